"""HTTPS admission server: AdmissionReview in, JSON patch out.

HTTP stack: anyio TCP listener + `anyio.streams.tls.TLSStream` + a small HTTP/1.1
keep-alive parser in this module, no extra dependency. The only client is the API
server, which sends one ``POST`` with a ``Content-Length`` body per request over pooled
keep-alive connections, so a full HTTP stack buys little, while owning the loop gives
what the webhook needs and uvicorn/starlette make awkward (uvicorn loads its TLS
certificate once at startup; h11 parses slower than this and httptools is a C build):

- the TLS context is chosen per handshake, so a rotated certificate reaches new
  connections at once while open connections keep working (no restart, no drops);
- every phase has its own bound: handshake, idle keep-alive, header bytes and time,
  body size (checked against ``Content-Length`` before reading) and time, write time,
  so a slow or hostile client only ever ties up its own task;
- it runs on the same anyio/asyncio loop as the rest of gpudra.

Throughput and latency targets are checked by the benchmark, not here.

Dry runs create nothing: the server only computes the patch and passes the dry-run flag
to the injected `TemplateEnsurer`, which owns all API-server writes. The idle keep-alive
timeout (120 s) is above the 90 s idle-connection timeout of Go's HTTP transports, so the API server
closes pooled connections first and never writes into one the server is closing.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import anyio
import anyio.to_thread
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteStream
from anyio.streams.tls import TLSStream
from gpudra.webhook.convert import (
    DEFAULT_POLICY,
    OPT_OUT_LABEL,
    Conversion,
    ConversionError,
    ConversionPolicy,
    convert_pod,
)
from gpudra.webhook.tenant_state import TenantState
from gpudra.webhook.validate import driver_classes, validate_claim_object
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

__all__ = [
    "MUTATE_PATH",
    "VALIDATE_CLAIMS_PATH",
    "ReloadingTLSContext",
    "ServerConfig",
    "TemplateEnsurer",
    "WebhookServer",
]

logger = logging.getLogger(__name__)

MUTATE_PATH: Final = "/mutate-pods"
VALIDATE_CLAIMS_PATH: Final = "/validate-claims"
_ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"
_KNOWN_PATHS: Final = frozenset(
    {MUTATE_PATH, VALIDATE_CLAIMS_PATH, "/healthz", "/readyz", "/metrics"}
)
_POD_KIND: Final = ("", "v1", "Pod")
_CLAIM_KIND: Final = ("resource.k8s.io", "v1", "ResourceClaim")
_TEMPLATE_KIND: Final = ("resource.k8s.io", "v1", "ResourceClaimTemplate")
_REASONS: Final = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}
_LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
# Errors that mean "the peer went away or spoke garbage": end the connection quietly.
_CONNECTION_ERRORS: Final = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ssl.SSLError,
    OSError,
    TimeoutError,
)


class TemplateEnsurer(Protocol):
    """Makes sure the ResourceClaimTemplates a converted pod refers to exist.

    Called before the patch is returned, so the controller-manager finds the template
    when it creates the pod's claim. The templates carry no namespace: they belong in
    `namespace`, and one that already exists under the name is reused (a name always
    stands for the same content). With ``dry_run`` it must not write anything. Raising (or
    exceeding ``ServerConfig.ensure_timeout``) denies the pod.
    """

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None: ...


@dataclass(frozen=True)
class ServerConfig:
    """Listener, TLS files, conversion policy and the per-phase limits."""

    cert_file: Path
    key_file: Path
    host: str | None = None
    """Address to bind; None listens on every interface (IPv4 and IPv6)."""
    port: int = 8443
    policy: ConversionPolicy = DEFAULT_POLICY
    extra_device_classes: tuple[str, ...] = ()
    """DeviceClasses of the driver beyond the policy's three (admin-made classes that
    select its devices): tenant class rules and claim validation cover them too."""
    max_body_bytes: int = 3 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    handshake_timeout: float = 10.0
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    write_timeout: float = 10.0
    idle_timeout: float = 120.0
    ensure_timeout: float = 5.0
    cert_check_interval: float = 1.0


class ReloadingTLSContext:
    """Serving TLS context, rebuilt when the certificate or key file changes.

    Each handshake takes `context`, so new connections see a rotated certificate as soon
    as `reload_if_changed` ran, and established ones keep theirs. A half-written pair
    (certificate and key not matching yet) keeps the previous context until the files
    change again.
    """

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        *,
        on_reload: Callable[[bool], None] | None = None,
    ) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._on_reload = on_reload
        self._signature = self._stat()
        self._context = self._build()
        self._failed: tuple[tuple[int, ...], ...] | None = None

    @property
    def context(self) -> ssl.SSLContext:
        return self._context

    def reload_if_changed(self) -> bool:
        """Reload when the files changed since the last load; True when reloaded."""
        try:
            signature = self._stat()
        except OSError as exc:
            logger.warning(
                "serving certificate files unreadable; keeping the current certificate",
                extra={"fields": {"error": str(exc)}},
            )
            return False
        if signature in (self._signature, self._failed):
            return False
        try:
            context = self._build()
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._failed = signature
            logger.warning(
                "could not load the new serving certificate; keeping the current one",
                extra={"fields": {"cert_file": str(self._cert_file), "error": str(exc)}},
            )
            if self._on_reload:
                self._on_reload(False)
            return False
        self._context, self._signature, self._failed = context, signature, None
        logger.info(
            "serving certificate reloaded", extra={"fields": {"cert_file": str(self._cert_file)}}
        )
        if self._on_reload:
            self._on_reload(True)
        return True

    async def watch(self, interval: float) -> None:
        """Poll the files every `interval` seconds (off the event loop) until cancelled."""
        while True:
            await anyio.sleep(interval)
            await anyio.to_thread.run_sync(self.reload_if_changed)

    def _stat(self) -> tuple[tuple[int, ...], ...]:
        # stat() follows symlinks, so a Secret volume's atomic ..data swap is seen.
        return tuple(
            (s.st_mtime_ns, s.st_size, s.st_ino, s.st_dev)
            for s in (self._cert_file.stat(), self._key_file.stat())
        )

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._cert_file, self._key_file)
        # Only HTTP/1.1: the API server must not try HTTP/2 on this listener.
        context.set_alpn_protocols(["http/1.1"])
        return context


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "gpudra_webhook_requests",
            "HTTP requests by path and result.",
            ["path", "result"],
            registry=registry,
        )
        self.denials = Counter(
            "gpudra_webhook_denials",
            "Admission denials by reason.",
            ["reason"],
            registry=registry,
        )
        self.conversions = Counter(
            "gpudra_webhook_conversions",
            "Pods converted from device-plugin resources to DRA claims.",
            ["dry_run"],
            registry=registry,
        )
        self.converted_claims = Counter(
            "gpudra_webhook_converted_claims",
            "Pod claims added by conversion, by device kind.",
            ["kind"],
            registry=registry,
        )
        self.latency = Histogram(
            "gpudra_webhook_request_duration_seconds",
            "Time from a complete request head to the response being written.",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.cert_reloads = Counter(
            "gpudra_webhook_certificate_reloads",
            "Serving certificate reload attempts by result.",
            ["result"],
            registry=registry,
        )


@dataclass
class _Response:
    status: int
    body: bytes
    result: str
    content_type: str = "text/plain; charset=utf-8"
    close: bool = False

    def encode(self, keep_alive: bool) -> bytes:
        head = (
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}\r\n"
            f"Content-Type: {self.content_type}\r\n"
            f"Content-Length: {len(self.body)}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        )
        return head.encode("latin-1") + self.body


@dataclass
class _Request:
    method: str
    path: str
    keep_alive: bool
    headers: dict[str, str] = field(default_factory=dict)


class _HTTPError(Exception):
    """A request the connection cannot continue after; answered, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _BadReview(Exception):
    """A well-framed request whose AdmissionReview is unusable (HTTP 400)."""


