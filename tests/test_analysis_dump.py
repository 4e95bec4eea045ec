"""The whole analysis of a synthetic store (two runs: full causal attention; a sliding window
with stored queries) equals the reference ``tests/data/analysis-dump.json``: every array of
every group, value for value, and every stored object, byte for byte. The reference is made
by ``tests/analysis_dump.py`` (see its docstring); it changes only with ``ANALYSIS_VERSION``."""

from __future__ import annotations

import json
from pathlib import Path

from analysis_dump import analyzed_dump

REFERENCE = Path(__file__).parent / "data" / "analysis-dump.json"


def test_analysis_equals_the_reference(tmp_path):
    reference = json.loads(REFERENCE.read_text())
    got = json.loads(json.dumps(analyzed_dump(tmp_path), sort_keys=True))
    assert sorted(got["arrays"]) == sorted(reference["arrays"])
    assert {k: v for k, v in got["arrays"].items() if v != reference["arrays"][k]} == {}
    assert sorted(got["objects"]) == sorted(reference["objects"])
    assert {k: v for k, v in got["objects"].items() if v != reference["objects"][k]} == {}
