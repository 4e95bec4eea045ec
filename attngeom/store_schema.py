"""The store contract (SPEC §6, schema version 1): layout, creation and validation.

A store is a Zarr v3 group. Each run lives in ``runs/<run_id>`` and holds one array per
captured quantity, with named dimensions (``dimension_names``) so that
``xr.open_zarr(store, group="runs/<run_id>")`` gives a Dataset.

Layout decisions, made for what reads and writes the store:

* Every per-sequence array is sharded with one shard per sequence (all layers) and one
  inner chunk per (sequence, layer). A writer always writes whole shards, so two processes
  extracting different sequences never touch the same object, and a resumed run rewrites
  whole shards. Analyze reads one inner chunk, i.e. one sequence x one layer, at a time.
* ``complete`` (seq) is written last for each sequence: a sequence exists for readers only
  once its flag is 1, so a killed run never exposes half a sequence.
* The run's provenance is written after its arrays; ``initialized`` in it marks a run
  whose creation finished.

Two numbers in the root's attributes say what a store is:

* ``schema_version`` is the contract of SPEC §6 (names, dimensions, dtypes), which readers
  rely on. A store of a later version is refused.
* ``format`` is how this implementation encodes that contract. Format 1 (attngeom 0.1.0's
  first stores, which carry no ``format`` attribute) has no chunk checksums; format 2 ends
  every chunk of every array, derived groups included, with a crc32c checksum. Every format
  of schema 1 is read; only the current format is written, and ``attngeom migrate``
  (:mod:`attngeom.store_migrate`) brings an older store to it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from attngeom import __version__
from attngeom.errors import AttngeomError

SCHEMA_VERSION = 1
FORMAT = 2
ATTR_KEY = "attngeom"
RUNS = "runs"

# zstd with bitshuffle at level 3: benchmarks/extract_throughput.py measured levels 1/3/5/9
# on gemma3-270m and smollm2-135m (L=1024): 3 is 3-7% larger than 9 but compresses 35-65x
# faster (9 would cost 3-6 s a sequence), and 5 gains under 1% over 3.
BLOSC_LEVEL = 3


def compressor(typesize: int) -> BloscCodec:
    """Blosc zstd with bitshuffle, the codec of every array of the store."""
    return BloscCodec(cname="zstd", clevel=BLOSC_LEVEL, shuffle="bitshuffle", typesize=typesize)


def compressors(dtype: np.dtype) -> tuple[BloscCodec, Crc32cCodec]:
    """The bytes-to-bytes codecs of every array written in format 2: Blosc, then a crc32c
    checksum of the compressed chunk."""
    typesize = dtype.itemsize if dtype.kind not in "OUS" else 1
    return compressor(typesize), Crc32cCodec()


def _codec_chain(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The codecs applied to each stored chunk: a shard's inner chunks for a sharded array
    (its index carries its own checksum)."""
    codecs = metadata["codecs"]
    if codecs and codecs[0]["name"] == "sharding_indexed":
        return codecs[0]["configuration"]["codecs"]
    return codecs


def has_checksum(metadata: Mapping[str, Any]) -> bool:
    """Whether the array of this ``zarr.json`` ends every chunk with a crc32c checksum."""
    return any(c["name"] == "crc32c" for c in _codec_chain(metadata))


