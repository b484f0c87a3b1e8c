"""One writer of tenant quotas on the real control plane: two webhook replicas of
different releases (their desired quotas differ, as when a new release counts another
DeviceClass) run at once; only the Lease's holder writes, the quota never flips between
them, and a stopped leader hands the Lease back so the other takes over at once."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import crd_manifest
from gpudra.common.kube import Kube
from gpudra.common.leader import LeaderElector
from gpudra.webhook.tenants import TenantController

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube as SyncKube
from e2e.cluster.kube import apply_crd
from e2e.tests.test_tenants import DRIVER, delete_tenant, make_labelled_tenant, quota_of, until
from e2e.webhook_env import call

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]

LEASE_DURATION_S = 60.0
"""Long, so that a takeover within `HANDOVER_WITHIN_S` can only come from the release."""
RENEW_DEADLINE_S = 40.0
RETRY_S = 0.5
HANDOVER_WITHIN_S = 30.0
"""Generous for a starved machine (a handover takes about one retry), yet under the
lease duration a takeover without the release would wait."""


@pytest.fixture
async def clients(cluster: Cluster) -> AsyncIterator[tuple[Kube, Kube]]:
    """One API client per replica, as two pods each have their own."""
    config = str(cluster.layout.admin_kubeconfig)
    a, b = await Kube.connect(config), await Kube.connect(config)
    yield a, b
    await a.close()
    await b.close()


def replica(kube: Kube, identity: str, lease: str, ns: str, extra_class: str) -> TenantController:
    elector = LeaderElector(
        kube,
        name=lease,
        namespace=ns,
        identity=identity,
        lease_duration_s=LEASE_DURATION_S,
        renew_deadline_s=RENEW_DEADLINE_S,
        retry_s=RETRY_S,
    )
    return TenantController(kube, extra_classes=[extra_class], leader=elector)


def wanted(controller: TenantController, ns: str) -> dict[str, str] | None:
    desired = controller.state.desired_quotas().get(ns)
    return None if desired is None else desired[0]


def hard_of(kube: SyncKube, ns: str) -> dict[str, str] | None:
    found: Any = quota_of(kube, ns)
    return None if found is None else found["spec"]["hard"]


async def test_one_replica_writes_the_quotas_and_a_stopped_one_hands_over_at_once(
    kube: SyncKube, clients: tuple[Kube, Kube]
) -> None:
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    apply_crd(kube, crd_manifest())
    ns = await call(smoke.make_namespace, kube, "leader")
    tenant = f"lead-{ns}"
    lease = f"quota-writer-{secrets.token_hex(3)}"
    old = replica(clients[0], "webhook-old", lease, ns, "release-old.example.com")
    new = replica(clients[1], "webhook-new", lease, ns, "release-new.example.com")
    scopes = {id(old): anyio.CancelScope(), id(new): anyio.CancelScope()}

    async def run(controller: TenantController) -> None:
        with scopes[id(controller)]:
            await controller.run()

    try:
        await call(lambda: make_labelled_tenant(kube, tenant, ns, deviceQuota={DRIVER: 2}))
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, old)
            tg.start_soon(run, new)
            leader: TenantController = await until(
                "one replica to lead",
                lambda: next((c for c in (old, new) if c.writing), None),
            )
            follower = new if leader is old else old
            await until(
                "both replicas to see the tenant",
                lambda: wanted(old, ns) is not None and wanted(new, ns) is not None,
            )
            want, theirs = wanted(leader, ns), wanted(follower, ns)
            assert want != theirs  # two releases that would overwrite each other
            await until("the leader's quota", lambda: hard_of(kube, ns) == want)

            # Over several renewals the quota stays the leader's; the follower writes
            # nothing (without the election it would write its own spec at once).
            seen = []
            for _ in range(int(6 * RETRY_S / 0.25)):
                seen.append(await call(hard_of, kube, ns))
                await anyio.sleep(0.25)
            assert all(hard == want for hard in seen), seen
            assert follower.writes == 0 and not follower.writing
            assert leader.writes >= 1 and leader.writing

            scopes[id(leader)].cancel()
            await until(
                "the follower to take the released lease",
                lambda: follower.writing,
                within_s=HANDOVER_WITHIN_S,
            )
            await until("the new leader's quota", lambda: hard_of(kube, ns) == theirs)
            assert follower.writes >= 1
            tg.cancel_scope.cancel()
    finally:
        await call(delete_tenant, kube, tenant)
        await call(kube.delete, "Namespace", ns)
