"""The whole analysis of a synthetic store (two runs: full causal attention; a sliding window
with stored queries) equals the reference ``tests/data/analysis-dump.json``: every array of
every group, value for value, and every stored object, byte for byte (the leave-one-out sums,
compiled with reassociation, within a relative 1e-9: see ``tests/analysis_dump.py``). The reference is made
by ``tests/analysis_dump.py`` (see its docstring); it changes only with ``ANALYSIS_VERSION``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from analysis_dump import analyzed_dump, reassociated

REFERENCE = Path(__file__).parent / "data" / "analysis-dump.json"


def test_analysis_equals_the_reference(tmp_path):
    reference = json.loads(REFERENCE.read_text())
    got = json.loads(json.dumps(analyzed_dump(tmp_path), sort_keys=True))
    assert sorted(got["arrays"]) == sorted(reference["arrays"])
    assert {k: v for k, v in got["arrays"].items() if v != reference["arrays"][k] and not reassociated(k)} == {}
    for key in filter(reassociated, got["arrays"]):
        got_array, want = got["arrays"][key], reference["arrays"][key]
        assert (got_array["shape"], got_array["dtype"]) == (want["shape"], want["dtype"]), key
        np.testing.assert_allclose(np.array(got_array["values"], dtype=float), np.array(want["values"], dtype=float),
                                   rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=key)
    assert sorted(got["objects"]) == sorted(reference["objects"])
    assert {k: v for k, v in got["objects"].items() if v != reference["objects"][k]} == {}
