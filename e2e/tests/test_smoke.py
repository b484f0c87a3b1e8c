"""Smoke: real controller-manager creates the claim, real scheduler allocates and binds."""

from __future__ import annotations

import pytest

from e2e import smoke
from e2e.cluster.kube import Kube

pytestmark = pytest.mark.cluster


def test_template_claim_is_allocated_bound_and_deleted_with_pod(kube: Kube) -> None:
    node = smoke.worker_node(kube)
    res = smoke.run(kube, node=node)
    assert res.node == node  # the only node with a slice for this driver
    assert res.pool == node
    assert res.device == "gpu-0"
    assert res.claim_owner == f"Pod/{res.pod}"
    claim = kube.get("ResourceClaim", res.claim, res.namespace)
    assert claim["status"]["reservedFor"][0]["name"] == res.pod
    smoke.teardown(kube, res)
    assert kube.get_or_none("ResourceClaim", res.claim, res.namespace) is None
    assert kube.get_or_none("ResourceSlice", f"{node}-{smoke.DRIVER}") is None
