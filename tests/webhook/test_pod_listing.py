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
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.templates import ApiClaimReader
from prometheus_client import CollectorRegistry

from tests.webhook.lists_api import ListsApi
from tests.webhook.test_admission import (
    CLAIM,
    Claims,
    Templates,
    claim_object,
    claim_pod,
    limited_admission,
    review,
)

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
    tenants = limited_admission(Claims())._tenants
    return Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        tenants=tenants,
        read_claims=ApiClaimReader(api, **reader),  # type: ignore[arg-type]
    )


async def create_together(admission: Admission, names: list[str]) -> dict[str, Any]:
    """Create one-GPU claims under `names` at once: the decision of each, by name."""
    decisions: dict[str, Any] = {}

    async def create(name: str) -> None:
        decisions[name] = await admission.validate_claim(review(CLAIM, claim_object(name, 1)))

    async with anyio.create_task_group() as group:
        for name in names:
            group.start_soon(create, name)
    return decisions


async def test_claims_created_together_share_two_paged_pod_lists() -> None:
    """Twenty claims created while the first one's list is under way: the first gets
    that list, the nineteen others one list begun after they all arrived, not one each.
    Each list is read in pages of `PER_PAGE`, the last page read too: the pod on
    it that names c7 refuses c7, and only c7."""
    pods = [idle_pod(i) for i in range(2 * PER_PAGE + 49)] + [user_of("c7", "waiting")]
    pods.append({**idle_pod(999), "status": {"phase": "Succeeded"}})
    api = PodsApi(pods)
    api.held[1] = anyio.Event()
    admission = admission_over(api)
    names = [f"c{i}" for i in range(20)]

    async with anyio.create_task_group() as group:

        async def release() -> None:
            await anyio.wait_all_tasks_blocked()
            api.held[1].set()

        group.start_soon(release)
        decisions = await create_together(admission, names)

    assert api.lists == 2
    assert api.pages == 2 * 3
    assert api.largest_page == PER_PAGE
    for query in api.queries:
        assert query["limit"] == str(PER_PAGE)
        assert query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"
        assert "resourceVersion" not in query  # a consistent read, not the watch cache's
    denied = {name for name, d in decisions.items() if d.result == "denied"}
    assert denied == {"c7"}
    message = decisions["c7"].response["status"]["message"]
    assert "maxDevicesPerPod is 1, and pod waiting uses this claim" in message
    assert "would get 2 devices" in message


async def test_a_list_under_way_is_not_handed_to_a_claim_a_pod_stored_since_would_use() -> None:
    """Claim `other`'s list has read the namespace; before its answer arrives the tenant
    stores a pod naming x (x held no GPU then), deletes x and creates it again with one.
    Had x's admission shared `other`'s list it would not have seen the pod and let x
    give it two devices; it gets a list of its own, begun after it arrived, and is
    refused."""
    api = PodsApi([idle_pod(i) for i in range(5)])
    api.held[1] = anyio.Event()
    admission = admission_over(api, per_page=2)
    decisions: dict[str, Any] = {}

    async def create(name: str) -> None:
        decisions[name] = await admission.validate_claim(review(CLAIM, claim_object(name, 1)))

    async with anyio.create_task_group() as group:
        group.start_soon(create, "other")
        await anyio.wait_all_tasks_blocked()
        assert api.lists == 1  # read, its answer held
        api.pods.append(user_of("x", "waiting"))
        group.start_soon(create, "x")
        await anyio.wait_all_tasks_blocked()
        api.held[1].set()

    assert decisions["other"].result == "allowed"
    assert decisions["x"].result == "denied"
    assert "pod waiting uses this claim" in decisions["x"].response["status"]["message"]
    assert api.lists == 2


async def test_a_page_that_fails_denies_every_claim_that_shared_the_list() -> None:
    """The second page answers 410 (the continue token expired): the pods of the pages
    not read cannot be counted, and a list restarted from the expired token would not
    be one snapshot, so each claim sharing the list is refused, to be retried, with the
    page and the API server's words."""
    api = PodsApi([idle_pod(i) for i in range(7)])
    api.fail_page = 2
    admission = admission_over(api, per_page=3)

    decisions = await create_together(admission, ["a", "b", "c"])

    assert api.lists <= 2
    for decision in decisions.values():
        assert decision.result == "denied"
        message = decision.response["status"]["message"]
        assert "maxDevicesPerPod is 1; could not list the pods that use this claim" in message
        assert "HTTP 410" in message
        assert "page 2 of the list of pods of namespace ns" in message
        assert message.endswith("; retry")


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
