"""Certificate and CA rotation under load: the real API server keeps calling the
webhook while the serving certificate and the CA are replaced, and no request fails."""

from __future__ import annotations

import datetime as dt
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from anyio.streams.tls import TLSAttribute
from cryptography import x509
from gpudra.common.kube import Kube
from gpudra.webhook import registration
from gpudra.webhook.cabundle import (
    CABundleController,
    ConfigurationKind,
    SelfSignedRotation,
    WebhookConfiguration,
)
from gpudra.webhook.certs import (
    TLS_CERT,
    TLS_KEY,
    CertKeyPair,
    WebhookPki,
    generate_ca,
    generate_serving_cert,
    load_pki,
    service_dns_names,
    store_pki,
)
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.templates import ApiTemplateEnsurer

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube as SyncKube

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
NAMES = service_dns_names("gpudra-webhook", "gpudra")
GUARD = 120  # seconds: only a hang guard, never a speed check
CREATES_PER_S = 8


@dataclass
class Load:
    """Dry-run creates of legacy GPU pods, started on a fixed schedule."""

    kube: SyncKube
    namespace: str
    converted: int = 0
    failures: list[str] = field(default_factory=list)

    def pod(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"namespace": self.namespace, "generateName": "rot-"},
            "spec": {
                "containers": [
                    {
                        "name": "cuda",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }
                ]
            },
        }

    async def one(self) -> None:
        try:
            pod = await anyio.to_thread.run_sync(lambda: self.kube.create(self.pod(), dryRun="All"))
        except Exception as exc:
            self.failures.append(str(exc))
            return
        claims = pod["spec"].get("resourceClaims") or []
        if [c.get("resourceClaimTemplateName") for c in claims] == ["gpudra-gpu-1"]:
            self.converted += 1
        else:
            self.failures.append(f"pod admitted unconverted: {pod['spec']}")

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                tg.start_soon(self.one)
                await anyio.sleep(1 / CREATES_PER_S)

    async def wait_for(self, converted: int) -> None:
        with anyio.fail_after(GUARD):
            while self.converted < converted and not self.failures:
                await anyio.sleep(0.05)


def due_pki(directory: Path, host: str) -> WebhookPki:
    """A CA two thirds through its ten years (due for rotation) and a serving
    certificate for `host` two thirds through its year (due as well), both valid today."""
    now = dt.datetime.now(dt.UTC)
    ca = generate_ca(now=now - dt.timedelta(days=2500))
    serving = generate_serving_cert(
        ca, NAMES, ip_addresses=(host,), now=now - dt.timedelta(days=250)
    )
    pki = WebhookPki(ca=ca, serving=serving)
    store_pki(directory, pki)
    return pki


def issued_by(cert: CertKeyPair | x509.Certificate, ca: CertKeyPair) -> bool:
    c = cert.certificate if isinstance(cert, CertKeyPair) else cert
    try:
        c.verify_directly_issued_by(ca.certificate)
    except Exception:
        return False
    return True


async def served_certificate(host: str, port: int, trust: bytes) -> x509.Certificate:
    """The certificate a new connection gets, verified against `trust` only."""
    context = ssl.create_default_context(cadata=trust.decode())
    stream = await anyio.connect_tcp(
        host,
        port,
        tls=True,
        ssl_context=context,
        tls_hostname=NAMES[0],
        tls_standard_compatible=False,
    )
    try:
        der = stream.extra(TLSAttribute.peer_certificate_binary)
    finally:
        await anyio.aclose_forcefully(stream)
    assert der is not None
    return x509.load_der_x509_certificate(der)


@dataclass
class Webhook:
    host: str
    port: int
    directory: Path
    before: WebhookPki
    controller: CABundleController
    rotation: SelfSignedRotation


@pytest.fixture
async def webhook(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Webhook]:
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    directory = tmp_path / "pki"
    host = cluster.webhook_host()  # kind's API server dials the host's address on its network
    before = due_pki(directory, host)
    server = WebhookServer(
        ServerConfig(
            cert_file=directory / TLS_CERT,
            key_file=directory / TLS_KEY,
            host=host,
            port=0,
            cert_check_interval=0.1,
        ),
        ApiTemplateEnsurer(akube),
    )
    controller = CABundleController(
        akube, [WebhookConfiguration(ConfigurationKind.MUTATING, registration.NAME)]
    )
    rotation = SelfSignedRotation(
        directory,
        NAMES,
        controller,
        ca_propagation=dt.timedelta(seconds=2),
        ip_addresses=(host,),
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        await registration.apply(
            akube,
            registration.mutating_configuration(
                ca_bundle_b64=before.ca_bundle_base64(),
                own_namespace="gpudra",
                url=f"https://{host}:{port}",
            ),
        )
        controller.set_bundle(before.ca_bundle)
        await tg.start(controller.run)
        yield Webhook(host, port, directory, before, controller, rotation)
        await registration.delete(akube)
        tg.cancel_scope.cancel()
    await akube.close()


async def test_serving_and_ca_rotation_under_load_fail_no_request(
    webhook: Webhook, kube: SyncKube
) -> None:
    ns = smoke.make_namespace(kube, "rotate")
    load = Load(kube, ns)
    before = webhook.before
    async with anyio.create_task_group() as tg:
        tg.start_soon(load.run)
        await load.wait_for(20)

        # Rotation is due for both: the CA is replaced (the old one stays trusted) and
        # the serving certificate is reissued, still by the old CA.
        await tg.start(webhook.rotation.run)
        during = load_pki(webhook.directory)
        assert during is not None
        assert during.ca != before.ca and during.previous_ca == before.ca
        assert during.serving != before.serving and issued_by(during.serving, before.ca)

        # Once the bundle with both CAs is in the configuration, the new CA signs.
        with anyio.fail_after(GUARD):
            while not issued_by(
                await served_certificate(webhook.host, webhook.port, during.ca_bundle), during.ca
            ):
                assert not load.failures, load.failures[:3]
                await anyio.sleep(0.1)
        switched_at = load.converted
        await load.wait_for(switched_at + 40)
        tg.cancel_scope.cancel()

    assert load.failures == []
    after = load_pki(webhook.directory)
    assert during is not None and after is not None
    assert after.ca == during.ca and after.previous_ca == before.ca
    # New connections get the new certificate, verified with the new CA alone.
    served = await served_certificate(webhook.host, webhook.port, after.ca.cert_pem)
    assert served == after.serving.certificate
    assert issued_by(served, after.ca) and not issued_by(served, before.ca)
    config = await anyio.to_thread.run_sync(
        lambda: kube.request("GET", f"{registration.PATH}/{registration.NAME}")
    )
    assert config["webhooks"][0]["clientConfig"]["caBundle"] == after.ca_bundle_base64()
    kube.delete("Namespace", ns)
