"""GPU discovery: read NVML once and describe every allocatable device as plain data.

The result (`Inventory`) is what the ResourceSlice publisher and the kubelet plugin work
from. It uses the upstream NVIDIA DRA driver's device names and attribute keys so that
DeviceClasses and CEL selectors written for that driver select the same devices here.

How GPUs are shown:
- A GPU without MIG, or MIG-capable with MIG mode disabled, is one device `gpu-<minor>`.
  gpudra never switches MIG mode itself (on Ampere that needs a GPU reset, and on any
  GPU it needs the GPU idle), so a MIG-disabled GPU is offered as a whole GPU only.
- A GPU with MIG mode enabled is never offered whole. Discovery reads both views of it:
  the MIG devices that exist now (`Gpu.mig_devices`, for statically partitioned GPUs)
  and every possible placement of every MIG profile (`Gpu.partitions`, for dynamic
  partitioning) with a per-GPU counter set so the scheduler cannot over-allocate memory
  slices or engines. `Inventory.devices(strategy)` picks one view; the two must never be
  published together because a static MIG device and the placement it occupies have
  the same name. The dynamic view leaves out what GPU instances gpudra did not create
  hold (`Gpu.dynamic_view`): discovery reads every instance (`Gpu.gpu_instances`), and
  the publisher names gpudra's own.

Which whole GPUs are shareable by memory (`SharedGpus`, from `gpudra node --shared-gpus`)
is the admin's choice, not NVML's: discovery reads the same inventory either way, and
`SharedGpus.resolve` picks the device names the publisher marks shareable.

Discovery is all-or-nothing: any NVML failure raises `DiscoveryError` naming the GPU
index and the call, so a caller can never publish a partial inventory. So is a driver
older than the oldest supported branch, or no NVML library at all: the error names what
was found and what is needed, and the agent keeps retrying.

There are two exceptions, each confined to one GPU:
- NVML_ERROR_NO_PERMISSION depends on how the agent runs, not on the GPU: a MIG-enabled
  GPU's total memory, its placements and its MIG instances need the MIG monitor
  capability. A field that answers so is left out of that GPU only (`Gpu.gaps` says
  which, why and which privilege is missing; the log line and the
  `gpudra_discovery_gap` metric repeat it), and the rest is published.
- NVML_ERROR_GPU_IS_LOST from a call on one GPU's own handle (or a MIG device of it)
  means that GPU fell off the bus (XID 79), not that NVML is unusable: nvml.h gives
  it per GPU. Such a GPU cannot be described (its minor number, hence its device names,
  is unreadable), so it is left out (`Inventory.lost` names its index and the call;
  a warning says so) and every other GPU is published. Discovery walks the GPUs by
  index, never by UUID: NVML's lookup by UUID answers GPU_IS_LOST for every GPU while
  any one is lost. A GPU lost after it was published keeps its last description in
  the agent (`Inventory.keeping_lost`), so its health taint stays visible.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import pynvml
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.nvml.branches import (
    OLDEST_SUPPORTED_BRANCH,
    UNREPAIRABLE_MEMORY_ENTRY,
    BranchError,
    driver_branch,
)
from gpudra.driver.nvml.codes import (
    DRIVER_NOT_LOADED_FIX,
    describe_nvml_error,
    nvml_start_problem,
)
from gpudra.driver.nvml.handles import NO_MIG_AT_INDEX
from gpudra.driver.nvml.topology import PciTopology, pci_topology
from gpudra.driver.nvml.unrepairable import read_unrepairable_memory

logger = logging.getLogger(__name__)

T = TypeVar("T")

PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"

# What the upstream driver published and later removed. Up to v25.3, as ints: on a GPU
# its NVML `index` and device `minor` number; on a MIG device its NVML MIG `index` on the
# parent and the parent's NVML index, `parentIndex` (removed in v25.8.0, September 2025).
# Neither number is stable (NVML's order changes with CUDA_VISIBLE_DEVICES, a driver
# reload or a GPU that drops off the bus; minor numbers are handed out at driver load),
# so a selector on them may pick another GPU after a reboot. Up to v25.8, as a string:
# `pcieBusID` on GPUs and MIG devices (a MIG device's is its parent's), which v25.12.0
# renamed `resource.kubernetes.io/pciBusID`; the same value, go-nvlib's spelling. A
# manifest that selects on a key no device has fails in the scheduler's CEL evaluation,
# so they are offered (off by default) for manifests written for those releases
# (docs/gpus.md).
LEGACY_ATTRIBUTES = ("index", "minor", "parentIndex", "pcieBusID")

# go-nvlib's brand and architecture spellings, which upstream publishes.
_BRANDS: Mapping[int, str] = {
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}
_ARCHITECTURES: Mapping[int, str] = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
    pynvml.NVML_DEVICE_ARCH_RUBIN: "Rubin",
    pynvml.NVML_DEVICE_ARCH_UNKNOWN: "Unknown",
}
# nvmlDeviceGetAddressingMode's answers, as go-nvlib spells them (upstream's attribute).
_ADDRESSING_MODES: Mapping[int, str] = {
    pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}
# MIG profile name suffixes by GPU-instance profile index, as go-nvlib/nvidia-smi spell them.
_PROFILE_SUFFIXES: Mapping[int, str] = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: "+me.all",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: "+me.all",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: "-me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: "-me",
}
# MIG capacity keys (upstream spelling) and the NVML profile fields they come from.
_MIG_CAPACITIES: tuple[tuple[str, str], ...] = (
    ("multiprocessors", "multiprocessorCount"),
    ("copyEngines", "copyEngineCount"),
    ("decoders", "decoderCount"),
    ("encoders", "encoderCount"),
    ("jpegEngines", "jpegCount"),
    ("ofaEngines", "ofaCount"),
)
_COUNTER_NAMES: Mapping[str, str] = {
    "multiprocessors": "multiprocessors",
    "copyEngines": "copy-engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpegEngines": "jpeg-engines",
    "ofaEngines": "ofa-engines",
    "memory": "memory",
}
_MIB = 1024 * 1024
_GIB = 1024 * 1024 * 1024


class DiscoveryError(RuntimeError):
    """Discovery failed; nothing it read may be published.

    `gpu_index` and `call` name the GPU and the NVML call when NVML failed;
    `nvml_error` is the original pynvml exception then.
    """

    def __init__(
        self,
        message: str,
        *,
        gpu_index: int | None = None,
        call: str | None = None,
        nvml_error: Exception | None = None,
    ) -> None:
        super().__init__(message)
        self.gpu_index = gpu_index
        self.call = call
        self.nvml_error = nvml_error


class DeviceType(StrEnum):
    GPU = "gpu"
    MIG = "mig"


class MigStrategy(StrEnum):
    """Which view of MIG-enabled GPUs to publish (see the module docstring)."""

    STATIC = "static"  # the MIG devices that exist now
    DYNAMIC = "dynamic"  # every placement, as partitionable devices with counters


@dataclass(frozen=True, slots=True)
class Version:
    """An attribute value of kind `version` (a semantic version string)."""

    value: str


# A tuple of ints is a list-type attribute (`ints`, Kubernetes' DRAListTypeAttributes).
AttributeValue = str | int | bool | Version | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CounterSet:
    """A ResourceSlice `sharedCounters` entry: what one physical GPU can hand out."""

    name: str
    counters: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class CounterConsumption:
    """A device's `consumesCounters` entry."""

    counter_set: str
    counters: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """Where a MIG device sits: GPU-instance profile and memory-slice placement."""

    profile: str  # e.g. "1g.10gb"
    profile_id: int  # GPU instance profile ID, e.g. 19
    start: int
    size: int

    @property
    def end(self) -> int:
        """One past the last memory slice it takes."""
        return self.start + self.size


