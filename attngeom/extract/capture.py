"""Capture of attention rows, values and per-query summaries during the model's own forward.

A function registered by :func:`register_capture` through transformers' ``AttentionInterface``
receives, in every supported architecture, the post-RoPE queries and keys and the un-repeated
values of each layer; from them :func:`attention_summaries` recomputes the probability rows
in float32, in query blocks (memory bounded at any L), and reduces each row to the quantities
the store keeps (docs/store.md#run-arrays). The layer's output is the model's own SDPA when it computes in a lower
precision; in float32 those rows are the eager attention itself, so ``rows @ v`` is the
output and SDPA is not run a second time.

What a forward records is scoped to the call: :func:`capturing` sets the model's attention
implementation to the capture one and a context-local :class:`Recorder` for the block, and
restores both on exit, so two models, two threads or a user's own hooks never see each other's
captures, and a model under no recorder runs plain SDPA.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attngeom.errors import UnsupportedModelError
from attngeom.extract.call_terms import (
    BIAS_ARGUMENTS,
    SELECTION_ARGUMENTS,
    SINK_ARGUMENTS,
    biased_mask,
    learned_sinks,
    selected_mask,
    sink_refusal,
)
from attngeom.extract.own_code import OWN_CODE_TYPES, own_code_attention
from attngeom.extract.phases import phase
from attngeom.extract.threads import one_thread, tile_threads
from attngeom.extract.tiles import LayerCapture, allowed_keys, attention_summaries

ATTN_IMPLEMENTATION = "attngeom_capture"


def host_copy(t: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """``t`` in host memory: ``t`` itself if it is there; else a pinned buffer that a
    non-blocking copy on ``stream`` fills (read it only after that stream's work has ended)."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    if stream is not None:
        # The caching allocator must not hand t's memory to the next layer before the copy read it.
        t.record_stream(stream)
    return host


@dataclass
class Recorder:
    """Collects the :class:`LayerCapture` of every layer during one forward pass.

    With ``to_host``, each layer's capture leaves the GPU as soon as the layer is done: its
    tensors are copied into pinned host buffers on a stream of their own, which waits for the
    layer and not the other way round, so the next layer runs meanwhile; :meth:`host_layers`
    waits for the copies. On CPU the captures are host memory already and stay as they are.
    """

    keep_rows: bool = False
    queries: tuple[int, ...] = ()
    to_host: bool = False
    # Queries whose rows and outputs ``compare`` checks against the model's eager attention
    # (:mod:`attngeom.extract.conformance`); () checks nothing.
    check_queries: tuple[int, ...] = ()
    compare: Callable[..., None] | None = field(default=None, repr=False)
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    # How many times each attention module ran in this block's forward (a looped layer runs
    # its module more than once); counted by :func:`capturing`'s hooks.
    runs: Counter = field(default_factory=Counter, repr=False)
    _stream: torch.cuda.Stream | None = field(default=None, repr=False)
    _copied: torch.cuda.Event | None = field(default=None, repr=False)

    def record(self, layer: int, capture: LayerCapture, runs: int = 1) -> None:
        """Keep ``capture`` as layer ``layer``'s (on its way to host memory with ``to_host``).
        A layer that calls the attention function twice in one forward is refused: its module
        run ``runs`` times (a looped layer: each call is a softmax, but the run stores one per
        layer and query), or calls it twice in one run (differential attention: its output is
        not one softmax over keys)."""
        if layer in self.layers:
            raise UnsupportedModelError(
                f"layer {layer} runs its attention {runs} times in one forward (a looped layer): each run is a "
                "softmax over keys, but a run stores one attention per layer and query"
                if runs > 1 else
                f"layer {layer} calls the attention function twice in one run of its attention (as differential "
                "attention does): its output is not one softmax over keys"
            )
        device = capture.attn_last.device
        if self.to_host and device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            capture = replace(capture, **{
                f.name: host_copy(getattr(capture, f.name), self._stream)
                for f in fields(capture)
                if getattr(capture, f.name) is not None
            })
            self._copied = self._stream.record_event()
        self.layers[layer] = capture

    def host_layers(self) -> dict[int, LayerCapture]:
        """Every layer's capture, once all of it is readable (host memory with ``to_host``)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.layers


# The recorder of each attention module captured in this thread (or task), set only by
# ``capturing``: keyed by module, so a second model's forward inside the block records nothing.
_RECORDERS: ContextVar[Mapping[torch.nn.Module, Recorder]] = ContextVar(
    "attngeom_recorders", default=MappingProxyType({})
)


def own_output(dtype: torch.dtype) -> bool:
    """Whether a capturing layer returns its float32 rows @ v (the eager attention of a
    float32 model) instead of running the model's SDPA for its output."""
    return dtype == torch.float32


def output_description(dtype: torch.dtype, model_type: str) -> str:
    """How a capturing layer's output is computed for a model of this compute dtype and type
    (a family whose attention is its own code has no SDPA to run)."""
    return "output = float32 rows @ v" if own_output(dtype) or model_type in OWN_CODE_TYPES else "sdpa output"


# Arguments of the attention call that change nothing the capture computes: the mask already
# holds a layer's sliding window or chunks (sliding_window serves kernels that take no mask),
# q and k already carry the positions, and the rest describe the cache or what to return.
IGNORED_ARGUMENTS = frozenset({
    "sliding_window", "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value",
    "output_attentions", "layer_idx", "is_causal", "softcap", "head_mask", *SINK_ARGUMENTS, *BIAS_ARGUMENTS,
    *SELECTION_ARGUMENTS,
})


def over_other_states(module: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: Mapping) -> bool:
    """Whether a call attends something else than the text's earlier tokens: a module of no
    decoder layer (no ``layer_idx``) attending without a mask and not causally, as Inkling 2's
    attention over the outputs of earlier blocks of layers at each position. A causal LM's
    attention over its tokens is causal or masked; such a call is the model's own business and
    runs as SDPA, unrecorded."""
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    return getattr(module, "layer_idx", None) is None and attention_mask is None and causal is False


def call_refusal(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                 dropout: float, kwargs: Mapping) -> str | None:
    """Why the capture cannot reproduce this attention call as one softmax over the text's
    keys, in words (None when it can): keys beyond the text's tokens, an argument it does not
    know, dropout, non-causal attention, a head mask."""
    layer = getattr(module, "layer_idx", None)
    where = f"the attention of {type(module).__name__}" + (f" (layer {layer})" if layer is not None else "")
    if "layer_idx" in inspect.signature(module.forward).parameters:
        return (f"{where} is one block shared by several depths, each passing it its own layer index: a run stores "
                "the attention of each layer's own module")
    if layer is None:
        return f"{where} has no layer index (layer_idx)"
    # The capture runs without a cache: each call's keys are the text's tokens, one per query.
    extra = key.shape[2] - query.shape[2]
    if extra > 0:
        return (f"{where} attends {extra} keys beyond the text's {query.shape[2]} tokens (as DeepSeek-V4's compressed "
                "entries, each pooled from several tokens): a row over the text's keys cannot hold their weight")
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_ARGUMENTS and v is not None)
    if unknown:
        return f"{where} passes {', '.join(repr(k) for k in unknown)}, which the capture does not reproduce"
    if dropout:
        return f"{where} applies dropout {dropout}"
    if kwargs.get("head_mask") is not None:
        return f"{where} is given a head mask"
    # Without a mask, a module of no decoder that says it is not causal (a BERT built without
    # is_decoder) attends every key, as its eager attention does. A decoder's causal mask
    # reaches the capture as None too, whatever its module says (BigBird-Pegasus's: not causal).
    causal = kwargs.get("is_causal")
    if causal is None and not getattr(module, "is_decoder", False):
        causal = getattr(module, "is_causal", True)
    if causal is False and attention_mask is None:
        return f"{where} is not causal: every query attends every key"
    sinks = learned_sinks(kwargs)
    if sinks is not None and sink_refusal(sinks, query) is not None:
        return f"{where} {sink_refusal(sinks, query)}"
    return None


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    recorder = _RECORDERS.get().get(module)
    if over_other_states(module, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    refusal = call_refusal(module, query, key, attention_mask, dropout, kwargs)
    if refusal is not None:
        raise UnsupportedModelError(refusal)
    softcap, sinks = kwargs.get("softcap"), learned_sinks(kwargs)
    # A sparse attention's selection hides the other keys, as the model's own eager path
    # does, and a position bias joins the scores as an additive mask does; the eager check
    # is given the call as the model makes it for eager attention.
    selected = selected_mask(attention_mask, kwargs, query, key.shape[2])
    mask = biased_mask(selected, kwargs, query)
    eager_call = {k: v for k, v in kwargs.items() if k not in SELECTION_ARGUMENTS}
    plain = {k: v for k, v in eager_call.items() if k not in BIAS_ARGUMENTS}
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # SDPA takes neither softcapped logits nor learned sinks: those layers return their own
    # float32 rows @ v, as a float32 model's do.
    own = softcap is not None or sinks is not None or own_output(query.dtype)
    if recorder is None and not own:
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **plain)
    # The keys the final query may attend are those of the model's mask: a sparse attention's
    # indexer choice among them is each row's zeros (docs/method.md#sparse-attention).
    attendable = attention_mask if selected is not attention_mask else None
    output = _summarise(recorder, module, module.layer_idx, query, key, value, mask, scaling, softcap=softcap,
                        sinks=sinks, need_output=own, attendable=attendable,
                        check=lambda: dict(mask=selected, kwargs=eager_call))
    if not own:
        output, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **plain)
    # Contiguous as transformers' own attention functions return it: some layers (JetMoE)
    # ``view`` the output, which a permuted layout would refuse.
    return output.contiguous(), None


