"""Head ablation: many (layer, head) masks evaluated in one batched forward.

Ablating head ``h`` of layer ``l`` zeroes its slice ``[h*Dh, (h+1)*Dh)`` of the input of that
layer's output projection ``self_attn.o_proj``: the input is the concatenation of the *query*
heads' attention outputs, so under grouped-query attention the mask addresses query heads
(kv head ``h // (H/KV)`` keeps serving the other heads of its group).

A forward pre-hook on every ``o_proj`` multiplies its input by a (batch, layer, head) mask:
the rows of one batch carry different masks. Layers below the first layer any mask of a batch
ablates compute the same thing under every mask, so they run once per sequence; a pre-hook
on that first ablated layer then repeats each sequence's hidden state once per mask.

Protocol (docs/method.md#ablation): prefill ``L-1`` tokens and score the next one. With the mask applied at
every position (the head is removed from the model, prefill included), prefill of tokens
``0..L-2`` followed by decoding is one causal forward over those tokens whose last position
predicts token ``L-1``; only that position's logits are computed (``logits_to_keep=1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from attngeom.extract.capture import decoder


@dataclass(frozen=True)
class HeadGeometry:
    """The model's attention shape: query heads per layer and their width at ``o_proj``."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM, in order (each has ``self_attn.o_proj``)."""
    return list(decoder(model).layers)


def head_geometry(model: torch.nn.Module) -> HeadGeometry:
    config = getattr(model.config, "text_config", None) or model.config
    n_heads = config.num_attention_heads
    o_proj = decoder_layers(model)[0].self_attn.o_proj
    return HeadGeometry(
        n_layers=len(decoder_layers(model)),
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=o_proj.in_features // n_heads,
    )


def apply_head_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` (B, T, H*Dh), an ``o_proj`` input; ``mask`` (B, H), 1 keeps and 0 ablates a head.
    Returns (B, T, H*Dh) with the slices of ablated heads zeroed."""
    b, t, width = x.shape
    n_heads = mask.shape[-1]
    heads = x.reshape(b, t, n_heads, width // n_heads)
    return (heads * mask.to(x.dtype)[:, None, :, None]).reshape(b, t, width)


def first_ablated_layers(masks: torch.Tensor) -> torch.Tensor:
    """masks (M, layers, heads) -> (M,) int64: each mask's first layer with a 0 (``layers`` if none)."""
    ablated = (masks == 0).any(dim=2)
    return torch.where(ablated.any(dim=1), ablated.int().argmax(dim=1), masks.shape[1])


class HeadMasker:
    """Context manager installing the mask hooks on ``model``; idle until :meth:`set`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = decoder_layers(model)
        self._masks: torch.Tensor | None = None
        self._start = len(self.layers)
        self._repeat = 1
        self._handles: list[Any] = []
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set(self, masks: torch.Tensor | None, start: int = 0, repeat: int = 1) -> None:
        """Apply ``masks`` (B', layers, heads) from layer ``start`` on, where each of the B
        input rows is first repeated ``repeat`` times (B' = B * repeat). ``None`` disables."""
        self._masks, self._start, self._repeat = masks, start, repeat
        self._memo = {}

    def _o_proj_hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> tuple | None:
            if self._masks is None or layer < self._start:
                return None
            return (apply_head_mask(args[0], self._masks[:, layer]), *args[1:])

        return hook

    def _repeated(self, value: Any, batch: int) -> Any:
        """``value`` with every tensor of two or more dims whose leading dim is the input batch
        repeated per mask (attention masks, per-sequence positions); batch-1 tensors broadcast
        as they are, and 1-D ones (cache positions) carry no batch."""
        if isinstance(value, torch.Tensor) and batch > 1 and value.ndim >= 2 and value.shape[0] == batch:
            key = id(value)
            if key not in self._memo:
                # Every layer from the start on receives the model's batch-B tensors again.
                self._memo[key] = (value, value.repeat_interleave(self._repeat, dim=0))
            return self._memo[key][1]
        if isinstance(value, tuple | list):
            return type(value)(self._repeated(v, batch) for v in value)
        return value

    def _layer_hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if self._masks is None or layer < self._start or self._repeat == 1:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            batch = hidden.shape[0] if layer == self._start else hidden.shape[0] // self._repeat
            if layer == self._start:
                hidden = hidden.repeat_interleave(self._repeat, dim=0)
            kwargs = {k: self._repeated(v, batch) for k, v in kwargs.items() if k != "hidden_states"}
            if args:
                return (hidden, *self._repeated(args[1:], batch)), kwargs
            return (), {**kwargs, "hidden_states": hidden}

        return hook

    def __enter__(self) -> HeadMasker:
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.self_attn.o_proj.register_forward_pre_hook(self._o_proj_hook(i)))
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
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
) -> torch.Tensor:
    """Decode NLL of token ``L-1`` given tokens ``0..L-2`` under every head mask.

    tokens (S, L) int; masks (M, layers, heads), 1 keeps and 0 ablates. Returns (S, M) float32.
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
    with torch.inference_mode(), HeadMasker(model) as masker, tqdm(
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
                else:
                    masker.set(chunk_masks.repeat(n, 1, 1), start=start, repeat=len(chunk))
                    nll = _last_token_nll(model, ids[seq], targets[seq].repeat_interleave(len(chunk)))
                    nll = nll.view(n, len(chunk))
                out[seq, chunk] = nll.cpu()
                bar.update(1)
    return out


def head_weight_norms(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Frobenius norms (layers, heads) float32 of each query head's slice of W_O (its Dh input
    columns of ``o_proj``) and of W_V (the Dh output rows of ``v_proj`` of the kv head it reads)."""
    geo = head_geometry(model)
    group = geo.n_heads // geo.n_kv_heads
    wo, wv = [], []
    with torch.no_grad():
        for layer in decoder_layers(model):
            o = layer.self_attn.o_proj.weight.float()
            v = layer.self_attn.v_proj.weight.float()
            wo.append(o.reshape(o.shape[0], geo.n_heads, geo.head_dim).norm(dim=(0, 2)))
            kv = v.reshape(geo.n_kv_heads, -1, v.shape[1]).norm(dim=(1, 2))
            wv.append(kv.repeat_interleave(group))
    return torch.stack(wo).cpu(), torch.stack(wv).cpu()
