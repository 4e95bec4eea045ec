"""The value-space picture of one instance (the paper's Figure 1, from data): a 2-D projection
of every contribution ``y_k = alpha_k v_k``, the selections ``I_N``, ``s_N`` and both balls.

Pure array functions, no I/O. The selection and the balls follow docs/method.md#balls exactly as
:func:`attngeom.analyze.kernels.topn_metrics` defines them (``I_N``: the N attendable keys of
largest alpha, ties to the smaller position; closed ``r_max`` ball, open ``r_min`` ball), and
distances are taken in the full head dimension; only the drawing is a projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Picture:
    """The picture of a batch of B instances over the N of ``n_grid`` (G sizes).

    - ``xy`` (B, K, 2): PCA coordinates of y_k (NaN for keys outside K_b);
    - ``order`` (B, K): keys by selection rank (I_N is ``order[b, :N]``), unattendable keys last;
    - ``s_xy`` (B, G, 2): s_N in the same coordinates;
    - ``r_min``, ``r_max`` (B, G): the radii in the full dimension, same units as y;
    - ``precision``, ``recall`` (B, G): P(r_max, N), R(r_min, N) from these distances;
    - ``in_r_max`` (B, G, K) bool: keys inside the closed r_max ball (the unselected ones
      among them lower P);
    - ``in_r_min`` (B, G, K) bool: keys inside the open r_min ball (the selected ones outside
      it lower R);
    - ``explained`` (B, 2): fraction of the variance of the y_k along each axis.

    Entries of an N that is not valid (N >= |K_b|) are NaN / False.
    """

    xy: np.ndarray
    order: np.ndarray
    s_xy: np.ndarray
    r_min: np.ndarray
    r_max: np.ndarray
    precision: np.ndarray
    recall: np.ndarray
    in_r_max: np.ndarray
    in_r_min: np.ndarray
    explained: np.ndarray


def principal_plane(y: np.ndarray, attendable: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centre (B, D), orthonormal basis (B, D, 2) of the two leading principal directions of
    the attendable y_k, and the fraction of variance each explains (B, 2).

    Signs are fixed (the largest-magnitude component of each direction is positive), so a
    picture does not flip between runs. A head dimension of 1 gets a zero second axis.
    """
    weight = attendable[:, :, None]
    count = np.maximum(attendable.sum(axis=1), 1)[:, None]
    centre = np.sum(np.where(weight, y, 0.0), axis=1) / count
    centred = np.where(weight, y - centre[:, None, :], 0.0)
    # Eigenvectors of the D x D scatter matrix rather than an SVD of the K x D data: the same
    # directions, at a small fraction of the cost for K >> D.
    scatter = centred.transpose(0, 2, 1) @ centred
    power, vectors = np.linalg.eigh(scatter)
    power, vectors = np.maximum(power[:, ::-1], 0.0), vectors[:, :, ::-1]
    basis = np.zeros((y.shape[0], y.shape[2], 2))
    k = min(2, y.shape[2])
    basis[:, :, :k] = vectors[:, :, :k]
    pivot = np.take_along_axis(basis, np.abs(basis).argmax(axis=1)[:, None, :], axis=1)
    basis *= np.where(pivot < 0, -1.0, 1.0)
    explained = np.zeros((y.shape[0], 2))
    total = power.sum(axis=1, keepdims=True)
    explained[:, :k] = np.divide(power[:, :k], total, out=np.zeros_like(power[:, :k]), where=total > 0)
    return centre, basis, explained


def value_picture(
    attn: np.ndarray, values: np.ndarray, attendable: np.ndarray, n_grid: Sequence[int]
) -> Picture:
    """The Figure-1 geometry of each instance: attn (B, K), values (B, K, D), attendable
    (B, K) bool, n_grid sizes N >= 1. See :class:`Picture` for the outputs.

    ``D_k = ||y_k - s_N||^2``; ``r_max^2 = max_{I_N} D_i``, ``r_min^2 = min_{U_N} D_j``;
    P = N / |{k: D_k <= r_max^2}|, R = |{i in I_N: D_i < r_min^2}| / N (docs/method.md#balls).
    """
    alpha = np.asarray(attn, dtype=np.float64)
    att = np.asarray(attendable, dtype=bool)
    y = alpha[:, :, None] * np.asarray(values, dtype=np.float64)
    B, K, _ = y.shape
    grid = np.asarray(n_grid, dtype=np.int64)
    centre, basis, explained = principal_plane(y, att)
    xy = np.einsum("bkd,bdp->bkp", y - centre[:, None, :], basis)
    xy[~att] = np.nan

    order = np.argsort(np.where(att, -alpha, np.inf), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(K)[None, :], axis=1)
    n_att = att.sum(axis=1)

    shape = (B, grid.size)
    s_xy = np.full((*shape, 2), np.nan)
    r_min, r_max, precision, recall = (np.full(shape, np.nan) for _ in range(4))
    in_r_max = np.zeros((*shape, K), dtype=bool)
    in_r_min = np.zeros((*shape, K), dtype=bool)
    for g, n in enumerate(grid):
        selected = (rank < n) & att
        s = np.sum(np.where(selected[:, :, None], y, 0.0), axis=1)
        diff = y - s[:, None, :]
        D = np.einsum("bkd,bkd->bk", diff, diff)
        r_max2 = np.max(D, axis=1, where=selected, initial=-np.inf)
        r_min2 = np.min(D, axis=1, where=att & ~selected, initial=np.inf)
        valid = n < n_att
        inside_max = valid[:, None] & att & (D <= r_max2[:, None])
        inside_min = valid[:, None] & att & (D < r_min2[:, None])
        in_r_max[:, g], in_r_min[:, g] = inside_max, inside_min
        s_xy[valid, g] = np.einsum("bd,bdp->bp", s - centre, basis)[valid]
        r_min[valid, g], r_max[valid, g] = np.sqrt(r_min2[valid]), np.sqrt(r_max2[valid])
        precision[valid, g] = n / inside_max[valid].sum(axis=1)
        recall[valid, g] = (inside_min & selected)[valid].sum(axis=1) / n
    return Picture(xy, order, s_xy, r_min, r_max, precision, recall, in_r_max, in_r_min, explained)
