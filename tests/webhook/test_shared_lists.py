"""The claim and Kueue Workload lists admissions read, against a fake API server.

A tenant controls how many claims and Workloads its namespace holds, and how often the
admissions that list them come: a claim created under maxDevicesPerPod lists the
namespace's claims once for all the pods that use it, a template created lists its
Workloads.
As for pods (test_pod_listing.py), admissions made together share lists, a list is read
in pages, a failed page denies every admission that shared it, and a list already under
way is never handed to an admission an object stored meanwhile would decide.
"""

from __future__ import annotations

from typing import Any

import pytest
from gpudra.common.kube import RESOURCE_API
from gpudra.webhook.admission import Admission
from gpudra.webhook.lists import PER_PAGE
from gpudra.webhook.templates import KUEUE_VERSIONS

from tests.webhook.lists_api import (
    ListsApi,
    assert_a_list_under_way_is_not_handed_on,
    assert_each_denied_for_the_failed_page,
    claim_review,
    create_together,
    created_together_over_two_paged_lists,
    lists_admission,
    template_review,
)
from tests.webhook.test_admission import (
    CLAIM,
    NO_DRIVER_DEVICE,
    claim_object,
    claim_pod,
    review,
    template_object,
)

pytestmark = pytest.mark.anyio

PODS = "/api/v1/namespaces/ns/pods"
CLAIMS = f"{RESOURCE_API}/namespaces/ns/resourceclaims"
TEMPLATES = f"{RESOURCE_API}/namespaces/ns/resourceclaimtemplates"
WORKLOADS = {version: f"/apis/{version}/namespaces/ns/workloads" for version in KUEUE_VERSIONS}
NEWEST, OLDER = (WORKLOADS[version] for version in KUEUE_VERSIONS)


def user_pod(claim: str) -> dict[str, Any]:
    """A waiting pod naming `claim` and template entry ``t`` (template tpl), for which
    its status names no claim yet: the claim's admission lists the claims made for it."""
    pod = claim_pod(
        0,
        {"name": "a", "resourceClaimName": claim},
        {"name": "t", "resourceClaimTemplateName": "tpl"},
    )
    pod["metadata"] = {"name": f"user-{claim}", "uid": f"uid-{claim}"}
    pod["status"] = {"phase": "Pending"}
    return pod


def made_claim(name: str, pod_uid: str, count: int) -> dict[str, Any]:
    """A claim the resourceclaim controller made for entry ``t`` of the pod `pod_uid`."""
    return claim_object(
        name,
        count,
        annotations={"resource.kubernetes.io/pod-claim-name": "t"},
        ownerReferences=[
            {"apiVersion": "v1", "kind": "Pod", "name": "x", "uid": pod_uid, "controller": True}
        ],
    )


def claims_admission(api: ListsApi, **reader: Any) -> Admission:
    """The claim endpoint of namespace ns, whose tenant allows two devices per pod,
    reading through the webhook's own API reader."""
    return lists_admission(api, limit=2, **reader)


def claims_api(claims: list[dict[str, Any]], users: list[str], template: Any = None) -> ListsApi:
    """The namespace's claims (their lists held), pods using the claims `users`, and
    template tpl (one GPU unless `template` is its spec)."""
    tpl = {"metadata": {"name": "tpl"}, "spec": {"spec": template}}
    return ListsApi(
        {
            PODS: [user_pod(name) for name in users],
            CLAIMS: claims,
            TEMPLATES: [tpl if template is not None else template_object("tpl", 1)],
        },
        held_path=CLAIMS,
    )


def idle_claims(count: int) -> list[dict[str, Any]]:
    """Claims no waiting pod controls: other pods' and the tenant's own."""
    return [
        made_claim(f"idle-{i}", f"gone-{i}", 1) if i % 2 else claim_object(f"own-{i}", 1)
        for i in range(count)
    ]


async def test_claims_created_together_share_two_paged_claim_lists() -> None:
    """Twenty claims, each used by a pod whose template entry has a claim made for it
    that its status does not name yet, created while the first one's claim list is
    under way: the nineteen others share one list begun after they all arrived. Each
    is read in pages of `PER_PAGE`, the last page too: the claim made there for c7's
    pod (two GPUs) refuses c7, and only c7."""
    claims = [*idle_claims(2 * PER_PAGE + 49), made_claim("user-c7-t-abcde", "uid-c7", 2)]
    names = [f"c{i}" for i in range(20)]
    api = claims_api(claims, names)
    admission = claims_admission(api)

    message = await created_together_over_two_paged_lists(admission, api, claim_review, names, "c7")

    assert "ResourceClaim user-c7-t-abcde (generated from ResourceClaimTemplate tpl)" in message
    assert "would get 3 devices" in message


