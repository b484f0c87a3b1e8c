"""Health: NVML events become taints and health statuses, and taints heal again, each on
its own evidence: quiet time, a GPU that answers again, or a GPU reset."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import anyio
import anyio.lowlevel
import pynvml
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import (
    MIG_MONITOR_PRIVILEGE,
    FieldGap,
    Inventory,
    MigStrategy,
    discover,
)
from gpudra.driver.gpuresets import GpuResets, PendingReset
from gpudra.driver.health import (
    APPLICATION_XIDS,
    RESET_XIDS,
    EccEvent,
    GpuLostEvent,
    GpuRecoveredEvent,
    GpuResetEvent,
    HealthPolicy,
    HealthState,
    NvmlHealthWatcher,
    TaintEffect,
    XidEvent,
)
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile

from tests.nvml.emulated import emulated

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


def make_state(inventory: Inventory, clock: FakeClock, **policy: object) -> HealthState:
    return HealthState(
        inventory,
        HealthPolicy(recovery_after_s=60, **policy),  # type: ignore[arg-type]
        clock=clock,
        wall_clock=wall,
    )


def test_critical_xid_taints_the_gpu_and_heals_after_quiet_time() -> None:
    """XID 74 (NVLink error): NVIDIA has it decoded first, no reset by default."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[3].uuid
    before = state.generation
    assert state.apply(XidEvent(uuid, 74))
    assert state.generation == before + 1
    report = state.report()
    (taint,) = report.taints("gpu-3")
    assert (taint.key, taint.value, taint.effect) == ("gpu.nvidia.com/xid", "74", "NoSchedule")
    assert taint.time_added == wall()
    assert not report.devices["gpu-3"].healthy
    assert report.devices["gpu-3"].message == "XID 74 (critical error)"
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
    state.apply(XidEvent(uuid, 74))
    clock.now += 50
    assert not state.apply(XidEvent(uuid, 74))  # same taint: no visible change
    clock.now += 50
    assert not state.expire()  # only 50 s since the last occurrence
    clock.now += 10
    assert state.expire()


def test_application_xid_is_informational() -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    state = make_state(inventory, clock, extra_application_xids=frozenset({999}))
    uuid = inventory.gpus[0].uuid
    assert state.apply(XidEvent(uuid, 999))  # configured as an application XID
    (taint,) = state.report().taints("gpu-0")
    assert (taint.value, taint.effect) == ("999", TaintEffect.NONE)
    assert state.report().devices["gpu-0"].healthy
    # Another application XID refreshes the informational taint and rewrites nothing
    # (the node's slices are not written again for every crash), yet it is counted.
    clock.now += 50
    assert not state.apply(XidEvent(uuid, 13))
    (taint,) = state.report().taints("gpu-0")
    assert (taint.value, taint.effect) == ("999", TaintEffect.NONE)
    assert state.xid_counts()[(uuid, 13)] == 1
    clock.now += 50
    assert not state.expire()  # 50 s since the last application XID, not 100
    # A critical XID overrides; a later application XID neither softens nor prolongs it.
    state.apply(XidEvent(uuid, 74))
    clock.now += 30
    assert not state.apply(XidEvent(uuid, 13))
    (taint,) = state.report().taints("gpu-0")
    assert (taint.value, taint.effect) == ("74", TaintEffect.NO_SCHEDULE)
    clock.now += 30
    assert state.expire()


def test_critical_effect_is_configurable() -> None:
    inventory = discover(emulated("l4"))
    state = make_state(inventory, FakeClock(), critical_effect=TaintEffect.NO_EXECUTE)
    state.apply(XidEvent(inventory.gpus[0].uuid, 74))
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
    state.apply(XidEvent(gpu.uuid, 74, device="gpu-0-mig-2g10gb-14-0"))
    report = state.report()
    assert [d.name for d in gpu.mig_devices if not report.devices[d.name].healthy] == [
        "gpu-0-mig-2g10gb-14-0"
    ]
    # A whole-GPU event taints every device of that GPU in every view, and no other GPU.
    state.apply(EccEvent(gpu.uuid))
    report = state.report()
    assert set(report.unhealthy()) == set(gpu.device_names())
    assert {d.name for d in inventory.devices(MigStrategy.DYNAMIC) if d.gpu_index == 0} <= set(
        report.unhealthy()
    )
    assert all(report.devices[n].healthy for n in inventory.gpus[1].device_names())


