"""Which files of a local store a command may open: one rule for every reader and writer.

A store made by someone else may hold a link that leads outside its folder (to another
store's run, to ``/dev/zero``) or a file that is no regular file (a device, a named pipe):
read, such a file never ends or is someone else's; written, the write lands outside the
store. Every local read asks :func:`check_file` first, validate names each such file
(:func:`foreign_files`), and every writer refuses a store holding one. Light: nothing of the
store's libraries loads here, so that the first look at a store (:mod:`attngeom.store.objects.preflight`)
keeps the same rule.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from attngeom.errors import ForeignFileError

__all__ = ["check_file", "foreign_files", "link_problem", "special_problem"]

# A chunk grid's folders (``c/<seq>/...``) are most of a store's; where ``whole`` is not
# asked, only their first level is walked.
_GRID = "c"


def link_problem(url: str, key: str, target: str) -> str:
    """The one line naming a link at ``key`` of the store at ``url`` that leads to ``target``,
    outside the store."""
    return (f"{key} in {url} is a link to {target}, outside the store; attngeom reads and writes nothing outside a "
            f"store's folder: replace the link by a copy of what it leads to, or remove it")


def special_problem(url: str, key: str, mode: int) -> str:
    """The one line naming the file at ``key`` of the store at ``url`` that is no regular
    file (``mode``: its ``st_mode``)."""
    kind = ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "no regular file")
    return f"{key} in {url} is {kind}, not a file a store holds; attngeom reads only regular files: remove it"


def check_file(root: Path, key: str, url: str) -> None:
    """Refuse to open the object ``key`` of the local store whose folder is ``root`` (its
    ``url`` as the user gave it), raising :class:`ForeignFileError`, when a link on its way
    leads outside the store or it is no regular file. A missing object passes: the reader
    says it is absent."""
    # Each part of the key looked at without following it (a read's cost: no path resolved
    # from the file system's root), until a link: then where the path leads decides.
    here, mode = str(root), None
    for part in key.split("/"):
        here = os.path.join(here, part)
        try:
            mode = os.lstat(here).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISLNK(mode) or part == "..":
            _check_resolved(root, key, url)
            return
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ForeignFileError(special_problem(url, key, mode))


def _check_resolved(root: Path, key: str, url: str) -> None:
    """:func:`check_file` for a key with a link (or "..") on its way: where it leads."""
    real = os.path.realpath(os.path.join(root, key))
    base = os.path.realpath(root)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise ForeignFileError(_link_on_the_way(root, key, url))
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ForeignFileError(special_problem(url, key, mode))


def _link_on_the_way(root: Path, key: str, url: str) -> str:
    """The line naming the first link on the way from ``root`` to ``key`` that leads outside
    the store (looked for only once the path is known to leave it)."""
    base = Path(os.path.realpath(root))
    parts = key.split("/")
    for depth in range(1, len(parts) + 1):
        here = Path(root, *parts[:depth])
        if here.is_symlink():
            target = here.resolve()
            if not target.is_relative_to(base):
                return link_problem(url, "/".join(parts[:depth]), str(target))
    return link_problem(url, key, os.path.realpath(os.path.join(root, key)))


def foreign_files(url: str, root: Path, *, whole: bool) -> dict[str, str]:
    """Key -> the line naming it, for each file under the local store folder ``root`` (at
    ``url``) that :func:`check_file` refuses: a link leading outside the store, a file that
    is no regular file; sorted by key, links not followed. ``whole``: every folder (validate);
    else where writers go: every folder but a run array's chunk grid, whose first level
    (``c/<seq>``) alone is looked at."""
    base = root.resolve()
    found: dict[str, str] = {}

    def walk(folder: Path, key: str, descend: bool) -> None:
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return
        for entry in entries:
            name = f"{key}/{entry.name}" if key else entry.name
            if entry.is_symlink():
                target = Path(entry.path).resolve()
                if not target.is_relative_to(base):
                    found[name] = link_problem(url, name, str(target))
            elif entry.is_dir(follow_symlinks=False):
                if descend:
                    walk(Path(entry.path), name, whole or entry.name != _GRID)
            elif not entry.is_file(follow_symlinks=False):
                found[name] = special_problem(url, name, entry.stat(follow_symlinks=False).st_mode)

    walk(root, "", True)
    return dict(sorted(found.items()))