async def test_a_claim_list_under_way_is_not_handed_to_a_claim_a_claim_made_since_counts() -> None:
    """Claim `other`'s admission has listed the namespace's claims; before the answer
    arrives the controller stores the claim it made (two GPUs) for entry t of the pod
    that names x, whose template now asks for none of the driver's devices. Had x's
    admission shared `other`'s list it would have counted the template and let x add a
    GPU to the pod's two; it gets a list begun after it arrived, and is refused."""
    api = claims_api(idle_claims(5), ["other", "x"], template=NO_DRIVER_DEVICE)
    admission = claims_admission(api, per_page=2)

    await assert_a_list_under_way_is_not_handed_on(
        admission,
        api,
        claim_review,
        made_claim("user-x-t-abcde", "uid-x", 2),
        "would get 3 devices",
    )


async def test_a_claim_list_page_that_fails_denies_every_claim_that_shared_it() -> None:
    """The second page of the claim list answers 410 (its continue token expired): the
    claims made for the pods could be on the pages not read, so each claim whose
    admission shared the list is refused, to be retried, with the page and the API
    server's words."""
    api = claims_api(idle_claims(7), ["a", "b", "c"])
    api.fail_page = 2
    admission = claims_admission(api, per_page=3)

    decisions = await create_together(admission, claim_review, "abc")

    assert api.lists_of[CLAIMS] <= 2
    assert_each_denied_for_the_failed_page(
        api,
        decisions,
        "could not list the claims made for the pod to count its devices",
        "resourceclaims (resource.k8s.io/v1)",
    )


def users_of(claim: str, count: int) -> list[dict[str, Any]]:
    """`count` waiting pods naming `claim`, user-0 (UID uid-0) on, each with template
    entry ``t`` its status names no claim for (`user_pod`)."""
    pods = [user_pod(claim) for _ in range(count)]
    for i, pod in enumerate(pods):
        pod["metadata"] = {"name": f"user-{i}", "uid": f"uid-{i}"}
    return pods


async def test_a_claim_used_by_many_pods_lists_the_claims_made_for_them_once() -> None:
    """Claim c is used by twenty pods, none of whose statuses names the claim made for
    its entry t: one list of the namespace's claims answers for all of them, a tenant
    deciding how many pods use a claim. The claims made for them still count, each for
    its own pod: on the last page, the one made for user-19 (two GPUs) with c's GPU
    exceeds two devices, and the one made for user-4 (one GPU) does not; without the
    former, c is admitted, again with one list."""
    claims = [
        *idle_claims(2 * PER_PAGE + 49),
        made_claim("user-4-t-abcde", "uid-4", 1),
        made_claim("user-19-t-abcde", "uid-19", 2),
    ]
    api = claims_api(claims, [])
    api.objects[PODS] = users_of("c", 20)
    admission = claims_admission(api)

    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))

    assert api.lists_of == {PODS: 1, CLAIMS: 1}
    assert api.pages_of[CLAIMS] == 3
    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "pod user-19 uses this claim" in message
    assert "ResourceClaim user-19-t-abcde (generated from ResourceClaimTemplate tpl)" in message
    assert "would get 3 devices" in message

    api.objects[CLAIMS].pop()
    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))
    assert decision.result == "allowed"
    assert api.lists_of == {PODS: 2, CLAIMS: 2}


async def test_a_claim_whose_pods_statuses_name_their_claims_lists_no_claims() -> None:
    """Each pod using claim c has its status name the claim made for entry t, which
    counts (the one made for user-3 has two GPUs): no pod needs the claims made for
    it, so the namespace's claims are not listed."""
    pods = users_of("c", 5)
    for i, pod in enumerate(pods):
        pod["status"]["resourceClaimStatuses"] = [{"name": "t", "resourceClaimName": f"m-{i}"}]
    made = [made_claim(f"m-{i}", f"uid-{i}", 2 if i == 3 else 1) for i in range(5)]
    api = claims_api([*idle_claims(9), *made], [])
    api.objects[PODS] = pods
    admission = claims_admission(api)

    decision = await admission.validate_claim(review(CLAIM, claim_object("c", 1)))

    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "pod user-3 uses this claim" in message
    assert "ResourceClaim m-3 (generated from ResourceClaimTemplate tpl)" in message
    assert api.lists_of == {PODS: 1}


