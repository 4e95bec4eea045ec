"""The digests a run records of its model: a file's sha256 (a GGUF file, a folder's weights)
and a model in memory's state-dict sha256."""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import torch

__all__ = ["file_sha256", "state_dict_sha256"]


def file_sha256(path: Path) -> str:
    """sha256 of the file at ``path``, read a MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


# Per model object, while it lives: (the state dict's tensor versions, their sha256).
_STATE_DIGESTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]] = weakref.WeakKeyDictionary()


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict: every entry's name, dtype, shape and bytes, in order.

    Hashing a model's weights costs about a second per GB, as much as several forwards of a
    small model, so the digest is kept per model object and reused while every entry is the
    same tensor at the same version (torch bumps a tensor's version on each in-place change,
    an optimizer step or ``load_state_dict`` included).
    """
    state = model.state_dict()
    try:
        versions = tuple((name, t.data_ptr(), t._version, t.dtype, t.shape) for name, t in state.items())
    except RuntimeError:  # inference tensors keep no version: nothing to reuse
        versions = None
    kept = _STATE_DIGESTS.get(model)
    if versions is not None and kept is not None and kept[0] == versions:
        return kept[1]
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    value = digest.hexdigest()
    if versions is not None:
        _STATE_DIGESTS[model] = (versions, value)
    return value
