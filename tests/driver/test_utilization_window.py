"""A whole GPU's utilization covers the sampling interval, not NVML's last sample period:
the sampler averages the GPU's utilization samples since its previous pass, and
accounting bills idle time from that."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest
from gpudra.driver.accounting import Accounting
from gpudra.driver.checkpoint import ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.devices import Inventory, discover
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile
from gpudra.driver.records import DeviceDetails
from gpudra.driver.sampling import Sample, Sampler

pytestmark = pytest.mark.anyio

POOL = "node-a"
INTERVAL = 10.0


class Clock:
    """One clock for the emulated GPU and the sampler: a test steps both through time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def held(uuid: str) -> ClaimRecord:
    details = DeviceDetails(type="gpu", gpu_uuid=uuid, uuid=uuid, pod="trainer")
    return ClaimRecord(
        uid="u1",
        namespace="team-a",
        name="train",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(DeviceRecord(POOL, "gpu-0", ("gpu",), details=details),),
    )


def samples_fail(code: int) -> type[NvmlEmulator]:
    """Emulated GPUs whose samples call answers `code` (NOT_SUPPORTED: a product
    without the buffer; FUNCTION_NOT_FOUND: a libnvidia-ml without the symbol)."""

    class Failing(NvmlEmulator):
        def nvmlDeviceGetSamples(
            self, device: Any, sampling_type: int, timeStamp: int
        ) -> tuple[int, list[Any]]:
            raise pynvml.NVMLError(code)

    return Failing


class Node:
    def __init__(self, telemetry: dict[str, Any], nvml: type[NvmlEmulator] = NvmlEmulator) -> None:
        doc = load_builtin_profile("l4").model_dump(mode="json")
        doc["gpus"][0]["telemetry"] = telemetry
        self.clock = Clock()
        self.nvml = nvml(parse_profile(doc), clock=self.clock)
        self.inventory: Inventory | None = discover(self.nvml)
        self.uuid = discover(self.nvml).gpus[0].uuid
        self.accounting = Accounting(idle_below=5)
        self.sampler = Sampler(
            self.nvml,
            pool=POOL,
            inventory=lambda: self.inventory,
            prepared=lambda: (held(self.uuid),),
            on_sample=(self.accounting.observe,),
            interval_s=INTERVAL,
            clock=self.clock,
        )

    async def sample_at(self, at: float) -> Sample:
        self.clock.now = at
        return await self.sampler.sample_once()

    def utilization(self, sample: Sample, name: str = "utilization") -> float:
        [reading] = [r for d, r in sample.devices if d.uuid == self.uuid]
        return reading.values[name]

    def instant_utilization(self) -> int:
        """What the rates call answers now: the GPU's last sample period only."""
        self.nvml.nvmlInit()
        try:
            return int(
                self.nvml.nvmlDeviceGetUtilizationRates(self.nvml.nvmlDeviceGetHandleByIndex(0)).gpu
            )
        finally:
            self.nvml.nvmlShutdown()

    def billed(self) -> tuple[float, float]:
        [(key, allocated)] = self.accounting.allocated().items()
        return allocated, self.accounting.idle().get(key, 0.0)


def every_interval(busy: float, idle: float, *, for_s: float, gap_from: float) -> list[Any]:
    """Steps of a job at `busy` percent with a gap at `idle` percent from `gap_from`
    seconds into each sampling interval to its end."""
    steps: list[Any] = []
    for start in range(0, int(for_s), int(INTERVAL)):
        steps += [[start, busy], [start + gap_from, idle]]
    return steps


async def test_a_gpu_busy_but_between_kernels_at_each_pass_is_not_billed_idle() -> None:
    """Busy 95 % of each interval, in its data-loader gap at every pass: one reading
    per pass saw 0 % each time and billed the hour idle."""
    node = Node({"utilization": every_interval(97, 0, for_s=3700, gap_from=9.5)})
    for n in range(361):  # one hour at the default 10 s interval, each pass in the gap
        sample = await node.sample_at(n * INTERVAL + 9.75)
        assert node.instant_utilization() == 0
        if n:
            assert node.utilization(sample) == pytest.approx(97 * 0.95, abs=2)
    allocated, idle = node.billed()
    assert allocated == pytest.approx(3600)
    assert idle == 0


async def test_a_burst_timed_to_each_pass_does_not_hide_an_idle_gpu() -> None:
    """The other way round: idle but for a burst around each pass, billed idle."""
    node = Node({"utilization": every_interval(0, 100, for_s=3700, gap_from=9.8)})
    for n in range(361):
        sample = await node.sample_at(n * INTERVAL + 9.9)
        assert node.instant_utilization() == 100
        if n:
            assert node.utilization(sample) == pytest.approx(2, abs=2)
    assert node.billed() == pytest.approx((3600, 3600))


async def test_memory_utilization_covers_the_interval_too() -> None:
    node = Node({"memoryUtilization": [[0, 0], [10, 60], [15, 20]]})
    await node.sample_at(10.0)
    sample = await node.sample_at(20.0)
    assert node.utilization(sample, "memory_utilization") == pytest.approx(40, abs=3)


async def test_without_samples_to_average_a_pass_takes_the_gpus_last_sample_period() -> None:
    """The first pass (the buffer holds time from before it) and a pass with no sample
    since the previous one (NOT_FOUND) read the utilization rates call instead."""
    node = Node({"utilization": [[0, 100], [9, 30]]})
    first = await node.sample_at(10.0)
    assert node.utilization(first) == 30  # not the buffer's mean of 100s and 30s
    again = await node.sample_at(10.05)  # within one sample period: none newer
    assert node.utilization(again) == 30
    node.nvml.telemetry.script(0, utilization=70)
    assert node.utilization(await node.sample_at(10.1)) == 70


async def test_a_gpu_sampled_again_after_a_while_starts_afresh() -> None:
    """A GPU that left the inventory and came back averages nothing it missed: its
    first pass back takes the rates call's figure."""
    node = Node({"utilization": [[0, 50], [10, 100], [19, 0]]})
    await node.sample_at(10.0)
    inventory, node.inventory = node.inventory, None
    await node.sample_at(15.0)
    node.inventory = inventory
    assert node.utilization(await node.sample_at(20.0)) == 0  # not the 100s since 10 s


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND]
)
async def test_without_the_samples_call_every_pass_takes_the_rates_call(code: int) -> None:
    node = Node({"utilization": [[0, 100], [19, 30]]}, samples_fail(code))
    await node.sample_at(10.0)
    sample = await node.sample_at(20.0)
    assert node.utilization(sample) == 30
    assert node.billed() == pytest.approx((10, 0))


async def test_a_failing_samples_call_loses_the_utilization_and_says_why() -> None:
    """Not a figure from another call: the reason is exported, the rest is read."""
    node = Node({"utilization": 50, "temperature": 61}, samples_fail(pynvml.NVML_ERROR_UNKNOWN))
    sample = await node.sample_at(10.0)
    [reading] = [r for d, r in sample.devices if d.uuid == node.uuid]
    assert "utilization" not in reading.values
    assert reading.missing == {"utilization": "unknown", "memory_utilization": "unknown"}
    assert reading.values["temperature"] == 61