def _summarise(recorder: Recorder | None, module: torch.nn.Module, layer: int, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float, *,
               softcap: float | None = None, sinks: torch.Tensor | None = None, need_output: bool,
               attendable: torch.Tensor | None = None, check: Callable[[], dict]) -> torch.Tensor | None:
    """One attention call's summaries, recorded as layer ``layer``'s by ``recorder`` (if any) once
    the conformance check (given what ``check()`` adds to its arguments) has compared them;
    the float32 rows @ v (B, L, H, Dv) when ``need_output`` or checked, else None.
    ``attendable``: the mask whose keys the final query may attend, when not ``mask``."""
    checked = recorder.check_queries if recorder is not None else ()
    kept = recorder.queries if recorder else ()
    # The layer's setup runs on one torch thread and its tiles on as many threads as the caller's
    # torch threads, each of one (attngeom.extract.threads): same bits for any count.
    threads = tile_threads(query.device)
    with one_thread(query.device), phase("attngeom.capture"):
        capture, output = attention_summaries(
            query, key, value, mask, scaling, softcap=softcap, sinks=sinks,
            keep_rows=recorder.keep_rows if recorder else False,
            queries=tuple(sorted({*kept, *checked})),
            need_output=need_output or bool(checked),
            threads=threads,
        )
    if attendable is not None:
        length = query.shape[2]
        capture = replace(capture, attendable=allowed_keys(attendable, length - 1, length, length,
                                                           query.device)[0, :, -1].all(dim=0))
    if recorder is not None:
        if checked:
            recorder.compare(module, layer, query, key, value, scaling=scaling, capture=capture, output=output,
                             **check())
            if tuple(checked) != tuple(kept):
                capture = replace(capture, query_rows=_kept_rows(capture.query_rows, kept, checked))
        recorder.record(layer, capture, recorder.runs[module])
    return output


