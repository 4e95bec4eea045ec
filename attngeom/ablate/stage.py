"""The ablate stage (docs/method.md#ablation): single-head ablation and per-layer head sparsification.

Loads the run's model with its own attention implementation (the capture is extract's),
reads the run's tokens, attention summaries and (if present) the analysis head table, and
writes ``runs/<id>/ablation/``:

- ``single``       (layer, head[, seq]): single-head delta NLL on the importance split
  (per sequence, mean, median), robust z, critical and protected flags, the attention
  diagnostics, W_O / W_V slice norms, and analyze's head statistics and regime if present;
- ``correlations`` (diagnostic): Spearman and Pearson (r, two-sided p, n) of every numeric
  diagnostic with the mean single-head delta NLL, over all heads;
- ``sweep``        (method, retention[, draw, seq, layer, head]): delta NLL of each
  sparsification method on the evaluation split, and every mask evaluated;
- ``table``        (row): the sweep as a tidy table;
- ``critical``     (critical): the critical heads and the rule that found them;
- ``regimes``      (regime): mean and median single-head impact, when the analysis has regimes.

Protocol, recorded in every group's attributes:

- NLL of token ``L-1`` given tokens ``0..L-2`` (prefill ``L-1`` tokens, score the next), with
  the masked heads removed at every position; delta = masked NLL - intact NLL, in nats.
- Splits: the run's completed sequences (the first ``max_sequences`` of them) in index
  order, alternating: ranks 0, 2, 4, ... form the importance split, ranks 1, 3, 5, ... the
  evaluation split. Disjoint, spread evenly over the corpus, and stable when extract appends.
- Single-head impacts, critical heads, regime priorities and every diagnostic used to rank
  heads come from the importance split alone; the sweep is measured on the evaluation split.
- Diagnostics are per head means over the importance split at the final query ``L-1`` (the
  query the store keeps whole rows of): ``a_{L-1}`` current token, ``a_0`` sink, top-N mass,
  entropy, top-1; ``*_allq`` are the stored per-query summaries averaged over queries 1..L-1.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import xarray as xr

from attngeom.version import __version__
from attngeom.ablate.kernels import (
    CRITICAL_RULE,
    attention_diagnostics,
    correlation_table,
    critical_heads,
    critical_threshold,
    keep_mask,
    kept_per_layer,
    random_keys,
    regime_means,
    robust_z,
    type_guided_keys,
)
from attngeom.ablate.masking import head_geometry, head_weight_norms, masked_nll
from attngeom.ablate.request import AblateRequest, check_request
from attngeom.errors import AttngeomWarning, InProgressError, InputError
from attngeom.extract.placement import parse_device_map
from attngeom.extract.runcheck import check_run_model
from attngeom.extract.runmodel import evaluating, run_model
from attngeom.store import ABLATION, ANALYSIS, ATTR_KEY, REGIMES
from attngeom.store.session import RunReader, StoreSession

# How each method (schema.METHODS, in that order) orders the heads of a layer, first kept first.
RANKINGS = {
    "type_guided": "regimes by mean single-head impact (unprotected heads), then heads by own impact; largest first",
    "single_impact": "own single-head impact on the importance split; largest first",
    "weight_o": "Frobenius norm of the head's W_O slice; largest first",
    "weight_v": "Frobenius norm of the W_V slice of the kv head it reads (ties by W_O norm); largest first",
    "entropy_low": "final-query attention entropy; lowest first",
    "entropy_high": "final-query attention entropy; highest first",
    "sink_attention": "final-query sink attention a_0; lowest first (a head parked on the sink is taken as idle)",
    "current_attention": "final-query attention on the current token a_{L-1}; highest first",
    "random": "uniformly random order per layer, one seeded draw per mask, nested across retentions",
}
PROTOCOL = (
    "decode NLL of token L-1 given tokens 0..L-2 (prefill L-1 tokens, score the next); a head is "
    "ablated by zeroing its query-head slice of the o_proj input at every position; "
    "delta_nll = masked - intact NLL (nats)"
)
SPLIT_RULE = "completed sequences in index order, alternating: even ranks -> importance, odd ranks -> evaluation"
ALL_QUERY_DIAGNOSTICS = {
    "mean_sink_attention_allq": "sink_attn",
    "mean_diag_attention_allq": "diag_attn",
    "mean_attention_entropy_allq": "entropy",
    "mean_top1_attention_allq": "top1_attn",
}


@dataclass(frozen=True)
class AblateResult:
    """What :func:`ablate` wrote, as in memory Datasets, plus the sweep as a table."""

    run_id: str
    single: xr.Dataset
    sweep: xr.Dataset
    correlations: xr.Dataset
    critical: xr.Dataset
    regimes: xr.Dataset | None
    table: pd.DataFrame
    skipped: dict[str, str]
    seconds: float


def split_sequences(seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted completed sequence indices (S,) -> (importance, evaluation), see SPLIT_RULE."""
    return seqs[0::2], seqs[1::2]


