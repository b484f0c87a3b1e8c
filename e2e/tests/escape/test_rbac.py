"""Escape attempts that the API server itself must stop, before gpudra sees anything.

gpudra relies on three Kubernetes rules that a platform team could get wrong: a
DeviceClass is cluster-scoped and only the cluster admin writes it, `adminAccess`
requests are refused outside namespaces the admin labelled
`resource.kubernetes.io/admin-access: "true"`, and a pod can only name claims of its
own namespace. A tenant user (a ServiceAccount with the built-in `edit` ClusterRole
bound in its own namespace only, each request made with its own token) tries each
way around them; every attempt is denied with a message naming the reason, or shown
harmless by what the test reads back. No webhook runs here: these guarantees must
hold whether or not gpudra's webhook is reachable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gpudra.api.deviceclasses import device_classes

from e2e import smoke
from e2e.claims import pod_with_claim
from e2e.cluster.kube import ApiError, wait_for
from e2e.cluster.kube import Kube as SyncKube
from e2e.tenant_user import tenant_user

pytestmark = pytest.mark.cluster
DRIVER = "gpu.nvidia.com"
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


@pytest.fixture
def namespaces(kube: SyncKube) -> Iterator[tuple[str, str]]:
    """The tenant's namespace and another tenant's, with the driver's DeviceClasses."""
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    mine = smoke.make_namespace(kube, "escape-rbac")
    other = smoke.make_namespace(kube, "escape-rbac-other")
    yield mine, other
    kube.delete("Namespace", mine)
    kube.delete("Namespace", other)


def claim(ns: str, name: str, **exactly: Any) -> dict[str, Any]:
    request = {"deviceClassName": DRIVER, **exactly}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
    }


def denied(attempt: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        attempt(*args, **kwargs)
    return err.value


def test_admin_access_is_refused_outside_labelled_namespaces(
    kube: SyncKube, namespaces: tuple[str, str]
) -> None:
    ns, _ = namespaces
    user = tenant_user(kube, ns)
    err = denied(user.create, claim(ns, "admin", adminAccess=True))
    assert err.status == 422, err
    assert "spec.devices.requests[0].adminAccess: Forbidden" in str(err)
    assert f"requires the `{ADMIN_ACCESS_LABEL}: true` label" in str(err)
    assert kube.get_or_none("ResourceClaim", "admin", ns) is None

    # Nor can the tenant give its own namespace the label that would allow it.
    label = {"metadata": {"labels": {ADMIN_ACCESS_LABEL: "true"}}}
    err = denied(user.request, "PATCH", f"/api/v1/namespaces/{ns}", label)
    assert err.status == 403, err
    assert f'User "{user.name}" cannot patch resource "namespaces"' in str(err)
    labels = kube.get("Namespace", ns)["metadata"].get("labels", {})
    assert ADMIN_ACCESS_LABEL not in labels


def test_a_tenant_cannot_write_device_classes(kube: SyncKube, namespaces: tuple[str, str]) -> None:
    ns, _ = namespaces
    user = tenant_user(kube, ns)
    own = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": f"mine-{ns}"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}]},
    }
    err = denied(user.create, own)
    assert err.status == 403, err
    assert f'User "{user.name}" cannot create resource "deviceclasses"' in str(err)
    assert kube.get_or_none("DeviceClass", f"mine-{ns}") is None

    # Nor widen the driver's own class to match every device.
    widened = {"spec": {"selectors": [{"cel": {"expression": "true"}}]}}
    path = SyncKube.path("DeviceClass", name=DRIVER)
    err = denied(user.request, "PATCH", path, widened)
    assert err.status == 403, err
    assert f'User "{user.name}" cannot patch resource "deviceclasses"' in str(err)
    kept = kube.get("DeviceClass", DRIVER)["spec"]["selectors"]
    assert kept == next(
        c["spec"]["selectors"] for c in device_classes(DRIVER) if c["metadata"]["name"] == DRIVER
    )


