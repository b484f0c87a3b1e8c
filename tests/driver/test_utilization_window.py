"""A whole GPU's utilization covers the sampling interval, not NVML's last sample period:
the sampler averages the GPU's utilization samples since its previous pass, and
accounting bills idle time from that."""

from __future__ import annotations

from typing import Any

import anyio
import pynvml
import pytest
from gpudra.driver.accounting import Accounting
from gpudra.driver.checkpoint import ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.devices import Inventory, discover
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile
from gpudra.driver.records import DeviceDetails
from gpudra.driver.sampling import Sample, Sampler
from gpudra.driver.utilization import TOP_UP_EVERY_S

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
    """An emulated L4 held by one claim, sampled every `interval_s`. `wall`: the clock of
    NVML's sample timestamps where it is not the sampler's (the node's wall clock)."""

    def __init__(
        self,
        telemetry: dict[str, Any],
        nvml: type[NvmlEmulator] = NvmlEmulator,
        *,
        interval_s: float = INTERVAL,
        wall: Clock | None = None,
    ) -> None:
        doc = load_builtin_profile("l4").model_dump(mode="json")
        doc["gpus"][0]["telemetry"] = telemetry
        self.clock = Clock()
        self.wall = wall
        self.nvml = nvml(parse_profile(doc), clock=wall or self.clock)
        self.inventory: Inventory | None = discover(self.nvml)
        self.uuid = discover(self.nvml).gpus[0].uuid
        self.accounting = Accounting(idle_below=5)
        self.sampler = Sampler(
            self.nvml,
            pool=POOL,
            inventory=lambda: self.inventory,
            prepared=lambda: (held(self.uuid),),
            on_sample=(self.accounting.observe,),
            interval_s=interval_s,
            clock=self.clock,
            **({"wall_clock": wall} if wall is not None else {}),
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


def every_interval(
    busy: float, idle: float, *, for_s: float, gap_from: float, interval_s: float = INTERVAL
) -> list[Any]:
    """Steps of a job at `busy` percent with a gap at `idle` percent from `gap_from`
    seconds into each sampling interval to its end."""
    steps: list[Any] = []
    for start in range(0, int(for_s), int(interval_s)):
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


@pytest.mark.parametrize(("interval", "busy_for"), [(30.0, 13.0), (60.0, 40.0)])
async def test_an_interval_longer_than_the_sample_buffer_loses_none_of_its_samples(
    interval: float, busy_for: float
) -> None:
    """NVML's buffer holds about 14 s of samples: a 30 s or 60 s pass that read it once
    averaged only the interval's tail, and billed a job that computes at the start of
    each interval, idle after, as idle. Reads between passes keep every sample."""
    steps = every_interval(100, 0, for_s=3700, gap_from=busy_for, interval_s=interval)
    node = Node({"utilization": steps}, interval_s=interval)
    for n in range(int(3600 / interval) + 1):
        start = n * interval
        if n:  # between passes, as `Sampler.run` reads at this interval
            for k in range(1, int(interval // TOP_UP_EVERY_S) + 1):
                node.clock.now = start + k * TOP_UP_EVERY_S - 0.05
                await node.sampler.top_up_once()
        sample = await node.sample_at(start + interval - 0.05)
        if n:
            assert node.utilization(sample) == pytest.approx(100 * busy_for / interval, abs=1)
    allocated, idle = node.billed()
    assert allocated == pytest.approx(3600)
    assert idle == 0


async def test_reads_between_passes_leave_the_first_pass_and_an_idle_gpu_as_they_were() -> None:
    """A read before any pass starts nothing (the first pass still takes the rates
    call), and the reads add samples, never weight: an idle GPU stays idle."""
    node = Node({"utilization": [[0, 100], [29, 0]]}, interval_s=30)
    node.clock.now = 10.0
    await node.sampler.top_up_once()
    assert node.utilization(await node.sample_at(30.0)) == 0  # the rates call's
    node.nvml.telemetry.script(0, utilization=0)
    for at in (40.0, 50.0):
        node.clock.now = at
        await node.sampler.top_up_once()
    assert node.utilization(await node.sample_at(60.0)) == 0
    assert node.billed() == pytest.approx((30, 30))


class CountingRates(NvmlEmulator):
    """Counts the rates calls: the figure of the GPU's last sample period only."""

    rates_calls = 0

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        self.rates_calls += 1
        return super().nvmlDeviceGetUtilizationRates(handle)


async def test_after_the_wall_clock_steps_back_passes_average_the_samples_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The samples' timestamps are the wall clock's: after it stepped back an hour, the
    newest seen was an hour ahead, no sample was newer, and every pass took the rates
    call, whose last sample period a burst timed to each pass fills."""
    wall = Clock()
    wall.now = 1_700_000_000.0
    node = Node({"utilization": 0}, CountingRates, wall=wall)
    nvml = node.nvml
    assert isinstance(nvml, CountingRates)

    async def step() -> float:
        wall.now += INTERVAL
        return node.utilization(await node.sample_at(node.clock.now + INTERVAL))

    for _ in range(3):
        await step()
    wall.now -= 3600  # NTP steps the wall clock back an hour
    with caplog.at_level("WARNING", logger="gpudra.driver.utilization"):
        seen = [await step() for _ in range(5)]
        nvml.rates_calls = 0
        node.nvml.telemetry.script(0, utilization=90)
        seen += [await step() for _ in range(30)]
    assert seen[-1] == 90
    assert nvml.rates_calls == 0  # every pass after the first averaged samples
    [warning] = [r for r in caplog.records if "stepped back" in r.getMessage()]
    assert getattr(warning, "fields", {})["gpu"] == node.uuid


class CountingSamples(NvmlEmulator):
    """Counts the samples calls, passes' and reads' between them alike."""

    samples_calls = 0

    def nvmlDeviceGetSamples(
        self, device: Any, sampling_type: int, timeStamp: int
    ) -> tuple[int, list[Any]]:
        self.samples_calls += 1
        return super().nvmlDeviceGetSamples(device, sampling_type, timeStamp)


async def test_a_running_sampler_reads_the_buffer_between_passes_longer_than_it_holds() -> None:
    """`run` reads every `top_up_every_s` between passes an interval apart: here one
    pass an hour, so every samples call after the first pass's two is such a read."""
    node = Node({"utilization": 50}, CountingSamples, interval_s=3600)
    nvml = node.nvml
    assert isinstance(nvml, CountingSamples)
    node.sampler.top_up_every_s = 0.01
    node.clock.now = 10.0  # the buffer has samples for the first pass to start from
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(node.sampler.run)
            while nvml.samples_calls < 2 + 3 * 2:  # three reads of both figures
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert node.sampler.latest is not None  # the first pass, whose reads start the windows
