"""Collaborators on one object store (moto's S3 server on loopback, behind a fault proxy
where the network matters): two extracts appending to one run at once, two creating one
store at once, an appender stopped past its lease while another commits, a run wedged by
appenders that did not take turns, and the network lost in extract and in analyze. Each
ends valid and equal, array for array, to an undisturbed write."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
import xarray as xr
from click.testing import CliRunner
from conftest import moto_s3
from s3faults import fault_proxy, through
from test_run_write import LAYOUT, PROVENANCE, _arrays

import attngeom as ag
from attngeom.cli import main
from attngeom.errors import DamagedStoreError
from attngeom.store import validate_store
from attngeom.store.integrity.repair import repair
from attngeom.store.session import StoreSession

# Seconds a lease lasts: long enough that a live writer's renewals land on a busy machine
# (with 2 s, one in some 30 appends lost its lease to a peer); the tests of a writer stopped
# or cut off give that writer a shorter one, or wait it out.
LEASE = "20"


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server's endpoint, the environment pointing s3fs at it, short leases."""
    with moto_s3(ATTNGEOM_LEASE_SECONDS=LEASE) as endpoint:
        yield endpoint


def new_url() -> str:
    return f"s3://attngeom/{uuid.uuid4().hex}.zarr"


def append(url: str, total: int, data=_arrays) -> list[int]:
    """Extract's write of run r's sequences ``range(total)`` (synthetic, ``data(seq)``); the
    sequences it wrote."""
    with StoreSession(url, mode="c") as session, session.run_write("r").begin(total) as begun:
        todo = list(begun.todo)
        if todo:
            begun.create(LAYOUT, PROVENANCE, in_flight=0)
        for seq in todo:
            begun.submit(seq, data(seq))
        begun.commit()
    return todo


def assert_holds(url: str, n_seq: int, data=_arrays) -> None:
    """The store is valid, run r's arrays hold ``n_seq`` sequences, all committed, each the
    arrays ``data(seq)`` wrote."""
    assert validate_store(url, deep=True) == []
    run = ag.open_store(url).run("r")
    assert run.sequences().tolist() == list(range(n_seq))
    ds = run.dataset()
    for seq in range(n_seq):
        for name, written in data(seq).items():
            if name in ds:
                assert np.array_equal(ds[name].sel(seq=seq).values, written), (seq, name)


def together(*calls) -> list[object]:
    """Run the calls at once, each in a thread; their results (or errors), in order."""
    out: list[object] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int, call) -> None:
        barrier.wait()
        try:
            out[i] = call()
        except Exception as exc:  # noqa: BLE001
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class AppendersMachine(RuleBasedStateMachine):
    """Extracts appending to one run of an S3 store, two at once (without turns, 2 of 4
    trials of 8 and 10 appended to 6 wedged the run), and runs wedged by hand and repaired.
    The model: the sequences the run holds. After every step the store is valid and holds
    exactly them, each sequence written once, each equal to what was written for it."""

    @initialize()
    def make(self) -> None:
        self.url, self.held = new_url(), 0

    @rule(a=st.integers(1, 6), b=st.integers(1, 6))
    def two_appenders(self, a: int, b: int) -> None:
        written = together(lambda: append(self.url, a), lambda: append(self.url, b))
        assert not [w for w in written if isinstance(w, Exception)], written
        assert sorted(s for todo in written for s in todo) == list(range(self.held, max(a, b, self.held)))
        self.held = max(a, b, self.held)

    @precondition(lambda self: self.held > 1)
    @rule(names=st.sampled_from([("tokens", "entropy", "prev_attn", "recent_attn"), ("values", "attn_last", "complete")]),
          short=st.integers(1, 5))
    def wedged_and_repaired(self, names: tuple[str, ...], short: int) -> None:
        """Some arrays shorter, as two appenders without turns left them: readers name the
        remedy, repair gives the run its length back."""
        wedge(self.url, names, min(short, self.held - 1))
        with pytest.raises(DamagedStoreError, match="disagree in length.*--repair"):
            ag.open_store(self.url).run("r").dataset()
        done = repair(self.url)
        assert done.unrepairable == () and set(done.rebuilt) >= {f"runs/r/{name}/zarr.json" for name in names}

    @invariant()
    def holds_what_was_written(self) -> None:
        if self.held:
            assert_holds(self.url, self.held)


