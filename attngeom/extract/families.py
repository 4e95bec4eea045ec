"""Which causal LMs the capture can read, from their config alone (before any weight loads).

The capture reads every model whose attention layers call transformers' attention interface
(docs/models.md): it follows the arguments of that call, not a list of model types. What the
config already tells is refused here, in one line: a model class that computes attention in
its own code where attngeom reads none of it (:mod:`attngeom.extract.own_code` reads
``OWN_CODE_TYPES``), or where that attention is not causal as configured, a family whose
attention is not one softmax over keys, a model with no softmax-attention layer at all. What
only a forward tells (an argument the capture does not know, a layer that calls attention
twice) is refused by the capture itself, and a family the test suite does not cover is
compared with its own eager attention first (:mod:`attngeom.extract.conformance`).
"""

from __future__ import annotations

from typing import Any

from attngeom.errors import UnsupportedModelError
from attngeom.extract.model_files import check_config_sizes
from attngeom.extract.sources import cache_dir

__all__ = ["OWN_CODE_TYPES", "VERIFIED_TYPES", "attention_layers", "layer_kind", "loop_layers", "supported_config"]

# The families whose attention is their own code and which `own_code.py` captures (one
# adapter each in its FAMILIES): named here, where the config is judged before torch loads.
OWN_CODE_TYPES = frozenset({"gpt_neo", "openai-gpt", "gpt_neox_japanese", "bloom", "mpt", "xglm", "trocr",
                            "megatron-bert", "rembert", "roformer", "git", "big_bird", "xlm", "mvp", "xlnet",
                            "prophetnet", "reformer"})

# Families whose own code computes an attention no run can store as one causal softmax over
# the text's keys per layer, with why.
OWN_CODE_REFUSED = {
    "cpmant": "its model marks every token as context, so each layer's softmax attends every key, the text's later "
              "tokens and the prompt tokens it puts before the text included: its attention is not causal",
}

# Reformer's LSH layers (its local layers are read from its own code).
LSH_REASON = ("its LSH attention layers hash queries and keys into buckets and mix the softmaxes of several hashing "
              "rounds, each over its own bucket's keys, so a row is no one softmax over the text's keys")

# Own-code families that are causal only where their config says so: model_type -> (the
# config's setting, the value that makes the attention causal).
CAUSAL_SETTING = {"xlm": ("causal", True), "xlnet": ("attn_type", "uni")}

# Encoder-decoder configs whose causal LM runs the decoder alone, while num_hidden_layers
# and num_attention_heads (which a run's layout reads) answer the encoder's: model_type ->
# the decoder's layers and heads.
DECODER_SIZES = {"mvp": ("decoder_layers", "decoder_attention_heads"),
                 "prophetnet": ("num_decoder_layers", "num_decoder_attention_heads")}

# The families whose capture the test suite compares with an eager float64 forward
# (tests/test_families.py); extract checks any other against its eager attention first.
VERIFIED_TYPES = frozenset({
    "llama", "mistral", "gemma", "gemma2", "gemma3_text", "qwen2", "qwen3", "gpt2", "gpt_neox", "olmo", "olmo2",
    "olmo3", "phi", "phi3", "stablelm", "falcon", "mixtral", "qwen3_moe", "starcoder2", "glm4", "ministral",
    "cohere2", "smollm3", "llama4_text", "gpt_oss", "deepseek_v3", "qwen3_next", "granite", "exaone4", "jetmoe",
    "modernbert-decoder", "mimo_v2_flash", "gpt_neo", "openai-gpt", "bloom", "mpt", "gpt_neox_japanese", "xlm", "mvp",
    "prophetnet", "zamba", "zamba2", "hrm_text", "dory",
})

# Families whose attention is not one softmax over keys, as transformers implements them.
NOT_SOFTMAX = {
    "diffllama": "differential attention: each head subtracts two softmax attentions, so no row is one softmax "
                 "over keys",
    "rwkv": "its time mixing is a linear recurrence over the tokens, with no softmax over keys",
    "xlstm": "its mLSTM blocks are a gated linear recurrence over the tokens (a matrix memory), with no softmax over "
             "keys",
}

