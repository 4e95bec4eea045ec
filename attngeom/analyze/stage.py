"""The analyze stage: the kernels of SPEC §3 mapped over a store, out of core, with Dask.

Each task reads one (sequence, layer) chunk of ``attn_last`` and ``values`` (the store's inner
chunks), evaluates every head of it, and returns a few kilobytes; memory per worker is bounded
by one such chunk whatever the store's size. Results are written back to the store under
``runs/<id>/analysis/``:

- ``topn``    (seq, layer, head, n): the per-instance quantities of SPEC §3;
- ``values``  (seq, layer, head): norm and coherence statistics per sequence;
- ``taxonomy`` (seq, layer, head, vote): Diagonal/Sink/Other query votes of SPEC §4 and each
  sequence's plurality label;
- ``heads``   (layer, head): the regime (Retriever/Mixer/Reset) and vote fractions, the
  statistics' means and coefficients of variation across sequences, and the robust
  coherence constants at ``N = 64``;
- ``signatures`` (regime, n): mechanistic signatures, mean and median across a regime's heads;
- ``summary`` (layer, head, n, stat): mean, median, 5% and 95% quantiles and count of every
  ``topn`` variable across sequences, plus F conditioned on the sink's selection;
- ``table``   (row): the same as a tidy table (also Parquet and CSV with ``--out``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pandas as pd
import xarray as xr
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from attngeom.analyze import taxonomy
from attngeom.analyze.kernels import (
    TOPN_COUNTS,
    TOPN_FLOATS,
    VALUE_STATISTICS,
    topn_metrics,
    value_statistics,
)
from attngeom.errors import AttngeomError
from attngeom.store import (
    SIGNATURE_VARIABLES,
    STATS,
    VOTES,
    analysis_path,
    check_committed,
    completed,
    consolidate,
    open_dataset,
    open_root,
    open_run_group,
    run_ids,
    run_path,
    run_provenance,
    write_dataset,
    zarr_store,
)

TOPN_INTS = TOPN_COUNTS
TOPN_VARS = (*TOPN_FLOATS, *TOPN_COUNTS, "sink_selected")
VALUE_VARS = VALUE_STATISTICS
RANDOM_DRAWS = 8
# The paper's appendix reports the coherence constants at N = 64.
COHERENCE_N = 64
SEQ_CHUNK = 64


def default_n_grid(length: int) -> list[int]:
    """N in {1, 2, 4, ...} with N < L."""
    return [2**k for k in range(int(np.log2(max(length - 1, 1))) + 1) if 2**k < length]


def _instance_seed(seed: int, seq: int, layer: int) -> int:
    """A seed per (sequence, layer): the random control does not depend on chunking or order."""
    return int(np.random.SeedSequence([seed, seq, layer]).generate_state(1)[0])


def _head_values(values: np.ndarray, head_kv: np.ndarray) -> np.ndarray:
    """(KV, K, D) kv-head values -> (H, K, D): query head h reads kv head head_kv[h]."""
    return values[head_kv].astype(np.float64)


def _topn_block(attn, values, attendable, seq_ids, layer_ids, *, head_kv, n_grid, seed):
    """One (sequence, layer) block: attn (1,1,H,K), values (1,1,KV,K,D), attendable (1,K)
    -> (1, 1, H, n, var) float64 in TOPN_VARS order."""
    n_heads = attn.shape[2]
    out = topn_metrics(
        attn[0, 0].astype(np.float64),
        _head_values(values[0, 0], head_kv),
        np.broadcast_to(attendable[0], attn.shape[2:]),
        n_grid,
        seed=_instance_seed(seed, int(seq_ids[0]), int(layer_ids[0])),
        random_draws=RANDOM_DRAWS,
    )
    stacked = np.stack([out[name].astype(np.float64) for name in TOPN_VARS], axis=-1)
    return stacked.reshape(1, 1, n_heads, len(n_grid), len(TOPN_VARS))


def _values_block(values, attendable, *, head_kv):
    """values (1,1,KV,K,D), attendable (1,K) -> (1, 1, H, var) float64 in VALUE_VARS order."""
    head_values = _head_values(values[0, 0], head_kv)
    out = value_statistics(head_values, np.broadcast_to(attendable[0], head_values.shape[:2]))
    return np.stack([out[name] for name in VALUE_VARS], axis=-1)[None, None]


def _votes_from_rows_block(rows, values, *, head_kv):
    """Full rows (1,1,H,Q,K) and values (1,1,KV,K,D) -> vote counts (1,1,H,3)."""
    winner = taxonomy.winners_from_rows(rows[0, 0], values[0, 0], head_kv)
    return taxonomy.query_votes(winner)[None, None]


@dataclass(frozen=True)
class AnalyzeResult:
    run_id: str
    sequences: int
    instances: int
    seconds: float


def open_completed(store: str, run_id: str) -> xr.Dataset:
    """The run as a lazy Dataset restricted to committed sequences, with a ``seq`` coordinate;
    :class:`DamagedStoreError` if a committed sequence lacks a stored object."""
    root = open_root(store)
    run = open_run_group(root, run_id)
    check_committed(store, run, run_id)
    done = completed(run)
    ds = open_dataset(store, run_path(run_id))
    return ds.isel(seq=done).assign_coords(seq=("seq", done.astype("int64")))


def topn_dataset(ds: xr.Dataset, n_grid: Sequence[int], seed: int = 0) -> xr.Dataset:
    """Lazy (seq, layer, head, n) Dataset of every SPEC §3 quantity for the run ``ds``."""
    n_seq, n_layers = ds.sizes["seq"], ds.sizes["layer"]
    head_kv = ds["head_kv"].values
    attn = ds["attn_last"].data
    values = ds["values"].data
    attendable = da.from_array(ds["attendable"].values, chunks=(1, -1))
    seq_ids = da.from_array(ds["seq"].values, chunks=1)
    layer_ids = da.from_array(np.arange(n_layers), chunks=1)
    grid = np.asarray(n_grid, dtype=np.int64)
    stacked = da.blockwise(
        _topn_block, "slhnv",
        attn, "slhk", values, "slgkd", attendable, "lk", seq_ids, "s", layer_ids, "l",
        new_axes={"n": len(grid), "v": len(TOPN_VARS)},
        concatenate=True, dtype=np.float64,
        head_kv=head_kv, n_grid=grid, seed=seed,
    ).rechunk({0: min(SEQ_CHUNK, max(n_seq, 1)), 1: -1})
    dims = ("seq", "layer", "head", "n")
    data = {}
    for i, name in enumerate(TOPN_VARS):
        x = stacked[..., i]
        if name in TOPN_INTS:
            x = x.astype(np.int64)
        elif name == "sink_selected":
            x = x.astype(np.int8)
        data[name] = (dims, x)
    return xr.Dataset(
        data, coords={"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values, "n": grid}
    )


def values_dataset(ds: xr.Dataset) -> xr.Dataset:
    """Lazy (seq, layer, head) Dataset of the per-sequence norm and coherence statistics."""
    attendable = da.from_array(ds["attendable"].values, chunks=(1, -1))
    stacked = da.blockwise(
        _values_block, "slhv",
        ds["values"].data, "slgkd", attendable, "lk",
        new_axes={"h": ds.sizes["head"], "v": len(VALUE_VARS)},
        concatenate=True, dtype=np.float64, head_kv=ds["head_kv"].values,
    ).rechunk({0: min(SEQ_CHUNK, max(ds.sizes["seq"], 1)), 1: -1})
    dims = ("seq", "layer", "head")
    return xr.Dataset(
        {name: (dims, stacked[..., i]) for i, name in enumerate(VALUE_VARS)},
        coords={"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values},
    )


def votes_dataset(ds: xr.Dataset) -> xr.Dataset:
    """Lazy (seq, layer, head, vote) query-vote counts of SPEC §4 and each sequence's label.

    From the full rows and values when the run kept them (``--store-rows all``), else from
    the stored winners.
    """
    if "attn" in ds:
        votes = da.blockwise(
            _votes_from_rows_block, "slhv",
            ds["attn"].data, "slhqk", ds["values"].data, "slgkd",
            new_axes={"v": 3}, concatenate=True, dtype=np.int64, head_kv=ds["head_kv"].values,
        )
    else:
        winner = ds["winner"].data
        votes = da.map_blocks(taxonomy.query_votes, winner, chunks=winner.chunks[:3] + ((3,),), dtype=np.int64)
    votes = votes.rechunk({0: min(SEQ_CHUNK, max(ds.sizes["seq"], 1)), 1: -1})
    labels = da.map_blocks(taxonomy.plurality, votes, drop_axis=3, dtype=np.int8)
    return xr.Dataset(
        {"votes": (("seq", "layer", "head", "vote"), votes), "sequence_label": (("seq", "layer", "head"), labels)},
        coords={"seq": ds["seq"].values, "layer": ds["layer"].values, "head": ds["head"].values,
                "vote": np.asarray(VOTES, dtype=object)},
        attrs={"source": "attn rows and values" if "attn" in ds else "winner", "labels": list(VOTES)},
    )


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
    for name in VALUE_VARS:
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


def summary_dataset(topn: xr.Dataset) -> xr.Dataset:
    """(stat, layer, head, n) statistics across sequences of every topn variable (in memory).

    Count variables use -1 for "N not valid here"; they are masked before reducing. Also
    ``f_score_sink_selected`` / ``f_score_sink_unselected``: F conditioned on 0 in I_N.
    """
    masked = {
        name: topn[name].where(topn[name] >= 0) if name in TOPN_INTS or name == "sink_selected" else topn[name]
        for name in TOPN_VARS
    }
    selected = topn["sink_selected"] == 1
    masked["f_score_sink_selected"] = topn["f_score"].where(selected)
    masked["f_score_sink_unselected"] = topn["f_score"].where(topn["sink_selected"] == 0)
    masked["bound_violation"] = (topn["inversions"] > topn["k_sink"]).where(topn["k_sink"] >= 0)
    masked["certificate_violation"] = (topn["inversions"] > topn["k_sink_exact"]).where(topn["k_sink_exact"] >= 0)
    names = list(masked)
    dims = ("seq", "layer", "head", "n")
    x = np.stack([masked[name].transpose(*dims).values.astype(np.float64) for name in names], axis=-1)
    q05, q95 = np.nanquantile(x, [0.05, 0.95], axis=0)
    stats = np.stack(
        [np.nanmean(x, axis=0), np.nanmedian(x, axis=0), q05, q95, np.sum(~np.isnan(x), axis=0).astype(np.float64)]
    )
    coords = {d: topn[d].values for d in dims[1:]}
    coords["stat"] = np.array(STATS, dtype=object)
    return xr.Dataset(
        {name: (("stat", *dims[1:]), stats[..., i]) for i, name in enumerate(names)}, coords=coords
    )


def tidy_table(summary: xr.Dataset, provenance: dict, run_id: str) -> pd.DataFrame:
    """Long table: run, model, dataset, L, layer, head, n, variable, mean, median, q05, q95, count."""
    frame = summary.to_array("variable").to_dataset("stat").to_dataframe().reset_index()
    frame.insert(0, "run", run_id)
    frame.insert(1, "model", provenance.get("model", {}).get("id"))
    frame.insert(2, "dataset", provenance.get("dataset", {}).get("id"))
    frame.insert(3, "context_length", provenance.get("context_length"))
    frame = frame[["run", "model", "dataset", "context_length", "layer", "head", "n", "variable", *STATS]]
    text = ["run", "model", "dataset", "variable"]
    frame[text] = frame[text].astype(object)
    return frame


def _per_layer(reduce, *datasets: xr.Dataset) -> xr.Dataset:
    """``reduce`` applied to each layer of ``datasets`` loaded in memory, concatenated."""
    n_layers = datasets[0].sizes["layer"]
    parts = [reduce(*(d.isel(layer=[i]).load() for d in datasets)) for i in range(n_layers)]
    return xr.concat(parts, dim="layer", combine_attrs="override")


def run_regimes(store: str) -> dict[str, tuple[str, str, np.ndarray]]:
    """Run id -> (model, dataset, regime names (layer, head)) for every analyzed run."""
    root = open_root(store)
    out = {}
    for rid in run_ids(root):
        try:
            heads = open_dataset(store, analysis_path(rid, "heads"))
        except (FileNotFoundError, KeyError):
            continue
        if "regime" not in heads:
            continue
        prov = run_provenance(root, rid)
        out[rid] = (prov["model"]["id"], prov["dataset"]["id"], np.asarray(heads["regime"].values, dtype=object))
    return out


@contextlib.contextmanager
def dask_client(scheduler: str | None, store: str) -> Iterator[object | None]:
    """An existing cluster by address, ``"threads"`` for this process alone, else a
    LocalCluster of processes sized to the machine. A ``memory://`` store lives in this
    process only, so it is analyzed with threads.
    """
    if scheduler == "threads" or (store.startswith("memory://") and scheduler is None):
        # Dask's threads already fill the cores; a multi-threaded BLAS under each one
        # oversubscribes them (measured 1.3-1.5x slower). Distributed workers set this too.
        with dask.config.set(scheduler="threads"), threadpool_limits(limits=1):
            yield None
        return
    from distributed import Client, LocalCluster

    if scheduler is not None:
        try:
            client = Client(scheduler, timeout="10s")
        except OSError as exc:
            raise AttngeomError(f"cannot reach the Dask scheduler at {scheduler} ({exc})") from exc
        with client:
            yield client
        return
    # A task's error reaches the client, which reports it in one line; the workers' own
    # error log of it would print the traceback again.
    with LocalCluster(threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, Client(cluster) as client:
        yield client


def _write_by_sequence(dataset: xr.Dataset, store: str, group: str, label: str, progress: bool) -> None:
    """Compute and write a lazy (seq, ...) Dataset, SEQ_CHUNK sequences at a time.

    The group's metadata is written first; each batch is then a region write covering whole
    output chunks. Batching keeps the task graph, and so the client's memory, the size of one
    batch whatever the store's size.
    """
    write_dataset(dataset, store, group, compute=False)
    target = zarr_store(store, read_only=False)
    fixed = [name for name, v in dataset.variables.items() if "seq" not in v.dims]
    n_seq = dataset.sizes["seq"]
    with tqdm(total=n_seq, unit="seq", desc=label, disable=not progress) as bar:
        for a in range(0, n_seq, SEQ_CHUNK):
            b = min(n_seq, a + SEQ_CHUNK)
            part = dataset.isel(seq=slice(a, b)).drop_vars(fixed)
            part.to_zarr(target, group=group, region={"seq": slice(a, b)}, consolidated=False)
            bar.update(b - a)


def analyze(
    store: str,
    *,
    run_id: str | None = None,
    scheduler: str | None = None,
    n_grid: Sequence[int] | None = None,
    out: Path | None = None,
    seed: int = 0,
    progress: bool = True,
) -> list[AnalyzeResult]:
    """Analyze every run of the store (or ``run_id``); results go to ``runs/<id>/analysis``."""
    root = open_root(store, mode="a")
    runs = run_ids(root)
    if run_id is not None and run_id not in runs:
        raise AttngeomError(f"no run '{run_id}' in {store} (runs: {', '.join(runs) or 'none'})")
    todo = [run_id] if run_id else runs
    if not todo:
        raise AttngeomError(f"{store} holds no run; run extract first")
    results = []
    with dask_client(scheduler, store):
        for rid in todo:
            start = time.perf_counter()
            ds = open_completed(store, rid)
            if ds.sizes["seq"] == 0:
                raise AttngeomError(f"run '{rid}' has no complete sequence yet")
            length = ds.sizes["key"]
            grid = sorted(set(n_grid)) if n_grid else default_n_grid(length)
            if grid[0] < 1 or grid[-1] >= length:
                raise AttngeomError(f"--n-grid must hold sizes 1 <= N < L = {length}")
            topn = topn_dataset(ds, grid, seed)
            topn.attrs["attngeom"] = {"n_grid": grid, "random_draws": RANDOM_DRAWS, "seed": seed}
            _write_by_sequence(topn, store, analysis_path(rid, "topn"), f"{rid}: top-N geometry", progress)
            _write_by_sequence(values_dataset(ds), store, analysis_path(rid, "values"), f"{rid}: value statistics", progress)
            _write_by_sequence(votes_dataset(ds), store, analysis_path(rid, "taxonomy"), f"{rid}: source winners", progress)
            stored_topn = open_dataset(store, analysis_path(rid, "topn"))
            stored_values = open_dataset(store, analysis_path(rid, "values"))
            stored_votes = open_dataset(store, analysis_path(rid, "taxonomy"))
            # Reductions across sequences, one layer at a time in memory: a layer of results
            # is small, and numpy is faster here than a graph. NaN marks "not defined here"
            # (no sink, N too large), so all-NaN reductions are expected.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                heads = _per_layer(heads_dataset, stored_values, stored_topn, stored_votes)
                summary = _per_layer(summary_dataset, stored_topn)
                per_head = _per_layer(lambda t: t[list(SIGNATURE_VARIABLES)].mean("seq"), stored_topn)
                signatures = taxonomy.signatures_dataset(per_head, heads["regime"])
            write_dataset(heads, store, analysis_path(rid, "heads"))
            write_dataset(summary, store, analysis_path(rid, "summary"))
            write_dataset(signatures, store, analysis_path(rid, "signatures"))
            table = tidy_table(summary, ds.attrs.get("attngeom", {}), rid)
            write_dataset(xr.Dataset.from_dataframe(table.rename_axis("row")), store, analysis_path(rid, "table"))
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                table.to_parquet(out / f"{rid}.topn.parquet", index=False)
                table.to_csv(out / f"{rid}.topn.csv", index=False)
            results.append(AnalyzeResult(rid, ds.sizes["seq"], ds.sizes["seq"] * ds.sizes["layer"] * ds.sizes["head"], time.perf_counter() - start))
    consolidate(open_root(store, mode="a"))
    return results
