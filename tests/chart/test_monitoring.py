"""The chart's monitoring pieces (PrometheusRule, PodMonitor, Grafana dashboard):
rendered by the real helm, shaped as the Prometheus Operator and Grafana's sidecar read
them, tuned by the values, and asking only for series the node agent and the webhook
export.

Here expressions are checked for the metric names they use; `test_alert_rules.py` parses
them and runs the alerts with the real promtool."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from gpudra.cli.report import AGENT_JOB
from gpudra.driver.accounting import Accounting
from gpudra.driver.metrics import ClaimMetrics, DeviceMetrics
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile
from gpudra.driver.sampling import Sampler
from gpudra.webhook.certs import generate_ca, service_dns_names
from gpudra.webhook.metrics import PodSecurityGaps, QuotaLeader, WebhookMetrics
from prometheus_client import CollectorRegistry

from e2e.tools import helm as h
from e2e.tools import prometheus as p

ENABLED = {"monitoring": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}
WEBHOOK_JOB = "gpudra-webhook"
WEBHOOK_TLS = {
    "self": {"source": "self"},
    "helm": {"source": "helm"},
    "secret": {"source": "secret", "secretName": "webhook-tls", "caBundle": "Y2E="},
}
CLIENT_AUTH = {"enabled": True, "caCert": generate_ca().cert_pem.decode()}


def rules_of(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def exported_series() -> set[str]:
    """Every series name the agent's and the webhook's registries expose."""
    registry = CollectorRegistry()
    ClaimMetrics(registry)
    WebhookMetrics(registry)
    registry.register(PodSecurityGaps(dict))
    registry.register(QuotaLeader(lambda: True))
    sampler = Sampler(
        NvmlEmulator(load_builtin_profile("l4")),
        pool="n",
        inventory=lambda: None,
        prepared=lambda: (),
    )
    registry.register(DeviceMetrics(sampler, Accounting()))
    names: set[str] = set()
    for family in registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_off_by_default(helm: Path) -> None:
    assert not [o for o in h.template(helm) if o["kind"] == "PrometheusRule"]


def test_every_alert_is_complete_and_asks_for_exported_series(helm: Path) -> None:
    rules = rules_of(h.template(helm, ENABLED))
    assert set(rules) == {
        "GpuLowUtilization",
        "GpuAllocatedIdle",
        "GpuMemoryHigh",
        "GpuTemperatureHigh",
        "GpuXidError",
        "GpuDeviceTainted",
        "GpudraPrepareErrors",
        "GpudraSamplingStalled",
        "GpudraScrapeFailing",
        "GpudraWebhookDenialsRising",
        "GpudraWebhookConnectionsShed",
        "GpudraTenantQuotasUnwritten",
        "GpudraTenantNamespaceWithoutPodSecurity",
    }
    exported = exported_series()
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule["annotations"]["summary"], name
        if "for" in rule:
            assert re.fullmatch(r"[0-9]+[smhd]", rule["for"]), name
        used = set(re.findall(r"\bgpudra_[a-z_]+", rule["expr"]))
        # Or the series Prometheus writes for each scrape itself.
        assert used or re.match(r"up\{", rule["expr"]), name
        assert used <= exported, f"{name} uses series nobody exports: {used - exported}"


def test_thresholds_come_from_the_values(helm: Path) -> None:
    tuned = {
        "monitoring": {
            "prometheusRule": {
                **ENABLED["monitoring"]["prometheusRule"],
                "lowUtilizationPercent": 30,
                "lowUtilizationFor": "2h",
                "memoryUsedRatio": 0.8,
                "temperatureCelsius": 80,
                "idleSeconds": 1800,
            }
        }
    }
    rules = rules_of(h.template(helm, tuned))
    assert rules["GpuLowUtilization"]["expr"].endswith("< 30")
    assert rules["GpuLowUtilization"]["for"] == "2h"
    assert rules["GpuMemoryHigh"]["expr"].endswith("> 0.8")
    assert rules["GpuTemperatureHigh"]["expr"].endswith("> 80")
    assert rules["GpuAllocatedIdle"]["expr"].endswith("> 1800")


def test_the_sampling_values_reach_the_agent(helm: Path) -> None:
    values = {"node": {"sampleIntervalSeconds": 0, "idleThresholdPercent": 10}}
    (ds,) = [o for o in h.template(helm, values) if o["kind"] == "DaemonSet"]
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--sample-interval=0" in args
    assert "--idle-threshold=10" in args


def test_the_pod_monitor_scrapes_the_agents_metrics_port(helm: Path) -> None:
    values = {"monitoring": {"podMonitor": {"enabled": True, "interval": "15s"}}}
    objs = h.template(helm, values)
    monitor = p.pod_monitor(objs, "node")
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert endpoint["port"] in [port["name"] for port in ports]
    assert endpoint["interval"] == "15s"
    # Holder series name the holder's namespace, pod and container, which the operator's
    # target labels of the same names would otherwise rename to exported_*.
    assert endpoint["honorLabels"] is True


def test_pod_monitors_come_with_podmonitor_enabled_for_what_serves_metrics(helm: Path) -> None:
    def monitored(values: dict[str, Any]) -> list[str]:
        return sorted(
            o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
            for o in h.template(helm, values)
            if o["kind"] == "PodMonitor"
        )

    on = {"monitoring": {"podMonitor": {"enabled": True}}}
    assert monitored({}) == []
    assert monitored(on) == ["node", "webhook"]
    assert monitored({**on, "node": {"metricsPort": 0}}) == ["webhook"]
    assert monitored({**on, "webhook": {"enabled": False}}) == ["node"]


@pytest.mark.parametrize("client_auth", [False, True], ids=["admission-port", "client-auth"])
@pytest.mark.parametrize("source", sorted(WEBHOOK_TLS))
def test_the_webhook_pod_monitor_scrapes_its_metrics_over_tls(
    helm: Path, source: str, client_auth: bool
) -> None:
    """The webhook serves /metrics over HTTPS on the port its probes use (the admission
    port, or with clientAuth the health port, which asks for no client certificate)
    with a certificate for its Service's name. The scrape verifies it with the CA of
    the TLS Secret the pods mount; with tls.source=self, whose CA never leaves the pod,
    it cannot. The tenant namespaces' series keep their `namespace`, and every series
    gets the job the webhook's alerts read."""
    webhook: dict[str, Any] = {"tls": WEBHOOK_TLS[source]}
    if client_auth:
        webhook["clientAuth"] = CLIENT_AUTH
    monitoring = {"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}}}
    objs = h.template(helm, {"webhook": webhook, "monitoring": monitoring})
    monitor = p.pod_monitor(objs, "webhook")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    pod = h.find(objs, "Deployment")["spec"]["template"]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert not selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == ("health" if client_auth else "https")
    assert endpoint["port"] == container["readinessProbe"]["httpGet"]["port"]
    assert endpoint["port"] in [port["name"] for port in container["ports"]]
    assert (endpoint["scheme"], endpoint["path"]) == ("https", "/metrics")
    assert endpoint["interval"] == "15s"
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": WEBHOOK_JOB}]
    tls = endpoint["tlsConfig"]
    if source == "self":
        assert tls == {"insecureSkipVerify": True}
        return
    assert set(tls) == {"ca", "serverName"}
    ca = tls["ca"]["secret"]
    assert ca["key"] == "ca.crt"
    assert {"name": "certs", "secret": {"secretName": ca["name"]}} in pod["spec"]["volumes"]
    if source == "helm":
        assert "ca.crt" in h.find(objs, "Secret", ca["name"])["data"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
    # A name the serving certificate is made for: the webhook's own from the chart's CA,
    # or the Secret's, which the API server reaches through the Service by that name.
    assert tls["serverName"] in service_dns_names(flags["service"], flags["namespace"])


def test_every_view_of_gpudras_series_reads_the_job_its_pod_monitor_gives_them(
    helm: Path,
) -> None:
    """The alerts, the dashboard and `gpudra report` (by default) select the agents'
    series, and the webhook's alerts the webhook's, by the job each PodMonitor sets,
    whatever the release's name and namespace: a scraped pod's own series cannot carry
    it (docs/security.md)."""

    def jobs(values: dict[str, Any], **where: str) -> tuple[dict[str, str], dict[str, set[str]]]:
        monitoring = {
            **values,
            "podMonitor": {"enabled": True},
            "dashboard": {"enabled": True},
            **ENABLED["monitoring"],
        }
        objs = h.template(helm, {"monitoring": monitoring}, **where)
        set_jobs = {}
        for component in ("node", "webhook"):
            (endpoint,) = p.pod_monitor(objs, component)["spec"]["podMetricsEndpoints"]
            (set_job,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
            assert "sourceLabels" not in set_job
            set_jobs[component] = set_job["replacement"]
        exprs = [r["expr"] for r in rules_of(objs).values()]
        (cm,) = [
            o for o in objs if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
        ]
        dashboard = json.loads(cm["data"]["gpudra-gpus.json"])
        (job,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
        assert job["type"] == "constant"
        exprs += [
            e.replace('"$job"', json.dumps(job["query"]))
            for e in [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
            + [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
        ]
        selected: dict[str, set[str]] = {"node": set(), "webhook": set()}
        for expr in exprs:
            for name, labels in re.findall(r"\b(gpudra_[a-z_]+)(\{[^}]*\})?", expr):
                found = re.findall(r'\bjob="([^"]*)"', labels)
                assert found, f"{name} in {expr} selects no job"
                selected["webhook" if name.startswith("gpudra_webhook_") else "node"].update(found)
        return set_jobs, selected

    assert jobs({}) == (
        {"node": AGENT_JOB, "webhook": WEBHOOK_JOB},
        {"node": {AGENT_JOB}, "webhook": {WEBHOOK_JOB}},
    )
    moved = {"release": "gpu", "namespace": "monitoring"}
    named = {"agentJob": "gpu-agents", "webhookJob": "gpu-admission"}
    assert jobs(named, **moved) == (
        {"node": "gpu-agents", "webhook": "gpu-admission"},
        {"node": {"gpu-agents"}, "webhook": {"gpu-admission"}},
    )


def test_the_dashboard_loads_in_the_sidecar_and_queries_exported_series(helm: Path) -> None:
    values = {"monitoring": {"dashboard": {"enabled": True, "namespace": "grafana"}}}
    (cm,) = [
        o
        for o in h.template(helm, values)
        if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    ]
    assert cm["metadata"]["namespace"] == "grafana"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["gpudra-gpus.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 10
    exported = exported_series()
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        used = set(re.findall(r"\bgpudra_[a-z_]+", expr))
        assert used, expr
        assert used <= exported, f"{expr} uses series nobody exports: {used - exported}"
    assert not [
        o
        for o in h.template(helm)
        if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    ]


def agent_args_and_role(
    helm: Path, values: dict[str, Any]
) -> tuple[list[str], list[dict[str, Any]]]:
    """The node agent's arguments and its ClusterRole's rules, as `values` render."""
    objs = h.template(helm, values)
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    role = h.find(objs, "ClusterRole", "gpudra-node")["rules"]
    return ds["spec"]["template"]["spec"]["containers"][0]["args"], role


def test_claim_status_is_opt_in_with_its_one_extra_permission(helm: Path) -> None:
    args, role = agent_args_and_role(helm, {})
    assert "--claim-status" not in args
    assert not [r for r in role if "resourceclaims/status" in r["resources"]]
    assert not [r for r in role if "resourceclaims/driver" in r["resources"]]
    args, role = agent_args_and_role(helm, {"node": {"claimStatus": True}})
    assert "--claim-status" in args
    [status] = [r for r in role if "resourceclaims/status" in r["resources"]]
    assert (status["resources"], status["verbs"]) == (["resourceclaims/status"], ["patch"])
    # 1.36+ also asks for the driver's own entries on claims of the agent's node.
    [driver] = [r for r in role if "resourceclaims/driver" in r["resources"]]
    assert driver["resourceNames"] == ["gpu.nvidia.com"]
    assert driver["verbs"] == ["associated-node:patch", "associated-node:update"]


def test_device_metadata_is_opt_in_and_needs_no_permission(helm: Path) -> None:
    args, role = agent_args_and_role(helm, {})
    assert "--device-metadata" not in args
    enabled, same_role = agent_args_and_role(helm, {"node": {"deviceMetadata": True}})
    assert [a for a in enabled if a not in args] == ["--device-metadata"]
    assert same_role == role  # files on the node only: no API grant
    with pytest.raises(h.HelmFailed, match="deviceMetadata"):
        h.template(helm, {"node": {"deviceMetadata": "yes"}})


def test_the_agent_may_read_tenants_and_namespaces_only_while_it_samples(
    helm: Path,
) -> None:
    def watched(values: dict[str, Any]) -> list[tuple[str, ...]]:
        role = h.find(h.template(helm, values), "ClusterRole", "gpudra-node")["rules"]
        return sorted(
            (group, resource, *r["verbs"])
            for r in role
            for group in r["apiGroups"]
            for resource in r["resources"]
            if resource in {"gputenants", "namespaces", "pods"}
        )

    assert watched({}) == [
        ("", "namespaces", "list", "watch"),
        ("", "pods", "get"),
        ("gpudra.io", "gputenants", "list", "watch"),
    ]
    # Pods it reads either way: the sweep of deleted claims asks whether a claim's pod
    # still runs on the node.
    assert watched({"node": {"sampleIntervalSeconds": 0}}) == [("", "pods", "get")]


def test_the_accounting_zero_window_reaches_the_agent(helm: Path) -> None:
    (ds,) = [
        o
        for o in h.template(helm, {"node": {"accountingZeroWindowSeconds": 300}})
        if o["kind"] == "DaemonSet"
    ]
    assert "--accounting-zero-window=300" in ds["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    ("interval", "window", "fix"),
    [("1m", 90, 120), ("2m", 120, 240), ("1h", 3600, 7200), ("45s", 60, 90)],
)
def test_a_zero_window_shorter_than_two_scrapes_is_refused_naming_the_fix(
    helm: Path, interval: str, window: int, fix: int
) -> None:
    """A Prometheus that misses one scrape of a new counter's window would see it first
    at its count, and bill less than was used: the chart refuses such a window."""
    values = {
        "monitoring": {"podMonitor": {"enabled": True, "interval": interval}},
        "node": {"accountingZeroWindowSeconds": window},
    }
    with pytest.raises(h.HelmFailed) as failure:
        h.template(helm, values)
    assert f"node.accountingZeroWindowSeconds={window} is shorter than two scrapes" in str(
        failure.value
    )
    assert f"Set node.accountingZeroWindowSeconds to {fix} or more" in str(failure.value)


@pytest.mark.parametrize(("interval", "window"), [("30s", 60), ("1m", 120), ("2m", 300)])
def test_a_zero_window_holding_two_scrapes_renders(helm: Path, interval: str, window: int) -> None:
    values = {
        "monitoring": {"podMonitor": {"enabled": True, "interval": interval}},
        "node": {"accountingZeroWindowSeconds": window},
    }
    assert p.pod_monitor(h.template(helm, values), "node")


def test_the_zero_window_is_set_by_its_value_not_extra_args(helm: Path) -> None:
    with pytest.raises(h.HelmFailed) as failure:
        h.template(helm, {"node": {"extraArgs": ["--accounting-zero-window=10"]}})
    assert "set node.accountingZeroWindowSeconds instead" in str(failure.value)
