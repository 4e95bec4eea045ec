"""The inputs detect feeds the model (docs/method.md#head-detectors): repeated random-token
probes and needle-in-a-haystack samples. Pure numpy, seeded, deterministic.

Seeding: the probes draw from ``numpy.random.default_rng([seed, 0])``, the needles from
``default_rng([seed, 1])``, so that changing the number of probes leaves the needles as they
were, and the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Retrieval", "insert_position", "probe_tokens", "retrieval_samples", "vocabulary"]


def vocabulary(size: int, excluded: Iterable[int]) -> np.ndarray:
    """Sorted token ids (V,) that probes draw from: ``0 .. size-1`` without ``excluded``
    (the tokenizer's special and added tokens, and the run's BOS)."""
    return np.setdiff1d(np.arange(size, dtype=np.int64), np.fromiter(excluded, dtype=np.int64))


def probe_tokens(vocab: np.ndarray, bos: int, probes: int, k: int, seed: int) -> np.ndarray:
    """(probes, 2k+1) int64: ``[bos] + r + r`` with ``r`` of k ids drawn uniformly, with
    replacement, from ``vocab``. Positions: 0 BOS, 1..k the first copy, k+1..2k the second."""
    rng = np.random.default_rng([seed, 0])
    r = vocab[rng.integers(0, len(vocab), size=(probes, k))]
    return np.concatenate([np.full((probes, 1), bos, dtype=np.int64), r, r], axis=1)


def insert_position(depth: float, body: int) -> int:
    """Where the needle's first token goes at ``depth``: position ``1 + round(depth *
    (body - 1))`` of the sequence (rounded half up), ``body`` haystack tokens after BOS."""
    return 1 + int(np.floor(depth * (body - 1) + 0.5))


@dataclass(frozen=True)
class Retrieval:
    """Needle-in-a-haystack samples, one per (haystack, depth), haystack-major.

    tokens (sample, L) int64: ``[BOS] + body[:i] + needle + body[i:] + needle`` with
    ``body`` the first ``L - 1 - 2n`` tokens after BOS of the haystack window;
    needle_start (sample,): position of the inserted needle's first token (``1 + i``);
    depth (sample,); haystack, needle_source (sample,): the run's sequence ids of the
    haystack window and of the window the needle comes from; needle_offset (sample,): the
    needle's first position in that window. The final copy holds positions ``L-n .. L-1``.
    """

    tokens: np.ndarray
    needle_start: np.ndarray
    depth: np.ndarray
    haystack: np.ndarray
    needle_source: np.ndarray
    needle_offset: np.ndarray


def retrieval_samples(
    windows: np.ndarray, seqs: np.ndarray, haystacks: int, n: int, depths: Sequence[float], seed: int
) -> Retrieval:
    """The samples of the first ``haystacks`` of the run's windows (S, L) (sequence ids
    ``seqs``, in index order). Haystack i takes its needle from window ``(i + 1) % S``, at
    an offset drawn uniformly from ``1 .. L-n`` (never the BOS), one draw per haystack in
    order; the same needle goes in at every depth."""
    n_windows, length = windows.shape
    body = length - 1 - 2 * n
    rng = np.random.default_rng([seed, 1])
    rows, starts, where = [], [], []
    for i in range(min(haystacks, n_windows)):
        source = (i + 1) % n_windows
        offset = int(rng.integers(1, length - n + 1))
        needle = windows[source, offset : offset + n]
        hay = windows[i, 1 : 1 + body]
        for depth in depths:
            cut = insert_position(depth, body) - 1
            rows.append(np.concatenate([windows[i, :1], hay[:cut], needle, hay[cut:], needle]))
            starts.append(1 + cut)
            where.append((depth, seqs[i], seqs[source], offset))
    depth, haystack, needle_source, needle_offset = (np.array(x) for x in zip(*where))
    return Retrieval(
        tokens=np.stack(rows).astype(np.int64), needle_start=np.array(starts, dtype=np.int64),
        depth=depth.astype(np.float64), haystack=haystack.astype(np.int64),
        needle_source=needle_source.astype(np.int64), needle_offset=needle_offset.astype(np.int64),
    )
