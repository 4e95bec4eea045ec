"""Opening a store: the root and its attributes, the writers' hold, writability, a full disk
or read-only store as :class:`StoreWriteError`, and the root's consolidated metadata."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import zarr

from attngeom.version import __version__
from attngeom.errors import DamagedStoreError, SchemaError, StoreNotFoundError, StoreWriteError
from attngeom.store.objects.preflight import require_writable
from attngeom.store.objects.cache import cached, uncached
from attngeom.store.objects.damage import DECODE_ERRORS, recovery
from attngeom.store.objects.storage import (
    PARTIAL_SUFFIX,
    local_path,
    metadata_bytes,
    node_metadata,
    node_path,
    foreign_files,
    put_objects,
    store_url,
    zarr_store,
)
from attngeom.store.objects.schema import ATTR_KEY, DERIVED, FORMAT, RUNS, SCHEMA_VERSION

try:
    import fcntl
except ImportError:  # no flock (Windows): there a writer removes every leftover it finds
    fcntl = None


def store_format(meta: Mapping[str, Any]) -> int:
    """The format of a store from its root attributes (1 when absent: the first stores)."""
    return int(meta.get("format", 1))


def read_root_attrs(root: zarr.Group, url: str, *, writing: bool, migrating_ok: bool = False) -> dict[str, Any]:
    """The root's attngeom attributes, refusing a store this attngeom must not read (another
    schema, a migration under way) or, when ``writing``, must not write (another format)."""
    meta = root.attrs.get(ATTR_KEY)
    if not isinstance(meta, Mapping) or "schema_version" not in meta:
        raise SchemaError("not an attngeom store (no attngeom schema version in its root attributes)")
    version = meta["schema_version"]
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"store has schema version {version}, newer than this attngeom ({__version__}, "
            f"schema {SCHEMA_VERSION}); upgrade attngeom"
        )
    if version < SCHEMA_VERSION:
        raise SchemaError(f"store has schema version {version}; this attngeom reads {SCHEMA_VERSION}")
    if "migrating" in meta and not migrating_ok:
        raise SchemaError(
            f"{url} is being migrated, or its migration was interrupted; finish it with "
            f"`attngeom migrate --store {url}`"
        )
    fmt = store_format(meta)
    if writing and fmt > FORMAT:
        raise SchemaError(f"store format {fmt} is newer than this attngeom writes ({FORMAT}); upgrade attngeom")
    if writing and fmt < FORMAT:
        raise SchemaError(
            f"store format {fmt} is older than the one this attngeom writes ({FORMAT}); "
            f"bring it up to date first with `attngeom migrate --store {url}`"
        )
    return dict(meta)


def checked_root(zstore: Any, url: str, *, writing: bool) -> zarr.Group:
    """The root group of an existing store through ``zstore``, its attributes checked
    (:func:`read_root_attrs`): :class:`StoreNotFoundError` if there is none,
    :class:`DamagedStoreError` for an unreadable root."""
    try:
        root = zarr.open_group(zstore, mode="r+" if writing else "r", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise StoreNotFoundError(f"no attngeom store at {url}") from exc
    except DECODE_ERRORS as exc:
        raise DamagedStoreError(
            f"{url}: the root's zarr.json is unreadable ({exc}); {recovery(url, '', metadata=True)}"
        ) from exc
    read_root_attrs(root, url, writing=writing)
    return root


def open_root(url: str, *, mode: str = "r") -> zarr.Group:
    """Open an existing attngeom store; ``mode`` is "r" or "a" (which also refuses a store
    of another format, or one that cannot be written, and removes the leftovers of killed
    writes where no other process writes the store: :class:`WriterHold`). Raises
    :class:`StoreNotFoundError` if there is none, creating nothing, and
    :class:`DamagedStoreError` for an unreadable root."""
    path = local_path(url)
    if path is not None and not (path / "zarr.json").is_file():
        # Opening a local store for writing would create its folder.
        raise StoreNotFoundError(f"no attngeom store at {url}")
    if mode != "r":
        check_writable(url)
    hold = WriterHold(url) if mode != "r" else None
    root = checked_root(cached(zarr_store(url, read_only=mode == "r")), url, writing=mode != "r")
    if hold is not None:
        hold.bind(root)
    return root


# The local stores this process writes, by their folder's (device, inode): one open
# descriptor each, holding a shared advisory lock (flock) on the folder, and the root groups
# opened for writing through it that are still alive. The descriptor closes, and the lock
# goes, with the last of them.
_HOLDS: dict[tuple[int, int], list[Any]] = {}
# Threads of one process write one store too (two extracts from a notebook). Reentrant: a root's
# finalizer may run, in the thread holding it, during a garbage collection inside a hold.
_HOLDS_LOCK = threading.RLock()


class WriterHold:
    """This process as one of the writers of a local store, from before its first write to
    the end of the root groups it opens (:func:`open_root`, :func:`open_or_create_root`).
    Taken, it removes the ``*.partial`` leftovers of killed writes, but only where no other
    process holds the store: another writer's partial objects are its writes in flight
    (torchrun ranks, ``--shard`` peers, an analyze beside an extract), whose renames fail
    once they are removed. Leftovers found beside a live writer stay for the next writer
    that writes alone; validate names them meanwhile."""

    def __init__(self, url: str) -> None:
        self.key = None
        path = local_path(url)
        if path is None:
            return  # an object store: no leftovers, no lock
        if fcntl is None:
            remove_partials(url)
            return
        path.mkdir(parents=True, exist_ok=True)
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        with _HOLDS_LOCK:
            if key not in _HOLDS:
                _HOLDS[key] = [os.open(path, os.O_RDONLY), 0]
            _HOLDS[key][1] += 1
            self.key = key  # counted: from here on, released by the root or by __del__
            fd = _HOLDS[key][0]
            # Only the process's first hold clears leftovers: a later one's would be this
            # process's own writes in flight, from another thread.
            if _HOLDS[key][1] == 1:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    remove_partials(url)
                except BlockingIOError:
                    pass
            fcntl.flock(fd, fcntl.LOCK_SH)

    def bind(self, root: zarr.Group) -> None:
        """Keep the store held while ``root`` lives."""
        if self.key is not None:
            weakref.finalize(root, _release, self.key)
            self.key = None

    def release(self) -> None:
        """End the hold now (a :class:`~attngeom.store.session.StoreSession` ending)."""
        if self.key is not None:
            _release(self.key)
            self.key = None

    def __del__(self) -> None:
        if self.key is not None:  # no root was opened: the hold ends here
            _release(self.key)


def _release(key: tuple[int, int]) -> None:
    with _HOLDS_LOCK:
        hold = _HOLDS[key]
        hold[1] -= 1
        if not hold[1]:
            os.close(hold[0])
            del _HOLDS[key]


def partials(url: str) -> list[str]:
    """Keys of the ``*.partial`` leftovers of killed writes in a local store, sorted."""
    path = local_path(url)
    if path is None or not path.is_dir():
        return []
    return sorted(
        str(Path(folder, name).relative_to(path))
        for folder, _, names in os.walk(path)
        for name in names
        if name.endswith(PARTIAL_SUFFIX)
    )


def remove_partials(url: str) -> list[str]:
    """Remove the ``*.partial`` leftovers of a local store, and the empty folders a derived
    group's writer stopped by a full disk before its first object leaves; the keys removed.
    A writer calls it when it opens a store and is its only writer (:class:`WriterHold`),
    migrate before it rewrites the whole store; readers leave the store as it is (and
    ignore them)."""
    found = partials(url)
    for key in found:
        (local_path(url) / key).unlink(missing_ok=True)
    for folder in empty_derived_folders(url):
        shutil.rmtree(local_path(url) / folder, ignore_errors=True)
        found.append(folder)
    return found


def empty_derived_folders(url: str) -> list[str]:
    """Paths of the derived groups' folders of a local store holding no file (no record,
    no object): what a writer stopped before its first write leaves."""
    path = local_path(url)
    runs = path / RUNS if path is not None else None
    if runs is None or not runs.is_dir():
        return []
    return sorted(f"{RUNS}/{run.name}/{kind}" for run in runs.iterdir() for kind in DERIVED
                  if (run / kind).is_dir() and not any(files for _, _, files in os.walk(run / kind)))


@contextlib.contextmanager
def quiet_leftovers() -> Iterator[None]:
    """Silence zarr's warning about an object that is no node (a ``*.partial`` leftover)
    while a group's members are listed: validate names it, the next writer removes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Object at .* is not recognized as a component")
        yield


