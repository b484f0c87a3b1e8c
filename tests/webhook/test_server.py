"""The admission server over real HTTPS on loopback."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteStream
from anyio.streams.tls import TLSAttribute, TLSStream
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from gpudra.cli.main import build_parser
from gpudra.cli.webhook import conversion_policy, run, server_config
from gpudra.webhook.certs import (
    WebhookPki,
    ensure_pki,
    generate_ca,
    generate_serving_cert,
    service_dns_names,
    write_atomic,
)
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.transport import _RECEIVE_BUFFER, HttpConfig, HttpServer, _Connection
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from e2e.webhook_wire import PARTIAL_HELLO, Unread, posted

pytestmark = pytest.mark.anyio

Patcher = Callable[[Any, Sequence[dict[str, Any]]], Any]
GUARD = 10  # seconds: only a hang guard, never a speed check
BOTH_LOOPS = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": True}), ("asyncio", {"use_uvloop": False})],
    ids=["uvloop", "asyncio"],
)
"""For the handshake, where the two event loops' TLS layers differ (uvloop's is the one
production runs)."""


@dataclass
class Recorder:
    """Stands in for the API-server side of template creation (a later component)."""

    calls: list[tuple[str, list[dict[str, Any]], bool]] = field(default_factory=list)
    error: Exception | None = None
    hang: bool = False

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        self.calls.append((namespace, [dict(t) for t in templates], dry_run))
        if self.hang:
            await anyio.sleep_forever()
        if self.error:
            raise self.error


@dataclass
class Harness:
    server: WebhookServer
    port: int
    pki: WebhookPki
    pki_dir: Path
    ensure: Recorder


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    def __init__(self, stream: BufferedByteStream, tls: Any) -> None:
        self.stream = stream
        self.tls = tls

    @classmethod
    async def connect(cls, port: int, ca_pem: bytes) -> Client:
        context = ssl.create_default_context(cadata=ca_pem.decode())
        tls = await anyio.connect_tcp(
            "127.0.0.1",
            port,
            tls=True,
            ssl_context=context,
            tls_hostname="127.0.0.1",
            tls_standard_compatible=False,
        )
        return cls(BufferedByteStream(tls), tls)

    def peer_certificate(self) -> bytes:
        der: bytes = self.tls.extra(TLSAttribute.peer_certificate_binary)
        return der

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def response(self) -> Response:
        head = await self.stream.receive_until(b"\r\n\r\n", 65536)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await self.stream.receive_exactly(int(headers.get("content-length", "0")))
        return Response(status, headers, body)

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: str = ""
    ) -> Response:
        length = f"Content-Length: {len(body)}\r\n" if method == "POST" else ""
        head = f"{method} {path} HTTP/1.1\r\nHost: webhook\r\n{length}{headers}\r\n"
        await self.send(head.encode() + body)
        return await self.response()

    async def aclose(self) -> None:
        await self.stream.aclose()


@asynccontextmanager
async def running(tmp_path: Path, **overrides: Any) -> AsyncIterator[Harness]:
    pki_dir = tmp_path / "pki"
    pki, _ = ensure_pki(pki_dir, service_dns_names("gpudra-webhook", "gpudra"))
    ensure = overrides.pop("ensure", Recorder())
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "cert_check_interval": 0.02}
    config = ServerConfig(
        cert_file=pki_dir / "tls.crt", key_file=pki_dir / "tls.key", **{**settings, **overrides}
    )
    server = WebhookServer(config, ensure)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        yield Harness(server, port, pki, pki_dir, ensure)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def client(h: Harness) -> AsyncIterator[Client]:
    c = await Client.connect(h.port, h.pki.ca_bundle)
    try:
        yield c
    finally:
        await c.aclose()


def gpu_pod(gpus: str = "1", **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "train-", "namespace": "team-a", **metadata},
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "image": "cuda",
                    "resources": {
                        "limits": {"nvidia.com/gpu": gpus, "cpu": "1"},
                        "requests": {"nvidia.com/gpu": gpus, "cpu": "1"},
                    },
                }
            ]
        },
    }


def review(
    pod: Any, *, uid: str = "0a1b2c", dry_run: bool = False, **request: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team-a",
            "operation": "CREATE",
            "object": pod,
            "dryRun": dry_run,
            **request,
        },
    }


async def admit(c: Client, body: Any) -> Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await c.request("POST", "/mutate-pods?timeout=10s", data)


def metric(h: Harness, name: str, **labels: str) -> float:
    text = generate_latest(h.server.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


# --- admission round trips ---


async def test_admission_review_round_trip(tmp_path: Path, apply_patch: Patcher) -> None:
    pod = gpu_pod("2")
    async with running(tmp_path) as h, client(h) as c:
        with anyio.fail_after(GUARD):
            resp = await admit(c, review(pod, uid="uid-42"))
    assert resp.status == 200
    assert resp.headers["content-type"] == "application/json"
    out = resp.json()
    assert out["apiVersion"] == "admission.k8s.io/v1"
    assert out["kind"] == "AdmissionReview"
    answer = out["response"]
    assert answer["uid"] == "uid-42"
    assert answer["allowed"] is True
    assert answer["patchType"] == "JSONPatch"
    assert any("gpudra-gpu" in w for w in answer["warnings"])
    patched = apply_patch(pod, json.loads(base64.b64decode(answer["patch"])))
    expected = json.loads(json.dumps(pod))
    expected["spec"]["resourceClaims"] = [
        {"name": "gpudra-gpu", "resourceClaimTemplateName": "gpudra-gpu-2"}
    ]
    expected["spec"]["containers"][0]["resources"] = {
        "limits": {"cpu": "1"},
        "requests": {"cpu": "1"},
        "claims": [{"name": "gpudra-gpu"}],
    }
    expected["metadata"]["annotations"] = {
        "gpudra.nvidia.com/converted": "nvidia.com/gpu: 2 -> claim gpudra-gpu (template "
        "gpudra-gpu-2, class gpu.nvidia.com, 2 GPUs whole, sharing Exclusive)"
    }
    assert patched == expected
    ((namespace, templates, dry_run),) = h.ensure.calls
    assert (namespace, dry_run) == ("team-a", False)
    assert [t["metadata"]["name"] for t in templates] == ["gpudra-gpu-2"]


async def test_dry_run_is_passed_to_template_creation(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        resp = await admit(c, review(gpu_pod(), dry_run=True))
        assert resp.json()["response"]["patchType"] == "JSONPatch"
        assert [call[2] for call in h.ensure.calls] == [True]
        assert metric(h, "gpudra_webhook_conversions_total", dry_run="true") == 1


async def test_conversion_error_is_a_denial(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        resp = await admit(c, review(gpu_pod("-1")))
        assert resp.status == 200
        answer = resp.json()["response"]
        assert answer["allowed"] is False
        assert answer["status"]["code"] == 400
        assert 'container "train"' in answer["status"]["message"]
        assert "negative" in answer["status"]["message"]
        assert "patch" not in answer
        assert h.ensure.calls == []
        assert metric(h, "gpudra_webhook_denials_total", reason="invalid") == 1


async def test_template_failure_denies_with_500(tmp_path: Path) -> None:
    ensure = Recorder(error=RuntimeError("forbidden: cannot create resourceclaimtemplates"))
    async with running(tmp_path, ensure=ensure) as h, client(h) as c:
        answer = (await admit(c, review(gpu_pod()))).json()["response"]
        assert answer["allowed"] is False
        assert answer["status"]["code"] == 500
        assert "gpudra-gpu-1" in answer["status"]["message"]
        assert "forbidden" in answer["status"]["message"]
        assert metric(h, "gpudra_webhook_denials_total", reason="templates") == 1


async def test_hanging_template_creation_is_bounded(tmp_path: Path) -> None:
    hanging = Recorder(hang=True)
    async with running(tmp_path, ensure=hanging, ensure_timeout=0.1) as h, client(h) as c:
        with anyio.fail_after(GUARD):
            answer = (await admit(c, review(gpu_pod()))).json()["response"]
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 500
    assert "no answer within 0.1s" in answer["status"]["message"]


async def test_pods_without_gpus_and_other_operations_pass_unchanged(tmp_path: Path) -> None:
    plain = gpu_pod()
    plain["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    async with running(tmp_path) as h, client(h) as c:
        for body in (
            review(plain),
            review(gpu_pod(), operation="UPDATE"),
            review(gpu_pod(labels={"gpudra.nvidia.com/convert": "false"})),
        ):
            answer = (await admit(c, body)).json()["response"]
            assert answer == {"uid": "0a1b2c", "allowed": True}
        assert h.ensure.calls == []
        assert (
            metric(h, "gpudra_webhook_requests_total", path="/mutate-pods", result="allowed") == 3
        )


async def test_keep_alive_serves_many_requests_on_one_connection(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        for i in range(5):
            resp = await admit(c, review(gpu_pod(), uid=f"u{i}"))
            assert resp.json()["response"]["uid"] == f"u{i}"
            assert resp.headers["connection"] == "keep-alive"
        # Pipelined: two requests in one write, two answers in order.
        body = json.dumps(review(gpu_pod(), uid="p1")).encode()
        body2 = json.dumps(review(gpu_pod(), uid="p2")).encode()
        await c.send(posted(body) + posted(body2))
        assert (await c.response()).json()["response"]["uid"] == "p1"
        assert (await c.response()).json()["response"]["uid"] == "p2"


async def test_connection_close_is_honoured(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        resp = await c.request("GET", "/healthz", headers="Connection: close\r\n")
        assert resp.headers["connection"] == "close"
        with pytest.raises((anyio.EndOfStream, anyio.IncompleteRead)):
            await c.stream.receive()


# --- bad requests ---


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b"[]", "must be an AdmissionReview object"),
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}, "v1beta1"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "Status"}, "'Status'"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "has no request"),
        (review(gpu_pod(), uid=""), "uid is missing"),
        (
            review(gpu_pod(), kind={"group": "apps", "version": "v1", "kind": "Deployment"}),
            "unsupported resource kind",
        ),
        (review("a pod"), "request.object must be the Pod"),
        (review(gpu_pod(), namespace=""), "namespace"),
    ],
)
async def test_malformed_reviews_get_400(tmp_path: Path, body: Any, message: str) -> None:
    if isinstance(body, dict) and body.get("request", {}).get("namespace") == "":
        body["request"]["object"]["metadata"].pop("namespace")
    async with running(tmp_path) as h, client(h) as c:
        resp = await admit(c, body)
        assert resp.status == 400
        assert message in resp.body.decode()
        # The framing was fine, so the connection stays usable.
        assert (await c.request("GET", "/healthz")).status == 200
        assert (
            metric(h, "gpudra_webhook_requests_total", path="/mutate-pods", result="bad_request")
            == 1
        )


async def test_oversized_body_is_refused_before_it_is_read(tmp_path: Path) -> None:
    async with running(tmp_path, max_body_bytes=1024 * 1024) as h, client(h) as c:
        body = b"x" * (1024 * 1024 + 1)
        resp = await c.request("POST", "/mutate-pods", body)
        assert resp.status == 400
        assert "exceeds the limit of 1048576 bytes" in resp.body.decode()
        assert resp.headers["connection"] == "close"


async def test_default_body_cap_is_3_mib(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        await c.send(
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n" % (3 * 2**20 + 1)
        )
        resp = await c.response()
        assert resp.status == 400
        assert "3145728" in resp.body.decode()


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"GET /healthz HTTP/2.0\r\n\r\n", 400, "unsupported protocol version"),
        (b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n", 400, "malformed header"),
        (
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: -5\r\n\r\n",
            400,
            "Content-Length",
        ),
        (
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\n"
            b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n",
            400,
            "conflicting Content-Length",
        ),
        (b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\n\r\n", 411, "Content-Length"),
        (
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nTransfer-Encoding: chunked\r\n\r\n",
            501,
            "Transfer-Encoding",
        ),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n", 400, "request head exceeds"),
        (
            b"GET /healthz HTTP/1.1\r\nHost: w\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(40))
            + b"\r\n",
            400,
            "exceeds 32 header lines",
        ),
        # HTTP/1.1 requires Host (RFC 9112); the API server always sends it.
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 400, "missing Host"),
    ],
)
async def test_malformed_http_gets_an_error_and_a_closed_connection(
    tmp_path: Path, raw: bytes, status: int, message: str
) -> None:
    async with running(tmp_path) as h, client(h) as c:
        with anyio.fail_after(GUARD):
            await c.send(raw)
            resp = await c.response()
        assert resp.status == status
        assert message in resp.body.decode()
        assert resp.headers["connection"] == "close"


# --- the request head's bound ---


def head_of(size: int, path: str = "/healthz", line: int = 200) -> bytes:
    """A complete GET head of exactly `size` bytes, in header lines of about `line` bytes
    (each far below the per-line limit)."""
    head = f"GET {path} HTTP/1.1\r\nHost: w\r\n".encode()
    n = 0
    while len(head) + line + 2 < size:
        head += b"X-%d: " % n + b"a" * (line - len(b"X-%d: \r\n" % n)) + b"\r\n"
        n += 1
    last = size - len(head) - len(b"X-last: \r\n\r\n")
    head += b"X-last: " + b"b" * last + b"\r\n\r\n"
    assert len(head) == size
    return head


async def test_the_whole_head_is_bounded_not_only_its_lines(tmp_path: Path) -> None:
    """Header lines each far below the per-line limit, fewer than the line-count limit,
    but more bytes together than the head's bound: answered 431 and closed; a head of
    exactly the bound is served."""
    assert HttpConfig.max_head_bytes == 32 * 1024  # the default: two of the longest lines
    assert HttpConfig.max_head_bytes == 2 * HttpConfig.max_header_bytes
    async with running(tmp_path, max_head_bytes=4096) as h:
        async with client(h) as c:
            await c.send(head_of(4096))
            assert (await c.response()).status == 200
        async with client(h) as c:
            head = head_of(4097, line=300)
            assert head.count(b"\r\n") < 32  # fewer lines than the line-count limit
            await c.send(head)
            with anyio.fail_after(GUARD):
                resp = await c.response()
                with pytest.raises(CLOSED):
                    await c.response()
        assert resp.status == 431
        assert resp.body.decode() == "request head exceeds 4096 bytes\n"
        assert resp.headers["connection"] == "close"
        assert metric(h, "gpudra_webhook_requests_total", path="other", result="bad_request") == 1
        async with client(h) as c:
            assert (await c.request("GET", "/healthz")).status == 200


@pytest.mark.parametrize(
    "start",
    [
        b"GET /healthz HTTP/1.1\r\nHost: w\r\nX: ",  # a header line that never ends
        b"GET /healthz HTTP/1.1\r\nHost: w\r\n",  # short lines, one after another
    ],
)
async def test_a_head_trickled_in_small_writes_is_refused_at_the_bound(
    tmp_path: Path, start: bytes
) -> None:
    """A head sent a few bytes at a time is counted as it arrives, the line the parser
    still holds included: one that reaches the bound unfinished is refused then (it can
    only go past it), long before the head's deadline."""
    limit = 4096
    async with running(tmp_path, max_head_bytes=limit, header_timeout=60) as h, client(h) as c:
        if start.endswith(b": "):
            trickle = start + b"a" * (limit - len(start))
        else:
            lines = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 150) for i in range(30))
            trickle = (start + lines)[:limit]
            assert trickle.count(b"\r\n") < 32  # fewer lines than the line-count limit
        assert len(trickle) == limit
        for i in range(0, len(trickle), 64):
            await c.send(trickle[i : i + 64])
        with anyio.fail_after(GUARD):
            resp = await c.response()
        assert resp.status == 431
        assert "request head exceeds 4096 bytes" in resp.body.decode()
        assert resp.headers["connection"] == "close"


