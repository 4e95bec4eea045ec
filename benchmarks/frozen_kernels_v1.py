"""FROZEN for benchmark comparison only: a verbatim copy of attngeom/analyze/kernels.py at
commit 617baa4 (before issue 11), the baseline of benchmarks/analyze_kernels.py. Not used by
attngeom; do not edit it, and import it nowhere else.

Numeric kernels of the analyze stage: top-N geometry at the final query (SPEC §3).

One instance is one (sequence, layer, head) at the final query ``q = L-1``. Every public
function takes a batch of ``B`` instances on a leading axis:

- ``attn`` (B, K): the final query's attention row ``alpha_k`` over key positions 0..K-1;
- ``values`` (B, K, D): the head's value vectors ``v_k`` (kv head already mapped to the query head);
- ``attendable`` (B, K) bool: the keys ``K_b`` the final query may attend to. Keys outside it
  (sliding-window layers) take no part at all. Position 0 is the sink; an instance whose
  position 0 is not attendable has no sink: all of its keys are non-sink and the sink terms vanish.

Arithmetic is float64 throughout. A value vector of norm 0 has no direction: its unit vector is
taken as 0 (cosine 0 with everything) in the coherence statistics, which keeps the exact
certificate valid because such a key has ``beta = 0`` there; a cosine reported as an output is
NaN whenever one of its vectors is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Float64 elements of one B x K x K Gram slice; larger batches are processed in slices of at
# most this size, so peak memory stays a few hundred MiB whatever the batch.
_GRAM_BUDGET = 1 << 23

# Relative margin of the "L <= 0" test of the sink-aware bounds, see `_k_sink`.
_L_RTOL = 1e-10

VALUE_STATISTICS = (
    "C", "sink_norm_ratio", "norm_cv", "median_cos",
    "sink_cos_median", "sink_cos_neg_frac", "nu_minus_q95", "nu_plus_q95",
)
# Outputs of topn_metrics: int64 counts (-1 = N not valid), the int8 sink flag, floats.
TOPN_COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact")
TOPN_FLOATS = (
    "precision", "recall", "f_score",
    "mu", "mu_q95",
    "precision_bound", "recall_bound", "precision_bound_q95", "recall_bound_q95",
    "random_precision", "random_recall", "random_f_score",
    "nosink_precision", "nosink_recall", "nosink_f_score",
    "sink_norm_share", "sink_direction_change", "sink_intrusion", "sink_pair_inversion_frac",
    "sink_alignment",
    "loo_cos", "loo_margin", "loo_positive_frac", "loo_distance_margin",
    "s_norm", "s_norm_nosink", "s_norm_nocurrent", "cos_s_v0", "cos_s_vlast",
)


def topn_metrics(
    attn: np.ndarray,
    values: np.ndarray,
    attendable: np.ndarray,
    n_grid: Sequence[int],
    *,
    seed: int = 0,
    random_draws: int = 8,
) -> dict[str, np.ndarray]:
    """Top-N separability, bounds and diagnostics at the final query (SPEC §3).

    attn (B, K), values (B, K, D), attendable (B, K) bool; n_grid: selection sizes N >= 1.
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
    alpha, values, attendable = _check_batch(attn, values, attendable)
    grid = np.asarray(n_grid, dtype=np.int64).reshape(-1)
    if np.any(grid < 1):
        raise ValueError(f"n_grid must hold sizes N >= 1, got {grid.tolist()}")
    if random_draws < 0:
        raise ValueError(f"random_draws must be >= 0, got {random_draws}")
    B, K, _ = values.shape
    # Drawn for the whole batch up front, so the draws do not depend on the slicing below.
    draw_keys = np.random.default_rng(seed).random((random_draws, B, K))

    shape = (B, grid.size)
    out = {name: np.full(shape, np.nan) for name in TOPN_FLOATS}
    out.update({name: np.full(shape, -1, dtype=np.int64) for name in TOPN_COUNTS})
    out["sink_selected"] = np.full(shape, -1, dtype=np.int8)
    # Degenerate instances (zero vectors, zero norms) give NaN by design, not warnings.
    with np.errstate(divide="ignore", invalid="ignore"):
        for part in _batch_slices(B, K):
            _topn_slice(
                alpha[part], values[part], attendable[part], grid, draw_keys[:, part],
                {name: array[part] for name, array in out.items()},
            )
    return out


