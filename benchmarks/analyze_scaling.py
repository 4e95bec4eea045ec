#!/usr/bin/env python
"""Scaling of analyze with L and with store size (run by hand).

    python benchmarks/analyze_scaling.py --json scaling.json        # ~5 min on 2 cores

``ag.analyze(store, scheduler="threads")`` wall time on synthetic stores
(``attngeom.extract.synthetic.write_synthetic_run``) of 2 layers, 8 heads, 2 kv heads, head_dim 128:
over L = 128, 512, 1024 at 4 and 8 sequences, and over 8, 16, 32 sequences at L = 512 (each
repetition analyzes anew: the earlier analysis is deleted). Seconds per head-instance, split
into the fixed part (what one analyze call costs whatever the number of sequences: the
reductions across sequences, the heads/summary/signatures/table writes, the commit) and the
per-sequence part, by a least-squares line of median wall time against sequences over the
stores of one L (public calls only: nothing inside analyze is timed). "kernel" is the serial
time of ``topn_metrics`` + ``value_statistics`` on one block of the same store, timed in the
same repetition; "per-seq / kernel" is then about 1/threads for a stage that adds no overhead.
Configurations are interleaved per repetition. BLAS runs at ``--blas-threads`` (default 1, as
Dask's worker processes do); "BLAS default" rows repeat the L series at the default count.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import Blas, fmt, int_list, median, table as md_table

import attngeom as ag
from attngeom.analyze.kernels import topn_metrics, value_statistics
from attngeom.analyze.parameters import RANDOM_DRAWS, default_n_grid
from attngeom.analyze.runner import open_completed
from attngeom.extract.synthetic import write_synthetic_run

BLAS = Blas()


def fixed_parts(configs: list[dict], samples: list[list[dict]]) -> dict[tuple[int, int], float]:
    """(L, BLAS threads) -> the intercept, in seconds, of median wall time against sequences
    over the stores of that L (NaN where only one store size was timed)."""
    by_key: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for cfg, ss in zip(configs, samples):
        by_key.setdefault((cfg["L"], cfg["blas"]), []).append((cfg["seqs"], median([s["wall"] for s in ss])))
    out = {}
    for key, points in by_key.items():
        xs = sorted({x for x, _ in points})
        if len(xs) < 2:
            out[key] = math.nan
            continue
        x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
        out[key] = float(np.polyfit(x, y, 1)[1])
    return out


def kernel_block_seconds(store: str) -> float:
    """Single-thread topn_metrics + value_statistics on one (sequence, layer) block of the
    store, as the stage calls them (kv-head values and head_kv): seconds per
    head-instance."""
    ds = open_completed(store, "r")
    head_kv = ds["head_kv"].values
    attn = ds["attn_last"][0, 0].values.astype(np.float64)
    values = ds["values"][0, 0].values.astype(np.float64)
    att = np.broadcast_to(ds["attendable"][0].values, values.shape[:2])
    grid = default_n_grid(ds.sizes["key"])
    t0 = time.perf_counter()
    topn_metrics(attn, values, att, grid, head_kv=head_kv, seed=1, random_draws=RANDOM_DRAWS)
    value_statistics(values, att)
    return (time.perf_counter() - t0) / attn.shape[0]


def bench_scaling(workdir: Path, configs: list[dict], reps: int, log) -> list[dict]:
    layout = dict(n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128)
    stores = []
    for cfg in configs:
        path = str(workdir / f"scale_L{cfg['L']}_S{cfg['seqs']}.zarr")
        if path not in stores:
            write_synthetic_run(path, "r", n_seq=cfg["seqs"], length=cfg["L"], **layout)
            if not stores:
                ag.analyze(path, scheduler="threads", progress=False)  # warm-up (imports)
        stores.append(path)
    samples: list[list[dict]] = [[] for _ in configs]
    for rep in range(reps):
        order = list(range(len(configs)))
        order = order[rep % len(order):] + order[:rep % len(order)]
        for i in order:
            BLAS.set(configs[i]["blas"])
            kernel = kernel_block_seconds(stores[i])
            # analyze is incremental: without its earlier analysis the run is analyzed anew.
            shutil.rmtree(Path(stores[i]) / "runs" / "r" / "analysis", ignore_errors=True)
            t0 = time.perf_counter()
            (result,) = ag.analyze(stores[i], scheduler="threads", progress=False)
            wall = time.perf_counter() - t0
            samples[i].append(dict(wall=wall, instances=result.instances, kernel=kernel))
        log(f"  scaling repetition {rep + 1}/{reps} done")
    fixed = fixed_parts(configs, samples)
    rows = []
    for cfg, ss in zip(configs, samples):
        n = ss[0]["instances"]
        f = fixed.get((cfg["L"], cfg["blas"]), math.nan)
        rows.append(dict(
            series=cfg["series"], L=cfg["L"], seqs=cfg["seqs"], blas_threads=cfg["blas"],
            instances=n, **layout, reps=reps,
            wall_s=median([s["wall"] for s in ss]),
            s_per_inst=median([s["wall"] / n for s in ss]),
            per_seq_s_per_inst=median([(s["wall"] - f) / n for s in ss]),
            fixed_s=f,
            kernel_s_per_inst=median([s["kernel"] for s in ss]),
            per_seq_over_kernel=median([(s["wall"] - f) / n / s["kernel"] for s in ss]),
        ))
    return rows


def scaling_table(rows) -> str:
    return md_table(
        ["series", "L", "seqs", "BLAS thr", "instances", "wall s", "s/inst (total)", "s/inst (per-seq part)",
         "fixed part s", "kernel s/inst (serial)", "per-seq / kernel"],
        [[r["series"], r["L"], r["seqs"], r["blas_threads"], r["instances"], fmt(r["wall_s"]), fmt(r["s_per_inst"]),
          fmt(r["per_seq_s_per_inst"]), fmt(r["fixed_s"]), fmt(r["kernel_s_per_inst"]),
          fmt(r["per_seq_over_kernel"], 2)] for r in rows],
    )



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--lengths", type=int_list, default=[128, 512, 1024], help="L of the L series")
    p.add_argument("--seqs", type=int_list, default=[4, 8], help="store sizes of the L series")
    p.add_argument("--scale-seqs", type=int_list, default=[8, 16, 32], help="store sizes of the size series (L=512)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--blas-threads", type=int, default=1)
    args = p.parse_args(argv)
    b = args.blas_threads
    configs = [dict(series="L", L=L, seqs=s, blas=b) for L in args.lengths for s in args.seqs]
    configs += [dict(series="store size", L=512, seqs=s, blas=b) for s in args.scale_seqs]
    if BLAS.available and BLAS.default != b:
        configs += [dict(series="BLAS default", L=L, seqs=s, blas=BLAS.default) for L in args.lengths for s in args.seqs]
    with tempfile.TemporaryDirectory(prefix="attngeom-bench-") as wd:
        rows = bench_scaling(Path(wd), configs, args.reps, lambda m: print(m, file=sys.stderr, flush=True))
    BLAS.set(BLAS.default)
    print("## analyze scaling (threads scheduler; 2 layers, 8 heads, 2 kv heads, head_dim 128)\n")
    print(scaling_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
