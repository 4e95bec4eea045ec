#!/usr/bin/env python
"""How long ``attngeom migrate`` takes, against copying the store and reading it all (by hand).

    python benchmarks/migrate_throughput.py                  # 8 sequences of a Gemma-3-270m-shaped run, ~150 MB
    python benchmarks/migrate_throughput.py --num-sequences 32 --reps 3

A synthetic run (``attngeom.extract.synthetic``) is written, then re-encoded with zarr into format 1,
as attngeom 0.1.0 wrote it (every array rewritten with Blosc only, no chunk checksums; no
``format`` attribute). Each repetition then times, side
by side: a plain file copy of the store (``shutil.copytree``, the floor for touching every
byte), ``attngeom validate --deep`` of the copy (decoding every chunk), and ``migrate`` of
the copy (decode, re-encode with checksums into a temporary array, replace). Ratios are of
the same repetition: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import attngeom as ag
from attngeom.store import compressor, consolidate, open_root, open_run_group, validate_store
from attngeom.extract.synthetic import write_synthetic_run


def format1_store(path: Path, args: argparse.Namespace) -> None:
    """A synthetic run encoded as format 1: every array rewritten with Blosc alone (the chunk
    layout, dimension names and attributes kept), no format attribute."""
    write_synthetic_run(str(path), "r", n_seq=args.num_sequences, n_layers=args.layers, n_heads=args.heads,
                        n_kv_heads=args.kv_heads, head_dim=args.head_dim, length=args.length)
    root = open_root(str(path), mode="a")
    run = open_run_group(root, "r")
    for name, arr in list(run.arrays()):
        data, attrs = arr[:], dict(arr.attrs)
        typesize = arr.dtype.itemsize if arr.dtype.kind not in "OUS" else 1
        new = run.create_array(
            name, shape=arr.shape, dtype=arr.dtype, chunks=arr.chunks, shards=arr.shards,
            compressors=(compressor(typesize),), fill_value=arr.fill_value,
            dimension_names=arr.metadata.dimension_names, attributes=attrs, overwrite=True,
            config={"write_empty_chunks": True},  # as the stage writes: a chunk present marks it written
        )
        new[...] = data
    consolidate(root)
    meta = json.loads((path / "zarr.json").read_text())
    del meta["attributes"]["attngeom"]["format"]
    (path / "zarr.json").write_text(json.dumps(meta))


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        original = Path(tmp) / "format1.zarr"
        format1_store(original, args)
        size = size_of(original)
        rows = []
        for rep in range(args.reps):
            copy = Path(tmp) / f"copy{rep}.zarr"
            t0 = time.perf_counter()
            shutil.copytree(original, copy)
            t_copy = time.perf_counter() - t0
            t0 = time.perf_counter()
            problems = validate_store(str(copy), deep=True)
            t_deep = time.perf_counter() - t0
            assert problems and all("checksum" in line for line in problems), problems[:3]
            t0 = time.perf_counter()
            report = ag.migrate(str(copy), progress=False)
            t_migrate = time.perf_counter() - t0
            assert validate_store(str(copy), deep=True) == []
            rows.append((t_copy, t_deep, t_migrate, report))
            shutil.rmtree(copy)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    report = rows[-1][3]
    mib = size / 2**20
    print(f"store: {args.num_sequences} sequences, L={args.length}, {args.layers} layers x {args.kv_heads} kv heads "
          f"x head_dim {args.head_dim}: {mib:.0f} MiB on disk, {report.arrays} arrays, {report.chunks} chunk objects\n")
    print("| rep | copy s | validate --deep s | migrate s | migrate/copy | migrate/deep | migrate MiB/s |")
    print("|---|---|---|---|---|---|---|")
    for i, (c, d, m, _) in enumerate(rows):
        print(f"| {i + 1} | {c:.2f} | {d:.2f} | {m:.2f} | {m / c:.1f} | {m / d:.1f} | {mib / m:.0f} |")
    ratios = np.array([[m / c, m / d] for c, d, m, _ in rows])
    print(f"\nmedian ratios: migrate/copy {med(list(ratios[:, 0])):.1f}, migrate/validate --deep {med(list(ratios[:, 1])):.1f}")


if __name__ == "__main__":
    main()
