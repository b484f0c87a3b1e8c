"""The NVML emulator behaves like pynvml: same names, types, errors and MIG rules."""

from __future__ import annotations

import ctypes
import inspect
import json
import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.driver.devices import DiscoveryError, discover
from gpudra.driver.nvml import NvmlLoadError, ProfileError, builtin_profile_names, load_nvml
from gpudra.driver.nvml.branches import EMULATED_BRANCHES, OLDEST_SUPPORTED_BRANCH
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile

BRANCH_PROFILES = [
    f"{gpu}-mig-r{b}" for gpu in ("a100-40gb", "h100-80gb") for b in EMULATED_BRANCHES
]
BUILTINS = sorted(
    [
        "a100-40gb-mig-mixed",
        "h100-80gb-hbm3-x8",
        "h100-80gb-hbm3-x8-mig",
        "l4",
        "t4",
        *BRANCH_PROFILES,
    ]
)


def emulator(name: str) -> NvmlEmulator:
    nvml = load_nvml(f"emulated:{name}")
    assert isinstance(nvml, NvmlEmulator)
    nvml.nvmlInit()
    return nvml


def placements(nvml: NvmlEmulator, handle: Any, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    return [(p.start, p.size) for p in array]


def create(nvml: NvmlEmulator, handle: Any, profile_id: int, start: int, size: int) -> Any:
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle, profile_id, ctypes.byref(placement)
    )


def h100_with_mig() -> tuple[NvmlEmulator, Any]:
    nvml = emulator("h100-80gb-hbm3-x8")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    return nvml, handle


def test_builtin_profiles_are_listed_and_load() -> None:
    assert builtin_profile_names() == BUILTINS
    for name in BUILTINS:
        nvml = emulator(name)
        assert nvml.nvmlDeviceGetCount() == len(load_builtin_profile(name).gpus)


def test_every_emulated_entry_point_matches_pynvml_signature() -> None:
    names = [n for n in dir(NvmlEmulator) if n.startswith("nvml")]
    assert len(names) > 60
    # The library itself (pynvml's CDLL, None until nvmlInit), not an entry point.
    libraries = [n for n in names if isinstance(inspect.getattr_static(NvmlEmulator, n), property)]
    assert libraries == ["nvmlLib"] and hasattr(pynvml, "nvmlLib")
    for name in (n for n in names if n not in libraries):
        real = getattr(pynvml, name, None)
        assert real is not None, f"{name} does not exist in pynvml"
        ours = inspect.signature(getattr(NvmlEmulator, name))
        theirs = inspect.signature(real)
        our_params = [(p.name, p.default) for p in list(ours.parameters.values())[1:]]
        their_params = [(p.name, p.default) for p in theirs.parameters.values()]
        assert our_params == their_params, name


def test_returns_pynvml_types_and_values() -> None:
    nvml = emulator("h100-80gb-hbm3-x8")
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    assert nvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    assert nvml.nvmlDeviceGetMinorNumber(handle) == 3
    assert nvml.nvmlDeviceGetArchitecture(handle) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert nvml.nvmlDeviceGetBrand(handle) == pynvml.NVML_BRAND_NVIDIA
    assert nvml.nvmlDeviceGetCudaComputeCapability(handle) == (9, 0)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    assert isinstance(memory, pynvml.c_nvmlMemory_t)
    assert memory.total == 81559 * 1024 * 1024
    assert memory.free + memory.used == memory.total
    pci = nvml.nvmlDeviceGetPciInfo(handle)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:5D:00.0"  # decoded str, as pynvml's structure returns
    assert pci.busIdLegacy == "0000:5D:00.0"
    assert pci.pciDeviceId == 0x233010DE
    assert nvml.nvmlDeviceGetNumaNodeId(handle) == 0
    assert nvml.nvmlDeviceGetMigMode(handle) == [0, 0]
    assert nvml.nvmlSystemGetDriverVersion() == "580.95.05"
    assert nvml.nvmlSystemGetCudaDriverVersion_v2() == 13000
    by_uuid = nvml.nvmlDeviceGetHandleByUUID(nvml.nvmlDeviceGetUUID(handle))
    assert nvml.nvmlDeviceGetIndex(by_uuid) == 3
    by_bus = nvml.nvmlDeviceGetHandleByPciBusId("0000:5d:00.0")
    assert nvml.nvmlDeviceGetIndex(by_bus) == 3


