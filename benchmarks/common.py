"""Helpers the benchmarks share: statistics, tables, argument lists, timing, BLAS threads,
and a model loaded once through the public loaders (so loading stays out of every timing).

Benchmarks import it as ``from common import ...``: each runs as a script from ``benchmarks/``,
whose folder Python puts first on the import path.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import queue as queue_module
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np


# (heads, kv heads, head_dim) of the paper's five models, for synthetic stores of their shapes.
PAPER_SHAPES = {
    "llama2-7b": (32, 32, 128),
    "llama3.2-1b": (32, 8, 64),
    "mistral-7b": (32, 8, 128),
    "gemma-2b": (8, 1, 256),
    "gemma-7b": (16, 16, 256),
}


def median(xs: list[float]) -> float:
    """The median, NaN for an empty list."""
    return float(statistics.median(xs)) if xs else float("nan")


def rotate(items: list[Any], k: int) -> list[Any]:
    """``items`` started at position ``k`` (mod its length): variants change order per repetition."""
    k %= len(items)
    return items[k:] + items[:k]


def default_n_grid(length: int) -> list[int]:
    """analyze's default selection sizes at context length ``length``: N in {1, 2, 4, ...} below it."""
    return [n for n in (2**k for k in range(length.bit_length())) if n < length]


def int_list(text: str) -> list[int]:
    """'512,1024' -> [512, 1024]."""
    return [int(x) for x in text.split(",") if x.strip()]


def cell(x: Any) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; floats to 3 significant digits (thousands separated from 100 up)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def busy(count: int) -> Iterator[None]:
    """Within the block, ``count`` CPU-bound processes (a Python loop each) compete with the
    benchmark for the machine's cores: the busy machine, made on purpose."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds; CPU time covers every thread of this process."""
    return time.perf_counter(), time.process_time()


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call of ``fn``."""
    w0, c0 = now()
    fn()
    w1, c1 = now()
    return w1 - w0, c1 - c0


class Blas:
    """The thread count of numpy's BLAS (OpenBLAS, MKL), set at run time through threadpoolctl."""

    def __init__(self) -> None:
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p["user_api"] == "blas"]
        self.available = bool(pools)
        self.default = pools[0]["num_threads"] if pools else 1

    def set(self, n: int) -> None:
        """BLAS at ``n`` threads from now on (until the next set)."""
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=int(n), user_api="blas")


@dataclass
class Loaded:
    """A model loaded once through ``attngeom.extract.models``: stock SDPA attention, eval mode."""

    name: str
    model: Any  # transformers causal LM; ag.extract(model, ...) takes it as it is
    tokenizer: Any
    device: str
    dtype: Any
    load_s: float


def load(name: str, device: str = "auto", dtype: str = "auto") -> Loaded:
    """``name`` (an offline name, hub id or folder) loaded with its tokenizer, attention set to
    stock SDPA, so that its decoder-only forward is the reference extract is compared with."""
    from attngeom.extract.models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model

    t0 = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    source = resolve_model(name)
    model = load_model(source, device=dev, dtype=dt)
    model.set_attn_implementation("sdpa")
    tokenizer = load_tokenizer(source)
    return Loaded(name, model, tokenizer, dev, dt, time.perf_counter() - t0)


