"""Errors a user can act on, by kind. The CLI prints any of them as one line and exits 2;
Python callers catch the kind they can handle (never the message text).

::

    AttngeomError
    ├── InputError            bad arguments, model, tokenizer or corpus
    │   └── UnsupportedModelError  a model whose attention the capture cannot reproduce
    └── StoreError            the store cannot be used as asked
        ├── StoreNotFoundError    nothing (or no attngeom store) at the URL
        ├── SchemaError           not attngeom's, another schema version or format, a migration under way
        ├── RunNotFoundError      no such run (or no completed sequence in it)
        ├── GroupNotFoundError    no such analysis, ablation or detect group in a run (not computed yet)
        ├── StoreWriteError       the store cannot be written (full, read-only)
        ├── StoreUnreachableError the store does not answer (a connection lost or refused, a timeout, throttling)
        └── DamagedStoreError     unreadable metadata, a missing or corrupt chunk
            ├── CorruptChunkError     a chunk that fails to decode (checksum, compression)
            ├── ForeignFileError      a link leading outside a local store, a device or pipe in it
            └── IncompleteGroupError  a derived group whose writer was interrupted
                └── InProgressError       ... or whose writer is still at work

An error whose remedy is said otherwise on the command line carries that wording as
``command_line``; :func:`attngeom.options.refusal` makes both from one message naming
options, as keywords in Python and flags on the command line.

A stage that goes on without part of its work (a run that lacks some summaries) says so with
an :class:`AttngeomWarning`, which the CLI prints as one line.
"""

from __future__ import annotations

__all__ = [
    "AttngeomError",
    "AttngeomWarning",
    "CorruptChunkError",
    "DamagedStoreError",
    "ForeignFileError",
    "GroupNotFoundError",
    "InProgressError",
    "IncompleteGroupError",
    "InputError",
    "RunNotFoundError",
    "SchemaError",
    "StoreError",
    "StoreNotFoundError",
    "StoreUnreachableError",
    "StoreWriteError",
    "UnsupportedModelError",
]


class AttngeomError(Exception):
    """Bad input or an unusable store; the message says what to change.

    ``command_line``: the same message in the command line's words, where the remedy differs
    (an option, ``--model``, where Python passes an object, ``model=``); the CLI prints it.
    """

    def __init__(self, message: str, *, command_line: str | None = None) -> None:
        super().__init__(message)
        self.command_line = command_line


class InputError(AttngeomError):
    """An argument, model, tokenizer or corpus that cannot be used as given."""


class UnsupportedModelError(InputError):
    """A model whose attention is not one softmax over keys that the capture reproduces
    (differential attention, a layer outside transformers' attention interface, an argument
    the capture does not know), or whose capture disagrees with its own eager attention."""


class StoreError(AttngeomError):
    """The store cannot be used as asked."""


class StoreNotFoundError(StoreError):
    """Nothing at the store's URL, or no attngeom store there."""


class SchemaError(StoreError):
    """A Zarr store that is not attngeom's, of another schema version or format, or one whose
    migration is under way."""


class RunNotFoundError(StoreError):
    """No run of that id in the store, or none with a completed sequence."""


class GroupNotFoundError(StoreError):
    """A run without the analysis or ablation group asked for: not analyzed or ablated yet."""


class StoreWriteError(StoreError):
    """The store cannot be written: out of space, read-only, or not a folder."""


class StoreUnreachableError(StoreError):
    """The store does not answer: a connection lost or refused, a timeout, or throttling
    that outlasted the retries. What was committed before is kept; the same command, run
    again once the store answers, goes on from there."""


class DamagedStoreError(StoreError):
    """Part of the store is missing or unreadable: metadata, a chunk, a group."""


class CorruptChunkError(DamagedStoreError):
    """A chunk that fails to decode (its checksum, or its compression)."""


class ForeignFileError(DamagedStoreError):
    """A file of a local store that attngeom neither reads nor writes through: a link that
    leads outside the store's folder, or no regular file (a device, a named pipe)."""


class IncompleteGroupError(DamagedStoreError):
    """An analysis or ablation whose writer was interrupted: not finished, so not read."""


class InProgressError(IncompleteGroupError):
    """An analysis, ablation or detect that a live writer is still writing: read it once it
    commits (the message names the writer)."""


class AttngeomWarning(UserWarning):
    """A stage went on without part of its work; the message says what and how to get it."""