def test_errors_are_pynvml_exception_classes() -> None:
    nvml = emulator("t4")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(handle)  # Turing has no MIG
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(ctypes.cast(1234, pynvml.c_nvmlDevice_t))
    other = emulator("t4")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        other.nvmlDeviceGetName(handle)  # a handle of another machine


def test_calls_need_init_and_shutdown_is_counted() -> None:
    nvml = load_nvml("emulated:l4")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 1
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_placements_use_memory_slice_semantics() -> None:
    nvml, handle = h100_with_mig()
    assert placements(nvml, handle, 19) == [(s, 1) for s in range(7)]
    assert placements(nvml, handle, 15) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert placements(nvml, handle, 9) == [(0, 4), (4, 4)]
    assert placements(nvml, handle, 0) == [(0, 8)]
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(
        handle, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    )
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (info.id, info.name, info.memorySizeMB, info.multiprocessorCount) == (
        19,
        "MIG 1g.10gb",
        9984,
        16,
    )
    small = ctypes.c_uint(0)
    too_small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, too_small, ctypes.byref(small))


def test_gpu_instance_ids_follow_the_placement_as_the_driver_numbers_them() -> None:
    """Published `nvidia-smi mig -lgi` output of A100s and H100s: the whole GPU is GI 0,
    halves 1-2, quarters 3-6 and single slices 7-13, whatever was created before."""
    expected = {
        0: {0: 0},  # 7g
        5: {0: 1},  # 4g
        9: {0: 1, 4: 2},  # 3g
        14: {0: 3, 2: 4, 4: 5},  # 2g
        15: {0: 3, 2: 4, 4: 5, 6: 6},  # 1g.20gb, two memory slices
        19: {s: 7 + s for s in range(7)},  # 1g
    }
    for name, index in (("h100-80gb-hbm3-x8", 0), ("a100-40gb-mig-r570", 1)):
        nvml = emulator(name)
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        for profile_id, ids in expected.items():
            size = placements(nvml, handle, profile_id)[0][1]
            # Highest placement first: the lowest free number would differ.
            for start, gi_id in sorted(ids.items(), reverse=True):
                gi = create(nvml, handle, profile_id, start, size)
                assert nvml.nvmlGpuInstanceGetInfo(gi).id == gi_id, (name, profile_id, start)
            for gi_id in ids.values():
                nvml.nvmlGpuInstanceDestroy(nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))


def test_static_mig_devices_get_the_ids_a_real_a100_showed() -> None:
    """The A100 profiles' static layout is the one NVIDIA/DCGM issue 138 lists from a
    real A100 (`nvidia-smi mig -lgi`): 2g at 0 is GI 3, 1g at 2 and 3 are GIs 9 and 10,
    3g at 4 is GI 2."""
    migs = discover(emulator("a100-40gb-mig-r570")).gpus[0].mig_devices
    placed = {
        (d.placement.profile_id, d.placement.start): d.gpu_instance_id for d in migs if d.placement
    }
    assert placed == {(14, 0): 3, (19, 2): 9, (19, 3): 10, (9, 4): 2}


