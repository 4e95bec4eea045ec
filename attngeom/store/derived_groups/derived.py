"""The write of derived groups (``analysis``, ``ablation``, ``detect``) and of their commit
record (docs/store.md#commit-protocol).

A derived group ``runs/<id>/<kind>`` carries a record in its attributes, under ``attngeom``:

- ``commit``: what the groups at ``runs/<id>/<kind>/<name>`` hold once finished: the run's
  sequences they cover (in the order of their ``seq`` axis), the parameters they were
  computed with, the group names, the attngeom version, and every stored object of the
  groups with its size (``objects``), so that a lost, emptied or truncated object is seen
  from one listing. It is the writer's last write. A reader sees the results only through
  it (:func:`~attngeom.store.derived_groups.derived_read.read_derived`).
- ``pending``: an update under way or interrupted: its parameters, the sequences already
  written, and whether it writes into the staging group ``runs/<id>/<kind>/_next`` (the
  commit then stays valid meanwhile) or into the groups themselves (the commit was dropped
  first, unless it only appends sequences beyond the committed ones). ``promoting`` lists
  groups being moved from staging into place: the commit is dropped for that short step,
  and a rerun finishes it.

The record's shape, its reading and the check of the committed objects against it live in
:mod:`attngeom.store.derived_groups.record`, with zarr alone; this module writes the record and the groups
(with xarray), :mod:`attngeom.store.derived_groups.derived_read` reads the groups through it.

So a writer touches nothing a commit covers without dropping the commit first, and it
writes the commit last: a killed writer leaves either the earlier finished results or a
group that every reader refuses as incomplete. A derived group without any record predates
records (attngeom 0.1.0 stores) and is read as it is.

On an object store a writer's lease can end without its knowledge, and then it may not touch
what a commit covers at all: there the groups of each update go into a generation folder of
the writer's own, the commit record names it, and every record write is conditional on the
record the writer last saw (see :class:`DerivedWrite`).

One writer owns one update from start to commit: :class:`DerivedWrite`, made by the
command's :class:`~attngeom.store.session.StoreSession`, holds the run's lock (a
lease on object stores), finds what of the committed groups is damaged, plans
(:mod:`attngeom.store.derived_groups.plan`), stages, writes, promotes and commits, through a few verbs that cannot be called in a wrong
order. Analyze, ablate and detect all write through it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xarray as xr
import zarr

from attngeom.store.holds.access import consolidate
from attngeom.store.objects.cache import note_written
from attngeom.store.extracted.datasets import open_dataset, read_regions, set_regions, write_datasets
from attngeom.store.objects.storage import (
    child_names,
    copy_within,
    delete_objects,
    group_document,
    jsonable,
    local_path,
    metadata_bytes,
    move_group,
    node_exists,
    put_objects,
    remove_dir,
)
from attngeom.store.holds.lease import HeldObject
from attngeom.store.holds.held_store import HeldStore
from attngeom.store.derived_groups.plan import Plan, healing, plan_update
from attngeom.store.derived_groups.record import (
    LOST,
    STAGING,
    Commit,
    Damage,
    DerivedState,
    Pending,
    derived_damage,
    generation_name,
    groups_path,
    kind_path,
    read_state,
    staged_path,
    stored_sizes,
)
from attngeom.store.objects.schema import ATTR_KEY, DERIVED

__all__ = ["DerivedWrite", "forget_unreadable"]


def forget_unreadable(session: HeldStore, run_id: str, kind: str) -> str | None:
    """Remove ``runs/<run_id>/<kind>`` if its record does not parse, is malformed or lost (the
    run locked for the rest of the session): it tells nothing of what the groups hold, which
    are written again; and an empty folder left there. What was wrong with the record if it
    was removed ("did not parse", "was malformed", "was lost"), else None. A writer does this
    before opening the run with xarray, which reads every child group's metadata."""
    session.lock(run_id, DERIVED.get(kind, kind))
    state = read_state(session.zstore, run_id, kind)
    if state.unreadable and session.held_object(run_id, kind_path(run_id, kind)) is not None:
        with DerivedWrite(session, run_id, kind) as write:  # fenced: its record replaced first
            return write.forgotten
    if state.leftover:
        remove_dir(session.zstore, kind_path(run_id, kind))
    if not state.unreadable:
        return None
    remove_dir(session.zstore, kind_path(run_id, kind))
    return _fault_words(state)


def _fault_words(state: DerivedState) -> str:
    return "was lost" if state.fault == LOST else "was malformed" if state.fault.startswith("malformed") \
        else "did not parse"


