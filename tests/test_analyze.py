"""analyze over stores made by extract: values equal the brute force, idempotent, cluster by
address; incremental equals full; SIGKILL at any store write, then a rerun, equals an
uninterrupted analyze, and no reader takes the half state for a finished analysis."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from click.testing import CliRunner
from conftest import extract
from stores import Run, copy_store
from test_analyze_kernels import brute_topn, brute_value_statistics

from attngeom.analyze import runner
from attngeom.analyze.blocks import template_groups
from attngeom.analyze.parameters import instance_seed
from attngeom.analyze.reductions import _sorted_median, _sorted_quantiles
from attngeom.analyze.scheduling import _worker_processes
from attngeom.api import analyze
from attngeom.analyze.taxonomy_tables import run_regimes
from attngeom.cli import main
from attngeom.errors import IncompleteGroupError
from attngeom.store.objects import storage
from attngeom.store.session import StoreSession
from attngeom.extract.request import ExtractRequest
from attngeom.report.data import load_runs
from attngeom.store import (
    SEQUENCE_ARRAYS,
    ABLATION,
    ANALYSIS,
    ANALYSIS_GROUPS,
    TOPN_VARIABLES,
    VALUE_STATISTICS,
    consolidate,
    open_dataset,
    open_or_create_root,
    open_root,
    read_state,
    replace_groups,
    resize_run,
    validate_store,
    zarr_store,
)

GRID = [1, 2, 4, 8, 15]


def read_group(url: str, run_id: str, kind: str, name: str):
    """The committed derived group, as every reader reads it (through a store session)."""
    return StoreSession.reading(url).reader(run_id).derived(kind, name)


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as c:
        yield c


@pytest.fixture(scope="module")
def analyzed(extracted_store, tmp_path_factory, cluster):
    """Two runs (Llama with GQA; Gemma 3 with a 6-key sliding window at L=16), analyzed."""
    store = copy_store(extracted_store(Run("llama", 3, "llama"), Run("gemma3", 3, "gemma3")),
                       tmp_path_factory.mktemp("an"))
    out = tmp_path_factory.mktemp("tables")
    analyze(str(store), scheduler=cluster.scheduler_address, n_grid=GRID, out=out, progress=False)
    return store, out


def group(store, run, name) -> xr.Dataset:
    return open_dataset(StoreSession.reading(str(store)).zstore, str(store), f"runs/{run}/analysis/{name}")


@pytest.mark.parametrize("run", ["llama", "gemma3"])
def test_topn_equals_brute_force_value_by_value(analyzed, run):
    store, _ = analyzed
    ds = xr.open_zarr(str(store), group=f"runs/{run}", consolidated=False)
    topn = group(store, run, "topn").load()
    values = group(store, run, "values").load()
    assert topn["precision"].dims == ("seq", "layer", "head", "n")
    assert list(topn["n"].values) == GRID
    head_kv = ds["head_kv"].values
    for s in range(ds.sizes["seq"]):
        for layer in range(ds.sizes["layer"]):
            attn = ds["attn_last"].values[s, layer].astype(np.float64)
            vals = ds["values"].values[s, layer][head_kv].astype(np.float64)
            att = np.broadcast_to(ds["attendable"].values[layer], attn.shape)
            want = brute_topn(attn, vals, att, GRID, seed=instance_seed(0, s, layer))
            got = topn.isel(seq=s, layer=layer)
            for name in TOPN_VARIABLES:
                np.testing.assert_allclose(got[name].values, want[name], rtol=1e-9, atol=1e-12, err_msg=name)
            stats = brute_value_statistics(vals, att)
            for name in VALUE_STATISTICS:
                np.testing.assert_allclose(values[name].values[s, layer], stats[name], rtol=1e-9, err_msg=name)
    assert (topn["inversions"] <= topn["k_sink_exact"]).all()
    if run == "gemma3":  # sliding layers: the final query cannot see the sink at L=16
        assert np.isnan(values["sink_norm_ratio"].sel(layer=0)).all()
        assert not np.isnan(values["sink_norm_ratio"].sel(layer=1)).any()


def test_heads_summary_and_tables(analyzed, tmp_path):
    store, out = analyzed
    heads = group(store, "llama", "heads")
    assert dict(heads.sizes) == {"layer": 3, "head": 4}
    assert {"C", "C_cv", "sink_norm_ratio", "mu_q95", "mu_q95_cv", "nu_plus_q95_cv"} <= set(heads.data_vars)
    summary = group(store, "llama", "summary")
    assert list(summary["stat"].values) == ["mean", "median", "q05", "q95", "count"]
    assert float(summary["certificate_violation"].sel(stat="mean").max()) == 0
    assert int(summary["precision"].sel(stat="count", n=1).min()) == 3
    table = pd.read_parquet(out / "llama.topn.parquet")
    assert list(table.columns[:8]) == ["run", "model", "dataset", "context_length", "layer", "head", "n", "variable"]
    assert len(table) == 3 * 4 * len(GRID) * len(summary.data_vars)
    assert (out / "gemma3.topn.csv").exists()
    stored = group(store, "llama", "table").to_dataframe()
    assert len(stored) == len(table)
    # An analysis already up to date writes the same files from its stored table.
    again = tmp_path / "again"
    analyze(str(store), run_id="llama", scheduler="threads", n_grid=GRID, out=again, progress=False)
    pd.testing.assert_frame_equal(pd.read_parquet(again / "llama.topn.parquet"), table)
    assert (again / "llama.topn.csv").read_bytes() == (out / "llama.topn.csv").read_bytes()


def test_rerun_is_idempotent_and_reads_only_completed(analyzed, cluster, tmp_path):
    store, _ = analyzed
    before = group(store, "llama", "topn").load()
    run = zarr.open_group(str(store), path="runs/llama", mode="r+", use_consolidated=False)
    resize_run(run, 5)
    run["tokens"][3] = run["tokens"][0]  # sequence 3 is being written: no commit flag yet
    analyze(str(store), run_id="llama", scheduler=cluster.scheduler_address, n_grid=GRID, progress=False)
    after = group(store, "llama", "topn").load()
    assert list(after["seq"].values) == [0, 1, 2]
    xr.testing.assert_identical(before, after)


def test_cli_local_cluster_of_processes(analyzed, tmp_path):
    store, _ = analyzed
    result = CliRunner().invoke(main, ["analyze", "--store", str(store), "--run", "gemma3", "--n-grid", "1,4",
                                       "--scheduler", "processes", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "run gemma3: 3 new sequences (3 analyzed), 36 head instances" in result.output
    assert "recomputed every sequence: n grid 1,2,4,8,15 -> 1,4" in result.output
    assert list(group(store, "gemma3", "topn")["n"].values) == [1, 4]
    bad = CliRunner().invoke(main, ["analyze", "--store", str(store), "--run", "nope"])
    assert bad.exit_code == 2 and "no run 'nope'" in bad.stderr


def test_multiprocess_cluster_matches_threads(extracted_store, analyzed_store, tmp_path):
    """The same run analyzed by threads and, in a copy of the store never analyzed, by a
    cluster of two worker processes: equal results, and the cluster did the computing."""
    from distributed import Client, LocalCluster, get_task_stream

    run = Run("mistral", sequences=3)
    by_cluster = copy_store(extracted_store(run), tmp_path)
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
          Client(cluster) as client, get_task_stream(client) as stream):
        analyze(str(by_cluster), scheduler=cluster.scheduler_address, n_grid=[1, 2, 8], progress=False)
    assert stream.data, "the cluster computed nothing"
    by_threads = str(analyzed_store(run, n_grid=(1, 2, 8)))
    for g in ("topn", "values", "heads", "summary"):
        xr.testing.assert_identical(read_group(str(by_cluster), "r", ANALYSIS, g).load(),
                                    read_group(by_threads, "r", ANALYSIS, g).load())


# ------------------------------------------------------------------ incremental and safe to kill


def extract_llama(model, corpus, store, n: int) -> None:
    extract(ExtractRequest(model=str(model), dataset=str(corpus), context_length=16, num_sequences=n,
                           store=str(store), run_id="r", progress=False))


def analysis(store) -> dict[str, xr.Dataset]:
    """Every group of run r's finished analysis, in memory."""
    return {name: read_group(str(store), "r", ANALYSIS, name).load() for name in ANALYSIS_GROUPS}


