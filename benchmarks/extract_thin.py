#!/usr/bin/env python
"""extract() against the plain forward on random-weight models with the paper's attention and a
thin MLP (run by hand).

    python benchmarks/extract_thin.py            # 32/32/128 at L=1024, 32/8/128 at L=4096, hidden H x Dh and 256
    python benchmarks/extract_thin.py --shapes 32/32/128@1024:256 --reps 5 --threads 1

Each shape H/KV/Dh@L[:D] is a Llama model whose MLP is ``--mlp`` wide, so that attention takes
the share of the forward it takes on a GPU, where the MLP is cheap; a few layers (``--layers``)
keep it within this CPU's reach. Its hidden size is D, by default H x Dh (the projections are the
paper model's); at D = 256 the projections are small too and attention is nearly all of the
forward, so that the ratios are the capture's against SDPA's.
Random weights (seeded) and random token ids behind BOS: timing only. Per repetition, side by
side in rotating order over the same sequences, after an untimed warm-up of each:

* "SDPA fwd": ``model.get_decoder()(input_ids=ids, use_cache=False)`` with stock SDPA attention;
* "capture fwd": the same forward inside ``capturing(model)`` (summaries kept, nothing written);
* "extract": ``ag.extract(model, token_ids=..., store=...)`` into a fresh store, writes included;
  "loop" is its ``ExtractResult.seconds``.

Ratios to the SDPA forward are taken within each repetition and reported as medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import busy, median, now, rotate, table
from transformers import LlamaConfig, LlamaForCausalLM

import attngeom as ag
from attngeom.extract.capture import capturing

VARIANTS = ("sdpa", "capture", "extract")
VOCAB = 1024


def thin_model(heads: int, kv_heads: int, head_dim: int, layers: int, mlp: int, hidden: int | None = None,
               seed: int = 0) -> Any:
    """A random-weight Llama causal LM, float32 on CPU, with SDPA attention; hidden size
    heads x head_dim unless given."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden or heads * head_dim, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=8192, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def token_ids(count: int, length: int, seed: int = 0) -> torch.Tensor:
    """(count, length) random ids with BOS (0) at position 0."""
    ids = torch.randint(2, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 0
    return ids


def parse_shape(shape: str) -> tuple[int, int, int, int, int | None]:
    """(query heads, kv heads, head dim, L, hidden size or None) of a shape written H/KV/Dh@L[:D]."""
    dims, rest = shape.split("@")
    length, _, hidden = rest.partition(":")
    heads, kv_heads, head_dim = (int(x) for x in dims.split("/"))
    return heads, kv_heads, head_dim, int(length), int(hidden) if hidden else None


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark over thin-model shapes."""
    p.add_argument("--shapes", default="32/32/128@1024,32/8/128@4096,32/32/128@1024:256,32/8/128@4096:256",
                   help="comma-separated H/KV/Dh@L[:D]: query heads, kv heads, head dim, context length, "
                        "hidden size (default H x Dh)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mlp", type=int, default=256, help="MLP width (intermediate size)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run N CPU-bound processes beside the benchmark (default 0)")
    p.add_argument("--workdir", default=None, help="folder for the temporary stores (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")


def run_shapes(args: argparse.Namespace, bench: Any, report: Any, prefix: str) -> dict[str, Any]:
    """bench(shape, args, workdir) of every shape of args, in a temporary folder; prints
    report(results) and writes them as JSON where asked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "reps": args.reps, "busy": args.busy,
                               "shapes": []}
    with tempfile.TemporaryDirectory(prefix=prefix, dir=args.workdir) as tmp, busy(args.busy):
        for shape in args.shapes.split(","):
            results["shapes"].append(bench(shape, args, Path(tmp)))
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def one_rep(model: Any, ids: torch.Tensor, store: str, rep: int) -> dict[str, float]:
    def forward(capture: bool) -> None:
        with torch.inference_mode(), capturing(model) if capture else contextlib.nullcontext():
            for seq in ids:
                model.get_decoder()(input_ids=seq[None], use_cache=False)

    loop: list[float] = []

    def extract() -> None:
        result = ag.extract(model, token_ids=ids, store=store, progress=False)
        assert result.written == len(ids), result
        loop.append(result.seconds)
        shutil.rmtree(store)

    runs = {"sdpa": lambda: forward(False), "capture": lambda: forward(True), "extract": extract}
    out: dict[str, float] = {}
    for name in rotate(list(VARIANTS), rep):
        w0, c0 = now()
        runs[name]()
        w1, c1 = now()
        out[name], out[f"{name}_cpu"] = w1 - w0, c1 - c0
    out["loop"] = loop[0]
    return out


