"""MIG on one node: GPU and compute instances, compute mode, capability device nodes.

A dynamic MIG device is made at prepare, exactly at the placement the scheduler
allocated, and destroyed at undo; a process inside the container then needs the
device nodes of the GPU instance's and compute instance's access capabilities,
whose numbers the kernel driver publishes under /proc. The compute mode (set to
exclusive-process for an MPS daemon that owns a whole GPU) is an NVML setting of
the same kind, so it lives here too.

Every NVML call runs in the caller's thread and opens NVML for itself (NVML counts
init/shutdown, so a caller that holds NVML open is unaffected); errors name the
GPU and the step. Only calls that every supported driver branch has are used (R535
has no nvmlDeviceGetGpuInstanceProfileInfoById), and a GPU is looked up so that
another GPU falling off the bus does not fail it (`nvml.handles`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pynvml
from gpudra.driver.devices import MigKey, MigPlacement
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.nvml.codes import describe_nvml_error
from gpudra.driver.nvml.handles import (
    device_handle,
    gpu_instance_profile,
    mig_device_handles,
    nvml_code,
)
from gpudra.driver.records import CreatedMig

if TYPE_CHECKING:
    from gpudra.driver.checkpoint import ClaimRecord

__all__ = [
    "MIG_CONFIG_PRIVILEGE",
    "MigError",
    "caps_major",
    "compute_mode",
    "create_compute_instance",
    "create_gpu_instance",
    "destroy_mig",
    "mig_capability_minors",
    "placement_taken",
    "recorded_instances",
    "set_compute_mode",
]

log = logging.getLogger(__name__)

# The kernel driver numbers MIG capabilities in a fixed table
# (/proc/driver/nvidia-caps/mig-minors): config 1, monitor 2, then for every GPU minor
# 15 GPU instances, each an access capability followed by 8 compute instances.
_MIG_FIRST_MINOR: Final = 3
_MIG_GPU_INSTANCES: Final = 15
_MIG_COMPUTE_INSTANCES: Final = 8
_NOT_FOUND: Final = frozenset({pynvml.NVML_ERROR_NOT_FOUND})
_SKIP_PROFILE: Final = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT}
)


class MigError(RuntimeError):
    """An NVML MIG operation failed; the message names the GPU and the step."""


class MigNotCreated(MigError):
    """NVML refused to create the GPU instance: nothing was made."""


# --- capability device nodes ------------------------------------------------------------


def _cap_file(path: Path) -> tuple[int, int | None] | None:
    """(DeviceFileMinor, DeviceFileMode) of a /proc capability file, None if unreadable."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    minor: int | None = None
    mode: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        with contextlib.suppress(ValueError):
            if key.strip() == "DeviceFileMinor":
                minor = int(value.strip())
            elif key.strip() == "DeviceFileMode":
                mode = int(value.strip())
    return None if minor is None else (minor, mode)


def _minors_table(proc_root: Path) -> dict[str, int]:
    try:
        text = (proc_root / "driver/nvidia-caps/mig-minors").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return {}
    table: dict[str, int] = {}
    for line in text.splitlines():
        name, _, number = line.strip().rpartition(" ")
        if name and number.isdigit():
            table[name] = int(number)
    return table


def mig_capability_minors(
    proc_root: Path, gpu_minor: int, gi: int, ci: int
) -> tuple[tuple[int, int | None], tuple[int, int | None]]:
    """Minors (and file modes, when known) of the GI and CI access capabilities.

    Read from `<proc>/driver/nvidia/capabilities/gpu<minor>/mig/gi<gi>[/ci<ci>]/access`
    (`DeviceFileMinor:`), as the kernel driver publishes them; else from
    `<proc>/driver/nvidia-caps/mig-minors`; else computed from the fixed layout of
    that table (3 + minor*135 + gi*9, the CI capabilities following their GI). The
    layout has been stable since MIG appeared (R450), so the fallback gives the right
    node when /proc is not mounted into the plugin.
    """
    base = proc_root / "driver/nvidia/capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gi}"
    gi_cap = _cap_file(base / "access")
    ci_cap = _cap_file(base / f"ci{ci}" / "access")
    if gi_cap is None or ci_cap is None:
        table = _minors_table(proc_root)
        gi_name = f"gpu{gpu_minor}/gi{gi}/access"
        ci_name = f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"
        first = (
            _MIG_FIRST_MINOR
            + gpu_minor * _MIG_GPU_INSTANCES * (1 + _MIG_COMPUTE_INSTANCES)
            + gi * (1 + _MIG_COMPUTE_INSTANCES)
        )
        if gi_cap is None:
            gi_cap = (table.get(gi_name, first), None)
        if ci_cap is None:
            ci_cap = (table.get(ci_name, first + 1 + ci), None)
    return gi_cap, ci_cap


