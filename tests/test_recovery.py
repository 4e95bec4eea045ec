"""Damage after the extract: analysis and ablation groups, metadata, consolidated
metadata, concurrent analyzes and bad input. Each case: the damage, what validate says
(exit 1), what a command meets it with (one line, exit 2), the command that recovers, and
the store afterwards equal, object for object, to an undisturbed one."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xarray as xr
import zarr

from attngeom.api import analyze
from attngeom.api import ablate
from attngeom.store.session import StoreSession
from attngeom.store.objects.schema import ANALYSIS

from conftest import ABLATED_SEQUENCES
from test_damage import flip, one_error, run, validate

S = ABLATED_SEQUENCES
GRID = ["--n-grid", "1,2,4"]


@pytest.fixture
def store(ablated_store) -> Path:
    return ablated_store


def assert_same_tree(a: Path, b: Path) -> None:
    """The same objects, byte for byte (metadata, records and consolidated copy included)."""
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert mismatch == [] and errors == [], mismatch + errors


def analyze_cli(store: Path, *flags: str) -> list[str]:
    code, lines = run("analyze", "--store", str(store), "--scheduler", "threads", "--no-progress", *GRID, *flags)
    assert code == 0, lines
    return lines


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


A = "runs/r/analysis"
REWRITE = "run `attngeom analyze --store {url} --run r` again to rewrite it"


@pytest.mark.parametrize("key, damage, what, reader", [
    ("heads/regime/c.0.0", Path.unlink, "is missing", "taxonomy"),
    ("topn/precision/c.0.0.0.0", Path.unlink, "is missing", "explore"),
    ("topn/zarr.json", truncate, "is truncated (40 of ", "explore"),
    ("summary/f_score/c.0.0.0.0", lambda p: p.write_bytes(b""), "is empty (0 bytes)", "report"),
    ("taxonomy/votes/c.0.0.0.0", truncate, "is truncated (40 of ", "explore"),
], ids=["cross-sequence-chunk", "sequence-chunk", "group-metadata", "empty-chunk", "truncated-chunk"])
def test_analyze_rewrites_a_lost_or_resized_analysis_object(store, ablated_store_source, tmp_path, key, damage, what, reader):
    """Seen from the objects the analysis's commit lists: validate names it, readers refuse
    it, a plain rerun rewrites it and ends as an undisturbed analyze."""
    url = str(store)
    damage(store / A / key)
    line = f"{A}/{key} {what}"
    lines = validate(store)  # (an unparsable zarr.json: "empty or truncated (unreadable JSON)")
    assert len(lines) == 1 and lines[0].startswith(f"{A}/{key} is ") and lines[0].endswith(REWRITE.format(url=url))
    args = {"taxonomy": ["taxonomy", "--store", url],
            "explore": ["explore", "--store", url, "--out", str(tmp_path / "page"), "--no-progress"],
            "report": ["report", "--store", url, "--out", str(tmp_path / "page")]}[reader]
    assert one_error(*args).startswith(f"attngeom: error: {line}")
    assert not (tmp_path / "page").exists()
    assert analyze_cli(store)[-1].startswith(f"run r: rewrote the damaged analysis: {line}")
    assert_same_tree(store, ablated_store_source)
    (again,) = analyze_cli(store)  # healed once: nothing left to rewrite
    assert again.startswith("run r: 0 new sequences")


def test_a_corrupt_analysis_chunk_is_rewritten_under_deep_or_after_repair(store, ablated_store_source):
    """A flipped byte keeps the object's size: validate --deep names it, analyze --deep
    rewrites it; or validate --deep --repair removes it and a plain analyze rewrites it."""
    url = str(store)
    key = f"{A}/topn/recall/c.0.0.0.0"
    flip(store / key, 40)
    pristine = store.parent / "flipped.zarr"
    shutil.copytree(store, pristine)
    (line,) = validate(store, "--deep")
    assert line.startswith(f"array '{A}/topn/recall' chunk c.0.0.0.0 is damaged (ValueError: Stored and computed")
    assert line.endswith(f"run `attngeom analyze --store {url} --run r --deep` again to rewrite it")
    assert len(analyze_cli(store)) == 1  # the cheap check does not read the objects
    assert analyze_cli(store, "--deep")[-1].startswith(f"run r: rewrote the damaged analysis: {key} is damaged")
    assert_same_tree(store, ablated_store_source)

    code, lines = run("validate", "--store", str(pristine), "--deep", "--repair")
    assert code == 1 and lines[0] == (f"removed damaged {key}; run `attngeom analyze --store {pristine} --run r` "
                                      f"again to rewrite it"), lines
    assert lines[1].startswith(f"{key} is missing")
    analyze_cli(pristine)
    assert_same_tree(pristine, ablated_store_source)


@pytest.mark.parametrize("damage", [truncate, lambda p: p.write_text("{}")], ids=["truncated", "not-zarr"])
def test_an_unreadable_analysis_record_is_named_everywhere_and_rebuilt_by_analyze(store, ablated_store_source, tmp_path, damage):
    url = str(store)
    damage(store / A / "zarr.json")
    message = f"{A}/zarr.json is empty or truncated (unreadable JSON); {REWRITE.format(url=url)}"
    assert validate(store) == [message]
    code, lines = run("validate", "--store", url, "--deep", "--repair")
    assert code == 1 and lines == [message]
    for args in (["taxonomy", "--store", url], ["report", "--store", url, "--out", str(tmp_path / "page")],
                 ["explore", "--store", url, "--out", str(tmp_path / "page"), "--no-progress"]):
        assert one_error(*args) == f"attngeom: error: {message}"
    lines = analyze_cli(store)
    assert lines[0].startswith(f"run r: {S} new sequences") and lines[1] == (
        f"run r: recomputed every sequence: its record {A}/zarr.json did not parse")
    assert_same_tree(store, ablated_store_source)


@pytest.mark.parametrize("key, damage, what", [
    ("single/delta_nll_mean/c.0.0", Path.unlink, "is missing"),
    ("zarr.json", truncate, "is empty or truncated (unreadable JSON)"),
], ids=["chunk", "record"])
def test_ablate_rewrites_a_damaged_ablation(store, ablated_store_source, key, damage, what):
    url = str(store)
    damage(store / "runs/r/ablation" / key)
    message = f"runs/r/ablation/{key} {what}; run `attngeom ablate --store {url} --run r` again to rewrite it"
    assert validate(store) == [message]
    if key == "zarr.json":  # xarray, opening the run, reads its groups' metadata
        assert one_error("analyze", "--store", url, "--no-progress").endswith(message)
    ablate(url, "r", device="cpu", random_masks=2, retention=[1.0, 0.5], progress=False)
    assert validate(store, "--deep") == []
    assert_same_tree(store / "runs/r/ablation", ablated_store_source / "runs/r/ablation")


def test_run_metadata_is_rebuilt_by_repair(store, ablated_store_source, tiny_model_dir, word_corpus, tmp_path):
    """A run array's zarr.json rebuilt from the run's layout, the runs group's, and the root's
    from its runs: byte for byte what was written. Until then extract refuses to report
    success and explore names it."""
    url = str(store)
    extract_args = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
                    "-S", str(S), "--store", url, "--run", "r", "--no-progress"]
    truncate(store / "runs/r/values/zarr.json")
    rebuild = f"run `attngeom validate --store {url} --repair` to rebuild it"
    assert validate(store) == [f"runs/r/values/zarr.json is empty or truncated (unreadable JSON); {rebuild}"]
    assert one_error(*extract_args).endswith(rebuild)
    assert one_error("explore", "--store", url, "--out", str(tmp_path / "page")).endswith(rebuild)
    code, lines = run("validate", "--store", url, "--deep", "--repair")
    assert code == 0 and lines == ["rebuilt runs/r/values/zarr.json", "refreshed the root's consolidated metadata",
                                   f"{url}: valid"], lines
    assert_same_tree(store, ablated_store_source)

    (store / "zarr.json").write_bytes(b"")
    (store / "runs/zarr.json").write_bytes(b"{")
    assert one_error("taxonomy", "--store", url).endswith(rebuild)
    code, lines = run("validate", "--store", url, "--repair")
    assert code == 0 and lines[:2] == ["rebuilt runs/zarr.json", "rebuilt zarr.json"], lines
    assert_same_tree(store, ablated_store_source)
    code, lines = run(*extract_args)
    assert code == 0 and lines[-1].endswith(f"the run holds {S} committed of {S}"), lines


def test_a_lost_coordinate_chunk_is_refused_and_rewritten_by_repair(store, ablated_store_source):
    """Read whole, a lost coordinate chunk would be zeros: every layer 0 in the analysis."""
    url = str(store)
    (store / "runs/r/layer/c/0").unlink()
    message = (f"run r: coordinate 'layer' does not hold what the run's layout records (a lost or damaged chunk); "
               f"run `attngeom validate --store {url} --repair` to rewrite it")
    assert validate(store) == [message]
    assert one_error("analyze", "--store", url, "--no-progress") == f"attngeom: error: {message}"
    code, lines = run("validate", "--store", url, "--repair")
    assert code == 0 and lines == ["rebuilt runs/r/layer/c/0", f"{url}: valid"], lines
    assert_same_tree(store, ablated_store_source)


def test_what_cannot_be_rebuilt_is_said_in_one_line(store):
    (store / "zarr.json").write_bytes(b"")
    (store / "runs/r/zarr.json").write_bytes(b"")
    code, lines = run("validate", "--store", str(store), "--repair")
    assert code == 1 and lines[:2] == [
        "rebuilt zarr.json",
        "runs/r/zarr.json cannot be rebuilt (nothing in the store records it); restore the store from a copy, "
        "or remove runs/r and extract again",
    ], lines


@pytest.mark.parametrize("damage", [
    lambda p: shutil.rmtree(p / "runs/r/values/c/1"),
    lambda p: (p / "runs/r/values/c/1/0/0/0/0").write_bytes(b""),
    lambda p: flip(p / "runs/r/values/c/1/0/0/0/0", 40),
], ids=["deleted", "empty", "flipped"])
def test_explore_checks_the_values_it_reads(store, tmp_path, damage):
    damage(store)
    line = one_error("explore", "--store", str(store), "--out", str(tmp_path / "page"), "--no-progress")
    assert "sequence 1" in line and line.endswith(
        f"run `attngeom validate --store {store} --deep --repair` to uncommit sequence 1, then the run's extract "
        "command again to rewrite it")
    assert not (tmp_path / "page").exists()


def test_consolidated_metadata_is_refreshed_after_a_killed_extract(ablated_store_source, tiny_model_dir, word_corpus, tmp_path,
                                                                  monkeypatch):
    """An extract appending sequences, interrupted before it refreshes the consolidated
    metadata: validate names it, and the rerun (with nothing left to write) refreshes it,
    so that the README's xr.open_zarr sees every committed sequence."""
    import attngeom.store.extracted.run_write as run_write

    store = tmp_path / "s.zarr"
    shutil.copytree(ablated_store_source, store)
    url = str(store)
    args = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
            "-S", str(S + 2), "--store", url, "--run", "r", "--no-progress"]

    def killed(root):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(run_write, "consolidate", killed)
        assert run(*args)[0] == 130
    (line,) = validate(store)
    assert line.startswith("the root's consolidated metadata (read by xr.open_zarr) is out of date for runs/r/")
    assert line.endswith(f"run `attngeom validate --store {url} --repair` to refresh it")
    assert xr.open_zarr(url, group="runs/r").sizes["seq"] == S  # what it lied
    code, lines = run(*args)
    assert code == 0 and lines[-1].startswith("run r: wrote 0 sequences"), lines
    assert xr.open_zarr(url, group="runs/r").sizes["seq"] == S + 2
    assert validate(store) == []


