"""A model's tokenizer, or that it has none, and the BOS token every stage puts at position 0.

A model saved with ``save_pretrained`` alone (a researcher's own checkpoint often is) holds
no tokenizer files; transformers then builds an empty tokenizer (a vocabulary of one special
token) or fails to build one. Such a folder has no tokenizer here: it is never loaded, nor
recorded. Light: transformers loads only when a tokenizer does.

The BOS rule (:func:`bos_token_id`): ``bos_token`` where named, else the tokenizer's BOS, else
the model config's ``bos_token_id``, else the token every row of the caller's token ids
starts with, said in a warning.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from attngeom.errors import AttngeomWarning, InputError
from attngeom.options import refusal
from attngeom.extract.saved_tokenizer import folder_tokenizer
from attngeom.store.objects.commands import TOKENIZER_FILES, holds_tokenizer

__all__ = [
    "TOKENIZER_FILES", "Bos", "bos_token_id", "check_tokenizer_name", "folder_tokenizer", "given_tokenizer",
    "holds_tokenizer", "no_tokenizer", "run_tokenizer",
]

def no_tokenizer(model: str, request: type) -> InputError:
    """The refusal of a dataset or texts for ``model``, which has no tokenizer to window them
    with; in the words of ``request``'s caller (:func:`attngeom.options.refusal`)."""
    return refusal(f"model {model} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...; a model saved "
                   "alone has none) to window a corpus with: give one with {tokenizer} (a name or folder), or "
                   "extract from token ids with {token_ids}", request)


def check_tokenizer_name(name: str) -> None:
    """Refuse, before anything loads, a tokenizer named by ``name`` that is not there: a folder
    without a saved tokenizer, or a name that names no model (a GGUF file, an offline name, a
    hub id in the cache or on a reachable hub)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not holds_tokenizer(path):
            raise InputError(f"tokenizer folder {name} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        return
    from attngeom.extract.sources import model_name

    try:
        model_name(name)
    except InputError as exc:
        raise InputError(f"tokenizer {name!r}: {exc}") from None


def given_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer the caller gave: one in memory as it is, or one named (a folder, a GGUF
    file, an offline name or a hub id), loaded; :class:`InputError` where the name holds none."""
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    name = str(tokenizer)
    path = Path(name).expanduser()
    if path.is_dir():
        loaded = folder_tokenizer(str(path), name)
    else:
        from attngeom.extract.models import load_tokenizer, resolve_model

        loaded = load_tokenizer(resolve_model(name))
    if loaded is None:
        raise InputError(f"tokenizer {name} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return loaded


def _config_bos(config: Any) -> int | None:
    """The model config's ``bos_token_id``, where it names one id of the model's vocabulary
    (a config class's default, GPT-2's 50256 in a model of 100 tokens, names none)."""
    bos, vocab = getattr(config, "bos_token_id", None), getattr(config, "vocab_size", None)
    if not isinstance(bos, int) or isinstance(bos, bool) or bos < 0:
        return None
    return bos if not isinstance(vocab, int) or bos < vocab else None


class Bos(NamedTuple):
    """The BOS token id, and whose it is, in words."""

    id: int
    source: str


def bos_token_id(tokenizer: Any, bos_token: str | None, config: Any, request: type,
                 token_ids: np.ndarray | None = None) -> Bos:
    """The BOS every sequence starts with: ``bos_token`` (a token of ``tokenizer``) where
    named; else the tokenizer's BOS; else ``config``'s ``bos_token_id`` (said in a warning
    where the tokenizer names none); else, for the caller's ``token_ids`` (S, L), the token
    every row starts with (said in a warning). :class:`InputError` otherwise, in the words of
    ``request``'s caller."""
    if bos_token is not None:
        if tokenizer is None:
            raise refusal("{bos_token} names a token of a tokenizer, and the model has none: give {tokenizer} too",
                          request)
        token_id = tokenizer.convert_tokens_to_ids(bos_token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise refusal("{bos_token:{token}} is not a token of this tokenizer", request, token=repr(bos_token))
        return Bos(int(token_id), f"the {bos_token!r} named")
    if tokenizer is not None and tokenizer.bos_token_id is not None:
        return Bos(int(tokenizer.bos_token_id), "the tokenizer's")
    configured = _config_bos(config)
    if configured is not None:
        if tokenizer is not None:
            warnings.warn(AttngeomWarning(f"the tokenizer names no BOS token: taking the model config's "
                                          f"bos_token_id {configured} as the BOS"), stacklevel=2)
        return Bos(configured, "the model config's bos_token_id")
    if token_ids is not None and token_ids.ndim == 2 and token_ids.shape[0] and token_ids.shape[1]:
        first = token_ids[:, 0]
        other = np.flatnonzero(first != first[0])
        if other.size:
            raise refusal("neither the tokenizer nor the model's config names a BOS token, and the rows of "
                          "{token_ids} start with different tokens (row 0 with {a}, row {row} with {b}): start every "
                          "row with the model's BOS", request, a=int(first[0]), row=int(other[0]),
                          b=int(first[other[0]]))
        warnings.warn(AttngeomWarning(f"neither the tokenizer nor the model's config names a BOS token: taking "
                                      f"token {int(first[0])}, which every row of the token ids starts with, as the "
                                      "BOS"), stacklevel=2)
        return Bos(int(first[0]), "the token every row starts with")
    if tokenizer is None:
        raise refusal("neither a tokenizer nor the model's config names a BOS token: give a tokenizer that names one "
                      "with {tokenizer}, or token ids whose rows start with the BOS with {token_ids}", request)
    raise refusal("neither the tokenizer nor the model's config names a BOS token: name one with {bos_token} "
                  "(e.g. {bos_token:'<|endoftext|>'})", request)


def run_tokenizer(provenance: dict[str, Any], model: str | None = None) -> Any | None:
    """The tokenizer a run was extracted with (``provenance``, its record); None where it
    records none. Found where its record says it was loaded from (a local folder), else with
    its model: ``model``, where the run's model is now, or the one it records by name (a
    model given in memory has none), else where its record says (a hub id). :class:`InputError`
    when none of these holds it here."""
    recorded = provenance.get("tokenizer", {})
    if recorded is None:
        return None
    where = recorded.get("name_or_path") if isinstance(recorded, dict) else None
    if where and Path(where).is_dir():
        found = folder_tokenizer(where, where)
        if found is not None:
            return found
    source = provenance.get("model") or {}
    name = model if model is not None else None if source.get("source") == "memory" else source.get("id")
    try:
        if name is not None:
            from attngeom.extract.models import load_tokenizer, resolve_model

            found = load_tokenizer(resolve_model(name))
            if found is not None:
                return found
        if where and not Path(where).is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(where)
    except (InputError, OSError, ValueError):
        pass
    raise InputError("its tokenizer cannot be loaded here")
