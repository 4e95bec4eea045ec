#!/usr/bin/env python
"""extract at the paper's model shapes, on random weights (run by hand).

    python benchmarks/extract_paper_shapes.py --layers 2 --lengths 1024 --num-sequences 2 --mlp thin
    python benchmarks/extract_paper_shapes.py --device cuda --dtype bfloat16 --num-sequences 8 --json h100.json

Models are built from transformers configs with the attention geometry of the paper's five
models (``SHAPES``) and random weights, ``--mlp full`` (the real intermediate size) or ``thin``
(64, so attention dominates the forward as it does on a GPU); ``--layers`` keeps the first N
layers for CPU runs. The vocabulary is 32,000 for all: only the embedding lookup sees it.
Inputs are random token ids with BOS at position 0, the same for every variant.

Per shape and length, each repetition times side by side in rotated order, after one untimed
warm-up extract:

* "SDPA fwd": ``model.get_decoder()(input_ids=ids, use_cache=False)``, stock SDPA.
* "capture fwd": the same forward inside ``capturing(model)`` (nothing written).
* "extract loop": ``ag.extract(model, token_ids=...)`` into a fresh store, its ``ExtractResult.seconds``
  (the per-batch loop and the writes beside it);
* "fsync'd write": the objects of the warm-up extract's store written to fresh files, each
  fsync'd: with the forward, the limit of the extract loop, "extract loop / max(SDPA, fsync'd write)".

With ``--analyze``, one more extract of the same ids writes a store that ``ag.analyze`` then
reads, in a fresh interpreter per repetition (a user's ``attngeom analyze``: default scheduler,
a worker process per core), alternating with reading analyze's inputs in this process:
analyze s/seq, analyze / that extract's loop, analyze / read, and busy (CPU seconds of analyze
and its workers over wall x cores). numba's cache is warmed first on a small synthetic store.

The store writer alone, against the disk's pace: benchmarks/extract_writer.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from common import analyze_in_child, int_list, median, now, read_inputs, rotate, synchronize, table
from extract_writer import fsync_write, stored_objects

import attngeom as ag
from attngeom.extract.capture import capturing
from attngeom.extract.synthetic import write_synthetic_run

VOCAB = 32_000
THIN_MLP = 64


@dataclass(frozen=True)
class Shape:
    """The attention geometry of one paper model and the config that builds it."""

    family: str  # transformers model_type
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


SHAPES = {
    "Llama-2-7B": Shape("llama", 32, 32, 32, 128, 4096, 11008),
    "Llama-3.2-1B": Shape("llama", 16, 32, 8, 64, 2048, 8192),
    "Mistral-7B": Shape("mistral", 32, 32, 8, 128, 4096, 14336),
    "Gemma-2B": Shape("gemma", 18, 8, 1, 256, 2048, 16384),
    "Gemma-7B": Shape("gemma", 28, 16, 16, 256, 3072, 24576),
}

def build_model(shape: Shape, *, layers: int | None, mlp: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM of ``shape`` with random weights (seeded), eval mode, stock SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        shape.family,
        num_hidden_layers=layers or shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        hidden_size=shape.hidden,
        intermediate_size=THIN_MLP if mlp == "thin" else shape.intermediate,
        vocab_size=VOCAB,
        bos_token_id=1,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):  # weights drawn where they live, not drawn on the CPU and copied
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def token_ids(count: int, length: int, seed: int = 0) -> np.ndarray:
    """(count, length) random ids of the vocabulary, BOS (1) first."""
    ids = np.random.default_rng(seed).integers(2, VOCAB, size=(count, length), dtype=np.int64)
    ids[:, 0] = 1
    return ids


@contextlib.contextmanager
def matmul_precision(dtype: str) -> Iterator[None]:
    """float32 matmuls in TF32 within the block for ``float32-tf32``, as extract's forward has them."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "float32-tf32" else before)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def forward(model: torch.nn.Module, ids: np.ndarray, batch_size: int, device: str, *, capture: bool,
            dtype: str) -> None:
    """The decoder over ``ids`` batch by batch, inside ``capturing`` when ``capture``."""
    with (torch.inference_mode(), matmul_precision(dtype),
          capturing(model) if capture else contextlib.nullcontext()):
        for b0 in range(0, len(ids), batch_size):
            model.get_decoder()(input_ids=torch.from_numpy(ids[b0 : b0 + batch_size]).to(device), use_cache=False)


