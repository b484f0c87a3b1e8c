"""An emulated NVML with the names, signatures, return types and errors of `pynvml`.

Discovery, health and MIG management take an object that has pynvml's function names.
In production that object is the `pynvml` module itself; in tests, demos and benchmarks
it is an `NvmlEmulator` built from a product profile (JSON), so the very same driver
code runs without GPUs. Only NVML is emulated: the emulator returns pynvml's own ctypes
structures and handle types and raises pynvml's own `NVMLError` subclasses, so code that
works here works against libnvidia-ml. The library itself, which pynvml holds as
`nvmlLib`, is emulated too (`EmulatedLibrary`), for the one entry point gpudra calls past
pynvml's wrapper (`gpudra.driver.nvml.unrepairable` says why).

Behaviour that the driver relies on follows the NVML documentation: MIG calls need MIG
mode (NOT_SUPPORTED otherwise), GPU instances are placed on memory slices and may not
overlap (INSUFFICIENT_RESOURCES), a GPU instance with compute instances cannot be
destroyed (IN_USE), calls on a lost GPU raise GPU_IS_LOST, and so do the handle
lookups by UUID and PCI bus ID while any GPU is lost (they walk every GPU). Without
privilege (`set_privileged(False)`) the calls NVML reserves for root answer
NO_PERMISSION.

The emulator answers as the driver branch its profile names (`branches`): functions
the branch lacks raise FUNCTION_NOT_FOUND, profile indices it does not know are
INVALID_ARGUMENT, and profile variants it does not offer are hidden. Where the
documentation leaves a detail open (GPU instance IDs, MIG device UUIDs) the emulator
picks a stable, deterministic rule.

All calls take one re-entrant lock: the health watcher blocks in `nvmlEventSetWait_v2` in
a worker thread while discovery or MIG changes run in another.
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Concatenate, Final, Literal, ParamSpec, TypeVar

import pynvml
from gpudra.common.files import atomic_write
from gpudra.driver.nvml.branches import (
    PLACEMENTS_WITHOUT_MIG_SINCE,
    RECOVERY_ACTION_SINCE,
    UNREPAIRABLE_MEMORY_ENTRY,
    BranchError,
    driver_branch,
    has_function,
    has_gpu_instance_profile,
)
from gpudra.driver.nvml.codes import (
    FULL_GPU_INSTANCE_ID,
    RECOVERY_ACTION_XID,
    constant_names,
    describe_nvml_error,
)
from gpudra.driver.nvml.series import ScriptError, Telemetry, TelemetrySpec
from gpudra.driver.nvml.topology import PciTopology
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

PROFILE_FORMAT = "gpudra.nvml-profile/v1"

_MIB = 1024 * 1024
_DEFAULT_EVENT_TYPES = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
    | pynvml.nvmlEventTypePowerSourceChange
)

# Compute-instance profile index (NVML_COMPUTE_INSTANCE_PROFILE_*) for a slice count.
_CI_PROFILE_FOR_SLICES: Mapping[int, int] = MappingProxyType(
    {
        1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
        6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
        7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
        8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
    }
)
_SLICES_FOR_CI_PROFILE: Mapping[int, int] = MappingProxyType(
    {v: k for k, v in _CI_PROFILE_FOR_SLICES.items()}
)


# The telemetry each emulated `nvmlDeviceGetSamples` sampling type reads.
_SAMPLED: Mapping[int, str] = MappingProxyType(
    {
        pynvml.NVML_GPU_UTILIZATION_SAMPLES: "utilization",
        pynvml.NVML_MEMORY_UTILIZATION_SAMPLES: "memoryUtilization",
    }
)


def _nvml_error(code: int) -> Exception:
    """The exact exception class pynvml raises for `code` (an NVMLError subclass)."""
    err: Exception = pynvml.NVMLError(code)
    return err


# --- Profile schema -------------------------------------------------------------------


def _parse_constant(prefix: str) -> Callable[[object], object]:
    """Accept an int, a hex/decimal string, or a pynvml constant name with `prefix`."""

    def parse(value: object) -> object:
        if not isinstance(value, str):
            return value
        if value.startswith(prefix):
            constant = getattr(pynvml, value, None)
            if isinstance(constant, int):
                return constant
            msg = f"{value!r} is not a pynvml constant"
            raise ValueError(msg)
        try:
            return int(value, 0)
        except ValueError:
            msg = f"expected an integer or a pynvml constant name starting with {prefix}"
            raise ValueError(msg) from None

    return parse


def _constant_serializer(prefix: str) -> Callable[[int], int | str]:
    """Write a known value back as its pynvml constant name, so profiles stay readable."""
    names = constant_names(prefix)

    def serialize(value: int) -> int | str:
        return names.get(value, value)

    return serialize


def _parse_int(value: object) -> object:
    if isinstance(value, str):
        try:
            return int(value, 0)
        except ValueError:
            msg = "expected an integer (decimal or 0x hex)"
            raise ValueError(msg) from None
    return value


NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]
HexUint32 = Annotated[
    int,
    Field(ge=0, le=0xFFFFFFFF),
    BeforeValidator(_parse_int),
    PlainSerializer(lambda v: f"0x{v:08X}", when_used="json"),
]
Brand = Annotated[
    int,
    BeforeValidator(_parse_constant("NVML_BRAND_")),
    PlainSerializer(_constant_serializer("NVML_BRAND_"), when_used="json"),
]
Architecture = Annotated[
    int,
    BeforeValidator(_parse_constant("NVML_DEVICE_ARCH_")),
    PlainSerializer(_constant_serializer("NVML_DEVICE_ARCH_"), when_used="json"),
]
GpuInstanceProfileIndex = Annotated[
    int,
    BeforeValidator(_parse_constant("NVML_GPU_INSTANCE_PROFILE_")),
    PlainSerializer(_constant_serializer("NVML_GPU_INSTANCE_PROFILE_"), when_used="json"),
]
NvmlName = Annotated[
    str, Field(min_length=1, max_length=pynvml.NVML_DEVICE_NAME_V2_BUFFER_SIZE - 1)
]
GpuUuid = Annotated[
    str,
    Field(pattern=r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"),
]
MigUuid = Annotated[
    str,
    Field(pattern=r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"),
]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlacementSpec(_Spec):
    """A GPU instance placement: `size` memory slices starting at slice `start`."""

    start: NonNegInt
    size: PosInt


class GpuInstanceProfileSpec(_Spec):
    """One row of `nvidia-smi mig -lgip` plus its `-lgipp` placements.

    `index` is the NVML_GPU_INSTANCE_PROFILE_* value passed to
    nvmlDeviceGetGpuInstanceProfileInfo; `id` is the profile ID it returns, which all
    other MIG calls take.
    """

    index: GpuInstanceProfileIndex
    id: NonNegInt
    name: NvmlName
    sliceCount: PosInt
    instanceCount: PosInt
    multiprocessorCount: NonNegInt
    copyEngineCount: NonNegInt
    decoderCount: NonNegInt
    encoderCount: NonNegInt
    jpegCount: NonNegInt
    ofaCount: NonNegInt
    memorySizeMB: PosInt
    isP2pSupported: NonNegInt = 0
    placements: tuple[PlacementSpec, ...] = ()

    @field_validator("index")
    @classmethod
    def _index_in_range(cls, value: int) -> int:
        if not 0 <= value < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            limit = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
            msg = f"must be below NVML_GPU_INSTANCE_PROFILE_COUNT ({limit})"
            raise ValueError(msg)
        return value

    @field_validator("placements")
    @classmethod
    def _placements_consistent(cls, value: tuple[PlacementSpec, ...]) -> tuple[PlacementSpec, ...]:
        sizes = {p.size for p in value}
        if len(sizes) > 1:
            msg = f"all placements of one profile have the same size, got sizes {sorted(sizes)}"
            raise ValueError(msg)
        starts = [p.start for p in value]
        if len(set(starts)) != len(starts):
            msg = f"placement starts must be unique, got {starts}"
            raise ValueError(msg)
        return value


class MigSupportSpec(_Spec):
    """MIG capability of a product; absent for GPUs without MIG."""

    maxMigDeviceCount: PosInt = 7
    # Hopper and newer switch MIG mode without a GPU reset; Ampere only sets it pending.
    toggleWithoutReset: bool = False
    gpuInstanceProfiles: tuple[GpuInstanceProfileSpec, ...] = Field(min_length=1)

    @field_validator("gpuInstanceProfiles")
    @classmethod
    def _unique_profiles(
        cls, value: tuple[GpuInstanceProfileSpec, ...]
    ) -> tuple[GpuInstanceProfileSpec, ...]:
        for attr in ("index", "id"):
            seen = [getattr(p, attr) for p in value]
            if len(set(seen)) != len(seen):
                msg = f"GPU instance profile {attr} values must be unique, got {seen}"
                raise ValueError(msg)
        return value

    @field_validator("gpuInstanceProfiles")
    @classmethod
    def _placements_form_a_tree(
        cls, value: tuple[GpuInstanceProfileSpec, ...]
    ) -> tuple[GpuInstanceProfileSpec, ...]:
        # GPU-instance IDs are nodes of the binary tree of memory slots (see
        # `gpu_instance_id_for_placement`), so every placement must be one such node.
        slots = placement_slots(value)
        for profile in value:
            for p in profile.placements:
                if p.size & (p.size - 1) or p.start % p.size or p.start + p.size > slots:
                    msg = (
                        f"placement {p.start}:{p.size} of {profile.name!r} is not an aligned "
                        f"power-of-two block of the GPU's {slots} memory slots; real MIG "
                        "placements always are, so copy them from `nvidia-smi mig -lgipp`"
                    )
                    raise ValueError(msg)
        return value


class ProductSpec(_Spec):
    """What every GPU of one product model answers, independent of its slot."""

    name: NvmlName
    brand: Brand
    architecture: Architecture
    cudaComputeCapability: tuple[NonNegInt, NonNegInt]
    memoryTotal: PosInt  # bytes
    memoryReserved: NonNegInt = 0  # bytes, reported by the v2 memory info only
    memoryUsed: NonNegInt = 0  # bytes
    multiprocessorCount: NonNegInt
    copyEngineCount: NonNegInt = 0
    decoderCount: NonNegInt = 0
    encoderCount: NonNegInt = 0
    jpegCount: NonNegInt = 0
    ofaCount: NonNegInt = 0
    pciDeviceId: HexUint32
    pciSubSystemId: HexUint32
    supportedEventTypes: Annotated[int, Field(ge=0), BeforeValidator(_parse_int)] = (
        _DEFAULT_EVENT_TYPES
    )
    mig: MigSupportSpec | None = None

    @model_validator(mode="after")
    def _memory_fits(self) -> ProductSpec:
        if self.memoryUsed + self.memoryReserved > self.memoryTotal:
            msg = "memoryUsed + memoryReserved must not exceed memoryTotal"
            raise ValueError(msg)
        return self


class MigInstanceSpec(_Spec):
    """A MIG device present at start-up: a GPU instance plus one compute instance.

    IDs and UUID are optional; recordings carry them so a replay matches the original.
    """

    profileId: NonNegInt
    placementStart: NonNegInt
    computeInstanceProfileId: NonNegInt | None = None  # default: spans the GPU instance
    gpuInstanceId: NonNegInt | None = None
    computeInstanceId: NonNegInt | None = None
    uuid: MigUuid | None = None


class GpuSpec(_Spec):
    """One GPU of the node, in NVML index order."""

    product: str
    uuid: GpuUuid
    minor: NonNegInt
    busId: Annotated[str, Field(pattern=r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")]
    pcieRoot: Annotated[str, Field(pattern=r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")] | None = None
    numaNode: Annotated[int, Field(ge=-1)] | None = None  # None: NVML says NOT_SUPPORTED
    # The NUMA node sysfs gives the GPU's PCI device, where it is not numaNode (Grace:
    # NVML names the GPU's own HBM node, sysfs the CPU's); None: numaNode is sysfs's too.
    pciNumaNode: NonNegInt | None = None
    # nvmlDeviceGetAddressingMode's answer (NVML_DEVICE_ADDRESSING_MODE_*: 0 none, 1 HMM,
    # 2 ATS; R580 and later); None: NVML says NOT_SUPPORTED. Recordings carry it; no
    # product profile does, since none was read off a real GPU of its kind.
    addressingMode: NonNegInt | None = None
    migEnabled: bool = False
    migPendingEnabled: bool | None = None  # None: same as migEnabled
    migInstances: tuple[MigInstanceSpec, ...] = ()
    computeMode: Annotated[int, Field(ge=0, lt=pynvml.NVML_COMPUTEMODE_COUNT)] = 0
    telemetry: TelemetrySpec | None = None  # None: defaults; see gpudra.driver.nvml.series

    @property
    def sysfs_numa_node(self) -> int | None:
        """The NUMA node sysfs shows for the GPU's PCI device (None: no node), which
        discovery publishes before NVML's: pciNumaNode where given, else numaNode."""
        node = self.numaNode if self.pciNumaNode is None else self.pciNumaNode
        return node if node is not None and node >= 0 else None


