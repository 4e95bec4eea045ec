"""explore: the value picture against the analyze kernels, the folder written from a real
(tiny-model) store, its failures, and the page driven in headless Chromium."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st
from stores import Run, copy_store

from attngeom.analyze.kernels import topn_metrics
from attngeom.api import analyze
from attngeom.api import explore
from attngeom.cli import main
from attngeom.errors import InputError, RunNotFoundError, StoreNotFoundError
from attngeom.explore.geometry import value_picture
from attngeom.analyze.palette import REGIME_COLORS
from attngeom.store import open_dataset
from attngeom.store.session import StoreSession

GRID = [1, 2, 4, 8]
LENGTH = 16


def _instances(seed: int, B: int = 5, K: int = 12, D: int = 4, window: int | None = None):
    rng = np.random.default_rng(seed)
    scores = rng.normal(scale=2.0, size=(B, K))
    attendable = np.ones((B, K), dtype=bool)
    if window is not None:  # a sliding window: the final query sees only the last keys
        attendable[:, : K - window] = False
    scores[:, 0] += 3.0
    attn = np.where(attendable, np.exp(scores), 0.0)
    attn /= attn.sum(axis=1, keepdims=True)
    values = rng.normal(size=(B, K, D))
    # Exact ties of alpha, resolved to the smaller position by both.
    attn[:, 3] = attn[:, 4]
    return attn, values, attendable


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), window=st.sampled_from([None, 5, 11]))
def test_picture_precision_recall_match_the_analyze_kernel(seed, window):
    attn, values, attendable = _instances(seed, window=window)
    picture = value_picture(attn, values, attendable, GRID)
    reference = topn_metrics(attn, values, attendable, GRID, random_draws=0)
    np.testing.assert_allclose(picture.precision, reference["precision"], equal_nan=True)
    np.testing.assert_allclose(picture.recall, reference["recall"], equal_nan=True)


def test_picture_against_brute_force():
    """Selection, s_N, radii, intruders and strays from plain loops over the keys."""
    attn, values, attendable = _instances(3, B=3, K=10, D=3, window=7)
    picture = value_picture(attn, values, attendable, GRID)
    for b in range(3):
        keys = [k for k in range(10) if attendable[b, k]]
        ranked = sorted(keys, key=lambda k: (-attn[b, k], k))
        assert picture.order[b, : len(keys)].tolist() == ranked
        y = attn[b, :, None] * values[b]
        for g, n in enumerate(GRID):
            if n >= len(keys):
                assert np.isnan(picture.precision[b, g]) and not picture.in_r_max[b, g].any()
                continue
            chosen = ranked[:n]
            s = y[chosen].sum(axis=0)
            dist = {k: float(np.sum((y[k] - s) ** 2)) for k in keys}
            r_max2 = max(dist[i] for i in chosen)
            r_min2 = min(dist[j] for j in keys if j not in chosen)
            assert picture.r_max[b, g] == pytest.approx(np.sqrt(r_max2))
            assert picture.r_min[b, g] == pytest.approx(np.sqrt(r_min2))
            assert np.flatnonzero(picture.in_r_max[b, g]).tolist() == [k for k in keys if dist[k] <= r_max2]
            assert np.flatnonzero(picture.in_r_min[b, g]).tolist() == [k for k in keys if dist[k] < r_min2]
            intruders = [j for j in keys if j not in chosen and dist[j] <= r_max2]
            strays = [i for i in chosen if dist[i] >= r_min2]
            assert picture.precision[b, g] == pytest.approx(n / (n + len(intruders)))
            assert picture.recall[b, g] == pytest.approx(1 - len(strays) / n)


def test_projection_is_a_contraction_with_s_n_in_place():
    """The plane is orthonormal: drawn distances never exceed true ones, so a point inside a
    ball is drawn inside its circle; s_N is the sum of the selected y, projected."""
    attn, values, attendable = _instances(7, B=4, K=20, D=6)
    picture = value_picture(attn, values, attendable, GRID)
    y = attn[:, :, None] * values
    for b in range(4):
        for g, n in enumerate(GRID):
            drawn = np.linalg.norm(picture.xy[b] - picture.s_xy[b, g], axis=1)
            true = np.linalg.norm(y[b] - y[b, picture.order[b, :n]].sum(axis=0), axis=1)
            assert np.all(drawn <= true + 1e-12)
    assert np.allclose(np.nanmean(picture.xy, axis=1), 0, atol=1e-12)  # centred on the mean y
    assert np.all(picture.explained >= 0) and np.all(picture.explained.sum(axis=1) <= 1 + 1e-12)


# ---- the folder, from a real store of a tiny model ----


@pytest.fixture(scope="module")
def store(extracted_store, tmp_path_factory) -> str:
    """Run "a": tiny Llama (3 layers x 4 heads, 2 kv heads), analyzed, with an ablation table;
    run "g": tiny Gemma 3 (layers 0 and 2 slide a window of 6), analyzed; run "raw": extracted in
    bfloat16, never analyzed."""
    runs = (Run("llama", 3, "a", LENGTH), Run("gemma3", 1, "g", LENGTH),
            Run("llama", 2, "raw", LENGTH, (("dtype", "bfloat16"),)))
    url = str(copy_store(extracted_store(*runs), tmp_path_factory.mktemp("explore"), "store.zarr"))
    for run_id in ("a", "g"):
        analyze(url, run_id=run_id, scheduler="threads", n_grid=GRID, progress=False)
    # What `attngeom ablate` writes to ablation/single (it needs the model's weights).
    delta = np.arange(12, dtype=float).reshape(3, 4) / 10
    xr.Dataset({"delta_nll_mean": (("layer", "head"), delta)},
               coords={"layer": np.arange(3), "head": np.arange(4)}).to_zarr(
        url, group="runs/a/ablation/single", mode="w", consolidated=False, zarr_format=3)
    return url


@pytest.fixture(scope="module")
def page(store, tmp_path_factory) -> Path:
    result = explore(store, tmp_path_factory.mktemp("page") / "explore", sequences=2, progress=False)
    assert result.runs == 3 and result.heads == 3 * 3 * 4
    return result.index


def _load(path: Path, register: str) -> list:
    """The arguments of the registration call a data file makes."""
    text = path.read_text()
    assert text.startswith(f"attngeomExplore.{register}(") and text.rstrip().endswith(");")
    args = json.loads("[" + text.strip()[len(f"attngeomExplore.{register}("):-2] + "]")
    if register == "head":  # gzipped JSON in base64
        args[-1] = json.loads(gzip.decompress(base64.b64decode(args[-1])))
    return args


def test_folder_holds_the_page_plotly_and_one_file_per_head(page):
    out = page.parent
    html = page.read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", html), "the page must work offline"
    for ref in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert (out / ref).is_file(), ref
    assert (out / "plotly.min.js").stat().st_size > 1_000_000
    assert re.search(r"plotly\.js \d+\.\d+", html)
    for run in ("a", "g", "raw"):
        files = sorted(p.name for p in (out / "data" / run).iterdir())
        assert files == sorted(f"head_{layer}_{head}.js" for layer in range(3) for head in range(4))


def test_index_carries_the_head_table_and_decoded_tokens(page):
    (index,) = _load(page.parent / "data" / "index.js", "index")
    runs = {r["id"]: r for r in index["runs"]}
    a, raw = runs["a"], runs["raw"]
    assert (a["layers"], a["heads"], a["kv_heads"], a["head_kv"]) == (3, 4, 2, [0, 0, 1, 1])
    assert a["n_grid"] == GRID and a["sequences"] == [0, 1]
    assert (a["dtype"], raw["dtype"]) == ("float32", "bfloat16")  # extract's compute dtype, shown per run
    # The field's text scores (analysis/head_scores) colour the grid too; no detect, no probe scores.
    assert set(a["stats"]) == {"regime", "vote_diagonal", "vote_sink", "vote_other", "lambda", "f_score", "delta_nll",
                               "sink_score", "prev_token_score", "distant_mass_w16", "distant_mass_w64",
                               "distant_mass_w256"}
    # The command that adds them, as it runs for this run.
    [missing] = a["field"]["missing"]
    assert re.fullmatch(r"no detect/scores \(run `attngeom detect --store \S+ --run a( --model \S+)?`\): "
                        r"no duplicate-token, induction or retrieval scores", missing), missing
    assert a["stats"]["delta_nll"][2][3] == pytest.approx(1.1)
    assert np.asarray(a["stats"]["f_score"], dtype=float).shape == (3, 4, len(GRID))
    # The tiny model's word-level tokenizer decodes the corpus words.
    assert a["tokens"][0][0] == "<bos>" and all(t.startswith("w") for t in a["tokens"][0][1:])
    assert raw["stats"] == {} and any("no analysis" in n for n in raw["notes"])
    assert any("no ablation" in n for n in raw["notes"]) and not any("no ablation" in n for n in a["notes"])
    # The report's palette: a regime has one colour wherever it is drawn.
    from attngeom.analyze.palette import VOTE_COLORS

    assert index["palette"] == {"regime": REGIME_COLORS, "vote": VOTE_COLORS}


def _plane(xy: dict) -> np.ndarray:
    """The points of a head file's uint16 grid (NaN for a point not drawn), as the page decodes them."""
    grid = np.frombuffer(base64.b64decode(xy["q"]), dtype="<u2").reshape(-1, 2)
    return np.where(grid == 65535, np.nan, np.asarray(xy["lo"]) + grid * xy["step"])


