"""``attngeom demo``: the pipeline end to end on the offline default model and corpus."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import numpy as np

from attngeom import api
from attngeom.errors import DamagedStoreError, InputError, StoreError

DEMO_MODEL = "gemma3-270m"
DEMO_DATASET = "wiki-summaries"
# The demo's ablation: every single head on one sequence, and a sweep of two retentions with
# two random masks each on another, so that it shows every table and figure in a fraction of
# the full ablation's time (the ablate command's defaults: every committed sequence, five
# retentions, ten random masks). Its single heads are most of its cost: a forward per layer.
DEMO_RETENTION = (1.0, 0.5)
DEMO_RANDOM_MASKS = 2
DEMO_ABLATION_SEQUENCES = 2


def store_summary(store: str, run_id: str) -> str:
    """A few lines describing a run: shape, bytes, and where the final query looks."""
    from attngeom.store import SEQUENCE_ARRAYS
    from attngeom.store.session import StoreSession

    with StoreSession(store) as session:
        run = session.reader(run_id, check="arrays")
        ds = run.dataset()
        arrays = [run.array(n) for n in SEQUENCE_ARRAYS if run.has(n)]
    done = ds["seq"].values
    stored = sum(arr.nbytes_stored() for arr in arrays)
    raw = sum(arr.nbytes * len(done) // max(1, arr.shape[0]) for arr in arrays)
    winner = ds["winner"].isel(query=slice(1, None)).values
    query = np.arange(1, winner.shape[-1] + 1)
    diag = (winner == query).mean()
    sink = (winner == 0).mean()
    sink_last = float(ds["attn_last"].isel(key=0).mean())
    lines = [
        f"run {run_id}: {len(done)} sequences x {ds.sizes['layer']} layers x {ds.sizes['head']} heads "
        f"({ds.sizes['kv_head']} kv heads) at L={ds.sizes['pos']}",
        f"store: {stored / 2**20:.2f} MiB on disk for {raw / 2**20:.2f} MiB of arrays "
        f"(compression {raw / max(stored, 1):.1f}x)",
        f"source winners j* over all queries i>0: diagonal {diag:.1%}, sink {sink:.1%}, other {1 - diag - sink:.1%}",
        f"final query's mean attention on the sink (BOS): {sink_last:.3f}",
    ]
    return "\n".join(lines)


def analysis_table(store: str, run_id: str) -> str:
    """F_N of top-N against random-N, median lambda, and violation counts of the two bounds."""
    run = api.open_store(store).run(run_id)
    topn = run.analysis("topn").load()
    values = run.analysis("values").load()
    defined = topn["k_sink"] >= 0
    lines = [f"{'N':>5} {'F_N top-N':>10} {'F_N random':>11} {'bound viol.':>12} {'certif. viol.':>14}"]
    for n in topn["n"].values:
        t = topn.sel(n=n)
        paper = int(((t["inversions"] > t["k_sink"]) & defined.sel(n=n)).sum())
        exact = int(((t["inversions"] > t["k_sink_exact"]) & (t["k_sink_exact"] >= 0)).sum())
        instances = int(defined.sel(n=n).sum())
        lines.append(
            f"{n:>5} {float(t['f_score'].mean()):>10.3f} {float(t['random_f_score'].mean()):>11.3f} "
            f"{paper:>6}/{instances:<5} {exact:>8}/{instances:<5}"
        )
    lam = float(values["sink_norm_ratio"].median())
    lines.append(f"median sink norm ratio lambda = ||v_0||/C: {lam:.3f}")
    return "\n".join(lines)


class _Clock:
    """Each step's seconds, said when it ends, and the total."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        self.steps[name] = time.perf_counter() - began
        click.echo(f"{name}: {self.steps[name]:.1f} s")

    def total(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.steps.items())
        return f"demo: {time.perf_counter() - self.start:.1f} s in all ({parts})"


def _ablated_already(store: str, run_id: str, sequences: int) -> bool:
    """Whether the run's committed ablation is the demo's, over its ``sequences`` first sequences."""
    try:
        attrs = api.open_store(store).run(run_id).ablation("sweep").attrs.get("attngeom", {})
    except StoreError:  # none yet, or damaged or unfinished: ablate (again)
        return False
    used = sorted(attrs.get("importance_sequences", []) + attrs.get("evaluation_sequences", []))
    return (attrs.get("retention") == list(DEMO_RETENTION) and attrs.get("random_masks") == DEMO_RANDOM_MASKS
            and attrs.get("seed") == 0 and used == list(range(min(sequences, DEMO_ABLATION_SEQUENCES))))


def run_demo(out: Path, *, num_sequences: int, context_length: int) -> None:
    """Extract a few sequences of gemma3-270m on wiki-summaries, validate, analyze, ablate
    and write the report, saying each step's time and the total. A rerun says which steps
    had nothing to do."""
    if num_sequences < 2:
        raise InputError(f"the demo needs at least 2 sequences (got -S {num_sequences}): analyze compares sequences")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out} cannot be made a folder ({exc.strerror or exc})") from exc
    store = str(out / "store.zarr")
    clock = _Clock()
    click.echo(f"extract: {DEMO_MODEL} on {DEMO_DATASET}, L={context_length}, {num_sequences} sequences -> {store}")
    with clock.step("extract"):
        result = api.extract(
            DEMO_MODEL, dataset=DEMO_DATASET, context_length=context_length, num_sequences=num_sequences, store=store
        )
        if result.written == 0:
            click.echo(f"extract: nothing to do, {result.committed} sequences already in {store}")
    with clock.step("validate"):
        validation = api.validate(store)
        if not validation.valid:
            raise DamagedStoreError("the demo store is invalid: " + "; ".join(validation.problems))
        click.echo(f"validate: {store} is valid")
    click.echo(store_summary(store, result.run_id))
    click.echo("analyze: out of core with Dask, every head at the final query")
    with clock.step("analyze"):
        analyzed = api.analyze(store, run_id=result.run_id, out=out / "tables")
        unchanged = analyzed.new_sequences == 0 and not analyzed.recomputed and not analyzed.healed
        if unchanged:
            click.echo(f"analyze: nothing to do, the {analyzed.sequences} sequences of run {result.run_id} "
                       "are analyzed already")
    click.echo(analysis_table(store, result.run_id))
    click.echo(f"ablate: single-head ablation on sequence 0 and a sparsification sweep on sequence 1 at "
               f"retention {', '.join(map(str, DEMO_RETENTION))} ({DEMO_RANDOM_MASKS} random masks each; the ablate "
               "command takes every sequence and sweeps five retentions), decode NLL on CPU")
    with clock.step("ablate"):
        if unchanged and _ablated_already(store, result.run_id, result.committed):
            click.echo(f"ablate: nothing to do, run {result.run_id} is ablated already")
            single = api.open_store(store).run(result.run_id).ablation("single").load()
        else:
            single = api.ablate(store, result.run_id, device="cpu", retention=DEMO_RETENTION,
                                random_masks=DEMO_RANDOM_MASKS, max_sequences=DEMO_ABLATION_SEQUENCES,
                                out=out / "tables").single
    impact = single["delta_nll_mean"]
    top = impact.argmax(...)
    click.echo(
        f"largest single-head impact: layer {int(top['layer'])} head {int(top['head'])}, "
        f"delta NLL {float(impact.max()):+.3f} nats (mean over heads {float(impact.mean()):+.4f})"
    )
    with clock.step("report"):
        report = api.report(store, out / "report")
        click.echo(f"report: {report.index}")
    click.echo(clock.total())
