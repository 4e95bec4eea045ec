"""Selections and aggregates (docs/method.md#selection): the order of a query head's keys by
attention (and of the random control's draws), and the sums s_N of their contributions
y_k = alpha_k v_k over the first N keys of each order. Aggregates add their keys one at a
time in selection order, as ``np.cumsum`` does."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attngeom.analyze.kernels._jit import jit, jit_head


class Orders(NamedTuple):
    """The three selections' key orders, each (..., K): all keys, selected first."""

    order: np.ndarray     # by descending alpha over the attendable keys, ties to the smaller position
    rank: np.ndarray      # each key's position in order
    ns_order: np.ndarray  # the same without the sink among the candidates
    draws: np.ndarray     # (..., R, K) the random control's draws


class Aggregates(NamedTuple):
    """A query head's contributions and aggregates (a group's: one more leading axis, h).

    The rows of S are the main selection's s_N at each size, then the sink-excluded
    selection's at the sizes where it is valid (`sink_excluded_sizes`), then each random
    draw's at every size."""

    y: np.ndarray       # (K, D) y_k = alpha_k v_k
    S: np.ndarray       # (rows, D) every selection's s_N
    s_plus: np.ndarray  # (P, D) the main s_N without the sink
    orders: Orders


@jit
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


@jit
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


@jit
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




@jit_head
def aggregates(alpha, values, att, points, draw_keys, out):
    """One query head's `Aggregates`, filled into out: alpha (K,), values (K, D), att (K,)
    bool, points (P,) ascending, draw_keys (R, K)."""
    y, S, s_plus, orders = out
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
    _prefix_sums(y, order, nonsink, points, s_plus, np.int64(0))
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


@jit
def group_aggregates(alpha, values, att, points, draw_keys):
    """`aggregates` of each query head reading one kv head: alpha (h, K), draw_keys (h, R, K);
    returns `Aggregates` with a leading axis h."""
    h, K = alpha.shape
    D, P, R = values.shape[1], points.size, draw_keys.shape[1]
    out = Aggregates(np.empty((h, K, D)), np.empty((h, P + sink_excluded_sizes(points, att) + R * P, D)),
                     np.empty((h, P, D)), Orders(np.empty((h, K), np.int64), np.empty((h, K), np.int64),
                                                 np.empty((h, K), np.int64), np.empty((h, R, K), np.int64)))
    for i in range(h):
        aggregates(alpha[i], values, att, points, draw_keys[i], head_aggregates(out, i))
    return out


@jit
def head_orders(orders, i):
    """Query head i's `Orders` from a group's."""
    return Orders(orders.order[i], orders.rank[i], orders.ns_order[i], orders.draws[i])


@jit
def head_aggregates(group, i):
    """Query head i's `Aggregates` from a group's."""
    return Aggregates(group.y[i], group.S[i], group.s_plus[i], head_orders(group.orders, i))


@jit
def sink_excluded_sizes(points, att):
    """Pn: how many of points the sink-excluded selection has (N below the number of
    non-sink keys; none without a sink)."""
    if not att[0]:
        return 0
    n_ns = 0
    for k in range(1, att.size):
        n_ns += att[k]
    return np.sum(points < n_ns)


@jit
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