# A MIG GPU instance by where it sits: (parent GPU UUID, GPU-instance profile ID,
# placement start). A placement holds one instance at a time, so this names it whoever
# made it; the kubelet plugin's checkpoint records the ones gpudra made the same way
# (`gpudra.driver.mig.recorded_instances`).
MigKey = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A GPU instance that exists on a MIG-enabled GPU now, whoever made it (gpudra for
    a prepared claim, or an administrator with nvidia-smi or mig-parted)."""

    gpu_instance_id: int
    placement: MigPlacement


@dataclass(frozen=True, slots=True)
class Device:
    """One allocatable device with its canonical (unqualified) attributes and capacity.

    `uuid` is None for a placement that does not exist yet (dynamic MIG).
    `gpu_instance_id`/`compute_instance_id` are set for MIG devices that exist.
    `legacy_attributes` are upstream's attributes from before v25.8.0 (`LEGACY_ATTRIBUTES`),
    published only when the admin asks (`gpudra node --legacy-attributes`).
    `list_attributes` are attributes in their list form, published in place of the
    scalar ones only when the admin asks (`gpudra node --numa-node-list`): an API
    server without the DRAListTypeAttributes feature gate refuses them.
    """

    name: str
    type: DeviceType
    gpu_index: int
    parent_uuid: str
    uuid: str | None
    attributes: Mapping[str, AttributeValue]
    capacity: Mapping[str, int]
    consumes_counters: tuple[CounterConsumption, ...] = ()
    placement: MigPlacement | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    legacy_attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    list_attributes: Mapping[str, AttributeValue] = field(default_factory=dict)


# What NVML needs to answer the calls that may say NO_PERMISSION, for the log and metric.
MIG_MONITOR_PRIVILEGE = (
    "the MIG monitor capability (read access to /dev/nvidia-caps/nvidia-cap2, "
    "granted by /proc/driver/nvidia/capabilities/mig/monitor), or root"
)


@dataclass(frozen=True, slots=True)
class FieldGap:
    """A field of one GPU that NVML refused to read, and the privilege it needs."""

    field: str  # "memory", "placements", "migDevices"
    call: str
    privilege: str
    effect: str  # what is published without it


@dataclass(frozen=True, slots=True)
class LostGpu:
    """A GPU whose own NVML calls answered GPU_IS_LOST: it fell off the bus.

    `uuid` is known only where an earlier inventory described the GPU and the agent
    kept that description (`Inventory.keeping_lost`); NVML cannot tell it now.
    """

    index: int  # NVML index
    call: str  # the call that answered GPU_IS_LOST
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class Gpu:
    """Everything discovery learnt about one physical GPU."""

    index: int
    minor: int
    uuid: str
    pci_bus_id: str
    product_name: str
    mig_capable: bool
    mig_enabled: bool
    device: Device  # the whole GPU
    mig_devices: tuple[Device, ...] = ()  # MIG devices that exist now
    partitions: tuple[Device, ...] = ()  # every possible placement (MIG enabled only)
    counter_set: CounterSet | None = None  # what partitions consume from
    mig_profiles: Mapping[int, str] = field(default_factory=dict)  # GI profile ID -> name
    gaps: tuple[FieldGap, ...] = ()  # fields NVML refused for lack of privilege
    # Every GPU instance that exists now, with or without compute instances (MIG
    # devices are only those with one spanning the instance); for dynamic MIG.
    gpu_instances: tuple[MigInstance, ...] = ()
    # GI profile ID -> its compute slices (NVML `sliceCount`: 1 for a 1g, 7 for a 7g).
    mig_slices: Mapping[int, int] = field(default_factory=dict)
    # NVML's row remapper says a remapping ever failed (`nvmlDeviceGetRemappedRows`):
    # the GPU reached NVIDIA's RMA threshold for its memory. None where NVML does not
    # say (before Ampere, or a MIG-enabled GPU with instances: nvml.h).
    row_remap_failed: bool | None = None
    # NVML says the GPU has unrepairable memory (`nvmlDeviceGetUnrepairableMemoryFlag_v1`,
    # `gpudra.driver.nvml.unrepairable`). None where NVML does not say (before Hopper, a
    # driver before R590).
    unrepairable_memory: bool | None = None

    def compute_share(self, profile_id: int) -> float | None:
        """The part of this GPU's compute a MIG device of GPU-instance profile
        `profile_id` has: the profile's compute slices over the whole GPU's, which are
        its largest profile's (the 7g's on an A100, H100 or H200: a 1g, `+me` or not,
        is a seventh). Compute slices, not memory: a 1g.20gb computes as a 1g.10gb
        does. None for a profile discovery did not read."""
        slices = self.mig_slices.get(profile_id)
        whole = max(self.mig_slices.values(), default=0)
        return slices / whole if slices and whole else None

    def publishable(
        self, strategy: MigStrategy, own: Container[MigKey] | None = None
    ) -> tuple[Device, ...]:
        """The devices `strategy` publishes; `own` as in `dynamic_view`."""
        if not self.mig_enabled:
            return (self.device,)
        if strategy is MigStrategy.DYNAMIC:
            return self.dynamic_view(own)[0]
        return self.mig_devices

    def foreign_instances(self, own: Container[MigKey]) -> tuple[MigInstance, ...]:
        """The GPU instances `own` does not name: ones gpudra did not create."""
        return tuple(
            i
            for i in self.gpu_instances
            if (self.uuid, i.placement.profile_id, i.placement.start) not in own
        )

    def dynamic_view(
        self, own: Container[MigKey] | None = None
    ) -> tuple[tuple[Device, ...], CounterSet | None]:
        """The placements dynamic MIG publishes and the counter set they consume from.

        `own` names the GPU instances gpudra created for prepared claims (the kubelet
        plugin's checkpoint); every other instance on the GPU (made with nvidia-smi or
        mig-parted before or beside gpudra) is foreign. None: every placement, as
        discovered, whatever exists (what a device name means to the kubelet plugin).

        A foreign instance holds its memory slices and engines as an allocated device
        would, so it is taken off the counter set, and a placement that no longer fits
        the rest (it overlaps the instance, or needs an engine it took, such as the one
        OFA engine of a `+me` profile) is left out: NVML would refuse to create it and
        the claim's prepare would fail. Left out rather than tainted NoSchedule: a
        toleration would still allocate it, and an API server without the
        DRADeviceTaints gate (off by default up to 1.35) drops device taints silently.
        The counters stay exact (they allow what NVML creates, no more), so no layout of
        the published placements collides with a foreign instance. gpudra's own
        instances are neither taken off nor hidden: their placements are allocated to
        claims, and the scheduler counts what allocated devices consume itself.
        """
        counter_set = self.counter_set
        if own is None or counter_set is None:
            return self.partitions, counter_set
        foreign = self.foreign_instances(own)
        if not foreign:
            return self.partitions, counter_set
        held: dict[str, int] = {}
        for instance in foreign:
            for key, value in self._instance_counters(instance.placement).items():
                held[key] = held.get(key, 0) + value
        left = {k: max(v - held.get(k, 0), 0) for k, v in counter_set.counters.items()}
        fits = tuple(
            d
            for d in self.partitions
            if all(
                v <= left.get(k, 0) for use in d.consumes_counters for k, v in use.counters.items()
            )
        )
        return fits, CounterSet(counter_set.name, left)

    def _instance_counters(self, placement: MigPlacement) -> Mapping[str, int]:
        """What an instance at `placement` consumes: the placement's counters, or its
        profile's engines with its own memory slices where NVML lists no such placement."""
        slices = {memory_slice_counter(s): 1 for s in range(placement.start, placement.end)}
        same_profile: Mapping[str, int] = {}
        for device in self.partitions:
            at = device.placement
            if at is None or at.profile_id != placement.profile_id or not device.consumes_counters:
                continue
            counters = device.consumes_counters[0].counters
            if at.start == placement.start:
                return counters
            same_profile = counters
        engines = {k: v for k, v in same_profile.items() if not k.startswith(_SLICE_PREFIX)}
        return {**engines, **slices}

    def device_names(self) -> frozenset[str]:
        """Every name any view uses for this GPU or a part of it."""
        names = {self.device.name}
        names.update(d.name for d in self.mig_devices)
        names.update(d.name for d in self.partitions)
        return frozenset(names)


