"""A fake API server for the namespace-wide lists the webhook reads, as `Kube.request`
answers them: ``limit``/``continue`` pages served from the snapshot the first page
took, the pod phase field selector, an object read by name, and 404 for a collection it
does not serve (a Kueue API version that is not installed).

`held` holds the answer to the first page of the lists of `held_path` (the first
collection unless named) it numbers (1 for the first), once its snapshot is taken,
until the test sets the event; `fail_page` answers that page of every list with
`fail_status`, the API server's 410 for an expired continue token unless set.
`api_server` serves it over HTTP, to the webhook's own API client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
from aiohttp import web
from gpudra.common.kube import ApiError, Kube
from gpudra.webhook.admission import Admission
from gpudra.webhook.lists import PER_PAGE
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.templates import ApiClaimReader
from prometheus_client import CollectorRegistry

from tests.common.loopback import kube_serving
from tests.webhook.test_admission import (
    CLAIM,
    TEMPLATE,
    Claims,
    Templates,
    claim_object,
    limited_admission,
    review,
    template_object,
)

EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. "
    "You can start a new list without the continue parameter."
)


class ListsApi:
    """The collections of `objects` (by path), listed and read as the API server does."""

    def __init__(
        self, objects: dict[str, list[dict[str, Any]]], held_path: str | None = None
    ) -> None:
        self.objects = objects
        self.held_path = held_path if held_path is not None else next(iter(objects))
        self.lists = 0
        self.lists_of: dict[str, int] = {}
        """Lists begun, by collection path."""
        self.pages = 0
        self.pages_of: dict[str, int] = {}
        self.largest_page = 0
        self.bytes = 0
        """What the webhook parsed: the JSON bodies of every page."""
        self.bytes_of: dict[str, int] = {}
        self.queries: list[dict[str, str]] = []
        self.held: dict[int, anyio.Event] = {}
        self.fail_page: int | None = None
        self.fail_status = 410
        self.in_flight = 0
        self.most_in_flight = 0
        """The most requests answered at a time."""
        self._snapshots: dict[str, list[dict[str, Any]]] = {}

    async def request(
        self, method: str, path: str, body: Any = None, *, query: Any = None, **_: Any
    ) -> Any:
        if method != "GET":
            raise AssertionError(f"unexpected {method} {path}")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._answer(method, path, query)
        finally:
            self.in_flight -= 1

    async def _answer(self, method: str, path: str, query: Any) -> Any:
        collection, _, name = path.rpartition("/")
        if path not in self.objects and collection in self.objects:
            await anyio.lowlevel.checkpoint()
            for obj in self.objects[collection]:
                if obj["metadata"]["name"] == name:
                    return json.loads(json.dumps(obj))
            raise ApiError(404, f"{name} not found", method, path)
        if path not in self.objects:
            raise ApiError(404, "the server could not find the requested resource", method, path)
        query = dict(query or {})
        self.queries.append(query)
        token = query.get("continue")
        if token is None:
            self.lists += 1
            self.lists_of[path] = self.lists_of.get(path, 0) + 1
            snapshot = token = str(self.lists)
            self._snapshots[snapshot] = [o for o in self.objects[path] if _selected(o, query)]
            offset = 0
            hold = self.held.get(self.lists_of[path]) if path == self.held_path else None
            if hold is not None:
                await hold.wait()
        else:
            snapshot, _, at = token.partition(":")
            offset = int(at)
        page_number = offset // int(query["limit"]) + 1 if "limit" in query else 1
        await anyio.lowlevel.checkpoint()  # the round trip: other admissions run meanwhile
        if page_number == self.fail_page:
            message = EXPIRED if self.fail_status == 410 else "failed"
            raise ApiError(self.fail_status, message, method, path)
        items = self._snapshots[snapshot][offset:]
        metadata: dict[str, str] = {}
        if "limit" in query and len(items) > int(query["limit"]):
            items = items[: int(query["limit"])]
            metadata["continue"] = f"{snapshot}:{offset + len(items)}"
        raw = json.dumps({"kind": "List", "metadata": metadata, "items": items})
        self.pages += 1
        self.pages_of[path] = self.pages_of.get(path, 0) + 1
        self.largest_page = max(self.largest_page, len(items))
        self.bytes += len(raw)
        self.bytes_of[path] = self.bytes_of.get(path, 0) + len(raw)
        return json.loads(raw)


@asynccontextmanager
async def api_server(api: ListsApi) -> AsyncIterator[Kube]:
    """The webhook's API client of an HTTP server answering as `api` does: its errors
    as the API server's Status objects."""

    async def answer(request: web.Request) -> web.Response:
        try:
            listing = await api.request(request.method, request.path, query=dict(request.query))
        except ApiError as e:
            status = {"kind": "Status", "code": e.status, "message": e.message}
            return web.json_response(status, status=e.status)
        return web.json_response(listing)

    async with kube_serving(answer) as kube:
        yield kube


