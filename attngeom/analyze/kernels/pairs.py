"""One kv head's pairs (docs/method.md#norms-and-coherence): the median of its pair cosines,
each key's largest |cosine|, and the pairs of largest |cosine| listed for the coherence
constants (`coherence`), from a float32 screen of its Gram matrix refined in float64; and the
order statistics (quantiles) they rest on."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attngeom.analyze.kernels._jit import jit

_BUCKETS = 1024
# From this many values on, `order_pair` counts instead of partitioning.
COUNTED_MIN = 4096


class Screen(NamedTuple):
    """The Gram matrix of a kv head's unit non-sink values, below the diagonal, as a screen."""

    gram: np.ndarray   # (k, k) float32 (float64 where the unit vectors are not finite)
    unit: np.ndarray   # (k, D) float64 unit vectors
    delta: float       # bound on |gram - exact cosine| (`values.screen_bound`), 0 for float64


class PairStatistics(NamedTuple):
    """`pair_statistics` of one kv head."""

    median: float        # median pair cosine
    row_max: np.ndarray  # (k,) max_{q != p} |<u_p, u_q>| (the screen's)
    top_p: np.ndarray    # (n,) the listed pairs (p, q), by bucket
    top_q: np.ndarray    # (n,)
    bounds: np.ndarray   # (buckets + 1,) where each bucket of the listed pairs begins
    edges: np.ndarray    # (3,) lowest listed |cosine|, buckets per unit |cosine|, threshold


@jit
def pair_cos(unit, q, p):
    """<u_q, u_p> in float64, its terms added in one fixed order (four running sums): the one
    value a pair's cosine takes wherever an output or a comparison reads it exactly (the
    float32 Gram matrix only screens for the pairs that need it, see
    `values.screen_bound`)."""
    a, b = unit[q], unit[p]
    D = a.size
    s0 = s1 = s2 = s3 = 0.0
    d = 0
    while d + 4 <= D:
        s0 += a[d] * b[d]
        s1 += a[d + 1] * b[d + 1]
        s2 += a[d + 2] * b[d + 2]
        s3 += a[d + 3] * b[d + 3]
        d += 4
    while d < D:
        s0 += a[d] * b[d]
        d += 1
    return (s0 + s1) + (s2 + s3)


@jit
def refined_pair(x, at, lo, hi, below, x_lo, x_hi, unit, delta, absolute):
    """The lo-th and hi-th smallest pair cosines (|cosine| if absolute) of a set, exact
    (`pair_cos`), from the screen: x (n,) the float32 values of the set's members within
    [x_lo, x_hi], ``below`` members below x_lo, at (n,) their pairs as indices t
    (`_pair_at`); every float32 value within delta of its exact one.

    The exact statistics lie within delta of those of x, so a member more than 2 delta below
    (above) them is below (above) both: only the members of that band are computed. Returns
    (False, NaN, NaN) where the band reaches outside [x_lo, x_hi] (members not in x)."""
    f_lo, f_hi = order_pair(x, lo - below, hi - below)
    band_lo, band_hi = f_lo - 2 * delta, f_hi + 2 * delta
    if not (band_lo >= x_lo and band_hi <= x_hi):
        return False, np.nan, np.nan
    n_below = below
    band = np.empty(x.size)
    j = 0
    for i in range(x.size):
        v = x[i]
        # Half the values lie below: counted without a branch, which would mispredict.
        n_below += v < band_lo
        if v >= band_lo and v <= band_hi:
            q, p = _pair_at(at[i])
            c = pair_cos(unit, q, p)
            band[j] = abs(c) if absolute else c
            j += 1
    band = np.sort(band[:j])
    return True, band[lo - n_below], band[hi - n_below]


