"""Repairing a store (``validate --repair``): what can be derived is rebuilt, what is damaged
in a committed sequence is uncommitted for extract to rewrite.

- Metadata: a run array's ``zarr.json`` from the layout its run records (byte for byte what
  extract wrote), the ``runs`` group's, a run group's from the root's consolidated copy,
  the root's from the runs it holds (its three attributes). A derived group's is rewritten
  by its stage, not here.
- Coordinates: a run's coordinate array (layer, head, ...) not holding what its layout
  records (a lost chunk reads as zeros) is written again.
- Sequences: a committed sequence with a missing, empty (and with ``deep``, corrupt) object
  is uncommitted, so that the run's extract command rewrites it.
- Derived groups, with ``deep``: an object failing to decode is removed, so that the next
  analyze (which compares the objects with those its commit lists) rewrites it.
- The root's consolidated metadata is refreshed when stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zarr
from zarr.buffer import default_buffer_prototype
from attngeom.store._zarr import sync

from attngeom import __version__
from attngeom.errors import StoreNotFoundError
from attngeom.store.access import (
    check_writable,
    consolidate,
    open_root,
    quiet_leftovers,
    stale_consolidated,
    writing,
)
from attngeom.store.damage import DECODE_ERRORS
from attngeom.store.nodes import local_path, node_metadata, zarr_store
from attngeom.store.codecs import has_checksum
from attngeom.store.objects import chunk_key, chunk_objects, object_damage
from attngeom.store.runs import array_metadata_bytes, completed, open_run_group, run_coordinates, run_layout
from attngeom.store.validate import arrays_of, committed_damage, readable_runs, wrong_coordinates
from attngeom.store.schema import (
    ATTR_KEY,
    DERIVED,
    FORMAT,
    RUN_VARIABLES,
    RUNS,
    SCHEMA_VERSION,
    SEQUENCE_ARRAYS,
    RunLayout,
)

__all__ = ["Repair", "repair"]


@dataclass(frozen=True)
class Repair:
    """What a repair did: ``rebuilt`` the ``zarr.json`` keys and coordinate chunks written again, ``uncommitted``
    run id -> the sequences uncommitted, ``removed`` the damaged derived objects removed,
    ``refreshed`` whether the consolidated metadata was refreshed; ``unrepairable`` one line
    for each thing it cannot repair, saying what to do."""

    rebuilt: tuple[str, ...] = ()
    uncommitted: dict[str, list[int]] | None = None
    removed: tuple[str, ...] = ()
    refreshed: bool = False
    unrepairable: tuple[str, ...] = ()


def repair(url: str, *, deep: bool = False) -> Repair:
    """Repair the store at ``url`` (see the module). Raises :class:`StoreNotFoundError` when
    there is no store, :class:`StoreWriteError` when it cannot be written."""
    path = local_path(url)
    if path is not None and not (path / "zarr.json").is_file():
        raise StoreNotFoundError(f"no attngeom store at {url}")
    check_writable(url)
    zstore = zarr_store(url, read_only=False)
    with writing(url):
        rebuilt, cannot = _rebuild_metadata(zstore)
        unrepairable = tuple(cannot.values())
        if "zarr.json" in cannot:
            return Repair(tuple(rebuilt), {}, unrepairable=unrepairable)
        root = open_root(url, mode="a")
        unreadable = frozenset(key.rpartition("/")[0] for key in cannot)
        runs = readable_runs(root, unreadable)
        rebuilt += _rewrite_coordinates(root, runs)
        uncommitted = _uncommit(root, runs, deep)
        removed = _remove_damaged_derived(root) if deep else []
        refreshed = False
        remaining = [key for key, meta in node_metadata(zstore).items() if meta is None]
        if not remaining and (any(key.endswith("zarr.json") for key in rebuilt) or stale_consolidated(zstore)):
            consolidate(root)
            refreshed = True
    return Repair(tuple(rebuilt), uncommitted, tuple(removed), refreshed, unrepairable)


def _depth(key: str) -> tuple[int, str]:
    """Parents before children, the root last (its format is read from the arrays)."""
    return (99 if key == "zarr.json" else key.count("/"), key)


def _rebuild_metadata(zstore: Any) -> tuple[list[str], dict[str, str]]:
    """Write again every ``zarr.json`` that does not parse and can be derived; the keys
    rebuilt, and key -> one line for each that cannot be."""
    nodes = node_metadata(zstore)
    root = nodes.get("zarr.json")
    copy = ((root or {}).get("consolidated_metadata") or {}).get("metadata") or {}
    rebuilt: list[str] = []
    cannot: dict[str, str] = {}
    for key in sorted((k for k, m in nodes.items() if m is None), key=_depth):
        node = key.rpartition("/")[0]
        parts = node.split("/")
        if len(parts) >= 3 and parts[0] == RUNS and parts[2] in DERIVED:
            continue  # rewritten by its stage, as validate says
        if key == "zarr.json":
            data = _root_metadata(nodes)
        elif node == RUNS:
            data = _group_metadata({})
        elif len(parts) == 2 and parts[0] == RUNS:
            attrs = (copy.get(node) or {}).get("attributes") or {}
            data = _group_metadata(attrs) if (attrs.get(ATTR_KEY) or {}).get("initialized") else None
        elif len(parts) == 3 and parts[0] == RUNS and parts[2] in RUN_VARIABLES:
            data = _array_metadata(nodes, parts[1], parts[2])
        else:
            data = None
        if data is None:
            cannot[key] = (f"{key} cannot be rebuilt (nothing in the store records it); restore the store "
                           f"from a copy, or remove {'it' if key == 'zarr.json' else node} and extract again")
            continue
        sync(zstore.set(key, default_buffer_prototype().buffer.from_bytes(data)))
        nodes[key] = {}  # readable now (its content is not needed by what follows)
        rebuilt.append(key)
    return rebuilt, cannot


def _group_metadata(attributes: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` of a group with ``attributes``, as zarr writes it."""
    memory = zarr.storage.MemoryStore()
    zarr.create_group(memory, zarr_format=3, attributes=dict(attributes))
    return sync(memory.get("zarr.json", prototype=default_buffer_prototype())).to_bytes()


