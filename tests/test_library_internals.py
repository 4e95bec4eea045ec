"""Where the package reaches past a library's public API, and the benchmarks never do: each
reach is checked here against the library, so that a release changing it fails a test
before a user meets it (numba's cache locators: tests/test_kernel_cache.py)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from pathlib import Path

import fsspec
import pytest
import zarr
from fsspec.asyn import AsyncFileSystem

from attngeom.store.objects import cache

ROOT = Path(__file__).resolve().parent.parent


def _fs_coroutines() -> set[str]:
    """The file-system coroutines the package awaits or runs: ``<x>.fs._name(``."""
    found = set()
    for path in (ROOT / "attngeom").rglob("*.py"):
        found.update(re.findall(r"\bfs\.(_[a-z][a-z_]*)\(", path.read_text()))
    return found


def test_the_file_system_coroutines_the_store_awaits_are_fsspecs_async_api():
    """Each is the async twin of a public method of every async file system (its name less
    the underscore), as store/objects/_zarr.py explains."""
    used = _fs_coroutines()
    assert used >= {"_cat_file", "_pipe_file", "_ls", "_find", "_cp_file", "_rm"}, used
    for name in sorted(used):
        assert inspect.iscoroutinefunction(getattr(AsyncFileSystem, name, None)), name
        assert callable(getattr(fsspec.AbstractFileSystem, name[1:], None)), name


def test_a_read_only_cached_store_refuses_delete_dir_as_zarrs_own():
    """The cached Store's delete_dir, which lists once and removes in bulk, checks the Store
    is writable from its public ``read_only`` (zarr's check is private)."""
    zarrs = zarr.storage.FsspecStore.from_url("memory://internals/s.zarr", read_only=True)
    refusals = []
    for store in (zarrs, cache._CachedFsspecStore(fs=zarrs.fs, path=zarrs.path, read_only=True)):
        with pytest.raises(ValueError) as refused:
            asyncio.run(store.delete_dir("runs"))
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1]


def _private_uses(path: Path) -> list[str]:
    """``attngeom`` names a benchmark imports or reaches whose name starts with an underscore."""
    tree = ast.parse(path.read_text())
    modules, wrong = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attngeom"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    wrong.append(f"{path.name}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                           if alias.name.startswith("attngeom"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                wrong.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return wrong


def test_benchmarks_use_the_packages_public_names_only():
    wrong = [use for path in sorted((ROOT / "benchmarks").glob("*.py")) for use in _private_uses(path)]
    assert not wrong, wrong