def value_statistics(values: np.ndarray, attendable: np.ndarray) -> dict[str, np.ndarray]:
    """Norm and coherence statistics of each instance (SPEC §3 "Norms and coherence").

    values (B, K, D), attendable (B, K) bool; returns arrays of shape (B,), over the attendable
    non-sink keys k (cosines of unit vectors u_k = v_k/||v_k||):

    - ``C``: median ||v_k||; ``norm_cv``: std/mean of ||v_k|| (population std);
    - ``median_cos``: median <u_p, u_q> over pairs p != q;
    - sink (NaN without one): ``sink_norm_ratio`` lambda = ||v_0||/C, ``sink_cos_median`` and
      ``sink_cos_neg_frac`` (fraction < 0) of <u_0, u_k>, ``nu_minus_q95`` = max(0, -q95) and
      ``nu_plus_q95`` = max(0, -q05) of <u_0, u_k>.
    """
    _, values, attendable = _check_batch(None, values, attendable)
    B, K, _ = values.shape
    out = {name: np.full(B, np.nan) for name in VALUE_STATISTICS}
    with np.errstate(divide="ignore", invalid="ignore"):
        for part in _batch_slices(B, K):
            _value_statistics_slice(values[part], attendable[part],
                                    {name: array[part] for name, array in out.items()})
    return out


class _Instances(NamedTuple):
    """Per-instance quantities that do not depend on N, for a slice of the batch."""

    values: np.ndarray      # (B, K, D) v_k
    y: np.ndarray           # (B, K, D) y_k = alpha_k v_k
    y_norm: np.ndarray      # (B, K)
    att: np.ndarray         # (B, K) K_b
    has_sink: np.ndarray    # (B,)
    o_norm: np.ndarray      # (B,) ||o||, o = sum_K y_k, the head's output
    rank: np.ndarray        # (B, K) rank of each key in the top-N selection order
    s_plus_by_n: np.ndarray # (B, K, D) s_{N,+} at index N-1


class _TopN(NamedTuple):
    """The selection I_N of every instance of a slice and its geometry."""

    n: int
    selected: np.ndarray    # (B, K) I_N
    unselected: np.ndarray  # (B, K) U_N
    sigma: np.ndarray       # (B,) 0 in I_N
    s_plus: np.ndarray      # (B, D) s_{N,+}
    s: np.ndarray           # (B, D) s_N
    diff: np.ndarray        # (B, K, D) y_k - s_N
    D: np.ndarray           # (B, K) ||y_k - s_N||^2


