"""The webhook's Prometheus metrics, registered on one registry per server.

One object holds them so the transport (requests, latency, certificate reloads) and the
admission logic (denials, conversions) count into the same registry without either
knowing the other, and tests read a fresh registry per server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["PodSecurityGaps", "QuotaLeader", "WebhookMetrics"]

_LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "gpudra_webhook_requests",
            "HTTP requests by path and result.",
            ["path", "result"],
            registry=registry,
        )
        self.denials = Counter(
            "gpudra_webhook_denials",
            "Admission denials by reason.",
            ["reason"],
            registry=registry,
        )
        self.conversions = Counter(
            "gpudra_webhook_conversions",
            "Pods converted from device-plugin resources to DRA claims.",
            ["dry_run"],
            registry=registry,
        )
        self.converted_claims = Counter(
            "gpudra_webhook_converted_claims",
            "Pod claims added by conversion, by device kind.",
            ["kind"],
            registry=registry,
        )
        self.latency = Histogram(
            "gpudra_webhook_request_duration_seconds",
            "Time from a complete request head to the response being written.",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.connections_shed = Counter(
            "gpudra_webhook_connections_shed",
            "Connections closed by the server's bounds: 'evicted' (the one waiting "
            "longest, for a new one at the connection bound, or one holding request "
            "bodies behind answers its client does not read, for a new body at the body "
            "budget) or 'refused' (a new one, when every open connection was having a "
            "request answered).",
            ["action"],
            registry=registry,
        )
        self.cert_reloads = Counter(
            "gpudra_webhook_certificate_reloads",
            "Serving certificate reload attempts by result.",
            ["result"],
            registry=registry,
        )
        # Label children, cached: labels() costs more than the increment, and every
        # label set is small (known paths or "other", fixed results and reasons).
        self._children: dict[tuple[Counter, tuple[str, ...]], Any] = {}
        self._latency_children: dict[str, Any] = {}

    def inc(self, counter: Counter, *labels: str) -> None:
        """Add one to `counter` (one of these metrics) for `labels`."""
        child = self._children.get((counter, labels))
        if child is None:
            child = self._children[counter, labels] = counter.labels(*labels)
        child.inc()

    def observe_request(self, path: str, result: str, seconds: float) -> None:
        """Count one answered request and its time from head to answer."""
        self.inc(self.requests, path, result)
        histogram = self._latency_children.get(path)
        if histogram is None:
            histogram = self._latency_children[path] = self.latency.labels(path)
        histogram.observe(seconds)


class PodSecurityGaps(Collector):
    """``gpudra_webhook_tenant_namespace_without_pod_security``: 1 for each tenant
    namespace whose Pod Security level lets pods be privileged (and so reach every GPU
    of their node without a claim), read from the tenant state at each scrape so that a
    namespace labelled since is gone from the next one."""

    NAME: Final = "gpudra_webhook_tenant_namespace_without_pod_security"

    def __init__(self, namespaces: Callable[[], Mapping[str, tuple[str, ...]]]) -> None:
        self._namespaces = namespaces

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            self.NAME,
            "Tenant namespaces without Pod Security baseline or restricted enforced: a "
            "privileged pod there gets its node's GPUs without a claim (docs/security.md).",
            labels=["namespace", "tenant"],
        )

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for namespace, tenants in self._namespaces().items():
            family.add_metric([namespace, ",".join(tenants)], 1)
        yield family


class QuotaLeader(Collector):
    """``gpudra_webhook_quota_leader``: 1 on the replica that writes the tenants'
    ResourceQuotas (it holds the lease), 0 on the others; read at each scrape, so a
    replica past its renew deadline shows 0 at once. Summed over the replicas it is 1
    while quotas are kept, and 0 during a handover or while no replica can renew."""

    NAME: Final = "gpudra_webhook_quota_leader"

    def __init__(self, leading: Callable[[], bool]) -> None:
        self._leading = leading

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            self.NAME,
            "1 where this webhook replica leads, and so writes, the tenants' ResourceQuotas "
            "(it holds the leader election Lease); 0 where it only follows.",
        )

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        family.add_metric([], 1 if self._leading() else 0)
        yield family
