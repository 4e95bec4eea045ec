"""report: every figure and table from a tiny synthetic store, notes for missing inputs, and an
index.html that renders offline in headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from field_groups import add_detect, add_head_scores, detect_scores, head_scores
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from attngeom.api import analyze
from attngeom.analyze.palette import REGIME_COLORS
from attngeom.report import build_report
from attngeom.report.build import FIGURES, TABLES, draw_figure, select_runs
from attngeom.report.data import RunData, load_runs
from attngeom.report.plots import N_LABEL
from attngeom.report.spec import FigureSpec
from attngeom.store import (
    ATTR_KEY,
    REGIMES,
    open_dataset,
    open_root,
    open_run_group,
    zarr_store,
)
from attngeom.store.session import StoreSession
from attngeom.extract.synthetic import write_synthetic_run

GRID = [1, 2, 4, 8, 16]
SHAPE = dict(n_seq=3, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)


def _write(ds: xr.Dataset, store: str, group: str) -> None:
    ds.to_zarr(zarr_store(store, read_only=False), group=group, mode="w",
               consolidated=False, zarr_format=3)


def _set_identity(store: str, run_id: str, model: str, dataset: str, dtype: str | None = None) -> None:
    run = open_run_group(open_root(store, mode="a"), run_id)
    meta = dict(run.attrs[ATTR_KEY])
    meta.update(model={"id": model}, dataset={"id": dataset})
    if dtype is not None:
        meta["compute_dtype"] = dtype
    run.attrs[ATTR_KEY] = meta


def _add_ablation(store: str, run_id: str) -> None:
    """What ``attngeom ablate`` writes (it needs a model), in its layout: head (0, 1) critical."""
    base = f"runs/{run_id}/ablation"
    rng = np.random.default_rng(1)
    heads = open_dataset(StoreSession.reading(store).zstore, store, f"runs/{run_id}/analysis/heads")
    coords = {"layer": heads["layer"].values, "head": heads["head"].values}
    shape = (heads.sizes["layer"], heads.sizes["head"])
    delta = rng.exponential(0.05, size=(*shape, 2))
    delta[0, 1] = 5.0
    _write(xr.Dataset({"delta_nll": (("layer", "head", "seq"), delta),
                       "delta_nll_mean": (("layer", "head"), delta.mean(-1)),
                       "delta_nll_median": (("layer", "head"), np.median(delta, -1))},
                      coords={**coords, "seq": [0, 2]}),
           store, f"{base}/single")
    methods = np.asarray(["type_guided", "single_impact", "weight_o", "weight_v", "entropy_low", "entropy_high",
                          "sink_attention", "current_attention", "random"], dtype=object)
    retention = np.array([0.25, 0.5, 0.75, 1.0])
    std = np.full((methods.size, retention.size), np.nan)  # one mask: no spread
    std[-1] = 0.1
    _write(xr.Dataset({"delta_nll_mean": (("method", "retention"), rng.random(std.shape) * (1 - retention)),
                       "delta_nll_std": (("method", "retention"), std)},
                      coords={"method": methods, "retention": retention}),
           store, f"{base}/sweep")
    diagnostics = np.asarray(["mean_last_attention", "mean_sink_attention", "mean_topN_attention_mass",
                              "mean_attention_entropy", "mean_top1_attention"], dtype=object)
    _write(xr.Dataset({name: ("diagnostic", rng.uniform(-1, 1, diagnostics.size))
                       for name in ("spearman_r", "spearman_p", "pearson_r", "pearson_p")},
                      coords={"diagnostic": diagnostics}),
           store, f"{base}/correlations")
    _write(xr.Dataset({"layer": ("critical", [0]), "head": ("critical", [1]), "delta_nll_mean": ("critical", [5.0]),
                       "robust_z": ("critical", [40.0])}),
           store, f"{base}/critical")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Three runs: "full" (rows kept at 4 queries, analysis, field scores and ablation), "plain" (analysis
    only, another model and L) and "raw" (extracted, never analyzed)."""
    url = str(tmp_path_factory.mktemp("report") / "store.zarr")
    for run_id, length, seed, model, dataset, dtype in (("full", 32, 0, "org/model-a", "corpus-a", "bfloat16"),
                                                         ("plain", 24, 1, "model-b", "corpus-b", "float32"),
                                                         ("raw", 32, 2, "model-b", "corpus-a", None)):
        queries = (7, 15, 23, 31) if run_id == "full" else ()
        write_synthetic_run(url, run_id, length=length, seed=seed, queries=queries, **SHAPE)
        _set_identity(url, run_id, model, dataset, dtype)
    for run_id in ("full", "plain"):
        analyze(url, run_id=run_id, scheduler="threads", n_grid=GRID, progress=False)
    _add_ablation(url, "full")
    rng = np.random.default_rng(2)
    shape = (SHAPE["n_layers"], SHAPE["n_heads"])
    scores = head_scores(rng.random(shape), rng.random(shape), rng.random((*shape, 3)))
    # As for a model with learned sinks (gpt-oss): the learned sink's mean weight beside key 0's.
    scores["learned_sink_score"] = (("layer", "head"), rng.random(shape) * 0.2)
    add_head_scores(url, "full", scores)
    add_detect(url, "full", detect_scores(*rng.random((4, *shape))))
    return url


