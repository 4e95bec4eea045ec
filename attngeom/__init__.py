"""attngeom: geometric analysis of token selection in multi-head attention.

The Python API (docs/api.md), one function per command, each returning its results::

    import attngeom as ag
    ag.extract(model, store=..., texts=... | token_ids=... | dataset=..., context_length=...)
    ag.analyze(store), ag.taxonomy(store), ag.ablate(store, run_id), ag.detect(store, run_id)
    ag.report(store, out)
    ag.explore(store, out), ag.validate(store), ag.migrate(store)
    run = ag.open_store(store).run(run_id); run.analysis("topn")

Errors are kinds of :class:`AttngeomError`. Importing attngeom loads neither torch nor
transformers: each function imports its stage when called (see :mod:`attngeom.api`).
"""

from __future__ import annotations

import importlib
import types

# typing alone would take longer to import than the rest of this package (annotations here
# are strings, never evaluated); type checkers read the block below as typing.TYPE_CHECKING.
TYPE_CHECKING = False

from attngeom.errors import (
    AttngeomError,
    AttngeomWarning,
    CorruptChunkError,
    DamagedStoreError,
    ForeignFileError,
    GroupNotFoundError,
    IncompleteGroupError,
    InProgressError,
    InputError,
    RunNotFoundError,
    SchemaError,
    StoreError,
    StoreNotFoundError,
    StoreUnreachableError,
    StoreWriteError,
    UnsupportedModelError,
)
from attngeom.version import __version__

if TYPE_CHECKING:
    from typing import Any

    from attngeom.api import (
        Taxonomy,
        Validation,
        ablate,
        analyze,
        check_model,
        detect,
        explore,
        extract,
        migrate,
        open_store,
        repair,
        report,
        taxonomy,
        validate,
    )

__all__ = [
    "AttngeomError", "AttngeomWarning", "CorruptChunkError", "DamagedStoreError", "ForeignFileError",
    "GroupNotFoundError",
    "IncompleteGroupError", "InProgressError", "InputError",
    "RunNotFoundError", "SchemaError", "StoreError", "StoreNotFoundError", "StoreUnreachableError", "StoreWriteError",
    "UnsupportedModelError",
    "Taxonomy", "Validation", "__version__", "ablate", "analyze", "check_model", "detect", "explore", "extract",
    "migrate", "open_store", "repair", "report", "taxonomy", "validate",
]

# Commands whose name is also a stage's package (attngeom/extract/, ...).
STAGES = ("extract", "analyze", "ablate", "detect", "report", "explore")
# The API's other names, loaded with attngeom.api on first use (dataclasses and inspect alone
# would triple the time `import attngeom` takes).
_API_NAMES = ("Taxonomy", "Validation", "check_model", "migrate", "open_store", "repair", "taxonomy", "validate")


def __getattr__(name: str) -> Any:
    if name in _API_NAMES or name == "api":
        api = importlib.import_module("attngeom.api")
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module 'attngeom' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Stage(types.ModuleType):
    """A stage's package that is also its command's function: ``attngeom.extract`` is the
    package attngeom/extract/, and ``attngeom.extract(model, ...)`` calls
    :func:`attngeom.api.extract`. One name cannot be bound to both a function and a package
    (importing ``attngeom.extract.pipeline`` binds the package to it), so the package is
    made callable. The packages' ``__init__`` import nothing heavy."""

    def _function(self) -> Any:
        return getattr(importlib.import_module("attngeom.api"), self.__name__.rpartition(".")[2])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function()(*args, **kwargs)

    @property
    def __signature__(self) -> Any:
        import inspect

        return inspect.signature(self._function())

    # help() and pydoc document a module by its docstring: the function's signature and
    # docstring come first, then the package's own.
    @property
    def __doc__(self) -> str:  # type: ignore[override]
        import inspect

        function = self._function()
        signature = f"{function.__name__}{inspect.signature(function)}"
        return f"{signature}\n\n{inspect.getdoc(function)}\n\n{vars(self)['__doc__']}"


for _name in STAGES:
    importlib.import_module(f"attngeom.{_name}").__class__ = _Stage
del _name
