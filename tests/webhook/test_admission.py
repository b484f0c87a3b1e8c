"""The admission endpoints called directly: decisions need no HTTP server."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import anyio
import pytest
from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import API_VERSION, LabelSelector
from gpudra.cli.main import build_parser
from gpudra.cli.webhook import conversion_policy, device_class_cache
from gpudra.common.kube import ApiError
from gpudra.webhook.admission import (
    MAX_CLAIM_USERS,
    MAX_CLAIM_USERS_BYTES,
    MUTATE_PATH,
    VALIDATE_CLAIMS_PATH,
    Admission,
)
from gpudra.webhook.convert import DEFAULT_POLICY, OPT_OUT_LABEL, ConversionPolicy, convert_pod
from gpudra.webhook.device_classes import DeviceClassCache
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.reviews import ReviewError
from gpudra.webhook.tenant_rules import QuotaUsage, StoredClaim
from gpudra.webhook.tenant_state import TenantState
from gpudra.webhook.verdicts import ClaimJudge
from prometheus_client import CollectorRegistry

from tests.webhook.quotas import quota

pytestmark = pytest.mark.anyio


class Templates:
    def __init__(self) -> None:
        self.names: list[str] = []

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        self.names += [t["metadata"]["name"] for t in templates]


def review(kind: dict[str, str], obj: Any, **request: Any) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "kind": kind,
                "namespace": "ns",
                "operation": "CREATE",
                "object": obj,
                **request,
            },
        }
    ).encode()


POD = {"group": "", "version": "v1", "kind": "Pod"}
CLAIM = {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"}
GPU_POD = {
    "metadata": {"name": "p"},
    "spec": {
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
    },
}


async def test_each_endpoint_decides_a_review_body() -> None:
    templates = Templates()
    registry = CollectorRegistry()
    endpoints = Admission(templates, WebhookMetrics(registry)).endpoints()
    assert set(endpoints) == {MUTATE_PATH, VALIDATE_CLAIMS_PATH}

    decision = await endpoints[MUTATE_PATH](review(POD, GPU_POD))
    assert decision.result == "patched"
    assert decision.response["patchType"] == "JSONPatch"
    assert templates.names == ["gpudra-gpu-1"]
    assert registry.get_sample_value("gpudra_webhook_conversions_total", {"dry_run": "false"})

    claim = {"metadata": {"name": "c"}, "spec": {"devices": {"requests": []}}}
    decision = await endpoints[VALIDATE_CLAIMS_PATH](review(CLAIM, claim))
    assert (decision.result, decision.response) == ("allowed", {"uid": "u1", "allowed": True})


async def test_an_unusable_review_raises_naming_the_field() -> None:
    endpoints = Admission(Templates(), WebhookMetrics(CollectorRegistry())).endpoints()
    with pytest.raises(ReviewError, match=r"request\.object must be the Pod"):
        await endpoints[MUTATE_PATH](review(POD, "a pod"))
    with pytest.raises(ReviewError, match=r"request\.object is required"):
        await endpoints[VALIDATE_CLAIMS_PATH](review(CLAIM, None))
    with pytest.raises(ReviewError, match="unsupported resource kind"):
        await endpoints[VALIDATE_CLAIMS_PATH](review(POD, GPU_POD))


async def test_a_forged_namespace_reaches_no_url() -> None:
    """A review sent straight to the port names its namespace: one that is no namespace
    name (a path in it) or that differs from the object's own is refused before any read
    or write of the webhook's is made with it."""
    templates, claims = Templates(), Claims(one=one_gpu_spec())
    endpoints = Admission(
        templates, WebhookMetrics(CollectorRegistry()), read_claims=claims
    ).endpoints()
    named = claim_pod(0, {"name": "a", "resourceClaimName": "one"})
    for namespace in ("x/../kube-system", "../../apis", "NS", "ns?watch=1"):
        for path, obj in ((MUTATE_PATH, GPU_POD), (MUTATE_PATH, named)):
            with pytest.raises(ReviewError, match="is not a namespace name"):
                await endpoints[path](review(POD, obj, namespace=namespace))
        with pytest.raises(ReviewError, match="is not a namespace name"):
            await endpoints[VALIDATE_CLAIMS_PATH](
                review(CLAIM, {"metadata": {"name": "c"}}, namespace=namespace)
            )
    other = {**GPU_POD, "metadata": {"name": "p", "namespace": "kube-system"}}
    with pytest.raises(ReviewError, match="differ"):
        await endpoints[MUTATE_PATH](review(POD, other))
    assert templates.names == []
    assert claims.reads == []


TEMPLATE = {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaimTemplate"}


def _generated_templates(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(convert_pod(pod).templates)


async def test_a_template_under_a_generated_name_must_have_the_generated_content() -> None:
    endpoints = Admission(Templates(), WebhookMetrics(CollectorRegistry())).endpoints()
    ours = _generated_templates(GPU_POD)[0]
    assert ours["metadata"]["name"] == "gpudra-gpu-1"
    decision = await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, ours))
    assert decision.result == "allowed"

    forged = json.loads(json.dumps(ours))
    forged["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 4
    decision = await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, forged))
    assert decision.result == "denied"
    assert "reserved for the templates gpudra generates" in decision.response["status"]["message"]

    # A prefixed name no conversion generates is refused too; other names are not ours.
    other = {**ours, "metadata": {"name": "gpudra-mine"}}
    assert (await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, other))).result == "denied"
    other = {**forged, "metadata": {"name": "mine"}}
    assert (await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, other))).result == "allowed"


SHARED_POD = {
    "metadata": {"name": "p"},
    "spec": {
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}],
    },
}


async def test_the_share_only_conversion_writes_templates_its_own_guard_admits() -> None:
    """With `--no-shared-whole-gpu-fallback` the pod refers to the share-only template,
    which the claim webhook (served by the same policy) admits under its generated name
    when the conversion writes it; one share raised to two, or the fallback shape under
    that name, is refused as forged."""
    policy = conversion_policy(
        build_parser().parse_args(["webhook", "--cert-dir=c", "--no-shared-whole-gpu-fallback"])
    )
    templates = Templates()
    endpoints = Admission(templates, WebhookMetrics(CollectorRegistry()), policy=policy).endpoints()
    decision = await endpoints[MUTATE_PATH](review(POD, SHARED_POD))
    assert decision.result == "patched"
    (ours,) = convert_pod(SHARED_POD, policy).templates
    assert templates.names == [ours["metadata"]["name"]] != ["gpudra-gpu-shared-1"]
    (request,) = ours["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["capacity"] == {"requests": {"shares": "1"}}
    assert (await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, ours))).result == "allowed"

    forged = json.loads(json.dumps(ours))
    forged["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"] = {
        "shares": "2"
    }
    decision = await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, forged))
    assert decision.result == "denied"
    assert "reserved for the templates gpudra generates" in decision.response["status"]["message"]
    (fallback,) = convert_pod(SHARED_POD).templates
    renamed = {**fallback, "metadata": ours["metadata"]}
    assert (await endpoints[VALIDATE_CLAIMS_PATH](review(TEMPLATE, renamed))).result == "denied"


def one_gpu_spec(count: int = 1) -> dict[str, Any]:
    exactly = {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": count}
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


class Claims:
    """The objects a pod may refer to, as the API would return their specs."""

    def __init__(self, **specs: dict[str, Any]) -> None:
        self.specs = specs
        self.allocated: set[str] = set()
        self.reads: list[tuple[str, str]] = []
        self.live_pods: list[dict[str, Any]] = []
        self.namespaces: dict[str, dict[str, str]] = {}
        self.made: dict[str, dict[str, list[str]]] = {}
        """Claims made for each pod's template entries: pod UID -> entry -> claim names."""
        self.made_asked: list[set[str]] = []
        """The pod UIDs each read of the claims made for pods was asked for."""
        self.admitted: dict[str, list[str]] = {}
        """Kueue Workloads admitted with each template name."""

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None:
        self.reads.append((kind, name))
        spec = self.specs.get(name)
        return None if spec is None else StoredClaim(spec, name in self.allocated)

    async def pods(
        self, namespace: str, keep: Callable[[Mapping[str, Any]], bool]
    ) -> list[dict[str, Any]]:
        return [p for p in self.live_pods if keep(p)]

    async def claims_made_for(
        self, namespace: str, pod_uids: Collection[str]
    ) -> dict[str, dict[str, list[str]]]:
        self.made_asked.append(set(pod_uids))
        return {uid: self.made[uid] for uid in pod_uids if uid in self.made}

    async def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        return self.namespaces.get(namespace)

    async def workloads_admitted_with(self, namespace: str, template: str) -> list[str]:
        self.reads.append(("Workload", template))
        return self.admitted.get(template, [])


def limited_admission(
    claims: Claims,
    limit: int = 1,
    policy: ConversionPolicy = DEFAULT_POLICY,
    classes: DeviceClassCache | None = None,
    ensure_timeout: float = 5.0,
) -> Admission:
    state = TenantState(base_policy=policy)
    state.replace(
        "tenants",
        [
            {
                "apiVersion": API_VERSION,
                "kind": "GpuTenant",
                "metadata": {"name": "team-a"},
                "spec": {"namespaces": ["ns"], "maxDevicesPerPod": limit},
            }
        ],
    )
    state.replace("namespaces", [{"metadata": {"name": "ns"}, "status": {"phase": "Active"}}])
    state.replace("quotas", [])
    return Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        policy=policy,
        tenants=state,
        read_claims=claims,
        device_classes=classes.configs if classes is not None else None,
        ensure_timeout=ensure_timeout,
    )


