"""Metadata that can be derived from what else a store records: what ``validate --repair``
writes back for a ``zarr.json`` that is unreadable or lost, and what ``validate`` asks it
for (it advises ``--repair`` only for what this rebuilds).

- the root's, from the runs it holds (its three attributes);
- the ``runs`` group's (no attributes);
- a run group's, from the root's consolidated copy (a well-formed one);
- a run array's, from the layout its run records (byte for byte what extract wrote).

A derived group's is rewritten by its stage, not here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.version import __version__
from attngeom.store.objects.preflight import run_created
from attngeom.store.objects._zarr import sync
from attngeom.store.holds.access import consolidated_fault
from attngeom.store.objects.codecs import has_checksum
from attngeom.store.derived_groups.record import STAGING, is_generation
from attngeom.store.objects.storage import lost_metadata
from attngeom.store.extracted.runs import array_metadata_bytes
from attngeom.store.objects.schema import (
    ATTR_KEY,
    DERIVED,
    FIELD_SUMMARIES,
    FORMAT,
    RUN_VARIABLES,
    RUNS,
    SCHEMA_VERSION,
    RunLayout,
)

__all__ = ["broken_metadata", "cannot_rebuild", "derived_node", "rebuild_plan", "rebuilt_metadata"]


def derived_node(key: str) -> bool:
    """Whether the ``zarr.json`` ``key`` belongs to a derived group (its stage rewrites it)."""
    parts = key.split("/")
    return len(parts) >= 4 and parts[0] == RUNS and parts[2] in DERIVED


def rebuilt_metadata(nodes: Mapping[str, Any], key: str) -> bytes | None:
    """The ``zarr.json`` ``key`` derived from ``nodes`` (key -> parsed metadata, None where
    unreadable); None when nothing in the store records it, or it is a derived group's."""
    node = key.rpartition("/")[0]
    parts = node.split("/")
    if derived_node(key):
        return None
    if key == "zarr.json":
        return _root_metadata(nodes)
    if node == RUNS:
        return _group_metadata({})
    if len(parts) == 2 and parts[0] == RUNS:
        root = nodes.get("zarr.json")
        copy = root["consolidated_metadata"]["metadata"] if (
            isinstance(root, Mapping) and root.get("consolidated_metadata") is not None
            and consolidated_fault(root) is None) else {}
        attrs = (copy.get(node) or {}).get("attributes") or {}
        return _group_metadata(attrs) if isinstance(attrs, Mapping) and run_created(attrs.get(ATTR_KEY)) else None
    if len(parts) == 3 and parts[0] == RUNS and parts[2] in RUN_VARIABLES:
        return _array_metadata(nodes, parts[1], parts[2])
    return None


def cannot_rebuild(key: str) -> str:
    """The line for a ``zarr.json`` that :func:`rebuilt_metadata` cannot derive: what to do."""
    node = key.rpartition("/")[0]
    return (f"{key} cannot be rebuilt (nothing in the store records it); restore the store "
            f"from a copy, or remove {'it' if key == 'zarr.json' else node} and extract again")


def broken_metadata(nodes: Mapping[str, Any]) -> list[str]:
    """Keys of the ``zarr.json`` objects of ``nodes`` that are unreadable, and of those lost
    above a node (:func:`~attngeom.store.objects.storage.lost_metadata`) but in a derived group's
    staging or generations: parents first, the root last (its format is read from the arrays)."""
    # A staged group is a writer's work under way, its metadata written last: its rerun
    # writes it again, and readers never read it. A generation no record names is what a
    # writer that lost its hold left (the next writer removes it), and the committed one's
    # objects are checked against its commit.
    lost = [key for key in lost_metadata(nodes)
            if not (derived_node(key) and (key.split("/")[3] == STAGING or is_generation(key.split("/")[3])))]
    broken = [key for key, meta in nodes.items() if meta is None] + lost + _lost_arrays(nodes)
    return sorted(broken, key=lambda key: (99 if key == "zarr.json" else key.count("/"), key))


def _lost_arrays(nodes: Mapping[str, Any]) -> list[str]:
    """Keys of the ``zarr.json`` of the arrays a run's recorded layout names but the store
    lacks (lost, or never written by an interrupted creation): rebuilt from the layout, their
    committed sequences are then found without their chunks and written again by extract."""
    lost = []
    for key, meta in nodes.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != RUNS or not isinstance(meta, Mapping):
            continue
        layout = _layout(nodes, parts[1])
        if layout is not None:
            lost += [f"{RUNS}/{parts[1]}/{name}/zarr.json" for name in layout.names()
                     if f"{RUNS}/{parts[1]}/{name}/zarr.json" not in nodes]
    return lost


