"""Figures of top-N separability: the 2D illustration, precision/recall against the random
control and the sink-aware bound (overall, by context length, by dataset), leave-one-out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Circle

from attngeom.analyze.kernels import topn_metrics
from attngeom.report.curves import pooled_curve
from attngeom.report.data import RunData, requires
from attngeom.report.plots import UNIT, Line, Panel, color_legend, curves_figure, n_axis, new_figure
from attngeom.report.spec import FigureSpec

ILLUSTRATION_N = 4


def illustration(_: Sequence[RunData]) -> Figure:
    """The paper's 2D example: values on a circle, contributions y_i = alpha_i v_i, the balls.

    Drawn from a fixed synthetic instance (no store data); P and R come from the analyze
    kernels themselves, so the picture and the metric agree by construction.
    """
    # A seed whose instance shows both kinds of error (P = 0.8, R = 0.75).
    rng = np.random.default_rng(4)
    angles = np.sort(rng.uniform(0, 2 * np.pi, 16))
    values = np.stack([np.cos(angles), np.sin(angles)], axis=-1)
    alpha = np.exp(1.5 * np.cos(angles - 1.0) + rng.normal(size=angles.size))
    alpha /= alpha.sum()
    y = alpha[:, None] * values
    top = np.argsort(-alpha, kind="stable")[:ILLUSTRATION_N]
    selected = np.zeros(alpha.size, dtype=bool)
    selected[top] = True
    s = y[selected].sum(axis=0)
    distance = np.linalg.norm(y - s, axis=-1)
    r_max, r_min = distance[selected].max(), distance[~selected].min()
    metrics = topn_metrics(alpha[None], values[None], np.ones((1, alpha.size), dtype=bool), [ILLUSTRATION_N])
    precision, recall = float(metrics["precision"][0, 0]), float(metrics["recall"][0, 0])

    fig, axes = new_figure(1, 3, width=11.0, height=3.8)
    left, middle, right = axes[0]
    t = np.linspace(0, 2 * np.pi, 200)
    left.plot(np.cos(t), np.sin(t), color="0.8", linewidth=0.8)
    left.scatter(values[~selected, 0], values[~selected, 1], color="black", s=14, label="other tokens")
    left.scatter(values[selected, 0], values[selected, 1], color="magenta", marker="*", s=90, label=f"top-{ILLUSTRATION_N}")
    left.set_title("value states $v_i$ on a circle")
    for ax in (middle, right):
        ax.scatter(y[~selected, 0], y[~selected, 1], color="black", s=14)
        ax.scatter(y[selected, 0], y[selected, 1], color="magenta", marker="*", s=90)
        ax.scatter(*s, color="tab:blue", marker="X", s=60, label="$s_N$")
    middle.set_title(r"contributions $y_i = \alpha_i v_i$")
    right.add_patch(Circle(s, r_max, fill=False, color="tab:red", linestyle="-", label=r"$r_{\max}$ (closed)"))
    right.add_patch(Circle(s, r_min, fill=False, color="tab:green", linestyle="--", label=r"$r_{\min}$ (open)"))
    right.set_title(f"balls around $s_N$: P = {precision:.2f}, R = {recall:.2f}")
    for ax in axes[0]:
        ax.set_aspect("equal", adjustable="datalim")
        ax.set_xlabel("value dimension 1")
        ax.set_ylabel("value dimension 2")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)
    return fig


PRECISION = Panel(
    "(a) geometric precision", r"$P(r_{\max}, N)$",
    (Line("precision", "-", "top-N"), Line("random_precision", "--", "random N"),
     Line("precision_bound", ":", "sink-aware bound")),
    ylim=UNIT,
)
RECALL = Panel(
    "(b) geometric recall", r"$R(r_{\min}, N)$",
    (Line("recall", "-", "top-N"), Line("random_recall", "--", "random N"),
     Line("recall_bound", ":", "sink-aware bound")),
    ylim=UNIT,
)


def precision_recall(runs: Sequence[RunData]) -> Figure:
    """P(r_max,N) and R(r_min,N) with the random-N control (dashed) and the bound (dotted)."""
    return curves_figure(runs, (PRECISION, RECALL))


def _model_colors(runs: Sequence[RunData]) -> dict[str, str]:
    models = list(dict.fromkeys(r.model for r in runs))
    return {m: f"C{i % 10}" for i, m in enumerate(models)}


def _pooled_by(runs: Sequence[RunData], key: Callable[[RunData], object], title: str) -> Figure:
    """P and R (rows) per value of ``key`` (columns), one colour per model, pooling the runs
    that share both (e.g. the datasets of a model at one context length)."""
    panels = sorted({key(r) for r in runs}, key=str)
    colors = _model_colors(runs)
    fig, axes = new_figure(2, len(panels), height=6.0 + 0.3 * len(colors))
    for col, value in enumerate(panels):
        grid: set[int] = set()
        for model, color in colors.items():
            chosen = [r.summary for r in runs if key(r) == value and r.model == model and r.summary is not None]
            for row, var in enumerate(("precision", "recall")):
                y = pooled_curve(chosen, var)
                grid.update(int(n) for n in y.index)
                axes[row, col].plot(y.index, y.to_numpy(), color=color, marker="o", markersize=3)
        for row, label in enumerate((r"$P(r_{\max}, N)$", r"$R(r_{\min}, N)$")):
            ax = axes[row, col]
            n_axis(ax, sorted(grid))
            ax.set_ylabel(label)
            ax.set_ylim(*UNIT)
            ax.set_title(f"{title} {value}")
    color_legend(fig, list(colors.items()))
    return fig


def by_context_length(runs: Sequence[RunData]) -> Figure:
    """Precision and recall per context length, pooled over datasets."""
    return _pooled_by(runs, lambda r: r.context_length, "L =")


def by_dataset(runs: Sequence[RunData]) -> Figure:
    """Precision and recall per dataset, pooled over context lengths."""
    return _pooled_by(runs, lambda r: r.dataset, "dataset:")


def leave_one_out(runs: Sequence[RunData]) -> Figure:
    """Contrastive leave-one-out margin M_N^loo and the positive leave-one-out fraction."""
    return curves_figure(runs, (
        Panel("(a) contrastive leave-one-out margin", r"$M_N^{\mathrm{loo}}$",
              (Line("loo_margin"),), hline=0.0),
        Panel("(b) selected with positive leave-one-out cosine", r"fraction with $\cos(y_i, s_{N,-i}) > 0$",
              (Line("loo_positive_frac"),), ylim=UNIT),
    ))


def distance_margin(runs: Sequence[RunData]) -> Figure:
    """The strict distance margin gamma_N^loo."""
    return curves_figure(runs, (
        Panel("distance leave-one-out margin", r"$\gamma_N^{\mathrm{loo}}$",
              (Line("loo_distance_margin"),), hline=0.0),
    ))


def certificate(runs: Sequence[RunData]) -> Figure:
    """The paper's bound against the exact certificate: violations, counts, bounds."""
    return curves_figure(runs, (
        Panel("(a) instances with $A_N > K$", "fraction of instances",
              (Line("bound_violation", "-", "paper bound $K_N^{sink}$"),
               Line("certificate_violation", "--", r"exact certificate $K_N^{exact}$")),
              hline=0.0),
        Panel("(b) inversions against the pair counts", "mean count / N",
              (Line("inversions", "-", "inversions $A_N$", per_n=True),
               Line("k_sink_exact", "--", "$K_N^{exact}$", per_n=True),
               Line("k_sink", ":", "$K_N^{sink}$ (worst case)", per_n=True),
               Line("k_sink_q95", "-.", "$K_N^{sink}$ (q95)", per_n=True)),
              logy=True),
        Panel("(c) precision and its lower bounds", r"$P(r_{\max}, N)$",
              (Line("precision", "-", "actual"), Line("precision_bound", ":", "bound (worst case)"),
               Line("precision_bound_q95", "-.", "bound (q95 constants)")), ylim=UNIT),
        Panel("(d) recall and its lower bounds", r"$R(r_{\min}, N)$",
              (Line("recall", "-", "actual"), Line("recall_bound", ":", "bound (worst case)"),
               Line("recall_bound_q95", "-.", "bound (q95 constants)")), ylim=UNIT),
    ), ncols=2)


