"""The webhook configurations: pod conversion (mutating) and claim checks (validating).

`matchConditions` send only pods that ask for `nvidia.com/*` resources or refer to
ResourceClaims (every device a pod gets counts against its tenant's limit), and only claims
and templates that request one of the driver's DeviceClasses or carry an opaque config
for its driver, so `failurePolicy: Fail` can never block anything else; kube-system and
the driver's own namespace are excluded so a broken webhook cannot block its own recovery.

During a migration pod conversion can be limited to the namespaces a label selector
picks: pods elsewhere keep their `nvidia.com/*` requests and go to the nodes the device
plugin still serves, so no pod is converted before its namespace is ready for DRA. With
tenant rules the webhook evaluates the selector itself (it watches Namespaces for the
rules) and is sent every namespace's GPU pods, because the rules that count a pod's
devices together must hold where pods are not converted too; without tenant rules the
selector narrows the registration (`conversion_namespaces`), and pods elsewhere never
reach the webhook.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from gpudra.api.tenants import excluded_namespace_list
from gpudra.common.kube import ApiError, Kube
from gpudra.webhook.admission import MUTATE_PATH, VALIDATE_CLAIMS_PATH
from gpudra.webhook.cabundle import FIELD_MANAGER
from gpudra.webhook.convert import OPT_OUT_LABEL

NAME = "gpudra-pod-conversion"
PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
VALIDATING_NAME = "gpudra-claim-validation"
VALIDATING_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
_DEVICE_CLASS_RESOURCE = "k.startsWith('deviceclass.resource.kubernetes.io/')"
_ASKS_FOR_A_CLASS = (
    f"has(c.resources) && ((has(c.resources.limits) && "
    f"c.resources.limits.exists(k, {_DEVICE_CLASS_RESOURCE})) || "
    f"(has(c.resources.requests) && c.resources.requests.exists(k, {_DEVICE_CLASS_RESOURCE})))"
)
GPU_POD_CEL = (
    "object.spec.containers.exists(c, has(c.resources) && ("
    "(has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('nvidia.com/'))) || "
    "(has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('nvidia.com/')))"
    ")) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, "
    "has(c.resources) && has(c.resources.limits) && "
    "c.resources.limits.exists(k, k.startsWith('nvidia.com/')))) || "
    "has(object.spec.resourceClaims) || "
    f"object.spec.containers.exists(c, {_ASKS_FOR_A_CLASS}) || "
    "(has(object.spec.initContainers) && "
    f"object.spec.initContainers.exists(c, {_ASKS_FOR_A_CLASS}))"
)
"""Pods the conversion webhook is sent: any that names an ``nvidia.com/`` resource, refers
to a claim, or asks for a DeviceClass as an extended resource, in limits or in requests
alone (`extended_resources`: the tenant rules count the claim the scheduler will make for
it; the API server takes such a name as one of its own, which may be requested without
a limit)."""


OPT_OUT_CEL = f"object.metadata.?labels[?'{OPT_OUT_LABEL}'].orValue('') == 'false'"


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
    """The namespaces the webhook never reviews (`excluded_namespace_list`), left out of
    its registration, so the API server sends it no review for them."""
    return {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": list(excluded_namespace_list(own_namespace)),
            }
        ]
    }


def conversion_namespaces(
    own_namespace: str, selector: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The pod webhook's namespaceSelector: never the system namespaces, and only those
    `selector` (a LabelSelector; None or empty: all) picks. Its terms are added to the
    exclusion, which the API server ANDs, so a selector can narrow but never widen it."""
    out = _not_system(own_namespace)
    if selector:
        if selector.get("matchLabels"):
            out["matchLabels"] = dict(selector["matchLabels"])
        out["matchExpressions"] += [dict(e) for e in selector.get("matchExpressions") or ()]
    return out


def gpu_pod_cel(native_resources: Iterable[str] = ()) -> str:
    """GPU_POD_CEL, with the resources a DeviceClass maps itself (the chart's rule too).

    Those are not converted, but the tenant rules still count them, so pods that ask
    for them are sent too, by a clause of their own (`native_pod_cel`).
    """
    names = sorted(native_resources)
    cel = GPU_POD_CEL
    for name in names:
        cel = cel.replace(
            "k.startsWith('nvidia.com/')", f"(k.startsWith('nvidia.com/') && k != '{name}')"
        )
    return f"{cel} || {native_pod_cel(names)}" if names else cel


