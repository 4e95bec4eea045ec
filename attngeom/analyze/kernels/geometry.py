"""Every top-N output of a query head (docs/method.md): the ball scores of the three
selections, the inversions, the sink-aware bounds, the sink diagnostics, leave-one-out and the
mechanistic signatures, at each valid size N, from the parts the other modules compute.

Outputs are written by the schema's names (`FLOAT`, `COUNT`): rows of a (variable, N) array in
the order of ``TOPN_FLOATS`` and of the integer variables that follow them in
``TOPN_VARIABLES``.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from attngeom.analyze.kernels._jit import jit, jit_head
from attngeom.analyze.kernels.balls import ExactDistances, ball, head_expansions, inversions
from attngeom.analyze.kernels.bounds import k_sink
from attngeom.analyze.kernels.coherence import Coherence
from attngeom.analyze.kernels.selection import head_aggregates
from attngeom.analyze.kernels.vectors import (
    cos,
    dot,
    exact_distance,
    leave_one_out,
    norm,
    row_cache,
    squared_difference,
)
from attngeom.store.objects.schema import TOPN_FLOATS, TOPN_VARIABLES

# The integer outputs: the counts, then the flags of the two sinks' selection.
TOPN_INTEGERS = TOPN_VARIABLES[len(TOPN_FLOATS):]
# Each output's row, by name: FLOAT.precision is "precision"'s row of the float outputs.
FLOAT = namedtuple("FloatRows", TOPN_FLOATS)(*range(len(TOPN_FLOATS)))
COUNT = namedtuple("CountRows", TOPN_INTEGERS)(*range(len(TOPN_INTEGERS)))


@jit_head
def head_geometry(kv, points, alpha, agg, sv, expansions, exact, coherence, tol, floats, counts):
    """Every top-N output of one query head at the valid sizes ``points`` (ascending, each
    < |K|): floats (len(TOPN_FLOATS), P) and counts (len(TOPN_INTEGERS), P), rows by `FLOAT`
    and `COUNT`, filled in place (they arrive NaN / -1).

    kv: the head's `values.KvHead`; alpha (K,) its attention row; agg its
    `selection.Aggregates`, sv (rows, K) = S values^T; expansions (`balls.Expansions`) and exact
    (`balls.ExactDistances`) from `balls.exact_keys`; coherence (`coherence.Coherence`) mu and
    mu_q95 (P,); tol the `settings.Tolerances`.

    The outputs, by section of docs/method.md. Selection ``I_N``: the N attendable keys of
    largest alpha, ties to the smaller position; ``U_N = K \\ I_N``, ``s_N = sum_{I_N} y_i`` with
    ``y_k = alpha_k v_k``, ``D_k = ||y_k - s_N||^2``.

    - #precision-recall-and-f, #inversions: ``precision`` = N / |{k: D_k <= r_max^2}|,
      ``recall`` = |{i in I_N: D_i < r_min^2}| / N, ``f_score`` = 2PR/(P+R); ``inversions``
      A_N = #{(i, j) in I_N x U_N: D_j <= D_i}.
    - ``sink_selected``: 0 in I_N; ``learned_sink_selected``: the learned sink's virtual key
      (kv.virtual: key 1) in I_N, -1 without one.
    - #sink-aware-bound, #robust-constants: ``k_sink``, ``precision_bound`` = 1/(1 + k/N),
      ``recall_bound`` = max(0, 1 - k/N): the appendix bound with beta_i = alpha_i (i > 0),
      beta_0 = alpha_0 ||v_0||/C, worst-case ``mu`` and nu; ``*_q95`` the same with ``mu_q95``
      and the 5%/95% sink-cosine quantiles. Undefined (-1/NaN) for an instance with a sink and
      C = 0. ``mu``/``mu_q95`` range over the unordered non-sink pairs with at least one key in
      I_N.
    - #exact-certificate: ``k_sink_exact``: the same algebra with beta_i = alpha_i ||v_i|| / C for every key and
      signed sink constants; ``inversions <= k_sink_exact`` on every instance.
    - #random-control: ``random_*``: P, R, F of uniformly random size-N subsets of K, mean over the draws; draw d
      selects the N attendable keys of smallest
      ``np.random.default_rng(seed).random((random_draws, B, K))[d]``.
    - #sink-excluded-variant: ``nosink_*``: P, R, F with the sink removed from the candidate keys before selection.
    - #sink-diagnostics (NaN without a sink): ``sink_norm_share`` ||y_0||/||s_N|| and
      ``sink_direction_change`` 1 - cos(s_N, s_N - y_0) when 0 in I_N; ``sink_intrusion``
      1{D_0 <= r_max^2} and ``sink_pair_inversion_frac`` mean_{I_N} 1{D_0 <= D_i} when not;
      ``sink_alignment`` cos(y_0, s_{N,+}), s_{N,+} the selected non-sink part of s_N.
    - #leave-one-out (s_{N,-i} = s_N - y_i): ``loo_cos`` mean_{I_N} cos(y_i, s_{N,-i}),
      ``loo_margin`` loo_cos - mean_{U_N} cos(y_j, s_N), ``loo_positive_frac`` the fraction of
      those cosines > 0, ``loo_distance_margin``
      min_{U_N} ||y_j - s_N|| - max_{I_N} ||y_i - s_{N,-i}||.
      Means and fractions run over the defined cosines (NaN if none, e.g. N = 1).
    - #mechanistic-signatures, o = sum_K y_k: ``s_norm`` ||s_N||/||o||, ``s_norm_nosink`` and
      ``s_norm_nocurrent`` the same without y_0 / y_{K-1} when selected, ``cos_s_v0``
      cos(s_N, v_0), ``cos_s_vlast`` cos(s_N, v_{K-1}).
    """
    values, att, v_norm, C, c_lo, c_hi, q05, q95, virtual = kv
    y, S, s_plus, orders = agg
    mu, mu_q95 = coherence
    e_rel, tiny, l_rtol = tol
    K, D = values.shape
    P = points.size
    order, rank, ns_order, draw_orders = orders
    R = draw_orders.shape[0]
    has_sink = att[0]
    nonsink = att.copy()
    nonsink[0] = False
    n_att = n_ns = np.int64(0)
    for k in range(K):
        n_att += att[k]
        n_ns += nonsink[k]
    Pn = S.shape[0] - P - R * P
    yy = np.empty(K)
    y_norm = np.empty(K)
    o = np.zeros(D)
    for k in range(K):
        yy[k] = dot(y[k], y[k])
        y_norm[k] = np.sqrt(yy[k])
        if att[k]:
            for d in range(D):
                o[d] += y[k, d]
    o_norm = norm(o)
    X, err, unsure_rows, row_scores = expansions
    buffer = np.empty(K)

    # The sink-aware bounds' weights (paper: beta_0 = lambda alpha_0; exact: alpha ||v||).
    paper_defined = not has_sink or C > 0
    beta_paper = alpha.copy()
    beta_paper[0] = alpha[0] * v_norm[0] / C if has_sink and paper_defined else 0.0
    # The learned sink's virtual key has a known norm, 0, as the sink's is absorbed.
    if virtual:
        beta_paper[1] = 0.0
    beta_exact = alpha * v_norm
    nu_paper = (max(0.0, -c_lo), max(0.0, -c_hi)) if has_sink else (0.0, 0.0)
    nu_q95 = (max(0.0, -q05), max(0.0, -q95)) if has_sink else (0.0, 0.0)
    nu_exact = (-c_lo, -c_hi) if has_sink else (0.0, 0.0)

    # The sizes grow and the selections nest: I_N is kept by adding the keys it gains.
    selected = np.zeros(K, dtype=np.bool_)
    for p in range(P):
        n = points[p]
        s = S[p]
        x, e, unsure, cache = X[p], err[p], unsure_rows[p], row_cache(exact, p, buffer)
        precision, recall, f_score, r_max2, r_min2 = ball(y, s, x, y_norm, e_rel, tiny, unsure,
                                                          order, n, n_att, cache)
        floats[FLOAT.precision, p], floats[FLOAT.recall, p], floats[FLOAT.f_score, p] = precision, recall, f_score
        for i in range(n):
            selected[order[i]] = True
        sigma = has_sink and selected[0]
        counts[COUNT.sink_selected, p] = sigma
        if virtual:
            counts[COUNT.learned_sink_selected, p] = selected[1]

        # Inversions #{(i, j): D_j <= D_i} from the selected keys' exact distances.
        d_sel = np.empty(n)
        for i in range(n):
            d_sel[i] = exact_distance(y, np.uint64(order[i]), s, cache)
        counts[COUNT.inversions, p] = inversions(d_sel, x, order, n, n_att, 2 * e, unsure, y, s, cache)

        if has_sink and not sigma:
            d0 = exact_distance(y, np.uint64(0), s, cache)
            floats[FLOAT.sink_intrusion, p] = 1.0 if d0 <= r_max2 else 0.0
            beats = 0
            for i in range(n):
                beats += d0 <= d_sel[i]
            floats[FLOAT.sink_pair_inversion_frac, p] = beats / n

        # Leave-one-out: s_{N,-i} = s_N - y_i.
        s_norm = norm(s)
        loo_sum, loo_pos, loo_n, spread_max = 0.0, 0, 0, -np.inf
        for i in range(n):
            key = np.uint64(order[i])
            # cos(y_i, s_{N,-i}) = -<y_i, y_i - s_N> / (||y_i|| ||y_i - s_N||), and
            # ||y_i - s_{N,-i}|| = ||2 y_i - s_N||.
            inner, spread2 = leave_one_out(y[key], s)
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
        floats[FLOAT.loo_cos, p] = loo_cos
        floats[FLOAT.loo_positive_frac, p] = loo_pos / loo_n if loo_n else np.nan
        floats[FLOAT.loo_margin, p] = loo_cos - js_sum / js_n if js_n else np.nan
        floats[FLOAT.loo_distance_margin, p] = np.sqrt(r_min2) - spread_max

        # Sink shares and mechanistic signatures.
        sp = s_plus[p]
        if sigma:
            floats[FLOAT.sink_norm_share, p] = y_norm[0] / s_norm
            floats[FLOAT.sink_direction_change, p] = 1.0 - cos(s, sp)
        if has_sink:
            floats[FLOAT.sink_alignment, p] = cos(y[0], sp)
            floats[FLOAT.cos_s_v0, p] = cos(s, values[0])
        floats[FLOAT.s_norm, p] = s_norm / o_norm
        floats[FLOAT.s_norm_nosink, p] = norm(sp) / o_norm
        if selected[K - 1]:
            floats[FLOAT.s_norm_nocurrent, p] = np.sqrt(squared_difference(s, y[K - 1])) / o_norm
        else:
            floats[FLOAT.s_norm_nocurrent, p] = s_norm / o_norm
        floats[FLOAT.cos_s_vlast, p] = cos(s, values[K - 1])

        # Bounds: the paper's variant, the robust one (q95) and the exact certificate.
        mu_p = 0.0 if np.isnan(mu[p]) else mu[p]
        mu_q = 0.0 if np.isnan(mu_q95[p]) else mu_q95[p]
        floats[FLOAT.mu, p], floats[FLOAT.mu_q95, p] = mu[p], mu_q95[p]
        counts[COUNT.k_sink_exact, p] = k_sink(beta_exact, selected, order, n, n_att, nonsink, has_sink, mu_p,
                                          nu_exact[0], nu_exact[1], l_rtol)
        if paper_defined:
            k_paper = k_sink(beta_paper, selected, order, n, n_att, nonsink, has_sink, mu_p,
                              nu_paper[0], nu_paper[1], l_rtol)
            k_q95 = k_sink(beta_paper, selected, order, n, n_att, nonsink, has_sink, mu_q,
                            nu_q95[0], nu_q95[1], l_rtol)
            counts[COUNT.k_sink, p], counts[COUNT.k_sink_q95, p] = k_paper, k_q95
            floats[FLOAT.precision_bound, p] = 1.0 / (1.0 + k_paper / n)
            floats[FLOAT.recall_bound, p] = max(0.0, 1.0 - k_paper / n)
            floats[FLOAT.precision_bound_q95, p] = 1.0 / (1.0 + k_q95 / n)
            floats[FLOAT.recall_bound_q95, p] = max(0.0, 1.0 - k_q95 / n)

    # The sink-excluded variant: without a sink it is the main selection.
    for p in range(P):
        if not has_sink:
            floats[FLOAT.nosink_precision, p] = floats[FLOAT.precision, p]
            floats[FLOAT.nosink_recall, p] = floats[FLOAT.recall, p]
            floats[FLOAT.nosink_f_score, p] = floats[FLOAT.f_score, p]
        elif p < Pn:
            row = P + p
            if np.isnan(row_scores[row, 0]):
                scores = ball(y, S[row], X[row], y_norm, e_rel, tiny, unsure_rows[row], ns_order,
                               points[p], n_ns, row_cache(exact, row, buffer))
                row_scores[row] = scores[0], scores[1], scores[2]
            floats[FLOAT.nosink_precision, p], floats[FLOAT.nosink_recall, p], floats[FLOAT.nosink_f_score, p] = (
                row_scores[row, 0], row_scores[row, 1], row_scores[row, 2])

    # The random control: mean over the draws.
    if R:
        for p in range(P):
            total = np.zeros(3)
            for r in range(R):
                row = P + Pn + r * P + p
                if np.isnan(row_scores[row, 0]):
                    scores = ball(y, S[row], X[row], y_norm, e_rel, tiny, unsure_rows[row],
                                   draw_orders[r], points[p], n_att,
                                   row_cache(exact, row, buffer))
                    row_scores[row] = scores[0], scores[1], scores[2]
                for i in range(3):
                    total[i] += row_scores[row, i]
            floats[FLOAT.random_precision, p] = total[0] / R
            floats[FLOAT.random_recall, p] = total[1] / R
            floats[FLOAT.random_f_score, p] = total[2] / R


@jit
def group_geometry(kv, points, alpha, agg, sv, expansions, exact, coherence, tol):
    """`head_geometry` of each query head reading kv: floats (h, len(TOPN_FLOATS), P), counts
    (h, len(TOPN_INTEGERS), P); alpha (h, K), the parts with a leading axis h (exact: the
    distances of the (head, row, key) triples `balls.group_exact_keys` names, in its order,
    as (heads, rows, keys, distances))."""
    h, P = alpha.shape[0], points.size
    floats = np.full((h, len(FLOAT), P), np.nan)
    counts = np.full((h, len(COUNT), P), -1, np.int64)
    heads, rows, keys, distances = exact
    for i in range(h):
        lo, hi = np.searchsorted(heads, i), np.searchsorted(heads, i + 1)
        head_geometry(kv, points, alpha[i], head_aggregates(agg, i), sv[i], head_expansions(expansions, i),
                      ExactDistances(rows[lo:hi], keys[lo:hi], distances[lo:hi]),
                      Coherence(coherence.mu[i], coherence.mu_q95[i]), tol, floats[i], counts[i])
    return floats, counts
