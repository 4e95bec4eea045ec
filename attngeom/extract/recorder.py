"""What one forward under the capture records: each layer's :class:`LayerCapture`, kept by a
:class:`Recorder` that the attention hook finds by its module (:func:`recorder_of`), so that
two models, two threads or a user's own hooks never see each other's captures. Which queries
a layer computes rows for, and which of them it keeps, are the recorder's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from attngeom.errors import UnsupportedModelError
from attngeom.extract.device_copies import HostCopies
from attngeom.extract.tiles import LayerCapture

__all__ = ["Recorder", "recorder_of", "recording"]


@dataclass
class Recorder:
    """Collects the :class:`LayerCapture` of every layer during one forward pass.

    With ``to_host``, each layer's capture leaves the GPU as soon as the layer is done
    (:class:`~attngeom.extract.device_copies.HostCopies`); :meth:`host_layers` waits for the
    copies. On CPU the captures are host memory already and stay as they are.
    """

    keep_rows: bool = False
    queries: tuple[int, ...] = ()
    to_host: bool = False
    # Queries whose rows and outputs ``compare`` checks against the model's eager attention
    # (:mod:`attngeom.extract.conformance`); () checks nothing.
    check_queries: tuple[int, ...] = ()
    compare: Callable[..., None] | None = field(default=None, repr=False)
    # The layer of a module's current attention call (its own ``layer_idx``, the depth a
    # shared block is applied at, the layer a looped stack's run names:
    # :class:`~attngeom.extract.call_layers.CallLayers`).
    layer_of: Callable[[torch.nn.Module], int | None] = field(
        default=lambda module: getattr(module, "layer_idx", None), repr=False)
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    # How many times each attention module ran in this block's forward (a looped layer runs
    # its module more than once); counted by :func:`~attngeom.extract.capture.capturing`'s hooks.
    runs: Counter = field(default_factory=Counter, repr=False)
    _copies: HostCopies = field(default_factory=HostCopies, repr=False)

    def computed_queries(self) -> tuple[int, ...]:
        """The queries a layer computes rows for: those kept and those checked, ascending."""
        return tuple(sorted({*self.queries, *self.check_queries}))

    def kept(self, capture: LayerCapture) -> LayerCapture:
        """``capture`` with the rows of the kept queries only (the checked ones dropped)."""
        if tuple(self.check_queries) == tuple(self.queries):
            return capture
        rows = None
        if self.queries:
            every = self.computed_queries()
            rows = capture.query_rows[:, :, [every.index(q) for q in self.queries]]
        return replace(capture, query_rows=rows)

    def record(self, layer: int, capture: LayerCapture, runs: int = 1) -> None:
        """Keep ``capture`` as layer ``layer``'s (on its way to host memory with ``to_host``).
        A layer that calls the attention function twice in one forward is refused: its module
        run ``runs`` times, the model naming no layer of its own for each run (a looped layer:
        each call is a softmax, but the run stores one per layer and query), or calls it twice
        in one run (differential attention: its output is not one softmax over keys)."""
        if layer in self.layers:
            raise UnsupportedModelError(
                f"layer {layer} runs its attention {runs} times in one forward (a looped layer) and the model "
                "names no layer of its own for each run: a run stores one attention per layer and query"
                if runs > 1 else
                f"layer {layer} calls the attention function twice in one run of its attention (as differential "
                "attention does): its output is not one softmax over keys"
            )
        self.layers[layer] = self._copies.copy(capture) if self.to_host else capture

    def host_layers(self) -> dict[int, LayerCapture]:
        """Every layer's capture, once all of it is readable (host memory with ``to_host``)."""
        self._copies.wait()
        return self.layers


# The recorder of each attention module captured in this thread (or task), set only by
# ``recording``: keyed by module, so a second model's forward inside the block records nothing.
_RECORDERS: ContextVar[Mapping[torch.nn.Module, Recorder]] = ContextVar(
    "attngeom_recorders", default=MappingProxyType({})
)


def recorder_of(module: torch.nn.Module) -> Recorder | None:
    """The recorder of ``module``'s attention calls in this thread (or task), if any."""
    return _RECORDERS.get().get(module)


class recording:
    """Within the block, the attention calls of ``model``'s modules in this thread record
    into ``recorder``; the thread's recorders as they were after."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder) -> None:
        self._model, self._recorder = model, recorder

    def __enter__(self) -> Recorder:
        self._token = _RECORDERS.set({**_RECORDERS.get(), **dict.fromkeys(self._model.modules(), self._recorder)})
        return self._recorder

    def __exit__(self, *_: object) -> None:
        _RECORDERS.reset(self._token)
