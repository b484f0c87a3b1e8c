"""GpuTenant rules on the real control plane: the API server calls the webhook over
HTTPS, the tenant controller keeps native ResourceQuotas, the controller-manager creates
the converted pods' claims under that quota, and the scheduler allocates them."""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import API_VERSION, crd_manifest
from gpudra.common.kube import Kube
from gpudra.webhook.extended_resources import fills_extended_resources
from gpudra.webhook.tenants import MANAGED_BY_LABEL, QUOTA_NAME, TenantController

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, apply_crd
from e2e.cluster.kube import Kube as SyncKube
from e2e.node_process import delete_slices
from e2e.webhook_env import (
    EmulatedNode,
    call,
    register_webhook,
    serving_config,
    start_emulated_nodes,
    tenant_webhook,
    unregister_webhook,
)

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"
TENANTS = f"/apis/{API_VERSION}/gputenants"
QUOTA_KEY = "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"


async def until(what: str, probe: Callable[[], Any], within_s: float = 90) -> Any:
    try:
        with anyio.fail_after(within_s):
            while True:
                value = await call(probe)
                if value:
                    return value
                await anyio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"timed out after {within_s:.0f}s waiting for {what}") from None


@dataclass
class Env:
    controller: TenantController
    kube: SyncKube


@pytest.fixture
async def env(cluster: Cluster, kube: SyncKube, tmp_path: Path) -> AsyncIterator[Env]:
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    apply_crd(kube, crd_manifest())
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    pki, config = serving_config(cluster, tmp_path / "pki")
    controller, server = tenant_webhook(akube, config)
    node = EmulatedNode("worker-1", "emulated:h100-80gb-hbm3-x8", uuid_salt="tenants")
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        await tg.start(controller.run)
        await start_emulated_nodes(tg, akube, DRIVER, [node])
        await register_webhook(akube, pki, config, f"https://{cluster.webhook_host()}:{port}")
        yield Env(controller, kube)
        await unregister_webhook(akube)
        tg.cancel_scope.cancel()
    delete_slices(kube, DRIVER)
    await akube.close()


def make_tenant(kube: SyncKube, name: str, **spec: Any) -> None:
    body = {"apiVersion": API_VERSION, "kind": "GpuTenant", "metadata": {"name": name}}
    kube.request("POST", TENANTS, {**body, "spec": spec})


def make_labelled_tenant(kube: SyncKube, name: str, ns: str, **spec: Any) -> None:
    """Label `ns` with `gpu-tenant: name` and create the tenant selecting that label, so a
    test's tenant governs only the namespace it made, never the rest of the shared cluster."""
    kube.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}",
        {"metadata": {"labels": {"gpu-tenant": name}}},
        content_type="application/merge-patch+json",
    )
    make_tenant(kube, name, namespaceSelector={"matchLabels": {"gpu-tenant": name}}, **spec)


def delete_tenant(kube: SyncKube, name: str) -> None:
    try:
        kube.request("DELETE", f"{TENANTS}/{name}")
    except ApiError as e:
        if e.status != 404:
            raise


def gpu_pod(ns: str, name: str, limits: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name},
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


def claim(ns: str, name: str, devices: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"devices": devices},
    }


def quota_of(kube: SyncKube, ns: str) -> Any:
    return kube.get_or_none("ResourceQuota", QUOTA_NAME, ns)


def allocated_claims(kube: SyncKube, ns: str) -> list[dict[str, Any]]:
    return [c for c in kube.list("ResourceClaim", ns) if (c.get("status") or {}).get("allocation")]


