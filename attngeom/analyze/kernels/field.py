"""The field's head scores (docs/method.md#the-fields-head-scores) from the per-query summaries
extract keeps: sink, previous-token and distant mass, per sequence and across sequences.

Plain numpy in float64: one pass over a sequence's summaries, no per-key work.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["SINK_THRESHOLD", "FieldScores", "distant_attn", "head_scores", "learned_sink_score", "sequence_scores"]

# A sink head puts more than this mean mass on the first token (Gu et al. 2024, "When
# attention sink emerges", epsilon = 0.3).
SINK_THRESHOLD = 0.3


class FieldScores(NamedTuple):
    """Head scores, float64: sink_score and prev_token_score (..., layer, head), distant_mass
    (..., layer, head, recent); NaN where no query qualifies."""

    sink_score: np.ndarray
    prev_token_score: np.ndarray
    distant_mass: np.ndarray


def distant_attn(sink_attn: np.ndarray, recent_attn: np.ndarray, learned_sink: np.ndarray | None = None) -> np.ndarray:
    """The mass off the sink and the last W keys, per query: ``1 - A_i0 - recent_attn[i, W]``,
    less the learned sink's weight ``s_i`` where the model has one (its row sums to ``1 - s_i``:
    docs/method.md#learned-sinks).

    sink_attn (..., L), recent_attn (..., L, R), learned_sink (..., L) -> (..., L, R) float64.
    """
    total = 1.0 if learned_sink is None else 1.0 - learned_sink.astype(np.float64)[..., None]
    return total - sink_attn.astype(np.float64)[..., None] - recent_attn.astype(np.float64)


def sequence_scores(sink_attn: np.ndarray, prev_attn: np.ndarray, recent_attn: np.ndarray,
                    windows: np.ndarray, learned_sink: np.ndarray | None = None) -> FieldScores:
    """One sequence's head scores: means over its queries.

    sink_attn, prev_attn (layer, head, L) and recent_attn (layer, head, L, R) float32, the
    summaries of the run; windows (R,) the W of recent_attn. ``sink_score`` = mean over
    i >= 1 of A_i0, ``prev_token_score`` = mean over i >= 1 of A_i,i-1, ``distant_mass[W]``
    = mean over i >= 2W of :func:`distant_attn` (NaN where L <= 2W); ``learned_sink``
    (layer, head, L), the weight of a learned sink, where the model has one.
    """
    length = sink_attn.shape[-1]
    distant = np.full((*sink_attn.shape[:-1], len(windows)), np.nan)
    for r, w in enumerate(int(w) for w in windows):
        if 2 * w < length:
            learned = None if learned_sink is None else learned_sink[..., 2 * w :]
            distant[..., r] = distant_attn(sink_attn[..., 2 * w :], recent_attn[..., 2 * w :, r : r + 1],
                                           learned)[..., 0].mean(-1)
    return FieldScores(
        sink_score=sink_attn[..., 1:].astype(np.float64).mean(-1),
        prev_token_score=prev_attn[..., 1:].astype(np.float64).mean(-1),
        distant_mass=distant,
    )


def head_scores(per_sequence: FieldScores) -> tuple[FieldScores, np.ndarray]:
    """The run's head scores from :func:`sequence_scores` of each sequence (stacked on a
    first axis, seq): their means across sequences (every sequence has the same queries, so
    this is the mean over all its queries), and ``sink_head`` = sink_score > SINK_THRESHOLD
    (layer, head) bool."""
    scores = FieldScores(*(np.mean(x, axis=0) for x in per_sequence))
    return scores, scores.sink_score > SINK_THRESHOLD


def learned_sink_score(learned_sink: np.ndarray) -> np.ndarray:
    """The mean weight of a head's learned sink over queries i >= 1, the learned sink's
    counterpart of ``sink_score`` (docs/method.md#learned-sinks).

    learned_sink (..., L) float32 -> (...) float64.
    """
    return learned_sink[..., 1:].astype(np.float64).mean(-1)
