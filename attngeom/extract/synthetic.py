"""Synthetic stores of realistic shape, without a model: for memory tests and benchmarks.

Attention rows are softmaxes of scaled Gaussian scores with a heavy sink; values are Gaussian
with a small sink vector, so every quantity of docs/method.md is defined and non-trivial.
"""

from __future__ import annotations

import numpy as np

from attngeom.store import (
    RECENT_WINDOWS,
    RunLayout,
    consolidate,
    create_run,
    open_or_create_root,
    write_sequence,
)
from attngeom.store.objects.schema import BFLOAT16


def synthetic_sequence(rng: np.random.Generator, layout: RunLayout) -> dict[str, np.ndarray]:
    """The arrays of one sequence, shaped as ``write_sequence`` expects; with ``layout.queries``
    also ``attn_rows``, each query's row a softmax over its keys 0..q (``attn_last`` at L-1)."""
    n_layers, n_heads, n_kv, length, dim = (
        layout.n_layers, layout.n_heads, layout.n_kv_heads, layout.length, layout.head_dim
    )
    scores = rng.normal(scale=2.0, size=(n_layers, n_heads, length)).astype(np.float32)
    scores[..., 0] += 4.0
    attn_last = np.exp(scores - scores.max(-1, keepdims=True))
    attn_last /= attn_last.sum(-1, keepdims=True)
    values = rng.normal(size=(n_layers, n_kv, length, dim)).astype(np.float32)
    values[:, :, 0] *= 0.2
    if layout.values_dtype == BFLOAT16:  # bfloat16 values (the float32's upper half), as stored
        values = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    values = values.astype(layout.dtype("values"), copy=False)
    summaries = rng.random((4, n_layers, n_heads, length)).astype(np.float32)
    query = np.arange(length)
    winner = (rng.random((n_layers, n_heads, length)) * (query + 1)).astype(layout.winner_dtype)
    # The field's summaries follow from the others, with no draw of their own (the draws of
    # every later sequence stay those of stores written before them): the mass off the sink,
    # spread evenly over keys 1..i, and A_i,i-1 a share of the last 16 keys' mass.
    windows = np.asarray(RECENT_WINDOWS, dtype=np.float32)
    spread = np.minimum(1, windows / np.maximum(query, 1)[:, None]) * (query > 0)[:, None]
    recent_attn = ((1 - summaries[0])[..., None] * spread).astype(np.float32)
    prev_attn = (recent_attn[..., 0] * summaries[1] * (query > 0)).astype(np.float32)
    arrays = {
        "tokens": rng.integers(0, 1000, size=length, dtype=np.int32),
        "values": values,
        "attn_last": attn_last.astype(np.float32),
        "winner": winner,
        "sink_attn": summaries[0],
        "diag_attn": summaries[1],
        "top1_attn": summaries[2],
        "entropy": summaries[3],
        "prev_attn": prev_attn,
        "recent_attn": recent_attn,
        "doc_index": np.asarray(0, dtype=np.int64),
        "window_start": np.asarray(0, dtype=np.int64),
    }
    if layout.queries:
        rows = np.zeros((n_layers, n_heads, len(layout.queries), length), dtype=np.float32)
        for i, q in enumerate(layout.queries):
            if q == length - 1:
                rows[:, :, i] = arrays["attn_last"]
                continue
            row = np.exp(scores[..., : q + 1] - scores[..., : q + 1].max(-1, keepdims=True))
            rows[:, :, i, : q + 1] = row / row.sum(-1, keepdims=True)
        arrays["attn_rows"] = rows
    return arrays


def write_synthetic_run(
    store: str,
    run_id: str,
    *,
    n_seq: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    length: int,
    seed: int = 0,
    queries: tuple[int, ...] = (),
    values_dtype: str = "float32",
) -> RunLayout:
    """Create ``runs/<run_id>`` in ``store`` holding ``n_seq`` synthetic sequences, with rows
    at ``queries`` (positions, ascending) when given, values stored as ``values_dtype``
    (float32, float16 or bfloat16)."""
    layout = RunLayout(
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, length=length,
        head_kv=tuple(h // (n_heads // n_kv_heads) for h in range(n_heads)),
        window=(0,) * n_layers, attendable=((True,) * length,) * n_layers, queries=tuple(queries),
        values_dtype=values_dtype,
    )
    root = open_or_create_root(store)
    provenance = {
        "model": {"id": "synthetic"}, "dataset": {"id": "synthetic"}, "context_length": length,
        "library_versions": {}, "command_line": "attngeom.extract.synthetic.write_synthetic_run",
    }
    run = create_run(root, run_id, layout, provenance, n_seq)
    rng = np.random.default_rng(seed)
    for s in range(n_seq):
        write_sequence(run, s, synthetic_sequence(rng, layout))
    consolidate(root)
    return layout
