"""Upstream's `addressingMode` attribute: NVML's addressing mode (R580 and later),
published on a GPU and every MIG device of it, spelt as go-nvlib spells it, and left
out, never failing the scan, where NVML has no answer or one nobody knows."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest
from gpudra.driver import publish
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.slices import SliceLimits, plan_slices

from tests.nvml.emulated import emulated, with_gpu_answers

ATS, HMM, NONE = (
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS,
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM,
    pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE,
)


def published(nvml: NvmlLibrary, strategy: MigStrategy) -> dict[str, dict[str, Any]]:
    """Each published device's attributes by name, as the API server is sent them."""
    content = publish.pool_content(discover(nvml), strategy)
    plan_slices(content, SliceLimits())  # within what the API takes
    return {d["name"]: d["attributes"] for d in content.devices}


def gpu_of(attrs: dict[str, Any]) -> str:
    return str((attrs.get("parentUUID") or attrs["uuid"])["string"])


def gpu_uuids(nvml: NvmlLibrary) -> list[str]:
    nvml.nvmlInit()
    try:
        return [
            str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
            for i in range(nvml.nvmlDeviceGetCount())
        ]
    finally:
        nvml.nvmlShutdown()


@pytest.mark.parametrize("strategy", [MigStrategy.STATIC, MigStrategy.DYNAMIC])
def test_each_gpus_mode_reaches_it_and_every_mig_device_of_it(strategy: MigStrategy) -> None:
    """The A100 profile's first GPU has four MIG devices (static) and the second none
    (its placements, dynamic): each device carries its own GPU's mode."""
    nvml = with_gpu_answers("a100-40gb-mig-r580", "addressingMode", [ATS, HMM])
    expected = dict(zip(gpu_uuids(nvml), ("ATS", "HMM"), strict=True))
    attrs = published(nvml, strategy)
    assert {a["type"]["string"] for a in attrs.values()} == {"mig"}
    first, second = expected
    assert {gpu_of(a) for a in attrs.values()} == (
        {second} if strategy is MigStrategy.DYNAMIC else {first}
    )
    for name, got in attrs.items():
        assert got["addressingMode"] == {"string": expected[gpu_of(got)]}, name


def test_a_platform_with_neither_mode_active_says_none_as_upstream_does() -> None:
    attrs = published(
        with_gpu_answers("h100-80gb-hbm3-x8", "addressingMode", [NONE] * 8), MigStrategy.DYNAMIC
    )
    assert len(attrs) == 8
    assert all(a["addressingMode"] == {"string": "None"} for a in attrs.values())


@pytest.mark.parametrize(
    "profile",
    ["h100-80gb-mig-r535", "h100-80gb-mig-r550", "h100-80gb-mig-r570", "h100-80gb-mig-r580"],
)
def test_no_attribute_where_nvml_has_no_answer(profile: str) -> None:
    """Before R580 the entry point is missing (FUNCTION_NOT_FOUND, even where the GPU
    has a mode); on R580 the profile's GPUs answer NOT_SUPPORTED, as no product profile
    says what its real GPU answers."""
    r580 = profile.endswith("r580")
    nvml = emulated(profile) if r580 else with_gpu_answers(profile, "addressingMode", [ATS, ATS])
    attrs = published(nvml, MigStrategy.DYNAMIC)
    assert len({gpu_of(a) for a in attrs.values()}) == 2
    assert not any("addressingMode" in a for a in attrs.values())


def test_a_mode_nobody_knows_leaves_that_gpu_published_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Upstream fails the node's whole enumeration on a value go-nvlib does not know; a
    selector that needs the attribute fails closed on that GPU alone here."""
    nvml = with_gpu_answers("h100-80gb-mig-r580", "addressingMode", [7, HMM])
    first, second = gpu_uuids(nvml)
    attrs = published(nvml, MigStrategy.DYNAMIC)
    assert {gpu_of(a) for a in attrs.values()} == {first, second}
    for name, got in attrs.items():
        if gpu_of(got) == first:
            assert "addressingMode" not in got, name
        else:
            assert got["addressingMode"] == {"string": "HMM"}, name
    assert "an addressing mode gpudra does not know" in caplog.text


def test_an_nvml_error_leaves_the_gpus_published_and_a_lost_gpu_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = with_gpu_answers("h100-80gb-hbm3-x8", "addressingMode", [HMM] * 8)
    answer = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    real = nvml.nvmlDeviceGetAddressingMode

    def at_gpu_2(device: object) -> int:
        if nvml.nvmlDeviceGetIndex(device) == 2:
            raise pynvml.NVMLError(answer)
        return real(device)

    monkeypatch.setattr(nvml, "nvmlDeviceGetAddressingMode", at_gpu_2)
    inventory = discover(nvml)
    assert [("addressingMode" in g.device.attributes) for g in inventory.gpus] == [
        i != 2 for i in range(8)
    ]
    assert "NVML refused the GPU's addressing mode" in caplog.text
    answer = pynvml.NVML_ERROR_GPU_IS_LOST
    inventory = discover(nvml)
    assert [g.index for g in inventory.gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert [lost.index for lost in inventory.lost] == [2]
