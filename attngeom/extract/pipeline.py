"""The extract stage, one way: the request resolved and checked once (:func:`~attngeom.extract.request.preflight`,
before torch or the store's package loads), the command's one store session opened, a run
that holds every sequence asked for answered through it, and otherwise the run written
(:func:`attngeom.extract.writing.write_run`: the model, the forward, the writes). Light: torch
loads only where there is something to write."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from attngeom.errors import InputError
from attngeom.extract.request import ExtractPlan, ExtractRequest, ExtractResult, preflight

if TYPE_CHECKING:
    from attngeom.store.session import StoreSession

__all__ = ["ExtractRequest", "ExtractResult", "answer", "extract"]


def extract(request: ExtractRequest) -> ExtractResult:
    """Run ``extract``; raises :class:`InputError` (or a :class:`StoreError`) on bad input
    with the store untouched. Every read and write of the store goes through one
    ``StoreSession(store, mode="c")``, opened here. Libraries' own bars are shown only with
    the request's ``progress`` (:func:`attngeom.extract.models.library_bars`)."""
    plan = preflight(request)
    from attngeom.store.session import StoreSession

    with StoreSession(request.store, mode="c") as session:
        done = answer(plan, session)
        if done is not None:
            return done
        from attngeom.extract.models import library_bars
        from attngeom.extract.writing import write_run

        with library_bars(request.progress):
            return write_run(plan, session)


def answer(plan: ExtractPlan, session: StoreSession) -> ExtractResult | None:
    """The result when ``plan``'s run holds every sequence asked for already (nothing to load
    or write), read through the command's ``session`` (mode "c") and the run checked as a
    finished extract checks it; None when there is something to write. :class:`InputError`
    for a run lacking arrays, which takes no new sequences."""
    done = None if plan.total is None else _finished(session, plan.run_id, plan.total, plan.shard)
    if done is None and plan.lacking:
        raise InputError(
            f"run '{plan.run_id}' in {session.url} was extracted before attngeom kept "
            f"{' and '.join(plan.lacking)} (migrated from an earlier store format) and takes no new sequences; "
            "choose another --run"
        )
    return done


def _finished(session: StoreSession, run_id: str, total: int, shard: tuple[int, int] | None) -> ExtractResult | None:
    """The result of an extract with nothing to write: run ``run_id`` holds every sequence of
    ``range(total)`` (of this shard) committed; None when it does not."""
    start = time.perf_counter()
    with session.run_write(run_id, shard=shard).begin(total) as begun:
        if begun.todo:
            return None
        committed = begun.commit()
        return ExtractResult(run_id, 0, committed, begun.capacity, time.perf_counter() - start)
