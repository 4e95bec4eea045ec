"""Reading derived groups (``analysis``, ``ablation``, ``detect``) through their commit
record (docs/store.md#commit-protocol), and the problems of derived groups that validate names.

:func:`read_derived` is the one way attngeom reads derived results: a group is seen only as a
commit covers it, and an incomplete, damaged or unreadable one is refused with a one-line
error saying which command rewrites it. :func:`derived_problems` words the same faults, and
the commits' claims on sequences the run does not hold, as validate's problems;
:func:`unheld_claims` tells a writer (detect) that its results describe data the run lacks.
The record itself is read by :mod:`attngeom.store.derived_groups.record`; :mod:`attngeom.store.derived_groups.derived`
writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xarray as xr
import zarr

from attngeom.errors import DamagedStoreError, GroupNotFoundError, IncompleteGroupError, InProgressError
from attngeom.store.objects.commands import stage_command
from attngeom.store.objects.damage import Problem
from attngeom.store.extracted.datasets import open_dataset
from attngeom.store.holds.locks import holder_words, live_holder
from attngeom.store.derived_groups.record import Commit, Damage, DerivedState, damage_found, kind_path, read_state
from attngeom.store.objects.schema import DERIVED
from attngeom.store.objects.storage import node_exists

__all__ = ["derived_problems", "read_derived", "unheld_claims"]


def _rerun(url: str, run_id: str, kind: str) -> str:
    return f"run `{stage_command(DERIVED.get(kind, kind), url, run_id)}` again to rewrite it"


def _damaged(url: str, state: DerivedState, damage: Damage) -> DamagedStoreError:
    return DamagedStoreError(
        f"{state.groups_path}/{damage}; {_rerun(url, state.run_id, state.kind)}"
    )


# The options of each stage that its recorded parameters give back, in the order its hint
# names them: an interrupted update is finished by its own command, not by the defaults.
_OPTIONS = {
    "analyze": (("n_grid", "--n-grid"), ("seed", "--seed")),
    "ablate": (("retention", "--retention"), ("random_masks", "--random-masks"), ("seed", "--seed"),
               ("protect", "--protect"), ("protect_critical", "--protect-critical")),
    "detect": (("probes", "--probes"), ("haystack_sequences", "--haystacks"), ("needle_length", "--needle-length"),
               ("depths", "--depths"), ("seed", "--seed")),
}


def _options(stage: str, parameters: Mapping[str, Any]) -> str:
    """' --probes 4 --haystacks 2 ...': the command-line options giving ``parameters`` back."""
    out = []
    for key, flag in _OPTIONS.get(stage, ()):
        value = parameters.get(key)
        if value is None or value is False or value == []:
            continue
        if key == "haystack_sequences":
            value = len(value)
        elif key == "protect":
            value = ",".join(f"{layer}.{head}" for layer, head in value)
        elif isinstance(value, list):
            value = ",".join(map(str, value))
        out.append(flag if value is True else f"{flag} {value}")
    return "".join(f" {part}" for part in out)


def _incomplete(url: str, state: DerivedState) -> IncompleteGroupError:
    stage = DERIVED.get(state.kind, "")
    options = _options(stage, state.pending.parameters) if state.pending is not None else ""
    return IncompleteGroupError(
        f"{state.kind} of run {state.run_id} is incomplete (interrupted {stage or 'writer'}); "
        f"re-run `{stage_command(stage, url, state.run_id, options)}`"
    )


def _in_progress(state: DerivedState, holder: Mapping[str, Any]) -> InProgressError:
    return InProgressError(
        f"{state.kind} of run {state.run_id} is in progress: {holder_words(state.run_id, dict(holder))} is "
        f"writing it; wait for it to finish (it is not interrupted)"
    )


def _writer_at_work(zstore: Any, state: DerivedState) -> dict[str, Any] | None:
    """The live writer of the run if it is this kind's stage (another stage holding the run
    writes another group); None when none is."""
    holder = live_holder(zstore, state.run_id)
    if holder is not None and holder.get("command", DERIVED.get(state.kind)) == DERIVED.get(state.kind):
        return holder
    return None


def _unreadable_record(url: str, state: DerivedState) -> DamagedStoreError:
    return DamagedStoreError(
        f"{kind_path(state.run_id, state.kind)}/zarr.json is {state.fault}; {_rerun(url, state.run_id, state.kind)}"
    )


def read_derived(zstore: Any, url: str, run_id: str, kind: str, name: str) -> xr.Dataset:
    """The finished group ``runs/<run_id>/<kind>/<name>`` of the store at ``url``, opened
    as ``zstore``, as a lazy Dataset, through its commit record: the one way attngeom reads
    derived results, called by :meth:`~attngeom.store.session.RunReader.derived`.

    Groups that grow along ``seq`` are cut to the sequences the commit covers. Raises
    :class:`GroupNotFoundError` when the run has no such results,
    :class:`IncompleteGroupError` when they are not finished (an interrupted writer;
    :class:`InProgressError` while their writer is at work, holding the run), and
    :class:`DamagedStoreError` when the record does not parse or an object the commit lists
    is missing or of another size (one listing of the group).
    """
    state = read_state(zstore, run_id, kind)
    if not state.readable and (holder := _writer_at_work(zstore, state)) is not None:
        raise _in_progress(state, holder)
    if not state.exists:
        raise GroupNotFoundError(
            f"run {run_id} has no {kind} (run `{stage_command(DERIVED.get(kind, ''), url, run_id)}`)"
        )
    if state.unreadable:
        raise _unreadable_record(url, state)
    if not state.readable:
        raise _incomplete(url, state)
    if state.commit is not None and name not in state.commit.groups:
        raise GroupNotFoundError(f"{kind} of run {run_id} has no group '{name}'")
    damage = damage_found(zstore, state, [name], deep=False)
    if damage:
        raise _damaged(url, state, damage[name])
    try:
        ds = open_dataset(zstore, url, f"{state.groups_path}/{name}")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError) as exc:
        if state.legacy:
            raise GroupNotFoundError(f"{kind} of run {run_id} has no group '{name}'") from exc
        raise _incomplete(url, state) from exc
    if state.commit is not None and name in state.commit.sequence_groups:
        ds = ds.isel(seq=slice(0, len(state.commit.sequences)))
    return ds


def derived_problems(zstore: Any, url: str, run_id: str, committed_sequences: Sequence[int]) -> list[Problem]:
    """Problems of a run's derived groups, one line each: an incomplete one (interrupted
    writer; or one in progress, its writer named), a malformed record, an empty folder left
    where one would be, a committed group that is missing or whose objects are (or have
    another size), or a record claiming sequences the run does not hold as committed (those
    it covers, and those its parameters name). An unparsable or lost record is named as the
    metadata check words it (validate names it once). ``zstore``: the store at ``url`` as
    the validator opened it. Each problem names the objects it is about, if any."""
    problems = []
    done = set(int(s) for s in committed_sequences)
    for kind in DERIVED:
        state = read_state(zstore, run_id, kind)
        if state.leftover:
            problems.append(Problem(f"{kind_path(run_id, kind)} is an empty folder, left by a {DERIVED[kind]} "
                                    f"stopped before its first write (a full disk?); harmless: the next writer "
                                    f"that writes the store alone removes it"))
            continue
        if not state.readable and (holder := _writer_at_work(zstore, state)) is not None:
            problems.append(Problem(str(_in_progress(state, holder))))
            continue
        if not state.exists or state.legacy:
            continue
        if state.unreadable:
            problems.append(Problem(str(_unreadable_record(url, state)), (f"{kind_path(run_id, kind)}/zarr.json",)))
            continue
        if not state.readable:
            problems.append(Problem(str(_incomplete(url, state))))
            continue
        assert state.commit is not None
        damage = damage_found(zstore, state, state.commit.groups, deep=False)
        for name in state.commit.groups:
            if name in damage:
                problems.append(Problem(str(_damaged(url, state, damage[name])),
                                        tuple(f"{state.groups_path}/{key}" for key, _ in damage[name].objects)))
            elif not state.commit.objects and not node_exists(zstore, f"{state.groups_path}/{name}"):
                problems.append(Problem(f"run {run_id}: {kind} is committed but lacks its group '{name}'"))
        for what, claimed in _claims(state.commit).items():
            unknown = sorted(set(claimed) - done)
            if unknown:
                problems.append(Problem(f"run {run_id}: {kind} {what} sequences {unknown[:5]} the run does not "
                                        f"hold as complete"))
    return problems


def _claims(done: Commit) -> dict[str, list[int]]:
    """The run's sequences a commit says its results were computed from, by what says it:
    the sequences it covers, and each parameter listing sequences (``*_sequences``)."""
    claims = {"covers": list(done.sequences)}
    for key, value in sorted(done.parameters.items()):
        if key.endswith("_sequences") and isinstance(value, list):
            claims[f"parameter '{key}' names"] = value
    return claims


def unheld_claims(state: DerivedState, committed: Sequence[int]) -> bool:
    """Whether the commit of ``state`` claims a sequence the run does not hold as committed
    (``committed``): its results then describe data the run lacks, and are computed again."""
    held = set(int(s) for s in committed)
    return state.commit is not None and any(set(claimed) - held for claimed in _claims(state.commit).values())