def caps_major(proc_root: Path) -> int | None:
    """The character major of `nvidia-caps` from /proc/devices, if readable."""
    try:
        text = (proc_root / "devices").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        number, _, name = line.strip().partition(" ")
        if name.strip() == "nvidia-caps" and number.isdigit():
            return int(number)
    return None


# --- NVML: MIG instances and compute mode ------------------------------------------------


@contextlib.contextmanager
def _nvml_open(nvml: NvmlLibrary) -> Iterator[None]:
    """NVML counts init/shutdown, so a caller that initialised NVML itself is unaffected."""
    nvml.nvmlInit()
    try:
        yield
    finally:
        try:
            nvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.warning("nvmlShutdown failed", extra={"fields": {"error": str(err)}})


# What NVML needs to create and destroy MIG instances (and to set modes).
MIG_CONFIG_PRIVILEGE = (
    "the MIG config capability (access to /dev/nvidia-caps/nvidia-cap1, granted by "
    "/proc/driver/nvidia/capabilities/mig/config), or root"
)


def _mig_error(
    step: str, gpu_uuid: str, err: BaseException, kind: type[MigError] = MigError
) -> MigError:
    msg = f"{step} on GPU {gpu_uuid}: {describe_nvml_error(err)}"
    if nvml_code(err) == pynvml.NVML_ERROR_NO_PERMISSION:
        msg += f"; the node agent needs {MIG_CONFIG_PRIVILEGE}"
    return kind(msg)


def create_gpu_instance(nvml: NvmlLibrary, gpu_uuid: str, placement: MigPlacement) -> int:
    """Create the GPU instance at exactly the allocated placement; returns its ID."""
    step = (
        f"creating MIG GPU instance {placement.profile} (profile ID {placement.profile_id}) "
        f"at memory slice {placement.start}"
    )
    with _nvml_open(nvml):
        try:
            parent = device_handle(nvml, gpu_uuid)
            where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                parent, placement.profile_id, ctypes.byref(where)
            )
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err, MigNotCreated) from err
        try:  # made: a failure from here on leaves an instance an undo must find
            return int(nvml.nvmlGpuInstanceGetInfo(gi).id)
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err) from err


def placement_taken(nvml: NvmlLibrary, gpu_uuid: str, mig: CreatedMig) -> bool:
    """Whether a GPU instance of `mig`'s profile already starts at its memory slice,
    before this claim made one: an administrator's, one of a static layout, or one a
    lost checkpoint no longer names. Such an instance is never the claim's to destroy."""
    with _nvml_open(nvml):
        try:
            return _find_gpu_instance(nvml, device_handle(nvml, gpu_uuid), mig) is not None
        except pynvml.NVMLError as err:
            raise _mig_error("listing MIG GPU instances", gpu_uuid, err) from err


def recorded_instances(claims: Iterable[ClaimRecord]) -> frozenset[MigKey]:
    """The MIG instances gpudra made for `claims` (the checkpoint's), as `MigKey`s.

    Each is recorded before NVML creates it and forgotten only after it is destroyed,
    so an instance on a GPU that no claim records is one gpudra did not create: an
    administrator's, a static layout's, or one a lost checkpoint no longer names (as
    `placement_taken` says at prepare). The dynamic MIG view keeps what those hold
    out of the published counters (`Gpu.dynamic_view`)."""
    return frozenset(
        (device.details.gpu_uuid, mig.profile_id, mig.start)
        for claim in claims
        for device in claim.devices
        if isinstance(mig := device.details.mig, CreatedMig) and device.details.gpu_uuid
    )


def _mig_uuid(nvml: NvmlLibrary, parent: Any, gi_id: int, ci_id: int) -> str | None:
    for handle in mig_device_handles(nvml, parent):
        if (
            int(nvml.nvmlDeviceGetGpuInstanceId(handle)) == gi_id
            and int(nvml.nvmlDeviceGetComputeInstanceId(handle)) == ci_id
        ):
            return str(nvml.nvmlDeviceGetUUID(handle))
    return None


def _ci_profiles(nvml: NvmlLibrary, gi: Any) -> Iterator[Any]:
    """The compute instance profiles the GPU instance supports (shared engines)."""
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            yield nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError as err:
            if nvml_code(err) not in _SKIP_PROFILE:
                raise