def test_a_gpu_set_up_with_other_ids_keeps_them_and_numbers_the_rest() -> None:
    """A replayed record may hold an ID the placement would not give (a GPU numbering
    its halves mirrored): that instance keeps it, a new one takes a free ID."""
    nvml, handle = h100_with_mig()
    nvml.create_gpu_instance_numbered(0, 9, 4, 1)  # 3g at start 4, numbered mirrored
    mirrored = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(handle, 1))
    assert mirrored.placement.start == 4
    other = nvml.nvmlGpuInstanceGetInfo(create(nvml, handle, 9, 0, 4))
    assert (other.placement.start, other.id) == (0, 2)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.create_gpu_instance_numbered(0, 19, 4, 11)  # the slot is taken


def test_a_placement_off_the_slot_tree_is_refused_when_loading() -> None:
    doc = load_builtin_profile("h100-80gb-hbm3-x8").model_dump(mode="json")
    product = next(iter(doc["products"].values()))
    gip = next(p for p in product["mig"]["gpuInstanceProfiles"] if p["id"] == 14)
    gip["placements"] = [{"start": 1, "size": 2}]
    with pytest.raises(ProfileError, match=r"placement 1:2 of 'MIG 2g.20gb' is not an aligned"):
        parse_profile(doc)


def test_mig_calls_need_mig_mode() -> None:
    nvml = emulator("h100-80gb-hbm3-x8")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    # R580 lists placements with MIG off (older branches do not: test_branches.py).
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, None, ctypes.byref(count))
    assert count.value == 7
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        create(nvml, handle, 19, 0, 1)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    # Hopper switches MIG mode at once; Ampere only sets it pending until a reset.
    nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert nvml.nvmlDeviceGetMigMode(handle) == [1, 1]
    a100 = emulator("a100-40gb-mig-mixed")
    a100_handle = a100.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_InUse):
        a100.nvmlDeviceSetMigMode(a100_handle, pynvml.NVML_DEVICE_MIG_DISABLE)


def test_create_and_destroy_follow_placement_rules() -> None:
    nvml, handle = h100_with_mig()
    gi = create(nvml, handle, 9, 0, 4)  # 3g.40gb on slices 0-3
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 0, 4)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(nvml, handle, 19, 2, 1)  # 1g on slice 2 overlaps
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(nvml, handle, 0, 0, 8)  # the whole GPU no longer fits
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        create(nvml, handle, 14, 1, 2)  # 2g cannot start on an odd slice
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 19) == 3  # slices 4,5,6
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 9) == 1
    me = create(nvml, handle, 20, 4, 1)  # 1g.10gb+me: the only media-extension instance
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(nvml, handle, 20, 5, 1)
    nvml.nvmlGpuInstanceDestroy(me)
    create(nvml, handle, 20, 5, 1)

    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlGpuInstanceDestroy(gi)  # compute instances first
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    assert nvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert nvml.nvmlDeviceGetIndex(parent) == 0
    assert nvml.nvmlDeviceGetGpuInstanceId(mig) == info.id
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 40448 * 1024 * 1024
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMinorNumber(mig)
    nvml.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(mig)  # the MIG device is gone
    nvml.nvmlGpuInstanceDestroy(gi)
    create(nvml, handle, 5, 0, 4)  # 4g.40gb where the 3g.40gb was


def test_gpu_instance_listing_and_lookup() -> None:
    nvml = emulator("a100-40gb-mig-mixed")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    array = (pynvml.c_nvmlGpuInstance_t * 7)()
    nvml.nvmlDeviceGetGpuInstances(handle, 19, array, ctypes.byref(count))
    assert count.value == 2
    starts = sorted(nvml.nvmlGpuInstanceGetInfo(array[i]).placement.start for i in range(2))
    assert starts == [2, 3]
    gi_id = nvml.nvmlGpuInstanceGetInfo(array[0]).id
    same = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
    assert nvml.nvmlGpuInstanceGetInfo(same).id == gi_id
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetGpuInstanceById(handle, 99)
    ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        same, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0
    )
    assert (ci_info.sliceCount, ci_info.multiprocessorCount) == (1, 14)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            same, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, 0
        )


def test_compute_mode_round_trip() -> None:
    nvml = emulator("l4")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nvml.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert nvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetComputeMode(handle, 9)