def claim_pod(gpus: int, *refs: dict[str, str]) -> dict[str, Any]:
    resources: dict[str, Any] = {"claims": [{"name": r["name"]} for r in refs]}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    return {
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "c", "resources": resources}],
            "resourceClaims": list(refs),
        },
    }


async def test_max_devices_per_pod_counts_every_claim_the_pod_refers_to() -> None:
    claims = Claims(one=one_gpu_spec(), two=one_gpu_spec(), tpl=one_gpu_spec())
    admission = limited_admission(claims)

    # Two hand-written one-GPU claims: each fits alone, the pod does not.
    pod = claim_pod(
        0, {"name": "a", "resourceClaimName": "one"}, {"name": "b", "resourceClaimName": "two"}
    )
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in message
    assert "claim a (ResourceClaim one): 1" in message

    # nvidia.com/gpu: 1 plus one hand-written template.
    pod = claim_pod(1, {"name": "a", "resourceClaimTemplateName": "tpl"})
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    assert "this pod asks for 2 devices" in decision.response["status"]["message"]
    assert ("ResourceClaimTemplate", "tpl") in claims.reads

    # One claim alone is within the limit; a missing one cannot be counted.
    pod = claim_pod(0, {"name": "a", "resourceClaimName": "one"})
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"
    pod = claim_pod(0, {"name": "a", "resourceClaimName": "later"})
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    assert "does not exist" in decision.response["status"]["message"]


def gpu_pod(limits: dict[str, str], labels: dict[str, str] | None = None, **spec: Any) -> Any:
    container = {"name": "c", "resources": {"limits": limits}}
    return {
        "metadata": {"name": "p", "labels": labels or {}},
        "spec": {"containers": [container], **spec},
    }


