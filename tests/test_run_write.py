"""Extract's write of a run (:class:`~attngeom.store.extracted.run_write.RunWrite`, from
``StoreSession(url, mode="c").run_write``) as a state machine (hypothesis), as zarr-python
tests its stores.

Rules: an extract of the first ``total`` sequences that commits; one that fails after
``k`` of them (an error in the caller, or a full disk); one killed (its process gone, no
clean-up) after ``k``, before the run's creation, or with a sequence's objects written and
not committed; and the verbs called in a wrong order, refused. The model: which sequences a
reader may see committed (each with the arrays written for it), and whether the store
exists. After every step a reader, through the public reading API, sees exactly the
committed sequences, each equal to what was written; an uncommitted sequence is never
visible; a failed write of a new store leaves no store; a rerun writes only the sequences
not committed (resume continues) and a committed write validates.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import attngeom as ag
from attngeom.errors import AttngeomError, StoreWriteError
from attngeom.store import RunLayout, SequenceWriter, validate_store
from attngeom.store.session import StoreSession
from attngeom.extract.synthetic import synthetic_sequence

CAPACITY = 6
LENGTH = 8
LAYOUT = RunLayout(n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=LENGTH, head_kv=(0, 0),
                   window=(0, 0), attendable=((True,) * LENGTH,) * 2)
PROVENANCE = {"model": {"id": "synthetic"}, "dataset": {"id": "synthetic"}, "context_length": LENGTH,
              "library_versions": {}, "command_line": "test"}


class Failed(Exception):
    """The caller fails in the middle of a write (the model, the input)."""


def _arrays(seq: int) -> dict[str, np.ndarray]:
    return synthetic_sequence(np.random.default_rng(100 + seq), LAYOUT)


def _write(url: str, total: int, k: int | None) -> list[int]:
    """Write the first ``k`` of the sequences ``range(total)`` still to write (all of them
    and commit for ``k`` None; else fail after ``k``); returns what was to write."""
    with StoreSession(url, mode="c") as session, session.run_write("r").begin(total) as begun:
        todo = list(begun.todo)
        if todo:
            begun.create(LAYOUT, PROVENANCE, in_flight=0)
        for seq in todo[:k]:
            begun.submit(seq, _arrays(seq))
        if k is not None:
            raise Failed
        begun.commit()
    return todo


# A writer in a process of its own, killed (os._exit: no clean-up at all) at argv[3]: "begun"
# (the store opened, before the run's creation), "created" (the run created, nothing written)
# or a number k: after k sequences committed, the objects of the next written, its flag not.
_KILLED = """
import os, sys
import numpy as np
import attngeom.store.extracted.runs as runs
from attngeom.store.session import StoreSession
from attngeom.extract.synthetic import synthetic_sequence
sys.path.insert(0, sys.argv[4])
from test_run_write import LAYOUT, PROVENANCE, _arrays

url, total, at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
put, count = runs.put_objects, [0]

def put_then_die(*args):
    put(*args)
    count[0] += 1
    if at.isdigit() and count[0] == int(at) + 1:
        os._exit(9)

runs.put_objects = put_then_die
with StoreSession(url, mode="c") as session, session.run_write("r").begin(total) as begun:
    print(",".join(map(str, begun.todo)), flush=True)
    if at == "begun":
        os._exit(9)
    begun.create(LAYOUT, PROVENANCE, in_flight=0)
    if at == "created":
        os._exit(9)
    for seq in begun.todo:
        begun.submit(seq, _arrays(seq))
    os._exit(9)
