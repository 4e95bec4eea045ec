"""The command line that makes what a store lacks or rewrites what it holds damaged: the
stage's words for a run, with ``--model`` and ``--tokenizer`` where the run's record says the
stage would not find them (read before torch loads)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from attngeom.store.objects.preflight import run_record

__all__ = ["TOKENIZER_FILES", "holds_tokenizer", "stage_command"]

# The files a tokenizer is saved in: its config, or a vocabulary of one of the formats
# transformers reads. A folder holding none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


def holds_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a saved tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


# The stages that load a run's model again.
_MODEL_STAGES = ("ablate", "detect")


def stage_command(stage: str, url: str, run_id: str, options: str = "") -> str:
    """The command line of ``stage`` for run ``run_id`` of the store at ``url``, as it runs
    for that run (its record read, before torch loads): with ``--model`` where ablate or
    detect cannot find the run's model by its recorded name (moved, or given in memory:
    where the weights its provenance names are saved, else ``FOLDER`` for the caller to
    fill in), and, for detect, ``--tokenizer`` where the run records a tokenizer that is
    found nowhere it says. ``options``: the stage's other options, as they follow."""
    words = ["attngeom", stage, "--store", url, "--run", run_id]
    if stage in _MODEL_STAGES:
        record = run_record(url, run_id) or {}
        model = _model_now(record)
        if model is not None:
            words += ["--model", model]
        if stage == "detect" and _tokenizer_lost(record):
            words += ["--tokenizer", "NAME_OR_FOLDER"]
    return shlex.join(words) + options


def _model_now(record: dict[str, Any]) -> str | None:
    """What ``--model`` a stage needs for a run (its ``record``): None where it loads the
    model by its recorded name (an offline name or a hub id, which the stage itself checks,
    or a path that is there); the folder a model in memory was loaded from (its
    ``name_or_path``), where that holds a model; else ``FOLDER``."""
    recorded = record.get("model") or {}
    if not recorded:
        return None
    if recorded.get("source") == "memory":
        where = recorded.get("name_or_path")
        return where if where and (Path(where) / "config.json").is_file() else "FOLDER"
    path = Path(str(recorded.get("id")))
    return "FOLDER" if path.is_absolute() and not path.exists() else None


def _tokenizer_lost(record: dict[str, Any]) -> bool:
    """Whether a run records a tokenizer found nowhere its record says: not in the folder
    it was loaded from, nor beside its model (a local folder holding none; a model in
    memory)."""
    recorded = record.get("tokenizer")
    if not isinstance(recorded, dict):
        return False
    where = recorded.get("name_or_path")
    if where and Path(where).is_dir() and holds_tokenizer(Path(where)):
        return False
    model = record.get("model") or {}
    if model.get("source") == "memory":
        # A name that is no path here is a hub id, left to the hub.
        return not (where and not Path(where).expanduser().is_absolute() and not Path(where).exists())
    folder = Path(str(model.get("id")))
    return folder.is_dir() and not holds_tokenizer(folder)
