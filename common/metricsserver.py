"""A Prometheus endpoint that a client holding connections cannot exhaust.

prometheus_client's `start_http_server` serves each connection on a thread of its own
and never times a client out. Anyone who reaches the port (any pod, where no
NetworkPolicy says otherwise) can hold a thread per connection for as long as it
likes: measured, 3,000 idle connections made 3,000 threads and 75 MiB more memory. In
the node agent enough of them exhaust its memory or its pids limit, and an agent that
cannot start a thread cannot prepare claims.

This serves the same WSGI app (prometheus_client's, so the exposition formats, content
negotiation and compression stay the library's), with:

- at most `max_connections` connections at a time; one more is closed at once, so the
  threads are bounded whatever a client does (a scrape then fails, and Prometheus's
  `up` says so; the agent keeps working);
- a deadline per connection (`deadline_s`) from its accept, whatever it sends: a client
  that sends its request a byte at a time, or never reads the answer, loses the
  connection when the deadline passes. wsgiref answers one request per connection, so
  keep-alive cannot hold one either;
- a bound on what a connection may send (`HEAD_BYTES`, the request line and headers,
  which is all a scrape sends), answered 431 past it: the standard library's parser
  takes 100 header lines of 64 KiB each, and 16 connections sending such heads in a
  loop took the server past 500 MiB, which it kept. The rest of such a request is read
  and dropped, so that the client gets the answer.

The server loop checks the deadlines on every turn (`service_actions`, twice a second).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from gpudra.common.logpace import LogPace
from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MetricsServer", "serve_metrics"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS: Final = 16
"""Scrapes at once: each Prometheus replica scrapes a target one request at a time."""
DEADLINE_S: Final = 10.0
"""Prometheus's default scrape timeout: no scrape it makes waits longer."""
HEAD_BYTES: Final = 32 * 1024
"""What a connection may send: a scrape's request line and headers are a few hundred
bytes (the webhook bounds its heads the same)."""


class _Bounded(io.BufferedIOBase):
    """A connection's input, of which at most `limit` bytes are read; the read that would
    go past it raises LineTooLong, which the request parser answers 431."""

    def __init__(self, raw: io.BufferedIOBase, limit: int) -> None:
        super().__init__()
        self._raw = raw
        self._limit = limit
        self._left = limit
        self.past = False
        """Whether a read went past the bound."""

    def _take(self, data: bytes) -> bytes:
        self._left -= len(data)
        if self._left < 0:
            self.past = True
            raise http.client.LineTooLong(f"request past {self._limit} bytes")
        return data

    def _want(self, size: int | None) -> int:
        return self._left + 1 if size is None or size < 0 else min(size, self._left + 1)

    def readline(self, size: int | None = -1, /) -> bytes:
        return self._take(self._raw.readline(self._want(size)))

    def read(self, size: int | None = -1, /) -> bytes:
        return self._take(self._raw.read(self._want(size)))

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Handler(WSGIRequestHandler):
    timeout = DEADLINE_S  # each socket operation; the connection's deadline bounds the sum

    def setup(self) -> None:
        super().setup()
        self._input = _Bounded(self.rfile, HEAD_BYTES)
        self.rfile = self._input

    def handle(self) -> None:
        try:
            super().handle()
        except http.client.LineTooLong:
            # The request line itself past the bound (the parser answers for headers).
            self.requestline = self.request_version = self.command = ""
            self.send_error(431)
        if self._input.past:
            self._drain()

    def _drain(self) -> None:
        """End the answer, then read what the client still sends and drop it, into one
        buffer, until it stops (or the connection's deadline): closed with data unread,
        the socket would send a reset, which can make the client lose the answer."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
            dropped = bytearray(65536)
            while self.connection.recv_into(dropped):
                pass

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (the base class writes a line per request to stderr)."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """The WSGI server, a thread per connection, with a bound on connections and a
    deadline on each."""

    daemon_threads = True
    # socketserver's default listen backlog is 5: a burst of connections overflows it,
    # and the kernel then holds clients in their handshake for seconds instead of
    # handing them over to be served or closed.
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        *,
        max_connections: int = MAX_CONNECTIONS,
        deadline_s: float = DEADLINE_S,
    ) -> None:
        # An IPv6 listen address needs an IPv6 socket (as prometheus_client chooses).
        self.address_family = socket.getaddrinfo(
            address[0], address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]
        super().__init__(address, _Handler)
        self.set_app(make_wsgi_app(registry))
        self._max = max_connections
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}  # connection -> its deadline
        self.refused = 0
        """Connections closed at once because `max_connections` were open."""
        self._refusal_log = LogPace()  # the server thread's only

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._open) >= self._max
            if not full:
                self._open[request] = time.monotonic() + self._deadline_s
        if full:
            self.refused += 1
            refused = self._refusal_log.due()
            if refused is not None:
                log.warning(
                    "metrics connections at their bound; closing new ones (a client holding "
                    "many open? restrict who reaches the port)",
                    extra={"fields": {"refused": refused, "maxConnections": self._max}},
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._finished(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._finished(request)

    def _finished(self, request: socket.socket) -> None:
        with self._lock:
            self._open.pop(request, None)

    def service_actions(self) -> None:
        """Shut down connections past their deadline; their threads then end."""
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, deadline in self._open.items() if deadline <= now]
        for conn in late:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or ran out of time: nothing to report (the base
        class prints a traceback to stderr)."""


def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    max_connections: int = MAX_CONNECTIONS,
    deadline_s: float = DEADLINE_S,
) -> tuple[MetricsServer, threading.Thread]:
    """Serve `registry` on host:port from a daemon thread; `server.shutdown()` stops it.
    Raises OSError when the address cannot be bound."""
    server = MetricsServer(
        (host, port), registry, max_connections=max_connections, deadline_s=deadline_s
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