def _layout(nodes: Mapping[str, Any], run_id: str) -> RunLayout | None:
    """The layout run ``run_id`` records, without its attendable keys; None without one."""
    layout = _run_attributes(nodes, run_id).get("layout")
    if not isinstance(layout, Mapping) or not run_created(_run_attributes(nodes, run_id)):
        return None
    # A layout recorded before format 5 names no ``lacking``: the run lacks the summaries it
    # does not hold (as ``runs.run_layout`` reads it).
    lacking = layout["lacking"] if "lacking" in layout else [
        name for name in FIELD_SUMMARIES if f"{RUNS}/{run_id}/{name}/zarr.json" not in nodes]
    try:
        return RunLayout(**{**layout, "head_kv": tuple(layout["head_kv"]), "window": tuple(layout["window"]),
                            "queries": tuple(layout.get("queries", ())), "layers": tuple(layout.get("layers", ())),
                            "layer_kv_heads": tuple(layout.get("layer_kv_heads", ())),
                            "layer_head_dims": tuple(layout.get("layer_head_dims", ())),
                            "lacking": tuple(lacking)}, attendable=())
    except (KeyError, TypeError):
        return None


def rebuild_plan(nodes: Mapping[str, Any]) -> dict[str, bytes | None]:
    """Key -> what ``validate --repair`` writes back (None: it cannot) for every key of
    :func:`broken_metadata` but a derived group's, each derived from what the store records
    once the ones before it are written back."""
    known = dict(nodes)
    plan: dict[str, bytes | None] = {}
    for key in broken_metadata(nodes):
        if derived_node(key):
            continue
        plan[key] = data = rebuilt_metadata(known, key)
        if data is not None:
            known[key] = json.loads(data)  # a run's arrays are derived from its group, rebuilt first
    return plan


def _group_metadata(attributes: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` of a group with ``attributes``, as zarr writes it."""
    memory = zarr.storage.MemoryStore()
    zarr.create_group(memory, zarr_format=3, attributes=dict(attributes))
    return sync(memory.get("zarr.json", prototype=default_buffer_prototype())).to_bytes()


def _run_attributes(nodes: Mapping[str, Any], run_id: str) -> Mapping[str, Any]:
    meta = nodes.get(f"{RUNS}/{run_id}/zarr.json") or {}
    attrs = meta.get("attributes") or {}
    found = attrs.get(ATTR_KEY) if isinstance(attrs, Mapping) else None
    return found if isinstance(found, Mapping) else {}


def _root_metadata(nodes: Mapping[str, Any]) -> bytes | None:
    """The root's ``zarr.json`` from the runs the store holds: schema version 1; the format
    its arrays are written in (no checksums: 1, zarr-python strings: 2); created by the
    attngeom of its first run. None when the store holds no run."""
    runs = sorted({key.split("/")[1] for key in nodes if key.startswith(f"{RUNS}/") and key.count("/") == 2})
    if not runs:
        return None
    arrays = [meta for meta in nodes.values() if isinstance(meta, Mapping) and meta.get("node_type") == "array"]
    fmt = FORMAT
    if any(meta.get("data_type") == "string" for meta in arrays):
        fmt = 2
    if any(not has_checksum(meta) for meta in arrays):
        fmt = 1
    created_by = str(_run_attributes(nodes, runs[0]).get("attngeom_version") or __version__)
    attrs = {"schema_version": SCHEMA_VERSION, "format": fmt, "created_by": created_by}
    return _group_metadata({ATTR_KEY: attrs if fmt > 1 else {"schema_version": SCHEMA_VERSION,
                                                             "created_by": created_by}})


def _array_metadata(nodes: Mapping[str, Any], run_id: str, name: str) -> bytes | None:
    """A run array's ``zarr.json`` from the layout the run records, sized for as many
    sequences as its other per-sequence arrays; None without a layout."""
    layout = _layout(nodes, run_id)
    if layout is None or name not in layout.names():
        return None
    sizes = [
        meta["shape"][0] for key, meta in nodes.items()
        if key.startswith(f"{RUNS}/{run_id}/") and key.count("/") == 3 and isinstance(meta, Mapping)
        and tuple(meta.get("dimension_names") or ())[:1] == ("seq",)
    ]
    return array_metadata_bytes(name, layout, max(sizes, default=0))
