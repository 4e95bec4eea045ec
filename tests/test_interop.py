"""Format 3 is readable by any Zarr v3 implementation: tensorstore (Google's C++ one) reads
every array of a real store (run, analysis, ablation, empty ones included) bit for bit as
zarr-python does; label variables are integer codes whose labels ride in attributes, and
attngeom's opener gives them back as strings; labels of a fixed vocabulary have the same
codes in every store (format 4). A format-2 store (zarr-python's ``string`` type) and a
format-3 one (codes in order of first appearance) migrate to exactly what attngeom writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import assert_tensorstore_reads, extract

from attngeom.api import analyze
from attngeom.api import ablate
from attngeom.extract.request import ExtractRequest
from attngeom.store import (
    FORMAT,
    LABEL_ORDERS,
    REGIMES,
    arrays_of,
    compressors,
    open_dataset,
    open_root,
    validate_store,
)
from attngeom.store.integrity import migrate
from attngeom.store.session import StoreSession

ts = pytest.importorskip("tensorstore")

CORE = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128")


@pytest.fixture(scope="module")
def built(tiny_model_dir, word_corpus, tmp_path_factory) -> Path:
    """A real store: 4 sequences of a tiny llama (L = 16) with rows kept at queries 5, 10 and
    15 (attn_rows, topn_by_query), analyzed and ablated; no head is critical, so
    ``ablation/critical`` holds zero-length arrays."""
    store = tmp_path_factory.mktemp("interop") / "s.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=4, store=str(store), run_id="r", queries="every:5", progress=False))
    analyze(str(store), scheduler="threads", n_grid=[1, 2, 4], progress=False)
    ablate(str(store), "r", device="cpu", random_masks=2, retention=[1.0, 0.5], progress=False)
    return store


def metadata(store: Path, path: str) -> dict:
    return json.loads((store / path / "zarr.json").read_text())


def test_tensorstore_reads_every_array_as_zarr_python_does(built):
    arrays = arrays_of(open_root(str(built)))
    paths = {a.path for a in arrays}
    assert {"runs/r/values", "runs/r/analysis/heads/regime", "runs/r/ablation/sweep/method",
            "runs/r/ablation/critical/layer", "runs/r/attn_rows", "runs/r/query_pos",
            "runs/r/analysis/topn_by_query/f_score", "runs/r/analysis/summary_by_query/f_score",
            "runs/r/prev_attn", "runs/r/recent_attn", "runs/r/recent", "runs/r/analysis/head_scores/sink_head",
            "runs/r/analysis/head_scores/distant_mass", "runs/r/analysis/sequence_scores/sink_score"} <= paths
    assert any(a.size == 0 for a in arrays)
    for arr in arrays:
        assert metadata(built, arr.path)["data_type"] in CORE, arr.path
        assert_tensorstore_reads(ts, built, arr)


def test_labels_are_codes_on_disk_and_strings_through_attngeom(built):
    session = StoreSession.reading(str(built))
    heads = open_dataset(session.zstore, session.url, "runs/r/analysis/heads")
    assert heads["regime"].dtype == object and set(heads["regime"].values.ravel()) <= {"Retriever", "Mixer", "Reset"}
    plain = xr.open_zarr(str(built), group="runs/r/analysis/heads", consolidated=False)
    codes = plain["regime"]
    labels = codes.attrs["attngeom"]["labels"]
    assert codes.dtype.kind == "i" and codes.attrs["flag_values"] == list(range(len(labels)))
    assert codes.attrs["flag_meanings"].split() == labels
    np.testing.assert_array_equal(np.array(labels, dtype=object)[codes.values], heads["regime"].values)
    sweep = open_dataset(session.zstore, session.url, "runs/r/ablation/sweep")
    assert "single_impact" in list(sweep.indexes["method"])
    table = open_dataset(session.zstore, session.url, "runs/r/analysis/table")
    assert set(table["run"].values) == {"r"}


def as_format2(store: Path) -> None:
    """Rewrite ``store`` as format 2 wrote it: every label variable as zarr-python's
    variable-length strings."""
    root = zarr.open_group(str(store), mode="r+", use_consolidated=False)
    for arr in arrays_of(root):
        meta = metadata(store, arr.path)
        labels = meta["attributes"].get("attngeom", {}).get("labels")
        if labels is None:
            continue
        values = np.array(labels, dtype=object)[arr[...]]
        attrs = {k: v for k, v in meta["attributes"].items() if k not in ("attngeom", "flag_values", "flag_meanings")}
        with zarr.config.set({"array.write_empty_chunks": True}):
            text = zarr.create_array(store=root.store, name=arr.path, shape=arr.shape, dtype=str,
                                     chunks=arr.chunks, compressors=compressors(np.dtype(object)),
                                     dimension_names=meta["dimension_names"], attributes=attrs, overwrite=True,
                                     chunk_key_encoding=meta["chunk_key_encoding"])
            if values.size:
                text[...] = values
    root.attrs["attngeom"] = {**root.attrs["attngeom"], "format": 2}


def test_fixed_vocabularies_have_their_codes_in_every_store(built):
    coded = {}
    for arr in arrays_of(open_root(str(built))):
        name = arr.path.rpartition("/")[2]
        labels = metadata(built, arr.path)["attributes"].get("attngeom", {}).get("labels")
        if labels is not None and name in LABEL_ORDERS:
            assert labels == list(LABEL_ORDERS[name]), arr.path
            coded[arr.path] = labels
    assert {"runs/r/analysis/heads/regime", "runs/r/analysis/signatures/regime", "runs/r/analysis/taxonomy/vote",
            "runs/r/analysis/summary/stat", "runs/r/ablation/sweep/method", "runs/r/ablation/table/method",
            "runs/r/ablation/single/regime", "runs/r/ablation/regimes/regime"} <= set(coded)
    # The codes a plain reader sees: Retriever 0, Mixer 1, Reset 2, whichever regimes there are.
    plain = xr.open_zarr(str(built), group="runs/r/analysis/heads", consolidated=False)["regime"].values
    names = open_dataset(StoreSession.reading(str(built)).zstore, str(built), "runs/r/analysis/heads")["regime"].values
    np.testing.assert_array_equal(plain, [[REGIMES.index(n) for n in row] for row in names])


def as_format3(store: Path) -> int:
    """Rewrite ``store`` as format 3 could have: the labels of every fixed vocabulary numbered
    otherwise (here reversed, an order of first appearance). Returns how many arrays."""
    root = zarr.open_group(str(store), mode="r+", use_consolidated=False)
    rewritten = 0
    for arr in arrays_of(root):
        meta = metadata(store, arr.path)
        labels = meta["attributes"].get("attngeom", {}).get("labels")
        if labels is None or arr.path.rpartition("/")[2] not in LABEL_ORDERS:
            continue
        new = labels[::-1]
        table = np.array([new.index(label) for label in labels] + [-1], dtype=arr.dtype)
        with zarr.config.set({"array.write_empty_chunks": True}):
            if arr.size:
                zarr.open_array(str(store), path=arr.path, mode="r+")[...] = table[arr[...]]
        meta = metadata(store, arr.path)
        meta["attributes"]["attngeom"]["labels"] = new
        meta["attributes"]["flag_meanings"] = " ".join("_".join(label.split()) for label in new)
        (store / arr.path / "zarr.json").write_text(json.dumps(meta))
        rewritten += 1
    root.attrs["attngeom"] = {**root.attrs["attngeom"], "format": 3}
    return rewritten


def test_format3_store_migrates_to_fixed_codes(built, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(built, store)
    rewritten = as_format3(store)
    assert metadata(store, "runs/r/analysis/heads/regime")["attributes"]["attngeom"]["labels"] == list(REGIMES[::-1])
    migrated, original = StoreSession.reading(str(store)), StoreSession.reading(str(built))
    xr.testing.assert_identical(open_dataset(migrated.zstore, migrated.url, "runs/r/analysis/heads"),
                                open_dataset(original.zstore, original.url, "runs/r/analysis/heads"))
    report = migrate.migrate(str(store), progress=False)
    assert (report.source, report.target, report.arrays) == (3, FORMAT, rewritten)
    assert validate_store(str(store), deep=True) == []
    for arr in arrays_of(open_root(str(built))):
        assert metadata(store, arr.path) == metadata(built, arr.path), arr.path
        np.testing.assert_array_equal(zarr.open_array(str(store), path=arr.path, mode="r")[...], arr[...])


def test_format2_store_migrates_to_what_this_attngeom_writes(built, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(built, store)
    as_format2(store)
    assert metadata(store, "runs/r/analysis/heads/regime")["data_type"] == "string"
    assert validate_store(str(store))[0].startswith(f"store format 2 is older than the one this attngeom writes ({FORMAT})")
    report = migrate.migrate(str(store), progress=False)
    assert (report.source, report.target) == (2, FORMAT) and report.arrays >= 10
    assert validate_store(str(store), deep=True) == []
    for arr in arrays_of(open_root(str(built))):
        old, new = metadata(built, arr.path), metadata(store, arr.path)
        for key in ("data_type", "fill_value", "codecs", "attributes", "chunk_grid", "dimension_names"):
            assert new[key] == old[key], (arr.path, key)
        np.testing.assert_array_equal(zarr.open_array(str(store), path=arr.path, mode="r")[...], arr[...])


def test_tensorstore_reads_bfloat16_values_as_their_bit_patterns(tmp_path):
    """A bfloat16 model's values: any Zarr v3 reader (tensorstore here) reads the uint16 bit
    patterns whose encoding the array's attributes name; shifted into the upper half of a
    float32 they are the values attngeom gives."""
    from attngeom.extract.synthetic import write_synthetic_run

    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=2, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=16,
                        values_dtype="bfloat16")
    meta = metadata(store, "runs/r/values")
    assert meta["data_type"] == "uint16" and meta["attributes"]["attngeom"] == {"encoding": "bfloat16"}
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store / "runs/r/values")}}
    bits = ts.open(spec, open=True, read=True).result().read().result()
    values = open_dataset(StoreSession.reading(str(store)).zstore, str(store), "runs/r")["values"].values
    assert values.dtype == np.float32 and np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), values)
    assert np.array_equal(bits, zarr.open_array(str(store), path="runs/r/values", mode="r")[:])
