"""The plan of a derived update (attngeom.store.derived_groups.plan), from a table of cases: which
sequences are kept, whether the update writes into staging or in place, whether the commit
stays readable meanwhile, and why earlier results are recomputed."""

from __future__ import annotations

import pytest

from attngeom.store.derived_groups.record import Commit, Damage, DerivedState, Pending
from attngeom.store.derived_groups.plan import changes, healing, plan_update

A = {"n_grid": [1, 2, 4], "seed": 0}
B = {"n_grid": [1, 2, 4], "seed": 1}
GROUPS, SEQUENCE_GROUPS = ("topn", "values", "heads"), ("topn", "values")


def state(commit=None, pending=None, *, legacy=False):
    done = Commit(commit[0], GROUPS, commit[1], SEQUENCE_GROUPS) if commit else None
    return DerivedState("r", "analysis", exists=bool(commit or pending or legacy), legacy=legacy, commit=done,
                        pending=Pending(*pending) if pending else None)


CASES = [
    # (record, params, target) -> (keep, staged, keep_commit, up_to_date, recomputed)
    ("nothing yet", state(), A, (0, 1), ((), False, False, False, None)),
    ("appended", state((A, (0, 1))), A, (0, 1, 2), ((0, 1), False, True, False, None)),
    ("up to date", state((A, (0, 1))), A, (0, 1), ((0, 1), False, True, True, None)),
    ("other parameters", state((A, (0, 1))), B, (0, 1), ((), True, True, False, "seed 0 -> 1")),
    ("not a prefix", state((A, (0, 2))), A, (0, 1, 2), ((), True, True, False,
                                                       "sequences completed before the last analyzed one, or "
                                                       "analyzed sequences are gone from the run")),
    ("interrupted append resumed", state((A, (0,)), (A, (0, 1), False)), A, (0, 1, 2),
     ((0, 1), False, True, False, None)),
    ("interrupted append finished", state((A, (0,)), (A, (0, 1), False)), A, (0, 1),
     ((0, 1), False, True, False, None)),
    ("interrupted first analyze resumed", state(None, (A, (0,), False)), A, (0, 1), ((0,), False, False, False, None)),
    ("interrupted first analyze, other parameters", state(None, (A, (0,), False)), B, (0, 1),
     ((), False, False, False, "the interrupted analyze had other parameters (seed 0 -> 1)")),
    ("interrupted recompute resumed in staging", state((A, (0, 1)), (B, (0,), True)), B, (0, 1),
     ((0,), True, True, False, "seed 0 -> 1")),
    ("staged work of other parameters dropped", state((A, (0, 1)), (B, (0,), True)), {**B, "seed": 2}, (0, 1),
     ((), True, True, False, "seed 0 -> 2")),
    ("legacy", state(legacy=True), A, (0, 1), ((), False, False, False,
                                                "the earlier analysis records no parameters (written before "
                                                "attngeom recorded them)")),
]


@pytest.mark.parametrize("name, record, params, target, want", CASES, ids=[c[0] for c in CASES])
def test_plan(name, record, params, target, want):
    plan = plan_update(record, params, target)
    assert (plan.keep, plan.staged, plan.keep_commit, plan.up_to_date, plan.recomputed) == want
    assert plan.target == target and plan.heal == ()


HEALING = [
    # damage -> (keep, keep_commit, heal)
    ("a per-sequence group from its second sequence", {"topn": Damage("topn", (("topn/x/c.1", "missing"),), 1)},
     ((0,), False, ("topn",))),
    ("a per-sequence group's metadata", {"values": Damage("values", (("values/zarr.json", "missing"),), None)},
     ((), False, ("values",))),
    ("a group across sequences", {"heads": Damage("heads", (("heads/C/c.0", "missing"),), None)},
     ((0, 1, 2), True, ("heads",))),
]


@pytest.mark.parametrize("name, damage, want", HEALING, ids=[c[0] for c in HEALING])
def test_healing(name, damage, want):
    plan = healing(plan_update(state((A, (0, 1, 2))), A, (0, 1, 2)), damage, SEQUENCE_GROUPS)
    assert (plan.keep, plan.keep_commit, plan.heal) == want and not plan.up_to_date and not plan.staged


def test_a_recompute_into_staging_heals_by_replacing():
    plan = plan_update(state((A, (0, 1))), B, (0, 1))
    assert healing(plan, {"topn": Damage("topn", (("topn/x/c.0", "missing"),), 0)}, SEQUENCE_GROUPS) == plan


def test_changes_name_what_differs_in_order():
    assert changes({"seed": 0, "n_grid": [1, 2]}, {"seed": 1, "n_grid": [1, 4]}) == "n grid 1,2 -> 1,4; seed 0 -> 1"
