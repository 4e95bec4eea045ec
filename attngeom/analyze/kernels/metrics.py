"""The kernels' public functions: top-N geometry at the final query and the value statistics
of each kv head, for a batch of heads (docs/method.md).

One instance is one (sequence, layer, head) at the final query ``q = L-1``. The functions take
a batch on a leading axis:

- ``attn`` (B, K): the final query's attention row ``alpha_k`` over key positions 0..K-1, one
  row per query head;
- ``values`` (G, K, D): the value vectors ``v_k`` of each kv head; query head ``b`` reads kv head
  ``head_kv[b]`` (grouped-query attention; by default ``head_kv[b] = b``);
- ``attendable`` (G, K) bool: the keys ``K_b`` the final query may attend to, per kv head (the
  query heads that share a kv head share the final query's mask). Keys outside it
  (sliding-window layers) take no part at all. Position 0 is the sink; an instance whose
  position 0 is not attendable has no sink: all of its keys are non-sink and the sink terms vanish.

Whatever depends only on the values (`values`) is computed once per kv head and shared by the
query heads reading it; each step then runs once for all the query heads of a kv head (a call
into the compiled loops costs microseconds per argument, which small heads notice).

Arithmetic is float64 throughout, but for one screen: the Gram matrix of a kv head's unit
values is computed in float32, within a proven bound of each exact cosine
(`values.screen_bound`), and every pair cosine that an output takes, or that decides one (the
median, a row's maximum, the pairs around a quantile), is computed again in float64 from the
unit vectors (docs/method.md#arithmetic).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import numpy as np

from attngeom.analyze.kernels import values as kv_values
from attngeom.analyze.kernels._jit import cache_is_warm
from attngeom.analyze.kernels.balls import error_bound, group_exact_keys, squared_distances
from attngeom.analyze.kernels.coherence import Coherence, group_coherence
from attngeom.analyze.kernels.geometry import TOPN_INTEGERS, group_geometry
from attngeom.analyze.kernels.pairs import pair_statistics
from attngeom.analyze.kernels.selection import group_aggregates
from attngeom.analyze.kernels.settings import KernelSettings, Tolerances
from attngeom.store.objects.schema import TOPN_FLAGS, TOPN_FLOATS, VALUE_STATISTICS

# The loops index a kv head's pairs as int32 (`pairs.pair_statistics`); the Gram matrix
# alone would take 16 GiB here.
MAX_KEYS = 1 << 16

DEFAULT_SETTINGS = KernelSettings()


def topn_metrics(
    attn: np.ndarray,
    values: np.ndarray,
    attendable: np.ndarray,
    n_grid: Sequence[int],
    *,
    head_kv: np.ndarray | None = None,
    learned_sink: np.ndarray | None = None,
    seed: int = 0,
    random_draws: int = 8,
    settings: KernelSettings = DEFAULT_SETTINGS,
) -> dict[str, np.ndarray]:
    """Top-N separability, bounds and diagnostics at the final query (docs/method.md).

    attn (B, K), values (G, K, D) (float32, as stored, or float64), attendable (G, K) bool,
    head_kv (B,) ints in [0, G) (default: G = B, instance b reads values[b]); n_grid:
    selection sizes N >= 1; the random control's draw d selects the N attendable keys of smallest
    ``np.random.default_rng(seed).random((random_draws, B, K))[d]``; settings:
    `KernelSettings` (tolerances and shortcuts).

    learned_sink (B,): the weight ``s_b`` of each query head's learned sink at the final query,
    for a model with learned sinks (docs/method.md#learned-sinks), where attn holds the weights
    on the real keys (summing to ``1 - s_b``). The sink is then a virtual key with a zero value
    vector, attendable, between key 0 and key 1 (keys 0, sink, 1, ..., K-1: ties and the
    random draws, ``random((random_draws, B, K + 1))``, follow that order); it can be selected
    like any key, has ``beta = 0`` in the bounds, and takes no part in the statistics of the
    values (C, lambda, the cosines, mu).

    Returns an array (B, len(n_grid)) per name of ``TOPN_VARIABLES`` (attngeom.store.objects.schema):
    floats, then int64 counts and the sink's int8 selection flag, each defined in
    docs/method.md and, with its formula, in `geometry.head_geometry`. N is valid for an
    instance iff N < |K_b| (``nosink_*``: N < |K_b \\ {0}|; the virtual key counts in K_b);
    invalid entries are NaN, or -1 for
    the integers.
    """
    return _metrics(attn, values, attendable, n_grid, head_kv, learned_sink, seed, random_draws, settings, False)[0]


def value_statistics(
    values: np.ndarray, attendable: np.ndarray, *, settings: KernelSettings = DEFAULT_SETTINGS
) -> dict[str, np.ndarray]:
    """Norm and coherence statistics of each kv head (docs/method.md#norms-and-coherence).

    values (G, K, D), attendable (G, K) bool; returns an array (G,) per name of
    ``VALUE_STATISTICS`` (attngeom.store.objects.schema), each defined, with its formula, in
    `values.statistics`. They depend on the values only: a query head takes those of the kv
    head it reads.
    """
    _, values, attendable, _ = check_batch(None, values, attendable, None)
    values = values.astype(np.float64, copy=False)
    with np.errstate(divide="ignore", invalid="ignore"):
        kv = kv_values.kv_heads(values, attendable)
        work = np.empty(values.shape[1] ** 2, _gram_dtype(settings))
        median_cos = np.array([pair_statistics(kv_values.nonsink_gram(kv, g, work), settings).median
                               for g in range(values.shape[0])])
        return kv_values.statistics(kv, median_cos)


def head_metrics(
    attn: np.ndarray,
    values: np.ndarray,
    attendable: np.ndarray,
    n_grid: Sequence[int],
    *,
    head_kv: np.ndarray | None = None,
    learned_sink: np.ndarray | None = None,
    seed: int = 0,
    random_draws: int = 8,
    settings: KernelSettings = DEFAULT_SETTINGS,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(topn_metrics(attn, values, attendable, n_grid, ...), value_statistics(values,
    attendable))``, equal to the two calls, from one pass over each kv head's values: their
    norms, unit vectors and Gram matrix serve both. Shapes as in the two functions."""
    return _metrics(attn, values, attendable, n_grid, head_kv, learned_sink, seed, random_draws, settings, True)


def compile_kernels(*, progress: bool = True) -> None:
    """Compile the kernels' loops, or load them from numba's cache beside the package, in
    this process: worker processes forked after it share them (the stage calls it before
    forking its workers; otherwise the first call in each process pays it). A compile takes
    one to two minutes on 2 cores, once after installing or changing the package; a load
    from the cache under a second. progress: say on stderr when it compiles (nothing is said
    when the cache is warm).

    It compiles what a run takes: the loops for the float64 Gram matrix that only non-finite
    values take (`values.nonsink_gram`) are compiled when a block first needs them."""
    cold = progress and not cache_is_warm((kv_values.kv_head, pair_statistics, group_aggregates, group_coherence,
                                           group_exact_keys, group_geometry))
    if cold:
        print("compiling the analysis kernels (first run only, one to two minutes on 2 cores) ...", end="",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    head_metrics(rng.random((2, 8)), rng.normal(size=(2, 8, 2)), np.ones((2, 8), dtype=bool), [1, 2, 4],
                 head_kv=np.arange(2), random_draws=1)
    if cold:
        print(f" done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _metrics(attn, values, attendable, n_grid, head_kv, learned_sink, seed, random_draws, settings, with_values):
    """topn_metrics' outputs, and value_statistics' (None unless with_values)."""
    alpha, values, attendable, head_kv = check_batch(attn, values, attendable, head_kv)
    virtual = learned_sink is not None
    if virtual:
        alpha, values, attendable = _with_virtual_key(alpha, values, attendable, learned_sink)
    grid = np.asarray(n_grid, dtype=np.int64).reshape(-1)
    if np.any(grid < 1):
        raise ValueError(f"n_grid must hold sizes N >= 1, got {grid.tolist()}")
    if random_draws < 0:
        raise ValueError(f"random_draws must be >= 0, got {random_draws}")
    B, K = alpha.shape
    # Drawn as documented, (R, B, K); each group of query heads takes its rows as (h, R, K).
    draw_keys = np.random.default_rng(seed).random((random_draws, B, K)).transpose(1, 0, 2)

    # Every head's outputs at once: (B, variable, N), split into variables by name at the end.
    floats = np.full((B, len(TOPN_FLOATS), grid.size), np.nan)
    counts = np.full((B, len(TOPN_INTEGERS), grid.size), -1, dtype=np.int64)
    stats = {name: np.full(values.shape[0], np.nan) for name in VALUE_STATISTICS} if with_values else None
    work = np.empty(K * K, _gram_dtype(settings))
    # Degenerate instances (zero vectors, zero norms) give NaN by design, not warnings.
    with np.errstate(divide="ignore", invalid="ignore"):
        for g in range(values.shape[0]) if with_values else np.unique(head_kv):
            # Keys outside the mask take no part: a sliding-window layer is computed on its
            # window alone (the first and last positions stay, as the sink and the current
            # key, whatever the mask says of them).
            keys = _kept_keys(attendable[g])
            vals = np.ascontiguousarray(values[g][keys], dtype=np.float64)
            att = np.ascontiguousarray(attendable[g][keys])
            kv = kv_values.kv_heads(vals[None], att[None], virtual=virtual)
            screen = kv_values.nonsink_gram(kv, 0, work)
            pairs = pair_statistics(screen, settings)
            heads = np.flatnonzero(head_kv == g)
            if heads.size:
                # C-contiguous like every input (`check_batch`): the window's keys picked by
                # index would leave the rows Fortran-ordered, a signature of their own.
                rows = np.ascontiguousarray(alpha[heads][:, keys])
                _query_heads((floats, counts), heads, rows, kv_values.one_kv_head(kv, 0, vals, att),
                             kv.nonsink[0], screen, pairs, grid, draw_keys[heads][:, :, keys], settings)
            if with_values:
                for name, x in kv_values.statistics(kv, np.array([pairs.median])).items():
                    stats[name][g] = x[0]
    out = {name: floats[:, i] for i, name in enumerate(TOPN_FLOATS)}
    out.update({name: counts[:, i] for i, name in enumerate(TOPN_INTEGERS)})
    for flag in TOPN_FLAGS:
        out[flag] = out[flag].astype(np.int8)
    return out, stats


def _with_virtual_key(alpha, values, attendable, learned_sink):
    """The inputs with the learned sink as key 1: its weight in alpha (B, K+1), a zero value
    in values (G, K+1, D), attendable."""
    sink = np.asarray(learned_sink, dtype=np.float64).reshape(-1)
    if sink.shape != (alpha.shape[0],):
        raise ValueError(f"learned_sink has shape {np.shape(learned_sink)}, expected ({alpha.shape[0]},)")
    if values.shape[1] + 1 > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per instance, the learned sink included")
    return (np.insert(alpha, 1, sink, axis=1), np.insert(values, 1, 0.0, axis=1),
            np.insert(attendable, 1, True, axis=1))


def _gram_dtype(settings):
    return np.float32 if settings.float32_gram else np.float64


def _kept_keys(attendable):
    """The positions a kv head's computation keeps: all (a slice, no copy) unless some key
    between the first and the last is masked."""
    if attendable[1:-1].all():
        return slice(None)
    keep = attendable.copy()
    keep[0] = keep[-1] = True
    return np.flatnonzero(keep)


def _query_heads(out, heads, alpha, kv, nonsink, screen, pairs, grid, draw_keys, settings):
    """Rows heads of out = (floats, counts), (B, variable, len(grid)) each: the outputs at
    every N of grid of the query heads reading the kv head kv (`values.KvHead`), from their
    attention rows alpha (h, K), the kv head's non-sink keys nonsink (K,), its `pairs.Screen`
    and `pairs.PairStatistics`; draw_keys (h, R, K)."""
    values, att = kv.values, kv.att
    n_att = int(att.sum())
    points = np.unique(grid[grid < n_att])
    tol = Tolerances(error_bound(values.shape[1]), settings.tiny, settings.l_rtol)
    agg = group_aggregates(alpha, values, att, points, np.ascontiguousarray(draw_keys))
    if screen.gram.shape[0] >= 2:
        coherence = group_coherence(np.ascontiguousarray(agg.orders.rank[:, nonsink]), pairs, screen, points, n_att)
    else:
        coherence = Coherence(np.full((heads.size, points.size), np.nan), np.full((heads.size, points.size), np.nan))
    # <s, v_k> of every aggregate and key: one product of every head's aggregates with the
    # values they share (a product per head, of y, took a third longer); the loops take
    # <s, y_k> as alpha_k <s, v_k>.
    S = agg.S
    sv = (S.reshape(-1, S.shape[-1]) @ values.T).reshape(*S.shape[:2], values.shape[0])
    expansions, hh, rows, keys = group_exact_keys(agg, sv, alpha, points, att, tol)
    exact = (hh, rows, keys, squared_distances(agg.y[hh, keys], S[hh, rows]))
    floats, counts = group_geometry(kv, points, alpha, agg, sv, expansions, exact, coherence, tol)
    if np.array_equal(points, grid):  # every size valid, each once, in order: the common case
        for whole, part in zip(out, (floats, counts)):
            whole[heads] = part
        return
    valid = np.flatnonzero(grid < n_att)
    at = np.searchsorted(points, grid[valid])
    for whole, part in zip(out, (floats, counts)):
        whole[np.ix_(heads, np.arange(part.shape[1]), valid)] = part[..., at]


def check_batch(attn, values, attendable, head_kv):
    """The inputs as the loops take them (float64, bool and int64, C-contiguous, writeable;
    float32 values as they are, cast a kv head at a time), checked: ValueError naming what
    is wrong."""
    # Contiguous and writeable: the compiled loops have one signature, loaded from numba's
    # cache; a read-only input (a broadcast mask) would compile another one in every worker.
    # Values as stored (float32) are cast where a kv head is taken: the float64 copy of a
    # whole layer's (32 MB at a 7B model's shape) costs more than the kv heads' ones, each
    # still in cache when its loops read it.
    values = np.require(values, np.float32 if np.asarray(values).dtype == np.float32 else np.float64, ["C", "W"])
    attendable = np.require(attendable, bool, ["C", "W"])
    if values.ndim != 3 or values.shape[1] < 1:
        raise ValueError(f"values must have shape (G, K, D) with K >= 1, got {values.shape}")
    if values.shape[1] > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per instance, got {values.shape[1]}")
    if attendable.shape != values.shape[:2]:
        raise ValueError(f"attendable has shape {attendable.shape}, expected {values.shape[:2]}")
    if attn is None:
        return None, values, attendable, None
    attn = np.require(attn, np.float64, ["C", "W"])
    if attn.ndim != 2 or attn.shape[1] != values.shape[1]:
        raise ValueError(f"attn has shape {attn.shape}, expected (B, {values.shape[1]})")
    if head_kv is None:
        if attn.shape[0] != values.shape[0]:
            raise ValueError(f"attn has {attn.shape[0]} rows for {values.shape[0]} value heads; "
                             "pass head_kv")
        head_kv = np.arange(attn.shape[0])
    head_kv = np.asarray(head_kv, dtype=np.int64).reshape(-1)
    if head_kv.shape != (attn.shape[0],) or np.any((head_kv < 0) | (head_kv >= values.shape[0])):
        raise ValueError(f"head_kv must hold {attn.shape[0]} kv heads in [0, {values.shape[0]}), "
                         f"got {head_kv.tolist()}")
    return attn, values, attendable, head_kv
