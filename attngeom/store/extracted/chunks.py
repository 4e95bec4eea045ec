"""Reading a run's arrays one stored chunk at a time: the inputs of analyze's (sequence, layer) tasks.

zarr-python reads a chunk of a sharded array through its asynchronous codec pipeline: a hop to
its event loop, the shard's index and the chunk read there, the chunk decoded on another thread
into a buffer of its own and then copied into the output. For the one inner chunk that an
analyze task reads (a layer of a sequence: 16 MB of a 7B model's values), that machinery costs
as much again as the decoding itself, and its threads run beside the task's kernels
(benchmarks/analyze_stage.py). :func:`read_chunk` reads a selection within one inner chunk (a
sequence's, or a sequence's layer's) as attngeom stores it (:mod:`attngeom.store.objects.codecs`:
Blosc, then a crc32c checksum per chunk; a shard's index at its end) in the calling thread: the
index and the chunk with two reads of the file on a local disk (two requests in one hop to
zarr's loop on any other store, the index kept by the command's cached Store), the checksum
checked, the chunk decoded into the array returned. Any other selection or layout goes through
zarr.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import crc32c
import numpy as np
import zarr
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.buffer import default_buffer_prototype
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec

from attngeom.store.objects._zarr import sync
from attngeom.store.objects.codecs import codec_setting, decode_chunk, decoded, can_decode
from attngeom.store.objects.damage import DECODE_ERRORS, damaged_chunk, locate_damage
from attngeom.store.objects.schema import ATTR_KEY, ENCODING
from attngeom.store.objects.files import check_file

__all__ = ["read_chunk"]

# A shard index's entry for a chunk that is not stored (all fill value).
_EMPTY = 2**64 - 1

# Each thread's buffer for the stored bytes it reads (`_file_bytes`).
_reading = threading.local()


class _Address(NamedTuple):
    """Where one inner chunk of an array lies: the stored object (``key`` in the store, at
    ``grid`` in the array's grid of objects), the chunk's position in its shard's index
    (``slot`` of ``n_slots``; None for an unsharded array), its shape ``inner`` and the
    selection ``within`` it."""

    key: str
    grid: tuple[int, ...]
    slot: int | None
    n_slots: int
    inner: tuple[int, ...]
    within: tuple[int, ...]


def read_chunk(url: str, arr: zarr.Array, key: tuple[int | slice, ...]) -> np.ndarray:
    """``arr[key]`` of an array of the store at ``url``, read directly (no xarray decoding:
    for the run's raw arrays), values of an encoding given as their values (bfloat16 as
    float32); a chunk that fails to decode raises :class:`CorruptChunkError` naming it. A
    zarr Array pickles to its store and metadata, so a task sent to a worker process can
    carry the array it reads (0.1 ms to unpickle, against 1 ms to open it)."""
    address = _address(arr, key)
    try:
        raw = np.asarray(arr[key]) if address is None else _read(arr, address)[address.within]
        return decoded(raw, (arr.attrs.get(ATTR_KEY) or {}).get(ENCODING))
    except DECODE_ERRORS as exc:
        if address is not None:
            raise damaged_chunk(url, arr, address.grid, exc) from exc
        error = locate_damage(url, arr, key)
        if error is None:
            raise
        raise error from exc


def _address(arr: zarr.Array, key: tuple[int | slice, ...]) -> _Address | None:
    """Where the inner chunk that holds the selection ``key`` lies, if ``key`` is an integer
    for each of the leading dimensions, each split into chunks of 1 or not split, the chunk
    whole along the others, and its codecs are those attngeom writes; None for any other
    selection or layout."""
    codecs, slots = arr.metadata.codecs, None
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        sharding = codecs[0]
        if codec_setting(sharding.index_location) != "end" or not _index_codecs(sharding.index_codecs):
            return None
        codecs, inner, stored = sharding.codecs, tuple(sharding.chunk_shape), tuple(arr.shards)
        slots = tuple(s // c for s, c in zip(stored, inner))
    else:
        inner = stored = tuple(arr.chunks)
    m = len(key)
    if (not can_decode(codecs) or m > arr.ndim
            or not all(isinstance(k, (int, np.integer)) and 0 <= k < n for k, n in zip(key, arr.shape))
            or any(c not in (1, n) for c, n in zip(inner[:m], arr.shape)) or inner[m:] != tuple(arr.shape[m:])):
        return None
    at = tuple(int(k) for k in key) + (0,) * (arr.ndim - m)
    grid = tuple(i // s for i, s in zip(at, stored))
    within = tuple(k % c for k, c in zip(at[:m], inner))
    name = "/".join(filter(None, (arr.path, arr.metadata.chunk_key_encoding.encode_chunk_key(grid))))
    if slots is None:
        return _Address(name, grid, None, 1, inner, within)
    slot = int(np.ravel_multi_index(tuple(i % s // c for i, s, c in zip(at, stored, inner)), slots))
    return _Address(name, grid, slot, math.prod(slots), inner, within)


def _index_codecs(codecs: tuple[Any, ...]) -> bool:
    """Whether a shard index's ``codecs`` are little-endian bytes, then crc32c."""
    return (len(codecs) == 2 and isinstance(codecs[0], BytesCodec) and isinstance(codecs[1], Crc32cCodec)
            and codec_setting(codecs[0].endian) in (None, "little") and sys.byteorder == "little")


def _read(arr: zarr.Array, address: _Address) -> np.ndarray:
    """The chunk at ``address``, decoded: the fill value where it is not stored."""
    data = _stored_bytes(arr.store, address)
    dtype = np.dtype(arr.dtype)
    if data is None:
        return np.full(address.inner, arr.fill_value, dtype=dtype)
    return decode_chunk(data, np.empty(address.inner, dtype=dtype))


def _stored_bytes(zstore: Any, address: _Address) -> memoryview | None:
    """The stored bytes of the chunk at ``address``; None if it is not stored."""
    index_size = 16 * address.n_slots + 4
    if isinstance(zstore, zarr.storage.LocalStore):
        check_file(Path(zstore.root), address.key, str(zstore.root))
        try:
            fd = os.open(Path(zstore.root) / address.key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if address.slot is None:
                return _file_bytes(fd, 0, size)
            span = _span(os.pread(fd, index_size, max(size - index_size, 0)), address, size)
            return None if span is None else _file_bytes(fd, *span)
        finally:
            os.close(fd)
    prototype = default_buffer_prototype()

    async def read() -> bytes | None:
        if address.slot is None:
            whole = await zstore.get(address.key, prototype)
            return None if whole is None else whole.to_bytes()
        index = await zstore.get(address.key, prototype, SuffixByteRequest(index_size))
        span = None if index is None else _span(index.to_bytes(), address, None)
        if span is None:
            return None
        chunk = await zstore.get(address.key, prototype, RangeByteRequest(span[0], span[0] + span[1]))
        return _exactly(b"" if chunk is None else chunk.to_bytes(), span[1])

    data = sync(read())
    return None if data is None else memoryview(data)


def _file_bytes(fd: int, offset: int, length: int) -> memoryview:
    """``length`` bytes of the open file ``fd`` from ``offset``, in this thread's buffer: valid
    until the thread's next read. A fresh buffer for each chunk (16 MB of a 7B model's
    values) would be mapped and faulted in, page by page, each time; the buffer stays, as
    large as the largest chunk the thread read."""
    buffer = getattr(_reading, "buffer", None)
    if buffer is None or len(buffer) < length:
        buffer = _reading.buffer = bytearray(length)
    view = memoryview(buffer)[:length]
    return _exactly(view[: os.preadv(fd, [view], offset)], length)


def _span(index: bytes, address: _Address, size: int | None) -> tuple[int, int] | None:
    """(offset, length) of the chunk at ``address`` in its shard, from the shard's ``index``
    (its last bytes; the shard ``size`` bytes long when known), checked; None if the chunk is
    not stored. ValueError for an index that is short, fails its checksum or points outside."""
    if len(index) != 16 * address.n_slots + 4:
        raise ValueError("the shard is shorter than its index")
    if crc32c.crc32c(index[:-4]) != int.from_bytes(index[-4:], "little"):
        raise ValueError("the shard's index fails its crc32c checksum")
    offset, length = (int(x) for x in np.frombuffer(index, "<u8", 2, 16 * address.slot))
    if offset == _EMPTY and length == _EMPTY:
        return None
    if size is not None and offset + length > size - len(index):
        raise ValueError(f"the shard's index points beyond its chunks ({offset} + {length} bytes)")
    return offset, length


def _exactly(data: bytes | memoryview, length: int) -> memoryview:
    """``data``, which should be ``length`` bytes: EOFError when it is short."""
    if len(data) != length:
        raise EOFError(f"read {len(data)} of the chunk's {length} bytes")
    return memoryview(data)
