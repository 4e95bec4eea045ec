"""The per-(sequence, layer) tasks of the analysis and the per-sequence groups they make.

Each task reads one (sequence, layer) chunk of ``attn_last``, ``values`` and the votes' source
(``winner``, or the full rows of a run that kept them) (the store's inner chunks), evaluates
every head of it, and returns a few kilobytes; memory per worker is bounded by one such chunk
whatever the store's size. Its results become ``topn``, ``values`` and ``taxonomy``.

``topn_by_query``, the analysis at every stored query (docs/method.md#any-query): a run
extracted with ``--queries`` keeps ``attn_rows`` (seq, layer, head, query_pos, key), the
attention rows of the queries at ``query_pos``. Query ``q`` is analyzed exactly as the final
query is, on its own keys: the row, the values and the mask are cut to keys 0..q, so that the
kernels' current token (their last key) is ``q`` itself and ``C``, lambda and the coherence
constants are taken over those keys only. The mask is the final query's, moved with its query
(:func:`attngeom.store.query_attendable`). The random control draws, like ``topn``'s, from the
(sequence, layer) seed, ``random((draws, heads, q + 1))``: at ``q = L-1`` every input is the
final query's, so every value equals ``topn``'s bit for bit.

One task per (sequence, layer), like ``topn``'s: it reads that chunk of ``attn_rows`` (heads x
queries x L float32) and of ``values`` and returns a few kilobytes per query. Each task draws
its random control from its own seed (:func:`~attngeom.analyze.parameters.instance_seed`),
so results do not depend on chunking or order.

``sequence_scores``, the field's head scores of each sequence (docs/method.md#the-fields-head-scores),
for a run that holds ``prev_attn`` and ``recent_attn``: one task per sequence reads its
``sink_attn``, ``prev_attn`` and ``recent_attn`` (one chunk each) and returns their means per
head, from which ``head_scores`` is reduced across sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask
import dask.array as da
import numpy as np
import xarray as xr

from attngeom.analyze import taxonomy
from attngeom.analyze.kernels import head_metrics, learned_sink_score, sequence_scores
from attngeom.analyze.parameters import RANDOM_DRAWS, instance_seed
from attngeom.store import (
    ANALYSIS_GROUPS,
    ANALYSIS_SEQUENCE_GROUPS,
    QUERY_GROUPS,
    QUERY_SEQUENCE_GROUPS,
    SCORE_GROUPS,
    SCORE_SEQUENCE_GROUPS,
    TOPN_COUNTS,
    TOPN_FLAGS,
    TOPN_VARIABLES,
    VALUE_STATISTICS,
    VOTES,
    query_attendable,
    read_chunk,
)

__all__ = [
    "all_groups", "computed_groups", "has_queries", "has_scores", "query_block", "sequence_groups", "template_groups",
]

# The columns of a (sequence, layer) block's results (`_analysis_block`).
_BLOCK_COLUMNS = (*TOPN_VARIABLES, *VALUE_STATISTICS, *(f"votes_{vote}" for vote in VOTES))

# The columns of a (sequence, layer) block's results at the stored queries (`query_block`):
# every topn variable, then the value statistics of the query's keys (the same at every n).
_QUERY_COLUMNS = (*TOPN_VARIABLES, *VALUE_STATISTICS)


def has_queries(ds: xr.Dataset) -> bool:
    """Whether a run (as ``open_completed`` opens it) kept rows at more than the last query."""
    if "attn_rows" not in ds:
        return False
    return ds["query_pos"].values.tolist() != [ds.sizes["key"] - 1]


def has_scores(ds: xr.Dataset) -> bool:
    """Whether a run holds the summaries of the field's head scores (one migrated from a
    format before them does not)."""
    return "prev_attn" in ds and "recent_attn" in ds


def sequence_groups(ds: xr.Dataset) -> tuple[str, ...]:
    """The per-sequence groups of the run ``ds``: topn_by_query too for a run with queries,
    sequence_scores for a run with the field's summaries."""
    return (*ANALYSIS_SEQUENCE_GROUPS, *(QUERY_SEQUENCE_GROUPS if has_queries(ds) else ()),
            *(SCORE_SEQUENCE_GROUPS if has_scores(ds) else ()))


