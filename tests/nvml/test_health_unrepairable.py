"""A GPU NVML says has unrepairable memory stays out of service.

`nvmlDeviceGetUnrepairableMemoryFlag_v1` (R590 and later, Hopper and newer) says
"whether or not there is unrepairable memory" (NVML change log). NVIDIA publishes its
struct in two shapes: `nvml.h` declares the flag alone, nvidia-ml-py a version and then
the flag, and reads the second word. `gpudra.driver.nvml.unrepairable` reads the flag
the same way from either, where pynvml's wrapper would read a header-shaped answer as
"none" on every GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.driver.devices import Inventory, discover
from gpudra.driver.health import HealthPolicy, HealthState, TaintEffect
from gpudra.driver.nvml import NvmlEmulator
from gpudra.driver.nvml.unrepairable import (
    StatusWords,
    read_status_words,
    read_unrepairable_memory,
    unrepairable,
)

from tests.nvml.emulated import emulated
from tests.nvml.test_health import FakeClock
from tests.nvml.test_health_row_remap import with_reading

KEY = "gpu.nvidia.com/unrepairable-memory"
MESSAGE = "NVML says the GPU has unrepairable memory: needs service"
VERSION = 0x1000008  # nvidia-ml-py's nvmlUnrepairableMemory_v1: version 1, 8 bytes
R590 = "h100-80gb-mig-r590"  # 2x H100, MIG enabled with no instances


def with_unrepairable(inventory: Inventory, index: int, says: bool | None) -> Inventory:
    return with_reading(inventory, index, says, flag="unrepairable_memory")


def started(name: str) -> tuple[NvmlEmulator, Any]:
    nvml = emulated(name)
    nvml.nvmlInit()
    return nvml, nvml.nvmlDeviceGetHandleByIndex(1)


@pytest.mark.parametrize("versioned", [False, True], ids=["nvml.h", "nvidia-ml-py"])
def test_the_flag_reads_the_same_from_either_struct(versioned: bool) -> None:
    nvml, handle = started(R590)
    nvml.write_unrepairable_memory_versioned(versioned)
    assert pynvml.nvmlUnrepairableMemory_v1 == VERSION
    assert read_status_words(nvml, handle) == ((VERSION, 0) if versioned else (0, 0))
    assert read_unrepairable_memory(nvml, handle) is False
    nvml.flag_unrepairable_memory(1)
    assert read_status_words(nvml, handle) == ((VERSION, 1) if versioned else (1, 0))
    assert read_unrepairable_memory(nvml, handle) is True
    assert read_unrepairable_memory(nvml, nvml.nvmlDeviceGetHandleByIndex(0)) is False
    nvml.flag_unrepairable_memory(1, unrepairable=False)
    assert read_unrepairable_memory(nvml, handle) is False


def test_pynvml_s_struct_misses_a_flag_written_as_nvml_h_declares_it() -> None:
    """What reading the second word alone, as pynvml's wrapper does, would give."""
    nvml, handle = started(R590)
    nvml.flag_unrepairable_memory(1)
    status = pynvml.c_nvmlUnrepairableMemory_v1_t()
    entry = nvml.nvmlLib.nvmlDeviceGetUnrepairableMemoryFlag_v1
    assert entry(handle, ctypes.byref(status)) == pynvml.NVML_SUCCESS
    assert status.unrepairableMemory == 0  # the flag went over the version
    assert unrepairable((status.version, status.unrepairableMemory))


def test_the_two_words_decide_by_the_first() -> None:
    assert [unrepairable(w) for w in [(0, 0), (1, 0), (VERSION, 0), (VERSION, 1)]] == [
        False,
        True,
        False,
        True,
    ]


