"""The derived-write protocol as a state machine (hypothesis), as zarr-python tests its stores.

Rules: a fresh analyze, sequences appended to the run (an extract going on), a recompute
with other parameters (into staging), damage to a committed object (then a rerun heals it),
a writer that withdrew the commit and died, a writer at work in another process (its update
begun, the run held), and a kill at any chosen store write of any analyze; on an object
store (``memory://``, whose writers are fenced: each writes a generation of its own) also a
writer whose lease another writer took over while it slept, which wakes after that one
committed and writes on: it fails at its next record write, and every analyze that
finishes leaves only the generation its commit names. After every step
a reader, through the public reading API only, sees either no finished analysis or one whose
every group equals a fresh analysis of exactly the committed sequences with the committed
parameters: never a mix; and it is told an unfinished analysis is in progress while its
writer lives, interrupted once it is dead, never the other way round. A finished analyze
leaves exactly the run's committed sequences with its own parameters.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from attngeom.analyze.blocks import all_groups, sequence_groups, template_groups
from attngeom.analyze.parameters import analysis_parameters
from attngeom.analyze.runner import open_completed
from attngeom.api import analyze
from attngeom.errors import DamagedStoreError, GroupNotFoundError, IncompleteGroupError, InProgressError, StoreWriteError
from attngeom.store import (
    ANALYSIS,
    RunLayout,
    consolidate,
    create_run,
    open_or_create_root,
    open_root,
    open_run_group,
    read_state,
    write_sequence,
    zarr_store,
)
from attngeom.store.derived_groups.record import is_generation
from attngeom.store.session import StoreSession
from attngeom.extract.synthetic import synthetic_sequence

CAPACITY = 5
LENGTH = 12
LAYOUT = RunLayout(n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=LENGTH, head_kv=(0, 0),
                   window=(0, 0), attendable=((True,) * LENGTH,) * 2)
# Two parameter sets: (n grid, seed).
PARAMS = {"a": ([1, 2, 4], 0), "b": ([1, 4, 8], 3)}


def read_group(url: str, run_id: str, kind: str, name: str):
    """The committed derived group, as every reader reads it (through a store session)."""
    return StoreSession.reading(url).reader(run_id).derived(kind, name)


class Killed(BaseException):
    """The writer dies here (raised from inside a store write)."""


def _make_run(url: str, n: int) -> None:
    root = open_or_create_root(url)
    run = create_run(root, "r", LAYOUT, {"model": {"id": "synthetic"}, "dataset": {"id": "synthetic"},
                                         "context_length": LENGTH}, CAPACITY)
    for s in range(n):
        _write(run, s)
    consolidate(root)


def _write(run, seq: int) -> None:
    write_sequence(run, seq, synthetic_sequence(np.random.default_rng(100 + seq), LAYOUT))


def _run_analyze(url: str, params: str) -> None:
    grid, seed = PARAMS[params]
    analyze(url, run_id="r", scheduler="threads", n_grid=grid, seed=seed, progress=False)


def _groups(url: str) -> dict[str, dict[str, np.ndarray]] | None:
    """Every committed group of the run's analysis, loaded; None when there is no finished one
    (an unfinished one raises what a reader meets: in progress, or incomplete)."""
    state = read_state(zarr_store(url, read_only=True), "r", ANALYSIS)
    if state.commit is None:
        if state.exists:
            read_group(url, "r", ANALYSIS, "heads")
        return None
    out = {}
    for name in state.commit.groups:
        ds = read_group(url, "r", ANALYSIS, name).load()
        out[name] = {str(k): np.asarray(v.values) for k, v in ds.variables.items()}
    return out


_REFERENCES: dict[tuple[int, str], dict] = {}


def _reference(n: int, params: str) -> dict[str, dict[str, np.ndarray]]:
    """The groups of a fresh analysis of the run's first ``n`` sequences with ``params``."""
    if (n, params) not in _REFERENCES:
        with tempfile.TemporaryDirectory() as tmp:
            url = str(Path(tmp) / "ref.zarr")
            _make_run(url, n)
            _run_analyze(url, params)
            _REFERENCES[n, params] = _groups(url)
            # Every group is under the protocol, the field's head scores too.
            assert {"sequence_scores", "head_scores"} <= _REFERENCES[n, params].keys()
    return _REFERENCES[n, params]


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for name in a:
        if a[name].keys() != b[name].keys():
            return False
        for var in a[name]:
            x, y = a[name][var], b[name][var]
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not (np.array_equal(x, y, equal_nan=x.dtype.kind == "f") if x.dtype.kind != "O"
                    else (x == y).all()):
                return False
    return True


