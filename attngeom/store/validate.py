"""Checking a store against its contract: one line per problem, never an exception."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from attngeom.errors import AttngeomError
from attngeom.store.access import read_root_attrs, store_format, zarr_store
from attngeom.store.codecs import has_checksum
from attngeom.store.derived import derived_problems
from attngeom.store.runs import completed, open_run_group, run_ids, run_layout
from attngeom.store.schema import ATTR_KEY, FORMAT, RUN_VARIABLES


def _written_sequences(run: zarr.Group, name: str) -> set[int]:
    arr = run[name]
    prefix = f"{arr.path}/c/"

    async def collect() -> set[int]:
        found: set[int] = set()
        async for key in arr.store.list_prefix(prefix):
            head = key[len(prefix) :].split("/", 1)[0]
            if head.isdigit():
                found.add(int(head))
        return found

    return sync(collect())


def _ranges(indices: Iterable[int]) -> str:
    idx = sorted(indices)
    parts, start = [], None
    for a, b in zip(idx, idx[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ", ".join(parts)


def validate_run(run: zarr.Group, run_id: str) -> list[str]:
    """Problems of one run, one line each (empty when valid)."""
    where = f"run {run_id}"
    meta = run.attrs.get(ATTR_KEY)
    if not isinstance(meta, Mapping) or not meta.get("initialized"):
        return [f"{where}: creation was interrupted (no provenance); re-run extract"]
    problems = []
    for key in ("model", "dataset", "context_length", "library_versions", "command_line"):
        if key not in meta:
            problems.append(f"{where}: provenance lacks '{key}'")
    try:
        layout = run_layout(run)
    except (KeyError, TypeError) as exc:
        return problems + [f"{where}: unreadable layout in provenance ({exc})"]
    members = dict(run.arrays())
    n_seq = int(members["complete"].shape[0]) if "complete" in members else None
    for name in layout.names():
        var = RUN_VARIABLES[name]
        if name not in members:
            problems.append(f"{where}: missing array '{name}'")
            continue
        arr = members[name]
        dims = tuple(arr.metadata.dimension_names or ())
        if dims != var.dims:
            problems.append(f"{where}: array '{name}' has dims {dims}, expected {var.dims}")
        if str(arr.dtype) not in var.dtypes:
            problems.append(f"{where}: array '{name}' has dtype {arr.dtype}, expected {' or '.join(var.dtypes)}")
        expected = layout.shape(name, n_seq if n_seq is not None else arr.shape[0])
        if tuple(arr.shape) != expected:
            problems.append(f"{where}: array '{name}' has shape {tuple(arr.shape)}, expected {expected}")
    if problems or n_seq is None:
        return problems
    done = set(completed(run).tolist())
    written: dict[int, set[str]] = {}
    for name in layout.names():
        if RUN_VARIABLES[name].per_sequence and name != "complete":
            for s in _written_sequences(run, name):
                written.setdefault(s, set()).add(name)
    expected_arrays = {n for n in layout.names() if RUN_VARIABLES[n].per_sequence and n != "complete"}
    for s in sorted(done):
        missing = expected_arrays - written.get(s, set())
        if missing:
            problems.append(f"{where}: sequence {s} is marked complete but lacks {', '.join(sorted(missing))}")
    partly = sorted(s for s in written if s not in done and s < n_seq)
    for s in partly:
        problems.append(f"{where}: sequence {s} is only partly written (interrupted run; re-run the same extract command)")
    unwritten = [s for s in range(n_seq) if s not in done and s not in written]
    if unwritten:
        problems.append(f"{where}: sequences {_ranges(unwritten)} of {n_seq} are not written yet (re-run the same extract command)")
    return problems


def corrupt_chunks(arr: zarr.Array) -> list[str]:
    """Read every stored chunk (every shard) of ``arr``; one line per chunk that fails to
    decode, its checksum included."""
    grid = arr.shards or arr.chunks
    counts = [max(1, -(-n // c)) for n, c in zip(arr.shape, grid)]
    problems = []
    for index in np.ndindex(*counts):
        region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, grid, arr.shape))
        try:
            arr[region]
        except Exception as exc:  # a corrupt chunk surfaces as any codec's error
            key = "/".join(str(i) for i in index)
            problems.append(f"array '{arr.path}' chunk c/{key} is corrupt ({type(exc).__name__}: {exc})")
    return problems


def array_metadata(arr: zarr.Array) -> dict[str, Any]:
    """The array's ``zarr.json``, as stored."""
    raw = sync(arr.store.get(f"{arr.path}/zarr.json", prototype=default_buffer_prototype()))
    return json.loads(raw.to_bytes())


def arrays_of(root: zarr.Group) -> list[zarr.Array]:
    """Every array of the store, run and derived, in path order."""
    members = root.members(max_depth=None, use_consolidated_for_children=False)
    return sorted((node for _, node in members if isinstance(node, zarr.Array)), key=lambda a: a.path)


def validate_store(url: str, *, deep: bool = False) -> list[str]:
    """Every problem of the store at ``url``, one line each; empty when valid.

    ``deep`` also reads every chunk of every array, so that a corrupt chunk (its crc32c
    checksum, or its compression) is named by array and chunk key.
    """
    try:
        root = zarr.open_group(zarr_store(url, read_only=True), mode="r", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        return [f"no Zarr store at {url}"]
    try:
        meta = read_root_attrs(root, url, writing=False)
    except AttngeomError as exc:
        return [str(exc)]
    problems: list[str] = []
    if store_format(meta) < FORMAT:
        problems.append(
            f"store format {store_format(meta)} has no chunk checksums (corruption can go unseen); "
            f"run `attngeom migrate --store {url}`"
        )
    for run_id in run_ids(root):
        run = open_run_group(root, run_id)
        problems += validate_run(run, run_id)
        problems += derived_problems(url, run_id, completed(run).tolist() if "complete" in run else [])
    if deep:
        for arr in arrays_of(root):
            if not has_checksum(array_metadata(arr)):
                problems.append(f"array '{arr.path}' has no chunk checksums")
            problems += corrupt_chunks(arr)
    return problems
