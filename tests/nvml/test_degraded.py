"""One GPU's trouble stays that GPU's: a lost GPU fails lookups of every GPU by UUID
(nvml.h) and cannot be described itself, and a missing privilege refuses some fields,
yet the other GPUs and fields are still served."""

from __future__ import annotations

import logging
from typing import cast

import anyio
import pynvml
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import (
    MIG_MONITOR_PRIVILEGE,
    DiscoveryError,
    LostGpu,
    MigStrategy,
    SharedGpus,
    discover,
)
from gpudra.driver.health import GpuLostEvent, HealthPolicy, NvmlHealthWatcher
from gpudra.driver.metrics import DiscoveryGaps
from gpudra.driver.mig import (
    MIG_CONFIG_PRIVILEGE,
    MigError,
    compute_mode,
    create_compute_instance,
    create_gpu_instance,
)
from gpudra.driver.node import NodeService
from gpudra.driver.nvml.emulator import NvmlEmulator
from gpudra.driver.nvml.handles import device_handle
from gpudra.driver.sampling import Sampler
from prometheus_client import CollectorRegistry

from tests.nvml.emulated import emulated


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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


@pytest.mark.anyio
async def test_mig_devices_of_a_healthy_gpu_are_sampled_while_another_gpu_is_lost() -> None:
    """The lookup by UUID answers GPU_IS_LOST for MIG devices too while any GPU is lost:
    the fallback finds a healthy GPU's MIG devices through that GPU, and a MIG device of
    the lost GPU is still told lost."""
    nvml = emulated("a100-40gb-mig-r550")
    gpu1 = discover(nvml).gpus[1]
    partition = next(d for d in gpu1.partitions if d.placement and d.placement.profile_id == 19)
    assert partition.placement is not None
    gi = create_gpu_instance(nvml, gpu1.uuid, partition.placement)
    create_compute_instance(nvml, gpu1.uuid, gi)
    inventory = discover(nvml)
    healthy, lost = inventory.gpus
    assert len(healthy.mig_devices) == 4
    assert len(lost.mig_devices) == 1
    nvml.lose_gpu(1)
    sampler = Sampler(nvml, pool="n1", inventory=lambda: inventory, prepared=list)
    sample = await sampler.sample_once()
    readings = {device.uuid: reading for device, reading in sample.devices}
    for mig in healthy.mig_devices:
        assert "handle" not in readings[mig.uuid].missing
        assert readings[mig.uuid].values["memory_used"] >= 0
    assert readings[lost.mig_devices[0].uuid].missing == {"handle": "gpu_is_lost"}
    nvml.nvmlInit()
    for mig in healthy.mig_devices:
        assert nvml.nvmlDeviceGetUUID(device_handle(nvml, mig.uuid)) == mig.uuid
    nvml.nvmlShutdown()


