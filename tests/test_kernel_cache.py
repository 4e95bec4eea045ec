"""The kernels' on-disk cache reaches into numba's private caching API (`kernels._jit`, whose
locator keys every loop on all of the package's sources): these tests notice when a numba
release changes it, before users pay a compile on every run or, worse, load loops built from
older sources. Whether a loop was compiled or loaded is read from numba's public dispatcher
statistics (``stats.cache_hits``, ``stats.cache_misses``). The "compiling" notice is timed."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from attngeom.analyze.kernels import _jit, metrics, values

# A kernel called in a fresh interpreter under NUMBA_CACHE_DIR: whether numba's cache served it
# (hits, misses); argv[1] "stale" changes the sources' stamp first, as an edit of the package does.
_SCRIPT = """
import sys
import numpy as np
from attngeom.analyze.kernels import _jit, values
if sys.argv[1] == "stale":  # the cache as a fresh import of an edited package makes it
    from numba.core.caching import FunctionCache
    _jit.sources_stamp = lambda: "an edited package"
    values.kv_head._cache = FunctionCache(values.kv_head.py_func)
values.kv_head(np.ones((3, 2)), np.ones(3, dtype=bool))
stats = values.kv_head.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
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
    assert values.kv_head.stats.cache_path == locator.get_cache_path()


def test_a_compiled_kernel_is_found_again_until_a_source_changes(tmp_path):
    assert _run("compile", tmp_path) == "0 1"
    assert _run("load", tmp_path) == "1 0"
    assert _run("stale", tmp_path) == "0 1"


def _compile_kernels_said(monkeypatch, after_s: float, wait_for_notice: bool) -> str:
    """What compile_kernels says on stderr when the notice is due after ``after_s`` seconds and
    its work, where ``wait_for_notice``, lasts until the notice has begun."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(metrics, "COMPILE_NOTICE_AFTER_S", after_s)

    def head_metrics(*args, **kwargs):
        while wait_for_notice and "compiling" not in err.getvalue():
            time.sleep(0.01)

    monkeypatch.setattr(metrics, "head_metrics", head_metrics)
    metrics.compile_kernels(progress=True)
    return err.getvalue()


def test_compile_kernels_says_compiling_when_its_work_outlasts_the_notice(monkeypatch):
    said = _compile_kernels_said(monkeypatch, 0.0, True)
    assert said.startswith("compiling the analysis kernels (first run only")
    assert said.endswith(" s\n") and " ... done in " in said


def test_compile_kernels_says_nothing_when_its_work_ends_first(monkeypatch):
    assert _compile_kernels_said(monkeypatch, 600.0, False) == ""