def all_groups(ds: xr.Dataset) -> tuple[str, ...]:
    """Every group an analysis of the run ``ds`` commits."""
    return (*ANALYSIS_GROUPS, *(QUERY_GROUPS if has_queries(ds) else ()), *(SCORE_GROUPS if has_scores(ds) else ()))


def _analysis_block(*, block_id, seqs, store, inputs, attendable, head_kv, n_grid, seed):
    """The (sequence, layer) block ``block_id[:2]`` (sequence seqs[block_id[0]] of the run),
    read here from the run's zarr arrays ``inputs``: attn_last (H, K), values (KV, K, D), the
    votes' source, winner (H, Q) or the full rows attn (H, Q, K) of a run that kept them, and
    learned_sink_attn (H, Q) of a model with learned sinks (the final query's is its
    virtual key's weight, docs/method.md#learned-sinks);
    attendable (layer, K) -> (1, 1, H, n, column) float64: the _BLOCK_COLUMNS, the value
    statistics and votes the same at every n; query head h takes the statistics of kv head
    head_kv[h]. One kernel call serves both geometry outputs, so each kv head's Gram matrix is
    computed once."""
    seq, layer = int(seqs[block_id[0]]), block_id[1]
    attn, kv_values, source, *learned = (read_chunk(store, arr, (seq, layer)) for arr in inputs)
    topn, stats = head_metrics(
        attn,
        kv_values,
        np.broadcast_to(attendable[layer], kv_values.shape[:2]),
        n_grid,
        head_kv=head_kv,
        learned_sink=learned[0][:, -1] if learned else None,
        seed=instance_seed(seed, seq, layer),
        random_draws=RANDOM_DRAWS,
    )
    winner = source if source.ndim == 2 else taxonomy.winners_from_rows(source, kv_values, head_kv)
    per_n = np.stack([topn[name].astype(np.float64) for name in TOPN_VARIABLES], axis=-1)
    per_head = np.concatenate([np.stack([stats[name][head_kv] for name in VALUE_STATISTICS], axis=-1),
                               taxonomy.query_votes(winner)], axis=-1)
    per_head = np.broadcast_to(per_head[:, None], (*per_n.shape[:2], per_head.shape[-1]))
    return np.concatenate([per_n, per_head], axis=-1)[None, None]


def _analysis_blocks(store: str, run: Any, ds: xr.Dataset, grid: np.ndarray, seed: int) -> da.Array:
    """Lazy (seq, layer, head, n, column) float64 of the sequences of ``ds`` (the run group
    ``run`` of ``store``, opened by :func:`open_completed`): :func:`_analysis_block`, one task
    per (sequence, layer). A task reads its own inputs, so that no chunk passes through this
    process on its way to a worker; it also counts the votes, so that they add no tasks to
    the graph."""
    return da.map_blocks(
        _analysis_block,
        chunks=((1,) * ds.sizes["seq"], (1,) * ds.sizes["layer"], (ds.sizes["head"],), (len(grid),),
                (len(_BLOCK_COLUMNS),)),
        dtype=np.float64, meta=np.empty((0,) * 5),
        seqs=ds["seq"].values, store=store,
        inputs=(run["attn_last"], run["values"], run["attn" if "attn" in ds else "winner"], *_learned_sinks(run, ds)),
        attendable=ds["attendable"].values, head_kv=ds["head_kv"].values, n_grid=grid, seed=seed,
    )


def _learned_sinks(run: Any, ds: xr.Dataset) -> tuple[Any, ...]:
    """The run's learned_sink_attn array, for a model with learned sinks; else nothing."""
    return (run["learned_sink_attn"],) if "learned_sink_attn" in ds else ()


