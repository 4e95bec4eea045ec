"""extract's phases, named in a torch profile: each is a ``torch.profiler.record_function``
range, the names a profile of ``ag.extract`` shows (docs/architecture.md#extracts-phases-in-a-profile).
Nothing is recorded when no profiler runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.profiler import record_function

__all__ = ["PHASES", "phase", "phased", "profiling"]

T = TypeVar("T")

PHASES = {
    "attngeom.forward": "the model's decoder over a batch of sequences, the capture inside it",
    "attngeom.capture": "one layer's attention captured: its rows, summaries and own output",
    "attngeom.rows": "a tile's float32 probability rows: q k^T, the mask, the row maximum, the softmax",
    "attngeom.output": "a tile's rows @ v, the layer's output where the capture returns its own",
    "attngeom.hand_off": "a sequence's arrays taken from the capture for the writer, one part per layer",
    "attngeom.write": "a sequence handed to the writer (attngeom.hand_off), and its parts stacked and converted "
                      "and its writes where the writer runs in the caller's thread, the wait for room beside it "
                      "otherwise",
}

_NOTHING = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a torch profiler records the calling thread's ranges."""
    # torch's own check is private (a C call, a tenth of a us); record_function costs some
    # 15 us even with no profiler running, and a layer at L = 4096 has a thousand tiles.
    # tests/test_capture.py sees every range under a profiler, or fails.
    return torch.autograd._profiler_enabled()


def phase(name: str) -> contextlib.AbstractContextManager[object]:
    """The block as the range ``name`` (one of :data:`PHASES`) of a running torch profiler."""
    return record_function(name) if profiling() else _NOTHING


def phased(name: str, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` run as the range ``name`` (:func:`phase`), in whichever thread calls it."""

    def run() -> T:
        with phase(name):
            return fn()

    return run
