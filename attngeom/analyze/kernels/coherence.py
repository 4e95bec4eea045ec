"""The coherence constants of a selection (docs/method.md#sink-aware-bound): mu_N, the largest
|cosine| over the non-sink pairs with a key in I_N, and mu_q95 their 95% quantile, from the kv
head's pair statistics (`pairs.pair_statistics`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attngeom.analyze.kernels._jit import jit, jit_head
from attngeom.analyze.kernels.pairs import (
    bucket_of,
    exact_row_max,
    interpolate,
    order_pair,
    pair_cos,
    pair_index,
    refined_pair,
)


class Coherence(NamedTuple):
    """mu and mu_q95 of a query head at each size (a group's: (h, P))."""

    mu: np.ndarray       # (P,)
    mu_q95: np.ndarray   # (P,)


@jit
def _exact_mu(screen, row_max, exact_rows, keys, screened):
    """max of the exact row maxima (`pairs.exact_row_max`, kept in exact_rows, NaN until
    needed) of keys; row_max are the screen's and screened their maximum over keys: a row more
    than 2 delta below it cannot hold the exact one."""
    gram, unit, delta = screen
    best = -np.inf
    for r in keys:
        if row_max[r] >= screened - 2 * delta:
            if np.isnan(exact_rows[r]):
                exact_rows[r] = exact_row_max(gram, unit, r, row_max[r], delta)
            best = max(best, exact_rows[r])
    return best


@jit
def _listed_statistics(stats, ts, members, p, first, n, pairs, screen):
    """The members ts[0] and ts[1] from the top (|cosine| descending) of the set of points[p]
    among the listed pairs, into stats; False if fewer are listed. With delta > 0 the
    buckets locate the screen's values, and the members within 2 delta of them are computed
    exactly (`pairs.pair_cos`): those above are above both; False if that band reaches below
    the listing threshold (pairs not listed)."""
    _, _, top_p, top_q, bounds, edges = pairs
    gram, unit, delta = screen
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
    b_top, b_bottom = bucket_of(band_hi, edges), bucket_of(band_lo, edges)
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
                band[j] = abs(pair_cos(unit, top_q[i], top_p[i]))
                j += 1
    band = -np.sort(-band[:j])
    stats[0], stats[1] = band[ts[0] - above], band[ts[1] - above]
    return True


@jit_head
def head_coherence(rank, pairs, screen, exact_rows, points, n_att, out):
    """mu and mu_q95 (P,) of one query head at the sizes points
    (docs/method.md#sink-aware-bound): mu_N = max |<u_p, u_q>| over the non-sink pairs with
    p in I_N, mu_q95 their 95% quantile ('linear'); NaN without such a pair, mu_q95 also where
    N >= |K|.

    rank (k,): the selection rank of each non-sink key (in the kv head's Gram order); pairs
    the kv head's `pairs.PairStatistics` from its `pairs.Screen` screen; out = `Coherence`,
    filled in place (it arrives NaN); exact_rows (k,) the exact row maxima found so far,
    shared by the kv head's query heads.
    A pair is in the set of N iff the smaller rank of its keys is < N. The quantile's order
    statistics are counted from the top of the listed pairs' buckets; a set with too few
    listed members is gathered whole.
    """
    _, row_max, top_p, top_q, bounds, edges = pairs
    gram, unit, delta = screen
    mu, mu_q95 = out
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
        mu[p] = running[s - 1] if delta == 0 else _exact_mu(screen, row_max, exact_rows,
                                                            by_rank[:s], running[s - 1])
        if n >= n_att:
            continue
        m = total - (k - s) * (k - s - 1) // 2
        pos = 0.95 * (m - 1)
        lo = int(np.floor(pos))
        hi = min(lo + 1, m - 1)
        # From the top: the lo-th smallest is member number m - 1 - lo.
        ts[0], ts[1] = m - 1 - lo, m - 1 - hi
        if not _listed_statistics(stats, ts, members, p, first, n, pairs, screen):
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
                    gathered_at[np.uint64(j_gathered)] = pair_index(a_key, b_key)
                    j_gathered += rank[b_key] > r_a
                for b_key in range(a_key + 1, k):
                    gathered[np.uint64(j_gathered)] = abs(gram[b_key, a_key])
                    gathered_at[np.uint64(j_gathered)] = pair_index(b_key, a_key)
                    j_gathered += rank[b_key] > r_a
            n_gathered = s
            if delta == 0:
                stats[0], stats[1] = order_pair(gathered[:m], lo, hi)
            else:
                _, stats[0], stats[1] = refined_pair(gathered[:m], gathered_at[:m], lo, hi, np.int64(0),
                                                      -np.inf, np.inf, unit, delta, True)
        mu_q95[p] = interpolate(stats[0], stats[1], pos, lo)


@jit
def group_coherence(rank, pairs, screen, points, n_att):
    """`head_coherence` of each query head reading one kv head: rank (h, k) -> `Coherence`
    (h, P)."""
    h, P = rank.shape[0], points.size
    out = Coherence(np.full((h, P), np.nan), np.full((h, P), np.nan))
    exact_rows = np.full(rank.shape[1], np.nan)
    for i in range(h):
        head_coherence(rank[i], pairs, screen, exact_rows, points, n_att, Coherence(out.mu[i], out.mu_q95[i]))
    return out