def test_a_lost_gpu_is_left_out_and_the_others_are_published(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nvml.h answers GPU_IS_LOST per GPU ("if the target GPU has fallen off the bus"):
    discovery leaves that GPU out, says so, and describes the other seven, which the
    lookup by UUID (GPU_IS_LOST for all of them while one is lost) must not decide."""
    nvml = emulated("h100-80gb-hbm3-x8")
    healthy = discover(nvml)
    nvml.lose_gpu(5)
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.devices"):
        inventory = discover(nvml)
    assert inventory.gpus == tuple(g for g in healthy.gpus if g.index != 5)
    assert inventory.lost == (LostGpu(5, "nvmlDeviceGetHandleByIndex"),)
    assert [d.name for d in inventory.devices()] == [f"gpu-{i}" for i in (0, 1, 2, 3, 4, 6, 7)]
    [logged] = [r.__dict__["fields"] for r in caplog.records if "GPU is lost" in r.getMessage()]
    assert (logged["gpuIndex"], logged["call"]) == (5, "nvmlDeviceGetHandleByIndex")
    assert "NVML_ERROR_GPU_IS_LOST" in logged["error"]


def test_a_gpu_lost_in_the_middle_of_its_scan_is_left_out_too() -> None:
    """GPU_IS_LOST from any call on a GPU's handles (or its MIG devices') leaves that GPU
    out, whichever call it is; from a call for the whole system nothing is published."""
    probe = emulated("a100-40gb-mig-mixed")
    whole = discover(probe)
    for n in range(probe.call_count):
        nvml = emulated("a100-40gb-mig-mixed")
        nvml.fail_after(n, pynvml.NVML_ERROR_GPU_IS_LOST)  # this call and every later one
        try:
            inventory = discover(nvml)
        except DiscoveryError as err:
            assert err.gpu_index is None and err.call is not None
            assert isinstance(err.nvml_error, pynvml.NVMLError_GpuIsLost)
            continue
        [first_lost, *later] = inventory.lost
        assert first_lost.call.startswith("nvml")
        assert [g.index for g in inventory.gpus] == list(range(first_lost.index))
        assert inventory.gpus == whole.gpus[: first_lost.index]
        assert [e.index for e in later] == list(range(first_lost.index + 1, len(whole.gpus)))


def lost_gpu_agent(shared: str = "none", *, checks: bool = False) -> NodeAgent:
    """An agent whose health watcher does not run; `checks`: as with --health-checks,
    where the tests apply what the watcher would report."""
    config = AgentConfig(node_name="n1", shared_gpus=SharedGpus.parse(shared), health_events=checks)
    return NodeAgent(config, cast(Kube, object()), emulated("h100-80gb-hbm3-x8"))


def published(agent: NodeAgent) -> list[str]:
    return [d["name"] for d in agent._content().devices]


@pytest.mark.anyio
async def test_the_agent_starts_with_a_lost_gpu_and_takes_it_back_once_it_answers() -> None:
    """After an XID 79 an agent restart still publishes the healthy GPUs; the rescan
    (what `NodeAgent` runs every `rescan_s`) adds the GPU back once it answers."""
    agent = lost_gpu_agent()
    assert isinstance(agent.nvml, NvmlEmulator)
    agent.nvml.lose_gpu(5)
    inventory = await agent.scan()  # would raise DiscoveryError if one GPU blanked the node
    assert [entry.index for entry in inventory.lost] == [5]
    assert published(agent) == [f"gpu-{i}" for i in (0, 1, 2, 3, 4, 6, 7)]
    agent.nvml.recover_gpu(5)
    inventory = await agent.scan()
    assert inventory.lost == ()
    assert published(agent) == [f"gpu-{i}" for i in range(8)]


@pytest.mark.anyio
async def test_with_health_checks_off_a_gpu_lost_while_published_leaves_the_pool() -> None:
    """A GPU lost after it was published stays in the pool for the watcher's `gpu-lost`
    taint (the test below). With the health checks off nothing would ever taint it:
    kept, it would be a dead GPU published healthy, so the rescan leaves it out."""
    agent = lost_gpu_agent()
    assert isinstance(agent.nvml, NvmlEmulator)
    await agent.scan()
    agent.nvml.lose_gpu(5)
    inventory = await agent.scan()  # the periodic rescan
    assert [entry.index for entry in inventory.lost] == [5]
    assert published(agent) == [f"gpu-{i}" for i in (0, 1, 2, 3, 4, 6, 7)]
    agent.nvml.recover_gpu(5)
    await agent.scan()
    assert published(agent) == [f"gpu-{i}" for i in range(8)]


@pytest.mark.anyio
async def test_a_gpu_lost_when_the_agent_starts_is_watched_once_it_is_back() -> None:
    """The health watcher registers the events of the GPUs it starts with; a GPU the
    rescan takes back (lost at start, so left out) is registered too, before the
    watcher's next wait, or its XIDs, double-bit ECC errors and next loss go unseen and
    it stays published healthy whatever it reports."""
    nvml = emulated("h100-80gb-hbm3-x8")
    config = AgentConfig(node_name="n1", health=HealthPolicy(recovery_after_s=600))
    agent = NodeAgent(config, cast(Kube, object()), nvml)
    nvml.lose_gpu(5)
    await agent.scan()  # the agent's first scan: GPU 5 left out
    health = agent.health
    assert health is not None
    watcher = NvmlHealthWatcher(nvml, health, wait_timeout_ms=20)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        nvml.recover_gpu(5)
        inventory = await agent.scan()  # the periodic rescan takes it back
        uuid = inventory.gpus[5].uuid
        assert inventory.gpus[5].index == 5
        # NVML reports a GPU's events once they are registered: it keeps reporting.
        with anyio.fail_after(5):
            while "gpu-5" not in health.report().unhealthy():
                nvml.inject_ecc(5)
                await anyio.sleep(0.05)
        assert [t.key for t in health.report().taints("gpu-5")] == ["gpu.nvidia.com/ecc"]

        seen = health.generation
        nvml.inject_xid(5, 48)
        with anyio.fail_after(5):
            await health.wait_for_change(seen)
        assert ("gpu.nvidia.com/xid", "48") in {
            (t.key, t.value) for t in health.report().taints("gpu-5")
        }

        seen = health.generation
        nvml.lose_gpu(5)  # lost again: the watcher sees it this time
        with anyio.fail_after(5):
            await health.wait_for_change(seen)
        assert health.lost_gpus == {uuid}
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_gpu_lost_while_published_stays_published_tainted() -> None:
    """The rescan keeps a published GPU that is lost as it was last described, so its
    gpu-lost taint (NoExecute) stays on the slice instead of the device vanishing."""
    agent = lost_gpu_agent(checks=True)
    assert isinstance(agent.nvml, NvmlEmulator)
    before = await agent.scan()
    lost = before.gpus[5]
    agent.nvml.lose_gpu(5)
    assert agent.health is not None
    agent.health.apply(GpuLostEvent(lost.uuid))  # what the health watcher reports
    inventory = await agent.scan()
    assert inventory.gpus == before.gpus
    assert inventory.lost == (LostGpu(5, "nvmlDeviceGetHandleByIndex", lost.uuid),)
    devices = {d["name"]: d for d in agent._content().devices}
    assert len(devices) == 8
    assert [t["key"] for t in devices["gpu-5"]["taints"]] == ["gpu.nvidia.com/gpu-lost"]


@pytest.mark.anyio
async def test_shared_gpus_naming_a_lost_gpu_does_not_stop_the_agent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first inventory stops the agent when --shared-gpus names a GPU it lacks; a
    lost GPU is not lacking, and stopping would blank the node again."""
    agent = lost_gpu_agent("5")
    assert isinstance(agent.nvml, NvmlEmulator)
    agent.nvml.lose_gpu(5)
    with caplog.at_level(logging.ERROR, logger="gpudra.driver.agent"):
        await agent.scan()
    assert agent.shared == frozenset()
    [problems] = [r.__dict__["fields"]["problems"] for r in caplog.records]
    assert problems == ["GPU index 5 is lost (NVML answers GPU_IS_LOST), so it is not published"]
    agent.nvml.recover_gpu(5)
    await agent.scan()
    assert agent.shared == {"gpu-5"}


def test_a_uuid_not_found_while_a_gpu_is_lost_may_be_that_gpus() -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    uuid = discover(nvml).gpus[5].uuid
    nvml.lose_gpu(5)
    inventory = discover(nvml)
    assert SharedGpus.parse(uuid).absent(inventory) == [
        f"no GPU with UUID {uuid.lower()} among the GPUs that answer (lost, and maybe it: index 5)"
    ]


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