async def test_a_body_in_the_same_write_as_its_head_is_not_counted_as_head(
    tmp_path: Path,
) -> None:
    """The head's bound counts the head only: a review far larger than the bound, sent
    in one write with its head, is served, and so are requests pipelined after a body
    in one write (a head that begins where a body ends is counted from its start)."""
    async with running(tmp_path, max_head_bytes=1024) as h, client(h) as c:
        pod = gpu_pod(annotations={"padding": "x" * 8000})
        body = json.dumps(review(pod, uid="big")).encode()
        assert len(body) > 8 * 1024
        with anyio.fail_after(GUARD):
            resp = await admit(c, body)
        assert resp.json()["response"]["uid"] == "big"
        small = b"x" * 500
        post = b"POST /healthz HTTP/1.1\r\nHost: w\r\nContent-Length: 500\r\n\r\n" + small
        # The first request and most of the second head arrive together in one read of
        # up to the bound: the second head is charged at most what is not the body.
        second = head_of(900)
        assert len(post) + len(second) > 1024
        await c.send(post + second)
        with anyio.fail_after(GUARD):
            answers = [await c.response() for _ in range(2)]
        assert [a.status for a in answers] == [405, 200]
        assert answers[1].headers["connection"] == "keep-alive"
        # The bound still holds for a pipelined head past it, after a body shorter or
        # longer than the bound.
        large = b"POST /healthz HTTP/1.1\r\nHost: w\r\nContent-Length: 2000\r\n\r\n"
        for first in (post, large + b"x" * 2000):
            async with client(h) as other:
                await other.send(first + head_of(1025))
                with anyio.fail_after(GUARD):
                    answers = [await other.response() for _ in range(2)]
                assert [a.status for a in answers] == [405, 431]


