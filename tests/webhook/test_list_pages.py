"""What the webhook holds of a namespace-wide list is bounded whatever a tenant stores:
a page is read within a byte bound (smaller pages where it is over), an object over
it alone fails the list, and only so many pages of all namespaces' lists are read at a
time. A page that is not a list of objects fails the list rather than ending it."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from aiohttp import web
from gpudra.webhook.lists import PAGE_BYTES, PAGES_AT_ONCE, ListError, SharedLists

from tests.common.loopback import kube_serving
from tests.webhook.lists_api import ListsApi, api_server, claim_review, lists_admission
from tests.webhook.test_pod_listing import PODS, idle_pod, user_of

pytestmark = pytest.mark.anyio

BOUND = 10_000


def padded(index: int, size: int) -> dict[str, Any]:
    """A pending pod of about `size` bytes of JSON: a tenant decides how large."""
    pod = idle_pod(index)
    pod["metadata"]["annotations"] = {"pad": "x" * size}
    return pod


def everything(_: Any) -> bool:
    return True


def names(pods: list[Any]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


async def test_a_page_over_the_bound_is_read_again_in_smaller_pages() -> None:
    """Pods 10 and 11 are 0.7 of the bound each: the first page of 16 is over it and is
    read again from the start with 4; the third page of 4 (two of them) is over it and
    is read again from its continue token with 1, the pages after it too. The list is
    every pod, in order, each once."""
    pods = [idle_pod(i) for i in range(10)]
    pods += [padded(i, 7_000) for i in (10, 11)]
    pods += [idle_pod(i) for i in range(12, 22)]
    api = ListsApi({PODS: pods})

    async with api_server(api) as kube:
        found = await SharedLists(kube, per_page=16, page_bytes=BOUND).read(PODS, everything)

    assert names(found) == names(pods)
    shape = [(q["limit"], q.get("continue")) for q in api.queries]
    assert shape[:5] == [("16", None), ("4", None), ("4", "2:4"), ("4", "2:8"), ("1", "2:8")]
    assert shape[5:] == [("1", f"2:{at}") for at in range(9, 22)]


async def test_an_object_over_the_bound_alone_fails_the_list_naming_it() -> None:
    """One pod is over the bound on its own: no page holds it, and the list fails
    saying whose objects are too large and what to do, not ending short of it."""
    pods = [idle_pod(0), padded(1, BOUND), idle_pod(2)]
    api = ListsApi({PODS: pods})

    async with api_server(api) as kube:
        with pytest.raises(ListError) as err:
            await SharedLists(kube, per_page=8, page_bytes=BOUND).read(PODS, everything)

    assert [q["limit"] for q in api.queries] == ["8", "2", "1", "1"]
    message = str(err.value)
    assert message.startswith(
        f"an object of the pods of namespace ns is over the {BOUND} bytes the webhook "
        "reads at a time (page 2 of their list is at least "
    )
    assert message.endswith("the namespace's objects are too large to count; delete or shrink them")


async def test_a_claim_whose_pods_are_too_large_to_list_is_denied() -> None:
    """A tenant stores a pod over `PAGE_BYTES` that names claim c, then creates c under
    a per-pod device limit: its pods cannot be counted, so c is refused, saying why."""
    api = ListsApi({PODS: [padded(0, PAGE_BYTES), user_of("c", "waiting")]})

    async with api_server(api) as kube:
        decision = await lists_admission(kube, limit=1).validate_claim(claim_review("c"))

    assert decision.result == "denied"
    message = decision.response["status"]["message"]
    assert "could not list the pods that use this claim" in message
    assert "pods of namespace ns is over" in message
    assert "delete or shrink them" in message


async def test_the_pages_of_all_namespaces_lists_are_read_a_few_at_a_time() -> None:
    """Eight namespaces' pods are listed at once, a page each at a time: no more than
    `PAGES_AT_ONCE` pages are read at a time, and every list is whole."""
    paths = [f"/api/v1/namespaces/ns{i}/pods" for i in range(8)]
    api = ListsApi({path: [idle_pod(i) for i in range(5)] for path in paths})
    lists = SharedLists(api, per_page=2)  # type: ignore[arg-type]
    found: dict[str, list[str]] = {}

    async def read(path: str) -> None:
        found[path] = names(await lists.read(path, everything))

    async with anyio.create_task_group() as group:
        for path in paths:
            group.start_soon(read, path)

    assert api.most_in_flight == PAGES_AT_ONCE
    assert found == {path: [f"idle-{i}" for i in range(5)] for path in paths}


@pytest.mark.parametrize(
    ("body", "what"),
    [
        (b"null", "the answer is a NoneType, not an object"),
        (b"[]", "the answer is a list, not an object"),
        (b'{"items": {}}', "its items are a dict, not a list"),
        (b'{"items": [1]}', "one of its items is not an object"),
        (b'{"items": [], "metadata": {"continue": 5}}', "its continue token is a int"),
    ],
)
async def test_a_page_that_is_not_a_list_of_objects_fails_the_list(body: bytes, what: str) -> None:
    """An answer the API server would not send is not taken for the list's end: the
    pages after it would be left uncounted."""

    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async with kube_serving(answer) as kube:
        with pytest.raises(ListError) as err:
            await SharedLists(kube).read(PODS, everything)

    assert str(err.value).startswith(
        f"page 1 of the list of pods of namespace ns is not a list the API server sends: {what}"
    )


async def test_a_list_without_items_is_an_empty_list() -> None:
    """An empty list's items may be left out (or null): that list is whole, and empty."""

    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=json.dumps({"metadata": {}}).encode())

    async with kube_serving(answer) as kube:
        assert await SharedLists(kube).read(PODS, everything) == []
