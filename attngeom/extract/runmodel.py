"""The model a run was extracted with, loaded again by the stages that need it (ablate, detect).

A run of a named model is loaded by its recorded name, or from where the caller says it is
now (a name, GGUF file, folder or hub id), refused if the weights found are not those
recorded; a run of a model given in memory needs that model again, or the folder, GGUF or
hub id its weights were saved in, its state dict hashing as recorded. What can be told
without torch (where the model is, its architecture and shapes) is
:func:`attngeom.extract.runcheck.check_run_model`'s, made first.
"""

from __future__ import annotations

import contextlib
import os
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

__all__ = ["run_model", "evaluating", "is_named"]


def is_named(model: Any) -> bool:
    """Whether ``model`` says where a model is (a name or path), not a loaded one."""
    return isinstance(model, str | os.PathLike)


def run_model(
    model: Any, provenance: dict[str, Any], run_id: str, device: str, dtype: str,
    device_map: str | dict[str, str | int] | None = None,
) -> tuple[torch.nn.Module, str, torch.dtype]:
    """(model, device, compute dtype): the run's model on ``device`` (or placed by
    ``device_map``) in ``dtype``, loaded by its recorded name or from ``model`` (where it is
    now), or the caller's ``model`` in
    memory, used where it is, never moved or cast. Refused when its weights are not those
    recorded: a named run's file hash (or hub revision), checked before the weights load; a
    run of a model in memory, the state dict's hash."""
    recorded = provenance["model"]
    from_memory = recorded.get("source") == "memory"
    if model is not None and not is_named(model):
        if state_dict_sha256(loaded_model(model)) != recorded.get("state_dict_sha256"):
            raise InputError(f"the model given is not the one run '{run_id}' was extracted with (state dict differs)")
        placed, compute_dtype = model_placement(model, device, dtype)
        return model, placed, compute_dtype
    source = resolve_model(str(model) if model is not None else recorded["id"])
    where = f"model '{source.name}'"
    if not from_memory:
        was, now = recorded.get("file_sha256") or recorded.get("revision"), source.file_sha256 or source.revision
        if was and now and was != now:
            raise InputError(f"{where} is not the one run '{run_id}' was extracted with: its weights differ from "
                             "those recorded at extract")
    placed = resolve_device(device) if device_map is None else map_device(device_map)
    compute_dtype = resolve_dtype(dtype)
    loaded = load_model(source, device=placed, dtype=compute_dtype, device_map=device_map)
    if from_memory and state_dict_sha256(loaded) != recorded.get("state_dict_sha256"):
        raise InputError(f"{where} is not the one run '{run_id}' was extracted with: its weights differ from "
                         "those of the model in memory (state dict)")
    return loaded, placed, compute_dtype


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode for the block, then back in the mode it was given in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
