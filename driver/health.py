"""Device health: NVML events become device taints and kubelet health statuses.

`HealthState` is the model: plain data, changed only through `apply` (one event),
`expire` (time passing), `restore_resets` and `restore_timed` (taints of before a
restart) and `update_inventory`, with a generation number and `wait_for_change` so
that async consumers (the ResourceSlice publisher, the kubelet health stream) wake up
on change and never miss one. `NvmlHealthWatcher` feeds it from NVML: it blocks in
`nvmlEventSetWait_v2` in a worker thread with a short timeout, so shutdown is prompt.

Policy, following the upstream NVIDIA DRA driver and improving on it where its users hit
problems:
- a critical XID taints the device `gpu.nvidia.com/xid=<xid>` with NoSchedule
  (configurable NoExecute); application XIDs (`APPLICATION_XIDS` plus a configured
  list), the XIDs NVIDIA's XID catalogue has ignored (`IGNORED_XIDS`: 63, a row
  remapping recorded, among them) and the others it answers by restarting the
  application (`RESTARTED_XIDS`: 94, a contained memory error, among them) are
  informational: effect None, the device stays healthy. The informational taint names
  the first such XID until the device has been quiet for `recovery_after_s`: later ones
  refresh it without rewriting it (each is logged and counted), so a workload that
  crashes in a loop does not have the node's ResourceSlices rewritten, and its pool
  briefly incomplete, for every crash;
- a double-bit ECC error taints `gpu.nvidia.com/ecc=double-bit` like a critical XID;
- a lost GPU taints `gpu.nvidia.com/gpu-lost` with NoExecute;
- a GPU whose row remapper says a remapping failed (`Gpu.row_remap_failed`, read at
  each discovery) taints every device of it `gpu.nvidia.com/row-remap=failed` like a
  critical XID, until a reading says otherwise. NVIDIA's memory error guide defines
  that flag by its RMA policy thresholds for row remapping, and NVIDIA's NVSentinel
  sends a GPU DCGM reports so for field diagnostics. The flag stays with the GPU,
  where the taint of XID 64 (a remapping that could not be recorded) goes at the next
  reset: without this one a reboot would put the GPU back in service. A pending
  remapping is no reason: NVIDIA lets new work start until the reset that applies it;
- a GPU NVML says has unrepairable memory (`Gpu.unrepairable_memory`, R590 and later,
  Hopper and newer, read at each discovery) is tainted
  `gpu.nvidia.com/unrepairable-memory` the same way (`_GPU_FLAGS` holds both): NVIDIA's
  DCGM fails its memory health check on that flag;
- a GPU whose events cannot be watched gets `gpu.nvidia.com/unmonitored` (effect None),
  lifted once a later try registers them (NVML errors are tried again, 10 s after the
  first and twice as long after each, at most 5 min), and so do the MIG devices of a
  GPU whose MIG instance events NVML withholds: it reports them only to a caller with
  the MIG monitor capability (nvml.h, nvmlEventSetWait_v2), which discovery found
  missing (`Gpu.gaps`);
- XID 154 (GPU recovery action changed) follows the recovery action NVML reports with
  it (`RESET_RECOVERY_ACTIONS`): a reset or reboot waits for a reset, none is
  informational, others (or an action NVML does not give) are timed;
- unlike upstream, taints go away again, each on its own evidence. An XID after which
  NVIDIA's XID catalogue has the GPU reset (or more: the node rebooted, the board
  serviced) before reuse, `RESET_XIDS` plus a configured list, and a double-bit ECC
  error (XID 48) stay until the GPU was reset: it was lost and answers again in full
  (`NvmlHealthWatcher._reset_seen`), or an admin who reset it creates
  `<stateDir>/reset/<GPU UUID>` (`gpudra.driver.gpuresets`, which also keeps them
  across agent restarts within one boot). A lost GPU's taint goes `recovery_after_s`
  after it answers again. Any other XID's taint goes once the device stayed quiet for
  `recovery_after_s`. The clock is injectable so tests need no sleeping;
- an agent restart lifts no taint early: those that wait for time are kept in the
  state folder too (`gpudra.driver.timedtaints`, which says why there and not in the
  published ResourceSlices) and raised again with the times they had, so each lifts
  when it would have, and one whose time ran out while the agent was down is not. A
  lost GPU's taint is kept while it is lost too: one that answers again after the
  restart waits `recovery_after_s` from the restart, or from the rescan that finds it
  answering. The taints that wait for a reset of a GPU discovery leaves out at start
  (still lost) are held too, and raised when a rescan finds the GPU: answering again
  after a loss the agent did not see is no evidence of a reset.
An event on a whole GPU taints every device carved from it, and so does an XID after
which the GPU is reset (a reset takes down every instance on it). Any other event NVML
attributes to a GPU instance (nvml.h, nvmlEventData_t.gpuInstanceId) taints the MIG
device of that instance and every placement that shares a memory slice with it: the
hardware, not the name, since dynamic MIG publishes each placement under its own name.
Where that instance is gone before the event is read (its claim was unprepared), no
device is tainted: the GPU's other instances belong to other tenants, whom one tenant's
instance must not take out of service.

Which GPU is lost is decided per GPU from calls scoped to it (on the handle taken when
its events were registered), never from a lookup by UUID: that lookup answers
GPU_IS_LOST for every GPU while any one is lost (nvml.h). NVML's "a GPU is lost" from
the event wait is re-checked the same way, so one lost GPU taints its own devices only.
That answer is a state, not an event: the wait gives it "if a GPU has fallen off the
bus" (nvml.h), wait after wait and at once, until the GPU is reset. So the watcher
builds its event set again without the lost GPUs, to keep hearing from the others, and
registers a lost GPU again once it was reset; where NVML still answers so, it waits out
the wait timeout between asking, instead of spinning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final, TypeAlias

import anyio
import anyio.to_thread
import pynvml
from anyio.abc import TaskStatus
from gpudra.driver.devices import Gpu, Inventory, mig_device_name
from gpudra.driver.gpuresets import GpuResets, PendingReset
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.nvml.codes import (
    FULL_GPU_INSTANCE_ID,
    RECOVERY_ACTION_XID,
    constant_names,
    describe_nvml_error,
)
from gpudra.driver.nvml.handles import device_handle, handle_address
from gpudra.driver.timedtaints import TimedTaint, TimedTaints

logger = logging.getLogger(__name__)

_Resets: TypeAlias = Mapping[str, tuple[PendingReset, ...]]
"""Taints waiting for a GPU reset, by GPU UUID."""

DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
# Every device's health message while the checks are off (`HealthState(watched=False)`).
HEALTH_CHECKS_OFF = "gpudra's health checks are off (--no-health-checks)"
# XIDs caused by applications, not hardware: NVIDIA's XID catalogue
# (docs.nvidia.com/deploy/xid-errors, "Resolution Bucket (Immediate Action)") has the
# application restarted (13, 31, 68) or nothing done (43; 45 follows the XID it comes
# with), upstream's list. Also those the catalogue has the application restarted and
# then the application or CUDA checked: 11 and 25 (invalid push buffer stream), 69
# (graphics engine class error), 80 (corrupted data sent to the GPU). A process writes
# its own push buffer and classes, so as critical XIDs any tenant of a shared GPU could
# keep every tenant's new pods off it at will. 32 (PBDMA error) has that investigation
# too, but the catalogue says it is mostly the PCI bus, not the application, so it is
# in RESTARTED_XIDS below, where it still fires the alert. 109 (context switch
# timeout) is listed by upstream too and stays here although the catalogue has
# RESET_GPU for it: a workload that does not yield raises it, so as a reset-class XID
# any tenant could take a GPU out of service until an admin acts. An admin who wants
# the catalogue's treatment lists it in the reset XIDs.
APPLICATION_XIDS = frozenset({11, 13, 25, 31, 43, 45, 68, 69, 80, 109})
# The other XIDs the same catalogue answers by restarting the application (RESTART_APP
# as the immediate action): 8 (GPU stopped processing), 32 (PBDMA error), 60 (video
# processor), the copy engines (39-41, 70-72, 75-77, 85, 126-135), the video decoders
# beyond the first (83, 84, 88, 89, 96-98), the JPEG decoders (82, 99-105) and the
# optical flow engines (86, 139), and 94 (contained memory error: "all other
# applications running at the time of the Xid are unaffected ... applications can
# continue to be run until the reset can be performed"). The GPU stays in service: the
# same rows as 68 (NVDEC0), which upstream counts as an application's, and a workload
# can raise them on whichever engine it lands on, so as critical XIDs any tenant of a
# shared GPU could keep every tenant's new pods off it. NVIDIA's NVSentinel, which
# cordons nodes on XIDs, counts every RESTART_APP row non-fatal too. The catalogue's
# investigation asks for support after most of them, so unlike application XIDs they
# fire the XID alert. An uncorrectable memory error behind a 94 also raises 48 or a
# double-bit ECC event, which wait for a reset as before.
RESTARTED_XIDS = frozenset(
    {8, 32, 39, 40, 41, 60, 70, 71, 72, 75, 76, 77, 82, 83, 84, 85, 86, 88, 89, 94}
    | set(range(96, 106))
    | set(range(126, 136))
    | {139}
)
# XIDs the same catalogue has ignored (IGNORE as the immediate action): 63 (row
# remapping or page retirement recorded: the memory was repaired, IGNORE in both
# buckets), 92 (high single-bit ECC error rate), 93 (InfoROM wear limit), 121
# (corrected C2C link errors), 157 (no resources left to retire more), 160 and 161
# (channel retirement), 37, 38, 66, 67 (driver firmware errors), 44 (fault during a
# context switch), 137 (NVLink privilege error), 141 (CUDA fast path error), 14 (an
# injected error), 106, 107 (SMBPBI test messages), 108, 152 and 153 (unused or on no
# data center GPU). 43 is ignored there too and is an application XID above. Its
# investigatory bucket asks for support after some of them: that is the XID metric's
# and the log's to show, not a reason to keep the device from new work.
IGNORED_XIDS = frozenset(
    {14, 37, 38, 44, 63, 66, 67, 92, 93, 106, 107, 108, 121, 137, 141, 152, 153, 157, 160, 161}
)
# XIDs after which the same catalogue has the GPU reset or more before it is used
# again: RESET_GPU (46, 62, 64, 95, 110, 119, 120, 136, 140, 143, 155, 156, 158),
# RESTART_BM (79: reboot), RESTART_VM (151), CHECK_MECHANICALS (54: auxiliary power
# not connected), CONTACT_SUPPORT (142), and 48 (double-bit ECC), whose workflow
# NVIDIA Health Validation spells "drain: reset_gpu -> service_required", with 171 and
# 172: the catalogue gives them no bucket of their own ("Additional to Xid 48 providing
# more details on particulars of fault"), and NVIDIA's memory error guide ("User Visible
# Statistics") has them say whether that uncorrectable error was in DRAM (171) or SRAM
# (172), so they wait for the reset 48 does, whichever of them comes first. XIDs the
# catalogue has restarted, ignored or decoded first (74, 144-150: NVLink) are not here,
# nor the others it gives no bucket (162-170).
RESET_XIDS = frozenset(
    {46, 48, 54, 62, 64, 79, 95, 110, 119, 120, 136, 140, 142, 143, 151, 155, 156, 158, 171, 172}
)
_RECOVERY_ACTIONS: Final = constant_names("NVML_GPU_RECOVERY_ACTION_")
"""Readable recovery actions, for the log."""
# XID 154 ("GPU recovery action changed", drivers R565 on) is treated as the recovery
# action NVML reports with it says (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION). These
# have the GPU reset or more before reuse: NVIDIA's memory error guide ("terminate all
# GPU processes, then reset"; "reboot"), the ones DCGM's health watch fails a GPU on
# (GPU reset, node reboot, drain and reset) and the bus reset and system reboot of
# later branches. NONE needs nothing (informational); DRAIN_P2P is followed by another
# action once P2P work drained; RECOVER_IMEX_DOMAIN concerns the IMEX domain, not the
# GPU: those two are timed, as an XID 154 whose action cannot be read is.
RESET_RECOVERY_ACTIONS = frozenset(
    {
        pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
        pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
        pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
        6,  # NVML_GPU_RECOVERY_ACTION_BUS_RESET and
        7,  # SYSTEM_REBOOT (NVML 615): named in nvidia-ml-py newer than its floor
    }
)


class TaintEffect(StrEnum):
    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


_SEVERITY: Mapping[TaintEffect, int] = {
    TaintEffect.NONE: 0,
    TaintEffect.NO_SCHEDULE: 1,
    TaintEffect.NO_EXECUTE: 2,
}


@dataclass(frozen=True, slots=True)
class Taint:
    """A device taint as resource.k8s.io/v1 spells it."""

    key: str
    value: str | None
    effect: TaintEffect
    time_added: datetime


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How events map to taints, and when taints are lifted."""

    driver_name: str = DEFAULT_DRIVER_NAME
    critical_effect: TaintEffect = TaintEffect.NO_SCHEDULE
    gpu_lost_effect: TaintEffect = TaintEffect.NO_EXECUTE
    application_xids: frozenset[int] = APPLICATION_XIDS
    ignored_xids: frozenset[int] = IGNORED_XIDS
    restarted_xids: frozenset[int] = RESTARTED_XIDS
    extra_application_xids: frozenset[int] = frozenset()
    reset_xids: frozenset[int] = RESET_XIDS
    extra_reset_xids: frozenset[int] = frozenset()
    recovery_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.critical_effect is TaintEffect.NONE:
            msg = "critical_effect must be NoSchedule or NoExecute; None would hide broken GPUs"
            raise ValueError(msg)
        if self.gpu_lost_effect is TaintEffect.NONE:
            msg = "gpu_lost_effect must be NoSchedule or NoExecute"
            raise ValueError(msg)
        if self.recovery_after_s < 0:
            msg = "recovery_after_s must be >= 0"
            raise ValueError(msg)
        if both := sorted(self.extra_application_xids & self.extra_reset_xids):
            msg = (
                f"XIDs {', '.join(map(str, both))} are listed both as application XIDs "
                "(--application-xids) and as XIDs that need a GPU reset (--reset-xids): "
                "list each in one of them"
            )
            raise ValueError(msg)

    @property
    def xid_key(self) -> str:
        return f"{self.driver_name}/xid"

    @property
    def ecc_key(self) -> str:
        return f"{self.driver_name}/ecc"

    @property
    def gpu_lost_key(self) -> str:
        return f"{self.driver_name}/gpu-lost"

    @property
    def unmonitored_key(self) -> str:
        return f"{self.driver_name}/unmonitored"

    @property
    def row_remap_key(self) -> str:
        return f"{self.driver_name}/row-remap"

    @property
    def unrepairable_memory_key(self) -> str:
        return f"{self.driver_name}/unrepairable-memory"

    def is_application_xid(self, xid: int) -> bool:
        """Informational (effect None) as an application's error. The admin's lists win
        over the built-in ones."""
        if xid in self.extra_reset_xids:
            return False
        return xid in self.application_xids or xid in self.extra_application_xids

    def is_informational(self, xid: int) -> bool:
        """Effect None: an application's error, or one NVIDIA's catalogue has ignored
        (`IGNORED_XIDS`) or answers by restarting the application (`RESTARTED_XIDS`),
        unless the admin listed it as needing a reset."""
        if xid in self.extra_reset_xids:
            return False
        return (
            self.is_application_xid(xid) or xid in self.ignored_xids or xid in self.restarted_xids
        )

    def needs_reset(self, xid: int) -> bool:
        """Its taint stays until the GPU was reset, however quiet the GPU is."""
        if xid in self.extra_application_xids:
            return False
        return xid in self.reset_xids or xid in self.extra_reset_xids

    def treatment(self, xid: int, recovery: int | None = None) -> tuple[TaintEffect, bool]:
        """The taint effect of an XID and whether it waits for a GPU reset. `recovery`:
        the recovery action read with XID 154 (`RESET_RECOVERY_ACTIONS`), which decides
        unless the admin listed 154 themselves."""
        listed = xid in self.extra_application_xids or xid in self.extra_reset_xids
        if recovery is not None and xid == RECOVERY_ACTION_XID and not listed:
            if recovery == pynvml.NVML_GPU_RECOVERY_ACTION_NONE:
                return TaintEffect.NONE, False
            return self.critical_effect, recovery in RESET_RECOVERY_ACTIONS
        effect = TaintEffect.NONE if self.is_informational(xid) else self.critical_effect
        return effect, self.needs_reset(xid)


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID error; `device` names the MIG device it hit, None for the whole GPU.

    `unplaced`: NVML attributed it to a GPU instance that could not be named (gone by
    the time the event was read), so it is no whole-GPU event either.
    """

    gpu_uuid: str
    xid: int
    device: str | None = None
    unplaced: bool = False
    recovery: int | None = None
    """With XID 154: the recovery action NVML reported then; None where not read."""


@dataclass(frozen=True, slots=True)
class EccEvent:
    """A double-bit (uncorrectable) ECC error."""

    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class GpuLostEvent:
    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class GpuRecoveredEvent:
    """A lost GPU answers again, so it was reset: the taints that waited for that go,
    and its gpu-lost taint clears after `recovery_after_s`."""

    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class GpuResetEvent:
    """An admin says the GPU was reset (`<stateDir>/reset/<GPU UUID>`): the taints that
    waited for that go."""

    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class UnmonitoredEvent:
    """NVML cannot deliver events for this GPU; health is unknown, not bad."""

    gpu_uuid: str
    reason: str


@dataclass(frozen=True, slots=True)
class MonitoredEvent:
    """The events of a GPU that was unmonitored are registered now (a registration
    that failed succeeded on a later try): its health is known again."""

    gpu_uuid: str


HealthEvent = (
    XidEvent
    | EccEvent
    | GpuLostEvent
    | GpuRecoveredEvent
    | GpuResetEvent
    | UnmonitoredEvent
    | MonitoredEvent
)


# --- state ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceHealthState:
    """One device's health state: its taints for the ResourceSlice, and what the kubelet
    health stream reports (as a `plugin.DeviceHealth` message) from it.

    `healthy` is False while any taint has effect NoSchedule or NoExecute.
    `monitored` is False while the device carries the unmonitored taint: its GPU's
    events do not reach the agent, so that it is healthy is not known; and for every
    device while the health checks are off.
    `updated_at` is the unix time of the device's last change.
    """

    name: str
    gpu_uuid: str
    healthy: bool
    message: str
    taints: tuple[Taint, ...]
    updated_at: float
    monitored: bool = True


@dataclass(frozen=True, slots=True)
class HealthReport:
    """Every known device's health at one generation; generations only grow."""

    generation: int
    devices: Mapping[str, DeviceHealthState]

    def taints(self, name: str) -> tuple[Taint, ...]:
        device = self.devices.get(name)
        return device.taints if device is not None else ()

    def unhealthy(self) -> tuple[str, ...]:
        return tuple(name for name, d in self.devices.items() if not d.healthy)


