"""Compiled loops of the analyze kernels (numba): one query head's top-N geometry, and one kv
head's pair statistics from its Gram matrix. Pure functions on arrays, no I/O; the public
face and the numpy parts are in :mod:`attngeom.analyze.kernels`.

Distances ``D_k = ||y_k - s||^2`` are compared through their expansions
``||y_k||^2 - 2 <y_k, s> + ||s||^2`` (``<y_k, s>`` as ``alpha_k <v_k, s>``, the products of a
kv head's values with every aggregate of its query heads by one BLAS call), which are within
``e/2`` of the exact value, ``e`` a bound per aggregate
(:func:`attngeom.analyze.kernels._error_bound`); a key whose expansion lies within ``2e`` of
a threshold is evaluated exactly, from the difference, the same way every time. Every count
is therefore that of the exact distances. Aggregates add their keys one at a time in
selection order, as ``np.cumsum`` does.

An index read from data, or a count that only grows, is cast to ``np.uint64`` where the
hottest loops use it: numba wraps a signed index around (``i < 0`` reads ``i + size``), which
costs each access three instructions more, and the casts change nothing else.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Slots of the float and count outputs of `head_geometry`: the order of
# attngeom.store.schema.TOPN_FLOATS and (*TOPN_COUNTS, "sink_selected").
(PRECISION, RECALL, F_SCORE, MU, MU_Q95, PRECISION_BOUND, RECALL_BOUND, PRECISION_BOUND_Q95,
 RECALL_BOUND_Q95, RANDOM_PRECISION, RANDOM_RECALL, RANDOM_F_SCORE, NOSINK_PRECISION,
 NOSINK_RECALL, NOSINK_F_SCORE, SINK_NORM_SHARE, SINK_DIRECTION_CHANGE, SINK_INTRUSION,
 SINK_PAIR_INVERSION_FRAC, SINK_ALIGNMENT, LOO_COS, LOO_MARGIN, LOO_POSITIVE_FRAC,
 LOO_DISTANCE_MARGIN, S_NORM, S_NORM_NOSINK, S_NORM_NOCURRENT, COS_S_V0, COS_S_VLAST) = range(29)
N_FLOATS = 29
INVERSIONS, K_SINK, K_SINK_Q95, K_SINK_EXACT, SINK_SELECTED = range(5)
N_COUNTS = 5

_BUCKETS = 1024
# From this many values on, `_order_pair` counts instead of partitioning.
_COUNTED_MIN = 4096
# The pair counts and the inversions compare up to this many values times log2 of the other
# side's size with every value of the other side, and sort that side beyond.
_SCAN_PER_LOG = 16

# Compiled once and cached on disk (numba's cache beside this module); numpy's float rules
# (x/0 is inf or NaN, not an exception); no fast-math, so every sum adds in the written order.
_jit = njit(cache=True, nogil=True, error_model="numpy")
# The inner products alone may reassociate and fuse (SIMD lanes): an expansion's error bound
# holds whatever the summation order, every distance a comparison depends on comes from
# `kernels._squared_distances`, and the aggregates, whose bits those distances read, add in
# the written order.
_jit_dot = njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})


# ------------------------------------------------------------------ small vector helpers


@_jit_dot
def _dot(a, b):
    acc = 0.0
    for d in range(a.size):
        acc += a[d] * b[d]
    return acc


@_jit_dot
def _squared_difference(a, b):
    """||a - b||^2."""
    acc = 0.0
    for d in range(a.size):
        diff = a[d] - b[d]
        acc += diff * diff
    return acc


@_jit_dot
def _leave_one_out(y, s):
    """(<y_i, y_i - s_N>, ||2 y_i - s_N||^2) in one pass: the leave-one-out cosine's
    numerator, negated, and the squared distance from y_i to s_{N,-i} = s_N - y_i."""
    a = b = 0.0
    for d in range(y.size):
        diff = y[d] - s[d]
        a += y[d] * diff
        twice = diff + y[d]
        b += twice * twice
    return a, b


@_jit
def _norm(a):
    return np.sqrt(_dot(a, a))


@_jit
def _cos(a, b):
    """Cosine, NaN where either vector is 0."""
    norms = _norm(a) * _norm(b)
    return _dot(a, b) / norms if norms > 0 else np.nan


@_jit
def _exact(y, k, s, cache):
    """D_k = ||y_k - s||^2: as computed by `kernels._squared_distances` for the keys
    :func:`exact_keys` names, elsewhere (cache NaN) here, from the difference: a key it does
    not name is more than an error from every key it is compared with, so its last ulps
    cannot change a comparison."""
    if np.isnan(cache[k]):
        cache[k] = _squared_difference(y[k], s)
    return cache[k]


@_jit
def _row_cache(named, row, cache):
    """cache (K,) <- the exact distances that `exact_keys` named for one aggregate row, NaN
    elsewhere; named = (rows, keys, distances) of one query head, rows ascending."""
    rows, keys, distances = named
    cache[:] = np.nan
    i = np.searchsorted(rows, row)
    while i < rows.size and rows[i] == row:
        cache[np.uint64(keys[i])] = distances[i]
        i += 1
    return cache


# ------------------------------------------------------------------ ranking and aggregates


@_jit
def ranked(key, candidates):
    """Order (K,) of the candidates by ascending key, ties to the smaller position, the
    other keys last in position order; and each key's rank in it."""
    K = key.size
    n = 0
    for k in range(K):
        n += candidates[k]
    cand = np.empty(n, dtype=np.int64)
    rest = np.empty(K - n, dtype=np.int64)
    i = j = 0
    for k in range(K):
        if candidates[k]:
            cand[i] = k
            i += 1
        else:
            rest[j] = k
            j += 1
    by_key = np.argsort(key[cand], kind="mergesort")
    order = np.empty(K, dtype=np.int64)
    for i in range(n):
        order[i] = cand[by_key[i]]
    for j in range(K - n):
        order[n + j] = rest[j]
    rank = np.empty(K, dtype=np.int64)
    for i in range(K):
        rank[order[i]] = i
    return order, rank


@_jit
def uniform_ranked(key, candidates):
    """`ranked` for keys in [0, 1) (the random control's draws), in expected O(K): the
    candidates are dealt into K buckets by key, and each bucket (about one key) is put in
    order by insertion, ties to the smaller position."""
    K = key.size
    start = np.zeros(K + 1, np.int64)
    bucket = np.empty(K, np.int64)
    n = 0
    for k in range(K):
        if candidates[k]:
            b = min(int(key[k] * K), K - 1)
            bucket[k] = b
            start[np.uint64(b + 1)] += 1
            n += 1
    for b in range(K):
        start[b + 1] += start[b]
    fill = start[:-1].copy()
    order = np.empty(K, np.int64)
    j = n
    for k in range(K):
        if candidates[k]:
            at = np.uint64(bucket[k])
            order[np.uint64(fill[at])] = k
            fill[at] += 1
        else:
            order[j] = k
            j += 1
    for b in range(K):
        for i in range(start[b] + 1, start[b + 1]):
            k = order[i]
            j = i - 1
            while j >= start[b] and (key[order[j]] > key[k] or (key[order[j]] == key[k] and order[j] > k)):
                order[j + 1] = order[j]
                j -= 1
            order[j + 1] = k
    return order