async def test_tenant_rules_hold_for_pods_the_webhook_does_not_convert() -> None:
    admission = limited_admission(Claims(tpl=one_gpu_spec()))
    two = {"nvidia.com/gpu": "2"}
    # (b) the opt-out label skips the conversion, not the rules.
    opted_out = gpu_pod(two, labels={OPT_OUT_LABEL: "false"})
    decision = await admission.mutate_pod(review(POD, opted_out))
    assert decision.result == "denied"
    assert (
        "maxDevicesPerPod is 1, this pod asks for 2 devices"
        in decision.response["status"]["message"]
    )
    assert (
        await admission.mutate_pod(
            review(POD, gpu_pod({"nvidia.com/gpu": "1"}, labels={OPT_OUT_LABEL: "false"}))
        )
    ).result == "allowed"

    # (c) a claim that merely looks like the conversion's does not make the pod "converted";
    # one exactly as the conversion writes it does, and its template is counted.
    looks_ours = gpu_pod(two, resourceClaims=[{"name": "gpudra-mine", "resourceClaimName": "x"}])
    assert convert_pod(looks_ours).changed
    exact = gpu_pod(
        {"nvidia.com/gpu": "1"},
        resourceClaims=[{"name": "gpudra-gpu", "resourceClaimTemplateName": "tpl"}],
    )
    assert convert_pod(exact).skipped != "already converted"  # "tpl" is no generated name
    exact["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = "gpudra-gpu-1"
    assert convert_pod(exact).skipped == "already converted"
    admission = limited_admission(Claims(**{"gpudra-gpu-1": one_gpu_spec()}))
    decision = await admission.mutate_pod(review(POD, exact))
    assert decision.result == "denied"
    assert "this pod asks for 2 devices" in decision.response["status"]["message"]


async def test_a_namespace_the_conversion_selector_leaves_out_keeps_the_rules() -> None:
    """With a migration's conversion selector, pods of a namespace it leaves out are not
    converted (and a review for one writes no template), but the tenant rules still count
    every device they ask for; a namespace whose labels are not known yet is refused
    with a retry, never converted or passed unchecked by guess."""
    claims = Claims(one=one_gpu_spec(), two=one_gpu_spec())
    templates = Templates()
    admission = limited_admission(claims)
    state = admission._tenants
    assert state is not None
    selector = LabelSelector.model_validate({"matchLabels": {"gpudra.nvidia.com/dra": "true"}})
    admission = Admission(
        templates,
        WebhookMetrics(CollectorRegistry()),
        tenants=state,
        read_claims=claims,
        conversion_selector=selector,
    )

    # "ns" lacks the label: nvidia.com/gpu stays, no template is written...
    one = gpu_pod({"nvidia.com/gpu": "1"})
    decision = await admission.mutate_pod(review(POD, one))
    assert decision.result == "allowed"
    assert "patch" not in decision.response
    assert templates.names == []
    # ...and the rules count it, with hand-written claims and legacy GPUs alike.
    two_claims = claim_pod(
        0, {"name": "a", "resourceClaimName": "one"}, {"name": "b", "resourceClaimName": "two"}
    )
    for pod in (two_claims, gpu_pod({"nvidia.com/gpu": "2"})):
        decision = await admission.mutate_pod(review(POD, pod))
        assert decision.result == "denied"
        assert (
            "maxDevicesPerPod is 1, this pod asks for 2 devices"
            in (decision.response["status"]["message"])
        )

    # Labelled: converted as without a selector.
    labelled = {"name": "ns", "labels": {"gpudra.nvidia.com/dra": "true"}}
    state.event("namespaces", "MODIFIED", {"metadata": labelled, "status": {"phase": "Active"}})
    decision = await admission.mutate_pod(review(POD, one))
    assert decision.result == "patched"
    assert templates.names == ["gpudra-gpu-1"]

    # A namespace not watched yet is read from the API server: labelled, it converts...
    claims.namespaces["brand-new"] = {"gpudra.nvidia.com/dra": "true"}
    decision = await admission.mutate_pod(review(POD, one, namespace="brand-new"))
    assert decision.result == "patched"
    # ...and where it cannot be read, a pod to convert is refused with a retry.
    decision = await admission.mutate_pod(review(POD, one, namespace="unknown"))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "could not read the labels of namespace unknown (it was not found)" in message
    assert "webhook.conversion.namespaceSelector" in message
    assert templates.names == ["gpudra-gpu-1", "gpudra-gpu-1"]


@pytest.mark.parametrize(
    "limits",
    [
        {"nvidia.com/mig-1g.5gb": "40"},  # more than one claim holds (56 on 8 A100s)
        {"nvidia.com/mig-1g.5gb.shared": "1"},  # time-sliced MIG: left to the plugin
    ],
)
async def test_a_pod_gpudra_cannot_convert_is_left_alone_where_conversion_is_off(
    limits: dict[str, str],
) -> None:
    """A device-plugin pod of a namespace the migration leaves out keeps its requests and
    goes to the device plugin, whether or not gpudra could convert it; moved, it is
    refused naming why."""
    state = TenantState()
    state.replace("tenants", [])
    state.replace("namespaces", [{"metadata": {"name": "ns"}, "status": {"phase": "Active"}}])
    state.replace("quotas", [])
    selector = LabelSelector.model_validate({"matchLabels": {"gpudra.nvidia.com/dra": "true"}})
    templates = Templates()
    admission = Admission(
        templates, WebhookMetrics(CollectorRegistry()), tenants=state, conversion_selector=selector
    )
    pod = gpu_pod(limits)
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "allowed"
    assert "patch" not in decision.response
    labelled = {"name": "ns", "labels": {"gpudra.nvidia.com/dra": "true"}}
    state.event("namespaces", "MODIFIED", {"metadata": labelled, "status": {"phase": "Active"}})
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    assert "nvidia.com/mig-1g.5gb" in decision.response["status"]["message"]
    assert templates.names == []


UNMOVED = LabelSelector.model_validate({"matchLabels": {"gpudra.nvidia.com/dra": "true"}})
"""A migration's conversion selector that leaves namespace "ns" out."""


@pytest.mark.parametrize(
    ("spec", "limits", "refused"),
    [
        # Past what one claim holds, or a MIG name gpudra cannot read: the device plugin
        # serves them, and a tenant that limits neither lets them through.
        ({}, {"nvidia.com/mig-1g.5gb": "40"}, None),
        ({}, {"nvidia.com/mig-1g.5gb.shared": "1"}, None),
        ({}, {"nvidia.com/mig-1g.10gb.me": "1"}, None),
        ({"maxDevicesPerPod": 40}, {"nvidia.com/gpu": "40"}, None),
        ({"allowedMigProfiles": ["1g.10gb+me"]}, {"nvidia.com/mig-1g.10gb.me": "2"}, None),
        # Each a try at passing the tenant's rules under a name gpudra does not convert.
        (
            {"maxDevicesPerPod": 8},
            {"nvidia.com/mig-1g.5gb": "40"},
            "maxDevicesPerPod is 8, this pod asks for 40 devices (nvidia.com/mig-1g.5gb in ",
        ),
        (
            {"maxDevicesPerPod": 1},
            {"nvidia.com/mig-1g.5gb.shared": "2"},
            "maxDevicesPerPod is 1, this pod asks for 2 devices",
        ),
        (
            {"allowedMigProfiles": ["1g.10gb"]},
            {"nvidia.com/mig-1g.10gb.shared": "1"},
            "MIG profile 1g.10gb.shared is not allowed; allowed profiles: 1g.10gb",
        ),
        (
            {"allowedMigProfiles": ["1g.10gb"]},
            {"nvidia.com/mig-1g.10gb.me": "1"},
            "MIG profile 1g.10gb+me is not allowed; allowed profiles: 1g.10gb",
        ),
        (
            {"allowedMigProfiles": []},
            {"nvidia.com/mig-anything": "1"},
            "MIG profile anything is not allowed; allowed profiles: none",
        ),
        (
            {"allowedDeviceClasses": ["gpu.nvidia.com"]},
            {"nvidia.com/mig-7g.999gb.xl": "1"},
            "device class mig.nvidia.com is not allowed; allowed classes: gpu.nvidia.com",
        ),
        # A MIG device the device plugin time-shares is not Exclusive: it shares as
        # nvidia.com/gpu.shared does, by the tenant's shared strategy.
        (
            {"allowedSharing": ["Exclusive"]},
            {"nvidia.com/mig-1g.10gb.shared": "1"},
            "sharing mode TimeSlicing is not allowed; allowed modes: Exclusive "
            "(nvidia.com/mig-1g.10gb.shared in container c=1)",
        ),
        (
            {"allowedSharing": ["Exclusive"]},
            {"nvidia.com/gpu.shared": "1"},
            "sharing mode TimeSlicing is not allowed; allowed modes: Exclusive "
            "(nvidia.com/gpu.shared in container c=1)",
        ),
        ({"allowedSharing": ["Exclusive"]}, {"nvidia.com/mig-1g.10gb": "1"}, None),
        (
            {"allowedSharing": ["MPS"], "gpuResource": {"sharing": "MPS"}},
            {"nvidia.com/mig-1g.10gb.shared": "1"},
            None,
        ),
    ],
)
async def test_a_pod_gpudra_cannot_convert_keeps_the_tenant_rules_where_conversion_is_off(
    spec: dict[str, Any], limits: dict[str, str], refused: str | None
) -> None:
    """A pod of a namespace the migration leaves out goes to the device plugin, which
    serves what no claim could hold, so only the tenant's rules may refuse it: every
    device it asks for counts, and a MIG resource gpudra cannot read is a MIG device of
    a profile no allowedMigProfiles lists, time-shared where its name ends in .shared
    (the device plugin's replica). A tenant's pod gets nothing past its rules by
    asking for what gpudra does not convert; a pod opted out where conversion is on is
    judged alike."""
    state = tenant_state(("team-a", {"namespaces": ["ns"], **spec}))
    templates = Templates()
    admission = Admission(
        templates, WebhookMetrics(CollectorRegistry()), tenants=state, conversion_selector=UNMOVED
    )
    opted_out = gpu_pod(limits, labels={OPT_OUT_LABEL: "false"})
    for pod in (gpu_pod(limits), opted_out):
        decision = await admission.mutate_pod(review(POD, pod))
        if refused is None:
            assert (decision.result, decision.response.get("patch")) == ("allowed", None)
        else:
            assert decision.result == "denied"
            status = decision.response["status"]
            assert status["code"] == 403
            assert status["message"].startswith('tenant "team-a" (GpuTenant team-a): ')
            assert refused in status["message"]
        labelled = {"name": "ns", "labels": {"gpudra.nvidia.com/dra": "true"}}
        state.event("namespaces", "MODIFIED", {"metadata": labelled, "status": {"phase": "Active"}})
    assert templates.names == []


NATIVE = ConversionPolicy(native_resources=frozenset({"nvidia.com/gpu"}))


def stored_classes(extended_resource_name: str | None) -> DeviceClassCache:
    """The chart's DeviceClasses as the API server stored them: gpu.nvidia.com with
    `extended_resource_name`, or without it, as an API server whose DRAExtendedResource
    gate is off stores the class the chart renders with it."""
    cache = DeviceClassCache(NATIVE.driver)
    cache.replace(device_classes())
    if extended_resource_name is not None:
        cache.event("MODIFIED", mapped_gpu_class(extended_resource_name))
    return cache


def mapped_gpu_class(extended_resource_name: str | None) -> dict[str, Any]:
    (gpu,) = (c for c in device_classes() if c["metadata"]["name"] == NATIVE.gpu_class)
    if extended_resource_name is not None:
        gpu["spec"]["extendedResourceName"] = extended_resource_name
    return gpu


async def test_tenant_rules_count_resources_a_device_class_serves_itself() -> None:
    admission = limited_admission(Claims(), policy=NATIVE, classes=stored_classes("nvidia.com/gpu"))
    decision = await admission.mutate_pod(review(POD, gpu_pod({"nvidia.com/gpu": "2"})))
    assert decision.result == "denied"
    assert (
        "maxDevicesPerPod is 1, this pod asks for 2 devices"
        in decision.response["status"]["message"]
    )
    decision = await admission.mutate_pod(review(POD, gpu_pod({"nvidia.com/gpu": "1"})))
    assert (decision.result, decision.response.get("patch")) == ("allowed", None)


async def test_a_native_resource_no_stored_class_maps_is_converted_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--extended-resource-name says the chart set gpu.nvidia.com's extendedResourceName,
    but an API server whose DRAExtendedResource gate is off (1.34 and 1.35's default)
    drops the field, and the scheduler then serves no nvidia.com/gpu pod: left alone, it
    would stay Pending. So its pods are converted as if the flag were not given, the tenant
    rules still count their GPUs, and each change of the stored class is logged once."""
    caplog.set_level(logging.INFO, logger="gpudra.webhook.admission")
    classes = stored_classes(None)
    admission = limited_admission(Claims(), policy=NATIVE, classes=classes)

    def changes() -> list[tuple[int, str]]:
        return [
            (r.levelno, r.__dict__["fields"]["resource"])
            for r in caplog.records
            if "extended resource" in r.getMessage()
        ]

    for _ in range(2):
        decision = await admission.mutate_pod(review(POD, gpu_pod({"nvidia.com/gpu": "1"})))
        assert decision.result == "patched"
    decision = await admission.mutate_pod(review(POD, gpu_pod({"nvidia.com/gpu": "2"})))
    assert decision.result == "denied"
    assert (
        "maxDevicesPerPod is 1, this pod asks for 2 devices"
        in (decision.response["status"]["message"])
    )
    (warning,) = (r for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.__dict__["fields"] == {
        "device_class": "gpu.nvidia.com",
        "resource": "nvidia.com/gpu",
    }
    assert "DRAExtendedResource" in warning.getMessage()
    assert "deviceClasses.gpu.extendedResourceName" in warning.getMessage()

    # The gate is enabled and the class applied again: the scheduler serves the pods.
    classes.event("MODIFIED", mapped_gpu_class("nvidia.com/gpu"))
    for _ in range(2):
        decision = await admission.mutate_pod(review(POD, gpu_pod({"nvidia.com/gpu": "1"})))
        assert (decision.result, decision.response.get("patch")) == ("allowed", None)
    # And the field is lost again (the class recreated while the gate is off).
    classes.event("MODIFIED", mapped_gpu_class(None))
    decision = await admission.mutate_pod(review(POD, gpu_pod({"nvidia.com/gpu": "1"})))
    assert decision.result == "patched"
    assert changes() == [
        (logging.WARNING, "nvidia.com/gpu"),
        (logging.INFO, "nvidia.com/gpu"),
        (logging.WARNING, "nvidia.com/gpu"),
    ]


def test_the_device_classes_are_mirrored_wherever_a_native_resource_is_configured() -> None:
    """Without the mirror no stored class is seen to map the resource, and its pods would
    all be converted, though the scheduler serves them: the webhook mirrors the classes
    for native resources even without claim validation."""
    flags = ["webhook", "--cert-dir=certs", "--no-tenants", "--no-validate-claims"]
    args = build_parser().parse_args([*flags, "--extended-resource-name=nvidia.com/gpu"])
    assert device_class_cache(args, conversion_policy(args)) is not None
    args = build_parser().parse_args(flags)
    assert device_class_cache(args, conversion_policy(args)) is None


async def test_a_review_for_an_excluded_namespace_writes_nothing() -> None:
    templates = Templates()
    admission = Admission(
        templates, WebhookMetrics(CollectorRegistry()), own_namespace="gpu-system"
    )
    for namespace in ("kube-system", "gpu-system"):
        decision = await admission.mutate_pod(review(POD, GPU_POD, namespace=namespace))
        assert decision.response == {"uid": "u1", "allowed": True}
    assert templates.names == []
    assert (await admission.mutate_pod(review(POD, GPU_POD))).result == "patched"
    assert templates.names == ["gpudra-gpu-1"]


def claim_object(name: str, count: int, **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **metadata}, "spec": one_gpu_spec(count)}


async def test_a_claim_created_again_bigger_is_counted_with_the_pods_that_use_it() -> None:
    # The pod was admitted with claim "one" of one device; the claim is then deleted and
    # created again under its name with two devices while the pod waits.
    claims = Claims(other=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    waiting = claim_pod(
        0, {"name": "a", "resourceClaimName": "one"}, {"name": "b", "resourceClaimName": "other"}
    )
    claims.live_pods = [waiting]

    decision = await admission.validate_claim(review(CLAIM, claim_object("one", 2)))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "maxDevicesPerPod is 2, and pod p uses this claim" in message
    assert "would get 3 devices" in message
    assert "claim a (ResourceClaim one (new)): 2" in message

    # The same size again is fine, and so is a bigger claim no pod uses.
    assert (
        await admission.validate_claim(review(CLAIM, claim_object("one", 1)))
    ).result == "allowed"
    assert (
        await admission.validate_claim(review(CLAIM, claim_object("lone", 2)))
    ).result == "allowed"


async def denied_under_admitted_pod(
    admission: Admission, claims: Claims, pod: dict[str, Any]
) -> str:
    """Admit `pod` unpatched (it keeps its legacy resource), let it wait, then create
    its claim x again with one GPU: the denial's message."""
    decision = await admission.mutate_pod(review(POD, pod))
    assert (decision.result, decision.response.get("patch")) == ("allowed", None)
    claims.live_pods = [pod]
    decision = await admission.validate_claim(review(CLAIM, claim_object("x", 1)))
    assert decision.result == "denied"
    return str(decision.response["status"]["message"])


async def test_a_claim_created_again_counts_the_device_plugin_resources_of_its_pods() -> None:
    """A namespace left out of the conversion, limit 1: the pod keeps nvidia.com/gpu: 1
    and names claim x, which asks for none of the driver's devices, so it is admitted.
    The tenant deletes x and creates it again with one GPU while the pod waits: with
    its device-plugin GPU the pod would get two, so the new claim is refused, naming
    the legacy resource as the pod's own admission does."""
    claims = Claims(x=NO_DRIVER_DEVICE)
    admission = limited_admission(claims)
    admission = Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        tenants=admission._tenants,
        read_claims=claims,
        conversion_selector=UNMOVED,
    )
    waiting = claim_pod(1, {"name": "a", "resourceClaimName": "x"})
    message = await denied_under_admitted_pod(admission, claims, waiting)
    assert "maxDevicesPerPod is 1, and pod p uses this claim" in message
    assert (
        "would get 2 devices (nvidia.com/gpu in container c=1; "
        "claim a (ResourceClaim x (new)): 1)" in message
    )
    # Created again as it was, asking for none of the driver's devices, it is fine.
    again = {"metadata": {"name": "x"}, "spec": NO_DRIVER_DEVICE}
    assert (await admission.validate_claim(review(CLAIM, again))).result == "allowed"


async def test_native_resources_are_counted_once_when_a_claim_is_created() -> None:
    """nvidia.com/gpu served by a DeviceClass's extendedResourceName stays in the pod:
    while the scheduler has made no claim for it, a claim created again for the pod's
    entry counts it as the pod's admission did; the scheduler's claim, which holds it,
    counts it in its place, not beside it."""
    claims = Claims(x=NO_DRIVER_DEVICE)
    admission = limited_admission(
        claims, limit=1, policy=NATIVE, classes=stored_classes("nvidia.com/gpu")
    )
    pod = claim_pod(1, {"name": "a", "resourceClaimName": "x"})
    pod["metadata"]["uid"] = "pod-uid"
    message = await denied_under_admitted_pod(admission, claims, pod)
    assert "nvidia.com/gpu in container c=1; claim a (ResourceClaim x (new)): 1" in message

    # The scheduler's claim for the pod's nvidia.com/gpu: one GPU, the pod's one.
    scheduled = extended_resource_claim("p", "pod-uid", 1)
    assert (await admission.validate_claim(review(CLAIM, scheduled))).result == "allowed"
    claims.specs["p-extended-resources-zzzzz"] = scheduled["spec"]
    pod["status"] = {
        "extendedResourceClaimStatus": {
            "resourceClaimName": "p-extended-resources-zzzzz",
            "requestMappings": [],
        }
    }
    again = {"metadata": {"name": "x"}, "spec": NO_DRIVER_DEVICE}
    assert (await admission.validate_claim(review(CLAIM, again))).result == "allowed"
    decision = await admission.validate_claim(review(CLAIM, claim_object("x", 1)))
    message = decision.response["status"]["message"]
    assert "would get 2 devices" in message
    assert "nvidia.com/gpu" not in message


class SwappedWhileRead(Claims):
    """The tenant deletes claim `swapped` and creates it again with `bigger` right after
    the webhook's first read of it, while the pod's admission goes on."""

    def __init__(self, bigger: dict[str, Any], **specs: dict[str, Any]) -> None:
        super().__init__(**specs)
        self.bigger = bigger

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None:
        stored = await super().__call__(namespace, kind, name)
        if name == "swapped":
            self.specs[name] = self.bigger
        return stored


@pytest.mark.parametrize("first", [1, 0], ids=["a-gpu", "no-gpu"])
async def test_a_claim_swapped_while_the_pod_is_admitted_is_caught_by_reading_it_again(
    first: int,
) -> None:
    """A pod's admission reads the claims it names one after another, so a pod naming
    many holds the window in which one deleted and created again bigger is counted by
    neither admission. Read again at once once counted, a changed one denies the pod
    (to be retried), also one counted as no GPU at all."""
    fillers = {f"f{i}": {"devices": {"requests": []}} for i in range(40)}
    no_gpu = {"devices": {"requests": []}}
    claims = SwappedWhileRead(
        one_gpu_spec(2),
        swapped=one_gpu_spec(1) if first else no_gpu,
        other=one_gpu_spec(),
        **fillers,
    )
    admission = limited_admission(claims, limit=2)
    entries = [{"name": "a", "resourceClaimName": "swapped"}]
    entries += [{"name": f"e{i}", "resourceClaimName": f"f{i}"} for i in range(40)]
    entries.append({"name": "b", "resourceClaimName": "other"})

    decision = await admission.mutate_pod(review(POD, claim_pod(0, *entries)))

    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert message.startswith('tenant "team-a" (GpuTenant team-a): maxDevicesPerPod is 2')
    assert (
        "ResourceClaim swapped was deleted and created again while the pod was admitted" in message
    )
    assert claims.reads.count(("ResourceClaim", "swapped")) == 2
    # The claim as it is now is what the retry counts: one device too many.
    again = await admission.mutate_pod(review(POD, claim_pod(0, *entries)))
    assert again.result == "denied"
    assert "this pod asks for 3 devices" in again.response["status"]["message"]


class FailingAt(Claims):
    """The API answering the `n`th read of a claim with an error."""

    def __init__(self, n: int, **specs: dict[str, Any]) -> None:
        super().__init__(**specs)
        self.n = n

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None:
        if len(self.reads) + 1 == self.n:
            self.reads.append((kind, name))
            raise ConnectionResetError("the API server went away")
        return await super().__call__(namespace, kind, name)


@pytest.mark.parametrize(
    ("n", "what"), [(1, "read ResourceClaim one"), (3, "read the pod's claims again")]
)
async def test_a_claim_that_cannot_be_read_denies_the_pod_for_a_retry(n: int, what: str) -> None:
    """Counting fails closed: a read that fails, first or again, denies the pod, and the
    API server's retry reads again."""
    claims = FailingAt(n, one=one_gpu_spec(), other=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(
        0, {"name": "a", "resourceClaimName": "one"}, {"name": "b", "resourceClaimName": "other"}
    )
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    assert decision.response["status"]["message"] == (
        'tenant "team-a" (GpuTenant team-a): maxDevicesPerPod is 2; could not '
        f"{what} to count its devices: the API server went away; retry"
    )


async def test_claims_unchanged_since_read_admit_the_pod() -> None:
    """Each claim the pod names is read twice, once to count and once, at once with the
    others, to see that none changed; a claim allocated meanwhile has not."""
    claims = Claims(one=one_gpu_spec(), other=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(
        0, {"name": "a", "resourceClaimName": "one"}, {"name": "b", "resourceClaimName": "other"}
    )
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"
    assert sorted(claims.reads) == [("ResourceClaim", "one")] * 2 + [("ResourceClaim", "other")] * 2


async def test_a_generated_claim_is_counted_with_the_pod_that_owns_it() -> None:
    # The template was swapped for a bigger one between the pod's admission and the
    # controller generating the pod's claim from it.
    claims = Claims(tpl=one_gpu_spec(), other=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(
        0,
        {"name": "a", "resourceClaimTemplateName": "tpl"},
        {"name": "b", "resourceClaimName": "other"},
    )
    pod["metadata"]["uid"] = "pod-uid"
    claims.live_pods = [pod]
    generated = claim_object(
        "p-a-x1y2z",
        2,
        annotations={"resource.kubernetes.io/pod-claim-name": "a"},
        ownerReferences=[{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid"}],
    )
    decision = await admission.validate_claim(review(CLAIM, generated))
    assert decision.result == "denied"
    assert "would get 3 devices" in decision.response["status"]["message"]
    # The template itself was not read for entry "a": the new claim fills it.
    assert ("ResourceClaimTemplate", "tpl") not in claims.reads

    # Another pod's claim under the same annotation is not this pod's.
    stranger = {**generated, "metadata": {**generated["metadata"], "ownerReferences": []}}
    assert (await admission.validate_claim(review(CLAIM, stranger))).result == "allowed"


def generated_claim(entry: str, suffix: str, count: int) -> dict[str, Any]:
    """The claim the resourceclaim controller generates for pod p's `entry`."""
    return claim_object(
        f"p-{entry}-{suffix}",
        count,
        annotations={"resource.kubernetes.io/pod-claim-name": entry},
        ownerReferences=[
            {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid", "controller": True}
        ],
    )


NO_DRIVER_DEVICE = {
    "devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "nothing.example.com"}}]}
}
"""A claim spec asking for another driver's device: none of ours."""


async def test_a_template_swapped_after_its_claim_was_made_counts_the_claim_made() -> None:
    """Two template entries, one GPU each, limit 2, the pod waiting. The tenant deletes
    both templates and creates them again, one asking for none of the driver's devices,
    the other for two; then deletes the first entry's claim. The controller's new claim
    for it (two GPUs) is counted with the claim it already made for the other entry
    (one GPU, from the old template), not with the template stored now (none)."""
    claims = Claims(ta=one_gpu_spec(1), tb=one_gpu_spec(1))
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(
        0,
        {"name": "e1", "resourceClaimTemplateName": "ta"},
        {"name": "e2", "resourceClaimTemplateName": "tb"},
    )
    pod["metadata"]["uid"] = "pod-uid"
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"
    claims.live_pods = [pod]
    for entry, suffix in (("e1", "aaaaa"), ("e2", "bbbbb")):
        made = generated_claim(entry, suffix, 1)
        assert (await admission.validate_claim(review(CLAIM, made))).result == "allowed"
        claims.specs[made["metadata"]["name"]] = made["spec"]
    pod["status"] = {
        "resourceClaimStatuses": [
            {"name": "e1", "resourceClaimName": "p-e1-aaaaa"},
            {"name": "e2", "resourceClaimName": "p-e2-bbbbb"},
        ]
    }
    claims.specs["tb"] = NO_DRIVER_DEVICE
    claims.specs["ta"] = one_gpu_spec(2)
    del claims.specs["p-e1-aaaaa"]
    claims.reads.clear()
    decision = await admission.validate_claim(review(CLAIM, generated_claim("e1", "ccccc", 2)))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "maxDevicesPerPod is 2, and pod p uses this claim" in message
    assert "would get 3 devices" in message
    assert "claim e2 (ResourceClaim p-e2-bbbbb (generated from ResourceClaimTemplate tb)): 1" in (
        message
    )
    assert ("ResourceClaimTemplate", "tb") not in claims.reads

    # The same with the tenant's own claim beside the entry: re-created bigger, refused.
    claims.specs["x"] = one_gpu_spec(1)
    pod["spec"]["resourceClaims"][0] = {"name": "e1", "resourceClaimName": "x"}
    decision = await admission.validate_claim(review(CLAIM, claim_object("x", 2)))
    assert "would get 3 devices" in decision.response["status"]["message"]

    # A generated claim that is gone again counts the template it will be made from.
    del claims.specs["p-e2-bbbbb"]
    claims.specs["tb"] = one_gpu_spec(2)
    decision = await admission.validate_claim(review(CLAIM, claim_object("x", 1)))
    assert "claim e2 (ResourceClaimTemplate tb): 2" in decision.response["status"]["message"]


async def test_a_claim_made_for_an_entry_counts_while_the_pod_status_lacks_it() -> None:
    """The resourceclaim controller applies the pod status of only the entries one pass
    made, which drops the other entries' from it. The same swap as above then finds no
    status for the other entry: the claim the pod controls for it is counted, not the
    template stored under its name now (which asks for none of the driver's devices)."""
    claims = Claims(ta=one_gpu_spec(2), tb=NO_DRIVER_DEVICE)
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(
        0,
        {"name": "e1", "resourceClaimTemplateName": "ta"},
        {"name": "e2", "resourceClaimTemplateName": "tb"},
    )
    pod["metadata"]["uid"] = "pod-uid"
    pod["status"] = {"resourceClaimStatuses": [{"name": "e1", "resourceClaimName": "p-e1-gone"}]}
    claims.live_pods = [pod]
    claims.specs["p-e2-small"] = NO_DRIVER_DEVICE
    claims.specs["p-e2-bbbbb"] = one_gpu_spec(1)
    claims.made["pod-uid"] = {"e2": ["p-e2-small", "p-e2-bbbbb"]}
    decision = await admission.validate_claim(review(CLAIM, generated_claim("e1", "ccccc", 2)))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "would get 3 devices" in message
    assert "claim e2 (ResourceClaim p-e2-bbbbb (generated from ResourceClaimTemplate tb)): 1" in (
        message
    )
    # Without a claim made for it, the entry counts its template.
    claims.made.clear()
    decision = await admission.validate_claim(review(CLAIM, generated_claim("e1", "ccccc", 2)))
    assert decision.result == "allowed"


async def test_the_claims_made_for_pods_are_read_for_the_entries_that_count_them() -> None:
    """Claim c is created, used by two waiting pods. Pod p has entry t2, a template its
    status names no claim for: the claims made for p are read, and the one made for t2
    (two GPUs) is counted, not template t2 (none of the driver's devices). Entry t1's
    claim is named by the status, entry h names a claim by hand, and pod q's only other
    entry is t1 too: the claims made for q are not read. One rule decides both which
    pods' claims are read and which entries count them, so the two cannot part."""
    claims = Claims(t1=one_gpu_spec(2), t2=NO_DRIVER_DEVICE, h=NO_DRIVER_DEVICE)
    claims.specs.update({"g1": NO_DRIVER_DEVICE, "p-t2-small": one_gpu_spec(2)})
    admission = limited_admission(claims, limit=2)
    pods = []
    for name, extra in (("p", [{"name": "t2", "resourceClaimTemplateName": "t2"}]), ("q", [])):
        pod = claim_pod(
            0,
            {"name": "a", "resourceClaimName": "c"},
            {"name": "t1", "resourceClaimTemplateName": "t1"},
            {"name": "h", "resourceClaimName": "h"},
            *extra,
        )
        pod["metadata"] = {"name": name, "uid": f"{name}-uid"}
        pod["status"] = {"resourceClaimStatuses": [{"name": "t1", "resourceClaimName": "g1"}]}
        pods.append(pod)
    claims.live_pods = pods
    claims.made["p-uid"] = {"t2": ["p-t2-small"]}

    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))

    assert claims.made_asked == [{"p-uid"}]
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "pod p uses this claim" in message
    assert "would get 3 devices" in message
    assert "claim t2 (ResourceClaim p-t2-small (generated from ResourceClaimTemplate t2)): 2" in (
        message
    )
    assert ("ResourceClaimTemplate", "t1") not in claims.reads

    # With t2 named by p's status too, no pod needs the claims made for it.
    pods[0]["status"]["resourceClaimStatuses"].append({"name": "t2", "resourceClaimName": "g1"})
    claims.made_asked.clear()
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "allowed"
    assert claims.made_asked == []


async def test_a_pods_create_request_cannot_say_which_claims_were_made_for_it() -> None:
    """At a pod's creation the mutating webhook sees the status and UID the request
    carries (the API server resets the status only after it): a status naming a small
    stored claim for the entry of a big template, and a UID that claims were made for,
    are the tenant's word, not Kubernetes'. The entry counts its template."""
    claims = Claims(big=one_gpu_spec(2), small=one_gpu_spec(1), other=one_gpu_spec(1))
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(
        0,
        {"name": "a", "resourceClaimTemplateName": "big"},
        {"name": "b", "resourceClaimName": "other"},
    )
    pod["status"] = {"resourceClaimStatuses": [{"name": "a", "resourceClaimName": "small"}]}
    pod["metadata"]["uid"] = "forged"
    claims.made["forged"] = {"a": ["small"]}
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "maxDevicesPerPod is 2, this pod asks for 3 devices" in message
    assert "claim a (ResourceClaimTemplate big): 2" in message
    assert ("ResourceClaim", "small") not in claims.reads


async def test_a_claim_made_for_an_entry_counts_the_pods_extended_resources() -> None:
    """A pod with a template entry and a DRA extended resource, limit 2: the entry's
    claim made again with two GPUs is counted with the extended-resource claim the
    scheduler will make (one), and once the scheduler made it, with the one it made."""
    claims = Claims(t=one_gpu_spec(1))
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(0, {"name": "e1", "resourceClaimTemplateName": "t"})
    pod["metadata"]["uid"] = "pod-uid"
    pod["spec"]["containers"][0]["resources"]["limits"] = {IMPLICIT_GPU: "1"}
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"
    claims.live_pods = [pod]
    assert (
        await admission.validate_claim(review(CLAIM, generated_claim("e1", "aaaaa", 1)))
    ).result == "allowed"
    decision = await admission.validate_claim(review(CLAIM, generated_claim("e1", "bbbbb", 2)))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "would get 3 devices" in message
    assert f"claim (extended resources) (container-0-request-0 ({IMPLICIT_GPU}=1" in message

    # The scheduler's claim is stored (with two devices, say): that one counts.
    claims.specs["p-extended-resources-zzzzz"] = one_gpu_spec(2)
    pod["status"] = {
        "extendedResourceClaimStatus": {
            "resourceClaimName": "p-extended-resources-zzzzz",
            "requestMappings": [],
        }
    }
    decision = await admission.validate_claim(review(CLAIM, generated_claim("e1", "ccccc", 1)))
    message = decision.response["status"]["message"]
    assert "claim (extended resources) (ResourceClaim p-extended-resources-zzzzz): 2" in message
    assert "would get 3 devices" in message


IMPLICIT_GPU = "deviceclass.resource.kubernetes.io/gpu.nvidia.com"
"""gpu.nvidia.com asked for as an extended resource (DRAExtendedResource): the scheduler
creates the pod's claim for it."""


def extended_resource_claim(pod_name: str, pod_uid: str, count: int) -> dict[str, Any]:
    """The claim kube-scheduler creates for a pod's extended resources, as it writes it."""
    claim = claim_object("", count)
    claim["metadata"] = {
        "generateName": f"{pod_name}-extended-resources-",
        "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
        "ownerReferences": [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod_name,
                "uid": pod_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    claim["spec"]["devices"]["requests"][0]["name"] = "container-0-request-0"
    return claim


async def test_a_device_class_asked_for_as_an_extended_resource_counts_with_the_pod() -> None:
    claims = Claims(one=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    # Converted GPUs and the claim the scheduler will create, each within the limit.
    pod = gpu_pod({"nvidia.com/gpu": "2", IMPLICIT_GPU: "2"})
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "maxDevicesPerPod is 2, this pod asks for 4 devices" in message
    assert (
        f'claim (extended resources) (container-0-request-0 ({IMPLICIT_GPU}=2, container "c")): 2'
        in message
    )
    # A hand-written claim beside it; and requests alone, which the API server allows.
    pod = claim_pod(0, {"name": "a", "resourceClaimName": "one"})
    pod["spec"]["containers"][0]["resources"]["requests"] = {IMPLICIT_GPU: "2"}
    decision = await admission.mutate_pod(review(POD, pod))
    assert "this pod asks for 3 devices" in decision.response["status"]["message"]
    # Alone, more than the limit: the scheduler's claim itself breaks it.
    decision = await admission.mutate_pod(review(POD, gpu_pod({IMPLICIT_GPU: "3"})))
    message = decision.response["status"]["message"]
    assert message.startswith("the ResourceClaim the scheduler would create for this pod's")
    assert "maxDevicesPerPod is 2, this claim asks for 3 devices" in message
    # Within it, admitted and left as it is.
    decision = await admission.mutate_pod(review(POD, gpu_pod({IMPLICIT_GPU: "2"})))
    assert (decision.result, decision.response.get("patch")) == ("allowed", None)
    # Another driver's class is not ours to count.
    other = {"deviceclass.resource.kubernetes.io/fpga.example.com": "5"}
    assert (await admission.mutate_pod(review(POD, gpu_pod(other)))).result == "allowed"


async def test_a_device_class_asked_for_as_an_extended_resource_meets_the_claim_rules() -> None:
    state = TenantState(base_policy=DEFAULT_POLICY)
    spec = {"namespaces": ["ns"], "allowedDeviceClasses": ["gpu.nvidia.com"]}
    tenant = {"apiVersion": API_VERSION, "kind": "GpuTenant", "metadata": {"name": "team-a"}}
    state.replace("tenants", [{**tenant, "spec": spec}])
    state.replace("namespaces", [{"metadata": {"name": "ns"}, "status": {"phase": "Active"}}])
    state.replace("quotas", [])
    admission = Admission(Templates(), WebhookMetrics(CollectorRegistry()), tenants=state)
    mig = gpu_pod({"deviceclass.resource.kubernetes.io/mig.nvidia.com": "1"})
    decision = await admission.mutate_pod(review(POD, mig))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "the ResourceClaim the scheduler would create for this pod's extended" in message
    assert "does not allow device class mig.nvidia.com" in message
    assert (await admission.mutate_pod(review(POD, gpu_pod({IMPLICIT_GPU: "1"})))).result == (
        "allowed"
    )


async def test_the_schedulers_extended_resource_claim_is_counted_with_the_pod_that_owns_it() -> (
    None
):
    claims = Claims(one=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    pod = claim_pod(0, {"name": "a", "resourceClaimName": "one"})
    pod["metadata"]["uid"] = "pod-uid"
    pod["spec"]["containers"][0]["resources"]["limits"] = {IMPLICIT_GPU: "1"}
    claims.live_pods = [pod]
    # The scheduler's claim as the pod was admitted: one device, the pod's two in all.
    fits = extended_resource_claim("p", "pod-uid", 1)
    assert (await admission.validate_claim(review(CLAIM, fits))).result == "allowed"
    # Bigger than what the pod's admission counted: two within the limit alone, not with
    # the pod's other claim.
    bigger = extended_resource_claim("p", "pod-uid", 2)
    decision = await admission.validate_claim(review(CLAIM, bigger))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "maxDevicesPerPod is 2, and pod p uses this claim" in message
    assert "would get 3 devices" in message
    assert "claim (extended resources) (the new claim): 2" in message
    # Only the pod that controls it: not another pod's, nor an owner that is no controller.
    for owner in ({"uid": "another"}, {"controller": False}):
        stray = extended_resource_claim("p", "pod-uid", 2)
        stray["metadata"]["ownerReferences"][0].update(owner)
        assert (await admission.validate_claim(review(CLAIM, stray))).result == "allowed"


def group_claim(spec: dict[str, Any], **owner: Any) -> dict[str, Any]:
    """The claim the resourceclaim controller makes from PodGroup g's entry b (Kubernetes
    1.36, DRAWorkloadResourceClaims): controlled by the PodGroup; `owner` changes that."""
    reference = {
        "apiVersion": "scheduling.k8s.io/v1alpha2",
        "kind": "PodGroup",
        "name": "g",
        "uid": "group-uid",
        "controller": True,
        **owner,
    }
    metadata = {
        "name": "g-b-xxxxx",
        "annotations": {"resource.kubernetes.io/podgroup-claim-name": "b"},
        "ownerReferences": [reference],
    }
    return {"metadata": metadata, "spec": spec}


TOLERATING = {
    "devices": {
        "requests": [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": "gpu.nvidia.com",
                    "count": 1,
                    "tolerations": [{"operator": "Exists"}],
                },
            }
        ]
    }
}
"""A claim spec tolerating every device taint, which rules without allowedTaintTolerations
refuse."""


@pytest.mark.parametrize(
    ("rules", "spec"),
    [
        # Fits the limit alone, but counted with none of the pods it is handed to.
        ({"maxDevicesPerPod": 2}, one_gpu_spec(2)),
        # Allowed under today's rules, and never judged again once they are tightened.
        ({"allowedTaintTolerations": ["*"]}, TOLERATING),
    ],
    ids=["limit", "rules"],
)
async def test_a_pod_groups_claim_is_refused_where_a_tenant_governs(
    rules: dict[str, Any], spec: dict[str, Any]
) -> None:
    """A pod of PodGroup g uses entry b, from template tb, as g's spec.resourceClaims
    does: Kubernetes hands it g's claim, which it records in g's status, not the pod's,
    so the webhook could neither count it with the pod nor judge it again for a new one.
    Its creation is refused, naming the owner and the fix; the same claim controlled by
    the pod, by another kind or group of owner, or not controlled, is judged as before,
    and so is a group's claim of none of the driver's devices, or one in a namespace no
    GpuTenant governs."""
    claims = Claims(tb=spec)
    admission = tenant_admission(claims, ("team-a", {"namespaces": ["ns"], **rules}))
    member = claim_pod(0, {"name": "b", "resourceClaimTemplateName": "tb"})
    member["metadata"]["uid"] = "pod-uid"
    member["spec"]["schedulingGroup"] = {"podGroupName": "g"}
    assert (await admission.mutate_pod(review(POD, member))).result == "allowed"
    claims.live_pods = [member]

    decision = await admission.validate_claim(review(CLAIM, group_claim(spec)))
    assert decision.result == "denied"
    status = decision.response["status"]
    assert status["code"] == 403
    assert status["message"].startswith(
        'ResourceClaim g-b-xxxxx: tenant "team-a" (GpuTenant team-a): its controlling owner '
        "is PodGroup g (scheduling.k8s.io/v1alpha2), and a PodGroup's claim is shared"
    )
    assert "leave the entry out of the PodGroup's spec.resourceClaims" in status["message"]
    assert "or run the workload in a namespace no GpuTenant governs" in status["message"]

    pods = {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid"}
    for owner in (
        pods,
        {"apiVersion": "scheduling.x-k8s.io/v1alpha1"},
        {"kind": "Workload"},
        {"controller": False},
    ):
        decision = await admission.validate_claim(review(CLAIM, group_claim(spec, **owner)))
        assert decision.result == "allowed", owner
    other = await admission.validate_claim(review(CLAIM, group_claim(NO_DRIVER_DEVICE)))
    assert other.result == "allowed"
    ungoverned = tenant_admission(claims, ("team-a", {"namespaces": ["elsewhere"], **rules}))
    assert (await ungoverned.validate_claim(review(CLAIM, group_claim(spec)))).result == "allowed"


def tenant_state(*tenants: dict[str, Any]) -> TenantState:
    """The tenant view of namespace "ns" under `tenants` (GpuTenant specs by name)."""
    state = TenantState()
    state.replace(
        "tenants",
        [
            {"apiVersion": API_VERSION, "kind": "GpuTenant", "metadata": {"name": n}, "spec": s}
            for n, s in tenants
        ],
    )
    state.replace("namespaces", [{"metadata": {"name": "ns"}, "status": {"phase": "Active"}}])
    state.replace("quotas", [])
    return state


def tenant_admission(claims: Claims, *tenants: tuple[str, dict[str, Any]]) -> Admission:
    return Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        tenants=tenant_state(*tenants),
        read_claims=claims,
    )


TWO_CLAIMS = claim_pod(
    0, {"name": "a", "resourceClaimName": "one"}, {"name": "b", "resourceClaimName": "two"}
)


@pytest.mark.parametrize(
    "tenants",
    [
        # Stored by the API server, refused by the webhook: its rules are unknown.
        [("team-a", {"namespaces": ["ns"], "maxDevicesPerPod": 1, "allowedSharing": ["MPS"]})],
        # Two of equal specificity: which one decides is unknown.
        [("a", {"namespaces": ["ns"], "maxDevicesPerPod": 1}), ("b", {"namespaces": ["ns"]})],
    ],
)
async def test_where_the_rules_are_unknown_a_pod_naming_gpu_claims_is_denied(
    tenants: list[tuple[str, dict[str, Any]]],
) -> None:
    """Not only pods asking for GPUs as resources: one whose GPUs come from claims it
    names is denied too, and one whose claims hold none of the driver's devices is not."""
    state = tenant_state(*tenants)
    assert state.lookup("ns").denial
    other = {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "nic"}}]}}
    claims = Claims(one=one_gpu_spec(), two=one_gpu_spec(), nic=other)
    admission = Admission(
        Templates(), WebhookMetrics(CollectorRegistry()), tenants=state, read_claims=claims
    )
    decision = await admission.mutate_pod(review(POD, TWO_CLAIMS))
    assert decision.result == "denied"
    assert decision.response["status"]["message"] == state.lookup("ns").denial
    nic_pod = claim_pod(0, {"name": "a", "resourceClaimName": "nic"})
    assert (await admission.mutate_pod(review(POD, nic_pod))).result == "allowed"


@pytest.mark.parametrize("limit", [4, None])
async def test_a_claim_stored_before_the_rules_is_not_handed_to_a_new_pod(
    limit: int | None,
) -> None:
    """A hand-written claim the namespace's rules forbid now (a class, a sharing mode),
    stored before its namespace got them or before they were tightened, is judged again
    when a new pod names it, with or without a per-pod device limit."""
    spec: dict[str, Any] = {
        "namespaces": ["ns"],
        "allowedDeviceClasses": ["gpu.nvidia.com"],
        "allowedSharing": ["Exclusive"],
    }
    if limit is not None:
        spec["maxDevicesPerPod"] = limit
    sliced = one_gpu_spec()
    sliced["devices"]["config"] = [
        {
            "opaque": {
                "driver": "gpu.nvidia.com",
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing"},
                },
            }
        }
    ]
    mig = {
        "devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "mig.nvidia.com"}}]}
    }
    claims = Claims(sliced=sliced, mig=mig, fine=one_gpu_spec())
    admission = Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        tenants=tenant_state(("team-a", spec)),
        read_claims=claims,
    )
    for name, problem in (("sliced", "TimeSlicing"), ("mig", "mig.nvidia.com")):
        pod = claim_pod(0, {"name": "a", "resourceClaimName": name})
        decision = await admission.mutate_pod(review(POD, pod))
        assert decision.result == "denied"
        message = decision.response["status"]["message"]
        assert f"pod claim a refers to ResourceClaim {name}, which its namespace's rules" in message
        assert problem in message
    fine = claim_pod(0, {"name": "a", "resourceClaimName": "fine"})
    assert (await admission.mutate_pod(review(POD, fine))).result == "allowed"


async def test_a_claim_stored_beyond_the_quota_is_not_handed_to_a_new_pod() -> None:
    """The API server counts a claim against the quota only when it is created: one stored
    before the quota (or before it was lowered) is refused to a new pod while the namespace
    is over its quota for the claim's class, or the class has none. An allocated claim holds
    its devices already: a new pod sharing it takes nothing more."""
    state = tenant_state(("team-a", {"namespaces": ["ns"], "deviceQuota": {"gpu.nvidia.com": 2}}))
    state.replace("quotas", [quota("ns", "team-a", 2, 8)])
    claims = Claims(big=one_gpu_spec(8), shared=one_gpu_spec(8))
    claims.allocated.add("shared")
    admission = Admission(
        Templates(), WebhookMetrics(CollectorRegistry()), tenants=state, read_claims=claims
    )
    decision = await admission.mutate_pod(
        review(POD, claim_pod(0, {"name": "a", "resourceClaimName": "big"}))
    )
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "pod claim a refers to ResourceClaim big, which its namespace's rules" in message
    assert "quota gpu.nvidia.com in namespace ns: " in message
    shared = claim_pod(0, {"name": "a", "resourceClaimName": "shared"})
    assert (await admission.mutate_pod(review(POD, shared))).result == "allowed"


async def test_a_stored_claim_within_the_quota_is_handed_to_a_new_pod() -> None:
    state = tenant_state(("team-a", {"namespaces": ["ns"], "deviceQuota": {"gpu.nvidia.com": 2}}))
    state.replace("quotas", [quota("ns", "team-a", 2, 2)])
    admission = Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        tenants=state,
        read_claims=Claims(two=one_gpu_spec(2)),
    )
    pod = claim_pod(0, {"name": "a", "resourceClaimName": "two"})
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"


