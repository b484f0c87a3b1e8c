"""The webhook's HTTPS transport: aiohttp's HTTP/1.1 server behind a reloading TLS context.

HTTP parsing, keep-alive and pipelining are aiohttp's (its llhttp parser, a C
extension), used through the low-level `aiohttp.web.Server`: one handler routes by path
to the endpoints it is given, so a request pays for no router or middleware. What the
webhook adds around it:

- TLS: the listener's context hands every handshake to the newest certificate
  (`ReloadingTLSContext`), so a rotated certificate reaches new connections at once
  while open ones keep working;
- every phase has its own bound, so a slow or hostile client only ever ties up its own
  connection: handshake (``handshake_timeout``); the first request head, and any head
  once its first byte arrived (``header_timeout``, answered 408); the body
  (``body_timeout``, 408) and its size, checked against ``Content-Length`` before
  reading (400); idle keep-alive (``idle_timeout``); head lines and their count (400);
- health (``/healthz``), readiness (``/readyz``, failing while draining or while the
  ``ready`` hook says no) and ``/metrics``.

The transport knows nothing of admission: an endpoint is a body in, a `Reply` out.

The idle keep-alive timeout (120 s) is above the 90 s idle-connection timeout of Go's
HTTP transports, so the API server closes pooled connections first and never writes
into one the server is closing. HTTP/1.1 requests must carry a Host header (RFC 9112):
the API server always sends one, and the parser refuses requests without.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import anyio
from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from anyio.abc import TaskStatus
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.tls import ReloadingTLSContext
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest
from yarl import URL

__all__ = ["Endpoint", "HttpConfig", "HttpServer", "Reply", "text_reply"]

logger = logging.getLogger(__name__)

_TEXT: Final = "text/plain; charset=utf-8"
_SERVICE_PATHS: Final = ("/healthz", "/readyz", "/metrics")
_SHUTDOWN_GRACE_S: Final = 1.0
"""Requests in flight when the server is stopped get this long to finish."""
_LINGER_S: Final = 1.0
"""After an answer sent before the body was read, unread input is drained this long so
that closing does not reset the connection before the client reads the answer."""
_BACKLOG: Final = 1024


@dataclass(frozen=True)
class HttpConfig:
    """Listener, TLS files and the per-phase limits."""

    cert_file: Path
    key_file: Path
    host: str | None = None
    """Address to bind; None listens on every interface (IPv4 and IPv6)."""
    port: int = 8443
    max_body_bytes: int = 3 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    """The longest request line or header line."""
    max_headers: int = 32
    handshake_timeout: float = 10.0
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    idle_timeout: float = 120.0
    cert_check_interval: float = 1.0


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    result: str
    """The requests metric's result label."""
    content_type: str = "application/json"
    close: bool = False
    """The connection cannot go on after this reply (its input is out of step)."""


Endpoint = Callable[[bytes], Awaitable[Reply]]
"""A POST endpoint: the request body in, the reply out."""


def text_reply(
    status: int, message: str, result: str = "bad_request", *, close: bool = False
) -> Reply:
    """A plain-text reply: the body is `message` and a newline."""
    return Reply(status, (message + "\n").encode(), result, _TEXT, close)


