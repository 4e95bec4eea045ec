"""The field's head scores from attention rows (docs/method.md#head-detectors).

``A[p, j]`` is the float32 weight of query ``p`` on key ``j`` of one (sequence, layer, head),
as the capture computes it (:mod:`attngeom.extract.capture`): causal mask, sliding window and
logit softcap included. Each function takes the rows of some queries of a batch of one
layer and returns per-head sums, so that a stage adds up batches and divides once.
"""

from __future__ import annotations

import torch

__all__ = ["probe_queries", "probe_sums", "retrieval_hits", "retrieval_queries"]


def probe_queries(k: int) -> tuple[int, ...]:
    """The queries of a probe ``[BOS] + r + r`` whose rows the scores read: 1 .. 2k."""
    return tuple(range(1, 2 * k + 1))


def probe_sums(rows: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per-head sums (H,) float64 over a batch of probes, rows (B, H, 2k, 2k+1) of queries
    1 .. 2k (:func:`probe_queries`):

    - ``duplicate``: sum of ``A[p, p-k]`` over p in k+1 .. 2k (the same token, first copy);
    - ``induction``: sum of ``A[p, p-k+1]`` over p in k+1 .. 2k (the token after it);
    - ``prev_token``: sum of ``A[p, p-1]`` over p in 1 .. 2k.

    Divided by ``B*k``, ``B*k`` and ``B*2k`` they are the scores' means. Row q holds query
    q+1, so ``A[p, p-1]`` is the diagonal of rows[:, :, :, :2k], and the second copy's rows
    start at q = k.
    """
    second = rows[:, :, k:]
    parts = {
        "duplicate": torch.diagonal(second[..., 1 : k + 1], dim1=-2, dim2=-1),
        "induction": torch.diagonal(second[..., 2 : k + 2], dim1=-2, dim2=-1),
        "prev_token": torch.diagonal(rows[..., : 2 * k], dim1=-2, dim2=-1),
    }
    return {name: part.double().sum(dim=(0, 2)) for name, part in parts.items()}


def retrieval_queries(length: int, n: int) -> tuple[int, ...]:
    """The queries of a retrieval sample of length L whose rows the score reads: the final
    copy's positions ``L-n+m`` holding needle token m, m in 0 .. n-2."""
    return tuple(range(length - n, length - 1))


def retrieval_hits(rows: torch.Tensor, needle_start: torch.Tensor) -> torch.Tensor:
    """Hits (B, H) int64 of a batch of samples: rows (B, H, n-1, L) of the final copy's
    queries (:func:`retrieval_queries`), needle_start (B,) the inserted needle's first
    position. The query holding needle token m hits when its first maximal key,
    ``argmax_j A[t, j]``, is ``needle_start + m + 1``: the inserted needle's next token."""
    target = needle_start[:, None, None] + 1 + torch.arange(rows.shape[2], device=rows.device)
    return (rows.argmax(dim=-1) == target).sum(dim=-1)
