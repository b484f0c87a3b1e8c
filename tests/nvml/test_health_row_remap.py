"""A GPU whose row remapper says a remapping failed stays out of service.

NVIDIA's memory error guide defines that flag (`nvmlDeviceGetRemappedRows`, "failure
occurred") by its RMA policy thresholds for row remapping. The flag stays with the GPU;
the taint of XID 64 (a remapping that could not be recorded) waits only for the next
reset, so without reading the flag a reboot would put the GPU back in service.
Discovery reads it, and the health state taints every device of the GPU for as long as
a reading says so.
"""

from __future__ import annotations

from dataclasses import replace

import pynvml
import pytest
from gpudra.driver.devices import Inventory, discover
from gpudra.driver.health import HealthPolicy, HealthState, TaintEffect

from tests.nvml.emulated import emulated
from tests.nvml.test_health import FakeClock

KEY = "gpu.nvidia.com/row-remap"
MESSAGE = "row remapping failed (NVIDIA's RMA threshold for the GPU's memory): needs service"


def with_reading(
    inventory: Inventory, index: int, says: bool | None, *, flag: str = "row_remap_failed"
) -> Inventory:
    """The same inventory, GPU `index`'s health flag `flag` (a `Gpu` field) read as
    `says` (None: NVML gave no reading)."""
    gpus = list(inventory.gpus)
    gpus[index] = replace(gpus[index], **{flag: says})
    return replace(inventory, gpus=tuple(gpus))


def test_the_emulator_answers_the_row_remapper_as_nvml_documents() -> None:
    """Ampere and newer; not for a MIG device, nor on a MIG-enabled GPU with instances
    (nvml.h: "On MIG-enabled GPUs with active instances, querying the number of
    remapped rows is not supported")."""
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 0)
    nvml.fail_row_remapping(2)
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 1)
    assert nvml.nvmlDeviceGetRemappedRows(nvml.nvmlDeviceGetHandleByIndex(1))[3] == 0
    nvml.fail_row_remapping(2, failed=False)
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 0)

    turing = emulated("t4")
    turing.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        turing.nvmlDeviceGetRemappedRows(turing.nvmlDeviceGetHandleByIndex(0))

    mig = emulated("a100-40gb-mig-mixed")
    mig.nvmlInit()
    parent = mig.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        mig.nvmlDeviceGetRemappedRows(parent)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        mig.nvmlDeviceGetRemappedRows(mig.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0))


def test_discovery_reads_whether_a_remapping_failed() -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.fail_row_remapping(3)
    gpus = discover(nvml).gpus
    assert [g.row_remap_failed for g in gpus] == [i == 3 for i in range(8)]
    assert [g.row_remap_failed for g in discover(emulated("t4")).gpus] == [None]
    mixed = discover(emulated("a100-40gb-mig-mixed")).gpus
    assert [(g.mig_enabled, g.row_remap_failed) for g in mixed] == [(True, None), (True, None)]


def test_a_reading_nvml_refuses_fails_no_discovery(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A health flag, not a description: NVML refusing it (NO_PERMISSION, as a VM's
    driver may) leaves it unread and the GPUs published; a lost GPU is still left out."""
    nvml = emulated("h100-80gb-hbm3-x8")

    def refused(device: object) -> tuple[int, int, int, int]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(nvml, "nvmlDeviceGetRemappedRows", refused)
    inventory = discover(nvml)
    assert len(inventory.gpus) == 8
    assert all(g.row_remap_failed is None for g in inventory.gpus)
    assert "NVML refused a health reading" in caplog.text

    calls = iter(range(8))  # one reading per GPU, by index

    def lost_at_5(device: object) -> tuple[int, int, int, int]:
        if next(calls) == 5:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return (0, 0, 0, 0)

    monkeypatch.setattr(nvml, "nvmlDeviceGetRemappedRows", lost_at_5)
    inventory = discover(nvml)
    assert [g.index for g in inventory.gpus] == [0, 1, 2, 3, 4, 6, 7]
    assert [lost.index for lost in inventory.lost] == [5]


def test_a_failed_row_remapping_keeps_every_device_out_until_a_reading_clears_it() -> None:
    """Read at discovery, so an agent started after a reboot (which lifted XID 64's
    taint) takes the GPU out again; no quiet time lifts it, and it is neither kept on
    disk nor waits for a reset: the next reading decides."""
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.fail_row_remapping(3)
    clock = FakeClock()
    state = HealthState(discover(nvml), HealthPolicy(recovery_after_s=60), clock=clock)
    report = state.report()
    assert report.unhealthy() == ("gpu-3",)
    (taint,) = report.taints("gpu-3")
    assert (taint.key, taint.value, taint.effect) == (KEY, "failed", TaintEffect.NO_SCHEDULE)
    assert report.devices["gpu-3"].message == MESSAGE
    clock.now += 3600
    assert not state.expire()
    assert state.timed_taints() == {} and state.pending_resets() == {}

    nvml.fail_row_remapping(3, failed=False)  # the board was serviced
    state.update_inventory(discover(nvml))
    report = state.report()
    assert report.unhealthy() == () and report.taints("gpu-3") == ()


def test_a_gpu_nvml_gives_no_reading_for_keeps_the_last_one() -> None:
    """A MIG-enabled GPU with instances gives none: what the last reading said holds,
    for the MIG devices made since too."""
    inventory = discover(emulated("a100-40gb-mig-mixed"))
    state = HealthState(with_reading(inventory, 1, True), HealthPolicy(), clock=FakeClock())
    gpu1 = inventory.gpus[1]
    assert set(state.report().unhealthy()) == set(gpu1.device_names())
    state.update_inventory(with_reading(inventory, 1, None))
    assert set(state.report().unhealthy()) == set(gpu1.device_names())
    state.update_inventory(with_reading(inventory, 1, False))
    assert state.report().unhealthy() == ()
    state.update_inventory(with_reading(inventory, 1, None))  # nothing read, nothing said
    assert state.report().unhealthy() == ()


def test_the_taint_has_the_critical_effect_and_none_with_the_checks_off() -> None:
    inventory = with_reading(discover(emulated("l4")), 0, True)
    evicting = HealthPolicy(critical_effect=TaintEffect.NO_EXECUTE)
    (taint,) = HealthState(inventory, evicting, clock=FakeClock()).report().taints("gpu-0")
    assert taint.effect is TaintEffect.NO_EXECUTE
    unwatched = HealthState(inventory, HealthPolicy(), clock=FakeClock(), watched=False)
    assert unwatched.report().taints("gpu-0") == ()
    assert unwatched.report().devices["gpu-0"].healthy
