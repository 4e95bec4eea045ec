"""detect on tiny random models: every score against an eager float64 twin on the stored inputs,
the inputs' layout, planted answers, the CLI's refusals, resume and damage; and a real model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")
from click.testing import CliRunner
from conftest import WORDS, assert_tensorstore_reads, cli_in_fresh_process

import attngeom as ag
from attngeom.cli import main
from attngeom.detect.inputs import insert_position, probe_tokens, retrieval_samples, vocabulary
from attngeom.detect.scores import probe_sums, retrieval_hits
from attngeom.errors import IncompleteGroupError
from attngeom.extract.pipeline import ExtractRequest, extract
from attngeom.store import open_dataset, validate_store
from attngeom.store.session import StoreSession

L, S, N, HAYSTACKS, PROBES = 40, 4, 8, 3, 5
SCORES = ("duplicate_score", "induction_score", "prev_token_score", "retrieval_score")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def windows() -> np.ndarray:
    """S windows of L tokens: the tiny tokenizer's BOS (1), then ids of its words (4-93).
    Given as token ids: the tiny word-level tokenizer does not survive every family's
    tokenizer class."""
    ids = np.random.default_rng(1).integers(4, 4 + len(WORDS), size=(S, L))
    ids[:, 0] = 1
    return ids


def detect(store, **options):
    given = {"device": "cpu", "probes": PROBES, "needle_length": N, "haystacks": HAYSTACKS, "progress": False}
    return ag.detect(str(store), "r", **{**given, **options})


@pytest.fixture(scope="module")
def detected(tiny_model_dir, tmp_path_factory):
    """Factory: (model folder, store) of a tiny model's run r (S sequences at L), detected."""
    made = {}

    def make(arch: str):
        if arch not in made:
            folder = tiny_model_dir(arch)
            store = tmp_path_factory.mktemp(f"detect-{arch}") / "s.zarr"
            extract(ExtractRequest(model=str(folder), token_ids=windows(), store=str(store), run_id="r",
                                   progress=False))
            detect(store)
            made[arch] = folder, store
        return made[arch]

    return make


def eager_rows(folder, ids: np.ndarray) -> list[np.ndarray]:
    """Every layer's attention (B, H, L, L) of a plain eager float64 forward of ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.model(input_ids=torch.from_numpy(ids), output_attentions=True, use_cache=False)
    return [a.numpy() for a in out.attentions]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen2"])
def test_every_score_is_the_eager_float64_twins_on_the_stored_inputs(arch, detected):
    """Mistral and Gemma 2 slide a window of 6 < L (and Gemma 2 softcaps its logits): the
    scores are those of the model's own eager attention, recomputed from the stored inputs."""
    folder, store = detected(arch)
    run = ag.open_store(store).run("r")
    scores, probes, retrieval = (run.detect(name).load() for name in ("scores", "probes", "retrieval"))

    tokens = probes["probe_tokens"].values
    k = (tokens.shape[1] - 1) // 2
    second, every = np.arange(k + 1, 2 * k + 1), np.arange(1, 2 * k + 1)
    rows = eager_rows(folder, tokens)
    want = {
        "duplicate_score": [a[:, :, second, second - k].mean(axis=(0, 2)) for a in rows],
        "induction_score": [a[:, :, second, second - k + 1].mean(axis=(0, 2)) for a in rows],
        "prev_token_score": [a[:, :, every, every - 1].mean(axis=(0, 2)) for a in rows],
    }
    for name, value in want.items():
        np.testing.assert_allclose(scores[name].values, np.stack(value), atol=1e-6, err_msg=name)

    samples = retrieval["retrieval_tokens"].values
    n = int(retrieval["needle_length"])
    starts = retrieval["needle_start"].values
    rows = np.stack(eager_rows(folder, samples))  # (layer, sample, head, L, L)
    final = rows[:, :, :, L - n : L - 1]  # queries holding needle tokens 0 .. n-2
    target = starts[None, :, None, None] + 1 + np.arange(n - 1)
    hit = final.argmax(-1) == target
    # Where the top two keys are within float32 rounding, either answer is the model's.
    top2 = np.sort(final, axis=-1)[..., -2:]
    near_tie = (top2[..., 1] - top2[..., 0]) < 1e-6
    stored = retrieval["retrieval_hits"].values.transpose(1, 0, 2)  # (layer, sample, head)
    assert (np.abs(stored - hit.sum(-1)) <= near_tie.sum(-1)).all()
    assert near_tie.mean() < 0.05  # the comparison is not vacuous
    np.testing.assert_allclose(
        scores["retrieval_score"].values, stored.sum(axis=1) / (len(samples) * (n - 1)), rtol=0, atol=0
    )
    for name in SCORES:
        assert ((scores[name] >= 0) & (scores[name] <= 1)).all(), name


