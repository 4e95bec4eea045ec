"""Figures of geometry along the context (docs/method.md#any-query): F_N, its random control
and the sink-aware bounds, and the sink's selection rate, against the query position, per
regime; from ``analysis/summary_by_query`` of runs extracted with ``--queries``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.figure import Figure

from attngeom.report.data import Missing, RunData, all_of, labels, requires
from attngeom.report.plots import UNIT, new_figure, no_data, run_legend, style_legend
from attngeom.report.spec import FigureSpec
from attngeom.store import REGIMES

SECTION = "Geometry along the context"
# The selection size drawn: small enough to be defined at early queries (N < q + 1).
QUERY_N = 4


def _n(summary: xr.Dataset) -> int:
    """QUERY_N, or the grid's nearest N to it."""
    grid = summary["n"].values
    return int(grid[np.argmin(np.abs(np.log2(grid) - np.log2(QUERY_N)))])


def regime_curve(run: RunData, var: str, regime: str) -> pd.Series:
    """Mean of ``var`` at N = _n over every defined (sequence, head) instance of the regime's
    heads, indexed by query position (empty when the regime has no head)."""
    summary = run.summary_by_query
    assert summary is not None and run.heads is not None
    regimes = run.heads["regime"].transpose("layer", "head")
    heads = xr.DataArray((labels(regimes) == regime).reshape(regimes.shape), dims=("layer", "head"),
                         coords={"layer": regimes["layer"].values, "head": regimes["head"].values})
    if not heads.any():
        return pd.Series(dtype=np.float64)
    at = summary[var].sel(n=_n(summary))
    mean, count = at.sel(stat="mean"), at.sel(stat="count").where(heads, 0.0)
    total = (mean.fillna(0.0) * count).sum(("layer", "head")).load()
    count = count.sum(("layer", "head")).load()
    curve = (total / count.where(count > 0)).to_series()
    return curve.dropna()


def _by_regime(runs: Sequence[RunData], lines: Sequence[tuple[str, str, str]], ylabel: str,
               title: str) -> Figure:
    """A panel per regime: each line (variable, style, meaning) per run against query position."""
    fig, axes = new_figure(1, len(REGIMES), height=3.2 + 0.3 * len(runs))
    grid = {_n(r.summary_by_query) for r in runs if r.summary_by_query is not None}
    at = f", N = {grid.pop()}" if len(grid) == 1 else ""
    for ax, regime in zip(axes[0], REGIMES):
        for run in runs:
            for var, style, _ in lines:
                y = regime_curve(run, var, regime)
                if not y.empty:
                    ax.plot(y.index, y.to_numpy(), linestyle=style, color=run.color,
                            marker="o" if style == "-" else None, markersize=3)
        if not ax.lines:
            no_data(ax)
        ax.set_title(f"{regime} heads: {title}{at}")
        ax.set_xlabel("query position q")
        ax.set_ylabel(ylabel)
        ax.set_ylim(*UNIT)
        if len(lines) > 1:
            style_legend(ax, [(style, meaning) for _, style, meaning in lines])
    run_legend(fig, runs)
    return fig


def separability_by_query(runs: Sequence[RunData]) -> Figure:
    """F_N, the random control and the sink-aware bounds against the query position."""
    return _by_regime(runs, (("f_score", "-", "top-N F"), ("random_f_score", "--", "random N"),
                             ("precision_bound", ":", "precision bound"),
                             ("recall_bound", "-.", "recall bound")), r"$F_N$ and bounds", "separability")


def sink_rate_by_query(runs: Sequence[RunData]) -> Figure:
    """How often the sink is among the top-N keys, against the query position."""
    return _by_regime(runs, (("sink_selected", "-", "sink selected"),), r"$\Pr(0 \in I_N)$",
                      "sink selection rate")


def _with_queries(run: RunData) -> Missing | None:
    """Why a run has no geometry along the context, or None."""
    if run.summary_by_query is None:
        return Missing("no analysis/summary_by_query (extract with --queries, then run `attngeom analyze`)",
                       "queries")
    return None


NEEDS = all_of(requires("heads", "regime"), _with_queries,
               requires("summary_by_query", "f_score", "sink_selected"))

FIGURES = (
    FigureSpec("separability_by_query", SECTION,
               f"F_N of top-N selection (solid), the random-N control (dashed) and the sink-aware "
               f"precision and recall bounds (dotted, dash-dotted) at N = {QUERY_N} against the query "
               "position, per regime, for runs extracted with --queries.",
               separability_by_query, all_of(NEEDS, requires("summary_by_query", "random_f_score",
                                                             "precision_bound", "recall_bound"))),
    FigureSpec("sink_rate_by_query", SECTION,
               f"Sink selection rate Pr(0 ∈ I_N) at N = {QUERY_N} against the query position, per regime; "
               "in a sliding-window layer the sink leaves the keys once q reaches the window.",
               sink_rate_by_query, NEEDS),
)
