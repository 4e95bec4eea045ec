"""How arrays are encoded: Blosc with bitshuffle (zstd; lz4 for the value vectors), then a crc32c
checksum of each chunk; a shard's inner chunks one after another, then its index."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import crc32c
import numpy as np
from numcodecs import Blosc
from numcodecs.blosc import decompress
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

from attngeom.store.objects.schema import BFLOAT16

# zstd with bitshuffle at level 3: benchmarks/extract_store_size.py measured levels 1/3/5/9
# on gemma3-270m and smollm2-135m (L=1024): 3 is 3-7% larger than 9 but compresses 35-65x
# faster (9 would cost 3-6 s a sequence), and 5 gains under 1% over 3.
BLOSC_LEVEL = 3
DEFAULT_CODEC = ("zstd", BLOSC_LEVEL)

# Value vectors are noise to a compressor: per sequence at L=1024, float32, zstd level 3 stores
# them 1.15x (smollm2-135m) and 1.12x (gemma3-270m), lz4 level 9 1.15x and 1.13x, at a quarter
# of the CPU time (0.015 against 0.057 s). They are most of a run's bytes, and on a GPU their
# encoding is the largest CPU cost of extract. lz4 level 5 (Blosc's smaller blocks) stores them
# 1% larger than level 9 at 1.07-1.12x its speed on those models, and 1.6x on a random-weight
# model whose values compress more (docs/design-notes.md#writer).
VALUES_CODEC = ("lz4", 5)


def compressor(typesize: int, codec: tuple[str, int] = DEFAULT_CODEC) -> BloscCodec:
    """Blosc with bitshuffle; ``codec`` is (cname, level): ``DEFAULT_CODEC`` for every array of
    the store but ``values`` (``VALUES_CODEC``)."""
    cname, level = codec
    return BloscCodec(cname=cname, clevel=level, shuffle="bitshuffle", typesize=typesize)


def compressors(dtype: np.dtype, codec: tuple[str, int] = DEFAULT_CODEC) -> tuple[BloscCodec, Crc32cCodec]:
    """The bytes-to-bytes codecs of every array written in format 2: Blosc (``compressor``),
    then a crc32c checksum of the compressed chunk."""
    typesize = dtype.itemsize if dtype.kind not in "OUS" else 1
    return compressor(typesize, codec), Crc32cCodec()


def _codec_chain(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The codecs applied to each stored chunk: a shard's inner chunks for a sharded array
    (its index carries its own checksum)."""
    codecs = metadata["codecs"]
    if codecs and codecs[0]["name"] == "sharding_indexed":
        return codecs[0]["configuration"]["codecs"]
    return codecs


def has_checksum(metadata: Mapping[str, Any]) -> bool:
    """Whether the array of this ``zarr.json`` ends every chunk with a crc32c checksum."""
    return any(c["name"] == "crc32c" for c in _codec_chain(metadata))


