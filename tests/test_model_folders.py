"""A researcher's own checkpoint: tiny random models of several families saved with
``save_pretrained`` alone (no tokenizer), through extract (a corpus, token ids), report,
ablate and detect, from the command line and from Python; and a stranger's folder (counts no
machine could hold, weights not whole or unreadable) refused in one line."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import cli_in_fresh_process, tiny_tokenizer
from families import family_config

import attngeom as ag
from attngeom.cli import main

pytestmark = pytest.mark.needs_model

L = 40  # detect's default needle of 16 tokens fits (L >= 34)
# The kinds of model whose run holds other layers than 0..n-1, or other arrays: a hybrid
# (softmax layers 1 and 3 of 4), layers without positions, learned sinks; and a plain one.
KINDS = {"hybrid": "qwen3_next", "nope": "smollm3", "sinks": "gpt_oss", "plain": "gpt2"}


def _save(model_type: str, folder: Path, **config: object) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    made = family_config(model_type)
    for key, value in config.items():
        setattr(made, key, value)
    AutoModelForCausalLM.from_config(made, dtype=torch.float32).save_pretrained(folder)
    return folder


def _ids(first: int = 1, rows: int = 3, seed: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(3, 100, size=(rows, L))
    ids[:, 0] = first
    return ids


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each kind's folder, saved without a tokenizer; and ids.npy, three rows of L tokens
    starting with the configs' BOS (1)."""
    root = tmp_path_factory.mktemp("folders")
    made = {kind: _save(model_type, root / kind) for kind, model_type in KINDS.items()}
    np.save(root / "ids.npy", _ids())
    made["ids"] = root / "ids.npy"
    return made


@pytest.fixture(scope="module")
def extracted(folders, tmp_path_factory) -> Path:
    """A store with one run of each kind, extracted from the token ids on the command line."""
    store = tmp_path_factory.mktemp("store") / "s.zarr"
    for kind in KINDS:
        result = CliRunner().invoke(main, ["extract", "--model", str(folders[kind]), "--token-ids",
                                           str(folders["ids"]), "--store", str(store), "--run", kind, "--no-progress"])
        assert result.exit_code == 0, result.output
    return store


def test_a_corpus_for_a_folder_without_a_tokenizer_is_refused_in_one_line_before_anything_loads(folders, tmp_path):
    """A corpus needs a tokenizer: the refusal names the folder and both remedies, in the
    words of the command line (in a fresh interpreter, with neither torch nor transformers
    imported) and of Python; a --tokenizer folder that holds none is refused the same way."""
    plain = str(folders["plain"])
    store = str(tmp_path / "s.zarr")
    corpus = ["extract", "--model", plain, "--dataset", "wiki-summaries", "-L", "32", "-S", "2", "--store", store]
    answers = cli_in_fresh_process([corpus, [*corpus, "--tokenizer", str(folders["hybrid"])]])
    said = ("none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...; a model saved alone "
            "has none")
    assert [(code, output) for code, output, _ in answers] == [
        (2, f"attngeom: error: model {plain} has no tokenizer ({said}) to window a corpus with: give one with "
            "--tokenizer (a name or folder), or extract from token ids with --token-ids\n"),
        (2, f"attngeom: error: tokenizer folder {folders['hybrid']} holds no tokenizer (none of tokenizer.json, "
            "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, spiece.model, sentencepiece.bpe.model, "
            "tokenizer.tiktoken)\n"),
    ]
    assert all("torch" not in heavy and "transformers" not in heavy for _, _, heavy in answers), answers
    with pytest.raises(ag.InputError, match=r"give one with tokenizer= \(a name or folder\), or extract from token "
                                            r"ids with token_ids=$"):
        ag.extract(plain, dataset="wiki-summaries", context_length=32, num_sequences=2, store=store, progress=False)
    assert not Path(store).exists()


