"""Escape attempts on the pod path: a tenant user tries to get more GPUs than its GpuTenant
allows, or to make the webhook write where it should not.

The tenant is a ServiceAccount with the built-in `edit` ClusterRole bound in its own
namespace only, and every attempt is made with its own token (TokenRequest API), as a
real user of a shared cluster would. Each attempt is denied with a message naming the
rule, or shown harmless by what the test reads back. Forged AdmissionReviews go straight
to the webhook's port.
"""

from __future__ import annotations

import dataclasses
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.abc
import anyio.to_thread
import pytest
import yaml
from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import API_VERSION, LabelSelector, crd_manifest
from gpudra.common.kube import ApiError as AsyncApiError
from gpudra.common.kube import Kube
from gpudra.webhook import registration
from gpudra.webhook.admission import MUTATE_PATH
from gpudra.webhook.convert import OPT_OUT_LABEL, convert_pod

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, apply_crd, wait_for
from e2e.cluster.kube import Kube as SyncKube
from e2e.tenant_user import cluster_admin_user, tenant_token
from e2e.webhook_env import (
    call,
    register_webhook,
    serving_config,
    tenant_webhook,
    unregister_webhook,
)

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"
TENANTS = f"/apis/{API_VERSION}/gputenants"
RESOURCE = "/apis/resource.k8s.io/v1"
MAX_CONNECTIONS = 32
"""The escape webhook's connection bound: small, so that a flood needs few connections;
how the bound holds does not depend on its size."""
NOT_MIGRATED = "escape.gpudra.io/not-migrated"
"""The escape webhook converts pods only in namespaces without this label, as a migration's
`webhook.conversion.namespaceSelector` would; the cluster admin sets it."""


@dataclass
class Escape:
    ns: str
    tenant: Kube
    """The tenant user's client: its own token, `edit` in `ns` only."""
    webhook_url: str
    webhook_ca: bytes


async def tenant_client(kube: SyncKube, cluster: Cluster, ns: str, tmp_path: Path) -> Kube:
    """A client for a ServiceAccount with `edit` in `ns`, using its own bound token."""
    token = tenant_token(kube, ns)
    admin = yaml.safe_load(cluster.layout.admin_kubeconfig.read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "tenant", "user": {"token": token}}],
        "contexts": [
            {
                "name": "tenant",
                "context": {"cluster": admin["clusters"][0]["name"], "user": "tenant"},
            }
        ],
        "current-context": "tenant",
    }
    path = tmp_path / "tenant.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return await Kube.connect(str(path))


@pytest.fixture
async def escape(cluster: Cluster, kube: SyncKube, tmp_path: Path) -> AsyncIterator[Escape]:
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    apply_crd(kube, crd_manifest())
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    pki, config = serving_config(cluster, tmp_path / "pki")
    not_migrated = {"matchExpressions": [{"key": NOT_MIGRATED, "operator": "DoesNotExist"}]}
    config = dataclasses.replace(
        config,
        max_connections=MAX_CONNECTIONS,
        conversion_selector=LabelSelector.model_validate(not_migrated),
    )
    controller, server = tenant_webhook(akube, config)
    ns = await call(smoke.make_namespace, kube, "escape")
    tenant_name = f"escape-{ns}"
    tenant: Kube | None = None
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        await tg.start(controller.run)
        url = f"https://{cluster.webhook_host()}:{port}"
        await register_webhook(akube, pki, config, url)
        for obj in [*registration.opt_out_policy([]), *registration.claim_links_policy()]:
            await registration.apply(akube, obj)
        probe = pod(ns, "probe", {"nvidia.com/gpu": "1"}, labels={OPT_OUT_LABEL: "false"})
        await call(opt_out_policy_active, kube, probe)
        try:
            await call(
                lambda: kube.request(
                    "POST",
                    TENANTS,
                    {
                        "apiVersion": API_VERSION,
                        "kind": "GpuTenant",
                        "metadata": {"name": tenant_name},
                        "spec": {"namespaces": [ns], "maxDevicesPerPod": 1},
                    },
                )
            )
            with anyio.fail_after(60):
                while controller.state.lookup(ns).rules is None:
                    await anyio.sleep(0.1)
            tenant = await tenant_client(kube, cluster, ns, tmp_path)
            yield Escape(ns, tenant, url, pki.ca_bundle)
        finally:
            if tenant is not None:
                await tenant.close()
            await unregister_webhook(akube)
            await akube.request(
                "DELETE", f"{registration.OPT_OUT_BINDING_PATH}/{registration.OPT_OUT_POLICY_NAME}"
            )
            await akube.request(
                "DELETE", f"{registration.OPT_OUT_POLICY_PATH}/{registration.OPT_OUT_POLICY_NAME}"
            )
            for obj in registration.claim_links_policy():
                path = registration.OPT_OUT_POLICY_PATH
                if obj["kind"] == "ValidatingAdmissionPolicyBinding":
                    path = registration.OPT_OUT_BINDING_PATH
                await akube.request("DELETE", f"{path}/{obj['metadata']['name']}")
            await call(lambda: kube.request("DELETE", f"{TENANTS}/{tenant_name}"))
            await call(kube.delete, "Namespace", ns)
            tg.cancel_scope.cancel()
    await akube.close()


def opt_out_policy_active(kube: SyncKube, probe: dict[str, Any]) -> None:
    """The API server loads admission policies asynchronously: wait until it enforces."""

    def refused() -> bool:
        try:
            kube.create(probe, dryRun="All")
        except ApiError as e:
            return "optOutNamespaces" in str(e)
        return False

    wait_for("the opt-out policy to be enforced", refused, timeout=60)


