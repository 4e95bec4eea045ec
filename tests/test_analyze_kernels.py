"""Tests of attngeom.analyze.kernels against a brute-force twin written from the definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngeom.analyze.kernels import (
    DEFAULT_SETTINGS,
    TOPN_FLOATS,
    KernelSettings,
    balls,
    bounds,
    compile_kernels,
    head_metrics,
    pairs,
    selection,
    topn_metrics,
    value_statistics,
)
from attngeom.analyze.kernels import values as kv_values

RTOL, ATOL = 1e-9, 1e-12
COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact", "sink_selected", "learned_sink_selected")


# ---------------------------------------------------------------- brute-force twin


def _unit(v):
    n = np.linalg.norm(v)
    return v / n if n > 0 else np.zeros_like(v)


def _cos(a, b):
    n = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / n) if n > 0 else math.nan


def _scores(I, U, candidates, y, s):
    """P(r_max), R(r_min), F from explicit balls around s."""
    D = {k: float(np.sum((y[k] - s) ** 2)) for k in candidates}
    r_max2 = max(D[i] for i in I)
    r_min2 = min(D[j] for j in U)
    in_closed_ball = [k for k in candidates if D[k] <= r_max2]
    in_open_ball = [i for i in I if D[i] < r_min2]
    P = len(I) / len(in_closed_ball)
    R = len(in_open_ball) / len(I)
    F = 2 * P * R / (P + R) if P + R > 0 else 0.0
    return P, R, F


def _brute_k_sink(beta, I, U, has_sink, mu, nu_plus, nu_minus):
    """K_N^sink by evaluating L for every selected-unselected pair (appendix proof)."""
    mu = 0.0 if math.isnan(mu) else mu
    S_plus = [i for i in I if i != 0]
    U_plus = [j for j in U if j != 0]
    sigma = has_sink and 0 in I
    b0 = beta[0] if has_sink else 0.0
    A_plus = sum(beta[i] for i in S_plus)
    A = A_plus + b0

    def tol(bi, bj):
        return DEFAULT_SETTINGS.l_rtol * ((bi + A) ** 2 + (bj + A) ** 2)

    count = 0
    for i in S_plus:
        for j in U_plus:
            L = (beta[i] ** 2 + beta[j] ** 2
                 - 2 * mu * (beta[i] * (A_plus - beta[i]) + beta[j] * A_plus))
            if sigma:
                L += 2 * b0 * (nu_minus * beta[j] - nu_plus * beta[i])
            count += L <= tol(beta[i], beta[j])
    if has_sink and not sigma:
        for i in S_plus:
            L = (beta[i] ** 2 + b0**2 - 2 * mu * beta[i] * (A_plus - beta[i])
                 + 2 * b0 * nu_minus * A_plus)
            count += L <= tol(beta[i], b0)
    if sigma:
        for j in U_plus:
            L = (b0**2 + beta[j] ** 2 - 2 * b0 * nu_plus * A_plus
                 + 2 * beta[j] * b0 * nu_minus - 2 * mu * beta[j] * A_plus)
            count += L <= tol(b0, beta[j])
    return count


def _brute_instance(alpha, v, att, grid, keys, virtual=False):
    """One instance from the definitions; virtual: key 1 is the learned sink's virtual key (a
    zero value that is no value of the model's: not in C, the cosines or mu; beta 0)."""
    Kn = len(alpha)
    Kset = [k for k in range(Kn) if att[k]]
    has_sink = bool(att[0])
    nonsink = [k for k in Kset if k != 0]
    real = [k for k in nonsink if not (virtual and k == 1)]
    y = {k: alpha[k] * v[k] for k in range(Kn)}
    u = {k: _unit(v[k]) for k in range(Kn)}
    C = float(np.median([np.linalg.norm(v[k]) for k in real])) if real else math.nan
    o = sum(y[k] for k in Kset)
    sink_cos = [float(u[0] @ u[k]) for k in real]
    rows = []
    for N in grid:
        r = {}
        if N < len(Kset):
            order = sorted(Kset, key=lambda k: (-alpha[k], k))
            I = order[:N]
            U = [k for k in Kset if k not in I]
            s = sum(y[i] for i in I)
            D = {k: float(np.sum((y[k] - s) ** 2)) for k in Kset}
            r["precision"], r["recall"], r["f_score"] = _scores(I, U, Kset, y, s)
            r["inversions"] = sum(1 for i in I for j in U if D[j] <= D[i])
            r["sink_selected"] = int(0 in I and has_sink)
            if virtual:
                r["learned_sink_selected"] = int(1 in I)

            pairs = {frozenset((p, q)) for p in I if p in real for q in real if q != p}
            cosines = [abs(float(u[p] @ u[q])) for p, q in map(tuple, pairs)]
            r["mu"] = max(cosines) if cosines else math.nan
            r["mu_q95"] = float(np.quantile(cosines, 0.95)) if cosines else math.nan
            if has_sink:
                c_lo, c_hi = min(sink_cos), max(sink_cos)
                q05, q95 = np.quantile(sink_cos, [0.05, 0.95])
            else:
                c_lo = c_hi = q05 = q95 = math.nan
            beta = {k: alpha[k] for k in Kset}
            if virtual:
                beta[1] = 0.0
            if has_sink and C > 0:
                beta[0] = np.linalg.norm(v[0]) / C * alpha[0]
            # C > 0 only rescales L; with C = 0 (all-zero values) keep the unscaled weights.
            scale = C if C > 0 else 1.0
            beta_exact = {k: alpha[k] * np.linalg.norm(v[k]) / scale for k in Kset}
            r["k_sink_exact"] = _brute_k_sink(beta_exact, I, U, has_sink, r["mu"], -c_lo, -c_hi)
            if not has_sink or C > 0:  # lambda = ||v_0|| / C
                r["k_sink"] = _brute_k_sink(beta, I, U, has_sink, r["mu"],
                                            max(0, -c_lo), max(0, -c_hi))
                r["k_sink_q95"] = _brute_k_sink(beta, I, U, has_sink, r["mu_q95"],
                                                max(0, -q05), max(0, -q95))
                for suffix in ("", "_q95"):
                    k = r["k_sink" + suffix]
                    r["precision_bound" + suffix] = 1 / (1 + k / N)
                    r["recall_bound" + suffix] = max(0.0, 1 - k / N)

            draws = []
            for d in range(len(keys)):
                random_I = sorted(Kset, key=lambda k: (keys[d][k], k))[:N]
                random_U = [k for k in Kset if k not in random_I]
                draws.append(_scores(random_I, random_U, Kset, y, sum(y[i] for i in random_I)))
            if draws:
                mean = np.mean(draws, axis=0)
                r["random_precision"], r["random_recall"], r["random_f_score"] = mean

            sigma = 0 in I and has_sink
            s_plus = sum((y[i] for i in I if i != 0), np.zeros_like(s))
            if sigma:
                r["sink_norm_share"] = np.linalg.norm(y[0]) / np.linalg.norm(s)
                r["sink_direction_change"] = 1 - _cos(s, s - y[0])
            if has_sink and not sigma:
                r["sink_intrusion"] = float(D[0] <= max(D[i] for i in I))
                r["sink_pair_inversion_frac"] = sum(D[0] <= D[i] for i in I) / N
            if has_sink:
                r["sink_alignment"] = _cos(y[0], s_plus)

            s_minus = {i: sum((y[k] for k in I if k != i), np.zeros_like(s)) for i in I}
            loo = [_cos(y[i], s_minus[i]) for i in I]
            loo = [c for c in loo if not math.isnan(c)]
            uns = [c for c in (_cos(y[j], s) for j in U) if not math.isnan(c)]
            if loo:
                r["loo_cos"] = float(np.mean(loo))
                r["loo_positive_frac"] = sum(c > 0 for c in loo) / len(loo)
                if uns:
                    r["loo_margin"] = r["loo_cos"] - float(np.mean(uns))
            r["loo_distance_margin"] = (min(np.linalg.norm(y[j] - s) for j in U)
                                        - max(np.linalg.norm(y[i] - s_minus[i]) for i in I))

            o_norm = np.linalg.norm(o)
            r["s_norm"] = np.linalg.norm(s) / o_norm
            r["s_norm_nosink"] = np.linalg.norm(s - (y[0] if sigma else 0)) / o_norm
            r["s_norm_nocurrent"] = np.linalg.norm(s - (y[Kn - 1] if Kn - 1 in I else 0)) / o_norm
            if has_sink:
                r["cos_s_v0"] = _cos(s, v[0])
            r["cos_s_vlast"] = _cos(s, v[Kn - 1])
        if N < len(nonsink):
            order = sorted(nonsink, key=lambda k: (-alpha[k], k))
            I, U = order[:N], order[N:]
            r["nosink_precision"], r["nosink_recall"], r["nosink_f_score"] = _scores(
                I, U, nonsink, y, sum(y[i] for i in I))
        rows.append(r)
    return rows


