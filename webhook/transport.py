"""The webhook's HTTPS transport: HTTP/1.1 on an asyncio protocol, parsed by llhttp.

HTTP parsing is llhttp's (Node.js's parser, a C library) through httptools, its kept
Python binding: the request line, headers, Content-Length and framing errors are the
parser's. What this module adds is the connection around it, one asyncio protocol per
connection with no per-request objects beyond the request itself: admission is the
webhook's hot path, and an HTTP framework's request, stream and response objects cost
a third of each admission's CPU (measured side by side with aiohttp's server, which
this replaces).

- TLS: the listener's context hands every handshake to the newest certificate
  (`ReloadingTLSContext`), so a rotated certificate reaches new connections at once
  while open ones keep working; each connection's kernel receive buffer is small
  (`_RECEIVE_BUFFER`), which bounds what the TLS layer keeps per connection;
- every phase has its own bound, so a slow or hostile client only ever ties up its own
  connection: handshake (``handshake_timeout``); the first request head, and any head
  once its first byte arrived (``header_timeout``, answered 408); the body
  (``body_timeout``, 408) and its size, checked against ``Content-Length`` before
  reading (400); idle keep-alive (``idle_timeout``); head lines and their count (400),
  and the whole head, counted as it arrives (``max_head_bytes``, 431);
- requests on one connection (keep-alive, pipelined) are answered one at a time, in
  order; a request the server refuses before its body closes the connection after the
  answer, draining unread input for a moment so the client reads the answer first;
- a request whose connection closes while its answer is being made is cancelled (counted
  ``abandoned``): a closed connection is out of every bound below, so work left going
  for it would be bounded by nothing;
- each connection is flow-controlled, so a client that pipelines requests and never
  reads the answers holds a few requests and a bounded write buffer, not the process:
  at most two of its requests wait (the one being answered and the next; the connection
  stops reading at two, and one more completed in the same read is answered last, with
  ``Connection: close``, since the parser cannot stop at a message and resume); while
  the transport's write buffer is above its high-water mark the connection stops
  answering and reading, and one that makes no progress for ``idle_timeout`` is
  aborted (for ``body_timeout`` while its queued requests hold request bodies, below);
  between two answers of one connection the loop serves the others;
- request bodies buffered at once are bounded server-wide (``max_buffered_body_bytes``,
  shared with the health port's listener), charged from ``Content-Length`` before any of
  the body is read and released once the request is answered or its connection closes.
  A body that does not fit makes room: first by aborting the connections whose queued
  requests hold bodies behind answers their clients do not read, the one waiting longest
  first; then by answering 503 to the bodies still being received that began longest
  ago (the way the connection bound does, so bodies declared and never sent cannot lock
  the API server out). When that cannot make room, the new request is answered 503 with
  ``Retry-After`` and its connection closed (the API server retries such an answer).
  Only the bodies of requests being answered are never shed: they hold the budget for
  as long as an answer takes. Without the first step a client that pipelined a slow
  review with a big answer and a 3 MiB request behind it, and never read, held that
  body for the keep-alive bound: about 22 such connections, from one address, held the
  whole budget for two minutes and every admission got 503. A complete body queued
  behind unread answers is held for ``body_timeout`` at most even when nothing needs
  its room, as one still being received is. The API server never holds one: it sends
  a request on a connection only once it has read the answer before (answers of a few
  KiB, far below the write buffer's mark). The budget has no share per client address:
  what any client can hold past a new request's need is only what is being answered,
  and the API server's requests may come from the same address as others' (a proxy, a
  node's address);
- connections in their TLS handshake are bounded (``max_connections``; a quarter of it,
  at least 64, with client certificates required, since a handshake that takes one
  costs more), counted from the moment they are accepted (each connection starts its
  own handshake): at the bound the one accepted longest ago is aborted. They never
  take a served connection's place, so a client that cannot pass the handshake
  (without the client certificate it asks for) cannot close the API server's
  connections;
- served connections (past their handshake) are bounded too (``max_connections``):
  anyone who reaches the port and passes the handshake can open connections and keep
  them (a request every two minutes keeps one alive, a slow head holds one for ten
  seconds at a time), each about 50 KiB with its TLS state (up to about 0.4 MiB once it
  carried a large request, most of it the 256 KiB read buffer uvloop gives every TLS
  connection, which nothing here can shrink). At the bound a new connection takes the
  place of the one that has waited longest without a request being answered (idle,
  still sending its request, or waiting for its client to read the answers), which is
  aborted, so a flood of held connections cannot lock the API server out nor exhaust
  the process's memory or file descriptors.
  A connection whose request is being answered is never closed for another; when
  every one is, the new one is refused;
- health (``/healthz``), readiness (``/readyz``, failing while draining or while the
  ``ready`` hook says no) and ``/metrics``;
- a stop (`HttpServer.serve` cancelled) works as Go's ``http.Server.Shutdown`` does:
  the listener closes and connections idle between requests close at once, while a
  connection still in its handshake, one that has not begun its first request, one
  part-way through sending a request and one whose request is being answered each get
  that request answered, with ``Connection: close``, within ``_SHUTDOWN_GRACE_S``;
  whatever is left then is aborted. A client that has just dialled has a request to
  send, and cutting it off loses that request: the API server reports ``EOF`` for it
  and does not retry a POST on a connection it opened for it.

The transport knows nothing of admission: an endpoint is a body in, a `Reply` out.

The idle keep-alive timeout (120 s) is above the 90 s idle-connection timeout of Go's
HTTP transports, so the API server closes pooled connections first and never writes
into one the server is closing. HTTP/1.1 requests must carry a Host header (RFC 9112):
the API server always sends one.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final, cast
from urllib.parse import unquote

import anyio
import httptools
from anyio.abc import TaskStatus
from gpudra.common.errors import exception_text
from gpudra.common.logpace import LogPace
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.tls import ReloadingTLSContext
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest

__all__ = ["BodyBudget", "Endpoint", "HttpConfig", "HttpServer", "Reply", "text_reply"]

logger = logging.getLogger(__name__)

_TEXT: Final = "text/plain; charset=utf-8"
_SERVICE_PATHS: Final = ("/healthz", "/readyz", "/metrics")
_SHUTDOWN_GRACE_S: Final = 1.0
"""Requests in flight when the server is stopped, and the first requests of connections
just opened or still in their handshake, get this long to be answered."""
_LINGER_S: Final = 1.0
"""After an answer sent before the body was read, unread input is drained this long so
that closing does not reset the connection before the client reads the answer."""
_TIMER_SLACK_S: Final = 0.001
"""A deadline this close is reached: the loop's timers count in milliseconds."""
_BACKLOG: Final = 1024
_SPARE_FILES: Final = 64
"""File descriptors kept free beside the connections: the listener, the certificate
reloads, the API client's own connections, the event loop's."""
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_QUEUED: Final = 2
"""Requests of one connection parsed and not yet answered, the one being answered
included: at the bound the connection stops reading until one is answered."""
_WRITE_HIGH_WATER: Final = 64 * 1024
"""Per connection: above this many bytes written and not yet sent (what the client has
not read), the connection stops answering and reading. Above the largest answer the
API server gets (an AdmissionReview response is a few KiB), and an eighth of the TLS
transport's default, so that a thousand connections whose clients never read hold tens
of MiB, not half a GiB."""
_READ_HIGH_WATER: Final = 16 * 1024
"""Per connection: encrypted input the TLS layer buffers while the connection does not
read (at most this, plus one read from the socket)."""
_RECEIVE_BUFFER: Final = 32 * 1024
"""Per connection: the kernel's receive buffer (SO_RCVBUF, which Linux doubles), set on
the listening sockets before they listen so that every accepted one inherits it. A read
from the socket takes at most what it holds, and uvloop's TLS layer keeps memory sized
by the largest read for as long as the connection is open: its encrypted-input buffer
(an OpenSSL memory BIO, which never shrinks) and the pages used of its read buffer.
Left to the kernel's autotuning, one large request grew them to about 0.5 MiB: 200
connections idle after a 3 MiB request each took the transport from 32 MiB to 145 MiB
(64 MiB at this size), and 1,000 sending 3 MiB bodies at once to 654 MiB (242 MiB). It
also bounds what a client can push into a connection that is not being read, and what
a connection carries per round trip (at most 64 KiB: a pod's review is 5-20 KiB; the
largest body allowed, 3 MiB, costs about 2 ms more CPU). What it cannot bound is that
read buffer's size: uvloop allocates 256 KiB for each TLS connection."""
_RETRY_AFTER_S: Final = 1
_CERT_HANDSHAKES: Final = 64
"""The fewest handshakes under way allowed with client certificates required (see
`HttpServer._handshake_bound`): many more than the API server needs at once, even in a
burst of new connections."""
_SHORTEST_HEAD: Final = len(b"GET  HTTP/1.1\r\n\r\n")
"""The fewest bytes a request head takes beside its target and header lines (each of
those at least its name, value, colon and line end)."""


