"""``attngeom explore``: an offline, interactive page to look at every head's geometry.

The folder written holds ``index.html``, the page's script and style, a vendored copy of
plotly.js, ``data/index.js`` (every run's head table: a few values per head) and one
``data/<run>/head_<layer>_<head>.js`` per head with that head's instances. A page opened from
disk may not ``fetch()`` files, so each data file is a script calling a registration function,
and a head's file is injected only when its cell is clicked: the page starts with the table
alone whatever the number of heads and the context length.

Its size: plotly.js (4.6 MB), the head table, and for each head, each of the first
``sequences`` sequences and each query shown (the final one, then each stored one before it)
about 10 bytes per key plus 1 kB before compression: weights as float16, the picture's points on
a uint16 grid, one bit per key and N, per-N numbers as float32; a head's file is that JSON,
gzipped, in base64. It does not grow with the store's sequences beyond ``sequences``. For a run
of 6 sequences at L = 512 kept at every 64th query, the head files take about a third of the
store's size (a sixth where one kv head of dimension 256 serves four heads, as in Gemma 3 270M).
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from attngeom.version import __version__
from attngeom.errors import InputError
from attngeom.explore import data
from attngeom.explore.geometry import Picture, value_picture
from attngeom.detect.head_classes import CRITERIA, SCORES, run_scores
from attngeom.analyze.palette import REGIME_COLORS, VOTE_COLORS
from attngeom.store import VOTES

PAGE_FILES = ("explore.js", "explore.css")
PLOTLY = "plotly.min.js"
# What marks a folder as one this stage wrote, so that writing again may replace it.
MARKER = ".attngeom-explore"


@dataclass(frozen=True)
class ExploreResult:
    """What ``explore`` wrote: the page, how many runs and heads, and the folder's size."""

    index: Path
    runs: int
    heads: int
    bytes: int
    seconds: float


