"""``attngeom migrate``: a format-1 store (written by attngeom 0.1.0) brought to the current
format (checksums, then labels as integer codes in their fixed order, then its runs marked as
lacking the summaries of format 5), data unchanged, checksums working, and an interrupted
migration finished by a rerun; a run migrated from format 4 lacks the field's head scores and
every reader says so."""

from __future__ import annotations

import json
import shutil
import uuid
import warnings
from pathlib import Path

import fsspec
import numpy as np
import pytest
import xarray as xr
import zarr
from click.testing import CliRunner
from conftest import extract

from attngeom.api import analyze
from attngeom.cli import main
from attngeom.errors import AttngeomError, GroupNotFoundError, InputError
from attngeom.extract.request import ExtractRequest
from attngeom.handles import open_store
from attngeom.store import (
    FORMAT,
    array_metadata,
    arrays_of,
    has_checksum,
    open_root,
    validate_store,
)
from attngeom.store.integrity import migrate as store_migrate

RUN = "tiny-llama"
# The data types of the Zarr v3 core that attngeom writes.
CORE = ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64")


def contents(url: str) -> dict[str, np.ndarray]:
    """Every array of the store, decoded; a label array (integer codes since format 3) as its
    labels, so that a string array and its codes compare equal."""
    root = open_root(url)
    out = {}
    for a in arrays_of(root):
        values = np.asarray(a[...])
        labels = a.attrs.get("attngeom", {}).get("labels") if isinstance(a.attrs.get("attngeom"), dict) else None
        if labels is not None:
            values = np.array(labels, dtype=object)[values]
        elif values.dtype.kind in "OUT":
            values = values.astype(object)
        out[a.path] = values
    return out


def stored_keys(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "zarr.json")


def assert_same_contents(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for path, values in a.items():
        np.testing.assert_array_equal(values, b[path], err_msg=path)


def test_format1_store_is_read_and_refused_for_writing(format1_store, word_corpus, tiny_model_dir):
    url = str(format1_store)
    ds = xr.open_zarr(url, group=f"runs/{RUN}")
    assert ds.sizes["seq"] == 3 and int(ds["complete"].sum()) == 3
    lines = CliRunner().invoke(main, ["validate", "--store", url]).output.strip().splitlines()
    assert lines == [
        f"store format 1 is older than the one this attngeom writes ({FORMAT}) and has no chunk checksums "
        f"(corruption can go unseen); run `attngeom migrate --store {url}`"
    ]
    deep = CliRunner().invoke(main, ["validate", "--deep", "--store", url]).output
    assert f"array 'runs/{RUN}/values' has no chunk checksums" in deep
    for command in (["analyze", "--store", url, "--scheduler", "threads"],
                    ["extract", "--model", str(tiny_model_dir("llama")), "--dataset", str(word_corpus),
                     "-L", "16", "-S", "4", "--store", url, "--run", RUN]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert f"bring it up to date first with `attngeom migrate --store {url}`" in result.output


def test_migrate_format1_keeps_every_value_and_checks_every_chunk(format1_store):
    url = str(format1_store)
    before, keys_before = contents(url), stored_keys(format1_store)
    assert len(before) == 145
    result = CliRunner().invoke(main, ["migrate", "--store", url, "--no-progress"])
    assert result.exit_code == 0, result.output
    # 145 arrays get checksums (1 -> 2), then the 5 string arrays become codes (2 -> 3), in
    # their fixed order where they have one: nothing is left to 3 -> 4.
    assert result.output.startswith(f"{url}: format 1 -> {FORMAT}: rewrote 150 arrays (170 chunk objects")
    assert_same_contents(before, contents(url))
    assert stored_keys(format1_store) == keys_before  # no chunk gained or lost
    assert not (format1_store / store_migrate.TEMPORARY).exists()
    assert validate_store(url, deep=True) == []
    root = open_root(url, mode="a")
    assert root.attrs["attngeom"] == {"schema_version": 1, "created_by": "0.1.0", "format": FORMAT}
    assert root[f"runs/{RUN}"].attrs["attngeom"]["layout"]["lacking"] == ["prev_attn", "recent_attn"]
    assert all(has_checksum(array_metadata(a)) for a in arrays_of(root))
    assert not [a.path for a in arrays_of(root) if array_metadata(a)["data_type"] not in CORE]
    # The consolidated metadata was rebuilt: xarray's default open reads it.
    xr.testing.assert_identical(xr.open_zarr(url, group=f"runs/{RUN}").load(),
                                xr.open_zarr(url, group=f"runs/{RUN}", consolidated=False).load())

    # What the migration is for: a flipped byte is now caught, and named.
    shard = format1_store / f"runs/{RUN}/values/c/2/0/0/0/0"
    data = bytearray(shard.read_bytes())
    data[30] ^= 0xFF
    shard.write_bytes(data)
    (line,) = validate_store(url, deep=True)
    assert line.startswith(f"array 'runs/{RUN}/values' chunk c/2/0/0/0/0 (sequence 2) is damaged") and "checksum" in line

    again = CliRunner().invoke(main, ["migrate", "--store", url])
    assert again.output.strip() == f"{url}: already format {FORMAT}, nothing to do"


def test_migrated_store_takes_new_work(format1_store, tiny_model_dir, word_corpus):
    """After migration the store takes a new run, and analyze rewrites the old run's analysis."""
    url = str(format1_store)
    store_migrate.migrate(url, progress=False)
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=2, store=url, run_id="new", progress=False))
    with pytest.warns(UserWarning, match=f"run {RUN} has no head scores"):  # only the new run has them
        results = analyze(url, scheduler="threads", n_grid=[1, 4], progress=False)
    assert [(r.run_id, r.sequences) for r in results] == [("new", 2), (RUN, 3)]
    assert validate_store(url, deep=True) == []


