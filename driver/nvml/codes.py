"""NVML's numbers made readable, for any NVML backend (libnvidia-ml or the emulator).

Discovery, health and MIG management need these whether the GPUs are real or not, so
they live apart from the emulator, which uses them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import pynvml

__all__ = ["FULL_GPU_INSTANCE_ID", "constant_names", "describe_nvml_error"]

# gpuInstanceId/computeInstanceId of an event that concerns the whole GPU.
FULL_GPU_INSTANCE_ID: Final = 0xFFFFFFFF


def constant_names(prefix: str) -> Mapping[int, str]:
    """pynvml's constant names starting with `prefix`, by value (the first name wins)."""
    names: dict[int, str] = {}
    for name in sorted(dir(pynvml)):
        if name.startswith(prefix) and not name.endswith("_COUNT"):
            value = getattr(pynvml, name)
            if isinstance(value, int):
                names.setdefault(value, name)
    return MappingProxyType(names)


def describe_nvml_error(err: BaseException) -> str:
    """`str(err)` plus the NVML_ERROR_* name: pynvml can only spell some codes itself."""
    code = getattr(err, "value", None)
    name = constant_names("NVML_ERROR_").get(code) if isinstance(code, int) else None
    return f"{err} ({name})" if name else str(err)
