"""The MutatingWebhookConfiguration for pod conversion.

`matchConditions` send only pods that ask for `nvidia.com/*` resources, so
`failurePolicy: Fail` can never block other pods; kube-system and the driver's own
namespace are excluded so a broken webhook cannot block its own recovery.
"""

from __future__ import annotations

from typing import Any

from gpudra.common.kube import ApiError, Kube
from gpudra.webhook.convert import OPT_OUT_LABEL

NAME = "gpudra-pod-conversion"
PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
GPU_POD_CEL = (
    "object.spec.containers.exists(c, has(c.resources) && ("
    "(has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('nvidia.com/'))) || "
    "(has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('nvidia.com/')))"
    ")) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, "
    "has(c.resources) && has(c.resources.limits) && "
    "c.resources.limits.exists(k, k.startsWith('nvidia.com/'))))"
)


def mutating_configuration(
    *,
    ca_bundle_b64: str,
    own_namespace: str,
    url: str | None = None,
    service: tuple[str, str, int] | None = None,
    timeout_s: int = 10,
) -> dict[str, Any]:
    """`url` for loopback tests, `service` (name, namespace, port) in a cluster."""
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    client: dict[str, Any] = {"caBundle": ca_bundle_b64}
    if url is not None:
        client["url"] = url.rstrip("/") + "/mutate-pods"
    else:
        assert service is not None
        client["service"] = {
            "name": service[0],
            "namespace": service[1],
            "port": service[2],
            "path": "/mutate-pods",
        }
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": NAME},
        "webhooks": [
            {
                "name": "pods.gpudra.nvidia.com",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "NoneOnDryRun",
                "failurePolicy": "Fail",
                "reinvocationPolicy": "IfNeeded",
                "timeoutSeconds": timeout_s,
                "clientConfig": client,
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                        "scope": "Namespaced",
                    }
                ],
                "namespaceSelector": {
                    "matchExpressions": [
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "NotIn",
                            "values": ["kube-system", own_namespace],
                        }
                    ]
                },
                "objectSelector": {
                    "matchExpressions": [
                        {"key": OPT_OUT_LABEL, "operator": "NotIn", "values": ["false"]}
                    ]
                },
                "matchConditions": [
                    {"name": "requests-nvidia-resources", "expression": GPU_POD_CEL}
                ],
            }
        ],
    }


async def apply(kube: Kube, config: dict[str, Any]) -> None:
    """Server-side apply, so the caBundle is kept current on every call."""
    await kube.request(
        "PATCH",
        f"{PATH}/{config['metadata']['name']}",
        config,
        query={"fieldManager": "gpudra-webhook", "force": "true"},
        content_type="application/apply-patch+yaml",
    )


async def delete(kube: Kube, name: str = NAME) -> None:
    try:
        await kube.request("DELETE", f"{PATH}/{name}")
    except ApiError as e:
        if e.status != 404:
            raise