@dataclass(frozen=True)
class HttpConfig:
    """Listener, TLS files and the per-phase limits."""

    cert_file: Path
    key_file: Path
    host: str | None = None
    """Address to bind; None listens on every interface (IPv4 and IPv6)."""
    port: int = 8443
    max_body_bytes: int = 3 * 1024 * 1024
    max_buffered_body_bytes: int = 64 * 1024 * 1024
    """Request-body bytes buffered at once, across every connection of the server (and
    of its health port's listener): see the module docstring. 64 MiB holds 21 bodies of
    the largest size (`max_body_bytes`) at once and thousands of the API server's usual
    ones (a pod's review is 5-20 KiB, and 200 reviews a second hold well under 1 MiB),
    and is an eighth of the chart's default memory limit (512 MiB), leaving the rest to
    the process at rest (about 60 MiB), the connections' TLS buffers and the reviews
    being decoded. Without it 150 connections declaring 3 MiB each and sending all but
    the last byte took the process to 600 MiB in a second."""
    max_header_bytes: int = 16 * 1024
    """The longest request line or header line."""
    max_headers: int = 32
    max_head_bytes: int = 32 * 1024
    """The whole request head as received: the request line, every header line and the
    empty line that ends them, line ends included, counted while it arrives (a line the
    parser still holds too), so a head never holds more than this, however slowly it
    comes (answered 431). The API server's heads are a few hundred bytes; 32 KiB is two
    of the longest lines, and what nginx allows by default (four 8 KiB buffers). The
    line and line-count limits alone let an unfinished head hold 528 KiB: 500
    connections holding such heads took the transport from 32 MiB to 557 MiB, and 81
    MiB at this bound."""
    handshake_timeout: float = 10.0
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    idle_timeout: float = 120.0
    cert_check_interval: float = 1.0
    max_connections: int = 1024
    """Served connections held open at most, and as many in their TLS handshake (see
    the module docstring); lowered at start to what the process's open-files limit
    leaves room for."""


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    result: str
    """The requests metric's result label."""
    content_type: str = "application/json"
    close: bool = False
    """The connection cannot go on after this reply (its input is out of step)."""
    retry_after: int = 0
    """Seconds for a Retry-After header (0: none)."""


Endpoint = Callable[[bytes], Awaitable[Reply]]
"""A POST endpoint: the request body in, the reply out."""


def text_reply(
    status: int, message: str, result: str = "bad_request", *, close: bool = False
) -> Reply:
    """A plain-text reply: the body is `message` and a newline."""
    return Reply(status, (message + "\n").encode(), result, _TEXT, close)


_ABANDONED: Final = text_reply(499, "the client closed the connection", "abandoned")
"""Counts a request whose connection closed before its answer was made; never sent."""


@dataclass(slots=True)
class _Request:
    """A request as the connection hands it to the server: complete, or refused early
    (`early` set: answered without its body, and the connection closes after it)."""

    method: str
    path: str
    version: str
    keep_alive: bool
    started: float
    """When the head was complete: the latency metric counts from here."""
    body: bytes = b""
    early: Reply | None = None
    refused_head: bool = False
    """Refused before it had a path (parser, head limits, head deadline): counted as the
    server's `rejected`, not as a request of a path."""
    charge: int = 0
    """Body bytes it holds in the server's budget (its Content-Length) until answered."""


_OVER_BUDGET: Final = Reply(
    503,
    b"the webhook is buffering as many request bodies as it may; retry\n",
    "unavailable",
    _TEXT,
    close=True,
    retry_after=_RETRY_AFTER_S,
)


