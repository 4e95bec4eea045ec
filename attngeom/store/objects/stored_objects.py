"""The stored objects of an array: listing them with their sizes, and checking one (a
shard's index, every chunk decoding). Shared by validate and by the derived groups' checks."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Mapping
from typing import Any

import crc32c
import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.errors import ForeignFileError
from attngeom.store.objects._zarr import sync
from attngeom.store.objects.cache import note_sizes
from attngeom.store.objects.damage import DECODE_ERRORS, stored_grid
from attngeom.store.objects.storage import local_files
from attngeom.store.objects.files import special_problem

__all__ = ["chunk_key", "chunk_objects", "object_damage", "object_sizes"]

# A shard index entry of an inner chunk that was never written: offset and length all ones.
_EMPTY_ENTRY = (2**64 - 1, 2**64 - 1)


def object_sizes(zstore: Any, prefix: str) -> dict[str, int]:
    """Stored object key -> size in bytes, for every object under ``prefix`` (one listing
    for a local or fsspec store); a local store's in key order, whatever order its
    folders list their files in."""
    if isinstance(zstore, zarr.storage.LocalStore):
        found = local_files(os.path.join(str(zstore.root), prefix), prefix.rstrip("/"))
        return {key: size for key, entry in sorted(found, key=lambda x: x[0])
                if (size := _size(str(zstore.root), key, entry)) is not None}
    if isinstance(zstore, zarr.storage.FsspecStore):
        root = zstore.path.rstrip("/")

        async def find() -> dict[str, int]:
            found = await zstore.fs._find(f"{root}/{prefix}", detail=True)
            sizes = {key[len(root) + 1 :]: int(info["size"]) for key, info in found.items()}
            note_sizes(zstore, sizes)
            return sizes

        return sync(find())

    async def collect() -> dict[str, int]:
        return {key: await zstore.getsize(key) async for key in zstore.list_prefix(prefix)}

    return sync(collect())


def _size(root: str, key: str, entry: os.DirEntry) -> int | None:
    """The size of the file ``entry`` listed at ``key`` of the local store folder ``root``;
    None when it is gone since the listing: another writer's ``*.partial`` object renamed
    into place (``extract --shard`` peers, torchrun ranks). :class:`ForeignFileError` for
    one that is no regular file (a pipe, a device), which no size describes."""
    try:
        info = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        raise ForeignFileError(special_problem(root, key, info.st_mode))
    return info.st_size


def chunk_key(arr: zarr.Array, index: tuple[int, ...]) -> str:
    """The store key of the object (chunk, or shard) at grid ``index`` of ``arr``."""
    return f"{arr.path}/{arr.metadata.chunk_key_encoding.encode_chunk_key(index)}"


def chunk_objects(arr: zarr.Array, listed: Mapping[str, int] | None = None) -> dict[tuple[int, ...], int]:
    """Grid index (of shards, or chunks if unsharded) -> size in bytes of every stored
    object of ``arr``: listed here, or found in ``listed`` (:func:`object_sizes` of a
    prefix holding the array)."""
    separator = arr.metadata.chunk_key_encoding.separator  # "c/0/0" or "c.0.0"
    prefix = f"{arr.path}/"
    sizes = object_sizes(arr.store, prefix) if listed is None else {
        key: size for key, size in listed.items() if key.startswith(prefix)}
    out = {}
    for key, size in sizes.items():
        parts = key[len(prefix):].split(separator)
        if parts[0] == "c" and len(parts) == arr.ndim + 1 and all(p.isdigit() for p in parts[1:]):
            out[tuple(int(p) for p in parts[1:])] = size
    return out


def _shard_index_problem(arr: zarr.Array, data: bytes) -> str | None:
    """What is wrong with a shard's index (at its end, with a crc32c checksum, as attngeom
    writes it), or None: too short, a checksum mismatch, an inner chunk never written or
    beyond the shard's end."""
    sharding = arr.metadata.codecs[0]
    n_chunks = int(np.prod([s // c for s, c in zip(arr.shards, sharding.chunk_shape)]))
    size = 16 * n_chunks + 4
    if len(data) < size:
        return f"is truncated ({len(data)} bytes, shorter than its {size}-byte index)"
    index, checksum = data[-size:-4], data[-4:]
    if struct.pack("<I", crc32c.crc32c(index)) != checksum:
        return "has a damaged index (checksum mismatch): truncated or overwritten"
    entries = struct.unpack(f"<{2 * n_chunks}Q", index)
    for i in range(n_chunks):
        offset, length = entries[2 * i], entries[2 * i + 1]
        if (offset, length) == _EMPTY_ENTRY:
            return f"lacks inner chunk {i} of {n_chunks}"
        if offset + length > len(data) - size:
            return f"is truncated (inner chunk {i} ends beyond its data)"
    return None


def object_damage(arr: zarr.Array, index: tuple[int, ...], size: int) -> Exception | None:
    """What is wrong with the stored object (chunk, or shard) at grid ``index`` of ``arr``,
    ``size`` bytes long, or None: empty, a bad shard index, or a chunk failing to decode
    (its checksum, its compression). Reads the object."""
    if size == 0:
        return EOFError("empty, 0 bytes")
    if arr.shards is not None:
        data = sync(arr.store.get(chunk_key(arr, index), prototype=default_buffer_prototype())).to_bytes()
        why = _shard_index_problem(arr, data)
        if why is not None:
            return ValueError(f"the shard {why}")
    grid = stored_grid(arr)
    region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, grid, arr.shape))
    try:
        arr[region]
    except DECODE_ERRORS as exc:
        return exc
    return None
