"""Preparing and unpreparing claims on this node: the device layer of the kubelet plugin.

The kubelet sends only a claim's namespace, name and UID, so each prepare reads the
ResourceClaim, checks that it is the claim the kubelet means (same UID) and that it
is allocated, keeps the results of this driver in this node's pool, resolves their
opaque configs (class configs before claim configs, strictly validated) and then
sets the devices up: dynamic MIG instances, time-slicing, an MPS daemon, and one CDI
spec file per claim whose device IDs go back to the kubelet.

Crash safety comes from the checkpoint: a prepare starts by recording the planned
devices (which is also where a device held by another claim is refused), records
each side effect before or right after making it, and only then marks the claim
prepared. Whatever a crash or a failed step leaves behind is undone from that
record: at once on failure, at the next prepare of the claim, or by `recover()` at
start. Undo steps are idempotent, so undoing twice is harmless.

Concurrency: checkpoint changes go through one `GroupCommit`, so claims prepared at
the same time share checkpoint writes instead of queueing for one fsync each; a
per-claim lock keeps two calls for the same claim (a kubelet retry, a cleanup) from
interleaving while different claims proceed in parallel. NVML calls, tools and file
I/O run in worker threads so the event loop keeps answering the kubelet.

Nothing here knows gRPC or HTTP; the protocol layer calls `prepare`/`unprepare`
(see `gpudra.driver.plugin.ClaimHandler`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import pynvml
from gpudra.api.config import (
    BoundConfig,
    ConfigError,
    DeviceConfig,
    GpuConfig,
    MpsConfig,
    bound_configs,
    interval_value,
    join_path,
    resolve_config,
)
from gpudra.api.config import (
    DeviceType as ConfigDeviceType,
)
from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.common.kube import ApiError, Kube, claim_path
from gpudra.driver.cdi import (
    CdiError,
    CdiSpecStore,
    ContainerEdits,
    DeviceNode,
    DeviceNumbers,
    Mount,
    ToolkitSpec,
    driver_common_edits,
    numbered,
    validate_claim_uid,
)
from gpudra.driver.cdi import PreparedDevice as CdiDevice
from gpudra.driver.checkpoint import (
    DEFAULT_BOOT_ID_PATH,
    Checkpoint,
    ClaimRecord,
    DeviceConflictError,
    DeviceRecord,
    GroupCommit,
)
from gpudra.driver.checkpoint import load as load_checkpoint
from gpudra.driver.claims import ClaimRef
from gpudra.driver.devices import Device, DeviceType, Gpu, Inventory, MigPlacement, MigStrategy
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.nvml.emulator import describe_nvml_error
from gpudra.driver.plugin import PreparedDevice, PrepareResult
from gpudra.driver.sharing import MpsDaemon, SharingBackend
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "ALLOCATION_CONFIG_PATH",
    "MPS_PIPE_DIR_IN_CONTAINER",
    "PREPARE_STEPS",
    "ClaimPreparer",
    "MigError",
    "RecoveryReport",
    "mig_capability_minors",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ALLOCATION_CONFIG_PATH: Final = "status.allocation.devices.config"
MPS_PIPE_DIR_IN_CONTAINER: Final = "/tmp/nvidia-mps"
_RW_BIND: Final = ("rw", "nosuid", "nodev", "rbind", "rprivate")
_DNS_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN: Final = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_ENV_UNSAFE: Final = re.compile(r"[^A-Za-z0-9]")
_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 10.0)
# The kernel driver numbers MIG capabilities in a fixed table
# (/proc/driver/nvidia-caps/mig-minors): config 1, monitor 2, then for every GPU minor
# 15 GPU instances, each an access capability followed by 8 compute instances.
_MIB: Final = 1024 * 1024
_MIG_FIRST_MINOR: Final = 3
_MIG_GPU_INSTANCES: Final = 15
_MIG_COMPUTE_INSTANCES: Final = 8
_NOT_FOUND: Final = frozenset({pynvml.NVML_ERROR_NOT_FOUND})
_SKIP_PROFILE: Final = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT}
)


class _ClaimFailure(Exception):
    """A per-claim failure; the message goes to the kubelet (and the pod's events)."""


class MigError(RuntimeError):
    """An NVML MIG operation failed; the message names the GPU and the step."""


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What `recover()` found and did; `errors` lists what is left for a later try."""

    rolled_back: tuple[str, ...] = ()
    previous_boot: tuple[str, ...] = ()
    orphaned_specs: tuple[str, ...] = ()
    orphaned_mps_dirs: tuple[str, ...] = ()
    temp_files: int = 0
    errors: tuple[str, ...] = ()


# The points of a prepare, in order, at which a fault hook runs: each follows a
# durable step (a checkpoint write or a side effect), so a crash there is one the
# recovery code must handle. Steps a claim does not need are skipped.
PREPARE_STEPS: Final = (
    "prepare-started",
    "mig-recorded",
    "mig-gpu-instance-created",
    "mig-created",
    "time-slice-recorded",
    "time-slice-applied",
    "compute-mode-recorded",
    "compute-mode-applied",
    "mps-recorded",
    "mps-started",
    "cdi-written",
    "prepare-completed",
)


# --- MIG capability device nodes -------------------------------------------------------


def _cap_file(path: Path) -> tuple[int, int | None] | None:
    """(DeviceFileMinor, DeviceFileMode) of a /proc capability file, None if unreadable."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    minor: int | None = None
    mode: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        with contextlib.suppress(ValueError):
            if key.strip() == "DeviceFileMinor":
                minor = int(value.strip())
            elif key.strip() == "DeviceFileMode":
                mode = int(value.strip())
    return None if minor is None else (minor, mode)


def _minors_table(proc_root: Path) -> dict[str, int]:
    try:
        text = (proc_root / "driver/nvidia-caps/mig-minors").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return {}
    table: dict[str, int] = {}
    for line in text.splitlines():
        name, _, number = line.strip().rpartition(" ")
        if name and number.isdigit():
            table[name] = int(number)
    return table


def mig_capability_minors(
    proc_root: Path, gpu_minor: int, gi: int, ci: int
) -> tuple[tuple[int, int | None], tuple[int, int | None]]:
    """Minors (and file modes, when known) of the GI and CI access capabilities.

    Read from `<proc>/driver/nvidia/capabilities/gpu<minor>/mig/gi<gi>[/ci<ci>]/access`
    (`DeviceFileMinor:`), as the kernel driver publishes them; else from
    `<proc>/driver/nvidia-caps/mig-minors`; else computed from the fixed layout of
    that table (3 + minor*135 + gi*9, the CI capabilities following their GI). The
    layout has been stable since MIG appeared (R450), so the fallback gives the right
    node when /proc is not mounted into the plugin.
    """
    base = proc_root / "driver/nvidia/capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gi}"
    gi_cap = _cap_file(base / "access")
    ci_cap = _cap_file(base / f"ci{ci}" / "access")
    if gi_cap is None or ci_cap is None:
        table = _minors_table(proc_root)
        gi_name = f"gpu{gpu_minor}/gi{gi}/access"
        ci_name = f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"
        first = (
            _MIG_FIRST_MINOR
            + gpu_minor * _MIG_GPU_INSTANCES * (1 + _MIG_COMPUTE_INSTANCES)
            + gi * (1 + _MIG_COMPUTE_INSTANCES)
        )
        if gi_cap is None:
            gi_cap = (table.get(gi_name, first), None)
        if ci_cap is None:
            ci_cap = (table.get(ci_name, first + 1 + ci), None)
    return gi_cap, ci_cap


def _caps_major(proc_root: Path) -> int | None:
    """The character major of `nvidia-caps` from /proc/devices, if readable."""
    try:
        text = (proc_root / "devices").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        number, _, name = line.strip().partition(" ")
        if name.strip() == "nvidia-caps" and number.isdigit():
            return int(number)
    return None


# --- NVML: MIG instances and compute mode ----------------------------------------------


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


@contextlib.contextmanager
def _nvml_open(nvml: NvmlLibrary) -> Iterator[None]:
    """NVML counts init/shutdown, so a caller that initialised NVML itself is unaffected."""
    nvml.nvmlInit()
    try:
        yield
    finally:
        try:
            nvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.warning("nvmlShutdown failed", extra={"fields": {"error": str(err)}})


def _mig_error(step: str, gpu_uuid: str, err: BaseException) -> MigError:
    return MigError(f"{step} on GPU {gpu_uuid}: {describe_nvml_error(err)}")


def _create_gpu_instance(nvml: NvmlLibrary, gpu_uuid: str, placement: MigPlacement) -> int:
    """Create the GPU instance at exactly the allocated placement; returns its ID."""
    step = (
        f"creating MIG GPU instance {placement.profile} (profile ID {placement.profile_id}) "
        f"at memory slice {placement.start}"
    )
    with _nvml_open(nvml):
        try:
            parent = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                parent, placement.profile_id, ctypes.byref(where)
            )
            return int(nvml.nvmlGpuInstanceGetInfo(gi).id)
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err) from err


