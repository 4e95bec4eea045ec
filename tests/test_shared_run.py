"""One run written by several processes on a local disk (``--shard`` writers, torchrun ranks):
each writer's sequences land once, a killed one's are written by its resumption, and a
writer's checks and cleanup leave another writer's writes in flight alone."""

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
from stores import Run

from attngeom.store import open_root, open_run_group, run_ids, validate_store
from attngeom.store.objects import stored_objects
from attngeom.store.objects.stored_objects import chunk_objects
from attngeom.store.extracted.checks import check_run
from attngeom.extract.synthetic import write_synthetic_run

S = 10


def extract_cmd(model, corpus, store, *extra):
    return [sys.executable, "-m", "attngeom.cli", "extract", "--model", str(model), "--dataset", str(corpus),
            "-L", "16", "-S", str(S), "--store", str(store), "--run", "r", "--no-progress", *extra]


@pytest.fixture(scope="module")
def reference(extracted_store):
    """Run r of S sequences of the tiny llama at L = 16, extracted by one writer, in memory."""
    return xr.open_zarr(str(extracted_store(Run(sequences=S))), group="runs/r", consolidated=False).load()


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
