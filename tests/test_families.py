"""Every verified family (tests/families.py): what extract stores equals the family's own eager
attention run in float64 on the same weights, rows, values and summaries; hybrids store their
softmax-attention layers under the model's own indices; learned sinks take the mass the rows
lack. Families the capture cannot reproduce are refused in one line before any weight loads."""

from __future__ import annotations

import sys

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
import xarray as xr
from families import CHECKED, FAMILIES, REFUSED_AT_FORWARD, checked_model, family_config, refused_model
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import attngeom as ag
from attngeom.errors import UnsupportedModelError
from attngeom.extract.capture import decoder
from attngeom.extract.families import VERIFIED_TYPES, attention_layers, supported_config
from attngeom.extract.own_code import FAMILIES as OWN_FAMILIES
from attngeom.extract.own_code import OWN_CODE_TYPES

pytestmark = pytest.mark.needs_model
L = 16


def eager64(model: torch.nn.Module, ids: torch.Tensor) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per attention layer, (rows (B, H, L, L), values (B, KV, L, Dv)) of the family's own eager
    attention on a float64 copy of ``model``: the modeling module's eager function, recorded
    (for a family that computes attention in its own code, that code's weights)."""
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    reference.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in model.state_dict().items()})
    if model.config.model_type in OWN_CODE_TYPES:
        return own_code64(reference, ids)
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    # The reference names each call by its place in the forward, not by the capture's reading
    # of the calls (a shared block's depth, a looped stack's run).
    layers = forward_order(model.config)

    def recording(module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        out, weights = eager(module, query, key, value, attention_mask, **kwargs)
        seen[layers[len(seen)]] = (weights.numpy(), value.numpy())
        return out, weights

    AttentionInterface.register("eager_recording", recording)
    AttentionMaskInterface.register("eager_recording", eager_mask)
    reference.set_attn_implementation("eager_recording")
    with torch.no_grad():
        decoder(reference)(input_ids=ids, use_cache=False)
    return seen


def forward_order(config) -> list[int]:
    """The model's attention layers in the order its forward runs them: as they are numbered,
    but in Dory, whose later loops (numbered after its declared layers) run before its output
    layers. Spelled out from the config, apart from extract's reading."""
    if config.model_type != "dory":
        return list(attention_layers(config))
    n, looped = config.num_hidden_layers, config.n_input_layers + config.n_recurrent_layers
    later = range(n, n + (config.n_recurrent_loops - 1) * config.n_recurrent_layers)
    return [*range(looped), *later, *range(looped, n)]


def own_code64(reference: torch.nn.Module, ids: torch.Tensor) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """eager64 of a float64 model whose attention modules compute their weights in their own
    code: each layer's weights, as its method returns them, and values (B, H, L, Dh), as its
    inner method is given them or its value projection computes them."""
    model_type = reference.config.model_type
    family = OWN_FAMILIES[model_type]
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    values: dict[int, np.ndarray] = {}
    modules = [m for name, m in reference.named_modules() if type(m).__name__ == family.attention
               and (family.name is None or name.endswith(f".{family.name}"))]
    for layer, module in enumerate(modules):
        if family.method != "forward":
            def recording(*args, module=module, layer=layer, **kwargs):
                result = getattr(type(module), family.method)(module, *args, **kwargs)
                weights, value = result[1], args[2]
                if model_type == "xlnet":  # laid out (L, L, B, H) and (L, B, H, D)
                    weights, value = weights.permute(2, 3, 0, 1), value.permute(1, 2, 0, 3)
                seen[layer] = (weights.numpy(), value.numpy())
                return result
            setattr(module, family.method, recording)
            continue
        module.register_forward_hook(lambda m, a, r, layer=layer: seen.__setitem__(layer, (r[1].numpy(), values[layer])))
        projection = getattr(module, VALUE_PROJECTIONS[model_type])
        heads = next(getattr(module, n) for n in ("n_heads", "num_heads", "num_attn_heads") if hasattr(module, n))
        projection.register_forward_hook(lambda m, a, r, layer=layer, heads=heads: values.__setitem__(
            layer, own_values(r, heads, model_type, ids.shape[1])))
    with torch.no_grad():
        decoder(reference)(input_ids=ids, use_cache=False, output_attentions=True)
    return seen


# The module of each own-code family's attention that projects its values.
VALUE_PROJECTIONS = {"bloom": "query_key_value", "mpt": "Wqkv", "xlm": "v_lin", "mvp": "v_proj",
                     "prophetnet": "value_proj"}


def own_values(projected: torch.Tensor, heads: int, model_type: str, length: int) -> np.ndarray:
    """Values (B, H, L, Dh) of the text's L tokens from a projection's output: BLOOM's fused
    qkv (B, L, 3 H Dh), interleaved per head; MPT's, in three blocks; the others' (B, L', H Dh),
    ProphetNet's L' holding its n-gram streams after the text."""
    bsz, width = projected.shape[0], projected.shape[-1]
    if model_type == "bloom":
        return projected.view(bsz, length, heads, 3, width // (3 * heads))[..., 2, :].transpose(1, 2).numpy()
    if model_type == "mpt":
        return projected.chunk(3, dim=2)[2].reshape(bsz, length, heads, -1).transpose(1, 2).numpy()
    return projected[:, :length].reshape(bsz, length, heads, -1).transpose(1, 2).numpy()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 100, (2, L), generator=generator)
    ids[:, 0] = 1
    return ids


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_store_equals_eager_float64(model_type, ids, tmp_path):
    config = family_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ag.extract(model, store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    ds = xr.open_zarr(str(tmp_path / "s.zarr"), group="runs/r", consolidated=False)
    reference = eager64(model, ids)
    # The model's own indices of its softmax-attention layers, no other.
    assert list(ds["layer"].values) == sorted(reference) == list(attention_layers(config))
    sinks = model_type in ("gpt_oss", "mimo_v2_flash")
    assert ("learned_sink_attn" in ds) == sinks
    n_kv, head_dim = ds.sizes["kv_head"], ds.sizes["head_dim"]
    for i, layer in enumerate(ds["layer"].values):
        rows, values = reference[int(layer)]
        group = rows.shape[1] // values.shape[1]
        # A layer narrower than the run's widest is stored with its kv heads repeated and its
        # value head padded with zeros (docs/store.md#layers-of-different-widths).
        wide = np.zeros((*values.shape[:1], n_kv, *values.shape[2:3], head_dim))
        wide[..., : values.shape[-1]] = np.repeat(values, n_kv // values.shape[1], axis=1)
        np.testing.assert_allclose(ds["values"].isel(layer=i).values, wide, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(ds["attn_last"].isel(layer=i).values, rows[:, :, -1], atol=1e-5)
        np.testing.assert_allclose(ds["sink_attn"].isel(layer=i).values, rows[..., 0], atol=1e-5)
        np.testing.assert_allclose(ds["top1_attn"].isel(layer=i).values, rows.max(-1), atol=1e-5)
        diagonal = np.diagonal(rows, axis1=2, axis2=3)
        np.testing.assert_allclose(ds["diag_attn"].isel(layer=i).values, diagonal, atol=1e-5)
        mass = rows.sum(-1)
        entropy = -(rows * np.log(np.where(rows > 0, rows, 1))).sum(-1)
        if sinks:
            learned = ds["learned_sink_attn"].isel(layer=i).values
            np.testing.assert_allclose(learned, 1 - mass, atol=1e-5)
            assert float(learned.min()) > 0 or model_type == "mimo_v2_flash"  # its full layers have none
            entropy -= np.where(mass < 1, (1 - mass) * np.log(np.where(mass < 1, 1 - mass, 1)), 0)
        else:
            np.testing.assert_allclose(mass, 1, atol=1e-6)  # eager softmaxes in float32
        np.testing.assert_allclose(ds["entropy"].isel(layer=i).values, entropy, atol=1e-4)
        score = rows * np.repeat(np.linalg.norm(values, axis=-1), group, axis=1)[:, :, None, :]
        winner = ds["winner"].isel(layer=i).values
        chosen = np.take_along_axis(score, winner[..., None].astype(np.int64), -1)[..., 0]
        np.testing.assert_allclose(chosen, score.max(-1), rtol=1e-5, atol=1e-9)
        # The last query's attendable keys are those the family's mask leaves it.
        np.testing.assert_array_equal(ds["attendable"].isel(layer=i).values, rows[0, 0, -1] > 0)


@pytest.mark.parametrize("model_type", sorted(CHECKED))
def test_families_read_through_the_conformance_check(model_type, ids, tmp_path):
    """Multimodal causal LMs' text stacks, learned sinks applied after the product, position
    biases and per-query sinks: the capture agrees with each family's own eager attention at
    every checked query (the check extract runs first), and the run holds the text stack's
    self-attention layers, whose rows and learned sinks sum to 1."""
    from attngeom.extract.conformance import check_capture, check_positions

    model = checked_model(model_type)
    checks = check_capture(model, ids[:1], check_positions(L))
    assert checks and all(c.agrees for c in checks), checks
    ag.extract(model, store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    ds = xr.open_zarr(str(tmp_path / "s.zarr"), group="runs/r", consolidated=False)
    config = model.config.get_text_config()
    assert list(ds["layer"].values) == list(attention_layers(config)) == [c.layer for c in checks]
    mass = ds["attn_last"].sum("key").values
    if "learned_sink_attn" in ds:
        sink = ds["learned_sink_attn"].isel(query=-1).values
        assert float(sink.min()) > 0
        mass = mass + sink
    np.testing.assert_allclose(mass, 1, atol=1e-5)


def test_sparse_attention_rows_weigh_the_selected_keys_only(tmp_path):
    """DeepSeek-V3.2: each row is a softmax over the 4 keys its indexer selected, zero at the
    others, while the attendable keys are the causal mask's (every key for the last query);
    the analysis reads such rows (docs/method.md#sparse-attention) and the store validates."""
    model = checked_model("deepseek_v32")
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 100, (3, 40), generator=generator)
    ids[:, 0] = 1
    store = str(tmp_path / "s.zarr")
    ag.extract(model, store=store, token_ids=ids, run_id="r", progress=False)
    ds = xr.open_zarr(store, group="runs/r", consolidated=False)
    rows = ds["attn_last"].values
    assert ((rows > 0).sum(-1) == 4).all()
    np.testing.assert_allclose(rows.sum(-1), 1, atol=1e-6)
    assert ds["attendable"].values.all() and (ds["window"].values == 0).all()
    ag.analyze(store, scheduler="threads", n_grid=[1, 2, 4, 8], progress=False)
    topn = ag.open_store(store).run("r").analysis("topn").load()
    assert np.isfinite(topn["precision"].values).all()
    assert (topn["k_sink_exact"].values >= topn["inversions"].values).all()
    assert ag.validate(store).valid


def test_rows_a_model_applies_after_its_sink():
    """Known answer: an eager attention that scales each row's output by c after the product
    (Granite-SWA's learned sink) applies c times its weights; one whose weights already carry
    the sink (c = 1) applies them as they are."""
    from attngeom.extract.conformance import applied_rows

    generator = torch.Generator().manual_seed(0)
    weights = torch.softmax(torch.randn(2, 4, 3, 7, generator=generator, dtype=torch.float64), -1)
    value = torch.randn(2, 2, 7, 5, generator=generator, dtype=torch.float64)
    scale = torch.rand(2, 4, 3, generator=generator, dtype=torch.float64)
    output = (scale[..., None] * (weights @ value.repeat_interleave(2, dim=1))).transpose(1, 2)
    torch.testing.assert_close(applied_rows(weights, output, value), weights * scale[..., None])
    plain = (weights @ value.repeat_interleave(2, dim=1)).transpose(1, 2)
    torch.testing.assert_close(applied_rows(weights, plain, value), weights)


def test_layers_of_different_widths_are_stored_as_their_heads_read_them():
    """Known answers: a layer of 2 kv heads among layers of 4, with a narrower value head, is
    stored so that head h (of 8) finds in slot h // 2 the values it read from kv head h // 4,
    zeros after them; kv heads that do not divide the widest count, and layers of different
    query heads, are refused."""
    from attngeom.extract.layer_widths import layer_shapes, widened

    narrow = torch.arange(12, dtype=torch.float32).view(1, 2, 3, 2)  # (B, KV, L, Dv)
    wide = torch.ones(1, 4, 3, 3)
    assert layer_shapes({0: narrow, 1: wide}, {0: 8, 1: 8}) == (4, 3, (2, 4), (2, 3))
    assert layer_shapes({0: wide, 1: wide}, {0: 8, 1: 8}) == (4, 3, (), ())
    stored = widened(narrow[0], 4, 3)
    for head in range(8):
        torch.testing.assert_close(stored[head // 2, :, :2], narrow[0, head // 4])
        assert (stored[head // 2, :, 2:] == 0).all()
    full = wide[0]
    assert widened(full, 4, 3) is full  # a layer of the run's own width is stored as it is
    with pytest.raises(UnsupportedModelError, match="do not divide"):
        layer_shapes({0: torch.ones(1, 3, 3, 3), 1: wide}, {0: 12, 1: 12})
    with pytest.raises(UnsupportedModelError, match="different numbers of query heads"):
        layer_shapes({0: wide, 1: wide}, {0: 8, 1: 4})


def test_windows_chunks_and_sinks_are_what_the_families_declare(ids, tmp_path):
    """Known answers: Mistral's window of 6, Llama 4's chunks of 6 (the last query, at 15,
    sees keys 12..15) beside its full layer, gpt-oss's sliding layers, GPT-Neo's local layers
    (a window its own code holds in a buffer)."""
    expected = {"mistral": [6, 6, 6], "llama4_text": [4, 4, 0], "gpt_oss": [6, 0, 6], "cohere2": [6, 6, 0],
                "gpt_neo": [0, 6, 6]}
    for model_type, windows in expected.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32).eval()
        ag.extract(model, store=tmp_path / f"{model_type}.zarr", token_ids=ids, run_id="r", progress=False)
        ds = xr.open_zarr(str(tmp_path / f"{model_type}.zarr"), group="runs/r", consolidated=False)
        assert list(ds["window"].values) == windows, model_type


def own_code_model(model_type: str) -> torch.nn.Module:
    """A tiny random float32 model of a family that computes attention in its own code."""
    if model_type in CHECKED:
        return checked_model(model_type)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", sorted(OWN_CODE_TYPES))
def test_own_code_families_agree_with_their_own_code_on_peaked_rows(model_type, ids):
    """With weights scaled so that rows are peaked, the capture of a family that computes
    attention in its own code agrees with that code at every checked query, and after the
    capture the model runs its own methods again: the same logits, bit for bit."""
    from attngeom.extract.conformance import check_capture, check_positions

    model = own_code_model(model_type)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3)
        before = model(ids, output_attentions=True)
    # Peaked: the top keys take twice the mass they would in uniform causal rows.
    uniform = float((1 / torch.arange(1, L + 1)).mean())
    assert float(torch.stack(before.attentions).amax(-1).mean()) > 2 * uniform
    checks = check_capture(model, ids[:1], check_positions(L))
    assert [c.layer for c in checks] == [0, 1, 2] and all(c.agrees for c in checks), checks
    assert not [m for m in model.modules() if "_attn" in vars(m) or "forward" in vars(m)]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before.logits)


def test_every_verified_type_is_tested():
    assert set(FAMILIES) == set(VERIFIED_TYPES)


@pytest.mark.parametrize("model_type, reason, arguments", [
    ("diffllama", "differential attention", {}),
    ("rwkv", "linear recurrence", {}),
    ("mamba", "no softmax-attention layer", {}),
    ("blt", r"its layers sit in 4 stacks \(patcher_config, encoder_config, decoder_config, global_config\)", {}),
    ("xlnet", r"with attn_type = 'bi': its attention is not causal \(only attn_type = 'uni' is\)", {}),
    ("xlm", r"with causal = False: its attention is not causal", {}),
    ("cpmant", "marks every token as context, so each layer's softmax attends every key", {}),
    ("reformer", "mix the softmaxes of several hashing rounds", dict(is_decoder=True)),
    ("mvp", r"a decoder of 2 layers and 16 heads beside an encoder of 12 and 16", dict(decoder_layers=2)),
    ("prophetnet", r"a decoder of 12 layers and 4 heads beside an encoder of 12 and 16",
     dict(num_decoder_attention_heads=4)),
])
def test_refused_from_the_config_before_weights(model_type, reason, arguments):
    """Families whose attention is no one causal softmax over the text's keys as configured
    (own code included), and encoder-decoder configs whose counts are not their decoder's."""
    config = AutoConfig.for_model(model_type, **arguments)
    with pytest.raises(UnsupportedModelError, match=reason):
        supported_config(config)


def test_a_layer_that_calls_attention_twice_is_refused(ids, tmp_path, monkeypatch):
    """Differential attention calls the attention function twice per layer. Without the
    config's refusal, the forward refuses it in one line, and no store is left behind."""
    from attngeom.extract import families

    monkeypatch.setattr(families, "NOT_SOFTMAX", {})
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "bos_token_id")
    config = AutoConfig.for_model("diffllama", **{k: getattr(family_config("llama"), k) for k in sizes})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(UnsupportedModelError, match="twice in one run of its attention"):
        ag.extract(model, store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    assert not (tmp_path / "s.zarr").exists()


def test_a_looped_stack_is_found_again_from_its_files(tmp_path):
    """The model's files name the layers its run stores: Dory's config.json, which lists each
    layer as an attention and an mlp block (as its released checkpoints do), declares its 3
    layers and the one its second loop adds; HRM's, every run of its stacks' layers."""
    import json

    from attngeom.extract.runcheck import layer_differences, model_shapes

    for model_type, layers in (("dory", [0, 1, 2, 3]), ("hrm_text", list(range(12)))):
        family_config(model_type).save_pretrained(tmp_path / model_type)
        shapes = model_shapes(json.loads((tmp_path / model_type / "config.json").read_text()))
        assert layer_differences(shapes, {"layers": layers}) == [], model_type
        assert layer_differences(shapes, {"layers": layers[:-1]}), model_type


def test_a_looped_layer_without_a_layer_for_each_run_is_refused(ids, tmp_path, monkeypatch):
    """A looped layer whose runs the model names no layer of their own: Dory read without its
    loops' offsets (each run then names its module's layer) is refused at the forward in one
    line, no store left behind; in its 'last_loop' cache mode, whose loops before the last
    share one cache layer, it is refused from the config."""
    from attngeom.extract import call_layers

    monkeypatch.setattr(call_layers, "OFFSET_ARGUMENTS", ("cycle_offset",))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("dory"), dtype=torch.float32).eval()
    with pytest.raises(UnsupportedModelError, match=r"layer 1 runs its attention 2 times in one forward \(a looped "
                                                    r"layer\) and the model names no layer of its own for each run"):
        ag.extract(model, store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    assert not (tmp_path / "s.zarr").exists()
    config = AutoConfig.for_model("dory", recurrent_kv_cache_mode="last_loop", n_recurrent_loops=3)
    with pytest.raises(UnsupportedModelError, match="loops before the last share one cache layer"):
        supported_config(config)


@pytest.mark.parametrize("model_type", sorted(REFUSED_AT_FORWARD))
def test_refused_at_the_first_forward_with_their_reason(model_type, ids, tmp_path):
    """A looped layer its config counts once (Dory) and keys beyond the text's tokens
    (DeepSeek-V4's compressed entries) are refused in one line saying so, and no store is
    left behind."""
    with pytest.raises(UnsupportedModelError, match=REFUSED_AT_FORWARD[model_type][0]):
        ag.extract(refused_model(model_type), store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    assert not (tmp_path / "s.zarr").exists()


def test_an_unverified_family_is_checked_against_its_eager_attention(ids, tmp_path, monkeypatch, capsys):
    """A family outside the verified list is compared with its eager attention first: it
    agrees (a Llama taken for unverified), or the run is refused with the size of the
    difference (the same model whose capture is made to scale its scores wrongly)."""
    from attngeom.extract import attention_hook, writing

    monkeypatch.setattr(writing, "VERIFIED_TYPES", frozenset())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama"), dtype=torch.float32).eval()
    ag.extract(model, store=tmp_path / "ok.zarr", token_ids=ids, run_id="r")
    assert "checking the capture of model type 'llama' against its eager attention" in capsys.readouterr().err
    summaries = attention_hook.attention_summaries
    monkeypatch.setattr(attention_hook, "attention_summaries",
                        lambda q, k, v, mask, scaling, **kw: summaries(q, k, v, mask, scaling * 1.5, **kw))
    with pytest.raises(UnsupportedModelError, match=r"disagrees with its own eager attention in 3 of 3 layers: "
                                                    r"layer 0 \(attention\) rows differ by"):
        ag.extract(model, store=tmp_path / "bad.zarr", token_ids=ids, run_id="r", progress=False)
    assert not (tmp_path / "bad.zarr").exists()


def three_masks(model, geo):
    """Two sequences of random tokens, three head masks (none; head 0 of the last layer; heads
    1 and 2 of the first) and ablate's masked NLL of each, which both masks change."""
    from attngeom.ablate.masking import masked_nll

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 100, (2, L), generator=generator)
    masks = torch.ones(3, geo.n_layers, geo.n_heads)
    masks[1, -1, 0] = 0
    masks[2, 0, 1:3] = 0
    nll = masked_nll(model, tokens, masks)
    assert not torch.allclose(nll[:, 0], nll[:, 1]) and not torch.allclose(nll[:, 0], nll[:, 2])
    return tokens, masks, nll


@pytest.mark.parametrize("model_type", ["qwen3_next", "deepseek_v3", "gpt_oss", "gpt2"])
def test_ablating_a_head_zeroes_its_attention_output(model_type):
    """A head's ablation removes its output sum_j A_ij v_j before the output projection, the
    same for grouped queries, latent attention, learned sinks and a hybrid (whose masks cover
    its softmax-attention layers only): the batched masks equal a forward whose attention
    function zeroes that head itself."""
    from attngeom.ablate.masking import head_geometry

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32).eval()
    geo = head_geometry(model)
    assert geo.layers == attention_layers(model.config)
    tokens, masks, nll = three_masks(model, geo)
    previous = model.config._attn_implementation
    for m in range(3):
        def zeroing(module, query, key, value, attention_mask, m=m, **kwargs):
            eager = sys.modules[type(module).__module__].eager_attention_forward
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            run = eager if previous == "eager" else ALL_ATTENTION_FUNCTIONS[previous]
            out, weights = run(module, query, key, value, attention_mask, **kwargs)
            keep = masks[m, geo.layers.index(module.layer_idx)]
            return out * keep[None, None, :, None], weights

        AttentionInterface.register("zeroing", zeroing)
        AttentionMaskInterface.register("zeroing", eager_mask if previous == "eager" else sdpa_mask)
        model.set_attn_implementation("zeroing")
        with torch.no_grad():
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, -1]
        model.set_attn_implementation(previous)
        expected = -torch.log_softmax(logits, -1).gather(1, tokens[:, -1:])[:, 0]
        torch.testing.assert_close(nll[:, m], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(t for t in OWN_CODE_TYPES if OWN_FAMILIES[t].ablation is None))
def test_ablating_a_head_of_an_own_code_family(model_type):
    """In a family that computes attention in its own code, the batched masks equal the
    model's own forward with that head's output zeroed at the input of its output projection
    (XLM's and XLNet's sequences run whole once per mask)."""
    from attngeom.ablate.masking import head_geometry

    model = own_code_model(model_type)
    geo = head_geometry(model)
    tokens, masks, nll = three_masks(model, geo)
    name = {"openai-gpt": "c_proj", "bloom": "dense", "gpt_neox_japanese": "dense", "xlm": "out_lin"}.get(
        model_type, "out_proj")
    family = OWN_FAMILIES[model_type]
    modules = dict(model.named_modules())
    paths = [path for path, m in modules.items() if type(m).__name__ == family.attention
             and (family.name is None or path.endswith(f".{family.name}"))]
    if family.name == "attention.self":  # a BERT-like self-attention's heads are projected by its sibling
        projections = [modules[path.removesuffix(".self") + ".output.dense"] for path in paths]
    elif model_type == "reformer":  # as a ReformerAttention's
        projections = [modules[path.removesuffix(".self_attention") + ".output.dense"] for path in paths]
    elif model_type != "xlnet":
        projections = [getattr(modules[path], name) for path in paths]
    for m in range(3):
        def zeroing(module, args, keep):
            context = args[0]
            heads = context.view(*context.shape[:2], geo.n_heads, -1) * keep[None, None, :, None]
            return (heads.view(context.shape),)

        if model_type == "xlnet":  # its heads (L, B, H, D) meet its output weights in post_attention
            for i, path in enumerate(paths):
                attention = modules[path]
                attention.post_attention = lambda h, vector, residual=True, a=attention, keep=masks[m, i]: type(
                    a).post_attention(a, h, vector * keep[None, None, :, None], residual)
            hooks = []
        else:
            hooks = [p.register_forward_pre_hook(lambda module, args, keep=masks[m, i]: zeroing(module, args, keep))
                     for i, p in enumerate(projections)]
        with torch.no_grad():
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, -1]
        for hook in hooks:
            hook.remove()
        for path in paths:
            vars(modules[path]).pop("post_attention", None)
        expected = -torch.log_softmax(logits, -1).gather(1, tokens[:, -1:])[:, 0]
        torch.testing.assert_close(nll[:, m], expected, rtol=0, atol=1e-5)


def test_ablate_refuses_the_heads_of_prophetnet():
    """ProphetNet's next token comes from its first n-gram stream, whose attention the capture
    does not store: ablate refuses in one line rather than zero a head in one stream only."""
    from attngeom.ablate.masking import head_geometry, masked_nll

    model = own_code_model("prophetnet")
    geo = head_geometry(model)
    with pytest.raises(UnsupportedModelError, match="predicts the next token from its first n-gram stream"):
        masked_nll(model, torch.ones(1, L, dtype=torch.long), torch.ones(1, geo.n_layers, geo.n_heads))


@pytest.mark.parametrize("model_type", ["zamba", "zamba2", "hrm_text", "dory"])
def test_ablating_a_head_at_one_call_of_a_module_called_at_several_layers(model_type):
    """A block shared by several depths (Zamba, Zamba 2) and a module of a looped stack (HRM,
    Dory: run at several of its layers) are ablated at the layer a mask names only. With head
    0 masked at the layer of the forward's middle call (in a looped stack, of a module that
    ran before), every call before it gives its output (before the output projection and any
    norm) what it gives unmasked, and that call the same but head 0's zeros; the batched masks
    equal a forward that zeroes the head in the call of the layer named, the calls named by
    their place in the forward (:func:`forward_order`)."""
    from attngeom.ablate.masking import HeadMasker, head_geometry

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32).eval()
    with torch.no_grad():  # the attention's part in the loss, tiny in a random Zamba, made visible
        for name, parameter in model.named_parameters():
            if ".shared_transf" in name or ".linear." in name:
                parameter.mul_(3)
    geo = head_geometry(model)
    order = forward_order(model.config)
    assert sorted(order) == list(geo.layers)
    modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if model_type in ("hrm_text", "dory"):
        assert len(modules) < geo.n_layers  # HRM's 4 modules run at 12 layers, Dory's 3 at 4
    tokens, masks, nll = three_masks(model, geo)
    middle = geo.n_layers // 2
    named = geo.layers.index(order[middle])

    def outputs(masker_masks=None):
        inputs: list[torch.Tensor] = []
        # Dory normalises all heads' outputs together before its projection: its norm's input.
        hooks = [getattr(m, "attn_sub_norm", m.o_proj).register_forward_pre_hook(
            lambda _, args: inputs.append(args[0])) for m in modules]
        with torch.no_grad(), HeadMasker(model) as masker:
            masker.set(masker_masks)
            model(input_ids=tokens[:, :-1], use_cache=False)
        for hook in hooks:
            hook.remove()
        return [x.view(*x.shape[:2], geo.n_heads, -1) for x in inputs]

    one = torch.ones(len(tokens), geo.n_layers, geo.n_heads)
    one[:, named, 0] = 0
    plain, masked = outputs(), outputs(one)
    assert len(plain) == len(masked) == geo.n_layers
    for k in range(middle):
        torch.testing.assert_close(masked[k], plain[k], rtol=0, atol=0)
    assert (masked[middle][:, :, 0] == 0).all() and (plain[middle][:, :, 0] != 0).any()
    torch.testing.assert_close(masked[middle][:, :, 1:], plain[middle][:, :, 1:], rtol=0, atol=0)
    previous = model.config._attn_implementation
    for m in range(3):
        calls = []

        def zeroing(module, query, key, value, attention_mask, m=m, **kwargs):
            out, weights = ALL_ATTENTION_FUNCTIONS[previous](module, query, key, value, attention_mask, **kwargs)
            calls.append(module)
            keep = masks[m, geo.layers.index(order[len(calls) - 1])]
            return out * keep[None, None, :, None], weights

        AttentionInterface.register("zeroing", zeroing)
        AttentionMaskInterface.register("zeroing", sdpa_mask)
        model.set_attn_implementation("zeroing")
        with torch.no_grad():
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, -1]
        model.set_attn_implementation(previous)
        assert len(calls) == geo.n_layers
        # A looped stack's middle call runs a module that ran before; a shared block's, a module of its own.
        assert (calls[middle] in calls[:middle]) == (model_type in ("hrm_text", "dory"))
        expected = -torch.log_softmax(logits, -1).gather(1, tokens[:, -1:])[:, 0]
        torch.testing.assert_close(nll[:, m], expected, rtol=0, atol=1e-5)