def _topn_slice(alpha, values, att, grid, draw_keys, out):
    has_sink = att[:, 0]
    nonsink = att.copy()
    nonsink[:, 0] = False
    n_att = att.sum(axis=1)
    y = alpha[:, :, None] * values
    v_norm = np.linalg.norm(values, axis=-1)
    order, rank = _ranked(-alpha, att)
    inst = _Instances(
        values=values, y=y, y_norm=np.linalg.norm(y, axis=-1), att=att,
        has_sink=has_sink, o_norm=np.linalg.norm(np.sum(y, axis=1, where=att[:, :, None]), axis=-1),
        rank=rank,
        # s_N is kept as its non-sink part plus the sink, so that s_{N,+} and s_N - y_0 carry
        # no cancellation error when the sink dominates the aggregate.
        s_plus_by_n=_cumulative(np.where(nonsink[:, :, None], y, 0.0), order),
    )
    # Only selections up to the largest valid N need coherence rows (typically K/2 of K).
    rows = int(min(grid.max(initial=1), max(n_att.max(initial=1) - 1, 1)))
    bounds = _SinkBounds(alpha, values, v_norm, nonsink, has_sink, order, rows)

    for g, n in enumerate(grid):
        valid = n < n_att
        if not valid.any():
            continue
        top = _select(inst, n)
        precision, recall, f_score, r_max2 = _ball_scores(top.D, top.selected, att, n)
        results = dict(
            precision=precision, recall=recall, f_score=f_score,
            inversions=_count_pairs_le(top.D, top.unselected, top.D, top.selected),
            sink_selected=top.sigma,
        )
        results.update(_sink_diagnostics(inst, top, r_max2))
        results.update(_leave_one_out(inst, top))
        results.update(_signatures(inst, top))
        certificate, paper = bounds.at(top)
        results.update(certificate)
        _store(out, g, results, valid)
        _store(out, g, paper, valid & bounds.paper_defined)

    _random_control(y, att, n_att, grid, draw_keys, out)
    _sink_excluded(alpha, y, nonsink, grid, out)


def _select(inst, n):
    selected = (inst.rank < n) & inst.att
    sigma = selected[:, 0]
    s_plus = inst.s_plus_by_n[:, n - 1]
    s = s_plus + np.where(sigma[:, None], inst.y[:, 0], 0.0)
    diff = inst.y - s[:, None, :]
    return _TopN(n=n, selected=selected, unselected=inst.att & ~selected, sigma=sigma,
                 s_plus=s_plus, s=s, diff=diff, D=np.einsum("bkd,bkd->bk", diff, diff))


class _SinkBounds:
    """Constants of the sink-aware bounds of one slice (SPEC §3) and their counts at each
    N <= rows."""

    def __init__(self, alpha, values, v_norm, nonsink, has_sink, order, rows):
        self.nonsink, self.has_sink = nonsink, has_sink
        n_ns = nonsink.sum(axis=1)
        C = _padded_quantile(np.where(nonsink, v_norm, -np.inf), n_ns, 0.5)
        unit = _unit(values, v_norm)
        sink_cos = np.einsum("bd,bkd->bk", unit[:, 0], unit)
        c_lo = np.min(sink_cos, axis=1, where=nonsink, initial=np.inf)
        c_hi = np.max(sink_cos, axis=1, where=nonsink, initial=-np.inf)
        q05 = _padded_quantile(np.where(nonsink, sink_cos, -np.inf), n_ns, 0.05)
        q95 = _padded_quantile(np.where(nonsink, sink_cos, -np.inf), n_ns, 0.95)
        self.pair_cos, self.pairs_by_n = _ranked_pairs(unit, nonsink, order, rows)
        self.mu_by_n = np.maximum.accumulate(self.pair_cos.max(axis=2), axis=1)

        # Without a sink the nu's multiply only zero terms; 0 keeps NaN out of that arithmetic.
        def sink_constant(x):
            return np.where(has_sink, x, 0.0)

        self.nu_paper = (sink_constant(np.maximum(0.0, -c_lo)),
                         sink_constant(np.maximum(0.0, -c_hi)))
        self.nu_q95 = (sink_constant(np.maximum(0.0, -q05)), sink_constant(np.maximum(0.0, -q95)))
        self.nu_exact = (sink_constant(-c_lo), sink_constant(-c_hi))
        # lambda = ||v_0||/C needs C > 0: with a sink and C = 0 the paper variant is undefined.
        self.paper_defined = ~has_sink | (C > 0)
        self.beta_paper = alpha.copy()
        self.beta_paper[:, 0] = np.where(has_sink & self.paper_defined,
                                         alpha[:, 0] * v_norm[:, 0] / C, 0.0)
        # The certificate's beta_i = alpha_i ||v_i|| / C; C > 0 only rescales every L by C^2
        # and the tolerance is relative, so it is left out (and C = 0 cannot poison it).
        self.beta_exact = alpha * v_norm

    def at(self, top):
        """Outputs at selection top: those defined everywhere (mu's and the certificate),
        and the paper variant's, defined where paper_defined."""
        n, B = top.n, top.selected.shape[0]
        K = self.pair_cos.shape[2]
        mu = self.mu_by_n[:, n - 1]
        mu = np.where(np.isfinite(mu), mu, np.nan)  # no pair yet: I_N = {sink}
        mu_q95 = _padded_quantile(self.pair_cos[:, :n].reshape(B, n * K),
                                  self.pairs_by_n[:, n - 1], 0.95)
        masks = (top.selected, top.unselected, self.nonsink, self.has_sink)
        k_sink = _k_sink(self.beta_paper, *masks, np.nan_to_num(mu), *self.nu_paper)
        k_sink_q95 = _k_sink(self.beta_paper, *masks, np.nan_to_num(mu_q95), *self.nu_q95)
        k_sink_exact = _k_sink(self.beta_exact, *masks, np.nan_to_num(mu), *self.nu_exact)
        paper = dict(
            k_sink=k_sink, k_sink_q95=k_sink_q95,
            precision_bound=1.0 / (1.0 + k_sink / n),
            recall_bound=np.maximum(0.0, 1.0 - k_sink / n),
            precision_bound_q95=1.0 / (1.0 + k_sink_q95 / n),
            recall_bound_q95=np.maximum(0.0, 1.0 - k_sink_q95 / n),
        )
        return dict(mu=mu, mu_q95=mu_q95, k_sink_exact=k_sink_exact), paper


