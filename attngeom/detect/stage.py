"""The detect stage (docs/method.md#head-detectors): the field's head detectors, run with the run's model.

Loads the run's model, checked against the run's provenance as ablate does, feeds it two
sets of inputs in batches and reads every head's attention rows from the model's own
forward (the capture of :mod:`attngeom.extract.capture`: float32 rows recomputed from the
post-RoPE queries and keys, causal mask, sliding window and logit softcap as the model
applies them). Writes ``runs/<id>/detect/``:

- ``scores``    (layer, head): ``duplicate_score``, ``induction_score``, ``prev_token_score``
  from P repeated random-token probes, ``retrieval_score`` from needle-in-a-haystack samples;
- ``probes``    (probe, pos): ``probe_tokens``, the probes ``[BOS] + r + r``;
- ``retrieval`` (sample, pos): ``retrieval_tokens``, ``needle_start``, ``needle_length``,
  ``depth``, the windows each sample comes from, and ``retrieval_hits`` (sample, layer, head).

Every score can be recomputed from the stored inputs with a plain eager forward. The groups
are replaced as a whole and committed last (a killed detect leaves the earlier results, or
none, readable); a rerun with the parameters of the committed results keeps them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from attngeom.version import __version__
from attngeom.detect.inputs import Retrieval, probe_tokens, retrieval_samples, vocabulary
from attngeom.detect.request import DetectRequest, check_request, check_sequences, probe_length
from attngeom.detect.scores import probe_queries, probe_sums, retrieval_hits, retrieval_queries
from attngeom.errors import AttngeomError, InputError
from attngeom.extract.capture import capturing, decoder
from attngeom.extract.families import attention_layers
from attngeom.extract.models import resolve_dtype
from attngeom.extract.tokenizing import given_tokenizer, run_tokenizer
from attngeom.extract.placement import parse_device_map
from attngeom.options import refusal
from attngeom.extract.runcheck import check_run_model
from attngeom.extract.runmodel import evaluating, is_named, run_model
from attngeom.store import ATTR_KEY, DETECT, DETECT_GROUPS, jsonable, read_state
from attngeom.store.derived_groups.derived_read import unheld_claims
from attngeom.store.session import StoreSession

__all__ = ["DetectResult", "detect"]

PROBE_RULE = (
    "P probes [BOS] + r + r, r of k = min(128, (L-1)//2) ids drawn uniformly with replacement from the "
    "vocabulary without special tokens; over queries p in k+1..2k: duplicate_score = mean A[p, p-k], "
    "induction_score = mean A[p, p-k+1]; prev_token_score = mean A[p, p-1] over p in 1..2k"
)
RETRIEVAL_RULE = (
    "teacher-forced: haystack i (the run's i-th committed window) holds a needle of n consecutive tokens of "
    "window (i+1) % S at each depth d, first token at position 1 + round(d * (L-2n-2)), and the needle again at "
    "positions L-n..L-1; the query holding needle token m < n-1 in that final copy hits when argmax_j A[t, j] "
    "is the inserted needle's token m+1; retrieval_score = hits / ((n-1) * samples)"
)
BOS_RULE = "the run's BOS: the token every stored window begins with (the tokenizer's BOS, or extract's --bos-token)"
VOCABULARY_RULE = (
    "ids 0 .. min(len(tokenizer), embedding rows) - 1 without the tokenizer's special and added tokens and the BOS"
)
CONFIG_VOCABULARY_RULE = (
    "ids 0 .. embedding rows - 1 without the model config's bos, eos and pad ids and the BOS (the run records no "
    "tokenizer)"
)
SEEDING = "probes: numpy default_rng([seed, 0]); needle offsets: default_rng([seed, 1]), one draw per haystack"


@dataclass(frozen=True)
class DetectResult:
    """The detect groups of ``run_id`` as in-memory Datasets: ``scores`` (layer, head),
    ``probes`` (probe, pos), ``retrieval`` (sample, pos); ``kept`` when the committed results
    already had these parameters and nothing was computed; ``haystacks``: the windows used
    as haystacks, fewer than asked when the run has fewer committed."""

    run_id: str
    scores: xr.Dataset
    probes: xr.Dataset
    retrieval: xr.Dataset
    kept: bool
    seconds: float
    haystacks: int


@dataclass(frozen=True)
class _RunInputs:
    """What the run provides: its provenance, committed windows (S, L), and coordinates."""

    provenance: dict[str, Any]
    seqs: np.ndarray
    windows: np.ndarray
    layer: np.ndarray
    head: np.ndarray

    @property
    def bos(self) -> int:
        return int(self.windows[0, 0])


def detect(request: DetectRequest) -> DetectResult:
    """The field's head scores of ``request.run_id``; writes ``runs/<id>/detect`` (see
    :class:`DetectRequest` for the options), or keeps the committed results when they were
    computed with the same parameters."""
    start = time.perf_counter()
    with StoreSession(request.store, mode="a") as session:
        inputs = _read_run(request, session)
        retrieval = retrieval_samples(inputs.windows, inputs.seqs, request.haystacks, request.needle_length,
                                      request.depths, request.seed)
        params = _parameters(request, inputs, retrieval)
        kept = _kept(session, request.run_id, params, inputs.seqs)
        if kept is not None:
            return DetectResult(request.run_id, *kept, kept=True, seconds=time.perf_counter() - start,
                                haystacks=len(params["haystack_sequences"]))
        model, device, compute_dtype = run_model(request.model, inputs.provenance, request.run_id,
                                                 request.device, request.dtype,
                                                 parse_device_map(request.device_map))
        tokenizer = _run_tokenizer(request, inputs.provenance)
        vocab, vocabulary_rule = _vocabulary(tokenizer, model, inputs.bos, request.run_id)
        config = model.config.get_text_config()
        if (_layers(model), config.num_attention_heads) != (tuple(int(i) for i in inputs.layer), len(inputs.head)):
            raise InputError(
                f"model has attention layers {', '.join(map(str, _layers(model)))} x {config.num_attention_heads} "
                f"heads, run '{request.run_id}' layers {', '.join(map(str, inputs.layer))} x {len(inputs.head)}"
            )
        k = probe_length(inputs.windows.shape[1])
        probes = probe_tokens(vocab, inputs.bos, request.probes, k, request.seed)
        with evaluating(model):
            probe = _probe_scores(model, probes, k, request, device)
            hits = _retrieval_hits(model, retrieval, request, device)
        attrs = _attrs(inputs, params, vocab, vocabulary_rule, device, compute_dtype)
        groups = _assemble(inputs, probes, probe, retrieval, hits, request.needle_length, attrs)
        with session.derived(request.run_id, DETECT) as write:
            write.replace(groups, params)
    return DetectResult(request.run_id, groups["scores"], groups["probes"], groups["retrieval"], kept=False,
                        seconds=time.perf_counter() - start, haystacks=len(params["haystack_sequences"]))


def _read_run(request: DetectRequest, session: StoreSession) -> _RunInputs:
    """Check the request against the run and read its committed windows (no model)."""
    run = session.reader(request.run_id, check="committed")
    provenance = run.provenance
    check_run_model(request.model, provenance, request.run_id, "detect")
    seqs = run.completed()
    check_request(request, int(run.array("tokens").shape[1]))
    check_sequences(request.run_id, len(seqs))
    with run.reading():
        windows = run.array("tokens").get_orthogonal_selection((seqs, slice(None))).astype(np.int64)
    return _RunInputs(provenance, seqs.astype(np.int64), windows, run.array("layer")[:], run.array("head")[:])


def _parameters(request: DetectRequest, inputs: _RunInputs, retrieval: Retrieval) -> dict[str, Any]:
    """What the results depend on: a rerun with the same keeps the committed results."""
    haystacks = np.unique(retrieval.haystack).tolist()
    sources = [int(retrieval.needle_source[retrieval.haystack == h][0]) for h in haystacks]
    if request.model is None or is_named(request.model):
        dtype = resolve_dtype(request.dtype)
    else:
        dtype = next(request.model.parameters()).dtype
    return jsonable({
        "model": inputs.provenance["model"]["id"],
        "compute_dtype": str(dtype).removeprefix("torch."),
        "probes": request.probes,
        "probe_length": probe_length(inputs.windows.shape[1]),
        "needle_length": request.needle_length,
        "depths": [float(d) for d in request.depths],
        "haystack_sequences": haystacks,
        "needle_sequences": sources,
        "seed": request.seed,
        # The probes' vocabulary: a tokenizer given in place of the run's draws others.
        **({} if request.tokenizer is None else {"tokenizer": _tokenizer_name(request.tokenizer)}),
    })


def _tokenizer_name(tokenizer: Any) -> str:
    """A tokenizer given to detect, by name: as given, or where it was loaded from."""
    if is_named(tokenizer):
        return str(tokenizer)
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _kept(session: StoreSession, run_id: str, params: dict[str, Any],
          committed: np.ndarray) -> tuple[xr.Dataset, ...] | None:
    """The committed groups, in memory, when they were computed with ``params`` from the
    run's ``committed`` sequences (their record claims no other) and are whole (none of
    their objects missing or resized); else None."""
    state = read_state(session.zstore, run_id, DETECT)
    if (state.commit is None or not state.readable or state.commit.parameters != params
            or unheld_claims(state, committed.tolist())):
        return None
    try:
        run = session.reader(run_id)
        return tuple(run.derived(DETECT, name).load() for name in DETECT_GROUPS)
    except AttngeomError:  # damaged or incomplete: computed and written again
        return None


def _vocabulary(tokenizer: Any, model: torch.nn.Module, bos: int, run_id: str) -> tuple[np.ndarray, str]:
    """The ids probes draw from, and their rule: :data:`VOCABULARY_RULE`, or without a
    tokenizer :data:`CONFIG_VOCABULARY_RULE`."""
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer is None:
        config = model.config.get_text_config()
        special = [getattr(config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")]
        ids = [i for s in special for i in (s if isinstance(s, list) else [s]) if isinstance(i, int)]
        vocab, rule = vocabulary(rows, {*ids, bos}), CONFIG_VOCABULARY_RULE
    else:
        size = min(len(tokenizer), rows)
        vocab = vocabulary(size, {*tokenizer.all_special_ids, *getattr(tokenizer, "added_tokens_decoder", {}), bos})
        rule = VOCABULARY_RULE
    if len(vocab) == 0:
        raise InputError(f"the tokenizer of run '{run_id}' has no token that is not special")
    return vocab, rule


def _run_tokenizer(request: DetectRequest, provenance: dict[str, Any]) -> Any | None:
    """The tokenizer whose vocabulary the probes draw from: the request's, else the run's
    (:func:`attngeom.extract.tokenizing.run_tokenizer`); None for a run extracted without
    one, whose probes draw from the model's embedding rows."""
    if request.tokenizer is not None:
        return given_tokenizer(request.tokenizer)
    try:
        return run_tokenizer(provenance, str(request.model) if is_named(request.model) else None)
    except InputError:
        raise refusal("the tokenizer of run '{run}' cannot be loaded here: give it with {tokenizer} (a name or "
                      "folder)", DetectRequest, run=request.run_id) from None