def test_an_xid_on_a_mig_instance_taints_every_placement_on_its_memory() -> None:
    # Dynamic MIG publishes each placement under its own name: tainting the name alone
    # would hand the same broken memory out under another profile.
    inventory = discover(emulated("h100-80gb-hbm3-x8-mig"))
    state = make_state(inventory, FakeClock())
    gpu = inventory.gpus[0]
    published = [d for d in inventory.devices(MigStrategy.DYNAMIC) if d.gpu_index == 0]
    hit = next(d for d in published if d.name == "gpu-0-mig-1g10gb-19-0")
    assert hit.placement is not None
    at = hit.placement
    state.apply(XidEvent(gpu.uuid, 74, device=hit.name))
    report = state.report()
    tainted = {d.name for d in published if not report.devices[d.name].healthy}
    sharing = {
        d.name
        for d in published
        if d.placement is not None and d.placement.start < at.end and at.start < d.placement.end
    }
    assert tainted == sharing
    assert hit.name in tainted and "gpu-0-mig-7g80gb-0-0" in tainted
    assert 1 < len(tainted) < len(published)
    # An XID after which the GPU is reset takes every instance on it out of service.
    state.apply(XidEvent(gpu.uuid, 95, device=hit.name))
    report = state.report()
    assert set(report.unhealthy()) == set(gpu.device_names())
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
        nvml.inject_xid(2, 74)
        await next_change(state, seen)
        assert state.report().unhealthy() == ("gpu-2",)
        assert state.report().taints("gpu-2")[0].value == "74"

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


# --- a lost GPU: NVML keeps saying so ----------------------------------------------------


def test_the_emulated_wait_says_lost_while_a_gpu_of_its_set_is_lost() -> None:
    """nvml.h: the wait answers GPU_IS_LOST "if a GPU has fallen off the bus", a state:
    at once and wait after wait, after the events queued before the loss, on a set that
    holds the lost GPU; a set without it waits and delivers as usual."""
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.nvmlInit()
    with_lost, without = nvml.nvmlEventSetCreate(), nvml.nvmlEventSetCreate()
    xid = pynvml.nvmlEventTypeXidCriticalError
    for index in range(4):
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index), xid, with_lost)
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), xid, without)
    nvml.inject_xid(0, 74)
    nvml.lose_gpu(3)
    assert nvml.nvmlEventSetWait_v2(with_lost, 0).eventData == 74  # it came first
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            nvml.nvmlEventSetWait_v2(with_lost, 10_000)
    assert time.monotonic() - started < 5  # at once, not after the timeout
    assert nvml.nvmlEventSetWait_v2(without, 0).eventData == 74
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(without, 10)
    nvml.recover_gpu(3)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(with_lost, 10)


def xids_seen(state: HealthState, gpu: int, xid: int) -> int:
    return state.xid_counts().get((state.inventory.gpus[gpu].uuid, xid), 0)


async def until(condition: Callable[[], bool], within_s: float) -> None:
    with anyio.fail_after(within_s):
        while not condition():
            await anyio.sleep(0.01)


async def test_a_lost_gpu_neither_spins_the_watcher_nor_hides_the_other_gpus() -> None:
    """After an XID 79 every wait on an event set that holds the lost GPU answers
    GPU_IS_LOST at once. The watcher builds its set again without it: it does not spin
    (a waiting watcher makes no NVML calls), and the errors of the GPUs that still
    answer reach it, those queued behind the loss and those after it, long before the
    wait timeout."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=3000)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        nvml.lose_gpu(3)
        nvml.inject_xid(0, 48)  # at the same time: queued behind the loss
        await until(lambda: state.lost_gpus == {inventory.gpus[3].uuid}, 2)
        await until(lambda: xids_seen(state, 0, 48) == 1, 2)

        calls = nvml.call_count
        await anyio.sleep(0.3)
        assert nvml.call_count - calls <= 5  # blocked in the wait, not asking again

        nvml.inject_xid(1, 48)
        await until(lambda: xids_seen(state, 1, 48) == 1, 1)  # the wait is 3 s
        assert {"gpu-0", "gpu-1", "gpu-3"} == set(state.report().unhealthy())
        tg.cancel_scope.cancel()
        nvml.inject_xid(2, 13)  # wakes the wait, so the watcher stops now


async def test_a_lost_gpu_is_watched_again_once_it_was_reset() -> None:
    """The lost GPU left the event set; the reset that the watcher sees registers its
    events again: its next XID and its next loss are seen."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    lost = inventory.gpus[3].uuid
    async with watching(nvml, state):  # waits of 20 ms
        seen = state.generation
        nvml.lose_gpu(3)
        await next_change(state, seen)
        assert state.lost_gpus == {lost}
        calls = nvml.call_count
        await anyio.sleep(0.3)
        # One call per wait timeout: GPU 3 asked whether it was reset.
        assert nvml.call_count - calls < 100

        nvml.recover_gpu(3)
        await until(lambda: not state.lost_gpus, 10)
        nvml.inject_xid(3, 74)
        await until(lambda: xids_seen(state, 3, 74) == 1, 10)
        nvml.lose_gpu(3)
        await until(lambda: state.lost_gpus == {lost}, 10)