def brute_topn(attn, values, attendable, grid, seed=0, random_draws=8, learned_sink=None):
    """learned_sink (B,): the sink enters as key 1 with a zero value (docs/method.md#learned-sinks)."""
    if learned_sink is not None:
        attn = np.insert(attn, 1, learned_sink, axis=1)
        values = np.insert(values, 1, 0.0, axis=1)
        attendable = np.insert(attendable, 1, True, axis=1)
    B, K, _ = values.shape
    keys = np.random.default_rng(seed).random((random_draws, B, K))
    out = {name: np.full((B, len(grid)), np.nan) for name in TOPN_FLOATS}
    out.update({name: np.full((B, len(grid)), -1) for name in COUNTS})
    for b in range(B):
        with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 norms: NaN by definition
            rows = _brute_instance(attn[b], values[b], attendable[b], grid, keys[:, b],
                                   virtual=learned_sink is not None)
        for g, r in enumerate(rows):
            for name, x in r.items():
                out[name][b, g] = x
    return out


def brute_value_statistics(values, attendable):
    rows = []
    for v, att in zip(values, attendable):
        nonsink = [k for k in range(len(att)) if att[k] and k != 0]
        norms = np.array([np.linalg.norm(v[k]) for k in nonsink])
        u = {k: _unit(v[k]) for k in range(len(att))}
        pair_cos = [u[p] @ u[q] for p in nonsink for q in nonsink if p != q]
        r = dict(C=np.median(norms), norm_cv=norms.std() / norms.mean(),
                 median_cos=np.median(pair_cos) if pair_cos else np.nan)
        if att[0]:
            sink_cos = np.array([u[0] @ u[k] for k in nonsink])
            r.update(sink_norm_ratio=np.linalg.norm(v[0]) / r["C"],
                     sink_cos_median=np.median(sink_cos), sink_cos_neg_frac=np.mean(sink_cos < 0),
                     nu_minus_q95=max(0, -np.quantile(sink_cos, 0.95)),
                     nu_plus_q95=max(0, -np.quantile(sink_cos, 0.05)))
        rows.append(r)
    names = rows[0].keys() | {"sink_norm_ratio", "sink_cos_median", "sink_cos_neg_frac",
                              "nu_minus_q95", "nu_plus_q95"}
    return {name: np.array([r.get(name, np.nan) for r in rows]) for name in names}


# ---------------------------------------------------------------- synthetic batches