def synchronize(device: str) -> None:
    """Wait for queued accelerator work, so a wall-clock reading covers it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def store_tokens(store: str) -> np.ndarray:
    """The tokens (S, L) of the one run of ``store``, read through the public API."""
    import attngeom as ag

    opened = ag.open_store(store)
    (run_id,) = opened.runs
    return opened.run(run_id).dataset()["tokens"].values


def extract_store(loaded: Loaded, store: str, *, dataset: str, length: int, count: int, batch_size: int = 1,
                  run_id: str | None = None) -> Any:
    """``ag.extract`` of ``count`` windows of ``length`` tokens of ``dataset`` by the loaded model
    into ``store``; returns its ExtractResult (``seconds``: the per-batch loop and consolidation)."""
    import attngeom as ag

    result = ag.extract(
        loaded.model, tokenizer=loaded.tokenizer, store=store, dataset=dataset, context_length=length,
        num_sequences=count, batch_size=batch_size, run_id=run_id, progress=False,
    )
    assert result.written == count, result
    return result


def open_run(store: str) -> Any:
    """The zarr group of the one run of ``store``, read-only."""
    from attngeom.store import open_root, open_run_group, run_ids

    root = open_root(store, mode="r")
    (run_id,) = run_ids(root)
    return open_run_group(root, run_id)


def add_store_args(p: Any) -> None:
    """Options of the benchmarks that measure a store: an existing one, or one extracted here."""
    p.add_argument("--store", action="append", default=[], help="measure this store (repeatable); no extract")
    p.add_argument("--models", default="gemma3-270m,smollm2-135m", help="comma-separated model names")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--lengths", default="1024", help="comma-separated context lengths")
    p.add_argument("--num-sequences", type=int, default=2, help="sequences per store (default 2)")
    p.add_argument("--workdir", default=None, help="folder for the temporary stores (default: a temp dir)")


def bench_stores(args: Any, workdir: str) -> Any:
    """(model, L, store path, extract loop seconds per sequence) for each store to measure:
    those of ``--store`` (loop NaN), else one extract per model and length into ``workdir``."""
    import sys

    for store in args.store:
        yield store, open_run(store)["tokens"].shape[1], store, float("nan")
    if args.store:
        return
    for name in args.models.split(","):
        loaded = load(name)
        print(f"loaded {name} in {loaded.load_s:.1f}s", file=sys.stderr, flush=True)
        for length in int_list(args.lengths):
            store = f"{workdir}/{name}-L{length}.zarr"
            result = extract_store(loaded, store, dataset=args.dataset, length=length, count=args.num_sequences)
            yield name, length, store, result.seconds / args.num_sequences


def read_inputs(store: str, run_id: str) -> None:
    """Read and decompress analyze's inputs (attn_last, values, winner), a (sequence, layer)
    block at a time, in this process, as analyze's tasks read them (``read_chunk``: the
    shard's index, the chunk, its checksum, Blosc): the time analyze cannot go below."""
    import zarr

    from attngeom.store import read_chunk

    run = zarr.open_group(store, mode="r")[f"runs/{run_id}"]
    arrays = [run["attn_last"], run["values"], run["winner"]]
    n_seq, n_layers = arrays[0].shape[:2]
    for s in range(n_seq):
        for layer in range(n_layers):
            for array in arrays:
                read_chunk(store, array, (s, layer))


def analyze_fresh(store: str, run_id: str, scheduler: str | None = None) -> tuple[float, float]:
    """(wall s, CPU s of this process and its worker processes) of ``ag.analyze`` of ``run_id``
    from scratch: its analysis deleted first."""
    import attngeom as ag
    from attngeom.store import analysis_path

    shutil.rmtree(os.path.join(store, analysis_path(run_id)), ignore_errors=True)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    w0 = time.perf_counter()
    ag.analyze(store, run_id=run_id, progress=False, scheduler=scheduler)
    wall = time.perf_counter() - w0
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, usage))
    return wall, cpu


def _analyze_child(store: str, run_id: str, cores: list[int] | None, queue: Any) -> None:
    if cores is not None:
        os.sched_setaffinity(0, cores)
    queue.put(analyze_fresh(store, run_id))


