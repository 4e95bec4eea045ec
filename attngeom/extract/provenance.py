"""What a run records of its extract: its identity (what a rerun must match), the rest of its
provenance (tokenizer, compute, versions, command line) and its layout, read off the first
forward's capture."""

from __future__ import annotations

import platform
import shlex
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from attngeom.version import __version__
from attngeom.errors import InputError
from attngeom.extract.attention_hook import ATTN_IMPLEMENTATION, output_description
from attngeom.extract.families import check_recorded
from attngeom.extract.inputs import Input, Model
from attngeom.extract.layer_widths import layer_shapes
from attngeom.extract.placement import parse_device_map
from attngeom.extract.request import ExtractPlan, values_dtype_refusal
from attngeom.extract.tiles import LayerCapture
from attngeom.store.objects.schema import BFLOAT16, RunLayout
from attngeom.store.objects.storage import jsonable

__all__ = ["identity", "run_layout", "run_provenance"]


def _library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "zarr", "numcodecs", "numpy", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def _values_dtype(asked: str, model: Model, recorded: dict[str, Any] | None) -> str:
    """The values' storage dtype: as asked, or for "auto" the one the run holds, else
    bfloat16 for a bfloat16 model (2 bytes, exact) and float32 for any other."""
    if asked == "auto":
        if recorded is not None:
            return recorded.get("values_dtype", "float32")
        return BFLOAT16 if model.dtype == torch.bfloat16 else "float32"
    if asked == BFLOAT16 and model.dtype != torch.bfloat16:
        raise InputError(values_dtype_refusal(model.compute_dtype))
    return asked


def identity(plan: ExtractPlan, model: Model, inputs: Input, bos_id: int,
             recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The run's identity (:data:`~attngeom.extract.identity.IDENTITY`), as its record stores
    it, once the model and the input are read; ``recorded``: the run's record, if it exists."""
    return jsonable({
        "model": model.provenance,
        "dataset": inputs.provenance,
        "context_length": inputs.length,
        "window_rule": inputs.window_rule,
        "bos_token_id": bos_id,
        "values_dtype": _values_dtype(plan.request.values_dtype, model, recorded),
        "store_rows": plan.request.store_rows,
        "queries": list(plan.queries),
        "compute_dtype": model.compute_dtype,
    })


def run_provenance(plan: ExtractPlan, model: Model, bos_id: int) -> dict[str, Any]:
    """What a run records beyond its identity: tokenizer, compute, versions, command line."""
    request, tokenizer = plan.request, model.tokenizer
    return {
        "tokenizer": None if tokenizer is None else {
            "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer),
            "bos_token": tokenizer.convert_ids_to_tokens(bos_id),
            "name_or_path": getattr(tokenizer, "name_or_path", None) or None,
        },
        "model_type": model.config.model_type,
        "device": model.device,
        "device_map": jsonable(parse_device_map(request.device_map)),
        # What float32 matmuls of the forward computed in: "high" is TF32 on a GPU.
        "float32_matmul_precision": "high" if model.tf32 else torch.get_float32_matmul_precision(),
        "attention_implementation": f"{ATTN_IMPLEMENTATION} ({output_description(model.dtype, model.config.get_text_config().model_type)}; float32 rows recomputed from post-RoPE q/k)",
        "library_versions": _library_versions(),
        "attngeom_version": __version__,
        "command_line": shlex.join(request.command_line),
        "shard": list(plan.shard) if plan.shard else None,
    }


def run_layout(plan: ExtractPlan, config: Any, captures: dict[int, LayerCapture], values_dtype: str) -> RunLayout:
    """The run's layout, read off one forward's ``captures`` of the model of ``config``."""
    layers = check_recorded(config, list(captures))
    n_kv, head_dim, layer_kv_heads, layer_head_dims = layer_shapes(
        {l: captures[l].values for l in layers}, {l: captures[l].attn_last.shape[1] for l in layers})
    n_heads = captures[layers[0]].attn_last.shape[1]
    attendable = [captures[layer].attendable.cpu().numpy().astype(bool) for layer in layers]
    window = [int(a.sum()) if a.sum() < plan.length else 0 for a in attendable]
    return RunLayout(
        n_layers=len(layers),
        layers=layers,
        # A model may give learned sinks to some layers only (MiMo-V2-Flash's sliding ones).
        learned_sinks=any(captures[l].learned_sink is not None for l in layers),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        length=plan.length,
        head_kv=tuple(h // (n_heads // n_kv) for h in range(n_heads)),
        window=tuple(window),
        attendable=tuple(tuple(bool(x) for x in a) for a in attendable),
        layer_kv_heads=layer_kv_heads,
        layer_head_dims=layer_head_dims,
        values_dtype=values_dtype,
        store_rows=plan.request.store_rows,
        queries=plan.queries,
    )
