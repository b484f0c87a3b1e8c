"""XIDs NVIDIA's XID catalogue has ignored or answers by restarting the application
("Resolution Bucket (Immediate Action)": IGNORE, RESTART_APP) are informational: effect
None, the device stays in service."""

from __future__ import annotations

import pytest
from gpudra.driver.devices import discover
from gpudra.driver.health import (
    APPLICATION_XIDS,
    IGNORED_XIDS,
    RESET_XIDS,
    RESTARTED_XIDS,
    HealthPolicy,
    HealthState,
    TaintEffect,
    XidEvent,
)

from tests.nvml.emulated import emulated
from tests.nvml.test_health import FakeClock

# The catalogue's rows (docs.nvidia.com/deploy/xid-errors, analyzing-xid-catalog) whose
# immediate action is IGNORE; 43 is one too, and an application XID already.
CATALOGUE_IGNORES = (
    *(14, 37, 38, 44, 63, 66, 67, 92, 93, 106),
    *(107, 108, 121, 137, 141, 152, 153, 157, 160, 161),
)
# Its rows whose immediate action is RESTART_APP, with their investigatory action.
CATALOGUE_RESTARTS = {
    8: "CONTACT_SUPPORT",
    **dict.fromkeys((11, 25, 32, 69, 80), "CHECK_APP/CUDA"),
    13: "WORKFLOW_XID_13",
    31: "WORKFLOW_XID_31",
    60: "INVESTIGATE_SW",
    94: "IGNORE (sympathetic)",
    **dict.fromkeys(
        (39, 40, 41, 68, 70, 71, 72, 75, 76, 77, 82, 83, 84, 85, 86), "CONTACT_SUPPORT"
    ),
    **dict.fromkeys((88, 89, *range(96, 106), *range(126, 136), 139), "CONTACT_SUPPORT"),
}


def informational_message(xid: int) -> str:
    """Raise `xid` on an H100; check that it only informs (effect None, the device in
    service, counted, lifted after the quiet time) and return the device's message."""
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    clock = FakeClock()
    state = HealthState(inventory, HealthPolicy(recovery_after_s=60), clock=clock)
    uuid = inventory.gpus[2].uuid
    assert state.apply(XidEvent(uuid, xid))
    (taint,) = state.report().taints("gpu-2")
    assert (taint.key, taint.value, taint.effect) == ("gpu.nvidia.com/xid", str(xid), "None")
    health = state.report().devices["gpu-2"]
    assert health.healthy and state.report().unhealthy() == ()
    assert state.xid_counts() == {(uuid, xid): 1}  # still counted for the metric
    clock.now += 60
    assert state.expire()
    return health.message


@pytest.mark.parametrize("xid", CATALOGUE_IGNORES)
def test_an_xid_the_catalogue_ignores_is_informational(xid: int) -> None:
    kind = "informational: NVIDIA's XID catalogue has it ignored"
    assert informational_message(xid) == f"XID {xid} ({kind})"


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
    # What the catalogue resets or decodes first stays out of service.
    assert default.treatment(74) == (TaintEffect.NO_SCHEDULE, False)
    assert default.treatment(64) == (TaintEffect.NO_SCHEDULE, True)


@pytest.mark.parametrize("xid", sorted(CATALOGUE_RESTARTS))
def test_an_xid_the_catalogue_answers_by_restarting_the_application_is_informational(
    xid: int,
) -> None:
    """The GPU stays in service: a tenant's workload raises these on a GPU others may
    share. Those whose investigation is not the application's own are no application
    errors: the message says what NVIDIA has done about them, and the alert fires."""
    kind = (
        "application error"
        if xid in APPLICATION_XIDS
        else "informational: NVIDIA's XID catalogue has the application restarted"
    )
    assert informational_message(xid) == f"XID {xid} ({kind})"


def test_the_restarted_xids_are_the_catalogues_less_the_application_errors() -> None:
    assert RESTARTED_XIDS | (APPLICATION_XIDS & set(CATALOGUE_RESTARTS)) == set(CATALOGUE_RESTARTS)
    assert not RESTARTED_XIDS & (APPLICATION_XIDS | IGNORED_XIDS | RESET_XIDS)
    # An application error is one whose investigation is the application's own (or
    # upstream's list: 68); 32 is checked there too, but the catalogue names the PCI
    # bus as its usual cause, so its alert stays.
    own = {
        x for x, then in CATALOGUE_RESTARTS.items() if then.startswith(("CHECK_APP", "WORKFLOW"))
    }
    assert own - {32} | {68} == APPLICATION_XIDS & set(CATALOGUE_RESTARTS)


def test_the_admin_can_hold_a_restarted_xid_for_a_reset() -> None:
    """94 (contained memory error): the catalogue recommends a reset when convenient;
    an admin who wants no new work on the GPU until then lists it."""
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    policy = HealthPolicy(extra_reset_xids=frozenset({94}))
    state = HealthState(inventory, policy, clock=FakeClock())
    state.apply(XidEvent(inventory.gpus[0].uuid, 94))
    health = state.report().devices["gpu-0"]
    assert not health.healthy and health.message.startswith("XID 94 (critical error): needs")
