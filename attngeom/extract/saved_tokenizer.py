"""A model's or tokenizer's saved tokenizer, loaded from its folder: what extract's model
loading and the tokenizers a caller names share (:mod:`~attngeom.extract.models`,
:mod:`~attngeom.extract.tokenizing`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attngeom.errors import InputError
from attngeom.store.objects.commands import holds_tokenizer

__all__ = ["folder_tokenizer"]


def folder_tokenizer(folder: str, name: str) -> Any | None:
    """The tokenizer saved in ``folder`` (a local folder, or a hub id), of the model or
    tokenizer named ``name``; None where it has none: no tokenizer file in a local folder, or
    one transformers builds without a token that is not special. :class:`InputError` when its
    files cannot be read."""
    local = Path(folder)
    if local.is_dir() and not holds_tokenizer(local):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        said = str(exc).strip().splitlines()
        raise InputError(f"the tokenizer of {name} cannot be loaded ({type(exc).__name__}: "
                         f"{said[0] if said else 'no reason given'})") from exc
    return tokenizer if len(tokenizer) > len(set(tokenizer.all_special_ids)) else None