def with_checksum(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """This ``zarr.json`` with a crc32c checksum appended to each chunk's codecs."""
    out = json.loads(json.dumps(metadata))
    if not has_checksum(out):
        _codec_chain(out).append({"name": "crc32c"})
    return out


def chunk_encoder(metadata: Mapping[str, Any]) -> Callable[[np.ndarray], tuple[bytes, bytes]]:
    """The stored bytes of one chunk (its full chunk shape) of the array of this
    ``zarr.json``, as zarr-python encodes them, in two parts stored one after the other:
    little-endian bytes compressed by Blosc, then their 4-byte crc32c checksum. Only that
    chain, the one every derived array has (:func:`compressors`). Blosc works outside the
    GIL, so chunks encode in parallel on threads."""
    names = [codec["name"] for codec in metadata["codecs"]]
    if names != ["bytes", "blosc", "crc32c"]:
        raise ValueError(f"no encoder for the codecs {names}")
    config = metadata["codecs"][1]["configuration"]
    blosc = Blosc(cname=config["cname"], clevel=config["clevel"], shuffle=_SHUFFLES[config["shuffle"]],
                  blocksize=config["blocksize"], typesize=config["typesize"])
    little = np.dtype(metadata["data_type"]).newbyteorder("<")

    # The checksum stays beside the compressed bytes, written after them (a vectored write):
    # joining them would copy every stored byte once more, into freshly faulted memory, at
    # a cost near the compression's own on a 7B model's values.
    def encode(chunk: np.ndarray) -> tuple[bytes, bytes]:
        compressed = blosc.encode(np.ascontiguousarray(chunk, dtype=little))
        return compressed, crc32c.crc32c(compressed).to_bytes(4, "little")

    return encode


def codec_setting(x: Any) -> Any:
    """A codec setting as its name in a ``zarr.json``: zarr-python holds some as enums, and
    newer releases as strings."""
    return getattr(x, "value", x)


def can_decode(codecs: Sequence[Any]) -> bool:
    """Whether chunks with the zarr codecs ``codecs`` (an unsharded array's, or a shard's
    inner chunks') are stored as :func:`chunk_encoder` encodes them, which
    :func:`decode_chunk` reads: little-endian bytes, Blosc, then crc32c."""
    return (len(codecs) == 3 and isinstance(codecs[0], BytesCodec) and isinstance(codecs[1], BloscCodec)
            and isinstance(codecs[2], Crc32cCodec) and codec_setting(codecs[0].endian) in (None, "little")
            and sys.byteorder == "little")


def decode_chunk(data: bytes | memoryview, out: np.ndarray) -> np.ndarray:
    """``out`` (the chunk's full shape and data type) holding the chunk whose stored bytes,
    as :func:`chunk_encoder` encodes them, are ``data``: ValueError when their checksum or
    their size does not match. What zarr-python's codecs read, without a copy."""
    data = memoryview(data)
    body = data[:-4]
    if len(data) < 20 or crc32c.crc32c(body) != int.from_bytes(data[-4:], "little"):
        raise ValueError("Stored and computed checksum do not match")  # zarr-python's words
    # Blosc's header holds the size it decompresses to (bytes 4-8); a larger output would be
    # left partly unwritten.
    size = int.from_bytes(body[4:8], "little")
    if size != out.nbytes:
        raise ValueError(f"the chunk holds {size} bytes, not {out.nbytes}")
    decompress(body, out)
    return out


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns ``bits`` (uint16), exactly."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def decoded(x: np.ndarray, encoding: str | None) -> np.ndarray:
    """A run array's stored values ``x`` as its values: float32 for the ``bfloat16``
    encoding (schema ``VALUE_ENCODINGS``), ``x`` itself for none."""
    if encoding is None:
        return x
    if encoding != BFLOAT16:
        raise ValueError(f"unknown values encoding {encoding!r}")
    return bfloat16_values(x)


def object_chunks(metadata: Mapping[str, Any], values: np.ndarray | Sequence[np.ndarray],
                  ) -> tuple[Callable[[np.ndarray], tuple[bytes, bytes]], list[np.ndarray], bool]:
    """How the stored object of one whole chunk of the array of this ``zarr.json`` holds
    ``values`` (the chunk's full shape, or the shard's for a sharded array; or its parts
    along the second axis, a run's layer axis, each without the first two axes): the encoder
    of its chunks (:func:`chunk_encoder`, which also converts them to the stored dtype),
    those chunks in their stored order, and whether they are a shard's inner chunks, to be
    followed by :func:`shard_index`. Every chunk is stored, also one all fill value. The
    bytes are zarr-python's own: a shard is the layout its sharding codec writes (inner
    chunks in Morton order, index at the end, crc32c over the index), for shards whose inner
    chunks split one dimension only, where Morton order is their order along it (a run's
    arrays: an inner chunk per layer)."""
    codecs = metadata["codecs"]
    shape = tuple(metadata["chunk_grid"]["configuration"]["chunk_shape"])
    sharded = codecs[0]["name"] == "sharding_indexed"
    if sharded:
        config = codecs[0]["configuration"]
        index_codecs = [c["name"] for c in config["index_codecs"]]
        if config.get("index_location", "end") != "end" or index_codecs != ["bytes", "crc32c"]:
            raise ValueError(f"no encoder for a shard index {index_codecs} at the {config.get('index_location')}")
        inner = tuple(config["chunk_shape"])
        split = [axis for axis, (s, c) in enumerate(zip(shape, inner)) if s != c]
        if len(split) > 1 or any(s % c for s, c in zip(shape, inner)):
            raise ValueError(f"no encoder for shards of {shape} in inner chunks of {inner}")
        encode = chunk_encoder({**metadata, "codecs": config["codecs"]})
    else:
        encode = chunk_encoder(metadata)
    if isinstance(values, list | tuple):
        if (sharded and inner == (1, 1) + shape[2:] and shape[:2] == (1, len(values))
                and all(part.shape == shape[2:] for part in values)):
            return encode, [part[None, None] for part in values], True  # an inner chunk per part: no copy
        values = np.stack(values)[None]
    if values.shape != shape:
        raise ValueError(f"a chunk of shape {shape} cannot hold values of shape {values.shape}")
    if not sharded:
        return encode, [values], False
    axis = split[0] if split else 0
    return encode, [values[(slice(None),) * axis + (slice(i, i + inner[axis]),)]
                    for i in range(0, shape[axis], inner[axis])], True


def shard_index(sizes: Sequence[int]) -> bytes:
    """The index that ends a shard whose inner chunks of ``sizes`` bytes are stored one after
    another from its start: (offset, length) as little-endian uint64 per chunk, then the
    crc32c of those bytes."""
    lengths = np.asarray(sizes, dtype="<u8")
    index = np.stack([np.cumsum(lengths) - lengths, lengths], axis=-1).astype("<u8").tobytes()
    return index + crc32c.crc32c(index).to_bytes(4, "little")


# Blosc's shuffle modes by their names in a zarr.json.
_SHUFFLES = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
