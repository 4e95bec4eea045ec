"""The tidy table of an analysis: one row per (variable, layer, head, n) of ``summary``, as a
pandas DataFrame (``--out``'s Parquet and CSV) and as the ``table`` group."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from attngeom.store import STATS
from attngeom.store.extracted.datasets import encode_labels

__all__ = ["TABLE_COLUMNS", "table_dataset", "tidy_table"]

TABLE_COLUMNS = ("run", "model", "dataset", "context_length", "layer", "head", "n", "variable", *STATS)


def tidy_table(summary: xr.Dataset, provenance: dict, run_id: str) -> pd.DataFrame:
    """Long table: run, model, dataset, L, layer, head, n, variable, mean, median, q05, q95, count."""
    frame = summary.to_array("variable").to_dataset("stat").to_dataframe().reset_index()
    frame.insert(0, "run", run_id)
    frame.insert(1, "model", provenance.get("model", {}).get("id"))
    frame.insert(2, "dataset", provenance.get("dataset", {}).get("id"))
    frame.insert(3, "context_length", provenance.get("context_length"))
    frame = frame[list(TABLE_COLUMNS)]
    text = ["run", "model", "dataset", "variable"]
    frame[text] = frame[text].astype(object)
    return frame


def table_dataset(summary: xr.Dataset, provenance: dict, run_id: str) -> xr.Dataset:
    """The ``table`` group: :func:`tidy_table` row for row, (variable, layer, head, n) in
    that order, its text columns already label codes (:func:`encode_labels`). Built from
    the summary's arrays, its text columns coded on their few distinct values: a frame of
    strings coded row by row grows with the rows (hundreds of thousands for a 7B model)."""
    names = list(summary.data_vars)
    axes = [np.asarray(names, dtype=object), *(summary[d].values for d in ("layer", "head", "n"))]
    rows = int(np.prod([a.size for a in axes]))

    def column(x: np.ndarray, axis: int) -> np.ndarray:
        """x (one value per entry of axes[axis]) in each row."""
        inner = int(np.prod([a.size for a in axes[axis + 1:]]))
        return np.tile(np.repeat(x, inner), rows // (x.size * inner))

    def constant(value: Any) -> np.ndarray:
        return pd.Series([value]).to_numpy()  # the data type pandas gives the inserted column

    # The text columns are coded on their few distinct values, then spread over the rows.
    few = encode_labels(xr.Dataset({
        "run": ("one", constant(run_id)),
        "model": ("one", constant(provenance.get("model", {}).get("id"))),
        "dataset": ("one", constant(provenance.get("dataset", {}).get("id"))),
        "context_length": ("one", constant(provenance.get("context_length"))),
        "variable": ("names", axes[0]),
    }))
    stats = np.stack([summary[name].transpose("stat", "layer", "head", "n").values for name in names])
    columns = {name: (np.repeat(few[name].values, rows), few[name].attrs)
               for name in ("run", "model", "dataset", "context_length")}
    columns.update({name: (column(axes[i], i), {}) for i, name in ((1, "layer"), (2, "head"), (3, "n"))})
    columns["variable"] = (column(few["variable"].values, 0), few["variable"].attrs)
    at = {stat: i for i, stat in enumerate(summary["stat"].values)}
    columns.update({stat: (stats[:, at[stat]].ravel(), {}) for stat in STATS})
    return xr.Dataset({name: xr.Variable("row", x, attrs) for name, (x, attrs) in columns.items()},
                      coords={"row": np.arange(rows)})