def test_a_stored_claim_of_a_class_without_quota_is_over_it() -> None:
    rules = tenant_state(("team-a", {"namespaces": ["ns"]})).lookup("ns").rules
    assert rules is not None
    usage = QuotaUsage(hard={"gpu.nvidia.com": 0}, used={})
    why = rules.stored_claim_over_quota(StoredClaim(one_gpu_spec(1)), "ns", usage)
    assert why is not None and "deviceQuota sets no limit for this class" in why
    # Allocated already, or another class: nothing more is taken.
    assert rules.stored_claim_over_quota(StoredClaim(one_gpu_spec(1), True), "ns", usage) is None
    assert rules.stored_claim_over_quota(StoredClaim(NO_DRIVER_DEVICE), "ns", usage) is None


async def test_a_claim_named_by_many_entries_is_read_once() -> None:
    """A review may name one claim thousands of times: it is read once."""
    claims = Claims(one=one_gpu_spec())
    admission = limited_admission(claims, limit=4)
    pod = claim_pod(0, *({"name": f"e{i}", "resourceClaimName": "one"} for i in range(2000)))
    decision = await admission.mutate_pod(review(POD, pod))
    assert decision.result == "denied"  # each entry counts: 2,000 devices
    assert claims.reads == [("ResourceClaim", "one")]


