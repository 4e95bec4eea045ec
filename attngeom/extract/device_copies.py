"""Copies of a layer's capture off the GPU: into pinned host buffers on a CUDA stream of their
own, which waits for the layer and not the other way round, so the next layers run meanwhile."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from attngeom.extract.tiles import LayerCapture

__all__ = ["HostCopies", "host_copy"]


def host_copy(t: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """``t`` in host memory: ``t`` itself if it is there; else a pinned buffer that a
    non-blocking copy on ``stream`` fills (read it only after that stream's work has ended)."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    if stream is not None:
        # The caching allocator must not hand t's memory to the next layer before the copy read it.
        t.record_stream(stream)
    return host


class HostCopies:
    """One forward's copies of its layers' captures to host memory: :meth:`copy` starts a
    layer's, :meth:`wait` returns once all are readable. A capture on the CPU is left as it is."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None

    def copy(self, capture: LayerCapture) -> LayerCapture:
        """``capture`` on its way to host memory (readable after :meth:`wait`)."""
        device = capture.attn_last.device
        if device.type != "cuda":
            return capture
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        capture = replace(capture, **{
            f.name: host_copy(getattr(capture, f.name), self._stream)
            for f in fields(capture)
            if getattr(capture, f.name) is not None
        })
        self._copied = self._stream.record_event()
        return capture

    def wait(self) -> None:
        """Wait until every copy started has ended."""
        if self._copied is not None:
            self._copied.synchronize()
