"""The kernels' on-disk cache reaches into numba's private caching API (`kernels._jit`): these
tests notice when a numba release changes it, before users pay a compile on every run or,
worse, load loops built from older sources."""

from __future__ import annotations

import subprocess
import sys

from attngeom.analyze.kernels import _jit, values

# A kernel compiled in a fresh interpreter under NUMBA_CACHE_DIR, and whether the cache is then
# warm; argv[1] "stale" changes the sources' stamp first, as an edit of the package does.
_SCRIPT = """
import sys
import numpy as np
from attngeom.analyze.kernels import _jit, values
if sys.argv[1] == "stale":  # the cache as a fresh import of an edited package makes it
    from numba.core.caching import FunctionCache
    _jit.sources_stamp = lambda: "an edited package"
    values.kv_head._cache = FunctionCache(values.kv_head.py_func)
warm = _jit.cache_is_warm([values.kv_head])
if sys.argv[1] == "compile":
    values.kv_head(np.ones((3, 2)), np.ones(3, dtype=bool))
print(warm, _jit.cache_is_warm([values.kv_head]))
"""


def _run(mode: str, cache_dir) -> str:
    env = {"NUMBA_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_every_kernel_is_cached_under_the_package_stamp():
    locator = values.kv_head._cache._impl._locator
    assert isinstance(locator, _jit._PackageLocator)
    assert locator.get_source_stamp() == _jit.sources_stamp()


def test_a_compiled_kernel_is_found_again_until_a_source_changes(tmp_path):
    assert _run("compile", tmp_path) == "False True"
    assert _run("load", tmp_path) == "True True"
    assert _run("stale", tmp_path) == "False False"