def analyzed(model_type: str, folder) -> tuple[torch.nn.Module, str]:
    """A tiny model of the family, and a store of 3 of its sequences (L = 40) extracted and
    analyzed (N in 1, 2, 4) in ``folder``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 100, (3, 40), generator=generator)
    ids[:, 0] = 1
    store = str(folder / "s.zarr")
    ag.extract(model, store=store, token_ids=ids, run_id="r", progress=False)
    ag.analyze(store, scheduler="threads", n_grid=[1, 2, 4], progress=False)
    return model, store


@pytest.mark.parametrize("model_type, layers", [("qwen3_next", [1, 3]), ("zamba2", [1, 3]),
                                                ("hrm_text", list(range(12))), ("dory", [0, 1, 2, 3])])
def test_every_stage_on_a_hybrid_keeps_its_layer_indices(model_type, layers, tmp_path):
    """A Qwen3-Next of 4 layers (linear, softmax, linear, softmax), a Zamba 2 whose shared
    block runs at its hybrid layers 1 and 3, an HRM whose 4 modules run at its 12 layers and a
    Dory whose second loop is its layer 3, through every stage: the run, its analysis, detect
    and ablation groups all name the model's layers."""
    from conftest import tiny_tokenizer

    model, store = analyzed(model_type, tmp_path)
    ag.detect(store, "r", model=model, tokenizer=tiny_tokenizer(), probes=2, progress=False)
    ag.ablate(store, "r", model=model, device="cpu", random_masks=1, retention=[1.0, 0.5], progress=False)
    run = ag.open_store(store).run("r")
    assert run.provenance["layout"]["layers"] == layers
    for group in (run.dataset(), run.analysis("heads"), run.analysis("topn"), run.detect(), run.ablation("single")):
        assert list(group["layer"].values) == layers
    assert (run.analysis("topn")["learned_sink_selected"].values == -1).all()  # no learned sinks
    assert ag.validate(store).valid
    ag.report(store, tmp_path / "report")
    ag.explore(store, tmp_path / "explore")