class ProfileSpec(_Spec):
    """A whole node as NVML sees it: system versions, products and GPUs.

    The same format serves hand-written product profiles and recordings of a real
    node made by `gpudra.driver.nvml.record.record`.
    """

    format: Literal["gpudra.nvml-profile/v1"]
    description: str = ""
    driverVersion: Annotated[str, Field(min_length=1, max_length=79)]
    cudaDriverVersion: PosInt
    nvmlVersion: Annotated[str, Field(min_length=1, max_length=79)] | None = None
    products: dict[str, ProductSpec]
    gpus: tuple[GpuSpec, ...]

    @field_validator("driverVersion")
    @classmethod
    def _names_a_branch(cls, value: str) -> str:
        try:
            driver_branch(value)
        except BranchError as err:
            raise ValueError(str(err)) from None
        return value

    @property
    def branch(self) -> int:
        """The driver branch whose NVML the emulator answers as (see `branches`)."""
        return driver_branch(self.driverVersion)

    @model_validator(mode="after")
    def _cross_references(self) -> ProfileSpec:
        for field_name in ("uuid", "minor", "busId"):
            seen: dict[object, int] = {}
            for i, gpu in enumerate(self.gpus):
                value = getattr(gpu, field_name)
                if value in seen:
                    msg = (
                        f"gpus[{i}].{field_name}: {value!r} is already used by gpus[{seen[value]}]"
                    )
                    raise ValueError(msg)
                seen[value] = i
        for i, gpu in enumerate(self.gpus):
            product = self.products.get(gpu.product)
            if product is None:
                known = ", ".join(sorted(self.products)) or "none"
                msg = f"gpus[{i}].product: unknown product {gpu.product!r} (known: {known})"
                raise ValueError(msg)
            if product.mig is None and (
                gpu.migEnabled or gpu.migPendingEnabled or gpu.migInstances
            ):
                msg = f"gpus[{i}].migEnabled: product {gpu.product!r} has no MIG support"
                raise ValueError(msg)
            if gpu.migInstances and not gpu.migEnabled:
                msg = f"gpus[{i}].migInstances: MIG devices need migEnabled: true"
                raise ValueError(msg)
        return self


class ProfileError(ValueError):
    """A profile that cannot be loaded; the message names the file and the field."""


def placement_slots(profiles: tuple[GpuInstanceProfileSpec, ...]) -> int:
    """Memory slots of a MIG GPU: the size of its widest placement (8 on A100 and H100).

    The whole-GPU profile's placement spans them all, one more than the usable memory
    slices on 7-slice GPUs.
    """
    return max((p.size for profile in profiles for p in profile.placements), default=1)


def gpu_instance_id_for_placement(slots: int, start: int, size: int) -> int:
    """The GPU-instance ID the driver gives the placement `start`:`size`.

    Real drivers number a GPU instance by where it sits, not by the lowest free number:
    the IDs are the nodes of the binary tree over the memory slots, breadth first. On
    an 8-slot GPU (A100, H100) the whole GPU is 0, halves (starts 0, 4) 1-2, quarters
    (0, 2, 4, 6) 3-6, single slices (0..6) 7-13; on a 4-slot GPU (A30) the whole GPU
    is 0, halves 1-2 and quarters 3-6. Published `nvidia-smi mig -lgi` output shows
    this numbering; some GPUs map placements onto the tree differently (halves
    swapped, a fused-off slice skipped, so slices 7-14), which is why the driver code
    never derives a placement from an ID or the reverse.
    """
    return slots // size - 1 + start // size


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "<root>"
        lines.append(f"{source}: {loc}: {item['msg']}")
    return "; ".join(lines)


def parse_profile(data: object, *, source: str = "<profile>") -> ProfileSpec:
    """Validate profile data (a decoded JSON object) into a `ProfileSpec`."""
    try:
        return ProfileSpec.model_validate(data)
    except ValidationError as err:
        raise ProfileError(_format_validation_error(source, err)) from None


