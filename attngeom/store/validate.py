"""Checking a store against its contract: one line per problem, never an exception.

Checks, each a function of its own: the metadata (every ``zarr.json`` parses), leftovers of
killed writes (``*.partial``), each run against the schema and its commit flags (a committed
sequence has every stored object, none empty), and with ``deep`` every stored object of every
array: a shard's index (present, whole, listing every inner chunk) and every chunk decoding
(its crc32c checksum). :func:`committed_damage` is the cheap check stages run before
reading a run; :mod:`~attngeom.store.repair` repairs what they find.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.errors import AttngeomError, DamagedStoreError, ForeignFileError
from attngeom.limits import exceeds_memory
from attngeom.preflight import RUN_ID_PATTERN, run_created
from attngeom.store._zarr import sync
from attngeom.store.access import (
    consolidated_fault,
    partials,
    quiet_leftovers,
    read_root_attrs,
    stale_consolidated,
    store_format,
)
from attngeom.store.cache import cached
from attngeom.store.codecs import has_checksum
from attngeom.store.damage import (
    DECODE_ERRORS,
    RESTORE,
    Problem,
    damaged_chunk,
    metadata_damage,
    recovery,
    stored_grid,
    unreadable_metadata,
)
from attngeom.store.storage import (
    local_path,
    lost_metadata,
    metadata_fault,
    node_metadata,
    node_path,
    foreign_files,
    read_metadata,
    zarr_store,
)
from attngeom.store.stored_objects import chunk_objects, object_damage, object_sizes
from attngeom.store.rebuild import broken_metadata, cannot_rebuild, derived_node, rebuild_plan
from attngeom.store.runs import (
    completed,
    misnamed_runs,
    open_run_group,
    run_coordinates,
    run_ids,
    run_layout,
    sequences_problem,
)
from attngeom.store.schema import (
    ATTR_KEY,
    DERIVED,
    ENCODING,
    FORMAT,
    RUN_VARIABLES,
    RUNS,
    SEQUENCE_ARRAYS,
    VALUE_ENCODINGS,
    RunLayout,
)

# What a grid index of an expected object takes in memory (a tuple of a few ints).
_INDEX_BYTES = 100
# Arrays a deep check of an object store reads at once (each holds one stored object in
# memory at a time, a shard read whole).
_REMOTE_READERS = 4


def _ranges(mask: np.ndarray) -> str:
    """The indices where ``mask`` holds, as ranges ("0-3, 7"): found by its edges, so that a
    run of many sequences is not walked one at a time."""
    edges = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0, append=0))
    return ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()))


def lost_objects(run: zarr.Group, members: Mapping[str, zarr.Array] | None = None,
                 ) -> dict[str, dict[tuple[int, ...], Exception]]:
    """Per-sequence array -> grid index -> why (:class:`FileNotFoundError`: missing,
    :class:`EOFError`: empty) for each stored object (shard, or chunk) that a committed
    sequence must have and that is missing or empty: read, it would be the fill value. One
    listing of the run (on an object store, a page per thousand objects; one per array asked
    for at least one each); data are not read. ``members``: the run's arrays
    (:func:`_members`) when the caller has them."""
    members = _members(run) if members is None else members
    done = set(completed(run).tolist())
    listed = object_sizes(run.store, f"{run.path}/")
    lost: dict[str, dict[tuple[int, ...], Exception]] = {}
    for name in SEQUENCE_ARRAYS:
        if name not in members:
            continue
        objects = chunk_objects(members[name], listed)
        for index in _expected_objects(members[name], done):
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
    problems = array_problems(run, run_id, layout, _members(run) if members is None else members, url)
    if problems:
        remedied = problems[0].startswith(RUNS) or problems[0].endswith(even_lengths(url))
        raise DamagedStoreError(problems[0] if remedied else f"{problems[0]}; {RESTORE}")
    return layout


def check_committed(url: str, run: zarr.Group, run_id: str) -> None:
    """Raise :class:`DamagedStoreError` for an array of the run that is missing, unreadable or
    contradicts the run's layout (:func:`array_problems`), for the first committed sequence
    whose stored objects are missing or empty (see :func:`committed_damage`), or for a
    coordinate array not holding what the run's layout records (read whole: they are small)."""
    members = _members(run)
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
        members = _members(run)
        for name in SEQUENCE_ARRAYS:
            if name not in members:
                continue
            for index, size in sorted(chunk_objects(members[name]).items()):
                if index[0] in done and (why := object_damage(members[name], index, size)) is not None:
                    raise damaged_chunk(url, members[name], index, why) from exc
        raise DamagedStoreError(f"run {run_id} cannot be read ({type(exc).__name__}: {exc}); {RESTORE}") from exc


def _members(run: zarr.Group) -> dict[str, zarr.Array]:
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
    """The remedy of a run whose arrays disagree in length (:mod:`~attngeom.store.repair`)."""
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
    members = _members(run)
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


def _expected_objects(arr: zarr.Array, sequences: set[int] | None) -> list[tuple[int, ...]]:
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
    ``nodes``: every node's metadata (:func:`~attngeom.store.storage.node_metadata`) when the
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


def metadata_problems(url: str, zstore: Any, nodes: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """One line per ``zarr.json`` that does not parse, or is malformed, or is lost above a
    node (:func:`~attngeom.store.rebuild.broken_metadata`), saying what rewrites it: its
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
    (:func:`~attngeom.store.storage.node_metadata`). A malformed copy is named as such; a stale
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
    it, a device or pipe (:mod:`attngeom.store_files`)."""
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
    from attngeom.store.derived_read import derived_problems

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
            members = _members(run)
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
                return lines + [p.line for p in damaged_objects(arr, url, _expected_objects(arr, sequences),
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
