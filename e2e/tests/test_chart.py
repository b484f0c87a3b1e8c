"""The chart against the real API server: every rendered object passes a server-side
dry-run apply, the node-scoped slice policy really denies other nodes' slices, and
`helm install` stops before creating anything on bad values or a device plugin."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding
from gpudra.common.kube import Kube as CommonKube
from gpudra.driver.mpspods import MpsDaemonPods
from gpudra.driver.sharing import _POD_SCRIPT as POD_SCRIPT
from gpudra.webhook import registration
from gpudra.webhook.cabundle import FIELD_MANAGER
from gpudra.webhook.certs import (
    CertKeyPair,
    ensure_serving_from_ca,
    generate_ca,
    service_dns_names,
)

from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, Kube, crd_established, field_managers, wait_for
from e2e.node.realnode import WEBHOOK_CONFIGURATIONS
from e2e.tenant_user import pod_bound_token
from e2e.tools import helm as h

pytestmark = pytest.mark.cluster
NAMESPACE = "gpudra-chart-e2e"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NAMES = service_dns_names("gpudra-webhook", NAMESPACE)


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return h.helm_binary()
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")


@pytest.fixture(scope="module")
def kubectl(cluster: Cluster) -> list[str]:
    return [
        str(cluster.bin_dir() / "kubectl"),
        "--kubeconfig",
        str(cluster.layout.admin_kubeconfig),
    ]


@pytest.fixture(scope="module")
def namespace(kube: Kube) -> Iterator[str]:
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    yield NAMESPACE
    kube.delete("Namespace", NAMESPACE)


def fake_node(kube: Kube, name: str, gpus: int = 0, labels: dict[str, str] | None = None) -> None:
    """A Node object (no kubelet); `gpus` > 0 makes it look like a device-plugin node."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"gpudra.dev/chart-e2e": "true", **(labels or {})},
            },
        }
    )
    if gpus:
        capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        kube.patch_status("Node", name, {"status": {"capacity": capacity, "allocatable": capacity}})


