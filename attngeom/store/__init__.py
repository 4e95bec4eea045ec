"""The store: its contract (docs/store.md), opening and writing, validation and migration.

Modules, by concern: :mod:`~attngeom.store.schema` (layout, names, versions),
:mod:`~attngeom.store.codecs` (chunk encoding), :mod:`~attngeom.store.storage` (a URL's zarr
Store, its objects and node metadata), :mod:`~attngeom.store.access` (the root, the writers'
hold, consolidated metadata), :mod:`~attngeom.store.session` (one command's store, through
which it reads and writes),
:mod:`~attngeom.store.datasets` (groups as Datasets), :mod:`~attngeom.store.damage` (damage
errors and recovery), :mod:`~attngeom.store.chunks` (a run's arrays read a chunk at a time),
:mod:`~attngeom.store.runs` (runs and the per-sequence commit), :mod:`~attngeom.store.run_write`
(extract's write of a run, begin to commit), :mod:`~attngeom.store.derived` and
:mod:`~attngeom.store.derived_read` (analysis, ablation and detect groups: their write; their
reading through the commit record, and their problems), :mod:`~attngeom.store.record` and
:mod:`~attngeom.store.plan` (that record, and the plan of an update),
:mod:`~attngeom.store._zarr` (the zarr internals used), :mod:`~attngeom.store.stored_objects` (stored
objects and their checks), :mod:`~attngeom.store.validate`, :mod:`~attngeom.store.repair` and
:mod:`~attngeom.store.migrate`. Stages import what they use from here.
"""

import importlib
from typing import Any

from attngeom.preflight import RUN_ID_PATTERN, default_run_id
from attngeom.store.access import (
    check_writable,
    consolidate,
    open_or_create_root,
    open_root,
    read_root_attrs,
    store_format,
    writing,
)
from attngeom.store.chunks import read_chunk
from attngeom.store.damage import damaged_chunk, recovery
from attngeom.store.storage import jsonable, local_path, zarr_store
from attngeom.store.codecs import compressor, compressors, has_checksum, with_checksum
from attngeom.store.record import read_state
from attngeom.store.runs import (
    SequenceWriter,
    completed,
    create_run,
    lacking_message,
    lacking_summaries,
    n_sequences,
    open_run_group,
    require_run_group,
    require_runs,
    resize_run,
    run_ids,
    run_layout,
    run_provenance,
    write_sequence,
)
from attngeom.store.schema import (
    ABLATION,
    ABLATION_GROUPS,
    ANALYSIS,
    ANALYSIS_GROUPS,
    ANALYSIS_SEQUENCE_GROUPS,
    ATTR_KEY,
    COORDS,
    DERIVED,
    DETECT,
    DETECT_GROUPS,
    FIELD_SUMMARIES,
    FORMAT,
    LABEL_ORDERS,
    LABELS,
    METHODS,
    QUERY_GROUPS,
    QUERY_SEQUENCE_GROUPS,
    RECENT_WINDOWS,
    REGIMES,
    RUN_VARIABLES,
    RUNS,
    SCHEMA_VERSION,
    SCORE_GROUPS,
    SCORE_SEQUENCE_GROUPS,
    SEQUENCE_ARRAYS,
    SIGNATURE_VARIABLES,
    STATS,
    SUMMARY_DIMS,
    TOPN_COUNTS,
    TOPN_FLAGS,
    TOPN_FLOATS,
    TOPN_VARIABLES,
    VALUE_STATISTICS,
    VOTES,
    RunLayout,
    Variable,
    ablation_path,
    analysis_path,
    label_codes,
    label_dtype,
    query_attendable,
    run_path,
)
from attngeom.store.repair import Repair, repair
from attngeom.store.validate import (
    array_metadata,
    arrays_of,
    check_arrays,
    check_committed,
    check_run,
    damaged_objects,
    lost_objects,
    reading_run,
    validate_run,
    validate_store,
)

__all__ = [
    "Repair", "RunLayout", "SequenceWriter", "Variable", "ABLATION", "ABLATION_GROUPS", "ANALYSIS",
    "ANALYSIS_GROUPS", "ANALYSIS_SEQUENCE_GROUPS", "ATTR_KEY", "COORDS", "DERIVED", "DETECT",
    "DETECT_GROUPS", "FIELD_SUMMARIES", "FORMAT", "LABEL_ORDERS", "LABELS",
    "METHODS", "QUERY_GROUPS", "QUERY_SEQUENCE_GROUPS", "RECENT_WINDOWS", "REGIMES",
    "RUN_ID_PATTERN", "RUN_VARIABLES", "RUNS", "SCHEMA_VERSION", "SCORE_GROUPS",
    "SCORE_SEQUENCE_GROUPS", "SEQUENCE_ARRAYS",
    "SIGNATURE_VARIABLES", "STATS", "SUMMARY_DIMS", "TOPN_COUNTS", "TOPN_FLAGS", "TOPN_FLOATS", "TOPN_VARIABLES",
    "VALUE_STATISTICS", "VOTES", "ablation_path", "analysis_path", "array_metadata", "arrays_of",
    "check_arrays", "check_committed", "check_run", "check_writable", "completed", "compressor", "compressors",
    "consolidate",
    "create_run", "damaged_chunk", "damaged_objects", "default_run_id", "derived_problems",
    "has_checksum", "jsonable", "label_codes", "lacking_message", "lacking_summaries", "label_dtype", "local_path", "lost_objects", "n_sequences",
    "open_dataset", "open_or_create_root", "open_root", "open_run_group", "query_attendable",
    "read_chunk", "read_root_attrs", "read_state", "recovery", "reading_run", "repair", "replace_groups", "require_run_group",
    "require_runs", "resize_run",
    "run_ids", "run_layout", "run_path", "run_provenance", "store_format", "validate_run",
    "validate_store", "with_checksum", "write_dataset", "write_sequence", "writing", "zarr_store",
]

# What loads xarray and Dask, by the module holding it, imported on first use: a command that
# finds its work done (an analyze with nothing to do) reads and checks the store with zarr alone.
_LAZY = {"open_dataset": "datasets", "write_dataset": "datasets", "derived_problems": "derived_read",
         "replace_groups": "derived"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"attngeom.store.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attngeom.store' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