def _mig_uuid(nvml: NvmlLibrary, parent: Any, gi_id: int, ci_id: int) -> str | None:
    for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
        except pynvml.NVMLError as err:
            if _code(err) in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        if (
            int(nvml.nvmlDeviceGetGpuInstanceId(handle)) == gi_id
            and int(nvml.nvmlDeviceGetComputeInstanceId(handle)) == ci_id
        ):
            return str(nvml.nvmlDeviceGetUUID(handle))
    return None


def _create_compute_instance(nvml: NvmlLibrary, gpu_uuid: str, gi_id: int) -> tuple[int, str]:
    """One compute instance spanning the whole GPU instance; returns (CI ID, MIG UUID)."""
    step = f"creating the compute instance in MIG GPU instance {gi_id}"
    with _nvml_open(nvml):
        try:
            parent = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            gi = nvml.nvmlDeviceGetGpuInstanceById(parent, gi_id)
            gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            slices = int(
                nvml.nvmlDeviceGetGpuInstanceProfileInfoById(parent, gi_info.profileId).sliceCount
            )
            ci_profile: int | None = None
            for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                    )
                except pynvml.NVMLError as err:
                    if _code(err) in _SKIP_PROFILE:
                        continue
                    raise
                if int(info.sliceCount) == slices:
                    ci_profile = int(info.id)
                    break
            if ci_profile is None:
                raise MigError(f"{step} on GPU {gpu_uuid}: no compute profile of {slices} slices")
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
            ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
            uuid = _mig_uuid(nvml, parent, gi_id, ci_id)
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err) from err
    if uuid is None:
        raise MigError(f"{step} on GPU {gpu_uuid}: NVML lists no MIG device for GI {gi_id}")
    return ci_id, uuid


def _find_gpu_instance(nvml: NvmlLibrary, parent: Any, mig: Mapping[str, Any]) -> Any | None:
    """The GPU instance a record describes, matched on profile and placement (and ID
    when recorded), so an instance someone else made in between is never touched."""
    profile_id = int(mig["profileId"])
    start = int(mig["start"])
    if mig.get("gi") is not None:
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(parent, int(mig["gi"]))
        except pynvml.NVMLError as err:
            if _code(err) in _NOT_FOUND:
                return None
            raise
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        if int(info.profileId) == profile_id and int(info.placement.start) == start:
            return gi
        return None
    capacity = int(nvml.nvmlDeviceGetGpuInstanceProfileInfoById(parent, profile_id).instanceCount)
    found = (pynvml.c_nvmlGpuInstance_t * max(capacity, 1))()
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstances(parent, profile_id, found, ctypes.byref(count))
    for gi in found[: count.value]:
        if int(nvml.nvmlGpuInstanceGetInfo(gi).placement.start) == start:
            return gi
    return None


def _destroy_compute_instances(nvml: NvmlLibrary, gi: Any) -> None:
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError as err:
            if _code(err) in _SKIP_PROFILE:
                continue
            raise
        found = (pynvml.c_nvmlComputeInstance_t * max(int(info.instanceCount), 1))()
        count = ctypes.c_uint(0)
        nvml.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), found, ctypes.byref(count))
        for ci in found[: count.value]:
            nvml.nvmlComputeInstanceDestroy(ci)


def _destroy_mig(nvml: NvmlLibrary, gpu_uuid: str, mig: Mapping[str, Any]) -> bool:
    """Destroy the compute instances, then the GPU instance; False if it was gone."""
    step = f"destroying MIG GPU instance {mig.get('gi', '?')} (profile {mig.get('profileId')})"
    with _nvml_open(nvml):
        try:
            parent = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            gi = _find_gpu_instance(nvml, parent, mig)
            if gi is None:
                return False
            _destroy_compute_instances(nvml, gi)
            nvml.nvmlGpuInstanceDestroy(gi)
        except pynvml.NVMLError as err:
            raise _mig_error(step, gpu_uuid, err) from err
    return True


def _get_compute_mode(nvml: NvmlLibrary, gpu_uuid: str) -> int:
    with _nvml_open(nvml):
        try:
            return int(nvml.nvmlDeviceGetComputeMode(nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)))
        except pynvml.NVMLError as err:
            raise _mig_error("reading the compute mode", gpu_uuid, err) from err


def _set_compute_mode(nvml: NvmlLibrary, gpu_uuid: str, mode: int) -> None:
    with _nvml_open(nvml):
        try:
            nvml.nvmlDeviceSetComputeMode(nvml.nvmlDeviceGetHandleByUUID(gpu_uuid), mode)
        except pynvml.NVMLError as err:
            raise _mig_error(f"setting compute mode {mode}", gpu_uuid, err) from err


# --- planning ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    """One allocation result of the claim being prepared; `details` is what the
    checkpoint keeps for undo and for answering a repeated prepare."""

    index: int
    request: str
    gpu: Gpu
    device: Device
    config: DeviceConfig
    config_path: str
    admin: bool
    share_id: str | None
    consumed_memory: int | None
    details: dict[str, Any]
    create_mig: bool = False
    mps: bool = False
    time_slice: int | None = None
    cdi_ids: tuple[str, ...] = ()

    @property
    def base_request(self) -> str:
        return self.request.split("/", 1)[0]

    @property
    def uuid(self) -> str | None:
        value = self.details.get("uuid")
        return value if isinstance(value, str) else None

    @property
    def cdi_name(self) -> str:
        return self.device.name if self.share_id is None else f"{self.device.name}-{self.share_id}"

    def record(self, pool: str) -> DeviceRecord:
        return DeviceRecord(
            pool=pool,
            device=self.device.name,
            request_names=(self.base_request,),
            cdi_device_ids=self.cdi_ids,
            share_id=self.share_id,
            admin_access=self.admin,
            exclusive=self.share_id is None,
            details=self.details,
        )


def _whole_memory(entry: _Entry) -> bool:
    """The allocation consumed the GPU's whole memory."""
    total = entry.device.capacity.get("memory")
    return (
        entry.consumed_memory is not None and total is not None and entry.consumed_memory >= total
    )


