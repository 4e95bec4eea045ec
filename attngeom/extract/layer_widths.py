"""Layers of one model whose values differ in shape (MiMo-V2-Flash: its sliding-window layers
read twice the kv heads of its full ones), in the one ``values`` array of a run.

A run stores every layer with the model's most kv heads and widest value head
(docs/store.md#layers-of-different-widths): a layer of ``k`` kv heads among ``K`` stores kv
head ``c`` in slots ``c * K/k .. (c+1) * K/k - 1`` (the copies its query heads read, as the
model's own ``repeat_kv`` makes them), and a narrower value head is padded with zeros, which
change no norm and no dot product. Head ``h`` then reads slot ``head_kv[h] = h // (H/K)`` in
every layer, and its values are the ones it read in the model.
"""

from __future__ import annotations

import torch

from attngeom.errors import UnsupportedModelError

__all__ = ["layer_shapes", "widened"]


def layer_shapes(values: dict[int, torch.Tensor], heads: dict[int, int]) -> tuple[int, int, tuple[int, ...],
                                                                                  tuple[int, ...]]:
    """(kv heads, value head dim) of the run, and each layer's own kv heads and value head
    dims (both () when every layer has the run's), from each layer's values (B, KV, L, Dv)
    and query heads. Refuses layers of different query heads, or kv heads that do not
    divide the run's."""
    layers = sorted(values)
    if len(set(heads.values())) > 1:
        raise UnsupportedModelError(
            f"the attention layers have different numbers of query heads "
            f"({', '.join(f'layer {l}: {heads[l]}' for l in layers)}): a run stores one count of query heads for every layer")
    kv = tuple(int(values[l].shape[1]) for l in layers)
    dims = tuple(int(values[l].shape[-1]) for l in layers)
    n_kv, head_dim = max(kv), max(dims)
    odd = [l for l, k in zip(layers, kv) if n_kv % k]
    if odd:
        raise UnsupportedModelError(
            f"layer {odd[0]} has {values[odd[0]].shape[1]} kv heads, which do not divide the {n_kv} of the "
            "model's widest layer: a run stores one kv-head dimension")
    uneven = len(set(kv)) > 1 or len(set(dims)) > 1
    return n_kv, head_dim, kv if uneven else (), dims if uneven else ()


def widened(values: torch.Tensor, n_kv: int, head_dim: int) -> torch.Tensor:
    """One layer's values (KV, L, Dv) as the run stores them, (n_kv, L, head_dim): each kv head
    repeated n_kv / KV times in a row, zeros after Dv."""
    kv, length, dim = values.shape
    if kv != n_kv:
        values = values.repeat_interleave(n_kv // kv, dim=0)
    if dim != head_dim:
        values = torch.nn.functional.pad(values, (0, head_dim - dim))
    return values