def make_batch(rng, B, K, D, *, window=None, tie_decimals=None, zero_frac=0.0, drop_sink_frac=0.0):
    """Attention rows with a boosted sink, values of unequal norms, the sink small and opposed."""
    attendable = np.ones((B, K), dtype=bool)
    if window is not None:
        attendable[: B // 2, : K - window] = False  # sliding-window rows: no sink
    attendable[rng.random(B) < drop_sink_frac, 0] = False
    logits = rng.normal(size=(B, K)) * 1.5
    logits[:, 0] += rng.uniform(0, 4, size=B)
    logits[:, -1] += rng.uniform(0, 3, size=B)
    alpha = np.where(attendable, np.exp(logits), 0.0)
    alpha /= alpha.sum(axis=1, keepdims=True)
    if tie_decimals is not None:
        alpha = np.round(alpha, tie_decimals)
    alpha[(rng.random((B, K)) < zero_frac) & attendable] = 0.0
    values = rng.normal(size=(B, K, D)) * rng.lognormal(0, 0.4, size=(B, K, 1))
    values[:, 0] = -0.3 * values[:, 1:].mean(axis=1) + 0.1 * rng.normal(size=(B, D))
    return alpha, values, attendable


CASES = {
    "plain": dict(B=6, K=12, D=4),
    "ties": dict(B=6, K=10, D=3, tie_decimals=1),
    "ties_and_zeros": dict(B=6, K=11, D=3, tie_decimals=2, zero_frac=0.3),
    "window": dict(B=6, K=14, D=4, window=6),
    "no_sink": dict(B=6, K=9, D=5, drop_sink_frac=0.5),
    "zeros": dict(B=5, K=12, D=2, zero_frac=0.4),
    "tiny": dict(B=4, K=2, D=2),
    "three": dict(B=4, K=3, D=1),
    "scalar_values": dict(B=5, K=10, D=1, tie_decimals=1),
}


def _assert_same(got, want, names):
    for name in names:
        if name in COUNTS:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_topn_matches_brute_force(case):
    rng = np.random.default_rng(sorted(CASES).index(case))
    params = dict(CASES[case])
    B, K, D = params.pop("B"), params.pop("K"), params.pop("D")
    alpha, values, attendable = make_batch(rng, B, K, D, **params)
    grid = list(range(1, K + 1))  # every N, up to |K|-1 and beyond
    got = topn_metrics(alpha, values, attendable, grid, seed=5, random_draws=3)
    want = brute_topn(alpha, values, attendable, grid, seed=5, random_draws=3)
    assert set(got) == set(want)
    for name in COUNTS:
        assert got[name].shape == (B, K)
        assert got[name].dtype.kind == "i"
    _assert_same(got, want, want)


def _with_learned_sink(rng, alpha, attendable, *, strong=False):
    """Rows rescaled to 1 - s with a learned sink s per row: s above every key's weight
    (strong), or spread over (0, 0.7) with a few rows tying the sink with key 1's weight."""
    B = alpha.shape[0]
    if strong:
        s = rng.uniform(0.6, 0.95, size=B)
        return alpha * (1 - s)[:, None], s
    s = rng.uniform(0.0, 0.7, size=B)
    alpha = alpha * (1 - s)[:, None]
    tied = rng.random(B) < 0.3
    s[tied] = alpha[tied, 1]
    return alpha, s


@pytest.mark.parametrize("case", ["plain", "ties_and_zeros", "window", "no_sink", "tiny"])
@pytest.mark.parametrize("strong", [False, True], ids=["weak", "strong"])
def test_learned_sink_is_a_virtual_key_with_a_zero_value(case, strong):
    """With learned sinks every top-N output is the brute force's on the rows with a key of
    weight s and value 0 inserted after key 0, that key left out of C, the cosines and mu,
    with beta 0; the value statistics are those of the real keys."""
    rng = np.random.default_rng(40 + sorted(CASES).index(case))
    params = dict(CASES[case])
    B, K, D = params.pop("B"), params.pop("K"), params.pop("D")
    alpha, values, attendable = make_batch(rng, B, K, D, **params)
    alpha, sink = _with_learned_sink(rng, alpha, attendable, strong=strong)
    grid = list(range(1, K + 2))
    got, stats = head_metrics(alpha, values, attendable, grid, learned_sink=sink, seed=6, random_draws=3)
    want = brute_topn(alpha, values, attendable, grid, seed=6, random_draws=3, learned_sink=sink)
    _assert_same(got, want, want)
    want_stats = value_statistics(values, attendable)
    for name in want_stats:
        np.testing.assert_array_equal(stats[name], want_stats[name], err_msg=name)
    if strong:  # the sink outweighs every key: I_1 = {sink}, s_1 = 0, and it is separable
        no_zero_y = np.all((alpha > 0) & (np.linalg.norm(values, axis=2) > 0) | ~attendable, axis=1)
        assert np.all(got["precision"][:, 0][no_zero_y] == 1.0)
        np.testing.assert_array_equal(got["s_norm"][:, 0], 0.0)
        np.testing.assert_array_equal(got["learned_sink_selected"][:, 0], 1)
        np.testing.assert_array_equal(got["recall"][:, 0][no_zero_y], 1.0)


def test_learned_sink_shared_by_query_heads_matches_brute_force():
    alpha, values, attendable, head_kv = _gqa_case("window_ties_repeats")
    rng = np.random.default_rng(7)
    alpha, sink = _with_learned_sink(rng, alpha, attendable[head_kv])
    grid = list(range(1, alpha.shape[1] + 2))
    got = topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, learned_sink=sink, seed=3, random_draws=2)
    want = brute_topn(alpha, values[head_kv], attendable[head_kv], grid, seed=3, random_draws=2, learned_sink=sink)
    _assert_same(got, want, want)


def test_topn_matches_brute_force_at_a_longer_context():
    rng = np.random.default_rng(11)
    alpha, values, attendable = make_batch(rng, 4, 96, 8, window=64)
    grid = [1, 2, 4, 8, 16, 32, 48, 63, 95]
    got = topn_metrics(alpha, values, attendable, grid, seed=2, random_draws=2)
    _assert_same(got, brute_topn(alpha, values, attendable, grid, seed=2, random_draws=2), got)


@pytest.mark.parametrize("case", ["plain", "window", "no_sink", "tiny"])
def test_value_statistics_match_brute_force(case):
    rng = np.random.default_rng(1)
    params = dict(CASES[case])
    B, K, D = params.pop("B"), params.pop("K"), params.pop("D")
    _, values, attendable = make_batch(rng, B, K, D, **params)
    got = value_statistics(values, attendable)
    want = brute_value_statistics(values, attendable)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == (B,)
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_an_instance_does_not_depend_on_its_batch():
    """Each query head is computed alone: a batch of one gives its row of the batch, bit for
    bit (without the random control, whose draws are drawn for the whole batch)."""
    rng = np.random.default_rng(7)
    alpha, values, attendable = make_batch(rng, 7, 16, 4, window=10)
    grid = [1, 2, 4, 8, 15]
    whole = topn_metrics(alpha, values, attendable, grid, seed=3, random_draws=0)
    for b in range(7):
        one = topn_metrics(alpha[b:b + 1], values[b:b + 1], attendable[b:b + 1], grid, seed=3,
                           random_draws=0)
        for name in whole:
            np.testing.assert_array_equal(one[name][0], whole[name][b], err_msg=name)


def test_empty_batch_and_invalid_n():
    out = topn_metrics(np.zeros((0, 5)), np.zeros((0, 5, 3)), np.ones((0, 5), bool), [1, 2])
    assert out["precision"].shape == (0, 2)
    rng = np.random.default_rng(0)
    alpha, values, attendable = make_batch(rng, 2, 4, 2)
    out = topn_metrics(alpha, values, attendable, [4, 9])
    assert np.isnan(out["precision"]).all() and (out["inversions"] == -1).all()
    assert (out["sink_selected"] == -1).all()
    with pytest.raises(ValueError):
        topn_metrics(alpha, values, attendable, [0])
    with pytest.raises(ValueError):
        topn_metrics(alpha[:, :3], values, attendable, [1])
    with pytest.raises(ValueError):  # more keys than the loops index pairs of (int32)
        value_statistics(np.zeros((1, (1 << 16) + 1, 1)), np.ones((1, (1 << 16) + 1), bool))


# ---------------------------------------------------------------- properties


