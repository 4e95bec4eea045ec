"""What a detect is asked to do (docs/method.md#head-detectors): :class:`DetectRequest`. Light: no model code."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attngeom.errors import InputError

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
# The longest copy of the repeated random tokens, as in TransformerLens's head detector.
MAX_PROBE_LENGTH = 128


@dataclass(frozen=True)
class DetectRequest:
    """The arguments of ``attngeom detect`` and :func:`attngeom.detect`.

    probes: P repeated random-token sequences; needle_length: n tokens of the retrieval
    needle; haystacks: how many of the run's committed windows (the first ones) serve as
    haystacks, each at every depth of ``depths`` (fractions of the haystack body); seed:
    seeds the probe tokens and the needles. batch_size: sequences per forward. device:
    "auto", "cpu", "cuda" or "cuda:N"; dtype: "auto" (float32 on every device), "float32",
    "bfloat16" or "float16". model: the run's model when it was extracted from a model in
    memory; tokenizer: its tokenizer where the run records none that loads (the probe
    vocabulary is the tokenizer's).
    """

    store: str
    run_id: str
    device: str = "auto"
    device_map: str | Mapping[str, Any] | None = None
    dtype: str = "auto"
    probes: int = 16
    needle_length: int = 16
    haystacks: int = 16
    depths: Sequence[float] = DEFAULT_DEPTHS
    seed: int = 0
    batch_size: int = 8
    model: Any = None
    tokenizer: Any = None
    progress: bool = True


def probe_length(context_length: int) -> int:
    """k, the length of each copy of a probe ``[BOS] + r + r``: min(128, (L-1)//2)."""
    return min(MAX_PROBE_LENGTH, (context_length - 1) // 2)


def check_request(request: DetectRequest, context_length: int | None = None) -> None:
    """Refuse options no detect can run with, and, given the run's L, a needle or probe
    that does not fit it: :class:`InputError`, one line."""
    if request.probes < 1 or request.haystacks < 1 or request.batch_size < 1:
        raise InputError("--probes, --haystacks and --batch-size must be >= 1")
    if request.needle_length < 2:
        raise InputError(f"--needle-length must be >= 2 (a token and the one after it), got {request.needle_length}")
    depths = list(request.depths)
    if not depths or not all(0.0 <= d <= 1.0 for d in depths) or len(set(depths)) != len(depths):
        raise InputError("--depths takes distinct fractions between 0 and 1, e.g. 0.1,0.5,0.9")
    if context_length is None:
        return
    if probe_length(context_length) < 1:
        raise InputError(f"the run's L = {context_length} leaves no room for a repeated random sequence (L >= 3)")
    if context_length < 2 * request.needle_length + 2:
        raise InputError(
            f"--needle-length {request.needle_length} needs L >= {2 * request.needle_length + 2} "
            f"(BOS, a haystack token, the needle and its copy); the run has L = {context_length}"
        )


def check_sequences(run_id: str, committed: int) -> None:
    """Refuse a run of fewer ``committed`` sequences than a haystack and another window for its needle."""
    if committed < 2:
        raise InputError(
            f"run '{run_id}' needs at least 2 complete sequences (a haystack and another window for its needle); "
            f"it has {committed}"
        )