SUMMARY = "summary"

FIGURES = (
    FigureSpec("illustration", "Top-N geometric separability",
               "Illustrative 2D example (synthetic): values on a circle, contributions y_i = α_i v_i, "
               "top-N (stars), and the balls of radius r_max and r_min around s_N.", illustration),
    FigureSpec("precision_recall", "Top-N geometric separability",
               "Geometric precision P(r_max,N) and recall R(r_min,N) of top-N selection (solid), "
               "random-N control (dashed) and sink-aware lower bound (dotted).",
               precision_recall, requires(SUMMARY, "precision", "recall")),
    FigureSpec("precision_recall_by_length", "Top-N geometric separability",
               "Precision and recall per context length L, models as colours, pooled over datasets.",
               by_context_length, requires(SUMMARY, "precision", "recall")),
    FigureSpec("precision_recall_by_dataset", "Top-N geometric separability",
               "Precision and recall per dataset, models as colours, pooled over context lengths.",
               by_dataset, requires(SUMMARY, "precision", "recall")),
    FigureSpec("leave_one_out", "Leave-one-out control",
               "Contrastive leave-one-out margin M_N^loo (left) and fraction of selected tokens with "
               "positive leave-one-out cosine (right).",
               leave_one_out, requires(SUMMARY, "loo_margin", "loo_positive_frac")),
    FigureSpec("distance_margin", "Leave-one-out control",
               "Strict distance leave-one-out margin γ_N^loo = min_U ||y_j − s_N|| − max_I ||y_i − s_{N,−i}||.",
               distance_margin, requires(SUMMARY, "loo_distance_margin")),
    FigureSpec("certificate", "Exact certificate",
               "Paper's sink-aware bound vs the exact certificate: violation rates (A_N > K), mean pair "
               "counts over N, and precision/recall against their bounds (worst-case and q95 constants).",
               certificate, requires(SUMMARY, "bound_violation", "certificate_violation", "k_sink_exact")),
)
