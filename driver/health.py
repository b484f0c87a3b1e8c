"""Device health: NVML events become device taints and kubelet health statuses.

`HealthState` is the model: plain data, changed only through `apply` (one event) and
`expire` (time passing), with a generation number and `wait_for_change` so that async
consumers (the ResourceSlice publisher, the kubelet health stream) wake up on change and
never miss one. `NvmlHealthWatcher` feeds it from NVML: it blocks in
`nvmlEventSetWait_v2` in a worker thread with a short timeout, so shutdown is prompt.

Policy, following the upstream NVIDIA DRA driver and improving on it where its users hit
problems:
- a critical XID taints the device `gpu.nvidia.com/xid=<xid>` with NoSchedule
  (configurable NoExecute); application XIDs (13, 31, 43, 45, 68, 109 plus a configured
  list) are informational: effect None, the device stays healthy;
- a double-bit ECC error taints `gpu.nvidia.com/ecc=double-bit` like a critical XID;
- a lost GPU taints `gpu.nvidia.com/gpu-lost` with NoExecute;
- a GPU whose events cannot be watched gets `gpu.nvidia.com/unmonitored` (effect None);
- unlike upstream, taints go away again: a device that stays quiet for
  `recovery_after_s` (a lost GPU: after it answers again) loses its taint. The clock is
  injectable so tests need no sleeping.
An event on a whole GPU taints every device carved from it; an event on a MIG device
taints that MIG device only.

Which GPU is lost is decided per GPU from calls scoped to it (on the handle taken when
its events were registered), never from a lookup by UUID: that lookup answers
GPU_IS_LOST for every GPU while any one is lost (nvml.h). NVML's "a GPU is lost" from
the event wait is re-checked the same way, so one lost GPU taints its own devices only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import anyio
import anyio.to_thread
import pynvml
from anyio.abc import TaskStatus
from gpudra.driver.devices import Inventory, mig_device_name
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.nvml.codes import FULL_GPU_INSTANCE_ID
from gpudra.driver.nvml.handles import device_handle

logger = logging.getLogger(__name__)

DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
# XIDs caused by applications, not hardware (NVIDIA's XID catalogue).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


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
    extra_application_xids: frozenset[int] = frozenset()
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

    def is_application_xid(self, xid: int) -> bool:
        return xid in self.application_xids or xid in self.extra_application_xids


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID error; `device` names the MIG device it hit, None for the whole GPU."""

    gpu_uuid: str
    xid: int
    device: str | None = None


@dataclass(frozen=True, slots=True)
class EccEvent:
    """A double-bit (uncorrectable) ECC error."""

    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class GpuLostEvent:
    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class GpuRecoveredEvent:
    """A lost GPU answers again; its taint clears after `recovery_after_s`."""

    gpu_uuid: str


@dataclass(frozen=True, slots=True)
class UnmonitoredEvent:
    """NVML cannot deliver events for this GPU; health is unknown, not bad."""

    gpu_uuid: str
    reason: str


HealthEvent = XidEvent | EccEvent | GpuLostEvent | GpuRecoveredEvent | UnmonitoredEvent


# --- state ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceHealthState:
    """One device's health state: its taints for the ResourceSlice, and what the kubelet
    health stream reports (as a `plugin.DeviceHealth` message) from it.

    `healthy` is False while any taint has effect NoSchedule or NoExecute.
    `updated_at` is the unix time of the device's last change.
    """

    name: str
    gpu_uuid: str
    healthy: bool
    message: str
    taints: tuple[Taint, ...]
    updated_at: float


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


@dataclass(slots=True)
class _Record:
    gpu_uuid: str
    updated_at: float
    active: dict[str, _Active] = field(default_factory=dict)


def _now_utc() -> datetime:
    return datetime.now(UTC)


