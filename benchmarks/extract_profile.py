#!/usr/bin/env python
"""Where extract's time goes beyond the bare forward, phase by phase (run by hand).

    python benchmarks/extract_profile.py                                 # 32/32/128 at L=1024, 32/8/128 at L=4096
    python benchmarks/extract_profile.py --shapes 32/32/128@1024 --reps 5 --dtype bfloat16

The models are extract_thin.py's: random-weight Llama models with the paper's attention
(hidden size H x Dh, so the projections are the paper model's), an MLP ``--mlp`` wide so
that attention takes the share of the forward it takes on a GPU, ``--layers`` layers, one
sequence, ``--dtype`` the compute dtype.

First, per repetition, side by side in rotating order after an untimed warm-up: the bare
SDPA forward (``model.get_decoder()(input_ids=..., use_cache=False)``), the same forward
inside ``capturing(model)`` (nothing written), and ``ag.extract(model, token_ids=...)`` into
a fresh store, writes included; ratios to the SDPA forward, medians of per-repetition ratios.

Then one SDPA forward and one extract under ``torch.profiler`` with Python frames recorded,
and extract's wall time split by the frames it spends it in (each phase's seconds over the
profiled SDPA forward's, so the phases of extract add up to its ratio under the profiler):

* forward: the decoder outside the attention function (projections, RoPE, norms, MLP);
* attention output: the model's SDPA call, or for a float32 model the capture's own
  ``rows @ v`` (the bmm of the probabilities with the values) that replaces it;
* rows: the float32 recomputation of the probability rows: q and k laid out and scaled,
  ``q k^T`` per tile, the causal mask, the row maximum and the softmax;
* summaries: every other pass over a tile's rows (top-1, entropy, sink, diagonal, previous
  key, recent windows, the winner's ``A_ij ||v_j||`` and first argmax) and the per-layer
  layouts of the results;
* hand-off: the sequence's arrays stacked over layers and converted for the writer;
* writes: the writer's compression, checksums and writes, and the commit;
* other: the rest of ``ag.extract`` (input checks, the store's creation, provenance).

In the SDPA forward, "SDPA" is its attention calls and "forward" the rest. A phase's
seconds are the wall time of the frames named in ``PHASES``, on the calling thread (the
writer's encoder threads run inside "writes"). The profiler adds a few microseconds per
Python call and operator, more to the capture's many tile passes than to the forward's
few large products: read the profile for the split, the timed ratios for the total.
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
from torch.profiler import ProfilerActivity, profile

import attngeom as ag
from attngeom.extract.capture import capturing

VARIANTS = ("sdpa", "capture", "extract")
# Python frames (file name, function) that open a phase; the outermost one claims its time.
# Inside the capture, the per-tile operators are told apart by the order of a tile's passes:
# a tile's passes from its q k^T to its softmax are "rows", a bmm is the "attention output",
# everything else is "summaries".
PHASES = {
    ("sdpa_attention.py", "sdpa_attention_forward"): "attention output",
    ("capture.py", "attention_summaries"): "capture",
    ("pipeline.py", "_sequence_arrays"): "hand-off",
    ("runs.py", "write"): "writes",
}
ORDER = ("forward", "SDPA", "attention output", "rows", "summaries", "hand-off", "writes", "other")


def frame(name: str) -> tuple[str, str] | None:
    """(file name, function) of a Python frame event's name such as 'a/b/c.py(12): f'."""
    if "): " not in name or "(" not in name:
        return None
    where, func = name.rsplit("): ", 1)
    return Path(where.split("(")[0]).name, func


def capture_phases(event: Any, out: dict[str, float]) -> None:
    """Split attention_summaries' direct children: a tile's passes from ``_scores`` to its
    softmax are rows, bmm the attention output, the rest summaries (the setup before the
    first tile, q k v laid out and scaled, counts as rows; the Python between the operators,
    indexing and the loop, as summaries)."""
    phase = "rows"
    seen = 0.0
    for child in sorted(event.cpu_children, key=lambda e: e.time_range.start):
        f = frame(child.name)
        label = f[1] if f else child.name
        dt = child.cpu_time_total / 1e6
        seen += dt
        if label == "_scores":
            phase = "rows"
        if "bmm" in label:
            out["attention output"] += dt
        elif phase == "rows":
            out["rows"] += dt
            if "softmax" in label or "exp" in label:
                phase = "summaries"
        else:
            out["summaries"] += dt
    out["summaries"] += max(0.0, event.cpu_time_total / 1e6 - seen)


def split(prof: Any) -> dict[str, float]:
    """Seconds per phase of the profiled block, on the thread that ran it: the named phases,
    "forward" (the decoder's time outside them) and "other" (the rest of the block)."""
    out: dict[str, float] = defaultdict(float)
    tops = [e for e in prof.events() if e.cpu_parent is None]
    # The caller's thread: the one whose outermost frame is not a thread's bootstrap (a pool's).
    thread = max((e for e in tops if not e.name.startswith(("threading.py", "asyncio"))),
                 key=lambda e: e.cpu_time_total).thread
    tops = [e for e in tops if e.thread == thread]
    total = (max(e.time_range.end for e in tops) - min(e.time_range.start for e in tops)) / 1e6

    def walk(event: Any, in_forward: bool) -> float:
        """The seconds under ``event`` claimed by a phase (the decoder's rest included)."""
        f = frame(event.name)
        phase = PHASES.get(f) if f else None
        seconds = event.cpu_time_total / 1e6
        if phase == "capture":
            capture_phases(event, out)
            return seconds
        if phase is not None:
            out[phase] += seconds
            return seconds
        if f is not None and f[0] == "profiler.py":  # the profiler starting and stopping
            return seconds
        if not in_forward and event.name.startswith("nn.Module:"):  # the decoder's call
            out["forward"] += seconds - sum(walk(c, True) for c in event.cpu_children)
            return seconds
        return sum(walk(c, in_forward) for c in event.cpu_children)

    out["other"] = total - sum(walk(e, False) for e in tops)
    out["other"] -= sum(e.cpu_time_total for e in prof.events() if e.thread == thread
                        and (frame(e.name) or ("",))[0] == "profiler.py" and (e.cpu_parent is None or
                        (frame(e.cpu_parent.name) or ("",))[0] != "profiler.py")) / 1e6
    return dict(out)


def profiled(fn: Any) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    return split(prof)


def bench(shape: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    heads, kv_heads, head_dim, length = parse_shape(shape)
    model = thin_model(heads, kv_heads, head_dim, args.layers, args.mlp).to(getattr(torch, args.dtype))
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
    sdpa = profiled(runs["sdpa"])
    ext = profiled(extract)
    return {
        "shape": shape, "layers": args.layers, "mlp": args.mlp, "dtype": args.dtype, "reps": reps,
        "ratio": {k: median([r[k] / r["sdpa"] for r in reps]) for k in ("capture", "extract")},
        "sdpa_s": median([r["sdpa"] for r in reps]),
        "sdpa_phases": {"SDPA": sdpa.get("attention output", 0.0), "forward": sdpa.get("forward", 0.0),
                        "other": sdpa.get("other", 0.0)},
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
