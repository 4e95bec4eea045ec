"""Terms of an attention call beyond its queries, keys and values that join the scores: a
learned sink (gpt-oss's ``s_aux`` per head, Inkling 2's ``sinks`` per query), an additive
position bias (Inkling's ``position_bias``) and a sparse attention's selected keys
(DeepSeek-V3.2's ``indices``), under the names the families pass them.

A position bias is added to the scores before the softmax exactly as an additive mask is,
so the capture folds it into the mask and reads it as it reads ALiBi's; the selected keys
mask the others, as the model's own eager and SDPA paths fold them into the mask; a sink of
either shape is one more logit in each row's softmax with no value
(docs/models.md#learned-sinks).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["BIAS_ARGUMENTS", "SELECTION_ARGUMENTS", "SINK_ARGUMENTS", "biased_mask", "learned_sinks", "per_query",
           "selected_mask", "sink_refusal"]

SINK_ARGUMENTS = ("s_aux", "sinks")
BIAS_ARGUMENTS = ("position_bias",)
SELECTION_ARGUMENTS = ("indices",)


def learned_sinks(kwargs: Mapping) -> torch.Tensor | None:
    """The call's learned-sink logits: (H,) per head, or (B, H, L, 1) per query; None without."""
    for name in SINK_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def sink_refusal(sinks: torch.Tensor, query: torch.Tensor) -> str | None:
    """Why ``sinks`` cannot be the learned sinks of queries (B, H, L, Dh), in words; None when
    they can: one logit per head, or one per head and query."""
    bsz, n_heads, length, _ = query.shape
    if sinks.numel() == n_heads or tuple(sinks.shape) == (bsz, n_heads, length, 1):
        return None
    return f"passes learned sinks of shape {tuple(sinks.shape)} for {n_heads} heads and {length} queries"


def biased_mask(attention_mask: torch.Tensor | None, kwargs: Mapping, query: torch.Tensor) -> torch.Tensor | None:
    """``attention_mask`` with the call's additive position biases (B|1, H|1, L, L) folded in:
    an additive mask in the queries' dtype, the bias where a key is attended and the dtype's
    lowest value where it is hidden. The mask itself when the call has no bias."""
    biases = [kwargs[name] for name in BIAS_ARGUMENTS if kwargs.get(name) is not None]
    if not biases:
        return attention_mask
    length, keys = query.shape[2], biases[0].shape[-1]
    if attention_mask is None:
        allowed = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril(keys - length)[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    bias = sum(b.to(query.dtype) for b in biases)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        bias = bias + attention_mask.to(query.dtype)  # the mask's own biases (ALiBi) stay
    return torch.where(allowed, bias, torch.finfo(query.dtype).min)


def selected_mask(attention_mask: torch.Tensor | None, kwargs: Mapping, query: torch.Tensor,
                  n_keys: int) -> torch.Tensor | None:
    """``attention_mask`` with every key outside each query's selection hidden: the call's
    ``indices`` (B, L, k), the keys a sparse attention's indexer chose for each query, are
    the only ones its softmax weighs (DeepSeek-V3.2, GLM-MoE-DSA). A boolean mask (B, 1, L,
    n_keys), or the additive mask given with the dtype's lowest value at the other keys; the
    mask itself without a selection."""
    indices = next((kwargs[name] for name in SELECTION_ARGUMENTS if kwargs.get(name) is not None), None)
    if indices is None:
        return attention_mask
    bsz, length = indices.shape[:2]
    chosen = torch.zeros(bsz, length, n_keys, dtype=torch.bool, device=query.device)
    chosen.scatter_(-1, indices.long(), True)
    chosen = chosen[:, None]
    if attention_mask is None:
        causal = torch.ones(length, n_keys, dtype=torch.bool, device=query.device).tril(n_keys - length)
        return chosen & causal[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask & chosen
    return attention_mask.masked_fill(~chosen, torch.finfo(attention_mask.dtype).min)


def per_query(kwargs: Mapping, where: torch.Tensor, length: int) -> dict:
    """The call's arguments for the queries at ``where`` only: a term that holds one entry per
    query (a position bias, per-query sinks: (B, H, L, ...)) is taken at those queries."""
    return {name: value[:, :, where] if name in (*SINK_ARGUMENTS, *BIAS_ARGUMENTS) and isinstance(value, torch.Tensor)
            and value.dim() == 4 and value.shape[2] == length else value for name, value in kwargs.items()}
