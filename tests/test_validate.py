"""``attngeom validate`` on a good store and on deliberately broken ones."""

from __future__ import annotations

import json
import shutil

import pytest
import xarray as xr
import zarr
from click.testing import CliRunner
from conftest import extract

from attngeom.cli import main
from attngeom.extract.request import ExtractRequest
from attngeom.store import resize_run


@pytest.fixture(scope="module")
def good_store(tiny_model_dir, word_corpus, tmp_path_factory):
    store = tmp_path_factory.mktemp("good") / "s.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=3, store=str(store), run_id="r", progress=False))
    return store


@pytest.fixture
def store(good_store, tmp_path):
    copy = tmp_path / "s.zarr"
    shutil.copytree(good_store, copy)
    return copy


def problems_of(path) -> list[str]:
    result = CliRunner().invoke(main, ["validate", "--store", str(path)])
    lines = result.output.strip().splitlines()
    if result.exit_code == 0:
        assert lines == [f"{path}: valid"]
        return []
    assert result.exit_code == 1
    return lines


def test_good_store_is_valid_and_opens_with_xarray(good_store):
    assert problems_of(good_store) == []
    ds = xr.open_zarr(str(good_store), group="runs/r")
    assert set(ds.coords) >= {"layer", "head", "kv_head", "pos", "head_kv"}
    assert ds["head_kv"].dims == ("head",)
    assert ds["winner"].dims == ("seq", "layer", "head", "query")
    prov = ds.attrs["attngeom"]
    for key in ("model", "tokenizer", "dataset", "window_rule", "context_length", "values_dtype",
                "compute_dtype", "attention_implementation", "library_versions", "attngeom_version", "command_line"):
        assert key in prov, key
    assert prov["dataset"]["fingerprint"] and prov["model"]["file_sha256"]


def test_missing_array(store):
    """An array the run's layout names, gone whole: its metadata is rebuilt from the layout by
    --repair, which then finds its sequences without their chunks (extract rewrites them)."""
    shutil.rmtree(store / "runs/r/entropy")
    assert problems_of(store) == [
        f"runs/r/entropy/zarr.json is missing (lost metadata of a run array); run `attngeom validate --store "
        f"{store} --repair` to rebuild it",
        f"the root's consolidated metadata (read by xr.open_zarr) is out of date for runs/r/entropy (a writer was "
        f"interrupted); run `attngeom validate --store {store} --repair` to refresh it",
    ]


def test_wrong_dtype_and_dims(store):
    run = zarr.open_group(str(store), path="runs/r", mode="r+", use_consolidated=False)
    shape = run["sink_attn"].shape
    run.create_array("sink_attn", shape=shape, dtype="float64", dimension_names=("seq", "layer", "head", "query"), overwrite=True)
    run.create_array("top1_attn", shape=shape, dtype="float32", dimension_names=("seq", "layer", "head", "key"), overwrite=True)
    lines = problems_of(store)
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


def test_schema_version_from_the_future(store):
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["attngeom"]["schema_version"] = 2
    meta.pop("consolidated_metadata", None)
    (store / "zarr.json").write_text(json.dumps(meta))
    (line,) = problems_of(store)
    assert "schema version 2, newer than this attngeom" in line


def test_partly_written_and_unwritten_sequences(store):
    run = zarr.open_group(str(store), path="runs/r", mode="r+", use_consolidated=False)
    resize_run(run, 6)
    run["tokens"][3] = run["tokens"][0]  # an interrupted write of sequence 3: no commit flag
    shutil.rmtree(store / "runs/r/values/c/1")  # a committed sequence that lost a shard
    lines = problems_of(store)
    assert (f"run r: sequence 1 is marked complete but lacks values; run `attngeom validate --store {store} --deep "
            "--repair` to uncommit sequence 1, then the run's extract command again to rewrite it") in lines
    assert any(line.startswith("run r: sequence 3 is only partly written") for line in lines)
    assert any(line.startswith("run r: sequences 4-5 of 6 are not written yet") for line in lines)


def test_not_a_store(tmp_path):
    assert problems_of(tmp_path / "nothing") == [f"no Zarr store at {tmp_path / 'nothing'}"]
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w")
    assert problems_of(tmp_path / "plain.zarr") == [
        "not an attngeom store (no attngeom schema version in its root attributes)"
    ]
