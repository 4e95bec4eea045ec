"""Model resolution and loading: hub ids, local folders, GGUF files (read through the plain
folder :mod:`attngeom.extract.gguf_files` converts them into once) and the offline names
(docs/cli.md#models); a model given in memory checked, placed and identified; the compute
device and dtype."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from attngeom.errors import InputError
from attngeom.extract.families import supported_config
from attngeom.extract.gguf_files import converted_folder, offline_gguf, one_time_progress
from attngeom.extract.hashing import file_sha256, state_dict_sha256
from attngeom.extract.placement import uses_accelerator
from attngeom.extract.saved_tokenizer import folder_tokenizer
from attngeom.extract.sources import OFFLINE_MODELS, ModelSource, cache_dir, hub_address, memory_model_id

# float32-tf32: float32 weights and activations, float32 matmuls in TF32 on a GPU (inside
# extract's forward only: forward.matmul_precision).
COMPUTE_DTYPES = {"float32": torch.float32, "float32-tf32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}


@contextlib.contextmanager
def library_bars(progress: bool) -> Iterator[None]:
    """Within the block, transformers' and huggingface_hub's own bars (loading weights,
    downloads) and the details of a model's one-time preparation (the steps of a GGUF's
    conversion, their bars) are shown only with ``progress``; as they were after."""
    if progress:
        yield
        return
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with one_time_progress(False):
            yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def resolve_model(name: str) -> ModelSource:
    """Resolve an offline name, a GGUF file, a local folder or a hub id, without loading weights."""
    if name in OFFLINE_MODELS:
        gguf, sha256 = offline_gguf(name)
        return ModelSource(name, str(gguf.parent), gguf_file=gguf.name, file_sha256=sha256 or file_sha256(gguf))
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise InputError(f"GGUF file {name} does not exist")
        return ModelSource(str(path.resolve()), str(path.resolve().parent), gguf_file=path.name, file_sha256=file_sha256(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise InputError(f"model folder {name} has no config.json")
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        digest = hashlib.sha256()
        for w in weights:
            digest.update(w.name.encode())
            digest.update(file_sha256(w).encode())
        return ModelSource(str(path.resolve()), str(path.resolve()), file_sha256=digest.hexdigest())
    hub = hub_address()
    try:
        from transformers import AutoConfig

        # An unreachable hub is asked nothing: its client would retry for half a minute.
        config = AutoConfig.from_pretrained(name, local_files_only=hub is None)
    except Exception as exc:  # transformers raises OSError, ValueError or HTTP errors here
        why = (
            "is not in the local hub cache, and the hub cannot be reached (offline)" if hub is None
            else f"and the hub ({hub}) could not resolve it ({type(exc).__name__})"
        )
        raise InputError(
            f"unknown model '{name}': not an offline name ({', '.join(OFFLINE_MODELS)}), "
            f"not a local folder or .gguf file, {why}"
        ) from exc
    return ModelSource(name, name, revision=getattr(config, "_commit_hash", None))


def _folder(source: ModelSource) -> str:
    return str(converted_folder(source)) if source.gguf_file else source.path


def load_config(source: ModelSource) -> Any:
    """The model's text config; refuses a model whose attention the capture cannot read
    (:func:`attngeom.extract.families.supported_config`)."""
    from transformers import AutoConfig

    return supported_config(AutoConfig.from_pretrained(_folder(source)))


def load_tokenizer(source: ModelSource) -> Any | None:
    """The model's tokenizer; None where it has none (:func:`attngeom.extract.saved_tokenizer.folder_tokenizer`)."""
    return folder_tokenizer(_folder(source), source.name)


