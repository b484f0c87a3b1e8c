"""`--numa-node-list`: `resource.kubernetes.io/numaNode` in KEP-6072's list form, the
GPU's node followed by the nodes of its socket at the least firmware distance, as the
Kubernetes helper (`deviceattribute`, v0.37) computes it for other drivers' devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpudra.driver import publish
from gpudra.driver.devices import NUMA_NODE_ATTRIBUTE, MigStrategy, discover
from gpudra.driver.nvml.topology import SysfsTopology
from gpudra.driver.slices import DeviceLimitError, SliceLimits, plan_slices, validate_device

from e2e.sysfs import sysfs_numa_machine, sysfs_numa_nodes
from tests.nvml.emulated import emulated

# Two sockets of two nodes each (sub-NUMA clustering): 11 within a socket, 21 across.
SNC2 = [[10, 11, 21, 21], [11, 10, 21, 21], [21, 21, 10, 11], [21, 21, 11, 10]]


def machine(root: Path, sockets: list[int | None], distances: list[list[int]]) -> SysfsTopology:
    sysfs_numa_machine(root, sockets, distances)
    return SysfsTopology(root)


@pytest.mark.parametrize(
    ("sockets", "distances", "node", "nearest"),
    [
        ([0, 0, 1, 1], SNC2, 0, (1,)),
        ([0, 0, 1, 1], SNC2, 3, (2,)),
        # Two sockets, one node each: the other node is the other socket's.
        ([0, 1], [[10, 21], [21, 10]], 0, ()),
        # At the least distance but on another socket: left out.
        ([0, 0, 1], [[10, 12, 12], [12, 10, 20], [12, 20, 10]], 0, (1,)),
        # A node without CPUs (memory alone, its socket unknown) is kept, as the helper
        # keeps it; the farther same-socket node is not the nearest.
        ([0, None, 0], [[10, 11, 12], [11, 10, 12], [12, 12, 10]], 0, (1,)),
        # The GPU's own node has no CPUs: its socket is unknown, so no node is left out.
        ([None, 0, 1], [[10, 11, 11], [11, 10, 21], [11, 21, 10]], 0, (1, 2)),
        # One node: nothing else to name.
        ([0], [[10]], 0, ()),
    ],
    ids=["snc2-first", "snc2-last", "two-sockets", "other-socket", "cpuless", "own-cpuless", "one"],
)
def test_the_nearest_nodes_of_the_socket_as_the_kubernetes_helper_reads_them(
    tmp_path: Path,
    sockets: list[int | None],
    distances: list[list[int]],
    node: int,
    nearest: tuple[int, ...],
) -> None:
    assert machine(tmp_path, sockets, distances).nearest_numa_nodes(node) == nearest


def test_without_a_distance_table_the_list_names_the_node_alone(tmp_path: Path) -> None:
    assert SysfsTopology(tmp_path).nearest_numa_nodes(0) == ()
    sysfs_numa_machine(tmp_path, [0], [[10]])
    (tmp_path / "devices/system/node/node0/distance").write_text("ten\n")
    assert SysfsTopology(tmp_path).nearest_numa_nodes(0) == ()
    assert SysfsTopology(tmp_path).nearest_numa_nodes(5) == ()


def published(topology: SysfsTopology, strategy: MigStrategy, *, lists: bool) -> dict[str, Any]:
    inventory = discover(emulated("a100-40gb-mig-r580"), topology=topology)
    content = publish.pool_content(inventory, strategy, lists=lists)
    plan_slices(content, SliceLimits())  # within what the API takes
    return {d["name"]: d["attributes"] for d in content.devices}


@pytest.mark.parametrize("strategy", [MigStrategy.STATIC, MigStrategy.DYNAMIC])
def test_every_device_of_a_gpu_carries_its_list_only_when_asked(
    tmp_path: Path, strategy: MigStrategy
) -> None:
    """GPU 0 on node 2 of the SNC2 machine, GPU 1 on node 1; every MIG device of a GPU
    (static devices and dynamic placements) carries its GPU's list."""
    topology = sysfs_numa_nodes(tmp_path, {"0000:07:00.0": 2, "0000:0f:00.0": 1})
    sysfs_numa_machine(tmp_path, [0, 0, 1, 1], SNC2)
    scalar = published(topology, strategy, lists=False)
    listed = published(topology, strategy, lists=True)
    assert scalar.keys() == listed.keys() and scalar
    for name, attrs in listed.items():
        node = scalar[name][NUMA_NODE_ATTRIBUTE]["int"]
        assert attrs[NUMA_NODE_ATTRIBUTE] == {"ints": {2: [2, 3], 1: [1, 0]}[node]}, name
        assert {k: v for k, v in attrs.items() if k != NUMA_NODE_ATTRIBUTE} == {
            k: v for k, v in scalar[name].items() if k != NUMA_NODE_ATTRIBUTE
        }


def test_a_gpu_without_a_node_has_no_list_either(tmp_path: Path) -> None:
    """R535's NVML has no NUMA node to fall back on where sysfs has none."""
    topology = sysfs_numa_nodes(tmp_path, {"0000:07:00.0": 0})
    inventory = discover(emulated("a100-40gb-mig-r535"), topology=topology)
    by_gpu = {
        d["attributes"]["parentUUID"]["string"]: d["attributes"].get(NUMA_NODE_ATTRIBUTE)
        for strategy in (MigStrategy.STATIC, MigStrategy.DYNAMIC)
        for d in publish.pool_content(inventory, strategy, lists=True).devices
    }
    assert sorted(by_gpu.values(), key=str) == [None, {"ints": [0]}]


def device(attributes: dict[str, Any]) -> dict[str, Any]:
    return {"name": "gpu-0", "attributes": attributes}


def test_a_list_is_checked_as_the_api_server_checks_it() -> None:
    limits = SliceLimits()
    validate_device(device({NUMA_NODE_ATTRIBUTE: {"ints": [0, 1]}}), limits)
    for bad in ([], [0, "1"], 0):
        with pytest.raises(DeviceLimitError, match="non-empty list of ints"):
            validate_device(device({NUMA_NODE_ATTRIBUTE: {"ints": bad}}), limits)
    # Each item counts towards the device's 48 values, as the API server counts them.
    many = {f"a{i}": {"int": i} for i in range(30)}
    validate_device(device({**many, "l": {"ints": list(range(18))}}), limits)
    with pytest.raises(DeviceLimitError, match="49 values"):
        validate_device(device({**many, "l": {"ints": list(range(19))}}), limits)
