"""A small synchronous Kubernetes client for the test harness (stdlib + client cert).

The harness must work before the package's dependencies are importable (it starts
the cluster the tests run against), and tests want plain dicts to assert on.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        self.status = status
        self.body = body
        msg = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path}: HTTP {status}: {msg}")


@dataclass(frozen=True)
class Credentials:
    host: str
    port: int
    ca: Path
    cert: Path
    key: Path


# kind -> (api prefix, plural, namespaced)
RESOURCES: dict[str, tuple[str, str, bool]] = {
    "Node": ("/api/v1", "nodes", False),
    "Namespace": ("/api/v1", "namespaces", False),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "Secret": ("/api/v1", "secrets", True),
    "Service": ("/api/v1", "services", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "PriorityClass": ("/apis/scheduling.k8s.io/v1", "priorityclasses", False),
    "ResourceQuota": ("/api/v1", "resourcequotas", True),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases", True),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates", True),
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
        False,
    ),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingwebhookconfigurations",
        False,
    ),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True),
    "CustomResourceDefinition": (
        "/apis/apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        False,
    ),
    "ResourceFlavor": ("/apis/kueue.x-k8s.io/v1beta2", "resourceflavors", False),
    "ClusterQueue": ("/apis/kueue.x-k8s.io/v1beta2", "clusterqueues", False),
    "LocalQueue": ("/apis/kueue.x-k8s.io/v1beta2", "localqueues", True),
    "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads", True),
    "WorkloadPriorityClass": ("/apis/kueue.x-k8s.io/v1beta2", "workloadpriorityclasses", False),
}


class Kube:
    """Blocking JSON client; one connection per call keeps it thread-safe."""

    def __init__(self, creds: Credentials, timeout: float = 30.0) -> None:
        self.creds = creds
        self.timeout = timeout
        ctx = ssl.create_default_context(cafile=str(creds.ca))
        ctx.load_cert_chain(str(creds.cert), str(creds.key))
        self._ctx = ctx

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> Any:
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        conn = http.client.HTTPSConnection(
            self.creds.host, self.creds.port, context=self._ctx, timeout=self.timeout
        )
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        if resp.status >= 400:
            raise ApiError(resp.status, parsed, method, path)
        return parsed

    # -- typed helpers ---------------------------------------------------------
    @staticmethod
    def path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
        prefix, plural, namespaced = RESOURCES[kind]
        base = (
            f"{prefix}/namespaces/{namespace}/{plural}"
            if namespaced and namespace
            else (f"{prefix}/{plural}")
        )
        return f"{base}/{name}" if name else base

    def create(self, obj: dict[str, Any], **query: str) -> Any:
        ns = obj.get("metadata", {}).get("namespace")
        return self.request("POST", self.path(obj["kind"], ns), obj, query=query or None)

    def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
        return self.request("GET", self.path(kind, namespace, name))

    def get_or_none(self, kind: str, name: str, namespace: str | None = None) -> Any:
        try:
            return self.get(kind, name, namespace)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str | None = None, **query: str) -> list[Any]:
        items: list[Any] = self.request("GET", self.path(kind, namespace), query=query or None)[
            "items"
        ]
        return items

    def delete(
        self, kind: str, name: str, namespace: str | None = None, grace: int | None = None
    ) -> Any:
        body = None if grace is None else {"gracePeriodSeconds": grace}
        try:
            return self.request("DELETE", self.path(kind, namespace, name), body)
        except ApiError as e:
            if e.status != 404:
                raise
            return None

    def apply(self, obj: dict[str, Any], manager: str = "gpudra-e2e") -> Any:
        """Server-side apply, so tests and the demo are idempotent."""
        ns = obj.get("metadata", {}).get("namespace")
        return self.request(
            "PATCH",
            self.path(obj["kind"], ns, obj["metadata"]["name"]),
            obj,
            content_type="application/apply-patch+yaml",
            query={"fieldManager": manager, "force": "true"},
        )

    def patch_status(
        self, kind: str, name: str, patch: dict[str, Any], namespace: str | None = None
    ) -> Any:
        return self.request(
            "PATCH",
            self.path(kind, namespace, name) + "/status",
            patch,
            content_type="application/merge-patch+json",
        )


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def field_managers(obj: dict[str, Any], field: str) -> set[str]:
    """The field managers the API server records as owning `field` (anywhere in `obj`):
    an apply that sets it to another value conflicts with them, and the last of them to
    leave it out of an apply takes it out."""
    return {
        m["manager"]
        for m in obj["metadata"].get("managedFields") or ()
        if f'"f:{field}"' in json.dumps(m.get("fieldsV1"))
    }


def crd_established(kube: Kube, name: str) -> bool:
    """True once the API server serves CRD `name`; a new CRD's conditions may be null."""
    status = kube.request("GET", f"{CRD_PATH}/{name}").get("status") or {}
    return any(
        c["type"] == "Established" and c["status"] == "True" for c in status.get("conditions") or []
    )


def apply_crd(kube: Kube, crd: dict[str, Any]) -> None:
    """Server-side apply of a CRD, then wait until the API server serves it."""
    name = crd["metadata"]["name"]
    kube.request(
        "PATCH",
        f"{CRD_PATH}/{name}",
        crd,
        content_type="application/apply-patch+yaml",
        query={"fieldManager": "gpudra-e2e", "force": "true"},
    )
    wait_for(f"the CRD {name} to be established", lambda: crd_established(kube, name))


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2
) -> Any:
    """Polls `probe` until it returns something truthy; the error says what never happened."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
        except (ApiError, OSError) as e:
            last_exc = e
            value = None
        if value:
            return value
        time.sleep(interval)
    detail = f" (last error: {last_exc})" if last_exc else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
