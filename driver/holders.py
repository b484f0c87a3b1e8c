"""Who holds each prepared device, and each holder's fair share of it.

Device metrics, accounting and claim status all ask the same question of the
checkpoint: which claims (namespace, pod, claim, request) hold this device, shared
how? The checkpoint answers most of it; what it does not keep (the DeviceClass of a
request, the memory a slice took) comes from the claim object read from the API server
(`ClaimInfo`), and is simply empty until that read has happened. The tenant is the
namespace's, looked up when asked (`gpudra.driver.tenancy`).

A device with a share ID is a memory slice or some integer shares of a GPU, and only
the claim object says which and how big. Until it has been read (after an agent
restart, where the read is retried until it succeeds: `gpudra.driver.claimreader`), its
holder is `Unknown`, never a guess: called a memory slice, an integer-share holder
would be split equally with the others and paid for their time.

What a device is billed is its part of its GPU's compute, in GPU-seconds (a whole GPU
for a second is one): a whole GPU all of it, a MIG device its GPU-instance profile's
compute slices over the whole GPU's (NVML `sliceCount`, as discovery read it:
`Inventory.compute_share`), so a 1g instance of an A100 or H100 is a seventh, a 3g
three sevenths, and seven 1g instances bill one GPU as the GPU bills itself whole.
Static or dynamic MIG alike. A MIG device whose part the inventory does not tell (no
inventory yet, a name no view has) is billed nothing, never a guess: billed whole, one
1g would pay for seven, the overbilling the part is there to end.

The fair split of that part among a device's holders:
- a device with one holder (not a memory slice or integer shares): all of it;
- memory slices of one GPU: each holder its share of the memory the scheduler divided,
  the GPU's memory as the inventory published it (a slice of 20 GiB of an 80 GiB GPU
  holds a quarter of it). Never the memory NVML reads at a sample: a sample whose
  memory call failed would leave the slices without a basis, and the basis is the
  published size, not what the driver reports now;
- integer shares of a GPU published with shares (`--gpu-shares`): each holder the
  shares it took over those published (3 of 4 shares hold three quarters of it);
- memory slices whose GPU's published memory is not known (no inventory yet, a GPU
  discovery could not size), and integer shares of a device not published with shares
  now: nothing, never an equal part, which would bill a 1 GiB slice beside a 20 GiB one
  half the GPU;
- time-sliced and MPS holders (of a whole GPU or of one MIG device), and slices or
  shares whose own size the claim does not give, and a device whose holders are some
  sized and some not: equal parts;
- `Unknown` holders (claim not read yet) are not billed; while a device has one, only
  the holders whose part is their own size (a memory slice, integer shares) are billed,
  since every other part depends on what the unread claim took. The time held back is
  lost, as that of a holder change the agent was not told the time of is: billing only
  for what a claim took comes before billing all of the time;
- admin-access holders (monitoring, debugging) hold nothing: they are shown, not billed.

This splits the time the device was held, by what each holder was allocated: a holder
of one share of four pays a quarter of the time, whatever the others ran. It does not
split use: whether that time was used or idle is the whole device's
(`gpudra.driver.accounting`), so a holder that ran nothing beside a busy one is billed
its part as used, and one busy beside an idle one as idle only when the whole device
was. NVML gives no per-process utilization that would tell them apart.

When each claim held its devices: `HoldingLog` keeps the times the preparer tells it,
from a claim's prepare completing to its unprepare, until the next sampling pass takes
them (`gpudra.driver.accounting` bills by them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpudra.api.sharing import SharingMode
from gpudra.driver.checkpoint import ClaimRecord, DeviceRecord
from gpudra.driver.claims import Claim, reserved_pods
from gpudra.driver.devices import Inventory

__all__ = [
    "ADMIN",
    "DEFAULT_HOLDING_CHANGES",
    "EXCLUSIVE",
    "MEMORY_SLICE",
    "MPS",
    "TIME_SLICING",
    "UNKNOWN",
    "ClaimInfo",
    "ClaimInfos",
    "HeldDevice",
    "HoldChange",
    "Holder",
    "HoldingLog",
    "claim_info",
    "held_devices",
    "released_devices",
    "sharing_of",
]

# The `sharing` label: the config's sharing mode (typed by the API's own names), or one
# of three holders that no sharing config names: a memory slice, admin access, and a
# share ID whose claim has not been read yet (a memory slice or integer shares).
EXCLUSIVE: Final[SharingMode] = "Exclusive"
TIME_SLICING: Final[SharingMode] = "TimeSlicing"
MPS: Final[SharingMode] = "MPS"
MEMORY_SLICE: Final = "MemorySlice"
ADMIN: Final = "AdminAccess"
UNKNOWN: Final = "Unknown"

# Changes a `HoldingLog` keeps at most between two passes (10 s apart by default): a
# node preparing and unpreparing hundreds of claims a second stays under it for a
# stalled pass's three intervals, whose time is billed to nobody anyway.
DEFAULT_HOLDING_CHANGES: Final = 10_000


@dataclass(frozen=True, slots=True)
class ClaimInfo:
    """What the checkpoint does not keep of a claim, read from its API object.

    They map an allocated device (device name, share ID) to what it was allocated
    with: `device_classes` the DeviceClass of its request (or subrequest), `memory`
    the bytes a memory slice took, `shares` the integer shares a claim took of a GPU
    published with shares. `pods` are the pods the claim was reserved for,
    name -> UID: the checkpoint keeps only the holding pod's name, and the UID tells
    that pod from one re-created under its name (`gpudra.driver.podclaims`).
    """

    device_classes: Mapping[tuple[str, str | None], str] = field(default_factory=dict)
    memory: Mapping[tuple[str, str | None], int] = field(default_factory=dict)
    pods: Mapping[str, str] = field(default_factory=dict)
    shares: Mapping[tuple[str, str | None], int] = field(default_factory=dict)


class ClaimInfos:
    """The `ClaimInfo` of each claim read from the API server, by claim UID.

    The claim reader remembers each claim it reads for a prepare; `retain`, called
    with the checkpoint's claims, forgets a claim once it has left the checkpoint. A
    claim read but not yet in the checkpoint (its prepare is under way) is kept, for
    `pending_s`, so a pass between the read and the checkpoint write loses nothing.

    Used on the event loop. A `snapshot` never changes once handed out, so it may go
    to any thread: the map is copied before the first change after one. Copying it on
    every read instead cost each prepare a copy of every claim prepared, quadratic in
    the claims a node holds.
    """

    def __init__(
        self, *, pending_s: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._infos: dict[str, ClaimInfo] = {}
        self._handed_out = False  # `_infos` is some snapshot: copy it before a change
        self._read_at: dict[str, float] = {}
        self._seen: set[str] = set()  # in the checkpoint at the last `retain`
        self._pending_s = pending_s
        self._clock = clock

    def remember(self, uid: str, info: ClaimInfo) -> None:
        self._read_at[uid] = self._clock()
        if self._handed_out:
            self._infos, self._handed_out = dict(self._infos), False
        self._infos[uid] = info

    def retain(self, uids: Iterable[str]) -> None:
        """Forget claims that left the checkpoint, and reads whose claim never got there."""
        current = set(uids)
        now = self._clock()
        self._seen = (self._seen | current) & set(self._infos)
        gone = {
            uid
            for uid in self._infos
            if uid not in current
            and (uid in self._seen or now - self._read_at.get(uid, now) > self._pending_s)
        }
        self._seen &= current
        if gone:
            self._infos = {uid: i for uid, i in self._infos.items() if uid not in gone}
            self._handed_out = False
            for uid in gone:
                self._read_at.pop(uid, None)

    def snapshot(self) -> Mapping[str, ClaimInfo]:
        self._handed_out = True
        return self._infos


def _requests(spec: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    """(request name, DeviceClass) of a claim spec, in v1 and v1beta1 shapes."""
    for request in (spec.get("devices") or {}).get("requests") or ():
        if not isinstance(request, Mapping):
            continue
        name = str(request.get("name") or "")
        exactly = request.get("exactly") or {}
        device_class = exactly.get("deviceClassName") or request.get("deviceClassName")
        if device_class:
            yield name, str(device_class)
        for sub in request.get("firstAvailable") or ():
            if isinstance(sub, Mapping) and sub.get("deviceClassName"):
                yield f"{name}/{sub.get('name') or ''}", str(sub["deviceClassName"])


def claim_info(obj: Mapping[str, Any], claim: Claim) -> ClaimInfo:
    """The `ClaimInfo` of a claim object and its checked form (`checked_claim`)."""
    classes = dict(_requests(obj.get("spec") or {}))
    return ClaimInfo(
        device_classes={
            (d.device, d.share_id): classes[d.request]
            for d in claim.devices
            if d.request in classes
        },
        memory={
            (d.device, d.share_id): d.consumed_memory
            for d in claim.devices
            if d.consumed_memory is not None
        },
        pods=reserved_pods(obj),
        shares={
            (d.device, d.share_id): d.consumed_shares
            for d in claim.devices
            if d.consumed_shares is not None
        },
    )


@dataclass(frozen=True, slots=True)
class Holder:
    """One claim's hold on one device. `memory`: bytes of a memory slice, else None;
    `shares`: the integer shares it took, else None."""

    namespace: str
    pod: str
    claim: str
    claim_uid: str
    request: str
    sharing: str
    device_class: str = ""
    tenant: str = ""
    memory: int | None = None
    container: str = ""  # the pod's containers using it, "," between (`podclaims`)
    shares: int | None = None


@dataclass(frozen=True, slots=True)
class HeldDevice:
    """A prepared device of this node's pool and its holders.

    `uuid` is the device's own (the GPU's, or the MIG device's once created);
    `gpu_uuid` the GPU it is or is part of; `published_shares` the integer shares the
    device is published with now, None for none; `memory_total` the bytes of memory
    the inventory publishes it with, which memory slices divide, None where it does not
    tell; `compute` the part of its GPU's compute it is (1.0 a whole GPU, a MIG device
    its slices' part), None where the inventory does not tell (see the module
    docstring).
    """

    device: str
    gpu_uuid: str
    uuid: str
    mig: bool
    holders: tuple[Holder, ...]
    published_shares: int | None = None
    compute: float | None = 1.0
    memory_total: int | None = None

    def shares(self) -> list[tuple[Holder, float]]:
        """Each billed holder and its part of a whole GPU: its fraction of the device
        times the device's part of its GPU (see the module docstring)."""
        if self.compute is None:
            return []  # a MIG device of unknown size: billed nothing rather than a guess
        return [(h, part * self.compute) for h, part in self._fractions()]

    def _fractions(self) -> list[tuple[Holder, float]]:
        """Each billed holder and its fraction of the device itself."""
        billed = [h for h in self.holders if h.sharing != ADMIN]
        all_sized = bool(billed) and (
            all(h.shares is not None for h in billed) or all(h.memory is not None for h in billed)
        )
        if all_sized or any(h.sharing == UNKNOWN for h in billed):
            # Each its own size, or nothing where the size or what it divides is not known.
            sized = [(h, self._sized(h)) for h in billed]
            return [(h, part) for h, part in sized if part is not None]
        if len(billed) == 1:
            return [(billed[0], 1.0)]
        return [(h, 1.0 / len(billed)) for h in billed]

    def _sized(self, holder: Holder) -> float | None:
        """`holder`'s fraction by its own size alone (integer shares over those
        published, a memory slice over the published memory); None where its size or
        what it divides is not known."""
        published, memory_total = self.published_shares, self.memory_total
        if holder.shares is not None:
            return min(1.0, holder.shares / published) if published else None
        if holder.memory is not None:
            return min(1.0, holder.memory / memory_total) if memory_total else None
        return None


