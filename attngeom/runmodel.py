"""The model a run was extracted with, loaded again by the stages that need it (ablate, detect).

A run of a named model is loaded by its recorded name, refused if the weights found now are
not those recorded; a run of a model given in memory needs that model again, its state dict
hashing as recorded. Either check is made before any model loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from attngeom.errors import InputError
from attngeom.extract.models import (
    load_model,
    loaded_model,
    map_device,
    model_placement,
    resolve_device,
    resolve_dtype,
    resolve_model,
    state_dict_sha256,
)

__all__ = ["check_run_model", "evaluating", "run_model"]


def check_run_model(model: Any, provenance: dict[str, Any], run_id: str, stage: str) -> None:
    """Refuse a ``model`` that is not the run's: a run of a model in memory needs it (its
    state dict hashing as recorded); a run of a named model is loaded by the ``stage`` itself,
    so ``model`` must be None."""
    recorded = provenance.get("model") or {}
    from_memory = recorded.get("source") == "memory"
    if model is None:
        if from_memory:
            raise InputError(
                f"run '{run_id}' was extracted from a model in memory ({recorded.get('class')}): pass it as model="
            )
        if "id" not in recorded:
            raise InputError(f"run '{run_id}' records no model in its provenance")
        return
    if not from_memory:
        raise InputError(f"run '{run_id}' was extracted from '{recorded.get('id')}', which {stage} loads itself: drop model=")
    if state_dict_sha256(loaded_model(model)) != recorded.get("state_dict_sha256"):
        raise InputError(f"the model given is not the one run '{run_id}' was extracted with (state dict differs)")


def run_model(
    model: Any, provenance: dict[str, Any], run_id: str, device: str, dtype: str,
    device_map: str | dict[str, str | int] | None = None,
) -> tuple[torch.nn.Module, str, torch.dtype]:
    """(model, device, compute dtype): the run's model loaded by its recorded name on
    ``device`` (or placed by ``device_map``) in ``dtype`` (refused if its weights differ from
    those recorded), or the caller's ``model`` in memory, used where it is, never moved or
    cast. Check it first with :func:`check_run_model`."""
    if model is not None:
        placed, compute_dtype = model_placement(model, device, dtype)
        return model, placed, compute_dtype
    recorded = provenance["model"]
    source = resolve_model(recorded["id"])
    was, now = recorded.get("file_sha256") or recorded.get("revision"), source.file_sha256 or source.revision
    if was and now and was != now:
        raise InputError(
            f"model '{recorded['id']}' is not the one run '{run_id}' was extracted with "
            f"(weights {now[:12]}, recorded {was[:12]})"
        )
    placed = resolve_device(device) if device_map is None else map_device(device_map)
    compute_dtype = resolve_dtype(dtype)
    return load_model(source, device=placed, dtype=compute_dtype, device_map=device_map), placed, compute_dtype


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode for the block, then back in the mode it was given in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
