"""The Python API (docs/api.md): in-memory models captured from texts and token ids equal their
own eager attention and are left as given; API and CLI write identical stores; open_store
reads runs back; errors come by kind; the README's example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
import xarray as xr
from click.testing import CliRunner
from conftest import WORDS, tiny_config, tiny_tokenizer

import attngeom as ag
from attngeom.cli import main

L = 16


def memory_model(arch: str, attn: str = "eager") -> torch.nn.Module:
    """A tiny random model built in memory (never saved), with its own attention implementation."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32, attn_implementation=attn)


def eager_reference(model: torch.nn.Module, ids: torch.Tensor):
    """Eager attention rows (B, H, L, L) per layer of this same model object, and its value
    states (B, KV, L, Dh) from v_proj hooks."""
    values, hooks = {}, []
    for i, layer in enumerate(model.get_decoder().layers):
        attn = layer.self_attn

        def hook(mod, inp, out, i=i, attn=attn):
            values[i] = out.view(out.shape[0], out.shape[1], -1, attn.head_dim).transpose(1, 2)

        hooks.append(attn.v_proj.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model.get_decoder()(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.attentions, values


def texts(n: int = 6, words: int = 40) -> list[str]:
    rng = np.random.default_rng(1)
    return [" ".join(rng.choice(WORDS, size=words - 2 * i)) for i in range(n)]


def assert_equals_eager(store: str, run_id: str, model: torch.nn.Module) -> None:
    ds = ag.open_store(store).run(run_id).dataset()
    tokens = torch.from_numpy(ds["tokens"].values.astype("int64"))
    rows, values = eager_reference(model, tokens)
    head_kv = ds["head_kv"].values
    for layer in range(ds.sizes["layer"]):
        a, v = rows[layer].numpy(), values[layer].numpy()
        np.testing.assert_allclose(ds["values"].isel(layer=layer).values, v, atol=1e-6)
        np.testing.assert_allclose(ds["attn_last"].isel(layer=layer).values, a[:, :, -1], atol=1e-5)
        np.testing.assert_allclose(ds["attn"].isel(layer=layer).values, a, atol=1e-3)
        score = a * np.linalg.norm(v, axis=-1)[:, head_kv, None, :]
        np.testing.assert_array_equal(ds["winner"].isel(layer=layer).values, score.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_memory_model_from_texts_and_token_ids_equals_its_eager_attention(arch, tmp_path):
    model = memory_model(arch).train()  # given in train mode: captured in eval, left in train
    tokenizer = tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    store = str(tmp_path / "s.zarr")

    result = ag.extract(model, tokenizer=tokenizer, texts=texts(), context_length=L, store=store,
                        run_id="texts", store_rows="all", progress=False)
    assert (result.written, result.total) == (6, 6)
    assert_equals_eager(store, "texts", model.eval())

    ids = np.random.default_rng(2).integers(4, 100, size=(3, L))
    ids[:, 0] = 1
    model.train()
    ag.extract(model, token_ids=torch.from_numpy(ids), store=store, run_id="ids", store_rows="all", progress=False)
    run = ag.open_store(store).run("ids")
    np.testing.assert_array_equal(run.dataset()["tokens"].values, ids)
    assert_equals_eager(store, "ids", model.eval())

    assert model.config._attn_implementation == "eager"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    prov = run.provenance["model"]
    assert prov["source"] == "memory"
    assert prov["class"].endswith("ForCausalLM") and prov["config"]["model_type"] == tiny_config(arch).model_type
    assert re.fullmatch(r"[0-9a-f]{64}", prov["state_dict_sha256"])
    assert run.provenance["tokenizer"] is None  # token ids given without a tokenizer
    assert sorted(ag.open_store(store).runs) == ["ids", "texts"]


def test_state_dict_digest_follows_the_weights():
    """The in-memory model's sha256 is that of its state dict's names, dtypes, shapes and bytes;
    kept while the model is unchanged, new after an in-place update or a replaced tensor."""
    import hashlib

    from attngeom.extract.models import state_dict_sha256

    def independent(model):
        digest = hashlib.sha256()
        for name, t in model.state_dict().items():
            digest.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
            digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    model = memory_model("llama")
    first = state_dict_sha256(model)
    assert first == independent(model) == state_dict_sha256(model)
    weight = model.get_decoder().layers[0].self_attn.q_proj.weight
    original = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = original + 1.0
    changed = state_dict_sha256(model)
    assert changed == independent(model) != first
    weight.data = weight.data.clone()
    with torch.no_grad():
        weight.data[0, 0] = original  # a new tensor at version 1, as the one before: seen by its address
    assert state_dict_sha256(model) == independent(model) == first


@pytest.mark.parametrize("own", ["eager", "sdpa"])
def test_memory_model_attention_and_mode_restored_even_on_failure(own, tmp_path):
    model = memory_model("llama", attn=own).train()
    ids = np.ones((2, L), dtype=np.int64)
    ag.extract(model, token_ids=ids, store=str(tmp_path / "a.zarr"), progress=False)
    assert model.config._attn_implementation == own and model.training

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    # A forward that fails mid-way still gives the model back as it was.
    handle = model.get_decoder().layers[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        ag.extract(model, token_ids=ids, store=str(tmp_path / "b.zarr"), progress=False)
    handle.remove()
    assert model.config._attn_implementation == own and model.training
    with torch.no_grad():
        ag.extract(model, token_ids=ids, store=str(tmp_path / "c.zarr"), progress=False)
        model.eval()
        logits = model(input_ids=torch.from_numpy(ids)).logits
    with torch.no_grad():
        again = memory_model("llama", attn=own).eval()(input_ids=torch.from_numpy(ids)).logits
    torch.testing.assert_close(logits, again, rtol=0, atol=0)


def test_memory_model_input_errors_by_kind(tmp_path):
    model = memory_model("llama")
    store = str(tmp_path / "s.zarr")
    ids = np.ones((5, L), dtype=np.int64)
    ids[[1, 3], 0] = 7
    with pytest.raises(ag.InputError, match=r"rows 1, 3 do not start with the BOS token 1"):
        ag.extract(model, token_ids=ids, store=store, progress=False)
    with pytest.raises(ag.InputError, match="exactly one input"):
        ag.extract(model, token_ids=ids, texts=["a"], store=store, progress=False)
    with pytest.raises(ag.InputError, match="tokenizer"):
        ag.extract(model, texts=texts(), context_length=L, store=store, progress=False)
    with pytest.raises(ag.InputError, match=r"texts is a list of documents \(strings\), not one string"):
        ag.extract(model, tokenizer=tiny_tokenizer(), texts=texts()[0], context_length=L, store=store, progress=False)
    with pytest.raises(ag.InputError, match="does not cast"):
        ag.extract(model, token_ids=np.ones((1, L), dtype=np.int64), dtype="bfloat16", store=store, progress=False)
    with pytest.raises(ag.InputError, match="outside the vocabulary"):
        ag.extract(model, token_ids=np.full((1, L), 1000), store=store, progress=False)
    with pytest.raises(ag.UnsupportedModelError, match="with causal = False: its attention is not causal"):
        from transformers import XLMConfig, XLMWithLMHeadModel

        ag.extract(XLMWithLMHeadModel(XLMConfig(n_layers=1, emb_dim=8, n_heads=2, vocab_size=100, causal=False,
                                                bos_index=1)), token_ids=ids, store=store)
    assert not Path(store).exists()

    # The same run id with another model (edited weights) is refused, the store untouched.
    good = np.ones((2, L), dtype=np.int64)
    ag.extract(model, token_ids=good, store=store, run_id="r", progress=False)
    with torch.no_grad():
        model.get_decoder().layers[0].self_attn.o_proj.weight.mul_(2)
    with pytest.raises(ag.InputError, match="the weights of model .* differ from those the run was extracted from"):
        ag.extract(model, token_ids=good, store=store, run_id="r", progress=False)


def test_ablate_a_run_of_a_memory_model(tmp_path):
    model = memory_model("llama", attn="sdpa")
    ids = np.random.default_rng(4).integers(4, 100, size=(4, L))
    ids[:, 0] = 1
    store = str(tmp_path / "s.zarr")
    ag.extract(model, token_ids=ids, store=store, run_id="m", progress=False)
    options = dict(device="cpu", retention=(1.0, 0.5), random_masks=1, progress=False)
    with pytest.raises(ag.InputError, match="as model="):
        ag.ablate(store, "m", **options)
    with pytest.warns(UserWarning, match="type-guided sparsification skipped"):
        out = ag.ablate(store, "m", model=model, **options)
    assert out.single["delta_nll"].shape == (3, 4, 2)
    stored = ag.open_store(store).run("m").ablation("single").load()
    np.testing.assert_array_equal(stored["delta_nll_mean"].values, out.single["delta_nll_mean"].values)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        model.get_decoder().layers[0].self_attn.o_proj.weight.mul_(2)
    with pytest.raises(ag.InputError, match="not the one run 'm' was extracted with"):
        ag.ablate(store, "m", model=model, **options)


def test_api_and_cli_write_identical_stores(tiny_model_dir, word_corpus, tmp_path):
    folder = tiny_model_dir("gemma3")
    cli_store, api_store = str(tmp_path / "cli.zarr"), str(tmp_path / "api.zarr")
    result = CliRunner().invoke(main, ["extract", "--model", str(folder), "--dataset", str(word_corpus), "-L", str(L),
                                       "-S", "4", "--store", cli_store, "--batch-size", "3", "--no-progress"])
    assert result.exit_code == 0, result.output
    out = ag.extract(str(folder), dataset=str(word_corpus), context_length=L, num_sequences=4, store=api_store,
                     batch_size=3, progress=False)
    assert ag.open_store(cli_store).runs == ag.open_store(api_store).runs == [out.run_id]
    a, b = (ag.open_store(s).run(out.run_id) for s in (cli_store, api_store))
    xr.testing.assert_identical(a.dataset().load(), b.dataset().load())
    pa, pb = a.provenance, b.provenance
    assert {k: v for k, v in pa.items() if k != "command_line"} == {k: v for k, v in pb.items() if k != "command_line"}

    # analyze through the CLI and the API: the same topn Dataset.
    assert CliRunner().invoke(main, ["analyze", "--store", cli_store, "--scheduler", "threads", "--no-progress"]).exit_code == 0
    [analyzed] = ag.analyze(api_store, scheduler="threads", progress=False)
    assert analyzed.sequences == 4
    xr.testing.assert_identical(a.analysis("topn").load(), b.analysis("topn").load())
    assert str(ag.taxonomy(api_store)) in CliRunner().invoke(main, ["taxonomy", "--store", cli_store]).output
    assert ag.validate(api_store).valid and ag.validate(api_store).problems == ()


def test_open_store_reads_runs_and_errors_by_kind(tiny_model_dir, word_corpus, tmp_path):
    folder = tiny_model_dir("llama")
    store = str(tmp_path / "s.zarr")
    with pytest.raises(ag.StoreNotFoundError):
        ag.open_store(store)
    ag.extract(str(folder), dataset=str(word_corpus), context_length=L, num_sequences=2, store=store, run_id="r",
               progress=False)
    st = ag.open_store(store)
    run = st.run("r")
    assert run.provenance["model"]["id"] == str(folder.resolve())
    assert run.dataset().sizes["seq"] == 2
    text = run.text(1)
    assert text.startswith("<bos>") and len(text.split()) >= L - 1
    with pytest.raises(ag.RunNotFoundError, match="runs: r"):
        st.run("nope")
    with pytest.raises(ag.GroupNotFoundError, match=r"has no analysis \(run `attngeom analyze --store "):
        run.analysis("topn")
    with pytest.raises(ag.InputError, match="no group 'nope'"):
        run.analysis("nope")
    with pytest.raises(ag.StoreError):  # every store kind is a StoreError, every kind an AttngeomError
        run.ablation("single")
    with pytest.raises(ag.InputError, match="not committed"):
        run.text(5)


def test_import_attngeom_loads_no_torch_and_stage_names_stay_callable():
    code = (
        "import sys, attngeom as ag\n"
        "assert not {'torch', 'transformers', 'zarr', 'matplotlib'} & set(sys.modules), sorted(sys.modules)\n"
        "import attngeom.extract.pipeline as p, attngeom.analyze.runner, attngeom.report.build\n"
        "from attngeom.ablate import ablate, AblateRequest\n"
        "assert callable(ag.extract) and callable(ag.analyze) and callable(ag.ablate) and callable(ag.report)\n"
        "assert ag.extract.pipeline is p\n"
        "import inspect; assert 'token_ids' in inspect.signature(ag.extract).parameters\n"
        "assert set(ag.__all__) <= set(dir(ag)) and all(hasattr(ag, n) for n in ag.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def readme_examples() -> list[str]:
    """The README's worked example: the python blocks of its "Python" section."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("given", ["memory", "path"])
def test_readme_example_runs_as_written(given, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Both blocks, as written: the hub is simulated by a tiny random Llama, then the model
    is the one in memory or, as a named model, that model saved to a folder."""
    import matplotlib
    from transformers import AutoModelForCausalLM, AutoTokenizer

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    for i in range(3):
        (tmp_path / "notes" / f"{i}.txt").write_text(" ".join(np.random.default_rng(i).choice(WORDS, size=140)))
    setup, example = readme_examples()[:2]
    scope: dict = {}
    with monkeypatch.context() as hub:
        hub.setattr(AutoModelForCausalLM, "from_pretrained", lambda name: memory_model("llama", attn="sdpa"))
        hub.setattr(AutoTokenizer, "from_pretrained", lambda name: tiny_tokenizer())
        exec(compile(setup, "README.md", "exec"), scope)
    folder = tiny_model_dir("llama")
    if given == "path":
        scope["model"] = str(folder)
    exec(compile(example, "README.md", "exec"), scope)
    assert (tmp_path / "precision.png").stat().st_size > 0
    topn = scope["topn"]
    assert topn.sizes["seq"] == 3 and list(topn["n"].values) == [1, 2, 4, 8, 16, 32, 64]
    assert scope["analyzed"].sequences == 3
    printed = capsys.readouterr().out.split()
    assert printed[0] == "3" and printed[1] == "<bos>"
    assert printed[-1] == (str(folder.resolve()) if given == "path" else "LlamaForCausalLM")
    if given == "memory":
        assert scope["model"].config._attn_implementation == "sdpa"


def test_readme_blocks_on_the_store_run_as_written(tmp_path, monkeypatch):
    """The README's other python blocks, which read `runs.zarr` (its first command's store)
    given the run id, on a synthetic store of that run."""
    from attngeom.extract.synthetic import write_synthetic_run

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    python = readme.split("## Python", 1)[1].split("\n## ", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", python, flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    run_id = "gemma3-270m__wiki-summaries__L128"
    write_synthetic_run("runs.zarr", run_id, n_seq=2, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=16)
    ag.analyze("runs.zarr", scheduler="threads", progress=False)
    scope = {"run_id": run_id}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["ds"].sizes["seq"] == 2 and scope["topn"].sizes["seq"] == 2


def test_a_script_without_main_guard_analyzes(tmp_path):
    """Worker processes (forked by default) do not run the caller's script again."""
    script = tmp_path / "notebook_like.py"
    script.write_text(
        "import numpy as np, torch, attngeom as ag\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "open('runs.log', 'a').write('top level ran\\n')\n"
        "torch.manual_seed(0)\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
        "                                     num_attention_heads=2, num_key_value_heads=1, bos_token_id=1))\n"
        "ids = np.random.default_rng(0).integers(2, 64, size=(2, 12)); ids[:, 0] = 1\n"
        "result = ag.extract(model, token_ids=ids, store='s.zarr', progress=False)\n"
        "ag.analyze('s.zarr', progress=False)\n"
        "print(ag.open_store('s.zarr').run(result.run_id).analysis('topn').sizes['seq'])\n"
    )
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2"]
    assert (tmp_path / "runs.log").read_text() == "top level ran\n"


@pytest.mark.parametrize("name", ag.STAGES)
def test_help_of_a_stage_shows_its_function(name):
    """help(ag.extract) documents the function the call runs: its signature and docstring."""
    import inspect
    import pydoc

    function = getattr(ag.api, name)
    text = pydoc.render_doc(getattr(ag, name), renderer=pydoc.plaintext)
    assert f"{name}{inspect.signature(function)}" in text
    assert all(f"{p}:" in text for p in inspect.signature(function).parameters)
    assert inspect.getdoc(function).splitlines()[0] in text


def test_a_missing_dataset_is_said_before_the_model_is_looked_at(tmp_path, monkeypatch):
    import attngeom.extract.inputs as inputs

    def no_model(*args, **kwargs):
        raise AssertionError("the model was resolved before the dataset was checked")

    monkeypatch.setattr(inputs, "resolve_model", no_model)
    missing = str(tmp_path / "notes.txt")
    result = CliRunner().invoke(main, ["extract", "--model", "smollm2-135m", "--dataset", missing, "-L", "16",
                                       "-S", "2", "--store", str(tmp_path / "s.zarr")])
    assert (result.exit_code, result.output) == (2, f"attngeom: error: no such file or folder: {missing}\n")
    assert not (tmp_path / "s.zarr").exists()


def test_a_mistyped_model_name_fails_at_once_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    """The hub is probed once per process (simulated here: no test reaches the network); an
    unreachable one is asked nothing, so no retries, and the error says why in one line."""
    import socket

    from huggingface_hub import constants
    from transformers import AutoConfig

    from attngeom.extract import models

    probes, asked = [], []

    def unreachable(address, timeout):
        probes.append((address, timeout))
        raise OSError("Name or service not known")

    def from_pretrained(name, local_files_only):
        asked.append(local_files_only)
        raise OSError(f"{name} is not in the cache")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    models.hub_address.cache_clear()
    try:
        offline = ("unknown model 'smollm2-13m': not an offline name (gemma3-270m, smollm2-135m), not a local "
                   "folder or .gguf file, is not in the local hub cache, and the hub cannot be reached (offline)")
        for _ in range(2):
            with pytest.raises(ag.InputError) as caught:
                models.resolve_model("smollm2-13m")
            assert str(caught.value) == offline
        assert len(probes) == 1 and probes[0][1] == 3 and asked == [True, True]
        result = CliRunner().invoke(main, ["extract", "--model", "smollm2-13m", "--dataset", "wiki-summaries",
                                           "-L", "16", "-S", "1", "--store", str(tmp_path / "s.zarr")])
        assert (result.exit_code, result.output) == (2, f"attngeom: error: {offline}\n")

        # A hub that answers is asked, and its answer named.
        monkeypatch.setattr(socket, "create_connection", lambda address, timeout: socket.socket())
        models.hub_address.cache_clear()
        with pytest.raises(ag.InputError, match=r"and the hub \(.+:\d+\) could not resolve it \(OSError\)$"):
            models.resolve_model("org/smollm2-13m")
        assert asked[-1] is False
    finally:
        models.hub_address.cache_clear()