async def test_quota_holds_for_concurrent_pods(env: Env, kube: SyncKube) -> None:
    ns = await call(smoke.make_namespace, kube, "quota")
    tenant = f"team-{ns}"
    try:
        await call(lambda: make_tenant(kube, tenant, namespaces=[ns], deviceQuota={DRIVER: 4}))
        quota = await until(
            "the controller's ResourceQuota with its status",
            lambda: (q := quota_of(kube, ns)) and q.get("status", {}).get("hard") and q,
        )
        hard = quota["spec"]["hard"]
        assert hard[QUOTA_KEY] == "4"  # every other class of the driver: none
        assert {v for k, v in hard.items() if k != QUOTA_KEY} == {"0"}
        assert quota["metadata"]["labels"][MANAGED_BY_LABEL] == "gpudra"
        await until(
            "the webhook's cache to see the quota status",
            lambda: (
                env.controller.state.quota_usage(ns) is not None
                and "gpu.nvidia.com" in env.controller.state.quota_usage(ns).hard
            ),  # type: ignore[union-attr]
        )

        created: list[str] = []
        denied: list[str] = []

        async def create(i: int) -> None:
            try:
                await call(kube.create, gpu_pod(ns, f"p{i}", {"nvidia.com/gpu": "1"}))
                created.append(f"p{i}")
            except ApiError as e:
                denied.append(str(e))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(create, i)
        assert len(created) + len(denied) == 20
        pattern = re.compile(
            rf'tenant "{tenant}" \(GpuTenant {tenant}\): quota gpu.nvidia.com in namespace '
            rf"{ns}: limit 4, used [0-9]+, this pod asks for 1"
        )
        assert all(pattern.search(d) for d in denied), denied
        assert len(created) >= 4  # the pre-check only denies once 4 claims exist

        # The native quota admits exactly 4 claims; the scheduler allocates them.
        await until("4 allocated claims", lambda: len(allocated_claims(kube, ns)) == 4)
        await until(
            "quota usage 4",
            lambda: (quota_of(kube, ns).get("status", {}).get("used") or {}).get(QUOTA_KEY) == "4",
        )
        claims = await call(kube.list, "ResourceClaim", ns)
        assert len(claims) == 4
        devices = sum(len(c["status"]["allocation"]["devices"]["results"]) for c in claims)
        assert devices == 4
        if len(created) > 4:
            await until(
                "an event for a claim refused by the quota",
                lambda: any(
                    "exceeded quota" in e.get("message", "") for e in kube.list("Event", ns)
                ),
            )

        # With the usage visible, the webhook denies early with rule, limit and usage.
        expected = (
            f'tenant "{tenant}" (GpuTenant {tenant}): quota gpu.nvidia.com in namespace '
            f"{ns}: limit 4, used 4, this pod asks for 1"
        )

        def extra_pod_denied() -> bool:
            try:
                kube.create(gpu_pod(ns, "extra", {"nvidia.com/gpu": "1"}), dryRun="All")
            except ApiError as e:
                assert e.status == 403, e
                assert expected in str(e), e
                return True
            return False

        await until("the pre-check to deny", extra_pod_denied)

        for name in created:
            await call(lambda n=name: kube.delete("Pod", n, ns, grace=0))
        await until("no ResourceClaims left", lambda: not kube.list("ResourceClaim", ns))
    finally:
        await call(delete_tenant, kube, tenant)
        await call(kube.delete, "Namespace", ns)


