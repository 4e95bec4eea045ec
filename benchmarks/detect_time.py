#!/usr/bin/env python
"""detect's wall time per model, and the heads it finds (run by hand).

    python benchmarks/detect_time.py                                  # both offline models, L = 512, S = 16, CPU
    python benchmarks/detect_time.py --models smollm2-135m --length 256 --num-sequences 8 --eager

For each model: extract a run of ``--num-sequences`` windows of ``--dataset`` at ``--length``
(not timed), then ``attngeom.detect`` with its defaults (16 probes, 16 haystacks x 5 depths,
needle of 16 tokens; as many haystacks as the run has windows, up to 16), timed as a whole:
model load, the probe and retrieval forwards through the capture, and the write. With
``--eager``, then the same forwards as a plain eager ``output_attentions`` forward of the
model in float32 (every layer's full L x L rows), the route detect does not take, timed
alone. Prints each model's top heads as it is done, then one table row per model.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time

import numpy as np
import torch

import attngeom as ag
from attngeom.extract.models import load_model, resolve_model


def top(scores, name: str, count: int = 5) -> str:
    values = scores[name].values
    flat = values.argsort(axis=None)[::-1][:count]
    return ", ".join(f"{i}.{j} {values[i, j]:.2f}" for i, j in zip(*np.unravel_index(flat, values.shape)))


def eager_seconds(model_name: str, inputs: list[np.ndarray], batch_size: int, device: str) -> float:
    """Wall time of eager float32 forwards with output_attentions over ``inputs`` (model loaded first)."""
    model = load_model(resolve_model(model_name), device=device, dtype=torch.float32)
    model.set_attn_implementation("eager")
    start = time.perf_counter()
    with torch.inference_mode():
        for tokens in inputs:
            for b0 in range(0, len(tokens), batch_size):
                ids = torch.from_numpy(tokens[b0 : b0 + batch_size]).to(device)
                model.get_decoder()(input_ids=ids, output_attentions=True, use_cache=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--num-sequences", type=int, default=16)
    parser.add_argument("--dataset", default="python-docs", help="an offline corpus with documents of L-1 tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eager", action="store_true", help="also time the eager output_attentions forwards")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {args.device}, {args.dataset}, L = {args.length}, S = {args.num_sequences}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            store = f"{tmp}/{name}.zarr"
            run_id = ag.extract(name, store=store, dataset=args.dataset, context_length=args.length,
                                num_sequences=args.num_sequences, progress=False).run_id
            start = time.perf_counter()
            result = ag.detect(store, run_id, device=args.device, progress=False)
            seconds = time.perf_counter() - start
            scores = result.scores
            print(f"{name}: detect {seconds:.1f} s")
            print(f"{name}: induction {top(scores, 'induction_score')}")
            print(f"{name}: retrieval {top(scores, 'retrieval_score')}")
            print(f"{name}: duplicate {top(scores, 'duplicate_score', 3)}; prev_token {top(scores, 'prev_token_score', 3)}",
                  flush=True)
            eager = None
            if args.eager:
                inputs = [result.probes["probe_tokens"].values, result.retrieval["retrieval_tokens"].values]
                eager = eager_seconds(name, inputs, 8, args.device)
            rows.append((name, seconds, eager, int((scores["induction_score"] > 0.4).sum()),
                         int((scores["retrieval_score"] > 0.1).sum()), scores.sizes["layer"] * scores.sizes["head"]))
    print("| model | detect (s) | eager output_attentions forwards alone (s) | heads induction > 0.4 | heads retrieval > 0.1 | heads |")
    print("|---|---|---|---|---|---|")
    for name, seconds, eager, induction, retrieval, heads in rows:
        print(f"| {name} | {seconds:.1f} | {'' if eager is None else f'{eager:.1f}'} | {induction} | {retrieval} | {heads} |")


if __name__ == "__main__":
    main()
