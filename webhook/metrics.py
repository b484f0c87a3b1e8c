"""The webhook's Prometheus metrics, registered on one registry per server.

One object holds them so the transport (requests, latency, certificate reloads) and the
admission logic (denials, conversions) count into the same registry without either
knowing the other, and tests read a fresh registry per server.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["WebhookMetrics"]

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
        self.cert_reloads = Counter(
            "gpudra_webhook_certificate_reloads",
            "Serving certificate reload attempts by result.",
            ["result"],
            registry=registry,
        )