class HttpServer:
    """The HTTPS listener; run `serve` inside a task group."""

    def __init__(
        self,
        config: HttpConfig,
        endpoints: Mapping[str, Endpoint],
        metrics: WebhookMetrics,
        *,
        ready: Callable[[], bool] | None = None,
    ) -> None:
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

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); 0 before `serve` started."""
        return self._port

    def begin_shutdown(self) -> None:
        """Fail readiness and close connections after their current request, so the
        Service stops routing here before the process is stopped."""
        self._draining = True

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through `task_status`."""
        cfg = self._config
        loop = asyncio.get_running_loop()
        manager = web.Server(self._handle, loop=loop)

        listener = await loop.create_server(
            lambda: _Connection(manager, loop, cfg, self._rejected),
            cfg.host,
            cfg.port,
            ssl=self.tls.listener_context,
            ssl_handshake_timeout=cfg.handshake_timeout,
            backlog=_BACKLOG,
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.tls.watch, cfg.cert_check_interval)
                self._port = listener.sockets[0].getsockname()[1]
                self._serving = True
                logger.info("admission webhook listening", extra={"fields": {"port": self._port}})
                task_status.started(self._port)
                await anyio.sleep_forever()
        finally:
            self._serving = False
            listener.close()
            with anyio.CancelScope(shield=True):
                manager.pre_shutdown()
                await manager.shutdown(_SHUTDOWN_GRACE_S)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = cast(_Connection, request.protocol)
        connection.head_received()
        started = time.perf_counter()
        path = request.path
        label = path if path in self._endpoints or path in _SERVICE_PATHS else "other"
        try:
            reply = await self._route(request, path)
        except Exception:
            logger.exception("unexpected error answering a webhook request")
            reply = text_reply(500, "internal error", "error", close=True)
        keep_alive = request.keep_alive and not reply.close and not self._draining
        connection.request_done(keep_alive)
        response = web.Response(
            status=reply.status,
            body=reply.body,
            headers={
                "Content-Type": reply.content_type,
                "Connection": "keep-alive" if keep_alive else "close",
            },
        )
        if not keep_alive:
            response.force_close()
        if reply.close and reply.status < 500:
            logger.info(
                "rejected malformed webhook request",
                extra={"fields": {"status": reply.status, "error": reply.body.decode().strip()}},
            )
        self._metrics.observe_request(label, reply.result, time.perf_counter() - started)
        return response

    async def _route(self, request: web.BaseRequest, path: str) -> Reply:
        method = request.method
        if not path.startswith("/"):
            return text_reply(400, "malformed request line: no request target", close=True)
        if request.version not in (HttpVersion11, HttpVersion10):
            version = f"HTTP/{request.version.major}.{request.version.minor}"
            return text_reply(
                400, f"unsupported protocol version {version}; use HTTP/1.1", close=True
            )
        endpoint = self._endpoints.get(path)
        if endpoint is not None:
            if method != "POST":
                return text_reply(405, f"{path} accepts POST only")
            body = await self._read_body(request)
            return body if isinstance(body, Reply) else await endpoint(body)
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

    async def _read_body(self, request: web.BaseRequest) -> bytes | Reply:
        """The whole body within its size and time bounds, or the error to answer."""
        cfg = self._config
        if "Transfer-Encoding" in request.headers:
            message = "Transfer-Encoding is not supported; send Content-Length"
            return text_reply(501, message, close=True)
        length = request.content_length
        if length is None:
            return text_reply(411, "POST needs a Content-Length header", close=True)
        if length > cfg.max_body_bytes:
            message = (
                f"request body of {length} bytes exceeds the limit of "
                f"{cfg.max_body_bytes} bytes; AdmissionReviews of Pods are far smaller"
            )
            return text_reply(400, message, close=True)
        if not length:
            return b""
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer proper has not started
        content = request.content
        try:
            if content.is_eof():  # the usual case: it came with the head, nothing to wait for
                return await content.readexactly(length)
            with anyio.fail_after(cfg.body_timeout):
                return await content.readexactly(length)
        except TimeoutError:
            return text_reply(408, "request body not received in time", close=True)
        except asyncio.IncompleteReadError:
            return text_reply(400, "request body ended before Content-Length bytes", close=True)
        except ConnectionError:
            # The client went away (FIN, close_notify, reset) while its body was read: its
            # error, not ours, so it is answered (if anyone listens) and counted as a 400.
            return text_reply(400, "connection closed before the request body arrived", close=True)

    def _ready(self) -> bool:
        if not self._serving or self._draining:
            return False
        return self._ready_check() if self._ready_check else True

    def _rejected(self, status: int, message: str) -> None:
        """Count and log a request refused before it had a path."""
        self._metrics.inc(
            self._metrics.requests, "other", "bad_request" if status < 500 else "error"
        )
        logger.info(
            "rejected malformed webhook request",
            extra={"fields": {"status": status, "error": message}},
        )


