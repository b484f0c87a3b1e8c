"""The DeviceClasses gpudra serves, compatible with the upstream NVIDIA driver's.

The one definition: the demo and the tests apply these objects, and the Helm chart's
template must render exactly them for the same values (tests/chart compares them
field by field, the shared class's config included), so a selector or a sharing
config cannot drift between what is demonstrated, tested and installed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "CLASS_TYPES",
    "DEFAULT_DRIVER",
    "DEFAULT_SHARED_SHARING",
    "SHARED_CLASS",
    "device_classes",
]

DEFAULT_DRIVER = "gpu.nvidia.com"
SHARED_CLASS: Final = "gpu-shared.nvidia.com"
CLASS_TYPES: Final[Mapping[str, str]] = {
    "gpu.nvidia.com": "gpu",
    "mig.nvidia.com": "mig",
    SHARED_CLASS: "gpu",
}
"""Each class and the device `type` attribute its selector matches."""
DEFAULT_SHARED_SHARING: Final[Mapping[str, Any]] = {
    "strategy": "TimeSlicing",
    "timeSlicingConfig": {"interval": "Default"},
}
"""The shared class's sharing config with the chart's default values
(`deviceClasses.shared`): hand-written claims on it are time-sliced."""


def device_classes(
    driver: str = DEFAULT_DRIVER, shared_sharing: Mapping[str, Any] = DEFAULT_SHARED_SHARING
) -> list[dict[str, Any]]:
    """gpu, mig and gpu-shared; `shared_sharing` is the GpuConfig `sharing` of the last."""

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
    return [gpu, mig, shared]
