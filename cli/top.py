"""`gpudra top`: every GPU the driver publishes, who holds it, and how busy it is.

The rows come from the API server (ResourceSlices and the allocations in
ResourceClaims, read as `gpudra devices` reads them), so a device shows even where
its agent is down; each node's agent metrics endpoint, found from the agent pods,
adds utilization, memory and idle time (the device series of
`gpudra.driver.metrics`: exactly what Prometheus would scrape, without needing a
Prometheus). One row per device: node, device, model, state (free, held by
namespace/pod, shared by k pods, tainted), utilization, memory, and how long an
allocated device has been idle.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Final, TextIO

import aiohttp
import anyio
from gpudra.api.deviceclasses import DEFAULT_DRIVER
from gpudra.cli import agents, cluster
from gpudra.cli import devices as published
from gpudra.cli.scrape import agent_endpoint, parse_duration, timeout_seconds
from gpudra.cli.terminal import printable, warn
from gpudra.common.kube import ApiError
from prometheus_client.samples import Sample

__all__ = [
    "DeviceRow",
    "measured",
    "merge",
    "register",
    "rows_from_devices",
    "rows_from_metrics",
]

_SORT_KEYS: Final = ("node", "utilization", "memory", "idle")
_RED: Final = "\033[31m"
_YELLOW: Final = "\033[33m"
_RESET: Final = "\033[0m"


@dataclass
class DeviceRow:
    """One device as `gpudra top` shows it."""

    node: str
    device: str
    uuid: str
    model: str
    holders: list[str] = field(default_factory=list)  # namespace/pod
    namespaces: list[str] = field(default_factory=list)
    healthy: bool = True
    taints: list[str] = field(default_factory=list)  # key:effect, from the slice
    utilization: float | None = None  # None: NVML gives none for this device
    memory_used: float | None = None
    memory_total: float | None = None
    idle_seconds: float | None = None

    @property
    def state(self) -> str:
        if not self.healthy or self.taints:
            return "tainted"
        if not self.holders:
            return "free"
        if len(self.holders) == 1:
            return f"held by {self.holders[0]}"
        return f"shared by {len(self.holders)} pods"


def measured(name: str) -> bool:
    """Whether `top` reads the series `name` from an agent: the device series."""
    return name == "gpudra_device_idle_seconds" or name.startswith("gpudra_gpu_")


def rows_from_metrics(node: str, samples: Iterable[Sample]) -> list[DeviceRow]:
    """The devices of one agent's samples (of the `measured` series)."""
    rows: dict[str, DeviceRow] = {}

    def row(labels: dict[str, str]) -> DeviceRow:
        found = rows.get(labels["uuid"])
        if found is None:
            found = rows[labels["uuid"]] = DeviceRow(
                node, labels["device"], labels["uuid"], labels.get("model", "")
            )
        return found

    for sample in samples:
        labels = sample.labels
        if "uuid" not in labels or "device" not in labels:
            continue
        if sample.name == "gpudra_device_idle_seconds":
            current = row(labels).idle_seconds or 0.0
            row(labels).idle_seconds = max(current, sample.value)
            continue
        if not sample.name.startswith("gpudra_gpu_") or "utilization_scope" not in labels:
            continue
        device = row(labels)
        holder = f"{labels.get('namespace', '')}/{labels.get('pod', '')}"
        if labels.get("namespace") and holder not in device.holders:
            device.holders.append(holder)
            if labels["namespace"] not in device.namespaces:
                device.namespaces.append(labels["namespace"])
        if sample.name == "gpudra_gpu_utilization_percent":
            device.utilization = sample.value
        elif sample.name == "gpudra_gpu_memory_used_bytes":
            device.memory_used = sample.value
        elif sample.name == "gpudra_gpu_memory_total_bytes":
            device.memory_total = sample.value
        elif sample.name == "gpudra_gpu_healthy":
            device.healthy = sample.value > 0
    return sorted(rows.values(), key=lambda r: r.device)


def rows_from_devices(found: Iterable[published.Device]) -> list[DeviceRow]:
    """The published devices with their holders: the pods a claim is reserved for, or
    the claim itself while no pod has it yet."""
    rows = []
    for d in found:
        row = DeviceRow(d.node, d.name, "", d.model, taints=list(d.taints))
        for holder in d.holders:
            namespace, _, claim = holder.claim.partition("/")
            for pod in holder.pods or (f"claim {claim}",):
                if f"{namespace}/{pod}" not in row.holders:
                    row.holders.append(f"{namespace}/{pod}")
            if namespace not in row.namespaces:
                row.namespaces.append(namespace)
        rows.append(row)
    return rows


def merge(api: Sequence[DeviceRow], measured: Iterable[DeviceRow]) -> list[DeviceRow]:
    """The API's rows with each device's measurements from its node's agent.

    Who holds a device and its taints come from the API server, which decides them;
    the agent adds what only it knows (UUID, utilization, memory, idle time, health).
    A device only an agent reports (given by URL, or not yet published) keeps its row."""
    rows = {(r.node, r.device): r for r in api}
    extra = []
    for m in measured:
        row = rows.get((m.node, m.device))
        if row is None:
            extra.append(m)
            continue
        row.uuid = row.uuid or m.uuid
        row.model = row.model or m.model
        row.healthy = row.healthy and m.healthy
        row.utilization = m.utilization
        row.memory_used, row.memory_total = m.memory_used, m.memory_total
        row.idle_seconds = m.idle_seconds
    return [*rows.values(), *extra]


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024**3:.1f}"