@dataclass(frozen=True, slots=True)
class Inventory:
    """The node's GPUs as read from NVML in one consistent scan."""

    driver_version: str
    cuda_driver_version: int
    gpus: tuple[Gpu, ...]
    lost: tuple[LostGpu, ...] = ()  # GPUs that answered GPU_IS_LOST (module docstring)

    def keeping_lost(self, previous: Inventory) -> Inventory:
        """This inventory with each lost GPU that `previous` described put back as it was.

        A GPU that falls off the bus while published must stay published, tainted
        `gpu-lost` by the health watcher, so that pods using it are evicted and the
        scheduler sees why; dropping it would leave their claims on a device no slice
        names. The lost GPU is matched by NVML index, which stays the GPU's while the
        driver stays loaded; a description whose UUID or device names another GPU now
        has is not kept.
        """
        if not self.lost:
            return self
        by_index = {g.index: g for g in previous.gpus}
        uuids = {g.uuid for g in self.gpus}
        names = {name for g in self.gpus for name in g.device_names()}
        kept: list[Gpu] = []
        lost: list[LostGpu] = []
        for entry in self.lost:
            old = by_index.get(entry.index)
            if old is None or old.uuid in uuids or old.device_names() & names:
                lost.append(entry)
                continue
            kept.append(old)
            uuids.add(old.uuid)
            names |= old.device_names()
            lost.append(LostGpu(entry.index, entry.call, old.uuid))
        if not kept:
            return self
        gpus = tuple(sorted((*self.gpus, *kept), key=lambda g: g.index))
        return Inventory(self.driver_version, self.cuda_driver_version, gpus, tuple(lost))

    def devices(
        self, strategy: MigStrategy = MigStrategy.STATIC, own: Container[MigKey] | None = None
    ) -> tuple[Device, ...]:
        """The devices to publish under `strategy`, GPU by GPU in NVML index order;
        `own` as in `Gpu.dynamic_view` (None: every placement)."""
        return tuple(d for gpu in self.gpus for d in gpu.publishable(strategy, own))

    def counter_sets(
        self, strategy: MigStrategy = MigStrategy.STATIC, own: Container[MigKey] | None = None
    ) -> tuple[CounterSet, ...]:
        """The shared counter sets the devices of `strategy` consume from."""
        if strategy is not MigStrategy.DYNAMIC:
            return ()
        sets = (gpu.dynamic_view(own)[1] for gpu in self.gpus if gpu.mig_enabled)
        return tuple(cs for cs in sets if cs is not None)

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None

    def compute_share(self, name: str) -> float | None:
        """The part of its GPU's compute the device `name` (of any view) has: all of
        it for a whole GPU, a MIG device its profile's part (`Gpu.compute_share`);
        None for a name no view has."""
        device = self.find(name)
        if device is None:
            return None
        if device.placement is None:  # a whole GPU
            return 1.0
        gpu = self.gpu_by_uuid(device.parent_uuid)
        return gpu.compute_share(device.placement.profile_id) if gpu is not None else None

    def find(self, name: str) -> Device | None:
        """Look a device up by name in every view."""
        for gpu in self.gpus:
            if gpu.device.name == name:
                return gpu.device
            for device in (*gpu.mig_devices, *gpu.partitions):
                if device.name == name:
                    return device
        return None


MEMORY_SLICE_MIN = _GIB
_GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$", re.IGNORECASE)
SHARED_GPUS_FORMS = (
    "none, all, or a comma-separated list of GPU indices and/or GPU UUIDs "
    "(e.g. 0,3 or GPU-86737bf0-609a-5b5b-b9e7-de8873112c51)"
)


class SharedGpusError(ValueError):
    """`--shared-gpus` is malformed or names a GPU this node cannot share."""


