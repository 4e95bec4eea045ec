"""What extract captures, built from its checked request (:class:`~attngeom.extract.request.ExtractPlan`)
before the model's weights load: the model (resolved by name, or given in memory) with its
config, tokenizer, device and dtype, and the input's windows (docs/method.md#preprocessing).

A model given in memory is used where it is and as it is, and left as it was given.
Sequence ``i`` of a run is always window ``i`` of the input, so a killed run started again
with the same command rewrites only the sequences not yet committed, and a larger
``--num-sequences`` appends.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attngeom.errors import AttngeomWarning, InputError
from attngeom.extract.corpora import Corpus, Window, iter_windows, open_corpus, select_windows
from attngeom.extract.families import supported_config
from attngeom.extract.models import (
    load_config,
    load_model,
    load_tokenizer,
    loaded_model,
    map_device,
    memory_provenance,
    model_placement,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from attngeom.extract.placement import parse_device_map
from attngeom.extract.request import ExtractPlan, ExtractRequest
from attngeom.extract.sources import ModelSource
from attngeom.extract.tokenizing import Bos, given_tokenizer, no_tokenizer
from attngeom.options import refusal

__all__ = ["Input", "Model", "corpus", "inputs", "model"]


@dataclass(frozen=True)
class Model:
    """The model to capture, before it is loaded: what the checks and provenance need."""

    name: str
    config: Any
    tokenizer: Any
    provenance: dict[str, Any]
    device: str
    dtype: torch.dtype
    load: Callable[[], torch.nn.Module]
    # float32 matmuls in TF32 inside the forward (dtype float32-tf32).
    tf32: bool = False

    @property
    def compute_dtype(self) -> str:
        """The dtype the run records: the torch dtype's name, float32-tf32 with TF32."""
        return "float32-tf32" if self.tf32 else str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Input:
    """The sequences to capture: window ``i`` is sequence ``i`` of the run. ``windows`` reads
    and tokenizes the documents, so it is called once the cheaper checks have passed."""

    id: str
    provenance: dict[str, Any]
    window_rule: dict[str, Any]
    length: int
    windows: Callable[[], list[Window]]


def model(plan: ExtractPlan) -> Model:
    """The model of the request: resolved by name (loaded later, onto the asked device) or
    given in memory (used where it is, as it is)."""
    request, shard = plan.request, plan.shard
    if not isinstance(request.model, str | os.PathLike):
        net = loaded_model(request.model)
        device, dtype = model_placement(net, request.device, request.dtype)
        provenance = memory_provenance(net)
        tokenizer = None if request.tokenizer is None else given_tokenizer(request.tokenizer)
        return Model(provenance["id"], supported_config(net.config, type(net)), tokenizer, provenance, device, dtype,
                     lambda: net, tf32=request.dtype == "float32-tf32")
    device_map = parse_device_map(request.device_map)
    device = resolve_device(request.device) if device_map is None else map_device(device_map)
    if shard is not None and device == "cuda":
        # One GPU per local rank under a launcher; all ranks share one GPU if there is one.
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', shard[0])) % torch.cuda.device_count()}"
    dtype = resolve_dtype(request.dtype)
    source = resolve_model(str(request.model))
    config = load_config(source)
    tokenizer = given_tokenizer(request.tokenizer) if request.tokenizer is not None else _own_tokenizer(request, source)
    return Model(
        source.name, config, tokenizer, source.provenance(), device, dtype,
        lambda: load_model(source, device=device, dtype=dtype, device_map=device_map),
        tf32=request.dtype == "float32-tf32",
    )


def _own_tokenizer(request: ExtractRequest, source: ModelSource) -> Any:
    """The named model's own tokenizer, or None where it has none. Token ids need none: a
    tokenizer that cannot be read is then said in a warning and left out."""
    try:
        return load_tokenizer(source)
    except InputError as exc:
        if request.token_ids is None:
            raise
        warnings.warn(AttngeomWarning(f"{exc}: extracting the token ids without it"), stacklevel=2)
        return None


def _texts_corpus(texts: Iterable[str]) -> Corpus:
    """The caller's texts as a corpus, fingerprinted by their content and order."""
    texts = list(texts)
    digest = hashlib.sha256()
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(f"texts must be strings; item {i} is a {type(text).__name__}")
        digest.update(f"{text}\0".encode())
    return Corpus("texts", None, digest.hexdigest(), lambda: texts)


