"""A command's object store, read once where a local disk hides the cost of reading again.

zarr-python reads a node's ``zarr.json`` each time it opens the node, a shard's index each
time it reads one of the shard's chunks, and a chunk holding a whole sequence (a run's
per-query summaries) once for every layer's task: free on a local disk (the page cache), a
request each on an object store. :func:`cached` gives one command (a
:class:`~attngeom.store.session.StoreSession`, a validate) a Store that keeps
what it read of these (objects up to ``SMALL`` bytes, ``KEPT`` bytes in all, the oldest
dropped first), and the metadata it wrote, for the rest of the command:

- concurrent reads of one object (the tasks of one sequence's layers asking for its shard's
  index at once) wait for one request;
- an object the command listed (:func:`note_sizes`) as at most ``SMALL`` bytes is read whole
  at the first read of any part of it, and every part after is cut from that copy: a small
  sequence's shard costs one request, not one per layer;
- a whole object is read in one request (s3fs asks an object's size first, to split a large
  read across connections: a second request for every small one).

Its read-only view (which zarr and xarray open for reading) shares what it keeps. Absence is
never kept (a peer may create the object a moment later), and what this Store writes or
removes replaces or drops its copy. What a concurrent writer rewrites meanwhile (a peer
extract growing a run's arrays) stays as first read: a writer of the store's consolidated
metadata reads through :func:`uncached`, and extract's write, as it begins, drops what its
session's Store kept (:func:`drop_kept`). A Store sent to another process (a Dask worker)
arrives empty and reads afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import zarr
from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest

__all__ = ["KEPT", "SMALL", "cached", "drop_kept", "note_sizes", "note_written", "uncached"]

# A whole object is kept if it is at most SMALL bytes: a sequence's summaries, a small
# model's shard of a sequence at a short context (smollm2-135m's values at L = 64: 1.5 MB),
# not a large model's; all kept objects take at most KEPT bytes, a few batches' shards.
SMALL = 8 << 20
KEPT = 256 << 20

# A whole object read with one request: from its first byte on.
_WHOLE = OffsetByteRequest(0)

_Slot = tuple[str, ByteRequest | None]


class _Kept:
    """What one command's Store (and its read-only view) read: ``objects`` slot -> bytes, in
    the order read (the oldest first); ``sizes`` key -> size of the objects it listed;
    ``reading`` slot -> the read in flight."""

    def __init__(self) -> None:
        self.objects: dict[_Slot, bytes] = {}
        self.bytes = 0
        self.sizes: dict[str, int] = {}
        self.reading: dict[_Slot, asyncio.Future] = {}

    def keep(self, slot: _Slot, value: bytes) -> None:
        if slot[1] is None and len(value) > SMALL:
            return
        self.drop(slot)
        self.objects[slot] = value
        self.bytes += len(value)
        while self.bytes > KEPT:
            self.drop(next(iter(self.objects)))

    def drop(self, slot: _Slot) -> None:
        value = self.objects.pop(slot, None)
        if value is not None:
            self.bytes -= len(value)

    def forget(self, prefix: str, *, whole: bool = False) -> None:
        """Drop what is kept of the object ``prefix`` (every object under it if ``whole``)."""
        for slot in [s for s in self.objects if (s[0].startswith(prefix) if whole else s[0] == prefix)]:
            self.drop(slot)
        for key in [k for k in self.sizes if (k.startswith(prefix) if whole else k == prefix)]:
            del self.sizes[key]


def _part(value: bytes, byte_range: ByteRequest) -> bytes:
    """The part ``byte_range`` of a whole object ``value``, as a ranged read returns it."""
    if isinstance(byte_range, RangeByteRequest):
        return value[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return value[byte_range.offset :]
    return value[-byte_range.suffix :] if byte_range.suffix else b""


class _CachedFsspecStore(zarr.storage.FsspecStore):
    """An fsspec Store keeping what it read of metadata, shard indexes (suffix reads) and
    small objects (:class:`_Kept`, shared with its read-only view)."""

    def __init__(self, *args: Any, kept: _Kept | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept = kept if kept is not None else _Kept()

    async def _read(self, slot: _Slot, prototype: BufferPrototype) -> bytes | None:
        """The object part ``slot`` as stored (None if absent): one request, however many
        ask for it at once."""
        kept = self._kept
        if slot in kept.objects:
            return kept.objects[slot]
        while slot in kept.reading:
            reading = kept.reading[slot]
            try:
                return await asyncio.shield(reading)
            except asyncio.CancelledError:
                if not reading.cancelled():
                    raise  # this read was cancelled, not the one it waited for
        future = asyncio.get_running_loop().create_future()
        kept.reading[slot] = future
        try:
            key, byte_range = slot
            large = byte_range is None and kept.sizes.get(key, 0) > SMALL
            value = await super().get(key, prototype, None if large else byte_range or _WHOLE)
            data = None if value is None else value.to_bytes()
            if data is not None and (byte_range is None or isinstance(byte_range, SuffixByteRequest)):
                kept.keep(slot, data)
            future.set_result(data)
            return data
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no warning where nobody else waited
            raise
        finally:
            del kept.reading[slot]

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        kept = self._kept
        if byte_range is not None and ((key, None) in kept.objects or 0 < kept.sizes.get(key, SMALL + 1) <= SMALL):
            whole = await self._read((key, None), prototype)
            return None if whole is None else prototype.buffer.from_bytes(_part(whole, byte_range))
        value = await self._read((key, byte_range), prototype)
        return None if value is None else prototype.buffer.from_bytes(value)

    async def set(self, key: str, value: Buffer, byte_range: tuple[int, int] | None = None) -> None:
        self._kept.forget(key)
        await super().set(key, value, byte_range)
        if key.rsplit("/", 1)[-1] == "zarr.json":
            self._kept.keep((key, None), value.to_bytes())

    async def delete(self, key: str) -> None:
        self._kept.forget(key)
        await super().delete(key)

    async def delete_dir(self, prefix: str) -> None:
        # One listing, then the objects found removed in bulk: the file system's recursive
        # removal also asks about the folder itself (on S3 two listings and a HEAD more),
        # also where nothing is stored.
        self._check_writable()
        prefix = prefix.rstrip("/") + "/"
        self._kept.forget(prefix, whole=True)
        keys = [key async for key in self.list_prefix(prefix)]
        if keys:
            root = self.path.rstrip("/")
            await self.fs._rm([f"{root}/{key}" for key in keys])

    async def exists(self, key: str) -> bool:
        return (key, None) in self._kept.objects or await super().exists(key)

    def __getstate__(self) -> dict[str, Any]:
        # A Dask worker in another process reads afresh rather than receive the copies.
        return {**self.__dict__, "_kept": _Kept()}

    def with_read_only(self, read_only: bool = False) -> zarr.storage.FsspecStore:
        return _CachedFsspecStore(fs=self.fs, path=self.path, read_only=read_only,
                                  allowed_exceptions=self.allowed_exceptions, kept=self._kept)


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


def drop_kept(zstore: Any) -> None:
    """Forget all that ``zstore`` kept (nothing for another Store): its next reads see what
    peers wrote since, as a Store built afresh would."""
    if isinstance(zstore, _CachedFsspecStore):
        zstore._kept.forget("", whole=True)


def note_written(zstore: Any, key: str, value: bytes) -> None:
    """Tell a command's Store that the command wrote ``value`` at ``key`` by another way (a
    conditional write of a commit record): it keeps it as if written through it."""
    if isinstance(zstore, _CachedFsspecStore):
        zstore._kept.forget(key)
        if key.rsplit("/", 1)[-1] == "zarr.json":
            zstore._kept.keep((key, None), value)


def note_sizes(zstore: Any, sizes: Mapping[str, int]) -> None:
    """Tell a command's Store the sizes of objects it listed (key -> bytes), so that it reads
    a small one whole at the first read of any part of it (nothing for another Store). On
    zarr's event loop, where the Store reads."""
    if isinstance(zstore, _CachedFsspecStore):
        zstore._kept.sizes.update(sizes)
