"""Damaged metadata of every level, as validate, repair, the readers and the writers meet it:
the consolidated copy, a group's or an array's zarr.json malformed or lost, a commit record
malformed or claiming what the run does not hold, an empty group left by a full disk. Each
case: one line naming the object and what is wrong, never a traceback nor "valid"; the
command that heals it, run once; then a store equal, object for object, to an undisturbed
one, and validate saying valid (or, for what nothing rebuilds, no advice to --repair).

And a store someone else made, read as a careful collaborator would: metadata that
contradicts the store's own records (an absurd shape, a non-UTF-8 byte, an unknown codec),
links that lead outside the store, folders under ``runs/`` that are no run. Every command
names them in one line (validate: exit 1, the others: exit 2), with no traceback, and nothing
is written outside the store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import xarray as xr
from click.testing import CliRunner
from conftest import cli_in_fresh_process
from damage import analyze_cli, assert_same_tree, one_error, run, validate

import attngeom as ag
from attngeom.cli import main
from attngeom.errors import DamagedStoreError, ForeignFileError, GroupNotFoundError
from attngeom.store import validate_store
from attngeom.extract.synthetic import write_synthetic_run

A = "runs/r/analysis"


@pytest.fixture
def store(ablated_store) -> Path:
    return ablated_store


def edit(path: Path, change) -> None:
    """Rewrite the JSON document at ``path`` as ``change`` leaves it."""
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def repair(store: Path) -> list[str]:
    code, lines = run("validate", "--store", str(store), "--repair")
    return lines


def set_key(document: dict, keys: tuple[str, ...], value) -> None:
    for key in keys[:-1]:
        document = document[key]
    document[keys[-1]] = value


@pytest.mark.parametrize("keys, value, fault", [
    (("consolidated_metadata",), "x", "it is a str, not an object"),
    (("consolidated_metadata", "kind"), "bogus", "its kind is 'bogus', not 'inline'"),
    (("consolidated_metadata", "metadata"), "x", "its metadata is a str, not an object"),
    (("consolidated_metadata", "metadata", "runs/r"), 3, "its entry 'runs/r' is no node's metadata"),
], ids=["string", "kind", "metadata", "entry"])
def test_malformed_consolidated_metadata_is_named_and_rebuilt_by_repair(store, ablated_store_source, keys, value,
                                                                       fault):
    url = str(store)
    edit(store / "zarr.json", lambda d: set_key(d, keys, value))
    assert validate(store) == [f"zarr.json: the root's consolidated metadata (read by xr.open_zarr) is malformed "
                               f"({fault}); run `attngeom validate --store {url} --repair` to rebuild it"]
    assert repair(store) == ["refreshed the root's consolidated metadata", f"{url}: valid"]
    assert_same_tree(store, ablated_store_source)
    assert xr.open_zarr(url, group="runs/r").sizes["seq"] > 0


@pytest.mark.parametrize("key, field, value, fault", [
    ("runs/r/zarr.json", "attributes", "x", "its attributes are not an object"),
    ("runs/zarr.json", "attributes", [], "its attributes are not an object"),
    ("runs/r/values/zarr.json", "shape", "x", "its shape is of another type"),
    ("runs/r/tokens/zarr.json", "codecs", None, "its codecs is of another type"),
], ids=["run-group", "runs-group", "array-shape", "array-codecs"])
def test_malformed_node_metadata_is_named_and_rebuilt_by_repair(store, ablated_store_source, tmp_path, key, field,
                                                                value, fault):
    url = str(store)
    edit(store / key, lambda d: d.__setitem__(field, value))
    line = f"{key} is malformed ({fault}); run `attngeom validate --store {url} --repair` to rebuild it"
    assert line in validate(store)
    assert one_error("report", "--store", url, "--out", str(tmp_path / "page")).startswith("attngeom: error: ")
    lines = repair(store)
    assert lines[0] == f"rebuilt {key}" and lines[-1] == f"{url}: valid", lines
    assert_same_tree(store, ablated_store_source)


def test_lost_run_metadata_without_a_copy_is_said_once_and_never_sent_to_repair(store):
    """Nothing records a run's attributes once the consolidated copy is gone too: validate
    says so instead of advising --repair, which says it once and changes nothing."""
    edit(store / "zarr.json", lambda d: d.pop("consolidated_metadata"))
    (store / "runs/r/zarr.json").unlink()
    cannot = ("runs/r/zarr.json cannot be rebuilt (nothing in the store records it); restore the store from a copy, "
              "or remove runs/r and extract again")
    (line,) = validate(store)
    assert line == ("runs/r/zarr.json is missing (lost metadata of a group: nothing it holds can be reached); "
                    "it " + cannot.split(" ", 1)[1])
    assert "--repair" not in line
    assert repair(store) == [cannot, line]


def test_lost_run_metadata_is_rebuilt_from_the_consolidated_copy(store, ablated_store_source):
    (store / "runs/r/zarr.json").unlink()
    (store / "runs/r/values/zarr.json").write_bytes(b"")  # rebuilt from the run's layout, once the run's is back
    assert validate(store) == [
        f"runs/r/zarr.json is missing (lost metadata of a group: nothing it holds can be reached); "
        f"run `attngeom validate --store {store} --repair` to rebuild it",
        f"runs/r/values/zarr.json is empty or truncated (unreadable JSON); "
        f"run `attngeom validate --store {store} --repair` to rebuild it"]
    assert repair(store)[:2] == ["rebuilt runs/r/zarr.json", "rebuilt runs/r/values/zarr.json"]
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


@pytest.mark.parametrize("name", ["values", "attn_last", "head_kv"])
def test_a_lost_run_array_metadata_is_rebuilt_from_the_layout_in_one_repair(store, ablated_store_source, name):
    """An array's zarr.json deleted (its chunks kept): named as lost metadata of a run array,
    not as a missing array, and rebuilt by one repair, byte for byte."""
    (store / f"runs/r/{name}/zarr.json").unlink()
    problems = validate(store)
    assert problems[0] == (f"runs/r/{name}/zarr.json is missing (lost metadata of a run array); "
                           f"run `attngeom validate --store {store} --repair` to rebuild it")
    assert not any("missing array" in line for line in problems)
    assert repair(store)[0] == f"rebuilt runs/r/{name}/zarr.json"
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


@pytest.mark.parametrize("key", ["zarr.json", "topn/zarr.json", "heads/zarr.json"])
def test_lost_derived_group_metadata_is_named_everywhere_and_healed_by_analyze(store, ablated_store_source, tmp_path,
                                                                             key):
    """Not "no analysis yet", not a stale consolidated copy that --repair refreshes for ever:
    the lost metadata of the group, named by validate, report, explore and the API alike."""
    url = str(store)
    (store / A / key).unlink()
    message = f"{A}/{key} is missing"
    (line,) = validate(store)
    assert line.startswith(message) and line.endswith(f"run `attngeom analyze --store {url} --run r` again to "
                                                      "rewrite it"), line
    assert repair(store) == [line]  # nothing for --repair: validate does not send it there
    for args in (["report", "--store", url, "--out", str(tmp_path / "page")],
                 ["explore", "--store", url, "--out", str(tmp_path / "page"), "--no-progress"]):
        assert one_error(*args).startswith(f"attngeom: error: {message}")
    with pytest.raises(DamagedStoreError, match=message):
        ag.open_store(url).run("r").analysis("heads" if key == "zarr.json" else key.split("/")[0])
    analyze_cli(store)
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


@pytest.mark.parametrize("change, fault", [
    (lambda r: r.__setitem__("commit", "x"), "its commit is a str, not an object"),
    (lambda r: r["commit"].__setitem__("parameters", "x"), "its commit's parameters are not an object"),
    (lambda r: r["commit"].__setitem__("sequences", "0-5"), "its commit's sequences are not a list of sequence ids"),
    (lambda r: r["commit"].__setitem__("objects", []), "its commit's objects are not a list of sizes by key"),
], ids=["commit", "parameters", "sequences", "objects"])
def test_a_malformed_analysis_record_is_named_and_rewritten_by_analyze(store, ablated_store_source, change, fault):
    url = str(store)
    edit(store / A / "zarr.json", lambda d: change(d["attributes"]["attngeom"]))
    message = f"{A}/zarr.json is malformed ({fault}); run `attngeom analyze --store {url} --run r` again to rewrite it"
    assert message in validate(store)
    assert one_error("taxonomy", "--store", url) == f"attngeom: error: {message}"
    lines = analyze_cli(store)
    assert lines[1] == f"run r: recomputed every sequence: its record {A}/zarr.json was malformed", lines
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


def test_records_claiming_sequences_the_run_lacks_are_named_and_healed(store, ablated_store_source):
    """Every claim a record makes: the sequences it covers, and those its parameters list."""
    edit(store / A / "zarr.json", lambda d: d["attributes"]["attngeom"]["commit"]["sequences"].append(9))
    edit(store / "runs/r/ablation/zarr.json",
         lambda d: d["attributes"]["attngeom"]["commit"]["parameters"]["importance_sequences"].append(8))
    problems = validate(store)
    assert "run r: analysis covers sequences [9] the run does not hold as complete" in problems
    assert ("run r: ablation parameter 'importance_sequences' names sequences [8] the run does not hold as complete"
            in problems)
    analyze_cli(store)
    ag.ablate(str(store), "r", device="cpu", random_masks=2, retention=[1.0, 0.5], progress=False)
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


def test_an_empty_derived_group_left_by_a_full_disk_is_named_and_removed_by_the_next_writer(store,
                                                                                         ablated_store_source):
    (store / "runs/r/detect/_next/scores").mkdir(parents=True)
    assert validate(store) == [
        "runs/r/detect is an empty folder, left by a detect stopped before its first write (a full disk?); "
        "harmless: the next writer that writes the store alone removes it"]
    with pytest.raises(GroupNotFoundError):
        ag.open_store(str(store)).run("r").detect()
    analyze_cli(store)
    assert not (store / "runs/r/detect").exists()
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


def test_a_malformed_copy_beside_a_record_for_analyze_to_rewrite_is_dropped_and_the_store_converges(
        store, ablated_store_source):
    """The copy cannot be refreshed while a record does not parse (its groups would be left
    out): --repair drops it, so that validate names only what analyze rewrites, and
    analyze's own refresh puts it back."""
    url = str(store)
    edit(store / "zarr.json", lambda d: set_key(d, ("consolidated_metadata", "kind"), "bogus"))
    (store / A / "zarr.json").write_text("{")
    record = f"{A}/zarr.json is empty or truncated (unreadable JSON); run `attngeom analyze --store {url} --run r` " \
             "again to rewrite it"
    assert len(validate(store)) == 2
    assert repair(store) == ["rebuilt zarr.json", record]
    assert validate(store) == [record]
    analyze_cli(store)
    assert validate(store) == []
    assert_same_tree(store, ablated_store_source)


# ------------------------------------------------------------------ a stranger's store


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
