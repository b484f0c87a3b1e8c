"""The DeviceClasses gpudra serves, compatible with the upstream NVIDIA driver's.

One definition used by the Helm chart check, the tests and the demo, so a selector
cannot drift between them.
"""

from __future__ import annotations

from typing import Any

DEFAULT_DRIVER = "gpu.nvidia.com"


def device_classes(driver: str = DEFAULT_DRIVER) -> list[dict[str, Any]]:
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
    # GPUs apart from exclusive ones.
    return [
        cls("gpu.nvidia.com", "gpu"),
        cls("mig.nvidia.com", "mig"),
        cls("gpu-shared.nvidia.com", "gpu"),
    ]
