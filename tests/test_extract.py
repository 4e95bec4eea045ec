"""extract end to end on tiny models: store contents equal eager attention, resume, append, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
import xarray as xr
import zarr
from click.testing import CliRunner
from test_capture import eager_reference

from attngeom.cli import main
from attngeom.extract.pipeline import ExtractRequest, extract
from attngeom.store import open_or_create_root, validate_store


def run_extract(model_dir, corpus, store, **kw) -> str:
    args = dict(model=str(model_dir), dataset=str(corpus), context_length=16, num_sequences=4,
                store=str(store), run_id="r", progress=False)
    args.update(kw)
    return extract(ExtractRequest(**args)).run_id


def open_run(store, run_id="r") -> xr.Dataset:
    return xr.open_zarr(str(store), group=f"runs/{run_id}", consolidated=False)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_store_equals_eager_for_stored_tokens(arch, tiny_model_dir, word_corpus, tmp_path):
    folder = tiny_model_dir(arch)
    run_extract(folder, word_corpus, tmp_path / "s.zarr", batch_size=3, store_rows="all", num_sequences=5)
    ds = open_run(tmp_path / "s.zarr")
    assert dict(ds.sizes) | {} == dict(ds.sizes)
    assert ds["values"].dims == ("seq", "layer", "kv_head", "pos", "head_dim")
    assert ds["attn_last"].dims == ("seq", "layer", "head", "key")
    assert list(ds["head_kv"].values) == [0, 0, 1, 1]
    tokens = torch.from_numpy(ds["tokens"].values.astype("int64"))
    assert (tokens[:, 0] == 1).all()  # BOS
    rows, values, _ = eager_reference(folder, tokens)
    length = tokens.shape[1]
    for layer in range(ds.sizes["layer"]):
        a = rows[layer].numpy()
        v = values[layer].numpy()
        np.testing.assert_allclose(ds["values"].isel(layer=layer).values, v, atol=1e-6)
        np.testing.assert_allclose(ds["attn_last"].isel(layer=layer).values, a[:, :, -1], atol=1e-5)
        np.testing.assert_allclose(ds["attn"].isel(layer=layer).values, a, atol=1e-3)
        np.testing.assert_allclose(ds["sink_attn"].isel(layer=layer).values, a[..., 0], atol=1e-5)
        score = a * np.repeat(np.linalg.norm(v, axis=-1), 2, axis=1)[:, :, None, :]
        np.testing.assert_array_equal(ds["winner"].isel(layer=layer).values, score.argmax(-1))
        allowed = ds["attendable"].isel(layer=layer).values
        assert allowed.sum() == (length if ds["window"].values[layer] == 0 else ds["window"].values[layer])
    if arch == "gemma3":
        assert list(ds["window"].values) == [6, 0, 6]


def test_resume_and_append_write_each_sequence_once(tiny_model_dir, word_corpus, tmp_path):
    folder = tiny_model_dir("llama")
    reference = tmp_path / "ref.zarr"
    run_extract(folder, word_corpus, reference, num_sequences=6)
    store = tmp_path / "s.zarr"
    run_extract(folder, word_corpus, store, num_sequences=3)
    run_extract(folder, word_corpus, store, num_sequences=3)  # nothing left to do
    run_extract(folder, word_corpus, store, num_sequences=6)  # appends 3
    assert validate_store(str(store)) == []
    a, b = open_run(reference), open_run(store)
    for name in ("tokens", "values", "attn_last", "winner", "entropy", "doc_index", "window_start"):
        np.testing.assert_array_equal(a[name].values, b[name].values)
    assert list(b["doc_index"].values) == sorted(set(b["doc_index"].values))


def test_sigkill_at_any_point_then_resume(tiny_model_dir, word_corpus, tmp_path):
    """Kill extract with SIGKILL at several moments; the same command then finishes the run."""
    folder = tiny_model_dir("gemma3")
    reference = tmp_path / "ref.zarr"
    run_extract(folder, word_corpus, reference, num_sequences=11)
    store = tmp_path / "s.zarr"
    cmd = [sys.executable, "-m", "attngeom.cli", "extract", "--model", str(folder), "--dataset",
           str(word_corpus), "-L", "16", "-S", "11", "--store", str(store), "--run", "r", "--no-progress"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    complete = store / "runs" / "r" / "complete" / "c"
    for wait_for_commits in (0, 2, 5):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            done = len(list(complete.iterdir())) if complete.exists() else 0
            if (wait_for_commits == 0 and (store / "zarr.json").exists()) or (wait_for_commits and done >= wait_for_commits):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert validate_store(str(store)) == []
    a, b = open_run(reference), open_run(store)
    assert int(b["complete"].sum()) == 11
    for name in ("tokens", "values", "attn_last", "winner", "sink_attn", "doc_index"):
        np.testing.assert_array_equal(a[name].values, b[name].values)


def test_interrupted_creation_is_replaced(tiny_model_dir, word_corpus, tmp_path):
    store = tmp_path / "s.zarr"
    root = open_or_create_root(str(store))
    root.require_group("runs/r").create_array("tokens", shape=(1, 3), dtype="int32")
    assert "creation was interrupted" in validate_store(str(store))[0]
    run_extract(tiny_model_dir("llama"), word_corpus, store, num_sequences=2)
    assert validate_store(str(store)) == []


def tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_bad_input_exits_2_with_one_line_and_store_untouched(tiny_model_dir, word_corpus, tmp_path):
    folder = tiny_model_dir("llama")
    store = tmp_path / "s.zarr"
    run_extract(folder, word_corpus, store, num_sequences=2)
    before = tree(store)
    base = ["extract", "--model", str(folder), "--dataset", str(word_corpus), "-L", "16", "-S", "2",
            "--store", str(store), "--run", "r", "--no-progress"]

    def with_(**kw):
        args = list(base)
        for key, value in kw.items():
            flag = "--" + key.replace("_", "-")
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        return args

    cases = {
        "unknown model": with_(model="no-such-model-xyz"),
        "unknown dataset": with_(dataset="no-such-dataset-xyz"),
        "too few documents": with_(num_sequences="500"),
        "another L for the run": with_(context_length="12"),
        "bad BOS token": with_(bos_token="<not-a-token>"),
    }
    runner = CliRunner()
    messages = {}
    for case, args in cases.items():
        result = runner.invoke(main, args)
        assert result.exit_code == 2, (case, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), (case, result.stderr)
        messages[case] = lines[0]
        assert tree(store) == before, case
    assert "only 12 documents of at least 15 tokens" in messages["too few documents"]
    assert "--context-length is 16 in the run, 12 here" in messages["another L for the run"]

    afile = tmp_path / "afile"
    afile.write_text("x")
    result = runner.invoke(main, with_(store=str(afile / "s.zarr")))
    assert result.exit_code == 2 and "not a folder" in result.stderr

    other = tmp_path / "other.zarr"
    zarr.open_group(str(other), mode="w").attrs["attngeom"] = {"schema_version": 99}
    result = runner.invoke(main, with_(store=str(other)))
    assert result.exit_code == 2 and "schema version 99" in result.stderr


def test_another_compute_dtype_is_refused_and_auto_resumes_a_float32_run(tiny_model_dir, word_corpus, tmp_path):
    folder = tiny_model_dir("llama")
    store = tmp_path / "s.zarr"
    run_extract(folder, word_corpus, store, num_sequences=1, device="cpu", dtype="float32")
    before = tree(store)
    args = ["extract", "--model", str(folder), "--dataset", str(word_corpus), "-L", "16", "-S", "2",
            "--store", str(store), "--run", "r", "--device", "cpu", "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--dtype", "bfloat16"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), result.stderr
    assert "--dtype is float32 in the run, bfloat16 here" in lines[0]
    assert tree(store) == before
    # auto resolves to float32 on CPU: the same run, and its second sequence is appended.
    result = CliRunner().invoke(main, [*args, "--dtype", "auto"])
    assert result.exit_code == 0, result.output
    assert validate_store(str(store)) == []
    ds = open_run(store)
    assert ds["complete"].values.tolist() == [1, 1]
    assert ds.attrs["attngeom"]["compute_dtype"] == "float32"


def test_the_bos_is_the_tokenizers_else_the_configs_else_refused(tiny_model_dir, word_corpus, tmp_path):
    """A tokenizer that names no BOS: the model config's bos_token_id is taken, said in one
    warning; a config that names none either: refused in one line naming --bos-token, before
    the store is made."""
    import attngeom as ag

    folder = tmp_path / "nobos"
    src = tiny_model_dir("llama")
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("bos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    args = ["extract", "--model", str(folder), "--dataset", str(word_corpus), "-L", "16", "-S", "1", "--no-progress"]
    taken = CliRunner().invoke(main, [*args, "--store", str(tmp_path / "taken.zarr")])
    assert taken.exit_code == 0, taken.output
    assert ("attngeom: warning: the tokenizer names no BOS token: taking the model config's bos_token_id 1 as the BOS"
            in taken.stderr)
    assert ag.open_store(tmp_path / "taken.zarr").run(taken.stdout.split()[1].rstrip(":")).provenance[
        "bos_token_id"] == 1
    model = json.loads((folder / "config.json").read_text())
    model["bos_token_id"] = None  # LlamaConfig's default is 1: left out, it would be there again
    (folder / "config.json").write_text(json.dumps(model))
    refused = CliRunner().invoke(main, [*args, "--store", str(tmp_path / "s.zarr")])
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        "attngeom: error: neither the tokenizer nor the model's config names a BOS token: name one with --bos-token "
        "(e.g. --bos-token '<|endoftext|>')"]
    assert not (tmp_path / "s.zarr").exists()


def test_a_bfloat16_models_values_are_stored_at_two_bytes_losing_nothing(tiny_model_dir, word_corpus, tmp_path):
    """In bfloat16 the values are stored by default as their bfloat16 bit patterns (uint16,
    the encoding named in the array's attributes): read back as float32 they equal a float32
    store of the same forward, and so does every analysis value; a rerun keeps the run's
    values dtype, one asking for another is refused."""
    import attngeom as ag

    folder = tiny_model_dir("llama")
    two, four = tmp_path / "two.zarr", tmp_path / "four.zarr"
    run_extract(folder, word_corpus, two, dtype="bfloat16")
    run_extract(folder, word_corpus, four, dtype="bfloat16", values_dtype="float32")
    raw = zarr.open_array(str(two), path="runs/r/values", mode="r")
    assert raw.dtype == np.uint16 and raw.attrs["attngeom"] == {"encoding": "bfloat16"}
    runs = [ag.open_store(str(store)).run("r") for store in (two, four)]
    assert [run.provenance["values_dtype"] for run in runs] == ["bfloat16", "float32"]
    got, want = (run.dataset()["values"].values for run in runs)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal((raw[:].astype(np.uint32) << 16).view(np.float32), want)  # a plain reader's decoding
    for store in (two, four):
        ag.analyze(str(store), scheduler="threads", progress=False)
    for group in ("topn", "values", "heads"):
        xr.testing.assert_identical(*(run.analysis(group).load() for run in
                                      (ag.open_store(str(s)).run("r") for s in (two, four))))
    assert run_extract(folder, word_corpus, two, dtype="bfloat16", num_sequences=5) == "r"
    with pytest.raises(ag.InputError, match="--values-dtype is bfloat16 in the run, float32 here"):
        run_extract(folder, word_corpus, two, dtype="bfloat16", num_sequences=6, values_dtype="float32")


def test_values_dtype_bfloat16_needs_a_bfloat16_model(tiny_model_dir, word_corpus, tmp_path):
    """A float32 model's values in bfloat16 would lose bits: refused in one line, exit 2,
    before the model loads and with nothing written."""
    store = tmp_path / "s.zarr"
    args = ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus), "-L", "16", "-S", "2",
            "--store", str(store), "--values-dtype", "bfloat16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "--values-dtype bfloat16 stores a bfloat16 model's values exactly; this model computes in float32" in result.output
    assert not store.exists()


def test_float32_tf32_changes_nothing_on_a_cpu_and_is_recorded(tiny_model_dir, word_corpus, tmp_path):
    """--dtype float32-tf32: TF32 matmuls inside the forward only (torch's precision is the
    caller's again after), recorded as the run's compute dtype; a CPU computes every array
    as in float32."""
    import attngeom as ag

    folder = tiny_model_dir("llama")
    before = torch.get_float32_matmul_precision()
    run_extract(folder, word_corpus, tmp_path / "tf32.zarr", dtype="float32-tf32")
    assert torch.get_float32_matmul_precision() == before
    run_extract(folder, word_corpus, tmp_path / "f32.zarr", dtype="float32")
    tf32, f32 = (ag.open_store(str(tmp_path / name)).run("r") for name in ("tf32.zarr", "f32.zarr"))
    assert (tf32.provenance["compute_dtype"], tf32.provenance["float32_matmul_precision"]) == ("float32-tf32", "high")
    assert f32.provenance["compute_dtype"] == "float32"
    xr.testing.assert_equal(tf32.dataset().load(), f32.dataset().load())  # the values; attributes record the dtype
    with pytest.raises(ag.InputError, match="--dtype is float32-tf32 in the run, float32 here"):
        run_extract(folder, word_corpus, tmp_path / "tf32.zarr", dtype="float32", num_sequences=5)


def test_two_extracts_appending_to_one_run_take_turns(tiny_model_dir, word_corpus, tmp_path):
    """An extract appending to a run while another holds its append lock waits, naming the
    holder, and goes on once it is let go, writing only what the other left: here the holder
    (a process that takes the lock, and lets it go when told) wrote nothing, so the extract
    appends all three sequences, equal to one undisturbed extract."""
    folder = tiny_model_dir("llama")
    reference, store = tmp_path / "ref.zarr", tmp_path / "s.zarr"
    run_extract(folder, word_corpus, reference, num_sequences=5)
    run_extract(folder, word_corpus, store, num_sequences=2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from attngeom.store.holds.locks import RunLock; "
         "lock = RunLock(Path(sys.argv[1]), 'r', 'extract', part='complete'); lock.acquire(); print('held', flush=True); "
         "sys.stdin.readline(); lock.release()", str(store)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "held"
    appending = subprocess.Popen(
        [sys.executable, "-m", "attngeom.cli", "extract", "--model", str(folder), "--dataset", str(word_corpus),
         "-L", "16", "-S", "5", "--store", str(store), "--run", "r", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    waiting = appending.stderr.readline()
    assert waiting.startswith("attngeom: waiting for the extract of run r held by "), waiting
    holder.communicate("go\n", timeout=60)
    out, err = appending.communicate(timeout=300)
    assert appending.returncode == 0, err
    assert "waiting for" not in err and "wrote 3 sequences" in out
    a, b = open_run(reference), open_run(store)
    for name in ("tokens", "values", "attn_last", "winner", "entropy"):
        np.testing.assert_array_equal(a[name].values, b[name].values)
    assert not (store / "leases").exists() and validate_store(str(store)) == []
