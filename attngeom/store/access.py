"""Opening and writing a store: URLs, the root's attributes, Datasets of groups.

Names, here and in every stage: ``url`` is where a store is (a local path or an fsspec URL,
the CLI's ``--store``); a ``zarr_store`` is the zarr-python Store object opened on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import tempfile
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import xarray as xr
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata
from zarr.core.sync import sync

from attngeom import __version__
from attngeom.errors import (
    CorruptChunkError,
    DamagedStoreError,
    InputError,
    SchemaError,
    StoreNotFoundError,
    StoreWriteError,
)
from attngeom.store.codecs import chunk_encoder, compressors
from attngeom.store.schema import (
    ABLATION,
    ANALYSIS,
    ATTR_KEY,
    FORMAT,
    LABEL_ORDERS,
    LABELS,
    RUNS,
    SCHEMA_VERSION,
    label_codes,
    label_dtype,
)

try:
    import fcntl
except ImportError:  # no flock (Windows): there a writer removes every leftover it finds
    fcntl = None

# How a damaged object surfaces from zarr, numcodecs and json: a checksum mismatch or an
# unparsable zarr.json is a ValueError, a blosc or shard-index failure a RuntimeError or
# ValueError, a short object an EOFError. Other errors (bad selections, OSError) are not damage.
DECODE_ERRORS = (ValueError, RuntimeError, EOFError)
# zarr-python's LocalStore writes each object as ``<name>.<uuid>.partial`` and renames it; a
# write killed in between leaves that object behind.
PARTIAL_SUFFIX = ".partial"


def zarr_store(url: str, *, read_only: bool) -> Any:
    """A zarr Store for a local path or any fsspec URL (``s3://``, ``memory://``, ``file://``)."""
    local = local_path(url)
    if local is None:
        try:
            return zarr.storage.FsspecStore.from_url(url, read_only=read_only)
        except (ValueError, ImportError) as exc:  # an unknown protocol, or its package missing
            raise InputError(f"cannot open the store {url}: {exc}") from exc
    return zarr.storage.LocalStore(local, read_only=read_only)


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


def local_path(url: str) -> Path | None:
    """The folder of a local store (a path or a ``file://`` URL); None for a remote one."""
    if "://" in url and not url.startswith("file://"):
        return None
    return Path(url.removeprefix("file://")).expanduser().absolute()


def open_root(url: str, *, mode: str = "r") -> zarr.Group:
    """Open an existing attngeom store; ``mode`` is "r" or "a" (which also refuses a store
    of another format, or one that cannot be written, and removes the leftovers of killed
    writes where no other process writes the store: :class:`_WriterHold`). Raises
    :class:`StoreNotFoundError` if there is none, creating nothing, and
    :class:`DamagedStoreError` for an unreadable root."""
    path = local_path(url)
    if path is not None and not (path / "zarr.json").is_file():
        # Opening a local store for writing would create its folder.
        raise StoreNotFoundError(f"no attngeom store at {url}")
    if mode != "r":
        check_writable(url)
    hold = _WriterHold(url) if mode != "r" else None
    try:
        root = zarr.open_group(
            zarr_store(url, read_only=mode == "r"), mode="r" if mode == "r" else "r+", use_consolidated=False
        )
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise StoreNotFoundError(f"no attngeom store at {url}") from exc
    except DECODE_ERRORS as exc:
        raise DamagedStoreError(
            f"{url}: the root's zarr.json is unreadable ({exc}); {recovery(url, '', metadata=True)}"
        ) from exc
    read_root_attrs(root, url, writing=mode != "r")
    if hold is not None:
        hold.bind(root)
    return root


# The local stores this process writes, by their folder's (device, inode): one open
# descriptor each, holding a shared advisory lock (flock) on the folder, and the root groups
# opened for writing through it that are still alive. The descriptor closes, and the lock
# goes, with the last of them.
_HOLDS: dict[tuple[int, int], list[Any]] = {}


class _WriterHold:
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
        if key not in _HOLDS:
            _HOLDS[key] = [os.open(path, os.O_RDONLY), 0]
        _HOLDS[key][1] += 1
        self.key = key  # counted: from here on, released by the root or by __del__
        fd = _HOLDS[key][0]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this process's own hold converts
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
    """Remove the ``*.partial`` leftovers of a local store; the keys removed. A writer calls
    it when it opens a store and is its only writer (:class:`_WriterHold`), migrate before
    it rewrites the whole store; readers leave the store as it is (and ignore them)."""
    found = partials(url)
    for key in found:
        (local_path(url) / key).unlink(missing_ok=True)
    return found


@contextlib.contextmanager
def quiet_leftovers() -> Iterator[None]:
    """Silence zarr's warning about an object that is no node (a ``*.partial`` leftover)
    while a group's members are listed: validate names it, the next writer removes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Object at .* is not recognized as a component")
        yield


def open_or_create_root(url: str) -> zarr.Group:
    """Open the store at ``url`` for writing, creating it (schema version 1) if absent.

    The root's metadata and attributes are one object, written at once; an empty group
    without them (a store created by hand, or by older code killed mid-way) is adopted.
    """
    hold = _WriterHold(url)
    zstore = zarr_store(url, read_only=False)
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
    hold.bind(root)
    return root


def check_writable(url: str) -> None:
    """Refuse a local store path that cannot be written, before anything is created.

    Probes by creating and removing a temporary file in the store folder, or in its nearest
    existing parent: permission bits do not tell (root, read-only mounts).
    """
    path = local_path(url)
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise StoreWriteError(f"store path {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not (path / "zarr.json").exists():
        raise StoreWriteError(f"{path} is a non-empty folder that is not a Zarr store")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise StoreWriteError(f"cannot create store {path}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".attngeom-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise StoreWriteError(f"store path {path} is not writable ({exc.strerror} in {probe})") from exc


RESTORE = "restore the store from a copy, or remove it and extract again"


def recovery(url: str, path: str, seq: int | None = None, *, decoding: bool = False, metadata: bool = False) -> str:
    """How to recover from damage to the array or group at ``path``: a derived group is
    rewritten by its stage (an analysis chunk that fails to decode, ``decoding``, is found
    by ``analyze --deep``; a missing or resized one by any analyze); a committed sequence is
    uncommitted by ``validate --repair`` and rewritten by the run's extract command; the
    ``zarr.json`` of any other node (``metadata``) is rebuilt by ``validate --repair``."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == RUNS and parts[2] in (ANALYSIS, ABLATION):
        stage = "analyze" if parts[2] == ANALYSIS else "ablate"
        deep = " --deep" if decoding and parts[2] == ANALYSIS else ""
        return f"run `attngeom {stage} --store {url} --run {parts[1]}{deep}` again to rewrite it"
    if len(parts) >= 2 and parts[0] == RUNS and seq is not None:
        return (
            f"run `attngeom validate --store {url} --deep --repair` to uncommit sequence {seq}, then the "
            f"run's extract command again to rewrite it"
        )
    if metadata:
        return f"run `attngeom validate --store {url} --repair` to rebuild it"
    return RESTORE


def damaged_chunk(url: str, arr: zarr.Array, index: tuple[int, ...], exc: BaseException) -> CorruptChunkError:
    """The error naming the stored object (chunk or shard) at grid ``index`` of ``arr``."""
    key = arr.metadata.chunk_key_encoding.encode_chunk_key(index)
    seq = index[0] if arr.metadata.dimension_names and arr.metadata.dimension_names[0] == "seq" else None
    where = f" (sequence {seq})" if seq is not None and arr.path.count("/") == 2 else ""
    decoding = not isinstance(exc, (EOFError, FileNotFoundError))  # not a missing or empty object
    return CorruptChunkError(
        f"array '{arr.path}' chunk {key}{where} is damaged ({type(exc).__name__}: {exc}); "
        f"{recovery(url, arr.path, seq if where else None, decoding=decoding)}"
    )


def stored_grid(arr: zarr.Array) -> tuple[int, ...]:
    """The shape of one stored object of ``arr``: a shard, or a chunk if unsharded."""
    return tuple(arr.shards or arr.chunks)


def _locate(url: str, arr: zarr.Array, selection: tuple[slice | int, ...]) -> CorruptChunkError | None:
    """The error naming the first stored object within ``selection`` that fails to decode;
    None if none does (the failure was not the store's)."""
    grid = stored_grid(arr)
    ranges = []
    for dim, (n, c) in enumerate(zip(arr.shape, grid)):
        sel = selection[dim] if dim < len(selection) else slice(None)
        if isinstance(sel, slice):
            start, stop, _ = sel.indices(n)
            ranges.append(range(start // c, max(start // c + 1, -(-stop // c))))
        else:
            ranges.append(range(int(sel) // c, int(sel) // c + 1))
    for index in np.ndindex(*(len(r) for r in ranges)):
        grid_index = tuple(r[i] for r, i in zip(ranges, index))
        region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(grid_index, grid, arr.shape))
        try:
            arr[region]
        except DECODE_ERRORS as inner:
            return damaged_chunk(url, arr, grid_index, inner)
    return None


def node_metadata(zstore: Any, group: str = "") -> dict[str, dict[str, Any] | None]:
    """Key -> parsed ``zarr.json`` of every node at and under ``group`` (None where it is
    no Zarr v3 node's metadata: empty, truncated or overwritten), sorted by key."""
    if isinstance(zstore, zarr.storage.LocalStore):
        # Read here: through the store, each of an analysis's 160 objects took a hop to
        # zarr's thread and one to a file thread, a third of a millisecond each.
        found = local_files(os.path.join(str(zstore.root), group), group)
        return {key: _parsed(_read_bytes(entry.path)) for key, entry in sorted(found, key=lambda x: x[0])
                if entry.name == "zarr.json"}
    prefix = f"{group}/" if group else ""

    async def read() -> dict[str, Any]:
        # One listing, then every object at once: one at a time took 0.3 s for an analysis.
        keys = sorted([k async for k in zstore.list_prefix(prefix) if k.rsplit("/", 1)[-1] == "zarr.json"])
        raws = await asyncio.gather(*(zstore.get(k, prototype=default_buffer_prototype()) for k in keys))
        return dict(zip(keys, raws))

    return {key: _parsed(raw.to_bytes() if raw is not None else None) for key, raw in sync(read()).items()}


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


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:  # removed since the listing
        return None


def _parsed(raw: bytes | None) -> dict[str, Any] | None:
    """A stored ``zarr.json`` (None when absent) parsed; None if it is no Zarr v3 node's
    metadata."""
    try:
        meta = json.loads(raw if raw is not None else b"")
    except ValueError:
        return None
    node = isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") in ("group", "array")
    return meta if node else None


def metadata_bytes(document: Mapping[str, Any]) -> bytes:
    """A ``zarr.json`` document as stored by attngeom's own writes: on one line (zarr-python
    indents, through Python's pure-Python JSON encoder, a quarter of the analyzing process's
    time in a small analysis; the C encoder writes one line)."""
    return json.dumps(document, allow_nan=True).encode()


def read_metadata(zstore: Any, path: str) -> dict[str, Any] | None:
    """The ``zarr.json`` of the node at ``path``, parsed; None if it is no Zarr v3 node's
    metadata (empty, truncated or overwritten). :class:`FileNotFoundError` when absent."""
    raw = sync(zstore.get(f"{path}/zarr.json", prototype=default_buffer_prototype()))
    if raw is None:
        raise FileNotFoundError(f"{path}/zarr.json")
    return _parsed(raw.to_bytes())


def _node(key: str) -> str:
    """The node path of a ``zarr.json`` key ("" for the root's)."""
    return key.rpartition("/")[0]


def unreadable_metadata(url: str, group: str = "") -> list[str]:
    """Keys of the ``zarr.json`` objects at and under ``group`` that are not JSON objects
    (empty or truncated), sorted."""
    return [key for key, meta in node_metadata(zarr_store(url, read_only=True), group).items() if meta is None]


def metadata_damage(url: str, group: str, exc: BaseException) -> DamagedStoreError:
    """The error for a group that fails to open: naming its unreadable ``zarr.json``."""
    bad = unreadable_metadata(url, group)
    if bad:
        return DamagedStoreError(
            f"{bad[0]} is empty or truncated (unreadable JSON); {recovery(url, _node(bad[0]), metadata=True)}"
        )
    return DamagedStoreError(f"group '{group}' cannot be read ({type(exc).__name__}: {exc}); {recovery(url, group)}")


def read_chunk(url: str, arr: zarr.Array, key: tuple[int | slice, ...]) -> np.ndarray:
    """``arr[key]`` of an array of the store at ``url``, read directly (no xarray decoding:
    for the run's raw arrays); a chunk that fails to decode raises :class:`CorruptChunkError`
    naming it. A zarr Array pickles to its store and metadata, so a task sent to a worker
    process can carry the array it reads (0.1 ms to unpickle, against 1 ms to open it)."""
    try:
        return np.asarray(arr[key])
    except DECODE_ERRORS as exc:
        error = _locate(url, arr, key)
        if error is None:
            raise
        raise error from exc


class _CheckedArray:
    """A lazy variable of a group whose reads name a damaged chunk (the chunks dask reads)."""

    def __init__(self, url: str, path: str, variable: xr.Variable) -> None:
        self.url, self.path, self.variable = url, path, variable
        self.shape, self.dtype, self.ndim = variable.shape, variable.dtype, variable.ndim

    def __getitem__(self, key: tuple[slice, ...]) -> np.ndarray:
        try:
            return np.asarray(self.variable[key].values)
        except DECODE_ERRORS as exc:
            arr = zarr.open_array(zarr_store(self.url, read_only=True), path=self.path, mode="r")
            error = _locate(self.url, arr, key)
            if error is None:
                raise
            raise error from exc


def open_dataset(url: str, group: str, *, zstore: Any = None) -> xr.Dataset:
    """The group ``group`` of the store at ``url`` as a lazy Dataset, read from its own
    metadata (never the consolidated copy, which lags behind writers). The one way attngeom
    opens a group as a Dataset.

    Label variables, stored as integer codes (see :func:`write_dataset`), come back as
    strings. Data are read by dask in the arrays' (inner) chunks; a chunk that fails to
    decode raises :class:`CorruptChunkError` naming it, an unreadable ``zarr.json``
    :class:`DamagedStoreError`. ``zstore``: the store at ``url`` already open (a writer's).
    """
    try:
        with quiet_leftovers():
            ds = xr.open_zarr(zstore if zstore is not None else zarr_store(url, read_only=True), group=group,
                              consolidated=False, chunks=None)
    except (FileNotFoundError, zarr.errors.NodeNotFoundError):
        raise  # no such group: the caller decides what absence means
    except DECODE_ERRORS as exc:
        raise metadata_damage(url, group, exc) from exc
    lazy = {}
    for name, var in ds.variables.items():
        if name in ds.indexes:
            continue  # read when opened
        checked = _CheckedArray(url, f"{group}/{name}", var)
        data = da.from_array(
            checked, chunks=var.encoding.get("chunks") or var.shape, name=f"{group}/{name}-{uuid.uuid4().hex}",
            lock=False, asarray=False, meta=np.empty((0,) * var.ndim, dtype=var.dtype),
        )
        lazy[name] = var.copy(deep=False, data=data)
    ds = ds.assign_coords({n: v for n, v in lazy.items() if n in ds.coords})
    ds = ds.assign({n: v for n, v in lazy.items() if n not in ds.coords})
    return _decode_labels(ds)


def _decode_labels(ds: xr.Dataset) -> xr.Dataset:
    """Integer-coded label variables as their labels (object arrays of str)."""
    decoded = {}
    for name, var in ds.variables.items():
        meta = var.attrs.get(ATTR_KEY)
        if not isinstance(meta, Mapping) or LABELS not in meta:
            continue
        table = np.array([*meta[LABELS], None], dtype=object)  # code -1: no label
        data = var.data
        data = data.map_blocks(table.__getitem__, dtype=object) if isinstance(data, da.Array) else table[np.asarray(data)]
        attrs = {k: v for k, v in var.attrs.items() if k not in (ATTR_KEY, "flag_values", "flag_meanings")}
        decoded[name] = xr.Variable(var.dims, data, attrs)
    ds = ds.assign_coords({n: v for n, v in decoded.items() if n in ds.coords})
    return ds.assign({n: v for n, v in decoded.items() if n not in ds.coords})


def encode_labels(dataset: xr.Dataset) -> xr.Dataset:
    """String variables as integer codes of the Zarr v3 core, readable by any implementation:
    the codes' labels in the variable's attributes, both as CF ``flag_values`` /
    ``flag_meanings`` (blanks in a label become ``_``) and exactly, as
    ``attngeom.labels`` (code ``-1``: no label). Labels of a fixed vocabulary
    (``LABEL_ORDERS``) have the same codes in every store."""
    encoded = {}
    for name, var in dataset.variables.items():
        if var.dtype.kind not in "OUS":
            continue
        labels, codes = label_codes(np.asarray(var.values), LABEL_ORDERS.get(str(name), ()))
        attrs = {
            **var.attrs,
            "flag_values": list(range(len(labels))),
            "flag_meanings": " ".join("_".join(label.split()) or "_" for label in labels),
            ATTR_KEY: {LABELS: labels},
        }
        encoded[name] = xr.Variable(var.dims, codes.astype(label_dtype(len(labels))), attrs)
    dataset = dataset.assign_coords({n: v for n, v in encoded.items() if n in dataset.coords})
    return dataset.assign({n: v for n, v in encoded.items() if n not in dataset.coords})


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


def write_dataset(dataset: xr.Dataset, url: str, group: str, *, compute: bool = True,
                  chunks: Mapping[str, int] | None = None, zstore: Any = None) -> None:
    """Write a derived Dataset to ``group``, replacing it, in the store's format: chunk
    checksums, labels as integer codes (:func:`encode_labels`).

    With ``compute=False`` only the metadata and the numpy-backed variables are written, for
    later region writes into the dask-backed ones. Arrays are chunked as the data's dask chunks,
    or as zarr chooses; ``chunks`` gives chunk lengths along some dimensions instead (a
    variable with one of them is chunked whole along its others). ``zstore``: the store at
    ``url`` already open for writing (a writer's).

    What is stored is what ``Dataset.to_zarr`` stores (``tests/test_store_writes.py`` holds the two
    side by side): NaN as the fill value of floats, with xarray's ``_FillValue`` attribute;
    0 (False) for integers (booleans). The group's objects are encoded in memory first, all
    of its arrays, then written to the store concurrently. ``to_zarr`` creates, fills and
    annotates one array after another: an analysis's four groups across sequences (98 small
    arrays) took 0.43-0.61 s through it.
    """
    write_datasets({group: dataset}, url, compute=compute, chunks=chunks, zstore=zstore)


def write_datasets(datasets: Mapping[str, xr.Dataset], url: str, *, compute: bool = True,
                   chunks: Mapping[str, int] | None = None, zstore: Any = None) -> None:
    """:func:`write_dataset` of each Dataset of ``datasets`` (group -> Dataset), all at once:
    the groups are encoded together, then written together, each replacing its own."""
    encoded = {group: encode_labels(dataset) for group, dataset in datasets.items()}
    data = {}
    for group, dataset in encoded.items():
        coordinates = set(dataset.coords) - set(dataset.dims)
        if coordinates:
            raise ValueError(f"write_dataset stores dimension coordinates only, not {sorted(coordinates)}")
        lazy = {name: var.data for name, var in dataset.variables.items() if isinstance(var.data, da.Array)}
        data[group] = {name: None if name in lazy else np.asarray(var.values)
                       for name, var in dataset.variables.items()}
        if compute:
            data[group].update(zip(lazy, da.compute(*lazy.values())))
    target = zstore if zstore is not None else zarr_store(url, read_only=False)
    forms: dict[tuple, tuple[ArrayV3Metadata, dict[str, Any]]] = {}
    objects = {group: _group_objects(dataset, data[group], group, chunks or {}, forms)
               for group, dataset in encoded.items()}

    with writing(url):
        for parent in sorted({group.rpartition("/")[0] for group in encoded} - {""}):
            zarr.open_group(target, path=parent, mode="a", use_consolidated=False)
        _replace_groups(target, objects)


def _replace_groups(target: Any, objects: Mapping[str, Mapping[str, bytes]]) -> None:
    """Replace each group of ``objects`` (group -> key -> bytes) in the zarr Store
    ``target`` by those objects, its own ``zarr.json`` last, so that a group with metadata
    has all of its arrays."""
    own = {group: f"{group}/zarr.json" for group in objects}
    rest = {key: value for group, group_objects in objects.items() for key, value in group_objects.items()
            if key != own[group]}
    last = {own[group]: objects[group][own[group]] for group in objects}
    for group in objects:
        remove_dir(target, group)
    put_objects(target, rest)
    put_objects(target, last)


def remove_dir(zstore: Any, path: str) -> None:
    """Remove every object under ``path`` of the zarr Store ``zstore``: a folder removed
    whole on a local store."""
    if isinstance(zstore, zarr.storage.LocalStore):
        shutil.rmtree(Path(str(zstore.root)) / path, ignore_errors=True)
        return
    sync(zstore.delete_dir(path))


def put_objects(zstore: Any, objects: Mapping[str, bytes]) -> None:
    """Store ``objects`` (key -> bytes) in the zarr Store ``zstore``, all at once."""
    if isinstance(zstore, zarr.storage.LocalStore):
        # Written here: through the store, each object took a hop to zarr's thread and one
        # to a file thread (an analysis writes some 350).
        root, folders = Path(str(zstore.root)), set()
        for key, value in objects.items():
            _put_local(root / key, value, folders)
        return
    prototype = default_buffer_prototype()
    _gather(zstore.set(key, prototype.buffer.from_bytes(value)) for key, value in objects.items())


def _gather(coroutines: Iterable[Any]) -> None:
    """Run the store's coroutines at once, on zarr's event loop."""

    async def run() -> None:
        await asyncio.gather(*coroutines)

    sync(run())


def _put_local(path: Path, value: bytes, folders: set[Path]) -> None:
    """Write a local store's object as zarr-python does: into ``<name>.<uuid>.partial``,
    then renamed, so that a killed write leaves no truncated object (and a failed one, no
    partial object). ``folders``: those made already."""
    if path.parent not in folders:
        path.parent.mkdir(parents=True, exist_ok=True)
        folders.add(path.parent)
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    try:
        partial.write_bytes(value)
        os.replace(partial, path)
    except BaseException:  # a full disk: no partial object left behind
        partial.unlink(missing_ok=True)
        raise


def _chunk_shape(var: xr.Variable, chunks: Mapping[str, int]) -> tuple[int, ...] | str:
    """``chunks`` along its dimensions and whole along the others if it names one of the
    variable's; else the dask chunks; else zarr's own choice ("auto"), as ``to_zarr``."""
    if set(chunks) & set(var.dims):
        return tuple(max(1, chunks.get(dim, size)) for dim, size in var.sizes.items())
    if isinstance(var.data, da.Array):
        return tuple(max(1, c[0] if c else 0) for c in var.data.chunks)
    return "auto"


# xarray's ``_FillValue`` attribute of a float variable stored in Zarr v3: the float64 NaN's
# bytes in base64, whatever the float's width.
_NAN_FILL_ATTRIBUTE = "AAAAAAAA+H8="


# A derived group's chunks are files beside their array's metadata ("c.0.0"), not nested
# folders ("c/0/0"): an analysis has 160 arrays of one or a few chunks, and the folders were
# most of the file system's work of writing it.
_FLAT_CHUNK_KEYS = {"name": "default", "separator": "."}


def _group_objects(dataset: xr.Dataset, data: Mapping[str, np.ndarray | None], group: str,
                   chunks: Mapping[str, int], forms: dict[tuple, tuple[ArrayV3Metadata, dict[str, Any]]],
                   ) -> dict[str, bytes]:
    """The stored objects of the group ``group`` holding ``dataset``, key -> bytes: its own
    ``zarr.json``, every array's metadata and, where ``data`` holds its values (None:
    metadata only), its chunks, as zarr-python writes them (a chunk all fill value is not
    stored; the documents on one line, :func:`metadata_bytes`). zarr makes the metadata of
    one array of each form (data type, shape, chunks, dimensions) in ``forms``, shared by the
    groups of a write; each array takes a copy with its own attributes. Through zarr, each
    array made, filled and copied in turn from an assembled store, an analysis's groups
    across sequences (98 small arrays) took 0.15-0.3 s of this process's time, most of it
    zarr's own; encoded here, 0.05 s."""
    objects = {f"{group}/zarr.json": metadata_bytes(GroupMetadata(attributes=dict(dataset.attrs)).to_dict())}
    for name, var in dataset.variables.items():
        form = (var.dtype.str, var.shape, _chunk_shape(var, chunks), var.dims)
        if form not in forms:
            made = _array_metadata(var, form[2])
            forms[form] = (made, made.to_dict())
        template, document = forms[form]
        attributes = {**var.attrs, **({"_FillValue": _NAN_FILL_ATTRIBUTE} if var.dtype.kind == "f" else {})}
        objects[f"{group}/{name}/zarr.json"] = metadata_bytes({**document, "attributes": attributes})
        if data[name] is not None:
            objects.update((f"{group}/{name}/{key}", value) for key, value in _chunks(template, data[name]))
    return objects


def _array_metadata(var: xr.Variable, chunks: tuple[int, ...] | str) -> ArrayV3Metadata:
    """The metadata zarr makes for an array of ``var``'s form, without attributes."""
    return zarr.create_array(
        zarr.storage.MemoryStore(), shape=var.shape, dtype=var.dtype, chunks=chunks,
        compressors=compressors(var.dtype), fill_value=np.nan if var.dtype.kind == "f" else None,
        dimension_names=var.dims or None, chunk_key_encoding=_FLAT_CHUNK_KEYS,
    ).metadata


def _chunks(meta: ArrayV3Metadata, x: np.ndarray) -> Iterator[tuple[str, bytes]]:
    """(key, stored bytes) of each chunk of the array ``x`` with metadata ``meta``, one all
    fill value left out."""
    encode = chunk_encoder(meta.to_dict())
    shape, fill = meta.chunk_grid.chunk_shape, meta.fill_value
    for index in np.ndindex(*(-(-size // c) for size, c in zip(x.shape, shape))):
        block = _whole(meta, x[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, shape))])
        if np.isnan(block).all() if np.isnan(fill) else (block == fill).all():
            continue
        yield meta.encode_chunk_key(index), encode(block)


def _whole(meta: ArrayV3Metadata, block: np.ndarray) -> np.ndarray:
    """A chunk's values, padded with the fill value past the array's edge to the chunk
    shape, as zarr stores a chunk it does not hold yet."""
    shape = meta.chunk_grid.chunk_shape
    if block.shape == shape:
        return block
    padded = np.full(shape, meta.fill_value, dtype=block.dtype)
    padded[tuple(slice(0, n) for n in block.shape)] = block
    return padded


def write_new_chunks(zstore: Any, blocks: Iterable[tuple[zarr.AsyncArray, tuple[int, ...], np.ndarray]]) -> None:
    """Store each (array, grid index, values) of ``blocks`` as that chunk of the array, the
    values filling it up to the array's edge; every chunk is stored, also one all fill
    value. For chunks the store does not hold yet: zarr would keep a held chunk's values
    past the edge, this writes the fill value there. What zarr's own writes store, without
    a hop to zarr's thread and a file thread per chunk."""
    objects = {}
    for arr, index, values in blocks:
        meta = arr.metadata
        objects[f"{arr.path}/{meta.encode_chunk_key(index)}"] = chunk_encoder(meta.to_dict())(_whole(meta, values))
    put_objects(zstore, objects)


def set_regions(parts: Iterable[tuple[zarr.AsyncArray, np.ndarray]], start: int) -> None:
    """Write each (array, values) of ``parts`` at positions ``start``, ``start + 1``, ... of
    its first axis, every array at once (zarr merges them into the chunks held)."""
    _gather(arr.setitem(slice(start, start + len(values)), values) for arr, values in parts)


def delete_objects(zstore: Any, keys: Iterable[str]) -> None:
    """Remove the objects ``keys`` of the zarr Store ``zstore``, all at once."""
    _gather(zstore.delete(key) for key in keys)


def node_exists(zstore: Any, path: str) -> bool:
    """Whether the zarr Store ``zstore`` holds a node (its ``zarr.json``) at ``path``."""
    return sync(zstore.exists(f"{path}/zarr.json"))


def move_group(url: str, zstore: Any, source: str, target: str) -> None:
    """Move the group at ``source`` of the store at ``url`` (``zstore``) to ``target``,
    replacing it: a folder rename on a local store; on any other store (object stores have
    no rename) a copy of each object through the zarr Store, then a delete."""
    remove_dir(zstore, target)
    local = local_path(url)
    if local is not None:
        os.replace(local / source, local / target)
        return

    async def move() -> None:
        await copy_group(zstore, source, zstore, target)
        await zstore.delete_dir(source)

    sync(move())


async def copy_group(source: Any, source_group: str, target: Any, target_group: str) -> None:
    """Copy every object of ``source_group`` in the zarr Store ``source`` to ``target_group`` in
    ``target``, concurrently; the group's own ``zarr.json`` last, so that a group with
    metadata has all of its arrays."""
    own = f"{source_group}/zarr.json"
    keys = [key async for key in source.list_prefix(f"{source_group}/") if key != own]

    async def copy(key: str) -> None:
        value = await source.get(key, prototype=default_buffer_prototype())
        await target.set(f"{target_group}{key[len(source_group):]}", value)

    await asyncio.gather(*(copy(key) for key in keys))
    await copy(own)


def consolidate(root: zarr.Group) -> None:
    """Refresh the root's consolidated metadata, so that ``xr.open_zarr(url, group=...)``
    opens quickly and quietly. attngeom itself never reads it (it goes stale while a later
    stage writes); every writer refreshes it last, and ``validate`` names a stale one.
    :class:`DamagedStoreError` names a ``zarr.json`` that does not parse.

    The copy is what ``zarr.consolidate_metadata`` writes: every node reached from the root
    through groups, each with its stored metadata (a group's with an empty consolidated
    copy of its own), read in one listing. zarr's walk built every node's object and
    serialized it again: a tenth of a second per analyze, growing with the store."""
    zstore = root.store
    nodes = node_metadata(zstore)
    bad = [key for key, meta in nodes.items() if meta is None]
    if bad:
        local = isinstance(zstore, zarr.storage.LocalStore)
        url = str(zstore.root) if local else zstore.fs.unstrip_protocol(zstore.path)
        raise DamagedStoreError(
            f"{bad[0]} is empty or truncated (unreadable JSON), so the store's consolidated metadata cannot "
            f"be refreshed; {recovery(url, _node(bad[0]), metadata=True)}"
        )
    by_path = {_node(key): meta for key, meta in nodes.items()}
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


def stale_consolidated(zstore: Any) -> list[str]:
    """Paths of the nodes whose copy in the root's consolidated metadata (what
    ``xr.open_zarr`` reads by default) is not their own metadata, or that it lacks or holds
    in excess; empty when there is no consolidated copy or it is current."""
    nodes = node_metadata(zstore)
    root = nodes.get("zarr.json") or {}
    copy = (root.get("consolidated_metadata") or {}).get("metadata")
    if not isinstance(copy, dict):
        return []

    def own(meta: Any) -> Any:
        return {k: v for k, v in meta.items() if k != "consolidated_metadata"} if isinstance(meta, dict) else meta

    actual = {key.rsplit("/", 1)[0]: own(meta) for key, meta in nodes.items() if key != "zarr.json"}
    return sorted(path for path in set(actual) | set(copy) if own(copy.get(path)) != actual.get(path))


def jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON attributes (tuples as lists, other objects as str)."""
    return json.loads(json.dumps(obj, default=str))
