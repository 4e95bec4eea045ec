"""The extract stage from its checked request to the run's commit (docs/method.md#preprocessing,
docs/store.md): the model and the input built (:mod:`~attngeom.extract.inputs`), the run's
identity checked against its record once they are read, then each batch's forward
(:mod:`~attngeom.extract.forward`) written through the command's
:class:`~attngeom.store.extracted.run_write.RunWrite`: the run created from the first forward's layout,
each sequence's arrays handed to the writer, the write committed. The store is handed values
(a layout, a provenance, arrays), never a function of extract's."""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from attngeom.extract.corpora import Window
from attngeom.extract.families import VERIFIED_TYPES
from attngeom.extract.forward import capturing_forward, check_chunks, check_conformance, in_flight, sequence_parts
from attngeom.extract.identity import differences, other_run
from attngeom.extract.inputs import Model, corpus, inputs, model
from attngeom.extract.phases import phase
from attngeom.extract.positions import check_context_length, config_positions
from attngeom.extract.provenance import identity, run_layout, run_provenance
from attngeom.extract.request import ExtractPlan, ExtractRequest, ExtractResult
from attngeom.extract.tokenizing import bos_token_id
from attngeom.store.extracted.run_write import Begun
from attngeom.store.session import StoreSession

__all__ = ["write_run"]


def write_run(plan: ExtractPlan, session: StoreSession) -> ExtractResult:
    """Extract ``plan``'s run through ``session`` (the command's store, mode "c"); raises
    :class:`InputError` (or a :class:`StoreError`) on bad input with the store untouched.

    With ``shard = (i, n)`` this process writes sequences s with s % n == i, so n processes
    (by hand, or ranks of torchrun) fill one run without touching each other's shards.
    """
    request = plan.request
    source = corpus(plan)  # before the model, which may take minutes to load the first time
    captured = model(plan)
    bos = bos_token_id(captured.tokenizer, request.bos_token, captured.config, ExtractRequest, plan.token_ids)
    given = inputs(plan, source, captured, bos)
    # Also here: a hub model's metadata is known once its config is loaded, before its weights.
    check_context_length(plan.length, config_positions(captured.config), captured.name, ExtractRequest)
    check_chunks(captured.config, plan.queries, plan.length)
    write = session.run_write(plan.run_id, shard=plan.shard)
    recorded = write.recorded()
    asked = identity(plan, captured, given, bos.id, recorded)
    diffs = [] if recorded is None else differences(recorded, asked, plan.given)
    if diffs:
        raise other_run(request.store, plan.run_id, diffs)
    windows = given.windows()
    with write.begin(len(windows)) as begun:
        start = time.perf_counter()
        written = len(begun.todo)
        if begun.todo:
            provenance = {**asked, **run_provenance(plan, captured, bos.id)}
            _write_sequences(plan, captured, begun, provenance, windows)
        committed = begun.commit()
        return ExtractResult(plan.run_id, written, committed, begun.capacity, time.perf_counter() - start)


def _write_sequences(plan: ExtractPlan, captured: Model, begun: Begun, provenance: dict,
                     windows: list[Window]) -> None:
    """Run the model over the windows of the sequences ``begun.todo`` batch by batch and
    commit each sequence; the run is created after the first forward (its layout comes from
    the capture)."""
    request = plan.request
    net = captured.load()
    seqs = begun.todo
    if captured.config.model_type not in VERIFIED_TYPES:
        check_conformance(net, captured, windows[seqs[0]], request.progress)
    bar = tqdm(total=len(seqs), unit="seq", desc=f"extract {plan.run_id}", disable=not request.progress)
    start = time.perf_counter()
    layout = None
    try:
        with capturing_forward(net, keep_rows=request.store_rows == "all", queries=plan.queries,
                               tf32=captured.tf32) as record:
            for b0 in range(0, len(seqs), request.batch_size):
                batch = [windows[i] for i in seqs[b0 : b0 + request.batch_size]]
                ids = torch.from_numpy(np.stack([w.tokens for w in batch]).astype("int64")).to(captured.device)
                layers = record(ids)
                if layout is None:  # the run's recorded layout, also when resuming
                    layout = begun.create(run_layout(plan, captured.config, layers, provenance["values_dtype"]),
                                          provenance, in_flight=in_flight(captured.device))
                # Stacked, compressed and written beside the next batch's forward (on CPU, before it).
                for b, (seq, window) in enumerate(zip(seqs[b0 : b0 + request.batch_size], batch)):
                    with phase("attngeom.write"):
                        with phase("attngeom.hand_off"):
                            arrays = sequence_parts(layers, b, window, layout)
                        begun.submit(seq, arrays)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{bar.n * plan.length / max(time.perf_counter() - start, 1e-9):.0f}")
    finally:
        bar.close()
