"""Fixtures shared by the end-to-end tests: the GPU node every GPU-pod test runs on
(the real node with gpudra as host processes or from the chart, or kind's worker) and a
namespace of the test's own on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube
from e2e.gpu_pods import scratch_namespace
from e2e.node.chart import ChartStack, chart_unavailable_reason
from e2e.node.gpus import GpuStack, NodeGpus, installed
from e2e.node.realnode import RealNode, unavailable_reason
from e2e.provider import on_kind


@pytest.fixture
def anyio_backend() -> str:
    """kubernetes_asyncio and grpc.aio are asyncio-only."""
    return "asyncio"


# kind has no real node to add; its GPU node is a worker with the chart (make e2e-kind).
PROVIDERS = ["kind"] if on_kind() else ["processes", "chart"]


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
    yield from scratch_namespace(kube, "gpu", stack)


SUITE_OUTCOMES = ("passed", "failed", "error", "skipped")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """On kind (`make e2e-kind`), one row per test file: passed, failed, errors and
    skips, and after it each skip's reason, so a run says at a glance which suites ran
    there and which assume the local harness (the README's kind section lists them)."""
    if PROVIDERS != ["kind"]:
        return
    counts: dict[str, dict[str, int]] = {}
    reasons: dict[str, set[str]] = {}
    for outcome in SUITE_OUTCOMES:
        for report in terminalreporter.stats.get(outcome, []):
            if not isinstance(report, pytest.TestReport):
                continue
            suite = report.nodeid.split("::")[0]
            row = counts.setdefault(suite, dict.fromkeys(SUITE_OUTCOMES, 0))
            row[outcome] += 1
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                reasons.setdefault(suite, set()).add(report.longrepr[2].removeprefix("Skipped: "))
    if not counts:
        return
    write = terminalreporter.write_line
    width = max(len(s) for s in counts)
    terminalreporter.section("kind: results per suite")
    write(f"{'suite':<{width}}  " + "  ".join(f"{o:>7}" for o in SUITE_OUTCOMES))
    for suite in sorted(counts):
        write(f"{suite:<{width}}  " + "  ".join(f"{counts[suite][o]:>7}" for o in SUITE_OUTCOMES))
    for suite in sorted(reasons):
        for reason in sorted(reasons[suite]):
            write(f"skipped in {suite}: {reason}")
