#!/usr/bin/env python
"""extract's store writer against the disk's pace, on one sequence of a paper shape (run by hand).

    python benchmarks/extract_writer.py                                  # Llama-2-7B, L = 1024, 5 reps
    python benchmarks/extract_writer.py --shapes Llama-2-7B,Mistral-7B --reps 3 --json writer.json

Needs no torch, so that it also runs in an environment with the newest zarr. One synthetic
sequence (``attngeom.extract.synthetic``) of the shape at full depth, as extract writes it: values
(layer, kv_head, pos, head_dim), the final query's attention row, the per-query summaries.
Per values encoding (``--values``):

* ``bfloat16``: a bfloat16 model's values stored at 2 bytes (their bit patterns, extract's
  default for a bfloat16 model);
* ``float32-of-bf16``: the same values stored as float32 (``--values-dtype float32`` with a
  bfloat16 model): half of every float is zero bits;
* ``float32``: a float32 model's values (full float32 mantissas).

Each repetition times, side by side in rotated order, into a fresh run each:

* "writer": ``SequenceWriter.write`` as extract runs it, the writer opened on the run
  beforehand (the chunks compressed on a thread per core, each written with its checksum as
  its compression ends, shards assembled and written by attngeom);
* "zarr": zarr-python writing the same arrays, all at once, with ``write_empty_chunks`` (its
  default codec pipeline, a shard's inner chunks encoded as one batch);
* "zarr fused": the same through zarr's ``FusedCodecPipeline`` on a thread per core, where the
  installed zarr has it (3.2 and later);
* "zarrs": the same through the ``zarrs`` codec pipeline (Rust), where installed;
* "compress": Blosc of every chunk of the sequence with the store's codecs, on a thread per
  core, nothing written;
* "fsync'd write": the very objects the writer stored, written to fresh files and fsync'd;
* "bare compress": Blosc of every chunk of the sequence with numcodecs' encoder
  (``numcodecs.Blosc.encode``, the settings of the array's ``zarr.json``) on a thread per
  core, nothing else (no checksum);
* "bare fsync'd write": those compressed bytes, an object's chunks one after another, written
  to fresh files (one vectored write each) and fsync'd.

A variant that stores other objects than the writer (a chunk all fill value left out breaks
the commit rule) is named and not timed. The limit is max(compress, fsync'd write), the bare
limit max(bare compress, bare fsync'd write): the writer cannot be faster than either. Ratios
are medians of per-repetition ratios; "stored MiB" the size of the sequence's objects. "CPU: X
/ work" is X's process CPU time over that of compress plus the fsync'd write, the work any
writer does, "CPU: X / bare work" over bare compress plus the bare fsync'd write: steadier
than wall time on a machine doing other work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from numcodecs import Blosc
from common import median, now, rotate, table, timed

from attngeom.store import RunLayout, SequenceWriter, create_run, open_or_create_root, open_run_group
from attngeom.store.objects.codecs import object_chunks
from attngeom.extract.synthetic import synthetic_sequence

# (layers, heads, kv heads, head dim) of the paper's models.
SHAPES = {
    "Llama-2-7B": (32, 32, 32, 128),
    "Llama-3.2-1B": (16, 32, 8, 64),
    "Mistral-7B": (32, 32, 8, 128),
    "Gemma-2B": (18, 8, 1, 256),
    "Gemma-7B": (28, 16, 16, 256),
}
VALUES = ("bfloat16", "float32-of-bf16", "float32")
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"
SHUFFLES = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
IOV_MAX = os.sysconf("SC_IOV_MAX")
ZARRS = "zarrs.ZarrsCodecPipeline"


def bfloat16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def sequence(name: str, length: int, values: str) -> tuple[RunLayout, dict[str, np.ndarray]]:
    """The layout and arrays of one synthetic sequence of shape ``name`` with ``values`` encoding."""
    layers, heads, kv_heads, head_dim = SHAPES[name]
    stored = {"bfloat16": "bfloat16", "float32-of-bf16": "float32", "float32": "float32"}[values]
    layout = RunLayout(
        n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, length=length,
        head_kv=tuple(h // (heads // kv_heads) for h in range(heads)), window=(0,) * layers,
        attendable=((True,) * length,) * layers, values_dtype=stored,
    )
    arrays = synthetic_sequence(np.random.default_rng(0), replace(layout, values_dtype="float32"))
    if values != "float32":
        arrays["values"] = bfloat16_rounded(arrays["values"])
    if stored == "bfloat16":
        arrays["values"] = (arrays["values"].view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return layout, arrays


def fresh_run(folder: Path, layout: RunLayout) -> zarr.Group:
    return create_run(open_or_create_root(str(folder)), "r", layout, {"model": {"id": "bench"}}, 1)


def zarr_write(run: zarr.Group, arrays: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    """Every array of the sequence written by zarr at once, then the commit flag."""
    with zarr.config.set({"array.write_empty_chunks": True, **config}):  # read when an array is opened
        reopened = open_run_group(zarr.open_group(run.store, mode="r+"), "r")
        members = {name: reopened[name].async_array for name in (*arrays, "complete")}

    async def write() -> None:
        await asyncio.gather(*(members[name].setitem(0, value) for name, value in arrays.items()))
        await members["complete"].setitem(0, 1)

    # A loop of its own: the benchmark needs no Store bound to zarr's loop (a local disk).
    asyncio.run(write())


@contextlib.contextmanager
def opened_writer(run: zarr.Group, arrays: dict[str, np.ndarray]) -> Iterator[Callable[[], None]]:
    """The write of the sequence by extract's writer, opened on ``run`` beforehand: extract
    opens it once per run, not per sequence."""
    with SequenceWriter(run, in_flight=0) as writer:
        yield lambda: writer.write(0, arrays)


def stored_objects(folder: Path) -> dict[Path, bytes]:
    """Every chunk object of the run, path relative to ``folder`` -> bytes."""
    root = folder / "runs" / "r"
    return {p.relative_to(folder): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "/c/" in p.as_posix() and not p.as_posix().startswith(f"{root}/complete/")}


def chunk_tasks(run: zarr.Group, arrays: dict[str, np.ndarray]) -> list[tuple[Any, np.ndarray]]:
    """(encoder, chunk) of every chunk of the sequence, with the store's codecs."""
    tasks = []
    for name, value in arrays.items():
        encode, chunks, _ = object_chunks(run[name].metadata.to_dict(), np.asarray(value)[None])
        tasks += [(encode, chunk) for chunk in chunks]
    return tasks


