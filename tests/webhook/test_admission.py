"""The admission endpoints called directly: decisions need no HTTP server."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from gpudra.webhook.admission import MUTATE_PATH, VALIDATE_CLAIMS_PATH, Admission
from gpudra.webhook.convert import convert_pod
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.reviews import ReviewError
from prometheus_client import CollectorRegistry

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
    with pytest.raises(ReviewError, match=r"request\.object and request\.namespace"):
        await endpoints[VALIDATE_CLAIMS_PATH](review(CLAIM, None))
    with pytest.raises(ReviewError, match="unsupported resource kind"):
        await endpoints[VALIDATE_CLAIMS_PATH](review(POD, GPU_POD))


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
