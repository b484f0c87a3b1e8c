"""`gpudra report`: GPU-hours from the agents' counters, or from Prometheus's query API
(a stand-in server answering as Prometheus does)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import anyio
import pytest
from gpudra.common.metricsserver import serve_metrics
from gpudra.driver.accounting import DEFAULT_ZERO_WINDOW_S
from prometheus_client import generate_latest

from tests.cli.stubs import gpudra, http_server, serving
from tests.driver.test_device_metrics import (
    HOUR,
    Node,
    claim,
    emulator,
    inventory_of,
    only,
    scrape,
    seven_1g_tenants,
    values,
)


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return gpudra("report", *args)


def test_from_the_agents_counters(endpoint: str) -> None:
    done = report("--metrics", endpoint, "-o", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert "since each agent started" in doc["span"]
    [team] = doc["usage"]
    assert team["namespace"] == "team-a"
    assert team["allocated_hours"] == pytest.approx(1200 / 3600)
    assert team["idle_hours"] == pytest.approx(1200 / 3600)
    assert team["used_hours"] == pytest.approx(0)


def test_seven_1g_mig_tenants_of_one_gpu_are_a_seventh_of_a_gpu_hour_each() -> None:
    """The report's GPU-hours are whole GPUs: an H100 in seven 1g instances, each a
    namespace's for an hour, is one GPU-hour in all, a seventh each."""
    node = anyio.run(seven_1g_tenants)
    with http_server(serving(generate_latest(node.registry))) as port:
        done = report("--metrics", f"node-a=http://127.0.0.1:{port}/metrics", "-o", "json")
    assert done.returncode == 0, done.stderr
    usage = json.loads(done.stdout)["usage"]
    hours = {u["namespace"]: u["allocated_hours"] for u in usage}
    assert hours == {f"team-{i}": pytest.approx(1 / 7) for i in range(7)}
    assert sum(hours.values()) == pytest.approx(1.0)


def test_a_counters_first_scrape_is_counted_with_what_the_agent_withheld() -> None:
    """An agent serves a new counter at zero in its first scrape (for Prometheus's
    increase()) and what it held back beside it: the report adds both, so a namespace
    nobody has scraped yet still has its hours."""

    async def held_idle_for_an_hour() -> Node:
        node = Node(emulator("l4", {"utilization": 1}), interval_s=HOUR)
        uuid = inventory_of(node.nvml).gpus[0].uuid
        node.claims = [claim("u1", "team-a", "a", "gpu-0", uuid)]
        await node.sampler.sample_once()
        node.clock.now += HOUR
        await node.sampler.sample_once()
        return node

    first = generate_latest(anyio.run(held_idle_for_an_hour).registry)
    labels = b'{device_class="",namespace="team-a",sharing="Exclusive",tenant=""}'
    assert b"gpudra_allocated_device_seconds_total" + labels + b" 0.0\n" in first
    assert b"gpudra_withheld_allocated_device_seconds" + labels + b" 3600.0\n" in first
    with http_server(serving(first)) as port:
        done = report("--metrics", f"node-a=http://127.0.0.1:{port}/metrics", "-o", "json")
    assert done.returncode == 0, done.stderr
    [team] = json.loads(done.stdout)["usage"]
    assert (team["namespace"], team["allocated_hours"], team["idle_hours"]) == (
        "team-a",
        pytest.approx(1.0),
        pytest.approx(1.0),
    )


