#!/usr/bin/env python
"""analyze against extract and against reading analyze's inputs (run by hand).

    python benchmarks/analyze_vs_extract.py                     # both models, L = 512 and 1024
    python benchmarks/analyze_vs_extract.py --models smollm2-135m --lengths 512 -S 2 --reps 3 --json r.json

For each model and L, every repetition, side by side:

- **extract**: ``ag.extract(model, tokenizer=...)`` of S sequences of python-docs into a fresh
  store, the model and tokenizer loaded once beforehand and handed to it as objects (model
  loading excluded; choosing the corpus windows and writing the store included);
- **read**: ``attn_last`` and ``values`` of those sequences loaded from the store (analyze's
  inputs; threads);
- **analyze**: ``ag.analyze()`` of the run from scratch (its analysis deleted first) with each
  scheduler of ``--schedulers`` in turn, the order alternating between repetitions: ``default``
  (forked worker processes, started by the call), ``threads``, ``processes`` (a LocalCluster,
  start-up included);
- **kernel**: ``head_metrics`` on (sequence, layer) blocks of the store (kv heads' values and
  ``head_kv``), serially, as the stage calls it; a sample of ``--kernel-blocks`` blocks scaled to the run
  (S x layers blocks).

Reported: medians of per-repetition ratios analyze/extract and analyze/read, and the
orchestration overhead: analyze minus the kernel's ideal parallel time (serial kernel time
divided by the cores), i.e. what the stage adds besides the kernel (graph, reads, writes,
reductions, cluster start-up). Compare ratios within a run: seconds move with whatever else
the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import extract_store, int_list, load, timed

import attngeom as ag
from attngeom.analyze.kernels import head_metrics
from attngeom.analyze.parameters import RANDOM_DRAWS, default_n_grid
from attngeom.analyze.runner import open_completed
from attngeom.store import analysis_path

DATASET = "python-docs"


def wall(f) -> float:
    return timed(f)[0]


def kernel_seconds(store: str, run_id: str, blocks: int) -> float:
    """Serial kernel seconds for the whole run, from ``blocks`` sampled (sequence, layer)
    blocks: float64 inputs, one ``head_metrics`` call per block, default N grid."""
    ds = open_completed(store, run_id)
    head_kv = ds["head_kv"].values
    grid = default_n_grid(ds.sizes["key"])
    pairs = [(s, layer) for s in range(ds.sizes["seq"]) for layer in range(ds.sizes["layer"])]
    sample = [pairs[i] for i in np.linspace(0, len(pairs) - 1, min(blocks, len(pairs))).astype(int)]
    spent = 0.0
    for s, layer in sample:
        attn = ds["attn_last"][s, layer].values.astype(np.float64)
        values = ds["values"][s, layer].values.astype(np.float64)
        att = np.broadcast_to(ds["attendable"][layer].values, values.shape[:2])
        t0 = time.perf_counter()
        head_metrics(attn, values, att, grid, head_kv=head_kv, seed=1, random_draws=RANDOM_DRAWS)
        spent += time.perf_counter() - t0
    return spent / len(sample) * len(pairs)


def one_case(model: str, length: int, n_seq: int, reps: int, blocks: int, schedulers: list[str], workdir: Path,
             log) -> dict[str, Any]:
    samples: list[dict[str, float]] = []
    loaded = load(model)
    for rep in range(reps):
        store = str(workdir / f"{model}_L{length}_{rep}.zarr")
        shutil.rmtree(store, ignore_errors=True)
        t = {"extract": wall(lambda: extract_store(loaded, store, dataset=DATASET, length=length, count=n_seq,
                                                   run_id="r"))}
        ds = ag.open_store(store).run("r").dataset()
        t["read"] = wall(lambda: (ds["attn_last"].load(), ds["values"].load()))
        for scheduler in schedulers if rep % 2 == 0 else schedulers[::-1]:
            shutil.rmtree(Path(store) / analysis_path("r"), ignore_errors=True)
            t[f"analyze_{scheduler}"] = wall(lambda: ag.analyze(
                store, run_id="r", scheduler=None if scheduler == "default" else scheduler, progress=False))
        t["kernel"] = kernel_seconds(store, "r", blocks)
        t["loadavg"] = os.getloadavg()[0]
        samples.append(t)
        log(f"  {model} L={length} rep {rep + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
        shutil.rmtree(store, ignore_errors=True)
    cores = os.cpu_count() or 1

    def med(f) -> float:
        return statistics.median(f(s) for s in samples)

    row = dict(
        model=model, L=length, sequences=n_seq, reps=reps, cores=cores, kernel_blocks=blocks,
        extract_s_per_seq=med(lambda s: s["extract"] / n_seq),
        read_s_per_seq=med(lambda s: s["read"] / n_seq),
        kernel_serial_s_per_seq=med(lambda s: s["kernel"] / n_seq),
        loadavg=med(lambda s: s["loadavg"]),
        samples=samples,
    )
    for name in schedulers:
        key = f"analyze_{name}"
        row[name] = dict(
            analyze_s_per_seq=med(lambda s: s[key] / n_seq),
            analyze_over_extract=med(lambda s: s[key] / s["extract"]),
            analyze_over_read=med(lambda s: s[key] / s["read"]),
            over_first=med(lambda s: s[key] / s[f"analyze_{schedulers[0]}"]),
            overhead_s_per_seq=med(lambda s: (s[key] - s["kernel"] / cores) / n_seq),
        )
    return row


def table(rows: list[dict[str, Any]], schedulers: list[str]) -> str:
    """One row per (model, L, scheduler); ``vs first``: its time over the first scheduler's."""
    head = ["model", "L", "S", "scheduler", "extract s/seq", "read s/seq", "analyze s/seq", "analyze/extract",
            "analyze/read", "vs first", "kernel serial s/seq", "overhead s/seq", "load avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for name in schedulers:
            a = r[name]
            cells = [r["model"], r["L"], r["sequences"], name, r["extract_s_per_seq"], r["read_s_per_seq"],
                     a["analyze_s_per_seq"], a["analyze_over_extract"], a["analyze_over_read"], a["over_first"],
                     r["kernel_serial_s_per_seq"], a["overhead_s_per_seq"], r["loadavg"]]
            lines.append("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--lengths", default="512,1024")
    p.add_argument("--num-sequences", "-S", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernel-blocks", type=int, default=4, help="blocks timed for the kernel estimate")
    p.add_argument("--schedulers", default="default,threads",
                   help="analyze with each: default, threads, processes (a LocalCluster) or an address")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    schedulers = args.schedulers.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="attngeom-ave-") as wd:
        for model in args.models.split(","):
            for length in int_list(args.lengths):
                rows.append(one_case(model, length, args.num_sequences, args.reps, args.kernel_blocks,
                                     schedulers, Path(wd), log))
    print(table(rows, schedulers))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
