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

Arithmetic is float64 throughout, but for one screen: the Gram matrix of a kv head's unit
values is computed in float32, within a proven bound of each exact cosine (`_screen_bound`), and
every pair cosine that an output takes, or that decides one (the median, a row's maximum, the
pairs around a quantile), is computed again in float64 from the unit vectors.

A value vector of norm 0 has no direction: its unit vector is taken as 0 (cosine 0 with
everything) in the coherence statistics, which keeps the exact certificate valid because such
a key has ``beta = 0`` there; a cosine reported as an output is NaN whenever one of its
vectors is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy.linalg.blas import dsyrk, ssyrk

from attngeom.analyze import _loops
from attngeom.store.schema import TOPN_COUNTS, TOPN_FLOATS, VALUE_STATISTICS

# Share of a kv head's non-sink pairs kept, largest |cosine| first, as the candidates of the
# 95% coherence quantile mu_q95 (which sits in the top 5% of its pairs). Any (head, N) whose
# quantile falls outside them is computed from all of its pairs: the share trades speed only.
_TOP_PAIR_SHARE = 0.08
# Below this many pairs every pair is a candidate.
_TOP_PAIR_MIN = 4096

# A kv head with more pairs than this finds its median pair cosine within a bracket from a
# sample (`_loops.pair_statistics`).
_BRACKET_MIN = 1 << 16

# The Gram matrix of a kv head's unit values is computed in float32 (twice float64's speed)
# and read as a screen (`_nonsink_gram`); float64, its entries the cosines, where the unit
# vectors are not finite, or everywhere with float64 here (the tests' exact fallback).
_GRAM_DTYPE = np.float32

# The loops index a kv head's pairs as int32 (`_loops.pair_statistics`); the Gram matrix
# alone would take 16 GiB here.
MAX_KEYS = 1 << 16

# An absolute floor under the expansions' error bound (`_error_bound`), far above subnormal
# rounding.
_TINY = 1e-290

# Relative margin of the "L <= 0" test of the sink-aware bounds, see `_loops._k_sink`.
_L_RTOL = 1e-10

__all__ = ["MAX_KEYS", "TOPN_COUNTS", "TOPN_FLOATS", "VALUE_STATISTICS", "compile_kernels", "head_metrics",
           "topn_metrics", "value_statistics"]


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
        work = np.empty(values.shape[1] ** 2, _GRAM_DTYPE)
        median_cos = np.array([
            _loops.pair_statistics(*_nonsink_gram(kv, g, work), _TOP_PAIR_SHARE, _TOP_PAIR_MIN, _BRACKET_MIN)[0]
            for g in range(values.shape[0])])
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


