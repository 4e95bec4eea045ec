"""The kernels' tolerances and shortcuts, one object the public functions take."""

from __future__ import annotations

from typing import NamedTuple


class KernelSettings(NamedTuple):
    """Tolerances and shortcuts of the kernels; the defaults are the analysis's.

    The shortcuts trade speed only: every output is the same with any of them (the tests run
    with each fallback taken). ``l_rtol`` is part of the method
    (docs/method.md#sink-aware-bound).
    """

    # Share of a kv head's non-sink pairs kept, largest |cosine| first, as the candidates of
    # the 95% coherence quantile mu_q95 (which sits in the top 5% of its pairs). Any (head, N)
    # whose quantile falls outside them is computed from all of its pairs.
    top_pair_share: float = 0.08
    # Below this many pairs every pair is a candidate.
    top_pair_min: int = 4096
    # A kv head with more pairs than this finds its median pair cosine within a bracket from
    # a sample (`pairs.pair_statistics`).
    bracket_min: int = 1 << 16
    # The Gram matrix of a kv head's unit values in float32 (twice float64's speed), read as a
    # screen (`values.nonsink_gram`); False: float64, its entries the cosines.
    float32_gram: bool = True
    # An absolute floor under the expansions' error bound (`balls.error_bound`), far above
    # subnormal rounding; a huge one (1e300) compares every distance exactly.
    tiny: float = 1e-290
    # Relative margin of the "L <= 0" test of the sink-aware bounds (`bounds.k_sink`).
    l_rtol: float = 1e-10


class Tolerances(NamedTuple):
    """What the compiled loops read of the settings for one kv head."""

    e_rel: float   # `balls.error_bound` at the head's dimension
    tiny: float
    l_rtol: float
