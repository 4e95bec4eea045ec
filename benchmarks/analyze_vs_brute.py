#!/usr/bin/env python
"""The analyze kernels against their brute-force twins (run by hand).

    python benchmarks/analyze_vs_brute.py --json brute.json        # ~5 min on 2 cores

Head-instances per second of ``topn_metrics`` (and ``value_statistics``) over a batch of B = 8
heads of one (sequence, layer), against the brute-force twin of ``tests/test_analyze_kernels.py``
(``brute_topn``, ``brute_value_statistics``; the tests are their one home) run on single instances
of the same batch, at L = 128, 512, 1024 and head_dim 64 and 256, default N grid (powers of two
< L). Brute force is slow (seconds per instance at L = 1024), so each repetition times one
instance (a few at L = 128). Each repetition runs kernel and brute force back to back (order
alternating) and the speed-up is the ratio within the repetition; tables give medians. Each
brute-force instance is also checked against the kernel run on that instance alone (counts
exact, floats to 1e-9 relative). BLAS runs at ``--blas-threads`` (default 1, as Dask's worker
processes do); the kernel is also timed at the default thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
from common import Blas, fmt, int_list, median, table as md_table

from attngeom.analyze.kernels import topn_metrics, value_statistics
from attngeom.analyze.parameters import default_n_grid

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact", "sink_selected")
BLAS = Blas()



def synthetic_batch(rng: np.random.Generator, B: int, L: int, D: int):
    """Like `attngeom.extract.synthetic`: softmax of Gaussian scores with a heavy sink, Gaussian values
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
    return md_table(
        ["L", "head_dim", "kernel topn inst/s", "kernel topn+values inst/s",
         "brute topn s/inst", "brute topn+values s/inst", "speed-up topn", "speed-up topn+values",
         "(min)", "brute inst timed", "agree", f"kernel topn+values inst/s, BLAS {BLAS.default} thr"],
        [[r["L"], r["head_dim"], fmt(r["kernel_topn_inst_per_s"]), fmt(r["kernel_all_inst_per_s"]),
          fmt(r["brute_topn_s_per_inst"]), fmt(r["brute_all_s_per_inst"]),
          f"{r['speedup_topn']:.0f}x", f"{r['speedup_all']:.0f}x", f"{r['speedup_all_min']:.0f}x",
          r["brute_instances"], "yes" if r["agrees"] else "NO",
          fmt(r["kernel_all_inst_per_s_blas_default"])] for r in rows],
    )



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--lengths", type=int_list, default=[128, 512, 1024])
    p.add_argument("--dims", type=int_list, default=[64, 256], help="head_dim")
    p.add_argument("--batch", type=int, default=8, help="heads per kernel batch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--blas-threads", type=int, default=1)
    args = p.parse_args(argv)
    rows = bench_kernel_vs_brute(args.lengths, args.dims, args.batch, args.reps, args.blas_threads,
                                 lambda m: print(m, file=sys.stderr, flush=True))
    BLAS.set(BLAS.default)
    print(f"## Kernel vs brute force (head-instances; batch of {args.batch} heads; default N grid)\n")
    print(kernel_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"platform": platform.platform(), "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
