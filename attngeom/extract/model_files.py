"""A model's files read as a stranger's: the sizes its config declares and the headers of its
safetensors files, checked before anything is allocated, iterated or loaded by them. A
config claiming 10**9 layers would otherwise be walked layer by layer (and its model built
until memory runs out); a truncated weights file would fail inside the loader, after the
model was built. Light: reads JSON and a few header bytes, never a tensor, no torch.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attngeom.errors import InputError
from attngeom.extract.positions import POSITION_KEYS
from attngeom.limits import memory_bytes, size_text

__all__ = ["check_config_sizes", "check_safetensors"]

# The names a config gives each count (transformers' own first, then those its config classes
# map to it: ``attribute_map``). Every one present is checked: the JSON of a config class with
# an alias may hold both names, and a hostile one two different values.
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
COUNT_KEYS = (
    *LAYER_KEYS, *HIDDEN_KEYS, "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
    "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "n_positions", "max_seq_len",
    "num_local_experts", "num_experts", "n_routed_experts",
)
# What a model holds in memory per layer wherever its weights are placed (the disk, with a
# device map): its modules and parameter objects, over a KiB a layer.
_LAYER_OBJECT_BYTES = 1024
# The fewest bytes a weight takes: 4-bit quantized.
_QUANTIZED_WEIGHT_BYTES = 0.5
_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
# safetensors refuses a header longer than this (its own limit, 100 MB).
_MAX_HEADER = 100_000_000


def _get(config: Mapping[str, Any] | Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    # A heterogeneous config (Gemma 4's wider global layers) refuses a global read of a count
    # that varies per layer: its own value, that of every layer it does not override, is read.
    if key in (getattr(config, "per_layer_attributes", None) or ()):
        return vars(config).get(key)
    return getattr(config, key, None)


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def check_config_sizes(config: Mapping[str, Any] | Any, model: str, cache: Path) -> None:
    """Refuse a config (its ``config.json`` mapping, or a transformers config object; a
    multimodal one's text config is checked too) whose counts are no non-negative integers,
    or whose layers this machine could not hold: their modules (over a KiB each) beyond its
    memory, or their weights (at least hidden size squared per layer, in the config's dtype)
    beyond its memory and the free disk under ``cache``, where a device map offloads them.
    :class:`InputError` naming ``model`` and the count."""
    text = _get(config, "text_config") or config
    for part in (config, text) if text is not config else (config,):
        for key in COUNT_KEYS:
            value = _get(part, key)
            # A position limit of -1 says there is none (XLNet's relative positions).
            unlimited = key in POSITION_KEYS and value == -1
            # A list holds a count per layer (Gemma 3n's intermediate sizes).
            per_layer = isinstance(value, list) and value and all(_is_count(v) for v in value)
            if value is not None and not unlimited and not per_layer and not _is_count(value):
                raise InputError(f"the config of {model} declares {key} = {value!r}, which is no count of anything")
    layers = max((_get(text, k) or 0 for k in LAYER_KEYS), default=0)
    hidden = max((_get(text, k) or 0 for k in HIDDEN_KEYS), default=0)
    memory = memory_bytes()
    if layers * _LAYER_OBJECT_BYTES > memory:
        raise InputError(f"the config of {model} declares {layers:,} layers, more than this machine's "
                         f"{size_text(memory)} of memory could hold the modules of; is it the model's own config?")
    quantized = _get(config, "quantization_config") is not None
    dtype = str(_get(text, "dtype") or _get(text, "torch_dtype") or _get(config, "dtype") or "")
    per_weight = _QUANTIZED_WEIGHT_BYTES if quantized else _DTYPE_BYTES.get(dtype, 2)
    weights = layers * hidden * hidden * per_weight
    room = memory + shutil.disk_usage(_existing(cache)).free
    if weights > room:
        raise InputError(
            f"the config of {model} declares {layers:,} layers of hidden size {hidden:,}: at least "
            f"{size_text(weights)} of weights, more than this machine's memory and free disk ({size_text(room)}); "
            "is it the model's own config?"
        )


def _existing(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header says it is not whole: shorter than its header,
    a header that is no JSON object of tensors, or tensors whose data end before or after
    the file does. Reads the header alone. :class:`InputError` naming the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path} is truncated ({size} bytes): no safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise InputError(f"{path} is truncated or no safetensors file: its header claims {length:,} bytes, "
                             f"the file holds {size:,}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
        ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise InputError(f"{path} is no safetensors file: its header does not list tensors") from None
    data = size - 8 - length
    if max(ends, default=0) != data:
        what = "truncated" if max(ends, default=0) > data else "longer than its tensors"
        raise InputError(f"{path} is {what}: its tensors take {max(ends, default=0):,} bytes, the file holds "
                         f"{data:,} after its header; download or save the model again")