@st.composite
def instances(draw):
    """Small batches on a coarse lattice: exact ties in alpha, in D and in L are common."""
    B = draw(st.integers(1, 3))
    K = draw(st.integers(2, 9))
    D = draw(st.integers(1, 3))
    lattice = st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0])
    alpha = np.array(draw(st.lists(lattice, min_size=B * K, max_size=B * K))).reshape(B, K)
    # A few lattice directions scaled by powers of 2: parallel values whose contributions
    # coincide exactly, the case where the certificate's L is 0 up to rounding.
    coords = st.integers(-3, 3).map(float)
    vectors = st.lists(coords, min_size=D, max_size=D)
    directions = np.array(draw(st.lists(vectors, min_size=1, max_size=3)))
    which = draw(st.lists(st.integers(0, len(directions) - 1), min_size=B * K, max_size=B * K))
    scale = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=B * K, max_size=B * K))
    values = (directions[which] * np.array(scale)[:, None]).reshape(B, K, D)
    window = draw(st.integers(2, K))
    attendable = np.zeros((B, K), dtype=bool)
    attendable[:, K - window:] = True
    attendable[:, 0] |= draw(st.booleans())
    alpha[~attendable] = 0.0
    return alpha, values, attendable


PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(instances())
def test_inversions_bound_precision_recall_and_certificate(batch):
    alpha, values, attendable = batch
    K = alpha.shape[1]
    grid = np.arange(1, K)
    out = topn_metrics(alpha, values, attendable, grid, random_draws=1)
    valid = out["inversions"] >= 0
    A = out["inversions"][valid]
    N = np.broadcast_to(grid, valid.shape)[valid]
    assert np.all(A <= out["k_sink_exact"][valid])
    assert np.all(out["precision"][valid] >= N / (N + A) - 1e-12)
    assert np.all(out["recall"][valid] >= 1 - A / N - 1e-12)
    paper = out["k_sink"] >= 0
    N = np.broadcast_to(grid, valid.shape)[paper]
    assert np.all(out["precision_bound"][paper] == 1 / (1 + out["k_sink"][paper] / N))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_lattice_instances_match_brute_force(batch):
    alpha, values, attendable = batch
    grid = list(range(1, alpha.shape[1] + 1))
    got = topn_metrics(alpha, values, attendable, grid, seed=1, random_draws=2)
    _assert_same(got, brute_topn(alpha, values, attendable, grid, seed=1, random_draws=2), got)


@PROPERTY
@given(instances())
def test_extremal_balls_are_trivial(batch):
    """R(r_max, N) = 1 and P(r_min, N) = 1 with the closed/open ball convention, at the
    kernel's selection and distances."""
    alpha, values, attendable = batch
    B, K, _ = values.shape
    y = alpha[:, :, None] * values
    for b in range(B):
        rank = selection.ranked(-alpha[b], attendable[b])[1]
        Kset = [k for k in range(K) if attendable[b, k]]
        for N in range(1, len(Kset)):
            I = [k for k in Kset if rank[k] < N]
            U = [k for k in Kset if k not in I]
            s = y[b, I].sum(axis=0)
            D = np.einsum("kd,kd->k", y[b] - s, y[b] - s)
            r_max2, r_min2 = max(D[I]), min(D[U])
            assert sum(D[i] <= r_max2 for i in I) / N == 1  # R(r_max, N)
            ball = [k for k in Kset if D[k] < r_min2]
            assert all(k in I for k in ball)  # P(r_min, N) = 1 (or the ball is empty)


@PROPERTY
@given(instances(), st.integers(0, 2**32 - 1))
def test_paper_bound_holds_under_its_assumptions(batch, seed):
    """Equal non-sink norms and a sink opposed to every non-sink direction (nu^- >= 0)
    are the paper's assumptions; then inversions <= k_sink."""
    alpha, _, attendable = batch
    B, K = alpha.shape
    rng = np.random.default_rng(seed)
    values = np.abs(rng.normal(size=(B, K, 3)))
    values /= np.linalg.norm(values, axis=-1, keepdims=True)
    values[:, 0] *= -rng.uniform(0.1, 2.0, size=(B, 1))
    out = topn_metrics(alpha, values, attendable, np.arange(1, K), random_draws=0)
    valid = out["inversions"] >= 0
    assert np.all(out["inversions"][valid] <= out["k_sink"][valid])


# ---------------------------------------------------------------- known answers


def test_orthogonal_unit_values_are_perfectly_separable():
    # D_i = ||s||^2 - alpha_i^2 for i in I_N and D_j = ||s||^2 + alpha_j^2 otherwise.
    alpha = np.array([[0.3, 0.25, 0.2, 0.15, 0.1]])
    values = np.eye(5)[None]
    attendable = np.ones((1, 5), bool)
    grid = [1, 2, 3, 4]
    out = topn_metrics(alpha, values, attendable, grid)
    for name in ("precision", "recall", "f_score", "precision_bound", "recall_bound"):
        np.testing.assert_array_equal(out[name], 1.0, err_msg=name)
    for name in ("inversions", "k_sink", "k_sink_exact", "mu", "loo_cos", "loo_margin",
                 "loo_positive_frac"):
        np.testing.assert_array_equal(out[name][0, 1:], 0, err_msg=name)
    assert np.isnan(out["loo_cos"][0, 0])  # N = 1: s_N - y_i = 0
    s2 = np.cumsum(alpha[0] ** 2)[:4]
    np.testing.assert_allclose(out["s_norm"][0], np.sqrt(s2 / np.sum(alpha**2)))
    # ||y_i - s_{N,-i}||^2 = ||s_N||^2; the nearest unselected key has the smallest alpha, 0.1.
    np.testing.assert_allclose(out["loo_distance_margin"][0], np.sqrt(s2 + 0.1**2) - np.sqrt(s2))
    np.testing.assert_array_equal(out["sink_selected"][0], 1)
    np.testing.assert_allclose(out["sink_norm_share"][0], 0.3 / np.sqrt(s2))


def test_unequal_norms_violate_the_paper_bound_but_not_the_certificate():
    # Key 2 has twice the norm of key 1 and half its attention: y_2 = y_1 = s_1, so the
    # unselected key 2 ties the selected key 1 at distance 0 (one inversion, P = 1/2, R = 0).
    # With beta = alpha the paper's L^{++}_{12} = 0.6^2 + 0.3^2 - 2 * 0.3 * 0.6 = 0.09 > 0
    # misses it; the certificate's L^{++}_{12} = 0.6^2 + 0.6^2 - 2 * 0.6 * 0.6 = 0 exactly.
    alpha = np.array([[0.1, 0.6, 0.3]])
    values = np.array([[[0.0, 1.0], [1.0, 0.0], [2.0, 0.0]]])
    out = topn_metrics(alpha, values, np.ones((1, 3), bool), [1, 2])
    assert out["inversions"][0, 0] == 1
    assert out["k_sink"][0, 0] == 0
    assert out["k_sink_exact"][0, 0] == 1
    assert np.sum(out["inversions"] > out["k_sink"]) == 1
    assert (out["precision"][0, 0], out["recall"][0, 0], out["f_score"][0, 0]) == (0.5, 0.0, 0.0)
    assert out["precision_bound"][0, 0] == 1.0  # the violated "bound"
    # N = 2: s = 1.2 e_1, D = (1.45, 0.36, 0.36): separable again.
    assert (out["precision"][0, 1], out["recall"][0, 1], out["inversions"][0, 1]) == (1.0, 1.0, 0)