class Crash(Exception):
    pass


def test_interrupted_migration_is_finished_by_a_rerun(format1_store, tmp_path, monkeypatch):
    """Kill the migration at object writes spread over all of it (temporary copies, the
    replacements, the root's bookkeeping); the store is refused meanwhile, and a rerun ends
    where an uninterrupted migration does. A crash is an exception out of the store's
    ``set``: nothing after it runs, as after SIGKILL."""
    url = str(format1_store)
    reference = contents(url)
    pristine = tmp_path / "pristine"
    shutil.copytree(format1_store, pristine)
    set_ = zarr.storage.LocalStore.set
    writes, crash_at = 0, None

    async def crashing(self, key, value):
        nonlocal writes
        writes += 1
        if writes == crash_at:
            raise Crash(key)
        await set_(self, key, value)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", crashing)
    store_migrate.migrate(url, progress=False)
    total = writes
    keys = stored_keys(format1_store)

    for crash_at in (1, 2, 3, 4, total // 7, total // 3, total // 2, 2 * total // 3, total - 2, total - 1, total):
        shutil.rmtree(format1_store)
        shutil.copytree(pristine, format1_store)
        writes = 0
        with pytest.raises(Crash):
            store_migrate.migrate(url, progress=False)
        # The first write marks the migration; the last one, after the mark is gone, rebuilds
        # the consolidated metadata.
        if 1 < crash_at < total:
            with pytest.raises(AttngeomError, match="is being migrated, or its migration was interrupted"):
                open_root(url)
            assert validate_store(url)[0].endswith(f"finish it with `attngeom migrate --store {url}`")
        writes, limit = 0, crash_at
        crash_at = None
        store_migrate.migrate(url, progress=False)
        assert_same_contents(reference, contents(url))
        assert stored_keys(format1_store) == keys, limit
        assert validate_store(url, deep=True) == [], limit


def test_migrate_memory_store(format1_store):
    """The same migration through fsspec (memory://), as on s3://."""
    url = f"memory://attngeom-{uuid.uuid4().hex}/store.zarr"
    fsspec.filesystem("memory").put(str(format1_store), url.removeprefix("memory://"), recursive=True)
    before = contents(url)
    report = store_migrate.migrate(url, progress=False)
    assert (report.source, report.target, report.arrays) == (1, FORMAT, 150)
    assert_same_contents(before, contents(url))
    assert validate_store(url, deep=True) == []


def test_current_store_needs_nothing_and_future_format_is_refused(tiny_model_dir, word_corpus, tmp_path):
    url = str(tmp_path / "s.zarr")
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), dataset=str(word_corpus), context_length=16,
                           num_sequences=2, store=url, run_id="r", progress=False))
    root_json = tmp_path / "s.zarr/zarr.json"
    meta = json.loads(root_json.read_text())
    assert meta["attributes"]["attngeom"]["format"] == FORMAT
    report = store_migrate.migrate(url, progress=False)
    assert report.arrays == 0 and json.loads(root_json.read_text()) == meta

    # A store whose arrays all carry checksums but whose root predates the attribute (as the
    # runs of attngeom 0.1.0 after checksums went in): only the attribute changes.
    del meta["attributes"]["attngeom"]["format"]
    root_json.write_text(json.dumps(meta))
    report = store_migrate.migrate(url, progress=False)
    assert (report.source, report.arrays) == (1, 0)
    assert open_root(url, mode="a").attrs["attngeom"]["format"] == FORMAT
    meta = json.loads(root_json.read_text())

    meta["attributes"]["attngeom"]["format"] = FORMAT + 1
    root_json.write_text(json.dumps(meta))
    open_root(url)  # the contract is the same schema: still read
    with pytest.raises(AttngeomError, match=f"store format {FORMAT + 1} is newer than this attngeom writes"):
        open_root(url, mode="a")
    with pytest.raises(AttngeomError, match="newer than this attngeom knows"):
        store_migrate.migrate(url, progress=False)


