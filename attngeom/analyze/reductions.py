"""The groups across sequences: ``heads``, ``summary``, ``signatures``, ``summary_by_query``
and ``head_scores``, reduced from the per-sequence groups in the analyzing process."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence

import dask
import dask.threaded
import numpy as np
import xarray as xr

from attngeom.analyze import taxonomy
from attngeom.analyze.kernels import SINK_THRESHOLD, FieldScores, head_scores
from attngeom.analyze.tables import table_dataset
from attngeom.store import (
    SIGNATURE_VARIABLES,
    STATS,
    TOPN_COUNTS,
    TOPN_FLAGS,
    TOPN_VARIABLES,
    VALUE_STATISTICS,
    VOTES,
)

__all__ = ["LOADED_TOPN_BYTES", "cross_sequence_groups", "head_scores_dataset", "heads_dataset", "summary_by_query",
           "summary_dataset"]

# The paper's appendix reports the coherence constants at N = 64.
COHERENCE_N = 64


# Largest ``topn`` the cross-sequence reductions load at once (a 7B model with 1,024 heads has
# about 4 MB a sequence at 12 N): larger ones are reduced one variable at a time.
LOADED_TOPN_BYTES = 1 << 28


def cross_sequence_groups(stored: Mapping[str, xr.Dataset], provenance: dict, run_id: str) -> dict[str, xr.Dataset]:
    """heads, summary, signatures and table (and summary_by_query when the per-sequence
    groups ``stored`` (name -> Dataset, lazy or loaded) hold topn_by_query, head_scores when
    they hold sequence_scores), reduced in this
    process: ``topn`` loaded whole up to LOADED_TOPN_BYTES (a read per variable, each its
    own dask compute, costs more than the whole load), one variable at a time beyond;
    ``provenance`` and ``run_id`` label the table."""
    topn = stored["topn"]
    # NaN marks "not defined here" (no sink, N too large): all-NaN reductions are expected.
    # The reads are small; a cluster would only add transfers.
    with warnings.catch_warnings(), dask.config.set(scheduler=dask.threaded.get):
        warnings.simplefilter("ignore", RuntimeWarning)
        if topn.nbytes <= LOADED_TOPN_BYTES:
            topn = topn.load()
        heads = heads_dataset(stored["values"].load(), topn[["mu", "mu_q95"]].load(), stored["taxonomy"].load())
        summary = summary_dataset(topn)
        per_head = topn[list(SIGNATURE_VARIABLES)].load().mean("seq")
        signatures = taxonomy.signatures_dataset(per_head, heads["regime"])
        if "topn_by_query" in stored:
            per_query = stored["topn_by_query"]
            if per_query.nbytes <= LOADED_TOPN_BYTES:
                per_query = per_query.load()
            summary_query = summary_by_query(per_query)
    groups = {"heads": heads, "summary": summary, "signatures": signatures,
              "table": table_dataset(summary, provenance, run_id)}
    if "topn_by_query" in stored:
        groups["summary_by_query"] = summary_query
    if "sequence_scores" in stored:
        groups["head_scores"] = head_scores_dataset(stored["sequence_scores"].load(scheduler=dask.threaded.get))
    return groups


def head_scores_dataset(sequence_scores: xr.Dataset) -> xr.Dataset:
    """(layer, head[, recent]): the field's head scores across sequences
    (docs/method.md#the-fields-head-scores), from each sequence's (``sequence_scores``):
    sink_score, sink_head, prev_token_score and distant_mass, and learned_sink_score for a
    model with learned sinks."""
    per_sequence = FieldScores(*(sequence_scores[name].transpose("seq", "layer", "head", ...).values
                                 for name in FieldScores._fields))
    scores, sink_head = head_scores(per_sequence)
    dims = ("layer", "head")
    # A model with learned sinks: the learned sink's mean weight beside key 0's.
    learned = ({"learned_sink_score": (dims, sequence_scores["learned_sink_score"].mean("seq").values)}
               if "learned_sink_score" in sequence_scores else {})
    return xr.Dataset(
        {"sink_score": (dims, scores.sink_score), "sink_head": (dims, sink_head),
         "prev_token_score": (dims, scores.prev_token_score),
         "distant_mass": ((*dims, "recent"), scores.distant_mass), **learned},
        coords={d: sequence_scores[d].values for d in ("layer", "head", "recent")},
        attrs={"sink_threshold": SINK_THRESHOLD},
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
        if name in TOPN_COUNTS or name in TOPN_FLAGS:
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
        # One sort serves the median and the quantiles: the sorts are most of the reductions,
        # which run after the workers are done.
        ordered, count = np.sort(x, axis=0), np.sum(~np.isnan(x), axis=0)
        q05, q95 = _sorted_quantiles(ordered, count, [0.05, 0.95])
        mean = np.sum(np.nan_to_num(x), axis=0) / np.where(count > 0, count, np.nan)
        stats = np.stack([mean, _sorted_median(ordered, count), q05, q95, count.astype(np.float64)])
        out[name] = (("stat", "layer", "head", "n"), stats)
    coords = {d: topn[d].values for d in ("layer", "head", "n")}
    coords["stat"] = np.array(STATS, dtype=object)
    return xr.Dataset(out, coords=coords)


def summary_by_query(topn_by_query: xr.Dataset) -> xr.Dataset:
    """(stat, layer, head, query_pos, n): :func:`summary_dataset` (the statistics across
    sequences of ``summary``) of the topn variables at each query."""
    topn = topn_by_query[list(TOPN_VARIABLES)]
    per_query = [summary_dataset(topn.isel(query_pos=i)) for i in range(topn.sizes["query_pos"])]
    out = xr.concat(per_query, dim="query_pos").assign_coords(query_pos=topn["query_pos"].values)
    return out.transpose("stat", "layer", "head", "query_pos", "n")
