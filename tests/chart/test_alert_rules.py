"""The chart's alerts and dashboard queries under Prometheus's own tools.

The PrometheusRule rendered by the real helm goes through `promtool check rules` and
`promtool test rules` with series written here in the node agent's and the webhook's
label shapes (`DEVICE_LABELS`, `HOLDER_LABELS`) under the jobs the chart's PodMonitors
give them: each alert fires, with the labels and text an operator reads, when its
condition holds long enough, and stays silent when it does not (below the threshold,
too short, or a device nobody holds), or when the series come from another job (a
tenant's pod serving look-alikes). Every dashboard
query is parsed by promtool as a recording rule, with Grafana's variables replaced by
what Grafana substitutes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudra.cli.report import usage_query
from gpudra.driver.health import APPLICATION_XIDS
from gpudra.driver.metrics import DEVICE_LABELS, HOLDER_LABELS

from e2e.tools import helm as h
from e2e.tools import prometheus as p

ENABLED = {"monitoring": {"prometheusRule": {"enabled": True}}}
SCRAPE = {"instance": "10.0.0.7:8080", "job": "gpudra-node", "node": "gpu-node-1"}
WEBHOOK_SCRAPE = {"instance": "10.0.0.8:8443", "job": "gpudra-webhook"}
# A tenant's pod, scraped by a PodMonitor of its own without honored labels: the pod's
# target labels, the ones it serves of those names renamed exported_*.
TENANT_SCRAPE = {
    "job": "team-b/app",
    "instance": "10.0.1.5:8080",
    "namespace": "team-b",
    "pod": "app-0",
    "container": "app",
}
DEVICE = {
    "device": "gpu-0",
    "uuid": "GPU-aaaa",
    "gpu_uuid": "GPU-aaaa",
    "mig_uuid": "",
    "model": "NVIDIA L4",
    "utilization_scope": "device",
}
HOLDER = {
    "namespace": "team-a",
    "pod": "trainer",
    "container": "main",
    "claim": "trainer-gpu",
    "request": "gpu",
    "tenant": "research",
    "sharing": "Exclusive",
}
NO_HOLDER = dict.fromkeys(HOLDER_LABELS, "")
OTHER = {**DEVICE, "device": "gpu-1", "uuid": "GPU-bbbb", "gpu_uuid": "GPU-bbbb"}
BUSY = {**HOLDER, "pod": "busy", "claim": "busy-gpu"}
# A tenant namespace without Pod Security, as the webhook's series names it.
UNENFORCED = {"namespace": "team-a", "tenant": "a"}


def device_series(name: str, device: Mapping[str, str], holder: Mapping[str, str]) -> str:
    labels = {**SCRAPE, **device, **holder}
    assert set(DEVICE_LABELS) | set(HOLDER_LABELS) <= labels.keys()
    return p.series(name, labels)


def alert(labels: Mapping[str, str], severity: str, **annotations: str) -> dict[str, Any]:
    """An expected alert; empty labels are absent in Prometheus, as on a real scrape."""
    return {
        "exp_labels": {**{k: v for k, v in labels.items() if v}, "severity": severity},
        "exp_annotations": annotations,
    }


def rendered_rules(helm: Path, tmp_path: Path) -> Path:
    (rule,) = [o for o in h.template(helm, ENABLED) if o["kind"] == "PrometheusRule"]
    return p.write_yaml(tmp_path / "rules.yaml", p.rule_groups(rule))


def test_the_rules_pass_promtool_check(helm: Path, prometheus_bin: Path, tmp_path: Path) -> None:
    out = p.promtool(prometheus_bin, "check", "rules", str(rendered_rules(helm, tmp_path)))
    assert "SUCCESS: 13 rules found" in out


def silent_xids(helm: Path, values: Mapping[str, Any]) -> set[int]:
    """The XIDs the rendered GpuXidError leaves out."""
    (rule,) = [o for o in h.template(helm, {**ENABLED, **values}) if o["kind"] == "PrometheusRule"]
    (expr,) = [
        r["expr"]
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if r.get("alert") == "GpuXidError"
    ]
    (listed,) = set(re.findall(r'xid!~"([0-9|]+)"', expr))
    return {int(x) for x in listed.split("|")}


def test_the_xid_alert_leaves_out_the_xids_the_agent_takes_as_application_errors(
    helm: Path,
) -> None:
    # A tenant's crashing kernel raises them, on a GPU other tenants may share: the
    # agent does not taint for them, and the alert no longer fires for them either.
    assert silent_xids(helm, {}) == APPLICATION_XIDS
    health = {"applicationXids": [8, 13], "resetXids": [109]}
    assert silent_xids(helm, {"node": {"health": health}}) == (APPLICATION_XIDS | {8}) - {109}


def test_each_alert_fires_when_it_should_and_only_then(
    helm: Path, prometheus_bin: Path, tmp_path: Path
) -> None:
    rendered_rules(helm, tmp_path)
    util = "gpudra_gpu_utilization_percent"
    low = {**SCRAPE, **DEVICE, **HOLDER}
    idle = {**SCRAPE, "device": "gpu-0", "uuid": "GPU-aaaa", **HOLDER}
    mem = {**SCRAPE, **DEVICE, **NO_HOLDER}
    xid = {**SCRAPE, "gpu_uuid": "GPU-aaaa", "xid": "79"}
    prepare = {**SCRAPE, "operation": "prepare"}
    tests: list[dict[str, Any]] = [
        {
            "name": "a held GPU under 50% for an hour, per holder; busy and unheld ones never",
            "interval": "1m",
            "input_series": [
                {"series": device_series(util, DEVICE, HOLDER), "values": "30x90"},
                {"series": device_series(util, OTHER, BUSY), "values": "80x90"},
                {
                    "series": device_series(util, {**OTHER, "device": "gpu-2"}, NO_HOLDER),
                    "values": "0x90",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "50m", "alertname": "GpuLowUtilization", "exp_alerts": []},
                {
                    "eval_time": "61m",
                    "alertname": "GpuLowUtilization",
                    "exp_alerts": [
                        alert(
                            low,
                            "info",
                            summary="team-a/trainer uses gpu-0 under 50%",
                            description="GPU GPU-aaaa (NVIDIA L4) held by claim trainer-gpu "
                            "has stayed under 50% utilization for 1h.",
                        )
                    ],
                },
            ],
        },
        {
            "name": "a device allocated and idle past idleSeconds",
            "interval": "1m",
            "input_series": [
                {
                    "series": p.series("gpudra_device_idle_seconds", idle),
                    "values": "0+60x90",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "59m", "alertname": "GpuAllocatedIdle", "exp_alerts": []},
                {
                    "eval_time": "70m",
                    "alertname": "GpuAllocatedIdle",
                    "exp_alerts": [
                        alert(
                            idle,
                            "warning",
                            summary="team-a/trainer holds gpu-0 and does nothing",
                            description="Device GPU-aaaa has been allocated and idle for "
                            "1h 10m 0s.",
                        )
                    ],
                },
            ],
        },
        {
            "name": "memory over 90% and temperature over 85 C, held for 5m",
            "interval": "1m",
            "input_series": [
                {
                    "series": device_series("gpudra_gpu_memory_total_bytes", DEVICE, NO_HOLDER),
                    "values": "100x20",
                },
                {
                    "series": device_series("gpudra_gpu_memory_used_bytes", DEVICE, NO_HOLDER),
                    "values": "50x4 95x15",
                },
                {
                    "series": device_series("gpudra_gpu_memory_total_bytes", OTHER, NO_HOLDER),
                    "values": "100x20",
                },
                {
                    "series": device_series("gpudra_gpu_memory_used_bytes", OTHER, NO_HOLDER),
                    "values": "90x20",
                },
                {
                    "series": device_series("gpudra_gpu_temperature_celsius", DEVICE, NO_HOLDER),
                    "values": "70x4 90x15",
                },
                {
                    "series": device_series("gpudra_gpu_temperature_celsius", OTHER, NO_HOLDER),
                    "values": "85x20",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "7m", "alertname": "GpuMemoryHigh", "exp_alerts": []},
                {"eval_time": "7m", "alertname": "GpuTemperatureHigh", "exp_alerts": []},
                {
                    "eval_time": "10m",
                    "alertname": "GpuMemoryHigh",
                    "exp_alerts": [
                        alert(
                            mem,
                            "warning",
                            summary="gpu-0 on 10.0.0.7:8080 has used over 90% of its memory",
                        )
                    ],
                },
                {
                    "eval_time": "10m",
                    "alertname": "GpuTemperatureHigh",
                    "exp_alerts": [
                        alert(mem, "warning", summary="gpu-0 on 10.0.0.7:8080 is at 90 C")
                    ],
                },
            ],
        },
        {
            # As the agent exports them: a GPU's series of an XID from its first one, at 1,
            # gone while the agent restarts (stale), and back at its count since.
            "name": "each XID fires: the first, a second, the first after a restart",
            "interval": "1m",
            "input_series": [
                {
                    "series": p.series("gpudra_gpu_xid_errors_total", xid),
                    "values": "_x20 1x10 2x30",
                },
                {
                    # Raised before, then one failed scrape: nothing new.
                    "series": p.series(
                        "gpudra_gpu_xid_errors_total", {**xid, "gpu_uuid": "GPU-bbbb"}
                    ),
                    "values": "3x25 stale 3x30",
                },
                {
                    # Raised twice, then the agent restarted and it raised one since.
                    "series": p.series(
                        "gpudra_gpu_xid_errors_total", {**xid, "gpu_uuid": "GPU-cccc"}
                    ),
                    "values": "2x15 stale _x9 1x30",
                },
                {
                    # An application XID (a tenant's kernel faulted), as the first one.
                    "series": p.series("gpudra_gpu_xid_errors_total", {**xid, "xid": "13"}),
                    "values": "_x20 1x10 2x30",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "19m", "alertname": "GpuXidError", "exp_alerts": []},
                {
                    "eval_time": "22m",
                    "alertname": "GpuXidError",
                    "exp_alerts": [alert(xid, "warning", summary="GPU GPU-aaaa raised XID 79")],
                },
                {
                    "eval_time": "33m",
                    "alertname": "GpuXidError",
                    "exp_alerts": [
                        alert(xid, "warning", summary="GPU GPU-aaaa raised XID 79"),
                        alert(
                            {**xid, "gpu_uuid": "GPU-cccc"},
                            "warning",
                            summary="GPU GPU-cccc raised XID 79",
                        ),
                    ],
                },
                {
                    "eval_time": "36m",
                    "alertname": "GpuXidError",
                    "exp_alerts": [alert(xid, "warning", summary="GPU GPU-aaaa raised XID 79")],
                },
                {"eval_time": "50m", "alertname": "GpuXidError", "exp_alerts": []},
            ],
        },
        {
            "name": "a tainted device and a failed prepare fire at once; quiet ones never",
            "interval": "1m",
            "input_series": [
                {
                    "series": device_series("gpudra_gpu_healthy", DEVICE, NO_HOLDER),
                    "values": "1x5 0x20",
                },
                {"series": device_series("gpudra_gpu_healthy", OTHER, NO_HOLDER), "values": "1x25"},
                {
                    "series": p.series("gpudra_claim_operation_errors_total", prepare),
                    "values": "0x5 2x20",
                },
                {
                    "series": p.series(
                        "gpudra_claim_operation_errors_total", {**prepare, "operation": "unprepare"}
                    ),
                    "values": "0x5 2x20",
                },
            ],
            "alert_rule_test": [
                *(
                    {"eval_time": "4m", "alertname": name, "exp_alerts": []}
                    for name in ("GpuDeviceTainted", "GpudraPrepareErrors")
                ),
                {
                    "eval_time": "8m",
                    "alertname": "GpuDeviceTainted",
                    "exp_alerts": [
                        alert(
                            mem,
                            "critical",
                            summary="gpu-0 on 10.0.0.7:8080 is tainted unhealthy (critical "
                            "XID, ECC, failed row remapping, unrepairable memory or lost)",
                        )
                    ],
                },
                {
                    "eval_time": "8m",
                    "alertname": "GpudraPrepareErrors",
                    "exp_alerts": [
                        alert(
                            prepare, "warning", summary="Claims failed to prepare on 10.0.0.7:8080"
                        )
                    ],
                },
            ],
        },
        {
            # A pass that hangs: its age grows past three intervals (30 s) and stays.
            "name": "sampling stalled past its bound for 5m; a slow pass never",
            "interval": "1m",
            "input_series": [
                {"series": p.series("gpudra_sample_age_seconds", SCRAPE), "values": "5x5 0+60x20"},
                {
                    "series": p.series("gpudra_sample_stale_after_seconds", SCRAPE),
                    "values": "30x25",
                },
                {
                    "series": p.series(
                        "gpudra_sample_age_seconds", {**SCRAPE, "node": "gpu-node-2"}
                    ),
                    "values": "5 25 5 25 5 25 5 25 5 25 5 25 5 25",
                },
                {
                    "series": p.series(
                        "gpudra_sample_stale_after_seconds", {**SCRAPE, "node": "gpu-node-2"}
                    ),
                    "values": "30x13",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "GpudraSamplingStalled", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "GpudraSamplingStalled",
                    "exp_alerts": [
                        alert(
                            SCRAPE,
                            "warning",
                            summary="GPU sampling on 10.0.0.7:8080 has stalled",
                            description="The node agent's last completed sampling pass is "
                            "6m 0s old (an NVML call hanging, or every pass failing: see the "
                            "agent's log). Its device series and idle times are withdrawn, and "
                            "no GPU time is billed until a pass completes.",
                        )
                    ],
                },
            ],
        },
        {
            "name": "an agent or the webhook Prometheus cannot scrape for 5m; other jobs never",
            "interval": "1m",
            "input_series": [
                {"series": p.series("up", SCRAPE), "values": "1x3 0x10"},
                {"series": p.series("up", WEBHOOK_SCRAPE), "values": "1 0 1 0 1 0 1 0 1 0"},
                {"series": p.series("up", TENANT_SCRAPE), "values": "0x13"},
            ],
            "alert_rule_test": [
                {"eval_time": "7m", "alertname": "GpudraScrapeFailing", "exp_alerts": []},
                {
                    "eval_time": "9m",
                    "alertname": "GpudraScrapeFailing",
                    "exp_alerts": [
                        alert(
                            SCRAPE,
                            "warning",
                            summary="gpudra-node at 10.0.0.7:8080 cannot be scraped",
                            description="Prometheus has failed to scrape it for 5 minutes: "
                            "the GPU alerts, idle times and billing of what it serves are "
                            "blind meanwhile. A node agent's metrics port takes a bounded "
                            "number of connections: restrict who reaches it "
                            "(node.networkPolicy).",
                        )
                    ],
                },
            ],
        },
        {
            "name": "webhook denials at ten times last hour's rate, for 10m",
            "interval": "1m",
            "input_series": [
                {
                    "series": p.series(
                        "gpudra_webhook_denials_total", {**WEBHOOK_SCRAPE, "reason": "quota"}
                    ),
                    "values": "0+1x120 130+10x40",
                },
                {
                    "series": p.series(
                        "gpudra_webhook_denials_total", {**WEBHOOK_SCRAPE, "reason": "class"}
                    ),
                    "values": "0+1x160",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "115m", "alertname": "GpudraWebhookDenialsRising", "exp_alerts": []},
                {
                    "eval_time": "150m",
                    "alertname": "GpudraWebhookDenialsRising",
                    "exp_alerts": [
                        alert(
                            {"reason": "quota"},
                            "info",
                            summary="GPU admission denials for quota are rising",
                        )
                    ],
                },
            ],
        },
        {
            # Exported from the first connection shed, at the count then: one burst.
            "name": "webhook connections shed at the bound",
            "interval": "1m",
            "input_series": [
                {
                    "series": p.series(
                        "gpudra_webhook_connections_shed_total",
                        {**WEBHOOK_SCRAPE, "action": "evicted"},
                    ),
                    "values": "_x30 3x40",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "25m", "alertname": "GpudraWebhookConnectionsShed", "exp_alerts": []},
                {
                    "eval_time": "35m",
                    "alertname": "GpudraWebhookConnectionsShed",
                    "exp_alerts": [
                        alert(
                            {"instance": WEBHOOK_SCRAPE["instance"], "action": "evicted"},
                            "warning",
                            summary="The GPU admission webhook at 10.0.0.8:8443 is shedding "
                            "connections (evicted)",
                            description="It holds its most connections and closes others to "
                            "take new ones: something may be holding connections open to its "
                            "port. Restrict who reaches it (webhook.networkPolicy or "
                            "webhook.clientAuth).",
                        )
                    ],
                },
                {"eval_time": "65m", "alertname": "GpudraWebhookConnectionsShed", "exp_alerts": []},
            ],
        },
        {
            # Replica .8 leads, drops the Lease for 2m (a handover: no alert), leads
            # again and then loses it at 20m; .9 takes it only at 42m: one alert between.
            "name": "no webhook replica writes the tenants' quotas",
            "interval": "1m",
            "input_series": [
                {
                    "series": p.series(
                        "gpudra_webhook_quota_leader", {**WEBHOOK_SCRAPE, "instance": instance}
                    ),
                    "values": values,
                }
                for instance, values in (
                    ("10.0.0.8:8443", "1x9 0x1 1x7 0x40"),
                    ("10.0.0.9:8443", "0x41 1x20"),
                )
            ],
            "alert_rule_test": [
                {"eval_time": "15m", "alertname": "GpudraTenantQuotasUnwritten", "exp_alerts": []},
                {
                    "eval_time": "27m",
                    "alertname": "GpudraTenantQuotasUnwritten",
                    "exp_alerts": [
                        alert(
                            {},
                            "warning",
                            summary="No GPU admission webhook replica writes the tenants' "
                            "ResourceQuotas",
                            description="None holds the Lease gpudra-webhook-tenant-quotas: "
                            "quotas stay as they were written, and new or changed GpuTenants "
                            "get none. See the webhook's log (leader election) and its "
                            "permissions on Leases in its namespace.",
                        )
                    ],
                },
                {"eval_time": "50m", "alertname": "GpudraTenantQuotasUnwritten", "exp_alerts": []},
            ],
        },
        {
            # Two replicas report the namespace until it is labelled at 30m: one alert.
            "name": "a tenant namespace without Pod Security",
            "interval": "1m",
            "input_series": [
                {
                    "series": p.series(
                        "gpudra_webhook_tenant_namespace_without_pod_security",
                        {**WEBHOOK_SCRAPE, **UNENFORCED, "instance": instance},
                    ),
                    "values": "1x30",
                }
                for instance in ("10.0.0.8:8443", "10.0.0.9:8443")
            ],
            "alert_rule_test": [
                {
                    "eval_time": "5m",
                    "alertname": "GpudraTenantNamespaceWithoutPodSecurity",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "15m",
                    "alertname": "GpudraTenantNamespaceWithoutPodSecurity",
                    "exp_alerts": [
                        alert(
                            {"namespace": "team-a", "tenant": "a"},
                            "warning",
                            summary="Namespace team-a of GpuTenant a does not enforce Pod "
                            "Security baseline",
                            description="A privileged pod there gets every GPU of its node "
                            "without a claim, outside the tenant's rules. Label the namespace "
                            "pod-security.kubernetes.io/enforce=baseline (or restricted).",
                        )
                    ],
                },
                {
                    "eval_time": "45m",
                    "alertname": "GpudraTenantNamespaceWithoutPodSecurity",
                    "exp_alerts": [],
                },
            ],
        },
    ]
    tested = {t["alertname"] for case in tests for t in case["alert_rule_test"]}
    rules = (tmp_path / "rules.yaml").read_text()
    assert tested == set(re.findall(r"alert: (\w+)", rules)), "every alert has a case"
    unit = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    p.write_yaml(tmp_path / "tests.yaml", unit)
    out = p.promtool(prometheus_bin, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in out


def rendered_dashboard(helm: Path, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    monitoring = {**(values or {}), "dashboard": {"enabled": True}}
    (cm,) = [
        o
        for o in h.template(helm, {"monitoring": monitoring})
        if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    ]
    dashboard: dict[str, Any] = json.loads(cm["data"]["gpudra-gpus.json"])
    return dashboard


def panel_query(dashboard: Mapping[str, Any], title: str) -> str:
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    (target,) = panel["targets"]
    return str(target["expr"])


def grafana_to_promql(query: str, dashboard: Mapping[str, Any]) -> str:
    """A dashboard query as Grafana sends it: the dashboard's constants and the other
    variables (all values) substituted, and the `label_values(series, label)` query
    function reduced to the series it lists."""
    listing = re.fullmatch(r"label_values\((.+), *\w+\)", query)
    if listing:
        query = listing.group(1)
    query = query.replace("$__rate_interval", "1m").replace("$__range", "1h")
    for v in dashboard["templating"]["list"]:
        if v["type"] == "constant":
            query = query.replace(f"${v['name']}", v["query"])
    return re.sub(r"\$\w+", ".*", query)


def test_every_dashboard_query_parses(helm: Path, prometheus_bin: Path, tmp_path: Path) -> None:
    dashboard = rendered_dashboard(helm)
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    queries += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    exprs = [grafana_to_promql(q, dashboard) for q in queries]
    assert not [e for e in exprs if "$" in e]
    path = p.write_yaml(tmp_path / "dashboard-rules.yaml", p.recording_rules(exprs))
    out = p.promtool(prometheus_bin, "check", "rules", str(path))
    assert f"SUCCESS: {len(exprs)} rules found" in out


def test_the_xid_panel_shows_a_gpus_first_xid(
    helm: Path, prometheus_bin: Path, tmp_path: Path
) -> None:
    """The agent exports a GPU's series of an XID from its first one, at 1: the panel
    shows that one as it does a later one, and nothing while none comes."""
    dashboard = rendered_dashboard(helm)
    query = grafana_to_promql(panel_query(dashboard, "XID errors"), dashboard)
    xid = {**SCRAPE, "gpu_uuid": "GPU-aaaa", "xid": "79"}
    shown = {"node": SCRAPE["node"], "gpu_uuid": "GPU-aaaa", "xid": "79"}
    unit = {
        "rule_files": [],
        "tests": [
            {
                "interval": "15s",  # Grafana's $__rate_interval is 4 of them at least
                "input_series": [
                    {
                        "series": p.series("gpudra_gpu_xid_errors_total", xid),
                        "values": "_x80 1x80",
                    },
                    {
                        # Raised before the span, nothing since.
                        "series": p.series(
                            "gpudra_gpu_xid_errors_total", {**xid, "gpu_uuid": "GPU-bbbb"}
                        ),
                        "values": "2x160",
                    },
                ],
                "promql_expr_test": [
                    {"expr": query, "eval_time": "19m", "exp_samples": []},
                    {
                        "expr": query,
                        "eval_time": "20m15s",
                        "exp_samples": [{"labels": p.series("", shown), "value": 1}],
                    },
                    {"expr": query, "eval_time": "30m", "exp_samples": []},
                ],
            }
        ],
    }
    p.write_yaml(tmp_path / "tests.yaml", unit)
    assert "SUCCESS" in p.promtool(prometheus_bin, "test", "rules", "tests.yaml", cwd=tmp_path)


def test_a_scraped_pods_own_series_bill_and_alert_nothing(
    helm: Path, prometheus_bin: Path, tmp_path: Path
) -> None:
    """A tenant's pod serves gpudra's series claiming another namespace, tenant and job,
    scraped (its own PodMonitor) without honored labels: Prometheus keeps them under the
    pod's own target labels, the claimed ones renamed exported_*, but the `tenant` label,
    which no target carries, as the pod wrote it. `gpudra report`, the dashboard's
    GPU-hours and the alerts read the agents' job only, and so bill and name the agent's
    holder alone."""
    rendered_rules(helm, tmp_path)
    account = {**SCRAPE, "namespace": "team-a", "tenant": "research"}
    account |= {"device_class": "gpu.nvidia.com", "sharing": "Exclusive"}
    pod = {
        **account,
        **TENANT_SCRAPE,
        "exported_namespace": "team-a",
        "exported_job": SCRAPE["job"],
    }
    idle = {**SCRAPE, "device": "gpu-0", "uuid": "GPU-aaaa", **HOLDER}
    forged_idle = {**idle, **{k: pod[k] for k in ("job", "instance", "namespace", "pod")}}
    allocated, idled = "gpudra_allocated_device_seconds_total", "gpudra_idle_device_seconds_total"
    dashboard = rendered_dashboard(helm)
    hours = grafana_to_promql(
        panel_query(dashboard, "GPU-hours allocated per namespace and tenant (range)"),
        dashboard,
    )
    billed = p.series("", {"namespace": "team-a", "tenant": "research"})
    unit = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": p.series(allocated, account), "values": "0+60x60"},
                    {"series": p.series(idled, account), "values": "0+15x60"},
                    {"series": p.series(allocated, pod), "values": "0+600x60"},
                    {"series": p.series(idled, pod), "values": "0+600x60"},
                    {
                        "series": p.series("gpudra_device_idle_seconds", forged_idle),
                        "values": "7200+60x70",
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": usage_query(allocated, 3600),
                        "eval_time": "60m",
                        "exp_samples": [{"labels": billed, "value": 3600}],
                    },
                    {
                        "expr": usage_query(idled, 3600),
                        "eval_time": "60m",
                        "exp_samples": [{"labels": billed, "value": 900}],
                    },
                    {
                        "expr": hours,
                        "eval_time": "60m",
                        "exp_samples": [{"labels": billed, "value": 1}],
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "70m", "alertname": "GpuAllocatedIdle", "exp_alerts": []},
                ],
            }
        ],
    }
    p.write_yaml(tmp_path / "tests.yaml", unit)
    assert "SUCCESS" in p.promtool(prometheus_bin, "test", "rules", "tests.yaml", cwd=tmp_path)


def test_a_scraped_pods_own_webhook_series_fire_no_webhook_alert(
    helm: Path, prometheus_bin: Path, tmp_path: Path
) -> None:
    """A tenant's pod serves the webhook's series, claiming the webhook's job and a
    namespace without Pod Security, with values that fire each webhook alert in
    `test_each_alert_fires_when_it_should_and_only_then`: under the pod's own scrape's
    job none fires, so the pod can neither page nor name a namespace."""
    rendered_rules(helm, tmp_path)
    pod = {**TENANT_SCRAPE, "exported_job": WEBHOOK_SCRAPE["job"]}
    forged = {
        "gpudra_webhook_denials_total": ({**pod, "reason": "quota"}, "0+1x120 130+10x40"),
        "gpudra_webhook_connections_shed_total": ({**pod, "action": "evicted"}, "_x30 3x40"),
        "gpudra_webhook_tenant_namespace_without_pod_security": (
            {**pod, "exported_namespace": UNENFORCED["namespace"], "tenant": UNENFORCED["tenant"]},
            "1x160",
        ),
        "gpudra_webhook_quota_leader": (pod, "0x160"),
    }
    quiet = [
        ("GpudraWebhookDenialsRising", "150m"),
        ("GpudraWebhookConnectionsShed", "35m"),
        ("GpudraTenantNamespaceWithoutPodSecurity", "15m"),
        ("GpudraTenantQuotasUnwritten", "15m"),
    ]
    unit = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": p.series(name, labels), "values": values}
                    for name, (labels, values) in forged.items()
                ],
                "alert_rule_test": [
                    {"eval_time": at, "alertname": name, "exp_alerts": []} for name, at in quiet
                ],
            }
        ],
    }
    p.write_yaml(tmp_path / "tests.yaml", unit)
    assert "SUCCESS" in p.promtool(prometheus_bin, "test", "rules", "tests.yaml", cwd=tmp_path)


def documented_dcgm_join() -> str:
    """The PromQL docs/monitoring.md gives for joining dcgm-exporter's series."""
    text = (h.REPO / "docs" / "monitoring.md").read_text()
    section = text.split("## Beside dcgm-exporter", 1)[1].split("\n## ", 1)[0]
    (query,) = re.findall(r"```promql\n(.*?)```", section, flags=re.DOTALL)
    return query.strip()


