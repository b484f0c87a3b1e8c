"""The real API server calls the conversion webhook over HTTPS; the converted pod's
claim is created by the controller-manager and allocated by the real scheduler."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from gpudra.api.deviceclasses import device_classes
from gpudra.common.kube import Kube
from gpudra.webhook import registration
from gpudra.webhook.server import WebhookServer
from gpudra.webhook.templates import ApiTemplateEnsurer

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError
from e2e.cluster.kube import Kube as SyncKube
from e2e.node_process import delete_slices
from e2e.webhook_env import EmulatedNode, serving_config, start_emulated_nodes

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"


@pytest.fixture
async def webhook(cluster: Cluster, kube: SyncKube, tmp_path: Path) -> AsyncIterator[None]:
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    pki, config = serving_config(cluster, tmp_path / "pki")
    server = WebhookServer(config, ApiTemplateEnsurer(akube))
    nodes = [
        EmulatedNode("worker-1", "emulated:h100-80gb-hbm3-x8", uuid_salt="wh"),
        # A second node with MIG devices (1g.5gb, 2g.10gb, 3g.20gb, ...) for MIG pods.
        EmulatedNode("worker-2", "emulated:a100-40gb-mig-mixed", uuid_salt="wh-mig"),
    ]
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        await start_emulated_nodes(tg, akube, DRIVER, nodes)
        await registration.apply(
            akube,
            registration.mutating_configuration(
                ca_bundle_b64=pki.ca_bundle_base64(),
                own_namespace="gpudra",
                url=f"https://{cluster.webhook_host()}:{port}",
            ),
        )
        yield
        await registration.delete(akube)
        tg.cancel_scope.cancel()
    delete_slices(kube, DRIVER)
    await akube.close()


def legacy_pod(ns: str, name: str, limits: dict[str, str], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, **({"name": name} if name else {}), **meta},
        "spec": {
            "containers": [
                {
                    "name": "cuda",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": limits},
                }
            ]
        },
    }


async def allocated(kube: SyncKube, ns: str, pod: str) -> list[dict[str, Any]]:
    with anyio.fail_after(60):
        while True:
            p = kube.get("Pod", pod, ns)
            st = p.get("status", {}).get("resourceClaimStatuses") or []
            if p["spec"].get("nodeName") and st and st[0].get("resourceClaimName"):
                c = kube.get("ResourceClaim", st[0]["resourceClaimName"], ns)
                res: list[dict[str, Any]] = c["status"]["allocation"]["devices"]["results"]
                return res
            await anyio.sleep(0.2)


async def test_legacy_gpu_pod_is_converted_and_allocated(webhook: None, kube: SyncKube) -> None:
    ns = smoke.make_namespace(kube, "legacy")
    # The webhook serves from this event loop: blocking calls go to a worker thread.
    created = await anyio.to_thread.run_sync(
        kube.create, legacy_pod(ns, "", {"nvidia.com/gpu": "2"}, generateName="train-")
    )
    name = created["metadata"]["name"]
    spec = created["spec"]
    assert "nvidia.com/gpu" not in spec["containers"][0]["resources"].get("limits", {})
    (pod_claim,) = spec["resourceClaims"]
    assert pod_claim["resourceClaimTemplateName"] == "gpudra-gpu-2"
    assert spec["containers"][0]["resources"]["claims"][0]["name"] == pod_claim["name"]
    results = await allocated(kube, ns, name)
    assert len(results) == 2 and {r["pool"] for r in results} == {"worker-1"}
    assert len({r["device"] for r in results}) == 2
    kube.delete("Namespace", ns)


async def test_dry_run_creates_no_template(webhook: None, kube: SyncKube) -> None:
    ns = smoke.make_namespace(kube, "dry")
    await anyio.to_thread.run_sync(
        lambda: kube.create(legacy_pod(ns, "p", {"nvidia.com/gpu": "3"}), dryRun="All")
    )
    assert kube.get_or_none("ResourceClaimTemplate", "gpudra-gpu-3", ns) is None
    assert kube.get_or_none("Pod", "p", ns) is None
    kube.delete("Namespace", ns)


async def test_bad_count_is_denied_with_reason(webhook: None, kube: SyncKube) -> None:
    ns = smoke.make_namespace(kube, "bad")
    with pytest.raises(ApiError) as err:
        await anyio.to_thread.run_sync(
            kube.create, legacy_pod(ns, "p", {"nvidia.com/mig-9g.99gb": "1"})
        )
    assert "9g.99gb" in str(err.value)
    kube.delete("Namespace", ns)


async def test_non_gpu_pods_never_reach_the_webhook(webhook: None, kube: SyncKube) -> None:
    ns = smoke.make_namespace(kube, "plain")
    pod = await anyio.to_thread.run_sync(kube.create, legacy_pod(ns, "p", {"cpu": "1"}))
    assert "resourceClaims" not in pod["spec"]
    kube.delete("Namespace", ns)


async def test_mig_pod_gets_a_device_of_its_profile(webhook: None, kube: SyncKube) -> None:
    ns = smoke.make_namespace(kube, "mig")
    created = await anyio.to_thread.run_sync(
        kube.create, legacy_pod(ns, "mig", {"nvidia.com/mig-1g.5gb": "1"})
    )
    (pod_claim,) = created["spec"]["resourceClaims"]
    assert pod_claim["resourceClaimTemplateName"] == "gpudra-mig-1g5gb-1"
    (result,) = await allocated(kube, ns, "mig")
    assert result["pool"] == "worker-2"
    slices = [s for s in kube.list("ResourceSlice") if s["spec"]["pool"]["name"] == "worker-2"]
    device = next(
        d for s in slices for d in s["spec"].get("devices", []) if d["name"] == result["device"]
    )
    assert device["attributes"]["profile"]["string"] == "1g.5gb"
    kube.delete("Namespace", ns)


async def test_init_containers_reuse_the_app_containers_devices(
    webhook: None, kube: SyncKube
) -> None:
    ns = smoke.make_namespace(kube, "init")
    pod = legacy_pod(ns, "init", {"nvidia.com/gpu": "1"})
    app = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**app, "name": "a"}, {**app, "name": "b"}]
    pod["spec"]["initContainers"] = [
        {**app, "name": "setup", "resources": {"limits": {"nvidia.com/gpu": "2"}}}
    ]
    created = await anyio.to_thread.run_sync(kube.create, pod)
    spec = created["spec"]
    (pod_claim,) = spec["resourceClaims"]
    name = pod_claim["name"]
    assert spec["initContainers"][0]["resources"]["claims"] == [{"name": name}]
    assert spec["containers"][0]["resources"]["claims"] == [{"name": name, "request": "part-0"}]
    assert spec["containers"][1]["resources"]["claims"] == [{"name": name, "request": "part-1"}]
    # Device-plugin semantics: max(init 2, app 1 + 1) = 2 devices, not 4.
    results = await allocated(kube, ns, "init")
    assert sorted(r["request"] for r in results) == ["part-0", "part-1"]
    assert len({r["device"] for r in results}) == 2
    kube.delete("Namespace", ns)


async def test_where_helm_manages_the_configuration_the_webhook_takes_only_its_ca_bundle(
    cluster: Cluster,
) -> None:
    """With tls.source=self the chart renders the configuration without a caBundle and the
    webhook applies it. Had the webhook applied the whole configuration with force, it
    would own the chart's fields, and the next `helm upgrade` changing one of them (here a
    match condition) would fail with a conflict."""
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    path = f"{registration.PATH}/{registration.NAME}"

    def chart(native: tuple[str, ...]) -> dict[str, Any]:
        config = registration.mutating_configuration(
            ca_bundle_b64="",
            own_namespace="gpudra",
            url="https://127.0.0.1:9/",
            native_resources=native,
        )
        del config["webhooks"][0]["clientConfig"]["caBundle"]
        config["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "Helm"}
        return config

    async def helm_apply(config: dict[str, Any]) -> dict[str, Any]:
        applied: dict[str, Any] = await akube.request(
            "PATCH",
            path,
            config,
            query={"fieldManager": "helm"},
            content_type="application/apply-patch+yaml",
        )
        return applied

    try:
        await helm_apply(chart(()))
        own = registration.mutating_configuration(
            ca_bundle_b64="Y2E=", own_namespace="gpudra", url="https://127.0.0.1:9/"
        )
        await registration.apply(akube, own)
        upgraded = await helm_apply(chart(("nvidia.com/gpu",)))  # no conflict
        (hook,) = upgraded["webhooks"]
        assert hook["clientConfig"]["caBundle"] == "Y2E="
        assert (
            hook["matchConditions"] == chart(("nvidia.com/gpu",))["webhooks"][0]["matchConditions"]
        )
    finally:
        await registration.delete(akube)
        await akube.close()