def _store_diagnostics(run: RunReader, seqs: np.ndarray, top_n: int) -> dict[str, np.ndarray]:
    """Per-head means (layers, heads) over ``seqs`` of the attention diagnostics, read one
    sequence shard at a time."""
    sums: dict[str, np.ndarray] = {}
    for s in seqs:
        s = int(s)
        entropy = run.array("entropy")[s]
        per_seq = attention_diagnostics(run.array("attn_last")[s], entropy[..., -1], run.array("top1_attn")[s][..., -1],
                                        top_n)
        for name, array in ALL_QUERY_DIAGNOSTICS.items():
            # Query 0 is excluded: there the sink is also the diagonal (docs/method.md#preprocessing).
            per_seq[name] = (entropy if array == "entropy" else run.array(array)[s])[..., 1:].mean(axis=-1)
        for name, value in per_seq.items():
            sums[name] = sums.get(name, 0.0) + value.astype(np.float64)
    return {name: total / len(seqs) for name, total in sums.items()}


def _analysis_heads(run: RunReader) -> xr.Dataset | None:
    """analyze's (layer, head) table, or None when the run has not been analyzed. While an
    analyze of the run is at work, waits for it (saying whom it waits for) and reads what it
    commits: an ablation is worth the wait for its type-guided sweep."""
    while True:
        try:
            heads = run.derived(ANALYSIS, "heads", missing_ok=True)
        except InProgressError:
            run.wait_for_writer()
            continue
        return None if heads is None else heads.transpose("layer", "head", ...).load()


def _span(layers: tuple[int, ...]) -> str:
    """Layer indices as a user reads them: "0-31", or the list where they are not 0..n-1."""
    return f"0-{len(layers) - 1}" if layers == tuple(range(len(layers))) else ", ".join(map(str, layers))


def _single_masks(n_layers: int, n_heads: int) -> torch.Tensor:
    """(layers*heads, layers, heads): mask ``l*H + h`` ablates head (l, h) alone."""
    masks = torch.ones(n_layers * n_heads, n_layers * n_heads)
    masks.fill_diagonal_(0)
    return masks.view(-1, n_layers, n_heads)


def _evaluate_masks(
    model: torch.nn.Module, tokens: torch.Tensor, keep: np.ndarray, batch_size: int, progress: bool
) -> tuple[np.ndarray, np.ndarray]:
    """keep (..., layers, heads) bool -> (intact NLL (S,), delta NLL (..., S)). Each distinct
    mask is evaluated once; the all-kept mask is the intact model, whose delta is 0 exactly."""
    n_layers, n_heads = keep.shape[-2:]
    flat = keep.reshape(-1, n_layers, n_heads)
    unique, inverse = np.unique(flat, axis=0, return_inverse=True)
    ablating = ~unique.all(axis=(1, 2))
    intact = masked_nll(model, tokens, torch.ones(1, n_layers, n_heads), batch_size=batch_size)[:, 0].double().numpy()
    delta_unique = np.zeros((len(unique), tokens.shape[0]))
    if ablating.any():
        masks = torch.from_numpy(unique[ablating].astype(np.float32))
        nll = masked_nll(model, tokens, masks, batch_size=batch_size, progress=progress, desc="sweep").double().numpy()
        delta_unique[ablating] = (nll - intact[:, None]).T
    return intact, delta_unique[inverse.ravel()].reshape(*keep.shape[:-2], tokens.shape[0])