def explore(store: str, out: Path, *, run_id: str | None = None, sequences: int = 8,
            progress: bool = True) -> ExploreResult:
    """Write the explorer of ``store`` (every run, or ``run_id``) into the folder ``out``.

    Each head's page shows its first ``sequences`` committed sequences. Needs no model (the
    tokenizer, when it can be read from local files, decodes the tokens). Inputs are checked
    before anything is written; on failure nothing is left behind. An existing ``out`` is
    replaced only if an earlier ``explore`` wrote it.
    """
    start = time.perf_counter()
    if sequences < 1:
        raise InputError(f"--sequences must be at least 1, got {sequences}")
    out = Path(out)
    _check_target(out)
    runs = data.open_runs(store, run_id, sequences)
    created = next((p for p in reversed(out.absolute().parents) if not p.exists()), None)
    # Written aside and moved in at the end: a failure leaves neither a half folder nor
    # the parents made for it. Made as mkdir does (the umask's mode, not mkdtemp's 0700):
    # the page is for others to read too.
    work = out.parent / f".{out.name}-{uuid.uuid4().hex[:12]}"
    try:
        work.mkdir(parents=True)
    except OSError as exc:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise InputError(f"--out {out} cannot be made a folder ({exc.strerror or exc})") from exc
    try:
        heads = _write(store, runs, work, progress)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(created or work, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return ExploreResult(out / "index.html", len(runs), heads, size, time.perf_counter() - start)


def _check_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise InputError(f"--out {out} is a non-empty folder that attngeom explore did not write")


def _write(store: str, runs: list[data.ExploreRun], out: Path, progress: bool) -> int:
    (out / MARKER).write_text(f"attngeom {__version__}\n")
    for name in PAGE_FILES:
        (out / name).write_bytes(resources.files(__package__).joinpath(name).read_bytes())
    plotly_version = _vendor_plotly(out / PLOTLY)
    (out / "data").mkdir()
    entries = []
    heads = 0
    for run in runs:
        folder = out / "data" / run.run_id
        folder.mkdir()
        heads += _write_heads(run, folder, progress)
        entries.append(_run_entry(run, progress))
    palette = {"regime": REGIME_COLORS, "vote": VOTE_COLORS}
    _write_script(out / "data" / "index.js", "index", {"store": store, "runs": entries, "palette": palette})
    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")
    page = page.replace("{{version}}", __version__).replace("{{plotly_version}}", plotly_version)
    (out / "index.html").write_text(page, encoding="utf-8")
    return heads


def _vendor_plotly(target: Path) -> str:
    """Copy plotly.js from the ``plotly`` package; return its version (from its banner)."""
    source = resources.files("plotly").joinpath("package_data", PLOTLY)
    text = source.read_bytes()
    target.write_bytes(text)
    found = re.search(rb"plotly\.js v([0-9][0-9A-Za-z.\-]*)", text[:400])
    return found.group(1).decode() if found else "unknown"


def _write_script(path: Path, register: str, payload: Any, *args: Any, packed: bool = False) -> None:
    """A data file: one call ``attngeomExplore.<register>(*args, payload)``; ``packed``, the
    payload's JSON gzipped in base64 (the page inflates it with DecompressionStream): a head's
    file shrinks by about 30%."""
    text = json.dumps(_jsonable(payload), separators=(",", ":"))
    if packed:
        text = json.dumps(base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode("ascii"))
    call = ", ".join([*(json.dumps(a) for a in args), text])
    path.write_text(f"attngeomExplore.{register}({call});\n", encoding="utf-8")


def _jsonable(obj: Any) -> Any:
    """Plain JSON: NumPy scalars and arrays as numbers and lists, NaN and inf as null, and
    floats to 5 significant digits (the page shows 3 or 4; a float64's 17 took a third of a
    head's file)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, (float, np.floating)):
        return _digits(obj) if np.isfinite(obj) else None
    return obj


def _digits(x: float) -> float:
    return float(f"{x:.5g}")


def _base64(x: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(x, dtype=dtype).tobytes()).decode("ascii")


def _float32(x: np.ndarray) -> str:
    """Base64 of little-endian float32 (NaN where undefined): per-N numbers, at a third of
    their size in JSON."""
    return _base64(x, "<f4")


def _float16(x: np.ndarray) -> str:
    """Base64 of little-endian float16: attention weights to 3 significant digits (0 below
    6e-8), a quarter of their size in JSON."""
    return _base64(x, "<f2")


def _positions(x: np.ndarray, length: int) -> str:
    """Base64 of key positions as little-endian uint16, or uint32 for a context of more than
    65,536 keys."""
    return _base64(x, "<u2" if length <= 2**16 else "<u4")


def _plane(xy: np.ndarray) -> dict[str, Any]:
    """Points (K, 2) on a uint16 grid: x = lo + q * step per axis, one step for both axes (the
    drawing keeps their scales equal), 65535 for a point not drawn (NaN). The step is 1/65534
    of the larger extent, far below a pixel; ``lo`` and ``step`` are chosen among the numbers
    of 5 significant digits that JSON carries, ``lo`` at or below every point."""
    drawn = np.isfinite(xy).all(axis=1)
    points = xy[drawn] if drawn.any() else np.zeros((1, 2))
    lo = [_digits(v - abs(v) * 1e-4) for v in points.min(axis=0)]
    extent = float((points - lo).max())
    step = _digits(extent / 65534 * (1 + 1e-4)) if extent > 0 else 1.0
    grid = np.full(xy.shape, 65535, dtype="<u2")
    grid[drawn] = np.rint((xy[drawn] - lo) / step)
    return {"lo": lo, "step": step, "q": _base64(grid, "<u2")}


def _bits(masks: np.ndarray) -> str:
    """Base64 of boolean masks (G, K), each packed 8 keys a byte (key k at bit k % 8 of byte
    k // 8) and padded to whole bytes, one after the other."""
    return base64.b64encode(np.packbits(masks, axis=-1, bitorder="little").tobytes()).decode("ascii")


def _run_entry(run: data.ExploreRun, progress: bool) -> dict[str, Any]:
    """The run's head table and what every head page shares (tokens, grid, notes)."""
    layout = run.layout
    with tqdm(total=2, unit="step", desc=f"{run.run_id}: tokens", disable=not progress) as bar:
        bar.set_postfix_str("loading the tokenizer")
        decode, how = data.token_decoder(run.provenance)
        bar.update()
        bar.set_postfix_str("decoding")
        ids = data.read_tokens(run)
        # Undecoded ids are kept apart by a space in the running text.
        tokens = decode(ids) if decode else [[f"{int(t)} " for t in row] for row in ids]
        bar.update()
    stats: dict[str, Any] = {}
    if run.heads is not None:
        stats["regime"] = [[str(x) for x in row] for row in np.asarray(run.heads["regime"].values)]
        for name in VOTES:
            stats[f"vote_{name}"] = run.heads[f"vote_{name}"].values
        if "sink_norm_ratio" in run.heads:
            stats["lambda"] = run.heads["sink_norm_ratio"].values
    if run.summary is not None and "f_score" in run.summary:
        stats["f_score"] = run.summary["f_score"].sel(stat="mean").transpose("layer", "head", "n").values
    if run.ablation is not None and "delta_nll_mean" in run.ablation:
        stats["delta_nll"] = run.ablation["delta_nll_mean"].transpose("layer", "head").values
    scores = {name: x.values for name, x in run_scores(run.head_scores, run.detect).items()}
    stats.update(scores)
    return {
        "id": run.run_id, "model": run.model, "dataset": run.dataset, "length": layout.length,
        "dtype": run.compute_dtype,
        "layers": layout.n_layers, "heads": layout.n_heads, "kv_heads": layout.n_kv_heads,
        "head_dim": layout.head_dim, "head_kv": list(layout.head_kv), "window": list(layout.window),
        "n_grid": run.n_grid, "sequences": run.sequences, "tokens": tokens, "token_ids": ids,
        "tokens_note": how, "stats": stats, "notes": run.notes,
        "field": _field_entry(scores, run.field_missing),
        "query_pos": [q for _, q in _earlier_queries(run)],
    }


def _field_entry(scores: dict[str, np.ndarray], missing: list[str]) -> dict[str, Any]:
    """The field's scores of every head (name -> (layer, head)), with their labels, the
    criteria that make classes of them (docs/method.md#field-classes), and what the run lacks."""
    return {
        "scores": scores,
        "labels": {s.name: s.label for s in SCORES if s.name in scores},
        "criteria": [{"name": c.name, "column": c.column, "score": c.score, "threshold": c.threshold,
                      "above": c.above, "rule": c.rule, "source": c.source} for c in CRITERIA],
        "missing": missing,
    }


def _write_heads(run: data.ExploreRun, folder: Path, progress: bool) -> int:
    layout = run.layout
    total = layout.n_layers * layout.n_heads
    # Single-threaded BLAS: each call is small (a D x D eigenproblem per instance), too small
    # for a multi-threaded BLAS to gain anything but its threads' synchronization.
    with threadpool_limits(limits=1), \
            tqdm(total=total, unit="head", desc=f"{run.run_id}: heads", disable=not progress) as bar:
        for layer in range(layout.n_layers):
            arrays = data.read_layer(run, layer)
            for head in range(layout.n_heads):
                payload = _head_payload(run, arrays, layer, head)
                _write_script(folder / f"head_{layer}_{head}.js", "head", payload, run.run_id, layer, head,
                              packed=True)
                bar.update()
    return total


def _earlier_queries(run: data.ExploreRun) -> list[tuple[int, int]]:
    """(index among the stored queries, position) of those before the final query: the final
    query's row is attn_last, which the page shows as its "final" query already."""
    return [(i, int(q)) for i, q in enumerate(run.layout.queries) if q < run.layout.length - 1]


def _head_payload(run: data.ExploreRun, arrays: data.LayerData, layer: int, head: int) -> dict[str, Any]:
    """One head: per chosen sequence its attention row, the value picture and its curves, at
    the final query (``instances``) and at each stored query (``by_query``, one list of
    instances per position of ``query_pos``)."""
    by_query = []
    if arrays.query_rows is not None:
        by_query = [_instances(run, arrays.at_query(q, i), head, "analysis/topn_by_query")
                    for i, q in _earlier_queries(run)]
    kv = run.layout.head_kv[head]
    heads = run.heads
    regime = None if heads is None else {
        "regime": str(heads["regime"].values[layer, head]),
        **{f"vote_{v}": heads[f"vote_{v}"].values[layer, head] for v in VOTES},
        **{f"sequences_{v}": heads[f"sequences_{v}"].values[layer, head] for v in VOTES},
    }
    return {
        "kv_head": kv, "shares_kv": [h for h, k in enumerate(run.layout.head_kv) if k == kv and h != head],
        "window": run.layout.window[layer], "regime": regime,
        "instances": _instances(run, arrays, head, "analysis/topn"), "by_query": by_query,
    }


def _instances(run: data.ExploreRun, arrays: data.LayerData, head: int, source: str) -> list[dict[str, Any]]:
    """Per chosen sequence: head ``head``'s row in ``arrays``, its value picture, and its
    curves from the analysis group ``source``."""
    kv = run.layout.head_kv[head]
    attn = arrays.attn[:, head]
    attendable = np.broadcast_to(arrays.attendable, attn.shape)
    picture = value_picture(attn, arrays.values[:, kv], attendable, run.n_grid)
    top = max(run.n_grid)
    all_curves, all_votes = _by_sequence(arrays.curves, head), _by_sequence(arrays.votes, head)
    instances = []
    for b, seq in enumerate(run.sequences):
        curves, votes = all_curves.get(int(seq)), all_votes.get(int(seq))
        # The store's P and R (analysis/topn) where it has them; else the picture's own.
        precision, recall = picture.precision[b], picture.recall[b]
        exact = np.zeros(len(run.n_grid), dtype=bool)
        if curves is not None:
            exact = np.isfinite(curves["precision"])
            precision, recall = np.where(exact, curves["precision"], precision), np.where(exact, curves["recall"], recall)
        instances.append({
            "seq": int(seq), "source": source, "attn": _float16(attn[b]), "xy": _plane(picture.xy[b]),
            "order": _positions(picture.order[b, :top], run.layout.length), "explained": picture.explained[b],
            "per_n": {
                "exact": exact, "s": _float32(picture.s_xy[b]), "r_min": _float32(picture.r_min[b]),
                "r_max": _float32(picture.r_max[b]), "precision": _float32(precision), "recall": _float32(recall),
                "misplaced": _bits(_misplaced(picture, b, run.n_grid)),
            },
            "curves": _encoded(curves), "votes": None if votes is None else votes.astype(int).tolist(),
        })
    return instances


def _misplaced(picture: Picture, b: int, n_grid: list[int]) -> np.ndarray:
    """(G, K) bool: per N, the keys that lower R or P, as the geometry panel marks them: those
    of I_N outside the open r_min ball, and the others inside the closed r_max ball. One mask
    where the picture has two: which of the two applies follows from the key's rank."""
    selected = np.zeros(picture.in_r_max[b].shape, dtype=bool)
    for g, n in enumerate(n_grid):
        selected[g, picture.order[b, :n]] = True
    return np.where(selected, ~picture.in_r_min[b], picture.in_r_max[b])


def _by_sequence(ds: xr.Dataset | xr.DataArray | None, head: int) -> dict[int, Any]:
    """Head ``head``'s rows of ``ds`` (seq, head, ...) by sequence id, as NumPy: indexing an
    xarray object per instance cost half of explore's time."""
    if ds is None:
        return {}
    ds = ds.isel(head=head).transpose("seq", ...)
    if isinstance(ds, xr.DataArray):
        rows = ds.values
        return {int(s): rows[i] for i, s in enumerate(ds["seq"].values)}
    columns = {name: ds[name].values for name in data.CURVES}
    return {int(s): {name: v[i] for name, v in columns.items()} for i, s in enumerate(ds["seq"].values)}


def _encoded(curves: dict[str, np.ndarray] | None) -> dict[str, str] | None:
    return None if curves is None else {name: _float32(v) for name, v in curves.items()}


