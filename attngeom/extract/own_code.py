"""Capture of the families whose attention transformers computes in the model's own code.

GPT-Neo, GPT-1 (openai-gpt), GPT-NeoX-Japanese, BLOOM, MPT, XGLM, TrOCR, Megatron-BERT,
RemBERT, RoFormer, BigBird, Git's text stack, XLM, MVP, XLNet, ProphetNet and Reformer (its
local layers) never call the attention interface: each attention module computes its probabilities itself, the first
three in an inner ``_attn`` from the queries, keys and values their forward split into heads,
XLNet in an inner ``rel_attn_core`` (its content stream, with relative position terms),
BLOOM's and MPT's inside their forward with an ALiBi bias, ProphetNet's main stream inside
its forward beside its n-gram streams, Reformer's over chunks, the others inside their forward
(RoFormer's with its rotary). For the duration of a capture, that method of each of the model's attention modules
is replaced, on the instance only, by one that takes the same q, k, v, the family's mask (its
causal or windowed ``bias`` buffer, its ALiBi bias or relative position terms and the model's
padding mask, as one additive mask) and its scale to the capture's path, layer by layer as
the forward runs, and returns what the method returns. The model's own method stays the
reference: with queries to check, it runs on the same arguments in float32 and its weights
are what the conformance check compares the rows with.

This is the one module that reaches into those modules' internals (``_attn``, ``bias``,
``scale``, the projections, ALiBi and relative position arguments of the others):
transformers exposes no interface for them. tests/test_families.py compares each family's
stored rows with the model's own float64 forward, or its own float32 code where it does not
run in float64, so a change in transformers shows there.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from attngeom.errors import UnsupportedModelError
from attngeom.extract.families import OWN_CODE_TYPES

__all__ = ["OWN_CODE_TYPES", "Attend", "Reference", "own_code_attention", "plain_attention"]

# (output (B, P, H, Dv), weights (B, H, P, L)) of the model's own code at the checked queries.
Reference = tuple[torch.Tensor, torch.Tensor]
# The capture's path for one call: (module, layer, query, key, value, additive float32 mask,
# scaling, the model's own code at the checked queries (a callable of those queries)) ->
# output (B, L, H, Dv).
Attend = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Family:
    """How one family's attention is read. ``attention``: the class whose ``method`` is
    replaced; ``read`` (module, the method's arguments by name) -> (query, key, value
    (B, H, L, D), additive float32 mask (B|1, 1|H, L, L), scaling); ``returns`` (module,
    output (B, L, H, Dv), the arguments) -> what the method returns. The method returns its
    weights (B, H, L, L) second (when asked, by ``output_attentions``), and first its attention
    output (B, H, L, Dv) where ``method`` is the inner ``_attn``, or the layer's output where
    it is the module's ``forward``. ``name``: how the self-attention's module path ends, where
    a layer holds a cross-attention of the same class beside it. ``own``: (module, what
    ``method`` returns with its weights) -> (output (B, H, L, Dv), or None where ``method`` is
    ``forward``, weights (B, H, L, L)), for a method that lays them out otherwise. ``repeats_layers``: whether ablation may repeat a decoder
    layer's inputs once per head mask (a layer module that takes batch-first states and adds
    its own residual); else each sequence runs whole once per mask. ``ablation``: why ablation
    cannot zero this family's heads, where it cannot."""

    attention: str
    method: str
    read: Callable[..., tuple]
    returns: Callable[..., object]
    name: str | None = None
    own: Callable[[torch.nn.Module, tuple], tuple[torch.Tensor | None, torch.Tensor]] | None = None
    repeats_layers: bool = True
    ablation: str | None = None


LOW = torch.finfo(torch.float32).min


