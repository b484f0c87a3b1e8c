"""The DeviceClasses gpudra serves: the opt-in per-profile MIG classes and their names."""

from __future__ import annotations

import pytest
from gpudra.api.deviceclasses import device_classes, mig_profile_class
from gpudra.api.names import is_dns_subdomain


@pytest.mark.parametrize(
    ("profile", "name"),
    [
        ("1g.10gb", "mig-1g.10gb.nvidia.com"),
        ("3g.40gb", "mig-3g.40gb.nvidia.com"),
        ("1g.10gb+me", "mig-1g.10gb-me.nvidia.com"),
        ("1g.10gb-me", "mig-1g.10gb-nome.nvidia.com"),
        ("1g.20gb+me.all", "mig-1g.20gb-meall.nvidia.com"),
        ("1g.10gb+gfx", "mig-1g.10gb-gfx.nvidia.com"),
        ("1c.2g.20gb", "mig-1c.2g.20gb.nvidia.com"),
        ("7c.7g.9999gb+me.all", "mig-7c.7g.9999gb-meall.nvidia.com"),
    ],
)
def test_every_profile_gets_a_valid_distinct_class_name(profile: str, name: str) -> None:
    assert mig_profile_class(profile) == name
    assert is_dns_subdomain(name)


def test_a_name_that_is_not_a_profile_is_refused_with_the_form() -> None:
    for bad in ("1g.10GB", "1g.10gb+ME", "mig-1g.10gb", ""):
        with pytest.raises(ValueError, match=r"is not a MIG profile: expected .*1g\.10gb"):
            mig_profile_class(bad)


def test_per_profile_classes_select_mig_devices_of_their_profile() -> None:
    """Opt-in: none by default; each one is the MIG class's selector plus the profile
    attribute that static and dynamic MIG devices both carry."""
    names = [c["metadata"]["name"] for c in device_classes()]
    assert names == ["gpu.nvidia.com", "mig.nvidia.com", "gpu-shared.nvidia.com"]
    classes = device_classes("gpu.example.com", mig_profiles=["1g.10gb", "3g.40gb"])
    mig = classes[1]["spec"]["selectors"]
    by_name = {c["metadata"]["name"]: c["spec"]["selectors"] for c in classes}
    assert by_name["mig-3g.40gb.nvidia.com"] == [
        *mig,
        {"cel": {"expression": 'device.attributes["gpu.example.com"].profile == "3g.40gb"'}},
    ]
    assert [c["metadata"]["name"] for c in classes][2:4] == [
        "mig-1g.10gb.nvidia.com",
        "mig-3g.40gb.nvidia.com",
    ]
