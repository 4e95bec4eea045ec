"""The checks every reader of a run makes before it reads: its arrays against the run's
layout and the schema (metadata only), and each committed sequence's stored objects present
and not empty. One exception naming the damage and what repairs it; the store's whole check,
one line per problem, is :mod:`~attngeom.store.integrity.validate`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.errors import DamagedStoreError
from attngeom.limits import exceeds_memory
from attngeom.store.objects._zarr import sync
from attngeom.store.holds.access import quiet_leftovers
from attngeom.store.objects.damage import (
    DECODE_ERRORS,
    RESTORE,
    damaged_chunk,
    metadata_damage,
    recovery,
    stored_grid,
    unreadable_metadata,
)
from attngeom.store.objects.storage import node_metadata, node_path, read_metadata
from attngeom.store.objects.stored_objects import chunk_objects, object_damage, object_sizes
from attngeom.store.extracted.runs import (
    completed,
    run_coordinates,
    run_layout,
    sequences_problem,
)
from attngeom.store.objects.schema import (
    ATTR_KEY,
    DERIVED,
    ENCODING,
    RUN_VARIABLES,
    RUNS,
    SEQUENCE_ARRAYS,
    VALUE_ENCODINGS,
    RunLayout,
)

# What a grid index of an expected object takes in memory (a tuple of a few ints).
_INDEX_BYTES = 100


def lost_objects(run: zarr.Group, members: Mapping[str, zarr.Array] | None = None,
                 ) -> dict[str, dict[tuple[int, ...], Exception]]:
    """Per-sequence array -> grid index -> why (:class:`FileNotFoundError`: missing,
    :class:`EOFError`: empty) for each stored object (shard, or chunk) that a committed
    sequence must have and that is missing or empty: read, it would be the fill value. One
    listing of the run (on an object store, a page per thousand objects; one per array asked
    for at least one each); data are not read. ``members``: the run's arrays
    (:func:`run_members`) when the caller has them."""
    members = run_members(run) if members is None else members
    done = set(completed(run).tolist())
    listed = object_sizes(run.store, f"{run.path}/")
    lost: dict[str, dict[tuple[int, ...], Exception]] = {}
    for name in SEQUENCE_ARRAYS:
        if name not in members:
            continue
        objects = chunk_objects(members[name], listed)
        for index in expected_objects(members[name], done):
            size = objects.get(index)
            if not size:
                why = FileNotFoundError("missing") if size is None else EOFError("empty, 0 bytes")
                lost.setdefault(name, {})[index] = why
    return lost


def committed_damage(run: zarr.Group, members: Mapping[str, zarr.Array] | None = None) -> dict[int, str]:
    """Committed sequence -> what is wrong with its stored objects: an array with no object
    (shard) for it, or an empty one (:func:`lost_objects`)."""
    damage: dict[int, str] = {}
    for name, lost in lost_objects(run, members).items():
        for index, why in lost.items():
            what = "missing" if isinstance(why, FileNotFoundError) else "empty (0 bytes)"
            damage.setdefault(index[0], f"its '{name}' chunk is {what}")
    return damage


def check_arrays(url: str, run: zarr.Group, run_id: str, members: Mapping[str, zarr.Array] | None = None,
                 ) -> RunLayout | None:
    """Raise :class:`DamagedStoreError` for the first array of the run that is missing,
    unreadable or contradicts the run's layout (:func:`array_problems`): metadata only, before
    anything is read by a shape it gives. Returns the layout (None when it does not read:
    that is met, and named, where it is read). ``members``: the run's arrays when the
    caller has them."""
    try:
        layout = run_layout(run)
    except (KeyError, TypeError, *DECODE_ERRORS):
        return None
    problems = array_problems(run, run_id, layout, run_members(run) if members is None else members, url)
    if problems:
        remedied = problems[0].startswith(RUNS) or problems[0].endswith(even_lengths(url))
        raise DamagedStoreError(problems[0] if remedied else f"{problems[0]}; {RESTORE}")
    return layout


def check_committed(url: str, run: zarr.Group, run_id: str) -> None:
    """Raise :class:`DamagedStoreError` for an array of the run that is missing, unreadable or
    contradicts the run's layout (:func:`array_problems`), for the first committed sequence
    whose stored objects are missing or empty (see :func:`committed_damage`), or for a
    coordinate array not holding what the run's layout records (read whole: they are small)."""
    members = run_members(run)
    layout = check_arrays(url, run, run_id, members)
    damage = committed_damage(run, members)
    if damage:
        s = min(damage)
        more = f" (and {len(damage) - 1} more sequences)" if len(damage) > 1 else ""
        raise DamagedStoreError(
            f"run {run_id}: committed sequence {s}: {damage[s]}{more}; {recovery(url, f'{RUNS}/{run_id}', s)}"
        )
    problems = coordinate_problems(run, layout, members, url) if layout is not None else []
    if problems:
        raise DamagedStoreError(problems[0])


