"""Geometry at any query (docs/method.md#any-query): extract --queries keeps the rows of chosen
queries, analyze computes topn_by_query from them: equal to a brute-force twin on keys 0..q,
to topn bit for bit at q = L-1, and right on sliding-window layers at early queries."""

from __future__ import annotations

import base64
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
import xarray as xr
from click.testing import CliRunner
from test_analyze_kernels import COUNTS, RTOL, ATOL, brute_topn, brute_value_statistics
from test_capture import eager_reference
from test_explore import _browser, _load

import attngeom as ag
from attngeom.analyze.parameters import instance_seed
from attngeom.api import analyze
from attngeom.cli import main
from attngeom.errors import InputError
from attngeom.extract.tiles import attention_summaries
from attngeom.extract.pipeline import ExtractRequest, extract
from attngeom.extract.queries import query_positions
from attngeom.store import TOPN_VARIABLES, VALUE_STATISTICS, query_attendable, validate_store

GRID = [1, 2, 4, 8]


@pytest.mark.parametrize("spec, want", [
    ("last", ()),
    ("every:5", (5, 10, 15)),
    ("every:4", (3, 7, 11, 15)),
    ("every:20", (15,)),
    ("9,3, 3,15", (3, 9, 15)),
    ([15, 1], (1, 15)),
])
def test_query_positions(spec, want):
    assert query_positions(spec, 16) == want


@pytest.mark.parametrize("spec", ["every:0", "every:x", "0,3", "3,16", "a,b", "", [2.5], "first"])
def test_query_positions_refuse(spec):
    with pytest.raises(InputError, match="--queries"):
        query_positions(spec, 16)


def test_query_attendable_moves_the_final_querys_mask():
    full, window = np.ones(16, bool), np.arange(16) >= 10  # a window of 6 at q = 15
    assert query_attendable(full, 4).tolist() == [True] * 5
    assert query_attendable(window, 4).tolist() == [True] * 5
    assert query_attendable(window, 8).tolist() == [False] * 3 + [True] * 6
    assert query_attendable(window, 15).tolist() == window.tolist()