def _additive(allowed: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """Float32 (B|1, 1, L, L): 0 (or the padding mask's value) where ``allowed``, the float32
    lowest value where the family's mask hides a key."""
    if padding is None:
        return torch.where(allowed, 0.0, LOW)
    if padding.dtype == torch.bool:
        return torch.where(allowed & padding, 0.0, LOW)
    return torch.where(allowed, padding.float().clamp(min=LOW), LOW)


def _read_gpt_neo(module, a):
    query, key = a["query"], a["key"]
    length = key.shape[-2]
    # Local layers' bias buffer holds their window; GPT-Neo scales no logit by 1/sqrt(d).
    allowed = module.bias[:, :, length - query.shape[-2]: length, :length]
    return query, key, a["value"], _additive(allowed, a["attention_mask"]), 1.0


def _read_openai_gpt(module, a):
    k, v = a["k"], a["v"]
    length = k.shape[-1]
    allowed = module.bias[:, :, :length, :length].bool()
    # Keys arrive transposed (B, H, Dh, L) for the product; the scale is 1/sqrt(Dv) when set.
    scaling = 1 / math.sqrt(v.shape[-1]) if module.scale else 1.0
    return a["q"], k.transpose(-1, -2), v, _additive(allowed, a["attention_mask"]), scaling


def _read_gpt_neox_japanese(module, a):
    mask = a["attention_mask"]
    query, key = a["query"], a["key"]
    if mask is None:  # its own code masks nothing then
        mask = torch.zeros(1, 1, query.shape[-2], key.shape[-2], device=query.device)
    elif mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, LOW)
    return query, key, a["value"], mask.float().clamp(min=LOW), 1 / module.norm_factor


def _read_bloom(module, a):
    hidden = a["hidden_states"]
    query, key, value = module._reshape(module.query_key_value(hidden))
    if a["layer_past"] is not None:
        key, value = a["layer_past"].update(key, value, module.layer_idx)
    bsz, n_heads, length = query.shape[:3]
    # scores = beta * alibi + q k^T / sqrt(d), then the additive causal mask.
    bias = module.beta * a["alibi"].float().view(-1, n_heads, 1, key.shape[2])
    # Ablation repeats each sequence's states per head mask, but not the (B H, 1, L) ALiBi.
    bias = bias.repeat_interleave(bsz // bias.shape[0], dim=0)
    mask = a["attention_mask"]
    if mask is None:
        mask = torch.where(torch.ones(length, key.shape[2], dtype=torch.bool, device=hidden.device).tril(
            key.shape[2] - length), 0.0, LOW)
    mask = mask.float() if mask.dtype != torch.bool else torch.where(mask, 0.0, LOW)
    return query, key, value, torch.where(mask > LOW / 2, bias + mask, LOW), module.inv_norm_factor


def _bloom_returns(module, output, a):
    context = output.reshape(*output.shape[:2], -1)
    if module.pretraining_tp > 1 and module.slow_but_exact:
        slices = module.hidden_size / module.pretraining_tp
        dense = torch.zeros_like(context)
        for i in range(module.pretraining_tp):
            dense = dense + torch.nn.functional.linear(context[:, :, int(i * slices): int((i + 1) * slices)],
                                                       module.dense.weight[:, int(i * slices): int((i + 1) * slices)])
    else:
        dense = module.dense(context)
    return a["residual"] + torch.nn.functional.dropout(dense, p=module.hidden_dropout, training=module.training), None


def _read_mpt(module, a):
    hidden = a["hidden_states"]
    bsz, length = hidden.shape[:2]
    mixed = module.Wqkv(hidden)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (t.reshape(bsz, length, module.n_heads, module.head_dim).transpose(1, 2)
                         for t in mixed.chunk(3, dim=2))
    if a["cache"] is not None:
        key, value = a["cache"].update(key, value, module.layer_idx, kwargs=a.get("kwargs", {}))
    n_keys = key.shape[2]
    bias = torch.zeros(1, module.n_heads, 1, n_keys, device=hidden.device)
    if a["position_bias"] is not None:
        bias = a["position_bias"][:, -1:, -n_keys:].float()[None]
    # MPT fills its scores where the mask is set (nonzero), whatever the mask's dtype.
    mask = a["attention_mask"]
    return query, key, value, bias if mask is None else bias.masked_fill(mask.bool(), LOW), module.softmax_scale


def _out_proj_returns(module, output, a):
    return module.out_proj(output.reshape(*output.shape[:2], -1)), None


def _out_lin_returns(module, output, a):
    return module.out_lin(output.reshape(*output.shape[:2], -1)), None


def _read_scaled_queries(module, a):
    """XGLM's and TrOCR's decoder self-attention."""
    if a["key_value_states"] is not None:
        raise UnsupportedModelError(f"{type(module).__name__}'s cross-attention attends an encoder's states, not the "
                                    "text's tokens")
    hidden = a["hidden_states"]
    bsz, length = hidden.shape[:2]

    def heads(t):
        return t.view(bsz, length, -1, module.head_dim).transpose(1, 2)

    # Both scale the queries, not the scores: the capture's scale is then 1, the same bits.
    query = heads(module.q_proj(hidden) * module.scaling)
    key, value = heads(module.k_proj(hidden)), heads(module.v_proj(hidden))
    cache = getattr(a["cache"], "self_attention_cache", a["cache"])  # TrOCR's is an encoder-decoder cache
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=a["kwargs"])
    mask = a["attention_mask"]
    if mask is None:  # these mask nothing then
        return query, key, value, torch.zeros(1, 1, length, key.shape[2], device=hidden.device), 1.0
    return query, key, value, mask.float().clamp(min=LOW), 1.0