@dataclass(frozen=True, slots=True)
class SharedGpus:
    """Which whole GPUs are published with `allowMultipleAllocations` (memory slices).

    An admin choice per node, so it is configuration, not discovery: the same GPUs are
    discovered either way. `all` shares every GPU that can be shared and skips the rest;
    naming a GPU that cannot be shared (absent, MIG-enabled, no memory size) is an error,
    since the admin asked for something that would silently not happen.
    """

    every: bool = False
    indices: frozenset[int] = frozenset()
    uuids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # NVML spells UUIDs in lower case; people copy them from anywhere.
        object.__setattr__(self, "uuids", frozenset(u.lower() for u in self.uuids))

    @classmethod
    def parse(cls, raw: str) -> SharedGpus:
        """`none`, `all`, or `0,3,GPU-<uuid>`; raises `SharedGpusError` naming the problem."""
        text = raw.strip()
        if text.lower() == "none":
            return cls()
        if text.lower() == "all":
            return cls(every=True)
        indices: set[int] = set()
        uuids: set[str] = set()
        for item in (part.strip() for part in text.split(",")):
            if item.isascii() and item.isdigit():
                indices.add(int(item))
            elif _GPU_UUID.match(item):
                uuids.add(item.lower())
            elif not item:
                raise SharedGpusError(f"empty entry in {raw!r}; give {SHARED_GPUS_FORMS}")
            elif item.upper().startswith("MIG-"):
                raise SharedGpusError(
                    f"{item!r} is a MIG device; only whole GPUs can be shared by memory"
                )
            elif item.lower() in ("none", "all"):
                raise SharedGpusError(f"{item!r} cannot be combined with other entries")
            else:
                raise SharedGpusError(
                    f"{item!r} is neither a GPU index nor a GPU UUID; give {SHARED_GPUS_FORMS}"
                )
        return cls(indices=frozenset(indices), uuids=frozenset(uuids))

    def __str__(self) -> str:
        if self.every:
            return "all"
        if not self.indices and not self.uuids:
            return "none"
        return ",".join([*(str(i) for i in sorted(self.indices)), *sorted(self.uuids)])

    def resolve(self, inventory: Inventory) -> tuple[frozenset[str], tuple[str, ...]]:
        """The names of the whole-GPU devices to publish shared, and what could not be.

        A GPU with MIG mode enabled is never offered whole (see the module docstring),
        so it cannot be handed out in memory slices either; one whose memory NVML does
        not report (or below the smallest slice) has nothing to slice.
        """
        names: set[str] = set()
        problems: list[str] = []
        for gpu in filter(self.selects, inventory.gpus):
            why = _unshareable(gpu)
            if why is None:
                names.add(gpu.device.name)
            elif not self.every:
                problems.append(f"GPU index {gpu.index} ({gpu.uuid}) {why}")
        return frozenset(names), (*problems, *self.absent(inventory))

    def selects(self, gpu: Gpu) -> bool:
        """`all`, or the GPU is named by index or UUID."""
        return self.every or gpu.index in self.indices or gpu.uuid.lower() in self.uuids

    def absent(self, inventory: Inventory) -> list[str]:
        """The named GPUs this node does not have, or has lost, one problem each."""
        indices = {g.index for g in inventory.gpus}
        lost = {entry.index for entry in inventory.lost} - indices
        problems = [
            f"GPU index {index} is lost (NVML answers GPU_IS_LOST), so it is not published"
            if index in lost
            else f"GPU index {index} does not exist on this node "
            f"(it has {len(indices | lost)} GPUs{_index_range(indices | lost)})"
            for index in sorted(self.indices - indices)
        ]
        known = {g.uuid.lower() for g in inventory.gpus}
        # A lost GPU's UUID is unreadable: a UUID not found may be that GPU's.
        where = f"among the GPUs that answer (lost, and maybe it: index {_indices(lost)})"
        problems += [
            f"no GPU with UUID {uuid} {where if lost else 'on this node'}"
            for uuid in sorted(self.uuids - known)
        ]
        return problems


def _unshareable(gpu: Gpu) -> str | None:
    if gpu.mig_enabled:
        return (
            "has MIG mode enabled, so it is never offered whole and cannot be shared by "
            "memory; disable MIG mode on it or leave it out of --shared-gpus"
        )
    memory = gpu.device.capacity.get("memory")
    if memory is None:
        return "has no memory size from NVML, so there is no memory to share"
    if memory < MEMORY_SLICE_MIN:
        return f"has {memory} bytes of memory, less than one {MEMORY_SLICE_MIN}-byte slice"
    return None


def _indices(indices: set[int]) -> str:
    return ", ".join(str(i) for i in sorted(indices))


def _index_range(indices: set[int]) -> str:
    if not indices:
        return ""
    if len(indices) == 1:
        return f": index {min(indices)}"
    return f": indices {min(indices)}-{max(indices)}"


# --- naming and value helpers ------------------------------------------------------------


def gpu_device_name(minor: int) -> str:
    return f"gpu-{minor}"


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


_SLICE_PREFIX = "memory-slice-"


def memory_slice_counter(index: int) -> str:
    return f"{_SLICE_PREFIX}{index}"


def _rfc1123(name: str) -> str:
    name = re.sub(r"[^a-z0-9-.]", "-", name.lower()).strip("-")
    return name.removesuffix(".")


def mig_device_name(parent_minor: int, profile: str, profile_id: int, start: int) -> str:
    """Upstream's `gpu-<minor>-mig-<profile without dots>-<giProfileID>-<placementStart>`."""
    compact = _rfc1123(profile.replace(".", ""))
    return f"gpu-{parent_minor}-mig-{compact}-{profile_id}-{start}"


def _counter_name(capacity: str) -> str:
    """camelCase capacity -> DNS-label counter name (`copyEngines` -> `copy-engines`)."""
    known = _COUNTER_NAMES.get(capacity)
    if known is not None:
        return known
    hyphenated = re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", capacity)
    hyphenated = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1-\2", hyphenated)
    return _rfc1123(hyphenated)


def mig_profile_name(
    profile_index: int,
    gpu_slices: int,
    compute_slices: int,
    memory_mib: int,
    total_memory_bytes: int,
) -> str:
    """nvidia-smi/go-nvlib MIG profile name, e.g. `1g.10gb`, `1g.10gb+me`, `1c.3g.40gb`.

    The memory figure is go-nvlib's: the profile's share of the GPU rounded up to
    eighths, times the GPU's memory in whole GiB.
    """
    fraction = math.ceil((memory_mib * _MIB) / total_memory_bytes * 8) / 8
    total_gib = (total_memory_bytes + _GIB - 1) // _GIB
    gb = math.floor(fraction * total_gib + 0.5)  # Go's math.Round: halves away from zero
    suffix = _PROFILE_SUFFIXES.get(profile_index, "")
    if compute_slices == gpu_slices:
        return f"{gpu_slices}g.{gb}gb{suffix}"
    return f"{compute_slices}c.{gpu_slices}g.{gb}gb{suffix}"


def semver_from_driver_version(raw: str) -> str:
    """NVIDIA driver version -> semver: `580.95.05` -> `580.95.5`, `470.82` -> `470.82.0`."""
    parts = raw.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        msg = f"driver version {raw!r} is not of the form MAJOR.MINOR[.PATCH]"
        raise DiscoveryError(msg, call="nvmlSystemGetDriverVersion")
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in numbers)


def semver_from_cuda_version(raw: int) -> str:
    """NVML's CUDA driver version integer -> semver: 12080 -> `12.8.0` (as upstream)."""
    return f"{raw // 1000}.{(raw % 1000) // 10}.0"


