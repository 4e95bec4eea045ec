"""Damaged metadata of every level, as validate, repair, the readers and the writers meet it:
the consolidated copy, a group's or an array's zarr.json malformed or lost, a commit record
malformed or claiming what the run does not hold, an empty group left by a full disk. Each
case: one line naming the object and what is wrong, never a traceback nor "valid"; the
command that heals it, run once; then a store equal, object for object, to an undisturbed
one, and validate saying valid (or, for what nothing rebuilds, no advice to --repair)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xarray as xr

import attngeom as ag
from attngeom.errors import DamagedStoreError, GroupNotFoundError
from test_damage import one_error, run, validate
from test_recovery import analyze_cli, assert_same_tree

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
