"""Head ablation: many (layer, head) masks evaluated in one batched forward.

Ablating head ``h`` of an attention layer zeroes that query head's attention output,
``sum_j A_ij v_j`` for every query, before the layer's output projection: under grouped-query
attention the mask addresses query heads (their kv head keeps serving the other heads of its
group), under latent attention the head's value-width output, and in a hybrid only its
softmax-attention layers have heads (docs/method.md#ablation). The mask is applied where every
family's attention returns its per-head outputs, the attention interface: the model's own
attention function runs, and its output (batch, L, heads, Dv) is multiplied by a (batch,
layer, head) mask; the rows of one batch carry different masks. Layers below the first layer
any mask of a batch ablates compute the same thing under every mask, so they run once per
sequence; a pre-hook on that first ablated layer then repeats each sequence's hidden state
once per mask.

Protocol (docs/method.md#ablation): prefill ``L-1`` tokens and score the next one. With the mask applied at
every position (the head is removed from the model, prefill included), prefill of tokens
``0..L-2`` followed by decoding is one causal forward over those tokens whose last position
predicts token ``L-1``; only that position's logits are computed (``logits_to_keep=1``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from accelerate.utils import align_module_device
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attngeom.errors import UnsupportedModelError
from attngeom.extract.call_layers import CallLayers
from attngeom.extract.capture import decoder
from attngeom.extract.families import attention_layers, loop_layers
from attngeom.extract.own_code import FAMILIES as OWN_FAMILIES
from attngeom.extract.own_code import OWN_CODE_TYPES, own_code_attention, plain_attention

MASKED_IMPLEMENTATION = "attngeom_masked"


@dataclass(frozen=True)
class HeadGeometry:
    """The model's attention shape: its softmax-attention layers (the model's own indices),
    query and kv heads per layer."""

    layers: tuple[int, ...]
    n_heads: int
    n_kv_heads: int

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def layer_list(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder layers of a causal LM, in order, attention or not: the module list of its
    decoder that holds one module per layer (``layers``, GPT-2's ``h``, ...; a BERT-like
    decoder's ``encoder.layer``, one level down); None for a looped stack, whose modules run
    once per layer of several (HRM's, Dory's)."""
    config = model.config.get_text_config()
    if loop_layers(config):
        return None
    n_layers = config.num_hidden_layers
    stack = decoder(model)
    for child in (*stack.children(), *stack.modules()):
        if isinstance(child, torch.nn.ModuleList) and len(child) == n_layers:
            return list(child)
    return None


def head_geometry(model: torch.nn.Module) -> HeadGeometry:
    config = model.config.get_text_config()
    n_heads = config.num_attention_heads
    return HeadGeometry(
        layers=attention_layers(config),
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
    )


def first_ablated_layers(masks: torch.Tensor) -> torch.Tensor:
    """masks (M, layers, heads) -> (M,) int64: each mask's first layer with a 0 (``layers`` if none)."""
    ablated = (masks == 0).any(dim=2)
    return torch.where(ablated.any(dim=1), ablated.int().argmax(dim=1), masks.shape[1])


# The masker of each model captured in this thread, set only by ``HeadMasker``: keyed by
# attention module, so another model's forward inside the block runs unmasked.
_MASKERS: ContextVar[Mapping[torch.nn.Module, HeadMasker]] = ContextVar(
    "attngeom_maskers", default=MappingProxyType({})
)


def _masked_attention(module, query, key, value, attention_mask, **kwargs):
    masker = _MASKERS.get().get(module)
    if masker is None:
        raise RuntimeError(f"{type(module).__name__} runs {MASKED_IMPLEMENTATION!r} outside a HeadMasker")
    output, weights = masker.attention(module)(module, query, key, value, attention_mask, **kwargs)
    return masker.masked(masker.calls.layer(module), output), weights


