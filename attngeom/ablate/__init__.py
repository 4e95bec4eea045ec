"""The ablate stage: single-head ablation and head sparsification (docs/method.md#ablation).

Called, ``attngeom.ablate(store, run_id, ...)`` is :func:`attngeom.api.ablate`. Its names load
on first use: the request is light, the stage loads torch and transformers.
"""

from __future__ import annotations

__all__ = ["DEFAULT_RETENTION", "AblateRequest", "AblateResult", "ablate", "parse_heads"]


def __getattr__(name: str) -> object:
    if name in ("DEFAULT_RETENTION", "AblateRequest", "parse_heads"):
        from attngeom.ablate import request

        return getattr(request, name)
    if name in ("AblateResult", "ablate"):
        from attngeom.ablate import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'attngeom.ablate' has no attribute {name!r}")
