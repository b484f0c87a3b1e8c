"""A hostile tenant against the node's health checks, on the real control plane.

A tenant's workload raises many XIDs at will: a faulting kernel, a push buffer its
process wrote, an exception of whichever copy engine or decoder it drives. On a GPU
others share (time-slicing, MPS, shares), each of those that took the device out of
service would keep every tenant's new pods off it: a denial of service on demand.
NVIDIA's XID catalogue answers them by restarting the application, not by taking the
GPU away, and gpudra follows it (`gpudra.driver.health.APPLICATION_XIDS`,
`RESTARTED_XIDS`). Node agents with emulated GPUs publish the slices; the real
scheduler decides.
"""

from __future__ import annotations

import anyio
import pytest

from e2e import features, smoke
from e2e.cluster.kube import Kube as SyncKube
from e2e.tests.test_inventory import (
    DRIVER,
    Node,
    allocation,
    claim_pod,
    nodes,  # noqa: F401 -- the fixture, used by name
    on_worker_1_gpu,
    published,
    tainted,
    unschedulable,
)

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]

# One of each kind a workload drives: the graphics engine (25, 69), a channel that
# stopped (8), a copy engine (39), a video decoder other than the first (83), a JPEG
# decoder (99), the optical flow engine (86).
RAISED_AT_WILL = (8, 25, 39, 69, 83, 86, 99)


async def test_xids_a_workload_raises_keep_no_other_tenant_off_its_gpu(
    nodes: dict[str, Node],  # noqa: F811 -- the fixture imported above
    kube: SyncKube,
) -> None:
    """Tenant A's workload raises one XID of each engine on gpu-5; tenant B's next claim
    for that very GPU is still allocated by the scheduler. An NVLink error (74), which
    the catalogue has decoded first, still keeps new claims off: the scheduler here
    does read the taints, so the first answer is the rule's, not a blind spot's."""
    if reason := features.device_taints(kube):
        pytest.skip(reason)
    node = nodes["worker-1"]
    health = node.agent.health
    assert health is not None
    uuid = (await published(kube, "worker-1"))["gpu-5"]["attributes"]["uuid"]["string"]
    for xid in RAISED_AT_WILL:
        node.nvml.inject_xid(5, xid)
    with anyio.fail_after(30):  # until the agent read them all
        while sum(n for (u, _), n in health.xid_counts().items() if u == uuid) < len(
            RAISED_AT_WILL
        ):
            await anyio.sleep(0.05)
    (taint,) = await tainted(kube, "worker-1", "gpu-5")
    assert (taint["key"], taint["value"], taint["effect"]) == (f"{DRIVER}/xid", "8", "None")

    ns = smoke.make_namespace(kube, "xid-tenant-b")
    claim_pod(kube, ns, "tenant-b", await on_worker_1_gpu(kube, "gpu-5"))
    assert (await allocation(kube, ns, "tenant-b"))["device"] == "gpu-5"

    node.nvml.inject_xid(6, 74)
    await tainted(kube, "worker-1", "gpu-6")
    claim_pod(kube, ns, "after-nvlink", await on_worker_1_gpu(kube, "gpu-6"))
    assert await unschedulable(kube, ns, "after-nvlink")
    kube.delete("Namespace", ns)
