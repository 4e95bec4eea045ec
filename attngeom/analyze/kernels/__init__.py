"""Numeric kernels of the analyze stage: top-N geometry at the final query and the value
statistics of each kv head (docs/method.md).

The public functions are in `metrics`; the compiled loops are grouped by family of
quantities: `selection` (orders and aggregates), `balls` (distances, precision and recall,
inversions), `bounds` (the sink-aware bound), `pairs` (a kv head's pair cosines), `coherence`
(mu and mu_q95), `values` (what depends on a kv head's values only), `geometry` (every output
of a query head, by the schema's names) and `vectors` (small vector helpers). They pass their
parts as named tuples; the tolerances and shortcuts are one `KernelSettings`. `field` holds the
field's head scores from the per-query summaries (plain numpy).
"""

from attngeom.analyze.kernels.field import (
    SINK_THRESHOLD,
    FieldScores,
    distant_attn,
    head_scores,
    learned_sink_score,
    sequence_scores,
)
from attngeom.analyze.kernels.metrics import (
    DEFAULT_SETTINGS,
    MAX_KEYS,
    compile_kernels,
    head_metrics,
    topn_metrics,
    value_statistics,
)
from attngeom.analyze.kernels.settings import KernelSettings
from attngeom.store.objects.schema import TOPN_COUNTS, TOPN_FLOATS, VALUE_STATISTICS

__all__ = ["DEFAULT_SETTINGS", "MAX_KEYS", "SINK_THRESHOLD", "TOPN_COUNTS", "TOPN_FLOATS", "VALUE_STATISTICS",
           "FieldScores", "KernelSettings", "compile_kernels", "distant_attn", "head_metrics", "head_scores",
           "learned_sink_score", "sequence_scores", "topn_metrics", "value_statistics"]