class _Connection(RequestHandler):
    """aiohttp's connection, plus a deadline on each request head and our wording for
    requests its parser refuses.

    The deadline runs from the connection's start for the first request, and from the
    first byte of any later one (idle time between requests is aiohttp's keep-alive
    timeout). It stops when the head is complete: the handler calls `head_received`.
    A head still partial at the deadline is answered 408; a connection that never sent
    a byte is closed without an answer. (The head of a pipelined request whose first
    bytes came while the previous request was being answered has only the keep-alive
    bound: the API server does not pipeline.)
    """

    __slots__ = (
        "_closing",
        "_config",
        "_event_loop",
        "_head_timer",
        "_heard",
        "_in_request",
        "_on_reject",
    )

    def __init__(
        self,
        manager: web.Server,
        loop: asyncio.AbstractEventLoop,
        config: HttpConfig,
        on_reject: Callable[[int, str], None],
    ) -> None:
        super().__init__(
            manager,
            loop=loop,
            keepalive_timeout=config.idle_timeout,
            # No access log (the requests metric counts them): aiohttp's documented
            # off switch, though its annotation only names Logger.
            access_log=None,  # type: ignore[arg-type]
            max_line_size=config.max_header_bytes,
            max_field_size=config.max_header_bytes,
            max_headers=config.max_headers,
            lingering_time=_LINGER_S,
            # Bodies are read as sent: Content-Length bounds what is read.
            auto_decompress=False,
        )
        self._event_loop = loop
        self._config = config
        self._on_reject = on_reject
        # aiohttp's C parser hands over a request line without a target (`CONNECT   `) as
        # a message with no URL, and building the request from it then fails in a task
        # nobody awaits, leaving the client without an answer. An empty target instead:
        # routing answers it 400.
        make_request = self._request_factory
        assert make_request is not None

        def request_factory(message: Any, *args: Any) -> web.BaseRequest:
            if getattr(message, "url", True) is None:
                message = message._replace(url=URL(""), path="")
            return make_request(message, *args)

        self._request_factory = request_factory
        self._head_timer: asyncio.TimerHandle | None = None
        self._heard = False
        self._in_request = False
        self._closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._in_request and not self._closing:
            if self._head_timer is None:
                self._arm()
            self._heard = True
        RequestHandler.data_received(self, data)  # per TLS record: skip super()'s lookup

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def head_received(self) -> None:
        self._disarm()
        self._in_request = True

    def request_done(self, keep_alive: bool) -> None:
        self._in_request = False
        self._closing = not keep_alive

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer what the parser refused (or an error aiohttp caught) and close."""
        self._disarm()
        self._closing = True
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was sent already; closing the connection")
        text = _describe(exc, self._config) if isinstance(exc, HttpProcessingError) else None
        text = text or "internal error"
        self._on_reject(status, text)
        response = web.Response(
            status=status, text=text + "\n", headers={"Connection": "close"}, charset="utf-8"
        )
        response.force_close()
        return response

    def _arm(self) -> None:
        self._disarm()
        self._heard = False
        self._head_timer = self._event_loop.call_later(
            self._config.header_timeout, self._head_expired
        )

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        transport = self.transport
        if self._in_request or self._closing or transport is None:
            return
        if self._heard:
            message = "request head not received in time"
            self._on_reject(408, message)
            body = (message + "\n").encode()
            transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            )
        self.force_close()


# What the parser's refusals mean, by the start of its message.
_PARSER_MESSAGES: Final = (
    ("Missing 'Host' header", "missing Host header: HTTP/1.1 requests must send one"),
    ("Duplicate Content-Length", "conflicting Content-Length headers"),
    ("Too many headers", "request head exceeds {max_headers} header lines"),
)


def _describe(exc: HttpProcessingError, limits: HttpConfig) -> str:
    """The parser's refusal in the words of the webhook's own errors, with its detail."""
    detail = (exc.message or type(exc).__name__).split("\n", 1)[0].rstrip(":").strip()
    if isinstance(exc, LineTooLong):
        what = f"request head exceeds {limits.max_header_bytes} bytes in one line"
    elif isinstance(exc, BadStatusLine):
        what = "malformed request line"
    else:
        fallback = "invalid Content-Length" if "Content-Length" in detail else "malformed header"
        what = next((w for start, w in _PARSER_MESSAGES if detail.startswith(start)), fallback)
    return f"{what.format(max_headers=limits.max_headers)} ({detail})"
