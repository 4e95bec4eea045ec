"""Where a model's modules go when it is larger than one device (``--device-map``), checked
without torch: accelerate places them when the model loads (docs/cli.md#models)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from attngeom.errors import InputError

__all__ = ["DEVICE_MAP_STRATEGIES", "parse_device_map", "uses_accelerator"]

# accelerate's strategies: every GPU, then the CPU, then the disk, as each fills.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE = re.compile(r"^(cpu|disk|mps|cuda(:\d+)?|\d+)$")


def parse_device_map(value: str | Mapping[str, Any] | None) -> str | dict[str, str | int] | None:
    """None, a strategy of ``DEVICE_MAP_STRATEGIES``, or an explicit map of module names to
    devices ("cpu", "disk", "cuda:N" or a GPU index), given as a mapping or a JSON object."""
    if value is None or (isinstance(value, str) and value in DEVICE_MAP_STRATEGIES):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise InputError(f"--device-map takes {', '.join(DEVICE_MAP_STRATEGIES)} or a JSON object of module "
                             'names to devices, e.g. \'{"model.layers.0": 0, "model.layers.1": "cpu"}\'')
    if not value:
        raise InputError("--device-map names no module")
    bad = [f"{module}: {device!r}" for module, device in value.items() if not _DEVICE.match(str(device))]
    if bad:
        raise InputError(f"--device-map: {', '.join(bad)} is no device (cpu, disk, cuda:N or a GPU index)")
    return {str(module): (int(device) if str(device).isdigit() else str(device)) for module, device in value.items()}


def uses_accelerator(device_map: str | dict[str, str | int]) -> bool:
    """Whether a map places modules on an accelerator (a strategy does, where there is one)."""
    if isinstance(device_map, str):
        return True
    return any(str(device) not in ("cpu", "disk") for device in device_map.values())