def _describe(ref: ClaimRef) -> str:
    return f"ResourceClaim {ref.namespace}/{ref.name} ({ref.uid})"


def _config_issues(ref: ClaimRef, err: ConfigError) -> str:
    issues = "; ".join(str(issue) for issue in err.issues)
    return (
        f"{_describe(ref)}: invalid opaque config: {issues}; fix the parameters in the "
        "claim's spec.devices.config or in the DeviceClass's spec.config (the allocation "
        "copies them)"
    )


def _config_path(
    config: DeviceConfig, class_configs: Sequence[BoundConfig], claim_configs: Sequence[BoundConfig]
) -> str:
    for bound in (*class_configs, *claim_configs):
        if bound.config is config:
            return bound.path
    return ""


def _pod_name(claim: Mapping[str, Any]) -> str:
    """The first Pod the claim is reserved for: the kubelet does not tell us the pod."""
    for consumer in (claim.get("status") or {}).get("reservedFor") or ():
        if (
            isinstance(consumer, Mapping)
            and consumer.get("resource") == "pods"
            and not consumer.get("apiGroup")
        ):
            return str(consumer.get("name") or "")
    return ""


def _sharing_of(config: DeviceConfig) -> tuple[bool, int | None, MpsConfig | None]:
    """(uses MPS, time-slice value or None, MPS settings) of a resolved config."""
    sharing = config.sharing
    if sharing is None:
        return False, None, None
    if sharing.strategy == "MPS":
        return True, None, sharing.mps_config
    if isinstance(config, GpuConfig) and config.sharing is not None:
        interval = config.sharing.effective_interval()
        return False, None if interval is None else interval_value(interval), None
    return False, None, None  # MIG devices have no time-slice setting


def _result_from_record(record: ClaimRecord) -> PrepareResult:
    return PrepareResult(
        devices=[
            PreparedDevice(
                request_names=list(d.request_names),
                pool_name=d.pool,
                device_name=d.device,
                cdi_device_ids=list(d.cdi_device_ids),
                share_id=d.share_id,
            )
            for d in record.devices
        ]
    )


def _env_key(name: str) -> str:
    return _ENV_UNSAFE.sub("_", name).upper()


# --- metrics ------------------------------------------------------------------------------


