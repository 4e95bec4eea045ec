"""analyze over stores made by extract: values equal the brute force, idempotent, cluster by address."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from click.testing import CliRunner
from test_kernels import brute_topn, brute_value_statistics

from attngeom.analyze.stage import TOPN_VARS, VALUE_VARS, _instance_seed, analyze
from attngeom.cli import main
from attngeom.extract.pipeline import ExtractRequest, extract
from attngeom.store import open_dataset, resize_run

GRID = [1, 2, 4, 8, 15]


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as c:
        yield c


@pytest.fixture(scope="module")
def analyzed(tiny_model_dir, word_corpus, tmp_path_factory, cluster):
    """Two runs (Llama with GQA; Gemma 3 with a 6-key sliding window at L=16), analyzed."""
    store = tmp_path_factory.mktemp("an") / "s.zarr"
    for arch in ("llama", "gemma3"):
        extract(ExtractRequest(model=str(tiny_model_dir(arch)), dataset=str(word_corpus), context_length=16,
                               num_sequences=3, store=str(store), run_id=arch, progress=False))
    out = tmp_path_factory.mktemp("tables")
    analyze(str(store), scheduler=cluster.scheduler_address, n_grid=GRID, out=out, progress=False)
    return store, out


def group(store, run, name) -> xr.Dataset:
    return open_dataset(str(store), f"runs/{run}/analysis/{name}")


@pytest.mark.parametrize("run", ["llama", "gemma3"])
def test_topn_equals_brute_force_value_by_value(analyzed, run):
    store, _ = analyzed
    ds = xr.open_zarr(str(store), group=f"runs/{run}", consolidated=False)
    topn = group(store, run, "topn").load()
    values = group(store, run, "values").load()
    assert topn["precision"].dims == ("seq", "layer", "head", "n")
    assert list(topn["n"].values) == GRID
    head_kv = ds["head_kv"].values
    for s in range(ds.sizes["seq"]):
        for layer in range(ds.sizes["layer"]):
            attn = ds["attn_last"].values[s, layer].astype(np.float64)
            vals = ds["values"].values[s, layer][head_kv].astype(np.float64)
            att = np.broadcast_to(ds["attendable"].values[layer], attn.shape)
            want = brute_topn(attn, vals, att, GRID, seed=_instance_seed(0, s, layer))
            got = topn.isel(seq=s, layer=layer)
            for name in TOPN_VARS:
                np.testing.assert_allclose(got[name].values, want[name], rtol=1e-9, atol=1e-12, err_msg=name)
            stats = brute_value_statistics(vals, att)
            for name in VALUE_VARS:
                np.testing.assert_allclose(values[name].values[s, layer], stats[name], rtol=1e-9, err_msg=name)
    assert (topn["inversions"] <= topn["k_sink_exact"]).all()
    if run == "gemma3":  # sliding layers: the final query cannot see the sink at L=16
        assert np.isnan(values["sink_norm_ratio"].sel(layer=0)).all()
        assert not np.isnan(values["sink_norm_ratio"].sel(layer=1)).any()


def test_heads_summary_and_tables(analyzed):
    store, out = analyzed
    heads = group(store, "llama", "heads")
    assert dict(heads.sizes) == {"layer": 3, "head": 4}
    assert {"C", "C_cv", "sink_norm_ratio", "mu_q95", "mu_q95_cv", "nu_plus_q95_cv"} <= set(heads.data_vars)
    summary = group(store, "llama", "summary")
    assert list(summary["stat"].values) == ["mean", "median", "q05", "q95", "count"]
    assert float(summary["certificate_violation"].sel(stat="mean").max()) == 0
    assert int(summary["precision"].sel(stat="count", n=1).min()) == 3
    table = pd.read_parquet(out / "llama.topn.parquet")
    assert list(table.columns[:8]) == ["run", "model", "dataset", "context_length", "layer", "head", "n", "variable"]
    assert len(table) == 3 * 4 * len(GRID) * len(summary.data_vars)
    assert (out / "gemma3.topn.csv").exists()
    stored = group(store, "llama", "table").to_dataframe()
    assert len(stored) == len(table)


def test_rerun_is_idempotent_and_reads_only_completed(analyzed, cluster, tmp_path):
    store, _ = analyzed
    before = group(store, "llama", "topn").load()
    run = zarr.open_group(str(store), path="runs/llama", mode="r+", use_consolidated=False)
    resize_run(run, 5)
    run["tokens"][3] = run["tokens"][0]  # sequence 3 is being written: no commit flag yet
    analyze(str(store), run_id="llama", scheduler=cluster.scheduler_address, n_grid=GRID, progress=False)
    after = group(store, "llama", "topn").load()
    assert list(after["seq"].values) == [0, 1, 2]
    xr.testing.assert_identical(before, after)


def test_cli_default_local_cluster(analyzed, tmp_path):
    store, _ = analyzed
    result = CliRunner().invoke(main, ["analyze", "--store", str(store), "--run", "gemma3", "--n-grid", "1,4", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "run gemma3: 3 sequences, 36 head instances" in result.output
    assert list(group(store, "gemma3", "topn")["n"].values) == [1, 4]
    bad = CliRunner().invoke(main, ["analyze", "--store", str(store), "--run", "nope"])
    assert bad.exit_code == 2 and "no run 'nope'" in bad.stderr
