"""The API server authenticates itself to the webhook by client certificate, set up as
docs/install.md ("Who may call the webhook") tells a cluster's admin to: the harness
starts the API server with an admission kubeConfigFile whose user, named
`<fullname>-webhook.<namespace>.svc:<webhook.port>`, holds a certificate the cluster's
CA signed (`AdmissionClient`), and the chart on the real node is installed with
webhook.clientAuth: that CA as caCert, the certificate's common name as allowedNames.

The API server's calls through both plugins are served (a legacy pod converted, a bad
claim denied with the webhook's own reason, where failurePolicy Fail would have named a
failed call), while a caller without that certificate, or with another the same CA
signed, is refused before any HTTP: so it was the certificate that let the API server
in, under the user name the doc gives."""

from __future__ import annotations

import base64
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpudra.webhook.certs import service_dns_names

from e2e import smoke
from e2e.cluster.harness import AdmissionClient, Cluster
from e2e.cluster.kube import ApiError, Kube
from e2e.node.chart import NAMESPACE, RELEASE, ChartStack, chart_node_unavailable_reason
from e2e.node.gpus import DRIVER, installed
from e2e.node.realnode import RealNode
from e2e.processes import free_port
from e2e.provider import local_only
from e2e.tests.escape.test_claims import claim, gpu_config
from e2e.tests.test_webhook import legacy_pod

pytestmark = [
    pytest.mark.cluster,
    local_only("the local harness gives its API server the admission client certificate"),
]


class ClientAuthChart(ChartStack):
    """The chart's release with webhook.clientAuth as docs/install.md has it installed:
    `--set webhook.clientAuth.enabled=true --set-file webhook.clientAuth.caCert=ca.crt
    --set 'webhook.clientAuth.allowedNames={<common name>}'`, on the port the API
    server's kubeconfig user names. The probes' port is one free here, since the webhook
    shares the host's network."""

    def __init__(self, node: RealNode, client: AdmissionClient) -> None:
        super().__init__(node)
        self.client = client
        self.health_port = free_port()

    def values(
        self,
        *,
        node_args: list[str] | None = None,
        api_port: int | None = None,
        driver_root: Path | None = None,
    ) -> dict[str, Any]:
        values = super().values(node_args=node_args, api_port=api_port, driver_root=driver_root)
        values["webhook"]["port"] = self.client.port
        values["webhook"]["clientAuth"] = {
            "enabled": True,
            "caCert": self.client.ca.read_text(),
            "allowedNames": [self.client.common_name],
            "healthPort": self.health_port,
        }
        return values


@pytest.fixture(scope="module")
def chart(cluster: Cluster) -> Iterator[ClientAuthChart]:
    client = cluster.admission_client()
    if client is None:
        pytest.skip(
            "the running cluster's API server was started without the admission client "
            "certificate: run `make cluster-down cluster-up`"
        )
    assert (client.service, client.namespace) == (f"{RELEASE}-webhook", NAMESPACE)
    if reason := chart_node_unavailable_reason():
        pytest.skip(reason)
    node = RealNode(cluster)
    node.up(log=lambda _m: None)
    try:
        yield from installed(ClientAuthChart(node, client))
    finally:
        node.down(log=lambda _m: None)


@pytest.fixture
def ns(chart: ClientAuthChart, kube: Kube) -> Iterator[str]:
    name = smoke.make_namespace(kube, "client-auth")
    yield name
    kube.delete("Namespace", name)