async def test_tenant_rules_for_pods(env: Env, kube: SyncKube) -> None:
    ns = await call(smoke.make_namespace, kube, "shared")
    tenant = f"ts-{ns}"
    try:
        await call(
            lambda: make_labelled_tenant(
                kube,
                tenant,
                ns,
                maxDevicesPerPod=2,
                allowedSharing=["TimeSlicing"],
                gpuResource={"sharing": "TimeSlicing", "timeSlicingInterval": "Short"},
            )
        )
        await until(
            "the webhook to see the tenant",
            lambda: env.controller.state.lookup(ns).rules is not None,
        )
        pod = await call(kube.create, gpu_pod(ns, "ts", {"nvidia.com/gpu": "1"}))
        (pod_claim,) = pod["spec"]["resourceClaims"]
        tpl = await call(
            kube.get, "ResourceClaimTemplate", pod_claim["resourceClaimTemplateName"], ns
        )
        devices = tpl["spec"]["spec"]["devices"]
        # One share of a GPU published with shares, else a whole GPU (no node here has shares).
        share, whole = devices["requests"][0]["firstAvailable"]
        assert share["capacity"] == {"requests": {"shares": "1"}}
        assert share["deviceClassName"] == whole["deviceClassName"] == "gpu-shared.nvidia.com"
        assert devices["config"][0]["opaque"]["parameters"]["sharing"] == {
            "strategy": "TimeSlicing",
            "timeSlicingConfig": {"interval": "Short"},
        }

        async def pod_claim_allocated() -> list[Any]:
            def probe() -> Any:
                st = kube.get("Pod", "ts", ns).get("status", {}).get("resourceClaimStatuses")
                if not st or not st[0].get("resourceClaimName"):
                    return None
                c = kube.get("ResourceClaim", st[0]["resourceClaimName"], ns)
                return (c.get("status") or {}).get("allocation")

            return await until("the shared GPU claim to be allocated", probe)  # type: ignore[no-any-return]

        allocation = await pod_claim_allocated()
        (result,) = allocation["devices"]["results"]
        assert result["request"] == "part-0/gpu"  # the whole-GPU fallback
        assert (
            allocation["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["strategy"]
            == "TimeSlicing"
        )

        with pytest.raises(ApiError) as err:
            await call(
                kube.create,
                gpu_pod(ns, "big", {"nvidia.com/gpu": "3"}),
            )
        assert err.value.status == 403
        assert (
            f'tenant "{tenant}" (GpuTenant {tenant}): maxDevicesPerPod is 2, this pod asks '
            "for 3 devices (nvidia.com/gpu in container cuda=3)"
        ) in str(err.value)
        # Whole GPUs (Exclusive) are not allowed for this tenant: MIG pods are refused too.
        with pytest.raises(ApiError) as err:
            await call(kube.create, gpu_pod(ns, "mig", {"nvidia.com/mig-1g.10gb": "1"}))
        assert "sharing mode Exclusive is not allowed; allowed modes: TimeSlicing" in str(err.value)
        await call(lambda: kube.delete("Pod", "ts", ns, grace=0))
    finally:
        await call(delete_tenant, kube, tenant)
        await call(kube.delete, "Namespace", ns)


async def test_hand_written_claims_are_validated(env: Env, kube: SyncKube) -> None:
    ns = await call(smoke.make_namespace, kube, "claims")
    tenant = f"cl-{ns}"
    try:
        await call(
            lambda: make_tenant(kube, tenant, namespaces=[ns], allowedDeviceClasses=[DRIVER])
        )
        await until(
            "the webhook to see the tenant",
            lambda: env.controller.state.lookup(ns).rules is not None,
        )
        mig = {"requests": [{"name": "m", "exactly": {"deviceClassName": "mig.nvidia.com"}}]}
        with pytest.raises(ApiError) as err:
            await call(kube.create, claim(ns, "mig", mig))
        message = str(err.value)
        assert "spec.devices.requests[0].exactly.deviceClassName" in message
        assert "does not allow device class mig.nvidia.com; accepted values: gpu.nvidia.com" in (
            message
        )

        bad_config = {
            "requests": [{"name": "g", "exactly": {"deviceClassName": DRIVER}}],
            "config": [
                {
                    "opaque": {
                        "driver": DRIVER,
                        "parameters": {
                            "apiVersion": "resource.nvidia.com/v1beta1",
                            "kind": "GpuConfig",
                            "sharing": {"strategy": "Sliced"},
                        },
                    }
                }
            ],
        }
        with pytest.raises(ApiError) as err:
            await call(kube.create, claim(ns, "bad", bad_config))
        assert err.value.status == 400
        assert (
            "spec.devices.config[0].opaque.parameters.sharing.strategy: unknown value "
            "'Sliced'; accepted values: TimeSlicing, MPS"
        ) in str(err.value)

        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"namespace": ns, "name": "bad"},
            "spec": {"spec": {"devices": bad_config}},
        }
        with pytest.raises(ApiError) as err:
            await call(kube.create, template)
        assert "spec.spec.devices.config[0].opaque.parameters.sharing.strategy" in str(err.value)

        # Another driver's opaque config is not ours to judge; a valid claim passes.
        fine = {
            "requests": [{"name": "g", "exactly": {"deviceClassName": DRIVER}}],
            "config": [{"opaque": {"driver": "nic.example.com", "parameters": {"any": 1}}}],
        }
        created = await call(kube.create, claim(ns, "fine", fine))
        assert created["metadata"]["name"] == "fine"
    finally:
        await call(delete_tenant, kube, tenant)
        await call(kube.delete, "Namespace", ns)


