"""A store damaged by hand: ``validate`` names each damage in one line (exit 1); every other
command meets it with one line naming the array and chunk and how to recover (exit 2);
``validate --repair`` and the run's extract command recover a damaged sequence; failing
commands leave nothing behind; and the messages around them say what is true."""

from __future__ import annotations

import errno
import gc
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import crc32c
import dask
import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from conftest import ABLATED_SEQUENCES

from attngeom.cli import main
from attngeom.store import FORMAT, SEQUENCE_ARRAYS, validate_store

S = ABLATED_SEQUENCES


@pytest.fixture
def store(ablated_store) -> Path:
    return ablated_store


def run(*args: str):
    """The CLI on ``args``: (exit code, stdout and stderr lines, without transformers' own
    weight-loading bar)."""
    result = CliRunner().invoke(main, list(args))
    output = re.sub(r"Loading weights:[^\n]*?(\r|\n|(?=run )|(?=attngeom: ))", "", result.output)
    return result.exit_code, output.strip().splitlines()


def validate(store: Path, *flags: str) -> list[str]:
    code, lines = run("validate", "--store", str(store), *flags)
    assert code == (0 if lines == [f"{store}: valid"] else 1), lines
    return [] if code == 0 else lines


def one_error(*args: str) -> str:
    """The one line an analyze/ablate/report/taxonomy meets the store with (exit 2)."""
    code, lines = run(*args)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), lines
    return lines[0]


def commands(store: Path, tmp: Path) -> dict[str, list[str]]:
    url = str(store)
    return {
        "analyze": ["analyze", "--store", url, "--no-progress"],
        "ablate": ["ablate", "--store", url, "--run", "r", "--device", "cpu", "--random-masks", "0",
                   "--retention", "1.0", "--no-progress"],
        "report": ["report", "--store", url, "--out", str(tmp / "report")],
        "taxonomy": ["taxonomy", "--store", url],
    }


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


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
