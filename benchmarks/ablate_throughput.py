#!/usr/bin/env python
"""Ablation throughput: head masks per second, batched against one forward per mask (run by hand).

    python benchmarks/ablate_throughput.py                        # smollm2-135m, L = 64, 4 sequences
    python benchmarks/ablate_throughput.py --model gemma3-270m --length 64 --layers 6
    python benchmarks/ablate_throughput.py --device cuda --dtype bfloat16 --length 1024 --batch-sizes 64,256

Every variant computes the ablate stage's quantity, the decode NLL of token L-1 given tokens
0..L-2 of each sequence under each mask (``attngeom.ablate.masking.masked_nll``), for the same
masks and sequences; a mask counts once however many sequences it is evaluated on.

* "per mask": one forward per mask, carrying the S sequences (the usual hook-per-head loop);
* "batched B": up to B (sequence, mask) rows per forward, each row its own mask; layers below
  a batch's first ablated layer run once per sequence and are shared by its masks.

Two mask sets: the single-head masks of every head of ``--layers`` evenly spaced layers (a
slice of the single-head stage, where the layers below a mask's layer are shared by the masks
of that layer), and as many random 50% masks (every layer ablated, as in the sparsification
sweep: nothing to share, only batching). Sequences are
random token ids after the model's BOS: throughput does not depend on the text. Model load is
excluded; each variant runs once untimed, then ``--reps`` times; the table gives the median.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from attngeom.ablate.masking import head_geometry, masked_nll
from attngeom.extract.models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model


def timed(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls after one untimed warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=64, help="L: context length (L-1 tokens are fed)")
    parser.add_argument("--num-sequences", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3, help="layers (evenly spaced) whose heads make the single-head set")
    parser.add_argument("--batch-sizes", default="16,64", help="(sequence, mask) rows per forward")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    source = resolve_model(args.model)
    model = load_model(source, device=device, dtype=dtype)
    geo = head_geometry(model)
    bos = load_tokenizer(source).bos_token_id
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    tokens = torch.randint(10, vocab, (args.num_sequences, args.length), generator=generator)
    tokens[:, 0] = bos

    layers = torch.linspace(0, geo.n_layers - 1, args.layers).round().long().tolist()
    single = torch.ones(len(layers) * geo.n_heads, geo.n_layers, geo.n_heads)
    for i, (layer, head) in enumerate((l, h) for l in layers for h in range(geo.n_heads)):
        single[i, layer, head] = 0
    random = (torch.rand(len(single), geo.n_layers, geo.n_heads, generator=generator) < 0.5).float()

    print(f"model {args.model}: {geo.n_layers} layers x {geo.n_heads} heads ({geo.n_kv_heads} kv), "
          f"device {device}, dtype {str(dtype).removeprefix('torch.')}, L {args.length}, "
          f"{args.num_sequences} sequences, {len(single)} masks per set (single-head: layers {layers}), torch threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'mask set':<14}{'variant':<14}{'seconds':>10}{'masks/s':>10}{'speed-up':>10}")
    for name, masks in (("single-head", single), ("random 50%", random)):
        per_mask = timed(
            lambda: [masked_nll(model, tokens, masks[i : i + 1], batch_size=args.num_sequences) for i in range(len(masks))],
            args.reps,
        )
        print(f"{name:<14}{'per mask':<14}{per_mask:>10.3f}{len(masks) / per_mask:>10.1f}{1.0:>10.2f}")
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            seconds = timed(lambda: masked_nll(model, tokens, masks, batch_size=batch), args.reps)
            print(f"{name:<14}{f'batched {batch}':<14}{seconds:>10.3f}{len(masks) / seconds:>10.1f}{per_mask / seconds:>10.2f}")


if __name__ == "__main__":
    main()