def _lower_bus_id(bus_id: str) -> str:
    """NVML's `00000000:18:00.0` -> the standard attribute's `0000:18:00.0` (go-nvlib rule)."""
    lowered = bus_id.lower()
    return lowered.removeprefix("0000") if lowered != "0000" else lowered


# --- the scan ------------------------------------------------------------------------------


class _Scanner:
    """Calls NVML and turns every failure into a `DiscoveryError` naming GPU and call."""

    def __init__(self, nvml: NvmlLibrary) -> None:
        self.nvml = nvml
        self.gaps: dict[int, list[FieldGap]] = {}

    def privileged(
        self, index: int, field_name: str, effect: str, name: str, *args: Any, ok: frozenset[int]
    ) -> tuple[Any, bool]:
        """Like `optional`; NO_PERMISSION gives (None, False) and records the gap."""
        try:
            return self.optional(index, name, *args, ok=ok), True
        except DiscoveryError as err:
            if getattr(err.nvml_error, "value", None) != pynvml.NVML_ERROR_NO_PERMISSION:
                raise
        gap = FieldGap(field_name, name, MIG_MONITOR_PRIVILEGE, effect)
        gaps = self.gaps.setdefault(index, [])
        if gap not in gaps:
            gaps.append(gap)
            logger.warning(
                "NVML refused a field for lack of privilege; publishing the GPU without it",
                extra={
                    "fields": {
                        "gpuIndex": index,
                        "field": field_name,
                        "call": name,
                        "needs": MIG_MONITOR_PRIVILEGE,
                        "effect": effect,
                    }
                },
            )
        return None, False

    def call(self, index: int | None, name: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, name)(*args)
        except pynvml.NVMLError as err:
            where = "the system" if index is None else f"GPU index {index}"
            msg = f"NVML call {name} failed for {where}: {describe_nvml_error(err)}"
            raise DiscoveryError(msg, gpu_index=index, call=name, nvml_error=err) from err

    def optional(self, index: int | None, name: str, *args: Any, ok: frozenset[int]) -> Any:
        """Like `call`, but NVML errors with a code in `ok` give None."""
        try:
            entry = getattr(self.nvml, name)
        except AttributeError:
            return None  # an older binding without this entry point
        return self.read(index, name, lambda: entry(*args), ok=ok)

    def read(
        self, index: int | None, name: str, fn: Callable[[], T], *, ok: frozenset[int]
    ) -> T | None:
        """`fn()`, which calls NVML entry point `name`: NVML errors with a code in `ok`
        give None, the others a `DiscoveryError` naming GPU and call."""
        try:
            return fn()
        except pynvml.NVMLError as err:
            if getattr(err, "value", None) in ok:
                return None
            where = "the system" if index is None else f"GPU index {index}"
            msg = f"NVML call {name} failed for {where}: {describe_nvml_error(err)}"
            raise DiscoveryError(msg, gpu_index=index, call=name, nvml_error=err) from err


_UNSUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
_NOTHING: frozenset[int] = frozenset()
_ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT})


@dataclass(frozen=True, slots=True)
class _GiProfile:
    index: int
    id: int
    name: str
    slices: int
    memory_mib: int
    capacity: Mapping[str, int]
    placements: tuple[tuple[int, int], ...]
    instance_count: int = 0  # the most instances of it the GPU holds at once


@dataclass(frozen=True, slots=True)
class _MigContext:
    """The parent GPU facts every MIG device of it repeats."""

    index: int
    minor: int
    uuid: str
    handle: Any
    parent_attrs: Mapping[str, AttributeValue]
    list_attrs: Mapping[str, AttributeValue]

    def mig_attrs(self) -> dict[str, AttributeValue]:
        return {"type": DeviceType.MIG.value, "parentUUID": self.uuid}

    def legacy_attrs(self) -> dict[str, AttributeValue]:
        """The `LEGACY_ATTRIBUTES` every MIG device of this GPU has: upstream gave a MIG
        device its parent's index and PCI bus ID."""
        return {"parentIndex": self.index, "pcieBusID": self.parent_attrs[PCI_BUS_ID_ATTRIBUTE]}


def discover(nvml: NvmlLibrary, *, topology: PciTopology | None = None) -> Inventory:
    """Read every GPU from NVML and return the inventory, or raise `DiscoveryError`.

    NVML is initialised for the scan and shut down afterwards (NVML reference-counts, so
    a caller that initialised NVML itself stays initialised).
    """
    topo = topology if topology is not None else pci_topology(nvml)
    scan = _Scanner(nvml)
    _init(scan)
    try:
        raw_driver = scan.call(None, "nvmlSystemGetDriverVersion")
        _check_branch(scan, str(raw_driver))
        cuda = int(scan.call(None, "nvmlSystemGetCudaDriverVersion"))
        common: dict[str, AttributeValue] = {
            "driverVersion": Version(semver_from_driver_version(raw_driver)),
            "cudaDriverVersion": Version(semver_from_cuda_version(cuda)),
        }
        count = int(scan.call(None, "nvmlDeviceGetCount"))
        gpus: list[Gpu] = []
        lost: list[LostGpu] = []
        for index in range(count):
            try:
                gpus.append(_discover_gpu(scan, topo, index, common))
            except DiscoveryError as err:
                if not _is_lost(err, index):
                    raise
                lost.append(_left_out(err, index))
    finally:
        try:
            nvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            logger.warning(
                "nvmlShutdown failed after discovery", extra={"fields": {"error": str(err)}}
            )
    names: dict[str, int] = {}
    for gpu in gpus:
        for name in gpu.device_names():
            if name in names:
                msg = f"device name {name} is used by GPU index {names[name]} and {gpu.index}"
                raise DiscoveryError(msg, gpu_index=gpu.index)
            names[name] = gpu.index
    inventory = Inventory(
        driver_version=raw_driver, cuda_driver_version=cuda, gpus=tuple(gpus), lost=tuple(lost)
    )
    logger.info(
        "discovered GPUs",
        extra={
            "fields": {
                "gpus": len(gpus),
                "migDevices": sum(len(g.mig_devices) for g in gpus),
                "partitions": sum(len(g.partitions) for g in gpus),
                "lostGpus": [entry.index for entry in lost],
            }
        },
    )
    return inventory


def _is_lost(err: DiscoveryError, index: int) -> bool:
    """Whether GPU `index` itself answered GPU_IS_LOST (every call on its handles names
    it; a call for the whole system does not, and stays fatal)."""
    code = getattr(err.nvml_error, "value", None)
    return err.gpu_index == index and code == pynvml.NVML_ERROR_GPU_IS_LOST


