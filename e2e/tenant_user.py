"""A tenant user for escape tests: a ServiceAccount with the built-in `edit` ClusterRole
bound in its own namespace only, whose requests carry its own TokenRequest token, as a
real user of a shared cluster would make them (the admin client's certificate would
hide every RBAC rule); and the ServiceAccount tokens and kubeconfigs that let tests act
as any other ServiceAccount (a node agent's, the webhook's) the same way."""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.kube import ApiError, Credentials
from e2e.cluster.kube import Kube as SyncKube

RBAC = "/apis/rbac.authorization.k8s.io/v1"
CLUSTER_ROLE_BINDINGS = f"{RBAC}/clusterrolebindings"


class TenantUser:
    """Requests made with a ServiceAccount's own bearer token, as a tenant would."""

    def __init__(self, creds: Credentials, token: str, name: str) -> None:
        self.name = name
        self._creds = creds
        self._token = token
        self._ctx = ssl.create_default_context(cafile=str(creds.ca))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/merge-patch+json",
    ) -> Any:
        """With the token; PATCH bodies are merge patches unless `content_type` says."""
        conn = http.client.HTTPSConnection(
            self._creds.host, self._creds.port, context=self._ctx, timeout=30
        )
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type if method == "PATCH" else "application/json"
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


def bound_service_account(
    kube: SyncKube, ns: str, sa: str, role: str, *, binding: str, cluster_wide: bool = False
) -> str:
    """A ServiceAccount `sa` in `ns` bound to ClusterRole `role` by `binding`, a
    RoleBinding in `ns` or, `cluster_wide`, a ClusterRoleBinding (for the caller to
    delete); returns its own bound token."""
    kube.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}},
    )
    kube.request(
        "POST",
        CLUSTER_ROLE_BINDINGS if cluster_wide else f"{RBAC}/namespaces/{ns}/rolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding" if cluster_wide else "RoleBinding",
            "metadata": {"name": binding},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        },
    )
    return service_account_token(kube, ns, sa)


def tenant_token(kube: SyncKube, ns: str, sa: str = "tenant") -> str:
    """A ServiceAccount `sa` bound to `edit` in `ns` only; returns its own bound token."""
    return bound_service_account(kube, ns, sa, "edit", binding=f"{sa}-edit")


def service_account_token(
    kube: SyncKube,
    ns: str,
    sa: str,
    *,
    bound_to: dict[str, Any] | None = None,
    expiration_s: int | None = 600,
) -> str:
    """A TokenRequest token of ServiceAccount `sa` in `ns`, bound to the object
    `bound_to` (as stored) when given, valid `expiration_s` (None: the server's default)."""
    spec: dict[str, Any] = {}
    if expiration_s is not None:
        spec["expirationSeconds"] = expiration_s
    if bound_to is not None:
        spec["boundObjectRef"] = {
            "apiVersion": bound_to["apiVersion"],
            "kind": bound_to["kind"],
            "name": bound_to["metadata"]["name"],
            "uid": bound_to["metadata"]["uid"],
        }
    issued = kube.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    token: str = issued["status"]["token"]
    return token


def pod_bound_token(
    kube: SyncKube, ns: str, sa: str, node: str, pod: str, *, expiration_s: int | None = 600
) -> str:
    """A token of ServiceAccount `sa` bound to a new pod `pod` of it on `node`, as a
    DaemonSet's pod there holds one (no kubelet runs it: the API server only records it)."""
    bound = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns},
            "spec": {
                "nodeName": node,
                "serviceAccountName": sa,
                "containers": [{"name": "agent", "image": "gpudra:test"}],
            },
        }
    )
    return service_account_token(kube, ns, sa, bound_to=bound, expiration_s=expiration_s)


def token_kubeconfig(creds: Credentials, token: str, user: str, path: Path) -> Path:
    """A kubeconfig at `path` for the cluster of `creds` whose user `user` holds `token`,
    for gpudra's own client to make its requests as that user."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": f"https://{creds.host}:{creds.port}",
                    "certificate-authority": str(creds.ca),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": user}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def cluster_admin_user(
    kube: SyncKube, ns: str, sa: str = "platform-admin"
) -> tuple[TenantUser, str]:
    """A ServiceAccount of `ns` bound to the `cluster-admin` ClusterRole, and a client
    with its token: a cluster admin outside `system:masters`, as kubeadm's admin.conf
    user is. Also returns the ClusterRoleBinding's path, for the caller to delete."""
    binding = f"{ns}-{sa}"
    token = bound_service_account(kube, ns, sa, "cluster-admin", binding=binding, cluster_wide=True)
    user = TenantUser(kube.creds, token, f"system:serviceaccount:{ns}:{sa}")
    return user, f"{CLUSTER_ROLE_BINDINGS}/{binding}"


def tenant_user(kube: SyncKube, ns: str) -> TenantUser:
    """A ServiceAccount bound to `edit` in `ns` only, and a client with its token."""
    sa = "tenant"
    return TenantUser(kube.creds, tenant_token(kube, ns, sa), f"system:serviceaccount:{ns}:{sa}")
