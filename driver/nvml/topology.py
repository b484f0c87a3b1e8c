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
        try:
            node = int(path.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None


def pci_topology(nvml: object) -> PciTopology:
    """The topology `nvml` reports for its GPUs, or this machine's sysfs."""
    if isinstance(nvml, ReportsPciTopology):
        return nvml.pci_topology
    return SysfsTopology()