class AnyGpuLost(NvmlEmulator):
    """NVML as NVIDIA's mock NVML has it (k8s-test-infra, PR 746): while any GPU is
    lost, every wait answers GPU_IS_LOST once the pending events are read, whatever
    GPUs its event set holds. Counts the waits."""

    def __init__(self, name: str) -> None:
        super().__init__(load_builtin_profile(name))
        self.lost: set[int] = set()
        self.waits = 0

    def lose_gpu(self, index: int) -> None:
        super().lose_gpu(index)
        self.lost.add(index)

    def recover_gpu(self, index: int) -> None:
        super().recover_gpu(index)
        self.lost.discard(index)

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> object:
        self.waits += 1
        if not self.lost:
            return super().nvmlEventSetWait_v2(eventSet, timeoutms)
        try:
            return super().nvmlEventSetWait_v2(eventSet, 0)
        except pynvml.NVMLError_Timeout:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST) from None


async def test_an_nvml_that_says_lost_for_any_gpu_does_not_spin_the_watcher(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where the wait says lost whatever the event set holds, building it again does not
    help: the watcher waits the wait timeout between waits (and checks for a reset), and
    says once, not per wait, that no other GPU is lost. Events still come through."""
    nvml = AnyGpuLost("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=100)
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.health"):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            nvml.lose_gpu(3)
            await until(lambda: state.lost_gpus == {inventory.gpus[3].uuid}, 10)
            waits = nvml.waits
            await anyio.sleep(0.5)
            assert nvml.waits - waits <= 10  # one per wait timeout

            nvml.inject_xid(0, 48)
            await until(lambda: xids_seen(state, 0, 48) == 1, 10)
            nvml.recover_gpu(3)
            await until(lambda: not state.lost_gpus, 10)
            nvml.inject_xid(3, 74)
            await until(lambda: xids_seen(state, 3, 74) == 1, 10)
            tg.cancel_scope.cancel()
    unexplained = [r for r in caplog.records if "every GPU answers" in r.message]
    assert 1 <= len(unexplained) <= 2  # before the XID on GPU 0, and after it


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
            74,
            gpu_instance_id=mig.gpu_instance_id,
            compute_instance_id=mig.compute_instance_id,
        )
        await next_change(state, seen)
        report = state.report()
        assert [
            d.name for d in inventory.gpus[1].mig_devices if not report.devices[d.name].healthy
        ] == ["gpu-1-mig-4g20gb-5-0"]
        assert all(report.devices[n].healthy for n in inventory.gpus[0].device_names())


async def test_an_event_of_a_whole_gpu_instance_is_named_where_nvml_cannot_say_where_it_sits() -> (
    None
):
    """An XID scoped to a GPU instance but to none of its compute instances, read while
    NVML cannot be asked where that instance sits (the last scan is asked then): it
    names the instance's MIG device. It named none before, so it tainted nothing."""
    nvml = emulated("a100-40gb-mig-mixed")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    mig = inventory.find("gpu-1-mig-4g20gb-5-0")
    assert mig is not None and mig.gpu_instance_id is not None
    async with watching(nvml, state):
        seen = state.generation
        nvml.fail_after(0, pynvml.NVML_ERROR_UNKNOWN)
        nvml.inject_xid(1, 74, gpu_instance_id=mig.gpu_instance_id)
        await next_change(state, seen)
        nvml.clear_failure()
    report = state.report()
    assert [
        d.name for d in inventory.gpus[1].mig_devices if not report.devices[d.name].healthy
    ] == ["gpu-1-mig-4g20gb-5-0"]


@dataclass(frozen=True)
class Instance:
    """A GPU instance with one compute instance spanning it, as prepare makes them."""

    gi: object
    ci: object
    gi_id: int
    ci_id: int

    @classmethod
    def make(
        cls,
        nvml: NvmlEmulator,
        index: int,
        profile_id: int,
        start: int,
        *,
        size: int = 1,
        ci_profile: int = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    ) -> Instance:
        parent = nvml.nvmlDeviceGetHandleByIndex(index)
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(parent, profile_id, placement)
        profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_profile, 0)
        ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, profile.id)
        gi_id = nvml.nvmlGpuInstanceGetInfo(gi).id
        return cls(gi, ci, gi_id, nvml.nvmlComputeInstanceGetInfo(ci).id)

    def destroy(self, nvml: NvmlEmulator) -> None:
        nvml.nvmlComputeInstanceDestroy(self.ci)
        nvml.nvmlGpuInstanceDestroy(self.gi)