def test_certificate_survives_rounding_at_an_exact_tie():
    # As above with v_1 = w, v_2 = 2 w: y_1 = y_2 exactly, an inversion at N = 1 whose
    # certificate L = 0 in exact arithmetic; for w = (1, 3, 3) the computed <u_1, u_2> is
    # 1 - 4e-16, so L rounds to +1e-16 and only the tie tolerance keeps the pair counted.
    w = np.array([1.0, 3.0, 3.0])
    alpha = np.array([[0.1, 0.6, 0.3]])
    values = np.array([[[3.0, -1.0, 0.0], w, 2 * w]])
    out = topn_metrics(alpha, values, np.ones((1, 3), bool), [1])
    assert out["inversions"][0, 0] == 1
    assert out["k_sink_exact"][0, 0] == 1


def test_unselected_sink_intrusion():
    # 1-D contributions y = (0.05, 0.5, 0.3, -0.2): at N = 2, s = 0.8 and
    # D = (0.5625, 0.09, 0.25, 1.0); at N = 1, s = 0.5, D = (0.2025, 0, 0.04, 0.49): the
    # unselected sink lies outside the r_max ball. At N = 3, s = 0.6, D = (0.3025, 0.01, 0.09,
    # 0.64): it intrudes, beats key 3, and bounds the open r_min ball, which loses key 3.
    alpha = np.array([[0.05, 0.5, 0.3, 0.2]])
    values = np.array([[[1.0], [1.0], [1.0], [-1.0]]])
    out = topn_metrics(alpha, values, np.ones((1, 4), bool), [1, 2, 3])
    np.testing.assert_array_equal(out["sink_selected"][0], [0, 0, 0])
    np.testing.assert_array_equal(out["sink_intrusion"][0], [0.0, 0.0, 1.0])
    np.testing.assert_allclose(out["recall"][0], [1.0, 1.0, 2 / 3])
    np.testing.assert_allclose(out["precision"][0], [1.0, 1.0, 3 / 4])
    np.testing.assert_array_equal(out["inversions"][0], [0, 0, 1])
    np.testing.assert_allclose(out["sink_alignment"][0], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(out["sink_pair_inversion_frac"][0], [0.0, 0.0, 1 / 3])


def test_unselected_sink_tying_the_selected_keys():
    # Dyadic, so exact: y = ((.5, 0), (0, .5), (.5, 0), (0, -.0625)). At N = 2, s = (.5, .5)
    # and D_0 = D_1 = D_2 = 0.25: the unselected sink ties both selected keys (closed ball:
    # it intrudes, two inversions, P = 2/3; open ball: R = 0).
    alpha = np.array([[0.125, 0.5, 0.25, 0.0625]])
    values = np.array([[[4.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, -1.0]]])
    out = topn_metrics(alpha, values, np.ones((1, 4), bool), [2])
    assert out["sink_selected"][0, 0] == 0
    assert out["sink_intrusion"][0, 0] == 1.0
    assert out["sink_pair_inversion_frac"][0, 0] == 1.0
    assert out["inversions"][0, 0] == 2 <= out["k_sink_exact"][0, 0]
    assert (out["precision"][0, 0], out["recall"][0, 0]) == (2 / 3, 0.0)


# ---------------------------------------------------------------- grouped-query batches


def make_gqa_batch(rng, H, G, K, D, *, window=None, tie_decimals=None, repeats=0.0, zeros=0.0,
                   no_sink=False):
    """H query heads over G kv heads (head_kv = h * G // H), adversarial on request: alpha
    rounded to ties, repeated value vectors, zero vectors, a sliding window, no sink."""
    head_kv = np.arange(H) * G // H
    attendable = np.ones((G, K), dtype=bool)
    if window is not None:
        attendable[:, : K - window] = False
    if no_sink:
        attendable[:, 0] = False
    att = attendable[head_kv]
    logits = rng.normal(size=(H, K)) * 1.5
    logits[:, 0] += rng.uniform(0, 4, size=H)
    alpha = np.where(att, np.exp(logits), 0.0)
    alpha /= alpha.sum(axis=1, keepdims=True)
    if tie_decimals is not None:
        alpha = np.round(alpha, tie_decimals)
    values = rng.normal(size=(G, K, D)) * rng.lognormal(0, 0.4, size=(G, K, 1))
    values[:, 0] = -0.3 * values[:, 1:].mean(axis=1)
    for g in range(G):
        copies = rng.random(K) < repeats
        values[g, copies] = values[g, rng.integers(0, K, size=copies.sum())]
        values[g, rng.random(K) < zeros] = 0.0
    return alpha, values, attendable, head_kv


GQA_CASES = {
    "random": dict(H=6, G=2, K=14, D=3),
    "ties": dict(H=4, G=2, K=12, D=2, tie_decimals=1),
    "repeated_values": dict(H=6, G=3, K=12, D=2, repeats=0.5),
    "zero_values": dict(H=4, G=2, K=12, D=3, zeros=0.3, tie_decimals=2),
    "window": dict(H=4, G=1, K=16, D=4, window=7),
    "window_ties_repeats": dict(H=4, G=2, K=14, D=2, window=9, tie_decimals=1, repeats=0.4),
    "no_sink": dict(H=3, G=1, K=10, D=3, no_sink=True, repeats=0.3),
}


def _gqa_case(case):
    rng = np.random.default_rng(100 + sorted(GQA_CASES).index(case))
    params = dict(GQA_CASES[case])
    return make_gqa_batch(rng, params.pop("H"), params.pop("G"), params.pop("K"), params.pop("D"),
                          **params)


# Every exact fallback taken: the top-pair list holds almost nothing, every quantile comes from
# a sampled bracket, no distance is settled by its expansion, and the Gram matrix is float64.
NO_SHORTCUTS = KernelSettings(top_pair_min=0, top_pair_share=1e-3, bracket_min=8, tiny=1e300, float32_gram=False)


@pytest.mark.parametrize("shortcuts", [True, False], ids=["default", "fallbacks"])
@pytest.mark.parametrize("case", sorted(GQA_CASES))
def test_grouped_query_heads_match_brute_force(case, shortcuts):
    """Query heads sharing a kv head against the brute-force twin run on each query head's
    own copy of the values: counts exact, floats to 1e-9 relative."""
    alpha, values, attendable, head_kv = _gqa_case(case)
    K = alpha.shape[1]
    chosen = DEFAULT_SETTINGS if shortcuts else NO_SHORTCUTS
    grid = list(range(1, K + 1))
    got = topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=4, random_draws=3, settings=chosen)
    want = brute_topn(alpha, values[head_kv], attendable[head_kv], grid, seed=4, random_draws=3)
    _assert_same(got, want, want)
    stats = value_statistics(values, attendable, settings=chosen)
    want_stats = brute_value_statistics(values, attendable)
    for name in want_stats:
        np.testing.assert_allclose(stats[name], want_stats[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_shortcuts_do_not_change_results_at_a_longer_context():
    """At K = 300 every shortcut is live by default (the top-pair list is a sample's share,
    quantiles of the pairs are bracketed); taking every fallback instead changes nothing,
    and both match the kernel run on per-query-head copies of the values."""
    rng = np.random.default_rng(21)
    alpha, values, attendable, head_kv = make_gqa_batch(rng, 6, 2, 300, 8, repeats=0.1,
                                                        zeros=0.02, tie_decimals=4)
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    fast = topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=9)
    fast_stats = value_statistics(values, attendable)
    per_head = topn_metrics(alpha, values[head_kv], attendable[head_kv], grid, seed=9)
    _assert_same(fast, per_head, per_head)
    _assert_same(topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=9, settings=NO_SHORTCUTS),
                 fast, fast)
    _assert_same(value_statistics(values, attendable, settings=NO_SHORTCUTS), fast_stats, fast_stats)



