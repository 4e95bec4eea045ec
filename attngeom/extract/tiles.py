"""The tile maths of the capture: a layer's float32 attention rows recomputed from its post-RoPE
queries and keys one tile of scores at a time, and each row reduced to what the store keeps.

:func:`attention_summaries` is the kernel (docs/store.md#run-arrays for what it yields);
:func:`score_tile` sizes its tiles; tests/test_capture.py holds its brute-force twin.
On CPU a layer's tiles, and the copies of its layout, are shared out among threads of one
torch thread each (:mod:`attngeom.extract.threads`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from attngeom.extract.phases import phase
from attngeom.extract.row_passes import RowOutputs, TilePlace, softmax_rows
from attngeom.extract.threads import share_out
from attngeom.store.objects.schema import RECENT_WINDOWS

__all__ = ["MASKED", "LayerCapture", "allowed_keys", "attention_summaries", "key_floor", "masked_floor",
           "score_tile"]
# Bytes of float32 scores one tile (a block of queries of some kv heads) may take on CPU; a
# handful of tile-sized temporaries live at once. 2 MiB tiles ran 1.9-4.7x faster than 64 MiB
# ones (smollm2-135m and gemma3-270m layer shapes, L=512-1024) and no slower than 0.5-4 MiB
# ones: the temporaries stay in cache (4 MiB, in the whole forward at L=512 and 1024:
# 1.045-1.052 of SDPA against 1.028-1.051 for smollm2-135m, 0.980-1.026 against 0.941-0.978
# for gemma3-270m).
CPU_TILE_BYTES = 2 * 2**20
# Fewest rows (queries x the query heads of one kv head) a tile's score product may have: with
# many heads or long rows a 2 MiB tile of every kv head holds a few queries only (16 for 32
# heads at L=1024, 4 for 32 heads at L=4096), and products and passes that small run about 3x
# slower than tiles of 4 kv heads x 128 queries of the same bytes; such layers take fewer kv
# heads per tile.
MIN_PRODUCT_ROWS = 128
# On CUDA a tile is sized from the GPU's memory: large tiles keep the kernel launches few, and
# about six tile-sized temporaries live at once beside the model and its activations (1.25 GiB
# tiles on an 80 GB GPU). From the total, not the free memory, so that one GPU kind always takes
# the same tiles and a float32 model's rows @ v the same rounding, run after run.
CUDA_TILE_SHARE = 64
CUDA_MIN_TILE_BYTES = 64 * 2**20
# Bytes of float32 queries from which a layer's layout copies are shared out among the tile
# threads (CPU). On one thread they took 0.2 ms at smollm2-135m's and gemma3-270m's layers
# (L=1024), less than waking and meeting a thread may cost on a busy machine, and 23 ms at
# 32/32/128 (L=1024), 94 ms at 32/8/128 (L=4096): a tenth and a thirtieth of their captures.
LAYOUT_SHARE_BYTES = 8 * 2**20
MASKED = -1e30


@dataclass
class LayerCapture:
    """What one layer yields for a batch of B sequences of length L.

    values (B, KV, L, Dh) in the model dtype; attn_last (B, H, L) float32, the final query's
    row; winner (B, H, L) int64, j* (docs/method.md#head-taxonomy) per query; sink_attn, diag_attn, top1_attn,
    entropy, prev_attn (B, H, L) float32 per query (entropy in nats); recent_attn (B, H, L, R)
    float32, the mass on the last W keys but the sink for each window W of ``recent``
    (docs/method.md#the-fields-head-scores); attendable (L,) bool, keys the
    final query may attend; rows (B, H, L, L) float16 when full rows are kept; query_rows
    (B, H, Q, L) float32, the rows of the Q queries asked for (--queries), 0 after each query;
    learned_sink (B, H, L) float32, the weight s_i of a model's learned sink, None without one
    (docs/method.md#learned-sinks).
    """

    values: torch.Tensor
    attn_last: torch.Tensor
    winner: torch.Tensor
    sink_attn: torch.Tensor
    diag_attn: torch.Tensor
    top1_attn: torch.Tensor
    entropy: torch.Tensor
    prev_attn: torch.Tensor
    recent_attn: torch.Tensor
    attendable: torch.Tensor
    rows: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    learned_sink: torch.Tensor | None = None


def allowed_keys(
    attention_mask: torch.Tensor | None, q0: int, q1: int, length: int, device: torch.device
) -> torch.Tensor:
    """Boolean (B|1, 1|H, q1-q0, L) mask of the keys each query in [q0, q1) may attend.

    ``attention_mask`` is what transformers passes to the attention function: None when plain
    causal attention lets SDPA use ``is_causal``, a boolean mask (True = attend), or an additive
    float mask (0 = attend; a bias such as ALiBi elsewhere, the dtype's lowest value where masked).
    """
    if attention_mask is None:
        q = torch.arange(q0, q1, device=device)[:, None]
        k = torch.arange(length, device=device)[None, :]
        return (k <= q)[None, None]
    block = attention_mask[:, :, q0:q1, :length]
    if block.dtype == torch.bool:
        return block
    return block > torch.finfo(block.dtype).min / 2


def key_floor(attention_mask: torch.Tensor, q0: int, q1: int, n_keys: int) -> torch.Tensor:
    """Float32 (B|1, 1|H, q1-q0, n_keys) added to the scores of queries [q0, q1): ``MASKED``
    where a key is hidden, 0 where it is attended, and an additive mask's bias (ALiBi) as given."""
    block = attention_mask[:, :, q0:q1, :n_keys]
    if block.dtype == torch.bool:
        return masked_floor(block)
    return block.float().clamp(min=MASKED)


def _tile_floor(floor: torch.Tensor, h0: int, h1: int, group: int) -> torch.Tensor:
    """The part of a block's floor (B|1, 1|H, Q, K) that the tile of kv heads [h0, h1) adds,
    laid out as its per-query scores (kv, B, Q, g, K): broadcast over heads, or each head's own."""
    if floor.shape[1] == 1:
        return floor[:, 0][None, :, :, None]
    bsz, _, block, keys = floor.shape
    return floor[:, h0 * group : h1 * group].view(bsz, h1 - h0, group, block, keys).permute(1, 0, 3, 2, 4)


def masked_floor(allowed: torch.Tensor) -> torch.Tensor:
    """Float32 0 where ``allowed``, ``MASKED`` elsewhere: the additive form of the mask."""
    return torch.where(allowed, 0.0, MASKED).float()


def score_tile(
    bsz: int, n_heads: int, n_kv: int, length: int, device: torch.device, tile_bytes: int | None = None
) -> tuple[int, int]:
    """(kv heads, queries) of one tile of the float32 scores of a layer: B sequences, H query
    heads reading KV kv heads, L keys. A tile holds at most ``tile_bytes`` of scores (default
    per device: ``CPU_TILE_BYTES`` on CPU, a share of the GPU's memory on CUDA), every kv head
    while its products keep ``MIN_PRODUCT_ROWS`` rows, fewer kv heads (in even tiles) where
    they would not. The tile changes results in rounding only: the entropy's sum, a float32
    model's rows @ v, and with tiles of a query or two the softmax; winners stayed equal."""
    if tile_bytes is None:
        tile_bytes = _tile_bytes(device)
    group = n_heads // n_kv
    query_bytes = bsz * group * length * 4  # one query's scores, one kv head
    kv_tile, block = n_kv, tile_bytes // (n_kv * query_bytes)
    if block * group < MIN_PRODUCT_ROWS:
        block = -(-MIN_PRODUCT_ROWS // group)
        fit = max(1, min(n_kv, tile_bytes // (block * query_bytes)))
        kv_tile = -(-n_kv // -(-n_kv // fit))
        block = max(block, tile_bytes // (kv_tile * query_bytes))
    return kv_tile, max(1, min(length, block))


def _tile_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_TILE_BYTES
    _, total = torch.cuda.mem_get_info(device)
    return max(CUDA_MIN_TILE_BYTES, total // CUDA_TILE_SHARE)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T for each of the batch's matrices: q (N, rows, Dh), k (N, keys, Dh) -> (N, rows, keys)."""
    if q.device.type != "cpu":
        return torch.bmm(q, k.transpose(1, 2))
    # On CPU bmm shares out whole matrices among the threads: 3 kv heads on 2 cores left one
    # core idle a third of the time. mm splits each product: bmm's bits at the real models'
    # block shapes (tiny ones differ by an ulp), and the scores of a smollm2-135m layer took
    # 1.15 against 1.35-1.6 ms at L=512, 3.9 against 4.6-5.4 ms at L=1024.
    scores = torch.empty(q.shape[0], q.shape[1], k.shape[1], device=q.device)
    for i in range(q.shape[0]):
        torch.mm(q[i], k[i].T, out=scores[i])
    return scores


def attention_summaries(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    keep_rows: bool = False,
    queries: tuple[int, ...] = (),
    need_output: bool = False,
    tile: tuple[int, int] | None = None,
    recent: tuple[int, ...] = RECENT_WINDOWS,
    threads: int = 1,
) -> tuple[LayerCapture, torch.Tensor | None]:
    """Per-query summaries of ``softmax(scaling * q k^T + mask)`` for one layer.

    query and key (B, H, L, Dh) and (B, KV, L, Dh), value (B, KV, L, Dv) with query head h
    reading kv head h // (H/KV) (Dv differs from Dh in latent attention). ``softcap``: logits
    c tanh(s / c) before the mask; ``attention_mask`` additive float masks carry their biases
    (ALiBi) and may differ per head; ``sinks`` (H,) or (B, H, L, 1): each head's (or each
    head's and query's) learned sink logit, a key with no value in the softmax, whose weight is ``learned_sink`` and which the rows exclude (they
    sum to 1 - s_i; docs/method.md#learned-sinks). Scores are computed in float32 one ``tile`` at a time: (kv heads, queries),
    default :func:`score_tile` (memory bounded at any L). ``winner`` is argmax_j A_ij ||v_j|| with ties to the smaller
    j. ``queries`` (ascending positions) have their float32 rows
    kept, the same numbers as ``attn_last`` at L-1. With ``need_output`` (a float32 model, or a softcapped one SDPA
    cannot run) the attention output (B, L, H, Dh) is returned too. ``prev_attn`` is
    A_i,i-1 (0 at i = 0) and ``recent_attn`` the sum of A_ij over j in max(1, i-W+1)..i for
    each W of ``recent``: masked keys have probability 0, so only attendable keys count
    (docs/method.md#the-fields-head-scores).

    Each tile of scores is one product, the mask's add, and the rows' softmax and summaries
    (:func:`~attngeom.extract.row_passes.softmax_rows`: one compiled pass per row on CPU,
    torch's vectorized passes on CUDA). On a GPU those passes belong in one fused kernel beside
    the flash pass: given the row's log-normaliser log Z, which the SDPA/flash forward already
    computes, p_j = exp(s_j - log Z), and sink, diag, top-1, entropy and winner are each a
    running reduction of one more pass over the scores, with no block of probabilities
    written. Not written here: there is no GPU to prove it on.
    """
    bsz, n_heads, length, head_dim = query.shape
    n_kv = key.shape[1]
    group = n_heads // n_kv
    device = query.device
    # kv-head-major, query-major rows: the g query heads of one kv head sit side by side for
    # each query, so a tile of queries of some kv heads is one contiguous (kv*B, rows*g, Dh)
    # block of matrices that multiplies its keys as it is, one product per kv head shared by
    # the group, with no copy (the head-major einsum copied every block; 1.13 -> 1.04 of the
    # SDPA forward, smollm2-135m L=1024). Scaling q costs one pass over L x Dh instead of one
    # over every tile of scores. Large layers are laid out one kv head per item on the tiles'
    # threads: copies, the same bits on any of them.
    value_dim = value.shape[-1]
    copy_threads = threads if query.numel() * 4 >= LAYOUT_SHARE_BYTES else 1
    q = torch.empty(n_kv, bsz, length * group, head_dim, device=device)
    k = torch.empty(n_kv, bsz, length, head_dim, device=device)
    v = torch.empty(n_kv, bsz, length, value_dim, device=device)
    grouped = query.reshape(bsz, n_kv, group, length, head_dim)

    def lay_out(h: int) -> None:
        q[h].view(bsz, length, group, head_dim).copy_(grouped[:, h].transpose(1, 2)).mul_(scaling)
        k[h].copy_(key[:, h])
        v[h].copy_(value[:, h])

    share_out(lay_out, range(n_kv), copy_threads)
    # Each row's sink logit, laid out as the rows are (KV B, L g): a head's for all its queries,
    # or each query's own.
    sink_rows = None
    if sinks is not None:
        per_head = sinks.numel() == n_heads
        sink_rows = (sinks.float().view(n_kv, 1, 1, group) if per_head else
                     sinks.float().view(bsz, n_kv, group, length).permute(1, 0, 3, 2)
                     ).expand(n_kv, bsz, length, group).reshape(n_kv * bsz, length * group)
    v_norm = v.norm(dim=-1).flatten(0, 1)
    kv_tile, block = tile or score_tile(bsz, n_heads, n_kv, length, device)

    # Per-query results, row by row as the tiles' scores lay them out: (KV B, L g), (B, H, L) at the end.
    def per_row(*more: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(n_kv * bsz, length * group, *more, device=device, dtype=dtype)

    out = RowOutputs(top1=per_row(), entropy=per_row(), winner=per_row(dtype=torch.int64), sink_attn=per_row(),
                     diag_attn=per_row(), prev_attn=per_row(), recent_attn=per_row(len(recent)),
                     learned_sink=per_row() if sinks is not None else None)
    rows = (
        torch.zeros(n_kv, bsz, group, length, length, device=device, dtype=torch.float16)
        if keep_rows
        else None
    )
    query_rows = (
        torch.zeros(n_kv, bsz, len(queries), group, length, device=device, dtype=torch.float32)
        if queries
        else None
    )
    output = torch.empty(n_kv, bsz, length * group, value_dim, device=device) if need_output else None
    # Causal blocks: keys [q0, q1) are the only ones hidden from some of the block's queries;
    # their floor (block, 1, block) is added like ``masked_floor`` below.
    above_diagonal = (
        masked_floor(~torch.ones(block, block, dtype=torch.bool, device=device).triu(1))[:, None]
        if attention_mask is None
        else None
    )
    attn_last = torch.empty(n_kv, bsz, group, length, device=device)

    def run_tile(tile: tuple[int, int]) -> None:
        q0, h0 = tile
        q1, h1 = min(length, q0 + block), min(n_kv, h0 + kv_tile)
        if attention_mask is None:
            n_keys = q1
        else:
            # A causal mask hides every key after the block's last query from all its queries:
            # scoring only keys [0, q1) halves the work on average and changes no row.
            n_keys = length if bool(allowed_keys(attention_mask, q0, q1, length, device)[..., q1:].any()) else q1
            floor = key_floor(attention_mask, q0, q1, n_keys)
        # The kept queries inside the block: a slice of the ascending positions.
        lo, hi = bisect.bisect_left(queries, q0), bisect.bisect_left(queries, q1)
        inside = torch.tensor(queries[lo:hi], device=device) - q0 if query_rows is not None and hi > lo else None
        with phase("attngeom.rows"):
            scores = _scores(q[h0:h1, :, q0 * group : q1 * group].flatten(0, 1),
                             k[h0:h1, :, :n_keys].flatten(0, 1))
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            # (kv, B, block, g, keys): the per-query view of the same scores.
            per_query = scores.view(h1 - h0, bsz, q1 - q0, group, n_keys)
            # A finite floor, not -inf, for masked keys: their probability still underflows to 0,
            # and 0 * floor stays 0 in the entropy below. s + MASKED rounds to MASKED exactly for
            # any score below 1e22, so adding the floor equals filling it; a broadcast add is a
            # vectorized pass, a broadcast fill is not.
            if attention_mask is None:
                per_query[..., q0:q1].add_(above_diagonal[: q1 - q0, :, : q1 - q0])
            else:
                per_query.add_(_tile_floor(floor, h0, h1, group))
            sink = None if sink_rows is None else sink_rows[h0 * bsz: h1 * bsz, q0 * group: q1 * group].contiguous()
            probs = softmax_rows(scores, v_norm[h0 * bsz: h1 * bsz], sink, TilePlace(h0 * bsz, q0, group, recent), out)
        tile_probs = probs.view(h1 - h0, bsz, q1 - q0, group, n_keys)
        if rows is not None:
            rows.transpose(2, 3)[h0:h1, :, q0:q1, :, :n_keys] = tile_probs
        if inside is not None:
            query_rows[h0:h1, :, lo:hi, :, :n_keys] = tile_probs[:, :, inside]
        if output is not None:
            with phase("attngeom.output"):
                torch.bmm(probs, v[h0:h1, :, :n_keys].flatten(0, 1),
                          out=output[h0:h1, :, q0 * group : q1 * group].flatten(0, 1))
        if q1 == length:
            attn_last[h0:h1] = tile_probs[:, :, -1]

    # Tiles in query order, so that a thread's tiles of one block share its mask and keys.
    share_out(run_tile, [(q0, h0) for q0 in range(0, length, block) for h0 in range(0, n_kv, kv_tile)], threads)
    last_allowed = allowed_keys(attention_mask, length - 1, length, length, device)[0, :, -1].all(dim=0)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(n_kv, bsz, length, group).permute(1, 0, 3, 2).reshape(bsz, n_heads, length)

    capture = LayerCapture(
        values=value,
        attn_last=attn_last.transpose(0, 1).reshape(bsz, n_heads, length),
        winner=heads(out.winner),
        sink_attn=heads(out.sink_attn),
        diag_attn=heads(out.diag_attn),
        top1_attn=heads(out.top1),
        entropy=heads(out.entropy),
        prev_attn=heads(out.prev_attn),
        recent_attn=out.recent_attn.view(n_kv, bsz, length, group, len(recent)).permute(1, 0, 3, 2, 4).reshape(
            bsz, n_heads, length, len(recent)),
        attendable=last_allowed,
        rows=rows.transpose(0, 1).reshape(bsz, n_heads, length, length) if rows is not None else None,
        query_rows=(
            query_rows.permute(1, 0, 3, 2, 4).reshape(bsz, n_heads, len(queries), length)
            if query_rows is not None
            else None
        ),
        learned_sink=heads(out.learned_sink) if sinks is not None else None,
    )
    attn_output = None
    if output is not None:
        attn_output = torch.empty(bsz, length, n_heads, value_dim, device=device, dtype=query.dtype)
        per_query = output.view(n_kv, bsz, length, group, value_dim)
        share_out(lambda h: attn_output[:, :, h * group : (h + 1) * group].copy_(per_query[h]), range(n_kv),
                  copy_threads)
    return capture, attn_output
