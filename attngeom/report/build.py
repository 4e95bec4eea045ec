"""``attngeom report``: every figure and table of the paper from a store, and index.html.

Each figure or table declares what it needs; it is drawn from the runs that have it, and a
run lacking it (no analysis, no ablation yet) gives a note on the page instead of a crash.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import matplotlib

from attngeom.errors import DamagedStoreError, InputError
from attngeom.report import figures_geometry, figures_heads, figures_queries, figures_sink, figures_values, html, tables
from attngeom.report.data import Requirement, RunData, load_runs
from attngeom.report.plots import RC
from attngeom.report.spec import FigureSpec, TableSpec

FIGURES: tuple[FigureSpec, ...] = (
    *figures_geometry.FIGURES, *figures_sink.FIGURES, *figures_values.FIGURES, *figures_heads.FIGURES,
    *figures_queries.FIGURES,
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


def _entry(spec: FigureSpec | TableSpec, runs: Sequence[RunData], kind: str, make) -> html.Entry:
    """The page entry of ``spec``: ``make(chosen runs)`` gives its content (Entry fields).

    Later stages' groups are read as they are found; an unexpected layout must cost this
    figure or table only, with the reason on the page, not the whole report. A damaged
    store is no layout: it ends the report (one line, naming the chunk).
    """
    chosen, notes = select_runs(spec.needs, runs)
    if spec.needs is not None and not chosen:
        return html.Entry(spec.name, spec.section, spec.caption, notes=tuple(notes))
    try:
        content = make(chosen)
    except DamagedStoreError:
        raise
    except Exception as exc:  # noqa: BLE001
        return html.Entry(spec.name, spec.section, spec.caption, notes=(*notes, _failure(kind, exc)))
    return html.Entry(spec.name, spec.section, spec.caption, notes=tuple(notes), **content)


def draw_figure(spec: FigureSpec, runs: Sequence[RunData], out: Path) -> html.Entry:
    """Draw ``spec`` from the runs that have its inputs and save ``<name>.png`` in ``out``."""

    def make(chosen: Sequence[RunData]) -> dict:
        with matplotlib.rc_context(RC):
            spec.draw(chosen).savefig(out / f"{spec.name}.png")
        return {"image": f"{spec.name}.png"}

    return _entry(spec, runs, "figure", make)


def make_table(spec: TableSpec, runs: Sequence[RunData], out: Path) -> html.Entry:
    """Make ``spec`` from the runs that have its inputs; write ``<name>.md`` and ``<name>.csv``."""

    def make(chosen: Sequence[RunData]) -> dict:
        frame = spec.make(chosen)
        return {"table": frame, "files": tuple(tables.write(frame, out, spec.name))}

    return _entry(spec, runs, "table", make)


def build_report(store: str, out: Path) -> Path:
    """Write every figure (PNG), table (Markdown, CSV) and ``index.html`` into ``out``.

    Needs no model. Returns the path of ``index.html``. ``out`` is created only once the
    store has been read, and removed again if it was new and the report fails.
    """
    out = Path(out)
    runs = load_runs(store)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out} cannot be made a folder ({exc.strerror or exc})") from exc
    try:
        entries = [draw_figure(spec, runs, out) for spec in FIGURES]
        entries += [make_table(spec, runs, out) for spec in TABLES]
        index = out / "index.html"
        index.write_text(html.render(store, len(runs), entries, _summary_notes(entries)), encoding="utf-8")
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return index


def _summary_notes(entries: Sequence[html.Entry]) -> list[str]:
    """The page's list of missing inputs: each distinct note once, with the items it affects."""
    affected: dict[str, list[str]] = {}
    for entry in entries:
        for note in entry.notes:
            affected.setdefault(note, []).append(entry.name)
    return [f"{note} — affects {', '.join(names)}" for note, names in affected.items()]