def query_block(*, block_id: tuple[int, ...], seqs: np.ndarray, store: str, inputs: tuple[Any, ...],
                attendable: np.ndarray, head_kv: np.ndarray, positions: np.ndarray, n_grid: np.ndarray,
                seed: int) -> np.ndarray:
    """The (sequence, layer) block ``block_id[:2]`` (sequence seqs[block_id[0]] of the run), read
    here from the run's zarr arrays ``inputs``: attn_rows (H, Q, K), values (KV, K, D) and
    learned_sink_attn (H, L) of a model with learned sinks; attendable (layer, K) the final
    query's mask, positions (Q,) the queries -> (1, 1, H, Q, n, column) float64: the columns
    are `TOPN_VARIABLES`, then `VALUE_STATISTICS` of the query's keys (the same at every n)."""
    seq, layer = int(seqs[block_id[0]]), block_id[1]
    rows, kv_values, *learned = (read_chunk(store, arr, (seq, layer)) for arr in inputs)
    out = np.empty((rows.shape[0], len(positions), len(n_grid), len(_QUERY_COLUMNS)))
    for i, q in enumerate(int(p) for p in positions):
        keys = q + 1
        topn, stats = head_metrics(
            rows[:, i, :keys].astype(np.float64),
            kv_values[:, :keys],
            np.broadcast_to(query_attendable(attendable[layer], q), (kv_values.shape[0], keys)),
            n_grid,
            head_kv=head_kv,
            learned_sink=learned[0][:, q] if learned else None,
            seed=instance_seed(seed, seq, layer),
            random_draws=RANDOM_DRAWS,
        )
        out[:, i, :, : len(TOPN_VARIABLES)] = np.stack([topn[name] for name in TOPN_VARIABLES], axis=-1)
        per_head = np.stack([stats[name][head_kv] for name in VALUE_STATISTICS], axis=-1)
        out[:, i, :, len(TOPN_VARIABLES):] = per_head[:, None]
    return out[None, None]


def _query_blocks(store: str, run: Any, ds: xr.Dataset, grid: np.ndarray, seed: int) -> da.Array:
    """Lazy (seq, layer, head, query_pos, n, column) float64 of the sequences of ``ds`` (the run
    group ``run`` of ``store``, opened by ``open_completed``): one task per (sequence, layer)."""
    return da.map_blocks(
        query_block,
        chunks=((1,) * ds.sizes["seq"], (1,) * ds.sizes["layer"], (ds.sizes["head"],),
                (ds.sizes["query_pos"],), (len(grid),), (len(_QUERY_COLUMNS),)),
        dtype=np.float64, meta=np.empty((0,) * 6),
        seqs=ds["seq"].values, store=store, inputs=(run["attn_rows"], run["values"], *_learned_sinks(run, ds)),
        attendable=ds["attendable"].values, head_kv=ds["head_kv"].values,
        positions=ds["query_pos"].values, n_grid=grid, seed=seed,
    )


def _score_block(*, block_id, seqs, store, inputs, windows) -> np.ndarray:
    """The sequence ``seqs[block_id[0]]`` of the run, read here from its zarr arrays ``inputs``:
    sink_attn, prev_attn (layer, head, L), recent_attn (layer, head, L, R) and, for a model
    with learned sinks, learned_sink_attn (layer, head, L) -> (1, layer, head, 2 + R [+ 1])
    float64: sink_score, prev_token_score, distant_mass at each window[, learned_sink_score]."""
    seq = int(seqs[block_id[0]])
    sink, prev, recent, *learned = (read_chunk(store, arr, (seq,)) for arr in inputs)
    scores = sequence_scores(sink, prev, recent, windows, *learned)
    columns = [scores.sink_score[..., None], scores.prev_token_score[..., None], scores.distant_mass,
               *(learned_sink_score(x)[..., None] for x in learned)]
    return np.concatenate(columns, axis=-1)[None]