def _left_out(err: DiscoveryError, index: int) -> LostGpu:
    entry = LostGpu(index, err.call or "")
    logger.warning(
        "GPU is lost (fell off the bus); publishing the node's other GPUs without it",
        extra={
            "fields": {
                "gpuIndex": index,
                "call": entry.call,
                "error": describe_nvml_error(err.nvml_error or err),
                "effect": "its devices are not published until it answers again (a GPU "
                "reset or a reboot) and the next rescan finds it",
            }
        },
    )
    return entry


def _init(scan: _Scanner) -> None:
    """nvmlInit, with a missing library or kernel driver named as such."""
    try:
        scan.call(None, "nvmlInit")
    except DiscoveryError as err:
        code = getattr(err.nvml_error, "value", None)
        problem = nvml_start_problem(code)
        if problem is None:
            raise
        if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            fix = DRIVER_NOT_LOADED_FIX
        else:
            fix = "install it on the node, or name where it is: --driver-root (the driver's "
            fix += "folder on the host, e.g. /run/nvidia/driver) and --host-root (where this "
            fix += "process sees the host's /); the chart sets both from node.driverRoot"
        msg = (
            f"{problem} ({describe_nvml_error(err.nvml_error or err)}); gpudra needs the "
            f"NVIDIA driver of branch R{OLDEST_SUPPORTED_BRANCH} or newer: {fix}"
        )
        raise DiscoveryError(msg, call="nvmlInit", nvml_error=err.nvml_error) from err


def _check_branch(scan: _Scanner, raw_driver: str) -> None:
    """Refuse a driver older than every supported path (nothing is published)."""
    try:
        branch = driver_branch(raw_driver)
    except BranchError as err:
        raise DiscoveryError(str(err), call="nvmlSystemGetDriverVersion") from None
    if branch >= OLDEST_SUPPORTED_BRANCH:
        return
    library = scan.optional(None, "nvmlSystemGetNVMLVersion", ok=_UNSUPPORTED)
    found = f"NVML library version {library}" if library is not None else "an NVML library"
    msg = (
        f"found {found} of NVIDIA driver {raw_driver} (branch R{branch}); gpudra supports "
        f"driver branch R{OLDEST_SUPPORTED_BRANCH} and newer: upgrade the NVIDIA driver on "
        "this node (nothing is published until then)"
    )
    raise DiscoveryError(msg, call="nvmlSystemGetDriverVersion")


def _numa_node(
    scan: _Scanner, topo: PciTopology, index: int, handle: Any, bus_id: str
) -> int | None:
    """The NUMA node `resource.kubernetes.io/numaNode` means: that of the GPU's PCI
    device, as sysfs gives it (`numa_node`, what KEP-6072 and the Kubernetes helpers
    read), the node of the CPUs and NICs near the GPU.

    NVML's nvmlDeviceGetNumaNodeId "only applies to platforms where the GPUs are NUMA
    nodes" (nvml.h): on Grace (GH200, GB200) it names the GPU's own HBM node, never the
    CPU's, so it is asked only where sysfs has no node (R535 has no such call at all).
    """
    node = topo.numa_node(bus_id)
    if node is not None:
        return node
    numa = scan.optional(index, "nvmlDeviceGetNumaNodeId", handle, ok=_UNSUPPORTED)
    return int(numa) if numa is not None else None