"""


class RunWriteMachine(RuleBasedStateMachine):
    """A run written, failed, killed and resumed; the model: the committed sequences a
    reader may see, and whether the store exists."""

    @initialize()
    def make(self) -> None:
        self.folder = tempfile.mkdtemp()
        self.url = str(Path(self.folder) / "s.zarr")
        self.committed: set[int] = set()
        self.exists = False
        self.created = False  # the run's creation finished
        self.capacity = 0  # sequences the run's arrays are sized for

    def teardown(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _todo(self, total: int) -> list[int]:
        return [s for s in range(total) if s not in self.committed]

    @rule(total=st.integers(1, CAPACITY))
    def extract(self, total: int) -> None:
        todo = _write(self.url, total, None)
        assert todo == self._todo(total), "a rerun writes exactly the sequences not committed"
        self._grown(total, todo)
        self.committed |= set(todo)
        self.exists = True
        # What validate may still say of a run sized for more than is committed: its
        # sequences not written yet, or only partly (by a killed writer).
        problems = validate_store(self.url)
        assert not [p for p in problems if not re.search("not written yet|only partly written", p)], problems
        assert not problems or not set(range(self.capacity)) <= self.committed, problems

    @rule(total=st.integers(1, CAPACITY), k=st.integers(0, 2))
    def failed(self, total: int, k: int) -> None:
        todo = self._todo(total)
        with pytest.raises(Failed):
            _write(self.url, total, k)
        self._after_failure(total, todo, k)

    @rule(total=st.integers(1, CAPACITY), k=st.integers(0, 2))
    def full_disk(self, total: int, k: int) -> None:
        todo = self._todo(total)
        write, budget = SequenceWriter.write, [k]

        def full(writer, seq, arrays):
            if not budget[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            budget[0] -= 1
            write(writer, seq, arrays)

        SequenceWriter.write = full
        try:
            if k >= len(todo):  # room enough
                _write(self.url, total, None)
                self.exists = True
                self._grown(total, todo)
                self.committed |= set(todo)
                return
            with pytest.raises(StoreWriteError) as raised:
                _write(self.url, total, None)
        finally:
            SequenceWriter.write = write
        assert f"ran out of space after {k} of {len(todo)} sequences were committed" in str(raised.value)
        self._after_failure(total, todo, k)

    def _after_failure(self, total: int, todo: list[int], k: int) -> None:
        self.committed |= set(todo[:k])
        if not self.exists and not self.committed:
            return  # the store the write created is gone again: it held no committed sequence
        self.exists = True
        self._grown(total, todo)

    def _grown(self, total: int, todo: list[int]) -> None:
        """The run created or grown for ``total`` sequences when there was something to write."""
        if todo:
            self.created, self.capacity = True, max(self.capacity, total)

    @rule(total=st.integers(1, CAPACITY),
          at=st.one_of(st.sampled_from(["begun", "created"]), st.integers(0, 2).map(str)))
    def killed(self, total: int, at: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
        done = subprocess.run([sys.executable, "-c", _KILLED, self.url, str(total), at, str(Path(__file__).parent)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 9, done.stderr
        todo = [int(s) for s in done.stdout.split(",") if s.strip()]
        assert todo == self._todo(total)
        self.exists = True  # a killed writer cleans nothing up
        if at != "begun":
            self._grown(total, todo)
        if at.isdigit():
            self.committed |= set(todo[: int(at)])

    @rule()
    def wrong_order(self) -> None:
        with StoreSession(self.url, mode="c") as session, session.run_write("r").begin(1) as begun:
            if begun.todo:
                with pytest.raises(RuntimeError, match="create the run before"):
                    begun.submit(0, _arrays(0))
            begun.commit()
            for verb in (begun.commit, lambda: begun.create(LAYOUT, PROVENANCE),
                         lambda: begun.submit(0, _arrays(0))):
                with pytest.raises(RuntimeError, match="is committed"):
                    verb()
        with pytest.raises(RuntimeError, match="cannot begin: the write of run r is committed"):
            begun.__enter__()
        self.exists = True  # a write that commits nothing leaves the store it opened

    @invariant()
    def reader_sees_the_committed_sequences(self) -> None:
        if not hasattr(self, "url"):
            return
        assert Path(self.url).exists() == self.exists
        if not Path(self.url).exists():
            return
        store = ag.open_store(self.url)
        if not self.created:
            try:
                seen = store.run("r").sequences().tolist() if "r" in store.runs else []
            except AttngeomError:  # an interrupted creation: validate names it
                seen = []
            assert seen == []
            return
        run = store.run("r")
        assert run.sequences().tolist() == sorted(self.committed)
        ds = run.dataset()
        for seq in sorted(self.committed):
            written = _arrays(seq)
            for name in ("tokens", "attn_last", "values"):
                assert np.array_equal(ds[name].sel(seq=seq).values, written[name]), (seq, name)


RunWriteMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=6, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_run_write = RunWriteMachine.TestCase


def test_a_failed_first_write_of_a_new_store_leaves_nothing(tmp_path):
    url = str(tmp_path / "s.zarr")
    with pytest.raises(Failed):
        _write(url, 3, 0)
    assert not Path(url).exists()
    with pytest.raises(Failed):
        _write(url, 3, 1)
    assert ag.open_store(url).run("r").sequences().tolist() == [0]
