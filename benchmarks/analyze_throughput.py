#!/usr/bin/env python
"""Analyze-stage benchmark: kernel vs brute force, scaling, and memory on a multi-GB store.

    python benchmarks/analyze_throughput.py                    # default mode, ~5-10 min on 2 cores
    python benchmarks/analyze_throughput.py --json bench.json
    python benchmarks/analyze_throughput.py --big --skip-default --json big.json   # long: ~30 min

What is measured (every store is synthetic, `attngeom.synthetic.write_synthetic_run`):

1. **Kernel vs brute force.** Head-instances per second of ``topn_metrics`` (and
   ``value_statistics``) over a batch of B = 8 heads of one (sequence, layer), against the
   brute-force twin of ``tests/test_analyze_kernels.py`` (``brute_topn``, ``brute_value_statistics``)
   run on single instances of the same batch, at L = 128, 512, 1024 and head_dim 64 and 256,
   default N grid (powers of two < L). Brute force is slow (seconds per instance at L = 1024),
   so each repetition times one instance (a few at L = 128). Each repetition runs kernel and
   brute force back to back (order alternating) and the speed-up is the ratio within the
   repetition; tables give medians. Each brute-force instance is also checked against the
   kernel run on that instance alone (counts exact, floats to 1e-9 relative).
2. **Scaling.** ``analyze(store, scheduler="threads")`` wall time on stores of 2 layers, 8 heads,
   2 kv heads, head_dim 128: over L = 128, 512, 1024 at 4 sequences, and over 8, 16, 32
   sequences at L = 512 (each repetition analyzes anew: the earlier analysis is deleted);
   seconds per head-instance, split into the fixed part (``_cross_sequence_groups``: the
   reductions across sequences into ``heads``/``summary``/``signatures``/``table``) and the
   rest (reading, both kernels, writing the per-sequence groups, the small cross-sequence
   writes and the commit). "kernel" is the serial time of ``topn_metrics`` + ``value_statistics`` on one
   block of the same store, timed in the same repetition; "per-seq / kernel" is then about
   1/threads for a stage that adds no overhead. Configurations are interleaved per repetition.
   The "BLAS default" rows repeat the L series with OpenBLAS at its default thread count.

   OpenBLAS threads: parts 1 and 2 run numpy's OpenBLAS with ``--blas-threads`` (default 1, what
   Dask's worker processes get from ``distributed.nanny.pre-spawn-environ``), set at run time
   through scipy-openblas' ``scipy_openblas_set_num_threads64_``; part 1 also times the kernel
   with the default thread count (the "BLAS n thr" column).
3. **Memory on a multi-GB store** (``--big``). Stores of realistic shape (by default L = 1024,
   16 layers, 4 heads, 4 kv heads, head_dim 256: 64 MiB of float32 values per sequence, 4 MiB per
   (sequence, layer) chunk; sizes from ``--big-seqs``, by default 8 and 36 sequences: 0.5 and
   2.25 GiB of values, ~15-30 min on 2 busy cores; random values barely compress, so the store
   takes about as much disk) analyzed by the ``attngeom analyze`` CLI in a
   subprocess, against a ``distributed.LocalCluster(n_workers=2, threads_per_worker=1,
   memory_limit="1GiB")`` passed as ``--scheduler``. A background thread polls the RSS of the
   workers and of the CLI process every 0.2 s; reported: peaks, whether the CLI completed,
   whether a worker was restarted (its pid changed), and the output's shape.

The machine is assumed shared and noisy: compare ratios taken within one run, not absolute times
across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from attngeom.analyze import stage  # noqa: E402
from attngeom.analyze.kernels import topn_metrics, value_statistics  # noqa: E402
from attngeom.analyze.stage import default_n_grid  # noqa: E402
from attngeom.synthetic import write_synthetic_run  # noqa: E402

GiB = 2**30
MiB = 2**20
COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact", "sink_selected")


class Blas:
    """Sets the thread count of numpy's OpenBLAS at run time (threadpoolctl is not a
    dependency): scipy-openblas exports ``scipy_openblas_set_num_threads64_``."""

    def __init__(self):
        import ctypes
        import glob

        self.default = os.cpu_count() or 1
        self._set = self._get = None
        libs = glob.glob(str(Path(np.__file__).parent.parent / "numpy.libs" / "*openblas*"))
        for lib in libs:
            handle = ctypes.CDLL(lib)
            for suffix in ("64_", "_64_", ""):
                try:
                    self._set = getattr(handle, f"scipy_openblas_set_num_threads{suffix}")
                    self._get = getattr(handle, f"scipy_openblas_get_num_threads{suffix}")
                    self.default = int(self._get())
                    return
                except AttributeError:
                    continue

    @property
    def available(self) -> bool:
        return self._set is not None

    def set(self, n: int) -> None:
        if self._set is not None:
            self._set(int(n))

    def get(self) -> int | None:
        return int(self._get()) if self._get is not None else None


BLAS = Blas()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------ 1. kernel vs brute force


def synthetic_batch(rng: np.random.Generator, B: int, L: int, D: int):
    """Like `attngeom.synthetic`: softmax of Gaussian scores with a heavy sink, Gaussian values
    with a small sink vector, every key attendable."""
    scores = rng.normal(scale=2.0, size=(B, L))
    scores[:, 0] += 4.0
    attn = np.exp(scores - scores.max(axis=1, keepdims=True))
    attn /= attn.sum(axis=1, keepdims=True)
    values = rng.normal(size=(B, L, D))
    values[:, 0] *= 0.2
    return attn, values, np.ones((B, L), dtype=bool)


def agrees(got: dict, want: dict, names) -> bool:
    for name in names:
        if name not in want:
            continue
        g, w = np.asarray(got[name]), np.asarray(want[name])
        if name in COUNTS:
            if not np.array_equal(g, w):
                return False
        elif not np.allclose(g, w, rtol=1e-9, atol=1e-12, equal_nan=True):
            return False
    return True


def bench_kernel_vs_brute(lengths, dims, B: int, reps: int, blas_threads: int, log) -> list[dict]:
    from test_analyze_kernels import brute_topn, brute_value_statistics

    rows = []
    for L in lengths:
        for D in dims:
            rng = np.random.default_rng(L * 1000 + D)
            attn, values, att = synthetic_batch(rng, B, L, D)
            grid = default_n_grid(L)
            brute_n = 4 if L <= 128 else 1  # instances per repetition
            topn_metrics(attn, values, att, grid, seed=1)  # warm-up
            value_statistics(values, att)
            k_topn, k_vals, k_multi, b_topn, b_vals, ok = [], [], [], [], [], True
            for rep in range(reps):
                idx = [(rep * brute_n + i) % B for i in range(brute_n)]

                def kernel():
                    BLAS.set(blas_threads)
                    t0 = time.perf_counter()
                    topn_metrics(attn, values, att, grid, seed=1)
                    t1 = time.perf_counter()
                    value_statistics(values, att)
                    t2 = time.perf_counter()
                    k_topn.append((t1 - t0) / B)
                    k_vals.append((t2 - t1) / B)
                    if BLAS.available and BLAS.default != blas_threads:
                        BLAS.set(BLAS.default)
                        t0 = time.perf_counter()
                        topn_metrics(attn, values, att, grid, seed=1)
                        value_statistics(values, att)
                        k_multi.append((time.perf_counter() - t0) / B)
                        BLAS.set(blas_threads)

                def brute():
                    nonlocal ok
                    tt = tv = 0.0
                    for b in idx:
                        sl = slice(b, b + 1)
                        t0 = time.perf_counter()
                        want = brute_topn(attn[sl], values[sl], att[sl], grid, seed=2)
                        t1 = time.perf_counter()
                        want_v = brute_value_statistics(values[sl], att[sl])
                        t2 = time.perf_counter()
                        tt, tv = tt + t1 - t0, tv + t2 - t1
                        got = topn_metrics(attn[sl], values[sl], att[sl], grid, seed=2)
                        got_v = value_statistics(values[sl], att[sl])
                        ok = ok and agrees(got, want, got) and agrees(got_v, want_v, got_v)
                    b_topn.append(tt / len(idx))
                    b_vals.append(tv / len(idx))

                for f in ((kernel, brute) if rep % 2 == 0 else (brute, kernel)):
                    f()
            speed_topn = [b / k for b, k in zip(b_topn, k_topn)]
            speed_all = [(bt + bv) / (kt + kv) for bt, bv, kt, kv in zip(b_topn, b_vals, k_topn, k_vals)]
            row = dict(
                L=L, head_dim=D, batch=B, n_grid=len(grid), reps=reps, brute_instances=reps * brute_n,
                kernel_topn_inst_per_s=1 / median(k_topn),
                kernel_all_inst_per_s=1 / median([a + b for a, b in zip(k_topn, k_vals)]),
                kernel_all_inst_per_s_blas_default=1 / median(k_multi) if k_multi else math.nan,
                blas_threads=blas_threads, blas_default=BLAS.default,
                brute_topn_s_per_inst=median(b_topn),
                brute_all_s_per_inst=median([a + b for a, b in zip(b_topn, b_vals)]),
                speedup_topn=median(speed_topn), speedup_all=median(speed_all),
                speedup_all_min=min(speed_all), agrees=bool(ok),
            )
            log(f"  L={L} D={D}: kernel {row['kernel_all_inst_per_s']:.1f} inst/s, "
                f"brute {row['brute_all_s_per_inst']:.2f} s/inst, x{row['speedup_all']:.0f}")
            rows.append(row)
    return rows


def kernel_table(rows) -> str:
    return table(
        ["L", "head_dim", "kernel topn inst/s", "kernel topn+values inst/s",
         "brute topn s/inst", "brute topn+values s/inst", "speed-up topn", "speed-up topn+values",
         "(min)", "brute inst timed", "agree", f"kernel topn+values inst/s, BLAS {BLAS.default} thr"],
        [[r["L"], r["head_dim"], fmt(r["kernel_topn_inst_per_s"]), fmt(r["kernel_all_inst_per_s"]),
          fmt(r["brute_topn_s_per_inst"]), fmt(r["brute_all_s_per_inst"]),
          f"{r['speedup_topn']:.0f}x", f"{r['speedup_all']:.0f}x", f"{r['speedup_all_min']:.0f}x",
          r["brute_instances"], "yes" if r["agrees"] else "NO",
          fmt(r["kernel_all_inst_per_s_blas_default"])] for r in rows],
    )


# ------------------------------------------------------------------ 2. scaling of analyze


@contextlib.contextmanager
def phase_timers() -> Iterator[dict[str, float]]:
    """Time analyze's phases by wrapping stage-module functions for the duration."""
    times: dict[str, float] = {}
    names = ("_cross_sequence_groups",)
    saved = {name: getattr(stage, name) for name in names}

    def wrap(name, f):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        return timed

    for name, f in saved.items():
        setattr(stage, name, wrap(name, f))
    try:
        yield times
    finally:
        for name, f in saved.items():
            setattr(stage, name, f)


