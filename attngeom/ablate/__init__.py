"""The ablate stage: single-head ablation and head sparsification (SPEC §5)."""

from attngeom.ablate.stage import DEFAULT_RETENTION, AblateResult, ablate, parse_heads

__all__ = ["DEFAULT_RETENTION", "AblateResult", "ablate", "parse_heads"]