@_jit
def _prefix_sums(y, order, include, points, out, row0):
    """out[row0 + p] = the sum of y over the first points[p] keys of order, keys outside
    include counted as 0, added one key at a time in that order."""
    D = y.shape[1]
    acc = np.zeros(D)
    i = 0
    for p in range(points.size):
        # Four keys a step, each sum still added one key at a time: acc makes one round trip
        # through memory per four keys, not one per key (the random rows' loads bound this).
        while i + 4 <= points[p]:
            k0, k1, k2, k3 = order[i], order[i + 1], order[i + 2], order[i + 3]
            w0, w1, w2, w3 = include[k0], include[k1], include[k2], include[k3]
            for d in range(D):
                acc[d] = ((((acc[d] + (y[k0, d] if w0 else 0.0)) + (y[k1, d] if w1 else 0.0))
                           + (y[k2, d] if w2 else 0.0)) + (y[k3, d] if w3 else 0.0))
            i += 4
        while i < points[p]:
            k = order[i]
            w = include[k]
            for d in range(D):
                acc[d] += y[k, d] if w else 0.0
            i += 1
        out[row0 + p] = acc


# ------------------------------------------------------------------ balls


@_jit
def _half_bound(yn_k, sn, e_rel, tiny):
    """How far a key's expansion can lie from its distance computed either way: half of
    `kernels._error_bound`'s e_rel (||y_k|| + ||s||)^2 + tiny, from the key's own norm (a
    row's largest ||y_k||, the sink's, would widen every key's band by (||y_0||/||s||)^2)."""
    return 0.5 * (e_rel * (yn_k + sn) ** 2 + tiny)


@_jit
def _limits(x, yn, sn, e_rel, tiny, order, n, n_cand):
    """Where the radii can lie: r_max^2 in [lo_max, hi_max] (the selected keys order[:n]),
    r_min^2 in [lo_min, hi_min] (the unselected candidates order[n:n_cand]), each distance
    within its half bound of its expansion x."""
    lo_max = hi_max = -np.inf
    lo_min = hi_min = np.inf
    for i in range(n):
        k = np.uint64(order[i])
        h = _half_bound(yn[k], sn, e_rel, tiny)
        lo_max, hi_max = max(lo_max, x[k] - h), max(hi_max, x[k] + h)
    for i in range(n, n_cand):
        k = np.uint64(order[i])
        h = _half_bound(yn[k], sn, e_rel, tiny)
        lo_min, hi_min = min(lo_min, x[k] - h), min(hi_min, x[k] + h)
    return lo_max, hi_max, lo_min, hi_min


@_jit
def _ordered(bits):
    """An int64 that orders as the float64 whose bits it holds (NaN aside): integer maxima
    and minima run in SIMD lanes where numba's float ones, kept to IEEE semantics, do not.
    Its own inverse."""
    return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)


@_jit
def _screen(x, yn, sn, e_rel, tiny, position, n, n_cand, scores, bands):
    """Whether a row's ball scores follow from its expansions x; if so, scores (3,) <- P, R,
    F. The selection is the keys at positions 0..n-1 (position (K,), n_cand and more: not a
    candidate); bands (2, K) a scratch buffer.

    The radii lie within the limits of :func:`_limits`. A key needs its exact distance where
    the radius it is compared with could fall within its band (expansion plus or minus
    `_half_bound`): an unselected key against r_max, a selected one against r_min. Every
    selected key is inside the r_max ball; an unselected one is not closer than r_min. Passes
    in key order with no branch on a key's membership, the limits taken on the bands' bits
    (`_ordered`); x is finite here."""
    K = x.size
    lo_band, hi_band = bands[0, :K], bands[1, :K]
    for k in range(K):
        h = _half_bound(yn[k], sn, e_rel, tiny)
        lo_band[k], hi_band[k] = x[k] - h, x[k] + h
    lo_bits, hi_bits = lo_band.view(np.int64), hi_band.view(np.int64)
    infinite = _ordered(np.array([-np.inf, np.inf]).view(np.int64))
    lo_max = hi_max = infinite[0]
    lo_min = hi_min = infinite[1]
    for k in range(K):
        chosen = position[k] < n
        other = (position[k] >= n) & (position[k] < n_cand)
        lo, hi = _ordered(lo_bits[k]), _ordered(hi_bits[k])
        lo_max = max(lo_max, lo if chosen else infinite[0])
        hi_max = max(hi_max, hi if chosen else infinite[0])
        lo_min = min(lo_min, lo if other else infinite[1])
        hi_min = min(hi_min, hi if other else infinite[1])
    limits = _ordered(np.array([lo_max, hi_max, lo_min, hi_min])).view(np.float64)
    r_max_lo, r_max_hi, r_min_lo, r_min_hi = limits[0], limits[1], limits[2], limits[3]
    inside, closer, band = n, 0, 0
    for k in range(K):
        lo, hi = lo_band[k], hi_band[k]
        chosen = position[k] < n
        other = (position[k] >= n) & (position[k] < n_cand)
        closer += chosen & (hi < r_min_lo)
        inside += other & (hi < r_max_lo)
        band += ((chosen & (hi >= r_min_lo) & (lo <= r_min_hi))
                 | (other & (hi >= r_max_lo) & (lo <= r_max_hi)))
    if band:
        return False
    precision, recall = n / inside, closer / n
    scores[0], scores[1] = precision, recall
    scores[2] = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return True


@_jit
def _ball(y, s, x, yn, e_rel, tiny, unsure, order, n, n_cand, cache):
    """Ball scores of the selection order[:n] among the candidates order[:n_cand] around s
    (docs/method.md#balls): P(r_max, N), R(r_min, N), F, r_max^2, r_min^2 of the exact
    distances. x: the row's expansions, yn (K,) the keys' norms ||y_k|| (their error bounds,
    `_half_bound`); unsure: compare every key exactly.

    A radius is the distance of a key whose band (its expansion plus or minus its bound)
    reaches the extreme of the others' bands; a key whose band lies below (above) a radius
    is inside (outside) by its expansion, the rest are compared exactly. Loops run over the
    order's lists, so no branch depends on a key's membership."""
    sn = np.sqrt(_dot(s, s))
    lo_max, _, _, hi_min = _limits(x, yn, sn, e_rel, tiny, order, n, n_cand)
    r_max2, r_min2 = -np.inf, np.inf
    for i in range(n):
        k = np.uint64(order[i])
        if unsure or x[k] + _half_bound(yn[k], sn, e_rel, tiny) >= lo_max:
            r_max2 = max(r_max2, _exact(y, k, s, cache))
    for i in range(n, n_cand):
        k = np.uint64(order[i])
        if unsure or x[k] - _half_bound(yn[k], sn, e_rel, tiny) <= hi_min:
            r_min2 = min(r_min2, _exact(y, k, s, cache))
    inside = closer = 0
    if unsure:
        for i in range(n_cand):
            inside += _exact(y, np.uint64(order[i]), s, cache) <= r_max2
        for i in range(n):
            closer += _exact(y, np.uint64(order[i]), s, cache) < r_min2
    else:
        for i in range(n_cand):
            k = np.uint64(order[i])
            h = _half_bound(yn[k], sn, e_rel, tiny)
            if x[k] + h < r_max2:
                inside += 1
            elif x[k] - h <= r_max2:
                inside += _exact(y, k, s, cache) <= r_max2
        for i in range(n):
            k = np.uint64(order[i])
            h = _half_bound(yn[k], sn, e_rel, tiny)
            if x[k] + h < r_min2:
                closer += 1
            elif x[k] - h < r_min2:
                closer += _exact(y, k, s, cache) < r_min2
    precision = n / inside
    recall = closer / n
    f_score = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f_score, r_max2, r_min2