def bare_tasks(run: zarr.Group, arrays: dict[str, np.ndarray]) -> dict[str, list[tuple[Blosc, np.ndarray]]]:
    """Object name -> (numcodecs Blosc, chunk) of each of its chunks, in order: Blosc as the
    array's ``zarr.json`` sets it, without the store's encoder around it."""
    tasks = {}
    for name, value in arrays.items():
        metadata = run[name].metadata.to_dict()
        codecs = metadata["codecs"]
        if codecs[0]["name"] == "sharding_indexed":
            codecs = codecs[0]["configuration"]["codecs"]
        config = next(c["configuration"] for c in codecs if c["name"] == "blosc")
        blosc = Blosc(cname=config["cname"], clevel=config["clevel"], shuffle=SHUFFLES[config["shuffle"]],
                      blocksize=config["blocksize"], typesize=config["typesize"])
        _, chunks, _ = object_chunks(metadata, np.asarray(value)[None])
        tasks[name] = [(blosc, chunk) for chunk in chunks]
    return tasks


def bare_fsync_write(objects: dict[str, list[bytes]], folder: Path) -> None:
    """Each object's compressed chunks written one after another to a fresh file under
    ``folder`` with one vectored write, each file fsync'd."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, parts in objects.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            views, total = [memoryview(p) for p in parts], sum(len(p) for p in parts)
            while total:
                written = os.writev(fd, views[:IOV_MAX])
                total -= written
                while views and written >= len(views[0]):
                    written -= len(views.pop(0))
                if views:
                    views[0] = views[0][written:]
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_write(objects: dict[Path, bytes], folder: Path) -> None:
    """``objects`` written to fresh files under ``folder``, each fsync'd."""
    for rel, data in objects.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def has_zarrs() -> bool:
    try:
        import zarrs  # noqa: F401
    except ImportError:
        return False
    return True


