"""The store: its contract (docs/store.md), opening and writing, validation and migration.

Its sub-packages are layers, each importing only those below it (docs/architecture.md):
:mod:`~attngeom.store.objects` (the store's names and layout, its objects and their bytes, a
first look before zarr loads, the damage they name), :mod:`~attngeom.store.holds` (the root,
the writers' hold, a run's lock and lease), :mod:`~attngeom.store.extracted` (runs and the
per-sequence commit, extract's write of a run, arrays read a chunk at a time, groups as
Datasets, the checks every reader makes), :mod:`~attngeom.store.derived_groups` (analysis,
ablation and detect groups, their commit record and the plan of an update),
:mod:`~attngeom.store.integrity` (validation, repair, rebuilt metadata, migration) and, on
top, :mod:`~attngeom.store.session` (one command's store, through which it reads and writes).

Stages import what they use from here or from those modules. Each name loads its module on
first use: a first look at a store (:mod:`~attngeom.store.objects.preflight`) loads no zarr,
and a command that finds its work done (an analyze with nothing to do) reads and checks the
store with zarr alone, without xarray and Dask.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Each public name, by the module below this package that holds it.
_HOME = {
    "objects.schema": (
        "ABLATION", "ABLATION_GROUPS", "ANALYSIS", "ANALYSIS_GROUPS", "ANALYSIS_SEQUENCE_GROUPS",
        "ATTR_KEY", "COORDS", "DERIVED", "DETECT", "DETECT_GROUPS", "FIELD_SUMMARIES", "FORMAT",
        "LABELS", "LABEL_ORDERS", "METHODS", "QUERY_GROUPS", "QUERY_SEQUENCE_GROUPS", "RECENT_WINDOWS",
        "REGIMES", "RUNS", "RUN_VARIABLES", "RunLayout", "SCHEMA_VERSION", "SCORE_GROUPS",
        "SCORE_SEQUENCE_GROUPS", "SEQUENCE_ARRAYS", "SIGNATURE_VARIABLES", "STATS", "SUMMARY_DIMS",
        "TOPN_COUNTS", "TOPN_FLAGS", "TOPN_FLOATS", "TOPN_VARIABLES", "VALUE_STATISTICS", "VOTES",
        "Variable", "ablation_path", "analysis_path", "label_codes", "label_dtype", "query_attendable",
        "run_path",
    ),
    "objects.codecs": ("compressor", "compressors", "has_checksum", "with_checksum"),
    "objects.storage": ("jsonable", "local_path", "zarr_store"),
    "objects.preflight": ("RUN_ID_PATTERN", "default_run_id"),
    "objects.damage": ("damaged_chunk", "recovery"),
    "holds.access": (
        "check_writable", "consolidate", "open_or_create_root", "open_root", "read_root_attrs",
        "store_format", "writing",
    ),
    "extracted.runs": (
        "SequenceWriter", "completed", "create_run", "lacking_message", "lacking_summaries",
        "n_sequences", "open_run_group", "require_run_group", "require_runs", "resize_run", "run_ids",
        "run_layout", "run_provenance", "write_sequence",
    ),
    "extracted.chunks": ("read_chunk",),
    "extracted.datasets": ("open_dataset", "write_dataset"),
    "extracted.checks": (
        "array_metadata", "arrays_of", "check_arrays", "check_committed", "check_run", "lost_objects",
        "reading_run",
    ),
    "derived_groups.record": ("read_state",),
    "derived_groups.derived_read": ("derived_problems",),
    "session": ("StoreSession", "replace_groups"),
    "integrity.validate": ("damaged_objects", "validate_run", "validate_store"),
    "integrity.repair": ("Repair", "repair"),
}
_MODULE = {name: module for module, names in _HOME.items() for name in names}

__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name in _MODULE:
        value = getattr(importlib.import_module(f"attngeom.store.{_MODULE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attngeom.store' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
