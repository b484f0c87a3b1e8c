"""The chart refuses a cluster it cannot run on before creating anything: older than
1.34 (Chart.yaml's kubeVersion), or one that does not serve resource.k8s.io/v1.

Helm reads both from the cluster's discovery, so the cluster here is a discovery
endpoint that answers what such a cluster answers: its version, its API groups, and
no releases or nodes yet. Anything else it is asked (a create) fails the test.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from e2e.tools import helm as h

CORE = {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}


class Discovery:
    """A cluster of `version` serving `groups` ({group: [versions]}), read-only."""

    def __init__(self, version: str, groups: dict[str, list[str]]) -> None:
        self.version = version
        self.groups = groups
        self.writes: list[str] = []

    def answer(self, method: str, path: str) -> tuple[int, Any]:
        path = path.split("?", 1)[0]
        if method != "GET":
            self.writes.append(f"{method} {path}")
            return 405, {"kind": "Status", "code": 405}
        if path == "/version":
            minor = self.version.split(".")[1]
            return 200, {"major": "1", "minor": minor, "gitVersion": f"v{self.version}"}
        if path == "/api":
            return 200, CORE
        if path == "/apis":
            return 200, {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in self.groups.items()
                ],
            }
        parts = path.strip("/").split("/")
        if parts[0] in ("api", "apis") and len(parts) in (2, 3):
            gv = "/".join(parts[1:])
            return 200, {"kind": "APIResourceList", "groupVersion": gv, "resources": []}
        # A list (releases, nodes): nothing there yet.
        return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []}


@pytest.fixture
def cluster_at(tmp_path: Path) -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(version: str, groups: dict[str, list[str]]) -> tuple[Path, Discovery]:
        discovery = Discovery(version, groups)

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                code, body = discovery.answer(self.command, self.path)
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _reply

            def log_message(self, *_args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        config = tmp_path / f"kubeconfig-{version}"
        url = f"http://127.0.0.1:{server.server_address[1]}"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": url}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        return config, discovery

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def install(helm: Path, kubeconfig: Path) -> str:
    with pytest.raises(h.HelmFailed) as failure:
        h.run(
            helm,
            "install",
            "gpudra",
            str(h.CHART),
            "--namespace",
            "gpudra",
            "--kubeconfig",
            str(kubeconfig),
        )
    return str(failure.value)


RESOURCE_V1 = {"resource.k8s.io": ["v1", "v1beta2"], "apps": ["v1"]}


def test_a_cluster_older_than_1_34_is_refused_naming_both_versions(
    helm: Path, cluster_at: Any
) -> None:
    kubeconfig, discovery = cluster_at("1.33.5", {"resource.k8s.io": ["v1beta2"], "apps": ["v1"]})
    message = install(helm, kubeconfig)
    assert "chart requires kubeVersion: >=1.34.0-0" in message
    assert "incompatible with Kubernetes v1.33.5" in message
    assert discovery.writes == []


def test_a_cluster_without_resource_v1_is_refused_naming_the_version_and_the_fix(
    helm: Path, cluster_at: Any
) -> None:
    kubeconfig, discovery = cluster_at("1.35.2", {"resource.k8s.io": ["v1beta2"], "apps": ["v1"]})
    message = install(helm, kubeconfig)
    assert (
        "this cluster (Kubernetes v1.35.2) does not serve resource.k8s.io/v1: gpudra needs "
        "Kubernetes 1.34 or newer with the resource.k8s.io/v1 API" in message
    )
    assert "--runtime-config=resource.k8s.io/v1=true" in message
    assert discovery.writes == []


def test_a_supported_cluster_gets_past_the_check(helm: Path, cluster_at: Any) -> None:
    """The same endpoint with resource.k8s.io/v1 served: the chart renders and helm goes
    on to build the objects (which this discovery-only endpoint has no schemas for), so
    the refusals above are the checks' and not the endpoint's."""
    kubeconfig, discovery = cluster_at("1.34.2", RESOURCE_V1)
    message = install(helm, kubeconfig)
    assert "unable to build kubernetes objects from release manifest" in message
    assert "resource.k8s.io/v1" not in message
    assert "kubeVersion" not in message
    assert discovery.writes == []
