"""One command's store: opened once, passed down to every reader and writer.

A :class:`StoreSession` turns the command's URL into one zarr Store (on an object store one
that reads each node's metadata, shard index and small object once: :mod:`~attngeom.store.cache`)
and its root group, checks the root (schema, format, writability), holds the store as one of
its writers and the runs it writes (their locks, or leases: :mod:`~attngeom.store.lease`),
translates a full disk or a read-only store into :class:`~attngeom.errors.StoreWriteError`,
and looks runs up. What it holds lives exactly as
long as its ``with`` block::

    with StoreSession(url, mode="a") as session:
        run = session.run(run_id)
        with session.derived(run_id, ANALYSIS) as write:
            ...
"""

from __future__ import annotations

import contextlib
from typing import Any

import zarr

from attngeom.errors import StoreNotFoundError, StoreWriteError
from attngeom.store.access import WriterHold, check_writable, checked_root, writing
from attngeom.store.cache import cached
from attngeom.store.derived import DerivedWrite
from attngeom.store.lease import Lease, lease_seconds
from attngeom.store.locks import RunLock
from attngeom.store.nodes import local_path, zarr_store
from attngeom.store.runs import open_run_group, require_run, require_runs

__all__ = ["StoreSession"]


class StoreSession:
    """The store at ``url`` for one command: ``mode`` "r" to read, "a" to write (which also
    refuses a store of another format or one that cannot be written, and holds the store as
    one of its writers: see :func:`~attngeom.store.access.open_root`). Attributes, inside
    the ``with`` block: ``url``, ``zstore`` (the zarr Store) and ``root`` (its root group).
    :class:`StoreNotFoundError` if there is no store, creating nothing;
    :class:`DamagedStoreError` for an unreadable root. ``lease_seconds``: how long the lease
    of a run written on an object store lasts (:func:`~attngeom.store.lease.lease_seconds`)."""

    def __init__(self, url: str, *, mode: str = "r", lease_seconds: float | None = None) -> None:
        self.url, self.mode = url, mode
        self.lease_seconds = lease_seconds
        self.zstore: Any = None
        self.root: zarr.Group | None = None
        self._exit = contextlib.ExitStack()
        self._locked: set[str] = set()
        self._leases: dict[str, Lease] = {}

    def __enter__(self) -> StoreSession:
        writer = self.mode != "r"
        path = local_path(self.url)
        if path is not None and not (path / "zarr.json").is_file():
            # Opening a local store for writing would create its folder.
            raise StoreNotFoundError(f"no attngeom store at {self.url}")
        with contextlib.ExitStack() as stack:
            if writer:
                check_writable(self.url)
                stack.callback(WriterHold(self.url).release)
                stack.enter_context(writing(self.url))
            self.zstore = cached(zarr_store(self.url, read_only=not writer))
            self.root = checked_root(self.zstore, self.url, writing=writer)
            self._exit = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        lost = next((lease.lost for lease in self._leases.values() if lease.lost), None)
        self._locked.clear()
        self._leases.clear()
        suppress = self._exit.__exit__(*exc)
        if lost and exc[0] is None:
            raise StoreWriteError(lost)
        return suppress

    def runs(self) -> list[str]:
        """Ids of the store's runs, sorted; :class:`RunNotFoundError` when it holds none."""
        return require_runs(self.root, self.url)

    def run(self, run_id: str) -> zarr.Group:
        """The run's group; :class:`RunNotFoundError`, naming the runs there are, if none."""
        require_run(self.root, run_id, self.url)
        return open_run_group(self.root, run_id)

    def lock(self, run_id: str, what: str = "writer") -> None:
        """Hold the run's writer lock until the session ends, so that two writers of one run's
        derived groups (two analyzes, an analyze and an ablate: ``what``, named to a writer
        waiting for it) run one after the other. On a local store an advisory lock on the
        run's folder (``flock``), released when the session ends or the process dies; on an
        object store (``s3://``, ``memory://``) a :class:`~attngeom.store.lease.Lease`,
        renewed while held, removed when the session ends and taken over once expired. A
        writer waiting for either says whom it waits for (:mod:`~attngeom.store.locks`)."""
        if run_id in self._locked:
            return
        local = local_path(self.url)
        if local is None:
            lease = Lease(self.zstore, run_id, what, lease_seconds(self.lease_seconds))
            lease.acquire()
            self._exit.callback(lease.release)
            self._leases[run_id] = lease
        else:
            run_lock = RunLock(local, run_id, what)
            self._exit.callback(run_lock.release)
            run_lock.acquire()
        self._locked.add(run_id)

    def check_lock(self, run_id: str) -> None:
        """:class:`StoreWriteError` if the run's lease was lost (taken over by another writer
        after it expired unrenewed): a writer checks before each write of a commit record."""
        if run_id in self._leases:
            self._leases[run_id].check()

    def derived(self, run_id: str, kind: str, *, deep: bool = False) -> DerivedWrite:
        """The update of ``runs/<run_id>/<kind>`` (:class:`~attngeom.store.derived.DerivedWrite`),
        the run locked for the rest of the session."""
        return DerivedWrite(self, run_id, kind, deep=deep)