async def test_watcher_names_a_dynamic_instance_by_where_it_sits_now() -> None:
    # The inventory (rescanned every minute) saw a 1g.10gb+me instance at slice 0; its
    # claim was unprepared and a 1g.10gb instance made there for another claim. An XID on
    # the new instance taints the new one's name.
    nvml = emulated("h100-80gb-hbm3-x8-mig")
    nvml.nvmlInit()
    old = Instance.make(nvml, 0, 20, 0)
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    old.destroy(nvml)
    new = Instance.make(nvml, 0, 19, 0)
    async with watching(nvml, state):
        seen = state.generation
        nvml.inject_xid(0, 74, gpu_instance_id=new.gi_id, compute_instance_id=new.ci_id)
        await next_change(state, seen)
    assert not state.report().devices["gpu-0-mig-1g10gb-19-0"].healthy


@pytest.mark.parametrize(("xid", "whole_gpu"), [(69, False), (95, True)])
async def test_an_xid_on_an_instance_gone_before_it_is_read_spares_the_other_tenants(
    xid: int, whole_gpu: bool
) -> None:
    # A tenant's instance raises an XID and is destroyed (its claim unprepared) before
    # the event is read: the GPU's other instances are other tenants', and no event of
    # that instance may take them out of service, unless the GPU itself needs a reset.
    nvml = emulated("h100-80gb-hbm3-x8-mig")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    async with watching(nvml, state):
        gone = Instance.make(nvml, 0, 19, 0)
        gone.destroy(nvml)
        seen = state.generation
        nvml.inject_xid(0, xid, gpu_instance_id=gone.gi_id, compute_instance_id=gone.ci_id)
        nvml.inject_xid(1, 74)  # a whole-GPU event behind it, to know the first was read
        await next_change(state, seen)
        with anyio.fail_after(10):
            while not state.xid_counts().get((inventory.gpus[0].uuid, xid)):
                await anyio.sleep(0.01)
    report = state.report()
    gpu0 = inventory.gpus[0].device_names()
    if whole_gpu:
        assert not any(report.devices[n].healthy for n in gpu0)
    else:
        assert all(report.devices[n].healthy for n in gpu0)
        assert state.xid_counts()[(inventory.gpus[0].uuid, xid)] == 1


async def test_an_xid_on_an_instance_the_last_scan_saw_spares_the_one_now_on_its_memory() -> None:
    # The rescan saw tenant A's 1g.10gb instance at slice 2; A's claim was unprepared and
    # tenant B's 2g.20gb instance made on slices 2-3 before A's XID was read. NVML no
    # longer has A's instance: the last scan's instance of that ID would name slice 2,
    # whose overlapping placements are B's now. Nothing is tainted.
    nvml = emulated("h100-80gb-hbm3-x8-mig")
    nvml.nvmlInit()
    a = Instance.make(nvml, 0, 19, 2)
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock(), critical_effect=TaintEffect.NO_EXECUTE)
    async with watching(nvml, state):
        a.destroy(nvml)
        b = Instance.make(
            nvml, 0, 14, 2, size=2, ci_profile=pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE
        )
        assert b.gi_id != a.gi_id  # else NVML names B's instance: nothing tells them apart
        seen = state.generation
        nvml.inject_xid(0, 74, gpu_instance_id=a.gi_id, compute_instance_id=a.ci_id)
        nvml.inject_xid(1, 74)  # a whole-GPU event behind it, to know the first was read
        await next_change(state, seen)
        await until(lambda: xids_seen(state, 0, 74) == 1, 10)
    report = state.report()
    assert all(report.devices[n].healthy for n in inventory.gpus[0].device_names())
    assert not report.taints("gpu-0-mig-2g20gb-14-2")
    assert not report.devices["gpu-1"].healthy


class FlakyRegistration(NvmlEmulator):
    """NVML whose event registration of the GPUs in `failing` fails `times` times each
    with an error other than a lost GPU, as a transient driver error would."""

    def __init__(self, name: str, failing: set[int], times: int) -> None:
        super().__init__(load_builtin_profile(name))
        self.failures = dict.fromkeys(failing, times)

    def nvmlDeviceRegisterEvents(self, device: object, eventTypes: int, eventSet: object) -> None:
        index = self.nvmlDeviceGetIndex(device)
        if self.failures.get(index, 0) > 0:
            self.failures[index] -= 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        super().nvmlDeviceRegisterEvents(device, eventTypes, eventSet)