def analyze_in_child(store: str, run_id: str, cores: list[int] | None = None) -> tuple[float, float]:
    """``analyze_fresh`` in a new interpreter (spawned), as a user's ``attngeom analyze`` runs:
    its workers fork from a process that holds no model, no GPU context and no caches of this
    one. ``cores``: the CPUs the child may use (``os.sched_setaffinity``); all when None."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_analyze_child, args=(store, run_id, cores, queue))
    child.start()
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except queue_module.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the analyze in a child process ended with code {child.exitcode}") from None
    child.join()
    return result


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a table: "-" for none or NaN, thousands grouped, else ``digits`` significant."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


_HERE = os.path.dirname(os.path.abspath(__file__))
# The source tree these benchmarks belong to.
REPO = os.path.dirname(_HERE)


class Kernels:
    """The analysis kernels of the attngeom source tree at ``path``, run in a child interpreter
    (its import path that tree first, BLAS on one thread) that loads them from their numba
    cache. Kernels of two trees compared this way run in processes alike
    (an in-process call and a child's differ by more than two versions of the kernels do).
    Use as a context manager: the child ends on leaving it.
    """

    def __init__(self, path: str, name: str | None = None) -> None:
        self.name = name or path
        # A first child fills the tree's numba cache and ends; the one that serves loads the
        # kernels from it, as analyze does: code loaded from numba's cache can run up to a
        # third slower than code compiled in the process, which would tilt a comparison.
        for serving in (False, True):
            self._child = subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {_HERE!r}); import common; "
                 f"common._serve_kernels({path!r})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            try:
                self._reply()  # imported and compiled, or loaded
            except BaseException:
                self.close()
                raise
            if not serving:
                self._stop()

    def call(self, function: str, *args: Any, **kwargs: Any) -> tuple[Any, float, float]:
        """(``function(*args, **kwargs)`` of ``attngeom.analyze.kernels``, wall s, CPU s of the
        call in the child)."""
        pickle.dump((function, args, kwargs), self._child.stdin)
        self._child.stdin.flush()
        return self._reply()

    def _reply(self) -> Any:
        try:
            reply = pickle.load(self._child.stdout)
        except EOFError:
            raise RuntimeError(f"the kernels of {self.name} ended with code {self._child.wait()}") from None
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._child.poll() is None:
            self._child.stdin.close()  # the child's end of input
            try:
                self._child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._child.kill()

    def __enter__(self) -> Kernels:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class KernelsAt(Kernels):
    """`Kernels` as they were at the git revision ``rev``, checked out into a temporary
    ``git worktree`` (their numba cache lives there: they compile on every use, a minute or
    more), removed on leaving the context."""

    def __init__(self, rev: str) -> None:
        self._repo = REPO
        self._path = tempfile.mkdtemp(prefix="attngeom-kernels-")
        os.rmdir(self._path)  # git worktree add makes it
        subprocess.run(["git", "-C", self._repo, "worktree", "add", "--detach", "--quiet", self._path, rev],
                       check=True)
        try:
            super().__init__(self._path, rev)
        except BaseException:
            self._remove()
            raise

    def close(self) -> None:
        super().close()
        self._remove()

    def _remove(self) -> None:
        subprocess.run(["git", "-C", self._repo, "worktree", "remove", "--force", self._path], check=False)




def _serve_kernels(path: str) -> None:
    """The child of `Kernels`: a function of the tree at ``path``'s ``attngeom.analyze.kernels``
    for each request read (pickled) from stdin, the reply pickled to stdout; anything printed
    goes to stderr."""
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr
    sys.path.insert(0, path)

    def reply(obj: Any) -> None:
        pickle.dump(obj, replies)
        replies.flush()

    try:
        from threadpoolctl import threadpool_limits

        from attngeom.analyze import kernels

        if not sys.modules["attngeom"].__file__.startswith(path):
            raise ImportError(f"attngeom imported from {sys.modules['attngeom'].__file__}, not from {path}")
        threadpool_limits(1)
        if hasattr(kernels, "compile_kernels"):  # the numpy kernels of older revisions compile nothing
            kernels.compile_kernels()
        reply(None)
    except BaseException as error:  # noqa: BLE001 - handed to the parent
        reply(error)
        return
    while True:
        try:
            function, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            w0, c0 = time.perf_counter(), time.process_time()
            result = getattr(kernels, function)(*args, **kwargs)
            reply((result, time.perf_counter() - w0, time.process_time() - c0))
        except BaseException as error:  # noqa: BLE001 - handed to the parent
            reply(error)
