"""The ``attngeom`` command line (docs/cli.md). Thin: each command parses, calls its function of
the Python API (:mod:`attngeom.api`, same defaults and errors), and reports."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import click

from attngeom.version import __version__
from attngeom.ablate.request import AblateRequest
from attngeom.detect.request import DetectRequest
from attngeom.errors import AttngeomError, AttngeomWarning
from attngeom.extract.request import ExtractRequest
from attngeom.library_logs import library_warnings
from attngeom.options import accepts, flag, request_field

# The process ends with its command: Python's last collection at exit would walk every object
# of the libraries the command loaded (0.5-0.9 s of CPU time after those of an analyze, a tenth
# of an incremental one of smollm2-135m at L = 256), and nothing attngeom leaves needs it (its
# files are closed where they are written, its locks and leases released by their commands).
atexit.register(gc.freeze)

# What to do after Ctrl-C, by command: each is safe to interrupt and to run again.
RESUME = {
    "extract": "committed sequences are kept; run the same command again to write the rest",
    "analyze": "nothing of the store is lost; run the same command again to finish the analysis",
    "ablate": "nothing of the store is lost; run the same command again to finish the ablation",
    "detect": "nothing of the store is lost; run the same command again to finish the head scores",
    "migrate": "the store is refused until its migration ends; run the same command again to finish it",
}


class _Group(click.Group):
    """Lists its commands in pipeline order. Turns :class:`AttngeomError` and a command's bad
    arguments into one line on stderr and exit code 2, and Ctrl-C into one line saying how
    to finish, exit code 130."""

    def invoke(self, ctx: click.Context):
        shown = warnings.showwarning
        said: set[str] = set()

        def say(text: str) -> None:
            if text not in said:
                said.add(text)
                click.echo(f"attngeom: warning: {text}", err=True)

        def one_line(message, category, filename, lineno, file=None, line=None):
            # Python's form adds the file, line and source of the call: noise to a user. A
            # library's warning names the library; each is said once.
            text = " ".join(str(message).split()) or category.__name__
            say(text if issubclass(category, AttngeomWarning) else f"{_library(filename)}: {text}")

        warnings.showwarning = one_line
        try:
            with library_warnings(say):
                return super().invoke(ctx)
        except AttngeomError as exc:
            click.echo(f"attngeom: error: {exc.command_line or exc}", err=True)
            sys.exit(2)
        except click.UsageError as exc:
            # click's own form takes three lines: the usage, a hint, then the error.
            where = " ".join(["attngeom", *filter(None, [ctx.invoked_subcommand])])
            click.echo(f"attngeom: error: {exc.format_message()} (see `{where} --help`)", err=True)
            sys.exit(2)
        except Exception as exc:
            # A failure of the network met outside the API's own translation (a library's
            # thread, a read deep in Dask): the same one line.
            from attngeom.store.objects.network import unreachable

            error = unreachable(ctx.meta.get(_STORE, "at the URL given"), exc)
            if error is None:
                raise
            click.echo(f"attngeom: error: {error}", err=True)
            sys.exit(2)
        except (KeyboardInterrupt, click.exceptions.Abort):
            how = RESUME.get(ctx.invoked_subcommand or "", "run the same command again")
            click.echo(f"attngeom: interrupted; {how}", err=True)
            sys.exit(130)
        finally:
            warnings.showwarning = shown

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="attngeom")
def main() -> None:
    """Geometric analysis of token selection in multi-head attention.

    extract runs the model once into a Zarr store. analyze, taxonomy, report, explore,
    validate and migrate read the store and need no model; ablate and detect load the run's
    model again; demo runs extract, validate, analyze, ablate and report on the offline default
    model. Mistakes in the arguments, names or store are answered before any model loads.
    """


def _library(filename: str) -> str:
    """The package a warning was raised in, from its file's path (site-packages/<name>/...)."""
    parts = Path(filename).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1].removesuffix(".py")
    return Path(filename).stem


