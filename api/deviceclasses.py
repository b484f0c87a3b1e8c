"""The DeviceClasses gpudra serves, compatible with the upstream NVIDIA driver's.

The one definition: the demo and the tests apply these objects, and the Helm chart's
template must render exactly them for the same values (tests/chart compares them
field by field, the shared class's config included), so a selector or a sharing
config cannot drift between what is demonstrated, tested and installed. The opt-in
per-profile MIG classes (`mig_profile_class`) are named here once; the webhook converts
to them and reads their profile for the tenant rules by the same rule.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpudra.api.names import check_dns_subdomain
from gpudra.api.tenants import MIG_PROFILE_RE, MIG_SUFFIX_TOKENS

__all__ = [
    "CLASS_TYPES",
    "DEFAULT_DRIVER",
    "DEFAULT_SHARED_SHARING",
    "MIG_CLASS",
    "SHARED_CLASS",
    "device_classes",
    "mig_profile_class",
    "mig_profile_selector",
]

DEFAULT_DRIVER = "gpu.nvidia.com"
SHARED_CLASS: Final = "gpu-shared.nvidia.com"
MIG_CLASS: Final = "mig.nvidia.com"
CLASS_TYPES: Final[Mapping[str, str]] = {
    "gpu.nvidia.com": "gpu",
    MIG_CLASS: "mig",
    SHARED_CLASS: "gpu",
}
"""Each class and the device `type` attribute its selector matches."""
DEFAULT_SHARED_SHARING: Final[Mapping[str, Any]] = {
    "strategy": "TimeSlicing",
    "timeSlicingConfig": {"interval": "Default"},
}
"""The shared class's sharing config with the chart's default values
(`deviceClasses.shared`): hand-written claims on it are time-sliced."""


def mig_profile_class(profile: str) -> str:
    """The opt-in DeviceClass of one MIG profile: ``mig-1g.10gb.nvidia.com``.

    Kueue (and a ResourceQuota) count claims per DeviceClass, so a quota per MIG profile
    needs a class per profile. The profile's suffix (``+me``, ``+me.all``, ``+gfx``,
    ``-me``) becomes a readable token after a dash, since ``+`` is not allowed in a name
    and ``-me`` must not read as ``+me``: ``1g.10gb+me`` -> ``mig-1g.10gb-me.nvidia.com``,
    ``1g.10gb-me`` -> ``mig-1g.10gb-nome.nvidia.com``. The name is checked here, once.
    """
    match = MIG_PROFILE_RE.fullmatch(profile)
    if match is None:
        raise ValueError(
            f"{profile!r} is not a MIG profile: expected "
            "[<c>c.]<slices>g.<memory>gb with an optional suffix (+me, +me.all, +gfx, -me), "
            'for example "1g.10gb" or "3g.40gb"'
        )
    suffix = match["suffix"] or ""
    base = profile.removesuffix(suffix)
    token = f"-{MIG_SUFFIX_TOKENS[suffix]}" if suffix else ""
    name = f"mig-{base}{token}.{MIG_CLASS.split('.', 1)[1]}"
    check_dns_subdomain(name, f"the DeviceClass name of MIG profile {profile}")
    return name


def mig_profile_selector(driver: str, profile: str) -> str:
    """CEL pinning a MIG device to `profile`: the attribute every MIG device carries,
    static (existing instances) and dynamic (placements created on prepare) alike. The
    conversion writes it into claims and the per-profile classes add it to the MIG
    class's selector, so both name a profile the same way."""
    return f'device.attributes["{driver}"].profile == "{profile}"'


def device_classes(
    driver: str = DEFAULT_DRIVER,
    shared_sharing: Mapping[str, Any] = DEFAULT_SHARED_SHARING,
    mig_profiles: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """gpu, mig, one class per profile of `mig_profiles` (opt-in, the chart's
    `deviceClasses.mig.profiles`) and gpu-shared; `shared_sharing` is the GpuConfig
    `sharing` of the last."""

    def cls(name: str, device_type: str) -> dict[str, Any]:
        expr = (
            f'device.driver == "{driver}" && device.attributes["{driver}"].type == "{device_type}"'
        )
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expr}}]},
        }

    # gpu-shared.nvidia.com selects the same full GPUs; the webhook's converted
    # nvidia.com/gpu.shared claims request it, so a GpuTenant can allow or quota shared
    # GPUs apart from exclusive ones. Its config makes every device it allocates shared.
    gpu, mig, shared = (cls(name, device_type) for name, device_type in CLASS_TYPES.items())
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": copy.deepcopy(dict(shared_sharing)),  # callers may edit what they get
    }
    shared["spec"]["config"] = [{"opaque": {"driver": driver, "parameters": parameters}}]
    per_profile = []
    for profile in mig_profiles:
        one = cls(mig_profile_class(profile), CLASS_TYPES[MIG_CLASS])
        one["spec"]["selectors"].append(
            {"cel": {"expression": mig_profile_selector(driver, profile)}}
        )
        per_profile.append(one)
    return [gpu, mig, *per_profile, shared]