def _attention_rows(model: torch.nn.Module, ids: np.ndarray, queries: tuple[int, ...], device: str) -> dict[int, torch.Tensor]:
    """Position of each attention layer among the run's layers -> the float32 rows (B, H, Q, L)
    of ``queries`` of a forward of ``ids`` (B, L)."""
    with torch.inference_mode(), capturing(model, queries=queries) as recorder:
        decoder(model)(input_ids=torch.from_numpy(ids).to(device), use_cache=False)
    position = {layer: p for p, layer in enumerate(_layers(model))}
    return {position[layer]: capture.query_rows for layer, capture in recorder.layers.items()}


def _batches(count: int, request: DetectRequest, desc: str) -> tqdm:
    """Slices of ``request.batch_size`` sequences over ``count``, with a progress bar."""
    size = request.batch_size
    return tqdm((slice(b0, b0 + size) for b0 in range(0, count, size)), total=-(-count // size), unit="batch",
                desc=desc, disable=not request.progress)


def _probe_scores(model: torch.nn.Module, probes: np.ndarray, k: int, request: DetectRequest,
                  device: str) -> dict[str, np.ndarray]:
    """duplicate_score, induction_score, prev_token_score (layers, heads) over the probes."""
    sums: dict[str, np.ndarray] = {}
    for batch in _batches(len(probes), request, "detect probes"):
        for layer, rows in _attention_rows(model, probes[batch], probe_queries(k), device).items():
            for name, value in probe_sums(rows, k).items():
                sums.setdefault(name, np.zeros((len(_layers(model)), rows.shape[1])))[layer] += value.cpu().numpy()
    count = {"duplicate": k, "induction": k, "prev_token": 2 * k}
    return {f"{name}_score": total / (len(probes) * count[name]) for name, total in sums.items()}


def _retrieval_hits(model: torch.nn.Module, retrieval: Retrieval, request: DetectRequest, device: str) -> np.ndarray:
    """Hits (sample, layer, head) int64 of the final copy's queries (n-1 per sample)."""
    tokens = retrieval.tokens
    queries = retrieval_queries(tokens.shape[1], request.needle_length)
    hits: np.ndarray | None = None
    for batch in _batches(len(tokens), request, "detect retrieval"):
        starts = torch.from_numpy(retrieval.needle_start[batch]).to(device)
        for layer, rows in _attention_rows(model, tokens[batch], queries, device).items():
            if hits is None:
                hits = np.zeros((len(tokens), len(_layers(model)), rows.shape[1]), dtype=np.int64)
            hits[batch, layer] = retrieval_hits(rows, starts).cpu().numpy()
    return hits


def _layers(model: torch.nn.Module) -> tuple[int, ...]:
    """The model's own indices of its softmax-attention layers: the run's layer coordinate."""
    return attention_layers(model.config.get_text_config())


def _attrs(inputs: _RunInputs, params: dict[str, Any], vocab: np.ndarray, vocabulary_rule: str, device: str,
           compute_dtype: torch.dtype) -> dict[str, Any]:
    """The protocol and parameters every detect group records."""
    return {
        ATTR_KEY: {
            **params,
            "probe_rule": PROBE_RULE,
            "retrieval_rule": RETRIEVAL_RULE,
            "bos_rule": BOS_RULE,
            "bos_token_id": inputs.bos,
            "vocabulary_rule": vocabulary_rule,
            "vocabulary_size": len(vocab),
            "seeding": SEEDING,
            "attention": "float32 rows recomputed from the model's post-RoPE queries and keys (the capture of extract)",
            "device": device,
            "compute_dtype": str(compute_dtype).removeprefix("torch."),
            "attngeom_version": __version__,
        }
    }


def _assemble(inputs: _RunInputs, probes: np.ndarray, probe: dict[str, np.ndarray], retrieval: Retrieval,
              hits: np.ndarray, n: int, attrs: dict[str, Any]) -> dict[str, xr.Dataset]:
    """The detect groups by name, each carrying the protocol attributes."""
    heads = {"layer": inputs.layer, "head": inputs.head}
    score = hits.sum(axis=0) / (len(hits) * (n - 1))
    scores = xr.Dataset(
        {**{name: (("layer", "head"), value) for name, value in probe.items()},
         "retrieval_score": (("layer", "head"), score)},
        coords=heads, attrs=attrs,
    )
    probes_ds = xr.Dataset(
        {"probe_tokens": (("probe", "pos"), probes)},
        coords={"probe": np.arange(len(probes)), "pos": np.arange(probes.shape[1])}, attrs=attrs,
    )
    retrieval_ds = xr.Dataset(
        {
            "retrieval_tokens": (("sample", "pos"), retrieval.tokens),
            "needle_start": ("sample", retrieval.needle_start),
            "needle_length": ((), np.int64(n)),
            "depth": ("sample", retrieval.depth),
            "haystack": ("sample", retrieval.haystack),
            "needle_source": ("sample", retrieval.needle_source),
            "needle_offset": ("sample", retrieval.needle_offset),
            "retrieval_hits": (("sample", "layer", "head"), hits),
        },
        coords={"sample": np.arange(len(hits)), "pos": np.arange(retrieval.tokens.shape[1]), **heads},
        attrs=attrs,
    )
    return {"scores": scores, "probes": probes_ds, "retrieval": retrieval_ds}