def extract_loop(model: torch.nn.Module, ids: np.ndarray, store: str, batch_size: int, dtype: str) -> float:
    """``ag.extract`` of ``ids`` (compute ``dtype``) into a fresh ``store``; the seconds of its loop."""
    result = ag.extract(model, token_ids=ids, store=store, run_id="r", batch_size=batch_size, progress=False,
                        dtype=dtype)
    assert result.written == len(ids), result
    return result.seconds


def store_mib_per_sequence(store: str, count: int) -> float:
    """MiB of the run's per-sequence objects, per sequence."""
    root = Path(store, "runs", "r")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "/c/" in p.as_posix()) / count / 2**20


def model_times(name: str, args: argparse.Namespace, length: int, count: int, workdir: Path) -> dict[str, Any]:
    """SDPA fwd, capture fwd and extract loop of one shape and length, per repetition."""
    shape = SHAPES[name]
    dtype = getattr(torch, args.dtype.removesuffix("-tf32"))
    model = build_model(shape, layers=args.layers, mlp=args.mlp, device=args.device, dtype=dtype)
    ids = token_ids(count, length)
    store = str(workdir / f"{name}-L{length}.zarr")
    extract_loop(model, ids, store, args.batch_size, args.dtype)  # warm-up: kernels, codecs, page cache
    mib = store_mib_per_sequence(store, count)
    objects = stored_objects(Path(store))
    shutil.rmtree(store)
    out: dict[str, float] = {}

    def fsync_written() -> None:
        fsync_write(objects, workdir / "plain")
        shutil.rmtree(workdir / "plain")

    runs = {
        "sdpa": lambda: forward(model, ids, args.batch_size, args.device, capture=False, dtype=args.dtype),
        "capture": lambda: forward(model, ids, args.batch_size, args.device, capture=True, dtype=args.dtype),
        "extract": lambda: out.update(loop=extract_loop(model, ids, store, args.batch_size, args.dtype)),
        "fsync": fsync_written,
    }
    reps = []
    for rep in range(args.reps):
        out = {}
        for variant in rotate(list(runs), rep):
            synchronize(args.device)
            w0, _ = now()
            runs[variant]()
            synchronize(args.device)
            out[variant] = now()[0] - w0
        out["loadavg_1min"] = os.getloadavg()[0]
        shutil.rmtree(store)
        reps.append(out)
        print(f"  [{name} L={length} rep {rep + 1}/{args.reps}] "
              + " ".join(f"{k}={out[k]:.2f}s" for k in ("sdpa", "capture", "loop", "fsync")), file=sys.stderr, flush=True)
    analyzed = analyze_times(model, ids, store, args) if args.analyze else {}
    return {
        **analyzed,
        "shape": name, "layers": args.layers or shape.layers, "mlp": args.mlp, "length": length, "sequences": count,
        "sdpa_ms_per_seq": median([r["sdpa"] for r in reps]) / count * 1e3,
        "capture_over_sdpa": median([r["capture"] / r["sdpa"] for r in reps]),
        "loop_over_sdpa": median([r["loop"] / r["sdpa"] for r in reps]),
        "fsync_ms_per_seq": median([r["fsync"] for r in reps]) / count * 1e3,
        "loop_over_limit": median([r["loop"] / max(r["sdpa"], r["fsync"]) for r in reps]),
        "store_mib_per_seq": mib,
        "reps": reps,
    }


