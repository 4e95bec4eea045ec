#!/usr/bin/env python
"""Stored bytes of an extract store and Blosc levels on its real chunks (run by hand).

    python benchmarks/extract_store_size.py --json size.json                 # extracts 2 seqs per model at L=1024
    python benchmarks/extract_store_size.py --store real.zarr                # an existing store, no extract

Per store (one ``ag.extract`` per model and length with the model loaded beforehand, or
``--store``): stored bytes per sequence and the compression ratio of every run array
(``nbytes / nbytes_stored()``); then Blosc zstd + bitshuffle at several levels (``--levels``)
on the real inner chunks (one (sequence, layer) chunk each, as the store compresses them),
levels interleaved per repetition: ratio, compress and decompress time per sequence, and the
level a rule would choose (the smallest output whose compress time is at most ``--level-budget``
of extract's loop per sequence, measured by the extract that wrote the store).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import zarr
from common import add_store_args, bench_stores, int_list, median, open_run, rotate, table

from attngeom.store import n_sequences
from attngeom.store.objects.codecs import BLOSC_LEVEL

SUMMARIES = ("winner", "sink_attn", "diag_attn", "top1_attn", "entropy")
LEVEL_ARRAYS = ("values", "attn_last", *SUMMARIES)
SIZE_ARRAYS = ("values", "attn_last", *SUMMARIES, "tokens")


def store_sizes(store: str) -> dict[str, Any]:
    run = open_run(store)
    n_seq = n_sequences(run)
    per_array = {}
    for name, arr in run.arrays():
        stored = arr.nbytes_stored()
        per_array[name] = {"nbytes": arr.nbytes, "stored": stored, "ratio": arr.nbytes / stored}
    on_disk = sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())
    return {
        "sequences": n_seq,
        "run_bytes_per_seq": sum(a["stored"] for a in per_array.values()) / n_seq,
        "store_files_bytes_per_seq": on_disk / n_seq,
        "arrays": per_array,
    }


def inner_chunks(run: zarr.Group, name: str) -> list[np.ndarray]:
    data = run[name][:]
    return [np.ascontiguousarray(data[s, l]) for s in range(data.shape[0]) for l in range(data.shape[1])]


def compression_levels(store: str, levels: list[int], reps: int) -> dict[str, Any]:
    """Blosc zstd + bitshuffle per (sequence, layer) chunk, levels interleaved per repetition."""
    run = open_run(store)
    n_seq = n_sequences(run)
    chunks = {name: inner_chunks(run, name) for name in LEVEL_ARRAYS}
    codecs = {c: numcodecs.Blosc(cname="zstd", clevel=c, shuffle=numcodecs.Blosc.BITSHUFFLE) for c in levels}
    enc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    dec: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, dict[int, int]] = defaultdict(dict)
    for rep in range(reps):
        for c in rotate(levels, rep):
            codec = codecs[c]
            for name, parts in chunks.items():
                t0 = time.perf_counter()
                encoded = [codec.encode(p) for p in parts]
                enc[name][c].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for e in encoded:
                    codec.decode(e)
                dec[name][c].append(time.perf_counter() - t0)
                sizes[name][c] = sum(len(e) for e in encoded)
    raw = {name: sum(p.nbytes for p in parts) for name, parts in chunks.items()}
    out: dict[str, Any] = {"sequences": n_seq, "levels": levels, "arrays": {}}
    for name in list(LEVEL_ARRAYS) + ["total"]:
        names = LEVEL_ARRAYS if name == "total" else (name,)
        r = sum(raw[n] for n in names)
        out["arrays"][name] = {
            "raw_bytes": r,
            "ratio": {c: r / sum(sizes[n][c] for n in names) for c in levels},
            "compressed_bytes": {c: sum(sizes[n][c] for n in names) for c in levels},
            "compress_s_per_seq": {c: sum(median(enc[n][c]) for n in names) / n_seq for c in levels},
            "decompress_s_per_seq": {c: sum(median(dec[n][c]) for n in names) / n_seq for c in levels},
        }
    return out


def choose_level(levels_result: dict[str, Any], loop_s_per_seq: float, budget: float) -> str:
    """The level with the smallest output among those whose compression costs at most
    ``budget`` of the extract loop's time per sequence (single-threaded Blosc, where it runs)."""
    if loop_s_per_seq != loop_s_per_seq:
        return "none (no extract loop time for a --store store)"
    total = levels_result["arrays"]["total"]
    levels = levels_result["levels"]
    size, enc, dec = total["compressed_bytes"], total["compress_s_per_seq"], total["decompress_s_per_seq"]
    affordable = [c for c in levels if enc[c] <= budget * loop_s_per_seq] or [min(levels, key=enc.get)]
    pick = min(affordable, key=lambda c: (size[c], enc[c]))
    smallest = min(levels, key=size.get)
    lines = [
        f"clevel {pick} (rule: smallest output whose compress time is <= {budget:.0%} of the extract loop "
        f"per sequence, {loop_s_per_seq:.2f} s here)."
    ]
    for c in levels:
        lines.append(
            f"  c{c}: {size[c] / size[smallest] - 1:+.1%} bytes vs c{smallest}, compress "
            f"{enc[c] * 1e3:.0f} ms/seq ({enc[c] / loop_s_per_seq:.1%} of the loop), decompress {dec[c] * 1e3:.0f} ms/seq"
        )
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    out = [f"## Store size (run group, nbytes / nbytes_stored per array; store level c{BLOSC_LEVEL})\n"]
    out.append(table(
        ["model", "L", "MB/seq", *[f"{a} ratio" for a in SIZE_ARRAYS]],
        [[s["model"], s["length"], s["run_bytes_per_seq"] / 1e6,
          *[s["arrays"][a]["ratio"] for a in SIZE_ARRAYS]] for s in results["store"]],
    ))
    out.append("")
    out.append(table(
        ["model", "L", *[f"{a} MB/seq" for a in SIZE_ARRAYS]],
        [[s["model"], s["length"], *[s["arrays"][a]["stored"] / s["sequences"] / 1e6 for a in SIZE_ARRAYS]]
         for s in results["store"]],
    ))
    for lv in results["levels"]:
        levels = lv["levels"]
        out.append(
            f"\n## Blosc zstd + bitshuffle levels: {lv['model']} L={lv['length']}, {lv['sequences']} seqs, "
            "per (seq, layer) chunk; ratio = raw/compressed, ms = compress time per sequence\n"
        )
        out.append(table(
            ["array", "raw MB/seq", *[f"ratio c{c}" for c in levels], *[f"ms c{c}" for c in levels],
             *[f"dec ms c{c}" for c in levels]],
            [[name, a["raw_bytes"] / lv["sequences"] / 1e6, *[a["ratio"][c] for c in levels],
              *[a["compress_s_per_seq"][c] * 1e3 for c in levels],
              *[a["decompress_s_per_seq"][c] * 1e3 for c in levels]]
             for name, a in lv["arrays"].items()],
        ))
        out.append(f"\nwould choose {lv['choice']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_store_args(p)
    p.add_argument("--levels", default="1,3,5,9", help="Blosc zstd levels to compare")
    p.add_argument("--level-reps", type=int, default=3)
    p.add_argument("--level-budget", type=float, default=0.05,
                   help="largest compress time, as a fraction of the extract loop per sequence, a chosen level may cost")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"store": [], "levels": [], "blosc_level_in_store": BLOSC_LEVEL}
    with tempfile.TemporaryDirectory(prefix="attngeom-bench-", dir=args.workdir) as tmp:
        for model, length, store, loop_per_seq in bench_stores(args, tmp):
            tag = {"model": model, "length": length}
            results["store"].append({**tag, **store_sizes(store)})
            lv = compression_levels(store, int_list(args.levels), args.level_reps)
            results["levels"].append({**tag, **lv, "choice": choose_level(lv, loop_per_seq, args.level_budget)})
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
