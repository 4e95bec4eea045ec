"""The report stage: figures and tables of the paper from a store, and an offline index.html.

Called, ``attngeom.report(store, out)`` is :func:`attngeom.api.report`. matplotlib and the
figure modules load on first use of :func:`build_report`.
"""

from __future__ import annotations

__all__ = ["Report", "build_report"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from attngeom.report import build

        return getattr(build, name)
    raise AttributeError(f"module 'attngeom.report' has no attribute {name!r}")
