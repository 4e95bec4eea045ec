"""The report stage: figures and tables of the paper from a store, and an offline index.html."""

from attngeom.report.build import build_report

__all__ = ["build_report"]