def _read_bert_self_attention(module, a):
    """Megatron-BERT's, RemBERT's, RoFormer's, BigBird's and Git's self-attention as a decoder
    (RoFormer's rotary from the ``sinusoidal_pos`` its encoder hands every layer)."""
    if a.get("encoder_hidden_states") is not None:
        raise UnsupportedModelError(f"{type(module).__name__}'s cross-attention attends an encoder's states, not the "
                                    "text's tokens")
    if not getattr(module, "is_decoder", True):
        raise UnsupportedModelError(f"the attention of {type(module).__name__} is not causal (its config is no "
                                    "decoder's: is_decoder is off): every query attends every key")
    hidden = a["hidden_states"]
    shape = (*hidden.shape[:-1], -1, module.attention_head_size)
    query, key, value = (getattr(module, name)(hidden).view(shape).transpose(1, 2) for name in ("query", "key", "value"))
    if a.get("sinusoidal_pos") is not None:
        if module.rotary_value:
            query, key, value = module.apply_rotary_position_embeddings(a["sinusoidal_pos"], query, key, value)
        else:
            query, key = module.apply_rotary_position_embeddings(a["sinusoidal_pos"], query, key)
    cache = getattr(a["cache"], "self_attention_cache", a["cache"])
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=a["kwargs"])
    mask = a["attention_mask"]
    if mask is None:  # their own code masks nothing then
        mask = torch.zeros(1, 1, query.shape[2], key.shape[2], device=hidden.device)
    elif mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, LOW)
    return query, key, value, mask.float().clamp(min=LOW), 1 / math.sqrt(module.attention_head_size)


def _context_returns(module, output, a):
    return output.reshape(*output.shape[:2], -1), None


def _read_xlm(module, a):
    if a["kv"] is not None:
        raise UnsupportedModelError("XLM's attention over a source sentence attends other states, not the text's "
                                    "tokens")
    hidden, mask = a["input"], a["mask"]
    if mask.dim() != 3:  # a padding mask over keys alone
        raise UnsupportedModelError("the attention of XLM is not causal (its config's causal is off): every query "
                                    "attends every key")
    bsz, length = hidden.shape[:2]

    def heads(t):
        return t.view(bsz, -1, module.n_heads, module.head_dim).transpose(1, 2)

    # XLM scales its queries before the product: the capture's scale is then 1, the same bits.
    # Its model makes a cache in every forward, empty in a capture's: the keys are the text's.
    query = heads(module.q_lin(hidden)) / math.sqrt(module.head_dim)
    allowed = mask.view(bsz, 1, length, -1) != 0
    return query, heads(module.k_lin(hidden)), heads(module.v_lin(hidden)), _additive(allowed, None), 1.0


