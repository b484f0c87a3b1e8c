"""The one sharing resolution prepare and claim validation share."""

from __future__ import annotations

import pytest
from gpudra.api.config import BoundConfig, ConfigError, GpuConfig, GpuSharing, MigDeviceConfig
from gpudra.api.sharing import driver_capacities, is_memory_slice, resolve_sharing

TIME_SLICED = BoundConfig(GpuConfig(sharing=GpuSharing(strategy="TimeSlicing")), (), "class[0]")
MPS = BoundConfig(GpuConfig(sharing=GpuSharing(strategy="MPS")), (), "claim[0]")


def test_class_config_sets_the_mode_and_claim_config_overrides_it() -> None:
    shared = resolve_sharing("gpu", [TIME_SLICED], [], "gpu", memory_slice=False, where="r")
    assert (shared.mode, shared.path, shared.time_slice) == ("TimeSlicing", "class[0]", 0)
    mps = resolve_sharing("gpu", [TIME_SLICED], [MPS], "gpu", memory_slice=False, where="r")
    assert (mps.mode, mps.path, mps.mps) == ("MPS", "claim[0]", True)
    plain = resolve_sharing("gpu", [], [], "gpu", memory_slice=False, where="r")
    assert (plain.mode, plain.path) == ("Exclusive", "")


def test_a_memory_slice_runs_under_mps() -> None:
    sliced = resolve_sharing("gpu", [], [], "gpu", memory_slice=True, where="r")
    assert sliced.mode == "MPS" and sliced.mps


def test_time_slicing_cannot_apply_to_a_memory_slice() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_sharing("gpu", [TIME_SLICED], [], "gpu", memory_slice=True, where="req[0]")
    (issue,) = err.value.issues
    assert issue.path == "class[0].sharing.strategy"
    assert "TimeSlicing cannot apply to req[0]" in issue.message
    assert issue.accepted == ("MPS",)


def test_config_bound_to_the_request_must_fit_its_device() -> None:
    bound = BoundConfig(GpuConfig(), ("mig",), "claim[0]")
    with pytest.raises(ConfigError, match="GpuConfig cannot configure the MIG device"):
        resolve_sharing("mig", [], [bound], "mig", memory_slice=False, where="r")
    mig = BoundConfig(MigDeviceConfig(), ("mig",), "claim[0]")
    assert resolve_sharing("mig", [], [mig], "mig", memory_slice=False, where="r").mode == (
        "Exclusive"
    )


def test_capacity_names_are_read_within_the_drivers_domain() -> None:
    """`<driver>/shares` is the driver's `shares` (as the 1.38 scheduler resolves it);
    another domain's name, or another driver's, is left as it is."""
    named = {"gpu.nvidia.com/shares": "1", "example.com/memory": "1Gi", "bandwidth": "1"}
    short = driver_capacities(named, "gpu.nvidia.com")
    assert short == {"shares": "1", "example.com/memory": "1Gi", "bandwidth": "1"}
    assert not is_memory_slice(short)
    assert driver_capacities(named, "gpu.example.com") == named
