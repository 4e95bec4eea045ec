"""What an ablation is asked to do (docs/method.md#ablation): :class:`AblateRequest`. Light: no model code."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attngeom.errors import InputError
from attngeom.extract.request import check_device_map
from attngeom.options import check_options, option, refusal
from attngeom.extract.runcheck import STAGE_DTYPES, check_device

__all__ = ["DEFAULT_RETENTION", "AblateRequest", "check_request", "parse_heads"]

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
    Each option's default and what it accepts are declared here once (:mod:`attngeom.options`).
    """

    store: str
    run_id: str
    model: Any = None
    device: str = "auto"
    device_map: str | Mapping[str, Any] | None = None
    dtype: str = option("auto", choices=STAGE_DTYPES, why=" (float32-tf32 is extract's alone)")
    protect: Sequence[tuple[int, int]] = ()
    protect_critical: bool = False
    retention: Sequence[float] = DEFAULT_RETENTION
    random_masks: int = option(10, least=0)
    seed: int = 0
    top_n: int = option(8, least=1, flag="top_n")
    critical_k: float = 5.0
    critical_floor: float = 2.0
    max_sequences: int | None = option(None, least=2, why=" (an importance and an evaluation split)")
    batch_size: int = option(64, least=1)
    out: Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        # Kept as given by the caller (a list, a generator): one tuple, read more than once.
        object.__setattr__(self, "protect", tuple(self.protect))
        object.__setattr__(self, "retention", tuple(self.retention))


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"0.12,3.4"`` -> ``[(0, 12), (3, 4)]`` (layer.head pairs, for ``--protect``)."""
    heads = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        layer, dot, head = item.partition(".")
        if not dot or not layer.isdigit() or not head.isdigit():
            raise InputError(f"--protect takes LAYER.HEAD pairs separated by commas, e.g. 0.12,3.4 (got {item!r})")
        heads.append((int(layer), int(head)))
    return heads


def check_request(request: AblateRequest, layout: dict[str, Any] | None = None, committed: int | None = None) -> None:
    """Refuse options no ablation can run with or that would change nothing (the device, the
    device map and the dtype included, reading nothing): :class:`InputError`, one line. Given the run's ``layout`` (its record's: n_layers, n_heads), also a protected
    head outside the run and a retention that keeps no head of a layer; given its
    ``committed`` sequences, fewer than the two splits need."""
    check_options(request)
    check_device(request.device)
    check_device_map(request.device_map, request.device, named=request.model is None
                     or isinstance(request.model, str | os.PathLike))
    retention = list(request.retention)
    outside = [f for f in retention if not 0.0 < f <= 1.0]
    if not retention or outside:
        raise refusal("{retention:{value}}: each fraction of heads kept is above 0 and at most 1, e.g. 1.0,0.75,0.5",
                      AblateRequest, value=",".join(map(str, outside or retention)))
    if request.random_masks == 0 and request.seed != 0:
        raise refusal("{seed:{value}} seeds the random masks, and {random_masks:0} asks for none: drop {seed!s}, "
                      "or ask for random masks", AblateRequest, value=request.seed)
    if layout:
        n_layers, n_heads = layout["n_layers"], layout["n_heads"]
        for layer, head in request.protect:
            if not (0 <= layer < n_layers and 0 <= head < n_heads):
                raise refusal("{protect!s} {layer}.{head}: the run has layers 0-{last_layer} and heads "
                              "0-{last_head}", AblateRequest, layer=layer, head=head, last_layer=n_layers - 1,
                              last_head=n_heads - 1)
        # kept_per_layer: f * H rounded half up.
        none_kept = [f for f in retention if int(f * n_heads + 0.5) == 0]
        if none_kept:
            raise refusal("{retention:{value}} keeps no head of a layer of {n_heads} (its fraction of heads, "
                          "rounded); the smallest fraction keeping one is {least}", AblateRequest, value=none_kept[0],
                          n_heads=n_heads, least=f"{0.5 / n_heads:g}")
    if committed is not None:
        used = committed if request.max_sequences is None else min(committed, request.max_sequences)
        if used < 2:
            raise InputError(
                f"run '{request.run_id}' needs at least 2 complete sequences (an importance and an evaluation "
                f"split); it has {committed}"
            )
