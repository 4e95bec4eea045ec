"""The sink-aware bounds (docs/method.md#sink-aware-bound): K_N^sink, the number of
selected-unselected pairs that the appendix proof cannot order, from the keys' weights beta
and the coherence constants mu and nu."""

from __future__ import annotations

import numpy as np

from attngeom.analyze.kernels._jit import jit
from attngeom.analyze.kernels.vectors import SCAN_PER_LOG, bisect_left, extent


@jit
def count_below(small, large, strict):
    """#{(s, l): l < s} (strict) or #{(s, l): l <= s} (not strict) over s in small and l in
    large, as a search of small sorted (NaN last) counts them: a NaN s lies above every finite
    l, and a NaN l below every s when not strict, below none when strict.

    Most of large lies outside small's range (87% on a Mistral-7B block): counted without a
    search; the few within it are compared with every s, and small is sorted only when they
    are many, or when small holds a NaN."""
    n = small.size
    s_lo, s_hi, finite = extent(small)
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
    if finite and j <= SCAN_PER_LOG * np.log2(n + 1):
        for v in within[:j]:
            for x in small:
                count += (x > v) if strict else not (x < v)
        return count
    ordered = np.sort(small)
    for v in within[:j]:
        count += n - (np.searchsorted(ordered, v, side="right") if strict else bisect_left(ordered, v))
    return count


@jit
def k_sink(beta, selected, order, n, n_att, nonsink, has_sink, mu, nu_plus, nu_minus, l_rtol):
    """K_N^sink of the appendix proof (docs/method.md#sink-aware-bound): the
    selected-unselected pairs whose lower bound L <= (D_j - D_i)/C^2 is not positive, each
    L counted "<= 0" within l_rtol of its scale (beta + A)^2 . The
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
        k_pp = count_below(minus_f, g, False)
    else:
        k_pp = n_sel * n_uns - count_below(g, minus_f, True)
    if sigma:
        return k_pp + k_0p
    return k_pp + k_p0 if has_sink else k_pp
