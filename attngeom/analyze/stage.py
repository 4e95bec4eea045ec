"""The analyze stage: the kernels of docs/method.md mapped over a store, out of core, with Dask.

Each task reads one (sequence, layer) chunk of ``attn_last``, ``values`` and the votes' source
(``winner``, or the full rows of a run that kept them) (the store's inner chunks), evaluates
every head of it, and returns a few kilobytes; memory per worker is bounded by one such chunk
whatever the store's size. Results are written back to the store under
``runs/<id>/analysis/``:

- ``topn``    (seq, layer, head, n): the per-instance quantities of docs/method.md;
- ``values``  (seq, layer, head): norm and coherence statistics per sequence;
- ``taxonomy`` (seq, layer, head, vote): Diagonal/Sink/Other query votes of docs/method.md#head-taxonomy and each
  sequence's plurality label;
- ``heads``   (layer, head): the regime (Retriever/Mixer/Reset) and vote fractions, the
  statistics' means and coefficients of variation across sequences, and the robust
  coherence constants at ``N = 64``;
- ``signatures`` (regime, n): mechanistic signatures, mean and median across a regime's heads;
- ``summary`` (layer, head, n, stat): mean, median, 5% and 95% quantiles and count of every
  ``topn`` variable across sequences, plus F conditioned on the sink's selection;
- ``table``   (row): the same as a tidy table (also Parquet and CSV with ``--out``);
- ``topn_by_query`` (seq, layer, head, query_pos, n) and ``summary_by_query``: the same at each
  stored query of a run extracted with ``--queries`` (:mod:`attngeom.analyze.by_query`),
  committed, healed and resumed with the other groups.

The analysis is committed last (:mod:`attngeom.store.derived`): its record says which
sequences and which parameters (:func:`analysis_parameters`) it covers. A rerun with the same
parameters computes only the sequences not yet covered, appending them along ``seq``, then
recomputes the groups across sequences; with other parameters everything is recomputed into
staging while the earlier analysis stays readable. Killed at any moment, the same command
resumes and ends bit for bit where an uninterrupted one does. A rerun also rewrites what of
the committed analysis is lost or damaged (:func:`attngeom.store.plan.healing`). One
:class:`~attngeom.store.derived.DerivedWrite` owns the record from the plan to the commit.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import dask.threaded
import numpy as np
import pandas as pd
import xarray as xr
from tqdm.auto import tqdm

from attngeom.analyze import by_query, taxonomy
from attngeom.analyze.kernels import MAX_KEYS, compile_kernels, head_metrics
from attngeom.analyze.scheduling import dask_client
from attngeom.errors import GroupNotFoundError, InputError, RunNotFoundError
from attngeom.store import (
    ANALYSIS,
    ANALYSIS_GROUPS,
    ANALYSIS_SEQUENCE_GROUPS,
    QUERY_GROUPS,
    QUERY_SEQUENCE_GROUPS,
    SIGNATURE_VARIABLES,
    TOPN_COUNTS,
    TOPN_VARIABLES,
    VALUE_STATISTICS,
    STATS,
    VOTES,
    analysis_path,
    check_committed,
    completed,
    open_dataset,
    open_root,
    read_chunk,
    require_runs,
    run_path,
    run_provenance,
)
from attngeom.store.access import encode_labels
from attngeom.store.derived import DerivedWrite, forget_unreadable, open_derived
from attngeom.store.session import StoreSession

RANDOM_DRAWS = 8
# The paper's appendix reports the coherence constants at N = 64.
COHERENCE_N = 64
# Part of the parameters an analysis records: bump it with any change to the kernels or to
# this stage that changes a stored bit, so that a rerun recomputes instead of mixing results.
ANALYSIS_VERSION = 4
# (sequence, layer) tasks per batch: the analysis records its progress after each batch, so
# a killed analyze loses at most one; enough tasks to keep every worker busy meanwhile.
BATCH_TASKS = 128
# Largest ``topn`` the cross-sequence reductions load at once (a 7B model with 1,024 heads has
# about 4 MB a sequence at 12 N): larger ones are reduced one variable at a time.
_LOADED_TOPN_BYTES = 1 << 28


# The columns of a (sequence, layer) block's results (`_analysis_block`).
_BLOCK_COLUMNS = (*TOPN_VARIABLES, *VALUE_STATISTICS, *(f"votes_{vote}" for vote in VOTES))


def default_n_grid(length: int) -> list[int]:
    """N in {1, 2, 4, ...} with N < L."""
    return [2**k for k in range(int(np.log2(max(length - 1, 1))) + 1) if 2**k < length]


def _instance_seed(seed: int, seq: int, layer: int) -> int:
    """A seed per (sequence, layer): the random control does not depend on chunking or order."""
    return int(np.random.SeedSequence([seed, seq, layer]).generate_state(1)[0])


def _analysis_block(*, block_id, seqs, store, inputs, attendable, head_kv, n_grid, seed):
    """The (sequence, layer) block ``block_id[:2]`` (sequence seqs[block_id[0]] of the run),
    read here from the run's zarr arrays ``inputs``: attn_last (H, K), values (KV, K, D) and
    the votes' source, winner (H, Q) or the full rows attn (H, Q, K) of a run that kept them;
    attendable (layer, K) -> (1, 1, H, n, column) float64: the _BLOCK_COLUMNS, the value
    statistics and votes the same at every n; query head h takes the statistics of kv head
    head_kv[h]. One kernel call serves both geometry outputs, so each kv head's Gram matrix is
    computed once."""
    seq, layer = int(seqs[block_id[0]]), block_id[1]
    attn, kv_values, source = (read_chunk(store, arr, (seq, layer)) for arr in inputs)
    kv_values = kv_values.astype(np.float64)
    topn, stats = head_metrics(
        attn.astype(np.float64),
        kv_values,
        np.broadcast_to(attendable[layer], kv_values.shape[:2]),
        n_grid,
        head_kv=head_kv,
        seed=_instance_seed(seed, seq, layer),
        random_draws=RANDOM_DRAWS,
    )
    winner = source if source.ndim == 2 else taxonomy.winners_from_rows(source, kv_values, head_kv)
    per_n = np.stack([topn[name].astype(np.float64) for name in TOPN_VARIABLES], axis=-1)
    per_head = np.concatenate([np.stack([stats[name][head_kv] for name in VALUE_STATISTICS], axis=-1),
                               taxonomy.query_votes(winner)], axis=-1)
    per_head = np.broadcast_to(per_head[:, None], (*per_n.shape[:2], per_head.shape[-1]))
    return np.concatenate([per_n, per_head], axis=-1)[None, None]


def _votes_from_rows_block(rows, values, *, head_kv):
    """Full rows (1,1,H,Q,K) and values (1,1,KV,K,D) -> vote counts (1,1,H,3)."""
    winner = taxonomy.winners_from_rows(rows[0, 0], values[0, 0], head_kv)
    return taxonomy.query_votes(winner)[None, None]


@dataclass(frozen=True)
class AnalyzeResult:
    """One run's analyze: ``sequences`` covered by the analysis now, ``new_sequences``
    computed by this call, ``instances`` the (sequence, layer, head) instances covered,
    ``seconds`` wall time; ``recomputed`` says why earlier results were recomputed rather
    than extended (None when they were extended, or there were none); ``healed`` names the
    damaged committed groups written again (None when there were none)."""

    run_id: str
    sequences: int
    new_sequences: int
    instances: int
    seconds: float
    recomputed: str | None = None
    healed: str | None = None


def open_completed(store: str, run_id: str) -> xr.Dataset:
    """The run as a lazy Dataset restricted to committed sequences, with a ``seq`` coordinate;
    :class:`DamagedStoreError` if a committed sequence lacks a stored object."""
    with StoreSession(store) as session:
        return _completed(session, run_id)


def _completed(session: StoreSession, run_id: str) -> xr.Dataset:
    """:func:`open_completed` of the session's store."""
    run = session.run(run_id)
    check_committed(session.url, run, run_id)
    done = completed(run)
    ds = open_dataset(session.url, run_path(run_id), zstore=session.zstore)
    return ds.isel(seq=done).assign_coords(seq=("seq", done.astype("int64")))