def kernel_block_seconds(store: str) -> float:
    """Single-thread topn_metrics + value_statistics on one (sequence, layer) block of the
    store, as _topn_block/_values_block call them (kv-head values and head_kv): seconds per
    head-instance."""
    ds = stage.open_completed(store, "r")
    head_kv = ds["head_kv"].values
    attn = ds["attn_last"][0, 0].values.astype(np.float64)
    values = ds["values"][0, 0].values.astype(np.float64)
    att = np.broadcast_to(ds["attendable"][0].values, values.shape[:2])
    grid = default_n_grid(ds.sizes["key"])
    t0 = time.perf_counter()
    topn_metrics(attn, values, att, grid, head_kv=head_kv, seed=1, random_draws=stage.RANDOM_DRAWS)
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
                stage.analyze(path, scheduler="threads", progress=False)  # warm-up (imports)
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
            with phase_timers() as times:
                t0 = time.perf_counter()
                (result,) = stage.analyze(stores[i], scheduler="threads", progress=False)
                wall = time.perf_counter() - t0
            fixed = times.get("_cross_sequence_groups", 0.0)
            samples[i].append(dict(wall=wall, per_seq=wall - fixed, fixed=fixed,
                                   instances=result.instances, kernel=kernel))
        log(f"  scaling repetition {rep + 1}/{reps} done")
    rows = []
    for cfg, ss in zip(configs, samples):
        n = ss[0]["instances"]
        rows.append(dict(
            series=cfg["series"], L=cfg["L"], seqs=cfg["seqs"], blas_threads=cfg["blas"],
            instances=n, **layout, reps=reps,
            wall_s=median([s["wall"] for s in ss]),
            s_per_inst=median([s["wall"] / n for s in ss]),
            per_seq_s_per_inst=median([s["per_seq"] / n for s in ss]),
            fixed_s=median([s["fixed"] for s in ss]),
            kernel_s_per_inst=median([s["kernel"] for s in ss]),
            per_seq_over_kernel=median([s["per_seq"] / n / s["kernel"] for s in ss]),
        ))
    return rows


