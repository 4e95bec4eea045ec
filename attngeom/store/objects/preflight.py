"""A first look at a store, before the store package and its libraries (zarr, Dask, xarray)
load: is there one, can it be written, what does a run's record say. Every command looks
here first, so that a store that is missing, unreachable or read-only is answered at once;
what this cannot tell (damage, a schema, a run's arrays) is left to :mod:`attngeom.store`."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attngeom.errors import InputError, RunNotFoundError, StoreError, StoreNotFoundError, StoreWriteError
from attngeom.store.objects.files import check_file

__all__ = [
    "RUN_ID_PATTERN", "default_run_id", "local_path", "local_run_ids", "require_run", "require_store", "require_writable", "run_created",
    "run_record",
]

# The store's attributes key (docs/store.md), in the root's and each run's zarr.json.
_ATTR_KEY = "attngeom"

# What a run id may hold (docs/store.md): the name of its folder, an HTML id, a file name.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")


def default_run_id(model: str, dataset: str, length: int) -> str:
    """A readable run id: model, dataset and context length (the last part of a path each)."""

    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text.rstrip("/").split("/")[-1]).strip("-") or "x"

    return f"{slug(model)}__{slug(dataset)}__L{length}"


def local_path(url: str) -> Path | None:
    """The folder of a local store (a path or a ``file://`` URL); None for a remote one."""
    if "://" in url and not url.startswith("file://"):
        return None
    return Path(url.removeprefix("file://")).expanduser().absolute()


def require_store(url: str) -> None:
    """Raise :class:`StoreNotFoundError` unless the store's root metadata is there, and
    :class:`StoreError` when a remote store cannot be reached (credentials, network, bucket)."""
    path = local_path(url)
    if path is not None:
        if not (path / "zarr.json").is_file():
            raise StoreNotFoundError(f"no attngeom store at {url}")
        return
    if _read_remote(url, "zarr.json") is None:
        raise StoreNotFoundError(f"no attngeom store at {url}")


def require_run(url: str, run_id: str) -> None:
    """:func:`require_store`, then :class:`RunNotFoundError` naming the runs there are (as
    the store package says it) unless a local store holds run ``run_id``; a remote store's
    runs are left to the store package, which lists them once."""
    require_store(url)
    runs = local_run_ids(url)
    if runs is None:
        return
    if run_id in runs:
        return
    if not runs:
        raise RunNotFoundError(f"{url} holds no run yet: extract one into it first")
    raise RunNotFoundError(f"no run '{run_id}' in {url} (runs: {', '.join(runs)})")


def local_run_ids(url: str) -> list[str] | None:
    """The ids of a local store's runs (folders under ``runs/`` named as run ids, with their
    ``zarr.json``: a link there counts, for its reader to refuse), sorted; None for a remote
    store."""
    path = local_path(url)
    if path is None:
        return None
    folder = path / "runs"
    return sorted(p.name for p in folder.iterdir() if RUN_ID_PATTERN.match(p.name)
                  and os.path.lexists(p / "zarr.json")) if folder.is_dir() else []


_PROBE = ".attngeom-probe-"


def require_writable(url: str) -> None:
    """Refuse a local store path that cannot be written, before anything is created: one
    whose parent folder does not exist, or where a file made and removed in the store's
    folder (or its parent's, for a new store) fails (permission bits do not tell: root,
    read-only mounts). A remote store is not probed."""
    path = local_path(url)
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise StoreWriteError(f"store path {path} exists and is not a folder")
    # A probe (below) or the root's metadata half written (zarr writes ``zarr.json.<id>.partial``
    # and renames it) is another creator's of the same new store, a moment before its root.
    if (path.is_dir() and any(not _creating(entry.name) for entry in path.iterdir())
            and not (path / "zarr.json").exists()):
        raise StoreWriteError(f"{path} is a non-empty folder that is not a Zarr store")
    probe = path if path.exists() else path.parent
    if probe.exists() and not probe.is_dir():
        raise StoreWriteError(f"cannot create store {path}: {probe} is a file, not a folder")
    if not probe.exists():
        # A mistyped folder would otherwise be made, silently, with the store in it.
        raise StoreWriteError(f"cannot create store {path}: its folder {probe} does not exist (make it first)")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=_PROBE)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise StoreWriteError(f"store path {path} is not writable ({exc.strerror} in {probe})") from exc


def _creating(name: str) -> bool:
    """Whether a file in a store's folder is a creator's before the root exists."""
    return name.startswith(_PROBE) or (name.startswith("zarr.json.") and name.endswith(".partial"))


def run_record(url: str, run_id: str) -> dict[str, Any] | None:
    """The attngeom attributes of run ``run_id`` (its provenance and layout), or None when the
    store holds no such run or its record cannot be read as JSON (then the store package, which
    names damage, decides). :class:`ForeignFileError` for a record no command opens (a link
    leading outside the store, a device)."""
    key = f"runs/{run_id}/zarr.json"
    path = local_path(url)
    if path is not None:
        check_file(path, key, url)
    try:
        raw = (path / key).read_bytes() if path is not None else _read_remote(url, key)
        meta = json.loads(raw) if raw is not None else None
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    record = attrs.get(_ATTR_KEY) if isinstance(attrs, dict) else None
    return record if isinstance(record, dict) else None


def run_created(record: Any) -> bool:
    """Whether a run's record (its attngeom attributes) says that its creation finished:
    ``create_run`` writes it last, with ``initialized``, after the run's arrays. Every reader
    asks here; a run without it is resumed by finishing its creation."""
    return isinstance(record, Mapping) and bool(record.get("initialized"))


def _read_remote(url: str, key: str) -> bytes | None:
    """The object ``key`` under a remote store, None when absent; :class:`StoreError` when the
    store cannot be reached at all."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as exc:  # an unknown protocol, or its package missing
        raise InputError(f"cannot open the store {url}: {exc}") from exc
    try:
        return fs.cat_file(f"{root.rstrip('/')}/{key}")
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - each filesystem raises its own: credentials, network, bucket
        text = str(exc).strip().splitlines()
        raise StoreError(
            f"cannot read the store {url}: {type(exc).__name__}: {text[0] if text else 'no reason given'}"
        ) from exc