def _shard(ctx, param, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        index, count = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter("i/n, e.g. 0/2") from None
    if count < 1:
        raise click.BadParameter(f"{value}: the count of shards n must be at least 1, e.g. 0/2")
    if not 0 <= index < count:
        raise click.BadParameter(f"{value}: the index i must be in 0..{count - 1}")
    return index, count


def _token_ids(ctx, param, value: str | None) -> Any:
    """The integer array of a .npy file, mapped (its rows are read as they are used)."""
    if value is None:
        return None
    import numpy as np

    try:
        return np.load(value, mmap_mode="r", allow_pickle=False)
    except OSError as exc:
        raise click.BadParameter(f"{value} cannot be read ({exc.strerror or exc})") from None
    except ValueError:  # numpy's reason for a file of another format speaks of pickles
        raise click.BadParameter(f"{value} is not an array saved by numpy.save (.npy)") from None


def _comma_list(convert, expected: str):
    """A click callback parsing "a,b,c" with ``convert``; ``expected`` is said on error."""

    def parse(ctx, param, value: str | None) -> list | None:
        if value is None:
            return None
        items = [x.strip() for x in value.split(",")]
        if not all(items):
            raise click.BadParameter(f"{value!r} has an empty entry; {expected}")
        try:
            return [convert(x) for x in items]
        except ValueError:
            raise click.BadParameter(f"{value!r}: {expected}") from None

    return parse


def _option(request: type, name: str, *short: str, **kwargs: Any) -> Callable[[Callable], Callable]:
    """The click option of the option ``name`` of ``request`` (a request dataclass): its flag,
    default (shown in --help) and type or choices are the field's (:mod:`attngeom.options`);
    ``short`` flags and the ``help`` text are the command line's own. A default a click option
    cannot take (a tuple) is shown, and left to the request: the command passes it no value."""
    field = request_field(request, name)
    said = accepts(field)
    if "type" not in kwargs and "callback" not in kwargs:
        if said.choices:
            kwargs["type"] = click.Choice(said.choices)
        elif said.least is not None:
            kwargs["type"] = click.IntRange(said.least)
        elif isinstance(field.default, int | float) and not isinstance(field.default, bool):
            kwargs["type"] = type(field.default)
    if isinstance(field.default, tuple):
        shown = ",".join(map(str, field.default))
        kwargs["help"] = f"{kwargs['help']}  [default: {shown}]"
    elif field.default is not None and field.default is not MISSING:
        kwargs.update(default=field.default, show_default=True)
    return click.option(*short, flag(field), name, **kwargs)


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options given on the command line: those left out take the request's defaults."""
    return {name: value for name, value in options.items() if value is not None}


# Where the command's --store is kept for the group's error lines (the contexts share ``meta``).
_STORE = "attngeom.store"


def _noted_store(ctx: click.Context, _: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        ctx.meta[_STORE] = value
    return value


STORE = click.option("--store", required=True, callback=_noted_store,
                     help="Store: a local path or an fsspec URL (s3://, memory://, file://).")
DEVICE_HELP = "auto, cpu, cuda or cuda:N."
DEVICE_MAP_HELP = ("Place a model larger than one device over the GPUs, the CPU and the disk: auto (or balanced, "
                   "balanced_low_0, sequential), or a JSON object of module names to devices, e.g. "
                   "'{\"model.layers.0\": 0, \"model.layers.1\": \"disk\"}'.")
TOKENIZER_HELP = ("A tokenizer for a model folder saved without one: a name or folder, as --model takes them "
                  "(a folder need hold only the tokenizer's files)")
MODEL_NOW = click.option("--model", help="Where the run's model is now, if not where extract found it: a name, .gguf file, folder or hub id; checked against the run's architecture, shapes and weights [default: the run's recorded model].")


@main.command(short_help="Run the model once; write attention rows, values and per-query summaries into a Zarr store (GPU where there is one).")
@click.option("--model", required=True, help="Offline name (gemma3-270m, smollm2-135m), hub id, local folder or .gguf file.")
@click.option("--dataset", help="wiki-summaries, python-docs, wikitext-103, openwebtext, a datasets name, or a local .txt/.jsonl/.parquet file or folder (or give --token-ids).")
@click.option("--token-ids", type=click.Path(exists=True, dir_okay=False), callback=_token_ids, help="Instead of --dataset: a .npy file of integer token ids (S, L), each row starting with the BOS, used as given; needs no tokenizer.")
@_option(ExtractRequest, "context_length", "-L", help="L: BOS plus L-1 tokens of one document; at most the model's positions (8192 for smollm2-135m). Needed with --dataset; token ids have theirs.")
@_option(ExtractRequest, "num_sequences", "-S", help="Sequences wanted in the run; a larger number later appends. Needed with --dataset [default with --token-ids: every row].")
@STORE
@_option(ExtractRequest, "run_id", help="Run id inside the store [default: <model>__<dataset>__L<L>].")
@_option(ExtractRequest, "split", help="Dataset split, for hub datasets.")
@_option(ExtractRequest, "text_field", help="Text field of .jsonl/.parquet/hub rows.")
@_option(ExtractRequest, "device", help=DEVICE_HELP)
@_option(ExtractRequest, "device_map", help=DEVICE_MAP_HELP)
@_option(ExtractRequest, "dtype", help="Compute dtype; auto is float32 on every device (bfloat16 moves results; float32-tf32: float32 matmuls in TF32 on a GPU: see README).")
@_option(ExtractRequest, "batch_size", help="Sequences per forward pass.")
@_option(ExtractRequest, "store_rows", help="'all' also keeps every full attention row (float16), for small studies.")
@_option(ExtractRequest, "queries", help="Queries whose attention rows are kept (attn_rows) for analysis/topn_by_query: last (attn_last only), every:K (L-1, L-1-K, ... down to 1) or positions P1,P2,... in 1..L-1.")
@_option(ExtractRequest, "values_dtype", help="Storage dtype of the value vectors; auto is bfloat16 (2 bytes, exact) for a bfloat16 model, float32 otherwise, and what a resumed run holds; float16 halves the store, rounding.")
@_option(ExtractRequest, "window_rule", help="Which window of each document: the first, or a seeded random offset.")
@_option(ExtractRequest, "seed", help="Seed of the random window rule.")
@_option(ExtractRequest, "tokenizer", help=TOKENIZER_HELP + " [default: the model's own].")
@_option(ExtractRequest, "bos_token", help="Token to use as BOS instead of the tokenizer's (else the model config's bos_token_id).")
@_option(ExtractRequest, "shard", callback=_shard, help="i/n: write only sequences s with s % n == i, so n processes fill one run together [default: RANK/WORLD_SIZE under torchrun or accelerate].")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def extract(**kwargs) -> None:
    """Run the model once over equalized single-document windows into the store.

    Loads the model (the first use of an offline name converts it once into
    ~/.cache/attngeom). Arguments, model and dataset names, L against the model's
    positions and a rerun's parameters against the stored run are checked first, before
    the model loads. Resumable: a run killed at any point and started again with the same
    command finishes with every sequence exactly once; a run that already holds every
    sequence asked for is answered from the store. Sequences become visible to readers
    only when all of their arrays are written.

    The input is --dataset, windowed with the model's tokenizer (--tokenizer for a model
    folder saved without one), or --token-ids: a .npy file of an integer array (S, L)
    (numpy.save), used as given, every row starting with the BOS (the tokenizer's, else the
    config's bos_token_id, else the token every row starts with, said in a warning); it
    needs no tokenizer.

    \b
    Examples:
      attngeom extract --model gemma3-270m --dataset wiki-summaries -L 128 -S 64 --store runs.zarr
      attngeom extract --model ./my-checkpoint --token-ids ids.npy --store runs.zarr
    """
    from attngeom import api

    progress = not kwargs.pop("no_progress")
    result = api.extract(kwargs.pop("model"), **_given(kwargs), progress=progress)
    click.echo(
        f"run {result.run_id}: wrote {result.written} sequences in {result.seconds:.1f} s; the run holds "
        f"{result.committed} committed of {result.total}"
    )


@main.command("check-model", short_help="Check that extract's capture reproduces a model's own eager attention (needs the model).")
@click.argument("model")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True, help="Dtype the model is loaded in; the comparison is float32 in any case.")
@click.option("--length", "-L", type=click.IntRange(2), default=64, show_default=True, help="Positions of the seeded random input (BOS first).")
def check_model(model: str, device: str, dtype: str, length: int) -> None:
    """Check that extract's capture reproduces MODEL's own eager attention.

    MODEL is a name or path as extract takes it. One forward of BOS and L-1 seeded random
    tokens; at a few queries, each attention layer's captured rows and output are compared
    with the model's eager attention in float32 (rows within 1e-4). Prints one verdict per
    layer kind; exits 1 when any layer disagrees, 2 when the model cannot be captured at all.
    extract runs the same check by itself before writing a model of a family attngeom's
    tests do not cover.
    """
    from attngeom import api

    result = api.check_model(model, device=device, dtype=dtype, length=length)
    for line in result.verdicts():
        click.echo(f"{result.model_type}: {line}")
    if not result.agrees:
        sys.exit(1)


@main.command(short_help="Compute the paper's geometry from the store, out of core (Dask).")
@STORE
@click.option("--run", "run_id", help="Analyze only this run [default: every run].")
@click.option("--scheduler", help="'threads' for this process alone, 'processes' for a dask.distributed LocalCluster, or the address of an existing Dask scheduler (tcp://host:8786) [default: one worker process per core, forked from this one; threads where processes cannot be forked].")
@click.option("--n-grid", callback=_comma_list(int, "a comma-separated list of integers, e.g. 1,2,4,8"), help="Selection sizes N [default: 1,2,4,... < L].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Also write the tidy tables here (Parquet and CSV).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random-N control.")
@click.option("--deep", is_flag=True, help="Also decode every object of the committed analysis (checksums) and rewrite a damaged one; without it, lost or resized objects are rewritten.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def analyze(store: str, run_id: str | None, scheduler: str | None, n_grid, out: Path | None, seed: int, deep: bool,
            no_progress: bool) -> None:
    """Compute every quantity of docs/method.md from the store, out of core, without the model.

    Writes runs/<id>/analysis/{topn,values,taxonomy,heads,summary,signatures,table,
    sequence_scores,head_scores} into the store (and topn_by_query, summary_by_query for a
    run extracted with --queries);
    only committed sequences are read. Incremental: a rerun with the same
    parameters (n grid, seed) computes only the sequences not analyzed yet, then the groups
    across sequences; other parameters recompute everything (the output says why), and the
    earlier analysis stays readable until the new one is complete. Safe to kill: the same
    command resumes where it stopped. A damaged committed analysis is written again; two
    analyzes of one run on a local store run one after the other.
    """
    from attngeom import api

    results = api.analyze(store, run_id=run_id, scheduler=scheduler, n_grid=n_grid, out=out, seed=seed,
                          progress=not no_progress, deep=deep)
    for r in [results] if run_id is not None else results:
        click.echo(f"run {r.run_id}: {r.new_sequences} new sequences ({r.sequences} analyzed), "
                   f"{r.instances} head instances in {r.seconds:.1f} s")
        if r.recomputed:
            click.echo(f"run {r.run_id}: recomputed every sequence: {r.recomputed}")
        if r.healed:
            click.echo(f"run {r.run_id}: rewrote the damaged analysis: {r.healed}")


@main.command(short_help="Print the Retriever / Mixer / Reset distribution of the heads; export every head's scores.")
@STORE
@click.option("--export", type=click.Path(path_type=Path), help="Also write every head's regime, signatures and field scores as one table: a .csv or .parquet file.")
@click.option("--export-kv", type=click.Path(path_type=Path), help="Also write one run's --score per layer and kv head, in [0, 1] (1 = keep the full KV cache), as DuoAttention's full_attention_heads.tsv.")
@click.option("--score", help="The score of --export-kv: distant_mass_w16, distant_mass_w64, distant_mass_w256, retrieval_score, induction_score or duplicate_score.")
@click.option("--run", "run_id", help="The run of --export-kv [default: the store's only run].")
def taxonomy(store: str, export: Path | None, export_kv: Path | None, score: str | None, run_id: str | None) -> None:
    """Print the head-regime distribution (Retriever / Mixer / Reset) of every analyzed run,
    and for runs of one model on two corpora the per-regime difference and label agreement.

    With --export, also write every head (run, layer, head, kv head, regime, signatures,
    the field's scores and classes) as one tidy table; with --export-kv, a run's chosen
    score per layer and kv head for KV-cache tools. Reads the analysis that analyze (and
    detect) wrote; needs no model."""
    from attngeom import api

    result = api.taxonomy(store, export=export, export_kv=export_kv, score=score, run_id=run_id)
    click.echo(str(result))
    if export_kv is not None:
        click.echo(f"wrote {export_kv}: {score} per layer and kv head")
    if export is not None:
        click.echo(f"wrote {export}: every head of {len(result.labels)} run(s)")


@main.command(short_help="Measure single-head ablation and head sparsification (needs the model).")
@STORE
@click.option("--run", "run_id", required=True, help="The run whose model and tokens to use.")
@MODEL_NOW
@_option(AblateRequest, "device", help=DEVICE_HELP)
@_option(AblateRequest, "device_map", help=DEVICE_MAP_HELP)
@_option(AblateRequest, "dtype", help="Compute dtype; auto is float32 on every device (bfloat16 moves results: see README); float32-tf32 is extract's alone.")
@click.option("--protect", default="", help="LAYER.HEAD pairs always kept and outside every ranking, e.g. 0.12,3.4.")
@click.option("--protect-critical", is_flag=True, help="Also hold the automatically found critical heads fixed.")
@_option(AblateRequest, "retention", callback=_comma_list(float, "comma-separated fractions, e.g. 1.0,0.75,0.5"), help="Fractions of heads kept per layer.")
@_option(AblateRequest, "random_masks", help="Seeded random masks per retention.")
@_option(AblateRequest, "seed", help="Seed of the random masks.")
@_option(AblateRequest, "max_sequences", help="Use only the first completed sequences.")
@_option(AblateRequest, "batch_size", help="(sequence, mask) rows per forward pass.")
@_option(AblateRequest, "out", type=click.Path(file_okay=False, path_type=Path), help="Also write the tables here (CSV).")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def ablate(store: str, run_id: str, protect: str, no_progress: bool, **kwargs) -> None:
    """Single-head ablation and head sparsification of a run (docs/method.md#ablation); needs the model.

    Loads the run's model again by its recorded name, or from --model where it is now,
    on --device. Options, the device and the model's architecture and shapes are checked
    first, in about a second, before torch loads. Prefills L-1 tokens of each stored
    sequence and scores the next one; heads are zeroed at the input of the output
    projection, many masks per batched forward. Writes
    runs/<id>/ablation/{single,sweep,correlations,critical,table,regimes}.
    """
    from attngeom import api
    from attngeom.ablate.request import parse_heads

    result = api.ablate(store, run_id, protect=parse_heads(protect), progress=not no_progress, **_given(kwargs))
    critical = result.critical
    click.echo(f"run {result.run_id}: ablation written in {result.seconds:.1f} s; "
               f"{critical.sizes.get('critical', 0)} critical head(s)")


@main.command(short_help="Score every head as the field's detectors do: induction, duplicate, previous-token, retrieval (needs the model).")
@STORE
@click.option("--run", "run_id", required=True, help="The run whose model and stored windows to use.")
@MODEL_NOW
@_option(DetectRequest, "tokenizer", help=TOKENIZER_HELP + "; its vocabulary, without special tokens, is the probes' [default: the run's; for a run extracted without one, the model's embedding rows without the config's special ids].")
@_option(DetectRequest, "device", help=DEVICE_HELP)
@_option(DetectRequest, "device_map", help=DEVICE_MAP_HELP)
@_option(DetectRequest, "dtype", help="Compute dtype of the model; auto is float32 on every device (attention rows are float32 in any case); float32-tf32 is extract's alone.")
@_option(DetectRequest, "probes", help="P: repeated random-token sequences [BOS] + r + r, r of k = min(128, (L-1)//2) tokens.")
@_option(DetectRequest, "needle_length", help="n: tokens of the retrieval needle, taken from another stored window (needs L >= 2n+2).")
@_option(DetectRequest, "haystacks", help="How many of the run's committed windows (the first ones) serve as haystacks.")
@_option(DetectRequest, "depths", callback=_comma_list(float, "comma-separated fractions, e.g. 0.1,0.5,0.9"), help="Depths of the inserted needle in each haystack.")
@_option(DetectRequest, "seed", help="Seed of the probe tokens and the needles.")
@_option(DetectRequest, "batch_size", help="Sequences per forward pass.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def detect(store: str, run_id: str, no_progress: bool, **kwargs) -> None:
    """The field's head scores of a run (docs/method.md#head-detectors); needs the model.

    Loads the run's model again by its recorded name, or from --model where it is now, on
    --device (options, the device and the model's shapes are checked first, before torch
    loads), and reads every head's attention from its own forward. Repeated random tokens
    give each head its duplicate_score, induction_score and prev_token_score; the run's own windows, with a
    needle from another window inserted at each depth and repeated at the end, its
    teacher-forced retrieval_score. Writes runs/<id>/detect/{scores,probes,retrieval}, the
    inputs included, so that every score can be recomputed. A rerun with the same options
    keeps the results; other options compute them again.

    \b
    Example:
      attngeom detect --store runs.zarr --run smollm2-135m__python-docs__L512
    """
    from attngeom import api

    result = api.detect(store, run_id, progress=not no_progress, **_given(kwargs))
    how = "kept (same parameters)" if result.kept else f"written in {result.seconds:.1f} s"
    click.echo(f"run {result.run_id}: head scores {how}")
    if result.haystacks < kwargs["haystacks"]:
        click.echo(f"  retrieval: {result.haystacks} haystacks, all the run's committed windows "
                   f"(--haystacks {kwargs['haystacks']} asked for more)")
    scores = result.scores
    for name in ("induction_score", "retrieval_score", "duplicate_score", "prev_token_score"):
        values = scores[name].values
        best = ", ".join(f"{scores['layer'].values[i]}.{scores['head'].values[j]} {values[i, j]:.2f}"
                         for i, j in zip(*divmod(values.argsort(axis=None)[::-1][:3], values.shape[1])))
        click.echo(f"  {name}: top heads (layer.head) {best}")


@main.command(short_help="Draw the paper's figures and tables from a store.")
@STORE
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder for index.html, the figures (PNG) and the tables (Markdown and CSV).")
def report(store: str, out: Path) -> None:
    """Draw every figure and table of the paper from the store, no model needed.

    Writes DIR/index.html (works offline) with the PNG figures and the tables beside it;
    the page opens with how to read it: what each section answers and the store's headline
    findings. Run analyze (and ablate, detect) first for every figure: inputs a run lacks
    become notes in the report, and a line here names the command that adds them.
    """
    from attngeom import api

    result = api.report(store, out)
    click.echo(f"report: {result.index}")
    for line in result.missing:
        click.echo(f"report: {line}")


@main.command(short_help="Write an offline, interactive page of every head's geometry.")
@STORE
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder for index.html and its data; replaced if an earlier explore wrote it.")
@click.option("--run", "run_id", help="Only this run [default: every run of the store].")
@click.option("--sequences", type=click.IntRange(1), default=8, show_default=True, help="Sequences per head shown on the page (the first committed ones).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def explore(store: str, out: Path, run_id: str | None, sequences: int, no_progress: bool) -> None:
    """Write an interactive page to look at every head's geometry, no model needed.

    DIR/index.html opens from disk with no network (plotly.js is copied beside it). A grid
    of heads coloured by regime, F at N, lambda or delta NLL; clicking a head loads only
    that head's file and shows the final query's attention over the decoded tokens, P, R
    and F against N with the random control and the bounds, and the value-space picture
    (every y_i = alpha_i v_i, the top-N set, s_N, the r_min / r_max balls).
    """
    from attngeom import api

    result = api.explore(store, out, run_id=run_id, sequences=sequences, progress=not no_progress)
    click.echo(f"explore: {result.index} ({result.runs} run(s), {result.heads} heads, "
               f"{result.bytes / 2**20:.1f} MiB in {result.seconds:.1f} s)")


@main.command(short_help="Check a store against the schema.")
@STORE
@click.option("--deep", is_flag=True, help="Also read every chunk and name any damaged one (empty, truncated, failing its checksum).")
@click.option("--repair", is_flag=True, help="Rebuild unreadable metadata that can be derived, refresh stale consolidated metadata, give a run whose arrays disagree in length one length again, and uncommit every committed sequence with a missing or empty chunk (with --deep, also a corrupt one, and remove a corrupt analysis or ablation chunk), so that the run's extract command (analyze), run again, rewrites it.")
def validate(store: str, deep: bool, repair: bool) -> None:
    """Check the store against schema version 1 and its format; one line per problem, exit 1 if any.

    Exit 0 when valid; 2 for a store that cannot be reached at all (credentials, network).
    Reads the store only; needs no model. With --repair, damaged committed sequences are uncommitted first; the check that
    follows lists them as not written yet.
    """
    from attngeom import api

    if repair:
        from attngeom.store import recovery

        done = api.repair(store, deep=deep)
        for key in done.rebuilt:
            click.echo(f"rebuilt {key}")
        for line in done.unrepairable:
            click.echo(line)
        for run_id, sequences in (done.uncommitted or {}).items():
            click.echo(f"run {run_id}: uncommitted damaged sequences {', '.join(map(str, sequences))}; "
                       "run its extract command again to rewrite them")
        for key in done.removed:
            click.echo(f"removed damaged {key}; {recovery(store, key)}")
        if done.refreshed:
            click.echo("refreshed the root's consolidated metadata")
    validation = api.validate(store, deep=deep)
    for line in validation.problems:
        click.echo(line)
    if not validation.valid:
        sys.exit(1)
    click.echo(f"{store}: valid")


@main.command(short_help="Bring a store of an older format up to date.")
@STORE
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def migrate(store: str, no_progress: bool) -> None:
    """Bring a store of an older format up to the one this attngeom writes.

    Format 1 stores (attngeom 0.1.0 before chunk checksums) get a crc32c checksum on every
    chunk; format 2 stores get their label arrays (zarr-python's string type) as integer
    codes of the Zarr v3 core, their labels in the attributes; format 3 stores get the
    codes of regimes, votes, statistics and methods in their fixed order; format 4 stores
    get, in each run's layout, the per-query summaries (prev_attn, recent_attn) the run
    lacks; format 5 stores the model's layer indices (0..n-1) and that it has no learned
    sinks. Values are kept.
    Each array is rewritten through a temporary copy: a migration that is interrupted is
    finished by running it again. No other command may use the store meanwhile.
    """
    from attngeom import api

    result = api.migrate(store, progress=not no_progress)
    if result.arrays == 0 and result.source == result.target:
        click.echo(f"{store}: already format {result.target}, nothing to do")
        return
    click.echo(f"{store}: format {result.source} -> {result.target}: rewrote {result.arrays} arrays "
               f"({result.chunks} chunk objects, {result.bytes_written / 2**20:.1f} MiB) in {result.seconds:.1f} s")


@main.command(short_help="The whole pipeline on the offline default model and corpus.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"), show_default=True, help="Folder for the demo store and its outputs.")
@click.option("--num-sequences", "-S", type=int, default=4, show_default=True, help="Sequences to extract; at least 2 (analyze compares sequences).")
@click.option("--context-length", "-L", type=click.IntRange(2), default=128, show_default=True, help="L: BOS plus L-1 tokens of one document.")
def demo(out: Path, num_sequences: int, context_length: int) -> None:
    """The whole pipeline on the offline default model (gemma3-270m) and corpus (wiki-summaries).

    Runs extract, validate, analyze, ablate (the model again, on CPU: every single head on
    one sequence, and a sweep of retention 1.0 and 0.5 with 2 random masks on another) and
    report, saying each step's time and the total, and writes the store, tables and report
    under --out (./demo-out). The first run assembles the model's GGUF and de-quantizes it into
    ~/.cache/attngeom ($ATTNGEOM_CACHE), about 1.4 GB; later runs read it from there. Run
    again, it says which steps had nothing to do.
    """
    # A demo's CPU is often shared: there torch's OpenMP threads, spinning while they wait for
    # each other, take the cores from the work (the demo's ablation on 2 cores at load 9:
    # 303 s with the default wait, 87 s passive). Read once, when torch loads; a user's own
    # setting stands.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from attngeom.demo import run_demo

    run_demo(out, num_sequences=num_sequences, context_length=context_length)


if __name__ == "__main__":
    main()
