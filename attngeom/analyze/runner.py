"""The analyze stage: the kernels of docs/method.md mapped over a store, out of core, with Dask.

The run's (sequence, layer) blocks are Dask tasks (:mod:`attngeom.analyze.blocks`), computed
batch after batch and written as they come; the groups across sequences are reduced last
(:mod:`attngeom.analyze.reductions`, :mod:`attngeom.analyze.tables`). Results are written
back to the store under ``runs/<id>/analysis/``:

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
  stored query of a run extracted with ``--queries``,
  committed, healed and resumed with the other groups;
- ``sequence_scores`` (seq, layer, head[, recent]) and ``head_scores`` (layer, head[, recent]):
  the field's head scores (docs/method.md#the-fields-head-scores) of each sequence and across
  them, for a run that holds ``prev_attn`` and ``recent_attn`` (one migrated from a format
  before them is analyzed without, and analyze says so).

The analysis is committed last (:mod:`attngeom.store.derived_groups.derived`): its record says which
sequences and which parameters (:func:`~attngeom.analyze.parameters.analysis_parameters`) it covers. A rerun with the same
parameters computes only the sequences not yet covered, appending them along ``seq``, then
recomputes the groups across sequences; with other parameters everything is recomputed into
staging while the earlier analysis stays readable. Killed at any moment, the same command
resumes and ends bit for bit where an uninterrupted one does. A rerun also rewrites what of
the committed analysis is lost or damaged (:func:`attngeom.store.derived_groups.plan.healing`). One
:class:`~attngeom.store.derived_groups.derived.DerivedWrite` owns the record from the plan to the commit.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import time
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import dask
import dask.threaded
import numpy as np
import xarray as xr
from tqdm.auto import tqdm

from attngeom.analyze.blocks import all_groups, computed_groups, has_scores, sequence_groups, template_groups
from attngeom.analyze.kernels import MAX_KEYS, compile_kernels
from attngeom.analyze.parameters import AnalyzeRequest, AnalyzeResult, analysis_parameters, default_n_grid
from attngeom.analyze.reductions import LOADED_TOPN_BYTES, cross_sequence_groups
from attngeom.analyze.scheduling import dask_client
from attngeom.analyze.tables import TABLE_COLUMNS, tidy_table
from attngeom.errors import AttngeomWarning, InputError, RunNotFoundError
from attngeom.store import (
    ANALYSIS,
    analysis_path,
    check_committed,
    completed,
    lacking_message,
    lacking_summaries,
    open_dataset,
    run_path,
)
from attngeom.store.derived_groups.derived import DerivedWrite, forget_unreadable
from attngeom.store.session import StoreSession

__all__ = ["analyze", "open_completed"]

# (sequence, layer) tasks per batch: the analysis records its progress after each batch, so
# a killed analyze loses at most one; enough tasks to keep every worker busy meanwhile.
BATCH_TASKS = 128


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
    ds = open_dataset(session.zstore, session.url, run_path(run_id))
    return ds.isel(seq=done).assign_coords(seq=("seq", done.astype("int64")))


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


def _sequences_per_batch(n_layers: int) -> int:
    return max(1, BATCH_TASKS // max(n_layers, 1))


def _batches(start: int, stop: int, n_layers: int) -> Iterator[tuple[int, int]]:
    size = _sequences_per_batch(n_layers)
    # A batch ends where a chunk of the per-sequence groups does (a chunk holds `size`
    # sequences), or at the end: after kept sequences, the first batch fills their last
    # chunk (and goes on to the end when the rest fits in a batch: one batch, with its fixed
    # costs, fewer) and every later one writes whole chunks, each once, never read back to
    # be merged.
    bounds = [start]
    while bounds[-1] < stop:
        bounds.append(stop if stop - bounds[-1] <= size else (bounds[-1] + size) // size * size)
    yield from itertools.pairwise(bounds)


def _per_sequence_groups(write: DerivedWrite, n_seq: int, names: Sequence[str],
                         held: Mapping[str, Sequence[xr.Dataset]] | None) -> dict[str, xr.Dataset]:
    """The per-sequence groups ``names`` over their first ``n_seq`` sequences: lazy, read from
    the store; or with ``held`` (group -> the Datasets of the last sequences, computed by this
    analyze, in ``seq`` order), those in memory after the sequences before them, read here."""
    if held is None:
        return {name: write.read(name).isel(seq=slice(0, n_seq)) for name in names}
    first = n_seq - sum(part.sizes["seq"] for part in held[names[0]])
    # Read here, as the reductions read, every array at once: handed to the workers, the
    # chunks would be pickled to them and their arrays back.
    kept = write.written(first) if first else {}
    return {name: _joined(held[name], kept.get(name, {})) for name in names}


def _joined(parts: Sequence[xr.Dataset], before: Mapping[str, np.ndarray]) -> xr.Dataset:
    """The Datasets ``parts`` one after the other along ``seq``, after the values ``before``
    (variable -> values of the sequences before them, as stored: no variable along ``seq``
    is a label; none when empty). The other coordinates and the attributes are the same in
    every part: the first part's are taken."""
    if not before and len(parts) == 1:
        return parts[0]

    def joined(key: Hashable, var: xr.Variable) -> xr.Variable:
        if "seq" not in var.dims:
            return var
        values = [part.variables[key].values for part in parts]
        return xr.Variable(var.dims, np.concatenate([*([before[key]] if before else []), *values],
                                                    axis=var.get_axis_num("seq")), var.attrs)

    template = parts[0]
    return xr.Dataset({key: joined(key, template.variables[key]) for key in template.data_vars},
                      coords={key: joined(key, template.variables[key]) for key in template.coords},
                      attrs=template.attrs)


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
        return computed_groups(write.url, run, ds.isel(seq=slice(*batch)), grid, seed)

    # Batches in flight beside the one being written: the workers compute the next batch
    # while this process writes one, and are handed the batch after it before the tail of
    # the one they run ends. Their results are a few kilobytes per task. Dask's threads give
    # each computing thread a pool of its own, so there one batch at a time keeps one task
    # per core (and memory to one task per core).
    in_flight = 1 if dask.config.get("scheduler", None) in ("threads", dask.threaded.get) else 2
    # The reductions across sequences load the groups whole when small: those computed are
    # then kept here instead of being read back from the store (they are views of the
    # blocks' results, which hold the per-head columns at every n too: a third more).
    held: dict[str, list[xr.Dataset]] | None = {name: [] for name in sequence_groups(ds)} if batches else None
    computing = ThreadPoolExecutor(in_flight)
    try:
        with tqdm(total=len(target) - len(keep), unit="seq", desc=f"{run_id}: analyze", disable=not progress) as bar:
            futures = [computing.submit(compute, batch) for batch in batches[:in_flight]]
            # The workers start on the first batches while the groups are created (kept groups
            # are grown instead: no templates). A chunk holds a batch's sequences: an
            # uninterrupted analyze writes each chunk once.
            templates = template_groups(ds, grid, seed) if not keep else {}
            write.create(templates, _sequences_per_batch(ds.sizes["layer"]))
            for i, (a, b) in enumerate(batches):
                computed = futures[i].result()
                if i + in_flight < len(batches):
                    futures.append(computing.submit(compute, batches[i + in_flight]))
                write.append(computed)
                if held is not None and sum(d.nbytes for d in computed.values()) * len(target) <= (
                        LOADED_TOPN_BYTES * (b - a)):
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


