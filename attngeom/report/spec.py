"""What the report shows: a figure or table, the runs it needs, and its one-line caption."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
from matplotlib.figure import Figure

from attngeom.report.data import Requirement, RunData

# Sections of index.html, in order.
SECTIONS = (
    "Models",
    "Top-N geometric separability",
    "Attention sink geometry",
    "Value norms and coherence",
    "Sink diagnostics",
    "Leave-one-out control",
    "Exact certificate",
    "Head taxonomy",
    "Geometry along the context",
    "Heads of the field",
    "Ablation and sparsification",
)


@dataclass(frozen=True)
class FigureSpec:
    """A figure: ``draw`` receives the runs meeting ``needs`` (at least one), or every run
    (possibly none) when ``needs`` is None: a figure drawn from no store data."""

    name: str
    section: str
    caption: str
    draw: Callable[[Sequence[RunData]], Figure]
    needs: Requirement | None = None


@dataclass(frozen=True)
class TableSpec:
    """A table: ``make`` receives the runs meeting ``needs`` (at least one; every run when
    ``needs`` is None)."""

    name: str
    section: str
    caption: str
    make: Callable[[Sequence[RunData]], pd.DataFrame]
    needs: Requirement | None = None


@dataclass(frozen=True)
class TextSpec:
    """Generated sentences: ``make`` receives the runs meeting ``needs`` (at least one) and
    returns the sentences, each said on the page as one item."""

    name: str
    section: str
    caption: str
    make: Callable[[Sequence[RunData]], list[str]]
    needs: Requirement | None = None
