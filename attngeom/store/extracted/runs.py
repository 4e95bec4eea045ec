"""Runs: their ids, creation, growth and the per-sequence commit (docs/store.md#commit-protocol)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.errors import DamagedStoreError, RunNotFoundError
from attngeom.limits import exceeds_memory, memory_bytes, size_text
from attngeom.store.objects.preflight import RUN_ID_PATTERN
from attngeom.store.objects._zarr import sync
from attngeom.store.holds.access import quiet_leftovers
from attngeom.store.objects.codecs import VALUES_CODEC, compressors, object_chunks, shard_index
from attngeom.store.objects.damage import DECODE_ERRORS, RESTORE, metadata_damage
from attngeom.store.objects.storage import Part, jsonable, node_exists, put_objects, store_url
from attngeom.store.objects.schema import (
    ATTR_KEY,
    ENCODING,
    FIELD_SUMMARIES,
    RECENT_WINDOWS,
    RUN_VARIABLES,
    RUNS,
    SEQUENCE_ARRAYS,
    SUMMARY_DIMS,
    VALUE_ENCODINGS,
    RunLayout,
    run_path,
)


def run_ids(root: zarr.Group) -> list[str]:
    """Ids of the store's runs, sorted: the groups under ``runs/`` named as run ids are
    (:data:`~attngeom.store.objects.preflight.RUN_ID_PATTERN`); a folder of another name is no run, and
    validate names it (:func:`misnamed_runs`). :class:`DamagedStoreError` names a run's
    ``zarr.json`` that does not parse."""
    with quiet_leftovers():
        try:
            if RUNS not in root:
                return []
            return sorted(name for name, _ in root[RUNS].groups() if RUN_ID_PATTERN.match(name))
        except DECODE_ERRORS as exc:
            raise metadata_damage(store_url(root.store), RUNS, exc) from exc


def misnamed_runs(root: zarr.Group) -> list[str]:
    """Names of the groups under ``runs/`` that are not run ids, sorted."""

    async def names() -> list[str]:
        return [name async for name in root.store.list_dir(RUNS)]

    return sorted(name for name in sync(names()) if not RUN_ID_PATTERN.match(name)
                  and node_exists(root.store, f"{RUNS}/{name}"))


def require_runs(root: zarr.Group, url: str) -> list[str]:
    """Ids of the store's runs, sorted; :class:`RunNotFoundError` when it holds none (every
    reader says so in the same words)."""
    runs = run_ids(root)
    if not runs:
        raise RunNotFoundError(f"{url} holds no run yet: extract one into it first")
    return runs


def require_run_group(root: zarr.Group, run_id: str, url: str) -> None:
    """Raise :class:`RunNotFoundError`, naming the runs there are, unless ``run_id`` is one."""
    runs = require_runs(root, url)
    if run_id not in runs:
        raise RunNotFoundError(f"no run '{run_id}' in {url} (runs: {', '.join(runs)})")


def open_run_group(root: zarr.Group, run_id: str) -> zarr.Group:
    """The group of a run, read from its own metadata: the consolidated copy a finished
    extract leaves for readers goes stale as soon as a later extract appends."""
    return zarr.open_group(
        root.store, path=run_path(run_id), mode="r" if root.read_only else "r+", use_consolidated=False
    )


def run_provenance(root: zarr.Group, run_id: str) -> dict[str, Any]:
    """The run's provenance (its attngeom attributes); empty for a run whose creation was
    interrupted before them."""
    return dict(open_run_group(root, run_id).attrs.get(ATTR_KEY, {}))


def _array_options(name: str, layout: RunLayout, n_seq: int) -> dict[str, Any]:
    """The ``create_array`` arguments of run array ``name``: shape, dtype, chunks, codecs."""
    var = RUN_VARIABLES[name]
    shape = layout.shape(name, n_seq)
    dtype = np.dtype(layout.dtype(name))
    attrs: dict[str, Any] = {"description": var.doc} if var.doc else {}
    if "head" in var.dims and name not in ("head", "head_kv"):
        attrs["coordinates"] = "head_kv"
    if name == "values" and layout.values_dtype in VALUE_ENCODINGS:
        attrs[ATTR_KEY] = {ENCODING: layout.values_dtype}
    if var.per_sequence and len(shape) > 1:
        whole = (1, *shape[1:])
        # analyze reads attn_last, values and attn one (sequence, layer) block at a time: a shard
        # per sequence, an inner chunk per layer. The per-query summaries are read whole; one
        # chunk per sequence writes each 3-4x faster (smollm2-135m, L=512: 2-3 against 8-10 ms).
        layered = var.dims[1] == "layer" and var.dims[:4] != SUMMARY_DIMS
        chunking: dict[str, Any] = {"chunks": (1, 1, *shape[2:]), "shards": whole} if layered else {"chunks": whole}
    elif var.per_sequence:
        chunking = {"chunks": (1,)}
    else:
        chunking = {"chunks": shape}
    return {
        "shape": shape,
        "dtype": dtype,
        "compressors": compressors(dtype, VALUES_CODEC) if name == "values" else compressors(dtype),
        "dimension_names": var.dims,
        "fill_value": -1 if name == "winner" else 0,
        "attributes": attrs,
        **chunking,
    }


def run_coordinates(layout: RunLayout) -> dict[str, np.ndarray]:
    """The run's coordinate arrays and its ``attendable`` mask, as they are stored."""
    return {
        "layer": np.asarray(layout.layer_indices, dtype="int32"),
        "head": np.arange(layout.n_heads, dtype="int32"),
        "kv_head": np.arange(layout.n_kv_heads, dtype="int32"),
        "pos": np.arange(layout.length, dtype="int32"),
        "head_kv": np.asarray(layout.head_kv, dtype="int32"),
        "window": np.asarray(layout.window, dtype="int32"),
        "attendable": np.asarray(layout.attendable, dtype=bool),
        "query_pos": np.asarray(layout.queries, dtype="int32"),
        "recent": np.asarray(RECENT_WINDOWS, dtype="int32"),
    }