def apply(kubectl: list[str], objects: list[dict[str, Any]], *flags: str) -> str:
    stream = "\n---\n".join(yaml.safe_dump(o) for o in objects)
    proc = subprocess.run(
        [*kubectl, "apply", "--server-side", "--field-manager=helm", *flags, "-f", "-"],
        input=stream,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def delete(kubectl: list[str], objects: list[dict[str, Any]]) -> None:
    stream = "\n---\n".join(yaml.safe_dump(o) for o in objects)
    proc = subprocess.run(
        [*kubectl, "delete", "--ignore-not-found", "-f", "-"],
        input=stream,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def install_crds(kube: Kube, kubectl: list[str], objects: list[dict[str, Any]]) -> None:
    """Custom resources can only be dry-run once their CRD is served: create CRDs for real."""
    apply(kubectl, objects)
    for crd in objects:
        name = crd["metadata"]["name"]
        wait_for(f"CRD {name} Established", functools.partial(crd_established, kube, name))


@pytest.mark.parametrize("values", ["default", "full"])
def test_every_rendered_object_passes_server_side_dry_run(
    helm: Path, kube: Kube, kubectl: list[str], namespace: str, values: str
) -> None:
    files = [] if values == "default" else [h.FULL_VALUES]
    objects = h.template(helm, *files, namespace=namespace)
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert crds, "the chart renders the GpuTenant CRD"
    rest = [o for o in objects if o["kind"] != "CustomResourceDefinition"]
    try:
        install_crds(kube, kubectl, crds)
        # The suite's cluster already holds the DeviceClasses, written by the test harness
        # with the default values; the full values give the shared class another config,
        # a field conflict a real install (the chart owning its classes) never has. The
        # dry run checks the objects, so it takes the fields over.
        out = apply(kubectl, rest, "--dry-run=server", "--force-conflicts")
    finally:
        delete(kubectl, crds)  # helm refuses to adopt objects it did not create
    applied = [ln for ln in out.splitlines() if "serverside-applied (server dry run)" in ln]
    assert len(applied) == len(rest), out
    # A dry run stores nothing.
    daemonsets = kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/daemonsets")
    assert daemonsets["items"] == []


class Token:
    """Requests as the node agent would make them, with a pod-bound ServiceAccount token."""

    def __init__(self, cluster: Cluster, kube: Kube, token: str) -> None:
        self.base = f"https://{kube.creds.host}:{kube.creds.port}"
        self.ctx = ssl.create_default_context(cafile=str(kube.creds.ca))
        self.token = token

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


def slice_for(node: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


ACCESS_KINDS = frozenset(
    {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)


def node_access(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendered objects that say what the node agent may do: its ServiceAccounts,
    roles, bindings and admission policies."""
    return [
        o
        for o in objects
        if o["kind"] in ACCESS_KINDS
        and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "node"
    ]


@pytest.fixture
def node_agent_token(
    helm: Path, cluster: Cluster, kube: Kube, kubectl: list[str], namespace: str
) -> Iterator[Token]:
    """The chart's node RBAC and admission policy for real, and a token bound to a pod on
    node chart-e2e-a, as the DaemonSet's pod would have."""
    node_objects = node_access(h.template(helm, namespace=namespace))
    apply(kubectl, node_objects)
    fake_node(kube, "chart-e2e-a")
    fake_node(kube, "chart-e2e-b")
    token = pod_bound_token(kube, namespace, "gpudra-node", "chart-e2e-a", "node-agent")
    yield Token(cluster, kube, token)
    kube.delete("Pod", "node-agent", namespace, grace=0)
    for name in ("chart-e2e-a-gpu", "chart-e2e-b-gpu"):
        kube.delete("ResourceSlice", name)
    for node in ("chart-e2e-a", "chart-e2e-b"):
        kube.delete("Node", node)
    delete(kubectl, node_objects)


def test_node_agent_writes_only_its_own_nodes_slices(kube: Kube, node_agent_token: Token) -> None:
    agent = node_agent_token
    kube.create(slice_for("chart-e2e-b", "chart-e2e-b-gpu"))  # another node's, by the admin

    # The policy is enforced once the API server has loaded it.
    def denied() -> Any:
        status, body = agent.request("POST", SLICES, slice_for("chart-e2e-b", "chart-e2e-x"))
        return body if status == 403 else None

    body = wait_for("the admission policy to deny another node's slice", denied, timeout=30)
    assert "may only write ResourceSlices of its own node" in body["message"]
    assert "of node chart-e2e-b" in body["message"]

    status, created = agent.request("POST", SLICES, slice_for("chart-e2e-a", "chart-e2e-a-gpu"))
    assert status == 201, created
    created["spec"]["devices"].append({"name": "gpu-1"})
    status, body = agent.request("PUT", f"{SLICES}/chart-e2e-a-gpu", created)
    assert status == 200, body

    other = kube.get("ResourceSlice", "chart-e2e-b-gpu")
    other["spec"]["devices"].append({"name": "gpu-1"})
    status, body = agent.request("PUT", f"{SLICES}/chart-e2e-b-gpu", other)
    assert status == 403, body
    status, body = agent.request("DELETE", f"{SLICES}/chart-e2e-b-gpu")
    assert status == 403, body
    # Moving its own slice to another node is a write to that node too.
    mine = kube.get("ResourceSlice", "chart-e2e-a-gpu")
    mine["spec"]["nodeName"] = "chart-e2e-b"
    status, body = agent.request("PUT", f"{SLICES}/chart-e2e-a-gpu", mine)
    assert status in (403, 422), body  # nodeName is also immutable in recent versions
    status, body = agent.request("DELETE", f"{SLICES}/chart-e2e-a-gpu")
    assert status == 200, body


def test_node_agent_creates_only_its_own_nodes_daemon_pods(
    helm: Path, kube: Kube, node_agent_token: Token, namespace: str
) -> None:
    """The agent may run pods for its MPS daemons; the admission policy holds it to
    those: on its own node, labelled as daemon pods, the chart's image, no token."""
    agent = node_agent_token
    rendered = h.template(helm, namespace=namespace)
    cm = next(
        o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-mps")
    )
    template = json.loads(cm["data"]["pod.json"])
    pods = f"/api/v1/namespaces/{namespace}/pods"

    def daemon_pod(node: str, claim: str = "claim-a") -> dict[str, Any]:
        pods_of = MpsDaemonPods(None, namespace=namespace, node_name=node, template=template)  # type: ignore[arg-type]
        # The agent's own command: the policy allows no other.
        argv = ["sh", "-c", POD_SCRIPT, "/usr/bin/nvidia-cuda-mps-control"]
        return pods_of.manifest(claim, argv, {"A": "1"}, None)

    def denied() -> Any:
        # A claim of its own: a probe sent before the policy is in force is created, and
        # must not take the name of the pod the agent creates below (409, not 201).
        status, body = agent.request("POST", pods, daemon_pod("chart-e2e-b", claim="probe"))
        return body if status == 403 else None

    body = wait_for("the admission policy to deny another node's pod", denied, timeout=30)
    assert "may only create or delete pods bound to its own node" in body["message"]

    other_image = daemon_pod("chart-e2e-a")
    other_image["spec"]["containers"][0]["image"] = "busybox:latest"
    with_token = daemon_pod("chart-e2e-a")
    with_token["spec"]["automountServiceAccountToken"] = True
    unlabelled = daemon_pod("chart-e2e-a")
    del unlabelled["metadata"]["labels"]["app.kubernetes.io/component"]
    with_init = daemon_pod("chart-e2e-a")
    with_init["spec"]["initContainers"] = [dict(with_init["spec"]["containers"][0], name="i")]
    for pod, message in (
        (other_image, "runs the chart's image only"),
        (with_token, "without init containers or a service account token"),
        (unlabelled, "only create or delete its MPS control daemon pods"),
        (with_init, "without init containers"),
    ):
        status, body = agent.request("POST", pods, pod)
        assert status == 403 and message in body["message"], body

    status, created = agent.request("POST", pods, daemon_pod("chart-e2e-a"))
    assert status == 201, created
    status, body = agent.request("DELETE", f"{pods}/{created['metadata']['name']}")
    assert status == 200, body
    # Pods it may not touch: another node's daemon pod, and a pod that is not one.
    kube.create(daemon_pod("chart-e2e-b", "claim-b"))
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "not-a-daemon", "namespace": namespace},
            "spec": {"nodeName": "chart-e2e-a", "containers": [{"name": "c", "image": "x"}]},
        }
    )
    for name in (daemon_pod("chart-e2e-b", "claim-b")["metadata"]["name"], "not-a-daemon"):
        status, body = agent.request("DELETE", f"{pods}/{name}")
        assert status == 403, body
        kube.delete("Pod", name, namespace, grace=0)
    kube.delete("Pod", created["metadata"]["name"], namespace, grace=0)
    # The probe, if one was created before the policy was in force (404 otherwise).
    kube.delete("Pod", daemon_pod("chart-e2e-b", claim="probe")["metadata"]["name"], namespace, 0)


def helm_env(cluster: Cluster) -> dict[str, str]:
    return {"KUBECONFIG": str(cluster.layout.admin_kubeconfig)}


def released_objects(kube: Kube, release: str) -> list[str]:
    selector = f"app.kubernetes.io/instance={release}"
    found = [
        f"ClusterRole/{o['metadata']['name']}"
        for o in kube.request(
            "GET",
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            query={"labelSelector": selector},
        )["items"]
    ]
    found += [
        f"Secret/{o['metadata']['name']}"
        for o in kube.request(
            "GET", f"/api/v1/namespaces/{NAMESPACE}/secrets", query={"labelSelector": "owner=helm"}
        )["items"]
    ]
    return found


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"deviceClasses": {"shared": {"strategy": "Spatial"}}}, "/deviceClasses/shared/strategy"),
        ({"node": {"driverRoot": "run/nvidia/driver"}}, "/node/driverRoot"),
        ({"webhook": {"port": 70000}}, "/webhook/port"),
    ],
    ids=["sharing-mode", "driver-root", "webhook-port"],
)
def test_install_with_bad_values_creates_nothing(
    helm: Path,
    cluster: Cluster,
    kube: Kube,
    namespace: str,
    values: dict[str, Any],
    message: str,
    tmp_path: Path,
) -> None:
    with pytest.raises(h.HelmFailed) as failure:
        h.run(
            helm,
            "install",
            "bad",
            str(h.CHART),
            "--namespace",
            namespace,
            *h.values_args([values], tmp_path),
            env=helm_env(cluster),
        )
    assert message in str(failure.value)
    assert released_objects(kube, "bad") == []