# The scheduler bound a pod asking for a class by name as an extended resource without
# making its claim: it does not map such a name to its class.
UNSERVED = object()


async def test_the_schedulers_claim_for_a_device_class_asked_for_by_name(
    env: Env, kube: SyncKube
) -> None:
    """`deviceclass.resource.kubernetes.io/gpu.nvidia.com` under a tenant: counted with the
    pod's claim at its admission; the claim the real scheduler then creates for it passes
    the claim webhook, is allocated, and is the one the webhook takes for the pod's
    extended resources (`fills_extended_resources`) when it counts a claim with its pod."""
    implicit = "deviceclass.resource.kubernetes.io/gpu.nvidia.com"
    ns = await call(smoke.make_namespace, kube, "implicit")
    tenant = f"im-{ns}"
    try:
        await call(lambda: make_tenant(kube, tenant, namespaces=[ns], maxDevicesPerPod=2))
        await until(
            "the webhook to see the tenant",
            lambda: env.controller.state.lookup(ns).rules is not None,
        )
        one = {"requests": [{"name": "g", "exactly": {"deviceClassName": DRIVER}}]}
        await call(kube.create, claim(ns, "one", one))

        def pod_with(count: str, name: str) -> dict[str, Any]:
            obj = gpu_pod(ns, name, {implicit: count})
            obj["spec"]["containers"][0]["resources"]["claims"] = [{"name": "a"}]
            obj["spec"]["resourceClaims"] = [{"name": "a", "resourceClaimName": "one"}]
            return obj

        with pytest.raises(ApiError) as err:
            await call(kube.create, pod_with("2", "over"))
        assert "maxDevicesPerPod is 2, this pod asks for 3 devices" in str(err.value)
        created = await call(kube.create, pod_with("1", "fits"))

        def extended_claim() -> Any:
            pod = kube.get("Pod", "fits", ns)
            status = pod.get("status", {})
            name = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
            if not name and pod["spec"].get("nodeName"):
                return UNSERVED  # the claim's name is written before the binding
            return name and kube.get("ResourceClaim", name, ns)

        made = await until("the scheduler's claim for the extended resource", extended_claim)
        if made is UNSERVED:
            # The webhook's part (counting the name at admission) is asserted above.
            pytest.skip(
                "the scheduler binds a pod asking for a class by name with no claim: it "
                "does not map the name to its class (Kubernetes 1.34; kubernetes#133363 "
                "is in 1.35)"
            )
        assert (made.get("status") or {}).get("allocation")
        assert fills_extended_resources(made, created)
        await call(lambda: kube.delete("Pod", "fits", ns, grace=0))
    finally:
        await call(delete_tenant, kube, tenant)
        await call(kube.delete, "Namespace", ns)


