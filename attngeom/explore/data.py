"""What the explorer reads from a store: one run's head table, its chosen sequences and their
decoded tokens, and per layer the arrays a head's page needs.

Analysis and ablation groups may be absent; they are ``None`` here and the page says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from attngeom.analyze.parameters import default_n_grid
from attngeom.errors import RunNotFoundError
from attngeom.detect.head_classes import DETECT, DETECT_GROUP, open_groups, why_no_head_scores
from attngeom.store.objects.commands import stage_command
from attngeom.store import ABLATION, ANALYSIS, RunLayout, query_attendable
from attngeom.store.session import RunReader, StoreSession

# Per-sequence top-N curves a head's page draws: the head's own, the random control, the bounds.
CURVES = (
    "precision", "recall", "f_score",
    "random_precision", "random_recall", "random_f_score",
    "precision_bound", "recall_bound", "precision_bound_q95", "recall_bound_q95",
)


@dataclass
class ExploreRun:
    """One run as the explorer sees it: identity, shape, chosen sequences, optional groups."""

    run_id: str
    provenance: dict[str, Any]
    reader: RunReader                       # the run in the store
    layout: RunLayout
    sequences: np.ndarray                   # chosen committed sequence ids
    n_grid: list[int]
    heads: xr.Dataset | None = None         # analysis/heads (layer, head)
    summary: xr.Dataset | None = None       # analysis/summary (stat, layer, head, n)
    topn: xr.Dataset | None = None          # analysis/topn (seq, layer, head, n), lazy
    taxonomy: xr.Dataset | None = None      # analysis/taxonomy (seq, layer, head, vote), lazy
    by_query: xr.Dataset | None = None      # analysis/topn_by_query (seq, layer, head, query_pos, n), lazy
    ablation: xr.Dataset | None = None      # ablation/single (layer, head[, seq])
    head_scores: xr.Dataset | None = None   # analysis/head_scores (layer, head[, recent])
    detect: xr.Dataset | None = None        # detect/scores (layer, head)
    notes: list[str] = field(default_factory=list)
    field_missing: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return str(self.provenance.get("model", {}).get("id") or "?")

    @property
    def dataset(self) -> str:
        return str(self.provenance.get("dataset", {}).get("id") or "?")

    @property
    def compute_dtype(self) -> str:
        """The dtype the model computed in at extract (bfloat16 and float32 runs differ)."""
        return str(self.provenance.get("compute_dtype") or "?")


def open_runs(store: str, run_id: str | None, sequences: int) -> list[ExploreRun]:
    """The run ``run_id`` (every run when None) with its first ``sequences`` committed
    sequences, read through one :class:`~attngeom.store.session.StoreSession`. Raises
    StoreNotFoundError (no store), SchemaError (not one this attngeom reads) or
    RunNotFoundError (no such run, no run at all, or a run with no sequence)."""
    with StoreSession(store) as session:
        if run_id is not None:
            return [_open_run(session.reader(run_id, check="full"), sequences)]
        return [_open_run(run, sequences) for run in session.readers(check="full")]


def _open_run(reader: RunReader, sequences: int) -> ExploreRun:
    done = reader.completed()
    if done.size == 0:
        raise RunNotFoundError(f"run '{reader.id}' in {reader.url} has no complete sequence yet")
    layout = reader.layout
    run = ExploreRun(reader.id, reader.provenance, reader, layout, done[:sequences], default_n_grid(layout.length))
    for name in ("heads", "summary"):
        ds = reader.derived(ANALYSIS, name, missing_ok=True)
        setattr(run, name, ds.load() if ds is not None else None)
    run.topn = reader.derived(ANALYSIS, "topn", missing_ok=True)
    run.taxonomy = reader.derived(ANALYSIS, "taxonomy", missing_ok=True)
    run.by_query = reader.derived(ANALYSIS, "topn_by_query", missing_ok=True)
    run.ablation = reader.derived(ABLATION, "single", missing_ok=True)
    if run.topn is not None:
        run.n_grid = [int(n) for n in run.topn["n"].values]
        analyzed = set(run.topn["seq"].values.tolist())
        missing = [int(s) for s in run.sequences if int(s) not in analyzed]
        if missing:
            run.notes.append(f"sequences {missing} were committed after the analysis: their curves are "
                             f"missing (run `{stage_command('analyze', reader.url, reader.id)}`)")
    else:
        run.notes.append(f"no analysis (run `{stage_command('analyze', reader.url, reader.id)}`): no regimes, "
                         "no curves; precision and "
                         "recall are computed here from the picture's distances")
    if run.ablation is None:
        run.notes.append(f"no ablation (run `{stage_command('ablate', reader.url, reader.id)}`): no delta NLL")
    run.head_scores, run.detect = open_groups(reader)
    if run.head_scores is None:
        run.field_missing.append(f"{why_no_head_scores(run.provenance, reader.url, reader.id)}: no sink, previous-token or "
                                 "distant-mass scores")
    if run.detect is None:
        run.field_missing.append(f"no {DETECT}/{DETECT_GROUP} (run `{stage_command('detect', reader.url, reader.id)}`): "
                                 "no duplicate-token, "
                                 "induction or retrieval scores")
    return run


@dataclass(frozen=True)
class LayerData:
    """One layer of the chosen sequences, in memory: attn (S, H, K), values (S, KV, K, D),
    attendable (K,), and the analysis rows of those sequences (None without analysis); for a
    run extracted with queries, the stored queries' rows (S, H, Q, K) and their topn_by_query
    rows (None without them)."""

    attn: np.ndarray
    values: np.ndarray
    attendable: np.ndarray
    curves: xr.Dataset | None
    votes: xr.DataArray | None
    query_rows: np.ndarray | None = None
    query_curves: xr.Dataset | None = None

    def at_query(self, q: int, i: int) -> LayerData:
        """The layer as query ``q`` (the i-th stored one) sees it: its rows, keys 0..q and
        their mask (docs/method.md#any-query), and its topn_by_query rows."""
        assert self.query_rows is not None
        curves = None if self.query_curves is None else self.query_curves.isel(query_pos=i)
        return LayerData(self.query_rows[:, :, i, : q + 1], self.values[:, :, : q + 1],
                         query_attendable(self.attendable, q), curves, self.votes)


def read_layer(run: ExploreRun, layer: int) -> LayerData:
    """The arrays of ``layer`` for the run's chosen sequences (one store chunk per sequence)."""
    seqs, reader = run.sequences, run.reader
    with reader.reading():
        attn = np.stack([reader.array("attn_last")[int(s), layer] for s in seqs])
        values = np.stack([reader.chunk("values", (int(s), layer)) for s in seqs])
        query_rows = (np.stack([reader.array("attn_rows")[int(s), layer] for s in seqs])
                      if reader.has("attn_rows") else None)
    curves = votes = query_curves = None
    if run.topn is not None:
        present = [int(s) for s in seqs if int(s) in set(run.topn["seq"].values.tolist())]
        curves = run.topn[list(CURVES)].isel(layer=layer).sel(seq=present).load()
    if run.taxonomy is not None and "votes" in run.taxonomy:
        present = [int(s) for s in seqs if int(s) in set(run.taxonomy["seq"].values.tolist())]
        votes = run.taxonomy["votes"].isel(layer=layer).sel(seq=present).load()
    if query_rows is not None and run.by_query is not None:
        present = [int(s) for s in seqs if int(s) in set(run.by_query["seq"].values.tolist())]
        query_curves = run.by_query[list(CURVES)].isel(layer=layer).sel(seq=present).load()
    return LayerData(attn, values, reader.array("attendable")[layer], curves, votes, query_rows, query_curves)


def read_tokens(run: ExploreRun) -> np.ndarray:
    """Token ids (S, L) of the chosen sequences."""
    with run.reader.reading():
        return np.stack([run.reader.array("tokens")[int(s)] for s in run.sequences])


def token_decoder(provenance: dict[str, Any]) -> tuple[Callable[[np.ndarray], list[list[str]]] | None, str]:
    """A function decoding token ids (S, L) one by one with the run's tokenizer, from local
    files only (never the weights, never the network), and how it was found; None when the
    tokenizer cannot be loaded here, with the reason.

    A GGUF model's tokenizer is read from the folder extract converted it into, when it is
    still cached: parsing the GGUF again took 31 s of a 37 s explore (smollm2-135m). A
    tokenizer given to extract in place of the model's is read from where it was loaded from;
    a model folder holding none has none (transformers would build an empty stand-in)."""
    from attngeom.extract.tokenizing import holds_tokenizer

    model, recorded = provenance.get("model", {}), provenance.get("tokenizer", {})
    if recorded is None:
        return None, "the run was extracted from token ids without a tokenizer"
    path, gguf = model.get("path"), model.get("gguf_file")
    where = recorded.get("name_or_path") if isinstance(recorded, dict) else None
    if where and Path(where).is_dir() and holds_tokenizer(Path(where)):
        path, gguf = where, None
    if not path:
        return None, "the run's provenance names no model path"
    if not gguf and Path(path).is_dir() and not holds_tokenizer(Path(path)):
        return None, f"{path} holds no tokenizer"
    kwargs = {"gguf_file": gguf} if gguf else {}
    if gguf and model.get("file_sha256"):
        from attngeom.extract.gguf_files import converted_path

        converted = converted_path(gguf, model["file_sha256"])
        if (converted / "tokenizer_config.json").is_file():
            path, kwargs = str(converted), {}
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- any failure means "show ids"
        return None, f"tokenizer of {model.get('id', path)} not loadable here ({type(exc).__name__})"

    def decode(ids: np.ndarray) -> list[list[str]]:
        # Each distinct id once: a window repeats many of its tokens.
        distinct, where = np.unique(ids, return_inverse=True)
        text = np.asarray([tokenizer.decode([int(i)]) for i in distinct], dtype=object)
        return text[where.reshape(ids.shape)].tolist()

    return decode, f"decoded with the tokenizer of {model.get('id', path)}"