@pytest.mark.parametrize("tile", [(1, 1), (2, 4), (1, 11)])  # (kv heads, queries): blocks of 1, 4, every query
@pytest.mark.parametrize("kind", ["causal", "sliding"])
def test_capture_keeps_the_rows_of_the_asked_queries_at_any_block(tile, kind):
    """The kept rows are the float32 probability rows, 0 after the query (and outside the
    window), whichever block holds each query; at L-1 they are attn_last's bits."""
    torch.manual_seed(2)
    bsz, n_heads, n_kv, length, dim = 2, 4, 2, 11, 5
    q, k, v = (torch.randn(bsz, h, length, dim) for h in (n_heads, n_kv, n_kv))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (j <= i) & (i - j < 4) if kind == "sliding" else j <= i
    mask = None if kind == "causal" else allowed[None, None].expand(bsz, 1, length, length)
    queries = (1, 4, 5, 9, 10)
    cap, _ = attention_summaries(q, k, v, mask, 0.5, queries=queries, tile=tile)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.5
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)[:, :, list(queries)]
    assert cap.query_rows.shape == (bsz, n_heads, len(queries), length)
    torch.testing.assert_close(cap.query_rows, want, atol=1e-6, rtol=0)
    assert not cap.query_rows[~allowed[list(queries)].expand_as(cap.query_rows)].any()
    assert torch.equal(cap.query_rows[:, :, -1], cap.attn_last)


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Gemma 3 (sliding window 6 in layers 0 and 2), L = 16, 3 sequences, rows kept at
    queries 3, 5, 8, 12 and 15, analyzed."""
    folder = tiny_model_dir("gemma3")
    store = tmp_path_factory.mktemp("queries") / "s.zarr"
    ids = np.random.default_rng(0).integers(4, 90, size=(3, 16))
    ids[:, 0] = 1
    ag.extract(str(folder), token_ids=ids, store=store, run_id="r", queries=[3, 5, 8, 12, 15], progress=False)
    analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    return folder, store


def test_rows_are_the_eager_rows_and_the_last_is_attn_last(built):
    folder, store = built
    ds = xr.open_zarr(str(store), group="runs/r", consolidated=False)
    assert ds["attn_rows"].dims == ("seq", "layer", "head", "query_pos", "key")
    assert ds["attn_rows"].dtype == np.float32
    positions = ds["query_pos"].values
    assert positions.tolist() == [3, 5, 8, 12, 15]
    assert ag.open_store(str(store)).run("r").provenance["queries"] == [3, 5, 8, 12, 15]
    rows, _, _ = eager_reference(folder, torch.from_numpy(ds["tokens"].values.astype("int64")))
    for layer in range(ds.sizes["layer"]):
        stored = ds["attn_rows"].isel(layer=layer).values
        np.testing.assert_allclose(stored, rows[layer].numpy()[:, :, positions], atol=1e-5)
        for i, q in enumerate(positions):
            assert not stored[:, :, i, q + 1:].any()  # keys after the query
    np.testing.assert_array_equal(ds["attn_rows"].isel(query_pos=-1).values, ds["attn_last"].values)
    assert validate_store(str(store)) == []


def test_last_query_equals_topn_bit_for_bit(built):
    run = ag.open_store(str(built[1])).run("r")
    by_query, topn = run.analysis("topn_by_query").load(), run.analysis("topn").load()
    values = run.analysis("values").load()
    assert by_query["f_score"].dims == ("seq", "layer", "head", "query_pos", "n")
    last = by_query.sel(query_pos=15)
    for name in TOPN_VARIABLES:
        assert last[name].dtype == topn[name].dtype, name
        np.testing.assert_array_equal(last[name].values, topn[name].values, err_msg=name)
    for name in VALUE_STATISTICS:
        np.testing.assert_array_equal(last[name].values, values[name].values, err_msg=name)
    summary = run.analysis("summary_by_query").load()
    np.testing.assert_array_equal(summary.sel(query_pos=15)["f_score"].values,
                                  run.analysis("summary")["f_score"].values)


def test_early_queries_match_a_brute_force_twin_on_their_keys(built):
    """Every stored query of every layer (sliding ones included), from the stored rows and
    values cut to keys 0..q and the window's mask at q, against the definitions."""
    _, store = built
    ds = xr.open_zarr(str(store), group="runs/r", consolidated=False)
    by_query = ag.open_store(str(store)).run("r").analysis("topn_by_query").load()
    head_kv, window = ds["head_kv"].values, ds["window"].values
    for seq in range(ds.sizes["seq"]):
        for layer in range(ds.sizes["layer"]):
            values = ds["values"].values[seq, layer].astype(np.float64)
            for i, q in enumerate(ds["query_pos"].values[:-1]):
                keys = np.arange(q + 1)
                att = (keys > q - window[layer]) if window[layer] else np.ones(q + 1, bool)
                alpha = ds["attn_rows"].values[seq, layer, :, i, : q + 1].astype(np.float64)
                per_head = values[head_kv, : q + 1]
                masks = np.broadcast_to(att, alpha.shape)
                want = brute_topn(alpha, per_head, masks, GRID, seed=instance_seed(0, seq, layer))
                got = by_query.isel(seq=seq, layer=layer, query_pos=i)
                for name, x in want.items():
                    if name in COUNTS:
                        np.testing.assert_array_equal(got[name].values, x, err_msg=f"{name} q={q}")
                    else:
                        np.testing.assert_allclose(got[name].values, x, rtol=RTOL, atol=ATOL, err_msg=f"{name} q={q}")
                stats = brute_value_statistics(values[:, : q + 1], np.broadcast_to(att, (values.shape[0], q + 1)))
                for name, x in stats.items():
                    np.testing.assert_allclose(got[name].values, x[head_kv], rtol=1e-9, err_msg=f"{name} q={q}")


def test_sliding_layers_lose_the_sink_once_the_window_passes_it(built):
    """Window 6: query 5 still attends the sink, query 8 does not (its keys are 3..8)."""
    by_query = ag.open_store(str(built[1])).run("r").analysis("topn_by_query").load()
    sliding, full = by_query.sel(layer=[0, 2]), by_query.sel(layer=1)
    for name in ("sink_norm_ratio", "sink_cos_median"):
        assert sliding[name].sel(query_pos=[3, 5]).notnull().all(), name
        assert sliding[name].sel(query_pos=[8, 12, 15]).isnull().all(), name
        assert full[name].notnull().all(), name
    assert (sliding["sink_selected"].sel(query_pos=[8, 12, 15], n=[1, 2, 4]) == 0).all()
    # N < |K_q|: q = 3 has 4 keys, so N = 4 and 8 are not defined there; in a window of 6
    # keys N = 8 never is.
    assert by_query["f_score"].sel(query_pos=3, n=[4, 8]).isnull().all()
    assert by_query["f_score"].sel(query_pos=3, n=[1, 2]).notnull().all()
    assert sliding["f_score"].sel(query_pos=15, n=8).isnull().all()
    assert full["f_score"].sel(query_pos=15, n=8).notnull().all()


def test_a_run_without_queries_has_no_query_groups(tiny_model_dir, word_corpus, tmp_path):
    store = tmp_path / "s.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=2, store=str(store), run_id="r", queries="15", progress=False))
    analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    run = ag.open_store(str(store)).run("r")
    assert "attn_rows" in run.dataset()
    with pytest.raises(ag.errors.GroupNotFoundError):
        run.analysis("topn_by_query")