@_jit
def _expansions(yy, sv, alpha, ss, y_max, e_rel, tiny, x):
    """x (K,) <- the expansions of D around one aggregate (its products sv (K,) with the
    values, <y_k, s> = alpha_k <v_k, s>; its squared norm ss); returns the row's error bound
    and whether the row must be compared exactly (a non-finite bound or expansion)."""
    bound = e_rel * (y_max + np.sqrt(ss)) ** 2 + tiny
    finite = np.isfinite(bound)
    for k in range(x.size):
        expansion = yy[k] - 2 * (alpha[k] * sv[k]) + ss
        x[k] = expansion
        finite &= expansion - expansion == 0.0  # a boolean, not a float sum: SIMD lanes
    return (bound if finite else 0.0), not finite


# ------------------------------------------------------------------ the sink-aware bounds


@_jit
def _bisect_left(a, v):
    """The first index of the sorted a whose value is >= v (a.size if none)."""
    lo, hi = 0, a.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def _count_below(small, large, strict):
    """#{(s, l): l < s} (strict) or #{(s, l): l <= s} (not strict) over s in small and l in
    large, as a search of small sorted (NaN last) counts them: a NaN s lies above every finite
    l, and a NaN l below every s when not strict, below none when strict.

    Most of large lies outside small's range (87% on a Mistral-7B block): counted without a
    search; the few within it are compared with every s, and small is sorted only when they
    are many, or when small holds a NaN."""
    n = small.size
    s_lo, s_hi, finite = _extent(small)
    if n == 0:
        return 0
    count = 0
    within = np.empty(large.size)
    j = 0
    for v in large:
        if finite and (v >= s_hi if strict else v > s_hi):
            continue
        if finite and (v < s_lo if strict else v <= s_lo):
            count += n
        else:
            within[j] = v
            j += 1
    if finite and j <= _SCAN_PER_LOG * np.log2(n + 1):
        for v in within[:j]:
            for x in small:
                count += (x > v) if strict else not (x < v)
        return count
    ordered = np.sort(small)
    for v in within[:j]:
        count += n - (np.searchsorted(ordered, v, side="right") if strict else _bisect_left(ordered, v))
    return count


@_jit
def _extent(x):
    """(min, max, whether x holds no NaN)."""
    lo, hi, finite = np.inf, -np.inf, True
    for v in x:
        lo, hi = min(lo, v), max(hi, v)
        finite &= v == v
    return lo, hi, finite


@_jit
def _k_sink(beta, selected, order, n, n_att, nonsink, has_sink, mu, nu_plus, nu_minus, l_rtol):
    """K_N^sink of the appendix proof (docs/method.md#sink-aware-bound): the
    selected-unselected pairs whose lower bound L <= (D_j - D_i)/C^2 is not positive, each
    L counted "<= 0" within l_rtol of its scale (beta + A)^2 (see kernels._k_sink). The
    selection is order[:n] (selected (K,) its mask), the unselected candidates order[n:n_att]."""
    K = beta.size
    sigma = selected[0] and has_sink
    beta0 = beta[0] if has_sink else 0.0
    # A_+ adds in position order, as it always has: its last bit can decide a count.
    a_plus = 0.0
    for k in range(K):
        if nonsink[k] and selected[k]:
            a_plus += beta[k]
    n_sel = n - sigma
    n_uns = n_att - n - (has_sink and not sigma)
    scale = a_plus + beta0
    tol0 = l_rtol * (beta0 + scale) ** 2
    sink_weight = beta0 if sigma else 0.0
    minus_f = np.empty(n_sel)
    g = np.empty(n_uns)
    c_p0 = beta0**2 - tol0 + 2 * beta0 * nu_minus * a_plus
    c_0p = beta0**2 - tol0 - 2 * beta0 * nu_plus * a_plus
    k_p0 = k_0p = 0
    # The two sides in selection order: no branch on a key's membership (in position order
    # it mispredicts), and the counts do not depend on the order.
    i = 0
    for t in range(n):
        k = np.uint64(order[t])
        if nonsink[k]:
            b = beta[k]
            tol = l_rtol * (b + scale) ** 2
            f = b * b - 2 * mu * b * (a_plus - b) - 2 * sink_weight * nu_plus * b - tol
            minus_f[i] = -f
            i += 1
            k_p0 += f + c_p0 <= 0
    j = 0
    for t in range(n, n_att):
        k = np.uint64(order[t])
        if nonsink[k]:
            b = beta[k]
            tol = l_rtol * (b + scale) ** 2
            gk = b * b - 2 * mu * b * a_plus + 2 * sink_weight * nu_minus * b - tol
            g[j] = gk
            j += 1
            k_0p += gk + c_0p <= 0
    # g_j <= -f_i, searched in the smaller side.
    if n_sel <= n_uns:
        k_pp = _count_below(minus_f, g, False)
    else:
        k_pp = n_sel * n_uns - _count_below(g, minus_f, True)
    if sigma:
        return k_pp + k_0p
    return k_pp + k_p0 if has_sink else k_pp


# ------------------------------------------------------------------ one query head


@_jit
def aggregates(alpha, values, att, points, draw_keys, y, S, s_plus, orders):
    """One query head's contributions y = alpha v (K, D) and aggregates, filled in place: the
    rows of S (rows, D) are the main selection's s_N at each of points, then the
    sink-excluded selection's at the Pn points where it is valid (:func:`_sink_excluded_sizes`),
    then each random draw's at every point; s_plus (P, D) the main s_N without the sink; and
    orders = (order, rank, ns_order, draw_orders), the orders (and the main ranks) of the three
    selections, (K,) each and (R, K). alpha (K,), values (K, D), att (K,) bool, points (P,)
    ascending, draw_keys (R, K)."""
    K, D = values.shape
    P, R = points.size, draw_keys.shape[0]
    Pn = S.shape[0] - P - R * P
    order, rank, ns_order, draw_orders = orders
    has_sink = att[0]
    nonsink = att.copy()
    nonsink[0] = False
    n_ns = 0
    for k in range(K):
        n_ns += nonsink[k]
    for k in range(K):
        for d in range(D):
            y[k, d] = alpha[k] * values[k, d]
    order[:], rank[:] = ranked(-alpha, att)
    _prefix_sums(y, order, nonsink, points, s_plus, 0)
    for p in range(P):
        sink_in = has_sink and rank[0] < points[p]
        for d in range(D):
            S[p, d] = s_plus[p, d] + y[0, d] if sink_in else s_plus[p, d]
    ns_order[:] = _without_sink(order, n_ns + has_sink, has_sink)
    if Pn:
        _prefix_sums(y, ns_order, nonsink, points[:Pn], S, P)
    for r in range(R):
        draw_orders[r] = uniform_ranked(draw_keys[r], att)
        _prefix_sums(y, draw_orders[r], att, points, S, P + Pn + r * P)


@_jit
def _sink_excluded_sizes(points, att):
    """Pn: how many of points the sink-excluded selection has (N below the number of
    non-sink keys; none without a sink)."""
    if not att[0]:
        return 0
    n_ns = 0
    for k in range(1, att.size):
        n_ns += att[k]
    return np.sum(points < n_ns)


@_jit
def _without_sink(order, n_att, has_sink):
    """``ranked(key, candidates without 0)[0]`` from ``order = ranked(key, candidates)[0]``
    (n_att candidates): the sink leaves the candidates for the head of the others, which
    follow in position order."""
    if not has_sink:
        return order
    out = np.empty_like(order)
    j = 0
    for i in range(n_att):
        if order[i] != 0:
            out[j] = order[i]
            j += 1
    out[j] = 0
    out[j + 1:] = order[n_att:]
    return out


