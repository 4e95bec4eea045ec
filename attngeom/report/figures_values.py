"""Figures of the appendix's value-norm structure and empirical coherence constants."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from attngeom.report.data import RunData, requires
from attngeom.report.plots import BoxPanel, boxes_figure, draw_boxes, new_figure, run_legend
from attngeom.report.spec import FigureSpec

SECTION = "Value norms and coherence"
# (heads variable, its name), each drawn as a value panel and a CV-across-sequences panel.
COHERENCE = (
    ("mu_q95", r"$\mu_N^{(0.95)}$"),
    ("sink_cos_neg_frac", r"fraction of $\langle u_0, u_k\rangle < 0$"),
    ("nu_minus_q95", r"$\nu_N^{-,(0.95)}$"),
    ("nu_plus_q95", r"$\nu_N^{+,(0.95)}$"),
)


def norm_cv(runs: Sequence[RunData]) -> Figure:
    """Non-sink value-norm CV per head (left) and its mean per relative depth (right)."""
    fig, axes = new_figure(1, 2, width=max(8.4, 4.2 + 1.1 * len(runs)), height=3.4 + 0.3 * len(runs))
    draw_boxes(axes[0, 0], runs, BoxPanel("(a) non-sink value-norm CV per head",
                                          r"$\mathrm{CV}_{l,h} = \mathrm{std}/\mathrm{mean}\ \|v_i\|$",
                                          ("norm_cv",)))
    ax = axes[0, 1]
    for run in runs:
        assert run.heads is not None
        per_layer = run.heads["norm_cv"].mean("head").to_numpy()
        depth = np.arange(per_layer.size) / max(per_layer.size - 1, 1)
        ax.plot(depth, per_layer, color=run.color, marker="o", markersize=3)
    ax.set_title("(b) mean CV by depth")
    ax.set_xlabel("relative depth (layer / (layers − 1))")
    ax.set_ylabel("mean CV across heads")
    run_legend(fig, runs)
    return fig


def coherence(runs: Sequence[RunData]) -> Figure:
    """mu^(0.95), the negative sink-cosine fraction, nu^-(0.95), nu^+(0.95), each with its CV."""
    panels = []
    for var, name in COHERENCE:
        panels.append(BoxPanel(f"{name} per head", name, (var,)))
        panels.append(BoxPanel(f"CV across sequences of {name}", "CV", (f"{var}_cv",),
                               undefined="0 in every sequence (CV 0/0), or no sink"))
    fig = boxes_figure(runs, panels, ncols=2)
    at = {n for r in runs if r.heads is not None and (n := r.heads.attrs.get("coherence_n")) is not None}
    if at:
        fig.suptitle(f"empirical coherence at N = {', '.join(str(n) for n in sorted(at))}")
    return fig


FIGURES = (
    FigureSpec("value_norm_cv", SECTION,
               "Coefficient of variation of non-sink value norms within each layer–head pair "
               "(mean over sequences): small values support ||v_i|| ≈ C.",
               norm_cv, requires("heads", "norm_cv")),
    FigureSpec("coherence", SECTION,
               "Robust coherence μ^(0.95), fraction of negative sink cosines, ν^−(0.95) and ν^+(0.95) "
               "across layer–head pairs (left) and their CV across sequences (right).",
               coherence, requires("heads", *(v for v, _ in COHERENCE), *(f"{v}_cv" for v, _ in COHERENCE))),
)