def native_pod_cel(native_resources: Sequence[str]) -> str:
    """CEL: a container or init container has a limit on one of `native_resources`."""
    names = _cel_string_list(native_resources)
    has_limit = (
        f"has(c.resources) && has(c.resources.limits) && c.resources.limits.exists(k, k in {names})"
    )
    return (
        f"object.spec.containers.exists(c, {has_limit}) || "
        f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {has_limit}))"
    )


OPT_OUT_POLICY_NAME = "gpudra-opt-out-namespaces"
OPT_OUT_POLICY_PATH = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
OPT_OUT_BINDING_PATH = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"


def opt_out_policy(namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its binding: the opt-out label only where allowed.

    Anyone who may create pods can set a label, so without this the opt-out would let
    any pod skip the webhook and with it every tenant rule. The cluster admin names the
    namespaces where it may be used (the chart's ``webhook.optOutNamespaces``, the same
    policy); everywhere else a pod carrying it is refused at creation.
    """
    allowed = _cel_string_list(sorted(set(namespaces)))
    message = (
        f'\'the label {OPT_OUT_LABEL}="false" skips the GPU webhook and the GpuTenant '
        "rules, so it is allowed only in namespaces the cluster admin names "
        f"(webhook.optOutNamespaces: {', '.join(sorted(set(namespaces))) or 'none'}); ' + "
        "'namespace ' + request.namespace + ' is not one: remove the label'"
    )
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": OPT_OUT_POLICY_NAME},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "matchConditions": [{"name": "opts-out", "expression": OPT_OUT_CEL}],
            "validations": [
                {
                    "expression": f"request.namespace in {allowed}",
                    "messageExpression": message,
                    "reason": "Forbidden",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": OPT_OUT_POLICY_NAME},
        "spec": {"policyName": OPT_OUT_POLICY_NAME, "validationActions": ["Deny"]},
    }
    return [policy, binding]


CLAIM_LINKS_POLICY_NAME = "gpudra-claim-links"
TEMPLATE_LINKS_POLICY_NAME = "gpudra-claim-template-links"
CLAIM_LINK_ANNOTATIONS: Final = (
    "resource.kubernetes.io/pod-claim-name",
    "resource.kubernetes.io/extended-resource-claim",
)
"""What, with a claim's controlling owner, ties a claim to a pod's claim entry."""
KUBERNETES_ANNOTATIONS: Final = "resource.kubernetes.io/"
DELETE_PROTECTION: Final = "resource.kubernetes.io/delete-protection"
TRUSTED_CEL: Final = (
    "'system:masters' in request.userInfo.groups || request.userInfo.username in "
    "['system:kube-controller-manager', 'system:kube-scheduler'] || "
    "request.userInfo.username.startsWith('system:serviceaccount:kube-system:') || "
    "authorizer.group('admissionregistration.k8s.io').resource('validatingadmissionpolicies')"
    ".check('delete').allowed()"
)
"""Kubernetes' own controllers (with or without service-account credentials), the
scheduler and the cluster admins. An admin is anyone allowed to delete
ValidatingAdmissionPolicies, not only `system:masters`: kubeadm's admin.conf (kind's
too) has been in `kubeadm:cluster-admins` since Kubernetes 1.29, and a policy that
refused it would refuse the cluster's own admin a stuck claim's finalizer. Whoever may
delete the policy gains nothing from being held by it."""


def _owners_cel(obj: str, *, controllers: bool) -> str:
    """`obj`'s owner references (only its controlling one with `controllers`), each as
    one string of everything that identifies it: the scheduler, the kubelet and the
    resource claim controller match owners by UID, name or kind."""
    refs = f"{obj}.metadata.?ownerReferences.orValue([])"
    if controllers:
        refs += ".filter(r, r.?controller.orValue(false))"
    ident = "r.apiVersion + '/' + r.kind + '/' + r.name + '/' + r.uid"
    if not controllers:
        ident += " + '/' + string(r.?controller.orValue(false))"
    return f"{refs}.map(r, {ident})"


def claim_links_policy(trusted_users: Sequence[str] = ()) -> list[dict[str, Any]]:
    """ValidatingAdmissionPolicies and their bindings: only Kubernetes ties a
    ResourceClaim to a pod, and only Kubernetes lets an allocated claim go.

    The scheduler and the kubelet take a claim as a pod's when its controlling owner
    has the pod's UID (any kind) and its name is the one the pod's status gives the
    entry; the resource claim controller adopts a claim the pod controls that carries
    the pod-claim-name annotation; the scheduler takes one with the
    extended-resource-claim annotation and the pod as an owner for the pod's
    extended-resource claim; and a claim's metadata may change after its creation. So
    without this a tenant could make, or turn, a claim of its own into a waiting pod's
    claim, which the webhook judged with no pod (more devices than
    ``maxDevicesPerPod``; or a claim stored before the rules, never judged again).
    Hence, for everyone but Kubernetes and `trusted_users`: no controlling owner set or
    changed; neither annotation set or changed; no owner changed at all on a claim
    Kubernetes made for a pod (an owner without ``controller`` beside the annotation
    crashes the 1.36 scheduler); and no ``resource.kubernetes.io/`` annotation on a
    ResourceClaimTemplate, whose annotations the resource claim controller copies onto
    the claims it makes. The delete-protection finalizer keeps an allocated claim, and
    its devices, from being released while a pod still uses it; a tenant that removed it
    could delete the claim under a running pod and the scheduler would hand the GPU to
    another tenant while the first one's container still has it.
    """
    trusted = TRUSTED_CEL
    if trusted_users:
        names = _cel_string_list(sorted(set(trusted_users)))
        trusted += f" || request.userInfo.username in {names}"
    links = _cel_string_list(CLAIM_LINK_ANNOTATIONS)
    update = "request.operation == 'UPDATE'"
    none = _cel_string_list([""] * len(CLAIM_LINK_ANNOTATIONS))

    def annotations(obj: str) -> str:
        return f"{links}.map(k, {obj}.metadata.?annotations[?k].orValue(''))"

    def policy(name: str, resource: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        rules = [
            {
                "apiGroups": ["resource.k8s.io"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": [resource],
            }
        ]
        return [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": name},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {"resourceRules": rules},
                    "matchConditions": [{"name": "not-kubernetes", "expression": f"!({trusted})"}],
                    **spec,
                },
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": name},
                "spec": {"policyName": name, "validationActions": ["Deny"]},
            },
        ]

    claims = {
        "variables": [
            {"name": "owners", "expression": _owners_cel("object", controllers=True)},
            {
                "name": "oldOwners",
                "expression": f"{update} ? {_owners_cel('oldObject', controllers=True)} : []",
            },
            {"name": "links", "expression": annotations("object")},
            {"name": "oldLinks", "expression": f"{update} ? {annotations('oldObject')} : {none}"},
            {
                "name": "madeForPod",
                "expression": "size(variables.oldOwners) > 0 || "
                "variables.oldLinks.exists(l, l != '')",
            },
        ],
        "validations": [
            {
                "expression": "variables.owners == variables.oldOwners",
                "message": (
                    "only Kubernetes' controllers set a ResourceClaim's controlling owner "
                    "(metadata.ownerReferences with controller: true): it makes the claim "
                    "a pod's; leave it out, or ask the cluster admin to trust your "
                    "controller (gpudra's claimLinks.trustedUsers)"
                ),
                "reason": "Forbidden",
            },
            {
                "expression": "variables.links == variables.oldLinks",
                "message": (
                    "only Kubernetes sets the annotations "
                    + " and ".join(CLAIM_LINK_ANNOTATIONS)
                    + " on a ResourceClaim: they make the claim a pod's; leave them out"
                ),
                "reason": "Forbidden",
            },
            {
                "expression": (
                    f"!variables.madeForPod || {_owners_cel('object', controllers=False)} == "
                    f"{_owners_cel('oldObject', controllers=False)}"
                ),
                "message": (
                    "only Kubernetes changes the owners of a ResourceClaim it made for a "
                    "pod (one with a controlling owner or a pod-claim-name or "
                    "extended-resource-claim annotation); leave metadata.ownerReferences "
                    "as they are"
                ),
                "reason": "Forbidden",
            },
            {
                "expression": (
                    f"!({update}) || !('{DELETE_PROTECTION}' in "
                    "oldObject.metadata.?finalizers.orValue([])) || "
                    f"'{DELETE_PROTECTION}' in object.metadata.?finalizers.orValue([])"
                ),
                "message": (
                    f"only Kubernetes removes the finalizer {DELETE_PROTECTION}: it "
                    "keeps the claim's devices while a pod uses them; delete the claim "
                    "and its pods, and Kubernetes releases it"
                ),
                "reason": "Forbidden",
            },
        ],
    }
    templates = {
        "validations": [
            {
                "expression": (
                    "!object.spec.?metadata.?annotations.orValue({}).exists(k, "
                    f"k.startsWith('{KUBERNETES_ANNOTATIONS}'))"
                ),
                "message": (
                    f"annotations under {KUBERNETES_ANNOTATIONS} are Kubernetes' own: the "
                    "resource claim controller copies a template's spec.metadata.annotations "
                    "onto the claims it makes for pods, where they would tie a claim to a "
                    "pod; leave them out"
                ),
                "reason": "Forbidden",
            }
        ],
    }
    return [
        *policy(CLAIM_LINKS_POLICY_NAME, "resourceclaims", claims),
        *policy(TEMPLATE_LINKS_POLICY_NAME, "resourceclaimtemplates", templates),
    ]


# The label Helm sets on everything a chart renders.
HELM_MANAGED_BY: Final = ("app.kubernetes.io/managed-by", "Helm")


def mutating_configuration(
    *,
    ca_bundle_b64: str,
    own_namespace: str,
    url: str | None = None,
    service: tuple[str, str, int] | None = None,
    timeout_s: int = 10,
    native_resources: Iterable[str] = (),
    namespace_selector: Mapping[str, Any] | None = None,
    selector_in_webhook: bool = False,
) -> dict[str, Any]:
    """`url` for loopback tests, `service` (name, namespace, port) in a cluster.

    Pods whose only nvidia.com requests are `native_resources` never reach the webhook,
    nor, unless `selector_in_webhook` (the webhook runs the tenant rules and evaluates
    the selector itself), do pods outside the namespaces `namespace_selector` picks
    (`conversion_namespaces`).
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
                "namespaceSelector": conversion_namespaces(
                    own_namespace, None if selector_in_webhook else namespace_selector
                ),
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
    """Server-side apply (a webhook configuration, so the caBundle is kept current, or the
    opt-out policy and its binding).

    Where Helm manages a webhook configuration (the chart renders it, for
    tls.source=self leaving the caBundle out unless it keeps one Helm set before), only
    the caBundle is applied. Applying all of it with force would take the chart's fields
    too, and the next `helm upgrade` that changes one of them (a new match condition,
    say) would fail with a conflict with this field manager. Without Helm (`gpudra
    webhook` run on its own) the webhook owns the whole configuration and re-applies it,
    undoing drift."""
    base = {
        "ValidatingWebhookConfiguration": VALIDATING_PATH,
        "ValidatingAdmissionPolicy": OPT_OUT_POLICY_PATH,
        "ValidatingAdmissionPolicyBinding": OPT_OUT_BINDING_PATH,
    }.get(config["kind"], PATH)
    path = f"{base}/{config['metadata']['name']}"
    if "webhooks" in config and await _helm_manages(kube, path):
        config = _ca_bundles_only(config)
    await kube.request(
        "PATCH",
        path,
        config,
        query={"fieldManager": FIELD_MANAGER, "force": "true"},
        content_type="application/apply-patch+yaml",
    )


async def _helm_manages(kube: Kube, path: str) -> bool:
    try:
        current = await kube.request("GET", path)
    except ApiError as e:
        if e.status == 404:
            return False
        raise
    labels = (current.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(HELM_MANAGED_BY[0]) == HELM_MANAGED_BY[1])


def _ca_bundles_only(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` cut down to what identifies it and each webhook's caBundle."""
    return {
        "apiVersion": config["apiVersion"],
        "kind": config["kind"],
        "metadata": {"name": config["metadata"]["name"]},
        "webhooks": [
            {"name": w["name"], "clientConfig": {"caBundle": w["clientConfig"]["caBundle"]}}
            for w in config["webhooks"]
        ],
    }


async def delete(kube: Kube, name: str = NAME, *, validating: bool = False) -> None:
    try:
        await kube.request("DELETE", f"{VALIDATING_PATH if validating else PATH}/{name}")
    except ApiError as e:
        if e.status != 404:
            raise
