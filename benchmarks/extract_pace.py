#!/usr/bin/env python
"""extract's loop against the SDPA forward, on the machine as it is and beside a CPU-bound
process: the real offline models and the thin paper shapes in one command (run by hand).

    python benchmarks/extract_pace.py                       # every case, quiet then busy: about 12 minutes
    python benchmarks/extract_pace.py --shapes 32/32/128@1024:256 --states busy --reps 5

Cases (``--shapes``) are offline model names at a context length (``smollm2-135m@1024``: windows of the
``--dataset`` corpus, as ``attngeom extract`` reads them) or extract_thin.py's thin shapes
``H/KV/Dh@L[:D]`` (random-weight Llama models, ``--layers`` layers, MLP ``--mlp`` wide, random
token ids). Each case's model is loaded once; then for each state, "quiet" (nothing started
beside it: the machine as it is, its load average reported) and "busy" (one CPU-bound process
started beside it, common.busy; ``--busy N`` adds N more throughout), an untimed warm-up and ``--reps`` repetitions of, in rotating
order over the same sequences:

* "SDPA fwd": ``model.get_decoder()(input_ids=ids, use_cache=False)`` with stock SDPA attention;
* "extract": ``ag.extract`` of the same sequences into a fresh store with default settings
  (torch's threads, the writer's), writes included; "loop" is its ``ExtractResult.seconds``,
  the per-batch forwards, captures and writes and the consolidation.

Ratios to the SDPA forward are taken within each repetition and reported as medians: loop
and extract() wall seconds, and extract()'s process CPU seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from common import busy, extract_store, load, median, now, rotate, store_tokens, table
from extract_thin import add_shape_args, parse_shape, run_shapes, thin_model, token_ids

import attngeom as ag

CASES = "smollm2-135m@1024,gemma3-270m@1024,32/32/128@1024:256,32/8/128@4096:256"
STATES = {"quiet": 0, "busy": 1}


def prepared(case: str, args: argparse.Namespace, workdir: Path) -> tuple[Any, torch.Tensor, Any]:
    """(model, ids (S, L), extract(store) -> ExtractResult) of a case."""
    name, _, length = case.partition("@")
    if "/" in name:
        heads, kv_heads, head_dim, length, hidden = parse_shape(case)
        model = thin_model(heads, kv_heads, head_dim, args.layers, args.mlp, hidden)
        ids = token_ids(args.num_sequences, length)
        return model, ids, lambda store: ag.extract(model, token_ids=ids, store=store, progress=False)
    loaded = load(name)
    extract = lambda store: extract_store(loaded, store, dataset=args.dataset, length=int(length),  # noqa: E731
                                          count=args.num_sequences)
    warm = str(workdir / "tokens.zarr")
    extract(warm)  # its windows are the forward's sequences
    ids = torch.from_numpy(store_tokens(warm).astype("int64"))
    shutil.rmtree(warm)
    return loaded.model, ids, extract


def one_rep(model: Any, ids: torch.Tensor, extract: Any, store: str, rep: int) -> dict[str, float]:
    def forward() -> None:
        with torch.inference_mode():
            for seq in ids:
                model.get_decoder()(input_ids=seq[None], use_cache=False)

    loop: list[float] = []

    def run_extract() -> None:
        result = extract(store)
        assert result.written == len(ids), result
        loop.append(result.seconds)
        shutil.rmtree(store)

    out: dict[str, float] = {}
    for name, run in rotate([("sdpa", forward), ("extract", run_extract)], rep):
        w0, c0 = now()
        run()
        w1, c1 = now()
        out[name], out[f"{name}_cpu"] = w1 - w0, c1 - c0
    out["loop"] = loop[0]
    return out


def bench(case: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model, ids, extract = prepared(case, args, workdir)
    store = str(workdir / "pace.zarr")
    states = []
    for state in args.states.split(","):
        with busy(STATES[state]):
            one_rep(model, ids, extract, store, 0)  # warm-up, untimed
            reps = []
            for rep in range(args.reps):
                r = one_rep(model, ids, extract, store, rep)
                r["loadavg_1min"] = os.getloadavg()[0]
                reps.append(r)
                print(f"  [{case} {state} rep {rep + 1}/{args.reps}] sdpa={r['sdpa']:.2f}s "
                      f"extract={r['extract']:.2f}s loop={r['loop']:.2f}s load={r['loadavg_1min']:.1f}",
                      file=sys.stderr, flush=True)
        states.append({
            "state": state, "times_s": {k: [r[k] for r in reps] for k in reps[0]},
            "ratio": {"loop": median([r["loop"] / r["sdpa"] for r in reps]),
                      "extract": median([r["extract"] / r["sdpa"] for r in reps]),
                      "extract_cpu": median([r["extract_cpu"] / r["sdpa_cpu"] for r in reps])},
        })
    return {"case": case, "sequences": len(ids), "states": states}


COLUMNS = ["case", "machine", "seqs", "SDPA fwd s", "loop/SDPA", "extract/SDPA", "extract/SDPA CPU", "load avg"]
NOTE = ("busy = one CPU-bound process started beside the run; load avg = 1-minute load average after each rep. "
        "Ratios: medians of per-rep ratios (wall; CPU = process CPU seconds). loop = ExtractResult.seconds; "
        "extract() adds the store's creation and the model's provenance.")


def report(results: dict[str, Any]) -> str:
    rows = [[r["case"], s["state"], r["sequences"], median(s["times_s"]["sdpa"]), s["ratio"]["loop"],
             s["ratio"]["extract"], s["ratio"]["extract_cpu"],
             "/".join(f"{x:.1f}" for x in s["times_s"]["loadavg_1min"])]
            for r in results["shapes"] for s in r["states"]]
    heading = (f"## extract's loop against the SDPA forward, quiet and busy ({results['torch_threads']} torch "
               f"threads, {os.cpu_count()} CPUs, {results['reps']} reps)")
    return "\n\n".join([heading, table(COLUMNS, rows), NOTE])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_shape_args(p)
    p.set_defaults(shapes=CASES)
    p.add_argument("--states", default="quiet,busy", help="comma-separated: quiet, busy")
    p.add_argument("--num-sequences", type=int, default=4,
                   help="sequences per extract (default 4: the run's creation and commit, paid once a run, "
                        "weigh on the ratio as on a short run)")
    p.add_argument("--dataset", default="python-docs")
    return run_shapes(p.parse_args(argv), bench, report, "attngeom-pace-")


if __name__ == "__main__":
    main()
