"""An HTTP server on a free loopback port, for tests of the API client against answers
they write themselves: every method and path goes to one handler."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web
from gpudra.common.kube import Kube
from kubernetes_asyncio.client import ApiClient, Configuration

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """Serve every request with `handler` until the block ends: the server's base URL.
    Port 0 lets parallel tests never collide on a port."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def kube_serving(handler: Handler) -> AsyncIterator[Kube]:
    """A client of `serving(handler)`, closed before the server stops so that no pooled
    connection outlives it."""
    async with serving(handler) as host:
        kube = Kube(ApiClient(configuration=Configuration(host=host)))
        try:
            yield kube
        finally:
            await kube.close()