async def test_a_claim_named_many_times_is_judged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Judging a stored claim again costs a validation: one per claim, not per entry (a
    pod naming one claim 3,000 times held the webhook's loop for 10 s)."""
    judged: list[object] = []
    real = ClaimJudge.judge

    def counting(self: ClaimJudge, obj: Any, **kw: Any) -> Any:
        judged.append(obj)
        return real(self, obj, **kw)

    # The judge itself, not what it calls: its memo would hide a claim judged again.
    monkeypatch.setattr(ClaimJudge, "judge", counting)
    claims = Claims(one=one_gpu_spec())
    admission = tenant_admission(claims, ("team-a", {"namespaces": ["ns"]}))
    pod = claim_pod(0, *({"name": f"e{i}", "resourceClaimName": "one"} for i in range(3000)))
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"
    assert (len(judged), claims.reads) == (1, [("ResourceClaim", "one")])


async def test_without_a_per_pod_limit_only_stored_claims_are_judged_again() -> None:
    """Where no maxDevicesPerPod counts a pod's devices, a template is not read, and a
    claim not created yet is left to its own admission (the pod waits for it, as
    `kubectl apply` of a pod before its claim does)."""
    claims = Claims(one=one_gpu_spec())
    admission = tenant_admission(claims, ("team-a", {"namespaces": ["ns"]}))
    pod = claim_pod(
        0,
        {"name": "a", "resourceClaimName": "later"},
        {"name": "b", "resourceClaimTemplateName": "tpl"},
        {"name": "c", "resourceClaimName": "one"},
    )
    assert (await admission.mutate_pod(review(POD, pod))).result == "allowed"
    assert claims.reads == [("ResourceClaim", "later"), ("ResourceClaim", "one")]


def template_object(name: str, count: int, device_class: str = "gpu.nvidia.com") -> dict[str, Any]:
    spec = one_gpu_spec(count)
    spec["devices"]["requests"][0]["exactly"]["deviceClassName"] = device_class
    return {"metadata": {"name": name}, "spec": {"spec": spec}}


async def test_a_template_a_kueue_workload_was_admitted_with_is_not_created_again() -> None:
    # Kueue charged job-a for template "train" (one GPU) when it admitted it; the tenant
    # deleted the template and creates it again asking for eight.
    claims = Claims()
    claims.admitted["train"] = ["job-a-1f2e3"]
    admission = Admission(Templates(), WebhookMetrics(CollectorRegistry()), read_claims=claims)
    decision = await admission.validate_claim(review(TEMPLATE, template_object("train", 8)))
    assert decision.result == "denied"
    assert decision.response["status"]["code"] == 403
    message = decision.response["status"]["message"]
    assert message.startswith("ResourceClaimTemplate train: Kueue Workload job-a-1f2e3 was")
    assert "once the job has finished or been deleted" in message
    # Another name, a template of another driver's devices, and a name no admitted
    # Workload uses are none of its business.
    for allowed in (
        template_object("other", 8),
        template_object("train", 8, device_class="fpga.example.com"),
    ):
        decision = await admission.validate_claim(review(TEMPLATE, allowed))
        assert decision.result == "allowed", allowed
    assert ("Workload", "train") in claims.reads
    assert ("Workload", "other") in claims.reads
    # ResourceClaims are never templates a Workload refers to.
    assert (await admission.validate_claim(review(CLAIM, claim_object("train", 8)))).result == (
        "allowed"
    )


class UnlistableWorkloads(Claims):
    async def workloads_admitted_with(self, namespace: str, template: str) -> list[str]:
        raise ApiError(503, "etcdserver: leader changed", "GET", "/apis/kueue.x-k8s.io")


async def test_workloads_that_cannot_be_listed_deny_the_template_for_a_retry() -> None:
    admission = Admission(
        Templates(), WebhookMetrics(CollectorRegistry()), read_claims=UnlistableWorkloads()
    )
    decision = await admission.validate_claim(review(TEMPLATE, template_object("train", 1)))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "could not list the namespace's Kueue Workloads" in message
    assert message.endswith("; retry")


def users_of(claim: str, count: int, *others: str) -> list[dict[str, Any]]:
    """`count` stored pods, each naming `claim` and then `others` (a name with ``{}`` in
    it is the pod's own: its index filled in)."""
    pods = []
    for u in range(count):
        entries = [{"name": "a", "resourceClaimName": claim}]
        entries += [
            {"name": f"e{i}", "resourceClaimName": other.format(u)}
            for i, other in enumerate(others)
        ]
        pod = claim_pod(0, *entries)
        pod["metadata"] = {"name": f"p{u}", "uid": f"uid-{u}"}
        pods.append(pod)
    return pods


async def test_the_pods_that_use_a_claim_read_the_claims_they_share_once() -> None:
    """A claim's creation counts every pod that names it, with the claims each names
    besides: read once per admission, not once per pod, however many pods name them."""
    others: dict[str, dict[str, Any]] = {f"o{i}": {"devices": {"requests": []}} for i in range(20)}
    claims = Claims(gpu=one_gpu_spec(), **others)
    admission = limited_admission(claims, limit=2)
    claims.live_pods = users_of("c", 100, "gpu", *others)

    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "allowed"
    assert sorted(claims.reads) == sorted([("ResourceClaim", n) for n in ["gpu", *others]])

    # The verdict is the one each pod's count gives: one device more is too many.
    claims.reads.clear()
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 2)))
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "pod p0 uses this claim: with its 2 device(s) the pod would get 3" in message
    assert len(claims.reads) == len(set(claims.reads))


