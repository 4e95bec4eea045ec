"""The layer of the model each attention call belongs to: the index of the cache layer the
call writes, which the model's own code names.

A module's ``layer_idx`` names its layer in most families. A block shared by several depths
(Zamba's, Zamba 2's: one attention block, its weights tied, applied by several hybrid
layers) is called with the index of the decoder layer applying it, passed to its forward as
``layer_idx``. A looped stack runs its modules several times per forward, each run passing
its module the offset of its layer: HRM counts each run as a layer of its own (its config's
``num_hidden_layers``) and passes its cycle's (``cycle_offset``); Dory writes each loop after
the first to cache layers appended after its declared ones (``cache_offset``). The run's
layer is the module's ``layer_idx`` plus that offset. A :class:`CallLayers` follows a model's
forward and answers, for each attention call, that layer (docs/models.md#shared-blocks,
#looped-stacks).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["CallLayers", "shared_by_depths"]

# The argument through which a shared block is told the depth that applies it.
DEPTH_ARGUMENT = "layer_idx"
# The arguments through which a looped stack tells each run of a module the offset of its
# layer from the module's own ``layer_idx``: HRM's cycles, Dory's loops.
OFFSET_ARGUMENTS = ("cycle_offset", "cache_offset")


def shared_by_depths(module: torch.nn.Module) -> bool:
    """Whether ``module`` is told its layer by each call (its forward takes ``layer_idx``)
    rather than holding it."""
    return DEPTH_ARGUMENT in inspect.signature(module.forward).parameters


def _told_its_layer(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return hasattr(module, "layer_idx") and any(a in parameters for a in (DEPTH_ARGUMENT, *OFFSET_ARGUMENTS))


class CallLayers:
    """Within the block, the layer of each call of ``model``'s attention modules: its own
    ``layer_idx``; for a block shared by several depths, the ``layer_idx`` its current call
    was given; for a module of a looped stack, its own plus its current call's offset (both
    read by a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._current: dict[torch.nn.Module, int] = {}
        self._handles: list[Any] = []

    def layer(self, module: torch.nn.Module) -> int | None:
        """The layer of ``module``'s current attention call (None: it names none)."""
        if module in self._current:
            return self._current[module]
        return getattr(module, "layer_idx", None)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        if bound.get(DEPTH_ARGUMENT) is not None:
            self._current[module] = int(bound[DEPTH_ARGUMENT])
        elif module.layer_idx is not None:
            self._current[module] = module.layer_idx + sum(int(bound.get(a) or 0) for a in OFFSET_ARGUMENTS)

    def __enter__(self) -> CallLayers:
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self._model.modules()
                         if _told_its_layer(m)]
        return self

    def __exit__(self, *_: object) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._current.clear()