@jit
def exact_row_max(gram, unit, r, screened, delta):
    """max_{q != r} |<u_r, u_q>| exact (`pair_cos`), from the screen's maximum of the row:
    only its pairs within 2 delta of that maximum can hold the exact one."""
    best = -np.inf
    floor = screened - 2 * delta
    for p in range(r):
        if abs(gram[r, p]) >= floor:
            best = max(best, abs(pair_cos(unit, r, p)))
    for q in range(r + 1, gram.shape[0]):
        if abs(gram[q, r]) >= floor:
            best = max(best, abs(pair_cos(unit, q, r)))
    return best


@jit
def bucket_of(v, edges):
    """The bucket of a listed |cosine| v (`pair_statistics`): buckets descend in |cosine|."""
    a_lo, scale = edges[0], edges[1]
    return _BUCKETS - 1 - max(min(int((v - a_lo) * scale), _BUCKETS - 1), 0)


@jit
def _pair_at(t):
    """The t-th pair (q, p), q > p, of the lower triangle in row order."""
    q = int((1.0 + np.sqrt(1.0 + 8.0 * t)) / 2.0)
    while q * (q - 1) // 2 > t:
        q -= 1
    while (q + 1) * q // 2 <= t:
        q += 1
    return q, t - q * (q - 1) // 2


@jit
def pair_index(q, p):
    """The index t of the pair (q, p), q > p, of the lower triangle in row order (`_pair_at`'s
    inverse)."""
    return q * (q - 1) // 2 + p


@jit
def interpolate(below, above, pos, lo):
    """numpy's 'linear' quantile between the order statistics lo and lo + 1."""
    return below + (pos - lo) * (above - below)


@jit
def order_pair(x, lo, hi):
    """The lo-th and hi-th smallest of x (hi = lo or lo + 1), NaN sorting last, as numpy's
    ``part = np.partition(x, lo)`` gives them: ``part[lo]`` and ``part[lo + 1:].min()`` (NaN
    if any value above the lo-th is NaN). By a sort (of a copy) for a short x or one holding
    NaN, else by `_order_pair_counted`: the same two values. (A sort, not numba's partition,
    whose compile took a fifth of the kernels'.)"""
    if x.size >= COUNTED_MIN:
        x_min, x_max, finite = np.inf, -np.inf, 0.0
        for v in x:
            x_min, x_max = min(x_min, v), max(x_max, v)
            finite += v - v  # NaN once a value is NaN or infinite
        if finite == 0.0 and np.isfinite(x_max - x_min):
            return _order_pair_counted(x, lo, hi, x_min, x_max)
    ordered = np.sort(x)
    if hi == lo:
        return ordered[lo], ordered[lo]
    return ordered[lo], (ordered[-1] if np.isnan(ordered[-1]) else ordered[hi])


@jit
def _order_pair_counted(x, lo, hi, x_min, x_max):
    """`order_pair` of a finite x within [x_min, x_max], in two passes of counting: the
    values are dealt into buckets of equal width (the bucket of a value never decreases
    with the value), the buckets' counts locate the two order statistics, and only the
    bucket(s) holding them are sorted. numba's partition took most of an instance's time
    on real stores, whose μ(0.95) often needs every pair of a selection (hundreds of
    thousands)."""
    n_buckets = max(_BUCKETS, x.size >> 6)
    scale = n_buckets / (x_max - x_min) if x_max > x_min else 0.0
    count = np.zeros(n_buckets + 1, np.int64)
    for v in x:
        count[np.uint64(min(int((v - x_min) * scale), n_buckets - 1) + 1)] += 1
    for b in range(n_buckets):
        count[b + 1] += count[b]
    # The buckets of the lo-th and hi-th smallest: the last ones whose start is at or below.
    b_lo = np.searchsorted(count, lo, side="right") - 1
    b_hi = np.searchsorted(count, hi, side="right") - 1
    members = np.empty(count[b_hi + 1] - count[b_lo] + 1)
    j = 0
    for v in x:
        b = min(int((v - x_min) * scale), n_buckets - 1)
        members[np.uint64(j)] = v
        j += (b >= b_lo) & (b <= b_hi)
    members = np.sort(members[:j])
    return members[lo - count[b_lo]], members[hi - count[b_lo]]


