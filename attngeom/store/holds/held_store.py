"""A command's store as its writers see it: what extract's write of a run and a derived
group's write ask of the :class:`~attngeom.store.session.StoreSession` that makes them,
named here so that they, below the session, need not import it."""

from __future__ import annotations

from typing import Any, Protocol

import zarr

from attngeom.store.holds.lease import HeldObject

__all__ = ["HeldStore"]


class HeldStore(Protocol):
    """``url``, ``zstore`` (the zarr Store), ``root`` (its root group; None in mode "c"
    before a write creates the store) and ``lease_seconds`` (a run's lease on an object
    store), with the holds a writer takes through them."""

    url: str
    zstore: Any
    root: zarr.Group | None
    lease_seconds: float | None

    def lock(self, run_id: str, what: str = "writer") -> None:
        """Hold the run's writer lock until the command's store closes."""

    def check_lock(self, run_id: str) -> None:
        """:class:`~attngeom.errors.StoreWriteError` if the run's lease was lost."""

    def held_object(self, run_id: str, key: str) -> HeldObject | None:
        """The object ``key`` as the holder of the run's lease writes it; None on a local store."""

    def fresh_root(self) -> zarr.Group:
        """The root read afresh, created first in mode "c" where there is none."""

    def remove(self) -> None:
        """Remove the local store, which a write created and left holding nothing committed."""
