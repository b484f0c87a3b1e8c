"""The caBundle controller and the self-signed rotation against the real API server."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from gpudra.common.kube import Kube
from gpudra.webhook.cabundle import (
    LEASE_PREFIX,
    CABundleController,
    ConfigurationKind,
    SelfSignedRotation,
    WebhookConfiguration,
    certificates,
    fingerprint,
)
from gpudra.webhook.certs import (
    WebhookPki,
    generate_ca,
    generate_serving_cert,
    load_pki,
    service_dns_names,
    store_pki,
)

from e2e.cluster.kube import Kube as SyncKube
from e2e.cluster.kube import field_managers

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
API = "/apis/admissionregistration.k8s.io/v1"
NAMES = service_dns_names("gpudra-webhook", "gpudra")
GUARD = 60  # seconds: only a hang guard, never a speed check


def configuration(kind: ConfigurationKind, name: str, ca_bundle: str = "") -> dict[str, Any]:
    """Two webhooks that never match anything (their label is never set)."""
    webhook_kind = "Mutating" if kind is ConfigurationKind.MUTATING else "Validating"
    hooks = []
    for i in range(2):
        client: dict[str, Any] = {"url": f"https://127.0.0.1:1/never-{i}"}
        if ca_bundle:
            client["caBundle"] = ca_bundle
        hooks.append(
            {
                "name": f"h{i}.test.gpudra.nvidia.com",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Ignore",
                "clientConfig": client,
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["configmaps"],
                    }
                ],
                "objectSelector": {"matchLabels": {"gpudra-test-never": "true"}},
            }
        )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": f"{webhook_kind}WebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": hooks,
    }


class Configs:
    """Creates, edits and reads configurations through the test's own client."""

    def __init__(self, kube: SyncKube) -> None:
        self.kube = kube
        self.created: list[WebhookConfiguration] = []

    def ref(self, kind: ConfigurationKind) -> WebhookConfiguration:
        return WebhookConfiguration(kind, f"gpudra-test-{uuid.uuid4().hex[:8]}")

    async def create(self, ref: WebhookConfiguration, ca_bundle: str = "") -> None:
        self.created.append(ref)
        body = configuration(ref.kind, ref.name, ca_bundle)
        await anyio.to_thread.run_sync(
            lambda: self.kube.request("POST", f"{API}/{ref.kind.value}", body)
        )

    async def get(self, ref: WebhookConfiguration) -> Any:
        return await anyio.to_thread.run_sync(
            lambda: self.kube.request("GET", f"{API}/{ref.kind.value}/{ref.name}")
        )

    async def bundles(self, ref: WebhookConfiguration) -> list[str | None]:
        obj = await self.get(ref)
        return [w["clientConfig"].get("caBundle") for w in obj["webhooks"]]

    async def bundle_managers(self, ref: WebhookConfiguration) -> set[str]:
        """The field managers the API server records as owning a webhook's caBundle:
        whom an apply that sets it (a chart's) conflicts with."""
        return field_managers(await self.get(ref), "caBundle")

    async def leases(self, ref: WebhookConfiguration) -> set[str]:
        """The fingerprints of the CA leases on the configuration."""
        obj = await self.get(ref)
        found = obj["metadata"].get("annotations") or {}
        return {k.removeprefix(LEASE_PREFIX) for k in found if k.startswith(LEASE_PREFIX)}

    async def set_bundle(self, ref: WebhookConfiguration, index: int, value: str) -> None:
        patch = [{"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": value}]
        await anyio.to_thread.run_sync(
            lambda: self.kube.request(
                "PATCH",
                f"{API}/{ref.kind.value}/{ref.name}",
                patch,
                content_type="application/json-patch+json",
            )
        )

    async def wait_bundles(self, ref: WebhookConfiguration, expected: str) -> None:
        with anyio.fail_after(GUARD):
            while await self.bundles(ref) != [expected, expected]:
                await anyio.sleep(0.1)

    def cleanup(self) -> None:
        for ref in self.created:
            with contextlib.suppress(Exception):  # best-effort cleanup
                self.kube.request("DELETE", f"{API}/{ref.kind.value}/{ref.name}")


@pytest.fixture
def configs(kube: SyncKube) -> Any:
    c = Configs(kube)
    yield c
    c.cleanup()


def b64(pem: bytes) -> str:
    return base64.b64encode(pem).decode()


