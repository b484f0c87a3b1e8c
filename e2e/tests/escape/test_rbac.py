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

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpudra.api.deviceclasses import device_classes
from gpudra.driver.mpspods import MpsDaemonPods
from gpudra.driver.sharing import _POD_SCRIPT as POD_SCRIPT
from gpudra.driver.sharing import MpsDaemon

from e2e import smoke
from e2e.claims import pod_with_claim
from e2e.cluster.kube import ApiError, wait_for
from e2e.cluster.kube import Kube as SyncKube
from e2e.tenant_user import TenantUser, pod_bound_token, tenant_user
from e2e.tests.test_chart import node_access
from e2e.tools import helm

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
    # claim stays reserved for their pod alone. Where a node has a free GPU (kind's
    # emulated workers) the pod is scheduled on the tenant's own claim; where none has
    # (the local cluster's escape suite) it stays unschedulable. Either is a try.
    user.create(claim(ns, "theirs"))

    def tried() -> str | None:
        pod = kube.get("Pod", "sneaky", ns)
        for condition in pod.get("status", {}).get("conditions", []):
            if condition.get("type") == "PodScheduled" and condition.get("status") in (
                "True",
                "False",
            ):
                return str(condition["status"])
        return None

    outcome = wait_for("the scheduler to try the pod", tried, timeout=60)
    mine = kube.get("ResourceClaim", "theirs", ns)
    reserved = [r["name"] for r in mine.get("status", {}).get("reservedFor", [])]
    if outcome == "True":
        assert kube.get("Pod", "sneaky", ns)["spec"].get("nodeName")
        assert reserved == ["sneaky"], mine
    else:
        assert not kube.get("Pod", "sneaky", ns)["spec"].get("nodeName")
        assert reserved == [], mine
    theirs = kube.get("ResourceClaim", "theirs", other)
    assert [r["name"] for r in theirs["status"]["reservedFor"]] == ["owner"]
    kube.delete("Pod", "sneaky", ns, grace=0)


def allocate(kube: SyncKube, ns: str, name: str) -> None:
    """Mark a claim allocated and reserved for its pod `owner`, as the scheduler would.
    The pod asks for a node no cluster has (the allocation's pool), so that where
    nodes have GPUs (kind) the scheduler does not allocate the claim first."""
    owner = kube.create(pod_with_claim("owner", ns, "node-x", claim=name))
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


# -- The node agent's token: what the chart's admission policies leave it ---------------
#
# Whoever holds one node (the agent's token, or root there and so the kubelet's
# credentials) must not reach further. The kubelet may read every Secret and ConfigMap a
# pod bound to its node names and get a token for its ServiceAccount, so a pod the agent
# could shape freely would hand out the webhook's ServiceAccount and TLS key; a slice or
# a claim status it could write freely would break other nodes' pools and claims. Each
# attempt below is made with a token bound to a pod on the agent's node, as the
# DaemonSet's pod has it, against the chart's own RBAC and policies (a release of its
# own name, apart from any other test's).

AGENT_NS = "escape-rbac-agent"
AGENT_RELEASE = "escape"
AGENT_SA = "escape-gpudra-node"
WEBHOOK_SA = "escape-gpudra-webhook"
AGENT_NODE = "escape-agent-a"
OTHER_NODE = "escape-agent-b"
STATE_DIR = "/var/lib/gpudra"  # the chart's default node.stateDir
# What the agent runs in every daemon pod: its pod script and the daemon.
MPS_CONTROL = "/usr/bin/nvidia-cuda-mps-control"


