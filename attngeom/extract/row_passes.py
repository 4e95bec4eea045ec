"""A tile's scores made probabilities and summarised, row by row: :func:`softmax_rows`.

On CPU (:func:`row_summaries`) each row of scores, 4 to 16 KiB at the paper's lengths, is read from the tile once and then
worked on in the core's first-level cache: its maximum, its exponentials with the
normaliser Z and the sum that gives the entropy, its probabilities, and the winner. The same
as a dozen vectorized torch passes over the whole tile (docs/design-notes.md#extract-score-tiles-and-threads),
each of which reads the tile from memory again.

The loops may reassociate their sums and run in SIMD lanes (``fastmath``), and the
exponential is a polynomial of its own that the compiler vectorizes (numba's ``math.exp`` is a
scalar call without Intel's SVML): rows agree with torch's softmax to a few units in the last
place, the same on any thread count, since one row is always one thread's loop.
Compiled at first use and cached on disk beside the package (numba's cache): about 2 s once
after installing, 0.4 s to load in each process after.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["RowOutputs", "TilePlace", "first_argmax", "softmax_rows", "torch_rows"]

# Below this a float32 exponential is not a normal number: its probability is taken as 0,
# as it is for a masked key.
_EXP_FLOOR = np.float32(-87.0)
_LOG2E = np.float32(1.4426950408889634)
# ln 2 in two parts, the first exact in few bits, so that n ln 2 subtracts without rounding.
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# exp(r) - 1 - r = r^2 (c0 + c1 r + ...) on |r| <= ln 2 / 2, to float32's precision (Cephes' expf).
_C = tuple(np.float32(c) for c in (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3,
                                   1.3981999507e-3, 1.9875691500e-4))

_loop = njit(cache=True, nogil=True, error_model="numpy", fastmath={"nnan", "ninf", "nsz", "reassoc", "contract"})


class RowOutputs(NamedTuple):
    """A layer's per-query results, float32 but the int64 winner, each row laid out as the
    scores' rows are: (KV B, L g), item kv head x sequence, row query x query head of the group
    (docs/method.md#head-taxonomy, docs/method.md#the-fields-head-scores). top1: max_j p_j;
    entropy in nats; winner: argmax_j p_j ||v_j||, the first on ties; sink_attn p_0; diag_attn
    p_i; prev_attn p_(i-1) (0 at i = 0); recent_attn (KV B, L g, W): sum of p_j over j in
    max(1, i-W+1)..i for each window W; learned_sink: the sink's weight, None without one."""

    top1: torch.Tensor
    entropy: torch.Tensor
    winner: torch.Tensor
    sink_attn: torch.Tensor
    diag_attn: torch.Tensor
    prev_attn: torch.Tensor
    recent_attn: torch.Tensor
    learned_sink: torch.Tensor | None


class TilePlace(NamedTuple):
    """Where a tile's scores (N, R, K) sit in the layer: items ``item``..``item`` + N of the
    outputs' rows, queries from ``q0``, ``group`` rows (query heads) per query: row r is
    query q0 + r // group. ``windows``: the recent-mass windows W, ascending."""

    item: int
    q0: int
    group: int
    windows: tuple[int, ...]


def softmax_rows(scores: torch.Tensor, v_norm: torch.Tensor, sinks: torch.Tensor | None, place: TilePlace,
                 out: RowOutputs) -> torch.Tensor:
    """The probabilities (N, R, K) of the rows of a tile of ``scores`` (N, R, K) float32,
    C-contiguous, which it may overwrite, each row summarised into ``out`` at ``place``:
    p_j = e^(s_j - m) / Z, m = max(max_j s_j, sink), Z = sum_j e^(s_j - m) (+ e^(sink - m)),
    H = log Z - sum_j p_j (s_j - m) (the sink a term of it). Masked keys carry a large negative
    floor. v_norm (N, >=K) float32, C-contiguous: ||v_j|| of the keys item n reads; sinks
    (N, R) float32: each row's learned sink logit, a key with no value that joins m and Z
    (docs/method.md#learned-sinks), or None. On CPU one compiled pass per row, the
    probabilities in the scores' buffer; elsewhere :func:`torch_rows`."""
    if scores.device.type != "cpu":
        return torch_rows(scores, v_norm, sinks, place, out)
    with_sinks = sinks is not None
    _rows(scores.numpy(), v_norm.numpy(), (sinks if with_sinks else out.top1).numpy(), with_sinks,
          place.item, place.q0, place.group, np.asarray(place.windows, dtype=np.int64),
          *(a.numpy() for a in out[:7]), (out.learned_sink if with_sinks else out.top1).numpy())
    return scores


def torch_rows(scores: torch.Tensor, v_norm: torch.Tensor, sinks: torch.Tensor | None, place: TilePlace,
               out: RowOutputs) -> torch.Tensor:
    """:func:`softmax_rows` as vectorized torch passes over the whole tile, for any device: the
    probabilities in a buffer of their own.

    With s the scores less their maximum, log p_j = s_j - log Z (and 1/Z = max_j p_j without
    a learned sink), so H = -sum_j p_j log p_j = log Z - sum_j p_j s_j: no log per key. A
    learned sink is one more term of the distribution, - p_s (s_sink). The product takes the
    scores' buffer (``vecdot`` is the same product and sum, with a block-sized temporary),
    and so does A_ij ||v_j|| after it, whose argmax :func:`first_argmax` takes."""
    n_items, n_rows, n_keys = scores.shape
    group, q0 = place.group, place.q0
    n_queries = n_rows // group
    if sinks is None:
        scores.sub_(scores.amax(dim=-1, keepdim=True))
        probs = torch.softmax(scores, dim=-1)
        top1 = probs.amax(dim=-1)
        log_z = -torch.log(top1)
    else:
        # The sink's logit joins the row's maximum and its normaliser Z; its weight
        # e^(sink - m) / Z is the part of the row no key receives.
        top = torch.maximum(scores.amax(dim=-1), sinks)
        scores.sub_(top[..., None])
        sink = sinks - top
        probs = torch.exp(scores)
        z = probs.sum(dim=-1) + torch.exp(sink)
        probs.div_(z[..., None])
        top1 = probs.amax(dim=-1)
        log_z = torch.log(z)
        sink_weight = torch.exp(sink - log_z)
    at = (slice(place.item, place.item + n_items), slice(q0 * group, q0 * group + n_rows))
    entropy = log_z - scores.mul_(probs).sum(dim=-1)
    if sinks is not None:
        entropy -= sink_weight * sink
        out.learned_sink[at] = sink_weight
    out.top1[at] = top1
    out.entropy[at] = entropy
    out.winner[at] = first_argmax(torch.mul(probs, v_norm[:, None, :n_keys], out=scores))
    # (N, 1, Q, g, K): the per-query view of the rows, as recent_mass takes it.
    per_query = probs.view(n_items, 1, n_queries, group, n_keys)
    q1, first_prev = q0 + n_queries, max(q0, 1)
    out.sink_attn[at] = probs[..., 0]
    out.diag_attn[at] = per_query[..., q0:q1].diagonal(dim1=2, dim2=4).permute(0, 1, 3, 2).reshape(n_items, n_rows)
    out.prev_attn[at[0], first_prev * group: q1 * group] = per_query[:, :, first_prev - q0:, :, first_prev - 1: q1 - 1
                                                                      ].diagonal(dim1=2, dim2=4).permute(0, 1, 3, 2
                                                                                                         ).flatten(1)
    if q0 == 0:
        out.prev_attn[at[0], :group] = 0.0
    # Summed over each window's keys, not as a difference of running sums over the row, which
    # would lose the window's few digits beside the mass before it.
    for r, window in enumerate(place.windows):
        recent_mass(per_query, q0, window, out.recent_attn[(*at, r)].view(n_items, 1, n_queries, group))
    return probs


def recent_mass(tile_probs: torch.Tensor, q0: int, window: int, out: torch.Tensor) -> None:
    """The mass on the last ``window`` keys but the sink of each query of a tile:
    sum of A_ij over j in max(1, i-W+1)..i (docs/method.md#the-fields-head-scores).

    tile_probs (kv, B, Q, g, K), contiguous, holds the rows of queries q0..q0+Q-1 over keys
    0..K-1 (K > q0+Q-1); the sums are written into ``out`` (kv, B, Q, g), which may be a
    strided view. A query's last W keys lie at a fixed offset from its
    own position, so for the queries whose window starts after the sink they are one strided
    view (a row step of one row plus one key), summed over W keys and no more; the earlier
    queries (i < W, only when q0 < W) sum keys 1..i of their rows.
    """
    kv, bsz, block, group, keys = tile_probs.shape
    first = min(block, max(0, window - q0))  # the tile's first query whose window starts after the sink
    if first:
        key = torch.arange(1, q0 + first, device=tile_probs.device)
        early = (key <= torch.arange(q0, q0 + first, device=tile_probs.device)[:, None]).float()[:, None]
        out[:, :, :first] = (tile_probs[:, :, :first, :, 1 : q0 + first] * early).sum(dim=-1)
    if first < block:
        stride = tile_probs.stride()
        band = tile_probs.as_strided(
            (kv, bsz, block - first, group, window), (*stride[:2], stride[2] + 1, stride[3], 1),
            tile_probs.storage_offset() + first * stride[2] + q0 + first - window + 1,
        )
        torch.sum(band, dim=-1, out=out[:, :, first:])


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for finite ``x``: int64 index of each row's first maximum. Overwrites x.

    On CPU ``argmax`` over the last dimension is a scalar loop, about 10x slower than ``amax``
    on attention-row shapes. With m the row maximum, [x_j >= m] is 1 exactly where x_j == m
    and 0 elsewhere; weighted by n - j its maximum is n - j* for the smallest such j. Every
    step is a vectorized pass, on CPU and CUDA alike; the in-place comparison makes them four
    (max, compare, weight, max), where ``1 + sign(x_j - m)`` took six.
    """
    n = x.shape[-1]
    x.ge_(x.amax(dim=-1, keepdim=True)).mul_(torch.arange(n, 0, -1, dtype=x.dtype, device=x.device))
    return n - x.amax(dim=-1).long()


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 ``bits`` (2^n from its exponent field)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


# The exponentials keep IEEE order (no reassociation), or the compiler would fold the two
# parts of ln 2 back into one; every other flag lets the loop run in SIMD lanes.
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"nnan", "ninf", "nsz", "contract"})
def _exp_shifted(s, m, out):
    """out_j = e^(s_j - m) for s_j <= m, 0 where that is below ``_EXP_FLOOR``. Range reduction
    x = n ln 2 + r, then e^x = 2^n e^r with e^r a polynomial."""
    for j in range(s.size):
        x = s[j] - m
        y = x if x > _EXP_FLOOR else _EXP_FLOOR
        n = np.floor(y * _LOG2E + np.float32(0.5))
        r = y - n * _LN2_HI - n * _LN2_LO
        p = _C[5]
        p = p * r + _C[4]
        p = p * r + _C[3]
        p = p * r + _C[2]
        p = p * r + _C[1]
        p = p * r + _C[0]
        e = (p * r * r + r + np.float32(1.0)) * _float_of_bits((np.int32(n) + np.int32(127)) << np.int32(23))
        out[j] = e if x >= _EXP_FLOOR else np.float32(0.0)


@_loop
def _ordered(bits):
    """An int32 that orders as the float32 whose bits it holds (NaN aside), and its own inverse:
    integer maxima run in SIMD lanes, numba's float ones (IEEE's NaN rules) do not."""
    return bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))


@_loop
def _rows(scores, v_norm, sinks, with_sinks, item0, q0, group, windows,
          top1, entropy, winner, sink_attn, diag_attn, prev_attn, recent_attn, learned_sink):
    """softmax_rows on CPU: scores (N, R, K) become probabilities; row r of item a is written at
    (item0 + a, q0 group + r) of the outputs (KV B, L g)."""
    n_items, n_rows, n_keys = scores.shape
    e = np.empty(n_keys, dtype=np.float32)
    weighted = np.empty(n_keys, dtype=np.float32)
    weighted_bits = weighted.view(np.int32)  # >= 0: their bits order as they do
    at = np.empty(1, dtype=np.float32)
    e_at = np.zeros(1, dtype=np.float32)
    for a in range(n_items):
        norms = v_norm[a]
        out = item0 + a
        for r in range(n_rows):
            s = scores[a, r]
            bits = s.view(np.int32)
            top = _ordered(bits[0])
            for j in range(n_keys):
                o = _ordered(bits[j])
                top = o if o > top else top
            m = s_max = _float_of_bits(_ordered(top))
            z = t = np.float32(0.0)  # Z, and Z times the mean shifted score
            sink_e = np.float32(0.0)
            if with_sinks:
                at[0] = sinks[a, r]
                m = at[0] if at[0] > m else m
                _exp_shifted(at, m, e_at)
                sink_e = e_at[0]
                z, t = sink_e, sink_e * (at[0] - m)
            _exp_shifted(s, m, e)
            for j in range(n_keys):
                z += e[j]
                t += e[j] * (s[j] - m)
            inv = np.float32(1.0) / z
            best = np.int32(0)
            for j in range(n_keys):
                p = e[j] * inv
                s[j] = p
                weighted[j] = p * norms[j]
                best = weighted_bits[j] if weighted_bits[j] > best else best
            # The first j at the maximum, as a minimum over j (SIMD lanes), not a scan that stops.
            w = n_keys
            for j in range(n_keys):
                first = j if weighted_bits[j] >= best else n_keys
                w = first if first < w else w
            # The largest key's e^(s - m): 1 unless a sink's logit is the row's maximum.
            at[0] = s_max
            _exp_shifted(at, m, e_at)
            row = q0 * group + r
            i = q0 + r // group
            top1[out, row] = e_at[0] * inv
            entropy[out, row] = math.log(z) - t * inv
            winner[out, row] = w
            sink_attn[out, row] = s[0]
            diag_attn[out, row] = s[i]
            prev_attn[out, row] = s[i - 1] if i > 0 else np.float32(0.0)
            for k in range(windows.size):
                mass = np.float32(0.0)
                for j in range(max(1, i - windows[k] + 1), i + 1):
                    mass += s[j]
                recent_attn[out, row, k] = mass
            if with_sinks:
                learned_sink[out, row] = sink_e * inv
