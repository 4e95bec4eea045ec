"""Every stage on a store at a remote URL: in memory (``memory://``) and on S3 (moto's server
on loopback, as s3fs's own tests use it): extract, validate, analyze, taxonomy, ablate and
report, each finding what it would find on a local disk."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from conftest import extract, moto_s3
from stores import Run

from attngeom.api import analyze
from attngeom.cli import main
from attngeom.extract.request import ExtractRequest
from attngeom.store import ABLATION, ANALYSIS, validate_store, zarr_store
from attngeom.store.session import StoreSession

S = 10


@pytest.fixture(scope="module")
def reference(extracted_store):
    """Run r of S sequences of the tiny llama at L = 16, extracted to a local disk, in memory."""
    return xr.open_zarr(str(extracted_store(Run(sequences=S))), group="runs/r", consolidated=False).load()


@pytest.fixture(scope="module")
def s3_url():
    """A bucket on moto's S3 server on loopback, as s3fs's own tests use it."""
    with moto_s3():
        yield "s3://attngeom/store.zarr"


def test_memory_store_pipeline(tiny_model_dir, word_corpus):
    url = f"memory://attngeom-{uuid.uuid4().hex}/store.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("gemma3")), dataset=str(word_corpus), context_length=16,
                           num_sequences=2, store=url, run_id="r", progress=False))
    assert validate_store(url, deep=True) == []
    analyze(url, n_grid=[1, 4], progress=False)
    # On an object store the analysis lies in the generation folder its record names.
    topn = StoreSession.reading(url).reader("r").derived(ANALYSIS, "topn")
    assert dict(topn.sizes) == {"seq": 2, "layer": 3, "head": 4, "n": 2}


def test_s3_store_every_stage(tiny_model_dir, word_corpus, s3_url, reference, tmp_path):
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=S, store=s3_url, run_id="r", progress=False))
    assert validate_store(s3_url, deep=True) == []
    ds = xr.open_zarr(zarr_store(s3_url, read_only=True), group="runs/r")
    np.testing.assert_array_equal(ds["values"].values, reference["values"].values)
    analyze(s3_url, scheduler="threads", n_grid=[1, 4], progress=False)
    result = CliRunner().invoke(main, ["taxonomy", "--store", s3_url])
    assert result.exit_code == 0, result.output
    assert "Reset" in result.output
    result = CliRunner().invoke(main, ["ablate", "--store", s3_url, "--run", "r", "--device", "cpu",
                                       "--retention", "1.0,0.5", "--random-masks", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    single = StoreSession.reading(s3_url).reader("r").derived(ABLATION, "single")
    assert dict(single.sizes)["layer"] == 3
    result = CliRunner().invoke(main, ["report", "--store", s3_url, "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report" / "index.html").exists()
