"""The field's head scores (docs/method.md#the-fields-head-scores): extract's prev_attn and
recent_attn and analyze's sequence_scores and head_scores equal their definitions computed
from an eager float64 forward (Llama, Mistral with a sliding window shorter than L, Gemma 2
with softcapped logits and sliding layers, Qwen 2); the capture's band sums equal brute force
at any tile and mask; every score lies in [0, 1] and a query's sink, recent and distant mass
add to 1. A run migrated from format 4, which lacks them: tests/test_migrate.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attngeom as ag
from attngeom.analyze.kernels import SINK_THRESHOLD, distant_attn, head_scores, sequence_scores
from attngeom.api import analyze
from attngeom.store import RECENT_WINDOWS

torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")

from attngeom.extract.tiles import attention_summaries  # noqa: E402

# Long enough for distant_mass at W = 16 and 64 (queries i >= 2W); W = 256 has none (NaN).
L = 160
SEQUENCES = 2


def _config(arch: str):
    """conftest's tiny config of the family, with a sliding window (24) shorter than L but
    longer than the smallest recent window, and positions for L."""
    from conftest import tiny_config

    config = tiny_config(arch)
    config.max_position_embeddings = 512
    if getattr(config, "sliding_window", None):
        config.sliding_window = 24
    return config


def _brute(attentions: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """Every summary and score from the eager rows (layer -> (B, H, L, L) float64), by the
    definitions: loops over windows, masks from positions, means over all queries at once."""
    a = torch.stack(list(attentions), dim=1).double().numpy()  # (S, layer, H, L, L)
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    prev = np.zeros(a.shape[:-1])
    prev[..., 1:] = a[..., np.arange(1, L), np.arange(L - 1)]
    recent = np.stack([(a * ((j >= np.maximum(1, i - w + 1)) & (j <= i))).sum(-1) for w in RECENT_WINDOWS], -1)
    sink = a[..., 0]
    distant = []
    for r, w in enumerate(RECENT_WINDOWS):
        if 2 * w < L:
            distant.append((1 - sink[..., 2 * w :] - recent[..., 2 * w :, r]).mean(axis=(0, -1)))
        else:
            distant.append(np.full(sink.shape[1:3], np.nan))
    return {"prev_attn": prev, "recent_attn": recent, "sink_score": sink[..., 1:].mean(axis=(0, -1)),
            "prev_token_score": prev[..., 1:].mean(axis=(0, -1)), "distant_mass": np.stack(distant, -1)}


@pytest.mark.needs_model
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen2"])
def test_summaries_and_scores_equal_an_eager_float64_forward(arch, tmp_path):
    from conftest import extract, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from attngeom.extract.request import ExtractRequest

    torch.manual_seed(0)
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    ids = torch.randint(4, 100, (SEQUENCES, L), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 1
    url = str(tmp_path / "s.zarr")
    extract(ExtractRequest(model=str(folder), token_ids=ids.numpy(), store=url, run_id="r", progress=False))
    analyze(url, scheduler="threads", n_grid=[1, 4], progress=False)

    twin = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = twin.model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    want = _brute(attentions)
    run = ag.open_store(url).run("r")
    ds = run.dataset()
    if arch in ("mistral", "gemma2"):
        assert (ds["window"].values == 24).any()  # the sliding layers' windows are shorter than L
    assert ds["recent"].values.tolist() == list(RECENT_WINDOWS)
    np.testing.assert_allclose(ds["prev_attn"].values, want["prev_attn"], atol=2e-6, rtol=0)
    np.testing.assert_allclose(ds["recent_attn"].values, want["recent_attn"], atol=2e-6, rtol=0)
    scores = run.analysis("head_scores").load()
    for name in ("sink_score", "prev_token_score", "distant_mass"):
        np.testing.assert_allclose(scores[name].values, want[name], atol=1e-6, rtol=0, err_msg=name)
    assert np.isnan(scores["distant_mass"].sel(recent=256)).all()
    assert not np.isnan(scores["distant_mass"].sel(recent=[16, 64])).any()
    clear = np.abs(want["sink_score"] - SINK_THRESHOLD) > 1e-5
    np.testing.assert_array_equal(scores["sink_head"].values[clear], (want["sink_score"] > SINK_THRESHOLD)[clear])
    per_seq = run.analysis("sequence_scores").load()
    assert per_seq["seq"].values.tolist() == list(range(SEQUENCES))
    np.testing.assert_allclose(per_seq["sink_score"].mean("seq"), scores["sink_score"], atol=1e-15)


def _brute_window(row: torch.Tensor, query: int, window: int) -> float:
    return float(sum(row[j] for j in range(max(1, query - window + 1), query + 1)))


@pytest.mark.parametrize("tile", [(1, 1), (1, 4), (2, 3), (2, 23)])
@pytest.mark.parametrize("kind", ["causal", "sliding", "prefix"])
def test_prev_and_recent_match_brute_force_any_tile(tile, kind, row_passes):
    """Every tile (kv heads, queries) and mask, windows shorter and longer than the sliding
    one and than L: the capture's prev_attn and recent_attn equal sums over its own rows."""
    torch.manual_seed(3)
    bsz, n_heads, n_kv, length, dim = 2, 4, 2, 23, 5
    q, k, v = torch.randn(bsz, n_heads, length, dim) * 2, torch.randn(bsz, n_kv, length, dim), torch.randn(
        bsz, n_kv, length, dim)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = {"causal": j <= i, "sliding": (j <= i) & (i - j < 6), "prefix": (j <= i) | (j < 4)}[kind]
    mask = allowed[None, None].expand(bsz, 1, length, length)
    windows = (1, 3, 8, 40)
    cap, _ = attention_summaries(q, k, v, None if kind == "causal" else mask, 0.5, tile=tile, recent=windows,
                                 queries=tuple(range(length)))
    rows = cap.query_rows  # the float32 rows the summaries come from
    for b in range(bsz):
        for h in range(n_heads):
            for qi in range(length):
                row = rows[b, h, qi].double()
                assert abs(float(cap.prev_attn[b, h, qi]) - (float(row[qi - 1]) if qi else 0.0)) < 1e-6
                for r, w in enumerate(windows):
                    assert abs(float(cap.recent_attn[b, h, qi, r]) - _brute_window(row, qi, w)) < 1e-6, (qi, w)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(2, 70), window=st.one_of(st.none(), st.integers(1, 40)), scale=st.floats(0.1, 8.0),
       block=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_every_score_lies_in_0_1_and_a_query_mass_adds_to_1(length, window, scale, block, seed):
    """Random rows (any scale of scores: flat to one-hot), causal or a sliding window, any tile:
    each query's sink, recent and distant mass are in [0, 1] (up to float32 rounding) and add
    to 1, and so every sequence and head score lies in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 2, length, 4, generator=g) * scale, torch.randn(1, 1, length, 4, generator=g)
    v = torch.randn(1, 1, length, 4, generator=g)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = None if window is None else ((j <= i) & (i - j < window))[None, None]
    windows = (2, 5, 16)
    cap, _ = attention_summaries(q, k, v, mask, 1.0, tile=(1, block), recent=windows)
    sink, prev, recent = cap.sink_attn[0].numpy(), cap.prev_attn[0].numpy(), cap.recent_attn[0].numpy()
    distant = distant_attn(sink, recent)
    eps = 1e-6
    for x in (sink, prev, recent, distant):
        assert x.min() >= -eps and x.max() <= 1 + eps
    np.testing.assert_allclose(sink[..., None] + recent + distant, 1.0, atol=1e-12)
    # A_i,i-1 is in the last W >= 2 keys whenever i-1 is not the sink.
    assert (prev[..., 2:, None] <= recent[..., 2:, :] + eps).all()
    one = sequence_scores(sink[None], prev[None], recent[None], np.asarray(windows))
    scores, sink_head = head_scores(type(one)(*(x[None] for x in one)))
    for x in scores:
        finite = x[~np.isnan(x)]
        assert ((finite >= -eps) & (finite <= 1 + eps)).all()
    assert np.isnan(scores.distant_mass[..., [2 * w >= length for w in windows]]).all()
    np.testing.assert_array_equal(sink_head, scores.sink_score > SINK_THRESHOLD)