def _sink_diagnostics(inst, top, r_max2):
    """Appendix "Additional attention sink diagnostics"; NaN where they do not apply."""
    y0 = inst.y[:, 0]
    sink_out = inst.has_sink & ~top.sigma
    sink_beats = np.sum(top.selected & (top.D[:, :1] <= top.D), axis=1) / top.n
    return dict(
        sink_norm_share=np.where(top.sigma, inst.y_norm[:, 0] / np.linalg.norm(top.s, axis=-1),
                                 np.nan),
        sink_direction_change=np.where(top.sigma, 1.0 - _cos(top.s, top.s_plus), np.nan),
        sink_intrusion=np.where(sink_out, top.D[:, 0] <= r_max2, np.nan),
        sink_pair_inversion_frac=np.where(sink_out, sink_beats, np.nan),
        sink_alignment=np.where(inst.has_sink, _cos(y0, top.s_plus), np.nan),
    )


def _leave_one_out(inst, top):
    """Appendix "Leave-one-out control": C_N^loo, M_N^loo, positive fraction, gamma_N^loo."""
    s_norm = np.linalg.norm(top.s, axis=-1)
    # cos(y_i, s_{N,-i}) from <y_i, y_i - s_N> and D_i = ||y_i - s_N||^2, both computed from
    # the difference itself rather than expanded (no cancellation when y_i ~ s_N).
    loo_cos_i = -np.einsum("bkd,bkd->bk", inst.y, top.diff) / (inst.y_norm * np.sqrt(top.D))
    cos_js = np.einsum("bkd,bd->bk", inst.y, top.s) / (inst.y_norm * s_norm[:, None])
    loo_defined = top.selected & np.isfinite(loo_cos_i)
    loo_cos = _masked_mean(loo_cos_i, loo_defined)
    loo_spread = np.linalg.norm(inst.y + top.diff, axis=-1)  # ||y_i - s_{N,-i}|| = ||2 y_i - s_N||
    return dict(
        loo_cos=loo_cos,
        loo_margin=loo_cos - _masked_mean(cos_js, top.unselected & np.isfinite(cos_js)),
        loo_positive_frac=_masked_mean(loo_cos_i > 0, loo_defined),
        loo_distance_margin=(np.sqrt(np.min(top.D, axis=1, where=top.unselected, initial=np.inf))
                             - np.max(loo_spread, axis=1, where=top.selected, initial=-np.inf)),
    )