class SlowApi(Claims):
    """An API server that takes `list_s` to list pods and `get_s` to answer each GET."""

    def __init__(self, list_s: float, get_s: float, **specs: dict[str, Any]) -> None:
        super().__init__(**specs)
        self.list_s, self.get_s = list_s, get_s

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None:
        await anyio.sleep(self.get_s)
        return await super().__call__(namespace, kind, name)

    async def pods(
        self, namespace: str, keep: Callable[[Mapping[str, Any]], bool]
    ) -> list[dict[str, Any]]:
        await anyio.sleep(self.list_s)
        return await super().pods(namespace, keep)


# Against a 0.5 s deadline: 80 reads of 10 ms are past it; the list (0.25 s) and 40
# reads (0.4 s) each fit it alone, with room for a loaded machine, but not together.
@pytest.mark.parametrize(
    ("list_s", "users"), [(0.0, 80), (0.25, 40)], ids=["reads", "list-and-reads"]
)
async def test_a_claims_admission_is_denied_past_one_deadline_for_all_its_reads(
    list_s: float, users: int
) -> None:
    """Each pod that uses the claim names a claim of its own, each read well within the
    deadline, and so is the list: together they are not, and the creation is denied
    as any read past its deadline is, to be retried, not allowed after as many
    deadlines as there are pods."""
    deadline = 0.5
    mine: dict[str, dict[str, Any]] = {
        f"mine-{u}": {"devices": {"requests": []}} for u in range(users)
    }
    claims = SlowApi(list_s, 0.01, **mine)
    admission = limited_admission(claims, limit=2, ensure_timeout=deadline)
    claims.live_pods = users_of("c", users, "mine-{}")

    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))

    assert decision.result == "denied"
    # The deadline passes either during a read or between two pods: both deny alike.
    message = decision.response["status"]["message"]
    assert re.fullmatch(
        r'ResourceClaim c: tenant "team-a" \(GpuTenant team-a\): maxDevicesPerPod is 2; '
        r"could not read (ResourceClaim mine-\d+|what pod p\d+ names) to count its devices: "
        r"no answer in time; retry",
        message,
    ), message
    assert len(claims.reads) < users

    # Read at once, with time to spare, the same pods are counted and the claim allowed:
    # what denied it was the time its reads took together, not what they read.
    quick = Claims(**mine)
    quick.live_pods = claims.live_pods
    fast = limited_admission(quick, limit=2, ensure_timeout=30)
    assert (await fast.validate_claim(review(CLAIM, claim_object("c", 1)))).result == "allowed"


