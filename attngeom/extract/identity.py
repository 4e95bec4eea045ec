"""What makes a run (:data:`IDENTITY`), and how a rerun differs from it, in words.

One comparison serves both moments a rerun is checked: before anything loads, with what the
request's names tell (the model and the corpus by their ids, a local corpus by its documents'
fingerprint), and once the model and corpus are read, with the whole identity (weights,
documents, BOS token, dtypes). Light: imports nothing beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from attngeom.errors import InputError

__all__ = ["IDENTITY", "differences", "other_run"]

# What makes a run: the provenance keys in which a rerun must agree with it to resume or
# append to it.
IDENTITY = ("model", "dataset", "context_length", "window_rule", "bos_token_id", "values_dtype", "store_rows",
            "queries", "compute_dtype")
# The value of an identity key in a run that predates it. compute_dtype (the resolved dtype,
# never "auto") has none: every run extract has written records it, since the first store
# schema, so an older run is held to the dtype it was written in; a run without it was not
# written by extract and is refused, as one lacking any other identity key.
_IDENTITY_BEFORE = {"queries": []}

# The option that sets each part of a run's identity, as the record names it.
IDENTITY_FLAGS = {
    "model": "--model", "dataset": "--dataset", "context_length": "--context-length", "window_rule": "--window",
    "values_dtype": "--values-dtype", "store_rows": "--store-rows", "queries": "--queries", "compute_dtype": "--dtype",
    "text_field": "--text-field",
}


def differences(record: Mapping[str, Any], identity: Mapping[str, Any],
                given: Mapping[str, Any] | None = None) -> list[str]:
    """How ``identity`` differs from run ``record`` (its provenance), in words; [] where it does
    not. ``identity``: the :data:`IDENTITY` keys known so far (a key absent or None is not
    compared yet); the model and the dataset are dicts as the run records them, compared on the
    keys given (``{"id": ...}`` compares their names). ``given``: values as the command gave
    them, to be said in their place (queries as ``every:K``, the dataset as named)."""
    given = given or {}
    out = []
    for key in IDENTITY:
        now = identity.get(key)
        if now is None:
            continue
        was = record.get(key, _IDENTITY_BEFORE.get(key))
        if key in ("model", "dataset"):
            held = was if isinstance(was, dict) else {}
            if {k: held.get(k) for k in now} != now:
                out.append(_part_difference(key, held, now, given.get(key)))
        elif was != now:
            out.append(_difference(key, was, given.get(key, now)))
    return out


def other_run(store: str, run_id: str, diffs: Sequence[str]) -> InputError:
    """The refusal of a command that differs from run ``run_id`` in ``diffs`` (in words)."""
    return InputError(f"run '{run_id}' in {store} differs from this command: " + "; ".join(diffs)
                      + "; give the run's values to continue it, or another --run")


def _part_difference(key: str, was: Mapping[str, Any], now: Mapping[str, Any], name: Any) -> str:
    """A difference in the model or the dataset (``name``: as the command named it): by their
    ids, or by their weights, text field and documents where the ids agree."""
    if was.get("id") != now.get("id"):
        return _difference(key, was.get("id"), now.get("id"))
    if key == "model":
        return f"the weights of model {now.get('id')} differ from those the run was extracted from"
    if "text_field" in now and was.get("text_field") != now["text_field"]:
        return _difference("text_field", was.get("text_field"), now["text_field"])
    return f"the documents of --dataset {name or now.get('id')} changed since the run read them"


def _difference(key: str, was: Any, now: Any) -> str:
    """One difference between a run and a command, in words: the option, the run's value, the asked one."""
    if key == "bos_token_id":
        return f"the BOS token is id {was} in the run, {now} here (--bos-token)"
    return f"{IDENTITY_FLAGS[key]} is {_shown(key, was)} in the run, {_shown(key, now)} here"


def _shown(key: str, value: Any) -> str:
    """A recorded or asked value as its option takes it."""
    if key == "window_rule" and isinstance(value, dict):
        rule = value.get("rule")
        if rule == "random":
            return f"random --seed {value.get('seed')}"
        return "token_ids" if rule == "given" else str(rule)
    if key == "queries" and isinstance(value, list):
        if not value:
            return "last"
        shown = ",".join(map(str, value))
        return shown if len(value) <= 8 else f"{','.join(map(str, value[:3]))},...,{value[-1]} ({len(value)} positions)"
    return str(value)
