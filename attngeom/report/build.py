"""``attngeom report``: every figure and table of the paper from a store, and index.html.

Each figure or table declares what it needs; it is drawn from the runs that have it, and a
run lacking it (no analysis, no ablation yet) gives a note on the page instead of a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

from attngeom.report import figures_geometry, figures_heads, figures_sink, figures_values, html, tables
from attngeom.report.data import Requirement, RunData, load_runs
from attngeom.report.plots import RC
from attngeom.report.spec import FigureSpec, TableSpec

FIGURES: tuple[FigureSpec, ...] = (
    *figures_geometry.FIGURES, *figures_sink.FIGURES, *figures_values.FIGURES, *figures_heads.FIGURES,
)
TABLES: tuple[TableSpec, ...] = tables.TABLES


def select_runs(needs: Requirement | None, runs: Sequence[RunData]) -> tuple[list[RunData], list[str]]:
    """The runs meeting ``needs`` (every run if None), and a note for each other run."""
    chosen, notes = [], []
    for run in runs:
        reason = needs(run) if needs is not None else None
        if reason is None:
            chosen.append(run)
        else:
            notes.append(f"run {run.run_id}: {reason}")
    return chosen, notes


def _failure(kind: str, exc: Exception) -> str:
    return f"this {kind} could not be made from the store's data ({type(exc).__name__}: {exc})"


def draw_figure(spec: FigureSpec, runs: Sequence[RunData], out: Path) -> html.Entry:
    """Draw ``spec`` from the runs that have its inputs and save ``<name>.png`` in ``out``."""
    chosen, notes = select_runs(spec.needs, runs)
    entry = html.Entry(spec.name, spec.section, spec.caption, notes=tuple(notes))
    if spec.needs is not None and not chosen:
        return entry
    try:
        with matplotlib.rc_context(RC):
            figure = spec.draw(chosen)
            figure.savefig(out / f"{spec.name}.png")
    # Later stages' groups are read as they are found; an unexpected layout must cost this
    # figure only, with the reason on the page, not the whole report.
    except Exception as exc:  # noqa: BLE001
        return html.Entry(spec.name, spec.section, spec.caption, notes=(*notes, _failure("figure", exc)))
    return html.Entry(spec.name, spec.section, spec.caption, image=f"{spec.name}.png", notes=tuple(notes))


def make_table(spec: TableSpec, runs: Sequence[RunData], out: Path) -> html.Entry:
    """Make ``spec`` from the runs that have its inputs; write ``<name>.md`` and ``<name>.csv``."""
    chosen, notes = select_runs(spec.needs, runs)
    entry = html.Entry(spec.name, spec.section, spec.caption, notes=tuple(notes))
    if spec.needs is not None and not chosen:
        return entry
    try:
        frame = spec.make(chosen)
        files = tables.write(frame, out, spec.name)
    except Exception as exc:  # noqa: BLE001  (as in draw_figure)
        return html.Entry(spec.name, spec.section, spec.caption, notes=(*notes, _failure("table", exc)))
    return html.Entry(spec.name, spec.section, spec.caption, table=frame, files=tuple(files), notes=tuple(notes))


def build_report(store: str, out: Path) -> Path:
    """Write every figure (PNG), table (Markdown, CSV) and ``index.html`` into ``out``.

    Needs no model. Returns the path of ``index.html``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(store)
    entries = [draw_figure(spec, runs, out) for spec in FIGURES]
    entries += [make_table(spec, runs, out) for spec in TABLES]
    index = out / "index.html"
    index.write_text(html.render(store, len(runs), entries, _summary_notes(runs, entries)), encoding="utf-8")
    return index


def _summary_notes(runs: Sequence[RunData], entries: Sequence[html.Entry]) -> list[str]:
    """The page's list of missing inputs: each distinct note once, with the items it affects."""
    affected: dict[str, list[str]] = {}
    for entry in entries:
        for note in entry.notes:
            affected.setdefault(note, []).append(entry.name)
    notes = [] if runs else ["the store holds no run yet (run `attngeom extract`)"]
    return notes + [f"{note} — affects {', '.join(names)}" for note, names in affected.items()]
