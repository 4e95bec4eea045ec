"""A store that does not answer: the network's failures, by kind, in one place.

A connection refused or lost, a timeout, or throttling that outlasted the retries of s3fs
and botocore is :class:`~attngeom.errors.StoreUnreachableError`, one line naming the store
and what of the command's work is kept (:func:`unreachable`, :func:`reaching`). The
failures are recognized by kind (:func:`network_failure`), never by message. The reports
asyncio and aiohttp make of the same failure in the other requests then in flight (each a
traceback on stderr) are dropped (:func:`quiet_lost_requests`): the command's one line says it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Iterator

from attngeom.errors import StoreUnreachableError

__all__ = ["network_failure", "quiet_lost_requests", "reaching", "unreachable"]

# The answers of an object store that say it is throttling requests, or unable to serve
# them for a while (S3's and those of S3-compatible stores).
_THROTTLING = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                         "TooManyRequestsException", "ServiceUnavailable", "503", "429"})
_NETWORK_ERRNOS = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ETIMEDOUT,
                             errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE})


def network_failure(exc: BaseException) -> str | None:
    """What failed of the network in ``exc`` or the errors that caused it, in words (a
    connection refused or lost, a timeout, throttling); None when none did. The one place
    that knows the kinds: botocore's and aiohttp's (looked up only where the library is
    loaded: none of its errors can be raised otherwise) and Python's own."""
    botocore = sys.modules.get("botocore.exceptions")
    aiohttp = sys.modules.get("aiohttp")
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if botocore is not None and isinstance(exc, botocore.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _THROTTLING:
                return f"it kept answering {code} (throttling) beyond the retries"
        if botocore is not None and isinstance(exc, (botocore.ReadTimeoutError, botocore.ConnectTimeoutError)):
            return f"a request timed out: {exc}"
        if botocore is not None and isinstance(exc, botocore.ConnectionError):
            return f"the connection failed: {exc}"
        if aiohttp is not None and isinstance(exc, aiohttp.ServerTimeoutError):
            return f"a request timed out: {exc}"
        if aiohttp is not None and isinstance(exc, aiohttp.ClientConnectionError):
            return f"the connection failed: {exc}"
        if isinstance(exc, TimeoutError):
            return f"a request timed out{f': {exc}' if str(exc) else ''}"
        if isinstance(exc, (ConnectionError, socket.gaierror)) or (
                isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS):
            return f"the connection failed: {exc}"
        exc = exc.__cause__ or exc.__context__
    return None


def unreachable(url: str, exc: BaseException, committed: str | None = None) -> StoreUnreachableError | None:
    """The :class:`StoreUnreachableError` that ``exc`` is (:func:`network_failure`), naming
    the store and ``committed``, what of the command's work is kept (by default: what was
    committed before); None if it is no failure of the network."""
    why = network_failure(exc)
    if why is None:
        return None
    kept = committed or "what it holds committed is kept"
    return StoreUnreachableError(f"the store {url} does not answer ({why}); {kept}: run the same command again "
                                 "once it answers to go on")


@contextlib.contextmanager
def reaching(url: str) -> Iterator[None]:
    """Turn a failure of the network met inside it into :class:`StoreUnreachableError`."""
    try:
        yield
    except StoreUnreachableError:
        raise
    except Exception as exc:
        error = unreachable(url, exc)
        if error is None:
            raise
        raise error from exc


class _LostRequests(logging.Filter):
    """Drops asyncio's report of a task whose request failed with the network (an upload
    aiohttp began beside the request whose failure the command met)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or network_failure(exc) is None


_QUIET = _LostRequests()


def quiet_lost_requests() -> None:
    """Silence asyncio's reports of requests failed with the network (:class:`_LostRequests`):
    called where a store is opened over the network."""
    log = logging.getLogger("asyncio")
    if _QUIET not in log.filters:
        log.addFilter(_QUIET)
