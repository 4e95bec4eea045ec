"""Requests on an object store (moto's S3 server on loopback), counted where the client makes
them: what a local disk hides costs a round trip each on a bucket. An analyze reads each
node's metadata and each input shard once, however many sequences and batches it runs, and
writes its record once per batch; a first analyze copies nothing; validate reads each
``zarr.json`` once and lists the store once per array at most, not once per sequence."""

from __future__ import annotations

import collections
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import moto_s3

from attngeom.analyze import runner
from attngeom.api import analyze
from attngeom.store import validate_store, zarr_store
from attngeom.store.objects.storage import node_metadata
from attngeom.extract.synthetic import write_synthetic_run


@pytest.fixture(scope="module")
def s3_env():
    with moto_s3():
        yield


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter]:
    """Every S3 request of the block: (operation, key below the store) -> count."""
    from aiobotocore.client import AioBaseClient

    counts: collections.Counter = collections.Counter()
    original = AioBaseClient._make_api_call

    async def call(self: Any, operation: str, params: dict[str, Any]) -> Any:
        key = params.get("Key") or params.get("Prefix") or ""
        counts[(operation, key.partition(".zarr/")[2])] += 1
        return await original(self, operation, params)

    AioBaseClient._make_api_call = call
    try:
        yield counts
    finally:
        AioBaseClient._make_api_call = original


def total(counts: collections.Counter, operation: str, test=lambda key: True) -> int:
    return sum(n for (op, key), n in counts.items() if op == operation and test(key))


def metadata(key: str) -> bool:
    return key.endswith("zarr.json")


def synthetic(n_seq: int) -> str:
    url = f"s3://attngeom/{uuid.uuid4().hex}.zarr"
    write_synthetic_run(url, "r", n_seq=n_seq, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    return url


def analyzed(url: str) -> collections.Counter:
    with pytest.MonkeyPatch.context() as mp, counted() as counts:
        mp.setattr(runner, "BATCH_TASKS", 2)  # one sequence (two layers) a batch
        analyze(url, run_id="r", scheduler="threads", n_grid=[1, 2, 4], progress=False)
    return counts


@pytest.fixture(scope="module")
def analyzed_stores(s3_env) -> list[tuple[str, collections.Counter]]:
    """Synthetic stores of 2 and 6 sequences, each analyzed once: its url and the requests
    of its analyze. The tests only read them."""
    return [(url, analyzed(url)) for url in (synthetic(n) for n in (2, 6))]


def test_an_analyze_reads_metadata_and_each_shard_once_whatever_its_batches(analyzed_stores):
    few, many = (counts for _, counts in analyzed_stores)
    # Each node's metadata once: the same reads for 2 batches or 6.
    assert total(few, "GetObject", metadata) == total(many, "GetObject", metadata)
    # The command's first look at the store and at the run's record (its L, against which
    # --n-grid is checked before the libraries load), and the version (ETag) of the analysis
    # record: read before the record itself (the analyze's record writes are conditional on
    # it), and once more before the consolidated copy is refreshed.
    assert total(many, "HeadObject", metadata) <= 4, {key: n for key, n in many.items() if key[0] == "HeadObject"}
    for counts, n in ((few, 2), (many, 6)):
        for prefix in ("runs/r/values/c/", "runs/r/attn_last/c/", "runs/r/winner/c/"):
            # A sequence's shard is read once, for both of its layers' tasks.
            assert total(counts, "GetObject", lambda key, prefix=prefix: key.startswith(prefix)) == n, prefix
        # The record: begun, once a batch, committed.
        assert counts[("PutObject", "runs/r/analysis/zarr.json")] == n + 2
        # Nothing staged, nothing copied into place.
        assert total(counts, "CopyObject") == 0
    # Each node's metadata once, and what lies outside the analysis once more, as stored at
    # the end (a peer may have changed it), for the consolidated copy; the root's also at
    # the command's first look, before the store's libraries load. What the analyze wrote,
    # it never reads back; its record it looks for (absent) when it opens the run.
    reads = {key: n for (op, key), n in many.items() if op == "GetObject" and metadata(key)}
    # The run's record once more, for the check of --n-grid before the libraries load.
    assert reads.pop("zarr.json") == 3 and reads.pop("runs/r/zarr.json") == 3 and max(reads.values()) == 2
    assert [key for key in reads if key.startswith("runs/r/analysis/")] == ["runs/r/analysis/zarr.json"]


def test_validate_reads_each_zarr_json_once_and_lists_per_array_not_per_sequence(analyzed_stores):
    runs = []
    for url, _ in analyzed_stores:
        documents = set(node_metadata(zarr_store(url, read_only=True)))
        with counted() as counts:
            assert validate_store(url, deep=True) == []
        assert {key: n for (op, key), n in counts.items() if op == "GetObject" and key in documents} == dict.fromkeys(
            documents, 1)
        assert total(counts, "HeadObject") == 0
        runs.append(counts)
    few, many = runs
    assert total(few, "ListObjectsV2") == total(many, "ListObjectsV2")


def test_a_small_objects_parts_are_cut_from_one_read_of_it_and_equal_ranged_reads(monkeypatch):
    """An object the command listed as small is read once, whole, and every part asked for
    (ranges, offsets, suffixes, also past its end) equals what a ranged read returns."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype

    from attngeom.store.objects._zarr import sync
    from attngeom.store.objects.cache import cached, note_sizes, uncached

    url = f"memory://attngeom-{uuid.uuid4().hex}/s.zarr"
    mine = cached(zarr_store(url, read_only=False))
    data = bytes(range(200))
    sync(uncached(mine).set("a/c/0", default_buffer_prototype().buffer.from_bytes(data)))
    reads = []
    original = mine.fs._cat_file

    async def counting(path, *args, **kwargs):
        reads.append(path)
        return await original(path, *args, **kwargs)

    monkeypatch.setattr(mine.fs, "_cat_file", counting)

    async def note() -> None:
        note_sizes(mine, {"a/c/0": len(data)})

    sync(note())
    parts = [RangeByteRequest(10, 20), OffsetByteRequest(190), SuffixByteRequest(5), SuffixByteRequest(300),
             RangeByteRequest(195, 250), None]

    def get(store, part):
        return sync(store.get("a/c/0", prototype=default_buffer_prototype(), byte_range=part)).to_bytes()

    got = [get(mine, part) for part in parts]
    assert len(reads) == 1  # the whole object, once
    assert got == [get(uncached(mine), part) for part in parts]
    assert got[:3] == [data[10:20], data[190:], data[-5:]]
