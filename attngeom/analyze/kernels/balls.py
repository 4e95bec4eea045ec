"""Balls around an aggregate (docs/method.md#balls): precision and recall of a selection from
the distances D_k = ||y_k - s||^2, and the inversions A_N.

Distances are compared through their expansions ``||y_k||^2 - 2 <y_k, s> + ||s||^2``
(``<y_k, s>`` as ``alpha_k <v_k, s>``, the products of a kv head's values with every aggregate
of its query heads by one BLAS call), which are within ``e/2`` of the exact value, ``e`` a
bound per aggregate (`error_bound`); a key whose expansion lies within ``2e`` of a threshold
is evaluated exactly, from the difference (`squared_distances`), the same way every time.
Every count is therefore that of the exact distances.

An index read from data, or a count that only grows, is cast to ``np.uint64`` where the
hottest loops use it: numba wraps a signed index around (``i < 0`` reads ``i + size``), which
costs each access three instructions more, and the casts change nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attngeom.analyze.kernels._jit import jit, jit_head
from attngeom.analyze.kernels.selection import head_aggregates
from attngeom.analyze.kernels.vectors import SCAN_PER_LOG, bisect_left, dot, exact_distance, extent


class Expansions(NamedTuple):
    """The expansions of a query head's distances around each of its aggregate rows (a
    group's: one more leading axis, h)."""

    X: np.ndarray       # (rows, K) expansions, written where a row's scores are NaN
    err: np.ndarray     # (rows,) each row's error bound e
    unsure: np.ndarray  # (rows,) bool: the row is compared exactly
    scores: np.ndarray  # (rows, 3) P, R, F of the rows the expansions settle, NaN elsewhere


class ExactDistances(NamedTuple):
    """The exact distances `exact_keys` names for one query head, rows ascending."""

    rows: np.ndarray       # (n,) aggregate rows
    keys: np.ndarray       # (n,) keys
    distances: np.ndarray  # (n,) D_k of `squared_distances`


@jit
def _half_bound(yn_k, sn, e_rel, tiny):
    """How far a key's expansion can lie from its distance computed either way: half of
    `error_bound`'s e_rel (||y_k|| + ||s||)^2 + tiny, from the key's own norm (a
    row's largest ||y_k||, the sink's, would widen every key's band by (||y_0||/||s||)^2)."""
    return 0.5 * (e_rel * (yn_k + sn) ** 2 + tiny)


@jit
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


@jit
def _ordered(bits):
    """An int64 that orders as the float64 whose bits it holds (NaN aside): integer maxima
    and minima run in SIMD lanes where numba's float ones, kept to IEEE semantics, do not.
    Its own inverse."""
    return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)


