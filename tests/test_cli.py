"""The command line as a newcomer meets it: help texts, and one line with exit 2 for input
that cannot be used."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import cli_in_fresh_process
from stores import Run

import attngeom as ag
from attngeom.cli import main


def test_help_lists_each_command_once_in_pipeline_order_and_every_option_has_help():
    top = CliRunner().invoke(main, ["--help"]).output
    listed = re.findall(r"^  (\w+) ", top.split("Commands:", 1)[1], flags=re.M)
    assert listed == ["extract", "analyze", "taxonomy", "ablate", "detect", "report", "explore", "validate", "migrate",
                      "demo"]
    # Which commands need the model, as the code does: extract, ablate, detect and demo load it.
    intro = " ".join(top.split("Options:", 1)[0].split())
    assert "analyze, taxonomy, report, explore, validate and migrate read the store and need no model" in intro
    assert "ablate and detect load the run's model again" in intro and "demo runs extract" in intro
    for name, command in main.commands.items():
        assert all(p.help for p in command.params if isinstance(p, click.Option)), name
        text = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        assert "%%" not in text, name
    assert "s with s % n == i" in CliRunner().invoke(main, ["extract", "--help"], terminal_width=200).output


def test_every_reader_of_a_store_without_runs_says_so_in_one_line(tmp_path):
    from attngeom.store import open_or_create_root

    store = str(tmp_path / "empty.zarr")
    open_or_create_root(store)
    expected = f"attngeom: error: {store} holds no run yet: extract one into it first\n"
    for args in (["analyze", "--no-progress"], ["taxonomy"], ["report", "--out", str(tmp_path / "report")],
                 ["explore", "--out", str(tmp_path / "explore"), "--no-progress"], ["ablate", "--run", "r"]):
        result = CliRunner().invoke(main, [*args, "--store", store])
        assert (result.exit_code, result.output) == (2, expected), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.zarr"]


@pytest.mark.parametrize("command", ["report", "explore"])
def test_an_out_that_cannot_be_a_folder_is_one_line(command, tmp_path):
    from attngeom.extract.synthetic import write_synthetic_run

    store = str(tmp_path / "s.zarr")
    write_synthetic_run(store, "r", n_seq=1, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    result = CliRunner().invoke(main, [command, "--store", store, "--out", str(out)])
    assert (result.exit_code, result.output) == (
        2, f"attngeom: error: --out {out} cannot be made a folder (Not a directory)\n")
    with pytest.raises(ag.InputError, match="cannot be made a folder"):
        getattr(ag, command)(store, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "s.zarr"]


def test_a_run_longer_than_the_kernels_take_is_one_line_and_writes_nothing(tmp_path):
    """analyze refuses a run of more keys per query than its kernels index (MAX_KEYS) before
    it writes anything."""
    from attngeom.analyze.kernels import MAX_KEYS
    from attngeom.extract.synthetic import write_synthetic_run

    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=1, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                        length=MAX_KEYS + 2)
    before = sorted(store.rglob("*"))
    result = CliRunner().invoke(main, ["analyze", "--store", str(store), "--no-progress"])
    assert (result.exit_code, result.output) == (
        2, f"attngeom: error: run 'r' has L = {MAX_KEYS + 2} keys per query; analyze takes at most {MAX_KEYS}\n")
    assert sorted(store.rglob("*")) == before



# --- mistakes answered before anything heavy loads --------------------------------------------


def refusal(*args: str) -> str:
    """The one line the CLI refuses ``args`` with (exit code 2)."""
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2, (args, result.output)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), (args, result.output)
    return lines[0].removeprefix("attngeom: error: ")


@pytest.fixture
def extracted(tiny_model_dir, word_corpus, extracted_store):
    """(model folder, corpus folder, store) with run r: 2 sequences of a tiny llama at L = 16."""
    return tiny_model_dir("llama"), word_corpus, extracted_store(Run(sequences=2))


def extract_args(extracted, **options: str) -> list[str]:
    model, corpus, store = extracted
    given = {"model": str(model), "dataset": str(corpus), "context-length": "16", "num-sequences": "2",
             "store": str(store), "run": "r", **{k.replace("_", "-"): v for k, v in options.items()}}
    return ["extract", *(x for key, value in given.items() for x in (f"--{key}", value)), "--no-progress"]


def tree(path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_each_extract_mistake_is_one_line_with_the_store_untouched(extracted, tmp_path):
    store = extracted[2]
    before = tree(store)
    afile = tmp_path / "afile"
    afile.write_text("x")
    expected = {
        "--queries every:0": ({"queries": "every:0"}, "--queries 'every:0': the step K of every:K must be at least 1"),
        "--queries 600 at L = 16": ({"queries": "600"}, "--queries '600': positions must lie in 1..15 (L = 16); got 600"),
        "a store under a file": ({"store": str(afile / "s.zarr")},
                                 f"cannot create store {afile / 's.zarr'}: {afile} is a file, not a folder"),
        "another L for the run": ({"context_length": "12"},
                                  f"run 'r' in {store} differs from this command: --context-length is 16 in the run, "
                                  "12 here; give the run's values to continue it, or another --run"),
        "another values dtype": ({"values_dtype": "float16"}, f"run 'r' in {store} differs from this command: "
                                 "--values-dtype is float32 in the run, float16 here; give the run's values to "
                                 "continue it, or another --run"),
        "another window rule and queries": ({"window": "random", "seed": "3", "queries": "every:4"},
                                            f"run 'r' in {store} differs from this command: --window is first in "
                                            "the run, random --seed 3 here; --queries is last in the run, every:4 "
                                            "here; give the run's values to continue it, or another --run"),
        "a seed the first window does not use": ({"seed": "7"}, "--seed 7 seeds the random window rule, and --window "
                                                 "first takes each document's first window: drop --seed, or use "
                                                 "--window random"),
        "a text field of plain documents": ({"text_field": "body"}, f"--text-field body: {extracted[1]} is read as "
                                            "plain documents, it has no fields to choose from; drop --text-field"),
        "a store in a folder not there": ({"store": str(tmp_path / "no" / "s.zarr")},
                                          f"cannot create store {tmp_path / 'no' / 's.zarr'}: its folder "
                                          f"{tmp_path / 'no'} does not exist (make it first)"),
        "a device that is none": ({"device": "gpu"}, "--device 'gpu': use auto, cpu, cuda or cuda:N"),
        "a misspelled model": ({"model": "smollm2-13m"}, "unknown model 'smollm2-13m': not an offline name "
                               "(gemma3-270m, smollm2-135m), not a local folder or .gguf file, is not in the local "
                               "hub cache, and the hub cannot be reached (offline)"),
        "a missing GGUF file": ({"model": str(tmp_path / "m.gguf")}, f"GGUF file {tmp_path / 'm.gguf'} does not exist"),
        "a misspelled dataset": ({"dataset": "wiki-sumaries"}, "unknown dataset 'wiki-sumaries': not an offline "
                                 "corpus (wiki-summaries, python-docs), not a local file or folder, and the hub could "
                                 "not load it (it is not in the local datasets cache, and HF_HUB_OFFLINE is set)"),
        "a missing corpus file": ({"dataset": str(tmp_path / "c.txt")}, f"no such file or folder: {tmp_path / 'c.txt'}"),
        "a bad run id": ({"run": "<svg>"}, "run id '<svg>' may hold only letters, digits, '.', '_' and '-'"),
        "a negative window seed": ({"seed": "-1"}, "the window seed must be a non-negative integer, got -1"),
    }
    for case, (options, message) in expected.items():
        assert refusal(*extract_args(extracted, **options)) == message, case
    assert tree(store) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_context_longer_than_the_model_positions_is_refused_naming_the_limit(tiny_model_dir, extracted, tmp_path):
    # The tiny models' configs take 256 positions; Mistral's slides a window of 6 keys.
    store = str(tmp_path / "s.zarr")
    assert refusal(*extract_args(extracted, context_length="300", store=store)) == (
        "--context-length 300 is more than the 256 positions " f"{extracted[0]} takes; use --context-length 256 or less")
    mistral = str(tiny_model_dir("mistral"))
    assert refusal(*extract_args(extracted, model=mistral, context_length="257", store=store)) == (
        f"--context-length 257 is more than the 256 positions {mistral} takes (its sliding window of 6 keys "
        "bounds its local layers' attention, not the positions); use --context-length 256 or less")
    # An offline name: the limit from its GGUF header, read from the pieces its package ships.
    assert refusal(*extract_args(extracted, model="gemma3-270m", context_length="40000", store=store)) == (
        "--context-length 40,000 is more than the 32,768 positions gemma3-270m takes (its sliding window of "
        "512 keys bounds its local layers' attention, not the positions); use --context-length 32768 or less")
    # A Python caller is told its keyword.
    model, corpus, _ = extracted
    with pytest.raises(ag.InputError, match=r"^context_length=300 is more than the 256 positions .* takes; "
                                            r"use context_length=256 or less$"):
        ag.extract(str(model), dataset=str(corpus), context_length=300, num_sequences=2, store=store, progress=False)
    assert not (tmp_path / "s.zarr").exists()


def test_gguf_positions_read_the_header_only(tmp_path):
    """A GGUF header written by hand (version 3, no tensors), split in two pieces at an odd byte."""
    import struct

    from attngeom.extract.positions import Positions, gguf_positions

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    entries = [
        string("general.architecture") + struct.pack("<I", 8) + string("mistral"),
        string("general.tags") + struct.pack("<IIQ", 9, 8, 2) + string("a") + string("bc"),
        string("mistral.block_count") + struct.pack("<II", 4, 3),
        string("mistral.context_length") + struct.pack("<II", 4, 4096),
        string("mistral.attention.sliding_window") + struct.pack("<II", 4, 1024),
        string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0, 1, 2),
    ]
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries)
    (tmp_path / "a").write_bytes(header[:37])
    (tmp_path / "b").write_bytes(header[37:])
    assert gguf_positions([tmp_path / "a", tmp_path / "b"]) == Positions(4096, 1024)
    (tmp_path / "c").write_bytes(header.replace(string("mistral.attention.sliding_window"),
                                                string("mistral.attention.other_number")))
    assert gguf_positions([tmp_path / "c"]) == Positions(4096, None)
    (tmp_path / "d").write_bytes(b"PK\x03\x04" + header[4:])
    with pytest.raises(ag.InputError, match="is not a GGUF file"):
        gguf_positions([tmp_path / "d"])


def test_each_reader_mistake_is_one_line(extracted, tmp_path):
    store = str(extracted[2])
    missing = str(tmp_path / "none.zarr")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for command in (["analyze"], ["taxonomy"], ["ablate", "--run", "r"], ["migrate"], ["report", "--out", "o"],
                    ["explore", "--out", "o"]):
        assert refusal(*command, "--store", missing) == f"no attngeom store at {missing}", command
    for command in (["analyze"], ["ablate"], ["explore", "--out", "o"]):
        assert refusal(*command, "--store", store, "--run", "q") == f"no run 'q' in {store} (runs: r)", command
    assert refusal("analyze", "--store", store, "--seed", "-1") == (
        "--seed -1: the seed of the random-N control is a non-negative integer")
    assert refusal("analyze", "--store", store, "--scheduler", "bogus") == (
        "--scheduler 'bogus': use threads, processes, or a Dask scheduler's address (tcp://host:8786)")
    assert refusal("analyze", "--store", store, "--out", str(afile / "t")) == (
        f"--out {afile / 't'} cannot be made a folder (Not a directory)")
    assert refusal("demo", "-S", "1", "--out", str(tmp_path / "demo")) == (
        "the demo needs at least 2 sequences (got -S 1): analyze compares sequences")
    result = CliRunner().invoke(main, ["validate", "--store", missing])
    assert (result.exit_code, result.output) == (1, f"no Zarr store at {missing}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_remote_store_that_cannot_be_reached_is_one_line(tmp_path):
    """S3 without credentials: refused before any request is sent (no network)."""
    pytest.importorskip("s3fs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=os.pathsep.join(sys.path))
    for command in (["validate"], ["analyze"], ["report", "--out", str(tmp_path / "r")]):
        done = subprocess.run([sys.executable, "-m", "attngeom.cli", *command, "--store", "s3://no-bucket/x.zarr"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (2, ""), (command, done.stderr)
        assert done.stderr == ("attngeom: error: cannot read the store s3://no-bucket/x.zarr: NoCredentialsError: "
                               "Unable to locate credentials\n"), command


def test_refusals_come_before_the_model_and_heavy_libraries_load(extracted, tmp_path):
    """In a fresh interpreter: each refusal is made with none of torch, transformers, Dask,
    numba, xarray, pandas, zarr or datasets imported; a rerun with other parameters than its
    run holds, and a run with nothing to do, without torch or transformers (the store's
    package checks that the store may be written first)."""
    store = str(extracted[2])
    cases = [
        extract_args(extracted, queries="every:0"),
        extract_args(extracted, model="smollm2-13m"),
        extract_args(extracted, dataset="wiki-sumaries"),
        extract_args(extracted, context_length="300", store=str(tmp_path / "new.zarr")),
        ["analyze", "--store", str(tmp_path / "none.zarr")],
        ["analyze", "--store", store, "--scheduler", "bogus"],
        ["ablate", "--store", store, "--run", "q"],
        ["report", "--store", str(tmp_path / "none.zarr"), "--out", str(tmp_path / "r")],
        ["validate", "--store", str(tmp_path / "none.zarr")],
        ["demo", "-S", "1", "--out", str(tmp_path / "demo")],
    ]
    answers = [[code, heavy] for code, _, heavy in cli_in_fresh_process(cases)]
    assert answers == [[1 if args[0] == "validate" else 2, []] for args in cases], list(zip(cases, answers))

    reruns = [extract_args(extracted, context_length="12"), extract_args(extracted)]
    answers = [[code, heavy] for code, _, heavy in cli_in_fresh_process(reruns)]
    assert [code for code, _ in answers] == [2, 0], answers
    assert all("torch" not in heavy and "transformers" not in heavy for _, heavy in answers), answers


def test_an_analyze_with_nothing_to_do_loads_neither_dask_nor_xarray_nor_the_kernels(extracted, tmp_path):
    """In a fresh interpreter, an analyze of a run analyzed already answers from the records
    with zarr alone; a damaged committed sequence is refused there as the runner refuses it;
    a lost analysis object, or a sequence more to analyze, loads the rest and writes it."""
    store = tmp_path / "s.zarr"
    shutil.copytree(extracted[2], store)
    ag.analyze(str(store), run_id="r", scheduler="threads", progress=False)
    analyze = ["analyze", "--store", str(store), "--no-progress"]
    answers = cli_in_fresh_process([analyze])
    assert [(code, heavy) for code, _, heavy in answers] == [(0, ["zarr"])], answers
    assert answers[0][1].startswith("run r: 0 new sequences (2 analyzed), "), answers

    values = store / "runs" / "r" / "values" / "c" / "1" / "0" / "0" / "0" / "0"
    kept = values.read_bytes()
    values.write_bytes(b"")
    recover = (f"run `attngeom validate --store {store} --deep --repair` to uncommit sequence 1, then the run's "
               f"extract command again to rewrite it")
    answers = cli_in_fresh_process([analyze])
    assert answers == [(2, f"attngeom: error: run r: committed sequence 1: its 'values' chunk is empty (0 bytes); "
                           f"{recover}\n", ["zarr"])], answers
    values.write_bytes(kept)

    (store / "runs" / "r" / "analysis" / "heads" / "regime" / "c.0.0").unlink()
    code, output, heavy = cli_in_fresh_process([analyze])[0]
    assert code == 0 and "rewrote the damaged analysis: runs/r/analysis/heads/regime/c.0.0 is missing" in output, output
    assert {"dask", "numba", "xarray"} <= set(heavy), heavy
    assert cli_in_fresh_process([analyze])[0][2] == ["zarr"]

    import zarr

    flags = zarr.open_array(store / "runs" / "r" / "complete", mode="r+")
    flags[1] = 0
    ag.analyze(str(store), run_id="r", scheduler="threads", progress=False)  # the first sequence alone
    flags[1] = 1
    code, output, heavy = cli_in_fresh_process([analyze])[0]
    assert code == 0 and output.startswith("run r: 1 new sequences (2 analyzed), "), output
    assert {"dask", "numba", "xarray"} <= set(heavy), heavy


def test_a_finished_run_is_answered_from_the_store_and_the_demo_says_so(extracted, monkeypatch, tmp_path):
    """A rerun with every sequence committed writes nothing and loads no model; the demo names
    the steps that had nothing to do."""
    from attngeom import api, demo
    from attngeom.extract import writing

    model, corpus, store = extracted
    before = tree(store)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(writing, "model", no_model)
    result = CliRunner().invoke(main, extract_args(extracted))
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"run r: wrote 0 sequences in \d+\.\d s; the run holds 2 committed of 2\n", result.output)
    assert {k: v for k, v in tree(store).items() if not k.endswith("zarr.json")} == {
        k: v for k, v in before.items() if not k.endswith("zarr.json")}

    # The demo on the tiny model, its later steps stood in for: they are the analysis's own tests'.
    monkeypatch.setattr(demo, "DEMO_MODEL", str(model))
    monkeypatch.setattr(demo, "DEMO_DATASET", str(corpus))
    analyzed = types.SimpleNamespace(new_sequences=0, sequences=2, recomputed=None, healed=None)
    monkeypatch.setattr(api, "analyze", lambda *a, **k: analyzed)
    monkeypatch.setattr(demo, "store_summary", lambda *a: "(summary)")
    monkeypatch.setattr(demo, "analysis_table", lambda *a: "(table)")
    monkeypatch.setattr(api, "ablate", lambda *a, **k: (_ for _ in ()).throw(ag.InputError("stop here")))
    out = tmp_path / "demo"
    out.mkdir()
    shutil.copytree(store, out / "store.zarr")
    default = f"{Path(str(model)).name}__{Path(str(corpus)).name}__L16"
    (out / "store.zarr" / "runs" / "r").rename(out / "store.zarr" / "runs" / default)
    result = CliRunner().invoke(main, ["demo", "-S", "2", "-L", "16", "--out", str(out)])
    lines = result.output.splitlines()
    assert lines[1] == f"extract: nothing to do, 2 sequences already in {out / 'store.zarr'}", lines
    assert f"analyze: nothing to do, the 2 sequences of run {default} are analyzed already" in lines, lines
    assert (result.exit_code, lines[-1]) == (2, "attngeom: error: stop here")


def test_a_finished_run_over_a_changed_corpus_is_not_answered_from_its_record(extracted, tmp_path):
    model, corpus, _ = extracted
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    store = tmp_path / "s.zarr"
    args = extract_args(extracted, dataset=str(copy), store=str(store))
    assert CliRunner().invoke(main, args).exit_code == 0
    with (copy / "doc00.txt").open("a") as f:
        f.write(" w1")
    assert refusal(*args) == (f"run 'r' in {store} differs from this command: the documents of --dataset {copy} "
                              "changed since the run read them; give the run's values to continue it, or another --run")


def test_run_ids_are_readable_and_match_the_pattern_the_store_checks():
    """Known answers: the last part of each path, other characters as '-', and every id one
    the store's pattern accepts."""
    from attngeom.store.objects.preflight import RUN_ID_PATTERN, default_run_id

    expected = {("gemma3-270m", "wiki-summaries", 128): "gemma3-270m__wiki-summaries__L128",
                ("/m/x.gguf", "/data/notes/", 16): "x.gguf__notes__L16",
                ("a b", "ü/", 2): "a-b__x__L2"}
    for names, run_id in expected.items():
        assert default_run_id(*names) == run_id
        assert RUN_ID_PATTERN.match(run_id)
    assert not RUN_ID_PATTERN.match("a b") and not RUN_ID_PATTERN.match("runs/x")


