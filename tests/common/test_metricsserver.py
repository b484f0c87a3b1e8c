"""The node agent's metrics endpoint over real sockets: it serves the registry, and a
client that holds connections, drips its request or sends a huge one can neither grow
its threads past the bound, keep a connection past its deadline nor make the server
hold more than a bounded head."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from gpudra.common.metricsserver import HEAD_BYTES, MetricsServer, serve_metrics
from prometheus_client import CollectorRegistry, Counter

GUARD = 10.0  # seconds: only a hang guard, never a speed check


@contextmanager
def serving(**bounds: float) -> Iterator[tuple[MetricsServer, int]]:
    registry = CollectorRegistry()
    Counter("gpudra_test_scrapes", "A series to find in the answer.", registry=registry).inc()
    server, thread = serve_metrics("127.0.0.1", 0, registry, **bounds)
    try:
        yield server, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(GUARD)


def scrape(port: int, head: bytes = b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD) as s:
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


def test_serves_the_registry() -> None:
    with serving() as (_server, port):
        answer = scrape(port)
    assert answer.startswith(b"HTTP/1.0 200 OK")
    assert b"gpudra_test_scrapes_total 1.0" in answer


def test_held_connections_cannot_grow_the_threads_past_the_bound() -> None:
    with serving(max_connections=4, deadline_s=60) as (server, port):
        before = threading.active_count()
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        try:
            # The server takes them in order: four get a thread, the rest are closed.
            assert all(closed_by_server(s) for s in held[4:])
            assert threading.active_count() <= before + 4
            assert server.refused == 8
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + GUARD
        while b"gpudra_test_scrapes_total" not in scrape(port):  # slots freed on close
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_client_dripping_its_request_loses_it_at_the_deadline() -> None:
    with serving(max_connections=2, deadline_s=0.5) as (_server, port):
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
    with serving() as (_server, port):
        answer = scrape(port, head)
        assert answer.startswith(b"HTTP/1.0 431"), (what, answer[:80])
        under = _head(b"GET /metrics HTTP/1.1", (HEAD_BYTES - 2048) // 1024, 1024)
        assert b"gpudra_test_scrapes_total 1.0" in scrape(port, under)


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
