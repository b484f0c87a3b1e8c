"""Taints that wait for a GPU reset, of a GPU still lost when the agent starts: held, not
dropped, kept across a further restart, raised when a rescan finds the GPU, and dropped by
the admin's reset mark."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gpudra.driver.devices import discover
from gpudra.driver.gpuresets import GpuResets, PendingReset
from gpudra.driver.health import GpuResetEvent, HealthPolicy, HealthState, TaintEffect
from gpudra.driver.nvml.emulator import NvmlEmulator

from tests.nvml.emulated import emulated
from tests.nvml.test_gpu_resets import saved, until, watching
from tests.nvml.test_health import FakeClock, wall
from tests.nvml.test_health_restart import (
    LOST_KEY,
    RECOVERY_S,
    XID_KEY,
    boot_id,
    keep,
    lost_at,
    restarted,
    taints,
)

pytestmark = pytest.mark.anyio

ECC_KEY = "gpu.nvidia.com/ecc"


@pytest.fixture
def clock() -> FakeClock:
    """The monotonic clock: one for every run of the agent, as the kernel's is."""
    return FakeClock()


@pytest.fixture
def nvml() -> NvmlEmulator:
    """Eight H100s, gpu-0 lost: discovery leaves it out."""
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.lose_gpu(0)
    return nvml


def resets_of(tmp_path: Path) -> GpuResets:
    """The state folder's pending-reset file, as the agent that `restarted` starts reads it."""
    return GpuResets(tmp_path / "state", boot_id_path=boot_id(tmp_path))


def pending(state: HealthState) -> dict[str, set[PendingReset]]:
    """`pending_resets`, in no order (the file keeps its entries sorted)."""
    return {uuid: set(items) for uuid, items in state.pending_resets().items()}


def lost_uuid() -> str:
    return discover(emulated("h100-80gb-hbm3-x8")).gpus[0].uuid


