"""Choose the NVML the driver talks to: libnvidia-ml through `pynvml`, or the emulator.

Everything above this package (discovery, health, MIG management) calls NVML functions
by their pynvml names on an `NvmlLibrary`. `load_nvml("real")` hands out the `pynvml`
module itself; `load_nvml("emulated:<profile>")` an `NvmlEmulator` that answers the same
calls with the same types and errors, so the driver's NVML code path runs unchanged in
tests, demos and benchmarks.

pynvml opens libnvidia-ml by its soname, through this process's dynamic linker, which
does not search a driver root seen elsewhere (the chart's container mounts it under
`/host`). `preload_nvml` opens the driver root's library by its full path first.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpudra.driver.driverroot import NVML_LIBRARY, DriverRoot
from gpudra.driver.nvml.emulator import (
    NvmlEmulator,
    ProfileError,
    builtin_profile_names,
    load_builtin_profile,
    load_profile_file,
)

__all__ = [
    "DriverNvml",
    "NvmlEmulator",
    "NvmlLibrary",
    "NvmlLoadError",
    "ProfileError",
    "builtin_profile_names",
    "labelled_nvml",
    "load_nvml",
    "preload_nvml",
]

log = logging.getLogger(__name__)

_EMULATED = "emulated:"


class NvmlLoadError(RuntimeError):
    """The requested NVML cannot be provided; the message says what to fix."""


class NvmlLibrary(Protocol):
    """The NVML entry points gpudra uses, spelled and shaped as in `pynvml`.

    Handles and ctypes out-parameters are typed `Any` because pynvml itself is untyped;
    return values are pynvml's own structures. Errors are `pynvml.NVMLError` subclasses.
    """

    @property
    def nvmlLib(self) -> Any:
        """libnvidia-ml itself (pynvml's ctypes CDLL once initialised), for an entry
        point read past pynvml's wrapper (`gpudra.driver.nvml.unrepairable`)."""

    def nvmlInit(self) -> None: ...
    def nvmlInitWithFlags(self, flags: int) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int: ...
    def nvmlSystemGetNVMLVersion(self) -> str: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str) -> Any: ...
    def nvmlDeviceGetIndex(self, handle: Any) -> int: ...
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int: ...
    def nvmlDeviceGetBrand(self, handle: Any) -> int: ...
    def nvmlDeviceGetArchitecture(self, device: Any) -> int: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any: ...
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int: ...
    def nvmlDeviceGetAddressingMode(self, device: Any) -> int: ...
    def nvmlDeviceGetAttributes_v2(self, device: Any) -> Any: ...
    def nvmlDeviceGetAttributes(self, device: Any) -> Any: ...
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int: ...
    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None: ...
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]: ...
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any: ...
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any: ...
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any: ...
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int: ...
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Any, profile: int, version: int = 2
    ) -> Any: ...
    def nvmlDeviceGetGpuInstanceProfileInfoV(
        self, device: Any, profile: int, version: int = 2
    ) -> Any: ...
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any: ...
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int: ...
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int: ...
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any: ...
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: Any, profileId: int, placement: Any
    ) -> Any: ...
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int: ...
    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int: ...
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any: ...
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any: ...
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any: ...
    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any: ...
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: Any, profileId: int
    ) -> int: ...
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any: ...
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int: ...
    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: Any, computeInstanceId: int
    ) -> Any: ...
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any: ...
    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any: ...
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetSamples(
        self, device: Any, sampling_type: int, timeStamp: int
    ) -> tuple[int, list[Any]]: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int: ...
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any: ...
    def nvmlGpmSampleAlloc(self) -> Any: ...
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None: ...
    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any: ...
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None: ...
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any: ...
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any: ...
    def nvmlEventSetFree(self, eventSet: Any) -> None: ...


def _real_nvml() -> NvmlLibrary:
    """The `pynvml` module, without loading libnvidia-ml yet.

    A node whose driver is missing, not loaded yet or too old is not a reason to exit:
    discovery says what it found and which branch it needs (`devices.discover`), the
    agent publishes nothing and retries, and picks the driver up once it is there.
    """
    try:
        pynvml: Any = importlib.import_module("pynvml")
    except ImportError as err:  # pragma: no cover - nvidia-ml-py is a dependency
        msg = "the pynvml module (package nvidia-ml-py) is not installed"
        raise NvmlLoadError(msg) from err
    library: NvmlLibrary = pynvml
    return library


@dataclass(frozen=True, slots=True)
class DriverNvml:
    """libnvidia-ml as `preload_nvml` loaded it from the driver root: its path, and the
    handle, which whoever runs the agent holds for as long as NVML is used."""

    path: Path
    library: ctypes.CDLL


