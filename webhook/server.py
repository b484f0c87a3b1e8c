"""The admission webhook server: admission decisions served over the HTTPS transport.

Composition only. `Admission` (``admission.py``) turns AdmissionReview bodies into
responses and knows nothing of HTTP; `HttpServer` (``transport.py``) serves HTTPS with
certificate reload, limits, health and metrics and knows nothing of admission; both
count into one `WebhookMetrics` registry. This module maps one onto the other: a
decision becomes a 200 with the AdmissionReview, a body that is not a usable review a
400 naming the field.

Throughput and latency targets are checked by the benchmark (``make bench-webhook``).
The server runs on uvloop (`gpudra.common.eventloop`, which says why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from gpudra.api.tenants import LabelSelector
from gpudra.webhook.admission import (
    MUTATE_PATH,
    VALIDATE_CLAIMS_PATH,
    Admission,
    ClaimReader,
    ReviewHandler,
    TemplateEnsurer,
)
from gpudra.webhook.convert import DEFAULT_POLICY, ConversionPolicy
from gpudra.webhook.metrics import PodSecurityGaps, WebhookMetrics
from gpudra.webhook.reviews import ReviewError, encode_review
from gpudra.webhook.tenant_state import TenantState
from gpudra.webhook.tls import ReloadingTLSContext
from gpudra.webhook.transport import Endpoint, HttpConfig, HttpServer, Reply, text_reply
from gpudra.webhook.validate import ClassConfigs
from prometheus_client import CollectorRegistry

__all__ = [
    "MUTATE_PATH",
    "VALIDATE_CLAIMS_PATH",
    "ServerConfig",
    "TemplateEnsurer",
    "WebhookServer",
]


@dataclass(frozen=True)
class ServerConfig(HttpConfig):
    """The transport's settings plus the conversion policy and the template deadline."""

    policy: ConversionPolicy = DEFAULT_POLICY
    extra_device_classes: tuple[str, ...] = ()
    """DeviceClasses of the driver beyond the policy's three (admin-made classes that
    select its devices): tenant class rules and claim validation cover them too."""
    ensure_timeout: float = 5.0
    """How long template creation may take before the pod is denied."""
    own_namespace: str = "gpudra"
    """The driver's namespace: excluded from the webhook like kube-system, so no review
    for it ever makes the webhook write there."""
    conversion_selector: LabelSelector | None = None
    """The namespaces whose pods are converted (a migration's selector). Evaluated by the
    webhook itself where it watches Namespaces (with tenant rules), so that the pod
    webhook can be sent every namespace's GPU pods and the rules hold in all of them."""


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
        device_classes: Mapping[str, ClassConfigs] | None = None,
        read_claims: ClaimReader | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        metrics = WebhookMetrics(self.registry)
        if tenants is not None:
            self.registry.register(PodSecurityGaps(tenants.without_pod_security))
        admission = Admission(
            ensure_templates,
            metrics,
            policy=config.policy,
            extra_device_classes=config.extra_device_classes,
            tenants=tenants,
            ensure_timeout=config.ensure_timeout,
            device_classes=device_classes,
            read_claims=read_claims,
            own_namespace=config.own_namespace,
            conversion_selector=config.conversion_selector,
        )
        self._endpoints = {
            path: http_endpoint(handler) for path, handler in admission.endpoints().items()
        }
        self._http = HttpServer(config, self._endpoints, metrics, ready=ready)
        self._config, self._metrics, self._ready = config, metrics, ready

    def health_server(self, port: int) -> HttpServer:
        """A second listener on `port` with only /healthz, /readyz and /metrics and no
        client certificate check: the kubelet's probes and metrics scrapers present
        none, while the admission port may require the API server's. It shares the
        admission port's budget of buffered request bodies: one process, one memory
        limit."""
        config = dataclasses.replace(self._config, port=port)
        return HttpServer(config, {}, self._metrics, ready=self._ready, bodies=self._http.bodies)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); 0 before `serve` started."""
        return self._http.port

    @property
    def tls(self) -> ReloadingTLSContext:
        return self._http.tls

    def begin_shutdown(self) -> None:
        """Fail readiness and close connections after their current request."""
        self._http.begin_shutdown()

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through `task_status`."""
        await self._http.serve(task_status=task_status)

    async def review(self, body: bytes) -> tuple[int, bytes]:
        """Answer one pod AdmissionReview body without HTTP: (HTTP status, body)."""
        reply = await self._endpoints[MUTATE_PATH](body)
        return reply.status, reply.body


def http_endpoint(handler: ReviewHandler) -> Endpoint:
    """`handler` as a transport endpoint: 200 with the review, or 400 naming the field."""

    async def endpoint(body: bytes) -> Reply:
        try:
            decision = await handler(body)
        except ReviewError as exc:
            return text_reply(400, str(exc))
        return Reply(200, encode_review(decision.response), decision.result)

    return endpoint