def _text(status: int, message: str, result: str, *, close: bool = False) -> _Response:
    return _Response(status, (message + "\n").encode(), result, close=close)


class WebhookServer:
    """The admission webhook's HTTPS endpoint; run `serve` inside a task group."""

    def __init__(
        self,
        config: ServerConfig,
        ensure_templates: TemplateEnsurer,
        *,
        registry: CollectorRegistry | None = None,
        ready: Callable[[], bool] | None = None,
        tenants: TenantState | None = None,
    ) -> None:
        self._config = config
        self._ensure = ensure_templates
        self._ready_check = ready
        self._tenants = tenants
        self._classes = driver_classes(config.policy, config.extra_device_classes)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = _Metrics(self.registry)
        self._tls = ReloadingTLSContext(
            config.cert_file,
            config.key_file,
            on_reload=lambda ok: self._metrics.cert_reloads.labels(
                "success" if ok else "failure"
            ).inc(),
        )
        self._port = 0
        self._serving = False
        self._draining = False

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); 0 before `serve` started."""
        return self._port

    @property
    def tls(self) -> ReloadingTLSContext:
        return self._tls

    def begin_shutdown(self) -> None:
        """Fail readiness and close connections after their current request, so the
        Service stops routing here before the process is stopped."""
        self._draining = True

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through `task_status`."""
        listener = await anyio.create_tcp_listener(
            local_host=self._config.host, local_port=self._config.port
        )
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(self._tls.watch, self._config.cert_check_interval)
            self._port = listener.extra(SocketAttribute.local_port)  # noqa: S610 (anyio, not Django)
            self._serving = True
            logger.info("admission webhook listening", extra={"fields": {"port": self._port}})
            task_status.started(self._port)
            try:
                await listener.serve(self._connection, tg)
            finally:
                self._serving = False

    async def review(self, body: bytes) -> tuple[int, bytes]:
        """Answer one AdmissionReview body: (HTTP status, response body)."""
        response = await self._mutate(body)
        return response.status, response.body

    async def _connection(self, raw: SocketStream) -> None:
        cfg = self._config
        try:
            with anyio.fail_after(cfg.handshake_timeout):
                tls = await TLSStream.wrap(
                    raw, server_side=True, ssl_context=self._tls.context, standard_compatible=False
                )
            stream = BufferedByteStream(tls)
            first = True
            while await self._exchange(stream, first):
                first = False
        except _CONNECTION_ERRORS:
            pass
        except Exception:
            # Never let one connection take the listener down.
            logger.exception("unexpected error on a webhook connection")
        finally:
            await anyio.aclose_forcefully(raw)

    async def _exchange(self, stream: BufferedByteStream, first: bool) -> bool:
        """Serve one request; True when the connection stays open for another.

        One cancel scope covers the whole exchange and its deadline moves with the
        phase (idle, head, body, answer, write): each phase is bounded on its own while
        a request pays for a single scope.
        """
        cfg = self._config
        phase = "idle"
        failure: _HTTPError | None = None
        path = "other"
        with anyio.CancelScope(
            deadline=anyio.current_time() + (cfg.header_timeout if first else cfg.idle_timeout)
        ) as scope:
            if not stream.buffer:
                stream.feed_data(await stream.receive())
            phase = "head"
            scope.deadline = anyio.current_time() + cfg.header_timeout
            try:
                head = await stream.receive_until(b"\r\n\r\n", cfg.max_header_bytes)
                started = time.perf_counter()
                request = _parse_head(head)
                path = request.path if request.path in _KNOWN_PATHS else "other"
                length = self._body_length(request)
                if request.headers.get("expect", "").lower() == "100-continue" and length:
                    await stream.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                phase = "body"
                scope.deadline = anyio.current_time() + cfg.body_timeout
                body = await stream.receive_exactly(length) if length else b""
            except anyio.DelimiterNotFound:
                failure = _HTTPError(400, f"request head exceeds {cfg.max_header_bytes} bytes")
            except _HTTPError as exc:
                failure = exc
            if failure is None:
                phase = "answer"
                scope.deadline = math.inf
                try:
                    response = await self._route(request, body)
                except Exception:
                    logger.exception("unexpected error answering a webhook request")
                    response = _text(500, "internal error", "error", close=True)
                keep_alive = request.keep_alive and not response.close and not self._draining
                phase = "write"
                scope.deadline = anyio.current_time() + cfg.write_timeout
                await stream.send(response.encode(keep_alive))
                self._metrics.requests.labels(path, response.result).inc()
                self._metrics.latency.labels(path).observe(time.perf_counter() - started)
                return keep_alive
        if failure is None and phase in ("head", "body"):
            failure = _HTTPError(408, f"request {phase} not received in time")
        if failure is not None:
            await self._fail(stream, failure.status, failure.message, path)
        return False

    def _body_length(self, request: _Request) -> int:
        if "transfer-encoding" in request.headers:
            raise _HTTPError(501, "Transfer-Encoding is not supported; send Content-Length")
        length_text = request.headers.get("content-length")
        if length_text is None:
            if request.method == "POST":
                raise _HTTPError(411, "POST needs a Content-Length header")
            return 0
        if not (length_text.isascii() and length_text.isdigit()) or len(length_text) > 18:
            raise _HTTPError(400, f"invalid Content-Length {length_text!r}")
        length = int(length_text)
        if length > self._config.max_body_bytes:
            raise _HTTPError(
                400,
                f"request body of {length} bytes exceeds the limit of "
                f"{self._config.max_body_bytes} bytes; AdmissionReviews of Pods are far smaller",
            )
        return length

    async def _fail(
        self, stream: BufferedByteStream, status: int, message: str, path: str = "other"
    ) -> None:
        """Answer a request the connection cannot go on after, then drain briefly so
        closing with unread input does not reset the connection before the client
        reads the answer."""
        self._metrics.requests.labels(path, "bad_request" if status < 500 else "error").inc()
        logger.info(
            "rejected malformed webhook request",
            extra={"fields": {"status": status, "error": message}},
        )
        with anyio.move_on_after(self._config.write_timeout):
            await stream.send(_text(status, message, "bad_request").encode(keep_alive=False))
        with anyio.move_on_after(1.0):
            drained = 0
            while drained < self._config.max_body_bytes * 4:
                drained += len(await stream.receive())

    async def _route(self, request: _Request, body: bytes) -> _Response:
        path, method = request.path, request.method
        if path == MUTATE_PATH:
            if method != "POST":
                return _text(405, f"{path} accepts POST only", "bad_request")
            return await self._mutate(body)
        if path == VALIDATE_CLAIMS_PATH:
            if method != "POST":
                return _text(405, f"{path} accepts POST only", "bad_request")
            return self._validate_claims(body)
        if path not in _KNOWN_PATHS:
            return _text(404, f"no handler for {path}", "not_found")
        if method != "GET":
            return _text(405, f"{path} accepts GET only", "bad_request")
        if path == "/healthz":
            return _text(200, "ok", "ok")
        if path == "/readyz":
            if self._ready():
                return _text(200, "ok", "ok")
            return _text(503, "not ready", "unavailable")
        return _Response(200, generate_latest(self.registry), "ok", CONTENT_TYPE_LATEST)

    def _ready(self) -> bool:
        if not self._serving or self._draining:
            return False
        return self._ready_check() if self._ready_check else True

    def _validate_claims(self, body: bytes) -> _Response:
        """Hand-written ResourceClaims and templates: tenant rules and opaque configs."""
        try:
            uid, request = _read_review(body, (_CLAIM_KIND, _TEMPLATE_KIND))
        except _BadReview as exc:
            return _text(400, str(exc), "bad_request")
        if request.get("operation", "CREATE") != "CREATE":
            return _review(uid, allowed=True, result="allowed")
        obj = request.get("object")
        namespace = request.get("namespace")
        if not isinstance(obj, dict) or not isinstance(namespace, str) or not namespace:
            return _text(400, "request.object and request.namespace are required", "bad_request")
        lookup = self._tenants.lookup(namespace) if self._tenants is not None else None
        kind = request["kind"]["kind"]
        verdict = validate_claim_object(
            obj,
            template=kind == "ResourceClaimTemplate",
            policy=self._config.policy,
            classes=self._classes,
            rules=lookup.rules if lookup is not None else None,
            denial=lookup.denial if lookup is not None else "",
        )
        if verdict.allowed:
            return _review(uid, allowed=True, result="allowed")
        self._metrics.denials.labels("invalid_config" if verdict.invalid else "tenant").inc()
        name = (obj.get("metadata") or {}).get("name") or "(generated name)"
        message = f"{kind} {name}: {verdict.message}"
        logger.info(
            "denied claim",
            extra={"fields": {"uid": uid, "namespace": namespace, "error": message}},
        )
        code = 400 if verdict.invalid else 403
        return _review(uid, allowed=False, code=code, message=message, result="denied")

    async def _mutate(self, body: bytes) -> _Response:
        try:
            uid, request = _read_review(body)
        except _BadReview as exc:
            return _text(400, str(exc), "bad_request")
        if request.get("operation", "CREATE") != "CREATE":
            return _review(uid, allowed=True, result="allowed")
        pod = request.get("object")
        if not isinstance(pod, dict):
            return _text(400, "request.object must be the Pod being admitted", "bad_request")
        metadata = pod.get("metadata")
        namespace = request.get("namespace") or (
            metadata.get("namespace") if isinstance(metadata, dict) else None
        )
        if not isinstance(namespace, str) or not namespace:
            return _text(400, "request.namespace is missing", "bad_request")
        dry_run = request.get("dryRun") is True
        fields = {"uid": uid, "namespace": namespace, "dry_run": dry_run}
        policy = self._config.policy
        lookup = self._tenants.lookup(namespace) if self._tenants is not None else None
        if lookup is not None and lookup.rules is not None:
            policy = lookup.rules.policy
        try:
            conversion = convert_pod(pod, policy)
        except ConversionError as exc:
            self._metrics.denials.labels("invalid").inc()
            logger.info("denied pod", extra={"fields": {**fields, "error": str(exc)}})
            return _review(uid, allowed=False, code=400, message=str(exc), result="denied")
        if not conversion.changed:
            return _review(uid, allowed=True, result="allowed")
        if lookup is not None:
            assert self._tenants is not None
            reason = lookup.denial or (
                lookup.rules.check_pod(conversion, namespace, self._tenants.quota_usage(namespace))
                if lookup.rules is not None
                else None
            )
            if reason:
                self._metrics.denials.labels("tenant").inc()
                logger.info("denied pod", extra={"fields": {**fields, "error": reason}})
                return _review(uid, allowed=False, code=403, message=reason, result="denied")
        if conversion.templates:
            try:
                with anyio.fail_after(self._config.ensure_timeout):
                    await self._ensure(namespace, conversion.templates, dry_run)
            except Exception as exc:
                names = ", ".join(t["metadata"]["name"] for t in conversion.templates)
                self._metrics.denials.labels("templates").inc()
                logger.warning(
                    "could not ensure ResourceClaimTemplates",
                    exc_info=True,
                    extra={"fields": {**fields, "templates": names}},
                )
                if isinstance(exc, TimeoutError):
                    reason = f"no answer within {self._config.ensure_timeout:g}s"
                else:
                    reason = str(exc) or type(exc).__name__
                message = (
                    f"could not create ResourceClaimTemplates {names} in namespace "
                    f"{namespace}: {reason}; retry, or label the pod "
                    f'{OPT_OUT_LABEL}="false" to skip conversion'
                )
                return _review(uid, allowed=False, code=500, message=message, result="denied")
        self._metrics.conversions.labels("true" if dry_run else "false").inc()
        for claim in conversion.claims:
            self._metrics.converted_claims.labels(claim.kind.value).inc()
        logger.info(
            "converted pod",
            extra={"fields": {**fields, "claims": [c.template_name for c in conversion.claims]}},
        )
        warnings = [
            f"gpudra: converted device-plugin GPU resources to DRA claim {c.pod_claim_name} "
            f"(template {c.template_name}, {c.devices} device(s))"
            for c in conversion.claims
        ]
        return _review(
            uid, allowed=True, conversion=conversion, warnings=warnings, result="patched"
        )


