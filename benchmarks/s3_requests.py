#!/usr/bin/env python
"""Requests and seconds per command on an S3 server against a local disk (run by hand).

    python benchmarks/s3_requests.py                          # smollm2-135m, wiki-summaries, L = 64, 8 sequences, 3 reps
    python benchmarks/s3_requests.py --model gemma3-270m --length 128 --num-sequences 16 --reps 5

The same commands, in order, on a local store and on a bucket of moto's S3 server on
loopback (``moto[server]``, started here in a process of its own, as a real server is):
``extract``, ``analyze``, ``validate --deep``, ``report``, each through the Python API in
this process, after one untimed warm-up extract and analyze on a scratch local store (model
loading, the kernels' compile). Each repetition writes fresh stores; within it each command
runs on both sides one right after the other, in an order that alternates between
repetitions, so that both see the machine alike. Every S3 request is counted where the
client makes it (aiobotocore's ``_make_api_call``, which s3fs's calls, listings included, go
through), by operation and by what it names: ``zarr.json`` (metadata), ``leases/`` (a
writer's lease), anything else (chunks and shards). The table gives each command's median
seconds on either side, the median and range of the per-repetition ratios, and the S3
requests of the last repetition.

Loopback S3 has no network latency: each request costs what the server and the client spend
on it, so the counts, not the seconds, say what a distant bucket would add.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any


def classify(params: dict[str, Any]) -> str:
    key = params.get("Key") or params.get("Prefix") or ""
    if key.endswith("zarr.json"):
        return "zarr.json"
    if "/leases/" in f"/{key}":
        return "leases"
    return "other"


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter]:
    """Count every S3 request made in the block by (operation, what it names)."""
    from aiobotocore.client import AioBaseClient

    # aiobotocore's private entry of every request: botocore's public event hooks need the
    # client, which s3fs makes inside each file system. tests/test_s3_requests.py counts the
    # same way and fails when this stops counting.
    counts: collections.Counter = collections.Counter()
    original = AioBaseClient._make_api_call

    async def call(self: Any, operation: str, params: dict[str, Any]) -> Any:
        counts[(operation, classify(params))] += 1
        return await original(self, operation, params)

    AioBaseClient._make_api_call = call
    try:
        yield counts
    finally:
        AioBaseClient._make_api_call = original


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(counts: collections.Counter) -> dict[str, int]:
    """Totals by kind: listings, metadata reads and writes, other reads and writes."""
    out = collections.Counter()
    for (operation, what), n in counts.items():
        if operation.startswith("List"):
            kind = "list"
        elif operation in ("GetObject", "HeadObject"):
            kind = f"read {what}"
        elif operation in ("PutObject", "CopyObject", "CompleteMultipartUpload", "UploadPart", "CreateMultipartUpload"):
            kind = f"write {what}"
        elif operation.startswith("Delete"):
            kind = "delete"
        else:
            kind = operation
        out[kind] += n
    out["total"] = sum(counts.values())
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="wiki-summaries")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--reps", type=int, default=3, help="repetitions, each on fresh stores (default 3)")
    p.add_argument("--scheduler", default="threads", help="analyze's scheduler (default threads; "
                   "'default' for attngeom's own default, worker processes)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    args = p.parse_args()

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(600):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.1)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": endpoint, "FSSPEC_S3_ENDPOINT_URL": endpoint})
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")

    from attngeom import api

    work = tempfile.mkdtemp(prefix="attngeom-s3-")
    scheduler = None if args.scheduler == "default" else args.scheduler

    def commands(url: str, out: str) -> dict[str, Callable[[], Any]]:
        return {
            "extract": lambda: api.extract(args.model, dataset=args.dataset, context_length=args.length,
                                           num_sequences=args.num_sequences, store=url, run_id="r", device="cpu",
                                           progress=False),
            "analyze": lambda: api.analyze(url, scheduler=scheduler, progress=False),
            "validate --deep": lambda: api.validate(url, deep=True),
            "report": lambda: api.report(url, out),
        }

    warm = commands(f"{work}/warm.zarr", f"{work}/warm-report")
    warm["extract"]()
    warm["analyze"]()

    reps: list[dict[str, dict[str, Any]]] = []
    for rep in range(args.reps):
        sides = {"local": commands(f"{work}/local{rep}.zarr", f"{work}/local{rep}-report"),
                 "s3": commands(f"s3://bench/store{rep}.zarr", f"{work}/s3-{rep}-report")}
        figures: dict[str, dict[str, Any]] = {}
        for name in sides["local"]:
            row = figures[name] = {}
            for side in (("local", "s3") if rep % 2 == 0 else ("s3", "local")):
                if side == "s3":
                    with counted() as counts:
                        row["s3_s"] = timed(sides["s3"][name])
                    row["requests"] = summary(counts)
                    row["by_operation"] = {f"{o} {w}": n for (o, w), n in sorted(counts.items())}
                else:
                    row["local_s"] = timed(sides["local"][name])
        reps.append(figures)
    server.terminate()
    server.wait()

    names = list(reps[0])
    last = reps[-1]
    kinds = sorted({k for row in last.values() for k in row["requests"] if k != "total"})
    print(f"model {args.model}, {args.dataset}, L = {args.length}, {args.num_sequences} sequences, "
          f"analyze scheduler {args.scheduler}, {args.reps} repetitions; S3: moto on loopback")
    header = ["command", "local s", "S3 s", "S3/local", "(range)", "requests", *kinds]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in names:
        local = [rep[name]["local_s"] for rep in reps]
        remote = [rep[name]["s3_s"] for rep in reps]
        ratios = [r / loc for r, loc in zip(remote, local)]
        req = last[name]["requests"]
        print(" | ".join([name, f"{statistics.median(local):.2f}", f"{statistics.median(remote):.2f}",
                          f"{statistics.median(ratios):.1f}x", f"{min(ratios):.1f}-{max(ratios):.1f}",
                          str(req["total"]), *(str(req.get(k, 0)) for k in kinds)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "reps": reps}, f, indent=1)


if __name__ == "__main__":
    main()