def _float32(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def _masks(b64: str, keys: int) -> np.ndarray:
    packed = np.frombuffer(base64.b64decode(b64), dtype=np.uint8).reshape(len(GRID), -1)
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :keys].astype(bool)


def test_head_file_matches_the_store(page, store):
    layer, head = 1, 3
    run_id, l, h, payload = _load(page.parent / "data" / "a" / f"head_{layer}_{head}.js", "head")
    assert (run_id, l, h, payload["kv_head"], payload["shares_kv"]) == ("a", layer, head, 1, [2])
    ds = xr.open_zarr(store, group="runs/a", consolidated=False)
    topn = xr.open_zarr(store, group="runs/a/analysis/topn", consolidated=False)
    # Labels decoded from their codes.
    heads = open_dataset(StoreSession.reading(store).zstore, store, "runs/a/analysis/heads")
    assert payload["regime"]["regime"] == str(heads["regime"].values[layer, head])
    for inst in payload["instances"]:
        seq = inst["seq"]
        stored = ds["attn_last"].values[seq, layer, head]
        attn = np.frombuffer(base64.b64decode(inst["attn"]), dtype="<f2")
        np.testing.assert_array_equal(attn, stored.astype(np.float16))
        order = np.frombuffer(base64.b64decode(inst["order"]), dtype="<u2")
        assert order.tolist() == sorted(range(LENGTH), key=lambda k: (-stored[k], k))[: max(GRID)]
        values = ds["values"].values[seq, layer, payload["kv_head"]].astype(np.float64)
        picture = value_picture(stored[None], values[None], np.ones((1, LENGTH), dtype=bool), GRID)
        xy = _plane(inst["xy"])
        assert inst["xy"]["step"] <= np.ptp(picture.xy[0], axis=0).max() / 65000
        np.testing.assert_allclose(xy, picture.xy[0], rtol=0, atol=inst["xy"]["step"] / 2 * (1 + 1e-9))
        per_n = inst["per_n"]
        # Per N: the top-N keys outside the r_min ball (strays), the others inside the r_max ball.
        misplaced = _masks(per_n["misplaced"], LENGTH)
        for g, n in enumerate(GRID):
            top = set(order[:n].tolist())
            strays = {k for k in top if not picture.in_r_min[0, g, k]}
            intruders = {k for k in range(LENGTH) if k not in top and picture.in_r_max[0, g, k]}
            assert set(np.flatnonzero(misplaced[g]).tolist()) == strays | intruders
        row = topn.sel(seq=seq).isel(layer=layer, head=head)
        assert inst["source"] == "analysis/topn" and all(per_n["exact"])
        for name in ("precision", "recall"):
            np.testing.assert_array_equal(_float32(per_n[name]), row[name].values.astype(np.float32))
        np.testing.assert_array_equal(_float32(inst["curves"]["f_score"]), row["f_score"].values.astype(np.float32))
        np.testing.assert_array_equal(_float32(per_n["r_max"]), picture.r_max[0].astype(np.float32))
        assert sum(inst["votes"]) == LENGTH - 1