def _signatures(inst, top):
    """Mechanistic signatures of the head taxonomy (SPEC §4); the current token is K-1."""
    current = np.where(top.selected[:, -1, None], inst.y[:, -1], 0.0)
    return dict(
        s_norm=np.linalg.norm(top.s, axis=-1) / inst.o_norm,
        s_norm_nosink=np.linalg.norm(top.s_plus, axis=-1) / inst.o_norm,
        s_norm_nocurrent=np.linalg.norm(top.s - current, axis=-1) / inst.o_norm,
        cos_s_v0=np.where(inst.has_sink, _cos(top.s, inst.values[:, 0]), np.nan),
        cos_s_vlast=_cos(top.s, inst.values[:, -1]),
    )


def _random_control(y, att, n_att, grid, draw_keys, out):
    """random_precision/recall/f_score: P, R, F of random size-N subsets, mean over draws."""
    totals = np.zeros((3, *out["random_precision"].shape))
    for keys in draw_keys:
        # One random ranking per draw: its first N keys are a uniform size-N subset for every
        # N at once (nested across N within a draw, independent across draws).
        order, rank = _ranked(keys, att)
        s_by_n = _cumulative(y, order)
        for g, n in enumerate(grid):
            if not np.any(n < n_att):
                continue
            selected = (rank < n) & att
            D = _squared_distances(y, s_by_n[:, n - 1])
            totals[:, :, g] += _ball_scores(D, selected, att, n)[:3]
    if len(draw_keys):
        names = ("random_precision", "random_recall", "random_f_score")
        for g, n in enumerate(grid):
            _store(out, g, dict(zip(names, totals[:, :, g] / len(draw_keys))), n < n_att)


def _sink_excluded(alpha, y, nonsink, grid, out):
    """nosink_precision/recall/f_score: selection and balls over K \\ {0}."""
    n_ns = nonsink.sum(axis=1)
    order, rank = _ranked(-alpha, nonsink)
    s_by_n = _cumulative(y, order)
    for g, n in enumerate(grid):
        valid = n < n_ns
        if not valid.any():
            continue
        selected = (rank < n) & nonsink
        D = _squared_distances(y, s_by_n[:, n - 1])
        scores = _ball_scores(D, selected, nonsink, n)[:3]
        names = ("nosink_precision", "nosink_recall", "nosink_f_score")
        _store(out, g, dict(zip(names, scores)), valid)


def _store(out, g, results, valid):
    """Write results into column g of out: where not valid, NaN (floats) or -1 (counts)."""
    for name, x in results.items():
        out[name][:, g] = np.where(valid, x, np.nan if out[name].dtype.kind == "f" else -1)


