"""Test helpers: the field's score groups written into a store with chosen values, in the
layout analyze (``analysis/head_scores``) and detect (``detect/scores``) write them, committed
as their writers commit them, so that readers find them as they find real ones."""

from __future__ import annotations

import numpy as np
import xarray as xr
import zarr

from attngeom.store import ATTR_KEY, open_dataset, open_root, open_run_group, replace_groups, zarr_store
from attngeom.store.session import StoreSession
from attngeom.store.objects.stored_objects import object_sizes

RECENT = [16, 64, 256]


def head_scores(sink: np.ndarray, prev: np.ndarray, distant: np.ndarray) -> xr.Dataset:
    """analysis/head_scores from (layer, head) sink and previous-token scores and (layer,
    head, recent) distant mass."""
    dims = ("layer", "head")
    layers, heads = sink.shape
    return xr.Dataset(
        {"sink_score": (dims, sink), "sink_head": (dims, sink > 0.3), "prev_token_score": (dims, prev),
         "distant_mass": ((*dims, "recent"), distant)},
        coords={"layer": np.arange(layers), "head": np.arange(heads), "recent": RECENT},
    )


def detect_scores(duplicate: np.ndarray, induction: np.ndarray, prev: np.ndarray,
                  retrieval: np.ndarray) -> xr.Dataset:
    dims = ("layer", "head")
    layers, heads = duplicate.shape
    return xr.Dataset(
        {"duplicate_score": (dims, duplicate), "induction_score": (dims, induction),
         "prev_token_score": (dims, prev), "retrieval_score": (dims, retrieval)},
        coords={"layer": np.arange(layers), "head": np.arange(heads)},
    )


def add_head_scores(url: str, run_id: str, ds: xr.Dataset) -> None:
    """``ds`` as ``runs/<run_id>/analysis/head_scores`` of a run analyze has committed: the
    group written (in place of analyze's own, if any), then listed in the analysis's commit
    record."""
    base = f"runs/{run_id}/analysis"
    zstore = zarr_store(url, read_only=False)
    ds.to_zarr(zstore, group=f"{base}/head_scores", mode="w", consolidated=False, zarr_format=3)
    group = zarr.open_group(zstore, path=base, mode="r+", use_consolidated=False)
    record = dict(group.attrs[ATTR_KEY])
    commit = dict(record["commit"])
    commit["groups"] = [*(g for g in commit["groups"] if g != "head_scores"), "head_scores"]
    objects = object_sizes(zstore, f"{base}/head_scores/")
    kept = {k: v for k, v in commit["objects"].items() if not k.startswith("head_scores/")}
    commit["objects"] = {**kept, **{k[len(base) + 1:]: v for k, v in objects.items()}}
    record["commit"] = commit
    group.attrs[ATTR_KEY] = record


def drop_head_scores(url: str, run_id: str) -> None:
    """Remove ``analysis/head_scores`` from a committed analysis, as analyze leaves a run that
    lacks prev_attn and recent_attn (extracted before attngeom kept them)."""
    base = f"runs/{run_id}/analysis"
    zstore = zarr_store(url, read_only=False)
    group = zarr.open_group(zstore, path=base, mode="r+", use_consolidated=False)
    record = dict(group.attrs[ATTR_KEY])
    commit = dict(record["commit"])
    commit["groups"] = [g for g in commit["groups"] if g not in ("head_scores", "sequence_scores")]
    commit["sequence_groups"] = [g for g in commit.get("sequence_groups", []) if g != "sequence_scores"]
    commit["objects"] = {k: v for k, v in commit["objects"].items()
                         if not k.startswith(("head_scores/", "sequence_scores/"))}
    record["commit"] = commit
    group.attrs[ATTR_KEY] = record
    for name in ("head_scores", "sequence_scores"):
        if name in group:
            del group[name]


def mark_lacking(url: str, run_id: str) -> None:
    """Record the run as extracted before attngeom kept prev_attn and recent_attn, as migrate
    records a run of an older format."""
    run = open_run_group(open_root(url, mode="a"), run_id)
    meta = dict(run.attrs[ATTR_KEY])
    meta["layout"] = {**meta["layout"], "lacking": ["prev_attn", "recent_attn"]}
    run.attrs[ATTR_KEY] = meta


def add_detect(url: str, run_id: str, ds: xr.Dataset) -> None:
    """``ds`` as the committed ``runs/<run_id>/detect/scores``."""
    replace_groups(url, run_id, "detect", {"scores": ds}, {"probes": 16})


def regimes(url: str, run_id: str) -> np.ndarray:
    """The run's regimes (layer, head) as str."""
    heads = open_dataset(StoreSession.reading(url).zstore, url, f"runs/{run_id}/analysis/heads")
    regime = heads["regime"].transpose("layer", "head")
    return np.asarray([str(x) for x in np.asarray(regime.values).ravel()], dtype=object).reshape(regime.shape)


def plant_regimes(url: str, run_id: str, plan: dict[tuple[int, int], str]) -> None:
    """Make heads (layer, head) of a synthetic run Retrievers (every query's source winner the
    query itself) or Mixers (the sink), before analyze; the others keep random winners,
    which make Resets."""
    run = open_run_group(open_root(url, mode="a"), run_id)
    winner = run["winner"][:]
    query = np.arange(winner.shape[-1])
    for (layer, head), regime in plan.items():
        winner[:, layer, head] = query if regime == "Retriever" else 0
    run["winner"][:] = winner