class _Metrics:
    def __init__(
        self, registry: CollectorRegistry, prepared: Callable[[], Checkpoint | None], pool: str
    ) -> None:
        self.operations = Counter(
            "gpudra_claim_operations",
            "Claims the kubelet asked to prepare or unprepare.",
            ["operation"],
            registry=registry,
        )
        self.errors = Counter(
            "gpudra_claim_operation_errors",
            "Claims whose prepare or unprepare failed.",
            ["operation"],
            registry=registry,
        )
        self.latency = Histogram(
            "gpudra_claim_operation_duration_seconds",
            "Time to prepare or unprepare one claim, including reading it from the API.",
            ["operation"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_PreparedDevices(prepared, pool))
        # Labelled once (this also exports zeros before the first call): a lookup per
        # claim would cost a lock and a label check each time.
        self.prepare = _OpMetrics(self, "prepare")
        self.unprepare = _OpMetrics(self, "unprepare")


class _OpMetrics:
    """The per-claim metrics of one operation."""

    def __init__(self, metrics: _Metrics, operation: str) -> None:
        self.operations = metrics.operations.labels(operation)
        self.errors = metrics.errors.labels(operation)
        self.latency = metrics.latency.labels(operation)


_INFO_LABELS: Final = ("namespace", "pod", "claim", "request", "device", "uuid")


class _PreparedDevices(Collector):
    """The prepared devices, read from the checkpoint when scraped.

    Kept per claim in labelled children instead, every prepare and unprepare would
    create and drop metric objects; a scrape reads the same state far less often.
    The scrape runs in the metrics server's thread: it only reads the checkpoint's
    claims, which are replaced, never changed in place.
    """

    def __init__(self, prepared: Callable[[], Checkpoint | None], pool: str) -> None:
        self._prepared = prepared
        self._pool = pool

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        cp = self._prepared()
        yield from self._families(cp.claims() if cp is not None else ())

    def _families(self, claims: Iterable[ClaimRecord] = ()) -> tuple[Metric, Metric]:
        info = InfoMetricFamily(
            "gpudra_prepared_device",
            "A device prepared for a claim; pod is the first pod the claim is reserved for.",
            labels=_INFO_LABELS,
        )
        holders: dict[str, set[str]] = {}
        for record in claims:
            if not record.completed:
                continue
            for device in record.devices:
                if device.pool == self._pool:
                    holders.setdefault(device.device, set()).add(record.uid)
                details = device.details
                for request in device.request_names or ("",):
                    labels = (
                        record.namespace,
                        str(details.get("pod") or ""),
                        record.name,
                        request,
                        device.device,
                        str(details.get("uuid") or ""),
                    )
                    info.add_metric(labels, {})
        per_device = GaugeMetricFamily(
            "gpudra_device_prepared_claims",
            "Prepared claims holding each device (more than one: shared or admin access).",
            labels=("device",),
        )
        for name, uids in sorted(holders.items()):
            per_device.add_metric((name,), len(uids))
        return info, per_device


# --- the preparer -------------------------------------------------------------------------


@dataclass(slots=True)
class _Guard:
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


class ClaimPreparer:
    """Prepares and unprepares claims of one driver on one node (a `ClaimHandler`).

    `inventory` is the node's discovered devices, or a callable returning the
    current one (None until the first discovery). `mig_strategy` must be the view
    the slices are published with, so that a device name means here what it meant
    to the scheduler. `state_dir` (default: the checkpoint's folder) holds the
    per-claim MPS pipe and log folders; it must be a host path that this process
    sees at the same path, because the container runtime mounts the pipe folder
    from there. `dev_root`, `driver_root` and `proc_root` are where the host's
    /dev, driver files and /proc are; `host_view` is where this process sees the
    host's `/`. `device_numbers` (emulated GPUs) numbers the device nodes in the
    specs, for hosts that lack them. Call `recover()` once before serving.
    """

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        kube: Kube,
        nvml: NvmlLibrary,
        inventory: Inventory | Callable[[], Inventory | None],
        cdi: CdiSpecStore,
        checkpoint_path: Path,
        sharing: SharingBackend,
        driver_root: Path = Path("/"),
        dev_root: Path = Path("/"),
        proc_root: Path = Path("/proc"),
        state_dir: Path | None = None,
        boot_id_path: Path = DEFAULT_BOOT_ID_PATH,
        driver_libraries: Sequence[str] = (),
        host_view: Path | None = Path("/"),
        toolkit: ToolkitSpec | None = None,
        mig_strategy: MigStrategy = MigStrategy.STATIC,
        registry: CollectorRegistry | None = None,
        api_timeout_s: float = 10.0,
        device_numbers: DeviceNumbers | None = None,
        fault: Callable[[str], None] | None = None,
    ) -> None:
        self._driver = driver_name
        self._fault = fault
        self._node = node_name
        self._kube = kube
        self._nvml = nvml
        self._inventory: Callable[[], Inventory | None] = (
            inventory if callable(inventory) else (lambda: inventory)
        )
        self._cdi = cdi
        self._checkpoint_path = checkpoint_path
        self._boot_id_path = boot_id_path
        self._sharing = sharing
        self._driver_root = driver_root
        self._dev_root = dev_root
        self._device_numbers = device_numbers
        self._proc_root = proc_root
        self._mps_root = (state_dir or checkpoint_path.parent) / "mps"
        self._libraries = tuple(driver_libraries)
        self._host_view = host_view
        self._toolkit = toolkit
        self._mig_strategy = mig_strategy
        self._api_timeout_s = api_timeout_s
        self._metrics = _Metrics(
            registry if registry is not None else CollectorRegistry(),
            lambda: self._commit.checkpoint if self._commit is not None else None,
            node_name,
        )
        # Held while the checkpoint loads or is written, and while its temp files are swept.
        self._lock = anyio.Lock()
        self._guards: dict[str, _Guard] = {}
        self._commit: GroupCommit | None = None
        self._common: ContainerEdits | None = None

    # --- plumbing ---

    async def _checkpoint(self) -> Checkpoint:
        """Loaded once; afterwards the in-memory copy is authoritative (it is written
        through on every change), so no prepare re-reads the file."""
        return (await self._committer()).checkpoint

    async def _committer(self) -> GroupCommit:
        if self._commit is None:
            async with self._lock:
                if self._commit is None:
                    cp = await anyio.to_thread.run_sync(
                        functools.partial(
                            load_checkpoint, self._checkpoint_path, boot_id_path=self._boot_id_path
                        )
                    )
                    self._commit = GroupCommit(cp, lock=self._lock)
        return self._commit

    async def _persist(self, change: Callable[[Checkpoint], T]) -> T:
        """Apply a checkpoint change; returns once it is on disk."""
        return await (await self._committer()).apply(change)

    @contextlib.asynccontextmanager
    async def _guard(self, uid: str) -> AsyncIterator[None]:
        guard = self._guards.get(uid)
        if guard is None:
            guard = self._guards[uid] = _Guard()
        guard.users += 1
        try:
            async with guard.lock:
                yield
        finally:
            guard.users -= 1
            if guard.users == 0:
                del self._guards[uid]

    def _mps_dirs(self, uid: str) -> tuple[Path, Path]:
        base = self._mps_root / validate_claim_uid(uid)
        return base / "pipe", base / "log"

    def _node_path(self, path: str) -> DeviceNode:
        host = None if self._dev_root == Path("/") else str(self._dev_root / path.lstrip("/"))
        numbers = self._device_numbers(path) if self._device_numbers is not None else None
        return numbered(path, host, numbers)

    async def _cdi_io(self, fn: Callable[[], T]) -> T:
        """Run a CDI spec write or removal.

        Specs that are not fsynced (the default: the CDI root is a tmpfs) cost a few
        small syscalls, less than the hand-off to a worker thread and back, so they
        run right here; fsynced ones wait for the disk in a worker thread.
        """
        if self._cdi.durable:
            return await anyio.to_thread.run_sync(fn)
        return fn()

    def _at(self, step: str) -> None:
        """A named point of a prepare, where tests inject crashes (see `PREPARE_STEPS`)."""
        if self._fault is not None:
            self._fault(step)

    # --- the ClaimHandler interface ---

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare each claim on its own: one claim's failure is only its error."""
        if len(claims) == 1:
            return {claims[0].uid: await self._prepare_timed(claims[0])}
        results: dict[str, PrepareResult] = {}

        async def one(ref: ClaimRef) -> None:
            results[ref.uid] = await self._prepare_timed(ref)

        async with anyio.create_task_group() as group:
            for ref in claims:
                group.start_soon(one, ref)
        return results

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        """Undo each claim's devices; an unknown claim is already unprepared."""
        if len(claims) == 1:
            return {claims[0].uid: await self._unprepare_timed(claims[0])}
        results: dict[str, str | None] = {}

        async def one(ref: ClaimRef) -> None:
            results[ref.uid] = await self._unprepare_timed(ref)

        async with anyio.create_task_group() as group:
            for ref in claims:
                group.start_soon(one, ref)
        return results

    async def _prepare_timed(self, ref: ClaimRef) -> PrepareResult:
        started = time.perf_counter()
        metrics = self._metrics.prepare
        metrics.operations.inc()
        try:
            result = await self._prepare_claim(ref)
        except _ClaimFailure as exc:
            result = PrepareResult(error=str(exc))
        except Exception as exc:
            log.exception("prepare failed", extra={"fields": {"claim": ref.uid}})
            result = PrepareResult(
                error=f"{_describe(ref)}: prepare failed: {type(exc).__name__}: {exc}"
            )
        if result.error:
            metrics.errors.inc()
            log.warning(
                "claim not prepared",
                extra={"fields": {"claim": ref.uid, "error": result.error}},
            )
        metrics.latency.observe(time.perf_counter() - started)
        return result

    async def _unprepare_timed(self, ref: ClaimRef) -> str | None:
        started = time.perf_counter()
        metrics = self._metrics.unprepare
        metrics.operations.inc()
        error: str | None
        try:
            error = await self._unprepare_claim(ref)
        except _ClaimFailure as exc:
            error = str(exc)
        except Exception as exc:
            log.exception("unprepare failed", extra={"fields": {"claim": ref.uid}})
            error = f"{_describe(ref)}: unprepare failed: {type(exc).__name__}: {exc}"
        if error:
            metrics.errors.inc()
            log.warning(
                "claim not unprepared", extra={"fields": {"claim": ref.uid, "error": error}}
            )
        metrics.latency.observe(time.perf_counter() - started)
        return error

    # --- prepare ---

    @staticmethod
    def _check_ref(ref: ClaimRef) -> None:
        try:
            validate_claim_uid(ref.uid)
        except CdiError as exc:
            raise _ClaimFailure(f"claim {ref.namespace}/{ref.name}: {exc}") from None
        if not _DNS_LABEL.fullmatch(ref.namespace) or not _DNS_SUBDOMAIN.fullmatch(ref.name):
            raise _ClaimFailure(
                f"claim {ref.namespace!r}/{ref.name!r} ({ref.uid}): namespace must be a DNS "
                "label and name a DNS subdomain"
            )

    async def _prepare_claim(self, ref: ClaimRef) -> PrepareResult:
        self._check_ref(ref)
        async with self._guard(ref.uid):
            cp = await self._checkpoint()
            record = cp.get(ref.uid)
            if record is not None:
                if record.completed:
                    return _result_from_record(record)
                await self._undo(record, "rolling back an interrupted earlier prepare")
            claim = await self._fetch(ref)
            entries = self._plan(ref, claim, cp)
            planned = [e.record(self._node) for e in entries]
            # Only prepares that change the node beyond the CDI spec need the started
            # record on disk before they begin; see Checkpoint.begin_prepare.
            persist = any(e.create_mig or e.time_slice is not None or e.mps for e in entries)
            try:
                if persist:
                    await self._persist(lambda c: c.begin_prepare(ref, planned))
                else:
                    cp.begin_prepare(ref, planned, persist=False)  # memory only: no I/O
            except DeviceConflictError as exc:
                raise _ClaimFailure(
                    f"{_describe(ref)}: {exc}; that claim must be unprepared first (it is "
                    "cleaned up once its ResourceClaim is deleted)"
                ) from None
            self._at("prepare-started")
            try:
                devices = await self._setup(ref, cp, entries)
            except Exception as exc:
                message = f"{_describe(ref)}: {exc}"
                if isinstance(exc, ConfigError):
                    message = _config_issues(ref, exc)
                current = cp.get(ref.uid)
                if current is not None:
                    try:
                        await self._undo(current, "rolling back the failed prepare")
                    except _ClaimFailure as undo_exc:
                        message += (
                            f"; rolling back failed too (retried at the next prepare or "
                            f"restart): {undo_exc}"
                        )
                raise _ClaimFailure(message) from exc
            return PrepareResult(devices=devices)

    async def _fetch(self, ref: ClaimRef) -> Mapping[str, Any]:
        path = claim_path(ref.namespace, ref.name)
        try:
            claim = await self._kube.request("GET", path, request_timeout_s=self._api_timeout_s)
        except ApiError as exc:
            if exc.status == 404:
                raise _ClaimFailure(
                    f"{_describe(ref)} does not exist in the API server (deleted?); nothing "
                    "to prepare"
                ) from None
            raise _ClaimFailure(f"{_describe(ref)}: reading it failed: {exc}") from None
        except Exception as exc:
            raise _ClaimFailure(
                f"{_describe(ref)}: reading it from the API server failed: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(claim, Mapping):
            raise _ClaimFailure(f"{_describe(ref)}: the API server returned no object")
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise _ClaimFailure(
                f"ResourceClaim {ref.namespace}/{ref.name} has metadata.uid {uid}, but the "
                f"kubelet asked for UID {ref.uid}: the claim was deleted and re-created; the "
                "pod of the old claim must go before the new one can be prepared"
            )
        if not (claim.get("status") or {}).get("allocation"):
            raise _ClaimFailure(
                f"{_describe(ref)} has no status.allocation: it is not allocated (the "
                "scheduler allocates it when it schedules a pod that uses it)"
            )
        return claim

    def _lookup(self, inventory: Inventory, name: str) -> tuple[Gpu, Device] | None:
        """The device of `name` in the view the slices were published with."""
        for gpu in inventory.gpus:
            if gpu.device.name == name:
                return gpu, gpu.device
            if self._mig_strategy is MigStrategy.DYNAMIC:
                views: tuple[tuple[Device, ...], ...] = (gpu.partitions,)
            else:
                views = (gpu.mig_devices,)
            for view in views:
                for device in view:
                    if device.name == name:
                        return gpu, device
        return None

    def _plan(self, ref: ClaimRef, claim: Mapping[str, Any], cp: Checkpoint) -> list[_Entry]:
        allocation = claim["status"]["allocation"]
        section = allocation.get("devices") or {}
        results = section.get("results") or []
        ours = [
            (i, r)
            for i, r in enumerate(results)
            if isinstance(r, Mapping)
            and r.get("driver") == self._driver
            and r.get("pool") == self._node
        ]
        if not ours:
            raise _ClaimFailure(
                f"{_describe(ref)}: status.allocation.devices.results has no device of "
                f"driver {self._driver} in pool {self._node}; the claim was allocated for "
                "another node or driver"
            )
        entries_in = section.get("config") or []
        try:
            class_cfgs = bound_configs(
                entries_in, driver=self._driver, prefix=ALLOCATION_CONFIG_PATH, source="FromClass"
            )
            claim_cfgs = bound_configs(
                entries_in, driver=self._driver, prefix=ALLOCATION_CONFIG_PATH, source="FromClaim"
            )
        except ConfigError as exc:
            raise _ClaimFailure(_config_issues(ref, exc)) from None
        inventory = self._inventory()
        if inventory is None:
            raise _ClaimFailure(
                f"{_describe(ref)}: this node's GPUs have not been discovered yet; the "
                "kubelet retries the prepare"
            )
        pod = _pod_name(claim)
        entries: list[_Entry] = []
        for index, result in ours:
            entries.append(
                self._plan_entry(ref, cp, inventory, index, result, class_cfgs, claim_cfgs, pod)
            )
        names = [e.cdi_name for e in entries]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise _ClaimFailure(
                f"{_describe(ref)}: device {', '.join(duplicates)} is allocated twice to "
                "this claim without a shareID"
            )
        self._plan_mps(ref, entries)
        return entries

    def _plan_entry(
        self,
        ref: ClaimRef,
        cp: Checkpoint,
        inventory: Inventory,
        index: int,
        result: Mapping[str, Any],
        class_cfgs: Sequence[BoundConfig],
        claim_cfgs: Sequence[BoundConfig],
        pod: str,
    ) -> _Entry:
        where = f"status.allocation.devices.results[{index}]"
        request = str(result.get("request") or "")
        name = str(result.get("device") or "")
        found = self._lookup(inventory, name)
        if found is None:
            raise _ClaimFailure(
                f"{_describe(ref)}: {where}.device: {name!r} is not a device of this node "
                f"({self._node}); the ResourceSlice it was allocated from is stale: delete "
                "the pod so that the claim is allocated again"
            )
        gpu, device = found
        if device.type is DeviceType.GPU and gpu.mig_enabled:
            raise _ClaimFailure(
                f"{_describe(ref)}: {where}.device: GPU {name} has MIG mode enabled and "
                "cannot be used whole; request one of its MIG devices"
            )
        device_type: ConfigDeviceType = "gpu" if device.type is DeviceType.GPU else "mig"
        try:
            # The full "req/sub" name: a config may be bound to the subrequest itself.
            config = resolve_config(device_type, class_cfgs, claim_cfgs, request)
        except ConfigError as exc:
            raise _ClaimFailure(_config_issues(ref, exc)) from None
        share_id = result.get("shareID")
        entry = _Entry(
            index=index,
            request=request,
            gpu=gpu,
            device=device,
            config=config,
            config_path=_config_path(config, class_cfgs, claim_cfgs),
            admin=result.get("adminAccess") is True,
            share_id=str(share_id) if share_id else None,
            consumed_memory=self._consumed_memory(ref, where, result),
            details={
                "type": device_type,
                "request": request,
                "parentUuid": gpu.uuid,
                "gpuMinor": gpu.minor,
                "uuid": device.uuid,
                "pod": pod,
            },
        )
        if device.type is DeviceType.MIG:
            self._plan_mig(ref, cp, where, entry)
        if entry.admin:
            return entry  # monitoring beside the owner: nothing on the device changes
        uses_mps, time_slice, _ = _sharing_of(config)
        # A share that consumed all of the GPU's memory (a plain claim: the request
        # policy defaults to the whole memory) leaves no room for another claim, so it
        # holds the GPU alone, as an exclusive claim does.
        sliced = entry.share_id is not None and not _whole_memory(entry)
        if time_slice is not None and sliced:
            raise _ClaimFailure(
                f"{_describe(ref)}: {join_path(entry.config_path, 'sharing.strategy')}: "
                f"TimeSlicing cannot apply to {where} (shareID {entry.share_id}): the "
                "time-slice is a setting of the whole GPU, which other claims share; use "
                "strategy MPS or no sharing config"
            )
        entry.time_slice = time_slice
        # A slice of a shared GPU always gets an MPS daemon: it enforces the memory.
        entry.mps = uses_mps or sliced
        return entry

    def _consumed_memory(self, ref: ClaimRef, where: str, result: Mapping[str, Any]) -> int | None:
        consumed = result.get("consumedCapacity") or {}
        raw = consumed.get("memory", consumed.get(f"{self._driver}/memory"))
        if raw is None:
            return None
        try:
            value = parse_quantity(str(raw).strip()).value()
        except QuantityError as exc:
            raise _ClaimFailure(
                f"{_describe(ref)}: {where}.consumedCapacity.memory: {exc}"
            ) from None
        if value < _MIB:
            # MPS takes whole MiB, and a limit of 0 would mean no limit at all.
            raise _ClaimFailure(
                f"{_describe(ref)}: {where}.consumedCapacity.memory is {raw}; a memory "
                "slice must be at least 1Mi: raise the claim's capacity request"
            )
        return value

    def _plan_mig(self, ref: ClaimRef, cp: Checkpoint, where: str, entry: _Entry) -> None:
        device = entry.device
        placement = device.placement
        if device.uuid is not None:
            entry.details["mig"] = {
                "gi": device.gpu_instance_id,
                "ci": device.compute_instance_id,
                "created": False,
            }
            return
        if placement is None:
            raise _ClaimFailure(
                f"{_describe(ref)}: {where}.device: MIG device {device.name} has neither a "
                "UUID nor a placement"
            )
        if not entry.admin:
            entry.create_mig = True
            return
        # Admin access to a dynamic partition: it exists only if its owner created it.
        for holder, held in cp.holders((self._node, device.name)):
            mig = held.details.get("mig")
            if not held.admin_access and isinstance(mig, Mapping) and mig.get("ci") is not None:
                entry.details["uuid"] = held.details.get("uuid")
                entry.details["mig"] = {"gi": mig.get("gi"), "ci": mig.get("ci"), "created": False}
                log.debug(
                    "admin access beside the owner",
                    extra={"fields": {"claim": ref.uid, "owner": holder.uid}},
                )
                return
        raise _ClaimFailure(
            f"{_describe(ref)}: {where}.device: MIG device {device.name} does not exist yet "
            "(no claim on this node created it); admin access can only monitor an existing "
            "device"
        )

    def _plan_mps(self, ref: ClaimRef, entries: Sequence[_Entry]) -> None:
        """Check MPS settings before anything changes on the node."""
        members = [e for e in entries if e.mps]
        if not members:
            return
        percentages: dict[int, str] = {}
        for entry in members:
            _, _, mps = _sharing_of(entry.config)
            if mps is not None and mps.default_active_thread_percentage is not None:
                percentages.setdefault(mps.default_active_thread_percentage, entry.config_path)
        if len(percentages) > 1:
            where = ", ".join(
                f"{join_path(path, 'sharing.mpsConfig.defaultActiveThreadPercentage')}={value}"
                for value, path in percentages.items()
            )
            raise _ClaimFailure(
                f"{_describe(ref)}: one MPS daemon serves the claim, but its configs ask for "
                f"different active thread percentages ({where}); use one value"
            )
        # UUIDs of MIG devices created later are unknown yet; index keys still resolve.
        try:
            self._mps_limits(members, placeholder=True)
        except ConfigError as exc:
            raise _ClaimFailure(_config_issues(ref, exc)) from None

    @staticmethod
    def _mps_limits(members: Sequence[_Entry], *, placeholder: bool = False) -> dict[str, int]:
        """Pinned memory limit per device UUID: the config's, capped at a slice's memory."""
        limits: dict[str, int] = {}
        groups: dict[int, list[_Entry]] = {}
        for entry in members:
            groups.setdefault(id(entry.config), []).append(entry)
        for group in groups.values():
            _, _, mps = _sharing_of(group[0].config)
            if mps is None:
                continue
            uuids = [e.uuid or (f"<{e.device.name}>" if placeholder else "") for e in group]
            try:
                limits.update(mps.pinned_memory_limits(uuids))
            except ConfigError as exc:
                raise exc.with_prefix(
                    join_path(group[0].config_path, "sharing.mpsConfig")
                ) from None
        for entry in members:
            if entry.consumed_memory is not None:
                key = entry.uuid or f"<{entry.device.name}>"
                limits[key] = min(limits.get(key, entry.consumed_memory), entry.consumed_memory)
        return limits

    # --- side effects ---

    async def _setup(
        self, ref: ClaimRef, cp: Checkpoint, entries: Sequence[_Entry]
    ) -> list[PreparedDevice]:
        async def progress(step: str) -> None:
            records = [e.record(self._node) for e in entries]
            await self._persist(lambda c: c.record_progress(ref.uid, records))
            self._at(step)

        for entry in entries:
            if entry.create_mig:
                await self._create_mig(entry, progress)
        for entry in entries:
            if entry.time_slice is not None and entry.uuid is not None:
                # "applied" tells undo whether the reset must succeed: a setting the
                # GPU refused needs no reset, and a failing reset must not pin the claim.
                step = {"uuid": entry.uuid, "interval": entry.time_slice, "applied": False}
                entry.details["timeSlice"] = step
                await progress("time-slice-recorded")
                await anyio.to_thread.run_sync(
                    self._sharing.set_time_slice, entry.uuid, entry.time_slice
                )
                step["applied"] = True
                await progress("time-slice-applied")
        members = [e for e in entries if e.mps]
        daemon: MpsDaemon | None = None
        if members:
            daemon = await self._start_mps(ref, members, progress)
        common = await self._common_edits()
        cdi_devices = [self._cdi_device(e, daemon) for e in entries]
        toolkit_mode = all(d.toolkit_ids for d in cdi_devices)
        if toolkit_mode:
            cdi_devices = [
                dataclasses.replace(d, edits=dataclasses.replace(d.edits, device_nodes=()))
                for d in cdi_devices
            ]
            common = ContainerEdits(env={"NVIDIA_VISIBLE_DEVICES": "void"})
        else:
            cdi_devices = [dataclasses.replace(d, toolkit_ids=()) for d in cdi_devices]
        await self._cdi_io(
            functools.partial(self._cdi.write_claim, ref.uid, cdi_devices, common_edits=common)
        )
        self._at("cdi-written")
        for entry, cdi_device in zip(entries, cdi_devices, strict=True):
            entry.cdi_ids = tuple(self._cdi.device_ids(ref.uid, cdi_device))
        records = [e.record(self._node) for e in entries]
        final = await self._persist(lambda c: c.complete_prepare(ref.uid, records))
        self._at("prepare-completed")
        log.info(
            "claim prepared",
            extra={
                "fields": {
                    "claim": ref.uid,
                    "namespace": ref.namespace,
                    "name": ref.name,
                    "devices": [e.cdi_name for e in entries],
                }
            },
        )
        return _result_from_record(final).devices

    async def _create_mig(self, entry: _Entry, progress: Callable[[str], Any]) -> None:
        placement = entry.device.placement
        assert placement is not None
        mig: dict[str, Any] = {
            "profileId": placement.profile_id,
            "profile": placement.profile,
            "start": placement.start,
            "size": placement.size,
            "created": True,
        }
        # Recorded before creating, so a crash right after creation is still undone.
        entry.details["mig"] = mig
        await progress("mig-recorded")
        mig["gi"] = await anyio.to_thread.run_sync(
            _create_gpu_instance, self._nvml, entry.gpu.uuid, placement
        )
        await progress("mig-gpu-instance-created")
        ci, uuid = await anyio.to_thread.run_sync(
            _create_compute_instance, self._nvml, entry.gpu.uuid, int(mig["gi"])
        )
        mig["ci"] = ci
        entry.details["uuid"] = uuid
        await progress("mig-created")

    async def _start_mps(
        self, ref: ClaimRef, members: Sequence[_Entry], progress: Callable[[str], Any]
    ) -> MpsDaemon:
        # A whole GPU given to one claim runs MPS clients only, as upstream does; a
        # shared GPU keeps its mode, since other claims' daemons use it too.
        for entry in members:
            uuid = entry.uuid
            if entry.device.type is not DeviceType.GPU or entry.share_id is not None or not uuid:
                continue
            previous = await anyio.to_thread.run_sync(_get_compute_mode, self._nvml, uuid)
            if previous == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                continue
            step = {"uuid": uuid, "previous": previous, "applied": False}
            entry.details["computeMode"] = step
            await progress("compute-mode-recorded")
            await anyio.to_thread.run_sync(
                _set_compute_mode, self._nvml, uuid, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
            )
            step["applied"] = True
            await progress("compute-mode-applied")
        percentage = None
        for entry in members:
            _, _, mps = _sharing_of(entry.config)
            if mps is not None and mps.default_active_thread_percentage is not None:
                percentage = mps.default_active_thread_percentage
        pipe_dir, log_dir = self._mps_dirs(ref.uid)
        uuids = tuple(dict.fromkeys(e.uuid for e in members if e.uuid))
        daemon = MpsDaemon(
            name=ref.uid,
            pipe_dir=pipe_dir,
            log_dir=log_dir,
            device_uuids=uuids,
            active_thread_percentage=percentage,
            pinned_memory_limits=self._mps_limits(members),
        )
        for entry in members:
            entry.details["mps"] = {
                "pipeDir": str(pipe_dir),
                "logDir": str(log_dir),
                "uuids": list(uuids),
            }
        await progress("mps-recorded")
        await anyio.to_thread.run_sync(self._sharing.start_mps, daemon)
        self._at("mps-started")
        return daemon

    async def _common_edits(self) -> ContainerEdits:
        """Control nodes and driver libraries; they do not change while we run."""
        if self._common is None:
            edits = await anyio.to_thread.run_sync(
                functools.partial(
                    driver_common_edits,
                    driver_root=self._driver_root,
                    dev_root=self._dev_root,
                    libraries=self._libraries,
                    host_view=self._host_view,
                    device_numbers=self._device_numbers,
                )
            )
            self._common = dataclasses.replace(
                edits, env={**edits.env, "NVIDIA_VISIBLE_DEVICES": "void"}
            )
        return self._common

    def _cdi_device(self, entry: _Entry, daemon: MpsDaemon | None) -> CdiDevice:
        nodes = [self._node_path(f"/dev/nvidia{entry.gpu.minor}")]
        mig = entry.details.get("mig")
        if isinstance(mig, Mapping) and mig.get("gi") is not None and mig.get("ci") is not None:
            nodes.extend(self._cap_nodes(entry.gpu.minor, int(mig["gi"]), int(mig["ci"])))
        env = {f"GPUDRA_DEVICE_{_env_key(entry.cdi_name)}_UUID": entry.uuid or ""}
        mounts: tuple[Mount, ...] = ()
        if entry.mps and daemon is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_DIR_IN_CONTAINER
            mounts = (
                Mount(str(daemon.pipe_dir), MPS_PIPE_DIR_IN_CONTAINER, _RW_BIND),
                Mount(str(self._dev_root / "dev/shm"), "/dev/shm", _RW_BIND),
            )
        toolkit_ids: tuple[str, ...] = ()
        if self._toolkit is not None and entry.uuid:
            toolkit_ids = tuple(self._toolkit.device_ids(entry.uuid))
        return CdiDevice(
            name=entry.cdi_name,
            edits=ContainerEdits(env=env, device_nodes=tuple(nodes), mounts=mounts),
            toolkit_ids=toolkit_ids,
        )

    def _cap_nodes(self, gpu_minor: int, gi: int, ci: int) -> list[DeviceNode]:
        major = _caps_major(self._proc_root)
        nodes = []
        for minor, mode in mig_capability_minors(self._proc_root, gpu_minor, gi, ci):
            node = self._node_path(f"/dev/nvidia-caps/nvidia-cap{minor}")
            if major is not None and node.major is None:
                # With the numbers the runtime can create the node even where
                # nvidia-modprobe has not made it on the host yet.
                node = dataclasses.replace(node, type="c", major=major, minor=minor, file_mode=mode)
            nodes.append(node)
        return nodes

    # --- undo ---

    async def _unprepare_claim(self, ref: ClaimRef) -> str | None:
        try:
            validate_claim_uid(ref.uid)
        except CdiError as exc:
            raise _ClaimFailure(f"claim {ref.namespace}/{ref.name}: {exc}") from None
        async with self._guard(ref.uid):
            cp = await self._checkpoint()
            record = cp.get(ref.uid)
            if record is None:
                return None
            await self._undo(record, "unprepare")
        return None

    def _owned_elsewhere(
        self, cp: Checkpoint, uid: str, gpu_uuid: str, mig: Mapping[str, Any]
    ) -> str | None:
        """Another current claim that records the same MIG instance (after a crash
        between destroy and forget, the ID may have been handed out again)."""
        for other in cp.claims():
            if other.uid == uid:
                continue
            for device in other.devices:
                theirs = device.details.get("mig")
                if (
                    isinstance(theirs, Mapping)
                    and theirs.get("created")
                    and device.details.get("parentUuid") == gpu_uuid
                    and theirs.get("gi") == mig.get("gi")
                    and theirs.get("start") == mig.get("start")
                    and theirs.get("profileId") == mig.get("profileId")
                ):
                    return other.uid
        return None

    async def _undo(self, record: ClaimRecord, why: str) -> None:
        """Undo every recorded side effect, newest kind first, then forget the claim.

        Every step is tried even when one fails, so one stuck piece does not keep
        the rest in place; the record stays until all of them succeed.
        """
        cp = await self._checkpoint()
        errors: list[str] = []

        async def attempt(
            what: str, fn: Callable[[], object], *, required: bool = True, cdi: bool = False
        ) -> None:
            try:
                if cdi:
                    await self._cdi_io(fn)
                else:
                    await anyio.to_thread.run_sync(fn)
            except Exception as exc:
                if required:
                    errors.append(f"{what}: {exc}")
                else:
                    # The step may never have taken effect (it failed, or the process
                    # died right after it): undoing it is best effort.
                    log.warning(
                        "undo of a step not known to be applied failed",
                        extra={"fields": {"claim": record.uid, "step": what, "error": str(exc)}},
                    )

        await attempt(
            "removing the CDI spec", functools.partial(self._cdi.remove, record.uid), cdi=True
        )
        daemons: dict[str, MpsDaemon] = {}
        time_slices: dict[str, bool] = {}
        modes: dict[str, tuple[int, bool]] = {}
        migs: list[tuple[str, Mapping[str, Any]]] = []
        for device in record.devices:
            details = device.details
            mps = details.get("mps")
            if isinstance(mps, Mapping) and mps.get("pipeDir"):
                daemons.setdefault(
                    str(mps["pipeDir"]),
                    MpsDaemon(
                        name=record.uid,
                        pipe_dir=Path(str(mps["pipeDir"])),
                        log_dir=Path(str(mps.get("logDir") or mps["pipeDir"])),
                        device_uuids=tuple(str(u) for u in mps.get("uuids") or ()),
                    ),
                )
            ts = details.get("timeSlice")
            if isinstance(ts, Mapping) and ts.get("uuid"):
                applied = ts.get("applied", True) is not False
                key = str(ts["uuid"])
                time_slices[key] = time_slices.get(key, False) or applied
            mode = details.get("computeMode")
            if isinstance(mode, Mapping) and mode.get("uuid"):
                applied = mode.get("applied", True) is not False
                modes.setdefault(str(mode["uuid"]), (int(mode.get("previous", 0)), applied))
            mig = details.get("mig")
            if isinstance(mig, Mapping) and mig.get("created") and details.get("parentUuid"):
                migs.append((str(details["parentUuid"]), mig))
        for daemon in daemons.values():
            await attempt(
                f"stopping MPS daemon {daemon.pipe_dir}",
                functools.partial(self._stop_mps, daemon),
            )
        for uuid, applied in time_slices.items():
            await attempt(
                f"resetting the time-slice of {uuid}",
                functools.partial(self._sharing.reset_time_slice, uuid),
                required=applied,
            )
        for uuid, (previous, applied) in modes.items():
            await attempt(
                f"restoring compute mode {previous} of {uuid}",
                functools.partial(_set_compute_mode, self._nvml, uuid, previous),
                required=applied,
            )
        for gpu_uuid, mig in migs:
            owner = self._owned_elsewhere(cp, record.uid, gpu_uuid, mig)
            if owner is not None:
                log.warning(
                    "MIG instance now belongs to another claim; not destroying it",
                    extra={"fields": {"claim": record.uid, "owner": owner, "gi": mig.get("gi")}},
                )
                continue
            await attempt(
                f"destroying MIG instance {mig.get('gi', '?')} on {gpu_uuid}",
                functools.partial(_destroy_mig, self._nvml, gpu_uuid, mig),
            )
        if errors:
            raise _ClaimFailure(
                f"ResourceClaim {record.namespace}/{record.name} ({record.uid}): {why}: "
                + "; ".join(errors)
            )
        await self._persist(lambda c: c.remove(record.uid))
        log.info(
            "claim unprepared",
            extra={"fields": {"claim": record.uid, "reason": why}},
        )

    def _stop_mps(self, daemon: MpsDaemon) -> None:
        self._sharing.stop_mps(daemon)
        parent = daemon.pipe_dir.parent
        if parent.parent == self._mps_root:
            shutil.rmtree(parent, ignore_errors=True)

    # --- start-up and housekeeping ---

    async def recover(self) -> RecoveryReport:
        """Put the node back in line with the checkpoint; call once at start.

        Rolls back prepares a crash interrupted, cleans up after a reboot (MIG
        instances we created that the driver kept), and removes CDI specs, MPS
        folders and temp files that belong to no recorded claim. Safe to call while
        serving: each claim is handled under its own lock.
        """
        cp = await self._checkpoint()
        errors: list[str] = []
        rolled_back: list[str] = []
        for record in cp.incomplete():
            async with self._guard(record.uid):
                current = cp.get(record.uid)
                if current is None or current.completed:
                    continue
                try:
                    await self._undo(current, "rolling back a prepare interrupted by a restart")
                except _ClaimFailure as exc:
                    errors.append(str(exc))
                else:
                    rolled_back.append(record.uid)
        previous = [r.uid for r in cp.previous_boot()]
        errors.extend(await self._clean_previous_boot(cp))
        orphan_specs, orphan_dirs, temp_files = await self._remove_orphans(cp, errors)
        report = RecoveryReport(
            rolled_back=tuple(rolled_back),
            previous_boot=tuple(previous),
            orphaned_specs=tuple(orphan_specs),
            orphaned_mps_dirs=tuple(orphan_dirs),
            temp_files=temp_files,
            errors=tuple(errors),
        )
        log.info("recovery done", extra={"fields": dataclasses.asdict(report)})
        return report

    async def _clean_previous_boot(self, cp: Checkpoint) -> list[str]:
        """MIG instances may outlive a reboot when the driver keeps them; daemons and
        time-slices do not. The records go only once everything is cleaned."""
        errors: list[str] = []
        for record in cp.previous_boot():
            for device in record.devices:
                details = device.details
                mig = details.get("mig")
                gpu_uuid = details.get("parentUuid")
                if isinstance(mig, Mapping) and mig.get("created") and gpu_uuid:
                    if self._owned_elsewhere(cp, "", str(gpu_uuid), mig) is not None:
                        continue
                    try:
                        await anyio.to_thread.run_sync(_destroy_mig, self._nvml, str(gpu_uuid), mig)
                    except Exception as exc:
                        errors.append(
                            f"previous boot claim {record.namespace}/{record.name}: "
                            f"destroying MIG instance {mig.get('gi', '?')} on {gpu_uuid}: {exc}"
                        )
                mps = details.get("mps")
                if isinstance(mps, Mapping) and mps.get("pipeDir"):
                    pipe = Path(str(mps["pipeDir"]))
                    if pipe.parent.parent == self._mps_root:
                        await anyio.to_thread.run_sync(
                            functools.partial(shutil.rmtree, pipe.parent, ignore_errors=True)
                        )
        if not errors and cp.previous_boot():
            await self._persist(lambda c: c.clear_previous_boot())
        return errors

    async def _remove_orphans(
        self, cp: Checkpoint, errors: list[str]
    ) -> tuple[list[str], list[str], int]:
        def listing() -> tuple[list[str], list[str]]:
            specs = self._cdi.list_claim_uids()
            dirs = (
                sorted(p.name for p in self._mps_root.iterdir() if p.is_dir())
                if self._mps_root.is_dir()
                else []
            )
            return specs, dirs

        async with self._lock:
            specs, dirs = await anyio.to_thread.run_sync(listing)
        removed_specs: list[str] = []
        removed_dirs: list[str] = []
        for uid in specs:
            async with self._guard(uid):
                if cp.get(uid) is not None or uid in cp.unreadable():
                    continue
                try:
                    await anyio.to_thread.run_sync(self._cdi.remove, uid)
                except OSError as exc:
                    errors.append(f"removing orphaned CDI spec of claim {uid}: {exc}")
                else:
                    removed_specs.append(uid)
        for name in dirs:
            async with self._guard(name):
                if cp.get(name) is not None or name in cp.unreadable():
                    continue
                try:
                    pipe_dir, log_dir = self._mps_dirs(name)
                except CdiError:
                    continue  # not a folder of ours
                daemon = MpsDaemon(name=name, pipe_dir=pipe_dir, log_dir=log_dir, device_uuids=())
                try:
                    await anyio.to_thread.run_sync(self._stop_mps, daemon)
                except Exception as exc:
                    errors.append(f"stopping orphaned MPS daemon {pipe_dir}: {exc}")
                else:
                    removed_dirs.append(name)

        def temp_files() -> int:
            count = self._cdi.remove_temp_files()
            folder = self._checkpoint_path.parent
            if folder.is_dir():
                for path in folder.glob(f".{self._checkpoint_path.name}.*.tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        count += 1
            return count

        async with self._lock:
            removed_temp = await anyio.to_thread.run_sync(temp_files)
        return removed_specs, removed_dirs, removed_temp

    async def cleanup_deleted_claims(self) -> list[str]:
        """Unprepare recorded claims whose ResourceClaim is gone (404) or was re-created
        (other UID): the kubelet never unprepares those when it missed the deletion.

        Returns the UIDs unprepared; failures are logged and retried on the next call.
        """
        cp = await self._checkpoint()
        cleaned: list[str] = []
        for record in cp.claims():
            path = claim_path(record.namespace, record.name)
            try:
                claim = await self._kube.request("GET", path, request_timeout_s=self._api_timeout_s)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning(
                        "cannot check claim",
                        extra={"fields": {"claim": record.uid, "error": str(exc)}},
                    )
                    continue
                current_uid = None
            except Exception as exc:
                log.warning(
                    "cannot check claim", extra={"fields": {"claim": record.uid, "error": str(exc)}}
                )
                continue
            else:
                current_uid = (
                    (claim.get("metadata") or {}).get("uid") if isinstance(claim, Mapping) else None
                )
            if current_uid == record.uid:
                continue
            error = await self._unprepare_timed(record.ref)
            if error is None:
                cleaned.append(record.uid)
        if cleaned:
            log.info("unprepared deleted claims", extra={"fields": {"claims": cleaned}})
        return cleaned
