"""The capture's hook into transformers: the function registered through its
``AttentionInterface`` (:func:`register_capture`), which receives, in every supported
architecture, each layer's post-RoPE queries and keys and un-repeated values, refuses an
argument it cannot reproduce (:func:`call_refusal`), and has
:func:`~attngeom.extract.tiles.attention_summaries` recompute the layer's probability rows in
float32 and reduce them to the quantities the store keeps (docs/store.md#run-arrays), for the
module's :class:`~attngeom.extract.recorder.Recorder`. The layer's output is the model's own SDPA
when it computes in a lower precision; in float32 those rows are the eager attention itself,
so ``rows @ v`` is the output and SDPA is not run a second time. A module under no recorder
runs plain SDPA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

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
from attngeom.extract.call_layers import shared_by_depths
from attngeom.extract.families import OWN_CODE_TYPES
from attngeom.extract.phases import phase
from attngeom.extract.recorder import Recorder, recorder_of
from attngeom.extract.threads import one_thread, tile_threads
from attngeom.extract.tiles import allowed_keys, attention_summaries

__all__ = ["ATTN_IMPLEMENTATION", "IGNORED_ARGUMENTS", "call_refusal", "output_description", "own_code_call",
           "own_output", "register_capture"]

ATTN_IMPLEMENTATION = "attngeom_capture"


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


def call_refusal(module: torch.nn.Module, layer: int | None, query: torch.Tensor, key: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float, kwargs: Mapping) -> str | None:
    """Why the capture cannot reproduce this attention call as one softmax over the text's
    keys, in words (None when it can): no layer (``layer``: the call's, from
    :class:`~attngeom.extract.call_layers.CallLayers`), keys beyond the text's tokens, an
    argument it does not know, dropout, non-causal attention, a head mask."""
    where = f"the attention of {type(module).__name__}" + (f" (layer {layer})" if layer is not None else "")
    if layer is None and not shared_by_depths(module):
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
    recorder = recorder_of(module)
    if over_other_states(module, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = recorder.layer_of(module) if recorder is not None else getattr(module, "layer_idx", None)
    refusal = call_refusal(module, layer, query, key, attention_mask, dropout, kwargs)
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
    output = _summarise(recorder, module, layer, query, key, value, mask, scaling, softcap=softcap,
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
    # The layer's setup runs on one torch thread and its tiles on as many threads as the caller's
    # torch threads, each of one (attngeom.extract.threads): same bits for any count.
    threads = tile_threads(query.device)
    with one_thread(query.device), phase("attngeom.capture"):
        capture, output = attention_summaries(
            query, key, value, mask, scaling, softcap=softcap, sinks=sinks,
            keep_rows=recorder.keep_rows if recorder else False,
            queries=recorder.computed_queries() if recorder is not None else (),
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
            capture = recorder.kept(capture)
        recorder.record(layer, capture, recorder.runs[module])
    return output


def register_capture() -> None:
    """Register the capture attention function and its (SDPA) mask builder with transformers
    under ``ATTN_IMPLEMENTATION``; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _capture_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def own_code_call(module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, mask: torch.Tensor, scaling: float,
                  reference: Callable[[tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The capture of one call of a family that computes attention in its own code
    (:mod:`attngeom.extract.own_code`): its output is always the float32 rows @ v, there being
    no attention function of transformers' to defer to; ``reference`` runs the model's own
    code at the checked queries."""
    recorder = recorder_of(module)
    return _summarise(recorder, module, layer, query, key, value, mask, scaling, need_output=True,
                      check=lambda: dict(mask=mask, kwargs={}, reference=reference(recorder.check_queries)))
