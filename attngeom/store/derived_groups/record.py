"""The commit record of a derived group (``runs/<id>/<kind>``: analysis, ablation, detect)
and the check of its committed objects against it (docs/store.md#commit-protocol), with zarr
alone: a command finding its groups up to date reads and checks them without loading xarray
or Dask (:mod:`attngeom.store.derived_groups.derived` writes the record and the groups,
:mod:`attngeom.store.derived_groups.derived_read` reads the groups through it)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zarr
from zarr.buffer import default_buffer_prototype

from attngeom.version import __version__
from attngeom.store.objects._zarr import sync
from attngeom.store.objects.damage import DECODE_ERRORS
from attngeom.store.objects.storage import PARTIAL_SUFFIX, metadata_fault, node_metadata, parse_metadata
from attngeom.store.objects.stored_objects import chunk_key, chunk_objects, object_damage, object_sizes
from attngeom.store.objects.schema import ATTR_KEY, run_path

__all__ = [
    "LOST", "STAGING", "Commit", "Damage", "DerivedState", "Pending", "damage_found", "derived_damage",
    "generation_name", "groups_path", "is_generation", "kind_path", "read_state", "staged_path", "stored_sizes",
]

# The staging group inside a derived group: results replacing committed ones are written
# here first, then moved into place.
STAGING = "_next"

# A generation: the folder inside a derived group holding one object-store writer's groups,
# named for that writer alone (docs/store.md#commit-protocol).
_GENERATION = re.compile(r"gen-[0-9a-f]{16}")


def is_generation(name: str) -> bool:
    """Whether ``name`` (a folder inside a derived group) is a generation's."""
    return _GENERATION.fullmatch(name) is not None


def generation_name(token: str) -> str:
    """The generation folder of the writer ``token`` (16 hex digits): ``gen-<token>``."""
    name = f"gen-{token}"
    if not _GENERATION.fullmatch(name):
        raise ValueError(f"no generation name: {name!r}")
    return name


@dataclass(frozen=True)
class Commit:
    """Finished results: ``sequences`` (run sequence ids, in ``seq`` order) covered by the
    ``sequence_groups`` (which grow along ``seq``), computed with ``parameters``; ``objects``:
    key (below the groups' folder) -> size in bytes of every stored object of the groups
    (empty in records written before attngeom kept it; anything rewriting the objects in
    place, a future migration say, must list them again); ``generation``: the folder below
    ``runs/<id>/<kind>/`` holding the groups, written by one object-store writer alone
    ("" where the groups are in ``runs/<id>/<kind>/`` itself, as a local writer keeps them)."""

    parameters: dict[str, Any]
    groups: tuple[str, ...]
    sequences: tuple[int, ...] = ()
    sequence_groups: tuple[str, ...] = ()
    attngeom_version: str = __version__
    objects: dict[str, int] = field(default_factory=dict)
    generation: str = ""


@dataclass(frozen=True)
class Pending:
    """An update under way (or interrupted): ``sequences`` written so far with
    ``parameters``, into staging when ``staged``; ``promoting`` groups are being moved into
    place; ``generation``: the folder an object-store writer writes them into ("" for a
    local writer)."""

    parameters: dict[str, Any]
    sequences: tuple[int, ...] = ()
    staged: bool = False
    promoting: tuple[str, ...] = ()
    generation: str = ""


@dataclass(frozen=True)
class DerivedState:
    """The record of ``runs/<run_id>/<kind>``; ``exists`` False when there is no such group
    (``leftover`` when an empty folder is left where it would be), ``legacy`` when the group
    predates records, ``unreadable`` when its ``zarr.json`` (the record) does not parse, is
    malformed or is lost while the group holds objects (``fault`` says which, in words)."""

    run_id: str
    kind: str
    exists: bool = False
    legacy: bool = False
    commit: Commit | None = None
    pending: Pending | None = None
    unreadable: bool = False
    fault: str = ""
    leftover: bool = False

    @property
    def groups_path(self) -> str:
        """Where the committed groups are: ``runs/<id>/<kind>[/<generation>]``."""
        return groups_path(self.run_id, self.kind, self.commit.generation if self.commit is not None else "")

    @property
    def readable(self) -> bool:
        """Whether readers may use the groups: finished, and nothing being moved into place."""
        if self.legacy:
            return True
        return self.commit is not None and not (self.pending is not None and self.pending.promoting)


