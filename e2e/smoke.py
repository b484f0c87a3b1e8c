"""The smoke scenario: the real controller-manager and scheduler allocate a claim.

A DeviceClass, a ResourceSlice for one fake node, a ResourceClaimTemplate and a pod
that uses it. The controller-manager creates the claim owned by the pod, the
scheduler allocates a device and binds the pod, and deleting the pod deletes the
claim. Shared by the demo and the end-to-end test.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from e2e.cluster.kube import Kube, wait_for

DRIVER = "smoke.gpudra.dev"


@dataclass
class SmokeResult:
    namespace: str
    pod: str
    node: str
    claim: str
    claim_owner: str
    device: str
    pool: str


def setup_inventory(kube: Kube, node: str) -> None:
    kube.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
    )
    kube.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": "gpu-0",
                        "attributes": {
                            "type": {"string": "gpu"},
                            "productName": {"string": "Smoke GPU"},
                        },
                    }
                ],
            },
        }
    )


def make_namespace(kube: Kube, prefix: str) -> str:
    name = f"{prefix}-{secrets.token_hex(3)}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(f"service account in {name}", lambda: _has_default_sa(kube, name), timeout=60)
    return name


def _has_default_sa(kube: Kube, ns: str) -> bool:
    items = kube.request("GET", f"/api/v1/namespaces/{ns}/serviceaccounts")["items"]
    return any(sa["metadata"]["name"] == "default" for sa in items)


def pod_with_template(ns: str, name: str, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def worker_node(kube: Kube) -> str:
    """A node that is not a control plane: the local harness's `worker-1` (a Node with
    no kubelet, so nothing tries to start the pod) where it exists, else the first, as
    kind's `gpudra-e2e-worker`; so the scenario runs on either provider."""
    control = "node-role.kubernetes.io/control-plane"
    names = sorted(
        n["metadata"]["name"]
        for n in kube.list("Node")
        if control not in n["metadata"].get("labels", {})
    )
    if not names:
        raise RuntimeError("the cluster has no worker node for the smoke pod")
    return "worker-1" if "worker-1" in names else names[0]


def run(kube: Kube, node: str, log: Any = None) -> SmokeResult:
    say = log or (lambda _m: None)
    setup_inventory(kube, node)
    ns = make_namespace(kube, "smoke")
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu", "namespace": ns},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]
                    }
                }
            },
        }
    )
    kube.create(pod_with_template(ns, "smoke", "one-gpu"))
    say(f"created pod {ns}/smoke using ResourceClaimTemplate one-gpu")

    def bound() -> Any:
        pod = kube.get("Pod", "smoke", ns)
        statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
        if pod["spec"].get("nodeName") and statuses and statuses[0].get("resourceClaimName"):
            return pod
        return None

    pod = wait_for("the scheduler to bind the smoke pod", bound, timeout=60)
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = kube.get("ResourceClaim", claim_name, ns)
    result = claim["status"]["allocation"]["devices"]["results"][0]
    owner = claim["metadata"]["ownerReferences"][0]
    return SmokeResult(
        ns,
        "smoke",
        pod["spec"]["nodeName"],
        claim_name,
        f"{owner['kind']}/{owner['name']}",
        result["device"],
        result["pool"],
    )


def teardown(kube: Kube, res: SmokeResult) -> None:
    """Deletes the pod and waits until the controller-manager deleted its claim; then
    the scenario's slice and class, which on kind sit on a real worker beside its GPUs."""
    kube.delete("Pod", res.pod, res.namespace)
    wait_for(
        "the generated claim to be deleted with its pod",
        lambda: kube.get_or_none("ResourceClaim", res.claim, res.namespace) is None,
        timeout=60,
    )
    kube.delete("Namespace", res.namespace)
    kube.delete("ResourceSlice", f"{res.node}-{DRIVER}")
    kube.delete("DeviceClass", DRIVER)