def compile_kernels() -> None:
    """Compile the kernels' loops, or load them from numba's cache beside the package, in
    this process: worker processes forked after it share them (the stage calls it before
    forking its workers; otherwise the first call in each process pays it). A cold compile
    takes tens of seconds, a load from the cache under a second."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, 8, 2))
    values[1, 3] = np.nan  # kv head 1 takes the float64 Gram matrix
    head_metrics(rng.random((2, 8)), values, np.ones((2, 8), dtype=bool), [1, 2, 4],
                 head_kv=np.arange(2), random_draws=1)


def _metrics(attn, values, attendable, n_grid, head_kv, seed, random_draws, with_values):
    """topn_metrics' outputs, and value_statistics' (None unless with_values)."""
    alpha, values, attendable, head_kv = _check_batch(attn, values, attendable, head_kv)
    grid = np.asarray(n_grid, dtype=np.int64).reshape(-1)
    if np.any(grid < 1):
        raise ValueError(f"n_grid must hold sizes N >= 1, got {grid.tolist()}")
    if random_draws < 0:
        raise ValueError(f"random_draws must be >= 0, got {random_draws}")
    B, K = alpha.shape
    # Drawn as documented, (R, B, K); each group of query heads takes its rows as (h, R, K).
    draw_keys = np.random.default_rng(seed).random((random_draws, B, K)).transpose(1, 0, 2)

    # Every head's outputs at once: (B, variable, N), split into variables at the end.
    floats = np.full((B, len(TOPN_FLOATS), grid.size), np.nan)
    counts = np.full((B, len(TOPN_COUNTS) + 1, grid.size), -1, dtype=np.int64)
    stats = {name: np.full(values.shape[0], np.nan) for name in VALUE_STATISTICS} if with_values else None
    work = np.empty(K * K, _GRAM_DTYPE)
    # Degenerate instances (zero vectors, zero norms) give NaN by design, not warnings.
    with np.errstate(divide="ignore", invalid="ignore"):
        for g in range(values.shape[0]) if with_values else np.unique(head_kv):
            # Keys outside the mask take no part: a sliding-window layer is computed on its
            # window alone (the first and last positions stay, as the sink and the current
            # key, whatever the mask says of them).
            keys = _kept_keys(attendable[g])
            vals, att = values[g][keys], attendable[g][keys]
            kv = _kv_heads(vals[None], att[None])
            screen = _nonsink_gram(kv, 0, work)
            pairs = _loops.pair_statistics(*screen, _TOP_PAIR_SHARE, _TOP_PAIR_MIN, _BRACKET_MIN)
            heads = np.flatnonzero(head_kv == g)
            if heads.size:
                _query_heads((floats, counts), heads, alpha[heads][:, keys], vals, att, kv, 0, screen, pairs, grid,
                             draw_keys[heads][:, :, keys])
            if with_values:
                for name, x in _value_statistics(kv, np.array([pairs[0]])).items():
                    stats[name][g] = x[0]
    out = {name: floats[:, i] for i, name in enumerate(TOPN_FLOATS)}
    out.update({name: counts[:, i] for i, name in enumerate(TOPN_COUNTS)})
    out["sink_selected"] = counts[:, -1].astype(np.int8)
    return out, stats


def _kept_keys(attendable):
    """The positions a kv head's computation keeps: all (a slice, no copy) unless some key
    between the first and the last is masked."""
    if attendable[1:-1].all():
        return slice(None)
    keep = attendable.copy()
    keep[0] = keep[-1] = True
    return np.flatnonzero(keep)


def _query_heads(out, heads, alpha, values, att, kv, g, screen, pairs, grid, draw_keys):
    """Rows heads of out = (floats, counts), (B, variable, len(grid)) each: the outputs at
    every N of grid of the query heads reading kv head g,
    from their attention rows alpha (h, K), the kv head's values (K, D), mask att (K,), Gram
    matrix screen = (gram, unit, delta) of `_nonsink_gram` and pair statistics; draw_keys
    (h, R, K)."""
    gram = screen[0]
    att = np.ascontiguousarray(att)
    n_att = int(att.sum())
    points = np.unique(grid[grid < n_att])
    options = np.array([_error_bound(values.shape[1]), _TINY, _L_RTOL])
    y, S, s_plus, orders = _loops.group_aggregates(alpha, values, att, points, np.ascontiguousarray(draw_keys))
    if gram.shape[0] >= 2:
        mu, mu_q95 = _loops.group_coherence(np.ascontiguousarray(orders[1][:, kv.nonsink[g]]), *pairs[1:],
                                            *screen, points, n_att)
    else:
        mu = mu_q95 = np.full((heads.size, points.size), np.nan)
    # <s, v_k> of every aggregate and key: one product of every head's aggregates with the
    # values they share (a product per head, of y, took a third longer); the loops take
    # <s, y_k> as alpha_k <s, v_k>.
    sv = (S.reshape(-1, S.shape[-1]) @ values.T).reshape(*S.shape[:2], values.shape[0])
    X, err, unsure, scores, hh, rows, keys = _loops.group_exact_keys(y, S, sv, alpha, orders, points, att, options)
    named = (hh, rows, keys, _squared_distances(y[hh, keys], S[hh, rows]))
    head_constants = np.array([kv.C[g], kv.c_lo[g], kv.c_hi[g], kv.q05[g], kv.q95[g]])
    floats, counts = _loops.group_geometry(values, att, points, y, S, s_plus, sv, (X, err, unsure, scores),
                                           named, orders, alpha, kv.v_norm[g], head_constants, mu,
                                           mu_q95, options)
    if np.array_equal(points, grid):  # every size valid, each once, in order: the common case
        for whole, part in zip(out, (floats, counts)):
            whole[heads] = part
        return
    valid = np.flatnonzero(grid < n_att)
    at = np.searchsorted(points, grid[valid])
    for whole, part in zip(out, (floats, counts)):
        whole[np.ix_(heads, np.arange(part.shape[1]), valid)] = part[..., at]


def _squared_distances(y, s):
    """||y - s||^2 over the last axis, from the difference: the exact distance D_k of every
    comparison an expansion cannot settle. Rounding decides between keys whose distances
    agree to a few ulps (real attention rows hold many keys of nearly no weight, all at
    nearly ||s_N||^2): this is the one way they are computed, as before the compiled kernels."""
    diff = y - s
    return np.einsum("...d,...d->...", diff, diff)


def _error_bound(D: int) -> float:
    """The relative error bound e_rel of a distance's expansion: D_k = ||y_k - s||^2 computed
    from the difference, or expanded as ||y_k||^2 - 2 <y_k, s> + ||s||^2 with <y_k, s> taken
    as alpha_k <v_k, s> (y_k = alpha_k v_k rounded: two roundings more than <y_k, s>), is
    within (D + 4) eps (||y_k|| + ||s||)^2 of the real value, whatever the summation order
    and fused multiply-adds; the bound used for a row of keys, e_rel (max_k ||y_k|| + ||s||)^2
    plus _TINY, is twice what the two ways can differ by, so a comparison may widen a
    threshold by e instead of bounding every key's own rounding."""
    return 4 * (D + 4) * np.finfo(np.float64).eps


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
    G, K, D = values.shape
    v_norm, unit, sink_cos, stats = np.empty((G, K)), np.empty((G, K, D)), np.empty((G, K)), np.empty((G, 6))
    for g in range(G):
        v_norm[g], unit[g], sink_cos[g], stats[g] = _loops.kv_head(values[g], np.ascontiguousarray(attendable[g]))
    return _KvHeads(
        v_norm=v_norm, unit=unit, nonsink=nonsink, has_sink=attendable[:, 0],
        C=stats[:, 0], sink_cos=sink_cos, c_lo=stats[:, 1], c_hi=stats[:, 2],
        sink_cos_median=stats[:, 3], q05=stats[:, 4], q95=stats[:, 5],
    )