@dataclass(frozen=True)
class Damage:
    """A committed group found damaged: ``objects`` its damaged objects (keys below
    ``runs/<id>/<kind>/``) and what is wrong with each; ``seq_from`` the first ``seq``
    position of a damaged chunk of a group growing along ``seq``, None when the whole group
    must be written again (its metadata, or a group across sequences)."""

    group: str
    objects: tuple[tuple[str, str], ...]
    seq_from: int | None

    def __str__(self) -> str:
        key, what = self.objects[0]
        more = f" (and {len(self.objects) - 1} more objects)" if len(self.objects) > 1 else ""
        return f"{key} is {what}{more}"


def kind_path(run_id: str, kind: str) -> str:
    """``runs/<id>/<kind>``."""
    return f"{run_path(run_id)}/{kind}"


def groups_path(run_id: str, kind: str, generation: str) -> str:
    """The folder of the groups of ``generation``: ``runs/<id>/<kind>/<generation>``, or
    ``runs/<id>/<kind>`` for ""."""
    return f"{kind_path(run_id, kind)}/{generation}" if generation else kind_path(run_id, kind)


def staged_path(run_id: str, kind: str, name: str) -> str:
    """Where ``name`` is written while staged: ``runs/<id>/<kind>/_next/<name>``."""
    return f"{kind_path(run_id, kind)}/{STAGING}/{name}"


def read_state(zstore: Any, run_id: str, kind: str, *, raw: bytes | None | bool = True) -> DerivedState:
    """The record of ``runs/<run_id>/<kind>`` in ``zstore`` (one read of the group's metadata;
    where there is none, one listing of what the group's folder holds); or, given ``raw``,
    of those bytes of its ``zarr.json`` (None: absent) as a fenced writer read them."""
    base = kind_path(run_id, kind)
    if raw is True:
        got = sync(zstore.get(f"{base}/zarr.json", prototype=default_buffer_prototype()))
        raw = None if got is None else got.to_bytes()
    if raw is None:
        held = _contents(zstore, base)
        if held == "objects":
            return DerivedState(run_id, kind, exists=True, unreadable=True, fault=LOST)
        return DerivedState(run_id, kind, leftover=held == "empty")
    meta = parse_metadata(raw)
    if meta is None or meta["node_type"] != "group":
        fault = metadata_fault(raw) if meta is None else "malformed (an array's metadata, not a group's)"
        return DerivedState(run_id, kind, exists=True, unreadable=True, fault=fault)
    if ATTR_KEY not in meta.get("attributes", {}):
        return DerivedState(run_id, kind, exists=True, legacy=True)
    record = meta["attributes"][ATTR_KEY]
    fault = _record_fault(record)
    if fault is not None:
        return DerivedState(run_id, kind, exists=True, unreadable=True, fault=f"malformed ({fault})")
    done, pending = record.get("commit"), record.get("pending")
    return DerivedState(
        run_id, kind, exists=True,
        commit=Commit(
            parameters=dict(done["parameters"]), groups=tuple(done["groups"]),
            sequences=tuple(done.get("sequences", ())), sequence_groups=tuple(done.get("sequence_groups", ())),
            attngeom_version=str(done.get("attngeom_version", "")),
            objects={str(k): int(v) for k, v in done.get("objects", {}).items()},
            generation=done.get("generation", ""),
        ) if done is not None else None,
        pending=Pending(
            parameters=dict(pending["parameters"]), sequences=tuple(pending.get("sequences", ())),
            staged=bool(pending.get("staged")), promoting=tuple(pending.get("promoting", ())),
            generation=pending.get("generation", ""),
        ) if pending is not None else None,
    )