class NodeAgent(TenantUser):
    """Requests with the agent's pod-bound token, and the chart's daemon pod template."""

    def __init__(self, kube: SyncKube, token: str, template: dict[str, Any]) -> None:
        super().__init__(kube.creds, token, f"system:serviceaccount:{AGENT_NS}:{AGENT_SA}")
        self.template = template

    def daemon_pod(
        self, node: str = AGENT_NODE, claim: str = "claim-a", *, multi_user: bool = False
    ) -> dict[str, Any]:
        """The pod the agent creates for claim `claim` (gpudra.driver.mpspods), its daemon
        with the options the agent gives it (`MpsDaemon.options`)."""
        pods = MpsDaemonPods(None, namespace=AGENT_NS, node_name=node, template=self.template)  # type: ignore[arg-type]
        folder = f"{STATE_DIR}/mps/{claim}"
        options = MpsDaemon(claim, Path(folder), Path(folder), (), multi_user=multi_user).options
        return pods.manifest(
            claim,
            ["sh", "-c", POD_SCRIPT, MPS_CONTROL, *options],
            {
                "CUDA_MPS_PIPE_DIRECTORY": f"{folder}/pipe",
                "CUDA_MPS_LOG_DIRECTORY": f"{folder}/log",
            },
            Path(f"{folder}/shm"),
            folders=[Path(f"{folder}/pipe"), Path(f"{folder}/log")],
        )

    def refused(self, method: str, path: str, body: Any = None) -> str:
        """The message of the policy's refusal (403)."""
        err = denied(self.request, method, path, body)
        assert err.status == 403, err
        return str(err)


@pytest.fixture
def node_agent(kube: SyncKube, request: pytest.FixtureRequest) -> Iterator[NodeAgent]:
    """The chart's node ServiceAccounts, RBAC and admission policies, rendered with the
    test's values (`agent_values`, indirect), and the agent's token bound to a pod on
    AGENT_NODE."""
    values = getattr(request, "param", {})
    try:
        objects = helm.template(
            helm.helm_binary(), values, release=AGENT_RELEASE, namespace=AGENT_NS
        )
    except helm.HelmUnavailable as e:
        pytest.skip(str(e))
    mine = node_access(objects)
    mps = helm.find(objects, "ConfigMap", f"{AGENT_SA}-mps")
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": AGENT_NS}})
    try:
        for node in (AGENT_NODE, OTHER_NODE):
            kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        for obj in mine:
            kube.request(
                "PATCH",
                object_path(obj, named=True),
                obj,
                content_type="application/apply-patch+yaml",
                query={"fieldManager": "gpudra-e2e", "force": "true"},
            )
        # What an attacker would name: the webhook's ServiceAccount (the admin's, here).
        kube.request(
            "POST",
            f"/api/v1/namespaces/{AGENT_NS}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": WEBHOOK_SA}},
        )
        token = pod_bound_token(kube, AGENT_NS, AGENT_SA, AGENT_NODE, "node-agent")
        yield NodeAgent(kube, token, json.loads(mps["data"]["pod.json"]))
    finally:
        for obj in mine:
            if "namespace" not in obj["metadata"]:
                kube.request("DELETE", object_path(obj, named=True))
        for slice_ in kube.request("GET", SLICES)["items"]:
            if slice_["spec"].get("nodeName") in (AGENT_NODE, OTHER_NODE):
                kube.delete("ResourceSlice", slice_["metadata"]["name"])
        # No kubelet runs on these nodes to see a pod end: gone at once.
        for pod in kube.request("GET", f"/api/v1/namespaces/{AGENT_NS}/pods")["items"]:
            kube.delete("Pod", pod["metadata"]["name"], AGENT_NS, grace=0)
        kube.delete("Namespace", AGENT_NS)
        for node in (AGENT_NODE, OTHER_NODE):
            kube.delete("Node", node)
        wait_for(
            f"namespace {AGENT_NS} deleted",
            lambda: kube.get_or_none("Namespace", AGENT_NS) is None,
            timeout=60,
        )


SLICES = "/apis/resource.k8s.io/v1/resourceslices"
RBAC_API = "/apis/rbac.authorization.k8s.io/v1"
ADMISSION_API = "/apis/admissionregistration.k8s.io/v1"
_RESOURCES = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": (RBAC_API, "roles"),
    "RoleBinding": (RBAC_API, "rolebindings"),
    "ClusterRole": (RBAC_API, "clusterroles"),
    "ClusterRoleBinding": (RBAC_API, "clusterrolebindings"),
    "ValidatingAdmissionPolicy": (ADMISSION_API, "validatingadmissionpolicies"),
    "ValidatingAdmissionPolicyBinding": (ADMISSION_API, "validatingadmissionpolicybindings"),
}


def object_path(obj: dict[str, Any], *, named: bool = False) -> str:
    api, plural = _RESOURCES[obj["kind"]]
    meta = obj["metadata"]
    ns = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
    return f"{api}{ns}/{plural}" + (f"/{meta['name']}" if named else "")


