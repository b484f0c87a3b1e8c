"""Shared pytest fixtures: a ready local control plane for tests marked `cluster`, and
clients of it (the harness's synchronous one, gpudra's own async one)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from gpudra.common.kube import Kube as AsyncKube

from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube
from e2e.provider import on_kind


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Reuses a running cluster; one started here is stopped at the end of the run
    unless GPUDRA_KEEP_CLUSTER=1. GPUDRA_CLUSTER_PROVIDER=kind runs on kind instead of
    the local control plane (`make e2e-kind`)."""
    c: Cluster
    if on_kind():
        from e2e.kind.cluster import KindCluster  # noqa: PLC0415 - only with Docker

        c = KindCluster()  # type: ignore[assignment]
    else:
        c = Cluster()
    started = not c.is_up()
    if started:
        c.up(log=lambda _m: None)
    yield c
    if started and os.environ.get("GPUDRA_KEEP_CLUSTER") != "1":
        c.down(log=lambda _m: None)


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Kube:
    return cluster.kube()


@pytest.fixture
async def akube(cluster: Cluster) -> AsyncIterator[AsyncKube]:
    """gpudra's own API client, as its components use it, with admin credentials."""
    k = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig))
    yield k
    await k.close()
