#!/usr/bin/env python
"""`attngeom analyze` as the command line runs it: with nothing to do, incremental, full (run by hand).

    python benchmarks/analyze_command.py                   # smollm2-135m, python-docs, L = 256, 12 sequences
    python benchmarks/analyze_command.py --reps 5 --json command.json

Each analyze is a fresh process (``python -m attngeom.cli analyze --store ... --no-progress``),
so its imports, the kernels' load and its worker processes are part of what it costs, as they
are for a user. One store is built once with the command line: ``attngeom extract -S n/2``,
``attngeom analyze``, ``attngeom extract -S n`` (the state a researcher is in after extracting
more sequences). In every repetition, order rotating, on copies of it made beforehand (none
deleted before the end: on a file system whose new files are slower to make after many
deletions, deleting would slow the writes timed next):

- **no-op**: analyze of a copy analyzed whole already: nothing to do;
- **incremental**: analyze of a copy, which computes the second half of the sequences and
  reduces across all of them;
- **full**: analyze of a copy without its analysis, everything computed.

Wall time and CPU time (the command's process and its workers); incremental / full would be
0.5 if a call had no fixed cost. The first repetition warms the caches and is not counted.

Beside them, in the same repetitions, where a call's fixed cost goes, each a fresh process:

- **CLI**: the interpreter with the command line loaded (``attngeom --version``);
- **libraries**: the same with the libraries an analyze with work loads (zarr, Dask's arrays,
  xarray and pandas, numba);
- **kernels**: the same with the analysis kernels loaded from numba's cache too
  (:func:`attngeom.analyze.kernels.compile_kernels`).

The children run with bytecode caching on (``PYTHONDONTWRITEBYTECODE`` removed from their
environment), as an installed package runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import median, rotate, table

from attngeom.store import analysis_path, default_run_id

VARIANTS = ("no-op", "incremental", "full")
# The parts of a call's fixed cost, each a fresh process: what it runs (python arguments).
PARTS = {
    "CLI": ["-m", "attngeom.cli", "--version"],
    "libraries": ["-c", "import attngeom.cli, zarr, dask.array, xarray, numba"],
    "kernels": ["-c", "import attngeom.cli, zarr, dask.array, xarray\n"
                      "from attngeom.analyze.kernels import compile_kernels\ncompile_kernels(progress=False)"],
}
# A user's installed package runs from its cached bytecode.
ENV = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def python(*args: str) -> tuple[float, float]:
    """(wall s, CPU s of the process and its workers) of one fresh ``python`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL, env=ENV)
    wall = time.perf_counter() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def cli(*args: str) -> tuple[float, float]:
    """(wall s, CPU s of the process and its workers) of one ``attngeom`` command."""
    return python("-m", "attngeom.cli", *args)


def half_analyzed(store: Path, args: argparse.Namespace) -> None:
    """A store of ``args.sequences`` sequences whose first half is analyzed, built with the CLI."""
    extract = ["extract", "--model", args.model, "--dataset", args.dataset, "-L", str(args.length),
               "--store", str(store), "--no-progress"]
    cli(*extract, "-S", str(args.sequences // 2))
    cli("analyze", "--store", str(store), "--no-progress")
    cli(*extract, "-S", str(args.sequences))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--length", type=int, default=256, help="L (default 256)")
    p.add_argument("--sequences", type=int, default=12, help="sequences of the run, half analyzed first (default 12)")
    p.add_argument("--reps", type=int, default=3, help="counted repetitions (default 3)")
    p.add_argument("--workdir", default=None, help="folder for the stores (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="attngeom-analyze-command-", dir=args.workdir) as tmp:
        pristine = Path(tmp) / "pristine.zarr"
        half_analyzed(pristine, args)
        analysis = pristine / analysis_path(default_run_id(args.model, args.dataset, args.length))
        stores: dict[tuple[str, int], Path] = {}
        for rep in range(args.reps + 1):
            for variant in VARIANTS:
                store = stores[variant, rep] = Path(tmp) / f"{variant}-{rep}.zarr"
                shutil.copytree(pristine, store, ignore=lambda folder, names, full=variant == "full": (
                    ["analysis"] if full and Path(folder) / "analysis" == analysis else []))
                if variant == "no-op":
                    cli("analyze", "--store", str(store), "--no-progress")
        times: dict[str, list[tuple[float, float]]] = {variant: [] for variant in (*VARIANTS, *PARTS)}
        loads = []
        for rep in range(args.reps + 1):
            for variant in rotate([*VARIANTS, *PARTS], rep):
                t = (python(*PARTS[variant]) if variant in PARTS
                     else cli("analyze", "--store", str(stores[variant, rep]), "--no-progress"))
                print(f"  [rep {rep}] {variant}: {t[0]:.2f} s wall, {t[1]:.2f} s CPU", file=sys.stderr, flush=True)
                if rep:
                    times[variant].append(t)
            loads.append(os.getloadavg()[0])
    inc, full, noop = times["incremental"], times["full"], times["no-op"]
    result = {
        "model": args.model, "dataset": args.dataset, "length": args.length, "sequences": args.sequences,
        "reps": args.reps, "cpu_count": len(os.sched_getaffinity(0)), "loadavg_1min": loads, "times": times,
        "no_op_wall": median([w for w, _ in noop]), "no_op_cpu": median([c for _, c in noop]),
        "incremental_wall": median([w for w, _ in inc]), "full_wall": median([w for w, _ in full]),
        "incremental_cpu": median([c for _, c in inc]), "full_cpu": median([c for _, c in full]),
        "wall_ratio": median([a[0] / b[0] for a, b in zip(inc, full)]),
        "cpu_ratio": median([a[1] / b[1] for a, b in zip(inc, full)]),
        # What a call pays whatever its work: an incremental analyze less the work of the
        # sequences a full one computes beyond it (full - incremental).
        "fixed_wall": median([2 * a[0] - b[0] for a, b in zip(inc, full)]),
        "fixed_cpu": median([2 * a[1] - b[1] for a, b in zip(inc, full)]),
        **{f"{part}_{what}": median([t[i] for t in times[part]]) for part in PARTS
           for i, what in enumerate(("wall", "cpu"))},
    }
    print(f"## attngeom analyze from the command line ({args.model}, {args.dataset}, L = {args.length}, "
          f"{args.sequences} sequences, {result['cpu_count']} CPUs, {args.reps} reps; medians)")
    print(table(["no-op wall s", "no-op CPU s", "full wall s", "incremental wall s", "incremental / full wall",
                 "full CPU s", "incremental CPU s", "incremental / full CPU"],
                [[result["no_op_wall"], result["no_op_cpu"], result["full_wall"], result["incremental_wall"],
                  result["wall_ratio"], result["full_cpu"], result["incremental_cpu"], result["cpu_ratio"]]]))
    print("\n## Where the fixed part goes (fresh processes, same repetitions; medians, s)")
    print(table(["", "wall s", "CPU s"],
                [["a call's fixed part (2 x incremental - full)", result["fixed_wall"], result["fixed_cpu"]],
                 *[[{"CLI": "the interpreter and the CLI", "libraries": "+ zarr, Dask's arrays, xarray, numba",
                     "kernels": "+ the kernels loaded"}[part], result[f"{part}_wall"], result[f"{part}_cpu"]]
                   for part in PARTS]]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