def in_force(agent: NodeAgent, attempt: dict[str, Any]) -> str:
    """Waits until the API server enforces the policies (loaded a moment after they
    are created): `attempt`, a daemon pod for another node, is refused. Its message."""
    pods = f"/api/v1/namespaces/{AGENT_NS}/pods"

    def refused() -> str | None:
        try:
            agent.request("POST", pods, attempt)
        except ApiError as err:
            return str(err) if err.status == 403 else None
        # Created before the policy was in force: out of the way of the next attempt.
        agent.request("DELETE", f"{pods}/{attempt['metadata']['name']}")
        return None

    return wait_for("the node agent's admission policies in force", refused, timeout=30)


def with_volume(pod: dict[str, Any], volume: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["volumes"].append(volume)
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": volume["name"], "mountPath": "/x"})
    return pod


DAEMON_POD_ATTEMPTS: dict[str, tuple[Any, str]] = {
    # The review's exploit: the webhook's ServiceAccount and TLS Secret, read by a shell.
    "webhook-service-account": (
        lambda p: p["spec"].update(serviceAccountName=WEBHOOK_SA),
        "runs as ServiceAccount escape-gpudra-node-mps",
    ),
    "default-service-account": (
        lambda p: p["spec"].pop("serviceAccountName"),
        "runs as ServiceAccount escape-gpudra-node-mps",
    ),
    "secret-volume": (
        lambda p: with_volume(
            p, {"name": "s", "secret": {"secretName": "escape-gpudra-webhook-tls"}}
        ),
        "no Secret, ConfigMap, projected token or other volume",
    ),
    "configmap-volume": (
        lambda p: with_volume(p, {"name": "s", "configMap": {"name": "kube-root-ca.crt"}}),
        "no Secret, ConfigMap, projected token or other volume",
    ),
    "projected-token": (
        lambda p: with_volume(
            p,
            {
                "name": "t",
                "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]},
            },
        ),
        "no Secret, ConfigMap, projected token or other volume",
    ),
    "host-root": (
        lambda p: with_volume(p, {"name": "h", "hostPath": {"path": "/etc"}}),
        "a claim's folders under /var/lib/gpudra/mps/",
    ),
    "state-folder": (
        lambda p: with_volume(p, {"name": "h", "hostPath": {"path": STATE_DIR}}),
        "a claim's folders under /var/lib/gpudra/mps/",
    ),
    "all-claims-folders": (
        lambda p: with_volume(p, {"name": "h", "hostPath": {"path": f"{STATE_DIR}/mps/"}}),
        "a claim's folders under /var/lib/gpudra/mps/",
    ),
    "env-secret": (
        lambda p: p["spec"]["containers"][0]["env"].append(
            {
                "name": "K",
                "valueFrom": {"secretKeyRef": {"name": "escape-gpudra-webhook-tls", "key": "k"}},
            }
        ),
        "no env valueFrom or envFrom",
    ),
    "env-from-configmap": (
        lambda p: p["spec"]["containers"][0].update(
            envFrom=[{"configMapRef": {"name": "kube-root-ca.crt"}}]
        ),
        "no env valueFrom or envFrom",
    ),
    "pull-secret": (
        lambda p: p["spec"].update(imagePullSecrets=[{"name": "escape-gpudra-webhook-tls"}]),
        "no image pull secrets but the chart's",
    ),
    "host-pid": (lambda p: p["spec"].update(hostPID=True), "uses no host namespace"),
    "host-network": (lambda p: p["spec"].update(hostNetwork=True), "uses no host namespace"),
    "pod-security-context": (
        lambda p: p["spec"].update(securityContext={"seLinuxOptions": {"type": "spc_t"}}),
        "no host namespace, runtime class or pod security context",
    ),
    "container-security-context": (
        lambda p: p["spec"]["containers"][0]["securityContext"].update(runAsUser=1000),
        "the security context the chart renders for it",
    ),
    "command": (
        lambda p: p["spec"]["containers"][0].update(command=["sh", "-c", "cat /t/token"]),
        "runs the agent's daemon command (the daemon, and -M",
    ),
    # The script passes the daemon's options on to it: only multi-user mode's, once.
    "another-daemon-option": (
        lambda p: p["spec"]["containers"][0]["command"].append("-p"),
        "runs the agent's daemon command (the daemon, and -M",
    ),
    "options-beyond-multi-user": (
        lambda p: p["spec"]["containers"][0]["command"].extend(["-M", "-M"]),
        "runs the agent's daemon command (the daemon, and -M",
    ),
    "post-start-hook": (
        lambda p: p["spec"]["containers"][0].update(
            lifecycle={"postStart": {"exec": {"command": ["sh", "-c", "cat /t/token"]}}}
        ),
        "no args, lifecycle hooks or probes",
    ),
}


@pytest.mark.parametrize(
    "node_agent",
    [{}, {"nodeScopedSlices": {"enabled": False}, "node": {"nvml": "emulated:l4"}}],
    ids=["real-gpus", "emulated-gpus-without-node-scoped-slices"],
    indirect=True,
)
def test_node_agent_daemon_pods_name_no_secret_token_or_host_folder(
    kube: SyncKube, node_agent: NodeAgent
) -> None:
    """The agent's own daemon pod is created; every change that would name a Secret,
    ConfigMap or ServiceAccount token, mount more of the host, or share a host namespace
    is refused, also with nodeScopedSlices off (the Role's pod rule stays then)."""
    agent = node_agent
    pods = f"/api/v1/namespaces/{AGENT_NS}/pods"
    message = in_force(agent, agent.daemon_pod(OTHER_NODE, claim="probe"))
    assert "may only create or delete pods bound to its own node" in message
    created = agent.request("POST", pods, agent.daemon_pod())
    assert created["spec"]["serviceAccountName"] == f"{AGENT_SA}-mps"
    agent.request("DELETE", f"{pods}/{created['metadata']['name']}")
    multi_user = agent.request("POST", pods, agent.daemon_pod(claim="users", multi_user=True))
    assert multi_user["spec"]["containers"][0]["command"][-1] == "-M"
    agent.request("DELETE", f"{pods}/{multi_user['metadata']['name']}")
    for name, (change, expected) in DAEMON_POD_ATTEMPTS.items():
        pod = agent.daemon_pod(claim=f"claim-{name}")
        change(pod)
        message = agent.refused("POST", pods, pod)
        assert expected in message, (name, message)
        assert kube.get_or_none("Pod", pod["metadata"]["name"], AGENT_NS) is None, name
    # A path that climbs out of a claim's folder: refused by the API server's own
    # validation before the policy sees it, or by the policy.
    pod = with_volume(
        agent.daemon_pod(claim="claim-climb"),
        {"name": "h", "hostPath": {"path": f"{STATE_DIR}/mps/x/../../../../etc"}},
    )
    err = denied(agent.request, "POST", pods, pod)
    assert err.status in (403, 422), err


def agent_slice(node: str, name: str, *, pool: str | None = None, driver: str = DRIVER) -> Any:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def test_node_agent_cannot_squat_another_nodes_pool(kube: SyncKube, node_agent: NodeAgent) -> None:
    """A slice of the agent's node that publishes another node's pool (its devices would
    make that pool incomplete or invalid for the scheduler) or another driver's is
    refused; its own node's pool is written."""
    agent = node_agent

    def squat_refused() -> str | None:
        try:
            agent.request("POST", SLICES, agent_slice(AGENT_NODE, "escape-squat", pool=OTHER_NODE))
        except ApiError as err:
            return str(err) if err.status == 403 else None
        kube.delete("ResourceSlice", "escape-squat")
        return None

    message = wait_for("the slice policy in force", squat_refused, timeout=30)
    assert f"may only publish the pool of its own node, {AGENT_NODE}" in message
    message = agent.refused(
        "POST", SLICES, agent_slice(AGENT_NODE, "escape-other-driver", driver="other.example.com")
    )
    assert f"only write ResourceSlices of its driver, {DRIVER}" in message
    kube.create(agent_slice(AGENT_NODE, "escape-other-driver", driver="other.example.com"))
    message = agent.refused("DELETE", f"{SLICES}/escape-other-driver")
    assert f"only write ResourceSlices of its driver, {DRIVER}" in message
    mine = agent.request("POST", SLICES, agent_slice(AGENT_NODE, "escape-mine"))
    mine["spec"]["pool"]["name"] = OTHER_NODE
    err = denied(agent.request, "PUT", f"{SLICES}/escape-mine", mine)
    assert err.status in (403, 422), err  # pool.name is also immutable in recent versions
    agent.request("DELETE", f"{SLICES}/escape-mine")


def allocated_claim(kube: SyncKube, name: str, node: str) -> Any:
    """A claim allocated on `node` and reserved for its running pod there, as the
    scheduler leaves it (the claim controller drops reservations of missing pods)."""
    kube.create(claim(AGENT_NS, name))
    owner = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-owner", "namespace": AGENT_NS},
            "spec": {
                "nodeName": node,
                "containers": [
                    {"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            },
        }
    )
    stored = kube.get("ResourceClaim", name, AGENT_NS)
    on_node = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    stored["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}]
            },
            "nodeSelector": {"nodeSelectorTerms": [on_node]},
        },
        "reservedFor": [
            {"resource": "pods", "name": f"{name}-owner", "uid": owner["metadata"]["uid"]}
        ],
    }
    return kube.request("PUT", SyncKube.path("ResourceClaim", AGENT_NS, name) + "/status", stored)