def test_head_scores_of_a_model_with_learned_sinks(tmp_path):
    """gpt-oss: learned_sink_score is the mean weight of the learned sink over queries i >= 1,
    and the distant mass leaves it out, as it leaves out key 0 (brute force from the stored
    summaries)."""
    model, store = analyzed("gpt_oss", tmp_path)
    run = ag.open_store(store).run("r")
    scores, ds = run.analysis("head_scores").load(), run.dataset().load()
    learned, sink = ds["learned_sink_attn"].values, ds["sink_attn"].values
    np.testing.assert_allclose(scores["learned_sink_score"].values, learned[..., 1:].mean(axis=(0, -1)), atol=1e-7)
    distant = 1 - learned - sink - ds["recent_attn"].sel(recent=16).values
    np.testing.assert_allclose(scores["distant_mass"].sel(recent=16).values, distant[..., 32:].mean(axis=(0, -1)),
                               atol=1e-7)


def test_top_n_geometry_of_a_model_with_learned_sinks(tmp_path):
    """gpt-oss: the analysis reads the learned sink as a virtual key with a zero value: topn
    is the kernels' on the stored rows with the final query's sink weight, and at N = 1 the
    learned sink is selected exactly where it outweighs key 0 (ties to key 0) and every
    other key; the report draws both sinks' selection rates."""
    from attngeom.analyze.kernels import head_metrics
    from attngeom.analyze.parameters import RANDOM_DRAWS, instance_seed

    _, store = analyzed("gpt_oss", tmp_path)
    run = ag.open_store(store).run("r")
    ds, topn = run.dataset().load(), run.analysis("topn").load()
    seed = topn.attrs["attngeom"]["seed"]
    for seq in range(ds.sizes["seq"]):
        for li, layer in enumerate(ds["layer"].values):
            at = dict(seq=seq, layer=li)
            attn, sink = ds["attn_last"].isel(at).values, ds["learned_sink_attn"].isel(at).values[:, -1]
            want, _ = head_metrics(attn, ds["values"].isel(at).values, np.broadcast_to(
                ds["attendable"].isel(layer=li).values, ds["values"].isel(at).shape[:2]), [1, 2, 4],
                head_kv=ds["head_kv"].values, learned_sink=sink, seed=instance_seed(seed, seq, li),
                random_draws=RANDOM_DRAWS)
            for name in ("precision", "recall", "k_sink_exact", "learned_sink_selected", "sink_selected"):
                np.testing.assert_array_equal(topn[name].isel(at).values, want[name], err_msg=name)
            first = sink > attn[:, 0]
            first &= sink >= attn[:, 1:].max(axis=1)
            np.testing.assert_array_equal(topn["learned_sink_selected"].isel(at).isel(n=0).values, first)
    assert ag.validate(store).valid
    ag.report(store, tmp_path / "report")
    assert list((tmp_path / "report").rglob("learned_sink_selection_rate*.png"))


