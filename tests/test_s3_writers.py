"""Writers of one run on an object store (moto's S3 server on loopback): the run's lease
serializes analyzes, an extract appends beside an analyze, a killed analyze's lease is taken
over once expired, and one stopped until another took its lease over and committed fails at
its next record write, having changed nothing committed; each store ends valid and equal,
object for object, to a serial run's (a derived group's objects in the generation folder
its record names)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import xarray as xr
from conftest import ABLATED_SEQUENCES, extract, moto_s3

from attngeom.api import analyze, open_store
from attngeom.errors import InputError, StoreWriteError
from attngeom.extract.request import ExtractRequest
from attngeom.store import DERIVED, validate_store, zarr_store
from attngeom.store.derived_groups.derived import DerivedWrite
from attngeom.store.holds.lease import Lease, lease_seconds
from attngeom.extract.synthetic import write_synthetic_run

S = ABLATED_SEQUENCES
ANALYSIS_GROUPS = ("topn", "values", "taxonomy", "heads", "summary", "signatures", "table")
LEASE = "10"  # seconds: a killed writer's run is taken over that long after its last renewal


@pytest.fixture(scope="module")
def s3_env():
    """moto's S3 server on loopback and the environment that points s3fs (here and in
    subprocesses) at it, with short leases."""
    with moto_s3(ATTNGEOM_LEASE_SECONDS=LEASE):
        yield {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}


def s3_fs():
    return fsspec.filesystem("s3", skip_instance_cache=True)


@pytest.fixture
def s3_store(s3_env, ablated_store_source) -> str:
    """A copy of `ablated_store_source` in the bucket, of the test's own."""
    url = f"s3://attngeom/{uuid.uuid4().hex}.zarr"
    s3_fs().put(f"{ablated_store_source}/", url.removeprefix("s3://"), recursive=True)
    return url


@pytest.fixture(scope="module")
def analyzed_reference(ablated_store_source, tmp_path_factory) -> Path:
    """A local copy of `ablated_store_source` analyzed serially with n grid 1, 4: what each
    store on S3 analyzed so must equal, object for object. The tests only read it."""
    reference = local_copy(ablated_store_source, tmp_path_factory.mktemp("reference") / "reference.zarr")
    analyze(str(reference), scheduler="threads", n_grid=[1, 4], progress=False)
    return reference


def downloaded(url: str, folder: Path) -> Path:
    s3_fs().get(url.removeprefix("s3://") + "/", str(folder), recursive=True)
    return folder


def assert_same_objects(url: str, reference: Path, folder: Path) -> None:
    """The store at ``url`` holds the objects of the local ``reference``, byte for byte: its
    run arrays as they are, each derived group's in the generation its record names, and
    nothing else there; records equal but for the generation and writer they name. (The
    root's consolidated copy names the generations, and is left out.)"""
    got = downloaded(url, folder)

    def objects(root: Path) -> dict[str, bytes]:
        files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        out = {}
        for key, data in sorted(files.items()):
            parts = key.split("/")
            if key == "zarr.json":
                continue
            if len(parts) == 4 and parts[0] == "runs" and parts[2] in DERIVED and parts[3] == "zarr.json":
                record = json.loads(data)["attributes"]["attngeom"]
                record.pop("writer", None)
                generation = record["commit"].pop("generation", "")
                data = json.dumps(record, sort_keys=True).encode()
                kept = f"runs/{parts[1]}/{parts[2]}/{generation}/" if generation else None
                out.update({f"runs/{parts[1]}/{parts[2]}/{k[len(kept):]}": v for k, v in files.items()
                            if kept and k.startswith(kept) and k != f"{kept}zarr.json"})
            elif len(parts) > 4 and parts[0] == "runs" and parts[2] in DERIVED and parts[3].startswith("gen-"):
                continue
            out[key] = data
        return out

    mine, theirs = objects(got), objects(reference)
    assert sorted(mine) == sorted(theirs)
    assert [key for key in mine if mine[key] != theirs[key]] == []


def generations(url: str, kind: str = "analysis") -> list[str]:
    """The generation folders of the run ``r``'s ``kind``, as the bucket lists them."""
    return sorted(p.rsplit("/", 1)[-1] for p in s3_fs().ls(f"{url.removeprefix('s3://')}/runs/r/{kind}", refresh=True)
                  if p.rsplit("/", 1)[-1].startswith("gen-"))


