"""A read bounded by `max_bytes` never holds much more of an answer than that: what a
tenant stores decides how large a list of it is, and parsed JSON takes many times its
size. An answer over the bound fails as an ApiError naming the request and both sizes,
and its connection, not read to its end, is not used again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from aiohttp import web
from gpudra.common.kube import AnswerTooLarge, ApiError, Kube

from tests.common.loopback import kube_serving

pytestmark = pytest.mark.anyio

BOUND = 100_000
PIECE = 2**14


class Server:
    """Answers ``/small`` with a small list, ``/declared`` with a Content-Length over
    `BOUND` and no body until the test ends, ``/chunked`` with a chunked body written
    until the client stops reading, ``/error`` with a 403 Status; records the client
    port of each request, to tell a new connection from a pooled one."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.written = 0
        self.done = anyio.Event()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.ports.append(request.transport.get_extra_info("peername")[1])
        if request.path == "/small":
            return web.json_response({"items": [{"metadata": {"name": "a"}}]})
        if request.path == "/error":
            return web.json_response({"message": "forbidden"}, status=403)
        response = web.StreamResponse()
        response.content_type = "application/json"
        if request.path == "/declared":
            response.content_length = BOUND + 1
            await response.prepare(request)
            await self.done.wait()  # a client reading the body would wait for it
            return response
        response.enable_chunked_encoding()
        await response.prepare(request)
        with anyio.move_on_after(10):
            await response.write(b'{"items":[')
            while not self.done.is_set():
                await response.write(b'"' + b"x" * PIECE + b'",')
                self.written += PIECE + 3
        return response


@asynccontextmanager
async def server() -> AsyncIterator[tuple[Server, Kube]]:
    answers = Server()
    async with kube_serving(answers.answer) as kube:
        try:
            yield answers, kube
        finally:
            answers.done.set()


async def test_an_answer_within_the_bound_is_read_whole_on_a_pooled_connection() -> None:
    async with server() as (answers, kube):
        first = await kube.request("GET", "/small", max_bytes=BOUND)
        second = await kube.request("GET", "/small", max_bytes=BOUND)
        unbounded = await kube.request("GET", "/small")
    assert first == second == unbounded == {"items": [{"metadata": {"name": "a"}}]}
    assert len(set(answers.ports)) == 1


async def test_a_declared_length_over_the_bound_is_refused_without_reading_the_body() -> None:
    async with server() as (answers, kube):
        with anyio.fail_after(5), pytest.raises(AnswerTooLarge) as err:
            await kube.request("GET", "/declared", max_bytes=BOUND)
        assert await kube.request("GET", "/small", max_bytes=BOUND)
    assert isinstance(err.value, ApiError) and err.value.status == 200
    assert (err.value.size, err.value.bound) == (BOUND + 1, BOUND)
    assert str(err.value) == (
        f"GET /declared: HTTP 200: the answer is at least {BOUND + 1} bytes, over the "
        f"{BOUND} bytes this read takes"
    )
    assert answers.ports[0] != answers.ports[1]  # the unread body's connection closed


async def test_a_chunked_answer_over_the_bound_is_cut_off_once_past_it() -> None:
    async with server() as (answers, kube):
        with anyio.fail_after(5), pytest.raises(AnswerTooLarge) as err:
            await kube.request("GET", "/chunked", max_bytes=BOUND)
        assert await kube.request("GET", "/small", max_bytes=BOUND)
    assert BOUND < err.value.size <= BOUND + 2**16
    assert f"at least {err.value.size} bytes, over the {BOUND} bytes" in str(err.value)
    assert answers.ports[0] != answers.ports[1]


async def test_an_error_answer_within_the_bound_is_the_api_servers_error() -> None:
    async with server() as (_, kube):
        with pytest.raises(ApiError) as err:
            await kube.request("GET", "/error", max_bytes=BOUND)
    assert not isinstance(err.value, AnswerTooLarge)
    assert (err.value.status, err.value.message) == (403, "forbidden")