def _value_statistics_slice(values, att, out):
    B, K, _ = values.shape
    has_sink = att[:, 0]
    nonsink = att.copy()
    nonsink[:, 0] = False
    n_ns = nonsink.sum(axis=1)
    v_norm = np.linalg.norm(values, axis=-1)
    C = _padded_quantile(np.where(nonsink, v_norm, -np.inf), n_ns, 0.5)
    mean = np.sum(v_norm, axis=1, where=nonsink) / n_ns
    var = np.sum((v_norm - mean[:, None]) ** 2, axis=1, where=nonsink) / n_ns

    gram = _gram(_unit(values, v_norm))
    # Each unordered pair once; the median of the ordered pairs is the same.
    pairs = nonsink[:, :, None] & nonsink[:, None, :] & np.triu(np.ones((K, K), dtype=bool), 1)
    median_cos = _padded_quantile(np.where(pairs, gram, -np.inf).reshape(B, K * K),
                                  n_ns * (n_ns - 1) // 2, 0.5)
    sink_cos = np.where(nonsink, gram[:, 0, :], -np.inf)
    sink_quantiles = {q: _padded_quantile(sink_cos, n_ns, q) for q in (0.05, 0.5, 0.95)}
    negative = np.sum(sink_cos < 0, axis=1, where=nonsink) / n_ns

    out["C"][...] = C
    out["norm_cv"][...] = np.sqrt(var) / mean
    out["median_cos"][...] = median_cos
    for name, x in dict(
        sink_norm_ratio=v_norm[:, 0] / C,
        sink_cos_median=sink_quantiles[0.5],
        sink_cos_neg_frac=negative,
        nu_minus_q95=np.maximum(0.0, -sink_quantiles[0.95]),
        nu_plus_q95=np.maximum(0.0, -sink_quantiles[0.05]),
    ).items():
        out[name][...] = np.where(has_sink & (n_ns > 0), x, np.nan)


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
    f = beta**2 - 2 * mu * beta * (a_plus[:, None] - beta) - 2 * sink_weight * nu_plus * beta - tol
    g = beta**2 - 2 * mu * beta * a_plus[:, None] + 2 * sink_weight * nu_minus * beta - tol
    k_pp = _count_pairs_le(g, uns_p, -f, sel_p)
    # With the sink unselected f_i carries no sink term, with it selected g_j carries it.
    l_p0 = f + (beta0**2 - tol0 + 2 * beta0 * nu_minus[:, 0] * a_plus)[:, None]
    l_0p = g + (beta0**2 - tol0 - 2 * beta0 * nu_plus[:, 0] * a_plus)[:, None]
    k_p0 = np.sum(sel_p & (l_p0 <= 0), axis=1)
    k_0p = np.sum(uns_p & (l_0p <= 0), axis=1)
    return k_pp + np.where(sigma, k_0p, np.where(has_sink, k_p0, 0))


def _count_pairs_le(b, b_mask, a, a_mask):
    """#{(i, j): a_mask_i, b_mask_j, b_j <= a_i} per row of (B, K) arrays, in O(K log K).

    One stable merge sort of the concatenation [b, a]: an equal b_j sorts before a_i, so
    the b's preceding each a_i are exactly those with b_j <= a_i.
    """
    merged = np.concatenate([np.where(b_mask, b, 0.0), np.where(a_mask, a, 0.0)], axis=1)
    order = np.argsort(merged, axis=1, kind="stable")
    none = np.zeros_like(a_mask)
    is_b = np.take_along_axis(np.concatenate([b_mask, none], axis=1), order, axis=1)
    is_a = np.take_along_axis(np.concatenate([none, a_mask], axis=1), order, axis=1)
    return np.sum(np.cumsum(is_b, axis=1), axis=1, where=is_a)


def _ball_scores(D, selected, candidates, n):
    """P(r_max, N), R(r_min, N), F and r_max^2 over the candidate keys (closed r_max ball,
    open r_min ball: SPEC §3 "Balls")."""
    r_max2 = np.max(D, axis=1, where=selected, initial=-np.inf)
    r_min2 = np.min(D, axis=1, where=candidates & ~selected, initial=np.inf)
    precision = n / np.sum(candidates & (D <= r_max2[:, None]), axis=1)
    recall = np.sum(selected & (D < r_min2[:, None]), axis=1) / n
    f_score = np.where(precision + recall > 0,
                       2 * precision * recall / (precision + recall), 0.0)
    return precision, recall, f_score, r_max2


def _ranked_pairs(unit, nonsink, order, rows):
    """|<u_p, u_q>| of the non-sink pairs, rows and columns in selection order, each unordered
    pair once (row rank < column rank), other entries -inf, for the first `rows` ranks:
    (B, rows, K); and the pair counts by N (B, rows).

    The pairs with at least one key in I_N are then exactly rows < N: the coherence
    constants of every N are prefixes of one array.
    """
    K = unit.shape[1]
    ranked_unit = np.take_along_axis(unit, order[:, :, None], axis=1)
    ranked = np.abs(ranked_unit[:, :rows] @ np.ascontiguousarray(ranked_unit.transpose(0, 2, 1)))
    ok = np.take_along_axis(nonsink, order, axis=1)
    pairs = ok[:, :rows, None] & ok[:, None, :] & np.triu(np.ones((rows, K), dtype=bool), 1)
    np.copyto(ranked, -np.inf, where=~pairs)
    return ranked, np.cumsum(pairs.sum(axis=2), axis=1)


def _padded_quantile(x, m, q):
    """q-quantile (numpy's default 'linear' method) of the m valid entries of each row of
    x (B, M), the other M - m entries being -inf; NaN where m = 0.

    The m valid entries are the top m of the row, so only the two order statistics around
    position q (m - 1) are needed: a partition, not a sort.
    """
    M = x.shape[1]
    m = np.asarray(m, dtype=np.int64)
    has = m > 0
    last = np.maximum(m - 1, 0)
    pos = q * last
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, last)
    lo_idx = np.where(has, M - m + lo, 0)
    hi_idx = np.where(has, M - m + hi, 0)
    kth = np.unique(np.concatenate([lo_idx[has], hi_idx[has]]))
    if kth.size == 0:
        return np.full(x.shape[0], np.nan)
    part = np.partition(x, kth, axis=1)
    below = np.where(has, np.take_along_axis(part, lo_idx[:, None], axis=1)[:, 0], 0.0)
    above = np.where(has, np.take_along_axis(part, hi_idx[:, None], axis=1)[:, 0], 0.0)
    return np.where(has, below + (pos - lo) * (above - below), np.nan)


