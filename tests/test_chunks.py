"""``read_chunk``, which reads one stored chunk of a run's array without zarr's pipeline, against
zarr-python reading the same selection: every array of synthetic runs, arrays of any sharding
(hypothesis), chunks not stored, and damaged shards named in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngeom.errors import CorruptChunkError
from attngeom.store import compressors, read_chunk
from attngeom.store.extracted.chunks import _address
from attngeom.store.objects.codecs import decoded
from attngeom.store.session import StoreSession
from attngeom.extract.synthetic import write_synthetic_run


def zarr_read(arr: zarr.Array, key: tuple[int, ...]) -> np.ndarray:
    return decoded(np.asarray(arr[key]), (arr.attrs.get("attngeom") or {}).get("encoding"))


@pytest.mark.parametrize("values_dtype", ["float32", "bfloat16", "float16"])
def test_every_array_of_a_run_reads_as_zarr_reads_it(tmp_path, values_dtype):
    url = str(tmp_path / "s.zarr")
    write_synthetic_run(url, "r", n_seq=3, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=24,
                        queries=(7, 15), values_dtype=values_dtype)
    direct = set()
    with StoreSession(url) as session:
        run = session.run("r")
        for name in run.array_keys():
            arr = run[name]
            for key in [(s,) for s in range(arr.shape[0])] + [(s, layer) for s in range(arr.shape[0])
                                                              for layer in range(arr.shape[1] if arr.ndim > 1 else 0)]:
                got, want = read_chunk(url, arr, key), zarr_read(arr, key)
                assert got.dtype == want.dtype and got.shape == want.shape, (name, key)
                np.testing.assert_array_equal(got, want, err_msg=f"{name}{key}")
                if _address(arr, key) is not None:
                    direct.add(name)
    # The analysis' inputs, and the per-sequence summaries, are read directly.
    assert {"attn_last", "values", "winner", "attn_rows", "sink_attn", "prev_attn", "recent_attn"} <= direct


@st.composite
def layouts(draw):
    """(shape, inner chunk, shard or None, key) of a 4-d float32 array and a selection of
    its leading dimensions."""
    shape = tuple(draw(st.integers(1, 4)) for _ in range(4))
    # Leading dimensions split into chunks of 1 or not at all; the rest whole, or split.
    inner = tuple(draw(st.sampled_from([1, n])) for n in shape[:2]) + tuple(
        draw(st.sampled_from(sorted({1, n}))) for n in shape[2:])
    shard = None
    if draw(st.booleans()):  # edge shards may be partial
        shard = tuple(c * draw(st.integers(1, -(-n // c))) for n, c in zip(shape, inner))
    m = draw(st.integers(1, 2))
    key = tuple(draw(st.integers(0, n - 1)) for n in shape[:m])
    return shape, inner, shard, key


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts(), empty=st.booleans())
def test_any_layout_reads_as_zarr_reads_it(tmp_path_factory, layout, empty):
    shape, inner, shard, key = layout
    url = str(tmp_path_factory.mktemp("layout") / "a.zarr")
    arr = zarr.create_array(url, shape=shape, dtype="float32", chunks=inner, shards=shard, fill_value=7.5,
                            compressors=compressors(np.dtype("float32")))
    data = np.arange(np.prod(shape), dtype="float32").reshape(shape)
    if empty:  # chunks all fill value are not stored
        data[key] = 7.5
    arr[...] = data
    np.testing.assert_array_equal(read_chunk(url, arr, key), zarr_read(arr, key))


def test_a_shard_not_stored_reads_as_its_fill_value(tmp_path):
    url = str(tmp_path / "a.zarr")
    arr = zarr.create_array(url, shape=(2, 3, 5), dtype="int16", chunks=(1, 1, 5), shards=(1, 3, 5), fill_value=-1,
                            compressors=compressors(np.dtype("int16")))
    arr[0] = 4
    assert _address(arr, (1, 2)) is not None
    np.testing.assert_array_equal(read_chunk(url, arr, (1, 2)), np.full(5, -1, dtype="int16"))
    np.testing.assert_array_equal(read_chunk(url, arr, (0, 2)), np.full(5, 4, dtype="int16"))


def shard_of(tmp_path: Path) -> tuple[str, zarr.Array, Path]:
    url = str(tmp_path / "a.zarr")
    arr = zarr.create_array(url, shape=(2, 3, 64), dtype="float32", chunks=(1, 1, 64), shards=(1, 3, 64),
                            compressors=compressors(np.dtype("float32")))
    arr[...] = np.random.default_rng(0).normal(size=(2, 3, 64))
    return url, arr, tmp_path / "a.zarr/c/1/0/0"


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-10] + bytes([b[-10] ^ 1]) + b[-9:], "the shard's index fails its crc32c checksum"),
    (lambda b: b[:30] + bytes([b[30] ^ 1]) + b[31:], "Stored and computed checksum do not match"),
    (lambda b: b[-52:], "the shard's index points beyond its chunks"),  # the index alone
    (lambda b: b[-40:], "the shard is shorter than its index"),
])
def test_a_damaged_shard_is_named_in_one_line(tmp_path, damage, why):
    url, arr, path = shard_of(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptChunkError) as caught:
        for layer in range(3):
            read_chunk(url, arr, (1, layer))
    message = str(caught.value)
    assert "chunk c/1/0/0 is damaged" in message
    assert why in message and "\n" not in message
    np.testing.assert_array_equal(read_chunk(url, arr, (0, 1)), np.asarray(arr[0, 1]))