def _for(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _table(rows: Sequence[DeviceRow], out: TextIO, *, colour: bool) -> None:
    header = ("NODE", "DEVICE", "MODEL", "STATE", "UTIL%", "MEM GiB", "IDLE FOR")
    cells = [
        [
            printable(cell)  # the model and the holders are what an agent or tenant wrote
            for cell in (
                r.node,
                r.device,
                r.model,
                r.state,
                "n/a" if r.utilization is None else f"{r.utilization:.0f}",
                f"{_gib(r.memory_used)}/{_gib(r.memory_total)}",
                _for(r.idle_seconds),
            )
        ]
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *cells, strict=False)]
    out.write("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip() + "\n")
    for r, line in zip(rows, cells, strict=True):
        text = "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        if colour and r.state == "tainted":
            text = f"{_RED}{text}{_RESET}"
        elif colour and r.idle_seconds is not None:
            text = f"{_YELLOW}{text}{_RESET}"
        out.write(text + "\n")


def _select(rows: Iterable[DeviceRow], args: argparse.Namespace) -> list[DeviceRow]:
    idle = parse_duration(args.idle) if args.idle else None
    chosen = [
        r
        for r in rows
        if (not args.namespace or args.namespace in r.namespaces)
        and (not args.node or r.node == args.node)
        and (idle is None or (r.idle_seconds is not None and r.idle_seconds >= idle))
    ]
    keys = {
        "node": lambda r: (r.node, r.device),
        "utilization": lambda r: -(r.utilization if r.utilization is not None else -1),
        "memory": lambda r: -(r.memory_used or 0),
        "idle": lambda r: -(r.idle_seconds or 0),
    }
    return sorted(chosen, key=keys[args.sort])


def run(args: argparse.Namespace) -> int:
    """The table; exit status 1 when an agent did not answer or two pods claim to be
    one node's agent (the node's devices are still shown, without measurements), else 0."""
    if args.idle:
        try:
            parse_duration(args.idle)
        except ValueError as e:
            raise SystemExit(f"gpudra top: --idle: {e}") from None
    overrides = dict(agent_endpoint(raw, command="top") for raw in args.metrics or ())
    api: list[DeviceRow] = []
    found = agents.Agents()
    if args.no_api:
        if not overrides:
            raise SystemExit("gpudra top: --no-api needs --metrics NODE=URL (repeatable)")
    else:
        api, found = anyio.run(_from_cluster, args)
    endpoints = {**found.urls, **overrides}
    wanted = {n: u for n, u in endpoints.items() if not args.node or n == args.node}
    answers, failed = agents.scrape(wanted, args.timeout, measured)
    rows = [row for node, samples in answers.items() for row in rows_from_metrics(node, samples)]
    for node, why in failed.items():
        warn("top", f"node {node}: {why}; its devices show no measurements")
    contested = {
        node: why
        for node, why in found.contested.items()
        if node not in overrides and (not args.node or node == args.node)
    }
    for node, why in sorted(contested.items()):
        warn("top", f"node {node}: {why}, or give --metrics {node}=URL")
    for node in sorted({r.node for r in api} - endpoints.keys() - contested.keys()):
        warn(
            "top",
            f"node {node}: no agent metrics endpoint "
            f"({agents.looked_for(args.agent_namespace, args.agent_selector)}); "
            f"give --metrics {node}=URL",
        )
    selected = _select(merge(api, rows), args)
    if args.output == "json":
        doc = [{**asdict(r), "state": r.state} for r in selected]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _table(selected, sys.stdout, colour=sys.stdout.isatty())
    return 1 if failed or contested else 0


async def _from_cluster(args: argparse.Namespace) -> tuple[list[DeviceRow], agents.Agents]:
    """The published devices with their holders, and the nodes' agents."""
    kube = await cluster.connect(
        args.kubeconfig, command="top", otherwise="--no-api with --metrics NODE=URL"
    )
    try:
        found = await published.read(kube, args.driver_name, args.node or "")
        try:
            located = await agents.read(kube, args.agent_namespace, args.agent_selector)
        except ApiError as e:
            warn("top", f"cannot list the agent pods ({e}); give --metrics NODE=URL")
            located = agents.Agents()
    except (ApiError, aiohttp.ClientError, OSError) as e:
        raise SystemExit(f"gpudra top: reading the cluster failed: {e}") from None
    finally:
        await kube.close()
    return rows_from_devices(found), located


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top", help="show every published GPU: holder, utilization, memory, idle time"
    )
    agents.add_arguments(p)
    p.add_argument("--driver-name", default=DEFAULT_DRIVER, help="the DRA driver name")
    p.add_argument(
        "--metrics",
        action="append",
        default=None,
        metavar="[NODE=]URL",
        help="a node agent's metrics endpoint, e.g. http://10.0.0.5:9477/metrics, used "
        "instead of the one found for NODE; repeatable (NODE default: the URL's host)",
    )
    p.add_argument(
        "--no-api",
        action="store_true",
        help="read only the --metrics endpoints, not the cluster (holders as the agents know them)",
    )
    p.add_argument("--namespace", "-n", default=None, help="only devices held in this namespace")
    p.add_argument("--node", default=None, help="only this node's devices")
    p.add_argument(
        "--idle",
        default=None,
        metavar="DURATION",
        help="only allocated devices idle at least this long, e.g. 30m",
    )
    p.add_argument("--sort", choices=_SORT_KEYS, default="node", help="row order")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=5.0,
        help="seconds to wait for each agent's whole answer",
    )
    p.set_defaults(func=run)
