"""attngeom: geometric analysis of token selection in multi-head attention.

The Python API (SPEC §8), one function per command, each returning its results::

    import attngeom as ag
    ag.extract(model, store=..., texts=... | token_ids=... | dataset=..., context_length=...)
    ag.analyze(store), ag.taxonomy(store), ag.ablate(store, run_id), ag.report(store, out)
    ag.validate(store), ag.migrate(store)
    run = ag.open_store(store).run(run_id); run.analysis("topn")

Errors are kinds of :class:`AttngeomError`. Importing attngeom loads neither torch nor
transformers: each function imports its stage when called (see :mod:`attngeom.api`).
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from attngeom import api
from attngeom.api import Taxonomy, Validation, migrate, open_store, taxonomy, validate
from attngeom.errors import (
    AttngeomError,
    CorruptChunkError,
    DamagedStoreError,
    GroupNotFoundError,
    InputError,
    RunNotFoundError,
    SchemaError,
    StoreError,
    StoreNotFoundError,
    StoreWriteError,
)

if TYPE_CHECKING:
    from attngeom.api import ablate, analyze, extract, report

__all__ = [
    "AttngeomError", "CorruptChunkError", "DamagedStoreError", "GroupNotFoundError", "InputError",
    "RunNotFoundError", "SchemaError", "StoreError", "StoreNotFoundError", "StoreWriteError",
    "Taxonomy", "Validation", "__version__", "ablate", "analyze", "extract", "migrate", "open_store",
    "report", "taxonomy", "validate",
]

# Commands whose name is also a stage's package (attngeom/extract/, ...).
STAGES = ("extract", "analyze", "ablate", "report")


class _Stage(types.ModuleType):
    """A stage's package that is also its command's function: ``attngeom.extract`` is the
    package attngeom/extract/, and ``attngeom.extract(model, ...)`` calls
    :func:`attngeom.api.extract`. One name cannot be bound to both a function and a package
    (importing ``attngeom.extract.pipeline`` binds the package to it), so the package is
    made callable. The packages' ``__init__`` import nothing heavy."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


for _name in STAGES:
    _package = importlib.import_module(f"attngeom.{_name}")
    _package.__class__ = _Stage
    _package.__signature__ = inspect.signature(getattr(api, _name))
del _name, _package
