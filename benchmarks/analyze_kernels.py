#!/usr/bin/env python
"""Analyze kernels, old vs new: head-instances per second of topn_metrics + value_statistics.

    python benchmarks/analyze_kernels.py                      # ~5 min on 2 busy cores
    python benchmarks/analyze_kernels.py --reps 5 --json kernels.json
    python benchmarks/analyze_kernels.py --store a.zarr --store b.zarr   # also real stores

One (sequence, layer) block of a model's shape is what an analyze task hands the kernels:
H query heads reading KV kv heads of head_dim D at context length L, default N grid (powers
of two < L), 8 random draws. "old" is the frozen copy of the numpy kernels before the
compiled ones of issue 24 (``benchmarks/frozen_kernels_v2.py``) through its ``head_metrics``;
the current kernels run through ``head_metrics`` (one call for both outputs, each kv head's
Gram matrix computed once: "new") and as two calls ``topn_metrics`` + ``value_statistics``
("new, 2 calls").

Shapes: smollm2-135m (H = 9, KV = 3, D = 64) and gemma3-270m (H = 4, KV = 1, D = 256), at
L = 512 and 1024. Inputs are synthetic (softmax of Gaussian scores with a heavy sink; values
with a shared direction, unequal norms and a small sink vector). Every repetition times old
and the two new forms on the same block back to back (order rotating), BLAS pinned to one
thread (threadpoolctl), and the ratios are taken within the repetition; tables give medians.

Every comparison also checks the results: counts exact, floats equal to 1e-9 relative
(absolute 1e-12), NaN where NaN. With ``--store`` every (sequence, layer) block of every run of
each real store is compared the same way, and timed once each way (CPU time).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import frozen_kernels_v2 as old  # noqa: E402

from attngeom.analyze.kernels import compile_kernels, head_metrics, topn_metrics, value_statistics  # noqa: E402
from attngeom.analyze.parameters import RANDOM_DRAWS, default_n_grid  # noqa: E402
from attngeom.analyze.runner import open_completed  # noqa: E402
from attngeom.store import open_root, run_ids  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(heads=9, kv_heads=3, head_dim=64),
    "gemma3-270m": dict(heads=4, kv_heads=1, head_dim=256),
}
COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact", "sink_selected")


def synthetic_block(rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int, length: int):
    """attn (H, L), kv values (KV, L, D), head_kv (H,), attendable (L,)."""
    scores = rng.normal(scale=2.0, size=(heads, length))
    scores[:, 0] += 4.0
    attn = np.exp(scores - scores.max(axis=1, keepdims=True))
    attn /= attn.sum(axis=1, keepdims=True)
    values = rng.normal(size=(kv_heads, length, head_dim)) + 0.5 * rng.normal(size=(kv_heads, 1, head_dim))
    values *= rng.lognormal(0, 0.3, size=(kv_heads, length, 1))
    values[:, 0] *= 0.2
    head_kv = np.repeat(np.arange(kv_heads), heads // kv_heads)
    return attn, values, head_kv, np.ones(length, dtype=bool)


def run_old(attn, values, head_kv, attendable, grid, seed):
    """The frozen numpy kernels in one call; value statistics mapped to query heads."""
    att = np.broadcast_to(attendable, values.shape[:2])
    topn, stats = old.head_metrics(attn, values, att, grid, head_kv=head_kv, seed=seed,
                                   random_draws=RANDOM_DRAWS)
    return topn, {name: x[head_kv] for name, x in stats.items()}


def run_new(attn, values, head_kv, attendable, grid, seed):
    """The current kernels in one call; value statistics mapped to query heads."""
    att = np.broadcast_to(attendable, values.shape[:2])
    topn, stats = head_metrics(attn, values, att, grid, head_kv=head_kv, seed=seed,
                               random_draws=RANDOM_DRAWS)
    return topn, {name: x[head_kv] for name, x in stats.items()}


def run_new_two_calls(attn, values, head_kv, attendable, grid, seed):
    """The current kernels as two calls, as the stage's block functions call them today."""
    att = np.broadcast_to(attendable, values.shape[:2])
    topn = topn_metrics(attn, values, att, grid, head_kv=head_kv, seed=seed, random_draws=RANDOM_DRAWS)
    stats = value_statistics(values, att)
    return topn, {name: x[head_kv] for name, x in stats.items()}


RUNS = {"old": run_old, "new": run_new, "new2": run_new_two_calls}


def differences(got, want) -> dict:
    """Count mismatches (exact) and float mismatches (1e-9 relative) of two result pairs."""
    bad, worst = [], 0.0
    for g, w in zip(got, want):
        for name in w:
            a, b = np.asarray(g[name]), np.asarray(w[name])
            if name in COUNTS:
                if not np.array_equal(a, b):
                    bad.append(name)
                continue
            if not np.array_equal(np.isnan(a), np.isnan(b)):
                bad.append(name)
                continue
            both = ~np.isnan(b)
            if not np.allclose(a[both], b[both], rtol=1e-9, atol=1e-12):
                bad.append(name)
            scale = np.maximum(np.abs(b[both]), 1e-12)
            worst = max(worst, float(np.max(np.abs(a[both] - b[both]) / scale, initial=0.0)))
    return dict(mismatched=sorted(set(bad)), max_rel_diff=worst)


def timed(f, *args):
    t0, c0 = time.perf_counter(), time.process_time()
    result = f(*args)
    return result, time.perf_counter() - t0, time.process_time() - c0


