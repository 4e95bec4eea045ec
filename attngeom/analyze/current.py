"""Whether an analyze has anything to do, answered before Dask, xarray and the kernels load.

An analysis committed with the parameters asked for over exactly its run's committed
sequences, nothing of it pending, lost, resized or unreadable, is up to date: the runner
would open the run, load the kernels, start its workers, find nothing to do and refresh the
consolidated metadata. :func:`analyzed` makes the runner's checks of the run and of the
commit from the records, the run's flags and one listing of the analysis, with zarr alone,
and answers as the runner does; anything else (an update to make or to finish, damage to
heal, a record to drop, a warning to give, tables to write) is left to the runner, in the
same session.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from attngeom.analyze.parameters import AnalyzeRequest, AnalyzeResult, analysis_parameters, default_n_grid
from attngeom.store import ANALYSIS, DERIVED, check_committed, completed, consolidate, jsonable, local_path, run_layout
from attngeom.store.objects.damage import DECODE_ERRORS
from attngeom.store.derived_groups.plan import plan_update
from attngeom.store.derived_groups.record import derived_damage, kind_path, read_state

if TYPE_CHECKING:
    from attngeom.store.session import StoreSession

__all__ = ["analyzed"]


def analyzed(request: AnalyzeRequest, session: StoreSession) -> list[AnalyzeResult] | None:
    """The results of ``request`` when every run it names is analyzed already (its analysis
    committed with the request's parameters over exactly the run's committed sequences,
    nothing pending, no committed object lost or resized, or with ``deep`` failing to
    decode, no metadata that does not parse, the run holding the field's summaries); None
    when any has something to do, or the request asks for what only the runner does
    (``out``; a scheduler's address, which it must reach or refuse; a store that is not on a
    local disk, where the runner's own reads answer and every request counts). A damaged run
    raises the error the runner raises. ``session``: the store opened for writing; each run
    is locked as the runner locks it, and the consolidated metadata refreshed as it does."""
    if (request.out is not None or local_path(request.store) is None
            or request.scheduler not in (None, "threads", "processes")):
        return None
    starts, runs, states = {}, {}, {}
    todo = [request.run_id] if request.run_id is not None else session.runs()
    # First what says whether there is work: every record, then every run's flags (an
    # incremental analyze goes on at once to the runner, which checks the runs); the runs'
    # checks only when there is none.
    for run_id in todo:
        starts[run_id] = time.perf_counter()
        runs[run_id] = session.run(run_id)
        session.lock(run_id, DERIVED[ANALYSIS])
        state = states[run_id] = read_state(session.zstore, run_id, ANALYSIS)
        if state.commit is None or state.pending is not None:
            return None
    counts = {}
    for run_id, state in states.items():
        try:
            # Flags sized unlike the run's rows are not read (they could claim 10**12
            # sequences): the runner names them.
            if runs[run_id]["complete"].shape[:1] != runs[run_id]["attn_last"].shape[:1]:
                return None
            layout, target = run_layout(runs[run_id]), tuple(int(s) for s in completed(runs[run_id]))
        except (KeyError, *DECODE_ERRORS):  # the runner names it
            return None
        grid = sorted(set(request.n_grid)) if request.n_grid else default_n_grid(layout.length)
        # The runner refuses an empty run or a grid that does not fit L, and warns of a run
        # without the field's summaries.
        if layout.lacking or not target or grid[0] < 1 or grid[-1] >= layout.length:
            return None
        if not plan_update(state, jsonable(analysis_parameters(grid, request.seed)), target).up_to_date:
            return None
        counts[run_id] = len(target), len(target) * layout.n_layers * layout.n_heads
    for run_id, state in states.items():
        check_committed(session.url, runs[run_id], run_id)
        if derived_damage(session.zstore, state, deep=request.deep):
            return None
    results = []
    for run_id, (sequences, instances) in counts.items():
        consolidate(session.root, own=kind_path(run_id, ANALYSIS))
        results.append(AnalyzeResult(run_id, sequences, 0, instances, time.perf_counter() - starts[run_id]))
    return results
