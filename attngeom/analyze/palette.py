"""The colours of the head regimes, one palette for report and explore.

Okabe & Ito's colour-blind-safe set: bluish green, orange and reddish purple stay apart under
every common colour-vision deficiency, and in greyscale by lightness. A query's vote takes the
colour of the regime it makes (Diagonal -> Retriever, Sink -> Mixer, Other -> Reset; docs/method.md#head-taxonomy).
"""

from __future__ import annotations

from attngeom.store.objects.schema import REGIMES, VOTES

__all__ = ["REGIME_COLORS", "VOTE_COLORS"]

REGIME_COLORS: dict[str, str] = dict(zip(REGIMES, ("#009E73", "#E69F00", "#CC79A7")))
VOTE_COLORS: dict[str, str] = dict(zip(VOTES, REGIME_COLORS.values()))
