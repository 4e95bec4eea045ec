"""The ablate stage: single-head ablation and head sparsification (SPEC §5).

Called, ``attngeom.ablate(store, run_id, ...)`` is :func:`attngeom.api.ablate`. The request
is light to import; the stage (torch, transformers) loads on first use.
"""

from __future__ import annotations

from typing import Any

from attngeom.ablate.request import DEFAULT_RETENTION, AblateRequest, parse_heads

__all__ = ["DEFAULT_RETENTION", "AblateRequest", "AblateResult", "ablate", "parse_heads"]


def __getattr__(name: str) -> Any:
    if name in ("AblateResult", "ablate"):
        from attngeom.ablate import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'attngeom.ablate' has no attribute {name!r}")
