"""The whole analysis of a deterministic synthetic store, as a digest per array and per
stored object: what ``tests/test_analysis_dump.py`` compares against ``tests/data/analysis-dump.json``.

The leave-one-out sums are compiled with reassociation (``kernels._jit.jit_dot``), so their
last bits follow the code LLVM generates for the machine's CPU and numba's release: those
arrays, and the ``table`` columns that summarize them with every other variable, are kept
as values and compared within a relative 1e-9 (their stored objects by key alone, and the
analysis record without their sizes); every other array and object is compared bit for bit.

Regenerate the reference (only with a change that is meant to change analysis results, and
so bumps ``ANALYSIS_VERSION``) with::

    PYTHONPATH=. python tests/analysis_dump.py tests/data/analysis-dump.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from attngeom.store import (
    ANALYSIS,
    RunLayout,
    consolidate,
    create_run,
    local_path,
    open_or_create_root,
    read_state,
    write_sequence,
    zarr_store,
)
from attngeom.store.session import StoreSession
from attngeom.extract.synthetic import synthetic_sequence, write_synthetic_run

# Run "full": full causal attention, no stored queries; run "window": a sliding window of 6
# keys in its second layer and rows stored at three queries.
LENGTH = 16
GRID = [1, 2, 4, 8]


def read_group(url: str, run_id: str, kind: str, name: str):
    """The committed derived group, as every reader reads it (through a store session)."""
    return StoreSession.reading(url).reader(run_id).derived(kind, name)


def make_store(url: str) -> None:
    """The two synthetic runs of the dump, written into a new store at ``url``."""
    write_synthetic_run(url, "full", n_seq=4, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=LENGTH,
                        seed=1)
    window = (0, 6)
    attendable = tuple(tuple(w == 0 or k >= LENGTH - w for k in range(LENGTH)) for w in window)
    layout = RunLayout(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=LENGTH, head_kv=(0, 0, 1, 1),
                       window=window, attendable=attendable, queries=(5, 9, LENGTH - 1))
    root = open_or_create_root(url)
    provenance = {"model": {"id": "synthetic"}, "dataset": {"id": "synthetic"}, "context_length": LENGTH,
                  "library_versions": {}, "command_line": "tests/analysis_dump.py"}
    run = create_run(root, "window", layout, provenance, 3)
    rng = np.random.default_rng(2)
    for s in range(3):
        write_sequence(run, s, synthetic_sequence(rng, layout))
    consolidate(root)


# The arrays whose last bits follow LLVM's code for reassociated sums: (group, variable).
REASSOCIATED = {(group, name) for group in ("topn", "summary", "topn_by_query", "summary_by_query")
                for name in ("loo_cos", "loo_margin", "loo_distance_margin")} | {
                ("table", name) for name in ("mean", "median", "q05", "q95")}


def reassociated(key: str) -> bool:
    """Whether the dump's array ``<run>/<group>/<name>`` or object
    ``runs/<run>/analysis/<group>/<name>/...`` is one of :data:`REASSOCIATED`."""
    parts = key.split("/")
    return tuple(parts[1:3] if not key.startswith("runs/") else parts[3:5]) in REASSOCIATED


def _digest(values: np.ndarray) -> str:
    if values.dtype.kind == "O":
        return hashlib.sha256(json.dumps([None if v is None else str(v) for v in values.ravel()]).encode()).hexdigest()
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def _object_digest(path: Path, key: str) -> str:
    """The sha256 of a stored object; of the analysis group's metadata, whose record lists
    each object's size, with the sizes of the reassociated arrays' objects left out."""
    data = path.read_bytes()
    if key.endswith(f"/{ANALYSIS}/zarr.json"):
        meta = json.loads(data)
        objects = meta["attributes"]["attngeom"]["commit"]["objects"]
        run_id = key.split("/")[1]
        for name in [name for name in objects if reassociated(f"runs/{run_id}/{ANALYSIS}/{name}")]:
            del objects[name]
        data = json.dumps(meta, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def dump(url: str) -> dict[str, Any]:
    """Every array of every committed analysis group of every run (shape, dtype, sha256 of its
    values), and the sha256 of every stored object under ``runs/<id>/analysis``."""
    out: dict[str, Any] = {"arrays": {}, "objects": {}}
    root = Path(local_path(url))
    for run_id in ("full", "window"):
        state = read_state(zarr_store(url, read_only=True), run_id, ANALYSIS)
        assert state.commit is not None and state.pending is None
        out["arrays"][f"{run_id}/record"] = {"parameters": state.commit.parameters,
                                             "sequences": list(state.commit.sequences),
                                             "groups": list(state.commit.groups)}
        for group in state.commit.groups:
            ds = read_group(url, run_id, ANALYSIS, group).load()
            for name, var in sorted(ds.variables.items()):
                values = np.asarray(var.values)
                key = f"{run_id}/{group}/{name}"
                out["arrays"][key] = {"shape": list(values.shape), "dtype": values.dtype.str}
                if reassociated(key):
                    out["arrays"][key]["values"] = [None if np.isnan(v) else float(v) for v in values.ravel()]
                else:
                    out["arrays"][key]["sha256"] = _digest(values)
        base = root / "runs" / run_id / ANALYSIS
        for path in sorted(base.rglob("*")):
            if path.is_file():
                key = str(path.relative_to(root))
                out["objects"][key] = None if reassociated(key) else _object_digest(path, key)
    return out


def analyzed_dump(folder: Path) -> dict[str, Any]:
    """The dump of :func:`make_store`'s store analyzed in ``folder`` (threads, n grid GRID)."""
    from attngeom.api import analyze

    url = str(folder / "dump.zarr")
    make_store(url)
    analyze(url, scheduler="threads", n_grid=GRID, progress=False)
    return dump(url)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        result = analyzed_dump(Path(tmp))
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