@_jit
def _rows(P, Pn, R):
    """For each aggregate row: its size's index p and which selection (0 main, 1 sink-excluded,
    2 + r random draw r)."""
    rows = P + Pn + R * P
    point = np.empty(rows, np.int64)
    kind = np.empty(rows, np.int64)
    for i in range(rows):
        if i < P:
            point[i], kind[i] = i, 0
        elif i < P + Pn:
            point[i], kind[i] = i - P, 1
        else:
            point[i], kind[i] = (i - P - Pn) % P, 2 + (i - P - Pn) // P
    return point, kind


@_jit
def _mark_near_pairs(x, order, n, n_cand, width, mark):
    """Marks every selected key order[:n] and unselected candidate order[n:n_cand] whose
    (finite) expansions x are within width of one of the other side. The candidates above
    every selected key by more than width are passed over; the few others are compared with
    every selected key, or, when many, looked up in the selected keys sorted."""
    x_top = -np.inf
    for i in range(n):
        x_top = max(x_top, x[np.uint64(order[i])])
    near = np.empty(n_cand - n, np.int64)
    j = 0
    for i in range(n, n_cand):
        near[np.uint64(j)] = order[i]
        j += not (x[np.uint64(order[i])] - width > x_top)
    if j <= _SCAN_PER_LOG * np.log2(n + 1):
        for t in range(j):
            k = near[t]
            lo, hi = x[k] - width, x[k] + width
            for i in range(n):
                c = np.uint64(order[i])
                if x[c] >= lo and x[c] <= hi:
                    mark[k] = mark[c] = True
        return
    chosen = order[:n]
    by_x = np.argsort(x[chosen])
    xs = x[chosen][by_x]
    for t in range(j):
        k = near[t]
        lo = _bisect_left(xs, x[k] - width)
        hi = lo
        while hi < n and xs[hi] <= x[k] + width:
            hi += 1
        if lo != hi:
            mark[k] = True
            for i in range(lo, hi):
                mark[chosen[by_x[i]]] = True


@_jit
def exact_keys(y, S, sv, alpha, orders, points, att, options, X, err, unsure, scores):
    """Fills the expansions X (rows, K) of the aggregates' distances (the rows it leaves a score
    NaN, which :func:`head_geometry` reads; the others are not written), each row's error bound
    err (rows,) and whether it is compared exactly, unsure (rows,), and returns the (row, key)
    pairs whose exact distance the comparisons of :func:`head_geometry` can need: the candidates for a radius
    and the keys whose band (expansion plus or minus `_half_bound`) meets the range the
    radius they are compared with can take (:func:`_ball`), and in the main rows the sink and
    every selected and unselected key (or the sink) within 3e of one of the other side
    (inversions); every candidate of a row compared exactly.

    An expansion is within its half bound (within e/2) of D_k computed either way, so the other
    comparisons come out the same whichever way D_k is rounded. A sink-excluded or random row whose scores no
    exact distance can change gets them here: scores (rows, 3) P, R, F, NaN in the other
    rows. The outputs are filled in place: a head's share of the group's arrays, not a copy."""
    K = y.shape[0]
    rows = S.shape[0]
    order, rank, ns_order, draw_orders = orders
    P, R = points.size, draw_orders.shape[0]
    Pn = rows - P - R * P
    n_att = 0
    for k in range(K):
        n_att += att[k]
    yy = np.empty(K)
    for k in range(K):
        yy[k] = _dot(y[k], y[k])
    y_max = np.sqrt(yy.max()) if K else 0.0
    yn = np.sqrt(yy)
    e_rel, tiny = options[0], options[1]
    point, kind = _rows(P, Pn, R)
    mark = np.zeros(K, np.bool_)
    pair_rows, pair_keys = [0], [0]
    pair_rows.pop()
    pair_keys.pop()
    scores[:] = np.nan
    # Each key's position in the sink-excluded and random selections (K: not a candidate).
    positions = np.full((1 + R, K), K, np.int64)
    bands = np.empty((2, K))
    for i in range(n_att - 1):
        positions[0, np.uint64(ns_order[i])] = i
    for r in range(R):
        for i in range(n_att):
            positions[1 + r, np.uint64(draw_orders[r, i])] = i
    scratch = np.empty(K)
    for row in range(rows):
        ss = _dot(S[row], S[row])
        # A row the screen settles is not kept: most random rows' expansions stay in cache.
        x = X[row] if kind[row] == 0 else scratch
        err[row], unsure[row] = _expansions(yy, sv[row], alpha, ss, y_max, options[0], options[1], x)
        e, n = err[row], points[point[row]]
        if kind[row] == 0:
            sel_order, n_cand = order, n_att
        elif kind[row] == 1:
            sel_order, n_cand = ns_order, n_att - 1
        else:
            sel_order, n_cand = draw_orders[kind[row] - 2], n_att
        sn = np.sqrt(ss)
        if kind[row] > 0 and not unsure[row] and _screen(x, yn, sn, e_rel, tiny,
                                                         positions[kind[row] - 1], n, n_cand,
                                                         scores[row], bands):
            continue
        if kind[row] > 0:
            X[row] = scratch
        lo_max, hi_max, lo_min, hi_min = _limits(x, yn, sn, e_rel, tiny, sel_order, n, n_cand)
        # Those keys, and the candidates for each radius.
        for i in range(n_cand):
            key = np.uint64(sel_order[i])
            h = _half_bound(yn[key], sn, e_rel, tiny)
            if i < n:
                mark[key] = (x[key] + h >= lo_max) or (x[key] + h >= lo_min and x[key] - h <= hi_min)
            else:
                mark[key] = (x[key] - h <= hi_min) or (x[key] + h >= lo_max and x[key] - h <= hi_max)
            mark[key] = mark[key] or unsure[row]
        if kind[row] == 0:
            # Inversions and the sink's comparisons: the pairs of a selected and an
            # unselected key (the sink among them) whose expansions are within 3e (an unsure
            # row has marked every candidate already).
            mark[0] = att[0]
            if not unsure[row]:
                _mark_near_pairs(x, sel_order, n, n_cand, 3 * e, mark)
        for k in range(K):
            if mark[k]:
                pair_rows.append(row)
                pair_keys.append(k)
                mark[k] = False
    return np.array(pair_rows, np.int64), np.array(pair_keys, np.int64)


@_jit
def _inversions(d_sel, x, order, n, n_att, width, unsure, y, s, cache):
    """A_N = #{(i, j) in I_N x U_N: D_j <= D_i} from the selected keys' exact distances d_sel
    (n,) and the unselected keys' expansions x (order[n:n_att]), within width of D_j unless
    unsure: a key above every D_i by more than width makes no inversion (the common case);
    with no D_i within width of x_j, D_i >= D_j exactly for the D_i above the band; else
    D_j is taken exactly. The few keys left are compared with every D_i, or, when many,
    looked up in them sorted."""
    d_top, finite = _extent(d_sel)[1:]
    near = np.empty(n_att - n, np.int64)
    j = 0
    for i in range(n, n_att):
        near[np.uint64(j)] = order[i]
        j += unsure or not finite or not (x[np.uint64(order[i])] - width > d_top)
    inversions = 0
    if finite and j <= _SCAN_PER_LOG * np.log2(n + 1):
        for t in range(j):
            k = near[t]
            if not unsure:
                lo, hi = x[k] - width, x[k] + width
                at_or_above, within = 0, False
                for d in d_sel:
                    at_or_above += not (d < lo)
                    within |= (d >= lo) & (d <= hi)
                if not within:
                    inversions += at_or_above
                    continue
            d_k = _exact(y, k, s, cache)
            for d in d_sel:
                inversions += not (d < d_k)
        return inversions
    d_sorted = np.sort(d_sel)
    for t in range(j):
        k = near[t]
        lo = _bisect_left(d_sorted, x[k] - width)
        if not unsure and (lo == n or d_sorted[lo] > x[k] + width):
            inversions += n - lo
        else:
            inversions += n - _bisect_left(d_sorted, _exact(y, k, s, cache))
    return inversions