def _nonsink_gram(kv, g, work):
    """The Gram matrix (k, k) <u_p, u_q> of kv head g over its k non-sink keys, in position
    order, below the diagonal (q > p) only, as a screen: (gram, unit, delta), unit (k, D) the
    float64 unit vectors and delta the bound on |gram - exact| (`_screen_bound`), 0 where the
    gram is float64 and its entries are the cosines (unit vectors not finite).

    The symmetric product (BLAS syrk) does half a full product's work. It is handed the
    transpose, Fortran-ordered as BLAS wants it (the C-ordered unit vectors would be copied
    first), and writes into work, a buffer of at least k*k shared by the kv heads of a call
    (a fresh output would be zeroed first, page by page). The result is a view of work,
    valid until the next kv head."""
    nonsink = kv.nonsink[g]
    # Without a window the non-sink keys are 1..K-1: a view, not a 1 MB copy per kv head.
    unit = kv.unit[g][1:] if nonsink[1:].all() else kv.unit[g][nonsink]
    k, D = unit.shape
    if not k:
        return np.empty((0, 0), work.dtype), unit, 0.0
    if work.dtype == np.float32:
        gram = ssyrk(1.0, unit.astype(np.float32).T, trans=1, c=work[: k * k].reshape((k, k), order="F"),
                     overwrite_c=1).T
        if np.isfinite(np.diagonal(gram)).all():
            return gram, unit, _screen_bound(D)
        work = np.empty(k * k)
    return dsyrk(1.0, unit.T, trans=1, c=work[: k * k].reshape((k, k), order="F"), overwrite_c=1).T, unit, 0.0


def _screen_bound(D: int) -> float:
    """delta: how far a float32 Gram entry can lie from the exact cosine `_loops._pair_cos`.
    The unit vectors (norm at most 1 + D eps64) are rounded to float32 (relative 2^-24 each, or
    2^-149 absolute below float32's normal range) and their products summed in any order,
    within (D + 2) 2^-24 (1 + D 2^-24); `_pair_cos` is within D eps64 of the real value. Twice
    (D + 3) 2^-24 covers both with room."""
    return 2 * (D + 3) * 2.0**-24


def _check_batch(attn, values, attendable, head_kv):
    # Contiguous and writeable: the compiled loops have one signature, loaded from numba's
    # cache; a read-only input (a broadcast mask) would compile another one in every worker.
    values = np.require(values, np.float64, ["C", "W"])
    attendable = np.require(attendable, bool, ["C", "W"])
    if values.ndim != 3 or values.shape[1] < 1:
        raise ValueError(f"values must have shape (G, K, D) with K >= 1, got {values.shape}")
    if values.shape[1] > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per instance, got {values.shape[1]}")
    if attendable.shape != values.shape[:2]:
        raise ValueError(f"attendable has shape {attendable.shape}, expected {values.shape[:2]}")
    if attn is None:
        return None, values, attendable, None
    attn = np.require(attn, np.float64, ["C", "W"])
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
