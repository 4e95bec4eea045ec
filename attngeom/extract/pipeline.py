"""The extract stage: one pass of the model over equalized windows into the store (SPEC §1, §2, §6).

Everything that can be refused is checked before the store is touched: the store path, the
model, the tokenizer's BOS, the corpus and its number of usable documents, and an existing
run's identity. Sequence ``i`` of a run is always window ``i`` of the corpus, so a killed run
started again with the same command rewrites only the sequences not yet committed, and a
larger ``--num-sequences`` appends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from tqdm.auto import tqdm

from attngeom import __version__
from attngeom.errors import AttngeomError, InputError, StoreNotFoundError, StoreWriteError
from attngeom.extract.capture import (
    ATTN_IMPLEMENTATION,
    LayerCapture,
    attention_output,
    recording,
)
from attngeom.extract.corpora import Window, open_corpus, select_windows
from attngeom.extract.models import (
    load_config,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from attngeom.store import (
    ATTR_KEY,
    RUN_ID_PATTERN,
    RunLayout,
    check_writable,
    completed,
    consolidate,
    create_run,
    default_run_id,
    jsonable,
    local_path,
    n_sequences,
    open_or_create_root,
    open_root,
    open_run_group,
    resize_run,
    run_ids,
    run_layout,
    run_provenance,
    write_sequence,
)

# Provenance keys that must agree before a run may be resumed or appended.
IDENTITY = ("model", "dataset", "context_length", "window_rule", "bos_token_id", "values_dtype", "store_rows")


@dataclass(frozen=True)
class ExtractRequest:
    """The arguments of ``attngeom extract``."""

    model: str
    dataset: str
    context_length: int
    num_sequences: int
    store: str
    run_id: str | None = None
    split: str | None = None
    text_field: str = "text"
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 1
    store_rows: str = "last"
    values_dtype: str = "float32"
    window_rule: str = "first"
    seed: int = 0
    bos_token: str | None = None
    shard: tuple[int, int] | None = None
    command_line: Sequence[str] = field(default_factory=lambda: list(sys.argv))
    progress: bool = True


@dataclass(frozen=True)
class ExtractResult:
    """What an extract did: sequences it wrote, and those the run holds now (committed, by
    whichever process, and all it is sized for)."""

    run_id: str
    written: int
    committed: int
    total: int
    seconds: float


def _library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "zarr", "numcodecs", "numpy", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def _bos_token_id(tokenizer: Any, bos_token: str | None) -> int:
    if bos_token is not None:
        token_id = tokenizer.convert_tokens_to_ids(bos_token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise AttngeomError(f"--bos-token {bos_token!r} is not a token of this tokenizer")
        return int(token_id)
    if tokenizer.bos_token_id is None:
        raise AttngeomError(
            "the tokenizer defines no BOS token; name one with --bos-token (e.g. --bos-token '<|endoftext|>')"
        )
    return int(tokenizer.bos_token_id)


def _check_existing_run(request: ExtractRequest, run_id: str, identity: dict[str, Any]) -> None:
    """Refuse to resume a run that holds another model, corpus or L, and a store this
    attngeom does not write (store untouched)."""
    try:
        root = open_root(request.store, mode="a")
    except StoreNotFoundError:
        return
    if run_id not in run_ids(root):
        return
    prov = run_provenance(root, run_id)
    if not prov.get("initialized"):
        return
    diffs = [
        f"{key} {prov.get(key)!r} (asked {identity[key]!r})"
        for key in IDENTITY
        if jsonable(identity[key]) != prov.get(key)
    ]
    if diffs:
        raise AttngeomError(
            f"run '{run_id}' in {request.store} already holds " + "; ".join(diffs) + "; choose another --run"
        )


def _layout(config: Any, captures: dict[int, LayerCapture], request: ExtractRequest) -> RunLayout:
    n_layers = config.num_hidden_layers
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = captures[0].values.shape[-1]
    attendable = [captures[layer].attendable.cpu().numpy().astype(bool) for layer in range(n_layers)]
    length = request.context_length
    window = [int(a.sum()) if a.sum() < length else 0 for a in attendable]
    return RunLayout(
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        length=length,
        head_kv=tuple(h // (n_heads // n_kv) for h in range(n_heads)),
        window=tuple(window),
        attendable=tuple(tuple(bool(x) for x in a) for a in attendable),
        values_dtype=request.values_dtype,
        store_rows=request.store_rows,
    )


def _sequence_arrays(
    captures: dict[int, LayerCapture], b: int, window: Window, layout: RunLayout
) -> dict[str, np.ndarray]:
    layers = range(layout.n_layers)

    def stack(name: str, dtype: str) -> np.ndarray:
        return torch.stack([getattr(captures[l], name)[b] for l in layers]).cpu().numpy().astype(dtype)

    arrays = {
        "tokens": window.tokens.astype("int32"),
        "values": torch.stack([captures[l].values[b].float() for l in layers]).cpu().numpy().astype(layout.values_dtype),
        "attn_last": stack("attn_last", "float32"),
        "winner": stack("winner", layout.winner_dtype),
        "sink_attn": stack("sink_attn", "float32"),
        "diag_attn": stack("diag_attn", "float32"),
        "top1_attn": stack("top1_attn", "float32"),
        "entropy": stack("entropy", "float32"),
        "doc_index": np.asarray(window.doc_index, dtype="int64"),
        "window_start": np.asarray(window.start, dtype="int64"),
    }
    if layout.store_rows == "all":
        arrays["attn"] = stack("rows", "float16")
    return arrays


def launcher_shard() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun or accelerate (``RANK``/``WORLD_SIZE``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else None


def extract(request: ExtractRequest) -> ExtractResult:
    """Run ``extract``; raises :class:`AttngeomError` on bad input with the store untouched.

    With ``shard = (i, n)`` this process writes sequences s with s % n == i, so n processes
    (by hand, or ranks of torchrun) fill one run without touching each other's shards.
    """
    if request.context_length < 2:
        raise InputError("--context-length must be at least 2 (BOS and one token)")
    if request.num_sequences < 1:
        raise InputError("--num-sequences must be at least 1")
    shard = request.shard or launcher_shard()
    if shard is not None and shard[1] < 1:
        raise InputError(f"--shard {shard[0]}/{shard[1]}: the count of shards must be at least 1")
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise InputError(f"--shard {shard[0]}/{shard[1]}: the index must be in 0..{shard[1] - 1}")
    check_writable(request.store)
    device = resolve_device(request.device)
    if shard is not None and device == "cuda":
        # One GPU per local rank under a launcher; all ranks share one GPU if there is one.
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', shard[0])) % torch.cuda.device_count()}"
    dtype = resolve_dtype(request.dtype, device)
    source = resolve_model(request.model)
    config = load_config(source)
    tokenizer = load_tokenizer(source)
    bos_id = _bos_token_id(tokenizer, request.bos_token)
    corpus = open_corpus(request.dataset, split=request.split, text_field=request.text_field)
    run_id = request.run_id or default_run_id(source.name, corpus.id, request.context_length)
    if not RUN_ID_PATTERN.match(run_id):
        raise AttngeomError(f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-'")
    model_prov = source.provenance()
    dataset_prov = {"id": corpus.id, "split": corpus.split, "fingerprint": corpus.fingerprint, "text_field": request.text_field}
    identity = {
        "model": model_prov,
        "dataset": dataset_prov,
        "context_length": request.context_length,
        "window_rule": {"rule": request.window_rule, "seed": request.seed},
        "bos_token_id": bos_id,
        "values_dtype": request.values_dtype,
        "store_rows": request.store_rows,
    }
    _check_existing_run(request, run_id, identity)

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    windows = select_windows(
        corpus, tokenize, bos_id, request.context_length, request.num_sequences,
        rule=request.window_rule, seed=request.seed,
    )

    path = local_path(request.store)
    # A store this extract creates goes again if it fails before committing anything; not
    # with --shard, where a peer may be writing into the new store already.
    new_store = path is not None and not path.exists() and shard is None
    root = open_or_create_root(request.store)
    with _removed_on_failure(path, root, new_store):
        run = _open_run(root, run_id)
        mine = [i for i in range(request.num_sequences) if shard is None or i % shard[1] == shard[0]]
        todo = (
            mine
            if run is None
            else [i for i in mine if i >= n_sequences(run) or run["complete"][i] != 1]
        )
        if run is not None and n_sequences(run) < request.num_sequences:
            resize_run(run, request.num_sequences)
        start = time.perf_counter()
        if not todo:
            return ExtractResult(run_id, 0, completed(run).size, n_sequences(run), 0.0)

        model = load_model(source, device=device, dtype=dtype)
        provenance = {
            **identity,
            "tokenizer": {
                "class": type(tokenizer).__name__,
                "vocab_size": len(tokenizer),
                "bos_token": tokenizer.convert_ids_to_tokens(bos_id),
            },
            "model_type": config.model_type,
            "compute_dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "attention_implementation": f"{ATTN_IMPLEMENTATION} ({attention_output(dtype)}; float32 rows recomputed from post-RoPE q/k)",
            "library_versions": _library_versions(),
            "attngeom_version": __version__,
            "command_line": shlex.join(request.command_line),
            "shard": list(shard) if shard else None,
        }
        bar = tqdm(total=len(todo), unit="seq", desc=f"extract {run_id}", disable=not request.progress)
        try:
            for b0 in range(0, len(todo), request.batch_size):
                batch = todo[b0 : b0 + request.batch_size]
                ids = torch.from_numpy(np.stack([windows[i].tokens for i in batch]).astype("int64")).to(device)
                with torch.inference_mode(), recording(keep_rows=request.store_rows == "all") as rec:
                    model.model(input_ids=ids, use_cache=False)
                if run is None:
                    layout = _layout(config, rec.layers, request)
                    run = create_run(root, run_id, layout, provenance, request.num_sequences)
                layout = run_layout(run)
                for b, seq in enumerate(batch):
                    write_sequence(run, seq, _sequence_arrays(rec.layers, b, windows[seq], layout))
                bar.update(len(batch))
                elapsed = time.perf_counter() - start
                bar.set_postfix(tok_s=f"{bar.n * request.context_length / max(elapsed, 1e-9):.0f}")
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                done = 0 if run is None else int(np.isin(todo, completed(run)).sum())
                kept = "; committed sequences are kept:" if done else ";"
                raise StoreWriteError(
                    f"the store ran out of space after {done} of {len(todo)} sequences were committed{kept} "
                    "free space and re-run the same command" + (" to finish" if done else "")
                ) from exc
            raise
        finally:
            bar.close()
        consolidate(root)
        return ExtractResult(run_id, len(todo), completed(run).size, n_sequences(run), time.perf_counter() - start)


@contextlib.contextmanager
def _removed_on_failure(path: Path | None, root: zarr.Group, new_store: bool) -> Iterator[None]:
    """Remove the store at ``path`` if the body fails, the store is new (``new_store``) and
    no sequence of it was committed: a failed extract leaves no empty store behind."""
    try:
        yield
    except BaseException:
        if new_store and not _holds_committed(root):
            shutil.rmtree(path, ignore_errors=True)
        raise


def _holds_committed(root: zarr.Group) -> bool:
    """Whether any run of the store has a committed sequence (True if that cannot be read:
    a store is never removed on a guess)."""
    try:
        return any(_committed(open_run_group(root, run_id)) for run_id in run_ids(root))
    except Exception:  # noqa: BLE001
        return True


def _committed(run: zarr.Group) -> bool:
    return "complete" in run and completed(run).size > 0


def _open_run(root: zarr.Group, run_id: str) -> zarr.Group | None:
    """The run if its creation finished; None if absent or its creation was interrupted
    (``create_run`` then finishes it, keeping what is already right)."""
    if run_id not in run_ids(root):
        return None
    run = open_run_group(root, run_id)
    return run if run.attrs.get(ATTR_KEY, {}).get("initialized") else None