def test_nvml_answers_as_its_header_documents() -> None:
    """Hopper and newer, from R590 on: an older driver has no such symbol, an Ampere GPU
    answers NOT_SUPPORTED, and so does a MIG device; a versioned struct of another version
    is refused (ARGUMENT_VERSION_MISMATCH, nvml.h)."""
    older, handle = started("h100-80gb-mig-r580")
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        read_unrepairable_memory(older, handle)
    ampere, handle = started("a100-40gb-mig-r590")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        read_unrepairable_memory(ampere, handle)
    nvml, handle = started(R590)
    gi = nvml.nvmlDeviceCreateGpuInstance(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        read_unrepairable_memory(nvml, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    nvml.write_unrepairable_memory_versioned()
    words = StatusWords(VERSION + 1, 0)
    entry = nvml.nvmlLib.nvmlDeviceGetUnrepairableMemoryFlag_v1
    assert entry(handle, ctypes.byref(words)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        read_unrepairable_memory(nvml, handle)


# Two libraries exporting the entry point as NVIDIA declares it: nvml.h's struct (the
# flag alone) and nvidia-ml-py's (a version the call checks, then the flag). Read through
# ctypes exactly as on a node, where `nvmlLib` is pynvml's CDLL of libnvidia-ml.
_LIBRARY = """
typedef struct { unsigned int bUnrepairableMemory; } header_t;
typedef struct { unsigned int version; unsigned int bUnrepairableMemory; } versioned_t;
int nvmlDeviceGetUnrepairableMemoryFlag_v1(void *device, void *status) {
#ifdef VERSIONED
    versioned_t *s = status;
    if (s->version != 0x1000008u) return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    s->bUnrepairableMemory = FLAG;
#else
    ((header_t *)status)->bUnrepairableMemory = FLAG;
#endif
    return device ? 0 : 2; /* NVML_ERROR_INVALID_ARGUMENT for no device */
}
"""


@dataclass
class _CLibrary:
    nvmlLib: ctypes.CDLL


def _compiled(tmp_path: Path, *defines: str) -> _CLibrary:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a library exporting the entry point")
    source = tmp_path / "nvml.c"
    source.write_text(_LIBRARY)
    library = tmp_path / f"libnvml{'-'.join(defines)}.so"
    flags = [f"-D{d}" for d in defines]
    subprocess.run([compiler, "-shared", "-fPIC", *flags, "-o", library, source], check=True)
    return _CLibrary(ctypes.CDLL(str(library)))


@pytest.mark.parametrize("versioned", [False, True], ids=["nvml.h", "nvidia-ml-py"])
@pytest.mark.parametrize("flag", [0, 1])
def test_a_c_library_of_either_struct_is_read_through_ctypes(
    tmp_path: Path, versioned: bool, flag: int
) -> None:
    defines = [f"FLAG={flag}"] + (["VERSIONED"] if versioned else [])
    library = _compiled(tmp_path, *defines)
    device = ctypes.cast(ctypes.c_void_p(1), pynvml.c_nvmlDevice_t)  # a handle's type
    assert read_unrepairable_memory(library, device) is bool(flag)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        read_unrepairable_memory(library, pynvml.c_nvmlDevice_t())


def test_discovery_reads_the_flag_where_nvml_gives_it() -> None:
    nvml = emulated(R590)
    nvml.flag_unrepairable_memory(1)
    assert [g.unrepairable_memory for g in discover(nvml).gpus] == [False, True]
    assert [g.unrepairable_memory for g in discover(emulated("h100-80gb-mig-r580")).gpus] == [
        None,
        None,
    ]
    assert [g.unrepairable_memory for g in discover(emulated("a100-40gb-mig-r590")).gpus] == [
        None,
        None,
    ]


def test_a_reading_nvml_refuses_fails_no_discovery(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A health flag, not a description: NVML refusing it leaves it unread and the GPUs
    published; a lost GPU is still left out."""
    nvml = emulated(R590)
    answer = pynvml.NVML_ERROR_NO_PERMISSION

    def refusing(device: object, status: object) -> int:
        return answer

    monkeypatch.setattr(nvml, "_c_unrepairable_memory_flag", refusing)
    inventory = discover(nvml)
    assert [g.unrepairable_memory for g in inventory.gpus] == [None, None]
    assert "NVML refused a health reading" in caplog.text
    answer = pynvml.NVML_ERROR_GPU_IS_LOST
    inventory = discover(nvml)
    assert inventory.gpus == () and [lost.index for lost in inventory.lost] == [0, 1]


def test_unrepairable_memory_keeps_every_device_out_until_a_reading_clears_it() -> None:
    """Every device of the GPU, MIG placements too; no quiet time lifts it and nothing
    of it is kept on disk: the next reading decides, and one that gives none (a driver
    rolled back before R590) keeps the last."""
    nvml = emulated(R590)
    nvml.flag_unrepairable_memory(1)
    clock = FakeClock()
    inventory = discover(nvml)
    state = HealthState(inventory, HealthPolicy(recovery_after_s=60), clock=clock)
    report = state.report()
    gpu1 = inventory.gpus[1]
    assert len(gpu1.device_names()) > 1
    assert set(report.unhealthy()) == set(gpu1.device_names())
    (taint,) = report.taints("gpu-1")
    assert (taint.key, taint.value, taint.effect) == (KEY, None, TaintEffect.NO_SCHEDULE)
    assert report.devices["gpu-1"].message == MESSAGE
    clock.now += 3600
    assert not state.expire()
    assert state.timed_taints() == {} and state.pending_resets() == {}

    state.update_inventory(with_unrepairable(discover(nvml), 1, None))
    assert set(state.report().unhealthy()) == set(gpu1.device_names())
    nvml.flag_unrepairable_memory(1, unrepairable=False)  # the board was serviced
    state.update_inventory(discover(nvml))
    assert state.report().unhealthy() == ()


def test_both_flags_taint_side_by_side_and_lift_each_on_its_own() -> None:
    inventory = discover(emulated(R590))
    both = with_reading(with_unrepairable(inventory, 0, True), 0, True)
    state = HealthState(both, HealthPolicy(), clock=FakeClock())
    keys = sorted(t.key for t in state.report().taints("gpu-0"))
    assert keys == ["gpu.nvidia.com/row-remap", KEY]
    state.update_inventory(with_reading(with_unrepairable(inventory, 0, True), 0, False))
    assert [t.key for t in state.report().taints("gpu-0")] == [KEY]


def test_the_taint_has_the_critical_effect_and_none_with_the_checks_off() -> None:
    inventory = with_unrepairable(discover(emulated(R590)), 0, True)
    evicting = HealthPolicy(critical_effect=TaintEffect.NO_EXECUTE)
    (taint,) = HealthState(inventory, evicting, clock=FakeClock()).report().taints("gpu-0")
    assert taint.effect is TaintEffect.NO_EXECUTE
    unwatched = HealthState(inventory, HealthPolicy(), clock=FakeClock(), watched=False)
    assert unwatched.report().taints("gpu-0") == ()
