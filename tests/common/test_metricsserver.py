"""The node agent's metrics endpoint over real sockets: it serves the registry, and a
client that holds connections, drips its request or sends a huge one can neither grow
its threads past the bound, keep a connection past its deadline, starve other clients
of the bound nor make the server hold more than a bounded head."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from gpudra.common import metricsserver
from gpudra.common.metricsserver import (
    HEAD_BYTES,
    MAX_CONNECTIONS,
    MAX_PER_CLIENT,
    serve_metrics,
)
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

GUARD = 10.0  # seconds: only a hang guard, never a speed check
LONG = 600.0  # a deadline no test reaches


@contextmanager
def serving(
    registry: CollectorRegistry | None = None, host: str = "127.0.0.1", **bounds: float
) -> Iterator[tuple[int, CollectorRegistry]]:
    if registry is None:
        registry = CollectorRegistry()
        Counter("gpudra_test_scrapes", "A series to find in the answer.", registry=registry).inc()
    server, thread = serve_metrics(host, 0, registry, **bounds)
    try:
        yield server.server_address[1], registry
    finally:
        server.shutdown()
        server.server_close()
        thread.join(GUARD)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the server from the loopback address `source` (Linux answers on
    all of 127.0.0.0/8, so each is a client address of its own)."""
    target = "::1" if ":" in source else "127.0.0.1"
    return socket.create_connection((target, port), timeout=GUARD, source_address=(source, 0))


def scrape(
    port: int,
    head: bytes = b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n",
    source: str = "127.0.0.1",
) -> bytes:
    with connect(port, source) as s:
        s.sendall(head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def closed_by_server(s: socket.socket) -> bool:
    """True once the server has closed `s` (EOF or reset), waiting up to GUARD."""
    s.settimeout(GUARD)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def still_open(s: socket.socket) -> bool:
    """Whether the server has not closed `s` (nothing to read, no EOF), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        s.settimeout(GUARD)


def eventually(condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within GUARD (a thread that has left the server's books
    takes a moment more to end)."""
    deadline = time.monotonic() + GUARD
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def shed(registry: CollectorRegistry, action: str) -> float:
    value = registry.get_sample_value("gpudra_metrics_connections_shed_total", {"action": action})
    return value or 0.0


def test_serves_the_registry() -> None:
    with serving() as (port, _registry):
        answer = scrape(port)
    assert answer.startswith(b"HTTP/1.0 200 OK")
    assert b"gpudra_test_scrapes_total 1.0" in answer


def test_held_connections_cannot_grow_the_threads_past_the_bound() -> None:
    """Idle connections from as many addresses as they like: at the bound each new one
    takes the place of the one accepted longest ago (none has sent a request), whose
    thread ends first, so the threads stay within the bound and a scrape gets in."""
    with serving(max_connections=4, deadline_s=LONG, head_deadline_s=LONG) as (port, registry):
        before = threading.active_count()
        held = [connect(port, f"127.0.1.{i}") for i in range(1, 13)]
        try:
            # The server takes them in order: each past the fourth evicts the oldest.
            assert all(closed_by_server(s) for s in held[:8])
            assert all(still_open(s) for s in held[8:])
            assert eventually(lambda: threading.active_count() <= before + 4)
            assert shed(registry, "evicted") == 8
            assert b"gpudra_test_scrapes_total 1.0" in scrape(port, source="127.0.0.2")
            assert closed_by_server(held[8])  # the scrape took its place
            assert shed(registry, "refused") == 0
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize(
    ("host", "holder", "scraper"),
    [("127.0.0.1", "127.0.0.1", "127.0.0.2"), ("::", "::1", "127.0.0.1")],
    ids=["ipv4", "ipv6-holder"],
)
def test_one_client_holding_connections_cannot_starve_another(
    host: str, holder: str, scraper: str
) -> None:
    """The default bounds, one client holding three times as many idle connections as
    the server serves: past its own bound each is closed at once, and a scrape from
    another address is served while the client's connections stay open. (Before the
    per-client bound, 20 such connections, reopened as each was closed, failed every
    scrape.)"""
    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with serving(host=host, deadline_s=LONG, head_deadline_s=LONG) as (port, registry):
        held = [connect(port, holder) for _ in range(3 * MAX_CONNECTIONS)]
        try:
            assert all(closed_by_server(s) for s in held[MAX_PER_CLIENT:])
            assert shed(registry, "refused_per_client") == 3 * MAX_CONNECTIONS - MAX_PER_CLIENT
            assert b"gpudra_test_scrapes_total 1.0" in scrape(port, source=scraper)
            assert all(still_open(s) for s in held[:MAX_PER_CLIENT])
            assert shed(registry, "evicted") == shed(registry, "refused") == 0
        finally:
            for s in held:
                s.close()


def test_a_connection_without_a_complete_head_is_closed_at_the_head_deadline() -> None:
    """A scrape sends its head as it connects; one that sends nothing, or part of a
    head, is closed at the head deadline, long before the connection's own, without an
    answer."""
    with serving(deadline_s=LONG, head_deadline_s=0.2) as (port, registry):
        silent = connect(port)
        partial = connect(port, "127.0.0.2")
        try:
            partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: m\r\n")  # no blank line
            assert closed_by_server(silent)
            partial.settimeout(GUARD)
            assert partial.recv(65536) == b""  # closed, nothing answered
            assert shed(registry, "timed_out") == 2
        finally:
            silent.close()
            partial.close()
        assert b"gpudra_test_scrapes_total 1.0" in scrape(port)


class _Blocking:
    """A collector that holds each scrape until released: connections being answered."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def collect(self) -> Iterator[Metric]:
        self.entered.release()
        self.release.wait(GUARD)
        yield GaugeMetricFamily("gpudra_test_held", "Answered once released.", value=1)


def test_a_connection_being_answered_is_never_shed() -> None:
    """At the bound with every connection being answered, the new one is closed, not
    one of theirs."""
    registry = CollectorRegistry()
    blocking = _Blocking()
    registry.register(blocking)
    with serving(registry, max_connections=2, deadline_s=LONG, head_deadline_s=LONG) as (
        port,
        _registry,
    ):
        answers: list[bytes] = []
        scrapes = [
            threading.Thread(target=lambda src=src: answers.append(scrape(port, source=src)))
            for src in ("127.0.0.2", "127.0.0.3")
        ]
        for t in scrapes:
            t.start()
        try:
            for _ in scrapes:
                assert blocking.entered.acquire(timeout=GUARD)
            with connect(port, "127.0.0.4") as late:
                assert closed_by_server(late)
        finally:
            blocking.release.set()
            for t in scrapes:
                t.join(GUARD)
        assert len(answers) == 2
        # Read once released: reading the registry collects the held collector too.
        assert shed(registry, "refused") == 1
        assert shed(registry, "evicted") == 0
        assert all(b"gpudra_test_held 1.0" in a for a in answers)


class _Large:
    """A collector with a large exposition (one label value of `size` bytes): the answer
    of a node with many GPUs and claims, asked for uncompressed, larger than what the
    sockets between the server and a client that does not read can hold."""

    def __init__(self, size: int) -> None:
        self._pad = "a" * size

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpudra_test_large", "A large answer.", labels=["pad"])
        family.add_metric([self._pad], 1)
        yield family


def _unread_scrape(port: int, source: str) -> socket.socket:
    """A client at `source` that sends a scrape and never reads its answer, returned once
    the answer has begun to arrive (peeked at, not read: the window stays shut), so
    that its connection is being answered. Its receive buffer and segments are as small
    as it may ask for (before it connects, so that the window it offers is small), so
    that the server's sockets take tens of KiB of the answer before the server's write
    waits for it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.settimeout(GUARD)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
        assert s.recv(1, socket.MSG_PEEK) == b"H"
    except BaseException:
        s.close()
        raise
    return s


def _served(port: int, source: str) -> bool:
    """Whether a scrape from `source` gets the registry (a connection closed at once, at
    the bound, may be reset with its request unread)."""
    try:
        return b"gpudra_test_scrapes_total 1.0" in scrape(port, source=source)
    except (ConnectionResetError, BrokenPipeError):
        return False


def test_answers_their_clients_do_not_read_make_room_for_scrapes() -> None:
    """An escape attempt on the metrics port: clients fill the bound with scrapes of a
    large exposition and never read the answers, each address within its share. Held as
    being answered while their writes waited, such connections kept every scrape out
    until the connection's deadline, again after each reconnect. An answer whose write
    has waited `WRITE_STALL_S` for its client makes room for a new connection, as one
    without a head does: the scrape, refused while no write had waited that long, gets
    in, and the connection closed for it is counted `stalled`."""
    registry = CollectorRegistry()
    Counter("gpudra_test_scrapes", "A series to find in the answer.", registry=registry).inc()
    registry.register(_Large(4 * 1024 * 1024))
    with serving(
        registry, max_connections=4, max_per_client=2, deadline_s=LONG, head_deadline_s=LONG
    ) as (port, _registry):
        held = [_unread_scrape(port, f"127.0.0.{2 + i // 2}") for i in range(4)]
        try:
            assert eventually(lambda: _served(port, "127.0.0.4"))
            assert shed(registry, "stalled") == 1
            assert shed(registry, "evicted") == shed(registry, "timed_out") == 0
        finally:
            for s in held:
                s.close()


def test_the_registry_can_be_served_again_once_shut_down() -> None:
    """The shed counter leaves the registry with its server, so that the registry can
    be served again (the tests of the agent's series serve theirs once per scrape)."""
    registry = CollectorRegistry()
    for _ in range(2):
        with serving(registry) as (port, _registry):
            assert b"gpudra_metrics_connections_shed_total" in scrape(port)


def test_a_client_dripping_its_request_loses_it_at_the_deadline() -> None:
    with serving(max_connections=2, deadline_s=0.5) as (port, _registry):
        drip = socket.create_connection(("127.0.0.1", port))
        started = time.monotonic()
        try:
            drip.settimeout(0.1)
            cut = False
            for byte in b"GET /metrics HTTP/1.1\r\nHost: m\r\n" * 10:
                try:
                    drip.sendall(bytes([byte]))
                    if drip.recv(1) == b"":
                        cut = True
                        break
                except TimeoutError:
                    continue  # nothing yet: the server is still reading
                except (BrokenPipeError, ConnectionResetError):
                    cut = True
                    break
                assert time.monotonic() - started < GUARD
            assert cut, "the dripping client kept its connection"
        finally:
            drip.close()
        assert b"gpudra_test_scrapes_total" in scrape(port)


def _head(request_line: bytes, lines: int, line_bytes: int) -> bytes:
    """A request with `lines` header lines of `line_bytes` each."""
    line = b"X-Pad: " + b"a" * (line_bytes - 9) + b"\r\n"
    return request_line + b"\r\nHost: m\r\n" + line * lines + b"\r\n"


@pytest.mark.parametrize(
    ("what", "head"),
    [
        # As many lines, as long, as the standard library's parser takes: 6 MiB.
        ("headers", _head(b"GET /metrics HTTP/1.1", 98, 64 * 1024)),
        ("request line", b"GET /" + b"m" * (48 * 1024) + b" HTTP/1.1\r\n\r\n"),
    ],
)
def test_a_request_past_the_head_bound_is_answered_431(what: str, head: bytes) -> None:
    """The standard library's parser reads 100 header lines of 64 KiB each: 16
    connections sending such heads in a loop held over 500 MiB. Past `HEAD_BYTES` the
    request is answered 431 without reading on; a scrape's head, well under, is served."""
    with serving() as (port, _registry):
        answer = scrape(port, head)
        assert answer.startswith(b"HTTP/1.0 431"), (what, answer[:80])
        under = _head(b"GET /metrics HTTP/1.1", (HEAD_BYTES - 2048) // 1024, 1024)
        assert b"gpudra_test_scrapes_total 1.0" in scrape(port, under)


def test_connections_refused_431_and_sending_on_do_not_hold_the_places_of_scrapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An escape attempt on the metrics port: clients fill the bound with requests past
    the head bound and keep sending a byte at a time, each within its address's share.
    Held as being answered while their rest was dropped, such connections kept every
    scrape out until the connection deadline, again after each reconnect. Refused, each
    makes room for a new connection as one without a head does, and is closed once it
    has had `DRAIN_S` to read its answer. That is 3 s here, not the server's 1 s, so that
    a loaded machine's stall of a second between the refusals and the scrape does not
    let the first refused connection time out before the scrape evicts it."""
    monkeypatch.setattr(metricsserver, "DRAIN_S", 3.0)
    with serving(max_connections=2, max_per_client=1, deadline_s=LONG, head_deadline_s=LONG) as (
        port,
        registry,
    ):
        held = [connect(port, source) for source in ("127.0.0.2", "127.0.0.3")]
        try:
            for s in held:
                s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (HEAD_BYTES + 10) + b"\r\n")
            for s in held:
                assert s.recv(12) == b"HTTP/1.0 431"
                s.sendall(b"x")  # still sending: its rest is being dropped
            assert b"gpudra_test_scrapes_total 1.0" in scrape(port, source="127.0.0.4")
            assert shed(registry, "evicted") == 1
            assert shed(registry, "refused") == 0
            # The other one is closed once it had its time to read the answer, though
            # it keeps sending and the connection's own deadline is far.
            assert eventually(lambda: shed(registry, "timed_out") == 1)
            for s in held:
                with contextlib.suppress(ConnectionResetError):
                    while s.recv(65536):  # the rest of its answer, then the close
                        pass
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_listens_on_the_address_family_of_its_host(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    server, thread = serve_metrics(host, 0, CollectorRegistry())
    try:
        assert server.socket.family == (socket.AF_INET6 if ":" in host else socket.AF_INET)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(GUARD)