@jit
def _screen(x, yn, sn, e_rel, tiny, position, n, n_cand, scores, bands):
    """Whether a row's ball scores follow from its expansions x; if so, scores (3,) <- P, R,
    F. The selection is the keys at positions 0..n-1 (position (K,), n_cand and more: not a
    candidate); bands (2, K) a scratch buffer.

    The radii lie within the limits of `_limits`. A key needs its exact distance where
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


@jit
def ball(y, s, x, yn, e_rel, tiny, unsure, order, n, n_cand, cache):
    """Ball scores of the selection order[:n] among the candidates order[:n_cand] around s
    (docs/method.md#balls): P(r_max, N), R(r_min, N), F, r_max^2, r_min^2 of the exact
    distances. x: the row's expansions, yn (K,) the keys' norms ||y_k|| (their error bounds,
    `_half_bound`); unsure: compare every key exactly.

    A radius is the distance of a key whose band (its expansion plus or minus its bound)
    reaches the extreme of the others' bands; a key whose band lies below (above) a radius
    is inside (outside) by its expansion, the rest are compared exactly. Loops run over the
    order's lists, so no branch depends on a key's membership."""
    sn = np.sqrt(dot(s, s))
    lo_max, _, _, hi_min = _limits(x, yn, sn, e_rel, tiny, order, n, n_cand)
    r_max2, r_min2 = -np.inf, np.inf
    for i in range(n):
        k = np.uint64(order[i])
        if unsure or x[k] + _half_bound(yn[k], sn, e_rel, tiny) >= lo_max:
            r_max2 = max(r_max2, exact_distance(y, k, s, cache))
    for i in range(n, n_cand):
        k = np.uint64(order[i])
        if unsure or x[k] - _half_bound(yn[k], sn, e_rel, tiny) <= hi_min:
            r_min2 = min(r_min2, exact_distance(y, k, s, cache))
    inside = closer = 0
    if unsure:
        for i in range(n_cand):
            inside += exact_distance(y, np.uint64(order[i]), s, cache) <= r_max2
        for i in range(n):
            closer += exact_distance(y, np.uint64(order[i]), s, cache) < r_min2
    else:
        for i in range(n_cand):
            k = np.uint64(order[i])
            h = _half_bound(yn[k], sn, e_rel, tiny)
            if x[k] + h < r_max2:
                inside += 1
            elif x[k] - h <= r_max2:
                inside += exact_distance(y, k, s, cache) <= r_max2
        for i in range(n):
            k = np.uint64(order[i])
            h = _half_bound(yn[k], sn, e_rel, tiny)
            if x[k] + h < r_min2:
                closer += 1
            elif x[k] - h < r_min2:
                closer += exact_distance(y, k, s, cache) < r_min2
    precision = n / inside
    recall = closer / n
    f_score = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f_score, r_max2, r_min2


@jit
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


@jit
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
    if j <= SCAN_PER_LOG * np.log2(n + 1):
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
        lo = bisect_left(xs, x[k] - width)
        hi = lo
        while hi < n and xs[hi] <= x[k] + width:
            hi += 1
        if lo != hi:
            mark[k] = True
            for i in range(lo, hi):
                mark[chosen[by_x[i]]] = True


@jit_head
def exact_keys(agg, sv, alpha, points, att, tol, out):
    """Fills out = `Expansions`: the expansions X (rows, K) of the distances of the aggregates
    agg (`selection.Aggregates`) whose products with the values are sv (rows, K) (the rows it
    leaves a score NaN, which `geometry.head_geometry` reads; the others are not written), each
    row's error bound err (rows,) and whether it is compared exactly, unsure (rows,); returns the
    (row, key) pairs whose exact distance the comparisons of `geometry.head_geometry` can need:
    the candidates for a radius
    and the keys whose band (expansion plus or minus `_half_bound`) meets the range the
    radius they are compared with can take (`ball`), and in the main rows the sink and
    every selected and unselected key (or the sink) within 3e of one of the other side
    (inversions); every candidate of a row compared exactly.

    An expansion is within its half bound (within e/2) of D_k computed either way, so the other
    comparisons come out the same whichever way D_k is rounded. A sink-excluded or random row whose scores no
    exact distance can change gets them here: scores (rows, 3) P, R, F, NaN in the other
    rows. The outputs are filled in place: a head's share of the group's arrays, not a copy.
    tol: `settings.Tolerances`."""
    y, S, _, orders = agg
    X, err, unsure, scores = out
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
        yy[k] = dot(y[k], y[k])
    y_max = np.sqrt(yy.max()) if K else 0.0
    yn = np.sqrt(yy)
    e_rel, tiny = tol.e_rel, tol.tiny
    point, kind = _row_kinds(P, Pn, R)
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
        ss = dot(S[row], S[row])
        # A row the screen settles is not kept: most random rows' expansions stay in cache.
        x = X[row] if kind[row] == 0 else scratch
        err[row], unsure[row] = _expansions(yy, sv[row], alpha, ss, y_max, tol.e_rel, tol.tiny, x)
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


@jit
def inversions(d_sel, x, order, n, n_att, width, unsure, y, s, cache):
    """A_N = #{(i, j) in I_N x U_N: D_j <= D_i} from the selected keys' exact distances d_sel
    (n,) and the unselected keys' expansions x (order[n:n_att]), within width of D_j unless
    unsure: a key above every D_i by more than width makes no inversion (the common case);
    with no D_i within width of x_j, D_i >= D_j exactly for the D_i above the band; else
    D_j is taken exactly. The few keys left are compared with every D_i, or, when many,
    looked up in them sorted."""
    d_top, finite = extent(d_sel)[1:]
    near = np.empty(n_att - n, np.int64)
    j = 0
    for i in range(n, n_att):
        near[np.uint64(j)] = order[i]
        j += unsure or not finite or not (x[np.uint64(order[i])] - width > d_top)
    inversions = 0
    if finite and j <= SCAN_PER_LOG * np.log2(n + 1):
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
            d_k = exact_distance(y, k, s, cache)
            for d in d_sel:
                inversions += not (d < d_k)
        return inversions
    d_sorted = np.sort(d_sel)
    for t in range(j):
        k = near[t]
        lo = bisect_left(d_sorted, x[k] - width)
        if not unsure and (lo == n or d_sorted[lo] > x[k] + width):
            inversions += n - lo
        else:
            inversions += n - bisect_left(d_sorted, exact_distance(y, k, s, cache))
    return inversions


@jit
def _row_kinds(P, Pn, R):
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


@jit
def group_exact_keys(agg, sv, alpha, points, att, tol):
    """`exact_keys` of each query head of a group (agg `selection.Aggregates` with a leading
    axis h, sv (h, rows, K), alpha (h, K)): the `Expansions` (h, ...) and the (head, row, key)
    triples to compute exactly, heads ascending."""
    h, rows, K = sv.shape
    out = Expansions(np.empty((h, rows, K)), np.empty((h, rows)), np.empty((h, rows), np.bool_),
                     np.empty((h, rows, 3)))
    heads, row_idx, key_idx = [], [], []
    for i in range(h):
        r, k = exact_keys(head_aggregates(agg, i), sv[i], alpha[i], points, att, tol, head_expansions(out, i))
        for j in range(r.size):
            heads.append(i)
            row_idx.append(r[j])
            key_idx.append(k[j])
    return out, np.array(heads, np.int64), np.array(row_idx, np.int64), np.array(key_idx, np.int64)


@jit
def head_expansions(group, i):
    """Query head i's `Expansions` from a group's."""
    return Expansions(group.X[i], group.err[i], group.unsure[i], group.scores[i])


def squared_distances(y: np.ndarray, s: np.ndarray) -> np.ndarray:
    """||y - s||^2 over the last axis, from the difference: the exact distance D_k of every
    comparison an expansion cannot settle. Rounding decides between keys whose distances
    agree to a few ulps (real attention rows hold many keys of nearly no weight, all at
    nearly ||s_N||^2): this is the one way they are computed, as before the compiled kernels."""
    diff = y - s
    return np.einsum("...d,...d->...", diff, diff)


def error_bound(D: int) -> float:
    """The relative error bound e_rel of a distance's expansion: D_k = ||y_k - s||^2 computed
    from the difference, or expanded as ||y_k||^2 - 2 <y_k, s> + ||s||^2 with <y_k, s> taken
    as alpha_k <v_k, s> (y_k = alpha_k v_k rounded: two roundings more than <y_k, s>), is
    within (D + 4) eps (||y_k|| + ||s||)^2 of the real value, whatever the summation order
    and fused multiply-adds; the bound used for a row of keys, e_rel (max_k ||y_k|| + ||s||)^2
    plus tiny (`settings.KernelSettings`), is twice what the two ways can differ by, so a
    comparison may widen a threshold by e instead of bounding every key's own rounding."""
    return 4 * (D + 4) * np.finfo(np.float64).eps
