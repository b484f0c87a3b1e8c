"""dcgm-exporter's DRA mode keeps mapping pods to GPUs that gpudra serves.

dcgm-exporter (`--kubernetes-enable-dra`) takes the (driver, pool, device) of each
container's claims from the kubelet's pod-resources API (filled by the kubelet from the
claim's allocation, nothing a driver writes) and resolves the device to a GPU through
the driver's ResourceSlices: it watches slices with `spec.driver=gpu.nvidia.com`, reads
a pool only once all its slices of the newest generation are there, and reads the
device's bare attributes `type` ("gpu" or "mig"), `uuid`, and for MIG `parentUUID` and
`profile`; a MIG device without a `uuid` (a dynamic placement, created at prepare) is
resolved from its name, `gpu-<parent minor>-mig-<profile>-<GI profile id>-<placement
start>`. This test holds gpudra's published pools to exactly that (docs/monitoring.md,
"Beside dcgm-exporter").
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from gpudra.driver.agent import AgentConfig
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile
from gpudra.driver.publish import pool_content

DCGM_DRIVER = "gpu.nvidia.com"
DYNAMIC_MIG_NAME = re.compile(r"^gpu-(\d+)-mig-.+-(\d+)-(\d+)$")


def string(device: dict[str, Any], key: str) -> str | None:
    attr = device["attributes"].get(key)
    return None if attr is None else attr.get("string")


def test_the_default_driver_name_is_the_one_dcgm_exporter_watches() -> None:
    assert AgentConfig(node_name="n").driver_name == DCGM_DRIVER


@pytest.mark.parametrize("strategy", list(MigStrategy))
@pytest.mark.parametrize("profile", ["h100-80gb-hbm3-x8-mig", "a100-40gb-mig-mixed", "l4"])
def test_every_published_device_resolves_as_dcgm_exporter_resolves_it(
    profile: str, strategy: MigStrategy
) -> None:
    inventory = discover(NvmlEmulator(load_builtin_profile(profile)))
    gpus = {g.uuid: g for g in inventory.gpus}
    devices = pool_content(inventory, strategy).devices
    # Whole GPUs published for memory slices too: still `gpu` devices with their UUID.
    whole = frozenset(d["name"] for d in devices if string(d, "type") == "gpu")
    shared = pool_content(inventory, strategy, shared=whole, driver=DCGM_DRIVER).devices
    assert devices or strategy is MigStrategy.STATIC  # no MIG device created yet
    resolved = 0
    for device in [*devices, *shared]:
        kind = string(device, "type")
        uuid = string(device, "uuid")
        if kind == "gpu":
            assert uuid in gpus, device["name"]
        else:
            assert kind == "mig", device["name"]
            parent = gpus[string(device, "parentUUID") or ""]
            assert string(device, "profile"), device["name"]
            if uuid is None:
                placement = next(
                    d.placement
                    for d in inventory.devices(strategy)
                    if d.name == device["name"] and d.placement is not None
                )
                match = DYNAMIC_MIG_NAME.match(device["name"])
                assert match, device["name"]
                minor, profile_id, start = (int(g) for g in match.groups())
                assert minor == parent.minor
                assert (profile_id, start) == (placement.profile_id, placement.start)
        resolved += 1
    assert resolved == 2 * len(devices)
