"""Runs the pinned promtool and prometheus (built by build-prometheus.sh, cached) for the
tests: the chart's alert rules under `promtool test rules`, and a real Prometheus that
scrapes the node agent and the webhook end to end.

Why the real binaries: PromQL, rule evaluation, `for:` holds and alert templating behave
exactly as in a user's Prometheus; a hand-written checker would only test itself.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.processes import free_port, spawn_logged, stop_pid
from e2e.progress import BuildFailed, build_script

BUILD_SCRIPT = Path(__file__).resolve().parent / "build-prometheus.sh"


class PrometheusUnavailable(Exception):
    """prometheus/promtool could not be built (no Go toolchain, proxy unreachable)."""


class PromtoolFailed(Exception):
    """promtool ran and exited non-zero; the message is its output."""


def bin_dir() -> Path:
    """The cached folder holding `prometheus` and `promtool`, built on first use."""
    try:
        return build_script(BUILD_SCRIPT, prefix="build-prometheus", what="building prometheus")
    except BuildFailed as e:
        raise PrometheusUnavailable(f"build-prometheus: {e}") from e


def promtool(bin_path: Path, *args: str, cwd: Path | None = None, timeout: float = 120) -> str:
    """Runs promtool; its combined output, or PromtoolFailed with it."""
    proc = subprocess.run(
        [str(bin_path / "promtool"), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=timeout,
    )
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise PromtoolFailed(out)
    return out


def rule_groups(prometheus_rule: Mapping[str, Any]) -> dict[str, Any]:
    """A Prometheus rules file of a PrometheusRule object: what the Operator hands
    Prometheus (its `spec`)."""
    return {"groups": list(prometheus_rule["spec"]["groups"])}


def write_yaml(path: Path, doc: object) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def series(name: str, labels: Mapping[str, str]) -> str:
    """A series in promtool's input notation: `name{a="x",b="y"}`."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def recording_rules(exprs: Sequence[str]) -> dict[str, Any]:
    """A rules file with each expression as a recording rule, so `promtool check rules`
    parses every one with Prometheus's own PromQL parser."""
    return {
        "groups": [
            {
                "name": "parse",
                "rules": [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }


@dataclass(frozen=True)
class Server:
    """A running Prometheus: its HTTP API, and its log for failure messages."""

    url: str
    log: Path

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def alerts(self) -> list[dict[str, Any]]:
        """Every pending and firing alert, each with `labels`, `annotations`, `state`."""
        alerts: list[dict[str, Any]] = self.get("/api/v1/alerts")["alerts"]
        return alerts

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's samples, each with its `metric` labels and `value`."""
        data = self.get(f"/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
        samples: list[dict[str, Any]] = data["result"]
        return samples

    def targets_up(self) -> bool:
        active = self.get("/api/v1/targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def pod_monitor(objects: Sequence[Mapping[str, Any]], component: str) -> dict[str, Any]:
    """The rendered PodMonitor of the chart's pods of `component` (`node`, `webhook`)."""
    (monitor,) = [
        o
        for o in objects
        if o["kind"] == "PodMonitor"
        and o["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == component
    ]
    return dict(monitor)


# What Kubernetes discovery gives the metadata labels the chart's relabelings read
# (static stand-ins: the targets here are not discovered).
_POD_META = {"__meta_kubernetes_pod_node_name": "gpu-node"}
# The fields of an endpoint's tlsConfig that `operator_scrape` reproduces; any other (a
# client certificate) would be left out silently.
_TLS_FIELDS = {"ca", "serverName", "insecureSkipVerify"}


def operator_scrape(
    pod_monitor: Mapping[str, Any], targets: Sequence[str], *, ca_file: Path | None = None
) -> dict[str, Any]:
    """The scrape job the Prometheus Operator makes of a PodMonitor's one endpoint, with
    `targets` standing for the pods it discovers: every target carries the labels the
    operator gives it (the pod's namespace, name and container, the endpoint's port and
    the job, unless the endpoint's relabelings set it), ``honor_labels`` is the
    endpoint's ``honorLabels`` (default false), and the endpoint's ``scheme``, ``path``
    and ``tlsConfig`` are the scrape's.
    Those labels are what a scraped series' own `namespace`, `pod` and `container`
    collide with: without honorLabels Prometheus renames the series' to ``exported_*``.

    A tlsConfig CA lives in a Secret or ConfigMap, which the operator copies into
    Prometheus's configuration and a static configuration cannot read: `ca_file` is
    the file holding the same certificate, required exactly where the endpoint names
    a CA."""
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    meta = pod_monitor["metadata"]
    # The chart names each pod's container for its component.
    container = pod_monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
    labels = {
        "namespace": meta["namespace"],
        "pod": f"{meta['name']}-0",
        "container": container,
        "endpoint": endpoint["port"],
        "job": f"{meta['namespace']}/{meta['name']}",
    }
    # Its relabelings, which the operator applies after its own: those that copy a pod's
    # metadata (the chart's node) and those that set a constant (the chart's job).
    for relabeling in endpoint.get("relabelings", ()):
        sources = relabeling.get("sourceLabels")
        if not sources:
            labels[relabeling["targetLabel"]] = relabeling["replacement"]
        else:
            (source,) = sources
            labels[relabeling["targetLabel"]] = _POD_META[source]
    job: dict[str, Any] = {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "scheme": endpoint.get("scheme", "http"),
        "metrics_path": endpoint.get("path", "/metrics"),
        "static_configs": [{"targets": list(targets), "labels": labels}],
    }
    tls = endpoint.get("tlsConfig", {})
    if set(tls) - _TLS_FIELDS:
        raise ValueError(f"tlsConfig fields not reproduced here: {sorted(set(tls) - _TLS_FIELDS)}")
    if ("ca" in tls) != (ca_file is not None):
        raise ValueError(f"ca_file is for an endpoint that names a CA; this one has {tls}")
    tls_config: dict[str, Any] = {}
    if ca_file is not None:
        tls_config["ca_file"] = str(ca_file)
    if "serverName" in tls:
        tls_config["server_name"] = tls["serverName"]
    if tls.get("insecureSkipVerify"):
        tls_config["insecure_skip_verify"] = True
    if tls_config:
        job["tls_config"] = tls_config
    return job


@contextlib.contextmanager
def serve(
    bin_path: Path,
    workdir: Path,
    *,
    targets: Sequence[str],
    rules: Mapping[str, Any],
    interval: str = "1s",
    pod_monitor: Mapping[str, Any] | None = None,
    ca_file: Path | None = None,
) -> Iterator[Server]:
    """Prometheus scraping `targets` (host:port, path /metrics) and evaluating `rules`
    every `interval`, on a free loopback port with its data under `workdir`; stopped
    (and waited for) on exit, whatever happened inside. With `pod_monitor` (the chart's
    rendered PodMonitor), the scrape is the one the Prometheus Operator makes of it,
    with `ca_file` for the CA it names (`operator_scrape`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_yaml(workdir / "rules.yaml", dict(rules))
    job: dict[str, Any] = {
        "job_name": "gpudra-node",
        "static_configs": [{"targets": list(targets)}],
    }
    if pod_monitor is not None:
        job = operator_scrape(pod_monitor, targets, ca_file=ca_file)
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [job],
    }
    write_yaml(workdir / "prometheus.yml", config)
    port = free_port()
    argv = [
        str(bin_path / "prometheus"),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log = workdir / "prometheus.log"
    proc = spawn_logged(argv, log, workdir, None)
    server = Server(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {proc.returncode}: {server.log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{server.url}/-/ready", timeout=2),
            ):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready in 60s: {server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        stop_pid(proc.pid, str(bin_path / "prometheus"))
        proc.wait(timeout=30)
