"""Health: NVML events become taints and health statuses, and taints heal again."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
import anyio.lowlevel
import pytest
from gpudra.driver.devices import Inventory, MigStrategy, discover
from gpudra.driver.health import (
    EccEvent,
    GpuLostEvent,
    GpuRecoveredEvent,
    HealthPolicy,
    HealthState,
    NvmlHealthWatcher,
    TaintEffect,
    XidEvent,
)
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.emulator import NvmlEmulator

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def wall() -> datetime:
    return datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def emulated(name: str) -> NvmlEmulator:
    nvml = load_nvml(f"emulated:{name}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml


def make_state(inventory: Inventory, clock: FakeClock, **policy: object) -> HealthState:
    return HealthState(
        inventory,
        HealthPolicy(recovery_after_s=60, **policy),  # type: ignore[arg-type]
        clock=clock,
        wall_clock=wall,
    )


def test_critical_xid_taints_the_gpu_and_heals_after_quiet_time() -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[3].uuid
    before = state.generation
    assert state.apply(XidEvent(uuid, 79))
    assert state.generation == before + 1
    report = state.report()
    (taint,) = report.taints("gpu-3")
    assert (taint.key, taint.value, taint.effect) == ("gpu.nvidia.com/xid", "79", "NoSchedule")
    assert taint.time_added == wall()
    assert not report.devices["gpu-3"].healthy
    assert "XID 79 (critical error)" in report.devices["gpu-3"].message
    assert report.unhealthy() == ("gpu-3",)
    assert report.devices["gpu-2"].healthy and report.taints("gpu-2") == ()

    clock.now += 59
    assert not state.expire()
    clock.now += 1
    assert state.expire()
    assert state.report().taints("gpu-3") == ()
    assert state.report().devices["gpu-3"].healthy


def test_repeated_xid_restarts_the_recovery_time() -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[0].uuid
    state.apply(XidEvent(uuid, 48))
    clock.now += 50
    assert not state.apply(XidEvent(uuid, 48))  # same taint: no visible change
    clock.now += 50
    assert not state.expire()  # only 50 s since the last occurrence
    clock.now += 10
    assert state.expire()


def test_application_xid_is_informational() -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    state = make_state(inventory, clock, extra_application_xids=frozenset({999}))
    uuid = inventory.gpus[0].uuid
    for xid in (13, 999):
        state.apply(XidEvent(uuid, xid))
        (taint,) = state.report().taints("gpu-0")
        assert (taint.value, taint.effect) == (str(xid), TaintEffect.NONE)
        assert state.report().devices["gpu-0"].healthy
    # A critical XID overrides; a later application XID neither softens nor prolongs it.
    state.apply(XidEvent(uuid, 79))
    clock.now += 30
    assert not state.apply(XidEvent(uuid, 13))
    (taint,) = state.report().taints("gpu-0")
    assert (taint.value, taint.effect) == ("79", TaintEffect.NO_SCHEDULE)
    clock.now += 30
    assert state.expire()


def test_critical_effect_is_configurable() -> None:
    inventory = discover(emulated("l4"))
    state = make_state(inventory, FakeClock(), critical_effect=TaintEffect.NO_EXECUTE)
    state.apply(XidEvent(inventory.gpus[0].uuid, 94))
    assert state.report().taints("gpu-0")[0].effect is TaintEffect.NO_EXECUTE
    with pytest.raises(ValueError, match="critical_effect"):
        HealthPolicy(critical_effect=TaintEffect.NONE)


def test_gpu_lost_stays_until_the_gpu_answers_and_then_heals() -> None:
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[6].uuid
    state.apply(GpuLostEvent(uuid))
    (taint,) = state.report().taints("gpu-6")
    assert (taint.key, taint.value, taint.effect) == ("gpu.nvidia.com/gpu-lost", None, "NoExecute")
    clock.now += 10_000
    assert not state.expire()  # still lost: never expires
    assert state.apply(GpuRecoveredEvent(uuid))
    assert not state.report().devices["gpu-6"].healthy
    assert "answers again" in state.report().devices["gpu-6"].message
    clock.now += 60
    assert state.expire()
    assert state.report().devices["gpu-6"].healthy


def test_mig_scoped_xid_taints_only_that_mig_device() -> None:
    inventory = discover(emulated("a100-40gb-mig-mixed"))
    state = make_state(inventory, FakeClock())
    gpu = inventory.gpus[0]
    state.apply(XidEvent(gpu.uuid, 79, device="gpu-0-mig-2g10gb-14-0"))
    report = state.report()
    assert report.unhealthy() == ("gpu-0-mig-2g10gb-14-0",)
    # A whole-GPU event taints every device of that GPU in every view, and no other GPU.
    state.apply(EccEvent(gpu.uuid))
    report = state.report()
    assert set(report.unhealthy()) == set(gpu.device_names())
    assert {d.name for d in inventory.devices(MigStrategy.DYNAMIC) if d.gpu_index == 0} <= set(
        report.unhealthy()
    )
    assert all(report.devices[n].healthy for n in inventory.gpus[1].device_names())


async def test_wait_for_change_wakes_on_apply() -> None:
    inventory = discover(emulated("l4"))
    state = make_state(inventory, FakeClock())
    seen = state.generation
    woke = anyio.Event()

    async def waiter() -> None:
        await state.wait_for_change(seen)
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.lowlevel.checkpoint()
        assert not woke.is_set()
        state.apply(XidEvent(inventory.gpus[0].uuid, 79))
        with anyio.fail_after(10):
            await woke.wait()


@asynccontextmanager
async def watching(nvml: NvmlEmulator, state: HealthState) -> AsyncIterator[Callable[[], int]]:
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=20)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        yield lambda: state.generation
        tg.cancel_scope.cancel()


async def next_change(state: HealthState, seen: int) -> None:
    with anyio.fail_after(10):  # a hang guard, not a timing assertion
        await state.wait_for_change(seen)


async def test_watcher_turns_nvml_events_into_taints() -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    clock = FakeClock()
    state = make_state(inventory, clock)
    async with watching(nvml, state):
        seen = state.generation
        nvml.inject_xid(2, 79)
        await next_change(state, seen)
        assert state.report().unhealthy() == ("gpu-2",)
        assert state.report().taints("gpu-2")[0].value == "79"

        seen = state.generation
        nvml.inject_xid(4, 13)
        await next_change(state, seen)
        assert state.report().taints("gpu-4")[0].effect is TaintEffect.NONE

        seen = state.generation
        clock.now += 60  # the watcher lets taints expire between events
        await next_change(state, seen)
        assert state.report().unhealthy() == ()
    # The watcher freed its event set and shut NVML down on the way out.
    with pytest.raises(Exception, match="Uninitialized"):
        nvml.nvmlDeviceGetCount()


async def test_watcher_handles_gpu_loss_and_recovery() -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    clock = FakeClock()
    state = make_state(inventory, clock)
    lost_uuid = inventory.gpus[5].uuid
    async with watching(nvml, state):
        seen = state.generation
        nvml.lose_gpu(5)
        await next_change(state, seen)
        assert state.report().unhealthy() == ("gpu-5",)
        assert state.report().taints("gpu-5")[0].effect is TaintEffect.NO_EXECUTE
        assert state.lost_gpus == {lost_uuid}

        seen = state.generation
        nvml.recover_gpu(5)
        await next_change(state, seen)  # the watcher notices the GPU answers again
        assert state.lost_gpus == frozenset()
        assert "gpu-5" in state.report().unhealthy()

        seen = state.generation
        clock.now += 60
        await next_change(state, seen)
        assert state.report().unhealthy() == ()

        # Events still flow for the recovered GPU.
        seen = state.generation
        nvml.inject_xid(5, 63)
        await next_change(state, seen)
        assert state.report().taints("gpu-5")[0].value == "63"


async def test_watcher_resolves_mig_scoped_events() -> None:
    nvml = emulated("a100-40gb-mig-mixed")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    mig = inventory.find("gpu-1-mig-4g20gb-5-0")
    assert mig is not None and mig.gpu_instance_id is not None
    assert mig.compute_instance_id is not None
    async with watching(nvml, state):
        seen = state.generation
        nvml.inject_xid(
            1,
            79,
            gpu_instance_id=mig.gpu_instance_id,
            compute_instance_id=mig.compute_instance_id,
        )
        await next_change(state, seen)
        assert state.report().unhealthy() == ("gpu-1-mig-4g20gb-5-0",)


async def test_watcher_is_cancelled_promptly_while_waiting() -> None:
    nvml = emulated("l4")
    state = make_state(discover(nvml), FakeClock())
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=50)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            tg.cancel_scope.cancel()
