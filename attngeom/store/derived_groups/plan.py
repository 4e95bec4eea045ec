"""How a derived update brings its groups up to date: pure functions of the commit record.

:func:`plan_update` reads the record (:class:`~attngeom.store.derived_groups.record.DerivedState`), the
parameters of the update and the sequences it must cover, and says which committed or
written sequences it keeps, whether it writes into staging (the commit stays readable
meanwhile) or in place, and why earlier results are recomputed; :func:`healing` adds the
damaged committed groups to write again. Nothing here touches a store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attngeom.store.derived_groups.record import Damage, DerivedState

__all__ = ["Plan", "changes", "healing", "plan_update"]


@dataclass(frozen=True)
class Plan:
    """How to bring one run's derived groups to ``target`` (the run's committed sequences,
    in order): ``keep`` is the prefix already written with these parameters (in staging
    when ``staged``); the earlier commit stays valid meanwhile when ``keep_commit``;
    ``recomputed`` says why earlier results are recomputed rather than extended (None when
    they are extended, or there are none); ``heal`` names the damaged committed groups to
    write again; ``up_to_date`` when there is nothing to do."""

    target: tuple[int, ...]
    keep: tuple[int, ...]
    staged: bool
    keep_commit: bool
    recomputed: str | None
    heal: tuple[str, ...] = ()
    up_to_date: bool = False


# How the parameters an analysis records are named in the reasons given to users.
_PARAMETER_NAMES = {"n_grid": "n grid", "seed": "seed", "random_draws": "random draws",
                    "analysis_version": "analysis code version"}


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """'n grid 1,2,4 -> 1,4; seed 0 -> 1': the parameters that differ."""

    def show(x: Any) -> str:
        return ",".join(map(str, x)) if isinstance(x, list) else str(x)

    keys = sorted(set(old) | set(new), key=lambda k: list(_PARAMETER_NAMES).index(k) if k in _PARAMETER_NAMES else 99)
    return "; ".join(f"{_PARAMETER_NAMES.get(k, k)} {show(old.get(k))} -> {show(new.get(k))}"
                     for k in keys if old.get(k) != new.get(k))


def _is_prefix(head: Sequence[int], seq: Sequence[int]) -> bool:
    return tuple(seq[: len(head)]) == tuple(head)


def plan_update(state: DerivedState, params: Mapping[str, Any], target: tuple[int, ...]) -> Plan:
    """The plan of an update with ``params`` to ``target`` from the record ``state``: a
    commit with these parameters covering a prefix of ``target`` is extended in place (also
    beyond an interrupted in-place append of it); anything else is recomputed, into staging
    when there is a commit to keep readable, resuming an interrupted update of the same
    parameters and place."""
    done, pending = state.commit, state.pending
    if done is not None and done.parameters == params and _is_prefix(done.sequences, target):
        keep = done.sequences
        if (pending is not None and not pending.staged and pending.parameters == params
                and _is_prefix(keep, pending.sequences) and _is_prefix(pending.sequences, target)):
            keep = pending.sequences
        return Plan(target, keep, staged=False, keep_commit=True, recomputed=None,
                    up_to_date=keep == target and pending is None)
    if state.legacy:
        reason = "the earlier analysis records no parameters (written before attngeom recorded them)"
    elif done is not None and done.parameters != params:
        reason = changes(done.parameters, params)
    elif done is not None:
        reason = "sequences completed before the last analyzed one, or analyzed sequences are gone from the run"
    else:
        reason = None
    staged = done is not None
    keep: tuple[int, ...] = ()
    if (pending is not None and pending.parameters == params and pending.staged == staged
            and _is_prefix(pending.sequences, target)):
        keep = pending.sequences
    elif pending is not None and done is None and pending.parameters != params:
        reason = f"the interrupted analyze had other parameters ({changes(pending.parameters, params)})"
    return Plan(target, keep, staged=staged, keep_commit=staged, recomputed=reason)


def healing(plan: Plan, damage: Mapping[str, Damage], sequence_groups: Sequence[str]) -> Plan:
    """``plan`` also rewriting the damaged committed groups. A recomputation into staging
    replaces them all anyway; otherwise the per-sequence groups (``sequence_groups``) are
    computed again from their first damaged sequence on, in place (so the commit is dropped
    first), and the groups across sequences, recomputed by any update that is not up to
    date, with them."""
    if not damage or plan.staged:
        return plan
    plan = replace(plan, heal=tuple(sorted(damage)), up_to_date=False)
    starts = [d.seq_from or 0 for d in damage.values() if d.group in sequence_groups]
    if starts:
        plan = replace(plan, keep=plan.keep[: min(starts)], keep_commit=False)
    return plan