def check_run(url: str, run: zarr.Group, run_id: str) -> None:
    """Raise :class:`DamagedStoreError` for a run whose metadata does not parse (its derived
    groups aside) or with a committed sequence missing a stored object: what a writer
    checks before it reports success."""
    for key in unreadable_metadata(run.store, run.path):
        if key.split("/")[2] not in DERIVED:
            raise DamagedStoreError(
                f"{key} is empty or truncated (unreadable JSON); {recovery(url, key.rpartition('/')[0], metadata=True)}"
            )
    check_committed(url, run, run_id)


@contextlib.contextmanager
def reading_run(url: str, run: zarr.Group, run_id: str) -> Iterator[None]:
    """Read a run's arrays directly (not through ``open_dataset``): a chunk failing to decode
    is raised as :class:`CorruptChunkError` naming the first damaged stored object of the
    run's committed sequences (found by reading them, only once something failed)."""
    try:
        yield
    except DECODE_ERRORS as exc:
        if unreadable_metadata(run.store, run.path):
            raise metadata_damage(url, run.path, exc) from exc
        done = set(completed(run).tolist())
        members = run_members(run)
        for name in SEQUENCE_ARRAYS:
            if name not in members:
                continue
            for index, size in sorted(chunk_objects(members[name]).items()):
                if index[0] in done and (why := object_damage(members[name], index, size)) is not None:
                    raise damaged_chunk(url, members[name], index, why) from exc
        raise DamagedStoreError(f"run {run_id} cannot be read ({type(exc).__name__}: {exc}); {RESTORE}") from exc


def run_members(run: zarr.Group) -> dict[str, zarr.Array]:
    """The run's arrays whose metadata reads (unreadable ones are named by metadata checks):
    one listing and every member's metadata read at once, or where one does not read, each
    member looked up in turn."""
    try:
        with quiet_leftovers():
            found = dict(run.members())
    except (KeyError, TypeError, *DECODE_ERRORS):
        found = None
    out = {}
    for name in RUN_VARIABLES:
        if found is not None:
            node = found.get(name)
        else:
            try:
                node = run[name]
            except (KeyError, *DECODE_ERRORS):
                continue
        if isinstance(node, zarr.Array):
            out[name] = node
    return out


def wrong_coordinates(layout: RunLayout, members: Mapping[str, zarr.Array]) -> list[str]:
    """The run's coordinate arrays that do not hold what its layout records (a lost chunk
    reads as zeros; a damaged one does not decode)."""
    wrong = []
    for name, values in run_coordinates(layout).items():
        if name == "attendable" or name not in members:  # attendable: recorded nowhere else
            continue
        if members[name].shape != np.shape(values):
            continue  # named by its shape (array_problems), not read by it
        try:
            same = np.array_equal(members[name][...], values)
        except DECODE_ERRORS:
            same = False
        if not same:
            wrong.append(name)
    return wrong


def coordinate_problems(run: zarr.Group, layout: RunLayout, members: Mapping[str, zarr.Array], url: str) -> list[str]:
    """One line per coordinate array that does not hold what the run's layout records."""
    return [
        f"run {run.path.rsplit('/', 1)[-1]}: coordinate '{name}' does not hold what the run's layout records "
        f"(a lost or damaged chunk); run `attngeom validate --store {url} --repair` to rewrite it"
        for name in wrong_coordinates(layout, members)
    ]