def test_a_report_in_a_counters_zero_window_totals_what_it_does_after_it() -> None:
    """For a window from a new counter's first scrape the agent serves it at zero to
    every reader, what it counted in the withheld gauges: a report read from the agent
    at any time in the window totals the same as one read after it."""
    window = DEFAULT_ZERO_WINDOW_S

    async def held_idle_then_released() -> Node:
        node = Node(emulator("l4", {"utilization": 1}), interval_s=30)
        uuid = inventory_of(node.nvml).gpus[0].uuid
        node.claims = [claim("u1", "team-a", "a", "gpu-0", uuid)]
        await node.sampler.sample_once()
        node.clock.now += 30
        await node.sampler.sample_once()
        node.claims = []  # released: nothing more billed from here on
        return node

    node = anyio.run(held_idle_then_released)
    first_scrape = node.clock.now

    def hours_reported() -> tuple[float, float]:
        done = report("--metrics", f"node-a={url}", "-o", "json")
        assert done.returncode == 0, done.stderr
        [team] = json.loads(done.stdout)["usage"]
        assert team["namespace"] == "team-a"
        return team["allocated_hours"], team["idle_hours"]

    server, thread = serve_metrics("127.0.0.1", 0, node.registry)  # as the agent serves
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        reports: dict[float, tuple[float, float]] = {}
        for after_s in (0, window / 2, window - 1, window):
            node.clock.now = first_scrape + after_s
            anyio.run(node.sampler.sample_once)
            if after_s < window:  # served at zero to every reader, withheld beside it
                served = scrape(url)  # another reader
                assert only(served, "gpudra_allocated_device_seconds_total") == 0
                assert only(served, "gpudra_withheld_allocated_device_seconds") == 30
            reports[after_s] = hours_reported()
        served = scrape(url)
        assert only(served, "gpudra_allocated_device_seconds_total") == 30
        assert values(served, "gpudra_withheld_allocated_device_seconds") == []
    finally:
        server.shutdown()
        thread.join()
    assert set(reports.values()) == {(30 / 3600, 30 / 3600)}


class PrometheusServer(HTTPServer):
    """Answers /api/v1/query as Prometheus does, and keeps the queries asked."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Prometheus)
        self.queries: list[str] = []


class Prometheus(BaseHTTPRequestHandler):
    server: PrometheusServer

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
        self.server.queries.append(query)
        value = "7200" if "allocated" in query else "1800"
        body = {
            "status": "success",
            "data": {
                "resultType": "vector",
                "result": [
                    {"metric": {"namespace": "team-a", "tenant": "research"}, "value": [0, value]}
                ],
            },
        }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[PrometheusServer]:
    server = PrometheusServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()


def test_from_prometheus_over_the_span(prometheus: PrometheusServer) -> None:
    url = f"http://127.0.0.1:{prometheus.server_port}"
    done = report("--prometheus", url, "--since", "24h")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "GPU-hours, last 24h"
    assert lines[2].split() == ["team-a", "research", "2.00", "1.50", "0.50"]
    # The agents' series only, by the job the chart's PodMonitor gives them: any scraped
    # pod can serve series of these names claiming any namespace and tenant.
    assert prometheus.queries == [
        f'sum by (namespace, tenant) (increase({counter}{{job="gpudra-node"}}[86400s]))'
        for counter in ("gpudra_allocated_device_seconds_total", "gpudra_idle_device_seconds_total")
    ]


def test_from_prometheus_of_the_agents_scraped_by_another_job(
    prometheus: PrometheusServer,
) -> None:
    url = f"http://127.0.0.1:{prometheus.server_port}"
    done = report("--prometheus", url, "--since", "1h", "--job", 'gpu/"agents"')
    assert done.returncode == 0, done.stderr
    assert [q.split("{")[1].split("}")[0] for q in prometheus.queries] == [
        'job="gpu/\\"agents\\""'
    ] * 2


def test_a_prometheus_that_does_not_answer_is_one_line_and_a_failure() -> None:
    done = report("--prometheus", "http://127.0.0.1:9", "--timeout", "2")
    assert done.returncode != 0
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("gpudra report: http://127.0.0.1:9/api/v1/query?")
    assert "did not answer" in line


def test_no_cluster_to_find_the_agents_in_says_what_to_give(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}  # and not in a pod
    env["HOME"] = str(tmp_path)  # no ~/.kube/config either
    done = gpudra("report", env=env)
    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: no cluster to read")
    assert "give --kubeconfig, or --metrics NODE=URL or --prometheus URL" in line


def test_an_agent_that_does_not_answer_is_one_line_naming_it_and_a_failure(
    endpoint: str,
) -> None:
    done = report("--metrics", endpoint, "--metrics", "node-b=http://127.0.0.1:9/metrics")
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: node node-b: http://127.0.0.1:9/metrics did not")
    assert "team-a" in done.stdout  # the agents that answered are still reported
