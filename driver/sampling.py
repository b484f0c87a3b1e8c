"""Periodic NVML sampling of every device the node serves, for metrics and accounting.

The sampler reads each GPU and each existing MIG device (those discovered, and those
a prepare created since) every `interval_s` seconds. All NVML calls run in a worker
thread (`anyio.to_thread`), and the sampler reads the prepared claims from the
preparer's in-memory checkpoint without its lock, so sampling never waits for, nor
delays, a prepare.

A MIG device's utilization comes from GPM where the GPU has it (Hopper and newer,
`gpudra.driver.gpm`). A value NVML does not give for a device (NOT_SUPPORTED on an older
GPU, no per-instance utilization on an older MIG device, a GPU that fell off the bus) is
absent from that device's `Reading`, and `missing` says why: the metrics export a
reason series instead, and a failing call never stops the sampling of other values or
devices.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import pynvml
from gpudra.common.periodic import run_every
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.devices import Inventory
from gpudra.driver.gpm import MigUtilization
from gpudra.driver.health import HealthState
from gpudra.driver.holders import (
    ClaimInfo,
    HeldDevice,
    HoldChange,
    HoldingLog,
    held_devices,
    released_devices,
)
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.nvml.codes import constant_names
from gpudra.driver.nvml.handles import device_handle
from gpudra.driver.utilization import TOP_UP_EVERY_S, GpuUtilization, utilization_rates

__all__ = [
    "DEFAULT_INTERVAL_S",
    "Reading",
    "Sample",
    "SampledDevice",
    "Sampler",
    "devices_to_sample",
    "read_device",
]

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class SampledDevice:
    """A device to sample: its published name, own UUID and the GPU it is or is part of."""

    name: str
    uuid: str
    gpu_uuid: str
    model: str
    mig: bool


@dataclass(frozen=True, slots=True)
class Reading:
    """One device's values at one sample (see `read_device` for names and units).

    `missing` maps each value NVML did not give to the reason (the NVML error name,
    lower case without the prefix: "not_supported", "gpu_is_lost", ...).
    """

    values: Mapping[str, float] = field(default_factory=dict)
    missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sample:
    """What one sampling pass saw: each device's reading, who held it, and the health
    state then (taken on the event loop, so a scrape never reads live health state).

    `healthy` maps device names to health; `xids` (GPU UUID, XID) to events seen.
    `changes` are the claims that started or stopped holding their devices since the
    previous pass (`HoldingLog`, read with `held`), oldest first; `released` the
    devices the claims released meanwhile held, with those claims as their holders.
    """

    at: float  # the sampler's clock
    devices: tuple[tuple[SampledDevice, Reading], ...] = ()
    held: Mapping[str, HeldDevice] = field(default_factory=dict)
    healthy: Mapping[str, bool] = field(default_factory=dict)
    xids: Mapping[tuple[str, int], int] = field(default_factory=dict)
    interval_s: float = DEFAULT_INTERVAL_S  # the sampler's: how soon the next one is due
    changes: tuple[HoldChange, ...] = ()
    released: Mapping[str, HeldDevice] = field(default_factory=dict)


def _reason(err: BaseException) -> str:
    code = getattr(err, "value", None)
    name = constant_names("NVML_ERROR_").get(code) if isinstance(code, int) else None
    return name.removeprefix("NVML_ERROR_").lower() if name else type(err).__name__


def read_device(
    nvml: NvmlLibrary,
    handle: Any,
    utilization: Callable[[], tuple[float, float]] | None = None,
) -> Reading:
    """Read one device: each value from its own call, so one failing call loses one value.

    Names and units: utilization and memory_utilization (percent), memory_used and
    memory_total (bytes), temperature (degrees C), power (watts), sm_clock (MHz),
    ecc_corrected and ecc_uncorrected (volatile counts since the driver loaded).
    `utilization` gives the first two (a GPU's over the interval: `GpuUtilization`);
    without it they are the rates call's, over the device's last sample period.
    """
    values: dict[str, float] = {}
    missing: dict[str, str] = {}

    def take(names: tuple[str, ...], call: Callable[[], tuple[float, ...]]) -> None:
        try:
            got = call()
        except pynvml.NVMLError as err:
            missing.update(dict.fromkeys(names, _reason(err)))
            return
        values.update(zip(names, got, strict=True))

    def memory() -> tuple[float, float]:
        # v2 counts the driver's reserved memory apart from `used`; older drivers lack it.
        try:
            m = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except pynvml.NVMLError:
            m = nvml.nvmlDeviceGetMemoryInfo(handle)
        return float(m.used), float(m.total)

    def ecc(kind: int) -> tuple[float]:
        return (float(nvml.nvmlDeviceGetTotalEccErrors(handle, kind, pynvml.NVML_VOLATILE_ECC)),)

    take(
        ("utilization", "memory_utilization"),
        utilization or (lambda: utilization_rates(nvml, handle)),
    )
    take(("memory_used", "memory_total"), memory)
    take(
        ("temperature",),
        lambda: (float(nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),),
    )
    take(("power",), lambda: (nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,))
    take(("sm_clock",), lambda: (float(nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),))
    take(("ecc_corrected",), lambda: ecc(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED))
    take(("ecc_uncorrected",), lambda: ecc(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
    return Reading(values, missing)


def devices_to_sample(
    inventory: Inventory | None, held: Mapping[str, HeldDevice]
) -> list[SampledDevice]:
    """Every GPU and existing MIG device of the inventory, and the MIG devices that
    prepares created after the last discovery (the held ones with a UUID)."""
    found: dict[str, SampledDevice] = {}
    models: dict[str, str] = {}
    for gpu in inventory.gpus if inventory is not None else ():
        models[gpu.uuid] = gpu.product_name
        found[gpu.uuid] = SampledDevice(
            gpu.device.name, gpu.uuid, gpu.uuid, gpu.product_name, False
        )
        for mig in gpu.mig_devices:
            if mig.uuid:
                found[mig.uuid] = SampledDevice(
                    mig.name, mig.uuid, gpu.uuid, gpu.product_name, True
                )
    for device in held.values():
        if device.mig and device.uuid and device.uuid not in found:
            model = models.get(device.gpu_uuid, "")
            found[device.uuid] = SampledDevice(
                device.device, device.uuid, device.gpu_uuid, model, True
            )
    return sorted(found.values(), key=lambda d: (d.gpu_uuid, d.mig, d.name))


class Sampler:
    """Samples every device on an interval and keeps the latest `Sample`.

    `inventory` and `prepared` are read each pass (the agent's latest inventory, which
    also says what part of its GPU each held MIG device bills; the preparer's completed
    claims, read without its lock); `claim_info` gives what the
    checkpoint does not keep of a claim; `tenant_of` a namespace's tenant; `containers`
    the container label of each claim's requests (`gpudra.driver.podclaims`); `shares` the
    integer shares each device is published with (the agent's); `health` the agent's
    health state. `on_sample` (accounting) is called on the event loop with each
    new sample. `holdings` is told by the preparer when claims start and stop holding
    their devices, on this sampler's clock; each pass takes what it was told.
    `wall_clock` is the clock of NVML's utilization sample timestamps (the node's).

    With an interval longer than `TOP_UP_EVERY_S`, `run` also reads the GPUs'
    utilization sample buffers every `TOP_UP_EVERY_S` between passes (`top_up_once`),
    since the buffer holds less than such an interval (`gpudra.driver.utilization`).
    """

    def __init__(
        self,
        nvml: NvmlLibrary,
        *,
        pool: str,
        inventory: Callable[[], Inventory | None],
        prepared: Callable[[], Iterable[ClaimRecord]],
        claim_info: Callable[[], Mapping[str, ClaimInfo]] = dict,
        tenant_of: Callable[[str], str] = lambda _namespace: "",
        containers: Callable[[], Mapping[str, Mapping[str, str]]] = dict,
        shares: Callable[[], Mapping[str, int]] = dict,
        health: Callable[[], HealthState | None] = lambda: None,
        interval_s: float = DEFAULT_INTERVAL_S,
        on_sample: Iterable[Callable[[Sample], None]] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._nvml = nvml
        self._pool = pool
        self._inventory = inventory
        self._prepared = prepared
        self._claim_info = claim_info
        self._tenant_of = tenant_of
        self._containers = containers
        self._shares = shares
        self._health = health
        self.interval_s = interval_s
        self.top_up_every_s = TOP_UP_EVERY_S  # reads between passes longer than this
        self._on_sample = tuple(on_sample)
        self.clock = clock  # of `Sample.at`: a scrape tells the latest sample's age by it
        self.latest: Sample | None = None  # replaced whole, so a scrape reads one pass
        self.holdings = HoldingLog(claim_info=claim_info, clock=clock)
        self._gpm = MigUtilization()  # used by one pass at a time, in its worker thread
        self._gpu_utilization = GpuUtilization(wall_clock=wall_clock)  # likewise
        # Held by a pass's or a top-up's worker thread: they share the two above.
        self._reading = threading.Lock()

    def _read_all(self, devices: list[SampledDevice]) -> list[tuple[SampledDevice, Reading]]:
        with self._reading:
            return self._read_devices(devices)

    def _read_devices(self, devices: list[SampledDevice]) -> list[tuple[SampledDevice, Reading]]:
        out: list[tuple[SampledDevice, Reading]] = []
        try:
            self._nvml.nvmlInit()
        except pynvml.NVMLError as err:
            reason = _reason(err)
            return [(d, Reading(missing={"init": reason})) for d in devices]
        try:
            for device in devices:
                try:
                    # Not the plain lookup by UUID: it fails for every GPU while any
                    # one is lost, and one lost GPU must not blank the others' series.
                    handle = device_handle(self._nvml, device.uuid)
                except pynvml.NVMLError as err:
                    out.append((device, Reading(missing={"handle": _reason(err)})))
                    continue
                # A GPU's utilization over the interval; a MIG device has none from NVML.
                over_interval = partial(self._gpu_utilization.read, self._nvml, handle, device.uuid)
                reading = read_device(self._nvml, handle, None if device.mig else over_interval)
                if device.mig and "utilization" not in reading.values:
                    reading = self._mig_utilization(device, handle, reading)
                out.append((device, reading))
            self._gpm.retain(self._nvml, (d.uuid for d in devices if d.mig))
            self._gpu_utilization.retain(d.uuid for d in devices if not d.mig)
        finally:
            self._nvml.nvmlShutdown()
        return out

    def _mig_utilization(self, device: SampledDevice, handle: Any, reading: Reading) -> Reading:
        """`reading` with the MIG device's own SM utilization from GPM where the GPU
        has it; else the reason stays (`not_supported`), or says GPM has only one
        sample of the device yet."""
        try:
            value = self._gpm.read(self._nvml, handle, device.uuid)
        except pynvml.NVMLError as err:
            return Reading(reading.values, {**reading.missing, "utilization": _reason(err)})
        if value is None:
            return Reading(reading.values, {**reading.missing, "utilization": "first_gpm_sample"})
        missing = {k: v for k, v in reading.missing.items() if k != "utilization"}
        return Reading({**reading.values, "utilization": value}, missing)

    def _top_up_all(self) -> None:
        with self._reading:
            gpus = self._gpu_utilization.gpus()
            if not gpus:
                return
            try:
                self._nvml.nvmlInit()
            except pynvml.NVMLError:
                return  # the next pass reads and reports it
            try:
                for uuid in sorted(gpus):
                    try:
                        handle = device_handle(self._nvml, uuid)
                    except pynvml.NVMLError:
                        continue
                    self._gpu_utilization.top_up(self._nvml, handle, uuid)
            finally:
                self._nvml.nvmlShutdown()

    async def top_up_once(self) -> None:
        """Read the sampled GPUs' utilization samples since the last read into the
        coming pass's figure (in a worker thread), so that none is lost from NVML's
        buffer between passes: the pass's figure is the mean over its whole interval,
        as a buffer long enough would give it."""
        await anyio.to_thread.run_sync(self._top_up_all)

    async def sample_once(self) -> Sample:
        """One pass: read every device in a worker thread, then tell `on_sample`."""
        inventory = self._inventory()
        prepared = self._prepared()
        # In the same step as the checkpoint read: the preparer tells the log with each
        # change, so the changes taken are exactly those since the previous pass's read.
        changes = self.holdings.take()
        containers, shares = self._containers(), self._shares()
        held = held_devices(
            prepared, self._pool, self._claim_info(), self._tenant_of, containers, shares, inventory
        )
        released = released_devices(
            changes, self._pool, self._tenant_of, containers, shares, inventory
        )
        devices = devices_to_sample(inventory, held)
        try:
            readings = await anyio.to_thread.run_sync(self._read_all, devices)
        except BaseException:
            self.holdings.put_back(changes)  # for the next pass, which reads the claims again
            raise
        health = self._health()
        report = health.report() if health is not None else None
        sample = Sample(
            self.clock(),
            tuple(readings),
            held,
            healthy={n: d.healthy for n, d in report.devices.items()} if report else {},
            xids=health.xid_counts() if health is not None else {},
            interval_s=self.interval_s,
            changes=changes,
            released=released,
        )
        self.latest = sample
        for callback in self._on_sample:
            callback(sample)
        return sample

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        async with anyio.create_task_group() as tg:
            if self.interval_s > self.top_up_every_s:
                tg.start_soon(
                    partial(
                        run_every,
                        self.top_up_every_s,
                        self.top_up_once,
                        failed="reading utilization samples between passes failed; trying again",
                        logger=log,
                    )
                )
            await run_every(
                self.interval_s,
                self.sample_once,
                failed="device sampling failed; trying again next interval",
                logger=log,
            )