def _ranked(key, candidates):
    """Order (B, K) of the candidates by ascending key, ties to the smaller position, other
    keys last; and each key's rank in it."""
    order = np.argsort(np.where(candidates, key, np.inf), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :], axis=1)
    return order, rank


def _cumulative(y, order):
    """(B, K, D): entry n-1 is the sum of y over the first n keys of order."""
    return np.cumsum(np.take_along_axis(y, order[:, :, None], axis=1), axis=1)


def _squared_distances(y, s):
    diff = y - s[:, None, :]
    return np.einsum("bkd,bkd->bk", diff, diff)


def _unit(values, v_norm):
    """u = v/||v||, and u = 0 for v = 0."""
    return values / np.where(v_norm > 0, v_norm, 1.0)[:, :, None]


def _gram(x):
    """(B, K, K) inner products of the rows of x (B, K, D)."""
    # A contiguous right operand lets matmul use BLAS on every matrix (several times faster).
    return x @ np.ascontiguousarray(x.transpose(0, 2, 1))


def _cos(a, b):
    """Cosine of (B, D) vectors, NaN where either is 0."""
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.where(norms > 0, np.einsum("bd,bd->b", a, b) / norms, np.nan)


def _masked_mean(x, mask):
    """Row means of x over mask, NaN for an empty mask."""
    count = mask.sum(axis=1)
    return np.where(count > 0, np.sum(x, axis=1, where=mask) / count, np.nan)


def _batch_slices(B, K):
    step = max(1, _GRAM_BUDGET // (K * K))
    return [slice(start, start + step) for start in range(0, B, step)] or [slice(0, 0)]


def _check_batch(attn, values, attendable):
    values = np.asarray(values, dtype=np.float64)
    attendable = np.asarray(attendable, dtype=bool)
    if values.ndim != 3 or values.shape[1] < 1:
        raise ValueError(f"values must have shape (B, K, D) with K >= 1, got {values.shape}")
    if attendable.shape != values.shape[:2]:
        raise ValueError(f"attendable has shape {attendable.shape}, expected {values.shape[:2]}")
    if attn is None:
        return None, values, attendable
    attn = np.asarray(attn, dtype=np.float64)
    if attn.shape != values.shape[:2]:
        raise ValueError(f"attn has shape {attn.shape}, expected {values.shape[:2]}")
    return attn, values, attendable
