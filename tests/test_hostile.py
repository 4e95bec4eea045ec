"""A store someone else made, read as a careful collaborator would: metadata that contradicts
the store's own records (an absurd shape, a non-UTF-8 byte, an unknown codec), links that
lead outside the store, folders under ``runs/`` that are no run. Every command names them in
one line (validate: exit 1, the others: exit 2), with no traceback, and nothing is written
outside the store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from conftest import cli_in_fresh_process

import attngeom as ag
from attngeom.cli import main
from attngeom.errors import DamagedStoreError, ForeignFileError
from attngeom.store import validate_store
from attngeom.extract.synthetic import write_synthetic_run


def cli(*args: str) -> tuple[int, list[str]]:
    """The CLI on ``args``: (exit code, output lines)."""
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output.strip().splitlines()


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory) -> Path:
    """A synthetic run of 4 sequences, analyzed."""
    url = tmp_path_factory.mktemp("hostile") / "s.zarr"
    write_synthetic_run(str(url), "syn", n_seq=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    code, lines = cli("analyze", "--store", str(url), "--no-progress")
    assert code == 0, lines
    return url


def declare_length(store: Path, key: str, length: int) -> None:
    """The array ``key`` declared ``length`` long along its first dimension, in its zarr.json
    and the consolidated copy alike."""
    meta = json.loads((store / key / "zarr.json").read_text())
    meta["shape"][0] = length
    (store / key / "zarr.json").write_text(json.dumps(meta))
    root = json.loads((store / "zarr.json").read_text())
    root["consolidated_metadata"]["metadata"][key]["shape"][0] = length
    (store / "zarr.json").write_text(json.dumps(root))


def absurd_shape(store: Path, name: str = "values") -> str:
    """``name`` 10**12 sequences long, in its zarr.json and the consolidated copy alike."""
    declare_length(store, f"runs/syn/{name}", 10**12)
    if name == "complete":
        return "run syn: array 'complete' has shape (1000000000000,), expected (4,)"
    return "run syn: array 'values' has shape (1000000000000, 2, 1, 8, 4), expected (4, 2, 1, 8, 4)"


def not_utf8(store: Path) -> str:
    """A byte that is no UTF-8 inside a string of the run's zarr.json."""
    path = store / "runs" / "syn" / "zarr.json"
    raw = path.read_bytes()
    at = raw.index(b'"model"') + 2
    path.write_bytes(raw[:at] + b"\xff" + raw[at:])
    return "runs/syn/zarr.json is empty or truncated (unreadable JSON)"


def unknown_codec(store: Path) -> str:
    """A codec no zarr knows in an array's metadata (and the consolidated copy)."""
    key = "runs/syn/values"
    for path, get in ((store / key / "zarr.json", lambda m: m),
                      (store / "zarr.json", lambda m: m["consolidated_metadata"]["metadata"][key])):
        meta = json.loads(path.read_text())
        get(meta)["codecs"][0]["name"] = "no_such_codec"
        path.write_text(json.dumps(meta))
    return "runs/syn/values/zarr.json is not an array this attngeom reads (UnknownCodecError"


def absurd_run(store: Path) -> str:
    """Every per-sequence array of the run 10**15 sequences long, the flags included: the
    arrays agree with each other, and no machine holds their flags."""
    root = json.loads((store / "zarr.json").read_text())
    for folder in (store / "runs" / "syn").iterdir():
        meta = json.loads((folder / "zarr.json").read_text()) if folder.is_dir() else {}
        if (meta.get("dimension_names") or [None])[0] == "seq":
            meta["shape"][0] = 10**15
            (folder / "zarr.json").write_text(json.dumps(meta))
            root["consolidated_metadata"]["metadata"][f"runs/syn/{folder.name}"]["shape"][0] = 10**15
    (store / "zarr.json").write_text(json.dumps(root))
    return "run syn: its arrays declare 1,000,000,000,000,000 sequences, whose commit flags and indices every reader"


def absurd_coordinate(store: Path) -> str:
    """The ``pos`` coordinate 10**12 positions long (a coordinate is read whole)."""
    declare_length(store, "runs/syn/pos", 10**12)
    return "run syn: array 'pos' has shape (1000000000000,), expected (8,)"


