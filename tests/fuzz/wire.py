"""The wire side of the webhook fuzz tests: a raw TLS client that can send any bytes and
half-close, and a handle on a running server with what it logged and counted."""

from __future__ import annotations

import gc
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from gpudra.webhook.server import WebhookServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.webhook.test_server import Response

GUARD = 15.0
"""Seconds one exchange may take before it counts as a hang: a hang guard, never a
speed check (the server's own deadlines in `FUZZ_LIMITS` are far shorter)."""

FUZZ_LIMITS: Mapping[str, Any] = {
    "header_timeout": 3.0,
    "body_timeout": 3.0,
    "handshake_timeout": 3.0,
    "max_body_bytes": 256 * 1024,
}
"""Deadlines short enough that a fuzz case the server must wait out ends quickly."""


class Hang(AssertionError):
    """The server neither answered nor closed within `GUARD`."""


class TlsClient:
    """A blocking TLS client over a memory BIO, so the test decides every byte on the
    wire: any request bytes, a TCP half-close (FIN) or a TLS close_notify, and reading
    the answer after either."""

    def __init__(self, port: int, ca_pem: bytes) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=GUARD)
        context = ssl.create_default_context(cadata=ca_pem.decode())
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_hostname="127.0.0.1")
        self._buffer = b""
        self._eof = False
        self._deadline = time.monotonic() + GUARD
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
        self._flush()

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self._sock.sendall(data)

    def _fill(self) -> None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise Hang(f"no answer and no close within {GUARD:g}s")
        self._sock.settimeout(remaining)
        try:
            chunk = self._sock.recv(65536)
        except TimeoutError:
            raise Hang(f"no answer and no close within {GUARD:g}s") from None
        except ConnectionResetError:
            chunk = b""
        if chunk:
            self._in.write(chunk)
        else:
            self._in.write_eof()

    def send(self, data: bytes) -> None:
        self._deadline = time.monotonic() + GUARD
        if data:
            self._tls.write(data)
        self._flush()

    def half_close(self) -> None:
        """TCP FIN: nothing more will be sent, the answer can still be read."""
        self._sock.shutdown(socket.SHUT_WR)

    def close_notify(self) -> None:
        """TLS close_notify: the TLS-level end of the client's input."""
        with suppress(ssl.SSLWantReadError, ssl.SSLError):
            self._tls.unwrap()
        self._flush()

    def _read_more(self) -> bool:
        """More decrypted bytes into the buffer; False at the end of the stream."""
        if self._eof:
            return False
        while True:
            try:
                data = self._tls.read(65536)
            except ssl.SSLWantReadError:
                self._fill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError, ssl.SSLSyscallError):
                data = b""
            except ssl.SSLError:
                data = b""  # close_notify from us crossed with the server's answer
            if not data:
                self._eof = True
                return False
            self._buffer += data
            return True

    def response(self, *, head_only: bool = False) -> Response | None:
        """The next answer (interim 1xx answers skipped), or None when the server
        closed without one."""
        while True:
            while b"\r\n\r\n" not in self._buffer:
                if not self._read_more():
                    return None
            head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:
                continue
            if head_only:
                return Response(status, headers, b"")
            if "content-length" in headers:
                length = int(headers["content-length"])
                while len(self._buffer) < length:
                    if not self._read_more():
                        break
                body, self._buffer = self._buffer[:length], self._buffer[length:]
            else:
                while self._read_more():
                    pass
                body, self._buffer = self._buffer, b""
            return Response(status, headers, body)

    def drain(self) -> None:
        """Read until the server closes (or the guard says it hangs)."""
        while self._read_more():
            self._buffer = b""

    def close(self) -> None:
        self._sock.close()


def post(path: str, body: bytes, extra_headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra_headers}\r\n"
    ).encode() + body


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, and every record with a traceback, from any
    logger (the server thread's included): an unhandled exception shows up here."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            with self._guard:
                self.records.append(record)

    def take(self) -> list[str]:
        with self._guard:
            taken, self.records = self.records, []
        return [
            f"{r.name}: {r.getMessage()}\n{self.format(r) if r.exc_info else ''}" for r in taken
        ]


@dataclass
class Webhook:
    """A running webhook server and what it logged."""

    server: WebhookServer
    port: int
    ca_pem: bytes
    errors: ErrorLog
    templates: list[tuple[str, int, bool]] = field(default_factory=list)
    _errors_counted: float = 0.0

    @contextmanager
    def connect(self) -> Iterator[TlsClient]:
        client = TlsClient(self.port, self.ca_pem)
        try:
            yield client
        finally:
            client.close()

    def exchange(self, raw: bytes, *, half_close: bool = False) -> Response | None:
        with self.connect() as client:
            client.send(raw)
            if half_close:
                client.half_close()
            return client.response()

    def requests(self, result: str) -> float:
        """The requests metric summed over paths, for one result label."""
        text = generate_latest(self.server.registry).decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "gpudra_webhook_requests_total"
            and sample.labels.get("result") == result
        )

    def assert_healthy(self) -> None:
        """Nothing unhandled so far, no 500 counted, and a normal request is served."""
        # A task that died unobserved is reported when it is collected: collect now, so
        # the report lands on the case that caused it.
        gc.collect(1)
        logged = self.errors.take()
        counted, self._errors_counted = self._errors_counted, self.requests("error")
        assert not logged, "\n".join(logged)
        assert self._errors_counted == counted, "a request was answered 500"
        response = self.exchange(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")
        assert response is not None
        assert response.status == 200