@dataclass(slots=True)
class _Active:
    taint: Taint
    last_seen: float  # injectable clock
    needs_reset: bool = False  # stays until the GPU was reset, not for `recovery_after_s`


@dataclass(slots=True)
class _Record:
    gpu_uuid: str
    updated_at: float
    active: dict[str, _Active] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _GpuFlag:
    """A condition discovery reads off a GPU at each scan (`Gpu` field `read`) that takes
    every device of it out of service for as long as a reading says so: the taint
    `key`=`value` with the critical effect, which no quiet time lifts, which is not kept
    on disk and which waits for no reset. A scan that gives no reading (None) keeps
    what the last one said."""

    key: Callable[[HealthPolicy], str]
    value: str | None
    read: Callable[[Gpu], bool | None]
    raised: str  # logged when a reading first says so
    cleared: str  # logged when one no longer does
    message: str  # the device's health message while tainted


_GPU_FLAGS: Final = (
    _GpuFlag(
        key=lambda policy: policy.row_remap_key,
        value="failed",
        read=lambda gpu: gpu.row_remap_failed,
        raised="the GPU's row remapper says a remapping failed (NVIDIA's RMA threshold for "
        "its memory): its devices are taken out of service",
        cleared="the GPU's row remapper no longer says a remapping failed",
        message="row remapping failed (NVIDIA's RMA threshold for the GPU's memory): needs service",
    ),
    _GpuFlag(
        key=lambda policy: policy.unrepairable_memory_key,
        value=None,
        read=lambda gpu: gpu.unrepairable_memory,
        raised="NVML says the GPU has unrepairable memory: its devices are taken out of service",
        cleared="NVML no longer says the GPU has unrepairable memory",
        message="NVML says the GPU has unrepairable memory: needs service",
    ),
)