def test_run_without_analysis_uses_the_pictures_own_scores(page):
    *_, payload = _load(page.parent / "data" / "raw" / "head_0_0.js", "head")
    assert payload["regime"] is None
    inst = payload["instances"][0]
    assert inst["curves"] is None and inst["votes"] is None
    assert not any(inst["per_n"]["exact"])
    precision = _float32(inst["per_n"]["precision"])
    assert np.all((precision > 0) & (precision <= 1))


QUERIES = tuple(range(15, 256, 16))


@pytest.fixture(scope="module")
def query_page(tmp_path_factory) -> tuple[str, Path]:
    """A synthetic run kept at every 16th query of L = 256 (the final one among them), 4
    sequences, Gemma 3 270M's head shape (one kv head of dimension 256), and its page."""
    from attngeom.extract.synthetic import write_synthetic_run

    folder = tmp_path_factory.mktemp("queries")
    url = str(folder / "s.zarr")
    write_synthetic_run(url, "q", n_seq=4, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=256, length=256,
                        queries=QUERIES)
    analyze(url, run_id="q", scheduler="threads", progress=False)
    return url, explore(url, folder / "page", progress=False).index


def test_the_page_is_a_small_fraction_of_the_store_and_offers_each_query_once(query_page):
    url, index_html = query_page
    out = index_html.parent
    store_bytes = sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())
    data_bytes = sum(p.stat().st_size for p in (out / "data").rglob("*") if p.is_file())
    page_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    # The head files and table scale with the store; the page's own files (plotly.js, 4.6 MB)
    # do not.
    assert data_bytes < 0.3 * store_bytes, (data_bytes, store_bytes)
    assert page_bytes - data_bytes < 5_000_000
    (index,) = _load(out / "data" / "index.js", "index")
    assert index["runs"][0]["query_pos"] == list(QUERIES[:-1])  # the final query is the page's "final"
    *_, payload = _load(out / "data" / "q" / "head_1_2.js", "head")
    assert len(payload["by_query"]) == len(QUERIES) - 1
    at = payload["by_query"][2][0]  # q = 47 of sequence 0: its 48 keys
    assert len(base64.b64decode(at["attn"])) == 2 * 48 and at["source"] == "analysis/topn_by_query"