def test_install_refuses_a_device_plugin_node(
    helm: Path, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    fake_node(kube, "chart-e2e-plugin", gpus=4, labels={"pool": "legacy"})
    fake_node(kube, "chart-e2e-dra", labels={"pool": "dra"})
    try:
        base = ["install", "gpu", str(h.CHART), "--namespace", namespace, "--dry-run=server"]
        # Other tests may have created the driver's DeviceClasses outside Helm, and a
        # release elsewhere keeps the GpuTenant CRD (crds.keep); an install would refuse
        # to adopt them, which is not what this test is about.
        for kind in ("gpu", "mig", "shared"):
            base += ["--set", f"deviceClasses.{kind}.enabled=false"]
        base += ["--set", "crds.install=false"]
        with pytest.raises(h.HelmFailed) as failure:
            h.run(helm, *base, env=helm_env(cluster))
        assert "nodes chart-e2e-plugin advertise nvidia.com/gpu" in str(failure.value)
        assert "devicePlugin.allowCoexistence=true" in str(failure.value)
        # Narrowed to nodes without the device plugin, or explicitly allowed: installs.
        h.run(helm, *base, "--set", "node.nodeSelector.pool=dra", env=helm_env(cluster))
        h.run(helm, *base, "--set", "devicePlugin.allowCoexistence=true", env=helm_env(cluster))
    finally:
        kube.delete("Node", "chart-e2e-plugin")
        kube.delete("Node", "chart-e2e-dra")
    assert released_objects(kube, "gpu") == []


# -- webhook.tls.source=helm across upgrades: the chart's `lookup` of its own Secret ----


TLS_SECRET = "gpudra-webhook-tls"
# Other tests may have created the driver's DeviceClasses outside Helm, and a release
# elsewhere keeps the GpuTenant CRD (crds.keep); a release (or a server dry run) would
# refuse to adopt them, which is not what the TLS tests are about.
ADOPTS_NOTHING = {
    "deviceClasses": {kind: {"enabled": False} for kind in ("gpu", "mig", "shared")},
    "crds": {"install": False},
}


def render_with_lookup(
    helm: Path, cluster: Cluster, namespace: str, source: str
) -> list[dict[str, Any]]:
    """Render with webhook.tls.source `source` and the API server's objects visible to
    `lookup`, as an upgrade does."""
    return h.template(
        helm,
        ADOPTS_NOTHING,
        {"webhook": {"tls": {"source": source}}},
        namespace=namespace,
        extra=["--dry-run=server", "--kubeconfig", str(cluster.layout.admin_kubeconfig)],
    )


def render_chart_tls(
    helm: Path, cluster: Cluster, namespace: str
) -> tuple[dict[str, bytes], dict[str, Any], list[x509.Certificate]]:
    """Render tls.source=helm as an upgrade does: the Secret's files, its metadata, and
    the caBundle's certificates."""
    objects = render_with_lookup(helm, cluster, namespace, "helm")
    secret = h.find(objects, "Secret", TLS_SECRET)
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    (hook,) = h.find(objects, "MutatingWebhookConfiguration")["webhooks"]
    bundle = x509.load_pem_x509_certificates(base64.b64decode(hook["clientConfig"]["caBundle"]))
    return files, secret["metadata"], bundle


def delete_secret(kube: Kube, namespace: str) -> None:
    with contextlib.suppress(ApiError):  # already gone
        kube.request("DELETE", f"/api/v1/namespaces/{namespace}/secrets/{TLS_SECRET}")


def put_secret(kube: Kube, namespace: str, files: dict[str, bytes], renew_after: str = "") -> None:
    delete_secret(kube, namespace)
    # Owned by the release, as after an install, so the render is an upgrade's.
    annotations = {
        "meta.helm.sh/release-name": "gpudra",
        "meta.helm.sh/release-namespace": namespace,
    }
    if renew_after:
        annotations["gpudra.nvidia.com/ca-renew-after"] = renew_after
    metadata: dict[str, Any] = {
        "name": TLS_SECRET,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "Helm"},
        "annotations": annotations,
    }
    kube.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": metadata,
            "data": {k: base64.b64encode(v).decode() for k, v in files.items()},
        },
    )


