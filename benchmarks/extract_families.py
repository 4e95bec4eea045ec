#!/usr/bin/env python
"""extract() of the attention variants of today's families against their bare forward (run by hand).

    python benchmarks/extract_families.py
    python benchmarks/extract_families.py --families gpt2,gpt_oss --length 512 --num-sequences 2 --reps 3

Per family, a random-weight model of one shape (``--hidden``, ``--layers``, ``--heads`` of 64
dimensions, 2 kv heads where the family groups queries) is built from transformers' own
config class, and each repetition times side by side, order rotated:

* "extract": ``ag.extract(model, token_ids=...)`` into a fresh store (the model in memory);
* "forward": the bare forward of the same batches: the decoder alone, the model's own
  attention implementation (SDPA, or eager where the family needs it: gpt-oss's sinks), no
  capture, no LM head.

Ratios are taken within each repetition (process CPU time and wall) and reported as medians.
Families whose attention is eager by default (gpt-oss) return the capture's own float32
output; the others in float32 too (the capture's rows @ v replace the forward's attention).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import numpy as np
import torch
from common import median, now, rotate, table

import attngeom as ag
from attngeom.extract.capture import decoder

# Arguments beyond the shape for each family's config: the variant it exercises.
FAMILIES = {
    "llama": ("grouped queries (reference)", {}),
    "gpt2": ("fused qkv, learned positions", {}),
    "gpt_neox": ("partial rotary", {"rotary_pct": 0.25}),
    "falcon": ("ALiBi biases in the mask", {"alibi": True, "new_decoder_architecture": False, "multi_query": False}),
    "gpt_oss": ("learned sinks, sliding window 128", {"sliding_window": 128, "num_local_experts": 2,
                                                      "num_experts_per_tok": 1}),
    "deepseek_v3": ("latent attention", {"q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
                                         "qk_nope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 2,
                                         "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
                                         "first_k_dense_replace": 64}),
    "llama4_text": ("chunked attention 128, layers without positions", {
        "attention_chunk_size": 128, "num_local_experts": 1, "interleave_moe_layer_step": 64}),
}


def build(family: str, hidden: int, layers: int, heads: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=2 if family != "deepseek_v3" else heads,
                 max_position_embeddings=8192, bos_token_id=1, n_embd=hidden, n_layer=layers, n_head=heads,
                 n_positions=8192, moe_intermediate_size=hidden, intermediate_size_mlp=2 * hidden)
    config = AutoConfig.for_model(family, **shape, **FAMILIES[family][1])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--num-sequences", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    rows = []
    for family in args.families.split(","):
        model = build(family, args.hidden, args.layers, args.heads)
        ids = np.random.default_rng(0).integers(4, 4096, (args.num_sequences, args.length))
        ids[:, 0] = 1
        workdir = tempfile.mkdtemp(prefix="attngeom-families-")

        def extract(rep: int) -> None:
            ag.extract(model, store=f"{workdir}/r{rep}.zarr", token_ids=ids, run_id="r", progress=False)

        def forward(rep: int) -> None:
            with torch.inference_mode():
                for row in ids:
                    decoder(model)(input_ids=torch.from_numpy(row[None]), use_cache=False)

        extract(-1)  # warm-up: first-call costs out of the timings
        ratios: dict[str, list[float]] = {"cpu": [], "wall": []}
        for rep in range(args.reps):
            took = {}
            for name, fn in rotate([("extract", extract), ("forward", forward)], rep):
                wall0, cpu0 = now()
                fn(rep)
                wall1, cpu1 = now()
                took[name] = (wall1 - wall0, cpu1 - cpu0)
            ratios["wall"].append(took["extract"][0] / took["forward"][0])
            ratios["cpu"].append(took["extract"][1] / took["forward"][1])
        shutil.rmtree(workdir, ignore_errors=True)
        rows.append([family, FAMILIES[family][0], f"{median(ratios['cpu']):.2f}", f"{median(ratios['wall']):.2f}"])
        print(table(["family", "variant", "extract / forward, CPU", "wall"], rows[-1:]), flush=True)
    print()
    print(f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads, L = {args.length}, "
          f"{args.num_sequences} sequences, {args.reps} repetitions, torch threads {torch.get_num_threads()}")
    print(table(["family", "variant", "extract / forward, CPU", "wall"], rows))


if __name__ == "__main__":
    main()