# How a lost record reads in the lines naming it.
LOST = "missing (lost metadata of a group: nothing it holds can be reached)"


def _record_fault(record: Any) -> str | None:
    """What makes a commit record unusable, in words; None when it has the shape a writer
    writes (:class:`Commit`, :class:`Pending`)."""

    def ints(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)

    def names(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(n, str) for n in x)

    if not isinstance(record, Mapping):
        return f"the record is a {type(record).__name__}, not an object"
    done, pending = record.get("commit"), record.get("pending")
    if done is not None:
        if not isinstance(done, Mapping):
            return f"its commit is a {type(done).__name__}, not an object"
        if not isinstance(done.get("parameters"), Mapping):
            return "its commit's parameters are not an object"
        named = next((key for key, value in done["parameters"].items() if key.endswith("_sequences")
                      and isinstance(value, list) and not ints(value)), None)
        if named is not None:
            return f"its commit's parameter '{named}' is not a list of sequence ids"
        if not names(done.get("groups")):
            return "its commit's groups are not a list of names"
        if not ints(done.get("sequences", [])):
            return "its commit's sequences are not a list of sequence ids"
        along = done.get("sequence_groups", [])
        if not names(along) or not set(along) <= set(done["groups"]):
            return "its commit's sequence_groups are not among its groups"
        objects = done.get("objects", {})
        if not isinstance(objects, Mapping) or not all(isinstance(v, int) and v >= 0 for v in objects.values()):
            return "its commit's objects are not a list of sizes by key"
        if not _generation_ok(done.get("generation", "")):
            return "its commit's generation is no generation folder's name"
    if pending is not None:
        if not isinstance(pending, Mapping):
            return f"its pending update is a {type(pending).__name__}, not an object"
        if not isinstance(pending.get("parameters"), Mapping):
            return "its pending update's parameters are not an object"
        if not ints(pending.get("sequences", [])) or not names(pending.get("promoting", [])):
            return "its pending update's sequences or promoted groups are malformed"
        if not _generation_ok(pending.get("generation", "")):
            return "its pending update's generation is no generation folder's name"
    return None


def _generation_ok(name: Any) -> bool:
    return name == "" or (isinstance(name, str) and is_generation(name))


def _contents(zstore: Any, base: str) -> str:
    """What the folder ``base`` holds without its ``zarr.json``: "objects", "empty" (a local
    folder holding no file: a writer stopped by a full disk before its first object), or
    "none"."""
    if isinstance(zstore, zarr.storage.LocalStore):
        folder = os.path.join(str(zstore.root), base)
        if not os.path.isdir(folder):
            return "none"
        return "objects" if any(names for _, _, names in os.walk(folder)) else "empty"

    async def first() -> bool:
        async for _ in zstore.list_prefix(f"{base}/"):
            return True
        return False

    return "objects" if sync(first()) else "none"


def stored_sizes(zstore: Any, base: str, group: str | None = None) -> dict[str, int]:
    """Key (below ``base``) -> size of every stored object of the groups under ``base`` (or
    of ``group`` alone): not the record, not staging, not the leftovers of killed writes."""
    prefix = f"{base}/{group}/" if group else f"{base}/"
    return {
        key[len(base) + 1 :]: size for key, size in object_sizes(zstore, prefix).items()
        if key != f"{base}/zarr.json" and not key.startswith(f"{base}/{STAGING}/") and not key.endswith(PARTIAL_SUFFIX)
    }


