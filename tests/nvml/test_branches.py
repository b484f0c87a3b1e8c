"""Every supported driver branch: the emulator answers as that branch's NVML does, and
discovery, dynamic MIG and health work on each (R535 lacks calls that R580 has)."""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import anyio
import pynvml
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import Device, DiscoveryError, MigStrategy, discover
from gpudra.driver.health import HealthPolicy, HealthState, NvmlHealthWatcher
from gpudra.driver.mig import create_compute_instance, create_gpu_instance, destroy_mig
from gpudra.driver.nvml.branches import (
    EMULATED_BRANCHES,
    GPU_INSTANCE_PROFILES_SINCE,
    OLDEST_SUPPORTED_BRANCH,
    driver_branch,
)
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile
from gpudra.driver.records import CreatedMig

from tests.nvml.emulated import emulated

PRODUCTS = ("a100-40gb", "h100-80gb")
PROFILES = [f"{product}-mig-r{branch}" for product in PRODUCTS for branch in EMULATED_BRANCHES]
# The indices R575 added: "no media engine" and "all media engines" variants, which the
# GH100 does not offer (a real H200 on R580 answers NOT_SUPPORTED, tests/nvml/answers).
MEDIA_VARIANTS = (
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME,
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME,
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME,
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME,
)
GRAPHICS_VARIANTS = (
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX,
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX,
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX,
)


def one_per_profile(partitions: tuple[Device, ...]) -> list[Device]:
    """The first placement of every GPU-instance profile the GPU offers."""
    first: dict[int, Device] = {}
    for device in partitions:
        assert device.placement is not None
        first.setdefault(device.placement.profile_id, device)
    return list(first.values())


@pytest.mark.parametrize("name", PROFILES)
def test_profile_answers_as_its_branch(name: str) -> None:
    branch = int(name.rsplit("-r", 1)[1])
    nvml = emulated(name)
    assert driver_branch(load_builtin_profile(name).driverVersion) == branch
    nvml.nvmlInit()
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    if branch < 580:  # NVML added the lookup by profile ID in R580
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            nvml.nvmlDeviceGetGpuInstanceProfileInfoById(parent, 19)
    else:
        assert int(nvml.nvmlDeviceGetGpuInstanceProfileInfoById(parent, 19).sliceCount) == 1
    for index, since in GPU_INSTANCE_PROFILES_SINCE.items():
        # An index the branch does not know, or one it knows and neither card offers.
        unknown = pynvml.NVMLError_InvalidArgument
        with pytest.raises(unknown if branch < since else pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, index)
    nvml.nvmlShutdown()


@pytest.mark.parametrize(
    ("branch", "graphics", "media"),
    [
        # nvml.h of NVML 12.8 (R570) first has the GFX indices, 12.9 (R575) the -me ones.
        (550, pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_InvalidArgument),
        (570, pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument),
        (580, pynvml.NVMLError_NotSupported, pynvml.NVMLError_NotSupported),
    ],
)
def test_variant_indices_appear_in_the_branch_that_declared_them(
    branch: int, graphics: type[Exception], media: type[Exception]
) -> None:
    nvml = emulated(f"h100-80gb-mig-r{branch}")
    nvml.nvmlInit()
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    for indices, error in ((GRAPHICS_VARIANTS, graphics), (MEDIA_VARIANTS, media)):
        for index in indices:
            with pytest.raises(error):
                nvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, index)
    nvml.nvmlShutdown()


@pytest.mark.parametrize("name", PROFILES)
def test_numa_node_entry_point_from_r550_on(name: str) -> None:
    """nvmlDeviceGetNumaNodeId is first declared in NVML 12.4 (R550)."""
    branch = int(name.rsplit("-r", 1)[1])
    nvml = emulated(name)
    nvml.nvmlInit()
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    if branch < 550:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            nvml.nvmlDeviceGetNumaNodeId(parent)
    else:
        assert nvml.nvmlDeviceGetNumaNodeId(parent) == 0
    nvml.nvmlShutdown()


@pytest.mark.parametrize("name", PROFILES)
def test_discovery_on_every_branch(name: str) -> None:
    branch = int(name.rsplit("-r", 1)[1])
    inventory = discover(emulated(name))
    gpu = inventory.gpus[-1]
    assert gpu.mig_enabled and gpu.gaps == ()
    names = [d.name for d in gpu.partitions]
    assert len(names) == len(set(names))
    # Neither the A100 nor the H100 offers the -me / +me.all variants, on any branch.
    profiles = {str(d.attributes["profile"]) for d in gpu.partitions}
    assert not {p for p in profiles if p.endswith(("-me", "+me.all"))}, (branch, profiles)
    assert gpu.publishable(MigStrategy.DYNAMIC) == gpu.partitions


