"""Requests written by hand to the webhook's port, and a TLS client that never reads
what the server sends: to pipeline requests, or to hold a connection in a state no
client library makes. The transport's own tests (over loopback) and the escape tests
(against the webhook the real API server calls) share them, so that both attack the
server the same way."""

from __future__ import annotations

import socket
import ssl

import anyio.to_thread

PARTIAL_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
"""The first bytes of a TLS ClientHello that announces 512 bytes and sends 11: sent
alone, it holds a connection in its handshake on the server's side for as long as the
client keeps it open."""


def posted(body: bytes, path: str = "/mutate-pods") -> bytes:
    """A whole POST of `body` to `path`, as bytes to send: requests written by hand, to
    pipeline them or to hold a connection in a state no client library makes."""
    return b"POST %s HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


class Unread:
    """A TLS client that never reads what the server sends, with a small receive buffer so
    that the server's writes back up after a few answers (blocking; run in a thread).

    `max_segment` (bytes; 0: what the route allows) is the TCP segment size it
    announces. The server's kernel sizes its send buffer by the peer's segments: on
    loopback (64 KiB segments) it takes megabytes of answers nobody reads before the
    server's own write buffer grows, with 536-byte segments tens of KiB, so a client
    announcing small segments backs the server's writer up after a few hundred KiB of
    answers, with no hold on the server's sockets. `timeout` bounds each blocking send
    (None: none), so a send the server stopped reading fails instead of hanging."""

    def __init__(
        self,
        port: int,
        ca_pem: bytes,
        host: str = "127.0.0.1",
        *,
        max_segment: int = 0,
        timeout: float | None = None,
    ) -> None:
        raw = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if max_segment:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, max_segment)
        raw.settimeout(timeout)
        raw.connect((host, port))
        context = ssl.create_default_context(cadata=ca_pem.decode())
        self.tls = context.wrap_socket(raw, server_hostname=host)

    async def send(self, data: bytes) -> None:
        await anyio.to_thread.run_sync(self.tls.sendall, data)

    def close(self) -> None:
        self.tls.close()