def absurd_layout(store: Path) -> str:
    """The run's layout and every array with a layer dimension claiming 10**12 layers: the
    arrays agree with the layout, whose own list of windows does not."""
    root = json.loads((store / "zarr.json").read_text())
    run = json.loads((store / "runs" / "syn" / "zarr.json").read_text())
    for meta in (run, root["consolidated_metadata"]["metadata"]["runs/syn"]):
        meta["attributes"]["attngeom"]["layout"]["n_layers"] = 10**12
    (store / "runs" / "syn" / "zarr.json").write_text(json.dumps(run))
    for folder in (store / "runs" / "syn").iterdir():
        meta = json.loads((folder / "zarr.json").read_text()) if folder.is_dir() else {}
        if "layer" in (meta.get("dimension_names") or []):
            at = meta["dimension_names"].index("layer")
            meta["shape"][at] = 10**12
            (folder / "zarr.json").write_text(json.dumps(meta))
            root["consolidated_metadata"]["metadata"][f"runs/syn/{folder.name}"]["shape"][at] = 10**12
    (store / "zarr.json").write_text(json.dumps(root))
    return "run syn: its layout's n_layers is 1,000,000,000,000, but its 'window' lists 2"


HOSTILE = {
    "absurd shape": absurd_shape,
    "absurd flags": lambda store: absurd_shape(store, "complete"),
    "absurd run": absurd_run,
    "absurd coordinate": absurd_coordinate,
    "absurd layout": absurd_layout,
    "not UTF-8": not_utf8,
    "unknown codec": unknown_codec,
}
COMMANDS = ["validate", "validate --deep", "analyze", "report", "explore", "api"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_metadata_is_one_line_everywhere(analyzed, tmp_path, hostile, command):
    store = tmp_path / "s.zarr"
    shutil.copytree(analyzed, store)
    expected = HOSTILE[hostile](store)
    if command == "api":
        with pytest.raises(DamagedStoreError) as caught:
            ag.open_store(store).run("syn").dataset()
        assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
        return
    name, *flags = command.split()
    out = {"report": ["--out", str(tmp_path / "report")], "explore": ["--out", str(tmp_path / "page")]}.get(name, [])
    progress = ["--no-progress"] if name in ("analyze", "explore") else []
    code, lines = cli(name, "--store", str(store), *flags, *out, *progress)
    assert not any("Traceback" in line for line in lines), lines
    if name == "validate":
        assert code == 1 and any(line.startswith(expected) for line in lines), lines
        return
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"attngeom: error: {expected}"), lines


