"""Fixtures shared by the end-to-end tests: the GPU node every GPU-pod test runs on
(the real node with gpudra as host processes or from the chart, or kind's worker) and a
namespace of the test's own on it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube
from e2e.gpu_pods import scratch_namespace
from e2e.node.chart import ChartStack, chart_unavailable_reason
from e2e.node.gpus import GpuStack, NodeGpus, installed
from e2e.node.realnode import RealNode, unavailable_reason


@pytest.fixture
def anyio_backend() -> str:
    """kubernetes_asyncio and grpc.aio are asyncio-only."""
    return "asyncio"


# kind has no real node to add; its GPU node is a worker with the chart (make e2e-kind).
PROVIDERS = (
    ["kind"] if os.environ.get("GPUDRA_CLUSTER_PROVIDER") == "kind" else ["processes", "chart"]
)


@pytest.fixture(scope="module", params=PROVIDERS)
def stack(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[NodeGpus]:
    if request.param == "kind":
        from e2e.kind.gpus import KindGpus, gpu_worker  # noqa: PLC0415 - only with Docker

        yield from installed(KindGpus(gpu_worker(cluster)))  # type: ignore[arg-type]
        return
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no real node on this machine: {reason}")
    if request.param == "chart" and (reason := chart_unavailable_reason()):
        pytest.skip(f"the chart cannot be installed here: {reason}")
    node = RealNode(cluster)
    node.up(log=lambda _m: None)
    if request.param == "processes" and chart_unavailable_reason() is None:
        ChartStack(node).down()  # a release an interrupted run left would take the node's webhook
    try:
        yield from installed(GpuStack(node) if request.param == "processes" else ChartStack(node))
    finally:
        node.down(log=lambda _m: None)


@pytest.fixture
def ns(stack: NodeGpus, kube: Kube) -> Iterator[str]:
    yield from scratch_namespace(kube, "gpu")
