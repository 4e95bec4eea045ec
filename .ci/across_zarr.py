"""A store written with one environment's zarr is analyzed with the other's, then validated
(every chunk read) and read back with the first; the analysis equals the reference of
tests/test_analysis_dump.py, and each store equals the other object for object.

    python .ci/across_zarr.py PYTHON_A PYTHON_B

PYTHON_A and PYTHON_B are the interpreters of two environments with attngeom installed
(CI: zarr 3.1.6 on Python 3.11, the newest zarr on Python 3.12).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).parents[1] / "tests"


def step(what: str, folder: str) -> None:
    """One step, in this interpreter: ``write`` the dump's synthetic store, ``analyze`` it, or
    ``check`` it (validate deep, then print its dump as JSON)."""
    sys.path.insert(0, str(TESTS))
    from analysis_dump import GRID, dump, make_store

    from attngeom.api import analyze, validate

    url = str(Path(folder) / "dump.zarr")
    if what == "write":
        make_store(url)
    elif what == "analyze":
        analyze(url, scheduler="threads", n_grid=GRID, progress=False)
    else:
        problems = validate(url, deep=True).problems
        if problems:
            raise SystemExit(f"{url}: {problems}")
        print(json.dumps(dump(url), sort_keys=True))


def run(python: str, what: str, folder: Path) -> str:
    return subprocess.run([python, __file__, "--step", what, str(folder)], check=True, capture_output=True,
                          text=True).stdout


def version(python: str) -> str:
    return subprocess.run([python, "-c", "import sys, zarr; print(f'zarr {zarr.__version__}, Python {sys.version.split()[0]}')"],
                          check=True, capture_output=True, text=True).stdout.strip()


def objects(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file()}


def main(a: str, b: str) -> None:
    reference = json.loads((TESTS / "data" / "analysis-dump.json").read_text())
    stores = []
    with tempfile.TemporaryDirectory() as tmp:
        for writer, analyzer in ((a, b), (b, a)):
            folder = Path(tmp) / str(len(stores))
            folder.mkdir()
            run(writer, "write", folder)
            run(analyzer, "analyze", folder)
            got = json.loads(run(writer, "check", folder))
            what = f"written with {version(writer)}, analyzed with {version(analyzer)}"
            if got != reference:
                raise SystemExit(f"a store {what}: its analysis differs from tests/data/analysis-dump.json")
            print(f"a store {what}: valid, its analysis equals the reference")
            stores.append(objects(folder / "dump.zarr"))
    if stores[0] != stores[1]:
        differ = sorted(k for k in stores[0].keys() | stores[1].keys() if stores[0].get(k) != stores[1].get(k))
        raise SystemExit(f"the two stores differ in {len(differ)} objects, e.g. {differ[:3]}")
    print(f"the two stores are identical ({len(stores[0])} objects)")


if __name__ == "__main__":
    if sys.argv[1] == "--step":
        step(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
