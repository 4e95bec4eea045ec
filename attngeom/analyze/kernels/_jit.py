"""How the kernels' loops are compiled, and where numba caches them.

Compiled once and cached on disk (numba's cache beside the package); numpy's float rules
(x/0 is inf or NaN, not an exception); no fast-math, so every sum adds in the written order.

numba keys a cached function on its own source file alone, while a loop here calls loops of
the other modules and reads the schema's variable names as constants: every function of the
package is keyed on all of their sources (`_PackageLocator`), so that a change anywhere
recompiles everything instead of loading a loop built from older callees.

numba compiles a callee once more for every type an argument takes, a literal constant
included, and even for the type a counter has before inference unifies it (``Literal[int](0)``
before int64): counters and indices handed to another loop start as ``np.int64(0)``.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba import njit
from numba.core import caching

import attngeom.store.objects.schema

# numba's list of cache locators, tried in order (CacheImpl in recent numba, _CacheImpl before).
_LOCATORS = getattr(caching, "CacheImpl", None) or caching._CacheImpl
_PACKAGE = Path(__file__).resolve().parent
# Every source a compiled loop can read: the package's modules and the schema's names.
_SOURCES = (*sorted(_PACKAGE.glob("*.py")), Path(attngeom.store.objects.schema.__file__).resolve())

jit = njit(cache=True, nogil=True, error_model="numpy")
# A query head's loop, which one loop over the heads of a group calls: compiled into it, not
# once more on its own (numba compiles and optimizes every callee as a whole first).
jit_head = njit(cache=True, nogil=True, error_model="numpy", inline="always")
# The inner products alone may reassociate and fuse (SIMD lanes): an expansion's error bound
# holds whatever the summation order, every distance a comparison depends on comes from
# `balls.squared_distances`, and the aggregates, whose bits those distances read, add in
# the written order.
jit_dot = njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})


@functools.cache
def sources_stamp() -> str:
    """A hash of every source a compiled loop depends on."""
    digest = hashlib.sha256()
    for path in _SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class _PackageLocator(caching._CacheLocator):
    """numba's own choice of cache folder for a function of this package (beside it, or the
    user-wide one where the package is read-only), stamped with `sources_stamp`."""

    def __init__(self, inner: caching._CacheLocator):
        self._inner = inner

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return sources_stamp()

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != _PACKAGE:
            return None
        for other in _LOCATORS._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None


if _PackageLocator not in _LOCATORS._locator_classes:
    _LOCATORS._locator_classes.insert(0, _PackageLocator)


def cache_is_warm(dispatchers) -> bool:
    """Whether numba's cache holds each of the compiled functions dispatchers, built from
    today's sources (a read of their index files, no compile)."""
    return all(dispatcher._cache._cache_file._load_index() for dispatcher in dispatchers)