class HealthState:
    """Taints and health of every device of an inventory.

    Change it from the event loop thread only (`apply`, `expire`, `update_inventory`);
    read it from anywhere through `report()`.
    """

    def __init__(
        self,
        inventory: Inventory,
        policy: HealthPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = _now_utc,
    ) -> None:
        self._policy = policy if policy is not None else HealthPolicy()
        self._clock = clock
        self._wall_clock = wall_clock
        self._generation = 0
        self._changed: anyio.Event | None = None
        self._lost: set[str] = set()
        self._unmonitored: set[str] = set()
        self._records: dict[str, _Record] = {}
        self._gpu_devices: dict[str, tuple[str, ...]] = {}
        self._inventory = inventory
        self._index(inventory)
        self._report: HealthReport | None = None
        # (GPU UUID, XID) -> events seen; replaced whole, so the metrics thread reads one.
        self._xid_counts: Mapping[tuple[str, int], int] = {}

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
        """Follow a new discovery; devices that still exist keep their taints."""
        self._inventory = inventory
        self._index(inventory)
        self._lost &= set(self._gpu_devices)
        self._unmonitored &= set(self._gpu_devices)
        self._bump()

    def report(self) -> HealthReport:
        if self._report is None or self._report.generation != self._generation:
            self._report = HealthReport(
                self._generation,
                {name: self._device_health(name, rec) for name, rec in self._records.items()},
            )
        return self._report

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
            logger.warning(
                "health event for a GPU not in the inventory",
                extra={"fields": {"uuid": event.gpu_uuid, "event": type(event).__name__}},
            )
            return False
        policy = self._policy
        changed = False
        match event:
            case XidEvent(xid=xid, device=device):
                key = (event.gpu_uuid, xid)
                self._xid_counts = {**self._xid_counts, key: self._xid_counts.get(key, 0) + 1}
                targets = (device,) if device is not None and device in names else names
                effect = (
                    TaintEffect.NONE if policy.is_application_xid(xid) else policy.critical_effect
                )
                for name in targets:
                    changed |= self._raise(name, policy.xid_key, str(xid), effect)
            case EccEvent():
                for name in names:
                    changed |= self._raise(
                        name, policy.ecc_key, "double-bit", policy.critical_effect
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
                    changed = True
            case UnmonitoredEvent():
                if event.gpu_uuid not in self._unmonitored:
                    self._unmonitored.add(event.gpu_uuid)
                    for name in names:
                        changed |= self._raise(name, policy.unmonitored_key, None, TaintEffect.NONE)
        if changed:
            self._bump()
        return changed

    def expire(self) -> bool:
        """Lift taints of devices that stayed quiet for `recovery_after_s`."""
        now = self._clock()
        policy = self._policy
        changed = False
        for name, record in self._records.items():
            for key, active in list(record.active.items()):
                if key == policy.gpu_lost_key and record.gpu_uuid in self._lost:
                    continue
                if key == policy.unmonitored_key and record.gpu_uuid in self._unmonitored:
                    continue
                if now - active.last_seen >= policy.recovery_after_s:
                    del record.active[key]
                    self._touch(name)
                    changed = True
                    logger.info(
                        "device taint lifted",
                        extra={"fields": {"device": name, "key": key}},
                    )
        if changed:
            self._bump()
        return changed

    # --- internals ---------------------------------------------------------------------------

    def _raise(self, name: str, key: str, value: str | None, effect: TaintEffect) -> bool:
        record = self._records[name]
        now = self._clock()
        current = record.active.get(key)
        if current is not None:
            if _SEVERITY[current.taint.effect] > _SEVERITY[effect]:
                return False  # a milder event does not soften or prolong a worse one
            if current.taint.value == value and current.taint.effect is effect:
                current.last_seen = now
                return False
        record.active[key] = _Active(Taint(key, value, effect, self._wall_clock()), now)
        self._touch(name)
        logger.info(
            "device tainted",
            extra={"fields": {"device": name, "key": key, "value": value, "effect": effect.value}},
        )
        return True

    def _touch(self, name: str) -> None:
        self._records[name].updated_at = self._wall_clock().timestamp()

    def _bump(self) -> None:
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _device_health(self, name: str, record: _Record) -> DeviceHealthState:
        taints = tuple(a.taint for a in record.active.values())
        healthy = all(t.effect is TaintEffect.NONE for t in taints)
        return DeviceHealthState(
            name=name,
            gpu_uuid=record.gpu_uuid,
            healthy=healthy,
            message="; ".join(self._describe(t, record.gpu_uuid) for t in taints),
            taints=taints,
            updated_at=record.updated_at,
        )

    def _describe(self, taint: Taint, gpu_uuid: str) -> str:
        policy = self._policy
        if taint.key == policy.xid_key:
            kind = (
                "application error"
                if taint.value is not None and policy.is_application_xid(int(taint.value))
                else "critical error"
            )
            return f"XID {taint.value} ({kind})"
        if taint.key == policy.ecc_key:
            return "uncorrectable (double-bit) ECC error"
        if taint.key == policy.gpu_lost_key:
            if gpu_uuid in self._lost:
                return "GPU is lost (fell off the bus or stopped answering)"
            return "GPU was lost and answers again; waiting for it to stay healthy"
        if taint.key == policy.unmonitored_key:
            return "health events unavailable for this GPU"
        return taint.key


# --- the NVML watcher ------------------------------------------------------------------------

_DEFAULT_EVENT_MASK = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)


