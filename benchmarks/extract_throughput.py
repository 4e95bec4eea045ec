#!/usr/bin/env python
"""Extract throughput, store size, compression level and chunk-read benchmark (run by hand).

    python benchmarks/extract_throughput.py                       # defaults: ~6-10 min on 2 idle CPU cores
    python benchmarks/extract_throughput.py --models smollm2-135m --lengths 512 --num-sequences 2
    python benchmarks/extract_throughput.py --json bench.json --profile
    python benchmarks/extract_throughput.py --references sdpa     # busy machine: no eager reference

What is measured, per model and context length L, on the first windows of the corpus:

* ``extract()``: the real stage (``attngeom.extract.pipeline.extract``) into a fresh temporary
  store each repetition, writes, store creation and metadata consolidation included. Model
  *load* is excluded: the model, its config and tokenizer are loaded once and handed to
  ``extract()`` by patching its loaders (``resolve_model``, ``load_config``, ``load_tokenizer``,
  ``load_model``). Two figures: "extract()" is the whole call (corpus tokenization and window
  selection, store creation, the per-batch loop, consolidation); "loop" is
  ``ExtractResult.seconds`` (per-batch forward + capture + writes + consolidation).
* "SDPA fwd": the reference, ``model.model(input_ids=ids, use_cache=False)`` of a stock
  ``attn_implementation="sdpa"`` model over the same batches: decoder only, no capture, no LM head.
* "eager+attn": the peers' way, the full model with its LM head, ``attn_implementation="eager"``
  and ``model(input_ids=ids, output_attentions=True)`` (attention maps left in memory, not saved).

The machine is assumed shared and noisy, so the variants are interleaved batch by batch, inside
the real call: a forward pre-hook on extract's decoder runs the SDPA and eager references (order
rotated) on the batch's ids just before extract's own forward, and their time is subtracted from
extract's. Each repetition (after one untimed warm-up) thus gives one ratio per batch and one
per run, taken seconds apart; tables give medians of those ratios, the ratio of the fastest runs,
and the same ratio in process CPU time, which other processes on the machine disturb less.
The same runs time the phases of extract (by wrapping ``attention_summaries``, the SDPA call
inside the capture, ``_sequence_arrays``, ``write_sequence``, ``create_run``, ``consolidate``),
so the breakdown says where extract's time goes with no extra pass.

Then, on the store the last repetition wrote: stored bytes per sequence and compression ratio
per array (``nbytes / nbytes_stored()``); Blosc zstd + bitshuffle at several levels on the real
inner chunks (one (sequence, layer) chunk each, as the store compresses them); and the time to
read one (sequence, layer) inner chunk of ``values`` and ``attn_last`` against the whole
sequence shard and against a layout without inner chunks. ``--profile`` adds torch.profiler's
top operators of one capturing forward.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numcodecs
import numpy as np
import torch
import zarr

from attngeom.extract import capture, pipeline
from attngeom.extract.capture import capturing
from attngeom.extract.corpora import Window, open_corpus, select_windows
from attngeom.extract.models import (
    _folder,
    load_config,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from attngeom.extract.pipeline import ExtractRequest, extract
from attngeom.store import (
    compressor,
    n_sequences,
    open_root,
    open_run_group,
    run_ids,
)
from attngeom.store.codecs import BLOSC_LEVEL

SUMMARIES = ("winner", "sink_attn", "diag_attn", "top1_attn", "entropy")
LEVEL_ARRAYS = ("values", "attn_last", *SUMMARIES)
SIZE_ARRAYS = ("values", "attn_last", *SUMMARIES, "tokens")
READ_ARRAYS = ("values", "attn_last")


# --------------------------------------------------------------------------- helpers


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            if x != x:
                return "n/a"
            return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
        return str(x)

    body = [[cell(x) for x in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# --------------------------------------------------------------------------- models


@dataclass
class Bundle:
    """One model loaded three ways, plus what extract() would load itself."""

    name: str
    source: Any
    config: Any
    tokenizer: Any
    bos_id: int
    capture_model: torch.nn.Module  # attn_implementation = attngeom_capture (what extract runs)
    sdpa_model: torch.nn.Module  # stock sdpa, decoder-only forward is the reference
    eager_model: torch.nn.Module  # stock eager, the peers' output_attentions=True way
    device: str
    dtype: torch.dtype
    load_s: float


def load_bundle(name: str, device: str, dtype: torch.dtype) -> Bundle:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    source = resolve_model(name)
    config = load_config(source)
    tokenizer = load_tokenizer(source)
    cap = load_model(source, device=device, dtype=dtype)
    folder = _folder(source)
    stock = {
        impl: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=impl).to(device).eval()
        for impl in ("sdpa", "eager")
    }
    load_s = time.perf_counter() - t0
    return Bundle(
        name, source, config, tokenizer, pipeline._bos_token_id(tokenizer, None), cap,
        stock["sdpa"], stock["eager"], device, dtype, load_s,
    )


@contextlib.contextmanager
def preloaded(bundle: Bundle) -> Iterator[None]:
    """Within the block, extract() gets the already loaded model instead of loading it."""
    with (
        mock.patch.object(pipeline, "resolve_model", lambda name: bundle.source),
        mock.patch.object(pipeline, "load_config", lambda source: bundle.config),
        mock.patch.object(pipeline, "load_tokenizer", lambda source: bundle.tokenizer),
        mock.patch.object(pipeline, "load_model", lambda source, device, dtype: bundle.capture_model),
    ):
        yield


def windows_for(bundle: Bundle, dataset: str, length: int, count: int) -> list[Window]:
    corpus = open_corpus(dataset)
    return select_windows(
        corpus, lambda t: bundle.tokenizer(t, add_special_tokens=False).input_ids, bundle.bos_id, length, count
    )


def batches_of(windows: list[Window], batch_size: int, device: str) -> list[torch.Tensor]:
    return [
        torch.from_numpy(np.stack([w.tokens for w in windows[i : i + batch_size]]).astype("int64")).to(device)
        for i in range(0, len(windows), batch_size)
    ]


# --------------------------------------------------------------------------- variants


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds; CPU time covers every thread of this process."""
    return time.perf_counter(), time.process_time()