def test_compute_mode_of_a_mig_enabled_gpu_is_its_mig_devices() -> None:
    """nvml.h, nvmlDevice{Get,Set}ComputeMode: "If MIG is enabled on a GPU, device must
    be MIG device handle"."""
    nvml = emulator("a100-40gb-mig-mixed")
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(parent)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    other = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    assert nvml.nvmlDeviceGetComputeMode(mig) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nvml.nvmlDeviceSetComputeMode(mig, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert nvml.nvmlDeviceGetComputeMode(mig) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert nvml.nvmlDeviceGetComputeMode(other) == pynvml.NVML_COMPUTEMODE_DEFAULT
    for call in (
        lambda: nvml.nvmlDeviceGetComputeMode(parent),
        lambda: nvml.nvmlDeviceSetComputeMode(parent, pynvml.NVML_COMPUTEMODE_DEFAULT),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    nvml.set_privileged(False)
    with pytest.raises(pynvml.NVMLError_NoPermission):  # "Requires root/admin permissions"
        nvml.nvmlDeviceSetComputeMode(mig, pynvml.NVML_COMPUTEMODE_DEFAULT)


def test_a_mig_enabled_gpu_has_no_utilization_rates() -> None:
    """nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently
    supported"; the same GPU with MIG disabled has them."""
    nvml = emulator("a100-40gb-mig-mixed")
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(parent)
    h100 = emulator("h100-80gb-hbm3-x8")
    handle = h100.nvmlDeviceGetHandleByIndex(0)
    assert h100.nvmlDeviceGetUtilizationRates(handle).gpu >= 0
    h100.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        h100.nvmlDeviceGetUtilizationRates(handle)


@pytest.mark.parametrize("name", ["l4", "t4"])
def test_max_mig_device_count_is_zero_without_mig_support(name: str) -> None:
    """nvml.h nvmlDeviceGetMaxMigDeviceCount: "Returns zero if MIG is not supported or
    enabled" (NOT_SUPPORTED is not among its answers); discovery still offers the GPU
    whole, with no MIG view."""
    nvml = emulator(name)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):  # the GPU has no MIG mode
        nvml.nvmlDeviceGetMigMode(handle)
    nvml.nvmlShutdown()
    [gpu] = discover(nvml).gpus
    assert (gpu.mig_capable, gpu.mig_devices, gpu.partitions) == (False, (), ())


def test_events_are_delivered_to_registered_sets_only() -> None:
    nvml = emulator("h100-80gb-hbm3-x8")
    event_set = nvml.nvmlEventSetCreate()
    handle = nvml.nvmlDeviceGetHandleByIndex(2)
    supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
    assert supported & pynvml.nvmlEventTypeXidCriticalError
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    nvml.inject_xid(5, 79)  # GPU 5 is not registered
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 1)
    nvml.inject_xid(2, 48, gpu_instance_id=3, compute_instance_id=0)
    data = nvml.nvmlEventSetWait_v2(event_set, 1000)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (48, 3, 0)
    assert nvml.nvmlDeviceGetUUID(data.device) == nvml.nvmlDeviceGetUUID(handle)
    nvml.inject_ecc(2)  # double-bit ECC is not in this set's mask
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(event_set, 1)
    nvml.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlEventSetWait_v2(event_set, 1)


def test_without_privilege_only_whole_gpu_events_are_delivered() -> None:
    """nvml.h, nvmlEventSetWait_v2: in MIG mode the events of the instances come only to
    a caller with the privilege (the MIG monitor capability); otherwise only the events
    that affect the whole device."""
    nvml = emulator("a100-40gb-mig-mixed")
    event_set = nvml.nvmlEventSetCreate()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    nvml.set_privileged(False)
    nvml.inject_xid(0, 94, gpu_instance_id=1, compute_instance_id=0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 1)
    nvml.inject_xid(0, 48)
    assert nvml.nvmlEventSetWait_v2(event_set, 1000).eventData == 48
    nvml.set_privileged(True)
    nvml.inject_xid(0, 94, gpu_instance_id=1, compute_instance_id=0)
    data = nvml.nvmlEventSetWait_v2(event_set, 1000)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (94, 1, 0)


