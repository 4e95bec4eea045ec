"""write_dataset, the writer of every derived group, stores what xarray's own ``to_zarr`` stores
(its brute-force twin here): the same objects, the same metadata, the same chunk bytes."""

from __future__ import annotations

import json

import dask.array as da
import numpy as np
import pytest
import xarray as xr
import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.store.objects._zarr import sync
from attngeom.store import open_dataset, write_dataset, zarr_store
from attngeom.store.extracted.datasets import encode_labels
from attngeom.store.objects.codecs import compressors


def to_zarr_twin(dataset: xr.Dataset, group: str, *, compute: bool = True, chunks=None) -> zarr.storage.MemoryStore:
    """The group as ``Dataset.to_zarr`` writes it, with the store's codecs, chunk lengths and chunk keys."""
    dataset = encode_labels(dataset)
    chunks = chunks or {}
    encoding = {}
    for name, var in dataset.variables.items():
        encoding[name] = {"compressors": compressors(var.dtype), "chunk_key_encoding": {"name": "default", "separator": "."}}
        if set(chunks) & set(var.dims):
            encoding[name]["chunks"] = tuple(chunks.get(dim, size) for dim, size in var.sizes.items())
    store = zarr.storage.MemoryStore()
    dataset.to_zarr(store, group=group, mode="w", consolidated=False, zarr_format=3, encoding=encoding,
                    compute=compute)
    return store


def objects(store, group: str) -> dict:
    """Every object under the group: parsed JSON for metadata, bytes for chunks."""

    async def read() -> dict:
        out = {}
        async for key in store.list_prefix(f"{group}/"):
            raw = (await store.get(key, prototype=default_buffer_prototype())).to_bytes()
            out[key] = json.loads(raw) if key.endswith("zarr.json") else raw
        return out

    return sync(read())


def sample_datasets() -> dict[str, xr.Dataset]:
    rng = np.random.default_rng(0)
    floats = rng.normal(size=(3, 4, 5))
    floats[0, 1] = np.nan
    analysis_like = xr.Dataset(
        {
            "f": (("layer", "head", "n"), floats),
            "all_nan": (("layer", "head"), np.full((3, 4), np.nan)),
            "count": (("layer", "head", "n"), rng.integers(-1, 9, size=(3, 4, 5))),
            "flag": (("layer", "head"), rng.integers(0, 2, size=(3, 4)).astype(np.int8)),
            "regime": (("layer", "head"), rng.choice(["Mixer", "Reset", "a b"], size=(3, 4)).astype(object)),
        },
        coords={"layer": np.arange(3, dtype=np.int32), "head": np.arange(4, dtype=np.int32),
                "n": [1, 2, 4, 8, 16], "stat": np.array(["mean", "q95"], dtype=object)},
        attrs={"attngeom": {"n_grid": [1, 2], "seed": 0}, "coherence_n": 64},
    )
    odd = xr.Dataset(
        {
            "f32": ("a", np.float32([1.5, np.nan])),
            "mask": ("a", np.array([True, False])),
            "empty": ("e", np.zeros(0)),
            "scalar": ((), 3.5),
            "long": ("row", rng.normal(size=200_000)),  # zarr chooses several chunks
        },
        coords={"a": [10, 20], "e": np.zeros(0, dtype=np.int64), "row": np.arange(200_000)},
        attrs={"critical_heads": 0},
    )
    lazy = xr.Dataset(
        {"x": (("seq", "layer"), da.ones((6, 3), chunks=(2, 3))), "y": ("seq", da.zeros(6, chunks=2, dtype=np.int64))},
        coords={"seq": np.arange(6), "layer": np.arange(3)},
    )
    return {"analysis_like": analysis_like, "odd": odd, "lazy": lazy}


