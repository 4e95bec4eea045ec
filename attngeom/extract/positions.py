"""How many positions a model takes, read from its metadata (a config or a GGUF header), never
from its weights: extract refuses a context length L beyond them before the model loads."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from attngeom.errors import InputError
from attngeom.options import refusal

__all__ = ["POSITION_KEYS", "Positions", "check_context_length", "config_positions", "gguf_positions"]


@dataclass(frozen=True)
class Positions:
    """limit: the positions the model was trained for (``max_position_embeddings``, a GGUF's
    ``<arch>.context_length``), None when its metadata names none; window: the sliding window
    of its local layers (keys), None without one. The window bounds what a local layer
    attends to, not how long a context may be: the limit is what holds."""

    limit: int | None
    window: int | None = None


# The names a config.json gives its position limit: transformers' own, then those its config
# classes map to it (``attribute_map``: GPT-2, GPT-J, CodeGen, StarCoder; DBRX; Kimi Linear),
# which a config object answers under the first name but its JSON file does not.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "model_max_length")


def config_positions(config: Mapping[str, Any] | Any) -> Positions:
    """The positions of a transformers config, as an object or as its ``config.json`` mapping
    (a multimodal config's ``text_config`` when it has one)."""

    def get(source: Any, key: str) -> Any:
        return source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)

    text = get(config, "text_config") or config
    limit = next((value for key in POSITION_KEYS if (value := get(text, key))), None)
    window = get(text, "sliding_window")
    # A model without a position limit (XLNet) says -1.
    return Positions(int(limit) if limit and int(limit) > 0 else None, int(window) if window else None)


def check_context_length(length: int, positions: Positions, model: str, option: str | type = "--context-length"
                         ) -> None:
    """Refuse ``length`` (L: BOS plus L-1 tokens) beyond the model's position limit, naming the
    option in its caller's words: a request dataclass whose ``context_length`` it is (its keyword
    to a Python caller, its flag on the command line: :func:`attngeom.options.refusal`), or a
    command's option, its flag (``--length``: ``length=`` to a Python caller)."""
    if positions.limit is None or length <= positions.limit:
        return
    window = (
        f" (its sliding window of {positions.window:,} keys bounds its local layers' attention, not the positions)"
        if positions.window else ""
    )
    if isinstance(option, type):
        raise refusal("{context_length:{given}} is more than the {limit} positions {which} takes{bound}; "
                      "use {context_length:{least}} or less", option, given=f"{length:,}",
                      limit=f"{positions.limit:,}", which=model, bound=window, least=positions.limit)
    keyword = option.lstrip("-").replace("-", "_")
    template = "{} is more than the {:,} positions {} takes{}; use {} or less"
    raise InputError(
        template.format(f"{keyword}={length:,}", positions.limit, model, window, f"{keyword}={positions.limit}"),
        command_line=template.format(f"{option} {length:,}", positions.limit, model, window,
                                     f"{option} {positions.limit}"),
    )


# GGUF value types (gguf.md of ggml): fixed-size scalars by their struct format; 8 is a
# string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_positions(parts: Iterable[Path]) -> Positions:
    """The positions a GGUF file's header names (``<arch>.context_length`` and
    ``<arch>.attention.sliding_window``), reading only its metadata; ``parts``: the file, or
    the pieces that concatenated make it. :class:`InputError` when it is not a GGUF file."""
    with _Chained([Path(p) for p in parts]) as f:
        if f.read(4) != b"GGUF":
            raise InputError(f"{f.name} is not a GGUF file (no GGUF magic)")
        version = _read(f, "<I")
        count = "<I" if version == 1 else "<Q"
        _read(f, count)  # tensors
        found: dict[str, Any] = {}
        for _ in range(_read(f, count)):
            key, kind = _string(f, count), _read(f, "<I")
            value = _value(f, kind, count)
            found[key] = value
            arch = found.get("general.architecture")
            limit, window = f"{arch}.context_length", f"{arch}.attention.sliding_window"
            if limit in found and (window in found or key.startswith("tokenizer.")):
                # The model's keys come before the tokenizer's (vocabularies of 10^5 strings).
                break
    arch = found.get("general.architecture")
    return Positions(found.get(f"{arch}.context_length"), found.get(f"{arch}.attention.sliding_window"))


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise InputError(f"{f.name}: its GGUF header ends early")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO, count: str) -> str:
    return f.read(_read(f, count)).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int, count: str) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f, count)
    if kind == _ARRAY:
        item, n = _read(f, "<I"), _read(f, count)
        if item in _SCALARS:
            f.read(n * struct.calcsize(_SCALARS[item]))
        else:
            for _ in range(n):
                _value(f, item, count)
        return None  # arrays (vocabularies, merges) are not what is looked for
    raise InputError(f"{f.name}: unknown GGUF value type {kind}")


class _Chained:
    """The concatenation of files, read front to back (a GGUF shipped in pieces)."""

    def __init__(self, paths: list[Path]) -> None:
        self.name = str(paths[0])
        self._paths, self._file = list(paths), None

    def __enter__(self) -> _Chained:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def read(self, size: int) -> bytes:
        out = b""
        while len(out) < size:
            if self._file is None:
                if not self._paths:
                    break
                self._file = open(self._paths.pop(0), "rb", buffering=1 << 20)  # noqa: SIM115
            block = self._file.read(size - len(out))
            if not block:
                self._file.close()
                self._file = None
            out += block
        return out
