"""What depends on a kv head's values and mask only (docs/method.md#norms-and-coherence): the
norms and unit vectors of its values, the sink's cosines with the other keys, the Gram matrix
of its unit non-sink values, and the value statistics read from them. Computed once per kv
head and shared by the query heads reading it.

A value vector of norm 0 has no direction: its unit vector is taken as 0 (cosine 0 with
everything) in the coherence statistics, which keeps the exact certificate valid because such
a key has ``beta = 0`` there; a cosine reported as an output is NaN whenever one of its
vectors is 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.linalg.blas import dsyrk, ssyrk

from attngeom.analyze.kernels._jit import jit
from attngeom.analyze.kernels.pairs import Screen, quantile
from attngeom.analyze.kernels.vectors import dot, norm
from attngeom.store.objects.schema import VALUE_STATISTICS


class KvHeads(NamedTuple):
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
    virtual: bool           # key 1 is the learned sink's virtual key


class KvHead(NamedTuple):
    """One kv head as its query heads' geometry reads it."""

    values: np.ndarray  # (K, D)
    att: np.ndarray     # (K,) bool, the attendable keys
    v_norm: np.ndarray  # (K,) ||v_k||
    C: float            # median non-sink norm
    c_lo: float         # min_k <u_0, u_k>
    c_hi: float         # max_k <u_0, u_k>
    q05: float          # 5% quantile of <u_0, u_k>
    q95: float          # 95% quantile
    virtual: bool       # key 1 is the learned sink's virtual key (value 0, beta 0)


@jit
def kv_head(values, att):
    """What depends on one kv head's values (K, D) and mask att (K,) only: ||v_k|| (K,), the
    unit vectors u_k (K, D) (0 for v_k = 0), <u_0, u_k> (K,) at the non-sink keys (-inf
    elsewhere), and (C, c_lo, c_hi, median, q05, q95): the median non-sink norm and the
    extremes, median and 5%/95% quantiles of <u_0, u_k> over the non-sink keys."""
    K, D = values.shape
    v_norm = np.empty(K)
    unit = np.zeros((K, D))
    for k in range(K):
        v_norm[k] = norm(values[k])
        if v_norm[k] > 0:
            for d in range(D):
                unit[k, d] = values[k, d] / v_norm[k]
    sink_cos = np.full(K, -np.inf)
    n_ns = 0
    for k in range(1, K):
        if att[k]:
            sink_cos[k] = dot(unit[0], unit[k])
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
    stats = np.array([quantile(norms, 0.5), c_lo, c_hi, quantile(cos, 0.5), quantile(cos, 0.05),
                      quantile(cos, 0.95)])
    return v_norm, unit, sink_cos, stats


def kv_heads(values: np.ndarray, attendable: np.ndarray, *, virtual: bool = False) -> KvHeads:
    """`KvHeads` of values (G, K, D) with mask attendable (G, K). virtual: key 1 is the
    learned sink's virtual key (docs/method.md#learned-sinks), a zero value that is not one of
    the model's: it takes no part in the statistics of the values, their cosines and pairs."""
    real = attendable.copy()
    if virtual:
        real[:, 1] = False
    nonsink = real.copy()
    nonsink[:, 0] = False
    G, K, D = values.shape
    v_norm, unit, sink_cos, stats = np.empty((G, K)), np.empty((G, K, D)), np.empty((G, K)), np.empty((G, 6))
    for g in range(G):
        v_norm[g], unit[g], sink_cos[g], stats[g] = kv_head(values[g], np.ascontiguousarray(real[g]))
    return KvHeads(
        v_norm=v_norm, unit=unit, nonsink=nonsink, has_sink=attendable[:, 0],
        C=stats[:, 0], sink_cos=sink_cos, c_lo=stats[:, 1], c_hi=stats[:, 2],
        sink_cos_median=stats[:, 3], q05=stats[:, 4], q95=stats[:, 5], virtual=virtual,
    )


def one_kv_head(kv: KvHeads, g: int, values: np.ndarray, att: np.ndarray) -> KvHead:
    """kv head g of kv as `KvHead`, with its values (K, D) and mask att (K,)."""
    return KvHead(values, att, kv.v_norm[g], kv.C[g], kv.c_lo[g], kv.c_hi[g], kv.q05[g], kv.q95[g], kv.virtual)


def nonsink_gram(kv: KvHeads, g: int, work: np.ndarray) -> Screen:
    """The Gram matrix (k, k) <u_p, u_q> of kv head g over its k non-sink keys, in position
    order, below the diagonal (q > p) only, as a `Screen`: float32 (the dtype of work) within
    `screen_bound` of each exact cosine, or float64 with its entries the cosines (delta 0)
    where the unit vectors are not finite or work is float64.

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
        return Screen(np.empty((0, 0), work.dtype), unit, 0.0)
    if work.dtype == np.float32:
        gram = ssyrk(1.0, unit.astype(np.float32).T, trans=1, c=work[: k * k].reshape((k, k), order="F"),
                     overwrite_c=1).T
        if np.isfinite(np.diagonal(gram)).all():
            return Screen(gram, unit, screen_bound(D))
        work = np.empty(k * k)
    return Screen(dsyrk(1.0, unit.T, trans=1, c=work[: k * k].reshape((k, k), order="F"), overwrite_c=1).T,
                  unit, 0.0)


def screen_bound(D: int) -> float:
    """delta: how far a float32 Gram entry can lie from the exact cosine `pairs.pair_cos`.
    The unit vectors (norm at most 1 + D eps64) are rounded to float32 (relative 2^-24 each, or
    2^-149 absolute below float32's normal range) and their products summed in any order,
    within (D + 2) 2^-24 (1 + D 2^-24); `pair_cos` is within D eps64 of the real value. Twice
    (D + 3) 2^-24 covers both with room."""
    return 2 * (D + 3) * 2.0**-24


def statistics(kv: KvHeads, median_cos: np.ndarray) -> dict[str, np.ndarray]:
    """The value statistics (G,) of kv, by name of `VALUE_STATISTICS`, from its kv heads'
    median pair cosines (G,) (`pairs.pair_statistics`); over the attendable non-sink keys k
    (cosines of unit vectors u_k = v_k/||v_k||, docs/method.md#norms-and-coherence):

    - ``C``: median ||v_k||; ``norm_cv``: std/mean of ||v_k|| (population std);
    - ``median_cos``: median <u_p, u_q> over pairs p != q;
    - sink (NaN without one): ``sink_norm_ratio`` lambda = ||v_0||/C, ``sink_cos_median`` and
      ``sink_cos_neg_frac`` (fraction < 0) of <u_0, u_k>, ``nu_minus_q95`` = max(0, -q95) and
      ``nu_plus_q95`` = max(0, -q05) of <u_0, u_k>.
    """
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