def serves_from(files: dict[str, bytes], tmp: Path) -> CertKeyPair:
    """What the webhook (--cert-source=ca) serves when that Secret is mounted."""
    secret = tmp / "secret"
    secret.mkdir(parents=True)
    for name, data in files.items():
        (secret / name).write_bytes(data)
    serving, _ = ensure_serving_from_ca(secret, tmp / "serving", NAMES)
    return serving


def trusted_by(cert: CertKeyPair | bytes, bundle: list[x509.Certificate]) -> bool:
    leaf = x509.load_pem_x509_certificate(cert if isinstance(cert, bytes) else cert.cert_pem)
    for ca in bundle:
        try:
            leaf.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def test_chart_ca_is_kept_renewed_and_rotated_across_upgrades(
    helm: Path, cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path
) -> None:
    try:
        # First install: a CA with its key, which the webhook signs its certificate from.
        first, meta, bundle = render_chart_tls(helm, cluster, namespace)
        assert {"ca.crt", "ca.key", "tls.crt", "tls.key"} <= set(first)
        assert trusted_by(serves_from(first, tmp_path / "a"), bundle)
        renew_after = meta["annotations"]["gpudra.nvidia.com/ca-renew-after"]

        # An upgrade keeps the CA (no caBundle change under running pods) and re-signs
        # the Secret's serving certificate.
        put_secret(kube, namespace, first, renew_after)
        kept, _, kept_bundle = render_chart_tls(helm, cluster, namespace)
        assert kept["ca.crt"] == first["ca.crt"] and kept["ca.key"] == first["ca.key"]
        assert kept["tls.crt"] != first["tls.crt"]
        assert [c.public_bytes(Encoding.PEM) for c in kept_bundle] == [
            c.public_bytes(Encoding.PEM) for c in bundle
        ]

        # Two thirds into the CA's life: a new CA; the old one stays in the bundle so
        # pods still serving from it are trusted until they follow.
        put_secret(kube, namespace, first, "2000-01-01T00:00:00Z")
        rotated, _, rotated_bundle = render_chart_tls(helm, cluster, namespace)
        assert rotated["ca.crt"] != first["ca.crt"]
        assert rotated["ca-previous.crt"] == first["ca.crt"]
        assert trusted_by(serves_from(first, tmp_path / "b"), rotated_bundle)
        assert trusted_by(serves_from(rotated, tmp_path / "c"), rotated_bundle)

        # A Secret from a chart version that kept no CA key: a new CA the webhook can
        # renew from, the old serving certificate still trusted.
        legacy = {k: v for k, v in first.items() if k in ("ca.crt", "tls.crt", "tls.key")}
        put_secret(kube, namespace, legacy)
        upgraded, _, upgraded_bundle = render_chart_tls(helm, cluster, namespace)
        assert "ca.key" in upgraded and upgraded["ca-previous.crt"] == legacy["ca.crt"]
        assert trusted_by(legacy["tls.crt"], upgraded_bundle)
        assert trusted_by(serves_from(upgraded, tmp_path / "d"), upgraded_bundle)
    finally:
        delete_secret(kube, namespace)