def _parse_head(head: bytes) -> _Request:
    lines = head.lstrip(b"\r\n").split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise _HTTPError(400, "malformed request line")
    method, target, version = (p.decode("latin-1") for p in parts)
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _HTTPError(400, f"unsupported protocol version {version!r}; use HTTP/1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise _HTTPError(400, "malformed header line")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        if key in headers:
            if key == "content-length" and headers[key] != text:
                raise _HTTPError(400, "conflicting Content-Length headers")
            text = f"{headers[key]}, {text}" if key != "content-length" else text
        headers[key] = text
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
    return _Request(
        method=method, path=target.split("?", 1)[0], keep_alive=keep_alive, headers=headers
    )


def _read_review(
    body: bytes, kinds: tuple[tuple[str, str, str], ...] = (_POD_KIND,)
) -> tuple[str, Mapping[str, Any]]:
    """Validate the AdmissionReview envelope for one of `kinds` (group, version, kind);
    returns (uid, request)."""
    try:
        review = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _BadReview(f"request body is not valid JSON: {exc}") from None
    if not isinstance(review, dict):
        raise _BadReview("request body must be an AdmissionReview object")
    api_version, kind = review.get("apiVersion"), review.get("kind")
    if api_version != _ADMISSION_API_VERSION or kind != "AdmissionReview":
        raise _BadReview(
            f"expected apiVersion {_ADMISSION_API_VERSION} kind AdmissionReview, got "
            f"apiVersion {api_version!r} kind {kind!r}; set admissionReviewVersions: [v1] "
            "in the webhook configuration"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise _BadReview("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise _BadReview("AdmissionReview request.uid is missing")
    resource_kind = request.get("kind")
    if (
        not isinstance(resource_kind, dict)
        or (
            resource_kind.get("group", ""),
            resource_kind.get("version"),
            resource_kind.get("kind"),
        )
        not in kinds
    ):
        wanted = ", ".join(f"{g or 'core'}/{v} {k}" for g, v, k in kinds)
        raise _BadReview(
            f"unsupported resource kind {resource_kind!r}: this path admits {wanted} only; "
            "restrict the webhook rules to those resources"
        )
    return uid, request


def _review(
    uid: str,
    *,
    allowed: bool,
    result: str,
    code: int = 200,
    message: str = "",
    conversion: Conversion | None = None,
    warnings: Sequence[str] = (),
) -> _Response:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {
            "status": "Failure",
            "code": code,
            "reason": {400: "BadRequest", 403: "Forbidden"}.get(code, "InternalError"),
            "message": message,
        }
    if conversion is not None and conversion.patch:
        patch = json.dumps(conversion.patch, separators=(",", ":")).encode()
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(patch).decode("ascii")
    if warnings:
        response["warnings"] = list(warnings)
    review = {"apiVersion": _ADMISSION_API_VERSION, "kind": "AdmissionReview", "response": response}
    body = json.dumps(review, separators=(",", ":")).encode()
    return _Response(200, body, result, "application/json")
