"""Figure building blocks shared by the figure modules: style, curves over N, box plots.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot, so drawing touches no
global state and needs no display; ``savefig`` renders them with Agg.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

from attngeom.report.curves import curve
from attngeom.report.data import RunData, finite

RC = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.alpha": 0.3,
    "savefig.dpi": 130,
}
# A little room around [0, 1], so that curves at 0 or 1 stay visible off the spines.
UNIT = (-0.03, 1.03)
N_LABEL = "N (top-N selection size)"


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float | None = None,
               height: float | None = None) -> tuple[Figure, np.ndarray]:
    """A constrained-layout figure and its (nrows, ncols) axes."""
    fig = Figure(figsize=(width or 4.2 * ncols, height or 3.2 * nrows), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def n_axis(ax: Axes, grid: Sequence[int]) -> None:
    """Log-2 axis for N with the grid's values as ticks."""
    ax.set_xscale("log", base=2)
    ticks = sorted({int(n) for n in grid})
    if ticks:
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel(N_LABEL)


def no_data(ax: Axes, why: str = "") -> None:
    """Say so on an axes left empty: every value of it is undefined (NaN) in these runs, and
    ``why``, when known."""
    ax.text(0.5, 0.5, "no defined values" + (f"\n({why})" if why else ""), transform=ax.transAxes,
            ha="center", va="center", color="0.4")


def short_label(run: RunData) -> str:
    """A compact tick label for a run."""
    return f"{run.model}\n{run.dataset}\nL={run.context_length}"


def color_legend(fig: Figure, entries: Sequence[tuple[str, str]]) -> None:
    """A figure legend below the axes: one patch per (label, colour)."""
    handles = [Patch(color=color, label=label) for label, color in entries]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(3, len(handles)), frameon=False)


def run_legend(fig: Figure, runs: Sequence[RunData]) -> None:
    color_legend(fig, [(r.label, r.color) for r in runs])


def style_legend(ax: Axes, styles: Sequence[tuple[str, str]]) -> None:
    """A legend inside ``ax`` explaining line styles: (linestyle, meaning) in black."""
    handles = [Line2D([], [], color="0.2", linestyle=style, label=meaning) for style, meaning in styles]
    ax.legend(handles=handles, loc="best", frameon=False)


@dataclass(frozen=True)
class Line:
    """One summary variable drawn against N; ``per_n`` divides it by N."""

    var: str
    style: str = "-"
    meaning: str = ""
    per_n: bool = False


@dataclass(frozen=True)
class Panel:
    """One axes of curves against N, a line per (run, Line)."""

    title: str
    ylabel: str
    lines: tuple[Line, ...]
    hline: float | None = None
    ylim: tuple[float, float] | None = None
    logy: bool = False


def draw_curves(ax: Axes, runs: Sequence[RunData], panel: Panel) -> None:
    """Fill ``ax`` with ``panel``'s curves, one colour per run."""
    grid: set[int] = set()
    for run in runs:
        assert run.summary is not None
        for line in panel.lines:
            if line.var not in run.summary:
                continue
            y = curve(run.summary, line.var)
            if line.per_n:
                y = y / y.index.to_numpy(dtype=np.float64)
            if y.empty:
                continue
            grid.update(int(n) for n in y.index)
            marker = "o" if line.style == "-" else None
            ax.plot(y.index, y.to_numpy(), linestyle=line.style, color=run.color, marker=marker, markersize=3)
    if not ax.lines:
        no_data(ax)
    n_axis(ax, sorted(grid))
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    if panel.hline is not None:
        ax.axhline(panel.hline, color="0.5", linewidth=0.8)
    if panel.logy:
        ax.set_yscale("log", nonpositive="mask")
    if panel.ylim is not None:
        ax.set_ylim(*panel.ylim)
    if len(panel.lines) > 1:
        style_legend(ax, [(line.style, line.meaning) for line in panel.lines])