def local_copy(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    return folder


def analyze_cmd(url: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "attngeom.cli", "analyze", "--store", url, "--scheduler", "threads",
            "--no-progress", *flags]


def test_lease_seconds_come_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.setenv("ATTNGEOM_LEASE_SECONDS", "7.5")
    assert lease_seconds() == 7.5 and lease_seconds(3) == 3.0
    monkeypatch.delenv("ATTNGEOM_LEASE_SECONDS")
    assert lease_seconds() == 60.0
    for bad in ("soon", "0"):
        monkeypatch.setenv("ATTNGEOM_LEASE_SECONDS", bad)
        with pytest.raises(InputError, match="ATTNGEOM_LEASE_SECONDS|positive"):
            lease_seconds()


def test_an_expired_lease_goes_to_one_writer_at_a_time(s3_env, capsys):
    """Writers racing for a lease its killed holder left: each holds it alone, in turn."""
    zstore = zarr_store(f"s3://attngeom/{uuid.uuid4().hex}.zarr", read_only=False)
    dead = Lease(zstore, "r", "analyze", 0.5)
    dead.acquire()
    dead._stop.set()  # its holder killed: never renewed, never released
    held: list[tuple[float, float]] = []

    def write() -> None:
        lease = Lease(zstore, "r", "analyze", 1.0)
        lease.acquire()
        start = time.monotonic()
        time.sleep(0.3)
        held.append((start, time.monotonic()))
        lease.release()
        assert lease.lost is None

    writers = [threading.Thread(target=write) for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    held.sort()
    assert len(held) == 3 and all(a[1] <= b[0] for a, b in itertools.pairwise(held))
    assert "waiting for the analyze of run r held by" in capsys.readouterr().err
    assert not s3_fs().exists(f"{zstore.path}/leases/r.json")


def test_two_analyzes_of_a_run_on_s3_run_one_after_the_other(s3_store, s3_env, analyzed_reference, tmp_path):
    both = [subprocess.Popen(analyze_cmd(s3_store, "--n-grid", "1,4"), env=s3_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in both]
    assert [p.returncode for p in both] == [0, 0], outputs
    # One recomputed every sequence; the other, waiting meanwhile, found the analysis up to date.
    assert sorted(out.split(" new sequences")[0].rsplit(" ", 1)[-1] for out, _ in outputs) == ["0", str(S)], outputs
    assert validate_store(s3_store, deep=True) == []
    assert_same_objects(s3_store, analyzed_reference, tmp_path / "s3.zarr")


def test_an_extract_appending_during_an_analyze_on_s3_ends_valid(s3_store, s3_env, ablated_store_source, tiny_model_dir,
                                                                 word_corpus, tmp_path):
    def append(url: str) -> None:
        extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                               num_sequences=S + 2, store=url, run_id="r", progress=False))

    reference = local_copy(ablated_store_source, tmp_path / "reference.zarr")
    append(str(reference))
    analyze(str(reference), scheduler="threads", n_grid=[1, 2, 4], progress=False)

    busy = subprocess.Popen(analyze_cmd(s3_store, "--n-grid", "1,4"), env=s3_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    append(s3_store)
    out, err = busy.communicate(timeout=600)
    assert busy.returncode == 0, (out, err)
    assert validate_store(s3_store, deep=True) == []
    analyze(s3_store, scheduler="threads", n_grid=[1, 2, 4], progress=False)  # what the reference ran last
    assert validate_store(s3_store, deep=True) == []
    # The same values; the analysis's chunks follow the batches it was written in.
    got, want = open_store(s3_store).run("r"), open_store(str(reference)).run("r")
    xr.testing.assert_identical(got.dataset().load(), want.dataset().load())
    for name in ANALYSIS_GROUPS:
        xr.testing.assert_identical(got.analysis(name).load(), want.analysis(name).load())


def test_a_killed_analyze_on_s3_is_taken_over_after_its_lease_and_rerun_to_the_same_store(
        s3_store, s3_env, analyzed_reference, tmp_path, capsys):
    fs, base = s3_fs(), s3_store.removeprefix("s3://")
    # A lease long enough that the rerun meets it unexpired, and waits.
    victim = subprocess.Popen(analyze_cmd(s3_store, "--n-grid", "1,4"), env={**s3_env, "ATTNGEOM_LEASE_SECONDS": "15"},
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    record = f"{base}/runs/r/analysis/zarr.json"
    deadline = time.monotonic() + 300
    # Killed mid-update: its lease held, its record saying an update is under way.
    while "pending" not in json.loads(fs.cat_file(record))["attributes"]["attngeom"]:
        assert victim.poll() is None and time.monotonic() < deadline, victim.communicate()
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    lease = json.loads(fs.cat_file(f"{base}/leases/r.json"))
    assert lease["command"] == "analyze" and lease["pid"] == victim.pid

    analyze(s3_store, scheduler="threads", n_grid=[1, 4], progress=False)
    assert f"waiting for the analyze of run r held by {lease['host']}:{victim.pid} since {lease['since']}" in (
        capsys.readouterr().err)
    assert validate_store(s3_store, deep=True) == []
    assert_same_objects(s3_store, analyzed_reference, tmp_path / "s3.zarr")


@pytest.mark.parametrize("scheme", ["s3://attngeom", "memory://attngeom"])
def test_a_held_object_is_written_only_while_it_is_the_version_its_writer_last_saw(s3_env, scheme):
    """Two writers of one record: each write is conditional on the version its writer last
    read or wrote, so a writer that missed the other's write fails and writes nothing."""
    zstore = zarr_store(f"{scheme}/{uuid.uuid4().hex}.zarr", read_only=False)
    first, second = (Lease(zstore, "r", "analyze", 60.0).held_object("runs/r/analysis/zarr.json") for _ in range(2))
    assert first.read() is None and second.read() is None
    first.write(b'{"writer": 1}')
    with pytest.raises(StoreWriteError, match="^the analyze of run r lost its hold: another writer took the run over"):
        second.write(b'{"writer": 2}')  # created meanwhile
    assert second.read() == b'{"writer": 1}'
    second.write(b'{"writer": 2}')
    with pytest.raises(StoreWriteError, match="lost its hold"):
        first.write(b'{"writer": 1, "again": true}')
    assert first.read() == b'{"writer": 2}'


# Runs the command of its arguments (``python -c STOPPED_AT_FIRST_TOPN_CHUNK analyze ...``)
# stopping its own process (SIGSTOP: every thread, its lease's renewals too, as a machine
# asleep) as it begins the write of its first chunk of analysis/topn.
STOPPED_AT_FIRST_TOPN_CHUNK = """
import os, re, signal
import s3fs
put, stopped = s3fs.S3FileSystem._pipe_file, []
async def pipe_file(self, path, data, *args, **kwargs):
    if not stopped and re.search(r"/analysis/gen-[0-9a-f]+/topn/[^/]+/c[.]", path):
        stopped.append(path)
        os.kill(os.getpid(), signal.SIGSTOP)
    return await put(self, path, data, *args, **kwargs)
s3fs.S3FileSystem._pipe_file = pipe_file
from attngeom.cli import main
main()
"""


def test_a_writer_whose_lease_was_taken_over_changes_nothing_committed(s3_store, s3_env, analyzed_reference, tmp_path,
                                                                        monkeypatch):
    """An analyze (seed 1) stopped at its first topn chunk; another takes its lease over once
    expired and commits; the first, resumed, fails in one line at its next record write. What
    it wrote lies in its own generation, which no record names: the commit equals an
    undisturbed analyze's, object for object, validate --deep passes, and the next writer
    removes the stale one's objects."""
    monkeypatch.setenv("ATTNGEOM_LEASE_SECONDS", "2")
    stale = subprocess.Popen([sys.executable, "-c", STOPPED_AT_FIRST_TOPN_CHUNK, *analyze_cmd(s3_store, "--seed", "1")[3:]],
                             env={**s3_env, "ATTNGEOM_LEASE_SECONDS": "2"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    _, status = os.waitpid(stale.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), stale.communicate()
    try:
        analyze(s3_store, scheduler="threads", n_grid=[1, 4], progress=False)  # takes the lease over
        assert_same_objects(s3_store, analyzed_reference, tmp_path / "committed")
    finally:
        stale.send_signal(signal.SIGCONT)
    _, err = stale.communicate(timeout=600)
    lines = err.strip().splitlines()
    assert stale.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("attngeom: error: ") and "another writer" in lines[0], lines
    # Its stopped write landed, in a generation no record names.
    committed = json.loads(s3_fs().cat_file(f"{s3_store.removeprefix('s3://')}/runs/r/analysis/zarr.json"))
    committed = committed["attributes"]["attngeom"]["commit"]["generation"]
    assert len(generations(s3_store)) == 2 and committed in generations(s3_store)
    assert validate_store(s3_store, deep=True) == []
    assert_same_objects(s3_store, analyzed_reference, tmp_path / "resumed")

    analyze(s3_store, scheduler="threads", n_grid=[1, 4], progress=False)  # up to date: removes it
    assert generations(s3_store) == [committed]
    assert validate_store(s3_store, deep=True) == []
    assert_same_objects(s3_store, analyzed_reference, tmp_path / "next")


def test_a_writer_stalled_after_its_commit_removes_nothing_a_later_writer_committed(tmp_path, monkeypatch):
    """What a writer removes after its commit was listed before its first record write: one
    that sleeps past its lease between its commit and that removal, while another analyze
    takes the run over and commits, removes nothing of the later commit."""
    local = tmp_path / "s.zarr"
    write_synthetic_run(str(local), "r", n_seq=2, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=16)
    url = f"memory://attngeom-{uuid.uuid4().hex}/s.zarr"
    fsspec.filesystem("memory").put(str(local), url.removeprefix("memory://"), recursive=True)
    analyze(url, scheduler="threads", n_grid=[1, 2], progress=False)
    remove = DerivedWrite._remove_garbage

    def asleep_first(write, keep):
        monkeypatch.setattr(DerivedWrite, "_remove_garbage", remove)
        lease = write.session._leases["r"]
        lease._stop.set()
        lease._thread.join()
        lease.fs.pipe_file(lease.path, b'{"host": "asleep", "pid": 0, "expires": 0}')
        analyze(url, scheduler="threads", n_grid=[1, 4], progress=False)
        remove(write, keep)

    monkeypatch.setattr(DerivedWrite, "_remove_garbage", asleep_first)
    analyze(url, scheduler="threads", n_grid=[1, 2, 4], progress=False)
    assert validate_store(url, deep=True) == []
    analyze(str(local), scheduler="threads", n_grid=[1, 4], progress=False)
    got, want = open_store(url).run("r"), open_store(str(local)).run("r")
    for name in ANALYSIS_GROUPS:
        xr.testing.assert_identical(got.analysis(name).load(), want.analysis(name).load())


def test_a_commands_object_store_keeps_what_it_read_never_an_absence():
    """A cached store answers a second read of metadata from what it read or wrote, forgets
    what it removes, and reads again what it found absent (a peer may create it)."""
    from zarr.core.buffer import default_buffer_prototype

    from attngeom.store.objects._zarr import sync
    from attngeom.store.objects.cache import cached, uncached

    url = f"memory://attngeom-{uuid.uuid4().hex}/s.zarr"
    mine, peer = cached(zarr_store(url, read_only=False)), zarr_store(url, read_only=False)
    assert uncached(mine) is not mine and cached(uncached(mine)) is not mine

    def get(store, key):
        value = sync(store.get(key, prototype=default_buffer_prototype()))
        return None if value is None else value.to_bytes()

    def put(store, key, value):
        sync(store.set(key, default_buffer_prototype().buffer.from_bytes(value)))

    assert get(mine, "a/zarr.json") is None
    put(peer, "a/zarr.json", b"1")
    assert get(mine, "a/zarr.json") == b"1"  # absence was not kept
    put(peer, "a/zarr.json", b"2")
    assert get(mine, "a/zarr.json") == b"1" and get(uncached(mine), "a/zarr.json") == b"2"
    put(mine, "a/zarr.json", b"3")
    assert get(mine, "a/zarr.json") == b"3"
    put(peer, "a/zarr.json", b"4")
    sync(mine.delete_dir("a"))
    assert get(mine, "a/zarr.json") is None
    put(peer, "a/c/0", b"x" * 10)
    assert get(mine, "a/c/0") == b"x" * 10
    put(mine, "a/c/0", b"y")
    assert get(mine, "a/c/0") == b"y"  # its own write is never hidden by what it read before