def _analysis_blocks(store: str, run: Any, ds: xr.Dataset, grid: np.ndarray, seed: int) -> da.Array:
    """Lazy (seq, layer, head, n, column) float64 of the sequences of ``ds`` (the run group
    ``run`` of ``store``, opened by :func:`open_completed`): :func:`_analysis_block`, one task
    per (sequence, layer). A task reads its own inputs: a graph that read them in tasks of
    their own (and selected the sequences in more) sent every chunk through this process on
    its way to a worker: about 12 ms more for each block of 43 ms (smollm2-135m, L = 512, two
    worker processes). The votes are counted in the same task: in a graph of their own they
    were 361 more tasks for 4 sequences of smollm2-135m (0.2 s computed alone)."""
    return da.map_blocks(
        _analysis_block,
        chunks=((1,) * ds.sizes["seq"], (1,) * ds.sizes["layer"], (ds.sizes["head"],), (len(grid),),
                (len(_BLOCK_COLUMNS),)),
        dtype=np.float64, meta=np.empty((0,) * 5),
        seqs=ds["seq"].values, store=store,
        inputs=(run["attn_last"], run["values"], run["attn" if "attn" in ds else "winner"]),
        attendable=ds["attendable"].values, head_kv=ds["head_kv"].values, n_grid=grid, seed=seed,
    )


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
        elif name == "sink_selected":
            x = x.astype(np.int8)
        topn[name] = (dims, x)
    values = {name: (dims[:3], columns[name][:, :, :, 0]) for name in VALUE_STATISTICS}
    votes = stacked[:, :, :, 0, len(_BLOCK_COLUMNS) - len(VOTES):].astype(np.int64)
    return (xr.Dataset(topn, coords={**coords, "n": grid}), xr.Dataset(values, coords=coords),
            _votes_variables(votes, ds))


