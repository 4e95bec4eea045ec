"""The report's sentences on where the field's head classes and the paper's regimes agree and
where they do not, computed from each run's heads (docs/method.md#field-classes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attngeom.detect.head_classes import CRITERIA, DETECT, DETECT_GROUP, Criterion, class_counts, regimes_of, run_scores
from attngeom.report.data import RunData, has_field_scores
from attngeom.report.spec import TextSpec
from attngeom.store.objects.commands import stage_command
from attngeom.store import REGIMES

SECTION = "Heads of the field"


def plural(name: str) -> str:
    """"sink head" -> "sink heads", "previous-token head (probe)" -> "previous-token heads (probe)"."""
    return name.replace(" head", " heads", 1)


def _a(name: str) -> str:
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _not(k: int, of: int, who: str, what: str) -> str:
    """"1 of the 5 Mixer heads is not a sink head", "2 of the 5 ... are not sink heads"."""
    return f"{k} of the {of} {who} " + (f"is not {_a(what)}" if k == 1 else f"are not {plural(what)}")


def _heads(n: int) -> str:
    return f"{n} head" if n == 1 else f"{n} heads"


def class_sentences(criterion: Criterion, regimes: np.ndarray, values: np.ndarray) -> list[str]:
    """What ``criterion`` makes of heads with regimes ``regimes`` and scores ``values`` (both
    flat, one entry per head): how many heads are of the class and of which regimes, which
    regime has none of them, and, for a class with a counterpart regime, the heads on which
    the two agree and those on which they differ."""
    total = regimes.size
    name, names = criterion.name, plural(criterion.name)
    if not np.isfinite(values).any():
        return [f"{criterion.score} is undefined for every head (distant mass at window W needs L > 2W): "
                f"{names} cannot be told at this L."]
    passes = criterion.passes(values)
    n = int(passes.sum())
    counts = class_counts(regimes, passes)
    sizes = {r: int(np.sum(regimes == r)) for r in REGIMES}
    regime = criterion.regime
    if n == 0:
        beside = f"; none of the {sizes[regime]} {regime} heads is one" if regime and sizes[regime] else ""
        return [f"No head is {_a(name)} ({criterion.rule}){beside}."]
    ranked = sorted(REGIMES, key=lambda r: -counts[r])
    top = ranked[0]
    rest = ", ".join(f"{counts[r]} {r}" for r in ranked[1:])
    said = [f"{n} of {total} heads are {names} ({criterion.rule}); {100.0 * counts[top] / n:.0f}% of them "
            f"({counts[top]}) are {top} heads, {rest}."]
    absent = [r for r in REGIMES if counts[r] == 0 and sizes[r] > 0]
    if absent:
        said.append(" ".join(f"No {r} head is {_a(name)}." for r in absent))
    if regime is not None and sizes[regime] == 0:
        said.append(f"The run has no {regime} head to read beside its {names}.")
    elif regime is not None:
        both = counts[regime]
        only_regime, only_class = sizes[regime] - both, n - both
        verdict = "agree on every head" if only_regime + only_class == 0 else (
            f"agree on {_heads(both)} and differ on {only_regime + only_class}: "
            f"{_not(only_regime, sizes[regime], f'{regime} heads', name)}, "
            f"{_not(only_class, n, names, f'{regime} head')}")
        said.append(f"{regime} heads and {names} {verdict}.")
    return said


def agreement(runs: Sequence[RunData]) -> list[str]:
    """Per run, its name once, then: for each field class whose score the run has,
    :func:`class_sentences`; and what cannot be compared, and why, for a group the run lacks."""
    lines = []
    for run in runs:
        assert run.heads is not None
        lines.append(f"Run {run.run_id} ({run.model}, {run.dataset}, L={run.context_length}):")
        regimes = regimes_of(run.heads).ravel()
        scores = run_scores(run.head_scores, run.detect)
        if run.head_scores is None:
            lines.append(f"Sink, previous-token and streaming heads are not compared: {run.no_head_scores}.")
        if run.detect is None:
            lines.append(f"Duplicate-token, induction and retrieval heads are not compared: no "
                         f"{DETECT}/{DETECT_GROUP} (run `{stage_command('detect', run.url, run.run_id)}`).")
        for criterion in CRITERIA:
            if criterion.score in scores:
                values = scores[criterion.score].values.ravel()
                lines += class_sentences(criterion, regimes, values)
    return lines


TEXTS = (
    TextSpec("field_agreement", SECTION,
             "Where the field's classes and the paper's regimes agree and where they do not, computed from "
             "each run's heads; a class is read beside its counterpart regime: sink heads beside Mixers (the "
             "sink wins their vote), previous-token heads beside Resets (the previous token is an Other "
             "winner), induction and retrieval heads beside Retrievers.",
             agreement, has_field_scores()),
)
