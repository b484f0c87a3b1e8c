"""Find a GPU's NVML handle and GPU-instance profile on every supported driver branch.

Two NVML habits would otherwise break a healthy GPU because of another one, or a
driver that is older than the call:
- `nvmlDeviceGetHandleByUUID` walks every GPU and answers GPU_IS_LOST when *any* GPU
  has fallen off the bus (nvml.h), so it says nothing about the GPU asked for. The
  lookup by index is scoped to its target: `device_handle` falls back to it, and to
  the lookup of a GPU's MIG devices by index, and decides from the GPU itself.
- `nvmlDeviceGetGpuInstanceProfileInfoById` exists from R580 only;
  `gpu_instance_profile` finds a profile by ID through the per-index query every
  MIG-capable branch has.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pynvml
from gpudra.driver.nvml import NvmlLibrary

__all__ = [
    "NO_MIG_AT_INDEX",
    "device_handle",
    "gpu_instance_profile",
    "gpu_instance_profiles",
    "handle_address",
    "mig_device_handles",
    "nvml_code",
]

# Answers of nvmlDeviceGetGpuInstanceProfileInfo for an index the GPU or branch lacks.
_NO_PROFILE = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT})
# Answers of nvmlDeviceGetMigDeviceHandleByIndex for an index without a MIG device.
NO_MIG_AT_INDEX = frozenset({pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT})


def nvml_code(err: BaseException) -> int | None:
    """The NVML_ERROR_* value of a pynvml error, None for anything else."""
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def handle_address(handle: Any) -> int | None:
    """Where a device handle points: NVML hands out one handle per device for the life of
    the library, so two handles of one GPU have the same address, whether they came from
    a lookup or an event. None for something that is not a pointer."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None
    return address if isinstance(address, int) else None


def device_handle(nvml: NvmlLibrary, uuid: str) -> Any:
    """The handle of the GPU (or MIG device) with `uuid`.

    Raises GPU_IS_LOST only when that GPU itself is lost, or when the device is not
    among those of the GPUs that answer while one is lost (it may be the lost GPU's
    or one of its MIG devices); NOT_FOUND when no device has the UUID; other NVML
    errors as they come.
    """
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError_GpuIsLost:
        pass
    # The lookup by UUID gave up on every device, MIG devices of healthy GPUs too:
    # walk the GPUs that answer, and a MIG UUID through their MIG devices, or one lost
    # GPU would blank every MIG device's metrics and MIG management on the node.
    mig = uuid.startswith("MIG-")  # a GPU's UUID starts GPU-: no MIG walk for it
    lost = False
    for index in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            candidates = [handle, *(mig_device_handles(nvml, handle) if mig else ())]
            for candidate in candidates:
                if str(nvml.nvmlDeviceGetUUID(candidate)) == uuid:
                    return candidate
        except pynvml.NVMLError_GpuIsLost:
            lost = True  # this index is the lost GPU, or one of them
    # Not among the devices that answer: either it is the lost GPU or one of its MIG
    # devices, or it does not exist.
    if lost:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


def mig_device_handles(nvml: NvmlLibrary, parent: Any) -> Iterator[Any]:
    """The handles of `parent`'s MIG devices.

    MIG device indices may have gaps (NOT_FOUND, or INVALID_ARGUMENT past what the GPU
    offers), as where a GPU instance was destroyed; a GPU without MIG answers a
    maximum of 0 or NOT_SUPPORTED.
    """
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))
    except pynvml.NVMLError as err:
        if nvml_code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return
        raise
    for index in range(count):
        try:
            yield nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
        except pynvml.NVMLError as err:
            if nvml_code(err) not in NO_MIG_AT_INDEX:
                raise


def gpu_instance_profiles(nvml: NvmlLibrary, parent: Any) -> dict[int, tuple[int, Any]]:
    """Every GPU-instance profile the GPU offers: profile ID -> (profile index, info)."""
    found: dict[int, tuple[int, Any]] = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, index)
        except pynvml.NVMLError as err:
            if nvml_code(err) in _NO_PROFILE:
                continue
            raise
        found.setdefault(int(info.id), (index, info))
    return found


def gpu_instance_profile(nvml: NvmlLibrary, parent: Any, profile_id: int) -> Any:
    """The profile info of GPU-instance profile `profile_id` (NOT_SUPPORTED if none)."""
    match = gpu_instance_profiles(nvml, parent).get(profile_id)
    if match is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return match[1]
