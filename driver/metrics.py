"""Prometheus metrics of the kubelet plugin: claim calls, and the devices prepared.

`ClaimMetrics` counts and times each claim of the kubelet's prepare and unprepare
calls, where the plugin answers them (reading the claim from the API included), so
a claim that fails before it reaches the device layer is counted too.
`PreparedDevices` reports what the checkpoint holds when scraped, `DiscoveryGaps` the
GPU fields discovery had to leave out for lack of privilege.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from gpudra.driver.checkpoint import Checkpoint, ClaimRecord
from gpudra.driver.devices import Inventory
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ClaimMetrics", "DiscoveryGaps", "PreparedDevices"]

_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 10.0)
_OPERATIONS: Final = ("prepare", "unprepare")
_INFO_LABELS: Final = ("namespace", "pod", "claim", "request", "device", "uuid")


class _OpMetrics:
    """The per-claim metrics of one operation."""

    def __init__(
        self, operations: Counter, errors: Counter, latency: Histogram, operation: str
    ) -> None:
        self.operations = operations.labels(operation)
        self.errors = errors.labels(operation)
        self.latency = latency.labels(operation)


class ClaimMetrics:
    """Per-claim counters and latency of the kubelet's calls (a `CallMetrics`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        operations = Counter(
            "gpudra_claim_operations",
            "Claims the kubelet asked to prepare or unprepare.",
            ["operation"],
            registry=registry,
        )
        errors = Counter(
            "gpudra_claim_operation_errors",
            "Claims whose prepare or unprepare failed.",
            ["operation"],
            registry=registry,
        )
        latency = Histogram(
            "gpudra_claim_operation_duration_seconds",
            "Time to prepare or unprepare one claim, including reading it from the API.",
            ["operation"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        # Labelled once (this also exports zeros before the first call): a lookup per
        # claim would cost a lock and a label check each time.
        self._ops = {op: _OpMetrics(operations, errors, latency, op) for op in _OPERATIONS}

    def observe(self, operation: str, seconds: float, *, failed: bool) -> None:
        """One claim of a call to `operation` ("prepare" or "unprepare") was answered."""
        metrics = self._ops[operation]
        metrics.operations.inc()
        if failed:
            metrics.errors.inc()
        metrics.latency.observe(seconds)


class PreparedDevices(Collector):
    """The prepared devices, read from the checkpoint when scraped.

    Kept per claim in labelled children instead, every prepare and unprepare would
    create and drop metric objects; a scrape reads the same state far less often.
    The scrape runs in the metrics server's thread: it only reads the checkpoint's
    claims, which are replaced, never changed in place.
    """

    def __init__(self, prepared: Callable[[], Checkpoint | None], pool: str) -> None:
        self._prepared = prepared
        self._pool = pool

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        cp = self._prepared()
        yield from self._families(cp.claims() if cp is not None else ())

    def _families(self, claims: Iterable[ClaimRecord] = ()) -> tuple[Metric, Metric]:
        info = InfoMetricFamily(
            "gpudra_prepared_device",
            "A device prepared for a claim; pod is the first pod the claim is reserved for.",
            labels=_INFO_LABELS,
        )
        holders: dict[str, set[str]] = {}
        for record in claims:
            if not record.completed:
                continue
            for device in record.devices:
                if device.pool == self._pool:
                    holders.setdefault(device.device, set()).add(record.uid)
                details = device.details
                for request in device.request_names or ("",):
                    labels = (
                        record.namespace,
                        details.pod,
                        record.name,
                        request,
                        device.device,
                        details.uuid or "",
                    )
                    info.add_metric(labels, {})
        per_device = GaugeMetricFamily(
            "gpudra_device_prepared_claims",
            "Prepared claims holding each device (more than one: shared or admin access).",
            labels=("device",),
        )
        for name, uids in sorted(holders.items()):
            per_device.add_metric((name,), len(uids))
        return info, per_device


class DiscoveryGaps(Collector):
    """`gpudra_discovery_gap`: 1 per GPU field NVML refused (NO_PERMISSION), labelled
    with the field, the call and the privilege that is missing, read from the current
    inventory when scraped."""

    def __init__(self, inventory: Callable[[], Inventory | None]) -> None:
        self._inventory = inventory

    def describe(self) -> Iterator[Metric]:
        yield self._family(None)

    def collect(self) -> Iterator[Metric]:
        yield self._family(self._inventory())

    @staticmethod
    def _family(inventory: Inventory | None) -> Metric:
        family = GaugeMetricFamily(
            "gpudra_discovery_gap",
            "A GPU field NVML refused to read for lack of privilege (published without it).",
            labels=("gpu", "field", "call", "privilege"),
        )
        for gpu in inventory.gpus if inventory is not None else ():
            for gap in gpu.gaps:
                family.add_metric((gpu.uuid, gap.field, gap.call, gap.privilege), 1)
        return family