def test_analyze_appends_and_resumes_topn_by_query(tiny_model_dir, tmp_path):
    """Incremental: sequences added later are analyzed alone and give what one pass gives."""
    folder = tiny_model_dir("gemma3")
    ids = np.random.default_rng(1).integers(4, 90, size=(3, 12))
    ids[:, 0] = 1
    one, two = tmp_path / "one.zarr", tmp_path / "two.zarr"
    ag.extract(str(folder), token_ids=ids, store=one, run_id="r", queries="every:4", progress=False)
    analyze(str(one), scheduler="threads", n_grid=GRID, progress=False)
    ag.extract(str(folder), token_ids=ids, num_sequences=2, store=two, run_id="r", queries="every:4", progress=False)
    analyze(str(two), scheduler="threads", n_grid=GRID, progress=False)
    ag.extract(str(folder), token_ids=ids, store=two, run_id="r", queries="every:4", progress=False)
    result = analyze(str(two), scheduler="threads", n_grid=GRID, progress=False)[0]
    assert (result.sequences, result.new_sequences) == (3, 1)
    a = ag.open_store(str(one)).run("r").analysis("topn_by_query").load()
    b = ag.open_store(str(two)).run("r").analysis("topn_by_query").load()
    assert a["query_pos"].values.tolist() == [3, 7, 11]
    xr.testing.assert_identical(a, b)


def test_cli_queries_bad_input_exits_2_and_leaves_nothing(tiny_model_dir, word_corpus, tmp_path):
    store = tmp_path / "s.zarr"
    args = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
            "-S", "2", "--store", str(store), "--run", "r", "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--queries", "0,4"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--queries '0,4': positions must lie in 1..15" in result.stderr
    assert not store.exists()
    assert CliRunner().invoke(main, [*args, "--queries", "every:8"]).exit_code == 0
    result = CliRunner().invoke(main, [*args, "--queries", "every:4"])
    assert result.exit_code == 2 and "--queries is 7,15 in the run, every:4 here" in result.stderr


@pytest.fixture(scope="module")
def explored(built, tmp_path_factory) -> Path:
    return ag.explore(str(built[1]), tmp_path_factory.mktemp("explore") / "page", sequences=2,
                      progress=False).index


def test_explore_offers_every_stored_query(built, explored):
    """A head's page carries an instance per (stored query, sequence): the row over keys 0..q,
    its picture and topn_by_query's curves; q = L-1 is offered once, as the final query."""
    index = _load(explored.parent / "data" / "index.js", "index")[0]
    assert index["runs"][0]["query_pos"] == [3, 5, 8, 12]  # 15 = L-1 is the final query's
    head = _load(explored.parent / "data" / "r" / "head_2_1.js", "head")[3]
    assert len(head["by_query"]) == 4 and all(len(per_seq) == 2 for per_seq in head["by_query"])
    assert [inst["source"] for inst in head["instances"]] == ["analysis/topn"] * 2
    by_query = ag.open_store(str(built[1])).run("r").analysis("topn_by_query")
    early = head["by_query"][1][0]  # q = 5, sequence 0
    assert len(np.frombuffer(base64.b64decode(early["attn"]), dtype="<f2")) == 6
    f_score = np.frombuffer(base64.b64decode(early["curves"]["f_score"]), dtype="<f4")
    np.testing.assert_array_equal(
        f_score, by_query["f_score"].sel(seq=0, layer=2, head=1, query_pos=5).values.astype(np.float32))
    assert early["source"] == "analysis/topn_by_query"


def test_sigkill_then_rerun_equals_uninterrupted(built, tmp_path):
    """analyze of a run with queries, SIGKILLed half-way through its store writes, then rerun:
    topn_by_query and summary_by_query end as the uninterrupted analysis's."""
    from test_analyze import run_killed

    want = {name: ag.open_store(str(built[1])).run("r").analysis(name).load()
            for name in ("topn", "topn_by_query", "summary_by_query")}
    pristine = tmp_path / "pristine.zarr"
    shutil.copytree(built[1], pristine)
    shutil.rmtree(pristine / "runs" / "r" / "analysis")
    store = tmp_path / "s.zarr"
    shutil.copytree(pristine, store)
    full = run_killed(tmp_path, store, GRID, 0)
    assert full.returncode == 0, full.stderr
    total = int(full.stdout.split("writes")[-1])
    shutil.rmtree(store)
    shutil.copytree(pristine, store)
    # Mid-way: some sequences' batches written and recorded, the rest not.
    assert run_killed(tmp_path, store, GRID, total // 2).returncode == -signal.SIGKILL
    analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)
    run = ag.open_store(str(store)).run("r")
    for name, data in want.items():
        xr.testing.assert_identical(run.analysis(name).load(), data)
    assert validate_store(str(store)) == []


