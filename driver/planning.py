"""Planning a prepare: what each allocated device of a checked claim needs.

For every device of the claim: find it in the view the slices were published with,
resolve its config (class configs before claim configs, a subrequest's own binding
included) and decide what its prepare does: create a MIG instance, set the GPU's
time-slice, join the claim's MPS daemon. Every refusal a claim's content can cause
happens here, before anything on the node changes.

Pure: the inventory and the checkpoint (who holds a device) are read, nothing is
written; errors are the claim's (`ClaimError`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from gpudra.api.config import (
    INTERVALS,
    ConfigError,
    DeviceConfig,
    interval_value,
    join_path,
)
from gpudra.api.config import DeviceType as ConfigDeviceType
from gpudra.api.names import base_request
from gpudra.api.sharing import (
    mps_daemon_settings,
    mps_setting_conflict,
    resolve_sharing,
    sharing_of,
)
from gpudra.driver.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from gpudra.driver.claims import AllocatedDevice, Claim, ClaimError, ClaimRef, config_error
from gpudra.driver.devices import Device, DeviceType, Gpu, Inventory, MigStrategy, Version
from gpudra.driver.records import DeviceDetails, TimeSliceSet, UsedMig

__all__ = [
    "Entry",
    "interval_name",
    "mps_limits",
    "mps_settings",
    "other_claim",
    "plan",
    "time_slice_conflict",
]

log = logging.getLogger(__name__)

_DEFAULT_INTERVAL: Final = interval_value("Default")
MULTI_USER_MPS_CAPABILITY: Final = (7, 0)
"""Volta: the oldest GPUs NVIDIA's MPS guide runs a multi-user MPS server on."""


@dataclass(slots=True)
class Entry:
    """One device of the claim being prepared; `details` grows a record for each
    side effect as the prepare makes it (see `gpudra.driver.records`)."""

    allocated: AllocatedDevice
    gpu: Gpu
    device: Device
    config: DeviceConfig
    config_path: str
    details: DeviceDetails
    alone: bool = True
    """No other claim may hold the device beside this one: it is not shared, or this
    claim took all of its shares or memory."""
    create_mig: bool = False
    mps: bool = False
    time_slice: int | None = None
    cdi_ids: tuple[str, ...] = ()

    @property
    def share_id(self) -> str | None:
        return self.allocated.share_id

    @property
    def admin(self) -> bool:
        return self.allocated.admin_access

    @property
    def base_request(self) -> str:
        return base_request(self.allocated.request)

    @property
    def uuid(self) -> str | None:
        return self.details.uuid

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
            exclusive=self.alone,
            details=self.details,
        )


