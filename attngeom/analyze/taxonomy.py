"""Parameter-free head taxonomy (docs/method.md#head-taxonomy, paper Algorithm 1) and its mechanistic signatures.

For every query i >= 1 the source winner is j* = argmax_{j <= i, attendable} A_ij ||v_j||
(ties to the smaller j), stored by extract as ``winner``. A query votes Diagonal (j* = i),
Sink (j* = 0) or Other; each sequence takes the plurality of its queries' votes, each head
the plurality of its sequences' labels; an exact tie at either vote is Other. Query 0 is left
out because sink and diagonal coincide there. Diagonal -> Retriever, Sink -> Mixer,
Other -> Reset.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from attngeom.store import REGIMES, SIGNATURE_VARIABLES, VOTES

DIAGONAL, SINK, OTHER = range(len(VOTES))


def query_votes(winner: np.ndarray) -> np.ndarray:
    """Counts of Diagonal, Sink and Other votes over queries i >= 1.

    winner (..., Q) int, j* per query position; returns (..., 3) int64.
    """
    query = np.arange(winner.shape[-1])
    w = winner[..., 1:]
    diagonal = (w == query[1:]).sum(axis=-1)
    sink = (w == 0).sum(axis=-1)
    other = w.shape[-1] - diagonal - sink
    return np.stack([diagonal, sink, other], axis=-1).astype(np.int64)


def plurality(counts: np.ndarray) -> np.ndarray:
    """Index of the unique largest count along the last axis; OTHER on an exact tie.

    counts (..., 3) -> (...,) int8.
    """
    best = counts.max(axis=-1, keepdims=True)
    unique = (counts == best).sum(axis=-1) == 1
    return np.where(unique, counts.argmax(axis=-1), OTHER).astype(np.int8)


def winners_from_rows(rows: np.ndarray, values: np.ndarray, head_kv: np.ndarray) -> np.ndarray:
    """j* = argmax_j A_ij ||v_j|| from full attention rows (ties to the smaller j).

    rows (H, Q, K) attention of one (sequence, layer), values (KV, K, D); returns (H, Q) int64.
    """
    norms = np.linalg.norm(values.astype(np.float64), axis=-1)[head_kv]
    return (rows.astype(np.float64) * norms[:, None, :]).argmax(axis=-1)


def head_regimes(sequence_labels: np.ndarray) -> np.ndarray:
    """Plurality over sequences of per-sequence labels: (seq, ...) int -> (...) int8."""
    counts = np.stack([(sequence_labels == k).sum(axis=0) for k in range(3)], axis=-1)
    return plurality(counts)


def regime_names(labels: np.ndarray) -> np.ndarray:
    """int labels -> object array of "Retriever" / "Mixer" / "Reset"."""
    return np.asarray(REGIMES, dtype=object)[labels]


def signatures_dataset(per_head: xr.Dataset, regime: xr.DataArray) -> xr.Dataset:
    """Mechanistic signatures per regime over N: mean and median across heads.

    per_head (layer, head, n): each head's SIGNATURE_VARIABLES averaged over sequences; regime
    (layer, head) names. Returns dims (regime, n) with ``<name>`` (mean across heads),
    ``<name>_median`` and ``heads`` (how many heads the regime has).
    """
    flat = per_head.stack(instance=("layer", "head"))
    labels = regime.stack(instance=("layer", "head")).values
    out: dict[str, list[np.ndarray]] = {}
    for name in REGIMES:
        chosen = flat.isel(instance=np.flatnonzero(labels == name))
        for var in SIGNATURE_VARIABLES:
            x = chosen[var].transpose("instance", "n").values
            out.setdefault(var, []).append(np.nanmean(x, axis=0) if x.size else np.full(flat.sizes["n"], np.nan))
            out.setdefault(f"{var}_median", []).append(
                np.nanmedian(x, axis=0) if x.size else np.full(flat.sizes["n"], np.nan)
            )
        out.setdefault("heads", []).append(np.full(flat.sizes["n"], chosen.sizes["instance"], dtype=np.float64))
    return xr.Dataset(
        {name: (("regime", "n"), np.stack(rows)) for name, rows in out.items()},
        coords={"regime": np.asarray(REGIMES, dtype=object), "n": per_head["n"].values},
    )
