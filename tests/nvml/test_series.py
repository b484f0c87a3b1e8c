"""Emulated telemetry: profile values, scripted values and a script file, read through
the NVML calls the node agent makes on a real GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.driver.nvml import NvmlLoadError, ProfileError, load_nvml
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile
from gpudra.driver.nvml.series import ScriptError

MIB = 1024 * 1024


def started(nvml: Any) -> NvmlEmulator:
    assert isinstance(nvml, NvmlEmulator)
    nvml.nvmlInit()
    return nvml


def with_telemetry(telemetry: dict[str, Any], *, name: str = "l4") -> NvmlEmulator:
    doc = load_builtin_profile(name).model_dump(mode="json")
    doc["gpus"][0]["telemetry"] = telemetry
    return started(NvmlEmulator(parse_profile(doc)))


def readings(nvml: NvmlEmulator, handle: Any) -> dict[str, int]:
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return {
        "gpu": rates.gpu,
        "memory": rates.memory,
        "temperature": nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        "power_mw": nvml.nvmlDeviceGetPowerUsage(handle),
        "sm_mhz": nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
        "used": nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used,
        "ecc_uncorrected": nvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        ),
    }


def test_profile_values_answer_the_nvml_calls() -> None:
    nvml = with_telemetry(
        {
            "utilization": 42,
            "memoryUtilization": 7,
            "temperature": 71,
            "power": 55.5,
            "smClock": 1800,
            "memoryUsed": 512 * MIB,
            "eccUncorrected": 2,
        }
    )
    assert readings(nvml, nvml.nvmlDeviceGetHandleByIndex(0)) == {
        "gpu": 42,
        "memory": 7,
        "temperature": 71,
        "power_mw": 55500,
        "sm_mhz": 1800,
        "used": 512 * MIB,
        "ecc_uncorrected": 2,
    }


def test_steps_hold_from_their_time_on() -> None:
    nvml = with_telemetry({"utilization": [[0, 90], [3600, 5]]})
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 90
    nvml.telemetry._start -= 3600  # an hour later, without waiting for it
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 5


def test_script_by_index_and_uuid_wins_over_the_profile_and_ecc_events_add_up() -> None:
    nvml = with_telemetry({"utilization": 80, "eccUncorrected": 1})
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.telemetry.script(0, utilization=3, temperature=90)
    assert readings(nvml, handle)["gpu"] == 3
    nvml.telemetry.script(nvml.nvmlDeviceGetUUID(handle), temperature=20)
    assert readings(nvml, handle)["temperature"] == 20
    nvml.inject_ecc(0, double_bit=True)
    assert readings(nvml, handle)["ecc_uncorrected"] == 2


def test_a_mig_device_has_its_own_memory_and_no_other_figures() -> None:
    nvml = started(load_nvml("emulated:a100-40gb-mig-mixed"))
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    nvml.telemetry.script(0, utilization=99)
    nvml.telemetry.script(nvml.nvmlDeviceGetUUID(mig), memoryUsed=100 * MIB)
    assert nvml.nvmlDeviceGetMemoryInfo(mig).used == 100 * MIB
    for call in (
        lambda: nvml.nvmlDeviceGetUtilizationRates(mig),
        lambda: nvml.nvmlDeviceGetTemperature(mig, pynvml.NVML_TEMPERATURE_GPU),
        lambda: nvml.nvmlDeviceGetPowerUsage(mig),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    with pytest.raises(ScriptError, match="no temperature of its own"):
        nvml.telemetry.script(nvml.nvmlDeviceGetUUID(mig), temperature=1)
    # Its SM utilization may be scripted (GPM measures it on Hopper), yet the plain
    # call still has none.
    nvml.telemetry.script(nvml.nvmlDeviceGetUUID(mig), utilization=1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(mig)


def gpm_utilization(nvml: NvmlEmulator, gpu: Any, instance: int) -> float:
    first, second = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmMigSampleGet(gpu, instance, first)
    nvml.nvmlGpmMigSampleGet(gpu, instance, second)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 2
    request.sample1, request.sample2 = first, second
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    request.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    nvml.nvmlGpmMetricsGet(request)
    assert request.metrics[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.nvmlGpmSampleFree(first)
    nvml.nvmlGpmSampleFree(second)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpmSampleFree(second)
    assert request.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS
    return float(request.metrics[0].value)


def test_gpm_measures_a_hopper_mig_instance_and_refuses_on_ampere() -> None:
    doc = load_builtin_profile("h100-80gb-mig-r580").model_dump(mode="json")
    doc["gpus"][0]["telemetry"] = {"utilization": 40}
    doc["gpus"][0]["migInstances"] = [{"profileId": 19, "placementStart": 0}]
    nvml = started(NvmlEmulator(parse_profile(doc)))
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    instance = nvml.nvmlDeviceGetGpuInstanceId(mig)
    assert nvml.nvmlGpmQueryDeviceSupport(gpu).isSupportedDevice == 1
    assert gpm_utilization(nvml, gpu, instance) == 40  # the GPU's load, unless scripted
    nvml.telemetry.script(nvml.nvmlDeviceGetUUID(mig), utilization=7)
    assert gpm_utilization(nvml, gpu, instance) == 7
    assert nvml.gpm_samples_held() == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # no such GPU instance
        nvml.nvmlGpmMigSampleGet(gpu, instance + 100, nvml.nvmlGpmSampleAlloc())

    ampere = started(load_nvml("emulated:a100-40gb-mig-mixed"))
    a100 = ampere.nvmlDeviceGetHandleByIndex(0)
    assert ampere.nvmlGpmQueryDeviceSupport(a100).isSupportedDevice == 0
    a100_mig = ampere.nvmlDeviceGetMigDeviceHandleByIndex(a100, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        ampere.nvmlGpmMigSampleGet(
            a100, ampere.nvmlDeviceGetGpuInstanceId(a100_mig), ampere.nvmlGpmSampleAlloc()
        )


def test_unsupported_values_answer_not_supported() -> None:
    nvml = with_telemetry({"unsupported": ["power", "eccUncorrected"]})
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetPowerUsage(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        readings(nvml, handle)
    assert nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 35


def test_bad_scripts_name_the_key_and_value() -> None:
    nvml = with_telemetry({})
    with pytest.raises(ScriptError, match="utilization: 120 is not a percentage"):
        nvml.telemetry.script(0, utilization=120)
    with pytest.raises(ScriptError, match="unknown value 'fan'"):
        nvml.telemetry.script(0, fan=1)
    with pytest.raises(ScriptError, match="no GPU at index 5"):
        nvml.telemetry.script(5, utilization=1)
    with pytest.raises(ProfileError, match=r"telemetry.*utilization.*percentage"):
        with_telemetry({"utilization": [[0, 50], [10, 101]]})


def test_a_script_file_scripts_another_process_and_a_bad_edit_keeps_the_last(
    tmp_path: Path,
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"0": {"utilization": 12}}))
    nvml = started(load_nvml("emulated:t4", script_path=script))
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 12
    uuid = nvml.nvmlDeviceGetUUID(handle)
    script.write_text(json.dumps({uuid: {"utilization": 64, "power": 31}}))
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 64
    script.write_text("{not json")
    assert nvml.nvmlDeviceGetPowerUsage(handle) == 31000
    script.unlink()
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 0


def test_a_bad_script_file_at_start_is_a_load_error(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"GPU-nope": {"utilization": 1}}))
    with pytest.raises(ProfileError, match=r"GPU-nope.*is no GPU of this node"):
        load_nvml("emulated:t4", script_path=script)
    with pytest.raises(NvmlLoadError, match="emulated GPUs only"):
        load_nvml("real", script_path=script)