async def test_a_gpu_still_lost_at_start_keeps_its_reset_taints_until_a_rescan_finds_it(
    tmp_path: Path, nvml: NvmlEmulator, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, its XID 79 was logged as "the device is gone" and dropped: the GPU came
    back in service once it answered, never reset. Now it is held (and kept, for a
    further restart) and raised by the rescan that finds the GPU, with the gpu-lost
    taint, which is handled as before: quiet from that rescan."""
    uuid = lost_uuid()
    resets_of(tmp_path).save({uuid: (PendingReset("gpu-0", 79), PendingReset("gpu-0"))})
    keep(tmp_path, {uuid: (lost_at(clock.now),)})
    clock.now += 10 * RECOVERY_S
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.health"):
        agent = await restarted(nvml, tmp_path, clock)
    health = agent.health
    assert health is not None
    assert "gpu-0" not in health.report().devices
    assert pending(health) == {uuid: {PendingReset("gpu-0", 79), PendingReset("gpu-0")}}
    assert health.held_reset_gpus == {uuid}
    assert health.timed_taints() == {uuid: (lost_at(1000.0),)}
    assert "the device is gone" not in caplog.text
    held = [r.__dict__["fields"] for r in caplog.records if "the taint is held" in r.message]
    assert held == [
        {"uuid": uuid, "device": "gpu-0", "taint": "ecc=double-bit", "held": True},
        {"uuid": uuid, "device": "gpu-0", "taint": "xid=79", "held": True},
    ]  # in the file's order

    nvml.recover_gpu(0)  # it answers again: no evidence of a reset
    clock.now += 30
    await agent.scan()
    assert taints(health, "gpu-0") == {
        (XID_KEY, "79", TaintEffect.NO_SCHEDULE),
        (ECC_KEY, "double-bit", TaintEffect.NO_SCHEDULE),
        (LOST_KEY, None, TaintEffect.NO_EXECUTE),
    }
    assert health.held_reset_gpus == frozenset()
    assert pending(health) == {uuid: {PendingReset("gpu-0", 79), PendingReset("gpu-0")}}
    clock.now += RECOVERY_S
    assert health.expire()  # the gpu-lost taint goes after its quiet time ...
    assert taints(health, "gpu-0") == {
        (XID_KEY, "79", TaintEffect.NO_SCHEDULE),
        (ECC_KEY, "double-bit", TaintEffect.NO_SCHEDULE),
    }
    clock.now += 3600
    assert not health.expire()  # ... those that wait for a reset stay
    assert not health.report().devices["gpu-0"].healthy


async def test_a_held_reset_taint_survives_a_further_restart(
    tmp_path: Path, nvml: NvmlEmulator, clock: FakeClock
) -> None:
    """The watcher writes the pending-reset file as soon as it starts: before, it wrote
    it without the lost GPU's taints, so a second restart had nothing to hold."""
    uuid = lost_uuid()
    resets = resets_of(tmp_path)
    resets.save({uuid: (PendingReset("gpu-0", 79),)})
    first = await restarted(nvml, tmp_path, clock)
    assert first.health is not None
    async with watching(nvml, first.health, resets):
        assert saved(resets)["gpus"] == {uuid: [{"device": "gpu-0", "taint": "xid=79"}]}

    again = await restarted(nvml, tmp_path, clock)  # still lost
    health = again.health
    assert health is not None
    assert health.held_reset_gpus == {uuid}
    nvml.recover_gpu(0)
    await again.scan()
    assert taints(health, "gpu-0") == {(XID_KEY, "79", TaintEffect.NO_SCHEDULE)}


async def test_the_admins_mark_drops_a_held_reset_taint(
    tmp_path: Path, nvml: NvmlEmulator, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A mark for a GPU out of the inventory with held taints is no stray mark: it is
    taken as for a GPU in the inventory (taints dropped, the file written, the mark
    removed), and the GPU comes back without them."""
    uuid = lost_uuid()
    resets = resets_of(tmp_path)
    resets.save({uuid: (PendingReset("gpu-0", 48),)})
    agent = await restarted(nvml, tmp_path, clock)
    health = agent.health
    assert health is not None
    assert health.held_reset_gpus == {uuid}
    marker = resets.marker(uuid)
    assert marker is not None
    marker.parent.mkdir()
    marker.touch()
    with caplog.at_level(logging.INFO, logger="gpudra.driver.health"):
        async with watching(nvml, health, resets):
            await until(lambda: not marker.exists())
    assert health.pending_resets() == {}
    assert health.held_reset_gpus == frozenset()
    assert saved(resets)["gpus"] == {}
    assert "names no GPU" not in caplog.text
    (lifted,) = [r.__dict__["fields"] for r in caplog.records if "GPU reset:" in r.message]
    assert lifted == {
        "uuid": uuid,
        "why": "an admin marked the GPU reset",
        "lifted": [],
        "heldDropped": ["gpu-0 gpu.nvidia.com/xid=48"],
    }

    nvml.recover_gpu(0)
    await agent.scan()
    assert health.report().devices["gpu-0"].healthy


def test_what_is_held_follows_the_policy_and_only_a_missing_gpu_is_held(
    nvml: NvmlEmulator, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a GPU the inventory lacks is held: a device no longer on a GPU that is here
    stays gone, and an XID the policy no longer holds for a reset is not held either.
    Held taints change no device (no new generation), and are held once however often
    they are restored; the reset of a GPU in the inventory leaves them alone."""
    inventory = discover(nvml)
    uuid, present = lost_uuid(), inventory.gpus[0].uuid
    policy = HealthPolicy(recovery_after_s=RECOVERY_S, extra_application_xids=frozenset({109}))
    state = HealthState(inventory, policy, clock=clock, wall_clock=wall)
    pending = {
        uuid: (PendingReset("gpu-0", 79), PendingReset("gpu-0", 109)),
        present: (PendingReset("gpu-9", 48),),
    }
    seen = state.generation
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.health"):
        assert not state.restore_resets(pending)
        assert not state.restore_resets({uuid: (PendingReset("gpu-0", 79),)})
    assert state.generation == seen
    assert state.pending_resets() == {uuid: (PendingReset("gpu-0", 79),)}
    assert "the XID needs no reset now" in caplog.text
    assert "the device is gone" in caplog.text
    assert not state.apply(GpuResetEvent(present))
    assert state.pending_resets() == {uuid: (PendingReset("gpu-0", 79),)}
    assert not state.apply(GpuResetEvent(uuid))  # no device changed ...
    assert state.pending_resets() == {}  # ... but nothing is held now
    assert state.held_reset_gpus == frozenset()