def test_a_link_leading_outside_the_store_is_refused_before_any_write(analyzed, tmp_path):
    """A run folder linked to another store's run: analyze, repair and extract refuse it in
    one line (exit 2) and the other store is left as it was; validate names the link. A
    link inside a run's chunk grid is refused the same way."""
    victim, store = tmp_path / "victim.zarr", tmp_path / "shared.zarr"
    write_synthetic_run(str(victim), "syn", n_seq=2, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    shutil.copytree(analyzed, store)
    before = sorted(p.relative_to(victim) for p in victim.rglob("*"))
    (store / "runs" / "evil").symlink_to(victim / "runs" / "syn")
    line = (f"runs/evil in {store} is a link to {victim / 'runs' / 'syn'}, outside the store; attngeom reads "
            f"and writes nothing outside a store's folder: replace the link by a copy of what it leads to, or remove it")
    for args in (["analyze", "--no-progress"], ["analyze", "--run", "evil", "--no-progress"],
                 ["validate", "--deep", "--repair"]):
        assert cli(args[0], "--store", str(store), *args[1:]) == (2, [f"attngeom: error: {line}"])
    assert line in validate_store(str(store))
    assert sorted(p.relative_to(victim) for p in victim.rglob("*")) == before

    (store / "runs" / "evil").unlink()
    grid = store / "runs" / "syn" / "winner" / "c" / "3"
    shutil.rmtree(grid)
    grid.symlink_to(victim / "runs" / "syn" / "winner" / "c" / "1")
    code, lines = cli("analyze", "--store", str(store), "--no-progress")
    assert code == 2 and lines[0].startswith("attngeom: error: runs/syn/winner/c/3 in "), lines
    assert any(p.startswith("runs/syn/winner/c/3 in ") for p in validate_store(str(store)))
    assert sorted(p.relative_to(victim) for p in victim.rglob("*")) == before


def test_a_folder_that_is_no_run_is_named_and_never_read(analyzed, tmp_path):
    """A copy of a run under a name run ids cannot have: validate names it; readers list
    and read only the run ids."""
    store = tmp_path / "s.zarr"
    shutil.copytree(analyzed, store)
    shutil.copytree(store / "runs" / "syn", store / "runs" / "<svg onload=alert(1)>")
    problems = validate_store(str(store))
    assert ("runs/<svg onload=alert(1)> is no run: run ids are letters, digits, '.', '_' and '-' (the group is "
            "not read); rename or remove it") in problems
    assert ag.open_store(store).runs == ["syn"]
    code, lines = cli("analyze", "--store", str(store), "--no-progress")
    assert code == 0 and all("svg" not in line for line in lines), lines


def test_a_scheduler_nobody_answers_is_one_line(analyzed, tmp_path):
    """A well-formed scheduler address where nothing listens: one line, exit 2, and nothing
    more at the interpreter's exit (no "Exception ignored in Client.__del__" from the client
    that failed to connect)."""
    done = subprocess.run([sys.executable, "-c", "import sys; from attngeom.cli import main; main(sys.argv[1:])",
                           "analyze", "--store", str(analyzed), "--scheduler", "tcp://127.0.0.1:1", "--no-progress"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "attngeom: error: cannot reach the Dask scheduler at tcp://127.0.0.1:1 (Timed out trying to connect to "
        "tcp://127.0.0.1:1 after 10 s)"], done.stderr


def link_to_device(store: Path) -> str:
    """The tokens chunk of sequence 3 a link to /dev/zero, which never ends."""
    chunk = store / "runs" / "syn" / "tokens" / "c" / "3" / "0"
    chunk.unlink()
    chunk.symlink_to("/dev/zero")
    return (f"runs/syn/tokens/c/3/0 in {store} is a link to /dev/zero, outside the store; attngeom reads and writes "
            f"nothing outside a store's folder: replace the link by a copy of what it leads to, or remove it")


def named_pipe(store: Path) -> str:
    """The tokens chunk of sequence 3 a named pipe, which a reader would wait on for ever."""
    chunk = store / "runs" / "syn" / "tokens" / "c" / "3" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    return (f"runs/syn/tokens/c/3/0 in {store} is a named pipe, not a file a store holds; attngeom reads only "
            f"regular files: remove it")


@pytest.mark.parametrize("foreign", [link_to_device, named_pipe])
def test_a_chunk_that_is_no_file_of_the_store_is_named_and_never_read(analyzed, tmp_path, foreign):
    """A tokens chunk that is a link to a device, or a named pipe: validate (plain and deep)
    names it, explore and the Python API refuse it in one line, by kind; none reads it."""
    store = tmp_path / "s.zarr"
    shutil.copytree(analyzed, store)
    line = foreign(store)
    for deep in ([], ["--deep"]):
        code, lines = cli("validate", "--store", str(store), *deep)
        assert code == 1 and line in lines, lines
    code, lines = cli("explore", "--store", str(store), "--out", str(tmp_path / "page"), "--no-progress")
    assert (code, lines) == (2, [f"attngeom: error: {line}"])
    with pytest.raises(ForeignFileError) as caught:
        ag.open_store(store).run("syn").dataset()["tokens"].values
    assert str(caught.value) == line


def test_a_run_record_linked_to_a_device_is_refused_before_any_library_loads(analyzed, tmp_path):
    """The first look at a store (a run's record, read before zarr loads) keeps the same rule."""
    store = tmp_path / "s.zarr"
    shutil.copytree(analyzed, store)
    record = store / "runs" / "syn" / "zarr.json"
    record.unlink()
    record.symlink_to("/dev/zero")
    line = (f"runs/syn/zarr.json in {store} is a link to /dev/zero, outside the store; attngeom reads and writes "
            f"nothing outside a store's folder: replace the link by a copy of what it leads to, or remove it")
    answers = cli_in_fresh_process([["analyze", "--store", str(store), "--run", "syn", "--n-grid", "1,2"]])
    assert answers == [(2, f"attngeom: error: {line}\n", [])], answers
    code, lines = cli("validate", "--store", str(store))
    assert code == 1 and line in lines, lines


def test_report_tables_escape_what_a_strangers_store_holds(analyzed, tmp_path):
    """A model id made of markup, a column break, a line break and a formula: the Markdown
    table escapes it (as index.html does), the CSV quotes it and keeps it from running as a
    formula; read back, the CSV holds the id as written after the leading apostrophe."""
    store = tmp_path / "s.zarr"
    shutil.copytree(analyzed, store)
    hostile = '=HYPERLINK("http://x")|<script>alert(1)</script>\n`rm -rf`'
    for path, get in ((store / "runs" / "syn" / "zarr.json", lambda m: m),
                      (store / "zarr.json", lambda m: m["consolidated_metadata"]["metadata"]["runs/syn"])):
        meta = json.loads(path.read_text())
        get(meta)["attributes"]["attngeom"]["model"]["id"] = hostile
        path.write_text(json.dumps(meta))
    out = tmp_path / "report"
    assert cli("report", "--store", str(store), "--out", str(out))[0] == 0
    row = (out / "models.md").read_text().splitlines()[2]
    assert ('| =HYPERLINK("http://x")\\|&lt;script&gt;alert(1)&lt;/script&gt; \\`rm -rf\\` |' in row), row
    columns = (out / "models.md").read_text().splitlines()[0].count("|")
    assert "<" not in row and row.replace("\\|", "").count("|") == columns, row
    raw = (out / "models.csv").read_text()
    assert '"\'=HYPERLINK(""http://x"")|<script>alert(1)</script>\n`rm -rf`"' in raw, raw
    assert pd.read_csv(out / "models.csv")["model"].tolist() == ["'" + hostile]


def model_folder(folder: Path, config: dict, weights: bytes | None = None) -> Path:
    """A model folder holding ``config`` as its config.json and, if given, ``weights`` as its
    model.safetensors."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


LLAMA = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 256}


def safetensors_file(data_bytes: int, claimed: int = 16) -> bytes:
    """A safetensors file of one float32 tensor of ``claimed`` bytes, holding ``data_bytes``."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [claimed // 4], "data_offsets": [0, claimed]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(data_bytes)


def test_a_hostile_model_folder_is_refused_in_one_line_before_any_library_loads(tmp_path):
    """Counts a config.json declares beyond what this machine could hold, or that are no
    counts, and a safetensors file that is not whole: extract and check-model refuse them in
    one line, in a fresh interpreter with none of torch, transformers or zarr imported."""
    huge = model_folder(tmp_path / "huge", dict(LLAMA, num_hidden_layers=10**12))
    wide = model_folder(tmp_path / "wide", dict(LLAMA, num_hidden_layers=10**6, hidden_size=10**6))
    text = model_folder(tmp_path / "text", dict(LLAMA, num_hidden_layers="3"))
    truncated = model_folder(tmp_path / "truncated", LLAMA, safetensors_file(10))
    junk = model_folder(tmp_path / "junk", LLAMA, b"not a safetensors file")
    store = str(tmp_path / "s.zarr")
    cases = {
        huge: (f"the config of {huge} declares 1,000,000,000,000 layers, more than this machine's "),
        wide: (f"the config of {wide} declares 1,000,000 layers of hidden size 1,000,000: at least 1.73 EiB of "
               "weights, more than this machine's memory and free disk ("),
        text: f"the config of {text} declares num_hidden_layers = '3', which is no count of anything",
        truncated: (f"{truncated / 'model.safetensors'} is truncated: its tensors take 16 bytes, the file holds 10 "
                    "after its header; download or save the model again"),
        junk: (f"{junk / 'model.safetensors'} is truncated or no safetensors file: its header claims "
               f"{int.from_bytes(b'not a sa', 'little'):,} bytes, the file holds 22"),
    }
    commands = [["extract", "--model", str(folder), "--dataset", "wiki-summaries", "-L", "16", "-S", "1",
                 "--store", store] for folder in cases] + [["check-model", str(folder)] for folder in cases]
    answers = cli_in_fresh_process(commands)
    for (code, output, heavy), line in zip(answers, [*cases.values(), *cases.values()]):
        assert (code, heavy) == (2, []) and output.startswith(f"attngeom: error: {line}"), (output, line)
        assert output.count("\n") == 1, output
    assert not (tmp_path / "s.zarr").exists()


def test_weights_the_safetensors_library_cannot_read_are_one_line(tiny_model_dir, tmp_path):
    """A whole safetensors file whose header names a dtype the library does not know: the
    load's error, translated by its kind, in one line naming the model."""
    import shutil as sh

    folder = tmp_path / "model"
    sh.copytree(tiny_model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + length].replace(b'"F32"', b'"Q7 "', 1)
    weights.write_bytes(raw[:8] + header + raw[8 + length:])
    code, lines = cli("check-model", str(folder), "--device", "cpu")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"attngeom: error: the weights of {folder} cannot be read: Error while deserializing "
                               "header: "), lines
    assert lines[0].endswith("; download or save the model again"), lines
