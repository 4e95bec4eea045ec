"""What the stages that load a run's model again (ablate, detect) decide before torch loads:
the device asked for, how many sequences the run has committed, and the model: where it is
now and whether its architecture and shapes are the run's. The weights themselves (their
file hash, or the state dict of a model extracted from memory) are compared by
:mod:`attngeom.extract.runmodel` once they are found, before the model runs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from attngeom.errors import InputError
from attngeom.extract.families import attention_layers
from attngeom.extract.sources import hub_cached_config, model_name
from attngeom.limits import exceeds_memory

__all__ = [
    "STAGE_DTYPES", "check_device", "check_run_model", "committed_count", "layer_differences", "model_shapes",
]

DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# ablate's and detect's: float32-tf32 is extract's alone (TF32 inside its forward).
STAGE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# GPU device files on Linux: NVIDIA's driver, WSL's, ROCm's (torch calls a ROCm GPU "cuda").
_GPU_FILES = ("nvidia[0-9]*", "dxg", "kfd")


def check_device(device: str) -> None:
    """Refuse a ``device`` that is not auto, cpu, cuda or cuda:N, and a CUDA device where
    there is certainly none: a CPU build of torch, macOS, or Linux without a GPU's device
    file. Where these cannot tell, torch decides once it loads."""
    if not DEVICES.match(device):
        raise InputError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and (why := _no_cuda()):
        raise InputError(f"--device {device} asked for, but {why}: use --device cpu or auto")


def _no_cuda() -> str | None:
    try:
        build = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None  # its import says so
    if build.endswith("+cpu"):
        return f"the installed torch ({build}) is a CPU build"
    if sys.platform == "darwin":
        return "torch has no CUDA on macOS"
    if sys.platform.startswith("linux") and not any(any(Path("/dev").glob(p)) for p in _GPU_FILES):
        return "this machine has no GPU (no /dev/nvidia*)"
    return None


def committed_count(url: str, run_id: str) -> int | None:
    """How many sequences run ``run_id`` has committed, from its commit flags (zarr alone,
    none of the store package's libraries); None when they cannot be read, so that the
    store package, which names damage, decides."""
    try:
        import zarr

        from attngeom.store.objects.storage import zarr_store

        # The store's own Store: a local one opens no link out of the store, no device.
        flags = zarr.open_array(store=zarr_store(url, read_only=True), path=f"runs/{run_id}/complete", mode="r")
        if exceeds_memory(flags.nbytes):
            return None  # flags no machine holds: named by the store package, not read
        return int((flags[:] == 1).sum())
    except Exception:  # noqa: BLE001 - damage and missing arrays are named by the store package
        return None


# The names config.json files give what a run's layout records, the most common first.
_NAMES = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    # A model whose values are narrower than its queries and keys (multi-head latent
    # attention) records the values' width.
    "head_dim": ("v_head_dim", "head_dim"),
}


# The counts of layers a file that lists each layer as two blocks doubles.
_BLOCK_COUNTS = ("num_hidden_layers", "n_input_layers", "n_recurrent_layers", "n_output_layers")


def _paired_blocks(text: dict[str, Any]) -> dict[str, Any]:
    """A text config that lists each layer as an attention block and an mlp block (Dory's
    files, as its released checkpoints are written) as its config class reads it: one kind per
    layer, the counts of layers halved; any other as it is."""
    kinds = text["layer_types"]
    if len(kinds) % 2 or kinds[1::2] != ["mlp"] * (len(kinds) // 2):
        return text
    return {**text, "layer_types": kinds[::2],
            **{k: text[k] // 2 for k in _BLOCK_COUNTS if isinstance(text.get(k), int)}}


def model_shapes(config: dict[str, Any]) -> dict[str, Any]:
    """What a run records of a model, from its ``config.json`` mapping (the text config of a
    multimodal one): architecture, all its layers, the indices of its softmax-attention
    layers (None where the file declares no ``layer_types``), heads, the values' head
    dimension; None for what the file does not say. Not the kv heads: families name them in
    several ways, some of which another family's file may carry unused (GPT-2's
    ``num_key_value_heads``, Falcon's ``multi_query``); the weights' hash tells them apart."""
    text = config.get("text_config") or config

    def named(key: str) -> int | None:
        return next((text[n] for n in _NAMES[key] if isinstance(text.get(n), int) and text[n] > 0), None)

    n_layers, heads, hidden = named("n_layers"), named("n_heads"), named("hidden")
    kinds = text.get("layer_types")
    attention = None
    if n_layers is not None and isinstance(kinds, list) and len(kinds) == n_layers:
        # The whole text config: a looped stack's fields tell the layers its loops add.
        declared = _paired_blocks({**text, "num_hidden_layers": n_layers})
        n_layers, attention = declared["num_hidden_layers"], attention_layers(SimpleNamespace(**declared))
    return {
        "model_type": text.get("model_type"),
        "n_layers": n_layers,
        "attention_layers": attention,
        "n_heads": heads,
        "head_dim": named("head_dim") or (hidden // heads if heads and hidden else None),
    }


def _span(layers: Any) -> str:
    layers = list(layers)
    return f"0-{layers[-1]}" if layers == list(range(len(layers))) and len(layers) > 2 else ", ".join(map(str, layers))


def layer_differences(shapes: dict[str, Any], layout: dict[str, Any]) -> list[str]:
    """How a model's layers (:func:`model_shapes`) differ from those a run's ``layout``
    stored (its ``layers``, the model's own indices, else 0..n_layers-1): the model's
    softmax-attention layers where its config declares its layer kinds; else all its layers,
    where the run stored layers 0..n-1, or at least as many as the run's highest index."""
    stored = [int(i) for i in layout.get("layers") or range(int(layout.get("n_layers") or 0))]
    total = shapes["n_layers"]
    if not stored or total is None:
        return []
    expected = shapes["attention_layers"]
    if expected is None and stored == list(range(len(stored))):
        expected = tuple(range(total))
    if expected is not None:
        if list(expected) == stored:
            return []
        return [f"softmax-attention layers {_span(expected)} of {total} (the run's: {_span(stored)})"]
    return [] if max(stored) < total else [f"{total} layers (the run's include layer {max(stored)})"]


_SHAPE_WORDS = {"model_type": "architecture", "n_heads": "heads", "head_dim": "head dimension"}


def check_run_model(model: Any, record: dict[str, Any], run_id: str, stage: str) -> None:
    """Refuse, before torch loads, a ``model`` that cannot be the run's (``record``: its
    provenance and layout): none given for a run of a model in memory or whose recorded
    name is found no more; a name that names nothing; a model whose config says another
    architecture or other shapes than the run's layout; a loaded model for a run of a
    named one. ``model``: None, a name, GGUF file, folder or hub id (where the run's model
    is now), or a loaded transformers model."""
    recorded = record.get("model") or {}
    from_memory = recorded.get("source") == "memory"
    if model is None:
        if from_memory:
            raise InputError(
                f"run '{run_id}' was extracted from a model in memory ({recorded.get('class')}): pass it, or the "
                "folder, GGUF file or hub id its weights are saved in, as model=",
                command_line=f"run '{run_id}' was extracted from a model in memory ({recorded.get('class')}): "
                "give --model with the folder, GGUF file or hub id its weights are saved in",
            )
        if "id" not in recorded:
            raise InputError(f"run '{run_id}' records no model in its provenance")
        try:
            model_name(recorded["id"])
        except InputError as exc:
            gone = Path(recorded["id"]).is_absolute() and not Path(recorded["id"]).exists()
            why = "which is not there any more" if gone else f"which cannot be used now ({exc})"
            raise InputError(
                f"run '{run_id}' was extracted from '{recorded['id']}', {why}: pass model= with where it is now",
                command_line=f"run '{run_id}' was extracted from '{recorded['id']}', {why}: give --model with where "
                "it is now (a name, a .gguf file, a folder or a hub id)",
            ) from None
        return
    if not isinstance(model, str | os.PathLike):
        if not from_memory:
            raise InputError(
                f"run '{run_id}' was extracted from '{recorded.get('id')}', which {stage} loads itself: drop model=, "
                "or pass where that model is now"
            )
        return  # its state dict is compared with the record's once torch is loaded
    name = str(model)
    found = model_name(name)
    config = _config_of(name)
    if config is None:
        return  # a GGUF file: its hash is compared before its weights load
    layout = record.get("layout") or {}
    have = model_shapes(config)
    want = {"model_type": record.get("model_type"), **{k: layout.get(k) for k in _SHAPE_WORDS if k != "model_type"}}
    # The architecture first, then the layers, then the shapes of each layer.
    diffs = [f"{_SHAPE_WORDS[k]} {have[k]} (the run's: {want[k]})" for k in _SHAPE_WORDS
             if want[k] is not None and have[k] is not None and have[k] != want[k]]
    first = int(bool(diffs) and diffs[0].startswith(_SHAPE_WORDS["model_type"]))
    diffs[first:first] = layer_differences(have, layout)
    if diffs:
        raise InputError(
            f"model {found.id} is not the model of run '{run_id}': its " + ", ".join(diffs),
        )


def _config_of(name: str) -> dict[str, Any] | None:
    """The config.json of a model folder, or of a hub id in the local hub cache; None for a
    GGUF file, an offline name, or a hub id not cached."""
    path = Path(name).expanduser()
    if path.is_dir():
        file = path / "config.json"
    elif name.endswith(".gguf") or "/" not in name:
        return None
    else:
        file = hub_cached_config(name)
        if file is None:
            return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: transformers says why when it loads it