def registered_services(kube: Kube) -> list[dict[str, Any]]:
    """Where the API server is told to call each of the release's webhooks."""
    configs = [
        *kube.list("MutatingWebhookConfiguration"),
        *kube.list("ValidatingWebhookConfiguration"),
    ]
    return [
        w["clientConfig"]["service"]
        for c in configs
        if c["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE
        for w in c.get("webhooks", [])
    ]


def test_the_api_server_presents_the_certificate_through_both_plugins(
    chart: ClientAuthChart, kube: Kube, ns: str
) -> None:
    """The user name holds for what the chart registers: every webhook of the release
    is its Service in its namespace at webhook.port, the host and port the API server
    looks the kubeconfig user up by. Both plugins then reach the webhook: the mutating
    one converts a legacy pod, the validating one gets the webhook's own denial."""
    client = chart.client
    services = registered_services(kube)
    assert len(services) >= 2
    for service in services:
        host_port = f"{service['name']}.{service['namespace']}.svc:{service['port']}"
        assert host_port == client.user

    pod = legacy_pod(ns, "legacy", {"nvidia.com/gpu": "1"})
    converted = kube.create(pod, dryRun="All")["spec"]
    assert "nvidia.com/gpu" not in converted["containers"][0]["resources"].get("limits", {})
    (pod_claim,) = converted["resourceClaims"]
    assert pod_claim["resourceClaimTemplateName"] == "gpudra-gpu-1"

    bad = claim(ns, "bad-config", {"deviceClassName": DRIVER}, gpu_config("Sometimes"))
    with pytest.raises(ApiError) as denied:
        kube.create(bad)
    body = str(denied.value.body)
    assert 'admission webhook "resourceclaims.gpudra.nvidia.com" denied the request' in body
    assert "sharing.strategy" in body
    assert "failed calling webhook" not in body


def webhook_address(kube: Kube, client: AdmissionClient) -> tuple[str, int]:
    """The address the API server calls: the one endpoint of the webhook's Service."""
    path = f"/apis/discovery.k8s.io/v1/namespaces/{client.namespace}/endpointslices"
    query = {"labelSelector": f"kubernetes.io/service-name={client.service}"}
    slices = kube.request("GET", path, query=query)["items"]
    (address,) = [a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]]
    (port,) = {p["port"] for s in slices for p in s.get("ports") or []}
    return str(address), int(port)


def serving_ca(kube: Kube) -> str:
    """The CA the API server verifies the webhook's serving certificate with."""
    (bundle,) = {
        w["clientConfig"]["caBundle"]
        for c in kube.list("MutatingWebhookConfiguration")
        if c["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE
        for w in c["webhooks"]
    }
    return base64.b64decode(bundle).decode()


def review_request() -> bytes:
    """A review of a pod without GPUs, as anyone who reaches the port can send one."""
    body = json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "forged",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "default",
                "operation": "CREATE",
                "userInfo": {"username": "forger"},
                "object": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "p", "namespace": "default"},
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                },
            },
        }
    ).encode()
    head = (
        f"POST /mutate-pods HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def answer(address: tuple[str, int], ca: str, identity: tuple[Path, Path] | None) -> str | None:
    """The status line the webhook answers a review with on a fresh connection,
    presenting `identity` (certificate and key files) or no certificate; None when it
    closes the connection before any HTTP (TLS 1.3 reports a refused certificate at the
    client's first read, earlier versions during the handshake)."""
    context = ssl.create_default_context(cadata=ca)
    if identity is not None:
        context.load_cert_chain(*identity)
    server_name = service_dns_names(f"{RELEASE}-webhook", NAMESPACE)[0]
    try:
        with (
            socket.create_connection(address, timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=server_name) as tls,
        ):
            tls.sendall(review_request())
            head = b""
            while b"\r\n" not in head:
                chunk = tls.recv(4096)
                if not chunk:
                    return None
                head += chunk
    except (ssl.SSLError, ConnectionError):
        return None
    return head.split(b"\r\n", 1)[0].decode()


def test_a_caller_without_the_certificate_is_refused(
    chart: ClientAuthChart, cluster: Cluster, kube: Kube
) -> None:
    """The same review sent straight to the webhook's port: answered with the API
    server's certificate (so the address and the serving CA are right), refused without
    one, and refused with the admin's certificate, which the same CA signed for client
    authentication but under a name allowedNames leaves out."""
    client = chart.client
    address = webhook_address(kube, client)
    ca = serving_ca(kube)
    pk = cluster.layout.pki
    assert answer(address, ca, (client.cert, client.key)) == "HTTP/1.1 200 OK"
    assert answer(address, ca, None) is None
    assert answer(address, ca, (pk / "admin.crt", pk / "admin.key")) is None
