"""The report's tables as DataFrames, and their Markdown and CSV forms."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import dask
import dask.threaded
import numpy as np
import pandas as pd
import xarray as xr

from attngeom.detect.head_classes import CRITERIA, SCORES, class_counts, regimes_of, run_scores, share
from attngeom.report.data import (
    RunData,
    all_of,
    has_field_scores,
    has_learned_sinks,
    labels,
    regime_counts,
    requires,
    table_frame,
)
from attngeom.report.spec import TableSpec
from attngeom.store import REGIMES

COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact")


def _identity(run: RunData) -> dict[str, object]:
    return {"run": run.run_id, "model": run.model_id, "dataset": run.dataset_id}


MODEL_COLUMNS = (
    "run", "model", "dataset", "L", "dtype", "layers", "heads", "kv heads", "sequences", "analysis", "ablation",
)


def models(runs: Sequence[RunData]) -> pd.DataFrame:
    """One row per run: model, dataset, context length, compute dtype, geometry, sequences,
    stages present."""
    rows = [
        {**_identity(r), "L": r.context_length, "dtype": r.compute_dtype, "layers": r.n_layers, "heads": r.n_heads,
         "kv heads": r.n_kv_heads, "sequences": r.sequences,
         "analysis": "yes" if r.summary is not None else "no",
         "ablation": ", ".join(sorted(r.ablation)) or "no"}
        for r in runs
    ]
    return pd.DataFrame(rows, columns=list(MODEL_COLUMNS))


def taxonomy_distribution(runs: Sequence[RunData]) -> pd.DataFrame:
    """Heads per regime and their share, per run (the paper's taxonomy table)."""
    rows = []
    for run in runs:
        counts = regime_counts(run)
        total = sum(counts.values())
        row: dict[str, object] = {**_identity(run), "L": run.context_length, "total": total}
        for regime in REGIMES:
            row[regime] = counts[regime]
            row[f"{regime} %"] = round(100.0 * counts[regime] / total, 1) if total else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def two_sinks(runs: Sequence[RunData]) -> pd.DataFrame:
    """Per run with learned sinks and per layer: the mean weight of key 0 and of the learned
    sink over its heads, queries i >= 1 and sequences (docs/method.md#learned-sinks)."""
    rows = []
    for run in runs:
        scores = run.head_scores
        for layer in scores["layer"].values:
            at = scores.sel(layer=layer)
            rows.append({**_identity(run), "layer": int(layer),
                         "key 0 (BOS)": round(float(at["sink_score"].mean()), 4),
                         "learned sink": round(float(at["learned_sink_score"].mean()), 4)})
    return pd.DataFrame(rows)


def _with_identity(run: RunData, frame: pd.DataFrame, first: Sequence[str]) -> pd.DataFrame:
    """``frame`` behind the run's identity columns, the columns ``first`` leading."""
    leading = [c for c in first if c in frame.columns]
    frame = frame[leading + [c for c in frame.columns if c not in leading]].reset_index(drop=True)
    return pd.concat([pd.DataFrame([_identity(run)] * len(frame)), frame], axis=1)


def ablation_correlations(runs: Sequence[RunData]) -> pd.DataFrame:
    """Head diagnostics against single-head Delta NLL, strongest Spearman first within a run."""
    parts = []
    for run in runs:
        frame = table_frame(run.ablation["correlations"]).drop(columns=["row"], errors="ignore")
        if "spearman_r" in frame:
            frame = frame.iloc[np.argsort(-frame["spearman_r"].abs().to_numpy(), kind="stable")]
        parts.append(_with_identity(run, frame, ("diagnostic", "spearman_r", "spearman_p", "pearson_r", "pearson_p")))
    return pd.concat(parts, ignore_index=True)


def regime_impact(runs: Sequence[RunData]) -> pd.DataFrame:
    """Mean and median single-head Delta NLL of each regime's heads."""
    rows = []
    for run in runs:
        assert run.heads is not None
        impact, regime = xr.align(run.ablation["single"]["delta_nll_mean"], run.heads["regime"])
        regimes = labels(regime)
        values = impact.transpose(*regime.dims).to_numpy().ravel()
        for name in REGIMES:
            chosen = values[(regimes == name) & np.isfinite(values)]
            rows.append({**_identity(run), "regime": name, "heads": int(np.sum(regimes == name)),
                         "mean ΔNLL (nats)": float(chosen.mean()) if chosen.size else math.nan,
                         "median ΔNLL (nats)": float(np.median(chosen)) if chosen.size else math.nan})
    return pd.DataFrame(rows)


def critical_heads(runs: Sequence[RunData]) -> pd.DataFrame:
    """The ablation stage's critical heads, as it lists them."""
    parts = []
    for run in runs:
        parts.append(_with_identity(run, table_frame(run.ablation["critical"]), ("layer", "head", "delta_nll_mean")))
    return pd.concat(parts, ignore_index=True)


def certificate(runs: Sequence[RunData]) -> pd.DataFrame:
    """Per run and N: violations of the paper's bound (worst-case and q95 constants) and of the
    exact certificate (always 0), and the mean counts they compare.

    Reduced out of core from ``analysis/topn`` (Dask, threads); -1 marks an undefined count.
    """
    rows = []
    for run in runs:
        topn = run.topn
        assert topn is not None
        dims = ["seq", "layer", "head"]
        inv, exact = topn["inversions"], topn["k_sink_exact"]
        bounds = {"K_sink": topn["k_sink"], "K_sink (q95)": topn["k_sink_q95"], "K_exact": exact}
        reduced: dict[str, xr.DataArray] = {"instances": (exact >= 0).sum(dims)}
        for name, k in bounds.items():
            reduced[f"A_N > {name}"] = ((inv > k) & (k >= 0)).sum(dims)
        reduced["mean A_N"] = inv.where(inv >= 0).mean(dims)
        for name, k in bounds.items():
            reduced[f"mean {name}"] = k.where(k >= 0).mean(dims)
        reduced["mean A_N / K_exact"] = (inv / exact.where(exact > 0)).mean(dims)
        # A function, not the name "threads": a name makes dask import dask.distributed.
        with dask.config.set(scheduler=dask.threaded.get):
            (computed,) = dask.compute(xr.Dataset(reduced))
        rows.append(_with_identity(run, computed.to_dataframe().reset_index().rename(columns={"n": "N"}), ()))
    return pd.concat(rows, ignore_index=True)


def field_medians(runs: Sequence[RunData]) -> pd.DataFrame:
    """Per run and regime: the regime's heads and the median of each field score over them
    (NaN where the run lacks the score or no head of the regime has a value)."""
    rows = []
    for run in runs:
        assert run.heads is not None
        regimes = regimes_of(run.heads).ravel()
        scores = run_scores(run.head_scores, run.detect)
        for regime in REGIMES:
            chosen = regimes == regime
            row: dict[str, object] = {**_identity(run), "regime": regime, "heads": int(chosen.sum())}
            for score in SCORES:
                values = scores[score.name].values.ravel()[chosen] if score.name in scores else np.array([])
                values = values[np.isfinite(values)]
                row[score.name] = float(np.median(values)) if values.size else math.nan
            rows.append(row)
    frame = pd.DataFrame(rows)
    # A score no run has is no column.
    return frame.dropna(axis=1, how="all")


def field_classes(runs: Sequence[RunData]) -> pd.DataFrame:
    """Per run and field class: its rule, how many heads pass it, how many of them are of each
    regime, and which share of each regime's heads passes it."""
    rows = []
    for run in runs:
        assert run.heads is not None
        regimes = regimes_of(run.heads).ravel()
        sizes = {r: int(np.sum(regimes == r)) for r in REGIMES}
        scores = run_scores(run.head_scores, run.detect)
        for c in CRITERIA:
            if c.score not in scores:
                continue
            values = scores[c.score].values.ravel()
            row: dict[str, object] = {**_identity(run), "class": c.name, "rule": c.rule}
            if not np.isfinite(values).any():
                # Not "0 heads": the run's L cannot define the score (distant mass at W needs L > 2W).
                row["heads"] = f"needs L > 2W (L = {run.context_length})"
                rows.append(row)
                continue
            passes = c.passes(values)
            counts = class_counts(regimes, passes)
            row["heads"] = int(passes.sum())
            row.update({regime: counts[regime] for regime in REGIMES})
            row.update({f"% of {regime}": share(counts[regime], sizes[regime]) for regime in REGIMES})
            rows.append(row)
    return pd.DataFrame(rows)


def field_criteria(_: Sequence[RunData]) -> pd.DataFrame:
    """The field's classes: rule, group and where the threshold comes from."""
    return pd.DataFrame([{"class": c.name, "rule": c.rule, "regime read beside": c.regime or "",
                          "source of the threshold": c.source} for c in CRITERIA])


# What a Markdown cell must not hold raw: a store's strings (a model id, a run's corpus) are a
# stranger's, and a renderer would take "<script>" or a backtick for markup, "|" for a column
# and a line break for the table's end; a backslash, which escapes the others, is doubled.
_MARKDOWN = {"\\": "\\\\", "|": "\\|", "`": "\\`", "&": "&amp;", "<": "&lt;", ">": "&gt;"}
# Cells a spreadsheet application runs as a formula (CSV injection): those starting so.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(x: object) -> str:
    """A Markdown table cell: a number to 4 significant figures, text with its markup escaped
    and its line breaks made spaces."""
    if isinstance(x, (float, np.floating)):
        return "" if math.isnan(x) else f"{x:.4g}"
    text = "".join(_MARKDOWN.get(c, c) for c in str(x))
    return " ".join(text.splitlines())


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table, numbers right-aligned."""
    numeric = [frame[c].dtype.kind in "iuf" for c in frame.columns]
    header = "| " + " | ".join(_cell(c) for c in frame.columns) + " |"
    rule = "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"
    body = ["| " + " | ".join(_cell(x) for x in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


def _inert(x: object) -> object:
    """A CSV cell that no spreadsheet application runs: text starting as a formula gets a
    leading apostrophe (which those applications show as text), as OWASP advises."""
    return f"'{x}" if isinstance(x, str) and x.startswith(_FORMULA_STARTS) else x


def to_csv(frame: pd.DataFrame, path: Path) -> None:
    """``frame`` as CSV at ``path``: every text cell and name quoted, none a formula."""
    inert = frame.rename(columns=_inert)
    for i, dtype in enumerate(inert.dtypes):
        if dtype.kind not in "iufb":
            inert.isetitem(i, inert.iloc[:, i].map(_inert))
    inert.to_csv(path, index=False, quoting=csv.QUOTE_NONNUMERIC)


def write(frame: pd.DataFrame, out: Path, name: str) -> list[str]:
    """``name``.md and ``name``.csv in ``out``; returns their file names."""
    (out / f"{name}.md").write_text(to_markdown(frame), encoding="utf-8")
    to_csv(frame, out / f"{name}.csv")
    return [f"{name}.md", f"{name}.csv"]


TABLES = (
    TableSpec("models", "Models", "Runs of the store: model, dataset, context length L, attention geometry, "
              "completed sequences, and which later stages have written results.", models),
    TableSpec("certificate_violations", "Exact certificate",
              "Per N: instances where the inversions A_N exceed the paper's K_N^sink (worst-case and q95 "
              "constants) or the exact certificate K_N^exact (never), and mean counts.",
              certificate, requires("topn", *COUNTS)),
    TableSpec("two_sinks", "Attention sink geometry",
              "For a model with learned sinks: the mean weight of each layer's two sinks, key 0 (BOS) and the learned "
              "sink, over heads, queries and sequences; the rows on real keys sum to 1 minus the learned sink's.",
              two_sinks, has_learned_sinks),
    TableSpec("taxonomy_distribution", "Head taxonomy",
              "Distribution of the parameter-free head regimes per model and corpus.",
              taxonomy_distribution, requires("heads", "regime")),
    TableSpec("field_criteria", "Heads of the field",
              "The field's head classes, each a threshold on one score, and where each threshold comes from "
              "(docs/method.md#field-classes).", field_criteria),
    TableSpec("field_medians", "Heads of the field",
              "Median of each field score over the heads of each regime.",
              field_medians, has_field_scores()),
    TableSpec("field_classes", "Heads of the field",
              "Heads passing each field criterion: in all, per regime, and as a share of each regime's heads.",
              field_classes, has_field_scores()),
    TableSpec("ablation_correlations", "Ablation and sparsification",
              "Correlations (Spearman, Pearson) between head diagnostics and single-head ablation ΔNLL.",
              ablation_correlations, requires("correlations")),
    TableSpec("regime_impact", "Ablation and sparsification",
              "Mean and median single-head ablation ΔNLL per regime.",
              regime_impact, all_of(requires("heads", "regime"), requires("single", "delta_nll_mean"))),
    TableSpec("critical_heads", "Ablation and sparsification",
              "Critical heads found by the ablation stage (single-head impact an outlier).",
              critical_heads, requires("critical")),
)
