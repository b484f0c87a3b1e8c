"""The emulator answers as real GPUs did, call by call.

`answers/*.json` hold what a real GPU's NVML answered to the calls the driver relies on
(`e2e/gpu_node_check.py`, run on a GPU node): every GPU-instance profile index, offered
or refused and with which error; a whole GPU's engine counts; GPM support; both memory
structures; the MIG device maximum; how many utilization samples its buffers keep, and
how far apart. Each names the recording of the same node in
`fixtures/`; replaying it through the emulator must answer the same, and discovery on
the replay must publish the devices the real node's discovery did (`published`). A
difference is the emulator being wrong about a real driver: fix the emulator, not the
answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.api.deviceclasses import DEFAULT_DRIVER
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.nvml.emulator import load_profile_file
from gpudra.driver.publish import pool_content

from e2e.gpu_node_check import ReadOnlyNvml, RefusedCall, nvml_answers, sample_buffer

HERE = Path(__file__).parent
ANSWERS = sorted((HERE / "answers").glob("*.json"))


def without_versions(value: Any) -> Any:
    """Structure versions echo what the caller passed (pynvml leaves some at 0)."""
    if isinstance(value, dict):
        return {k: without_versions(v) for k, v in value.items() if k != "version"}
    return value


def test_answers_are_there() -> None:
    assert ANSWERS, "tests/nvml/answers holds at least one real GPU's answers"


@pytest.mark.parametrize("path", ANSWERS, ids=lambda p: p.stem)
def test_the_emulator_answers_as_the_real_gpu(path: Path) -> None:
    document = json.loads(path.read_text(encoding="utf-8"))
    recording = HERE / "fixtures" / document["recording"]
    expected: dict[str, Any] = document["answers"]
    got = without_versions(nvml_answers(ReadOnlyNvml(load_nvml(f"emulated:{recording}"))))
    assert {key: got[key] for key in expected} == expected


@pytest.mark.parametrize("path", ANSWERS, ids=lambda p: p.stem)
def test_the_emulators_sample_buffers_hold_what_the_real_gpus_did(path: Path) -> None:
    """`sampleBuffer`: how many utilization samples the real GPU's NVML kept and how far
    apart. The sampler's reads between passes (`TOP_UP_EVERY_S`) must come within what
    the buffer spans, so the emulated one must not span more than a real one."""
    document = json.loads(path.read_text(encoding="utf-8"))
    now = [0.0]
    emulator = NvmlEmulator(
        load_profile_file(HERE / "fixtures" / document["recording"]), clock=lambda: now[0]
    )
    now[0] = 3600.0  # up for an hour, as the real GPU was
    got = sample_buffer(ReadOnlyNvml(emulator))
    shape = {kind: {"count": b["count"], "gapUs": b["gapUs"]["median"]} for kind, b in got.items()}
    assert shape == document["sampleBuffer"]


@pytest.mark.parametrize("path", ANSWERS, ids=lambda p: p.stem)
def test_discovery_on_the_replay_publishes_what_the_real_node_did(path: Path) -> None:
    """`published` is what discovery on the real node made of its GPUs, per strategy."""
    document = json.loads(path.read_text(encoding="utf-8"))
    inventory = discover(load_nvml(f"emulated:{HERE / 'fixtures' / document['recording']}"))
    for strategy in MigStrategy:
        content = pool_content(inventory, strategy, driver=DEFAULT_DRIVER)
        published = document["published"][strategy.value]
        assert content.devices == published["devices"], strategy
        assert content.counter_sets == published["counterSets"], strategy


def test_a_whole_gpu_has_no_engine_counts() -> None:
    """nvml.h: engine counts are for MIG device handles; a real H200 on R580 answers a
    whole GPU's handle NOT_SUPPORTED, on every emulated product alike."""
    nvml = load_nvml("emulated:h100-80gb-hbm3-x8")
    nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError) as raised:
        nvml.nvmlDeviceGetAttributes(nvml.nvmlDeviceGetHandleByIndex(0))
    assert raised.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_the_check_refuses_calls_that_change_the_gpu() -> None:
    emulator = load_nvml("emulated:h100-80gb-mig-r580")
    assert isinstance(emulator, NvmlEmulator)
    guarded = ReadOnlyNvml(emulator)
    guarded.nvmlInit()
    handle = guarded.nvmlDeviceGetHandleByIndex(0)
    before = emulator.nvmlDeviceGetMigMode(handle)
    for call, args in (
        ("nvmlDeviceSetMigMode", (handle, pynvml.NVML_DEVICE_MIG_DISABLE)),
        ("nvmlDeviceCreateGpuInstance", (handle, 19)),
        ("nvmlDeviceSetComputeMode", (handle, 0)),
    ):
        with pytest.raises(RefusedCall):
            getattr(guarded, call)(*args)
    assert emulator.nvmlDeviceGetMigMode(handle) == before
    assert dict(guarded.refused) == {
        "nvmlDeviceSetMigMode": 1,
        "nvmlDeviceCreateGpuInstance": 1,
        "nvmlDeviceSetComputeMode": 1,
    }
    # The health watcher's event set is allowed: it changes nothing on the GPU.
    guarded.nvmlEventSetFree(guarded.nvmlEventSetCreate())
