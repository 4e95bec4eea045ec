"""Opening and writing a store: URLs, the root's attributes, Datasets of groups.

Names, here and in every stage: ``url`` is where a store is (a local path or an fsspec URL,
the CLI's ``--store``); a ``zarr_store`` is the zarr-python Store object opened on it.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xarray as xr
import zarr

from attngeom import __version__
from attngeom.errors import SchemaError, StoreNotFoundError, StoreWriteError
from attngeom.store.codecs import compressors
from attngeom.store.schema import ATTR_KEY, FORMAT, SCHEMA_VERSION


def zarr_store(url: str, *, read_only: bool) -> Any:
    """A zarr Store for a local path or any fsspec URL (``s3://``, ``memory://``, ``file://``)."""
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
        raise SchemaError("not an attngeom store (no attngeom schema version in its root attributes)")
    version = meta["schema_version"]
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"store has schema version {version}, newer than this attngeom ({__version__}, "
            f"schema {SCHEMA_VERSION}); upgrade attngeom"
        )
    if version < SCHEMA_VERSION:
        raise SchemaError(f"store has schema version {version}; this attngeom reads {SCHEMA_VERSION}")
    if "migrating" in meta and not migrating_ok:
        raise SchemaError(
            f"{url} is being migrated, or its migration was interrupted; finish it with "
            f"`attngeom migrate --store {url}`"
        )
    fmt = store_format(meta)
    if writing and fmt > FORMAT:
        raise SchemaError(f"store format {fmt} is newer than this attngeom writes ({FORMAT}); upgrade attngeom")
    if writing and fmt < FORMAT:
        raise SchemaError(
            f"store format {fmt} predates chunk checksums (this attngeom writes format {FORMAT}); "
            f"bring it up to date first with `attngeom migrate --store {url}`"
        )
    return dict(meta)


def open_root(url: str, *, mode: str = "r") -> zarr.Group:
    """Open an existing attngeom store; ``mode`` is "r" or "a" (which also refuses a store
    of another format). Raises :class:`StoreNotFoundError` if there is none."""
    try:
        root = zarr.open_group(
            zarr_store(url, read_only=mode == "r"), mode="r" if mode == "r" else "r+", use_consolidated=False
        )
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise StoreNotFoundError(f"no attngeom store at {url}") from exc
    read_root_attrs(root, url, writing=mode != "r")
    return root


def open_or_create_root(url: str) -> zarr.Group:
    """Open the store at ``url`` for writing, creating it (schema version 1) if absent.

    The root's metadata and attributes are one object, written at once; an empty group
    without them (a store created by hand, or by older code killed mid-way) is adopted.
    """
    zstore = zarr_store(url, read_only=False)
    meta = {ATTR_KEY: {"schema_version": SCHEMA_VERSION, "format": FORMAT, "created_by": __version__}}
    try:
        root = zarr.open_group(zstore, mode="r+", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        try:
            root = zarr.create_group(zstore, zarr_format=3, attributes=meta)
        except zarr.errors.ContainsGroupError:  # a concurrent writer created it
            root = zarr.open_group(zstore, mode="r+", use_consolidated=False)
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
        raise StoreWriteError(f"store path {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not (path / "zarr.json").exists():
        raise StoreWriteError(f"{path} is a non-empty folder that is not a Zarr store")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise StoreWriteError(f"cannot create store {path}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".attngeom-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise StoreWriteError(f"store path {path} is not writable ({exc.strerror} in {probe})") from exc


def open_dataset(url: str, group: str) -> xr.Dataset:
    """The group ``group`` of the store at ``url`` as a lazy Dataset, read from its own
    metadata (never the consolidated copy, which lags behind writers). The one way attngeom
    opens a group as a Dataset."""
    return xr.open_zarr(zarr_store(url, read_only=True), group=group, consolidated=False)


def write_dataset(dataset: xr.Dataset, url: str, group: str, *, compute: bool = True) -> None:
    """Write a derived Dataset to ``group``, replacing it, in the store's format (checksums).

    With ``compute=False`` only the metadata is written, for later region writes.
    """
    encoding = {name: {"compressors": compressors(var.dtype)} for name, var in dataset.variables.items()}
    target = zarr_store(url, read_only=False)
    dataset.to_zarr(target, group=group, mode="w", consolidated=False, zarr_format=3, encoding=encoding, compute=compute)


def consolidate(root: zarr.Group) -> None:
    """Refresh the root's consolidated metadata, so that ``xr.open_zarr(url, group=...)``
    opens quickly and quietly. attngeom itself never reads it (it goes stale while a later
    stage writes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        zarr.consolidate_metadata(root.store)


def jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON attributes (tuples as lists, other objects as str)."""
    return json.loads(json.dumps(obj, default=str))
