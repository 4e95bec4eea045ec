#!/usr/bin/env python
"""What geometry at any query costs: store bytes and analyze time per stored query (run by hand).

    python benchmarks/analyze_by_query.py                         # ~2 min on 2 cores
    python benchmarks/analyze_by_query.py --shapes llama2-7b --every 64 --json out.json

For each of the paper's shapes a synthetic store (``attngeom.extract.synthetic.write_synthetic_run``:
softmax rows with a heavy sink, Gaussian values) of one layer and ``--sequences`` sequences at
L = ``--length``, with rows kept at ``every:K`` (the queries L-1, L-1-K, ... down to 1):

- **bytes per (sequence, layer)**: the stored (compressed) objects of ``attn_rows`` against
  its raw size Q x heads x L x 4 and against everything else a sequence stores for that
  layer (values, attn_last, the per-query summaries); multiply by the model's layers for a
  sequence.
- **core-ms per instance**: the per-query analysis of one (sequence, layer) block read from
  the store (``attngeom.analyze.blocks``), one thread, divided by its heads and queries,
  against ``topn``'s per instance (``head_metrics`` at the final query) timed in the same
  repetition; their ratio is the cost of one stored query in final-query instances (about
  the mean of q/L over the stored queries, plus what does not shrink with the keys).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from common import PAPER_SHAPES as SHAPES, median, rotate, table
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attngeom.analyze import blocks  # noqa: E402
from attngeom.analyze.kernels import head_metrics  # noqa: E402
from attngeom.analyze.parameters import RANDOM_DRAWS, default_n_grid, instance_seed  # noqa: E402
from attngeom.extract.queries import query_positions  # noqa: E402
from attngeom.store import TOPN_VARIABLES  # noqa: E402
from attngeom.extract.synthetic import write_synthetic_run  # noqa: E402

RUN = "synthetic"
OTHER = ("values", "attn_last", "winner", "sink_attn", "diag_attn", "top1_attn", "entropy")


def stored_bytes(store: str, name: str, n_seq: int) -> float:
    """Mean bytes of one sequence's objects of a run array (a shard, or a chunk, per sequence)."""
    folder = Path(store) / "runs" / RUN / name / "c"
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / n_seq


def cpu_ms(fn) -> float:
    c0 = time.process_time()
    fn()
    return (time.process_time() - c0) * 1e3


def measure(store: str, length: int, positions: tuple[int, ...], reps: int) -> dict:
    run = zarr.open_group(store, mode="r")[f"runs/{RUN}"]
    grid = np.asarray(default_n_grid(length), dtype=np.int64)
    head_kv = run["head_kv"][:]
    attendable = run["attendable"][:]
    H = head_kv.size

    def per_query():
        return blocks._query_block(
            block_id=(0, 0), seqs=np.array([0]), store=store, inputs=(run["attn_rows"], run["values"]),
            attendable=attendable, head_kv=head_kv, positions=np.asarray(positions), n_grid=grid, seed=0)

    attn = run["attn_last"][0, 0].astype(np.float64)
    values = run["values"][0, 0].astype(np.float64)

    def final():
        return head_metrics(attn, values, np.broadcast_to(attendable[0], values.shape[:2]), grid,
                            head_kv=head_kv, seed=instance_seed(0, 0, 0), random_draws=RANDOM_DRAWS)

    runs = {"by_query": per_query, "final": final}
    times = {name: [] for name in runs}
    with threadpool_limits(1):
        last = per_query()[0, 0][:, -1]  # compiled or loaded from numba's cache, outside the timing
        topn, _ = final()
        same = all(np.array_equal(last[:, :, i], np.asarray(topn[name], dtype=np.float64), equal_nan=True)
                   for i, name in enumerate(TOPN_VARIABLES))
        for rep in range(reps):
            for name in rotate(list(runs), rep):
                times[name].append(cpu_ms(runs[name]))
    per_query_ms = [t / (H * len(positions)) for t in times["by_query"]]
    final_ms = [t / H for t in times["final"]]
    return dict(per_query_ms=median(per_query_ms), final_ms=median(final_ms),
                ratio=median([q / f for q, f in zip(per_query_ms, final_ms)]),
                mean_q_over_L=float(np.mean(np.asarray(positions) + 1) / length), last_equals_topn=same)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--every", type=int, default=128, help="K of --queries every:K")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    positions = query_positions(f"every:{args.every}", args.length)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            H, KV, D = SHAPES[name]
            store = f"{tmp}/{name}.zarr"
            write_synthetic_run(store, RUN, n_seq=args.sequences, n_layers=1, n_heads=H, n_kv_heads=KV,
                                head_dim=D, length=args.length, queries=positions)
            rows_bytes = stored_bytes(store, "attn_rows", args.sequences)
            other = sum(stored_bytes(store, n, args.sequences) for n in OTHER)
            raw = len(positions) * H * args.length * 4
            r = dict(queries=len(positions), attn_rows_mb=rows_bytes / 2**20, raw_mb=raw / 2**20,
                     rest_mb=other / 2**20, **measure(store, args.length, positions, args.reps))
            results[name] = r
            rows.append([name, r["queries"], r["attn_rows_mb"], r["raw_mb"], r["rest_mb"],
                         r["per_query_ms"], r["final_ms"], r["ratio"], r["mean_q_over_L"], r["last_equals_topn"]])
            print(rows[-1], flush=True)
    print(f"\nL = {args.length}, queries every:{args.every}; MB per (sequence, layer); core-ms per instance")
    print(table(["shape", "Q", "attn_rows MB", "raw MB", "rest of run MB", "per stored query ms",
                 "final query ms", "ratio", "mean (q+1)/L", "L-1 = topn"], rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