def _vote_blocks(ds: xr.Dataset) -> da.Array:
    """Lazy (seq, layer, head, vote) query-vote counts: from the full rows and values when
    the run kept them (``--store-rows all``), else from the stored winners."""
    if "attn" in ds:
        return da.blockwise(
            _votes_from_rows_block, "slhv",
            ds["attn"].data, "slhqk", ds["values"].data, "slgkd",
            new_axes={"v": 3}, concatenate=True, dtype=np.int64, head_kv=ds["head_kv"].values,
        )
    winner = ds["winner"].data
    return da.map_blocks(taxonomy.query_votes, winner, chunks=winner.chunks[:3] + ((3,),), dtype=np.int64)


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


def votes_dataset(ds: xr.Dataset) -> xr.Dataset:
    """Lazy (seq, layer, head, vote) query-vote counts (docs/method.md#head-taxonomy) and each sequence's label.

    From the full rows and values when the run kept them (``--store-rows all``), else from
    the stored winners.
    """
    return _votes_variables(_vote_blocks(ds).rechunk({1: -1}), ds)


def _cv(x: xr.DataArray, dim: str) -> xr.DataArray:
    """Coefficient of variation std/mean across ``dim``."""
    return x.std(dim) / x.mean(dim)


def heads_dataset(values: xr.Dataset, topn: xr.Dataset, votes: xr.Dataset) -> xr.Dataset:
    """(layer, head): the regime and its vote fractions, the per-sequence statistics' means
    and CVs, and the coherence constants at N = 64."""
    label = taxonomy.head_regimes(votes["sequence_label"].transpose("seq", "layer", "head").values)
    total = votes["votes"].sum("seq")
    out = {"regime": (("layer", "head"), taxonomy.regime_names(label))}
    for k, name in enumerate(VOTES):
        out[f"vote_{name}"] = (total.isel(vote=k) / total.sum("vote")).drop_vars("vote")
        out[f"sequences_{name}"] = (votes["sequence_label"] == k).sum("seq")
    for name in VALUE_STATISTICS:
        out[name] = values[name].mean("seq")
        out[f"{name}_cv"] = _cv(values[name], "seq")
    n = topn["n"].values
    at = n[n <= COHERENCE_N].max() if (n <= COHERENCE_N).any() else n.min()
    coherence = topn.sel(n=at).drop_vars("n")
    for name in ("mu_q95", "mu"):
        out[name] = coherence[name].mean("seq")
        out[f"{name}_cv"] = _cv(coherence[name], "seq")
    heads = xr.Dataset(out)
    heads.attrs["coherence_n"] = int(at)
    return heads


