"""What the kubelet's health stream reads of the agent's health state (`AgentHealth`)."""

from __future__ import annotations

from typing import cast

import pytest
from gpudra.common.kube import Kube
from gpudra.driver.health import HEALTH_CHECKS_OFF, UnmonitoredEvent, XidEvent
from gpudra.driver.node import AgentHealth

from tests.driver.test_prepare import (
    Node,
    h100,
    node,  # noqa: F401  (the fixture)
)
from tests.driver.test_take_over import node_service

pytestmark = pytest.mark.anyio


async def test_a_device_whose_gpu_is_unmonitored_is_unknown_to_the_kubelet(
    node: Node,  # noqa: F811
) -> None:
    """A GPU whose events NVML cannot deliver carries an informational taint: its health
    is not known, and the kubelet shows it Unknown in the pod's status, not Healthy. A
    critical XID seen before its events stopped still says Unhealthy."""
    service = node_service(node, cast(Kube, object()), h100(), health_checks=True)
    await service.agent.scan()
    state = service.agent.health
    assert state is not None
    inventory = service.agent.inventory
    assert inventory is not None
    gpus = inventory.gpus
    state.apply(UnmonitoredEvent(gpus[3].uuid, "registering for its events failed"))
    state.apply(XidEvent(gpus[5].uuid, 48))
    state.apply(UnmonitoredEvent(gpus[5].uuid, "registering for its events failed"))
    health = {d.device_name: d.healthy for d in AgentHealth(service.agent).snapshot().devices}
    assert health["gpu-3"] is None
    assert health["gpu-5"] is False
    assert {name for name, healthy in health.items() if healthy is not True} == {"gpu-3", "gpu-5"}


async def test_with_health_checks_off_every_device_is_unknown_to_the_kubelet(
    node: Node,  # noqa: F811
) -> None:
    """`--no-health-checks`: no event of any GPU is read, so the kubelet is told that
    no device's health is known, and why, rather than that all are Healthy."""
    service = node_service(node, cast(Kube, object()), h100(), health_checks=False)
    await service.agent.scan()
    devices = AgentHealth(service.agent).snapshot().devices
    assert [d.device_name for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert {(d.healthy, d.message) for d in devices} == {(None, HEALTH_CHECKS_OFF)}
