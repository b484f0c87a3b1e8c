"""Taints that lift after quiet time outlive an agent restart within one boot: raised
again with their times, lifted when they would have been, forgotten after a reboot."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import discover
from gpudra.driver.gpuresets import GpuResets, PendingReset
from gpudra.driver.health import (
    GpuLostEvent,
    GpuRecoveredEvent,
    HealthPolicy,
    HealthState,
    TaintEffect,
    UnmonitoredEvent,
    XidEvent,
)
from gpudra.driver.nvml.emulator import NvmlEmulator
from gpudra.driver.timedtaints import TimedTaint, TimedTaints

from tests.nvml.emulated import emulated
from tests.nvml.test_gpu_resets import until, watching
from tests.nvml.test_health import FakeClock
from tests.nvml.test_health import wall as raised_at

pytestmark = pytest.mark.anyio

BOOT = "0c4b6a1e-6d2f-4c1a-8e3b-5f7a9d2c4e61"
RECOVERY_S = 60.0
XID_KEY = "gpu.nvidia.com/xid"
LOST_KEY = "gpu.nvidia.com/gpu-lost"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def boot_id(tmp_path: Path, value: str = BOOT) -> Path:
    path = tmp_path / f"boot_id-{value}"
    path.write_text(value + "\n")
    return path


def policy() -> HealthPolicy:
    return HealthPolicy(recovery_after_s=RECOVERY_S)


@pytest.fixture
def l4() -> NvmlEmulator:
    """A node with one L4 GPU, gpu-0."""
    return emulated("l4")


@pytest.fixture
def clock() -> FakeClock:
    """The monotonic clock: one for both runs of the agent, as the kernel's is."""
    return FakeClock()


def keep(tmp_path: Path, gpus: Mapping[str, tuple[TimedTaint, ...]], boot: str = BOOT) -> None:
    """What an earlier run of the agent, in boot `boot`, kept in the state folder."""
    TimedTaints(tmp_path / "state", boot_id_path=boot_id(tmp_path, boot)).save(gpus)


def xid_94(quiet_since: float) -> tuple[TimedTaint, ...]:
    """gpu-0's kept taint for XID 74 (NVLink error), quiet since `quiet_since`."""
    return (TimedTaint("gpu-0", 74, "NoSchedule", raised_at(), quiet_since),)


async def restarted(nvml: NvmlEmulator, tmp_path: Path, clock: FakeClock) -> NodeAgent:
    """The agent started again in this boot, on the same monotonic clock (the kernel's):
    its first scan raises what the state folder kept."""
    config = AgentConfig(
        node_name="n1",
        health=policy(),
        state_dir=tmp_path / "state",
        boot_id_path=boot_id(tmp_path),
    )
    agent = NodeAgent(config, cast(Kube, object()), nvml, clock=clock)
    await agent.scan()
    assert agent.health is not None
    return agent


async def restart(nvml: NvmlEmulator, tmp_path: Path, clock: FakeClock) -> HealthState:
    """`restarted`'s health state."""
    health = (await restarted(nvml, tmp_path, clock)).health
    assert health is not None
    return health


def on_disk(timed: TimedTaints) -> Mapping[str, object]:
    if not timed.path.exists():
        return {}
    gpus: Mapping[str, object] = json.loads(timed.path.read_text())["gpus"]
    return gpus


def first(timed: TimedTaints, uuid: str) -> dict[str, object]:
    entries = cast(list[dict[str, object]], on_disk(timed)[uuid])
    return entries[0]


def taints(state: HealthState, device: str) -> set[tuple[str, str | None, TaintEffect]]:
    return {(t.key, t.value, t.effect) for t in state.report().taints(device)}


