"""A store's objects and node metadata: a URL's zarr Store, reading, writing, moving and
removing objects, each node's ``zarr.json``.

Names, here and in every stage: ``url`` is where a store is (a local path or an fsspec URL,
the CLI's ``--store``); a ``zarr_store`` is the zarr-python Store object opened on it. A
local store's objects are read and written here as files (each through the Store took a hop
to zarr's thread and one to a file thread); any other store's through its Store, at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.store.objects import files as store_files
from attngeom.errors import InputError
from attngeom.store.objects.preflight import local_path
from attngeom.store.objects._zarr import sync
from attngeom.store.objects.cache import uncached
from attngeom.store.objects.network import quiet_lost_requests

# zarr-python's LocalStore writes each object as ``<name>.<uuid>.partial`` and renames it; a
# write killed in between leaves that object behind.
PARTIAL_SUFFIX = ".partial"

# One part of an object written part by part: bytes, or buffers stored one after another and
# written at once (a compressed chunk and its checksum).
Part = bytes | tuple[bytes, ...]

# Buffers one vectored write takes at most.
_IOV_MAX = os.sysconf("SC_IOV_MAX")


def foreign_files(url: str, *, whole: bool) -> dict[str, str]:
    """Key -> the line naming it, for each file of a local store that no command opens (a
    link leading outside its folder, a device or pipe: :mod:`attngeom.store.objects.files`); empty
    for a remote store. ``whole``: every folder (validate); else where writers go."""
    path = local_path(url)
    if path is None or not path.is_dir():
        return {}
    return store_files.foreign_files(url, path, whole=whole)


class ContainedStore(zarr.storage.LocalStore):
    """zarr-python's LocalStore, reading only what :func:`attngeom.store.objects.files.check_file`
    lets it: every zarr read of a local store goes through here (the reads outside zarr ask
    the same function), so that a link out of the store or a device in it is refused in one
    line by every command, never read until memory runs out."""

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        store_files.check_file(self.root, key, str(self.root))
        return await super().get(key, prototype, byte_range)

    def get_sync(self, key: str, *, prototype: Any = None, byte_range: Any = None) -> Any:
        store_files.check_file(self.root, key, str(self.root))
        return super().get_sync(key, prototype=prototype, byte_range=byte_range)

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
        key_ranges = list(key_ranges)
        for key, _ in key_ranges:
            store_files.check_file(self.root, key, str(self.root))
        return await super().get_partial_values(prototype, key_ranges)


def zarr_store(url: str, *, read_only: bool) -> Any:
    """A zarr Store for a local path or any fsspec URL (``s3://``, ``memory://``, ``file://``)."""
    local = local_path(url)
    if local is None:
        quiet_lost_requests()
        try:
            return zarr.storage.FsspecStore.from_url(url, read_only=read_only)
        except (ValueError, ImportError) as exc:  # an unknown protocol, or its package missing
            raise InputError(f"cannot open the store {url}: {exc}") from exc
    return ContainedStore(local, read_only=read_only)


def store_url(zstore: Any) -> str:
    """The URL of the store a zarr Store is opened on."""
    if isinstance(zstore, zarr.storage.LocalStore):
        return str(zstore.root)
    return zstore.fs.unstrip_protocol(zstore.path)


def node_metadata(zstore: Any, group: str = "", *, own: str | None = None) -> dict[str, dict[str, Any] | None]:
    """Key -> parsed ``zarr.json`` of every node at and under ``group`` (None where it is
    no Zarr v3 node's metadata: empty, truncated or overwritten), sorted by key. With
    ``own``, the path of a group only this command writes (a derived group of a run it
    holds locked), everything is listed and read afresh but that group's nodes, read
    through ``zstore``, which keeps what the command wrote (:mod:`~attngeom.store.objects.cache`)."""
    if isinstance(zstore, zarr.storage.LocalStore):
        # Read here: through the store, each object takes a hop to zarr's thread and one to a
        # file thread, and an analysis has many small ones.
        return dict(sorted(_local_documents(str(zstore.root), group)))
    prefix = f"{group}/" if group else ""
    fresh = uncached(zstore) if own is not None else zstore

    def reader(key: str) -> Any:
        return zstore if own is not None and key.startswith(f"{own}/") else fresh

    async def read() -> dict[str, Any]:
        # One listing, then every object at once: one at a time waits on each in turn.
        keys = sorted([k async for k in fresh.list_prefix(prefix) if k.rsplit("/", 1)[-1] == "zarr.json"])
        raws = await asyncio.gather(*(reader(k).get(k, prototype=default_buffer_prototype()) for k in keys))
        return dict(zip(keys, raws))

    return {key: parse_metadata(raw.to_bytes() if raw is not None else None) for key, raw in sync(read()).items()}


def lost_metadata(nodes: Mapping[str, Any]) -> list[str]:
    """Keys of the ``zarr.json`` lost above nodes of ``nodes`` (key -> metadata, as
    :func:`node_metadata` gives them): every folder holding a node is a group, whose own
    ``zarr.json`` zarr needs to reach what it holds. Sorted, parents first."""
    lost = set()
    for key in nodes:
        parts = key.split("/")[:-1]
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if f"{parent}/zarr.json" not in nodes:
                lost.add(f"{parent}/zarr.json")
    return sorted(lost, key=lambda k: (k.count("/"), k))


def _local_documents(root: str, key: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(key, parsed ``zarr.json``) of the node at ``key`` of the local store whose folder is
    ``root``, and of every node under it. An array's folders hold its chunks, no node: they
    are not walked (a run's chunk grid has a folder per sequence and layer, most of a store's
    folders)."""
    try:
        entries = list(os.scandir(os.path.join(root, key)))
    except (FileNotFoundError, NotADirectoryError):
        return
    document = next(
        (entry for entry in entries if entry.name == "zarr.json" and not entry.is_dir(follow_symlinks=False)), None)
    if document is not None:
        name = f"{key}/zarr.json" if key else "zarr.json"
        meta = parse_metadata(_read_bytes(root, name))
        yield name, meta
        if meta is not None and meta["node_type"] == "array":
            return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _local_documents(root, f"{key}/{entry.name}" if key else entry.name)


def local_files(folder: str, key: str) -> Iterator[tuple[str, os.DirEntry]]:
    """(key, directory entry) of every file under ``folder``, whose key is ``key``: one
    scandir per folder (os.walk with a stat and a relative path per file took a tenth of a
    second per analysis)."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        name = f"{key}/{entry.name}" if key else entry.name
        if entry.is_dir(follow_symlinks=False):
            yield from local_files(entry.path, name)
        else:
            yield name, entry


def _read_bytes(root: str, key: str) -> bytes | None:
    """The object ``key`` of the local store whose folder is ``root``, once
    :func:`~attngeom.store.objects.files.check_file` lets it be read; None when absent."""
    store_files.check_file(Path(root), key, root)
    try:
        with open(os.path.join(root, key), "rb") as f:
            return f.read()
    except FileNotFoundError:  # removed since the listing
        return None


def parse_metadata(raw: bytes | None) -> dict[str, Any] | None:
    """A stored ``zarr.json`` (None when absent) parsed; None if it is no Zarr v3 node's
    metadata (:func:`metadata_fault` says why)."""
    try:
        meta = json.loads(raw if raw is not None else b"")
    except ValueError:
        return None
    node = isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") in ("group", "array")
    return meta if node and _node_fault(meta) is None else None


# What an array's metadata holds, by key: the types every reader relies on.
_ARRAY_FIELDS = {"shape": list, "data_type": (str, dict), "chunk_grid": dict, "chunk_key_encoding": dict,
                 "codecs": list}


def _node_fault(meta: Mapping[str, Any]) -> str | None:
    """What makes a Zarr v3 node's metadata unusable, in words (None when nothing does):
    attributes that are no object, an array field missing or of another type."""
    if not isinstance(meta.get("attributes", {}), dict):
        return "its attributes are not an object"
    if meta["node_type"] != "array":
        return None
    for key, kind in _ARRAY_FIELDS.items():
        if not isinstance(meta.get(key), kind):
            return f"its {key} is {'missing' if key not in meta else 'of another type'}"
    if not all(isinstance(n, int) and n >= 0 for n in meta["shape"]):
        return "its shape is not a list of sizes"
    names = meta.get("dimension_names")
    if names is not None and not (isinstance(names, list) and len(names) == len(meta["shape"])):
        return "its dimension_names do not name its dimensions"
    return None


def metadata_fault(raw: bytes | None) -> str:
    """Why the stored ``zarr.json`` ``raw`` is no Zarr v3 node's metadata, as the lines naming
    it say: "empty or truncated (unreadable JSON)", or "malformed (...)" for a node's
    metadata that parses but cannot be used."""
    try:
        meta = json.loads(raw if raw is not None else b"")
    except ValueError:
        return "empty or truncated (unreadable JSON)"
    if isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") in ("group", "array"):
        fault = _node_fault(meta)
        if fault is not None:
            return f"malformed ({fault})"
    return "empty or truncated (unreadable JSON)"


def metadata_bytes(document: Mapping[str, Any]) -> bytes:
    """A ``zarr.json`` document as stored by attngeom's own writes: on one line (zarr-python
    indents, through Python's pure-Python JSON encoder, a quarter of the analyzing process's
    time in a small analysis; the C encoder writes one line)."""
    return json.dumps(document, allow_nan=True).encode()


def group_document(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A group's ``zarr.json`` document (Zarr v3) with ``attributes``, its keys in the order
    zarr-python writes them."""
    return {"attributes": dict(attributes), "zarr_format": 3, "node_type": "group"}


def read_metadata(zstore: Any, path: str) -> dict[str, Any] | None:
    """The ``zarr.json`` of the node at ``path``, parsed; None if it is no Zarr v3 node's
    metadata (empty, truncated or overwritten). :class:`FileNotFoundError` when absent."""
    raw = sync(zstore.get(f"{path}/zarr.json", prototype=default_buffer_prototype()))
    if raw is None:
        raise FileNotFoundError(f"{path}/zarr.json")
    return parse_metadata(raw.to_bytes())


def node_path(key: str) -> str:
    """The node path of a ``zarr.json`` key ("" for the root's)."""
    return key.rpartition("/")[0]


def put_objects(zstore: Any, objects: Mapping[str, bytes | Iterable[Part]], *, only_new: bool = False,
                ) -> dict[str, bytes]:
    """Store ``objects`` (key -> bytes, or an object's parts in order) in the zarr Store
    ``zstore``; a local store's are written one after another, each part as it comes (a
    sequence's values shard is written while its last chunks are compressed) with one
    vectored write, any other store's all at once. The first error is raised once every
    write has ended, so that nothing is written after a failed caller has cleaned up.

    With ``only_new``, an object store's objects are created only where absent (S3's
    ``If-None-Match: *``): those found present are not written and returned, key -> bytes,
    for the caller to decide (a writer that no longer holds its run must not replace
    them). A local store's writers take turns by a lock instead: there it returns nothing."""
    if isinstance(zstore, zarr.storage.LocalStore):
        # Written here: through the store, each object takes a hop to zarr's thread and one
        # to a file thread (an analysis writes some 350).
        root, folders = Path(str(zstore.root)), set()
        for key, value in objects.items():
            _put_local(root / key, value, folders)
        return {}
    prototype = default_buffer_prototype()
    data = {key: value if isinstance(value, bytes) else b"".join(b for part in value for b in _buffers(part))
            for key, value in objects.items()}
    present: dict[str, bytes] = {}

    async def put(key: str, value: bytes) -> None:
        if not only_new:
            await zstore.set(key, prototype.buffer.from_bytes(value))
            return
        try:
            await zstore.fs._pipe_file(f"{zstore.path.rstrip('/')}/{key}", value, mode="create")
        except FileExistsError:
            present[key] = value

    async def run() -> None:
        for outcome in await asyncio.gather(*(put(key, value) for key, value in data.items()),
                                            return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome

    sync(run())
    return present


def get_objects(zstore: Any, keys: Iterable[str]) -> dict[str, bytes | None]:
    """Key -> stored bytes (None where absent) of the objects ``keys`` of the zarr Store
    ``zstore``: a local store's read here, one after another, any other store's all at
    once (as :func:`put_objects` writes them)."""
    if isinstance(zstore, zarr.storage.LocalStore):
        return {key: _read_bytes(str(zstore.root), key) for key in keys}
    keys, prototype = list(keys), default_buffer_prototype()

    async def run() -> list[Any]:
        return list(await asyncio.gather(*(zstore.get(key, prototype=prototype) for key in keys)))

    return {key: None if got is None else got.to_bytes() for key, got in zip(keys, sync(run()))}


def gather(coroutines: Iterable[Any]) -> None:
    """Run the store's coroutines at once, on zarr's event loop."""

    async def run() -> None:
        await asyncio.gather(*coroutines)

    sync(run())


def _put_local(path: Path, value: bytes | Iterable[Part], folders: set[Path]) -> None:
    """Write a local store's object (its bytes, or its parts in order) as zarr-python does:
    into ``<name>.<uuid>.partial``, then renamed, so that a killed write leaves no truncated
    object (and a failed one, no partial object). ``folders``: those made already."""
    if path.parent not in folders:
        os.makedirs(path.parent, exist_ok=True)
        folders.add(path.parent)
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    try:
        if isinstance(value, bytes):
            partial.write_bytes(value)
        else:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                for part in value:
                    _write_all(fd, _buffers(part))
                    del part  # not held while the next part is made: its memory can be reused
            finally:
                os.close(fd)
        os.replace(partial, path)
    except BaseException:  # a full disk: no partial object left behind
        partial.unlink(missing_ok=True)
        raise


def _buffers(part: Part) -> tuple[bytes, ...]:
    """The buffers of one part of an object, in order."""
    return (part,) if isinstance(part, bytes) else tuple(part)


def _write_all(fd: int, buffers: Sequence[bytes]) -> None:
    """Write ``buffers`` one after another to the open file ``fd`` with vectored writes
    (as many as a short write or the system's limit on buffers per call take)."""
    views = [memoryview(b) for b in buffers]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views:
            views[0] = views[0][written:]


def remove_dir(zstore: Any, path: str) -> None:
    """Remove every object under ``path`` of the zarr Store ``zstore``: a folder removed
    whole on a local store."""
    if isinstance(zstore, zarr.storage.LocalStore):
        shutil.rmtree(Path(str(zstore.root)) / path, ignore_errors=True)
        return
    sync(zstore.delete_dir(path))


def delete_objects(zstore: Any, keys: Iterable[str]) -> None:
    """Remove the objects ``keys`` of the zarr Store ``zstore``, all at once."""
    gather(zstore.delete(key) for key in keys)


def node_exists(zstore: Any, path: str) -> bool:
    """Whether the zarr Store ``zstore`` holds a node (its ``zarr.json``) at ``path``."""
    return sync(zstore.exists(f"{path}/zarr.json"))


def move_group(url: str, zstore: Any, source: str, target: str) -> None:
    """Move the group at ``source`` of the store at ``url`` (``zstore``) to ``target``,
    replacing it: a folder rename on a local store; on any other store (object stores have
    no rename) a copy of each object, then a delete. An fsspec store copies each object on
    the server (one request, where reading and writing it back takes two)."""
    remove_dir(zstore, target)
    local = local_path(url)
    if local is not None:
        os.replace(local / source, local / target)
        return

    async def move() -> None:
        if isinstance(zstore, zarr.storage.FsspecStore):
            await _copy_group_on_server(zstore, source, target)
        else:
            await copy_group(zstore, source, zstore, target)
        await zstore.delete_dir(source)

    sync(move())


def copy_within(zstore: Any, source: str, target: str, *, skip: Iterable[str] = ()) -> None:
    """Copy every object of the group at ``source`` of the zarr Store ``zstore`` to ``target``
    (on the server for an fsspec store), but the keys ``skip``; the group's own ``zarr.json``
    last."""
    skipped = frozenset(skip)
    if isinstance(zstore, zarr.storage.FsspecStore):
        sync(_copy_group_on_server(zstore, source, target, skipped))
    else:
        sync(copy_group(zstore, source, zstore, target, skipped))


def child_names(zstore: Any, path: str) -> list[str]:
    """The names of the objects and folders right below ``path`` of the zarr Store ``zstore``,
    listed afresh."""
    if isinstance(zstore, zarr.storage.FsspecStore):
        # zarr's list_dir answers from the file system's listing cache (s3fs keeps one per
        # process): a writer must see what was written since by others.
        try:
            found = sync(zstore.fs._ls(f"{zstore.path.rstrip('/')}/{path}", detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted(name.rstrip("/").rsplit("/", 1)[-1] for name in found)

    async def names() -> list[str]:
        return [name async for name in zstore.list_dir(path)]

    return sorted(sync(names()))


async def copy_group(source: Any, source_group: str, target: Any, target_group: str,
                     skip: frozenset[str] = frozenset()) -> None:
    """Copy every object of ``source_group`` in the zarr Store ``source`` to ``target_group`` in
    ``target``, concurrently; the group's own ``zarr.json`` last, so that a group with
    metadata has all of its arrays."""
    own = f"{source_group}/zarr.json"
    keys = [key async for key in source.list_prefix(f"{source_group}/") if key != own and key not in skip]

    async def copy(key: str) -> None:
        value = await source.get(key, prototype=default_buffer_prototype())
        await target.set(f"{target_group}{key[len(source_group):]}", value)

    await asyncio.gather(*(copy(key) for key in keys))
    await copy(own)


async def _copy_group_on_server(zstore: zarr.storage.FsspecStore, source: str, target: str,
                                skip: frozenset[str] = frozenset()) -> None:
    """:func:`copy_group` within one fsspec store, each object copied by its filesystem; the
    group's own ``zarr.json`` last."""
    own = f"{source}/zarr.json"
    keys = [key async for key in zstore.list_prefix(f"{source}/") if key != own and key not in skip]
    root = zstore.path.rstrip("/")

    async def copy(key: str) -> None:
        await zstore.fs._cp_file(f"{root}/{key}", f"{root}/{target}{key[len(source):]}")

    await asyncio.gather(*(copy(key) for key in keys))
    await copy(own)


def jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON attributes (tuples as lists, other objects as str)."""
    return json.loads(json.dumps(obj, default=str))
