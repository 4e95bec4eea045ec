"""Analysis at every stored query (docs/method.md#any-query): ``topn_by_query`` and its summary.

A run extracted with ``--queries`` keeps ``attn_rows`` (seq, layer, head, query_pos, key), the
attention rows of the queries at ``query_pos``. Query ``q`` is analyzed exactly as the final
query is, on its own keys: the row, the values and the mask are cut to keys 0..q, so that the
kernels' current token (their last key) is ``q`` itself and ``C``, lambda and the coherence
constants are taken over those keys only. The mask is the final query's, moved with its query
(:func:`attngeom.store.query_attendable`). The random control draws, like ``topn``'s, from the
(sequence, layer) seed, ``random((draws, heads, q + 1))``: at ``q = L-1`` every input is the
final query's, so every value equals ``topn``'s bit for bit.

One task per (sequence, layer), like ``topn``'s: it reads that chunk of ``attn_rows`` (heads x
queries x L float32) and of ``values`` and returns a few kilobytes per query.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
import xarray as xr
import zarr

from attngeom.analyze.kernels import head_metrics
from attngeom.store import TOPN_COUNTS, TOPN_VARIABLES, VALUE_STATISTICS, query_attendable, read_chunk

__all__ = ["COLUMNS", "has_queries", "query_blocks", "query_groups", "summary_by_query"]

# The columns of a (sequence, layer) block's results (`_query_block`): every topn variable,
# then the value statistics of the query's keys (the same at every n).
COLUMNS = (*TOPN_VARIABLES, *VALUE_STATISTICS)


def has_queries(ds: xr.Dataset) -> bool:
    """Whether a run (as ``open_completed`` opens it) kept rows at more than the last query."""
    if "attn_rows" not in ds:
        return False
    return ds["query_pos"].values.tolist() != [ds.sizes["key"] - 1]


def _query_block(*, block_id, seqs, store, inputs, attendable, head_kv, positions, n_grid, seed,
                 instance_seed: Callable[[int, int, int], int], random_draws: int) -> np.ndarray:
    """The (sequence, layer) block ``block_id[:2]`` (sequence seqs[block_id[0]] of the run), read
    here from the run's zarr arrays ``inputs``: attn_rows (H, Q, K) and values (KV, K, D);
    attendable (layer, K) the final query's mask, positions (Q,) the queries ->
    (1, 1, H, Q, n, column) float64 of COLUMNS."""
    seq, layer = int(seqs[block_id[0]]), block_id[1]
    rows, kv_values = (read_chunk(store, arr, (seq, layer)) for arr in inputs)
    kv_values = kv_values.astype(np.float64)
    out = np.empty((rows.shape[0], len(positions), len(n_grid), len(COLUMNS)))
    for i, q in enumerate(int(p) for p in positions):
        keys = q + 1
        topn, stats = head_metrics(
            rows[:, i, :keys].astype(np.float64),
            kv_values[:, :keys],
            np.broadcast_to(query_attendable(attendable[layer], q), (kv_values.shape[0], keys)),
            n_grid,
            head_kv=head_kv,
            seed=instance_seed(seed, seq, layer),
            random_draws=random_draws,
        )
        out[:, i, :, : len(TOPN_VARIABLES)] = np.stack([topn[name] for name in TOPN_VARIABLES], axis=-1)
        per_head = np.stack([stats[name][head_kv] for name in VALUE_STATISTICS], axis=-1)
        out[:, i, :, len(TOPN_VARIABLES):] = per_head[:, None]
    return out[None, None]


def query_blocks(store: str, run: zarr.Group, ds: xr.Dataset, grid: np.ndarray, seed: int, *,
                 instance_seed: Callable[[int, int, int], int], random_draws: int) -> da.Array:
    """Lazy (seq, layer, head, query_pos, n, column) float64 of the sequences of ``ds`` (the run
    group ``run`` of ``store``, opened by ``open_completed``): one task per (sequence, layer)."""
    return da.map_blocks(
        _query_block,
        chunks=((1,) * ds.sizes["seq"], (1,) * ds.sizes["layer"], (ds.sizes["head"],),
                (ds.sizes["query_pos"],), (len(grid),), (len(COLUMNS),)),
        dtype=np.float64, meta=np.empty((0,) * 6),
        seqs=ds["seq"].values, store=store, inputs=(run["attn_rows"], run["values"]),
        attendable=ds["attendable"].values, head_kv=ds["head_kv"].values,
        positions=ds["query_pos"].values, n_grid=grid, seed=seed,
        instance_seed=instance_seed, random_draws=random_draws,
    )


def query_groups(stacked: Any, ds: xr.Dataset, grid: np.ndarray) -> xr.Dataset:
    """The ``topn_by_query`` Dataset from the stacked columns (numpy or dask): every topn
    variable (seq, layer, head, query_pos, n), typed as in ``topn``, and the value statistics
    of each query's keys (seq, layer, head, query_pos)."""
    dims = ("seq", "layer", "head", "query_pos", "n")
    out = {}
    for i, name in enumerate(COLUMNS):
        x = stacked[..., i]
        if name in TOPN_COUNTS:
            x = x.astype(np.int64)
        elif name == "sink_selected":
            x = x.astype(np.int8)
        out[name] = (dims, x) if name in TOPN_VARIABLES else (dims[:4], x[..., 0])
    coords = {"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values,
              "query_pos": ds["query_pos"].values.astype(np.int64), "n": grid}
    return xr.Dataset(out, coords=coords)


def summary_by_query(topn_by_query: xr.Dataset,
                     summarize: Callable[[xr.Dataset], xr.Dataset]) -> xr.Dataset:
    """(stat, layer, head, query_pos, n): ``summarize`` (the stage's ``summary_dataset``, the
    statistics across sequences of ``summary``) of the topn variables at each query."""
    topn = topn_by_query[list(TOPN_VARIABLES)]
    per_query = [summarize(topn.isel(query_pos=i)) for i in range(topn.sizes["query_pos"])]
    out = xr.concat(per_query, dim="query_pos").assign_coords(query_pos=topn["query_pos"].values)
    return out.transpose("stat", "layer", "head", "query_pos", "n")