def create_run(
    root: zarr.Group, run_id: str, layout: RunLayout, provenance: Mapping[str, Any], n_seq: int
) -> zarr.Group:
    """Create, or finish creating, ``runs/<run_id>`` with arrays sized for ``n_seq`` sequences.

    Several writers may create the same run at once (``extract --shard``): an array that
    already has this layout's shape and dtype is kept, never overwritten, so a peer's
    committed sequences survive; one left with another layout by an interrupted creation is
    replaced. Provenance is written last, with ``initialized: true``.
    """
    try:
        run = root.require_group(run_path(run_id))
    except zarr.errors.ContainsGroupError:  # a concurrent writer created it a moment ago (shards)
        run = open_run_group(root, run_id)
    sync(_create_arrays(run, layout, n_seq))
    meta = dict(provenance)
    # Not asdict: it deep-copies ``attendable``, L x layers booleans (30 ms at L=1024), to drop it.
    meta["layout"] = {f.name: getattr(layout, f.name) for f in fields(layout) if f.name != "attendable"}
    meta["initialized"] = True
    run.attrs[ATTR_KEY] = jsonable(meta)
    return run


async def _create_arrays(run: zarr.Group, layout: RunLayout, n_seq: int) -> None:
    # All arrays at once: their creations wait on the store, not on each other.
    group = await _opened(run)
    existing = {name: member async for name, member in group.members() if isinstance(member, zarr.AsyncArray)}
    coordinates = run_coordinates(layout)

    async def create(name: str) -> None:
        arr = existing.get(name)
        options = _array_options(name, layout, n_seq)
        shape, per_sequence = options["shape"], RUN_VARIABLES[name].per_sequence
        kept = arr is not None and str(arr.dtype) == layout.dtype(name) and (
            arr.shape[1:] == shape[1:] if per_sequence else arr.shape == shape
        )
        if not kept:
            try:
                arr = await group.create_array(name, overwrite=arr is not None, **options)
            except zarr.errors.ContainsArrayError:  # a concurrent writer created it a moment ago
                arr = await group.getitem(name)
        if per_sequence and arr.shape[0] < n_seq:  # grows, never shrinks
            await arr.resize((n_seq, *arr.shape[1:]))
        if name in coordinates:
            await arr.setitem(Ellipsis, coordinates[name])

    await _every(create(name) for name in layout.names())