def workload(name: str, template: str, *, admitted: bool = True) -> dict[str, Any]:
    """A Kueue Workload whose pods use ResourceClaimTemplate `template`."""
    spec = {"resourceClaims": [{"name": "g", "resourceClaimTemplateName": template}]}
    status = {"admission": {"clusterQueue": "q"}} if admitted else {}
    return {
        "metadata": {"name": name},
        "spec": {"podSets": [{"name": "main", "count": 1, "template": {"spec": spec}}]},
        "status": status,
    }


def idle_workloads(count: int) -> list[dict[str, Any]]:
    """Workloads of other templates, and one of t3 that was not admitted."""
    return [workload(f"idle-{i}", f"other-{i}") for i in range(count - 1)] + [
        workload("pending", "t3", admitted=False)
    ]


def templates_admission(api: ListsApi, **reader: Any) -> Admission:
    """The template endpoint of namespace ns, no tenant governing it, reading the
    Workloads through the webhook's own API reader."""
    return lists_admission(api, **reader)


async def test_templates_created_together_share_two_paged_workload_lists() -> None:
    """Twenty templates created while the first one's Workload list is under way: the
    nineteen others share one list begun after they all arrived, read in pages of
    `PER_PAGE`, the last page too: the Workload admitted there with t7 refuses t7, and
    only t7 (t3's Workload is not admitted)."""
    api = ListsApi({NEWEST: [*idle_workloads(2 * PER_PAGE + 49), workload("job-7", "t7")]})
    admission = templates_admission(api)
    names = [f"t{i}" for i in range(20)]

    message = await created_together_over_two_paged_lists(
        admission, api, template_review, names, "t7"
    )

    assert api.lists_of == {NEWEST: 2}
    assert "Kueue Workload job-7 was admitted" in message


async def test_workload_lists_fall_back_to_the_older_kueue_version_together() -> None:
    """Only the older Kueue version is served: the newest's list answers 404 on its first
    page, and every template that shared it lists the older one instead, sharing that
    too; the Workload admitted with t7 there refuses t7."""
    api = ListsApi({OLDER: [*idle_workloads(9), workload("job-7", "t7")]})
    admission = templates_admission(api, per_page=4)
    names = [f"t{i}" for i in range(10)]

    decisions = await create_together(admission, template_review, names)

    assert api.lists_of[OLDER] <= 2
    assert {name for name, d in decisions.items() if d.result == "denied"} == {"t7"}


@pytest.mark.parametrize("status", [410, 404])
async def test_a_workload_list_page_that_fails_denies_every_template_that_shared_it(
    status: int,
) -> None:
    """A later page of the newest version's list fails, a 404 too (the namespace went
    away meanwhile, or Kueue was removed): that version is served, so the older one is
    not listed instead; the Workloads of the pages not read could hold a template's
    name, so each template that shared the list is refused, to be retried."""
    every = idle_workloads(7)
    api = ListsApi({NEWEST: every, OLDER: every})
    api.fail_page = 2
    api.fail_status = status
    admission = templates_admission(api, per_page=3)

    decisions = await create_together(admission, template_review, "abc")

    assert OLDER not in api.lists_of
    assert api.lists_of[NEWEST] <= 2
    assert_each_denied_for_the_failed_page(
        api,
        decisions,
        "could not list the namespace's Kueue Workloads",
        f"workloads ({KUEUE_VERSIONS[0]})",
    )


async def test_a_workload_list_under_way_is_not_handed_to_a_template_admitted_since() -> None:
    """Template `other`'s admission has listed the Workloads; before the answer
    arrives Kueue admits a Workload whose pods use template x. Had x's admission shared
    `other`'s list it would have let x be created after admission, uncharged; it gets a
    list begun after it arrived, and is refused."""
    api = ListsApi({NEWEST: idle_workloads(5)})
    admission = templates_admission(api, per_page=2)

    await assert_a_list_under_way_is_not_handed_on(
        admission, api, template_review, workload("job-x", "x"), "Kueue Workload job-x was admitted"
    )