def preload_nvml(root: DriverRoot) -> DriverNvml | None:
    """Load the driver root's `libnvidia-ml.so.1` by its full path, before pynvml's
    first `nvmlInit` asks the linker for the bare soname.

    The dynamic linker hands a request for a soname the object already loaded under
    that soname, so pynvml (discovery, health events and sampling alike: one module
    per process) then talks to the driver root's NVML. Loaded with RTLD_GLOBAL, as a
    library the linker found itself would be. None where the root holds no NVML, or
    where it does not load (logged), and where the root is this process's `/` (the
    linker's own search, as before): pynvml then looks on the linker's own path, and
    discovery names what is missing.
    """
    if root.seen == Path("/"):
        return None  # the linker's own search covers this process's `/`
    path = root.library(NVML_LIBRARY)
    where = {"driver_root": str(root.path), "seen_at": str(root.seen)}
    if path is None:
        log.info(
            "no NVML library under the driver root; using the linker's search path",
            extra={"fields": {**where, "library": NVML_LIBRARY}},
        )
        return None
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        log.warning(
            "NVML library under the driver root does not load",
            extra={"fields": {**where, "path": str(path), "error": str(err)}},
        )
        return None
    log.info("NVML library loaded", extra={"fields": {**where, "path": str(path)}})
    return DriverNvml(path, library)


def load_nvml(
    spec: str,
    *,
    uuid_salt: str | None = None,
    state_path: Path | None = None,
    script_path: Path | None = None,
) -> NvmlLibrary:
    """Return the NVML named by `spec`.

    - `"real"`: the `pynvml` module; libnvidia-ml is loaded by the first `nvmlInit`.
    - `"emulated:<name>"`: an emulator with a built-in product profile.
    - `"emulated:<path.json>"`: an emulator with a profile or recording from a file.

    `uuid_salt` (emulated only) derives distinct GPU UUIDs, so many simulated nodes
    from one profile do not share UUIDs. `state_path` (emulated only) keeps the
    GPUs' MIG instances and modes in a file across processes, as a real GPU does.
    `script_path` (emulated only) is a telemetry script file that another process
    may write (see `gpudra.driver.nvml.series`).
    """
    if spec == "real":
        if state_path is not None or script_path is not None:
            msg = "a state or script file is for emulated GPUs only; a real GPU has its own"
            raise NvmlLoadError(msg)
        return _real_nvml()
    if not spec.startswith(_EMULATED):
        msg = f"unknown NVML {spec!r}: use 'real', 'emulated:<profile>' or 'emulated:<file.json>'"
        raise NvmlLoadError(msg)
    target = spec.removeprefix(_EMULATED)
    if not target:
        msg = f"'emulated:' needs a profile; known profiles: {', '.join(builtin_profile_names())}"
        raise NvmlLoadError(msg)
    if target.endswith(".json") or "/" in target:
        path = Path(target)
        return NvmlEmulator(
            load_profile_file(path),
            uuid_salt=uuid_salt,
            source=str(path),
            state_path=state_path,
            script_path=script_path,
        )
    return NvmlEmulator(
        load_builtin_profile(target),
        uuid_salt=uuid_salt,
        source=target,
        state_path=state_path,
        script_path=script_path,
    )


def labelled_nvml(spec: str, *, label: str, node: str, labels: Mapping[str, str]) -> str:
    """The NVML `node` runs: `emulated:<value>` when it carries `label`, else `spec`.

    A per-node choice of emulated product, set where platform teams already describe
    nodes: kind's cluster config (`nodes[].labels`), a cloud node pool's labels, `kubectl
    label`. One chart then gives an H100 node with MIG and an L4 node each their own
    GPUs, and nodes without the label keep the chart-wide `spec`. Only built-in profile
    names are accepted (a label value cannot hold a path), and only with an emulated
    `spec`: the chart runs emulated agents unprivileged and without the host's driver,
    so a label must not turn a real-GPU node's agent emulated or the other way round.
    """
    flag = f"--emulated-profile-label {label}"
    if not spec.startswith(_EMULATED):
        msg = (
            f"{flag} needs --nvml emulated:<profile> (the profile of nodes without the "
            f"label), not --nvml {spec}; drop the label flag to use the real GPUs"
        )
        raise NvmlLoadError(msg)
    value = labels.get(label)
    if value is None:
        return spec
    known = builtin_profile_names()
    if value not in known:
        msg = (
            f"node {node} has label {label}={value!r} ({flag}), which names no emulated "
            f"profile: set it to one of {', '.join(known)} (kubectl label node {node} "
            f"{label}=<profile> --overwrite), or remove it to use --nvml {spec}"
        )
        raise NvmlLoadError(msg)
    return f"{_EMULATED}{value}"