@pytest.mark.parametrize("name", PROFILES)
def test_dynamic_mig_create_and_destroy_on_every_branch(name: str) -> None:
    """Every profile of a GPU without instances: create the GPU and compute instance,
    then destroy by the recorded IDs; and once more with no ID recorded (a crash
    between creation and the record), which finds the instance by its placement."""
    nvml = emulated(name)
    gpu = discover(nvml).gpus[-1]
    assert not gpu.mig_devices
    for device in one_per_profile(gpu.partitions):
        placement = device.placement
        assert placement is not None
        for record_ids in (True, False):
            gi = create_gpu_instance(nvml, gpu.uuid, placement)
            ci, mig_uuid = create_compute_instance(nvml, gpu.uuid, gi)
            assert mig_uuid.startswith("MIG-")
            [created] = discover(nvml).gpus[-1].mig_devices
            assert (created.name, created.uuid) == (device.name, mig_uuid)
            record = CreatedMig(
                placement.profile_id,
                placement.profile,
                placement.start,
                placement.size,
                gi=gi if record_ids else None,
                ci=ci if record_ids else None,
            )
            assert destroy_mig(nvml, gpu.uuid, record)
            assert discover(nvml).gpus[-1].mig_devices == ()
            assert not destroy_mig(nvml, gpu.uuid, record)  # gone: nothing to undo


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def watching(nvml: NvmlEmulator, state: HealthState) -> AsyncIterator[None]:
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=20)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        yield
        tg.cancel_scope.cancel()


async def next_change(state: HealthState, seen: int) -> None:
    with anyio.fail_after(10):  # a hang guard, not a timing assertion
        await state.wait_for_change(seen)


@pytest.mark.anyio
@pytest.mark.parametrize("name", PROFILES)
async def test_health_on_every_branch(name: str) -> None:
    """An XID and a lost GPU taint their own GPU only, on every branch."""
    nvml = emulated(name)
    inventory = discover(nvml)
    state = HealthState(inventory, HealthPolicy(recovery_after_s=60))
    first, last = inventory.gpus[0], inventory.gpus[-1]
    async with watching(nvml, state):
        seen = state.generation
        nvml.inject_xid(0, 79)
        await next_change(state, seen)
        assert state.report().taints(f"gpu-{first.minor}")[0].value == "79"
        seen = state.generation
        nvml.lose_gpu(len(inventory.gpus) - 1)
        await next_change(state, seen)
        assert state.lost_gpus == {last.uuid}


@pytest.mark.anyio
async def test_a_driver_older_than_the_oldest_branch_is_named_and_retried() -> None:
    """The agent publishes nothing from a too old driver, and takes the node's GPUs once
    the driver is upgraded (its run loop retries every DiscoveryError)."""
    profile = load_builtin_profile("a100-40gb-mig-r535")
    old = NvmlEmulator(
        profile.model_copy(update={"driverVersion": "470.256.02", "cudaDriverVersion": 11040})
    )
    config = AgentConfig(node_name="n1", health_events=False)
    agent = NodeAgent(config, cast(Kube, object()), old)
    with pytest.raises(DiscoveryError) as err:
        await agent.scan()
    message = str(err.value)
    assert "NVML library version 11.470.256.02" in message
    assert "driver 470.256.02 (branch R470)" in message
    assert f"R{OLDEST_SUPPORTED_BRANCH} and newer" in message
    assert agent.inventory is None
    agent.nvml = NvmlEmulator(profile)  # the driver was upgraded
    assert len((await agent.scan()).gpus) == 2


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "loading libnvidia-ml.so.1 failed"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA kernel driver is not loaded"),
    ],
)
def test_a_missing_library_or_kernel_driver_is_named(code: int, named: str) -> None:
    nvml = emulated("t4")
    nvml.fail_after(0, code)  # nvmlInit itself fails
    with pytest.raises(DiscoveryError) as err:
        discover(nvml)
    assert named in str(err.value)
    assert f"R{OLDEST_SUPPORTED_BRANCH} or newer" in str(err.value)


def test_a_missing_library_names_the_flags_that_say_where_the_driver_is() -> None:
    """The chart's agent runs in a container without the driver: what it needs is
    where the driver root is and where it sees the host, not a linker setting."""
    nvml = emulated("t4")
    nvml.fail_after(0, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(DiscoveryError) as err:
        discover(nvml)
    assert "--driver-root" in str(err.value)
    assert "--host-root" in str(err.value)
    assert "LD_LIBRARY_PATH" not in str(err.value)


def test_event_registration_refuses_an_empty_mask() -> None:
    nvml = emulated("h100-80gb-mig-r535")
    nvml.nvmlInit()
    events = nvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), 0, events)
    nvml.nvmlEventSetFree(events)
    nvml.nvmlShutdown()


def test_compute_mode_is_refused_on_a_mig_enabled_gpu() -> None:
    nvml = emulated("h100-80gb-mig-r535")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    exclusive = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceSetComputeMode(handle, exclusive)
    nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
    nvml.nvmlDeviceSetComputeMode(handle, exclusive)
    assert nvml.nvmlDeviceGetComputeMode(handle) == exclusive
    nvml.nvmlShutdown()


def test_placements_with_mig_disabled_from_r550_on() -> None:
    """NVML 12.4 (R550) first lists placements "regardless of whether MIG is enabled"."""
    for branch in EMULATED_BRANCHES:
        nvml = emulated(f"h100-80gb-mig-r{branch}")
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
        assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
        count = ctypes.c_uint(0)
        if branch >= 550:
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, None, ctypes.byref(count))
            assert count.value == 7
        else:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
                    handle, 19, None, ctypes.byref(count)
                )
        nvml.nvmlShutdown()