@_jit
def head_geometry(values, att, points, y, S, s_plus, sv, expansions, named, orders, alpha, v_norm,
                  head_constants, mu, mu_q95, options, floats, counts):
    """Every top-N output of one query head (docs/method.md) at the valid sizes ``points``
    (ascending, each < |K|): floats (N_FLOATS, P) and counts (N_COUNTS, P), filled in place
    (they arrive NaN / -1).

    values (K, D) of the head's kv head, att (K,) bool; y, S, s_plus and orders from
    :func:`aggregates`, sv (rows, K) = S values^T; expansions = (X, err, unsure, scores) from
    :func:`exact_keys` and named = (rows, keys, distances) the exact distances of the pairs it
    names, rows ascending; alpha (K,) the attention row; v_norm (K,) ||v_k||; head_constants: C, c_lo,
    c_hi, q05, q95 of the kv head; mu and mu_q95 (P,) from :func:`head_coherence`; options:
    e_rel, tiny, l_rtol (`_k_sink`).
    """
    K, D = values.shape
    P = points.size
    order, rank, ns_order, draw_orders = orders
    R = draw_orders.shape[0]
    e_rel, tiny, l_rtol = options[0], options[1], options[2]
    C, c_lo, c_hi, q05, q95 = (head_constants[0], head_constants[1], head_constants[2],
                               head_constants[3], head_constants[4])
    has_sink = att[0]
    nonsink = att.copy()
    nonsink[0] = False
    n_att = n_ns = 0
    for k in range(K):
        n_att += att[k]
        n_ns += nonsink[k]
    Pn = S.shape[0] - P - R * P
    yy = np.empty(K)
    y_norm = np.empty(K)
    o = np.zeros(D)
    for k in range(K):
        yy[k] = _dot(y[k], y[k])
        y_norm[k] = np.sqrt(yy[k])
        if att[k]:
            for d in range(D):
                o[d] += y[k, d]
    o_norm = _norm(o)
    X, err, unsure_rows, row_scores = expansions
    buffer = np.empty(K)

    # The sink-aware bounds' weights (paper: beta_0 = lambda alpha_0; exact: alpha ||v||).
    paper_defined = not has_sink or C > 0
    beta_paper = alpha.copy()
    beta_paper[0] = alpha[0] * v_norm[0] / C if has_sink and paper_defined else 0.0
    beta_exact = alpha * v_norm
    nu_paper = (max(0.0, -c_lo), max(0.0, -c_hi)) if has_sink else (0.0, 0.0)
    nu_q95 = (max(0.0, -q05), max(0.0, -q95)) if has_sink else (0.0, 0.0)
    nu_exact = (-c_lo, -c_hi) if has_sink else (0.0, 0.0)

    # The sizes grow and the selections nest: I_N is kept by adding the keys it gains.
    selected = np.zeros(K, dtype=np.bool_)
    for p in range(P):
        n = points[p]
        s = S[p]
        x, e, unsure, cache = X[p], err[p], unsure_rows[p], _row_cache(named, p, buffer)
        precision, recall, f_score, r_max2, r_min2 = _ball(y, s, x, y_norm, e_rel, tiny, unsure,
                                                          order, n, n_att, cache)
        floats[PRECISION, p], floats[RECALL, p], floats[F_SCORE, p] = precision, recall, f_score
        for i in range(n):
            selected[order[i]] = True
        sigma = has_sink and selected[0]
        counts[SINK_SELECTED, p] = sigma

        # Inversions #{(i, j): D_j <= D_i} from the selected keys' exact distances.
        d_sel = np.empty(n)
        for i in range(n):
            d_sel[i] = _exact(y, np.uint64(order[i]), s, cache)
        counts[INVERSIONS, p] = _inversions(d_sel, x, order, n, n_att, 2 * e, unsure, y, s, cache)

        if has_sink and not sigma:
            d0 = _exact(y, 0, s, cache)
            floats[SINK_INTRUSION, p] = 1.0 if d0 <= r_max2 else 0.0
            beats = 0
            for i in range(n):
                beats += d0 <= d_sel[i]
            floats[SINK_PAIR_INVERSION_FRAC, p] = beats / n

        # Leave-one-out: s_{N,-i} = s_N - y_i.
        s_norm = _norm(s)
        loo_sum, loo_pos, loo_n, spread_max = 0.0, 0, 0, -np.inf
        for i in range(n):
            key = np.uint64(order[i])
            # cos(y_i, s_{N,-i}) = -<y_i, y_i - s_N> / (||y_i|| ||y_i - s_N||), and
            # ||y_i - s_{N,-i}|| = ||2 y_i - s_N||.
            inner, spread2 = _leave_one_out(y[key], s)
            c = -inner / (y_norm[key] * np.sqrt(d_sel[i]))
            if np.isfinite(c):
                loo_sum += c
                loo_pos += c > 0
                loo_n += 1
            spread_max = max(spread_max, np.sqrt(spread2))
        js_sum, js_n = 0.0, 0
        for i in range(n, n_att):
            key = np.uint64(order[i])
            c = alpha[key] * sv[p, key] / (y_norm[key] * s_norm)
            if np.isfinite(c):
                js_sum += c
                js_n += 1
        loo_cos = loo_sum / loo_n if loo_n else np.nan
        floats[LOO_COS, p] = loo_cos
        floats[LOO_POSITIVE_FRAC, p] = loo_pos / loo_n if loo_n else np.nan
        floats[LOO_MARGIN, p] = loo_cos - js_sum / js_n if js_n else np.nan
        floats[LOO_DISTANCE_MARGIN, p] = np.sqrt(r_min2) - spread_max

        # Sink shares and mechanistic signatures.
        sp = s_plus[p]
        if sigma:
            floats[SINK_NORM_SHARE, p] = y_norm[0] / s_norm
            floats[SINK_DIRECTION_CHANGE, p] = 1.0 - _cos(s, sp)
        if has_sink:
            floats[SINK_ALIGNMENT, p] = _cos(y[0], sp)
            floats[COS_S_V0, p] = _cos(s, values[0])
        floats[S_NORM, p] = s_norm / o_norm
        floats[S_NORM_NOSINK, p] = _norm(sp) / o_norm
        if selected[K - 1]:
            floats[S_NORM_NOCURRENT, p] = np.sqrt(_squared_difference(s, y[K - 1])) / o_norm
        else:
            floats[S_NORM_NOCURRENT, p] = s_norm / o_norm
        floats[COS_S_VLAST, p] = _cos(s, values[K - 1])

        # Bounds: the paper's variant, the robust one (q95) and the exact certificate.
        mu_p = 0.0 if np.isnan(mu[p]) else mu[p]
        mu_q = 0.0 if np.isnan(mu_q95[p]) else mu_q95[p]
        floats[MU, p], floats[MU_Q95, p] = mu[p], mu_q95[p]
        counts[K_SINK_EXACT, p] = _k_sink(beta_exact, selected, order, n, n_att, nonsink, has_sink, mu_p,
                                          nu_exact[0], nu_exact[1], l_rtol)
        if paper_defined:
            k_paper = _k_sink(beta_paper, selected, order, n, n_att, nonsink, has_sink, mu_p,
                              nu_paper[0], nu_paper[1], l_rtol)
            k_q95 = _k_sink(beta_paper, selected, order, n, n_att, nonsink, has_sink, mu_q,
                            nu_q95[0], nu_q95[1], l_rtol)
            counts[K_SINK, p], counts[K_SINK_Q95, p] = k_paper, k_q95
            floats[PRECISION_BOUND, p] = 1.0 / (1.0 + k_paper / n)
            floats[RECALL_BOUND, p] = max(0.0, 1.0 - k_paper / n)
            floats[PRECISION_BOUND_Q95, p] = 1.0 / (1.0 + k_q95 / n)
            floats[RECALL_BOUND_Q95, p] = max(0.0, 1.0 - k_q95 / n)

    # The sink-excluded variant: without a sink it is the main selection.
    for p in range(P):
        if not has_sink:
            floats[NOSINK_PRECISION, p] = floats[PRECISION, p]
            floats[NOSINK_RECALL, p] = floats[RECALL, p]
            floats[NOSINK_F_SCORE, p] = floats[F_SCORE, p]
        elif p < Pn:
            row = P + p
            if np.isnan(row_scores[row, 0]):
                scores = _ball(y, S[row], X[row], y_norm, e_rel, tiny, unsure_rows[row], ns_order,
                               points[p], n_ns, _row_cache(named, row, buffer))
                row_scores[row] = scores[0], scores[1], scores[2]
            floats[NOSINK_PRECISION, p], floats[NOSINK_RECALL, p], floats[NOSINK_F_SCORE, p] = (
                row_scores[row, 0], row_scores[row, 1], row_scores[row, 2])

    # The random control: mean over the draws.
    if R:
        for p in range(P):
            total = np.zeros(3)
            for r in range(R):
                row = P + Pn + r * P + p
                if np.isnan(row_scores[row, 0]):
                    scores = _ball(y, S[row], X[row], y_norm, e_rel, tiny, unsure_rows[row],
                                   draw_orders[r], points[p], n_att,
                                   _row_cache(named, row, buffer))
                    row_scores[row] = scores[0], scores[1], scores[2]
                for i in range(3):
                    total[i] += row_scores[row, i]
            floats[RANDOM_PRECISION, p] = total[0] / R
            floats[RANDOM_RECALL, p] = total[1] / R
            floats[RANDOM_F_SCORE, p] = total[2] / R


