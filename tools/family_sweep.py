"""Every causal-LM family of the installed transformers, built tiny from its own config class
and read by extract: one verdict per family.

    python tools/family_sweep.py                      # every family, one line each
    python tools/family_sweep.py llama jetmoe zamba   # these only
    python tools/family_sweep.py --json sweep.json    # the verdicts as JSON too
    python tools/family_sweep.py --json s.json --only-from s.json --markdown table.md

Each family is built as the tests build it (tests/families.py) where they do; any other
family's default config is shrunk (64 dimensions, 4 heads, 3 to 4 layers keeping one of
each layer kind, 4 experts, 100 tokens; its sub-configs and per-layer overrides alike), with
what shrinking alone gets wrong set per family (EXTRA: sizes a default leaves unset, fields
naming layers, a family's own constraints), a random model is built from it, its queries and
keys scaled up so that rows are peaked, and extract reads 2 sequences of 16 tokens after
comparing its capture with the family's own eager attention in float32 at 6 queries (the
conformance check, forced for every family); the stored last rows are then compared with
the weights of the family's eager forward in float64 on the same weights, where it returns
them for each layer. Verdicts: ``captured`` (with the largest row and output differences),
``wrong`` (a stored row more than 1e-4 from the float64 forward's: the worst outcome),
``refused`` (attngeom's one-line reason, a disagreement with the eager attention included),
``crash`` (an exception attngeom did not turn into a refusal: a bug), and ``not built`` (a speculative drafter, which no text alone runs, or a config the sweep
could not shrink into a model: a limit of this script, not of attngeom).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

SMALL = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, d_model=64, n_embd=64, n_head=4, n_heads=4, n_positions=256, n_ctx=256,
    ffn_dim=96, d_inner=96, d_head=16, decoder_ffn_dim=96, encoder_ffn_dim=96, decoder_attention_heads=4,
    encoder_attention_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, n_routed_experts=4,
    num_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, num_experts_per_token=2,
    moe_topk=2, n_group=1, topk_group=1, num_expert_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=16, sliding_window=6, sliding_window_size=6,
    attention_chunk_size=6, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_head_dim=16, linear_num_heads=4, index_topk=4, index_head_dim=16,
    index_n_heads=2, mamba_d_state=16, mamba_n_heads=8, mamba_d_head=16, mamba_headdim=16, n_mamba_heads=8,
    mamba_dt_rank=8, mamba_chunk_size=8, chunk_size=8, state_size=16, time_step_rank=8, kv_channels=16,
    num_query_groups=2, attention_head_dim=16, attention_hidden_size=64, swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=16, d_rel=4, rel_extent=16, first_dense_intermediate_size=96,
    dense_intermediate_size=96, mlp_only_intermediate_size=96, expert_ffn_hidden_size=32, ffn_hidden_size=96,
    intermediate_size_mlp=96, shared_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    embedding_size=64, word_embed_proj_dim=64, lru_width=64, attention_window_size=6, local_attention_window_len=6,
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=100, num_kv_shared_layers=0, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, use_mamba_kernels=False, rotary_dim=8, attn_layer_period=2, attn_layer_offset=1,
    expert_layer_period=2, expert_layer_offset=1, adapter_in_dim=64, adapter_out_dim=64, adapter_input_size=64,
)
LAYERS = 3
# Keys naming layers by index, remapped onto the kept layers.
LAYER_INDEX_KEYS = ("cross_attention_layers", "global_attn_indexes", "hybrid_layer_ids", "full_attn_idxs",
                    "attn_layer_indices", "local_layer_ids")
# Per family, what shrinking its default config alone gets wrong: sizes its default leaves
# unset that its modeling code reads, fields whose values name layers, its own constraints.
EXTRA: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(num_experts_per_tok=2, n_group=1, topk_group=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "ernie4_5_moe": dict(moe_k=2),
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16),
    "nemotron": dict(num_key_value_heads=2),
    "lfm2_moe": dict(num_hidden_layers=4, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),
    "mamba2": dict(num_heads=8, head_dim=16),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    # BERT-like decoders: their causal-LM classes ask for is_decoder (else their attention is
    # bidirectional).
    "megatron-bert": dict(is_decoder=True),
    "rembert": dict(is_decoder=True),
    "roformer": dict(is_decoder=True),
    "big_bird": dict(is_decoder=True, attention_type="original_full"),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16], attention_head_size=16,
                     feed_forward_size=96, lsh_attn_chunk_length=8, local_attn_chunk_length=8),
    "kolibri1_1": dict(num_hidden_layers=3, layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
                       index_layers=[1], kv_source_layers=[0, 1, 1], mlp_only_layers=[0], index_pool_size=16,
                       index_num_heads=2),
    # transformers' DBRX attention reads a rope_theta its attention config class does not
    # declare; DBRX's checkpoints set it there.
    "dbrx": dict(attn_config=dict(rope_theta=500000.0, kv_n_heads=2, clip_qkv=8.0)),
    "dots3_note_text": dict(head_dim=24),  # its sliding layers' qk_nope_head_dim (16) + qk_rope_head_dim
    "xlstm": dict(embedding_dim=64, num_heads=4),
    "xlm": dict(emb_dim=64, n_heads=4, causal=True),
    "musicgen": dict(num_codebooks=1),
    "musicgen_melody": dict(num_codebooks=1),
    "blt": dict(encoder_config=dict(hidden_size_global=64), decoder_config=dict(hidden_size_global=64),
                encoder_hash_byte_group_vocab=100, local_attention_window_len=6, max_position_embeddings=256),
    "cohere_compass_text": dict(rope_parameters={"full_attention": None, "sliding_attention": dict(
        rope_type="default", rope_theta=10000.0)}),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2, hc_lowrank=16, ple_embed_dim=64),
}
EXTRA["qwen4_exp"] = dict(text_config=EXTRA["qwen4_exp_text"])
EXTRA["dots3_note"] = dict(text_config=EXTRA["dots3_note_text"])
# Families whose causal-LM class is built from one sub-config (EXTRA then applies to it):
# MusicGen's decoder; Gemma 3n's text stack (its multimodal class needs timm for its vision
# tower), as attngeom judges it.
SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder", "gemma3n": "text_config"}
# Speculative drafters: their forward reads the key and value states of the model they draft
# for, so no text alone runs them (and Gemma 4's default assistant config does not validate).
DRAFTERS = frozenset({"gemma4_assistant", "gemma4_unified_assistant"})
LENGTH = 16
TIMEOUT_S = 120
# Largest |difference| between a stored row (float32) and the eager float64 forward's.
FLOAT64_TOLERANCE = 1e-4


def _kept_layers(values: dict[str, Any], n_layers: int) -> list[int]:
    """Layer indices to keep: the first of each kind of every per-layer list, then the first
    layers up to LAYERS."""
    keep: set[int] = set()
    for value in values.values():
        if isinstance(value, list) and len(value) == n_layers and n_layers > LAYERS:
            seen: dict[str, list[int]] = {}
            for i, kind in enumerate(value):
                seen.setdefault(repr(kind), []).append(i)
            keep.update(i for first in seen.values() for i in first[:2])  # two: a shared block shows
    for key in LAYER_INDEX_KEYS:
        if isinstance(values.get(key), list) and values[key]:
            keep.add(int(values[key][0]) % n_layers)
    i = 0
    while len(keep) < min(LAYERS, n_layers):
        keep.add(i)
        i += 1
    return sorted(keep)


def _per_layer(sizes: dict[str, Any]) -> dict[str, Any]:
    """A per-layer override of sizes, shrunk to twice SMALL's: those layers stay wider."""
    out = {k: 2 * SMALL[k] if isinstance(SMALL.get(k), int) and not isinstance(SMALL[k], bool) else v
           for k, v in sizes.items()}
    if "num_key_value_heads" in sizes and sizes["num_key_value_heads"] == sizes.get("num_attention_heads"):
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``extra``, sub-config dicts merged key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _shrunk(config: Any) -> dict[str, Any]:
    """Constructor arguments of ``config``'s class that make it tiny (sub-configs included)."""
    values = config.to_dict()
    out = {k: v for k, v in SMALL.items() if k in values and values[k] is not None}
    if values.get("qk_rope_head_dim"):  # latent attention: its rotary head is head_dim, a key per head
        out["head_dim"] = SMALL["qk_rope_head_dim"]
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = SMALL["num_attention_heads"]
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out[name] = {**sub.to_dict(), **_shrunk(sub)}
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers"):
        n_layers = values.get(key)
        if not isinstance(n_layers, int) or n_layers <= 0:
            continue
        keep = _kept_layers(values, n_layers)
        out[key] = len(keep)
        for name, value in values.items():
            if isinstance(value, list) and len(value) == n_layers and name not in out:
                out[name] = [value[i] for i in keep]
            elif name in LAYER_INDEX_KEYS and isinstance(value, list):
                out[name] = [keep.index(i) for i in value if i in keep]
        if isinstance(values.get("per_layer_config"), dict):  # {"05": {"head_dim": 512}}: sizes of some layers
            out["per_layer_config"] = {str(keep.index(int(k))).zfill(len(k)): _per_layer(v)
                                       for k, v in values["per_layer_config"].items() if int(k) in keep}
        break
    if values.get("is_decoder") is False and "is_decoder" in type(config).__dataclass_fields__:
        # A BERT-like causal LM is causal as a decoder only (its class warns without it).
        out["is_decoder"] = True
    if "encoder_layers" in values and "decoder_layers" in values:  # a causal LM's decoder of an encoder-decoder
        out["encoder_layers"] = out["decoder_layers"] = LAYERS
    return out