def _discover_gpu(
    scan: _Scanner, topo: PciTopology, index: int, common: Mapping[str, AttributeValue]
) -> Gpu:
    handle = scan.call(index, "nvmlDeviceGetHandleByIndex", index)
    minor = int(scan.call(index, "nvmlDeviceGetMinorNumber", handle))
    uuid = str(scan.call(index, "nvmlDeviceGetUUID", handle))
    product = str(scan.call(index, "nvmlDeviceGetName", handle))
    brand_code = int(scan.call(index, "nvmlDeviceGetBrand", handle))
    arch_code = int(scan.call(index, "nvmlDeviceGetArchitecture", handle))
    major, minor_cc = scan.call(index, "nvmlDeviceGetCudaComputeCapability", handle)
    memory, _ = scan.privileged(
        index,
        "memory",
        "memory size taken from the largest MIG profile",
        "nvmlDeviceGetMemoryInfo",
        handle,
        ok=_UNSUPPORTED,
    )
    pci = scan.call(index, "nvmlDeviceGetPciInfo_v3", handle)
    nvml_bus_id = str(pci.busId)
    bus_id = _lower_bus_id(nvml_bus_id)
    numa_node = _numa_node(scan, topo, index, handle, bus_id)
    pcie_root = topo.pcie_root(bus_id)
    mig_mode = scan.optional(index, "nvmlDeviceGetMigMode", handle, ok=_UNSUPPORTED)
    mig_capable = mig_mode is not None
    row_remap_failed = _health_flag(
        scan,
        index,
        "nvmlDeviceGetRemappedRows",
        lambda: bool(scan.nvml.nvmlDeviceGetRemappedRows(handle)[3]),
    )
    unrepairable_memory = _health_flag(
        scan,
        index,
        UNREPAIRABLE_MEMORY_ENTRY,
        lambda: read_unrepairable_memory(scan.nvml, handle),
    )
    mig_enabled = mig_capable and int(mig_mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE
    addressing_mode = _addressing_mode(scan, index, handle)

    # Attributes every device of this GPU carries (MIG devices inherit them).
    parent_attrs: dict[str, AttributeValue] = {
        "productName": product,
        "brand": _BRANDS.get(brand_code, "Unknown"),
        "architecture": _ARCHITECTURES.get(arch_code, "Unknown"),
        "cudaComputeCapability": Version(f"{int(major)}.{int(minor_cc)}.0"),
        **common,
        PCI_BUS_ID_ATTRIBUTE: bus_id,
    }
    if pcie_root is not None:
        parent_attrs[PCIE_ROOT_ATTRIBUTE] = pcie_root
    list_attrs: dict[str, AttributeValue] = {}
    if numa_node is not None and numa_node >= 0:
        parent_attrs[NUMA_NODE_ATTRIBUTE] = numa_node
        list_attrs[NUMA_NODE_ATTRIBUTE] = (numa_node, *topo.nearest_numa_nodes(numa_node))
    if addressing_mode is not None:
        parent_attrs["addressingMode"] = addressing_mode

    total_memory = int(memory.total) if memory is not None else None
    whole = Device(
        name=gpu_device_name(minor),
        type=DeviceType.GPU,
        gpu_index=index,
        parent_uuid=uuid,
        uuid=uuid,
        attributes={"type": DeviceType.GPU.value, "uuid": uuid, **parent_attrs},
        capacity={"memory": total_memory} if total_memory is not None else {},
        legacy_attributes={"index": index, "minor": minor, "pcieBusID": bus_id},
        list_attributes=list_attrs,
    )
    gpu = Gpu(
        index=index,
        minor=minor,
        uuid=uuid,
        pci_bus_id=bus_id,
        product_name=product,
        mig_capable=mig_capable,
        mig_enabled=mig_enabled,
        device=whole,
        row_remap_failed=row_remap_failed,
        unrepairable_memory=unrepairable_memory,
    )
    if not mig_enabled:
        return gpu
    if total_memory is None:
        # A MIG-enabled GPU without its aggregate memory (no privilege): the largest
        # profile spans the GPU and gives the names the same sizes.
        total_memory = _largest_profile_memory(scan, index, handle)
    if total_memory is None:
        msg = f"GPU index {index} has MIG enabled but NVML reports no memory size"
        raise DiscoveryError(msg, gpu_index=index, call="nvmlDeviceGetMemoryInfo")

    profiles = _gi_profiles(scan, index, handle, total_memory)
    ctx = _MigContext(index, minor, uuid, handle, parent_attrs, list_attrs)
    partitions, counter_set = _partitions(ctx, profiles)
    mig_devices = _existing_migs(scan, ctx, profiles)
    gpu_instances: tuple[MigInstance, ...] | None = ()
    if partitions:  # only the dynamic view needs them
        gpu_instances = _gpu_instances(scan, ctx, profiles)
    if gpu_instances is None:  # what is taken is unknown: offer no placement
        partitions, counter_set, gpu_instances = (), None, ()
    return Gpu(
        index=index,
        minor=minor,
        uuid=uuid,
        pci_bus_id=bus_id,
        product_name=product,
        mig_capable=True,
        mig_enabled=True,
        device=whole,
        mig_devices=mig_devices,
        partitions=partitions,
        counter_set=counter_set,
        mig_profiles={p.id: p.name for p in profiles.values()},
        gaps=tuple(scan.gaps.get(index, ())),
        gpu_instances=gpu_instances,
        mig_slices={p.id: p.slices for p in profiles.values()},
        row_remap_failed=row_remap_failed,
        unrepairable_memory=unrepairable_memory,
    )


def _health_flag(scan: _Scanner, index: int, call: str, read: Callable[[], bool]) -> bool | None:
    """A GPU condition NVML reports (a failed row remapping, unrepairable memory); None
    where NVML gives no reading. A health flag, not a description of the GPU: an error
    reading it (a privilege a VM's driver withholds, say) leaves it unread
    (`_spare_reading`)."""
    return _spare_reading(
        scan, index, call, read, "NVML refused a health reading; the GPU is published without it"
    )


def _spare_reading(
    scan: _Scanner, index: int, call: str, read: Callable[[], T], refused: str
) -> T | None:
    """`read()`, which calls NVML entry point `call` for a reading the GPU can be
    published without; None where NVML gives none. An error is logged (`refused`) and
    leaves it unread, as an unsupported call does, rather than failing the scan and
    with it every GPU of the node. A lost GPU's error goes on, for the scan to leave
    that GPU out."""
    try:
        return scan.read(index, call, read, ok=_UNSUPPORTED)
    except DiscoveryError as err:
        if _is_lost(err, index):
            raise
        logger.warning(
            refused, extra={"fields": {"gpuIndex": index, "call": call, "error": str(err)}}
        )
        return None


def _addressing_mode(scan: _Scanner, index: int, handle: Any) -> str | None:
    """The upstream driver's `addressingMode`: how the GPU reaches memory the CPU
    allocated (`malloc`, `mmap`), spelt as go-nvlib spells it. "HMM": the driver mirrors
    the CPU's page tables (Linux HMM, open kernel modules); "ATS": the GPU uses the
    CPU's page tables through Address Translation Services (Grace: GH200, GB200);
    "None": the platform has the call but neither is active. None: no attribute,
    where NVML has no answer (NOT_SUPPORTED, a branch before R580).

    Upstream fails the whole node's enumeration on an error or a value it does not
    know; here the GPU is published without the attribute, as on a driver before R580,
    rather than the node publishing nothing."""
    entry = getattr(scan.nvml, "nvmlDeviceGetAddressingMode", None)
    if entry is None:  # an older binding without this entry point
        return None
    refused = "NVML refused the GPU's addressing mode; the GPU is published without it"
    mode = _spare_reading(
        scan, index, "nvmlDeviceGetAddressingMode", lambda: entry(handle), refused
    )
    if mode is None:
        return None
    name = _ADDRESSING_MODES.get(int(mode))
    if name is None:
        logger.warning(
            "NVML gave an addressing mode gpudra does not know; the GPU is published without it",
            extra={"fields": {"gpuIndex": index, "addressingMode": int(mode)}},
        )
    return name


def _largest_profile_memory(scan: _Scanner, index: int, handle: Any) -> int | None:
    sizes = [
        int(info.memorySizeMB) * _MIB
        for profile_index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
        if (
            info := scan.optional(
                index, "nvmlDeviceGetGpuInstanceProfileInfo", handle, profile_index, ok=_ABSENT
            )
        )
        is not None
    ]
    return max(sizes, default=None)


def _gi_profiles(
    scan: _Scanner, index: int, handle: Any, total_memory: int
) -> dict[int, _GiProfile]:
    """Every GPU-instance profile the GPU offers, with its placements, by profile ID."""
    profiles: dict[int, _GiProfile] = {}
    for profile_index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = scan.optional(
            index, "nvmlDeviceGetGpuInstanceProfileInfo", handle, profile_index, ok=_ABSENT
        )
        if info is None:
            continue
        profile_id = int(info.id)
        count = ctypes.c_uint(0)
        got, _ = scan.privileged(
            index,
            "placements",
            "no MIG partitions of this GPU for dynamic MIG",
            "nvmlDeviceGetGpuInstancePossiblePlacements",
            handle,
            profile_id,
            None,
            ctypes.byref(count),
            ok=_ABSENT,
        )
        placements: tuple[tuple[int, int], ...] = ()
        if got is not None and count.value:
            array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
            scan.call(
                index,
                "nvmlDeviceGetGpuInstancePossiblePlacements",
                handle,
                profile_id,
                array,
                ctypes.byref(count),
            )
            placements = tuple((int(p.start), int(p.size)) for p in array[: count.value])
        slices = int(info.sliceCount)
        memory_mib = int(info.memorySizeMB)
        capacity = {key: int(getattr(info, attr)) for key, attr in _MIG_CAPACITIES}
        capacity["memory"] = memory_mib * _MIB
        profiles[profile_id] = _GiProfile(
            index=profile_index,
            id=profile_id,
            name=mig_profile_name(profile_index, slices, slices, memory_mib, total_memory),
            slices=slices,
            memory_mib=memory_mib,
            capacity=capacity,
            placements=placements,
            instance_count=int(info.instanceCount),
        )
    return profiles


def _partitions(
    ctx: _MigContext, profiles: Mapping[int, _GiProfile]
) -> tuple[tuple[Device, ...], CounterSet | None]:
    """Every placement of every profile, consuming from the GPU's counter set; each
    profile's placements by descending start.

    The order is the placement policy: the scheduler hands a claim the first device in
    slice order whose counters still fit, and never moves it (`plan_slices` splits this
    list into slices without reordering it, and their names sort in plan order). The
    profiles a GPU has the fewest places for start low (A100, H100, H200: 7g and 4g at
    memory slice 0 only, 3g at 0 or 4), the small ones fit almost anywhere (2g at 0, 2
    or 4; 1g at 0 to 6). Listed from the top, a small instance takes the slices the
    fewest larger placements need (2g@4 blocks a 3g@4, 2g@0 or 2g@2 the 4g and a 3g@0),
    and the low half stays free for a 4g: on one H200, 1g.18gb then 4g.71gb get 1g@6
    and 4g@0, where ascending order put the 1g at 0 and no 4g fitted.

    No fixed order fits every sequence of claims: 2g, 3g, 2g fits only with the first
    2g low (2g@0, 3g@4, 2g@2); from the top it goes to 4, the 3g to 0, and no 2g place
    is left. That is the price of 2g then 4g fitting; a 4g, with its one placement, is
    the harder to find room for.
    """
    set_name = counter_set_name(ctx.minor)
    devices: list[Device] = []
    totals: dict[str, int] = {}
    slice_count = 0
    ordered = sorted(profiles.values(), key=lambda p: (p.memory_mib, p.slices, p.index))
    for profile in ordered:
        counters = {_counter_name(k): v for k, v in profile.capacity.items()}
        for key, value in counters.items():
            totals[key] = max(totals.get(key, 0), value)
        for start, size in sorted(profile.placements, reverse=True):
            slice_count = max(slice_count, start + size)
            consumed = dict(counters)
            consumed.update({memory_slice_counter(s): 1 for s in range(start, start + size)})
            device = Device(
                name=mig_device_name(ctx.minor, profile.name, profile.id, start),
                type=DeviceType.MIG,
                gpu_index=ctx.index,
                parent_uuid=ctx.uuid,
                uuid=None,
                attributes={**ctx.mig_attrs(), "profile": profile.name, **ctx.parent_attrs},
                capacity=dict(profile.capacity),
                consumes_counters=(CounterConsumption(set_name, consumed),),
                placement=MigPlacement(profile.name, profile.id, start, size),
                # A placement has no MIG index until it is created.
                legacy_attributes=ctx.legacy_attrs(),
                list_attributes=ctx.list_attrs,
            )
            devices.append(device)
    if not devices:
        return (), None
    totals.update({memory_slice_counter(s): 1 for s in range(slice_count)})
    counter_set = CounterSet(set_name, totals)
    return tuple(devices), counter_set


def _gpu_instances(
    scan: _Scanner, ctx: _MigContext, profiles: Mapping[int, _GiProfile]
) -> tuple[MigInstance, ...] | None:
    """Every GPU instance on the GPU now, with or without compute instances (a MIG
    device needs one; an instance without takes its memory slices all the same); None
    where NVML refuses to list them."""
    index, handle = ctx.index, ctx.handle
    instances: list[MigInstance] = []
    for profile in profiles.values():
        found = (pynvml.c_nvmlGpuInstance_t * max(profile.instance_count, 1))()
        count = ctypes.c_uint(0)
        _, allowed = scan.privileged(
            index,
            "placements",
            "no MIG partitions of this GPU for dynamic MIG",
            "nvmlDeviceGetGpuInstances",
            handle,
            profile.id,
            found,
            ctypes.byref(count),
            ok=_ABSENT,
        )
        if not allowed:
            return None
        for gi in found[: count.value]:
            info = scan.call(index, "nvmlGpuInstanceGetInfo", gi)
            start, size = int(info.placement.start), int(info.placement.size)
            placement = MigPlacement(profile.name, profile.id, start, size)
            instances.append(MigInstance(int(info.id), placement))
    return tuple(sorted(instances, key=lambda i: (i.placement.start, i.gpu_instance_id)))


def _existing_migs(
    scan: _Scanner, ctx: _MigContext, profiles: Mapping[int, _GiProfile]
) -> tuple[Device, ...]:
    """The MIG devices that exist now, named after their profile and placement."""
    index, handle = ctx.index, ctx.handle
    devices: list[Device] = []
    max_count = int(scan.call(index, "nvmlDeviceGetMaxMigDeviceCount", handle))
    for j in range(max_count):
        mig = scan.optional(
            index, "nvmlDeviceGetMigDeviceHandleByIndex", handle, j, ok=NO_MIG_AT_INDEX
        )
        if mig is None:
            continue
        gi_id = int(scan.call(index, "nvmlDeviceGetGpuInstanceId", mig))
        ci_id = int(scan.call(index, "nvmlDeviceGetComputeInstanceId", mig))
        gi, allowed = scan.privileged(
            index,
            "migDevices",
            "existing MIG devices of this GPU not published (static MIG)",
            "nvmlDeviceGetGpuInstanceById",
            handle,
            gi_id,
            ok=_NOTHING,
        )
        if not allowed:
            continue
        gi_info = scan.call(index, "nvmlGpuInstanceGetInfo", gi)
        mig_uuid = str(scan.call(index, "nvmlDeviceGetUUID", mig))
        attrs = scan.call(index, "nvmlDeviceGetAttributes", mig)
        profile = profiles.get(int(gi_info.profileId))
        if profile is None:
            msg = (
                f"MIG device {mig_uuid} on GPU index {index} uses GPU instance profile "
                f"{int(gi_info.profileId)}, which the GPU does not list"
            )
            raise DiscoveryError(msg, gpu_index=index, call="nvmlGpuInstanceGetInfo")
        if int(attrs.computeInstanceSliceCount) != int(attrs.gpuInstanceSliceCount):
            # Several compute instances share one GPU instance: the upstream naming
            # (profile + placement) cannot tell them apart, so they are not offered.
            logger.warning(
                "skipping MIG device that does not span its GPU instance",
                extra={"fields": {"uuid": mig_uuid, "gpuIndex": index, "giId": gi_id}},
            )
            continue
        start = int(gi_info.placement.start)
        size = int(gi_info.placement.size)
        device = Device(
            name=mig_device_name(ctx.minor, profile.name, profile.id, start),
            type=DeviceType.MIG,
            gpu_index=index,
            parent_uuid=ctx.uuid,
            uuid=mig_uuid,
            attributes={
                **ctx.mig_attrs(),
                "uuid": mig_uuid,
                "profile": profile.name,
                **ctx.parent_attrs,
            },
            capacity=dict(profile.capacity),
            placement=MigPlacement(profile.name, profile.id, start, size),
            gpu_instance_id=gi_id,
            compute_instance_id=ci_id,
            legacy_attributes={"index": j, **ctx.legacy_attrs()},
            list_attributes=ctx.list_attrs,
        )
        devices.append(device)
    return tuple(sorted(devices, key=lambda d: d.name))