def test_a_folder_with_a_tokenizer_given_extracts_a_corpus(folders, word_corpus, tmp_path):
    """--tokenizer gives a folder saved without one its tokenizer: the run records it and
    decodes with it; ids it gives beyond the model's vocabulary are refused."""
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    store = tmp_path / "s.zarr"
    args = ["extract", "--model", str(folders["plain"]), "--dataset", str(word_corpus), "-L", "16", "-S", "2",
            "--store", str(store), "--run", "r", "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--tokenizer", str(tmp_path / "tok")])
    assert result.exit_code == 0, result.output
    run = ag.open_store(store).run("r")
    assert run.provenance["tokenizer"]["name_or_path"] == str(tmp_path / "tok")
    tokens = run.dataset()["tokens"].values[0]
    assert run.text(0) == tokenizer.decode(tokens.tolist()) and tokens[0] == 1
    with pytest.raises(ag.InputError, match=r"outside the model's vocabulary \[0, 50\): give the model's own "
                                            r"tokenizer with tokenizer=$"):
        small = _save("gpt2", tmp_path / "small", vocab_size=50)
        ag.extract(small, tokenizer=str(tmp_path / "tok"), dataset=str(word_corpus), context_length=16,
                   num_sequences=2, store=str(tmp_path / "small.zarr"), progress=False)


def test_token_ids_need_no_tokenizer_and_the_run_records_none(folders, extracted):
    """Every kind extracts from --token-ids as given; its provenance records no tokenizer and
    the config's BOS; text() says it has none in one line, and decodes with one given."""
    ids = np.load(folders["ids"])
    for kind in KINDS:
        run = ag.open_store(extracted).run(kind)
        assert run.provenance["tokenizer"] is None and run.provenance["bos_token_id"] == 1, kind
        np.testing.assert_array_equal(run.dataset()["tokens"].values, ids)
    with pytest.raises(ag.InputError, match=r"^run 'plain' was extracted from token ids without a tokenizer \(its "
                                            r"provenance records none\): pass tokenizer= to decode its tokens$"):
        ag.open_store(extracted).run("plain").text(0)
    tokenizer = tiny_tokenizer()
    assert ag.open_store(extracted).run("plain").text(1, tokenizer) == tokenizer.decode(ids[1].tolist())


