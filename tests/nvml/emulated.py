"""The emulated NVML of a built-in profile, as the tests of this folder load it."""

from __future__ import annotations

from gpudra.driver.nvml import NvmlEmulator, load_nvml


def emulated(name: str) -> NvmlEmulator:
    """`load_nvml("emulated:<name>")`, typed as the emulator it is."""
    nvml = load_nvml(f"emulated:{name}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml
