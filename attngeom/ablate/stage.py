"""The ablate stage (SPEC §5): single-head ablation and per-layer head sparsification.

Loads the run's model, reads its tokens, attention summaries and (if present) the analysis
head table, and writes ``runs/<id>/ablation/``:

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
import zarr

from attngeom import __version__
from attngeom.ablate.kernels import (
    MAD_SCALE,
    attention_diagnostics,
    correlation_table,
    critical_heads,
    keep_mask,
    kept_per_layer,
    random_keys,
    regime_means,
    robust_z,
    type_guided_keys,
)
from attngeom.ablate.masking import head_geometry, head_weight_norms, masked_nll
from attngeom.errors import AttngeomError
from attngeom.extract.models import (
    ModelSource,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from attngeom.store import (
    ABLATION,
    ANALYSIS,
    REGIMES,
    ablation_path,
    analysis_path,
    check_committed,
    completed,
    consolidate,
    open_dataset,
    open_root,
    open_run_group,
    reading_run,
    run_ids,
    run_provenance,
    write_dataset,
)

DEFAULT_RETENTION = (1.0, 0.9, 0.75, 0.5, 0.25)
# How each method orders the heads of a layer, first kept first.
METHODS = {
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


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"0.12,3.4"`` -> ``[(0, 12), (3, 4)]`` (layer.head pairs, for ``--protect``)."""
    heads = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        layer, dot, head = item.partition(".")
        if not dot or not layer.isdigit() or not head.isdigit():
            raise AttngeomError(f"--protect takes LAYER.HEAD pairs separated by commas, e.g. 0.12,3.4 (got {item!r})")
        heads.append((int(layer), int(head)))
    return heads


