"""What an extract is asked to do (:class:`ExtractRequest`), and what can be answered before
torch, transformers, the store's libraries or the model load: :func:`preflight`. Light: it
reads names, metadata files and the store's records, never a model or a corpus."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from attngeom.errors import InputError
from attngeom.extract.corpora import (
    OFFLINE_CORPORA,
    WINDOW_RULES,
    Corpus,
    check_text_field,
    check_window_args,
    corpus_id,
    open_corpus,
)
from attngeom.extract.identity import differences, other_run
from attngeom.extract.placement import parse_device_map
from attngeom.extract.positions import check_context_length, config_positions
from attngeom.extract.queries import query_positions
from attngeom.extract.sources import OFFLINE_MODELS, memory_model_id, model_name
from attngeom.extract.tokenizing import check_tokenizer_name, holds_tokenizer, no_tokenizer
from attngeom.options import check_options, option, refusal
from attngeom.store.objects.preflight import RUN_ID_PATTERN, default_run_id, require_writable, run_created, run_record
from attngeom.extract.runcheck import check_device

__all__ = ["ExtractPlan", "ExtractRequest", "ExtractResult", "check_arguments", "launcher_shard", "preflight", "token_array"]

# Compute dtypes: "auto" is float32 on every device; float32-tf32 runs float32 matmuls in
# TF32 inside the forward.
DTYPES = ("auto", "float32", "float32-tf32", "bfloat16", "float16")


@dataclass(frozen=True)
class ExtractRequest:
    """The arguments of ``attngeom extract`` and :func:`attngeom.extract`.

    ``model`` is a name or path, or a loaded transformers causal LM. The input is exactly
    one of ``dataset`` (a corpus name or path, windowed by docs/method.md#preprocessing), ``texts`` (strings,
    windowed the same way) or ``token_ids`` (S, L) integers used as given. ``tokenizer``: one
    in memory, or a name or folder to load one from, in place of the model's own (which a
    folder saved without one lacks: :mod:`attngeom.extract.tokenizing`). Each option's
    default and what it accepts are declared here once (:mod:`attngeom.options`): the API's
    keywords and the command's options take them from these fields.
    """

    model: Any = field(repr=False)
    store: str
    dataset: str | None = None
    texts: Iterable[str] | None = field(default=None, repr=False)
    token_ids: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)
    context_length: int | None = option(None, least=2, why=" (BOS and one token)")
    num_sequences: int | None = option(None, least=1)
    run_id: str | None = option(None, flag="--run")
    split: str | None = None
    text_field: str = "text"
    device: str = "auto"
    device_map: str | Mapping[str, Any] | None = None
    dtype: str = option("auto", choices=DTYPES)
    batch_size: int = option(1, least=1)
    store_rows: str = option("last", choices=("last", "all"))
    queries: str | Sequence[int] = "last"
    values_dtype: str = option("auto", choices=("auto", "float32", "float16", "bfloat16"))
    window_rule: str = option("first", choices=WINDOW_RULES, flag="--window")
    seed: int = 0
    bos_token: str | None = None
    shard: tuple[int, int] | None = None
    command_line: Sequence[str] = field(default_factory=lambda: list(sys.argv))
    progress: bool = True


@dataclass(frozen=True)
class ExtractResult:
    """What :func:`attngeom.extract` did: sequences it wrote, and those the run holds now
    (committed, by whichever process, and all it is sized for)."""

    run_id: str
    written: int
    committed: int
    total: int
    seconds: float


@dataclass(frozen=True)
class ExtractPlan:
    """A request resolved once and checked (:func:`preflight`): what the rest of extract reads
    instead of the request's raw arguments. ``shard``: (i, n) or None; ``run_id``: the run it
    writes; ``length``: L; ``queries``: the positions whose rows it keeps; ``token_ids``: the
    caller's token ids as an integer array (S, L), or None; ``corpus``: an offline or local
    corpus, opened (its documents fingerprinted, nothing tokenized), or None; ``given``: the
    values of the run's identity as the command gave them, to be said in a refusal
    (:func:`attngeom.extract.identity.differences`); ``total``: the sequences asked for, where the store
    alone (no model) can tell whether the run holds them all already
    (:func:`attngeom.extract.pipeline.answer`);
    ``lacking``: the arrays an existing run was extracted without (migrated from an earlier
    store format)."""

    request: ExtractRequest = field(repr=False)
    shard: tuple[int, int] | None
    run_id: str
    length: int
    queries: tuple[int, ...]
    token_ids: Any = field(default=None, repr=False)
    corpus: Corpus | None = field(default=None, repr=False)
    given: Mapping[str, Any] = field(default_factory=dict, repr=False)
    total: int | None = None
    lacking: tuple[str, ...] = ()


def launcher_shard() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun or accelerate (``RANK``/``WORLD_SIZE``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else None


def check_arguments(request: ExtractRequest) -> tuple[int, int] | None:
    """Refuse arguments that cannot be used, reading nothing; returns the shard."""
    given = [name for name in ("dataset", "texts", "token_ids") if getattr(request, name) is not None]
    if len(given) != 1:
        flags = {"dataset": "--dataset", "token_ids": "--token-ids"}
        raise InputError(
            "give exactly one input: dataset, texts or token_ids" + (f" (got {' and '.join(given)})" if given else ""),
            command_line="give exactly one input: --dataset or --token-ids FILE.npy"
            + (f" (got {' and '.join(flags.get(name, name) for name in given)})" if given else ""),
        )
    if request.dataset is not None and (request.context_length is None or request.num_sequences is None):
        raise refusal("a dataset needs {context_length} and {num_sequences}", ExtractRequest)
    if isinstance(request.texts, str | bytes):
        # A string is an iterable of strings: it would be read one character per document.
        raise InputError("texts is a list of documents (strings), not one string: pass texts=[text]")
    if request.texts is not None and request.context_length is None:
        raise InputError("texts need a context_length")
    if request.split is not None and request.dataset is None:
        raise InputError("split applies to a dataset only")
    check_options(request)
    if request.token_ids is None:
        check_window_args(request.context_length, request.window_rule, request.seed)
        if request.window_rule == "first" and request.seed != 0:
            raise InputError(f"--seed {request.seed} seeds the random window rule, and --window first takes each "
                             "document's first window: drop --seed, or use --window random")
    elif request.window_rule != "first" or request.seed != 0:
        raise InputError("window_rule and seed cut windows out of a dataset or texts; token_ids are used as given")
    if request.run_id is not None and not RUN_ID_PATTERN.match(request.run_id):
        raise InputError(f"run id {request.run_id!r} may hold only letters, digits, '.', '_' and '-'")
    shard = request.shard or launcher_shard()
    check_device_map(request.device_map, request.device, named=isinstance(request.model, str | os.PathLike),
                     shard=shard)
    if shard is not None and shard[1] < 1:
        raise InputError(f"--shard {shard[0]}/{shard[1]}: the count of shards must be at least 1")
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise InputError(f"--shard {shard[0]}/{shard[1]}: the index must be in 0..{shard[1] - 1}")
    return shard


def check_device_map(device_map: Any, device: str, *, named: bool, shard: tuple[int, int] | None = None) -> None:
    """Refuse a device map that cannot be used: malformed, beside an explicit --device, for a
    model given in memory (placed already), or with --shard (one process per GPU)."""
    if device_map is None:
        return
    parse_device_map(device_map)
    if device != "auto":
        raise InputError(f"--device-map places the model's modules itself: leave --device auto (got {device!r})")
    if not named:
        raise InputError("device_map places a model as it loads; a model given in memory stays where it is")
    if shard is not None:
        raise InputError("--device-map spreads one model over the devices; --shard runs one model per process: "
                         "use one or the other")


def values_dtype_refusal(compute_dtype: str) -> str:
    """Why values_dtype bfloat16 is refused for a model computing in ``compute_dtype``."""
    compute = "float32" if compute_dtype == "auto" else compute_dtype
    return (f"--values-dtype bfloat16 stores a bfloat16 model's values exactly; this model computes in {compute}: "
            "use --dtype bfloat16, or --values-dtype float32 or float16")


def preflight(request: ExtractRequest) -> ExtractPlan:
    """The request resolved and checked as far as its arguments, the model's and the corpus's
    names and metadata, and the store's records decide, before torch, the model or the
    corpus loads: the arguments; L and the queries for it; the store's writability; the model
    (an offline name, an existing path, a hub id it can reach or has cached, or one in memory)
    and L against its positions; the corpus's name and text field; the run id; an existing
    run's identity as its record states it (model and corpus ids, L, window rule, dtypes,
    rows, queries; an offline or local corpus's documents and text field), a difference
    named by its option, the run's value and the asked one. Whether that run already holds
    every sequence asked for (of a named model, an offline or local corpus, and no BOS token
    named: only the tokenizer tells its id) is answered next, from its commit flags, through
    the command's store session (:func:`attngeom.extract.pipeline.answer`: the store's package loads, no
    model). :class:`InputError` or a :class:`StoreError` otherwise, with the store untouched."""
    shard = check_arguments(request)
    check_device(request.device)
    ids = None if request.token_ids is None else token_array(request.token_ids)
    length = int(ids.shape[1]) if ids is not None else request.context_length
    queries = query_positions(request.queries, length)
    require_writable(request.store)
    named = isinstance(request.model, str | os.PathLike)
    if named and request.values_dtype == "bfloat16" and request.dtype != "bfloat16":
        raise InputError(values_dtype_refusal(request.dtype))
    if named:
        model = model_name(str(request.model))
        model_id, positions = model.id, model.positions
    else:
        model_id, positions = memory_model_id(request.model), config_positions(getattr(request.model, "config", None) or {})
    if positions is not None:
        check_context_length(length, positions, str(request.model) if named else "the model", ExtractRequest)
    _check_tokenizer(request)
    if request.dataset is not None:
        input_id = corpus_id(request.dataset, split=request.split)
        check_text_field(request.dataset, request.text_field)
    else:
        input_id = "texts" if request.texts is not None else "token_ids"
    run_id = request.run_id or default_run_id(model_id, input_id, length)
    local = _local_corpus(request)
    identity = {
        # A model given in memory is known by its weights' hash alone, read with the model.
        "model": {"id": model_id} if named else None,
        "dataset": {"id": input_id} if local is None else {"id": input_id, "text_field": request.text_field,
                                                          "fingerprint": local.fingerprint},
        "context_length": length,
        "window_rule": ({"rule": "given", "seed": None} if ids is not None
                        else {"rule": request.window_rule, "seed": request.seed}),
        # "auto" keeps what a run holds (provenance.values_dtype).
        "values_dtype": None if request.values_dtype == "auto" else request.values_dtype,
        "store_rows": request.store_rows,
        "queries": list(queries),
        # "auto" computes in float32 on every device (models.resolve_dtype).
        "compute_dtype": ("float32" if request.dtype == "auto" else request.dtype) if named else None,
    }
    given = {"dataset": request.dataset, **({"queries": request.queries} if isinstance(request.queries, str) else {})}
    plan = ExtractPlan(request, shard, run_id, length, queries, ids, local, given)
    record = run_record(request.store, run_id)
    if not run_created(record):
        return plan
    diffs = differences(record, identity, given)
    if diffs:
        # A store this attngeom may not write (another format, a migration under way) is
        # the first thing to fix: said before the run's parameters, as the store says it.
        from attngeom.store import open_root

        open_root(request.store, mode="a")
        raise other_run(request.store, run_id, diffs)
    total = request.num_sequences
    if total is None and ids is not None:
        total = int(ids.shape[0])
    # A model given in memory is checked by its weights' hash, a BOS token by the tokenizer,
    # a hub corpus by `datasets`: only the full check reads them.
    light = named and request.bos_token is None and request.tokenizer is None and local is not None
    lacking = tuple((record.get("layout") or {}).get("lacking") or ())
    return replace(plan, total=total if light else None, lacking=lacking)


def token_array(given: Any) -> np.ndarray:
    """The caller's token ids as an integer array (S, L): a torch tensor (torch is loaded
    where one is given), or anything numpy reads."""
    torch = sys.modules.get("torch")
    ids = given.cpu().numpy() if torch is not None and isinstance(given, torch.Tensor) else np.asarray(given)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"token_ids must be an integer array (S, L); got {ids.dtype} of shape {ids.shape}")
    return ids


def _check_tokenizer(request: ExtractRequest) -> None:
    """Refuse a tokenizer named that is not there, and a dataset or texts for a model that
    has no tokenizer to window them with (a folder holding none, a model in memory given
    without one), before anything loads."""
    if isinstance(request.tokenizer, str | os.PathLike):
        check_tokenizer_name(str(request.tokenizer))
    if request.token_ids is not None or request.tokenizer is not None:
        return
    if not isinstance(request.model, str | os.PathLike):
        raise refusal("a dataset or texts are windowed with the model's tokenizer: give {tokenizer} with a model in "
                      "memory, or extract from {token_ids}", ExtractRequest)
    folder = Path(request.model).expanduser()
    if str(request.model) not in OFFLINE_MODELS and folder.is_dir() and not holds_tokenizer(folder):
        raise no_tokenizer(str(request.model), ExtractRequest)


def _local_corpus(request: ExtractRequest) -> Corpus | None:
    """The request's corpus when it is offline or local, opened (its fingerprint computed
    over the documents, nothing tokenized); None for a hub corpus, texts or token ids."""
    name = request.dataset
    if name is None or not (name in OFFLINE_CORPORA or Path(name).expanduser().exists()):
        return None
    return open_corpus(name, split=request.split, text_field=request.text_field)