@pytest.fixture(scope="module")
def report(store, tmp_path_factory) -> Path:
    return build_report(store, tmp_path_factory.mktemp("out") / "report").index


def test_report_writes_every_expected_file(report):
    out = report.parent
    assert report == out / "index.html" and report.stat().st_size > 0
    for spec in FIGURES:
        assert (out / f"{spec.name}.png").stat().st_size > 1000, spec.name
    for spec in TABLES:
        for ext in ("md", "csv"):
            assert (out / f"{spec.name}.{ext}").stat().st_size > 0, (spec.name, ext)


def test_index_references_every_output_and_nothing_online(report):
    page = report.read_text()
    for spec in FIGURES:
        assert f'src="{spec.name}.png"' in page
    for spec in TABLES:
        assert f'href="{spec.name}.csv"' in page and f'href="{spec.name}.md"' in page
    assert "<script" not in page
    assert not re.search(r"(src|href)=\"(https?:)?//", page), "index.html must work offline"
    for ref in re.findall(r'(?:src|href)="([^"#][^"]*)"', page):
        assert ref.startswith("data:") or (report.parent / ref).exists(), ref


def test_missing_inputs_are_notes_not_crashes(report):
    page = report.read_text()
    assert "Missing inputs" in page
    # Each with the command that adds it, as it runs for that run.
    assert re.search(r"run raw: no analysis/summary \(run `attngeom analyze --store \S+ --run raw`\)", page)
    assert re.search(r"run plain: no ablation/sweep \(run `attngeom ablate --store \S+ --run plain[^`]*`\)", page)
    assert "could not be made" not in page


@pytest.fixture(scope="module")
def runs(store) -> list[RunData]:
    return load_runs(store)


@pytest.mark.parametrize("spec", FIGURES, ids=lambda s: s.name)
def test_figures_have_axes_labels_and_data(runs, spec):
    fig = spec.draw(select_runs(spec.needs, runs)[0])
    assert isinstance(fig, Figure)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert axes
    for ax in axes:
        assert ax.get_ylabel(), (spec.name, ax.get_title())
        # Data, or the statement that there is none (e.g. a CV of constants is undefined).
        drawn = ax.lines or ax.patches or ax.collections or ax.images
        texts = [t.get_text() for t in ax.texts]
        assert drawn or (len(texts) == 1 and texts[0].startswith("no defined values")), (spec.name, ax.get_title())


