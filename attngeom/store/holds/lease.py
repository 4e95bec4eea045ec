"""A run's writer lease on an object store: the ``flock`` of a store without files.

A lease is one small object, ``leases/<run_id>.json`` under the store's root, naming its
holder (a token, host, pid, the command) and when it expires. It is created only where it
is absent (S3's ``If-None-Match: *``, fsspec's ``mode="create"``), renewed by a background
thread before it expires, and removed when its holder is done. A writer that finds it held
waits, saying so once; a lease past its expiry (its holder killed) is taken over. Where the
store replaces an object only if it is still the one read (S3's ``If-Match``), a takeover and
each renewal are such conditional replaces, so two writers never both hold it; elsewhere
(``memory://`` and other fsspec stores) the expired lease is removed, created again and read
back, and each renewal first reads that the lease is still its holder's.

The lease lasts ``ATTNGEOM_LEASE_SECONDS`` seconds (default 60): a killed writer's run is
taken over that long after its last renewal. Renewals come every third of it, and a writer
that must not write once its hold is gone renews it itself before such a write
(:meth:`Lease.confirm`): stopped past its expiry, it finds the lease taken over and stops.
A waiting writer says at once whom it waits for and when that lease ends unless renewed.

A lease orders writers; it cannot stop one whose lease ended without its knowledge (a
machine asleep) from writing on. What fences such a writer is :class:`HeldObject`: a small
object (a commit record) that its writer replaces only while it is still the version that
writer last read or wrote, by one conditional write.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from attngeom.errors import InputError, StoreWriteError
from attngeom.store.objects._zarr import sync
from attngeom.store.objects.network import network_failure

__all__ = ["LEASES", "HeldObject", "Lease", "current_lease", "lease_seconds"]

# The folder of the leases, under the store's root: no Zarr node, so no reader lists it.
LEASES = "leases"

_DEFAULT_SECONDS = 60.0


def lease_seconds(seconds: float | None = None) -> float:
    """How long a lease lasts: ``seconds`` if given, else ``ATTNGEOM_LEASE_SECONDS``, else 60."""
    if seconds is None:
        raw = os.environ.get("ATTNGEOM_LEASE_SECONDS")
        if raw is None:
            return _DEFAULT_SECONDS
        try:
            seconds = float(raw)
        except ValueError:
            raise InputError(f"ATTNGEOM_LEASE_SECONDS={raw!r} is not a number of seconds") from None
    if not seconds > 0:
        raise InputError(f"a lease must last a positive number of seconds, not {seconds}")
    return float(seconds)


class Lease:
    """The lease of the run ``run_id`` in the fsspec store ``zstore`` (a zarr ``FsspecStore``),
    held for ``what`` (the command, in the message a waiting writer prints) from
    :meth:`acquire` to :meth:`release`, each lasting ``seconds`` unless renewed. ``part``: a
    lease of the run's array of that name instead of the run's own, as
    :class:`~attngeom.store.holds.locks.RunLock` (extract's appends hold ``complete``)."""

    def __init__(self, zstore: Any, run_id: str, what: str, seconds: float, part: str | None = None) -> None:
        self.fs, self.run_id, self.seconds = _own_filesystem(zstore.fs), run_id, seconds
        self.path = f"{zstore.path.rstrip('/')}/{LEASES}/{run_id if part is None else f'{run_id}.{part}'}.json"
        self.token = uuid.uuid4().hex
        self.holder = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "command": what}
        # An S3 store replaces an object only if its ETag is still the one read (If-Match).
        self._conditional = hasattr(self.fs, "_call_s3")
        self._etag: str | None = None
        self._stop = threading.Event()
        # One renewal at a time: each replaces the lease read by the one before (its ETag).
        self._renewing = threading.Lock()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    def acquire(self) -> None:
        """Wait until the lease is this writer's, then renew it in the background."""
        told = None
        while True:
            self.holder.pop("since", None)  # held since it is created, not since the first try
            if self._create():
                break
            current = self._read()
            if current is None:  # released between the attempt and the read
                continue
            body, etag = current
            if _expires(body) <= time.time() and self._take_over(etag):
                break
            held = f"{body.get('host')}:{body.get('pid')}"
            if told != (held, body.get("since")):
                told = (held, body.get("since"))
                # Said before the first wait: a dead holder's lease keeps a writer waiting its whole term.
                print(f"attngeom: waiting for the {body.get('command', 'writer')} of run {self.run_id} held by "
                      f"{held} since {body.get('since')} (its lease ends at {_clock(_expires(body))} unless "
                      "renewed)", file=sys.stderr, flush=True)
            time.sleep(min(max(_expires(body) - time.time(), 0.05), self.seconds / 6, 2.0) + 0.05)
        self._thread = threading.Thread(target=self._renew_loop, name=f"attngeom-lease-{self.run_id}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this writer's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            current = self._read()
            if current is not None and current[0].get("token") == self.token:
                self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass
        except Exception as exc:
            if network_failure(exc) is None:
                raise
            # The store unreachable: the lease ends at its expiry, and the writer's own error says why.

    def check(self) -> None:
        """:class:`StoreWriteError` if the lease was lost (not renewed in time, taken over)."""
        if self.lost:
            raise StoreWriteError(self.lost)

    def held_object(self, key: str) -> HeldObject:
        """The object ``key`` (below the store's root) as this lease's writer replaces it:
        only while it is still the version the writer last read or wrote."""
        return HeldObject(self.fs, f"{self.path.rsplit(f'/{LEASES}/', 1)[0]}/{key}", key, self)

    def confirm(self) -> None:
        """Renew the lease now, if it is still this writer's, else :class:`StoreWriteError`: the
        fence a writer passes before each write into what others read. A writer stopped past
        its expiry (its machine asleep) finds it taken over and writes nothing more; one that
        passes holds it for ``seconds`` more."""
        self.check()
        with self._renewing:
            if not self._renew():
                self.lost = self._taken_over()
        self.check()

    def _body(self) -> bytes:
        now = time.time()
        since = self.holder.setdefault("since", datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"))
        return json.dumps({**self.holder, "since": since, "expires": now + self.seconds}).encode()

    def _create(self) -> bool:
        written, self._etag = _put_if(self.fs, self.path, self._body(), None)
        return written and (self._conditional or self._mine())

    def _take_over(self, etag: str | None) -> bool:
        if self._conditional:
            return self._replace(etag)
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass
        return self._create()

    def _replace(self, etag: str | None) -> bool:
        """Write a renewed lease over the one whose ETag is ``etag``; False if it changed."""
        written, new = _put_if(self.fs, self.path, self._body(), etag)
        if written:
            self._etag = new
        return written

    def _renew(self) -> bool:
        if self._conditional:
            return self._replace(self._etag)
        if not self._mine():
            return False
        self.fs.pipe_file(self.path, self._body())
        return True

    def _renew_loop(self) -> None:
        renewed = time.time()
        while not self._stop.wait(self.seconds / 3):
            try:
                with self._renewing:
                    if not self._renew():
                        self.lost = self._taken_over()
                        return
                renewed = time.time()
            except Exception as exc:
                # The store unreachable for a moment (botocore's connection errors are no
                # OSError): tried again at the next renewal.
                if not isinstance(exc, OSError) and network_failure(exc) is None:
                    raise
                if time.time() - renewed > self.seconds:
                    self.lost = f"the lease of run {self.run_id} could not be renewed ({exc}); run the command again"
                    return

    def _taken_over(self) -> str:
        return (f"the lease of run {self.run_id} ({self.path}) was taken over by another writer: it was not "
                f"renewed within {self.seconds:g} s; run the command again")

    def _mine(self) -> bool:
        current = self._read()
        return current is not None and current[0].get("token") == self.token

    def _read(self) -> tuple[dict[str, Any], str | None] | None:
        """The lease's body and ETag (read before the body, so a replace conditional on it
        fails if the body read is not the one it names); None if there is none."""
        try:
            etag = self.fs.info(self.path, refresh=True).get("ETag") if self._conditional else None
            body = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # a lease cut short: treated as expired
            body = {}
        return (body if isinstance(body, dict) else {}), etag


def _put_if(fs: Any, path: str, data: bytes, etag: str | None) -> tuple[bool, str | None]:
    """``data`` written at ``path`` in one conditional request: where ``etag`` is None only if
    nothing is there (S3's ``If-None-Match: *``, fsspec's ``mode="create"``), else only over the
    version whose ETag it is (``If-Match``). Whether it was written, and the ETag of what was
    (None where the store names none)."""
    try:
        out = fs.pipe_file(path, data, mode="create") if etag is None else fs.pipe_file(path, data, IfMatch=etag)
    except (FileExistsError, FileNotFoundError):
        return False, None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # s3fs's 412 Precondition Failed
            return False, None
        raise
    return True, out.get("ETag") if isinstance(out, dict) else None


class HeldObject:
    """The small object at ``path`` of the file system ``fs`` (``key``: its key below the
    store's root, in messages), written by the holder of ``lease`` only while it is still the
    version that writer last read or wrote: the fencing of a writer whose lease ended without
    its knowledge.

    On S3 each write is one conditional request (``If-Match`` the ETag last seen, or
    ``If-None-Match: *`` where the object was absent), so that between a check and the write
    no other writer's version can land and be overwritten. Any other fsspec store (no
    conditional replace: ``memory://``) compares the object with the version last seen first,
    a check then a write. The body of every write must differ from any other writer's (it
    names its writer): S3's ETag is the MD5 of the bytes, and two writers' equal bytes would
    look like one version."""

    def __init__(self, fs: Any, path: str, key: str, lease: Lease) -> None:
        self.fs, self.path, self.key, self.lease = fs, path, key, lease
        self._conditional = hasattr(fs, "_call_s3")
        self._etag: str | None = None
        self._seen: bytes | None = None

    def read(self) -> bytes | None:
        """The object's bytes (None if absent), its version remembered for the next write
        (the ETag read first, so that a write conditional on it fails if the bytes read are
        not the version it names)."""
        try:
            etag = self.fs.info(self.path, refresh=True).get("ETag") if self._conditional else None
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            etag, data = None, None
        self._etag, self._seen = etag, data
        return data

    def write(self, data: bytes) -> None:
        """Replace the object by ``data`` if it is still the version last read or written;
        else :class:`StoreWriteError` (the writer lost its hold), writing
        nothing."""
        self.lease.check()
        if self._conditional:
            written, self._etag = _put_if(self.fs, self.path, data, None if self._seen is None else self._etag)
            if not written:
                raise self._lost()
        else:
            try:
                current = self.fs.cat_file(self.path)
            except FileNotFoundError:
                current = None
            if current != self._seen:
                raise self._lost()
            self.fs.pipe_file(self.path, data)
        self._seen = data

    def unchanged(self) -> bool:
        """Whether the object is still the version last read or written (one request): a
        check, for what may follow it unfenced."""
        try:
            if self._conditional:
                return self.fs.info(self.path, refresh=True).get("ETag") == self._etag
            return self.fs.cat_file(self.path) == self._seen
        except FileNotFoundError:
            return self._seen is None

    def require_unchanged(self) -> None:
        """:class:`StoreWriteError` (the writer lost its hold) unless the object is still the
        version last read or written: for a writer that finds what it wrote gone, which only a
        writer that took the run over removes."""
        if not self.unchanged():
            raise self._lost()

    def _lost(self) -> StoreWriteError:
        return StoreWriteError(
            f"the {self.lease.holder['command']} of run {self.lease.run_id} lost its hold: another writer took "
            f"the run over and replaced {self.key} (this writer's lease was not renewed within "
            f"{self.lease.seconds:g} s: its machine asleep or stalled?); nothing it wrote since is named by a "
            f"record; run the command again")


def current_lease(zstore: Any, run_id: str) -> dict[str, Any] | None:
    """The holder of the run's lease in the fsspec store ``zstore`` while it is unexpired
    (its body: host, pid, command, since); None when there is none."""
    try:
        body = json.loads(sync(zstore.fs._cat_file(f"{zstore.path.rstrip('/')}/{LEASES}/{run_id}.json")))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(body, dict) or _expires(body) <= time.time():
        return None
    return {key: body[key] for key in ("host", "pid", "command", "since") if key in body}


def _own_filesystem(fs: Any) -> Any:
    """A synchronous twin of the zarr Store's file system, with its own connections: a
    renewal must not wait behind the requests of the command's reads and writes."""
    wrapped = getattr(fs, "sync_fs", None)  # a synchronous file system made async for zarr (memory://)
    if wrapped is not None:
        return wrapped
    return type(fs)(**{**fs.storage_options, "asynchronous": False, "skip_instance_cache": True})


def _clock(when: float) -> str:
    """A time of day as the lease records it (UTC, to the second)."""
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="seconds")


def _expires(body: dict[str, Any]) -> float:
    try:
        return float(body.get("expires", 0))
    except (TypeError, ValueError):
        return 0.0
