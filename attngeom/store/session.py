"""One command's store: opened once, passed down to every reader and writer.

A :class:`StoreSession` turns the command's URL into one zarr Store (on an object store one
that reads each node's metadata, shard index and small object once: :mod:`~attngeom.store.objects.cache`)
and its root group, checks the root (schema, format, writability), holds the store as one of
its writers and the runs it writes (their locks, or leases: :mod:`~attngeom.store.holds.lease`),
translates a full disk or a read-only store into :class:`~attngeom.errors.StoreWriteError`
and a store that stops answering into :class:`~attngeom.errors.StoreUnreachableError`,
and looks runs up. Its writers are the derived groups' (:meth:`StoreSession.derived`) and
extract's write of a run (:meth:`StoreSession.run_write`, in mode "c", which may create
the store). Every read of the command goes through it: :meth:`StoreSession.reader`
hands out a :class:`RunReader`, one run's url, id and group together, which reads the run's
arrays, its lazy Dataset, its provenance and its committed derived groups, and makes the
checks a reader needs. What it holds lives exactly as long as its ``with`` block::

    with StoreSession(url, mode="a") as session:
        heads = session.reader(run_id).derived(ANALYSIS, "heads", missing_ok=True)
        with session.derived(run_id, ANALYSIS) as write:
            ...

A reading session holds no lock and no writers' hold: :meth:`StoreSession.reading` opens
one that needs no ``with`` block, for a reader that outlives its caller's
(:func:`attngeom.handles.open_store`).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import zarr

from attngeom.errors import AttngeomError, GroupNotFoundError, StoreNotFoundError, StoreWriteError
from attngeom.store.holds.access import WriterHold, check_writable, checked_root, create_root, writing
from attngeom.store.objects.cache import cached, drop_kept
from attngeom.store.extracted.chunks import read_chunk
from attngeom.store.objects.damage import damaged_chunk
from attngeom.store.holds.lease import HeldObject, Lease, lease_seconds
from attngeom.store.objects.network import reaching, unreachable
from attngeom.store.extracted.run_write import RunWrite
from attngeom.store.holds.locks import RunLock, wait_for_writer
from attngeom.store.objects.storage import local_path, zarr_store
from attngeom.store.extracted.runs import (
    RunLayout,
    completed,
    open_run_group,
    require_run_group,
    require_runs,
    run_ids,
    run_layout,
)
from attngeom.store.objects.schema import ATTR_KEY, run_path
from attngeom.store.extracted.checks import check_arrays, check_committed, check_run, lost_objects, reading_run

if TYPE_CHECKING:
    import xarray as xr

    from attngeom.store.derived_groups.derived import DerivedWrite

__all__ = ["Check", "RunReader", "StoreSession", "replace_groups"]

# What a reader checks of a run before it reads (:meth:`RunReader.check`).
Check = Literal["arrays", "committed", "full"]


class StoreSession:
    """The store at ``url`` for one command: ``mode`` "r" to read, "a" to write (which also
    refuses a store of another format or one that cannot be written, and holds the store as
    one of its writers: see :func:`~attngeom.store.holds.access.open_root`), "c" for extract's
    write, which may create the store (:meth:`run_write`). Attributes, inside the ``with``
    block: ``url``, ``zstore`` (the zarr Store) and ``root`` (its root group).
    :class:`StoreNotFoundError` if there is no store, creating nothing; in mode "c" an
    absent store is no error: nothing is created until its write begins, ``root`` is None
    until then, and what the store refuses is told by the write, counting what it kept.
    :class:`DamagedStoreError` for an unreadable root. ``lease_seconds``: how long the lease
    of a run written on an object store lasts (:func:`~attngeom.store.holds.lease.lease_seconds`)."""

    def __init__(self, url: str, *, mode: str = "r", lease_seconds: float | None = None) -> None:
        self.url, self.mode = url, mode
        self.lease_seconds = lease_seconds
        self.zstore: Any = None
        self.root: zarr.Group | None = None
        self._exit = contextlib.ExitStack()
        self._locked: set[str] = set()
        self._leases: dict[str, Lease] = {}

    def __enter__(self) -> StoreSession:
        with reaching(self.url):
            return self._enter()

    def _enter(self) -> StoreSession:
        writer = self.mode != "r"
        path = local_path(self.url)
        # Opening a local store for writing would create its folder.
        absent = path is not None and not (path / "zarr.json").is_file()
        if absent and self.mode != "c":
            raise StoreNotFoundError(f"no attngeom store at {self.url}")
        with contextlib.ExitStack() as stack:
            if self.mode == "a":
                stack.enter_context(writing(self.url))
            if writer:
                check_writable(self.url)
            self.zstore = cached(zarr_store(self.url, read_only=not writer))
            if not absent:
                if writer:
                    stack.callback(WriterHold(self.url).release)
                try:
                    self.root = checked_root(self.zstore, self.url, writing=writer)
                except StoreNotFoundError:
                    if self.mode != "c":
                        raise
            self._exit = stack.pop_all()
        return self

    @classmethod
    def reading(cls, url: str) -> StoreSession:
        """The store at ``url`` opened to read for as long as the caller keeps it: a reading
        session holds nothing that its end releases, so it needs no ``with`` block."""
        return cls(url).__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        lost = next((lease.lost for lease in self._leases.values() if lease.lost), None)
        self._locked.clear()
        self._leases.clear()
        with reaching(self.url):
            suppress = self._exit.__exit__(*exc)
            error = None if exc[1] is None or isinstance(exc[1], AttngeomError) else unreachable(self.url, exc[1])
            if error is not None:
                raise error from exc[1]
        if lost and exc[0] is None:
            raise StoreWriteError(lost)
        return suppress

    def runs(self, *, missing_ok: bool = False) -> list[str]:
        """Ids of the store's runs, sorted; :class:`RunNotFoundError` when it holds none,
        unless ``missing_ok``."""
        return run_ids(self.root) if missing_ok else require_runs(self.root, self.url)

    def run(self, run_id: str) -> zarr.Group:
        """The run's group, for a writer; :class:`RunNotFoundError`, naming the runs there
        are, if none. A reader takes :meth:`reader`."""
        require_run_group(self.root, run_id, self.url)
        return open_run_group(self.root, run_id)

    def reader(self, run_id: str, *, check: Check | None = None) -> RunReader:
        """The run ``run_id`` to read (:class:`RunNotFoundError`, naming the runs there are,
        if none), checked as ``check`` says (:meth:`RunReader.check`) before it is handed out."""
        require_run_group(self.root, run_id, self.url)
        return RunReader(self, run_id).check(check)

    def readers(self, *, check: Check | None = None) -> Iterator[RunReader]:
        """Every run of the store, in run-id order, as :meth:`reader` hands them out, each
        checked as it is reached; :class:`RunNotFoundError` when the store holds none."""
        for run_id in self.runs():
            yield RunReader(self, run_id).check(check)

    def lock(self, run_id: str, what: str = "writer") -> None:
        """Hold the run's writer lock until the session ends, so that two writers of one run's
        derived groups (two analyzes, an analyze and an ablate: ``what``, named to a writer
        waiting for it) run one after the other. On a local store an advisory lock on the
        run's folder (``flock``), released when the session ends or the process dies; on an
        object store (``s3://``, ``memory://``) a :class:`~attngeom.store.holds.lease.Lease`,
        renewed while held, removed when the session ends and taken over once expired. A
        writer waiting for either says whom it waits for (:mod:`~attngeom.store.holds.locks`)."""
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

    def held_object(self, run_id: str, key: str) -> HeldObject | None:
        """The object ``key`` as the holder of the run's lease writes it, fenced
        (:class:`~attngeom.store.holds.lease.HeldObject`); None on a local store, where the run's
        lock is held until the writer's process ends and needs no fence."""
        lease = self._leases.get(run_id)
        return None if lease is None else lease.held_object(key)

    def run_write(self, run_id: str, *, shard: tuple[int, int] | None = None) -> RunWrite:
        """Extract's write of run ``run_id`` (:class:`~attngeom.store.extracted.run_write.RunWrite`),
        with ``shard = (i, n)`` of the sequences s with s % n == i only, through this
        session's Store and root."""
        return RunWrite(self, run_id, shard=shard)

    def fresh_root(self) -> zarr.Group:
        """The root, read afresh (what peers wrote since this session read it), for a write
        beginning; in mode "c" the store created first where there is none, this session
        then holding it as one of its writers (:func:`~attngeom.store.holds.access.create_root`)."""
        check_writable(self.url)
        if self.root is None:
            self._exit.callback(WriterHold(self.url).release)
        drop_kept(self.zstore)
        self.root = create_root(self.zstore, self.url)
        return self.root

    def remove(self) -> None:
        """Remove the local store, which a write of this session created and left holding
        nothing committed; ``root`` is None again, as before that write began."""
        shutil.rmtree(local_path(self.url), ignore_errors=True)
        self.root = None

    def derived(self, run_id: str, kind: str, *, deep: bool = False) -> DerivedWrite:
        """The update of ``runs/<run_id>/<kind>`` (:class:`~attngeom.store.derived_groups.derived.DerivedWrite`),
        the run locked for the rest of the session."""
        # Here, not at the top: derived groups are written with xarray, which a command that
        # only reads or checks the store does not load.
        from attngeom.store.derived_groups.derived import DerivedWrite

        return DerivedWrite(self, run_id, kind, deep=deep)


class RunReader:
    """One run of a :class:`StoreSession`'s store, to read: ``url``, ``id`` and ``group``
    (its zarr group) together, every read through the session's one zarr Store."""

    def __init__(self, session: StoreSession, run_id: str) -> None:
        self.session, self.url, self.id = session, session.url, run_id
        self.group = open_run_group(session.root, run_id)

    def check(self, check: Check | None) -> RunReader:
        """This reader once the run passes ``check`` (:class:`DamagedStoreError` names the
        first problem): "arrays", its arrays' metadata agree with its records
        (:func:`~attngeom.store.extracted.checks.check_arrays`); "committed", also every committed
        sequence has its stored objects and the coordinates are right
        (:func:`~attngeom.store.extracted.checks.check_committed`); "full", also the run's metadata
        parses (:func:`~attngeom.store.extracted.checks.check_run`); None, nothing."""
        if check == "arrays":
            check_arrays(self.url, self.group, self.id)
        elif check == "committed":
            check_committed(self.url, self.group, self.id)
        elif check == "full":
            check_run(self.url, self.group, self.id)
        elif check is not None:
            raise ValueError(f"no check {check!r}")
        return self

    @property
    def provenance(self) -> dict[str, Any]:
        """The run's provenance (its attngeom attributes); empty for a run whose creation
        was interrupted before them."""
        return dict(self.group.attrs.get(ATTR_KEY, {}))

    @property
    def layout(self) -> RunLayout:
        return run_layout(self.group)

    def completed(self) -> np.ndarray:
        """Indices (S,) of the committed sequences, sorted."""
        return completed(self.group)

    def has(self, name: str) -> bool:
        """Whether the run holds the array ``name``."""
        return name in self.group

    def array(self, name: str) -> zarr.Array:
        """The run's array ``name``; read it inside :meth:`reading`."""
        return self.group[name]

    def chunk(self, name: str, index: tuple[int, ...]) -> np.ndarray:
        """The chunk ``index`` of the array ``name`` (:func:`~attngeom.store.extracted.chunks.read_chunk`)."""
        return read_chunk(self.url, self.group[name], index)

    def sequence(self, name: str, seq: int) -> np.ndarray:
        """Sequence ``seq`` of the run's array ``name``: :class:`CorruptChunkError` names a
        stored object of it that is lost (missing, empty) or fails to decode."""
        arr = self.group[name]
        for index, why in lost_objects(self.group).get(name, {}).items():
            if index[0] == seq:
                raise damaged_chunk(self.url, arr, index, why)
        with self.reading():
            return arr[seq]

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Reads of the run's arrays inside it name a damaged chunk
        (:func:`~attngeom.store.extracted.checks.reading_run`)."""
        with reading_run(self.url, self.group, self.id):
            yield

    def dataset(self) -> xr.Dataset:
        """The committed sequences as a lazy Dataset, ``seq`` labelled by sequence index; a
        read of a stored object known to be lost raises :class:`CorruptChunkError`."""
        # Here, not at the top: xarray loads only where a Dataset is read (an analyze with
        # nothing to do checks the run with zarr alone).
        from attngeom.store.extracted.datasets import open_dataset

        done = self.completed()
        ds = open_dataset(self.session.zstore, self.url, run_path(self.id), lost=lost_objects(self.group))
        return ds.isel(seq=done).assign_coords(seq=("seq", done.astype("int64")))

    def derived(self, kind: str, name: str, *, missing_ok: bool = False) -> xr.Dataset | None:
        """The committed group ``<kind>/<name>`` as a lazy Dataset, through its commit record
        (:func:`~attngeom.store.derived_groups.derived_read.read_derived`): the one way attngeom reads derived
        results. With ``missing_ok``, None where it was never written; an unfinished one
        raises :class:`IncompleteGroupError` all the same."""
        from attngeom.store.derived_groups.derived_read import read_derived  # here: as open_dataset in dataset()

        try:
            return read_derived(self.session.zstore, self.url, self.id, kind, name)
        except GroupNotFoundError:
            if missing_ok:
                return None
            raise

    def wait_for_writer(self) -> None:
        """Wait while a live writer holds the run, saying whom it waits for."""
        wait_for_writer(self.session.zstore, self.id)


def replace_groups(url: str, run_id: str, kind: str, groups: Mapping[str, xr.Dataset],
                   parameters: Mapping[str, Any]) -> None:
    """Replace every group of ``runs/<run_id>/<kind>`` by ``groups``, as a whole
    (:meth:`~attngeom.store.derived_groups.derived.DerivedWrite.replace`)."""
    with StoreSession(url, mode="a") as session, session.derived(run_id, kind) as write:
        write.replace(groups, parameters)
