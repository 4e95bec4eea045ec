"""The field's head scores beside the regimes: the report's section and its computed
sentences, explore's head panel, and the taxonomy's exports (tidy table, DuoAttention's
KV-head table), with and without the score groups."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from field_groups import (
    add_detect,
    add_head_scores,
    detect_scores,
    drop_head_scores,
    head_scores,
    mark_lacking,
    plant_regimes,
    regimes,
)

from attngeom.api import analyze, taxonomy
from attngeom.errors import GroupNotFoundError, InputError
from attngeom.explore.build import explore
from attngeom.detect.head_classes import CRITERIA, KV_SCORES
from attngeom.report import build_report
from attngeom.report.agreement import class_sentences
from attngeom.extract.synthetic import write_synthetic_run

SHAPE = dict(n_seq=3, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8)
# Two Retrievers and three Mixers; the seven other heads are Resets.
PLAN = {(0, 0): "Retriever", (2, 3): "Retriever", (0, 1): "Mixer", (1, 2): "Mixer", (2, 0): "Mixer"}
GRID = [1, 2, 4, 8]
BY_NAME = {c.name: c for c in CRITERIA}


def test_sentences_of_a_known_case():
    regime = np.asarray(["Mixer"] * 5 + ["Reset"] * 3 + ["Retriever"] * 2, dtype=object)
    sink = np.array([0.9, 0.8, 0.7, 0.6, 0.1, 0.5, 0.1, 0.1, 0.0, 0.0])
    said = class_sentences(BY_NAME["sink head"], regime, sink)
    assert said == [
        "5 of 10 heads are sink heads (sink_score > 0.3); 80% of them (4) are Mixer heads, 1 Reset, 0 Retriever.",
        "No Retriever head is a sink head.",
        "Mixer heads and sink heads agree on 4 heads and differ on 2: 1 of the 5 Mixer heads is not a sink head, "
        "1 of the 5 sink heads is not a Mixer head.",
    ]
    none = class_sentences(BY_NAME["induction head"], regime, np.zeros(10))
    assert none == ["No head is an induction head (induction_score > 0.4); none of the 2 Retriever heads is one."]
    lone = class_sentences(BY_NAME["retrieval head"], regime[:8], np.r_[0.5, np.zeros(7)])
    assert lone[-1] == "The run has no Retriever head to read beside its retrieval heads."
    # A streaming head is one below its cut; a head without a value is of no class.
    streaming = class_sentences(BY_NAME["streaming head"], regime, np.r_[np.full(9, 0.1), np.nan])
    assert streaming[0].startswith("9 of 10 heads are streaming heads (distant_mass_w64 < 0.35)")
    assert class_sentences(BY_NAME["streaming head"], regime, np.full(10, np.nan))[0].startswith(
        "distant_mass_w64 is undefined for every head")


def test_every_class_agrees_when_scores_follow_the_regimes():
    regime = np.asarray(["Mixer", "Retriever", "Reset", "Mixer"], dtype=object)
    sink = (regime == "Mixer").astype(float)
    said = class_sentences(BY_NAME["sink head"], regime, sink)
    assert said[0] == "2 of 4 heads are sink heads (sink_score > 0.3); 100% of them (2) are Mixer heads, 0 Retriever, 0 Reset."
    assert said[-1] == "Mixer heads and sink heads agree on every head."


def _scores_from_regimes(regime: np.ndarray):
    """Scores whose classes are known from the regimes: sink heads = Mixers, previous-token
    heads = Resets, retrieval heads = Retrievers and the Reset head (1, 0), no induction
    head; distant mass defined at W = 16 only (L = 40)."""
    mixer, retriever, reset = (regime == "Mixer", regime == "Retriever", regime == "Reset")
    retriever = retriever.copy()
    retriever[1, 0] = True
    layers, heads = regime.shape
    distant = np.full((layers, heads, 3), np.nan)
    distant[..., 0] = np.linspace(0.0, 0.9, regime.size).reshape(layers, heads)
    text = head_scores(np.where(mixer, 0.8, 0.05), np.where(reset, 0.6, 0.1), distant)
    probe = detect_scores(np.full(regime.shape, 0.01), np.full(regime.shape, 0.02),
                          np.where(reset, 0.7, 0.0), np.where(retriever, 0.5, 0.0))
    return text, probe


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Runs "both" (analysis, head_scores, detect), "text" (head_scores only), "plain"
    (an analysis without head_scores, of a run extracted before prev_attn) and "raw"
    (extracted only)."""
    url = str(tmp_path_factory.mktemp("field") / "store.zarr")
    for seed, run_id in enumerate(("both", "text", "plain", "raw")):
        write_synthetic_run(url, run_id, length=40, seed=seed, **SHAPE)
        plant_regimes(url, run_id, PLAN)
        if run_id != "raw":
            analyze(url, run_id=run_id, scheduler="threads", n_grid=GRID, progress=False)
    drop_head_scores(url, "plain")
    mark_lacking(url, "plain")
    for run_id in ("both", "text"):
        text, probe = _scores_from_regimes(regimes(url, run_id))
        add_head_scores(url, run_id, text)
        if run_id == "both":
            add_detect(url, run_id, probe)
    return url