def _sweep_keys(
    single_impact: np.ndarray,
    weight_o: np.ndarray,
    weight_v: np.ndarray,
    diagnostics: dict[str, np.ndarray],
    regime: np.ndarray | None,
    protected: np.ndarray,
) -> dict[str, list[np.ndarray]]:
    """The deterministic methods' ranking keys (see RANKINGS), larger kept first."""
    entropy = diagnostics["mean_attention_entropy"]
    keys = {
        "single_impact": [single_impact],
        **({} if np.isnan(weight_o).all() else {"weight_o": [weight_o], "weight_v": [weight_v, weight_o]}),
        "entropy_low": [-entropy],
        "entropy_high": [entropy],
        "sink_attention": [-diagnostics["mean_sink_attention"]],
        "current_attention": [diagnostics["mean_last_attention"]],
    }
    if regime is not None:
        keys = {"type_guided": type_guided_keys(regime, single_impact, protected), **keys}
    return keys


def _sweep(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    keys: dict[str, list[np.ndarray]],
    protected: np.ndarray,
    retention: Sequence[float],
    random_masks: int,
    seed: int,
    batch_size: int,
    progress: bool,
    coords: dict[str, np.ndarray],
) -> xr.Dataset:
    """(method, retention) Dataset of the sparsification sweep on ``tokens`` (S, L)."""
    n_layers, n_heads = protected.shape
    methods = list(keys) + (["random"] if random_masks else [])
    n_draws = max(1, random_masks)
    shuffled = random_keys(random_masks, n_layers, n_heads, seed)
    keep = np.zeros((len(methods), len(retention), n_draws, n_layers, n_heads), dtype=bool)
    valid = np.zeros((len(methods), n_draws), dtype=bool)
    for m, method in enumerate(methods):
        valid[m, : random_masks if method == "random" else 1] = True
        for r, fraction in enumerate(retention):
            k = kept_per_layer(fraction, n_heads)
            if method == "random":
                for d in range(random_masks):
                    keep[m, r, d] = keep_mask([shuffled[d]], k, protected)
            else:
                # Every draw slot holds the one mask: evaluated once, the extra slots masked out.
                keep[m, r, :] = keep_mask(keys[method], k, protected)
    intact, delta = _evaluate_masks(model, tokens, keep, batch_size, progress)
    delta = np.where(valid[:, None, :, None], delta, np.nan)
    per_draw = delta.mean(axis=-1)  # (method, retention, draw)
    per_seq = np.nanmean(delta, axis=2)  # (method, retention, seq)
    counts = valid.sum(axis=1)
    with warnings.catch_warnings():
        # One-mask methods have no spread across draws, one evaluation sequence none across
        # sequences: NaN, not a warning.
        warnings.simplefilter("ignore", RuntimeWarning)
        std = np.where(counts[:, None] > 1, np.nanstd(per_draw, axis=2, ddof=1), np.nan)
        sem = per_seq.std(axis=-1, ddof=1) / np.sqrt(per_seq.shape[-1])
    dims = ("method", "retention")
    keep_stored = np.where(valid[:, None, :, None, None], keep, -1).astype(np.int8)
    return xr.Dataset(
        {
            "delta_nll_mean": (dims, np.nanmean(per_draw, axis=2)),
            "delta_nll_std": (dims, std),
            "delta_nll_sem": (dims, sem),
            "kept_fraction": (dims, keep[:, :, 0].mean(axis=(-2, -1))),
            "draw_delta_nll_mean": ((*dims, "draw"), per_draw),
            "delta_nll": ((*dims, "draw", "seq"), delta),
            "keep": ((*dims, "draw", "layer", "head"), keep_stored),
            "n_masks": ("method", counts.astype(np.int64)),
            "intact_nll": ("seq", intact),
        },
        coords={
            "method": np.array(methods, dtype=object),
            "retention": np.asarray(retention, dtype=np.float64),
            "draw": np.arange(n_draws),
            **coords,
        },
    )


def _sweep_table(sweep: xr.Dataset, run_id: str, model_id: str) -> pd.DataFrame:
    """Tidy (method, retention) table of the sweep's summary variables."""
    names = ["kept_fraction", "delta_nll_mean", "delta_nll_std", "delta_nll_sem"]
    frame = sweep[names].to_dataframe().reset_index()
    frame["n_masks"] = frame["method"].map(dict(zip(sweep["method"].values, sweep["n_masks"].values.tolist())))
    frame.insert(0, "run", run_id)
    frame.insert(1, "model", model_id)
    frame = frame[["run", "model", "method", "retention", *names, "n_masks"]]
    text = ["run", "model", "method"]
    frame[text] = frame[text].astype(object)
    return frame