def test_the_models_page_gives_every_family_its_verdict():
    """docs/models.md#every-family (written by tools/family_sweep.py) has one row per causal-LM
    family of the installed transformers, and the families the tests read have the verdict
    the tests give them."""
    import re
    from pathlib import Path

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    page = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    section = page.split("\n## Every family\n")[1].split("\n## ")[0]
    verdicts = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", section, re.MULTILINE))
    assert sorted(verdicts) == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert {t: verdicts[t] for t in (*FAMILIES, *CHECKED) if verdicts[t] != "captured"} == {}
    assert {t: verdicts[t] for t in REFUSED_AT_FORWARD if verdicts[t] != "refused"} == {}



def test_the_own_code_families_judged_from_the_config_are_those_the_capture_adapts():
    from attngeom.extract.families import OWN_CODE_TYPES
    from attngeom.extract.own_code import FAMILIES

    assert set(FAMILIES) == OWN_CODE_TYPES


def test_counts_per_layer_pass_the_config_check(tmp_path):
    """A heterogeneous config (Gemma 4's wider global layers), whose per-layer counts refuse a
    global read, and a count per layer (Gemma 3n's intermediate sizes) pass the config's size
    check; a per-layer list holding no count is refused."""
    from attngeom.errors import InputError
    from attngeom.extract.model_files import check_config_sizes

    gemma4 = AutoConfig.for_model("gemma4_text")
    assert "head_dim" in gemma4.per_layer_attributes
    check_config_sizes(gemma4, "gemma4", tmp_path)
    check_config_sizes(AutoConfig.for_model("gemma3n_text"), "gemma3n", tmp_path)
    with pytest.raises(InputError, match=r"declares intermediate_size = \[96, -1\], which is no count"):
        check_config_sizes({"num_hidden_layers": 2, "intermediate_size": [96, -1]}, "m", tmp_path)