def _read_xlnet(module, a):
    """XLNet's relative attention (``attn_type`` "uni"), its content stream: the scores are
    (q + r_w) k plus a position term (q + r_r) r and a segment term, all scaled, so the
    capture takes q + r_w and the scaled other terms as an additive mask. Its tensors are
    laid out (L, B, H, D)."""
    q, key, mask = a["q_head"], a["k_head_h"], a["attn_mask"]
    if mask is None:
        raise UnsupportedModelError("the attention of XLNet is not causal (its config's attn_type is 'bi'): every "
                                    "query attends every key")
    position = torch.einsum("ibnd,jbnd->bnij", q + module.r_r_bias, a["k_head_r"])
    position = module.rel_shift_bnij(position, klen=key.shape[0])
    if a["seg_mat"] is not None:
        segment = torch.einsum("ibnd,snd->ibns", q + module.r_s_bias, module.seg_embed)
        position = position + torch.einsum("ijbs,ibns->bnij", a["seg_mat"], segment)
    hidden = torch.einsum("ijbn->bnij", mask) > 0  # 1 where the key is hidden

    def bhld(t):
        return t.permute(1, 2, 0, 3)

    bias = torch.where(hidden, LOW, (position * module.scale).float())
    return bhld(q + module.r_w_bias), bhld(key), bhld(a["v_head_h"]), bias, module.scale


def _xlnet_returns(module, output, a):
    vector = output.transpose(0, 1)  # (L, B, H, Dv), as its post-attention reads it
    return (vector, None) if a["output_attentions"] else vector


def _read_prophetnet(module, a):
    """ProphetNet's n-gram self-attention, its main stream: the text's tokens, causal, with a
    relative position bias each query computes from its own state. The n-gram streams after
    it, which predict the tokens further ahead, run in the model's own code."""
    hidden = a["hidden_states"]
    bsz, streams = hidden.shape[:2]
    length = streams // (1 + module.ngram)

    def main(t):
        return module._shape(t, streams, bsz)[:, :, :length]

    # Projected over every stream and scaled before the product, as its own code does: the
    # same bits. A capture's forward runs without a cache, so the main keys are the text's.
    query = main(module.query_proj(hidden) / module.head_dim**0.5)
    key, value = main(module.key_proj(hidden)), main(module.value_proj(hidden))
    scores = torch.empty(bsz, module.num_attn_heads, length, length, device=hidden.device)  # its shape alone
    bias = module.get_main_relative_pos_embeddings(hidden[:, :length], scores, a["position_ids"],
                                                   a["main_relative_position_buckets"]).float()
    mask = a["attention_mask"]
    if mask is not None:
        bias = bias + mask.float().clamp(min=LOW)
    return query, key, value, bias.clamp(min=LOW), 1.0


def _read_reformer_local(module, a):
    """Reformer's local attention: each query attends, causally, the keys of its chunk and of
    the ``num_chunks_before`` chunks before it, counted round the text as its own code gathers
    them (the first chunk's previous is the last, whose keys the causal mask hides)."""
    hidden = a["hidden_states"]
    length = hidden.shape[1]

    def heads(t):
        return module._split_hidden_size_dim(t, module.num_attention_heads, module.attention_head_size)

    # Reformer scales its keys before the product: the capture's scale is then 1, the same bits.
    query, value = heads(module.query(hidden)), heads(module.value(hidden))
    key = heads(module.key(hidden)) / math.sqrt(module.attention_head_size)
    position = torch.arange(length, device=hidden.device)
    allowed = position[None, :] <= position[:, None]
    if module.chunk_length is not None and length > module.chunk_length:
        chunks, chunk = length // module.chunk_length, position // module.chunk_length
        offsets = range(-module.num_chunks_before, module.num_chunks_after + 1)
        times = sum((chunk[None, :] == (chunk[:, None] + k) % chunks).int() for k in offsets)
        if bool((times[allowed] > 1).any()):
            raise UnsupportedModelError(
                f"Reformer's local attention over {chunks} chunks of {module.chunk_length} tokens reaches some chunks "
                f"twice (its chunk and the {module.num_chunks_before} before it, counted round the text): its "
                "softmax weighs their keys twice, which no row over the text's keys holds")
        allowed = allowed & (times > 0)
    # The padding its model adds to reach a multiple of the chunk length hides its keys.
    padding = a["attention_mask"]
    allowed = allowed[None, None] if padding is None else allowed & padding.bool()[:, None, None, :]
    return query, key, value, _additive(allowed, None), 1.0


