"""The field's head scores beside the paper's regimes (docs/method.md#field-classes): the
scores by name, the criteria that make classes of them, and the per-head tables that export
them (``attngeom taxonomy --export`` and ``--export-kv``).

Two groups hold the scores, each possibly absent from a run: ``analysis/head_scores``
(analyze, from the run's own text) and ``detect/scores`` (the detect stage, from probe
sequences). Every reader takes them through :func:`run_scores`, so that one table names
them: a score's name is its variable's, ``distant_mass`` is split by its window
(``distant_mass_w64``) and detect's ``prev_token_score``, measured on repeated random
tokens, is ``detect_prev_token_score``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from attngeom.errors import GroupNotFoundError, InputError
from attngeom.store.objects.commands import stage_command
from attngeom.store import (
    ANALYSIS,
    DETECT,
    RECENT_WINDOWS,
    REGIMES,
    SIGNATURE_VARIABLES,
    VALUE_STATISTICS,
    VOTES,
    lacking_summaries,
)
from attngeom.store.session import RunReader, StoreSession

__all__ = [
    "CRITERIA", "DETECT", "DETECT_GROUP", "HEAD_SCORES", "KV_SCORES", "SCORES", "TABLE_SUFFIXES", "Criterion",
    "Score", "check_kv_score", "check_path", "class_counts", "head_table", "kv_scores", "open_groups", "regimes_of",
    "run_scores", "share", "why_no_head_scores", "write_kv", "write_table",
]

HEAD_SCORES = "head_scores"
DETECT_GROUP = "scores"


@dataclass(frozen=True)
class Score:
    """One field score per (layer, head): ``variable`` of ``group`` (``HEAD_SCORES`` in
    analysis, or ``DETECT``), at window ``recent`` for distant_mass; ``label`` as figures
    say it."""

    name: str
    group: str
    variable: str
    label: str
    recent: int | None = None


SCORES: tuple[Score, ...] = (
    Score("sink_score", HEAD_SCORES, "sink_score", "sink score (mean A[i,0])"),
    Score("prev_token_score", HEAD_SCORES, "prev_token_score", "previous-token score (text)"),
    *(Score(f"distant_mass_w{w}", HEAD_SCORES, "distant_mass", f"distant mass, W = {w}", w) for w in RECENT_WINDOWS),
    Score("duplicate_score", DETECT, "duplicate_score", "duplicate-token score"),
    Score("induction_score", DETECT, "induction_score", "induction score"),
    Score("detect_prev_token_score", DETECT, "prev_token_score", "previous-token score (probe)"),
    Score("retrieval_score", DETECT, "retrieval_score", "retrieval score"),
)
_BY_NAME = {s.name: s for s in SCORES}

# Scores whose high values mean that a head reads keys outside the sink and a recent window,
# so that a KV cache should keep its full history: DuoAttention's "retrieval heads" (1 =
# full KV). Previous-token and sink scores measure the opposite, local or sink-bound heads.
KV_SCORES = (*(f"distant_mass_w{w}" for w in RECENT_WINDOWS), "retrieval_score", "induction_score",
             "duplicate_score")


@dataclass(frozen=True)
class Criterion:
    """A class of the field: heads whose ``score`` is above (or, ``above`` False, below)
    ``threshold``; ``source`` says where the threshold comes from; ``regime`` names the
    paper's regime it is read beside, if one is its counterpart."""

    name: str
    column: str
    score: str
    threshold: float
    above: bool
    source: str
    regime: str | None = None

    @property
    def rule(self) -> str:
        return f"{self.score} {'>' if self.above else '<'} {self.threshold:g}"

    def passes(self, values: np.ndarray) -> np.ndarray:
        """Which heads are of the class; a head without a value (NaN) is not."""
        values = np.asarray(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            return values > self.threshold if self.above else values < self.threshold


CRITERIA: tuple[Criterion, ...] = (
    Criterion("sink head", "sink_head", "sink_score", 0.3, True,
              "Gu et al. 2024 (When attention sink emerges), epsilon = 0.3", "Mixer"),
    Criterion("previous-token head", "prev_token_head", "prev_token_score", 0.4, True,
              "attngeom's choice: 40% of a head's mass on one key; TransformerLens and nnterp set no cut", "Reset"),
    Criterion("streaming head", "streaming_head", "distant_mass_w64", 0.35, False,
              "mlx-lm PR 1522: a head with distant mass of at least 0.35 beyond a 64-token window is a "
              "retrieval head, the others streaming"),
    Criterion("duplicate-token head", "duplicate_head", "duplicate_score", 0.4, True,
              "attngeom's choice, as for previous-token heads"),
    Criterion("induction head", "induction_head", "induction_score", 0.4, True,
              "attngeom's choice, as for previous-token heads", "Retriever"),
    Criterion("previous-token head (probe)", "detect_prev_token_head", "detect_prev_token_score", 0.4, True,
              "attngeom's choice, as for previous-token heads", "Reset"),
    Criterion("retrieval head", "retrieval_head", "retrieval_score", 0.1, True,
              "Wu et al. 2024 (Retrieval head mechanistically explains long-context factuality), 0.1",
              "Retriever"),
)


def run_scores(head_scores: xr.Dataset | None, detect: xr.Dataset | None) -> dict[str, xr.DataArray]:
    """Every score the two groups hold, by name, each (layer, head) float64, in SCORES order."""
    groups = {HEAD_SCORES: head_scores, DETECT: detect}
    out = {}
    for score in SCORES:
        ds = groups[score.group]
        if ds is None or score.variable not in ds:
            continue
        x = ds[score.variable]
        if score.recent is not None:
            if "recent" not in x.dims or score.recent not in x["recent"].values:
                continue
            x = x.sel(recent=score.recent, drop=True)
        out[score.name] = x.transpose("layer", "head").astype(np.float64)
    return out


def open_groups(run: RunReader) -> tuple[xr.Dataset | None, xr.Dataset | None]:
    """The run's ``analysis/head_scores`` and detect scores, loaded; None for an absent one
    (an unfinished one raises :class:`IncompleteGroupError`)."""
    head_scores, detect = (run.derived(kind, name, missing_ok=True)
                           for kind, name in ((ANALYSIS, HEAD_SCORES), (DETECT, DETECT_GROUP)))
    return (None if head_scores is None else head_scores.load()), (None if detect is None else detect.load())


def why_no_head_scores(provenance: Mapping, url: str, run_id: str) -> str:
    """Why run ``run_id`` of the store at ``url`` has no ``analysis/head_scores``, and what adds
    it: a run extracted before attngeom kept prev_attn and recent_attn must be extracted
    again; any other, analyzed (the command, as it runs for that run)."""
    lacking = lacking_summaries(provenance)
    if lacking:
        return (f"no analysis/{HEAD_SCORES}: the run was extracted before attngeom kept {' and '.join(lacking)} "
                "(extract it again into a new run)")
    return f"no analysis/{HEAD_SCORES} (run `{stage_command('analyze', url, run_id)}`)"


def _run_frame(run: RunReader, heads: xr.Dataset) -> pd.DataFrame:
    """One run's heads as rows: identity, regime, vote fractions, value statistics,
    signatures at the heads' coherence N, field scores and classes."""
    provenance = run.provenance
    heads = heads.load()
    n_layers, n_heads = heads.sizes["layer"], heads.sizes["head"]
    head_kv = np.asarray(provenance.get("layout", {}).get("head_kv", [-1] * n_heads))
    columns: dict[str, np.ndarray] = {
        "layer": np.repeat(np.arange(n_layers), n_heads),
        "head": np.tile(np.arange(n_heads), n_layers),
        "kv_head": np.tile(head_kv, n_layers),
        "regime": regimes_of(heads).ravel(),
    }
    for name in (*(f"vote_{v}" for v in VOTES), *VALUE_STATISTICS, "mu", "mu_q95"):
        if name in heads:
            columns[name] = heads[name].transpose("layer", "head").values.ravel().astype(np.float64)
    summary = run.derived(ANALYSIS, "summary", missing_ok=True)
    n = heads.attrs.get("coherence_n")
    if summary is not None and n is not None and int(n) in summary["n"].values:
        at = summary.sel(stat="mean", n=int(n))
        columns["signature_n"] = np.full(n_layers * n_heads, int(n))
        for name in SIGNATURE_VARIABLES:
            if name in at:
                columns[name] = at[name].transpose("layer", "head").values.ravel().astype(np.float64)
    scores = run_scores(*open_groups(run))
    for name, x in scores.items():
        columns[name] = x.values.ravel()
    for c in CRITERIA:
        if c.score in scores:
            columns[c.column] = c.passes(scores[c.score].values).ravel()
    frame = pd.DataFrame(columns)
    frame.insert(0, "L", int(provenance.get("context_length", provenance.get("layout", {}).get("length", 0)) or 0))
    frame.insert(0, "dataset", str(provenance.get("dataset", {}).get("id") or ""))
    frame.insert(0, "model", str(provenance.get("model", {}).get("id") or ""))
    frame.insert(0, "run", run.id)
    return frame


def head_table(session: StoreSession, run_ids: Sequence[str]) -> pd.DataFrame:
    """Every head of the runs ``run_ids`` (analyzed ones) of the ``session``'s store as one
    tidy table, a row per (run, layer, head). A score or class column a run lacks (no
    head_scores, no detect) is empty there (NaN, or <NA> for a class); a column no run has
    is left out."""
    frames = []
    for run_id in run_ids:
        run = session.reader(run_id)
        heads = run.derived(ANALYSIS, "heads", missing_ok=True)
        if heads is None or "regime" not in heads:
            continue
        frames.append(_run_frame(run, heads))
    frame = pd.concat(frames, ignore_index=True)
    for c in CRITERIA:
        if c.column in frame:
            frame[c.column] = frame[c.column].astype("boolean")
    return frame


def _kv_run(session: StoreSession, run_id: str | None) -> RunReader:
    """The run an --export-kv reads: ``run_id``, or the store's only run."""
    if run_id is not None:
        return session.reader(run_id)
    runs = session.runs()
    if len(runs) > 1:
        raise InputError(f"--export-kv writes one model's heads: name a run with --run ({', '.join(runs)})")
    return session.reader(runs[0])


def check_kv_score(score: str | None) -> str:
    """``score`` if a KV table can be made of it, else :class:`InputError` saying why."""
    if score is None:
        raise InputError(f"--export-kv needs --score, one of {', '.join(KV_SCORES)}")
    if score not in KV_SCORES:
        why = "is not a field score" if score not in _BY_NAME else "does not say which heads need distant keys"
        raise InputError(f"--score {score} {why}; a KV table takes one of {', '.join(KV_SCORES)}")
    return score


def kv_scores(session: StoreSession, score: str, run_id: str | None = None) -> np.ndarray:
    """(layers, kv_heads) float64 in [0, 1]: ``score`` of every query head of run ``run_id``
    of the ``session``'s store (its only run by default), the largest of a
    kv head's query heads taken (its cache serves them all, so it is kept in full if one of
    them needs it), clipped to [0, 1] (distant mass, a difference of sums, may fall a
    rounding error outside). 1 means keep the full KV cache, as in DuoAttention.

    Raises :class:`InputError` for a score no KV table takes, :class:`GroupNotFoundError`
    when the run lacks the group that holds it or the score is undefined there."""
    check_kv_score(score)
    run = _kv_run(session, run_id)
    spec = _BY_NAME[score]
    values = run_scores(*open_groups(run)).get(score)
    if values is None and spec.group == HEAD_SCORES:
        raise GroupNotFoundError(f"run {run.id} has no {score}: {why_no_head_scores(run.provenance, run.url, run.id)}")
    if values is None:
        raise GroupNotFoundError(f"run {run.id} has no {score}: no {DETECT}/{DETECT_GROUP} "
                                 f"(run `{stage_command('detect', run.url, run.id)}`)")
    x = values.values
    if not np.isfinite(x).any():
        length = run.provenance.get("context_length", "?")
        raise GroupNotFoundError(f"{score} is undefined for every head of run {run.id} (L = {length}; distant mass "
                                 f"at window W needs L > 2W)")
    head_kv = np.asarray(run.provenance["layout"]["head_kv"])
    kv = np.stack([np.nanmax(x[:, head_kv == k], axis=1) for k in range(int(head_kv.max()) + 1)], axis=1)
    return np.clip(kv, 0.0, 1.0)


TABLE_SUFFIXES = (".csv", ".parquet")


def check_path(path: str | Path, option: str, suffixes: Sequence[str]) -> Path:
    """``path`` if its suffix is one of ``suffixes`` and the nearest of its folders that
    exists is a folder (the others are made as it is written), else :class:`InputError`
    naming ``option``; creates nothing."""
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise InputError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder")
    above = path.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise InputError(f"{option} {path} cannot be written ({above} is a file, not a folder)")
    return path


def _writing(path: Path, option: str):
    """``path`` opened for writing, its folders made first."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("wb")
    except OSError as exc:
        raise InputError(f"{option} {path} cannot be written ({exc.strerror or exc})") from exc


def write_table(frame: pd.DataFrame, path: str | Path) -> Path:
    """``frame`` as CSV or Parquet, by ``path``'s suffix (``.csv``, ``.parquet``)."""
    path = check_path(path, "--export", TABLE_SUFFIXES)
    with _writing(path, "--export") as f:
        if path.suffix.lower() == ".csv":
            frame.to_csv(f, index=False)
        else:
            frame.to_parquet(f, index=False)
    return path


def write_kv(kv: np.ndarray, path: str | Path) -> Path:
    """``kv`` (layers, kv_heads) as DuoAttention writes ``full_attention_heads.tsv``
    (``numpy.savetxt``, tab-separated, ``%.18e``, no header): a layer per line."""
    path = check_path(path, "--export-kv", (".tsv",))
    with _writing(path, "--export-kv") as f:
        np.savetxt(f, np.asarray(kv, dtype=np.float64), delimiter="\t")
    return path


def share(part: int, whole: int) -> float:
    """``part`` of ``whole`` in percent; NaN of nothing."""
    return 100.0 * part / whole if whole else math.nan


def regimes_of(heads: xr.Dataset) -> np.ndarray:
    """The regime names (layer, head) of an ``analysis/heads`` group as a str object array."""
    regime = heads["regime"].transpose("layer", "head")
    return np.asarray([str(x) for x in np.asarray(regime.values).ravel()], dtype=object).reshape(regime.shape)


def class_counts(regimes: np.ndarray, passes: np.ndarray) -> dict[str, int]:
    """How many heads of each regime (REGIMES order) are of the class ``passes``."""
    return {name: int(np.sum(passes & (regimes == name))) for name in REGIMES}