async def test_bundle_is_written_and_restored_after_edits(akube: Kube, configs: Configs) -> None:
    mutating = configs.ref(ConfigurationKind.MUTATING)
    validating = configs.ref(ConfigurationKind.VALIDATING)
    await configs.create(mutating)  # as a chart would: no caBundle yet
    await configs.create(validating, ca_bundle=b64(generate_ca().cert_pem))  # a stale one
    bundle = generate_ca().cert_pem
    controller = CABundleController(akube, [mutating, validating])
    controller.set_bundle(bundle)
    async with anyio.create_task_group() as tg:
        await tg.start(controller.run)
        with anyio.fail_after(GUARD):
            published = await controller.wait_published(bundle)
        assert published <= dt.datetime.now(dt.UTC)
        assert await configs.bundles(mutating) == [b64(bundle)] * 2
        assert await configs.bundles(validating) == [b64(bundle)] * 2
        # Recorded as the webhook's, which is whom a chart's conflicting apply names.
        assert await configs.bundle_managers(mutating) == {"gpudra-webhook"}

        # Someone empties one webhook's bundle (a chart re-apply): it comes back.
        await configs.set_bundle(mutating, 1, "")
        await configs.wait_bundles(mutating, b64(bundle))
        await configs.set_bundle(validating, 0, b64(generate_ca().cert_pem))
        await configs.wait_bundles(validating, b64(bundle))

        # A rotation: the new bundle reaches both configurations.
        rotated = generate_ca().cert_pem + bundle
        controller.set_bundle(rotated)
        with anyio.fail_after(GUARD):
            await controller.wait_published(rotated)
        assert controller.published_at(bundle) is None
        assert await configs.bundles(mutating) == [b64(rotated)] * 2
        assert await configs.bundles(validating) == [b64(rotated)] * 2
        tg.cancel_scope.cancel()


async def test_configuration_created_later_gets_the_bundle(akube: Kube, configs: Configs) -> None:
    ref = configs.ref(ConfigurationKind.VALIDATING)
    bundle = generate_ca().cert_pem
    controller = CABundleController(akube, [ref])
    controller.set_bundle(bundle)
    async with anyio.create_task_group() as tg:
        await tg.start(controller.run)
        # A configuration that does not exist calls nobody: nothing to wait for.
        with anyio.fail_after(GUARD):
            await controller.wait_published(bundle)
        await configs.create(ref)
        await configs.wait_bundles(ref, b64(bundle))
        tg.cancel_scope.cancel()


async def test_trusted_only_once_the_bundle_is_in_every_configuration(
    akube: Kube, configs: Configs
) -> None:
    """Readiness of a pod with its own CA: a restarted pod makes a new CA, and must get
    no traffic until the API server has it; a later CA rotation keeps it ready."""
    mutating = configs.ref(ConfigurationKind.MUTATING)
    validating = configs.ref(ConfigurationKind.VALIDATING)
    previous_pod = b64(generate_ca().cert_pem)
    await configs.create(mutating, ca_bundle=previous_pod)
    await configs.create(validating, ca_bundle=previous_pod)
    bundle = generate_ca().cert_pem
    controller = CABundleController(akube, [mutating, validating])
    controller.set_bundle(bundle)
    assert not controller.trusted
    async with anyio.create_task_group() as tg:
        await tg.start(controller.run)
        await wait_until(lambda: controller.trusted)
        # What the API server holds when the pod turns ready: its bundle, everywhere.
        assert await configs.bundles(mutating) == [b64(bundle)] * 2
        assert await configs.bundles(validating) == [b64(bundle)] * 2
        controller.set_bundle(generate_ca().cert_pem + bundle)
        assert controller.trusted
        tg.cancel_scope.cancel()