def test_figures_show_what_the_paper_describes(runs):
    by_name = {s.name: s for s in FIGURES}

    def draw(name: str) -> Figure:
        spec = by_name[name]
        return spec.draw(select_runs(spec.needs, runs)[0])

    precision, recall = draw("precision_recall").axes[:2]
    assert precision.get_ylabel() == r"$P(r_{\max}, N)$" and recall.get_ylabel() == r"$R(r_{\min}, N)$"
    assert precision.get_xlabel() == N_LABEL
    # Two analyzed runs, each drawn solid (top-N), dashed (random) and dotted (bound).
    assert sorted(line.get_linestyle() for line in precision.lines) == ["-", "-", "--", "--", ":", ":"]
    taxonomy = draw("taxonomy")
    assert [t.get_text() for t in taxonomy.axes[0].get_xticklabels()] == [
        "model-a\ncorpus-a\nL=32", "model-b\ncorpus-b\nL=24"]
    # Explore's palette: one colour per regime wherever it is drawn.
    bars = {to_hex(p.get_facecolor()) for p in taxonomy.axes[0].patches}
    assert bars <= {c.lower() for c in REGIME_COLORS.values()} and len(set(REGIME_COLORS.values())) == 3
    sparsification = draw("sparsification").axes[0]
    assert sparsification.get_xlabel() == "retained fraction of heads per layer"
    assert len(sparsification.lines) == 9 and len(sparsification.collections) == 1  # random's std band
    critical = draw("critical_head_diagnostic").axes[0]
    assert [t.get_text() for t in critical.texts] == ["critical heads (ΔNLL)\nL0 H1: 5.00"]


def test_tables_content(report):
    out = report.parent
    models = pd.read_csv(out / "models.csv")
    assert models["run"].tolist() == ["full", "plain", "raw"]
    assert models.loc[0, ["model", "dataset", "L", "layers", "heads", "kv heads", "sequences"]].tolist() == [
        "org/model-a", "corpus-a", 32, 2, 4, 2, 3]
    assert models["analysis"].tolist() == ["yes", "yes", "no"]
    assert models["dtype"].tolist() == ["bfloat16", "float32", "?"]  # "?": no dtype recorded
    taxonomy = pd.read_csv(out / "taxonomy_distribution.csv")
    assert taxonomy["run"].tolist() == ["full", "plain"]
    assert (taxonomy[list(REGIMES)].sum(axis=1) == taxonomy["total"]).all() and (taxonomy["total"] == 8).all()
    certificate = pd.read_csv(out / "certificate_violations.csv")
    assert set(certificate["run"]) == {"full", "plain"}
    assert (certificate["A_N > K_exact"] == 0).all()
    assert (certificate["instances"] > 0).all()
    impact = pd.read_csv(out / "regime_impact.csv")
    assert impact["regime"].tolist() == list(REGIMES) and impact["heads"].sum() == 8
    correlations = pd.read_csv(out / "ablation_correlations.csv")
    assert correlations["spearman_r"].abs().is_monotonic_decreasing
    assert (out / "models.md").read_text().splitlines()[1].startswith("| --- |")


def test_store_without_analysis_gives_notes_only(tmp_path):
    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "raw", length=16, **SHAPE)
    result = build_report(url, tmp_path / "out")
    index = result.index
    page = index.read_text()
    assert "run raw: no analysis/summary" in page
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["illustration.png"]
    assert (tmp_path / "out" / "models.csv").exists()
    # The terminal says what is missing and how to add it: the illustration and the models
    # table need nothing; the sparsification and critical-head items need only the ablation.
    assert list(result.missing) == [
        f"{len(FIGURES) - 3} of {len(FIGURES)} figures and 6 of {len(TABLES)} tables and 1 of 1 lists of "
        f"statements need `attngeom analyze --store {url}` (no analysis yet)",
        f"2 figures and 2 tables need `attngeom ablate --store {url} --run raw` (no ablation yet)",
    ]


