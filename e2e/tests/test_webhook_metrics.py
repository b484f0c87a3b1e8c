"""The chart's webhook PodMonitor and alert rules against the real webhook: a real
Prometheus scrapes it over HTTPS as the Prometheus Operator would scrape from the
chart's PodMonitor, and what the API server and the tenant controller make it count
arrives under the job the webhook's alerts read, with the labels the alerts name."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.api.tenants import API_VERSION, crd_manifest
from gpudra.common.kube import Kube
from gpudra.webhook.certs import CA_CERT

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, apply_crd
from e2e.cluster.kube import Kube as SyncKube
from e2e.tools import helm as h
from e2e.tools import prometheus as p
from e2e.webhook_env import (
    call,
    register_webhook,
    serving_config,
    tenant_webhook,
    unregister_webhook,
)

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
TENANTS = f"/apis/{API_VERSION}/gputenants"


@dataclass(frozen=True)
class Served:
    """Where Prometheus reaches the webhook, and the CA of its serving certificate (the
    file a TLS Secret's ca.crt would be): its certificate names the Service of the
    chart's default release, gpudra-webhook in namespace gpudra."""

    address: str
    ca_file: Path


@pytest.fixture
async def webhook(cluster: Cluster, kube: SyncKube, tmp_path: Path) -> AsyncIterator[Served]:
    """The webhook with tenant rules, serving from this event loop and registered with
    the API server."""
    apply_crd(kube, crd_manifest())
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    pki_dir = tmp_path / "pki"
    pki, config = serving_config(cluster, pki_dir)
    controller, server = tenant_webhook(akube, config)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        await tg.start(controller.run)
        address = f"{cluster.webhook_host()}:{port}"
        await register_webhook(akube, pki, config, f"https://{address}")
        yield Served(address, pki_dir / CA_CERT)
        await unregister_webhook(akube)
        tg.cancel_scope.cancel()
    await akube.close()


async def until(what: str, probe: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """`probe`'s first non-empty answer, asked off the event loop the webhook serves
    from (Prometheus scrapes it meanwhile)."""
    try:
        with anyio.fail_after(90):
            while not (found := await call(probe)):
                await anyio.sleep(0.5)
            return found
    except TimeoutError:
        raise AssertionError(f"timed out after 90s waiting for {what}") from None


@pytest.mark.parametrize("source", ["helm", "self"])
async def test_prometheus_scrapes_the_webhook_as_the_chart_says(
    webhook: Served, kube: SyncKube, tmp_path: Path, source: str
) -> None:
    """Scraped over HTTPS as the chart's PodMonitor says (tls.source=helm: verified with
    the CA and the Service's name; self: unverified), the webhook's series arrive under
    the job the webhook's alerts read: a denial the API server asked for is in the
    series GpudraWebhookDenialsRising selects, and a tenant namespace without Pod
    Security makes GpudraTenantNamespaceWithoutPodSecurity pending with that namespace
    and tenant (its own labels, kept over the webhook pod's)."""
    try:
        helm, prometheus = await call(h.helm_binary), await call(p.bin_dir)
    except (h.HelmUnavailable, p.PrometheusUnavailable) as e:
        pytest.skip(str(e))
    monitoring = {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    values = {"webhook": {"tls": {"source": source}}, "monitoring": monitoring}
    objects = await call(h.template, helm, values)
    monitor = p.pod_monitor(objects, "webhook")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    assert job == "gpudra-webhook"
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    denied_expr = alerts["GpudraWebhookDenialsRising"]["expr"]
    (denials,) = set(re.findall(r"gpudra_webhook_denials_total\{[^}]*\}", denied_expr))
    ca_file = webhook.ca_file if "ca" in endpoint["tlsConfig"] else None
    serving = p.serve(
        prometheus,
        tmp_path / "prometheus",
        targets=[webhook.address],
        rules=p.rule_groups(rule),
        pod_monitor=monitor,
        ca_file=ca_file,
    )
    prom = await call(serving.__enter__)
    ns = tenant = ""
    try:
        # The webhook counts the scrapes themselves: its series from the second one on.
        scraped = f'gpudra_webhook_requests_total{{job="{job}", path="/metrics"}}'
        await until("a scrape of the webhook", lambda: prom.query(scraped))
        assert await call(prom.targets_up), await call(prom.log_tail)

        ns = await call(smoke.make_namespace, kube, "metrics")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"namespace": ns, "name": "unknown-profile"},
            "spec": {
                "containers": [
                    {
                        "name": "cuda",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {"nvidia.com/mig-9g.99gb": "1"}},
                    }
                ]
            },
        }
        with pytest.raises(ApiError) as err:
            await call(kube.create, pod)
        assert "9g.99gb" in str(err.value)
        name = f"t-{ns}"
        body = {"apiVersion": API_VERSION, "kind": "GpuTenant", "metadata": {"name": name}}
        await call(kube.request, "POST", TENANTS, {**body, "spec": {"namespaces": [ns]}})
        tenant = name

        def invalid() -> list[dict[str, Any]]:
            return [s for s in prom.query(denials) if s["metric"].get("reason") == "invalid"]

        (denial,) = await until(f"the denial in {denials}", invalid)
        assert denial["metric"]["job"] == job
        assert float(denial["value"][1]) >= 1

        def pending() -> list[dict[str, Any]]:
            return [
                a
                for a in prom.alerts()
                if a["labels"]["alertname"] == "GpudraTenantNamespaceWithoutPodSecurity"
                and a["labels"].get("namespace") == ns
            ]

        (gap,) = await until(f"the alert naming {ns}", pending)
        assert gap["labels"]["tenant"] == tenant
    finally:
        if tenant:
            await call(kube.request, "DELETE", f"{TENANTS}/{tenant}")
        if ns:
            await call(kube.delete, "Namespace", ns)
        await call(serving.__exit__, None, None, None)