def _run_attributes(nodes: Mapping[str, Any], run_id: str) -> Mapping[str, Any]:
    meta = nodes.get(f"{RUNS}/{run_id}/zarr.json") or {}
    return (meta.get("attributes") or {}).get(ATTR_KEY) or {}


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
    layout = _run_attributes(nodes, run_id).get("layout")
    if not isinstance(layout, Mapping):
        return None
    layout = RunLayout(**{**layout, "head_kv": tuple(layout["head_kv"]), "window": tuple(layout["window"]),
                          "queries": tuple(layout.get("queries", ()))}, attendable=())
    if name not in layout.names():
        return None
    sizes = [
        meta["shape"][0] for key, meta in nodes.items()
        if key.startswith(f"{RUNS}/{run_id}/") and key.count("/") == 3 and isinstance(meta, Mapping)
        and tuple(meta.get("dimension_names") or ())[:1] == ("seq",)
    ]
    return array_metadata_bytes(name, layout, max(sizes, default=0))


def _rewrite_coordinates(root: zarr.Group, runs: list[str]) -> list[str]:
    """Write again every coordinate array of ``runs`` that does not hold what its run's
    layout records; their chunk keys."""
    rewritten = []
    for run_id in runs:
        run = open_run_group(root, run_id)
        try:
            layout = run_layout(run)
        except (KeyError, TypeError, *DECODE_ERRORS):
            continue  # named by validate
        members = {name: run[name] for name in run_coordinates(layout) if name in run}
        for name in wrong_coordinates(layout, members):
            members[name][...] = run_coordinates(layout)[name]
            rewritten.append(f"{run.path}/{name}/c/0")
    return rewritten


def _uncommit(root: zarr.Group, runs: list[str], deep: bool) -> dict[str, list[int]]:
    """Uncommit (reset ``complete`` to 0) every committed sequence of ``runs`` with a missing
    or empty stored object (and with ``deep``, one that fails to decode). Run id -> the
    sequences."""
    out: dict[str, list[int]] = {}
    with quiet_leftovers():
        for run_id in runs:
            run = open_run_group(root, run_id)
            if "complete" not in run:
                continue
            bad = set(committed_damage(run))
            if deep:
                done = set(completed(run).tolist())
                for name in SEQUENCE_ARRAYS:
                    if name in run:
                        arr = run[name]
                        bad |= {
                            index[0] for index, size in chunk_objects(arr).items()
                            if index[0] in done and object_damage(arr, index, size) is not None
                        }
            for s in sorted(bad):
                run["complete"][s] = 0
            if bad:
                out[run_id] = sorted(bad)
    return out


def _remove_damaged_derived(root: zarr.Group) -> list[str]:
    """Remove every object of a derived group that fails to decode; their keys."""
    removed = []
    for arr in arrays_of(root):
        parts = arr.path.split("/")
        if len(parts) < 3 or parts[0] != RUNS or parts[2] not in DERIVED:
            continue
        for index, size in sorted(chunk_objects(arr).items()):
            if object_damage(arr, index, size) is not None:
                key = chunk_key(arr, index)
                sync(root.store.delete(key))
                removed.append(key)
    return removed
