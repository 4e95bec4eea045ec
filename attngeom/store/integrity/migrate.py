"""Bring a store of an older format up to the one this attngeom writes (``attngeom migrate``).

A migration rewrites arrays one at a time, each through a temporary copy, so that a
migration killed at any moment loses nothing and is finished by running it again:

1. the root's attributes record ``migrating`` (readers and writers refuse the store until
   it is gone, as its arrays are half old and half new);
2. each array is decoded chunk by chunk with its old metadata and re-encoded into a
   temporary array under ``_migrating/`` with its new metadata; its path then joins
   ``migrating.copied``;
3. the copy's objects replace the array's own, its ``zarr.json`` last, and the copy goes;
4. once every array is done, ``format`` is raised and ``migrating`` removed, or, when
   another step follows, replaced by that step's in the same write.

An array in ``copied`` is resumed at step 3 (its own objects may be partly replaced); any
other is decoded again from its untouched objects. A step may also record something in
each run's attributes (format 5: the summaries a run lacks), after its arrays and before
the format is raised, idempotently. Migrations chain, one format at a time (a format-1
store goes 1 -> 2 -> 3 -> 4 -> 5 in one ``migrate``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from tqdm.auto import tqdm
from zarr.buffer import default_buffer_prototype

from attngeom.errors import DamagedStoreError, SchemaError, StoreNotFoundError
from attngeom.store.extracted.checks import array_metadata, arrays_of
from attngeom.store.extracted.runs import open_run_group, run_ids
from attngeom.store.holds.access import consolidate, read_root_attrs, remove_partials, store_format
from attngeom.store.objects._zarr import sync
from attngeom.store.objects.codecs import compressor, has_checksum, with_checksum
from attngeom.store.objects.schema import (
    ATTR_KEY,
    FIELD_SUMMARIES,
    FORMAT,
    LABEL_ORDERS,
    LABELS,
    label_codes,
    label_dtype,
)
from attngeom.store.objects.storage import local_path, metadata_bytes, zarr_store

TEMPORARY = "_migrating"


@dataclass(frozen=True)
class Migration:
    """One step from format ``source`` to ``source + 1``: which arrays it rewrites (by their
    path and ``zarr.json``), their new ``zarr.json`` (from the old one and the array), how
    the values of a chunk read with the old one become those written with the new one, and
    what it records in each run."""

    source: int
    doc: str
    needs: Callable[[str, Mapping[str, Any]], bool] = lambda path, meta: False
    rewrite: Callable[[Mapping[str, Any], zarr.Array], dict[str, Any]] = lambda meta, arr: dict(meta)
    convert: Callable[[Mapping[str, Any], Mapping[str, Any], np.ndarray], np.ndarray] = (
        lambda old, new, values: values
    )
    # What the step records in each run's group, once its arrays are done; it must be
    # idempotent, for a killed migration does it again.
    run: Callable[[zarr.Group], None] = lambda run: None


def _is_text(path: str, meta: Mapping[str, Any]) -> bool:
    """Whether the array of this ``zarr.json`` holds zarr-python's variable-length strings."""
    return meta["data_type"] == "string"


def _labels(meta: Mapping[str, Any]) -> list[str] | None:
    """The labels of a label array's ``zarr.json``; None for any other array."""
    own = meta.get("attributes", {}).get(ATTR_KEY)
    return list(own[LABELS]) if isinstance(own, Mapping) and LABELS in own else None


def _order(path: str) -> tuple[str, ...]:
    """The fixed order of the labels of the array at ``path`` (by its name), if any."""
    return LABEL_ORDERS.get(path.rpartition("/")[2], ())


