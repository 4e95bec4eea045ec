"""ablate on tiny random models: masked forwards against references, the stage's outputs."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pandas as pd
import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
import xarray as xr
from scipy import stats
from stores import Run, copy_store

from attngeom.ablate import parse_heads
from attngeom.ablate.kernels import (
    CRITICAL_RULE,
    correlation_table,
    critical_heads,
    critical_threshold,
    keep_mask,
    kept_per_layer,
    random_keys,
    robust_z,
    type_guided_keys,
)
from attngeom.ablate.masking import (
    head_geometry,
    head_weight_norms,
    masked_nll,
)
from attngeom.api import ablate
from attngeom.errors import AttngeomError
from attngeom.extract.models import load_model, resolve_model
from attngeom.store import open_dataset, open_root, open_run_group, zarr_store
from attngeom.store.session import StoreSession

REGIMES = np.array(
    [["Mixer", "Retriever", "Reset", "Mixer"], ["Reset", "Reset", "Mixer", "Retriever"], ["Mixer", "Reset", "Reset", "Mixer"]],
    dtype=object,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and two threads spinning beside other tests'
    workers make each small forward many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def open_group(store: str, name: str) -> xr.Dataset:
    """An ablation group of run "r", in memory. (Select methods with ``.sel({"method": m})``:
    ``.sel(method=m)`` is the nearest-neighbour option of ``sel``.)"""
    return open_dataset(StoreSession.reading(store).zstore, store, f"runs/r/ablation/{name}").load()


def load(folder) -> torch.nn.Module:
    return load_model(resolve_model(str(folder)), device="cpu", dtype=torch.float32)


def reference_nll(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NLL (S,) of token L-1 with the W_O columns of every masked head zeroed: no hooks."""
    geo = head_geometry(model)
    ablated = copy.deepcopy(model)
    with torch.no_grad():
        for layer, block in enumerate(ablated.get_decoder().layers):
            weight = block.self_attn.o_proj.weight
            weight.view(weight.shape[0], geo.n_heads, -1).mul_(mask[layer][None, :, None])
        logits = ablated(input_ids=tokens[:, :-1]).logits[:, -1]
    return -torch.log_softmax(logits, -1).gather(1, tokens[:, -1:].long())[:, 0]


@pytest.fixture(scope="module")
def store(extracted_store, tmp_path_factory) -> str:
    """A tiny llama run of 6 sequences (L = 16) with a stand-in analysis/heads holding regimes."""
    path = str(copy_store(extracted_store(Run(sequences=6)), tmp_path_factory.mktemp("ablate")))
    heads = xr.Dataset(
        {"regime": (("layer", "head"), REGIMES), "C": (("layer", "head"), np.arange(12.0).reshape(3, 4) ** 0.5)},
        coords={"layer": np.arange(3, dtype="int32"), "head": np.arange(4, dtype="int32")},
    )
    heads.to_zarr(zarr_store(path, read_only=False), group="runs/r/analysis/heads",
                  mode="w", consolidated=False, zarr_format=3)
    return path


@pytest.fixture(scope="module")
def result(store):
    return ablate(store, "r", device="cpu", protect=[(0, 1)], random_masks=10, progress=False)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_batched_masks_equal_per_mask_forwards_and_zeroed_weights(arch, tiny_model_dir):
    """ablate's model runs its own attention (no capture): Gemma 2's softcapped logits in eager."""
    model = load(tiny_model_dir(arch))
    assert model.config._attn_implementation == ("eager" if arch == "gemma2" else "sdpa")
    torch.manual_seed(0)
    tokens = torch.randint(4, 100, (3, 16))
    masks = (torch.rand(6, 3, 4) > 0.4).float()
    masks[0] = 1  # intact
    masks[1, :2] = 1  # first ablated layer 2: layers 0-1 shared across masks
    masks[1, 2, 1] = 0
    masks[2, 0] = 1
    batched = masked_nll(model, tokens, masks, batch_size=64)
    one_by_one = masked_nll(model, tokens, masks, batch_size=1)
    one_sequence = masked_nll(model, tokens, masks, batch_size=4)  # 4 masks of 1 sequence per forward
    torch.testing.assert_close(batched, one_by_one, rtol=0, atol=1e-5)
    torch.testing.assert_close(one_sequence, one_by_one, rtol=0, atol=1e-5)
    for m in range(len(masks)):
        torch.testing.assert_close(batched[:, m], reference_nll(model, tokens, masks[m]), rtol=0, atol=1e-5)


