#!/usr/bin/env python
"""Analyze at the paper's model shapes, against the Gram floor and the time to read (run by hand).

    python benchmarks/analyze_paper_shapes.py                       # ~10 min on 2 cores
    python benchmarks/analyze_paper_shapes.py --shapes llama2-7b --reps 5 --json out.json
    python benchmarks/analyze_paper_shapes.py --long mistral-7b     # also L = 4096
    python benchmarks/analyze_paper_shapes.py --against 455de4e     # old: the kernels at that revision

For each shape a synthetic store (``attngeom.extract.synthetic.write_synthetic_run``: softmax rows with
a heavy sink, Gaussian values) of ``--layers`` layers and ``--sequences`` sequences at L = 1024:

- **core-ms per instance**, old vs new: ``head_metrics`` on one (sequence, layer) block read
  from the store, one thread, divided by its heads. "new" is this tree's kernels, "old" those
  at the git revision ``--against`` (default: the numpy kernels before the compiled ones),
  checked out into a temporary worktree; each runs in a child process of its own
  (``common.Kernels``, ``common.KernelsAt``), back to back in every repetition, order
  rotating, and their results are compared (counts exact, floats to 1e-9).
- **Gram floor**: the one product analyze cannot avoid, a kv head's unit values times their
  transpose ((L-1) x head_dim float64, numpy's matmul), timed in the same repetition (in this
  process), shared by the query heads of a kv head: floor per instance = Gram x kv heads /
  heads.
- **analyze / read**: ``ag.analyze`` of the whole store (default scheduler: a worker process per
  core) against reading and decompressing its inputs (attn_last, values, winner) chunk by
  chunk in this process, both in the same repetition.
- **busy**: CPU seconds of analyze (this process and its workers) / (wall x cores).
- **2 cores / 1 core**: the same analyze in a child process allowed one core and in one
  allowed two (``os.sched_setaffinity``), alternating; the ratio of their wall times is the
  work two workers do for one's (ideal 2). ``threads_s``: the analyze with ``--scheduler
  threads`` (the compiled kernels release the GIL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from common import PAPER_SHAPES as SHAPES
from common import (
    REPO,
    Kernels,
    KernelsAt,
    analyze_fresh,
    analyze_in_child,
    default_n_grid,
    fmt,
    median,
    read_inputs,
    rotate,
    table,
)
from threadpoolctl import threadpool_limits

import attngeom as ag
from attngeom.extract.synthetic import write_synthetic_run

# The kernels before they were compiled (numba): numpy throughout.
NUMPY_KERNELS = "1f327e3^"

COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact", "sink_selected")
RUN = "synthetic"


def mismatches(got, want) -> list[str]:
    bad = []
    for g, w in zip(got, want):
        for name in w:
            a, b = np.asarray(g[name], float), np.asarray(w[name], float)
            if name in COUNTS:
                ok = np.array_equal(a, b)
            else:
                ok = np.array_equal(np.isnan(a), np.isnan(b)) and np.allclose(
                    a[~np.isnan(b)], b[~np.isnan(b)], rtol=1e-9, atol=1e-12)
            if not ok:
                bad.append(name)
    return bad


def block(store: str, seq: int, layer: int):
    ds = ag.open_store(store).run(RUN).dataset()
    attn = ds["attn_last"][seq, layer].values.astype(np.float64)
    values = ds["values"][seq, layer].values.astype(np.float64)
    attendable = np.broadcast_to(ds["attendable"][layer].values, values.shape[:2])
    return attn, values, attendable, ds["head_kv"].values


def cpu_ms(fn) -> float:
    c0 = time.process_time()
    fn()
    return (time.process_time() - c0) * 1e3


def kernels(new: Kernels, old: KernelsAt, store: str, length: int, reps: int) -> dict:
    attn, values, attendable, head_kv = block(store, 0, 0)
    H, KV = attn.shape[0], values.shape[0]
    grid = default_n_grid(length)
    unit = values[0, 1:] / np.linalg.norm(values[0, 1:], axis=-1, keepdims=True)
    runs = {
        # CPU time of the call in the kernels' own process
        "new": lambda: new.call("head_metrics", attn, values, attendable, grid, head_kv=head_kv)[2] * 1e3,
        "old": lambda: old.call("head_metrics", attn, values, attendable, grid, head_kv=head_kv)[2] * 1e3,
        "gram": lambda: cpu_ms(lambda: unit @ unit.T),
    }
    times = {name: [] for name in runs}
    with threadpool_limits(1):
        bad = mismatches(new.call("head_metrics", attn, values, attendable, grid, head_kv=head_kv)[0],
                         old.call("head_metrics", attn, values, attendable, grid, head_kv=head_kv)[0])
        for rep in range(reps):
            for name in rotate(list(runs), rep):
                times[name].append(runs[name]())
    per = {name: [t / H for t in ts] for name, ts in times.items() if name != "gram"}
    floor = [g * KV / H for g in times["gram"]]
    return dict(
        new_ms=median(per["new"]), old_ms=median(per["old"]), gram_ms=median(times["gram"]),
        floor_ms=median(floor), speedup=median([o / n for o, n in zip(per["old"], per["new"])]),
        new_over_floor=median([n / f for n, f in zip(per["new"], floor)]), mismatched=bad,
    )


def stage(store: str, reps: int) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    analyze_fresh(store, RUN)  # numba's cache and the OS's file cache warm
    analyze, read, busy, scale, threads = [], [], [], [], []
    for rep in range(reps):
        for which in rotate(["analyze", "read", "pinned", "threads"], rep):
            if which == "analyze":
                wall, cpu = analyze_fresh(store, RUN)
                analyze.append(wall)
                busy.append(cpu / (wall * len(cores)))
            elif which == "threads":
                threads.append(analyze_fresh(store, RUN, "threads")[0])
            elif which == "read":
                w0 = time.perf_counter()
                read_inputs(store, RUN)
                read.append(time.perf_counter() - w0)
            elif len(cores) > 1:
                pair = [analyze_in_child(store, RUN, c)[0] for c in rotate([cores[:1], cores[:2]], rep)]
                one, two = pair if rep % 2 == 0 else pair[::-1]
                scale.append(one / two)
    return dict(analyze_s=median(analyze), threads_s=median(threads), read_s=median(read),
                analyze_over_read=median([a / r for a, r in zip(analyze, read)]),
                busy=median(busy), two_over_one=median(scale), cores=len(cores))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--long", default="", help="shapes also measured at L = 4096 (kernels only)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-stage", action="store_true", help="kernels only: no analyze runs")
    p.add_argument("--json", type=Path)
    p.add_argument("--against", default=NUMPY_KERNELS,
                   help=f"git revision of the older kernels (default {NUMPY_KERNELS}: the numpy kernels)")
    args = p.parse_args()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp, Kernels(REPO, "this tree") as new, KernelsAt(args.against) as old:
        todo = [(name, args.length) for name in args.shapes.split(",")]
        todo += [(name, 4096) for name in args.long.split(",") if name]
        for name, length in todo:
            H, KV, D = SHAPES[name]
            store = f"{tmp}/{name}-{length}.zarr"
            write_synthetic_run(store, RUN, n_seq=args.sequences, n_layers=args.layers, n_heads=H,
                                n_kv_heads=KV, head_dim=D, length=length)
            r = kernels(new, old, store, length, args.reps)
            if not args.no_stage and length == args.length:
                r.update(stage(store, args.reps))
            results[f"{name} L={length}"] = r
            rows.append([f"{name} ({H}/{KV}/{D})", length, r["old_ms"], r["new_ms"], r["speedup"],
                         r["floor_ms"], r["new_over_floor"], r.get("analyze_over_read", float("nan")),
                         r.get("busy", float("nan")), r.get("two_over_one", float("nan")),
                         ",".join(r["mismatched"]) or "none"])
            shutil.rmtree(store)
            print(f"{name} L={length}: " + ", ".join(f"{k}={fmt(v) if isinstance(v, float) else v}"
                                                     for k, v in r.items()), flush=True)
    print()
    print(table(["shape (H/KV/D)", "L", "old core-ms/inst", "new core-ms/inst", "old/new", "Gram floor ms/inst",
                 "new/floor", "analyze/read", "busy", "2 cores/1", "mismatched"], rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
