#!/usr/bin/env python
"""extract() against the plain forward of the same batches (run by hand).

    python benchmarks/extract_vs_forward.py --json extract.json
    python benchmarks/extract_vs_forward.py --models smollm2-135m --lengths 512 --num-sequences 2
    python benchmarks/extract_vs_forward.py --references sdpa        # the bare forward only, no eager peer

Per model and context length L, on the first windows of the corpus, each repetition times side
by side (order rotated per repetition, after one untimed warm-up extract whose tokens give the
batches every variant runs):

* "extract": ``ag.extract(model, tokenizer=..., dataset=...)`` into a fresh store, the model
  loaded once beforehand and handed over as an object (loading excluded): windows, store
  creation, the per-batch loop, writes, consolidation. "loop" is its ``ExtractResult.seconds``.
* "SDPA fwd": the reference, ``model.get_decoder()(input_ids=ids, use_cache=False)`` with stock
  SDPA attention: decoder only, no capture, no LM head.
* "capture fwd": the same decoder forward inside ``capturing(model)`` (the capture attention and
  the per-query summaries, nothing written).
* "eager+attn": the peers' way, the full model with its LM head, eager attention and
  ``output_attentions=True`` (attention maps left in memory, not saved).

Ratios are taken within each repetition (wall and process CPU time) and reported as medians.
Where extract's time goes comes from the same runs: capture overhead = capture fwd - SDPA fwd,
writes and the rest = extract - capture fwd. ``--profile`` adds torch.profiler's top operators
of one capturing forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import Loaded, extract_store, int_list, load, median, now, rotate, store_tokens, synchronize, table

from attngeom.extract.capture import capturing

VARIANTS = ("extract", "sdpa", "capture", "eager")


def batches_of(tokens: Any, batch_size: int, device: str) -> list[torch.Tensor]:
    return [
        torch.from_numpy(tokens[i : i + batch_size].astype("int64")).to(device)
        for i in range(0, len(tokens), batch_size)
    ]


def forward_sdpa(loaded: Loaded, batches: list[torch.Tensor]) -> None:
    with torch.inference_mode():
        for ids in batches:
            loaded.model.get_decoder()(input_ids=ids, use_cache=False)


def forward_capture(loaded: Loaded, batches: list[torch.Tensor]) -> None:
    with torch.inference_mode(), capturing(loaded.model):
        for ids in batches:
            loaded.model.get_decoder()(input_ids=ids, use_cache=False)


def forward_eager(loaded: Loaded, batches: list[torch.Tensor]) -> None:
    loaded.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            for ids in batches:
                out = loaded.model(input_ids=ids, output_attentions=True)
                assert out.attentions is not None and len(out.attentions) == loaded.model.config.num_hidden_layers
    finally:
        loaded.model.set_attn_implementation("sdpa")


def one_rep(loaded: Loaded, args: argparse.Namespace, length: int, count: int,
            batches: list[torch.Tensor], store: str, rep: int) -> dict[str, Any]:
    """Every variant once, in an order rotated by ``rep``: (wall, cpu) seconds each."""
    loop: list[float] = []

    def run_extract() -> None:
        loop.append(extract_store(loaded, store, dataset=args.dataset, length=length, count=count,
                                  batch_size=args.batch_size).seconds)

    runs = {
        "extract": run_extract,
        "sdpa": lambda: forward_sdpa(loaded, batches),
        "capture": lambda: forward_capture(loaded, batches),
        "eager": lambda: forward_eager(loaded, batches),
    }
    out: dict[str, Any] = {}
    for name in rotate([v for v in VARIANTS if v in args.variants], rep):
        synchronize(loaded.device)
        w0, c0 = now()
        runs[name]()
        synchronize(loaded.device)
        w1, c1 = now()
        out[name], out[f"{name}_cpu"] = w1 - w0, c1 - c0
    out["loop"] = loop[0]
    shutil.rmtree(store)
    return out


def throughput(loaded: Loaded, args: argparse.Namespace, length: int, count: int, workdir: Path) -> dict[str, Any]:
    warm = str(workdir / f"{loaded.name}-L{length}-warm.zarr")
    # Warm-up (untimed): pages the weights in, builds kernels, imports codecs; its tokens are the batches.
    extract_store(loaded, warm, dataset=args.dataset, length=length, count=count, batch_size=args.batch_size)
    batches = batches_of(store_tokens(warm), args.batch_size, loaded.device)
    shutil.rmtree(warm)
    reps = []
    for rep in range(args.reps):
        load0 = os.getloadavg()[0]
        r = one_rep(loaded, args, length, count, batches, str(workdir / f"{loaded.name}-L{length}-{rep}.zarr"), rep)
        r["loadavg_1min"] = (load0 + os.getloadavg()[0]) / 2
        reps.append(r)
        print(f"  [{loaded.name} L={length} rep {rep + 1}/{args.reps}] "
              + " ".join(f"{k}={r[k]:.2f}s" for k in VARIANTS if k in r) + f" load={r['loadavg_1min']:.1f}",
              file=sys.stderr, flush=True)

    def ratio(key: str, ref: str = "sdpa") -> float:
        return median([r[key] / r[ref] for r in reps]) if key in reps[0] else float("nan")

    times = {k: [r[k] for r in reps] for k in reps[0] if k != "loadavg_1min"}
    med = {k: median(v) for k, v in times.items()}
    return {
        "model": loaded.name, "length": length, "sequences": count, "batch_size": args.batch_size,
        "times_s": times, "median_s": med,
        "median_ratio": {
            "extract": ratio("extract"), "loop": ratio("loop"), "capture": ratio("capture"),
            "eager": ratio("eager"), "extract_cpu": ratio("extract_cpu", "sdpa_cpu"),
            "capture_cpu": ratio("capture_cpu", "sdpa_cpu"), "eager_cpu": ratio("eager_cpu", "sdpa_cpu"),
        },
        "min_ratio": {k: min(times[k]) / min(times["sdpa"]) for k in ("extract", "capture", "eager") if k in times},
        "phases_s_per_seq": {
            "sdpa_forward": med["sdpa"] / count,
            "capture_overhead": median([r["capture"] - r["sdpa"] for r in reps]) / count,
            "writes_and_rest": median([r["extract"] - r["capture"] for r in reps]) / count,
            "extract": med["extract"] / count,
        },
        "loadavg_1min": [r["loadavg_1min"] for r in reps],
        "extract_tokens_per_s": count * length / med["extract"],
        "batches": batches,
    }


def torch_profile(loaded: Loaded, ids: torch.Tensor, top: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = loaded.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, torch.inference_mode(), capturing(loaded.model):
        loaded.model.get_decoder()(input_ids=ids, use_cache=False)
    return prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top)


def report(results: dict[str, Any]) -> str:
    thr = results["throughput"]
    out = [
        f"## extract() vs decoder-only SDPA forward ({results['device']}, {results['dtype']}, "
        f"{results['torch_threads']} torch threads, {results['cpu_count']} CPUs, {results['reps']} reps)\n",
        table(
            ["model", "L", "seqs", "SDPA fwd s", "capture fwd s", "extract() s", "loop s", "eager+attn s",
             "extract/SDPA [min/min]", "extract/SDPA CPU", "capture/SDPA", "eager+attn/SDPA", "eager/SDPA CPU",
             "extract tok/s", "load avg"],
            [[r["model"], r["length"], r["sequences"], r["median_s"]["sdpa"], r["median_s"].get("capture", float("nan")),
              r["median_s"]["extract"], r["median_s"]["loop"], r["median_s"].get("eager", float("nan")),
              f"{r['median_ratio']['extract']:.2f} [{r['min_ratio']['extract']:.2f}]",
              r["median_ratio"]["extract_cpu"], r["median_ratio"]["capture"], r["median_ratio"]["eager"],
              r["median_ratio"]["eager_cpu"], r["extract_tokens_per_s"],
              "/".join(f"{x:.1f}" for x in r["loadavg_1min"])] for r in thr],
        ),
        "\nTimes: medians over reps of whole-run seconds; ratios: medians of per-rep ratios, variants run one "
        "after the other in rotating order; [min/min] = ratio of the fastest reps. extract() = the whole call "
        "with the model given in memory (windows, store, loop, consolidation); loop = ExtractResult.seconds. "
        "CPU = process CPU seconds, less sensitive to other processes on the machine.\n",
        "## Where extract time goes (seconds per sequence, medians over reps)\n",
        table(
            ["model", "L", "SDPA fwd", "capture overhead (capture fwd - SDPA fwd)",
             "writes + rest (extract - capture fwd)", "extract"],
            [[r["model"], r["length"], *r["phases_s_per_seq"].values()] for r in thr],
        ),
    ]
    for p in results["profiles"]:
        out.append(f"\n## torch.profiler, one capturing forward: {p['model']} L={p['length']}\n")
        out.append("```\n" + p["table"] + "\n```")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", default="gemma3-270m,smollm2-135m", help="comma-separated model names")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--lengths", default="512,1024", help="comma-separated context lengths")
    p.add_argument("--num-sequences", default="4,2",
                   help="sequences per length: one number for all, or one per --lengths entry (default 4,2)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--references", default="sdpa,eager",
                   help="reference forwards beside extract (sdpa is required; eager, the slowest, may be left "
                   "out on a busy machine)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="add torch.profiler top operators of one capturing forward")
    p.add_argument("--workdir", default=None, help="folder for the temporary stores (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    args.lengths = int_list(args.lengths)
    counts = int_list(args.num_sequences)
    counts = counts * len(args.lengths) if len(counts) == 1 else counts
    if len(counts) != len(args.lengths):
        p.error("--num-sequences takes one number or one per --lengths entry")
    args.counts = counts
    refs = [r for r in args.references.split(",") if r]
    if "sdpa" not in refs or not set(refs) <= {"sdpa", "eager"}:
        p.error(f"--references takes sdpa and optionally eager, not {refs}")
    args.variants = ["extract", "capture", *refs]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "reps": args.reps, "dataset": args.dataset, "batch_size": args.batch_size, "torch": torch.__version__,
        "throughput": [], "profiles": [], "loads": {},
    }
    with tempfile.TemporaryDirectory(prefix="attngeom-bench-", dir=args.workdir) as tmp:
        for name in args.models.split(","):
            loaded = load(name, args.device, args.dtype)
            results.update(device=loaded.device, dtype=str(loaded.dtype).removeprefix("torch."))
            results["loads"][name] = loaded.load_s
            print(f"loaded {name} in {loaded.load_s:.1f}s", file=sys.stderr, flush=True)
            for length, count in zip(args.lengths, args.counts):
                bench = throughput(loaded, args, length, count, Path(tmp))
                batches = bench.pop("batches")
                results["throughput"].append(bench)
                if args.profile:
                    results["profiles"].append({"model": name, "length": length,
                                                "table": torch_profile(loaded, batches[0])})
            del loaded
    results["wall_s"] = time.perf_counter() - t_start
    print(report(results))
    print(f"\n(total benchmark wall time {results['wall_s']:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
