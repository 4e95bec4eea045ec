"""Stores shared by several writers (processes, torchrun ranks) and at remote URLs (memory://,
s3:// with moto): each writer's sequences land once, checksums name a corrupt chunk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from conftest import extract, moto_s3

from attngeom.api import analyze
from attngeom.cli import main
from attngeom.extract.request import ExtractRequest
from attngeom.store import (
    ABLATION,
    ANALYSIS,
    FORMAT,
    open_dataset,
    open_root,
    open_run_group,
    run_ids,
    validate_store,
    zarr_store,
)
from attngeom.store.session import StoreSession
from attngeom.store.objects import stored_objects
from attngeom.store.objects.stored_objects import chunk_objects
from attngeom.store.extracted.checks import check_run
from attngeom.extract.synthetic import write_synthetic_run

S = 10


def extract_cmd(model, corpus, store, *extra):
    return [sys.executable, "-m", "attngeom.cli", "extract", "--model", str(model), "--dataset", str(corpus),
            "-L", "16", "-S", str(S), "--store", str(store), "--run", "r", "--no-progress", *extra]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, word_corpus, tmp_path_factory):
    store = tmp_path_factory.mktemp("ref") / "ref.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=S, store=str(store), run_id="r", progress=False))
    return xr.open_zarr(str(store), group="runs/r", consolidated=False).load()


def assert_same_run(store, reference, run_id="r"):
    assert validate_store(str(store), deep=True) == []
    ds = xr.open_zarr(str(store), group=f"runs/{run_id}", consolidated=False)
    assert int(ds["complete"].sum()) == S
    for name in ("tokens", "values", "attn_last", "winner", "entropy", "doc_index"):
        np.testing.assert_array_equal(ds[name].values, reference[name].values)


def test_two_writers_then_a_killed_one_resumes(tiny_model_dir, word_corpus, tmp_path, reference):
    model = tiny_model_dir("llama")
    store = tmp_path / "s.zarr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    writers = [subprocess.Popen(extract_cmd(model, word_corpus, store, "--shard", f"{i}/2"), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    complete = store / "runs/r/complete/c"
    deadline = time.time() + 120
    while time.time() < deadline and writers[1].poll() is None:
        if complete.exists() and len(list(complete.iterdir())) >= 3:
            break
        time.sleep(0.005)
    writers[1].send_signal(signal.SIGKILL)
    assert writers[0].wait(timeout=180) == 0, writers[0].stderr.read()
    writers[1].wait()
    done = xr.open_zarr(str(store), group="runs/r", consolidated=False)["complete"].values
    assert done[0::2].all()  # shard 0 finished all of its sequences
    resumed = subprocess.run(extract_cmd(model, word_corpus, store, "--shard", "1/2"), env=env, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(store, reference)


def test_torchrun_ranks_share_one_run(tiny_model_dir, word_corpus, tmp_path, reference):
    store = tmp_path / "s.zarr"
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    args = extract_cmd(tiny_model_dir("llama"), word_corpus, store)[3:]
    del args[args.index("--run") : args.index("--run") + 2]  # torchrun's parser takes --run for --run-path
    result = subprocess.run([torchrun, "--nproc-per-node", "2", "--standalone", "-m", "attngeom.cli", *args],
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_id,) = run_ids(open_root(str(store)))
    assert_same_run(store, reference, run_id)
    prov = xr.open_zarr(str(store), group=f"runs/{run_id}", consolidated=False).attrs["attngeom"]
    assert prov["shard"][1] == 2


def test_check_run_meets_a_peers_object_renamed_during_its_listing(tmp_path, monkeypatch):
    """A writer checks its run (``check_run``) while a peer is still writing (torchrun ranks,
    ``--shard``): a ``*.partial`` object listed and then renamed into place before its size
    is read is no error, and the run's objects are all counted (1 of 30 torchrun runs of the test
    above failed so, with a FileNotFoundError)."""
    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=2, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    run = open_run_group(open_root(str(store)), "r")
    want = chunk_objects(run["values"])
    obj = next(p for p in sorted((store / "runs/r/values/c/1").rglob("*")) if p.is_file())
    partial = obj.with_name(f"{obj.name}.{uuid.uuid4().hex}.partial")
    shutil.copyfile(obj, partial)
    listed = stored_objects.local_files

    def renamed_after_listing(folder, key):
        found = list(listed(folder, key))
        if any(entry.path == str(partial) for _, entry in found):
            os.replace(partial, obj)
        yield from found

    monkeypatch.setattr(stored_objects, "local_files", renamed_after_listing)
    check_run(str(store), run, "r")
    assert chunk_objects(run["values"]) == want


def test_a_writer_leaves_the_partial_objects_of_another_writer(tmp_path):
    """A writer opening a store removes the leftovers of killed writes only where no other
    process writes it: another writer's ``*.partial`` objects are its writes in flight (1 of
    30 torchrun runs of the test above failed when a rank removed the other's root metadata
    mid-write). Once that writer has ended, the next one removes them."""
    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=1, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    peer = subprocess.Popen(
        [sys.executable, "-c", "import sys; from attngeom.store import open_root; root = open_root(sys.argv[1], "
         "mode='a'); print('writing', flush=True); sys.stdin.read()", str(store)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline() == "writing\n"
        in_flight = store / "runs/r/zarr.0123456789abcdef.partial"
        in_flight.write_bytes(b'{"zarr_format": 3')
        open_root(str(store), mode="a")
        assert in_flight.exists()
    finally:
        peer.communicate("", timeout=60)
    open_root(str(store), mode="a")
    assert not in_flight.exists()


def test_deep_validate_names_a_corrupt_chunk(tiny_model_dir, word_corpus, tmp_path):
    store = tmp_path / "s.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=2, store=str(store), run_id="r", progress=False))
    shard = store / "runs/r/attn_last/c/1/0/0/0"
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(data)
    runner = CliRunner()
    assert runner.invoke(main, ["validate", "--store", str(store)]).exit_code == 0  # metadata is fine
    deep = runner.invoke(main, ["validate", "--deep", "--store", str(store)])
    assert deep.exit_code == 1
    (line,) = deep.output.strip().splitlines()
    assert line.startswith("array 'runs/r/attn_last' chunk c/1/0/0/0 (sequence 1) is damaged")
    assert "checksum" in line


def test_memory_store_pipeline(tiny_model_dir, word_corpus):
    url = f"memory://attngeom-{uuid.uuid4().hex}/store.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("gemma3")), dataset=str(word_corpus), context_length=16,
                           num_sequences=2, store=url, run_id="r", progress=False))
    assert validate_store(url, deep=True) == []
    analyze(url, n_grid=[1, 4], progress=False)
    # On an object store the analysis lies in the generation folder its record names.
    topn = StoreSession.reading(url).reader("r").derived(ANALYSIS, "topn")
    assert dict(topn.sizes) == {"seq": 2, "layer": 3, "head": 4, "n": 2}


@pytest.fixture(scope="module")
def s3_url():
    """A bucket on moto's S3 server on loopback, as s3fs's own tests use it."""
    with moto_s3():
        yield "s3://attngeom/store.zarr"


def test_s3_store_every_stage(tiny_model_dir, word_corpus, s3_url, reference, tmp_path):
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=S, store=s3_url, run_id="r", progress=False))
    assert validate_store(s3_url, deep=True) == []
    ds = xr.open_zarr(zarr_store(s3_url, read_only=True), group="runs/r")
    np.testing.assert_array_equal(ds["values"].values, reference["values"].values)
    analyze(s3_url, scheduler="threads", n_grid=[1, 4], progress=False)
    result = CliRunner().invoke(main, ["taxonomy", "--store", s3_url])
    assert result.exit_code == 0, result.output
    assert "Reset" in result.output
    result = CliRunner().invoke(main, ["ablate", "--store", s3_url, "--run", "r", "--device", "cpu",
                                       "--retention", "1.0,0.5", "--random-masks", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    single = StoreSession.reading(s3_url).reader("r").derived(ABLATION, "single")
    assert dict(single.sizes)["layer"] == 3
    result = CliRunner().invoke(main, ["report", "--store", s3_url, "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report" / "index.html").exists()


def test_s3_store_migrates(format1_store, s3_url):
    import fsspec

    url = s3_url.replace("store.zarr", "format1.zarr")
    fsspec.filesystem("s3").put(str(format1_store), url.removeprefix("s3://"), recursive=True)
    assert validate_store(url)[0].startswith(
        f"store format 1 is older than the one this attngeom writes ({FORMAT}) and has no chunk checksums")
    result = CliRunner().invoke(main, ["migrate", "--store", url, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"format 1 -> {FORMAT}: rewrote 150 arrays" in result.output
    assert validate_store(url, deep=True) == []
    values = xr.open_zarr(zarr_store(url, read_only=True), group="runs/tiny-llama")["values"]
    np.testing.assert_array_equal(values.values, xr.open_zarr(str(format1_store), group="runs/tiny-llama")["values"].values)


def test_multiprocess_cluster_matches_threads(tiny_model_dir, word_corpus, tmp_path):
    """The same run analyzed by threads and, in a copy of the store, by a cluster of two
    worker processes: equal results, and the cluster did the computing."""
    from distributed import Client, LocalCluster, get_task_stream

    store = tmp_path / "s.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("mistral")), dataset=str(word_corpus), context_length=16,
                           num_sequences=3, store=str(store), run_id="r", progress=False))
    by_cluster = tmp_path / "c.zarr"
    shutil.copytree(store, by_cluster)
    analyze(str(store), scheduler="threads", n_grid=[1, 2, 8], progress=False)
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
          Client(cluster) as client, get_task_stream(client) as stream):
        analyze(str(by_cluster), scheduler=cluster.scheduler_address, n_grid=[1, 2, 8], progress=False)
    assert stream.data, "the cluster computed nothing"
    for g in ("topn", "values", "heads", "summary"):
        expected = open_dataset(StoreSession.reading(str(store)).zstore, str(store), f"runs/r/analysis/{g}").load()
        session = StoreSession.reading(str(by_cluster))
        got = open_dataset(session.zstore, session.url, f"runs/r/analysis/{g}").load()
        xr.testing.assert_identical(got, expected)


def _label_codes_brute(values):
    """label_codes one value at a time: labels by first appearance, bytes decoded, -1 for non-strings."""
    labels, codes = {}, []
    for value in values.ravel():
        value = value.decode() if isinstance(value, bytes) else value
        codes.append(labels.setdefault(value, len(labels)) if isinstance(value, str) else -1)
    return list(labels), np.asarray(codes, dtype=np.int64).reshape(values.shape)


def test_label_codes_equal_their_brute_force_twin():
    from attngeom.store import label_codes

    pool = ["a", "b", "", "c d", None, b"a", b"e", float("nan"), 3]
    rng = np.random.default_rng(0)
    cases = [np.array(["x", "y", "x"]), np.array([b"x", b"z"]), np.empty((0, 3), dtype=object)]
    for _ in range(200):
        n = int(rng.integers(0, 40)) // 2 * 2
        cases.append(np.array([pool[i] for i in rng.integers(0, len(pool), n)], dtype=object).reshape(2, n // 2))
    for values in cases:
        labels, codes = label_codes(values)
        want_labels, want_codes = _label_codes_brute(values)
        assert labels == want_labels
        np.testing.assert_array_equal(codes, want_codes)
        assert codes.dtype == np.int64 and codes.shape == values.shape