def test_an_optional_input_is_named_optional(tmp_path):
    """A run analyzed, ablated and detected, extracted without --queries, of a model without
    learned sinks: nothing is missing; the two figures along the context and the table of the
    two sinks are offered as optional."""
    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", length=24, **SHAPE)
    analyze(url, run_id="r", scheduler="threads", n_grid=GRID, progress=False)
    _add_ablation(url, "r")
    shape = (SHAPE["n_layers"], SHAPE["n_heads"])
    add_head_scores(url, "r", head_scores(np.zeros(shape), np.zeros(shape), np.zeros((*shape, 3))))
    add_detect(url, "r", detect_scores(*np.zeros((4, *shape))))
    result = build_report(url, tmp_path / "out")
    page = result.index.read_text()
    assert "Missing inputs" not in page and 'class="note"' not in page
    optional = re.findall(r'<p class="optional">([^<]*)</p>', page)
    assert optional[0] == ("Optional: run r: its model has no learned sinks — affects learned_sink_selection_rate, "
                           "two_sinks")
    assert optional[1] == ("Optional: run r: no analysis/summary_by_query (extract with --queries, then run "
                           "`attngeom analyze`) — affects separability_by_query, sink_rate_by_query")
    assert len(optional) == 6  # the page's two lines and one under each figure and table
    assert page.count("(optional)</li>") == 4 and "(missing)" not in page
    assert list(result.missing) == [
        "2 figures need a run extracted with --queries (optional)",
        "1 figure and 1 table need a model with learned sinks, such as gpt-oss (optional)"]


