"""Which whole GPUs of this node are published with integer shares, and how many.

The device plugin's time-slicing `replicas: N` made every GPU of a node N
`nvidia.com/gpu`; `gpudra node --gpu-shares N` does the same the DRA way: the node's
whole GPUs are published with N shares (see `gpudra.driver.publish`), so up to N
claims of one share each run on it. Like the device plugin, the choice is per node,
not per GPU: one number for the cluster (the chart's `node.gpuShares`) with a
per-node override (`node.gpuSharesByNode`, passed as `--gpu-shares-node NAME=N`).

Which GPUs get them is `--gpu-shares-gpus` (the chart's `node.gpuSharesGpus`), in
`--shared-gpus`'s forms; `all`, the default, means every GPU that serves no other kind
of claim: those with MIG mode enabled (they serve MIG claims) and those handed out in
memory slices (`--shared-gpus`) are left out, as the device plugin's time-slicing
left MIG devices alone. A GPU is shared one way only, so naming one of those in
`--gpu-shares-gpus` stops the agent at the first inventory with one line naming the GPU
and the setting, since half of what the admin asked for would silently not happen.
Later scans only log it and publish the GPU without shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpudra.driver.devices import Gpu, Inventory, SharedGpus

__all__ = ["GpuShares", "GpuSharesError", "parse_node_override"]

MAX_SHARES = 1024


class GpuSharesError(ValueError):
    """`--gpu-shares` is malformed or conflicts with another setting for one GPU."""


@dataclass(frozen=True, slots=True)
class GpuShares:
    """Shares per GPU: `default` for every node, `by_node` overriding it by node name,
    on the GPUs `gpus` selects (`--gpu-shares-gpus`)."""

    default: int = 0
    by_node: Mapping[str, int] = field(default_factory=dict)
    gpus: SharedGpus = field(default_factory=lambda: SharedGpus(every=True))

    def __post_init__(self) -> None:
        for where, value in (("--gpu-shares", self.default), *self._overrides()):
            if not 0 <= value <= MAX_SHARES:
                raise GpuSharesError(
                    f"{where} is {value}; give 0 (no shares) to {MAX_SHARES} shares per GPU"
                )

    def _overrides(self) -> list[tuple[str, int]]:
        return [(f"--gpu-shares-node {n}={v}", v) for n, v in sorted(self.by_node.items())]

    def for_node(self, node: str) -> int:
        return self.by_node.get(node, self.default)

    def flag(self, node: str) -> str:
        """The setting that gave `node` its count, for messages."""
        if node in self.by_node:
            return f"--gpu-shares-node {node}={self.by_node[node]}"
        return f"--gpu-shares {self.default}"

    def resolve(
        self, inventory: Inventory, node: str, memory_shared: frozenset[str]
    ) -> tuple[dict[str, int], tuple[str, ...]]:
        """The shares of each whole GPU to publish, and the GPUs that conflict.

        `memory_shared` are the device names published for memory slices.
        """
        count = self.for_node(node)
        if count == 0:
            return {}, ()
        shares: dict[str, int] = {}
        problems: list[str] = []
        for gpu in filter(self.gpus.selects, inventory.gpus):
            why = _conflict(gpu, memory_shared)
            if why is None:
                shares[gpu.device.name] = count
            elif not self.gpus.every:  # `all` leaves out GPUs that serve other claims
                problems.append(
                    f"GPU index {gpu.index} ({gpu.uuid}) {why}; "
                    f"--gpu-shares-gpus {self.gpus} with {self.flag(node)}"
                )
        problems += (f"--gpu-shares-gpus {self.gpus}: {p}" for p in self.gpus.absent(inventory))
        return shares, tuple(problems)


def _conflict(gpu: Gpu, memory_shared: frozenset[str]) -> str | None:
    if gpu.mig_enabled:
        return (
            "has MIG mode enabled (it serves MIG claims) and cannot also be shared whole: "
            "disable MIG mode on it or leave it out of --gpu-shares-gpus"
        )
    if gpu.device.name in memory_shared:
        return (
            "is in --shared-gpus (memory slices) and cannot also have integer shares: "
            "leave it out of one of --shared-gpus and --gpu-shares-gpus"
        )
    return None


def parse_node_override(raw: str) -> tuple[str, int]:
    """`NODE=N` of `--gpu-shares-node`; raises GpuSharesError naming the fix."""
    name, sep, value = raw.partition("=")
    name = name.strip()
    if not sep or not name or not value.strip().isdigit():
        raise GpuSharesError(
            f"--gpu-shares-node {raw!r}: give NODE=N, a node name and a whole number of "
            "shares, e.g. gpu-node-1=4"
        )
    return name, int(value)
