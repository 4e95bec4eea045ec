"""``attngeom taxonomy``: the head regimes of every analyzed run, read from the store, and the
tables it prints (docs/method.md#head-taxonomy)."""

from __future__ import annotations

import numpy as np

from attngeom.store import ANALYSIS, REGIMES
from attngeom.store.session import StoreSession

__all__ = ["cross_corpus", "distribution", "format_tables", "run_regimes"]


def run_regimes(session: StoreSession) -> dict[str, tuple[str, str, np.ndarray]]:
    """Run id -> (model, dataset, regime names (layer, head)) for every analyzed run of the
    ``session``'s store.

    Raises :class:`IncompleteGroupError` for a run whose analysis is not finished."""
    out = {}
    for run in session.readers():
        heads = run.derived(ANALYSIS, "heads", missing_ok=True)
        if heads is None or "regime" not in heads:
            continue
        prov = run.provenance
        out[run.id] = (prov["model"]["id"], prov["dataset"]["id"], np.asarray(heads["regime"].values, dtype=object))
    return out


def distribution(labels: dict[str, tuple[str, str, np.ndarray]]) -> list[dict[str, object]]:
    """The paper's distribution table: one row per run.

    labels: run id -> (model, dataset, regime names (layer, head)). Each row has run, model,
    dataset, total and, per regime, its count and percentage of the heads.
    """
    rows = []
    for run_id, (model, dataset, regime) in labels.items():
        row: dict[str, object] = {"run": run_id, "model": model, "dataset": dataset, "total": int(regime.size)}
        for name in REGIMES:
            count = int((regime == name).sum())
            row[name] = count
            row[f"{name}_pct"] = 100.0 * count / regime.size
        rows.append(row)
    return rows


def cross_corpus(labels: dict[str, tuple[str, str, np.ndarray]]) -> list[dict[str, object]]:
    """For every two runs of one model on two corpora: per-regime difference in percentage
    points (first minus second) and the share of heads whose label agrees."""
    rows = []
    runs = sorted(labels)
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            (model_a, data_a, reg_a), (model_b, data_b, reg_b) = labels[a], labels[b]
            if model_a != model_b or data_a == data_b or reg_a.shape != reg_b.shape:
                continue
            row: dict[str, object] = {"model": model_a, "datasets": f"{data_a} - {data_b}"}
            for name in REGIMES:
                row[f"{name}_pp"] = 100.0 * ((reg_a == name).mean() - (reg_b == name).mean())
            row["agreement"] = float((reg_a == reg_b).mean())
            rows.append(row)
    return rows


def format_tables(labels: dict[str, tuple[str, str, np.ndarray]]) -> str:
    """Both tables as aligned text, as ``attngeom taxonomy`` prints them."""
    lines = [f"{'model':<22} {'dataset':<16} {'total':>5} " + " ".join(f"{n:>15}" for n in REGIMES)]
    for row in distribution(labels):
        cells = " ".join(f"{row[n]:>6} ({row[f'{n}_pct']:5.1f}%)" for n in REGIMES)
        lines.append(f"{row['model']:<22} {row['dataset']:<16} {row['total']:>5} {cells}")
    pairs = cross_corpus(labels)
    if pairs:
        lines += ["", f"{'model':<22} {'datasets':<33} " + " ".join(f"{n + ' pp':>13}" for n in REGIMES) + "  agreement"]
        for row in pairs:
            cells = " ".join(f"{row[f'{n}_pp']:>+13.1f}" for n in REGIMES)
            lines.append(f"{row['model']:<22} {row['datasets']:<33} {cells}  {row['agreement']:>9.1%}")
    return "\n".join(lines)