def _regimes_dataset(regime: np.ndarray, impact: np.ndarray, protected: np.ndarray) -> xr.Dataset:
    """(regime): mean, median and count of single-head impact over all heads and over the
    unprotected ones, and the type-guided priority (0 = kept first)."""
    labels = [r for r in REGIMES if (regime == r).any()] + sorted(set(regime.ravel()) - set(REGIMES))
    means = regime_means(regime, impact, protected)
    order = sorted(labels, key=lambda r: (-np.nan_to_num(means[r], nan=-np.inf), labels.index(r)))

    every = {r: regime == r for r in labels}
    free = {r: (regime == r) & ~protected for r in labels}

    def stat(fn, members: dict[str, np.ndarray]) -> list[float]:
        return [float(fn(impact[members[r]])) if members[r].any() else np.nan for r in labels]

    return xr.Dataset(
        {
            "mean": ("regime", stat(np.mean, every)),
            "median": ("regime", stat(np.median, every)),
            "count": ("regime", [int(every[r].sum()) for r in labels]),
            "mean_unprotected": ("regime", stat(np.mean, free)),
            "median_unprotected": ("regime", stat(np.median, free)),
            "count_unprotected": ("regime", [int(free[r].sum()) for r in labels]),
            "priority": ("regime", [order.index(r) for r in labels]),
        },
        coords={"regime": np.array(labels, dtype=object)},
    )


@dataclass(frozen=True)
class _RunInputs:
    """What the run provides: its splits, tokens, stored diagnostics and analysis heads."""

    provenance: dict[str, Any]
    importance: np.ndarray
    evaluation: np.ndarray
    importance_tokens: torch.Tensor
    evaluation_tokens: torch.Tensor
    protected: np.ndarray
    diagnostics: dict[str, np.ndarray]
    regime: np.ndarray | None
    geometric: dict[str, np.ndarray]
    skipped: dict[str, str]
    layer_head: dict[str, np.ndarray]


@dataclass(frozen=True)
class _Measured:
    """What the model's forwards measured (single-head deltas (layers, heads, S_imp) and the
    sweep), and the heads they made critical and protected."""

    device: str
    compute_dtype: torch.dtype
    weight_o: np.ndarray
    weight_v: np.ndarray
    intact: np.ndarray
    delta: np.ndarray
    critical: np.ndarray
    threshold: float
    protected: np.ndarray
    sweep: xr.Dataset


def ablate(request: AblateRequest) -> AblateResult:
    """Single-head ablation and head sparsification of ``request.run_id``; writes
    ``runs/<id>/ablation`` (see :class:`AblateRequest` for the options).

    Reads the run (splits, tokens, diagnostics), measures with the model (single-head
    impacts on the importance split, the sweep on the evaluation split), assembles the
    Datasets and writes them, replacing any earlier ablation.
    """
    start = time.perf_counter()
    with StoreSession(request.store, mode="a") as session:
        inputs = _read_run(request, session)
        measured = _measure(request, inputs)
        groups, table = _assemble(request, inputs, measured)
        # Replaced as a whole, committed last: no group of an older ablation survives, and an
        # interrupted write leaves the older one readable. The commit records the protocol
        # and parameters every group carries in its attributes.
        with session.derived(request.run_id, ABLATION) as write:
            write.replace(groups, groups["single"].attrs[ATTR_KEY])
        if request.out is not None:  # inside the session, which tells a full disk in one line
            _write_tables(request.out, request.run_id, groups, table)
    return AblateResult(
        request.run_id, groups["single"], groups["sweep"], groups["correlations"], groups["critical"],
        groups.get("regimes"), table, inputs.skipped, time.perf_counter() - start,
    )


