"""Figures of the head taxonomy and of the ablation stage: regime shares, mechanistic
signatures per regime, sparsification curves, and the critical-head diagnostic."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from attngeom.analyze.palette import REGIME_COLORS
from attngeom.report.data import (
    RunData,
    all_of,
    critical_heads,
    labels,
    regime_counts,
    requires,
)
from attngeom.report.plots import (
    color_legend,
    n_axis,
    new_figure,
    short_label,
)
from attngeom.report.spec import FigureSpec
from attngeom.store import REGIMES

TAXONOMY = "Head taxonomy"
ABLATION = "Ablation and sparsification"
SIGNATURE_NORMS = (("s_norm", "-", r"$\|s(N)\|$"), ("s_norm_nosink", "-.", "without sink"),
                   ("s_norm_nocurrent", "--", "without current token"))
SIGNATURE_COSINES = (("cos_s_v0", "-", r"$\cos(s_N, v_0)$"), ("cos_s_vlast", "--", r"$\cos(s_N, v_{L-1})$"))


def taxonomy(runs: Sequence[RunData]) -> Figure:
    """Stacked regime shares per run (model and corpus)."""
    fig, axes = new_figure(1, 1, width=max(5.0, 1.0 + 1.2 * len(runs)), height=4.0)
    ax = axes[0, 0]
    bottom = np.zeros(len(runs))
    shares = []
    for run in runs:
        counts = regime_counts(run)
        total = max(sum(counts.values()), 1)
        shares.append([100.0 * counts[r] / total for r in REGIMES])
    shares_arr = np.asarray(shares)
    for k, regime in enumerate(REGIMES):
        bars = ax.bar(range(len(runs)), shares_arr[:, k], bottom=bottom, color=REGIME_COLORS[regime],
                      width=0.7)
        ax.bar_label(bars, labels=[f"{v:.1f}%" if v >= 4 else "" for v in shares_arr[:, k]],
                     label_type="center", fontsize=7, color="white")
        bottom += shares_arr[:, k]
    ax.set_xticks(range(len(runs)), [short_label(r) for r in runs])
    ax.set_ylabel("share of heads (%)")
    ax.set_ylim(0, 100)
    ax.grid(axis="x", visible=False)
    ax.set_title("(a) parameter-free head regimes")
    color_legend(fig, list(REGIME_COLORS.items()))
    return fig


def signatures(runs: Sequence[RunData]) -> Figure:
    """Per run (columns): normalized aggregate norms (top) and alignments (bottom) per regime."""
    fig, axes = new_figure(2, len(runs), height=6.4)
    for col, run in enumerate(runs):
        sig = run.signatures
        assert sig is not None
        n = sig["n"].to_numpy()
        names = labels(sig["regime"])
        for row, lines in enumerate((SIGNATURE_NORMS, SIGNATURE_COSINES)):
            ax = axes[row, col]
            for i, regime in enumerate(names):
                for var, style, _ in lines:
                    if var in sig:
                        ax.plot(n, sig[var].isel(regime=i).to_numpy(), linestyle=style,
                                color=REGIME_COLORS.get(regime, "0.4"))
            n_axis(ax, n)
            ax.legend(handles=[Line2D([], [], color="0.2", linestyle=s, label=m) for _, s, m in lines],
                      loc="best", frameon=False)
        axes[0, col].set_title(f"(b) {run.label}")
        axes[0, col].set_ylabel(r"$\|s\| / \|o\|$ (normalized)")
        axes[1, col].set_ylabel("cosine")
        axes[1, col].axhline(0.0, color="0.5", linewidth=0.8)
    color_legend(fig, list(REGIME_COLORS.items()))
    return fig


def sparsification(runs: Sequence[RunData]) -> Figure:
    """Delta NLL against the retained fraction of heads per layer, one line per method."""
    fig, axes = new_figure(1, len(runs), height=4.2)
    methods: dict[str, str] = {}
    for ax, run in zip(axes[0], runs):
        sweep = run.ablation["sweep"]
        retention = sweep["retention"].to_numpy()
        for i, method in enumerate(labels(sweep["method"])):
            color = methods.setdefault(method, f"C{len(methods) % 10}")
            guided = "type" in method
            mean = sweep["delta_nll_mean"].isel(method=i).to_numpy()
            ax.plot(retention, mean, color=color, marker="o", markersize=3, linewidth=2.4 if guided else 1.2,
                    zorder=3 if guided else 2)
            if "delta_nll_std" in sweep:
                std = sweep["delta_nll_std"].isel(method=i).to_numpy()
                if np.any(np.nan_to_num(std) > 0):
                    ax.fill_between(retention, mean - std, mean + std, color=color, alpha=0.15, linewidth=0)
        ax.set_xlabel("retained fraction of heads per layer")
        ax.set_ylabel(r"$\Delta$NLL (decode, nats)")
        ax.set_title(run.label)
        notes = sparsification_notes(sweep, run.n_heads)
        if notes:
            ax.text(0.02, 0.98, "\n".join(notes), transform=ax.transAxes, ha="left", va="top", fontsize=7,
                    color="0.25", zorder=4)
    color_legend(fig, list(methods.items()))
    return fig


def sparsification_notes(sweep: xr.Dataset, n_heads: int) -> list[str]:
    """What the curves hide: methods whose curves coincide (the last drawn covers the
    others), and retentions that keep every head of a layer (the intact model, as 1.0)."""
    notes = []
    names = labels(sweep["method"])
    mean = sweep["delta_nll_mean"].transpose("method", "retention").to_numpy()
    grouped: list[list[int]] = []
    for i in range(len(names)):
        same = next((g for g in grouped if np.array_equal(mean[g[0]], mean[i], equal_nan=True)), None)
        if same is None:
            grouped.append([i])
        else:
            same.append(i)
    notes += [" = ".join(names[i] for i in g) + " (one curve)" for g in grouped if len(g) > 1]
    if "kept_fraction" in sweep:
        kept = sweep["kept_fraction"].transpose("method", "retention").to_numpy()
        whole = [float(r) for r, k in zip(sweep["retention"].to_numpy(), kept.T) if r < 1 and np.all(k == 1)]
        if whole:
            notes.append(f"retention {', '.join(f'{r:g}' for r in whole)} keeps all {n_heads} heads per layer")
    return notes


CRITICAL_LISTED = 8


def critical(runs: Sequence[RunData]) -> Figure:
    """Single-head impacts sorted by size, critical heads marked in red and listed."""
    fig, axes = new_figure(1, len(runs), width=5.5 * len(runs), height=4.0)
    for ax, run in zip(axes[0], runs):
        flat = run.ablation["single"]["delta_nll_mean"].stack(pair=("layer", "head"))
        values = flat.to_numpy()
        order = np.argsort(-np.nan_to_num(values, nan=-np.inf), kind="stable")
        pairs = [(int(layer), int(head)) for layer, head in flat["pair"].values]
        marked = set(critical_heads(run))
        is_critical = np.array([pairs[i] in marked for i in order], dtype=bool)
        rank = np.arange(1, values.size + 1)
        ax.scatter(rank[~is_critical], values[order][~is_critical], color="0.35", s=10)
        ax.scatter(rank[is_critical], values[order][is_critical], color="tab:red", s=14)
        listed = [f"L{pairs[i][0]} H{pairs[i][1]}: {values[i]:.2f}" for i in order if pairs[i] in marked]
        if len(listed) > CRITICAL_LISTED:
            listed = listed[:CRITICAL_LISTED] + [f"+{len(listed) - CRITICAL_LISTED} more"]
        if listed:
            ax.text(0.97, 0.97, "\n".join(["critical heads (ΔNLL)", *listed]), transform=ax.transAxes,
                    ha="right", va="top", fontsize=7, color="tab:red")
        finite_values = values[np.isfinite(values)]
        if finite_values.size and finite_values.min() > 0:
            ax.set_yscale("log")
        else:
            # Ablating a head can lower the NLL: a symmetric log scale keeps both signs.
            ax.set_yscale("symlog", linthresh=max(1e-3, 1e-3 * float(np.abs(finite_values).max(initial=0))))
        ax.set_xlabel("head rank by single-head impact")
        ax.set_ylabel(r"single-head $\Delta$NLL (nats)")
        ax.set_title(f"{run.label}\n{len(marked)} critical head(s)")
    return fig


FIGURES = (
    FigureSpec("taxonomy", TAXONOMY,
               "Share of Retriever (diagonal winner), Mixer (sink winner) and Reset (other) heads per "
               "model and corpus (paper Algorithm 1).",
               taxonomy, requires("heads", "regime")),
    FigureSpec("signatures", TAXONOMY,
               "Mechanistic signatures per regime: normalized ||s(N)|| with its leave-one-out variants "
               "(top) and cos(s_N, v_0), cos(s_N, v_{L−1}) (bottom).",
               signatures, requires("signatures", *(v for v, _, _ in SIGNATURE_NORMS + SIGNATURE_COSINES))),
    FigureSpec("sparsification", ABLATION,
               "Decode ΔNLL when keeping a fraction of heads per layer: type-guided (thick) vs baselines; "
               "shaded bands are ± std over seeded draws.",
               sparsification, requires("sweep", "delta_nll_mean")),
    FigureSpec("critical_head_diagnostic", ABLATION,
               "Single-head ablation ΔNLL sorted by size (log scale, symmetric when some are negative); "
               "critical heads in red and listed.",
               critical, all_of(requires("single", "delta_nll_mean"), requires("critical"))),
)