def corpus(plan: ExtractPlan) -> tuple[Corpus, dict[str, Any]] | None:
    """The dataset or texts to window, and their provenance; None for token ids."""
    request = plan.request
    if request.dataset is not None:
        opened = plan.corpus or open_corpus(request.dataset, split=request.split, text_field=request.text_field)
        return opened, {"id": opened.id, "split": opened.split, "fingerprint": opened.fingerprint,
                        "text_field": request.text_field}
    if request.texts is not None:
        opened = _texts_corpus(request.texts)
        return opened, {"id": opened.id, "split": None, "fingerprint": opened.fingerprint, "text_field": None}
    return None


def inputs(plan: ExtractPlan, source: tuple[Corpus, dict[str, Any]] | None, model: Model, bos: Bos) -> Input:
    """The windows of the request's ``source`` (a dataset or texts), or its token ids as given."""
    if source is None:
        return _given(plan, model, bos)
    return _windowed(plan.request, source, model, bos.id)


def _windowed(request: ExtractRequest, source: tuple[Corpus, dict[str, Any]], model: Model, bos_id: int) -> Input:
    """Windows (docs/method.md#preprocessing) from a dataset or texts: BOS and L-1 tokens of one document."""
    if model.tokenizer is None:
        raise no_tokenizer(model.name, ExtractRequest)
    opened, provenance = source
    tokenizer, length = model.tokenizer, request.context_length

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    def windows() -> list[Window]:
        if request.num_sequences is not None:
            chosen = select_windows(
                opened, tokenize, bos_id, length, request.num_sequences, rule=request.window_rule, seed=request.seed
            )
        else:
            chosen = list(iter_windows(opened, tokenize, bos_id, length, rule=request.window_rule, seed=request.seed))
            if not chosen:
                raise InputError(f"no text holds the {length - 1:,} tokens a window of L = {length:,} needs")
        _check_vocabulary(chosen, model.config.vocab_size)
        return chosen

    return Input(opened.id, provenance, {"rule": request.window_rule, "seed": request.seed}, length, windows)


def _check_vocabulary(windows: list[Window], vocab: int) -> None:
    """Refuse windows holding ids beyond the model's vocabulary: a tokenizer not the model's."""
    top = max(int(w.tokens.max()) for w in windows)
    if top >= vocab:
        raise refusal("the tokenizer gives token id {top}, outside the model's vocabulary [0, {vocab}): give the "
                      "model's own tokenizer with {tokenizer}", ExtractRequest, top=top, vocab=vocab)


def _given(plan: ExtractPlan, model: Model, bos: Bos) -> Input:
    """token_ids (S, L) as given: integers of the vocabulary, BOS at position 0."""
    request, ids = plan.request, plan.token_ids
    n_seq, length = ids.shape
    if length < 2:
        raise refusal("{token_ids!s} need at least 2 positions (BOS and one token)", ExtractRequest)
    if request.context_length is not None and request.context_length != length:
        raise refusal("{context_length:{asked}} differs from the length of {token_ids!s}, {length}", ExtractRequest,
                      asked=request.context_length, length=length)
    count = n_seq if request.num_sequences is None else request.num_sequences
    if count > n_seq:
        raise refusal("{num_sequences:{count}} is more than the {rows} rows of {token_ids!s}", ExtractRequest,
                      count=count, rows=n_seq)
    vocab = model.config.vocab_size
    outside = np.flatnonzero(((ids < 0) | (ids >= vocab)).any(axis=1))
    if outside.size:
        raise refusal("{token_ids!s} rows {rows} hold ids outside the vocabulary [0, {vocab})", ExtractRequest,
                      rows=_row_list(outside), vocab=vocab)
    no_bos = np.flatnonzero(ids[:, 0] != bos.id)
    if no_bos.size:
        raise refusal("{token_ids!s} rows {rows} do not start with the BOS token {bos} ({source}; position 0 is BOS: "
                      "docs/method.md#preprocessing)", ExtractRequest, rows=_row_list(no_bos), bos=bos.id,
                      source=bos.source)
    digest = hashlib.sha256(f"{ids.shape}".encode())
    digest.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    provenance = {"id": "token_ids", "split": None, "fingerprint": digest.hexdigest(), "text_field": None}
    windows = [Window(doc_index=i, start=0, tokens=ids[i].astype(np.int32)) for i in range(count)]
    return Input("token_ids", provenance, {"rule": "given", "seed": None}, length, lambda: windows)


def _row_list(rows: np.ndarray, shown: int = 10) -> str:
    text = ", ".join(str(int(r)) for r in rows[:shown])
    return text + (f" and {rows.size - shown} more" if rows.size > shown else "")
