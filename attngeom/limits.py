"""What this machine could hold: the bound that sizes read from someone else's files (a
model's config, a store's metadata) are checked against before anything is allocated or
iterated by them. Light: no library of the store or the model loads here."""

from __future__ import annotations

import os

__all__ = ["exceeds_memory", "memory_bytes", "size_text"]


def memory_bytes() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def exceeds_memory(n_bytes: float) -> bool:
    """Whether ``n_bytes`` is more than this machine's physical memory."""
    return n_bytes > memory_bytes()


def size_text(n_bytes: float) -> str:
    """``n_bytes`` in binary units, three significant figures at most: "909 TiB"."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    value, unit = float(n_bytes), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.3g} {units[unit]}" if unit else f"{int(value)} bytes"