async def test_deleting_a_tenant_removes_its_quotas(env: Env, kube: SyncKube) -> None:
    ns1 = await call(smoke.make_namespace, kube, "del")
    ns2 = await call(smoke.make_namespace, kube, "del")
    tenant = f"del-{ns1}"
    foreign = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"namespace": ns2, "name": "team-own-quota"},
        "spec": {"hard": {QUOTA_KEY: "9"}},
    }
    try:
        await call(kube.create, foreign)
        await call(
            lambda: make_tenant(kube, tenant, namespaces=[ns1, ns2], deviceQuota={DRIVER: 2})
        )
        for ns in (ns1, ns2):
            await until(f"a quota in {ns}", lambda n=ns: quota_of(kube, n))
        await until(
            "the controller's cache to hold both quotas",
            lambda: {ns1, ns2} <= set(env.controller.state.quotas),
        )
        # Level-triggered without idle writes: nothing changed, so nothing is written.
        assert await env.controller.reconcile_once() == 0
        # Dropping a namespace from the tenant removes only that namespace's quota.
        await call(
            lambda: kube.request(
                "PATCH",
                f"{TENANTS}/{tenant}",
                {"spec": {"namespaces": [ns1]}},
                content_type="application/merge-patch+json",
            )
        )
        await until(f"no quota in {ns2}", lambda: quota_of(kube, ns2) is None)
        assert await call(quota_of, kube, ns1) is not None
        await call(delete_tenant, kube, tenant)
        await until(f"no quota in {ns1}", lambda: quota_of(kube, ns1) is None)
        # Quotas the controller does not own are never touched.
        assert await call(kube.get_or_none, "ResourceQuota", "team-own-quota", ns2) is not None
    finally:
        await call(delete_tenant, kube, tenant)
        await call(kube.delete, "Namespace", ns1)
        await call(kube.delete, "Namespace", ns2)


async def test_a_default_tenant_governs_a_fresh_namespace_no_tenant_selects(
    env: Env, kube: SyncKube
) -> None:
    """Escape attempt: a namespace created without its team's labels is not outside the
    rules once a default tenant (``namespaceSelector: {}``) exists; a namespace a
    labelled tenant selects is governed by that tenant alone, with no conflict.

    The default tenant here allows no DeviceClass rather than setting a deviceQuota: it
    governs every namespace of the shared test cluster while it exists, and a quota
    would be written into each of them."""
    default = f"default-{secrets.token_hex(3)}"
    labelled = ""
    fresh = team = ""
    try:
        await call(
            lambda: make_tenant(kube, default, namespaceSelector={}, allowedDeviceClasses=[])
        )
        fresh = await call(smoke.make_namespace, kube, "fresh")
        team = await call(smoke.make_namespace, kube, "team")
        labelled = f"team-{team}"
        await call(lambda: make_labelled_tenant(kube, labelled, team, maxDevicesPerPod=1))

        def governs(ns: str) -> str | None:
            rules = env.controller.state.lookup(ns).rules
            return rules.tenant.name if rules else None

        await until("the webhook to see both tenants", lambda: governs(team) == labelled)
        await until("the webhook to see the fresh namespace", lambda: governs(fresh) == default)

        with pytest.raises(ApiError) as err:
            await call(kube.create, gpu_pod(fresh, "escape", {"nvidia.com/gpu": "1"}))
        assert err.value.status == 403
        assert (
            f'tenant "{default}" (GpuTenant {default}): device class gpu.nvidia.com is not allowed'
        ) in str(err.value)

        # The labelled tenant's rules, not the default's, and no conflict between them.
        admitted = await call(
            lambda: kube.create(gpu_pod(team, "one", {"nvidia.com/gpu": "1"}), dryRun="All")
        )
        assert admitted["spec"]["resourceClaims"]
        with pytest.raises(ApiError) as err:
            await call(kube.create, gpu_pod(team, "two", {"nvidia.com/gpu": "2"}))
        assert err.value.status == 403
        assert f'tenant "{labelled}" (GpuTenant {labelled}): maxDevicesPerPod is 1' in str(
            err.value
        )
    finally:
        for name in (default, labelled):
            if name:
                await call(delete_tenant, kube, name)
        for ns in (fresh, team):
            if ns:
                await call(kube.delete, "Namespace", ns)
