"""The detect stage: the field's head detectors with the run's model (docs/method.md#head-detectors).

Called, ``attngeom.detect(store, run_id, ...)`` is :func:`attngeom.api.detect`. Its names load
on first use: the request is light, the stage loads torch and transformers.
"""

from __future__ import annotations

__all__ = ["DEFAULT_DEPTHS", "DetectRequest", "DetectResult", "detect"]


def __getattr__(name: str) -> object:
    if name in ("DEFAULT_DEPTHS", "DetectRequest"):
        from attngeom.detect import request

        return getattr(request, name)
    if name in ("DetectResult", "detect"):
        from attngeom.detect import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'attngeom.detect' has no attribute {name!r}")
