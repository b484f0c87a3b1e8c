"""Which Kueue Workloads keep a ResourceClaimTemplate from being created again.

Kueue counts a Workload's templates when it queues it and does not read them again
before admission; it watches no template. So a template replaced while its Workload waits
for quota is admitted at the count of the one it replaced, as one replaced after
admission is (e2e/tests/test_kueue.py shows both with the pinned Kueue). The Workloads
here are shaped as Kueue v0.19.2 writes them, served by a fake API server to the webhook's
own reader.
"""

from __future__ import annotations

from typing import Any

import pytest
from gpudra.webhook.templates import KUEUE_VERSIONS, ApiClaimReader

from tests.webhook.lists_api import ListsApi, lists_admission, template_review

pytestmark = pytest.mark.anyio

WORKLOADS = f"/apis/{KUEUE_VERSIONS[0]}/namespaces/ns/workloads"

QUEUED_FOR_QUOTA = {
    "type": "QuotaReserved",
    "status": "False",
    "reason": "Pending",
    "message": "couldn't assign flavors to pod set main: insufficient unused quota for "
    "nvidia.com/gpu in flavor gpu-default, 1 more needed",
}
TEMPLATE_MISSING = {
    "type": "QuotaReserved",
    "status": "False",
    "reason": "Inadmissible",
    "message": "failed to get claim spec for ResourceClaimTemplate t in podset main: "
    'resourceclaimtemplates.resource.k8s.io "t" not found',
}
ADMITTED = [
    {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
    {"type": "Admitted", "status": "True", "reason": "Admitted"},
]
FINISHED = {"type": "Finished", "status": "True", "reason": "Succeeded"}
COUNTED = [{"name": "main", "resources": {"nvidia.com/gpu": "1"}}]
USAGE = {
    "clusterQueue": "gpus",
    "podSetAssignments": [
        {"name": "main", "count": 1, "resourceUsage": {"nvidia.com/gpu": "1"}},
    ],
}


def workload(name: str, status: dict[str, Any], *, active: bool = True) -> dict[str, Any]:
    """A Workload of one pod set whose pods use template ``t``."""
    spec = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}
    return {
        "metadata": {"name": name},
        "spec": {
            "active": active,
            "queueName": "gpus",
            "podSets": [{"name": "main", "count": 1, "template": {"spec": spec}}],
        },
        "status": status,
    }


async def holding(*workloads: dict[str, Any]) -> list[str]:
    reader = ApiClaimReader(ListsApi({WORKLOADS: list(workloads)}))  # type: ignore[arg-type]
    return await reader.workloads_admitted_with("ns", "t")


async def test_a_waiting_workload_kueue_counted_holds_its_template() -> None:
    """Kueue's scheduler tried it, found no quota and wrote what it counted: it will be
    admitted at that count, whatever the template says by then."""
    waiting = workload("waits", {"conditions": [QUEUED_FOR_QUOTA], "resourceRequests": COUNTED})
    assert await holding(waiting) == ["waits"]


async def test_admitted_workloads_hold_their_template_until_finished() -> None:
    admitted = workload("runs", {"conditions": ADMITTED, "admission": USAGE})
    done = workload("done", {"conditions": [*ADMITTED, FINISHED], "admission": USAGE})
    assert await holding(admitted, done) == ["runs"]


async def test_workloads_kueue_has_not_counted_or_will_read_again_do_not_hold_it() -> None:
    """A Job created before its template: Kueue could not read it, counted nothing, and
    reads it again on its retry, so the template may be created after the Job. A
    deactivated Workload is read again when reactivated; one Kueue has not looked at
    has no status yet."""
    missing = workload("before-template", {"conditions": [TEMPLATE_MISSING]})
    deactivated = workload(
        "off", {"conditions": [QUEUED_FOR_QUOTA], "resourceRequests": COUNTED}, active=False
    )
    fresh = workload("new", {})
    assert await holding(missing, deactivated, fresh) == []


async def test_a_template_a_waiting_workload_was_counted_with_is_refused_naming_it() -> None:
    waiting = workload("waits", {"conditions": [QUEUED_FOR_QUOTA], "resourceRequests": COUNTED})
    api = ListsApi({WORKLOADS: [waiting]})
    admission = lists_admission(api)

    decision = await admission.validate_claim(template_review("t"))

    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "Kueue Workload waits was admitted or counted for admission" in message
    assert "Create it before the job, under another name" in message