def status_refused(agent: NodeAgent, path: str, body: Any) -> str:
    """The refusal of a status write: by the policy, or, for allocation and reservedFor
    since Kubernetes 1.36, by the API server's own check (resourceclaims/binding)
    before it. Status writes are refused as invalid (422), naming why."""
    err = denied(agent.request, "PATCH", path, body)
    assert err.status in (403, 422), err
    return str(err)


@pytest.mark.parametrize("node_agent", [{"node": {"claimStatus": True}}], indirect=True)
def test_node_agent_claim_status_writes_only_its_own_entries(
    kube: SyncKube, node_agent: NodeAgent
) -> None:
    """With node.claimStatus the agent may patch claims' status: it writes its own
    driver's entries of its own pool, as gpudra.driver.claimstatus does, and cannot clear
    a running claim's reservedFor or allocation, nor write another pool's entries."""
    agent = node_agent
    mine = allocated_claim(kube, "escape-mine", AGENT_NODE)
    other = allocated_claim(kube, "escape-other", OTHER_NODE)
    assert mine["status"]["reservedFor"] and other["status"]["reservedFor"]
    mine_status = f"{SyncKube.path('ResourceClaim', AGENT_NS, 'escape-mine')}/status"
    other_status = f"{SyncKube.path('ResourceClaim', AGENT_NS, 'escape-other')}/status"
    # The node agent's policies are loaded together: one in force, all are.
    in_force(agent, agent.daemon_pod(OTHER_NODE, claim="probe"))
    for path in (mine_status, other_status):
        for cleared in ({"reservedFor": None}, {"allocation": None, "reservedFor": None}):
            message = status_refused(agent, path, {"status": cleared})
            assert (
                "may not change a ResourceClaim's allocation or reservedFor" in message
                or 'requires resource="resourceclaims/binding"' in message
            ), message
    for name, before in (("escape-mine", mine), ("escape-other", other)):
        stored = kube.get("ResourceClaim", name, AGENT_NS)["status"]
        assert stored["reservedFor"] == before["status"]["reservedFor"], name
        assert stored["allocation"] == before["status"]["allocation"], name
        assert not stored.get("devices"), name
    # Its own entry, written as the agent writes it (server-side apply, its own manager).
    own = {"driver": DRIVER, "pool": AGENT_NODE, "device": "gpu-0", "data": {"sharing": "x"}}
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "escape-mine", "namespace": AGENT_NS, "uid": mine["metadata"]["uid"]},
        "status": {"devices": [own]},
    }
    agent.request(
        "PATCH",
        f"{mine_status}?fieldManager={DRIVER}&force=true",
        body,
        content_type="application/apply-patch+yaml",
    )
    stored = kube.get("ResourceClaim", "escape-mine", AGENT_NS)["status"]
    assert stored["reservedFor"] == mine["status"]["reservedFor"]
    if stored.get("devices") is not None:  # kept where DRAResourceClaimDeviceStatus is on
        assert [{k: v for k, v in e.items() if v is not None} for e in stored["devices"]] == [own]