def test_float32_gram_changes_nothing_where_cosines_tie_below_its_resolution():
    """Half (and 80%) of a kv head's values within 1e-5 of one direction (their cosines all
    round to the same float32 value, so the screen orders none of them), a tenth repeated exactly:
    the median, mu and mu_q95 from the float32 screen equal those of the float64 Gram matrix
    (and the brute-force twin's), every count equal, with the top-pair list and the brackets
    live (K = 400)."""
    rng = np.random.default_rng(22)
    G, K, D = 2, 400, 16
    values = rng.normal(size=(G, K, D))
    near = rng.random((G, K)) < np.array([[0.5], [0.8]])  # the median among the ties in kv head 1
    direction = rng.normal(size=(G, 1, D))
    values = np.where(near[..., None], direction + 1e-5 * values, values)
    values[:, 1::10] = values[:, 2:3]
    alpha = rng.dirichlet(np.full(K, 0.3), size=2 * G)
    attendable = np.ones((G, K), bool)
    head_kv = np.repeat(np.arange(G), 2)
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    screened = topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=3)
    screened_stats = value_statistics(values, attendable)
    _assert_same(screened_stats, brute_value_statistics(values, attendable), ["median_cos"])
    exact = KernelSettings(float32_gram=False)
    _assert_same(screened, topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=3, settings=exact),
                 screened)
    _assert_same(screened_stats, value_statistics(values, attendable, settings=exact), screened_stats)


@pytest.mark.parametrize("shortcuts", [True, False], ids=["default", "fallbacks"])
def test_head_metrics_are_the_two_kernels_bit_for_bit(shortcuts):
    """The combined entry point shares each kv head's Gram matrix between the two kernels and
    changes nothing: every output equal, NaN where NaN; a kv head no query head reads still
    gets its value statistics."""
    chosen = DEFAULT_SETTINGS if shortcuts else NO_SHORTCUTS
    rng = np.random.default_rng(23)
    alpha, values, attendable, head_kv = make_gqa_batch(rng, 6, 3, 300, 8, repeats=0.1,
                                                        zeros=0.02, window=200)
    head_kv = np.where(head_kv == 1, 0, head_kv)  # kv head 1 unread
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    topn, stats = head_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=9, settings=chosen)
    want_topn = topn_metrics(alpha, values, attendable, grid, head_kv=head_kv, seed=9, settings=chosen)
    want_stats = value_statistics(values, attendable, settings=chosen)
    for got, want in ((topn, want_topn), (stats, want_stats)):
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)

def test_values_as_stored_give_the_float64_results_bit_for_bit():
    """float32 values (as a store holds them), cast a kv head at a time inside the kernels,
    give every output of the same values cast whole beforehand, windowed kv heads included."""
    rng = np.random.default_rng(29)
    alpha, values, attendable, head_kv = make_gqa_batch(rng, 6, 3, 300, 8, repeats=0.1, zeros=0.02, window=200)
    stored = values.astype(np.float32)
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    got = head_metrics(alpha.astype(np.float32), stored, attendable, grid, head_kv=head_kv, seed=4)
    want = head_metrics(alpha.astype(np.float32).astype(np.float64), stored.astype(np.float64), attendable, grid,
                        head_kv=head_kv, seed=4)
    for got_part, want_part in zip(got, want):
        assert set(got_part) == set(want_part)
        for name in want_part:
            np.testing.assert_array_equal(got_part[name], want_part[name], err_msg=name)
    assert stored.dtype == np.float32  # the caller's array is not cast in place


@PROPERTY
@given(instances(), st.integers(1, 3))
def test_lattice_instances_shared_by_query_heads_match_brute_force(batch, per_kv):
    """Lattice values (exact ties in alpha, D and L) read by several query heads each."""
    alpha, values, attendable = batch
    B, K = alpha.shape
    rng = np.random.default_rng(B * K)
    head_kv = np.repeat(np.arange(B), per_kv)
    heads_alpha = np.where(attendable[head_kv], rng.permutation(np.repeat(alpha, per_kv, axis=0), axis=1), 0.0)
    grid = list(range(1, K + 1))
    got = topn_metrics(heads_alpha, values, attendable, grid, head_kv=head_kv, seed=1, random_draws=2)
    want = brute_topn(heads_alpha, values[head_kv], attendable[head_kv], grid, seed=1, random_draws=2)
    _assert_same(got, want, want)


def _sorted_quantile(x, q):
    """The kernels' 'linear' quantile from a full sort: x_lo + (pos - lo) (x_hi - x_lo)."""
    x = np.sort(x)
    pos = q * (x.size - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, x.size - 1)
    return x[lo] + (pos - lo) * (x[hi] - x[lo])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0]), min_size=1, max_size=400),
       st.floats(0, 1))
def test_quantile_is_the_sorted_quantile(x, q):
    x = np.array(x)
    assert pairs.quantile(x.copy(), q) == _sorted_quantile(x, q)
    np.testing.assert_allclose(pairs.quantile(x.copy(), q), np.quantile(x, q), rtol=1e-12, atol=1e-15)


