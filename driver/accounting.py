"""GPU accounting: allocated and idle GPU-seconds per namespace, tenant, class and sharing.

Each sample (`gpudra.driver.sampling.Sample`) adds the time since the previous one to
every holder (a claim's request, by claim UID) of a device that held it at both
samples, times its share of a whole GPU (`HeldDevice.shares`: a MIG device is its
compute slices' part of its GPU, a 1g of an A100 or H100 a seventh; memory slices by
their share of the GPU's memory; time-sliced and MPS holders split their device
equally; admin access not billed). So the counters are GPU-seconds whatever the
device: one GPU for one second is one, seven 1g instances held for a second are one,
and a sum over namespaces never bills a GPU more than the time it ran.

Where the device's holders changed between the two samples, its share is the
smaller of the two it had then: the samples do not say when in the interval the change
happened, so the time is never billed to a holder that did not hold the device (nor
shifted from a holder that left onto one that stayed), at the cost of leaving up to one
sampling interval per holder change unbilled. The time also counts as idle when the
device's utilization was under `idle_below` percent in this sample: for a whole GPU
the mean of NVML's own samples since the previous pass (`gpudra.driver.utilization`),
for a MIG device GPM's figure over the same span. A device whose
utilization NVML does not give (a MIG device without per-instance utilization) is
billed as allocated and never as idle: the agent does not know, and says so with
the `utilization_scope` label of its device series.

How long a device has been idle is kept per holder: a holder's idle time starts at the
first sample where it held the device idle, so a claim that gets a device another claim
left idle does not inherit the other's idle time (nor its idle alert).

A sample more than `STALE_AFTER_INTERVALS` sampling intervals after the previous one
follows a stall (a pass that hung in NVML, or kept failing): the samples do not say
what the devices did, nor who held them, in between, so that time is billed to nobody,
neither allocated nor idle, and idle runs start again at the sample after it. The
metrics withdraw the device series once the latest sample is that old
(`gpudra.driver.metrics`).

The resolution is the sampling interval; a claim prepared and unprepared between two
samples is not billed. Counters live in memory and restart at zero with the agent,
as Prometheus counters may.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeAlias

from gpudra.driver.holders import ADMIN, HeldDevice, Holder
from gpudra.driver.sampling import Sample

__all__ = [
    "DEFAULT_IDLE_BELOW",
    "STALE_AFTER_INTERVALS",
    "AccountKey",
    "Accounting",
    "IdleDevice",
    "holding",
    "stale_after",
]

DEFAULT_IDLE_BELOW: Final = 5.0
# A pass takes a fraction of an interval and starts one interval after the previous
# one ended: three intervals without a sample is a stall, not a slow pass.
STALE_AFTER_INTERVALS: Final = 3

# A holder of one device, the same from sample to sample: (claim UID, request).
_HolderId: TypeAlias = tuple[str, str]
# Device name -> each billed holder's labels (as of that sample) and share of it.
_Shares: TypeAlias = dict[str, dict[_HolderId, tuple[Holder, float]]]


@dataclass(frozen=True, slots=True, order=True)
class AccountKey:
    """What GPU-seconds are summed by."""

    namespace: str
    tenant: str
    device_class: str
    sharing: str


@dataclass(frozen=True, slots=True)
class IdleDevice:
    """A held device idle for `seconds` for `holders` (`holding`: never admin access):
    since each of them first held it idle (a shared device's holders that came at other
    times are other `IdleDevice`s)."""

    device: str
    uuid: str
    holders: tuple[Holder, ...]
    seconds: float


def _holder_id(holder: Holder) -> _HolderId:
    return holder.claim_uid, holder.request


def stale_after(interval_s: float) -> float:
    """Seconds after which a sample no longer tells what a device sampled every
    `interval_s` is doing: a sampling stall."""
    return STALE_AFTER_INTERVALS * interval_s


def holding(held: HeldDevice) -> dict[_HolderId, Holder]:
    """Who holds a device, for its series and idle time: one holder per claim and
    request (one claim may hold two slices of a GPU for one request), and never an
    admin-access claim, which holds nothing (a monitoring pod on a free GPU)."""
    found: dict[_HolderId, Holder] = {}
    for holder in held.holders:
        if holder.sharing != ADMIN:
            found.setdefault(_holder_id(holder), holder)
    return found


def _shares(sample: Sample) -> _Shares:
    """Each held device's billed holders and their shares at `sample`."""
    totals = {
        device.gpu_uuid: reading.values["memory_total"]
        for device, reading in sample.devices
        if "memory_total" in reading.values and not device.mig
    }
    found: _Shares = {}
    for name, held in sample.held.items():
        holders = found[name] = {}
        for holder, share in held.shares(totals.get(held.gpu_uuid)):
            # One claim may hold two slices of a GPU for one request: one holder.
            _, before = holders.get(_holder_id(holder), (holder, 0.0))
            holders[_holder_id(holder)] = (holder, before + share)
    return found