def test_gqa_masks_query_heads(tiny_model_dir):
    """4 query heads read 2 kv heads: a mask addresses query heads; heads 0 and 1 together are
    exactly kv head 0 (zeroing its W_V rows)."""
    model = load(tiny_model_dir("llama"))
    geo = head_geometry(model)
    assert (geo.layers, geo.n_heads, geo.n_kv_heads) == ((0, 1, 2), 4, 2)
    head_dim = 16
    torch.manual_seed(1)
    tokens = torch.randint(4, 100, (4, 16))
    masks = torch.ones(3, 3, 4)
    masks[0, 1, 0] = 0
    masks[1, 1, 1] = 0
    masks[2, 1, :2] = 0
    nll = masked_nll(model, tokens, masks)
    assert not torch.allclose(nll[:, 0], nll[:, 1])
    no_kv0 = copy.deepcopy(model)
    with torch.no_grad():
        no_kv0.get_decoder().layers[1].self_attn.v_proj.weight[:head_dim] = 0
        logits = no_kv0(input_ids=tokens[:, :-1]).logits[:, -1]
    expected = -torch.log_softmax(logits, -1).gather(1, tokens[:, -1:])[:, 0]
    torch.testing.assert_close(nll[:, 2], expected, rtol=0, atol=1e-5)
    wo, wv = head_weight_norms(model)
    v = model.get_decoder().layers[1].self_attn.v_proj.weight
    torch.testing.assert_close(wv[1], v.view(2, 16, -1).norm(dim=(1, 2)).repeat_interleave(2))
    o = model.get_decoder().layers[1].self_attn.o_proj.weight
    torch.testing.assert_close(wo[1, 3], o[:, 48:64].norm())


def test_single_head_delta_equals_unbatched_reference(store, result, tiny_model_dir):
    single = open_group(store, "single")
    assert list(single["seq"].values) == [0, 2, 4]
    model = load(tiny_model_dir("llama"))
    ds = xr.open_zarr(store, group="runs/r", consolidated=False)
    tokens = torch.from_numpy(ds["tokens"].values[[0, 2, 4]].astype("int64"))
    intact = reference_nll(model, tokens, torch.ones(3, 4))
    for layer, head in [(0, 0), (1, 3), (2, 2)]:
        mask = torch.ones(3, 4)
        mask[layer, head] = 0
        want = (reference_nll(model, tokens, mask) - intact).numpy()
        np.testing.assert_allclose(single["delta_nll"].values[layer, head], want, atol=2e-5)
        np.testing.assert_allclose(single["delta_nll_mean"].values[layer, head], want.mean(), atol=2e-5)
        np.testing.assert_allclose(single["delta_nll_median"].values[layer, head], np.median(want), atol=2e-5)
    rule = single.attrs["attngeom"]["critical_rule"]
    assert rule["rule"] == CRITICAL_RULE
    assert rule["threshold"] == critical_threshold(single["delta_nll_mean"].values, rule["k"], rule["floor"])


def test_sweep_shapes_and_full_retention_is_intact(store, result):
    sweep = open_group(store, "sweep")
    methods = ["type_guided", "single_impact", "weight_o", "weight_v", "entropy_low", "entropy_high",
               "sink_attention", "current_attention", "random"]
    assert list(sweep["method"].values) == methods
    assert list(sweep["retention"].values) == [1.0, 0.9, 0.75, 0.5, 0.25]
    assert sweep["delta_nll_mean"].dims == ("method", "retention")
    assert dict(sweep.sizes) == {"method": 9, "retention": 5, "draw": 10, "seq": 3, "layer": 3, "head": 4}
    assert list(sweep["seq"].values) == [1, 3, 5]  # the evaluation split, disjoint from importance
    full = sweep.sel(retention=1.0)
    assert (full["delta_nll_mean"].values == 0).all()
    assert (full["keep"].values[full["keep"].values >= 0] == 1).all()
    assert sweep["n_masks"].sel({"method": "random"}).item() == 10
    assert np.isfinite(sweep["delta_nll_std"].sel({"method": "random", "retention": 0.5}).item())
    assert np.isnan(sweep["delta_nll_std"].sel({"method": "weight_o"}).values).all()
    # 4 heads: round-half-up of f * 4 kept per layer, head (0, 1) protected on top of nothing.
    keep = sweep["keep"].sel({"method": "weight_o", "retention": 0.5}).isel(draw=0).values
    assert (keep.sum(axis=1) == kept_per_layer(0.5, 4)).all()
    table = result.table
    assert len(table) == 9 * 5 and set(table.columns) >= {"method", "retention", "delta_nll_mean", "delta_nll_std"}
    stored = open_dataset(StoreSession.reading(store).zstore, store, "runs/r/ablation/table")
    assert stored.sizes["row"] == 45
    attrs = sweep.attrs["attngeom"]
    assert attrs["importance_sequences"] == [0, 2, 4] and attrs["evaluation_sequences"] == [1, 3, 5]
    assert attrs["seed"] == 0 and attrs["random_masks"] == 10