def release_configurations(bundle: bytes, namespace: str) -> list[dict[str, Any]]:
    """gpudra's two webhook configurations trusting `bundle`, owned by the release as
    after an install, reviewing nothing while they stand."""
    b64 = base64.b64encode(bundle).decode()
    url = "https://127.0.0.1:9/"
    configs = [
        registration.mutating_configuration(ca_bundle_b64=b64, own_namespace=namespace, url=url),
        registration.validating_configuration(
            ca_bundle_b64=b64,
            own_namespace=namespace,
            device_classes=["gpu.nvidia.com"],
            driver="gpu.nvidia.com",
            url=url,
        ),
    ]
    for config in configs:
        config["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "Helm"}
        config["metadata"]["annotations"] = {
            "meta.helm.sh/release-name": "gpudra",
            "meta.helm.sh/release-namespace": namespace,
        }
        for hook in config["webhooks"]:
            hook["objectSelector"] = {"matchLabels": {"gpudra-e2e/never": "true"}}
    return configs


@contextlib.contextmanager
def configurations_removed_after(kube: Kube) -> Iterator[None]:
    """For a test that makes gpudra's webhook configurations: none may be live before
    (another test's would be replaced), and none is left after."""
    for kind, name in WEBHOOK_CONFIGURATIONS:
        assert kube.get_or_none(kind, name) is None, f"{kind} {name} is live; left by a test?"
    try:
        yield
    finally:
        for kind, name in WEBHOOK_CONFIGURATIONS:
            with contextlib.suppress(ApiError):
                kube.delete(kind, name)


def write_as_webhook(kube: Kube, kind: str, name: str, bundle: bytes) -> None:
    """Sets every caBundle of one configuration as the webhook's pods do: one JSON patch
    under its field manager."""
    hooks = kube.get(kind, name)["webhooks"]
    value = base64.b64encode(bundle).decode()
    kube.request(
        "PATCH",
        kube.path(kind, None, name),
        [
            {"op": "replace", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": value}
            for i in range(len(hooks))
        ],
        content_type="application/json-patch+json",
        query={"fieldManager": FIELD_MANAGER},
    )


def rendered_bundles(objects: list[dict[str, Any]]) -> dict[str, str | None]:
    """Each rendered webhook's caBundle, None where the chart leaves it out."""
    return {
        hook["name"]: hook["clientConfig"].get("caBundle")
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
        for hook in h.find(objects, kind)["webhooks"]
    }


@pytest.mark.anyio
async def test_moving_to_self_keeps_the_bundle_helm_set_until_the_webhook_writes_its_own(
    helm: Path, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    """Under tls.source=self the chart leaves caBundle to the webhook. On the upgrade that
    moves there from a bundle Helm set (helm, or secret with tls.caBundle), leaving it out
    would make Helm take it out, and the API server would trust no webhook pod until the
    new one wrote its CA: so the chart renders what Helm set, as it is. A configuration
    whose bundle the webhook writes (its own field manager) is left to it, and so is
    each configuration on its own. The configurations go through what a release does:
    installed with `self`, moved to `helm` (the forced apply docs/install.md names), then
    rendered for the move back."""
    chart_ca, own_ca = generate_ca().cert_pem, generate_ca().cert_pem

    def self_render() -> dict[str, str | None]:
        return rendered_bundles(render_with_lookup(helm, cluster, namespace, "self"))

    def managers() -> set[frozenset[str]]:
        return {
            frozenset(field_managers(kube.get(kind, name), "caBundle"))
            for kind, name in WEBHOOK_CONFIGURATIONS
        }

    akube = await CommonKube.connect(str(cluster.layout.admin_kubeconfig))
    with configurations_removed_after(kube):
        try:
            # Nothing live: the chart leaves caBundle out.
            assert set(self_render().values()) == {None}

            # Installed with `self`: the chart's configurations without a bundle, which
            # the webhook applies.
            for config in release_configurations(b"", namespace):
                for hook in config["webhooks"]:
                    del hook["clientConfig"]["caBundle"]
                kube.apply(config, manager="helm")
            for config in release_configurations(own_ca, namespace):
                await registration.apply(akube, config)
            assert managers() == {frozenset({FIELD_MANAGER})}
            assert set(self_render().values()) == {None}

            # Moved to `helm`: the chart's bundle applied over the webhook's. The
            # webhook's field manager still has an entry there (the webhooks' names),
            # but no bundle.
            helm_set = base64.b64encode(chart_ca).decode()
            for config in release_configurations(chart_ca, namespace):
                kube.apply(config, manager="helm")
            assert managers() == {frozenset({"helm"})}
            bundles = self_render()
            assert bundles == dict.fromkeys(bundles, helm_set) and len(bundles) == 3

            # Once the webhook has written the pod conversion's bundle (its own CA
            # added), that configuration's is its own; the claim validation's is still
            # Helm's.
            write_as_webhook(
                kube, "MutatingWebhookConfiguration", registration.NAME, chart_ca + own_ca
            )
            mutating = kube.get("MutatingWebhookConfiguration", registration.NAME)
            assert field_managers(mutating, "caBundle") == {FIELD_MANAGER}
            bundles = self_render()
            assert bundles.pop("pods.gpudra.nvidia.com") is None
            assert bundles == dict.fromkeys(bundles, helm_set)

            # Other sources render their own bundle whoever owns the live one.
            rendered = rendered_bundles(render_with_lookup(helm, cluster, namespace, "helm"))
            assert helm_set not in rendered.values()
        finally:
            await akube.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "helm_pin",
    [
        pytest.param("HELM_VERSION", id="helm4"),
        # Built on first use (minutes on a fresh machine): `make test-upgrade`.
        pytest.param("HELM3_VERSION", id="helm3", marks=pytest.mark.upgrade),
    ],
)
async def test_a_release_moved_between_tls_sources_keeps_its_pods_trusted(
    helm_pin: str, cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path
) -> None:
    """A release installed with `self`, moved to `helm` (the high-availability line of
    docs/install.md), back to `self`, then upgraded again, with the real Helm 4 (applies
    server-side) and Helm 3 (merges client-side against the release before). After each
    step the configurations trust every pod that may still serve: the move back keeps
    the chart's CA until the new pod has added its own, and no later upgrade takes
    either out. The webhook's writes are made as its pods make them: its apply of its
    bundle, then a JSON patch under its field manager."""
    try:
        helm = h.helm_binary(helm_pin)
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")

    def upgrade(source: str, *flags: str, timeout: int = 10) -> None:
        webhook = {
            "tls": {"source": source},
            "replicas": 2 if source == "helm" else 1,
            "timeoutSeconds": timeout,
        }
        h.run(
            helm,
            "upgrade",
            "--install",
            "gpudra",
            str(h.CHART),
            "--namespace",
            namespace,
            *h.values_args([ADOPTS_NOTHING, {"webhook": webhook}], tmp_path),
            *flags,
            env=helm_env(cluster),
        )

    def fingerprints(pem: bytes) -> tuple[str, ...]:
        """The SHA-256 (hex) of each certificate in `pem`, sorted."""
        return tuple(
            sorted(
                c.fingerprint(hashes.SHA256()).hex() for c in x509.load_pem_x509_certificates(pem)
            )
        )

    def bundles() -> set[tuple[str, ...] | None]:
        """Each webhook's trusted CAs (`fingerprints`), None where it has none."""
        return {
            fingerprints(base64.b64decode(hook["clientConfig"]["caBundle"]))
            if hook["clientConfig"].get("caBundle")
            else None
            for kind, name in WEBHOOK_CONFIGURATIONS
            for hook in kube.get(kind, name)["webhooks"]
        }

    first_pod, next_pod = generate_ca().cert_pem, generate_ca().cert_pem
    akube = await CommonKube.connect(str(cluster.layout.admin_kubeconfig))
    with configurations_removed_after(kube):
        try:
            upgrade("self")
            assert bundles() == {None}
            # The first pod applies its bundle (the chart manages the configurations).
            for config in release_configurations(first_pod, namespace):
                await registration.apply(akube, config)
            assert bundles() == {fingerprints(first_pod)}

            # To the chart's CA: Helm 4 must be told to take the webhook's field.
            upgrade("helm", *(["--force-conflicts"] if helm_pin == "HELM_VERSION" else []))
            secret = kube.get("Secret", TLS_SECRET, namespace)
            chart_ca = base64.b64decode(secret["data"]["ca.crt"])
            assert bundles() == {fingerprints(chart_ca)}

            # Back to `self`: the chart's CA stays until the new pod has written its own.
            upgrade("self")
            assert bundles() == {fingerprints(chart_ca)}
            both = chart_ca + next_pod
            for kind, name in WEBHOOK_CONFIGURATIONS:
                write_as_webhook(kube, kind, name, both)
            assert bundles() == {fingerprints(both)}

            # A later upgrade leaves the webhook's bundle as it is.
            upgrade("self", timeout=11)
            assert bundles() == {fingerprints(both)}
        finally:
            await akube.close()
            with contextlib.suppress(h.HelmFailed):
                h.run(helm, "uninstall", "gpudra", "--namespace", namespace, env=helm_env(cluster))
