"""What an ablation is asked to do (docs/method.md#ablation): :class:`AblateRequest`. Light: no model code."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attngeom.errors import InputError

DEFAULT_RETENTION = (1.0, 0.9, 0.75, 0.5, 0.25)


@dataclass(frozen=True)
class AblateRequest:
    """The arguments of ``attngeom ablate`` and :func:`attngeom.ablate`.

    protect: (layer, head) pairs always kept and outside every ranking; protect_critical adds
    the critical heads (see :func:`attngeom.ablate.kernels.critical_threshold`: ``k`` is
    ``critical_k``, ``floor`` is ``critical_floor`` nats). retention: fractions of heads kept
    per layer (``round(f * H)`` in every layer). random_masks: seeded random draws (0: none).
    top_n: N of the top-N attention mass diagnostic. max_sequences: use only the first
    completed sequences. batch_size: (sequence, mask) rows per forward. device: "auto",
    "cpu", "cuda" or "cuda:N"; dtype: "auto" (float32 on every device),
    "float32", "bfloat16" or "float16". model: the run's model when it was extracted from
    a model in memory (its state dict must hash as recorded). out: also write CSV tables there.
    """

    store: str
    run_id: str
    device: str = "auto"
    device_map: str | Mapping[str, Any] | None = None
    dtype: str = "auto"
    protect: Sequence[tuple[int, int]] = ()
    protect_critical: bool = False
    retention: Sequence[float] = DEFAULT_RETENTION
    random_masks: int = 10
    seed: int = 0
    top_n: int = 8
    critical_k: float = 5.0
    critical_floor: float = 2.0
    max_sequences: int | None = None
    batch_size: int = 64
    model: Any = None
    out: Path | None = None
    progress: bool = True


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"0.12,3.4"`` -> ``[(0, 12), (3, 4)]`` (layer.head pairs, for ``--protect``)."""
    heads = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        layer, dot, head = item.partition(".")
        if not dot or not layer.isdigit() or not head.isdigit():
            raise InputError(f"--protect takes LAYER.HEAD pairs separated by commas, e.g. 0.12,3.4 (got {item!r})")
        heads.append((int(layer), int(head)))
    return heads
