"""The query positions an extract keeps attention rows at (``--queries``, docs/method.md#any-query)."""

from __future__ import annotations

from collections.abc import Sequence

from attngeom.errors import InputError

__all__ = ["query_positions"]


def query_positions(queries: str | Sequence[int], length: int) -> tuple[int, ...]:
    """Ascending positions in 1..L-1 whose rows the run keeps; () for ``"last"`` (only
    ``attn_last``, as before ``--queries`` existed).

    ``queries`` is ``"last"``, ``"every:K"`` (L-1, L-1-K, L-1-2K, ... down to 1) or positions
    as ``"P1,P2,..."`` or a sequence of ints. :class:`InputError` for anything else.
    """
    if isinstance(queries, str):
        text = queries.strip()
        if text == "last":
            return ()
        if text.startswith("every:"):
            step = _integer(text.removeprefix("every:"), queries)
            if step < 1:
                raise InputError(f"--queries {queries!r}: the step K of every:K must be at least 1")
            return tuple(sorted(range(length - 1, 0, -step)))
        positions = [_integer(p, queries) for p in text.split(",")]
    else:
        positions = [_integer(p, queries) for p in queries]
    outside = sorted({p for p in positions if not 1 <= p <= length - 1})
    if outside or not positions:
        raise InputError(
            f"--queries {queries!r}: positions must lie in 1..{length - 1} (L = {length})"
            + (f"; got {', '.join(map(str, outside))}" if outside else "")
        )
    return tuple(sorted(set(positions)))


def _integer(text: object, queries: object) -> int:
    try:
        if isinstance(text, bool) or (not isinstance(text, str) and int(text) != text):
            raise ValueError
        return int(text)
    except (TypeError, ValueError):
        raise InputError(
            f"--queries {queries!r}: use last, every:K or positions P1,P2,... (integers)"
        ) from None