def tiny_model(model_type: str) -> Any:
    """A tiny random float32 model of ``model_type``: the tests' own (tests/families.py) where
    they build one, else one from the family's shrunk default config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import families

    if model_type in families.FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(families.family_config(model_type), dtype=torch.float32).eval()
    elif model_type in families.CHECKED:
        model = families.checked_model(model_type)
    elif model_type in families.REFUSED_AT_FORWARD:
        model = families.refused_model(model_type)
    else:
        default = causal = AutoConfig.for_model(model_type)
        if model_type in SUB_CONFIG:
            default = getattr(default, SUB_CONFIG[model_type])
        config = type(default)(**{**default.to_dict(), **_merged(_shrunk(default), EXTRA.get(model_type, {}))})
        torch.manual_seed(0)
        if model_type in SUB_CONFIG:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) or MODEL_FOR_CAUSAL_LM_MAPPING[type(causal)]
            model = cls._from_config(config, dtype=torch.float32).eval()
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        if hasattr(model, "set_default_language"):  # X-MOD's adapters need one
            model.set_default_language(config.languages[0])
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > 50_000_000:
        raise MemoryError(f"{parameters / 1e6:.0f}M parameters once shrunk")
    with torch.no_grad():  # peaked rows: queries and keys scaled up
        for name, p in model.named_parameters():
            if any(part in name for part in ("q_proj", "k_proj", "query", "key")) and p.dim() == 2:
                p.mul_(3.0)
        # A shrunk config the model's own forward cannot run is the sweep's, not attngeom's.
        model(input_ids=torch.ones(1, 4, dtype=torch.long), use_cache=False)
    return model


def float64_error(model: Any, ids: Any, store: str) -> float | None:
    """Largest |difference| between the stored last rows (attn_last) and the weights the
    model's own eager forward returns in float64 (``output_attentions``) on the same weights;
    None where that forward returns no weights for each layer (or weights of another shape:
    layers of different widths)."""
    import copy

    import numpy as np
    import torch
    import xarray as xr

    config = copy.deepcopy(model.config)
    try:
        reference = type(model)._from_config(config, dtype=torch.float64, attn_implementation="eager").eval()
        reference.load_state_dict({k: v.double() if v.is_floating_point() else v
                                   for k, v in model.state_dict().items()})
        with torch.no_grad():
            attentions = reference(input_ids=ids, output_attentions=True, use_cache=False).attentions
    except Exception:  # noqa: BLE001 - a family whose eager forward returns no weights has no such reference
        return None
    ds = xr.open_zarr(store, group="runs/r", consolidated=False)
    n_layers = model.config.get_text_config().num_hidden_layers
    if attentions is None or len(attentions) != n_layers:
        return None
    errors = []
    for i, layer in enumerate(ds["layer"].values):
        weights = attentions[int(layer)]
        stored = ds["attn_last"].isel(layer=i).values
        if weights is None or tuple(weights.shape[:2]) + (weights.shape[-1],) != stored.shape:
            return None
        last = weights[:, :, -1].numpy()
        if "learned_sink_attn" in ds:
            # A row the eager attention returns whole (Granite-SWA's, whose sink scales the
            # output after the product) is the stored row over 1 - its sink's weight.
            sink = ds["learned_sink_attn"].isel(layer=i).values[..., -1]
            whole = np.isclose(last.sum(-1), 1.0, rtol=0, atol=1e-5)
            last = np.where(whole[..., None], last * (1 - sink)[..., None], last)
        errors.append(float(np.abs(stored - last).max()))
    return max(errors)


def _timeout(signum, frame):
    raise TimeoutError(f"over {TIMEOUT_S} s")


def verdict(model_type: str) -> dict[str, Any]:
    """The sweep's verdict on ``model_type``: verdict and detail."""
    import torch

    import attngeom as ag
    from attngeom.errors import AttngeomError
    from attngeom.extract import writing
    from attngeom.extract.conformance import check_capture, check_positions, refuse_disagreement

    if model_type in DRAFTERS:
        return {"verdict": "not built", "detail": "a speculative drafter: its forward reads the key and value states "
                                                  "of the model it drafts for, not a text alone"}
    try:
        model = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001 - any failure to shrink is this script's
        return {"verdict": "not built", "detail": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(4, vocab, (2, LENGTH), generator=generator)
    text = model.config.get_text_config()
    if not isinstance(getattr(text, "bos_token_id", None), int) or text.bos_token_id >= vocab:
        text.bos_token_id = 1
    ids[:, 0] = text.bos_token_id
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(TIMEOUT_S)
    try:
        from attngeom.extract.models import loaded_model

        loaded_model(model)
        checks = check_capture(model, ids[:1], check_positions(LENGTH))
        rows, outputs = max(c.row_error for c in checks), max(c.output_error for c in checks)
        refuse_disagreement(checks, model.config.model_type)  # as extract refuses it
        writing.VERIFIED_TYPES = writing.VERIFIED_TYPES | {model.config.model_type}
        with tempfile.TemporaryDirectory() as folder:
            ag.extract(model, store=f"{folder}/s.zarr", token_ids=ids, run_id="r", progress=False)
            float64 = float64_error(model, ids, f"{folder}/s.zarr")
        detail = f"{len(checks)} layers, rows within {rows:.1g}, outputs within {outputs:.1g} of eager attention"
        if float64 is not None:
            detail += f"; stored last rows within {float64:.1g} of an eager float64 forward"
        if float64 is not None and float64 > FLOAT64_TOLERANCE:
            return {"verdict": "wrong", "detail": detail}
        return {"verdict": "captured", "detail": detail}
    except AttngeomError as exc:
        return {"verdict": "refused", "detail": str(exc)}
    except Exception as exc:  # noqa: BLE001 - anything else is a crash to report
        return {"verdict": "crash", "detail": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    finally:
        signal.alarm(0)


def causal_lm_types() -> list[str]:
    """Every model type of transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def markdown(found: dict[str, dict[str, Any]]) -> str:
    """The verdicts as the table of docs/models.md#every-family: one row per model type."""
    from attngeom.extract.families import VERIFIED_TYPES

    words = {"captured": "captured", "refused": "refused", "crash": "CRASH", "wrong": "WRONG", "not built": "not checked"}
    rows = ["| model type | verdict | how |", "|---|---|---|"]
    for model_type, v in sorted(found.items()):
        how = v["detail"].replace("|", "\\|")
        if v["verdict"] == "captured" and model_type in VERIFIED_TYPES:
            how = f"verified against a float64 eager forward (tests); {how}"
        elif v["verdict"] == "not built" and model_type not in DRAFTERS:
            how = f"the sweep's shrunk config does not build ({how})"
        rows.append(f"| `{model_type}` | {words[v['verdict']]} | {how} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="model types (default: every causal-LM family)")
    parser.add_argument("--json", help="write the verdicts to this file too")
    parser.add_argument("--markdown", help="write the verdicts as docs/models.md's table to this file")
    parser.add_argument("--only-from", help="rerun only the families of this JSON whose verdict is crash or "
                                            "not built, keeping the others' verdicts")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    found: dict[str, dict[str, Any]] = {}
    todo = args.families or causal_lm_types()
    if args.only_from:
        with open(args.only_from) as f:
            found = json.load(f)
        todo = [t for t in todo if t not in found or found[t]["verdict"] not in ("captured", "refused")]
    for model_type in todo:
        found[model_type] = verdict(model_type)
        print(f"{model_type}\t{found[model_type]['verdict']}\t{found[model_type]['detail']}", flush=True)
    counts: dict[str, int] = {}
    for v in found.values():
        counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(found))


if __name__ == "__main__":
    main()