def test_a_text_field_a_file_lacks_is_refused_with_the_fields_there_are(extracted, tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"title": "a", "body": "w1 w2"}\n')
    store = str(tmp_path / "s.zarr")
    assert refusal(*extract_args(extracted, dataset=str(corpus), store=store)) == (
        f"--text-field text: {corpus} has no such field (fields: title, body); pick one with --text-field")
    assert refusal(*extract_args(extracted, dataset="wiki-summaries", text_field="body", store=store)) == (
        "--text-field body: wiki-summaries is read as plain documents, it has no fields to choose from; "
        "drop --text-field")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


@pytest.fixture(scope="module")
def moved(tiny_model_dir, word_corpus, tmp_path_factory):
    """(store, the model folder now): run m of 2 sequences and run one of 1, extracted from a
    copy of the tiny llama that was then moved."""
    from attngeom.extract.pipeline import ExtractRequest, extract

    base = tmp_path_factory.mktemp("moved")
    shutil.copytree(tiny_model_dir("llama"), base / "before")
    store = base / "s.zarr"
    for run_id, count in (("m", 2), ("one", 1)):
        extract(ExtractRequest(model=str(base / "before"), dataset=str(word_corpus), context_length=16,
                               num_sequences=count, store=str(store), run_id=run_id, progress=False))
    (base / "before").rename(base / "now")
    return store, base / "now"


