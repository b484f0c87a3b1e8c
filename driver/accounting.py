"""GPU accounting: allocated and idle device-seconds per namespace, tenant, class and sharing.

Each sample (`gpudra.driver.sampling.Sample`) adds the time since the previous one to
every device held at both, split among the device's holders by `HeldDevice.shares`
(memory slices by their share of the GPU's memory; time-sliced and MPS holders
equally; admin access not billed). The time also counts as idle when the device's
utilization was under `idle_below` percent at this sample. A device whose
utilization NVML does not give (a MIG device without per-instance utilization) is
billed as allocated and never as idle: the agent does not know, and says so with
the `utilization_scope` label of its device series.

The resolution is the sampling interval; a claim prepared and unprepared between two
samples is not billed. Counters live in memory and restart at zero with the agent,
as Prometheus counters may.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpudra.driver.holders import Holder
from gpudra.driver.sampling import Sample

__all__ = ["DEFAULT_IDLE_BELOW", "AccountKey", "Accounting", "IdleDevice"]

DEFAULT_IDLE_BELOW: Final = 5.0


@dataclass(frozen=True, slots=True, order=True)
class AccountKey:
    """What device-seconds are summed by."""

    namespace: str
    tenant: str
    device_class: str
    sharing: str


@dataclass(frozen=True, slots=True)
class IdleDevice:
    """A held device idle since the sampler's clock said `since`."""

    device: str
    uuid: str
    holders: tuple[Holder, ...]
    seconds: float


class Accounting:
    """Device-second counters fed by the sampler; read from the metrics thread."""

    def __init__(self, *, idle_below: float = DEFAULT_IDLE_BELOW) -> None:
        if not 0 <= idle_below <= 100:
            msg = f"idle threshold {idle_below} is not a percentage (0 to 100)"
            raise ValueError(msg)
        self.idle_below = idle_below
        self._lock = threading.Lock()
        self._allocated: dict[AccountKey, float] = {}
        self._idle: dict[AccountKey, float] = {}
        self._idle_since: dict[str, float] = {}
        self._idle_now: tuple[IdleDevice, ...] = ()
        self._last: Sample | None = None

    def observe(self, sample: Sample) -> None:
        """Bill the time since the previous sample (a `Sampler` `on_sample` callback)."""
        previous, self._last = self._last, sample
        utilization: dict[str, float | None] = {}
        totals: dict[str, float] = {}
        for device, reading in sample.devices:
            utilization[device.uuid] = reading.values.get("utilization")
            if "memory_total" in reading.values and not device.mig:
                totals[device.gpu_uuid] = reading.values["memory_total"]
        elapsed = sample.at - previous.at if previous is not None else 0.0
        idle_since: dict[str, float] = {}
        idle_now: list[IdleDevice] = []
        with self._lock:
            for name, held in sample.held.items():
                util = utilization.get(held.uuid or held.gpu_uuid)
                idle = util is not None and util < self.idle_below
                if idle:
                    since = self._idle_since.get(name, sample.at)
                    idle_since[name] = since
                    idle_now.append(
                        IdleDevice(
                            name, held.uuid or held.gpu_uuid, held.holders, sample.at - since
                        )
                    )
                was_held = previous is not None and name in previous.held
                if not was_held or elapsed <= 0:
                    continue
                for holder, share in held.shares(totals.get(held.gpu_uuid)):
                    key = AccountKey(
                        holder.namespace, holder.tenant, holder.device_class, holder.sharing
                    )
                    self._allocated[key] = self._allocated.get(key, 0.0) + elapsed * share
                    if idle:
                        self._idle[key] = self._idle.get(key, 0.0) + elapsed * share
            self._idle_since = idle_since
            self._idle_now = tuple(idle_now)

    def allocated(self) -> Mapping[AccountKey, float]:
        with self._lock:
            return dict(self._allocated)

    def idle(self) -> Mapping[AccountKey, float]:
        with self._lock:
            return dict(self._idle)

    def idle_devices(self) -> tuple[IdleDevice, ...]:
        with self._lock:
            return self._idle_now
