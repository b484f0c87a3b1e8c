"""`gpudra top`: every GPU the node agents serve, who holds it, and how busy it is.

Reads the agents' metrics endpoints (the device series of `gpudra.driver.metrics`),
so it shows exactly what Prometheus would scrape, without needing a Prometheus. One
row per device: node, device, model, state (free, held by namespace/pod, shared by k
pods, tainted), utilization, memory, and how long an allocated device has been idle.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Final, TextIO

from gpudra.cli.scrape import agent_endpoint, fetch, parse_duration
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["DeviceRow", "register", "rows_from_metrics"]

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
    utilization: float | None = None  # None: NVML gives none for this device
    memory_used: float | None = None
    memory_total: float | None = None
    idle_seconds: float | None = None

    @property
    def state(self) -> str:
        if not self.healthy:
            return "tainted"
        if not self.holders:
            return "free"
        if len(self.holders) == 1:
            return f"held by {self.holders[0]}"
        return f"shared by {len(self.holders)} pods"


def rows_from_metrics(node: str, text: str) -> list[DeviceRow]:
    """The devices of one agent's metrics text."""
    rows: dict[str, DeviceRow] = {}

    def row(labels: dict[str, str]) -> DeviceRow:
        found = rows.get(labels["uuid"])
        if found is None:
            found = rows[labels["uuid"]] = DeviceRow(
                node, labels["device"], labels["uuid"], labels.get("model", "")
            )
        return found

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
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
        (
            r.node,
            r.device,
            r.model,
            r.state,
            "n/a" if r.utilization is None else f"{r.utilization:.0f}",
            f"{_gib(r.memory_used)}/{_gib(r.memory_total)}",
            _for(r.idle_seconds),
        )
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
    if args.idle:
        try:
            parse_duration(args.idle)
        except ValueError as e:
            raise SystemExit(f"gpudra top: --idle: {e}") from None
    rows: list[DeviceRow] = []
    for raw in args.metrics:
        node, url = agent_endpoint(raw, command="top")
        rows += rows_from_metrics(node, fetch(url, args.timeout, command="top"))
    selected = _select(rows, args)
    if args.output == "json":
        doc = [{**asdict(r), "state": r.state} for r in selected]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _table(selected, sys.stdout, colour=sys.stdout.isatty())
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top", help="show every GPU the node agents serve: holder, utilization, memory, idle"
    )
    p.add_argument(
        "--metrics",
        action="append",
        required=True,
        metavar="[NODE=]URL",
        help="a node agent's metrics endpoint, e.g. http://10.0.0.5:9477/metrics; repeatable "
        "(NODE names its rows, default: the URL's host)",
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
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each agent")
    p.set_defaults(func=run)
