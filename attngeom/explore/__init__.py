"""The explore stage: an offline, interactive page to look at every head's geometry."""

from attngeom.explore.build import ExploreResult, explore

__all__ = ["ExploreResult", "explore"]
