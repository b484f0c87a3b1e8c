"""`gpudra report`: GPU-hours allocated and idle per namespace and tenant.

With `--prometheus URL` it asks Prometheus for the increase of the agents' accounting
counters over `--since`, of the series of the agents' scrape job (`--job`) only;
without, it reads the counters straight from the agents' metrics endpoints, which
count since each agent started (the report says so), less the namespaces nothing has
held a device in for a day (the agent drops those counters): those given with
`--metrics`, else every agent found in the cluster as `gpudra top` finds them
(`gpudra.cli.agents`). The accounting rules (fair split of shared devices, the idle
threshold, how long a counter is kept) are in docs/monitoring.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Final

import anyio
from gpudra.cli import agents
from gpudra.cli.scrape import agent_endpoint, fetch, parse_duration, timeout_seconds
from gpudra.cli.terminal import printable, warn
from prometheus_client.samples import Sample

__all__ = [
    "AGENT_JOB",
    "Usage",
    "register",
    "usage_from_metrics",
    "usage_from_prometheus",
    "usage_query",
]

_ALLOCATED: Final = "gpudra_allocated_device_seconds_total"
_IDLE: Final = "gpudra_idle_device_seconds_total"
# The agent serves a new counter at zero during its first window, for Prometheus's
# increase(), and what it held back beside it: a sum of the counters as they are adds
# both, so a report totals the same in the window as after it.
_SUMMED: Final = {
    _ALLOCATED: _ALLOCATED,
    "gpudra_withheld_allocated_device_seconds": _ALLOCATED,
    _IDLE: _IDLE,
    "gpudra_withheld_idle_device_seconds": _IDLE,
}
# The `job` the chart's PodMonitor gives the agents' series (chart `monitoring.agentJob`).
AGENT_JOB: Final = "gpudra-node"


@dataclass(frozen=True)
class Usage:
    """GPU-hours of one namespace and tenant."""

    namespace: str
    tenant: str
    allocated_hours: float
    idle_hours: float

    @property
    def used_hours(self) -> float:
        return self.allocated_hours - self.idle_hours


def _usage(
    allocated: Mapping[tuple[str, str], float], idle: Mapping[tuple[str, str], float]
) -> list[Usage]:
    return [
        Usage(ns, tenant, seconds / 3600, idle.get((ns, tenant), 0.0) / 3600)
        for (ns, tenant), seconds in sorted(allocated.items())
    ]


def usage_from_metrics(answers: Iterable[Iterable[Sample]]) -> list[Usage]:
    """Sum the agents' counters (since each started) per namespace and tenant."""
    sums: dict[str, dict[tuple[str, str], float]] = {_ALLOCATED: {}, _IDLE: {}}
    for samples in answers:
        for sample in samples:
            if sample.name in _SUMMED:
                key = (sample.labels.get("namespace", ""), sample.labels.get("tenant", ""))
                summed = sums[_SUMMED[sample.name]]
                summed[key] = summed.get(key, 0.0) + sample.value
    return _usage(sums[_ALLOCATED], sums[_IDLE])


def _query(base: str, promql: str, timeout_s: float) -> dict[tuple[str, str], float]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    body = fetch(url, timeout_s, command="report")
    problem = f"gpudra report: {base} is not a Prometheus query API"
    try:
        doc = json.loads(body)
        if doc.get("status") != "success":
            # One line, whatever the error quotes (the end of the command keeps lines).
            raise SystemExit(f"{problem}: {printable(str(doc.get('error') or 'no result'))}")
        return {
            (r["metric"].get("namespace", ""), r["metric"].get("tenant", "")): float(r["value"][1])
            for r in doc["data"]["result"]
        }
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise SystemExit(f"{problem}: {e}") from None


def usage_query(counter: str, since_s: float, job: str = AGENT_JOB) -> str:
    """PromQL for `counter`'s increase over the last `since_s` seconds per namespace
    and tenant, of the series scraped by `job` only: any scraped pod can serve series of
    the same name claiming any namespace and tenant, but not its scrape's `job`
    (docs/security.md)."""
    selector = f"job={json.dumps(job)}"  # a JSON string is a PromQL string
    return f"sum by (namespace, tenant) (increase({counter}{{{selector}}}[{int(since_s)}s]))"


