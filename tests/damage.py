"""What the tests of damaged stores share: the command line run as a user meets it, validate's
verdict, the one line of a refusal, a flipped byte, and two stores compared object by object."""

from __future__ import annotations

import filecmp
import re
from pathlib import Path

from click.testing import CliRunner

from attngeom.cli import main

# The analyze of `analyze_cli`: the n grid of conftest's ablated store.
GRID = ["--n-grid", "1,2,4"]


def run(*args: str):
    """The CLI on ``args``: (exit code, stdout and stderr lines, without transformers' own
    weight-loading bar)."""
    result = CliRunner().invoke(main, list(args))
    output = re.sub(r"Loading weights:[^\n]*?(\r|\n|(?=run )|(?=attngeom: ))", "", result.output)
    return result.exit_code, output.strip().splitlines()


def validate(store: Path, *flags: str) -> list[str]:
    code, lines = run("validate", "--store", str(store), *flags)
    assert code == (0 if lines == [f"{store}: valid"] else 1), lines
    return [] if code == 0 else lines


def one_error(*args: str) -> str:
    """The one line an analyze/ablate/report/taxonomy meets the store with (exit 2)."""
    code, lines = run(*args)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("attngeom: error: "), lines
    return lines[0]


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_same_tree(a: Path, b: Path) -> None:
    """The same objects, byte for byte (metadata, records and consolidated copy included)."""
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert mismatch == [] and errors == [], mismatch + errors


def analyze_cli(store: Path, *flags: str) -> list[str]:
    code, lines = run("analyze", "--store", str(store), "--scheduler", "threads", "--no-progress", *GRID, *flags)
    assert code == 0, lines
    return lines
