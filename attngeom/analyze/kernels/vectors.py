"""Small vector helpers of the kernels' loops: inner products, norms, cosines, the exact
distances that the comparisons fall back to, and searches in sorted arrays."""

from __future__ import annotations

import numpy as np

from attngeom.analyze.kernels._jit import jit, jit_dot

# The pair counts and the inversions compare up to this many values times log2 of the other
# side's size with every value of the other side, and sort that side beyond.
SCAN_PER_LOG = 16


@jit_dot
def dot(a, b):
    acc = 0.0
    for d in range(a.size):
        acc += a[d] * b[d]
    return acc


@jit_dot
def squared_difference(a, b):
    """||a - b||^2."""
    acc = 0.0
    for d in range(a.size):
        diff = a[d] - b[d]
        acc += diff * diff
    return acc


@jit_dot
def leave_one_out(y, s):
    """(<y_i, y_i - s_N>, ||2 y_i - s_N||^2) in one pass: the leave-one-out cosine's
    numerator, negated, and the squared distance from y_i to s_{N,-i} = s_N - y_i."""
    a = b = 0.0
    for d in range(y.size):
        diff = y[d] - s[d]
        a += y[d] * diff
        twice = diff + y[d]
        b += twice * twice
    return a, b


@jit
def norm(a):
    return np.sqrt(dot(a, a))


@jit
def cos(a, b):
    """Cosine, NaN where either vector is 0."""
    norms = norm(a) * norm(b)
    return dot(a, b) / norms if norms > 0 else np.nan


@jit
def exact_distance(y, k, s, cache):
    """D_k = ||y_k - s||^2: as computed by `balls.squared_distances` for the keys
    `balls.exact_keys` names, elsewhere (cache NaN) here, from the difference: a key it does
    not name is more than an error from every key it is compared with, so its last ulps
    cannot change a comparison."""
    if np.isnan(cache[k]):
        cache[k] = squared_difference(y[k], s)
    return cache[k]


@jit
def row_cache(exact, row, cache):
    """cache (K,) <- the exact distances that `balls.exact_keys` named for one aggregate row,
    NaN elsewhere; exact: a query head's `balls.ExactDistances`."""
    rows, keys, distances = exact
    cache[:] = np.nan
    i = np.searchsorted(rows, row)
    while i < rows.size and rows[i] == row:
        cache[np.uint64(keys[i])] = distances[i]
        i += 1
    return cache


@jit
def bisect_left(a, v):
    """The first index of the sorted a whose value is >= v (a.size if none)."""
    lo, hi = 0, a.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@jit
def extent(x):
    """(min, max, whether x holds no NaN)."""
    lo, hi, finite = np.inf, -np.inf, True
    for v in x:
        lo, hi = min(lo, v), max(hi, v)
        finite &= v == v
    return lo, hi, finite