def _announce(run_id: str, plan: Any, healed: str | None) -> None:
    """Say, before doing it, what an analyze that is not a plain extension will do."""
    if plan.recomputed is not None:
        tqdm.write(f"{run_id}: {plan.recomputed}: recomputing all {len(plan.target)} sequences", file=sys.stderr)
    if healed is not None:
        again = len(plan.target) - len(plan.keep)
        tqdm.write(f"{run_id}: rewriting what is damaged ({healed}): {again} sequences and the summaries",
                   file=sys.stderr)


def analyze_run(session: StoreSession, run_id: str, ds: xr.Dataset, grid: Sequence[int],
                request: AnalyzeRequest) -> AnalyzeResult:
    """Bring the analysis of one run up to date with its committed sequences ``ds`` (as
    :func:`_checked_input` returned them, with the N grid ``grid``), in the Dask scheduler
    of the caller's context, rewriting what of it is damaged: measure -> write per batch ->
    reduce -> commit, one :class:`DerivedWrite` owning the record throughout. The committed
    groups are checked for lost or resized objects, and with ``request.deep`` also for
    objects failing to decode."""
    start = time.perf_counter()
    seed, out, progress = request.seed, request.out, request.progress
    params = analysis_parameters(grid, seed)
    # Small arrays every task needs, read once, here: through the workers they cost a round trip.
    ds = ds.assign(attendable=ds["attendable"].load(scheduler=dask.get), head_kv=ds["head_kv"].load(scheduler=dask.get))
    target = tuple(int(s) for s in ds["seq"].values)
    provenance = ds.attrs.get("attngeom", {})

    names = sequence_groups(ds)
    with session.derived(run_id, ANALYSIS, deep=request.deep) as write:
        plan = write.begin(params, target, all_groups(ds), names)
        healed = "; ".join(f"{write.state.groups_path}/{write.damage[name]}" for name in plan.heal) or None
        if progress:
            _announce(run_id, plan, healed)
        if plan.up_to_date:
            # In the tidy table's column order, not the order the store lists the arrays in.
            table = (write.read("table").to_dataframe().reset_index(drop=True)[list(TABLE_COLUMNS)]
                     if out is not None else None)
            new = 0
        else:
            new, held = _compute_sequences(write, session.run(run_id), ds, grid, seed, progress)
            cross = cross_sequence_groups(_per_sequence_groups(write, len(target), names, held), provenance, run_id)
            table = tidy_table(cross["summary"], provenance, run_id) if out is not None else None
            write.finish(cross)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table.to_parquet(out / f"{run_id}.topn.parquet", index=False)
        table.to_csv(out / f"{run_id}.topn.csv", index=False)
    instances = len(target) * ds.sizes["layer"] * ds.sizes["head"]
    return AnalyzeResult(run_id, len(target), new, instances, time.perf_counter() - start, plan.recomputed, healed)


