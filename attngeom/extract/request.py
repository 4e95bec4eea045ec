"""What an extract is asked to do (:class:`ExtractRequest`), and what can be answered before
torch, transformers, the store's libraries or the model load: :func:`preflight`. Light: it
reads names, metadata files and the store's records, never a model or a corpus."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from attngeom.extract.placement import parse_device_map
from attngeom.extract.positions import check_context_length, config_positions
from attngeom.extract.queries import query_positions
from attngeom.extract.sources import OFFLINE_MODELS, model_name
from attngeom.extract.tokenizing import check_tokenizer_name, holds_tokenizer, no_tokenizer
from attngeom.options import check_options, option, refusal
from attngeom.store.objects.preflight import RUN_ID_PATTERN, default_run_id, require_writable, run_created, run_record
from attngeom.extract.runcheck import check_device

if TYPE_CHECKING:
    from attngeom.store.session import StoreSession

__all__ = ["ExtractRequest", "ExtractResult", "Preflight", "check_arguments", "launcher_shard", "preflight"]

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
class Preflight:
    """A request that passed :func:`preflight`: its shard (i, n) or None. Where its run
    exists: ``run_id``; ``total``, the sequences asked for, where the store alone (no model)
    can tell whether the run holds them all already (:meth:`answer`); ``lacking``, the
    arrays the run was extracted without (migrated from an earlier store format)."""

    shard: tuple[int, int] | None
    run_id: str | None = None
    total: int | None = None
    lacking: tuple[str, ...] = ()

    def answer(self, session: StoreSession) -> ExtractResult | None:
        """The result when the run holds every sequence asked for already (nothing to load
        or write), read through the command's ``session`` (mode "c") and the run checked
        as a finished extract checks it; None when there is something to write.
        :class:`InputError` for a run lacking arrays, which takes no new sequences."""
        done = None if self.total is None else _finished(session, self.run_id, self.total, self.shard)
        if done is None and self.lacking:
            raise InputError(
                f"run '{self.run_id}' in {session.url} was extracted before attngeom kept "
                f"{' and '.join(self.lacking)} (migrated from an earlier store format) and takes no new sequences; "
                "choose another --run"
            )
        return done


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


def preflight(request: ExtractRequest) -> Preflight:
    """Everything about ``request`` that its arguments, the model's and the corpus's names and
    metadata, and the store's records decide, before torch, the model or the corpus loads:
    the arguments; the queries for L; the store's writability; the model (an offline name, an
    existing path, a hub id it can reach or has cached) and L against its positions; the
    corpus's name and text field; an existing run's identity as its record states it (model and
    corpus ids, L, window rule, dtypes, rows, queries; an offline or local corpus's documents
    and text field), a difference named by its option, the run's value and the asked one.
    Whether that run already holds every sequence asked for (of a named model, an offline or
    local corpus, and no BOS token named: only the tokenizer tells its id) is answered next,
    from its commit flags, through the command's store session (:meth:`Preflight.answer`: the
    store's package loads, no model).
    :class:`InputError` or a :class:`StoreError` otherwise, with the store untouched."""
    shard = check_arguments(request)
    check_device(request.device)
    length = request.context_length
    shape = getattr(request.token_ids, "shape", None)
    if request.token_ids is not None and shape is not None and len(shape) == 2:
        length = int(shape[1])
    queries = query_positions(request.queries, length) if length is not None else None
    require_writable(request.store)
    named = isinstance(request.model, str | os.PathLike)
    if named and request.values_dtype == "bfloat16" and request.dtype != "bfloat16":
        raise InputError(values_dtype_refusal(request.dtype))
    model_id = None
    if named:
        model = model_name(str(request.model))
        model_id, positions = model.id, model.positions
    else:
        positions = config_positions(getattr(request.model, "config", None) or {})
    if length is not None and positions is not None:
        check_context_length(length, positions, str(request.model) if named else "the model", ExtractRequest)
    _check_tokenizer(request)
    if request.dataset is not None:
        input_id = corpus_id(request.dataset, split=request.split)
        check_text_field(request.dataset, request.text_field)
    else:
        input_id = "texts" if request.texts is not None else "token_ids"
    run_id = request.run_id
    if run_id is None and model_id is not None and length is not None:
        run_id = default_run_id(model_id, input_id, length)
    record = run_record(request.store, run_id) if run_id is not None else None
    if not run_created(record):
        return Preflight(shard)
    rule = ({"rule": "given", "seed": None} if request.token_ids is not None
            else {"rule": request.window_rule, "seed": request.seed})
    asked = {
        "model": model_id, "dataset": input_id, "context_length": length, "window_rule": rule,
        # "auto" keeps what a run holds (pipeline._values_dtype).
        "values_dtype": None if request.values_dtype == "auto" else request.values_dtype,
        "store_rows": request.store_rows,
        "queries": None if queries is None else list(queries),
        # "auto" computes in float32 on every device (models.resolve_dtype).
        "compute_dtype": ("float32" if request.dtype == "auto" else request.dtype) if named else None,
    }
    held = dict(record, model=(record.get("model") or {}).get("id"), dataset=(record.get("dataset") or {}).get("id"))
    held.setdefault("queries", [])
    diffs = [(key, held.get(key), request.queries if key == "queries" and isinstance(request.queries, str) else value)
             for key, value in asked.items() if value is not None and held.get(key) != value]
    local = _local_corpus(request)
    if local is not None and not diffs:
        recorded = record.get("dataset") or {}
        if recorded.get("text_field") != request.text_field:
            diffs.append(("text_field", recorded.get("text_field"), request.text_field))
        elif recorded.get("fingerprint") != local.fingerprint:
            diffs.append(("documents", "", ""))
    if diffs:
        # A store this attngeom may not write (another format, a migration under way) is
        # the first thing to fix: said before the run's parameters, as the store says it.
        from attngeom.store import open_root

        open_root(request.store, mode="a")
        raise _other_run(request.store, run_id, [_difference(key, was, now, request.dataset) for key, was, now in diffs])
    total = request.num_sequences
    if total is None and request.token_ids is not None and shape is not None:
        total = int(shape[0])
    # A model given in memory is checked by its weights' hash, a BOS token by the tokenizer,
    # a hub corpus by `datasets`: only the full check reads them.
    light = named and request.bos_token is None and request.tokenizer is None and local is not None
    lacking = tuple((record.get("layout") or {}).get("lacking") or ())
    return Preflight(shard, run_id, total if light else None, lacking)


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


# The option that sets each part of a run's identity, as the record names it.
IDENTITY_FLAGS = {
    "model": "--model", "dataset": "--dataset", "context_length": "--context-length", "window_rule": "--window",
    "values_dtype": "--values-dtype", "store_rows": "--store-rows", "queries": "--queries", "compute_dtype": "--dtype",
    "text_field": "--text-field",
}


def _shown(key: str, value: Any) -> str:
    """A recorded or asked value as its option takes it."""
    if key == "window_rule" and isinstance(value, dict):
        rule = value.get("rule")
        if rule == "random":
            return f"random --seed {value.get('seed')}"
        return "token_ids" if rule == "given" else str(rule)
    if key == "queries" and isinstance(value, list):
        if not value:
            return "last"
        shown = ",".join(map(str, value))
        return shown if len(value) <= 8 else f"{','.join(map(str, value[:3]))},...,{value[-1]} ({len(value)} positions)"
    return str(value)


def _difference(key: str, was: Any, now: Any, dataset: str | None) -> str:
    """One difference between a run and a command, in words: the option, the run's value, the asked one."""
    if key == "documents":
        return f"the documents of --dataset {dataset} changed since the run read them"
    return f"{IDENTITY_FLAGS[key]} is {_shown(key, was)} in the run, {_shown(key, now)} here"


