"""zarr-python's internals that attngeom uses, in one place, each where no public API serves.

attngeom works with zarr 3.1.6 and later: keep this module small, and prefer zarr's public
API (``zarr.buffer``, ``zarr.storage``, ``zarr.api``) wherever it serves.

An FsspecStore's objects are listed, read, written, copied and removed beyond what the Store
API offers (a write only where absent, a listing with sizes, a copy within the store) through
its file system's coroutines (``fs._cat_file``, ``fs._pipe_file``, ``fs._ls``, ``fs._find``,
``fs._cp_file``, ``fs._rm``). The leading underscore is fsspec's name for the async twin of a
public method, its documented API for async file systems, and what zarr's FsspecStore itself
awaits: the blocking twins need a loop of fsspec's own, which a file system opened for async
use, as zarr opens the Store's, does not have. tests/test_library_internals.py checks that
each is still one.
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