def load_model(source: ModelSource, *, device: str, dtype: torch.dtype,
               device_map: str | dict[str, str | int] | None = None) -> torch.nn.Module:
    """The causal LM in eval mode, with the attention implementation transformers picks for
    it (sdpa, or eager where the model needs it, e.g. Gemma 2's softcapped logits). ablate
    runs it as it is; extract switches it to the capture for its forwards. With ``device_map``
    (:func:`attngeom.extract.placement.parse_device_map`) accelerate places its modules over
    the GPUs, the CPU and the disk (a folder under the cache, removed with the model), and
    ``device`` only says where its inputs start."""
    from transformers import AutoModelForCausalLM

    if device_map is None:
        with _weights_read(source):
            model = AutoModelForCausalLM.from_pretrained(_folder(source), dtype=dtype)
        return model.to(device).eval()
    folder = cache_dir() / "offload"
    folder.mkdir(parents=True, exist_ok=True)
    offload = tempfile.mkdtemp(dir=folder, prefix="weights-")
    try:
        with _weights_read(source):
            model = AutoModelForCausalLM.from_pretrained(_folder(source), dtype=dtype, device_map=device_map,
                                                         offload_folder=offload)
    except BaseException:
        shutil.rmtree(offload, ignore_errors=True)
        raise
    weakref.finalize(model, shutil.rmtree, offload, True)
    return model.eval()


@contextlib.contextmanager
def _weights_read(source: ModelSource) -> Iterator[None]:
    """Within the block, a weights file the safetensors library cannot read (one whose header
    passed :func:`~attngeom.extract.model_files.check_safetensors`: a dtype or shape it does
    not know) is :class:`InputError` naming the model, not the library's traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        raise InputError(f"the weights of {source.name} cannot be read: {exc}; download or save the model "
                         "again") from exc


def map_device(device_map: str | dict[str, str | int]) -> str:
    """Where the inputs of a model placed by ``device_map`` start: the first GPU when the map
    uses one, else the CPU (accelerate moves them to each module's device)."""
    return "cuda" if uses_accelerator(device_map) and torch.cuda.is_available() else "cpu"


def loaded_model(model: Any) -> Any:
    """A causal LM given in memory, checked: a transformers model whose attention the capture reads."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not hasattr(model, "get_decoder"):
        raise InputError(
            f"model must be a name or path, or a loaded transformers causal LM; got {type(model).__name__}"
        )
    supported_config(model.config, type(model))
    return model


def memory_provenance(model: Any) -> dict[str, Any]:
    """Provenance of a model given in memory: its class, config and state-dict hash.

    The config's private entries (the attention implementation among them) and the
    transformers version are left out: they say how the model runs, not what it is.
    """
    import json

    config = json.loads(model.config.to_json_string(use_diff=False))
    cls = type(model)
    return {
        "id": memory_model_id(model),
        "source": "memory",
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "name_or_path": model.config.name_or_path or None,
        "config": {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"},
        "state_dict_sha256": state_dict_sha256(model),
    }


def model_placement(model: torch.nn.Module, device: str, dtype: str) -> tuple[str, torch.dtype]:
    """(device, dtype) of a model given in memory. attngeom never moves or casts a caller's
    model: ``device`` and ``dtype`` must be "auto" or what the model already has."""
    param = next(model.parameters())
    have_device, have_dtype = param.device, param.dtype
    if device != "auto" and torch.device(device) != have_device and not (
        torch.device(device).index is None and torch.device(device).type == have_device.type
    ):
        raise InputError(
            f"the model is on {have_device} and attngeom does not move a model: call model.to({device!r}) "
            "first, or leave device='auto'"
        )
    if dtype != "auto" and resolve_dtype(dtype) != have_dtype:
        raise InputError(
            f"the model computes in {str(have_dtype).removeprefix('torch.')} and attngeom does not cast a "
            f"model: call model.to(torch.{str(resolve_dtype(dtype)).removeprefix('torch.')}) first, or leave dtype='auto'"
        )
    return str(have_device), have_dtype


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str) -> torch.dtype:
    """The compute dtype of a named model: "auto" is float32 on every device. In bfloat16,
    1.4-1.9% of the stored winners and a third of the F_8 values moved, and near-tie regimes
    flipped (smollm2-135m, gemma3-270m; README, benchmarks/dtype_effect.py); float32 is what
    CPU and GPU agree on."""
    if dtype == "auto":
        return torch.float32
    if dtype not in COMPUTE_DTYPES:
        raise InputError(f"dtype {dtype!r}: use auto, {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[dtype]