async def test_a_rollout_trusts_the_old_and_the_new_pod_until_the_window_ends(
    akube: Kube, configs: Configs
) -> None:
    """``tls.source=self`` rollout: the new pod (B) makes a new CA while the old pod (A)
    still serves. Both CAs stay trusted while A runs, however long past the window (a
    surge pod that never turns Ready), A and B write the same bundle instead of fighting,
    and A's CA goes once A is gone and its lease has lapsed."""
    window = 4.0
    mutating = configs.ref(ConfigurationKind.MUTATING)
    validating = configs.ref(ConfigurationKind.VALIDATING)
    old, new = generate_ca().cert_pem, generate_ca().cert_pem
    await configs.create(mutating, ca_bundle=b64(old))
    await configs.create(validating, ca_bundle=b64(old))
    both = b64(b"".join(sorted([*certificates(old), *certificates(new)])))
    a = CABundleController(akube, [mutating, validating], keep_foreign_s=window, holder="a")
    b = CABundleController(akube, [mutating, validating], keep_foreign_s=window, holder="b")
    a.set_bundle(old)
    b.set_bundle(new)
    async with anyio.create_task_group() as tg:
        old_pod = anyio.CancelScope()

        async def run_a() -> None:
            with old_pod:
                await a.run()

        tg.start_soon(run_a)
        await wait_until(lambda: a.trusted)
        await tg.start(b.run)
        await wait_until(lambda: b.trusted)
        await configs.wait_bundles(mutating, both)
        await configs.wait_bundles(validating, both)
        assert a.desired_b64() == b.desired_b64() == both
        # Settled, past the window: the bundle stays; only lease renewals are written
        # (four per window, pod and configuration).
        patches = a.patches + b.patches
        end = anyio.current_time() + 2.5 * window
        while anyio.current_time() < end:
            assert await configs.bundles(mutating) == [both, both]
            assert await configs.bundles(validating) == [both, both]
            await anyio.sleep(0.2)
        assert a.patches + b.patches - patches <= 2 * 2 * (4 * 3 + 1)
        assert a.undone == b.undone == 0
        leases = {fingerprint(certificates(pem)[0]) for pem in (old, new)}
        assert await configs.leases(mutating) == await configs.leases(validating) == leases

        old_pod.cancel()  # A has terminated; B drops its CA when A's lease lapses
        await configs.wait_bundles(mutating, b64(new))
        await configs.wait_bundles(validating, b64(new))
        assert b.trusted
        assert await configs.leases(mutating) == {fingerprint(certificates(new)[0])}
        tg.cancel_scope.cancel()


def issued_by(cert: Any, ca: Any) -> bool:
    try:
        cert.certificate.verify_directly_issued_by(ca.certificate)
    except Exception:
        return False
    return True


def old_pki(directory: Path) -> WebhookPki:
    """A CA two thirds through its life (due for rotation) and a fresh serving cert."""
    now = dt.datetime.now(dt.UTC)
    ca = generate_ca(now=now - dt.timedelta(days=2500))
    pki = WebhookPki(ca=ca, serving=generate_serving_cert(ca, NAMES, now=now))
    store_pki(directory, pki)
    return pki


async def wait_until(check: Callable[[], bool]) -> None:
    with anyio.fail_after(GUARD):
        while not check():
            await anyio.sleep(0.05)


async def test_ca_rotation_serves_the_new_ca_only_after_the_bundle_is_published(
    akube: Kube, configs: Configs, tmp_path: Path
) -> None:
    ref = configs.ref(ConfigurationKind.MUTATING)
    await configs.create(ref)
    directory = tmp_path / "pki"
    before = old_pki(directory)
    controller = CABundleController(akube, [ref])
    rotation = SelfSignedRotation(
        directory, NAMES, controller, ca_propagation=dt.timedelta(seconds=1)
    )
    async with anyio.create_task_group() as tg:
        await tg.start(controller.run)
        await tg.start(rotation.run)
        # The first check rotated the CA: both CAs are trusted, the old one still signs.
        during = load_pki(directory)
        assert during is not None
        assert during.ca != before.ca and during.previous_ca == before.ca
        assert issued_by(during.serving, before.ca)
        assert controller.bundle == during.ca_bundle
        await configs.wait_bundles(ref, b64(during.ca_bundle))

        def switched() -> bool:
            try:
                now = load_pki(directory)
            except ValueError:  # read between the key and the certificate being replaced
                return False
            return now is not None and issued_by(now.serving, now.ca)

        await wait_until(switched)
        after = load_pki(directory)
        assert after is not None and after.ca == during.ca
        published = controller.published_at(after.ca_bundle)
        assert published is not None
        # Issued no earlier than one propagation delay after the bundle was confirmed.
        issued = after.serving.not_before + dt.timedelta(minutes=5)
        assert issued >= published
        assert await configs.bundles(ref) == [b64(after.ca_bundle)] * 2
        tg.cancel_scope.cancel()