async def test_a_claim_named_by_more_pods_than_kubernetes_can_reserve_it_for_is_denied() -> None:
    """Past `MAX_CLAIM_USERS` pods, a claim's creation counts none of them: denied,
    saying how many pods name it, the most counted and what to do, without a read."""
    claims = Claims(gpu=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    claims.live_pods = users_of("c", MAX_CLAIM_USERS, "gpu")
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "allowed"

    claims.reads.clear()
    claims.live_pods = users_of("c", MAX_CLAIM_USERS + 1, "gpu")
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "denied"
    assert decision.response["status"]["message"] == (
        'ResourceClaim c: tenant "team-a" (GpuTenant team-a): maxDevicesPerPod is 2, and '
        "257 pods use this claim, more than the 256 its creation counts devices for "
        "(Kubernetes reserves a claim for at most 256 pods at a time); delete pods that "
        "name it until no more than 256 do, or give each pod its own claim from a "
        "ResourceClaimTemplate, then create it again"
    )
    assert claims.reads == []


async def test_a_claim_whose_pods_hold_more_json_than_its_creation_reads_is_denied() -> None:
    """The pods that name a claim are kept as their JSON while the list goes by, within
    `MAX_CLAIM_USERS_BYTES` (a parsed pod can take 14 times its JSON): past it, denied,
    without a read."""
    claims = Claims(gpu=one_gpu_spec())
    admission = limited_admission(claims, limit=2)
    pods = users_of("c", 3, "gpu")
    for pod in pods:
        pod["metadata"]["annotations"] = {"pad": "x" * (MAX_CLAIM_USERS_BYTES // 3 + 1)}
    claims.live_pods = pods[:2]
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "allowed"

    claims.reads.clear()
    claims.live_pods = pods
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "denied"
    assert decision.response["status"]["message"] == (
        'ResourceClaim c: tenant "team-a" (GpuTenant team-a): maxDevicesPerPod is 2, and '
        "the 3 pods that use this claim hold more than 32 MiB of JSON, more than its "
        "creation reads to count their devices; make those pods smaller (or fewer), then "
        "create the claim again"
    )
    assert claims.reads == []


class BusyApi(Claims):
    """An API whose answer to each GET holds the event loop `busy_s`, as parsing a pod's
    thousands of entries does: no await, so no read is cancelled at its deadline."""

    def __init__(self, busy_s: float, **specs: dict[str, Any]) -> None:
        super().__init__(**specs)
        self.busy_s = busy_s

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None:
        time.sleep(self.busy_s)  # noqa: ASYNC251 - the loop held, as by work
        return await super().__call__(namespace, kind, name)


async def test_pods_left_to_count_past_the_deadline_deny_the_claim() -> None:
    """What is read once is not read again, so the pods after it cost only their
    entries; the deadline holds for them as for reads."""
    claims = BusyApi(0.75, shared={"devices": {"requests": []}})
    admission = limited_admission(claims, limit=2, ensure_timeout=0.5)
    claims.live_pods = users_of("c", 3, "shared")
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "denied"
    assert decision.response["status"]["message"] == (
        'ResourceClaim c: tenant "team-a" (GpuTenant team-a): maxDevicesPerPod is 2; could '
        "not read what pod p1 names to count its devices: no answer in time; retry"
    )
    assert claims.reads == [("ResourceClaim", "shared")]