def test_a_figure_that_fails_becomes_a_note(runs, tmp_path):
    def broken(_runs):
        raise ValueError("unexpected layout")

    entry = draw_figure(FigureSpec("broken", "Models", "never drawn", broken), runs, tmp_path)
    assert entry.image is None
    assert entry.notes == ("this figure could not be made from the store's data (ValueError: unexpected layout)",)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_index_renders_in_headless_chromium(report, tmp_path):
    binary = _chromium()
    if binary is None:
        pytest.skip("Chromium is not installed (Debian package `chromium`)")
    screenshot = tmp_path / "index.png"
    common = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    url = report.resolve().as_uri()
    shot = subprocess.run([*common, f"--screenshot={screenshot}", "--window-size=1280,2000", url],
                          capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.stat().st_size > 10_000
    console = [line for line in shot.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for spec in FIGURES:
        assert f'src="{spec.name}.png"' in dom.stdout


def test_sparsification_figure_says_what_its_curves_hide():
    """weight_o equal to weight_v draws one curve under the other; retention 0.9 of 4 heads
    keeps all 4 (round(3.6)), the intact model: both are said on the figure."""
    from attngeom.report.figures_heads import sparsification, sparsification_notes

    retention = np.array([0.5, 0.9, 1.0])
    kept = np.round(retention * 4) / 4
    mean = np.array([[0.8, 0.0, 0.0], [0.8, 0.0, 0.0], [1.2, 0.0, 0.0]])
    sweep = xr.Dataset({"delta_nll_mean": (("method", "retention"), mean),
                        "kept_fraction": (("method", "retention"), np.tile(kept, (3, 1)))},
                       coords={"method": np.array(["weight_o", "weight_v", "random"], dtype=object),
                               "retention": retention})
    notes = ["weight_o = weight_v (one curve)", "retention 0.9 keeps all 4 heads per layer"]
    assert sparsification_notes(sweep, 4) == notes
    run = RunData("r", "m", "d", 16, "float32", 2, 4, 2, 3, ablation={"sweep": sweep})
    assert [t.get_text() for t in sparsification([run]).axes[0].texts] == ["\n".join(notes)]
    assert sparsification_notes(sweep.isel(method=[0, 2], retention=[0, 2]), 4) == []


def test_small_things_said_plainly(runs, tmp_path):
    """ΔNLL axes carry their unit; a one-run legend swatch has its boxes' colour; a table with
    no rows says none; a box of one value, or of few defined heads, says so."""
    from attngeom.report.build import make_table
    from attngeom.report.figures_heads import critical, sparsification
    from attngeom.report.figures_sink import sink_cosines
    from attngeom.report.figures_values import coherence
    from attngeom.report.html import _entry

    full = next(r for r in runs if r.run_id == "full")
    assert critical([full]).axes[0].get_ylabel() == r"single-head $\Delta$NLL (nats)"
    assert sparsification([full]).axes[0].get_ylabel() == r"$\Delta$NLL (decode, nats)"

    ax = sink_cosines([full]).axes[0]
    boxes = {to_hex(p.get_facecolor(), keep_alpha=True) for p in ax.patches}
    swatches = {to_hex(h.get_facecolor(), keep_alpha=True) for h in ax.get_legend().get_patches()}
    assert len(boxes) == 1 and swatches == boxes

    empty = xr.Dataset({"layer": ("critical", np.zeros(0, int)), "head": ("critical", np.zeros(0, int))})
    lone = RunData("r", "m", "d", 16, "float32", 2, 4, 2, 3, ablation={"critical": empty})
    spec = next(s for s in TABLES if s.name == "critical_heads")
    assert _entry(make_table(spec, [lone], tmp_path)).endswith("<p>none</p></section>")

    heads = full.heads.copy()
    cv = np.full(heads["nu_minus_q95_cv"].shape, np.nan)
    cv[1] = 0.678  # one layer of heads sharing one kv head: the only defined CV
    heads["nu_minus_q95_cv"] = (heads["nu_minus_q95_cv"].dims, cv)
    heads["nu_plus_q95_cv"] = heads["nu_plus_q95_cv"] * np.nan
    one = RunData("r", "m", "d", 16, "float32", 2, 4, 2, 3, heads=heads)
    axes = {ax.get_title(): ax for ax in coherence([one]).axes}
    degenerate = axes[r"CV across sequences of $\nu_N^{-,(0.95)}$"]
    assert degenerate.get_xlabel().replace("\n", " ") == (
        "4 of 8 heads defined, elsewhere 0 in every sequence (CV 0/0), or no sink; all 4 equal 0.678")
    assert [t.get_text() for t in axes[r"CV across sequences of $\nu_N^{+,(0.95)}$"].texts] == [
        "no defined values\n(0 in every sequence (CV 0/0), or no sink)"]


def test_the_page_opens_with_how_to_read_it(report, runs):
    """A line per section on what it answers, then findings computed from the store, each
    linked to its item; the method's sections they cite exist (test_docs checks every
    docs/method.md reference of the package)."""
    import html

    from attngeom.report.data import regime_counts
    from attngeom.report.html import section_id
    from attngeom.report.reading import QUESTIONS
    from attngeom.report.spec import SECTIONS

    page = report.read_text()
    opening = html.unescape(page[page.index('<h2 id="how-to-read-this-report">'):page.index("<nav>")])
    assert set(QUESTIONS) == set(SECTIONS)
    for title in SECTIONS:
        assert f'<a href="#{section_id(title)}">{title}</a>: {QUESTIONS[title][0]}' in opening
        assert f'<h2 id="{section_id(title)}">' in page
    full = next(r for r in runs if r.run_id == "full")
    counts = regime_counts(full)
    total = sum(counts.values())
    shares = ", ".join(f"{counts[r]} ({100 * counts[r] / total:.0f}%) {r}s" for r in REGIMES)
    assert f"Run full: of its {total} heads, {shares}. " in opening
    top = full.summary["f_score"].sel(stat="mean").mean(["layer", "head"]).values
    rand = full.summary["random_f_score"].sel(stat="mean").mean(["layer", "head"]).values
    if (top > rand).all():
        assert "Run full: top-N selection, averaged over heads, is above random at every N" in opening
    table = pd.read_csv(report.parent / "certificate_violations.csv")
    rows = table[table["run"] == "full"]
    assert (f"Run full: the paper's bound on inversions is exceeded in {rows['A_N > K_sink'].sum()} of "
            f"{rows['instances'].sum()} (sequence, layer, head, N) instances") in opening
    for item in ("taxonomy_distribution", "precision_recall", "certificate_violations"):
        assert f'<a href="#{item}">{item}</a>' in opening and f'<section id="{item}">' in page
    assert "Run raw" not in opening  # not analyzed: nothing to say