def test_the_documented_dcgm_join_gives_each_pod_its_tenant(
    prometheus_bin: Path, tmp_path: Path
) -> None:
    """dcgm-exporter's DRA labels joined to gpudra's holder labels: each pod's DCGM
    value with its tenant and sharing mode, once per pod even on a shared GPU."""
    dcgm = {"UUID": "GPU-aaaa", "gpu": "0", "dra_driver_name": "gpu.nvidia.com"}
    shared = {**DEVICE, **HOLDER, "sharing": "TimeSlicing"}
    other = {**shared, "pod": "eval", "claim": "eval-gpu", "tenant": "vision"}
    unit = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": p.series(
                            "DCGM_FI_PROF_SM_ACTIVE", {**dcgm, "namespace": "team-a", "pod": pod}
                        ),
                        "values": value,
                    }
                    for pod, value in (("trainer", "0.75x5"), ("eval", "0.25x5"))
                ]
                + [
                    {
                        "series": p.series("gpudra_gpu_utilization_percent", {**SCRAPE, **holder}),
                        "values": "50x5",
                    }
                    for holder in (shared, other)
                ],
                "promql_expr_test": [
                    {
                        "expr": documented_dcgm_join(),
                        "eval_time": "2m",
                        "exp_samples": [
                            {
                                "labels": p.series(
                                    "",
                                    {
                                        "namespace": "team-a",
                                        "pod": "trainer",
                                        "UUID": "GPU-aaaa",
                                        "tenant": "research",
                                        "sharing": "TimeSlicing",
                                    },
                                ),
                                "value": 0.75,
                            },
                            {
                                "labels": p.series(
                                    "",
                                    {
                                        "namespace": "team-a",
                                        "pod": "eval",
                                        "UUID": "GPU-aaaa",
                                        "tenant": "vision",
                                        "sharing": "TimeSlicing",
                                    },
                                ),
                                "value": 0.25,
                            },
                        ],
                    }
                ],
            }
        ],
    }
    p.write_yaml(tmp_path / "tests.yaml", unit)
    assert "SUCCESS" in p.promtool(prometheus_bin, "test", "rules", "tests.yaml", cwd=tmp_path)