def test_inputs_are_laid_out_as_documented(detected):
    """Probes: BOS, r, r with no special token; samples: BOS, haystack body with the needle
    at its depth, the needle again at the very end, L tokens in all; needles from another
    window at the recorded offset."""
    _, store = detected("llama")
    run = ag.open_store(store).run("r")
    probes, retrieval = run.detect("probes").load(), run.detect("retrieval").load()
    windows = run.dataset()["tokens"].values
    bos = windows[0, 0]

    tokens = probes["probe_tokens"].values
    k = min(128, (L - 1) // 2)
    assert tokens.shape == (PROBES, 2 * k + 1)
    assert (tokens[:, 0] == bos).all() and (tokens[:, 1 : k + 1] == tokens[:, k + 1 :]).all()
    assert tokens[:, 1:].min() >= 4  # the tiny tokenizer's special tokens are 0-3

    samples = retrieval["retrieval_tokens"].values
    depths = list(ag.detect.DEFAULT_DEPTHS)
    assert samples.shape == (HAYSTACKS * len(depths), L)
    assert retrieval["depth"].values.tolist() == depths * HAYSTACKS
    body = L - 1 - 2 * N
    for s, row in enumerate(samples):
        start, hay, source, offset = (int(retrieval[v][s]) for v in ("needle_start", "haystack", "needle_source",
                                                                     "needle_offset"))
        assert start == 1 + round(retrieval["depth"].values[s] * (body - 1) + 1e-9)
        assert source == (hay + 1) % S and 1 <= offset <= L - N
        needle = windows[source, offset : offset + N]
        assert (row[start : start + N] == needle).all() and (row[L - N :] == needle).all()
        assert row[0] == bos
        rest = np.concatenate([row[1:start], row[start + N : L - N]])
        assert (rest == windows[hay, 1 : 1 + body]).all()


def test_planted_rows_give_the_known_scores():
    """Rows whose heads attend exactly where a detector looks: the score is 1 there, 0 elsewhere."""
    k, batch = 5, 2
    length = 2 * k + 1
    rows = torch.zeros(batch, 4, 2 * k, length)
    p = torch.arange(1, 2 * k + 1)
    rows[:, 0, p - 1, torch.clamp(p - k + 1, min=0)] = 1  # induction (first copy: anywhere)
    rows[:, 1, p - 1, torch.clamp(p - k, min=0)] = 1  # duplicate
    rows[:, 2, p - 1, p - 1] = 1  # previous token
    rows[:, 3, :, 0] = 1  # sink
    sums = probe_sums(rows, k)
    assert (sums["induction"] / (batch * k)).tolist() == [1, 0, 0, 0]
    assert (sums["duplicate"] / (batch * k)).tolist() == [0, 1, 0, 0]
    # Query 1's previous token is key 0, where the first copy's planted rows also look.
    assert (sums["prev_token"] / (batch * 2 * k)).tolist() == pytest.approx([1 / (2 * k), 1 / (2 * k), 1, 1 / (2 * k)])

    n, length = 4, 20
    starts = torch.tensor([3, 7])
    rows = torch.full((2, 2, n - 1, length), 0.01)
    for b, start in enumerate(starts.tolist()):
        rows[b, 0, torch.arange(n - 1), start + 1 + torch.arange(n - 1)] = 0.5  # copies the next needle token
        rows[b, 1, torch.arange(n - 1), start + torch.arange(n - 1)] = 0.5  # the same token: a miss
    assert retrieval_hits(rows, starts).tolist() == [[n - 1, 0], [n - 1, 0]]


def test_inputs_are_seeded_and_independent():
    vocab = vocabulary(100, [0, 1, 2, 3])
    assert vocab.tolist() == list(range(4, 100))
    a, b = probe_tokens(vocab, 1, 3, 7, seed=0), probe_tokens(vocab, 1, 5, 7, seed=0)
    assert (a == b[:3]).all() and not (a == probe_tokens(vocab, 1, 3, 7, seed=1)).all()
    windows = np.arange(4 * 40).reshape(4, 40)
    one = retrieval_samples(windows, np.arange(4), 2, 8, [0.1, 0.9], seed=0)
    more = retrieval_samples(windows, np.arange(4), 3, 8, [0.1, 0.9], seed=0)
    assert (one.tokens == more.tokens[:4]).all()
    assert insert_position(0.0, 23) == 1 and insert_position(1.0, 23) == 23 and insert_position(0.5, 23) == 12


def test_a_rerun_keeps_and_other_parameters_recompute(detected, tmp_path):
    _, source = detected("llama")
    store = tmp_path / "s.zarr"
    shutil.copytree(source, store)
    first = ag.open_store(store).run("r").detect().load()
    again = detect(store)
    assert again.kept and again.scores.identical(first)
    other = detect(store, seed=1)
    assert not other.kept
    assert not np.array_equal(other.scores["induction_score"].values, first["induction_score"].values)
    assert ag.open_store(store).run("r").detect().attrs["attngeom"]["seed"] == 1


def test_an_interrupted_detect_is_refused_then_finished_equal(detected, tmp_path, monkeypatch):
    """Killed before its commit (the groups moved into place, the record not yet written):
    readers refuse the group as incomplete, validate names it, a rerun writes the same groups."""
    from attngeom.store.derived_groups.derived import DerivedWrite

    _, source = detected("llama")
    want = {name: ag.open_store(source).run("r").detect(name).load() for name in ("scores", "probes", "retrieval")}
    store = tmp_path / "s.zarr"
    shutil.copytree(source, store)
    shutil.rmtree(store / "runs" / "r" / "detect")

    def killed(self, done):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(DerivedWrite, "_commit", killed)
        with pytest.raises(KeyboardInterrupt):
            detect(store)
    with pytest.raises(IncompleteGroupError):
        ag.open_store(store).run("r").detect()
    (line,) = [p for p in validate_store(str(store)) if "detect of run r is incomplete" in p]
    # The hint repeats the interrupted detect's parameters: following it computes the same.
    hint = line.split("`")[1]
    assert hint == (f"attngeom detect --store {store} --run r --probes {PROBES} --haystacks {HAYSTACKS} "
                    f"--needle-length {N} --depths 0.1,0.3,0.5,0.7,0.9 --seed 0")
    result = CliRunner().invoke(main, [*hint.split()[1:], "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0 and "head scores written" in result.output, result.output
    for name, ds in want.items():
        got = ag.open_store(store).run("r").detect(name).load()
        assert got.drop_attrs().identical(ds.drop_attrs()), name
    assert validate_store(str(store)) == []


def test_a_killed_detect_leaves_the_earlier_results_and_a_rerun_gives_the_same(detected, tmp_path):
    """kill -9 during the forwards of a recomputation (other seed): the earlier results stay
    readable; the rerun's groups equal an uninterrupted detect's."""
    _, source = detected("llama")
    store = tmp_path / "s.zarr"
    shutil.copytree(source, store)
    before = ag.open_store(store).run("r").detect().load()
    script = (
        "import os, sys, attngeom.detect.stage as stage\n"
        "def die(*a, **k): os.kill(os.getpid(), 9)\n"
        "stage._retrieval_hits = die\n"
        "import attngeom as ag\n"
        f"ag.detect(sys.argv[1], 'r', device='cpu', probes={PROBES}, needle_length={N}, haystacks={HAYSTACKS},"
        " seed=1, progress=False)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script, str(store)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == -9, done.stderr
    assert ag.open_store(store).run("r").detect().load().identical(before)
    rerun = detect(store, seed=1)
    fresh = tmp_path / "fresh.zarr"
    shutil.copytree(source, fresh)
    shutil.rmtree(fresh / "runs" / "r" / "detect")
    want = detect(fresh, seed=1)
    assert rerun.scores.drop_attrs().identical(want.scores.drop_attrs())
    assert rerun.retrieval.drop_attrs().identical(want.retrieval.drop_attrs())


@pytest.mark.parametrize("claim, line", [
    (lambda c: c.__setitem__("sequences", [7]), "run r: detect covers sequences [7] the run does not hold as complete"),
    (lambda c: c["parameters"]["haystack_sequences"].append(9),
     "run r: detect parameter 'haystack_sequences' names sequences [9] the run does not hold as complete"),
], ids=["covers", "parameter"])
def test_a_record_claiming_sequences_the_run_lacks_is_named_and_recomputed(detected, tmp_path, claim, line):
    """Its results describe windows the run does not hold: not kept by a rerun."""
    _, source = detected("llama")
    store = tmp_path / "s.zarr"
    shutil.copytree(source, store)
    want = {name: ag.open_store(source).run("r").detect(name).load() for name in ("scores", "probes", "retrieval")}
    record = store / "runs/r/detect/zarr.json"
    document = json.loads(record.read_text())
    claim(document["attributes"]["attngeom"]["commit"])
    record.write_text(json.dumps(document))
    assert line in validate_store(str(store))
    assert not detect(store).kept
    assert validate_store(str(store)) == []
    for name, ds in want.items():
        assert ag.open_store(store).run("r").detect(name).load().drop_attrs().identical(ds.drop_attrs()), name


def test_a_damaged_group_is_named_and_rewritten(detected, tmp_path):
    _, source = detected("llama")
    store = tmp_path / "s.zarr"
    shutil.copytree(source, store)
    chunk = next(p for p in sorted((store / "runs/r/detect/scores/induction_score").rglob("*")) if p.is_file()
                 and p.name != "zarr.json")
    chunk.write_bytes(b"")
    problems = validate_store(str(store))
    assert len(problems) == 1 and "detect/scores/induction_score" in problems[0]
    assert "attngeom detect --store" in problems[0]
    result = detect(store)
    assert not result.kept and validate_store(str(store)) == []
    scores = open_dataset(StoreSession.reading(str(store)).zstore, str(store), "runs/r/detect/scores")
    assert scores["induction_score"].notnull().all()


# --- the command line ---------------------------------------------------------------------------


def test_refusals_are_one_line_before_anything_heavy_loads(detected, tmp_path):
    _, store = detected("llama")
    store = str(store)
    cases = [
        ["detect", "--store", store, "--run", "q"],
        ["detect", "--store", str(tmp_path / "none.zarr"), "--run", "r"],
        ["detect", "--store", store, "--run", "r", "--needle-length", "30"],
        ["detect", "--store", store, "--run", "r", "--needle-length", "1"],
        ["detect", "--store", store, "--run", "r", "--probes", "0"],
        ["detect", "--store", store, "--run", "r", "--depths", "0.5,1.5"],
        ["detect", "--store", store, "--run", "r", "--depths", "x"],
        ["detect", "--store", store],
    ]
    answers = cli_in_fresh_process(cases)
    for args, (code, output, heavy) in zip(cases, answers):
        lines = output.strip().splitlines()
        assert code == 2 and heavy == [], (args, output, heavy)
        assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), (args, output)
    assert "needs L >= 62" in answers[2][1]


def test_the_command_writes_and_names_the_top_heads(detected, tmp_path):
    _, source = detected("qwen2")
    store = tmp_path / "s.zarr"
    shutil.copytree(source, store)
    args = ["detect", "--store", str(store), "--run", "r", "--device", "cpu", "--probes", str(PROBES),
            "--needle-length", str(N), "--haystacks", str(HAYSTACKS), "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "head scores kept (same parameters)" in result.output
    result = CliRunner().invoke(main, [*args, "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "head scores written" in result.output and "induction_score: top heads (layer.head)" in result.output


def test_a_run_of_a_model_in_memory_needs_it(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    store = tmp_path / "s.zarr"
    ag.extract(model, token_ids=windows()[:2], store=str(store), run_id="r", progress=False)
    with pytest.raises(ag.InputError, match="as model="):
        detect(store)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32)
    with pytest.raises(ag.InputError, match="state dict differs"):
        detect(store, model=other)
    result = detect(store, model=model, tokenizer=AutoTokenizer.from_pretrained(folder))
    assert result.scores.sizes == {"layer": 3, "head": 4}


def test_tensorstore_reads_the_detect_groups_as_zarr_python_does(detected):
    """Any Zarr v3 implementation reads the groups: core data types, the same bytes."""
    ts = pytest.importorskip("tensorstore")
    from attngeom.store import arrays_of, open_root

    _, store = detected("llama")
    arrays = [a for a in arrays_of(open_root(str(store))) if a.path.startswith("runs/r/detect/")]
    assert {"runs/r/detect/scores/induction_score", "runs/r/detect/probes/probe_tokens",
            "runs/r/detect/retrieval/needle_length"} <= {a.path for a in arrays}
    for arr in arrays:
        assert_tensorstore_reads(ts, store, arr)


def test_smollm2_induction_heads_are_its_retrieval_heads(tmp_path):
    """smollm2-135m at L = 128 (4 windows of wiki-summaries, 8 probes, 4 haystacks x 5
    depths; measured): six heads in layers 17, 18 and 23 have induction_score > 0.5, 18.6 the
    highest (0.89); the heads with retrieval_score > 0.3 are among the eight with
    induction_score > 0.4, 18.6 again first (0.82)."""
    store = str(tmp_path / "s.zarr")
    run_id = extract(ExtractRequest(model="smollm2-135m", dataset="wiki-summaries", context_length=128,
                                    num_sequences=4, store=store, progress=False)).run_id
    scores = ag.detect(store, run_id, device="cpu", probes=8, haystacks=4, progress=False).scores
    series = {name: scores[name].to_series() for name in SCORES}
    induction, retrieval = series["induction_score"], series["retrieval_score"]
    assert set(induction[induction > 0.5].index) == {(17, 3), (17, 4), (17, 5), (18, 6), (18, 7), (23, 2)}
    assert induction.idxmax() == (18, 6) and induction.max() == pytest.approx(0.891, abs=2e-3)
    assert set(retrieval[retrieval > 0.3].index) <= set(induction[induction > 0.4].index)
    assert retrieval.idxmax() == (18, 6) and retrieval.max() == pytest.approx(0.823, abs=2e-3)
    assert ((scores.to_array() >= 0) & (scores.to_array() <= 1)).all()
