"""Curves over N pooled from ``analysis/summary``.

The summary holds, per (layer, head, n), the mean and the count of defined instances across
sequences; ``sum(mean * count) / sum(count)`` over heads (and over runs) is then the exact
mean over every defined (sequence, layer, head) instance, without reading ``topn``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
import xarray as xr

HEAD_DIMS = ("layer", "head")


def _totals(summary: xr.Dataset, var: str) -> pd.DataFrame:
    """Per n: the sum over defined instances of ``var`` and their count."""
    mean = summary[var].sel(stat="mean")
    count = summary[var].sel(stat="count")
    weighted = (mean.fillna(0.0) * count).sum(HEAD_DIMS)
    return pd.DataFrame(
        {"total": weighted.to_series(), "count": count.sum(HEAD_DIMS).to_series()}
    )


def pooled_curve(summaries: Iterable[xr.Dataset], var: str) -> pd.Series:
    """Mean of ``var`` over every defined instance of ``summaries``, indexed by N (NaN-free)."""
    parts = [_totals(s, var) for s in summaries]
    if not parts:
        return pd.Series(dtype=np.float64)
    totals = pd.concat(parts).groupby(level=0).sum()
    totals = totals[totals["count"] > 0]
    return (totals["total"] / totals["count"]).sort_index()


def curve(summary: xr.Dataset, var: str) -> pd.Series:
    """Mean of ``var`` over the instances of one run, indexed by N."""
    return pooled_curve([summary], var)


def instances(summary: xr.Dataset, var: str) -> pd.Series:
    """How many instances define ``var``, per N."""
    return summary[var].sel(stat="count").sum(HEAD_DIMS).to_series()
