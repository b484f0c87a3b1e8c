"""The pod list a claim's creation reads under maxDevicesPerPod, against a fake API server.

A tenant controls its pods and its claims: many cheap pending pods, then many claims
created at once, must not make each claim's admission list (and the webhook parse) the
whole namespace. Claims created together share lists, a list is read in pages, and a
list already under way is never handed to a claim that a pod stored meanwhile would use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import pytest
from gpudra.webhook.admission import Admission
from gpudra.webhook.lists import PER_PAGE
from gpudra.webhook.templates import ApiClaimReader

from tests.webhook.lists_api import (
    ListsApi,
    assert_a_list_under_way_is_not_handed_on,
    assert_each_denied_for_the_failed_page,
    claim_review,
    create_together,
    created_together_over_two_paged_lists,
    lists_admission,
)
from tests.webhook.test_admission import claim_pod

pytestmark = pytest.mark.anyio

PODS = "/api/v1/namespaces/ns/pods"


def idle_pod(index: int) -> dict[str, Any]:
    """A pending pod that uses no claim: what a tenant makes by the thousand."""
    return {
        "metadata": {"name": f"idle-{index}", "uid": f"uid-idle-{index}"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Pending"},
    }


def user_of(claim: str, name: str) -> dict[str, Any]:
    """A waiting pod with nvidia.com/gpu: 1 that names `claim`: under a limit of one, a
    claim of one GPU created under that name would give it two."""
    pod = claim_pod(1, {"name": "a", "resourceClaimName": claim})
    pod["metadata"] = {"name": name, "uid": f"uid-{name}"}
    pod["status"] = {"phase": "Pending"}
    return pod


class PodsApi(ListsApi):
    """The API server's pod list (`ListsApi`): the field selector on the phase, and
    ``limit``/``continue`` pages served from the snapshot the first page took."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        super().__init__({PODS: pods})
        self.pods = pods


def admission_over(api: PodsApi, **reader: Any) -> Admission:
    """The claim endpoint of a namespace whose tenant allows one device per pod, reading
    pods through the webhook's own API reader."""
    return lists_admission(api, limit=1, **reader)


async def test_claims_created_together_share_two_paged_pod_lists() -> None:
    """Twenty claims created while the first one's list is under way: the first gets
    that list, the nineteen others one list begun after they all arrived, not one each.
    Each list is read in pages of `PER_PAGE`, the last page read too: the pod on
    it that names c7 refuses c7, and only c7."""
    pods = [idle_pod(i) for i in range(2 * PER_PAGE + 49)] + [user_of("c7", "waiting")]
    pods.append({**idle_pod(999), "status": {"phase": "Succeeded"}})
    api = PodsApi(pods)
    admission = admission_over(api)
    names = [f"c{i}" for i in range(20)]

    message = await created_together_over_two_paged_lists(admission, api, claim_review, names, "c7")

    assert (api.lists, api.pages) == (2, 2 * 3)  # no list of anything but the pods
    for query in api.queries:
        assert query["limit"] == str(PER_PAGE)
        assert query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"
        assert "resourceVersion" not in query  # a consistent read, not the watch cache's
    assert "maxDevicesPerPod is 1, and pod waiting uses this claim" in message
    assert "would get 2 devices" in message


async def test_a_list_under_way_is_not_handed_to_a_claim_a_pod_stored_since_would_use() -> None:
    """Claim `other`'s list has read the namespace; before its answer arrives the tenant
    stores a pod naming x (x held no GPU then), deletes x and creates it again with one.
    Had x's admission shared `other`'s list it would not have seen the pod and let x
    give it two devices; it gets a list of its own, begun after it arrived, and is
    refused."""
    api = PodsApi([idle_pod(i) for i in range(5)])
    admission = admission_over(api, per_page=2)

    await assert_a_list_under_way_is_not_handed_on(
        admission, api, claim_review, user_of("x", "waiting"), "pod waiting uses this claim"
    )
    assert api.lists == 2


async def test_a_page_that_fails_denies_every_claim_that_shared_the_list() -> None:
    """The second page answers 410 (the continue token expired): the pods of the pages
    not read cannot be counted, and a list restarted from the expired token would not
    be one snapshot, so each claim sharing the list is refused, to be retried, with the
    page and the API server's words."""
    api = PodsApi([idle_pod(i) for i in range(7)])
    api.fail_page = 2
    admission = admission_over(api, per_page=3)

    decisions = await create_together(admission, claim_review, "abc")

    assert api.lists <= 2
    assert_each_denied_for_the_failed_page(
        api, decisions, "maxDevicesPerPod is 1; could not list the pods that use this claim", "pods"
    )


async def test_a_reader_whose_lists_leader_gave_up_lists_again_itself() -> None:
    """Reads a and c wait for the list under way (z's); a leads the next one, which c
    joined. a's admission runs out of time while its list is read: c is not failed for
    it, but lists again, from its own start, and gets the pods its filter keeps."""
    api = PodsApi([idle_pod(i) for i in range(4)] + [user_of("x", "waiting")])
    api.held[1] = anyio.Event()
    api.held[2] = anyio.Event()
    reader = ApiClaimReader(api, per_page=2)  # type: ignore[arg-type]
    got: dict[str, list[str]] = {}

    def names_a_claim(pod: Mapping[str, Any]) -> bool:
        return bool(pod.get("spec", {}).get("resourceClaims"))

    async def read(who: str) -> None:
        found = await reader.pods("ns", names_a_claim)
        got[who] = [p["metadata"]["name"] for p in found]

    gives_up = anyio.CancelScope()

    async def read_until_cancelled() -> None:
        with gives_up:
            await read("a")

    async with anyio.create_task_group() as group:
        group.start_soon(read, "z")
        await anyio.wait_all_tasks_blocked()
        group.start_soon(read_until_cancelled)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(read, "c")
        await anyio.wait_all_tasks_blocked()
        assert api.lists == 1
        api.held[1].set()
        await anyio.wait_all_tasks_blocked()
        assert api.lists == 2  # a's, shared with c, its first page held
        gives_up.cancel()

    assert api.lists == 3
    assert got == {"z": ["waiting"], "c": ["waiting"]}
    # Nothing of those lists is left behind: the next read lists once, at once.
    await read("later")
    assert (api.lists, got["later"]) == (4, ["waiting"])
