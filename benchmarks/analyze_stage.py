#!/usr/bin/env python
"""Where analyze's time goes beyond its kernels, at the paper's shapes (run by hand).

    python benchmarks/analyze_stage.py                          # ~10 min on 2 cores
    python benchmarks/analyze_stage.py --shapes llama2-7b --reps 5

For each shape, two synthetic stores (``attngeom.extract.synthetic.write_synthetic_run``) of
``--layers`` layers at L = ``--length``, one of 1 sequence and one of ``--sequences``. In every
repetition, in this process, order rotating:

- **stage**: ``ag.analyze(store, scheduler="threads")`` of each store from scratch, BLAS on one
  thread; the marginal CPU time per (sequence, layer, head) instance is the difference of the
  two stores' CPU times over the difference of their instances;
- **kernels**: ``attngeom.analyze.kernels.head_metrics`` on every (sequence, layer) block of
  the larger store, its inputs read beforehand, one thread: CPU time per instance;
- **read**: reading and decompressing the larger store's inputs (attn_last, values, winner) a
  block at a time, as the stage's tasks read them (``common.read_inputs``): CPU time per
  instance.

stage / kernels is the ratio the stage should keep near 1. The phases of the larger store's
analyze are timed too, in one more analyze of it per repetition, from profiles that replace
nothing of the package: the steps in this thread (cProfile, the thread's CPU time: the input
checks, the record, creating and appending groups, the reductions across sequences, the
commit) and the (sequence, layer) blocks in the
worker threads (Dask's task profile, wall time); and so is the call's fixed cost: the CPU
time of the 1-sequence store's analyze beyond its kernels.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import tempfile
import time

import numpy as np
from common import PAPER_SHAPES as SHAPES, analyze_fresh, default_n_grid, fmt, median, read_inputs, rotate, table
from dask.diagnostics import Profiler
from dask.utils import key_split
from threadpoolctl import threadpool_limits

import attngeom as ag
from attngeom.analyze.kernels import head_metrics
from attngeom.analyze.parameters import RANDOM_DRAWS
from attngeom.extract.synthetic import write_synthetic_run

RUN = "synthetic"

# (defining file, function, phase): the stage's steps in this thread, read from a profile of
# it (cProfile, this thread's CPU time, cumulative); and the (sequence, layer) blocks, read
# from Dask's task profile (their wall time in the worker threads). Nothing of the package is
# replaced: a renamed function reads as 0.
PHASES = (
    ("analyze/runner.py", "_checked_input", "open + check input"),
    ("store/derived_groups/derived.py", "begin", "record: begin"),
    ("store/derived_groups/derived.py", "create", "write: create groups"),
    ("store/derived_groups/derived.py", "append", "write: append batch"),
    ("analyze/reductions.py", "cross_sequence_groups", "reduce across sequences"),
    ("store/derived_groups/derived.py", "finish", "write: finish + commit"),
)
BLOCKS = ("analysis_block", "blocks (worker threads, wall)")  # the tasks' name, as Dask's key_split gives it
PHASE_NAMES = (*(phase for _, _, phase in PHASES), BLOCKS[1])


def phase_profile(store: str) -> dict[str, float]:
    """Seconds of each phase (PHASE_NAMES) in one more analyze of ``store`` from scratch, as
    the profiles see it."""
    profile = cProfile.Profile(time.thread_time)
    with Profiler() as tasks:
        profile.runcall(analyze_fresh, store, RUN, "threads")
    spent: dict[str, float] = collections.defaultdict(float)
    for (path, _, function), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
        for where, name, phase in PHASES:
            if function == name and path.replace(os.sep, "/").endswith(where):
                spent[phase] += cumulative
    spent[BLOCKS[1]] = sum(t.end_time - t.start_time for t in tasks.results if key_split(t.key) == BLOCKS[0])
    return spent


def blocks_of(store: str) -> list[tuple]:
    """Every (sequence, layer) block's kernel inputs, read through the public API."""
    ds = ag.open_store(store).run(RUN).dataset()
    head_kv = ds["head_kv"].values
    attn_all, values_all = ds["attn_last"].values, ds["values"].values
    out = []
    for s in range(ds.sizes["seq"]):
        for layer in range(ds.sizes["layer"]):
            values = values_all[s, layer].astype(np.float64)
            out.append((attn_all[s, layer].astype(np.float64), values,
                        np.broadcast_to(ds["attendable"][layer].values, values.shape[:2]), head_kv))
    return out


