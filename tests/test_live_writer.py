"""A live writer told apart from a dead one. A process holding a run's lock (on a local
disk, flock on the run's folder) is at work, even stopped (SIGSTOP): readers needing its
result say "in progress" and name it (ablate waits for it, naming it), a writer waiting for
the lock names it; once it is gone (killed), the same readers say "interrupted", with the
command, parameters included, that finishes the work, and that command ends with a store
equal to an undisturbed one."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import attngeom as ag
from attngeom.errors import InProgressError
from damage import assert_same_tree, one_error, run, validate

A = "runs/r/analysis"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}

# Holds run r of the store argv[1] as the command argv[2] until its stdin closes.
HOLDER = """
import sys
from attngeom.store.session import StoreSession
with StoreSession(sys.argv[1], mode="a") as session:
    session.lock("r", sys.argv[2])
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def store(ablated_store) -> Path:
    return ablated_store


def hold(store: Path, command: str) -> subprocess.Popen:
    """A process holding run r as ``command``, once it says so."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store), command], env=ENV, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == "held\n"
    return holder


def withdraw_analysis(store: Path) -> bytes:
    """The analysis record as a first analyze leaves it while at work (an update recorded,
    no commit); the record as it was."""
    path = store / A / "zarr.json"
    original = path.read_bytes()
    document = json.loads(original)
    record = document["attributes"]["attngeom"]
    record["pending"] = {"parameters": record.pop("commit")["parameters"], "sequences": [], "staged": False,
                         "promoting": []}
    path.write_text(json.dumps(document))
    return original


def lines_of(stream) -> queue.Queue:
    """The lines of ``stream``, read beside the test as they come."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def waiting_line(lines: queue.Queue) -> str:
    """The first line saying whom the process waits for (timeout: a hang, not a timing)."""
    while (line := lines.get(timeout=300)) is not None:
        if line.startswith("attngeom: waiting for "):
            return line.strip()
    raise AssertionError("the process ended without waiting")


def held_by(command: str, pid: int) -> str:
    return f"the {command} of run r held by {socket.gethostname()}:{pid} since "


def test_a_stopped_writer_is_in_progress_and_a_killed_one_interrupted(store, ablated_store_source, tmp_path):
    url = str(store)
    withdraw_analysis(store)
    holder = hold(store, "analyze")
    try:
        os.kill(holder.pid, signal.SIGSTOP)  # a long analyze, as readers see it: the lock held, nothing written
        in_progress = f"analysis of run r is in progress: {held_by('analyze', holder.pid)}"
        line = one_error("report", "--store", url, "--out", str(tmp_path / "page"))
        assert line.startswith(f"attngeom: error: {in_progress}") and "interrupted" not in line.replace(
            "it is not interrupted", ""), line
        assert any(p.startswith(in_progress) for p in validate(store))
        with pytest.raises(InProgressError, match="in progress"):
            ag.open_store(url).run("r").analysis("heads")
    finally:
        holder.kill()  # kill -9: its name stays in leases/, the lock goes with it
        holder.wait()
    assert (store / "leases/r.json").is_file()
    interrupted = (f"analysis of run r is incomplete (interrupted analyze); "
                   f"re-run `attngeom analyze --store {url} --run r --n-grid 1,2,4 --seed 0`")
    assert one_error("report", "--store", url, "--out", str(tmp_path / "page")) == f"attngeom: error: {interrupted}"
    assert interrupted in validate(store)
    hint = interrupted.split("`")[1]
    code, lines = run(*shlex.split(hint)[1:], "--scheduler", "threads", "--no-progress")
    assert code == 0, lines
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)  # the dead writer's name removed too


def test_a_writer_waiting_for_a_local_lock_names_its_holder(store, ablated_store_source):
    holder = hold(store, "detect")
    analyze = subprocess.Popen(
        [sys.executable, "-m", "attngeom.cli", "analyze", "--store", str(store), "--n-grid", "1,2,4",
         "--scheduler", "threads", "--no-progress"], env=ENV, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        line = waiting_line(lines_of(analyze.stderr))
        assert line.startswith(f"attngeom: waiting for {held_by('detect', holder.pid)}"), line
        holder.stdin.close()
        holder.wait()
        out = analyze.stdout.read()
        assert analyze.wait() == 0 and "run r: 0 new sequences" in out, out
    finally:
        holder.kill()
        analyze.kill()
    assert_same_tree(store, ablated_store_source)


def test_ablate_waits_for_an_analyze_at_work_and_reads_what_it_commits(store, ablated_store_source):
    """Its type-guided sweep needs the analysis: ablate waits, naming the analyze, rather
    than calling it interrupted or going on without it."""
    original = withdraw_analysis(store)
    holder = hold(store, "analyze")
    ablate = subprocess.Popen(
        [sys.executable, "-m", "attngeom.cli", "ablate", "--store", str(store), "--run", "r", "--device", "cpu",
         "--random-masks", "2", "--retention", "1.0,0.5", "--no-progress"], env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = waiting_line(lines_of(ablate.stderr))
        assert line.startswith(f"attngeom: waiting for {held_by('analyze', holder.pid)}"), line
        (store / A / "zarr.json").write_bytes(original)  # the analyze commits, then lets the run go
        holder.stdin.close()
        holder.wait()
        out = ablate.stdout.read()
        assert ablate.wait() == 0 and "skipped" not in out, out
    finally:
        holder.kill()
        ablate.kill()
    assert_same_tree(store, ablated_store_source)