def _now_utc() -> datetime:
    return datetime.now(UTC)


class HealthState:
    """Taints and health of every device of an inventory.

    Change it from the event loop thread only (`apply`, `expire`, `restore_resets`,
    `restore_timed`, `update_inventory`); read it from anywhere through `report()`,
    `pending_resets()`, `timed_taints()`, `xid_counts()` and `held_reset_gpus`.
    `resets` only names the admin's reset marks in the messages (None: there are none,
    the agent keeps no state folder). `watched` False: no watcher feeds it (the health
    checks are off), so no device is monitored: none is singled out with the
    unmonitored taint, and each reports `monitored` False with `HEALTH_CHECKS_OFF`.
    """

    def __init__(
        self,
        inventory: Inventory,
        policy: HealthPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = _now_utc,
        resets: GpuResets | None = None,
        watched: bool = True,
    ) -> None:
        self._policy = policy if policy is not None else HealthPolicy()
        self._watched = watched
        self._clock = clock
        self._wall_clock = wall_clock
        self._resets = resets
        self._generation = 0
        self._changed: anyio.Event | None = None
        self._lost: set[str] = set()
        self._unmonitored: set[str] = set()
        # Taint key of each of `_GPU_FLAGS` -> the GPUs whose last reading said so.
        self._flagged: dict[str, set[str]] = {}
        # GPU UUID -> the privilege NVML wants before it reports its MIG instances' events.
        self._mig_unwatched: dict[str, str] = {}
        self._records: dict[str, _Record] = {}
        self._gpu_devices: dict[str, tuple[str, ...]] = {}
        self._inventory = inventory
        self._index(inventory)
        self._watch_mig_instances()
        self._report: HealthReport | None = None
        # (generation, the held resets it saw, the result): the held ones change without
        # a new generation, and are replaced whole, so their identity tells a change.
        self._pending: tuple[int, _Resets, _Resets] | None = None
        # A repeated error moves a taint's quiet time without a new generation.
        self._refreshes = 0
        self._timed: tuple[tuple[int, int], Mapping[str, tuple[TimedTaint, ...]]] | None = None
        # GPU UUID -> the gpu-lost taints kept for a GPU lost when the agent last stopped
        # that discovery left out (still lost): raised once the inventory has it again.
        self._held_lost: dict[str, tuple[TimedTaint, ...]] = {}
        # GPU UUID -> the taints that waited for its reset when the agent last stopped,
        # for a GPU discovery left out (`restore_resets`): raised once the inventory has
        # it again. Replaced whole: the watcher thread reads its keys (`held_reset_gpus`).
        self._held_resets: _Resets = {}
        # (GPU UUID, XID) -> events seen; replaced whole, so the metrics thread reads one.
        self._xid_counts: Mapping[tuple[str, int], int] = {}
        self._follow_gpu_flags()

    @property
    def policy(self) -> HealthPolicy:
        return self._policy

    @property
    def inventory(self) -> Inventory:
        return self._inventory

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def lost_gpus(self) -> frozenset[str]:
        return frozenset(self._lost)

    @property
    def held_reset_gpus(self) -> frozenset[str]:
        """The GPUs out of the inventory whose taints that wait for a reset are held
        (`restore_resets`): an admin's reset mark naming one is taken, and drops them."""
        return frozenset(self._held_resets)

    def xid_counts(self) -> Mapping[tuple[str, int], int]:
        """How many events of each XID each GPU raised since the agent started."""
        return self._xid_counts

    def _index(self, inventory: Inventory) -> None:
        now = self._wall_clock().timestamp()
        records: dict[str, _Record] = {}
        self._gpu_devices = {}
        for gpu in inventory.gpus:
            names = tuple(sorted(gpu.device_names()))
            self._gpu_devices[gpu.uuid] = names
            for name in names:
                old = self._records.get(name)
                if old is not None and old.gpu_uuid == gpu.uuid:
                    records[name] = old
                else:
                    records[name] = _Record(gpu.uuid, now)
        self._records = records

    def update_inventory(self, inventory: Inventory) -> None:
        """Follow a new discovery; devices that still exist keep their taints. A GPU
        left out since the agent started whose taints were held (`restore_resets`,
        `restore_timed`) that the inventory has again answers again: its taints that
        wait for a reset are raised (it answering is no evidence of a reset), and its
        gpu-lost taint, quiet from now."""
        self._inventory = inventory
        self._index(inventory)
        self._lost &= set(self._gpu_devices)
        self._unmonitored &= set(self._gpu_devices)
        back = sorted(self._held_resets.keys() & self._gpu_devices.keys())
        if back:
            held = self._held_resets
            self._held_resets = {u: p for u, p in held.items() if u not in back}
            self.restore_resets({uuid: held[uuid] for uuid in back})
        back = sorted(self._held_lost.keys() & self._gpu_devices.keys())
        if back:
            self.restore_timed({uuid: self._held_lost.pop(uuid) for uuid in back})
        self._watch_mig_instances()
        self._follow_gpu_flags()
        self._bump()

    def report(self) -> HealthReport:
        if self._report is None or self._report.generation != self._generation:
            self._report = HealthReport(
                self._generation,
                {name: self._device_health(name, rec) for name, rec in self._records.items()},
            )
        return self._report

    def pending_resets(self) -> Mapping[str, tuple[PendingReset, ...]]:
        """The taints waiting for their GPU's reset, by GPU UUID (what survives a restart),
        those held for a GPU out of the inventory (`restore_resets`) included."""
        generation, held_resets = self._generation, self._held_resets
        if (
            self._pending is None
            or self._pending[0] != generation
            or self._pending[1] is not held_resets
        ):
            policy = self._policy
            pending: dict[str, list[PendingReset]] = {u: list(p) for u, p in held_resets.items()}
            for name, record in sorted(self._records.items()):
                for key, active in record.active.items():
                    if not active.needs_reset:
                        continue
                    value = active.taint.value
                    xid = int(value) if key == policy.xid_key and value is not None else None
                    pending.setdefault(record.gpu_uuid, []).append(PendingReset(name, xid))
            self._pending = (
                generation,
                held_resets,
                {u: tuple(p) for u, p in pending.items()},
            )
        return self._pending[2]

    def timed_taints(self) -> Mapping[str, tuple[TimedTaint, ...]]:
        """The taints that lift after quiet time, by GPU UUID (what `TimedTaints` keeps
        across a restart): XIDs that wait for no reset, and the gpu-lost taints, marked
        `lost` while the GPU still is (their quiet time has not begun: `restore_timed`
        starts it), those held for a GPU still out of the inventory included; not
        `unmonitored`."""
        version = (self._generation, self._refreshes)
        if self._timed is None or self._timed[0] != version:
            policy = self._policy
            timed: dict[str, list[TimedTaint]] = {u: list(t) for u, t in self._held_lost.items()}
            for name, record in sorted(self._records.items()):
                for key, active in record.active.items():
                    taint = active.taint
                    if active.needs_reset:
                        continue
                    if key == policy.xid_key and taint.value is not None:
                        xid: int | None = int(taint.value)
                    elif key == policy.gpu_lost_key:
                        xid = None
                    else:
                        continue
                    timed.setdefault(record.gpu_uuid, []).append(
                        TimedTaint(
                            name,
                            xid,
                            taint.effect.value,
                            taint.time_added,
                            active.last_seen,
                            lost=xid is None and record.gpu_uuid in self._lost,
                        )
                    )
            self._timed = (version, {u: tuple(t) for u, t in timed.items()})
        return self._timed[1]

    async def wait_for_change(self, generation: int) -> None:
        """Return once the generation differs from `generation`."""
        while self._generation == generation:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def apply(self, event: HealthEvent) -> bool:
        """Record one event; True if any device's taints or health changed."""
        names = self._gpu_devices.get(event.gpu_uuid)
        if names is None:
            if isinstance(event, GpuResetEvent) and event.gpu_uuid in self._held_resets:
                return self._lift_resets(event.gpu_uuid, "an admin marked the GPU reset")
            logger.warning(
                "health event for a GPU not in the inventory",
                extra={"fields": {"uuid": event.gpu_uuid, "event": type(event).__name__}},
            )
            return False
        policy = self._policy
        changed = False
        match event:
            case XidEvent(xid=xid):
                key = (event.gpu_uuid, xid)
                self._xid_counts = {**self._xid_counts, key: self._xid_counts.get(key, 0) + 1}
                effect, reset = policy.treatment(xid, event.recovery)
                for name in self._xid_targets(event, names, reset=reset):
                    changed |= self._raise(name, policy.xid_key, str(xid), effect, reset=reset)
            case EccEvent():
                for name in names:
                    changed |= self._raise(
                        name, policy.ecc_key, "double-bit", policy.critical_effect, reset=True
                    )
            case GpuLostEvent():
                self._lost.add(event.gpu_uuid)
                for name in names:
                    changed |= self._raise(name, policy.gpu_lost_key, None, policy.gpu_lost_effect)
            case GpuRecoveredEvent():
                if event.gpu_uuid in self._lost:
                    self._lost.discard(event.gpu_uuid)
                    now = self._clock()
                    for name in names:
                        active = self._records[name].active.get(policy.gpu_lost_key)
                        if active is not None:
                            active.last_seen = now
                            self._touch(name)
                    self._lift_resets(event.gpu_uuid, "the GPU was lost and answers again")
                    changed = True
            case GpuResetEvent():
                changed = self._lift_resets(event.gpu_uuid, "an admin marked the GPU reset")
            case UnmonitoredEvent():
                if event.gpu_uuid not in self._unmonitored:
                    self._unmonitored.add(event.gpu_uuid)
                    for name in names:
                        changed |= self._raise(name, policy.unmonitored_key, None, TaintEffect.NONE)
            case MonitoredEvent():
                if event.gpu_uuid in self._unmonitored:
                    self._unmonitored.discard(event.gpu_uuid)
                    # The MIG devices of a GPU whose instance events NVML withholds stay
                    # unmonitored (`_watch_mig_instances`); its whole device does not.
                    gpu = self._inventory.gpu_by_uuid(event.gpu_uuid)
                    whole = gpu.device.name if gpu is not None else None
                    migs_unwatched = event.gpu_uuid in self._mig_unwatched
                    for name in names:
                        if not migs_unwatched or name == whole:
                            changed |= self._lift(name, policy.unmonitored_key)
        if changed:
            self._bump()
        return changed

    def restore_resets(self, pending: Mapping[str, Iterable[PendingReset]]) -> bool:
        """Raise again the taints that waited for a GPU reset when the agent stopped
        (`GpuResets.load`): a restart resets no GPU. A device no longer on its GPU, or
        an XID the policy no longer holds for a reset, is left out (logged).

        A GPU the inventory lacks (discovery leaves a GPU still lost at start out) may
        come back: its taints are held, kept in `pending_resets` so that a further
        restart keeps them too, and raised by the `update_inventory` that brings the
        GPU back. Answering again after a loss the agent did not see is no evidence of
        a reset (`restore_timed`); the admin's reset mark for the GPU drops them, found
        or not (`HealthState.held_reset_gpus`). A GPU removed from the node for good
        keeps them held, and in the file, until a reboot voids the file.
        Returns whether a device's taints changed (held ones change none)."""
        policy = self._policy
        changed = False
        for uuid, items in sorted(pending.items()):
            names = self._gpu_devices.get(uuid)
            for item in items:
                # A saved XID 154 waited for a reset by the action NVML reported then.
                reset = (
                    item.xid is None
                    or policy.treatment(item.xid, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)[1]
                )
                fields = {"uuid": uuid, "device": item.device, "taint": item.taint()}
                if reset and names is None:
                    self._hold_reset(uuid, item)
                    logger.warning(
                        "a GPU with a taint that waited for its reset is not in the inventory "
                        "(still lost, or removed): the taint is held, and raised again once "
                        "the GPU is found",
                        extra={"fields": {**fields, "held": True}},
                    )
                    continue
                if names is None or item.device not in names or not reset:
                    logger.warning(
                        "a taint that waited for a GPU reset is not raised again: "
                        + ("the device is gone" if reset else "the XID needs no reset now"),
                        extra={"fields": fields},
                    )
                    continue
                key, value = self._reset_taint(item)
                changed |= self._raise(item.device, key, value, policy.critical_effect, reset=True)
                logger.warning(
                    "a taint that waits for a GPU reset is raised again", extra={"fields": fields}
                )
        if changed:
            self._bump()
        return changed

    def restore_timed(self, timed: Mapping[str, Iterable[TimedTaint]]) -> bool:
        """Raise again the taints that waited for quiet time when the agent stopped
        (`TimedTaints.load`), with the times they had: each lifts `recovery_after_s`
        after its device last had the error, as if the agent had not stopped, with the
        effect it had (a policy changed by the restart applies to the next events; these
        lift within `recovery_after_s` anyway). One whose time ran out meanwhile, on a
        device no longer here or with an effect this release does not know, is left out
        (logged); so is one where a taint of its kind is up already (one that waits for
        a reset, `restore_resets`).

        A gpu-lost taint kept while its GPU was still lost (`TimedTaint.lost`) is quiet
        from now, not from when it was found lost: the GPU may have stayed lost while
        the agent was down, and now is the latest time it may have been (the restart
        time, or the rescan's that finds it answering; `gpudra.driver.timedtaints`).
        Where the GPU answers, the taint is raised and lifts `recovery_after_s` from
        here; where discovery left the GPU out (still lost), it is held and raised by
        the `update_inventory` that brings the GPU back. Such a GPU is not taken as
        reset (its taints that wait for one stay, as for any reset the agent did not
        see, held with it while discovery leaves it out: `restore_resets`): an admin's
        reset mark lifts them, as before."""
        policy = self._policy
        now = self._clock()
        changed = False
        for uuid, items in sorted(timed.items()):
            names = self._gpu_devices.get(uuid)
            for item in items:
                fields: dict[str, Any] = {
                    "uuid": uuid,
                    "device": item.device,
                    "taint": item.taint(),
                    "effect": item.effect,
                }
                if item.lost:
                    fields["lostWhenStopped"] = True
                effect = next((e for e in TaintEffect if e.value == item.effect), None)
                if names is None and item.lost and effect is not None:
                    self._held_lost[uuid] = (*self._held_lost.get(uuid, ()), item)
                    self._timed = None  # kept on through the next restart
                    logger.warning(
                        "a GPU lost when the agent stopped is still lost: its gpu-lost "
                        "taint is raised again once it answers, for quiet time from then",
                        extra={"fields": fields},
                    )
                    continue
                if item.device not in (names or ()) or effect is None:
                    why = (
                        "the device is gone"
                        if effect is not None
                        else "its effect is none of " + ", ".join(e.value for e in TaintEffect)
                    )
                    logger.warning(
                        "a taint that waited for quiet time is not raised again: " + why,
                        extra={"fields": fields},
                    )
                    continue
                quiet_since = now if item.lost else item.quiet_since
                quiet = now - quiet_since
                if quiet >= policy.recovery_after_s:
                    logger.info(
                        "a taint's quiet time ran out while the agent was down; not raised again",
                        extra={"fields": {**fields, "quiet_s": round(quiet, 1)}},
                    )
                    continue
                key, value = (
                    (policy.gpu_lost_key, None)
                    if item.xid is None
                    else (policy.xid_key, str(item.xid))
                )
                record = self._records[item.device]
                if key in record.active:
                    continue
                # Quiet since no later than now: a time from another boot (its ID was
                # unreadable) at worst keeps the taint `recovery_after_s` from here.
                record.active[key] = _Active(
                    Taint(key, value, effect, item.time_added), min(quiet_since, now)
                )
                self._touch(item.device)
                changed = True
                logger.warning(
                    "a taint that waits for quiet time is raised again",
                    extra={
                        "fields": {
                            **fields,
                            "lifts_in_s": round(policy.recovery_after_s - max(quiet, 0.0), 1),
                        }
                    },
                )
        if changed:
            self._bump()
        return changed

    def expire(self) -> bool:
        """Lift taints that waited for time, not a reset: `recovery_after_s` of quiet."""
        now = self._clock()
        policy = self._policy
        changed = False
        for name, record in self._records.items():
            uuid = record.gpu_uuid
            for key, active in list(record.active.items()):
                if active.needs_reset:
                    continue
                if key == policy.gpu_lost_key and uuid in self._lost:
                    continue
                if key == policy.unmonitored_key and (
                    uuid in self._unmonitored or uuid in self._mig_unwatched
                ):
                    continue
                if uuid in self._flagged.get(key, ()):
                    continue
                if now - active.last_seen >= policy.recovery_after_s:
                    changed |= self._lift(name, key)
        if changed:
            self._bump()
        return changed

    # --- internals ---------------------------------------------------------------------------

    def _raise(
        self, name: str, key: str, value: str | None, effect: TaintEffect, *, reset: bool = False
    ) -> bool:
        record = self._records[name]
        now = self._clock()
        current = record.active.get(key)
        if current is not None:
            if current.needs_reset and not reset:
                return False  # only a reset lifts it: a kind that heals by time does not replace it
            if _SEVERITY[current.taint.effect] > _SEVERITY[effect]:
                return False  # a milder event does not soften or prolong a worse one
            if current.taint.effect is effect and (
                current.taint.value == value or effect is TaintEffect.NONE
            ):
                # The same taint, or another informational value for an informational
                # one (module docstring): it goes `recovery_after_s` after this.
                current.last_seen = now
                self._refreshes += 1
                return False
        record.active[key] = _Active(Taint(key, value, effect, self._wall_clock()), now, reset)
        self._touch(name)
        logger.info(
            "device tainted",
            extra={
                "fields": {
                    "device": name,
                    "key": key,
                    "value": value,
                    "effect": effect.value,
                    "needsReset": reset,
                }
            },
        )
        return True

    def _xid_targets(
        self, event: XidEvent, names: tuple[str, ...], *, reset: bool
    ) -> tuple[str, ...]:
        """The devices an XID taints (module docstring): the whole GPU for one not
        attributed to an instance or one that has the GPU reset; else the instance's
        device and every device sharing a memory slice with it; else none."""
        if reset or (event.device is None and not event.unplaced):
            return names
        gpu = self._inventory.gpu_by_uuid(event.gpu_uuid)
        carved = (*gpu.mig_devices, *gpu.partitions) if gpu is not None else ()
        hit = next((d for d in carved if d.name == event.device), None)
        if gpu is None or hit is None:
            logger.warning(
                "an XID on a GPU instance that is gone taints no device: the GPU's other "
                "instances are not that instance's",
                extra={
                    "fields": {"uuid": event.gpu_uuid, "xid": event.xid, "device": event.device}
                },
            )
            return ()
        at = hit.placement
        if at is None:  # where it sits is unknown (NVML withheld placements)
            return (hit.name,)
        overlapping = {
            d.name
            for d in carved
            if d.placement is not None and d.placement.start < at.end and at.start < d.placement.end
        }
        overlapping.add(gpu.device.name)  # the whole GPU holds every memory slice
        return tuple(n for n in names if n in overlapping)

    def _reset_taint(self, item: PendingReset) -> tuple[str, str]:
        """The key and value of the taint a pending reset stands for."""
        policy = self._policy
        if item.xid is None:
            return policy.ecc_key, "double-bit"
        return policy.xid_key, str(item.xid)

    def _hold_reset(self, uuid: str, item: PendingReset) -> None:
        """Hold a pending reset of a GPU out of the inventory (`restore_resets`)."""
        held = self._held_resets.get(uuid, ())
        if item not in held:
            # Replaced whole: `pending_resets` sees the change, and keeps it on through
            # the next restart.
            self._held_resets = {**self._held_resets, uuid: (*held, item)}

    def _lift_resets(self, gpu_uuid: str, why: str) -> bool:
        """Lift the taints of `gpu_uuid`'s devices that waited for its reset, and drop
        those held for it while it is out of the inventory; True where a device's
        taints changed."""
        held = self._held_resets.get(gpu_uuid, ())
        if held:
            self._held_resets = {u: p for u, p in self._held_resets.items() if u != gpu_uuid}
        dropped = [f"{p.device} {'='.join(self._reset_taint(p))}" for p in held]
        lifted: list[str] = []
        for name in self._gpu_devices.get(gpu_uuid, ()):
            record = self._records[name]
            for key, active in list(record.active.items()):
                if active.needs_reset:
                    del record.active[key]
                    self._touch(name)
                    lifted.append(f"{name} {key}={active.taint.value}")
        fields: dict[str, Any] = {"uuid": gpu_uuid, "why": why, "lifted": lifted}
        if dropped:
            fields["heldDropped"] = dropped  # held for a GPU out of the inventory
        logger.log(
            logging.INFO if lifted or dropped else logging.DEBUG,
            "GPU reset: taints that waited for it lifted"
            if lifted or dropped
            else "GPU reset: no taint waited for it",
            extra={"fields": fields},
        )
        return bool(lifted)

    def _watch_mig_instances(self) -> None:
        """Mark unmonitored the MIG devices of each GPU whose MIG instance events NVML
        withholds. nvml.h, nvmlEventSetWait_v2: in MIG mode it reports the events of
        the instances only to a caller with the privilege (the MIG monitor capability),
        otherwise only those of the whole device; discovery records that privilege
        missing as the GPU's gaps (NVML refused it a field with NO_PERMISSION)."""
        if not self._watched:
            return
        gpus = [gpu for gpu in self._inventory.gpus if gpu.mig_enabled and gpu.gaps]
        for gpu in gpus:
            privilege = gpu.gaps[0].privilege
            if gpu.uuid not in self._mig_unwatched:
                logger.warning(
                    "NVML withholds this GPU's MIG instance events: its MIG devices are "
                    "marked unmonitored",
                    extra={"fields": {"uuid": gpu.uuid, "needs": privilege}},
                )
            for name in self._gpu_devices[gpu.uuid]:
                if name != gpu.device.name:
                    self._raise(name, self._policy.unmonitored_key, None, TaintEffect.NONE)
        self._mig_unwatched = {gpu.uuid: gpu.gaps[0].privilege for gpu in gpus}

    def _follow_gpu_flags(self) -> None:
        """Taint every device of a GPU one of whose `_GPU_FLAGS` a reading says, and lift
        that once a reading says otherwise. A GPU NVML gives no reading for (the row
        remapper of a MIG-enabled one with instances) keeps what the last one said, also
        for MIG devices made since."""
        if not self._watched:
            return
        policy = self._policy
        for flag in _GPU_FLAGS:
            key = flag.key(policy)
            flagged = self._flagged.setdefault(key, set())
            flagged &= set(self._gpu_devices)
            for gpu in self._inventory.gpus:
                says = flag.read(gpu)
                if says is None:
                    says = gpu.uuid in flagged
                names = self._gpu_devices[gpu.uuid]
                if says:
                    if gpu.uuid not in flagged:
                        logger.error(flag.raised, extra={"fields": {"uuid": gpu.uuid}})
                        flagged.add(gpu.uuid)
                    for name in names:
                        self._raise(name, key, flag.value, policy.critical_effect)
                elif gpu.uuid in flagged:
                    flagged.discard(gpu.uuid)
                    logger.info(flag.cleared, extra={"fields": {"uuid": gpu.uuid}})
                    for name in names:
                        self._lift(name, key)

    def _lift(self, name: str, key: str) -> bool:
        """Lift the device's taint `key` at once; False where it has none."""
        if self._records[name].active.pop(key, None) is None:
            return False
        self._touch(name)
        logger.info("device taint lifted", extra={"fields": {"device": name, "key": key}})
        return True

    def _touch(self, name: str) -> None:
        self._records[name].updated_at = self._wall_clock().timestamp()

    def _bump(self) -> None:
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _device_health(self, name: str, record: _Record) -> DeviceHealthState:
        actives = tuple(record.active.values())
        taints = tuple(a.taint for a in actives)
        healthy = all(t.effect is TaintEffect.NONE for t in taints)
        return DeviceHealthState(
            name=name,
            gpu_uuid=record.gpu_uuid,
            healthy=healthy,
            message=(
                "; ".join(self._describe(a, record.gpu_uuid) for a in actives)
                if self._watched
                else HEALTH_CHECKS_OFF
            ),
            taints=taints,
            updated_at=record.updated_at,
            monitored=self._watched and all(t.key != self._policy.unmonitored_key for t in taints),
        )

    def _describe(self, active: _Active, gpu_uuid: str) -> str:
        policy = self._policy
        taint = active.taint
        reset = f": {self._reset_hint(gpu_uuid)}" if active.needs_reset else ""
        if taint.key == policy.xid_key:
            xid = int(taint.value) if taint.value is not None else None
            kind = "critical error"
            if xid is not None and policy.is_application_xid(xid):
                kind = "application error"
            elif taint.effect is TaintEffect.NONE and xid in policy.ignored_xids:
                kind = "informational: NVIDIA's XID catalogue has it ignored"
            elif taint.effect is TaintEffect.NONE and xid in policy.restarted_xids:
                kind = "informational: NVIDIA's XID catalogue has the application restarted"
            elif taint.effect is TaintEffect.NONE:
                kind = "informational"  # XID 154 whose recovery action is none
            return f"XID {taint.value} ({kind}){reset}"
        if taint.key == policy.ecc_key:
            return f"uncorrectable (double-bit) ECC error{reset}"
        for flag in _GPU_FLAGS:
            if taint.key == flag.key(policy):
                return flag.message
        if taint.key == policy.gpu_lost_key:
            if gpu_uuid in self._lost:
                return "GPU is lost (fell off the bus or stopped answering)"
            return "GPU was lost and answers again; waiting for it to stay healthy"
        if taint.key == policy.unmonitored_key:
            privilege = self._mig_unwatched.get(gpu_uuid)
            if gpu_uuid in self._unmonitored or privilege is None:
                return "health events unavailable for this GPU"
            return (
                "errors of this MIG device are not seen: NVML reports MIG instance events "
                f"only to an agent with {privilege} (the chart runs the agent privileged for "
                "real GPUs); errors of the whole GPU still are"
            )
        return taint.key

    def _reset_hint(self, gpu_uuid: str) -> str:
        """What lifts a taint that waits for a reset: the admin's mark, named in full."""
        marker = self._resets.marker(gpu_uuid) if self._resets is not None else None
        if marker is None:
            return "needs a GPU reset; stays until the GPU is reset and the agent restarted"
        return f"needs a GPU reset; after resetting the GPU, create the file {marker} on the node"