def curves_figure(runs: Sequence[RunData], panels: Sequence[Panel], ncols: int | None = None) -> Figure:
    """Panels of curves against N, side by side (or ``ncols`` per row), a run legend below."""
    ncols = ncols or len(panels)
    nrows = -(-len(panels) // ncols)
    fig, axes = new_figure(nrows, ncols, height=3.0 * nrows + 0.3 * len(runs))
    for ax, panel in zip(axes.flat, panels):
        draw_curves(ax, runs, panel)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    run_legend(fig, runs)
    return fig


@dataclass(frozen=True)
class BoxPanel:
    """One axes of box plots of ``analysis/heads`` variables across (layer, head), per run."""

    title: str
    ylabel: str
    variables: tuple[str, ...]
    meanings: tuple[str, ...] = ()
    hline: float | None = None
    undefined: str = ""  # why a head may have no value, said when some have none


HATCHES = ("", "///", "...")


def draw_boxes(ax: Axes, runs: Sequence[RunData], panel: BoxPanel) -> None:
    """Boxes of each run's per-head values, grouped by run; variables told apart by hatching."""
    width = 0.8 / len(panel.variables)
    notes = []
    for i, run in enumerate(runs):
        assert run.heads is not None
        for k, var in enumerate(panel.variables):
            values = finite(run.heads[var]) if var in run.heads else np.array([])
            note = _degenerate(values, run.heads[var].size if var in run.heads else 0, panel.undefined)
            if note:
                notes.append(note if len(runs) == 1 else f"{run.model} L={run.context_length}: {note}")
            if values.size == 0:
                continue
            position = i + (k - (len(panel.variables) - 1) / 2) * width
            box = ax.boxplot(values, positions=[position], widths=width * 0.85, patch_artist=True,
                             showfliers=True, flierprops={"markersize": 2})
            for patch in box["boxes"]:
                patch.set(facecolor=run.color, alpha=0.6, hatch=HATCHES[k % len(HATCHES)])
            for median in box["medians"]:
                median.set_color("black")
    if not ax.patches:
        no_data(ax, panel.undefined)
    elif notes:
        # Below the run labels, where it hides no box.
        ax.set_xlabel("\n".join(textwrap.fill(n, 60) for n in notes), fontsize=7, color="0.25")
    ax.set_xticks(range(len(runs)), [short_label(r) for r in runs])
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.grid(axis="x", visible=False)
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    if panel.hline is not None:
        ax.axhline(panel.hline, color="0.5", linewidth=0.8)
    if len(panel.variables) > 1:
        # One run: its colour, as its boxes; several: neutral, the colours being the runs'.
        face = dict(facecolor=runs[0].color, alpha=0.6) if len(runs) == 1 else dict(facecolor="0.85")
        handles = [Patch(**face, edgecolor="0.3", hatch=HATCHES[k % len(HATCHES)], label=m)
                   for k, m in enumerate(panel.meanings)]
        ax.legend(handles=handles, loc="best", frameon=False)


def _degenerate(values: np.ndarray, heads: int, undefined: str) -> str:
    """What a box hides: heads without a value (and why, if known), and a box of one value
    drawn as a line; "" when it hides nothing."""
    parts = []
    if 0 < values.size < heads:
        parts.append(f"{values.size} of {heads} heads defined" + (f", elsewhere {undefined}" if undefined else ""))
    if values.size > 1 and np.ptp(values) == 0:
        parts.append(f"all {values.size} equal {values[0]:.3g}")
    return "; ".join(parts)


def boxes_figure(runs: Sequence[RunData], panels: Sequence[BoxPanel], ncols: int | None = None) -> Figure:
    """Panels of per-head box plots, ``ncols`` per row."""
    ncols = ncols or len(panels)
    nrows = -(-len(panels) // ncols)
    width = max(4.2, 1.0 + 1.1 * len(runs)) * ncols
    fig, axes = new_figure(nrows, ncols, width=width, height=3.2 * nrows)
    for ax, panel in zip(axes.flat, panels):
        draw_boxes(ax, runs, panel)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    return fig
