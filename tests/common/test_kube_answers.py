"""The API client reads answers as Go does: what the API server keeps as raw JSON (a
claim's opaque parameters) comes back in GETs, LISTs and WATCHes as it was written,
and an unpaired surrogate escape there must not fail the whole answer; an answer not
even Go reads fails as an ApiError naming the request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from gpudra.api import jsonbytes
from gpudra.common.kube import ApiError, Kube, UndecodableAnswer

from tests.common.loopback import kube_serving

CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
SURROGATE = b'{"metadata":{"name":"odd"},"parameters":{"x":"\\ud800"}}'
TOO_DEEP = b"[" * (jsonbytes.GO_MAX_DEPTH + 1) + b"]" * (jsonbytes.GO_MAX_DEPTH + 1)


@asynccontextmanager
async def api_server(body: bytes) -> AsyncIterator[Kube]:
    """A client of a server answering every request with `body` (a watch stream too)."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async with kube_serving(answer) as kube:
        yield kube


@pytest.mark.anyio
async def test_a_list_holding_an_unpaired_surrogate_reads_as_go_reads_it() -> None:
    async with api_server(b'{"items":[' + SURROGATE + b',{"metadata":{"name":"a"}}]}') as kube:
        listed = await kube.request("GET", CLAIMS)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["odd", "a"]
    assert listed["items"][0]["parameters"] == {"x": "\ufffd"}


@pytest.mark.anyio
async def test_a_watch_event_holding_an_unpaired_surrogate_reads_as_go_reads_it() -> None:
    stream = b'{"type":"ADDED","object":' + SURROGATE + b'}\n{"type":"BOOKMARK","object":{}}\n'
    async with api_server(stream) as kube:
        events = [e async for e in kube.watch(CLAIMS, {})]
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[0]["object"]["parameters"] == {"x": "\ufffd"}


@pytest.mark.anyio
async def test_an_answer_go_cannot_read_either_is_an_api_error_naming_the_request() -> None:
    async with api_server(TOO_DEEP) as kube:
        with pytest.raises(ApiError) as err:
            await kube.request("GET", CLAIMS)
    assert isinstance(err.value, UndecodableAnswer) and err.value.status == 200
    assert str(err.value).startswith(
        f"GET {CLAIMS}: HTTP 200: the answer is not JSON that Go's decoder reads either: "
        "exceeded max depth"
    )


@pytest.mark.anyio
async def test_a_watch_event_go_cannot_read_either_is_an_api_error_naming_the_watch() -> None:
    async with api_server(b'{"type":"ADDED","object":' + TOO_DEEP + b"}\n") as kube:
        with pytest.raises(UndecodableAnswer) as err:
            [e async for e in kube.watch(CLAIMS, {})]
    assert str(err.value).startswith(f"WATCH {CLAIMS}: HTTP 200: the answer is not JSON")
