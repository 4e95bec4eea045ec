"""The Python API (docs/api.md): one function per command, returning results instead of printing.

The CLI is a thin layer over these functions: same defaults, same errors. Every error a caller
can act on is an :class:`~attngeom.errors.AttngeomError`, caught by kind. Each function
imports its stage when called, so ``import attngeom`` loads neither torch nor transformers,
and analyze, taxonomy, report and validate never do.

Shapes: S sequences, L context length (BOS plus L-1 tokens), layers, heads, N selection sizes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attngeom.ablate.request import AblateRequest
from attngeom.ablate.request import check_request as check_ablate
from attngeom.detect.request import DetectRequest, check_sequences
from attngeom.detect.request import check_request as check_detect
from attngeom.errors import GroupNotFoundError, InputError, StoreNotFoundError
from attngeom.extract.positions import check_context_length
from attngeom.extract.request import ExtractRequest
from attngeom.extract.sources import model_name
from attngeom.options import keywords_of
from attngeom.store.objects.preflight import local_path, local_run_ids, require_run, require_store, run_record
from attngeom.extract.runcheck import check_device, check_run_model, committed_count

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from attngeom.ablate.stage import AblateResult
    from attngeom.analyze.parameters import AnalyzeResult
    from attngeom.detect.stage import DetectResult
    from attngeom.explore.build import ExploreResult
    from attngeom.extract.conformance import ModelCheck
    from attngeom.extract.request import ExtractResult
    from attngeom.handles import Store
    from attngeom.report import Report
    from attngeom.store import Repair
    from attngeom.store.integrity.migrate import MigrationReport
    from attngeom.store.session import StoreSession

__all__ = [
    "Taxonomy", "Validation", "ablate", "analyze", "check_model", "detect", "explore", "extract", "migrate",
    "open_store", "repair", "report", "taxonomy", "validate",
]


@keywords_of(ExtractRequest, leave=("command_line",))
def extract(model: Any, *, store: str | Path, **options: Any) -> ExtractResult:
    """Run the model once over the input and write its run into ``store`` (docs/store.md#run-arrays).

    model: an offline name (gemma3-270m, smollm2-135m), hub id, local folder or .gguf file,
    or a loaded transformers causal LM whose attention the capture reads (docs/models.md). A
    hybrid's run holds its softmax-attention layers, under the model's own layer indices.
    device_map: "auto" (or another accelerate strategy) or a mapping of module names to
    devices ("cpu", "disk", "cuda:N", a GPU index) places a named model larger than one
    device over the GPUs, the CPU and the disk as it loads. A model given in memory is used
    on its own device and in its own dtype (``device``/``dtype`` must be "auto" or match:
    it is never moved or cast), in eval mode with the capture attention for the call only;
    its attention implementation and train/eval mode are restored after. Its provenance
    records its class, config and state-dict sha256, and ``"source": "memory"``.

    Input, exactly one of:

    - dataset: a corpus name or path (as the CLI's ``--dataset``); needs context_length
      and num_sequences; windows of docs/method.md#preprocessing (BOS + L-1 tokens of one document).
    - texts: strings, windowed the same way with the tokenizer (documents shorter than
      L-1 tokens are skipped); needs context_length; num_sequences defaults to every window.
    - token_ids: integer array (S, L), used as given: every row must start with BOS
      (``bos_token``, else the tokenizer's, else the model config's, else the token every row
      starts with, said in a warning); an :class:`InputError` names the rows that do not.

    tokenizer: a tokenizer, or a name or folder to load one from; needed for dataset and
    texts with a model given in memory or a model folder saved without one (refused before
    anything loads otherwise), never with token_ids. A run extracted without one records
    ``"tokenizer": None``. Errors name these keywords (``tokenizer=``) where the command
    line names its options (``--tokenizer``). Writes runs/<run_id> with tokens (S, L), values (S, layers, kv_heads, L,
    head_dim), attn_last (S, layers, heads, L) and the per-query summaries (S, layers,
    heads, L); resumable (a rerun writes only uncommitted sequences) and appendable.

    dtype: "auto" (float32), "float32", "float32-tf32" (float32, its matmuls in TF32 on a GPU,
    inside the forward only), "bfloat16" or "float16". values_dtype: "auto" stores a bfloat16
    model's values as bfloat16 (2 bytes, exact: their bit patterns as uint16, read back as
    float32) and any other model's as float32; "float32", "float16" (rounded) or "bfloat16"
    (a bfloat16 model only) choose.

    queries: "last" (default), "every:K" (L-1, L-1-K, ... down to 1) or positions in 1..L-1
    (a list, or "P1,P2,..."): also keeps those queries' rows, attn_rows (S, layers, heads,
    query_pos, L) float32, which analyze turns into analysis/topn_by_query
    (docs/method.md#any-query).
    """
    from attngeom.extract.pipeline import extract as run

    request = ExtractRequest(model=model, store=str(store), **options)
    # Mistakes are answered before the store's libraries load, and a run that holds every
    # sequence already before torch loads (attngeom.extract.pipeline).
    return run(request)


def check_model(model: str, *, device: str = "auto", dtype: str = "auto", length: int = 64) -> ModelCheck:
    """Check that the capture reproduces the model's own eager attention (docs/models.md#conformance).

    model: a name or path as extract takes it. Loads it, runs one forward of BOS and
    ``length - 1`` seeded random tokens, and compares at a few queries each attention layer's
    captured rows and output with its eager attention in float32 (row tolerance 1e-4).
    Raises :class:`UnsupportedModelError` for a model the capture cannot read at all. The
    name, the device and ``length`` against the model's positions are checked first, before
    torch loads.
    """
    if length < 2:
        raise InputError(f"length {length}: needs at least 2 positions (BOS and one token)")
    check_device(device)
    named = model_name(model)
    if named.positions is not None:
        check_context_length(length, named.positions, model, "--length")
    from attngeom.extract.conformance import check_model as run

    return run(model, device=device, dtype=dtype, length=length)


def analyze(
    store: str | Path,
    *,
    run_id: str | None = None,
    scheduler: str | None = None,
    n_grid: Sequence[int] | None = None,
    seed: int = 0,
    out: Path | None = None,
    progress: bool = True,
    deep: bool = False,
) -> AnalyzeResult | list[AnalyzeResult]:
    """Compute every quantity of docs/method.md, the taxonomy included, out of core, without the model,
    for every run (or ``run_id``); writes runs/<id>/analysis/{topn, values, taxonomy, heads,
    summary, signatures, table} (and topn_by_query, summary_by_query for a run extracted with
    ``queries``), read back with ``open_store(store).run(id).analysis(name)``.

    scheduler: None for one worker process per core, forked from this one (threads where
    processes cannot be forked), "threads" (this process alone), "processes" (a
    dask.distributed LocalCluster), or a Dask scheduler address. n_grid: selection sizes N (default 1, 2, 4, ... < L).
    seed: of the random-N control. out: also write the tidy tables there (Parquet, CSV).
    A committed analysis is checked first (object presence and sizes; with ``deep`` every
    object is also decoded) and what is damaged is written again; two analyzes of one run
    on a local store run one after the other (a lock on the run's folder; none on object
    stores). Returns the result of ``run_id`` (sequences, head instances, seconds, what was
    healed), or without ``run_id`` a list of one result per run.
    """
    _check_analyze(store, run_id=run_id, scheduler=scheduler, n_grid=n_grid, seed=seed, out=out)
    from attngeom.analyze.current import analyzed
    from attngeom.analyze.parameters import AnalyzeRequest
    from attngeom.store.session import StoreSession

    request = AnalyzeRequest(store=str(store), run_id=run_id, scheduler=scheduler, n_grid=n_grid, seed=seed, out=out,
                             progress=progress, deep=deep)
    with _workers_skip_main(), StoreSession(str(store), mode="a") as session:
        results = analyzed(request, session)
        if results is None:
            # Dask, xarray and the kernels load only where there is work.
            from attngeom.analyze.runner import analyze as run

            results = run(request, session)
    return results[0] if run_id is not None else results


# A Dask scheduler's address: scheme://host:port or host:port (distributed.comm.parse_address).
_SCHEDULER_ADDRESS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^\s:/]+:\d+$|^[A-Za-z][A-Za-z0-9+.-]*://\S+$")


def _check_analyze(store: str | Path, *, run_id: str | None, scheduler: str | None, n_grid: Sequence[int] | None,
                   seed: int, out: Path | None) -> None:
    """Refuse analyze's arguments that cannot be used, before Dask, xarray or numba load: an
    N grid against each run's L as its record states it (the runner checks it again against
    the arrays)."""
    if scheduler not in (None, "threads", "processes") and not _SCHEDULER_ADDRESS.match(scheduler):
        raise InputError(
            f"--scheduler {scheduler!r}: use threads, processes, or a Dask scheduler's address (tcp://host:8786)"
        )
    if seed < 0:
        raise InputError(f"--seed {seed}: the seed of the random-N control is a non-negative integer")
    if run_id is None:
        require_store(str(store))
    else:
        require_run(str(store), run_id)
    if n_grid:
        for rid in [run_id] if run_id is not None else local_run_ids(str(store)) or []:
            length = (run_record(str(store), rid) or {}).get("context_length")
            if isinstance(length, int) and not 1 <= min(n_grid) <= max(n_grid) < length:
                raise InputError(f"--n-grid must hold sizes 1 <= N < L = {length} (run '{rid}')")
    if out is not None:
        _check_out(out)


def _check_out(out: str | Path) -> None:
    """Refuse an ``--out`` folder that cannot be made or written, creating nothing: probes its
    nearest existing folder with a file made and removed."""
    probe = Path(out).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        fd, name = tempfile.mkstemp(dir=probe, prefix=".attngeom-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise InputError(f"--out {out} cannot be made a folder ({exc.strerror or exc})") from exc


@contextlib.contextmanager
def _workers_skip_main() -> Iterator[None]:
    """Within the block, processes started by spawn (the LocalCluster's workers) do not run
    the caller's script again. A worker re-imports ``__main__`` from its file: a script that
    calls ``attngeom.analyze`` at top level, without ``if __name__ == "__main__":``, would run
    its extract in every worker and then fail there. Workers need nothing of ``__main__``:
    their tasks are attngeom's own functions."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        yield  # a notebook, a REPL, python -c or -m: nothing is re-run
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


@dataclass(frozen=True)
class Taxonomy:
    """The head regimes of every analyzed run (docs/method.md#head-taxonomy).

    labels: run id -> (model id, dataset id, regime names (layers, heads)); store: where
    they were read. ``str()`` gives the tables ``attngeom taxonomy`` prints.
    """

    labels: dict[str, tuple[str, str, np.ndarray]]
    store: str = ""
    # The store as the taxonomy read it: its tables read on through it.
    _session: StoreSession | None = field(default=None, repr=False, compare=False)

    def distribution(self) -> pd.DataFrame:
        """One row per run: counts and percentages of Retriever, Mixer and Reset heads."""
        import pandas as pd

        from attngeom.analyze.taxonomy_tables import distribution

        return pd.DataFrame(distribution(self.labels))

    def cross_corpus(self) -> pd.DataFrame:
        """One row per two runs of one model on two corpora: percentage-point differences
        per regime and the share of heads whose label agrees."""
        import pandas as pd

        from attngeom.analyze.taxonomy_tables import cross_corpus

        return pd.DataFrame(cross_corpus(self.labels))

    def heads(self) -> pd.DataFrame:
        """Every head of the analyzed runs, a row per (run, layer, head): model, dataset, L,
        kv_head, regime, vote fractions, value statistics, the mechanistic signatures at
        N = ``signature_n``, the field's scores and classes (docs/method.md#field-classes);
        a score a run lacks is empty (NaN, <NA>)."""
        from attngeom.detect.head_classes import head_table

        return head_table(self._reading(), list(self.labels))

    def kv_scores(self, score: str, run_id: str | None = None) -> np.ndarray:
        """(layers, kv_heads) in [0, 1], 1 = keep the full KV cache: ``score`` of run
        ``run_id`` (the store's only run by default), a kv head taking the largest of its
        query heads' (docs/cli.md#taxonomy)."""
        from attngeom.detect.head_classes import kv_scores

        return kv_scores(self._reading(), score, run_id)

    def _reading(self) -> StoreSession:
        if self._session is not None:
            return self._session
        from attngeom.store.session import StoreSession

        return StoreSession.reading(self.store)

    def __str__(self) -> str:
        from attngeom.analyze.taxonomy_tables import format_tables

        return format_tables(self.labels)


def taxonomy(store: str | Path, *, export: str | Path | None = None, export_kv: str | Path | None = None,
             score: str | None = None, run_id: str | None = None) -> Taxonomy:
    """The Retriever / Mixer / Reset regimes of every analyzed run of ``store``; raises
    :class:`GroupNotFoundError` when no run is analyzed yet.

    export: also write :meth:`Taxonomy.heads` there (``.csv`` or ``.parquet``). export_kv:
    also write :meth:`Taxonomy.kv_scores` of ``score`` and ``run_id`` there (``.tsv``, the
    layout of DuoAttention's ``full_attention_heads.tsv``). Paths and ``score`` are checked
    before the store is read; folders on the way to a path are made as it is written.
    """
    store = str(store)
    from attngeom.detect.head_classes import TABLE_SUFFIXES, check_kv_score, check_path

    if export is not None:
        check_path(export, "--export", TABLE_SUFFIXES)
    if export_kv is not None:
        check_path(export_kv, "--export-kv", (".tsv",))
        check_kv_score(score)
    elif score is not None or run_id is not None:
        raise InputError("--score and --run choose what --export-kv writes: give --export-kv too")
    require_store(store)
    from attngeom.analyze.taxonomy_tables import run_regimes
    from attngeom.store.session import StoreSession

    session = StoreSession.reading(store)
    labels = run_regimes(session)
    if not labels:
        raise GroupNotFoundError(f"no analyzed run in {store}: run 'attngeom analyze --store {store}' first")
    result = Taxonomy(labels, store, session)
    if export_kv is not None:
        from attngeom.detect.head_classes import write_kv

        write_kv(result.kv_scores(score, run_id), export_kv)
    if export is not None:
        from attngeom.detect.head_classes import write_table

        write_table(result.heads(), export)
    return result


@keywords_of(AblateRequest)
def ablate(store: str | Path, run_id: str, **options: Any) -> AblateResult:
    """Single-head ablation and head sparsification of run ``run_id`` (docs/method.md#ablation); needs the model.

    The run's model is loaded by its recorded name with its own attention implementation.
    ``model`` says where it is now when it has moved (a name, .gguf file, folder or hub id,
    checked against the run's architecture, shapes and weights); a run extracted from a model
    in memory needs that model again, or where its weights were saved (its state dict must
    hash as recorded). device_map places a model larger than one device, as for
    :func:`extract`. A head's ablation zeroes its attention output (docs/method.md#ablation),
    in any family; a hybrid's heads are those of its softmax-attention layers. retention:
    fractions of heads kept per layer, each in (0, 1] (default
    1.0, 0.9, 0.75, 0.5, 0.25). Options are checked before torch loads. Writes
    runs/<id>/ablation/{single, sweep, correlations, critical, table[, regimes]}
    and returns them as in-memory Datasets (single: (layer, head[, seq]); sweep: (method,
    retention[, draw, seq, layer, head])) with the sweep as a table. See
    :class:`~attngeom.ablate.request.AblateRequest` for every option.
    """
    request = AblateRequest(store=str(store), run_id=run_id, **options)
    require_run(str(store), run_id)
    if request.out is not None:
        _check_out(request.out)
    check_ablate(request)
    record = _run_model_record(str(store), run_id, request.model, "ablate")
    check_ablate(request, record.get("layout"), committed_count(str(store), run_id))
    from attngeom.ablate.stage import ablate as run

    from attngeom.extract.models import library_bars

    with library_bars(request.progress):
        return run(request)


def _run_model_record(store: str, run_id: str, model: Any, stage: str) -> dict[str, Any]:
    """The run's record, once a model that cannot be the run's is refused (before torch
    loads); empty when it cannot be read: the store package names why."""
    record = run_record(store, run_id) or {}
    if record:
        check_run_model(model, record, run_id, stage)
    return record


@keywords_of(DetectRequest)
def detect(store: str | Path, run_id: str, **options: Any) -> DetectResult:
    """The field's head scores of run ``run_id`` (docs/method.md#head-detectors); needs the model.

    duplicate_score, induction_score and prev_token_score from ``probes`` seeded sequences
    ``[BOS] + r + r`` of random tokens; retrieval_score, teacher-forced, from the run's first
    ``haystacks`` windows (all of them when it has fewer: ``DetectResult.haystacks`` says how
    many) with a needle of ``needle_length`` tokens of another window
    inserted at each of ``depths`` (default 0.1, 0.3, 0.5, 0.7, 0.9) and repeated at the
    end. The run's model is loaded by its recorded name, or from ``model`` (a name, .gguf file,
    folder or hub id) where it is now, checked as for :func:`ablate`; a run extracted from a
    model in memory needs that model (or where its weights were saved) and, where the run
    records a tokenizer that does not load here, ``tokenizer`` (a tokenizer, or a name or
    folder); a run extracted without one needs none (the probes draw from the model's
    embedding rows without the config's special ids). device_map places a model larger than
    one device, as for :func:`extract`. Options are checked before torch loads.
    Writes runs/<id>/detect/{scores, probes, retrieval} and returns them as
    in-memory Datasets (scores: (layer, head)); a rerun with the same parameters keeps the
    committed results. See :class:`~attngeom.detect.request.DetectRequest` for every option.
    """
    request = DetectRequest(store=str(store), run_id=run_id, **options)
    require_run(str(store), run_id)
    check_detect(request)
    record = _run_model_record(str(store), run_id, request.model, "detect")
    length = record.get("context_length")
    check_detect(request, length if isinstance(length, int) else None)
    if (committed := committed_count(str(store), run_id)) is not None:
        check_sequences(run_id, committed)
    from attngeom.detect.stage import detect as run

    from attngeom.extract.models import library_bars

    with library_bars(request.progress):
        return run(request)


def report(store: str | Path, out: str | Path) -> Report:
    """Draw every figure (PNG) and table (Markdown, CSV) of the paper from ``store`` into
    ``out``, with an offline index.html that opens with "How to read this report"; needs no
    model and prints nothing. Returns a :class:`~attngeom.report.Report`: ``index`` (the path
    of index.html, also its ``os.fspath``) and ``missing``, a line per command that would add
    what the page lacks."""
    require_store(str(store))
    _check_out(out)
    from attngeom.report import build_report

    return build_report(str(store), Path(out))


def explore(
    store: str | Path, out: str | Path, *, run_id: str | None = None, sequences: int = 8, progress: bool = True
) -> ExploreResult:
    """Write an offline, interactive page of every head's geometry (``out/index.html``) for
    every run of ``store`` (or ``run_id``), showing each head's first ``sequences`` committed
    sequences; needs no model. Head data load when a head is clicked."""
    if run_id is None:
        require_store(str(store))
    else:
        require_run(str(store), run_id)
    _check_out(out)
    from attngeom.explore.build import explore as run

    return run(str(store), Path(out), run_id=run_id, sequences=sequences, progress=progress)


@dataclass(frozen=True)
class Validation:
    """The problems found in a store, one line each; none when it is valid."""

    store: str
    problems: tuple[str, ...]

    @property
    def valid(self) -> bool:
        return not self.problems


def validate(store: str | Path, *, deep: bool = False) -> Validation:
    """Check ``store`` against schema version 1 and its format; ``deep`` also reads every
    chunk, naming any corrupt one (checksums). A store that cannot be opened is a problem
    found, not an error."""
    path = local_path(str(store))
    if path is not None and not path.is_dir():
        return Validation(str(store), (f"no Zarr store at {store}",))  # as validate_store says, without loading it
    if path is None:
        with contextlib.suppress(StoreNotFoundError):  # a problem found, named below
            require_store(str(store))  # a store that cannot be reached is an error: credentials, network
    from attngeom.store import validate_store

    return Validation(str(store), tuple(validate_store(str(store), deep=deep)))


def repair(store: str | Path, *, deep: bool = False) -> Repair:
    """Repair what can be repaired: rebuild unreadable metadata that can be derived (a run
    array's from the run's layout, the root's from its runs), uncommit every committed
    sequence with a missing or empty chunk (with ``deep``, also one that fails to decode) so
    that the run's extract command, run again, rewrites it, with ``deep`` remove derived
    objects that fail to decode so that analyze rewrites them, and refresh stale
    consolidated metadata. Returns what was done and what cannot be repaired."""
    from attngeom.store import repair as run

    return run(str(store), deep=deep)


def migrate(store: str | Path, *, progress: bool = True) -> MigrationReport:
    """Bring a store of an older format up to the one this attngeom writes (data unchanged);
    an interrupted migration is finished by running it again."""
    require_store(str(store))
    from attngeom.store.integrity.migrate import migrate as run

    return run(str(store), progress=progress)


def open_store(url: str | Path) -> Store:
    """The store at ``url``, to read from Python: ``.runs``, ``.run(id)`` -> a Run with
    ``.provenance``, ``.dataset()``, ``.analysis(name)``, ``.ablation(name)``, ``.detect(name)``, ``.text(seq)``.
    Raises :class:`StoreNotFoundError` or :class:`SchemaError`."""
    require_store(str(url))
    from attngeom.handles import open_store as run

    return run(url)
