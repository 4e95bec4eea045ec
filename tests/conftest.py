"""Shared fixtures: tiny randomly initialised models and corpora, saved to temporary folders."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (pytest -n auto): a worker's torch and BLAS threads, and those of
    # the CLI processes it starts, would otherwise fight the other workers for the cores.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

WORDS = [f"w{i}" for i in range(90)]


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels(tmp_path_factory):
    """The analysis kernels compiled, or loaded from numba's cache beside the package, before
    the first test, by one xdist worker at a time: on a fresh checkout the first compiles (one
    to two minutes of CPU) and the others load what it cached, where each worker, and each
    subprocess a test starts meanwhile, would otherwise compile its own copy."""
    import fcntl

    from attngeom.analyze.kernels import compile_kernels

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        compile_kernels(progress=False)
        return
    # The workers' temporary folders share their parent, this run's own.
    with open(tmp_path_factory.getbasetemp().parent / "kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        compile_kernels(progress=False)


@pytest.fixture(params=["compiled", "torch"])
def row_passes(request, monkeypatch):
    """The capture's rows as CPU computes them (one compiled pass per row) and as CUDA does
    (torch's passes over the tile, here on CPU): one contract, each checked against the twins."""
    if request.param == "torch":
        from attngeom.extract import row_passes, tiles

        monkeypatch.setattr(tiles, "softmax_rows", row_passes.torch_rows)
    return request.param


# A test needs the model stack (torch, transformers, datasets, the offline model and corpus
# packages) when it uses `tiny_model_dir`, directly or through another fixture, or is marked
# `needs_model`. Where torch is not installed those tests are skipped and the rest (store,
# analysis, report) run: .ci/run runs them so on Python 3.12 with the newest zarr.
HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tiny_model_dir" in item.fixturenames:
            item.add_marker(pytest.mark.needs_model)
    if not HAS_TORCH:
        skip = pytest.mark.skip(reason="needs a model: torch is not installed")
        for item in items:
            if item.get_closest_marker("needs_model"):
                item.add_marker(skip)


def extract(request):
    """The extract stage on an ``ExtractRequest``, imported when called: a test module that
    imports this, not ``attngeom.extract.pipeline``, is collected without torch."""
    from attngeom.extract.pipeline import extract as run

    return run(request)


def tiny_config(arch: str):
    """A three-layer config of the family; Mistral and Gemma 2/3 slide a window of 6."""
    from transformers import (
        Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config,
    )

    common = dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=6)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "gemma":
        return GemmaConfig(**common)
    if arch == "gemma2":  # softcapped attention logits: SDPA cannot run it, the capture does
        return Gemma2Config(
            **common, sliding_window=6, attn_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    if arch == "gemma3":
        return Gemma3TextConfig(
            **common, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    raise ValueError(arch)


def tiny_tokenizer():
    """A word-level tokenizer over WORDS with <bos>=1, <eos>=2, <pad>=0, <unk>=3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def save_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: the folder of a tiny random model of the given family (cached per session)."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return make


@pytest.fixture(scope="session")
def word_corpus(tmp_path_factory) -> Path:
    """A folder of 12 .txt documents of 20 to 75 words from WORDS (seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        n = 20 + 5 * i
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, size=n)))
    return folder


@pytest.fixture(scope="session")
def extracted_store(tiny_model_dir, word_corpus, tmp_path_factory):
    """Factory: the store holding ``runs`` (`stores.Run`, a llama run r of 3 sequences at
    L = 16 by default), extracted once per session for every test asking for the same runs;
    never changed (copy it with `stores.copy_store` to change it)."""
    from stores import Run, build_extracted

    made: dict[tuple, Path] = {}

    def make(*runs: Run) -> Path:
        runs = runs or (Run(),)
        if runs not in made:
            made[runs] = build_extracted(tmp_path_factory.mktemp("extracted") / "s.zarr", runs, tiny_model_dir,
                                         word_corpus)
        return made[runs]

    return make


