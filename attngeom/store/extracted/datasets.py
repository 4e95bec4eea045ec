"""Groups as xarray Datasets: opened lazily with damaged chunks named, label variables as
integer codes, derived groups encoded in memory and written whole."""

from __future__ import annotations

import contextlib
import functools
import itertools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
import xarray as xr
import zarr
from dask.system import cpu_count

from attngeom.store.objects._zarr import ArrayV3Metadata
from attngeom.store.holds.access import quiet_leftovers, writing
from attngeom.store.extracted.chunks import read_chunk
from attngeom.store.objects.codecs import chunk_encoder, compressors, decode_chunk, decoded, can_decode
from attngeom.store.objects.damage import DECODE_ERRORS, damaged_chunk, locate_damage, metadata_damage, stored_grid
from attngeom.store.objects.storage import Part, get_objects, group_document, metadata_bytes, put_objects, remove_dir
from attngeom.store.objects.schema import ATTR_KEY, ENCODING, LABEL_ORDERS, LABELS, label_codes, label_dtype


class _CheckedArray:
    """A lazy variable of a group whose reads name a damaged chunk (the chunks dask reads),
    and a stored object known to be ``lost`` (grid index -> why) before reading it."""

    def __init__(self, url: str, zstore: Any, path: str, variable: xr.Variable,
                 lost: Mapping[tuple[int, ...], Exception]) -> None:
        self.url, self.zstore, self.path, self.variable, self.lost = url, zstore, path, variable, lost
        self.shape, self.dtype, self.ndim = variable.shape, variable.dtype, variable.ndim

    def __getitem__(self, key: tuple[slice, ...]) -> np.ndarray:
        if self.lost:
            arr = self._array()
            grid = stored_grid(arr)
            for index, why in sorted(self.lost.items()):
                if all(_overlaps(k, i * c, (i + 1) * c) for k, i, c in zip(key, index, grid)):
                    raise damaged_chunk(self.url, arr, index, why)
        try:
            return np.asarray(self.variable[key].values)
        except DECODE_ERRORS as exc:
            error = locate_damage(self.url, self._array(), key)
            if error is None:
                raise
            raise error from exc

    def _array(self) -> zarr.Array:
        return zarr.open_array(self.zstore, path=self.path, mode="r")


def _overlaps(key: slice | int, start: int, stop: int) -> bool:
    """Whether the selection ``key`` along one dimension reaches ``[start, stop)``."""
    if isinstance(key, slice):
        return (key.start or 0) < stop and (key.stop is None or key.stop > start)
    return start <= key < stop


def open_dataset(zstore: Any, url: str, group: str, *,
                 lost: Mapping[str, Mapping[tuple[int, ...], Exception]] | None = None) -> xr.Dataset:
    """The group ``group`` of the zarr Store ``zstore`` (the store at ``url``, named in
    errors: a command's :class:`~attngeom.store.session.StoreSession` holds both) as a lazy
    Dataset, read from its own metadata (never the consolidated copy, which lags behind
    writers). The one way attngeom opens a group as a Dataset.

    Label variables, stored as integer codes (see :func:`write_dataset`), come back as
    strings. Data are read by dask in the arrays' (inner) chunks; a chunk that fails to
    decode raises :class:`CorruptChunkError` naming it, an unreadable ``zarr.json``
    :class:`DamagedStoreError`. ``lost``: variable -> grid index -> why, the stored objects
    known to be missing or empty (:func:`~attngeom.store.extracted.checks.lost_objects`), whose reads
    raise :class:`CorruptChunkError` naming them rather than returning the fill value.
    """
    try:
        with quiet_leftovers():
            ds = xr.open_zarr(zstore, group=group, consolidated=False, chunks=None)
    except (FileNotFoundError, zarr.errors.NodeNotFoundError):
        raise  # no such group: the caller decides what absence means
    except DECODE_ERRORS as exc:
        raise metadata_damage(url, group, exc) from exc
    lazy = {}
    for name, var in ds.variables.items():
        if name in ds.indexes:
            continue  # read when opened
        checked = _CheckedArray(url, zstore, f"{group}/{name}", var, (lost or {}).get(str(name), {}))
        data = da.from_array(
            checked, chunks=var.encoding.get("chunks") or var.shape, name=f"{group}/{name}-{uuid.uuid4().hex}",
            lock=False, asarray=False, meta=np.empty((0,) * var.ndim, dtype=var.dtype),
        )
        lazy[name] = var.copy(deep=False, data=data)
    ds = ds.assign_coords({n: v for n, v in lazy.items() if n in ds.coords})
    ds = ds.assign({n: v for n, v in lazy.items() if n not in ds.coords})
    return _decode_values(_decode_labels(ds))


