#!/usr/bin/env python
"""Inner-chunk against whole-shard reads of an extract store (run by hand).

    python benchmarks/extract_chunk_reads.py --json reads.json      # extracts 2 seqs per model at L=1024
    python benchmarks/extract_chunk_reads.py --store real.zarr      # an existing store, no extract

Per store (one ``ag.extract`` per model and length with the model loaded beforehand, or
``--store``) and per array (values, attn_last), through zarr with the page cache warm: the time
to read one (sequence, layer) inner chunk, the whole sequence shard, every layer one by one, and
one layer of a copy of the array whose chunk is the whole sequence (no inner chunks); cases
rotate per repetition, medians reported, with the stored bytes per sequence of both layouts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import zarr
from common import add_store_args, bench_stores, median, open_run, rotate, table

from attngeom.store import compressor, n_sequences

READ_ARRAYS = ("values", "attn_last")


def chunk_reads(store: str, reps: int, workdir: Path) -> dict[str, Any]:
    """One (sequence, layer) inner chunk vs the whole sequence shard, and vs a layout whose
    chunk is the whole sequence (no inner chunks), read through zarr."""
    run = open_run(store)
    n_seq = n_sequences(run)
    out: dict[str, Any] = {}
    for name in READ_ARRAYS:
        arr = run[name]
        n_layers = arr.shape[1]
        alt_path = workdir / f"alt-{name}.zarr"
        alt = zarr.create_array(
            str(alt_path), shape=arr.shape, dtype=arr.dtype, chunks=(1, *arr.shape[1:]),
            compressors=compressor(arr.dtype.itemsize), fill_value=0,
        )
        alt[:] = arr[:]
        timings: dict[str, list[float]] = defaultdict(list)
        cases = {
            "inner_chunk": lambda s, l: arr[s, l],
            "whole_shard": lambda s, l: arr[s],
            "all_layers_one_by_one": lambda s, l: [arr[s, k] for k in range(n_layers)],
            "no_inner_chunks_one_layer": lambda s, l: alt[s, l],
        }
        for rep in range(reps):
            s, l = rep % n_seq, (rep * 7) % n_layers
            for case in rotate(list(cases), rep):
                t0 = time.perf_counter()
                cases[case](s, l)
                timings[case].append(time.perf_counter() - t0)
        out[name] = {
            **{k: median(v) for k, v in timings.items()},
            "n_layers": n_layers,
            "shard_stored_bytes_per_seq": arr.nbytes_stored() / n_seq,
            "no_inner_chunks_stored_bytes_per_seq": alt.nbytes_stored() / n_seq,
        }
        shutil.rmtree(alt_path)
    return out


def report(reads: list[dict[str, Any]]) -> str:
    return "## Chunk reads through zarr (median ms; page cache warm)\n\n" + table(
        ["model", "L", "array", "layers", "1 inner chunk", "whole shard", "shard/chunk",
         "all layers 1 by 1", "1 layer, no inner chunks", "stored MB/seq sharded", "stored MB/seq unsharded"],
        [[c["model"], c["length"], name, a["n_layers"], a["inner_chunk"] * 1e3, a["whole_shard"] * 1e3,
          a["whole_shard"] / a["inner_chunk"], a["all_layers_one_by_one"] * 1e3,
          a["no_inner_chunks_one_layer"] * 1e3, a["shard_stored_bytes_per_seq"] / 1e6,
          a["no_inner_chunks_stored_bytes_per_seq"] / 1e6]
         for c in reads for name, a in c["arrays"].items()],
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_store_args(p)
    p.add_argument("--read-reps", type=int, default=15)
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    reads = []
    with tempfile.TemporaryDirectory(prefix="attngeom-bench-", dir=args.workdir) as tmp:
        for model, length, store, _ in bench_stores(args, tmp):
            reads.append({"model": model, "length": length, "arrays": chunk_reads(store, args.read_reps, Path(tmp))})
    print(report(reads))
    if args.json:
        Path(args.json).write_text(json.dumps(reads, indent=2, default=str))
    return reads


if __name__ == "__main__":
    main()
