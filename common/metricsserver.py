"""A Prometheus endpoint that a client holding connections cannot exhaust, nor starve
the others of.

prometheus_client's `start_http_server` serves each connection on a thread of its own
and never times a client out. Anyone who reaches the port (any pod, where no
NetworkPolicy says otherwise) can hold a thread per connection for as long as it
likes: measured, 3,000 idle connections made 3,000 threads and 75 MiB more memory. In
the node agent enough of them exhaust its memory or its pids limit, and an agent that
cannot start a thread cannot prepare claims.

This serves the same WSGI app (prometheus_client's, so the exposition formats, content
negotiation and compression stay the library's), with:

- at most `max_connections` connections at a time, so the threads are bounded whatever
  a client does. That bound alone let one client starve the others (20 idle
  connections, reopened as each was closed, failed every scrape), so one client gets a
  share of it, and connections that send nothing do not keep their place:
- at most `max_per_client` connections at a time from one peer address; one more from
  it is closed at once. Prometheus scrapes a target one request at a time from each
  replica, and each replica (and `gpudra top`) connects from an address of its own, so
  one client holding connections leaves the others room;
- a deadline for the request head (`head_deadline_s`) from the connection's accept: a
  scrape sends its request line and headers as soon as it connects, so a connection
  that has not sent all of them by then (idle, or sending them a byte at a time) is
  closed, without an answer. Idle connections, from as many addresses as a client has,
  hold their place that long at most;
- at the bound, a new connection takes the place of one whose answer its client does
  not read: the answer is sent as the socket takes it, and one whose write has waited
  `WRITE_STALL_S` for the client is closed, the one waiting longest first. Failing
  that, it takes the place of the one accepted longest ago among those that have not
  sent a complete head yet; when every open connection is being answered, and no
  answer is stalled, the new one is closed instead. The one making room is waited for
  until its thread ends (at once: its socket is shut down under its read or its
  write), so the threads stay within the bound. The webhook's transport sheds its
  connections the same way (a connection being answered is not closed for another,
  one whose answers its client does not read is) and counts them in a metric of the
  same shape. (Held as being answered while their writes waited, 16 connections that
  sent a scrape of a large exposition and never read, 4 from each of 4 addresses,
  reopened as the deadline closed them, kept every scrape out);
- a deadline per connection (`deadline_s`) from its accept, whatever it sends: a client
  that never reads the answer loses the connection when the deadline passes, or
  sooner when a new connection needs its place. wsgiref answers one request per
  connection, so keep-alive cannot hold one either;
- a bound on what a connection may send (`HEAD_BYTES`, the request line and headers,
  which is all a scrape sends), answered 431 past it: the standard library's parser
  takes 100 header lines of 64 KiB each, and 16 connections sending such heads in a
  loop took the server past 500 MiB, which it kept. The rest of such a request is read
  and dropped, so that the client gets the answer, for `DRAIN_S` and `DRAIN_BYTES` at
  most; meanwhile the connection is no longer being answered and makes room for a new
  one as a connection without a head does. (Held as being answered, 16 such
  connections dripping a byte at a time, 4 from each of 4 addresses, kept every scrape
  out.)

Connections closed by these bounds count in `gpudra_metrics_connections_shed_total`,
on the registry served, by `action`: `refused`, `refused_per_client`, `evicted`,
`stalled`, `timed_out` (see `MetricsServer`). The server loop checks the deadlines on
every turn (`service_actions`, twice a second).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import logging
import socket
import threading
import time
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Final, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from gpudra.common.logpace import LogPace
from prometheus_client import CollectorRegistry, Counter, make_wsgi_app

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["MetricsServer", "serve_metrics"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS: Final = 16
"""Scrapes at once: each Prometheus replica scrapes a target one request at a time."""
MAX_PER_CLIENT: Final = 4
"""Connections at once from one address: a Prometheus replica scrapes a target one
request at a time; room for a scrape cut short and retried, and for `gpudra top` run by
people behind one address, while one client holding connections takes a quarter of the
default bound at most."""
DEADLINE_S: Final = 10.0
"""Prometheus's default scrape timeout: no scrape it makes waits longer."""
HEAD_DEADLINE_S: Final = 2.0
"""From accept to a complete request head: a scrape sends its head (a few hundred
bytes) as soon as it connects, so it arrives within a round trip; 2 s is many."""
HEAD_BYTES: Final = 32 * 1024
"""What a connection may send: a scrape's request line and headers are a few hundred
bytes (the webhook bounds its heads the same)."""
DRAIN_S: Final = 1.0
"""How long the rest of a request refused 431 is read and dropped (bounded by the
connection's deadline too): long enough for the client to see the answer before the
close, short enough that such connections do not hold places."""
DRAIN_BYTES: Final = 8 * 1024 * 1024
"""What of the rest of a refused request is read and dropped at most: more than the
largest head the standard library's parser takes (100 lines of 64 KiB), so that a
client that sent one still gets its answer."""
WRITE_STALL_S: Final = 0.5
"""How long an answer's write may wait for its client to read before the connection
can be closed to make room for a new one. Prometheus (and `gpudra top`) read an answer
as it arrives, so on a cluster's network a write waits on them for milliseconds; one
that has not moved for half a second is a client that does not read (or a path that
lost the same packet through two retransmission timeouts, 200 ms the first, whose
scrape Prometheus retries at its next interval). The write is only given up when a new
connection needs the place: with room left, a stalled answer holds nothing another
client needs (its thread and buffers are within the bound, as a scrape's are) and the
connection's deadline ends it, so a path that loses packets for a moment fails no
scrape that nothing needed to close (the webhook likewise sheds a connection whose
answers are unread only for room, or after its own deadline)."""
_MAKE_ROOM_S: Final = 1.0
"""How long a new connection waits for the thread of the one closed to make room for
it (which ends as soon as it runs: its socket is shut down under its read or its
write) before it is closed instead, so that the threads never outnumber the bound."""
SHED_METRIC: Final = "gpudra_metrics_connections_shed"
"""The counter of connections closed by a bound (`_total` in the exposition)."""


