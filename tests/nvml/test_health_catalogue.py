"""XIDs NVIDIA's XID catalogue has ignored ("Resolution Bucket (Immediate Action)":
IGNORE) are informational: effect None, the device stays in service."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from gpudra.driver.devices import discover
from gpudra.driver.health import (
    APPLICATION_XIDS,
    IGNORED_XIDS,
    RESET_XIDS,
    HealthPolicy,
    HealthState,
    TaintEffect,
    XidEvent,
)

from tests.nvml.emulated import emulated

# The catalogue's rows (docs.nvidia.com/deploy/xid-errors, analyzing-xid-catalog) whose
# immediate action is IGNORE; 43 is one too, and an application XID already.
CATALOGUE_IGNORES = (
    *(14, 37, 38, 44, 63, 66, 67, 92, 93, 106),
    *(107, 108, 121, 137, 141, 152, 153, 157, 160, 161),
)


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("xid", CATALOGUE_IGNORES)
def test_an_xid_the_catalogue_ignores_is_informational(xid: int) -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    state = HealthState(inventory, HealthPolicy(recovery_after_s=60), clock=clock)
    uuid = inventory.gpus[0].uuid
    assert state.apply(XidEvent(uuid, xid))
    (taint,) = state.report().taints("gpu-0")
    assert (taint.key, taint.value, taint.effect) == ("gpu.nvidia.com/xid", str(xid), "None")
    health = state.report().devices["gpu-0"]
    assert health.healthy
    assert health.message == f"XID {xid} (informational: NVIDIA's XID catalogue has it ignored)"
    assert state.xid_counts() == {(uuid, xid): 1}  # still counted for the metric
    clock.now += 60
    assert state.expire()


def test_xid_63_a_row_remapping_recorded_keeps_the_device_in_service() -> None:
    """63: the GPU recorded a row remapping (memory repaired); IGNORE in both buckets.
    64, a remapping that failed, still waits for a reset."""
    inventory = discover(emulated("a100-40gb-mig-mixed"))
    state = HealthState(inventory, HealthPolicy(), clock=FakeClock())
    gpu0, gpu1 = inventory.gpus
    state.apply(XidEvent(gpu0.uuid, 63))
    state.apply(XidEvent(gpu1.uuid, 64))
    report = state.report()
    assert not any(n in report.unhealthy() for n in gpu0.device_names())
    assert set(report.unhealthy()) == set(gpu1.device_names())
    assert all(t.effect is TaintEffect.NO_SCHEDULE for t in report.taints(gpu1.device.name))


def test_the_admin_can_still_hold_an_ignored_xid_for_a_reset() -> None:
    inventory = discover(emulated("l4"))
    clock = FakeClock()
    policy = HealthPolicy(recovery_after_s=60, extra_reset_xids=frozenset({92}))
    state = HealthState(inventory, policy, clock=clock)
    state.apply(XidEvent(inventory.gpus[0].uuid, 92))
    health = state.report().devices["gpu-0"]
    assert not health.healthy and health.message.startswith("XID 92 (critical error): needs")
    clock.now += 3600
    assert not state.expire()


def test_the_ignored_xids_are_the_catalogues_and_apart_from_the_other_lists() -> None:
    assert frozenset(CATALOGUE_IGNORES) == IGNORED_XIDS
    assert not IGNORED_XIDS & RESET_XIDS
    assert not IGNORED_XIDS & APPLICATION_XIDS
    default = HealthPolicy()
    assert all(default.is_informational(x) and not default.needs_reset(x) for x in IGNORED_XIDS)
    assert not any(default.is_application_xid(x) for x in IGNORED_XIDS)
    # What the catalogue has restarted or reset stays as it was.
    assert default.treatment(94) == (TaintEffect.NO_SCHEDULE, False)
    assert default.treatment(64) == (TaintEffect.NO_SCHEDULE, True)