def bench(shape: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    heads, kv_heads, head_dim, length, hidden = parse_shape(shape)
    model = thin_model(heads, kv_heads, head_dim, args.layers, args.mlp, hidden)
    ids = token_ids(args.num_sequences, length)
    store = str(workdir / f"thin-{heads}-{kv_heads}-{head_dim}-L{length}.zarr")
    one_rep(model, ids, store, 0)  # warm-up, untimed
    reps = []
    for rep in range(args.reps):
        r = one_rep(model, ids, store, rep)
        r["loadavg_1min"] = os.getloadavg()[0]
        reps.append(r)
        print(f"  [{shape} rep {rep + 1}/{args.reps}] " + " ".join(f"{k}={r[k]:.2f}s" for k in VARIANTS)
              + f" load={r['loadavg_1min']:.1f}", file=sys.stderr, flush=True)
    return {
        "shape": shape, "hidden": model.config.hidden_size, "layers": args.layers, "mlp": args.mlp,
        "sequences": args.num_sequences,
        "times_s": {k: [r[k] for r in reps] for k in reps[0]},
        "ratio": {k: median([r[k] / r["sdpa"] for r in reps]) for k in ("capture", "extract", "loop")},
        "ratio_cpu": {k: median([r[f"{k}_cpu"] / r["sdpa_cpu"] for r in reps]) for k in ("capture", "extract")},
        "min_ratio": {k: min(r[k] for r in reps) / min(r["sdpa"] for r in reps) for k in ("capture", "extract")},
    }


def report(results: dict[str, Any]) -> str:
    rows = [
        [r["shape"], r["hidden"], r["layers"], r["mlp"], r["sequences"], median(r["times_s"]["sdpa"]),
         f"{r['ratio']['capture']:.2f} [{r['min_ratio']['capture']:.2f}]",
         f"{r['ratio']['extract']:.2f} [{r['min_ratio']['extract']:.2f}]", r["ratio"]["loop"],
         r["ratio_cpu"]["capture"], r["ratio_cpu"]["extract"],
         "/".join(f"{x:.1f}" for x in r["times_s"]["loadavg_1min"])]
        for r in results["shapes"]
    ]
    return (
        f"## Thin-MLP random models, capture and extract against the SDPA forward "
        f"({results['torch_threads']} torch threads, {results['reps']} reps, {results['busy']} CPU-bound "
        f"processes beside)\n\n"
        + table(["H/KV/Dh@L", "hidden", "layers", "MLP", "seqs", "SDPA fwd s", "capture/SDPA [min/min]",
                 "extract/SDPA [min/min]", "loop/SDPA", "capture/SDPA CPU", "extract/SDPA CPU", "load avg"], rows)
        + "\n\nRatios: medians of per-rep ratios (wall; CPU = process CPU seconds, the steadier figure on a "
        "busy machine); [min/min] = fastest reps; loop = ExtractResult.seconds (the per-batch loop and "
        "consolidation: extract() less the model's provenance hash and the store's creation)."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_shape_args(p)
    p.add_argument("--num-sequences", type=int, default=1)
    return run_shapes(p.parse_args(argv), bench, report, "attngeom-thin-")


if __name__ == "__main__":
    main()
