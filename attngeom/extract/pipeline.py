"""The extract stage: one pass of the model over equalized windows into the store
(docs/method.md#preprocessing, docs/store.md).

Everything that can be refused is checked before the store is touched: the store path, the
model, the tokenizer's BOS, the input (a corpus and its number of usable documents, the
caller's texts, or the caller's token ids and their BOS), and an existing run's identity.
A model given in memory is used where it is and as it is, and left as it was given.
Sequence ``i`` of a run is always window ``i`` of the input, so a killed run started again
with the same command rewrites only the sequences not yet committed, and a larger
``--num-sequences`` appends.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from attngeom.version import __version__
from attngeom.errors import AttngeomWarning, InputError, UnsupportedModelError
from attngeom.extract.capture import (
    ATTN_IMPLEMENTATION,
    LayerCapture,
    output_description,
    capturing,
    decoder,
)
from attngeom.extract.conformance import check_capture, check_positions, refuse_disagreement
from attngeom.extract.corpora import Corpus, Window, iter_windows, open_corpus, select_windows
from attngeom.extract.models import (
    ModelSource,
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
from attngeom.extract.families import VERIFIED_TYPES, check_recorded, supported_config
from attngeom.extract.tokenizing import Bos, bos_token_id, given_tokenizer, no_tokenizer
from attngeom.extract.layer_widths import layer_shapes, widened
from attngeom.extract.phases import phase, phased
from attngeom.extract.placement import parse_device_map
from attngeom.extract.positions import check_context_length, config_positions
from attngeom.extract.queries import query_positions
from attngeom.options import refusal
from attngeom.extract.request import (
    ExtractRequest,
    ExtractResult,
    Preflight,
    check_identity,
    preflight,
    values_dtype_refusal,
)
from attngeom.store import RUN_ID_PATTERN, RunLayout, default_run_id, jsonable
from attngeom.store.extracted.run_write import Begun
from attngeom.store.extracted.runs import IN_FLIGHT
from attngeom.store.objects.schema import BFLOAT16
from attngeom.store.session import StoreSession

@dataclass(frozen=True)
class _Model:
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
class _Input:
    """The sequences to capture: window ``i`` is sequence ``i`` of the run. ``windows`` reads
    and tokenizes the documents, so it is called once the cheaper checks have passed."""

    id: str
    provenance: dict[str, Any]
    window_rule: dict[str, Any]
    length: int
    windows: Callable[[], list[Window]]


def _library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "zarr", "numcodecs", "numpy", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def _values_dtype(asked: str, model: _Model, prov: dict[str, Any] | None) -> str:
    """The values' storage dtype: as asked, or for "auto" the one the run holds, else
    bfloat16 for a bfloat16 model (2 bytes, exact) and float32 for any other."""
    if asked == "auto":
        if prov is not None:
            return prov.get("values_dtype", "float32")
        return BFLOAT16 if model.dtype == torch.bfloat16 else "float32"
    if asked == BFLOAT16 and model.dtype != torch.bfloat16:
        raise InputError(values_dtype_refusal(model.compute_dtype))
    return asked


def _model(request: ExtractRequest, shard: tuple[int, int] | None) -> _Model:
    """The model of the request: resolved by name (loaded later, onto the asked device) or
    given in memory (used where it is, as it is)."""
    if not isinstance(request.model, str | os.PathLike):
        model = loaded_model(request.model)
        device, dtype = model_placement(model, request.device, request.dtype)
        provenance = memory_provenance(model)
        name = provenance["id"]
        tokenizer = None if request.tokenizer is None else given_tokenizer(request.tokenizer)
        return _Model(name, supported_config(model.config, type(model)), tokenizer, provenance, device, dtype, lambda: model,
                      tf32=request.dtype == "float32-tf32")
    device_map = parse_device_map(request.device_map)
    device = resolve_device(request.device) if device_map is None else map_device(device_map)
    if shard is not None and device == "cuda":
        # One GPU per local rank under a launcher; all ranks share one GPU if there is one.
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', shard[0])) % torch.cuda.device_count()}"
    dtype = resolve_dtype(request.dtype)
    source = resolve_model(str(request.model))
    config = load_config(source)
    tokenizer = given_tokenizer(request.tokenizer) if request.tokenizer is not None else _own_tokenizer(request, source)
    return _Model(
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


def _corpus(request: ExtractRequest) -> tuple[Corpus, dict[str, Any]] | None:
    """The dataset or texts to window, and their provenance; None for token ids."""
    if request.dataset is not None:
        corpus = open_corpus(request.dataset, split=request.split, text_field=request.text_field)
        return corpus, {"id": corpus.id, "split": corpus.split, "fingerprint": corpus.fingerprint,
                        "text_field": request.text_field}
    if request.texts is not None:
        corpus = _texts_corpus(request.texts)
        return corpus, {"id": corpus.id, "split": None, "fingerprint": corpus.fingerprint, "text_field": None}
    return None


def _windowed(request: ExtractRequest, source: tuple[Corpus, dict[str, Any]], model: _Model, bos_id: int) -> _Input:
    """Windows (docs/method.md#preprocessing) from a dataset or texts: BOS and L-1 tokens of one document."""
    if model.tokenizer is None:
        raise no_tokenizer(model.name, ExtractRequest)
    corpus, provenance = source
    tokenizer, length = model.tokenizer, request.context_length

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    def windows() -> list[Window]:
        if request.num_sequences is not None:
            chosen = select_windows(
                corpus, tokenize, bos_id, length, request.num_sequences, rule=request.window_rule, seed=request.seed
            )
        else:
            chosen = list(iter_windows(corpus, tokenize, bos_id, length, rule=request.window_rule, seed=request.seed))
            if not chosen:
                raise InputError(f"no text holds the {length - 1:,} tokens a window of L = {length:,} needs")
        _check_vocabulary(chosen, model.config.vocab_size)
        return chosen

    return _Input(corpus.id, provenance, {"rule": request.window_rule, "seed": request.seed}, length, windows)


def _check_vocabulary(windows: list[Window], vocab: int) -> None:
    """Refuse windows holding ids beyond the model's vocabulary: a tokenizer not the model's."""
    top = max(int(w.tokens.max()) for w in windows)
    if top >= vocab:
        raise refusal("the tokenizer gives token id {top}, outside the model's vocabulary [0, {vocab}): give the "
                      "model's own tokenizer with {tokenizer}", ExtractRequest, top=top, vocab=vocab)


def _token_array(given: Any) -> np.ndarray:
    """The caller's token ids as an integer array (S, L)."""
    ids = given.cpu().numpy() if isinstance(given, torch.Tensor) else np.asarray(given)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"token_ids must be an integer array (S, L); got {ids.dtype} of shape {ids.shape}")
    return ids