async def test_a_restart_keeps_a_timed_taint_until_its_original_time(
    tmp_path: Path, clock: FakeClock
) -> None:
    """XID 74 (NVLink error) waits for quiet time, not a reset: before, an agent
    restart put the device back in service at once."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    uuid = inventory.gpus[3].uuid
    timed = TimedTaints(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    state = HealthState(inventory, policy(), clock=clock, wall_clock=raised_at)
    async with watching(nvml, state, timed=timed):
        nvml.inject_xid(3, 74)
        await until(lambda: uuid in on_disk(timed))
    assert on_disk(timed) == {
        uuid: [
            {
                "device": "gpu-3",
                "taint": "xid=74",
                "effect": "NoSchedule",
                "timeAdded": "2026-11-01T12:00:00+00:00",
                "quietSince": 1000.0,
            }
        ]
    }
    assert json.loads(timed.path.read_text())["bootId"] == BOOT

    clock.now += 40  # the agent was down for 40 s
    again = await restart(nvml, tmp_path, clock)
    (taint,) = again.report().taints("gpu-3")
    assert (taint.key, taint.value, taint.effect) == (XID_KEY, "74", TaintEffect.NO_SCHEDULE)
    assert taint.time_added == raised_at()  # the original time, not the restart's
    assert not again.report().devices["gpu-3"].healthy
    assert again.report().devices["gpu-2"].healthy
    assert again.xid_counts() == {}  # raised again, not seen again
    clock.now += RECOVERY_S - 40 - 1
    assert not again.expire()
    clock.now += 1  # 60 s after the XID, as without the restart
    assert again.expire()
    assert again.report().devices["gpu-3"].healthy


async def test_a_repeated_error_moves_the_kept_quiet_time(
    tmp_path: Path, l4: NvmlEmulator, clock: FakeClock
) -> None:
    uuid = discover(l4).gpus[0].uuid
    timed = TimedTaints(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    state = HealthState(discover(l4), policy(), clock=clock, wall_clock=raised_at)
    async with watching(l4, state, timed=timed):
        l4.inject_xid(0, 74)
        await until(lambda: uuid in on_disk(timed))
        clock.now += 30
        l4.inject_xid(0, 74)  # same taint: no new generation, but a later quiet time
        await until(lambda: first(timed, uuid)["quietSince"] == 1030.0)
    clock.now += 40  # 70 s after the first XID, 40 s after the second
    again = await restart(l4, tmp_path, clock)
    assert taints(again, "gpu-0") == {(XID_KEY, "74", TaintEffect.NO_SCHEDULE)}


async def test_a_taint_whose_time_ran_out_while_the_agent_was_down_is_not_raised(
    tmp_path: Path, l4: NvmlEmulator, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    uuid = discover(l4).gpus[0].uuid
    keep(tmp_path, {uuid: xid_94(clock.now)})
    clock.now += RECOVERY_S
    with caplog.at_level(logging.INFO, logger="gpudra.driver.health"):
        again = await restart(l4, tmp_path, clock)
    assert again.report().taints("gpu-0") == ()
    assert again.report().devices["gpu-0"].healthy
    assert "quiet time ran out while the agent was down" in caplog.text


async def test_a_new_boot_drops_the_timed_taints(
    tmp_path: Path, l4: NvmlEmulator, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    uuid = discover(l4).gpus[0].uuid
    keep(tmp_path, {uuid: xid_94(clock.now)}, boot="the-boot-before")
    with caplog.at_level(logging.INFO, logger="gpudra.driver.gpuresets"):
        again = await restart(l4, tmp_path, clock)
    assert again.report().taints("gpu-0") == ()
    assert "the node rebooted since the file of health taints that lift" in caplog.text


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"\x00\xff not json", "not JSON"),
        (b'["a list"]', "must hold a JSON object"),
        (b'{"version": 9, "gpus": {}}', "newer gpudra release"),
        (b'{"version": 1, "gpus": {"GPU-1": [{"device": "gpu-0", "taint": "ecc"}]}}', "taint"),
        (
            b'{"version": 1, "gpus": {"GPU-1": [{"device": "gpu-0", "taint": "xid=74", '
            b'"effect": "NoSchedule", "timeAdded": "yesterday", "quietSince": 1}]}}',
            "gpus.GPU-1[0].timeAdded",
        ),
        (
            b'{"version": 1, "gpus": {"GPU-1": [{"device": "gpu-0", "taint": "xid=74", '
            b'"effect": "NoSchedule", "timeAdded": "2026-11-01T12:00:00+00:00", '
            b'"quietSince": "soon"}]}}',
            "gpus.GPU-1[0].quietSince",
        ),
        (
            b'{"version": 1, "gpus": {"GPU-1": [{"device": "gpu-0", "taint": "gpu-lost", '
            b'"effect": "NoExecute", "timeAdded": "2026-11-01T12:00:00+00:00", '
            b'"quietSince": 1, "lost": "yes"}]}}',
            "gpus.GPU-1[0].lost 'yes' is neither true nor false",
        ),
        (
            b'{"version": 1, "gpus": {"GPU-1": [{"device": "gpu-0", "taint": "xid=74", '
            b'"effect": "NoSchedule", "timeAdded": "2026-11-01T12:00:00+00:00", '
            b'"quietSince": 1, "lost": true}]}}',
            "gpus.GPU-1[0].lost is true for taint 'xid=74': only gpu-lost can be",
        ),
    ],
)
async def test_a_damaged_file_is_named_and_the_agent_starts_without_it(
    tmp_path: Path,
    l4: NvmlEmulator,
    clock: FakeClock,
    content: bytes,
    error: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    timed = TimedTaints(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    timed.path.parent.mkdir()
    timed.path.write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="gpudra.driver.gpuresets"):
        again = await restart(l4, tmp_path, clock)
    assert again.report().unhealthy() == ()
    (record,) = caplog.records
    fields = record.__dict__["fields"]
    assert fields["path"] == str(timed.path)
    assert error in fields["error"]
    assert "health taints that lift after quiet time is malformed" in record.getMessage()
    assert "remove the file" in record.getMessage()


async def test_what_cannot_be_raised_again_is_named_and_the_rest_is(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A device that is gone, or an effect this release does not know, is skipped alone."""
    nvml = emulated("h100-80gb-hbm3-x8")
    uuid = discover(nvml).gpus[0].uuid
    keep(
        tmp_path,
        {
            uuid: (
                TimedTaint("gpu-9", 74, "NoSchedule", raised_at(), clock.now),
                TimedTaint("gpu-0", 74, "NoWhatever", raised_at(), clock.now),
            ),
            discover(nvml).gpus[1].uuid: (TimedTaint("gpu-1", 31, "None", raised_at(), clock.now),),
        },
    )
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.health"):
        again = await restart(nvml, tmp_path, clock)
    assert again.report().taints("gpu-0") == ()
    assert taints(again, "gpu-1") == {(XID_KEY, "31", TaintEffect.NONE)}  # informational too
    assert "the device is gone" in caplog.text
    assert "its effect is none of None, NoSchedule, NoExecute" in caplog.text


