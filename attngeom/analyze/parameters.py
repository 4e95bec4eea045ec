"""What an analysis's values depend on besides the run's sequences, what ``analyze`` is
asked to do (:class:`AnalyzeRequest`) and what it did (:class:`AnalyzeResult`). Light: no
Dask, no kernels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RANDOM_DRAWS = 8


# Part of the parameters an analysis records: bump it with any change to the kernels or to
# the analyze stage that changes a stored bit, so that a rerun recomputes instead of mixing results.
ANALYSIS_VERSION = 5


@dataclass(frozen=True)
class AnalyzeRequest:
    """The arguments of ``attngeom analyze`` and :func:`attngeom.analyze`: the runs of
    ``store`` to analyze (every run, or ``run_id``), the Dask ``scheduler``, the selection
    sizes ``n_grid`` (None: :func:`default_n_grid`), the ``seed`` of the random-N control,
    ``out`` a folder for the tidy tables, ``progress`` bars and announcements, and ``deep``
    to decode every committed object when checking the earlier analysis."""

    store: str
    run_id: str | None = None
    scheduler: str | None = None
    n_grid: Sequence[int] | None = None
    seed: int = 0
    out: Path | None = None
    progress: bool = True
    deep: bool = False


@dataclass(frozen=True)
class AnalyzeResult:
    """One run's analyze: ``sequences`` covered by the analysis now, ``new_sequences``
    computed by this call, ``instances`` the (sequence, layer, head) instances covered,
    ``seconds`` wall time; ``recomputed`` says why earlier results were recomputed rather
    than extended (None when they were extended, or there were none); ``healed`` names the
    damaged committed groups written again (None when there were none)."""

    run_id: str
    sequences: int
    new_sequences: int
    instances: int
    seconds: float
    recomputed: str | None = None
    healed: str | None = None


def default_n_grid(length: int) -> list[int]:
    """N in {1, 2, 4, ...} with N < L."""
    return [2**k for k in range(int(np.log2(max(length - 1, 1))) + 1) if 2**k < length]


def instance_seed(seed: int, seq: int, layer: int) -> int:
    """A seed per (sequence, layer): the random control does not depend on chunking or order."""
    return int(np.random.SeedSequence([seed, seq, layer]).generate_state(1)[0])


def analysis_parameters(n_grid: Sequence[int], seed: int) -> dict[str, Any]:
    """What an analysis's values depend on besides the run's sequences; recorded with it."""
    return {"n_grid": [int(n) for n in n_grid], "seed": int(seed), "random_draws": RANDOM_DRAWS,
            "analysis_version": ANALYSIS_VERSION}
