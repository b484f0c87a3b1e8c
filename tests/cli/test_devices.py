"""`gpudra devices`: free and held devices per node and class, from the ResourceSlices
the agent publishes (built here by the agent's own `pool_content`) and claims'
allocations as the scheduler writes them."""

from __future__ import annotations

from typing import Any

from gpudra.cli.devices import devices, render
from gpudra.cli.main import build_parser
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml import load_nvml
from gpudra.driver.publish import pool_content

DRIVER = "gpu.nvidia.com"
NODE = "gpu-node-1"


def slices(profile: str, **kwargs: Any) -> list[dict[str, Any]]:
    """The node's pool, as `gpudra node` publishes it (one slice is enough here)."""
    content = pool_content(discover(load_nvml(profile)), MigStrategy.DYNAMIC, **kwargs)
    spec: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": NODE,
        "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
        "devices": content.devices,
    }
    if content.counter_sets:
        spec["sharedCounters"] = content.counter_sets
    return [{"spec": spec}, {"spec": {"driver": "other.example.com", "devices": [{"name": "x"}]}}]


def claim(
    name: str, *results: tuple[str, dict[str, str]], sharing: str | None = None
) -> dict[str, Any]:
    """An allocated claim reserved for the pod of the same name."""
    config = []
    if sharing:
        parameters = {"kind": "GpuConfig", "sharing": {"strategy": sharing}}
        config = [{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": parameters}}]
    return {
        "metadata": {"namespace": "team-a", "name": name},
        "status": {
            "reservedFor": [{"resource": "pods", "name": f"pod-{name}"}],
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "part-0/share" if consumed.get("shares") else "gpu",
                            "driver": DRIVER,
                            "pool": NODE,
                            "device": device,
                            **({"consumedCapacity": consumed} if consumed else {}),
                        }
                        for device, consumed in results
                    ],
                    "config": config,
                }
            },
        },
    }


def by_name(found: list[Any]) -> dict[str, Any]:
    return {d.name: d for d in found}


def test_shares_memory_slices_and_whole_gpus_are_counted_per_node_and_class() -> None:
    published = slices(
        "emulated:h100-80gb-hbm3-x8",
        shares={"gpu-0": 2, "gpu-1": 2},
        shared=frozenset({"gpu-7"}),
        driver=DRIVER,
    )
    claims = [
        claim("a", ("gpu-0", {"shares": "1"}), sharing="TimeSlicing"),
        claim("b", ("gpu-0", {"shares": "1"}), sharing="TimeSlicing"),
        claim("c", ("gpu-1", {"shares": "1"}), sharing="MPS"),
        claim("d", ("gpu-2", {})),
        claim("e", ("gpu-7", {f"{DRIVER}/memory": "10Gi"})),
        {"metadata": {"namespace": "team-a", "name": "pending"}, "status": {}},
    ]
    found = devices(published, claims, DRIVER)
    assert [d.name for d in found] == [f"gpu-{i}" for i in range(8)]
    d = by_name(found)
    assert d["gpu-0"].use() == "full: 2/2 shares taken"
    assert d["gpu-1"].use() == "part: 1/2 shares taken"
    assert d["gpu-2"].use() == "full"
    assert d["gpu-3"].use() == "free"
    assert d["gpu-7"].use().startswith("part: 10Gi/")
    out = render(found).splitlines()
    assert out[0].split() == ["NODE", "CLASS", "DEVICES", "FREE", "PART", "FULL", "UNAVAILABLE"]
    # The whole-GPU classes count the same devices; no MIG device is published.
    assert out[1].split() == [NODE, "gpu.nvidia.com", "8", "4", "2", "2", "0"]
    assert out[2].split() == [NODE, "mig.nvidia.com", "0", "0", "0", "0", "0"]
    assert out[3].split() == [NODE, "gpu-shared.nvidia.com", "8", "4", "2", "2", "0"]
    lines = {line.split()[1]: line for line in out[6:]}
    assert lines["gpu-0"].endswith(
        "team-a/a (pod pod-a, TimeSlicing, 1 share); team-a/b (pod pod-b, TimeSlicing, 1 share)"
    )
    assert lines["gpu-1"].endswith("team-a/c (pod pod-c, MPS, 1 share)")
    assert lines["gpu-2"].endswith("team-a/d (pod pod-d, Exclusive)")
    assert lines["gpu-3"].split()[-2:] == ["free", "-"]


def test_a_held_mig_placement_blocks_only_placements_that_no_longer_fit() -> None:
    published = slices("emulated:h100-80gb-hbm3-x8-mig")

    def slices_of(device: dict[str, Any]) -> set[str]:
        (use,) = device["consumesCounters"]
        return {c for c in use["counters"] if c.startswith("memory-slice-")}

    on_gpu0 = {
        d["name"]: slices_of(d)
        for d in published[0]["spec"]["devices"]
        if d["name"].startswith("gpu-0-")
    }
    held = "gpu-0-mig-1g10gb-19-0"
    assert on_gpu0[held] == {"memory-slice-0"}
    found = by_name(devices(published, [claim("m", (held, {}))], DRIVER))
    assert found[held].use() == "full"
    for name, memory_slices in on_gpu0.items():
        if name == held:
            continue
        if "memory-slice-0" in memory_slices:  # that memory is taken
            assert found[name].use() == f"unavailable ({held} uses the same GPU)", name
    assert found["gpu-0-mig-1g10gb-19-1"].state == "free"  # the next memory slice fits
    # Placements on another GPU are untouched.
    assert all(d.state == "free" for n, d in found.items() if n.startswith("gpu-1-"))


def test_an_admin_access_claim_holds_nothing() -> None:
    # A monitoring pod's admin-access claim on a free GPU: the scheduler still hands
    # that GPU to others, so it is free, not held by the monitoring pod.
    published = slices("emulated:l4")
    probe = claim("probe", ("gpu-0", {}))
    probe["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    (d,) = devices(published, [probe], DRIVER)
    assert d.use() == "free"


def test_tainted_devices_are_unavailable() -> None:
    published = slices("emulated:l4")
    published[0]["spec"]["devices"][0]["taints"] = [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    ]
    (d,) = devices(published, [], DRIVER)
    assert d.use() == "tainted (gpu.nvidia.com/xid:NoSchedule)"


def test_an_informational_taint_leaves_a_device_free() -> None:
    """Effect None (an application's XID) keeps no pod off the device: counting it as
    unavailable would send an admin after GPUs that are there to be had."""
    published = slices("emulated:l4")
    published[0]["spec"]["devices"][0]["taints"] = [
        {"key": "gpu.nvidia.com/xid", "value": "13", "effect": "None"}
    ]
    (d,) = devices(published, [], DRIVER)
    assert (d.state, d.use()) == ("free", "free")


def test_the_command_is_registered() -> None:
    args = build_parser().parse_args(["devices", "--node", NODE])
    assert (args.command, args.node, args.driver_name) == ("devices", NODE, DRIVER)
