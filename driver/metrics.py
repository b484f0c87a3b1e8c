"""Prometheus metrics of the kubelet plugin: claim calls, and the devices prepared.

`ClaimMetrics` counts and times each claim of the kubelet's prepare and unprepare
calls, where the plugin answers them (reading the claim from the API included), so
a claim that fails before it reaches the device layer is counted too.
`PreparedDevices` reports what the checkpoint holds when scraped, `DiscoveryGaps` the
GPU fields discovery had to leave out for lack of privilege.
`DeviceMetrics` exports the sampler's latest readings of every device, labelled with
its holders, the accounting counters, and the devices' health and XID counts.

Every family has one series per label set: Prometheus drops the samples of a scrape
that repeats one, so rows that would repeat (one claim holding two slices of a GPU for
one request) are one row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from gpudra.driver.accounting import Accounting, holding, stale_after
from gpudra.driver.checkpoint import Checkpoint, ClaimRecord
from gpudra.driver.devices import Inventory
from gpudra.driver.holders import Holder
from gpudra.driver.sampling import Reading, SampledDevice, Sampler
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "DEVICE_LABELS",
    "HOLDER_LABELS",
    "ClaimMetrics",
    "DeviceMetrics",
    "DiscoveryGaps",
    "PreparedDevices",
]

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
        rows: dict[tuple[str, ...], None] = {}  # one per label set, in order
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
                    rows[labels] = None
        for row in rows:
            info.add_metric(row, {})
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


DEVICE_LABELS: Final = ("device", "uuid", "gpu_uuid", "mig_uuid", "model", "utilization_scope")
HOLDER_LABELS: Final = ("namespace", "pod", "container", "claim", "request", "tenant", "sharing")
_ACCOUNT_LABELS: Final = ("namespace", "tenant", "device_class", "sharing")
# Reading value -> (metric name, help).
_GAUGES: Final = (
    (
        "utilization",
        "gpudra_gpu_utilization_percent",
        "Utilization, percent: of the time a kernel ran, for a GPU; of the instance's SMs "
        "that were busy, for a MIG device (GPM).",
    ),
    (
        "memory_utilization",
        "gpudra_gpu_memory_utilization_percent",
        "Memory bandwidth utilization, percent.",
    ),
    ("memory_used", "gpudra_gpu_memory_used_bytes", "Device memory in use, bytes."),
    ("memory_total", "gpudra_gpu_memory_total_bytes", "Device memory, bytes."),
    ("temperature", "gpudra_gpu_temperature_celsius", "GPU temperature, degrees Celsius."),
    ("power", "gpudra_gpu_power_watts", "Power draw, watts."),
    ("sm_clock", "gpudra_gpu_sm_clock_mhz", "SM clock, MHz."),
)
_ECC: Final = (("ecc_corrected", "corrected"), ("ecc_uncorrected", "uncorrected"))
_NO_HOLDER: Final = ("",) * len(HOLDER_LABELS)


def _holder_labels(holder: Holder) -> tuple[str, ...]:
    return (
        holder.namespace,
        holder.pod,
        holder.container,
        holder.claim,
        holder.request,
        holder.tenant,
        holder.sharing,
    )


def _scope(device: SampledDevice, reading: Reading) -> str:
    """What the utilization of a device measures: itself, or nothing it can tell."""
    if "utilization" not in reading.values:
        return "unavailable"
    return "mig_instance" if device.mig else "device"


class DeviceMetrics(Collector):
    """Device series from the sampler's latest pass, with accounting and health.

    Each device series carries `DEVICE_LABELS` and, once per holder (`holding`) while
    the device is allocated, `HOLDER_LABELS` (empty when nobody holds it): a shared device
    has one series per holder with the device's value, so aggregate devices with
    `max by (uuid)`, not `sum`. An admin-access claim (monitoring) holds nothing, so it
    labels no series: a device only it has is free, and never idle or under-used for
    anybody (its claims are in `gpudra_prepared_device`). A MIG device whose
    utilization NVML does not give has `utilization_scope="unavailable"` and no
    utilization series, never its GPU's. Every value NVML refused is in
    `gpudra_gpu_metric_unavailable` with the reason.

    `gpudra_sample_age_seconds` says how old the latest pass is. Once it is older than
    `gpudra_sample_stale_after_seconds` (`stale_after`: a pass hung in NVML or failing
    again and again), the device series and the idle gauge are left out: a dashboard or
    alert sees them absent rather than the last values frozen. Runs in the metrics
    server's thread: it reads only the sampler's latest sample (replaced whole, health
    included), its clock, interval and holding log's drop count (an int), and the
    accounting's copies.
    """

    def __init__(self, sampler: Sampler, accounting: Accounting) -> None:
        self._sampler = sampler
        self._accounting = accounting
        self._since = sampler.clock()  # the age before the first pass ends

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on what was sampled

    def collect(self) -> Iterator[Metric]:
        latest = self._sampler.latest
        now = self._sampler.clock()
        age = now - (latest.at if latest is not None else self._since)
        bound = stale_after(self._sampler.interval_s)
        fresh = age <= bound
        sample = latest if fresh else None
        yield from self._freshness(age, bound)
        labels = (*DEVICE_LABELS, *HOLDER_LABELS)
        gauges = {key: GaugeMetricFamily(name, doc, labels=labels) for key, name, doc in _GAUGES}
        ecc = CounterMetricFamily(
            "gpudra_gpu_ecc_errors",
            "ECC errors since the driver loaded (NVML volatile counts).",
            labels=(*labels, "type"),
        )
        healthy = GaugeMetricFamily(
            "gpudra_gpu_healthy",
            "1 while the device has no NoSchedule or NoExecute health taint.",
            labels=labels,
        )
        unavailable = GaugeMetricFamily(
            "gpudra_gpu_metric_unavailable",
            "A value NVML did not give for a device, and why (NVML error).",
            labels=("device", "uuid", "metric", "reason"),
        )
        for device, reading in sample.devices if sample is not None else ():
            held = sample.held.get(device.name) if sample is not None else None
            if held is not None and device.mig and held.uuid != device.uuid:
                held = None  # another MIG device of the same placement name
            base = (
                device.name,
                device.uuid,
                device.gpu_uuid,
                device.uuid if device.mig else "",
                device.model,
                _scope(device, reading),
            )
            holders = holding(held).values() if held is not None else ()
            rows = list(dict.fromkeys((*base, *_holder_labels(h)) for h in holders))
            rows = rows or [(*base, *_NO_HOLDER)]
            healthy_now = sample.healthy.get(device.name) if sample is not None else None
            for row in rows:
                for key, gauge in gauges.items():
                    if key in reading.values:
                        gauge.add_metric(row, reading.values[key])
                for key, kind in _ECC:
                    if key in reading.values:
                        ecc.add_metric((*row, kind), reading.values[key])
                if healthy_now is not None:
                    healthy.add_metric(row, 1.0 if healthy_now else 0.0)
            for metric, reason in sorted(reading.missing.items()):
                unavailable.add_metric((device.name, device.uuid, metric, reason), 1.0)
        yield from gauges.values()
        yield from (ecc, healthy, unavailable)
        xids = CounterMetricFamily(
            "gpudra_gpu_xid_errors",
            "XID events each GPU raised since the agent started.",
            labels=("gpu_uuid", "xid"),
        )
        for (uuid, xid), count in sorted((sample.xids if sample is not None else {}).items()):
            xids.add_metric((uuid, str(xid)), count)
        yield xids
        yield from self._accounts(fresh=fresh, now=now)

    @staticmethod
    def _freshness(age: float, bound: float) -> Iterator[Metric]:
        age_family = GaugeMetricFamily(
            "gpudra_sample_age_seconds",
            "Seconds since the last completed sampling pass (before the first: since the "
            "agent started sampling).",
        )
        age_family.add_metric((), max(age, 0.0))
        bound_family = GaugeMetricFamily(
            "gpudra_sample_stale_after_seconds",
            "Sample age beyond which the device series are left out (three sampling intervals).",
        )
        bound_family.add_metric((), bound)
        yield from (age_family, bound_family)

    def _accounts(self, *, fresh: bool, now: float) -> Iterator[Metric]:
        allocated = CounterMetricFamily(
            "gpudra_allocated_device_seconds",
            "GPU-seconds allocated to claims (a whole GPU for a second is one; a MIG device "
            "its compute slices' part of its GPU), shared devices split among their holders.",
            labels=_ACCOUNT_LABELS,
        )
        idle = CounterMetricFamily(
            "gpudra_idle_device_seconds",
            "Allocated GPU-seconds while the device's utilization was under the idle threshold.",
            labels=_ACCOUNT_LABELS,
        )
        withheld = GaugeMetricFamily(
            "gpudra_withheld_allocated_device_seconds",
            "GPU-seconds of an allocated counter served at zero during its first window, "
            "so that increase() counts them; the counter has them once the window ends.",
            labels=_ACCOUNT_LABELS,
        )
        withheld_idle = GaugeMetricFamily(
            "gpudra_withheld_idle_device_seconds",
            "GPU-seconds of an idle counter served at zero during its first window, as above.",
            labels=_ACCOUNT_LABELS,
        )
        for key, served in sorted(self._accounting.serve(now).items()):
            row = (key.namespace, key.tenant, key.device_class, key.sharing)
            allocated.add_metric(row, served.allocated)
            idle.add_metric(row, served.idle)
            if served.withheld_allocated:  # a series' first window
                withheld.add_metric(row, served.withheld_allocated)
                withheld_idle.add_metric(row, served.withheld_idle)
        idle_for = GaugeMetricFamily(
            "gpudra_device_idle_seconds",
            "How long each allocated device has been under the idle threshold.",
            labels=("device", "uuid", *HOLDER_LABELS),
        )
        idle_rows: dict[tuple[str, ...], float] = {}
        for device in self._accounting.idle_devices() if fresh else ():
            for holder in device.holders:  # the longest idle first, if labels repeat
                idle_rows.setdefault(
                    (device.device, device.uuid, *_holder_labels(holder)), device.seconds
                )
        for idle_row, seconds in idle_rows.items():
            idle_for.add_metric(idle_row, seconds)
        threshold = GaugeMetricFamily(
            "gpudra_idle_threshold_percent",
            "Utilization under which an allocated device counts as idle.",
        )
        threshold.add_metric((), self._accounting.idle_below)
        dropped = CounterMetricFamily(
            "gpudra_holding_changes_dropped",
            "Claim prepares and unprepares whose times accounting lost, the sampler being "
            "too late to take them (their claims' time is not billed).",
        )
        dropped.add_metric((), self._sampler.holdings.dropped)
        yield from (allocated, idle, withheld, withheld_idle, idle_for, threshold, dropped)