def has_fused() -> bool:
    try:
        with zarr.config.set({"codec_pipeline.path": FUSED}):
            zarr.create_array(zarr.storage.MemoryStore(), shape=(1,), dtype="int8")
    except Exception:  # noqa: BLE001 - any zarr without the pipeline
        return False
    return True


def writer_times(name: str, length: int, values: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    layout, arrays = sequence(name, length, values)
    raw = sum(a.nbytes for a in arrays.values())
    cores = len(os.sched_getaffinity(0))
    layers = layout.n_layers
    def through_zarr(config: dict[str, Any]) -> Any:
        return lambda run: contextlib.nullcontext(lambda: zarr_write(run, arrays, config))

    variants: dict[str, Any] = {
        "writer": lambda run: opened_writer(run, arrays),
        "zarr": through_zarr({"codec_pipeline.batch_size": layers}),
    }
    if has_fused() and not args.no_fused:
        variants["zarr_fused"] = through_zarr({"codec_pipeline.path": FUSED, "codec_pipeline.max_workers": cores})
    if has_zarrs() and not args.no_zarrs:
        variants["zarrs"] = through_zarr({"codec_pipeline.path": ZARRS})

    def written(variant: str) -> tuple[float, float, dict[Path, bytes]]:
        folder = work / f"{variant}.zarr"
        run = fresh_run(folder, layout)
        with variants[variant](run) as write:
            w0, c0 = now()
            write()
            w1, c1 = now()
        objects = stored_objects(folder)
        shutil.rmtree(folder)
        return w1 - w0, c1 - c0, objects

    reference = written("writer")[2]
    differ = {}
    for variant in list(variants):
        objects = written(variant)[2]
        if objects != reference:  # e.g. a chunk all fill value left out: no commit rule then
            missing = sorted(str(k) for k in reference.keys() - objects.keys())
            differ[variant] = f"{len(missing)} objects missing ({', '.join(missing[:2])})" if missing else "other bytes"
            print(f"  {variant} stores other objects than the writer: {differ[variant]}; not timed",
                  file=sys.stderr, flush=True)
            del variants[variant]
    tasks_run = fresh_run(work / "codecs.zarr", layout)
    tasks = chunk_tasks(tasks_run, arrays)
    bare = bare_tasks(tasks_run, arrays)
    pool = ThreadPoolExecutor(cores)
    bare_objects = {name: list(pool.map(lambda task: task[0].encode(task[1]), bare[name])) for name in bare}
    reps = []
    for rep in range(args.reps):
        out: dict[str, float] = {}
        for variant in rotate([*variants, "compress", "fsync", "bare_compress", "bare_fsync"], rep):
            if variant == "compress":
                out["compress"], out["compress_cpu"] = timed(lambda: list(pool.map(lambda task: task[0](task[1]), tasks)))
            elif variant == "bare_compress":
                flat = [task for name in bare for task in bare[name]]
                out["bare_compress"], out["bare_compress_cpu"] = timed(
                    lambda: list(pool.map(lambda task: task[0].encode(task[1]), flat)))
            elif variant == "bare_fsync":
                out["bare_fsync"], out["bare_fsync_cpu"] = timed(lambda: bare_fsync_write(bare_objects, work / "bare"))
                shutil.rmtree(work / "bare")
            elif variant == "fsync":
                out["fsync"], out["fsync_cpu"] = timed(lambda: fsync_write(reference, work / "plain"))
                shutil.rmtree(work / "plain")
            else:
                out[variant], cpu, _ = written(variant)
                out[f"{variant}_cpu"] = cpu
        out["limit"] = max(out["compress"], out["fsync"])
        out["bare_limit"] = max(out["bare_compress"], out["bare_fsync"])
        out["loadavg_1min"] = os.getloadavg()[0]
        reps.append(out)
        print(f"  [{name} {values} rep {rep + 1}/{args.reps}] "
              + " ".join(f"{k}={out[k]:.3f}s" for k in (*variants, "compress", "fsync", "bare_compress", "bare_fsync")),
              file=sys.stderr, flush=True)
    pool.shutdown()
    shutil.rmtree(work / "codecs.zarr")
    result: dict[str, Any] = {
        "shape": name, "length": length, "values": values, "raw_mb": raw / 1e6,
        "stored_mib": sum(len(b) for b in reference.values()) / 2**20,
        "compress_s": median([r["compress"] for r in reps]), "fsync_s": median([r["fsync"] for r in reps]),
        "bare_compress_s": median([r["bare_compress"] for r in reps]),
        "bare_fsync_s": median([r["bare_fsync"] for r in reps]), "differ": differ, "reps": reps,
    }
    for variant in variants:
        result[f"{variant}_s"] = median([r[variant] for r in reps])
        result[f"{variant}_over_limit"] = median([r[variant] / r["limit"] for r in reps])
        result[f"{variant}_over_bare_limit"] = median([r[variant] / r["bare_limit"] for r in reps])
        result[f"{variant}_cpu_s"] = median([r[f"{variant}_cpu"] for r in reps])
        result[f"{variant}_cpu_over_work"] = median([r[f"{variant}_cpu"] / (r["compress_cpu"] + r["fsync_cpu"])
                                                     for r in reps])
        result[f"{variant}_cpu_over_bare_work"] = median(
            [r[f"{variant}_cpu"] / (r["bare_compress_cpu"] + r["bare_fsync_cpu"]) for r in reps])
    return result


def report(results: dict[str, Any]) -> str:
    rows = results["writer"]
    fused = any("zarr_fused_s" in r for r in rows)
    zarrs = any("zarrs_s" in r for r in rows)
    notes = "".join(f"\n{variant} ({r['values']}): stores other objects than the writer: {why}; not timed"
                    for r in rows for variant, why in r["differ"].items())
    head = (f"## The writer against its limit (zarr {results['zarr']}, Python {results['python']}, "
            f"{results['cpu_count']} CPUs, {results['reps']} reps; medians)\n")
    return head + table(
        ["shape", "L", "values", "raw MB", "stored MiB", "bare compress s", "bare fsync'd write s", "compress s",
         "fsync'd write s", "writer s", "writer / bare limit", "writer / limit", "zarr / limit",
         *(["zarr fused / limit"] if fused else []), *(["zarrs / limit"] if zarrs else []), "writer CPU s",
         "CPU: writer / bare work", "CPU: writer / work", "CPU: zarr / work"],
        [[r["shape"], r["length"], r["values"], r["raw_mb"], r["stored_mib"], r["bare_compress_s"],
          r["bare_fsync_s"], r["compress_s"], r["fsync_s"], r["writer_s"], r["writer_over_bare_limit"],
          r["writer_over_limit"], r["zarr_over_limit"],
          *([r.get("zarr_fused_over_limit", "")] if fused else []),
          *([r.get("zarrs_over_limit", "")] if zarrs else []), r["writer_cpu_s"],
          r["writer_cpu_over_bare_work"], r["writer_cpu_over_work"], r["zarr_cpu_over_work"]] for r in rows],
    ) + notes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", default="Llama-2-7B", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--lengths", default="1024", help="comma-separated context lengths")
    p.add_argument("--values", default=",".join(VALUES), help=f"comma-separated, of {', '.join(VALUES)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--no-fused", action="store_true", help="leave zarr's fused pipeline out")
    p.add_argument("--no-zarrs", action="store_true", help="leave the zarrs pipeline out even when installed")
    p.add_argument("--workdir", default=None, help="folder for the temporary stores (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    shapes, encodings = args.shapes.split(","), args.values.split(",")
    if set(shapes) - set(SHAPES) or set(encodings) - set(VALUES):
        p.error(f"shapes: {', '.join(SHAPES)}; values: {', '.join(VALUES)}")
    results: dict[str, Any] = {
        "zarr": zarr.__version__, "python": platform.python_version(), "cpu_count": len(os.sched_getaffinity(0)),
        "platform": platform.platform(), "reps": args.reps, "writer": [],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attngeom-writer-", dir=args.workdir) as tmp:
        for name in shapes:
            for length in (int(x) for x in args.lengths.split(",")):
                for values in encodings:
                    results["writer"].append(writer_times(name, length, values, args, Path(tmp)))
    results["wall_s"] = time.perf_counter() - t0
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