def test_prefix_sums_add_in_selection_order():
    """The aggregates equal np.cumsum's sequential sums bit for bit."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(200, 7)) * rng.lognormal(0, 3, size=(200, 1))
    order = np.argsort(rng.random(200))
    points = np.array([1, 2, 3, 8, 64, 150, 200])
    want = np.cumsum(y[order], axis=0)[points - 1]
    got = np.empty((points.size, 7))
    selection._prefix_sums(y, order, np.ones(200, bool), points, got, 0)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("exact", [False, True], ids=["expansions", "exact"])
def test_ball_scores_are_the_exact_counts(exact):
    """Ball radii and counts from the expansions (keys more than an error from a radius by
    their expansion, the rest exactly) equal those of the exact distances, on rows full of
    exact distance ties (repeated and zero contributions); and with every key compared
    exactly."""
    rng = np.random.default_rng(41)
    K, D = 40, 3
    e_rel = balls.error_bound(D)
    for trial in range(60):
        y = np.round(rng.normal(size=(K, D)), 1)
        y[::3] = y[1]  # repeated contributions: equal distances to every aggregate
        y[5:9] = 0.0
        candidates = rng.random(K) < 0.9
        order = selection.ranked(rng.random(K), candidates)[0]
        n_cand = int(candidates.sum())
        n = int(rng.integers(1, n_cand))
        s = y[order[:n]].sum(axis=0)
        yy = np.einsum("kd,kd->k", y, y)
        x = np.empty(K)
        tiny = 1e300 if exact else DEFAULT_SETTINGS.tiny
        _, unsure = balls._expansions(yy, y @ s, np.ones(K), s @ s, np.sqrt(yy.max()), e_rel, tiny, x)
        got = balls.ball(y, s, x, np.sqrt(yy), e_rel, tiny, unsure, order, n, n_cand, np.full(K, np.nan))
        D_ = ((y - s) ** 2).sum(axis=1)
        sel, uns = order[:n], order[n:n_cand]
        r_max2, r_min2 = D_[sel].max(), D_[uns].min()
        inside = np.count_nonzero(D_[order[:n_cand]] <= r_max2)
        closer = np.count_nonzero(D_[sel] < r_min2)
        # The radii to the last ulps of the summation order; the counts exactly.
        np.testing.assert_allclose(got[3:], (r_max2, r_min2), rtol=1e-13)
        assert got[:2] == (n / inside, closer / n)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False), min_size=2, max_size=50))
def test_ordered_bits_order_as_their_floats(x):
    """The screen's limits are integer maxima of `_ordered` bits: the same order as the floats
    (negative, zero, subnormal and infinite ones), and back to the same bits."""
    x = np.array(x)
    bits = x.view(np.int64)
    ordered = balls._ordered(bits)
    for i in range(x.size):
        assert np.all((ordered[i] < ordered) <= (x[i] <= x)) and np.all((x[i] < x) <= (ordered[i] < ordered))
    np.testing.assert_array_equal(balls._ordered(ordered), bits)
    assert x[np.argmax(ordered)] == x.max() and x[np.argmin(ordered)] == x.min()


def test_screened_scores_are_the_exact_counts():
    """A sink-excluded or random row settled by its expansions alone (`_screen`) has the
    scores of the exact distances; at N = 1 the selected key's distance is 0 and its band
    reaches below it."""
    rng = np.random.default_rng(43)
    K, D = 60, 5
    e_rel = balls.error_bound(D)
    settled = 0
    for trial in range(80):
        y = rng.normal(size=(K, D)) * rng.lognormal(0, 2, size=(K, 1))
        candidates = rng.random(K) < 0.9
        order = selection.ranked(rng.random(K), candidates)[0]
        n_cand = int(candidates.sum())
        n = 1 if trial % 4 == 0 else int(rng.integers(1, n_cand))
        s = y[order[:n]].sum(axis=0)
        yy = np.einsum("kd,kd->k", y, y)
        x = np.empty(K)
        _, unsure = balls._expansions(yy, y @ s, np.ones(K), s @ s, np.sqrt(yy.max()), e_rel, DEFAULT_SETTINGS.tiny, x)
        assert not unsure
        position = np.full(K, K)
        position[order[:n_cand]] = np.arange(n_cand)
        scores = np.full(3, np.nan)
        if not balls._screen(x, np.sqrt(yy), np.sqrt(s @ s), e_rel, DEFAULT_SETTINGS.tiny, position, n, n_cand,
                             scores, np.empty((2, K))):
            continue
        settled += 1
        D_ = ((y - s) ** 2).sum(axis=1)
        sel, uns = order[:n], order[n:n_cand]
        inside = np.count_nonzero(D_[order[:n_cand]] <= D_[sel].max())
        closer = np.count_nonzero(D_[sel] < D_[uns].min())
        assert tuple(scores[:2]) == (n / inside, closer / n)
    assert settled >= 60


def test_uniform_ranking_is_the_stable_sort():
    """The random control's bucket ranking equals a stable sort of its keys, ties included."""
    rng = np.random.default_rng(33)
    for K in (1, 2, 17, 300):
        key = rng.random(K)
        key[::5] = np.round(key[::5], 1)  # ties
        key[: K // 3] = key[0]
        candidates = rng.random(K) < 0.8
        want = selection.ranked(key, candidates)[0]
        np.testing.assert_array_equal(selection.uniform_ranked(key, candidates), want)
        np.testing.assert_array_equal(
            want[: candidates.sum()],
            np.flatnonzero(candidates)[np.argsort(key[candidates], kind="stable")])


def test_pair_statistics_median_and_row_maxima():
    """The bracketed median of the pair cosines is numpy's, on long and short Gram matrices,
    with ties; the row maxima are those of |cosine| off the diagonal. From a float32 screen
    the median is the exact one's and the row maxima are within the screen's bound."""
    rng = np.random.default_rng(8)
    for k, D in ((3, 2), (60, 4), (500, 3)):
        u = rng.normal(size=(k, D))
        u[::4] = u[1]
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        gram = u @ u.T
        exact = np.array([[pairs.pair_cos(u, q, p) for p in range(k)] for q in range(k)])
        cosines = gram[np.tril_indices(k, -1)]
        delta = kv_values.screen_bound(D)
        for bracket_min in (8, 1 << 30):
            listing = KernelSettings(top_pair_share=0.08, top_pair_min=64, bracket_min=bracket_min)
            median, row_max, *_ = pairs.pair_statistics(pairs.Screen(gram, u, 0.0), listing)
            assert median == _sorted_quantile(cosines, 0.5)
            off = np.abs(gram) + np.diag(np.full(k, -np.inf))
            np.testing.assert_array_equal(row_max, off.max(axis=1))
            screen = gram.astype(np.float32)
            median, row_max, *_ = pairs.pair_statistics(pairs.Screen(screen, u, delta), listing)
            assert median == _sorted_quantile(exact[np.tril_indices(k, -1)], 0.5)
            assert np.all(np.abs(row_max - off.max(axis=1)) <= delta)


@pytest.mark.parametrize("sizes", [(5, 40), (40, 5), (3, 300), (200, 200)])
def test_pair_counts_are_the_brute_force_counts(sizes):
    """The certificate's pair counts, by a scan (few values within the other side's range) or
    by a search of the sorted side (many), equal counting every pair; ties included."""
    rng = np.random.default_rng(sizes[0] * 1000 + sizes[1])
    for trial in range(50):
        small = np.round(rng.normal(size=sizes[0]), 1)
        large = np.round(rng.normal(size=sizes[1]) * rng.choice([0.1, 1.0, 10.0]), 1)
        assert bounds.count_below(small, large, False) == np.sum(large[None, :] <= small[:, None])
        assert bounds.count_below(small, large, True) == np.sum(large[None, :] < small[:, None])


def test_ranking_is_the_stable_sort():
    """The selection order equals a stable sort of the candidates' keys, other keys last in
    position order: ties, windows, infinite keys."""
    rng = np.random.default_rng(31)
    key = np.round(rng.random((40, 64)), 1)
    key[::3] = rng.random((14, 64))  # rows without ties
    key[6, :4] = -np.inf
    candidates = rng.random((40, 64)) < 0.8
    candidates[::4] = True
    for row, cand in zip(key, candidates):
        order, rank = selection.ranked(row, cand)
        np.testing.assert_array_equal(order, np.argsort(np.where(cand, row, np.inf), kind="stable"))
        np.testing.assert_array_equal(rank[order], np.arange(64))
        # The sink-excluded order, derived from it.
        nonsink = cand.copy()
        nonsink[0] = False
        np.testing.assert_array_equal(selection._without_sink(order, int(cand.sum()), cand[0]),
                                      selection.ranked(row, nonsink)[0])


def test_head_kv_is_checked():
    rng = np.random.default_rng(0)
    alpha, values, attendable, head_kv = make_gqa_batch(rng, 4, 2, 6, 2)
    with pytest.raises(ValueError):
        topn_metrics(alpha, values, attendable, [1])  # 4 query heads, 2 kv heads, no head_kv
    with pytest.raises(ValueError):
        topn_metrics(alpha, values, attendable, [1], head_kv=[0, 1, 2, 0])


def test_inputs_of_any_layout_reuse_the_compiled_loops():
    """After compile_kernels, read-only, broadcast, strided and int32 inputs, and a layer's
    keys cut to a sliding window, compile nothing more: each worker would otherwise compile its
    own copy (tens of seconds)."""
    from numba.core.registry import CPUDispatcher

    from attngeom.analyze.kernels import coherence, geometry, vectors

    modules = (balls, bounds, coherence, geometry, pairs, selection, kv_values, vectors)

    def signatures():
        return {(module.__name__, name): len(f.signatures) for module in modules
                for name, f in vars(module).items() if isinstance(f, CPUDispatcher)}

    compile_kernels()
    before = signatures()
    rng = np.random.default_rng(5)
    values = rng.normal(size=(2, 40, 6))
    values.flags.writeable = False
    attn = rng.random((8, 80))[::2, ::2]  # strided
    attendable = np.broadcast_to(np.ones(40, dtype=bool), (2, 40))  # read-only
    head_kv = np.array([0, 0, 1, 1], dtype=np.int32)
    topn_metrics(attn, values, attendable, [1, 3, 8], head_kv=head_kv)
    value_statistics(values, attendable)
    head_metrics(attn, values, attendable, (2, 4), head_kv=head_kv)
    window = np.ones((2, 40), dtype=bool)
    window[:, 5:20] = False  # a sliding window's layer: its keys picked by index
    topn_metrics(attn, values, window, [1, 3, 8], head_kv=head_kv)
    head_metrics(attn, values, window, (2, 4), head_kv=head_kv)
    assert signatures() == before


@pytest.mark.parametrize("kind", ["uniform", "ties", "equal", "skewed", "nan"])
def test_order_pair_counted_equals_the_partition(kind):
    """The order statistics of a long array by counting equal those of a partition (an array
    holding NaN is partitioned, as before)."""
    rng = np.random.default_rng(11)
    for n in (pairs.COUNTED_MIN, 9000, 30000):
        x = {"uniform": rng.random(n), "ties": np.round(rng.normal(size=n), 2),
             "equal": np.full(n, 0.3), "skewed": np.abs(rng.normal(size=n)) ** 8,
             "nan": np.where(rng.random(n) < 0.001, np.nan, rng.random(n))}[kind]
        for lo in (0, 1, n // 2, int(0.95 * (n - 1)), n - 2, n - 1):
            for hi in {lo, min(lo + 1, n - 1)}:
                part = np.partition(x, lo)
                want = (part[lo], part[lo] if hi == lo else part[lo + 1:].min())
                np.testing.assert_array_equal(pairs.order_pair(x, lo, hi), want)


def test_mu_q95_of_selections_outside_the_listed_pairs():
    """mu_q95 where the selected keys' pairs are far less coherent than the rest, so that the
    listed top pairs miss the quantile and the pairs are gathered (several thousand: counted,
    not partitioned), equals the quantile of |cos| over the pairs touching I_N."""
    rng = np.random.default_rng(12)
    K, D, top = 240, 16, 64
    values = rng.normal(size=(K, D)) * 0.2
    values[top + 1:] += 3.0 * rng.normal(size=D)  # the unselected keys share a direction
    attn = np.full(K, 1e-4)
    attn[1:top + 1] = np.linspace(0.5, 0.1, top)  # the incoherent keys come first
    attn /= attn.sum()
    grid = [1, 4, 16, 32, 64, 128]
    out = topn_metrics(attn[None], values[None], np.ones((1, K), bool), grid, random_draws=0)
    unit = values[1:] / np.linalg.norm(values[1:], axis=1, keepdims=True)
    cos = np.abs(unit @ unit.T)
    rank = np.argsort(np.argsort(-attn, kind="stable"), kind="stable")[1:]  # the sink is key 0
    for i, n in enumerate(grid):
        q, p = np.tril_indices(K - 1, -1)
        members = cos[q, p][np.minimum(rank[q], rank[p]) < n]
        assert members.size >= pairs.COUNTED_MIN or n < 32
        np.testing.assert_allclose(out["mu_q95"][0, i], np.quantile(members, 0.95), rtol=1e-12)


@PROPERTY
@given(instances(), st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]))
def test_certificate_holds_with_a_learned_sink(batch, s):
    alpha, values, attendable = batch
    grid = np.arange(1, alpha.shape[1] + 1)
    out = topn_metrics(alpha * (1 - s), values, attendable, grid, learned_sink=np.full(alpha.shape[0], s),
                       random_draws=1)
    valid = out["inversions"] >= 0
    assert np.all(out["inversions"][valid] <= out["k_sink_exact"][valid])
