"""Where a GPU sits on the PCI bus: its PCIe root complex and NUMA node.

NVML reports neither the root complex nor, before R550, the NUMA node, so on a real
node they come from sysfs, as the Kubernetes helpers read them. An NVML backend that
knows better (the emulator, from its profile: the machine it emulates has no sysfs)
reports its own through `ReportsPciTopology`; callers ask `pci_topology` and never
look at which backend they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["PciTopology", "ReportsPciTopology", "SysfsTopology", "pci_topology"]


class PciTopology(Protocol):
    """Where a PCI device sits, by bus ID (`0000:18:00.0`)."""

    def pcie_root(self, bus_id: str) -> str | None: ...

    def numa_node(self, bus_id: str) -> int | None: ...

    def nearest_numa_nodes(self, node: int) -> tuple[int, ...]:
        """The other NUMA nodes the list form of `resource.kubernetes.io/numaNode`
        (KEP-6072) names after `node` (`Device.list_attributes`); () where the machine
        does not say."""
        ...


@runtime_checkable
class ReportsPciTopology(Protocol):
    """An NVML backend that knows the topology of its own GPUs."""

    @property
    def pci_topology(self) -> PciTopology: ...


@dataclass(frozen=True, slots=True)
class SysfsTopology:
    """PCIe root complex and NUMA node from sysfs, as the Kubernetes helpers read them."""

    root: Path = Path("/sys")

    def pcie_root(self, bus_id: str) -> str | None:
        link = self.root / "bus" / "pci" / "devices" / bus_id
        try:
            target = link.resolve(strict=True)
            devices = (self.root / "devices").resolve(strict=True)
        except OSError:
            return None
        try:
            first = target.relative_to(devices).parts[0]
        except (ValueError, IndexError):
            return None
        return first if first.startswith("pci") else None

    def numa_node(self, bus_id: str) -> int | None:
        path = self.root / "bus" / "pci" / "devices" / bus_id / "numa_node"
        node = _read_int(path)
        return node if node is not None and node >= 0 else None

    def nearest_numa_nodes(self, node: int) -> tuple[int, ...]:
        """The NUMA nodes at the least distance from `node` in the firmware's table
        (ACPI SLIT, `node<N>/distance`) on `node`'s socket, in order: what the
        Kubernetes helper for the list form reads (`deviceattribute`, v0.37). A node
        whose socket is unknown (no CPUs, say) is kept, as the helper keeps it: leaving
        out a node of the same socket would break a match that holds."""
        nodes = self.root / "devices" / "system" / "node"
        try:
            row = [int(d) for d in (nodes / f"node{node}" / "distance").read_text().split()]
        except (OSError, ValueError):
            return ()
        if not 0 <= node < len(row):
            return ()
        others = [(i, d) for i, d in enumerate(row) if i != node]
        if not others:
            return ()
        least = min(d for _, d in others)
        socket = self._socket(node)
        return tuple(
            i
            for i, d in others
            if d == least and (socket is None or self._socket(i) in (None, socket))
        )

    def _socket(self, node: int) -> int | None:
        """The physical package of one of the node's CPUs; None for a node without
        CPUs or where sysfs does not say."""
        path = self.root / "devices" / "system" / "node" / f"node{node}" / "cpulist"
        try:
            first = path.read_text(encoding="ascii").strip().split(",")[0].split("-")[0]
            cpu = int(first)
        except (OSError, ValueError):
            return None
        package = self.root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        return _read_int(package / "physical_package_id")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None


def pci_topology(nvml: object) -> PciTopology:
    """The topology `nvml` reports for its GPUs, or this machine's sysfs."""
    if isinstance(nvml, ReportsPciTopology):
        return nvml.pci_topology
    return SysfsTopology()