def create_compute_instance(nvml: NvmlLibrary, gpu_uuid: str, gi_id: int) -> tuple[int, str]:
    """One compute instance spanning the whole GPU instance; returns (CI ID, MIG UUID)."""
    step = f"creating the compute instance in MIG GPU instance {gi_id}"
    with _nvml_open(nvml):
        try:
            parent = device_handle(nvml, gpu_uuid)
            gi = nvml.nvmlDeviceGetGpuInstanceById(parent, gi_id)
            gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            slices = int(gpu_instance_profile(nvml, parent, int(gi_info.profileId)).sliceCount)
            ci_profile = next(
                (int(p.id) for p in _ci_profiles(nvml, gi) if int(p.sliceCount) == slices), None
            )
            if ci_profile is None:
                raise MigError(f"{step} on GPU {gpu_uuid}: no compute profile of {slices} slices")
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
            ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
            uuid = _mig_uuid(nvml, parent, gi_id, ci_id)
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err) from err
    if uuid is None:
        raise MigError(f"{step} on GPU {gpu_uuid}: NVML lists no MIG device for GI {gi_id}")
    return ci_id, uuid


def _find_gpu_instance(nvml: NvmlLibrary, parent: Any, mig: CreatedMig) -> Any | None:
    """The GPU instance a record describes, matched on profile and placement (and ID
    when recorded), so an instance someone else made in between is never touched."""
    if mig.gi is not None:
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(parent, mig.gi)
        except pynvml.NVMLError as err:
            if nvml_code(err) in _NOT_FOUND:
                return None
            raise
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        if int(info.profileId) == mig.profile_id and int(info.placement.start) == mig.start:
            return gi
        return None
    profile = gpu_instance_profile(nvml, parent, mig.profile_id)
    capacity = int(profile.instanceCount)
    found = (pynvml.c_nvmlGpuInstance_t * max(capacity, 1))()
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstances(parent, mig.profile_id, found, ctypes.byref(count))
    for gi in found[: count.value]:
        if int(nvml.nvmlGpuInstanceGetInfo(gi).placement.start) == mig.start:
            return gi
    return None


def _destroy_compute_instances(nvml: NvmlLibrary, gi: Any) -> None:
    for info in _ci_profiles(nvml, gi):
        found = (pynvml.c_nvmlComputeInstance_t * max(int(info.instanceCount), 1))()
        count = ctypes.c_uint(0)
        nvml.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), found, ctypes.byref(count))
        for ci in found[: count.value]:
            nvml.nvmlComputeInstanceDestroy(ci)


def destroy_mig(
    nvml: NvmlLibrary, gpu_uuid: str, mig: CreatedMig, *, mig_uuid: str | None = None
) -> bool:
    """Destroy the compute instances, then the GPU instance; False if it was gone.

    With `mig_uuid`, only the instance whose MIG device has that UUID, the one gpudra
    made: an instance at the same placement and GPU instance ID may be another's (after
    a reboot the GPU hands both out afresh), and is then left, answering False.
    """
    gi_id = "?" if mig.gi is None else mig.gi
    step = f"destroying MIG GPU instance {gi_id} (profile {mig.profile_id})"
    with _nvml_open(nvml):
        try:
            parent = device_handle(nvml, gpu_uuid)
            gi = _find_gpu_instance(nvml, parent, mig)
            if gi is None:
                return False
            if mig_uuid is not None:
                found = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
                if mig.ci is None or _mig_uuid(nvml, parent, found, mig.ci) != mig_uuid:
                    return False
            _destroy_compute_instances(nvml, gi)
            nvml.nvmlGpuInstanceDestroy(gi)
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err) from err
    return True


def compute_mode(nvml: NvmlLibrary, gpu_uuid: str) -> int:
    with _nvml_open(nvml):
        try:
            return int(nvml.nvmlDeviceGetComputeMode(device_handle(nvml, gpu_uuid)))
        except pynvml.NVMLError as err:
            raise _mig_error("reading the compute mode", gpu_uuid, err) from err


def set_compute_mode(nvml: NvmlLibrary, gpu_uuid: str, mode: int) -> None:
    with _nvml_open(nvml):
        try:
            nvml.nvmlDeviceSetComputeMode(device_handle(nvml, gpu_uuid), mode)
        except pynvml.NVMLError as err:
            raise _mig_error(f"setting compute mode {mode}", gpu_uuid, err) from err
