"""Figures of the attention sink: its norm ratio and direction, its effect on F_N, and the
appendix's sink diagnostics against N."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from matplotlib.figure import Figure

from attngeom.report.data import RunData, all_of, has_learned_sinks, requires
from attngeom.report.plots import UNIT, BoxPanel, Line, Panel, boxes_figure, curves_figure
from attngeom.report.spec import FigureSpec

SECTION = "Attention sink geometry"
DIAGNOSTICS = "Sink diagnostics"


def sink_norm_ratio(runs: Sequence[RunData]) -> Figure:
    """lambda = ||v_0|| / C across (layer, head), per run."""
    return boxes_figure(runs, (
        BoxPanel("(a) sink-to-median value norm ratio", r"$\lambda = \|v_0\| / C$",
                 ("sink_norm_ratio",), hline=1.0),
    ))


def sink_cosines(runs: Sequence[RunData]) -> Figure:
    """Median non-sink pairwise cosine against median sink–non-sink cosine, per head."""
    return boxes_figure(runs, (
        BoxPanel("(b) value directions", "median cosine per head",
                 ("median_cos", "sink_cos_median"),
                 (r"non-sink pairs $\langle u_p, u_q\rangle$", r"sink–non-sink $\langle u_0, u_k\rangle$"),
                 hline=0.0),
    ))


def sink_exclusion(runs: Sequence[RunData]) -> Figure:
    """F_N with the sink among the candidates (solid) and with it removed (dashed)."""
    return curves_figure(runs, (
        Panel("(c) separability with and without the sink", r"$F_N$",
              (Line("f_score", "-", "with sink"), Line("nosink_f_score", "--", "sink removed")),
              ylim=UNIT),
    ))


def _diagnostic(title: str, ylabel: str, *lines: Line, hline: float | None = None,
                unit: bool = False) -> Callable[[Sequence[RunData]], Figure]:
    """A one-panel figure of summary curves against N."""
    panel = Panel(title, ylabel, lines, hline=hline, ylim=UNIT if unit else None)

    def draw(runs: Sequence[RunData]) -> Figure:
        return curves_figure(runs, (panel,))

    return draw


selection_rate = _diagnostic("sink selection rate", r"$\Pr(0 \in I_N)$", Line("sink_selected"), unit=True)
two_selection_rates = _diagnostic(
    "selection rate of the two sinks", r"$\Pr(\mathrm{sink} \in I_N)$",
    Line("sink_selected", "-", "key 0 (BOS)"), Line("learned_sink_selected", "--", "learned sink"), unit=True)


conditioned = _diagnostic(
    "separability conditioned on sink selection", r"$F_N$",
    Line("f_score_sink_selected", "-", r"sink selected ($0 \in I_N$)"),
    Line("f_score_sink_unselected", "--", r"sink not selected"), unit=True,
)
norm_share = _diagnostic("sink contribution magnitude (sink selected)", r"$\|y_0\| / \|s_N\|$",
                         Line("sink_norm_share"))
direction_change = _diagnostic("aggregate direction change without the sink (sink selected)",
                               r"$1 - \cos(s_N, s_N - y_0)$", Line("sink_direction_change"))
intrusion = _diagnostic("unselected sink intrusion rate", r"$\Pr(D_0 \leq r_{\max}^2)$",
                        Line("sink_intrusion"), unit=True)
pair_inversions = _diagnostic("sink-related pair inversions (sink not selected)",
                              r"$\frac{1}{N}\sum_{i \in I_N} 1\{D_0 \leq D_i\}$",
                              Line("sink_pair_inversion_frac"), unit=True)
alignment = _diagnostic("sink alignment with the selected non-sink aggregate", r"$\cos(y_0, s_{N,+})$",
                        Line("sink_alignment"), hline=0.0)

FIGURES = (
    FigureSpec("sink_norm_ratio", SECTION,
               "Sink-to-median value-norm ratio λ = ||v_0||/C across layer–head pairs (mean over sequences).",
               sink_norm_ratio, requires("heads", "sink_norm_ratio")),
    FigureSpec("sink_cosines", SECTION,
               "Median cosine between non-sink value directions vs between the sink and non-sink "
               "directions, across layer–head pairs.",
               sink_cosines, requires("heads", "median_cos", "sink_cos_median")),
    FigureSpec("sink_exclusion", SECTION,
               "F_N of top-N selection with the sink among the candidates (solid) and with it removed (dashed).",
               sink_exclusion, requires("summary", "f_score", "nosink_f_score")),
    FigureSpec("sink_selection_rate", DIAGNOSTICS,
               "How often the sink is among the top-N keys.", selection_rate,
               requires("summary", "sink_selected")),
    FigureSpec("learned_sink_selection_rate", DIAGNOSTICS,
               "For a model with learned sinks: how often each of the two sinks, key 0 and the learned sink (a "
               "virtual key with a zero value), is among the top-N keys.", two_selection_rates,
               all_of(has_learned_sinks, requires("summary", "sink_selected", "learned_sink_selected"))),
    FigureSpec("sink_conditioned_f", DIAGNOSTICS,
               "F_N conditioned on whether the sink is selected (groups are not matched).", conditioned,
               requires("summary", "f_score_sink_selected", "f_score_sink_unselected")),
    FigureSpec("sink_norm_share", DIAGNOSTICS,
               "Share of the aggregate carried by a selected sink, ||y_0||/||s_N||.", norm_share,
               requires("summary", "sink_norm_share")),
    FigureSpec("sink_direction_change", DIAGNOSTICS,
               "Direction change of the aggregate when a selected sink is removed, 1 − cos(s_N, s_N − y_0).",
               direction_change, requires("summary", "sink_direction_change")),
    FigureSpec("sink_intrusion", DIAGNOSTICS,
               "Probability that an unselected sink lies in the selected ball, D_0 ≤ r_max².", intrusion,
               requires("summary", "sink_intrusion")),
    FigureSpec("sink_pair_inversions", DIAGNOSTICS,
               "Fraction of selected tokens farther from s_N than the unselected sink.", pair_inversions,
               requires("summary", "sink_pair_inversion_frac")),
    FigureSpec("sink_alignment", DIAGNOSTICS,
               "Alignment of the sink contribution with the selected non-sink aggregate, cos(y_0, s_{N,+}).",
               alignment, requires("summary", "sink_alignment")),
)
