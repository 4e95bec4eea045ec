#!/usr/bin/env python
"""Are two extract stores equal to a tolerance? (run by hand, e.g. before/after a capture change)

    python tools/store_equality.py before.zarr after.zarr            # every run in both
    python tools/store_equality.py before.zarr after.zarr --atol 1e-6

Walks every array of every group present in both stores and compares it whole: integer and
boolean arrays (winners, token ids, masks) must be equal exactly, float arrays (rows, values,
summaries) to ``--atol`` in absolute value. Prints one line per array with its largest
difference and the count of differing elements; exits 1 when any array differs beyond the
tolerance or is missing from one side.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import zarr


def arrays(group: zarr.Group, prefix: str = "") -> dict[str, zarr.Array]:
    """Every array under ``group``, by its path."""
    found: dict[str, zarr.Array] = {}
    for name, member in group.members():
        path = f"{prefix}/{name}" if prefix else name
        if isinstance(member, zarr.Array):
            found[path] = member
        else:
            found.update(arrays(member, path))
    return found


def compare(a: np.ndarray, b: np.ndarray, atol: float) -> tuple[bool, float, int]:
    """(equal within tolerance, largest absolute difference, count of differing elements)."""
    if a.shape != b.shape:
        return False, float("inf"), -1
    if np.issubdtype(a.dtype, np.floating):
        both_nan = np.isnan(a) & np.isnan(b)
        diff = np.where(both_nan, 0.0, np.abs(a.astype("float64") - b.astype("float64")))
        worst = float(np.nanmax(diff)) if diff.size else 0.0
        return worst <= atol, worst, int(np.count_nonzero(diff))
    differ = int(np.count_nonzero(a != b))
    return differ == 0, float(differ > 0), differ


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--atol", type=float, default=1e-6, help="largest allowed |before - after| of float arrays")
    args = p.parse_args()
    left, right = arrays(zarr.open_group(args.before, mode="r")), arrays(zarr.open_group(args.after, mode="r"))
    ok = True
    for path in sorted(left.keys() | right.keys()):
        if path not in left or path not in right:
            print(f"{path}: only in {'before' if path in left else 'after'}")
            ok = False
            continue
        a, b = left[path][...], right[path][...]
        same, worst, differ = compare(np.asarray(a), np.asarray(b), args.atol)
        kind = "float" if np.issubdtype(np.asarray(a).dtype, np.floating) else "exact"
        print(f"{path} {np.asarray(a).dtype} {np.asarray(a).shape} [{kind}]: max |diff| {worst:.3g}, "
              f"{differ} differ{'' if same else '  <-- FAIL'}")
        ok &= same
    print("EQUAL" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