def split_sequences(seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted completed sequence indices (S,) -> (importance, evaluation), see SPLIT_RULE."""
    return seqs[0::2], seqs[1::2]


def _model_source(provenance: dict[str, Any], run_id: str) -> ModelSource:
    """The run's model, refused if its weights differ from those the run was extracted with."""
    model = provenance.get("model") or {}
    if "id" not in model:
        raise AttngeomError(f"run '{run_id}' records no model in its provenance")
    source = resolve_model(model["id"])
    recorded = model.get("file_sha256") or model.get("revision")
    current = source.file_sha256 or source.revision
    if recorded and current and recorded != current:
        raise AttngeomError(
            f"model '{model['id']}' is not the one run '{run_id}' was extracted with "
            f"(weights {current[:12]}, recorded {recorded[:12]})"
        )
    return source


def _store_diagnostics(run: zarr.Group, seqs: np.ndarray, top_n: int) -> dict[str, np.ndarray]:
    """Per-head means (layers, heads) over ``seqs`` of the attention diagnostics, read one
    sequence shard at a time."""
    sums: dict[str, np.ndarray] = {}
    for s in seqs:
        s = int(s)
        entropy = run["entropy"][s]
        per_seq = attention_diagnostics(run["attn_last"][s], entropy[..., -1], run["top1_attn"][s][..., -1], top_n)
        for name, array in ALL_QUERY_DIAGNOSTICS.items():
            # Query 0 is excluded: there the sink is also the diagonal (SPEC §2).
            per_seq[name] = (entropy if array == "entropy" else run[array][s])[..., 1:].mean(axis=-1)
        for name, value in per_seq.items():
            sums[name] = sums.get(name, 0.0) + value.astype(np.float64)
    return {name: total / len(seqs) for name, total in sums.items()}


def _analysis_heads(url: str, run: zarr.Group, run_id: str) -> xr.Dataset | None:
    """analyze's (layer, head) table, or None when the run has not been analyzed."""
    if ANALYSIS not in run or "heads" not in run[ANALYSIS]:
        return None
    heads = open_dataset(url, analysis_path(run_id, "heads"))
    return heads.transpose("layer", "head", ...).load()


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
    """The deterministic methods' ranking keys (see METHODS), larger kept first."""
    entropy = diagnostics["mean_attention_entropy"]
    keys = {
        "single_impact": [single_impact],
        "weight_o": [weight_o],
        "weight_v": [weight_v, weight_o],
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


def ablate(
    store: str,
    run_id: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    protect: Sequence[tuple[int, int]] = (),
    protect_critical: bool = False,
    retention: Sequence[float] = DEFAULT_RETENTION,
    random_masks: int = 10,
    seed: int = 0,
    top_n: int = 8,
    critical_k: float = 5.0,
    critical_floor: float = 2.0,
    max_sequences: int | None = None,
    batch_size: int = 64,
    out: Path | None = None,
    progress: bool = True,
) -> AblateResult:
    """Single-head ablation and head sparsification of run ``run_id``; writes ``runs/<id>/ablation``.

    protect: (layer, head) pairs always kept and outside every ranking; protect_critical adds
    the critical heads (``delta_nll_mean > median + critical_k * 1.4826 * MAD`` over all heads
    and ``> critical_floor`` nats). retention: fractions of heads kept per layer
    (``round(f * H)`` in every layer). random_masks: seeded random draws (0: none).
    batch_size: (sequence, mask) rows per forward. dtype: "auto" (float32 on CPU, bfloat16
    on CUDA), "float32", "bfloat16" or "float16". out: also write CSV tables there.
    """
    start = time.perf_counter()
    if not all(0.0 <= f <= 1.0 for f in retention) or not retention:
        raise AttngeomError("--retention takes fractions between 0 and 1")
    if random_masks < 0 or batch_size < 1 or top_n < 1:
        raise AttngeomError("--random-masks must be >= 0, --batch-size and top-N >= 1")
    root = open_root(store, mode="a")
    runs = run_ids(root)
    if run_id not in runs:
        raise AttngeomError(f"no run '{run_id}' in {store} (runs: {', '.join(runs) or 'none'})")
    run = open_run_group(root, run_id)
    check_committed(store, run, run_id)
    provenance = run_provenance(root, run_id)
    seqs = completed(run)[:max_sequences]
    if len(seqs) < 2:
        raise AttngeomError(f"run '{run_id}' needs at least 2 complete sequences (an importance and an evaluation split); it has {len(seqs)}")
    importance, evaluation = split_sequences(seqs)
    n_layers, n_heads = run["layer"].shape[0], run["head"].shape[0]
    protected = np.zeros((n_layers, n_heads), dtype=bool)
    for layer, head in protect:
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise AttngeomError(f"--protect {layer}.{head}: the run has layers 0-{n_layers - 1} and heads 0-{n_heads - 1}")
        protected[layer, head] = True

    with reading_run(store, run, run_id):
        diagnostics = _store_diagnostics(run, importance, top_n)
        tokens = run["tokens"].get_orthogonal_selection((seqs, slice(None))).astype(np.int64)
    heads = _analysis_heads(store, run, run_id)
    skipped: dict[str, str] = {}
    regime = None
    if heads is not None and "regime" in heads:
        regime = np.array(heads["regime"].values.tolist(), dtype=object)
    else:
        skipped["type_guided"] = (
            "no head regimes: runs/<id>/analysis/heads has no 'regime' variable"
            if heads is not None else "no head regimes: the run has not been analyzed (run attngeom analyze)"
        )
        warnings.warn(f"type-guided sparsification skipped: {skipped['type_guided']}", stacklevel=2)
    geometric = {
        name: heads[name].values.astype(np.float64)
        for name in sorted(heads.data_vars if heads is not None else ())
        if heads[name].dims == ("layer", "head") and np.issubdtype(heads[name].dtype, np.number)
    }

    by_seq = dict(zip(seqs.tolist(), torch.from_numpy(tokens)))
    imp_tokens = torch.stack([by_seq[int(s)] for s in importance])
    eval_tokens = torch.stack([by_seq[int(s)] for s in evaluation])

    source = _model_source(provenance, run_id)
    device = resolve_device(device)
    compute_dtype = resolve_dtype(dtype, device)
    model = load_model(source, device=device, dtype=compute_dtype)
    geometry = head_geometry(model)
    if (geometry.n_layers, geometry.n_heads) != (n_layers, n_heads):
        raise AttngeomError(
            f"model has {geometry.n_layers} layers x {geometry.n_heads} heads, run '{run_id}' {n_layers} x {n_heads}"
        )
    weight_o, weight_v = (w.numpy().astype(np.float64) for w in head_weight_norms(model))

    intact = masked_nll(model, imp_tokens, torch.ones(1, n_layers, n_heads), batch_size=batch_size)[:, 0].double().numpy()
    nll = masked_nll(
        model, imp_tokens, _single_masks(n_layers, n_heads), batch_size=batch_size, progress=progress, desc="single heads"
    ).double().numpy()
    delta = (nll - intact[:, None]).T.reshape(n_layers, n_heads, len(importance))
    impact = delta.mean(axis=-1)
    critical = critical_heads(impact, critical_k, critical_floor)
    if protect_critical:
        protected |= critical

    keys = _sweep_keys(impact, weight_o, weight_v, diagnostics, regime, protected)
    layer_head = {"layer": run["layer"][:], "head": run["head"][:]}
    sweep = _sweep(
        model, eval_tokens, keys, protected, retention, random_masks, seed, batch_size, progress,
        {"seq": evaluation.astype(np.int64), **layer_head},
    )

    model_id = provenance["model"]["id"]
    median = float(np.median(impact))
    threshold = median + critical_k * MAD_SCALE * float(np.median(np.abs(impact - median)))
    attrs = {
        "attngeom": {
            "protocol": PROTOCOL,
            "model": model_id,
            "device": device,
            "compute_dtype": str(compute_dtype).removeprefix("torch."),
            "split_rule": SPLIT_RULE,
            "max_sequences": max_sequences,
            "importance_sequences": importance.tolist(),
            "evaluation_sequences": evaluation.tolist(),
            "retention": list(map(float, retention)),
            "kept_per_layer": [kept_per_layer(f, n_heads) for f in retention],
            "random_masks": random_masks,
            "seed": seed,
            "random_seeding": "draw d: numpy default_rng([seed, d]) priorities per (layer, head)",
            "top_n": top_n,
            "protect": [list(map(int, h)) for h in protect],
            "protect_critical": protect_critical,
            "protected": np.argwhere(protected).tolist(),
            "critical_rule": {
                "rule": "delta_nll_mean > median + k * 1.4826 * MAD (over all heads) and > floor (nats)",
                "k": critical_k, "floor": critical_floor, "threshold": max(threshold, critical_floor),
            },
            "methods": {m: METHODS[m] for m in sweep["method"].values},
            "skipped_methods": skipped,
            "attngeom_version": __version__,
        }
    }
    single_vars: dict[str, Any] = {
        "delta_nll": (("layer", "head", "seq"), delta),
        "delta_nll_mean": (("layer", "head"), impact),
        "delta_nll_median": (("layer", "head"), np.median(delta, axis=-1)),
        "robust_z": (("layer", "head"), robust_z(impact)),
        "critical": (("layer", "head"), critical),
        "protected": (("layer", "head"), protected),
        "weight_o_norm": (("layer", "head"), weight_o),
        "weight_v_norm": (("layer", "head"), weight_v),
        "intact_nll": ("seq", intact),
        **{name: (("layer", "head"), value) for name, value in diagnostics.items()},
        **{name: (("layer", "head"), value) for name, value in geometric.items()},
    }
    if regime is not None:
        single_vars["regime"] = (("layer", "head"), regime)
    single = xr.Dataset(single_vars, coords={"seq": importance.astype(np.int64), **layer_head}, attrs=attrs)
    correlates = {**diagnostics, "weight_o_norm": weight_o, "weight_v_norm": weight_v, **geometric}
    correlations = correlation_table(impact, correlates).assign_attrs(attrs)
    where = np.argwhere(critical)
    critical_ds = xr.Dataset(
        {
            "layer": ("critical", where[:, 0].astype(np.int64)),
            "head": ("critical", where[:, 1].astype(np.int64)),
            "delta_nll_mean": ("critical", impact[critical]),
            "robust_z": ("critical", robust_z(impact)[critical]),
        },
        attrs=attrs,
    )
    regimes = _regimes_dataset(regime, impact, protected).assign_attrs(attrs) if regime is not None else None
    sweep = sweep.assign_attrs(attrs)
    table = _sweep_table(sweep, run_id, model_id)

    # Replace the previous results as a whole: no group of an older ablation survives.
    writable = open_run_group(open_root(store, mode="a"), run_id)
    if ABLATION in writable:
        del writable[ABLATION]
    groups = {"single": single, "sweep": sweep, "correlations": correlations, "critical": critical_ds,
              "table": xr.Dataset.from_dataframe(table.rename_axis("row")).assign_attrs(attrs)}
    if regimes is not None:
        groups["regimes"] = regimes
    for name, dataset in groups.items():
        write_dataset(dataset, store, ablation_path(run_id, name))
    consolidate(open_root(store, mode="a"))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / f"{run_id}.sweep.csv", index=False)
        correlations.to_dataframe().to_csv(out / f"{run_id}.correlations.csv")
        single[["delta_nll_mean", "delta_nll_median", "robust_z", "critical", "protected"]].to_dataframe().to_csv(
            out / f"{run_id}.single.csv"
        )
    return AblateResult(
        run_id, single, sweep, correlations, critical_ds, regimes, table, skipped, time.perf_counter() - start
    )