async def test_many_requests_on_one_connection_never_add_up_to_the_bound(
    tmp_path: Path,
) -> None:
    """Each head is counted on its own: a keep-alive connection serves far more bytes of
    heads in all than the bound, whether each request comes alone or pipelined in
    pairs."""
    async with running(tmp_path, max_head_bytes=1024) as h, client(h) as c:
        head = head_of(1000)
        with anyio.fail_after(GUARD):
            for _ in range(20):
                await c.send(head)
                assert (await c.response()).status == 200
            for _ in range(20):
                await c.send(head + head)
                assert [(await c.response()).status for _ in range(2)] == [200, 200]


async def test_connections_get_a_small_kernel_receive_buffer(tmp_path: Path) -> None:
    """Every accepted socket inherits the listener's small receive buffer (Linux
    doubles what is asked), which bounds each read and so what the TLS layer keeps."""
    async with running(tmp_path) as h, client(h) as c:
        assert (await c.request("GET", "/healthz")).status == 200
        (connection,) = h.server._http._connections
        assert connection._transport is not None
        sock = connection._transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * _RECEIVE_BUFFER
        assert _RECEIVE_BUFFER == 32 * 1024


async def test_transfer_encoding_is_refused_on_every_path(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        await c.send(b"GET /healthz HTTP/1.1\r\nHost: w\r\nTransfer-Encoding: chunked\r\n\r\n")
        resp = await c.response()
        assert (resp.status, resp.headers["connection"]) == (501, "close")


async def test_targets_in_absolute_form_and_escaped_paths_are_routed(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        assert (await c.request("GET", "https://webhook/healthz?x=1")).status == 200
        assert (await c.request("GET", "/health%7A")).status == 200
        resp = await c.request("CONNECT", "webhook:443")
        assert (resp.status, resp.headers["connection"]) == (400, "close")
        assert "no request target" in resp.body.decode()


async def test_http10_connections_close_unless_kept_alive(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        await c.send(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert (await c.response()).headers["connection"] == "keep-alive"
        await c.send(b"GET /healthz HTTP/1.0\r\n\r\n")
        resp = await c.response()
        assert (resp.status, resp.headers["connection"]) == (200, "close")
        with pytest.raises((anyio.EndOfStream, anyio.IncompleteRead)):
            await c.stream.receive()


@dataclass
class SlowRecorder(Recorder):
    delay: float = 0.3

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        await super().__call__(namespace, templates, dry_run)
        await anyio.sleep(self.delay)


async def test_a_pipelined_head_begun_during_an_answer_has_a_deadline(tmp_path: Path) -> None:
    slow = SlowRecorder()
    async with running(tmp_path, header_timeout=0.2, ensure=slow) as h, client(h) as c:
        body = json.dumps(review(gpu_pod(), uid="first")).encode()
        await c.send(posted(body) + b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Le")
        with anyio.fail_after(GUARD):
            assert (await c.response()).json()["response"]["uid"] == "first"
            resp = await c.response()
        assert resp.status == 408
        assert "head" in resp.body.decode()


@dataclass
class Stoppable:
    """A webhook server that the test stops (as SIGTERM's end does) while its own
    clients go on, in the same task group."""

    port: int
    pki: WebhookPki
    server: WebhookServer
    scope: anyio.CancelScope
    stopped: anyio.Event

    def stop(self) -> None:
        self.scope.cancel()


@asynccontextmanager
async def stoppable(tmp_path: Path, ensure: Recorder) -> AsyncIterator[Stoppable]:
    pki_dir = tmp_path / "pki"
    pki, _ = ensure_pki(pki_dir, ["localhost"])
    config = ServerConfig(
        cert_file=pki_dir / "tls.crt", key_file=pki_dir / "tls.key", host="127.0.0.1", port=0
    )
    server = WebhookServer(config, ensure)
    scope, stopped = anyio.CancelScope(), anyio.Event()

    async def serve(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        try:
            with scope:
                await server.serve(task_status=task_status)
        finally:
            stopped.set()

    async with anyio.create_task_group() as tg:
        port = await tg.start(serve)
        yield Stoppable(port, pki, server, scope, stopped)
        scope.cancel()


async def answered_and_closed(c: Client, uid: str) -> None:
    """The review `uid` was answered, with Connection: close, and the connection closed."""
    resp = await c.response()
    assert resp.json()["response"]["uid"] == uid
    assert resp.headers["connection"] == "close"
    with pytest.raises(CLOSED):
        await c.stream.receive()


async def test_a_request_in_flight_when_the_server_stops_is_answered(tmp_path: Path) -> None:
    """A stop answers the request being answered; a connection idle between requests
    (kept alive after one) closes at once, before that answer is made."""
    gated = GatedRecorder()
    async with stoppable(tmp_path, gated) as s:
        c = await Client.connect(s.port, s.pki.ca_bundle)
        idle = await Client.connect(s.port, s.pki.ca_bundle)
        assert (await idle.request("GET", "/healthz")).status == 200
        await c.send(posted(json.dumps(review(gpu_pod(), uid="busy")).encode()))
        with anyio.fail_after(GUARD):
            while not gated.calls:
                await anyio.sleep(0.01)
        s.stop()
        with anyio.fail_after(GUARD):
            with pytest.raises(CLOSED):
                await idle.stream.receive()
            assert not s.stopped.is_set()  # the busy request still being answered
            gated.gate.set()
            await answered_and_closed(c, "busy")
            await s.stopped.wait()
        await c.aclose()
        await idle.aclose()


async def test_a_connection_opened_before_the_stop_gets_its_first_request_answered(
    tmp_path: Path,
) -> None:
    """A client that has just opened a connection has a request to send: a stop waits
    for it, as Go's http.Server.Shutdown does, rather than close the connection under
    it (the API server reports that as EOF, and does not retry a POST on a connection
    it opened for it). The same for a request whose head has come and whose body has
    not: the rest is read and the request answered."""
    async with stoppable(tmp_path, Recorder()) as s:
        fresh = await Client.connect(s.port, s.pki.ca_bundle)
        partial = await Client.connect(s.port, s.pki.ca_bundle)
        body = json.dumps(review(gpu_pod(), uid="partial")).encode()
        request = posted(body)
        await partial.send(request[:-10])
        connections = s.server._http._connections
        with anyio.fail_after(GUARD):
            while len(connections) < 2 or not any(c._in_message for c in connections):
                await anyio.sleep(0.01)
        s.stop()
        await anyio.sleep(0.05)
        await fresh.send(posted(json.dumps(review(gpu_pod(), uid="fresh")).encode()))
        await partial.send(request[-10:])
        with anyio.fail_after(GUARD):
            await answered_and_closed(fresh, "fresh")
            await answered_and_closed(partial, "partial")
            await s.stopped.wait()
        await fresh.aclose()
        await partial.aclose()


class HeldHandshake(anyio.abc.ByteStream):
    """A TCP stream whose client holds back the end of its TLS handshake (its second
    flight) until `go` is set: a connection still in its handshake, on the server's
    side, for as long as the test needs."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.sends = 0
        self.held = anyio.Event()
        self.go = anyio.Event()

    async def send(self, item: bytes) -> None:
        self.sends += 1
        if self.sends == 2:
            self.held.set()
            await self.go.wait()
        await self.stream.send(item)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.stream.receive(max_bytes)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


@BOTH_LOOPS
async def test_a_connection_in_its_handshake_when_the_server_stops_is_served(
    tmp_path: Path,
) -> None:
    """A stop lets a handshake under way finish and answers the request it was opened
    for, with Connection: close: cut there, the client's request is lost (the API
    server reports EOF)."""
    async with stoppable(tmp_path, Recorder()) as s:
        held = HeldHandshake(await anyio.connect_tcp("127.0.0.1", s.port))
        context = ssl.create_default_context(cadata=s.pki.ca_bundle.decode())
        done: list[Client] = []

        async def handshake() -> None:
            tls = await TLSStream.wrap(
                held, hostname="127.0.0.1", ssl_context=context, standard_compatible=False
            )
            done.append(Client(BufferedByteStream(tls), tls))

        async with anyio.create_task_group() as tg:
            tg.start_soon(handshake)
            with anyio.fail_after(GUARD):
                await held.held.wait()
            assert s.server._http._handshaking
            s.stop()
            await anyio.sleep(0.05)
            assert not s.stopped.is_set()
            held.go.set()
        (c,) = done
        await c.send(posted(json.dumps(review(gpu_pod(), uid="late")).encode()))
        with anyio.fail_after(GUARD):
            await answered_and_closed(c, "late")
            await s.stopped.wait()
        await c.aclose()


async def test_a_connection_that_sends_nothing_does_not_hold_the_stop(tmp_path: Path) -> None:
    """Waiting for a first request is bounded by the stop's grace: a connection that
    never sends one, or a handshake that never ends, is aborted and the server stops."""
    async with stoppable(tmp_path, Recorder()) as s:
        silent = await Client.connect(s.port, s.pki.ca_bundle)
        hello = await anyio.connect_tcp("127.0.0.1", s.port)
        await hello.send(PARTIAL_HELLO)
        with anyio.fail_after(GUARD):
            while not (s.server._http._handshaking and s.server._http._connections):
                await anyio.sleep(0.01)
        s.stop()
        with anyio.fail_after(GUARD):
            await s.stopped.wait()
            with pytest.raises(CLOSED):
                await silent.stream.receive()
            with pytest.raises(CLOSED):
                await hello.receive()
        assert not s.server._http._handshaking and not s.server._http._connections
        await silent.aclose()
        await hello.aclose()


async def test_routes(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        assert (await c.request("GET", "/nope")).status == 404
        assert (await c.request("GET", "/mutate-pods")).status == 405
        assert (await c.request("POST", "/healthz")).status == 405
        assert metric(h, "gpudra_webhook_requests_total", path="other", result="not_found") == 1


async def test_expect_100_continue(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        body = json.dumps(review(gpu_pod())).encode()
        await c.send(
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        assert await c.stream.receive_until(b"\r\n\r\n", 1000) == b"HTTP/1.1 100 Continue"
        await c.send(body)
        assert (await c.response()).json()["response"]["allowed"] is True


async def test_slow_and_bad_clients_do_not_hold_up_a_good_request(tmp_path: Path) -> None:
    async with (
        running(tmp_path, header_timeout=60, body_timeout=60) as h,
        client(h) as slow_head,
        client(h) as slow_body,
        client(h) as huge,
    ):
        await slow_head.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Le")
        await slow_body.send(
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: 100000\r\n\r\n{"
        )
        await huge.send(
            b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: 999999999\r\n\r\n"
        )
        await huge.send(b"x" * 65536)
        async with client(h) as good:
            with anyio.fail_after(GUARD):
                resp = await admit(good, review(gpu_pod()))
                assert resp.json()["response"]["allowed"] is True
                assert (await huge.response()).status == 400
        # The slow ones are still pending on their own deadlines: nothing answered them.
        mutate = "/mutate-pods"
        assert metric(h, "gpudra_webhook_requests_total", path=mutate, result="patched") == 1
        assert metric(h, "gpudra_webhook_requests_total", path=mutate, result="bad_request") == 1
        assert metric(h, "gpudra_webhook_requests_total", path="other", result="bad_request") == 0


async def test_stalled_requests_time_out(tmp_path: Path) -> None:
    async with running(tmp_path, header_timeout=0.2, body_timeout=0.2) as h:
        async with client(h) as c:
            await c.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Le")
            with anyio.fail_after(GUARD):
                resp = await c.response()
            assert resp.status == 408
            assert "head" in resp.body.decode()
        async with client(h) as c:
            await c.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: 10\r\n\r\n{")
            with anyio.fail_after(GUARD):
                resp = await c.response()
            assert resp.status == 408
            assert "body" in resp.body.decode()
        async with client(h) as c:
            # A silent connection is closed without an answer.
            with anyio.fail_after(GUARD), pytest.raises((anyio.EndOfStream, anyio.IncompleteRead)):
                await c.stream.receive()


async def test_head_deadline_runs_from_the_first_byte_of_a_later_request(tmp_path: Path) -> None:
    async with running(tmp_path, header_timeout=0.2) as h, client(h) as c:
        assert (await c.request("GET", "/healthz")).status == 200
        # Idle between requests is bounded by the keep-alive timeout, not the head's.
        await anyio.sleep(0.5)
        assert (await c.request("GET", "/healthz")).status == 200
        await c.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Le")
        with anyio.fail_after(GUARD):
            resp = await c.response()
        assert resp.status == 408
        assert "head" in resp.body.decode()
        assert resp.headers["connection"] == "close"
        assert metric(h, "gpudra_webhook_requests_total", path="other", result="bad_request") == 1


async def test_garbage_instead_of_a_tls_handshake_leaves_the_server_up(tmp_path: Path) -> None:
    async with running(tmp_path, handshake_timeout=5) as h:
        async with await anyio.connect_tcp("127.0.0.1", h.port) as raw:
            await raw.send(b"GET / HTTP/1.1\r\n\r\n")
            with anyio.fail_after(GUARD), pytest.raises((anyio.EndOfStream, OSError)):
                await raw.receive()
        async with await anyio.connect_tcp("127.0.0.1", h.port):
            pass  # connects and leaves without a handshake
        async with client(h) as c:
            assert (await c.request("GET", "/healthz")).status == 200


# --- the connection bound ---

CLOSED = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)


async def connect_all(h: Harness, n: int) -> list[Client]:
    return [await Client.connect(h.port, h.pki.ca_bundle) for _ in range(n)]


async def close_all(clients: Sequence[Client]) -> None:
    for c in clients:
        with anyio.CancelScope(shield=True):
            await c.aclose()


async def test_at_the_connection_bound_the_longest_waiting_makes_room(tmp_path: Path) -> None:
    """A client that opens connections and keeps them cannot lock another out: at the
    bound the new connection takes the place of the one idle longest."""
    async with running(tmp_path, max_connections=3) as h:
        held = await connect_all(h, 3)
        try:
            for c in held:  # in this order: held[0] waits longest
                assert (await c.request("GET", "/healthz")).status == 200
            async with client(h) as newcomer:
                with anyio.fail_after(GUARD):
                    resp = await admit(newcomer, review(gpu_pod()))
                assert resp.json()["response"]["allowed"] is True
                with anyio.fail_after(GUARD), pytest.raises(CLOSED):
                    await held[0].stream.receive()
                for c in held[1:]:
                    assert (await c.request("GET", "/healthz")).status == 200
            assert metric(h, "gpudra_webhook_connections_shed_total", action="evicted") == 1
            assert metric(h, "gpudra_webhook_connections_shed_total", action="refused") == 0
        finally:
            await close_all(held)


async def test_slow_heads_cannot_hold_the_connection_bound(tmp_path: Path) -> None:
    async with running(tmp_path, max_connections=3, header_timeout=60) as h:
        slow = await connect_all(h, 3)
        try:
            for c in slow:
                await c.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Le")
            async with client(h) as good:
                with anyio.fail_after(GUARD):
                    resp = await admit(good, review(gpu_pod()))
                assert resp.json()["response"]["allowed"] is True
            assert metric(h, "gpudra_webhook_connections_shed_total", action="evicted") == 1
        finally:
            await close_all(slow)


@BOTH_LOOPS
async def test_connections_that_never_finish_a_handshake_count_against_the_bound(
    tmp_path: Path,
) -> None:
    """Anyone who reaches the port can open connections faster than the handshake's
    deadline closes them; each held about 50 KiB outside the bound (2,000 took the
    process up by about 100 MiB). They count from the moment they are accepted: the
    one waiting longest makes room, and a real client is served. On both event loops:
    asyncio's ends a handshake cut short without an error and without a transport."""
    async with running(tmp_path, max_connections=3, handshake_timeout=60) as h:
        silent: list[anyio.abc.SocketStream] = []
        try:
            for _ in range(2):  # two whose handshakes are under way: a partial ClientHello
                hello = await anyio.connect_tcp("127.0.0.1", h.port)
                silent.append(hello)
                await hello.send(PARTIAL_HELLO)
                await anyio.sleep(0.1)
            for _ in range(2):  # and two that never send a byte
                silent.append(await anyio.connect_tcp("127.0.0.1", h.port))
            # The first accepted made room, long before the handshake's deadline.
            with anyio.fail_after(GUARD), pytest.raises(CLOSED):
                await silent[0].receive()
            async with client(h) as c:
                with anyio.fail_after(GUARD):
                    resp = await admit(c, review(gpu_pod()))
                assert resp.json()["response"]["allowed"] is True
            with anyio.fail_after(GUARD), pytest.raises(CLOSED):
                await silent[1].receive()
            assert metric(h, "gpudra_webhook_connections_shed_total", action="evicted") == 2
        finally:
            for stream in silent:
                await stream.aclose()


@BOTH_LOOPS
async def test_handshakes_cut_short_leave_nothing_behind(tmp_path: Path) -> None:
    """A client that resets its connections mid-handshake, one at a time, holds one at
    most. The TLS layer does not tell a connection that its handshake was cut short:
    unless the connection sees to it itself, the bound fills with connections long gone,
    and they evict served ones."""
    async with running(tmp_path, max_connections=3) as h, client(h) as kept:
        assert (await kept.request("GET", "/healthz")).status == 200
        for _ in range(8):
            stream = await anyio.connect_tcp("127.0.0.1", h.port)
            await stream.send(PARTIAL_HELLO)
            await anyio.sleep(0.02)
            sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()  # a reset
        with anyio.fail_after(GUARD):
            while h.server._http._handshaking:
                await anyio.sleep(0.01)
        assert (await kept.request("GET", "/healthz")).status == 200
        assert metric(h, "gpudra_webhook_connections_shed_total", action="evicted") == 0


async def test_a_connection_being_answered_is_never_shed(tmp_path: Path) -> None:
    """At the bound with every connection's request being answered, a new connection is
    refused and the answers still go out; once one is answered it can make room."""
    slow = GatedRecorder()  # answers only once the late connection was refused
    async with (
        running(tmp_path, max_connections=1, ensure=slow, ensure_timeout=GUARD * 3) as h,
        client(h) as busy,
    ):
        body = json.dumps(review(gpu_pod(), uid="busy")).encode()
        await busy.send(posted(body))
        with anyio.fail_after(GUARD):
            while not slow.calls:
                await anyio.sleep(0.01)
        async with client(h) as late:
            with anyio.fail_after(GUARD), pytest.raises(CLOSED):
                await late.stream.receive()
        slow.gate.set()
        with anyio.fail_after(GUARD):
            assert (await busy.response()).json()["response"]["uid"] == "busy"
        assert metric(h, "gpudra_webhook_connections_shed_total", action="refused") == 1
        async with client(h) as after:
            assert (await after.request("GET", "/healthz")).status == 200
        assert metric(h, "gpudra_webhook_connections_shed_total", action="evicted") == 1


@dataclass
class Abandoned(Recorder):
    """Template creation that answers only when cancelled, and says it was."""

    cancelled: int = 0

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        self.calls.append((namespace, [dict(t) for t in templates], dry_run))
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise


async def test_an_answer_whose_client_closed_the_connection_is_not_made(tmp_path: Path) -> None:
    """A client that sends reviews and closes its connection at once, again and again,
    leaves no admission going on: each is cancelled at the close (counted `abandoned`),
    since a closed connection neither counts against the bound nor keeps its body in the
    budget, and work left running for it would pile up without limit."""
    ensure = Abandoned()
    async with running(tmp_path, ensure=ensure, ensure_timeout=GUARD * 3) as h:
        body = json.dumps(review(gpu_pod(), uid="gone")).encode()
        for sent in range(1, 6):
            async with client(h) as c:
                await c.send(posted(body))
                with anyio.fail_after(GUARD):
                    while len(ensure.calls) < sent:
                        await anyio.sleep(0.01)
                assert h.server._http.bodies.used == len(body)
            with anyio.fail_after(GUARD):
                while ensure.cancelled < sent:
                    await anyio.sleep(0.01)
        path = "/mutate-pods"
        assert metric(h, "gpudra_webhook_requests_total", path=path, result="abandoned") == 5
        assert h.server._http.bodies.used == 0
        # The server answers on, as before.
        async with client(h) as c:
            assert (await c.request("GET", "/healthz")).status == 200


# --- flow control: clients that pipeline and never read ---


async def test_a_client_pipelining_without_reading_holds_three_requests_at_most(
    tmp_path: Path,
) -> None:
    """Thousands of requests in one go, never read: the server parses the first three
    (one being answered, one waiting, and the one more the read held), answers the third
    with Connection: close and reads nothing further; another client is answered."""
    async with running(tmp_path) as h, client(h) as flood:
        await flood.send(b"GET /healthz HTTP/1.1\r\nHost: w\r\n\r\n" * 3000)
        async with client(h) as good:
            assert (await good.request("GET", "/healthz")).status == 200
        with anyio.fail_after(GUARD):
            answers = [await flood.response() for _ in range(3)]
            with pytest.raises(CLOSED):
                await flood.response()
        assert [a.status for a in answers] == [200, 200, 200]
        assert [a.headers["connection"] for a in answers] == ["keep-alive", "keep-alive", "close"]
        assert metric(h, "gpudra_webhook_requests_total", path="/healthz", result="ok") == 4


async def backed_up(h: Harness) -> tuple[Unread, Any]:
    """An `Unread` client asking /metrics one request at a time until the server's
    writes to it back up; it and its connection on the server."""
    unread = await anyio.to_thread.run_sync(Unread, h.port, h.pki.ca_bundle)
    request = b"GET /metrics HTTP/1.1\r\nHost: w\r\n\r\n"
    with anyio.fail_after(GUARD):
        await unread.send(request)
        while not h.server._http._connections:
            await anyio.sleep(0.001)
        (connection,) = h.server._http._connections
        # Little kernel buffering on the server's side too, so that few answers fill it.
        sock = connection._transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for sent in range(1, 10_000):
            while metric(h, "gpudra_webhook_requests_total", path="/metrics") < sent:
                await anyio.sleep(0.001)
            if connection._writing_paused:
                return unread, connection
            await unread.send(request)
    raise AssertionError("the server never stopped answering a client that does not read")


async def test_a_client_that_does_not_read_its_answers_is_no_longer_read(
    tmp_path: Path,
) -> None:
    """Requests one at a time, answers never read: once the server's write buffer for it
    is above its mark the server stops answering and reading that connection (what it
    sends next stays unread), its buffer stays bounded, and others are served."""
    async with running(tmp_path) as h:
        unread, connection = await backed_up(h)
        try:
            answered = metric(h, "gpudra_webhook_requests_total", path="/metrics")
            # Well within the socket buffers: sent whether or not the server reads.
            await unread.send(b"GET /metrics HTTP/1.1\r\nHost: w\r\n\r\n" * 300)
            async with client(h) as good:
                assert (await good.request("GET", "/healthz")).status == 200
                assert (await good.request("GET", "/healthz")).status == 200
            assert connection in h.server._http._connections  # still open
            assert connection._reading_paused
            assert not connection._transport.is_reading()
            assert connection._queued == 0
            assert metric(h, "gpudra_webhook_requests_total", path="/metrics") == answered
            # What it holds for the client: the mark (64 KiB) and one answer at most.
            assert connection._transport.get_write_buffer_size() < 2 * 64 * 1024
        finally:
            unread.close()


async def test_a_client_that_never_reads_is_closed_after_the_keep_alive_bound(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, idle_timeout=1.0) as h:
        unread, connection = await backed_up(h)
        try:
            with anyio.fail_after(GUARD):
                while connection in h.server._http._connections:
                    await anyio.sleep(0.01)
        finally:
            unread.close()


class FakeTransport:
    """Just enough of a transport to drive one connection by hand."""

    def __init__(self) -> None:
        self.written = b""
        self.reading = True
        self.aborted = False

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def set_read_buffer_limits(self, high: int) -> None:
        pass

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.aborted

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.aborted = True

    def abort(self) -> None:
        self.aborted = True


async def test_answers_waiting_for_a_client_that_does_not_read_are_abandoned(
    tmp_path: Path,
) -> None:
    """Requests queued while the transport's buffer is above its mark wait for the client
    to read; the connection is aborted when it has not for the keep-alive bound."""
    pki_dir = tmp_path / "pki"
    ensure_pki(pki_dir, ["localhost"])
    config = ServerConfig(
        cert_file=pki_dir / "tls.crt", key_file=pki_dir / "tls.key", idle_timeout=0.5
    )
    server = WebhookServer(config, Recorder())
    http: HttpServer = server._http
    connection = _Connection(http, asyncio.get_running_loop())
    transport = FakeTransport()
    # As a connection is served once its handshake passed (TLS itself is not the point).
    connection._transport = transport  # type: ignore[assignment]
    assert http.secured(connection)
    connection._serve()
    connection.pause_writing()
    assert not transport.reading
    connection.data_received(b"GET /healthz HTTP/1.1\r\nHost: w\r\n\r\n")
    with anyio.fail_after(GUARD):
        while not transport.aborted:
            await anyio.sleep(0.01)
    assert transport.written == b""  # nothing answered while the client read nothing
    connection.connection_lost(None)
    assert not http._connections


# --- the budget of buffered request bodies ---


async def held_body(h: Harness, size: int) -> Client:
    """A client that declares a body of `size` bytes and sends all but its last byte."""
    c = await Client.connect(h.port, h.pki.ca_bundle)
    await c.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n" % size)
    await c.send(b"x" * (size - 1))
    return c


async def test_bodies_past_the_budget_shed_those_held_longest(tmp_path: Path) -> None:
    """Bodies declared and held open, more than the budget holds: each one that does not
    fit makes room by answering 503 to the one held longest (closing it), so the
    server never buffers more than its budget and held bodies cannot lock newer
    requests out; every byte is given back once the connections close."""
    size = 64 * 1024
    async with running(tmp_path, max_body_bytes=size, max_buffered_body_bytes=3 * size) as h:
        bodies = h.server._http.bodies
        held: list[Client] = []
        try:
            for n in range(1, 7):
                held.append(await held_body(h, size))
                with anyio.fail_after(GUARD):
                    # Charged from its Content-Length, before its body is read.
                    while sum(c.receiving for c in h.server._http._connections) < min(n, 3) * size:
                        await anyio.sleep(0.001)
                assert bodies.used <= bodies.limit
            for shed in held[:3]:
                with anyio.fail_after(GUARD):
                    resp = await shed.response()
                    with pytest.raises(CLOSED):
                        await shed.response()
                assert resp.status == 503
                assert (resp.headers["retry-after"], resp.headers["connection"]) == ("1", "close")
            assert bodies.used == 3 * size
            # The newest three are still being received, and one of them can finish.
            await held[5].send(b"x")
            assert (await held[5].response()).status == 400  # not a review: it was read
        finally:
            await close_all(held)
        with anyio.fail_after(GUARD):
            while h.server._http._connections:
                await anyio.sleep(0.01)
        assert bodies.used == 0
        unavailable = metric(
            h, "gpudra_webhook_requests_total", path="/mutate-pods", result="unavailable"
        )
        assert unavailable == 3


@dataclass
class GatedRecorder(Recorder):
    """Template creation that waits until the test opens the gate."""

    gate: anyio.Event = field(default_factory=anyio.Event)

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        await super().__call__(namespace, templates, dry_run)
        await self.gate.wait()


async def test_a_body_that_cannot_make_room_is_refused_with_503(tmp_path: Path) -> None:
    """When the budget is held by requests being answered, nothing is shed for a new
    body: it is answered 503 with Retry-After before it is read, and its connection
    closes; requests without a body are still served."""
    gated = GatedRecorder()
    first = json.dumps(review(gpu_pod(), uid="first")).encode()
    second = json.dumps(review(gpu_pod(), uid="second")).encode()
    budget = len(first) + len(second)
    async with (
        running(tmp_path, max_buffered_body_bytes=budget, ensure=gated, ensure_timeout=60) as h,
        client(h) as a,
        client(h) as b,
    ):
        await a.send(posted(first))
        await b.send(posted(second))
        with anyio.fail_after(GUARD):
            while len(gated.calls) < 2:
                await anyio.sleep(0.001)
        assert h.server._http.bodies.used == budget
        async with client(h) as late:
            with anyio.fail_after(GUARD):
                resp = await admit(late, review(gpu_pod(), uid="late"))
            assert resp.status == 503
            assert (resp.headers["retry-after"], resp.headers["connection"]) == ("1", "close")
            assert "retry" in resp.body.decode()
        async with client(h) as probe:
            assert (await probe.request("GET", "/healthz")).status == 200
        gated.gate.set()
        with anyio.fail_after(GUARD):
            assert (await a.response()).json()["response"]["uid"] == "first"
            assert (await b.response()).json()["response"]["uid"] == "second"
        assert h.server._http.bodies.used == 0
        async with client(h) as after:
            assert (await admit(after, review(gpu_pod()))).json()["response"]["allowed"] is True


async def unread_with_a_body_queued(h: Harness, size: int) -> tuple[Unread, Any]:
    """An `Unread` client pipelining `GET /metrics` and a POST with a body of `size` bytes
    in one write, pair after pair, until the server's writes to it back up with the POST's
    complete body queued behind them and charged to the budget (the way a client that
    never reads can hold bodies it has sent in full); it and its connection on the
    server."""
    http = h.server._http
    known = set(http._connections)
    unread = await anyio.to_thread.run_sync(Unread, h.port, h.pki.ca_bundle)
    pair = b"GET /metrics HTTP/1.1\r\nHost: w\r\n\r\n" + posted(b"x" * size, "/healthz")
    answered = metric(h, "gpudra_webhook_requests_total", path="/healthz")
    with anyio.fail_after(GUARD):
        await unread.send(pair)
        while not set(http._connections) - known:
            await anyio.sleep(0.001)
        (connection,) = set(http._connections) - known
        sock = connection._transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for sent in range(1, 10_000):
            # The POST is answered (405) unless its answer waits for the client to read.
            while metric(h, "gpudra_webhook_requests_total", path="/healthz") < answered + sent:
                if connection._drained is not None and connection._charged == size:
                    return unread, connection
                await anyio.sleep(0.001)
            await unread.send(pair)
    raise AssertionError("the server never queued a body behind answers its client leaves")


def unavailable(h: Harness) -> float:
    return metric(h, "gpudra_webhook_requests_total", path="/mutate-pods", result="unavailable")


async def test_bodies_queued_behind_unread_answers_make_room_for_new_ones(
    tmp_path: Path,
) -> None:
    """Clients that never read, each with a complete body queued behind answers waiting
    for it, hold the whole budget: a new admission is still answered, by aborting the
    one that has waited longest for its client (only as many as the new body needs). A
    connection whose request is being answered holds its body and is answered."""
    size = 4096
    gated = GatedRecorder()
    first = json.dumps(review(gpu_pod(), uid="first")).encode()
    second = json.dumps(review(gpu_pod(), uid="second")).encode()
    budget = 2 * size + len(first)
    async with running(
        tmp_path, max_body_bytes=size, max_buffered_body_bytes=budget, ensure=gated
    ) as h:
        http = h.server._http
        held = [await unread_with_a_body_queued(h, size) for _ in range(2)]
        try:
            (_, oldest), (_, newer) = held
            async with client(h) as a, client(h) as b:
                await a.send(posted(first))
                with anyio.fail_after(GUARD):
                    while not gated.calls:
                        await anyio.sleep(0.001)
                assert http.bodies.used == http.bodies.limit  # held to the last byte
                await b.send(posted(second))
                with anyio.fail_after(GUARD):
                    while len(gated.calls) < 2 and not unavailable(h):
                        await anyio.sleep(0.001)
                assert unavailable(h) == 0  # not refused for the bodies nobody reads
                gated.gate.set()
                with anyio.fail_after(GUARD):
                    assert (await a.response()).json()["response"]["uid"] == "first"
                    assert (await b.response()).json()["response"]["uid"] == "second"
            with anyio.fail_after(GUARD):
                while oldest._transport is not None:
                    await anyio.sleep(0.001)
            assert newer in http._connections and newer._charged == size
            assert metric(h, "gpudra_webhook_connections_shed_total", action="evicted") == 1
        finally:
            for unread, _ in held:
                unread.close()
        with anyio.fail_after(GUARD):
            while http._connections:
                await anyio.sleep(0.01)
        assert http.bodies.used == 0


async def test_a_body_queued_behind_unread_answers_is_held_for_the_body_bound(
    tmp_path: Path,
) -> None:
    """A client that never reads its answers, with a complete body queued behind them,
    holds that body for the body's bound, not the keep-alive bound: then its connection
    is aborted and the body given back."""
    size = 4096
    async with running(tmp_path, max_body_bytes=size, body_timeout=0.5, idle_timeout=600) as h:
        unread, connection = await unread_with_a_body_queued(h, size)
        try:
            assert h.server._http.bodies.used == size
            with anyio.fail_after(GUARD):
                while connection._transport is not None:
                    await anyio.sleep(0.01)
            assert h.server._http.bodies.used == 0
            assert not connection._pending
        finally:
            unread.close()


def test_the_health_port_shares_the_body_budget(tmp_path: Path) -> None:
    pki_dir = tmp_path / "pki"
    ensure_pki(pki_dir, ["localhost"])
    config = ServerConfig(cert_file=pki_dir / "tls.crt", key_file=pki_dir / "tls.key")
    server = WebhookServer(config, Recorder())
    assert server.health_server(0).bodies is server._http.bodies
    assert server._http.bodies.limit == 64 * 2**20


def test_the_body_budget_flag_reaches_the_server_and_holds_the_largest_body(
    tmp_path: Path,
) -> None:
    parser = build_parser()

    def config(*flags: str) -> HttpConfig:
        args = parser.parse_args(["webhook", "--cert-dir=certs", *flags])
        return server_config(args, conversion_policy(args))

    assert config().max_buffered_body_bytes == HttpConfig.max_buffered_body_bytes == 64 * 2**20
    assert config("--max-buffered-body-bytes=268435456").max_buffered_body_bytes == 2**28
    too_small = f"--max-buffered-body-bytes={3 * 2**20 - 1}"
    args = parser.parse_args(["webhook", f"--cert-dir={tmp_path}", too_small])
    with pytest.raises(SystemExit) as exit_:
        run(args)
    assert "--max-buffered-body-bytes 3145727: give at least the largest request body" in str(
        exit_.value
    )
    assert not any(tmp_path.iterdir())  # refused before any certificate was made


# --- health, readiness, metrics ---


async def test_health_and_readiness(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        health = await c.request("GET", "/healthz")
        assert (health.status, health.body) == (200, b"ok\n")
        assert (await c.request("GET", "/readyz")).status == 200
        h.server.begin_shutdown()
        resp = await c.request("GET", "/readyz")
        assert resp.status == 503
        assert resp.headers["connection"] == "close"  # draining: no more keep-alive
    async with running(tmp_path / "b") as h, client(h) as c:
        assert (await c.request("GET", "/healthz")).status == 200


async def test_readiness_hook(tmp_path: Path) -> None:
    ready = {"value": False}
    pki_dir = tmp_path / "pki"
    ensure_pki(pki_dir, ["localhost"])
    config = ServerConfig(
        cert_file=pki_dir / "tls.crt", key_file=pki_dir / "tls.key", host="127.0.0.1", port=0
    )
    server = WebhookServer(config, Recorder(), ready=lambda: ready["value"])
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        pem = (pki_dir / "ca-bundle.crt").read_bytes()
        c = await Client.connect(port, pem)
        assert (await c.request("GET", "/readyz")).status == 503
        ready["value"] = True
        assert (await c.request("GET", "/readyz")).status == 200
        await c.aclose()
        tg.cancel_scope.cancel()


async def test_metrics_move(tmp_path: Path) -> None:
    async with running(tmp_path) as h, client(h) as c:
        await admit(c, review(gpu_pod()))
        await admit(c, review(gpu_pod("1.5")))
        await admit(c, b"{")
        resp = await c.request("GET", "/metrics")
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/plain")
        text = resp.body.decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    path = "/mutate-pods"
    assert value("gpudra_webhook_requests_total", path=path, result="patched") == 1
    assert value("gpudra_webhook_requests_total", path=path, result="denied") == 1
    assert value("gpudra_webhook_requests_total", path=path, result="bad_request") == 1
    assert value("gpudra_webhook_denials_total", reason="invalid") == 1
    assert value("gpudra_webhook_conversions_total", dry_run="false") == 1
    assert value("gpudra_webhook_converted_claims_total", kind="gpu") == 1
    assert value("gpudra_webhook_request_duration_seconds_count", path=path) == 3


async def test_review_without_http(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        status, body = await h.server.review(json.dumps(review(gpu_pod())).encode())
        assert status == 200
        assert json.loads(body)["response"]["patchType"] == "JSONPatch"
        status, body = await h.server.review(b"nope")
        assert status == 400


# --- TLS ---


async def test_certificate_rotation_reaches_new_connections(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        old = await Client.connect(h.port, h.pki.ca_bundle)
        old_der = old.peer_certificate()
        assert old_der == _der(h.pki.serving.cert_pem)

        rotated = generate_serving_cert(h.pki.ca, service_dns_names("gpudra-webhook", "gpudra"))
        write_atomic(h.pki_dir / "tls.key", rotated.key_pem)
        write_atomic(h.pki_dir / "tls.crt", rotated.cert_pem, mode=0o644)

        with anyio.fail_after(GUARD):
            while True:
                async with client(h) as c:
                    if c.peer_certificate() != old_der:
                        assert c.peer_certificate() == _der(rotated.cert_pem)
                        assert (await c.request("GET", "/healthz")).status == 200
                        break
                await anyio.sleep(0.02)
        # The connection opened before the rotation keeps working.
        resp = await admit(old, review(gpu_pod()))
        assert resp.json()["response"]["allowed"] is True
        await old.aclose()
        assert metric(h, "gpudra_webhook_certificate_reloads_total", result="success") >= 1


async def test_mismatched_certificate_files_keep_the_old_certificate(tmp_path: Path) -> None:
    async with running(tmp_path, cert_check_interval=3600) as h:
        other = generate_serving_cert(generate_ca(), ["elsewhere"])
        write_atomic(h.pki_dir / "tls.crt", other.cert_pem, mode=0o644)  # key not yet written
        assert h.server.tls.reload_if_changed() is False
        assert h.server.tls.reload_if_changed() is False  # not retried until files change
        async with client(h) as c:
            assert c.peer_certificate() == _der(h.pki.serving.cert_pem)
        assert metric(h, "gpudra_webhook_certificate_reloads_total", result="failure") == 1
        write_atomic(h.pki_dir / "tls.crt", h.pki.serving.cert_pem, mode=0o644)
        (h.pki_dir / "tls.key").unlink()
        assert h.server.tls.reload_if_changed() is False  # unreadable: keep serving


async def test_only_http11_is_offered(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        context = ssl.create_default_context(cadata=h.pki.ca_bundle.decode())
        context.set_alpn_protocols(["h2", "http/1.1"])
        async with await anyio.connect_tcp(
            "127.0.0.1",
            h.port,
            tls=True,
            ssl_context=context,
            tls_hostname="127.0.0.1",
            tls_standard_compatible=False,
        ) as tls:
            assert tls.extra(TLSAttribute.alpn_protocol) == "http/1.1"


async def test_missing_certificate_fails_at_construction(tmp_path: Path) -> None:
    config = ServerConfig(cert_file=tmp_path / "tls.crt", key_file=tmp_path / "tls.key")
    with pytest.raises(FileNotFoundError, match=r"tls\.crt"):
        WebhookServer(config, Recorder())


def _der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