def sharing_of(record: DeviceRecord, info: ClaimInfo | None = None) -> str:
    """The sharing mode of one prepared device, as the metrics label it.

    A device with a share ID is a memory slice, or, where `info` (its claim's) says it
    took integer shares, some of a GPU's shares: never a memory slice, and never
    Exclusive unless it took them all, since the other shares' holders use the GPU too
    (time-sliced unless MPS, as prepare resolves it). Without `info` (the claim is not
    read yet) it is `Unknown`: either is possible.
    """
    details = record.details
    integer_share = info is not None and (record.device, record.share_id) in info.shares
    if record.admin_access:
        return ADMIN
    if record.share_id is not None and info is None:
        return UNKNOWN
    if record.share_id is not None and not integer_share:  # MPS serves slices too
        return MEMORY_SLICE
    if details.mps is not None:
        return MPS
    if details.time_slice is not None or (integer_share and not record.exclusive):
        return TIME_SLICING
    return EXCLUSIVE


def held_devices(
    claims: Iterable[ClaimRecord],
    pool: str,
    info: Mapping[str, ClaimInfo],
    tenant_of: Callable[[str], str] = lambda _namespace: "",
    containers: Mapping[str, Mapping[str, str]] | None = None,
    published_shares: Mapping[str, int] | None = None,
    inventory: Inventory | None = None,
) -> dict[str, HeldDevice]:
    """Device name -> its holders, for the completed claims' devices in `pool`;
    `tenant_of` names a namespace's tenant ("" for none), `containers` the container
    label of each claim's requests by claim UID (`gpudra.driver.podclaims`),
    `published_shares` the integer shares each device is published with, `inventory`
    what part of its GPU each MIG device is (without it, none is known: not billed)."""
    holders: dict[str, list[Holder]] = {}
    identity: dict[str, tuple[str, str, bool]] = {}
    for record in claims:
        if not record.completed:
            continue
        read = info.get(record.uid)
        extra = read or ClaimInfo()
        tenant = tenant_of(record.namespace)
        labels = (containers or {}).get(record.uid, {})
        for device in record.devices:
            if device.pool != pool:
                continue
            details = device.details
            gpu_uuid = details.gpu_uuid or details.uuid or ""
            identity.setdefault(
                device.device, (gpu_uuid, details.uuid or "", details.mig is not None)
            )
            sharing = sharing_of(device, read)
            key = (device.device, device.share_id)
            for request in device.request_names or ("",):
                holders.setdefault(device.device, []).append(
                    Holder(
                        namespace=record.namespace,
                        pod=details.pod,
                        claim=record.name,
                        claim_uid=record.uid,
                        request=request,
                        sharing=sharing,
                        device_class=extra.device_classes.get(key, ""),
                        tenant=tenant,
                        memory=extra.memory.get(key) if sharing == MEMORY_SLICE else None,
                        container=labels.get(request, ""),
                        shares=extra.shares.get(key),
                    )
                )
    published = published_shares or {}
    return {
        name: HeldDevice(
            name,
            *identity[name],
            holders=tuple(found),
            published_shares=published.get(name),
            compute=_compute(name, mig=identity[name][2], inventory=inventory),
            memory_total=_published_memory(name, inventory),
        )
        for name, found in sorted(holders.items())
    }