# A writer at work in a process of its own: begins an analyze update of run r in the store
# argv[1] (n grid argv[2], seed argv[3], the first argv[4] sequences; argv[5] "1": its
# groups created too), says "held" and holds the run until its stdin closes, then dies
# without a word more.
_LIVE = """
import os, sys
from attngeom.analyze.blocks import all_groups, sequence_groups, template_groups
from attngeom.analyze.parameters import analysis_parameters
from attngeom.analyze.runner import open_completed
from attngeom.store.session import StoreSession
url, grid, seed, n = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
with StoreSession(url, mode="a") as session, session.derived("r", "analysis") as write:
    ds = open_completed(url, "r")
    plan = write.begin(analysis_parameters(grid, seed), range(n), all_groups(ds), sequence_groups(ds))
    if sys.argv[5] == "1" and not plan.up_to_date:
        write.create(template_groups(ds, grid, seed), 1)
    print("held", flush=True)
    sys.stdin.read()
    os._exit(9)
"""


class _Kill:
    """Raise :class:`Killed` at the ``at``-th store write of its ``family`` while active:
    "step" counts the protocol's steps (a write of the record, a group moved, a folder
    removed), "object" every other object put in place."""

    def __init__(self, family: str = "step", at: int | None = None) -> None:
        self.family, self.at = family, at
        self.count = {"step": 0, "object": 0}

    def __enter__(self) -> _Kill:
        self._replace, self._rmtree = os.replace, shutil.rmtree

        def step(family: str) -> None:
            self.count[family] += 1
            if family == self.family and self.count[family] == self.at:
                raise Killed

        def replace(src, dst, *args, **kwargs):
            record = str(dst).endswith(f"/{ANALYSIS}/zarr.json")
            step("step" if record or os.path.isdir(src) else "object")
            return self._replace(src, dst, *args, **kwargs)

        def rmtree(*args, **kwargs):
            step("step")
            return self._rmtree(*args, **kwargs)

        os.replace, shutil.rmtree = replace, rmtree
        return self

    def __exit__(self, *exc: object) -> None:
        os.replace, shutil.rmtree = self._replace, self._rmtree


def _generations(url: str) -> list[str]:
    """The generation folders of run r's analysis on a ``memory://`` store."""
    folder = f"{url.removeprefix('memory://')}/runs/r/{ANALYSIS}"
    fs = fsspec.filesystem("memory")
    return sorted(name for p in (fs.ls(folder, detail=False) if fs.exists(folder) else [])
                  if is_generation(name := p.rstrip("/").rsplit("/", 1)[-1]))


def _taken_over(session: StoreSession) -> None:
    """The run's lease of ``session`` as a sleeping machine's: its renewals stopped, expired
    for the next writer, and nothing told to its holder."""
    lease = session._leases["r"]
    lease._stop.set()
    lease._thread.join()
    lease.fs.pipe_file(lease.path, b'{"host": "asleep", "pid": 0, "expires": 0}')