@pytest.fixture(scope="module")
def page(store, tmp_path_factory):
    index = build_report(store, tmp_path_factory.mktemp("report") / "out").index
    return index.read_text(), index.parent


def _said(page: str) -> list[str]:
    block = re.search(r'<section id="field_agreement">.*?<ul class="said">(.*?)</ul>', page, re.DOTALL).group(1)
    return [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", block)]


def test_report_section_states_what_the_scores_make_of_the_regimes(store, page):
    text, out = page
    assert '<h2 id="heads-of-the-field">Heads of the field</h2>' in text
    for name in ("field_scores", "detect_scores", "field_scores_grid", "detect_scores_grid"):
        assert (out / f"{name}.png").stat().st_size > 1000
    said = _said(text)
    assert said == [line[2:] for line in (out / "field_agreement.md").read_text().splitlines()]
    assert regimes(store, "both").tolist() == [["Retriever", "Mixer", "Reset", "Reset"],
                                               ["Reset", "Reset", "Mixer", "Reset"],
                                               ["Mixer", "Reset", "Reset", "Retriever"]]
    # Each run is named once, its sentences after it.
    runs = [i for i, s in enumerate(said) if s.startswith("Run ")]
    blocks = {said[i]: said[i + 1:j] for i, j in zip(runs, [*runs[1:], len(said)])}
    both = blocks["Run both (synthetic, synthetic, L=40):"]
    assert both == [
        "3 of 12 heads are sink heads (sink_score > 0.3); 100% of them (3) are Mixer heads, 0 Retriever, 0 Reset.",
        "No Retriever head is a sink head. No Reset head is a sink head.",
        "Mixer heads and sink heads agree on every head.",
        "7 of 12 heads are previous-token heads (prev_token_score > 0.4); 100% of them (7) are Reset heads, "
        "0 Retriever, 0 Mixer.",
        "No Retriever head is a previous-token head. No Mixer head is a previous-token head.",
        "Reset heads and previous-token heads agree on every head.",
        "distant_mass_w64 is undefined for every head (distant mass at window W needs L > 2W): streaming heads "
        "cannot be told at this L.",
        "No head is a duplicate-token head (duplicate_score > 0.4).",
        "No head is an induction head (induction_score > 0.4); none of the 2 Retriever heads is one.",
        "7 of 12 heads are previous-token heads (probe) (detect_prev_token_score > 0.4); 100% of them (7) are "
        "Reset heads, 0 Retriever, 0 Mixer.",
        "No Retriever head is a previous-token head (probe). No Mixer head is a previous-token head (probe).",
        "Reset heads and previous-token heads (probe) agree on every head.",
        "3 of 12 heads are retrieval heads (retrieval_score > 0.1); 67% of them (2) are Retriever heads, 1 Reset, "
        "0 Mixer.",
        "No Mixer head is a retrieval head.",
        "Retriever heads and retrieval heads agree on 2 heads and differ on 1: 0 of the 2 Retriever heads are not "
        "retrieval heads, 1 of the 3 retrieval heads is not a Retriever head.",
    ]
    (text_run,) = [lines for name, lines in blocks.items() if name.startswith("Run text (")]
    assert re.fullmatch(r"Duplicate-token, induction and retrieval heads are not compared: no detect/scores "
                        r"\(run `attngeom detect --store \S+ --run text[^`]*`\)\.", text_run[0]), text_run[0]
    assert len(text_run) == 1 + 7  # the note, then the three text classes
    # The run without head_scores is named in the notes, with what would add them.
    assert ("run plain: no analysis/head_scores: the run was extracted before attngeom kept prev_attn and "
            "recent_attn (extract it again into a new run)") in text
    classes = pd.read_csv(out / "field_classes.csv")
    row = classes[(classes["run"] == "both") & (classes["class"] == "retrieval head")].iloc[0]
    assert [int(row["heads"]), *row[["Retriever", "Mixer", "Reset", "% of Retriever"]].tolist()] == [3, 2, 0, 1, 100.0]
    streaming = classes[(classes["run"] == "both") & (classes["class"] == "streaming head")].iloc[0]
    assert streaming["heads"] == "needs L > 2W (L = 40)" and pd.isna(streaming["Retriever"])
    assert row["% of Reset"] == pytest.approx(100 / 7)
    assert set(classes["run"]) == {"both", "text"}
    assert "induction head" not in classes[classes["run"] == "text"]["class"].tolist()
    medians = pd.read_csv(out / "field_medians.csv")
    assert "retrieval_score" in medians and "distant_mass_w256" not in medians  # NaN for every head
    mixer = medians[(medians["run"] == "both") & (medians["regime"] == "Mixer")]
    assert mixer["heads"].item() == 3 and mixer["sink_score"].item() == pytest.approx(0.8)


def test_report_without_any_score_group_says_so(tmp_path):
    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", length=24, **SHAPE)
    analyze(url, run_id="r", scheduler="threads", n_grid=GRID, progress=False)
    drop_head_scores(url, "r")
    result = build_report(url, tmp_path / "out")
    page = result.index.read_text()
    assert '<h2 id="heads-of-the-field">Heads of the field</h2>' in page and "could not be made" not in page
    assert (f"run r: no analysis/head_scores (run `attngeom analyze --store {url} --run r`) and no detect/scores "
            f"(run `attngeom detect --store {url} --run r`)") in page
    assert (tmp_path / "out" / "field_criteria.csv").exists() and not (tmp_path / "out" / "field_agreement.md").exists()
    err = "\n".join(result.missing)
    assert f"`attngeom detect --store {url} --run r` (no detect yet)" in err


def test_explore_panel_carries_each_heads_scores(store, tmp_path):
    explore(store, tmp_path / "page", run_id="both", sequences=1, progress=False)
    text = (tmp_path / "page" / "data" / "index.js").read_text()
    index = json.loads(text[text.index("(") + 1: text.rindex(")")])
    run = index["runs"][0]
    field = run["field"]
    assert [c["column"] for c in field["criteria"]] == [c.column for c in CRITERIA]
    regime = regimes(store, "both")
    sink = np.asarray(field["scores"]["sink_score"], dtype=float)
    np.testing.assert_allclose(sink, np.where(regime == "Mixer", 0.8, 0.05))
    assert np.asarray(field["scores"]["distant_mass_w256"], dtype=object).tolist() == [[None] * 4] * 3
    assert "retrieval_score" in field["scores"] and field["missing"] == []
    for stat in ("sink_score", "retrieval_score"):
        assert stat in run["stats"]
    explore(store, tmp_path / "plain", run_id="plain", sequences=1, progress=False)
    text = (tmp_path / "plain" / "data" / "index.js").read_text()
    plain = json.loads(text[text.index("(") + 1: text.rindex(")")])["runs"][0]["field"]
    assert plain["scores"] == {} and len(plain["missing"]) == 2


def test_tidy_table_round_trips(store, tmp_path):
    result = taxonomy(store, export=tmp_path / "heads.csv")
    frame = result.heads()
    assert len(frame) == 3 * 3 * 4 and set(frame["run"]) == {"both", "text", "plain"}
    assert list(frame.columns[:8]) == ["run", "model", "dataset", "L", "layer", "head", "kv_head", "regime"]
    both = frame[frame["run"] == "both"]
    regime = regimes(store, "both").ravel()
    assert both["regime"].tolist() == regime.tolist()
    assert both["kv_head"].tolist() == [0, 0, 1, 1] * 3
    assert both["sink_head"].tolist() == (regime == "Mixer").tolist()
    assert both["retrieval_head"].sum() == 3 and both["induction_head"].sum() == 0
    assert frame[frame["run"] == "text"]["retrieval_score"].isna().all()
    assert frame[frame["run"] == "plain"]["sink_head"].isna().all()
    assert {"s_norm", "cos_s_v0", "signature_n", "vote_sink", "sink_norm_ratio"} <= set(frame.columns)
    back = pd.read_csv(tmp_path / "heads.csv")
    assert back.shape == frame.shape and back["regime"].tolist() == frame["regime"].tolist()
    np.testing.assert_allclose(back["sink_score"], frame["sink_score"], equal_nan=True)
    taxonomy(store, export=tmp_path / "heads.parquet")
    parquet = pd.read_parquet(tmp_path / "heads.parquet")
    pd.testing.assert_frame_equal(parquet, frame)


def test_kv_table_is_duoattentions_layout(store, tmp_path):
    """Written where docs/cli.md's example writes it, into a folder made for it."""
    path = tmp_path / "patterns" / "full_attention_heads.tsv"
    taxonomy(store, export_kv=path, score="retrieval_score", run_id="both")
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(len(line.split("\t")) == 2 for line in lines)
    assert all(re.fullmatch(r"-?\d\.\d{18}e[+-]\d\d", cell) for line in lines for cell in line.split("\t"))
    # As duo_attn.utils.load_attn_pattern reads it.
    table = np.clip(np.loadtxt(path, dtype=float, delimiter="\t"), 0, 1)
    retrieval = np.where(regimes(store, "both") == "Retriever", 0.5, 0.0)
    retrieval[1, 0] = 0.5
    np.testing.assert_array_equal(table, retrieval.reshape(3, 2, 2).max(axis=2))
    np.testing.assert_array_equal(taxonomy(store).kv_scores("retrieval_score", "both"), table)
    distant = taxonomy(store).kv_scores("distant_mass_w16", "text")
    assert distant.shape == (3, 2) and ((distant >= 0) & (distant <= 1)).all()


@pytest.mark.parametrize("args, error", [
    (["--export-kv", "{tmp}/k.tsv", "--score", "sink_score", "--run", "both"], InputError),
    (["--export-kv", "{tmp}/k.tsv", "--score", "nope", "--run", "both"], InputError),
    (["--export-kv", "{tmp}/k.tsv", "--run", "both"], InputError),
    (["--export-kv", "{tmp}/k.tsv", "--score", "retrieval_score", "--run", "text"], GroupNotFoundError),
    (["--export-kv", "{tmp}/k.tsv", "--score", "distant_mass_w256", "--run", "text"], GroupNotFoundError),
    (["--export-kv", "{tmp}/k.tsv", "--score", "distant_mass_w16", "--run", "plain"], GroupNotFoundError),
    (["--export-kv", "{tmp}/k.tsv", "--score", "retrieval_score"], InputError),
    (["--export-kv", "{tmp}/k.csv", "--score", "retrieval_score", "--run", "both"], InputError),
    (["--export", "{tmp}/heads.xlsx"], InputError),
    (["--export", "/dev/null/heads.csv"], InputError),
    (["--export", "{tmp}"], InputError),
    (["--score", "retrieval_score"], InputError),
])
def test_cli_errors_are_one_line(store, tmp_path, args, error):
    argv = [a.format(tmp=tmp_path) for a in args]
    done = subprocess.run([sys.executable, "-m", "attngeom.cli", "taxonomy", "--store", store, *argv],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), done.stderr
    assert done.stdout == ""
    kwargs = {"export": None, "export_kv": None, "score": None, "run_id": None}
    for flag, key in (("--export", "export"), ("--export-kv", "export_kv"), ("--score", "score"), ("--run", "run_id")):
        if flag in argv:
            kwargs[key] = argv[argv.index(flag) + 1]
    with pytest.raises(error):
        taxonomy(store, **kwargs)
    assert not list(tmp_path.glob("k.*")) and not list(tmp_path.glob("heads.*"))


def test_unwritable_path_is_one_line(store, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if (locked / "probe").exists() or _writable(locked):
            pytest.skip("running as a user who writes anywhere")
        with pytest.raises(InputError, match="cannot be written"):
            taxonomy(store, export=locked / "heads.csv")
    finally:
        locked.chmod(0o700)


def _writable(folder) -> bool:
    try:
        (folder / "probe").write_text("")
    except OSError:
        return False
    (folder / "probe").unlink()
    return True


def test_kv_scores_are_those_that_mean_keep():
    assert set(KV_SCORES) == {"distant_mass_w16", "distant_mass_w64", "distant_mass_w256", "retrieval_score",
                              "induction_score", "duplicate_score"}