class NvmlHealthWatcher:
    """Feeds a `HealthState` from NVML events until cancelled.

    Blocking NVML calls run in a worker thread (`anyio.to_thread`); each wait is at most
    `wait_timeout_ms`, which bounds how long cancellation takes. Between events the
    watcher checks whether lost GPUs answer again and lets taints expire.
    """

    def __init__(
        self,
        nvml: NvmlLibrary,
        state: HealthState,
        *,
        wait_timeout_ms: int = 500,
        event_mask: int = _DEFAULT_EVENT_MASK,
    ) -> None:
        if wait_timeout_ms <= 0:
            msg = "wait_timeout_ms must be positive"
            raise ValueError(msg)
        self._nvml = nvml
        self._state = state
        self._timeout_ms = wait_timeout_ms
        self._mask = event_mask
        self._event_set: Any = None
        self._lost: set[str] = set()  # worker-thread view of lost GPUs
        self._handles: dict[str, Any] = {}  # GPU UUID -> handle, for GPU-scoped probes

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; `task_status.started()` fires once events are registered."""
        events = await anyio.to_thread.run_sync(self._setup)
        try:
            self._apply(events)
            task_status.started()
            while True:
                events = await anyio.to_thread.run_sync(self._wait_once)
                self._apply(events)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._teardown)

    def _apply(self, events: Iterable[HealthEvent]) -> None:
        for event in events:
            self._state.apply(event)
        self._state.expire()

    # --- worker-thread side ------------------------------------------------------------------

    def _setup(self) -> list[HealthEvent]:
        self._nvml.nvmlInit()
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except pynvml.NVMLError:
            self._nvml.nvmlShutdown()
            raise
        events: list[HealthEvent] = []
        for gpu in self._state.inventory.gpus:
            event = self._register(gpu.uuid)
            if event is not None:
                events.append(event)
        return events

    def _register(self, uuid: str) -> HealthEvent | None:
        try:
            handle = self._handles.get(uuid)
            if handle is None:
                handle = device_handle(self._nvml, uuid)
                self._handles[uuid] = handle
            supported = self._nvml.nvmlDeviceGetSupportedEventTypes(handle)
            mask = self._mask & supported
            if not mask:  # NVML refuses an empty mask; nothing we watch exists here
                reason = "the GPU supports none of the watched event types"
                logger.warning(
                    "cannot watch GPU health events",
                    extra={"fields": {"uuid": uuid, "error": reason}},
                )
                return UnmonitoredEvent(uuid, reason)
            self._nvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
        except pynvml.NVMLError_GpuIsLost:
            self._lost.add(uuid)
            return GpuLostEvent(uuid)
        except pynvml.NVMLError as err:
            logger.warning(
                "cannot watch GPU health events",
                extra={"fields": {"uuid": uuid, "error": str(err)}},
            )
            return UnmonitoredEvent(uuid, str(err))
        return None

    def _teardown(self) -> None:
        if self._event_set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except pynvml.NVMLError as err:
            logger.warning("nvmlEventSetFree failed", extra={"fields": {"error": str(err)}})
        finally:
            self._event_set = None
            try:
                self._nvml.nvmlShutdown()
            except pynvml.NVMLError as err:
                logger.warning("nvmlShutdown failed", extra={"fields": {"error": str(err)}})

    def _wait_once(self) -> list[HealthEvent]:
        try:
            data = self._nvml.nvmlEventSetWait_v2(self._event_set, self._timeout_ms)
        except pynvml.NVMLError_Timeout:
            return self._probe_lost()
        except pynvml.NVMLError_GpuIsLost:
            return self._find_lost()
        except pynvml.NVMLError as err:
            logger.warning("waiting for NVML events failed", extra={"fields": {"error": str(err)}})
            time.sleep(self._timeout_ms / 1000)  # do not spin on a persistent error
            return []
        event_type = int(data.eventType)
        if event_type & pynvml.nvmlEventTypeXidCriticalError:
            return self._xid_event(data)
        if event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            uuid = self._event_uuid(data)
            return [EccEvent(uuid)] if uuid is not None else self._find_lost()
        logger.debug("ignoring NVML event", extra={"fields": {"type": event_type}})
        return []

    def _event_uuid(self, data: Any) -> str | None:
        try:
            return str(self._nvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError:
            return None

    def _xid_event(self, data: Any) -> list[HealthEvent]:
        uuid = self._event_uuid(data)
        if uuid is None:
            return self._find_lost()
        xid = int(data.eventData)
        gi = int(data.gpuInstanceId)
        ci = int(data.computeInstanceId)
        device = None if gi == FULL_GPU_INSTANCE_ID else self._mig_device(uuid, gi, ci)
        logger.warning(
            "GPU XID event",
            extra={"fields": {"uuid": uuid, "xid": xid, "gi": gi, "ci": ci, "device": device}},
        )
        return [XidEvent(uuid, xid, device)]

    def _mig_device(self, uuid: str, gi: int, ci: int) -> str | None:
        """Name of the MIG device a GI/CI-scoped event hit; None: treat as the whole GPU."""
        gpu = self._state.inventory.gpu_by_uuid(uuid)
        if gpu is None or not gpu.mig_enabled:
            return None
        for mig in gpu.mig_devices:
            if mig.gpu_instance_id == gi and mig.compute_instance_id == ci:
                return mig.name
        # A MIG device created after discovery (dynamic MIG): ask NVML where it sits.
        try:
            parent = self._handles.get(uuid) or device_handle(self._nvml, uuid)
            instance = self._nvml.nvmlDeviceGetGpuInstanceById(parent, gi)
            info = self._nvml.nvmlGpuInstanceGetInfo(instance)
        except pynvml.NVMLError:
            return None
        profile = gpu.mig_profiles.get(int(info.profileId))
        if profile is None:
            return None
        return mig_device_name(gpu.minor, profile, int(info.profileId), int(info.placement.start))

    def _gpu_answers(self, uuid: str) -> bool:
        """Whether the GPU itself answers, asked through calls scoped to it."""
        try:
            handle = self._handles.get(uuid)
            if handle is None:
                handle = device_handle(self._nvml, uuid)
                self._handles[uuid] = handle
            self._nvml.nvmlDeviceGetUUID(handle)
            self._nvml.nvmlDeviceGetPciInfo_v3(handle)
        except pynvml.NVMLError_GpuIsLost:
            return False
        except pynvml.NVMLError:
            return True  # another problem, but the GPU itself is not reported lost
        return True

    def _find_lost(self) -> list[HealthEvent]:
        """NVML said a GPU is lost without saying which: ask each GPU, twice.

        A GPU counts as lost only if it fails its own probe and the re-check; if
        none does, nothing is tainted (the next wait or probe will tell again)
        instead of tainting every GPU of the node for one GPU's fault.
        """
        events: list[HealthEvent] = []
        candidates = [g.uuid for g in self._state.inventory.gpus if g.uuid not in self._lost]
        for uuid in candidates:
            if not self._gpu_answers(uuid) and not self._gpu_answers(uuid):
                self._lost.add(uuid)
                events.append(GpuLostEvent(uuid))
        if not events and candidates:
            logger.warning(
                "NVML reported a lost GPU, but every GPU answers its own probes",
                extra={"fields": {"gpus": len(candidates)}},
            )
        return events

    def _probe_lost(self) -> list[HealthEvent]:
        events: list[HealthEvent] = []
        for uuid in sorted(self._lost):
            if self._gpu_answers(uuid):
                self._lost.discard(uuid)
                events.append(GpuRecoveredEvent(uuid))
                again = self._register(uuid)  # a reset GPU needs its events re-registered
                if again is not None:
                    events.append(again)
        return events