def gpu_claim(ns: str, name: str, count: int = 1) -> dict[str, Any]:
    exactly = {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": count}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def controlled_by(owner: dict[str, Any]) -> dict[str, Any]:
    """The owner reference Kubernetes gives a claim it makes for the pod `owner` (as the
    API server returned it): the pod as its controlling owner."""
    meta = owner["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def pod(
    ns: str,
    name: str,
    limits: dict[str, str] | None = None,
    claims: dict[str, dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod with legacy `limits` and pod `claims` (pod claim name -> its source)."""
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if claims:
        resources["claims"] = [{"name": n} for n in claims]
    spec: dict[str, Any] = {
        "containers": [
            {"name": "cuda", "image": "registry.k8s.io/pause:3.10", "resources": resources}
        ]
    }
    if claims:
        spec["resourceClaims"] = [{"name": n, **source} for n, source in claims.items()]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": labels or {}},
        "spec": spec,
    }


async def create(client: Kube, obj: dict[str, Any], *, dry_run: bool = False) -> Any:
    plural = {"Pod": "/api/v1/namespaces/{}/pods"}.get(
        obj["kind"], RESOURCE + "/namespaces/{}/" + obj["kind"].lower() + "s"
    )
    query = {"dryRun": "All"} if dry_run else None
    path = plural.format(obj["metadata"]["namespace"])
    return await client.request("POST", path, obj, query=query)


async def refused(client: Kube, obj: dict[str, Any]) -> str:
    """The message the API server refused `obj` with (fails when it was created)."""
    with pytest.raises(AsyncApiError) as err:
        await create(client, obj)
    assert err.value.status in (400, 403, 422), err.value
    return str(err.value)


async def refused_once_loaded(client: Kube, kube: SyncKube, obj: dict[str, Any]) -> str:
    """`refused`, for a refusal by a ValidatingAdmissionPolicy, which the API server
    loads asynchronously: what it let through before then is deleted and tried again
    (for up to 30 s)."""
    meta = obj["metadata"]
    with anyio.fail_after(30):
        while True:
            try:
                await create(client, obj)
            except AsyncApiError as exc:
                return str(exc)
            await call(kube.delete, obj["kind"], meta["name"], meta["namespace"])
            await anyio.sleep(0.5)


def forged_review(
    uid: str, namespace: str, obj: dict[str, Any], *, dry_run: bool = False
) -> dict[str, Any]:
    """A pod's AdmissionReview as a client that reaches the webhook's port forges it."""
    request = {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": namespace,
        "operation": "CREATE",
        "object": obj,
    }
    if dry_run:
        request["dryRun"] = True
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


async def send_review(escape: Escape, review: dict[str, Any]) -> tuple[int, str]:
    """The webhook's status and body for `review`, sent straight to its port."""
    context = ssl.create_default_context(cadata=escape.webhook_ca.decode())
    async with (
        aiohttp.ClientSession() as session,
        session.post(escape.webhook_url + MUTATE_PATH, json=review, ssl=context) as resp,
    ):
        return resp.status, await resp.text()


async def pod_naming_two_claims_is_refused(tenant: Kube, ns: str) -> None:
    """The tenant makes two one-GPU claims, each fine alone, and a pod naming both."""
    await create(tenant, gpu_claim(ns, "one"))
    await create(tenant, gpu_claim(ns, "two"))
    two_claims = pod(
        ns,
        "two-claims",
        claims={"a": {"resourceClaimName": "one"}, "b": {"resourceClaimName": "two"}},
    )
    message = await refused(tenant, two_claims)
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in message


async def change_rules(
    escape: Escape, kube: SyncKube, spec: dict[str, Any], probe: dict[str, Any], *, admitted: bool
) -> None:
    """The cluster admin changes the escape tenant's `spec`; returns once the webhook
    judges the claim `probe` (a dry run) by the new rules: `admitted` or refused."""
    await call(
        lambda: kube.request(
            "PATCH",
            f"{TENANTS}/escape-{escape.ns}",
            {"spec": spec},
            content_type="application/merge-patch+json",
        )
    )
    path = f"{RESOURCE}/namespaces/{escape.ns}/resourceclaims"
    with anyio.fail_after(60):
        while True:
            try:
                await escape.tenant.request("POST", path, probe, query={"dryRun": "All"})
                if admitted:
                    return
            except AsyncApiError:
                if not admitted:
                    return
            await anyio.sleep(0.2)


async def test_hand_written_claims_count_towards_the_pod_limit(escape: Escape) -> None:
    ns, tenant = escape.ns, escape.tenant
    await pod_naming_two_claims_is_refused(tenant, ns)

    mixed = pod(ns, "mixed", {"nvidia.com/gpu": "1"}, {"a": {"resourceClaimName": "one"}})
    message = await refused(tenant, mixed)
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in message

    # A claim that does not exist yet cannot be counted, so it cannot be filled in later.
    later = pod(
        ns, "later", claims={"a": {"resourceClaimName": "later"}, "b": {"resourceClaimName": "one"}}
    )
    assert "does not exist" in await refused(tenant, later)

    # Within the limit, the pod is admitted.
    await create(tenant, pod(ns, "fits", claims={"a": {"resourceClaimName": "one"}}))


async def test_a_claim_named_by_more_pods_than_kubernetes_reserves_it_for_is_refused(
    escape: Escape,
) -> None:
    """Each pod that names a claim is counted when the claim is created, and Kubernetes
    reserves a claim for at most 256 pods: a crowd of pending pods naming one claim,
    which the tenant deletes and creates again, gets it refused before any pod is
    counted, rather than making every creation read for all of them."""
    ns, tenant = escape.ns, escape.tenant
    await create(tenant, gpu_claim(ns, "crowd"))
    names = {"a": {"resourceClaimName": "crowd"}}
    at_once = anyio.CapacityLimiter(8)

    async def one(index: int) -> None:
        async with at_once:
            await create(tenant, pod(ns, f"crowd-{index}", claims=names))

    async with anyio.create_task_group() as group:
        for index in range(257):
            group.start_soon(one, index)
    await tenant.request("DELETE", f"{RESOURCE}/namespaces/{ns}/resourceclaims/crowd")
    message = await refused(tenant, gpu_claim(ns, "crowd"))
    assert "257 pods use this claim, more than the 256 its creation counts" in message


async def test_a_claim_swapped_for_a_bigger_one_under_a_waiting_pod_is_refused(
    escape: Escape, kube: SyncKube
) -> None:
    """The pod is admitted with two one-device claims and waits (no GPU node here); the
    tenant deletes one and creates it again asking for two devices, each claim within
    the limit of two, the pod not."""
    ns, tenant = escape.ns, escape.tenant
    await change_rules(
        escape, kube, {"maxDevicesPerPod": 2}, gpu_claim(ns, "probe", count=2), admitted=True
    )
    await create(tenant, gpu_claim(ns, "swap"))
    await create(tenant, gpu_claim(ns, "keep"))
    both = {"a": {"resourceClaimName": "swap"}, "b": {"resourceClaimName": "keep"}}
    await create(tenant, pod(ns, "waits", claims=both))
    await tenant.request("DELETE", f"{RESOURCE}/namespaces/{ns}/resourceclaims/swap")
    message = await refused(tenant, gpu_claim(ns, "swap", count=2))
    assert "maxDevicesPerPod is 2, and pod waits uses this claim" in message
    assert "would get 3 devices" in message

    # The claim the resourceclaim controller generates from a template is counted with
    # the pod that owns it: a template swapped before generation gains nothing.
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": ns, "name": "tpl"},
        "spec": {"spec": gpu_claim(ns, "x")["spec"]},
    }
    await create(tenant, template)
    claims = {"g": {"resourceClaimTemplateName": "tpl"}, "b": {"resourceClaimName": "keep"}}
    owner = await create(tenant, pod(ns, "owner", claims=claims))
    generated = gpu_claim(ns, "owner-g-swapped", count=2)
    generated["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "g"}
    generated["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner["metadata"]["uid"]}
    ]
    # Created with the controller's rights (the tenant cannot plant it in its place).
    with pytest.raises(ApiError) as err:
        await call(kube.create, generated)
    assert "pod owner uses this claim" in str(err.value)

    # The same size again is admitted: nothing here stops a plain re-creation.
    await create(tenant, gpu_claim(ns, "swap"))


def claim_template(ns: str, name: str, count: int, device_class: str = DRIVER) -> dict[str, Any]:
    spec = gpu_claim(ns, name, count)["spec"]
    spec["devices"]["requests"][0]["exactly"]["deviceClassName"] = device_class
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"spec": spec},
    }


async def test_a_template_swapped_after_its_claims_were_made_gains_nothing(
    escape: Escape, kube: SyncKube
) -> None:
    """The pod has two template entries of one GPU each (the limit is two) and waits
    behind a scheduling gate; the resourceclaim controller makes its two claims. The
    tenant deletes both templates and creates them again, one asking for another
    driver's device, the other for two GPUs, then deletes the first entry's claim. The
    controller's new claim for it is refused: it counts with the claim already made for
    the other entry (one GPU), not with what that entry's template asks for now (none).
    Where the controller makes no new claim (below), the claim it would make is refused
    the same way."""
    ns, tenant = escape.ns, escape.tenant
    await change_rules(
        escape, kube, {"maxDevicesPerPod": 2}, gpu_claim(ns, "probe", count=2), admitted=True
    )
    for name in ("ta", "tb"):
        await create(tenant, claim_template(ns, name, 1))
    entries = {"e1": {"resourceClaimTemplateName": "ta"}, "e2": {"resourceClaimTemplateName": "tb"}}
    held = pod(ns, "held", claims=entries)
    held["spec"]["schedulingGates"] = [{"name": "escape.gpudra.io/hold"}]
    await create(tenant, held)

    def made() -> dict[str, str] | None:
        statuses = kube.get("Pod", "held", ns).get("status", {}).get("resourceClaimStatuses")
        found = {s["name"]: s.get("resourceClaimName") for s in statuses or ()}
        return found if all(found.get(e) for e in entries) else None

    claims = await call(lambda: wait_for("the pod's claims to be made", made, timeout=60))
    templates = f"{RESOURCE}/namespaces/{ns}/resourceclaimtemplates"
    for name, count, device_class in (("tb", 1, "nic.example.com"), ("ta", 2, DRIVER)):
        await tenant.request("DELETE", f"{templates}/{name}")
        await create(tenant, claim_template(ns, name, count, device_class))
    await tenant.request("DELETE", f"{RESOURCE}/namespaces/{ns}/resourceclaims/{claims['e1']}")

    def refusal() -> str | None:
        events = kube.list(
            "Event",
            ns,
            fieldSelector="involvedObject.name=held,reason=FailedResourceClaimCreation",
        )
        messages = [e.get("message", "") for e in events]
        return next((m for m in messages if "maxDevicesPerPod is 2" in m), None)

    def no_claim_for_e1() -> bool:
        stored = kube.list("ResourceClaim", ns)
        return all(
            c["metadata"].get("annotations", {}).get("resource.kubernetes.io/pod-claim-name")
            != "e1"
            for c in stored
        )

    try:
        message = await call(lambda: wait_for("the new claim refused", refusal, timeout=30))
    except TimeoutError:
        # At times the controller makes no new claim for e1: its cache of the claims it
        # made (client-go's mutation cache, kept for an hour) still hands it the deleted
        # one, and the pod status it then applies holds only the entries of that pass:
        # e1, naming the deleted claim, and not e2. The claim it would make is made here
        # instead, as it makes one (the pod its controlling owner, the entry's
        # annotation, the template's spec as stored now), with the rights Kubernetes'
        # controllers have, and the webhook must count it with the claim the pod controls
        # for e2, which the status no longer names (the same state, in process:
        # tests/webhook/test_admission.py::
        # test_a_claim_made_for_an_entry_counts_while_the_pod_status_lacks_it).
        assert await call(no_claim_for_e1), "a claim for e1 was admitted"
        message = await call(made_as_the_controller_would, kube, ns, "held", "e1", "ta")
    assert "would get 3 devices" in message
    assert f"ResourceClaim {claims['e2']} (generated from ResourceClaimTemplate tb)): 1" in message
    assert await call(no_claim_for_e1)


def made_as_the_controller_would(
    kube: SyncKube, ns: str, pod_name: str, entry: str, template: str
) -> str:
    """Create the claim the resourceclaim controller makes for `entry` of pod `pod_name`
    from `template` as stored now, with an admin's rights, and return why it was refused."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": ns,
            "generateName": f"{pod_name}-{entry}-",
            "annotations": {"resource.kubernetes.io/pod-claim-name": entry},
            "ownerReferences": [controlled_by(kube.get("Pod", pod_name, ns))],
        },
        "spec": kube.get("ResourceClaimTemplate", template, ns)["spec"]["spec"],
    }
    with pytest.raises(ApiError) as err:
        kube.create(claim)
    return str(err.value)


async def test_a_device_class_asked_for_as_an_extended_resource_counts_with_the_pod(
    escape: Escape, kube: SyncKube
) -> None:
    """`deviceclass.resource.kubernetes.io/<class>` (DRAExtendedResource) names no claim:
    the scheduler creates one while it schedules the pod. It is counted at the pod's
    admission, and the scheduler's claim is counted with the pod that owns it."""
    ns, tenant = escape.ns, escape.tenant
    implicit = "deviceclass.resource.kubernetes.io/gpu.nvidia.com"
    both = pod(ns, "both", {"nvidia.com/gpu": "1", implicit: "1"})
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in await refused(tenant, both)
    # Requests alone (the API server takes the name as one of its own, no limit needed).
    alone = pod(ns, "alone")
    alone["spec"]["containers"][0]["resources"]["requests"] = {implicit: "2"}
    message = await refused(tenant, alone)
    assert "the ResourceClaim the scheduler would create for this pod's" in message
    assert "maxDevicesPerPod is 1, this claim asks for 2 devices" in message

    await create(tenant, gpu_claim(ns, "one"))
    holder = await create(tenant, pod(ns, "holder", claims={"a": {"resourceClaimName": "one"}}))
    extended = gpu_claim(ns, "holder-extended-resources-x1y2z")
    extended["metadata"]["annotations"] = {"resource.kubernetes.io/extended-resource-claim": "true"}
    extended["metadata"]["ownerReferences"] = [controlled_by(holder)]
    # Created as the scheduler creates it, with its rights.
    with pytest.raises(ApiError) as err:
        await call(kube.create, extended)
    assert "pod holder uses this claim" in str(err.value)
    assert "would get 2 devices" in str(err.value)


async def test_the_opt_out_label_is_refused_outside_the_named_namespaces(escape: Escape) -> None:
    opted = pod(escape.ns, "opted", {"nvidia.com/gpu": "2"}, labels={OPT_OUT_LABEL: "false"})
    message = await refused(escape.tenant, opted)
    assert "webhook.optOutNamespaces" in message


async def test_a_claim_under_the_generated_prefix_does_not_skip_the_rules(escape: Escape) -> None:
    ns, tenant = escape.ns, escape.tenant
    await create(tenant, gpu_claim(ns, "mine"))
    looks_ours = pod(
        ns, "prefixed", {"nvidia.com/gpu": "1"}, {"gpudra-x": {"resourceClaimName": "mine"}}
    )
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in await refused(tenant, looks_ours)


async def test_a_template_planted_under_a_generated_name_is_refused(escape: Escape) -> None:
    ns, tenant = escape.ns, escape.tenant
    [ours] = convert_pod(pod(ns, "p", {"nvidia.com/gpu": "1"})).templates
    forged = json.loads(json.dumps(ours))
    forged["metadata"]["namespace"] = ns
    forged["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 4
    message = await refused(tenant, forged)
    assert "reserved for the templates gpudra generates" in message

    # A converted pod then gets the template with exactly the generated content.
    created = await create(tenant, pod(ns, "converted", {"nvidia.com/gpu": "1"}))
    name = created["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    template = await tenant.request(
        "GET", f"{RESOURCE}/namespaces/{ns}/resourceclaimtemplates/{name}"
    )
    assert template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1


async def test_pods_cannot_gain_claims_after_admission(escape: Escape) -> None:
    ns, tenant = escape.ns, escape.tenant
    await create(tenant, gpu_claim(ns, "extra"))
    await create(tenant, pod(ns, "running", {"nvidia.com/gpu": "1"}))
    path = f"/api/v1/namespaces/{ns}/pods/running"
    extra = {"name": "extra", "resourceClaimName": "extra"}
    with pytest.raises(AsyncApiError) as err:
        await tenant.request(
            "PATCH",
            path,
            {"spec": {"resourceClaims": [extra]}},
            content_type="application/strategic-merge-patch+json",
        )
    assert err.value.status in (403, 422)

    ephemeral = {
        "name": "debug",
        "image": "registry.k8s.io/pause:3.10",
        "resources": {"claims": [{"name": "extra"}]},
    }
    with pytest.raises(AsyncApiError) as err:
        await tenant.request(
            "PATCH",
            f"{path}/ephemeralcontainers",
            {"spec": {"ephemeralContainers": [ephemeral]}},
            content_type="application/strategic-merge-patch+json",
        )
    assert err.value.status in (403, 422)
    after = await tenant.request("GET", path)
    assert [c["name"] for c in after["spec"]["resourceClaims"]] == ["gpudra-gpu"]
    assert not after["spec"].get("ephemeralContainers")


async def test_forged_reviews_make_the_webhook_write_nothing(
    escape: Escape, kube: SyncKube
) -> None:
    legacy = {"nvidia.com/gpu": "7", "nvidia.com/mig-7g.999gb": "3"}
    for namespace, dry_run in (("kube-system", False), ("gpudra", False), ("default", True)):
        review = forged_review(
            f"forged-{namespace}", namespace, pod(namespace, "forged", legacy), dry_run=dry_run
        )
        status, body = await send_review(escape, review)
        assert status == 200
        answer = json.loads(body)
        assert answer["response"]["allowed"] is True
        assert "patch" not in answer["response"] or dry_run

    for namespace in ("kube-system", "gpudra", "default"):
        templates = await call(kube.list, "ResourceClaimTemplate", namespace)
        names = [t["metadata"]["name"] for t in templates]
        assert [n for n in names if n.startswith("gpudra-")] == []


async def leave_out_of_conversion(escape: Escape, kube: SyncKube) -> None:
    """The cluster admin leaves the escape namespace out of the conversion selector, as
    a migration does; returns once the webhook no longer converts its pods."""
    ns, tenant = escape.ns, escape.tenant
    await call(
        lambda: kube.request(
            "PATCH",
            f"/api/v1/namespaces/{ns}",
            {"metadata": {"labels": {NOT_MIGRATED: "true"}}},
            content_type="application/merge-patch+json",
        )
    )
    one_gpu = pod(ns, "legacy", {"nvidia.com/gpu": "1"})
    pods = f"/api/v1/namespaces/{ns}/pods"
    with anyio.fail_after(30):  # until the webhook has seen the label
        while (await tenant.request("POST", pods, one_gpu, query={"dryRun": "All"}))["spec"].get(
            "resourceClaims"
        ):
            await anyio.sleep(0.2)


async def test_a_namespace_left_out_of_conversion_keeps_the_pod_limit(
    escape: Escape, kube: SyncKube
) -> None:
    """During a migration the cluster admin leaves the tenant's namespace out of the
    conversion selector: its pods keep their device-plugin requests, but they still reach
    the webhook, so a pod naming two one-GPU claims is refused under maxDevicesPerPod 1,
    and a forged review for the namespace makes the webhook write no template there. A
    device-plugin name gpudra cannot convert gets no way around the limit, and one it
    can read (the device plugin's spelling of a `+me` profile) is left to the device
    plugin, not refused."""
    ns, tenant = escape.ns, escape.tenant
    await leave_out_of_conversion(escape, kube)
    one_gpu = pod(ns, "legacy", {"nvidia.com/gpu": "1"})

    await pod_naming_two_claims_is_refused(tenant, ns)
    message = await refused(tenant, pod(ns, "two-gpus", {"nvidia.com/gpu": "2"}))
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in message
    created = await create(tenant, one_gpu)
    assert not created["spec"].get("resourceClaims")  # left to the device plugin
    assert created["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    unreadable = pod(ns, "unreadable", {"nvidia.com/mig-1g.5gb.shared": "2"})
    message = await refused(tenant, unreadable)
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in message
    media = await create(tenant, pod(ns, "media", {"nvidia.com/mig-1g.10gb.me": "1"}))
    assert not media["spec"].get("resourceClaims")

    forged = forged_review("forged-not-migrated", ns, pod(ns, "forged", {"nvidia.com/gpu": "1"}))
    status, body = await send_review(escape, forged)
    assert status == 200
    answer = json.loads(body)
    assert answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]
    templates = await call(kube.list, "ResourceClaimTemplate", ns)
    assert [t["metadata"]["name"] for t in templates] == []


async def test_a_claim_swapped_under_a_pod_keeping_device_plugin_gpus_counts_them(
    escape: Escape, kube: SyncKube
) -> None:
    """In a namespace left out of the conversion, the tenant makes claim x of another
    driver's device (none of gpudra's) and a pod asking for nvidia.com/gpu: 1 that names
    x, held by a scheduling gate: one device, within maxDevicesPerPod 1. It then deletes
    x and creates it again as one whole GPU, which would give the pod two (one from the
    device plugin, one claimed): refused, as the pod naming a one-GPU claim beside its
    device-plugin GPU is at its own creation."""
    ns, tenant = escape.ns, escape.tenant
    await leave_out_of_conversion(escape, kube)
    await create(tenant, gpu_claim(ns, "one"))
    control = pod(ns, "control", {"nvidia.com/gpu": "1"}, {"c": {"resourceClaimName": "one"}})
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in await refused(tenant, control)

    decoy = gpu_claim(ns, "x")
    decoy["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "nic.example.com"
    await create(tenant, decoy)
    held = pod(ns, "held", {"nvidia.com/gpu": "1"}, {"c": {"resourceClaimName": "x"}})
    held["spec"]["schedulingGates"] = [{"name": "escape.gpudra.io/hold"}]
    stored = await create(tenant, held)
    # Left to the device plugin: the pod keeps its nvidia.com/gpu.
    assert stored["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert [c["name"] for c in stored["spec"]["resourceClaims"]] == ["c"]

    await tenant.request("DELETE", f"{RESOURCE}/namespaces/{ns}/resourceclaims/x")
    message = await refused(tenant, gpu_claim(ns, "x"))
    assert "maxDevicesPerPod is 1, and pod held uses this claim" in message
    assert "would get 2 devices (nvidia.com/gpu in container cuda=1; claim c" in message
    # Created again as it was, it is admitted: nothing stops a plain re-creation.
    await create(tenant, decoy)


async def test_a_time_shared_mig_device_left_to_the_device_plugin_is_not_exclusive(
    escape: Escape, kube: SyncKube
) -> None:
    """The cluster admin allows only Exclusive devices and leaves the tenant's namespace
    out of the conversion. The tenant asks for nvidia.com/mig-1g.10gb.shared, the device
    plugin's time-shared replica of a MIG device, which gpudra does not convert and
    which once counted as an Exclusive MIG device: it is time-shared, as
    nvidia.com/gpu.shared is, so it is refused naming the mode."""
    ns, tenant = escape.ns, escape.tenant
    probe = gpu_claim(ns, "probe")
    sharing = {"strategy": "TimeSlicing"}
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    opaque = {"driver": DRIVER, "parameters": {**parameters, "sharing": sharing}}
    probe["spec"]["devices"]["config"] = [{"opaque": opaque}]
    await change_rules(escape, kube, {"allowedSharing": ["Exclusive"]}, probe, admitted=False)
    await leave_out_of_conversion(escape, kube)
    for resource in ("nvidia.com/mig-1g.10gb.shared", "nvidia.com/gpu.shared"):
        message = await refused(tenant, pod(ns, "time-shared", {resource: "1"}))
        assert "sharing mode TimeSlicing is not allowed; allowed modes: Exclusive" in message
        assert f"({resource} in container cuda=1)" in message
    exclusive = await create(tenant, pod(ns, "exclusive", {"nvidia.com/mig-1g.10gb": "1"}))
    assert not exclusive["spec"].get("resourceClaims")  # left to the device plugin


async def test_a_claim_stored_before_the_rules_tightened_is_not_handed_to_a_new_pod(
    escape: Escape, kube: SyncKube
) -> None:
    """The tenant makes a MIG claim while its rules allow every class; the cluster admin
    then allows only whole GPUs. The stored claim is judged again when a new pod names
    it, so the pod is refused, naming the claim and the rule."""
    ns, tenant = escape.ns, escape.tenant
    mig = gpu_claim(ns, "early")
    mig["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "mig.nvidia.com"
    await create(tenant, mig)
    await change_rules(
        escape, kube, {"allowedDeviceClasses": ["gpu.nvidia.com"]}, mig, admitted=False
    )
    message = await refused(tenant, pod(ns, "late", claims={"a": {"resourceClaimName": "early"}}))
    assert "pod claim a refers to ResourceClaim early, which its namespace's rules" in message
    assert "does not allow device class mig.nvidia.com" in message


async def test_a_claim_stored_before_the_quota_is_not_handed_to_a_new_pod(
    escape: Escape, kube: SyncKube
) -> None:
    """The tenant stores a claim for two GPUs while its rules have no quota; the cluster
    admin then sets a deviceQuota of one. The API server counts a claim against a quota
    only when it is created, so the stored claim is refused to a new pod while the
    namespace is over its quota."""
    ns, tenant = escape.ns, escape.tenant
    await change_rules(
        escape, kube, {"maxDevicesPerPod": 2}, gpu_claim(ns, "probe", count=2), admitted=True
    )
    await create(tenant, gpu_claim(ns, "early", count=2))
    await change_rules(
        escape,
        kube,
        {"deviceQuota": {DRIVER: 1}},
        gpu_claim(ns, "probe", count=2),
        admitted=False,
    )
    late = pod(ns, "late", claims={"a": {"resourceClaimName": "early"}})
    key = f"{DRIVER}.deviceclass.resource.k8s.io/devices"

    def counted() -> bool:
        quotas = kube.list("ResourceQuota", ns)
        return any((q.get("status") or {}).get("used", {}).get(key) == "2" for q in quotas)

    await call(lambda: wait_for("the quota to count the stored claim", counted, timeout=60))
    with anyio.fail_after(30):
        while True:  # the webhook's view of the quota follows its watch
            try:
                await create(tenant, late, dry_run=True)
            except AsyncApiError as err:
                message = str(err)
                break
            await anyio.sleep(0.2)
    assert "pod claim a refers to ResourceClaim early, which its namespace's rules" in message
    assert f"quota {DRIVER} in namespace {ns}: limit 1, used 2, over the limit" in message
    assert "over the limit" in await refused(tenant, late)


async def test_a_claim_tolerating_taints_from_before_the_rule_is_not_handed_to_a_new_pod(
    escape: Escape, kube: SyncKube
) -> None:
    """The tenant stores a claim that tolerates the lost-GPU taint while its rules allow
    any toleration; the cluster admin then allows none. A new pod naming that claim is
    refused: a claim stored under looser rules is judged by today's."""
    ns, tenant = escape.ns, escape.tenant
    tolerating = gpu_claim(ns, "early")
    exactly = tolerating["spec"]["devices"]["requests"][0]["exactly"]
    exactly["tolerations"] = [{"key": "gpu.nvidia.com/gpu-lost", "operator": "Exists"}]
    probe = {**tolerating, "metadata": {"namespace": ns, "name": "probe"}}
    await change_rules(escape, kube, {"allowedTaintTolerations": ["*"]}, probe, admitted=True)
    stored = await create(tenant, tolerating)
    if "tolerations" not in stored["spec"]["devices"]["requests"][0]["exactly"]:
        pytest.skip("the API server drops device tolerations: DRADeviceTaints is off")
    await change_rules(escape, kube, {"allowedTaintTolerations": None}, probe, admitted=False)
    message = await refused(tenant, pod(ns, "late", claims={"a": {"resourceClaimName": "early"}}))
    assert "pod claim a refers to ResourceClaim early, which its namespace's rules" in message
    assert "does not allow tolerating device taint gpu.nvidia.com/gpu-lost" in message


async def test_a_forged_namespace_is_refused_before_any_read_or_write(escape: Escape) -> None:
    """A review sent straight to the port with a path for its namespace: answered 400,
    and nothing is read or written with it."""
    forged = forged_review(
        "forged-path",
        f"{escape.ns}/../kube-system",
        pod(escape.ns, "forged", {"nvidia.com/gpu": "1"}),
    )
    status, body = await send_review(escape, forged)
    assert status == 400
    assert "is not a namespace name" in body


async def test_connections_held_open_cannot_lock_the_api_server_out(escape: Escape) -> None:
    """A tenant that reaches the webhook's port opens twice as many connections as the
    server holds and keeps each alive with a request: the server sheds the ones waiting
    longest instead of holding them all, and the API server's reviews still get through,
    so the tenant's GPU pod is admitted and converted."""
    context = ssl.create_default_context(cadata=escape.webhook_ca.decode())
    host, _, port = escape.webhook_url.removeprefix("https://").rpartition(":")
    held: list[anyio.abc.ByteStream] = []
    try:
        with anyio.fail_after(120):
            for _ in range(2 * MAX_CONNECTIONS):
                stream = await anyio.connect_tcp(
                    host, int(port), ssl_context=context, tls_standard_compatible=False
                )
                held.append(stream)
                await stream.send(b"GET /healthz HTTP/1.1\r\nHost: w\r\n\r\n")
                answer = b""
                while not answer.endswith(b"ok\n"):
                    answer += await stream.receive()
        closed = 0
        for stream in held:
            with anyio.move_on_after(0.05):
                try:
                    await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    closed += 1
        assert closed >= len(held) - MAX_CONNECTIONS

        created = await create(escape.tenant, pod(escape.ns, "flooded", {"nvidia.com/gpu": "1"}))
        assert [c["name"] for c in created["spec"]["resourceClaims"]] == ["gpudra-gpu"]
    finally:
        for stream in held:
            with anyio.CancelScope(shield=True):
                await stream.aclose()


async def test_handshakes_never_finished_cannot_lock_the_api_server_out(escape: Escape) -> None:
    """A tenant that reaches the webhook's port opens twice as many TCP connections as the
    server holds and never finishes a TLS handshake on any (a partial ClientHello on
    each): they count against the bound from the moment they are accepted, so the
    server closes the ones waiting longest long before the handshake's deadline, and
    the API server's reviews still get through."""
    host, _, port = escape.webhook_url.removeprefix("https://").rpartition(":")
    held: list[anyio.abc.SocketStream] = []
    try:
        # No connection was accepted before this: each closure seen within half the
        # server's 10 s handshake deadline from here is the bound's, not the deadline's.
        seen_by = anyio.current_time() + 5
        with anyio.fail_after(60):
            for _ in range(2 * MAX_CONNECTIONS):
                stream = await anyio.connect_tcp(host, int(port))
                held.append(stream)
                await stream.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        closed = 0
        # A flood slowed past that by a loaded machine still gets a moment to be read.
        with anyio.move_on_at(max(seen_by, anyio.current_time() + 1)):
            for stream in held[:MAX_CONNECTIONS]:
                try:
                    await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    closed += 1
        assert closed == MAX_CONNECTIONS  # the oldest half, well inside the 10 s deadline

        created = await create(escape.tenant, pod(escape.ns, "handshakes", {"nvidia.com/gpu": "1"}))
        assert [c["name"] for c in created["spec"]["resourceClaims"]] == ["gpudra-gpu"]
    finally:
        for stream in held:
            with anyio.CancelScope(shield=True):
                await stream.aclose()


async def test_a_tenant_namespace_open_to_privileged_pods_is_reported(
    escape: Escape, kube: SyncKube
) -> None:
    """A privileged pod gets every GPU of its node without a claim, so the GpuTenant's
    rules hold only where Pod Security keeps pods unprivileged (the API server's side is
    in test_rbac.py). The escape tenant's namespace has no enforce label: the webhook
    exports it, with its tenant, until the cluster admin labels it baseline."""
    context = ssl.create_default_context(cadata=escape.webhook_ca.decode())

    async def exported() -> str:
        async with (
            aiohttp.ClientSession() as session,
            session.get(escape.webhook_url + "/metrics", ssl=context) as resp,
        ):
            assert resp.status == 200
            return await resp.text()

    series = (
        "gpudra_webhook_tenant_namespace_without_pod_security"
        f'{{namespace="{escape.ns}",tenant="escape-{escape.ns}"}} 1.0'
    )
    assert series in await exported()
    label = {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}}
    await call(
        lambda: kube.request(
            "PATCH",
            f"/api/v1/namespaces/{escape.ns}",
            label,
            content_type="application/merge-patch+json",
        )
    )
    with anyio.fail_after(30):
        while series in await exported():
            await anyio.sleep(0.2)


async def test_a_tenant_cannot_make_its_own_claim_a_pods_or_release_a_held_one(
    escape: Escape, kube: SyncKube
) -> None:
    """The scheduler and the kubelet take a claim as a pod's by its controlling owner's
    UID and the name in the pod's status, and the resource claim controller adopts one
    with the pod-claim-name annotation; a claim's metadata may change after the webhook
    judged it with no pod. The chart's `gpudra-claim-links` policy leaves both to
    Kubernetes, and the delete-protection finalizer too (removing it would let a tenant
    delete a claim under its running pod and the GPU go to another tenant). The tenant
    tries each, at creation and by update; other changes to its claims still work. A
    cluster admin outside `system:masters`, as kubeadm's is, may take the finalizer off."""
    ns, tenant = escape.ns, escape.tenant
    gated = pod(ns, "waiting")
    gated["spec"]["schedulingGates"] = [{"name": "escape.gpudra.io/hold"}]
    waiting = await create(tenant, gated)
    owner = controlled_by(waiting)
    owned = gpu_claim(ns, "owned")
    owned["metadata"]["ownerReferences"] = [owner]
    message = await refused_once_loaded(tenant, kube, owned)
    assert "only Kubernetes' controllers set a ResourceClaim's controlling owner" in message

    annotated = gpu_claim(ns, "annotated")
    annotated["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "a"}
    assert "only Kubernetes sets the annotations" in await refused(tenant, annotated)

    await create(tenant, gpu_claim(ns, "plain"))
    path = f"{RESOURCE}/namespaces/{ns}/resourceclaims/plain"
    merge = "application/merge-patch+json"
    for change in (
        {"metadata": {"ownerReferences": [owner]}},
        {"metadata": {"annotations": {"resource.kubernetes.io/pod-claim-name": "a"}}},
    ):
        with pytest.raises(AsyncApiError) as err:
            await tenant.request("PATCH", path, change, content_type=merge)
        assert err.value.status == 403 and "only Kubernetes" in str(err.value), err.value
    label = {"metadata": {"labels": {"team": "a"}}}
    await tenant.request("PATCH", path, label, content_type=merge)

    # As the scheduler does once it allocates the claim; the tenant cannot take it off.
    protect = {"metadata": {"finalizers": ["resource.kubernetes.io/delete-protection"]}}
    await call(lambda: kube.request("PATCH", path, protect, content_type=merge))
    with pytest.raises(AsyncApiError) as err:
        await tenant.request("PATCH", path, {"metadata": {"finalizers": []}}, content_type=merge)
    assert err.value.status == 403, err.value
    assert "only Kubernetes removes the finalizer" in str(err.value)
    stored = await call(kube.get, "ResourceClaim", "plain", ns)
    assert stored["metadata"]["labels"] == {"team": "a"}
    assert not stored["metadata"].get("ownerReferences")
    assert "resource.kubernetes.io/pod-claim-name" not in stored["metadata"].get("annotations", {})
    # A cluster admin outside system:masters (kubeadm's admin.conf is in
    # kubeadm:cluster-admins) may take it off, as one clearing a stuck claim does:
    # whoever may delete the policy gains nothing from being held by it.
    admin, binding = await call(cluster_admin_user, kube, ns)
    try:
        await call(admin.request, "PATCH", path, {"metadata": {"finalizers": []}})
    finally:
        await call(kube.request, "DELETE", binding)
    assert not (await call(kube.get, "ResourceClaim", "plain", ns))["metadata"].get("finalizers")

    # A template's annotations are copied onto the claims made from it: none of
    # Kubernetes' own there. And the owners of a claim Kubernetes made for a pod stay
    # as Kubernetes set them (an owner without `controller` beside the
    # extended-resource-claim annotation would crash the scheduler).
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": ns, "name": "marked"},
        "spec": {
            "metadata": {"annotations": {"resource.kubernetes.io/extended-resource-claim": "true"}},
            "spec": gpu_claim(ns, "x")["spec"],
        },
    }
    # Its own policy, which the API server may load later than the claims' one above.
    message = await refused_once_loaded(tenant, kube, template)
    assert "annotations under resource.kubernetes.io/ are Kubernetes' own" in message
    template["metadata"]["name"] = "plain-tpl"
    del template["spec"]["metadata"]
    await create(tenant, template)
    made = pod(ns, "made", claims={"g": {"resourceClaimTemplateName": "plain-tpl"}})
    made["spec"]["schedulingGates"] = [{"name": "escape.gpudra.io/hold"}]
    await create(tenant, made)
    with anyio.fail_after(60):
        while not (
            statuses := (await call(kube.get, "Pod", "made", ns))
            .get("status", {})
            .get("resourceClaimStatuses")
        ):
            await anyio.sleep(0.2)
    generated = f"{RESOURCE}/namespaces/{ns}/resourceclaims/{statuses[0]['resourceClaimName']}"
    extra = await tenant.request("GET", generated)
    extra["metadata"]["ownerReferences"].append({**owner, "controller": False})
    with pytest.raises(AsyncApiError) as err:
        await tenant.request("PUT", generated, extra)
    assert err.value.status == 403, err.value
    assert "only Kubernetes changes the owners of a ResourceClaim it made" in str(err.value)