def _read_run(request: AblateRequest, session: StoreSession) -> _RunInputs:
    """Check the request against the run of the ``session``'s store and read what the run
    provides (no model)."""
    run_id = request.run_id
    run = session.reader(run_id, check="committed")
    provenance = run.provenance
    check_run_model(request.model, provenance, run_id, "ablate")
    committed = run.completed()
    n_layers, n_heads = run.array("layer").shape[0], run.array("head").shape[0]
    check_request(request, {"n_layers": n_layers, "n_heads": n_heads}, len(committed))
    seqs = committed[: request.max_sequences]
    importance, evaluation = split_sequences(seqs)
    protected = np.zeros((n_layers, n_heads), dtype=bool)
    for layer, head in request.protect:
        protected[layer, head] = True

    with run.reading():
        diagnostics = _store_diagnostics(run, importance, request.top_n)
        tokens = run.array("tokens").get_orthogonal_selection((seqs, slice(None))).astype(np.int64)
    heads = _analysis_heads(run)
    skipped: dict[str, str] = {}
    regime = None
    if heads is not None and "regime" in heads:
        regime = np.array(heads["regime"].values.tolist(), dtype=object)
    else:
        skipped["type_guided"] = (
            "no head regimes: runs/<id>/analysis/heads has no 'regime' variable"
            if heads is not None else "no head regimes: the run has not been analyzed (run attngeom analyze)"
        )
        warnings.warn(f"type-guided sparsification skipped: {skipped['type_guided']}", AttngeomWarning, stacklevel=4)
    geometric = {
        name: heads[name].values.astype(np.float64)
        for name in sorted(heads.data_vars if heads is not None else ())
        if heads[name].dims == ("layer", "head") and np.issubdtype(heads[name].dtype, np.number)
    }
    by_seq = dict(zip(seqs.tolist(), torch.from_numpy(tokens)))
    return _RunInputs(
        provenance=provenance,
        importance=importance,
        evaluation=evaluation,
        importance_tokens=torch.stack([by_seq[int(s)] for s in importance]),
        evaluation_tokens=torch.stack([by_seq[int(s)] for s in evaluation]),
        protected=protected,
        diagnostics=diagnostics,
        regime=regime,
        geometric=geometric,
        skipped=skipped,
        layer_head={"layer": run.array("layer")[:], "head": run.array("head")[:]},
    )


def _measure(request: AblateRequest, inputs: _RunInputs) -> _Measured:
    """Single-head impacts on the importance split, the critical heads they single out, and
    the sparsification sweep on the evaluation split."""
    model, device, compute_dtype = run_model(
        request.model, inputs.provenance, request.run_id, request.device, request.dtype,
        parse_device_map(request.device_map),
    )
    n_layers, n_heads = inputs.protected.shape
    geometry = head_geometry(model)
    run_layers = tuple(int(i) for i in inputs.layer_head["layer"])
    if (geometry.layers, geometry.n_heads) != (run_layers, n_heads):
        raise InputError(
            f"model has attention layers {_span(geometry.layers)} x {geometry.n_heads} heads, run "
            f"'{request.run_id}' layers {_span(run_layers)} x {n_heads}"
        )
    norms = head_weight_norms(model)
    if norms is None:
        # A family with fused or latent projections has no per-head W_O and W_V slices.
        weight_o = weight_v = np.full((n_layers, n_heads), np.nan)
    else:
        weight_o, weight_v = (w.numpy().astype(np.float64) for w in norms)
    tokens, batch_size = inputs.importance_tokens, request.batch_size
    with evaluating(model):
        intact = masked_nll(model, tokens, torch.ones(1, n_layers, n_heads), batch_size=batch_size)[:, 0].double().numpy()
        nll = masked_nll(
            model, tokens, _single_masks(n_layers, n_heads), batch_size=batch_size, progress=request.progress,
            desc="single heads",
        ).double().numpy()
        delta = (nll - intact[:, None]).T.reshape(n_layers, n_heads, len(inputs.importance))
        impact = delta.mean(axis=-1)
        threshold = critical_threshold(impact, request.critical_k, request.critical_floor)
        critical = critical_heads(impact, request.critical_k, request.critical_floor)
        protected = inputs.protected | critical if request.protect_critical else inputs.protected
        keys = _sweep_keys(impact, weight_o, weight_v, inputs.diagnostics, inputs.regime, protected)
        sweep = _sweep(
            model, inputs.evaluation_tokens, keys, protected, request.retention, request.random_masks, request.seed,
            batch_size, request.progress, {"seq": inputs.evaluation.astype(np.int64), **inputs.layer_head},
        )
    return _Measured(device, compute_dtype, weight_o, weight_v, intact, delta, critical, threshold, protected, sweep)


