"""A sysfs of PCI devices laid out in a test's folder, for the production reader of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from gpudra.driver.nvml.topology import SysfsTopology


def sysfs_numa_nodes(
    root: Path, nodes: Mapping[str, int], *, pcie_root: str = "pci0000:00"
) -> SysfsTopology:
    """`root` laid out as /sys is: each PCI device (bus ID `0000:18:00.0`) under
    `pcie_root` with its `numa_node` file, linked from bus/pci/devices; read as the
    agent reads /sys."""
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    for bus_id, node in nodes.items():
        device = root / "devices" / pcie_root / bus_id
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
        (links / bus_id).symlink_to(device)
    return SysfsTopology(root)


def sysfs_numa_machine(
    root: Path, sockets: Sequence[int | None], distances: Sequence[Sequence[int]]
) -> None:
    """`root`'s NUMA nodes as /sys shows them: node N's firmware distance row
    (`distances[N]`) and, where `sockets[N]` is not None, two CPUs of that physical
    package (None: a node without CPUs, memory alone)."""
    for node, (socket, row) in enumerate(zip(sockets, distances, strict=True)):
        folder = root / "devices" / "system" / "node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "distance").write_text(" ".join(map(str, row)) + "\n")
        if socket is None:
            continue
        (folder / "cpulist").write_text(f"{2 * node}-{2 * node + 1}\n")
        for cpu in (2 * node, 2 * node + 1):
            topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
            topology.mkdir(parents=True)
            (topology / "physical_package_id").write_text(f"{socket}\n")