@pytest.fixture(scope="session")
def analyzed_store(extracted_store, tmp_path_factory):
    """Factory: `extracted_store`'s store of ``runs``, every run analyzed with threads on the
    grid ``n_grid``, once per session for each (runs, n_grid); never changed."""
    from stores import Run, build_analyzed, copy_store

    made: dict[tuple, Path] = {}

    def make(*runs: Run, n_grid: tuple[int, ...] = (1, 2, 4)) -> Path:
        runs = runs or (Run(),)
        key = (runs, tuple(n_grid))
        if key not in made:
            made[key] = build_analyzed(copy_store(extracted_store(*runs), tmp_path_factory.mktemp("analyzed")),
                                       key[1])
        return made[key]

    return make


# Sequences of the `ablated_store` fixture's run r.
ABLATED_SEQUENCES = 6


@pytest.fixture(scope="session")
def ablated_store_source(analyzed_store, tmp_path_factory) -> Path:
    """A real store: run r, ABLATED_SEQUENCES sequences of a tiny llama (L = 16), analyzed
    (n grid 1, 2, 4) and ablated; never changed (see `ablated_store`)."""
    from stores import Run, copy_store

    from attngeom.api import ablate

    store = copy_store(analyzed_store(Run(sequences=ABLATED_SEQUENCES)), tmp_path_factory.mktemp("ablated"))
    ablate(str(store), "r", device="cpu", random_masks=2, retention=[1.0, 0.5], progress=False)
    return store


@pytest.fixture
def ablated_store(ablated_store_source, tmp_path) -> Path:
    """A copy of `ablated_store_source` of the test's own, to damage."""
    from stores import copy_store

    return copy_store(ablated_store_source, tmp_path)


FORMAT1_STORE = Path(__file__).parent / "data" / "store-format1.tar.gz"


@pytest.fixture
def format1_store(tmp_path) -> Path:
    """A store as attngeom 0.1.0 wrote it before chunk checksums (format 1): commit 3f0ab0c's
    ``extract`` (tiny random Llama, L=16, 3 sequences, run ``tiny-llama``) and ``analyze``."""
    import tarfile

    with tarfile.open(FORMAT1_STORE) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "store"


@contextlib.contextmanager
def moto_s3(**env: str):
    """moto's S3 server on loopback, a bucket ``attngeom`` on it, and the environment that
    points s3fs and boto3 (here and in subprocesses) at it, plus ``env``. s3fs keeps one
    file system per set of arguments whatever the environment, so its instances are dropped
    on entry and exit: another module's server, since stopped, is never asked."""
    pytest.importorskip("moto.server")
    import boto3
    import s3fs
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    # moto's S3 app served alone, as `moto.server.ThreadedMotoServer` serves its app of every
    # service: that one finds the service of each request under one lock, listing moto's
    # package folder twice a request, which made it most of a request's time.
    server = make_server("127.0.0.1", 0, create_backend_app("s3"), threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    endpoint = f"http://{host}:{port}"
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                               "FSSPEC_S3_ENDPOINT_URL": endpoint, **env}.items():
                mp.setenv(key, value)
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="attngeom")
            yield endpoint
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.shutdown()
        thread.join()


# Libraries a refusal must be made without (each takes seconds to import).
def assert_tensorstore_reads(ts, store: Path, arr) -> None:
    """tensorstore (the module ``ts``) reads the zarr array ``arr`` of the local store at
    ``store`` as zarr-python does: the same data type, shape and bytes."""
    import numpy as np

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store / arr.path)}}
    read = ts.open(spec, open=True, read=True).result().read().result()
    expected = np.asarray(arr[...])
    assert read.dtype == expected.dtype and read.shape == expected.shape, arr.path
    assert read.tobytes() == np.ascontiguousarray(expected).tobytes(), arr.path


HEAVY = ("torch", "transformers", "dask", "numba", "xarray", "pandas", "zarr", "datasets")


def cli_in_fresh_process(cases: list[list[str]]) -> list[tuple[int, str, list[str]]]:
    """Each command line of ``cases`` run in one new interpreter, in order: its exit code,
    its output, and which of ``HEAVY`` were imported by then."""
    script = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from attngeom.cli import main\n"
        "out = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    result = CliRunner().invoke(main, args)\n"
        f"    out.append([result.exit_code, result.output, [m for m in {HEAVY!r} if m in sys.modules]])\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return [tuple(answer) for answer in json.loads(done.stdout)]
