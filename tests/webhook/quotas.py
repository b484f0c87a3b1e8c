"""The ResourceQuota the tenant controller keeps for a GpuTenant's deviceQuota, as the
API returns it: shared by the tenant and admission tests."""

from __future__ import annotations

from typing import Any

from gpudra.webhook.tenant_state import QUOTA_NAME, TENANT_LABEL
from gpudra.webhook.tenants import MANAGED_BY_LABEL, MANAGED_BY_VALUE

KEY = "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"
"""The quota's resource for gpu.nvidia.com devices."""


def quota(ns: str, owner: str, hard: int, used: int = 0) -> dict[str, Any]:
    return {
        "metadata": {
            "name": QUOTA_NAME,
            "namespace": ns,
            "uid": f"uid-{ns}",
            "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, TENANT_LABEL: owner},
        },
        "spec": {"hard": {KEY: str(hard)}},
        "status": {"hard": {KEY: str(hard)}, "used": {KEY: str(used)}},
    }