@pytest.mark.parametrize("name", ["analysis_like", "odd", "lazy"])
@pytest.mark.parametrize("compute", [True, False])
@pytest.mark.parametrize("chunks", [None, {"seq": 2, "layer": 2}])
@pytest.mark.parametrize("local", [False, True], ids=["fsspec", "local"])
def test_write_dataset_stores_what_to_zarr_stores(name, compute, chunks, local, tmp_path):
    """Through the store's own writes (fsspec) and the local folder's (files written directly)."""
    dataset = sample_datasets()[name]
    url = str(tmp_path / "s.zarr") if local else f"memory://writes-{name}-{compute}-{chunks is None}"
    write_dataset(zarr_store(url, read_only=False), url, "runs/r/analysis/g", dataset, compute=compute, chunks=chunks)
    got = objects(zarr_store(url, read_only=True), "runs/r/analysis/g")
    want = objects(to_zarr_twin(dataset, "runs/r/analysis/g", compute=compute, chunks=chunks), "runs/r/analysis/g")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key
    if compute:
        written = open_dataset(zarr_store(url, read_only=True), url, "runs/r/analysis/g")
        xr.testing.assert_identical(written.load(), dataset.load())


def test_write_dataset_refuses_a_non_dimension_coordinate():
    dataset = xr.Dataset({"x": ("a", [1.0, 2.0])}, coords={"a": [0, 1], "label": ("a", [5, 6])})
    with pytest.raises(ValueError, match="label"):
        write_dataset(zarr_store("memory://writes-coordinate", read_only=False), "memory://writes-coordinate", "g",
                      dataset)


def test_a_failed_sequence_write_commits_nothing_and_ends_every_write(tmp_path):
    """One array's chunk fails at once while the others take their time: the OSError goes up
    only after every other write of the sequence has ended (a failed extract then removes
    what it wrote, with nothing written after), and the sequence is not committed."""
    import asyncio
    import errno

    from attngeom.store import RUNS, open_root, open_run_group, resize_run, run_layout, write_sequence
    from attngeom.extract.synthetic import synthetic_sequence, write_synthetic_run

    class FullForValues(zarr.storage.WrapperStore):
        def __init__(self, store):
            super().__init__(store)
            self.ended: list[str] = []

        async def set(self, key, value):
            if "/values/c/1" in key:
                raise OSError(errno.ENOSPC, "No space left on device")
            await asyncio.sleep(0.2)
            await self._store.set(key, value)
            self.ended.append(key)

    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=1, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=16)
    resize_run(open_run_group(open_root(str(store), mode="r+"), "r"), 2)
    slow = FullForValues(zarr.storage.LocalStore(store))
    run = zarr.open_group(slow, path=f"{RUNS}/r", mode="r+", use_consolidated=False)
    with pytest.raises(OSError):
        write_sequence(run, 1, synthetic_sequence(np.random.default_rng(1), run_layout(run)))
    assert sorted(key.split("/")[2] for key in slow.ended) == [
        "attn_last", "diag_attn", "doc_index", "entropy", "prev_attn", "recent_attn", "sink_attn", "tokens",
        "top1_attn", "window_start", "winner"]
    assert list(run["complete"][:]) == [1, 0]


class GatedStore(zarr.storage.WrapperStore):
    """A local store whose chunk writes wait for ``gate`` and fail for ``failing`` keys; it
    records the keys written."""

    def __init__(self, store, failing: str | None = None):
        super().__init__(store)
        self.gate = __import__("threading").Event()
        self.failing = failing
        self.written: list[str] = []

    async def set(self, key, value):
        import asyncio
        import errno

        while not self.gate.is_set():  # no thread of zarr's pool held: the test reads meanwhile
            await asyncio.sleep(0.01)
        if self.failing and self.failing in key:
            raise OSError(errno.ENOSPC, "No space left on device")
        await self._store.set(key, value)
        self.written.append(key)


