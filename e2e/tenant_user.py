"""A tenant user for escape tests: a ServiceAccount with the built-in `edit` ClusterRole
bound in its own namespace only, whose requests carry its own TokenRequest token, as a
real user of a shared cluster would make them (the admin client's certificate would
hide every RBAC rule)."""

from __future__ import annotations

import http.client
import json
import ssl
from typing import Any

from e2e.cluster.kube import ApiError, Credentials
from e2e.cluster.kube import Kube as SyncKube


class TenantUser:
    """Requests made with a ServiceAccount's own bearer token, as a tenant would."""

    def __init__(self, creds: Credentials, token: str, name: str) -> None:
        self.name = name
        self._creds = creds
        self._token = token
        self._ctx = ssl.create_default_context(cafile=str(creds.ca))

    def request(self, method: str, path: str, body: Any = None) -> Any:
        conn = http.client.HTTPSConnection(
            self._creds.host, self._creds.port, context=self._ctx, timeout=30
        )
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if body is not None:
            merge = method == "PATCH"
            headers["Content-Type"] = (
                "application/merge-patch+json" if merge else "application/json"
            )
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            parsed: Any = json.loads(resp.read() or b"null")
        finally:
            conn.close()
        if resp.status >= 400:
            raise ApiError(resp.status, parsed, method, path)
        return parsed

    def create(self, obj: dict[str, Any]) -> Any:
        path = SyncKube.path(obj["kind"], obj["metadata"].get("namespace"))
        return self.request("POST", path, obj)


def tenant_token(kube: SyncKube, ns: str, sa: str = "tenant") -> str:
    """A ServiceAccount `sa` bound to `edit` in `ns` only; returns its own bound token."""
    kube.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}},
    )
    kube.request(
        "POST",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{sa}-edit"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "edit",
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        },
    )
    issued = kube.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 600},
        },
    )
    token: str = issued["status"]["token"]
    return token


def tenant_user(kube: SyncKube, ns: str) -> TenantUser:
    """A ServiceAccount bound to `edit` in `ns` only, and a client with its token."""
    sa = "tenant"
    return TenantUser(kube.creds, tenant_token(kube, ns, sa), f"system:serviceaccount:{ns}:{sa}")
