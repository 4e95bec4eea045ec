"""Derived groups (``analysis``, ``ablation``) and their commit record (docs/store.md#commit-protocol).

A derived group ``runs/<id>/<kind>`` carries a record in its attributes, under ``attngeom``:

- ``commit``: what the groups at ``runs/<id>/<kind>/<name>`` hold once finished: the run's
  sequences they cover (in the order of their ``seq`` axis), the parameters they were
  computed with, the group names, and the attngeom version. It is the writer's last write.
  A reader sees the results only through it (:func:`open_derived`).
- ``pending``: an update under way or interrupted: its parameters, the sequences already
  written, and whether it writes into the staging group ``runs/<id>/<kind>/_next`` (the
  commit then stays valid meanwhile) or into the groups themselves (the commit was dropped
  first, unless it only appends sequences beyond the committed ones). ``promoting`` lists
  groups being moved from staging into place: the commit is dropped for that short step,
  and a rerun finishes it.

So a writer touches nothing a commit covers without dropping the commit first, and it
writes the commit last: a killed writer leaves either the earlier finished results or a
group that every reader refuses as incomplete. A derived group without any record predates
records (attngeom 0.1.0 stores) and is read as it is.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import xarray as xr
import zarr
from zarr.core.sync import sync

from attngeom import __version__
from attngeom.errors import GroupNotFoundError, IncompleteGroupError
from attngeom.store.access import copy_group, jsonable, local_path, open_dataset, write_dataset, zarr_store
from attngeom.store.schema import ABLATION, ANALYSIS, ATTR_KEY, run_path

__all__ = [
    "STAGING",
    "Commit",
    "DerivedState",
    "Pending",
    "commit",
    "derived_problems",
    "derived_state",
    "open_derived",
    "promote",
    "replace_groups",
    "resume_promotion",
    "set_pending",
    "staged_path",
]

# The staging group inside a derived group: results replacing committed ones are written
# here first, then moved into place.
STAGING = "_next"
_RERUN = {ANALYSIS: "attngeom analyze", ABLATION: "attngeom ablate"}


@dataclass(frozen=True)
class Commit:
    """Finished results: ``sequences`` (run sequence ids, in ``seq`` order) covered by the
    ``sequence_groups`` (which grow along ``seq``), computed with ``parameters``."""

    parameters: dict[str, Any]
    groups: tuple[str, ...]
    sequences: tuple[int, ...] = ()
    sequence_groups: tuple[str, ...] = ()
    attngeom_version: str = __version__


@dataclass(frozen=True)
class Pending:
    """An update under way (or interrupted): ``sequences`` written so far with
    ``parameters``, into staging when ``staged``; ``promoting`` groups are being moved into
    place."""

    parameters: dict[str, Any]
    sequences: tuple[int, ...] = ()
    staged: bool = False
    promoting: tuple[str, ...] = ()


@dataclass(frozen=True)
class DerivedState:
    """The record of ``runs/<run_id>/<kind>``; ``exists`` False when there is no such group,
    ``legacy`` when the group predates records."""

    run_id: str
    kind: str
    exists: bool = False
    legacy: bool = False
    commit: Commit | None = None
    pending: Pending | None = field(default=None)

    @property
    def readable(self) -> bool:
        """Whether readers may use the groups: finished, and nothing being moved into place."""
        if self.legacy:
            return True
        return self.commit is not None and not (self.pending is not None and self.pending.promoting)


def _kind_path(run_id: str, kind: str) -> str:
    return f"{run_path(run_id)}/{kind}"


def _group_path(run_id: str, kind: str, name: str, *, staged: bool = False) -> str:
    return f"{_kind_path(run_id, kind)}/{STAGING}/{name}" if staged else f"{_kind_path(run_id, kind)}/{name}"


def _open_kind(url: str, run_id: str, kind: str, *, writing: bool) -> zarr.Group | None:
    try:
        return zarr.open_group(
            zarr_store(url, read_only=not writing), path=_kind_path(run_id, kind),
            mode="r+" if writing else "r", use_consolidated=False,
        )
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
        return None


def derived_state(url: str, run_id: str, kind: str) -> DerivedState:
    """The record of ``runs/<run_id>/<kind>`` (one read of the group's metadata)."""
    group = _open_kind(url, run_id, kind, writing=False)
    if group is None:
        return DerivedState(run_id, kind)
    record = group.attrs.get(ATTR_KEY)
    if not isinstance(record, Mapping):
        return DerivedState(run_id, kind, exists=True, legacy=True)
    done, pending = record.get("commit"), record.get("pending")
    return DerivedState(
        run_id, kind, exists=True,
        commit=Commit(
            parameters=dict(done["parameters"]), groups=tuple(done["groups"]),
            sequences=tuple(done.get("sequences", ())), sequence_groups=tuple(done.get("sequence_groups", ())),
            attngeom_version=str(done.get("attngeom_version", "")),
        ) if isinstance(done, Mapping) else None,
        pending=Pending(
            parameters=dict(pending["parameters"]), sequences=tuple(pending.get("sequences", ())),
            staged=bool(pending.get("staged")), promoting=tuple(pending.get("promoting", ())),
        ) if isinstance(pending, Mapping) else None,
    )


def _write_record(url: str, run_id: str, kind: str, done: Commit | None, pending: Pending | None) -> None:
    """Replace the record: one write of the group's ``zarr.json`` (created with it if absent)."""
    record: dict[str, Any] = {}
    if done is not None:
        record["commit"] = jsonable(done.__dict__)
    if pending is not None:
        record["pending"] = jsonable(pending.__dict__)
    group = _open_kind(url, run_id, kind, writing=True)
    if group is None:
        zarr.open_group(zarr_store(url, read_only=False), path=run_path(run_id), mode="r+",
                        use_consolidated=False).create_group(kind, attributes={ATTR_KEY: record})
        return
    group.attrs[ATTR_KEY] = record


def set_pending(url: str, run_id: str, kind: str, pending: Pending, *, keep_commit: bool) -> None:
    """Record an update under way; ``keep_commit`` False drops the commit first (in the same
    write), as any writer must before touching what it covers."""
    state = derived_state(url, run_id, kind)
    _write_record(url, run_id, kind, state.commit if keep_commit else None, pending)


def commit(url: str, run_id: str, kind: str, done: Commit) -> None:
    """Write the commit record (and forget the pending update): the writer's last write.
    Leftover staging is removed first."""
    _remove(url, f"{_kind_path(run_id, kind)}/{STAGING}")
    _write_record(url, run_id, kind, done, None)


# Moving and removing groups: a folder rename on a local store; on any other store (object
# stores have no rename) a copy of each object through the zarr Store, then a delete.


def _remove(url: str, path: str) -> None:
    local = local_path(url)
    if local is not None:
        shutil.rmtree(local / path, ignore_errors=True)
        return
    sync(zarr_store(url, read_only=False).delete_dir(path))


def _move(url: str, source: str, target: str) -> None:
    """Move the group at ``source`` to ``target``, replacing it."""
    _remove(url, target)
    local = local_path(url)
    if local is not None:
        os.replace(local / source, local / target)
        return
    store = zarr_store(url, read_only=False)

    async def move() -> None:
        await copy_group(store, source, store, target)
        await store.delete_dir(source)

    sync(move())


def _exists(url: str, path: str) -> bool:
    local = local_path(url)
    if local is not None:
        return (local / path / "zarr.json").exists()
    return sync(zarr_store(url, read_only=True).exists(f"{path}/zarr.json"))


def promote(url: str, run_id: str, kind: str, names: Sequence[str], pending: Pending) -> None:
    """Move the staged groups ``names``, complete, into place; ``pending`` says what they
    hold. The commit is dropped for this step (readers see an incomplete group); a rerun
    after a kill finishes it (:func:`resume_promotion`). The caller commits next."""
    set_pending(url, run_id, kind, replace(pending, promoting=tuple(names)), keep_commit=False)
    _finish_promotion(url, run_id, kind, names)


def _finish_promotion(url: str, run_id: str, kind: str, names: Sequence[str]) -> None:
    for name in names:
        staged = _group_path(run_id, kind, name, staged=True)
        if _exists(url, staged):
            _move(url, staged, _group_path(run_id, kind, name))


def resume_promotion(url: str, state: DerivedState) -> bool:
    """Finish a promotion a killed writer left half done; True if there was one. Its
    groups are complete in staging (promotion starts only then), so the result is the
    update's, as if uninterrupted; the caller commits it."""
    if state.pending is None or not state.pending.promoting:
        return False
    _finish_promotion(url, state.run_id, state.kind, state.pending.promoting)
    return True


def staged_path(run_id: str, kind: str, name: str) -> str:
    """Where ``name`` is written while staged: ``runs/<id>/<kind>/_next/<name>``."""
    return _group_path(run_id, kind, name, staged=True)


def replace_groups(url: str, run_id: str, kind: str, groups: Mapping[str, xr.Dataset],
                   parameters: Mapping[str, Any]) -> None:
    """Replace every group of ``runs/<run_id>/<kind>`` by ``groups``, as a whole.

    Written into staging while the earlier commit (if any) stays readable, then moved into
    place, groups of the earlier results that ``groups`` lacks removed, then committed.
    """
    params = jsonable(dict(parameters))
    set_pending(url, run_id, kind, Pending(params, staged=True), keep_commit=True)
    _remove(url, f"{_kind_path(run_id, kind)}/{STAGING}")
    for name, dataset in groups.items():
        write_dataset(dataset, url, staged_path(run_id, kind, name))
    group = _open_kind(url, run_id, kind, writing=False)
    stale = {name for name in (group.group_keys() if group is not None else ()) if name != STAGING} - set(groups)
    promote(url, run_id, kind, list(groups), Pending(params, staged=True))
    for name in stale:
        _remove(url, _group_path(run_id, kind, name))
    commit(url, run_id, kind, Commit(params, tuple(groups)))


def _incomplete(url: str, state: DerivedState) -> IncompleteGroupError:
    what = "analyze" if state.kind == ANALYSIS else "ablate"
    return IncompleteGroupError(
        f"{state.kind} of run {state.run_id} is incomplete (interrupted {what}); "
        f"re-run `{_RERUN.get(state.kind, 'attngeom')} --store {url} --run {state.run_id}`"
    )


def open_derived(url: str, run_id: str, kind: str, name: str) -> xr.Dataset:
    """The finished group ``runs/<run_id>/<kind>/<name>`` as a lazy Dataset, through its
    commit record: the one way attngeom reads derived results.

    Groups that grow along ``seq`` are cut to the sequences the commit covers. Raises
    :class:`GroupNotFoundError` when the run has no such results and
    :class:`IncompleteGroupError` when they are not finished (an interrupted writer).
    """
    state = derived_state(url, run_id, kind)
    if not state.exists:
        command = _RERUN.get(kind, "attngeom")
        raise GroupNotFoundError(f"run {run_id} has no {kind} (run `{command} --store {url} --run {run_id}`)")
    if not state.readable:
        raise _incomplete(url, state)
    if state.commit is not None and name not in state.commit.groups:
        raise GroupNotFoundError(f"{kind} of run {run_id} has no group '{name}'")
    try:
        ds = open_dataset(url, _group_path(run_id, kind, name))
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError) as exc:
        if state.legacy:
            raise GroupNotFoundError(f"{kind} of run {run_id} has no group '{name}'") from exc
        raise _incomplete(url, state) from exc
    if state.commit is not None and name in state.commit.sequence_groups:
        ds = ds.isel(seq=slice(0, len(state.commit.sequences)))
    return ds


def derived_problems(url: str, run_id: str, committed_sequences: Sequence[int]) -> list[str]:
    """Problems of a run's derived groups, one line each: an incomplete one (interrupted
    writer), a committed group that is missing, or an analysis covering a sequence the run
    does not hold as committed."""
    problems = []
    done = set(int(s) for s in committed_sequences)
    for kind in (ANALYSIS, ABLATION):
        state = derived_state(url, run_id, kind)
        if not state.exists or state.legacy:
            continue
        if not state.readable:
            problems.append(str(_incomplete(url, state)))
            continue
        assert state.commit is not None
        for name in state.commit.groups:
            if not _exists(url, _group_path(run_id, kind, name)):
                problems.append(f"run {run_id}: {kind} is committed but lacks its group '{name}'")
        unknown = sorted(set(state.commit.sequences) - done)
        if unknown:
            problems.append(f"run {run_id}: {kind} covers sequences {unknown[:5]} the run does not hold as complete")
    return problems
