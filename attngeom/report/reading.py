"""The report's opening, "How to read this report": the question each section answers, and the
store's headline findings computed from its data, each pointing at the item it comes from
and at the part of docs/method.md that defines it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from attngeom.report.data import RunData, regime_counts
from attngeom.store import REGIMES

__all__ = ["QUESTIONS", "Finding", "findings"]

# Section -> (what it answers, where docs/method.md defines it); every section of spec.SECTIONS.
QUESTIONS: dict[str, tuple[str, str]] = {
    "Models": ("Which runs the store holds (model, corpus, L, compute dtype, shapes) and which stages ran on "
               "each.", "docs/method.md#pipeline"),
    "Top-N geometric separability": ("Do the N keys a head attends to most sit apart from the others in value "
                                     "space? Precision, recall and F of the top-N set against N random keys.",
                                     "docs/method.md#precision-recall-and-f"),
    "Attention sink geometry": ("How the sink's value (position 0) compares with the others: its norm ratio "
                                "lambda, its cosines, and what leaving it out changes.",
                                "docs/method.md#sink-excluded-variant"),
    "Value norms and coherence": ("How much value norms vary across keys, and how aligned the selected "
                                  "contributions are.", "docs/method.md#norms-and-coherence"),
    "Sink diagnostics": ("How often the sink is among the top N, and how far it moves the aggregate when it is.",
                         "docs/method.md#sink-diagnostics"),
    "Leave-one-out control": ("Does each selected key matter? The margin of the aggregate when one key is "
                              "left out.", "docs/method.md#leave-one-out"),
    "Exact certificate": ("How often the paper's bound on inversions is exceeded, beside the exact certificate, "
                          "which never is.", "docs/method.md#exact-certificate"),
    "Head taxonomy": ("Which heads retrieve, mix or reset (Retriever, Mixer, Reset), and the signatures that "
                      "tell them apart.", "docs/method.md#head-taxonomy"),
    "Geometry along the context": ("The same separability at earlier queries, for runs extracted with "
                                   "--queries.", "docs/method.md#any-query"),
    "Heads of the field": ("How the field's head classes (sink, previous-token, streaming, induction, "
                           "retrieval heads) line up with the regimes.", "docs/method.md#field-classes"),
    "Ablation and sparsification": ("How much each head matters to the next token's loss, and which heads a "
                                    "layer can lose.", "docs/method.md#ablation"),
}


@dataclass(frozen=True)
class Finding:
    """One headline finding: its sentence, the page item it comes from, where docs/method.md defines it."""

    text: str
    item: str
    method: str


def _share(k: int, n: int) -> str:
    return f"{k} ({100.0 * k / n:.0f}%)" if n else str(k)


def _regimes(run: RunData) -> Finding:
    counts = regime_counts(run)
    total = sum(counts.values())
    shares = ", ".join(f"{_share(counts[r], total)} {r}s" for r in REGIMES)
    return Finding(f"Run {run.run_id}: of its {total} heads, {shares}.", "taxonomy_distribution",
                   "docs/method.md#head-taxonomy")


def _ns(ns: Sequence[int]) -> str:
    return f"N = {', '.join(map(str, ns))}"


def _above_random(run: RunData) -> Finding | None:
    summary = run.summary
    if summary is None or "f_score" not in summary or "random_f_score" not in summary:
        return None
    top = summary["f_score"].sel(stat="mean").mean(["layer", "head"]).values
    rand = summary["random_f_score"].sel(stat="mean").mean(["layer", "head"]).values
    ns = summary["n"].values
    # Where F does not tell them apart (both 1 at N = 1 in the demo's run), they are said equal.
    equal = np.isclose(top, rand)
    above = [int(n) for n, t, r, e in zip(ns, top, rand, equal) if t > r and not e]
    level = [int(n) for n, e in zip(ns, equal) if e]
    below = [int(n) for n in ns if int(n) not in above and int(n) not in level]
    widest = int(np.nanargmax(top - rand))
    at = f"F_{ns[widest]} {top[widest]:.2f} against {rand[widest]:.2f}"
    parts = []
    if above:
        parts.append(f"above random at {'every N' if len(above) == len(ns) else _ns(above)} ({at}, the widest gap)")
    if level:
        parts.append(f"equal to it at {_ns(level)}")
    if below:
        parts.append(f"below it at {_ns(below)}")
    verdict = ", ".join(parts)
    return Finding(f"Run {run.run_id}: top-N selection, averaged over heads, is {verdict}.", "precision_recall",
                   "docs/method.md#random-control")


def _certificate(run_id: str, table: pd.DataFrame) -> Finding:
    rows = table[table["run"] == run_id]
    instances = int(rows["instances"].sum())
    bound, q95, exact = (int(rows[c].sum()) for c in ("A_N > K_sink", "A_N > K_sink (q95)", "A_N > K_exact"))
    return Finding(
        f"Run {run_id}: the paper's bound on inversions is exceeded in {bound} of {instances} "
        f"(sequence, layer, head, N) instances, {q95} with its q95 constants; the exact certificate in {exact}"
        + (" (as it must be)." if exact == 0 else "."),
        "certificate_violations", "docs/method.md#sink-aware-bound",
    )


def findings(runs: Sequence[RunData], tables: Mapping[str, pd.DataFrame]) -> list[Finding]:
    """The headline findings of the analyzed ``runs``: each regime's share of heads, whether
    top-N selection is above random, and the certificate's violations (from the page's
    ``certificate_violations`` table, when it was made)."""
    said = []
    violations = tables.get("certificate_violations")
    for run in runs:
        if run.heads is not None and "regime" in run.heads:
            said.append(_regimes(run))
        if (above := _above_random(run)) is not None:
            said.append(above)
        if violations is not None and run.run_id in set(violations["run"]):
            said.append(_certificate(run.run_id, violations))
    return said
