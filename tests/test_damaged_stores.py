"""Stores damaged by hand, and a good one: ``validate`` names each damage in one line (exit 1)
and says a good store is valid; every other command meets the damage with one line naming the
array and chunk and how to recover (exit 2); ``validate --repair``, the run's extract command
and analyze or ablate recover it, leaving the store equal, object for object, to an undisturbed
one; failing commands leave nothing behind, and the messages around them say what is true.
The damaged stores are copies of conftest's ablated store (run r, analyzed and ablated)."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import crc32c
import dask
import numpy as np
import pytest
import xarray as xr
import zarr
from click.testing import CliRunner
from conftest import ABLATED_SEQUENCES
from damage import analyze_cli, assert_same_tree, flip, one_error, run, validate
from stores import Run, copy_store

from attngeom.api import ablate, analyze
from attngeom.cli import main
from attngeom.store import FORMAT, SEQUENCE_ARRAYS, resize_run, validate_store
from attngeom.store.objects.schema import ANALYSIS
from attngeom.store.session import StoreSession

S = ABLATED_SEQUENCES


@pytest.fixture
def store(ablated_store) -> Path:
    return ablated_store


@pytest.fixture
def good_store(extracted_store):
    """Run r of the tiny llama: 3 sequences at L = 16."""
    return extracted_store()


@pytest.fixture
def good_copy(good_store, tmp_path):
    return copy_store(good_store, tmp_path)


# ------------------------------------------------------------------ validate on a good store and on broken ones


def test_good_store_is_valid_and_opens_with_xarray(good_store):
    assert validate(good_store) == []
    ds = xr.open_zarr(str(good_store), group="runs/r")
    assert set(ds.coords) >= {"layer", "head", "kv_head", "pos", "head_kv"}
    assert ds["head_kv"].dims == ("head",)
    assert ds["winner"].dims == ("seq", "layer", "head", "query")
    prov = ds.attrs["attngeom"]
    for key in ("model", "tokenizer", "dataset", "window_rule", "context_length", "values_dtype",
                "compute_dtype", "attention_implementation", "library_versions", "attngeom_version", "command_line"):
        assert key in prov, key
    assert prov["dataset"]["fingerprint"] and prov["model"]["file_sha256"]


def test_missing_array(good_copy):
    """An array the run's layout names, gone whole: its metadata is rebuilt from the layout by
    --repair, which then finds its sequences without their chunks (extract rewrites them)."""
    shutil.rmtree(good_copy / "runs/r/entropy")
    assert validate(good_copy) == [
        f"runs/r/entropy/zarr.json is missing (lost metadata of a run array); run `attngeom validate --store "
        f"{good_copy} --repair` to rebuild it",
        f"the root's consolidated metadata (read by xr.open_zarr) is out of date for runs/r/entropy (a writer was "
        f"interrupted); run `attngeom validate --store {good_copy} --repair` to refresh it",
    ]


def test_wrong_dtype_and_dims(good_copy):
    run = zarr.open_group(str(good_copy), path="runs/r", mode="r+", use_consolidated=False)
    shape = run["sink_attn"].shape
    run.create_array("sink_attn", shape=shape, dtype="float64", dimension_names=("seq", "layer", "head", "query"), overwrite=True)
    run.create_array("top1_attn", shape=shape, dtype="float32", dimension_names=("seq", "layer", "head", "key"), overwrite=True)
    lines = validate(good_copy)
    assert "run r: array 'sink_attn' has dtype float64, expected float32" in lines
    assert "run r: array 'top1_attn' has dims ('seq', 'layer', 'head', 'key'), expected ('seq', 'layer', 'head', 'query')" in lines


def test_bfloat16_values_without_their_encoding(tmp_path):
    """A bfloat16-valued run whose values lost the attribute naming their encoding would pass
    bit patterns off as numbers: validate names it (and the reverse)."""
    from attngeom.store import validate_store
    from attngeom.extract.synthetic import write_synthetic_run

    for values_dtype in ("bfloat16", "float32"):
        store = tmp_path / f"{values_dtype}.zarr"
        write_synthetic_run(str(store), "r", n_seq=1, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=16,
                            values_dtype=values_dtype)
        assert validate_store(str(store)) == []
        meta = store / "runs/r/values/zarr.json"
        doc = json.loads(meta.read_text())
        doc["attributes"]["attngeom"] = {} if values_dtype == "bfloat16" else {"encoding": "bfloat16"}
        meta.write_text(json.dumps(doc))
        problems = validate_store(str(store))
        named = "None" if values_dtype == "bfloat16" else "'bfloat16'"
        assert any(f"run r: array 'values' names the encoding {named}, but the run's values_dtype is "
                   f"'{values_dtype}'" in p for p in problems), problems


def test_schema_version_from_the_future(good_copy):
    meta = json.loads((good_copy / "zarr.json").read_text())
    meta["attributes"]["attngeom"]["schema_version"] = 2
    meta.pop("consolidated_metadata", None)
    (good_copy / "zarr.json").write_text(json.dumps(meta))
    (line,) = validate(good_copy)
    assert "schema version 2, newer than this attngeom" in line


def test_partly_written_and_unwritten_sequences(good_copy):
    run = zarr.open_group(str(good_copy), path="runs/r", mode="r+", use_consolidated=False)
    resize_run(run, 6)
    run["tokens"][3] = run["tokens"][0]  # an interrupted write of sequence 3: no commit flag
    shutil.rmtree(good_copy / "runs/r/values/c/1")  # a committed sequence that lost a shard
    lines = validate(good_copy)
    assert (f"run r: sequence 1 is marked complete but lacks values; run `attngeom validate --store {good_copy} --deep "
            "--repair` to uncommit sequence 1, then the run's extract command again to rewrite it") in lines
    assert any(line.startswith("run r: sequence 3 is only partly written") for line in lines)
    assert any(line.startswith("run r: sequences 4-5 of 6 are not written yet") for line in lines)


def test_not_a_store(tmp_path):
    assert validate(tmp_path / "nothing") == [f"no Zarr store at {tmp_path / 'nothing'}"]
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w")
    assert validate(tmp_path / "plain.zarr") == [
        "not an attngeom store (no attngeom schema version in its root attributes)"
    ]


def test_deep_validate_names_a_corrupt_chunk(extracted_store, tmp_path):
    store = copy_store(extracted_store(Run(sequences=2)), tmp_path)
    shard = store / "runs/r/attn_last/c/1/0/0/0"
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(data)
    runner = CliRunner()
    assert runner.invoke(main, ["validate", "--store", str(store)]).exit_code == 0  # metadata is fine
    deep = runner.invoke(main, ["validate", "--deep", "--store", str(store)])
    assert deep.exit_code == 1
    (line,) = deep.output.strip().splitlines()
    assert line.startswith("array 'runs/r/attn_last' chunk c/1/0/0/0 (sequence 1) is damaged")
    assert "checksum" in line


# ------------------------------------------------------------------ damaged chunks, met by every command


def commands(store: Path, tmp: Path) -> dict[str, list[str]]:
    url = str(store)
    return {
        "analyze": ["analyze", "--store", url, "--no-progress"],
        "ablate": ["ablate", "--store", url, "--run", "r", "--device", "cpu", "--random-masks", "0",
                   "--retention", "1.0", "--no-progress"],
        "report": ["report", "--store", url, "--out", str(tmp / "report")],
        "taxonomy": ["taxonomy", "--store", url],
    }


VALUES_1 = "runs/r/values/c/1/0/0/0/0"
RECOVER_1 = "run `attngeom validate --store {url} --deep --repair` to uncommit sequence 1, then the run's extract command again to rewrite it"


def test_empty_shard_is_named_by_validate_and_refused_by_every_reader(store, tmp_path):
    (store / VALUES_1).write_bytes(b"")
    url = str(store)
    recover = RECOVER_1.format(url=url)
    assert validate(store) == [f"run r: sequence 1 is marked complete but its 'values' chunk is empty (0 bytes); {recover}"]
    assert f"array 'runs/r/values' chunk c/1/0/0/0/0 (sequence 1) is damaged (EOFError: empty, 0 bytes); {recover}" in validate(store, "--deep")
    for name in ("analyze", "ablate"):
        line = one_error(*commands(store, tmp_path)[name])
        assert line == f"attngeom: error: run r: committed sequence 1: its 'values' chunk is empty (0 bytes); {recover}"


@pytest.mark.parametrize("damage, why", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "the shard has a damaged index"),
    (lambda p: p.write_bytes(p.read_bytes()[:30]), "the shard is truncated (30 bytes, shorter than its 52-byte index)"),
    (lambda p: flip(p, 40), "checksum do not match"),
])
def test_truncated_or_corrupt_shard_is_named_by_deep_validate(store, damage, why):
    damage(store / VALUES_1)
    lines = validate(store, "--deep")
    assert len(lines) == 1, lines
    assert lines[0].startswith("array 'runs/r/values' chunk c/1/0/0/0/0 (sequence 1) is damaged") and why in lines[0]
    assert lines[0].endswith(RECOVER_1.format(url=store))


def test_shard_index_without_an_inner_chunk_is_named(store):
    """An index entry of all ones is an inner chunk never written: zarr reads fill values."""
    path = store / VALUES_1
    data = bytearray(path.read_bytes())
    n_chunks = 3
    index = bytearray(data[-(16 * n_chunks + 4) : -4])
    index[16:32] = b"\xff" * 16
    data[-(16 * n_chunks + 4) :] = index + np.uint32(crc32c.crc32c(bytes(index))).tobytes()
    path.write_bytes(bytes(data))
    assert np.all(zarr.open_array(str(store), path="runs/r/values", mode="r")[1, 1] == 0)  # silently
    (line,) = validate(store, "--deep")
    assert "(sequence 1) is damaged (ValueError: the shard lacks inner chunk 1 of 3)" in line


def test_checksum_failure_inside_analyze_names_the_chunk(store):
    """A corrupt chunk is met inside a Dask task on a worker: the client prints one line."""
    flip(store / "runs/r/attn_last/c/2/0/0/0", 40)
    line = one_error("analyze", "--store", str(store), "--no-progress")
    assert line.startswith("attngeom: error: array 'runs/r/attn_last' chunk c/2/0/0/0 (sequence 2) is damaged "
                           "(ValueError: Stored and computed checksum do not match")
    assert line.endswith(RECOVER_1.replace("1", "2").format(url=store))


def test_deleted_chunk_of_a_committed_sequence_is_refused(store, tmp_path):
    shutil.rmtree(store / "runs/r/values/c/3")
    (store / "runs/r/tokens/c/4/0").unlink()
    url = str(store)
    lines = validate(store)
    assert any(line.startswith("run r: sequence 3 is marked complete but lacks values;") for line in lines)
    assert any(line.startswith("run r: sequence 4 is marked complete but lacks tokens;") for line in lines)
    deep = validate(store, "--deep")
    assert f"array 'runs/r/tokens' chunk c/4/0 (sequence 4) is damaged (FileNotFoundError: missing); " \
           f"{RECOVER_1.replace('1', '4').format(url=url)}" in deep
    for name in ("analyze", "ablate"):
        line = one_error(*commands(store, tmp_path)[name])
        assert "run r: committed sequence 3: its 'values' chunk is missing (and 1 more sequences)" in line


@pytest.mark.parametrize("key, content", [
    ("zarr.json", b""),
    ("runs/r/attn_last/zarr.json", b'{"shape": [6, 3'),
    ("runs/r/analysis/heads/regime/zarr.json", b""),
    ("runs/r/ablation/single/zarr.json", b"{"),
])
def test_unreadable_metadata_is_one_line_everywhere(store, tmp_path, key, content):
    (store / key).write_bytes(content)
    url = str(store)
    for flags in ((), ("--deep",)):
        lines = validate(store, *flags)
        assert lines[0].startswith(f"{key} is empty or truncated (unreadable JSON); "), lines
    # Which commands read the damaged object, and what they say.
    expected, readers = {
        "zarr.json": (f"{url}: the root's zarr.json is unreadable", ("analyze", "ablate", "report", "taxonomy")),
        "runs/r/attn_last/zarr.json": ("runs/r/attn_last/zarr.json is empty or truncated", ("analyze", "ablate")),
        # Readers of a derived group compare its objects with those its commit lists.
        "runs/r/analysis/heads/regime/zarr.json": (
            "runs/r/analysis/heads/regime/zarr.json is empty (0 bytes); run `attngeom analyze",
            ("ablate", "report", "taxonomy")),
        "runs/r/ablation/single/zarr.json": (
            "runs/r/ablation/single/zarr.json is truncated (1 of ", ("report",)),
    }[key]
    for name in readers:
        line = one_error(*commands(store, tmp_path)[name])
        assert expected in line, (name, line)
    assert not (tmp_path / "report").exists()


def test_damaged_derived_chunk_is_named_with_its_stage(store, tmp_path):
    (store / "runs/r/analysis/summary/f_score/c.0.0.0.0").write_bytes(b"")
    # Named once, from the objects the analysis's commit lists (analyze sees it so too).
    assert validate(store, "--deep") == [f"runs/r/analysis/summary/f_score/c.0.0.0.0 is empty (0 bytes); "
                                         f"run `attngeom analyze --store {store} --run r` again to rewrite it"]
    code, lines = run(*commands(store, tmp_path)["analyze"], "--n-grid", "1,2,4")
    assert code == 0 and lines[-1] == ("run r: rewrote the damaged analysis: runs/r/analysis/summary/f_score/c.0.0.0.0 "
                                       "is empty (0 bytes)"), lines
    flip(store / "runs/r/ablation/single/delta_nll_mean/c.0.0", 20)
    error = one_error(*commands(store, tmp_path)["report"])
    assert error.startswith("attngeom: error: array 'runs/r/ablation/single/delta_nll_mean' chunk c.0.0 is damaged")
    assert error.endswith(f"run `attngeom ablate --store {store} --run r` again to rewrite it")
    assert not (tmp_path / "report").exists()


def test_partial_leftover_is_named_ignored_by_readers_and_removed_by_the_next_writer(store, tmp_path):
    leftover = store / "runs/zarr.0123456789abcdef.partial"
    leftover.write_bytes(b'{"zarr_format": 3')
    assert validate(store) == [
        "runs/zarr.0123456789abcdef.partial is the leftover of an interrupted write (harmless: the next "
        "extract, analyze, ablate or migrate that writes the store alone removes it), or a write in progress"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, lines = run("taxonomy", "--store", str(store))
    assert code == 0, lines
    code, lines = run(*commands(store, tmp_path)["analyze"])
    assert code == 0, lines
    assert not leftover.exists()
    assert validate(store) == []


def test_repair_then_extract_restores_the_run(store, ablated_store_source, tiny_model_dir, word_corpus):
    (store / VALUES_1).write_bytes(b"")
    flip(store / "runs/r/winner/c/4/0/0/0", 40)
    code, lines = run("validate", "--store", str(store), "--deep", "--repair")
    assert code == 1
    assert lines[0] == "run r: uncommitted damaged sequences 1, 4; run its extract command again to rewrite them"
    assert lines[1:] == [
        "run r: sequence 1 is only partly written (interrupted run; re-run the same extract command)",
        "run r: sequence 4 is only partly written (interrupted run; re-run the same extract command)",
        # The analysis and ablation built on them are named too, until extract commits them again.
        "run r: analysis covers sequences [1, 4] the run does not hold as complete",
        "run r: ablation parameter 'evaluation_sequences' names sequences [1] the run does not hold as complete",
        "run r: ablation parameter 'importance_sequences' names sequences [4] the run does not hold as complete",
    ]
    code, lines = run("extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
                      "-S", str(S), "--store", str(store), "--run", "r", "--no-progress")
    assert code == 0 and lines[-1].startswith("run r: wrote 2 sequences in ") and lines[-1].endswith(
        f"the run holds {S} committed of {S}")
    assert validate(store, "--deep") == []
    a = zarr.open_group(str(ablated_store_source), path="runs/r", mode="r")
    b = zarr.open_group(str(store), path="runs/r", mode="r")
    for name in ("values", "winner", "tokens", "attn_last", "complete"):
        np.testing.assert_array_equal(a[name][...], b[name][...], err_msg=name)


# Nothing left behind.


def test_commands_on_a_missing_store_create_nothing(tmp_path):
    for args in (["analyze", "--scheduler", "threads"], ["ablate", "--run", "r"], ["migrate"], ["taxonomy"]):
        line = one_error(*args, "--store", str(tmp_path / "nope"))
        assert line == f"attngeom: error: no attngeom store at {tmp_path / 'nope'}"
    one_error("report", "--store", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_failed_extract_leaves_no_new_store(tiny_model_dir, word_corpus, tmp_path, monkeypatch):
    """A failure after the store was created (here: a full disk at the first sequence)
    removes the store it created; one with committed sequences is kept, and its message
    counts them from the store, with or without a progress bar."""
    from attngeom.store import SequenceWriter

    write = SequenceWriter.write
    budget = {"n": 0}

    def full_disk(writer, seq, arrays):
        if budget["n"] == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["n"] -= 1
        write(writer, seq, arrays)

    monkeypatch.setattr(SequenceWriter, "write", full_disk)
    store = tmp_path / "s.zarr"
    args = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
            "-S", str(S), "--store", str(store), "--run", "r", "--no-progress"]
    line = one_error(*args)
    assert line.endswith("ran out of space after 0 of 6 sequences were committed; free space and re-run the same command")
    assert not store.exists()

    budget["n"] = 2
    line = one_error(*args)
    assert "ran out of space after 2 of 6 sequences were committed; committed sequences are kept" in line
    assert int(zarr.open_array(str(store), path="runs/r/complete", mode="r")[...].sum()) == 2


def test_ctrl_c_says_how_to_finish(store, monkeypatch):
    from attngeom.analyze import runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "analyze", interrupted)
    code, lines = run("analyze", "--store", str(store))
    assert code == 130
    assert lines == ["attngeom: interrupted; nothing of the store is lost; run the same command again to finish the analysis"]


def test_impossible_arguments_are_refused(store, tiny_model_dir, word_corpus):
    base = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
            "--store", str(store), "--run", "r", "--no-progress"]
    for shard, why in (("0/0", "0/0: the count of shards n must be at least 1"), ("2/2", "2/2: the index i must be in 0..1")):
        code, lines = run(*base, "-S", "2", "--shard", shard)
        assert code == 2 and why in lines[-1], lines
    for grid in ("", "1,,2", "1,2,"):
        code, lines = run("analyze", "--store", str(store), "--n-grid", grid)
        assert code == 2 and "has an empty entry" in lines[-1], lines
    code, lines = run(*base, "-S", "2", "--values-dtype", "float64")
    assert code == 2 and lines == ["attngeom: error: Invalid value for '--values-dtype': 'float64' is not one of "
                                   "'auto', 'float32', 'float16', 'bfloat16'. (see `attngeom extract --help`)"], lines
    before = dask.config.get("scheduler", None)
    code, lines = run("analyze", "--store", str(store), "--scheduler", "bogus://host:1")
    assert code == 2 and len(lines) == 1 and lines[0].startswith(
        "attngeom: error: cannot reach the Dask scheduler at bogus://host:1 (unknown address scheme 'bogus'"), lines
    # Neither the failed command nor the collection of its client leaves a scheduler set.
    assert dask.config.get("scheduler", None) == before
    gc.collect()
    assert dask.config.get("scheduler", None) == before
    # As a command of its own, it says that one line and nothing more at its exit.
    done = subprocess.run([sys.executable, "-c", "import sys; from attngeom.cli import main; main(sys.argv[1:])",
                           "analyze", "--store", str(store), "--scheduler", "bogus://host:1"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and done.stderr.splitlines() == lines, done.stderr
    code, lines = run("analyze", "--store", str(store), "--bogus")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("attngeom: error: No such option '--bogus'") and lines[0].endswith(
        "(see `attngeom analyze --help`)"), lines
    code, lines = run(*base, "-S", "2")
    assert code == 0 and lines == [lines[0]] and lines[0].endswith(f"the run holds {S} committed of {S}")


def test_root_json_of_a_valid_store_is_what_validate_reads(store):
    """The checks above damage a store that is valid as built."""
    assert validate(store, "--deep") == []
    assert json.loads((store / "zarr.json").read_text())["attributes"]["attngeom"]["format"] == FORMAT
    assert validate_store(str(store), deep=True) == []


def test_an_unwritable_chunk_path_is_one_line(tiny_model_dir, word_corpus, tmp_path):
    """A file where a sequence's chunk folder must go (a damaged store) stops extract with one
    line naming the path, exit 2, the earlier sequence still committed; once the path is
    repaired the same command finishes."""
    store = tmp_path / "s.zarr"
    args = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16",
            "--store", str(store), "--run", "r", "--no-progress"]
    assert run(*args, "-S", "1")[0] == 0
    blocker = store / "runs" / "r" / "values" / "c" / "1"
    blocker.write_bytes(b"")
    line = one_error(*args, "-S", "2")
    assert line.startswith(f"attngeom: error: the store cannot be written at {blocker}/")
    assert line.endswith("after 0 of 1 sequences were committed; repair that path and re-run the same command")
    assert list(zarr.open_array(str(store), path="runs/r/complete", mode="r")[...]) == [1, 0]
    blocker.unlink()
    assert run(*args, "-S", "2")[0] == 0
    assert list(zarr.open_array(str(store), path="runs/r/complete", mode="r")[...]) == [1, 1]


@pytest.fixture(scope="module")
def synthetic_source(tmp_path_factory) -> Path:
    """A synthetic run of 4 sequences holding every per-sequence array (rows at queries too)."""
    from attngeom.extract.synthetic import write_synthetic_run

    url = tmp_path_factory.mktemp("synthetic") / "s.zarr"
    write_synthetic_run(str(url), "syn", n_seq=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8,
                        queries=(3, 7))
    return url


@pytest.mark.parametrize("how", ["missing", "empty"])
# Every per-sequence array a synthetic run holds: all but the full attention matrices
# (``attn``, stored by ``extract --store-rows all`` only) and the learned sinks' weights (a
# model with learned sinks only), which are read the same way.
@pytest.mark.parametrize("name", [n for n in SEQUENCE_ARRAYS if n not in ("attn", "learned_sink_attn")])
def test_the_api_never_reads_a_lost_object_as_fill_values(synthetic_source, tmp_path, name, how):
    """A committed sequence's stored object deleted (or emptied) reads through the API as the
    damage error validate gives for it, not as the fill value; the other sequences read as
    before, and validate names the same object."""
    import attngeom as ag
    from attngeom.errors import CorruptChunkError

    store = tmp_path / "s.zarr"
    shutil.copytree(synthetic_source, store)
    before = ag.open_store(store).run("syn").dataset()[name].values
    folder = store / "runs" / "syn" / name / "c"
    victim = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).parts[0] == "2")[0]
    if how == "missing":
        victim.unlink()
    else:
        victim.write_bytes(b"")
    ds = ag.open_store(store).run("syn").dataset()
    assert ds.sizes["seq"] == 4
    np.testing.assert_array_equal(ds[name].sel(seq=[0, 1, 3]).values, before[[0, 1, 3]])
    with pytest.raises(CorruptChunkError) as caught:
        ds[name].sel(seq=2).values
    message = str(caught.value)
    key = victim.relative_to(store / "runs" / "syn" / name).as_posix()
    assert message.startswith(f"array 'runs/syn/{name}' chunk {key} (sequence 2) is damaged") and "\n" not in message
    assert message in validate_store(str(store), deep=True)
    if name == "tokens":
        with pytest.raises(CorruptChunkError):
            ag.open_store(store).run("syn").text(2, tokenizer=object())


# ------------------------------------------------------------------ derived groups, metadata and input damaged after the extract, and recovered


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
