"""Numeric kernels of the analyze stage: top-N geometry at the final query (docs/method.md).

One instance is one (sequence, layer, head) at the final query ``q = L-1``. The public
functions take a batch on a leading axis:

- ``attn`` (B, K): the final query's attention row ``alpha_k`` over key positions 0..K-1, one
  row per query head;
- ``values`` (G, K, D): the value vectors ``v_k`` of each kv head; query head ``b`` reads kv head
  ``head_kv[b]`` (grouped-query attention; by default ``head_kv[b] = b``);
- ``attendable`` (G, K) bool: the keys ``K_b`` the final query may attend to, per kv head (the
  query heads that share a kv head share the final query's mask). Keys outside it
  (sliding-window layers) take no part at all. Position 0 is the sink; an instance whose
  position 0 is not attendable has no sink: all of its keys are non-sink and the sink terms vanish.

Whatever depends only on the values (norms, unit vectors, their Gram matrix, the coherence
constants' raw material) is computed once per kv head and shared by the query heads reading it.

Arithmetic is float64 throughout. A value vector of norm 0 has no direction: its unit vector is
taken as 0 (cosine 0 with everything) in the coherence statistics, which keeps the exact
certificate valid because such a key has ``beta = 0`` there; a cosine reported as an output is
NaN whenever one of its vectors is 0.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from attngeom.store.schema import TOPN_COUNTS, TOPN_FLOATS, VALUE_STATISTICS

# Float64 elements of one B x K x D slice of per-N work; larger batches are processed in slices
# of at most this size, so peak memory stays a few hundred MiB whatever the batch.
_SLICE_BUDGET = 1 << 22

# Float64 elements gathered at once for the selected keys of a run of N (`_point_runs`).
_GATHER_BUDGET = 1 << 17

# Share of a kv head's non-sink pairs kept, largest |cosine| first, as the candidates of the
# 95% coherence quantile mu_q95 (which sits in the top 5% of its pairs). Any (head, N) whose
# quantile falls outside them is computed from all of its pairs: the share trades speed only.
_TOP_PAIR_SHARE = 0.08
# Below this many pairs every pair is a candidate.
_TOP_PAIR_MIN = 4096

# Quantiles of longer arrays are taken within a bracket from a sample (`_order_statistics`).
_BRACKET_MIN = 1 << 16

# Fractional part of the golden ratio: sample positions j * _GOLDEN mod 1 cover [0, 1) evenly.
_GOLDEN = 0.6180339887498949

# An absolute floor under `_Distances`' error bound, far above subnormal rounding.
_TINY = 1e-290

# Relative margin of the "L <= 0" test of the sink-aware bounds, see `_k_sink`.
_L_RTOL = 1e-10

__all__ = ["TOPN_COUNTS", "TOPN_FLOATS", "VALUE_STATISTICS", "head_metrics", "topn_metrics",
           "value_statistics"]


def topn_metrics(
    attn: np.ndarray,
    values: np.ndarray,
    attendable: np.ndarray,
    n_grid: Sequence[int],
    *,
    head_kv: np.ndarray | None = None,
    seed: int = 0,
    random_draws: int = 8,
) -> dict[str, np.ndarray]:
    """Top-N separability, bounds and diagnostics at the final query (docs/method.md).

    attn (B, K), values (G, K, D), attendable (G, K) bool, head_kv (B,) ints in [0, G)
    (default: G = B, instance b reads values[b]); n_grid: selection sizes N >= 1.
    Returns arrays of shape (B, len(n_grid)). N is valid for an instance iff N < |K_b|
    (``nosink_*``: N < |K_b \\ {0}|); invalid entries are NaN, or -1 for the int64 counts
    and the int8 ``sink_selected``.

    Selection ``I_N``: the N attendable keys of largest alpha, ties to the smaller position;
    ``U_N = K \\ I_N``, ``s_N = sum_{I_N} y_i`` with ``y_k = alpha_k v_k``,
    ``D_k = ||y_k - s_N||^2``.

    - ``precision`` = N / |{k: D_k <= r_max^2}|, ``recall`` = |{i in I_N: D_i < r_min^2}| / N,
      ``f_score`` = 2PR/(P+R); ``inversions`` A_N = #{(i, j) in I_N x U_N: D_j <= D_i}.
    - ``sink_selected``: 0 in I_N.
    - ``k_sink``, ``precision_bound`` = 1/(1 + k/N), ``recall_bound`` = max(0, 1 - k/N): the
      appendix bound with beta_i = alpha_i (i > 0), beta_0 = alpha_0 ||v_0||/C, worst-case
      ``mu`` and nu; ``*_q95`` the same with ``mu_q95`` and the 5%/95% sink-cosine quantiles.
      Undefined (-1/NaN) for an instance with a sink and C = 0.
      ``mu``/``mu_q95`` range over the unordered non-sink pairs with at least one key in I_N.
    - ``k_sink_exact``: the same algebra with beta_i = alpha_i ||v_i|| / C for every key and
      signed sink constants; ``inversions <= k_sink_exact`` on every instance.
    - ``random_*``: P, R, F of uniformly random size-N subsets of K, mean over the draws; draw d
      selects the N attendable keys of smallest
      ``np.random.default_rng(seed).random((random_draws, B, K))[d]``.
    - ``nosink_*``: P, R, F with the sink removed from the candidate keys before selection.
    - sink diagnostics (NaN without a sink): ``sink_norm_share`` ||y_0||/||s_N|| and
      ``sink_direction_change`` 1 - cos(s_N, s_N - y_0) when 0 in I_N; ``sink_intrusion``
      1{D_0 <= r_max^2} and ``sink_pair_inversion_frac`` mean_{I_N} 1{D_0 <= D_i} when not;
      ``sink_alignment`` cos(y_0, s_{N,+}), s_{N,+} the selected non-sink part of s_N.
    - leave-one-out (s_{N,-i} = s_N - y_i): ``loo_cos`` mean_{I_N} cos(y_i, s_{N,-i}),
      ``loo_margin`` loo_cos - mean_{U_N} cos(y_j, s_N), ``loo_positive_frac`` the fraction of
      those cosines > 0, ``loo_distance_margin``
      min_{U_N} ||y_j - s_N|| - max_{I_N} ||y_i - s_{N,-i}||.
      Means and fractions run over the defined cosines (NaN if none, e.g. N = 1).
    - mechanistic signatures, o = sum_K y_k: ``s_norm`` ||s_N||/||o||, ``s_norm_nosink`` and
      ``s_norm_nocurrent`` the same without y_0 / y_{K-1} when selected, ``cos_s_v0``
      cos(s_N, v_0), ``cos_s_vlast`` cos(s_N, v_{K-1}).
    """
    return _metrics(attn, values, attendable, n_grid, head_kv, seed, random_draws, False)[0]


def value_statistics(values: np.ndarray, attendable: np.ndarray) -> dict[str, np.ndarray]:
    """Norm and coherence statistics of each kv head (docs/method.md#norms-and-coherence).

    values (G, K, D), attendable (G, K) bool; returns arrays of shape (G,), over the attendable
    non-sink keys k (cosines of unit vectors u_k = v_k/||v_k||):

    - ``C``: median ||v_k||; ``norm_cv``: std/mean of ||v_k|| (population std);
    - ``median_cos``: median <u_p, u_q> over pairs p != q;
    - sink (NaN without one): ``sink_norm_ratio`` lambda = ||v_0||/C, ``sink_cos_median`` and
      ``sink_cos_neg_frac`` (fraction < 0) of <u_0, u_k>, ``nu_minus_q95`` = max(0, -q95) and
      ``nu_plus_q95`` = max(0, -q05) of <u_0, u_k>.

    They depend on the values only: a query head takes those of the kv head it reads.
    """
    _, values, attendable, _ = _check_batch(None, values, attendable, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        kv = _kv_heads(values, attendable)
        median_cos = np.array([_median_cos(_nonsink_gram(kv, g)) for g in range(values.shape[0])])
        return _value_statistics(kv, median_cos)


def head_metrics(
    attn: np.ndarray,
    values: np.ndarray,
    attendable: np.ndarray,
    n_grid: Sequence[int],
    *,
    head_kv: np.ndarray | None = None,
    seed: int = 0,
    random_draws: int = 8,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(topn_metrics(attn, values, attendable, n_grid, ...), value_statistics(values,
    attendable))``, equal to the two calls, from one pass over each kv head's values: their
    norms, unit vectors and Gram matrix serve both. Shapes as in the two functions."""
    return _metrics(attn, values, attendable, n_grid, head_kv, seed, random_draws, True)


def _metrics(attn, values, attendable, n_grid, head_kv, seed, random_draws, with_values):
    """topn_metrics' outputs, and value_statistics' (None unless with_values)."""
    alpha, values, attendable, head_kv = _check_batch(attn, values, attendable, head_kv)
    grid = np.asarray(n_grid, dtype=np.int64).reshape(-1)
    if np.any(grid < 1):
        raise ValueError(f"n_grid must hold sizes N >= 1, got {grid.tolist()}")
    if random_draws < 0:
        raise ValueError(f"random_draws must be >= 0, got {random_draws}")
    B, K = alpha.shape
    # Drawn for the whole batch up front, so the draws do not depend on the slicing below.
    draw_keys = np.random.default_rng(seed).random((random_draws, B, K))

    shape = (B, grid.size)
    out = {name: np.full(shape, np.nan) for name in TOPN_FLOATS}
    out.update({name: np.full(shape, -1, dtype=np.int64) for name in TOPN_COUNTS})
    out["sink_selected"] = np.full(shape, -1, dtype=np.int8)
    # Degenerate instances (zero vectors, zero norms) give NaN by design, not warnings.
    with np.errstate(divide="ignore", invalid="ignore"):
        att = attendable[head_kv]
        order, rank = _ranked(-alpha, att)
        kv = _kv_heads(values, attendable)
        median_cos = np.full(values.shape[0], np.nan) if with_values else None
        mu, mu_q95 = _coherence(kv, head_kv, rank, att.sum(axis=1), grid, median_cos)
        for part in _batch_slices(B, K * values.shape[2]):
            _topn_slice(
                alpha[part], values[head_kv[part]], att[part], order[part], rank[part],
                _Constants.gather(kv, head_kv[part], mu[part], mu_q95[part]),
                grid, draw_keys[:, part], {name: array[part] for name, array in out.items()},
            )
        stats = _value_statistics(kv, median_cos) if with_values else None
    return out, stats


def _value_statistics(kv, median_cos):
    """value_statistics' outputs from the kv heads and their median cosines (G,)."""
    out = {name: np.full(kv.C.shape, np.nan) for name in VALUE_STATISTICS}
    n_ns = kv.nonsink.sum(axis=1)
    mean = np.sum(kv.v_norm, axis=1, where=kv.nonsink) / n_ns
    var = np.sum((kv.v_norm - mean[:, None]) ** 2, axis=1, where=kv.nonsink) / n_ns
    out["median_cos"][...] = median_cos
    out["C"][...] = kv.C
    out["norm_cv"][...] = np.sqrt(var) / mean
    sink = kv.has_sink & (n_ns > 0)
    for name, x in dict(
        sink_norm_ratio=kv.v_norm[:, 0] / kv.C,
        sink_cos_median=kv.sink_cos_median,
        sink_cos_neg_frac=np.sum(kv.sink_cos < 0, axis=1, where=kv.nonsink) / n_ns,
        nu_minus_q95=np.maximum(0.0, -kv.q95),
        nu_plus_q95=np.maximum(0.0, -kv.q05),
    ).items():
        out[name][...] = np.where(sink, x, np.nan)
    return out


def _median_cos(gram):
    """Median of the off-diagonal entries of the (k, k) Gram matrix (its diagonal is
    overwritten).

    The median of the m unordered pairs is that of the 2m ordered ones (the two middle ranks
    of 2m fall on the middle ones of m), so the whole matrix is searched, its diagonal pushed
    above every cosine, without gathering a triangle."""
    k = gram.shape[0]
    np.fill_diagonal(gram, np.inf)
    return _quantile(gram.ravel(), 0.5, size=k * (k - 1))


class _KvHeads(NamedTuple):
    """What depends on a kv head's values and mask only: (G, ...) arrays."""

    v_norm: np.ndarray      # (G, K) ||v_k||
    unit: np.ndarray        # (G, K, D) u_k, 0 for v_k = 0
    nonsink: np.ndarray     # (G, K) attendable non-sink keys
    has_sink: np.ndarray    # (G,)
    C: np.ndarray           # (G,) median non-sink norm
    sink_cos: np.ndarray    # (G, K) <u_0, u_k> at non-sink k, -inf elsewhere
    c_lo: np.ndarray        # (G,) min_k <u_0, u_k> (inf without non-sink keys)
    c_hi: np.ndarray        # (G,) max_k <u_0, u_k>
    sink_cos_median: np.ndarray  # (G,) median of <u_0, u_k>
    q05: np.ndarray         # (G,) 5% quantile of <u_0, u_k>
    q95: np.ndarray         # (G,) 95% quantile


def _kv_heads(values, attendable):
    nonsink = attendable.copy()
    nonsink[:, 0] = False
    v_norm = np.linalg.norm(values, axis=-1)
    unit = _unit(values, v_norm)
    sink_cos = np.where(nonsink, np.einsum("gd,gkd->gk", unit[:, 0], unit), -np.inf)

    def quantiles(x, q):
        return np.array([_quantile(row[keep], q) for row, keep in zip(x, nonsink)])

    return _KvHeads(
        v_norm=v_norm, unit=unit, nonsink=nonsink, has_sink=attendable[:, 0],
        C=quantiles(v_norm, 0.5),
        sink_cos=sink_cos,
        c_lo=np.min(sink_cos, axis=1, where=nonsink, initial=np.inf),
        c_hi=np.max(sink_cos, axis=1, initial=-np.inf),
        sink_cos_median=quantiles(sink_cos, 0.5),
        q05=quantiles(sink_cos, 0.05),
        q95=quantiles(sink_cos, 0.95),
    )


def _nonsink_gram(kv, g):
    """(k, k) <u_p, u_q> of kv head g over its k non-sink keys, in position order."""
    unit = kv.unit[g][kv.nonsink[g]]
    return unit @ unit.T


def _coherence(kv, head_kv, rank, n_att, grid, median_cos=None):
    """mu and mu_q95 (B, len(grid)) of docs/method.md#sink-aware-bound: mu_N = max |<u_p, u_q>| over the unordered
    non-sink pairs p != q with p in I_N (q anywhere in K), mu_q95 the 95% quantile ('linear')
    of the same |<u_p, u_q>|; NaN without such a pair or where N >= |K|.

    One Gram matrix per kv head serves its query heads. mu_N is a running maximum of the
    keys' row maxima in selection order. The quantile needs the pairs' order statistics just
    below the top 5% of each pair set; they are read off one sorted list of each kv head's
    largest pairs (`_TopPairs`). Given median_cos (G,), each kv head's median cosine
    (`_median_cos`) is written there from the same Gram matrix.
    """
    B, n_grid = rank.shape[0], grid.size
    mu = np.full((B, n_grid), np.nan)
    mu_q95 = np.full((B, n_grid), np.nan)
    for g in range(kv.C.size) if median_cos is not None else np.unique(head_kv):
        heads = np.flatnonzero(head_kv == g)
        gram = _nonsink_gram(kv, g)
        if median_cos is not None:
            median_cos[g] = _median_cos(gram)
        k = gram.shape[0]
        if k < 2 or not heads.size:
            continue
        gram = np.abs(gram, out=gram)
        np.fill_diagonal(gram, -np.inf)
        row_max = gram.max(axis=1)
        top = _TopPairs.of(gram)
        ranks = rank[heads][:, kv.nonsink[g]]  # (h, k) selection rank of each non-sink key
        for h, r in zip(heads, ranks):
            by_rank = np.argsort(r)
            selected = np.searchsorted(r[by_rank], grid)  # non-sink keys in I_N, per N
            running = np.maximum.accumulate(row_max[by_rank])
            mu[h] = np.where(selected > 0, running[np.maximum(selected - 1, 0)], np.nan)
            first = np.minimum(r[top.p], r[top.q])  # a pair is in the set of N iff first < N
            for i, (n, s) in enumerate(zip(grid, selected)):
                if s > 0 and n < n_att[h]:
                    mu_q95[h, i] = top.quantile(first, n, k * (k - 1) // 2 - (k - s) * (k - s - 1) // 2,
                                                0.95, gram, r)
    return mu, mu_q95


class _TopPairs(NamedTuple):
    """A kv head's non-sink pairs p < q with |<u_p, u_q>| at or above a threshold, sorted
    descending: every pair off the list is below every pair on it."""

    p: np.ndarray
    q: np.ndarray
    cos: np.ndarray
    total: int              # pairs of the kv head, listed or not

    @classmethod
    def of(cls, gram):
        k = gram.shape[0]
        total = k * (k - 1) // 2
        threshold = -np.inf
        if total > _TOP_PAIR_MIN:
            # Any threshold is exact (see `quantile`); one from a 1/16 sample of the pairs
            # keeps about _TOP_PAIR_SHARE of them.
            sample = gram[::4, ::4]
            sample = sample[np.triu(np.ones(sample.shape, dtype=bool), 1)]
            kth = int((1 - _TOP_PAIR_SHARE) * (sample.size - 1))
            threshold = np.partition(sample, kth)[kth]
        flat = np.flatnonzero(gram >= threshold)
        p, q = np.divmod(flat, k)
        upper = p < q
        p, q = p[upper], q[upper]
        cos = gram.ravel()[flat[upper]]
        by_cos = np.argsort(-cos)  # equal cosines are interchangeable
        return cls(p[by_cos], q[by_cos], cos[by_cos], total)

    def quantile(self, first, n, m, q, gram, rank):
        """q-quantile ('linear', as numpy) of the m pairs whose first rank (the smaller
        selection rank of the two keys) is < n: `first` (listed pairs) and `rank` (keys).

        The set's order statistics counted from the top are those of its listed members
        while they last; past them, of all its pairs.
        """
        pos = q * (m - 1)
        lo = int(np.floor(pos))
        hi = min(lo + 1, m - 1)
        need = m - lo  # the set's largest `need` pairs
        # Members are spread over the list about as the set is over all pairs: first scan a
        # prefix of twice the length that should hold `need` of them.
        prefix = min(first.size, 2 * need * self.total // m + 64)
        listed = np.flatnonzero(first[:prefix] < n)
        if listed.size < need and prefix < first.size:
            listed = np.flatnonzero(first < n)
        if listed.size >= need:
            below, above = self.cos[listed[m - 1 - lo]], self.cos[listed[m - 1 - hi]]
        else:
            # Each pair once, from its key of smaller rank.
            rows = np.flatnonzero(rank < n)
            in_set = rank[None, :] > rank[rows, None]
            part = np.partition(gram[rows].ravel()[np.flatnonzero(in_set)], (lo, hi))
            below, above = part[lo], part[hi]
        return below + (pos - lo) * (above - below)


class _Constants(NamedTuple):
    """The sink-aware bounds' constants per query head of a slice (docs/method.md#sink-aware-bound)."""

    v_norm: np.ndarray      # (B, K)
    nonsink: np.ndarray     # (B, K)
    has_sink: np.ndarray    # (B,)
    C: np.ndarray           # (B,)
    c_lo: np.ndarray
    c_hi: np.ndarray
    q05: np.ndarray
    q95: np.ndarray
    mu: np.ndarray          # (B, len(grid))
    mu_q95: np.ndarray      # (B, len(grid))

    @classmethod
    def gather(cls, kv, head_kv, mu, mu_q95):
        return cls(kv.v_norm[head_kv], kv.nonsink[head_kv], kv.has_sink[head_kv], kv.C[head_kv],
                   kv.c_lo[head_kv], kv.c_hi[head_kv], kv.q05[head_kv], kv.q95[head_kv],
                   mu, mu_q95)


class _Instances(NamedTuple):
    """Per-instance quantities that do not depend on N, for a slice of the batch."""

    values: np.ndarray      # (B, K, D) v_k
    y: np.ndarray           # (B, K, D) y_k = alpha_k v_k
    y_norm: np.ndarray      # (B, K)
    att: np.ndarray         # (B, K) K_b
    has_sink: np.ndarray    # (B,)
    o_norm: np.ndarray      # (B,) ||o||, o = sum_K y_k, the head's output
    rank: np.ndarray        # (B, K) rank of each key in the top-N selection order
    points: np.ndarray      # (P,) the valid N, ascending
    s_plus_by_n: np.ndarray # (B, P, D) s_{N,+} at each of points
    s_by_n: np.ndarray      # (B, P, D) s_N at each of points
    ys: np.ndarray          # (B, P, K) <y_k, s_N> at each of points
    around: _Around         # distances of y to s_N, the N of points as its rows (P, B, K)
    scores: _BallScores     # (P, B) each, of I_N at each of points


class _TopN(NamedTuple):
    """The selection I_N of every instance of a slice and its geometry."""

    n: int
    p: int                  # index of N in points
    selected: np.ndarray    # (B, K) I_N
    unselected: np.ndarray  # (B, K) U_N
    sigma: np.ndarray       # (B,) 0 in I_N
    D: np.ndarray           # (B, K) ||y_k - s_N||^2 where selected or the sink, elsewhere
                            # a stand-in ordered as D against the other side (`_Around.ordered`)
    scores: tuple           # P(r_max, N), R(r_min, N), F, each (B,)
    r_max2: np.ndarray      # (B,)
    r_min2: np.ndarray      # (B,)


def _topn_slice(alpha, values, att, order, rank, constants, grid, draw_keys, out):
    nonsink = constants.nonsink
    n_att = att.sum(axis=1)
    # Aggregates are needed at the valid N only (typically up to K/2 of K keys).
    points = np.unique(grid[grid < max(n_att.max(initial=0), 2)])
    y = alpha[:, :, None] * values
    # s_N is kept as its non-sink part plus the sink, so that s_{N,+} and s_N - y_0 carry
    # no cancellation error when the sink dominates the aggregate.
    s_plus_by_n = _prefix_sums(np.where(nonsink[:, :, None], y, 0.0), order, points)
    sink_in = (rank[:, :1] < points) & att[:, :1]  # (B, P): 0 in I_N
    s_by_n = s_plus_by_n + np.where(sink_in[:, :, None], y[:, :1], 0.0)
    distances, around, selected, scores = _at_every_point(y, s_by_n, rank, att, points)
    inst = _Instances(
        values=values, y=y, y_norm=np.linalg.norm(y, axis=-1), att=att,
        has_sink=constants.has_sink,
        o_norm=np.linalg.norm(np.sum(y, axis=1, where=att[:, :, None]), axis=-1),
        rank=rank, points=points, s_plus_by_n=s_plus_by_n, s_by_n=s_by_n,
        ys=distances.ys[:, :, 0], around=around, scores=scores,
    )
    bounds = _SinkBounds(alpha, constants)
    # D exact where a value is reported or compared with the sink's: at every selected key and
    # the sink, for every N (`_select` orders the other keys).
    runs = _point_runs(points, y.shape[0] * y.shape[2])
    sink = np.zeros_like(att)
    sink[:, 0] = att[:, 0]
    for run in runs:
        around.part(run).D(selected[run] | sink)
    by_point = {**_sink_shares(inst), **_signatures(inst), **_leave_one_out(inst, selected, runs)}

    for g, n in enumerate(grid):
        valid = n < n_att
        if not valid.any():
            continue
        top = _select(inst, n)
        precision, recall, f_score = top.scores
        results = dict(
            precision=precision, recall=recall, f_score=f_score,
            inversions=_count_pairs_le(top.D, top.unselected, top.D, top.selected),
            sink_selected=top.sigma,
        )
        results.update({name: x[:, top.p] for name, x in by_point.items()})
        results.update(_sink_intrusion(inst, top))
        certificate, paper = bounds.at(top, g)
        results.update(certificate)
        _store(out, g, results, valid)
        _store(out, g, paper, valid & bounds.paper_defined)

    _random_control(y, att, n_att, grid, points, draw_keys, out)
    _sink_excluded(alpha, y, att, nonsink, grid, points, out)


def _at_every_point(y, s_by_n, rank, candidates, points):
    """The distances of y (B, K, D) to the aggregates s_by_n (B, P, D) of one selection
    (keys of rank < N among the candidates) at each N of points, and the ball scores there:
    every N is a row of one batch (P, B, K), each row's arithmetic that of its N alone."""
    distances = _Distances(y, s_by_n.transpose(1, 0, 2)[:, :, None])
    around = distances.at(0)
    selected = (rank < points[:, None, None]) & candidates
    return distances, around, selected, around.ball_scores(selected, candidates, points[:, None])


def _select(inst, n):
    selected = (inst.rank < n) & inst.att
    unselected = inst.att & ~selected
    p = np.searchsorted(inst.points, n)
    around = inst.around.part(slice(p, p + 1))
    *scores, r_max2, r_min2 = (x[p] for x in inst.scores)
    # Exact where selected or the sink (computed for every N up front); stand-ins that order
    # the selected and unselected keys exactly elsewhere.
    D = around.ordered(selected[None], unselected[None])[0]
    return _TopN(n=n, p=p, selected=selected, unselected=unselected, sigma=selected[:, 0],
                 D=D, scores=tuple(scores), r_max2=r_max2, r_min2=r_min2)


class _SinkBounds:
    """The sink-aware bounds of one slice (docs/method.md#sink-aware-bound): effective weights and sink constants,
    and their counts at each N of the grid."""

    def __init__(self, alpha, constants):
        self.constants = constants
        has_sink, C, v_norm = constants.has_sink, constants.C, constants.v_norm

        # Without a sink the nu's multiply only zero terms; 0 keeps NaN out of that arithmetic.
        def sink_constant(x):
            return np.where(has_sink, x, 0.0)

        c_lo, c_hi = constants.c_lo, constants.c_hi
        self.nu_paper = (sink_constant(np.maximum(0.0, -c_lo)),
                         sink_constant(np.maximum(0.0, -c_hi)))
        self.nu_q95 = (sink_constant(np.maximum(0.0, -constants.q05)),
                       sink_constant(np.maximum(0.0, -constants.q95)))
        self.nu_exact = (sink_constant(-c_lo), sink_constant(-c_hi))
        # lambda = ||v_0||/C needs C > 0: with a sink and C = 0 the paper variant is undefined.
        self.paper_defined = ~has_sink | (C > 0)
        self.beta_paper = alpha.copy()
        self.beta_paper[:, 0] = np.where(has_sink & self.paper_defined,
                                         alpha[:, 0] * v_norm[:, 0] / C, 0.0)
        # The certificate's beta_i = alpha_i ||v_i|| / C; C > 0 only rescales every L by C^2
        # and the tolerance is relative, so it is left out (and C = 0 cannot poison it).
        self.beta_exact = alpha * v_norm

    def at(self, top, g):
        """Outputs at selection top (grid index g): those defined everywhere (mu's and the
        certificate), and the paper variant's, defined where paper_defined."""
        n = top.n
        mu, mu_q95 = self.constants.mu[:, g], self.constants.mu_q95[:, g]
        # The three variants as one batch of 3B rows: paper, robust (q95), exact.
        masks = (top.selected, top.unselected, self.constants.nonsink, self.constants.has_sink)
        counts = _k_sink(
            np.concatenate([self.beta_paper, self.beta_paper, self.beta_exact]),
            *(np.concatenate([m] * 3) for m in masks),
            np.nan_to_num(np.concatenate([mu, mu_q95, mu])),
            *(np.concatenate(nus) for nus in zip(self.nu_paper, self.nu_q95, self.nu_exact)),
        )
        k_sink, k_sink_q95, k_sink_exact = np.split(counts, 3)
        paper = dict(
            k_sink=k_sink, k_sink_q95=k_sink_q95,
            precision_bound=1.0 / (1.0 + k_sink / n),
            recall_bound=np.maximum(0.0, 1.0 - k_sink / n),
            precision_bound_q95=1.0 / (1.0 + k_sink_q95 / n),
            recall_bound_q95=np.maximum(0.0, 1.0 - k_sink_q95 / n),
        )
        return dict(mu=mu, mu_q95=mu_q95, k_sink_exact=k_sink_exact), paper


def _sink_shares(inst):
    """Appendix "Additional attention sink diagnostics" that depend on N through s_N only,
    at each N of points (B, P); NaN where they do not apply."""
    sigma = (inst.rank[:, :1] < inst.points) & inst.att[:, :1]  # 0 in I_N
    s, s_plus = inst.s_by_n, inst.s_plus_by_n
    return dict(
        sink_norm_share=np.where(sigma, inst.y_norm[:, :1] / np.linalg.norm(s, axis=-1), np.nan),
        sink_direction_change=np.where(sigma, 1.0 - _cos(s, s_plus), np.nan),
        sink_alignment=np.where(inst.has_sink[:, None], _cos(inst.y[:, None, 0], s_plus), np.nan),
    )


def _sink_intrusion(inst, top):
    """The sink diagnostics of an unselected sink, which compare D_0 with I_N's distances."""
    sink_out = inst.has_sink & ~top.sigma
    sink_beats = np.sum(top.selected & (top.D[:, :1] <= top.D), axis=1) / top.n
    return dict(
        sink_intrusion=np.where(sink_out, top.D[:, 0] <= top.r_max2, np.nan),
        sink_pair_inversion_frac=np.where(sink_out, sink_beats, np.nan),
    )


def _point_runs(points, per_key):
    """Slices of points in runs of at most _GATHER_BUDGET elements sum N x per_key (at least
    one N a run): the work gathering (sum N, D) arrays of the selected keys goes a run at a
    time, small enough for its temporaries to be reused instead of paged in afresh."""
    runs, total, first = [], 0, 0
    for i, n in enumerate(points):
        if total and total + n * per_key > _GATHER_BUDGET:
            runs.append(slice(first, i))
            first, total = i, 0
        total += n * per_key
    return runs + [slice(first, len(points))]


def _leave_one_out(inst, selected, runs):
    """Appendix "Leave-one-out control": C_N^loo, M_N^loo, positive fraction, gamma_N^loo, at
    each N of points (B, P), one run of points (`_point_runs`) at a time; selected
    (P, B, K): I_N there, where D is exact."""
    parts = [_leave_one_out_run(inst, selected, run) for run in runs]
    return {name: np.concatenate([part[name] for part in parts], axis=1) for name in parts[0]}


def _leave_one_out_run(inst, selected, run):
    s = inst.s_by_n[:, run]
    s_norm = np.linalg.norm(s, axis=-1).T
    selected = selected[run]
    exact = inst.around.exact[run]
    p, b, k = np.nonzero(selected)
    y_i = inst.y[b, k]
    diff_i = y_i - s[b, p]
    # cos(y_i, s_{N,-i}) from <y_i, y_i - s_N> and D_i = ||y_i - s_N||^2, both computed from
    # the difference itself rather than expanded (no cancellation when y_i ~ s_N).
    loo_cos_i = np.full(selected.shape, np.nan)
    loo_cos_i[p, b, k] = (-np.einsum("md,md->m", y_i, diff_i)
                          / (inst.y_norm[b, k] * np.sqrt(exact[p, b, k])))
    loo_spread = np.full(selected.shape, -np.inf)  # ||y_i - s_{N,-i}|| = ||2 y_i - s_N||
    loo_spread[p, b, k] = np.linalg.norm(y_i + diff_i, axis=-1)
    cos_js = inst.ys[:, run].transpose(1, 0, 2) / (inst.y_norm * s_norm[..., None])
    loo_defined = selected & np.isfinite(loo_cos_i)
    loo_cos = _masked_mean(loo_cos_i, loo_defined)
    unselected = inst.att & ~selected
    r_min2 = inst.scores.r_min2[run]
    return dict(
        loo_cos=loo_cos.T,
        loo_margin=(loo_cos - _masked_mean(cos_js, unselected & np.isfinite(cos_js))).T,
        loo_positive_frac=_masked_mean(loo_cos_i > 0, loo_defined).T,
        loo_distance_margin=(np.sqrt(r_min2) - _masked_max(loo_spread, selected)).T,
    )


def _signatures(inst):
    """Mechanistic signatures (docs/method.md#mechanistic-signatures) at each N of points
    (B, P); the current token is K-1."""
    s = inst.s_by_n
    last_in = (inst.rank[:, -1:] < inst.points) & inst.att[:, -1:]  # K-1 in I_N
    current = np.where(last_in[..., None], inst.y[:, None, -1], 0.0)
    o_norm = inst.o_norm[:, None]
    return dict(
        s_norm=np.linalg.norm(s, axis=-1) / o_norm,
        s_norm_nosink=np.linalg.norm(inst.s_plus_by_n, axis=-1) / o_norm,
        s_norm_nocurrent=np.linalg.norm(s - current, axis=-1) / o_norm,
        cos_s_v0=np.where(inst.has_sink[:, None], _cos(s, inst.values[:, None, 0]), np.nan),
        cos_s_vlast=_cos(s, inst.values[:, None, -1]),
    )


def _random_control(y, att, n_att, grid, points, draw_keys, out):
    """random_precision/recall/f_score: P, R, F of random size-N subsets, mean over draws."""
    if not len(draw_keys):
        return
    # One random ranking per draw: its first N keys are a uniform size-N subset for every
    # N at once (nested across N within a draw, independent across draws).
    R, B, K = draw_keys.shape
    order, rank = _ranked(draw_keys.reshape(R * B, K), np.tile(att, (R, 1)))
    order, rank = order.reshape(R, B, K), rank.reshape(R, B, K)
    at = _Distances(y, np.stack([_prefix_sums(y, o, points) for o in order]))
    names = ("random_precision", "random_recall", "random_f_score")
    for g, n in enumerate(grid):
        valid = n < n_att
        if not valid.any():
            continue
        scores = at.at(np.searchsorted(points, n)).ball_scores((rank < n) & att, att, n)[:3]
        _store(out, g, dict(zip(names, (np.sum(x, axis=0) / len(draw_keys) for x in scores))),
               valid)


def _sink_excluded(alpha, y, att, nonsink, grid, points, out):
    """nosink_precision/recall/f_score: selection and balls over K \\ {0}. An instance without
    a sink has K \\ {0} = K: its scores are the main selection's (already in out)."""
    names = ("precision", "recall", "f_score")
    has_sink = att[:, 0]
    for name in names:
        out[f"nosink_{name}"][~has_sink] = out[name][~has_sink]
    if not has_sink.any():
        return
    rows = slice(None) if has_sink.all() else np.flatnonzero(has_sink)
    nonsink = nonsink[rows]
    n_ns = nonsink.sum(axis=1)
    order, rank = _ranked(-alpha[rows], nonsink)
    scores = _at_every_point(y[rows], _prefix_sums(y[rows], order, points), rank, nonsink, points)[3][:3]
    sub = {f"nosink_{name}": out[f"nosink_{name}"][rows] for name in names}
    for g, n in enumerate(grid):
        valid = n < n_ns
        if valid.any():
            p = np.searchsorted(points, n)
            _store(sub, g, dict(zip(sub, (x[p] for x in scores))), valid)
    for name, x in sub.items():
        out[name][rows] = x


class _Distances:
    """Distances D_k = ||y_k - s||^2 of the contributions y (B, K, D) to aggregates s
    (R, B, P, D): R selections (draws) at P sizes N. `at(p)` gives those at one N.

    D_k is evaluated exactly (as ``||y_k - s||^2`` from the difference, the same way for every
    key) only where the cheap expansion ||y_k||^2 - 2 <y_k, s> + ||s||^2 cannot settle a
    comparison. Both ways are within (D + 4) eps (||y_k|| + ||s||)^2 of the real value (any
    summation order, any fused multiply-add). The bound used is one per row, 4 (D + 4) eps
    (max_k ||y_k|| + ||s||)^2 plus an absolute floor for subnormal rounding: twice what the two
    ways can differ by, so that comparisons may shift a row's threshold instead of every key's
    expansion (a rounding of a few eps of the same scale). A row with a non-finite bound or
    expansion has every key evaluated exactly.
    """

    def __init__(self, y, s):
        R, B, P, D = s.shape
        self.y, self.s = y, s
        self.yy = np.einsum("bkd,bkd->bk", y, y)
        self.y_max = np.sqrt(self.yy.max(axis=-1, initial=0.0))
        # <y_k, s> for every selection and N by one product: (B, R, P, K).
        products = np.ascontiguousarray(s.transpose(1, 0, 2, 3)).reshape(B, R * P, D) @ y.transpose(0, 2, 1)
        self.ys = products.reshape(B, R, P, y.shape[1])
        self.ss = np.einsum("rbpd,rbpd->rbp", s, s)
        self.rel = 4 * (D + 4) * np.finfo(np.float64).eps

    def at(self, p):
        return _Around(self, p)


class _BallScores(NamedTuple):
    """docs/method.md#balls, each (R, B): P(r_max, N), R(r_min, N), F, and the radii r_max^2, r_min^2."""

    precision: np.ndarray
    recall: np.ndarray
    f_score: np.ndarray
    r_max2: np.ndarray
    r_min2: np.ndarray


class _Around:
    """The distances of every key to the aggregates at one N: (R, B, K) expansions, within
    `error` (R, B, 1) of D in rows not `unsure` (R, B), and the exact values computed so far
    (NaN where not)."""

    def __init__(self, distances, p):
        self.y, self.s = distances.y, distances.s[:, :, p]
        ss = distances.ss[:, :, p]
        self.expanded = distances.yy - 2 * distances.ys[:, :, p].transpose(1, 0, 2) + ss[..., None]
        error = distances.rel * (distances.y_max + np.sqrt(ss)) ** 2 + _TINY
        self.unsure = ~(np.isfinite(error) & np.all(np.isfinite(self.expanded), axis=-1))
        self.error = np.where(self.unsure, 0.0, error)[..., None]
        self.exact = np.full(self.expanded.shape, np.nan)

    def part(self, rows):
        """The same distances for the selections of the slice rows, sharing the exact values."""
        part = copy.copy(self)
        part.s = self.s[rows]
        part.expanded, part.error = self.expanded[rows], self.error[rows]
        part.unsure, part.exact = self.unsure[rows], self.exact[rows]
        return part

    def D(self, mask):
        """Exact D where mask (computed once per key), NaN elsewhere."""
        self.exact_at(np.flatnonzero(mask))
        return self.exact

    def exact_at(self, flat):
        """Exact D at the flat indices (computed once per key)."""
        exact = self.exact.reshape(-1)
        values = exact[flat]
        todo = np.isnan(values)
        if todo.any():
            new = flat[todo]
            r, b, k = np.unravel_index(new, self.exact.shape)
            values[todo] = exact[new] = _squared_distances(self.y[b, k], self.s[r, b])
        return values

    def _or_unsure(self, mask, keys):
        """mask, and every key of keys in the unsure rows."""
        return mask | (keys & self.unsure[..., None]) if self.unsure.any() else mask

    def ball_scores(self, selected, candidates, n) -> _BallScores:
        """Ball scores over the candidate keys (closed r_max ball, open r_min ball:
        docs/method.md#balls): P(r_max, N) = N / |{k: D_k <= r_max^2}|, R(r_min, N) =
        |{i in I_N: D_i < r_min^2}| / N, F = 2PR/(P+R) (0 if P + R = 0), r_max^2 and r_min^2,
        each (R, B), of the exact distances; selected (R, B, K), candidates (B, K), n an int
        or (R, 1)."""
        x, e = self.expanded, self.error
        unselected = candidates & ~selected
        # The extreme distance is among the keys within 2 errors of the extreme expansion.
        near_max = self._or_unsure(selected & (x >= _masked_max(x, selected)[..., None] - 2 * e),
                                   selected)
        near_min = self._or_unsure(unselected & (x <= _masked_min(x, unselected)[..., None] + 2 * e),
                                   unselected)
        flat = np.flatnonzero(near_max | near_min)
        exact, row = self.exact_at(flat), flat // x.shape[-1]
        of_max = near_max.reshape(-1)[flat]
        r_max2 = _row_reduce(np.maximum, exact[of_max], row[of_max], -np.inf, x.shape[:-1])
        r_min2 = _row_reduce(np.minimum, exact[~of_max], row[~of_max], np.inf, x.shape[:-1])
        precision = n / self._in_ball(candidates, r_max2, closed=True)
        recall = self._in_ball(selected, r_min2, closed=False) / n
        f_score = np.where(precision + recall > 0,
                           2 * precision * recall / (precision + recall), 0.0)
        return _BallScores(precision, recall, f_score, r_max2, r_min2)

    def _in_ball(self, keys, radius2, closed):
        """(R, B) #{k in keys: D_k <= radius2} (closed) or D_k < radius2 (open).

        A key more than an error below the radius is inside by its expansion, one more than an
        error above it outside; the band between is compared exactly. A closed ball's radius
        is a key's distance (r_max^2): that key is in its band, inside, so a band of one key
        needs no exact distance."""
        x, e = self.expanded, self.error
        lo, hi = radius2[..., None] - e, radius2[..., None] + e
        below = np.count_nonzero(keys & (x < lo), axis=-1)
        band = np.count_nonzero(keys & (x <= hi), axis=-1) - below
        settled = band <= 1 if closed else band == 0
        count = below + band if closed else below
        todo = ~settled | self.unsure
        if not todo.any():
            return count
        unsure = self.unsure[..., None]
        flat = np.flatnonzero(keys & todo[..., None] & ((x >= lo) & (x <= hi) | unsure))
        exact, row = self.exact_at(flat), flat // x.shape[-1]
        bound = radius2.reshape(-1)[row]
        hits = np.bincount(row[exact <= bound if closed else exact < bound], minlength=count.size)
        # In an unsure row every key was compared exactly.
        return np.where(todo, np.where(self.unsure, 0, below) + hits.reshape(count.shape), count)

    def ordered(self, a_mask, b_mask):
        """(R, B, K) stand-ins for D that compare between an a key and a b key exactly as the
        exact distances do: exact where some key of the other side has an expansion within
        4 errors, the expansion elsewhere."""
        either = a_mask | b_mask
        half = np.where(self.unsure, np.inf, self.error[..., 0])
        # A key is near one of the other side only in a row where two neighbours among the
        # keys' sorted expansions lie within 4 errors (tested at 8, which covers the rounding
        # of x -/+ w below): the other rows have none.
        ranked = np.sort(np.where(either, self.expanded, np.inf), axis=-1)
        close = np.diff(ranked, axis=-1) <= 8 * half[..., None]
        rows = np.any(close, axis=-1) | ~np.isfinite(half)
        near = np.zeros(a_mask.shape, dtype=bool)
        for idx in zip(*np.nonzero(rows)):
            x, w = self.expanded[idx], 4 * half[idx]
            if not np.isfinite(w):
                near[idx] = a_mask[idx] | b_mask[idx]
                continue
            for mine, other in ((a_mask[idx], b_mask[idx]), (b_mask[idx], a_mask[idx])):
                others = np.sort(x[other])
                keys = np.flatnonzero(mine)
                hits = (np.searchsorted(others, x[keys] + w, side="right")
                        - np.searchsorted(others, x[keys] - w, side="left"))
                near[idx][keys[hits > 0]] = True
        exact = self.D(near)
        return np.where(np.isnan(exact), self.expanded, exact)


def _store(out, g, results, valid):
    """Write results into column g of out: where not valid, NaN (floats) or -1 (counts)."""
    every = valid.all()
    for name, x in results.items():
        out[name][:, g] = x if every else np.where(valid, x, np.nan if out[name].dtype.kind == "f" else -1)


def _k_sink(beta, selected, unselected, nonsink, has_sink, mu, nu_plus, nu_minus):
    """K_N^sink of the appendix proof: the selected-unselected pairs whose lower bound
    L <= (D_j - D_i)/C^2 is not positive (L^{++}, and L^{+0} or L^{0+} by sink membership).

    beta (B, K) effective weights, mu/nu_plus/nu_minus (B,); returns int64 (B,).
    L^{++}_{ij} = f_i + g_j, so K^{++} is one merge count of g_j <= -f_i, O(K log K).
    """
    sel_p = selected & nonsink
    uns_p = unselected & nonsink
    sigma = selected[:, 0] & has_sink
    beta0 = np.where(has_sink, beta[:, 0], 0.0)
    a_plus = np.sum(beta, axis=1, where=sel_p)
    # In exact arithmetic L <= X/C^2, with equality where the pair attains the coherence
    # constants itself (two keys; the pair defining mu; alpha = 0 keys). An exact tie D_j = D_i
    # is an inversion while rounding can leave its L at +1e-17, which would certify the pair
    # safe and break inversions <= k_sink_exact. Both sides round at the scale
    # (beta + A)^2 with A = A_+ + beta_0, so L counts as "<= 0" up to _L_RTOL of that scale,
    # split as a term in i plus a term in j to keep the count a sort + search.
    scale = (a_plus + beta0)[:, None]
    tol = _L_RTOL * (beta + scale) ** 2
    tol0 = _L_RTOL * (beta0 + scale[:, 0]) ** 2
    mu, nu_plus, nu_minus = mu[:, None], nu_plus[:, None], nu_minus[:, None]
    sink_weight = np.where(sigma, beta0, 0.0)[:, None]
    beta2, mu_beta = beta**2, 2 * mu * beta
    f = beta2 - mu_beta * (a_plus[:, None] - beta) - 2 * sink_weight * nu_plus * beta - tol
    g = beta2 - mu_beta * a_plus[:, None] + 2 * sink_weight * nu_minus * beta - tol
    k_pp = _count_pairs_le(g, uns_p, -f, sel_p)
    # With the sink unselected f_i carries no sink term, with it selected g_j carries it.
    l_p0 = f + (beta0**2 - tol0 + 2 * beta0 * nu_minus[:, 0] * a_plus)[:, None]
    l_0p = g + (beta0**2 - tol0 - 2 * beta0 * nu_plus[:, 0] * a_plus)[:, None]
    k_p0 = np.sum(sel_p & (l_p0 <= 0), axis=1)
    k_0p = np.sum(uns_p & (l_0p <= 0), axis=1)
    return k_pp + np.where(sigma, k_0p, np.where(has_sink, k_p0, 0))


def _count_pairs_le(b, b_mask, a, a_mask):
    """#{(i, j): a_mask_i, b_mask_j, b_j <= a_i} per row of (B, K) arrays, in O(K log K):
    a binary search of each a_i among the sorted b_j. (A NaN b_j is never <= a_i; a NaN a_i
    counts every b_j, as NaN sorts last.)"""
    sorted_b = np.sort(np.where(b_mask, b, np.nan), axis=1)
    n_b = b_mask.sum(axis=1)
    return np.array([np.searchsorted(row[:m], x[keep], side="right").sum()
                     for row, m, x, keep in zip(sorted_b, n_b, a, a_mask)], dtype=np.int64)


def _ranked(key, candidates):
    """Order (B, K) of the candidates by ascending key, ties to the smaller position, other
    keys last (in position order); and each key's rank in it."""
    keyed = np.where(candidates, key, np.inf)
    # An unstable sort is the stable one wherever the candidates' keys are distinct and finite
    # and the other keys are put back in position order; other rows are sorted stably.
    order = np.argsort(keyed, axis=1)
    first = np.arange(order.shape[1]) < candidates.sum(axis=1)[:, None]
    in_order = np.take_along_axis(keyed, order, axis=1)
    unsure = (np.any((in_order[:, 1:] == in_order[:, :-1]) & first[:, 1:], axis=1)
              | ~np.all(np.isfinite(in_order) | ~first, axis=1))
    if not first.all():
        order[~first] = np.nonzero(~candidates)[1]  # row by row, in position order
    if unsure.any():
        order[unsure] = np.argsort(keyed[unsure], axis=1, kind="stable")
    B, K = order.shape
    rank = np.empty_like(order)
    rank.ravel()[(order + K * np.arange(B)[:, None]).ravel()] = np.tile(np.arange(K), B)
    return order, rank


def _prefix_sums(y, order, points):
    """(B, len(points), D): the sum of y over the first n keys of order for each n of points
    (ascending, 1 <= n <= K), added one key at a time in that order (as np.cumsum does)."""
    B, K, D = y.shape
    if not len(points):
        return np.empty((B, 0, D))
    # The ranked keys gathered once, each block of keys after a slot for the running sum of the
    # blocks before it (block i: keys points[i-1] .. points[i]-1 at positions shifted by i).
    P, last = len(points), points[-1]
    keys = np.arange(last)
    source = np.zeros((B, last + P - 1), dtype=np.int64)
    source[:, keys + np.searchsorted(points, keys, side="right")] = (
        order[:, :last] + K * np.arange(B)[:, None])
    ranked = y.reshape(B * K, D)[source]
    out = np.empty((B, P, D))
    # A reduction over a non-contiguous axis adds row after row: the running sum goes first.
    out[:, 0] = np.add.reduce(ranked[:, :points[0]], axis=1)
    for i in range(1, P):
        slot = points[i - 1] + i - 1
        ranked[:, slot] = out[:, i - 1]
        out[:, i] = np.add.reduce(ranked[:, slot:points[i] + i], axis=1)
    return out


def _row_reduce(ufunc, values, rows, initial, shape):
    """ufunc.reduce of the values by their flat row (rows ascending) into an array of shape,
    initial in rows without values."""
    out = np.full(shape, initial).reshape(-1)
    if rows.size:
        starts = np.flatnonzero(np.diff(rows, prepend=-1))
        out[rows[starts]] = ufunc.reduceat(values, starts)
    return out.reshape(shape)


def _squared_distances(y, s):
    """||y - s||^2 over the last axis (y and s broadcast), from the difference."""
    diff = y - s
    return np.einsum("...d,...d->...", diff, diff)


def _unit(values, v_norm):
    """u = v/||v||, and u = 0 for v = 0."""
    return values / np.where(v_norm > 0, v_norm, 1.0)[:, :, None]


def _cos(a, b):
    """Cosine of (..., D) vectors (broadcast), NaN where either is 0."""
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.where(norms > 0, np.einsum("...d,...d->...", a, b) / norms, np.nan)


def _masked_max(x, mask):
    """Maxima over the last axis of x where mask (-inf where none); NaN propagates."""
    return np.where(mask, x, -np.inf).max(axis=-1, initial=-np.inf)


def _masked_min(x, mask):
    """Minima over the last axis of x where mask (inf where none); NaN propagates."""
    return np.where(mask, x, np.inf).min(axis=-1, initial=np.inf)


def _masked_mean(x, mask):
    """Means of x over mask along the last axis, NaN for an empty mask."""
    count = mask.sum(axis=-1)
    return np.where(count > 0, np.sum(x, axis=-1, where=mask) / count, np.nan)


def _quantile(x, q, size=None):
    """q-quantile (numpy's 'linear' method: x_lo + (pos - lo) (x_hi - x_lo)) of the 1-D x, NaN
    if x is empty; with size, of x's smallest `size` entries (the others being larger)."""
    m = x.size if size is None else size
    if m == 0:
        return np.nan
    pos = q * (m - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, m - 1)
    below, above = _order_statistics(x, lo, hi)
    return below + (pos - lo) * (above - below)


def _order_statistics(x, lo, hi):
    """The lo-th and hi-th smallest entries of the 1-D x (lo <= hi).

    For a long x, a bracket [t_lo, t_hi] around them is taken from a sample; counting
    the entries below t_lo and partitioning the few inside is exact whenever the bracket
    holds both ranks. A bracket that misses is widened once (the entries of a flattened Gram
    matrix are correlated along rows, which a sample of 2048 sees less sharply), and a
    partition of all of x answers after that.
    """
    m = x.size
    if m > _BRACKET_MIN:
        # Positions spread by the golden ratio, not a stride: a stride that divides the row
        # length of a flattened matrix samples a few of its columns only.
        sample = np.sort(x[(np.arange(2048) * _GOLDEN % 1.0 * m).astype(np.int64)])
        for share in (0.02, 0.08):
            margin = share * sample.size + 8
            t_lo = sample[max(int(lo / m * sample.size - margin), 0)]
            t_hi = sample[min(int(hi / m * sample.size + margin), sample.size - 1)]
            below = np.count_nonzero(x < t_lo)
            # Gathered by index: a boolean mask's compress runs 2-3x slower on a long x.
            inside = x[np.flatnonzero((x >= t_lo) & (x <= t_hi))]
            if below <= lo and hi < below + inside.size:
                part = np.partition(inside, (lo - below, hi - below))
                return part[lo - below], part[hi - below]
    part = np.partition(x, (lo, hi))
    return part[lo], part[hi]


def _batch_slices(B, size):
    """Slices of the batch with at most _SLICE_BUDGET elements of per-instance size each."""
    step = max(1, _SLICE_BUDGET // max(size, 1))
    return [slice(start, start + step) for start in range(0, B, step)] or [slice(0, 0)]


def _check_batch(attn, values, attendable, head_kv):
    values = np.asarray(values, dtype=np.float64)
    attendable = np.asarray(attendable, dtype=bool)
    if values.ndim != 3 or values.shape[1] < 1:
        raise ValueError(f"values must have shape (G, K, D) with K >= 1, got {values.shape}")
    if attendable.shape != values.shape[:2]:
        raise ValueError(f"attendable has shape {attendable.shape}, expected {values.shape[:2]}")
    if attn is None:
        return None, values, attendable, None
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim != 2 or attn.shape[1] != values.shape[1]:
        raise ValueError(f"attn has shape {attn.shape}, expected (B, {values.shape[1]})")
    if head_kv is None:
        if attn.shape[0] != values.shape[0]:
            raise ValueError(f"attn has {attn.shape[0]} rows for {values.shape[0]} value heads; "
                             "pass head_kv")
        head_kv = np.arange(attn.shape[0])
    head_kv = np.asarray(head_kv, dtype=np.int64).reshape(-1)
    if head_kv.shape != (attn.shape[0],) or np.any((head_kv < 0) | (head_kv >= values.shape[0])):
        raise ValueError(f"head_kv must hold {attn.shape[0]} kv heads in [0, {values.shape[0]}), "
                         f"got {head_kv.tolist()}")
    return attn, values, attendable, head_kv
