"""A command's object store, read once where a local disk hides the cost of reading again.

zarr-python reads a node's ``zarr.json`` each time it opens the node, a shard's index each
time it reads one of the shard's chunks, and a chunk holding a whole sequence (a run's
per-query summaries) once for every layer's task: free on a local disk (the page cache), a
request each on an object store. :func:`cached` gives one command (a
:class:`~attngeom.store.session.StoreSession`, an extract) a Store that keeps what it read
of these (objects up to ``SMALL`` bytes, ``KEPT`` bytes in all, the oldest dropped first),
and the metadata it wrote, for the rest of the command. Absence is never kept (a peer may
create the object a moment later), and what this Store writes or removes replaces or drops
its copy. What a concurrent writer rewrites meanwhile (a peer extract growing a run's
arrays) stays as first read: a writer of the store's consolidated metadata reads through
:func:`uncached`.
"""

from __future__ import annotations

from typing import Any

import zarr
from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, SuffixByteRequest

__all__ = ["KEPT", "SMALL", "cached", "uncached"]

# A whole object is kept if it is at most SMALL bytes: a sequence's summaries, not its
# attention rows; all kept objects take at most KEPT bytes.
SMALL = 1 << 20
KEPT = 256 << 20


class _CachedFsspecStore(zarr.storage.FsspecStore):
    """An fsspec Store keeping what it read of metadata, shard indexes (suffix reads) and
    small objects, in the order read (a dict: the oldest first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept: dict[tuple[str, ByteRequest | None], bytes] = {}
        self._size = 0

    def _keep(self, slot: tuple[str, ByteRequest | None], value: bytes) -> None:
        if slot[1] is None and len(value) > SMALL:
            return
        self._drop(slot)
        self._kept[slot] = value
        self._size += len(value)
        while self._size > KEPT:
            self._drop(next(iter(self._kept)))

    def _drop(self, slot: tuple[str, ByteRequest | None]) -> None:
        value = self._kept.pop(slot, None)
        if value is not None:
            self._size -= len(value)

    def _forget(self, prefix: str, *, whole: bool = False) -> None:
        for slot in [s for s in self._kept if (s[0].startswith(prefix) if whole else s[0] == prefix)]:
            self._drop(slot)

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        slot = (key, byte_range)
        if slot in self._kept:
            return prototype.buffer.from_bytes(self._kept[slot])
        value = await super().get(key, prototype, byte_range)
        if value is not None and (byte_range is None or isinstance(byte_range, SuffixByteRequest)):
            self._keep(slot, value.to_bytes())
        return value

    async def set(self, key: str, value: Buffer, byte_range: tuple[int, int] | None = None) -> None:
        self._forget(key)
        await super().set(key, value, byte_range)
        if key.rsplit("/", 1)[-1] == "zarr.json":
            self._keep((key, None), value.to_bytes())

    async def delete(self, key: str) -> None:
        self._forget(key)
        await super().delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._forget(prefix.rstrip("/") + "/", whole=True)
        await super().delete_dir(prefix)

    async def exists(self, key: str) -> bool:
        return (key, None) in self._kept or await super().exists(key)

    def __getstate__(self) -> dict[str, Any]:
        # A Dask worker in another process reads afresh rather than receive the copies.
        return {**self.__dict__, "_kept": {}, "_size": 0}

    def with_read_only(self, read_only: bool = False) -> zarr.storage.FsspecStore:
        return uncached(self).with_read_only(read_only)


def cached(zstore: Any) -> Any:
    """``zstore`` keeping what it reads of metadata, shard indexes and small objects, if it
    is an object store's (a local store is returned as it is)."""
    if type(zstore) is not zarr.storage.FsspecStore:
        return zstore
    return _CachedFsspecStore(fs=zstore.fs, path=zstore.path, read_only=zstore.read_only,
                              allowed_exceptions=zstore.allowed_exceptions)


def uncached(zstore: Any) -> Any:
    """The same store reading every object afresh."""
    if not isinstance(zstore, _CachedFsspecStore):
        return zstore
    return zarr.storage.FsspecStore(fs=zstore.fs, path=zstore.path, read_only=zstore.read_only,
                                    allowed_exceptions=zstore.allowed_exceptions)
