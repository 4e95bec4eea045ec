#!/usr/bin/env python
"""What prev_attn and recent_attn cost extract's capture: the capture function of one layer
with them against the same function at a git revision before them (run by hand).

    python benchmarks/extract_field_summaries.py                        # the default shapes, L = 1024 and 2048
    python benchmarks/extract_field_summaries.py --shapes 32/8/128 --lengths 4096 --reps 3 --threads 1

Each shape H/KV/Dh is one layer's attention: random float32 queries (1, H, L, Dh), keys and
values (1, KV, L, Dh), causal mask, as transformers hands them to the capture.
``attention_summaries`` of this tree ("new") and of ``--revision`` ("old", loaded from
``git show``: the module depends on torch and transformers only) run side by side in each
repetition, in rotating order, after an untimed warm-up of each; the table gives the median
of the per-repetition ratios new/old of CPU and wall time. The capture is part of a forward,
so the ratio bounds extract's cost of the summaries from above.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import int_list, median, now, rotate, table

from attngeom.extract import tiles

# The last revision whose capture kept no prev_attn or recent_attn.
BEFORE = "3c6ce5c"
# smollm2-135m and gemma3-270m layers, and a paper model's (Llama 3 8B).
SHAPES = ("9/3/64", "4/1/256", "32/8/128")


def capture_at(revision: str) -> object:
    """attngeom.extract.capture as it was at ``revision``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:attngeom/extract/capture.py"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / "capture_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("capture_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def inputs(shape: str, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    heads, kv, dim = (int(x) for x in shape.split("/"))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, dim, generator=g)
    k = torch.randn(1, kv, length, dim, generator=g)
    v = torch.randn(1, kv, length, dim, generator=g)
    return q, k, v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="H/KV/Dh, comma separated")
    p.add_argument("--lengths", type=int_list, default=[1024, 2048])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--revision", default=BEFORE, help=f"git revision of the older capture (default {BEFORE})")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    old = capture_at(args.revision)
    variants = {"new": tiles.attention_summaries, "old": old.attention_summaries}
    rows, results = [], []
    for shape in args.shapes.split(","):
        for length in args.lengths:
            q, k, v = inputs(shape, length)
            scaling = q.shape[-1] ** -0.5

            def run(name: str) -> tuple[float, float]:
                w0, c0 = now()
                with torch.inference_mode():
                    variants[name](q, k, v, None, scaling)
                w1, c1 = now()
                return w1 - w0, c1 - c0

            for name in variants:
                run(name)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            for rep in range(args.reps):
                for name in rotate(list(variants), rep):
                    times[name].append(run(name))
            cpu = median([n[1] / o[1] for n, o in zip(times["new"], times["old"])])
            wall = median([n[0] / o[0] for n, o in zip(times["new"], times["old"])])
            old_ms = 1e3 * median([t[0] for t in times["old"]])
            rows.append([shape, length, old_ms, cpu, wall])
            results.append({"shape": shape, "length": length, "old_wall_ms": old_ms, "cpu_ratio": cpu,
                            "wall_ratio": wall, "times": times})
    print(f"capture of one layer, new / old ({args.revision}), median of {args.reps} repetitions, "
          f"{torch.get_num_threads()} torch threads\n")
    print(table(["H/KV/Dh", "L", "old wall ms", "CPU new/old", "wall new/old"], rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