@contextlib.contextmanager
def _collector_frozen() -> Iterator[None]:
    """Python's cyclic garbage collector leaves the objects alive now alone until the block
    ends (``gc.freeze``): a full collection otherwise walks every object of the libraries
    loaded (xarray, dask, zarr, numba's kernels), about 0.1 s each time an analyze triggers
    one, and in forked workers copies every page it touches. Left as it is when the caller
    froze objects of its own."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def analyze(request: AnalyzeRequest, session: StoreSession) -> list[AnalyzeResult]:
    """Analyze every run of ``request.store`` (or ``request.run_id``), opened for writing as
    ``session``; results go to ``runs/<id>/analysis``.

    Incremental: a run's sequences already analyzed with the same parameters are kept, and
    damaged committed groups written again (see :func:`analyze_run`; ``deep`` also reads
    every committed object). Two analyzes of one run run one after the other (a lock on a
    local disk, a lease on an object store: ``StoreSession.lock``)."""
    runs = session.runs()
    if request.run_id is not None:
        session.run(request.run_id)
    todo = [request.run_id] if request.run_id else runs
    # An analysis whose record does not parse is none (xarray could not even open the run).
    dropped = {rid: why for rid in todo if (why := forget_unreadable(session, rid, ANALYSIS)) is not None}
    # Every run's input checked before any analysis is touched.
    checked = {rid: _checked_input(session, rid, request.n_grid) for rid in todo}
    for rid, (ds, _) in checked.items():
        if not has_scores(ds):  # the rest of its analysis goes on
            warnings.warn(lacking_message(rid, lacking_summaries(ds.attrs.get("attngeom", {}))), AttngeomWarning,
                          stacklevel=3)
    compile_kernels(progress=request.progress)
    with _collector_frozen(), dask_client(request.scheduler, request.store):
        results = [analyze_run(session, rid, *checked[rid], request) for rid in todo]
    return [replace(r, recomputed=f"its record {analysis_path(r.run_id)}/zarr.json {dropped[r.run_id]}")
            if r.run_id in dropped else r for r in results]