# ------------------------------------------------------------------ one kv head's pairs


@_jit
def _pair_cos(unit, q, p):
    """<u_q, u_p> in float64, its terms added in one fixed order (four running sums): the one
    value a pair's cosine takes wherever an output or a comparison reads it exactly (the
    float32 Gram matrix only screens for the pairs that need it, see
    `kernels._screen_bound`)."""
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


@_jit
def _refined_pair(x, at, lo, hi, below, x_lo, x_hi, unit, delta, absolute):
    """The lo-th and hi-th smallest pair cosines (|cosine| if absolute) of a set, exact
    (`_pair_cos`), from the screen: x (n,) the float32 values of the set's members within
    [x_lo, x_hi], ``below`` members below x_lo, at (n,) their pairs as indices t
    (:func:`_pair_at`); every float32 value within delta of its exact one.

    The exact statistics lie within delta of those of x, so a member more than 2 delta below
    (above) them is below (above) both: only the members of that band are computed. Returns
    (False, NaN, NaN) where the band reaches outside [x_lo, x_hi] (members not in x)."""
    f_lo, f_hi = _order_pair(x, lo - below, hi - below)
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
            c = _pair_cos(unit, q, p)
            band[j] = abs(c) if absolute else c
            j += 1
    band = np.sort(band[:j])
    return True, band[lo - n_below], band[hi - n_below]


@_jit
def _exact_row_max(gram, unit, r, screened, delta):
    """max_{q != r} |<u_r, u_q>| exact (`_pair_cos`), from the screen's maximum of the row:
    only its pairs within 2 delta of that maximum can hold the exact one."""
    best = -np.inf
    floor = screened - 2 * delta
    for p in range(r):
        if abs(gram[r, p]) >= floor:
            best = max(best, abs(_pair_cos(unit, r, p)))
    for q in range(r + 1, gram.shape[0]):
        if abs(gram[q, r]) >= floor:
            best = max(best, abs(_pair_cos(unit, q, r)))
    return best


@_jit
def _bucket_of(v, edges):
    """The bucket of a listed |cosine| v (`pair_statistics`): buckets descend in |cosine|."""
    a_lo, scale = edges[0], edges[1]
    return _BUCKETS - 1 - max(min(int((v - a_lo) * scale), _BUCKETS - 1), 0)


@_jit
def _pair_at(t):
    """The t-th pair (q, p), q > p, of the lower triangle in row order."""
    q = int((1.0 + np.sqrt(1.0 + 8.0 * t)) / 2.0)
    while q * (q - 1) // 2 > t:
        q -= 1
    while (q + 1) * q // 2 <= t:
        q += 1
    return q, t - q * (q - 1) // 2


@_jit
def _pair_index(q, p):
    """The index t of the pair (q, p), q > p, of the lower triangle in row order (`_pair_at`'s
    inverse)."""
    return q * (q - 1) // 2 + p


@_jit
def _interpolate(below, above, pos, lo):
    """numpy's 'linear' quantile between the order statistics lo and lo + 1."""
    return below + (pos - lo) * (above - below)


@_jit
def _order_pair(x, lo, hi):
    """The lo-th and hi-th smallest of x (hi = lo or lo + 1): by a partition (of a copy) for
    a short x or one holding NaN, else by :func:`_order_pair_counted`. Both give the same
    two values."""
    if x.size >= _COUNTED_MIN:
        x_min, x_max, finite = np.inf, -np.inf, 0.0
        for v in x:
            x_min, x_max = min(x_min, v), max(x_max, v)
            finite += v - v  # NaN once a value is NaN or infinite
        if finite == 0.0 and np.isfinite(x_max - x_min):
            return _order_pair_counted(x, lo, hi, x_min, x_max)
    part = np.partition(x, lo)
    return part[lo], (part[lo] if hi == lo else part[lo + 1:].min())