class HeadMasker:
    """Context manager switching ``model`` to its own attention with head masks on the outputs;
    idle until :meth:`set`. ``layers``: the model's indices of the masked layers, in the order of
    the masks' layer axis (default: its softmax-attention layers)."""

    def __init__(self, model: torch.nn.Module, layers: tuple[int, ...] | None = None) -> None:
        own = OWN_FAMILIES.get(model.config.get_text_config().model_type)
        if own is not None and own.ablation is not None:
            raise UnsupportedModelError(f"ablate cannot mask the heads of {type(model).__name__}: {own.ablation}")
        self.model = model
        self.blocks = layer_list(model)
        # Layers whose inputs cannot be repeated per mask (XLM's, XLNet's), and a looped stack,
        # which has no module per layer to start the repeats at: every sequence runs whole once
        # per mask, each row its own mask.
        self.repeats_layers = (own is None or own.repeats_layers) and self.blocks is not None
        # A block shared by several depths is masked at the depth of each call only.
        self.calls = CallLayers(model)
        self.layers = tuple(layers if layers is not None else head_geometry(model).layers)
        self._position = {layer: p for p, layer in enumerate(self.layers)}
        self._masks: torch.Tensor | None = None
        self._start = len(self.layers)
        self._repeat = 1
        self._handles: list[Any] = []
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._previous = model.config._attn_implementation
        self._token = None
        self._own_code: contextlib.ExitStack | None = None

    def set(self, masks: torch.Tensor | None, start: int = 0, repeat: int = 1) -> None:
        """Apply ``masks`` (B', layers, heads) from layer ``start`` (a position on the masks'
        layer axis) on, where each of the B input rows is first repeated ``repeat`` times
        (B' = B * repeat). ``None`` disables."""
        self._masks, self._start, self._repeat = masks, start, repeat
        self._memo = {}

    def attention(self, module: torch.nn.Module) -> Callable:
        """The attention function the model ran before: its implementation's, or for "eager"
        the eager function of the module's own modeling module (a family's own, e.g. with sinks)."""
        if self._previous == "eager" or self._previous not in ALL_ATTENTION_FUNCTIONS:
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self._previous]

    def masked(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """A layer's attention output (B', L, heads, Dv) with the masked heads zeroed."""
        position = self._position.get(layer)
        if self._masks is None or position is None or position < self._start:
            return output
        return output * self._masks[:, position].to(output.dtype)[:, None, :, None]

    def _own_code_output(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, mask: torch.Tensor, scaling: float, reference: Callable) -> torch.Tensor:
        """The masked output (B', L, heads, Dv) of a layer of a family that computes attention in
        its own code (:mod:`attngeom.extract.own_code`)."""
        return self.masked(layer, plain_attention(query, key, value, mask, scaling))

    def _model_start(self) -> int:
        """The model's index of the first decoder layer the masks may change."""
        return self.layers[self._start] if self._start < len(self.layers) else len(self.blocks)

    def _repeated(self, value: Any, batch: int, state: tuple[int, ...] = ()) -> Any:
        """``value`` with every tensor of two or more dims whose leading dim is the input batch
        repeated per mask (attention masks, per-sequence positions); batch-1 tensors broadcast
        as they are, but for those of the shape ``state`` of the layer's input hidden state
        (Zamba's embeddings, which its layers join to their input), and 1-D ones (cache
        positions) carry no batch."""
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == batch and (
                batch > 1 or tuple(value.shape) == state):
            key = id(value)
            if key not in self._memo:
                # Every layer from the start on receives the model's batch-B tensors again.
                self._memo[key] = (value, value.repeat_interleave(self._repeat, dim=0))
            return self._memo[key][1]
        if isinstance(value, tuple | list):
            return type(value)(self._repeated(v, batch, state) for v in value)
        return value

    def _layer_hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            start = self._model_start()
            if self._masks is None or layer < start or self._repeat == 1:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            batch = hidden.shape[0] if layer == start else hidden.shape[0] // self._repeat
            if layer == start:
                hidden = hidden.repeat_interleave(self._repeat, dim=0)
            state = (batch, *hidden.shape[1:])
            kwargs = {k: self._repeated(v, batch, state) for k, v in kwargs.items() if k != "hidden_states"}
            if args:
                return (hidden, *self._repeated(args[1:], batch, state)), kwargs
            return (), {**kwargs, "hidden_states": hidden}

        return hook

    def __enter__(self) -> HeadMasker:
        AttentionInterface.register(MASKED_IMPLEMENTATION, _masked_attention)
        previous_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(self._previous) or ALL_MASK_ATTENTION_FUNCTIONS["eager"]
        AttentionMaskInterface.register(MASKED_IMPLEMENTATION, previous_mask)
        self._token = _MASKERS.set({**_MASKERS.get(), **dict.fromkeys(self.model.modules(), self)})
        model_type = self.model.config.get_text_config().model_type
        if model_type in OWN_CODE_TYPES:
            # No attention implementation to switch to: the family's own attention method is
            # replaced for the block, and its output masked as the interface's is.
            self._own_code = contextlib.ExitStack()
            self._own_code.enter_context(own_code_attention(self.model, model_type, self._own_code_output))
        else:
            self.model.set_attn_implementation(MASKED_IMPLEMENTATION)
        for i, block in enumerate(self.blocks or ()):
            self._handles.append(block.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
        self.calls.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.calls.__exit__()
        if self._own_code is not None:
            self._own_code.close()
            self._own_code = None
        else:
            self.model.set_attn_implementation(self._previous)
        _MASKERS.reset(self._token)
        self.set(None)


def _last_token_nll(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ids (B, L-1), targets (B',) -> (B',) float32 NLL of each target at the last position
    (B' = B times the masker's repeat)."""
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    return -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def masked_nll(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    masks: torch.Tensor,
    *,
    batch_size: int = 64,
    progress: bool = False,
    desc: str = "ablate",
    layers: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Decode NLL of token ``L-1`` given tokens ``0..L-2`` under every head mask.

    tokens (S, L) int; masks (M, layers, heads), 1 keeps and 0 ablates, over the model's
    softmax-attention layers ``layers`` (default: all of them). Returns (S, M) float32.
    Each forward carries at most ``batch_size`` (sequence, mask) rows, all of its masks with
    the same first ablated layer; the layers below it run once per sequence.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    n_seq, n_masks = tokens.shape[0], masks.shape[0]
    ids = tokens[:, :-1].to(device=device, dtype=torch.long)
    targets = tokens[:, -1].to(device=device, dtype=torch.long)
    starts = first_ablated_layers(masks)
    # A forward never mixes masks of different first ablated layers: every layer it shares
    # is then computed once per sequence instead of once per mask (about half the work of
    # the single-head masks); fewer masks per forward are made up by more sequences.
    chunks = []
    for start in torch.unique(starts).tolist():
        group = torch.nonzero(starts == start).flatten()
        per_forward = min(len(group), batch_size)
        chunks += [(start, group[i : i + per_forward]) for i in range(0, len(group), per_forward)]
    out = torch.empty(n_seq, n_masks, dtype=torch.float32)
    total = sum(-(-n_seq // max(1, batch_size // len(chunk))) for _, chunk in chunks)
    with torch.inference_mode(), HeadMasker(model, layers) as masker, tqdm(
        total=total, unit="fwd", desc=desc, disable=not progress
    ) as bar:
        for start, chunk in chunks:
            chunk_masks = masks[chunk].to(device=device, dtype=dtype)
            seqs_per_forward = max(1, batch_size // len(chunk))
            for s0 in range(0, n_seq, seqs_per_forward):
                seq = slice(s0, min(n_seq, s0 + seqs_per_forward))
                n = seq.stop - seq.start
                if start == len(masker.layers):
                    # No mask of this chunk ablates anything: one plain forward per sequence.
                    masker.set(None)
                    nll = _last_token_nll(model, ids[seq], targets[seq])[:, None].expand(n, len(chunk))
                elif masker.repeats_layers:
                    masker.set(chunk_masks.repeat(n, 1, 1), start=start, repeat=len(chunk))
                    nll = _last_token_nll(model, ids[seq], targets[seq].repeat_interleave(len(chunk)))
                    nll = nll.view(n, len(chunk))
                else:
                    masker.set(chunk_masks.repeat(n, 1, 1), start=start)
                    nll = _last_token_nll(model, ids[seq].repeat_interleave(len(chunk), dim=0),
                                          targets[seq].repeat_interleave(len(chunk))).view(n, len(chunk))
                out[seq, chunk] = nll.cpu()
                bar.update(1)
    return out


def head_weight_norms(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Frobenius norms (layers, heads) float32 of each query head's slice of W_O (its Dh input
    columns of ``o_proj``) and of W_V (the Dh output rows of ``v_proj`` of the kv head it reads),
    over the softmax-attention layers; None for a family whose attention has no separate
    ``o_proj`` and ``v_proj`` of those shapes (fused or latent projections), or whose layers
    are no modules of their own (a looped stack's)."""
    geo = head_geometry(model)
    group = geo.n_heads // geo.n_kv_heads
    blocks = layer_list(model)
    if blocks is None:
        return None
    wo, wv = [], []
    with torch.no_grad():
        for layer in geo.layers:
            attention = getattr(blocks[layer], "self_attn", None)
            if not (hasattr(attention, "o_proj") and hasattr(attention, "v_proj")):
                return None
            # A layer offloaded by a device map keeps its weights beside it until it runs.
            with align_module_device(attention.o_proj), align_module_device(attention.v_proj):
                o, v = attention.o_proj.weight.float().cpu(), attention.v_proj.weight.float().cpu()
            if o.shape[1] % geo.n_heads or v.shape[0] % geo.n_kv_heads:
                return None
            wo.append(o.reshape(o.shape[0], geo.n_heads, -1).norm(dim=(0, 2)))
            kv = v.reshape(geo.n_kv_heads, -1, v.shape[1]).norm(dim=(1, 2))
            wv.append(kv.repeat_interleave(group))
    return torch.stack(wo).cpu(), torch.stack(wv).cpu()
