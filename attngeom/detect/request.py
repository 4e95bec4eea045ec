"""What a detect is asked to do (docs/method.md#head-detectors): :class:`DetectRequest`. Light: no model code."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attngeom.errors import InputError
from attngeom.extract.request import check_device_map
from attngeom.extract.tokenizing import check_tokenizer_name
from attngeom.options import check_options, option, refusal
from attngeom.extract.runcheck import STAGE_DTYPES, check_device

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
    memory; tokenizer: a tokenizer, or a name or folder, whose vocabulary the probes draw
    from in place of the run's (needed where the run records one that does not load here; a
    run extracted without one draws from the model's embedding rows). Each option's default and what it accepts are declared
    here once (:mod:`attngeom.options`).
    """

    store: str
    run_id: str
    model: Any = None
    tokenizer: Any = None
    device: str = "auto"
    device_map: str | Mapping[str, Any] | None = None
    dtype: str = option("auto", choices=STAGE_DTYPES, why=" (float32-tf32 is extract's alone)")
    probes: int = option(16, least=1)
    needle_length: int = option(16, least=2, why=" (a token and the one after it)")
    haystacks: int = option(16, least=1)
    depths: Sequence[float] = DEFAULT_DEPTHS
    seed: int = 0
    batch_size: int = option(8, least=1)
    progress: bool = True

    def __post_init__(self) -> None:
        # Kept as given by the caller (a list, a generator): one tuple, read more than once.
        object.__setattr__(self, "depths", tuple(self.depths))


def probe_length(context_length: int) -> int:
    """k, the length of each copy of a probe ``[BOS] + r + r``: min(128, (L-1)//2)."""
    return min(MAX_PROBE_LENGTH, (context_length - 1) // 2)


def check_request(request: DetectRequest, context_length: int | None = None) -> None:
    """Refuse options no detect can run with (the device, the device map, the dtype and a
    tokenizer named that is not there included, reading no model), and, given the run's L, a needle or probe
    that does not fit it: :class:`InputError`, one line."""
    check_options(request)
    check_device(request.device)
    if isinstance(request.tokenizer, str | os.PathLike):
        check_tokenizer_name(str(request.tokenizer))
    check_device_map(request.device_map, request.device, named=request.model is None
                     or isinstance(request.model, str | os.PathLike))
    depths = list(request.depths)
    if not depths or not all(0.0 <= d <= 1.0 for d in depths) or len(set(depths)) != len(depths):
        raise refusal("{depths!s} takes distinct fractions between 0 and 1, e.g. 0.1,0.5,0.9", DetectRequest)
    if context_length is None:
        return
    if probe_length(context_length) < 1:
        raise InputError(f"the run's L = {context_length} leaves no room for a repeated random sequence (L >= 3)")
    if context_length < 2 * request.needle_length + 2:
        raise refusal("{needle_length:{value}} needs L >= {least} (BOS, a haystack token, the needle and its copy); "
                      "the run has L = {length}", DetectRequest, value=request.needle_length,
                      least=2 * request.needle_length + 2, length=context_length)


def check_sequences(run_id: str, committed: int) -> None:
    """Refuse a run of fewer ``committed`` sequences than a haystack and another window for its needle."""
    if committed < 2:
        raise InputError(
            f"run '{run_id}' needs at least 2 complete sequences (a haystack and another window for its needle); "
            f"it has {committed}"
        )
