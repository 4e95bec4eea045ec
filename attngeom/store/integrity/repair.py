"""Repairing a store (``validate --repair``): what can be derived is rebuilt, what is damaged
in a committed sequence is uncommitted for extract to rewrite.

- Metadata, unreadable or lost: what :mod:`~attngeom.store.integrity.rebuild` derives (a run array's
  from its run's layout, the ``runs`` group's, a run group's from the root's consolidated
  copy, the root's from its runs). A derived group's is rewritten by its stage, not here.
- Coordinates: a run's coordinate array (layer, head, ...) not holding what its layout
  records (a lost chunk reads as zeros) is written again.
- Lengths: a run whose per-sequence arrays disagree in length (two appenders that grew it
  at once, before appends took turns on object stores) is given one length again, that of
  its stored objects (the longest array's at most, the shortest's at least); its arrays'
  other dimensions must be its layout's, else it is named as one that cannot be repaired.
- Sequences: a committed sequence with a missing, empty (and with ``deep``, corrupt) object
  is uncommitted, so that the run's extract command rewrites it.
- Derived groups, with ``deep``: an object failing to decode is removed, so that the next
  analyze (which compares the objects with those its commit lists) rewrites it.
- The root's consolidated metadata is refreshed when stale or malformed; a malformed one
  that cannot be refreshed yet (metadata left for a stage to rewrite) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zarr
from zarr.buffer import default_buffer_prototype
from attngeom.store.objects._zarr import sync

from attngeom.errors import StoreNotFoundError
from attngeom.store.holds.access import (
    check_writable,
    consolidate,
    consolidated_fault,
    open_root,
    quiet_leftovers,
    stale_consolidated,
    writing,
)
from attngeom.store.objects.damage import DECODE_ERRORS, RESTORE
from attngeom.store.objects.storage import (
    local_path,
    lost_metadata,
    metadata_bytes,
    node_metadata,
    put_objects,
    read_metadata,
    zarr_store,
)
from attngeom.store.objects.stored_objects import chunk_key, chunk_objects, object_damage, object_sizes
from attngeom.store.integrity.rebuild import cannot_rebuild, rebuild_plan
from attngeom.store.extracted.runs import completed, open_run_group, run_coordinates, run_layout
from attngeom.store.extracted.checks import arrays_of, committed_damage, wrong_coordinates
from attngeom.store.integrity.validate import readable_runs
from attngeom.store.objects.schema import DERIVED, RUN_VARIABLES, RUNS, SEQUENCE_ARRAYS

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
        resized, uneven = _even_lengths(root, runs)
        rebuilt += resized
        unrepairable += uneven
        uncommitted = _uncommit(root, runs, deep)
        removed = _remove_damaged_derived(root) if deep else []
        refreshed = False
        nodes = node_metadata(zstore)
        remaining = [key for key, meta in nodes.items() if meta is None] + lost_metadata(nodes)
        malformed = consolidated_fault(nodes.get("zarr.json")) is not None
        if not remaining and (any(key.endswith("zarr.json") for key in rebuilt) or malformed
                              or stale_consolidated(zstore, nodes)):
            consolidate(root)
            refreshed = True
        elif malformed:
            # Not to be refreshed before the rest is rewritten (by analyze, say), and read by
            # xr.open_zarr meanwhile: without a copy it reads each node's own metadata.
            own = {key: value for key, value in nodes["zarr.json"].items() if key != "consolidated_metadata"}
            put_objects(zstore, {"zarr.json": metadata_bytes(own)})
            rebuilt.append("zarr.json")
    return Repair(tuple(rebuilt), uncommitted, tuple(removed), refreshed, unrepairable)


def _rebuild_metadata(zstore: Any) -> tuple[list[str], dict[str, str]]:
    """Write again every ``zarr.json`` that does not parse or is lost above a node and can be
    derived (:func:`~attngeom.store.integrity.rebuild.rebuild_plan`); the keys rebuilt, and key -> one
    line for each that cannot be."""
    rebuilt: list[str] = []
    cannot: dict[str, str] = {}
    for key, data in rebuild_plan(node_metadata(zstore)).items():
        if data is None:
            cannot[key] = cannot_rebuild(key)
            continue
        sync(zstore.set(key, default_buffer_prototype().buffer.from_bytes(data)))
        rebuilt.append(key)
    return rebuilt, cannot


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


def _even_lengths(root: zarr.Group, runs: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """Give the per-sequence arrays of each of ``runs`` one length again where they disagree:
    one past the last sequence any of them stores an object of, kept within their lengths.
    Only their ``zarr.json`` is rewritten (a resize through zarr visits every chunk
    position of a shrinking array: an absurd length takes forever). The keys rewritten, and
    one line for each run whose arrays disagree otherwise than in length."""
    rewritten, cannot = [], []
    for run_id in runs:
        run = open_run_group(root, run_id)
        try:
            layout = run_layout(run)
            arrays = {name: run[name] for name in layout.names() if RUN_VARIABLES[name].per_sequence and name in run}
        except (KeyError, TypeError, *DECODE_ERRORS):
            continue  # named by validate
        lengths = {name: int(arr.shape[0]) for name, arr in arrays.items()}
        if len(set(lengths.values())) < 2:
            continue
        odd = [name for name, arr in arrays.items() if tuple(arr.shape[1:]) != layout.shape(name, 0)[1:]]
        if odd:
            cannot.append(f"run {run_id}: arrays {', '.join(odd)} disagree with the run's layout beyond their "
                          f"length, so its arrays' lengths are left as they are; {RESTORE}")
            continue
        listed = object_sizes(run.store, f"{run.path}/")
        stored = max((index[0] + 1 for arr in arrays.values() for index in chunk_objects(arr, listed)), default=0)
        n_seq = min(max(stored, min(lengths.values())), max(lengths.values()))
        for name, arr in arrays.items():
            if lengths[name] != n_seq:
                key = f"{arr.path}/zarr.json"
                meta = read_metadata(run.store, arr.path)
                put_objects(run.store, {key: metadata_bytes({**meta, "shape": [n_seq, *meta["shape"][1:]]})})
                rewritten.append(key)
    return rewritten, tuple(cannot)


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
