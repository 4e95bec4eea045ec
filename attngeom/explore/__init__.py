"""The explore stage: an offline, interactive page to look at every head's geometry.

Called, ``attngeom.explore(store, out)`` is :func:`attngeom.api.explore`. The page builder
loads on first use of :func:`explore.build.explore`.
"""

from __future__ import annotations

__all__ = ["ExploreResult"]


def __getattr__(name: str) -> object:
    if name == "ExploreResult":
        from attngeom.explore.build import ExploreResult

        return ExploreResult
    raise AttributeError(f"module 'attngeom.explore' has no attribute {name!r}")
