"""Helpers the benchmarks share: statistics, tables, argument lists, timing, BLAS threads,
and a model loaded once through the public loaders (so loading stays out of every timing).

Benchmarks import it as ``from common import ...``: each runs as a script from ``benchmarks/``,
whose folder Python puts first on the import path.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


def median(xs: list[float]) -> float:
    """The median, NaN for an empty list."""
    return float(statistics.median(xs)) if xs else float("nan")


def rotate(items: list[Any], k: int) -> list[Any]:
    """``items`` started at position ``k`` (mod its length): variants change order per repetition."""
    k %= len(items)
    return items[k:] + items[:k]


def int_list(text: str) -> list[int]:
    """'512,1024' -> [512, 1024]."""
    return [int(x) for x in text.split(",") if x.strip()]


def cell(x: Any) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; floats to 3 significant digits (thousands separated from 100 up)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds; CPU time covers every thread of this process."""
    return time.perf_counter(), time.process_time()


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call of ``fn``."""
    w0, c0 = now()
    fn()
    w1, c1 = now()
    return w1 - w0, c1 - c0


def blas_threads(n: int | None) -> Any:
    """A context manager holding BLAS (OpenBLAS, MKL) at ``n`` threads; None leaves the default."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


@dataclass
class Loaded:
    """A model loaded once through ``attngeom.extract.models``: stock SDPA attention, eval mode."""

    name: str
    model: Any  # transformers causal LM; ag.extract(model, ...) takes it as it is
    tokenizer: Any
    device: str
    dtype: Any
    load_s: float


def load(name: str, device: str = "auto", dtype: str = "auto") -> Loaded:
    """``name`` (an offline name, hub id or folder) loaded with its tokenizer, attention set to
    stock SDPA, so that its decoder-only forward is the reference extract is compared with."""
    from attngeom.extract.models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model

    t0 = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    source = resolve_model(name)
    model = load_model(source, device=dev, dtype=dt)
    model.set_attn_implementation("sdpa")
    tokenizer = load_tokenizer(source)
    return Loaded(name, model, tokenizer, dev, dt, time.perf_counter() - t0)


def synchronize(device: str) -> None:
    """Wait for queued accelerator work, so a wall-clock reading covers it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def store_tokens(store: str) -> np.ndarray:
    """The tokens (S, L) of the one run of ``store``, read through the public API."""
    import attngeom as ag

    opened = ag.open_store(store)
    (run_id,) = opened.runs
    return opened.run(run_id).dataset()["tokens"].values
