"""The webhook configurations: pod conversion (mutating) and claim checks (validating).

`matchConditions` send only pods that ask for `nvidia.com/*` resources or refer to
ResourceClaims (every device a pod gets counts against its tenant's limit), and only claims
and templates that request one of the driver's DeviceClasses or carry an opaque config
for its driver, so `failurePolicy: Fail` can never block anything else; kube-system and
the driver's own namespace are excluded so a broken webhook cannot block its own recovery.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gpudra.common.kube import ApiError, Kube
from gpudra.webhook.admission import MUTATE_PATH, VALIDATE_CLAIMS_PATH
from gpudra.webhook.convert import OPT_OUT_LABEL

NAME = "gpudra-pod-conversion"
PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
VALIDATING_NAME = "gpudra-claim-validation"
VALIDATING_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
GPU_POD_CEL = (
    "object.spec.containers.exists(c, has(c.resources) && ("
    "(has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('nvidia.com/'))) || "
    "(has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('nvidia.com/')))"
    ")) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, "
    "has(c.resources) && has(c.resources.limits) && "
    "c.resources.limits.exists(k, k.startsWith('nvidia.com/')))) || "
    "has(object.spec.resourceClaims)"
)


def _client(
    ca_bundle_b64: str, url: str | None, service: tuple[str, str, int] | None, path: str
) -> dict[str, Any]:
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    client: dict[str, Any] = {"caBundle": ca_bundle_b64}
    if url is not None:
        client["url"] = url.rstrip("/") + path
    else:
        assert service is not None
        client["service"] = {
            "name": service[0],
            "namespace": service[1],
            "port": service[2],
            "path": path,
        }
    return client


def _cel_string_list(values: Sequence[str]) -> str:
    return (
        "["
        + ", ".join("'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" for v in values)
        + "]"
    )


def claim_cel(devices: str, device_classes: Sequence[str], driver: str) -> str:
    """CEL: the object's `devices` (a CEL path) request one of `device_classes` or carry
    an opaque config for `driver`."""
    classes = _cel_string_list(sorted(set(device_classes)))
    drivers = _cel_string_list([driver])
    return (
        f"has({devices}) && ("
        f"(has({devices}.requests) && {devices}.requests.exists(r, "
        f"(has(r.exactly) && r.exactly.deviceClassName in {classes}) || "
        f"(has(r.firstAvailable) && r.firstAvailable.exists(s, s.deviceClassName in {classes}))"
        f")) || "
        f"(has({devices}.config) && {devices}.config.exists(c, "
        f"has(c.opaque) && c.opaque.driver in {drivers})))"
    )


def validating_configuration(
    *,
    ca_bundle_b64: str,
    own_namespace: str,
    device_classes: Sequence[str],
    driver: str,
    url: str | None = None,
    service: tuple[str, str, int] | None = None,
    timeout_s: int = 10,
) -> dict[str, Any]:
    """Checks hand-written ResourceClaims and ResourceClaimTemplates at creation (their
    specs are immutable, so CREATE is enough and updates of metadata never depend on the
    webhook). `url` for loopback tests, `service` (name, namespace, port) in a cluster."""
    client = _client(ca_bundle_b64, url, service, VALIDATE_CLAIMS_PATH)

    def webhook(resource: str, devices: str) -> dict[str, Any]:
        return {
            "name": f"{resource}.gpudra.nvidia.com",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "matchPolicy": "Equivalent",
            "timeoutSeconds": timeout_s,
            "clientConfig": dict(client),
            "rules": [
                {
                    "apiGroups": ["resource.k8s.io"],
                    "apiVersions": ["v1"],
                    "operations": ["CREATE"],
                    "resources": [resource],
                    "scope": "Namespaced",
                }
            ],
            "namespaceSelector": _not_system(own_namespace),
            "matchConditions": [
                {
                    "name": "uses-driver-classes-or-configs",
                    "expression": claim_cel(devices, device_classes, driver),
                }
            ],
        }

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": VALIDATING_NAME},
        "webhooks": [
            webhook("resourceclaims", "object.spec.devices"),
            webhook("resourceclaimtemplates", "object.spec.spec.devices"),
        ],
    }


def _not_system(own_namespace: str) -> dict[str, Any]:
    return {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", own_namespace],
            }
        ]
    }


def gpu_pod_cel(native_resources: Iterable[str] = ()) -> str:
    """GPU_POD_CEL, minus the resources a DeviceClass maps itself (the chart's rule too)."""
    cel = GPU_POD_CEL
    for name in sorted(native_resources):
        cel = cel.replace(
            "k.startsWith('nvidia.com/')", f"(k.startsWith('nvidia.com/') && k != '{name}')"
        )
    return cel


def mutating_configuration(
    *,
    ca_bundle_b64: str,
    own_namespace: str,
    url: str | None = None,
    service: tuple[str, str, int] | None = None,
    timeout_s: int = 10,
    native_resources: Iterable[str] = (),
) -> dict[str, Any]:
    """`url` for loopback tests, `service` (name, namespace, port) in a cluster.

    Pods whose only nvidia.com requests are `native_resources` never reach the webhook.
    """
    client = _client(ca_bundle_b64, url, service, MUTATE_PATH)
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
                "namespaceSelector": _not_system(own_namespace),
                "objectSelector": {
                    "matchExpressions": [
                        {"key": OPT_OUT_LABEL, "operator": "NotIn", "values": ["false"]}
                    ]
                },
                "matchConditions": [
                    {
                        "name": "requests-nvidia-resources",
                        "expression": gpu_pod_cel(native_resources),
                    }
                ],
            }
        ],
    }


async def apply(kube: Kube, config: dict[str, Any]) -> None:
    """Server-side apply (mutating or validating), so the caBundle is kept current."""
    base = VALIDATING_PATH if config["kind"] == "ValidatingWebhookConfiguration" else PATH
    await kube.request(
        "PATCH",
        f"{base}/{config['metadata']['name']}",
        config,
        query={"fieldManager": "gpudra-webhook", "force": "true"},
        content_type="application/apply-patch+yaml",
    )


async def delete(kube: Kube, name: str = NAME, *, validating: bool = False) -> None:
    try:
        await kube.request("DELETE", f"{VALIDATING_PATH if validating else PATH}/{name}")
    except ApiError as e:
        if e.status != 404:
            raise