def nan_quantiles(x: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles along axis 0 ignoring NaN, numpy's default ("linear") method:
    (len(qs), *x.shape[1:]); NaN where a column has no number.

    ``np.nanquantile`` equals it value for value but loops in Python over the columns that
    hold a NaN (seconds for a summary); this sorts once (NaN last) and interpolates.
    """
    return _sorted_quantiles(np.sort(x, axis=0), np.sum(~np.isnan(x), axis=0), qs)


def nan_median(x: np.ndarray) -> np.ndarray:
    """Median along axis 0 ignoring NaN, as ``np.nanmedian``: the mean of the two middle
    numbers (one, for an odd count); NaN where a column has no number."""
    return _sorted_median(np.sort(x, axis=0), np.sum(~np.isnan(x), axis=0))


def _sorted_quantiles(ordered: np.ndarray, count: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """:func:`nan_quantiles` from x sorted along axis 0 (NaN last) and its count of numbers."""
    last = np.maximum(count - 1, 0)
    out = []
    for q in qs:
        pos = q * last.astype(np.float64)
        below = np.floor(pos).astype(np.int64)
        above = np.minimum(below + 1, last)
        a = np.take_along_axis(ordered, below[None], axis=0)[0]
        b = np.take_along_axis(ordered, above[None], axis=0)[0]
        t = pos - below
        # numpy's _lerp: from the nearer end, so that t = 0 and t = 1 give a and b exactly.
        diff = b - a
        value = np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
        out.append(np.where(count > 0, value, np.nan))
    return np.stack(out)


def _sorted_median(ordered: np.ndarray, count: np.ndarray) -> np.ndarray:
    """:func:`nan_median` from x sorted along axis 0 (NaN last) and its count of numbers."""
    low = np.maximum(count - 1, 0) // 2
    a = np.take_along_axis(ordered, low[None], axis=0)[0]
    b = np.take_along_axis(ordered, (count // 2)[None], axis=0)[0] if ordered.shape[0] else a
    return np.where(count > 0, (a + b) / 2, np.nan)


def _summary_inputs(topn: xr.Dataset) -> Iterator[tuple[str, np.ndarray]]:
    """(name, (seq, layer, head, n) float64) of every variable summarized, one at a time:
    each topn variable (counts' -1 "N not valid here" as NaN), then F conditioned on the
    sink's selection and the violation indicators of the two bounds."""

    def load(name: str) -> np.ndarray:
        return topn[name].transpose("seq", "layer", "head", "n").values

    for name in TOPN_VARIABLES:
        x = load(name).astype(np.float64)
        if name in TOPN_COUNTS or name == "sink_selected":
            x[x < 0] = np.nan
        yield name, x
    f_score, sink = load("f_score"), load("sink_selected")
    yield "f_score_sink_selected", np.where(sink == 1, f_score, np.nan)
    yield "f_score_sink_unselected", np.where(sink == 0, f_score, np.nan)
    inversions = load("inversions")
    for name, bound in (("bound_violation", "k_sink"), ("certificate_violation", "k_sink_exact")):
        k = load(bound)
        yield name, np.where(k >= 0, (inversions > k).astype(np.float64), np.nan)


def summary_dataset(topn: xr.Dataset) -> xr.Dataset:
    """(stat, layer, head, n) statistics across sequences of every topn variable: mean,
    median, 5% and 95% quantiles (NaN-ignoring) and count of numbers.

    Count variables use -1 for "N not valid here"; they are masked before reducing. Also
    ``f_score_sink_selected`` / ``f_score_sink_unselected``: F conditioned on 0 in I_N, and
    ``bound_violation`` / ``certificate_violation``: A_N > K_N^sink. ``topn`` may be lazy: one
    variable at a time is in memory.
    """
    out = {}
    for name, x in _summary_inputs(topn):
        # One sort serves the median and the quantiles: at 1,000 sequences of a 7B model, a
        # sort is 0.3 s of each of the 42 variables, reduced after the workers are done.
        ordered, count = np.sort(x, axis=0), np.sum(~np.isnan(x), axis=0)
        q05, q95 = _sorted_quantiles(ordered, count, [0.05, 0.95])
        mean = np.sum(np.nan_to_num(x), axis=0) / np.where(count > 0, count, np.nan)
        stats = np.stack([mean, _sorted_median(ordered, count), q05, q95, count.astype(np.float64)])
        out[name] = (("stat", "layer", "head", "n"), stats)
    coords = {d: topn[d].values for d in ("layer", "head", "n")}
    coords["stat"] = np.array(STATS, dtype=object)
    return xr.Dataset(out, coords=coords)


_TABLE_COLUMNS = ("run", "model", "dataset", "context_length", "layer", "head", "n", "variable", *STATS)


def tidy_table(summary: xr.Dataset, provenance: dict, run_id: str) -> pd.DataFrame:
    """Long table: run, model, dataset, L, layer, head, n, variable, mean, median, q05, q95, count."""
    frame = summary.to_array("variable").to_dataset("stat").to_dataframe().reset_index()
    frame.insert(0, "run", run_id)
    frame.insert(1, "model", provenance.get("model", {}).get("id"))
    frame.insert(2, "dataset", provenance.get("dataset", {}).get("id"))
    frame.insert(3, "context_length", provenance.get("context_length"))
    frame = frame[list(_TABLE_COLUMNS)]
    text = ["run", "model", "dataset", "variable"]
    frame[text] = frame[text].astype(object)
    return frame


def table_dataset(summary: xr.Dataset, provenance: dict, run_id: str) -> xr.Dataset:
    """The ``table`` group: :func:`tidy_table` row for row, (variable, layer, head, n) in
    that order, its text columns already label codes (:func:`encode_labels`). Built from
    the summary's arrays: a frame of strings, then their codes, took half a second for a
    7B model's 440,000 rows."""
    names = list(summary.data_vars)
    axes = [np.asarray(names, dtype=object), *(summary[d].values for d in ("layer", "head", "n"))]
    rows = int(np.prod([a.size for a in axes]))

    def column(x: np.ndarray, axis: int) -> np.ndarray:
        """x (one value per entry of axes[axis]) in each row."""
        inner = int(np.prod([a.size for a in axes[axis + 1:]]))
        return np.tile(np.repeat(x, inner), rows // (x.size * inner))

    def constant(value: Any) -> np.ndarray:
        return pd.Series([value]).to_numpy()  # the data type pandas gives the inserted column

    # The text columns are coded on their few distinct values, then spread over the rows.
    few = encode_labels(xr.Dataset({
        "run": ("one", constant(run_id)),
        "model": ("one", constant(provenance.get("model", {}).get("id"))),
        "dataset": ("one", constant(provenance.get("dataset", {}).get("id"))),
        "context_length": ("one", constant(provenance.get("context_length"))),
        "variable": ("names", axes[0]),
    }))
    stats = np.stack([summary[name].transpose("stat", "layer", "head", "n").values for name in names])
    columns = {name: (np.repeat(few[name].values, rows), few[name].attrs)
               for name in ("run", "model", "dataset", "context_length")}
    columns.update({name: (column(axes[i], i), {}) for i, name in ((1, "layer"), (2, "head"), (3, "n"))})
    columns["variable"] = (column(few["variable"].values, 0), few["variable"].attrs)
    at = {stat: i for i, stat in enumerate(summary["stat"].values)}
    columns.update({stat: (stats[:, at[stat]].ravel(), {}) for stat in STATS})
    return xr.Dataset({name: xr.Variable("row", x, attrs) for name, (x, attrs) in columns.items()},
                      coords={"row": np.arange(rows)})


def run_regimes(store: str) -> dict[str, tuple[str, str, np.ndarray]]:
    """Run id -> (model, dataset, regime names (layer, head)) for every analyzed run.

    Raises :class:`IncompleteGroupError` for a run whose analysis is not finished."""
    root = open_root(store)
    out = {}
    for rid in require_runs(root, store):
        try:
            heads = open_derived(store, rid, ANALYSIS, "heads")
        except GroupNotFoundError:
            continue
        if "regime" not in heads:
            continue
        prov = run_provenance(root, rid)
        out[rid] = (prov["model"]["id"], prov["dataset"]["id"], np.asarray(heads["regime"].values, dtype=object))
    return out


def analysis_parameters(n_grid: Sequence[int], seed: int) -> dict[str, Any]:
    """What an analysis's values depend on besides the run's sequences; recorded with it."""
    return {"n_grid": [int(n) for n in n_grid], "seed": int(seed), "random_draws": RANDOM_DRAWS,
            "analysis_version": ANALYSIS_VERSION}


def _sequence_groups(ds: xr.Dataset) -> tuple[str, ...]:
    """The per-sequence groups of the run ``ds``: topn_by_query too for a run with queries."""
    return (*ANALYSIS_SEQUENCE_GROUPS, *(QUERY_SEQUENCE_GROUPS if by_query.has_queries(ds) else ()))


def _all_groups(ds: xr.Dataset) -> tuple[str, ...]:
    """Every group an analysis of the run ``ds`` commits."""
    return (*ANALYSIS_GROUPS, *(QUERY_GROUPS if by_query.has_queries(ds) else ()))


def _groups(grid: Sequence[int], seed: int, stacked: Any, ds: xr.Dataset,
            by_query_stacked: Any = None) -> dict[str, xr.Dataset]:
    """The per-sequence groups from the stacked columns of the blocks (numpy or dask), and
    topn_by_query from those of the query blocks when given."""
    topn, values, votes = _block_variables(stacked, ds, np.asarray(grid, dtype=np.int64))
    attrs = {"n_grid": list(grid), "random_draws": RANDOM_DRAWS, "seed": seed}
    topn.attrs["attngeom"] = attrs
    groups = {"topn": topn, "values": values, "taxonomy": votes}
    if by_query_stacked is not None:
        groups["topn_by_query"] = by_query.query_groups(by_query_stacked, ds, np.asarray(grid, dtype=np.int64))
        groups["topn_by_query"].attrs["attngeom"] = attrs
    return groups


def _template_groups(ds: xr.Dataset, grid: Sequence[int], seed: int) -> dict[str, xr.Dataset]:
    """The per-sequence groups of ``ds``'s sequences as they will be computed (shapes, types,
    coordinates, attributes) over dask arrays that are never computed: their metadata.

    Each array is one dask chunk: xarray refuses to write a zarr chunk (a batch of sequences)
    that straddles two dask chunks, and dask's automatic ones (128 MiB) would, from about 30
    sequences of a 7B model. Never computed, a chunk costs no memory."""
    shape = (ds.sizes["seq"], ds.sizes["layer"], ds.sizes["head"], len(grid), len(_BLOCK_COLUMNS))
    query_shape = (*shape[:3], ds.sizes.get("query_pos", 0), len(grid), len(by_query.COLUMNS))
    return _groups(grid, seed, da.empty(shape, dtype=np.float64, chunks=-1), ds,
                   da.empty(query_shape, dtype=np.float64, chunks=-1) if by_query.has_queries(ds) else None)


def _computed_groups(store: str, run: Any, ds: xr.Dataset, grid: Sequence[int],
                     seed: int) -> dict[str, xr.Dataset]:
    """The per-sequence groups of ``ds``'s sequences, computed. Only the (sequence, layer)
    blocks are Dask tasks; their results are split into variables here, so that a worker
    process is sent the work, not every variable's slice of the results."""
    grid = np.asarray(grid, dtype=np.int64)
    blocks = [_analysis_blocks(store, run, ds, grid, seed)]
    if by_query.has_queries(ds):
        blocks.append(by_query.query_blocks(store, run, ds, grid, seed,
                                            instance_seed=_instance_seed, random_draws=RANDOM_DRAWS))
    stacked, *per_query = dask.compute(*blocks)
    return _groups(grid.tolist(), seed, stacked, ds, *per_query)


def _per_sequence_groups(write: DerivedWrite, n_seq: int, names: Sequence[str],
                         held: Mapping[str, Sequence[xr.Dataset]] | None) -> dict[str, xr.Dataset]:
    """The per-sequence groups ``names`` over their first ``n_seq`` sequences: lazy, read from
    the store; or with ``held`` (group -> the Datasets of the last sequences, computed by this
    analyze, in ``seq`` order), those in memory after the sequences before them, read here."""
    if held is None:
        return {name: write.read(name).isel(seq=slice(0, n_seq)) for name in names}
    out = {}
    for name in names:
        parts = list(held.get(name, ()))
        first = n_seq - sum(part.sizes["seq"] for part in parts)
        if first:
            parts.insert(0, write.read(name).isel(seq=slice(0, first)).load())
        # The other coordinates and the attributes are the same in every part.
        out[name] = parts[0] if len(parts) == 1 else xr.concat(
            parts, "seq", data_vars="all", coords="minimal", compat="override", join="override",
            combine_attrs="override")
    return out


def _cross_sequence_groups(write: DerivedWrite, n_seq: int, provenance: dict,
                           names: Sequence[str], held: Mapping[str, Sequence[xr.Dataset]] | None = None,
                           ) -> dict[str, xr.Dataset]:
    """heads, summary, signatures and table (and summary_by_query when ``names``, the
    per-sequence groups, hold topn_by_query) from the per-sequence groups (their first
    ``n_seq`` sequences; the last ones from ``held`` when given, see
    :func:`_per_sequence_groups`), reduced in this process: ``topn`` loaded whole up to
    _LOADED_TOPN_BYTES (each variable read by its own dask compute cost 0.2 s of an analyze
    of 4 sequences), one variable at a time beyond."""
    stored = _per_sequence_groups(write, n_seq, names, held)
    topn = stored["topn"]
    # NaN marks "not defined here" (no sink, N too large): all-NaN reductions are expected.
    # The reads are small; a cluster would only add transfers.
    with warnings.catch_warnings(), dask.config.set(scheduler=dask.threaded.get):
        warnings.simplefilter("ignore", RuntimeWarning)
        if topn.nbytes <= _LOADED_TOPN_BYTES:
            topn = topn.load()
        heads = heads_dataset(stored["values"].load(), topn[["mu", "mu_q95"]].load(), stored["taxonomy"].load())
        summary = summary_dataset(topn)
        per_head = topn[list(SIGNATURE_VARIABLES)].load().mean("seq")
        signatures = taxonomy.signatures_dataset(per_head, heads["regime"])
        if "topn_by_query" in stored:
            per_query = stored["topn_by_query"]
            if per_query.nbytes <= _LOADED_TOPN_BYTES:
                per_query = per_query.load()
            summary_query = by_query.summary_by_query(per_query, summary_dataset)
    groups = {"heads": heads, "summary": summary, "signatures": signatures,
              "table": table_dataset(summary, provenance, write.run_id)}
    if "topn_by_query" in stored:
        groups["summary_by_query"] = summary_query
    return groups


def _sequences_per_batch(n_layers: int) -> int:
    return max(1, BATCH_TASKS // max(n_layers, 1))


def _batches(start: int, stop: int, n_layers: int) -> Iterator[tuple[int, int]]:
    size = _sequences_per_batch(n_layers)
    for a in range(start, stop, size):
        yield a, min(stop, a + size)


def _checked_input(session: StoreSession, run_id: str,
                   n_grid: Sequence[int] | None) -> tuple[xr.Dataset, list[int]]:
    """The run's committed sequences and the N grid, refusing what cannot be analyzed."""
    ds = _completed(session, run_id)
    if ds.sizes["seq"] == 0:
        raise RunNotFoundError(f"run '{run_id}' has no complete sequence yet")
    length = ds.sizes["key"]
    if length > MAX_KEYS:
        raise InputError(f"run '{run_id}' has L = {length} keys per query; analyze takes at most {MAX_KEYS}")
    grid = sorted(set(n_grid)) if n_grid else default_n_grid(length)
    if grid[0] < 1 or grid[-1] >= length:
        raise InputError(f"--n-grid must hold sizes 1 <= N < L = {length} (run '{run_id}')")
    return ds, grid


def _compute_sequences(write: DerivedWrite, run: Any, ds: xr.Dataset, grid: Sequence[int], seed: int,
                       progress: bool) -> tuple[int, dict[str, list[xr.Dataset]] | None]:
    """Compute and write the per-sequence groups of the sequences the update's plan does not
    keep, batch by batch (:meth:`DerivedWrite.append` records each); returns how many
    sequences were computed, and the computed groups, batch after batch, when they are small
    enough to keep (None when not)."""
    plan = write.plan
    keep, target, run_id = plan.keep, plan.target, write.run_id
    batches = list(_batches(len(keep), len(target), ds.sizes["layer"]))

    def compute(batch: tuple[int, int]) -> dict[str, xr.Dataset]:
        return _computed_groups(write.url, run, ds.isel(seq=slice(*batch)), grid, seed)

    # Batches in flight beside the one being written: the workers compute the next batch
    # while this process writes one, and are handed the batch after it before the tail of
    # the one they run ends. Their results are a few kilobytes per task. Dask's threads give
    # each computing thread a pool of its own, so there one batch at a time keeps one task
    # per core (and memory to one task per core).
    in_flight = 1 if dask.config.get("scheduler", None) in ("threads", dask.threaded.get) else 2
    # The reductions across sequences load the groups whole when small: those computed are
    # then kept here instead of being read back from the store (they are views of the
    # blocks' results, which hold the per-head columns at every n too: a third more).
    held: dict[str, list[xr.Dataset]] | None = {name: [] for name in _sequence_groups(ds)} if batches else None
    computing = ThreadPoolExecutor(in_flight)
    try:
        with tqdm(total=len(target) - len(keep), unit="seq", desc=f"{run_id}: analyze", disable=not progress) as bar:
            futures = [computing.submit(compute, batch) for batch in batches[:in_flight]]
            # The workers start on the first batches while the groups are created.
            write.create(_template_groups(ds, grid, seed), _sequences_per_batch(ds.sizes["layer"]))
            for i, (a, b) in enumerate(batches):
                computed = futures[i].result()
                if i + in_flight < len(batches):
                    futures.append(computing.submit(compute, batches[i + in_flight]))
                write.append(computed)
                if held is not None and sum(d.nbytes for d in computed.values()) * len(target) <= (
                        _LOADED_TOPN_BYTES * (b - a)):
                    for name, data in computed.items():
                        held[name].append(data)
                else:
                    held = None
                bar.update(b - a)
    finally:
        # On an error or Ctrl-C, a batch still computing is not waited for: leaving the
        # scheduler's context cancels its tasks.
        computing.shutdown(wait=False, cancel_futures=True)
    return len(target) - len(keep), held


def analyze_run(session: StoreSession, run_id: str, ds: xr.Dataset, grid: Sequence[int], *, seed: int = 0,
                out: Path | None = None, progress: bool = True, deep: bool = False) -> AnalyzeResult:
    """Bring the analysis of one run up to date with its committed sequences ``ds`` (as
    :func:`_checked_input` returned them, with the N grid ``grid``), in the Dask scheduler
    of the caller's context, rewriting what of it is damaged: measure -> write per batch ->
    reduce -> commit, one :class:`DerivedWrite` owning the record throughout. The committed
    groups are checked for lost or resized objects, and with ``deep`` also for objects
    failing to decode."""
    start = time.perf_counter()
    params = analysis_parameters(grid, seed)
    # Small arrays every task needs, read once, here: through the workers they cost a round trip.
    ds = ds.assign(attendable=ds["attendable"].load(scheduler=dask.get), head_kv=ds["head_kv"].load(scheduler=dask.get))
    target = tuple(int(s) for s in ds["seq"].values)

    sequence_groups = _sequence_groups(ds)
    with session.derived(run_id, ANALYSIS, deep=deep) as write:
        plan = write.begin(params, target, _all_groups(ds), sequence_groups)
        healed = "; ".join(f"{analysis_path(run_id)}/{write.damage[name]}" for name in plan.heal) or None
        if plan.up_to_date:
            # In the tidy table's column order, not the order the store lists the arrays in.
            table = (write.read("table").to_dataframe().reset_index(drop=True)[list(_TABLE_COLUMNS)]
                     if out is not None else None)
            new = 0
        else:
            new, held = _compute_sequences(write, session.run(run_id), ds, grid, seed, progress)
            cross = _cross_sequence_groups(write, len(target), ds.attrs.get("attngeom", {}), sequence_groups, held)
            table = tidy_table(cross["summary"], ds.attrs.get("attngeom", {}), run_id) if out is not None else None
            write.finish(cross)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table.to_parquet(out / f"{run_id}.topn.parquet", index=False)
        table.to_csv(out / f"{run_id}.topn.csv", index=False)
    instances = len(target) * ds.sizes["layer"] * ds.sizes["head"]
    return AnalyzeResult(run_id, len(target), new, instances, time.perf_counter() - start, plan.recomputed, healed)


def analyze(
    store: str,
    *,
    run_id: str | None = None,
    scheduler: str | None = None,
    n_grid: Sequence[int] | None = None,
    out: Path | None = None,
    seed: int = 0,
    progress: bool = True,
    deep: bool = False,
) -> list[AnalyzeResult]:
    """Analyze every run of the store (or ``run_id``); results go to ``runs/<id>/analysis``.

    Incremental: a run's sequences already analyzed with the same parameters are kept, and
    damaged committed groups written again (see :func:`analyze_run`; ``deep`` also reads
    every committed object). Two analyzes of one run on a local store run one after the
    other."""
    with StoreSession(store, mode="a") as session:
        runs = session.runs()
        if run_id is not None:
            session.run(run_id)
        todo = [run_id] if run_id else runs
        # An analysis whose record does not parse is none (xarray could not even open the run).
        dropped = {rid for rid in todo if forget_unreadable(session, rid, ANALYSIS)}
        # Every run's input checked before any analysis is touched.
        checked = {rid: _checked_input(session, rid, n_grid) for rid in todo}
        compile_kernels()
        with dask_client(scheduler, store):
            results = [analyze_run(session, rid, *checked[rid], seed=seed, out=out, progress=progress, deep=deep)
                       for rid in todo]
    return [replace(r, recomputed=f"its record {analysis_path(r.run_id)}/zarr.json did not parse")
            if r.run_id in dropped else r for r in results]
