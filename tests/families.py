"""Tiny random configs of every family the capture is verified on, from transformers' own
config classes (nothing downloaded): three to six layers of 64 dimensions (HRM's 4 attention
modules run at its 12), 4 heads reading 2 kv heads where the family has grouped queries, a
window or chunk of 6 keys where it slides or chunks, so that a test of L = 16 crosses it."""

from __future__ import annotations

COMMON = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]

# model_type -> (the variants it exercises, its config's arguments beyond COMMON)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("grouped queries", {}),
    "mistral": ("sliding window", dict(sliding_window=6)),
    "qwen2": ("grouped queries, qkv bias", {}),
    "qwen3": ("q/k norm", {}),
    "gemma": ("grouped queries", {}),
    "gemma2": ("softcapped logits, sliding window", dict(sliding_window=6, attn_logit_softcapping=5.0,
                                                         layer_types=SLIDING)),
    "gemma3_text": ("sliding window, q/k norm", dict(sliding_window=6, layer_types=SLIDING)),
    "gpt2": ("learned positions, fused qkv, inverse-layer scaling", dict(
        n_embd=64, n_layer=3, n_head=4, n_positions=256, scale_attn_by_inverse_layer_idx=True)),
    "gpt_neox": ("partial rotary (Pythia)", dict(rotary_pct=0.25, num_key_value_heads=4)),
    "olmo": ("clipped qkv", dict(clip_qkv=8.0)),
    "olmo2": ("q/k norm over all heads", {}),
    "olmo3": ("sliding window, q/k norm", dict(sliding_window=6, layer_types=SLIDING)),
    "phi": ("partial rotary, dense output", dict(partial_rotary_factor=0.5, num_key_value_heads=4)),
    "phi3": ("fused qkv, sliding window", dict(sliding_window=6)),
    "stablelm": ("partial rotary, per-head layer norm", dict(partial_rotary_factor=0.25, qk_layernorm=True)),
    "falcon": ("ALiBi biases in the mask", dict(alibi=True, num_kv_heads=4, head_dim=None, new_decoder_architecture=False,
                                                multi_query=False, parallel_attn=True)),
    "mixtral": ("mixture of experts, sliding window", dict(num_local_experts=4, num_experts_per_tok=2,
                                                          sliding_window=6)),
    "qwen3_moe": ("mixture of experts", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "starcoder2": ("sliding window, biases", dict(sliding_window=6)),
    "glm4": ("partial rotary, sandwich norms", dict(partial_rotary_factor=0.5)),
    "ministral": ("sliding window layers", dict(sliding_window=6, layer_types=SLIDING)),
    "cohere2": ("sliding window, global layers without positions", dict(
        sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "smollm3": ("layers without positions", dict(no_rope_layers=[1, 0, 1])),
    "llama4_text": ("chunked attention, layers without positions, temperature tuning", dict(
        attention_chunk_size=6, layer_types=["chunked_attention", "chunked_attention", "full_attention"],
        no_rope_layers=[1, 1, 0], num_local_experts=2, intermediate_size_mlp=96, interleave_moe_layer_step=2,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5)),
    "gpt_oss": ("learned sinks, sliding window, mixture of experts", dict(
        sliding_window=6, layer_types=SLIDING, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("multi-head latent attention (value width differs), mixture of experts", dict(
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        head_dim=None, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1)),
    "qwen3_next": ("hybrid: gated softmax attention beside linear attention", dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                          "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
    "granite": ("multipliers on logits and residuals", dict(attention_multiplier=0.3, residual_multiplier=0.5)),
    "exaone4": ("sliding window, q/k norm", dict(sliding_window=6, layer_types=SLIDING)),
    "jetmoe": ("mixture of attention heads (its output viewed per expert)", dict(
        num_local_experts=4, num_experts_per_tok=2, kv_channels=16, num_key_value_heads=4)),
    "modernbert-decoder": ("local and global layers; get_decoder() answers the LM head", dict(
        num_key_value_heads=4, sliding_window=6, cls_token_id=None, sep_token_id=None)),
    "mimo_v2_flash": ("sliding-window layers with learned sinks and twice the kv heads of the full ones, "
                      "values narrower than keys", dict(
        num_key_value_heads=1, v_head_dim=12, sliding_window=6,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32)),
    "gpt_neo": ("attention in the model's own code, unscaled logits, local layers of a window of 6", dict(
        attention_types=[[["global", "local", "local"], 1]], window_size=6)),
    "openai-gpt": ("attention in the model's own code (GPT-1)", dict(n_embd=64, n_layer=3, n_head=4,
                                                                      n_positions=256)),
    "gpt_neox_japanese": ("attention in the model's own code, rotary", dict(intermediate_multiple_size=2)),
    "bloom": ("ALiBi in the model's own code", dict(n_layer=3, n_head=4)),
    "mpt": ("ALiBi in the model's own code, clipped qkv", dict(
        d_model=64, n_heads=4, n_layers=3, max_seq_len=256, attn_config=dict(alibi=True, clip_qkv=8.0))),
    "xlm": ("attention in the model's own code, causal as configured, no layer modules", dict(
        causal=True, num_key_value_heads=None)),
    "mvp": ("attention in the model's own code, the decoder of an encoder-decoder config", dict(
        decoder_layers=3, decoder_attention_heads=4, decoder_ffn_dim=96, encoder_ffn_dim=96, num_key_value_heads=None)),
    "prophetnet": ("the main stream of n-gram attention, relative position bias in the model's own code", dict(
        num_hidden_layers=None, num_encoder_layers=3, num_decoder_layers=3, num_decoder_attention_heads=4,
        decoder_ffn_dim=96, encoder_ffn_dim=96, num_buckets=8, relative_max_distance=16, num_key_value_heads=None)),
    "zamba": ("hybrid: one attention block, its weights tied, applied at depths 2 and 4 beside Mamba layers",
              dict(num_hidden_layers=6, attn_layer_period=2, attn_layer_offset=1, attention_hidden_size=128,
                   attention_head_dim=32, num_key_value_heads=4, mamba_dt_rank=8, use_mamba_kernels=False,
                   head_dim=None)),
    "zamba2": ("hybrid: a shared attention block with per-depth adapters, at depths 1 and 3", dict(
        num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], hybrid_layer_ids=[1, 3],
        num_key_value_heads=4, mamba_headdim=16, n_mamba_heads=8, use_mamba_kernels=False, mamba_d_state=16,
        chunk_size=8, head_dim=None, use_shared_attention_adapter=True, adapter_rank=8)),
    "hrm_text": ("looped stacks: two stacks of 2 layers run in 2 high cycles of 2 low cycles each, every run a "
                 "layer of its own (12)", dict(
        num_hidden_layers=2, H_cycles=2, L_cycles=2, L_bp_cycles=[1], num_key_value_heads=None)),
    "dory": ("a looped layer: its full-attention layer 1 run in 2 loops, the second stored as layer 3, between "
             "sliding-window layers", dict(
        n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2, sliding_window=6,
        layer_types=SLIDING)),
}


def family_config(model_type: str):
    """The tiny config of ``model_type`` (a key of FAMILIES)."""
    from transformers import AutoConfig

    arguments = {**COMMON, **FAMILIES[model_type][1]}
    return AutoConfig.for_model(model_type, **{k: v for k, v in arguments.items() if v is not None})

INKLING = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=6, d_rel=4,
               rel_extent=16, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
               mlp_layer_types=["sparse", "sparse", "sparse"], moe_intermediate_size=32, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, log_scaling_n_floor=4)

# Families read through the conformance check (their capture compared with their own eager
# attention in float32, as extract does for any family outside FAMILIES), each with what it
# exercises: model_type -> (variants, config arguments beyond COMMON; for a multimodal family,
# those of its text config).
CHECKED: dict[str, tuple[str, dict]] = {
    "emu3": ("an in-memory Emu3ForCausalLM holding Emu3's text config", {}),
    "mllama": ("an in-memory MllamaForCausalLM; cross-attention layers, which attend no text", dict(
        cross_attention_layers=[1])),
    "got_ocr2": ("a Qwen2 text model beside a vision tower that computes its own softmax", {}),
    "granite_swa": ("learned sinks applied after the product (eager returns rows before them)", dict(
        sliding_window=6)),
    "granitemoe_swa": ("learned sinks after the product, mixture of experts", dict(
        sliding_window=6, num_local_experts=4, num_experts_per_tok=2)),
    "inkling_text": ("an additive relative position bias (position_bias)", INKLING),
    "inkling2_text": ("position bias, learned sinks per query, attention over earlier blocks' outputs", INKLING),
    "deepseek_v32": ("sparse attention: each query's softmax over the 4 keys its indexer selects", dict(
        num_key_value_heads=4, head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, index_topk=4, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse", "sparse"], layer_types=["indexed_attention"] * 3)),
    # XGLM's own code does not run in float64 (it clamps its scores with a float64 lowest value
    # in a float32 tensor), so it has no float64 reference.
    "xglm": ("attention in the model's own code, queries scaled before the product", dict(
        d_model=64, num_layers=3, attention_heads=4, ffn_dim=96)),
    # TrOCR's decoder, like XGLM's, scales its queries in float32 in its own code; each layer
    # holds a cross-attention of the same class, which a text alone does not run.
    "trocr": ("attention in the model's own code beside an unused cross-attention of its class", dict(
        d_model=64, decoder_layers=3, decoder_attention_heads=4, decoder_ffn_dim=96)),
    # BERT-like decoders (is_decoder, as their causal-LM classes ask), attention in their own
    # code, read through the conformance check as TrOCR is.
    "megatron-bert": ("attention in the model's own code, a BERT decoder", dict(is_decoder=True)),
    "rembert": ("attention in the model's own code, narrower input embeddings", dict(
        is_decoder=True, input_embedding_size=32, output_embedding_size=32)),
    "roformer": ("attention in the model's own code, rotary", dict(is_decoder=True)),
    "big_bird": ("attention in the model's own code, its full attention as a decoder", dict(
        is_decoder=True, attention_type="original_full")),
    # XLNet's own code does not run in float64 (its projections are float32 tensors whatever
    # the model's dtype).
    "xlnet": ("relative attention in the model's own code (attn_type 'uni'), sequence-first states", dict(
        attn_type="uni", d_head=16, d_inner=96, max_position_embeddings=None, num_key_value_heads=None)),
    "reformer": ("local attention in the model's own code: chunks of 4 and the one before, reversible layers", dict(
        is_decoder=True, attn_layers=["local"] * 3, local_attn_chunk_length=4, attention_head_size=16,
        feed_forward_size=96, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32], num_key_value_heads=None)),
    "git": ("attention in the model's own code; a vision tower beside it, which a text alone does not run", dict(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16))),
}


def checked_model(model_type: str):
    """A tiny random float32 model of ``model_type`` (a key of CHECKED), in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    arguments = {**COMMON, **CHECKED[model_type][1]}
    torch.manual_seed(0)
    if model_type in ("emu3", "mllama"):
        outer = AutoConfig.for_model(model_type)
        text = type(outer.get_text_config())(**arguments)
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(outer)](text).float().eval()
    if model_type == "got_ocr2":
        text = {k: v for k, v in arguments.items() if k != "pad_token_id"}
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16, mlp_dim=48,
            output_channels=16, global_attn_indexes=[1], window_size=2))
    else:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in arguments.items() if v is not None})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

# Families refused at their first forward, each with the words of its true reason and its
# config's arguments beyond COMMON.
REFUSED_AT_FORWARD: dict[str, tuple[str, dict]] = {
    # Its compressed sparse layer (1) attends, beside its window's tokens, one entry pooled
    # from every 4 tokens; its heavily compressed layers pool 128, none in 16 tokens.
    "deepseek_v4": (r"\(layer 1\) attends 4 keys beyond the text's 16 tokens", dict(
        num_hidden_layers=3, num_key_value_heads=4, head_dim=8, q_lora_rank=32, qk_rope_head_dim=8, sliding_window=6,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, index_topk=4, index_head_dim=16,
        index_n_heads=2, layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                      "heavily_compressed_attention"], mlp_layer_types=["hash_moe", "moe", "moe"])),
}


def refused_model(model_type: str):
    """A tiny random float32 model of ``model_type`` (a key of REFUSED_AT_FORWARD)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arguments = {**COMMON, **REFUSED_AT_FORWARD[model_type][1]}
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in arguments.items() if v is not None})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
