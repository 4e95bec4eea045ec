"""The model's forward under the capture, and what it hands the writer: each layer's
:class:`~attngeom.extract.tiles.LayerCapture` in host memory, a sequence's arrays as views of
it (one part per layer; the writer stacks them), and the check of an unverified family's
capture against its eager attention before anything is written."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from attngeom.errors import UnsupportedModelError
from attngeom.extract.capture import capturing, decoder
from attngeom.extract.conformance import check_capture, check_positions, refuse_disagreement
from attngeom.extract.corpora import Window
from attngeom.extract.inputs import Model
from attngeom.extract.layer_widths import widened
from attngeom.extract.phases import phase
from attngeom.extract.tiles import LayerCapture
from attngeom.store.extracted.runs import IN_FLIGHT, SequenceValue
from attngeom.store.objects.schema import BFLOAT16, QUERY_SUMMARIES, RunLayout

__all__ = ["capturing_forward", "check_chunks", "check_conformance", "in_flight", "sequence_parts"]


@contextlib.contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
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
def capturing_forward(model: torch.nn.Module, *, keep_rows: bool, queries: tuple[int, ...],
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
        with torch.inference_mode(), matmul_precision(tf32), capturing(model, keep_rows=keep_rows, queries=queries,
                                                                       to_host=True) as recorder:
            with phase("attngeom.forward"):
                decoder(model)(input_ids=ids, use_cache=False)
        return recorder.host_layers()

    try:
        yield record
    finally:
        model.train(training)


def sequence_parts(captures: dict[int, LayerCapture], b: int, window: Window,
                   layout: RunLayout) -> dict[str, SequenceValue]:
    """Sequence ``b`` of a batch's ``captures`` as the writer takes it: each per-layer array as
    one part per stored layer, views of the captures' host memory where their dtype allows
    (the writer's encoders read each as one chunk of its shard, converted to the stored dtype)."""
    layers = layout.layer_indices

    def parts(name: str) -> list[np.ndarray]:
        return [getattr(captures[l], name)[b].cpu().numpy() for l in layers]

    arrays: dict[str, SequenceValue] = {
        "tokens": window.tokens.astype("int32"),
        "values": [_stored_values(widened(captures[l].values[b], layout.n_kv_heads, layout.head_dim),
                                  layout.values_dtype) for l in layers],
        "attn_last": parts("attn_last"),
        "winner": parts("winner"),
        **{name: parts(name) for name in QUERY_SUMMARIES},
        "doc_index": np.asarray(window.doc_index, dtype="int64"),
        "window_start": np.asarray(window.start, dtype="int64"),
    }
    if layout.store_rows == "all":
        arrays["attn"] = parts("rows")
    if layout.queries:
        arrays["attn_rows"] = parts("query_rows")
    if layout.learned_sinks:
        # A layer without learned sinks gives its sink no weight.
        arrays["learned_sink_attn"] = [
            captures[l].learned_sink[b].cpu().numpy() if captures[l].learned_sink is not None
            else np.zeros(captures[l].sink_attn[b].shape, np.float32) for l in layers
        ]
    return arrays


def _stored_values(values: torch.Tensor, values_dtype: str) -> np.ndarray:
    """One layer's values (kv_head, pos, head_dim) as numpy reads them: bfloat16 as its bit
    patterns (uint16; the model's bfloat16 values, so nothing is lost), a bfloat16 model's
    values stored in another dtype as float32 (numpy has no bfloat16), others as they are."""
    if values_dtype == BFLOAT16:
        return values.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return (values.float() if values.dtype == torch.bfloat16 else values).cpu().numpy()


def check_chunks(config: Any, queries: tuple[int, ...], length: int) -> None:
    """Refuse rows at earlier queries in a model whose attention works in chunks shorter than
    L (Llama 4): the analysis at any query takes each query's keys as the last ones of the
    final query's (docs/method.md#any-query), which holds for causal and sliding masks only.
    Reformer's local layers attend their chunk and those before it, and its model pads a text
    to a multiple of its chunk length: a run holds no padding's rows, so L must be one."""
    chunk = getattr(config, "attention_chunk_size", None)
    if config.model_type == "reformer":
        chunk = config.local_attn_chunk_length
        if length > chunk and length % chunk:
            raise UnsupportedModelError(
                f"Reformer pads a text of L = {length} tokens to a multiple of its chunk length ({chunk}), and a run "
                f"holds no padding's rows: use an L that is a multiple of {chunk}")
    if chunk and chunk < length and any(q < length - 1 for q in queries):
        raise UnsupportedModelError(
            f"--queries keeps rows at earlier queries, which the analysis reads with causal or sliding masks; "
            f"this model attends in chunks of {chunk} keys, fewer than L = {length}: use --queries last"
        )


def check_conformance(net: torch.nn.Module, model: Model, window: Window, progress: bool) -> None:
    """Compare the capture with the model's eager attention on the first window before
    anything is written (a family the tests do not cover); refuses a disagreement."""
    if progress:
        tqdm.write(f"checking the capture of model type '{model.config.model_type}' against its eager attention "
                   "(a family attngeom's tests do not cover)", file=sys.stderr)
    ids = torch.from_numpy(window.tokens[None].astype("int64")).to(model.device)
    with matmul_precision(model.tf32):
        checks = check_capture(net, ids, check_positions(len(window.tokens)))
    refuse_disagreement(checks, model.config.model_type)


def in_flight(device: str) -> int:
    """Sequences written beside the forward: on an accelerator the forward leaves the CPU to
    the writer. On CPU the forward's threads take every core and wait for each other: a
    writer beside them stalls them for longer than its own CPU time (smollm2-135m L=512, 2
    threads on 2 cores: a sequence's writes take 0.08 CPU s, 5% of the forward's, yet
    extract/SDPA was 1.34 beside against 1.06 between, OMP_WAIT_POLICY=PASSIVE on a busy
    host; 1.88 beside on a quiet one), so the caller writes each sequence between its
    forwards, compressing on every core."""
    return 0 if torch.device(device).type == "cpu" else IN_FLIGHT