def test_type_guided_orders_regimes_then_heads(store, result):
    impact = result.single["delta_nll_mean"].values
    protected = result.single["protected"].values
    regimes = open_group(store, "regimes")
    for label in ("Retriever", "Mixer", "Reset"):
        members = impact[REGIMES == label]
        assert regimes["mean"].sel(regime=label).item() == pytest.approx(members.mean())
        assert regimes["median"].sel(regime=label).item() == pytest.approx(np.median(members))
    want = keep_mask(type_guided_keys(REGIMES, impact, protected), 2, protected)
    got = result.sweep["keep"].sel({"method": "type_guided", "retention": 0.5}).isel(draw=0).values
    np.testing.assert_array_equal(got, want)
    # Within layer 2 (no protected head) the two kept heads come from the best regime first.
    means = {r: impact[(REGIMES == r) & ~protected].mean() for r in ("Retriever", "Mixer", "Reset")}
    order = sorted(range(4), key=lambda h: (-means[REGIMES[2, h]], -impact[2, h], h))
    assert set(np.flatnonzero(got[2])) == set(order[:2])


def test_protect_keeps_heads_in_every_mask(store, result):
    keep = result.sweep["keep"].values
    assert (keep[..., 0, 1][keep[..., 0, 1] >= 0] == 1).all()
    assert result.single["protected"].values[0, 1]
    # And the critical heads with protect_critical (a rule that flags the top half here).
    out = ablate(store, "r", device="cpu", protect_critical=True, critical_k=0.0, critical_floor=-1.0,
                 retention=(1.0, 0.25), random_masks=3, progress=False)
    critical = out.single["critical"].values
    assert critical.sum() >= 1
    assert out.critical.sizes["critical"] == critical.sum() == out.critical.attrs["critical_heads"]
    for layer, head in zip(out.critical["layer"].values, out.critical["head"].values):
        k = out.sweep["keep"].values[..., layer, head]
        assert (k[k >= 0] == 1).all()
    assert out.sweep.attrs["attngeom"]["protected"] == np.argwhere(critical).tolist()


def test_correlations_equal_scipy(store, result):
    corr = open_group(store, "correlations")
    single = result.single
    y = single["delta_nll_mean"].values.ravel()
    names = ["mean_last_attention", "mean_sink_attention", "mean_topN_attention_mass",
             "mean_attention_entropy", "mean_top1_attention", "C"]
    assert set(names) <= set(corr["diagnostic"].values)
    for name in names:
        x = single[name].values.ravel()
        row = corr.sel(diagnostic=name)
        s, p = stats.spearmanr(x, y), stats.pearsonr(x, y)
        np.testing.assert_allclose(
            [row[v].item() for v in ("spearman_r", "spearman_p", "pearson_r", "pearson_p")],
            [s.statistic, s.pvalue, p.statistic, p.pvalue], rtol=1e-10,
        )
    # The diagnostics themselves are means of the stored arrays over the importance split.
    ds = xr.open_zarr(store, group="runs/r", consolidated=False)
    attn = ds["attn_last"].values[[0, 2, 4]]
    np.testing.assert_allclose(single["mean_sink_attention"].values, attn[..., 0].mean(0), rtol=1e-6)
    np.testing.assert_allclose(single["mean_last_attention"].values, attn[..., -1].mean(0), rtol=1e-6)
    np.testing.assert_allclose(single["mean_topN_attention_mass"].values,
                               np.sort(attn, -1)[..., -8:].sum(-1).mean(0), rtol=1e-6)
    np.testing.assert_allclose(single["mean_attention_entropy"].values,
                               ds["entropy"].values[[0, 2, 4], ..., -1].mean(0), rtol=1e-6)


def test_correlation_table_kernel():
    rng = np.random.default_rng(0)
    y = rng.normal(size=20)
    x = y + rng.normal(size=20)
    x[3] = np.nan
    table = correlation_table(y, {"x": x, "flat": np.ones(20)})
    ok = np.isfinite(x)
    assert table["spearman_r"].sel(diagnostic="x").item() == pytest.approx(stats.spearmanr(x[ok], y[ok]).statistic)
    assert table["pearson_p"].sel(diagnostic="x").item() == pytest.approx(stats.pearsonr(x[ok], y[ok]).pvalue)
    assert table["n"].sel(diagnostic="x").item() == 19
    assert np.isnan(table["pearson_r"].sel(diagnostic="flat").item())


