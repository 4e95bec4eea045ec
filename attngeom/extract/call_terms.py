"""Terms of an attention call beyond its queries, keys and values that join the scores: a
learned sink (gpt-oss's ``s_aux`` per head, Inkling 2's ``sinks`` per query) and an additive
position bias (Inkling's ``position_bias``), under the names the families pass them.

A position bias is added to the scores before the softmax exactly as an additive mask is,
so the capture folds it into the mask and reads it as it reads ALiBi's; a sink of either
shape is one more logit in each row's softmax with no value (docs/models.md#learned-sinks).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["BIAS_ARGUMENTS", "SINK_ARGUMENTS", "biased_mask", "learned_sinks", "per_query", "sink_refusal"]

SINK_ARGUMENTS = ("s_aux", "sinks")
BIAS_ARGUMENTS = ("position_bias",)


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


def per_query(kwargs: Mapping, where: torch.Tensor, length: int) -> dict:
    """The call's arguments for the queries at ``where`` only: a term that holds one entry per
    query (a position bias, per-query sinks: (B, H, L, ...)) is taken at those queries."""
    return {name: value[:, :, where] if name in (*SINK_ARGUMENTS, *BIAS_ARGUMENTS) and isinstance(value, torch.Tensor)
            and value.dim() == 4 and value.shape[2] == length else value for name, value in kwargs.items()}