def _given(request: ExtractRequest, ids: np.ndarray, model: _Model, bos: Bos) -> _Input:
    """token_ids (S, L) as given: integers of the vocabulary, BOS at position 0."""
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
    return _Input("token_ids", provenance, {"rule": "given", "seed": None}, length, lambda: windows)


def _row_list(rows: np.ndarray, shown: int = 10) -> str:
    text = ", ".join(str(int(r)) for r in rows[:shown])
    return text + (f" and {rows.size - shown} more" if rows.size > shown else "")


def _layout(config: Any, captures: dict[int, LayerCapture], request: ExtractRequest, length: int,
            queries: tuple[int, ...], values_dtype: str) -> RunLayout:
    layers = check_recorded(config, list(captures))
    n_kv, head_dim, layer_kv_heads, layer_head_dims = layer_shapes(
        {l: captures[l].values for l in layers}, {l: captures[l].attn_last.shape[1] for l in layers})
    n_heads = captures[layers[0]].attn_last.shape[1]
    attendable = [captures[layer].attendable.cpu().numpy().astype(bool) for layer in layers]
    window = [int(a.sum()) if a.sum() < length else 0 for a in attendable]
    return RunLayout(
        n_layers=len(layers),
        layers=layers,
        # A model may give learned sinks to some layers only (MiMo-V2-Flash's sliding ones).
        learned_sinks=any(captures[l].learned_sink is not None for l in layers),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        length=length,
        head_kv=tuple(h // (n_heads // n_kv) for h in range(n_heads)),
        window=tuple(window),
        attendable=tuple(tuple(bool(x) for x in a) for a in attendable),
        layer_kv_heads=layer_kv_heads,
        layer_head_dims=layer_head_dims,
        values_dtype=values_dtype,
        store_rows=request.store_rows,
        queries=queries,
    )


@contextlib.contextmanager
def _matmul_precision(tf32: bool) -> Iterator[None]:
    """Within the block, float32 matmuls in TF32 when ``tf32`` (torch's "high" precision: on
    a GPU with tensor cores; a CPU computes as before), the caller's precision restored after.
    Every float32 matmul of the forward, the recomputed attention rows included."""
    if not tf32:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def _capturing(model: torch.nn.Module, *, keep_rows: bool, queries: tuple[int, ...],
               tf32: bool = False) -> Iterator[Callable[[torch.Tensor], dict[int, LayerCapture]]]:
    """Within the block, ``record(ids)`` runs the model's decoder on ids (B, L) in eval mode
    with the capture attention and returns every layer's :class:`LayerCapture` in host memory
    (copied from a GPU layer by layer while the next layers run), float32 matmuls in TF32
    when ``tf32``. The model's
    own attention implementation (restored by :func:`capturing` after each forward) and its
    train/eval mode are left as they were given, whatever happens."""
    training = model.training
    model.eval()

    def record(ids: torch.Tensor) -> dict[int, LayerCapture]:
        with torch.inference_mode(), _matmul_precision(tf32), capturing(model, keep_rows=keep_rows, queries=queries,
                                                                        to_host=True) as recorder:
            with phase("attngeom.forward"):
                decoder(model)(input_ids=ids, use_cache=False)
        return recorder.host_layers()

    try:
        yield record
    finally:
        model.train(training)


def _sequence_arrays(
    captures: dict[int, LayerCapture], b: int, window: Window, layout: RunLayout
) -> dict[str, np.ndarray]:
    layers = layout.layer_indices

    # The stack is a fresh array: converting it copies only where the dtype changes (a values
    # array is 24 MB a sequence for smollm2-135m at L=1024).
    def stack(name: str, dtype: str) -> np.ndarray:
        return torch.stack([getattr(captures[l], name)[b] for l in layers]).cpu().numpy().astype(dtype, copy=False)

    arrays = {
        "tokens": window.tokens.astype("int32"),
        "values": _stored_values(torch.stack([widened(captures[l].values[b], layout.n_kv_heads, layout.head_dim)
                                              for l in layers]), layout.values_dtype),
        "attn_last": stack("attn_last", "float32"),
        "winner": stack("winner", layout.winner_dtype),
        "sink_attn": stack("sink_attn", "float32"),
        "diag_attn": stack("diag_attn", "float32"),
        "top1_attn": stack("top1_attn", "float32"),
        "entropy": stack("entropy", "float32"),
        "prev_attn": stack("prev_attn", "float32"),
        "recent_attn": stack("recent_attn", "float32"),
        "doc_index": np.asarray(window.doc_index, dtype="int64"),
        "window_start": np.asarray(window.start, dtype="int64"),
    }
    if layout.store_rows == "all":
        arrays["attn"] = stack("rows", "float16")
    if layout.queries:
        arrays["attn_rows"] = stack("query_rows", "float32")
    if layout.learned_sinks:
        # A layer without learned sinks gives its sink no weight.
        arrays["learned_sink_attn"] = torch.stack([
            captures[l].learned_sink[b] if captures[l].learned_sink is not None
            else torch.zeros_like(captures[l].sink_attn[b]) for l in layers
        ]).cpu().numpy()
    return arrays


def _stored_values(values: torch.Tensor, values_dtype: str) -> np.ndarray:
    """Values (layer, kv_head, pos, head_dim) as the store holds them: bfloat16 as its bit
    patterns (uint16; the model's bfloat16 values, so nothing is lost), else numpy's dtype."""
    if values_dtype == BFLOAT16:
        return values.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return values.float().cpu().numpy().astype(values_dtype, copy=False)


def extract(request: ExtractRequest, checked: Preflight | None = None,
            session: StoreSession | None = None) -> ExtractResult:
    """Run ``extract``; raises :class:`InputError` (or a :class:`StoreError`) on bad input
    with the store untouched. ``checked`` and ``session``: the request's :func:`preflight`
    and the command's store (``StoreSession(store, mode="c")``, through which every read and
    write of the store goes), where the caller opened them and found nothing answered
    (:meth:`Preflight.answer`); else opened here.

    With ``shard = (i, n)`` this process writes sequences s with s % n == i, so n processes
    (by hand, or ranks of torchrun) fill one run without touching each other's shards.
    """
    if session is None:
        checked = checked or preflight(request)
        with StoreSession(request.store, mode="c") as session:
            done = checked.answer(session)
            return done if done is not None else extract(request, checked, session)
    shard = checked.shard
    source = _corpus(request)  # before the model, which may take minutes to load the first time
    model = _model(request, shard)
    ids = None if request.token_ids is None else _token_array(request.token_ids)
    bos = bos_token_id(model.tokenizer, request.bos_token, model.config, ExtractRequest, ids)
    bos_id = bos.id
    inputs = _windowed(request, source, model, bos_id) if ids is None else _given(request, ids, model, bos)
    # Also here: a hub model's metadata is known once its config is loaded, before its weights.
    check_context_length(inputs.length, config_positions(model.config), model.name, ExtractRequest)
    queries = query_positions(request.queries, inputs.length)
    _check_chunks(model.config, queries, inputs.length)
    run_id = request.run_id or default_run_id(model.name, inputs.id, inputs.length)
    if not RUN_ID_PATTERN.match(run_id):
        raise InputError(f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-'")
    write = session.run_write(run_id, shard=shard)
    recorded = write.recorded()
    identity = jsonable({
        "model": model.provenance,
        "dataset": inputs.provenance,
        "context_length": inputs.length,
        "window_rule": inputs.window_rule,
        "bos_token_id": bos_id,
        "values_dtype": _values_dtype(request.values_dtype, model, recorded),
        "store_rows": request.store_rows,
        "queries": list(queries),
        "compute_dtype": model.compute_dtype,
    })
    check_identity(recorded, identity, request.store, run_id)
    windows = inputs.windows()
    with write.begin(len(windows)) as begun:
        start = time.perf_counter()
        written = len(begun.todo)
        if begun.todo:
            provenance = {**identity, **_run_provenance(request, model, bos_id, shard)}
            _write_sequences(request, model, begun, run_id, provenance, windows, queries)
        committed = begun.commit()
        return ExtractResult(run_id, written, committed, begun.capacity, time.perf_counter() - start)


def _run_provenance(request: ExtractRequest, model: _Model, bos_id: int, shard: tuple[int, int] | None) -> dict[str, Any]:
    """What a run records beyond its identity: tokenizer, compute, versions, command line."""
    tokenizer = model.tokenizer
    return {
        "tokenizer": None if tokenizer is None else {
            "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer),
            "bos_token": tokenizer.convert_ids_to_tokens(bos_id),
            "name_or_path": getattr(tokenizer, "name_or_path", None) or None,
        },
        "model_type": model.config.model_type,
        "device": model.device,
        "device_map": jsonable(parse_device_map(request.device_map)),
        # What float32 matmuls of the forward computed in: "high" is TF32 on a GPU.
        "float32_matmul_precision": "high" if model.tf32 else torch.get_float32_matmul_precision(),
        "attention_implementation": f"{ATTN_IMPLEMENTATION} ({output_description(model.dtype, model.config.get_text_config().model_type)}; float32 rows recomputed from post-RoPE q/k)",
        "library_versions": _library_versions(),
        "attngeom_version": __version__,
        "command_line": shlex.join(request.command_line),
        "shard": list(shard) if shard else None,
    }


def _write_sequences(
    request: ExtractRequest, model: _Model, begun: Begun, run_id: str, provenance: dict[str, Any],
    windows: list[Window], queries: tuple[int, ...],
) -> None:
    """Run the model over the windows of the sequences ``begun.todo`` batch by batch and
    commit each sequence; the run is created after the first forward (its layout comes from
    the capture)."""
    net = model.load()
    seqs = begun.todo
    length = len(windows[0].tokens)
    if model.config.model_type not in VERIFIED_TYPES:
        _check_conformance(net, model, windows[seqs[0]], request.progress)
    bar = tqdm(total=len(seqs), unit="seq", desc=f"extract {run_id}", disable=not request.progress)
    start = time.perf_counter()
    layout = None
    try:
        with _capturing(net, keep_rows=request.store_rows == "all", queries=queries, tf32=model.tf32) as record:
            for b0 in range(0, len(seqs), request.batch_size):
                batch = [windows[i] for i in seqs[b0 : b0 + request.batch_size]]
                ids = torch.from_numpy(np.stack([w.tokens for w in batch]).astype("int64")).to(model.device)
                layers = record(ids)
                if layout is None:  # the run's recorded layout, also when resuming
                    layout = begun.create(
                        lambda: _layout(model.config, layers, request, length, queries, provenance["values_dtype"]),
                        provenance, in_flight=_in_flight(model.device))
                # Converted, compressed and written beside the next batch's forward (on CPU, before it).
                for b, (seq, window) in enumerate(zip(seqs[b0 : b0 + request.batch_size], batch)):
                    with phase("attngeom.write"):
                        begun.submit(seq, phased("attngeom.hand_off",
                                                 functools.partial(_sequence_arrays, layers, b, window, layout)))
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{bar.n * length / max(time.perf_counter() - start, 1e-9):.0f}")
    finally:
        bar.close()


def _check_chunks(config: Any, queries: tuple[int, ...], length: int) -> None:
    """Refuse rows at earlier queries in a model whose attention works in chunks shorter than
    L (Llama 4): the analysis at any query takes each query's keys as the last ones of the
    final query's (docs/method.md#any-query), which holds for causal and sliding masks only."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and chunk < length and any(q < length - 1 for q in queries):
        raise UnsupportedModelError(
            f"--queries keeps rows at earlier queries, which the analysis reads with causal or sliding masks; "
            f"this model attends in chunks of {chunk} keys, fewer than L = {length}: use --queries last"
        )


def _check_conformance(net: torch.nn.Module, model: _Model, window: Window, progress: bool) -> None:
    """Compare the capture with the model's eager attention on the first window before
    anything is written (a family the tests do not cover); refuses a disagreement."""
    if progress:
        tqdm.write(f"checking the capture of model type '{model.config.model_type}' against its eager attention "
                   "(a family attngeom's tests do not cover)", file=sys.stderr)
    ids = torch.from_numpy(window.tokens[None].astype("int64")).to(model.device)
    with _matmul_precision(model.tf32):
        checks = check_capture(net, ids, check_positions(len(window.tokens)))
    refuse_disagreement(checks, model.config.model_type)


def _in_flight(device: str) -> int:
    """Sequences written beside the forward: on an accelerator the forward leaves the CPU to
    the writer. On CPU the forward's threads take every core and wait for each other: a
    writer beside them stalls them for longer than its own CPU time (smollm2-135m L=512, 2
    threads on 2 cores: a sequence's writes take 0.08 CPU s, 5% of the forward's, yet
    extract/SDPA was 1.34 beside against 1.06 between, OMP_WAIT_POLICY=PASSIVE on a busy
    host; 1.88 beside on a quiet one), so the caller writes each sequence between its
    forwards, compressing on every core."""
    return 0 if torch.device(device).type == "cpu" else IN_FLIGHT