AppendersMachine.TestCase.settings = settings(
    max_examples=4, stateful_step_count=3, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.usefixtures("s3")
class TestAppenders(AppendersMachine.TestCase):
    pass


@pytest.mark.parametrize("trial", range(3))
@pytest.mark.parametrize("where", ["s3", "local"])
def test_two_creators_of_one_store(s3, tmp_path, where, trial):
    """Two extracts creating one store at once: one creates it, the other appends (on a
    local disk the second waits at the store's runs folder until the run's own exists)."""
    url = new_url() if where == "s3" else str(tmp_path / "s.zarr")
    written = together(lambda: append(url, 3), lambda: append(url, 5))
    assert not [w for w in written if isinstance(w, Exception)], written
    assert sorted(s for todo in written for s in todo) == list(range(5))
    assert_holds(url, 5)


def wedge(url: str, names: tuple[str, ...], n_seq: int) -> None:
    """Run r's arrays ``names`` set to ``n_seq`` sequences in their metadata, as two
    appenders growing it without turns left it; every object stays."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    for name in names:
        key = f"{url.removeprefix('s3://')}/runs/r/{name}/zarr.json"
        meta = json.loads(fs.cat_file(key))
        meta["shape"][0] = n_seq
        fs.pipe_file(key, json.dumps(meta).encode())


@pytest.mark.parametrize("short", [("tokens", "entropy", "prev_attn", "recent_attn"), ("values", "attn_last", "complete")])
def test_repair_heals_a_run_whose_arrays_disagree_in_length(s3, short):
    """The two stores the issue met: some arrays (the flags among them, or not) 4 sequences
    long, the others 6, every object there. Readers refuse it naming the remedy; repair
    gives it one length, equal to the undisturbed run."""
    url = new_url()
    append(url, 6)
    wedge(url, short, 4)
    problems = validate_store(url)
    assert any("disagree in length" in p and "--repair" in p for p in problems), problems
    with pytest.raises(DamagedStoreError, match="disagree in length.*--repair"):
        ag.open_store(url).run("r").dataset()
    done = repair(url)
    assert done.unrepairable == () and sorted(done.rebuilt)[:len(short)] == sorted(
        f"runs/r/{name}/zarr.json" for name in short)
    assert_holds(url, 6)


def test_repair_says_what_it_cannot_heal(s3):
    """Arrays that disagree beyond their length: one line, the lengths left as they are."""
    url = new_url()
    append(url, 4)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    key = f"{url.removeprefix('s3://')}/runs/r/tokens/zarr.json"
    meta = json.loads(fs.cat_file(key))
    meta["shape"] = [6, meta["shape"][1] + 1]
    fs.pipe_file(key, json.dumps(meta).encode())
    done = repair(url)
    assert len(done.unrepairable) == 1 and "tokens" in done.unrepairable[0], done.unrepairable
    assert json.loads(fs.cat_file(key))["shape"] == [6, meta["shape"][1]]


# An appender in a process of its own, through the proxy, writing sequences of its own data
# (argv[3]: the seed): stopped (the proxy holding its traffic) past its lease, then resumed.
_STALE = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[4])
from test_run_write import LAYOUT
from test_s3_collaborators import append
from attngeom.errors import AttngeomError
from attngeom.extract.synthetic import synthetic_sequence

url, total, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    append(url, total, lambda seq: synthetic_sequence(np.random.default_rng(seed + seq), LAYOUT))
except AttngeomError as exc:
    print(f"attngeom: error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def objects(url: str) -> dict[str, str]:
    """Key -> ETag of the store's objects, its leases left out."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    base = url.removeprefix("s3://")
    return {key: info["ETag"] for key, info in fs.find(base, detail=True).items() if "/leases/" not in key}


def test_an_appender_stopped_past_its_lease_never_changes_what_the_next_committed(s3):
    """A (its own data) stopped as it writes sequence 2's objects, past its lease; B takes the
    run over and commits 2..4; A resumed finds its hold gone and stops, every object B
    committed unchanged."""
    url = new_url()
    append(url, 2, lambda seq: stale_data(seq))
    with fault_proxy(s3) as proxy:
        proxy.hold_when(lambda line: line.startswith("PUT") and "/runs/r/values/c/2/" in line)
        env = {**os.environ, **proxy.env(), "ATTNGEOM_LEASE_SECONDS": "2", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                                             str(Path(__file__).parent)])}
        stale = subprocess.Popen([sys.executable, "-c", _STALE, url, "5", "1000", str(Path(__file__).parent)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proxy.held.wait(120), stale.communicate()
        # B waits out A's lease (or finds it already expired, on a slow machine) and takes it over.
        assert append(url, 5) == [2, 3, 4]
        committed = objects(url)
        proxy.release()
        _, err = stale.communicate(timeout=120)
    assert stale.returncode == 2 and "taken over by another writer" in err, err
    assert objects(url) == committed
    assert_holds(url, 5, lambda seq: stale_data(seq) if seq < 2 else _arrays(seq))


def stale_data(seq: int) -> dict[str, np.ndarray]:
    from attngeom.extract.synthetic import synthetic_sequence

    return synthetic_sequence(np.random.default_rng(1000 + seq), LAYOUT)


def cli(*args: str) -> tuple[int, list[str]]:
    """The CLI on ``args`` in this process: (exit code, output lines). Left out: aiohttp's
    notes, as the collector meets them, of the sessions of an s3fs dropped by an earlier
    command of this process (a command's process ends with it)."""
    result = CliRunner().invoke(main, list(args))
    lines = result.output.strip().splitlines()
    return result.exit_code, [line for line in lines if not line.startswith(("Unclosed client session",
                                                                              "client_session: <"))]


def extract_args(model: Path, corpus: Path, url: str, n_seq: int = 6) -> list[str]:
    return ["extract", "--model", str(model), "--dataset", str(corpus), "-L", "16", "-S", str(n_seq),
            "--store", url, "--run", "r", "--no-progress"]


def test_the_network_lost_in_extract_is_one_line_and_the_rerun_goes_on(s3, tiny_model_dir, word_corpus, tmp_path,
                                                                      monkeypatch):
    """The connection cut as sequence 3 commits: one line naming the store and the count
    committed, exit 2; the rerun says at once whom it waits for and until when, then ends
    equal, array for array, to an undisturbed extract."""
    # The rerun meets the cut-off writer's lease unexpired; botocore does not retry (s3fs still does).
    monkeypatch.setenv("ATTNGEOM_LEASE_SECONDS", "10")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    model = tiny_model_dir("llama")
    reference = str(tmp_path / "reference.zarr")
    code, lines = cli(*extract_args(model, word_corpus, reference))
    assert code == 0, lines
    url = new_url()
    with fault_proxy(s3) as proxy:
        proxy.cut_when(lambda line: line.startswith("PUT") and line.endswith("/runs/r/complete/c/3"))
        with through(proxy, monkeypatch):
            code, lines = cli(*extract_args(model, word_corpus, url))
    assert proxy.cut.is_set()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"attngeom: error: the store {url} does not answer (the connection failed"), lines
    assert "3 of the 6 sequences to write were committed before and are kept" in lines[0], lines

    code, lines = cli(*extract_args(model, word_corpus, url))
    assert code == 0, lines
    assert lines[0].startswith("attngeom: waiting for the extract of run r held by ") and "lease ends at" in lines[0]
    assert validate_store(url, deep=True) == []
    xr.testing.assert_identical(ag.open_store(url).run("r").dataset().load(),
                                ag.open_store(reference).run("r").dataset().load())


def test_the_network_lost_in_analyze_is_one_line_and_the_rerun_goes_on(s3, ablated_store_source, tmp_path,
                                                                      monkeypatch):
    """The connection cut at analyze's first write into the analysis: one line, exit 2; the
    rerun waits for the lease the cut-off analyze could not remove, saying so at once, and
    ends equal to an undisturbed analyze."""
    from test_s3_writers import ANALYSIS_GROUPS

    # The rerun meets the cut-off writer's lease unexpired; botocore does not retry (s3fs still does).
    monkeypatch.setenv("ATTNGEOM_LEASE_SECONDS", "20")
    reference = tmp_path / "reference.zarr"
    shutil.copytree(ablated_store_source, reference)
    args = ["--scheduler", "threads", "--no-progress", "--n-grid", "1,4"]
    assert cli("analyze", "--store", str(reference), *args)[0] == 0
    url = new_url()
    fsspec.filesystem("s3", skip_instance_cache=True).put(f"{ablated_store_source}/", url.removeprefix("s3://"),
                                                          recursive=True)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with fault_proxy(s3) as proxy:
        proxy.cut_when(lambda line: line.startswith("PUT") and "/runs/r/analysis/" in line)
        with through(proxy, monkeypatch):
            code, lines = cli("analyze", "--store", url, *args)
    assert proxy.cut.is_set()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"attngeom: error: the store {url} does not answer ("), lines

    code, lines = cli("analyze", "--store", url, *args)
    assert code == 0, lines
    assert lines[0].startswith("attngeom: waiting for the analyze of run r held by ") and "lease ends at" in lines[0]
    assert validate_store(url, deep=True) == []
    got, want = ag.open_store(url).run("r"), ag.open_store(str(reference)).run("r")
    for name in ANALYSIS_GROUPS:
        xr.testing.assert_identical(got.analysis(name).load(), want.analysis(name).load())


COMMANDS = {
    "validate": [], "validate --deep --repair": [], "analyze": ["--no-progress"], "report": ["--out", "{tmp}/report"],
    "explore": ["--out", "{tmp}/page", "--no-progress"], "migrate": [], "ablate": ["--run", "r"],
    "detect": ["--run", "r"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_store_that_does_not_answer_is_one_line_for_every_command(s3, command, tmp_path, monkeypatch):
    """Every command meeting a store whose connection is cut at its first request: one line
    naming the store, exit 2."""
    url = new_url()
    append(url, 2)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    name, *flags = command.split()
    with fault_proxy(s3) as proxy:
        proxy.cut_when(lambda line: True)
        with through(proxy, monkeypatch):
            code, lines = cli(name, "--store", url, *flags,
                              *(arg.format(tmp=tmp_path) for arg in COMMANDS[command]))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("attngeom: error: ") and url in lines[0], lines
