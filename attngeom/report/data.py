"""What the report reads from a store: one ``RunData`` per run, with every group it may use.

Groups written by later or optional stages (taxonomy, signatures, ablation) may be absent; a
missing group is ``None`` here, and ``Requirement``s turn absence into a readable note. An
unfinished analysis or ablation (an interrupted writer) is refused, never drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import xarray as xr

from attngeom.detect.head_classes import DETECT, DETECT_GROUP, HEAD_SCORES, open_groups, why_no_head_scores
from attngeom.store.objects.commands import stage_command
from attngeom.store import ABLATION, ABLATION_GROUPS, ANALYSIS, REGIMES
from attngeom.store.session import RunReader, StoreSession

# Small (layer, head[, n]) groups, loaded in memory; ``topn`` stays lazy (it is per sequence).
SMALL_GROUPS = ("summary", "heads", "signatures")


@dataclass
class RunData:
    """One run: its identity, shape, and the opened analysis and ablation datasets."""

    run_id: str
    model_id: str
    dataset_id: str
    context_length: int
    compute_dtype: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    sequences: int
    color: str = "C0"
    summary: xr.Dataset | None = None
    heads: xr.Dataset | None = None
    signatures: xr.Dataset | None = None
    topn: xr.Dataset | None = None
    summary_by_query: xr.Dataset | None = None
    head_scores: xr.Dataset | None = None   # analysis/head_scores (layer, head[, recent])
    no_head_scores: str = ""                # why head_scores is None
    detect: xr.Dataset | None = None        # the detect stage's scores (layer, head)
    ablation: dict[str, xr.Dataset] = field(default_factory=dict)
    url: str = ""                           # the store's, for the commands the report suggests

    @property
    def model(self) -> str:
        """Short model name: hub ids and paths read better without their prefix."""
        return _short(self.model_id)

    @property
    def dataset(self) -> str:
        return _short(self.dataset_id)

    @property
    def label(self) -> str:
        """Legend label: model, dataset and context length."""
        return f"{self.model} · {self.dataset} · L={self.context_length}"

    def group(self, name: str) -> xr.Dataset | None:
        """An analysis group (``summary``, ``heads``, ``signatures``, ``topn``,
        ``summary_by_query``, ``head_scores``), an ablation one, or ``detect``."""
        if name in ABLATION_GROUPS:
            return self.ablation.get(name)
        return getattr(self, name)


# Inputs only some runs can have: rows at more queries (extract --queries), a model with
# learned sinks.
OPTIONAL = ("queries", "sinks")


@dataclass(frozen=True)
class Missing:
    """Why a run lacks an input: ``reason``, as the page says it, and the ``stage`` whose
    output it is: "analyze", "ablate", "detect", or, optional, "queries" (an extract with
    --queries) or "sinks" (a model with learned sinks)."""

    reason: str
    stage: str

    @property
    def optional(self) -> bool:
        return self.stage in OPTIONAL

    def __str__(self) -> str:
        return self.reason


Requirement = Callable[[RunData], "Missing | None"]


def requires(group: str, *variables: str) -> Requirement:
    """A check that ``group`` exists and holds ``variables``; returns why not, or None."""
    if group == DETECT:
        stage, where = "detect", f"{DETECT}/{DETECT_GROUP}"
    elif group in ABLATION_GROUPS:
        stage, where = "ablate", f"{ABLATION}/{group}"
    else:
        stage, where = "analyze", f"{ANALYSIS}/{group}"

    def check(run: RunData) -> Missing | None:
        ds = run.group(group)
        if ds is None and group == HEAD_SCORES:
            return Missing(run.no_head_scores, stage)
        if ds is None:
            return Missing(f"no {where} (run `{stage_command(stage, run.url, run.run_id)}`)", stage)
        lacking = [v for v in variables if v not in ds.variables]
        if lacking:
            return Missing(f"{where} lacks {', '.join(lacking)} (run `{stage_command(stage, run.url, run.run_id)}` "
                           "again)", stage)
        return None

    return check


def has_learned_sinks(run: RunData) -> Missing | None:
    """Whether the run's head scores hold a learned sink's (a model with learned sinks)."""
    missing = requires(HEAD_SCORES, "sink_score")(run)
    if missing is not None:
        return missing
    if "learned_sink_score" not in run.head_scores.variables:
        return Missing("its model has no learned sinks", "sinks")
    return None


def any_of(*checks: Requirement) -> Requirement:
    """A check passing when one of ``checks`` passes; else every reason, joined."""

    def check(run: RunData) -> Missing | None:
        reasons = [c(run) for c in checks]
        if any(r is None for r in reasons):
            return None
        return Missing(" and ".join(str(r) for r in reasons), reasons[0].stage)

    return check


def all_of(*checks: Requirement) -> Requirement:
    """A check passing when every one of ``checks`` passes (the first failure's reason)."""

    def check(run: RunData) -> Missing | None:
        return next((reason for c in checks if (reason := c(run)) is not None), None)

    return check


def has_field_scores() -> Requirement:
    """A check that a run has regimes and field scores: ``analysis/head_scores``, detect's, or both."""
    return all_of(requires("heads", "regime"),
                  any_of(requires(HEAD_SCORES, "sink_score"), requires(DETECT, "induction_score")))


def _short(identifier: str) -> str:
    return identifier.rstrip("/").split("/")[-1] or identifier


def load_run(run: RunReader) -> RunData:
    """Open every group of the run that exists (a missing one is None, an unfinished one
    raises :class:`~attngeom.errors.IncompleteGroupError`); small ones are loaded in memory."""
    meta = run.provenance
    layout = meta.get("layout", {})
    data = RunData(
        run_id=run.id,
        url=run.url,
        model_id=str(meta.get("model", {}).get("id") or "?"),
        dataset_id=str(meta.get("dataset", {}).get("id") or "?"),
        context_length=int(meta.get("context_length", layout.get("length", 0)) or 0),
        # bfloat16 and float32 extracts of one model differ (README, "Compute dtype").
        compute_dtype=str(meta.get("compute_dtype") or "?"),
        n_layers=int(layout.get("n_layers", 0)),
        n_heads=int(layout.get("n_heads", 0)),
        n_kv_heads=int(layout.get("n_kv_heads", 0)),
        sequences=int(run.completed().size) if run.has("complete") else 0,
    )
    for name in SMALL_GROUPS:
        ds = run.derived(ANALYSIS, name, missing_ok=True)
        setattr(data, name, ds.load() if ds is not None else None)
    data.topn = run.derived(ANALYSIS, "topn", missing_ok=True)
    # Lazy as topn: (stat, layer, head, query_pos, n) grows with the stored queries.
    data.summary_by_query = run.derived(ANALYSIS, "summary_by_query", missing_ok=True)
    data.head_scores, data.detect = open_groups(run)
    data.no_head_scores = why_no_head_scores(meta, run.url, run.id)
    for name in ABLATION_GROUPS:
        ds = run.derived(ABLATION, name, missing_ok=True)
        if ds is not None:
            data.ablation[name] = ds
    return data


def load_runs(store: str) -> list[RunData]:
    """Every run of the store, in run-id order, read through one
    :class:`~attngeom.store.session.StoreSession`."""
    with StoreSession(store) as session:
        runs = [load_run(run) for run in session.readers(check="arrays")]
    # One colour per run, fixed here so that a run keeps it in every figure.
    for i, run in enumerate(runs):
        run.color = f"C{i % 10}"
    return runs


def table_frame(ds: xr.Dataset) -> pd.DataFrame:
    """A one-dimensional dataset (a stored table) as a DataFrame; its index becomes a column
    when it is a coordinate (``diagnostic``), not when it only numbers rows. Text columns hold
    plain ``str``."""
    labelled = all(dim in ds.coords for dim in ds.dims)
    frame = ds.to_dataframe().reset_index(drop=not labelled)
    for column in frame.columns:
        if frame[column].dtype.kind not in "biufcmM":
            frame[column] = frame[column].map(str).astype(object)
    return frame


def critical_heads(run: RunData) -> list[tuple[int, int]]:
    """The (layer, head) pairs of ``ablation/critical``: its ``layer`` and ``head`` columns."""
    ds = run.ablation.get("critical")
    if ds is None:
        return []
    frame = table_frame(ds)
    if not {"layer", "head"} <= set(frame.columns) or frame.empty:
        return []
    pairs = frame[["layer", "head"]].dropna().astype(int)
    return [(int(layer), int(head)) for layer, head in pairs.itertuples(index=False)]


def finite(x: xr.DataArray | np.ndarray) -> np.ndarray:
    """The finite entries of ``x`` as a flat float array."""
    values = np.asarray(x, dtype=np.float64).ravel()
    return values[np.isfinite(values)]


def labels(x: xr.DataArray) -> np.ndarray:
    """String values (a label variable or coordinate) as a flat object array of ``str``.

    Zarr v3 strings come back as NumPy's StringDType, which does not cast to ``<U``."""
    return np.asarray([str(v) for v in np.asarray(x.values).ravel()], dtype=object)


def regime_counts(run: RunData) -> dict[str, int]:
    """Heads per regime of a run (``analysis/heads`` ``regime``), in REGIMES order."""
    assert run.heads is not None
    regimes = labels(run.heads["regime"])
    return {name: int(np.sum(regimes == name)) for name in REGIMES}
