"""Faults of the network between a writer and the suite's S3 server (moto on loopback): a
TCP proxy that forwards each connection, reads the request line of each HTTP request it
forwards, and can cut every connection at a chosen request (the network gone: new ones are
closed at once until :meth:`FaultProxy.heal`) or hold all traffic from a chosen request on
(a writer stopped, its machine asleep: its lease renewals stall too) until
:meth:`FaultProxy.release`. A writer is pointed at it by its endpoint: a subprocess by its
environment (:meth:`FaultProxy.env`), this process by :func:`through`."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

# An HTTP/1.1 request line, as botocore writes it at the start of a request.
_REQUEST = re.compile(rb"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.1\r\n")


class FaultProxy:
    """A proxy on loopback in front of the S3 server at ``endpoint``: ``requests`` the request
    lines forwarded so far (method and path), in order."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._down = False
        self._cut_when: Callable[[str], bool] | None = None
        self._hold_when: Callable[[str], bool] | None = None
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()  # set once a request was held
        self.cut = threading.Event()  # set once the connections were cut
        threading.Thread(target=self._accept, daemon=True).start()

    def env(self) -> dict[str, str]:
        """The environment that points s3fs and boto3 at the proxy."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    def cut_when(self, predicate: Callable[[str], bool]) -> None:
        """Cut every connection, and refuse new ones, at the first request whose line
        ("PUT /bucket/key") ``predicate`` accepts, before it is forwarded."""
        self._cut_when = predicate

    def hold_when(self, predicate: Callable[[str], bool]) -> None:
        """Hold every connection's traffic from the first request ``predicate`` accepts on
        (that one not forwarded yet) until :meth:`release`."""
        self._hold_when = predicate

    def release(self) -> None:
        self._hold_when = None
        self._open.set()

    def heal(self) -> None:
        """Forward connections again (the network back)."""
        self._cut_when = None
        self._down = False

    def close(self) -> None:
        self._down = True
        self._listener.close()
        self._drop_all()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down:
                client.close()
                continue
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if requests:
                    for match in _REQUEST.finditer(data):
                        line = f"{match[1].decode()} {match[2].decode()}"
                        if self._hold_when is not None and self._hold_when(line):
                            self._hold_when = None
                            self._open.clear()
                            self.held.set()
                        if self._cut_when is not None and self._cut_when(line):
                            self._down = True
                            self.cut.set()
                            self._drop_all()
                            return
                        self.requests.append(line)
                self._open.wait()
                if self._down:
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _drop_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextlib.contextmanager
def fault_proxy(endpoint: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of ``endpoint`` for the ``with`` block."""
    proxy = FaultProxy(endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


@contextlib.contextmanager
def through(proxy: FaultProxy, monkeypatch: Any) -> Iterator[None]:
    """This process's s3fs (and boto3) pointed at ``proxy`` for the ``with`` block, then back.
    s3fs keeps one file system per set of arguments whatever the environment: its instances
    are dropped on entry and on exit."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    with monkeypatch.context() as mp:
        for key, value in proxy.env().items():
            mp.setenv(key, value)
        try:
            yield
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
