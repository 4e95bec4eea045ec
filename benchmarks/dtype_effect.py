#!/usr/bin/env python
"""How far the paper's quantities move when the model computes in bfloat16, or in float32 with
TF32 matmuls, instead of float32 (run by hand; the evidence behind the default dtype).

    python benchmarks/dtype_effect.py --workdir /tmp/dtype          # extract + analyze, then compare
    python benchmarks/dtype_effect.py --workdir /tmp/dtype --device cuda --json dtype.json

Per model, ``ag.extract`` over the same windows (``--dataset``, L, S) on ``--device`` once in
float32 and once in each of ``--dtypes`` (stores ``<workdir>/<model>-<dtype>-<device>.zarr``,
reused when already complete; the attention rows are float32 recomputations in every dtype,
from the model's own q and k, in TF32 too with float32-tf32), then ``ag.analyze`` of each,
then, each dtype against float32. TF32 is a GPU's: on a CPU float32-tf32 computes as float32
does, and every figure of its row is 0.

* regimes: heads whose regime (Retriever / Mixer / Reset) agrees;
* winners: stored ``winner`` entries (j* of every query of every head) that differ;
* F_8: median and largest |difference| of ``analysis/topn`` f_score at N = 8 over
  (sequence, layer, head), and the share of instances where it differs at all;
* λ (``sink_norm_ratio``) and median cosine (``median_cos``) per head: median and largest
  |difference| (λ relative to its float32 value);
* bound violations: instances with inversions > k_sink (every N) in each store, and how many
  instances change side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from common import table

import attngeom as ag

DTYPES = ("float32-tf32", "bfloat16")


def ensure_store(model: str, dtype: str, args: argparse.Namespace) -> str:
    """The analyzed store of ``model`` in ``dtype``: extracted and analyzed unless complete."""
    store = str(Path(args.workdir) / f"{model}-{dtype}-{args.device.replace(':', '')}.zarr")
    ag.extract(model, store=store, dataset=args.dataset, context_length=args.length,
               num_sequences=args.num_sequences, device=args.device, dtype=dtype, progress=False)
    ag.analyze(store)
    return store


def one_run(store: str) -> Any:
    opened = ag.open_store(store)
    (run_id,) = opened.runs
    return opened.run(run_id)


def compare(f32: Any, b16: Any, n: int = 8) -> dict[str, Any]:
    """Run ``b16`` (bfloat16 or float32-tf32) against float32 run ``f32`` (same model and windows)."""
    heads32, heads16 = f32.analysis("heads"), b16.analysis("heads")
    regime32, regime16 = heads32["regime"].values, heads16["regime"].values
    win32, win16 = f32.dataset()["winner"].values, b16.dataset()["winner"].values
    top32, top16 = f32.analysis("topn"), b16.analysis("topn")
    f_diff = np.abs(top16["f_score"].sel(n=n).values - top32["f_score"].sel(n=n).values)
    lam32, lam16 = heads32["sink_norm_ratio"].values, heads16["sink_norm_ratio"].values
    lam_rel = np.abs(lam16 - lam32) / np.abs(lam32)
    cos_diff = np.abs(heads16["median_cos"].values - heads32["median_cos"].values)
    viol32 = top32["inversions"].values > top32["k_sink"].values
    viol16 = top16["inversions"].values > top16["k_sink"].values
    return {
        "heads": int(regime32.size),
        "regimes_agree": int((regime32 == regime16).sum()),
        # With the shares of queries labelled diagonal / sink / other, float32 -> bfloat16: near ties.
        "regime_changes": [
            f"L{layer}H{head} {regime32[layer, head]}->{regime16[layer, head]} (votes "
            + "/".join(f"{float(heads32[f'vote_{v}'][layer, head]):.2f}" for v in ("diagonal", "sink", "other"))
            + " -> "
            + "/".join(f"{float(heads16[f'vote_{v}'][layer, head]):.2f}" for v in ("diagonal", "sink", "other"))
            + ")"
            for layer, head in zip(*np.nonzero(regime32 != regime16))
        ],
        "winner_entries": int(win32.size),
        "winners_differ": int((win32 != win16).sum()),
        "winners_differ_frac": float((win32 != win16).mean()),
        f"f{n}_median_abs_diff": float(np.nanmedian(f_diff)),
        f"f{n}_max_abs_diff": float(np.nanmax(f_diff)),
        f"f{n}_differ_frac": float((f_diff > 0).mean()),
        f"f{n}_mean_f32": float(np.nanmean(top32["f_score"].sel(n=n).values)),
        f"f{n}_mean_other": float(np.nanmean(top16["f_score"].sel(n=n).values)),
        "lambda_median_rel_diff": float(np.nanmedian(lam_rel)),
        "lambda_max_rel_diff": float(np.nanmax(lam_rel)),
        "median_cos_median_abs_diff": float(np.nanmedian(cos_diff)),
        "median_cos_max_abs_diff": float(np.nanmax(cos_diff)),
        "instances": int(viol32.size),
        "violations_f32": int(viol32.sum()),
        "violations_other": int(viol16.sum()),
        "violations_change_side": int((viol32 != viol16).sum()),
        "sequences": int(f32.dataset().sizes["seq"]),
        "compute_dtype": [f32.provenance.get("compute_dtype"), b16.provenance.get("compute_dtype")],
    }


def report(results: dict[str, dict[str, dict[str, Any]]], n: int = 8) -> str:
    rows = [[
        model, dtype, r["sequences"], f"{r['regimes_agree']}/{r['heads']}",
        f"{r['winners_differ']:,}/{r['winner_entries']:,} ({100 * r['winners_differ_frac']:.2f}%)",
        (f"{r[f'f{n}_median_abs_diff']:.3g} (max {r[f'f{n}_max_abs_diff']:.3g}; "
         f"{100 * r[f'f{n}_differ_frac']:.0f}% differ)"),
        f"{r['lambda_median_rel_diff']:.2e} (max {r['lambda_max_rel_diff']:.2e})",
        f"{r['median_cos_median_abs_diff']:.2e} (max {r['median_cos_max_abs_diff']:.2e})",
        f"{r['violations_f32']} / {r['violations_other']} of {r['instances']:,} ({r['violations_change_side']} change)",
    ] for model, by_dtype in results.items() for dtype, r in by_dtype.items()]
    return table(["model", "against float32", "seqs", "regimes agree", "winners differ", f"|ΔF_{n}| median",
                  "|Δλ|/λ median", "|Δ median cos| median", "inversions > k_sink f32 / other"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--num-sequences", type=int, default=16)
    p.add_argument("--workdir", required=True, help="folder of the stores (kept, reused when complete)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        reference = one_run(ensure_store(model, "float32", args))
        results[model] = {}
        for dtype in args.dtypes.split(","):
            store = ensure_store(model, dtype, args)
            print(f"{model}: {store}", file=sys.stderr, flush=True)
            results[model][dtype] = compare(reference, one_run(store))
    print(report(results))
    for model, by_dtype in results.items():
        for dtype, r in by_dtype.items():
            if r["regime_changes"]:
                print(f"\n{model} {dtype}: regimes that change: {', '.join(r['regime_changes'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