def plan(
    claim: Claim,
    *,
    inventory: Inventory | None,
    checkpoint: Checkpoint,
    pool: str,
    mig_strategy: MigStrategy,
    shares: Mapping[str, int] | None = None,
) -> list[Entry]:
    """The entries of `claim`'s devices, checked; raises ClaimError. `shares`: the
    integer shares each GPU is published with (by device name)."""
    ref = claim.ref
    if inventory is None:
        raise ClaimError(
            f"{ref.describe()}: this node's GPUs have not been discovered yet; the "
            "kubelet retries the prepare"
        )
    entries = [
        _entry(claim, allocated, inventory, checkpoint, pool, mig_strategy, shares or {})
        for allocated in claim.devices
    ]
    names = [e.cdi_name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ClaimError(
            f"{ref.describe()}: device {', '.join(duplicates)} is allocated twice to "
            "this claim without a shareID"
        )
    _check_time_slices(claim, checkpoint, pool, entries)
    _check_mps(claim, entries)
    return entries


def _lookup(inventory: Inventory, name: str, strategy: MigStrategy) -> tuple[Gpu, Device] | None:
    """The device of `name` in the view the slices were published with."""
    for gpu in inventory.gpus:
        if gpu.device.name == name:
            return gpu, gpu.device
        view = gpu.partitions if strategy is MigStrategy.DYNAMIC else gpu.mig_devices
        for device in view:
            if device.name == name:
                return gpu, device
    return None


def _entry(
    claim: Claim,
    allocated: AllocatedDevice,
    inventory: Inventory,
    checkpoint: Checkpoint,
    pool: str,
    strategy: MigStrategy,
    shares: Mapping[str, int],
) -> Entry:
    ref, where, name = claim.ref, allocated.path, allocated.device
    found = _lookup(inventory, name, strategy)
    if found is None:
        raise ClaimError(
            f"{ref.describe()}: {where}.device: {name!r} is not a device of this node "
            f"({pool}); the ResourceSlice it was allocated from is stale: delete "
            "the pod so that the claim is allocated again"
        )
    gpu, device = found
    if device.type is DeviceType.GPU and gpu.mig_enabled:
        raise ClaimError(
            f"{ref.describe()}: {where}.device: GPU {name} has MIG mode enabled and "
            "cannot be used whole; request one of its MIG devices"
        )
    device_type: ConfigDeviceType = "gpu" if device.type is DeviceType.GPU else "mig"
    # A share that consumed all of the GPU's memory (a plain claim: the request
    # policy defaults to the whole memory) leaves no room for another claim, so it
    # holds the GPU alone, as an exclusive claim does; so does one that took all of a
    # GPU's integer shares. Some of them is no memory slice, but never Exclusive: the
    # claims holding the other shares use the GPU too (time-sliced unless MPS). Where
    # the GPU is not published with shares now, any shares taken count as some.
    share_id = allocated.share_id
    taken = allocated.consumed_shares
    whole = share_id is not None and (
        (taken is not None and taken >= shares.get(device.name, taken + 1))
        or (taken is None and _whole_memory(allocated, device))
    )
    sliced = share_id is not None and taken is None and not whole
    some_shares = taken is not None and not whole
    try:
        # The full "req/sub" name: a config may be bound to the subrequest itself.
        sharing = resolve_sharing(
            device_type,
            claim.class_configs,
            claim.claim_configs,
            allocated.request,
            memory_slice=sliced and not allocated.admin_access,
            where=f"{where} (shareID {share_id})" if sliced else where,
            integer_share=some_shares and not allocated.admin_access,
        )
    except ConfigError as exc:
        raise config_error(ref, exc) from None
    entry = Entry(
        allocated=allocated,
        gpu=gpu,
        device=device,
        config=sharing.config,
        config_path=sharing.path,
        alone=share_id is None or whole,
        details=DeviceDetails(
            type=device_type,
            request=allocated.request,
            gpu_uuid=gpu.uuid,
            gpu_minor=gpu.minor,
            uuid=device.uuid,
            pod=claim.pod,
            pod_uid=claim.pod_uid,
        ),
    )
    if device.type is DeviceType.MIG:
        _plan_mig(claim, checkpoint, pool, entry)
    if entry.admin:
        return entry  # monitoring beside the owner: nothing on the device changes
    entry.time_slice = sharing.time_slice
    entry.mps = sharing.mps
    if entry.time_slice is not None and entry.uuid is not None:
        # Recorded with the plan (`ClaimPreparer._set_time_slice` replaces it once set),
        # so that a claim planned while this one is being prepared sees the interval it
        # relies on; not applied: an undo before the setting resets only on a best-effort
        # basis, and only where no other claim relies on the setting.
        planned = TimeSliceSet(uuid=entry.uuid, interval=entry.time_slice, applied=False)
        entry.details = replace(entry.details, time_slice=planned)
    return entry


def interval_name(value: int) -> str:
    """A time-slice setting as configs spell it (`Long`), for messages."""
    return INTERVALS[value] if 0 <= value < len(INTERVALS) else str(value)


def _relied_interval(entry: Entry) -> int | None:
    """The time-slice interval the device runs under on a GPU it shares with other
    claims; None where it shares no GPU-wide time-slice (admin access, a device held
    alone, a MIG device). A device that sets none (MPS, a memory slice) runs under the
    GPU's Default one."""
    if entry.admin or entry.alone or entry.device.type is not DeviceType.GPU:
        return None
    return _DEFAULT_INTERVAL if entry.time_slice is None else entry.time_slice


def _held_interval(record: ClaimRecord, held: DeviceRecord) -> int | None:
    """The time-slice interval another claim's device relies on, as its record says;
    None where it relies on none: admin access; an exclusive holder (the device conflict
    check refuses sharing it); a record with parts this release cannot read (the
    time-slice step itself names the by-hand remedy); or a prepared time-sliced share
    whose undo has already released its setting (it is leaving). A device without a
    time-slice record otherwise (an MPS share or memory slice, prepared or being
    prepared: a time-sliced share records its interval with its plan) relies on Default."""
    details = held.details
    if held.admin_access or held.exclusive or details.problems:
        return None
    if details.time_slice is not None:
        return details.time_slice.interval
    if record.completed and details.mps is None:
        return None
    return _DEFAULT_INTERVAL


def _check_time_slices(
    claim: Claim, checkpoint: Checkpoint, pool: str, entries: Sequence[Entry]
) -> None:
    """Claims sharing one GPU share its one time-slice setting, and a claim running MPS
    or holding a memory slice on it runs under that setting too, relying on Default
    (it sets none): so every claim on the GPU must rely on the same interval. Checked
    against the claims recorded (prepared or being prepared: the plan and its record
    are made with no other prepare in between) and between this claim's own devices."""
    held: dict[str, list[tuple[ClaimRecord, DeviceRecord]]] = {}  # by device: one scan
    for entry in entries:
        ours = _relied_interval(entry)
        if ours is None:
            continue
        for other in entries:
            if other is entry or other.device.name != entry.device.name:
                continue
            theirs = _relied_interval(other)
            if theirs is not None and theirs != ours:
                raise time_slice_conflict(
                    claim.ref,
                    entry,
                    theirs,
                    asked=other.time_slice is not None,
                    who=f"this claim's {other.allocated.path}",
                )
        name = entry.device.name
        if name not in held:
            held[name] = checkpoint.holders((pool, name))
        for holder, record in held[name]:
            if holder.uid == claim.uid:
                continue
            theirs = _held_interval(holder, record)
            if theirs is None or theirs == ours:
                continue
            raise time_slice_conflict(
                claim.ref,
                entry,
                theirs,
                asked=record.details.time_slice is not None,
                who=other_claim(holder.name_seen_from(claim.ref.namespace)),
            )


def other_claim(seen: str | None) -> str:
    """How a refusal names another claim on the GPU: by `seen`
    (`ClaimRecord.name_seen_from`) where the refused claim's namespace may read it, else
    only as another namespace's."""
    return f"claim {seen}" if seen else "a claim of another namespace"


def time_slice_conflict(
    ref: ClaimRef, entry: Entry, theirs: int, *, asked: bool, who: str
) -> ClaimError:
    """The refusal of `entry`, whose interval differs from the `theirs` that `who`
    relies on (`asked`: it set that interval itself, else it relies on Default).

    The one wording of the rule, for planning and for the comparison prepare makes
    again under the time-slice lock (`ClaimPreparer._set_time_slice`): a user sees one
    message for it whichever check refused."""
    if asked:
        their_side = f"is time-sliced with interval {interval_name(theirs)} for {who}"
    else:
        their_side = (
            f"is shared with {who}, which runs under the Default time-slice interval "
            "(an MPS device or a memory slice sets none)"
        )
    ours, path = entry.time_slice, entry.config_path
    if ours is not None and path:
        field = join_path(path, "sharing.timeSlicingConfig.interval")
        our_side = f"this claim's config ({field}) asks for {interval_name(ours)}"
    elif ours is not None:
        our_side = "this claim's share is time-sliced with the Default interval (no config)"
    elif path:
        field = join_path(path, "sharing.strategy")
        our_side = f"this claim's config ({field}) runs it under MPS, which relies on Default"
    else:
        our_side = "this claim's memory slice runs under MPS, which relies on Default"
    return ClaimError(
        f"{ref.describe()}: {entry.allocated.path}: GPU {entry.device.name} "
        f"{their_side}, and {our_side}; claims sharing a GPU need the same interval (Default "
        "where one of them runs MPS or holds a memory slice): use the same class or config "
        "for them"
    )


def _whole_memory(allocated: AllocatedDevice, device: Device) -> bool:
    """The allocation consumed the GPU's whole memory."""
    consumed = allocated.consumed_memory
    total = device.capacity.get("memory")
    return consumed is not None and total is not None and consumed >= total


def _plan_mig(claim: Claim, checkpoint: Checkpoint, pool: str, entry: Entry) -> None:
    ref, device, where = claim.ref, entry.device, entry.allocated.path
    if device.uuid is not None:
        mig = UsedMig(gi=device.gpu_instance_id, ci=device.compute_instance_id)
        entry.details = replace(entry.details, mig=mig)
        return
    if device.placement is None:
        raise ClaimError(
            f"{ref.describe()}: {where}.device: MIG device {device.name} has neither a "
            "UUID nor a placement"
        )
    if not entry.admin:
        entry.create_mig = True
        return
    # Admin access to a dynamic partition: it exists only if its owner created it.
    for holder, held in checkpoint.holders((pool, device.name)):
        theirs = held.details.mig
        if not held.admin_access and theirs is not None and theirs.ci is not None:
            entry.details = replace(
                entry.details, uuid=held.details.uuid, mig=UsedMig(gi=theirs.gi, ci=theirs.ci)
            )
            log.debug(
                "admin access beside the owner",
                extra={"fields": {"claim": ref.uid, "owner": holder.uid}},
            )
            return
    raise ClaimError(
        f"{ref.describe()}: {where}.device: MIG device {device.name} does not exist yet "
        "(no claim on this node created it); admin access can only monitor an existing "
        "device"
    )


def _check_mps(claim: Claim, entries: Sequence[Entry]) -> None:
    """Check MPS settings before anything changes on the node."""
    members = [e for e in entries if e.mps]
    if not members:
        return
    asked: dict[str, dict[int | bool, str]] = {}  # setting -> value -> config path
    for entry in members:
        _, _, mps = sharing_of(entry.config)
        for setting, value in (mps_daemon_settings(mps) if mps is not None else {}).items():
            asked.setdefault(setting, {}).setdefault(value, entry.config_path)
    for setting, values in asked.items():
        conflict = mps_setting_conflict(setting, values)
        if conflict is not None:
            raise ClaimError(f"{claim.ref.describe()}: {conflict}")
    if True in asked.get("multiUser", {}):
        _check_multi_user(claim, members)
    # UUIDs of MIG devices created later are unknown yet; an index key's limit must
    # then fit whichever device it names once they are made.
    try:
        mps_limits(members, placeholder=True)
    except ConfigError as exc:
        raise config_error(claim.ref, exc) from None


def _check_multi_user(claim: Claim, members: Sequence[Entry]) -> None:
    """Multi-user MPS needs Volta or newer (compute capability 7.0), as NVIDIA's MPS
    guide says. An older GPU's control daemon takes `-M` all the same, and then every
    client of another user than root fails to initialise CUDA (NOT_PERMITTED, seen by
    upstream on Pascal): refused here, before anything changes on the node."""
    for entry in members:
        capability = _compute_capability(entry.gpu.device)
        if capability is not None and capability < MULTI_USER_MPS_CAPABILITY:
            raise ClaimError(
                f"{claim.ref.describe()}: "
                f"{join_path(entry.config_path, 'sharing.mpsConfig.multiUser')}: GPU "
                f"{entry.gpu.uuid} has CUDA compute capability {'.'.join(map(str, capability))}"
                ", and multi-user MPS needs Volta or newer (7.0); remove multiUser (the "
                "claim's containers then run CUDA as one user) or select a newer GPU"
            )


def _compute_capability(device: Device) -> tuple[int, int] | None:
    """The GPU's CUDA compute capability, as discovery published it (None: not known)."""
    value = device.attributes.get("cudaComputeCapability")
    if not isinstance(value, Version):
        return None
    major, minor, *_ = value.value.split(".")
    return int(major), int(minor)


def mps_settings(members: Sequence[Entry]) -> dict[str, int | bool]:
    """The claim's MPS daemon settings by wire name (`plan` made sure its configs
    agree)."""
    settings: dict[str, int | bool] = {}
    for entry in members:
        _, _, mps = sharing_of(entry.config)
        if mps is not None:
            settings.update(mps_daemon_settings(mps))
    return settings


def mps_limits(members: Sequence[Entry], *, placeholder: bool = False) -> dict[str, int]:
    """Pinned memory limit per device UUID: the config's, capped at a slice's memory;
    one above the device's memory is refused (`MpsConfig.pinned_memory_limits`)."""
    limits: dict[str, int] = {}
    groups: dict[int, list[Entry]] = {}
    for entry in members:
        groups.setdefault(id(entry.config), []).append(entry)
    for group in groups.values():
        _, _, mps = sharing_of(group[0].config)
        if mps is None:
            continue
        uuids = [e.uuid or (f"<{e.device.name}>" if placeholder else "") for e in group]
        devices = [(e.device.name, e.device.capacity.get("memory")) for e in group]
        unordered = len(group) > 1 and any(not e.uuid for e in group)
        try:
            limits.update(mps.pinned_memory_limits(uuids, devices, unordered=unordered))
        except ConfigError as exc:
            raise exc.with_prefix(join_path(group[0].config_path, "sharing.mpsConfig")) from None
    for entry in members:
        consumed = entry.allocated.consumed_memory
        if consumed is not None:
            key = entry.uuid or f"<{entry.device.name}>"
            limits[key] = min(limits.get(key, consumed), consumed)
    return limits