# --- the NVML watcher ------------------------------------------------------------------------

_REGISTER_RETRY_MAX_S = 300.0
"""The longest wait between two tries to register a GPU's events (the waits double)."""

_DEFAULT_EVENT_MASK = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)


class NvmlHealthWatcher:
    """Feeds a `HealthState` from NVML events until cancelled.

    Blocking NVML calls run in a worker thread (`anyio.to_thread`); each wait is at most
    `wait_timeout_ms`, which bounds how long cancellation takes. Before each wait it
    registers the events of GPUs the inventory gained (`_watch_added`); between events
    it checks whether lost GPUs were reset and lets taints expire. A GPU found lost
    leaves the event set (`_wait_says_lost`) until it was reset. With `resets`
    it also takes the admin's reset marks and keeps the taints that wait for a reset
    in the state folder, so that an agent restart raises them again; with `timed` it
    keeps there the taints that wait for quiet time, each time they change.
    """

    def __init__(
        self,
        nvml: NvmlLibrary,
        state: HealthState,
        *,
        wait_timeout_ms: int = 500,
        event_mask: int = _DEFAULT_EVENT_MASK,
        resets: GpuResets | None = None,
        timed: TimedTaints | None = None,
        register_retry_s: float = 10.0,
    ) -> None:
        if wait_timeout_ms <= 0:
            msg = "wait_timeout_ms must be positive"
            raise ValueError(msg)
        self._nvml = nvml
        self._state = state
        self._timeout_ms = wait_timeout_ms
        self._mask = event_mask
        self._resets = resets
        self._saved: Mapping[str, tuple[PendingReset, ...]] | None = None  # as on disk
        self._save_failed = False
        self._taken: set[str] = set()  # reset marks applied, removed once that is saved
        self._stuck: set[str] = set()  # reset marks that could not be removed
        self._stray_marks: frozenset[str] = frozenset()  # reset marks naming no GPU here
        self._timed = timed
        self._timed_saved: Mapping[str, tuple[TimedTaint, ...]] | None = None  # as on disk
        self._event_set: Any = None
        # Worker-thread side, read and changed there only.
        self._lost: set[str] = set()  # lost GPUs, as the watcher saw them
        self._handles: dict[str, Any] = {}  # GPU UUID -> handle, for GPU-scoped probes
        self._watched: set[str] = set()  # GPUs whose events registration was tried
        self._registered: set[str] = set()  # GPUs whose events the event set holds
        # GPU -> (when to try again, the wait before that try) for a registration that
        # failed: a GPU tried once and left unwatched would hide its errors for good.
        self._retries: dict[str, tuple[float, float]] = {}
        self._register_retry_s = register_retry_s
        self._still_lost = False  # the last wait said lost, and no GPU was found lost
        self._inventory_seen: Inventory | None = None  # what `_watch_added` compared last
        self._not_reset: dict[str, str] = {}  # lost GPU -> why it is not taken as reset

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; `task_status.started()` fires once events are registered."""
        events = await anyio.to_thread.run_sync(self._setup)
        try:
            self._apply(events)
            await self._keep_resets(events)
            await self._keep_timed()
            task_status.started()
            while True:
                events = await anyio.to_thread.run_sync(self._next_events)
                self._apply(events)
                await self._keep_resets(events)
                await self._keep_timed()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._teardown)

    def _apply(self, events: Iterable[HealthEvent]) -> None:
        for event in events:
            self._state.apply(event)
        self._state.expire()

    async def _keep_resets(self, events: Iterable[HealthEvent]) -> None:
        """Write the taints that wait for a reset when they changed, then remove the
        reset marks taken (after the write: a crash in between only finds them again)."""
        if self._resets is None:
            return
        self._taken.update(e.gpu_uuid for e in events if isinstance(e, GpuResetEvent))
        pending = self._state.pending_resets()
        if pending != self._saved or (self._taken and not self._save_failed):
            await anyio.to_thread.run_sync(self._write_resets, self._resets, pending)

    async def _keep_timed(self) -> None:
        """Write the taints that wait for quiet time when they changed (a repeated error
        moves its quiet time); a write that failed is tried again at the next change."""
        if self._timed is None:
            return
        timed = self._state.timed_taints()
        if timed != self._timed_saved:
            self._timed_saved = timed
            await anyio.to_thread.run_sync(self._write_timed, self._timed, timed)

    # --- worker-thread side ------------------------------------------------------------------

    def _write_timed(self, store: TimedTaints, timed: Mapping[str, tuple[TimedTaint, ...]]) -> None:
        try:
            store.save(timed)
        except OSError as err:
            logger.error(
                "cannot keep the taints that wait for quiet time: an agent restart would "
                "lift them early",
                extra={"fields": {"path": str(store.path), "error": str(err)}},
            )

    def _write_resets(
        self, resets: GpuResets, pending: Mapping[str, tuple[PendingReset, ...]]
    ) -> None:
        if pending != self._saved:
            self._saved = pending  # on failure: tried again at the next change, not every wait
            try:
                resets.save(pending)
            except OSError as err:
                logger.error(
                    "cannot keep the taints that wait for a GPU reset: an agent restart "
                    "would lift them; reset marks stay until the file is written",
                    extra={"fields": {"path": str(resets.path), "error": str(err)}},
                )
                self._save_failed = True
                return
            self._save_failed = False
        if self._save_failed:
            return
        self._stuck.update(uuid for uuid in self._taken if not resets.unmark(uuid))
        self._taken.clear()

    def _next_events(self) -> list[HealthEvent]:
        return [
            *self._reset_marks(),
            *self._watch_added(),
            *self._retry_registrations(),
            *self._wait_once(),
        ]

    def _reset_marks(self) -> list[HealthEvent]:
        """The admin's marks of GPUs reset by hand; a mark naming no GPU here is
        reported once and left alone. A GPU out of the inventory whose taints that wait
        for a reset are held (`HealthState.restore_resets`) is here: its mark is taken
        and drops them, as it lifts those of a GPU in the inventory."""
        if self._resets is None:
            return []
        marked = self._resets.marked()
        self._stuck &= marked
        # Held first: `update_inventory` sets the inventory, then lets the GPU go from the
        # held ones, so a GPU coming back is in one or the other whatever this thread sees.
        held = self._state.held_reset_gpus
        known = {gpu.uuid for gpu in self._state.inventory.gpus} | held
        stray = marked - known
        for name in sorted(stray - self._stray_marks):
            logger.warning(
                "a GPU reset mark names no GPU of this node; name it after a GPU UUID "
                "(nvidia-smi -L)",
                extra={"fields": {"path": str(self._resets.reset_dir / name)}},
            )
        self._stray_marks = stray
        fresh = (marked & known) - self._taken - self._stuck
        return [GpuResetEvent(uuid) for uuid in sorted(fresh)]

    def _setup(self) -> list[HealthEvent]:
        self._nvml.nvmlInit()
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except pynvml.NVMLError:
            self._nvml.nvmlShutdown()
            raise
        return self._watch_added()

    def _watch_added(self) -> list[HealthEvent]:
        """Register the events of each GPU of the inventory not tried yet: at start all
        of them, later those a rescan added. A GPU lost when the agent started is left
        out of discovery until it answers; unregistered, its XIDs, ECC errors and next
        loss would go unseen. A GPU the inventory dropped is forgotten, so it is
        registered afresh should it come back. Cheap per wait: the GPUs are compared
        only when the inventory is a new one."""
        inventory = self._state.inventory
        if inventory is self._inventory_seen:
            return []
        started = self._inventory_seen is not None
        self._inventory_seen = inventory
        uuids = {gpu.uuid for gpu in inventory.gpus}
        for gone in self._watched - uuids:
            self._handles.pop(gone, None)
            self._retries.pop(gone, None)
            self._registered.discard(gone)
            self._lost.discard(gone)
            self._not_reset.pop(gone, None)
        self._watched &= uuids
        events: list[HealthEvent] = []
        for gpu in inventory.gpus:
            if gpu.uuid in self._watched:
                continue
            self._watched.add(gpu.uuid)
            event = self._register(gpu.uuid)
            if event is not None:
                events.append(event)
            elif started:
                logger.info(
                    "watching the health events of a GPU the inventory gained",
                    extra={"fields": {"uuid": gpu.uuid, "index": gpu.index}},
                )
        return events

    def _register(self, uuid: str, *, waited: float = 0.0) -> HealthEvent | None:
        """Register the GPU's events: None once done, else the event that says why not.
        After an NVML error other than a lost GPU it is tried again later
        (`_retry_registrations`), twice as long after the wait `waited` before this try."""
        try:
            return self._register_events(uuid)
        except pynvml.NVMLError_GpuIsLost:
            self._lost.add(uuid)
            return GpuLostEvent(uuid)
        except pynvml.NVMLError as err:
            wait = min(max(waited * 2, self._register_retry_s), _REGISTER_RETRY_MAX_S)
            self._retries[uuid] = (time.monotonic() + wait, wait)
            logger.warning(
                "cannot watch GPU health events; trying again later",
                extra={"fields": {"uuid": uuid, "error": str(err), "retry_in_s": wait}},
            )
            return UnmonitoredEvent(uuid, str(err))

    def _retry_registrations(self) -> list[HealthEvent]:
        """Try again to register the GPUs whose registration failed, each when its wait
        is over. One that succeeds is monitored again; a GPU lost meanwhile is
        registered once it was reset (`_reset_seen`), one the inventory dropped not."""
        now = time.monotonic()
        events: list[HealthEvent] = []
        for uuid, (due, _) in sorted(self._retries.items()):
            if due > now:
                continue
            _, waited = self._retries.pop(uuid)
            if uuid in self._lost or uuid in self._registered or uuid not in self._watched:
                continue
            event = self._register(uuid, waited=waited)  # a failure schedules the next try
            if event is None:
                logger.info(
                    "watching the health events of a GPU again", extra={"fields": {"uuid": uuid}}
                )
                event = MonitoredEvent(uuid)
            events.append(event)
        return events

    def _register_events(self, uuid: str) -> UnmonitoredEvent | None:
        """`_register`, raising NVML's errors. A GPU that supports none of the event types
        watched answered: it is unmonitored (NVML refuses an empty mask), not failing."""
        handle = self._handle(uuid)
        mask = self._mask & self._nvml.nvmlDeviceGetSupportedEventTypes(handle)
        if not mask:
            reason = "the GPU supports none of the watched event types"
            logger.warning(
                "cannot watch GPU health events",
                extra={"fields": {"uuid": uuid, "error": reason}},
            )
            return UnmonitoredEvent(uuid, reason)
        self._nvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
        self._registered.add(uuid)
        return None

    def _handle(self, uuid: str) -> Any:
        """The GPU's handle, looked up once (`device_handle`) and kept for its scoped calls."""
        handle = self._handles.get(uuid)
        if handle is None:
            handle = device_handle(self._nvml, uuid)
            self._handles[uuid] = handle
        return handle

    def _teardown(self) -> None:
        if self._event_set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except pynvml.NVMLError as err:
            logger.warning("nvmlEventSetFree failed", extra={"fields": {"error": str(err)}})
        finally:
            self._event_set = None
            self._registered.clear()
            try:
                self._nvml.nvmlShutdown()
            except pynvml.NVMLError as err:
                logger.warning("nvmlShutdown failed", extra={"fields": {"error": str(err)}})

    def _wait_once(self) -> list[HealthEvent]:
        try:
            data = self._nvml.nvmlEventSetWait_v2(self._event_set, self._timeout_ms)
        except pynvml.NVMLError_Timeout:
            self._still_lost = False
            return self._probe_lost()
        except pynvml.NVMLError_GpuIsLost:
            return self._wait_says_lost()
        except pynvml.NVMLError as err:
            logger.warning("waiting for NVML events failed", extra={"fields": {"error": str(err)}})
            time.sleep(self._timeout_ms / 1000)  # do not spin on a persistent error
            return []
        self._still_lost = False
        return self._read_event(data)

    def _wait_says_lost(self) -> list[HealthEvent]:
        """The wait answered GPU_IS_LOST: a state, not an event (module docstring).

        Waiting again at once would get the same answer at once: the watcher would spin,
        flood the log and read no event of the GPUs still healthy. So the GPUs newly lost
        are found (`_find_lost`) and the event set is built again without the lost ones
        (`_rebuild_event_set`); a lost GPU is registered again once it was reset
        (`_reset_seen`). Where NVML still says lost and no GPU is newly lost (a lost GPU
        the set holds although it could not be rebuilt, or an NVML that says so for a
        GPU outside the set) the watcher waits the wait timeout and checks whether lost
        GPUs were reset, as after a quiet wait; the warning that no GPU was found lost is
        logged once for such a stretch, not for every wait.
        """
        events = self._find_lost(warn=not self._still_lost)
        if self._registered & self._lost:
            rebuilt = self._rebuild_event_set()
            if rebuilt is not None:
                return [*events, *rebuilt]
        if events:
            return events
        self._still_lost = True
        time.sleep(self._timeout_ms / 1000)
        return self._probe_lost()

    def _rebuild_event_set(self) -> list[HealthEvent] | None:
        """Replace the event set by one that holds the GPUs it held less the lost ones;
        None where NVML makes no new set (the old one is kept).

        What the old set still holds is read first (without waiting), so that events
        queued before the loss are not freed with it. Each GPU is registered again
        through `_register`: one that turns out lost or fails is reported so.
        """
        events = self._drain()
        try:
            fresh = self._nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            logger.warning(
                "cannot build the NVML event set again without the lost GPUs",
                extra={"fields": {"error": str(err)}},
            )
            return events or None
        old, self._event_set = self._event_set, fresh
        dropped = sorted(self._registered & self._lost)
        kept = sorted(self._registered - self._lost)
        self._registered = set()
        try:
            self._nvml.nvmlEventSetFree(old)
        except pynvml.NVMLError as err:
            logger.warning("nvmlEventSetFree failed", extra={"fields": {"error": str(err)}})
        for uuid in kept:
            event = self._register(uuid)
            if event is not None:
                events.append(event)
        logger.info(
            "NVML event set built again without the lost GPUs",
            extra={"fields": {"lost": dropped, "watched": len(self._registered)}},
        )
        return events

    def _drain(self) -> list[HealthEvent]:
        """The events the event set holds now, read without waiting, until NVML answers
        anything but an event (GPU_IS_LOST, once they are read)."""
        events: list[HealthEvent] = []
        while True:
            try:
                data = self._nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError:
                return events
            events.extend(self._read_event(data))

    def _read_event(self, data: Any) -> list[HealthEvent]:
        """What one event the wait returned means for health."""
        event_type = int(data.eventType)
        if event_type & pynvml.nvmlEventTypeXidCriticalError:
            return self._xid_event(data)
        if event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            uuid, lost = self._event_uuid(data)
            events: list[HealthEvent] = [EccEvent(uuid)] if uuid is not None else []
            return [*events, *self._find_lost()] if lost or uuid is None else events
        logger.debug("ignoring NVML event", extra={"fields": {"type": event_type}})
        return []

    def _event_uuid(self, data: Any) -> tuple[str | None, bool]:
        """The UUID of the GPU an event came from (None where it cannot be told), and
        whether NVML said the GPU is lost, which sends the caller to look for the lost
        GPU. The event is not lost with the lookup: the handle is one of those the events
        were registered on, and NVML hands out one handle per GPU (`handle_address`). A
        GPU that falls off the bus (XID 79) is often lost by the time its XID is read."""
        try:
            return str(self._nvml.nvmlDeviceGetUUID(data.device)), False
        except pynvml.NVMLError as err:
            lost = isinstance(err, pynvml.NVMLError_GpuIsLost)
            address = handle_address(data.device)
            for uuid, handle in self._handles.items():
                if address is not None and handle_address(handle) == address:
                    return uuid, lost
            if not lost:
                logger.warning(
                    "an NVML event's GPU could not be identified",
                    extra={"fields": {"error": str(err)}},
                )
            return None, lost

    def _xid_event(self, data: Any) -> list[HealthEvent]:
        """The XID, and the lost GPU where NVML said one is: a lost GPU's XID is still
        logged, counted and applied (its MIG device and recovery action, which NVML no
        longer answers for it, unknown)."""
        uuid, lost = self._event_uuid(data)
        if uuid is None:
            return self._find_lost()
        xid = int(data.eventData)
        gi = int(data.gpuInstanceId)
        ci = int(data.computeInstanceId)
        whole_gpu = gi == FULL_GPU_INSTANCE_ID
        device = None if whole_gpu or lost else self._mig_device(uuid, gi, ci)
        recovery = self._recovery_action(uuid) if xid == RECOVERY_ACTION_XID and not lost else None
        fields = {"uuid": uuid, "xid": xid, "gi": gi, "ci": ci, "device": device, "lost": lost}
        if recovery is not None:
            fields["recovery_action"] = _RECOVERY_ACTIONS.get(recovery, str(recovery))
        logger.warning("GPU XID event", extra={"fields": fields})
        unplaced = not whole_gpu and device is None
        event = XidEvent(uuid, xid, device, unplaced=unplaced, recovery=recovery)
        return [event, *self._find_lost()] if lost else [event]

    def _recovery_action(self, uuid: str) -> int | None:
        """What the driver says the GPU needs now (NVML_GPU_RECOVERY_ACTION_*); None
        where NVML does not say (a branch before R565, or an error: logged)."""
        try:
            (value,) = self._nvml.nvmlDeviceGetFieldValues(
                self._handle(uuid), [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
            )
        except pynvml.NVMLError as err:
            error = str(err)
        else:
            if value.nvmlReturn == pynvml.NVML_SUCCESS:
                return int(value.value.uiVal)
            error = describe_nvml_error(pynvml.NVMLError(value.nvmlReturn))
        logger.warning(
            "XID 154 without the GPU's recovery action: its taint lifts after quiet time",
            extra={"fields": {"uuid": uuid, "error": error}},
        )
        return None

    def _mig_device(self, uuid: str, gi: int, ci: int) -> str | None:
        """Name of the MIG device a GI/CI-scoped event hit; None where it cannot be named.

        NVML is asked where the instance sits now: under dynamic MIG instances come and
        go between scans, and a new one may get the ID of one the inventory still lists
        at another placement. An instance NVML no longer has (NOT_FOUND: destroyed
        since the event, its claim unprepared) is named by nothing: the last scan's
        instance of that ID may sit where another tenant's instance sits now (module
        docstring). Only where NVML cannot answer at all is the last scan asked.
        """
        gpu = self._state.inventory.gpu_by_uuid(uuid)
        if gpu is None or not gpu.mig_enabled:
            return None
        try:
            parent = self._handle(uuid)
            instance = self._nvml.nvmlDeviceGetGpuInstanceById(parent, gi)
            info = self._nvml.nvmlGpuInstanceGetInfo(instance)
        except pynvml.NVMLError_NotFound:
            return None
        except pynvml.NVMLError:
            # An event of the GPU instance as a whole names no compute instance
            # (FULL_GPU_INSTANCE_ID there too), as NVML's own answer above needs none.
            for mig in gpu.mig_devices:
                if mig.gpu_instance_id == gi and ci in (
                    FULL_GPU_INSTANCE_ID,
                    mig.compute_instance_id,
                ):
                    return mig.name
            return None
        profile = gpu.mig_profiles.get(int(info.profileId))
        if profile is None:
            return None
        return mig_device_name(gpu.minor, profile, int(info.profileId), int(info.placement.start))

    def _gpu_answers(self, uuid: str) -> bool:
        """Whether the GPU itself answers, asked through calls scoped to it.

        Lenient: it only decides that a GPU is not lost (`_find_lost`), so any error
        but GPU_IS_LOST counts as an answer. Whether a lost GPU was reset is the strict
        `_reset_seen`.
        """
        try:
            handle = self._handle(uuid)
            self._nvml.nvmlDeviceGetUUID(handle)
            self._nvml.nvmlDeviceGetPciInfo_v3(handle)
        except pynvml.NVMLError_GpuIsLost:
            return False
        except pynvml.NVMLError:
            return True  # another problem, but the GPU itself is not reported lost
        return True

    def _find_lost(self, *, warn: bool = True) -> list[HealthEvent]:
        """NVML said a GPU is lost without saying which: ask each GPU, twice.

        A GPU counts as lost only if it fails its own probe and the re-check; if
        none does, nothing is tainted (the next wait or probe will tell again)
        instead of tainting every GPU of the node for one GPU's fault. `warn`: log
        that none does (off where the last wait already said so).
        """
        events: list[HealthEvent] = []
        candidates = [g.uuid for g in self._state.inventory.gpus if g.uuid not in self._lost]
        for uuid in candidates:
            if not self._gpu_answers(uuid) and not self._gpu_answers(uuid):
                self._lost.add(uuid)
                events.append(GpuLostEvent(uuid))
        if warn and not events and candidates:
            logger.warning(
                "NVML reported a lost GPU, but every GPU answers its own probes",
                extra={"fields": {"gpus": len(candidates)}},
            )
        return events

    def _probe_lost(self) -> list[HealthEvent]:
        """Take back each lost GPU that was reset (`_reset_seen`)."""
        events: list[HealthEvent] = []
        for uuid in sorted(self._lost):
            found = self._reset_seen(uuid)
            if found is not None:
                self._lost.discard(uuid)
                events.extend(found)
        return events

    def _reset_seen(self, uuid: str) -> list[HealthEvent] | None:
        """The events of a lost GPU that answers again in full; None while it does not.

        Strict, unlike `_gpu_answers`: the GpuRecoveredEvent this yields lifts the
        taints that wait for a GPU reset, and an error is no evidence of one. The GPU
        counts as reset once its own calls succeed under the UUID recorded for it and
        its events are registered again (a reset drops them). Until then it stays
        lost and is asked again at the next probe; an answer other than GPU_IS_LOST is
        logged, once per reason.
        """
        try:
            handle = self._handle(uuid)
            answered = str(self._nvml.nvmlDeviceGetUUID(handle))
            if answered != uuid:
                self._handles.pop(uuid)  # not this GPU's handle now: looked up again next time
                self._not_reset_yet(uuid, f"its handle answers as GPU {answered}")
                return None
            self._nvml.nvmlDeviceGetPciInfo_v3(handle)
            unwatched = self._register_events(uuid)
        except pynvml.NVMLError_GpuIsLost:
            self._not_reset.pop(uuid, None)
            return None
        except pynvml.NVMLError as err:
            self._not_reset_yet(uuid, str(err))
            return None
        self._not_reset.pop(uuid, None)
        return [GpuRecoveredEvent(uuid), unwatched or MonitoredEvent(uuid)]

    def _not_reset_yet(self, uuid: str, why: str) -> None:
        if self._not_reset.get(uuid) != why:
            self._not_reset[uuid] = why
            logger.warning(
                "a lost GPU answers, but not in full: not taken as reset, it stays lost",
                extra={"fields": {"uuid": uuid, "error": why}},
            )
