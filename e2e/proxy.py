"""A TCP forwarder to a loopback port that a test can cut and restore, to simulate an
API server outage without stopping the shared control plane, or listen on another
address of the host (`host`) to give pods a way to a server that listens on loopback
only."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.lowlevel


@dataclass
class Proxy:
    target_port: int
    port: int = 0
    host: str = "127.0.0.1"
    _conns: set[anyio.abc.SocketStream] = field(default_factory=set)
    _listener: anyio.abc.SocketListener | None = None
    _scope: anyio.CancelScope | None = None

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        self._listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        self.port = self._listener.extra(anyio.abc.SocketAttribute.local_port)
        self._scope = anyio.CancelScope()
        tg.start_soon(self._serve, self._listener, self._scope)

    async def _serve(self, listener: anyio.abc.SocketListener, scope: anyio.CancelScope) -> None:
        with scope, contextlib.suppress(anyio.ClosedResourceError, ExceptionGroup):
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        try:
            upstream = await anyio.connect_tcp("127.0.0.1", self.target_port)
        except OSError:
            await client.aclose()
            return
        self._conns |= {client, upstream}

        async def pump(a: anyio.abc.SocketStream, b: anyio.abc.SocketStream) -> None:
            with contextlib.suppress(Exception):
                async for chunk in a:
                    await b.send(chunk)
            with contextlib.suppress(Exception):
                await b.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, client, upstream)
            tg.start_soon(pump, upstream, client)
        self._conns -= {client, upstream}

    async def cut(self) -> None:
        """Stop listening and drop every open connection (an outage)."""
        if self._scope:
            self._scope.cancel()
        await anyio.lowlevel.checkpoint()  # let serve() unwind before its listener closes
        if self._listener:
            with contextlib.suppress(Exception):
                await self._listener.aclose()
        for c in list(self._conns):
            with contextlib.suppress(Exception):
                await c.aclose()
        self._conns.clear()

    async def restore(self, tg: anyio.abc.TaskGroup) -> None:
        await self.start(tg)
