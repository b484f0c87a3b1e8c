"""NVML's numbers made readable, for any NVML backend (libnvidia-ml or the emulator).

Discovery, health and MIG management need these whether the GPUs are real or not, so
they live apart from the emulator, which uses them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import pynvml

__all__ = [
    "DRIVER_NOT_LOADED_FIX",
    "FULL_GPU_INSTANCE_ID",
    "RECOVERY_ACTION_XID",
    "constant_names",
    "describe_nvml_error",
    "nvml_start_problem",
]

# gpuInstanceId/computeInstanceId of an event that concerns the whole GPU.
FULL_GPU_INSTANCE_ID: Final = 0xFFFFFFFF

# XID 154, "GPU recovery action changed" (NVIDIA's XID catalogue): raised with the XID
# that caused it; field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION says what the GPU needs now.
RECOVERY_ACTION_XID: Final = 154


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


_NO_LIBRARY: Final = frozenset(
    {pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
)
DRIVER_NOT_LOADED_FIX: Final = "load it (modprobe nvidia) or finish its installation"
"""What to do where `nvml_start_problem` says the kernel driver is not loaded."""


def nvml_start_problem(code: object) -> str | None:
    """What an nvmlInit failure with NVML error `code` says about the machine: no usable
    library, or no kernel driver; None for any other failure. The node agent and the
    recorder say the same, each with its own remedy for a missing library."""
    if code in _NO_LIBRARY:
        return "no usable NVML library: loading libnvidia-ml.so.1 failed"
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA kernel driver is not loaded"
    return None
