"""Dynamic MIG's placement order decides where the scheduler puts an instance: it takes
the first published placement whose counters still fit, in slice order, and never moves
it. Each profile's placements are published from the highest start down, so a small
instance keeps off the low memory slices where the large profiles' only placements lie.

The scheduler is stood in for by `first_fit`, which reads the production slices
(discovery, `publish.pool_content`, `plan_slices`, `slice_names`) the way the structured
allocator does (checked against k8s.io/dynamic-resource-allocation v0.36.5 on the same
slices); the emulated NVML then creates what it chose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpudra.driver import publish
from gpudra.driver.devices import Gpu, Inventory, MigStrategy, discover
from gpudra.driver.mig import create_gpu_instance
from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.slices import SliceLimits, plan_slices, slice_names

DRIVER = "gpu.nvidia.com"
RECORDED_H200 = Path(__file__).parents[1] / "nvml" / "fixtures" / "recorded-h200-r580.json"
LIMITS = [
    pytest.param(SliceLimits.for_server(34), id="1.34"),
    pytest.param(SliceLimits.for_server(36), id="1.35+"),
]


def first_fit(inventory: Inventory, profiles: list[str], limits: SliceLimits) -> list[str | None]:
    """One claim per profile, allocated in turn as the scheduler does: slices sorted by
    name, devices as listed, the first unallocated device of the profile whose counters
    fit what the earlier claims left of its counter set (None: none fits)."""
    content = publish.pool_content(inventory, MigStrategy.DYNAMIC)
    bodies = plan_slices(content, limits)
    named = dict(zip(slice_names("n1", DRIVER, len(bodies)), bodies, strict=True))
    devices = [d for name in sorted(named) for d in named[name].get("devices", [])]
    left = {
        cs["name"]: {k: int(v["value"]) for k, v in cs["counters"].items()}
        for body in bodies
        for cs in body.get("sharedCounters", [])
    }
    allocated: list[str | None] = []
    for profile in profiles:
        chosen = None
        for dev in devices:
            if dev["name"] in allocated or dev["attributes"]["profile"] != {"string": profile}:
                continue
            uses = [
                (use["counterSet"], counter, int(amount["value"]))
                for use in dev["consumesCounters"]
                for counter, amount in use["counters"].items()
            ]
            if all(n <= left[cs].get(counter, 0) for cs, counter, n in uses):
                for cs, counter, n in uses:
                    left[cs][counter] -= n
                chosen = dev["name"]
                break
        allocated.append(chosen)
    return allocated


def h200(tmp_path: Path) -> NvmlEmulator:
    """The recorded H200 (R580) with MIG enabled, as `nvidia-smi -mig 1` leaves it."""
    data: dict[str, Any] = json.loads(RECORDED_H200.read_text())
    for gpu in data["gpus"]:
        gpu["migEnabled"] = gpu["migPendingEnabled"] = True
    path = tmp_path / "h200-mig.json"
    path.write_text(json.dumps(data))
    nvml = load_nvml(f"emulated:{path}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml


def emulated(source: str, tmp_path: Path) -> NvmlEmulator:
    if source == "h200":
        return h200(tmp_path)
    nvml = load_nvml(f"emulated:{source}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml


def one_free_gpu(inventory: Inventory) -> tuple[Inventory, Gpu]:
    """The node as if it had only its first MIG GPU without instances."""
    gpu = next(g for g in inventory.gpus if g.mig_enabled and not g.gpu_instances)
    return Inventory(inventory.driver_version, inventory.cuda_driver_version, (gpu,)), gpu


# The emulated GPU and its profiles: the smallest 1g, the 1g with two memory slices,
# 2g, 3g, and the 4g they come before.
MODELS = {
    "H100-80GB": ("h100-80gb-mig-r580", ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb"), "4g.40gb"),
    "H200": ("h200", ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb"), "4g.71gb"),
    "A100-40GB": ("a100-40gb-mig-r580", ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb"), "4g.20gb"),
}
SEQUENCES = [
    pytest.param(model, first, id=f"{model}-{MODELS[model][1][first]}-then-4g")
    for model in MODELS
    for first in range(4)
]


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize(("model", "first"), SEQUENCES)
def test_a_smaller_instance_first_leaves_room_for_a_4g_on_the_same_gpu(
    model: str, first: int, limits: SliceLimits, tmp_path: Path
) -> None:
    """A 4g has one placement, at memory slice 0; a 1g, a 1g with two slices, a 2g or a
    3g before it takes the top of the GPU, and the 4g still fits (as NVML confirms)."""
    source, smaller, quarter = MODELS[model]
    nvml = emulated(source, tmp_path)
    inventory, gpu = one_free_gpu(discover(nvml))
    got = first_fit(inventory, [smaller[first], quarter], limits)
    assert None not in got, got
    for name in got:
        assert name is not None
        device = inventory.find(name)
        assert device is not None and device.placement is not None
        create_gpu_instance(nvml, gpu.uuid, device.placement)  # NVML makes that layout


@pytest.mark.parametrize("limits", LIMITS)
def test_three_1g_then_a_4g_share_one_gpu(limits: SliceLimits, tmp_path: Path) -> None:
    inventory, _ = one_free_gpu(discover(h200(tmp_path)))
    got = first_fit(inventory, ["1g.18gb"] * 3 + ["4g.71gb"], limits)
    assert got == [
        "gpu-0-mig-1g18gb-19-6",
        "gpu-0-mig-1g18gb-19-5",
        "gpu-0-mig-1g18gb-19-4",
        "gpu-0-mig-4g71gb-5-0",
    ]


@pytest.mark.parametrize("limits", LIMITS)
def test_eight_1g_then_seven_4g_on_eight_gpus(limits: SliceLimits) -> None:
    """Eight 1g fill one GPU's seven compute slices and one of a second GPU; each of
    the eight GPUs still has a 4g's place but the full one."""
    inventory = discover(load_nvml("emulated:h100-80gb-hbm3-x8-mig"))
    got = first_fit(inventory, ["1g.10gb"] * 8 + ["4g.40gb"] * 7, limits)
    assert None not in got, got
    assert [str(n).split("-mig-")[0] for n in got[:8]] == ["gpu-0"] * 7 + ["gpu-1"]
    assert got[8:] == [f"gpu-{i}-mig-4g40gb-5-0" for i in range(1, 8)]


def test_each_profiles_placements_are_published_from_the_highest_start() -> None:
    gpu = discover(load_nvml("emulated:h100-80gb-mig-r580")).gpus[0]
    starts: dict[str, list[int]] = {}
    for device in gpu.publishable(MigStrategy.DYNAMIC):
        assert device.placement is not None
        starts.setdefault(device.placement.profile, []).append(device.placement.start)
    assert starts["1g.10gb"] == [6, 5, 4, 3, 2, 1, 0]
    assert starts["2g.20gb"] == [4, 2, 0]
    assert starts["3g.40gb"] == [4, 0]
    assert starts["4g.40gb"] == starts["7g.80gb"] == [0]
