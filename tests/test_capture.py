"""The capture path equals eager attention with output_attentions=True (float32, 1e-5), and
what it records is scoped to the ``capturing`` block of one model in one thread."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
from transformers import AutoModelForCausalLM

from attngeom.extract.attention_hook import ATTN_IMPLEMENTATION, output_description
from attngeom.extract.capture import capturing
from attngeom.extract.recorder import Recorder
from attngeom.extract.tiles import attention_summaries
from attngeom.extract.models import ModelSource, load_model

L = 16  # longer than the sliding window (6) of the Mistral and Gemma 3 fixtures


def eager_reference(folder, ids):
    """Eager attention rows (B, H, L, L) per layer and the value states from v_proj hooks."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    values = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(mod, inp, out, i=i, attn=attn):
            bsz, length, _ = out.shape
            values[i] = out.view(bsz, length, -1, attn.head_dim).transpose(1, 2)

        hooks.append(attn.v_proj.register_forward_hook(hook))
    with torch.no_grad():
        out = model.model(input_ids=ids, output_attentions=True, use_cache=False)
    for h in hooks:
        h.remove()
    return out.attentions, values, out.last_hidden_state


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma", "gemma2", "gemma3", "qwen2"])
def test_capture_equals_eager(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    ids = torch.randint(4, 100, (2, L))
    ids[:, 0] = 1
    rows, values, hidden_eager = eager_reference(folder, ids)
    model = load_model(ModelSource(str(folder), str(folder)), device="cpu", dtype=torch.float32)
    with torch.no_grad(), capturing(model, keep_rows=True) as rec:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(hidden, hidden_eager, atol=1e-5, rtol=1e-5)
    n_heads = model.config.num_attention_heads
    group = n_heads // model.config.num_key_value_heads
    query = torch.arange(L)
    for layer, cap in rec.layers.items():
        a = rows[layer]
        v = values[layer]
        torch.testing.assert_close(cap.values, v, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(cap.attn_last, a[:, :, -1, :], atol=1e-5, rtol=0)
        torch.testing.assert_close(cap.rows.float(), a, atol=1e-3, rtol=0)
        torch.testing.assert_close(cap.sink_attn, a[..., 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(cap.diag_attn, a[..., query, query], atol=1e-5, rtol=0)
        torch.testing.assert_close(cap.top1_attn, a.amax(-1), atol=1e-5, rtol=0)
        entropy = -torch.special.xlogy(a, a).sum(-1)
        torch.testing.assert_close(cap.entropy, entropy, atol=1e-5, rtol=0)
        v_norm = v.norm(dim=-1).repeat_interleave(group, dim=1)  # head h reads kv head h // group
        score = a * v_norm[:, :, None, :]
        expected = score.argmax(-1)
        # Equal up to exact near-ties between eager's and our float32 rounding.
        agree = (cap.winner == expected) | torch.isclose(
            score.gather(-1, cap.winner[..., None])[..., 0], score.amax(-1), rtol=1e-6
        )
        assert bool(agree.all())
        assert bool((cap.winner <= query).all())
        types = getattr(model.config, "layer_types", None)
        slides = types is None or types[layer] == "sliding_attention"
        window = getattr(model.config, "sliding_window", None) if slides else None
        masked = torch.arange(L) <= (L - 1 - window) if window else torch.zeros(L, dtype=torch.bool)
        assert torch.equal(cap.attendable, ~masked)
        assert bool((cap.attn_last[..., masked] == 0).all())
    if arch in ("mistral", "gemma2", "gemma3"):
        assert any(not cap.attendable.all() for cap in rec.layers.values())


def brute_force_row(q, k, v, scaling, allowed):
    """One query row, straight from the definitions (float64)."""
    scores = torch.tensor([float(q @ k[j]) * scaling if allowed[j] else float("-inf") for j in range(len(k))], dtype=torch.float64)
    p = torch.softmax(scores, 0)
    weighted = [float(p[j]) * float(v[j].norm()) for j in range(len(k))]
    best = max(range(len(k)), key=lambda j: (weighted[j], -j))
    entropy = -sum(float(x) * float(torch.log(x)) for x in p if x > 0)
    return p, best, entropy


@pytest.mark.parametrize("tile", [(1, 1), (1, 4), (2, 3), (2, 9)])
@pytest.mark.parametrize("kind", ["causal", "sliding", "prefix"])
def test_summaries_match_brute_force_any_tile(tile, kind, row_passes):
    """Every tile (kv heads, queries) and mask: plain causal (None), a sliding window, and a
    bidirectional prefix, where early queries see keys after their block (no causal truncation
    allowed)."""
    torch.manual_seed(1)
    bsz, n_heads, n_kv, length, dim = 2, 4, 2, 9, 5
    q = torch.randn(bsz, n_heads, length, dim)
    k = torch.randn(bsz, n_kv, length, dim)
    v = torch.randn(bsz, n_kv, length, dim)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = {"causal": j <= i, "sliding": (j <= i) & (i - j < 4), "prefix": (j <= i) | (j < 4)}[kind]
    mask = allowed[None, None].expand(bsz, 1, length, length)
    cap, out = attention_summaries(q, k, v, None if kind == "causal" else mask, 0.5, keep_rows=True,
                                   need_output=True, tile=tile)
    for b in range(bsz):
        for h in range(n_heads):
            for qi in range(length):
                p, best, entropy = brute_force_row(q[b, h, qi], k[b, h // 2], v[b, h // 2], 0.5, mask[b, 0, qi])
                assert int(cap.winner[b, h, qi]) == best
                assert abs(float(cap.entropy[b, h, qi]) - entropy) < 1e-5
                assert abs(float(cap.sink_attn[b, h, qi]) - float(p[0])) < 1e-6
                assert abs(float(cap.diag_attn[b, h, qi]) - float(p[qi])) < 1e-6
                assert abs(float(cap.top1_attn[b, h, qi]) - float(p.max())) < 1e-6
                torch.testing.assert_close(cap.rows[b, h, qi].double(), p, atol=1e-3, rtol=0)
                torch.testing.assert_close(out[b, qi, h].double(), p @ v[b, h // 2].double(), atol=1e-5, rtol=0)
                if qi == length - 1:
                    torch.testing.assert_close(cap.attn_last[b, h].double(), p, atol=1e-6, rtol=0)


def brute_force_variant(q, k, v, scaling, bias, softcap, sink):
    """One query row with every variant, straight from the definitions (float64): scores
    scaling q.k, softcapped, plus an additive bias (-inf where masked), and a learned sink
    logit in the softmax with no value. Returns the weights on the keys, the sink's weight,
    the winner, the entropy of the whole distribution and the output."""
    scores = [float(q @ k[j]) * scaling for j in range(len(k))]
    if softcap is not None:
        scores = [softcap * math.tanh(s / softcap) for s in scores]
    logits = [s + float(b) for s, b in zip(scores, bias)] + ([float(sink)] if sink is not None else [])
    top = max(logits)
    exps = [math.exp(x - top) if x > -1e29 else 0.0 for x in logits]
    total = sum(exps)
    p = [e / total for e in exps]
    keys, learned = p[: len(k)], (p[-1] if sink is not None else 0.0)
    weighted = [keys[j] * float(v[j].norm()) for j in range(len(k))]
    best = max(range(len(k)), key=lambda j: (weighted[j], -j))
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    output = sum(keys[j] * v[j].double() for j in range(len(k)))
    return torch.tensor(keys, dtype=torch.float64), learned, best, entropy, output


@pytest.mark.parametrize("tile", [(1, 1), (1, 4), (2, 3), (2, 9)])
@pytest.mark.parametrize("variant", ["alibi", "sinks", "sinks+softcap", "chunks+sinks", "latent"])
def test_variants_match_brute_force_any_tile(tile, variant, row_passes):
    """The attention variants of today's models against their definitions, at every tile:
    per-head additive biases in the mask (ALiBi), learned sinks (gpt-oss), softcapped logits
    with sinks, chunked masks (Llama 4) and values narrower than the keys (latent attention)."""
    torch.manual_seed(4)
    bsz, n_heads, n_kv, length, dim = 2, 4, 2, 9, 5
    v_dim = 3 if variant == "latent" else dim
    q, k = torch.randn(bsz, n_heads, length, dim) * 2, torch.randn(bsz, n_kv, length, dim)
    v = torch.randn(bsz, n_kv, length, v_dim)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (j <= i) & (i // 4 == j // 4) if variant.startswith("chunks") else j <= i
    low = torch.finfo(torch.float32).min
    bias = torch.where(allowed, 0.0, low)[None, None].expand(bsz, n_heads, length, length).clone()
    if variant == "alibi":
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        bias += torch.where(allowed, -slopes[:, None, None] * (i - j), 0.0)[None]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if "sinks" in variant else None
    softcap = 2.0 if "softcap" in variant else None
    cap, out = attention_summaries(q, k, v, bias, 0.7, softcap=softcap, sinks=sinks, keep_rows=True,
                                   need_output=True, tile=tile)
    assert (cap.learned_sink is not None) == (sinks is not None)
    for b in range(bsz):
        for h in range(n_heads):
            for qi in range(length):
                keys, learned, best, entropy, output = brute_force_variant(
                    q[b, h, qi], k[b, h // 2], v[b, h // 2], 0.7, bias[b, h, qi], softcap,
                    None if sinks is None else sinks[h])
                assert int(cap.winner[b, h, qi]) == best
                assert abs(float(cap.entropy[b, h, qi]) - entropy) < 1e-5
                assert abs(float(cap.sink_attn[b, h, qi]) - float(keys[0])) < 1e-6
                assert abs(float(cap.top1_attn[b, h, qi]) - float(keys.max())) < 1e-6
                if sinks is not None:
                    assert abs(float(cap.learned_sink[b, h, qi]) - learned) < 1e-6
                torch.testing.assert_close(out[b, qi, h].double(), output, atol=1e-5, rtol=0)
                if qi == length - 1:
                    torch.testing.assert_close(cap.attn_last[b, h].double(), keys, atol=1e-6, rtol=0)
    assert torch.equal(cap.attendable, allowed[-1])


def test_softcap_output_matches_eager_formula():
    torch.manual_seed(2)
    q = torch.randn(1, 2, 6, 4) * 5
    k = torch.randn(1, 1, 6, 4) * 5
    v = torch.randn(1, 1, 6, 4)
    cap, out = attention_summaries(q, k, v, None, 1.0, softcap=3.0, need_output=True)
    scores = 3.0 * torch.tanh((q @ k.transpose(-1, -2)) / 3.0)
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    p = torch.softmax(scores, -1)
    torch.testing.assert_close(out, (p @ v).transpose(1, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cap.attn_last, p[:, :, -1], atol=1e-6, rtol=0)


def test_lower_precision_keeps_the_models_own_sdpa_output(tiny_model_dir):
    """In bfloat16 the capture changes nothing the model computes: its hidden states are the
    stock SDPA model's, bit for bit, while the summaries are still float32 recomputations."""
    folder = tiny_model_dir("llama")
    ids = torch.randint(4, 100, (2, L))
    ids[:, 0] = 1
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    model = load_model(ModelSource(str(folder), str(folder)), device="cpu", dtype=torch.bfloat16)
    with torch.no_grad(), capturing(model) as rec:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        expected = stock.model(input_ids=ids, use_cache=False).last_hidden_state
    assert output_description(torch.bfloat16, "llama") == "sdpa output"
    assert output_description(torch.float32, "llama") == "output = float32 rows @ v"
    assert output_description(torch.bfloat16, "gpt_neo") == "output = float32 rows @ v"  # no SDPA of its own
    assert torch.equal(hidden, expected)
    assert all(cap.entropy.dtype == torch.float32 for cap in rec.layers.values())


def tiny_ids(seed: int = 0) -> torch.Tensor:
    ids = torch.randint(4, 100, (2, L), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 1
    return ids


def stock(folder, impl: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_capturing_restores_the_models_own_implementation(impl, tiny_model_dir):
    """A user's model records inside the block and is its own "sdpa"/"eager" model again after,
    on every sub-config (Gemma 3's sliding layers included), also when the block raises."""
    model = stock(tiny_model_dir("gemma3"), impl)
    ids = tiny_ids()
    with torch.no_grad():
        before = model.model(input_ids=ids, use_cache=False).last_hidden_state
        with capturing(model) as rec:
            assert model.config._attn_implementation == ATTN_IMPLEMENTATION
            model.model(input_ids=ids, use_cache=False)
        with pytest.raises(RuntimeError), capturing(model):
            raise RuntimeError("user code failed inside the block")
        after = model.model(input_ids=ids, use_cache=False).last_hidden_state
    assert sorted(rec.layers) == list(range(model.config.num_hidden_layers))
    assert model.config._attn_implementation == impl
    assert all(m.config._attn_implementation == impl for m in model.modules() if hasattr(m, "config"))
    assert torch.equal(before, after)


def test_a_model_under_no_recorder_runs_plain_sdpa(tiny_model_dir):
    """Set to the capture implementation but outside any block (or inside another model's), a
    model computes exactly what the stock SDPA model does and records nothing."""
    folder = tiny_model_dir("llama")
    ids = tiny_ids()
    model = load_model(ModelSource(str(folder), str(folder)), device="cpu", dtype=torch.float32)
    other = load_model(ModelSource(str(folder), str(folder)), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        expected = stock(folder).model(input_ids=ids, use_cache=False).last_hidden_state
        assert torch.equal(model.model(input_ids=ids, use_cache=False).last_hidden_state, expected)
        with capturing(other) as rec:
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    assert torch.equal(hidden, expected)
    assert rec.layers == {}


def test_a_layers_capture_runs_on_one_thread(tiny_model_dir, monkeypatch):
    """Each layer's capture runs on one torch thread, its tiles shared out among as many
    threads as the caller has torch threads, and the rest of the forward on the caller's
    thread count, which is restored after each layer, also when a layer raises."""
    import attngeom.extract.attention_hook as capture_module

    model = stock(tiny_model_dir("llama"))
    real = capture_module.attention_summaries
    in_capture, in_mlp = [], []

    def spy(*args, **kwargs):
        in_capture.append((torch.get_num_threads(), kwargs["threads"]))
        return real(*args, **kwargs)

    def fail(*args, **kwargs):
        raise RuntimeError("a layer's capture failed")

    model.model.layers[0].mlp.register_forward_hook(lambda *_: in_mlp.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(capture_module, "attention_summaries", spy)
        with torch.no_grad(), capturing(model):
            model.model(input_ids=tiny_ids(), use_cache=False)
        assert in_capture == [(1, 2)] * model.config.num_hidden_layers
        assert in_mlp == [2]
        monkeypatch.setattr(capture_module, "attention_summaries", fail)
        with pytest.raises(RuntimeError, match="capture failed"), torch.no_grad(), capturing(model):
            model.model(input_ids=tiny_ids(), use_cache=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_two_threads_record_their_own_models_at_once(tiny_model_dir):
    """Two threads, each capturing a different tiny model, both inside their forward at the
    same moment (a barrier in layer 1), get exactly the captures of a run alone."""
    archs = ("llama", "qwen2")
    models = {a: stock(tiny_model_dir(a)) for a in archs}
    ids = {a: tiny_ids(seed) for seed, a in enumerate(archs)}
    alone = {}
    for a in archs:
        with torch.no_grad(), capturing(models[a]) as rec:
            models[a].model(input_ids=ids[a], use_cache=False)
        alone[a] = rec.layers
    barrier = threading.Barrier(len(archs), timeout=30)

    def meet(*_) -> None:
        barrier.wait()

    hooks = [m.model.layers[1].register_forward_pre_hook(meet) for m in models.values()]
    together, errors = {}, []

    def work(a: str) -> None:
        try:
            with torch.no_grad(), capturing(models[a]) as rec:
                models[a].model(input_ids=ids[a], use_cache=False)
            together[a] = rec.layers
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(a,)) for a in archs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in hooks:
        h.remove()
    assert not errors, errors
    for a in archs:
        assert sorted(together[a]) == sorted(alone[a]) == list(range(models[a].config.num_hidden_layers))
        for layer, cap in together[a].items():
            assert torch.equal(cap.values, alone[a][layer].values)
            assert torch.equal(cap.winner, alone[a][layer].winner)
            torch.testing.assert_close(cap.entropy, alone[a][layer].entropy, atol=0, rtol=0)


def test_registration_is_an_explicit_call():
    """Importing attngeom registers nothing with transformers; ``register_capture`` does, and
    calling it twice is harmless."""
    code = """
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
import attngeom.extract.writing, attngeom.ablate.stage
from attngeom.extract.attention_hook import ATTN_IMPLEMENTATION, register_capture
assert ATTN_IMPLEMENTATION not in AttentionInterface(), "registered at import"
assert ATTN_IMPLEMENTATION not in AttentionMaskInterface(), "mask registered at import"
register_capture()
register_capture()
assert ATTN_IMPLEMENTATION in AttentionInterface() and ATTN_IMPLEMENTATION in AttentionMaskInterface()
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("seed", range(5))
def test_first_argmax_is_torch_argmax(seed):
    """Known answers where ties are the rule: small integers (many equal maxima), all-zero rows,
    subnormal values one ulp apart, and a single column."""
    from attngeom.extract.row_passes import first_argmax

    g = torch.Generator().manual_seed(seed)
    cases = [
        torch.randint(0, 4, (3, 5, 37), generator=g).float(),
        torch.zeros(2, 7, 9),
        torch.randint(0, 3, (4, 50), generator=g).float() * 1e-45,
        torch.rand(6, 1, generator=g),
        torch.rand(2, 3, 4, 513, generator=g).softmax(-1) * torch.rand(513, generator=g),
    ]
    for x in cases:
        assert torch.equal(first_argmax(x.clone()), x.argmax(-1))


def test_additive_floor_equals_filling_the_mask():
    """Adding ``masked_floor`` is bit for bit ``masked_fill(~allowed, MASKED)`` for any score
    a model produces (|s| far below 1e22)."""
    from attngeom.extract.tiles import MASKED, masked_floor

    torch.manual_seed(3)
    scores = torch.randn(2, 3, 4, 64) * torch.logspace(-30, 6, 64)
    allowed = torch.rand(2, 1, 4, 64) < 0.6
    assert torch.equal(scores + masked_floor(allowed), scores.masked_fill(~allowed, MASKED))


def test_cpu_scores_are_the_batched_product():
    """On CPU the scores are one mm per kv head (bmm left a core idle): bmm's bits at the block
    shapes of smollm2-135m and gemma3-270m, and bmm's values to rounding at tiny ones, where
    the two take different kernels."""
    from attngeom.extract.tiles import _scores

    torch.manual_seed(4)
    for n, rows, keys, dim in [(1, 512, 300, 256), (3, 168, 1024, 64), (3, 168, 56, 64), (4, 7, 9, 5)]:
        q, k = torch.randn(n, rows, dim), torch.randn(n, keys, dim)
        scores, batched = _scores(q, k), torch.bmm(q, k.transpose(1, 2))
        if rows * keys > 1000:
            assert torch.equal(scores, batched)
        torch.testing.assert_close(scores, batched, rtol=1e-6, atol=1e-6)


def test_score_tiles_follow_the_layers_shape():
    """Layers whose 2 MiB tile of every kv head keeps 128 rows per product keep it (smollm2-135m,
    gemma3-270m: the tiles their stores were measured and written with); many heads or long
    rows take fewer kv heads per tile, in even tiles, and never fewer than 128 product rows."""
    from attngeom.extract.tiles import score_tile

    cpu = torch.device("cpu")
    assert score_tile(1, 9, 3, 1024, cpu) == (3, 56)  # smollm2-135m
    assert score_tile(1, 9, 3, 512, cpu) == (3, 113)
    assert score_tile(1, 4, 1, 1024, cpu) == (1, 128)  # gemma3-270m
    assert score_tile(1, 32, 32, 1024, cpu) == (4, 128)  # Llama-2-7B
    assert score_tile(1, 32, 8, 4096, cpu) == (1, 32)  # Mistral-7B at L=4096: 4 heads x 32 queries
    assert score_tile(1, 32, 32, 2048, cpu) == (2, 128)
    # 8 kv heads fit: tiles of 5 and 4, not 8 and 1; the queries fill the budget again.
    assert score_tile(1, 9, 9, 1024, cpu, tile_bytes=4 * 2**20) == (5, 204)
    assert score_tile(1, 12, 12, 1024, cpu, tile_bytes=3 * 2**20) == (6, 128)
    assert score_tile(2, 9, 3, 64, cpu) == (3, 64)  # the whole layer at once when it is small


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_captures_to_host_are_the_captures(device, tiny_model_dir):
    """``to_host`` hands every layer's capture over in host memory, equal to what the layer
    computed: on CPU the very tensors (nothing copied, nothing pinned); on CUDA pinned copies
    made on a side stream while later layers ran, read after ``host_layers`` waited for them."""
    folder = str(tiny_model_dir("gemma3"))
    model = load_model(ModelSource(folder, folder), device=device, dtype=torch.float32)
    ids = tiny_ids().to(device)
    with torch.no_grad(), capturing(model, keep_rows=True) as kept:
        model.model(input_ids=ids, use_cache=False)
    with torch.no_grad(), capturing(model, keep_rows=True, to_host=True) as moved:
        model.model(input_ids=ids, use_cache=False)
    host = moved.host_layers()
    assert sorted(host) == sorted(kept.layers) == list(range(model.config.num_hidden_layers))
    for layer, capture in host.items():
        for name in ("values", "attn_last", "winner", "sink_attn", "diag_attn", "top1_attn", "entropy",
                     "prev_attn", "recent_attn", "attendable", "rows"):
            got, want = getattr(capture, name), getattr(kept.layers[layer], name)
            assert got.device.type == "cpu"
            assert got.is_pinned() == (device == "cuda")
            assert torch.equal(got, want.cpu())
    if device == "cpu":
        recorder = Recorder(to_host=True)
        recorder.record(0, kept.layers[0])
        assert recorder.host_layers()[0] is kept.layers[0]


def test_auto_dtype_is_float32_on_every_device():
    """bfloat16 moved 1.4-1.9% of the winners of real models (README, "Compute dtype"): a named
    model computes in float32 unless asked otherwise, on a GPU too."""
    from attngeom.extract.models import resolve_dtype

    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_a_profile_shows_extracts_phases_and_changes_nothing(tiny_model_dir, tmp_path):
    """Under torch.profiler extract's phases are the ranges of ``PHASES`` (docs/architecture.md),
    and what it stores is what it stores unprofiled, bit for bit."""
    import numpy as np
    import zarr
    from torch.profiler import ProfilerActivity, profile

    import attngeom as ag
    from attngeom.extract.phases import PHASES

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    ids = np.random.default_rng(0).integers(4, 100, size=(2, L))
    ids[:, 0] = model.config.bos_token_id
    plain, profiled = str(tmp_path / "plain.zarr"), str(tmp_path / "profiled.zarr")
    ag.extract(model, token_ids=ids, store=plain, run_id="r", progress=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ag.extract(model, token_ids=ids, store=profiled, run_id="r", progress=False)
    names = [e.name for e in prof.events() if e.name.startswith("attngeom.")]
    assert set(names) == set(PHASES)
    # A capture per layer (3) of each forward, a write per sequence.
    assert names.count("attngeom.capture") == 3 * names.count("attngeom.forward") and names.count("attngeom.write") == 2
    want, got = zarr.open_group(plain, path="runs/r", mode="r"), zarr.open_group(profiled, path="runs/r", mode="r")
    assert sorted(want.array_keys()) == sorted(got.array_keys())
    for name in want.array_keys():
        np.testing.assert_array_equal(got[name][...], want[name][...], strict=True, err_msg=name)