# config.layer_types entries (transformers normalises every hybrid's to these) whose layers
# hold softmax attention; "hybrid" layers (Falcon-H1, Zamba 2) run attention beside an SSM.
SOFTMAX_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "hybrid", "attention"})
# Kinds without softmax attention: state-space and linear-attention mixers, convolutions,
# and the MLP-only or MoE-only layers of some hybrids.
OTHER_KINDS = frozenset({"linear_attention", "mamba", "conv", "moe", "mlp", "recurrent"})


def _text_stack_class(given: Any, config: Any, model_class: type | None) -> type | None:
    """The class that runs the text stack's attention: the base model of the text config
    (a vision tower beside it, as in GOT-OCR2, runs no text attention), else the causal-LM
    class given or mapped from either config; None when transformers has no causal-LM class
    for the model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    causal = model_class or MODEL_FOR_CAUSAL_LM_MAPPING.get(type(given), None) or MODEL_FOR_CAUSAL_LM_MAPPING.get(
        type(config), None)
    if causal is None:
        return None
    return MODEL_MAPPING.get(type(config), None) or causal


def _class_routes_attention(cls: type) -> bool:
    """Whether ``cls`` computes attention through the attention interface.

    transformers itself decides so, from the class's module source, before it lets a model
    switch its attention implementation (``_can_set_attn_implementation``, a private
    classmethod): asking it here keeps one answer for "may the capture be set" and refuses
    before any weight loads. A class it answers no for would silently keep its own attention.
    """
    return bool(cls._can_set_attn_implementation())


def loop_layers(config: Any) -> tuple[int, ...]:
    """The declared layer run by each layer a looped stack adds after those its config declares,
    in order: Dory runs its recurrent layers once per loop and, in its per-loop cache mode,
    writes each loop after the first to cache layers of its own, appended after the declared
    ones, loop by loop (docs/models.md#looped-stacks); () for any other model."""
    loops = getattr(config, "n_recurrent_loops", None)
    if not loops or getattr(config, "recurrent_kv_cache_mode", None) != "per_loop":
        return ()
    first, count = int(config.n_input_layers), int(config.n_recurrent_layers)
    return tuple(first + j for _ in range(int(loops) - 1) for j in range(count))


def layer_kind(config: Any, layer: int) -> str:
    """The kind of the model's layer ``layer``: its ``layer_types`` entry (for a layer a looped
    stack adds, that of the declared layer it runs), or "attention"."""
    n_layers = int(config.num_hidden_layers)
    if layer >= n_layers:
        layer = loop_layers(config)[layer - n_layers]
    kinds = getattr(config, "layer_types", None)
    return str(kinds[layer]) if kinds else "attention"


def attention_layers(config: Any) -> tuple[int, ...]:
    """The model's own indices of its softmax-attention layers, as its config declares them
    (every layer when it declares no layer types), then those a looped stack adds
    (:func:`loop_layers`). Layers of an unknown kind count: the forward then tells whether
    they call the attention interface. Cross-attention layers (Mllama's) attend an image's
    states, not the text's keys: they run no attention on text."""
    n_layers = int(config.num_hidden_layers) + len(loop_layers(config))
    cross = set(getattr(config, "cross_attention_layers", None) or ())
    return tuple(i for i in range(n_layers) if layer_kind(config, i) not in OTHER_KINDS and i not in cross)


def supported_config(config: Any, model_class: type | None = None) -> Any:
    """The text config of ``config``; refuses, before any weight loads, a model whose attention
    the capture cannot read (:class:`UnsupportedModelError`), and a config declaring more
    than this machine could hold (:class:`InputError`), before its layers are walked.
    ``model_class``: the class of a model given in memory, whose config may be a multimodal
    family's text config (an ``Emu3ForCausalLM`` holds an ``Emu3TextConfig``, which maps to no
    class of its own)."""
    given, config = config, getattr(config, "text_config", None) or config
    model_type = config.model_type
    check_config_sizes(given, getattr(given, "name_or_path", None) or f"model type '{model_type}'", cache_dir())
    if model_type in NOT_SOFTMAX:
        raise UnsupportedModelError(f"model type '{model_type}' is not supported: {NOT_SOFTMAX[model_type]}")
    if model_type in OWN_CODE_REFUSED:
        raise UnsupportedModelError(f"model type '{model_type}' is not supported: {OWN_CODE_REFUSED[model_type]}")
    _check_own_code_config(config)
    stack = _text_stack_class(given, config, model_class)
    if stack is None:
        raise UnsupportedModelError(f"model type '{model_type}' has no causal language model class in transformers")
    if not _class_routes_attention(stack) and model_type not in OWN_CODE_TYPES:
        raise UnsupportedModelError(
            f"model type '{model_type}' is not supported: transformers computes its attention inside the model's "
            "own code, not through its attention interface, and attngeom has no reader of that code for this family"
        )
    stacks = [name for name in getattr(config, "sub_configs", {})
              if getattr(getattr(config, name, None), "num_hidden_layers", None)]
    if not getattr(config, "num_hidden_layers", None) and len(stacks) > 1:
        raise UnsupportedModelError(
            f"model type '{model_type}' is not supported: its layers sit in {len(stacks)} stacks "
            f"({', '.join(stacks)}) over different sequences (as BLT's bytes and patches), and a run stores one "
            "attention over the text's tokens per layer")
    if getattr(config, "recurrent_kv_cache_mode", None) == "last_loop":
        raise UnsupportedModelError(
            f"model type '{model_type}' in its 'last_loop' cache mode is not supported: its loops before the last "
            "share one cache layer, so their runs are no layers of their own, and a run stores one attention per "
            "layer")
    if not getattr(config, "num_hidden_layers", None) or not attention_layers(config):
        raise UnsupportedModelError(f"model type '{model_type}' has no softmax-attention layer to capture")
    return config


def _check_own_code_config(config: Any) -> None:
    """Refuse an own-code family's config whose attention is not causal or not one softmax
    over the text's keys, or whose layer and head counts are not those its causal LM runs."""
    model_type = config.model_type
    if model_type == "reformer" and "lsh" in config.attn_layers:
        raise UnsupportedModelError(f"model type 'reformer' is not supported with attn_layers = "
                                    f"{list(config.attn_layers)}: {LSH_REASON}")
    if model_type in CAUSAL_SETTING:
        setting, causal = CAUSAL_SETTING[model_type]
        if getattr(config, setting) != causal:
            raise UnsupportedModelError(
                f"model type '{model_type}' is not supported with {setting} = {getattr(config, setting)!r}: its "
                f"attention is not causal (only {setting} = {causal!r} is): every query attends every key")
    if model_type in DECODER_SIZES:
        layers, heads = (getattr(config, name) for name in DECODER_SIZES[model_type])
        if (layers, heads) != (config.num_hidden_layers, config.num_attention_heads):
            raise UnsupportedModelError(
                f"model type '{model_type}' is not supported with a decoder of {layers} layers and {heads} heads "
                f"beside an encoder of {config.num_hidden_layers} and {config.num_attention_heads}: its config "
                "answers the encoder's counts, and its causal LM runs the decoder")


def check_recorded(config: Any, recorded: list[int]) -> tuple[int, ...]:
    """The layers a capturing forward recorded, sorted, once checked against the config: every
    declared softmax-attention layer called the attention interface (one that computes its
    attention in its own code would be missing). Refuses otherwise."""
    expected = attention_layers(config)
    missing = [i for i in expected if i not in recorded and layer_kind(config, i) in SOFTMAX_KINDS]
    if missing:
        raise UnsupportedModelError(
            f"layer{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of model type "
            f"'{config.model_type}' never called transformers' attention interface: attngeom cannot read "
            "its attention"
        )
    if not recorded:
        raise UnsupportedModelError(f"no layer of model type '{config.model_type}' called softmax attention")
    return tuple(sorted(recorded))
