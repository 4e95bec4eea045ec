"""Extract's write of one run, from begin to commit, as a database writes a transaction
(docs/store.md#commit-protocol).

A :class:`RunWrite`, handed out by the command's
:class:`~attngeom.store.session.StoreSession` (mode "c", which may create the store), owns
every step between the command's checks and its success, every read and write through the
session's one zarr Store: it reads the run's record (:meth:`RunWrite.recorded`, what a
rerun must match), begins (waits for another extract writing the run, by a lock on a local
disk and a lease on an object store; creates the store, or resumes the run, and names the
sequences still to write), creates the run or grows its
arrays before the first sequence, writes and commits each sequence, and commits the write
(consolidated metadata refreshed, the run checked). Leaving the ``with`` block on an error
aborts: a store this write created and that holds no committed sequence is removed, and a
write the store refused (a full disk, a path that cannot be written) is one
:class:`StoreWriteError` counting what was kept, a store that stopped answering one
:class:`StoreUnreachableError` (:mod:`~attngeom.store.objects.network`) the same. On an object
store each write is fenced by the lease (:class:`~attngeom.store.extracted.runs.SequenceWriter`)::

    with StoreSession(url, mode="c") as session:
        write = session.run_write(run_id)
        held = write.recorded()
        with write.begin(total) as begun:
            begun.create(layout, provenance)     # once, before the first sequence
            for seq in begun.todo:
                begun.submit(seq, arrays)
            committed = begun.commit()

A reader sees a sequence once its ``complete`` flag is set (:class:`SequenceWriter`),
whatever becomes of the write.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Mapping
from typing import Any

import numpy as np
import zarr

from attngeom.errors import StoreWriteError
from attngeom.store.objects.preflight import run_created
from attngeom.store.holds.access import consolidate
from attngeom.store.objects.network import network_failure, unreachable
from attngeom.store.holds.lease import Lease, lease_seconds
from attngeom.store.holds.held_store import HeldStore
from attngeom.store.holds.locks import RunLock
from attngeom.store.objects.storage import local_path
from attngeom.store.extracted.runs import (
    IN_FLIGHT,
    SequenceValue,
    SequenceWriter,
    completed,
    create_run,
    n_sequences,
    open_run_group,
    resize_run,
    run_ids,
    run_layout,
    run_provenance,
)
from attngeom.store.objects.schema import ATTR_KEY, RunLayout
from attngeom.store.extracted.checks import check_run

__all__ = ["Begun", "RunWrite"]


class RunWrite:
    """Extract's write of run ``run_id`` through ``session`` (:meth:`StoreSession.run_write`);
    with ``shard = (i, n)`` of the sequences s with s % n == i only (peers write the others)."""

    def __init__(self, session: HeldStore, run_id: str, *, shard: tuple[int, int] | None = None) -> None:
        self.session, self.url, self.run_id, self.shard = session, session.url, run_id, shard

    def recorded(self) -> dict[str, Any] | None:
        """The run's provenance when its creation finished, else None (also where the store
        does not exist yet): what a rerun must match. Creates nothing."""
        root = self.session.root
        if root is None or self.run_id not in run_ids(root):
            return None
        provenance = run_provenance(root, self.run_id)
        return provenance if run_created(provenance) else None

    def begin(self, total: int) -> Begun:
        """Begin writing the run's sequences ``range(total)`` (this shard's): the store is
        created if there is none, the run resumed if it exists. Use it as a ``with`` block."""
        return Begun(self, total)


class Begun:
    """A begun :class:`RunWrite`, from its ``with`` block's start to :meth:`commit`. Inside
    the block, ``todo``: the sequences of ``range(total)`` (this shard's) that are not
    committed yet, in order."""

    def __init__(self, write: RunWrite, total: int) -> None:
        self._write, self.total = write, total
        self.todo: list[int] = []
        self._run: zarr.Group | None = None
        self._writer: SequenceWriter | None = None
        self._state = "new"  # new -> begun -> committed | aborted
        self._exit = contextlib.ExitStack()
        self._lease: Lease | None = None
        self._creating: RunLock | None = None

    def __enter__(self) -> Begun:
        self._require("new", "begin")
        self._state = "begun"
        write = self._write
        path = local_path(write.url)
        # A store this write creates goes again if it fails before committing anything; not
        # with a shard, where a peer may be writing into the new store already.
        self._new_store = path is not None and not path.exists() and write.shard is None
        with self._aborting():
            if path is None and write.shard is None:
                # Two extracts writing one run take turns, also to create it: the second waits,
                # then finds committed what the first wrote (shards split the sequences
                # instead). On an object store nothing else orders the growth of the arrays'
                # metadata, and a writer stopped past its lease is fenced off (SequenceWriter).
                self._lease = Lease(write.session.zstore, write.run_id, "extract",
                                    lease_seconds(write.session.lease_seconds), part="complete")
                self._exit.callback(self._lease.release)
                self._lease.acquire()
            root = write.session.fresh_root()
            run = self._open_run(root)
            if run is None and path is not None and write.shard is None:
                # The same on a local disk, where a run's folder must exist to be locked: until
                # it does (create), the store's runs folder is the lock.
                try:
                    root.require_group("runs")
                except zarr.errors.ContainsGroupError:  # the other creator made it a moment ago
                    pass
                self._creating = RunLock.creating(path, write.run_id, "extract")
                self._exit.callback(self._creating.release)
                self._creating.acquire()
                run = self._open_run(write.session.fresh_root())  # what a creator before it wrote
            if run is not None and path is not None and write.shard is None:
                self._lock_run()
                run = self._open_run(write.session.fresh_root())  # what the other wrote meanwhile
            mine = [i for i in range(self.total) if write.shard is None or i % write.shard[1] == write.shard[0]]
            if run is None:
                self.todo = mine
            else:
                done = set(completed(run).tolist())
                self.todo = [i for i in mine if i not in done]
                self._run = run
        return self

    def create(self, layout: RunLayout, provenance: Mapping[str, Any], *, in_flight: int = IN_FLIGHT) -> RunLayout:
        """Create the run unless it exists (its ``layout`` and ``provenance``), else
        grow its arrays to ``total`` sequences, and open its writer, ``in_flight`` sequences
        written beside the caller (:class:`SequenceWriter`); returns the run's layout as
        recorded (a resumed run's own)."""
        self._require("begun", "create the run")
        if self._writer is not None:
            raise RuntimeError("the run's writer is open already")
        with self._store_errors():
            self._confirm()
            if self._run is None:
                self._run = create_run(self._write.session.root, self._write.run_id, layout, provenance, self.total)
                if self._creating is not None:
                    self._lock_run()
            elif n_sequences(self._run) < self.total:  # grown only once there is something to write
                resize_run(self._run, self.total)
            fence = None if self._lease is None else self._lease.confirm
            self._writer = self._exit.enter_context(SequenceWriter(self._run, in_flight=in_flight, fence=fence))
        return run_layout(self._run)

    def submit(self, seq: int, arrays: Mapping[str, SequenceValue]) -> None:
        """Write sequence ``seq`` (its ``arrays``, each whole or one part per stored layer) and
        commit it, beside the caller (:meth:`SequenceWriter.submit`); raises the error of an
        earlier write."""
        self._require("begun", "write a sequence")
        if self._writer is None:
            raise RuntimeError("create the run before writing its sequences")
        with self._store_errors():
            self._writer.submit(seq, arrays)

    def commit(self) -> int:
        """Wait for every submitted sequence, refresh the consolidated metadata and check
        the run (never a success on a run that does not validate); returns the sequences
        the run holds committed. A shard without a sequence of a run not created commits
        nothing and returns 0."""
        self._require("begun", "commit")
        with self._store_errors():
            if self._writer is not None:
                self._writer.close()
            if self._run is not None:
                self._confirm()
                # Also when nothing was written: an extract killed before refreshing it left it stale.
                consolidate(self._write.session.root)
        self._state = "committed"
        if self._run is None:
            return 0
        check_run(self._write.url, self._run, self._write.run_id)
        return int(completed(self._run).size)

    @property
    def capacity(self) -> int:
        """Sequences the run's arrays are sized for (committed or not); ``total`` before it exists."""
        return self.total if self._run is None else n_sequences(self._run)

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            self._exit.__exit__(kind, *_)  # the writer stopped (waiting for its write), the lock let go
        finally:
            if kind is not None or self._state != "committed":
                self._state = "aborted"
                if self._new_store and not self._holds_committed():
                    self._write.session.remove()

    def _lock_run(self) -> None:
        """Hold the lock of the run's appends on a local disk (its ``complete`` array's folder)
        for the rest of the write, and let the store's runs folder go if this write held it:
        creators of other runs wait for it only until this run's folder exists."""
        lock = RunLock(local_path(self._write.url), self._write.run_id, "extract", part="complete")
        self._exit.callback(lock.release)
        lock.acquire()
        if self._creating is not None:
            self._creating.release()
            self._creating = None

    def _open_run(self, root: zarr.Group) -> zarr.Group | None:
        """The run of ``root`` if its creation finished; None if absent or its creation was
        interrupted (``create_run`` then finishes it, keeping what is already right)."""
        if self._write.run_id not in run_ids(root):
            return None
        run = open_run_group(root, self._write.run_id)
        return run if run_created(run.attrs.get(ATTR_KEY)) else None

    def _confirm(self) -> None:
        """Raise unless this write still holds the run's lease (none on a local disk)."""
        if self._lease is not None:
            self._lease.confirm()

    def _require(self, state: str, what: str) -> None:
        if self._state != state:
            raise RuntimeError(f"cannot {what}: the write of run {self._write.run_id} is {self._state}")

    @contextlib.contextmanager
    def _aborting(self) -> Any:
        """Abort (as :meth:`__exit__` does) when beginning fails: no ``with`` block holds it yet."""
        try:
            yield
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise

    @contextlib.contextmanager
    def _store_errors(self) -> Any:
        """A write the store refuses, as one :class:`StoreWriteError` saying how many of the
        sequences to write are committed and kept, and what to do."""
        try:
            yield
        except Exception as exc:
            if network_failure(exc) is None:
                if isinstance(exc, OSError):
                    self._refused(exc)
                raise
            if self._writer is not None:
                self._writer.__exit__(type(exc), exc, None)
            done = 0 if self._writer is None else len(self._writer.committed)
            kept = (f"{done} of the {len(self.todo)} sequences to write were committed before and are kept"
                    if done else f"none of the {len(self.todo)} sequences to write was committed")
            raise unreachable(self._write.url, exc, kept) from exc

    def _refused(self, exc: OSError) -> None:
        """Raise the :class:`StoreWriteError` of a write the store refused (``exc``)."""
        if self._writer is not None:
            self._writer.__exit__(type(exc), exc, None)  # stopped, its write in flight ended: then counted
        done = 0 if self._run is None else int(np.isin(self.todo, completed(self._run)).sum())
        kept = "; committed sequences are kept:" if done else ";"
        finish = " to finish" if done else ""
        if exc.errno == errno.ENOSPC:
            raise StoreWriteError(
                f"the store ran out of space after {done} of {len(self.todo)} sequences were committed{kept} "
                f"free space and re-run the same command{finish}"
            ) from exc
        raise StoreWriteError(
            f"the store cannot be written at {exc.filename or self._write.url} ({exc.strerror or exc}) after "
            f"{done} of {len(self.todo)} sequences were committed{kept} repair that path and re-run the same "
            f"command{finish}"
        ) from exc

    def _holds_committed(self) -> bool:
        """Whether any run of the store has a committed sequence (True if that cannot be read:
        a store is never removed on a guess)."""
        root = self._write.session.root
        if root is None:
            return True
        try:
            return any("complete" in (run := open_run_group(root, run_id)) and completed(run).size > 0
                       for run_id in run_ids(root))
        except Exception:  # noqa: BLE001
            return True