def scaling_table(rows) -> str:
    return table(
        ["series", "L", "seqs", "BLAS thr", "instances", "wall s", "s/inst (total)", "s/inst (per-seq part)",
         "fixed part s", "kernel s/inst (serial)", "per-seq / kernel"],
        [[r["series"], r["L"], r["seqs"], r["blas_threads"], r["instances"], fmt(r["wall_s"]), fmt(r["s_per_inst"]),
          fmt(r["per_seq_s_per_inst"]), fmt(r["fixed_s"]), fmt(r["kernel_s_per_inst"]),
          fmt(r["per_seq_over_kernel"], 2)] for r in rows],
    )


# ------------------------------------------------------------------ 3. memory on a big store


class RssPoller:
    """Polls the resident set size of some processes from a background thread."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.pids: dict[str, list[int]] = {}
        self.peak: dict[str, int] = {}
        self.peak_sum: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, label: str, pids: list[int]) -> None:
        self.pids[label] = list(pids)

    def _rss(self, pid: int) -> int:
        try:
            return self._psutil.Process(pid).memory_info().rss
        except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            for label, pids in list(self.pids.items()):
                rss = [self._rss(p) for p in pids]
                self.peak[label] = max(self.peak.get(label, 0), *rss, 0)
                self.peak_sum[label] = max(self.peak_sum.get(label, 0), sum(rss))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def cli_command() -> list[str]:
    exe = Path(sys.executable).parent / "attngeom"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "attngeom.cli"]


def bench_big(workdir: Path, seqs_list: list[int], layout: dict, memory_limit: str,
              n_workers: int, keep: bool, log) -> list[dict]:
    import psutil
    import xarray as xr
    from distributed import Client, LocalCluster

    per_seq = layout["n_layers"] * layout["n_kv_heads"] * layout["length"] * layout["head_dim"] * 4
    rows = []
    for n_seq in seqs_list:
        values_bytes = n_seq * per_seq
        free = shutil.disk_usage(workdir).free
        if free < 1.3 * values_bytes + 2 * GiB:
            raise SystemExit(f"--big: {values_bytes / GiB:.2f} GiB store, only {free / GiB:.1f} GiB free in {workdir}")
        store = workdir / f"big_{n_seq}.zarr"
        log(f"  writing {n_seq} sequences ({values_bytes / GiB:.2f} GiB of values) to {store}")
        t0 = time.perf_counter()
        write_synthetic_run(str(store), "big", n_seq=n_seq, **{k: layout[k] for k in (
            "n_layers", "n_heads", "n_kv_heads", "head_dim")}, length=layout["length"])
        write_s = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
        log(f"  written in {write_s:.0f} s, {stored / GiB:.2f} GiB on disk; analyzing")
        with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                          memory_limit=memory_limit, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            start_pids = sorted(client.run(os.getpid).values())
            base_rss = max(client.run(lambda: __import__("psutil").Process().memory_info().rss).values())
            with RssPoller() as poller:
                poller.watch("workers", start_pids)
                t0 = time.perf_counter()
                proc = subprocess.Popen(
                    [*cli_command(), "analyze", "--store", str(store), "--scheduler", cluster.scheduler_address,
                     "--no-progress"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
                poller.watch("client", [proc.pid])
                out, err = proc.communicate()
                wall = time.perf_counter() - t0
            try:
                end_pids = sorted(client.run(os.getpid).values())
            except Exception:  # noqa: BLE001 - a cluster in trouble is a result, not an error
                end_pids = []
            scheduler_rss = psutil.Process().memory_info().rss
        completed = proc.returncode == 0
        reported = re.search(r"in ([0-9.]+) s", out or "")
        analyze_s = float(reported.group(1)) if reported else math.nan
        shape = None
        if completed:
            topn = xr.open_zarr(str(store), group="runs/big/analysis/topn", consolidated=False)
            shape = dict(topn.sizes)
        instances = n_seq * layout["n_layers"] * layout["n_heads"]
        row = dict(
            seqs=n_seq, **layout, values_gib=values_bytes / GiB, stored_gib=stored / GiB,
            instances=instances, write_s=write_s, memory_limit=memory_limit, n_workers=n_workers,
            completed=completed, returncode=proc.returncode, wall_s=wall, analyze_s=analyze_s,
            s_per_inst=analyze_s / instances,
            worker_idle_rss_mib=base_rss / MiB,
            peak_worker_rss_mib=poller.peak.get("workers", 0) / MiB,
            peak_workers_sum_rss_mib=poller.peak_sum.get("workers", 0) / MiB,
            peak_client_rss_mib=poller.peak.get("client", 0) / MiB,
            scheduler_process_rss_mib=scheduler_rss / MiB,
            worker_restarted=end_pids != start_pids, topn_sizes=shape,
            cli_stdout=out.strip()[-500:], cli_stderr=err.strip()[-2000:],
        )
        log(f"  {n_seq} seqs: completed={completed} in {wall:.0f} s, peak worker "
            f"{row['peak_worker_rss_mib']:.0f} MiB, client {row['peak_client_rss_mib']:.0f} MiB")
        if not completed:
            log(err[-2000:])
        rows.append(row)
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
    return rows


def big_table(rows) -> str:
    return table(
        ["seqs", "values GiB", "on disk GiB", "instances", "worker limit", "completed", "CLI wall s",
         "analyze s", "s/inst", "worker idle RSS MiB", "peak worker RSS MiB", "peak sum workers MiB",
         "peak client RSS MiB", "worker restarted"],
        [[r["seqs"], fmt(r["values_gib"]), fmt(r["stored_gib"]), r["instances"],
          f"{r['n_workers']} x {r['memory_limit']}", "yes" if r["completed"] else "NO",
          fmt(r["wall_s"]), fmt(r["analyze_s"]), fmt(r["s_per_inst"]), fmt(r["worker_idle_rss_mib"]),
          fmt(r["peak_worker_rss_mib"]), fmt(r["peak_workers_sum_rss_mib"]),
          fmt(r["peak_client_rss_mib"]), "yes" if r["worker_restarted"] else "no"] for r in rows],
    )


# ------------------------------------------------------------------ main


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--workdir", type=Path, help="where the synthetic stores go [default: a temporary folder]")
    p.add_argument("--lengths", type=ints, default=[128, 512, 1024], help="L of part 1 and of the L series")
    p.add_argument("--dims", type=ints, default=[64, 256], help="head_dim of part 1")
    p.add_argument("--batch", type=int, default=8, help="heads per kernel batch in part 1")
    p.add_argument("--kernel-reps", type=int, default=3)
    p.add_argument("--scale-seqs", type=ints, default=[8, 16, 32], help="store sizes of the size series (L=512)")
    p.add_argument("--scale-reps", type=int, default=2)
    p.add_argument("--blas-threads", type=int, default=1,
                   help="OpenBLAS threads of parts 1 and 2 [default: 1, as Dask workers run; "
                        "the machine's default is also timed side by side]")
    p.add_argument("--skip-default", action="store_true", help="skip parts 1 and 2")
    p.add_argument("--big", action="store_true", help="run part 3 (long)")
    p.add_argument("--big-seqs", type=ints, default=[8, 36])
    p.add_argument("--big-length", type=int, default=1024)
    p.add_argument("--big-layers", type=int, default=16)
    p.add_argument("--big-heads", type=int, default=4)
    p.add_argument("--big-kv-heads", type=int, default=4)
    p.add_argument("--big-head-dim", type=int, default=256)
    p.add_argument("--memory-limit", default="1GiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the --big stores")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict[str, Any] = dict(
        machine=dict(platform=platform.platform(), python=platform.python_version(),
                     numpy=np.__version__, cpus=os.cpu_count(), blas_default_threads=BLAS.default,
                     blas_control=BLAS.available,
                     load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None),
    )
    workdir_ctx = (contextlib.nullcontext(str(args.workdir)) if args.workdir
                   else tempfile.TemporaryDirectory(prefix="attngeom-bench-"))
    t_start = time.perf_counter()
    with workdir_ctx as wd:
        workdir = Path(wd)
        workdir.mkdir(parents=True, exist_ok=True)
        out = []
        if not args.skip_default:
            log("1. kernel vs brute force")
            results["kernel_vs_brute"] = bench_kernel_vs_brute(args.lengths, args.dims, args.batch,
                                                               args.kernel_reps, args.blas_threads, log)
            out += ["## Kernel vs brute force (head-instances; batch of "
                    f"{args.batch} heads; default N grid)", "", kernel_table(results["kernel_vs_brute"]), ""]
            log("2. scaling of analyze (scheduler='threads')")
            b = args.blas_threads
            configs = [dict(series="L", L=L, seqs=4, blas=b) for L in args.lengths]
            configs += [dict(series="store size", L=512, seqs=s, blas=b) for s in args.scale_seqs]
            if BLAS.available and BLAS.default != b:
                configs += [dict(series="BLAS default", L=L, seqs=4, blas=BLAS.default)
                            for L in (128, 1024) if L in args.lengths]
            results["scaling"] = bench_scaling(workdir, configs, args.scale_reps, log)
            BLAS.set(BLAS.default)
            out += ["## analyze scaling (threads scheduler; 2 layers, 8 heads, 2 kv heads, head_dim 128)",
                    "", scaling_table(results["scaling"]), ""]
        if args.big:
            layout = dict(length=args.big_length, n_layers=args.big_layers, n_heads=args.big_heads,
                          n_kv_heads=args.big_kv_heads, head_dim=args.big_head_dim)
            log(f"3. --big: {layout}")
            results["big"] = bench_big(workdir, args.big_seqs, layout, args.memory_limit,
                                       args.workers, args.keep, log)
            out += [f"## Memory on large stores (attngeom analyze CLI, LocalCluster; L={layout['length']}, "
                    f"{layout['n_layers']} layers, {layout['n_heads']} heads, {layout['n_kv_heads']} kv heads, "
                    f"head_dim {layout['head_dim']})", "", big_table(results["big"]), ""]
    results["total_s"] = time.perf_counter() - t_start
    out.append(f"_total {results['total_s']:.0f} s; load average at start "
               f"{results['machine']['load_avg']}_")
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