def test_ablate_and_detect_refusals_come_in_one_line_before_torch_loads(moved, tiny_model_dir, tmp_path):
    store, now = (str(x) for x in moved)
    run = ["--store", store, "--run", "m"]
    expected = {
        ("ablate", *run, "--retention", "1.5,-1"): "--retention 1.5,-1.0: each fraction of heads kept is above 0 "
                                                   "and at most 1, e.g. 1.0,0.75,0.5",
        ("ablate", *run, "--retention", "1,0"): "--retention 0.0: each fraction of heads kept is above 0 and at most "
                                                "1, e.g. 1.0,0.75,0.5",
        ("ablate", *run, "--model", now, "--retention", "0.1"): "--retention 0.1 keeps no head of a layer of 4 (its "
                                                                "fraction of heads, rounded); the smallest fraction "
                                                                "keeping one is 0.125",
        ("ablate", *run, "--model", now, "--protect", "99.99"): "--protect 99.99: the run has layers 0-2 and heads "
                                                                "0-3",
        ("ablate", *run, "--seed", "3", "--random-masks", "0"): "--seed 3 seeds the random masks, and --random-masks "
                                                                "0 asks for none: drop --seed, or ask for random masks",
        ("ablate", *run, "--device", "gpu"): "--device 'gpu': use auto, cpu, cuda or cuda:N",
        ("detect", *run, "--device", "gpu"): "--device 'gpu': use auto, cpu, cuda or cuda:N",
        ("ablate", *run): f"run 'm' was extracted from '{Path(now).parent / 'before'}', which is not there any more: "
                          "give --model with where it is now (a name, a .gguf file, a folder or a hub id)",
        ("detect", *run, "--model", str(tmp_path / "gone")): f"unknown model '{tmp_path / 'gone'}': not an offline "
                                                             "name (gemma3-270m, smollm2-135m), not a local folder or "
                                                             ".gguf file, is not in the local hub cache, and the hub "
                                                             "cannot be reached (offline)",
        ("detect", *run, "--model", str(tiny_model_dir("qwen2"))): f"model {tiny_model_dir('qwen2')} is not the "
                                                                   "model of run 'm': its architecture qwen2 (the "
                                                                   "run's: llama)",
        ("detect", "--store", store, "--run", "one", "--model", now, "--needle-length", "4"): "run 'one' needs at least 2 complete sequences "
                                                                      "(a haystack and another window for its "
                                                                      "needle); it has 1",
        ("ablate", "--store", store, "--run", "one", "--model", now): "run 'one' needs at least 2 complete sequences "
                                                                      "(an importance and an evaluation split); it "
                                                                      "has 1",
    }
    cases = [list(args) for args in expected]
    answers = cli_in_fresh_process(cases)
    for (args, message), (code, output, heavy) in zip(expected.items(), answers):
        assert (code, output) == (2, f"attngeom: error: {message}\n"), args
        assert "torch" not in heavy and "transformers" not in heavy, (args, heavy)