def test_concurrent_analyzes_of_a_run_run_one_after_the_other(store, ablated_store_source, tmp_path):
    """A writer holds an advisory lock on the run's folder: another process cannot take it
    meanwhile. Two analyzes started together both finish, the store as one analyze leaves it."""
    url = str(store)
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)")
    with StoreSession(url, mode="a") as session, session.derived("r", ANALYSIS):
        assert subprocess.run([sys.executable, "-c", probe, str(store / "runs/r")]).returncode == 3
    assert subprocess.run([sys.executable, "-c", probe, str(store / "runs/r")]).returncode == 0

    reference = tmp_path / "reference.zarr"
    shutil.copytree(ablated_store_source, reference)
    analyze(str(reference), scheduler="threads", n_grid=[1, 4], progress=False)
    cmd = [sys.executable, "-m", "attngeom.cli", "analyze", "--store", url, "--n-grid", "1,4", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    both = [subprocess.Popen([*cmd, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for flags in ((), ("--scheduler", "threads"))]
    outputs = [p.communicate(timeout=300) for p in both]
    assert [p.returncode for p in both] == [0, 0], outputs
    assert sorted(out.split(" new sequences")[0].rsplit(" ", 1)[-1] for out, _ in outputs) == ["0", str(S)], outputs
    assert_same_tree(store, reference)


@pytest.mark.parametrize("command", ["validate", "migrate", "taxonomy", "analyze"])
def test_an_unknown_url_scheme_is_one_line(command):
    assert one_error(command, "--store", "foo://x") == (
        "attngeom: error: cannot open the store foo://x: Protocol not known: foo")


@pytest.mark.parametrize("name, content, message", [
    ("bin.jsonl", b"\xff\xfe\x00\x81", "bin.jsonl:1 is not UTF-8 text (invalid start byte): convert it to UTF-8"),
    ("text.parquet", b"hello\n", "text.parquet is not a Parquet file (Parquet file size is 6 bytes"),
])
def test_an_unreadable_corpus_file_is_one_line(tiny_model_dir, tmp_path, name, content, message):
    corpus = tmp_path / name
    corpus.write_bytes(content)
    line = one_error("extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(corpus), "-L", "16",
                     "-S", "1", "--store", str(tmp_path / "s.zarr"), "--no-progress")
    assert line.startswith(f"attngeom: error: {tmp_path}/{message}")
    assert not (tmp_path / "s.zarr").exists()


def test_the_commit_lists_every_object_of_its_groups(ablated_store_source):
    """What the cheap check compares with: every stored object of the committed groups, and
    nothing of staging."""
    record = json.loads((ablated_store_source / A / "zarr.json").read_text())["attributes"]["attngeom"]["commit"]
    stored = {str(p.relative_to(ablated_store_source / A)): p.stat().st_size for p in (ablated_store_source / A).rglob("*")
              if p.is_file() and p.parent != ablated_store_source / A}
    assert record["objects"] == stored
    assert zarr.open_group(str(ablated_store_source), path=A, mode="r").attrs["attngeom"]["commit"]["groups"] == [
        "topn", "values", "taxonomy", "heads", "summary", "signatures", "table", "sequence_scores", "head_scores"]


def test_a_corrupt_kept_chunk_met_by_an_appending_analyze_is_rewritten_under_deep(tmp_path):
    """An appending analyze reads its kept sequences' last chunk back and meets a flipped
    byte: it stops naming the chunk, with the update under way recorded; analyze --deep then
    finds that chunk although the kept commit lists none of the sequence groups' objects,
    rewrites it, and ends where an undisturbed analyze of every sequence does."""
    import numpy as np

    import attngeom as ag
    from attngeom.errors import CorruptChunkError
    from attngeom.store import RunLayout, consolidate, create_run, open_or_create_root, write_sequence
    from attngeom.extract.synthetic import synthetic_sequence

    layout = RunLayout(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=32, head_kv=(0, 0, 1, 1),
                       window=(0, 0), attendable=((True,) * 32,) * 2, queries=())
    provenance = {"model": {"id": "synthetic"}, "dataset": {"id": "synthetic"}, "context_length": 32,
                  "library_versions": {}, "command_line": "test"}
    arrays = [synthetic_sequence(np.random.default_rng(s), layout) for s in range(6)]

    def extracted(url: str, sequences: range) -> None:
        root = open_or_create_root(url)
        run_group = root["runs/r"] if "runs" in root and "r" in root["runs"] else create_run(root, "r", layout,
                                                                                              provenance, 6)
        for s in sequences:
            write_sequence(run_group, s, arrays[s])
        consolidate(root)

    damaged, whole = str(tmp_path / "damaged.zarr"), str(tmp_path / "whole.zarr")
    extracted(damaged, range(3))
    ag.analyze(damaged, scheduler="threads", progress=False)
    extracted(damaged, range(3, 6))
    flip(Path(damaged) / A / "topn/s_norm/c.0.0.0.0", 30)
    with pytest.raises(CorruptChunkError, match=f"array '{A}/topn/s_norm' chunk c.0.0.0.0 is damaged"):
        ag.analyze(damaged, scheduler="threads", progress=False)
    (result,) = ag.analyze(damaged, scheduler="threads", progress=False, deep=True)
    assert result.healed.startswith(f"{A}/topn/s_norm/c.0.0.0.0 is damaged") and result.sequences == 6
    extracted(whole, range(6))
    ag.analyze(whole, scheduler="threads", progress=False)
    for name in ("topn", "values", "taxonomy", "heads", "summary"):
        xr.testing.assert_identical(ag.open_store(damaged).run("r").analysis(name).load(),
                                    ag.open_store(whole).run("r").analysis(name).load())
