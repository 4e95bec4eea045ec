"""``attngeom report``: every figure and table of the paper from a store, and index.html.

Each figure or table declares what it needs; it is drawn from the runs that have it, and a
run lacking it (no analysis, no ablation yet) gives a note on the page instead of a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

from attngeom.errors import DamagedStoreError, InputError
from attngeom.report import (
    agreement,
    figures_field,
    figures_geometry,
    figures_heads,
    figures_queries,
    figures_sink,
    figures_values,
    html,
    reading,
    tables,
)
from attngeom.report.data import OPTIONAL, Missing, Requirement, RunData, load_runs
from attngeom.report.plots import RC
from attngeom.report.spec import FigureSpec, TableSpec, TextSpec
from attngeom.store.objects.commands import stage_command

FIGURES: tuple[FigureSpec, ...] = (
    *figures_geometry.FIGURES, *figures_sink.FIGURES, *figures_values.FIGURES, *figures_heads.FIGURES,
    *figures_queries.FIGURES, *figures_field.FIGURES,
)
TABLES: tuple[TableSpec, ...] = tables.TABLES
TEXTS: tuple[TextSpec, ...] = agreement.TEXTS


def select_runs(needs: Requirement | None, runs: Sequence[RunData]) -> tuple[list[RunData], dict[str, Missing]]:
    """The runs meeting ``needs`` (every run if None), and what each other run lacks, by run id."""
    chosen, lacking = [], {}
    for run in runs:
        missing = needs(run) if needs is not None else None
        if missing is None:
            chosen.append(run)
        else:
            lacking[run.run_id] = missing
    return chosen, lacking


def _failure(kind: str, exc: Exception) -> str:
    return f"this {kind} could not be made from the store's data ({type(exc).__name__}: {exc})"


def _entry(spec: FigureSpec | TableSpec | TextSpec, runs: Sequence[RunData], kind: str, make) -> html.Entry:
    """The page entry of ``spec``: ``make(chosen runs)`` gives its content (Entry fields).

    Later stages' groups are read as they are found; an unexpected layout must cost this
    figure or table only, with the reason on the page, not the whole report. A damaged
    store is no layout: it ends the report (one line, naming the chunk).
    """
    chosen, lacking = select_runs(spec.needs, runs)
    entry = functools.partial(
        html.Entry, spec.name, spec.section, spec.caption, kind=kind,
        notes=tuple(f"run {run_id}: {m}" for run_id, m in lacking.items() if not m.optional),
        optional=tuple(f"run {run_id}: {m}" for run_id, m in lacking.items() if m.optional),
        stages=frozenset(m.stage for m in lacking.values()),
    )
    if spec.needs is not None and not chosen:
        return entry()
    try:
        content = make(chosen)
    except DamagedStoreError:
        raise
    except Exception as exc:  # noqa: BLE001
        failed = entry()
        return dataclasses.replace(failed, notes=(*failed.notes, _failure(kind, exc)), stages=failed.stages | {"error"})
    return entry(**content)


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


def make_text(spec: TextSpec, runs: Sequence[RunData], out: Path) -> html.Entry:
    """Make ``spec``'s sentences from the runs that have its inputs; write ``<name>.md``, a
    sentence per item."""

    def make(chosen: Sequence[RunData]) -> dict:
        lines = tuple(spec.make(chosen))
        (out / f"{spec.name}.md").write_text("".join(f"- {line}\n" for line in lines), encoding="utf-8")
        return {"text": lines, "files": (f"{spec.name}.md",)}

    return _entry(spec, runs, "text", make)


@dataclass(frozen=True)
class Report:
    """What a report wrote: ``index`` (index.html) and ``missing``, a line per command that
    would add what the page lacks (the page says it too). ``os.fspath`` gives the index."""

    index: Path
    missing: tuple[str, ...]

    def __fspath__(self) -> str:
        return str(self.index)


def build_report(store: str, out: Path) -> Report:
    """Write every figure (PNG), table (Markdown, CSV) and ``index.html`` into ``out``.

    Needs no model; prints nothing. ``out`` is created only once the store has been read,
    and removed again if it was new and the report fails.
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
        entries += [make_text(spec, runs, out) for spec in TEXTS]
        index = out / "index.html"
        tables_made = {e.name: e.table for e in entries if e.table is not None}
        page = html.render(store, len(runs), entries, _summary_notes(entries, "notes"),
                           _summary_notes(entries, "optional"), reading.findings(runs, tables_made))
        index.write_text(page, encoding="utf-8")
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return Report(index, tuple(missing_summary(store, runs, entries)))


def _summary_notes(entries: Sequence[html.Entry], field: str) -> list[str]:
    """The page's list of missing (``notes``) or optional inputs: each distinct note once,
    with the items it affects."""
    affected: dict[str, list[str]] = {}
    for entry in entries:
        for note in getattr(entry, field):
            affected.setdefault(note, []).append(entry.name)
    return [f"{note} — affects {', '.join(names)}" for note, names in affected.items()]


def _count(entries: Sequence[html.Entry], of: Sequence[html.Entry] | None = None) -> str:
    """"3 of 29 figures and 1 table": the entries by kind, each "of" its kind's total in ``of``."""
    parts = []
    for kind, one, many in (("figure", "figure", "figures"), ("table", "table", "tables"),
                            ("text", "list of statements", "lists of statements")):
        n = sum(e.kind == kind for e in entries)
        if n:
            total = f" of {sum(e.kind == kind for e in of)}" if of is not None else ""
            parts.append(f"{n}{total} {many if n > 1 or total else one}")
    return " and ".join(parts)


def missing_summary(store: str, runs: Sequence[RunData], entries: Sequence[html.Entry]) -> list[str]:
    """What the page lacks, one line per command that adds it: the items drawn from no run
    (absent from the page), counted, and the command to run."""
    absent = [e for e in entries if e.image is None and e.table is None and e.text is None]
    unablated = sorted(r.run_id for r in runs if not r.ablation)
    undetected = sorted(r.run_id for r in runs if r.detect is None)
    remedies = {
        "analyze": (f"`{shlex.join(['attngeom', 'analyze', '--store', store])}`", "no analysis yet"),
        "ablate": (" or ".join(f"`{stage_command('ablate', store, r)}`" for r in unablated),
                   "no ablation yet"),
        "detect": (" or ".join(f"`{stage_command('detect', store, r)}`" for r in undetected),
                   "no detect yet"),
        "queries": ("a run extracted with --queries", "optional"),
        "sinks": ("a model with learned sinks, such as gpt-oss", "optional"),
    }
    lines = []
    for stage, (what, why) in remedies.items():
        group = [e for e in absent if stage in e.stages and not (stage in OPTIONAL and e.notes)]
        if group:
            verb = "needs" if len(group) == 1 else "need"
            lines.append(f"{_count(group, entries if stage == 'analyze' else None)} {verb} {what} ({why})")
    failed = [e for e in absent if "error" in e.stages]
    if failed:
        lines.append(f"{_count(failed)} could not be made from the store's data (the page says why)")
    return lines
