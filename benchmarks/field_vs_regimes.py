#!/usr/bin/env python
"""The field's head classes beside the paper's regimes, on real models (run by hand).

    python benchmarks/field_vs_regimes.py                 # both offline models x both corpora, L = 320, S = 8, CPU
    python benchmarks/field_vs_regimes.py --models smollm2-135m --datasets wiki-summaries --length 256
    python benchmarks/field_vs_regimes.py --store field.zarr --out field-report   # keep the store, draw the report

For each model and corpus: extract ``--num-sequences`` windows at ``--length``, analyze
(regimes and analysis/head_scores) and detect (probe and retrieval scores), each timed; the
store is reused, so a second run with the same ``--store`` only prints. Then the report's
tables of the section "Heads of the field": the median of every score per regime
(``field_medians``), how many heads of each regime pass each class's threshold
(``field_classes``), and the computed sentences on where the classes and the regimes agree
(``field_agreement``). The default L = 320 is about the longest at which wiki-summaries has
8 documents for both models' tokenizers (its 8th longest has 354 tokens with SmolLM2's); it
defines the distant mass at W = 16 and W = 64 (queries i >= 2W), the streaming class's
window, and leaves W = 256 undefined (it needs L > 512: python-docs alone has such documents).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

import attngeom as ag
from attngeom.report.agreement import agreement
from attngeom.report.data import load_runs
from attngeom.report.tables import field_classes, field_medians, to_markdown


def prepare(store: str, model: str, dataset: str, length: int, sequences: int, device: str) -> tuple[str, dict]:
    """Extract, analyze and detect one run (each a no-op when the store has it); seconds per stage."""
    seconds = {}
    start = time.perf_counter()
    run_id = ag.extract(model, store=store, dataset=dataset, context_length=length, num_sequences=sequences,
                        device=device, progress=False).run_id
    seconds["extract"] = time.perf_counter() - start
    start = time.perf_counter()
    ag.analyze(store, run_id=run_id, progress=False)
    seconds["analyze"] = time.perf_counter() - start
    start = time.perf_counter()
    ag.detect(store, run_id, device=device, progress=False)
    seconds["detect"] = time.perf_counter() - start
    return run_id, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--datasets", default="wiki-summaries,python-docs")
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--num-sequences", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store", help="keep the store here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="also draw the whole report here")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, device {args.device}, L = {args.length}, S = {args.num_sequences}")
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"{tmp}/field.zarr"
        timings = []
        for model in args.models.split(","):
            for dataset in args.datasets.split(","):
                run_id, seconds = prepare(store, model, dataset, args.length, args.num_sequences, args.device)
                timings.append({"run": run_id, **{k: round(v, 1) for k, v in seconds.items()}})
        print("\nseconds per stage (a stage the store already held takes about none)\n")
        print(to_markdown(pd.DataFrame(timings)))
        runs = load_runs(store)
        medians = field_medians(runs).drop(columns=["model", "dataset"])
        print("field_medians: the median of each score over each regime's heads\n")
        print(to_markdown(medians.round(3)))
        classes = field_classes(runs).drop(columns=["model", "dataset"])
        print("field_classes: heads passing each class's threshold, per regime\n")
        print(to_markdown(classes.round(1)))
        print("field_agreement\n")
        for line in agreement(runs):
            print(f"- {line}")
        if args.out is not None:
            print(f"\nreport: {ag.report(store, args.out)}")


if __name__ == "__main__":
    main()