def layout_problem(layout: Mapping[str, Any]) -> str | None:
    """Why a run's recorded ``layout`` cannot be read by, or None: counts that are no
    non-negative integers, counts its own lists contradict (a window per layer, a kv head
    per head, the model's index of each layer), or one sequence's arrays (its attention
    rows and values, which a reader holds at once) more than this machine's memory."""
    counts = {key: layout[key] for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "length")}
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"its layout's {key} is {value!r}, no count"
    lists = {"window": "n_layers", "head_kv": "n_heads"}
    if layout.get("layers"):
        lists["layers"] = "n_layers"
    for key, count in lists.items():
        if len(layout[key]) != counts[count]:
            return f"its layout's {count} is {counts[count]:,}, but its '{key}' lists {len(layout[key]):,}"
    n_layers, length = counts["n_layers"], counts["length"]
    sequence = 4 * n_layers * length * (counts["n_heads"] + counts["n_kv_heads"] * counts["head_dim"])
    if exceeds_memory(sequence):
        return (f"its layout declares sequences of {size_text(sequence)} each ({n_layers:,} layers, L = {length:,}), "
                f"more than this machine's {size_text(memory_bytes())} of memory")
    return None


def run_layout(run: zarr.Group) -> RunLayout:
    """The layout recorded in a run's provenance, with its ``attendable`` keys. A layout
    recorded before format 5 names no ``lacking``: such a run lacks the summaries it does not
    hold (``attngeom migrate`` records them). :class:`DamagedStoreError` for a layout that
    cannot be read by (:func:`layout_problem`), before anything is read by it."""
    meta = run.attrs[ATTR_KEY]["layout"]
    why = layout_problem(meta)
    if why is not None:
        raise DamagedStoreError(f"run {run.path.rsplit('/', 1)[-1]}: {why}; {RESTORE}")
    attendable = tuple(tuple(bool(x) for x in row) for row in run["attendable"][:])
    lacking = meta["lacking"] if "lacking" in meta else [name for name in FIELD_SUMMARIES if name not in run]
    return RunLayout(
        **{**meta, "head_kv": tuple(meta["head_kv"]), "window": tuple(meta["window"]),
           "queries": tuple(meta.get("queries", ())), "lacking": tuple(lacking), "layers": tuple(meta.get("layers", ())),
           "layer_kv_heads": tuple(meta.get("layer_kv_heads", ())),
           "layer_head_dims": tuple(meta.get("layer_head_dims", ()))},
        attendable=attendable,
    )