def load_profile_file(path: Path) -> ProfileSpec:
    """Read and validate a profile or recording file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        msg = f"cannot read NVML profile {path}: {err.strerror or err}"
        raise ProfileError(msg) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        msg = f"{path}: not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        raise ProfileError(msg) from None
    return parse_profile(data, source=str(path))


def builtin_profile_names() -> list[str]:
    """Names accepted by `load_builtin_profile`, sorted."""
    folder = resources.files(__package__ or "gpudra.driver.nvml") / "profiles"
    return sorted(
        entry.name.removesuffix(".json")
        for entry in folder.iterdir()
        if entry.name.endswith(".json")
    )


def load_builtin_profile(name: str) -> ProfileSpec:
    """Load one of the product profiles shipped in the package."""
    known = builtin_profile_names()
    if name not in known:
        msg = f"unknown NVML profile {name!r}; known profiles: {', '.join(known)}"
        raise ProfileError(msg)
    entry = resources.files(__package__ or "gpudra.driver.nvml") / "profiles" / f"{name}.json"
    try:
        data = json.loads(entry.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        msg = f"built-in profile {name}: not valid JSON: {err.msg} at line {err.lineno}"
        raise ProfileError(msg) from None
    return parse_profile(data, source=f"built-in profile {name}")


# --- Emulated machine state ------------------------------------------------------------


@dataclass(eq=False)
class _ComputeInstance:
    gpu_instance: _GpuInstance
    id: int
    profile_id: int
    slice_count: int
    start: int
    uuid: str
    ci_address: int
    mig_address: int
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT


@dataclass(eq=False)
class _GpuInstance:
    gpu: _Gpu
    id: int
    profile: GpuInstanceProfileSpec
    start: int
    address: int
    compute_instances: dict[int, _ComputeInstance] = field(default_factory=dict)

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.profile.placements[0].size)


@dataclass(eq=False)
class _Gpu:
    index: int
    spec: GpuSpec
    product: ProductSpec
    uuid: str
    address: int
    mig_current: int
    mig_pending: int
    compute_mode: int
    lost: bool = False
    gpu_instances: dict[int, _GpuInstance] = field(default_factory=dict)
    mig_serial: int = 0
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    row_remap_failed: bool = False
    unrepairable_memory: bool = False

    def mig_devices(self) -> list[_ComputeInstance]:
        """MIG devices in NVML index order (by GPU instance, then compute instance)."""
        return [
            ci
            for gi in sorted(self.gpu_instances.values(), key=lambda g: g.id)
            for ci in sorted(gi.compute_instances.values(), key=lambda c: c.id)
        ]


@dataclass(eq=False)
class _EventSet:
    address: int
    gpus: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    queue: deque[_PendingEvent] = field(default_factory=deque)


@dataclass(frozen=True)
class _PendingEvent:
    gpu: _Gpu
    event_type: int
    data: int
    gpu_instance_id: int
    compute_instance_id: int
    lost: bool = False


@dataclass(frozen=True)
class EmulatedTopology:
    """PCIe roots and NUMA nodes of the emulated machine (what sysfs shows on a real one)."""

    roots: Mapping[str, str]
    numa_nodes: Mapping[str, int]

    def pcie_root(self, bus_id: str) -> str | None:
        return self.roots.get(_normalise_bus_id(bus_id))

    def numa_node(self, bus_id: str) -> int | None:
        return self.numa_nodes.get(_normalise_bus_id(bus_id))

    def nearest_numa_nodes(self, node: int) -> tuple[int, ...]:
        """A profile describes no distance table: the list form of the NUMA node
        attribute names the GPU's node alone."""
        return ()