def _seq_position(zstore: Any, base: str, key: str) -> int | None:
    """The first ``seq`` position of the chunk ``key`` (``<group>/<array>/c.<i>...``, or
    ``c/<i>/...`` in groups written earlier) of an array along ``seq``; None for any other object."""
    parts = key.split("/", 2)
    chunk = re.split(r"[./]", parts[2]) if len(parts) == 3 else []
    if chunk[:1] != ["c"] or len(chunk) < 2 or not chunk[1].isdigit():
        return None
    try:
        arr = zarr.open_array(zstore, path=f"{base}/{parts[0]}/{parts[1]}", mode="r")
    except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError, *DECODE_ERRORS):
        return None
    if tuple(arr.metadata.dimension_names or ())[:1] != ("seq",):
        return None
    return int(chunk[1]) * arr.chunks[0]


def damage_found(zstore: Any, state: DerivedState, names: Sequence[str], *, deep: bool) -> dict[str, Damage]:
    """The committed groups ``names`` found damaged, by name: an object the commit lists that
    is missing or of another size (one listing); with ``deep``, also one failing to decode."""
    done = state.commit
    if done is None or not done.objects:
        return {}
    base = state.groups_path
    stored = stored_sizes(zstore, base) if len(names) > 1 else stored_sizes(zstore, base, names[0])
    found: dict[str, list[tuple[str, str]]] = {}
    for key, size in sorted(done.objects.items()):
        group = key.split("/", 1)[0]
        if group in names and stored.get(key) != size:
            got = stored.get(key)
            what = ("missing" if got is None else "empty (0 bytes)" if got == 0
                    else f"truncated ({got} of {size} bytes)" if got < size
                    else f"{got} bytes long where {size} were written")
            found.setdefault(group, []).append((key, what))
    if deep:
        # Every stored object of the groups, not only those the commit lists: a commit kept
        # by an update appending in place lists none of its sequence groups' objects.
        for group in names:
            problems = [] if group in found else _decode_damage(zstore, base, group, stored)
            if problems:
                found[group] = problems
    out = {}
    for group, problems in found.items():
        positions = [_seq_position(zstore, base, key) if group in done.sequence_groups else None for key, _ in problems]
        start = None if None in positions else min(p for p in positions if p is not None)
        out[group] = Damage(group, tuple(problems), start)
    return out


def _decode_damage(zstore: Any, base: str, group: str, objects: Mapping[str, int]) -> list[tuple[str, str]]:
    """(key, what) of every object of the committed ``group`` that fails to decode, of its
    arrays among ``objects`` (key below ``base`` -> size)."""
    arrays = sorted({key.rsplit("/", 1)[0] for key in objects if key.startswith(f"{group}/") and key.count("/") == 2
                     and key.endswith("/zarr.json")})
    problems = []
    for path in arrays:
        try:
            arr = zarr.open_array(zstore, path=f"{base}/{path}", mode="r")
        except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError, *DECODE_ERRORS) as exc:
            problems.append((f"{path}/zarr.json", f"unreadable ({type(exc).__name__})"))
            continue
        for index, size in sorted(chunk_objects(arr).items()):
            why = object_damage(arr, index, size)
            if why is not None:
                problems.append((chunk_key(arr, index)[len(base) + 1:], f"damaged ({type(why).__name__}: {why})"))
    return problems


def derived_damage(zstore: Any, state: DerivedState, *, deep: bool) -> dict[str, Damage]:
    """The committed groups of ``state`` found damaged, by name (:func:`damage_found` of them
    all), and those holding a ``zarr.json`` of its size that does not parse (overwritten in
    place): such a group cannot be read, nor, on a rerun that found nothing else, rewritten."""
    names = state.commit.groups if state.commit is not None else ()
    damage = damage_found(zstore, state, names, deep=deep) if names else {}
    base = state.groups_path
    for key, meta in node_metadata(zstore, base).items():
        relative = key[len(base) + 1 :]
        group = relative.split("/", 1)[0]
        if meta is None and group in names and group not in damage:
            damage[group] = Damage(group, ((relative, "unreadable JSON"),), None)
    return damage
