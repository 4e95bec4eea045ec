"""Capture of the families whose attention transformers computes in the model's own code.

GPT-Neo and GPT-1 (openai-gpt) never call the attention interface: each attention module
computes its probabilities in a method of its own (``_attn``) from the queries, keys and
values its forward has split into heads. For the duration of a capture, that method of each
of the model's attention modules is replaced, on the instance only, by one that hands the
same q, k, v, the family's mask (its causal or windowed ``bias`` buffer and the model's
padding mask) and its scale to the capture's path, and returns the output in the family's
own layout. The model's own method stays the reference: with queries to check, it runs on
the same arguments in float32 and its weights are what the conformance check compares with.

This is the one module that reaches into those modules' internals (``_attn``, ``bias``,
``scale``): transformers exposes no interface for them. tests/test_families.py compares the
stored rows of each family with the model's own float64 forward, so a change in transformers
shows there.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from attngeom.errors import UnsupportedModelError

__all__ = ["OWN_CODE_TYPES", "Attend", "Reference", "own_code_attention"]

# (output (B, P, H, Dv), weights (B, H, P, L)) of the model's own code at the checked queries.
Reference = tuple[torch.Tensor, torch.Tensor]
# The capture's path for one call: (module, layer, query, key, value, additive float32 mask,
# scaling, the model's own code at the checked queries (a callable of those queries)) ->
# output (B, L, H, Dv).
Attend = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Family:
    """How one family's attention method is read: ``attention`` the class holding it, ``read``
    (module, its method's arguments) -> (query, key, value (B, H|KV, L, D), allowed (1, 1, L, L)
    bool, padding mask or None, scaling), and ``returns`` (module, output (B, H, L, Dv)) -> what
    the method returns."""

    attention: str
    read: Callable[..., tuple]
    returns: Callable[[torch.nn.Module, torch.Tensor], object]


def _read_gpt_neo(module, query, key, value, attention_mask=None):
    length = key.shape[-2]
    # Local layers' bias buffer holds their window; GPT-Neo scales no logit by 1/sqrt(d).
    allowed = module.bias[:, :, length - query.shape[-2]: length, :length]
    return query, key, value, allowed, attention_mask, 1.0


def _read_openai_gpt(module, q, k, v, attention_mask=None, output_attentions=False):
    length = k.shape[-1]
    allowed = module.bias[:, :, :length, :length].bool()
    # Keys arrive transposed (B, H, Dh, L) for the product; the scale is 1/sqrt(Dv) when set.
    return q, k.transpose(-1, -2), v, allowed, attention_mask, 1 / math.sqrt(v.shape[-1]) if module.scale else 1.0


FAMILIES: dict[str, Family] = {
    "gpt_neo": Family("GPTNeoSelfAttention", _read_gpt_neo, lambda module, out: (out, None)),
    "openai-gpt": Family("Attention", _read_openai_gpt, lambda module, out: [out]),
}
OWN_CODE_TYPES = frozenset(FAMILIES)


def _additive(allowed: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """Float32 (B|1, 1, L, L): 0 (or the padding mask's value) where ``allowed``, the float32
    lowest value where the family's mask hides a key."""
    low = torch.finfo(torch.float32).min
    if padding is None:
        return torch.where(allowed, 0.0, low)
    if padding.dtype == torch.bool:
        return torch.where(allowed & padding, 0.0, low)
    return torch.where(allowed, padding.float().clamp(min=low), low)


def _own_reference(original: Callable, module: torch.nn.Module, args: tuple, kwargs: dict
                   ) -> Callable[[tuple[int, ...]], Reference]:
    """The model's own method on its own arguments in float32 (asked for its weights where it
    returns them on request), at the queries asked for."""

    def at(positions: tuple[int, ...]) -> Reference:
        call = inspect.signature(original).bind(module, *args, **kwargs)
        for name, given in call.arguments.items():
            if isinstance(given, torch.Tensor) and given.is_floating_point():
                call.arguments[name] = given.float()
        if "output_attentions" in inspect.signature(original).parameters:
            call.arguments["output_attentions"] = True
        out, weights = original(*call.args, **call.kwargs)[:2]
        where = list(positions)
        return out[:, :, where].transpose(1, 2), weights[:, :, where]

    return at


@contextlib.contextmanager
def own_code_attention(model: torch.nn.Module, model_type: str, attend: Attend) -> Iterator[None]:
    """Within the block, each attention module of ``model`` (a ``model_type`` of
    ``OWN_CODE_TYPES``) runs its attention through ``attend``, layer by layer in model order;
    the modules' own methods are restored on exit."""
    family = FAMILIES[model_type]
    modules = [m for m in model.modules() if type(m).__name__ == family.attention]
    n_layers = model.config.get_text_config().num_hidden_layers
    if len(modules) != n_layers:
        raise UnsupportedModelError(
            f"model type '{model_type}' holds {len(modules)} {family.attention} modules for its {n_layers} layers: "
            "attngeom cannot tell their layers"
        )
    for layer, module in enumerate(modules):
        original = type(module)._attn

        def replaced(self, *args, layer=layer, original=original, **kwargs):
            query, key, value, allowed, padding, scaling = family.read(self, *args, **kwargs)
            output = attend(self, layer, query, key, value, _additive(allowed, padding), scaling,
                            _own_reference(original, self, args, kwargs))
            return family.returns(self, output.transpose(1, 2))

        module._attn = types.MethodType(replaced, module)
    try:
        yield
    finally:
        for module in modules:
            del module._attn