def _coded(meta: Mapping[str, Any], labels: list[str]) -> dict[str, Any]:
    """The ``zarr.json`` of a label array holding codes of ``labels``, as ``write_dataset``
    writes label variables (the labels in its attributes)."""
    dtype = np.dtype(label_dtype(len(labels)))
    out = json.loads(json.dumps(meta))
    out["data_type"] = dtype.name
    out["fill_value"] = 0
    out["codecs"] = [
        {"name": "bytes", "configuration": {"endian": "little"}} if dtype.itemsize > 1 else {"name": "bytes"},
        compressor(dtype.itemsize).to_dict(),
        *[c for c in meta["codecs"] if c["name"] == "crc32c"],
    ]
    out["attributes"] = {
        **meta.get("attributes", {}),
        "flag_values": list(range(len(labels))),
        "flag_meanings": " ".join("_".join(label.split()) or "_" for label in labels),
        ATTR_KEY: {LABELS: labels},
    }
    return out


def _as_codes(meta: Mapping[str, Any], arr: zarr.Array) -> dict[str, Any]:
    """The ``zarr.json`` of a string array stored as integer codes (its labels, those of the
    whole array, in their fixed order where the array has one)."""
    labels, _ = label_codes(np.asarray(arr[...], dtype=object), _order(arr.path))
    return _coded(meta, labels)


def _to_codes(old: Mapping[str, Any], new: Mapping[str, Any], values: np.ndarray) -> np.ndarray:
    """String values as the codes of the labels in the new ``zarr.json``."""
    index = {label: i for i, label in enumerate(new["attributes"][ATTR_KEY][LABELS])}
    codes = [index.get(v, -1) if isinstance(v, str) else -1 for v in np.asarray(values, dtype=object).ravel()]
    return np.asarray(codes, dtype=new["data_type"]).reshape(values.shape)


def _out_of_order(path: str, meta: Mapping[str, Any]) -> bool:
    """Whether a label array of a fixed vocabulary numbers its labels otherwise."""
    labels, order = _labels(meta), _order(path)
    return bool(order) and labels is not None and labels[: len(order)] != list(order)


def _in_order(meta: Mapping[str, Any], arr: zarr.Array) -> dict[str, Any]:
    """The ``zarr.json`` of a label array with its labels in their fixed order."""
    order = _order(arr.path)
    return _coded(meta, [*order, *(label for label in _labels(meta) if label not in order)])


def _recoded(old: Mapping[str, Any], new: Mapping[str, Any], values: np.ndarray) -> np.ndarray:
    """Codes of the old ``zarr.json``'s labels as codes of the new one's (-1 stays -1)."""
    index = {label: i for i, label in enumerate(_labels(new))}
    table = np.asarray([*(index[label] for label in _labels(old)), -1], dtype=new["data_type"])
    return table[np.asarray(values)]


def _mark_lacking(run: zarr.Group) -> None:
    """Record in a run's layout the per-query summaries of format 5 it lacks: the model is
    needed to compute them, and readers say so (``lacking_summaries``). A run whose
    creation never finished has no layout: the extract that finishes it writes them."""
    meta = run.attrs.get(ATTR_KEY)
    if not isinstance(meta, Mapping) or not isinstance(meta.get("layout"), Mapping):
        return
    lacking = [name for name in FIELD_SUMMARIES if name not in run]
    if lacking and meta["layout"].get("lacking") != lacking:
        run.attrs[ATTR_KEY] = {**meta, "layout": {**meta["layout"], "lacking": lacking}}


def _mark_layers(run: zarr.Group) -> None:
    """Record in a run's layout the model's own layer indices (those of format 6: a run
    before it stored every layer, 0..n-1) and that its model has no learned sinks (extract
    kept none before format 6)."""
    meta = run.attrs.get(ATTR_KEY)
    if not isinstance(meta, Mapping) or not isinstance(meta.get("layout"), Mapping):
        return
    layout = meta["layout"]
    marked = {"layers": list(range(int(layout["n_layers"]))), "learned_sinks": False}
    if any(layout.get(k) != v for k, v in marked.items()):
        run.attrs[ATTR_KEY] = {**meta, "layout": {**layout, **marked}}


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "a crc32c checksum at the end of every chunk",
        needs=lambda path, meta: not has_checksum(meta),
        rewrite=lambda meta, arr: with_checksum(meta),
    ),
    Migration(
        2,
        "labels as integer codes of the Zarr v3 core",
        needs=_is_text,
        rewrite=_as_codes,
        convert=_to_codes,
    ),
    Migration(
        3,
        "the same codes for the labels of a fixed vocabulary in every store",
        needs=_out_of_order,
        rewrite=_in_order,
        convert=_recoded,
    ),
    Migration(
        4,
        "runs extracted before prev_attn and recent_attn marked as lacking them",
        run=_mark_lacking,
    ),
    Migration(
        5,
        "runs marked with their layer indices and as having no learned sinks",
        run=_mark_layers,
    ),
    # Nothing to rewrite: a record naming no generation reads its groups where they are. The
    # raised format keeps writers that do not fence (docs/store.md#commit-protocol) off the store.
    Migration(6, "derived groups read through records that may name a generation"),
)