def lacking_summaries(provenance: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-query summaries a run lacks, from its provenance (its layout's ``lacking``):
    those of a later format than the one it was extracted in (``attngeom migrate`` records
    them; the model is needed to compute them)."""
    return tuple(provenance.get("layout", {}).get("lacking", ()))


def lacking_message(run_id: str, lacking: Iterable[str]) -> str:
    """One line saying that run ``run_id`` has no head scores, lacking the summaries ``lacking``."""
    return (f"run {run_id} has no head scores: it was extracted before attngeom kept {' and '.join(lacking)} "
            "(migrated from an earlier store format); extract it again into a new run to score its heads")


def n_sequences(run: zarr.Group) -> int:
    """Sequences the run's arrays are sized for, committed or not."""
    return int(run["complete"].shape[0])


def resize_run(run: zarr.Group, n_seq: int) -> None:
    """Grow every per-sequence array to ``n_seq`` sequences (idempotent, never shrinks)."""
    for name, var in RUN_VARIABLES.items():
        if var.per_sequence and name in run and run[name].shape[0] < n_seq:
            arr = run[name]
            arr.resize((n_seq, *arr.shape[1:]))


# What a reader of a run holds per sequence: its commit flag (the flags are read whole) and,
# where it is committed, its index.
_SEQUENCE_BYTES = 9


def sequences_problem(run_id: str, n_seq: int) -> str | None:
    """Why a run whose arrays declare ``n_seq`` sequences cannot be read on this machine, or
    None: what every reader holds of them (:data:`_SEQUENCE_BYTES` each) exceeds its memory.
    Metadata of someone else's store may claim any size; nothing is read by it."""
    need = n_seq * _SEQUENCE_BYTES
    if not exceeds_memory(need):
        return None
    return (f"run {run_id}: its arrays declare {n_seq:,} sequences, whose commit flags and indices every "
            f"reader holds in memory ({size_text(need)}), more than this machine's {size_text(memory_bytes())}")


def completed(run: zarr.Group) -> np.ndarray:
    """Indices of the sequences whose every array is written; :class:`DamagedStoreError` for
    flags too many to hold (:func:`sequences_problem`)."""
    flags = run["complete"]
    why = sequences_problem(run.path.rsplit("/", 1)[-1], int(flags.shape[0]))
    if why is not None:
        raise DamagedStoreError(f"{why}; {RESTORE}")
    return np.flatnonzero(flags[:] == 1)


# A sequence's array as a writer is handed it: whole, or one part per stored layer (views of a
# capture's buffers, read by the encoders: no copy of the whole is made).
SequenceValue = np.ndarray | Sequence[np.ndarray]


# Sequences a SequenceWriter holds between submit and commit: one written while the next waits,
# so the model never waits for a write shorter than its own forward.
IN_FLIGHT = 2


class SequenceWriter:
    """Writes sequences of one run beside the caller, each committed when all of it is stored.

    The run's arrays are opened once. ``submit(seq, arrays)`` hands over a sequence (each
    array whole, or one part per stored layer): one background thread writes every array
    at once (their chunks converted to the stored dtype and compressed on a thread per core)
    and then sets the sequence's ``complete`` flag,
    in the order submitted. At most ``in_flight`` sequences are between submit and commit
    (``submit`` waits for room), so memory holds at most that many sequences' arrays (and
    the buffers their parts view) beside the caller's. With ``in_flight=0`` ``submit``
    stacks, writes and commits in the caller's thread.
    ``fence``: called before a sequence's objects are written and before its commit, raising
    once the writer no longer holds the run (:meth:`~attngeom.store.holds.lease.Lease.confirm`);
    with it, objects are created only where absent on an object store.

    The first failed write stops the writer: the sequences after it are dropped uncommitted
    and its error is raised by the next ``submit`` or by ``close``. Leaving the ``with``
    block on an error drops the sequences not begun and waits for the one being written, so
    nothing is written once the caller sees the error.
    """

    def __init__(self, run: zarr.Group, *, in_flight: int = IN_FLIGHT, fence: Callable[[], None] | None = None,
                 ) -> None:
        self._arrays = sync(_sequence_members(run))
        self._store = run.store
        self._in_flight = in_flight
        self._fence = fence
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attngeom-writer")
        # Chunks are compressed here on every core, not by zarr: Blosc releases the GIL, and
        # zarr's writes (one coroutine and thread hop per chunk, the shard assembled in
        # copies; zarr >= 3.2's fused pipeline compresses a shard's chunks on one thread)
        # cost 1.3-2.2x the CPU of the compression and the write themselves on a Llama-2-7B
        # sequence, where this costs 1.0x (benchmarks/extract_writer.py, zarr 3.1.6 and 3.4.2).
        from dask.system import cpu_count  # here: Dask loads only where sequences are written

        self._encoders = ThreadPoolExecutor(max_workers=cpu_count(), thread_name_prefix="attngeom-encode")
        self._pending: deque[Future[None]] = deque()
        self._stopped = False
        self.committed: list[int] = []  # by this writer, in order: counted also where the store no longer answers

    def write(self, seq: int, arrays: Mapping[str, SequenceValue]) -> None:
        """Write sequence ``seq`` and commit it, in the calling thread: every chunk of every
        array stored (also one all fill value: validate tells a written sequence from an
        unwritten one by its chunk objects), then the ``complete`` flag. ``arrays``: each
        whole, or one part per stored layer."""
        given = {name: [np.asarray(part) for part in arrays[name]] if isinstance(arrays[name], list | tuple)
                 else np.asarray(arrays[name])[None] for name in SEQUENCE_ARRAYS if name in self._arrays}
        objects = {}
        # The largest first: its object is written while the others are still compressed.
        names = sorted(given, key=lambda n: -_nbytes(given[n]))
        for name in names:
            arr = self._arrays[name]
            encode, chunks, sharded = object_chunks(arr.metadata.to_dict(), given[name])
            key = f"{arr.path}/{arr.metadata.encode_chunk_key((seq,) + (0,) * (arr.ndim - 1))}"
            objects[key] = _stored_parts(deque(self._encoders.submit(encode, chunk) for chunk in chunks), sharded)
        if self._fence is None:
            put_objects(self._store, objects)
        else:
            self._fence()
            # Created only where absent: a committed sequence's objects are never replaced by a
            # writer that lost its hold meanwhile. One present is a killed writer's leftover,
            # or a stale writer's; this writer replaces it only while it still holds the run.
            present = put_objects(self._store, objects, only_new=True)
            if present:
                self._fence()
                put_objects(self._store, present)
            self._fence()
        sync(self._arrays["complete"].setitem(seq, 1))
        self.committed.append(seq)

    def submit(self, seq: int, arrays: Mapping[str, SequenceValue]) -> None:
        """Queue sequence ``seq``, its ``arrays`` (each whole, or its parts along the layer axis:
        the stored layers), for the background thread; raises the error of an earlier write."""
        if not self._in_flight:
            self._write_unless_stopped(seq, arrays)
            return
        while self._pending and (len(self._pending) >= self._in_flight or self._pending[0].done()):
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._write_unless_stopped, seq, arrays))

    def close(self) -> None:
        """Wait until every submitted sequence is committed; raises the first write's error."""
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._stop()

    def _write_unless_stopped(self, seq: int, arrays: Mapping[str, SequenceValue]) -> None:
        if self._stopped:
            return
        try:
            self.write(seq, arrays)
        except BaseException:
            self._stopped = True
            raise

    def _stop(self) -> None:
        self._stopped = True
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._encoders.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SequenceWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self._stop()