@jit
def _bracket(sample, lo, hi, m, share, use):
    """Bounds around the order statistics lo..hi of m values from their sorted sample, with a
    margin of ``share`` of the sample (the whole line unless use)."""
    if not use:
        return -np.inf, np.inf
    ns = sample.size
    margin = share * ns + 8
    return (sample[max(int(lo / m * ns - margin), 0)],
            sample[min(int(hi / m * ns + margin), ns - 1)])


@jit
def _row_pairs(gram, columns, start):
    """The pairs (q, columns[i]) for i in start[q]:start[q + 1]: their Gram entries (float64)
    and indices t (`_pair_at`)."""
    n = start[-1]
    x = np.empty(n)
    at = np.empty(n, np.int64)
    for q in range(1, gram.shape[0]):
        for i in range(start[q], start[q + 1]):
            x[i] = gram[q, np.uint64(columns[i])]
            at[i] = pair_index(q, columns[i])
    return x, at


@jit
def pair_statistics(screen, settings):
    """One kv head's `PairStatistics` from its `Screen`, the Gram matrix (k, k) of its unit
    non-sink values, read below the diagonal only (``gram[q, p]``, q > p):

    - the median of the k(k-1)/2 pair cosines (numpy's 'linear' quantile);
    - row_max (k,): max_{q != p} |<u_p, u_q>|;
    - the pairs whose |cosine| is at or above a threshold that keeps about
      ``settings.top_pair_share`` of them (all of them up to ``settings.top_pair_min`` pairs):
      (p, q) grouped into buckets of descending |cosine| (every pair of a bucket above every
      pair of a later one), the buckets' bounds, and edges = (lowest listed |cosine|, buckets
      per unit |cosine|, threshold) for `bucket_of`.

    With delta > 0 the Gram matrix is a float32 screen (each entry within delta of the exact
    `pair_cos` of unit (k, D)): the median is exact (`refined_pair`), the rest holds
    the screen's values, which `coherence.head_coherence` refines. With delta = 0 its values are
    the cosines.

    The median is found in a bracket around it taken from a sample of 2,048 pairs (counting
    the pairs below it, selecting among the few inside) once the head has more than
    ``settings.bracket_min`` pairs; a bracket that misses is widened once, then every pair is
    sorted (`settings.KernelSettings`).
    """
    gram, unit, delta = screen
    share, min_pairs, bracket_min = settings.top_pair_share, settings.top_pair_min, settings.bracket_min
    k = gram.shape[0]
    m = k * (k - 1) // 2
    row_max = np.full(k, -np.inf)
    if m == 0:
        return PairStatistics(np.nan, row_max, np.empty(0, np.int64), np.empty(0, np.int64),
                              np.zeros(1, np.int64), np.zeros(3))
    golden = 0.6180339887498949
    ns = 2048
    sample = np.empty(ns)
    for j in range(ns):
        q, p = _pair_at(int(j * golden % 1.0 * m))
        sample[j] = gram[q, p]
    sample.sort()
    pos = 0.5 * (m - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, m - 1)
    threshold = -np.inf
    if m > min_pairs:
        a_sample = np.sort(np.abs(sample))
        threshold = a_sample[int((1 - share) * (ns - 1))]

    t_lo, t_hi = _bracket(sample, lo, hi, m, 0.02, m > bracket_min)
    # One pass, free of branches: the comparisons go either way at random, and a candidate is
    # written at the end of its list whether or not the list then grows past it. Three writes
    # a pair, the pass's limit: p alone for the pairs inside the bracket and the listed ones,
    # their rows given by where each row's begin (int32: m < 2^31, `metrics.check_batch`).
    # The lists' ends index as unsigned (`balls` module docstring): a quarter of the pass.
    inside = np.empty(m + 1, np.int32)  # p of the pairs (q, p) inside the bracket
    in_start = np.zeros(k + 1, np.int64)
    listed = np.empty(m + 1, np.int32)  # p of the listed pairs (q, p)
    row_start = np.zeros(k + 1, np.int64)
    n_in = below = n_top = np.int64(0)
    for q in range(1, k):
        row = gram[q]
        best = -np.inf
        row_start[q] = n_top
        in_start[q] = n_in
        for p in range(q):
            c = row[p]
            a = abs(c)
            row_max[p] = max(row_max[p], a)
            best = max(best, a)
            below += c < t_lo
            inside[np.uint64(n_in)] = p
            n_in += (c >= t_lo) & (c <= t_hi)
            listed[np.uint64(n_top)] = p
            n_top += a >= threshold
        row_max[q] = max(row_max[q], best)
    row_start[k] = n_top
    in_start[k] = n_in
    median = np.nan
    for attempt in range(3):
        if below <= lo and hi < below + n_in:
            x, at = _row_pairs(gram, inside, in_start)
            if delta > 0:
                found, below_value, above_value = refined_pair(x, at, lo, hi, below, t_lo, t_hi, unit,
                                                                delta, False)
            else:
                found = True
                below_value, above_value = order_pair(x, lo - below, hi - below)
            if found:
                median = interpolate(below_value, above_value, pos, lo)
                break
        t_lo, t_hi = _bracket(sample, lo, hi, m, 0.08, attempt == 0 and m > bracket_min)
        n_in = below = np.int64(0)
        for q in range(1, k):
            in_start[q] = n_in
            for p in range(q):
                c = gram[q, p]
                below += c < t_lo
                inside[np.uint64(n_in)] = p
                n_in += (c >= t_lo) & (c <= t_hi)
        in_start[k] = n_in

    # Bucket the listed pairs by |cosine|, descending (a counting sort): every listed |cosine|
    # lies between the threshold (or the smallest of them, when all are listed) and the
    # largest row maximum. A pair is dealt to its bucket as one word, p and q packed (one
    # write stream per bucket, not three: the scattered writes took a third of the pass).
    a_hi = row_max.max()
    a_lo = threshold
    if not np.isfinite(a_lo):
        a_lo = np.inf
        for q in range(1, k):
            for p in range(q):
                a_lo = min(a_lo, abs(gram[q, p]))
    edges = np.array([a_lo, _BUCKETS / (a_hi - a_lo) if a_hi > a_lo else 0.0, threshold])
    bucket = np.empty(n_top, np.int64)
    bounds = np.zeros(_BUCKETS + 1, np.int64)
    for q in range(1, k):
        for i in range(row_start[q], row_start[q + 1]):
            b = bucket_of(abs(gram[q, np.uint64(listed[i])]), edges)
            bucket[i] = b
            bounds[np.uint64(b + 1)] += 1
    for b in range(_BUCKETS):
        bounds[b + 1] += bounds[b]
    fill = bounds[:-1].copy()
    packed = np.empty(n_top, np.int64)
    for q in range(1, k):
        for i in range(row_start[q], row_start[q + 1]):
            at = np.uint64(bucket[i])
            j = fill[at]
            fill[at] += 1
            packed[np.uint64(j)] = (q << 32) + listed[i]
    out_p = np.empty(n_top, np.int64)
    out_q = np.empty(n_top, np.int64)
    for j in range(n_top):
        out_q[j], out_p[j] = packed[j] >> 32, packed[j] & 0xFFFFFFFF
    return PairStatistics(median, row_max, out_p, out_q, bounds, edges)


@jit
def quantile(x, q):
    """numpy's 'linear' q-quantile of the 1-D x, NaN if x is empty."""
    m = x.size
    if m == 0:
        return np.nan
    pos = q * (m - 1)
    lo = int(np.floor(pos))
    below, above = order_pair(x, lo, min(lo + 1, m - 1))
    return interpolate(below, above, pos, lo)