def _as_format4(url: str, run_id: str) -> None:
    """The store as attngeom wrote it at format 4: no prev_attn, recent_attn or recent, no
    ``lacking`` in the run's layout, and no analysis (its groups covered what the run held)."""
    root, run = Path(url), Path(url) / "runs" / run_id
    for name in ("prev_attn", "recent_attn", "recent", "analysis"):
        shutil.rmtree(run / name, ignore_errors=True)
    meta = json.loads((run / "zarr.json").read_text())
    for key in ("lacking", "layers", "learned_sinks"):  # the last two came with format 6
        del meta["attributes"]["attngeom"]["layout"][key]
    (run / "zarr.json").write_text(json.dumps(meta))
    meta = json.loads((root / "zarr.json").read_text())
    meta["attributes"]["attngeom"]["format"] = 4
    meta.pop("consolidated_metadata", None)
    (root / "zarr.json").write_text(json.dumps(meta))


def test_a_run_migrated_from_format4_lacks_the_scores_and_readers_say_so(tiny_model_dir, tmp_path):
    url = str(tmp_path / "s.zarr")
    ids = np.random.default_rng(0).integers(4, 100, (3, 16))
    ids[:, 0] = 1
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), token_ids=ids[:2], store=url, run_id="old",
                           progress=False))
    _as_format4(url, "old")
    assert validate_store(url)[0].startswith(f"store format 4 is older than the one this attngeom writes ({FORMAT})")
    report = store_migrate.migrate(url, progress=False)
    assert (report.source, report.target, report.arrays) == (4, FORMAT, 0)
    run = open_store(url).run("old")
    assert run.provenance["layout"]["lacking"] == ["prev_attn", "recent_attn"]
    # Format 6 records the layers a run holds (every one, before it) and no learned sinks.
    assert (run.provenance["layout"]["layers"], run.provenance["layout"]["learned_sinks"]) == ([0, 1, 2], False)
    assert validate_store(url, deep=True) == []  # lacking them is no damage
    assert store_migrate.migrate(url, progress=False).arrays == 0  # nothing left to do

    # The command line says it in one line and analyzes the rest.
    done = CliRunner().invoke(main, ["analyze", "--store", url, "--n-grid", "1,4", "--no-progress"])
    assert done.exit_code == 0, done.output
    said = [line for line in done.stderr.splitlines() if "head scores" in line]
    assert len(said) == 1 and said[0].startswith(
        "attngeom: warning: run old has no head scores: it was extracted before attngeom kept prev_attn and "
        "recent_attn"), done.stderr
    assert "warnings.warn" not in done.stderr
    run.analysis("heads")  # the rest of the analysis is there
    with pytest.raises(GroupNotFoundError, match="extract it again into a new run") as raised:
        run.analysis("head_scores")
    assert "\n" not in str(raised.value)
    with pytest.raises(InputError, match="takes no new sequences; choose another --run"):
        extract(ExtractRequest(model=str(tiny_model_dir("llama")), token_ids=ids, store=url, run_id="old",
                               progress=False))
    # A new run of the same store has them, and the analyze of both warns of the old one only.
    extract(ExtractRequest(model=str(tiny_model_dir("llama")), token_ids=ids, store=url, run_id="new",
                           progress=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analyze(url, scheduler="threads", n_grid=[1, 4], progress=False)
    assert [str(w.message).split(":")[0] for w in caught if "head scores" in str(w.message)] == ["run old has no head scores"]
    assert open_store(url).run("new").analysis("head_scores")["sink_score"].shape == (3, 4)
    assert validate_store(url, deep=True) == []