def write_sequence(run: zarr.Group, seq: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Write one sequence's shards, every array of the run at once, then its ``complete``
    flag (the commit)."""
    with SequenceWriter(run, in_flight=0) as writer:
        writer.write(seq, arrays)


def _nbytes(value: np.ndarray | list[np.ndarray]) -> int:
    return sum(part.nbytes for part in value) if isinstance(value, list) else value.nbytes


def _stored_parts(chunks: deque[Future[tuple[bytes, bytes]]], sharded: bool) -> Iterator[Part]:
    """An object's parts in order, each as its encoding ends: its encoded ``chunks`` (each
    its compressed bytes and their checksum), then, for a shard, its index, built from their
    sizes. Should one fail, the encodings not begun are cancelled."""
    # Each chunk is let go once written, so that the next one's encoding can take its memory
    # rather than fault in fresh pages.
    sizes = []
    try:
        while chunks:
            parts = chunks[0].result()
            sizes.append(sum(len(b) for b in parts))
            chunks.popleft()
            yield parts
            del parts
    finally:
        for chunk in chunks:
            chunk.cancel()
    if sharded:
        yield shard_index(sizes)


async def _sequence_members(run: zarr.Group) -> dict[str, zarr.AsyncArray]:
    group = await _opened(run)
    return {name: member async for name, member in group.members() if name in (*SEQUENCE_ARRAYS, "complete")}


async def _opened(run: zarr.Group) -> zarr.AsyncGroup:
    """The run's group for the async API, read from its own metadata as ``open_run_group``."""
    return await zarr.api.asynchronous.open_group(store=run.store, path=run.path, mode="r+", use_consolidated=False)


async def _every(writes: Iterable[Awaitable[Any]]) -> None:
    """Await ``writes`` concurrently; the first error is raised once every write has ended,
    so that nothing is written after a failed caller has cleaned up."""
    for outcome in await asyncio.gather(*writes, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


def array_metadata_bytes(name: str, layout: RunLayout, n_seq: int) -> bytes:
    """The ``zarr.json`` that creating run array ``name`` for ``n_seq`` sequences writes (as
    :func:`create_run` does): what ``validate --repair`` puts back for a damaged one."""
    memory = zarr.storage.MemoryStore()
    zarr.create_array(memory, name=name, **_array_options(name, layout, n_seq))
    return sync(memory.get(f"{name}/zarr.json", prototype=default_buffer_prototype())).to_bytes()
