"""The command line as a newcomer meets it: help texts, and one line with exit 2 for input
that cannot be used."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

import attngeom as ag
from attngeom.cli import main


def test_help_lists_each_command_once_in_pipeline_order_and_every_option_has_help():
    top = CliRunner().invoke(main, ["--help"]).output
    listed = re.findall(r"^  (\w+) ", top.split("Commands:", 1)[1], flags=re.M)
    assert listed == ["extract", "analyze", "taxonomy", "ablate", "report", "explore", "validate", "migrate", "demo"]
    # Which commands need the model, as the code does: extract, ablate and demo load it.
    intro = " ".join(top.split("Options:", 1)[0].split())
    assert "analyze, taxonomy, report, explore, validate and migrate read the store and need no model" in intro
    assert "ablate loads the run's model again" in intro and "demo runs extract" in intro
    for name, command in main.commands.items():
        assert all(p.help for p in command.params if isinstance(p, click.Option)), name
        text = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        assert "%%" not in text, name
    assert "s with s % n == i" in CliRunner().invoke(main, ["extract", "--help"], terminal_width=200).output


def test_every_reader_of_a_store_without_runs_says_so_in_one_line(tmp_path):
    from attngeom.store import open_or_create_root

    store = str(tmp_path / "empty.zarr")
    open_or_create_root(store)
    expected = f"attngeom: error: {store} holds no run yet; run `attngeom extract --store {store}` first\n"
    for args in (["analyze", "--no-progress"], ["taxonomy"], ["report", "--out", str(tmp_path / "report")],
                 ["explore", "--out", str(tmp_path / "explore"), "--no-progress"], ["ablate", "--run", "r"]):
        result = CliRunner().invoke(main, [*args, "--store", store])
        assert (result.exit_code, result.output) == (2, expected), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.zarr"]


@pytest.mark.parametrize("command", ["report", "explore"])
def test_an_out_that_cannot_be_a_folder_is_one_line(command, tmp_path):
    from attngeom.synthetic import write_synthetic_run

    store = str(tmp_path / "s.zarr")
    write_synthetic_run(store, "r", n_seq=1, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    result = CliRunner().invoke(main, [command, "--store", store, "--out", str(out)])
    assert (result.exit_code, result.output) == (
        2, f"attngeom: error: --out {out} cannot be made a folder (Not a directory)\n")
    with pytest.raises(ag.InputError, match="cannot be made a folder"):
        getattr(ag, command)(store, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "s.zarr"]


def test_a_run_longer_than_the_kernels_take_is_one_line_and_writes_nothing(tmp_path):
    """analyze refuses a run of more keys per query than its kernels index (MAX_KEYS) before
    it writes anything."""
    from attngeom.analyze.kernels import MAX_KEYS
    from attngeom.synthetic import write_synthetic_run

    store = tmp_path / "s.zarr"
    write_synthetic_run(str(store), "r", n_seq=1, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                        length=MAX_KEYS + 2)
    before = sorted(store.rglob("*"))
    result = CliRunner().invoke(main, ["analyze", "--store", str(store), "--no-progress"])
    assert (result.exit_code, result.output) == (
        2, f"attngeom: error: run 'r' has L = {MAX_KEYS + 2} keys per query; analyze takes at most {MAX_KEYS}\n")
    assert sorted(store.rglob("*")) == before