def _own_code_call(module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, mask: torch.Tensor, scaling: float,
                   reference: Callable[[tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The capture of one call of a family that computes attention in its own code
    (:mod:`attngeom.extract.own_code`): its output is always the float32 rows @ v, there being
    no attention function of transformers' to defer to; ``reference`` runs the model's own
    code at the checked queries."""
    recorder = _RECORDERS.get().get(module)
    return _summarise(recorder, module, layer, query, key, value, mask, scaling, need_output=True,
                      check=lambda: dict(mask=mask, kwargs={}, reference=reference(recorder.check_queries)))


def _kept_rows(rows: torch.Tensor, kept: tuple[int, ...], checked: tuple[int, ...]) -> torch.Tensor | None:
    """The rows (B, H, Q, L) of the queries ``kept`` among those of ``kept`` and ``checked``."""
    if not kept:
        return None
    every = sorted({*kept, *checked})
    return rows[:, :, [every.index(q) for q in kept]]


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (its layers, without the LM head): the module that
    holds the list of its ``num_hidden_layers`` layers (BERT's inside its encoder).
    ``get_decoder()`` names it in most classes, but answers the model itself in some (Llama
    4's text model) and the LM head in others (ModernBERT-decoder), so the answer is checked
    by what it holds; the base model, ``model`` and then every submodule in order are the next
    candidates. A model whose layers sit in several stacks has its base model as decoder."""
    n_layers = model.config.get_text_config().num_hidden_layers
    for candidate in (model.get_decoder(), model.base_model, getattr(model, "model", None), *model.modules()):
        if candidate is not model and isinstance(candidate, torch.nn.Module) and any(
            isinstance(child, torch.nn.ModuleList) and len(child) == n_layers for child in candidate.modules()
        ):
            return candidate
    # Layers in several stacks (HRM's, BLT's): the base model runs them all.
    if model.base_model is not model:
        return model.base_model
    raise UnsupportedModelError(f"{type(model).__name__} holds no list of its {n_layers} decoder layers")


def register_capture() -> None:
    """Register the capture attention function and its (SDPA) mask builder with transformers
    under ``ATTN_IMPLEMENTATION``; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _capture_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@contextlib.contextmanager
def capturing(
    model: torch.nn.Module, *, keep_rows: bool = False, queries: tuple[int, ...] = (), to_host: bool = False,
    check_queries: tuple[int, ...] = (), compare: Callable[..., None] | None = None,
) -> Iterator[Recorder]:
    """Within the block, forwards of ``model`` in this thread record into the yielded recorder.

    ``model`` is a transformers ``PreTrainedModel``; its attention implementation (e.g. "sdpa"
    or "eager") is set to the capture one for the block and restored on exit. ``queries``:
    ascending positions whose rows each layer keeps (:attr:`LayerCapture.query_rows`). One model object
    is captured by one block at a time: the implementation is the model's, not the thread's.
    ``to_host``, ``check_queries`` and ``compare``: see :class:`Recorder`. A model whose class
    keeps its own attention (transformers refuses to switch it) is refused.
    """
    register_capture()
    # The text stack's implementation is the one that counts: a multimodal class (GOT-OCR2)
    # may keep its own while its language model switches.
    stack = getattr(decoder(model), "config", model.config)
    previous = stack._attn_implementation
    own_code = stack.model_type in OWN_CODE_TYPES
    if own_code:
        previous = ATTN_IMPLEMENTATION  # its attention method is replaced instead, for the block
    if previous != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if stack._attn_implementation != ATTN_IMPLEMENTATION:
            raise UnsupportedModelError(
                f"{type(model).__name__} keeps its own attention: transformers cannot switch it to the capture"
            )
    recorder = Recorder(keep_rows=keep_rows, queries=tuple(queries), to_host=to_host,
                        check_queries=tuple(check_queries), compare=compare)
    token = _RECORDERS.set({**_RECORDERS.get(), **dict.fromkeys(model.modules(), recorder)})
    counted = [m.register_forward_pre_hook(lambda module, args: recorder.runs.update((module,)))
               for m in model.modules() if hasattr(m, "layer_idx")]
    try:
        with own_code_attention(model, stack.model_type, _own_code_call) if own_code else contextlib.nullcontext():
            yield recorder
    finally:
        for hook in counted:
            hook.remove()
        _RECORDERS.reset(token)
        if previous != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(previous)
