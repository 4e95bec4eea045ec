"""Who writes a run: the writer lock of a run on a local disk, and the live holder of a run
(its lock, or its lease on an object store) as a reader sees it.

On a local disk a run's writer holds an advisory lock (``flock``) on the run's folder, gone
when its process ends, and names itself in ``leases/<run_id>.json`` (host, pid, command,
since), as a lease does on an object store: a writer waiting for the lock, and a reader
finding the run's results unfinished, say whom they wait for. The file is only believed
while the lock is held: one left by a killed writer names no one, and the run's next writer
replaces it and removes it (and the folder, when it holds no other) when done.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import zarr

from attngeom.store.holds.lease import LEASES, current_lease
from attngeom.store.objects.schema import run_path

try:
    import fcntl
except ImportError:  # no flock (Windows): local runs are not locked there
    fcntl = None

__all__ = ["RunLock", "holder_words", "live_holder", "wait_for_writer"]

# How often a writer waiting for a local lock looks again (and sees a new holder).
_POLL_SECONDS = 0.2


def holder_words(run_id: str, body: dict[str, Any]) -> str:
    """'the analyze of run r held by host:pid since ...': a run's holder, in words."""
    return (f"the {body.get('command', 'writer')} of run {run_id} held by {body.get('host', '?')}:"
            f"{body.get('pid', '?')} since {body.get('since', '?')}")


class RunLock:
    """The writer lock of the run ``run_id`` of the local store at ``folder``, held for
    ``what`` (the command) from :meth:`acquire` to :meth:`release`. ``part``: a lock of the
    run's array of that name instead of the run's own, one writer kind's apart from the
    other's (extract's appends lock ``complete``, not the derived writers' run lock)."""

    def __init__(self, folder: Path, run_id: str, what: str, part: str | None = None) -> None:
        self.folder, self.run_id = folder, run_id
        self.target = folder / run_path(run_id) / (part or "")
        self.path = folder / LEASES / (f"{run_id}.json" if part is None else f"{run_id}.{part}.json")
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "command": what}
        self.fd: int | None = None

    @classmethod
    def creating(cls, folder: Path, run_id: str, what: str) -> RunLock:
        """The lock of the store's ``runs`` folder, which a writer creating the run ``run_id``
        holds until the run's own folder exists and can be locked: two creators of one run
        then take turns, the second appending to what the first created. Creators of other
        runs of the store wait for it too, named by the run they create."""
        lock = cls(folder, run_id, what)
        lock.target, lock.path = folder / "runs", folder / LEASES / "runs.json"
        lock.holder["run"] = run_id
        return lock

    def acquire(self) -> None:
        """Wait until the run's lock is this writer's, saying once per holder whom it waits
        for, then name this writer as its holder."""
        self.fd = os.open(self.target, os.O_RDONLY)
        if fcntl is None:
            return
        told = None
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                body = _read(self.path)
                if told != body:
                    told = body
                    print(f"attngeom: waiting for {holder_words(body.get('run', self.run_id), body)}",
                          file=sys.stderr, flush=True)
                time.sleep(_POLL_SECONDS)
        since = datetime.now(UTC).isoformat(timespec="seconds")
        while True:
            try:
                self.path.write_text(json.dumps({**self.holder, "since": since}))
                break
            except FileNotFoundError:  # no folder yet, or another run's writer just removed it
                self.path.parent.mkdir(exist_ok=True)

    def release(self) -> None:
        """Remove this writer's name and end the hold."""
        if self.fd is None:
            return
        if fcntl is not None and _read(self.path).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
            try:
                self.path.parent.rmdir()  # the store as it was, unless another run is held
            except OSError:
                pass
        os.close(self.fd)  # closing releases the lock
        self.fd = None


def _read(path: Path) -> dict[str, Any]:
    """The holder a lock file names; empty when there is none (or it was cut short)."""
    try:
        body = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def live_holder(zstore: Any, run_id: str) -> dict[str, Any] | None:
    """The holder of the run's lock (or lease) while another process holds it: host, pid,
    command, since (any unknown left out); None when no live writer holds the run, or this
    process does."""
    if not isinstance(zstore, zarr.storage.LocalStore):
        body = current_lease(zstore, run_id)
        return None if body is None or _own(body) else body
    if fcntl is None:
        return None
    folder = Path(str(zstore.root))
    try:
        fd = os.open(folder / run_path(run_id), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # A shared hold is refused only while a writer holds the lock; taken, it is let go at once.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        body = _read(folder / LEASES / f"{run_id}.json")
        return None if _own(body) else body
    finally:
        os.close(fd)
    return None


def _own(body: dict[str, Any]) -> bool:
    """Whether a holder is this process (which reads what it writes itself as it goes)."""
    return body.get("pid") == os.getpid() and body.get("host") == socket.gethostname()


def wait_for_writer(zstore: Any, run_id: str) -> None:
    """Wait while a live writer holds the run, saying once per holder whom it waits for."""
    told = None
    while (body := live_holder(zstore, run_id)) is not None:
        if told != body:
            told = body
            print(f"attngeom: waiting for {holder_words(run_id, body)}", file=sys.stderr, flush=True)
        time.sleep(_POLL_SECONDS)
