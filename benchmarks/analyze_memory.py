#!/usr/bin/env python
"""Memory of analyze on multi-GB stores (run by hand; long: ~30 min).

    python benchmarks/analyze_memory.py --json big.json

Synthetic stores of realistic shape (``attngeom.extract.synthetic.write_synthetic_run``; by default
L = 1024, 16 layers, 4 heads, 4 kv heads, head_dim 256: 64 MiB of float32 values per sequence,
4 MiB per (sequence, layer) chunk; sizes from ``--seqs``, by default 8 and 36 sequences: 0.5 and
2.25 GiB of values; random values barely compress, so the store takes about as much disk)
analyzed by the ``attngeom analyze`` CLI in a subprocess, against a
``distributed.LocalCluster(n_workers=2, threads_per_worker=1, memory_limit="1GiB")`` passed as
``--scheduler``. A background thread polls the RSS of the workers and of the CLI process every
0.2 s; reported: peaks, whether the CLI completed, whether a worker was restarted (its pid
changed), and the output's shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import fmt, int_list, table as md_table

from attngeom.extract.synthetic import write_synthetic_run

GiB = 2**30
MiB = 2**20



class RssPoller:
    """Polls the resident set size of some processes from a background thread."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self.psutil = psutil
        self.interval = interval
        self.pids: dict[str, list[int]] = {}
        self.peak: dict[str, int] = {}
        self.peak_sum: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def watch(self, label: str, pids: list[int]) -> None:
        self.pids[label] = list(pids)

    def rss(self, pid: int) -> int:
        try:
            return self.psutil.Process(pid).memory_info().rss
        except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
            return 0

    def run(self) -> None:
        while not self.stop.is_set():
            for label, pids in list(self.pids.items()):
                rss = [self.rss(p) for p in pids]
                self.peak[label] = max(self.peak.get(label, 0), *rss, 0)
                self.peak_sum[label] = max(self.peak_sum.get(label, 0), sum(rss))
            self.stop.wait(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


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
    return md_table(
        ["seqs", "values GiB", "on disk GiB", "instances", "worker limit", "completed", "CLI wall s",
         "analyze s", "s/inst", "worker idle RSS MiB", "peak worker RSS MiB", "peak sum workers MiB",
         "peak client RSS MiB", "worker restarted"],
        [[r["seqs"], fmt(r["values_gib"]), fmt(r["stored_gib"]), r["instances"],
          f"{r['n_workers']} x {r['memory_limit']}", "yes" if r["completed"] else "NO",
          fmt(r["wall_s"]), fmt(r["analyze_s"]), fmt(r["s_per_inst"]), fmt(r["worker_idle_rss_mib"]),
          fmt(r["peak_worker_rss_mib"]), fmt(r["peak_workers_sum_rss_mib"]),
          fmt(r["peak_client_rss_mib"]), "yes" if r["worker_restarted"] else "no"] for r in rows],
    )



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--workdir", type=Path, help="where the synthetic stores go [default: a temporary folder]")
    p.add_argument("--seqs", type=int_list, default=[8, 36])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--memory-limit", default="1GiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the stores")
    args = p.parse_args(argv)
    layout = dict(length=args.length, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                  head_dim=args.head_dim)
    workdir_ctx = (contextlib.nullcontext(str(args.workdir)) if args.workdir
                   else tempfile.TemporaryDirectory(prefix="attngeom-bench-"))
    with workdir_ctx as wd:
        Path(wd).mkdir(parents=True, exist_ok=True)
        rows = bench_big(Path(wd), args.seqs, layout, args.memory_limit, args.workers, args.keep,
                         lambda m: print(m, file=sys.stderr, flush=True))
    print(f"## Memory on large stores (attngeom analyze CLI, LocalCluster; L={layout['length']}, "
          f"{layout['n_layers']} layers, {layout['n_heads']} heads, {layout['n_kv_heads']} kv heads, "
          f"head_dim {layout['head_dim']})\n")
    print(big_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
