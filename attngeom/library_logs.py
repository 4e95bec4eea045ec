"""The warnings that libraries log (transformers, huggingface_hub, datasets, accelerate) said
as the tool says its own: one line each, ``attngeom: warning: <library>: ...``, through the
command line's printer. transformers adds a handler of its own to its logger as it loads,
printing ``[transformers] ...``: while a command runs, that handler is silenced."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

__all__ = ["LIBRARIES", "library_warnings"]

# The libraries whose loggers a command's warnings come from.
LIBRARIES = ("transformers", "huggingface_hub", "datasets", "accelerate")


class _Said(logging.Handler):
    """Says each record of level WARNING or above with ``say``, as "<library>: <message>",
    and silences the other handlers of its library's logger, added by the library itself
    as it loads (after this one: found when its first record comes)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self._say = say
        self._silenced: list[logging.Handler] = []

    def emit(self, record: logging.LogRecord) -> None:
        library = record.name.split(".", 1)[0]
        self.silence(logging.getLogger(library))
        self._say(f"{library}: {' '.join(record.getMessage().split())}")

    def silence(self, logger: logging.Logger) -> None:
        """Silence the other handlers of ``logger``: by a filter, not by removal, since the
        logger may be walking its handlers right now."""
        for handler in logger.handlers:
            if handler is not self and handler not in self._silenced:
                handler.addFilter(_never)
                self._silenced.append(handler)

    def restore(self) -> None:
        for handler in self._silenced:
            handler.removeFilter(_never)
        self._silenced.clear()


def _never(record: logging.LogRecord) -> bool:
    return False


@contextlib.contextmanager
def library_warnings(say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, every warning the :data:`LIBRARIES` log is said with ``say``
    ("<library>: <message>", whitespace made single spaces) and by nothing else."""
    handler = _Said(say)
    loggers = [logging.getLogger(name) for name in LIBRARIES]
    for logger in loggers:
        handler.silence(logger)
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.restore()
