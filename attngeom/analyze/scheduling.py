"""Where analyze's tasks run: local worker processes, Dask's threads, or a cluster."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import dask
import dask.multiprocessing
import dask.threaded
from dask.system import cpu_count
from threadpoolctl import threadpool_limits

from attngeom.errors import AttngeomError

__all__ = ["dask_client"]

# prctl(2): deliver this signal to the child when the thread that forked it ends.
_PR_SET_PDEATHSIG = 1
# mallopt(3) parameters of glibc, and a worker's settings: allocations up to 32 MiB (the
# largest threshold glibc takes) come from its heap, and freed memory stays there up to 1 GiB.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 1 << 30


def _forks() -> bool:
    """Whether worker processes can be forked: on Linux. Forked workers start in
    milliseconds and never import the caller's script again (spawned ones run an unguarded
    notebook-like script once more); macOS's system libraries are not safe to fork."""
    return sys.platform.startswith("linux")


def _start_worker() -> None:
    # Ctrl-C reaches the whole process group: the parent stops the analyze, not each worker
    # with a traceback of its own. A SIGKILLed parent takes its workers with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # A task's large temporaries (a kv head's Gram matrix, 8 MB at L = 1024, its pair lists,
    # the products of every aggregate) would otherwise go back to the kernel when freed and
    # come again as fresh zeroed pages in the next task: 12% of the workers' CPU analyzing
    # smollm2-135m at L = 1024. A worker's heap then stays at the size of its largest task.
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


@contextlib.contextmanager
def _worker_processes(n: int) -> Iterator[ProcessPoolExecutor]:
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker)
    # The workers fork now, from this thread: a worker is killed when the thread that forked
    # it ends (PR_SET_PDEATHSIG, above), and a pool forks at its first task, which can come
    # from a thread that ends before the pool does (the analyze's batch threads).
    pool.submit(int)
    try:
        yield pool
    finally:
        # Tasks last a second at most; waiting for the running ones lets the pool close its
        # pipes before the interpreter's exit handlers use them.
        pool.shutdown(cancel_futures=True)


@contextlib.contextmanager
def dask_client(scheduler: str | None, store: str) -> Iterator[object | None]:
    """Run the Dask computations of the block on:

    - ``None`` (the default): one worker process per core, forked from this one (Linux with
      more than one core; elsewhere Dask's threads);
    - ``"threads"``: Dask's threads in this process, one per core;
    - ``"processes"``: a ``dask.distributed`` LocalCluster of worker processes;
    - anything else: the address of an existing Dask scheduler.

    A ``memory://`` store lives in this process only, so it is always analyzed with threads.
    Each worker (process or thread) runs numpy with one BLAS thread.

    Processes are the default because the analysis kernels hold the GIL in many small numpy
    steps, so threads share a core's worth of them; a LocalCluster costs more to start and
    stop than it gains on one machine.
    """
    # Schedulers are set as functions, not names: for a name, every compute asks whether
    # dask.distributed is installed, which imports it (0.33 s of an analyze in a fresh
    # process, half of it parsing its YAML configuration) where no cluster is used.
    local, cores = store.startswith("memory://"), cpu_count()
    if scheduler is None and not local and _forks() and cores > 1:
        # One task at a time to each worker: Dask hands them out six at a time, so 16
        # tasks on 2 workers went 6 + 4 to one and 6 to the other, which then waited for it a
        # third of the analyze (a task is a tenth of a second or more; handing one out, a
        # millisecond).
        with threadpool_limits(limits=1), _worker_processes(cores) as pool, \
                dask.config.set(scheduler=dask.multiprocessing.get, pool=pool, chunksize=1):
            yield None
        return
    if scheduler in (None, "threads") or local:
        # Dask's threads already fill the cores; a multi-threaded BLAS under each one
        # oversubscribes them (measured 1.3-1.5x slower). Distributed workers set this too.
        # A thread per core, named: called from a thread other than the main one (the
        # analyze's batch threads), Dask's threads number Python's default, cores + 4, and
        # six tasks on two cores took a fifth more CPU time each.
        with dask.config.set(scheduler=dask.threaded.get, num_workers=cores), threadpool_limits(limits=1):
            yield None
        return
    # The client is this block's scheduler alone: a default client sets Dask's scheduler
    # when made and resets it only when closed as the last client alive, so one that fails to
    # connect left it set until collected, and later computations of this process asked
    # for a client that was gone.
    with _client(scheduler) as client, dask.config.set(scheduler=client):
        yield client


@contextlib.contextmanager
def _client(scheduler: str) -> Iterator[object]:
    from distributed import Client, LocalCluster
    from distributed.comm import parse_address
    from distributed.comm.registry import get_backend

    if scheduler == "processes":
        # A task's error reaches the client, which reports it in one line; the workers' own
        # error log of it would print the traceback again.
        with LocalCluster(threads_per_worker=1, processes=True, dashboard_address=":0",
                          silence_logs=logging.CRITICAL) as cluster, Client(cluster, set_as_default=False) as client:
            yield client
        return
    try:
        # An address of a scheme Dask does not know is refused before a client is made: one
        # that fails so inside its constructor is closed only when collected, at the
        # interpreter's exit, where closing waits 20 s and prints a traceback.
        get_backend(parse_address(scheduler)[0])
        client = Client(scheduler, timeout="10s", set_as_default=False)
    except (OSError, ValueError) as exc:  # ValueError: an address scheme Dask does not know
        raise AttngeomError(f"cannot reach the Dask scheduler at {scheduler} ({exc})") from exc
    with client:
        yield client