def analyze_times(model: torch.nn.Module, ids: np.ndarray, store: str, args: argparse.Namespace) -> dict[str, Any]:
    """``ag.analyze`` of one more extract's store, in a fresh interpreter per repetition (default
    scheduler: a worker process per core), against that extract's loop and against reading its
    inputs in this process, alternating."""
    loop = extract_loop(model, ids, store, args.batch_size, args.dtype)
    count = len(ids)
    cores = len(os.sched_getaffinity(0))
    reps = []
    for rep in range(args.reps):
        out = {}
        for variant in rotate(["analyze", "read"], rep):
            if variant == "read":
                w0, _ = now()
                read_inputs(store, "r")
                out["read"] = now()[0] - w0
            else:
                out["analyze"], cpu = analyze_in_child(store, "r")
                out["busy"] = cpu / (out["analyze"] * cores)
        reps.append(out)
        print(f"  [analyze rep {rep + 1}/{args.reps}] analyze={out['analyze']:.2f}s read={out['read']:.2f}s "
              f"busy={out['busy']:.2f}", file=sys.stderr, flush=True)
    shutil.rmtree(store)
    return {
        "analyze_s_per_seq": median([r["analyze"] for r in reps]) / count,
        "analyze_over_loop": median([r["analyze"] for r in reps]) / loop,
        "analyze_over_read": median([r["analyze"] / r["read"] for r in reps]),
        "busy": median([r["busy"] for r in reps]),
        "analyze_reps": reps,
    }


def report(results: dict[str, Any]) -> str:
    out = [(f"## extract at the paper's shapes ({results['device']}, {results['dtype']}, {results['torch_threads']} "
            f"torch threads, {results['cpu_count']} CPUs, {results['reps']} reps, batch {results['batch_size']})\n")]
    if results["models"]:
        out.append(table(
            ["shape", "layers", "MLP", "L", "seqs", "SDPA fwd ms/seq", "capture fwd / SDPA", "extract loop / SDPA",
             "fsync'd write ms/seq", "extract loop / max(SDPA, fsync'd write)", "store MiB/seq"],
            [[r["shape"], r["layers"], r["mlp"], r["length"], r["sequences"], r["sdpa_ms_per_seq"],
              r["capture_over_sdpa"], r["loop_over_sdpa"], r["fsync_ms_per_seq"], r["loop_over_limit"],
              r["store_mib_per_seq"]] for r in results["models"]],
        ))
    analyzed = [r for r in results["models"] if "analyze_s_per_seq" in r]
    if analyzed:
        out.append(f"\nanalyze of one more extract's store ({results['cpu_count']} CPUs, default scheduler, "
                   "a fresh interpreter per repetition; busy: CPU s / (wall s x cores)):\n")
        out.append(table(
            ["shape", "L", "seqs", "analyze s/seq", "analyze / extract loop", "analyze / read", "busy"],
            [[r["shape"], r["length"], r["sequences"], r["analyze_s_per_seq"], r["analyze_over_loop"],
              r["analyze_over_read"], r["busy"]] for r in analyzed],
        ))
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--mlp", choices=("full", "thin"), default="full")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--lengths", default="1024", help="comma-separated context lengths")
    p.add_argument("--num-sequences", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float32-tf32", "bfloat16", "float16"))
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--analyze", action="store_true",
                   help="also analyze one more extract's store: analyze s/seq, / extract loop, / read, busy")
    p.add_argument("--workdir", default=None, help="folder for the temporary stores (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    args.shapes = args.shapes.split(",")
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    args.lengths = int_list(args.lengths)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "device": args.device, "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "reps": args.reps,
        "batch_size": args.batch_size, "torch": torch.__version__, "zarr": zarr.__version__,
        "models": [],
    }
    with tempfile.TemporaryDirectory(prefix="attngeom-bench-", dir=args.workdir) as tmp:
        if args.analyze:
            warm = f"{tmp}/warm.zarr"
            write_synthetic_run(warm, "r", n_seq=2, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, length=64)
            analyze_in_child(warm, "r")  # numba's cache, so that no timed analyze compiles
            shutil.rmtree(warm)
        for name in args.shapes:
            for length in args.lengths:
                results["models"].append(model_times(name, args, length, args.num_sequences, Path(tmp)))
    results["wall_s"] = time.perf_counter() - t_start
    print(report(results))
    print(f"\n(total benchmark wall time {results['wall_s']:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
