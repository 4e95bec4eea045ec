"""Stores made by extract from the tiny models and the word corpus (tests/conftest.py), and
analyzed, built once per test session for every module that asks for the same ones (the
fixtures ``extracted_store`` and ``analyzed_store``). A test that writes to one works on its
own copy (`copy_store`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Run:
    """One run of a shared store: ``sequences`` windows of ``length`` tokens of the word corpus
    through the tiny model of family ``arch``, stored as ``run_id``; ``options`` further fields
    of the ``ExtractRequest`` as (name, value) pairs."""

    arch: str = "llama"
    sequences: int = 3
    run_id: str = "r"
    length: int = 16
    options: tuple[tuple[str, object], ...] = ()


def build_extracted(store: Path, runs: tuple[Run, ...], model_dir: Callable[[str], Path], corpus: Path) -> Path:
    """Extract each of ``runs`` into ``store``, in order."""
    from attngeom.extract.pipeline import ExtractRequest, extract

    for run in runs:
        extract(ExtractRequest(model=str(model_dir(run.arch)), dataset=str(corpus), context_length=run.length,
                               num_sequences=run.sequences, store=str(store), run_id=run.run_id, progress=False,
                               **dict(run.options)))
    return store


def build_analyzed(store: Path, n_grid: tuple[int, ...]) -> Path:
    """Analyze every run of ``store`` with threads on the grid ``n_grid``."""
    from attngeom.api import analyze

    analyze(str(store), scheduler="threads", n_grid=list(n_grid), progress=False)
    return store


def copy_store(source: Path, folder: Path, name: str = "s.zarr") -> Path:
    """A copy of the store ``source`` as ``folder/name``, for a test to change."""
    copy = folder / name
    shutil.copytree(source, copy)
    return copy