def _score_columns(ds: xr.Dataset) -> int:
    """Columns of a score block: sink, previous token, each window, and the learned sink's."""
    return 2 + ds.sizes.get("recent", 0) + ("learned_sink_attn" in ds)


def _score_blocks(store: str, run: Any, ds: xr.Dataset) -> da.Array:
    """Lazy (seq, layer, head, 2 + R) float64 of the sequences of ``ds``: :func:`_score_block`,
    one task per sequence."""
    windows = ds["recent"].values
    learned = _learned_sinks(run, ds)
    return da.map_blocks(
        _score_block,
        chunks=((1,) * ds.sizes["seq"], (ds.sizes["layer"],), (ds.sizes["head"],), (_score_columns(ds),)),
        dtype=np.float64, meta=np.empty((0,) * 4),
        seqs=ds["seq"].values, store=store,
        inputs=(run["sink_attn"], run["prev_attn"], run["recent_attn"], *learned), windows=windows,
    )


def _score_groups(stacked: Any, ds: xr.Dataset) -> xr.Dataset:
    """The ``sequence_scores`` Dataset from the stacked columns of the score blocks (numpy or dask)."""
    dims = ("seq", "layer", "head")
    windows = ds.sizes["recent"]
    learned = {"learned_sink_score": (dims, stacked[..., 2 + windows])} if "learned_sink_attn" in ds else {}
    return xr.Dataset(
        {"sink_score": (dims, stacked[..., 0]), "prev_token_score": (dims, stacked[..., 1]),
         "distant_mass": ((*dims, "recent"), stacked[..., 2 : 2 + windows]), **learned},
        coords={"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values,
                "recent": ds["recent"].values.astype(np.int64)},
    )


def _query_groups(stacked: Any, ds: xr.Dataset, grid: np.ndarray) -> xr.Dataset:
    """The ``topn_by_query`` Dataset from the stacked columns (numpy or dask): every topn
    variable (seq, layer, head, query_pos, n), typed as in ``topn``, and the value statistics
    of each query's keys (seq, layer, head, query_pos)."""
    dims = ("seq", "layer", "head", "query_pos", "n")
    out = {}
    for i, name in enumerate(_QUERY_COLUMNS):
        x = stacked[..., i]
        if name in TOPN_COUNTS:
            x = x.astype(np.int64)
        elif name in TOPN_FLAGS:
            x = x.astype(np.int8)
        out[name] = (dims, x) if name in TOPN_VARIABLES else (dims[:4], x[..., 0])
    coords = {"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values,
              "query_pos": ds["query_pos"].values.astype(np.int64), "n": grid}
    return xr.Dataset(out, coords=coords)


