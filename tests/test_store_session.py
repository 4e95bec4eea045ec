"""One store handle per command: an analyze builds the same few zarr stores however many
batches it runs; the handle's locks live exactly as long as its ``with`` block."""

from __future__ import annotations

import subprocess
import sys

import pytest
import zarr

from attngeom.analyze import runner
from attngeom.api import analyze
from attngeom.extract.synthetic import write_synthetic_run


def _stores_built(monkeypatch, url: str, batch_tasks: int) -> int:
    built = []
    init = zarr.storage.LocalStore.__init__

    def counting(self, *args, **kwargs):
        built.append(args)
        init(self, *args, **kwargs)

    monkeypatch.setattr(runner, "BATCH_TASKS", batch_tasks)
    monkeypatch.setattr(zarr.storage.LocalStore, "__init__", counting)
    analyze(url, scheduler="threads", n_grid=[1, 2, 4], progress=False)
    monkeypatch.undo()
    return len(built)


def test_one_analyze_builds_the_same_few_stores_for_one_batch_or_four(tmp_path, monkeypatch):
    one, four = str(tmp_path / "one.zarr"), str(tmp_path / "four.zarr")
    for url in (one, four):
        write_synthetic_run(url, "r", n_seq=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    in_one = _stores_built(monkeypatch, one, batch_tasks=128)  # 64 sequences a batch
    in_four = _stores_built(monkeypatch, four, batch_tasks=2)  # 1 sequence a batch
    print(f"zarr stores built: {in_one} (1 batch), {in_four} (4 batches)")
    assert in_one == in_four <= 2


def _held(folder) -> bool:
    """Whether another process holds a lock on ``folder`` (an exclusive one cannot be taken)."""
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)")
    return subprocess.run([sys.executable, "-c", probe, str(folder)]).returncode == 3


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_the_sessions_locks_last_exactly_as_long_as_its_block(tmp_path):
    from attngeom.store.session import StoreSession

    url = tmp_path / "s.zarr"
    write_synthetic_run(str(url), "r", n_seq=1, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, length=4)
    with StoreSession(str(url), mode="a") as session:
        assert _held(url) and not _held(url / "runs" / "r")  # the writers' shared hold
        session.lock("r")
        assert _held(url / "runs" / "r")
    assert session.root is not None  # still referenced: nothing waits for garbage collection
    assert not _held(url) and not _held(url / "runs" / "r")


def test_analyze_says_what_it_will_recompute_before_it_starts(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", n_seq=3, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    analyze(url, scheduler="threads", n_grid=[1, 2], progress=False)
    capsys.readouterr()
    analyze(url, scheduler="threads", n_grid=[1, 4], progress=True)
    err = capsys.readouterr().err
    said = err.find("r: n grid 1,2 -> 1,4: recomputing all 3 sequences")
    assert 0 <= said < err.find("r: analyze"), err


def test_the_derived_write_refuses_its_verbs_out_of_order(tmp_path):
    from attngeom.store import ANALYSIS
    from attngeom.store.session import StoreSession

    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", n_seq=1, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, length=4)
    with StoreSession(url, mode="a") as session, session.derived("r", ANALYSIS) as write:
        for early in (lambda: write.append({}), lambda: write.finish({}), lambda: write.create({}, 1)):
            with pytest.raises(RuntimeError, match="not"):
                early()
        write.begin({"seed": 0}, [0], ("topn",), ("topn",))
        with pytest.raises(RuntimeError):
            write.begin({"seed": 0}, [0], ("topn",), ("topn",))
        with pytest.raises(RuntimeError):
            write.replace({}, {})
        with pytest.raises(RuntimeError):
            write.finish({})


def test_a_write_the_store_refuses_in_a_writing_session_is_one_line(tmp_path):
    """Inside a writing session's block (analyze, ablate and detect, their --out tables
    included) a full disk or read-only store is one StoreWriteError naming the store.
    extract's session (mode "c") creates nothing before its write begins and leaves what the
    store refuses to that write, which counts the sequences it kept."""
    import errno

    from attngeom.errors import StoreWriteError
    from attngeom.store.session import StoreSession

    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", n_seq=1, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    with pytest.raises(StoreWriteError) as raised, StoreSession(url, mode="a"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(raised.value) == f"the store {url} ran out of space; free space and run the command again"
    with pytest.raises(StoreWriteError, match="cannot be written"), StoreSession(url, mode="a"):
        raise OSError(errno.EROFS, "Read-only file system")

    new = tmp_path / "new.zarr"
    with pytest.raises(OSError) as raised, StoreSession(str(new), mode="c") as session:
        assert session.root is None and session.run_write("r").recorded() is None
        raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.type is OSError and not new.exists()


def test_a_second_creator_meets_the_first_ones_root_in_flight(tmp_path):
    """Two writers creating one local store: the second may look while zarr writes the
    first one's root metadata (``zarr.json.<id>.partial``, then renamed). That folder is a
    store being created, adopted; a folder holding anything else is refused."""
    from attngeom.errors import StoreWriteError
    from attngeom.store.holds.access import open_or_create_root

    path = tmp_path / "s.zarr"
    path.mkdir()
    (path / "zarr.json.0123abcd.partial").write_bytes(b"{")
    root = open_or_create_root(str(path))
    assert root.attrs["attngeom"]["schema_version"] >= 1
    del root
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(StoreWriteError, match="non-empty folder that is not a Zarr store"):
        open_or_create_root(str(other))
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_a_second_writer_in_one_process_leaves_the_first_ones_writes_in_flight(tmp_path):
    """A store opened for writing clears the leftovers of killed writes only when nothing
    else holds it, this process's other threads included: a ``*.partial`` object beside a
    live root is that writer's write in flight, renamed in a moment."""
    import gc

    from attngeom.store.holds.access import open_or_create_root, open_root

    url = str(tmp_path / "s.zarr")
    first = open_or_create_root(url)
    in_flight = tmp_path / "s.zarr" / "zarr.json.0123abcd.partial"
    in_flight.write_bytes(b"{}")
    second = open_root(url, mode="a")
    assert in_flight.exists()
    del first, second
    gc.collect()  # a root's hold ends with the root
    third = open_root(url, mode="a")
    assert not in_flight.exists()  # no writer left: a leftover, cleared
    del third
