"""Damage: how it surfaces from zarr, the errors naming a damaged object, and how to recover."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import zarr

from attngeom.errors import CorruptChunkError, DamagedStoreError
from attngeom.store.objects.commands import stage_command
from attngeom.store.objects.storage import node_metadata, node_path, zarr_store
from attngeom.store.objects.schema import ANALYSIS, DERIVED, RUNS

# How a damaged object surfaces from zarr, numcodecs and json: a checksum mismatch or an
# unparsable zarr.json is a ValueError, a blosc or shard-index failure a RuntimeError or
# ValueError, a short object an EOFError, a zarr.json of the wrong shape (attributes or a
# shape that are no object or list) a TypeError from zarr's parsing. Other errors (bad
# selections, OSError) are not damage.
DECODE_ERRORS = (ValueError, RuntimeError, EOFError, TypeError)


RESTORE = "restore the store from a copy, or remove it and extract again"


class Problem(NamedTuple):
    """One problem of a store, as validate says it: its line, and the keys (below the
    store's root) of the objects it names, by which one naming the same object twice is
    told apart."""

    line: str
    keys: tuple[str, ...] = ()


def recovery(url: str, path: str, seq: int | None = None, *, decoding: bool = False, metadata: bool = False) -> str:
    """How to recover from damage to the array or group at ``path``: a derived group is
    rewritten by its stage (an analysis chunk that fails to decode, ``decoding``, is found
    by ``analyze --deep``; a missing or resized one by any analyze); a committed sequence is
    uncommitted by ``validate --repair`` and rewritten by the run's extract command; the
    ``zarr.json`` of any other node (``metadata``) is rebuilt by ``validate --repair``."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == RUNS and parts[2] in DERIVED:
        stage = DERIVED[parts[2]]
        deep = " --deep" if decoding and parts[2] == ANALYSIS else ""
        return f"run `{stage_command(stage, url, parts[1], deep)}` again to rewrite it"
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


def locate_damage(url: str, arr: zarr.Array, selection: tuple[slice | int, ...]) -> CorruptChunkError | None:
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


def unreadable_metadata(zstore: Any, group: str = "") -> list[str]:
    """Keys of the ``zarr.json`` objects at and under ``group`` of the zarr Store
    ``zstore`` that are not JSON objects (empty or truncated), sorted."""
    return [key for key, meta in node_metadata(zstore, group).items() if meta is None]


def metadata_damage(url: str, group: str, exc: BaseException) -> DamagedStoreError:
    """The error for a group that fails to open: naming its unreadable ``zarr.json``."""
    bad = unreadable_metadata(zarr_store(url, read_only=True), group)
    if bad:
        return DamagedStoreError(
            f"{bad[0]} is empty or truncated (unreadable JSON); {recovery(url, node_path(bad[0]), metadata=True)}"
        )
    return DamagedStoreError(f"group '{group}' cannot be read ({type(exc).__name__}: {exc}); {recovery(url, group)}")