def assert_bitwise(a: dict[str, xr.Dataset], b: dict[str, xr.Dataset]) -> None:
    """Same groups, variables, coordinates, attributes, and the same bytes in every array."""
    assert a.keys() == b.keys()
    for name in a:
        xr.testing.assert_identical(a[name], b[name])
        for var in a[name].variables:
            x, y = a[name][var].values, b[name][var].values
            if x.dtype.kind in "biuf":
                assert x.tobytes() == y.tobytes(), f"{name}/{var}"


@pytest.fixture(scope="module")
def llama_stores(tiny_model_dir, word_corpus, extracted_store, tmp_path_factory):
    """Run r of the tiny Llama (L = 16): 3 sequences, and the same run extracted to 5."""
    model = tiny_model_dir("llama")
    three = extracted_store(Run(sequences=3))
    five = copy_store(three, tmp_path_factory.mktemp("inc"), "five.zarr")
    extract_llama(model, word_corpus, five, 5)
    return three, five, model


@pytest.fixture(scope="module")
def reference(llama_stores, analyzed_store, tmp_path_factory):
    """Uninterrupted analyses: 5 sequences with GRID and with [1, 4]; 3 sequences with GRID."""
    _, five, _ = llama_stores
    out = {"three": analysis(analyzed_store(Run(sequences=3), n_grid=tuple(GRID)))}
    for key, grid in (("five", GRID), ("five_14", [1, 4])):
        store = copy_store(five, tmp_path_factory.mktemp("ref"))
        analyze(str(store), scheduler="threads", n_grid=grid, progress=False)
        out[key] = analysis(store)
    return out