@pytest.mark.parametrize("when", ["at start", "when the event set is built again"])
async def test_a_gpu_whose_registration_failed_is_watched_once_it_succeeds(when: str) -> None:
    """A registration that fails once (at start, or in the rebuild after another GPU
    was lost) is tried again: before, the GPU stayed unwatched until the agent
    restarted, its errors unseen, under an informational taint only."""
    nvml = FlakyRegistration("h100-80gb-hbm3-x8", {3}, 2 if when == "at start" else 0)
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=20, register_retry_s=0.0)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        if when == "at start":
            assert state.report().taints("gpu-3")[0].key == state.policy.unmonitored_key
        else:
            nvml.failures[3] = 1
            nvml.lose_gpu(0)  # every other GPU is registered again in a new event set
        await until(lambda: nvml.failures[3] == 0 and not state.report().taints("gpu-3"), 10)
        nvml.inject_xid(3, 48)
        await until(lambda: xids_seen(state, 3, 48) == 1, 10)
        assert not state.report().devices["gpu-3"].healthy
        tg.cancel_scope.cancel()


async def recovery_action_changed(
    profile: str, action: int
) -> tuple[Inventory, FakeClock, HealthState]:
    """A watched `profile` whose GPU 0's recovery action NVML reports as `action` now
    (XID 154 says it changed): the inventory, the state's clock, and the state once the
    watcher has taken the event in."""
    nvml = emulated(profile)
    inventory = discover(nvml)
    clock = FakeClock()
    state = make_state(inventory, clock)
    async with watching(nvml, state):
        seen = state.generation
        nvml.change_recovery_action(0, action)
        await next_change(state, seen)
    return inventory, clock, state


@pytest.mark.parametrize(
    ("action", "critical", "reset"),
    [
        (pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET, True, True),
        (pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, True, True),
        (pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET, True, True),
        (pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, True, False),
        (pynvml.NVML_GPU_RECOVERY_ACTION_NONE, False, False),
    ],
)
async def test_xid_154_is_treated_as_the_recovery_action_nvml_reports_says(
    action: int, critical: bool, reset: bool
) -> None:
    """NVIDIA's XID 154 says the GPU's recovery action changed, and the field
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION what it is now. Before, every 154 was a timed
    critical XID: a GPU NVIDIA says must be reset went back into service after five
    quiet minutes, and one that needs nothing was taken out for five."""
    inventory, clock, state = await recovery_action_changed("h100-80gb-mig-r570", action)
    (taint,) = state.report().taints("gpu-0")
    assert taint.value == "154"
    expected = TaintEffect.NO_SCHEDULE if critical else TaintEffect.NONE
    assert taint.effect is expected
    uuid = inventory.gpus[0].uuid
    assert (PendingReset("gpu-0", 154) in state.pending_resets().get(uuid, ())) == reset
    clock.now += 10_000
    state.expire()
    assert bool(state.report().taints("gpu-0")) == reset
    # After a restart, a 154 that waited for a reset is raised again.
    restarted = make_state(inventory, FakeClock())
    assert restarted.restore_resets(state.pending_resets()) == reset


async def test_xid_154_without_a_readable_recovery_action_is_a_timed_critical_xid() -> None:
    # R535 has no recovery action (R565 on): the XID's taint lifts after quiet time.
    reset = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    _, _, state = await recovery_action_changed("h100-80gb-mig-r535", reset)
    (taint,) = state.report().taints("gpu-0")
    assert (taint.value, taint.effect) == ("154", TaintEffect.NO_SCHEDULE)
    assert state.pending_resets() == {}


def test_an_admins_list_decides_xid_154_over_the_recovery_action() -> None:
    inventory = discover(emulated("h100-80gb-mig-r570"))
    uuid = inventory.gpus[0].uuid
    reset = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    quiet = make_state(inventory, FakeClock(), extra_application_xids=frozenset({154}))
    quiet.apply(XidEvent(uuid, 154, recovery=reset))
    assert quiet.report().devices["gpu-0"].healthy and not quiet.pending_resets()
    none = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    strict = make_state(inventory, FakeClock(), extra_reset_xids=frozenset({154}))
    strict.apply(XidEvent(uuid, 154, recovery=none))
    assert PendingReset("gpu-0", 154) in strict.pending_resets()[uuid]


async def test_an_event_whose_gpu_lookup_fails_is_not_lost() -> None:
    # Asking the event's handle for its UUID can fail with an error other than
    # GPU_IS_LOST; the handle is still the one its events were registered on.
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    async with watching(nvml, state):
        seen = state.generation
        nvml.fail_after(0, pynvml.NVML_ERROR_UNKNOWN)
        nvml.inject_xid(3, 79)
        await next_change(state, seen)
        nvml.clear_failure()
    report = state.report()
    assert report.unhealthy() == ("gpu-3",)
    assert report.taints("gpu-3")[0].value == "79"