@pytest.mark.parametrize("model_type", ["bert", "megatron-bert"])
def test_a_bert_built_without_is_decoder_is_refused_as_not_causal(model_type, ids, tmp_path):
    """A BERT-like causal-LM class is causal as a decoder only: built without is_decoder, its
    attention (through the interface or its own code) attends every key, and the run is
    refused saying so rather than stored as causal rows."""
    from families import COMMON

    config = AutoConfig.for_model(model_type, **COMMON)
    assert not config.is_decoder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(UnsupportedModelError, match="is not causal"):
        ag.extract(model, store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    assert not (tmp_path / "s.zarr").exists()


def test_reformer_local_chunks_and_their_refusals(ids, tmp_path):
    """Reformer's local layers attend their chunk and the one before it (of 4 chunks of 4, the
    last query keys 8 to 15), as the model's own code does; chunks before that reach a chunk
    twice round the text (2 before, of 2 chunks) and an L its model would pad are refused."""
    from families import CHECKED, COMMON

    def reformer(**arguments):
        config = AutoConfig.for_model("reformer", **{k: v for k, v in {**COMMON, **CHECKED["reformer"][1],
                                                                        **arguments}.items() if v is not None})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    model = reformer()
    ag.extract(model, store=tmp_path / "s.zarr", token_ids=ids, run_id="r", progress=False)
    ds = xr.open_zarr(str(tmp_path / "s.zarr"), group="runs/r", consolidated=False)
    assert np.flatnonzero(ds["attendable"].isel(layer=0).values).tolist() == list(range(8, 16))
    assert (ds["attn_last"].isel(key=slice(0, 8)).values == 0).all()
    with pytest.raises(UnsupportedModelError, match="reaches some chunks twice"):
        ag.extract(reformer(local_num_chunks_before=2), store=tmp_path / "t.zarr", token_ids=ids[:, :8],
                   run_id="r", progress=False)
    with pytest.raises(UnsupportedModelError, match="pads a text of L = 15 tokens to a multiple of its chunk length"):
        ag.extract(model, store=tmp_path / "u.zarr", token_ids=ids[:, :15], run_id="r", progress=False)