def test_wait_wakes_up_when_an_event_arrives_from_another_thread() -> None:
    nvml = emulator("l4")
    event_set = nvml.nvmlEventSetCreate()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    results: list[int] = []

    def waiter() -> None:
        results.append(nvml.nvmlEventSetWait_v2(event_set, 30_000).eventData)

    thread = threading.Thread(target=waiter)
    thread.start()
    # Other calls proceed while the waiter blocks: the wait releases the lock.
    assert nvml.nvmlDeviceGetName(handle) == "NVIDIA L4"
    nvml.inject_xid(0, 94)
    thread.join(timeout=30)
    assert results == [94]


def test_lost_gpu_raises_gpu_is_lost_until_recovered() -> None:
    nvml = emulator("h100-80gb-hbm3-x8")
    event_set = nvml.nvmlEventSetCreate()
    handle = nvml.nvmlDeviceGetHandleByIndex(1)
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    nvml.lose_gpu(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlEventSetWait_v2(event_set, 1000)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(handle)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA H100 80GB HBM3"
    nvml.recover_gpu(1)
    assert nvml.nvmlDeviceGetMinorNumber(handle) == 1


def test_fail_after_fails_every_later_call_until_cleared() -> None:
    nvml = emulator("l4")
    nvml.fail_after(2, pynvml.NVML_ERROR_UNKNOWN)
    nvml.nvmlDeviceGetCount()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetName(handle)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetCount()
    nvml.clear_failure()
    assert nvml.nvmlDeviceGetName(handle) == "NVIDIA L4"


def test_uuid_salt_gives_each_node_its_own_uuids() -> None:
    a = load_nvml("emulated:t4", uuid_salt="node-a")
    b = load_nvml("emulated:t4", uuid_salt="node-b")
    plain = load_nvml("emulated:t4")
    uuids = []
    for nvml in (a, b, plain):
        nvml.nvmlInit()
        uuids.append(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0)))
    assert len(set(uuids)) == 3
    assert uuids[2] == "GPU-cb56645c-bc09-56d6-bb66-88a6004e7b31"
    assert all(u.startswith("GPU-") and len(u) == 40 for u in uuids)


def test_unknown_profile_lists_known_names() -> None:
    with pytest.raises(ProfileError) as err:
        load_nvml("emulated:h200-x4")
    message = str(err.value)
    assert "h200-x4" in message
    for name in BUILTINS:
        assert name in message
    with pytest.raises(NvmlLoadError, match="emulated"):
        load_nvml("fake")