def test_a_tokenizer_that_cannot_be_read_is_left_out_of_token_ids_and_refuses_a_corpus(folders, tmp_path):
    """A folder whose tokenizer file is damaged: token ids are extracted without it, said in
    one warning, the run recording none; a corpus is refused in one line."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in folders["plain"].iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "tokenizer.json").write_text("{not json")
    store = tmp_path / "s.zarr"
    ids = CliRunner().invoke(main, ["extract", "--model", str(broken), "--token-ids", str(folders["ids"]),
                                    "--store", str(store), "--run", "r", "--no-progress"])
    assert ids.exit_code == 0, ids.output
    assert re.fullmatch(rf"attngeom: warning: the tokenizer of {broken} cannot be loaded \(JSONDecodeError: .*\): "
                        "extracting the token ids without it", ids.stderr.strip())
    assert ag.open_store(store).run("r").provenance["tokenizer"] is None
    corpus = CliRunner().invoke(main, ["extract", "--model", str(broken), "--dataset", "wiki-summaries", "-L", "16",
                                       "-S", "2", "--store", str(store), "--no-progress"])
    assert corpus.exit_code == 2 and len(corpus.output.splitlines()) == 1
    assert corpus.output.startswith(f"attngeom: error: the tokenizer of {broken} cannot be loaded (JSONDecodeError")


def test_one_bos_rule_said_in_the_callers_words(folders, tmp_path):
    """Rows starting elsewhere than the config's BOS are refused naming their option; a config
    that names no BOS takes the token every row starts with, said in one warning; rows
    starting with different tokens are then refused: never a raw ValueError."""
    plain = str(folders["plain"])
    np.save(tmp_path / "seven.npy", _ids(first=7))
    args = ["extract", "--model", plain, "--token-ids", str(tmp_path / "seven.npy"), "--store", str(tmp_path / "s.zarr"),
            "--no-progress"]
    refused = CliRunner().invoke(main, args)
    assert (refused.exit_code, refused.output) == (2, "attngeom: error: --token-ids rows 0, 1, 2 do not start with "
                                                      "the BOS token 1 (the model config's bos_token_id; position 0 "
                                                      "is BOS: docs/method.md#preprocessing)\n")
    with pytest.raises(ag.InputError, match=r"^token_ids rows 0, 1, 2 do not start with the BOS token 1"):
        ag.extract(plain, token_ids=_ids(first=7), store=str(tmp_path / "s.zarr"), progress=False)

    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    for file in folders["plain"].iterdir():
        (unnamed / file.name).write_bytes(file.read_bytes())
    config = json.loads((unnamed / "config.json").read_text())
    config["bos_token_id"] = None
    (unnamed / "config.json").write_text(json.dumps(config))
    args[2] = str(unnamed)
    taken = CliRunner().invoke(main, [*args, "--run", "seven"])
    assert taken.exit_code == 0, taken.output
    assert taken.stderr.splitlines()[-1] == ("attngeom: warning: neither the tokenizer nor the model's config names a "
                                            "BOS token: taking token 7, which every row of the token ids starts "
                                            "with, as the BOS")
    assert ag.open_store(tmp_path / "s.zarr").run("seven").provenance["bos_token_id"] == 7
    mixed = _ids(first=7)
    mixed[2, 0] = 9
    np.save(tmp_path / "mixed.npy", mixed)
    args[4] = str(tmp_path / "mixed.npy")
    refused = CliRunner().invoke(main, args)
    assert (refused.exit_code, refused.output) == (2, "attngeom: error: neither the tokenizer nor the model's config "
                                                      "names a BOS token, and the rows of --token-ids start with "
                                                      "different tokens (row 0 with 7, row 2 with 9): start every row "
                                                      "with the model's BOS\n")


@pytest.mark.parametrize("kind", ["hybrid", "nope", "sinks"])
def test_a_run_finds_its_own_model_again(kind, folders, extracted):
    """ablate --model with the folder a run was extracted from passes the check of its
    layers (the hybrid's softmax layers 1 and 3 of 4 included) and runs; another kind's
    folder is refused in one line before torch loads, naming the layers."""
    ran = CliRunner().invoke(main, ["ablate", "--store", str(extracted), "--run", kind, "--model", str(folders[kind]),
                                    "--retention", "1.0", "--random-masks", "0", "--no-progress"])
    assert ran.exit_code == 0, ran.output
    assert ag.open_store(extracted).run(kind).ablation("single")["delta_nll"].shape[:2] == (
        2 if kind == "hybrid" else 3, 4)
    other = "plain" if kind == "hybrid" else "hybrid"
    refused = CliRunner().invoke(main, ["ablate", "--store", str(extracted), "--run", kind,
                                        "--model", str(folders[other])])
    # GPT-2's config declares no layer kinds: its layers are all softmax attention.
    layers = "3 layers (the run's include layer 3)" if kind == "hybrid" else \
        "softmax-attention layers 1, 3 of 4 (the run's: 0-2)"
    assert refused.exit_code == 2 and refused.output.startswith(
        f"attngeom: error: model {folders[other]} is not the model of run '{kind}': its architecture"), refused.output
    assert layers in refused.output


@pytest.mark.parametrize("kind", ["plain", "sinks"])
def test_detect_runs_on_a_run_without_a_tokenizer(kind, extracted):
    """A run that records no tokenizer: detect draws its probes from the model's embedding
    rows without the config's special ids, and records that rule."""
    result = CliRunner().invoke(main, ["detect", "--store", str(extracted), "--run", kind, "--probes", "2",
                                       "--haystacks", "2", "--needle-length", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    scores = ag.open_store(extracted).run(kind).detect("scores")
    recorded = scores.attrs["attngeom"]
    assert recorded["vocabulary_rule"].endswith("(the run records no tokenizer)")
    assert recorded["vocabulary_size"] == 100 - 3  # bos 1, eos 2, pad 0
    probes = ag.open_store(extracted).run(kind).detect("probes")["probe_tokens"].values
    assert (probes[:, 0] == 1).all() and (probes[:, 1:] > 2).all()


def test_detect_draws_from_a_tokenizer_given(extracted, tmp_path):
    """--tokenizer gives detect the vocabulary to draw from (without its special tokens), and
    is one of the parameters its results depend on: a rerun without it computes again."""
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    args = ["detect", "--store", str(extracted), "--run", "nope", "--probes", "2", "--haystacks", "2",
            "--needle-length", "4", "--no-progress"]
    given = CliRunner().invoke(main, [*args, "--tokenizer", str(tmp_path / "tok")])
    assert given.exit_code == 0, given.output
    recorded = ag.open_store(extracted).run("nope").detect("scores").attrs["attngeom"]
    assert recorded["tokenizer"] == str(tmp_path / "tok") and recorded["vocabulary_size"] == 90  # w0..w89
    assert (ag.open_store(extracted).run("nope").detect("probes")["probe_tokens"].values[:, 1:] >= 4).all()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "written" in again.output, again.output
    assert "tokenizer" not in ag.open_store(extracted).run("nope").detect("scores").attrs["attngeom"]


def test_every_command_the_report_or_validate_suggests_runs_as_printed(folders, tmp_path):
    """The report of a store holding a run of a named folder and one of a model in memory
    (loaded from that folder) names a command per missing stage and run, with --model where
    the run needs it; each runs as printed, and then the report lacks nothing they add. A
    damaged detect group of the run of a model in memory: validate names the command that
    rewrites it, which runs as printed."""
    from transformers import AutoModelForCausalLM

    store = tmp_path / "s.zarr"
    ag.extract(str(folders["plain"]), token_ids=_ids(), store=str(store), run_id="named", progress=False)
    in_memory = AutoModelForCausalLM.from_pretrained(folders["plain"])
    ag.extract(in_memory, token_ids=_ids(seed=1), store=str(store), run_id="memory", progress=False)
    ran: list[str] = []
    for attempt in range(4):  # a stage's results may show what the next one would add
        missing = ag.report(store, tmp_path / f"report{attempt}").missing
        commands = [c for line in missing for c in re.findall(r"`(attngeom [^`]+)`", line)]
        if not commands:
            break
        for command in commands:
            assert command not in ran, (command, missing)
            result = CliRunner().invoke(main, [*shlex.split(command)[1:], "--no-progress"])
            assert result.exit_code == 0, (command, result.output)
            ran.append(command)
    assert not commands, missing
    runs = f"attngeom {{}} --store {store} --run {{}}"
    assert sorted(ran) == sorted([
        f"attngeom analyze --store {store}", runs.format("ablate", "named"), runs.format("detect", "named"),
        runs.format("ablate", "memory") + f" --model {folders['plain']}",
        runs.format("detect", "memory") + f" --model {folders['plain']}",
    ])

    chunk = next(p for p in sorted((store / "runs/memory/detect/scores/induction_score").rglob("*"))
                 if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(b"")
    checked = CliRunner().invoke(main, ["validate", "--store", str(store)])
    assert checked.exit_code == 1
    (command,) = re.findall(r"`(attngeom [^`]+)`", checked.output)
    assert command == runs.format("detect", "memory") + f" --model {folders['plain']}", checked.output
    result = CliRunner().invoke(main, [*shlex.split(command)[1:], "--no-progress"])
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(main, ["validate", "--store", str(store)]).exit_code == 0


def test_explore_shows_ids_for_a_run_without_a_tokenizer(folders, extracted):
    """explore decodes no token of a run extracted without a tokenizer, nor with the empty
    stand-in transformers would build for its folder: it says why, and shows ids."""
    from attngeom.explore.data import token_decoder

    provenance = ag.open_store(extracted).run("plain").provenance
    assert token_decoder(provenance) == (None, "the run was extracted from token ids without a tokenizer")
    recorded = {**provenance, "tokenizer": {"name_or_path": str(folders["plain"])}}
    assert token_decoder(recorded) == (None, f"{folders['plain']} holds no tokenizer")


# ------------------------------------------------------------------ a stranger's model folder


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
    result = CliRunner().invoke(main, ["check-model", str(folder), "--device", "cpu"])
    code, lines = result.exit_code, result.output.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"attngeom: error: the weights of {folder} cannot be read: Error while deserializing "
                               "header: "), lines
    assert lines[0].endswith("; download or save the model again"), lines
