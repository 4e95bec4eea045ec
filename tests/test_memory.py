"""analyze stays within a memory budget on a store several times larger than the budget."""

from __future__ import annotations

import tracemalloc

import xarray as xr

from attngeom.analyze.kernels import compile_kernels
from attngeom.api import analyze
from attngeom.extract.synthetic import write_synthetic_run

# Measured peak: 58, 59 and 62 MiB for 16, 64 and 128 sequences (32 to 256 MiB of values;
# tracemalloc counts every numpy and Python allocation of this process, threads included).
BUDGET = 72 * 2**20


def test_analyze_peak_memory_is_bounded_by_a_chunk_not_the_store(tmp_path):
    store = str(tmp_path / "big.zarr")
    layout = write_synthetic_run(store, "big", n_seq=96, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=256, length=512)
    values_bytes = 96 * layout.n_layers * layout.n_kv_heads * layout.length * layout.head_dim * 4
    assert values_bytes > 2 * BUDGET
    compile_kernels()  # once per process (about 20 MiB of compiled code), not per store
    tracemalloc.start()
    try:
        analyze(store, scheduler="threads", n_grid=[1, 8, 64], progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BUDGET, f"peak {peak / 2**20:.1f} MiB"
    topn = xr.open_zarr(store, group="runs/big/analysis/topn", consolidated=False)
    assert dict(topn.sizes) == {"seq": 96, "layer": 4, "head": 2, "n": 3}
    assert bool((topn["inversions"] <= topn["k_sink_exact"]).all())
