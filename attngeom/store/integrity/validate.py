"""Checking a store against its contract: one line per problem, never an exception.

Checks, each a function of its own: the metadata (every ``zarr.json`` parses), leftovers of
killed writes (``*.partial``), each run against the schema and its commit flags (a committed
sequence has every stored object, none empty), and with ``deep`` every stored object of every
array: a shard's index (present, whole, listing every inner chunk) and every chunk decoding
(its crc32c checksum). The checks every reader makes before it reads a run are
:mod:`~attngeom.store.extracted.checks`'s; :mod:`~attngeom.store.integrity.repair` repairs what they find.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.errors import AttngeomError, DamagedStoreError, ForeignFileError
from attngeom.store.objects.preflight import RUN_ID_PATTERN, run_created
from attngeom.store.objects._zarr import sync
from attngeom.store.holds.access import (
    consolidated_fault,
    partials,
    quiet_leftovers,
    read_root_attrs,
    stale_consolidated,
    store_format,
)
from attngeom.store.objects.cache import cached
from attngeom.store.objects.codecs import has_checksum
from attngeom.store.objects.damage import (
    DECODE_ERRORS,
    RESTORE,
    Problem,
    damaged_chunk,
    recovery,
)
from attngeom.store.objects.storage import (
    local_path,
    lost_metadata,
    metadata_fault,
    node_metadata,
    node_path,
    foreign_files,
    zarr_store,
)
from attngeom.store.objects.stored_objects import chunk_objects, object_damage, object_sizes
from attngeom.store.integrity.rebuild import broken_metadata, cannot_rebuild, derived_node, rebuild_plan
from attngeom.store.extracted.runs import (
    completed,
    misnamed_runs,
    open_run_group,
    run_ids,
    run_layout,
    sequences_problem,
)
from attngeom.store.objects.schema import (
    ATTR_KEY,
    FORMAT,
    RUN_VARIABLES,
    RUNS,
    SEQUENCE_ARRAYS,
)
from attngeom.store.extracted.checks import (
    array_problems,
    arrays_of,
    committed_damage,
    coordinate_problems,
    expected_objects,
    run_members,
    sequence_count,
)


# Arrays a deep check of an object store reads at once (each holds one stored object in
# memory at a time, a shard read whole).
_REMOTE_READERS = 4


def _ranges(mask: np.ndarray) -> str:
    """The indices where ``mask`` holds, as ranges ("0-3, 7"): found by its edges, so that a
    run of many sequences is not walked one at a time."""
    edges = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0, append=0))
    return ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()))


def validate_run(run: zarr.Group, run_id: str, url: str, unreadable: frozenset[str] = frozenset()) -> list[str]:
    """Problems of one run of the store at ``url``, one line each (empty when valid);
    ``unreadable``: paths of arrays whose ``zarr.json`` does not parse (named elsewhere,
    not missing)."""
    where = f"run {run_id}"
    meta = run.attrs.get(ATTR_KEY)
    if not run_created(meta):
        return [f"{where}: creation was interrupted (no provenance); re-run extract"]
    problems = []
    for key in ("model", "dataset", "context_length", "library_versions", "command_line"):
        if key not in meta:
            problems.append(f"{where}: provenance lacks '{key}'")
    members = run_members(run)
    try:
        layout = run_layout(run)
    except (KeyError, TypeError, *DECODE_ERRORS) as exc:
        return problems + [f"{where}: unreadable layout in provenance ({exc})"]
    except DamagedStoreError as exc:
        return problems + [str(exc).removesuffix(f"; {RESTORE}")]
    n_seq = int(members["complete"].shape[0]) if "complete" in members else None
    problems += array_problems(run, run_id, layout, members, url, unreadable)
    problems += coordinate_problems(run, layout, members, url)
    if problems or n_seq is None:
        return problems
    try:
        done = set(completed(run).tolist())
    except DECODE_ERRORS:
        return problems  # the flags' chunk is damaged: named by the deep check
    written: dict[int, set[str]] = {}
    listed = object_sizes(run.store, f"{run.path}/")
    for name in layout.names():
        if RUN_VARIABLES[name].per_sequence and name != "complete" and name in members:
            for s in {index[0] for index in chunk_objects(members[name], listed)}:
                written.setdefault(s, set()).add(name)
    expected_arrays = {n for n in members if RUN_VARIABLES[n].per_sequence and n != "complete"}
    for s in sorted(done):
        missing = expected_arrays - written.get(s, set())
        if missing:
            problems.append(
                f"{where}: sequence {s} is marked complete but lacks {', '.join(sorted(missing))}; "
                f"{recovery(url, run.path, s)}"
            )
    for s, what in sorted(committed_damage(run, members).items()):
        if "empty" in what:
            problems.append(f"{where}: sequence {s} is marked complete but {what}; {recovery(url, run.path, s)}")
    partly = sorted(s for s in written if s not in done and s < n_seq)
    for s in partly:
        problems.append(f"{where}: sequence {s} is only partly written (interrupted run; re-run the same extract command)")
    unwritten = np.ones(n_seq, dtype=bool)
    unwritten[[s for s in (*done, *written) if s < n_seq]] = False
    if unwritten.any():
        problems.append(f"{where}: sequences {_ranges(unwritten)} of {n_seq} are not written yet (re-run the same extract command)")
    return problems


def damaged_objects(
    arr: zarr.Array, url: str, expected: Iterable[tuple[int, ...]] = (), sequences: set[int] | None = None,
    *, objects: Mapping[tuple[int, ...], int] | None = None,
) -> list[Problem]:
    """Every stored object of ``arr`` that is damaged (:func:`object_damage`), and every
    one of ``expected`` (grid indices) that is missing, each naming its object. With ``sequences``,
    only the objects of those (the committed ones of a run's per-sequence array: the
    others are rewritten by extract, and reported as partly written). ``objects``: the
    array's stored objects (:func:`chunk_objects`) when the caller listed them."""
    objects = chunk_objects(arr) if objects is None else objects

    def problem(index: tuple[int, ...], exc: BaseException) -> Problem:
        key = arr.metadata.chunk_key_encoding.encode_chunk_key(index)
        return Problem(str(damaged_chunk(url, arr, index, exc)), (f"{arr.path}/{key}",))

    problems = [problem(index, FileNotFoundError("missing")) for index in sorted(set(expected) - set(objects))]
    for index, size in sorted(objects.items()):
        if sequences is not None and index[0] not in sequences:
            continue
        try:
            exc = object_damage(arr, index, size)
        except ForeignFileError:
            continue  # named, not read: validate's walk of the store's folder names it
        if exc is not None:
            problems.append(problem(index, exc))
    return problems