def usage_from_prometheus(
    base: str, since_s: float, timeout_s: float = 10.0, job: str = AGENT_JOB
) -> list[Usage]:
    """Ask Prometheus for the counters' increase over the last `since_s` seconds, of
    the agents scraped by `job`."""
    return _usage(
        _query(base, usage_query(_ALLOCATED, since_s, job), timeout_s),
        _query(base, usage_query(_IDLE, since_s, job), timeout_s),
    )


def _from_agents(args: argparse.Namespace) -> tuple[list[Usage], bool]:
    """The agents' counters summed, and whether a node's are missing: its agent did not
    answer, or two pods claim to be its agent (one line on stderr names each; the
    report is then of the others)."""
    if args.metrics:
        found = agents.Agents(dict(agent_endpoint(raw, command="report") for raw in args.metrics))
    else:
        found = anyio.run(
            lambda: agents.find(
                args.kubeconfig,
                args.agent_namespace,
                args.agent_selector,
                command="report",
                otherwise="--metrics NODE=URL or --prometheus URL",
            )
        )
    answers, failed = agents.scrape(found.urls, args.timeout, _SUMMED.__contains__)
    left_out = {**failed, **found.contested}
    for node, why in sorted(left_out.items()):
        warn("report", f"node {node}: {why}; its counters are left out")
    return usage_from_metrics(answers.values()), bool(left_out)


def run(args: argparse.Namespace) -> int:
    """The report; exit status 1 when an agent did not answer, else 0."""
    try:
        since = parse_duration(args.since)
    except ValueError as e:
        raise SystemExit(f"gpudra report: --since: {e}") from None
    failed = False
    if args.prometheus:
        rows = usage_from_prometheus(args.prometheus, since, args.timeout, args.job)
        span = f"last {args.since}"
    else:
        rows, failed = _from_agents(args)
        span = "since each agent started (give --prometheus for --since)"
    status = 1 if failed else 0
    if args.output == "json":
        doc = [{**asdict(r), "used_hours": r.used_hours} for r in rows]
        sys.stdout.write(json.dumps({"span": span, "usage": doc}, indent=2) + "\n")
        return status
    header = ("NAMESPACE", "TENANT", "GPU-H ALLOCATED", "GPU-H USED", "GPU-H IDLE")
    cells = [
        (
            printable(r.namespace),
            printable(r.tenant or "-"),
            f"{r.allocated_hours:.2f}",
            f"{r.used_hours:.2f}",
            f"{r.idle_hours:.2f}",
        )
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *cells, strict=False)]
    sys.stdout.write(f"GPU-hours, {span}\n")
    for line in (header, *cells):
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        sys.stdout.write("\n")
    return status


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="GPU-hours allocated, used and idle per namespace and tenant",
        description="GPU-hours allocated, used and idle per namespace and tenant: from "
        "Prometheus with --prometheus; else from the node agents' counters (since each "
        "agent started), at the --metrics endpoints given, else at every agent found in "
        "the cluster as `gpudra top` finds them.",
    )
    p.add_argument("--prometheus", default=None, metavar="URL", help="Prometheus to ask")
    p.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="[NODE=]URL",
        help="without --prometheus: a node agent's metrics endpoint, read instead of the "
        "agents found in the cluster; repeatable",
    )
    agents.add_arguments(p)
    p.add_argument("--since", default="24h", metavar="DURATION", help="with --prometheus: span")
    p.add_argument(
        "--job",
        default=AGENT_JOB,
        metavar="JOB",
        help="with --prometheus: the job label of the agents' series, the chart's "
        f"monitoring.agentJob (default: {AGENT_JOB})",
    )
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=10.0,
        help="seconds to wait for each whole answer",
    )
    p.set_defaults(func=run)