def _published_memory(name: str, inventory: Inventory | None) -> int | None:
    """The memory the device `name` is published with (what the scheduler divides
    into memory slices), None where the inventory does not tell."""
    device = inventory.find(name) if inventory is not None else None
    return device.capacity.get("memory") if device is not None else None


def _compute(name: str, *, mig: bool, inventory: Inventory | None) -> float | None:
    """The part of its GPU's compute the held device `name` is: a whole GPU all of it
    (inventory or not), a MIG device what the inventory says, None where it does not."""
    if not mig:
        return 1.0
    return inventory.compute_share(name) if inventory is not None else None


@dataclass(frozen=True, slots=True)
class HoldChange:
    """A claim starting (`held`) or ceasing to hold its devices, `at` on the sampler's
    clock. A release keeps the claim's record and `ClaimInfo` as they were, so a claim
    prepared and unprepared between two passes is still labelled and billed."""

    claim_uid: str
    held: bool
    at: float
    record: ClaimRecord | None = None
    info: ClaimInfo | None = None


class HoldingLog:
    """When claims started and stopped holding their devices since the last pass.

    The preparer tells it (`held` when a prepare completes, `released` when an
    unprepare removes a completed claim) in the same step of the event loop as the
    checkpoint change, so a pass that reads the checkpoint and `take`s the log sees both
    or neither. `clock` must be the sampler's, `claim_info` what the claim reader
    remembers (taken at the release: the reader forgets a claim once it leaves the
    checkpoint). Each call is a clock read and an append: it is on the prepare path.

    Bounded: without passes (a sampler hung in NVML) it keeps the newest `limit`
    changes, drops the oldest and counts them in `dropped`. A dropped change only
    ever leaves time unbilled (`gpudra.driver.accounting`), as does one whose
    checkpoint write failed (the checkpoint undoes it, the log keeps it). Used on the
    event loop only.
    """

    def __init__(
        self,
        *,
        claim_info: Callable[[], Mapping[str, ClaimInfo]] = dict,
        clock: Callable[[], float] = time.monotonic,
        limit: int = DEFAULT_HOLDING_CHANGES,
    ) -> None:
        if limit < 1:
            msg = f"holding change limit {limit} must be at least 1"
            raise ValueError(msg)
        self._claim_info = claim_info
        self._clock = clock
        self._changes: deque[HoldChange] = deque(maxlen=limit)
        self.dropped = 0

    def held(self, uid: str) -> None:
        """Claim `uid` holds its devices from now (its prepare completed)."""
        self._add(HoldChange(uid, True, self._clock()))

    def released(self, record: ClaimRecord) -> None:
        """The completed claim `record` holds its devices no more (unprepared)."""
        info = self._claim_info().get(record.uid)
        self._add(HoldChange(record.uid, False, self._clock(), record, info))

    def _add(self, change: HoldChange) -> None:
        if len(self._changes) == self._changes.maxlen:
            self.dropped += 1
        self._changes.append(change)

    def take(self) -> tuple[HoldChange, ...]:
        """The changes since the last `take`, oldest first; the log is empty after."""
        taken = tuple(self._changes)
        self._changes.clear()
        return taken

    def put_back(self, changes: Iterable[HoldChange]) -> None:
        """Return what a failed pass took, before the changes made since (the newest
        `limit` are kept, the others counted dropped)."""
        merged = [*changes, *self._changes]
        limit = self._changes.maxlen or len(merged)
        self.dropped += max(0, len(merged) - limit)
        self._changes.clear()
        self._changes.extend(merged[-limit:])


def released_devices(
    changes: Iterable[HoldChange],
    pool: str,
    tenant_of: Callable[[str], str] = lambda _namespace: "",
    containers: Mapping[str, Mapping[str, str]] | None = None,
    published_shares: Mapping[str, int] | None = None,
    inventory: Inventory | None = None,
) -> dict[str, HeldDevice]:
    """`held_devices` of the claims released in `changes` (the last release of each),
    each with the `ClaimInfo` it had then: who held what until they left."""
    last = {c.claim_uid: c for c in changes if c.record is not None}
    return held_devices(
        (c.record for c in last.values() if c.record is not None),
        pool,
        {uid: c.info for uid, c in last.items() if c.info is not None},
        tenant_of,
        containers,
        published_shares,
        inventory,
    )