def open_or_create_root(url: str) -> zarr.Group:
    """Open the store at ``url`` for writing, creating it if absent (:func:`create_root`),
    held as one of its writers while the root lives (:class:`WriterHold`)."""
    check_writable(url)
    hold = WriterHold(url)
    root = create_root(cached(zarr_store(url, read_only=False)), url)
    hold.bind(root)
    return root


def create_root(zstore: Any, url: str) -> zarr.Group:
    """The root group through ``zstore``, opened for writing and read afresh, the store
    created (schema version 1) if absent.

    The root's metadata and attributes are one object, written at once; an empty group
    without them (a store created by hand, or by older code killed mid-way) is adopted.
    """
    meta = {ATTR_KEY: {"schema_version": SCHEMA_VERSION, "format": FORMAT, "created_by": __version__}}
    try:
        root = zarr.open_group(zstore, mode="r+", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        try:
            root = zarr.create_group(zstore, zarr_format=3, attributes=meta)
        except zarr.errors.ContainsGroupError:  # a concurrent writer created it
            root = zarr.open_group(zstore, mode="r+", use_consolidated=False)
    except DECODE_ERRORS as exc:
        raise DamagedStoreError(
            f"{url}: the root's zarr.json is unreadable ({exc}); {recovery(url, '', metadata=True)}"
        ) from exc
    if ATTR_KEY not in root.attrs and not list(root.keys()):
        root.attrs.update(meta)
    read_root_attrs(root, url, writing=True)
    return root


def check_writable(url: str) -> None:
    """Refuse a local store path that cannot be written, before anything is created
    (:func:`attngeom.store.objects.preflight.require_writable`), and a store holding a file no command opens
    (:mod:`attngeom.store.objects.files`): a link that leads outside its folder, through which a write
    would land in someone else's files, a device or pipe."""
    require_writable(url)
    foreign = foreign_files(url, whole=False)
    if foreign:
        raise StoreWriteError(next(iter(foreign.values())))


@contextlib.contextmanager
def writing(url: str) -> Iterator[None]:
    """Turn a full disk or a read-only store met while writing into :class:`StoreWriteError`."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreWriteError(f"the store {url} ran out of space; free space and run the command again") from exc
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise StoreWriteError(f"the store {url} cannot be written ({exc.strerror})") from exc
        raise


def consolidate(root: zarr.Group, *, own: str | None = None) -> None:
    """Refresh the root's consolidated metadata, so that ``xr.open_zarr(url, group=...)``
    opens quickly and quietly. attngeom itself never reads it (it goes stale while a later
    stage writes); every writer refreshes it last, and ``validate`` names a stale one.
    :class:`DamagedStoreError` names a ``zarr.json`` that does not parse.

    The copy is what ``zarr.consolidate_metadata`` writes: every node reached from the root
    through groups, each with its stored metadata (a group's with an empty consolidated
    copy of its own), read in one listing rather than by zarr's walk, which builds every
    node's object and serializes it again, a cost growing with the store. Every node is
    read as stored now, also what a peer writer changed, but those of ``own``, a group that
    only this command writes, read through its store (:func:`node_metadata`)."""
    zstore = root.store
    nodes = node_metadata(zstore if own is not None else uncached(zstore), own=own)
    bad = [key for key, meta in nodes.items() if meta is None]
    if bad:
        url = store_url(zstore)
        raise DamagedStoreError(
            f"{bad[0]} is empty or truncated (unreadable JSON), so the store's consolidated metadata cannot "
            f"be refreshed; {recovery(url, node_path(bad[0]), metadata=True)}"
        )
    by_path = {node_path(key): meta for key, meta in nodes.items()}
    groups = {path for path, meta in by_path.items() if meta["node_type"] == "group"}

    def reached(path: str) -> bool:
        parent = path.rpartition("/")[0]
        return parent in groups and (parent == "" or reached(parent))

    copy = {path: {**meta, "consolidated_metadata": _EMPTY_CONSOLIDATED} if path in groups else meta
            for path, meta in by_path.items() if path and reached(path)}
    own = {key: value for key, value in by_path[""].items() if key != "consolidated_metadata"}
    document = {**own, "consolidated_metadata": {**_EMPTY_CONSOLIDATED, "metadata": copy}}
    put_objects(zstore, {"zarr.json": metadata_bytes(document)})


# A consolidated copy holding no nodes, as zarr writes it.
_EMPTY_CONSOLIDATED = {"kind": "inline", "must_understand": False, "metadata": {}}


def consolidated_fault(root: Mapping[str, Any] | None) -> str | None:
    """What is wrong with the consolidated copy in the root's metadata ``root`` (its parsed
    ``zarr.json``), in words; None when there is none or it has the shape zarr writes: an
    object of kind "inline" whose ``metadata`` maps each node's path to its metadata."""
    if not isinstance(root, Mapping) or root.get("consolidated_metadata") is None:
        return None
    copy = root["consolidated_metadata"]
    if not isinstance(copy, Mapping):
        return f"it is a {type(copy).__name__}, not an object"
    if copy.get("kind") != "inline":
        return f"its kind is {copy.get('kind')!r}, not 'inline'"
    if not isinstance(copy.get("must_understand", False), bool):
        return "its must_understand is not true or false"
    nodes = copy.get("metadata")
    if not isinstance(nodes, Mapping):
        return f"its metadata is a {type(nodes).__name__}, not an object"
    bad = next((path for path, meta in nodes.items() if not isinstance(meta, Mapping)
                or meta.get("node_type") not in ("group", "array")), None)
    if bad is not None:
        return f"its entry {bad!r} is no node's metadata"
    return None


def stale_consolidated(zstore: Any, nodes: Mapping[str, Any] | None = None) -> list[str]:
    """Paths of the nodes whose copy in the root's consolidated metadata (what
    ``xr.open_zarr`` reads by default) is not their own metadata, or that it lacks or holds
    in excess; empty when there is no consolidated copy, it is current, or it is malformed
    (:func:`consolidated_fault` says how). ``nodes``: every node's metadata
    (:func:`node_metadata` of ``zstore``) when the caller read it."""
    nodes = node_metadata(zstore) if nodes is None else nodes
    root = nodes.get("zarr.json") or {}
    if root.get("consolidated_metadata") is None or consolidated_fault(root) is not None:
        return []
    copy = root["consolidated_metadata"]["metadata"]

    def own(meta: Any) -> Any:
        return {k: v for k, v in meta.items() if k != "consolidated_metadata"} if isinstance(meta, dict) else meta

    actual = {key.rsplit("/", 1)[0]: own(meta) for key, meta in nodes.items() if key != "zarr.json"}
    return sorted(path for path in set(actual) | set(copy) if own(copy.get(path)) != actual.get(path))