def _reformer_returns(module, output, a):
    outputs = sys.modules[type(module).__module__].LocalSelfAttentionOutput
    return outputs(hidden_states=output.reshape(*output.shape[:2], -1), attention_probs=())


def _reformer_rows(module, result) -> tuple[None, torch.Tensor]:
    """Reformer's local weights, (B, H, chunks, chunk, window) where the text is longer than a
    chunk, laid over the text's keys (B, H, L, L)."""
    weights = result.attention_probs
    if weights.dim() == 4:
        return None, weights
    bsz, n_heads, chunks, size, width = weights.shape
    offsets = torch.arange(-module.num_chunks_before, module.num_chunks_after + 1, device=weights.device)
    chunk = (torch.arange(chunks, device=weights.device)[:, None] + offsets) % chunks
    keys = (chunk[:, :, None] * size + torch.arange(size, device=weights.device)).reshape(chunks, 1, width)
    rows = weights.new_zeros(bsz, n_heads, chunks, size, chunks * size)
    rows.scatter_add_(-1, keys.expand(bsz, n_heads, chunks, size, width), weights)
    return None, rows.reshape(bsz, n_heads, chunks * size, chunks * size)


def _prophetnet_returns(module, output, a):
    """The main stream's output from the capture, the n-gram streams' from the model's own
    code (which reads the main stream's keys and values, not its output)."""
    own = type(module).forward(module, a["hidden_states"], cache=a["cache"], attention_mask=a["attention_mask"],
                               extended_predict_attention_mask=a["extended_predict_attention_mask"],
                               main_relative_position_buckets=a["main_relative_position_buckets"],
                               predict_relative_position_buckets=a["predict_relative_position_buckets"],
                               position_ids=a["position_ids"])
    length = output.shape[1]
    main = module.out_proj(output.reshape(*output.shape[:2], -1))
    return torch.cat([main, own[0][:, length:]], dim=1), None, None


FAMILIES: dict[str, Family] = {
    "gpt_neo": Family("GPTNeoSelfAttention", "_attn", _read_gpt_neo, lambda module, out, a: (out.transpose(1, 2), None)),
    "openai-gpt": Family("Attention", "_attn", _read_openai_gpt, lambda module, out, a: [out.transpose(1, 2)]),
    "gpt_neox_japanese": Family("GPTNeoXJapaneseAttention", "_attn", _read_gpt_neox_japanese,
                                lambda module, out, a: (out.transpose(1, 2), None)),
    "bloom": Family("BloomAttention", "forward", _read_bloom, _bloom_returns),
    "mpt": Family("MptAttention", "forward", _read_mpt, _out_proj_returns),
    "xglm": Family("XGLMAttention", "forward", _read_scaled_queries, _out_proj_returns),
    "trocr": Family("TrOCRAttention", "forward", _read_scaled_queries, _out_proj_returns, name="self_attn"),
    "megatron-bert": Family("MegatronBertSelfAttention", "forward", _read_bert_self_attention, _context_returns,
                            name="attention.self"),
    "rembert": Family("RemBertSelfAttention", "forward", _read_bert_self_attention, _context_returns,
                      name="attention.self"),
    "roformer": Family("RoFormerSelfAttention", "forward", _read_bert_self_attention, _context_returns,
                       name="attention.self"),
    "git": Family("GitSelfAttention", "forward", _read_bert_self_attention, _context_returns, name="attention.self"),
    # A BigBird decoder's attention is its full one (its block-sparse one refuses to decode).
    "big_bird": Family("BigBirdSelfAttention", "forward", _read_bert_self_attention, _context_returns,
                       name="attention.self"),
    # XLM's model adds each attention's output to its states itself, around no layer module.
    "xlm": Family("MultiHeadAttention", "forward", _read_xlm, _out_lin_returns, repeats_layers=False),
    "mvp": Family("MvpAttention", "forward", _read_scaled_queries, _out_proj_returns, name="self_attn"),
    # Its layers take their states sequence-first (L, B, D).
    "xlnet": Family("XLNetRelativeAttention", "rel_attn_core", _read_xlnet, _xlnet_returns,
                    own=lambda module, result: (result[0].permute(1, 2, 0, 3), result[1].permute(2, 3, 0, 1)),
                    repeats_layers=False),
    # Its local layers' (an LSH layer's config is refused): the self-attention of a
    # ReformerAttention, whose output projection is its sibling.
    "reformer": Family("LocalSelfAttention", "forward", _read_reformer_local, _reformer_returns, own=_reformer_rows),
    "prophetnet": Family(
        "ProphetNetNgramSelfAttention", "forward", _read_prophetnet, _prophetnet_returns,
        ablation="ProphetNet predicts the next token from its first n-gram stream, whose attention runs in its "
                 "own code beside the stored main stream's, so zeroing a stored head would leave it in that stream"),
}


def plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """softmax(scaling q k^T + mask) @ v in float32, as these families compute it: query, key,
    value (B, H, L, D), mask additive (B|1, 1|H, L, L) -> output (B, L, H, Dv) in value's dtype."""
    scores = scaling * query.float() @ key.float().transpose(-1, -2) + mask
    return (torch.softmax(scores, dim=-1) @ value.float()).transpose(1, 2).to(value.dtype)


def _own_reference(family: Family, original: Callable, signature: inspect.Signature, module: torch.nn.Module,
                   args: tuple, kwargs: dict, value: torch.Tensor) -> Callable[[tuple[int, ...]], Reference]:
    """The model's own method on its own arguments in float32, asked for its weights, at the
    queries asked for; its output there, or the weights @ ``value`` where its output is the
    layer's."""

    def at(positions: tuple[int, ...]) -> Reference:
        call = signature.bind(module, *args, **kwargs)
        for name, given in call.arguments.items():
            if isinstance(given, torch.Tensor) and given.is_floating_point():
                call.arguments[name] = given.float()
        if "output_attentions" in signature.parameters:
            call.arguments["output_attentions"] = True
        result = original(*call.args, **call.kwargs)
        out, weights = family.own(module, result) if family.own is not None else result[:2]
        weights = weights[:, :, list(positions)].float()
        if family.method != "forward":
            return out[:, :, list(positions)].transpose(1, 2), weights
        return (weights @ value.float()).transpose(1, 2), weights

    return at


@contextlib.contextmanager
def own_code_attention(model: torch.nn.Module, model_type: str, attend: Attend) -> Iterator[None]:
    """Within the block, each attention module of ``model`` (a ``model_type`` of
    ``OWN_CODE_TYPES``) runs its attention through ``attend``, layer by layer in model order;
    the modules' own methods are restored on exit."""
    family = FAMILIES[model_type]
    modules = [m for name, m in model.named_modules() if type(m).__name__ == family.attention
               and (family.name is None or name.endswith(f".{family.name}"))]
    n_layers = model.config.get_text_config().num_hidden_layers
    if not modules:
        raise UnsupportedModelError(
            f"model type '{model_type}' runs no {family.attention}: its attention is another of its own code's "
            "(BigBird's block-sparse attention of an encoder, for one), which attngeom does not read"
        )
    if len(modules) != n_layers:
        raise UnsupportedModelError(
            f"model type '{model_type}' holds {len(modules)} {family.attention} modules for its {n_layers} layers: "
            "attngeom cannot tell their layers"
        )
    for layer, module in enumerate(modules):
        original = getattr(type(module), family.method)

        def replaced(self, *args, layer=layer, original=original, signature=inspect.signature(original), **kwargs):
            call = signature.bind(self, *args, **kwargs)
            call.apply_defaults()
            query, key, value, mask, scaling = family.read(self, call.arguments)
            output = attend(self, layer, query, key, value, mask, scaling,
                            _own_reference(family, original, signature, self, args, kwargs, value))
            return family.returns(self, output, call.arguments)

        setattr(module, family.method, types.MethodType(replaced, module))
    try:
        yield
    finally:
        for module in modules:
            delattr(module, family.method)