def with_checksum(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """This ``zarr.json`` with a crc32c checksum appended to each chunk's codecs."""
    out = json.loads(json.dumps(metadata))
    if not has_checksum(out):
        _codec_chain(out).append({"name": "crc32c"})
    return out


@dataclass(frozen=True)
class Variable:
    """One array of a run: its dimensions and admissible dtypes."""

    dims: tuple[str, ...]
    dtypes: tuple[str, ...]
    per_sequence: bool = True
    optional: bool = False
    doc: str = ""


SUMMARY_DIMS = ("seq", "layer", "head", "query")

RUN_VARIABLES: dict[str, Variable] = {
    "tokens": Variable(("seq", "pos"), ("int32",), doc="token ids, BOS at pos 0"),
    "values": Variable(
        ("seq", "layer", "kv_head", "pos", "head_dim"),
        ("float16", "float32"),
        doc="value vectors v_j of every kv head",
    ),
    "attn_last": Variable(
        ("seq", "layer", "head", "key"), ("float32",), doc="final query's attention row alpha_j"
    ),
    "winner": Variable(
        SUMMARY_DIMS, ("int16", "int32"), doc="j* = argmax_j A_ij ||v_j|| (SPEC §4), per query"
    ),
    "sink_attn": Variable(SUMMARY_DIMS, ("float32",), doc="A_i0, per query"),
    "diag_attn": Variable(SUMMARY_DIMS, ("float32",), doc="A_ii, per query"),
    "top1_attn": Variable(SUMMARY_DIMS, ("float32",), doc="max_j A_ij, per query"),
    "entropy": Variable(SUMMARY_DIMS, ("float32",), doc="-sum_j A_ij log A_ij (nats), per query"),
    "attn": Variable(
        ("seq", "layer", "head", "query", "key"),
        ("float16",),
        optional=True,
        doc="full attention rows (--store-rows all)",
    ),
    "doc_index": Variable(("seq",), ("int64",), doc="document of the window, in corpus order"),
    "window_start": Variable(("seq",), ("int64",), doc="token offset of the window in its document"),
    "complete": Variable(("seq",), ("uint8",), doc="1 once every array of the sequence is written"),
    "layer": Variable(("layer",), ("int32",), per_sequence=False),
    "head": Variable(("head",), ("int32",), per_sequence=False),
    "kv_head": Variable(("kv_head",), ("int32",), per_sequence=False),
    "pos": Variable(("pos",), ("int32",), per_sequence=False),
    "head_kv": Variable(("head",), ("int32",), per_sequence=False, doc="kv head read by each head"),
    "window": Variable(
        ("layer",), ("int32",), per_sequence=False, doc="sliding window of the layer, 0 = full causal"
    ),
    "attendable": Variable(
        ("layer", "key"), ("bool",), per_sequence=False, doc="keys the final query may attend"
    ),
}

COORDS = ("layer", "head", "kv_head", "pos", "head_kv", "window")
# Arrays carrying one shard per sequence; `complete` is the commit flag written after them.
SEQUENCE_ARRAYS = tuple(
    n for n, v in RUN_VARIABLES.items() if v.per_sequence and n != "complete"
)


@dataclass(frozen=True)
class RunLayout:
    """Shape of one run: the model's attention geometry and the context length."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    length: int
    head_kv: tuple[int, ...]
    window: tuple[int, ...]
    attendable: tuple[tuple[bool, ...], ...] = field(repr=False)
    values_dtype: str = "float32"
    store_rows: str = "last"

    @property
    def winner_dtype(self) -> str:
        return "int16" if self.length <= np.iinfo(np.int16).max else "int32"

    def shape(self, name: str, n_seq: int) -> tuple[int, ...]:
        sizes = {
            "seq": n_seq,
            "layer": self.n_layers,
            "head": self.n_heads,
            "kv_head": self.n_kv_heads,
            "pos": self.length,
            "key": self.length,
            "query": self.length,
            "head_dim": self.head_dim,
        }
        return tuple(sizes[d] for d in RUN_VARIABLES[name].dims)

    def dtype(self, name: str) -> str:
        if name == "values":
            return self.values_dtype
        if name == "winner":
            return self.winner_dtype
        return RUN_VARIABLES[name].dtypes[0]

    def names(self) -> list[str]:
        return [
            n
            for n, v in RUN_VARIABLES.items()
            if not v.optional or (n == "attn" and self.store_rows == "all")
        ]


def store_from_url(url: str, *, read_only: bool) -> Any:
    """A zarr store for a local path or any fsspec URL (``s3://``, ``memory://``, ``file://``)."""
    url = url.removeprefix("file://")
    if "://" in url:
        return zarr.storage.FsspecStore.from_url(url, read_only=read_only)
    return zarr.storage.LocalStore(url, read_only=read_only)


def store_format(meta: Mapping[str, Any]) -> int:
    """The format of a store from its root attributes (1 when absent: the first stores)."""
    return int(meta.get("format", 1))


def read_root_attrs(root: zarr.Group, url: str, *, writing: bool, migrating_ok: bool = False) -> dict[str, Any]:
    """The root's attngeom attributes, refusing a store this attngeom must not read (another
    schema, a migration under way) or, when ``writing``, must not write (another format)."""
    meta = root.attrs.get(ATTR_KEY)
    if not isinstance(meta, Mapping) or "schema_version" not in meta:
        raise AttngeomError("not an attngeom store (no attngeom schema version in its root attributes)")
    version = meta["schema_version"]
    if version > SCHEMA_VERSION:
        raise AttngeomError(
            f"store has schema version {version}, newer than this attngeom ({__version__}, "
            f"schema {SCHEMA_VERSION}); upgrade attngeom"
        )
    if version < SCHEMA_VERSION:
        raise AttngeomError(f"store has schema version {version}; this attngeom reads {SCHEMA_VERSION}")
    if "migrating" in meta and not migrating_ok:
        raise AttngeomError(
            f"{url} is being migrated, or its migration was interrupted; finish it with "
            f"`attngeom migrate --store {url}`"
        )
    fmt = store_format(meta)
    if writing and fmt > FORMAT:
        raise AttngeomError(f"store format {fmt} is newer than this attngeom writes ({FORMAT}); upgrade attngeom")
    if writing and fmt < FORMAT:
        raise AttngeomError(
            f"store format {fmt} predates chunk checksums (this attngeom writes format {FORMAT}); "
            f"bring it up to date first with `attngeom migrate --store {url}`"
        )
    return dict(meta)


def open_root(url: str, *, mode: str = "r") -> zarr.Group:
    """Open an existing attngeom store; ``mode`` is "r" or "a" (which also refuses a store
    of another format). Raises if it is not one."""
    try:
        root = zarr.open_group(store_from_url(url, read_only=mode == "r"), mode="r" if mode == "r" else "r+", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise AttngeomError(f"no attngeom store at {url}") from exc
    read_root_attrs(root, url, writing=mode != "r")
    return root


def open_or_create_root(url: str) -> zarr.Group:
    """Open the store at ``url`` for writing, creating it (schema version 1) if absent.

    The root's metadata and attributes are one object, written at once; an empty group
    without them (a store created by hand, or by older code killed mid-way) is adopted.
    """
    store = store_from_url(url, read_only=False)
    meta = {ATTR_KEY: {"schema_version": SCHEMA_VERSION, "format": FORMAT, "created_by": __version__}}
    try:
        root = zarr.open_group(store, mode="r+", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        try:
            root = zarr.create_group(store, zarr_format=3, attributes=meta)
        except zarr.errors.ContainsGroupError:  # a concurrent writer created it
            root = zarr.open_group(store, mode="r+", use_consolidated=False)
    if ATTR_KEY not in root.attrs and not list(root.keys()):
        root.attrs.update(meta)
    read_root_attrs(root, url, writing=True)
    return root


def check_writable(url: str) -> None:
    """Refuse a local store path that cannot be written, before anything is created.

    Probes by creating and removing a temporary file in the store folder, or in its nearest
    existing parent: permission bits do not tell (root, read-only mounts).
    """
    if "://" in url and not url.startswith("file://"):
        return
    path = Path(url.removeprefix("file://")).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise AttngeomError(f"store path {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not (path / "zarr.json").exists():
        raise AttngeomError(f"{path} is a non-empty folder that is not a Zarr store")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise AttngeomError(f"cannot create store {path}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".attngeom-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise AttngeomError(f"store path {path} is not writable ({exc.strerror} in {probe})") from exc


def write_dataset(dataset: xr.Dataset, url: str, group: str, *, compute: bool = True) -> None:
    """Write a derived Dataset to ``group``, replacing it, in the store's format (checksums).

    With ``compute=False`` only the metadata is written, for later region writes.
    """
    encoding = {name: {"compressors": compressors(var.dtype)} for name, var in dataset.variables.items()}
    target = store_from_url(url, read_only=False)
    dataset.to_zarr(target, group=group, mode="w", consolidated=False, zarr_format=3, encoding=encoding, compute=compute)


def open_dataset(url: str, group: str) -> xr.Dataset:
    """The group ``group`` of the store at ``url`` as a lazy Dataset, read from its own
    metadata (never the consolidated copy, which lags behind writers)."""
    return xr.open_zarr(store_from_url(url, read_only=True), group=group, consolidated=False)


def run_ids(root: zarr.Group) -> list[str]:
    if RUNS not in root:
        return []
    return sorted(name for name, _ in root[RUNS].groups())


def open_run_group(root: zarr.Group, run_id: str) -> zarr.Group:
    """The group of a run, read from its own metadata: the consolidated copy a finished
    extract leaves for readers goes stale as soon as a later extract appends."""
    return zarr.open_group(
        root.store, path=f"{RUNS}/{run_id}", mode="r" if root.read_only else "r+", use_consolidated=False
    )


def run_provenance(root: zarr.Group, run_id: str) -> dict[str, Any]:
    return dict(open_run_group(root, run_id).attrs.get(ATTR_KEY, {}))


def _create_array(group: zarr.Group, name: str, layout: RunLayout, n_seq: int, *, overwrite: bool) -> zarr.Array:
    var = RUN_VARIABLES[name]
    shape = layout.shape(name, n_seq)
    dtype = np.dtype(layout.dtype(name))
    attrs: dict[str, Any] = {"description": var.doc} if var.doc else {}
    if "head" in var.dims and name not in ("head", "head_kv"):
        attrs["coordinates"] = "head_kv"
    if var.per_sequence and len(shape) > 1:
        shards = (1, *shape[1:])
        chunks = (1, 1, *shape[2:]) if var.dims[1] == "layer" else shards
        kwargs: dict[str, Any] = {"chunks": chunks, "shards": shards if chunks != shards else None}
    elif var.per_sequence:
        kwargs = {"chunks": (1,)}
    else:
        kwargs = {"chunks": shape}
    fill = -1 if name == "winner" else 0
    return group.create_array(
        name,
        shape=shape,
        dtype=dtype,
        compressors=compressors(dtype),
        dimension_names=var.dims,
        fill_value=fill,
        attributes=attrs,
        overwrite=overwrite,
        **kwargs,
    )


def create_run(
    root: zarr.Group, run_id: str, layout: RunLayout, provenance: Mapping[str, Any], n_seq: int
) -> zarr.Group:
    """Create, or finish creating, ``runs/<run_id>`` with arrays sized for ``n_seq`` sequences.

    Several writers may create the same run at once (``extract --shard``): an array that
    already has this layout's shape and dtype is kept, never overwritten, so a peer's
    committed sequences survive; one left with another layout by an interrupted creation is
    replaced. Provenance is written last, with ``initialized: true``.
    """
    run = root.require_group(f"{RUNS}/{run_id}")
    existing = dict(run.arrays())
    for name in layout.names():
        arr = existing.get(name)
        shape = layout.shape(name, n_seq)
        per_sequence = RUN_VARIABLES[name].per_sequence
        if arr is not None and str(arr.dtype) == layout.dtype(name) and (
            arr.shape[1:] == shape[1:] if per_sequence else arr.shape == shape
        ):
            continue
        try:
            _create_array(run, name, layout, n_seq, overwrite=arr is not None)
        except zarr.errors.ContainsArrayError:
            pass  # a concurrent writer created it a moment ago
    resize_run(run, n_seq)
    run["layer"][:] = np.arange(layout.n_layers, dtype="int32")
    run["head"][:] = np.arange(layout.n_heads, dtype="int32")
    run["kv_head"][:] = np.arange(layout.n_kv_heads, dtype="int32")
    run["pos"][:] = np.arange(layout.length, dtype="int32")
    run["head_kv"][:] = np.asarray(layout.head_kv, dtype="int32")
    run["window"][:] = np.asarray(layout.window, dtype="int32")
    run["attendable"][:] = np.asarray(layout.attendable, dtype=bool)
    meta = dict(provenance)
    meta["layout"] = {k: v for k, v in asdict(layout).items() if k != "attendable"}
    meta["initialized"] = True
    run.attrs[ATTR_KEY] = _jsonable(meta)
    return run


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def run_layout(run: zarr.Group) -> RunLayout:
    meta = run.attrs[ATTR_KEY]["layout"]
    attendable = tuple(tuple(bool(x) for x in row) for row in run["attendable"][:])
    return RunLayout(
        **{**meta, "head_kv": tuple(meta["head_kv"]), "window": tuple(meta["window"])},
        attendable=attendable,
    )


def n_sequences(run: zarr.Group) -> int:
    return int(run["complete"].shape[0])


def resize_run(run: zarr.Group, n_seq: int) -> None:
    """Grow every per-sequence array to ``n_seq`` sequences (idempotent, never shrinks)."""
    for name, var in RUN_VARIABLES.items():
        if var.per_sequence and name in run and run[name].shape[0] < n_seq:
            arr = run[name]
            arr.resize((n_seq, *arr.shape[1:]))


def completed(run: zarr.Group) -> np.ndarray:
    """Indices of the sequences whose every array is written."""
    return np.flatnonzero(run["complete"][:] == 1)


def write_sequence(run: zarr.Group, seq: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Write one sequence's shards, then its ``complete`` flag (the commit)."""
    # Store every chunk, also one equal to the fill value (a window at offset 0): validate
    # tells a written sequence from an unwritten one by its chunk objects. Encoding a shard's
    # inner chunks (one per layer) as one batch ran 0.9-1.5x as fast (median 1.3x) as one at
    # a time, on smollm2-135m and gemma3-270m shapes.
    config = {"array.write_empty_chunks": True, "codec_pipeline.batch_size": max(1, run["layer"].shape[0])}
    with zarr.config.set(config):
        for name in SEQUENCE_ARRAYS:
            if name in run:
                run[name][seq] = arrays[name]
        run["complete"][seq] = 1


def _written_sequences(run: zarr.Group, name: str) -> set[int]:
    arr = run[name]
    prefix = f"{arr.path}/c/"

    async def collect() -> set[int]:
        found: set[int] = set()
        async for key in arr.store.list_prefix(prefix):
            head = key[len(prefix) :].split("/", 1)[0]
            if head.isdigit():
                found.add(int(head))
        return found

    return sync(collect())


def _ranges(indices: Iterable[int]) -> str:
    idx = sorted(indices)
    parts, start = [], None
    for a, b in zip(idx, idx[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ", ".join(parts)


def validate_run(run: zarr.Group, run_id: str) -> list[str]:
    """Problems of one run, one line each (empty when valid)."""
    where = f"run {run_id}"
    meta = run.attrs.get(ATTR_KEY)
    if not isinstance(meta, Mapping) or not meta.get("initialized"):
        return [f"{where}: creation was interrupted (no provenance); re-run extract"]
    problems = []
    for key in ("model", "dataset", "context_length", "library_versions", "command_line"):
        if key not in meta:
            problems.append(f"{where}: provenance lacks '{key}'")
    try:
        layout = run_layout(run)
    except (KeyError, TypeError) as exc:
        return problems + [f"{where}: unreadable layout in provenance ({exc})"]
    members = dict(run.arrays())
    n_seq = int(members["complete"].shape[0]) if "complete" in members else None
    for name in layout.names():
        var = RUN_VARIABLES[name]
        if name not in members:
            problems.append(f"{where}: missing array '{name}'")
            continue
        arr = members[name]
        dims = tuple(arr.metadata.dimension_names or ())
        if dims != var.dims:
            problems.append(f"{where}: array '{name}' has dims {dims}, expected {var.dims}")
        if str(arr.dtype) not in var.dtypes:
            problems.append(f"{where}: array '{name}' has dtype {arr.dtype}, expected {' or '.join(var.dtypes)}")
        expected = layout.shape(name, n_seq if n_seq is not None else arr.shape[0])
        if tuple(arr.shape) != expected:
            problems.append(f"{where}: array '{name}' has shape {tuple(arr.shape)}, expected {expected}")
    if problems or n_seq is None:
        return problems
    done = set(completed(run).tolist())
    written: dict[int, set[str]] = {}
    for name in layout.names():
        if RUN_VARIABLES[name].per_sequence and name != "complete":
            for s in _written_sequences(run, name):
                written.setdefault(s, set()).add(name)
    expected_arrays = {n for n in layout.names() if RUN_VARIABLES[n].per_sequence and n != "complete"}
    for s in sorted(done):
        missing = expected_arrays - written.get(s, set())
        if missing:
            problems.append(f"{where}: sequence {s} is marked complete but lacks {', '.join(sorted(missing))}")
    partly = sorted(s for s in written if s not in done and s < n_seq)
    for s in partly:
        problems.append(f"{where}: sequence {s} is only partly written (interrupted run; re-run the same extract command)")
    unwritten = [s for s in range(n_seq) if s not in done and s not in written]
    if unwritten:
        problems.append(f"{where}: sequences {_ranges(unwritten)} of {n_seq} are not written yet (re-run the same extract command)")
    return problems


def corrupt_chunks(arr: zarr.Array) -> list[str]:
    """Read every stored chunk (every shard) of ``arr``; one line per chunk that fails to
    decode, its checksum included."""
    grid = arr.shards or arr.chunks
    counts = [max(1, -(-n // c)) for n, c in zip(arr.shape, grid)]
    problems = []
    for index in np.ndindex(*counts):
        region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, grid, arr.shape))
        try:
            arr[region]
        except Exception as exc:  # a corrupt chunk surfaces as any codec's error
            key = "/".join(str(i) for i in index)
            problems.append(f"array '{arr.path}' chunk c/{key} is corrupt ({type(exc).__name__}: {exc})")
    return problems


def array_metadata(arr: zarr.Array) -> dict[str, Any]:
    """The array's ``zarr.json``, as stored."""
    raw = sync(arr.store.get(f"{arr.path}/zarr.json", prototype=default_buffer_prototype()))
    return json.loads(raw.to_bytes())


def arrays_of(root: zarr.Group) -> list[zarr.Array]:
    """Every array of the store, run and derived, in path order."""
    members = root.members(max_depth=None, use_consolidated_for_children=False)
    return sorted((node for _, node in members if isinstance(node, zarr.Array)), key=lambda a: a.path)


def validate_store(url: str, *, deep: bool = False) -> list[str]:
    """Every problem of the store at ``url``, one line each; empty when valid.

    ``deep`` also reads every chunk of every array, so that a corrupt chunk (its crc32c
    checksum, or its compression) is named by array and chunk key.
    """
    try:
        root = zarr.open_group(store_from_url(url, read_only=True), mode="r", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        return [f"no Zarr store at {url}"]
    try:
        meta = read_root_attrs(root, url, writing=False)
    except AttngeomError as exc:
        return [str(exc)]
    problems: list[str] = []
    if store_format(meta) < FORMAT:
        problems.append(
            f"store format {store_format(meta)} has no chunk checksums (corruption can go unseen); "
            f"run `attngeom migrate --store {url}`"
        )
    for run_id in run_ids(root):
        problems += validate_run(open_run_group(root, run_id), run_id)
    if deep:
        for arr in arrays_of(root):
            if not has_checksum(array_metadata(arr)):
                problems.append(f"array '{arr.path}' has no chunk checksums")
            problems += corrupt_chunks(arr)
    return problems


def consolidate(root: zarr.Group) -> None:
    """Refresh the root's consolidated metadata, so that ``xr.open_zarr(store, group=...)``
    opens quickly and quietly. attngeom itself never reads it (it goes stale while a later
    stage writes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        zarr.consolidate_metadata(root.store)


RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")


def default_run_id(model: str, dataset: str, length: int) -> str:
    """A readable run id: model, dataset and context length."""

    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text.rstrip("/").split("/")[-1]).strip("-") or "x"

    return f"{slug(model)}__{slug(dataset)}__L{length}"