def _normalise_bus_id(bus_id: str) -> str:
    """Canonical `DDDDDDDD:BB:DD.F` upper-case form of a 4- or 8-digit-domain bus ID."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, function = rest.split(".")
        return (
            f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{int(function, 16):X}"
        )
    except ValueError:
        return bus_id


_FREED: Final = object()


def _gpm_capable(gpu: _Gpu) -> bool:
    """GPM (nvmlGpm*) works on Hopper and newer GPUs."""
    hopper: int = pynvml.NVML_DEVICE_ARCH_HOPPER
    return gpu.product.architecture >= hopper


P = ParamSpec("P")
R = TypeVar("R")


def _nvml(
    *, counted: bool = True, needs_init: bool = True, mutates: bool = False
) -> Callable[[Callable[Concatenate[Any, P], R]], Callable[Concatenate[Any, P], R]]:
    """Mark an emulated NVML entry point: lock, init check, call counting, injected failure.

    `mutates`: the call changes GPU state that outlives a process (modes, MIG
    instances), saved to the state file if there is one.
    """

    def wrap(fn: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
        @functools.wraps(fn)
        def inner(self: NvmlEmulator, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with self._lock:
                if not has_function(self._profile.branch, fn.__name__):
                    # pynvml looks the symbol up first: an older libnvidia-ml lacks it.
                    raise _nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
                self._enter(counted=counted, needs_init=needs_init)
                result = fn(self, *args, **kwargs)
                if mutates:
                    self._save_state()
                return result

        return inner

    return wrap


def _deref(ref: object) -> object:
    """The object behind `byref(x)`, `pointer(x)` or `x` itself."""
    inner = getattr(ref, "_obj", None)  # ctypes.byref() result
    if inner is not None:
        return inner
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


class EmulatedLibrary:
    """The emulator's libnvidia-ml, as pynvml's `nvmlLib` CDLL exposes the library: each
    entry point takes ctypes arguments, writes its out-parameter and returns an
    nvmlReturn_t code, never raising. Only those gpudra calls past pynvml's wrappers are
    here; a symbol the profile's branch lacks is an AttributeError, as a CDLL's lookup
    of a symbol the library does not export."""

    def __init__(self, emulator: NvmlEmulator) -> None:
        self._emulator = emulator

    def __getattr__(self, name: str) -> Callable[[object, object], int]:
        emulator = self._emulator
        if name == UNREPAIRABLE_MEMORY_ENTRY and has_function(emulator.profile.branch, name):
            return emulator._c_unrepairable_memory_flag
        msg = f"undefined symbol: {name}"
        raise AttributeError(msg)


class NvmlEmulator:
    """NVML for a node described by a `ProfileSpec`; see the module docstring.

    Besides the pynvml entry points (all methods named `nvml*`) it has controls that a
    test or a simulated node uses to make things happen: `inject_xid`, `inject_ecc`,
    `lose_gpu`, `recover_gpu`, `reset_gpu`, `fail_after` and `clear_failure`; and
    `telemetry.script` sets utilization, memory, temperature, power, clock and ECC counts.
    """

    def __init__(
        self,
        profile: ProfileSpec,
        *,
        uuid_salt: str | None = None,
        source: str = "<profile>",
        state_path: Path | None = None,
        script_path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Build the machine; `uuid_salt` gives every simulated node its own UUIDs.

        `script_path` is a telemetry script file (see `gpudra.driver.nvml.series`).
        `clock` (seconds) times the telemetry: a profile's steps and the timestamps of
        utilization samples; a test passes its own to step through time. It is the
        wall clock by default because NVML stamps its samples with the CPU's wall clock,
        and the agent reads them against its own (`gpudra.driver.utilization`).

        With `state_path`, the state a real GPU keeps when the process using it
        dies (MIG mode, MIG instances, compute mode) is saved there after every
        change and restored from it here, so a restarted process finds what a
        crashed one left behind, as it would on a real node.
        """
        self._state_path: Path | None = None
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._profile = profile
        self._salt = uuid_salt
        self._buffers: list[ctypes.Array[ctypes.c_char]] = []
        self._gpus: list[_Gpu] = []
        self._gpu_by_address: dict[int, _Gpu] = {}
        self._gi_by_address: dict[int, _GpuInstance] = {}
        self._ci_by_address: dict[int, _ComputeInstance] = {}
        self._mig_by_address: dict[int, _ComputeInstance] = {}
        self._event_sets: dict[int, _EventSet] = {}
        # GPM samples by address: None until taken, then (GPU instance, SM utilization).
        self._gpm_samples: dict[int, tuple[_GpuInstance, float] | None] = {}
        self._init_count = 0
        self._unrepairable_versioned = False
        self._calls = 0
        self._fail_remaining: int | None = None
        self._fail_code = pynvml.NVML_ERROR_UNKNOWN
        self._privileged = True
        for index, spec in enumerate(profile.gpus):
            mig_capable = profile.products[spec.product].mig is not None
            enabled = 1 if spec.migEnabled else 0
            pending = enabled if spec.migPendingEnabled is None else int(spec.migPendingEnabled)
            gpu = _Gpu(
                index=index,
                spec=spec,
                product=profile.products[spec.product],
                uuid=self._salted("GPU", spec.uuid),
                address=self._new_address(),
                mig_current=enabled if mig_capable else 0,
                mig_pending=pending if mig_capable else 0,
                compute_mode=spec.computeMode,
            )
            self._gpus.append(gpu)
            self._gpu_by_address[gpu.address] = gpu
            for j, mig in enumerate(spec.migInstances):
                try:
                    self._create_static_mig(gpu, mig)
                except pynvml.NVMLError as err:
                    msg = (
                        f"{source}: gpus.{index}.migInstances.{j}: cannot create GPU instance "
                        f"profile {mig.profileId} at slice {mig.placementStart}: "
                        f"{describe_nvml_error(err)}"
                    )
                    raise ProfileError(msg) from None
        self.telemetry = Telemetry(
            {gpu.uuid: gpu.spec.telemetry or TelemetrySpec() for gpu in self._gpus},
            index={gpu.index: gpu.uuid for gpu in self._gpus},
            product_memory_used={gpu.uuid: gpu.product.memoryUsed for gpu in self._gpus},
            script_path=script_path,
            clock=clock,
        )
        if script_path is not None:
            try:
                self.telemetry.check_file()
            except ScriptError as err:
                raise ProfileError(f"{source}: telemetry script: {err}") from None
        if state_path is not None:
            existed = state_path.exists()
            if existed:
                self._load_state(state_path)
            self._state_path = state_path
            if not existed:
                self._save_state()
        # A test may put a sysfs of its own here (one with a NUMA distance table).
        self.pci_topology: PciTopology = EmulatedTopology(
            roots=MappingProxyType(
                {_normalise_bus_id(g.busId): g.pcieRoot for g in profile.gpus if g.pcieRoot}
            ),
            numa_nodes=MappingProxyType(
                {
                    _normalise_bus_id(g.busId): g.sysfs_numa_node
                    for g in profile.gpus
                    if g.sysfs_numa_node is not None
                }
            ),
        )

    # --- construction helpers -----------------------------------------------------------

    @classmethod
    def from_builtin(cls, name: str, *, uuid_salt: str | None = None) -> NvmlEmulator:
        return cls(load_builtin_profile(name), uuid_salt=uuid_salt, source=f"profile {name}")

    @classmethod
    def from_file(cls, path: Path, *, uuid_salt: str | None = None) -> NvmlEmulator:
        return cls(load_profile_file(path), uuid_salt=uuid_salt, source=str(path))

    @property
    def profile(self) -> ProfileSpec:
        return self._profile

    def _salted(self, prefix: str, value: str) -> str:
        if self._salt is None:
            return value
        return f"{prefix}-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'{self._salt}/{value}')}"

    def _new_address(self) -> int:
        # A real (tiny) allocation per handle: addresses are unique and point at memory
        # we own, so a handle can never be mistaken for another emulator's handle.
        buffer = ctypes.create_string_buffer(1)
        self._buffers.append(buffer)
        return ctypes.addressof(buffer)

    def _create_static_mig(self, gpu: _Gpu, mig: MigInstanceSpec) -> None:
        profile = self._gi_profile_by_id(gpu, mig.profileId)
        gi = self._create_gpu_instance(gpu, profile, mig.placementStart, mig.gpuInstanceId)
        if mig.computeInstanceProfileId is None:
            ci_profile = _CI_PROFILE_FOR_SLICES.get(profile.sliceCount)
            if ci_profile is None:
                raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        else:
            ci_profile = mig.computeInstanceProfileId
        self._create_compute_instance(gi, ci_profile, mig.computeInstanceId, mig.uuid)

    # --- state that outlives a process ---------------------------------------------------

    def _save_state(self) -> None:
        if self._state_path is None:
            return
        gpus = [
            {
                "uuid": gpu.uuid,
                "migCurrent": gpu.mig_current,
                "migPending": gpu.mig_pending,
                "computeMode": gpu.compute_mode,
                "migSerial": gpu.mig_serial,
                "gpuInstances": [
                    {
                        "id": gi.id,
                        "profileId": gi.profile.id,
                        "start": gi.start,
                        "computeInstances": [
                            {
                                "id": ci.id,
                                "profileId": ci.profile_id,
                                "uuid": ci.uuid,
                                "computeMode": ci.compute_mode,
                            }
                            for ci in sorted(gi.compute_instances.values(), key=lambda c: c.id)
                        ],
                    }
                    for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id)
                ],
            }
            for gpu in self._gpus
        ]
        data = json.dumps({"version": 1, "gpus": gpus}, indent=1).encode()
        atomic_write(self._state_path, data, mode=0o600, durable=False)

    def _load_state(self, path: Path) -> None:
        try:
            gpus = json.loads(path.read_text())["gpus"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            msg = f"emulated GPU state file {path}: {err}; remove it to start afresh"
            raise ProfileError(msg) from None
        if [g.get("uuid") for g in gpus] != [g.uuid for g in self._gpus]:
            msg = f"emulated GPU state file {path} is another machine's (GPU UUIDs differ)"
            raise ProfileError(msg)
        try:
            for gpu, saved in zip(self._gpus, gpus, strict=True):
                for gi in list(gpu.gpu_instances.values()):
                    for ci in list(gi.compute_instances.values()):
                        self._remove_compute_instance(ci)
                    self._remove_gpu_instance(gi)
                gpu.mig_current = int(saved["migCurrent"])
                gpu.mig_pending = int(saved["migPending"])
                gpu.compute_mode = int(saved["computeMode"])
                for gi_doc in saved["gpuInstances"]:
                    profile = self._gi_profile_by_id(gpu, int(gi_doc["profileId"]))
                    gi = self._create_gpu_instance(
                        gpu, profile, int(gi_doc["start"]), int(gi_doc["id"])
                    )
                    for ci_doc in gi_doc["computeInstances"]:
                        ci = self._create_compute_instance(
                            gi, int(ci_doc["profileId"]), int(ci_doc["id"])
                        )
                        ci.uuid = str(ci_doc["uuid"])
                        ci.compute_mode = int(
                            ci_doc.get("computeMode", pynvml.NVML_COMPUTEMODE_DEFAULT)
                        )
                gpu.mig_serial = int(saved["migSerial"])
        except (OSError, ValueError, KeyError, TypeError, pynvml.NVMLError) as err:
            msg = f"emulated GPU state file {path}: {err}; remove it to start afresh"
            raise ProfileError(msg) from None

    # --- controls for tests and simulations ----------------------------------------------

    @property
    def call_count(self) -> int:
        """NVML calls made so far (event waits excluded); lets tests aim `fail_after`."""
        with self._lock:
            return self._calls

    def fail_after(self, n_calls: int, error_code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        """Let the next `n_calls` NVML calls succeed, then fail every call with `error_code`.

        Event waits and nvmlShutdown are exempt so a watcher and cleanup keep working.
        The failure stays until `clear_failure`.
        """
        if n_calls < 0:
            msg = "n_calls must be >= 0"
            raise ValueError(msg)
        with self._lock:
            self._fail_remaining = n_calls
            self._fail_code = error_code

    def clear_failure(self) -> None:
        with self._lock:
            self._fail_remaining = None

    def set_privileged(self, privileged: bool) -> None:
        """Run as root (True, the default) or as an unprivileged process without access
        to /dev/nvidia-caps: then MIG instance and placement calls, settings, and the
        aggregate memory of a MIG-enabled GPU answer NO_PERMISSION, and events of one
        MIG instance are not delivered (`_deliver`)."""
        with self._lock:
            self._privileged = privileged

    def inject_xid(
        self,
        index: int,
        xid: int,
        *,
        gpu_instance_id: int = FULL_GPU_INSTANCE_ID,
        compute_instance_id: int = FULL_GPU_INSTANCE_ID,
    ) -> None:
        """Raise an XID critical-error event on GPU `index` (optionally on one MIG device)."""
        with self._lock:
            gpu = self._gpu_at(index)
            self._deliver(
                _PendingEvent(
                    gpu,
                    pynvml.nvmlEventTypeXidCriticalError,
                    xid,
                    gpu_instance_id,
                    compute_instance_id,
                )
            )

    def inject_ecc(self, index: int, *, double_bit: bool = True) -> None:
        """Raise an ECC error event on GPU `index`."""
        event_type = (
            pynvml.nvmlEventTypeDoubleBitEccError
            if double_bit
            else pynvml.nvmlEventTypeSingleBitEccError
        )
        with self._lock:
            gpu = self._gpu_at(index)
            self.telemetry.count_ecc(gpu.uuid, uncorrected=double_bit)
            self._deliver(
                _PendingEvent(gpu, event_type, 0, FULL_GPU_INSTANCE_ID, FULL_GPU_INSTANCE_ID)
            )

    def lose_gpu(self, index: int, *, xid: int | None = None) -> None:
        """GPU `index` falls off the bus: its calls raise GPU_IS_LOST, waiters are told.

        `xid` (79, "GPU has fallen off the bus"): the XID the driver reported as the GPU
        went, queued before the loss in one step, so a watcher reads it from a GPU that
        is lost by then, as one on a real node mostly does."""
        with self._lock:
            if xid is not None:
                self.inject_xid(index, xid)
            gpu = self._gpu_at(index)
            gpu.lost = True
            self._deliver(
                _PendingEvent(gpu, 0, 0, FULL_GPU_INSTANCE_ID, FULL_GPU_INSTANCE_ID, lost=True)
            )

    def recover_gpu(self, index: int) -> None:
        """GPU `index` answers again (as after a successful reset)."""
        with self._lock:
            gpu = self._gpu_at(index)
            gpu.lost = False
            gpu.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE

    def fail_row_remapping(self, index: int, *, failed: bool = True) -> None:
        """GPU `index`'s row remapper says a remapping failed (`failed`: NVIDIA's RMA
        threshold for its memory was reached), or no longer does (the board was
        serviced): `nvmlDeviceGetRemappedRows` says so from now on."""
        with self._lock:
            self._gpu_at(index).row_remap_failed = failed

    def flag_unrepairable_memory(self, index: int, *, unrepairable: bool = True) -> None:
        """NVML says GPU `index` has unrepairable memory (`unrepairable`), or no longer
        does (the board was serviced): `nvmlDeviceGetUnrepairableMemoryFlag_v1` says so
        from now on, on R590 and later."""
        with self._lock:
            self._gpu_at(index).unrepairable_memory = unrepairable

    def write_unrepairable_memory_versioned(self, versioned: bool = True) -> None:
        """Which struct the emulated `nvmlDeviceGetUnrepairableMemoryFlag_v1` takes:
        `nvml.h`'s, the flag alone (the default), or nvidia-ml-py's, a version and then
        the flag (`versioned`), refusing any other version with ARGUMENT_VERSION_MISMATCH.
        NVIDIA publishes both (`gpudra.driver.nvml.unrepairable`)."""
        with self._lock:
            self._unrepairable_versioned = versioned

    @property
    def nvmlLib(self) -> EmulatedLibrary:
        """libnvidia-ml's own C entry points, where pynvml's is its ctypes CDLL."""
        return EmulatedLibrary(self)

    def _c_unrepairable_memory_flag(self, device: object, status: object) -> int:
        """The C entry point: write the flag into the caller's struct, return the
        nvmlReturn_t. Hopper and newer; NOT_SUPPORTED for a MIG device handle."""
        try:
            with self._lock:
                self._enter(counted=True, needs_init=True)
                gpu = self._gpu(device)
                hopper: int = pynvml.NVML_DEVICE_ARCH_HOPPER
                if gpu.product.architecture < hopper:
                    raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
                target = _deref(status)
                if not isinstance(target, ctypes.Array | ctypes.Structure):
                    raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                words = ctypes.cast(ctypes.addressof(target), ctypes.POINTER(ctypes.c_uint))
                flag = int(gpu.unrepairable_memory)
                if not self._unrepairable_versioned:
                    words[0] = flag
                elif words[0] != pynvml.nvmlUnrepairableMemory_v1:
                    raise _nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
                else:
                    words[1] = flag
        except pynvml.NVMLError as err:
            return int(err.value)
        return int(pynvml.NVML_SUCCESS)

    def change_recovery_action(self, index: int, action: int) -> None:
        """The driver says GPU `index` now needs `action` (NVML_GPU_RECOVERY_ACTION_*):
        field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION reads it from now on, and XID 154
        ("GPU recovery action changed", NVIDIA's XID catalogue) is raised, as the driver
        does alongside the XID that caused it."""
        with self._lock:
            gpu = self._gpu_at(index)
            gpu.recovery_action = action
            self._deliver(
                _PendingEvent(
                    gpu,
                    pynvml.nvmlEventTypeXidCriticalError,
                    RECOVERY_ACTION_XID,
                    FULL_GPU_INSTANCE_ID,
                    FULL_GPU_INSTANCE_ID,
                )
            )

    def reset_gpu(self, index: int) -> None:
        """Apply a pending MIG mode, as a GPU reset does on Ampere."""
        with self._lock:
            gpu = self._gpu_at(index)
            if gpu.mig_pending == 0 and gpu.gpu_instances:
                raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
            gpu.mig_current = gpu.mig_pending

    def power_cycle(self) -> None:
        """The host rebooted: a pending MIG mode takes effect and every GPU and compute
        instance is gone (NVIDIA: only MIG mode persists across a reboot). Instances made
        afterwards get MIG UUIDs none made before had, as the driver's do."""
        with self._lock:
            for gpu in self._gpus:
                for gi in list(gpu.gpu_instances.values()):
                    for ci in list(gi.compute_instances.values()):
                        self._remove_compute_instance(ci)
                    self._remove_gpu_instance(gi)
                gpu.mig_current = gpu.mig_pending
            self._save_state()

    def create_gpu_instance_numbered(
        self, index: int, profile_id: int, start: int, gpu_instance_id: int
    ) -> None:
        """Create a GPU instance at placement `start` under an ID of the caller's choosing.

        NVML derives the ID from the placement (`gpu_instance_id_for_placement`); this
        sets a GPU up as records made under another numbering describe it: a previous
        release's checkpoint written against the lowest-free numbering, or a GPU that
        numbers its halves mirrored.
        """
        with self._lock:
            gpu = self._gpu_at(index)
            profile = self._gi_profile_by_id(gpu, profile_id)
            self._create_gpu_instance(gpu, profile, start, gpu_instance_id)
            self._save_state()

    def _gpu_at(self, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            msg = f"no GPU at index {index}; this node has {len(self._gpus)}"
            raise IndexError(msg)
        return self._gpus[index]

    def _deliver(self, event: _PendingEvent) -> None:
        if not self._privileged and event.gpu_instance_id != FULL_GPU_INSTANCE_ID:
            # nvml.h, nvmlEventSetWait_v2: in MIG mode the events of the instances are
            # reported only to a caller with the privilege; without it only those that
            # affect the whole device.
            return
        for event_set in self._event_sets.values():
            mask = event_set.gpus.get(event.gpu.index)
            if mask is None:
                continue
            if event.lost or mask & event.event_type:
                event_set.queue.append(event)
        self._cond.notify_all()

    # --- plumbing -------------------------------------------------------------------------

    def _enter(self, *, counted: bool, needs_init: bool) -> None:
        if needs_init and self._init_count == 0:
            raise _nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        if not counted:
            return
        self._calls += 1
        if self._fail_remaining is not None:
            if self._fail_remaining == 0:
                raise _nvml_error(self._fail_code)
            self._fail_remaining -= 1

    @staticmethod
    def _address(handle: object) -> int:
        try:
            value = ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[arg-type]
        except (ctypes.ArgumentError, TypeError):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        if not value:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(value)

    @staticmethod
    def _check_alive(gpu: _Gpu) -> None:
        if gpu.lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _check_all_alive(self) -> None:
        """Lookups that walk every GPU fail while any GPU is lost (nvml.h)."""
        if any(gpu.lost for gpu in self._gpus):
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _check_privileged(self) -> None:
        if not self._privileged:
            raise _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)

    def _resolve(self, handle: object) -> tuple[_Gpu, _ComputeInstance | None]:
        """A GPU handle or a MIG device handle -> (GPU, MIG device or None)."""
        address = self._address(handle)
        gpu = self._gpu_by_address.get(address)
        if gpu is not None:
            self._check_alive(gpu)
            return gpu, None
        mig = self._mig_by_address.get(address)
        if mig is not None:
            self._check_alive(mig.gpu_instance.gpu)
            return mig.gpu_instance.gpu, mig
        raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gpu(self, handle: object) -> _Gpu:
        """A full-GPU handle; MIG device handles get NOT_SUPPORTED."""
        gpu, mig = self._resolve(handle)
        if mig is not None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_gpu(self, handle: object) -> _Gpu:
        """A full-GPU handle of a MIG-capable GPU."""
        gpu = self._gpu(handle)
        if gpu.product.mig is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_enabled_gpu(self, handle: object) -> _Gpu:
        gpu = self._mig_gpu(handle)
        if gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _gpu_instance(self, handle: object) -> _GpuInstance:
        gi = self._gi_by_address.get(self._address(handle))
        if gi is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._check_alive(gi.gpu)
        return gi

    def _compute_instance(self, handle: object) -> _ComputeInstance:
        ci = self._ci_by_address.get(self._address(handle))
        if ci is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._check_alive(ci.gpu_instance.gpu)
        return ci

    @staticmethod
    def _device_handle(address: int) -> Any:
        return ctypes.cast(address, pynvml.c_nvmlDevice_t)

    @staticmethod
    def _text(value: object) -> str:
        if isinstance(value, bytes):
            return value.decode()
        if isinstance(value, str):
            return value
        raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @staticmethod
    def _out_uint(ref: object) -> Any:
        target = _deref(ref)
        if not isinstance(target, ctypes.c_uint):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return target

    @staticmethod
    def _fill(ref: object, values: list[Any]) -> None:
        """Write `values` into a caller's ctypes array (or pointer to its first element)."""
        target = _deref(ref) if getattr(ref, "_obj", None) is not None else ref
        if isinstance(target, ctypes.Array) and len(target) < len(values):
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        try:
            for i, value in enumerate(values):
                target[i] = value  # type: ignore[index]
        except (TypeError, IndexError):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None

    # --- MIG model ------------------------------------------------------------------------

    def _offered(self, gpu: _Gpu) -> tuple[GpuInstanceProfileSpec, ...]:
        """The product's GPU instance profiles that this driver branch offers."""
        if gpu.product.mig is None:
            return ()
        branch = self._profile.branch
        return tuple(
            p
            for p in gpu.product.mig.gpuInstanceProfiles
            if has_gpu_instance_profile(branch, p.index)
        )

    def _gi_profile_by_id(self, gpu: _Gpu, profile_id: int) -> GpuInstanceProfileSpec:
        if gpu.product.mig is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for profile in self._offered(gpu):
            if profile.id == profile_id:
                return profile
        raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _full_profile(self, gpu: _Gpu) -> GpuInstanceProfileSpec:
        """The profile spanning the whole GPU: its engine counts are the GPU's pools."""
        return max(self._offered(gpu), key=lambda p: (p.sliceCount, p.memorySizeMB))

    def _fits(
        self,
        gpu: _Gpu,
        profile: GpuInstanceProfileSpec,
        start: int,
        extra: tuple[tuple[GpuInstanceProfileSpec, int], ...] = (),
    ) -> bool:
        """Whether a new instance of `profile` at `start` respects every shared resource.

        `extra` adds hypothetical instances (profile, start) to the existing ones.
        """
        size = profile.placements[0].size
        wanted = set(range(start, start + size))
        existing = [(gi.profile, gi.start) for gi in gpu.gpu_instances.values()]
        existing.extend(extra)
        for other, other_start in existing:
            if wanted & set(range(other_start, other_start + other.placements[0].size)):
                return False
        if sum(1 for other, _ in existing if other.id == profile.id) >= profile.instanceCount:
            return False
        pool = self._full_profile(gpu)
        for attr in (
            "sliceCount",
            "multiprocessorCount",
            "copyEngineCount",
            "decoderCount",
            "encoderCount",
            "jpegCount",
            "ofaCount",
            "memorySizeMB",
        ):
            used = sum(getattr(other, attr) for other, _ in existing)
            if used + getattr(profile, attr) > getattr(pool, attr):
                return False
        return True

    def _create_gpu_instance(
        self,
        gpu: _Gpu,
        profile: GpuInstanceProfileSpec,
        start: int | None,
        wanted_id: int | None = None,
    ) -> _GpuInstance:
        if gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        starts = [p.start for p in profile.placements]
        if start is None:
            free = [s for s in starts if self._fits(gpu, profile, s)]
            if not free:
                raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            start = free[0]
        elif start not in starts:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        elif not self._fits(gpu, profile, start):
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if wanted_id is not None:
            if wanted_id in gpu.gpu_instances:
                raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            gi_id = wanted_id
        else:
            slots = placement_slots(self._offered(gpu))
            gi_id = gpu_instance_id_for_placement(slots, start, profile.placements[0].size)
            if gi_id in gpu.gpu_instances:
                # Only a replayed recording can hold it (existing placements never
                # overlap): its GPU mapped placements differently. Any free ID will do.
                gi_id = next(i for i in range(1, 1 << 16) if i not in gpu.gpu_instances)
        gi = _GpuInstance(
            gpu=gpu, id=gi_id, profile=profile, start=start, address=self._new_address()
        )
        gpu.gpu_instances[gi_id] = gi
        self._gi_by_address[gi.address] = gi
        return gi

    @staticmethod
    def _ci_profile_allowed(gi: _GpuInstance, ci_profile: int) -> int | None:
        """Slice count of CI profile `ci_profile` inside `gi`, or None if not offered.

        Offered: the whole GPU instance, and smaller compute instances no bigger than
        half of it rounded up (the shapes NVIDIA documents).
        """
        slices = _SLICES_FOR_CI_PROFILE.get(ci_profile)
        g = gi.profile.sliceCount
        if slices is None or slices > g:
            return None
        if slices != g and slices * 2 > g + 1:
            return None
        return slices

    def _ci_multiprocessors(self, gi: _GpuInstance, slices: int) -> int:
        if slices == gi.profile.sliceCount:
            return gi.profile.multiprocessorCount
        return (gi.profile.multiprocessorCount // gi.profile.sliceCount) * slices

    def _ci_free_start(self, gi: _GpuInstance, slices: int) -> int | None:
        used: set[int] = set()
        for ci in gi.compute_instances.values():
            used.update(range(ci.start, ci.start + ci.slice_count))
        for start in range(0, gi.profile.sliceCount - slices + 1, slices):
            if not used & set(range(start, start + slices)):
                return start
        return None

    def _create_compute_instance(
        self,
        gi: _GpuInstance,
        ci_profile: int,
        wanted_id: int | None = None,
        wanted_uuid: str | None = None,
    ) -> _ComputeInstance:
        slices = self._ci_profile_allowed(gi, ci_profile)
        if slices is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        start = self._ci_free_start(gi, slices)
        if start is None:
            raise _nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if wanted_id is not None:
            if wanted_id in gi.compute_instances:
                raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            ci_id = wanted_id
        else:
            ci_id = next(i for i in range(1 << 16) if i not in gi.compute_instances)
        gpu = gi.gpu
        gpu.mig_serial += 1
        if wanted_uuid is not None:
            mig_uuid = self._salted("MIG", wanted_uuid)
        else:
            mig_uuid = "MIG-" + str(
                uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{gpu.uuid}/{gi.id}/{ci_id}/{gpu.mig_serial}")
            )
        ci = _ComputeInstance(
            gpu_instance=gi,
            id=ci_id,
            profile_id=ci_profile,
            slice_count=slices,
            start=start,
            uuid=mig_uuid,
            ci_address=self._new_address(),
            mig_address=self._new_address(),
        )
        gi.compute_instances[ci_id] = ci
        self._ci_by_address[ci.ci_address] = ci
        self._mig_by_address[ci.mig_address] = ci
        return ci

    @staticmethod
    def _mig_profile_name(gi: _GpuInstance, slices: int) -> str:
        base = gi.profile.name.removeprefix("MIG ")
        if slices == gi.profile.sliceCount:
            return base
        return f"{slices}c.{base}"

    # --- init / system ----------------------------------------------------------------------

    @_nvml(needs_init=False)
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._init_count += 1

    @_nvml(needs_init=False)
    def nvmlInit(self) -> None:
        self._init_count += 1

    @_nvml(counted=False)
    def nvmlShutdown(self) -> None:
        self._init_count -= 1

    @_nvml()
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._profile.driverVersion

    @_nvml()
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._profile.cudaDriverVersion

    @_nvml()
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self._profile.cudaDriverVersion

    @_nvml()
    def nvmlSystemGetNVMLVersion(self) -> str:
        if self._profile.nvmlVersion is not None:
            return self._profile.nvmlVersion
        return f"{self._profile.cudaDriverVersion // 1000}.{self._profile.driverVersion}"

    # --- device enumeration -----------------------------------------------------------------

    @_nvml()
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @_nvml()
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not isinstance(index, int) or not 0 <= index < len(self._gpus):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpus[index]
        self._check_alive(gpu)
        return self._device_handle(gpu.address)

    @_nvml()
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        wanted = self._text(uuid)
        self._check_all_alive()
        for gpu in self._gpus:
            if gpu.uuid == wanted:
                self._check_alive(gpu)
                return self._device_handle(gpu.address)
            for mig in gpu.mig_devices():
                if mig.uuid == wanted:
                    self._check_alive(gpu)
                    return self._device_handle(mig.mig_address)
        raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    @_nvml()
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        wanted = _normalise_bus_id(self._text(pciBusId))
        self._check_all_alive()
        for gpu in self._gpus:
            if gpu.spec.busId == wanted:
                self._check_alive(gpu)
                return self._device_handle(gpu.address)
        raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    @_nvml()
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._gpu(handle).index

    # --- device identity and properties -------------------------------------------------

    @_nvml()
    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu, mig = self._resolve(handle)
        if mig is None:
            return gpu.product.name
        profile = self._mig_profile_name(mig.gpu_instance, mig.slice_count)
        return f"{gpu.product.name} MIG {profile}"

    @_nvml()
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, mig = self._resolve(handle)
        return gpu.uuid if mig is None else mig.uuid

    @_nvml()
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._gpu(handle).spec.minor

    @_nvml()
    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._resolve(handle)[0].product.brand

    @_nvml()
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        """(rows remapped for correctable errors, for uncorrectable ones, remapping
        pending, a remapping ever failed). Ampere and newer; NOT_SUPPORTED for a MIG
        device, and on a MIG-enabled GPU with instances (nvml.h)."""
        gpu = self._gpu(device)
        ampere: int = pynvml.NVML_DEVICE_ARCH_AMPERE
        if gpu.product.architecture < ampere or gpu.gpu_instances:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (0, 0, 0, int(gpu.row_remap_failed))

    @_nvml()
    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        return self._resolve(device)[0].product.architecture

    @_nvml()
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        major, minor = self._resolve(handle)[0].product.cudaComputeCapability
        return (major, minor)

    @_nvml()
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu, mig = self._resolve(handle)
        if mig is None and gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            # nvml.h: a MIG-enabled parent's aggregate needs privilege.
            self._check_privileged()
        if mig is None:
            total = gpu.product.memoryTotal
            reserved = gpu.product.memoryReserved
        else:
            total = mig.gpu_instance.profile.memorySizeMB * _MIB
            reserved = 0
        scripted = self.telemetry.value(gpu.uuid, "memoryUsed", None if mig is None else mig.uuid)
        used = min(int(scripted), total - reserved)
        if not version:
            info = pynvml.c_nvmlMemory_t()
            info.total = total
            info.used = used + reserved
            info.free = total - used - reserved
            return info
        info = pynvml.c_nvmlMemory_v2_t()
        info.version = version
        info.total = total
        info.reserved = reserved
        info.used = used
        info.free = total - used - reserved
        return info

    # --- telemetry (values from gpudra.driver.nvml.series) ---------------------------------

    def _telemetry(self, handle: Any, name: str) -> float:
        gpu, mig = self._resolve(handle)
        return self.telemetry.value(gpu.uuid, name, None if mig is None else mig.uuid)

    @_nvml()
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu, mig = self._resolve(handle)
        if mig is None and gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            # nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not
            # currently supported." (A MIG device has none either: `series`.)
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = round(self._telemetry(handle, "utilization"))
        rates.memory = round(self._telemetry(handle, "memoryUtilization"))
        return rates

    @_nvml()
    def nvmlDeviceGetSamples(
        self, device: Any, sampling_type: int, timeStamp: int
    ) -> tuple[int, list[Any]]:
        """The GPU's utilization samples newer than `timeStamp` (`Telemetry.samples`),
        as pynvml returns them: the value type and a list of `c_nvmlSample_t`.

        nvml.h: NOT_FOUND where no sample is newer; utilization samples are unsigned
        ints; "On MIG-enabled GPUs, querying ... NVML_GPU_UTILIZATION_SAMPLES,
        NVML_MEMORY_UTILIZATION_SAMPLES ... is not currently supported". A MIG device
        has no samples of its own either, and the sampling types not emulated (power,
        clocks, encoder, decoder, ...) answer NOT_SUPPORTED.
        """
        gpu, mig = self._resolve(device)
        if not 0 <= sampling_type < pynvml.NVML_SAMPLINGTYPE_COUNT:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        name = _SAMPLED.get(sampling_type)
        if name is None or mig is not None or gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        taken = self.telemetry.samples(gpu.uuid, name, timeStamp)
        if not taken:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        samples = []
        for stamp, value in taken:
            sample = pynvml.c_nvmlSample_t()
            sample.timeStamp = stamp
            sample.sampleValue.uiVal = round(value)
            samples.append(sample)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    @_nvml()
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(self._telemetry(handle, "temperature"))

    @_nvml()
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return round(self._telemetry(handle, "power") * 1000)

    @_nvml()
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        if type != pynvml.NVML_CLOCK_SM:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return round(self._telemetry(handle, "smClock"))

    @_nvml()
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        names = {
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "eccCorrected",
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "eccUncorrected",
        }
        if errorType not in names or counterType not in (
            pynvml.NVML_VOLATILE_ECC,
            pynvml.NVML_AGGREGATE_ECC,
        ):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(self._telemetry(handle, names[errorType]))

    # --- GPU performance metrics (GPM): a MIG instance's own SM utilization -------------
    # Hopper and newer only; the SM utilization between two samples is the instance's
    # scripted utilization when the second was taken (`Telemetry.mig_sm_utilization`).

    def gpm_samples_held(self) -> int:
        """GPM samples allocated and not freed (a test's leak check)."""
        with self._lock:
            return len(self._gpm_samples)

    @_nvml()
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        gpu = self._gpu(device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(_gpm_capable(gpu))
        return support

    @_nvml()
    def nvmlGpmSampleAlloc(self) -> Any:
        address = self._new_address()
        self._gpm_samples[address] = None
        return ctypes.cast(address, pynvml.c_nvmlGpmSample_t)

    @_nvml()
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        if self._gpm_samples.pop(self._address(gpmSample), _FREED) is _FREED:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @_nvml()
    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        gpu = self._gpu(device)
        if not _gpm_capable(gpu):
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        address = self._address(gpmSample)
        gi = gpu.gpu_instances.get(gpuInstanceId)
        if address not in self._gpm_samples or gi is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        migs = [ci.uuid for ci in gi.compute_instances.values()]
        self._gpm_samples[address] = (gi, self.telemetry.mig_sm_utilization(gpu.uuid, migs))
        return gpmSample

    @_nvml()
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        first = self._gpm_samples.get(self._address(metricsGet.sample1))
        second = self._gpm_samples.get(self._address(metricsGet.sample2))
        if first is None or second is None or first[0] is not second[0]:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId == pynvml.NVML_GPM_METRIC_SM_UTIL:
                metric.value = second[1]
                metric.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return metricsGet

    @_nvml()
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        gpu = self._resolve(handle)[0]
        domain, bus, rest = gpu.spec.busId.split(":")
        device = rest.split(".")[0]
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{device}.0"
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device, 16)
        info.pciDeviceId = gpu.product.pciDeviceId
        info.pciSubSystemId = gpu.product.pciSubSystemId
        info.busId = gpu.spec.busId
        return info

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @_nvml()
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        gpu = self._resolve(handle)[0]
        if gpu.spec.numaNode is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.spec.numaNode

    @_nvml()
    def nvmlDeviceGetAddressingMode(self, device: Any) -> int:
        # Discovery asks the GPU only; a MIG device is answered its GPU's mode (what a
        # real driver answers a MIG handle has not been recorded).
        gpu = self._resolve(device)[0]
        if gpu.spec.addressingMode is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.spec.addressingMode

    @_nvml()
    def nvmlDeviceGetAttributes_v2(self, device: Any) -> Any:
        _gpu, mig = self._resolve(device)
        if mig is None:
            # nvml.h: "currently only supports MIG device handles"; a real H200 on
            # R580 (tests/nvml/answers) answers a whole GPU's handle so.
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        attrs = pynvml.c_nvmlDeviceAttributes()
        gi = mig.gpu_instance
        attrs.multiprocessorCount = self._ci_multiprocessors(gi, mig.slice_count)
        attrs.sharedCopyEngineCount = gi.profile.copyEngineCount
        attrs.sharedDecoderCount = gi.profile.decoderCount
        attrs.sharedEncoderCount = gi.profile.encoderCount
        attrs.sharedJpegCount = gi.profile.jpegCount
        attrs.sharedOfaCount = gi.profile.ofaCount
        attrs.gpuInstanceSliceCount = gi.profile.sliceCount
        attrs.computeInstanceSliceCount = mig.slice_count
        attrs.memorySizeMB = gi.profile.memorySizeMB
        return attrs

    def nvmlDeviceGetAttributes(self, device: Any) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    def _compute_mode_holder(self, handle: Any) -> _Gpu | _ComputeInstance:
        """What a compute mode call reads or sets. nvml.h: "If MIG is enabled on a GPU,
        device must be MIG device handle", so a MIG-enabled GPU has no mode of its own."""
        gpu, mig = self._resolve(handle)
        if mig is not None:
            return mig
        if gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @_nvml()
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        return self._compute_mode_holder(handle).compute_mode

    @_nvml(mutates=True)
    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        holder = self._compute_mode_holder(handle)
        if not isinstance(mode, int) or not 0 <= mode < pynvml.NVML_COMPUTEMODE_COUNT:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._check_privileged()
        holder.compute_mode = mode

    # --- MIG mode and MIG devices ---------------------------------------------------------

    @_nvml()
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._mig_gpu(device)
        return [gpu.mig_current, gpu.mig_pending]

    @_nvml(mutates=True)
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        gpu = self._mig_gpu(device)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._check_privileged()
        if mode == pynvml.NVML_DEVICE_MIG_DISABLE and gpu.gpu_instances:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        gpu.mig_pending = mode
        assert gpu.product.mig is not None
        if gpu.product.mig.toggleWithoutReset:
            gpu.mig_current = mode
        return int(pynvml.NVML_SUCCESS)

    @_nvml()
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu(device)
        if gpu.product.mig is None or gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return 0  # nvml.h: "zero if MIG is not supported or enabled"
        return gpu.product.mig.maxMigDeviceCount

    @_nvml()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._mig_gpu(device)
        assert gpu.product.mig is not None
        if not isinstance(index, int) or not 0 <= index < gpu.product.mig.maxMigDeviceCount:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        migs = gpu.mig_devices() if gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE else []
        if index >= len(migs):
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._device_handle(migs[index].mig_address)

    @_nvml()
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        gpu, mig = self._resolve(migDevice)
        if mig is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._device_handle(gpu.address)

    @_nvml()
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        # pynvml returns the c_uint itself here, not its value.
        return ctypes.c_uint(0 if self._resolve(device)[1] is None else 1)

    @_nvml()
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        mig = self._resolve(device)[1]
        if mig is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig.gpu_instance.id

    @_nvml()
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        mig = self._resolve(device)[1]
        if mig is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig.id

    # --- GPU instances ----------------------------------------------------------------------

    @staticmethod
    def _gi_profile_info(profile: GpuInstanceProfileSpec, version: int) -> Any:
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = profile.name
        elif version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = profile.id
        info.isP2pSupported = profile.isP2pSupported
        info.sliceCount = profile.sliceCount
        info.instanceCount = profile.instanceCount
        info.multiprocessorCount = profile.multiprocessorCount
        info.copyEngineCount = profile.copyEngineCount
        info.decoderCount = profile.decoderCount
        info.encoderCount = profile.encoderCount
        info.jpegCount = profile.jpegCount
        info.ofaCount = profile.ofaCount
        info.memorySizeMB = profile.memorySizeMB
        return info

    @_nvml()
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Any, profile: int, version: int = 2
    ) -> Any:
        gpu = self._mig_gpu(device)
        if (
            not isinstance(profile, int)
            or not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
            or not has_gpu_instance_profile(self._profile.branch, profile)
        ):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for spec in self._offered(gpu):
            if spec.index == profile:
                return self._gi_profile_info(spec, version)
        raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstanceProfileInfoV(
        self, device: Any, profile: int, version: int = 2
    ) -> Any:
        return self.nvmlDeviceGetGpuInstanceProfileInfo(device, profile, version)

    @_nvml()
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_gpu(device)
        return self._gi_profile_info(self._gi_profile_by_id(gpu, profileId), 2)

    def nvmlDeviceGetGpuInstanceProfileInfoByIdV(self, device: Any, profileId: int) -> Any:
        return self.nvmlDeviceGetGpuInstanceProfileInfoById(device, profileId)

    @_nvml()
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        gpu = self._mig_gpu(device)
        if (
            gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE
            and self._profile.branch < PLACEMENTS_WITHOUT_MIG_SINCE
        ):
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._check_privileged()
        profile = self._gi_profile_by_id(gpu, profileId)
        count = self._out_uint(countRef)
        if placementsRef is not None:
            self._fill(
                placementsRef,
                [pynvml.c_nvmlGpuInstancePlacement_t(p.start, p.size) for p in profile.placements],
            )
        count.value = len(profile.placements)
        return int(pynvml.NVML_SUCCESS)

    @_nvml()
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        gpu = self._mig_enabled_gpu(device)
        profile = self._gi_profile_by_id(gpu, profileId)
        # How many more fit when created first-fit, as NVML places them.
        added: tuple[tuple[GpuInstanceProfileSpec, int], ...] = ()
        for placement in profile.placements:
            if self._fits(gpu, profile, placement.start, added):
                added = (*added, (profile, placement.start))
        return len(added)

    @_nvml(mutates=True)
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_enabled_gpu(device)
        self._check_privileged()
        gi = self._create_gpu_instance(gpu, self._gi_profile_by_id(gpu, profileId), None)
        return ctypes.cast(gi.address, pynvml.c_nvmlGpuInstance_t)

    @_nvml(mutates=True)
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: Any, profileId: int, placement: Any
    ) -> Any:
        gpu = self._mig_enabled_gpu(device)
        self._check_privileged()
        profile = self._gi_profile_by_id(gpu, profileId)
        wanted = _deref(placement)
        if not isinstance(wanted, pynvml.c_nvmlGpuInstancePlacement_t):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not profile.placements or wanted.size != profile.placements[0].size:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = self._create_gpu_instance(gpu, profile, int(wanted.start))
        return ctypes.cast(gi.address, pynvml.c_nvmlGpuInstance_t)

    def _remove_gpu_instance(self, gi: _GpuInstance) -> None:
        del gi.gpu.gpu_instances[gi.id]
        del self._gi_by_address[gi.address]

    @_nvml(mutates=True)
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gi = self._gpu_instance(gpuInstance)
        self._check_privileged()
        if gi.compute_instances:
            raise _nvml_error(pynvml.NVML_ERROR_IN_USE)
        self._remove_gpu_instance(gi)
        return int(pynvml.NVML_SUCCESS)

    @_nvml()
    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        gpu = self._mig_enabled_gpu(device)
        self._check_privileged()
        self._gi_profile_by_id(gpu, profileId)
        count = self._out_uint(countRef)
        found = sorted(
            (gi for gi in gpu.gpu_instances.values() if gi.profile.id == profileId),
            key=lambda gi: gi.id,
        )
        if gpuInstancesRef is not None:
            self._fill(
                gpuInstancesRef,
                [ctypes.cast(gi.address, pynvml.c_nvmlGpuInstance_t) for gi in found],
            )
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    @_nvml()
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu = self._mig_enabled_gpu(device)
        self._check_privileged()
        gi = gpu.gpu_instances.get(gpuInstanceId)
        if gi is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return ctypes.cast(gi.address, pynvml.c_nvmlGpuInstance_t)

    @_nvml()
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gi = self._gpu_instance(gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._device_handle(gi.gpu.address)
        info.id = gi.id
        info.profileId = gi.profile.id
        info.placement = pynvml.c_nvmlGpuInstancePlacement_t(gi.start, len(gi.slices))
        return info

    # --- compute instances ----------------------------------------------------------------

    def _ci_profile_info(self, gi: _GpuInstance, ci_profile: int, version: int) -> Any:
        slices = self._ci_profile_allowed(gi, ci_profile)
        if slices is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.name = f"MIG {self._mig_profile_name(gi, slices)}"
        elif version == 1:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise _nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = ci_profile
        info.sliceCount = slices
        info.instanceCount = gi.profile.sliceCount // slices
        info.multiprocessorCount = self._ci_multiprocessors(gi, slices)
        info.sharedCopyEngineCount = gi.profile.copyEngineCount
        info.sharedDecoderCount = gi.profile.decoderCount
        info.sharedEncoderCount = gi.profile.encoderCount
        info.sharedJpegCount = gi.profile.jpegCount
        info.sharedOfaCount = gi.profile.ofaCount
        return info

    @_nvml()
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        gi = self._gpu_instance(device)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if (
            not isinstance(profile, int)
            or not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
        ):
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._ci_profile_info(gi, profile, version)

    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        return self.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            device, profile, engProfile, version
        )

    @_nvml()
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: Any, profileId: int
    ) -> int:
        gi = self._gpu_instance(gpuInstance)
        slices = self._ci_profile_allowed(gi, profileId)
        if slices is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        used: set[int] = set()
        for ci in gi.compute_instances.values():
            used.update(range(ci.start, ci.start + ci.slice_count))
        return sum(
            1
            for start in range(0, gi.profile.sliceCount - slices + 1, slices)
            if not used & set(range(start, start + slices))
        )

    @_nvml(mutates=True)
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        gi = self._gpu_instance(gpuInstance)
        self._check_privileged()
        ci = self._create_compute_instance(gi, profileId)
        return ctypes.cast(ci.ci_address, pynvml.c_nvmlComputeInstance_t)

    @_nvml()
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        gi = self._gpu_instance(gpuInstance)
        if self._ci_profile_allowed(gi, profileId) is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        count = self._out_uint(countRef)
        found = sorted(
            (ci for ci in gi.compute_instances.values() if ci.profile_id == profileId),
            key=lambda ci: ci.id,
        )
        if computeInstancesRef is not None:
            self._fill(
                computeInstancesRef,
                [ctypes.cast(ci.ci_address, pynvml.c_nvmlComputeInstance_t) for ci in found],
            )
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    @_nvml()
    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: Any, computeInstanceId: int
    ) -> Any:
        gi = self._gpu_instance(gpuInstance)
        ci = gi.compute_instances.get(computeInstanceId)
        if ci is None:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return ctypes.cast(ci.ci_address, pynvml.c_nvmlComputeInstance_t)

    @_nvml()
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        ci = self._compute_instance(computeInstance)
        gi = ci.gpu_instance
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._device_handle(gi.gpu.address)  # the parent GPU, as in nvml.h
        info.gpuInstance = ctypes.cast(gi.address, pynvml.c_nvmlGpuInstance_t)
        info.id = ci.id
        info.profileId = ci.profile_id
        info.placement = pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.slice_count)
        return info

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    @_nvml(mutates=True)
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        ci = self._compute_instance(computeInstance)
        self._check_privileged()
        self._remove_compute_instance(ci)
        return int(pynvml.NVML_SUCCESS)

    def _remove_compute_instance(self, ci: _ComputeInstance) -> None:
        del ci.gpu_instance.compute_instances[ci.id]
        del self._ci_by_address[ci.ci_address]
        del self._mig_by_address[ci.mig_address]

    # --- events -------------------------------------------------------------------------------

    @_nvml()
    def nvmlEventSetCreate(self) -> Any:
        event_set = _EventSet(address=self._new_address())
        self._event_sets[event_set.address] = event_set
        return ctypes.cast(event_set.address, pynvml.c_nvmlEventSet_t)

    def _event_set(self, handle: object) -> _EventSet:
        event_set = self._event_sets.get(self._address(handle))
        if event_set is None:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    @_nvml()
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        """The GPU recovery action (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, NVML of
        R565 on); any other field, or that one on an older branch, answers NOT_SUPPORTED
        in its own entry, as NVML reports each field's outcome apart. (Which code an
        older driver gives field 230 is not documented; NOT_SUPPORTED is assumed.)"""
        gpu = self._gpu(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for value, field_id in zip(values, fieldIds, strict=True):
            value.fieldId = int(field_id)
            value.timestamp = time.time_ns() // 1000
            known = (
                field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
                and self._profile.branch >= RECOVERY_ACTION_SINCE
            )
            if not known:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            value.nvmlReturn = pynvml.NVML_SUCCESS
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            value.value.uiVal = gpu.recovery_action
        return values

    @_nvml()
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        mask = gpu.product.supportedEventTypes
        if gpu.product.mig is not None:
            mask |= pynvml.nvmlEventMigConfigChange
        return mask

    @_nvml()
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._gpu(handle)
        event_set = self._event_set(eventSet)
        supported = gpu.product.supportedEventTypes
        if gpu.product.mig is not None:
            supported |= pynvml.nvmlEventMigConfigChange
        if not isinstance(eventTypes, int) or eventTypes <= 0:
            raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # nvml.h: invalid types
        if eventTypes & ~supported:
            raise _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.gpus[gpu.index] = event_set.gpus.get(gpu.index, 0) | eventTypes

    @_nvml(counted=False)
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Events in the order they happened; GPU_IS_LOST for as long as a GPU registered
        in the set is lost, not once.

        nvml.h gives GPU_IS_LOST "if a GPU has fallen off the bus", a state that lasts
        until the GPU is reset. NVIDIA's own mock NVML (k8s-test-infra, PR 746) answers
        it from every wait while a GPU is lost, at once, without waiting out the
        timeout, "the same as a real driver after Xid 79"; an event still pending is
        handed out first. So does this wait: the events queued before it (the loss
        itself among them, in its place) come out first, then GPU_IS_LOST at once, wait
        after wait. Unlike that mock, which knows no registrations, only a lost GPU
        registered in this set counts: a set built again without it waits as usual,
        which is how a client keeps hearing from the GPUs that still answer.
        """
        event_set = self._event_set(eventSet)
        deadline = time.monotonic() + max(timeoutms, 0) / 1000
        while not event_set.queue:
            if any(self._gpus[index].lost for index in event_set.gpus):
                raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            self._cond.wait(remaining)
            if event_set.address not in self._event_sets:
                raise _nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        event = event_set.queue.popleft()
        if event.lost:
            raise _nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        data = pynvml.c_nvmlEventData_t()
        data.device = self._device_handle(event.gpu.address)
        data.eventType = event.event_type
        data.eventData = event.data
        data.gpuInstanceId = event.gpu_instance_id
        data.computeInstanceId = event.compute_instance_id
        return data

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @_nvml()
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet)
        del self._event_sets[event_set.address]
        self._cond.notify_all()