def _attrs(request: AblateRequest, inputs: _RunInputs, measured: _Measured) -> dict[str, Any]:
    """The protocol and parameters every ablation group records."""
    n_heads = inputs.protected.shape[1]
    return {
        "attngeom": {
            "protocol": PROTOCOL,
            "model": inputs.provenance["model"]["id"],
            "device": measured.device,
            "compute_dtype": str(measured.compute_dtype).removeprefix("torch."),
            "split_rule": SPLIT_RULE,
            "max_sequences": request.max_sequences,
            "importance_sequences": inputs.importance.tolist(),
            "evaluation_sequences": inputs.evaluation.tolist(),
            "retention": list(map(float, request.retention)),
            "kept_per_layer": [kept_per_layer(f, n_heads) for f in request.retention],
            "random_masks": request.random_masks,
            "seed": request.seed,
            "random_seeding": "draw d: numpy default_rng([seed, d]) priorities per (layer, head)",
            "top_n": request.top_n,
            "protect": [list(map(int, h)) for h in request.protect],
            "protect_critical": request.protect_critical,
            "protected": np.argwhere(measured.protected).tolist(),
            "critical_rule": {
                "rule": CRITICAL_RULE, "k": request.critical_k, "floor": request.critical_floor,
                "threshold": measured.threshold,
            },
            "methods": {m: RANKINGS[m] for m in measured.sweep["method"].values},
            "skipped_methods": inputs.skipped,
            "attngeom_version": __version__,
        }
    }


def _assemble(
    request: AblateRequest, inputs: _RunInputs, measured: _Measured
) -> tuple[dict[str, xr.Dataset], pd.DataFrame]:
    """The ablation groups, by name, each carrying the protocol attributes; and the sweep as
    a tidy table."""
    attrs = _attrs(request, inputs, measured)
    impact = measured.delta.mean(axis=-1)
    critical, protected = measured.critical, measured.protected
    single_vars: dict[str, Any] = {
        "delta_nll": (("layer", "head", "seq"), measured.delta),
        "delta_nll_mean": (("layer", "head"), impact),
        "delta_nll_median": (("layer", "head"), np.median(measured.delta, axis=-1)),
        "robust_z": (("layer", "head"), robust_z(impact)),
        "critical": (("layer", "head"), critical),
        "protected": (("layer", "head"), protected),
        "weight_o_norm": (("layer", "head"), measured.weight_o),
        "weight_v_norm": (("layer", "head"), measured.weight_v),
        "intact_nll": ("seq", measured.intact),
        **{name: (("layer", "head"), value) for name, value in inputs.diagnostics.items()},
        **{name: (("layer", "head"), value) for name, value in inputs.geometric.items()},
    }
    if inputs.regime is not None:
        single_vars["regime"] = (("layer", "head"), inputs.regime)
    single = xr.Dataset(single_vars, coords={"seq": inputs.importance.astype(np.int64), **inputs.layer_head}, attrs=attrs)
    correlates = {**inputs.diagnostics, "weight_o_norm": measured.weight_o, "weight_v_norm": measured.weight_v,
                  **inputs.geometric}
    where = np.argwhere(critical)
    sweep = measured.sweep.assign_attrs(attrs)
    table = _sweep_table(sweep, request.run_id, inputs.provenance["model"]["id"])
    groups = {
        "single": single,
        "sweep": sweep,
        "correlations": correlation_table(impact, correlates).assign_attrs(attrs),
        "critical": xr.Dataset(
            {
                "layer": ("critical", where[:, 0].astype(np.int64)),
                "head": ("critical", where[:, 1].astype(np.int64)),
                "delta_nll_mean": ("critical", impact[critical]),
                "robust_z": ("critical", robust_z(impact)[critical]),
            },
            # How many, so that a reader need not open the arrays: they have length 0 when no
            # head is critical, which some Zarr implementations (zarrita) cannot read.
            attrs={**attrs, "critical_heads": int(len(where))},
        ),
        "table": xr.Dataset.from_dataframe(table.rename_axis("row")).assign_attrs(attrs),
    }
    if inputs.regime is not None:
        groups["regimes"] = _regimes_dataset(inputs.regime, impact, protected).assign_attrs(attrs)
    return groups, table


def _write_tables(out: Path, run_id: str, groups: dict[str, xr.Dataset], table: pd.DataFrame) -> None:
    """The sweep, correlation and single-head tables as CSV files in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / f"{run_id}.sweep.csv", index=False)
    groups["correlations"].to_dataframe().to_csv(out / f"{run_id}.correlations.csv")
    single = groups["single"][["delta_nll_mean", "delta_nll_median", "robust_z", "critical", "protected"]]
    single.to_dataframe().to_csv(out / f"{run_id}.single.csv")
