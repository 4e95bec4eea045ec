"""Figures of the field's head scores beside the paper's regimes: each score's distribution
per regime, and the scores on the layer x head grid (docs/method.md#field-classes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from attngeom.detect.head_classes import CRITERIA, DETECT, HEAD_SCORES, SCORES, regimes_of, run_scores
from attngeom.analyze.palette import REGIME_COLORS
from attngeom.report.data import RunData, all_of, requires
from attngeom.report.plots import UNIT, color_legend, new_figure, no_data, short_label
from attngeom.report.spec import FigureSpec
from attngeom.store import REGIMES

SECTION = "Heads of the field"
THRESHOLDS = {c.score: c for c in CRITERIA}


def _names(group: str) -> list[str]:
    return [s.name for s in SCORES if s.group == group]


def _labels() -> dict[str, str]:
    return {s.name: s.label for s in SCORES}


def by_regime(runs: Sequence[RunData], group: str) -> Figure:
    """A panel per score of ``group``: per run, a box of its heads' values per regime, the
    criterion's threshold dashed."""
    names = _names(group)
    labels = _labels()
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    width = max(4.2, 1.0 + 1.3 * len(runs)) * ncols
    fig, axes = new_figure(nrows, ncols, width=width, height=3.3 * nrows + 0.4)
    width_box = 0.8 / len(REGIMES)
    for ax, name in zip(axes.flat, names):
        for i, run in enumerate(runs):
            assert run.heads is not None
            values = run_scores(run.head_scores, run.detect).get(name)
            if values is None:
                continue
            regimes = regimes_of(run.heads).ravel()
            flat = values.values.ravel()
            for k, regime in enumerate(REGIMES):
                chosen = flat[(regimes == regime) & np.isfinite(flat)]
                if chosen.size == 0:
                    continue
                at = i + (k - 1) * width_box
                box = ax.boxplot(chosen, positions=[at], widths=width_box * 0.85, patch_artist=True,
                                 showfliers=False)
                for patch in box["boxes"]:
                    patch.set(facecolor=REGIME_COLORS[regime], alpha=0.55)
                for median in box["medians"]:
                    median.set_color("black")
                # Every head as a point: a regime may hold one head or a few.
                jitter = (np.random.default_rng(k).random(chosen.size) - 0.5) * width_box * 0.6
                ax.scatter(at + jitter, chosen, s=6, color=REGIME_COLORS[regime], edgecolor="0.2",
                           linewidth=0.3, zorder=3)
        if not ax.patches:
            no_data(ax, "L ≤ 2W in every run" if name.startswith("distant_mass") else "")
        criterion = THRESHOLDS.get(name)
        if criterion is not None:
            ax.axhline(criterion.threshold, color="0.3", linestyle="--", linewidth=0.9)
            ax.text(0.99, criterion.threshold, f" {criterion.name}: {criterion.rule}",
                    transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=7, color="0.25",
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1}, zorder=4)
        ax.set_xticks(range(len(runs)), [short_label(r) for r in runs])
        ax.set_xlim(-0.6, len(runs) - 0.4)
        ax.set_ylim(*UNIT)
        ax.grid(axis="x", visible=False)
        ax.set_title(labels[name])
        ax.set_ylabel("score per head")
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    color_legend(fig, list(REGIME_COLORS.items()))
    return fig


def grid(runs: Sequence[RunData], group: str) -> Figure:
    """Per run (rows): the regime of every (layer, head), then each score of ``group`` on the
    same grid, on one colour scale [0, 1]."""
    names = _names(group)
    labels = _labels()
    ncols = 1 + len(names)
    first = runs[0]
    cell = min(0.3, 10.0 / max(first.n_heads * ncols, 1))
    panel_w = max(1.6, cell * first.n_heads + 0.6)
    panel_h = max(2.0, min(6.0, 0.12 * first.n_layers + 1.2))
    fig, axes = new_figure(len(runs), ncols, width=panel_w * ncols + 1.2, height=panel_h * len(runs) + 0.8)
    regime_map = ListedColormap([REGIME_COLORS[r] for r in REGIMES])
    image = None
    for row, run in zip(axes, runs):
        assert run.heads is not None
        regimes = regimes_of(run.heads)
        codes = np.vectorize(lambda r: REGIMES.index(r) if r in REGIMES else -1)(regimes).astype(float)
        codes[codes < 0] = np.nan
        row[0].imshow(codes, cmap=regime_map, vmin=-0.5, vmax=len(REGIMES) - 0.5, aspect="auto",
                      interpolation="nearest")
        row[0].set_title(f"regime\n{run.model} · {run.dataset} · L={run.context_length}", fontsize=8)
        scores = run_scores(run.head_scores, run.detect)
        for ax, name in zip(row[1:], names):
            if name in scores and np.isfinite(scores[name].values).any():
                image = ax.imshow(scores[name].values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                                  interpolation="nearest")
            else:
                no_data(ax)
            ax.set_title(labels[name], fontsize=8)
        for ax in row:
            ax.grid(False)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if image is not None:
        fig.colorbar(image, ax=axes[:, 1:].ravel().tolist(), shrink=0.8, label="score")
    color_legend(fig, list(REGIME_COLORS.items()))
    return fig


def _text(runs: Sequence[RunData]) -> Figure:
    return by_regime(runs, HEAD_SCORES)


def _probe(runs: Sequence[RunData]) -> Figure:
    return by_regime(runs, DETECT)


def _text_grid(runs: Sequence[RunData]) -> Figure:
    return grid(runs, HEAD_SCORES)


def _probe_grid(runs: Sequence[RunData]) -> Figure:
    return grid(runs, DETECT)


HAS_TEXT = all_of(requires("heads", "regime"), requires(HEAD_SCORES, "sink_score", "prev_token_score", "distant_mass"))
HAS_PROBE = all_of(requires("heads", "regime"),
                   requires(DETECT, "duplicate_score", "induction_score", "prev_token_score", "retrieval_score"))

FIGURES = (
    FigureSpec("field_scores", SECTION,
               "The field's scores on the run's own text, per head and regime: mass on the sink (sink_score), on "
               "the previous token (prev_token_score), and outside the sink and the last W keys (distant_mass); "
               "dashed, the thresholds of the field's classes.",
               _text, HAS_TEXT),
    FigureSpec("detect_scores", SECTION,
               "The field's probe scores per head and regime: on repeated random tokens, the weight on the "
               "earlier copy of the token (duplicate), on the token after it (induction) and on the previous "
               "token; and the fraction of copy-paste steps whose top-1 key is the needle's next token "
               "(retrieval).",
               _probe, HAS_PROBE),
    FigureSpec("field_scores_grid", SECTION,
               "The regimes and the text scores on the layer × head grid, one colour scale [0, 1].",
               _text_grid, HAS_TEXT),
    FigureSpec("detect_scores_grid", SECTION,
               "The regimes and the probe scores on the layer × head grid, one colour scale [0, 1].",
               _probe_grid, HAS_PROBE),
)
