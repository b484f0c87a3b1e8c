"""Emulated `nvmlDeviceGetSamples`: a GPU's utilization samples, one per sample period,
in a bounded buffer, read by timestamp as nvml.h describes."""

from __future__ import annotations

import time
from typing import Any

import pynvml
import pytest
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile
from gpudra.driver.nvml.series import SAMPLE_PERIOD_US, SAMPLE_RING

GPU_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
MEMORY_SAMPLES = pynvml.NVML_MEMORY_UTILIZATION_SAMPLES


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def emulated(
    telemetry: dict[str, Any], clock: Clock, *, name: str = "l4"
) -> tuple[NvmlEmulator, Any]:
    doc = load_builtin_profile(name).model_dump(mode="json")
    doc["gpus"][0]["telemetry"] = telemetry
    nvml = NvmlEmulator(parse_profile(doc), clock=clock)
    nvml.nvmlInit()
    return nvml, nvml.nvmlDeviceGetHandleByIndex(0)


def read(nvml: NvmlEmulator, handle: Any, after: int, kind: int = GPU_SAMPLES) -> list[Any]:
    value_type, samples = nvml.nvmlDeviceGetSamples(handle, kind, after)
    assert value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT  # nvml.h, for utilization
    assert all(isinstance(s, pynvml.c_nvmlSample_t) for s in samples)
    return [(s.timeStamp, s.sampleValue.uiVal) for s in samples]


def test_samples_are_one_period_apart_with_the_value_at_each_samples_time() -> None:
    clock = Clock()
    nvml, gpu = emulated({"utilization": [[0, 90], [0.5, 10]], "memoryUtilization": 30}, clock)
    clock.now = 1.0
    got = read(nvml, gpu, 0)
    assert [t for t, _ in got] == [k * SAMPLE_PERIOD_US for k in range(1, 6)]  # up to 1 s
    assert [v for _, v in got] == [90, 90, 10, 10, 10]  # the step at 0.5 s, in between
    assert [v for _, v in read(nvml, gpu, 0, MEMORY_SAMPLES)] == [30] * 5


def test_only_samples_newer_than_the_timestamp_and_not_found_when_there_are_none() -> None:
    clock = Clock()
    nvml, gpu = emulated({"utilization": 40}, clock)
    with pytest.raises(pynvml.NVMLError_NotFound):  # none taken yet
        read(nvml, gpu, 0)
    clock.now = 0.5
    newest = read(nvml, gpu, 0)[-1][0]
    with pytest.raises(pynvml.NVMLError_NotFound):
        read(nvml, gpu, newest)
    clock.now = 1.0
    assert [t for t, _ in read(nvml, gpu, newest)] == [
        newest + k * SAMPLE_PERIOD_US for k in (1, 2, 3)
    ]


def test_the_buffer_keeps_the_newest_samples_only() -> None:
    clock = Clock()
    nvml, gpu = emulated({"utilization": [[0, 100], [60, 0]]}, clock)
    clock.now = 3600.0  # an hour unread
    got = read(nvml, gpu, 0)
    assert len(got) == SAMPLE_RING
    assert got[-1][0] == (3600 * 1_000_000 // SAMPLE_PERIOD_US) * SAMPLE_PERIOD_US
    assert {v for _, v in got} == {0}


def test_a_scripted_value_answers_every_sample_since_the_last_read() -> None:
    """A script has no time of its own: it is what the GPU did since the samples were
    last read, so a test scripts what the next sampling interval is."""
    clock = Clock()
    nvml, gpu = emulated({"utilization": 80}, clock)
    clock.now = 1.0
    newest = read(nvml, gpu, 0)[-1][0]
    clock.now = 2.0
    nvml.telemetry.script(0, utilization=5)
    # Every sample of the second since the last read.
    assert [v for _, v in read(nvml, gpu, newest)] == [5] * (1_000_000 // SAMPLE_PERIOD_US)
    assert nvml.nvmlDeviceGetUtilizationRates(gpu).gpu == 5


def test_a_nodes_emulated_gpu_stamps_its_samples_with_the_wall_clock_as_nvml_does() -> None:
    """NVML stamps a sample with the CPU's wall clock in microseconds, and the agent
    reads the newest against its own wall clock to see that clock step back
    (`gpudra.driver.utilization`). Stamped from the monotonic clock, as they were, an
    emulated node's samples lay decades behind it, so that check held whatever the
    clock did."""
    before_us = time.time() * 1_000_000
    nvml: Any = load_nvml("emulated:l4")  # as the agent builds it
    nvml.nvmlInit()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    time.sleep(1.5 * SAMPLE_PERIOD_US / 1_000_000)  # one sample period at least
    stamps = [t for t, _ in read(nvml, gpu, 0)]
    assert stamps
    assert before_us <= min(stamps) <= max(stamps) <= time.time() * 1_000_000


def test_what_has_no_samples_answers_as_nvml_does() -> None:
    clock = Clock()
    nvml, gpu = emulated({"unsupported": ["utilization"]}, clock)
    clock.now = 1.0
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a GPU without the figure
        read(nvml, gpu, 0)
    assert read(nvml, gpu, 0, MEMORY_SAMPLES)
    for not_emulated in (pynvml.NVML_TOTAL_POWER_SAMPLES, pynvml.NVML_PROCESSOR_CLK_SAMPLES):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            read(nvml, gpu, 0, not_emulated)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        read(nvml, gpu, 0, pynvml.NVML_SAMPLINGTYPE_COUNT)
    nvml.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        read(nvml, gpu, 0, MEMORY_SAMPLES)


def test_a_mig_enabled_gpu_and_its_mig_devices_have_no_utilization_samples() -> None:
    """nvml.h: "On MIG-enabled GPUs, querying ... NVML_GPU_UTILIZATION_SAMPLES,
    NVML_MEMORY_UTILIZATION_SAMPLES ... is not currently supported"."""
    nvml: Any = load_nvml("emulated:a100-40gb-mig-mixed")
    nvml.nvmlInit()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    for handle in (gpu, mig):
        for kind in (GPU_SAMPLES, MEMORY_SAMPLES):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nvml.nvmlDeviceGetSamples(handle, kind, 0)