async def test_a_taint_that_waits_for_a_reset_is_not_replaced_by_a_timed_one(
    tmp_path: Path, l4: NvmlEmulator, clock: FakeClock
) -> None:
    uuid = discover(l4).gpus[0].uuid
    resets = GpuResets(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    resets.save({uuid: (PendingReset("gpu-0", 79),)})
    keep(tmp_path, {uuid: xid_94(clock.now)})
    again = await restart(l4, tmp_path, clock)
    assert taints(again, "gpu-0") == {(XID_KEY, "79", TaintEffect.NO_SCHEDULE)}
    clock.now += 3600
    assert not again.expire()  # it still waits for the reset
    assert again.timed_taints() == {}


def test_what_is_kept_is_what_waits_for_quiet_time(clock: FakeClock) -> None:
    """A lost GPU's taint is kept while the GPU is lost (marked so: its quiet time has
    not begun) and once it answers (its quiet time runs); taints that wait for a reset
    and `unmonitored` are not kept here."""
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    state = HealthState(inventory, policy(), clock=clock, wall_clock=raised_at)
    lost, reset, quiet, unwatched = (inventory.gpus[i].uuid for i in range(4))
    state.apply(GpuLostEvent(lost))
    state.apply(XidEvent(reset, 79))
    state.apply(XidEvent(quiet, 63))  # informational (NVIDIA's catalogue ignores it)
    state.apply(UnmonitoredEvent(unwatched, "no events"))
    assert state.timed_taints() == {
        lost: (lost_at(1000.0),),
        quiet: (TimedTaint("gpu-2", 63, "None", raised_at(), 1000.0),),
    }
    clock.now += 5
    state.apply(GpuRecoveredEvent(lost))
    assert state.timed_taints()[lost] == (answering_since(1005.0),)


async def test_a_lost_gpu_that_answers_again_keeps_its_quiet_time_across_a_restart(
    tmp_path: Path, l4: NvmlEmulator, clock: FakeClock
) -> None:
    uuid = discover(l4).gpus[0].uuid
    keep(tmp_path, {uuid: (answering_since(clock.now),)})
    clock.now += 10
    again = await restart(l4, tmp_path, clock)
    assert taints(again, "gpu-0") == {("gpu.nvidia.com/gpu-lost", None, TaintEffect.NO_EXECUTE)}
    assert "answers again" in again.report().devices["gpu-0"].message
    clock.now += RECOVERY_S - 10
    assert again.expire()


def lost_at(quiet_since: float) -> TimedTaint:
    """gpu-0's kept gpu-lost taint, written while the GPU was still lost (found lost at
    `quiet_since`)."""
    return TimedTaint("gpu-0", None, "NoExecute", raised_at(), quiet_since, lost=True)


def answering_since(quiet_since: float) -> TimedTaint:
    """gpu-0's kept gpu-lost taint once the GPU answers again, quiet since
    `quiet_since`."""
    return TimedTaint("gpu-0", None, "NoExecute", raised_at(), quiet_since)


def assert_lifted_after_its_quiet_time(state: HealthState, clock: FakeClock) -> None:
    """gpu-0's gpu-lost taint, quiet since `clock.now`, holds until `RECOVERY_S` later,
    not a second less, and is lifted then, the GPU healthy again."""
    clock.now += RECOVERY_S - 1
    assert not state.expire()
    clock.now += 1
    assert state.expire()
    assert state.report().devices["gpu-0"].healthy


async def test_a_gpu_lost_when_the_agent_stopped_waits_its_quiet_time_once_it_answers(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A GPU lost when the agent stopped that answers at the next start (it came back,
    or was reset, while the agent was down) was published healthy at once: a flapping
    GPU got pods right after a restart, where without one it would have waited
    `recovery_after_s`. Its taint is kept while it is lost, and its quiet time counts
    from the restart, the latest time it may still have been lost."""
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    lost, other = inventory.gpus[0].uuid, inventory.gpus[3].uuid
    timed = TimedTaints(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    state = HealthState(inventory, policy(), clock=clock, wall_clock=raised_at)
    async with watching(nvml, state, timed=timed):
        nvml.lose_gpu(0)
        await until(lambda: lost in state.lost_gpus)
        nvml.inject_xid(3, 74)  # each write holds every taint: once this is on disk, so is the loss
        await until(lambda: other in on_disk(timed))
    assert on_disk(timed)[lost] == [
        {
            "device": "gpu-0",
            "taint": "gpu-lost",
            "effect": "NoExecute",
            "timeAdded": "2026-11-01T12:00:00+00:00",
            "quietSince": 1000.0,
            "lost": True,
        }
    ]

    nvml.recover_gpu(0)  # it answers again while the agent is down
    clock.now += 10 * RECOVERY_S  # long past `recovery_after_s` since it was found lost
    again = await restart(nvml, tmp_path, clock)
    assert taints(again, "gpu-0") == {(LOST_KEY, None, TaintEffect.NO_EXECUTE)}
    device = again.report().devices["gpu-0"]
    assert not device.healthy
    assert "answers again" in device.message
    assert again.report().taints("gpu-0")[0].time_added == raised_at()
    assert again.report().devices["gpu-3"].healthy  # XID 74's quiet time ran out meanwhile
    # Kept on as a GPU that answers again, quiet since the restart.
    assert again.timed_taints() == {lost: (answering_since(clock.now),)}
    assert_lifted_after_its_quiet_time(again, clock)


async def test_a_gpu_still_lost_at_start_waits_its_quiet_time_once_a_rescan_finds_it(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A GPU still lost when the agent starts is left out of the pool, as before; its
    kept taint is held (and kept for a further restart) and raised when the rescan
    finds the GPU answering, quiet from then, as a running agent counts."""
    nvml = emulated("h100-80gb-hbm3-x8")
    uuid = discover(nvml).gpus[0].uuid
    keep(tmp_path, {uuid: (lost_at(clock.now),)})
    nvml.lose_gpu(0)
    clock.now += 10 * RECOVERY_S
    agent = await restarted(nvml, tmp_path, clock)
    health = agent.health
    assert health is not None
    assert "gpu-0" not in health.report().devices
    assert health.timed_taints() == {uuid: (lost_at(1000.0),)}

    nvml.recover_gpu(0)
    clock.now += 30
    await agent.scan()  # the periodic rescan takes it back
    assert taints(health, "gpu-0") == {(LOST_KEY, None, TaintEffect.NO_EXECUTE)}
    assert health.timed_taints() == {uuid: (answering_since(clock.now),)}
    assert_lifted_after_its_quiet_time(health, clock)


async def test_a_gpu_reset_while_the_agent_was_down_lifts_what_waited_for_the_reset_by_the_mark(
    tmp_path: Path, l4: NvmlEmulator, clock: FakeClock
) -> None:
    """A GPU lost when the agent stopped that answers at start is not taken as reset, as
    before: its XID 79 waits for the admin's mark, made while the agent was down, which
    lifts it and not the gpu-lost taint, which waits its quiet time."""
    uuid = discover(l4).gpus[0].uuid
    resets = GpuResets(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    resets.save({uuid: (PendingReset("gpu-0", 79),)})
    keep(tmp_path, {uuid: (lost_at(clock.now),)})
    clock.now += 10
    again = await restart(l4, tmp_path, clock)
    assert taints(again, "gpu-0") == {
        (XID_KEY, "79", TaintEffect.NO_SCHEDULE),
        (LOST_KEY, None, TaintEffect.NO_EXECUTE),
    }
    marker = resets.marker(uuid)
    assert marker is not None
    marker.parent.mkdir()
    marker.touch()
    async with watching(l4, again, resets):
        await until(lambda: not marker.exists())
    assert taints(again, "gpu-0") == {(LOST_KEY, None, TaintEffect.NO_EXECUTE)}
    assert_lifted_after_its_quiet_time(again, clock)


def test_the_file_reads_across_the_release_that_keeps_lost_gpus(tmp_path: Path) -> None:
    """Upgrade: the previous release's file, which has no `lost`, reads as before.
    Downgrade: a lost GPU's entry keeps version 1 and every field the previous release
    reads, adding only `lost`, which that release does not look at: read without it,
    it is a lost GPU that answers again, quiet since it was found lost."""
    store = TimedTaints(tmp_path, boot_id_path=boot_id(tmp_path))
    previous = {
        "device": "gpu-0",
        "taint": "gpu-lost",
        "effect": "NoExecute",
        "timeAdded": "2026-11-01T12:00:00+00:00",
        "quietSince": 1000.0,
    }
    store.path.write_text(json.dumps({"version": 1, "bootId": BOOT, "gpus": {"GPU-1": [previous]}}))
    answers = answering_since(1000.0)
    assert store.load() == {"GPU-1": (answers,)}

    store.save({"GPU-1": (lost_at(1000.0),)})
    doc = json.loads(store.path.read_text())
    assert doc["version"] == 1
    assert doc["gpus"]["GPU-1"] == [{**previous, "lost": True}]
    assert store.load() == {"GPU-1": (lost_at(1000.0),)}
    del doc["gpus"]["GPU-1"][0]["lost"]  # what the previous release reads of it
    store.path.write_text(json.dumps(doc))
    assert store.load() == {"GPU-1": (answers,)}