def test_a_pod_cannot_name_another_namespaces_claim(
    kube: SyncKube, namespaces: tuple[str, str]
) -> None:
    ns, other = namespaces
    user = tenant_user(kube, ns)
    kube.create(claim(other, "theirs"))

    # The tenant cannot even read the other namespace's claim.
    err = denied(user.request, "GET", SyncKube.path("ResourceClaim", other, "theirs"))
    assert err.status == 403, err
    assert f'User "{user.name}" cannot get resource "resourceclaims"' in str(err)

    # A claim name is a name, not a path: "other/theirs" is no valid name.
    err = denied(user.create, pod_with_claim("by-path", ns, None, claim=f"{other}/theirs"))
    assert err.status == 422, err
    assert "spec.resourceClaims[0].resourceClaimName: Invalid value" in str(err)

    # A namespace next to the name is no field of a pod claim: it is dropped, and the
    # name resolves in the pod's own namespace, where no such claim exists.
    # Their claim is allocated and in use, as a claim worth taking would be.
    allocate(kube, other, "theirs")
    sneaky = pod_with_claim("sneaky", ns, None, claim="theirs")
    sneaky["spec"]["resourceClaims"][0]["namespace"] = other
    stored = user.create(sneaky)
    assert stored["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "theirs"}]
    assert stored["metadata"]["namespace"] == ns
    assert kube.get_or_none("ResourceClaim", "theirs", ns) is None

    # The scheduler looks for the claim in the pod's namespace only: the pod waits for
    # one there (no attempt is made before it exists), tries it once it does, and their
    # claim stays reserved for their pod alone.
    user.create(claim(ns, "theirs"))

    def waiting() -> str | None:
        pod = kube.get("Pod", "sneaky", ns)
        for condition in pod.get("status", {}).get("conditions", []):
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return str(condition.get("message", ""))
        return None

    wait_for("the scheduler to try the pod", waiting, timeout=60)
    assert not kube.get("Pod", "sneaky", ns)["spec"].get("nodeName")
    theirs = kube.get("ResourceClaim", "theirs", other)
    assert [r["name"] for r in theirs["status"]["reservedFor"]] == ["owner"]
    kube.delete("Pod", "sneaky", ns, grace=0)


def allocate(kube: SyncKube, ns: str, name: str) -> None:
    """Mark a claim allocated and reserved for its pod `owner`, as the scheduler would."""
    owner = kube.create(pod_with_claim("owner", ns, None, claim=name))
    claim = kube.get("ResourceClaim", name, ns)
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": "node-x", "device": "gpu-0"}
                ]
            }
        },
        "reservedFor": [{"resource": "pods", "name": "owner", "uid": owner["metadata"]["uid"]}],
    }
    kube.request("PUT", SyncKube.path("ResourceClaim", ns, name) + "/status", claim)


ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"


def test_pod_security_baseline_keeps_a_tenant_from_gpus_outside_claims(
    kube: SyncKube, namespaces: tuple[str, str]
) -> None:
    """A privileged container gets every device node of its node, so every GPU there
    with no claim, and a hostPath volume reaches the node agent's sockets, checkpoint
    and CDI specs: gpudra relies on Pod Security `baseline` in tenant namespaces (the
    webhook reports tenant namespaces without it). With the label set by the admin, each
    way in is refused by the API server, also when added to a running pod, and the
    tenant cannot lift the label."""
    ns, _ = namespaces
    kube.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}",
        {"metadata": {"labels": {ENFORCE_LABEL: "baseline"}}},
        content_type="application/merge-patch+json",
    )
    user = tenant_user(kube, ns)

    def plain(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]},
        }

    privileged = plain("privileged")
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    err = denied(user.create, privileged)
    assert err.status == 403, err
    assert 'violates PodSecurity "baseline:latest": privileged' in str(err)

    for name, path in (("sockets", "/var/lib/kubelet/plugins"), ("cdi", "/var/run/cdi")):
        mounted = plain(name)
        mounted["spec"]["volumes"] = [{"name": "host", "hostPath": {"path": path}}]
        err = denied(user.create, mounted)
        assert err.status == 403, err
        assert "hostPath volumes" in str(err)

    # A pod admitted plain cannot be given a privileged ephemeral container afterwards,
    # by the tenant, nor by anyone whose role allows adding one.
    user.create(plain("plain"))
    debug = {
        "name": "debug",
        "image": "registry.k8s.io/pause:3.10",
        "securityContext": {"privileged": True},
    }
    pod = kube.get("Pod", "plain", ns)
    pod["spec"]["ephemeralContainers"] = [debug]
    del pod["metadata"]["resourceVersion"]  # no precondition: the pod's status moves on
    path = SyncKube.path("Pod", ns, "plain") + "/ephemeralcontainers"
    err = denied(user.request, "PUT", path, pod)
    assert err.status == 403, err  # `edit` may not; where a role allows it, Pod Security:
    err = denied(kube.request, "PUT", path, pod)
    assert err.status == 403, err
    assert 'violates PodSecurity "baseline:latest": privileged' in str(err)
    assert not kube.get("Pod", "plain", ns)["spec"].get("ephemeralContainers")

    # Nor can the tenant lift the level.
    lift = {"metadata": {"labels": {ENFORCE_LABEL: "privileged"}}}
    err = denied(user.request, "PATCH", f"/api/v1/namespaces/{ns}", lift)
    assert err.status == 403, err
    assert kube.get("Namespace", ns)["metadata"]["labels"][ENFORCE_LABEL] == "baseline"
    for name in ("privileged", "sockets", "cdi"):
        assert kube.get_or_none("Pod", name, ns) is None
    kube.delete("Pod", "plain", ns, grace=0)
