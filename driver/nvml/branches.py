"""What each NVIDIA driver branch's NVML offers, for the emulator and the driver alike.

libnvidia-ml grows with every driver branch: functions appear (calling one on an older
driver gives NVML_ERROR_FUNCTION_NOT_FOUND, pynvml's `NVMLError_FunctionNotFound`), and
enums gain values (an index an older driver does not know is NVML_ERROR_INVALID_ARGUMENT).
The emulator answers as the branch its profile names; the driver checks here which
branch it may rely on and refuses, with a message naming the library it found, a
branch older than the oldest one it supports.

The table holds only what the driver (or a recording) calls and is newer than the
oldest supported branch; everything else the driver calls exists on R535.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import pynvml

__all__ = [
    "EMULATED_BRANCHES",
    "FUNCTIONS_SINCE",
    "GPU_INSTANCE_PROFILES_SINCE",
    "OLDEST_SUPPORTED_BRANCH",
    "PLACEMENTS_WITHOUT_MIG_SINCE",
    "RECOVERY_ACTION_SINCE",
    "UNREPAIRABLE_MEMORY_ENTRY",
    "BranchError",
    "driver_branch",
    "has_function",
    "has_gpu_instance_profile",
]

# The oldest production branch gpudra supports (R535, long-term support until 2026).
OLDEST_SUPPORTED_BRANCH: Final = 535
# The branches the emulator has profiles of (docs/gpus.md lists what works on each).
EMULATED_BRANCHES: Final = (535, 550, 570, 580, 590)

# The entry point of the unrepairable-memory flag (Hopper and newer, R590 and later).
UNREPAIRABLE_MEMORY_ENTRY: Final = "nvmlDeviceGetUnrepairableMemoryFlag_v1"

# NVML entry points newer than OLDEST_SUPPORTED_BRANCH, by the first branch that has them.
# Each is first declared in the nvml.h of that branch's NVML version (NVIDIA/go-nvml keeps
# every header: 12.4 is R550, 12.8 R570, 12.9 R575, 13.0 R580).
FUNCTIONS_SINCE: Final[Mapping[str, int]] = MappingProxyType(
    {
        # NVML 12.4: the R535 header (12.2) has no such entry point; discovery reads the
        # NUMA node from sysfs there (`gpudra.driver.nvml.topology`).
        "nvmlDeviceGetNumaNodeId": 550,
        "nvmlDeviceGetGpuInstanceProfileInfoById": 580,
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV": 580,
        # NVML 13.0 (12.9, R575, has no such entry point): HMM or ATS, how the GPU
        # reaches memory the CPU allocated; discovery publishes it as `addressingMode`.
        "nvmlDeviceGetAddressingMode": 580,
        # NVML change log, "Changes between v580 and v590"; first declared in the NVML
        # 13.1 header (13.0, R580, has no such entry point). Read through the library's
        # own symbol, not pynvml's wrapper (`gpudra.driver.nvml.unrepairable` says why).
        UNREPAIRABLE_MEMORY_ENTRY: 590,
    }
)

# The first branch whose NVML has the GPU recovery action (field
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and XID 154; NVML change log, R565).
RECOVERY_ACTION_SINCE: Final = 565

# GPU-instance profile indices (NVML_GPU_INSTANCE_PROFILE_*) newer than R535: the
# graphics variants (NVML 12.8, R570) and the "no media engine" / "all media engines"
# variants (NVML 12.9, R575). A branch that knows an index may still offer no profile
# there: that is the product's (profiles), not the branch's.
GPU_INSTANCE_PROFILES_SINCE: Final[Mapping[int, int]] = MappingProxyType(
    {
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: 570,
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: 570,
        # Unknown to R580: 580.159.04 answers it INVALID_ARGUMENT (a recording of an
        # H200, tests/nvml/answers). NVIDIA's Python bindings, numbered by the branch
        # whose NVML they wrap, first declare it in 13.610.43 (R610); 13.580.126,
        # 13.590.44 and 13.595.45 do not.
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX: 610,
        pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: 570,
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: 575,
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: 575,
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: 575,
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: 575,
    }
)

# From this branch on, NVML lists a GPU instance profile's placements while MIG mode is
# disabled ("regardless of whether MIG is enabled or not", first in the NVML 12.4
# header); older branches answer NOT_SUPPORTED. Seen on R580: an H200 with MIG disabled
# listed every profile's placements (tests/nvml/fixtures/recorded-h200-r580.json).
PLACEMENTS_WITHOUT_MIG_SINCE: Final = 550

_VERSION = re.compile(r"^\s*(\d+)(?:\.\d+){0,2}\s*$")


class BranchError(ValueError):
    """A driver version string that names no branch."""


def driver_branch(version: str) -> int:
    """The branch (major number) of a driver version: `535.261.03` -> 535."""
    match = _VERSION.match(version)
    if match is None:
        msg = f"driver version {version!r} is not of the form MAJOR[.MINOR[.PATCH]]"
        raise BranchError(msg)
    return int(match.group(1))


def has_function(branch: int, name: str) -> bool:
    """Whether libnvidia-ml of `branch` exports NVML entry point `name`."""
    return branch >= FUNCTIONS_SINCE.get(name, 0)


def has_gpu_instance_profile(branch: int, index: int) -> bool:
    """Whether `branch` knows GPU-instance profile index `index`."""
    return branch >= GPU_INSTANCE_PROFILES_SINCE.get(index, 0)
