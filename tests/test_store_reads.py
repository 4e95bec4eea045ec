"""One store per command: the report's data, explore, taxonomy (its tables and exports) and
a store opened from Python build one zarr Store each, however many runs the store holds and
whatever they hold (analyzed, with or without detect); an extract builds one, into a new
store, resuming or appending to a run, or with nothing left to write."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from field_groups import add_detect, detect_scores

from attngeom import api
from attngeom.report.data import load_runs
from attngeom.extract.synthetic import write_synthetic_run

SHAPE = dict(n_seq=3, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, length=40)


def _store(folder, runs: int) -> str:
    url = str(folder / f"{runs}.zarr")
    for seed in range(runs):
        write_synthetic_run(url, f"r{seed}", seed=seed, **SHAPE)
    api.analyze(url, scheduler="threads", n_grid=[1, 2, 4], progress=False)
    shape = (SHAPE["n_layers"], SHAPE["n_heads"])
    rng = np.random.default_rng(0)
    add_detect(url, "r0", detect_scores(*(rng.uniform(size=shape) for _ in range(4))))
    return url


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[int, str]:
    folder = tmp_path_factory.mktemp("reads")
    return {runs: _store(folder, runs) for runs in (1, 3)}


def _read_from_python(url: str, out) -> None:
    store = api.open_store(url)
    for run_id in store.runs:
        run = store.run(run_id)
        assert run.provenance["layout"]["n_layers"] == SHAPE["n_layers"]
        assert run.dataset()["tokens"].shape[0] == SHAPE["n_seq"]
        assert run.analysis("heads")["regime"].shape == (SHAPE["n_layers"], SHAPE["n_heads"])
        assert run.sequences().tolist() == list(range(SHAPE["n_seq"]))
    assert store.run("r0").detect()["induction_score"].shape == (SHAPE["n_layers"], SHAPE["n_heads"])


def _report_data(url: str, out) -> None:
    # The report's figures read only what load_runs opened; drawing them takes a minute.
    runs = load_runs(url)
    assert all(run.heads is not None and run.topn.load()["precision"].notnull().any() for run in runs)
    assert runs[0].detect is not None


COMMANDS = {
    "report": _report_data,
    "explore": lambda url, out: api.explore(url, out, sequences=2, progress=False),
    "taxonomy": lambda url, out: api.taxonomy(url, export=out.parent / f"{out.name}.csv",
                                              export_kv=out.parent / f"{out.name}.tsv",
                                              score="induction_score", run_id="r0").heads(),
    "open_store": _read_from_python,
}


def _stores_built(monkeypatch, command, url: str, out) -> int:
    built = []
    init = zarr.storage.LocalStore.__init__

    def counting(self, *args, **kwargs):
        built.append(args)
        init(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(zarr.storage.LocalStore, "__init__", counting)
        command(url, out)
    return len(built)


@pytest.mark.parametrize("name", COMMANDS)
def test_a_reading_command_builds_one_store_however_many_runs(stores, name, tmp_path, monkeypatch):
    built = {runs: _stores_built(monkeypatch, COMMANDS[name], url, tmp_path / f"out{runs}")
             for runs, url in stores.items()}
    print(f"{name}: zarr stores built: {built[1]} (1 run), {built[3]} (3 runs)")
    assert built[1] == built[3] == 1


def test_an_extract_builds_one_store_new_appended_or_done(tiny_model_dir, word_corpus, tmp_path, monkeypatch):
    """Its checks, its write and the answer of a run with nothing to write all go through
    the command's one session."""
    url = str(tmp_path / "s.zarr")

    def extract(count: int):
        return lambda url, out: api.extract(str(tiny_model_dir("llama")), store=url, dataset=str(word_corpus),
                                            context_length=16, num_sequences=count, run_id="r", progress=False)

    built = {what: _stores_built(monkeypatch, extract(count), url, None)
             for what, count in (("new", 2), ("appended", 3), ("done", 3))}
    print(f"extract: zarr stores built: {built}")
    assert api.open_store(url).run("r").sequences().tolist() == [0, 1, 2]
    assert built == {"new": 1, "appended": 1, "done": 1}