def test_query_menu_in_headless_chromium(query_page):
    chromium, sync_playwright = _browser()
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(query_page[1].resolve().as_uri())
        tab.wait_for_selector("body[data-ready='1']")
        menu = tab.locator("#query-select option").all_inner_texts()
        assert menu == ["final (q = 255)", *(f"q = {q}" for q in QUERIES[:-1])]
        tab.click("#head-grid [data-layer='1'][data-head='2']")
        tab.wait_for_selector("#head-view[data-rendered='1_2']")
        assert tab.locator("#panel-geometry .trace path.point").count() >= 256
        tab.select_option("#query-select", label="q = 47")
        tab.wait_for_function("() => document.getElementById('head-title').textContent.endsWith('query 47')")
        assert tab.locator("#panel-tokens .tok").count() == 256
        assert tab.locator("#panel-tokens .tok:not(.out)").count() == 48  # keys 0..47 of the query
        assert tab.locator("#panel-tokens .tok[style*='background']").count() == 47  # keys 1..47
        browser.close()
    assert not errors, errors


def test_bad_inputs_leave_nothing_behind(store, tmp_path):
    out = tmp_path / "new" / "explore"
    with pytest.raises(StoreNotFoundError):
        explore(str(tmp_path / "missing.zarr"), out, progress=False)
    with pytest.raises(RunNotFoundError):
        explore(store, out, run_id="nope", progress=False)
    assert not (tmp_path / "new").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("x")
    with pytest.raises(InputError):
        explore(store, foreign, progress=False)
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"]
    result = CliRunner().invoke(main, ["explore", "--store", store, "--out", str(out), "--run", "nope"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "no run 'nope'" in result.output
    assert not (tmp_path / "new").exists()


def test_cli_writes_one_run_and_rewrites_its_own_folder(store, tmp_path):
    out = tmp_path / "explore"
    for _ in range(2):  # the second run replaces the folder the first one wrote
        result = CliRunner().invoke(main, ["explore", "--store", store, "--out", str(out), "--run", "a",
                                           "--sequences", "1", "--no-progress"])
        assert result.exit_code == 0, result.output
        assert "1 run(s), 12 heads" in result.output
    assert sorted(p.name for p in (out / "data").iterdir()) == ["a", "index.js"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # Readable by others as a folder made by mkdir is (the umask's mode), not 0700.
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (out, out / "data", out / "data" / "a")} == {0o777 & ~umask}


# ---- the page in a real browser ----


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian package `chromium`)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    return chromium, sync_playwright


def test_page_in_headless_chromium(page, tmp_path):
    chromium, sync_playwright = _browser()
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(page.resolve().as_uri())
        tab.wait_for_selector("body[data-ready='1']")
        assert tab.locator("#head-grid [data-layer]").count() == 3 * 4
        assert tab.locator("#head-grid [data-layer='2'][data-head='3']").count() == 1
        assert tab.locator("#head-grid .axis.top").all_inner_texts() == ["L\\H", "0", "1", "2", "3"]
        colours = tab.evaluate("() => [...document.querySelectorAll('#head-grid .cell')].map(c => c.style.background)")
        palette = {f"rgb({int(c[1:3], 16)}, {int(c[3:5], 16)}, {int(c[5:7], 16)})" for c in REGIME_COLORS.values()}
        assert set(colours) <= palette, colours
        loaded = tab.evaluate("() => [...document.scripts].map(s => s.src).filter(s => s.includes('head_'))")
        assert loaded == [], "no head's data may load before a click"

        tab.click("#head-grid [data-layer='1'][data-head='3']")
        tab.wait_for_selector("#head-view[data-rendered='1_3']")
        assert "Layer 1, head 3" in tab.inner_text("#head-title")
        assert "reads kv head 1" in tab.inner_text("#head-meta")
        for plot in ("#panel-geometry", "#panel-curves"):
            assert tab.locator(f"{plot} svg.main-svg").count() > 0, plot
        assert tab.locator("#panel-geometry path.point").count() >= LENGTH
        assert tab.locator("#panel-geometry .shapelayer path").count() == 2  # r_min and r_max
        assert tab.locator("#panel-tokens .tok").count() == LENGTH
        assert tab.locator("#panel-tokens .tok.sink").count() == 1
        wrap = tab.evaluate("() => [getComputedStyle(document.getElementById('panel-tokens')).wordBreak,"
                            " getComputedStyle(document.getElementById('panel-tokens')).overflowWrap]")
        assert wrap == ["normal", "anywhere"]  # a line breaks inside a word only if it cannot fit
        assert "precision" in tab.inner_text("#geometry-numbers")
        assert "Regime:" in tab.inner_text("#panel-regime")
        tab.select_option("#stat-select", "delta_nll")  # coloured by ablation: a gradient legend
        assert tab.locator("#legend .bar").count() == 1

        tab.select_option("#n-select", label="2")
        assert tab.locator("#panel-tokens .tok.top").count() == 2
        tab.select_option("#run-select", index=1)  # "g": layer 0 slides a window, no sink there
        tab.click("#head-grid [data-layer='0'][data-head='1']")
        tab.wait_for_selector("#head-view[data-rendered='0_1']")
        window = tab.locator("#panel-tokens .tok:not(.out)").count()
        assert 0 < window < LENGTH and tab.locator("#panel-tokens .tok.sink").count() == 0
        assert tab.locator("#panel-geometry .trace path.point").count() == window  # N = 8 >= |K|: no s_N
        tab.select_option("#n-select", label="2")
        assert tab.locator("#panel-geometry .trace path.point").count() == window + 1  # and s_N
        assert "N is not valid" not in tab.inner_text("#geometry-numbers")
        tab.select_option("#run-select", index=2)  # "raw": no analysis, the page still works
        tab.click("#head-grid [data-layer='0'][data-head='0']")
        tab.wait_for_selector("#head-view[data-rendered='0_0']")
        assert "analyze" in tab.inner_text("#panel-curves")
        tab.screenshot(path=str(tmp_path / "explore.png"), full_page=True)
        browser.close()
    assert not errors, errors
    assert (tmp_path / "explore.png").stat().st_size > 10_000


@pytest.mark.needs_model
def test_a_gguf_runs_tokens_are_decoded_from_the_converted_folder(tmp_path, monkeypatch):
    """The tokenizer extract cached beside the converted model is read, not the GGUF again
    (here the GGUF is not even there); every distinct id is decoded as on its own."""
    from conftest import tiny_tokenizer

    from attngeom.explore.data import token_decoder
    from attngeom.extract.gguf_files import converted_path

    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path))
    model = {"id": "m", "path": str(tmp_path / "gone"), "gguf_file": "m.gguf", "file_sha256": "ab" * 32}
    decode, how = token_decoder({"model": model})
    assert decode is None and "not loadable here" in how
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(converted_path("m.gguf", "ab" * 32))
    decode, how = token_decoder({"model": model})
    ids = np.array([[1, 4, 5, 4], [1, 9, 4, 93]])
    assert decode(ids) == [[tokenizer.decode([int(i)]) for i in row] for row in ids]
    assert decode(ids)[1] == ["<bos>", "w5", "w0", "w89"] and how == "decoded with the tokenizer of m"
