"""A store from Python (docs/api.md#reading-a-store): :func:`open_store`, its runs, and their groups as lazy Datasets.

Reading needs neither torch nor the model; :meth:`Run.text` alone loads a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from attngeom.errors import GroupNotFoundError, InputError
from attngeom.store import (
    ABLATION,
    ABLATION_GROUPS,
    ANALYSIS,
    ANALYSIS_GROUPS,
    DETECT,
    DETECT_GROUPS,
    QUERY_GROUPS,
    SCORE_GROUPS,
    lacking_message,
    lacking_summaries,
)
from attngeom.store.session import RunReader, StoreSession

__all__ = ["Run", "Store", "open_store"]


def open_store(url: str | Path) -> Store:
    """The attngeom store at ``url`` (a local path or an fsspec URL).

    Raises :class:`StoreNotFoundError` when there is none, :class:`SchemaError` when it is
    not one this attngeom reads.
    """
    return Store(str(url))


@dataclass(frozen=True)
class Store:
    """An attngeom store, opened once (one :class:`~attngeom.store.session.StoreSession`,
    which its runs read through); nothing else is read until asked."""

    url: str
    _session: StoreSession = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_session", StoreSession.reading(self.url))

    @property
    def runs(self) -> list[str]:
        """Ids of the store's runs, sorted."""
        return self._session.runs(missing_ok=True)

    def run(self, run_id: str) -> Run:
        """The run ``run_id``; raises :class:`RunNotFoundError` (naming the runs there are)."""
        return Run(self.url, run_id, _reader=self._session.reader(run_id))


@dataclass(frozen=True)
class Run:
    """One run: a model over one input at one context length (docs/store.md#layout)."""

    url: str
    id: str
    _tokenizers: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _reader: RunReader | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._reader is None:
            object.__setattr__(self, "_reader", StoreSession.reading(self.url).reader(self.id))

    @property
    def provenance(self) -> dict[str, Any]:
        """Model, tokenizer, dataset, window rule, L, dtypes, versions, command line."""
        return self._reader.provenance

    def sequences(self) -> np.ndarray:
        """Indices (S,) of the committed sequences, sorted."""
        return self._reader.check("arrays").completed()

    def dataset(self) -> xr.Dataset:
        """The committed sequences as a lazy Dataset, ``seq`` labelled by sequence index:
        tokens (seq, pos), values (seq, layer, kv_head, pos, head_dim), attn_last (seq,
        layer, head, key), winner and the per-query summaries (seq, layer, head, query)."""
        return self._reader.check("arrays").dataset()
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

    def _group(self, kind: str, groups: tuple[str, ...], name: str) -> xr.Dataset:
        """A derived group, read only once its writer committed it (GroupNotFoundError when
        it was never written, IncompleteGroupError while its writer is interrupted)."""
        if name not in groups:
            raise InputError(f"{kind} has no group {name!r} (groups: {', '.join(groups)})")
        return self._reader.derived(kind, name)

    def text(self, seq: int, tokenizer: Any = None) -> str:
        """Sequence ``seq`` decoded, BOS included, with ``tokenizer`` or else the run's own
        (loaded from its model's name or path; a run of a model given in memory needs
        ``tokenizer`` unless its tokenizer was saved where its provenance says; a run
        extracted without a tokenizer, from token ids, needs ``tokenizer``)."""
        if seq not in self._reader.completed():
            raise InputError(f"sequence {seq} of run '{self.id}' is not committed")
        if tokenizer is None and "tokenizer" in self.provenance and self.provenance["tokenizer"] is None:
            raise InputError(f"run '{self.id}' was extracted from token ids without a tokenizer (its provenance "
                             "records none): pass tokenizer= to decode its tokens")
        tokens = self._reader.sequence("tokens", seq)
        return (tokenizer or self._tokenizer()).decode(tokens.tolist())

    def _tokenizer(self) -> Any:
        if "own" not in self._tokenizers:
            self._tokenizers["own"] = _load_tokenizer(self.provenance, self.id)
        return self._tokenizers["own"]


def _load_tokenizer(provenance: dict[str, Any], run_id: str) -> Any:
    """The tokenizer a run was extracted with (:func:`attngeom.extract.tokenizing.run_tokenizer`)."""
    from attngeom.extract.tokenizing import run_tokenizer

    try:
        return run_tokenizer(provenance)
    except InputError:
        raise InputError(f"the tokenizer of run '{run_id}' cannot be loaded here: pass tokenizer=") from None