def _committed_of(arr: zarr.Array, committed: dict[str, set[int]]) -> set[int] | None:
    """The committed sequences of the run if ``arr`` is one of its per-sequence arrays."""
    parts = arr.path.split("/")
    if len(parts) != 3 or parts[2] not in SEQUENCE_ARRAYS or parts[1] not in committed:
        return None
    return committed[parts[1]]


def metadata_problems(url: str, zstore: Any, nodes: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """One line per ``zarr.json`` that does not parse, or is malformed, or is lost above a
    node (:func:`~attngeom.store.integrity.rebuild.broken_metadata`), saying what rewrites it: its
    stage for a derived group's, ``validate --repair`` for what it can rebuild, else a copy."""
    plan = rebuild_plan(nodes)
    problems = []
    for key in broken_metadata(nodes):
        node = node_path(key)
        if key in nodes:
            raw = sync(zstore.get(key, prototype=default_buffer_prototype()))
            what = metadata_fault(raw.to_bytes() if raw is not None else None)
        else:
            what = ("missing (lost metadata of a run array)" if key.count("/") == 3 and key.startswith("runs/")
                    and not derived_node(key) else "missing (lost metadata of a group: nothing it holds can be reached)")
        if key not in plan:  # a derived group's: its readers name it in the same words
            problems.append(f"{key} is {what}; {recovery(url, node)}")
        elif plan[key] is None:
            problems.append(f"{key} is {what}; it {cannot_rebuild(key).split(' ', 1)[1]}")
        else:
            problems.append(f"{key} is {what}; {recovery(url, node, metadata=True)}")
    return problems


def consolidated_problems(url: str, nodes: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """One line if the root's consolidated metadata (what ``xr.open_zarr`` reads by default)
    is out of date: a writer killed before refreshing it. ``nodes``: every node's metadata
    (:func:`~attngeom.store.objects.storage.node_metadata`). A malformed copy is named as such; a stale
    one is not named while metadata is unreadable or lost (named, and repaired, first)."""
    fault = consolidated_fault(nodes.get("zarr.json"))
    if fault is not None:
        return [f"zarr.json: the root's consolidated metadata (read by xr.open_zarr) is malformed ({fault}); "
                f"run `attngeom validate --store {url} --repair` to rebuild it"]
    if any(meta is None for meta in nodes.values()) or lost_metadata(nodes):
        return []
    stale = stale_consolidated(None, nodes)
    if not stale:
        return []
    more = f" and {len(stale) - 1} more" if len(stale) > 1 else ""
    return [f"the root's consolidated metadata (read by xr.open_zarr) is out of date for {stale[0] or 'the root'}{more} "
            f"(a writer was interrupted); run `attngeom validate --store {url} --repair` to refresh it"]


def link_problems(url: str) -> list[str]:
    """One line per file of the store's folder that no command opens: a link leading outside
    it, a device or pipe (:mod:`attngeom.store.objects.files`)."""
    return list(foreign_files(url, whole=True).values())


def leftover_problems(url: str) -> list[str]:
    """One line per ``*.partial`` object: the leftover of a write killed mid-way."""
    return [
        f"{key} is the leftover of an interrupted write (harmless: the next extract, analyze, ablate "
        f"or migrate that writes the store alone removes it), or a write in progress"
        for key in partials(url)
    ]


def validate_store(url: str, *, deep: bool = False) -> list[str]:
    """Every problem of the store at ``url``, one line each; empty when valid.

    ``deep`` also reads every stored object of every array, so that a damaged one (empty,
    a bad shard index, a checksum or compression failure) is named by array and chunk key.
    """
    path = local_path(url)
    if path is not None and not path.is_dir():
        return [f"no Zarr store at {url}"]
    # One store for the whole check: on an object store every object is read once.
    zstore = cached(zarr_store(url, read_only=True))
    foreign = link_problems(url)
    try:
        nodes = node_metadata(zstore)
    except ForeignFileError:
        return foreign  # metadata that is no file of the store's: nothing more can be read
    bad_metadata = broken_metadata(nodes)
    problems = metadata_problems(url, zstore, nodes) + leftover_problems(url) + foreign
    if "zarr.json" in bad_metadata:
        return problems
    try:
        root = zarr.open_group(zstore, mode="r", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        return [f"no Zarr store at {url}"]
    try:
        meta = read_root_attrs(root, url, writing=False)
    except AttngeomError as exc:
        return problems + [str(exc)]
    fmt = store_format(meta)
    if fmt < FORMAT:
        unseen = " and has no chunk checksums (corruption can go unseen)" if fmt < 2 else ""
        problems.append(
            f"store format {fmt} is older than the one this attngeom writes ({FORMAT}){unseen}; "
            f"run `attngeom migrate --store {url}`"
        )
    problems += consolidated_problems(url, nodes)
    # Here, not at the top: derived_read.py loads xarray, which the store's other checks (a
    # writer's check_committed, an analyze with nothing to do) do without.
    from attngeom.store.derived_groups.derived_read import derived_problems

    unreadable = frozenset(k.rsplit("/", 1)[0] for k in bad_metadata)
    committed: dict[str, set[int]] = {}
    named: set[str] = set()
    with quiet_leftovers():
        problems += [f"{RUNS}/{name} is no run: run ids are letters, digits, '.', '_' and '-' (the group is not "
                     f"read); rename or remove it" for name in misnamed_runs(root)]
        for run_id in readable_runs(root, unreadable):
            try:
                run = open_run_group(root, run_id)
            except ForeignFileError:
                continue  # named by the walk of the store's folder, and not read
            try:
                problems += validate_run(run, run_id, url, unreadable)
            except DECODE_ERRORS as exc:  # a damaged flag or layout chunk: named by --deep
                problems.append(f"run {run_id}: cannot be checked ({type(exc).__name__}: {exc}); run validate --deep")
            except ForeignFileError:
                continue  # named by the walk of the store's folder, and not read
            members = run_members(run)
            try:
                # Flags longer than the run's arrays, or more than this machine holds, are named
                # above, not read.
                n_seq = sequence_count(members)
                fits = "complete" not in members or (members["complete"].shape[0] == n_seq
                                                     and sequences_problem(run_id, n_seq) is None)
                committed[run_id] = set(completed(run).tolist()) if fits else set()
            except (KeyError, *DECODE_ERRORS):
                fits, committed[run_id] = True, set()
            except ForeignFileError:
                fits, committed[run_id] = False, set()
            if not fits:
                continue  # its derived groups are checked against flags that can be read
            # An object named as unreadable metadata above is not named again, nor one
            # named here by the deep check below.
            derived = [p for p in derived_problems(root.store, url, run_id, sorted(committed[run_id]))
                       if not set(p.keys) & set(bad_metadata)]
            named.update(key for p in derived for key in p.keys)
            problems += [p.line for p in derived]
        if deep:
            try:
                listed = object_sizes(zstore, "")  # one listing, not one per array
            except ForeignFileError:
                return list(dict.fromkeys(problems))  # a pipe or device, named: none is read

            def check(arr: zarr.Array) -> list[str]:
                lines = [] if has_checksum(nodes[f"{arr.path}/zarr.json"]) else [
                    f"array '{arr.path}' has no chunk checksums"]
                sequences = _committed_of(arr, committed)
                return lines + [p.line for p in damaged_objects(arr, url, expected_objects(arr, sequences),
                                                                sequences, objects=chunk_objects(arr, listed))
                                if not set(p.keys) & named]

            # An object store's objects are read a few arrays at once: one after the other,
            # each waits for its own round trip. A local disk's are read in turn.
            with ThreadPoolExecutor(1 if path is not None else _REMOTE_READERS) as pool:
                for lines in pool.map(check, arrays_of(root, nodes)):
                    problems += lines
    return list(dict.fromkeys(problems))


def readable_runs(root: zarr.Group, unreadable: frozenset[str]) -> list[str]:
    """Ids of the runs whose group metadata reads; ``unreadable``: paths of the nodes whose
    ``zarr.json`` does not parse."""
    if RUNS in unreadable:
        return []
    try:
        return run_ids(root)
    except DamagedStoreError:

        async def names() -> list[str]:
            return [name async for name in root.store.list_dir(RUNS)]

        return sorted(n for n in sync(names()) if f"{RUNS}/{n}" not in unreadable and "." not in n
                      and RUN_ID_PATTERN.match(n))