class DerivedWrite:
    """One update of ``runs/<run_id>/<kind>``, the one owner of its commit record from start
    to commit (made by :meth:`StoreSession.derived <attngeom.store.session.StoreSession.derived>`).
    Entered, it locks the run, reads the record (one that does not parse is dropped with the
    groups it described) and checks the committed groups (``damage``: object presence and
    sizes, and with ``deep`` every object decoding); on a normal exit it refreshes the
    root's consolidated metadata. Its verbs, in this order, keep the protocol (the commit
    withdrawn before anything it covers is touched, written last)::

        with session.derived(run_id, ANALYSIS) as write:
            plan = write.begin(parameters, target, groups, sequence_groups)
            if not plan.up_to_date:
                write.create(templates, seq_chunk)
                for batch in ...:
                    write.append(batch_datasets)
                write.finish(cross_sequence_datasets)

    or, for groups replaced as a whole, ``write.replace(groups, parameters)``. A verb called
    out of this order raises :class:`RuntimeError`.

    On an object store, where a writer's lease can end without its knowledge, the update is
    fenced: every group it writes lies in a generation folder of its own
    (``runs/<id>/<kind>/gen-<token>``, a copy of the kept sequences first), the committed
    groups are never touched, and each record write is conditional on the record being the
    one this writer last read or wrote (:class:`~attngeom.store.holds.lease.HeldObject`). The
    commit, naming the generation, makes it current in one write; what no record names is
    removed after it. A writer whose lease was taken over thus stops at its next record
    write, having written only into a folder no record names. On a local disk the run's
    lock lasts as long as its writer's process and the groups are written in place.
    """

    def __init__(self, session: HeldStore, run_id: str, kind: str, *, deep: bool = False) -> None:
        self.session, self.url, self.run_id, self.kind, self.deep = session, session.url, run_id, kind, deep
        self.base = kind_path(run_id, kind)
        self.zstore = session.zstore
        self.state = DerivedState(run_id, kind)
        self.damage: dict[str, Damage] = {}
        self.plan: Plan | None = None
        self._record: zarr.Group | None = None
        self._step = "closed"
        self._update: _Update | None = None
        # Fenced writers' (object stores): the record as a conditional object, this writer's
        # generation, and what the kind's folder held before its first record write.
        self.fence: HeldObject | None = None
        self.generation = ""
        self._listed: tuple[str, ...] = ()
        self.forgotten: str | None = None

    def __enter__(self) -> DerivedWrite:
        self.session.lock(self.run_id, DERIVED.get(self.kind, self.kind))
        self.fence = self.session.held_object(self.run_id, f"{self.base}/zarr.json")
        if self.fence is None:
            self.state = read_state(self.zstore, self.run_id, self.kind)
            if self.state.unreadable or self.state.leftover:  # as forget_unreadable
                remove_dir(self.zstore, self.base)
                self.state = DerivedState(self.run_id, self.kind)
        else:
            self.generation = generation_name(uuid.uuid4().hex[:16])
            self.state = read_state(self.zstore, self.run_id, self.kind, raw=self.fence.read())
            # Listed after the record was read and before this writer's first write of it,
            # which fails if another writer wrote it in between: no later commit can name any
            # of these, so once this writer's commit (or record) is written they are garbage,
            # also if it stalls and they are removed long after.
            self._listed = tuple(name for name in child_names(self.zstore, self.base) if name != "zarr.json")
            if self.state.unreadable:
                self.forgotten = _fault_words(self.state)
                self.state = DerivedState(self.run_id, self.kind, exists=True)
                self._write_record(None, None)
                self._remove_garbage(keep=())
            elif self.state.pending is not None and self.state.pending.promoting:
                # A local-layout promotion cut short: its staging is not resumed here, the
                # groups are computed again into this writer's generation.
                self.state = replace(self.state, pending=None)
        self.damage = derived_damage(self.zstore, self.state, deep=self.deep)
        self._step = "open"
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._step = "closed"
        # Last, also when nothing was written: a killed writer may have left it stale. Not by
        # a fenced writer another writer took over from since its last record write: the
        # copy would describe its own record, and the holder refreshes the copy anyway.
        if kind is None and (self.fence is None or self.fence.unchanged()):
            consolidate(self.session.root, own=self.base)

    def _advance(self, expected: str, to: str) -> None:
        if self._step != expected:
            raise RuntimeError(f"{type(self).__name__}: called while {self._step}, not {expected}")
        self._step = to

    # The verbs.

    def begin(self, parameters: Mapping[str, Any], target: Sequence[int], groups: Sequence[str],
              sequence_groups: Sequence[str]) -> Plan:
        """Start an update with ``parameters`` covering the sequences ``target`` (in ``seq``
        order) in the groups ``groups``, of which ``sequence_groups`` grow along ``seq``:
        finish a promotion a killed writer left half done, plan (:func:`plan_update`, and
        :func:`healing` of ``damage``), and unless the plan is up to date record the update,
        withdrawing the commit first where the plan writes what it covers in place, and
        remove the damaged objects it rewrites. The plan's ``keep`` is what the written
        groups hold of it."""
        self._advance("open", "begun")
        params, target = jsonable(dict(parameters)), tuple(int(s) for s in target)
        groups, sequence_groups = tuple(groups), tuple(sequence_groups)
        resumed = self._resume_promotion()
        if resumed is not None:
            self._commit(Commit(resumed.parameters, groups, resumed.sequences, sequence_groups))
        plan = healing(plan_update(self.state, params, target), self.damage, sequence_groups)
        if plan.up_to_date:
            self._step, self.plan = "done", plan
            if self.fence is not None and self._garbage(self.state.commit):
                self._write_record(self.state.commit, None)
                self._remove_garbage(keep=self._committed_folders(self.state.commit))
            return plan
        pending = Pending(params, plan.keep, staged=plan.staged, generation=self.generation)
        self._set_pending(pending, keep_commit=plan.keep_commit)
        if self.fence is not None:
            self._start_generation()
            if plan.keep:
                self._copy_kept(plan, params, sequence_groups)
        else:
            self._discard_damaged(sequence_groups if not plan.keep_commit else ())
        plan = replace(plan, keep=self._kept(plan, sequence_groups))
        self.plan = plan
        self._update = _Update(Commit(params, groups, target, sequence_groups),
                               replace(pending, sequences=plan.keep), {})
        return plan

    def create(self, templates: Mapping[str, xr.Dataset], seq_chunk: int) -> None:
        """Create the per-sequence groups as ``templates`` (name -> Dataset over the
        ``target`` sequences, its data never computed: only metadata and the fixed
        coordinates are written), ``seq_chunk`` sequences a chunk; or, when the plan keeps
        sequences, grow the kept groups to the target (``templates`` unused)."""
        self._advance("begun", "writing")
        update, plan = self._update, self.plan
        if not plan.keep:
            self._write(templates, staged=plan.staged, compute=False, chunks={"seq": seq_chunk})
        arrays = {name: {key: arr.async_array for key, arr in self._group(name, plan.staged).arrays()}
                  for name in update.done.sequence_groups}
        if plan.keep:
            grown = {(name, key): arr.metadata.update_shape((len(plan.target), *arr.shape[1:]))
                     for name, group in arrays.items() for key, arr in group.items()
                     if tuple(arr.metadata.dimension_names or ())[:1] == ("seq",) and arr.shape[0] != len(plan.target)}
            # Groups grown in place are read through the kept commit meanwhile. Every array's
            # metadata is rewritten at once, as attngeom writes it (zarr's resize encodes each
            # document through Python's pure-Python JSON encoder, then waits for its write).
            with (contextlib.nullcontext() if plan.staged or not grown or self.fence is not None
                  else self._commit_withdrawn(update.pending)):
                put_objects(self.zstore, {f"{arrays[name][key].path}/zarr.json": metadata_bytes(meta.to_dict())
                                          for (name, key), meta in grown.items()})
            for (name, key), meta in grown.items():
                arrays[name][key] = zarr.AsyncArray(meta, arrays[name][key].store_path)
        update.arrays.update(arrays)

    def append(self, datasets: Mapping[str, xr.Dataset]) -> None:
        """Write the next sequences of the per-sequence groups (name -> Dataset along
        ``seq``, the target's sequences after those written so far), then record them."""
        self._advance("writing", "writing")
        update = self._update
        start = len(update.pending.sequences)
        count = next(iter(datasets.values())).sizes["seq"]
        sequences = update.done.sequences[start : start + count]
        for name, data in datasets.items():
            if tuple(int(s) for s in data["seq"].values) != sequences:
                raise ValueError(f"{name}: sequences {data['seq'].values.tolist()} are not the next {list(sequences)}")
        missing = [f"{name}/{var}" for name, data in datasets.items() for var in (*data.data_vars, "seq")
                   if var not in update.arrays[name]]
        if missing:
            # A fenced writer's generation is removed only by a writer that took the run over.
            if self.fence is not None:
                self.fence.require_unchanged()
            raise ValueError(f"no array {', '.join(missing)} in the groups written")
        parts = [(update.arrays[name][var], data[var].values) for name, data in datasets.items()
                 for var in (*data.data_vars, "seq")]
        set_regions(self.url, self.zstore, parts, start)
        update.pending = replace(update.pending, sequences=update.done.sequences[: start + count])
        self._set_pending(update.pending, keep_commit=self.plan.keep_commit)

    def written(self, count: int) -> dict[str, dict[str, np.ndarray]]:
        """The first ``count`` sequences written so far of every per-sequence group: group ->
        array along ``seq`` -> its stored values (label codes, not labels), every array read
        at once (:func:`~attngeom.store.extracted.datasets.read_regions`)."""
        if self._step != "writing":
            raise RuntimeError(f"{type(self).__name__}: called while {self._step}, not writing")
        if count > len(self._update.pending.sequences):
            raise ValueError(f"{count} of {len(self._update.pending.sequences)} sequences written")
        along = [(name, key, arr) for name, group in self._update.arrays.items() for key, arr in group.items()
                 if tuple(arr.metadata.dimension_names or ())[:1] == ("seq",)]
        values = read_regions(self.url, [(arr, slice(0, count)) for _, _, arr in along])
        out: dict[str, dict[str, np.ndarray]] = {name: {} for name in self._update.arrays}
        for (name, key, _), x in zip(along, values):
            out[name][key] = x
        return out

    def read(self, name: str) -> xr.Dataset:
        """The group ``name`` as a lazy Dataset: during an update, as written so far (not
        through the commit); else as committed last."""
        if self.fence is not None and self._step != "writing":
            return open_dataset(self.zstore, self.url, f"{self.state.groups_path}/{name}")
        staged = self._step == "writing" and self.plan is not None and self.plan.staged
        return open_dataset(self.zstore, self.url, self.path(name, staged=staged))

    def finish(self, datasets: Mapping[str, xr.Dataset]) -> None:
        """Write the groups across sequences (name -> Dataset, computed from every target
        sequence) into staging, move every staged group into place and commit: the update's
        last write. An update in place with no commit to keep readable writes them in place
        instead, and so does one on an object store, its kept commit withdrawn first: there
        a move is a copy of every object, which readers wait for as long as for the write,
        so that staging only doubled the writes."""
        self._advance("writing", "done")
        update = self._update
        if update.pending.sequences != update.done.sequences:
            raise RuntimeError(f"{len(update.pending.sequences)} of {len(update.done.sequences)} sequences written")
        if self.fence is not None:
            self._write(datasets)
        elif self.plan.staged or (self.state.commit is not None and local_path(self.url) is not None):
            self._write(datasets)
            staged = update.done.sequence_groups if self.plan.staged else ()
            self._promote([*staged, *datasets], update.pending)
        else:
            if self.state.commit is not None:
                self._set_pending(update.pending, keep_commit=False)
            self._write(datasets, staged=False)
        self._commit(update.done)

    def replace(self, groups: Mapping[str, xr.Dataset], parameters: Mapping[str, Any]) -> None:
        """Replace every group by ``groups``, as a whole: written into staging while the
        earlier commit (if any) stays readable, then moved into place, groups of the earlier
        results that ``groups`` lacks removed, then committed."""
        self._advance("open", "done")
        params = jsonable(dict(parameters))
        self._set_pending(Pending(params, staged=True, generation=self.generation), keep_commit=True)
        if self.fence is not None:
            self._start_generation()
            self._write(groups)
            self._commit(Commit(params, tuple(groups)))
            return
        remove_dir(self.zstore, f"{self.base}/{STAGING}")
        self._write(groups)
        kept = zarr.open_group(self.zstore, path=self.base, mode="r", use_consolidated=False)
        stale = {name for name in kept.group_keys() if name != STAGING} - set(groups)
        self._promote(list(groups), Pending(params, staged=True))
        for name in stale:
            remove_dir(self.zstore, self.path(name))
        self._commit(Commit(params, tuple(groups)))

    # Paths and groups.

    def path(self, name: str, *, staged: bool = False) -> str:
        """``runs/<id>/<kind>/<name>``, or its staging place; a fenced writer's own
        generation's ``runs/<id>/<kind>/<generation>/<name>`` either way."""
        if self.fence is not None:
            return f"{self.base}/{self.generation}/{name}"
        return staged_path(self.run_id, self.kind, name) if staged else f"{self.base}/{name}"

    def _group(self, name: str, staged: bool) -> zarr.Group:
        return zarr.open_group(self.zstore, path=self.path(name, staged=staged), mode="r+", use_consolidated=False)

    def _write(self, datasets: Mapping[str, xr.Dataset], *, staged: bool = True, compute: bool = True,
               chunks: Mapping[str, int] | None = None) -> None:
        """Write each Dataset of ``datasets`` (name -> Dataset) as the group ``name`` (in
        staging by default), replacing it, all at once
        (:func:`~attngeom.store.extracted.datasets.write_datasets`)."""
        write_datasets(self.zstore, self.url,
                       {self.path(name, staged=staged): dataset for name, dataset in datasets.items()},
                       compute=compute, chunks=chunks)

    def _kept(self, plan: Plan, sequence_groups: Sequence[str]) -> tuple[int, ...]:
        """The prefix of ``plan.keep`` its per-sequence groups hold: all of it, or none when
        a group is missing or holds other sequences."""
        keep = plan.keep
        if keep:
            try:
                groups = [self._group(name, plan.staged) for name in sequence_groups]
                if not all(np.array_equal(g["seq"][: len(keep)], keep) for g in groups):
                    keep = ()
            except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
                keep = ()
        return keep

    # The record.

    def _write_record(self, done: Commit | None, pending: Pending | None) -> None:
        """Replace the record: one write of the group's ``zarr.json`` (created with it if absent),
        only while the run's lock is held."""
        self.session.check_lock(self.run_id)
        record: dict[str, Any] = {}
        if done is not None:
            record["commit"] = _without_generation(jsonable(done.__dict__))
        if pending is not None:
            record["pending"] = _without_generation(jsonable(pending.__dict__))
        if self.fence is not None:
            # Named for its writer, so that no other writer's record has its bytes (HeldObject).
            record["writer"] = self.generation
            data = metadata_bytes(group_document({ATTR_KEY: record}))
            self.fence.write(data)
            note_written(self.zstore, f"{self.base}/zarr.json", data)
        elif not self.state.exists:
            # The group's metadata, written at once: zarr would first look for a node there,
            # a request on an object store for what the record already told.
            put_objects(self.zstore, {f"{self.base}/zarr.json": metadata_bytes(group_document({ATTR_KEY: record}))})
        else:
            if self._record is None:
                self._record = zarr.open_group(self.zstore, path=self.base, mode="r+", use_consolidated=False)
            self._record.attrs[ATTR_KEY] = record
        self.state = replace(self.state, exists=True, legacy=False, commit=done, pending=pending)

    def _set_pending(self, pending: Pending, *, keep_commit: bool) -> None:
        """Record an update under way; ``keep_commit`` False drops the commit first (in the
        same write), as any writer must before touching what it covers. A kept commit of an
        update appending sequences in place no longer lists the objects of its sequence
        groups: the append rewrites their last chunks (the committed sequences in them
        unchanged) and resizes their arrays."""
        if self.fence is not None:  # the commit's groups are never touched: kept whole
            self._write_record(self.state.commit, pending)
            return
        done = self.state.commit if keep_commit else None
        if done is not None and not pending.staged:
            done = replace(done, objects={key: size for key, size in done.objects.items()
                                          if key.split("/", 1)[0] not in done.sequence_groups})
        self._write_record(done, pending)

    @contextlib.contextmanager
    def _commit_withdrawn(self, pending: Pending) -> Iterator[None]:
        """Withdraw the kept commit for the block and restore it after, ``pending`` recorded
        throughout: readers are told an update is under way while the block makes a change
        they must not see half done (a group's arrays resized one after the other hold two
        lengths meanwhile, which no Dataset opens). Killed in the block, the commit stays
        withdrawn until the update commits."""
        done = self.state.commit
        if done is None:
            yield
            return
        self._set_pending(pending, keep_commit=False)
        yield
        self._write_record(done, pending)

    def _commit(self, done: Commit) -> None:
        """Write the commit record, listing every stored object of its groups (and forget the
        pending update): the writer's last write. Leftover staging is removed first."""
        if self.fence is not None:
            stored = stored_sizes(self.zstore, groups_path(self.run_id, self.kind, self.generation))
            objects = {key: size for key, size in stored.items() if key.split("/", 1)[0] in done.groups}
            self._write_record(replace(done, objects=objects, generation=self.generation), None)
            self.damage = {}
            self._remove_garbage(keep=(self.generation,))
            return
        remove_dir(self.zstore, f"{self.base}/{STAGING}")
        stored = stored_sizes(self.zstore, self.base)
        objects = {key: size for key, size in stored.items() if key.split("/", 1)[0] in done.groups}
        self._write_record(replace(done, objects=objects), None)
        self.damage = {}

    # A fenced writer's generation.

    def _start_generation(self) -> None:
        """Create this writer's generation folder as a group, so that its groups are nodes
        of the store's tree; after the record naming it, as every object of the update."""
        put_objects(self.zstore, {f"{self.base}/{self.generation}/zarr.json": metadata_bytes(group_document({}))})

    def _copy_kept(self, plan: Plan, params: Mapping[str, Any], sequence_groups: Sequence[str]) -> None:
        """Copy the per-sequence groups holding ``plan.keep`` (the commit's, or those of the
        interrupted update resumed) into this writer's generation, but their damaged objects:
        the update appends to its own copy, never to what another writer wrote."""
        done, pending = self.state.commit, self.state.pending
        if done is not None and not plan.staged and len(plan.keep) <= len(done.sequences):
            source = self.state.groups_path
            damaged = {key for damage in self.damage.values() for key, _ in damage.objects}
        else:
            assert pending is not None and pending.parameters == params
            source = (groups_path(self.run_id, self.kind, pending.generation) if pending.generation
                      else f"{self.base}/{STAGING}" if pending.staged else self.base)
            damaged = set()
        for name in sequence_groups:
            copy_within(self.zstore, f"{source}/{name}", self.path(name),
                        skip={f"{source}/{key}" for key in damaged if key.startswith(f"{name}/")})

    def _committed_folders(self, done: Commit | None) -> tuple[str, ...]:
        """The folders of the kind's that the commit ``done`` reads."""
        if done is None:
            return ()
        return (done.generation,) if done.generation else done.groups

    def _garbage(self, done: Commit | None) -> tuple[str, ...]:
        """What the kind's folder held, listed before this writer's first record write, that
        the commit ``done`` does not read."""
        keep = set(self._committed_folders(done))
        return tuple(name for name in self._listed if name not in keep)

    def _remove_garbage(self, keep: Sequence[str]) -> None:
        """Remove what the kind's folder held before this writer's first record write, but
        ``keep``: called after a record write of this writer, so nothing it removes can be
        named by a record (:meth:`__enter__`)."""
        for name in self._listed:
            if name not in keep:
                remove_dir(self.zstore, f"{self.base}/{name}")

    def _discard_damaged(self, names: Sequence[str]) -> None:
        """Remove the damaged objects of the groups ``names`` (their commit dropped first),
        so that a rewrite in place never reads one."""
        delete_objects(self.zstore, [f"{self.base}/{key}" for name in names
                                     for key, _ in (self.damage[name].objects if name in self.damage else ())])

    # Moving groups into place.

    def _promote(self, names: Sequence[str], pending: Pending) -> None:
        """Move the staged groups ``names``, complete, into place; ``pending`` says what they
        hold. The commit is dropped for this step (readers see an incomplete group); a rerun
        after a kill finishes it (:meth:`_resume_promotion`). The caller commits next."""
        self._set_pending(replace(pending, promoting=tuple(names)), keep_commit=False)
        self._finish_promotion(names)

    def _finish_promotion(self, names: Sequence[str]) -> None:
        for name in names:
            if node_exists(self.zstore, self.path(name, staged=True)):
                move_group(self.url, self.zstore, self.path(name, staged=True), self.path(name))

    def _resume_promotion(self) -> Pending | None:
        """Finish a promotion a killed writer left half done, returning its record (None if
        there was none). Its groups are complete in staging (promotion starts only then), so
        the result is the update's, as if uninterrupted; the caller commits it."""
        pending = self.state.pending
        if pending is None or not pending.promoting:
            return None
        self._finish_promotion(pending.promoting)
        return pending


def _without_generation(record: dict[str, Any]) -> dict[str, Any]:
    """A commit or pending record as written: without ``generation`` where it is "" (a local
    writer's, whose records read as before generations)."""
    return {key: value for key, value in record.items() if key != "generation" or value}


@dataclass
class _Update:
    """An update under way: ``done`` the commit it ends with, ``pending`` what is recorded
    written so far, ``arrays`` the per-sequence groups' arrays (group -> name -> array)."""

    done: Commit
    pending: Pending
    arrays: dict[str, dict[str, Any]]