def bench_synthetic(lengths, reps: int, log) -> list[dict]:
    rows = []
    compile_kernels()
    for name, shape in SHAPES.items():
        for length in lengths:
            rng = np.random.default_rng(length)
            block = synthetic_block(rng, shape["heads"], shape["kv_heads"], shape["head_dim"], length)
            grid = default_n_grid(length)
            wall = {which: [] for which in RUNS}
            cpu = {which: [] for which in RUNS}
            checks = []
            for rep in range(reps):
                results = {}
                names = list(RUNS)
                for which in names[rep % 3:] + names[:rep % 3]:
                    results[which], w, c = timed(RUNS[which], *block, grid, rep)
                    wall[which].append(w)
                    cpu[which].append(c)
                checks.append(differences(results["new"], results["old"]))
                checks.append(differences(results["new2"], results["old"]))
            ratios = [o / n for o, n in zip(wall["old"], wall["new"])]
            cpu_ratios = [o / n for o, n in zip(cpu["old"], cpu["new"])]
            ratios2 = [o / n for o, n in zip(wall["old"], wall["new2"])]
            heads = shape["heads"]
            row = dict(
                model=name, L=length, **shape, n_grid=len(grid), reps=reps,
                old_inst_per_s=heads / statistics.median(wall["old"]),
                new_inst_per_s=heads / statistics.median(wall["new"]),
                ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                cpu_ratio=statistics.median(cpu_ratios),
                ratio_two_calls=statistics.median(ratios2),
                agree=all(not c["mismatched"] for c in checks),
                mismatched=sorted({m for c in checks for m in c["mismatched"]}),
                max_rel_diff=max(c["max_rel_diff"] for c in checks),
            )
            log(f"  {name} L={length}: old {row['old_inst_per_s']:.1f} inst/s, new "
                f"{row['new_inst_per_s']:.1f} inst/s, x{row['ratio']:.1f} "
                f"(cpu x{row['cpu_ratio']:.1f}; 2 calls x{row['ratio_two_calls']:.1f}), "
                f"agree={row['agree']}")
            rows.append(row)
    return rows


def bench_store(store: str, log) -> list[dict]:
    rows = []
    compile_kernels()  # numba's cache loaded outside the timings
    root = open_root(store)
    for run_id in run_ids(root):
        ds = open_completed(store, run_id)
        head_kv = ds["head_kv"].values
        grid = default_n_grid(ds.sizes["key"])
        old_s = new_s = 0.0
        blocks = instances = windowed = 0
        bad: set[str] = set()
        worst = 0.0
        for s in range(ds.sizes["seq"]):
            attn_seq = ds["attn_last"][s].values.astype(np.float64)
            values_seq = ds["values"][s].values.astype(np.float64)
            for layer in range(ds.sizes["layer"]):
                attendable = ds["attendable"][layer].values
                block = (attn_seq[layer], values_seq[layer], head_kv, attendable)
                want, _, c_old = timed(run_old, *block, grid, s * 1000 + layer)
                got, _, c_new = timed(run_new, *block, grid, s * 1000 + layer)
                d = differences(got, want)
                bad |= set(d["mismatched"])
                worst = max(worst, d["max_rel_diff"])
                old_s, new_s = old_s + c_old, new_s + c_new
                blocks += 1
                instances += len(head_kv)
                windowed += int(not attendable.all())
        row = dict(run=run_id, blocks=blocks, instances=instances, windowed_blocks=windowed,
                   L=ds.sizes["key"], n_grid=len(grid), agree=not bad, mismatched=sorted(bad),
                   max_rel_diff=worst, cpu_ratio=old_s / new_s)
        log(f"  {run_id}: {blocks} blocks, {instances} instances ({windowed} windowed blocks), "
            f"agree={row['agree']}, max rel diff {worst:.2g}, cpu x{row['cpu_ratio']:.1f}")
        rows.append(row)
    return rows


def table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=ints, default=[512, 1024])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--store", action="append", default=[],
                   help="also compare old and new on every block of this store (repeatable)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict = dict(machine=dict(platform=platform.platform(), python=platform.python_version(),
                                      numpy=np.__version__, load_avg=list(__import__("os").getloadavg())))
    out = []
    with threadpool_limits(limits=1):
        log("synthetic blocks, old vs new")
        results["synthetic"] = bench_synthetic(args.lengths, args.reps, log)
        out += ["## Kernels old vs new (one (sequence, layer) block, one thread; median over "
                f"{args.reps} repetitions)", "", table(
                    ["model", "L", "H/KV/D", "old inst/s", "new inst/s", "new/old", "(min-max)",
                     "CPU-time ratio", "new, 2 calls/old", "results agree"],
                    [[r["model"], r["L"], f"{r['heads']}/{r['kv_heads']}/{r['head_dim']}",
                      f"{r['old_inst_per_s']:.1f}", f"{r['new_inst_per_s']:.1f}", f"{r['ratio']:.1f}x",
                      f"{r['ratio_min']:.1f}-{r['ratio_max']:.1f}", f"{r['cpu_ratio']:.1f}x",
                      f"{r['ratio_two_calls']:.1f}x",
                      "yes" if r["agree"] else f"NO {r['mismatched']}"] for r in results["synthetic"]]), ""]
        if args.store:
            log(f"real stores {args.store}, old vs new")
            results["store"] = [row for store in args.store for row in bench_store(store, log)]
            out += [f"## Real stores {', '.join(args.store)}", "", table(
                ["run", "L", "blocks", "instances", "windowed blocks", "results agree",
                 "max rel diff", "CPU-time ratio"],
                [[r["run"], r["L"], r["blocks"], r["instances"], r["windowed_blocks"],
                  "yes" if r["agree"] else f"NO {r['mismatched']}", f"{r['max_rel_diff']:.2g}",
                  f"{r['cpu_ratio']:.1f}x"] for r in results["store"]]), ""]
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(r["agree"] for r in results["synthetic"] + results.get("store", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
