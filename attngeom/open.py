"""A store from Python (docs/api.md#reading-a-store): :func:`open_store`, its runs, and their groups as lazy Datasets.

Reading needs neither torch nor the model; :meth:`Run.text` alone loads a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr

from attngeom.errors import AttngeomError, GroupNotFoundError, InputError
from attngeom.store import (
    ABLATION,
    ABLATION_GROUPS,
    ANALYSIS,
    ANALYSIS_GROUPS,
    DETECT,
    DETECT_GROUPS,
    QUERY_GROUPS,
    SCORE_GROUPS,
    check_arrays,
    completed,
    damaged_chunk,
    lacking_message,
    lacking_summaries,
    lost_objects,
    open_dataset,
    open_derived,
    open_root,
    open_run_group,
    require_run,
    run_ids,
    run_path,
    run_provenance,
)

__all__ = ["Run", "Store", "open_store"]


def open_store(url: str | Path) -> Store:
    """The attngeom store at ``url`` (a local path or an fsspec URL).

    Raises :class:`StoreNotFoundError` when there is none, :class:`SchemaError` when it is
    not one this attngeom reads.
    """
    url = str(url)
    open_root(url)
    return Store(url)


@dataclass(frozen=True)
class Store:
    """An attngeom store; nothing is read until asked."""

    url: str

    @property
    def runs(self) -> list[str]:
        """Ids of the store's runs, sorted."""
        return run_ids(open_root(self.url))

    def run(self, run_id: str) -> Run:
        """The run ``run_id``; raises :class:`RunNotFoundError` (naming the runs there are)."""
        require_run(open_root(self.url), run_id, self.url)
        return Run(self.url, run_id)


@dataclass(frozen=True)
class Run:
    """One run: a model over one input at one context length (docs/store.md#layout)."""

    url: str
    id: str
    _tokenizers: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def provenance(self) -> dict[str, Any]:
        """Model, tokenizer, dataset, window rule, L, dtypes, versions, command line."""
        return run_provenance(open_root(self.url), self.id)

    def sequences(self) -> np.ndarray:
        """Indices (S,) of the committed sequences, sorted."""
        return completed(self._checked())

    def dataset(self) -> xr.Dataset:
        """The committed sequences as a lazy Dataset, ``seq`` labelled by sequence index:
        tokens (seq, pos), values (seq, layer, kv_head, pos, head_dim), attn_last (seq,
        layer, head, key), winner and the per-query summaries (seq, layer, head, query)."""
        run = self._checked()
        done = completed(run)
        ds = open_dataset(self.url, run_path(self.id), lost=lost_objects(run))
        return ds.isel(seq=done).assign_coords(seq=("seq", done.astype("int64")))

    def analysis(self, name: str) -> xr.Dataset:
        """The lazy Dataset of ``analysis/<name>``: "topn" (seq, layer, head, n), "values",
        "taxonomy", "heads" (layer, head), "summary", "signatures" or "table"; for a run
        extracted with ``queries``, "topn_by_query" (seq, layer, head, query_pos, n) and
        "summary_by_query" (stat, layer, head, query_pos, n); "head_scores" (layer, head[,
        recent]), the field's head scores, and "sequence_scores" (seq, layer, head[, recent]),
        those of each sequence (:class:`GroupNotFoundError` for a run migrated from a format
        before their summaries)."""
        if name in SCORE_GROUPS:
            lacking = lacking_summaries(self.provenance)
            if lacking:
                raise GroupNotFoundError(lacking_message(self.id, lacking))
        return self._group(ANALYSIS, (*ANALYSIS_GROUPS, *QUERY_GROUPS, *SCORE_GROUPS), name)

    def ablation(self, name: str) -> xr.Dataset:
        """The lazy Dataset of ``ablation/<name>``: "single" (layer, head[, seq]), "sweep"
        (method, retention, ...), "correlations", "critical", "table" or "regimes"."""
        return self._group(ABLATION, ABLATION_GROUPS, name)

    def detect(self, name: str = "scores") -> xr.Dataset:
        """The lazy Dataset of ``detect/<name>`` (docs/method.md#head-detectors): "scores"
        (layer, head) holds duplicate_score, induction_score, prev_token_score and
        retrieval_score; "probes" (probe, pos) the probe_tokens; "retrieval" (sample, pos)
        the retrieval_tokens, needle_start, needle_length, depth and retrieval_hits."""
        return self._group(DETECT, DETECT_GROUPS, name)

    def _checked(self) -> zarr.Group:
        """The run's group, once its arrays' metadata agree with its records (:class:`DamagedStoreError`
        names the first that does not)."""
        run = open_run_group(open_root(self.url), self.id)
        check_arrays(self.url, run, self.id)
        return run

    def _group(self, kind: str, groups: tuple[str, ...], name: str) -> xr.Dataset:
        """A derived group, read only once its writer committed it (GroupNotFoundError when
        it was never written, IncompleteGroupError while its writer is interrupted)."""
        if name not in groups:
            raise InputError(f"{kind} has no group {name!r} (groups: {', '.join(groups)})")
        return open_derived(self.url, self.id, kind, name)

    def text(self, seq: int, tokenizer: Any = None) -> str:
        """Sequence ``seq`` decoded, BOS included, with ``tokenizer`` or else the run's own
        (loaded from its model's name or path; a run of a model given in memory needs
        ``tokenizer`` unless its tokenizer was saved where its provenance says)."""
        run = open_run_group(open_root(self.url), self.id)
        if not 0 <= seq < run["complete"].shape[0] or run["complete"][seq] != 1:
            raise InputError(f"sequence {seq} of run '{self.id}' is not committed")
        for index, why in lost_objects(run).get("tokens", {}).items():
            if index[0] == seq:
                raise damaged_chunk(self.url, run["tokens"], index, why)
        tokens = run["tokens"][seq]
        return (tokenizer or self._tokenizer()).decode(tokens.tolist())

    def _tokenizer(self) -> Any:
        if "own" not in self._tokenizers:
            self._tokenizers["own"] = _load_tokenizer(self.provenance, self.id)
        return self._tokenizers["own"]


def _load_tokenizer(provenance: dict[str, Any], run_id: str) -> Any:
    """The tokenizer a run was extracted with, from its model's name or path, or from the
    tokenizer's own ``name_or_path`` for a model given in memory."""
    model = provenance.get("model") or {}
    try:
        if model.get("source") != "memory" and "id" in model:
            from attngeom.extract.models import load_tokenizer, resolve_model

            return load_tokenizer(resolve_model(model["id"]))
        where = (provenance.get("tokenizer") or {}).get("name_or_path")
        if where:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(where)
    except (AttngeomError, OSError, ValueError):
        pass
    raise InputError(f"the tokenizer of run '{run_id}' cannot be loaded here: pass tokenizer=")
