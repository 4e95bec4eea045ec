#!/usr/bin/env python
"""An incremental analyze against a full one, on stores of small models' shapes (run by hand).

    python benchmarks/analyze_stage_incremental.py                 # ~3 min on 2 cores
    python benchmarks/analyze_stage_incremental.py --sequences 12 --length 512 --reps 5

For each shape a synthetic run (the arrays of ``attngeom.extract.synthetic.synthetic_sequence``) of
``--sequences`` sequences, the first half analyzed before the second half is written: the
state a researcher is in after extracting more sequences. In every repetition, order
rotating, on fresh copies of that store:

- **incremental**: ``ag.analyze`` (default scheduler), which computes the second half and
  reduces across all sequences;
- **full**: a copy of the same store without its analysis, everything computed.

incremental / full (wall and CPU time of this process and its workers) would be 0.5 if a
call had no fixed cost.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

import numpy as np
from common import fmt, median, rotate, table

import attngeom as ag
from attngeom.store import RunLayout, analysis_path, consolidate, create_run, open_or_create_root, write_sequence
from attngeom.extract.synthetic import synthetic_sequence

RUN = "synthetic"

# (layers, heads, kv heads, head_dim) of small models analyzed often.
SMALL_SHAPES = {
    "smollm2-135m": (30, 9, 3, 64),
    "gemma3-270m": (18, 4, 1, 256),
}


def half_analyzed(store: str, shape: tuple[int, int, int, int], n_seq: int, length: int) -> None:
    """A run of ``n_seq`` sequences whose first half is analyzed."""
    n_layers, n_heads, n_kv, dim = shape
    layout = RunLayout(
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=dim, length=length,
        head_kv=tuple(h // (n_heads // n_kv) for h in range(n_heads)),
        window=(0,) * n_layers, attendable=((True,) * length,) * n_layers, queries=(),
    )
    root = open_or_create_root(store)
    provenance = {"model": {"id": "synthetic"}, "dataset": {"id": "synthetic"}, "context_length": length,
                  "library_versions": {}, "command_line": "benchmarks/analyze_stage_incremental.py"}
    run = create_run(root, RUN, layout, provenance, n_seq)
    rng = np.random.default_rng(0)
    arrays = [synthetic_sequence(rng, layout) for _ in range(n_seq)]
    for s in range(n_seq // 2):
        write_sequence(run, s, arrays[s])
    consolidate(root)
    ag.analyze(store, run_id=RUN, progress=False)
    for s in range(n_seq // 2, n_seq):
        write_sequence(run, s, arrays[s])
    consolidate(root)


def timed_analyze(store: str, scheduler: str | None) -> tuple[float, float]:
    """(wall s, CPU s of this process and its workers) of one ``ag.analyze``."""
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    before = [resource.getrusage(w) for w in who]
    w0 = time.perf_counter()
    ag.analyze(store, run_id=RUN, progress=False, scheduler=scheduler)
    wall = time.perf_counter() - w0
    after = [resource.getrusage(w) for w in who]
    return wall, sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before))


def measure(name: str, tmp: str, args) -> dict:
    pristine = f"{tmp}/{name}.zarr"
    half_analyzed(pristine, SMALL_SHAPES[name], args.sequences, args.length)
    times = {"incremental": [], "full": []}
    analysis = os.path.join(pristine, analysis_path(RUN))
    for rep in range(args.reps + 1):
        for which in rotate(list(times), rep):
            # A copy of its own, the full one's without the analysis, none deleted before the
            # end: on a file system whose new files are slower to make after many deletions
            # (ext4 without a journal), deleting here would slow the writes timed next.
            store = f"{tmp}/{name}-{which}-{rep}.zarr"
            shutil.copytree(pristine, store, ignore=lambda folder, names: (
                ["analysis"] if which == "full" and os.path.join(folder, "analysis") == analysis else []))
            t = timed_analyze(store, args.scheduler)
            if rep:  # the first repetition warms caches
                times[which].append(t)
    inc, full = times["incremental"], times["full"]
    return {
        "incremental_wall": median([w for w, _ in inc]), "full_wall": median([w for w, _ in full]),
        "wall_ratio": median([a[0] / b[0] for a, b in zip(inc, full)]),
        "cpu_ratio": median([a[1] / b[1] for a, b in zip(inc, full)]),
        "incremental_cpu": median([c for _, c in inc]), "full_cpu": median([c for _, c in full]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SMALL_SHAPES))
    p.add_argument("--sequences", type=int, default=12)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scheduler", default=None, help="as analyze's --scheduler (default: worker processes)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            r = measure(name, tmp, args)
            L, H, KV, D = SMALL_SHAPES[name]
            rows.append([f"{name} ({L}x{H}/{KV}/{D})", r["full_wall"], r["incremental_wall"], r["wall_ratio"],
                         r["full_cpu"], r["incremental_cpu"], r["cpu_ratio"]])
            print(f"{name}: " + ", ".join(f"{k}={fmt(v)}" for k, v in r.items()), flush=True)
    print()
    print(table(["shape (layers x H/KV/D)", "full wall s", "incremental wall s", "incremental/full wall",
                 "full CPU s", "incremental CPU s", "incremental/full CPU"], rows))


if __name__ == "__main__":
    main()