class DerivedProtocol(RuleBasedStateMachine):
    """A run growing and being analyzed, killed and damaged; the model: which (sequences,
    parameters) commits a reader may find."""

    @initialize(n=st.integers(1, 3), local=st.booleans())
    def make(self, n: int, local: bool) -> None:
        self.local = local
        self.folder = tempfile.mkdtemp()
        self.url = str(Path(self.folder) / "s.zarr") if local else f"memory://derived-{Path(self.folder).name}/s.zarr"
        _make_run(self.url, n)
        self.n = n
        # The (sequence count, parameters) a reader may find committed; None: no finished analysis.
        self.possible: set[tuple[int, str] | None] = {None}
        self.damaged = False

    def teardown(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if not self.local:
            fsspec.filesystem("memory").rm(self.url.removeprefix("memory://").rsplit("/", 1)[0], recursive=True)

    @precondition(lambda self: self.n < CAPACITY)
    @rule(more=st.integers(1, 2))
    def extract_more(self, more: int) -> None:
        run = open_run_group(open_root(self.url, mode="a"), "r")
        for s in range(self.n, min(CAPACITY, self.n + more)):
            _write(run, s)
        self.n = min(CAPACITY, self.n + more)

    @rule(params=st.sampled_from(sorted(PARAMS)))
    def analyze(self, params: str) -> None:
        _run_analyze(self.url, params)
        self.possible = {(self.n, params)}
        self.damaged = False
        if not self.local:  # what earlier writers left that no record names is gone
            generation = read_state(zarr_store(self.url, read_only=True), "r", ANALYSIS).commit.generation
            assert _generations(self.url) == [generation]

    @precondition(lambda self: self.local)
    @rule(params=st.sampled_from(sorted(PARAMS)),
          kill=st.one_of(st.tuples(st.just("step"), st.integers(1, 28)), st.tuples(st.just("object"), st.integers(1, 340))))
    def killed_analyze(self, params: str, kill: tuple[str, int]) -> None:
        with _Kill(*kill) as killing:
            try:
                _run_analyze(self.url, params)
            except Killed:
                pass
            else:
                self.possible = {(self.n, params)}
                self.damaged = False
                return
        # Killed: the earlier commit, or the new one if the kill came after it.
        self.possible = self.possible | {None, (self.n, params)}
        assert killing.count[kill[0]] == kill[1]

    @precondition(lambda self: self.local)
    @rule(data=st.data())
    def damage(self, data) -> None:
        """Lose or truncate an object the commit lists (what any rerun heals)."""
        state = read_state(zarr_store(self.url, read_only=True), "r", ANALYSIS)
        if state.commit is None or not state.readable or not state.commit.objects:
            return
        victim = Path(self.url) / "runs" / "r" / ANALYSIS / data.draw(st.sampled_from(sorted(state.commit.objects)))
        if data.draw(st.booleans()):
            victim.unlink()
        else:
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        self.damaged = True

    @rule(params=st.sampled_from(sorted(PARAMS)), create=st.booleans())
    def begin_and_die(self, params: str, create: bool) -> None:
        """A writer that began an update (and created or grew its groups) and died."""
        grid, seed = PARAMS[params]
        with pytest.raises(Killed), StoreSession(self.url, mode="a") as session, \
                session.derived("r", ANALYSIS) as write:
            ds = open_completed(self.url, "r")
            plan = write.begin(analysis_parameters(grid, seed), range(self.n), all_groups(ds), sequence_groups(ds))
            if create and not plan.up_to_date:
                write.create(template_groups(ds, grid, seed), 1)
            raise Killed
        self.possible = self.possible | {None}

    @precondition(lambda self: self.local)
    @rule(params=st.sampled_from(sorted(PARAMS)), create=st.booleans())
    def live_writer(self, params: str, create: bool) -> None:
        """A writer at work in another process (its update begun, maybe its groups created),
        stopped there while a reader looks, then killed."""
        grid, seed = PARAMS[params]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
        holder = subprocess.Popen([sys.executable, "-c", _LIVE, self.url, ",".join(map(str, grid)), str(seed),
                                   str(self.n), "1" if create else "0"], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert holder.stdout.readline() == "held\n"
            self.live = True
            self.reader_sees_a_commit()
        finally:
            self.live = False
            holder.stdin.close()
            holder.wait()
        self.possible = self.possible | {None}

    @precondition(lambda self: not self.local)
    @rule(params=st.sampled_from(sorted(PARAMS)), other=st.sampled_from(sorted(PARAMS)), created=st.booleans())
    def stale_writer(self, params: str, other: str, created: bool) -> None:
        """A writer (``params``) that began an update (and created its groups, if
        ``created``), then slept past its lease; another analyze (``other``) takes the run
        over and commits; the first wakes and writes its first sequence on. Its record write
        fails (the fence: it never learns its lease ended), or, where the successor removed
        its generation (kept sequences copied there when it began), its first write finds
        its arrays gone and fails as well; what it wrote is named by no record."""
        grid, seed = PARAMS[params]
        try:
            with StoreSession(self.url, mode="a") as session, session.derived("r", ANALYSIS) as write:
                ds = open_completed(self.url, "r")
                plan = write.begin(analysis_parameters(grid, seed), range(self.n), all_groups(ds), sequence_groups(ds))
                if plan.up_to_date:  # nothing it would write
                    return
                if created:
                    write.create(template_groups(ds, grid, seed), 1)
                _taken_over(session)
                self.analyze(other)
                self.reader_sees_a_commit()
                if not created:
                    write.create(template_groups(ds, grid, seed), 1)
                start = len(plan.keep)
                write.append({"topn": template_groups(ds, grid, seed)["topn"].isel(seq=slice(start, start + 1)).load()})
        except StoreWriteError as exc:
            assert "lost its hold" in str(exc), exc
        else:
            raise AssertionError("a writer whose lease was taken over wrote its record")
        # The successor's, which the record names, and the stale writer's own, which none does,
        # unless the successor removed it as garbage (the kept groups copied before the takeover).
        committed = read_state(zarr_store(self.url, read_only=True), "r", ANALYSIS).commit.generation
        generations = _generations(self.url)
        assert committed in generations and len(generations) <= 2, generations

    @invariant()
    def reader_sees_a_commit(self) -> None:
        if not hasattr(self, "url"):
            return
        try:
            found = _groups(self.url)
        except InProgressError:
            assert getattr(self, "live", False), "a dead writer's analysis called in progress"
            return
        except IncompleteGroupError:
            assert not getattr(self, "live", False), "a live writer's analysis called interrupted"
            assert None in self.possible
            return
        except DamagedStoreError:
            assert self.damaged
            return
        except GroupNotFoundError:
            assert None in self.possible
            return
        if found is None:
            assert None in self.possible
            return
        matches = [p for p in self.possible if p is not None and _same(found, _reference(*p))]
        assert matches, f"the reader sees none of {self.possible}"
        self.possible = set(matches)


DerivedProtocol.TestCase.settings = settings(
    max_examples=8, stateful_step_count=6, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_derived_protocol = DerivedProtocol.TestCase