def gated_run(tmp_path, n_seq: int, failing: str | None = None):
    from attngeom.store import RUNS, open_root, open_run_group, resize_run
    from attngeom.extract.synthetic import write_synthetic_run

    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=1, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=16)
    resize_run(open_run_group(open_root(str(store), mode="r+"), "r"), n_seq)
    gated = GatedStore(zarr.storage.LocalStore(store), failing)
    return gated, zarr.open_group(gated, path=f"{RUNS}/r", mode="r+", use_consolidated=False)


class LayerPart:
    """One layer's part of a sequence's array as extract hands it to the writer; the writer's
    stack reads it, and the first layer's read is noted in ``log`` as (seq, thread)."""

    def __init__(self, seq, layer, value, log):
        self.seq, self.layer, self.value, self.log = seq, layer, value, log

    def __array__(self, dtype=None, copy=None):
        import threading

        if self.layer == 0:
            self.log.append((self.seq, threading.current_thread()))
        return self.value


def in_parts(seq, arrays, log):
    """``arrays`` with their values handed over one part per layer (:class:`LayerPart`)."""
    values = arrays["values"]
    return {**arrays, "values": [LayerPart(seq, layer, values[layer], log) for layer in range(values.shape[0])]}


def test_the_writer_converts_and_writes_beside_the_caller_in_order(tmp_path):
    """submit returns while the store holds the write back; the layers' parts are stacked in
    the writer, one sequence after another; close commits every sequence with its own arrays."""
    from attngeom.store import SequenceWriter, run_layout
    from attngeom.extract.synthetic import synthetic_sequence

    gated, run = gated_run(tmp_path, 4)
    layout = run_layout(run)
    sequences = {s: synthetic_sequence(np.random.default_rng(s), layout) for s in (1, 2, 3)}
    stacked: list[tuple] = []

    def arrays(seq):
        return in_parts(seq, sequences[seq], stacked)

    with SequenceWriter(run, in_flight=2) as writer:
        writer.submit(1, arrays(1))
        writer.submit(2, arrays(2))
        assert list(zarr.open_array(gated._store, path="runs/r/complete", mode="r")[:]) == [1, 0, 0, 0]
        assert [seq for seq, _ in stacked] in ([], [1])  # the second waits for the first to be written
        gated.gate.set()
        writer.submit(3, arrays(3))
    assert [seq for seq, _ in stacked] == [1, 2, 3]
    assert all(thread.name.startswith("attngeom-writer") for _, thread in stacked)
    reread = zarr.open_group(gated._store, path="runs/r", mode="r", use_consolidated=False)
    assert list(reread["complete"][:]) == [1, 1, 1, 1]
    for seq, expected in sequences.items():
        for name, value in expected.items():
            np.testing.assert_array_equal(reread[name][seq], value)


def test_a_failed_write_stops_the_writer_and_nothing_is_written_after(tmp_path):
    """Sequence 1's values cannot be stored: the OSError reaches the caller, sequence 0 stays
    committed, and no sequence after 1 is stacked or written."""
    from attngeom.store import SequenceWriter, run_layout
    from attngeom.extract.synthetic import synthetic_sequence

    gated, run = gated_run(tmp_path, 5, failing="/values/c/2")
    gated.gate.set()
    layout = run_layout(run)
    stacked: list[tuple] = []

    def arrays(seq):
        return in_parts(seq, synthetic_sequence(np.random.default_rng(seq), layout), stacked)

    with pytest.raises(OSError, match="No space"), SequenceWriter(run, in_flight=2) as writer:
        for seq in (1, 2, 3, 4):
            writer.submit(seq, arrays(seq))
    assert [seq for seq, _ in stacked] == [1, 2]
    assert not [key for key in gated.written if "/c/3" in key or "/c/4" in key]
    assert list(zarr.open_array(gated._store, path="runs/r/complete", mode="r")[:]) == [1, 1, 0, 0, 0]


