"""A model larger than one device, placed by accelerate over devices and the disk: on this
CPU, a tiny Llama with one layer and its LM head offloaded to the disk gives extract's arrays
and ablate's impacts and detect's scores equal to a one-device run; a map that cannot be used is refused in one
line before any model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
import xarray as xr
from click.testing import CliRunner

import attngeom as ag
from attngeom.cli import main
from attngeom.errors import InputError

SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.layers.2": "cpu", "model.norm": "disk", "lm_head": "disk"}


def test_extract_ablate_and_detect_across_devices_equal_one_device(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path / "cache"))
    folder = str(tiny_model_dir("llama"))
    ids = np.random.default_rng(0).integers(4, 100, (3, 16))
    ids[:, 0] = 1
    one, split = str(tmp_path / "one.zarr"), str(tmp_path / "split.zarr")
    ag.extract(folder, store=one, token_ids=ids, run_id="r", progress=False)
    ag.extract(folder, store=split, token_ids=ids, run_id="r", device_map=SPLIT, progress=False)
    a, b = (xr.open_zarr(s, group="runs/r", consolidated=False) for s in (one, split))
    for name in a.data_vars:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    assert ag.open_store(split).run("r").provenance["device_map"] == SPLIT
    options = dict(device="cpu", random_masks=1, retention=[1.0, 0.5], progress=False)
    single = ag.ablate(one, "r", **options).single
    options["device"] = "auto"
    placed = ag.ablate(split, "r", device_map=json.dumps(SPLIT), **options).single
    np.testing.assert_allclose(single["delta_nll"].values, placed["delta_nll"].values, rtol=0, atol=1e-5)
    options = dict(probes=2, haystacks=2, needle_length=4, progress=False)
    alone = ag.detect(one, "r", device="cpu", **options).scores
    spread = ag.detect(split, "r", device_map=SPLIT, **options).scores
    for name in alone.data_vars:
        np.testing.assert_allclose(alone[name].values, spread[name].values, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("args, message", [
    (["--device-map", "everywhere"], "--device-map takes auto, balanced"),
    (["--device-map", '{"model.layers.0": "gpu"}'], "model.layers.0: 'gpu' is no device"),
    (["--device-map", "auto", "--device", "cpu"], "leave --device auto"),
    (["--device-map", "auto", "--shard", "0/2"], "use one or the other"),
])
def test_a_device_map_that_cannot_be_used_is_refused_in_one_line(args, message, tmp_path):
    result = CliRunner().invoke(main, ["extract", "--model", "smollm2-135m", "--dataset", "wiki-summaries", "-L", "16",
                                       "-S", "1", "--store", str(tmp_path / "s.zarr"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "s.zarr").exists()


def test_a_model_in_memory_takes_no_device_map(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(InputError, match="a model given in memory stays where it is"):
        ag.extract(model, store=tmp_path / "s.zarr", token_ids=np.ones((1, 4), dtype=int), device_map="auto")