async def test_the_xid_of_a_gpu_lost_by_the_time_it_is_read_is_counted_and_applied() -> None:
    """A GPU that falls off the bus reports XID 79 and is lost by the time the watcher
    reads it: NVML answers GPU_IS_LOST for its UUID. The XID was dropped then (not
    logged, not in `gpudra_gpu_xid_errors_total`, no alert); it is the GPU's, through
    the handle its events were registered on."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    state = make_state(inventory, FakeClock())
    async with watching(nvml, state):
        nvml.lose_gpu(3, xid=79)
        await until(lambda: xids_seen(state, 3, 79) == 1, within_s=10)  # a hang guard
        await until(lambda: len(state.report().taints("gpu-3")) == 2, within_s=10)
    report = state.report()
    assert report.unhealthy() == ("gpu-3",)
    assert {(t.key, t.value) for t in report.taints("gpu-3")} == {
        ("gpu.nvidia.com/xid", "79"),
        ("gpu.nvidia.com/gpu-lost", None),
    }
    assert PendingReset("gpu-3", 79) in state.pending_resets()[inventory.gpus[3].uuid]


async def test_watcher_is_cancelled_promptly_while_waiting() -> None:
    nvml = emulated("l4")
    state = make_state(discover(nvml), FakeClock())
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=50)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            tg.cancel_scope.cancel()


# --- taints that wait for a GPU reset ------------------------------------------------------


@pytest.mark.parametrize("xid", [48, 79, 95, 119, 171, 172])
def test_an_xid_that_needs_a_reset_stays_until_the_gpu_is_reset(xid: int) -> None:
    """NVIDIA's XID catalogue has the GPU reset (79: the node rebooted) before reuse;
    however quiet the GPU stays, only a reset lifts the taint. 171 and 172 say whether
    an uncorrectable ECC error (48) was in DRAM or SRAM: the same error, the same wait,
    should one come without the 48."""
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[2].uuid
    assert state.apply(XidEvent(uuid, xid))
    clock.now += 10 * 365 * 86400
    assert not state.expire()
    health = state.report().devices["gpu-2"]
    assert not health.healthy
    assert health.message == (
        f"XID {xid} (critical error): needs a GPU reset; stays until the GPU is reset and "
        "the agent restarted"
    )
    assert state.pending_resets() == {uuid: (PendingReset("gpu-2", xid),)}
    assert not state.apply(GpuResetEvent(inventory.gpus[3].uuid))  # another GPU's reset
    assert state.apply(GpuResetEvent(uuid))
    assert state.report().devices["gpu-2"].healthy
    assert state.report().taints("gpu-2") == ()
    assert state.pending_resets() == {}


def test_a_double_bit_ecc_error_stays_until_the_gpu_is_reset(tmp_path: Path) -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    resets = GpuResets(tmp_path, boot_id_path=tmp_path / "boot_id")
    state = HealthState(
        inventory, HealthPolicy(recovery_after_s=60), clock=clock, wall_clock=wall, resets=resets
    )
    uuid = inventory.gpus[0].uuid
    state.apply(EccEvent(uuid))
    clock.now += 3600
    assert not state.expire()
    health = state.report().devices["gpu-0"]
    assert not health.healthy
    # The message (kubelet health stream) names the file that says the GPU was reset.
    assert health.message == (
        "uncorrectable (double-bit) ECC error: needs a GPU reset; after resetting the GPU, "
        f"create the file {tmp_path}/reset/{uuid} on the node"
    )
    assert state.pending_resets() == {uuid: (PendingReset("gpu-0"),)}
    assert state.apply(GpuResetEvent(uuid))
    assert state.report().devices["gpu-0"].healthy


def test_a_timed_xid_neither_replaces_nor_outlasts_one_that_needs_a_reset() -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[0].uuid
    state.apply(XidEvent(uuid, 74))  # heals by time
    assert state.apply(XidEvent(uuid, 95))  # needs a reset: takes over the taint
    assert not state.apply(XidEvent(uuid, 74))  # does not hand it back to the clock
    clock.now += 3600
    assert not state.expire()
    (taint,) = state.report().taints("gpu-0")
    assert taint.value == "95"


def test_a_lost_gpu_that_answers_again_was_reset() -> None:
    """GPU_IS_LOST and then answering again is a reset: the XID taint goes at once, the
    gpu-lost taint after the quiet time."""
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    clock = FakeClock()
    state = make_state(inventory, clock)
    uuid = inventory.gpus[4].uuid
    state.apply(XidEvent(uuid, 79))
    state.apply(GpuLostEvent(uuid))
    assert state.apply(GpuRecoveredEvent(uuid))
    assert [t.key for t in state.report().taints("gpu-4")] == ["gpu.nvidia.com/gpu-lost"]
    assert state.pending_resets() == {}
    clock.now += 60
    assert state.expire()
    assert state.report().devices["gpu-4"].healthy


async def test_a_lost_gpu_that_answers_with_an_error_was_not_reset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lost and answering again is evidence of a reset only when the GPU answers in
    full. One still off the bus may answer UNKNOWN instead of GPU_IS_LOST (nvidia-smi:
    "Unable to determine the device handle ... Unknown Error"): its XID 79 taint, its
    pending reset on disk and its gpu-lost taint stay until its calls and the
    registration of its events succeed."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    uuid = inventory.gpus[5].uuid
    (tmp_path / "boot_id").write_text("b1\n")
    resets = GpuResets(tmp_path / "state", boot_id_path=tmp_path / "boot_id")
    state = HealthState(
        inventory, HealthPolicy(recovery_after_s=600), wall_clock=wall, resets=resets
    )

    def taints() -> set[tuple[str, str | None]]:
        return {(t.key, t.value) for t in state.report().taints("gpu-5")}

    def pending_on_disk() -> bool:
        return bool(json.loads(resets.path.read_text())["gpus"].get(uuid))

    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=20, resets=resets)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        seen = state.generation
        nvml.inject_xid(5, 79)
        await next_change(state, seen)
        seen = state.generation
        nvml.lose_gpu(5)
        await next_change(state, seen)
        assert taints() == {("gpu.nvidia.com/xid", "79"), ("gpu.nvidia.com/gpu-lost", None)}

        nvml.fail_after(0, pynvml.NVML_ERROR_UNKNOWN)  # still lost, answering UNKNOWN
        with caplog.at_level(logging.WARNING, logger="gpudra.driver.health"):
            with anyio.move_on_after(2):
                while not any("not taken as reset" in r.message for r in caplog.records):
                    await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # more probes
        assert taints() == {("gpu.nvidia.com/xid", "79"), ("gpu.nvidia.com/gpu-lost", None)}
        assert state.lost_gpus == {uuid}
        assert pending_on_disk()
        [logged] = [r for r in caplog.records if "not taken as reset" in r.message]
        assert logged.__dict__["fields"]["uuid"] == uuid  # once, however many probes

        nvml.clear_failure()
        nvml.recover_gpu(5)  # reset: it answers in full
        with anyio.fail_after(10):
            while state.lost_gpus or pending_on_disk():
                await anyio.sleep(0.01)
        assert taints() == {("gpu.nvidia.com/gpu-lost", None)}  # goes after the quiet time
        tg.cancel_scope.cancel()


def test_which_xids_need_a_reset_follows_nvidia_and_the_admin() -> None:
    default = HealthPolicy()
    # NVIDIA's catalogue: reset (or reboot) for these, restart the application for those.
    assert {46, 48, 62, 64, 79, 95, 110, 119, 120, 140, 143} <= RESET_XIDS
    assert not RESET_XIDS & APPLICATION_XIDS
    assert not any(default.needs_reset(x) for x in (8, 13, 31, 43, 45, 68, 74, 94, 109))
    # 109 (context switch timeout): RESET_GPU in the catalogue, but any workload that
    # does not yield raises it, so by default it is informational, as upstream has it.
    assert default.is_application_xid(109) and not default.needs_reset(109)
    # 11 (corrupted push buffer): the catalogue restarts the application and checks it
    # or CUDA; a process writes its own push buffer, so one tenant of a shared GPU could
    # raise it at will. 8 (GPU stopped processing) is restarted there too but asks for
    # support: informational, yet no application's error (the alert fires for it).
    assert default.is_application_xid(11) and not default.is_application_xid(8)
    assert default.is_informational(8) and not default.is_informational(74)
    # The admin's lists win over the built-in ones, either way.
    mine = HealthPolicy(
        extra_application_xids=frozenset({46}), extra_reset_xids=frozenset({13, 74, 109})
    )
    assert mine.is_application_xid(46) and not mine.needs_reset(46)
    assert mine.needs_reset(109) and not mine.is_application_xid(109)
    assert mine.needs_reset(13) and not mine.is_application_xid(13)
    assert mine.needs_reset(74)
    with pytest.raises(ValueError, match=r"XIDs 31, 74 are listed both .*\(--reset-xids\)"):
        HealthPolicy(
            extra_application_xids=frozenset({31, 74}), extra_reset_xids=frozenset({31, 74})
        )


def test_an_application_xid_made_one_that_needs_a_reset_is_critical() -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    state = make_state(inventory, clock, extra_reset_xids=frozenset({13}))
    state.apply(XidEvent(inventory.gpus[0].uuid, 13))
    health = state.report().devices["gpu-0"]
    assert not health.healthy and health.message.startswith("XID 13 (critical error): needs")
    clock.now += 3600
    assert not state.expire()


# --- MIG instance events need privilege ----------------------------------------------------


def without_mig_monitor(inventory: Inventory, index: int) -> Inventory:
    """The inventory as discovery reads it where NVML refuses GPU `index` the aggregate
    memory only (NO_PERMISSION): its MIG devices are still known."""
    gap = FieldGap("memory", "nvmlDeviceGetMemoryInfo", MIG_MONITOR_PRIVILEGE, "from a profile")
    gpus = list(inventory.gpus)
    gpus[index] = replace(gpus[index], gaps=(gap,))
    return replace(inventory, gpus=tuple(gpus))


def test_mig_devices_are_unmonitored_where_nvml_withholds_their_events() -> None:
    """nvml.h, nvmlEventSetWait_v2: without the privilege only whole-GPU events come, so
    the MIG devices of a GPU discovery found short of it are marked unmonitored."""
    privileged = discover(emulated("a100-40gb-mig-mixed"))
    clock = FakeClock()
    state = make_state(without_mig_monitor(privileged, 0), clock)
    gpu0, gpu1 = privileged.gpus
    report = state.report()
    mig_names = set(gpu0.device_names()) - {gpu0.device.name}
    for name in mig_names:
        (taint,) = report.taints(name)
        assert (taint.key, taint.value, taint.effect) == (
            "gpu.nvidia.com/unmonitored",
            None,
            TaintEffect.NONE,
        )
        assert report.devices[name].healthy  # unknown is not bad
        assert MIG_MONITOR_PRIVILEGE in report.devices[name].message
        assert "the chart runs the agent privileged" in report.devices[name].message
    assert report.taints(gpu0.device.name) == ()
    assert all(report.taints(n) == () for n in gpu1.device_names())
    clock.now += 3600
    assert not state.expire()  # stays while the privilege is missing
    # A whole-GPU XID is still seen and shown beside it.
    state.apply(XidEvent(gpu0.uuid, 74))
    assert "XID 74" in state.report().devices[min(mig_names)].message
    # Granted (the next discovery has no gap): the mark goes after the quiet time.
    state.update_inventory(privileged)
    clock.now += 60
    assert state.expire()
    assert all(state.report().taints(n) == () for n in mig_names)


@pytest.mark.anyio
async def test_with_health_checks_off_no_mig_device_is_marked_unmonitored() -> None:
    """The agent's health state with the checks off: no watcher would hear any device,
    so singling out the MIG devices of a GPU short of the privilege would be a health
    taint where the admin turned them off."""
    nvml = emulated("a100-40gb-mig-mixed")
    agent = NodeAgent(AgentConfig(node_name="n1", health_events=False), cast(Kube, object()), nvml)
    await agent.scan()
    assert agent.health is not None and agent.inventory is not None
    agent.health.update_inventory(without_mig_monitor(agent.inventory, 0))
    assert all(d.taints == () for d in agent.health.report().devices.values())
    gpu0 = agent.inventory.gpus[0]
    mig = min(set(gpu0.device_names()) - {gpu0.device.name})
    checked = make_state(without_mig_monitor(agent.inventory, 0), FakeClock())
    assert checked.report().taints(mig) != ()  # what the checks would have marked


async def test_watcher_without_privilege_sees_whole_gpu_xids_only() -> None:
    nvml = emulated("a100-40gb-mig-mixed")
    inventory = discover(nvml)
    mig = inventory.find("gpu-1-mig-4g20gb-5-0")
    assert mig is not None and mig.gpu_instance_id is not None
    assert mig.compute_instance_id is not None
    state = make_state(inventory, FakeClock())
    async with watching(nvml, state):
        nvml.set_privileged(False)  # no MIG monitor capability
        seen = state.generation
        nvml.inject_xid(
            1, 74, gpu_instance_id=mig.gpu_instance_id, compute_instance_id=mig.compute_instance_id
        )
        nvml.inject_xid(0, 74)  # the whole GPU: still reported
        await next_change(state, seen)
        assert set(state.report().unhealthy()) == set(inventory.gpus[0].device_names())


def test_the_install_guide_lists_the_xids_that_need_a_reset() -> None:
    """docs/install.md names the built-in lists; they must not drift from the code."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
    (row,) = [line for line in guide.splitlines() if line.startswith("| XIDs 46, 48")]
    listed = {int(n) for n in re.findall(r"\b(\d+)\b", row.split("|")[1])}
    assert listed == RESET_XIDS
    assert "Application errors (XIDs 11, 13, 25, 31, 43, 45,\n68, 69, 80, 109 and" in guide
    assert frozenset({11, 13, 25, 31, 43, 45, 68, 69, 80, 109}) == APPLICATION_XIDS