class Accounting:
    """GPU-second counters fed by the sampler; read from the metrics thread."""

    def __init__(self, *, idle_below: float = DEFAULT_IDLE_BELOW) -> None:
        if not 0 <= idle_below <= 100:
            msg = f"idle threshold {idle_below} is not a percentage (0 to 100)"
            raise ValueError(msg)
        self.idle_below = idle_below
        self._lock = threading.Lock()
        self._allocated: dict[AccountKey, float] = {}
        self._idle: dict[AccountKey, float] = {}
        self._idle_since: dict[tuple[str, _HolderId], float] = {}
        self._idle_now: tuple[IdleDevice, ...] = ()
        self._last: tuple[float, _Shares] | None = None

    def observe(self, sample: Sample) -> None:
        """Bill the time since the previous sample (a `Sampler` `on_sample` callback)."""
        shares = _shares(sample)
        previous, self._last = self._last, (sample.at, shares)
        if previous is not None and sample.at - previous[0] > stale_after(sample.interval_s):
            previous = None  # a stall: nothing is known of the time since the previous
        elapsed = sample.at - previous[0] if previous is not None else 0.0
        before = previous[1] if previous is not None else {}
        utilization = {d.uuid: r.values.get("utilization") for d, r in sample.devices}
        idle_since: dict[tuple[str, _HolderId], float] = {}
        idle_now: list[IdleDevice] = []
        with self._lock:
            known_since = self._idle_since if previous is not None else {}
            for name, held in sample.held.items():
                uuid = held.uuid or held.gpu_uuid
                util = utilization.get(uuid)
                idle = util is not None and util < self.idle_below
                if idle:
                    by_since: dict[float, list[Holder]] = {}
                    for ident, holder in holding(held).items():
                        hold = (name, ident)
                        since = idle_since[hold] = known_since.get(hold, sample.at)
                        by_since.setdefault(since, []).append(holder)
                    idle_now.extend(
                        IdleDevice(name, uuid, tuple(holders), sample.at - since)
                        for since, holders in sorted(by_since.items())
                    )
                if elapsed <= 0:
                    continue
                held_before = before.get(name, {})
                for ident, (holder, share) in shares[name].items():
                    if ident not in held_before:
                        continue  # it got the device since the previous sample
                    seconds = elapsed * min(share, held_before[ident][1])
                    key = AccountKey(
                        holder.namespace, holder.tenant, holder.device_class, holder.sharing
                    )
                    self._allocated[key] = self._allocated.get(key, 0.0) + seconds
                    if idle:
                        self._idle[key] = self._idle.get(key, 0.0) + seconds
            self._idle_since = idle_since
            self._idle_now = tuple(idle_now)

    def allocated(self) -> Mapping[AccountKey, float]:
        with self._lock:
            return dict(self._allocated)

    def idle(self) -> Mapping[AccountKey, float]:
        with self._lock:
            return dict(self._idle)

    def idle_devices(self) -> tuple[IdleDevice, ...]:
        """The held devices under the idle threshold at the latest sample."""
        with self._lock:
            return self._idle_now
