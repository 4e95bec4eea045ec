"""zarr-python's internals that attngeom uses, in one place, each where no public API serves.

attngeom works with zarr 3.1.6 and later: keep this module small, and prefer zarr's public
API (``zarr.buffer``, ``zarr.storage``, ``zarr.api``) wherever it serves.
"""

from __future__ import annotations

# The type of a Zarr v3 array's ``metadata``, which attngeom reads (chunk grid, fill value,
# chunk key encoding) and copies; zarr exports it from no public module.
from zarr.core.metadata import ArrayV3Metadata

# Runs a coroutine on zarr's event loop. The Store API is async; a Store's synchronous
# methods (``get_sync``, ``set_sync``, ``delete_sync``) exist on LocalStore and MemoryStore
# only, not on FsspecStore, whose async file systems are bound to zarr's loop.
from zarr.core.sync import sync

__all__ = ["ArrayV3Metadata", "sync"]