def forward_sdpa(bundle: Bundle, ids: torch.Tensor) -> None:
    bundle.sdpa_model.model(input_ids=ids, use_cache=False)


def forward_eager(bundle: Bundle, ids: torch.Tensor) -> None:
    out = bundle.eager_model(input_ids=ids, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == bundle.config.num_hidden_layers


REFERENCES = {"sdpa": forward_sdpa, "eager": forward_eager}


class Probe:
    """Runs inside one real extract() call: before each batch's capturing forward it runs the
    reference forwards (SDPA decoder-only, eager + attentions) on the same ids, and it times
    the phases of the loop. The time spent in the references is subtracted from extract's."""

    def __init__(self, bundle: Bundle, rep: int, references: list[str]) -> None:
        self.bundle = bundle
        self.rep = rep
        self.references = references
        self.ref: dict[str, list[tuple[float, float]]] = defaultdict(list)  # per batch (wall, cpu)
        self.bounds: list[tuple[float, float, float, float]] = []  # (w0, c0, w1, c1) around the references
        self.phase: dict[str, float] = defaultdict(float)
        self.fwd_start = 0.0

    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"]
        synchronize(self.bundle.device)
        w0, c0 = now()
        with torch.inference_mode():
            for name in rotate(self.references, self.rep + len(self.bounds)):
                synchronize(self.bundle.device)
                a = now()
                REFERENCES[name](self.bundle, ids)
                synchronize(self.bundle.device)
                b = now()
                self.ref[name].append((b[0] - a[0], b[1] - a[1]))
        w1, c1 = now()
        self.bounds.append((w0, c0, w1, c1))
        self.fwd_start = w1

    def _post(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        synchronize(self.bundle.device)
        self.phase["capture_forward"] += time.perf_counter() - self.fwd_start

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            synchronize(self.bundle.device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            synchronize(self.bundle.device)
            self.phase[key] += time.perf_counter() - t0
            return out

        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        decoder = self.bundle.capture_model.model
        hooks = [
            decoder.register_forward_pre_hook(self._pre, with_kwargs=True),
            decoder.register_forward_hook(self._post, with_kwargs=True),
        ]
        patches = [
            (capture, "attention_summaries", "summaries"),
            (capture, "sdpa_attention_forward", "sdpa_in_capture"),
            (pipeline, "_sequence_arrays", "host_arrays"),
            (pipeline, "write_sequence", "zarr_writes"),
            (pipeline, "create_run", "create_run"),
            (pipeline, "consolidate", "consolidate"),
        ]
        try:
            with contextlib.ExitStack() as stack:
                for module, attr, key in patches:
                    stack.enter_context(mock.patch.object(module, attr, self._timed(key, getattr(module, attr))))
                yield
        finally:
            for h in hooks:
                h.remove()

    def segments(self, start: tuple[float, float], end: tuple[float, float]) -> list[tuple[float, float]]:
        """Extract's own (wall, cpu) time per batch: from the end of its references to the start
        of the next batch's references (the last one runs to the end of extract())."""
        ends = [(b[0], b[1]) for b in self.bounds[1:]] + [end]
        return [(e[0] - b[2], e[1] - b[3]) for b, e in zip(self.bounds, ends)]


def extract_request(bundle: Bundle, args: argparse.Namespace, length: int, count: int, store: str) -> ExtractRequest:
    """The extract() call every timed run makes: ``count`` sequences of length ``length`` into ``store``."""
    return ExtractRequest(
        model=bundle.name, dataset=args.dataset, context_length=length, num_sequences=count, store=store,
        device=bundle.device, dtype=args.dtype, batch_size=args.batch_size, progress=False,
        command_line=["benchmarks/extract_throughput.py"],
    )


def run_extract(
    bundle: Bundle, args: argparse.Namespace, length: int, count: int, store: str, rep: int = 0
) -> dict[str, Any]:
    request = extract_request(bundle, args, length, count, store)
    probe = Probe(bundle, rep, args.references)
    with preloaded(bundle), probe.installed():
        synchronize(bundle.device)
        start = now()
        result = extract(request)
        synchronize(bundle.device)
        end = now()
    assert result.written == count, result
    excluded_w = sum(b[2] - b[0] for b in probe.bounds)
    excluded_c = sum(b[3] - b[1] for b in probe.bounds)
    segments = probe.segments(start, end)
    return {
        "extract": end[0] - start[0] - excluded_w,
        "extract_cpu": end[1] - start[1] - excluded_c,
        "loop": result.seconds - excluded_w,
        "setup": probe.bounds[0][0] - start[0],
        "sdpa": sum(w for w, _ in probe.ref["sdpa"]),
        "sdpa_cpu": sum(c for _, c in probe.ref["sdpa"]),
        "eager": sum(w for w, _ in probe.ref["eager"]) if probe.ref["eager"] else float("nan"),
        "eager_cpu": sum(c for _, c in probe.ref["eager"]) if probe.ref["eager"] else float("nan"),
        "batch_extract": segments,
        "batch_sdpa": probe.ref["sdpa"],
        "batch_eager": probe.ref["eager"],
        "phases": dict(probe.phase),
    }


def run_alone(
    bundle: Bundle, args: argparse.Namespace, length: int, count: int, batches: list[torch.Tensor], store: str, rep: int
) -> dict[str, float]:
    """Whole runs, nothing hooked in: extract() into ``store`` and the SDPA forward over the
    same batches, one after the other (order alternating by rep): the plain figure a user
    sees, with no reference forward or timing wrapper inside extract()."""
    request = extract_request(bundle, args, length, count, store)

    def extract_run() -> float:
        with preloaded(bundle):
            synchronize(bundle.device)
            t0 = time.perf_counter()
            extract(request)
            synchronize(bundle.device)
            return time.perf_counter() - t0

    def sdpa_run() -> float:
        synchronize(bundle.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for ids in batches:
                forward_sdpa(bundle, ids)
        synchronize(bundle.device)
        return time.perf_counter() - t0

    runs = {"extract": extract_run, "sdpa": sdpa_run}
    out = {name: runs[name]() for name in rotate(list(runs), rep)}
    shutil.rmtree(store)
    return out


def throughput(bundle: Bundle, args: argparse.Namespace, length: int, count: int, workdir: Path) -> dict[str, Any]:
    """Repetitions of extract() with the references interleaved batch by batch."""
    windows = windows_for(bundle, args.dataset, length, count)
    batches = batches_of(windows, args.batch_size, bundle.device)
    stores = (str(workdir / f"{bundle.name}-L{length}-{i}.zarr") for i in itertools.count())

    # Warm-up (untimed): pages the weights in, builds kernels, imports zarr codecs.
    warm = next(stores)
    run_extract(bundle, args, length, 1, warm)
    shutil.rmtree(warm)

    reps: list[dict[str, Any]] = []
    last_store = None
    for rep in range(args.reps):
        store = next(stores)
        load0 = os.getloadavg()[0]
        r = run_extract(bundle, args, length, count, store, rep)
        r["alone"] = run_alone(bundle, args, length, count, batches, next(stores), rep)
        r["loadavg_1min"] = (load0 + os.getloadavg()[0]) / 2
        reps.append(r)
        if last_store is not None:
            shutil.rmtree(last_store)
        last_store = store
        print(
            f"  [{bundle.name} L={length} rep {rep + 1}/{args.reps}] extract={r['extract']:.2f}s "
            f"sdpa={r['sdpa']:.2f}s eager={r['eager']:.2f}s; alone extract={r['alone']['extract']:.2f}s "
            f"sdpa={r['alone']['sdpa']:.2f}s ({r['alone']['extract'] / r['alone']['sdpa']:.2f}x) "
            f"load={r['loadavg_1min']:.1f}",
            file=sys.stderr, flush=True,
        )

    def per_rep(key: str, ref: str = "sdpa") -> list[float]:
        return [r[key] / r[ref] for r in reps]

    def per_batch(key: str, cpu: bool = False) -> list[float]:
        i = 1 if cpu else 0
        return [e[i] / s[i] for r in reps for e, s in zip(r[f"batch_{key}"], r["batch_sdpa"])]

    times = {k: [r[k] for r in reps] for k in ("extract", "loop", "setup", "sdpa", "eager", "extract_cpu", "sdpa_cpu", "eager_cpu")}
    phases = {k: median([r["phases"].get(k, 0.0) for r in reps]) / count for k in reps[0]["phases"]}
    phases["sdpa_forward"] = median(times["sdpa"]) / count
    phases["setup_in_extract"] = median(times["setup"]) / count
    phases["extract"] = median(times["extract"]) / count
    return {
        "model": bundle.name,
        "length": length,
        "sequences": count,
        "batch_size": args.batch_size,
        "times_s": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "ratio_per_rep": {"extract": per_rep("extract"), "loop": per_rep("loop"), "eager": per_rep("eager")},
        "ratio_alone": [r["alone"]["extract"] / r["alone"]["sdpa"] for r in reps],
        "ratio_per_batch": {"extract": per_batch("extract"), "eager": per_batch("eager")},
        "ratio_per_batch_cpu": {"extract": per_batch("extract", True), "eager": per_batch("eager", True)},
        "median_ratio": {
            "extract": median(per_rep("extract")),
            "loop": median(per_rep("loop")),
            "eager": median(per_rep("eager")),
            "extract_per_batch": median(per_batch("extract")),
            "eager_per_batch": median(per_batch("eager")),
            "extract_cpu_per_batch": median(per_batch("extract", True)),
            "eager_cpu_per_batch": median(per_batch("eager", True)),
        },
        "min_ratio": {k: min(times[k]) / min(times["sdpa"]) for k in ("extract", "eager")},
        "alone_ratio": median([r["alone"]["extract"] / r["alone"]["sdpa"] for r in reps]),
        "phases_s_per_seq": phases,
        "loadavg_1min": [r["loadavg_1min"] for r in reps],
        "extract_tokens_per_s": count * length / median(times["extract"]),
        "store": last_store,
        "windows": windows,
        "batches": batches,
    }


def torch_profile(bundle: Bundle, ids: torch.Tensor, top: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bundle.device.startswith("cuda") else [])
    with profile(activities=activities) as prof, torch.inference_mode(), capturing(bundle.capture_model):
        bundle.capture_model.model(input_ids=ids, use_cache=False)
    sort = "self_cuda_time_total" if bundle.device.startswith("cuda") else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=top)


# --------------------------------------------------------------------------- store


def open_run(store: str) -> zarr.Group:
    root = open_root(store, mode="r")
    (run_id,) = run_ids(root)
    return open_run_group(root, run_id)


def store_sizes(store: str) -> dict[str, Any]:
    run = open_run(store)
    n_seq = n_sequences(run)
    per_array = {}
    total = 0
    for name, arr in run.arrays():
        stored = arr.nbytes_stored()
        total += stored
        per_array[name] = {"nbytes": arr.nbytes, "stored": stored, "ratio": arr.nbytes / stored}
    on_disk = sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())
    return {
        "sequences": n_seq,
        "run_bytes_per_seq": total / n_seq,
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
    sizes: dict[str, dict[int, int]] = defaultdict(dict)
    enc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    dec: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
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
    ``budget`` of the extract loop's time per sequence (single-threaded Blosc, this machine)."""
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


# --------------------------------------------------------------------------- report


def report(results: dict[str, Any]) -> str:
    out = []
    thr = results["throughput"]
    out.append(
        f"## Extract vs decoder-only SDPA forward ({results['device']}, {results['dtype']}, "
        f"{results['torch_threads']} torch threads, {results['cpu_count']} CPUs, {results['reps']} reps)\n"
    )
    out.append(table(
        ["model", "L", "seqs", "SDPA fwd s", "extract() s", "loop s", "eager+attn s",
         "extract()/SDPA whole runs alone", "extract()/SDPA per rep [min/min]", "extract/SDPA per batch", "extract/SDPA CPU-time",
         "eager+attn/SDPA per rep", "eager+attn/SDPA per batch", "extract tok/s", "load avg"],
        [[r["model"], r["length"], r["sequences"], r["median_s"]["sdpa"], r["median_s"]["extract"],
          r["median_s"]["loop"], r["median_s"]["eager"], r["alone_ratio"],
          f"{r['median_ratio']['extract']:.2f} [{r['min_ratio']['extract']:.2f}]",
          r["median_ratio"]["extract_per_batch"], r["median_ratio"]["extract_cpu_per_batch"],
          r["median_ratio"]["eager"], r["median_ratio"]["eager_per_batch"],
          r["extract_tokens_per_s"], "/".join(f"{x:.1f}" for x in r["loadavg_1min"])] for r in thr],
    ))
    out.append(
        "\nWhole runs alone: per rep, extract() and the SDPA forward over the same batches run one after "
        "the other with nothing hooked in. "
        "Times: medians over reps of whole-run seconds. Ratios: medians of ratios taken side by side; "
        "[min/min] = ratio of the fastest reps. Each batch runs SDPA fwd and eager+attn on its ids right "
        "before extract's own forward (hooked in; their time is subtracted from extract's), so \"per batch\" "
        "ratios compare runs seconds apart. extract() = the whole call minus model load (windows, store "
        "creation, loop, consolidation); loop = ExtractResult.seconds. SDPA fwd = stock sdpa "
        "`model.model(ids, use_cache=False)`; eager+attn = stock eager `model(ids, output_attentions=True)` "
        "with LM head, attentions not saved. CPU-time = process CPU seconds, less sensitive to other "
        "processes on the machine.\n"
    )

    out.append("## Where extract time goes (seconds per sequence; medians over reps of the timed runs)\n")
    keys = ["sdpa_forward", "extract", "capture_forward", "summaries", "sdpa_in_capture", "host_arrays",
            "zarr_writes", "create_run", "consolidate", "setup_in_extract"]
    out.append(table(
        ["model", "L", *keys, "capture fwd - summaries", "summaries/SDPA fwd"],
        [[r["model"], r["length"], *[r["phases_s_per_seq"].get(k, float("nan")) for k in keys],
          r["phases_s_per_seq"]["capture_forward"] - r["phases_s_per_seq"]["summaries"],
          r["phases_s_per_seq"]["summaries"] / r["phases_s_per_seq"]["sdpa_forward"]] for r in thr],
    ))
    out.append(
        "\ncapture_forward = extract's model.model under capturing(); summaries = attention_summaries "
        "inside it (float32 score recompute + per-query reductions); sdpa_in_capture = the SDPA output "
        "inside it; host_arrays = _sequence_arrays (stack, device->host, casts); zarr_writes = "
        "write_sequence (Blosc encode + files); setup_in_extract = before the first forward (corpus, "
        "windows, store checks).\n"
    )

    out.append("## Store size (run group, nbytes / nbytes_stored per array)\n")
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

    out.append("\n## Chunk reads through zarr (median ms; page cache warm)\n")
    out.append(table(
        ["model", "L", "array", "layers", "1 inner chunk", "whole shard", "shard/chunk",
         "all layers 1 by 1", "1 layer, no inner chunks", "stored MB/seq sharded", "stored MB/seq unsharded"],
        [[c["model"], c["length"], name, a["n_layers"], a["inner_chunk"] * 1e3, a["whole_shard"] * 1e3,
          a["whole_shard"] / a["inner_chunk"], a["all_layers_one_by_one"] * 1e3,
          a["no_inner_chunks_one_layer"] * 1e3, a["shard_stored_bytes_per_seq"] / 1e6,
          a["no_inner_chunks_stored_bytes_per_seq"] / 1e6]
         for c in results["reads"] for name, a in c["arrays"].items()],
    ))
    if results.get("profiles"):
        for p in results["profiles"]:
            out.append(f"\n## torch.profiler, one capturing forward: {p['model']} L={p['length']}\n")
            out.append("```\n" + p["table"] + "\n```")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gemma3-270m,smollm2-135m", help="comma-separated model names")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--lengths", default="512,1024", help="comma-separated context lengths")
    p.add_argument(
        "--num-sequences", default="4,2",
        help="sequences per length: one number for all, or one per --lengths entry (default 4,2)",
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--references", default="sdpa,eager",
        help="reference forwards run beside each batch of extract (sdpa is required; eager, the slowest, "
        "may be left out on a busy machine)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reps", type=int, default=3, help="interleaved timing repetitions (default 3)")
    p.add_argument("--level-reps", type=int, default=3)
    p.add_argument("--read-reps", type=int, default=15)
    p.add_argument("--levels", default="1,3,5,9", help="Blosc zstd levels to compare")
    p.add_argument(
        "--level-budget", type=float, default=0.05,
        help="largest compress time, as a fraction of the extract loop per sequence, a chosen level may cost",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="add torch.profiler top operators of one capturing forward")
    p.add_argument("--workdir", default=None, help="folder for the temporary stores (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args(argv)
    args.lengths = int_list(args.lengths)
    counts = int_list(args.num_sequences)
    if len(counts) == 1:
        counts *= len(args.lengths)
    if len(counts) != len(args.lengths):
        p.error("--num-sequences takes one number or one per --lengths entry")
    args.counts = counts
    args.level_list = int_list(args.levels)
    args.references = [r for r in args.references.split(",") if r]
    if "sdpa" not in args.references or not set(args.references) <= set(REFERENCES):
        p.error(f"--references takes sdpa and optionally eager, not {args.references}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "device": device, "dtype": str(dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "reps": args.reps,
        "dataset": args.dataset, "batch_size": args.batch_size, "blosc_level_in_store": BLOSC_LEVEL,
        "versions": pipeline._library_versions(),
        "throughput": [], "store": [], "levels": [], "reads": [], "profiles": [], "loads": {},
    }
    with tempfile.TemporaryDirectory(prefix="attngeom-bench-", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        for name in args.models.split(","):
            bundle = load_bundle(name, device, dtype)
            results["loads"][name] = bundle.load_s
            print(f"loaded {name} three ways in {bundle.load_s:.1f}s", file=sys.stderr, flush=True)
            for length, count in zip(args.lengths, args.counts):
                bench = throughput(bundle, args, length, count, workdir)
                results["throughput"].append(
                    {k: v for k, v in bench.items() if k not in ("windows", "batches", "store")}
                )
                tag = {"model": name, "length": length}
                results["store"].append({**tag, **store_sizes(bench["store"])})
                results["reads"].append({**tag, "arrays": chunk_reads(bench["store"], args.read_reps, workdir)})
                if length == max(args.lengths):
                    lv = compression_levels(bench["store"], args.level_list, args.level_reps)
                    loop_per_seq = bench["median_s"]["loop"] / count
                    results["levels"].append({**tag, **lv, "choice": choose_level(lv, loop_per_seq, args.level_budget)})
                if args.profile:
                    results["profiles"].append({**tag, "table": torch_profile(bundle, bench["batches"][0])})
                shutil.rmtree(bench["store"])
            del bundle
    results["wall_s"] = time.perf_counter() - t_start
    print(report(results))
    print(f"\n(total benchmark wall time {results['wall_s']:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
