"""How the capture uses a CPU's cores: a layer's tiles (and the copies that lay out its inputs
and gather its output, one kv head per item) shared out among threads of one torch thread
each, which take the next item whenever they are free and meet when the last item ends.

A tile is some twenty operators (docs/design-notes.md#extract-score-tiles-and-threads); run on
torch's threads, each is an OpenMP parallel region that ends in a barrier, and with OpenMP's
spinning wait and any other work on the machine every barrier waits for a descheduled peer.
Whole tiles per thread pay no barrier but the one at the layer's end, and a thread that the
machine slows takes fewer tiles. Each tile's operators run on one torch thread wherever it
runs, so the results are the same bits for any thread count.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from attngeom.extract.phases import profiling

__all__ = ["one_thread", "share_out", "tile_threads"]

T = TypeVar("T")

_lock = threading.Lock()
# The process's tile threads, made at first use and grown on demand; (pid, size, executor),
# remade in a forked child, which inherits the executor but none of its threads.
_pool: tuple[int, int, ThreadPoolExecutor] | None = None


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Within the block, torch runs its CPU operators on one thread in the calling thread (its
    thread count is restored on exit); on other devices, a no-op."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tile_threads(device: torch.device) -> int:
    """How many threads share out a layer's tiles: on CPU the calling thread's torch thread
    count (torch.set_num_threads, OMP_NUM_THREADS), elsewhere 1 (one stream runs them)."""
    return torch.get_num_threads() if device.type == "cpu" else 1


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < size:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), size, _started(size))
        return _pool[2]


def _started(size: int) -> ThreadPoolExecutor:
    """``size`` threads, each set to one torch thread before this returns. torch's
    set_num_threads also sets the count that every thread starting later takes (ATen keeps
    one for the process): the caller's is set again after, so that threads started later,
    the caller's own, take the caller's count, not the pool's."""
    caller = torch.get_num_threads()
    executor = ThreadPoolExecutor(size, thread_name_prefix="attngeom-tiles")
    # Each waits for all the others, so each runs in a thread of its own.
    everyone = threading.Barrier(size)
    wait([executor.submit(lambda: (torch.set_num_threads(1), everyone.wait())) for _ in range(size)])
    torch.set_num_threads(caller)
    return executor


def share_out(fn: Callable[[T], None], items: Sequence[T], threads: int) -> None:
    """``fn(item)`` for every item, on the calling thread as it is and up to ``threads - 1`` pool
    threads of one torch thread each, under the caller's grad and inference modes; each thread
    takes the next item when it is free. Returns when every call has ended; raises the first
    error. With one thread, one item, or under torch.profiler (whose ranges are the calling
    thread's alone), every call runs in the calling thread."""
    threads = min(threads, len(items))
    if threads <= 1 or profiling():
        for item in items:
            fn(item)
        return
    taken = itertools.count()  # next() of a count is atomic: one C call under the GIL
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def work() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            while (i := next(taken)) < len(items):
                fn(items[i])

    executor = _executor(threads - 1)
    futures = [executor.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        wait(futures)
    for future in futures:
        future.result()
