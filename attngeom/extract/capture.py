"""Capture of attention rows, values and per-query summaries during the model's own forward.

What a forward records is scoped to the call: :func:`capturing` sets the model's attention
implementation to the capture one (:mod:`~attngeom.extract.attention_hook`) and a
context-local :class:`~attngeom.extract.recorder.Recorder` for the block, and restores both on
exit, so two models, two threads or a user's own hooks never see each other's captures, and a
model under no recorder runs plain SDPA. :func:`decoder` finds the stack a forward runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from attngeom.errors import UnsupportedModelError
from attngeom.extract.attention_hook import ATTN_IMPLEMENTATION, own_code_call, register_capture
from attngeom.extract.call_layers import CallLayers
from attngeom.extract.own_code import OWN_CODE_TYPES, own_code_attention
from attngeom.extract.recorder import Recorder, recording

__all__ = ["capturing", "decoder"]


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
    calls = CallLayers(model)
    recorder = Recorder(keep_rows=keep_rows, queries=tuple(queries), to_host=to_host,
                        check_queries=tuple(check_queries), compare=compare, layer_of=calls.layer)
    counted = [m.register_forward_pre_hook(lambda module, args: recorder.runs.update((module,)))
               for m in model.modules() if hasattr(m, "layer_idx")]
    try:
        with calls, recording(model, recorder), (own_code_attention(model, stack.model_type, own_code_call)
                                                 if own_code else contextlib.nullcontext()):
            yield recorder
    finally:
        for hook in counted:
            hook.remove()
        if previous != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(previous)
