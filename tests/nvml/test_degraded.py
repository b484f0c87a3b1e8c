"""One GPU's trouble stays that GPU's: a lost GPU fails lookups of every GPU by UUID
(nvml.h) and a missing privilege refuses some fields, yet the other GPUs and fields
are still served."""

from __future__ import annotations

import logging
from typing import cast

import pynvml
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig
from gpudra.driver.devices import MIG_MONITOR_PRIVILEGE, MigStrategy, discover
from gpudra.driver.metrics import DiscoveryGaps
from gpudra.driver.mig import (
    MIG_CONFIG_PRIVILEGE,
    MigError,
    compute_mode,
    create_compute_instance,
    create_gpu_instance,
)
from gpudra.driver.node import NodeService
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.emulator import NvmlEmulator
from gpudra.driver.nvml.handles import device_handle
from prometheus_client import CollectorRegistry


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def emulated(name: str) -> NvmlEmulator:
    nvml = load_nvml(f"emulated:{name}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml


def test_device_handle_answers_for_healthy_gpus_while_one_is_lost() -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    uuids = [g.uuid for g in discover(nvml).gpus]
    nvml.lose_gpu(5)
    nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # the lookup NVML itself offers
        nvml.nvmlDeviceGetHandleByUUID(uuids[0])
    assert nvml.nvmlDeviceGetUUID(device_handle(nvml, uuids[0])) == uuids[0]
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        device_handle(nvml, uuids[5])
    assert compute_mode(nvml, uuids[0]) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nvml.recover_gpu(5)
    with pytest.raises(pynvml.NVMLError_NotFound):
        device_handle(nvml, "GPU-00000000-0000-0000-0000-000000000000")
    nvml.nvmlShutdown()


def test_prepare_calls_work_on_a_healthy_gpu_while_another_is_lost() -> None:
    nvml = emulated("h100-80gb-mig-r535")
    gpu = discover(nvml).gpus[0]
    partition = next(d for d in gpu.partitions if d.placement and d.placement.profile_id == 19)
    assert partition.placement is not None
    nvml.lose_gpu(1)
    gi = create_gpu_instance(nvml, gpu.uuid, partition.placement)
    _, mig_uuid = create_compute_instance(nvml, gpu.uuid, gi)
    assert mig_uuid.startswith("MIG-")


def unprivileged_mixed_node() -> NvmlEmulator:
    """Eight H100s, GPU 0 in MIG mode, the agent without the MIG monitor capability."""
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.nvmlInit()
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(0), 1)
    nvml.nvmlShutdown()
    nvml.set_privileged(False)
    return nvml


def test_no_permission_leaves_out_one_gpus_fields_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = unprivileged_mixed_node()
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.devices"):
        inventory = discover(nvml)
    mig_gpu, *whole = inventory.gpus
    assert {g.gaps for g in whole} == {()}
    assert [d.name for d in inventory.devices(MigStrategy.DYNAMIC)] == [
        f"gpu-{g.minor}" for g in whole
    ]
    assert {(gap.field, gap.call) for gap in mig_gpu.gaps} == {
        ("memory", "nvmlDeviceGetMemoryInfo"),
        ("placements", "nvmlDeviceGetGpuInstancePossiblePlacements"),
    }
    assert mig_gpu.partitions == ()
    assert {gap.privilege for gap in mig_gpu.gaps} == {MIG_MONITOR_PRIVILEGE}
    logged = [r.__dict__["fields"] for r in caplog.records if "lack of privilege" in r.getMessage()]
    assert {f["field"] for f in logged} == {"memory", "placements"}
    assert {f["needs"] for f in logged} == {MIG_MONITOR_PRIVILEGE}

    registry = CollectorRegistry()
    registry.register(DiscoveryGaps(lambda: inventory))
    labels = {
        "gpu": mig_gpu.uuid,
        "field": "placements",
        "call": "nvmlDeviceGetGpuInstancePossiblePlacements",
        "privilege": MIG_MONITOR_PRIVILEGE,
    }
    assert registry.get_sample_value("gpudra_discovery_gap", labels) == 1
    assert (
        registry.get_sample_value("gpudra_discovery_gap", {**labels, "gpu": whole[0].uuid}) is None
    )


def test_no_permission_on_existing_mig_devices_skips_them_only() -> None:
    nvml = emulated("a100-40gb-mig-mixed")
    privileged = discover(nvml)
    assert all(g.mig_devices for g in privileged.gpus)
    nvml.set_privileged(False)
    inventory = discover(nvml)
    for gpu in inventory.gpus:
        assert gpu.mig_devices == ()
        assert "migDevices" in {gap.field for gap in gpu.gaps}
    # The GPUs themselves are still known, with the same identity.
    assert [g.uuid for g in inventory.gpus] == [g.uuid for g in privileged.gpus]


@pytest.mark.anyio
async def test_the_node_service_serves_the_gap_metric() -> None:
    service = NodeService(
        AgentConfig(node_name="n1", health_events=False),
        cast(Kube, object()),
        unprivileged_mixed_node(),
    )
    families = {m.name: m for m in service.registry.collect()}
    assert families["gpudra_discovery_gap"].samples == []  # no inventory yet
    inventory = await service.agent.scan()
    labels = {
        "gpu": inventory.gpus[0].uuid,
        "field": "memory",
        "call": "nvmlDeviceGetMemoryInfo",
        "privilege": MIG_MONITOR_PRIVILEGE,
    }
    assert service.registry.get_sample_value("gpudra_discovery_gap", labels) == 1


def test_creating_a_mig_instance_without_privilege_names_the_privilege() -> None:
    nvml = emulated("h100-80gb-mig-r535")
    gpu = discover(nvml).gpus[0]
    placement = gpu.partitions[0].placement
    assert placement is not None
    nvml.set_privileged(False)
    with pytest.raises(MigError) as err:
        create_gpu_instance(nvml, gpu.uuid, placement)
    assert "NVML_ERROR_NO_PERMISSION" in str(err.value)
    assert str(err.value).endswith(f"the node agent needs {MIG_CONFIG_PRIVILEGE}")