def test_critical_head_detection():
    rng = np.random.default_rng(0)
    impact = np.abs(rng.normal(0.0, 0.02, size=(28, 16)))
    impact[0, 12] = 79.78  # the paper's Gemma-7B head
    impact[5, 3] = 1.68  # large, but below the 2-nat floor
    critical = critical_heads(impact, k=5.0, floor=2.0)
    assert np.argwhere(critical).tolist() == [[0, 12]]
    assert robust_z(impact)[0, 12] > 1000
    assert critical_heads(impact, k=5.0, floor=1.0).sum() == 2
    flat = np.zeros((2, 3))
    flat[1, 2] = 3.0  # MAD = 0: any head above the median and the floor is an outlier
    assert np.argwhere(critical_heads(flat, k=5.0, floor=2.0)).tolist() == [[1, 2]]
    assert critical_threshold(flat, k=5.0, floor=2.0) == 2.0  # the floor, MAD being 0
    median = np.median(impact)
    brute = median + 5.0 * 1.4826 * np.median(np.abs(impact - median))
    assert critical_threshold(impact, k=5.0, floor=0.0) == pytest.approx(brute)


def test_keep_mask_ranking():
    scores = np.array([[0.3, 0.9, 0.1, 0.9], [np.nan, 0.2, 0.5, 0.4]])
    protected = np.array([[False, False, True, False], [True, True, True, False]])
    keep = keep_mask([scores], 2, protected)
    # Layer 0: protected head 2, then the best of the rest (0.9 twice: the smaller index).
    assert np.flatnonzero(keep[0]).tolist() == [1, 2]
    # Layer 1: three protected heads exceed k = 2; all are kept, nothing else.
    assert np.flatnonzero(keep[1]).tolist() == [0, 1, 2]
    assert np.flatnonzero(keep_mask([scores], 3, np.zeros_like(protected))[1]).tolist() == [1, 2, 3]
    assert kept_per_layer(0.25, 9) == 2 and kept_per_layer(0.5, 9) == 5 and kept_per_layer(0.9, 4) == 4
    draws = random_keys(3, 2, 4, seed=7)
    np.testing.assert_array_equal(draws, random_keys(3, 2, 4, seed=7))
    assert not np.array_equal(draws[0], draws[1])


def test_type_guided_skipped_without_regimes(extracted_store, tmp_path):
    path = str(copy_store(extracted_store(Run("mistral", run_id="q", length=12)), tmp_path))
    with pytest.warns(UserWarning, match="type-guided sparsification skipped"):
        out = ablate(path, "q", device="cpu", retention=(1.0, 0.5), random_masks=2, out=tmp_path / "tables",
                     progress=False)
    # The --out tables, written inside the command's store session, as the result holds them.
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["q.correlations.csv", "q.single.csv", "q.sweep.csv"]
    assert pd.read_csv(tmp_path / "tables" / "q.sweep.csv").shape[0] == out.table.shape[0]
    assert "type_guided" not in out.sweep["method"].values
    assert "type_guided" in out.skipped and out.regimes is None
    assert out.sweep.sizes["seq"] == 1 and out.single.sizes["seq"] == 2
    root = open_root(path)
    assert sorted(open_run_group(root, "q")["ablation"].group_keys()) == [
        "correlations", "critical", "single", "sweep", "table"]


def test_errors_and_parse_heads(store):
    assert parse_heads("0.12, 3.4") == [(0, 12), (3, 4)]
    with pytest.raises(AttngeomError, match="LAYER.HEAD"):
        parse_heads("0-12")
    with pytest.raises(AttngeomError, match="no run"):
        ablate(store, "nope", device="cpu")
    with pytest.raises(AttngeomError, match="^protect 9.0: the run has layers"):
        ablate(store, "r", device="cpu", protect=[(9, 0)])
    with pytest.raises(AttngeomError, match=r"^seed=3 seeds the random masks, and random_masks=0 asks for none: drop seed"):
        ablate(store, "r", device="cpu", seed=3, random_masks=0)
    with pytest.raises(AttngeomError, match=r"^max_sequences must be at least 2 \(an importance and an evaluation split\) \(got 1\)"):
        ablate(store, "r", device="cpu", max_sequences=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttngeomError, match="above 0 and at most 1"):
            ablate(store, "r", retention=(1.5,))


def test_every_sparsification_method_has_its_fixed_label_code():
    from attngeom.ablate.stage import RANKINGS
    from attngeom.store import LABEL_ORDERS, METHODS

    assert tuple(RANKINGS) == METHODS == LABEL_ORDERS["method"]
