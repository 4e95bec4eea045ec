"""index.html: every figure and table with its caption, self-contained and offline.

No script, no stylesheet or font from elsewhere: the page references only the PNG, CSV and
Markdown files written beside it, so it opens from a folder, an archive or a CI artifact.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

import pandas as pd

from attngeom.version import __version__
from attngeom.report.reading import QUESTIONS, Finding
from attngeom.report.spec import SECTIONS

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 2em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption, .caption { font-size: 0.92em; color: #444; margin: 0.3em 0; }
.note { background: #fff6e0; border-left: 4px solid #e0a000; padding: 0.4em 0.8em; font-size: 0.9em; }
.optional { color: #666; font-size: 0.9em; margin: 0.3em 0; }
.scroll { overflow-x: auto; max-height: 32em; overflow-y: auto; }
table.data { border-collapse: collapse; font-size: 0.85em; }
table.data th, table.data td { border-bottom: 1px solid #ddd; padding: 0.2em 0.6em; text-align: left; }
table.data th { background: #f4f4f4; position: sticky; top: 0; }
.meta { color: #666; font-size: 0.9em; } nav ul { columns: 2; }
ul.said { font-size: 0.92em; } ul.said li { margin: 0.2em 0; }
"""


@dataclass(frozen=True)
class Entry:
    """One item of the page: a figure (``image``), a table (``table``) or sentences (``text``),
    or none when its inputs are missing; ``notes`` say what is missing, ``optional`` what an optional input
    (an extract with --queries) would add, and ``stages`` name the stages (analyze, ablate,
    queries; error for a failure) whose output it lacks."""

    name: str
    section: str
    caption: str
    kind: str = "figure"
    image: str | None = None
    table: pd.DataFrame | None = None
    text: tuple[str, ...] | None = None
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    stages: frozenset[str] = frozenset()


def _notes(notes: Sequence[str], css: str = "note") -> str:
    return "".join(f'<p class="{css}">{escape(n)}</p>' for n in notes)


def _entry(entry: Entry) -> str:
    caption = escape(entry.caption)
    links = " ".join(f'<a href="{escape(f)}">{escape(f)}</a>' for f in entry.files)
    if entry.image is not None:
        body = (f'<figure><img src="{escape(entry.image)}" alt="{caption}">'
                f"<figcaption><b>{escape(entry.name)}.</b> {caption}</figcaption></figure>")
    elif entry.text is not None:
        items = "".join(f"<li>{escape(line)}</li>" for line in entry.text) or "<li>none</li>"
        body = f'<p class="caption"><b>{escape(entry.name)}.</b> {caption} {links}</p><ul class="said">{items}</ul>'
    elif entry.table is not None and entry.table.empty:
        body = f'<p class="caption"><b>{escape(entry.name)}.</b> {caption} {links}</p><p>none</p>'
    elif entry.table is not None:
        table = entry.table.to_html(index=False, border=0, classes="data", na_rep="",
                                    float_format=lambda x: f"{x:.4g}")
        body = (f'<p class="caption"><b>{escape(entry.name)}.</b> {caption} {links}</p>'
                f'<div class="scroll">{table}</div>')
    else:
        body = f'<p class="caption"><b>{escape(entry.name)}.</b> {caption}</p>'
    notes = _notes(entry.notes) + _notes([f"Optional: {n}" for n in entry.optional], "optional")
    return f'<section id="{escape(entry.name)}">{body}{notes}</section>'


def _absent(entry: Entry) -> str:
    """The navigation's mark of an item not drawn: missing, or optional when only an optional
    input would add it."""
    if entry.image is not None or entry.table is not None or entry.text is not None:
        return ""
    return " (missing)" if entry.notes else " (optional)"


def section_id(title: str) -> str:
    """The id of a section's heading: "Heads of the field" -> "heads-of-the-field"."""
    return "-".join(title.lower().replace("-", " ").split())


def _method(reference: str) -> str:
    return f'<span class="meta">({escape(reference)})</span>'


def opening(sections: Sequence[str], found: Sequence[Finding]) -> str:
    """"How to read this report": what each of ``sections`` answers, then the headline findings,
    each linked to the item it comes from; both cite the part of docs/method.md defining them
    (a citation, not a link: the page opens offline, away from the docs)."""
    questions = "".join(
        f'<li><a href="#{section_id(title)}">{escape(title)}</a>: {escape(QUESTIONS[title][0])} '
        f"{_method(QUESTIONS[title][1])}</li>" for title in sections
    )
    said = "".join(f'<li>{escape(f.text)} <a href="#{escape(f.item)}">{escape(f.item)}</a> {_method(f.method)}</li>'
                   for f in found)
    shows = f"<h3>What this store shows</h3><ul class=\"said\">{said}</ul>" if found else ""
    return (f'<h2 id="how-to-read-this-report">How to read this report</h2>'
            "<p>Each section answers one question; the method, with every formula, is in attngeom's "
            f"docs/method.md (its section cited beside each line).</p><ul class=\"said\">{questions}</ul>{shows}")


def render(store: str, n_runs: int, entries: Sequence[Entry], notes: Sequence[str],
           optional: Sequence[str] = (), found: Sequence[Finding] = ()) -> str:
    """The page: header, "How to read this report" (with the headline findings ``found``),
    missing-input notes, optional inputs, then the entries section by section."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    order = {name: i for i, name in enumerate(SECTIONS)}
    ordered = sorted(entries, key=lambda e: order.get(e.section, len(order)))
    sections: dict[str, list[Entry]] = {}
    for entry in ordered:
        sections.setdefault(entry.section, []).append(entry)
    nav = "".join(f'<li><a href="#{escape(e.name)}">{escape(e.name)}</a>{_absent(e)}</li>' for e in ordered)
    body = "".join(
        f'<h2 id="{section_id(title)}">{escape(title)}</h2>' + "".join(_entry(e) for e in items)
        for title, items in sections.items()
    )
    missing = f"<h2>Missing inputs</h2>{_notes(notes)}" if notes else ""
    missing += _notes([f"Optional: {n}" for n in optional], "optional")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>attngeom report</title>
<style>{STYLE}</style>
</head>
<body>
<h1>attngeom report</h1>
<p class="meta">store <code>{escape(store)}</code> · {n_runs} run(s) · attngeom {escape(__version__)} · {now}</p>
{opening(list(sections), found)}
<nav><ul>{nav}</ul></nav>
{missing}
{body}
</body>
</html>
"""