def _decode_values(ds: xr.Dataset) -> xr.Dataset:
    """Variables stored in an encoding (bfloat16 bit patterns) as their float32 values."""
    decoded_vars = {}
    for name, var in ds.data_vars.items():
        meta = var.attrs.get(ATTR_KEY)
        if not isinstance(meta, Mapping) or ENCODING not in meta:
            continue
        encoding = meta[ENCODING]
        decode = functools.partial(decoded, encoding=encoding)
        data = var.data.map_blocks(decode, dtype=np.float32) if isinstance(var.data, da.Array) else decode(var.values)
        attrs = {k: v for k, v in var.attrs.items() if k != ATTR_KEY}
        decoded_vars[name] = xr.Variable(var.dims, data, attrs, encoding=var.encoding)
    return ds.assign(decoded_vars)


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


def write_dataset(zstore: Any, url: str, group: str, dataset: xr.Dataset, *, compute: bool = True,
                  chunks: Mapping[str, int] | None = None) -> None:
    """Write a derived Dataset to ``group`` of the zarr Store ``zstore`` open for writing
    (the store at ``url``, named in errors), replacing it, in the store's format: chunk
    checksums, labels as integer codes (:func:`encode_labels`).

    With ``compute=False`` only the metadata and the numpy-backed variables are written, for
    later region writes into the dask-backed ones. Arrays are chunked as the data's dask chunks,
    or as zarr chooses; ``chunks`` gives chunk lengths along some dimensions instead (a
    variable with one of them is chunked whole along its others).

    What is stored is what ``Dataset.to_zarr`` stores (``tests/test_store_writes.py`` holds the two
    side by side): NaN as the fill value of floats, with xarray's ``_FillValue`` attribute;
    0 (False) for integers (booleans). The group's objects are encoded in memory first, all
    of its arrays, then written to the store concurrently, where ``to_zarr`` creates, fills
    and annotates one array after another: an analysis writes many small arrays, whose
    round trips through zarr would be most of its writing.
    """
    write_datasets(zstore, url, {group: dataset}, compute=compute, chunks=chunks)


