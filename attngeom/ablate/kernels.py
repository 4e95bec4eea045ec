"""Pure kernels of the ablate stage: head rankings, sparsification masks, critical heads,
correlations. numpy in, numpy (or a small xarray Dataset) out; no model, no store."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import xarray as xr
from scipy import stats

# A MAD-based robust z: 1.4826 * MAD estimates the standard deviation of a normal sample.
MAD_SCALE = 1.4826
CRITICAL_RULE = f"delta_nll_mean > median + k * {MAD_SCALE} * MAD (over all heads) and > floor (nats)"


def kept_per_layer(retention: float, n_heads: int) -> int:
    """Heads kept in every layer at ``retention``: ``retention * n_heads`` rounded half up."""
    return int(np.floor(retention * n_heads + 0.5))


def keep_mask(keys: Sequence[np.ndarray], k: int, protected: np.ndarray) -> np.ndarray:
    """Per-layer sparsification mask.

    keys: priority arrays (layers, heads), most significant first; a larger value is kept
    first, NaN last, and the smaller head index breaks remaining ties. protected (layers,
    heads) bool: always kept and outside the ranking. Each layer keeps its protected heads,
    then the best-ranked others up to ``k`` heads in all (more than ``k`` only when it has
    more protected heads). Returns (layers, heads) bool, True = kept.
    """
    n_layers, n_heads = protected.shape
    keep = protected.copy()
    head = np.arange(n_heads)
    for layer in range(n_layers):
        free = np.flatnonzero(~protected[layer])
        slots = max(k - int(protected[layer].sum()), 0)
        # np.lexsort sorts by its last key first; negating puts larger values first, NaN last.
        sort_keys = [head[free]] + [-np.nan_to_num(key[layer, free], nan=-np.inf) for key in reversed(keys)]
        keep[layer, free[np.lexsort(sort_keys)][:slots]] = True
    return keep


def regime_means(regime: np.ndarray, impact: np.ndarray, protected: np.ndarray) -> dict[str, float]:
    """Mean single-head impact of each regime label over its unprotected heads (NaN if none).
    regime, impact, protected: (layers, heads)."""
    out = {}
    for label in sorted(set(regime.ravel().tolist())):
        members = (regime == label) & ~protected
        out[label] = float(impact[members].mean()) if members.any() else float("nan")
    return out


def type_guided_keys(regime: np.ndarray, impact: np.ndarray, protected: np.ndarray) -> list[np.ndarray]:
    """Keys for :func:`keep_mask`: the head's regime mean impact (regimes with a larger mean
    kept first), then the head's own impact. regime, impact, protected: (layers, heads)."""
    means = regime_means(regime, impact, protected)
    regime_key = np.vectorize(lambda label: means[label], otypes=[float])(regime)
    return [regime_key, impact]


def random_keys(n_draws: int, n_layers: int, n_heads: int, seed: int) -> np.ndarray:
    """(draws, layers, heads) uniform priorities: draw ``d`` is a uniformly random head order
    per layer, seeded by (seed, d), and nested across retentions (a mask keeps a prefix of it)."""
    out = np.empty((n_draws, n_layers, n_heads))
    for d in range(n_draws):
        out[d] = np.random.default_rng([seed, d]).random((n_layers, n_heads))
    return out


def robust_z(impact: np.ndarray) -> np.ndarray:
    """``(x - median) / (MAD_SCALE * MAD)`` over all entries; +-inf (or NaN at the median) when MAD = 0."""
    median = np.median(impact)
    mad = MAD_SCALE * np.median(np.abs(impact - median))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (impact - median) / mad


def critical_threshold(impact: np.ndarray, k: float, floor: float) -> float:
    """The impact (nats) a critical head exceeds (CRITICAL_RULE):
    ``max(median + k * MAD_SCALE * MAD, floor)`` over all heads of impact (layers, heads)."""
    median = np.median(impact)
    return max(float(median + k * MAD_SCALE * np.median(np.abs(impact - median))), floor)


def critical_heads(impact: np.ndarray, k: float, floor: float) -> np.ndarray:
    """Heads whose single-head impact is a robust outlier: ``impact > median + k * MAD_SCALE
    * MAD`` over all heads and ``impact > floor`` (nats). impact (layers, heads) -> bool."""
    return impact > critical_threshold(impact, k, floor)


def correlation_table(target: np.ndarray, diagnostics: Mapping[str, np.ndarray]) -> xr.Dataset:
    """Spearman and Pearson correlation (scipy.stats, two-sided p) of each diagnostic with
    ``target`` over heads where both are finite. Arrays of any equal shape (e.g. (layers,
    heads)). Returns a Dataset over ``diagnostic``: spearman_r, spearman_p, pearson_r,
    pearson_p, n (NaN where fewer than 3 heads or an input is constant)."""
    rows = []
    y_all = np.asarray(target, dtype=np.float64).ravel()
    for name, values in diagnostics.items():
        x_all = np.asarray(values, dtype=np.float64).ravel()
        ok = np.isfinite(x_all) & np.isfinite(y_all)
        x, y = x_all[ok], y_all[ok]
        row = [np.nan] * 4
        if ok.sum() >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", stats.ConstantInputWarning)
                s = stats.spearmanr(x, y)
                p = stats.pearsonr(x, y)
            row = [float(s.statistic), float(s.pvalue), float(p.statistic), float(p.pvalue)]
        rows.append(row + [int(ok.sum())])
    table = np.asarray(rows, dtype=np.float64).reshape(len(rows), 5)
    names = ("spearman_r", "spearman_p", "pearson_r", "pearson_p")
    data = {name: ("diagnostic", table[:, i]) for i, name in enumerate(names)}
    data["n"] = ("diagnostic", table[:, 4].astype(np.int64))
    return xr.Dataset(data, coords={"diagnostic": np.array(list(diagnostics), dtype=object)})


def attention_diagnostics(
    attn_last: np.ndarray, entropy: np.ndarray, top1: np.ndarray, top_n: int
) -> dict[str, np.ndarray]:
    """Final-query diagnostics of one sequence. attn_last (layers, heads, L): the final
    query's row; entropy, top1 (layers, heads): its entropy and top-1 attention.
    Returns (layers, heads) arrays: last (a_{L-1}, the current token), sink (a_0), topN mass
    (sum of the ``top_n`` largest weights), entropy and top-1."""
    return {
        "mean_last_attention": attn_last[..., -1],
        "mean_sink_attention": attn_last[..., 0],
        "mean_topN_attention_mass": -np.sort(-attn_last, axis=-1)[..., :top_n].sum(axis=-1),
        "mean_attention_entropy": entropy,
        "mean_top1_attention": top1,
    }