def test_without_sequences_in_flight_submit_writes_in_the_callers_thread(tmp_path):
    """in_flight=0 (extract on CPU): each submit returns with its sequence committed, stacked
    in the caller's thread; a failed write is raised by that submit and stops the writer."""
    import threading

    from attngeom.store import SequenceWriter, run_layout
    from attngeom.extract.synthetic import synthetic_sequence

    gated, run = gated_run(tmp_path, 4, failing="/values/c/3")
    gated.gate.set()
    layout = run_layout(run)
    stacked: list[tuple[int, threading.Thread]] = []

    def arrays(seq):
        return in_parts(seq, synthetic_sequence(np.random.default_rng(seq), layout), stacked)

    complete = zarr.open_array(gated._store, path="runs/r/complete", mode="r")
    with pytest.raises(OSError, match="No space"), SequenceWriter(run, in_flight=0) as writer:
        writer.submit(1, arrays(1))
        assert list(complete[:]) == [1, 1, 0, 0]
        writer.submit(2, arrays(2))
        assert list(complete[:]) == [1, 1, 1, 0]
        writer.submit(3, arrays(3))
    assert stacked == [(s, threading.current_thread()) for s in (1, 2, 3)]
    assert list(complete[:]) == [1, 1, 1, 0]


def test_consolidate_writes_what_zarr_writes(tmp_path):
    """The root's consolidated copy equals zarr.consolidate_metadata's, value for value: a
    run, a derived group beside it, and a node no group reaches (left out by both)."""
    import shutil
    import warnings

    from attngeom.store.holds.access import consolidate
    from attngeom.extract.synthetic import write_synthetic_run

    ours = tmp_path / "ours.zarr"
    write_synthetic_run(str(ours), "r", n_seq=2, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    write_dataset(zarr_store(str(ours), read_only=False), str(ours), "runs/r/analysis/g",
                  sample_datasets()["analysis_like"])
    orphan = ours / "runs" / "r" / "loose" / "inner"
    orphan.mkdir(parents=True)
    (orphan / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    theirs = tmp_path / "theirs.zarr"
    shutil.copytree(ours, theirs)
    consolidate(zarr.open_group(str(ours), mode="r+", use_consolidated=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(zarr.storage.LocalStore(str(theirs)))
    got, want = (json.loads((store / "zarr.json").read_text()) for store in (ours, theirs))
    assert "runs/r/analysis/g" in got["consolidated_metadata"]["metadata"]
    assert not any(path.startswith("runs/r/loose") for path in got["consolidated_metadata"]["metadata"])
    assert got == want


@pytest.mark.parametrize("local", [False, True], ids=["fsspec", "local"])
def test_regions_are_stored_as_zarr_stores_them(local, tmp_path):
    """set_regions against zarr's own writes of the same values, one region after another
    along the first axis: a chunk left partly unwritten, a chunk merged with the positions
    stored before the region, whole chunks, an edge chunk (padded with the fill value) and
    a chunk all fill value (stored all the same), float and integer, chunked along the
    second axis too."""
    from attngeom.store.extracted.datasets import set_regions

    url = str(tmp_path / "s.zarr") if local else f"memory://regions-{local}"
    zstore = zarr_store(url, read_only=False)
    twin = zarr.storage.MemoryStore()
    rng = np.random.default_rng(1)
    blocks = {"f": (rng.normal(size=(7, 3)), np.float64), "i": (rng.integers(-1, 9, size=(7, 3)), np.int64)}
    for store in (zstore, twin):
        for name, (_, dtype) in blocks.items():
            zarr.create_array(store, name=f"g/{name}", shape=(7, 3), chunks=(2, 2), dtype=dtype,
                              compressors=compressors(np.dtype(dtype)),
                              fill_value=np.nan if dtype == np.float64 else None,
                              chunk_key_encoding={"name": "default", "separator": "."})
    blocks["f"][0][4:6] = np.nan  # the third chunks all fill value
    blocks["i"][0][4:6] = 0
    regions = [(0, 3), (3, 4), (4, 7)]
    for a, b in regions:
        set_regions(url, zstore, [(zarr.open_array(zstore, path=f"g/{name}", mode="r+").async_array, values[a:b])
                                  for name, (values, _) in blocks.items()], a)
    with zarr.config.set({"array.write_empty_chunks": True}):  # read when an array is opened
        for name, (values, _) in blocks.items():
            theirs = zarr.open_array(twin, path=f"g/{name}", mode="r+")
            for a, b in regions:
                theirs[a:b] = values[a:b]
    got, want = objects(zstore, "g"), objects(twin, "g")
    assert sorted(got) == sorted(want) and "g/f/c.2.1" in got and "g/f/c.3.0" in got
    assert all(got[key] == want[key] for key in want)


@pytest.mark.parametrize("local", [False, True], ids=["fsspec", "local"])
def test_regions_read_as_zarr_reads_them(local, tmp_path):
    """read_regions against zarr's own reads of the same regions along the first axis:
    chunks split along the second axis too, an edge chunk, a chunk never stored (the fill
    value), an empty region, float and integer; a flipped byte is named as the damaged chunk."""
    from attngeom.errors import CorruptChunkError
    from attngeom.store.extracted.datasets import read_regions

    url = str(tmp_path / "s.zarr") if local else f"memory://read-regions-{local}"
    zstore = zarr_store(url, read_only=False)
    rng = np.random.default_rng(2)
    arrays = {}
    for name, dtype in (("f", np.float64), ("i", np.int64)):
        arr = zarr.create_array(zstore, name=f"g/{name}", shape=(7, 5), chunks=(3, 2), dtype=dtype,
                                compressors=compressors(np.dtype(dtype)),
                                fill_value=np.nan if dtype == np.float64 else None,
                                chunk_key_encoding={"name": "default", "separator": "."})
        arr[:3] = rng.normal(size=(3, 5)) if dtype == np.float64 else rng.integers(-1, 9, size=(3, 5))
        arr[6:] = np.arange(5)[None]  # chunks (1, *) never stored
        arrays[name] = zarr.open_array(zstore, path=f"g/{name}", mode="r").async_array
    regions = [slice(0, 7), slice(1, 5), slice(4, 7), slice(2, 2)]
    parts = [(arr, at) for arr in arrays.values() for at in regions]
    for (arr, at), got in zip(parts, read_regions(url, parts)):
        want = zarr.Array(arr)[at]
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=got.dtype.kind == "f")
    if local:
        chunk = tmp_path / "s.zarr" / "g" / "f" / "c.0.1"
        data = bytearray(chunk.read_bytes())
        data[30] ^= 0xFF
        chunk.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError, match=r"array 'g/f' chunk c\.0\.1 is damaged"):
            read_regions(url, [(arrays["i"], slice(0, 7)), (arrays["f"], slice(1, 2))])


@pytest.mark.parametrize("given", ["whole", "layers"])
@pytest.mark.parametrize("values_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("local", [False, True], ids=["fsspec", "local"])
def test_a_sequence_is_stored_as_zarr_stores_it(local, values_dtype, given, tmp_path):
    """The writer encodes a sequence's chunks and shards itself: every object equals zarr's
    own write of the same values with write_empty_chunks=True, an inner chunk all fill value
    (a layer of zero values) and a chunk all fill value (window_start 0) stored too; every
    run array, attention rows of every query and of chosen queries included. Handed whole, or
    one part per layer as extract hands them (float values in float32, the capture's dtype,
    converted by the writer)."""
    from attngeom.store import RunLayout, create_run, open_or_create_root, write_sequence
    from attngeom.extract.synthetic import synthetic_sequence

    layout = RunLayout(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, length=16, head_kv=(0, 0, 1, 1),
                       window=(0, 0, 4), attendable=((True,) * 16,) * 3, values_dtype=values_dtype,
                       store_rows="all", queries=(3, 15))
    arrays = synthetic_sequence(np.random.default_rng(2), layout)
    arrays["values"][1] = 0
    arrays["window_start"] = np.asarray(0, dtype=np.int64)
    arrays["attn"] = np.random.default_rng(3).random((3, 4, 16, 16)).astype(np.float16)
    ours = str(tmp_path / "ours.zarr") if local else f"memory://sequence-{values_dtype}"
    theirs = zarr.storage.MemoryStore()
    for url in (ours, theirs):
        run = create_run(open_or_create_root(url) if isinstance(url, str) else zarr.open_group(url, mode="w"),
                         "r", layout, {"model": {"id": "m"}}, 2)
        if url is ours:
            write_sequence(run, 1, arrays if given == "whole" else in_layers(arrays, layout.n_layers))
            continue
        with zarr.config.set({"array.write_empty_chunks": True}):  # read when an array is opened
            reopened = zarr.open_group(theirs, path="runs/r", mode="r+", use_consolidated=False)
            for name, value in arrays.items():
                reopened[name][1] = value
            reopened["complete"][1] = 1
    got, want = objects(zarr_store(ours, read_only=True), "runs/r"), objects(theirs, "runs/r")
    assert sorted(got) == sorted(want)
    assert {"runs/r/values/c/1/0/0/0/0", "runs/r/window_start/c/1", "runs/r/attn/c/1/0/0/0/0"} <= set(got)
    assert all(got[key] == want[key] for key in want)


def in_layers(arrays: dict, n_layers: int) -> dict:
    """A sequence's arrays with a layer axis as one part per layer, float ones in float32."""
    def part(layer):
        return layer.astype(np.float32) if layer.dtype == np.float16 else layer

    return {name: [part(layer) for layer in value] if value.ndim > 1 and value.shape[0] == n_layers else value
            for name, value in arrays.items()}


def test_a_local_store_lists_the_metadata_a_store_lists(tmp_path):
    """node_metadata reads a local folder itself: the documents the store's own listing
    gives, an unreadable one as None, whatever the folder order."""
    from attngeom.store.objects.storage import node_metadata
    from attngeom.extract.synthetic import write_synthetic_run

    url = tmp_path / "s.zarr"
    write_synthetic_run(str(url), "r", n_seq=2, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    write_dataset(zarr_store(str(url), read_only=False), str(url), "runs/r/analysis/g",
                  sample_datasets()["analysis_like"])
    (url / "runs" / "r" / "analysis" / "g" / "f" / "zarr.json").write_bytes(b"{")
    memory = zarr.storage.MemoryStore()
    for path in url.rglob("*"):
        if path.is_file():
            raw = default_buffer_prototype().buffer.from_bytes(path.read_bytes())
            memory._store_dict[str(path.relative_to(url))] = raw
    local = zarr_store(str(url), read_only=True)
    for group in ("", "runs/r", "runs/r/analysis"):
        got, want = node_metadata(local, group), node_metadata(memory, group)
        assert list(got) == list(want) and got == want
    assert node_metadata(local)["runs/r/analysis/g/f/zarr.json"] is None


def test_a_failed_local_write_leaves_no_partial_object(tmp_path, monkeypatch):
    """A local object whose write fails half way (a full disk) leaves neither the object nor
    its ``.partial`` file, and the error goes up."""
    import errno
    from pathlib import Path

    from attngeom.store.objects.storage import put_objects

    url = tmp_path / "s.zarr"
    zstore = zarr_store(str(url), read_only=False)
    written = Path.write_bytes

    def full(self, data):
        written(self, data[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError, match="No space"):
        put_objects(zstore, {"g/x/c.0": b"0123456789"})
    assert [p.name for p in url.rglob("*") if p.is_file()] == []

    def parts():  # an object written part by part, whose second part cannot be had
        yield b"01234"
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        put_objects(zstore, {"g/x/c.1": parts()})
    assert [p.name for p in url.rglob("*") if p.is_file()] == []