@dataclass
class MigrationReport:
    """What ``migrate`` did: formats, arrays rewritten, chunk objects and their bytes."""

    source: int
    target: int
    arrays: int = 0
    chunks: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


def migrate(url: str, *, progress: bool = True) -> MigrationReport:
    """Migrate the store at ``url`` to format ``FORMAT``, or finish an
    interrupted migration. Needs the store to itself: no extract or analyze may run on it."""
    start = time.perf_counter()
    path = local_path(url)
    if path is not None and not (path / "zarr.json").is_file():
        raise StoreNotFoundError(f"no attngeom store at {url}")
    store = zarr_store(url, read_only=False)
    try:
        root = zarr.open_group(store, mode="r+", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise StoreNotFoundError(f"no attngeom store at {url}") from exc
    except ValueError as exc:
        raise DamagedStoreError(f"{url}: the root's zarr.json is unreadable ({exc})") from exc
    meta = read_root_attrs(root, url, writing=False, migrating_ok=True)
    report = MigrationReport(store_format(meta), FORMAT)
    if report.source > FORMAT:
        raise SchemaError(f"store format {report.source} is newer than this attngeom knows ({FORMAT}); upgrade attngeom")
    if report.source == FORMAT and "migrating" not in meta:
        return report
    remove_partials(url)
    for step in MIGRATIONS:
        if step.source != store_format(meta):
            continue
        state = meta.setdefault("migrating", {"source": step.source, "target": step.source + 1, "copied": []})
        # The root's consolidated copy of the metadata would describe arrays by their old
        # codecs once they are rewritten; it goes first and is rebuilt at the end.
        _set_root_attrs(root, meta)
        root = _without_consolidated(store)
        zarr.open_group(store, path=TEMPORARY, mode="a")
        arrays = [a for a in arrays_of(root) if not a.path.startswith(f"{TEMPORARY}/")]
        metadata = {a.path: array_metadata(a) for a in arrays}
        todo = [a for a in arrays if a.path in state["copied"] or step.needs(a.path, metadata[a.path])]
        desc = f"format {step.source} -> {step.source + 1}: {step.doc}"
        for arr in tqdm(todo, unit="array", desc=desc, disable=not progress):
            if arr.path not in state["copied"]:
                _copy(arr, metadata[arr.path], step.rewrite(metadata[arr.path], arr), step.convert)
                state["copied"].append(arr.path)
                _set_root_attrs(root, meta)
            chunks, size = _replace(store, arr.path)
            state["copied"].remove(arr.path)
            _set_root_attrs(root, meta)
            report.arrays += 1
            report.chunks += chunks
            report.bytes_written += size
        for run_id in run_ids(root):
            step.run(open_run_group(root, run_id))
        # The next step's mark goes with the raised format, in one write: a store between
        # two steps is never taken for a finished one.
        meta["format"] = step.source + 1
        if meta["format"] < FORMAT:
            meta["migrating"] = {"source": meta["format"], "target": meta["format"] + 1, "copied": []}
        else:
            del meta["migrating"]
        _set_root_attrs(root, meta)
    sync(store.delete_dir(TEMPORARY))
    consolidate(root)
    report.seconds = time.perf_counter() - start
    return report


def _without_consolidated(store: Any) -> zarr.Group:
    """Drop the root's consolidated metadata; the root reopened."""
    metadata = json.loads(_get(store, "zarr.json"))
    if metadata.pop("consolidated_metadata", None) is not None:
        _put(store, "zarr.json", metadata_bytes(metadata))
    return zarr.open_group(store, mode="r+", use_consolidated=False)


def _set_root_attrs(root: zarr.Group, meta: Mapping[str, Any]) -> None:
    root.attrs[ATTR_KEY] = json.loads(json.dumps(meta))


def _temporary(path: str) -> str:
    """The temporary copy of the array ``path``: flat, so that ``_migrating`` is one group."""
    return f"{TEMPORARY}/{hashlib.sha1(path.encode()).hexdigest()[:16]}"


def _chunk_keys(store: Any, path: str) -> list[str]:
    """Keys of the stored chunk objects (shards for a sharded array) of the array ``path``,
    relative to it."""

    async def collect() -> list[str]:
        return [key async for key in store.list_prefix(f"{path}/")]

    return sorted(k[len(path) + 1 :] for k in sync(collect()) if k != f"{path}/zarr.json")


def _grid_index(key: str, metadata: Mapping[str, Any]) -> tuple[int, ...]:
    encoding = metadata["chunk_key_encoding"]
    separator = encoding.get("configuration", {}).get("separator", "/" if encoding["name"] == "default" else ".")
    if encoding["name"] == "default":
        key = key.removeprefix("c").removeprefix(separator)
    return tuple(int(i) for i in key.split(separator)) if key else (0,) * len(metadata["shape"])


def _copy(
    arr: zarr.Array,
    old: Mapping[str, Any],
    new: dict[str, Any],
    convert: Callable[[Mapping[str, Any], Mapping[str, Any], np.ndarray], np.ndarray],
) -> None:
    """Re-encode every stored chunk of ``arr`` (``zarr.json`` ``old``) into its temporary
    copy under ``new``, its values passed through ``convert``.

    Only chunks that exist are written, and each is written even when it equals the fill
    value, so the copy holds the same objects (validate tells written from unwritten
    sequences by them).
    """
    store = arr.store
    temp = _temporary(arr.path)
    sync(store.delete_dir(temp))
    _put(store, f"{temp}/zarr.json", metadata_bytes(new))
    grid = arr.shards or arr.chunks
    keys = _chunk_keys(store, arr.path)
    # The setting is read when an array is opened.
    with zarr.config.set({"array.write_empty_chunks": True}):
        target = zarr.open_array(store, path=temp, mode="r+")
        for key in keys:
            index = _grid_index(key, old)
            region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, grid, arr.shape))
            target[region] = convert(old, new, np.asarray(arr[region]))
    if _chunk_keys(store, temp) != keys:
        raise DamagedStoreError(f"migrating '{arr.path}': its copy does not hold the same chunks; nothing was replaced, run migrate again")


def _replace(store: Any, path: str) -> tuple[int, int]:
    """Move the temporary copy of ``path`` over it: chunk objects first, ``zarr.json`` last.
    Returns the count and bytes of the chunk objects."""
    temp = _temporary(path)
    if not sync(store.exists(f"{temp}/zarr.json")):
        # Replaced already: the copy's zarr.json goes only once the array's own is in place.
        sync(store.delete_dir(temp))
        return 0, 0
    keys = _chunk_keys(store, temp)
    size = 0
    for key in keys:
        data = _get(store, f"{temp}/{key}")
        size += len(data)
        _put(store, f"{path}/{key}", data)
    _put(store, f"{path}/zarr.json", _get(store, f"{temp}/zarr.json"))
    sync(store.delete(f"{temp}/zarr.json"))
    sync(store.delete_dir(temp))
    return len(keys), size


def _get(store: Any, key: str) -> bytes:
    return sync(store.get(key, prototype=default_buffer_prototype())).to_bytes()


def _put(store: Any, key: str, data: bytes) -> None:
    sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))
