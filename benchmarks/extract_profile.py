#!/usr/bin/env python
"""Where extract's time goes beyond the bare forward, phase by phase (run by hand).

    python benchmarks/extract_profile.py                                 # extract_thin.py's four shapes
    python benchmarks/extract_profile.py --shapes 32/32/128@1024 --reps 5 --dtype bfloat16

The models are extract_thin.py's: random-weight Llama models with the paper's attention
(hidden size H x Dh, so the projections are the paper model's), an MLP ``--mlp`` wide so
that attention takes the share of the forward it takes on a GPU, ``--layers`` layers, one
sequence, ``--dtype`` the compute dtype.

First, per repetition, side by side in rotating order after an untimed warm-up: the bare
SDPA forward (``model.get_decoder()(input_ids=..., use_cache=False)``), the same forward
inside ``capturing(model)`` (nothing written), and ``ag.extract(model, token_ids=...)`` into
a fresh store, writes included; ratios to the SDPA forward, medians of per-repetition ratios.

Then one SDPA forward and one extract under ``torch.profiler``, and extract's wall time split
by the ranges the package names its phases with (``attngeom.*``, docs/architecture.md) and
torch's own SDPA operator, each phase's seconds over the profiled SDPA forward's (so the
phases of extract add up to its ratio under the profiler):

* forward: the decoder outside the attention function (projections, RoPE, norms, MLP):
  ``attngeom.forward`` less the capture and SDPA inside it;
* attention output: the model's SDPA call (``aten::scaled_dot_product_attention``), or for a
  float32 model the capture's own ``rows @ v`` that replaces it (``attngeom.output``);
* rows: the float32 recomputation of the probability rows, q k^T per tile, the causal mask,
  the row maximum and the softmax (``attngeom.rows``);
* summaries: the rest of ``attngeom.capture``: the setup of a layer (q, k and v laid out and
  scaled), every other pass over a tile's rows (top-1, entropy, sink, diagonal, previous key,
  recent windows, the winner's ``A_ij ||v_j||`` and first argmax) and the per-layer layouts;
* hand-off: the sequence's arrays taken from the capture for the writer, one part per layer
  (``attngeom.hand_off``);
* writes: the writer's stack of the parts over layers, their conversion, compression,
  checksums and writes, and the sequence's commit (``attngeom.write`` less the hand-off
  inside it: on CPU the writer runs in extract's thread);
* other: the rest of ``ag.extract`` (input checks, the store's creation, provenance).

In the SDPA forward, "SDPA" is its attention operators and "forward" the rest of the
decoder's call. The profiler adds a few microseconds per operator and range, more to the
capture's many tile passes than to the forward's few large products: read the profile for
the split, the timed ratios for the total.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from common import median, now, rotate, table
from extract_thin import add_shape_args, parse_shape, run_shapes, thin_model, token_ids
from torch.profiler import ProfilerActivity, profile, record_function

import attngeom as ag
from attngeom.extract.capture import capturing

VARIANTS = ("sdpa", "capture", "extract")
# The ranges of a profile that the phases are read from: extract's, as the package names them,
# the bare forward's own (this script's), and torch's SDPA operator.
FORWARD, CAPTURE, ROWS, OUTPUT, HAND_OFF, WRITE = (
    "attngeom.forward", "attngeom.capture", "attngeom.rows", "attngeom.output", "attngeom.hand_off", "attngeom.write")
BARE_FORWARD = "benchmark.forward"
SDPA = "aten::scaled_dot_product_attention"
ORDER = ("forward", "SDPA", "attention output", "rows", "summaries", "hand-off", "writes", "other")


def within(inner: Any, outer: Any) -> bool:
    """Whether the profiler event ``inner`` ran inside ``outer`` (same thread, nested time)."""
    return (inner.thread == outer.thread and outer.time_range.start <= inner.time_range.start
            and inner.time_range.end <= outer.time_range.end)


def split(events: list[Any], total: float) -> dict[str, float]:
    """Seconds per phase of a profiled block that took ``total`` seconds, from its events."""
    by_name: dict[str, list[Any]] = defaultdict(list)
    for e in events:
        by_name[e.name].append(e)

    def seconds(name: str, inside: str | None = None) -> float:
        """Seconds of the ranges ``name`` (only those inside a range ``inside``)."""
        return sum(e.cpu_time_total for e in by_name[name]
                   if inside is None or any(within(e, o) for o in by_name[inside])) / 1e6

    if by_name[BARE_FORWARD]:  # the bare SDPA forward
        forward = seconds(BARE_FORWARD)
        return {"forward": forward - seconds(SDPA), "SDPA": seconds(SDPA), "other": total - forward}
    forward, write = seconds(FORWARD), seconds(WRITE)
    capture, output, sdpa = seconds(CAPTURE), seconds(OUTPUT), seconds(SDPA, inside=FORWARD)
    return {
        "forward": forward - capture - sdpa,
        "attention output": output + sdpa,
        "rows": seconds(ROWS),
        "summaries": capture - seconds(ROWS) - output,
        "hand-off": seconds(HAND_OFF),
        "writes": write - seconds(HAND_OFF, inside=WRITE),
        "other": total - forward - write,
    }


def profiled(fn: Any) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        w0, _ = now()
        fn()
        total = now()[0] - w0
    return split(list(prof.events()), total)


def bench(shape: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    heads, kv_heads, head_dim, length, hidden = parse_shape(shape)
    model = thin_model(heads, kv_heads, head_dim, args.layers, args.mlp, hidden).to(getattr(torch, args.dtype))
    ids = token_ids(1, length)
    store = str(workdir / "profile.zarr")

    def forward(capture: bool) -> None:
        with torch.inference_mode(), capturing(model) if capture else contextlib.nullcontext():
            model.get_decoder()(input_ids=ids, use_cache=False)

    def extract() -> None:
        shutil.rmtree(store, ignore_errors=True)
        result = ag.extract(model, token_ids=ids, store=store, progress=False)
        assert result.written == 1, result

    runs = {"sdpa": lambda: forward(False), "capture": lambda: forward(True), "extract": extract}
    for fn in runs.values():
        fn()  # warm-up
    reps = []
    for rep in range(args.reps):
        out = {}
        for name in rotate(list(VARIANTS), rep):
            w0, _ = now()
            runs[name]()
            out[name] = now()[0] - w0
        reps.append(out)
        print(f"  [{shape} rep {rep + 1}/{args.reps}] " + " ".join(f"{k}={out[k]:.2f}s" for k in VARIANTS)
              + f" load={os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    def bare_forward() -> None:
        with record_function(BARE_FORWARD):
            forward(False)

    sdpa = profiled(bare_forward)
    ext = profiled(extract)
    return {
        "shape": shape, "layers": args.layers, "mlp": args.mlp, "dtype": args.dtype, "reps": reps,
        "ratio": {k: median([r[k] / r["sdpa"] for r in reps]) for k in ("capture", "extract")},
        "sdpa_s": median([r["sdpa"] for r in reps]),
        "sdpa_phases": sdpa,
        "extract_phases": ext,
    }


def report(results: dict[str, Any]) -> str:
    out = [f"## extract's time by phase ({results['torch_threads']} torch threads, {results['reps']} reps)\n"]
    out.append(table(
        ["H/KV/Dh@L", "dtype", "SDPA fwd s", "capture fwd / SDPA", "extract / SDPA"],
        [[r["shape"], r["dtype"], r["sdpa_s"], r["ratio"]["capture"], r["ratio"]["extract"]]
         for r in results["shapes"]],
    ))
    out.append("\nUnder the profiler, seconds of each phase over the profiled SDPA forward's "
               "(extract's column adds up to its profiled ratio):\n")
    rows = []
    for r in results["shapes"]:
        base = sum(r["sdpa_phases"].values())
        for run, phases in (("SDPA fwd", r["sdpa_phases"]), ("extract", r["extract_phases"])):
            rows.append([r["shape"], run] + [phases.get(k, 0.0) / base for k in ORDER] + [sum(phases.values()) / base])
    out.append(table(["H/KV/Dh@L", "run", *ORDER, "total"], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_shape_args(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    return run_shapes(p.parse_args(argv), bench, report, "attngeom-profile-")


if __name__ == "__main__":
    main()