def test_a_moved_model_is_found_again_with_model(moved):
    store, now = (str(x) for x in moved)
    result = CliRunner().invoke(main, ["ablate", "--store", store, "--run", "m", "--model", now, "--device", "cpu",
                                       "--retention", "1.0,0.5", "--random-masks", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    # Said once, as one line: the run has no analysis.
    assert result.output.count("type-guided sparsification skipped") == 1, result.output
    assert "Loading weights" not in result.output
    result = CliRunner().invoke(main, ["detect", "--store", store, "--run", "m", "--model", now, "--device", "cpu",
                                       "--needle-length", "4", "--probes", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == (
        "  retrieval: 2 haystacks, all the run's committed windows (--haystacks 16 asked for more)")
    assert "Loading weights" not in result.output


def test_a_warning_is_one_line_said_once_naming_its_library():
    import warnings

    from attngeom.cli import _Group

    @click.group(cls=_Group)
    def group() -> None:
        """A group with one command that warns as a library and as attngeom, twice each."""

    @group.command()
    def noisy() -> None:
        for _ in range(2):
            warnings.warn_explicit("Data has no positive values,\n and therefore cannot be log-scaled.", UserWarning,
                                   "/venv/lib/python3.11/site-packages/matplotlib/axes/_base.py", 10)
            warnings.warn_explicit("type-guided sparsification skipped: no head regimes", ag.AttngeomWarning,
                                   "/repo/attngeom/ablate/stage.py", 20)

    result = CliRunner().invoke(group, ["noisy"])
    assert result.output == (
        "attngeom: warning: matplotlib: Data has no positive values, and therefore cannot be log-scaled.\n"
        "attngeom: warning: type-guided sparsification skipped: no head regimes\n")


def test_what_a_folder_or_a_stores_records_tell_is_answered_before_any_library_loads(tmp_path):
    """In a fresh interpreter, with none of torch, transformers, Dask, numba, xarray, pandas,
    zarr or datasets imported: L beyond a GPT-2 folder's positions (``n_positions``, not
    ``max_position_embeddings``), check-model on a folder that is no model and on a store,
    and analyze's --n-grid outside 1..L-1 of the run's record."""
    import json

    from attngeom.extract.synthetic import write_synthetic_run

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 256, "n_layer": 3,
                                                  "n_embd": 64, "n_head": 4, "vocab_size": 100}))
    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "syn", n_seq=2, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    cases = {
        ("extract", "--model", str(gpt2), "--dataset", "wiki-summaries", "-L", "300", "-S", "2", "--store",
         str(tmp_path / "new.zarr")):
            f"--context-length 300 is more than the 256 positions {gpt2} takes; use --context-length 256 or less",
        ("check-model", str(gpt2), "-L", "300"):
            f"--length 300 is more than the 256 positions {gpt2} takes; use --length 256 or less",
        ("check-model", str(tmp_path)): f"model folder {tmp_path} has no config.json",
        ("check-model", str(store)):
            f"{store} is a Zarr store (an attngeom store?), not a model folder: it has no config.json",
        ("analyze", "--store", str(store), "--n-grid", "0,2"): "--n-grid must hold sizes 1 <= N < L = 8 (run 'syn')",
        ("analyze", "--store", str(store), "--run", "syn", "--n-grid", "1,200"):
            "--n-grid must hold sizes 1 <= N < L = 8 (run 'syn')",
    }
    answers = cli_in_fresh_process([list(args) for args in cases])
    assert answers == [(2, f"attngeom: error: {line}\n", []) for line in cases.values()], answers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "s.zarr"]
    # From Python, in a keyword's words.
    with pytest.raises(ag.InputError, match=r"^length=300 is more than the 256 positions .* takes; use length=256 or less$"):
        ag.check_model(str(gpt2), length=300)


@pytest.mark.needs_model
def test_a_librarys_logged_warning_is_the_tools_warning_line():
    """transformers logs its warnings through a handler of its own, added as it loads
    ("[transformers] ..."): within a command each is one `attngeom: warning: transformers:`
    line, said once, whether transformers loads during the command or before it; after the
    command its own handler speaks again."""
    script = (
        "import logging\n"
        "import click\n"
        "from attngeom.cli import _Group\n"
        "@click.group(cls=_Group)\n"
        "def group():\n"
        "    pass\n"
        "@group.command()\n"
        "def noisy():\n"
        "    from transformers.utils import logging as transformers_logging\n"
        "    for _ in range(2):\n"
        "        transformers_logging.get_logger('transformers.models.x').warning('a config\\n  says so')\n"
        "for _ in range(2):\n"
        "    group(['noisy'], standalone_mode=False)\n"
        "logging.getLogger('transformers.models.x').warning('after')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["attngeom: warning: transformers: a config says so"] * 2 + [
        "[transformers] after"], done.stderr