# What makes a run: the provenance keys in which a rerun must agree with it to resume or
# append to it.
IDENTITY = ("model", "dataset", "context_length", "window_rule", "bos_token_id", "values_dtype", "store_rows",
            "queries", "compute_dtype")
# The value of an identity key in a run that predates it. compute_dtype (the resolved dtype,
# never "auto") has none: every run extract has written records it, since the first store
# schema, so an older run is held to the dtype it was written in; a run without it was not
# written by extract and is refused, as one lacking any other identity key.
_IDENTITY_BEFORE = {"queries": []}


def check_identity(record: Mapping[str, Any] | None, identity: Mapping[str, Any], store: str, run_id: str) -> None:
    """Refuse to resume or append to a run (its ``record``; None: no run) that holds another
    model, corpus, L, BOS, dtype, rows or queries than ``identity`` (each :data:`IDENTITY`
    key, as the record stores it): the full check, once the model and the corpus are read."""
    if record is None:
        return
    diffs = [identity_difference(key, record.get(key, _IDENTITY_BEFORE.get(key)), identity[key])
             for key in IDENTITY if identity[key] != record.get(key, _IDENTITY_BEFORE.get(key))]
    if diffs:
        raise _other_run(store, run_id, diffs)


def _other_run(store: str, run_id: str, diffs: Sequence[str]) -> InputError:
    """The refusal of a command that differs from run ``run_id`` in ``diffs`` (in words)."""
    return InputError(f"run '{run_id}' in {store} differs from this command: " + "; ".join(diffs)
                      + "; give the run's values to continue it, or another --run")


def identity_difference(key: str, was: Any, now: Any) -> str:
    """A difference of the full identity check (extract's, once the model and corpus are
    read), in the words of :func:`_difference`: the model and the corpus by their names, or
    by their weights and documents where the names agree."""
    if key in ("model", "dataset"):
        was, now = was if isinstance(was, dict) else {}, now if isinstance(now, dict) else {}
        if was.get("id") != now.get("id"):
            return _difference(key, was.get("id"), now.get("id"), None)
        if key == "dataset":
            return _difference("documents", None, None, now.get("id"))
        return f"the weights of model {now.get('id')} differ from those the run was extracted from"
    if key == "bos_token_id":
        return f"the BOS token is id {was} in the run, {now} here (--bos-token)"
    return _difference(key, was, now, None)


def _local_corpus(request: ExtractRequest) -> Corpus | None:
    """The request's corpus when it is offline or local, opened (its fingerprint computed
    over the documents, nothing tokenized); None for a hub corpus, texts or token ids."""
    name = request.dataset
    if name is None or not (name in OFFLINE_CORPORA or Path(name).expanduser().exists()):
        return None
    return open_corpus(name, split=request.split, text_field=request.text_field)


def _finished(session: StoreSession, run_id: str, total: int, shard: tuple[int, int] | None) -> ExtractResult | None:
    """The result of an extract with nothing to write: run ``run_id`` holds every sequence of
    ``range(total)`` (of this shard) committed; None when it does not."""
    start = time.perf_counter()
    with session.run_write(run_id, shard=shard).begin(total) as begun:
        if begun.todo:
            return None
        committed = begun.commit()
        return ExtractResult(run_id, 0, committed, begun.capacity, time.perf_counter() - start)