def array_problems(run: zarr.Group, run_id: str, layout: RunLayout, members: Mapping[str, zarr.Array], url: str,
                   unreadable: frozenset[str] = frozenset()) -> list[str]:
    """One line per array of the run's ``layout`` that is missing, whose metadata cannot be
    read as an array (an unknown codec), or whose dims, dtype or shape contradict the layout
    and the run's other arrays (:func:`sequence_count`). Metadata only.
    ``unreadable``: paths of arrays whose ``zarr.json`` does not parse (named elsewhere)."""
    where = f"run {run_id}"
    n_seq = sequence_count(members)
    too_many = sequences_problem(run_id, n_seq) if n_seq is not None else None
    problems = [] if too_many is None else [too_many]
    for name in layout.names():
        var = RUN_VARIABLES[name]
        if name not in members:
            if f"{run.path}/{name}" in unreadable:
                continue
            path = f"{run.path}/{name}"
            why = _member_error(run, name)
            if why is None:
                problems.append(f"{where}: missing array '{name}'")
            elif read_metadata(run.store, path) is None:
                problems.append(f"{path}/zarr.json is empty or truncated (unreadable JSON); "
                                f"{recovery(url, path, metadata=True)}")
            else:
                problems.append(f"{path}/zarr.json is not an array this attngeom reads ({type(why).__name__}: "
                                f"{why}); {RESTORE}")
            continue
        arr = members[name]
        dims = tuple(arr.metadata.dimension_names or ())
        if dims != var.dims:
            problems.append(f"{where}: array '{name}' has dims {dims}, expected {var.dims}")
        if str(arr.dtype) not in var.dtypes:
            problems.append(f"{where}: array '{name}' has dtype {arr.dtype}, expected {' or '.join(var.dtypes)}")
        encoding = (arr.attrs.get(ATTR_KEY) or {}).get(ENCODING) if name == "values" else None
        if name == "values" and encoding != (layout.values_dtype if layout.values_dtype in VALUE_ENCODINGS else None):
            # Read without it, bfloat16 bit patterns would pass for numbers.
            problems.append(f"{where}: array 'values' names the encoding {encoding!r}, but the run's values_dtype "
                            f"is {layout.values_dtype!r}; {RESTORE}")
        expected = layout.shape(name, n_seq if n_seq is not None else arr.shape[0])
        if tuple(arr.shape) != expected:
            line = f"{where}: array '{name}' has shape {tuple(arr.shape)}, expected {expected}"
            if tuple(arr.shape[1:]) == expected[1:]:
                line += f" (the run's arrays disagree in length); {even_lengths(url)}"
            problems.append(line)
    return problems


def even_lengths(url: str) -> str:
    """The remedy of a run whose arrays disagree in length (:mod:`~attngeom.store.integrity.repair`)."""
    return f"run `attngeom validate --store {url} --repair` to give them one length again"


def sequence_count(members: Mapping[str, zarr.Array]) -> int | None:
    """The sequences the run's arrays are sized for: the shortest of its per-sequence arrays
    (``complete`` included), so that one array claiming more than the others is named rather
    than read; None for a run with none."""
    lengths = [int(arr.shape[0]) for name, arr in members.items() if RUN_VARIABLES[name].per_sequence]
    return min(lengths) if lengths else None


def _member_error(run: zarr.Group, name: str) -> Exception | None:
    """Why the run's member ``name`` does not open as an array; None when it is absent."""
    try:
        run[name]
    except KeyError:
        return None
    except DECODE_ERRORS as exc:
        return exc
    return None


def expected_objects(arr: zarr.Array, sequences: set[int] | None) -> list[tuple[int, ...]]:
    """Grid indices that must be stored: those of the committed ``sequences`` of a run's
    per-sequence array (written with every chunk, also one equal to the fill value).
    Elsewhere an absent chunk is the fill value, not damage."""
    if sequences is None:
        return []
    counts = [-(-n // c) for n, c in zip(arr.shape, stored_grid(arr))]
    if exceeds_memory(_INDEX_BYTES * len(sequences) * math.prod(counts[1:])):
        return []  # a shape no machine could list the objects of: named by array_problems, not walked
    return [(s, *rest) for s in sorted(sequences) if s < counts[0] for rest in np.ndindex(*counts[1:])]


def array_metadata(arr: zarr.Array) -> dict[str, Any]:
    """The array's ``zarr.json``, as stored."""
    raw = sync(arr.store.get(f"{arr.path}/zarr.json", prototype=default_buffer_prototype()))
    return json.loads(raw.to_bytes())


def arrays_of(root: zarr.Group, nodes: Mapping[str, Mapping[str, Any] | None] | None = None) -> list[zarr.Array]:
    """Every array of the store whose ``zarr.json`` reads, run and derived, in path order.
    ``nodes``: every node's metadata (:func:`~attngeom.store.objects.storage.node_metadata`) when the
    caller read it."""
    nodes = node_metadata(root.store) if nodes is None else nodes
    out = []
    for key, meta in nodes.items():
        if meta is None or meta["node_type"] != "array" or "/" not in key:
            continue  # unreadable ones are named by the metadata check
        try:
            out.append(root[node_path(key)])
        except DECODE_ERRORS:
            continue
    return out