@_jit
def _order_pair_counted(x, lo, hi, x_min, x_max):
    """`_order_pair` of a finite x within [x_min, x_max], in two passes of counting: the
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


@_jit
def _bracket(sample, lo, hi, m, share, use):
    """Bounds around the order statistics lo..hi of m values from their sorted sample, with a
    margin of ``share`` of the sample (the whole line unless use)."""
    if not use:
        return -np.inf, np.inf
    ns = sample.size
    margin = share * ns + 8
    return (sample[max(int(lo / m * ns - margin), 0)],
            sample[min(int(hi / m * ns + margin), ns - 1)])


@_jit
def _row_pairs(gram, columns, start):
    """The pairs (q, columns[i]) for i in start[q]:start[q + 1]: their Gram entries (float64)
    and indices t (:func:`_pair_at`)."""
    n = start[-1]
    x = np.empty(n)
    at = np.empty(n, np.int64)
    for q in range(1, gram.shape[0]):
        for i in range(start[q], start[q + 1]):
            x[i] = gram[q, np.uint64(columns[i])]
            at[i] = _pair_index(q, columns[i])
    return x, at


@_jit
def pair_statistics(gram, unit, delta, share, min_pairs, bracket_min):
    """One kv head's pair statistics from its Gram matrix (k, k) of unit non-sink values,
    read below the diagonal only (``gram[q, p]``, q > p):

    - the median of the k(k-1)/2 pair cosines (numpy's 'linear' quantile);
    - row_max (k,): max_{q != p} |<u_p, u_q>|;
    - the pairs whose |cosine| is at or above a threshold that keeps about ``share`` of them
      (all of them up to ``min_pairs`` pairs): (p, q) grouped into buckets of descending
      |cosine| (every pair of a bucket above every pair of a later one), the buckets'
      bounds, and edges = (lowest listed |cosine|, buckets per unit |cosine|,
      threshold) for :func:`_bucket_of`.

    With delta > 0 the Gram matrix is a float32 screen (each entry within delta of the exact
    `_pair_cos` of unit (k, D)): the median is exact (:func:`_refined_pair`), the rest holds
    the screen's values, which :func:`head_coherence` refines. With delta = 0 its values are
    the cosines.

    The median is found in a bracket around it taken from a sample of 2,048 pairs (counting
    the pairs below it, selecting among the few inside) once the head has more than
    ``bracket_min`` pairs; a bracket that misses is widened once, then every pair is sorted.
    """
    k = gram.shape[0]
    m = k * (k - 1) // 2
    row_max = np.full(k, -np.inf)
    if m == 0:
        return (np.nan, row_max, np.empty(0, np.int64), np.empty(0, np.int64), np.zeros(1, np.int64),
                np.zeros(3))
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
    # their rows given by where each row's begin (int32: m < 2^31, `kernels._check_batch`).
    # The lists' ends index as unsigned (`_loops` module docstring): a quarter of the pass.
    inside = np.empty(m + 1, np.int32)  # p of the pairs (q, p) inside the bracket
    in_start = np.zeros(k + 1, np.int64)
    listed = np.empty(m + 1, np.int32)  # p of the listed pairs (q, p)
    row_start = np.zeros(k + 1, np.int64)
    n_in = below = n_top = 0
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
                found, below_value, above_value = _refined_pair(x, at, lo, hi, below, t_lo, t_hi, unit,
                                                                delta, False)
            else:
                found = True
                below_value, above_value = _order_pair(x, lo - below, hi - below)
            if found:
                median = _interpolate(below_value, above_value, pos, lo)
                break
        t_lo, t_hi = _bracket(sample, lo, hi, m, 0.08, attempt == 0 and m > bracket_min)
        n_in = below = 0
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
            b = _bucket_of(abs(gram[q, np.uint64(listed[i])]), edges)
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
    return median, row_max, out_p, out_q, bounds, edges


@_jit
def _exact_mu(gram, unit, delta, row_max, exact_rows, keys, screened):
    """max of the exact row maxima (`_exact_row_max`, kept in exact_rows, NaN until needed) of
    keys; row_max are the screen's and screened their maximum over keys: a row more than
    2 delta below it cannot hold the exact one."""
    best = -np.inf
    for r in keys:
        if row_max[r] >= screened - 2 * delta:
            if np.isnan(exact_rows[r]):
                exact_rows[r] = _exact_row_max(gram, unit, r, row_max[r], delta)
            best = max(best, exact_rows[r])
    return best


@_jit
def _listed_statistics(stats, ts, bounds, members, p, first, n, top_p, top_q, gram, unit, delta,
                       edges):
    """The members ts[0] and ts[1] from the top (|cosine| descending) of the set of points[p]
    among the listed pairs, into stats; False if fewer are listed. With delta > 0 the
    buckets locate the screen's values, and the members within 2 delta of them are computed
    exactly (`_pair_cos`): those above are above both; False if that band reaches below the
    listing threshold (pairs not listed)."""
    n_buckets = bounds.size - 1
    for which in range(2):
        t = ts[which]
        seen = 0
        found = False
        for b in range(n_buckets):
            c = members[b, p]
            if seen + c > t:
                inb = np.empty(c)
                j = 0
                for i in range(bounds[b], bounds[b + 1]):
                    if first[i] < n:
                        inb[j] = abs(gram[top_q[i], top_p[i]])
                        j += 1
                inb = -np.sort(-inb)
                stats[which] = inb[t - seen]
                found = True
                break
            seen += c
        if not found:
            return False
    if delta == 0:
        return True
    band_lo, band_hi = min(stats[0], stats[1]) - 2 * delta, max(stats[0], stats[1]) + 2 * delta
    if band_lo < edges[2]:
        return False
    b_top, b_bottom = _bucket_of(band_hi, edges), _bucket_of(band_lo, edges)
    above = 0
    for b in range(b_top):
        above += members[b, p]
    band = np.empty(bounds[b_bottom + 1] - bounds[b_top])
    j = 0
    for i in range(bounds[b_top], bounds[b_bottom + 1]):
        if first[i] < n:
            a = abs(gram[top_q[i], top_p[i]])
            if a > band_hi:
                above += 1
            elif a >= band_lo:
                band[j] = abs(_pair_cos(unit, top_q[i], top_p[i]))
                j += 1
    band = -np.sort(-band[:j])
    stats[0], stats[1] = band[ts[0] - above], band[ts[1] - above]
    return True


@_jit
def head_coherence(rank, row_max, top_p, top_q, bounds, edges, gram, unit, delta, exact_rows,
                   points, n_att, mu, mu_q95):
    """mu and mu_q95 (P,) of one query head at the sizes points
    (docs/method.md#sink-aware-bound): mu_N = max |<u_p, u_q>| over the non-sink pairs with
    p in I_N, mu_q95 their 95% quantile ('linear'); NaN without such a pair, mu_q95 also where
    N >= |K|.

    rank (k,): the selection rank of each non-sink key (in the kv head's Gram order); the
    pair statistics of :func:`pair_statistics`, its Gram matrix, unit values and delta;
    exact_rows (k,) the exact row maxima found so far, shared by the kv head's query heads.
    A pair is in the set of N iff the smaller rank of its keys is < N. The quantile's order
    statistics are counted from the top of the listed pairs' buckets; a set with too few
    listed members is gathered whole.
    """
    k, P = rank.size, points.size
    # The keys by rank: ranks are distinct positions in a selection order.
    slot = np.full(rank.max() + 1 if k else 0, -1, np.int64)
    for i in range(k):
        slot[rank[i]] = i
    by_rank = np.empty(k, np.int64)
    j = 0
    for r in range(slot.size):
        if slot[r] >= 0:
            by_rank[j] = slot[r]
            j += 1
    running = np.empty(k)
    best = -np.inf
    for i in range(k):
        best = max(best, row_max[by_rank[i]])
        running[i] = best
    n_buckets = bounds.size - 1
    # members[b, p]: listed pairs of bucket b in the set of points[p].
    members = np.zeros((n_buckets, P + 1), np.int64)
    first = np.empty(top_p.size, np.int64)
    # The first size at which a key of rank r is selected, for every rank.
    point_of = np.searchsorted(points, np.arange(rank.max() + 1), side="right")
    for b in range(n_buckets):
        for i in range(bounds[b], bounds[b + 1]):
            f = min(rank[np.uint64(top_p[i])], rank[np.uint64(top_q[i])])
            first[i] = f
            members[b, np.uint64(point_of[np.uint64(f)])] += 1
    for b in range(n_buckets):
        for p in range(P):
            members[b, p + 1] += members[b, p]
    total = k * (k - 1) // 2
    gathered = np.empty(0)
    gathered_at = np.empty(0, np.int32)
    n_gathered = j_gathered = 0
    stats = np.empty(2)
    ts = np.empty(2, np.int64)
    for p in range(P):
        n = points[p]
        s = 0
        for i in range(k):
            s += rank[i] < n
        if s == 0:
            continue
        mu[p] = running[s - 1] if delta == 0 else _exact_mu(gram, unit, delta, row_max, exact_rows,
                                                            by_rank[:s], running[s - 1])
        if n >= n_att:
            continue
        m = total - (k - s) * (k - s - 1) // 2
        pos = 0.95 * (m - 1)
        lo = int(np.floor(pos))
        hi = min(lo + 1, m - 1)
        # From the top: the lo-th smallest is member number m - 1 - lo.
        ts[0], ts[1] = m - 1 - lo, m - 1 - hi
        if not _listed_statistics(stats, ts, bounds, members, p, first, n, top_p, top_q, gram,
                                  unit, delta, edges):
            # Every pair of the set, each once from its key of lower rank; the sets grow with
            # N, so the pairs gathered for a smaller N are kept and only the keys that entered
            # since add theirs. Every |cosine| is written and the count moves on for the
            # members only: which keys follow in rank is as good as random, and a branch on it
            # mispredicts.
            if gathered.size == 0:
                gathered = np.empty(total + 1)
                gathered_at = np.empty(total + 1, np.int32)
            for i in range(n_gathered, s):
                a_key = by_rank[i]
                r_a = rank[a_key]
                for b_key in range(a_key):
                    gathered[np.uint64(j_gathered)] = abs(gram[a_key, b_key])
                    gathered_at[np.uint64(j_gathered)] = _pair_index(a_key, b_key)
                    j_gathered += rank[b_key] > r_a
                for b_key in range(a_key + 1, k):
                    gathered[np.uint64(j_gathered)] = abs(gram[b_key, a_key])
                    gathered_at[np.uint64(j_gathered)] = _pair_index(b_key, a_key)
                    j_gathered += rank[b_key] > r_a
            n_gathered = s
            if delta == 0:
                stats[0], stats[1] = _order_pair(gathered[:m], lo, hi)
            else:
                _, stats[0], stats[1] = _refined_pair(gathered[:m], gathered_at[:m], lo, hi, 0,
                                                      -np.inf, np.inf, unit, delta, True)
        mu_q95[p] = _interpolate(stats[0], stats[1], pos, lo)


@_jit
def _quantile(x, q):
    """numpy's 'linear' q-quantile of the 1-D x, NaN if x is empty."""
    m = x.size
    if m == 0:
        return np.nan
    pos = q * (m - 1)
    lo = int(np.floor(pos))
    below, above = _order_pair(x, lo, min(lo + 1, m - 1))
    return _interpolate(below, above, pos, lo)


@_jit
def kv_head(values, att):
    """What depends on one kv head's values (K, D) and mask att (K,) only: ||v_k|| (K,), the
    unit vectors u_k (K, D) (0 for v_k = 0), <u_0, u_k> (K,) at the non-sink keys (-inf
    elsewhere), and (C, c_lo, c_hi, median, q05, q95): the median non-sink norm and the
    extremes, median and 5%/95% quantiles of <u_0, u_k> over the non-sink keys."""
    K, D = values.shape
    v_norm = np.empty(K)
    unit = np.zeros((K, D))
    for k in range(K):
        v_norm[k] = _norm(values[k])
        if v_norm[k] > 0:
            for d in range(D):
                unit[k, d] = values[k, d] / v_norm[k]
    sink_cos = np.full(K, -np.inf)
    n_ns = 0
    for k in range(1, K):
        if att[k]:
            sink_cos[k] = _dot(unit[0], unit[k])
            n_ns += 1
    norms = np.empty(n_ns)
    cos = np.empty(n_ns)
    j = 0
    for k in range(1, K):
        if att[k]:
            norms[j], cos[j] = v_norm[k], sink_cos[k]
            j += 1
    c_lo = cos.min() if n_ns else np.inf
    c_hi = cos.max() if n_ns else -np.inf
    stats = np.array([_quantile(norms, 0.5), c_lo, c_hi, _quantile(cos, 0.5), _quantile(cos, 0.05),
                      _quantile(cos, 0.95)])
    return v_norm, unit, sink_cos, stats


# ------------------------------------------------------------------ the query heads of a kv head
# One call per step for all the query heads reading one kv head (h of them): a call from
# Python costs microseconds per argument, which small heads (L = 512, head_dim 64) notice.


@_jit
def group_aggregates(alpha, values, att, points, draw_keys):
    """:func:`aggregates` of each query head: alpha (h, K), draw_keys (h, R, K); returns
    y (h, K, D), S (h, rows, D), s_plus (h, P, D) and the orders stacked on a first axis."""
    h, K = alpha.shape
    D, P, R = values.shape[1], points.size, draw_keys.shape[1]
    y = np.empty((h, K, D))
    S = np.empty((h, P + _sink_excluded_sizes(points, att) + R * P, D))
    s_plus = np.empty((h, P, D))
    order = np.empty((h, K), np.int64)
    rank = np.empty((h, K), np.int64)
    ns_order = np.empty((h, K), np.int64)
    draw_orders = np.empty((h, R, K), np.int64)
    for i in range(h):
        aggregates(alpha[i], values, att, points, draw_keys[i], y[i], S[i], s_plus[i],
                   (order[i], rank[i], ns_order[i], draw_orders[i]))
    return y, S, s_plus, (order, rank, ns_order, draw_orders)


@_jit
def group_exact_keys(y, S, sv, alpha, orders, points, att, options):
    """:func:`exact_keys` of each query head: X (h, rows, K), err and unsure (h, rows),
    scores (h, rows, 3), and the (head, row, key) triples to compute exactly."""
    h, rows, K = sv.shape
    X = np.empty((h, rows, K))
    err = np.empty((h, rows))
    unsure = np.empty((h, rows), np.bool_)
    scores = np.empty((h, rows, 3))
    heads, row_idx, key_idx = [], [], []
    for i in range(h):
        o = (orders[0][i], orders[1][i], orders[2][i], orders[3][i])
        r, k = exact_keys(y[i], S[i], sv[i], alpha[i], o, points, att, options, X[i], err[i], unsure[i], scores[i])
        for j in range(r.size):
            heads.append(i)
            row_idx.append(r[j])
            key_idx.append(k[j])
    return (X, err, unsure, scores, np.array(heads, np.int64), np.array(row_idx, np.int64),
            np.array(key_idx, np.int64))


@_jit
def group_geometry(values, att, points, y, S, s_plus, sv, expansions, named, orders, alpha,
                   v_norm, head_constants, mu, mu_q95, options):
    """:func:`head_geometry` of each query head: floats (h, N_FLOATS, P), counts
    (h, N_COUNTS, P); named = (heads, rows, keys, distances) the exact distances of the
    (head, row, key) triples :func:`group_exact_keys` names, in its order; mu and mu_q95 (h, P)."""
    h, P = alpha.shape[0], points.size
    floats = np.full((h, N_FLOATS, P), np.nan)
    counts = np.full((h, N_COUNTS, P), -1, np.int64)
    heads, rows, keys, distances = named
    for i in range(h):
        o = (orders[0][i], orders[1][i], orders[2][i], orders[3][i])
        lo, hi = np.searchsorted(heads, i), np.searchsorted(heads, i + 1)
        head_geometry(values, att, points, y[i], S[i], s_plus[i], sv[i],
                      (expansions[0][i], expansions[1][i], expansions[2][i], expansions[3][i]),
                      (rows[lo:hi], keys[lo:hi], distances[lo:hi]), o, alpha[i],
                      v_norm, head_constants, mu[i], mu_q95[i], options, floats[i], counts[i])
    return floats, counts


@_jit
def group_coherence(rank, row_max, top_p, top_q, bounds, edges, gram, unit, delta, points, n_att):
    """:func:`head_coherence` of each query head: rank (h, k) -> mu, mu_q95 (h, P)."""
    h, P = rank.shape[0], points.size
    mu = np.full((h, P), np.nan)
    mu_q95 = np.full((h, P), np.nan)
    exact_rows = np.full(rank.shape[1], np.nan)
    for i in range(h):
        head_coherence(rank[i], row_max, top_p, top_q, bounds, edges, gram, unit, delta,
                       exact_rows, points, n_att, mu[i], mu_q95[i])
    return mu, mu_q95