def write_datasets(zstore: Any, url: str, datasets: Mapping[str, xr.Dataset], *, compute: bool = True,
                   chunks: Mapping[str, int] | None = None) -> None:
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
    forms: dict[tuple, _Form] = {}
    blocks: list[_Block] = []
    objects = {group: _group_objects(dataset, data[group], group, chunks or {}, forms, blocks)
               for group, dataset in encoded.items()}
    # Blosc releases the GIL: the chunks are compressed on a thread per core (an analysis's
    # groups across sequences are some 200 chunks, written while the workers are idle).
    threads = min(cpu_count(), len(blocks) // _BLOCKS_PER_THREAD)
    with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        for block, stored in zip(blocks, (pool.map if pool else map)(lambda b: b.encode(b.values), blocks)):
            block.objects[block.key] = (stored,)  # one part: written at once

    with writing(url):
        for parent in sorted({group.rpartition("/")[0] for group in encoded} - {""}):
            zarr.open_group(zstore, path=parent, mode="a", use_consolidated=False)
        _replace_groups(zstore, objects)


def _replace_groups(target: Any, objects: Mapping[str, Mapping[str, bytes | tuple[Part]]]) -> None:
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


class _Form(NamedTuple):
    """The metadata zarr makes for arrays of one form, as a document, and their chunk encoder."""

    metadata: ArrayV3Metadata
    document: dict[str, Any]
    encode: Callable[[np.ndarray], tuple[bytes, bytes]]


class _Block(NamedTuple):
    """A chunk to encode: its ``values``, by ``encode``, into ``objects[key]``."""

    objects: dict[str, bytes | tuple[Part]]
    key: str
    encode: Callable[[np.ndarray], tuple[bytes, bytes]]
    values: np.ndarray


# Chunks a thread is given at least: a derived chunk compresses in a fraction of a
# millisecond, about what handing it to a thread costs.
_BLOCKS_PER_THREAD = 16


def _group_objects(dataset: xr.Dataset, data: Mapping[str, np.ndarray | None], group: str, chunks: Mapping[str, int],
                   forms: dict[tuple, _Form], blocks: list[_Block]) -> dict[str, bytes | tuple[Part]]:
    """The stored objects of the group ``group`` holding ``dataset``, key -> bytes: its own
    ``zarr.json``, every array's metadata and, where ``data`` holds its values (None:
    metadata only), its chunks, as zarr-python writes them (a chunk all fill value is not
    stored; the documents on one line, :func:`metadata_bytes`), each chunk's bytes left to
    encode as one of ``blocks`` (its place in the objects kept). zarr makes the metadata of
    one array of each form (data type, shape, chunks, dimensions) in ``forms``, shared by the
    groups of a write, with its document and chunk encoder; each array takes a copy with its
    own attributes, rather than each array being made, filled and copied through zarr in turn."""
    objects = {f"{group}/zarr.json": metadata_bytes(group_document(dataset.attrs))}
    for name, var in dataset.variables.items():
        form = (var.dtype.str, var.shape, _chunk_shape(var, chunks), var.dims)
        if form not in forms:
            made = _array_metadata(var, form[2])
            document = made.to_dict()
            forms[form] = _Form(made, document, chunk_encoder(document))
        template, document, encode = forms[form]
        attributes = {**var.attrs, **({"_FillValue": _NAN_FILL_ATTRIBUTE} if var.dtype.kind == "f" else {})}
        objects[f"{group}/{name}/zarr.json"] = metadata_bytes({**document, "attributes": attributes})
        if data[name] is not None:
            for key, values in _chunks(template, data[name]):
                objects[f"{group}/{name}/{key}"] = b""
                blocks.append(_Block(objects, f"{group}/{name}/{key}", encode, values))
    return objects


def _array_metadata(var: xr.Variable, chunks: tuple[int, ...] | str) -> ArrayV3Metadata:
    """The metadata zarr makes for an array of ``var``'s form, without attributes."""
    return zarr.create_array(
        zarr.storage.MemoryStore(), shape=var.shape, dtype=var.dtype, chunks=chunks,
        compressors=compressors(var.dtype), fill_value=np.nan if var.dtype.kind == "f" else None,
        dimension_names=var.dims or None, chunk_key_encoding=_FLAT_CHUNK_KEYS,
    ).metadata


def _chunks(meta: ArrayV3Metadata, x: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(key, values) of each chunk of the array ``x`` with metadata ``meta``, one all fill
    value left out."""
    shape, fill = meta.chunk_grid.chunk_shape, meta.fill_value
    for index in np.ndindex(*(-(-size // c) for size, c in zip(x.shape, shape))):
        block = _whole(meta, x[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, shape))])
        if np.isnan(block).all() if np.isnan(fill) else (block == fill).all():
            continue
        yield meta.encode_chunk_key(index), block


def _whole(meta: ArrayV3Metadata, block: np.ndarray) -> np.ndarray:
    """A chunk's values, padded with the fill value past the array's edge to the chunk
    shape, as zarr stores a chunk it does not hold yet."""
    shape = meta.chunk_grid.chunk_shape
    if block.shape == shape:
        return block
    padded = np.full(shape, meta.fill_value, dtype=block.dtype)
    padded[tuple(slice(0, n) for n in block.shape)] = block
    return padded


def set_regions(url: str, zstore: Any, parts: Sequence[tuple[zarr.AsyncArray, np.ndarray]], start: int) -> None:
    """Write each (array, values) of ``parts`` at positions ``start``, ``start + 1``, ... of
    its first axis, every array at once: each chunk reached is encoded here and stored
    whole, also one all fill value, its positions before ``start`` as stored (read at once,
    :func:`read_regions`) and those past the values as the fill value (later positions are
    written by later calls). What zarr stores for the same writes, without its codec
    pipeline's round trips per array (an appending analyze writes some 60 arrays a batch)."""
    firsts = [start // arr.chunks[0] * arr.chunks[0] for arr, _ in parts]
    merged = [(arr, slice(first, start)) for (arr, _), first in zip(parts, firsts) if first < start]
    held = iter(read_regions(url, merged))
    objects = {}
    for (arr, values), first in zip(parts, firsts):
        meta = arr.metadata
        encode, chunks = chunk_encoder(meta.to_dict()), meta.chunk_grid.chunk_shape
        span = np.concatenate([next(held), values]) if first < start else values
        stop = -(-(start + len(values)) // chunks[0]) * chunks[0]
        grid = [range(first // chunks[0], stop // chunks[0])]
        grid += [range(-(-size // c)) for size, c in zip(meta.shape[1:], chunks[1:])]
        for index in itertools.product(*grid):
            at = (slice(index[0] * chunks[0] - first, (index[0] + 1) * chunks[0] - first),
                  *(slice(i * c, (i + 1) * c) for i, c in zip(index[1:], chunks[1:])))
            objects[f"{arr.path}/{meta.encode_chunk_key(index)}"] = (encode(_whole(meta, span[at])),)
    put_objects(zstore, objects)


def read_regions(url: str, parts: Sequence[tuple[zarr.AsyncArray, slice]]) -> list[np.ndarray]:
    """The values of each (array of the store at ``url``, positions along its first axis)
    of ``parts``, every chunk reached read at once and, where stored as attngeom writes
    derived arrays (:func:`~attngeom.store.objects.codecs.chunk_encoder`), decoded here: opening each
    array as a Dataset and reading it through dask, or each through zarr's codec pipeline,
    costs some ten times more in a small analysis. A chunk that fails to decode raises
    :class:`CorruptChunkError` naming it."""
    grids = [_chunks_reached(arr.metadata, at) for arr, at in parts]
    keys = [f"{arr.path}/{arr.metadata.encode_chunk_key(index)}" for (arr, _), grid in zip(parts, grids)
            if can_decode(arr.metadata.codecs) for index in grid]
    stored = get_objects(parts[0][0].store_path.store, keys) if keys else {}
    out = []
    for (arr, at), grid in zip(parts, grids):
        try:
            if can_decode(arr.metadata.codecs):
                out.append(_region(arr, at, grid, stored))
                continue
        except DECODE_ERRORS:
            pass  # read again through zarr, which says what is damaged
        out.append(read_chunk(url, zarr.Array(arr), (at,)))
    return out


def _region(arr: zarr.AsyncArray, at: slice, grid: Sequence[tuple[int, ...]],
            stored: Mapping[str, bytes | None]) -> np.ndarray:
    """``arr[at]`` from the stored bytes of the chunks at ``grid`` (key -> bytes)."""
    meta = arr.metadata
    start, stop, _ = at.indices(meta.shape[0])
    chunks = meta.chunk_grid.chunk_shape
    values = np.empty((stop - start, *meta.shape[1:]), dtype=meta.dtype.to_native_dtype())
    for index in grid:
        chunk = _decoded_chunk(meta, stored[f"{arr.path}/{meta.encode_chunk_key(index)}"])
        lo = index[0] * chunks[0]
        first, last = max(lo, start), min(lo + chunks[0], stop)
        rest = [slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index[1:], chunks[1:], meta.shape[1:])]
        values[(slice(first - start, last - start), *rest)] = chunk[
            (slice(first - lo, last - lo), *(slice(0, r.stop - r.start) for r in rest))]
    return values


def _chunks_reached(meta: ArrayV3Metadata, at: slice) -> list[tuple[int, ...]]:
    """Grid index of every chunk holding positions ``at`` along the first axis."""
    start, stop, _ = at.indices(meta.shape[0])
    chunks = meta.chunk_grid.chunk_shape
    along = range(start // chunks[0], -(-stop // chunks[0])) if start < stop else range(0)
    return list(itertools.product(along, *(range(-(-n // c)) for n, c in zip(meta.shape[1:], chunks[1:]))))


def _decoded_chunk(meta: ArrayV3Metadata, data: bytes | None) -> np.ndarray:
    """A chunk's values from its stored bytes (:func:`decode_chunk`): the fill value where
    not stored; ValueError when the checksum or the size does not match."""
    shape, dtype = meta.chunk_grid.chunk_shape, meta.dtype.to_native_dtype()
    if data is None:
        return np.full(shape, meta.fill_value, dtype=dtype)
    return decode_chunk(data, np.empty(shape, dtype=dtype))