def test_incremental_equals_full(llama_stores, reference, word_corpus, tmp_path):
    three, _, model = llama_stores
    store = tmp_path / "s.zarr"
    shutil.copytree(three, store)
    (first,) = analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    assert (first.sequences, first.new_sequences, first.recomputed) == (3, 3, None)
    extract_llama(model, word_corpus, store, 5)
    (second,) = analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    assert (second.sequences, second.new_sequences, second.recomputed) == (5, 2, None)
    assert_bitwise(analysis(store), reference["five"])
    (third,) = analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    assert (third.sequences, third.new_sequences) == (5, 0)
    assert_bitwise(analysis(store), reference["five"])
    assert validate_store(str(store)) == []


def test_parameter_change_recomputes_and_says_why(llama_stores, reference, tmp_path):
    _, five, _ = llama_stores
    store = tmp_path / "s.zarr"
    shutil.copytree(five, store)
    analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    result = CliRunner().invoke(main, ["analyze", "--store", str(store), "--scheduler", "threads",
                                       "--n-grid", "4,1", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "run r: 5 new sequences (5 analyzed)" in result.output
    assert "recomputed every sequence: n grid 1,2,4,8,15 -> 1,4" in result.output
    assert_bitwise(analysis(store), reference["five_14"])
    seed = CliRunner().invoke(main, ["analyze", "--store", str(store), "--scheduler", "threads",
                                     "--n-grid", "1,4", "--seed", "3", "--no-progress"])
    assert "recomputed every sequence: seed 0 -> 3" in seed.output
    bad = CliRunner().invoke(main, ["analyze", "--store", str(store), "--n-grid", "1,16"])
    assert bad.exit_code == 2 and "1 <= N < L = 16" in bad.stderr
    assert read_state(zarr_store(str(store), read_only=True), "r", ANALYSIS).commit.parameters["seed"] == 3  # untouched


def test_groups_of_a_run_larger_than_a_dask_chunk_are_created(tmp_path):
    """The per-sequence groups of 1,000 sequences of a 7B-sized run (32 layers, 32 heads: 1 GB
    of topn, never computed) are created chunked a batch of 4 sequences at a time."""
    n_seq, layers, heads = 1000, 32, 32
    ds = xr.Dataset(coords={"seq": np.arange(n_seq), "layer": np.arange(layers), "head": np.arange(heads)})
    store = str(tmp_path / "s.zarr")
    open_or_create_root(store).require_group("runs/r")
    with StoreSession(store, mode="a") as session, session.derived("r", ANALYSIS) as write:
        plan = write.begin({}, range(n_seq), ("topn", "values", "taxonomy"), ("topn", "values", "taxonomy"))
        assert plan.keep == () and not plan.up_to_date
        write.create(template_groups(ds, [1, 2, 4], seed=0), 4)
    recall = zarr.open_group(store, path="runs/r/analysis/topn", mode="r")["recall"]
    assert recall.shape == (n_seq, layers, heads, 3) and recall.chunks == (4, layers, heads, 3)
    votes = zarr.open_group(store, path="runs/r/analysis/taxonomy", mode="r")["votes"]
    assert votes.shape == (n_seq, layers, heads, 3) and votes.chunks == (4, layers, heads, 3)


def nan_quantiles(x: np.ndarray, qs) -> np.ndarray:
    """Quantiles along axis 0 ignoring NaN, from the summary's sort-once interpolation."""
    return _sorted_quantiles(np.sort(x, axis=0), np.sum(~np.isnan(x), axis=0), qs)


def nan_median(x: np.ndarray) -> np.ndarray:
    """Median along axis 0 ignoring NaN, from the summary's sort-once median."""
    return _sorted_median(np.sort(x, axis=0), np.sum(~np.isnan(x), axis=0))


def test_vectorized_quantiles_equal_numpy():
    rng = np.random.default_rng(0)
    for n_seq in (1, 2, 5, 64):
        x = rng.normal(size=(n_seq, 3, 4, 6))
        x[rng.random(x.shape) < 0.3] = np.nan
        x[:, 0, 0] = np.nan  # a column without a number
        x[:, 1, 1, :2] = 1.5  # ties
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
            want_q = np.nanquantile(x, [0.05, 0.5, 0.95], axis=0)
            want_m = np.nanmedian(x, axis=0)
        np.testing.assert_array_equal(nan_quantiles(x, [0.05, 0.5, 0.95]), want_q)
        np.testing.assert_array_equal(nan_median(x), want_m)


KILLER = textwrap.dedent("""
    import glob, json, os, signal, sys
    import zarr
    from attngeom.analyze import runner
    from attngeom.cli import main
    from attngeom.store.objects import storage

    # One (sequence, layer) task per batch of the tiny model: many batches, many records.
    runner.BATCH_TASKS = 3
    limit, count = int(os.environ.get("KILL_AT_WRITE", 0)), 0
    set_, put_local = zarr.storage.LocalStore.set, storage._put_local

    def write():
        global count
        count += 1
        if count == limit:
            with open("children", "w") as f:  # the worker processes, if any
                f.write(" ".join(open(t).read() for t in glob.glob(f"/proc/{os.getpid()}/task/*/children")))
            os.kill(os.getpid(), signal.SIGKILL)

    async def killing(self, key, value):
        write()
        await set_(self, key, value)

    def killing_local(path, value, folders):  # an object attngeom writes to a local folder itself
        write()
        put_local(path, value, folders)

    zarr.storage.LocalStore.set = killing
    storage._put_local = killing_local

    def run(argv):
        try:
            main(argv, standalone_mode=False)
        finally:
            print("writes", count)

    if sys.argv[1] != "--serve":
        run(sys.argv[1:])
    else:
        # One command a line of stdin, each run in a child forked from this process, which has
        # imported the package and loaded the kernels once for them all; its exit status is
        # answered on stdout, its output is left in the files the line names.
        from attngeom.analyze.kernels import compile_kernels

        compile_kernels(progress=False)
        for line in sys.stdin:
            argv, limit, out, err = json.loads(line)
            pid = os.fork()
            if pid == 0:
                for fd, name in ((1, out), (2, err)):
                    os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                sys.exit(run(argv))
            print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
""")


def run_killed(tmp_path: Path, store: Path, grid: list[int], kill_at: int,
               scheduler: tuple[str, ...] = ("--scheduler", "threads")) -> subprocess.CompletedProcess:
    """``attngeom analyze`` in a subprocess (in ``tmp_path``), SIGKILLed as it is about to
    make its ``kill_at``-th store write (0: never); it leaves its children's pids in the
    file ``children``."""
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    cmd = [sys.executable, str(script), "analyze", "--store", str(store), *scheduler,
           "--n-grid", ",".join(map(str, grid)), "--no-progress"]
    env = {**os.environ, "KILL_AT_WRITE": str(kill_at)}
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)


class KillServer:
    """``run_killed`` for many runs in one process: each ``attngeom analyze`` forked from a
    server that imported the package and loaded the kernels once, and SIGKILLed as
    ``run_killed``'s is."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        script = tmp_path / "killer.py"
        script.write_text(KILLER)
        self.server = subprocess.Popen([sys.executable, str(script), "--serve"], cwd=tmp_path, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def __call__(self, store: Path, grid: list[int], kill_at: int) -> subprocess.CompletedProcess:
        argv = ["analyze", "--store", str(store), "--scheduler", "threads", "--n-grid", ",".join(map(str, grid)),
                "--no-progress"]
        out, err = self.tmp_path / "run.out", self.tmp_path / "run.err"
        self.server.stdin.write(json.dumps([argv, kill_at, str(out), str(err)]) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], 300)
        assert ready, f"analyze killed at write {kill_at} did not end in 300 s"
        returncode = int(self.server.stdout.readline())
        return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        assert self.server.wait(timeout=60) == 0


def readers_refuse_or_see(store: Path, earlier: dict[str, xr.Dataset], out: Path) -> bool:
    """After a kill: either every reader refuses the analysis as incomplete, or it is the
    earlier finished one, unchanged. True when it was readable."""
    url = str(store)
    if read_state(zarr_store(url, read_only=True), "r", ANALYSIS).readable:
        assert_bitwise(analysis(store), earlier)
        # Objects are written concurrently: the kill may cut others short, whose leftovers
        # validate names as harmless (the rerun removes them; checked after it).
        # So may the consolidated metadata lag behind the analysis (the rerun refreshes it).
        problems = [p for p in validate_store(url) if "is the leftover of an interrupted write (harmless" not in p
                    and not p.startswith("the root's consolidated metadata (read by xr.open_zarr) is out of date")]
        assert problems == []
        return True
    with pytest.raises(IncompleteGroupError, match="analysis of run r is incomplete"):
        read_group(url, "r", ANALYSIS, "topn")
    with pytest.raises(IncompleteGroupError):
        run_regimes(StoreSession.reading(url))
    with pytest.raises(IncompleteGroupError):
        load_runs(url)
    assert any("analysis of run r is incomplete (interrupted analyze); re-run `attngeom analyze" in p
               for p in validate_store(url))
    taxonomy = CliRunner().invoke(main, ["taxonomy", "--store", url])
    assert taxonomy.exit_code == 2 and "incomplete" in taxonomy.stderr
    return False


@pytest.mark.parametrize("grid", [GRID, [1, 4]], ids=["extend", "new-grid"])
def test_sigkill_then_rerun_equals_uninterrupted(llama_stores, reference, tmp_path, grid):
    """Three sequences analyzed with GRID, extract to five, then ``analyze --n-grid grid``
    killed at store writes spread over it (and once killed again while resuming). Extending
    keeps the earlier analysis readable until the groups across sequences move into place,
    but while its groups grow (readers are refused, not shown arrays of two lengths); a new
    grid keeps it readable until the new one is complete."""
    three, five, _ = llama_stores
    pristine = tmp_path / "pristine.zarr"
    shutil.copytree(three, pristine)
    analyze(str(pristine), scheduler="threads", n_grid=GRID, progress=False)
    for name in (name for name in (*SEQUENCE_ARRAYS, "complete") if (five / "runs" / "r" / name).exists()):
        shutil.rmtree(pristine / "runs" / "r" / name)
        shutil.copytree(five / "runs" / "r" / name, pristine / "runs" / "r" / name)
    consolidate(open_root(str(pristine), mode="a"))  # as extract leaves it
    store = tmp_path / "s.zarr"
    shutil.copytree(pristine, store)
    run_killed = KillServer(tmp_path)
    full = run_killed(store, grid, 0)
    assert full.returncode == 0, full.stderr
    total = int(full.stdout.split("writes")[-1])
    want = reference["five" if grid == GRID else "five_14"]
    assert_bitwise(analysis(store), want)
    readable = []
    # The last writes: the record "promoting" (groups being moved into place), the commit,
    # the consolidated metadata.
    points = [1, total // 5, total // 2, 4 * total // 5, total - 2, total - 1]
    if grid == GRID:
        # The third write grows the kept groups in place (the second withdrew the commit).
        points.insert(1, 3)
    for kill_at in points:
        shutil.rmtree(store)
        shutil.copytree(pristine, store)
        killed = run_killed(store, grid, kill_at)
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr)
        readable.append(readers_refuse_or_see(store, reference["three"], tmp_path / "report"))
        if kill_at == total // 2:  # killed again while resuming
            again = run_killed(store, grid, 5)
            assert again.returncode == -signal.SIGKILL
            readers_refuse_or_see(store, reference["three"], tmp_path / "report")
        (result,) = analyze(str(store), scheduler="threads", n_grid=grid, progress=False)
        assert_bitwise(analysis(store), want)
        assert validate_store(str(store)) == [], kill_at
    # The earlier analysis stays readable through the computation; only while the kept
    # groups grow in place, and once finished groups are being moved into place, until the
    # commit, are readers refused.
    assert readable == [True] + [False] * (grid == GRID) + [True] * 4 + [False], readable
    run_killed.close()


def test_worker_processes_equal_threads_and_die_with_analyze(llama_stores, reference, tmp_path):
    """The default scheduler, forked worker processes, gives the threads' analysis bit for
    bit; an analyze SIGKILLed in the middle takes its workers with it."""
    three, _, _ = llama_stores
    store = tmp_path / "s.zarr"
    shutil.copytree(three, store)
    analyze(str(store), n_grid=GRID, progress=False)
    assert_bitwise(analysis(store), reference["three"])

    shutil.rmtree(store / "runs" / "r" / "analysis")
    full = run_killed(tmp_path, store, GRID, 0, scheduler=())
    assert full.returncode == 0, full.stderr
    shutil.rmtree(store / "runs" / "r" / "analysis")
    killed = run_killed(tmp_path, store, GRID, int(full.stdout.split("writes")[-1]) // 2, scheduler=())
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    workers = [int(pid) for pid in (tmp_path / "children").read_text().split()]
    assert len(workers) >= 2, "the analyze ran without worker processes"

    def alive(pid: int) -> bool:
        try:  # a zombie is dead, waiting for init to reap it
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, workers)), workers
    analyze(str(store), n_grid=GRID, progress=False)
    assert_bitwise(analysis(store), reference["three"])


def test_worker_processes_outlive_the_thread_of_the_first_task():
    """Workers die with the thread that forked them (so that a killed analyze takes them
    along); they fork with the pool, not at its first task, which the analyze hands them
    from a batch thread that ends before the pool does."""
    with _worker_processes(2) as pool:
        first = []
        thread = threading.Thread(target=lambda: first.append(pool.submit(os.getpid).result()))
        thread.start()
        thread.join()
        time.sleep(0.5)  # time for a parent-death signal to land
        pids = {pool.submit(os.getpid).result() for _ in range(8)}
    assert first[0] != os.getpid() and len(pids) >= 1 and os.getpid() not in pids


def test_batches_in_flight_and_worker_counts_change_nothing(llama_stores, reference, tmp_path, monkeypatch):
    """Batches of one sequence (three of them, two computing at once while one is written),
    and the default scheduler given one core and given two: the same analysis bit for bit."""
    three, _, _ = llama_stores
    store = tmp_path / "s.zarr"
    shutil.copytree(three, store)
    monkeypatch.setattr(runner, "BATCH_TASKS", 1)
    analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    assert_bitwise(analysis(store), reference["three"])
    monkeypatch.undo()
    cores = sorted(os.sched_getaffinity(0))
    for allowed in ([cores[0]], cores[:2]):
        shutil.rmtree(store / "runs" / "r" / "analysis")
        code = ("import os, sys; os.sched_setaffinity(0, {}); from attngeom.cli import main; "
                "main(sys.argv[1:])").format(set(allowed))
        done = subprocess.run([sys.executable, "-c", code, "analyze", "--store", str(store), "--n-grid",
                               ",".join(map(str, GRID)), "--no-progress"],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert_bitwise(analysis(store), reference["three"])


def test_interrupted_ablation_write_is_reported_and_earlier_kept(tmp_path, monkeypatch):
    """replace_groups (ablate's write): a crash while staging keeps the earlier ablation
    readable; one after the move into place, before the commit, is refused by readers and
    reported by validate. A crash is an exception out of the store's ``set``: nothing after
    it runs, as after SIGKILL."""
    import zarr

    from attngeom.extract.synthetic import write_synthetic_run

    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", n_seq=2, length=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4)
    first = {"single": xr.Dataset({"x": ("layer", np.arange(3.0))}), "table": xr.Dataset({"y": ("row", [1, 2])})}
    replace_groups(url, "r", ABLATION, first, {"seed": 0})
    second = {"single": xr.Dataset({"x": ("layer", np.arange(3.0) + 1)})}
    pristine = tmp_path / "pristine.zarr"
    shutil.copytree(tmp_path / "s.zarr", pristine)

    class Crash(Exception):
        pass

    set_, put_local = zarr.storage.LocalStore.set, storage._put_local
    keys: list[str] = []
    crash_at = None

    def write(key: str) -> None:
        keys.append(key)
        if len(keys) == crash_at:
            raise Crash(key)

    async def crashing(self, key, value):
        write(key)
        await set_(self, key, value)

    def crashing_local(path, value, folders):  # an object attngeom writes to a local folder itself
        write(str(path.relative_to(tmp_path / "s.zarr")))
        put_local(path, value, folders)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", crashing)
    monkeypatch.setattr(storage, "_put_local", crashing_local)
    replace_groups(url, "r", ABLATION, second, {"seed": 1})
    record = [i + 1 for i, k in enumerate(keys) if k == "runs/r/ablation/zarr.json"]
    staging = next(i + 1 for i, k in enumerate(keys) if "/_next/single/x/c" in k)
    for crash_at, readable in ((staging, True), (record[-1], False)):
        shutil.rmtree(tmp_path / "s.zarr")
        shutil.copytree(pristine, tmp_path / "s.zarr")
        keys.clear()
        with pytest.raises(Crash):
            replace_groups(url, "r", ABLATION, second, {"seed": 1})
        assert read_state(zarr_store(url, read_only=True), "r", ABLATION).readable == readable
        if readable:
            np.testing.assert_array_equal(read_group(url, "r", ABLATION, "single")["x"].values, np.arange(3.0))
            # The consolidated metadata lags behind the record (the next writer refreshes it).
            assert [p for p in validate_store(url) if not p.startswith("the root's consolidated metadata")] == []
        else:
            with pytest.raises(IncompleteGroupError):
                read_group(url, "r", ABLATION, "single")
            assert "ablation of run r is incomplete (interrupted ablate)" in " ".join(validate_store(url))
        crash_at = None
        replace_groups(url, "r", ABLATION, second, {"seed": 1})
        assert validate_store(url) == []
        np.testing.assert_array_equal(read_group(url, "r", ABLATION, "single")["x"].values, np.arange(3.0) + 1)
        assert not (tmp_path / "s.zarr" / "runs" / "r" / "ablation" / "table").exists()


def test_bfloat16_values_give_the_analysis_of_their_float32_store(tmp_path):
    """The same sequences with bfloat16 values, stored as bit patterns (2 bytes) and as
    float32: every analysis value is the same, bit for bit."""
    from attngeom.api import open_store
    from attngeom.store import create_run, write_sequence
    from attngeom.store.objects.codecs import bfloat16_values
    from attngeom.extract.synthetic import synthetic_sequence, write_synthetic_run

    shape = dict(n_seq=3, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=24, queries=(7, 23))
    two, four = str(tmp_path / "two.zarr"), str(tmp_path / "four.zarr")
    layout = write_synthetic_run(two, "r", **shape, values_dtype="bfloat16")
    provenance = {k: v for k, v in open_store(two).run("r").provenance.items() if k not in ("layout", "initialized")}
    run = create_run(open_or_create_root(four), "r", replace(layout, values_dtype="float32"), provenance, shape["n_seq"])
    rng = np.random.default_rng(0)  # write_synthetic_run's draws, sequence by sequence
    for seq in range(shape["n_seq"]):
        arrays = synthetic_sequence(rng, layout)
        write_sequence(run, seq, {**arrays, "values": bfloat16_values(arrays["values"])})
    for store in (two, four):
        analyze(store, scheduler="threads", n_grid=[1, 2, 4], progress=False)
    runs = [open_store(store).run("r") for store in (two, four)]
    assert [str(r.dataset()["values"].dtype) for r in runs] == ["float32", "float32"]
    for group in (*ANALYSIS_GROUPS, "topn_by_query", "summary_by_query"):
        got, want = (r.analysis(group).load() for r in runs)
        xr.testing.assert_equal(got, want)
        for name in want.data_vars:  # the numbers bit for bit (NaN where NaN), labels as strings
            if want[name].dtype.kind in "fiub":
                assert np.asarray(got[name]).tobytes() == np.asarray(want[name]).tobytes(), (group, name)