def test_explore_page_picks_the_query(explored):
    chromium, sync_playwright = _browser()
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(explored.resolve().as_uri())
        tab.wait_for_selector("body[data-ready='1']")
        tab.click("#head-grid [data-layer='1'][data-head='0']")  # full causal attention
        tab.wait_for_selector("#head-view[data-rendered='1_0']")
        assert "query 15" in tab.inner_text("#head-title")
        assert tab.locator("#panel-tokens .tok:not(.out)").count() == 16
        tab.select_option("#query-select", label="q = 5")
        assert "query 5" in tab.inner_text("#head-title")
        assert tab.locator("#panel-tokens .tok").count() == 16
        assert tab.locator("#panel-tokens .tok:not(.out)").count() == 6  # keys 0..5
        assert "N is not valid" in tab.inner_text("#geometry-numbers")  # N = 8 >= |K| = 6
        tab.select_option("#n-select", label="2")
        assert "analysis/topn_by_query" in tab.inner_text("#geometry-numbers")
        assert tab.locator("#panel-tokens .tok.top").count() == 2
        tab.click("#head-grid [data-layer='0'][data-head='0']")  # window 6: at q = 8, keys 3..8
        tab.wait_for_selector("#head-view[data-rendered='0_0']")
        tab.select_option("#query-select", label="q = 8")
        assert tab.locator("#panel-tokens .tok:not(.out)").count() == 6
        assert tab.locator("#panel-tokens .tok.sink").count() == 0
        browser.close()
    assert not errors, errors


def test_validate_names_a_missing_row_shard_and_a_missing_query_group(built, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(built[1], store)
    shutil.rmtree(store / "runs" / "r" / "attn_rows" / "c" / "1")
    shutil.rmtree(store / "runs" / "r" / "analysis" / "topn_by_query")
    problems = validate_store(str(store))
    assert any("sequence 1 is marked complete but lacks attn_rows" in p for p in problems), problems
    lost = [p for p in problems if p.startswith("runs/r/analysis/topn_by_query/")]
    assert len(lost) == 1 and " is missing" in lost[0] and "attngeom analyze" in lost[0], problems


def test_analyze_heals_damaged_query_groups(built, tmp_path):
    """A lost topn_by_query chunk and a truncated summary_by_query one, named by validate, are
    written again by the next analyze with the same parameters, which ends as the undisturbed
    analysis."""
    want = {name: ag.open_store(str(built[1])).run("r").analysis(name).load()
            for name in ("topn", "topn_by_query", "summary_by_query")}
    store = tmp_path / "s.zarr"
    shutil.copytree(built[1], store)
    base = store / "runs" / "r" / "analysis"
    lost = base / "topn_by_query" / "f_score" / "c.0.0.0.0.0"
    truncated = next(p for p in sorted((base / "summary_by_query" / "precision").glob("c.*")) if p.is_file())
    lost.unlink()
    truncated.write_bytes(truncated.read_bytes()[:10])
    problems = validate_store(str(store))
    assert any(p.startswith("runs/r/analysis/topn_by_query/f_score/c.0.0.0.0.0 is missing") for p in problems)
    assert any(p.startswith("runs/r/analysis/summary_by_query/precision/c.") and "truncated" in p
               for p in problems), problems
    result = analyze(str(store), scheduler="threads", n_grid=GRID, progress=False)[0]
    assert "topn_by_query/f_score" in result.healed and "summary_by_query/precision" in result.healed
    assert result.new_sequences == 3  # the lost chunk holds every sequence: computed again in place
    run = ag.open_store(str(store)).run("r")
    for name, data in want.items():
        xr.testing.assert_identical(run.analysis(name).load(), data)
    assert validate_store(str(store)) == []


def test_explore_checks_the_rows_it_reads(built, tmp_path):
    """A flipped byte in a committed sequence's attn_rows shard: explore ends in one line naming
    the sequence and how to recover, leaving no page."""
    from damage import flip, one_error

    store = tmp_path / "s.zarr"
    shutil.copytree(built[1], store)
    flip(store / "runs" / "r" / "attn_rows" / "c" / "1" / "0" / "0" / "0" / "0", 40)
    line = one_error("explore", "--store", str(store), "--out", str(tmp_path / "page"), "--no-progress")
    assert "sequence 1" in line and "attn_rows" in line and line.endswith(
        f"run `attngeom validate --store {store} --deep --repair` to uncommit sequence 1, then the run's extract "
        "command again to rewrite it"), line
    assert not (tmp_path / "page").exists()
