"""The store contract (docs/store.md, schema version 1): what a store holds and what it is called.

A store is a Zarr v3 group. Each run lives in ``runs/<run_id>`` and holds one array per
captured quantity, with named dimensions (``dimension_names``) so that
``xr.open_zarr(url, group="runs/<run_id>")`` gives a Dataset. Derived groups live beside a
run's arrays: ``runs/<run_id>/analysis/<name>`` (analyze), ``runs/<run_id>/ablation/<name>``
(ablate) and ``runs/<run_id>/detect/<name>`` (detect), or, written on an object store, in
the generation folder their record names (``runs/<run_id>/analysis/gen-<token>/<name>``). Every name that more than one stage uses is defined here, once.

Layout decisions, made for what reads and writes the store:

* Every per-sequence array is sharded with one shard per sequence (all layers) and one
  inner chunk per (sequence, layer). A writer always writes whole shards, so two processes
  extracting different sequences never touch the same object, and a resumed run rewrites
  whole shards. Analyze reads one inner chunk, i.e. one sequence x one layer, at a time.
* ``complete`` (seq) is written last for each sequence: a sequence exists for readers only
  once its flag is 1, so a killed run never exposes half a sequence.
* The run's provenance is written after its arrays; ``initialized`` in it marks a run
  whose creation finished.

Two numbers in the root's attributes say what a store is:

* ``schema_version`` is the contract of docs/store.md (names, dimensions, dtypes), which readers
  rely on. A store of a later version is refused.
* ``format`` is how this implementation encodes that contract. Format 1 (attngeom 0.1.0's
  first stores, which carry no ``format`` attribute) has no chunk checksums; format 2 ends
  every chunk of every array, derived groups included, with a crc32c checksum; format 3
  stores every array in data types of the Zarr v3 core, so that any implementation reads
  it: a label variable (a regime, a statistic, a method, a table's text column) is an
  integer code whose labels are the variable's attributes (CF ``flag_values`` /
  ``flag_meanings``, and exactly ``attngeom.labels``), where format 2 used zarr-python's
  ``string`` type and ``vlen-utf8`` codec; format 4 gives the labels of a fixed vocabulary
  (regimes, votes, statistics, methods: ``LABEL_ORDERS``) the same codes in every store,
  where format 3 numbered them in order of first appearance; format 5 adds the per-query
  summaries ``prev_attn`` and ``recent_attn`` (docs/method.md#the-fields-head-scores), which
  a run migrated from an earlier format lacks: its layout's ``lacking`` names them, for they
  cannot be computed without the model; format 6 records each run's layer indices (the
  model's own: a hybrid keeps its softmax-attention layers only) and whether its model has
  learned sinks, whose weight per query ``learned_sink_attn`` holds; format 7 lets a derived
  group's record name the generation folder holding its groups, where writers on object
  stores put them (docs/store.md#commit-protocol). Format 5 may also store the value vectors of a
  bfloat16 model at 2 bytes losing nothing: their bfloat16 bit patterns as ``uint16``, a
  core type every implementation reads (zarr-python reads no bfloat16), the array's attngeom
  attributes naming the encoding (``{"encoding": "bfloat16"}``); attngeom's readers give
  float32 (``VALUE_ENCODINGS``). ``attngeom.store.open_dataset`` gives the labels back as
  strings; a plain ``xr.open_zarr`` gives the codes. Every format
  of schema 1 is read; only the current format is written, and ``attngeom migrate``
  (:mod:`attngeom.store.integrity.migrate`) brings an older store to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCHEMA_VERSION = 1
FORMAT = 7
# The key of attngeom's attributes in the root's, a run's and a derived group's attributes.
ATTR_KEY = "attngeom"

# The key, in a label variable's attngeom attributes, of its labels (code i is labels[i]).
LABELS = "labels"

# The key, in a run array's attngeom attributes, of the encoding of its values, and the
# encodings: name -> stored dtype. "bfloat16": a bfloat16 value's bit pattern as uint16, whose
# float32 is the pattern in the upper half of a float32's bits, (u16.astype(uint32) << 16).view(float32).
ENCODING = "encoding"
BFLOAT16 = "bfloat16"
VALUE_ENCODINGS = {BFLOAT16: "uint16"}

# Group paths.
RUNS = "runs"
ANALYSIS = "analysis"
ABLATION = "ablation"
DETECT = "detect"
# The derived kinds, groups beside a run's arrays, and the stage (command) that writes each
# through the commit protocol (attngeom.store.derived_groups.derived).
DERIVED = {ANALYSIS: "analyze", ABLATION: "ablate", DETECT: "detect"}

# The groups analyze writes under runs/<id>/analysis: per sequence (seq, ...), then across
# sequences.
ANALYSIS_SEQUENCE_GROUPS = ("topn", "values", "taxonomy")
ANALYSIS_GROUPS = (*ANALYSIS_SEQUENCE_GROUPS, "heads", "summary", "signatures", "table")
# The groups of the field's head scores (docs/method.md#the-fields-head-scores), for a run
# that holds prev_attn and recent_attn: per sequence, then across sequences.
SCORE_SEQUENCE_GROUPS = ("sequence_scores",)
SCORE_GROUPS = (*SCORE_SEQUENCE_GROUPS, "head_scores")
# The groups analyze adds for a run extracted at more queries than the last
# (docs/method.md#any-query): per sequence, then across sequences.
QUERY_SEQUENCE_GROUPS = ("topn_by_query",)
QUERY_GROUPS = (*QUERY_SEQUENCE_GROUPS, "summary_by_query")
# The groups ablate writes under runs/<id>/ablation; ``regimes`` only when the run has regimes.
ABLATION_GROUPS = ("single", "sweep", "correlations", "critical", "table", "regimes")
# The groups detect writes under runs/<id>/detect (docs/method.md#head-detectors): the
# scores (layer, head), the probe sequences (probe, pos) and the retrieval samples (sample, pos).
DETECT_GROUPS = ("scores", "probes", "retrieval")

# Labels (docs/method.md#head-taxonomy). A query votes for one of VOTES; a head's regime is indexed like VOTES.
VOTES = ("diagonal", "sink", "other")
REGIMES = ("Retriever", "Mixer", "Reset")
# Mechanistic signatures (docs/method.md#mechanistic-signatures): variables of ``topn``
# reduced per regime in ``signatures``.
SIGNATURE_VARIABLES = ("s_norm", "s_norm_nosink", "s_norm_nocurrent", "cos_s_v0", "cos_s_vlast")
# Variables of ``topn`` (seq, layer, head, n), the outputs of the analyze kernels: floats,
# int64 counts (-1 = N not valid there), and the int8 flags of the selection of key 0 and of
# the learned sink (-1 for a run without learned sinks).
TOPN_FLOATS = (
    "precision", "recall", "f_score",
    "mu", "mu_q95",
    "precision_bound", "recall_bound", "precision_bound_q95", "recall_bound_q95",
    "random_precision", "random_recall", "random_f_score",
    "nosink_precision", "nosink_recall", "nosink_f_score",
    "sink_norm_share", "sink_direction_change", "sink_intrusion", "sink_pair_inversion_frac",
    "sink_alignment",
    "loo_cos", "loo_margin", "loo_positive_frac", "loo_distance_margin",
    "s_norm", "s_norm_nosink", "s_norm_nocurrent", "cos_s_v0", "cos_s_vlast",
)
TOPN_COUNTS = ("inversions", "k_sink", "k_sink_q95", "k_sink_exact")
TOPN_FLAGS = ("sink_selected", "learned_sink_selected")
TOPN_VARIABLES = (*TOPN_FLOATS, *TOPN_COUNTS, *TOPN_FLAGS)
# Variables of ``values`` (seq, layer, head): norm and coherence statistics per sequence.
VALUE_STATISTICS = (
    "C", "sink_norm_ratio", "norm_cv", "median_cos",
    "sink_cos_median", "sink_cos_neg_frac", "nu_minus_q95", "nu_plus_q95",
)
# Statistics across sequences of the ``summary`` group.
STATS = ("mean", "median", "q05", "q95", "count")
# Sparsification methods of ``ablation/sweep`` (docs/method.md#sparsification).
METHODS = (
    "type_guided", "single_impact", "weight_o", "weight_v", "entropy_low", "entropy_high",
    "sink_attention", "current_attention", "random",
)
# Label variables of a fixed vocabulary, by variable name (a coordinate, a data variable or a
# table column): code i is vocabulary[i] in every store, whatever labels a store holds, so
# that a reader of plain Zarr who learns the codes once decodes every store alike. A label
# outside its vocabulary would follow it, in order of first appearance; so do the labels
# of every other label variable (a run, a model, a variable name).
LABEL_ORDERS: dict[str, tuple[str, ...]] = {"regime": REGIMES, "vote": VOTES, "stat": STATS, "method": METHODS}


def run_path(run_id: str) -> str:
    """``runs/<run_id>``."""
    return f"{RUNS}/{run_id}"


def analysis_path(run_id: str, name: str | None = None) -> str:
    """``runs/<run_id>/analysis``, or its group ``name`` (one of ANALYSIS_GROUPS, QUERY_GROUPS or SCORE_GROUPS)."""
    return _derived_path(run_id, ANALYSIS, (*ANALYSIS_GROUPS, *QUERY_GROUPS, *SCORE_GROUPS), name)


def ablation_path(run_id: str, name: str | None = None) -> str:
    """``runs/<run_id>/ablation``, or its group ``name`` (one of ABLATION_GROUPS)."""
    return _derived_path(run_id, ABLATION, ABLATION_GROUPS, name)


def _derived_path(run_id: str, kind: str, groups: tuple[str, ...], name: str | None) -> str:
    if name is not None and name not in groups:
        raise ValueError(f"{kind} has no group {name!r} (groups: {', '.join(groups)})")
    base = f"{run_path(run_id)}/{kind}"
    return base if name is None else f"{base}/{name}"


@dataclass(frozen=True)
class Variable:
    """One array of a run: its dimensions and admissible dtypes."""

    dims: tuple[str, ...]
    dtypes: tuple[str, ...]
    per_sequence: bool = True
    optional: bool = False
    doc: str = ""


SUMMARY_DIMS = ("seq", "layer", "head", "query")
# The windows W of recent_attn, its coordinate ``recent`` (docs/method.md#the-fields-head-scores).
RECENT_WINDOWS = (16, 64, 256)
# The per-query summaries a capture keeps of each attention row, float32 per layer, head and
# query (recent_attn also per window W of RECENT_WINDOWS): named here once, for the run's
# arrays below, extract's hand-off and the capture's records.
SUMMARY_VARIABLES: dict[str, Variable] = {
    "sink_attn": Variable(SUMMARY_DIMS, ("float32",), doc="A_i0, per query"),
    "diag_attn": Variable(SUMMARY_DIMS, ("float32",), doc="A_ii, per query"),
    "top1_attn": Variable(SUMMARY_DIMS, ("float32",), doc="max_j A_ij, per query"),
    "entropy": Variable(SUMMARY_DIMS, ("float32",), doc="-sum_j A_ij log A_ij (nats), per query"),
    "prev_attn": Variable(SUMMARY_DIMS, ("float32",), doc="A_i,i-1 (0 at i = 0), per query"),
    "recent_attn": Variable(
        (*SUMMARY_DIMS, "recent"), ("float32",),
        doc="sum of A_ij over attendable j in max(1, i-W+1)..i, per query and window W",
    ),
}
QUERY_SUMMARIES = tuple(SUMMARY_VARIABLES)
# The per-query summaries format 5 added: a run migrated from an earlier format lacks them.
FIELD_SUMMARIES = ("prev_attn", "recent_attn")

RUN_VARIABLES: dict[str, Variable] = {
    "tokens": Variable(("seq", "pos"), ("int32",), doc="token ids, BOS at pos 0"),
    "values": Variable(
        ("seq", "layer", "kv_head", "pos", "head_dim"),
        ("float16", "float32", "uint16"),
        doc="value vectors v_j of every kv head",
    ),
    "attn_last": Variable(
        ("seq", "layer", "head", "key"), ("float32",), doc="final query's attention row alpha_j"
    ),
    "winner": Variable(
        SUMMARY_DIMS, ("int16", "int32"), doc="j* = argmax_j A_ij ||v_j|| (docs/method.md#head-taxonomy), per query"
    ),
    **SUMMARY_VARIABLES,
    "learned_sink_attn": Variable(
        SUMMARY_DIMS, ("float32",), optional=True,
        doc="s_i, the weight of the head's learned sink (runs of models with learned sinks), per query",
    ),
    "attn": Variable(
        ("seq", "layer", "head", "query", "key"),
        ("float16",),
        optional=True,
        doc="full attention rows (--store-rows all)",
    ),
    "attn_rows": Variable(
        ("seq", "layer", "head", "query_pos", "key"),
        ("float32",),
        optional=True,
        doc="attention rows of the queries at query_pos, 0 after the query (--queries)",
    ),
    "doc_index": Variable(("seq",), ("int64",), doc="document of the window, in corpus order"),
    "window_start": Variable(("seq",), ("int64",), doc="token offset of the window in its document"),
    "complete": Variable(("seq",), ("uint8",), doc="1 once every array of the sequence is written"),
    "layer": Variable(("layer",), ("int32",), per_sequence=False),
    "head": Variable(("head",), ("int32",), per_sequence=False),
    "kv_head": Variable(("kv_head",), ("int32",), per_sequence=False),
    "pos": Variable(("pos",), ("int32",), per_sequence=False),
    "head_kv": Variable(("head",), ("int32",), per_sequence=False, doc="kv head read by each head"),
    "window": Variable(
        ("layer",), ("int32",), per_sequence=False, doc="sliding window of the layer, 0 = full causal"
    ),
    "attendable": Variable(
        ("layer", "key"), ("bool",), per_sequence=False, doc="keys the final query may attend"
    ),
    "recent": Variable(("recent",), ("int32",), per_sequence=False, doc="windows W of recent_attn, in keys"),
    "query_pos": Variable(
        ("query_pos",), ("int32",), per_sequence=False, optional=True,
        doc="positions of the queries whose rows attn_rows keeps, ascending",
    ),
}

COORDS = ("layer", "head", "kv_head", "pos", "head_kv", "window", "recent")
# Arrays carrying one shard per sequence; `complete` is the commit flag written after them.
SEQUENCE_ARRAYS = tuple(
    n for n, v in RUN_VARIABLES.items() if v.per_sequence and n != "complete"
)


@dataclass(frozen=True)
class RunLayout:
    """Shape of one run: the model's attention geometry and the context length."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    length: int
    head_kv: tuple[int, ...]
    window: tuple[int, ...]
    attendable: tuple[tuple[bool, ...], ...] = field(repr=False)
    # float32, float16, or bfloat16 (stored as VALUE_ENCODINGS names).
    values_dtype: str = "float32"
    store_rows: str = "last"
    # Positions of the queries whose rows attn_rows keeps, ascending; () keeps none.
    queries: tuple[int, ...] = ()
    # The model's own indices of the stored layers (a hybrid's softmax-attention layers only);
    # () for 0..n_layers-1.
    layers: tuple[int, ...] = ()
    # Whether the model's heads have learned sinks (learned_sink_attn holds their weights).
    learned_sinks: bool = False
    # Each stored layer's own kv heads and value head dim where they differ between layers
    # (docs/store.md#layers-of-different-widths); () when every layer has n_kv_heads and head_dim.
    layer_kv_heads: tuple[int, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    # The FIELD_SUMMARIES a run migrated from an earlier format lacks (the model is needed to
    # compute them); () for a run extracted with them.
    lacking: tuple[str, ...] = ()

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """The model's own index of each stored layer, the ``layer`` coordinate."""
        return self.layers or tuple(range(self.n_layers))

    @property
    def winner_dtype(self) -> str:
        return "int16" if self.length <= np.iinfo(np.int16).max else "int32"

    def shape(self, name: str, n_seq: int) -> tuple[int, ...]:
        sizes = {
            "seq": n_seq,
            "layer": self.n_layers,
            "head": self.n_heads,
            "kv_head": self.n_kv_heads,
            "pos": self.length,
            "key": self.length,
            "query": self.length,
            "query_pos": len(self.queries),
            "head_dim": self.head_dim,
            "recent": len(RECENT_WINDOWS),
        }
        return tuple(sizes[d] for d in RUN_VARIABLES[name].dims)

    def dtype(self, name: str) -> str:
        if name == "values":
            return VALUE_ENCODINGS.get(self.values_dtype, self.values_dtype)
        if name == "winner":
            return self.winner_dtype
        return RUN_VARIABLES[name].dtypes[0]

    def names(self) -> list[str]:
        lacking = {*self.lacking, *(("recent",) if "recent_attn" in self.lacking else ())}
        return [
            n
            for n, v in RUN_VARIABLES.items()
            if (not v.optional
                or (n == "attn" and self.store_rows == "all")
                or (n in ("attn_rows", "query_pos") and self.queries)
                or (n == "learned_sink_attn" and self.learned_sinks))
            and n not in lacking
        ]


def query_attendable(attendable: np.ndarray, q: int) -> np.ndarray:
    """The keys 0..q query ``q`` may attend (q+1,) bool, from the final query's mask
    ``attendable`` (L,): the mask moves with its query, so it is the mask's last q+1 keys
    (every key 0..q under causal attention, the last ``window`` of them in a sliding-window
    layer); at q = L-1 it is ``attendable`` itself (docs/method.md#any-query)."""
    return np.asarray(attendable[attendable.shape[-1] - 1 - q :], dtype=bool)


def label_codes(values: np.ndarray, order: tuple[str, ...] = ()) -> tuple[list[str], np.ndarray]:
    """The labels of a string array, ``order`` first (every one of them, held or not), then
    the others in order of first appearance, and its codes (int64, same shape):
    ``values == labels[codes]``, code ``-1`` where a value is no string (None)."""
    import pandas as pd

    # Distinct values by a hash table in C (a dict filled value by value took 0.3 s of an
    # analyze); only those few are then decoded, merged and checked for being strings.
    codes, uniques = pd.factorize(values.ravel(), use_na_sentinel=True)
    labels = {label: i for i, label in enumerate(order)}
    label_of = [labels.setdefault(u, len(labels)) if isinstance(u, str) else -1
                for u in (u.decode() if isinstance(u, bytes) else u for u in uniques)]
    return list(labels), np.asarray([*label_of, -1], dtype=np.int64)[codes].reshape(values.shape)


def label_dtype(n_labels: int) -> str:
    """The smallest signed integer type holding codes -1..n_labels-1."""
    for dtype in ("int8", "int16", "int32"):
        if n_labels <= np.iinfo(dtype).max:
            return dtype
    return "int64"