def write_profile(tmp_path: Path, mutate: Any) -> Path:
    data = load_builtin_profile("a100-40gb-mig-mixed").model_dump(mode="json")
    mutate(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def test_malformed_profile_names_file_and_field(tmp_path: Path) -> None:
    def bad_bus(data: dict[str, Any]) -> None:
        data["gpus"][1]["busId"] = "07:00.0"

    path = write_profile(tmp_path, bad_bus)
    with pytest.raises(ProfileError) as err:
        load_nvml(f"emulated:{path}")
    assert str(path) in str(err.value)
    assert "gpus.1.busId" in str(err.value)

    def bad_brand(data: dict[str, Any]) -> None:
        data["products"]["a100-sxm4-40gb"]["brand"] = "NVML_BRAND_ACME"

    with pytest.raises(ProfileError, match=r"products\.a100-sxm4-40gb\.brand"):
        load_nvml(f"emulated:{write_profile(tmp_path, bad_brand)}")

    def unknown_field(data: dict[str, Any]) -> None:
        data["gpus"][0]["colour"] = "green"

    with pytest.raises(ProfileError, match=r"gpus\.0\.colour"):
        load_nvml(f"emulated:{write_profile(tmp_path, unknown_field)}")

    def overlapping(data: dict[str, Any]) -> None:
        data["gpus"][1]["migInstances"].append({"profileId": 19, "placementStart": 1})

    with pytest.raises(
        ProfileError, match=r"gpus\.1\.migInstances\.2.*NVML_ERROR_INSUFFICIENT_RESOURCES"
    ):
        load_nvml(f"emulated:{write_profile(tmp_path, overlapping)}")

    def wrong_product(data: dict[str, Any]) -> None:
        data["gpus"][0]["product"] = "h100"

    with pytest.raises(ProfileError, match=r"gpus\[0\]\.product"):
        load_nvml(f"emulated:{write_profile(tmp_path, wrong_product)}")

    not_json = tmp_path / "broken.json"
    not_json.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_nvml(f"emulated:{not_json}")
    with pytest.raises(ProfileError, match="cannot read"):
        load_nvml(f"emulated:{tmp_path / 'missing.json'}")


def test_real_nvml_without_library_gives_a_clear_error() -> None:
    """Loading never exits on a node without a driver; discovery names what is missing."""
    nvml = load_nvml("real")
    assert nvml is pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        with pytest.raises(DiscoveryError) as err:
            discover(nvml)
        message = str(err.value)
        assert "libnvidia-ml.so.1" in message
        assert f"R{OLDEST_SUPPORTED_BRANCH} or newer" in message
    else:  # pragma: no cover - a machine with a GPU driver
        pynvml.nvmlShutdown()


def test_state_file_keeps_mig_instances_and_modes_across_processes(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"

    def machine() -> NvmlEmulator:
        nvml = load_nvml("emulated:h100-80gb-hbm3-x8", state_path=state)
        assert isinstance(nvml, NvmlEmulator)
        nvml.nvmlInit()
        return nvml

    first = machine()
    handle = first.nvmlDeviceGetHandleByIndex(0)
    first.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    first.nvmlDeviceSetComputeMode(
        first.nvmlDeviceGetHandleByIndex(1), pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    )
    gi = create(first, handle, 9, 4, 4)
    first.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    first_mig = first.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    uuid = first.nvmlDeviceGetUUID(first_mig)
    first.nvmlDeviceSetComputeMode(first_mig, pynvml.NVML_COMPUTEMODE_PROHIBITED)

    # A new process (the first one crashed) sees the same GPUs.
    second = machine()
    handle = second.nvmlDeviceGetHandleByIndex(0)
    assert second.nvmlDeviceGetMigMode(handle) == [1, 1]
    mig = second.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert second.nvmlDeviceGetUUID(mig) == uuid
    assert second.nvmlDeviceGetComputeMode(mig) == pynvml.NVML_COMPUTEMODE_PROHIBITED
    gi = second.nvmlDeviceGetGpuInstanceById(handle, second.nvmlDeviceGetGpuInstanceId(mig))
    assert second.nvmlGpuInstanceGetInfo(gi).placement.start == 4
    assert (
        second.nvmlDeviceGetComputeMode(second.nvmlDeviceGetHandleByIndex(1))
        == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    )
    ci_id = second.nvmlDeviceGetComputeInstanceId(mig)
    ci = second.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
    second.nvmlComputeInstanceDestroy(ci)
    second.nvmlGpuInstanceDestroy(gi)

    third = machine()
    with pytest.raises(pynvml.NVMLError_NotFound):
        third.nvmlDeviceGetMigDeviceHandleByIndex(third.nvmlDeviceGetHandleByIndex(0), 0)

    with pytest.raises(ProfileError, match="another machine"):
        load_nvml("emulated:l4", state_path=state)
    state.write_text("{")
    with pytest.raises(ProfileError, match="remove it to start afresh"):
        load_nvml("emulated:h100-80gb-hbm3-x8", state_path=state)