def _block_variables(stacked: Any, ds: xr.Dataset, grid: np.ndarray) -> tuple[xr.Dataset, xr.Dataset, xr.Dataset]:
    """``topn``, ``values`` and ``taxonomy`` Datasets from the stacked columns (numpy or dask)."""
    coords = {"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values}
    dims = ("seq", "layer", "head", "n")
    columns = {name: stacked[..., i] for i, name in enumerate(_BLOCK_COLUMNS)}
    topn = {}
    for name in TOPN_VARIABLES:
        x = columns[name]
        if name in TOPN_COUNTS:
            x = x.astype(np.int64)
        elif name in TOPN_FLAGS:
            x = x.astype(np.int8)
        topn[name] = (dims, x)
    values = {name: (dims[:3], columns[name][:, :, :, 0]) for name in VALUE_STATISTICS}
    votes = stacked[:, :, :, 0, len(_BLOCK_COLUMNS) - len(VOTES):].astype(np.int64)
    return (xr.Dataset(topn, coords={**coords, "n": grid}), xr.Dataset(values, coords=coords),
            _votes_variables(votes, ds))


def _votes_variables(votes: Any, ds: xr.Dataset) -> xr.Dataset:
    """The ``taxonomy`` Dataset from vote counts (numpy or dask, whole layers per chunk)."""
    if isinstance(votes, da.Array):
        labels = da.map_blocks(taxonomy.plurality, votes, drop_axis=3, dtype=np.int8)
    else:
        labels = taxonomy.plurality(votes)
    return xr.Dataset(
        {"votes": (("seq", "layer", "head", "vote"), votes), "sequence_label": (("seq", "layer", "head"), labels)},
        coords={"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values,
                "vote": np.asarray(VOTES, dtype=object)},
        attrs={"source": "attn rows and values" if "attn" in ds else "winner", "labels": list(VOTES)},
    )


def _groups(grid: Sequence[int], seed: int, stacked: Any, ds: xr.Dataset,
            by_query_stacked: Any = None, score_stacked: Any = None) -> dict[str, xr.Dataset]:
    """The per-sequence groups from the stacked columns of the blocks (numpy or dask),
    topn_by_query from those of the query blocks and sequence_scores from those of the score
    blocks when given."""
    topn, values, votes = _block_variables(stacked, ds, np.asarray(grid, dtype=np.int64))
    attrs = {"n_grid": list(grid), "random_draws": RANDOM_DRAWS, "seed": seed}
    topn.attrs["attngeom"] = attrs
    groups = {"topn": topn, "values": values, "taxonomy": votes}
    if by_query_stacked is not None:
        groups["topn_by_query"] = _query_groups(by_query_stacked, ds, np.asarray(grid, dtype=np.int64))
        groups["topn_by_query"].attrs["attngeom"] = attrs
    if score_stacked is not None:
        groups["sequence_scores"] = _score_groups(score_stacked, ds)
    return groups


def template_groups(ds: xr.Dataset, grid: Sequence[int], seed: int) -> dict[str, xr.Dataset]:
    """The per-sequence groups of ``ds``'s sequences as they will be computed (shapes, types,
    coordinates, attributes) over dask arrays that are never computed: their metadata.

    Each array is one dask chunk: xarray refuses to write a zarr chunk (a batch of sequences)
    that straddles two dask chunks, and dask's automatic ones (128 MiB) would, from about 30
    sequences of a 7B model. Never computed, a chunk costs no memory."""
    shape = (ds.sizes["seq"], ds.sizes["layer"], ds.sizes["head"], len(grid), len(_BLOCK_COLUMNS))
    query_shape = (*shape[:3], ds.sizes.get("query_pos", 0), len(grid), len(_QUERY_COLUMNS))
    score_shape = (*shape[:3], _score_columns(ds))
    return _groups(grid, seed, da.empty(shape, dtype=np.float64, chunks=-1), ds,
                   da.empty(query_shape, dtype=np.float64, chunks=-1) if has_queries(ds) else None,
                   da.empty(score_shape, dtype=np.float64, chunks=-1) if has_scores(ds) else None)


def computed_groups(store: str, run: Any, ds: xr.Dataset, grid: Sequence[int],
                    seed: int) -> dict[str, xr.Dataset]:
    """The per-sequence groups of ``ds``'s sequences (of the run group ``run`` of the store at
    ``store``), computed. Only the (sequence, layer)
    blocks are Dask tasks; their results are split into variables here, so that a worker
    process is sent the work, not every variable's slice of the results."""
    grid = np.asarray(grid, dtype=np.int64)
    blocks = {"stacked": _analysis_blocks(store, run, ds, grid, seed)}
    if has_queries(ds):
        blocks["by_query_stacked"] = _query_blocks(store, run, ds, grid, seed)
    if has_scores(ds):
        blocks["score_stacked"] = _score_blocks(store, run, ds)
    (computed,) = dask.compute(blocks)
    return _groups(grid.tolist(), seed, ds=ds, **computed)