class BodyBudget:
    """Request-body bytes buffered at once by the listeners that share it: the admission
    port and the health port are one process, under one memory limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        """Bytes charged: the declared bodies of requests being received, queued or
        being answered."""
        self.pools: list[set[_Connection]] = []
        """The open connections of each listener sharing the budget."""


class HttpServer:
    """The HTTPS listener; run `serve` inside a task group."""

    def __init__(
        self,
        config: HttpConfig,
        endpoints: Mapping[str, Endpoint],
        metrics: WebhookMetrics,
        *,
        ready: Callable[[], bool] | None = None,
        bodies: BodyBudget | None = None,
    ) -> None:
        """`bodies`: a budget to share with another listener of the process; by default
        one of `config.max_buffered_body_bytes` of its own."""
        self._config = config
        self._endpoints = dict(endpoints)
        self._metrics = metrics
        self._ready_check = ready
        self.tls = ReloadingTLSContext(
            config.cert_file,
            config.key_file,
            on_reload=lambda ok: metrics.cert_reloads.labels("success" if ok else "failure").inc(),
        )
        self._port = 0
        self._serving = False
        self._draining = False
        self._connections: set[_Connection] = set()
        """Connections being served (their handshake passed)."""
        self._handshaking: set[_Connection] = set()
        """Connections in their TLS handshake."""
        self._all_closed: anyio.Event | None = None
        self._max_connections = config.max_connections
        self._shed_log = LogPace()  # counted on every one, logged at most once a minute
        self.bodies = bodies if bodies is not None else BodyBudget(config.max_buffered_body_bytes)
        self.bodies.pools.append(self._connections)
        self._budget_log = LogPace()
        self._stranger_log = LogPace()

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); 0 before `serve` started."""
        return self._port

    @property
    def config(self) -> HttpConfig:
        return self._config

    def begin_shutdown(self) -> None:
        """Fail readiness and close connections after their current request, so the
        Service stops routing here before the process is stopped."""
        self._draining = True

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through `task_status`."""
        cfg = self._config
        loop = asyncio.get_running_loop()
        # The listeners sharing the body budget are this process's (the health port's).
        self._max_connections = connection_bound(
            cfg.max_connections, listeners=len(self.bodies.pools)
        )
        # Plain TCP here: each connection starts its own TLS handshake (`_Connection`),
        # so that it counts against the connection bound from the moment it is accepted.
        listener = await loop.create_server(
            lambda: _Connection(self, loop),
            cfg.host,
            cfg.port,
            backlog=_BACKLOG,
            start_serving=False,
        )
        for sock in listener.sockets:
            # Before listening, so that every accepted socket inherits it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
        await listener.start_serving()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.tls.watch, cfg.cert_check_interval)
                self._port = listener.sockets[0].getsockname()[1]
                self._serving = True
                logger.info(
                    "admission webhook listening",
                    extra={"fields": {"port": self._port, "maxConnections": self._max_connections}},
                )
                task_status.started(self._port)
                await anyio.sleep_forever()
        finally:
            self._serving = False
            listener.close()
            with anyio.CancelScope(shield=True):
                await self._shut_down()

    async def _shut_down(self) -> None:
        """Close connections idle between requests now; the others once the request
        they carry, or the first one they are opened for, is answered, or the grace
        period is over. Connections in their handshake finish it and are served the
        same way (`answer` keeps none alive once the server stops)."""
        for connection in list(self._connections):
            connection.stop_after_answer()
        if self._connections or self._handshaking:
            self._all_closed = anyio.Event()
            with anyio.move_on_after(_SHUTDOWN_GRACE_S):
                await self._all_closed.wait()
        for connection in [*self._handshaking, *self._connections]:
            connection.abort()

    def admits(self, transport: asyncio.BaseTransport) -> bool:
        """Whether a new connection may send requests: with client certificates required,
        one whose certificate carries no accepted name, or that resumed a TLS session, may
        not (`ReloadingTLSContext.client_problem`). It is closed before it counts against
        the connection bound, so it takes no one's place."""
        if self.tls.client_ca_file is None:
            return True
        problem = self.tls.client_problem(transport.get_extra_info("ssl_object"))
        if problem is None:
            return True
        refused = self._stranger_log.due()
        if refused is not None:
            logger.warning(
                "webhook connection closed before any request: its client is not accepted",
                extra={"fields": {"error": problem, "refused": refused}},
            )
        return False

    def connected(self, connection: _Connection) -> None:
        """Take a connection just accepted in, for its TLS handshake. Handshakes have a
        bound of their own (the connection bound): at it, the one accepted longest ago
        makes room. They never take a served connection's place, so a stranger that
        cannot pass the handshake (without the client certificate it asks for) cannot
        close the API server's connections."""
        if len(self._handshaking) >= self._handshake_bound():
            victim = min(self._handshaking, key=lambda c: c.last_active)
            self._handshaking.discard(victim)
            victim.abort()
            self._shed("evicted")
        self._handshaking.add(connection)

    def _handshake_bound(self) -> int:
        """Handshakes under way at most: the connection bound, or with client
        certificates required a quarter of it (at least `_CERT_HANDSHAKES`, or the
        connection bound where it is lower). A handshake that asks for a client
        certificate takes one as large as the client declares (OpenSSL allocates the
        declared size, up to 100 KiB, before the rest arrives): one stalled inside such
        a message held about 0.21 MiB, one that sent only its hello 0.06 MiB. A quarter
        keeps what a full bound of them holds below what as many plain ones as the
        connection bound would; the API server, whose handshakes take milliseconds,
        needs a few at once."""
        bound = self._max_connections
        if self.tls.client_ca_file is None:
            return bound
        return max(bound // 4, min(bound, _CERT_HANDSHAKES))

    def secured(self, connection: _Connection) -> bool:
        """Take a connection whose handshake passed in, to be served; False when it must
        be closed at once (the bound is reached and every open connection is having a
        request answered)."""
        self._handshaking.discard(connection)
        if len(self._connections) >= self._max_connections:
            waiting = [c for c in self._connections if c.evictable]
            if not waiting:
                self._shed("refused")
                return False
            victim = min(waiting, key=lambda c: c.last_active)
            self._connections.discard(victim)
            victim.abort()
            self._shed("evicted")
        self._connections.add(connection)
        return True

    def _shed(self, action: str) -> None:
        self._metrics.inc(self._metrics.connections_shed, action)
        shed = self._shed_log.due()
        if shed is not None:
            logger.warning(
                "webhook connection bound reached; shedding connections (a client holding "
                "many open? restrict who reaches the port: see docs/security.md)",
                extra={
                    "fields": {
                        "maxConnections": self._max_connections,
                        "shed": shed,
                        "last": action,
                    }
                },
            )

    def disconnected(self, connection: _Connection) -> None:
        self._handshaking.discard(connection)
        self._connections.discard(connection)
        if not self._connections and not self._handshaking and self._all_closed is not None:
            self._all_closed.set()

    async def answer(self, request: _Request) -> tuple[Reply, bool]:
        """The reply to `request`, and whether the connection may go on after it."""
        if request.refused_head and request.early is not None:
            message = request.early.body.decode().strip()
            self.rejected(request.early.status, message)
            return request.early, False
        if request.early is not None:
            reply = request.early
        else:
            try:
                reply = await self._route(request)
            except Exception:
                logger.exception("unexpected error answering a webhook request")
                reply = text_reply(500, "internal error", "error", close=True)
        # Not after this answer: a closing connection, a draining or stopping server.
        keep_alive = request.keep_alive and not reply.close and not self._draining
        keep_alive = keep_alive and self._serving
        if reply.close and reply.status < 500:
            _log_refusal(reply.status, reply.body.decode().strip())
        return reply, keep_alive

    def answered(self, request: _Request, reply: Reply) -> None:
        """Count `request`, answered with `reply` (written, or its connection gone), and
        its time from head to answer: once the answer is out, so that the count is not
        in the answer's way. A head refused before it had a path counts as `rejected`."""
        if request.refused_head and request.early is not None:
            return
        path = request.path
        label = path if path in self._endpoints or path in _SERVICE_PATHS else "other"
        self._metrics.observe_request(label, reply.result, time.perf_counter() - request.started)

    async def _route(self, request: _Request) -> Reply:
        path, method = request.path, request.method
        if not path.startswith("/"):
            return text_reply(400, "malformed request line: no request target", close=True)
        if request.version not in ("1.1", "1.0"):
            return text_reply(
                400,
                f"unsupported protocol version HTTP/{request.version}; use HTTP/1.1",
                close=True,
            )
        endpoint = self._endpoints.get(path)
        if endpoint is not None:
            if method != "POST":
                return text_reply(405, f"{path} accepts POST only")
            return await endpoint(request.body)
        if path not in _SERVICE_PATHS:
            return text_reply(404, f"no handler for {path}", "not_found")
        if method != "GET":
            return text_reply(405, f"{path} accepts GET only")
        if path == "/healthz":
            return text_reply(200, "ok", "ok")
        if path == "/readyz":
            return (
                text_reply(200, "ok", "ok")
                if self._ready()
                else text_reply(503, "not ready", "unavailable")
            )
        return Reply(200, generate_latest(self._metrics.registry), "ok", CONTENT_TYPE_LATEST)

    def refusal(self, request: _Request, headers: Mapping[str, str]) -> Reply | None:
        """Why a request is answered from its head alone, before any of its body; a body
        it lets through is charged to the body budget (`request.charge`) here."""
        cfg = self._config
        if "transfer-encoding" in headers:
            message = "Transfer-Encoding is not supported; send Content-Length"
            return text_reply(501, message, close=True)
        length = headers.get("content-length")
        if length is None:
            if request.method == "POST" and request.path in self._endpoints:
                return text_reply(411, "POST needs a Content-Length header", close=True)
            return None
        size = int(length)  # the parser accepts digits only
        if size > cfg.max_body_bytes:
            message = (
                f"request body of {size} bytes exceeds the limit of "
                f"{cfg.max_body_bytes} bytes; AdmissionReviews of Pods are far smaller"
            )
            return text_reply(400, message, close=True)
        if size:
            # Charged now, before any of the body is read (see `BodyBudget`).
            bodies = self.bodies
            if bodies.used + size > bodies.limit and not self._make_room(size):
                self._over_budget("refused")
                return _OVER_BUDGET
            bodies.used += size
            request.charge = size
        return None

    def release(self, size: int) -> None:
        """Give back body budget `refusal` took."""
        self.bodies.used -= size

    def _make_room(self, size: int) -> bool:
        """Make room for `size` more bytes: first abort the connections whose charged
        requests wait behind answers their clients do not read, the one waiting longest
        first; then answer 503 to the bodies still being received that began longest ago.
        None when shedding all of them would not be enough (the budget is held by
        requests being answered).

        Unread first: such a client gets nothing more from the server until it reads, and
        the API server never is one (it reads every answer, a few KiB, as it comes), while
        a body being received may be the API server's, slowed by its network."""
        bodies = self.bodies
        connections = [c for pool in bodies.pools for c in pool]
        unread = [c for c in connections if c.unread_charge]
        receiving = [c for c in connections if c.receiving and c.evictable and not c.unread_charge]
        excess = bodies.used + size - bodies.limit
        if sum(c.unread_charge for c in unread) + sum(c.receiving for c in receiving) < excess:
            return False
        unread.sort(key=lambda c: c.unread_since)
        receiving.sort(key=lambda c: c.receiving_since)
        for connection in unread:
            if bodies.used + size <= bodies.limit:
                return True
            for pool in bodies.pools:
                pool.discard(connection)  # gone: no bound counts it any more
            connection.shed_unread()
            self._metrics.inc(self._metrics.connections_shed, "evicted")
            self._over_budget("evicted")
        for connection in receiving:
            if bodies.used + size <= bodies.limit:
                break
            connection.shed_body()
            self._over_budget("evicted")
        return True

    def _over_budget(self, action: str) -> None:
        due = self._budget_log.due()
        if due is not None:
            logger.warning(
                "webhook request-body budget reached; answering 503 (many large or slow "
                "request bodies at once? restrict who reaches the port: see "
                "docs/security.md)",
                extra={
                    "fields": {
                        "maxBufferedBodyBytes": self.bodies.limit,
                        "buffered": self.bodies.used,
                        "shed": due,
                        "last": action,
                    }
                },
            )

    def _ready(self) -> bool:
        if not self._serving or self._draining:
            return False
        return self._ready_check() if self._ready_check else True

    def rejected(self, status: int, message: str) -> None:
        """Count and log a request refused before it had a path."""
        self._metrics.inc(
            self._metrics.requests, "other", "bad_request" if status < 500 else "error"
        )
        _log_refusal(status, message)


def _log_refusal(status: int, message: str) -> None:
    logger.info(
        "rejected malformed webhook request",
        extra={"fields": {"status": status, "error": message}},
    )


class _Stop(Exception):
    """Raised from a parser callback to stop parsing: the request was answered from its
    head, and nothing after it on the connection is read."""


class _HeadError(Exception):
    """A request head the connection refuses: the status and the message to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Connection(asyncio.Protocol):
    """One client connection: feeds the parser, bounds each phase, answers in order.

    Timers: the head's deadline runs from the connection's start for the first
    request and from the first byte of any later one, and stops when the head is
    complete; the body's runs from there until the message is complete; between
    requests only the keep-alive bound applies. A head still partial at its deadline is
    answered 408; a connection that never sent a byte is closed without an answer.
    The timers run on while reading is paused (`_MAX_QUEUED`, or a client not reading
    its answers), and answering that waits for the client to read gives up after the
    keep-alive bound, or the body's while queued requests hold request bodies.
    """

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self._config = server.config
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        # One deadline at a time (see `_arm`).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        """When `_timer` fires (loop time)."""
        self._timer_kind = ""
        self._deadline = 0.0
        self._on_deadline: Callable[[], None] | None = None
        self._pending: deque[_Request | bytes] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._answering = False
        """The worker awaits an endpoint's answer (cancelled if the connection goes)."""
        self._starting: Coroutine[Any, Any, asyncio.Transport | None] | None = None
        """`loop.start_tls` while the handshake is under way."""
        self._early: list[bytes] | None = []
        """Requests' bytes that came in with the handshake's last message (a client
        sends its first request right behind it), before the connection is served:
        taken once it is; None from then on."""
        self._early_eof = False
        """The client ended its input before the connection was served."""
        # Flow control.
        self._queued = 0
        """Requests parsed and not yet answered, the one being answered included."""
        self._charged = 0
        """Body bytes this connection's requests hold in the server's budget."""
        self._reading_paused = False
        self._writing_paused = False
        self._drained: asyncio.Future[None] | None = None
        """While answering waits for the client to read: done once it has."""
        self._unread_since = 0.0
        """When answering last began to wait for the client to read."""
        self._overflowed = False
        # The message being parsed.
        self._in_message = False
        self._heard = False
        self._fresh = True
        """No request has begun on it: its client opened it to send one, which a stop
        waits for (`stop_after_answer`)."""
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._head_bytes = 0
        """Bytes received of the head being received, against `max_head_bytes`. Exact,
        but for a head that began in the same read as the end of a pipelined request:
        the parser does not say where one ended and the other began, so that head is
        charged what the read held past the fewest bytes the request can have taken
        (its head's target, names and values and their shortest framing, its body),
        and at most all of the read but that body: over-charged by what that request
        spent beyond the shortest framing (a longer method, spaces around values), a few
        bytes for the API server's."""
        self._head_floor = 0
        """The fewest bytes the head being parsed can have taken so far."""
        self._ended_bytes = 0
        """The fewest bytes the requests that ended in the input being parsed took."""
        self._ended_body_bytes = 0
        """Their bodies' bytes: all in that input (a body's input ends where it does)."""
        self._body: list[bytes] = []
        self._body_left = 0
        """Bytes of the body being received still to come."""
        self._request: _Request | None = None
        # No more input is parsed: an answer that closes the connection is coming.
        self._stopped = False
        self._closing = False
        self.last_active = time.monotonic()
        """When a byte last came in or an answer last went out: at the connection bound,
        the connection waiting longest makes room."""

    @property
    def evictable(self) -> bool:
        """Not having a request answered: idle, still sending one, or waiting for its
        client to read the answers."""
        return (self._worker is None or self._drained is not None) and self._transport is not None

    @property
    def receiving(self) -> int:
        """Budget held by the body still being received (0: none)."""
        request = self._request
        return request.charge if request is not None else 0

    @property
    def receiving_since(self) -> float:
        """When the body being received began (its head was complete)."""
        return self._request.started if self._request is not None else 0.0

    @property
    def unread_charge(self) -> int:
        """Budget held while answering waits for the client to read (0: none): the
        bodies of requests queued behind answers the client leaves unread, complete and
        no longer being received, which would otherwise stay charged for as long as the
        client waits (`HttpServer._make_room` sheds them first)."""
        return self._charged if self._drained is not None and self._transport is not None else 0

    @property
    def unread_since(self) -> float:
        """When answering began to wait for the client to read."""
        return self._unread_since

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Accepted: from here the connection counts against the bound of handshakes
        (`HttpServer.connected`), and once its handshake passed, against the bound of
        served connections (`HttpServer.secured`)."""
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        tcp = cast(asyncio.Transport, transport)
        self._transport = tcp
        self._server.connected(self)
        self._starting = self._loop.start_tls(
            tcp,
            self,
            self._server.tls.listener_context,
            server_side=True,
            ssl_handshake_timeout=self._config.handshake_timeout,
        )
        # The first step runs here, in this callback: it puts the TLS layer between the
        # socket and this protocol, and the loop starts reading the socket right after
        # this callback returns (a task's first step would come after the first read,
        # and the client's hello would reach the HTTP parser).
        self._step_handshake(tcp)

    def _step_handshake(self, tcp: asyncio.Transport) -> None:
        """Step `loop.start_tls` as a task would, from the done callback of what it
        waits on: that runs before the loop next reads the socket, so at most the read
        that finished the handshake waits in `_early`, and nothing overtakes it."""
        starting = self._starting
        if starting is None:
            return
        tls: asyncio.Transport | None = None
        try:
            waiting = starting.send(None)
        except StopIteration as done:
            self._starting, tls = None, done.value
        except (Exception, asyncio.CancelledError) as exc:  # the client's, or aborted
            self._starting = None
            self._handshake_failed(tcp, exc)
            return
        if self._starting is None:
            # Outside the except block: the parser's callbacks read `__context__`.
            self._secured(tcp, tls)
        elif isinstance(waiting, asyncio.Future):
            waiting._asyncio_future_blocking = False  # as a task does with what it awaits
            waiting.add_done_callback(lambda _: self._step_handshake(tcp))
        else:  # a bare yield: once round the loop
            self._loop.call_soon(self._step_handshake, tcp)

    def _handshake_failed(self, tcp: asyncio.Transport, exc: BaseException) -> None:
        logger.debug(
            "webhook TLS handshake failed", extra={"fields": {"error": exception_text(exc)}}
        )
        tcp.abort()
        # The TLS layer does not report a handshake it cut short (a reset, its deadline,
        # an abort) to this protocol.
        self.connection_lost(None)

    def _secured(self, tcp: asyncio.Transport, tls: asyncio.Transport | None) -> None:
        """The handshake is done: the connection is served, and the first head's
        deadline starts."""
        if tls is None or tls.is_closing() or self._transport is None or self._stopped:
            # Gone or stopped meanwhile (asyncio ends a handshake cut short without an
            # error and without a transport).
            (tcp if tls is None else tls).abort()
            self.connection_lost(None)
            return
        self._transport = tls
        if not self._server.admits(tls) or not self._server.secured(self):
            self._stopped = True
            self._transport.abort()
            return
        self._serve()

    def _serve(self) -> None:
        """Serve the connection over `_transport`: what came with the handshake first."""
        assert self._transport is not None
        self._transport.set_write_buffer_limits(_WRITE_HIGH_WATER)
        self._arm("head", self._config.header_timeout, self._head_expired)
        early, self._early = self._early or [], None
        for data in early:
            self.data_received(data)
        if self._early_eof:
            self.eof_received()

    def data_received(self, data: bytes) -> None:
        if self._early is not None:
            self._early.append(bytes(data))  # read once the connection is served
            return
        if self._stopped:
            return  # draining input after a refusal, or closing
        self.last_active = time.monotonic()
        if not self._in_message:
            self._heard = True
        limit = self._config.max_head_bytes
        rest: bytes | memoryview = data
        while rest and not self._stopped:
            piece = rest
            if self._request is None:
                # A head: never more at once than what is left of its bound, so that one
                # still unfinished at the bound is refused before any more is taken.
                room = limit - self._head_bytes  # at least 1: a head at it was refused
                if len(rest) > room:
                    piece, rest = memoryview(rest)[:room], memoryview(rest)[room:]
                else:
                    rest = b""
                self._head_bytes += len(piece)
                self._feed(piece)
                if self._request is not None:
                    self._head_bytes = 0  # complete: the rest of the piece is its body
                elif self._ended_bytes:
                    # Requests ended in the piece: a head begun after them holds at most
                    # what they cannot have taken of it.
                    after = min(
                        self._head_bytes - self._ended_bytes,
                        len(piece) - self._ended_body_bytes,
                    )
                    self._head_bytes = max(0, after) if self._in_message else 0
                self._ended_bytes = self._ended_body_bytes = 0
                if self._head_bytes >= limit and not self._stopped:
                    self._refuse_head(431, f"request head exceeds {limit} bytes")
            else:
                # A body: up to its end, so that the next head is counted from its start.
                size = self._body_left
                if 0 < size < len(rest):
                    piece, rest = memoryview(rest)[:size], memoryview(rest)[size:]
                else:
                    rest = b""
                self._feed(piece)
                self._ended_bytes = self._ended_body_bytes = self._head_bytes = 0
        # Deadlines for what this read left unfinished, armed once it is read (the usual
        # request comes whole in one read, and needs none).
        if self._stopped:
            return
        if self._request is not None:
            if self._timer_kind != "body":
                # A body still to come: its deadline runs from its head's end (just now).
                self._arm("body", self._config.body_timeout, self._body_expired)
        elif self._heard and self._timer_kind == "idle":
            # The first bytes of a later request: its head's deadline starts now.
            self._arm("head", self._config.header_timeout, self._head_expired)

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _HeadError):
                self._refuse_head(cause.status, cause.message)
            elif not isinstance(cause, _Stop):
                raise
        except httptools.HttpParserUpgrade:
            # CONNECT or an Upgrade header: the request itself is answered (routing refuses
            # CONNECT's empty target), nothing after it is read.
            self._stop_input()
        except httptools.HttpParserError as exc:
            self._refuse_head(400, _describe(exc, self._config))

    def eof_received(self) -> bool | None:
        if self._early is not None:
            # Not served yet: what came before it is read first. (The TLS layer closes
            # once it has passed the end on, so a client that half-closes right behind
            # its first request may get no answer; the API server never half-closes.)
            self._early_eof = True
            return None
        self._stop_input()
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._transport is None:  # reported already: by the TLS layer or a handshake's end
            return
        self._stop_timer()
        self._stopped = True
        self._transport = None
        self._drop_queued()
        self._wake_writer()
        if self._worker is not None and self._answering:
            # Nobody reads this answer: stop making it. Once gone, the connection no
            # longer counts against the bound and its body's charge is back in the
            # budget, so work left going for a closed connection would be bounded by
            # neither: a client sending reviews that read the API and closing at once,
            # in a loop, would pile up admissions and their parsed bodies without limit.
            # Admission writes nothing a retry cannot redo (a template created again
            # is found as its own), and the API server retries a request it gave up.
            self._worker.cancel()
        self._server.disconnected(self)

    def pause_writing(self) -> None:
        """The client has not read its answers and the transport's buffer is above its
        high-water mark: answer and read nothing more until it drains."""
        self._writing_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self.last_active = time.monotonic()
        self._wake_writer()
        self._resume_reading()

    # --- parser callbacks (httptools) --------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._heard = True
        self._fresh = False
        self._url = b""
        self._headers = {}
        self._header_count = 0
        self._head_floor = _SHORTEST_HEAD
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_floor += len(url)
        if len(self._url) > self._config.max_header_bytes:
            raise self._line_too_long("the request line")

    def on_header(self, name: bytes, value: bytes) -> None:
        cfg = self._config
        self._header_count += 1
        if self._header_count > cfg.max_headers:
            raise _HeadError(400, f"request head exceeds {cfg.max_headers} header lines")
        if len(name) + len(value) + 2 > cfg.max_header_bytes:
            raise self._line_too_long(f"header {name[:40].decode('latin-1')}")
        self._head_floor += len(name) + len(value) + 3
        key = name.decode("latin-1").lower()
        if key in self._headers:
            if key == "content-length":
                raise _HeadError(400, "conflicting Content-Length headers")
            self._headers[key] += ", " + value.decode("latin-1")
        else:
            self._headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        parser = self._parser
        version = parser.get_http_version()
        if version == "1.1" and "host" not in self._headers:
            raise _HeadError(400, "missing Host header: HTTP/1.1 requests must send one")
        self._disarm()
        request = _Request(
            method=parser.get_method().decode("latin-1"),
            path=_path_of(self._url),
            version=version,
            keep_alive=parser.should_keep_alive(),
            started=time.perf_counter(),
        )
        request.early = self._server.refusal(request, self._headers)
        if request.early is not None:
            self._stopped = True  # nothing more of this connection is read
            self._submit(request)
            raise _Stop
        self._charged += request.charge
        self._request = request
        if self._headers.get("expect", "").lower() == "100-continue":
            self._pending.append(_CONTINUE)
            if self._worker is None:
                self._worker = self._loop.create_task(self._answer_pending())
        self._body_left = request.charge  # its deadline: see `data_received`

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_left -= len(body)

    def on_message_complete(self) -> None:
        self._disarm()
        request, self._request = self._request, None
        self._in_message = False
        self._heard = False
        if request is None:
            return  # refused at its head: answered already
        request.body = b"".join(self._body)
        self._body = []
        self._ended_bytes += self._head_floor + len(request.body)
        self._ended_body_bytes += len(request.body)
        if self._queued >= _MAX_QUEUED:
            # More requests in one read than may wait: the parser cannot stop at a message
            # and resume later, so this one is answered last, with Connection: close, and
            # nothing after it is read (a client that pipelines retries the rest on a new
            # connection, RFC 9112 section 9.3.2).
            request.keep_alive = False
            self._overflowed = self._stopped = True
            self._submit(request)
            raise _Stop
        self._submit(request)

    # --- answering ---------------------------------------------------------------------------

    def _submit(self, request: _Request) -> None:
        self._pending.append(request)
        self._queued += 1
        if self._queued >= _MAX_QUEUED:
            self._pause_reading()
        if self._worker is None:
            self._worker = self._loop.create_task(self._answer_pending())

    async def _answer_pending(self) -> None:
        """Answer queued requests in order; then wait for the next, or close."""
        try:
            while self._pending:
                if self._writing_paused and not await self._client_read():
                    return
                item = self._pending.popleft()
                if isinstance(item, bytes):
                    self._write(item)
                    continue
                self._answering = True
                try:
                    reply, keep_alive = await self._server.answer(item)
                except asyncio.CancelledError:
                    if self._transport is None:  # cancelled for its connection's close
                        self._server.answered(item, _ABANDONED)
                    raise
                finally:
                    self._answering = False
                self._queued -= 1
                if item.charge and self._charged:  # else gone: its budget was given back
                    self._charged -= item.charge
                    self._server.bodies.used -= item.charge
                if self._transport is None:
                    self._server.answered(item, reply)
                    return  # gone meanwhile: nothing more is answered
                self._write(_response(reply, keep_alive))
                self._server.answered(item, reply)
                if not keep_alive:
                    self._finish(lingering=item.early is not None or self._overflowed)
                    return
                if self._reading_paused:
                    self._resume_reading()
                if self._pending:
                    await asyncio.sleep(0)  # one connection's queue never holds the loop
        finally:
            self._worker = None
            self.last_active = time.monotonic()
        if self._closing:
            self._finish(lingering=False)
        elif self._transport is None or self._request is not None:
            pass  # gone, or a pipelined request's body is on its own deadline
        elif self._in_message:
            # A pipelined head began while the last answer was made: bound it now.
            self._arm("head", self._config.header_timeout, self._head_expired)
        else:
            self._arm("idle", self._config.idle_timeout, self._idle_expired)

    async def _client_read(self) -> bool:
        """Wait for the client to read what was written (the write buffer below its
        low-water mark); False, with the connection aborted, when it has not in time, or
        the connection is gone. In time is the keep-alive bound, or the body's bound
        while its queued requests hold request bodies in the server's budget: a client
        that reads none of its answers must not keep bodies charged for two minutes (the
        API server reads each answer at once, and never waits here)."""
        cfg = self._config
        bound = cfg.body_timeout if self._charged else cfg.idle_timeout
        self._unread_since = time.monotonic()
        waiter = self._drained = self._loop.create_future()
        try:
            await asyncio.wait_for(waiter, bound)
        except TimeoutError:
            self.abort()
            return False
        finally:
            self._drained = None
        return self._transport is not None

    def _wake_writer(self) -> None:
        waiter = self._drained
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()
            # What the TLS layer buffers while the connection does not read: its default
            # (256 KiB) times a thousand connections would be a quarter of a GiB.
            self._transport.set_read_buffer_limits(_READ_HIGH_WATER)  # type: ignore[attr-defined]

    def _resume_reading(self) -> None:
        """Read on once a queued request was answered and the client reads its answers."""
        if self._queued < _MAX_QUEUED and not self._writing_paused:
            self._unpause_reading()

    def _unpause_reading(self) -> None:
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    def _release(self, size: int) -> None:
        if self._charged:  # nothing once the connection is gone: it gave back all it held
            self._charged -= size
            self._server.release(size)

    def shed_body(self) -> None:
        """Make room in the body budget: the request still being received is answered
        503 before the rest of its body, and the connection closes."""
        if self._request is not None:
            self._disarm()
            self._give_up_body(_OVER_BUDGET)

    def shed_unread(self) -> None:
        """Make room in the body budget: the connection, waiting for its client to read,
        is aborted, and what its queued requests held is given back now (its client
        reads no answer, a 503 included)."""
        self._drop_queued()
        self.abort()

    def _drop_queued(self) -> None:
        """Nothing more is answered: what was queued and every body held go now, their
        charge back to the budget."""
        self._pending.clear()
        self._body = []
        if self._charged:
            self._server.release(self._charged)
            self._charged = 0

    def _give_up_body(self, reply: Reply) -> None:
        """Answer the request still being received with `reply` before the rest of its
        body, giving back what its body held; nothing more is read."""
        request, self._request = self._request, None
        if request is None:
            return
        self._release(request.charge)
        request.charge = 0
        self._body = []
        self._stopped = True
        request.early = reply
        self._submit(request)

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _refuse_head(self, status: int, message: str) -> None:
        """Answer a head the parser or a limit refused, then close."""
        self._disarm()
        self._stopped = True
        self._request = None
        early = text_reply(status, message, close=True)
        self._submit(
            _Request("", "", "1.1", False, time.perf_counter(), early=early, refused_head=True)
        )

    def _line_too_long(self, what: str) -> _HeadError:
        limit = self._config.max_header_bytes
        return _HeadError(400, f"request head exceeds {limit} bytes in one line ({what})")

    def _stop_input(self) -> None:
        """No more requests come: close once what was asked is answered."""
        self._stopped = True
        self._closing = True
        if self._worker is None and self._request is None and not self._pending:
            self._finish(lingering=False)

    def stop_after_answer(self) -> None:
        """Server shutdown: close now if idle between requests, else once the request it
        carries is answered: the one being answered or received, or on a connection
        that has not begun one yet, the first (its client opened it to send one). The
        answer says ``Connection: close``; a client that never sends one is aborted at
        the end of the shutdown's grace."""
        self._closing = True
        if self._worker is None and not self._in_message and not self._fresh:
            self._finish(lingering=False)

    def abort(self) -> None:
        """Close now, with no TLS shutdown: a peer that never answers one cannot keep
        the descriptor."""
        self._stopped = True
        self._stop_timer()
        if self._transport is not None:
            self._transport.abort()

    def _finish(self, *, lingering: bool) -> None:
        """Close after the answers are written; with `lingering`, unread input is drained
        first, so that closing does not reset the connection before the client read it."""
        self._stopped = True
        self._disarm()
        if self._transport is None:
            return
        if lingering:
            self._unpause_reading()
            self._arm("linger", _LINGER_S, self._close)
        else:
            self._close()

    def _close(self) -> None:
        self._stop_timer()
        if self._transport is not None:
            self._transport.close()

    # --- timers ------------------------------------------------------------------------------

    def _arm(self, kind: str, seconds: float, callback: Callable[[], None]) -> None:
        """Call `callback` in `seconds` unless disarmed or armed anew first (one deadline
        at a time). The loop's timer is moved only to fire sooner: one set to fire later
        than the deadline is replaced, one set sooner is left to fire and find the new
        deadline (`_deadline_reached`), so a connection answering request after request
        re-arms its keep-alive deadline without touching the loop's timers."""
        deadline = self._loop.time() + seconds
        self._timer_kind, self._deadline, self._on_deadline = kind, deadline, callback
        if self._timer is None or self._timer_at > deadline:
            self._set_timer(deadline)

    def _disarm(self) -> None:
        """No deadline. A timer left set finds none when it fires; a connection that
        ends cancels it (`_stop_timer`)."""
        self._timer_kind, self._on_deadline = "", None

    def _set_timer(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._deadline_reached)
        self._timer_at = when

    def _stop_timer(self) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline_reached(self) -> None:
        self._timer = None
        callback = self._on_deadline
        if callback is None:
            return
        if self._loop.time() < self._deadline - _TIMER_SLACK_S:
            self._set_timer(self._deadline)  # armed anew since this timer was set
            return
        self._disarm()
        callback()

    def _head_expired(self) -> None:
        if self._heard:
            self._refuse_head(408, "request head not received in time")
        else:
            self._stopped = True
            self._close()

    def _body_expired(self) -> None:
        self._give_up_body(text_reply(408, "request body not received in time", close=True))

    def _idle_expired(self) -> None:
        if not self._in_message and self._worker is None:
            if self._writing_paused:
                self.abort()  # its client has not read its answers: no TLS shutdown either
            else:
                self._stopped = True
                self._close()


def connection_bound(configured: int, *, listeners: int = 1) -> int:
    """`configured`, or less where the process's open-files limit leaves room for fewer:
    each of `listeners` holds up to `configured` served connections and as many
    handshakes, one descriptor each, beside `_SPARE_FILES` for the rest."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per = 2 * max(1, listeners)
    if soft == resource.RLIM_INFINITY or configured * per <= soft - _SPARE_FILES:
        return configured
    bound = max(1, (soft - _SPARE_FILES) // per)
    logger.warning(
        "the open-files limit allows fewer webhook connections than configured; raise the "
        "container's RLIMIT_NOFILE (gpudra webhook raises its soft limit to the hard one)",
        extra={"fields": {"maxConnections": configured, "openFiles": soft, "bound": bound}},
    )
    return bound


def _path_of(target: bytes) -> str:
    """The decoded path of a request target (origin or absolute form); "" for none."""
    if not target.startswith(b"/"):
        if not target or target == b"*":
            return ""
        try:
            target = httptools.parse_url(target).path or b""
        except httptools.HttpParserInvalidURLError:
            return ""
    path = target.split(b"?", 1)[0].split(b"#", 1)[0].decode("latin-1")
    return unquote(path) if "%" in path else path


_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}


def _response(reply: Reply, keep_alive: bool) -> bytes:
    reason = _REASONS.get(reply.status, "Unknown")
    retry = f"Retry-After: {reply.retry_after}\r\n" if reply.retry_after else ""
    head = (
        f"HTTP/1.1 {reply.status} {reason}\r\n"
        f"Content-Type: {reply.content_type}\r\n"
        f"Content-Length: {len(reply.body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n{retry}\r\n"
    )
    return head.encode("latin-1") + reply.body


# What the parser's refusals mean, by the start of its message.
_PARSER_MESSAGES: Final = (
    ("Duplicate Content-Length", "conflicting Content-Length headers"),
    ("Invalid method", "malformed request line"),
    ("Invalid URL", "malformed request line"),
    ("Expected space after", "malformed request line"),
    ("Invalid HTTP version", "unsupported protocol version"),
    ("Expected HTTP/", "malformed request line"),
)


def _describe(exc: httptools.HttpParserError, limits: HttpConfig) -> str:
    """The parser's refusal in the words of the webhook's own errors, with its detail."""
    detail = (str(exc) or type(exc).__name__).split("\n", 1)[0].rstrip(":").strip()
    if isinstance(
        exc, httptools.HttpParserInvalidMethodError | httptools.HttpParserInvalidURLError
    ):
        what = "malformed request line"
    else:
        fallback = "invalid Content-Length" if "Content-Length" in detail else "malformed header"
        what = next((w for start, w in _PARSER_MESSAGES if detail.startswith(start)), fallback)
    return f"{what} ({detail})"