@dataclass
class _Connection:
    """What the server knows of one open connection; changed under the server's lock."""

    peer: str
    accepted: float
    deadline: float
    head_deadline: float
    answering: bool = False
    """Its head is complete (or refused) and the server is answering it: no longer
    under the head deadline, and closed to make room for another only while its answer
    is stalled (`stalled_for`)."""
    cut: bool = False
    """Closed by the server (a deadline, or room made for another): its thread is
    ending, and answers nothing."""
    sending_since: float | None = None
    """When the write of its answer now under way began to wait for the socket (None:
    none is): the socket takes what its buffers hold at once, so a write that waits is
    one whose client does not read."""

    def stalled_for(self, now: float) -> float:
        """How long its answer's write has waited for its client (0: no write waits)."""
        if not self.answering or self.sending_since is None:
            return 0.0
        return now - self.sending_since

    def ending(self) -> bool:
        """Cut, and its thread ends at once: it was not being answered (the shutdown
        ends its read) or was in a write (the shutdown fails it). One cut while making
        its answer may take its time."""
        return self.cut and (not self.answering or self.sending_since is not None)


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


class _Answer(io.BufferedIOBase):
    """A connection's output, sent as the socket takes it, each send's wait told to the
    server (`MetricsServer.sending`): a send returns as soon as the socket took part of
    it, so one that waits long is an answer its client does not read, which a new
    connection may then take the place of."""

    def __init__(self, conn: socket.socket, server: MetricsServer) -> None:
        super().__init__()
        self._conn = conn
        self._server = server

    def writable(self) -> bool:
        return True

    def write(self, buffer: ReadableBuffer, /) -> int:
        with memoryview(buffer) as view, view.cast("B") as data:
            sent = 0
            while sent < len(data):
                self._server.sending(self._conn, time.monotonic())
                sent += self._conn.send(data[sent:])
                # Not reached when the send fails: the connection, cut or broken, is
                # ending, and counts as in its write until its thread ends.
                self._server.sending(self._conn, None)
            return len(data)


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        # Each socket operation: the connection's deadline (`service_actions`) bounds
        # their sum, and no one of them should end the connection before it.
        self.connection.settimeout(self._server.deadline_s)
        self._input = _Bounded(self.rfile, HEAD_BYTES)
        self.rfile = self._input
        self.wfile = _Answer(self.connection, self._server)

    def handle(self) -> None:
        try:
            super().handle()
        except http.client.LineTooLong:
            # The request line itself past the bound (the parser answers for headers).
            if self._server.answering(self.connection):
                self.requestline = self.request_version = self.command = ""
                self.send_error(431)
        if self._input.past:
            self._drain()

    def parse_request(self) -> bool:
        """The head is read (or refused, its answer sent): the connection is being
        answered from here, unless the server closed it meanwhile (then its head may be
        what was read before the close, and is not answered)."""
        parsed = super().parse_request()
        return self._server.answering(self.connection) and parsed

    @property
    def _server(self) -> MetricsServer:
        return cast(MetricsServer, self.server)

    def _drain(self) -> None:
        """End the answer, then read what the client still sends and drop it, into one
        buffer, until it stops, `DRAIN_BYTES` were read or the server closes it
        (`MetricsServer.draining`): closed with data unread, the socket would send a
        reset, which can make the client lose the answer."""
        if not self._server.draining(self.connection):
            return
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
            dropped = bytearray(65536)
            left = DRAIN_BYTES
            while left > 0 and (read := self.connection.recv_into(dropped)):
                left -= read

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (the base class writes a line per request to stderr)."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """The WSGI server, a thread per connection, with bounds on connections (in all and
    per peer address) and deadlines on each (its head, and the whole exchange).

    Connections closed by a bound are counted in `gpudra_metrics_connections_shed_total`
    on `registry`, by `action`: `refused` (a new one, at `max_connections` with every
    open one being answered and no answer stalled), `refused_per_client` (a new one
    from an address holding `max_per_client`), `evicted` (one without a complete head,
    for a new one at `max_connections`), `stalled` (one whose answer's write has waited
    `WRITE_STALL_S` for its client to read, for a new one at `max_connections`; before
    any without a head, which may be a scrape whose head is not read yet) and
    `timed_out` (past its head deadline or its deadline). The counter leaves the
    registry when the server is shut down.
    """

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
        max_per_client: int = MAX_PER_CLIENT,
        deadline_s: float = DEADLINE_S,
        head_deadline_s: float = HEAD_DEADLINE_S,
    ) -> None:
        # An IPv6 listen address needs an IPv6 socket (as prometheus_client chooses).
        self.address_family = socket.getaddrinfo(
            address[0], address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]
        super().__init__(address, _Handler)
        self.set_app(make_wsgi_app(registry))
        self._max = max_connections
        self._max_per_client = max_per_client
        self.deadline_s = deadline_s
        self._head_deadline_s = min(head_deadline_s, deadline_s)
        self._changed = threading.Condition()  # its lock guards `_open`; notified on a close
        self._open: dict[socket.socket, _Connection] = {}
        self._registry = registry
        try:
            self._shed = self._shed_counter(registry)
        except BaseException:
            self.server_close()  # the name is served already: release the port
            raise
        self._shed_log = LogPace()  # the server thread's only

    @staticmethod
    def _shed_counter(registry: CollectorRegistry) -> Counter:
        return Counter(
            SHED_METRIC,
            "Connections to the metrics port closed by its bounds: 'refused' (a new one, "
            "at the connection bound with every open one being answered, none stalled), "
            "'refused_per_client' (a new one, from an address at its own bound), "
            "'evicted' (one without a complete request head, for a new one at the "
            "connection bound), 'stalled' (one whose client does not read its answer, "
            "for a new one at the connection bound), 'timed_out' (past its head's "
            "deadline or its own).",
            ["action"],
            registry=registry,
        )

    def process_request(self, request: Any, client_address: Any) -> None:
        """Take a new connection in, within the bounds, or close it at once."""
        now = time.monotonic()
        peer = str(client_address[0])
        with self._changed:
            action = self._admit(peer)
            if action in (None, "evicted"):
                self._open[request] = _Connection(
                    peer, now, now + self.deadline_s, now + self._head_deadline_s
                )
        if action in ("refused", "refused_per_client"):
            self._count(action)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._finished(request)
            raise

    def _admit(self, peer: str) -> str | None:
        """Under the lock: make room for a connection from `peer`, and add nothing.
        None: it fits; 'evicted': it fits, another was closed for it (counted by why);
        else why not."""
        if sum(1 for c in self._open.values() if c.peer == peer) >= self._max_per_client:
            return "refused_per_client"
        if len(self._open) < self._max:
            return None
        # A connection cut already whose thread ends at once makes the room; failing
        # that, one is closed for it. One cut while making its answer may take its
        # time: it is not waited for.
        if not any(c.ending() for c in self._open.values()):
            room = self._room(time.monotonic())
            if room is None:
                return "refused"
            self._cut(*room)
        if not self._changed.wait_for(lambda: len(self._open) < self._max, _MAKE_ROOM_S):
            return "refused"
        return "evicted"

    def _room(self, now: float) -> tuple[socket.socket, str] | None:
        """Under the lock, at the bound: the connection to close for a new one, and why;
        None when every open one is being answered and no answer is stalled. First the
        one whose answer has waited longest past `WRITE_STALL_S` for its client, which
        is no scrape (Prometheus reads as the answer comes); then the one accepted
        longest ago without a complete head, which may be a scrape whose head its
        thread has not read yet."""
        stalled = [(c.stalled_for(now), s) for s, c in self._open.items() if not c.cut]
        longest = max(stalled, key=lambda w: w[0], default=None)
        if longest is not None and longest[0] >= WRITE_STALL_S:
            return longest[1], "stalled"
        waiting = [(c.accepted, s) for s, c in self._open.items() if not c.answering]
        if not waiting:
            return None
        return min(waiting, key=lambda w: w[0])[1], "evicted"

    def _cut(self, conn: socket.socket, action: str) -> None:
        """Under the lock: close `conn` under its thread, which then ends; counted
        before its client can see it closed."""
        self._open[conn].cut = True
        self._count(action)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def answering(self, conn: socket.socket) -> bool:
        """Its thread has read `conn`'s head (or refused it): from here the head deadline
        no longer applies, and it is not closed for another unless its answer stalls
        (`WRITE_STALL_S`). False when it was cut already: its thread answers nothing
        then."""
        with self._changed:
            open_ = self._open.get(conn)
            if open_ is None or open_.cut:
                return False
            open_.answering = True
            return True

    def sending(self, conn: socket.socket, since: float | None) -> None:
        """`conn`'s thread begins a send of its answer at `since` (None: the send
        returned, the client took some of it): how long a send has waited tells an
        answer its client does not read (`WRITE_STALL_S`)."""
        with self._changed:
            open_ = self._open.get(conn)
            if open_ is not None:
                open_.sending_since = since

    def draining(self, conn: socket.socket) -> bool:
        """`conn`'s request was refused and answered: what it still sends is dropped
        until `DRAIN_S` from now at most, and it makes room for a new connection as one
        without a head does, so that refused connections cannot hold the places of
        scrapes. False when it was cut already."""
        with self._changed:
            open_ = self._open.get(conn)
            if open_ is None or open_.cut:
                return False
            open_.answering = False
            open_.head_deadline = min(open_.deadline, time.monotonic() + DRAIN_S)
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._finished(request)

    def _finished(self, request: socket.socket) -> None:
        with self._changed:
            self._open.pop(request, None)
            self._changed.notify_all()

    def service_actions(self) -> None:
        """Shut down connections past their deadline, or their head's; their threads
        then end."""
        now = time.monotonic()
        with self._changed:
            late = [
                conn
                for conn, c in self._open.items()
                if not c.cut and (c.deadline <= now or (c.head_deadline <= now and not c.answering))
            ]
            for conn in late:
                self._cut(conn, "timed_out")

    def _count(self, action: str) -> None:
        """Count a connection closed by a bound; log at most once a minute (a flood
        closes thousands a second). The server thread's only, as `_shed_log` is."""
        self._shed.labels(action).inc()
        shed = self._shed_log.due()
        if shed is not None:
            log.warning(
                "metrics connections closed at their bounds (a client holding many open? "
                "restrict who reaches the port)",
                extra={
                    "fields": {
                        "shed": shed,
                        "last": action,
                        "maxConnections": self._max,
                        "maxPerClient": self._max_per_client,
                    }
                },
            )

    def shutdown(self) -> None:
        """Stop serving; the shed counter leaves the registry, so that another server may
        serve it."""
        super().shutdown()
        with contextlib.suppress(KeyError):
            self._registry.unregister(self._shed)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or ran out of time: nothing to report (the base
        class prints a traceback to stderr)."""


def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    max_connections: int = MAX_CONNECTIONS,
    max_per_client: int = MAX_PER_CLIENT,
    deadline_s: float = DEADLINE_S,
    head_deadline_s: float = HEAD_DEADLINE_S,
) -> tuple[MetricsServer, threading.Thread]:
    """Serve `registry` on host:port from a daemon thread; `server.shutdown()` stops it.
    Raises OSError when the address cannot be bound."""
    server = MetricsServer(
        (host, port),
        registry,
        max_connections=max_connections,
        max_per_client=max_per_client,
        deadline_s=deadline_s,
        head_deadline_s=head_deadline_s,
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