def kernels_cpu(inputs: list[tuple], grid: list[int]) -> float:
    c0 = time.process_time()
    for i, (attn, values, attendable, head_kv) in enumerate(inputs):
        head_metrics(attn, values, attendable, grid, head_kv=head_kv, seed=i, random_draws=RANDOM_DRAWS)
    return time.process_time() - c0


def measure(name: str, tmp: str, args) -> dict:
    H, KV, D = SHAPES[name]
    small, large = f"{tmp}/{name}-1.zarr", f"{tmp}/{name}-{args.sequences}.zarr"
    for store, n in ((small, 1), (large, args.sequences)):
        write_synthetic_run(store, RUN, n_seq=n, n_layers=args.layers, n_heads=H, n_kv_heads=KV, head_dim=D,
                            length=args.length)
    grid = default_n_grid(args.length)
    inputs = blocks_of(large)
    per_block = H
    extra = (args.sequences - 1) * args.layers * H
    analyze_fresh(small, RUN, "threads")  # caches warm
    cpu = {"small": [], "large": [], "kernels": [], "read": []}
    phases = []
    with threadpool_limits(1):
        for rep in range(args.reps):
            for which in rotate(list(cpu), rep):
                if which == "read":
                    c0 = time.process_time()
                    read_inputs(large, RUN)
                    cpu[which].append((time.process_time() - c0) / (len(inputs) * per_block))
                elif which == "kernels":
                    cpu[which].append(kernels_cpu(inputs, grid) / (len(inputs) * per_block))
                elif which == "large":
                    cpu[which].append(analyze_fresh(large, RUN, "threads")[1])
                    phases.append(phase_profile(large))
                else:
                    cpu[which].append(analyze_fresh(small, RUN, "threads")[1])
    marginal = [(b - a) / extra for a, b in zip(cpu["small"], cpu["large"])]
    instances_large = args.sequences * args.layers * H
    result = {
        "stage_ms": median(marginal) * 1e3, "kernels_ms": median(cpu["kernels"]) * 1e3,
        "ratio": median([m / k for m, k in zip(marginal, cpu["kernels"])]), "read_ms": median(cpu["read"]) * 1e3,
        "small_s": median(cpu["small"]), "large_s": median(cpu["large"]),
        "fixed_s": median([s - k * args.layers * H for s, k in zip(cpu["small"], cpu["kernels"])]),
    }
    result["phases_ms_per_instance"] = {
        phase: median([p.get(phase, 0.0) for p in phases]) * 1e3 / instances_large for phase in PHASE_NAMES}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama2-7b,mistral-7b,gemma-7b", help="comma-separated names of SHAPES")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sequences", type=int, default=5)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    rows, phase_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            r = measure(name, tmp, args)
            H, KV, D = SHAPES[name]
            rows.append([f"{name} ({H}/{KV}/{D})", r["stage_ms"], r["kernels_ms"], r["ratio"], r["read_ms"], r["small_s"],
                         r["large_s"], r["fixed_s"]])
            phase_rows.append([name, *(r["phases_ms_per_instance"][phase] for phase in PHASE_NAMES)])
            print(f"{name}: " + ", ".join(f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in r.items()),
                  flush=True)
    print()
    print(table(["shape (H/KV/D)", "stage core-ms/inst", "kernels core-ms/inst", "stage/kernels", "read core-ms/inst",
                 "1-seq analyze CPU s", f"{args.sequences}-seq analyze CPU s", "fixed CPU s (1 seq - kernels)"],
                rows))
    print()
    print(f"phases of the {args.sequences}-sequence analyze, ms per instance (this thread's steps in CPU time; "
          "the blocks in wall time summed over the worker threads, read and kernels included)")
    print(table(["shape", *PHASE_NAMES], phase_rows))


if __name__ == "__main__":
    main()
