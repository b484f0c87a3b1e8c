"""Dynamic MIG beside MIG instances gpudra did not create (a GPU partitioned beforehand
with nvidia-smi or mig-parted): what those hold is kept out of the published pool, so
the scheduler never allocates a placement NVML cannot create, while the instances of
claims gpudra prepared (its checkpoint's) stay published as allocated."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path
from typing import Any, cast

import pynvml
import pytest
from gpudra.common.kube import Kube
from gpudra.driver import publish
from gpudra.driver.agent import AgentConfig
from gpudra.driver.checkpoint import ClaimRef, DeviceRecord
from gpudra.driver.checkpoint import load as load_checkpoint
from gpudra.driver.devices import Device, Gpu, MigKey, MigStrategy, discover
from gpudra.driver.mig import create_compute_instance, create_gpu_instance, recorded_instances
from gpudra.driver.node import NodeService, PluginConfig
from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.records import CreatedMig, DeviceDetails

MIXED = "a100-40gb-mig-mixed"  # GPU 0: 2g at 0, 1g at 2 and 3, 3g at 4; GPU 1: 4g at 0, 1g+me at 6
BOOT = "6c0ff6d4-1b2d-4a3e-9f00-00000000000a"
CLAIM = ClaimRef(namespace="ns", uid="11111111-1111-1111-1111-111111111111", name="c")


def emulated(profile: str) -> NvmlEmulator:
    nvml = load_nvml(f"emulated:{profile}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml


def slices_of(device: Device) -> set[int]:
    assert device.placement is not None
    return set(range(device.placement.start, device.placement.end))


def taken(gpu: Gpu) -> set[int]:
    return {s for i in gpu.gpu_instances for s in range(i.placement.start, i.placement.end)}


def consumption(device: Device) -> dict[str, int]:
    (use,) = device.consumes_counters
    return dict(use.counters)


def test_discovery_reads_every_gpu_instance() -> None:
    inventory = discover(emulated(MIXED))
    assert [
        [(i.placement.profile, i.placement.start, i.placement.size) for i in g.gpu_instances]
        for g in inventory.gpus
    ] == [
        [("2g.10gb", 0, 2), ("1g.5gb", 2, 1), ("1g.5gb", 3, 1), ("3g.20gb", 4, 4)],
        [("4g.20gb", 0, 4), ("1g.5gb+me", 6, 1)],
    ]


def test_placements_an_instance_gpudra_did_not_create_holds_are_not_published() -> None:
    inventory = discover(emulated(MIXED))
    content = publish.pool_content(inventory, MigStrategy.DYNAMIC)  # nothing is gpudra's
    published = {d["name"] for d in content.devices}
    gpu0, gpu1 = inventory.gpus
    assert not {d.name for d in gpu0.partitions} & published  # every memory slice is taken
    left = [d for d in gpu1.partitions if d.name in published]
    assert sorted(d.name for d in left) == [
        "gpu-1-mig-1g10gb-15-4",
        "gpu-1-mig-1g5gb-19-4",
        "gpu-1-mig-1g5gb-19-5",
        "gpu-1-mig-2g10gb-14-4",
    ]
    assert all(not slices_of(d) & taken(gpu1) for d in left)
    # 1g.5gb+me at 4 and 5 overlap nothing, but the instance at 6 has the one OFA engine.
    assert "gpu-1-mig-1g5gb-me-20-4" not in published
    sets = {cs["name"]: cs["counters"] for cs in content.counter_sets}
    assert sets["gpu-1-counter-set"]["memory-slice-0"] == {"value": "0"}
    assert sets["gpu-1-counter-set"]["memory-slice-4"] == {"value": "1"}
    assert sets["gpu-1-counter-set"]["ofa-engines"] == {"value": "0"}


@pytest.mark.parametrize("seed", range(20))
def test_counters_left_beside_foreign_instances_allow_exactly_what_nvml_creates(
    seed: int,
) -> None:
    """A scheduler honouring the published counters only picks placements NVML can
    create beside the instances already there, and vice versa."""
    nvml = emulated(MIXED)
    gpu = discover(nvml).gpus[1]
    content = publish.pool_content(discover(nvml), MigStrategy.DYNAMIC)
    (totals,) = [
        {k: int(v["value"]) for k, v in cs["counters"].items()}
        for cs in content.counter_sets
        if cs["name"] == "gpu-1-counter-set"
    ]
    published = {d["name"] for d in content.devices}
    order = list(gpu.partitions)
    random.Random(seed).shuffle(order)
    used: dict[str, int] = {}
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    for device in order:
        wanted = consumption(device)
        allowed = device.name in published and all(
            used.get(k, 0) + v <= totals[k] for k, v in wanted.items()
        )
        assert device.placement is not None
        where = pynvml.c_nvmlGpuInstancePlacement_t(device.placement.start, device.placement.size)
        try:
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, device.placement.profile_id, ctypes.byref(where)
            )
            accepted = True
        except pynvml.NVMLError_InsufficientResources:
            accepted = False
        assert allowed == accepted, device.name
        if allowed:
            for k, v in wanted.items():
                used[k] = used.get(k, 0) + v


def test_instances_gpudra_made_stay_published_and_counted_by_the_scheduler() -> None:
    inventory = discover(emulated(MIXED))
    gpu1 = inventory.gpus[1]
    own: set[MigKey] = {
        (gpu1.uuid, i.placement.profile_id, i.placement.start) for i in gpu1.gpu_instances
    }
    content = publish.pool_content(inventory, MigStrategy.DYNAMIC, own_migs=own)
    published = {d["name"] for d in content.devices}
    assert {d.name for d in gpu1.partitions} <= published  # allocated: never hidden
    sets = {cs["name"]: cs["counters"] for cs in content.counter_sets}
    full = publish.counter_set(gpu1.counter_set) if gpu1.counter_set else None
    assert full is not None and sets["gpu-1-counter-set"] == full["counters"]
    # GPU 0's instances are not named: still nothing of GPU 0 is offered.
    assert not {d.name for d in inventory.gpus[0].partitions} & published


def test_the_static_view_and_the_plugins_lookup_are_unchanged() -> None:
    inventory = discover(emulated(MIXED))
    assert len(inventory.devices(MigStrategy.DYNAMIC)) == 2 * 25  # every placement
    content = publish.pool_content(inventory, MigStrategy.STATIC)
    assert len(content.devices) == 6 and content.counter_sets == []


# --- the node: discovery meets the kubelet plugin's checkpoint ---------------------------


def node_service(tmp_path: Path, nvml: NvmlEmulator) -> NodeService:
    boot = tmp_path / "boot_id"
    boot.write_text(BOOT + "\n")
    plugin = PluginConfig(
        kubelet_root=tmp_path / "kubelet",
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "state",
        boot_id_path=boot,
        toolkit_spec=False,
        driver_libraries=("usr/lib/libnvidia-ml.so.1",),
        sample_interval_s=0,
    )
    config = AgentConfig(node_name="n1", health_events=False)
    return NodeService(config, cast(Kube, object()), nvml, plugin)


def record_claim(tmp_path: Path, gpu_uuid: str, mig: CreatedMig, device: str) -> None:
    checkpoint = load_checkpoint(
        tmp_path / "state" / "checkpoint.json", boot_id_path=tmp_path / "boot_id"
    )
    details = DeviceDetails(type="mig", gpu_uuid=gpu_uuid, mig=mig)
    record = DeviceRecord(pool="n1", device=device, details=details)
    checkpoint.begin_prepare(CLAIM, [record])
    checkpoint.complete_prepare(CLAIM.uid, [record])


def names(content: Any) -> set[str]:
    return {d["name"] for d in content.devices}


@pytest.mark.anyio
async def test_the_node_publishes_its_own_instances_and_hides_what_others_hold(
    tmp_path: Path,
) -> None:
    nvml = emulated("h100-80gb-mig-r580")
    gpu = discover(nvml).gpus[0]
    ours = next(d for d in gpu.partitions if d.name == "gpu-0-mig-3g40gb-9-0")
    theirs = next(d for d in gpu.partitions if d.name == "gpu-0-mig-1g10gb-19-4")
    made: list[CreatedMig] = []
    for device in (ours, theirs):
        assert device.placement is not None
        gi = create_gpu_instance(nvml, gpu.uuid, device.placement)
        ci, _ = create_compute_instance(nvml, gpu.uuid, gi)
        p = device.placement
        made.append(CreatedMig(p.profile_id, p.profile, p.start, p.size, gi=gi, ci=ci))
    service = node_service(tmp_path, nvml)
    (tmp_path / "state").mkdir()
    record_claim(tmp_path, gpu.uuid, made[0], ours.name)  # a claim gpudra prepared
    await service.agent.scan()

    # Before the checkpoint is read every instance counts as foreign: nothing taken is
    # offered, the claim's own placement is hidden for that moment too.
    early = service.agent._content()
    assert ours.name not in names(early) and theirs.name not in names(early)

    assert service.preparer is not None
    await service.preparer.recover()
    content = service.agent._content()
    published = names(content)
    assert ours.name in published  # allocated to the claim: still published
    overlapping = {d.name for d in gpu.partitions if slices_of(d) & slices_of(theirs)}
    assert theirs.name in overlapping and not overlapping & published
    (counters,) = [
        cs["counters"] for cs in content.counter_sets if cs["name"] == "gpu-0-counter-set"
    ]
    assert counters["memory-slice-4"] == {"value": "0"}  # theirs
    assert counters["memory-slice-0"] == {"value": "1"}  # ours: the scheduler counts it
    checkpoint = service.preparer.checkpoint_now()
    assert checkpoint is not None
    assert recorded_instances(checkpoint.claims()) == {(gpu.uuid, 9, 0)}