def _selected(obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
    """The phase field selector the webhook sends for pods, as the API server applies it."""
    if "fieldSelector" not in query:
        return True
    excluded = {term.split("!=")[1] for term in query["fieldSelector"].split(",") if "!=" in term}
    return obj.get("status", {}).get("phase") not in excluded


def lists_admission(api: ListsApi | Kube, limit: int | None = None, **reader: Any) -> Admission:
    """The admission of namespace ns reading its lists from `api` (or a client of it,
    `api_server`) through the webhook's own API reader; where `limit` is given, a tenant
    allows that many devices per pod."""
    tenants = limited_admission(Claims(), limit=limit)._tenants if limit is not None else None
    return Admission(
        Templates(),
        WebhookMetrics(CollectorRegistry()),
        tenants=tenants,
        read_claims=ApiClaimReader(api, **reader),  # type: ignore[arg-type]
    )


async def create_together(
    admission: Admission, review_of: Callable[[str], bytes], names: Iterable[str]
) -> dict[str, Any]:
    """Create each of `names` (its review `review_of(name)`) at once: the decision of
    each, by name."""
    decisions: dict[str, Any] = {}

    async def create(name: str) -> None:
        decisions[name] = await admission.validate_claim(review_of(name))

    async with anyio.create_task_group() as group:
        for name in names:
            group.start_soon(create, name)
    return decisions


async def released_after_all_wait(api: ListsApi, create: Any) -> dict[str, Any]:
    """Run `create` with the first held list's answer held until every admission
    waits."""
    api.held[1] = anyio.Event()
    async with anyio.create_task_group() as group:

        async def release() -> None:
            await anyio.wait_all_tasks_blocked()
            api.held[1].set()

        group.start_soon(release)
        decisions: dict[str, Any] = await create()
    return decisions


def claim_review(name: str) -> bytes:
    """The review of creating claim `name` for one GPU."""
    return review(CLAIM, claim_object(name, 1))


def template_review(name: str) -> bytes:
    """The review of creating template `name` for one GPU."""
    return review(TEMPLATE, template_object(name, 1))


async def created_together_over_two_paged_lists(
    admission: Admission,
    api: ListsApi,
    review_of: Callable[[str], bytes],
    names: list[str],
    refused: str,
) -> str:
    """Create each of `names` (its review `review_of(name)`) while the first one's list
    of the held collection is under way: the first gets that list, the others share one
    list begun after they all arrived, not one each. Each list holds three pages of
    `PER_PAGE`, the last read too, and only `refused` is refused: the message it gets."""
    decisions = await released_after_all_wait(
        api, lambda: create_together(admission, review_of, names)
    )
    assert api.lists_of[api.held_path] == 2
    assert api.pages_of[api.held_path] == 2 * 3
    assert api.largest_page == PER_PAGE
    assert {name for name, d in decisions.items() if d.result == "denied"} == {refused}
    message: str = decisions[refused].response["status"]["message"]
    return message


async def assert_a_list_under_way_is_not_handed_on(
    admission: Admission,
    api: ListsApi,
    review_of: Callable[[str], bytes],
    stored: dict[str, Any],
    reason: str,
) -> None:
    """Create `other` (its review `review_of("other")`), whose list of the held
    collection is read and its answer held; then store `stored` in that collection and
    create `x`. `other` is admitted on the list it read; x, had it shared that list,
    would not have seen `stored`: it gets a second list, begun after it arrived, and is
    refused saying `reason`."""
    api.held[1] = anyio.Event()
    decisions: dict[str, Any] = {}

    async def create(name: str) -> None:
        decisions[name] = await admission.validate_claim(review_of(name))

    async with anyio.create_task_group() as group:
        group.start_soon(create, "other")
        await anyio.wait_all_tasks_blocked()
        assert api.lists_of[api.held_path] == 1  # read, its answer held
        api.objects[api.held_path].append(stored)
        group.start_soon(create, "x")
        await anyio.wait_all_tasks_blocked()
        api.held[1].set()

    assert decisions["other"].result == "allowed"
    assert decisions["x"].result == "denied"
    assert reason in decisions["x"].response["status"]["message"]
    assert api.lists_of[api.held_path] == 2


def assert_each_denied_for_the_failed_page(
    api: ListsApi, decisions: dict[str, Any], reason: str, the_list: str
) -> None:
    """Every admission that shared the list whose page `api.fail_page` failed is refused,
    to be retried, saying `reason`, the API server's status and which page of
    `the_list` (as the message names it) of namespace ns failed."""
    assert decisions
    for decision in decisions.values():
        assert decision.result == "denied"
        message = decision.response["status"]["message"]
        assert reason in message
        assert f"HTTP {api.fail_status}" in message
        assert f"page {api.fail_page} of the list of {the_list} of namespace ns" in message
        assert message.endswith("; retry")
