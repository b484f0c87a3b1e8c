"""The chart refuses a cluster it cannot run on before creating anything: older than
1.34 (Chart.yaml's kubeVersion), or one that does not serve resource.k8s.io/v1. And it
refuses to upgrade from 0.1.0 with a surge pod of the node agent, or to move the node
agents' checkpoint, CDI folder or driver name under prepared claims, both of which it
knows from the release's node DaemonSet as the cluster has it (`lookup`, which `helm
template` cannot answer).

Helm reads all of these from the cluster, so the cluster here is a discovery endpoint
that answers what such a cluster answers: its version, its API groups, and no releases
or nodes yet, or else the objects a test gives it (a release Helm stored, its
DaemonSet). Anything else it is asked (a create) fails the test.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.tools import helm as h

CORE = {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}


class Discovery:
    """A cluster of `version` serving `groups` ({group: [versions]}), read-only; a GET
    of a path in `objects` answers that object (or list)."""

    def __init__(
        self,
        version: str,
        groups: dict[str, list[str]],
        objects: dict[str, Any] | None = None,
    ) -> None:
        self.version = version
        self.groups = groups
        self.objects = objects or {}
        self.writes: list[str] = []
        self.reads: list[str] = []

    def answer(self, method: str, path: str) -> tuple[int, Any]:
        path = path.split("?", 1)[0]
        if method != "GET":
            self.writes.append(f"{method} {path}")
            return 405, {"kind": "Status", "code": 405}
        self.reads.append(path)
        if path in self.objects:
            return 200, self.objects[path]
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
            resources = [DAEMONSETS] if gv == "apps/v1" else []
            return 200, {"kind": "APIResourceList", "groupVersion": gv, "resources": resources}
        if "namespaces" in parts and len(parts) - parts.index("namespaces") == 4:
            # One object by name (.../namespaces/<ns>/<resource>/<name>): none there.
            return 404, {"kind": "Status", "apiVersion": "v1", "code": 404, "reason": "NotFound"}
        # A list (releases, nodes): nothing there yet.
        return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []}


DAEMONSETS = {
    "name": "daemonsets",
    "singularName": "daemonset",
    "namespaced": True,
    "kind": "DaemonSet",
    "verbs": ["get", "list"],
}


@pytest.fixture
def cluster_at(tmp_path: Path) -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(
        version: str, groups: dict[str, list[str]], objects: dict[str, Any] | None = None
    ) -> tuple[Path, Discovery]:
        discovery = Discovery(version, groups, objects)

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


def helm_failure(helm: Path, kubeconfig: Path, *args: str) -> str:
    """What `helm ARGS` against the endpoint of `kubeconfig`, in namespace gpudra, failed
    with (this endpoint can never complete an install)."""
    with pytest.raises(h.HelmFailed) as failure:
        h.run(helm, *args, "--namespace", "gpudra", "--kubeconfig", str(kubeconfig))
    return str(failure.value)


def install(helm: Path, kubeconfig: Path) -> str:
    return helm_failure(helm, kubeconfig, "install", "gpudra", str(h.CHART))


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


# --- an upgrade from 0.1.0 with a surge pod ---------------------------------------------

APP_VERSION = yaml.safe_load((h.CHART / "Chart.yaml").read_text())["appVersion"]
DAEMONSET = "/apis/apps/v1/namespaces/gpudra/daemonsets/gpudra-node"
SURGE = {"updateStrategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}
NO_SURGE = {"updateStrategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}}
ON_DELETE = {"updateStrategy": {"type": "OnDelete", "rollingUpdate": {"maxSurge": 1}}}


def quoted_refusal() -> str:
    """The refusal as docs/install.md's Upgrade section quotes it, on one line."""
    text = (h.REPO / "docs" / "install.md").read_text()
    found = re.search(r"`(node\.updateStrategy\.rollingUpdate\.maxSurge=1 cannot be[^`]*)`", text)
    assert found, "docs/install.md does not quote the refusal"
    return " ".join(found[1].split())


def installed(version: str) -> dict[str, Any]:
    """What `helm upgrade` reads of a cluster gpudra `version` was installed on: the
    release Helm stored (a Secret in the release's namespace: the release as gzipped
    JSON in base64) and the release's node DaemonSet, labelled with that chart's
    appVersion as gpudra.labels labels it."""
    release = {
        "name": "gpudra",
        "namespace": "gpudra",
        "version": 1,
        "info": {
            "status": "deployed",
            "first_deployed": "2025-01-01T00:00:00Z",
            "last_deployed": "2025-01-01T00:00:00Z",
            "description": "Install complete",
        },
        "chart": {
            "metadata": {
                "apiVersion": "v2",
                "name": "gpudra",
                "version": version,
                "appVersion": version,
            }
        },
        "config": {},
        "manifest": "",
    }
    stored = base64.b64encode(gzip.compress(json.dumps(release).encode()))
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "sh.helm.release.v1.gpudra.v1",
            "namespace": "gpudra",
            "labels": {"owner": "helm", "name": "gpudra", "status": "deployed", "version": "1"},
        },
        "type": "helm.sh/release.v1",
        "data": {"release": base64.b64encode(stored).decode()},
    }
    return {
        "/api/v1/namespaces/gpudra/secrets": {
            "kind": "SecretList",
            "apiVersion": "v1",
            "metadata": {},
            "items": [secret],
        },
        DAEMONSET: {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {
                "name": "gpudra-node",
                "namespace": "gpudra",
                "labels": {
                    "app.kubernetes.io/name": "gpudra",
                    "app.kubernetes.io/instance": "gpudra",
                    "app.kubernetes.io/version": version,
                    "app.kubernetes.io/component": "node",
                },
            },
        },
    }


def upgrade(helm: Path, kubeconfig: Path, tmp: Path, node: dict[str, Any]) -> str:
    """`helm upgrade --install` with the working tree's chart and these node values; what
    it failed with (this endpoint can never complete one)."""
    return upgrade_with(helm, kubeconfig, tmp, {"node": node})


def upgrade_with(helm: Path, kubeconfig: Path, tmp: Path, values: dict[str, Any]) -> str:
    """`upgrade` with these values."""
    args = h.values_args([values], tmp)
    return helm_failure(helm, kubeconfig, "upgrade", "--install", "gpudra", str(h.CHART), *args)


@pytest.mark.parametrize(
    "node",
    [
        SURGE,
        {"updateStrategy": {"rollingUpdate": {"maxSurge": "25%"}}},
        # Its metrics port check would offer node.metricsPort=0, which does not help here.
        {"hostNetwork": True, **SURGE},
    ],
    ids=["one", "percent", "host-network"],
)
def test_an_upgrade_from_0_1_0_with_a_surge_pod_is_refused_naming_the_value_and_the_fix(
    helm: Path, cluster_at: Any, tmp_path: Path, node: dict[str, Any]
) -> None:
    """0.1.0's agent neither takes the checkpoint's lock nor reads its changes file: a
    surge pod beside it and it would overwrite each other's records."""
    kubeconfig, discovery = cluster_at("1.34.2", RESOURCE_V1, installed("0.1.0"))
    message = upgrade(helm, kubeconfig, tmp_path, node)
    surge = node["updateStrategy"]["rollingUpdate"]["maxSurge"]
    (line,) = [x for x in message.splitlines() if "maxSurge" in x]  # one line
    assert (
        f"node.updateStrategy.rollingUpdate.maxSurge={surge} cannot be used to upgrade from "
        "0.1.0 (DaemonSet gpudra/gpudra-node runs 0.1.0's agents)" in line
    )
    assert "neither takes the checkpoint's lock nor reads its changes file" in line
    assert (
        "Roll this upgrade with node.updateStrategy.rollingUpdate.maxSurge=0 "
        "(and maxUnavailable=1)" in line
    )
    assert "cannot go with node.hostNetwork" not in line
    if surge == 1:
        assert quoted_refusal() in line
    assert DAEMONSET in discovery.reads
    assert discovery.writes == []


@pytest.mark.parametrize(
    ("running", "node"),
    [
        (APP_VERSION, SURGE),
        ("0.1.0", NO_SURGE),
        ("0.1.0", ON_DELETE),
        (None, SURGE),
    ],
    ids=["from-this-release", "from-0.1.0-without-surge", "from-0.1.0-on-delete", "install"],
)
def test_an_upgrade_that_may_surge_or_does_not_gets_past_the_check(
    helm: Path, cluster_at: Any, tmp_path: Path, running: str | None, node: dict[str, Any]
) -> None:
    """An agent of this release (or none yet) beside a surge pod, or no surge pod: the
    chart renders, and helm goes on to check the objects (against schemas this endpoint
    does not have). The DaemonSet is looked up either way, for the state check below."""
    objects = installed(running) if running else {}
    kubeconfig, discovery = cluster_at("1.34.2", RESOURCE_V1, objects)
    message = upgrade(helm, kubeconfig, tmp_path, node)
    assert "error validating" in message
    assert "maxSurge" not in message
    assert DAEMONSET in discovery.reads
    assert discovery.writes == []


# --- an upgrade that moves the agents' state --------------------------------------------

STATE = {"node": {"stateDir": "/srv/gpudra"}}


def running(helm: Path, values: dict[str, Any]) -> dict[str, Any]:
    """A cluster this release was installed on with `values`: its node DaemonSet is the
    one the chart renders for them, so the live agents' flags are the chart's own."""
    objects = installed(APP_VERSION)
    objects[DAEMONSET] = h.find(h.template(helm, values), "DaemonSet", "gpudra-node")
    return objects


@pytest.mark.parametrize(
    ("live", "new", "moves", "keep"),
    [
        (
            {},
            STATE,
            [
                "node.stateDir changed from /var/lib/gpudra to /srv/gpudra "
                "(the node agents' --state-dir)"
            ],
            "node.stateDir=/var/lib/gpudra",
        ),
        (
            {},
            {"node": {"cdiRoot": "/etc/cdi"}},
            ["node.cdiRoot changed from /var/run/cdi to /etc/cdi (the node agents' --cdi-root)"],
            "node.cdiRoot=/var/run/cdi",
        ),
        (
            {},
            {"driverName": "gpu.example.com"},
            [
                "driverName changed from gpu.nvidia.com to gpu.example.com "
                "(the node agents' --driver-name)"
            ],
            "driverName=gpu.nvidia.com",
        ),
        (
            STATE,
            {},
            [
                "node.stateDir changed from /srv/gpudra to /var/lib/gpudra "
                "(the node agents' --state-dir)"
            ],
            "node.stateDir=/srv/gpudra",
        ),
        (
            {},
            {"node": {"extraArgs": ["--state-dir", "/srv/gpudra"]}},
            [
                "--state-dir in node.extraArgs changed from /var/lib/gpudra to /srv/gpudra "
                "(the node agents' --state-dir)"
            ],
            "--state-dir=/var/lib/gpudra in node.extraArgs",
        ),
        (
            {},
            {"driverName": "gpu.example.com", "node": {"cdiRoot": "/etc/cdi"}},
            [
                "driverName changed from gpu.nvidia.com to gpu.example.com",
                "node.cdiRoot changed from /var/run/cdi to /etc/cdi",
            ],
            "driverName=gpu.nvidia.com and node.cdiRoot=/var/run/cdi",
        ),
    ],
    ids=["state-dir", "cdi-root", "driver-name", "state-dir-back", "extra-args", "two"],
)
def test_an_upgrade_that_moves_the_agents_state_is_refused_naming_old_new_and_the_fix(
    helm: Path,
    cluster_at: Any,
    tmp_path: Path,
    live: dict[str, Any],
    new: dict[str, Any],
    moves: list[str],
    keep: str,
) -> None:
    """New agents with another checkpoint, CDI folder or driver name would not know the
    claims prepared under the old ones: they would delete the claims' CDI specs and
    leave their MIG instances, time-slices and MPS daemons behind, telling nobody."""
    kubeconfig, discovery = cluster_at("1.34.2", RESOURCE_V1, running(helm, live))
    message = upgrade_with(helm, kubeconfig, tmp_path, new)
    (line,) = [x for x in message.splitlines() if "allowStateMove" in x]  # one line
    for move in moves:
        assert move in line
    assert (
        "this upgrade would move the node agents of DaemonSet gpudra/gpudra-node away from "
        "the claims prepared on their nodes" in line
    )
    assert "leaving their MIG instances, time-slice settings and MPS daemons behind" in line
    assert (
        "Drain the GPU pods from the nodes first (kubectl drain, or delete the pods whose "
        "claims gpudra prepared), then upgrade again with --set node.allowStateMove=true; "
        f"or keep {keep}" in line
    )
    assert DAEMONSET in discovery.reads
    assert discovery.writes == []


@pytest.mark.parametrize(
    ("objects", "live", "new"),
    [
        ("running", {}, {**STATE, "node": {**STATE["node"], "allowStateMove": True}}),
        ("running", {}, {"driverName": "gpu.example.com", "node": {"allowStateMove": True}}),
        ("none", {}, {"driverName": "gpu.example.com", **STATE}),
        ("running", STATE, STATE),
        ("running", STATE, {"node": {"stateDir": "/srv/gpudra/"}}),
        ("running", {}, {"node": {"metricsPort": 9478, "extraArgs": ["--cdi-root=/var/run/cdi"]}}),
        ("0.1.0", {}, STATE),
    ],
    ids=[
        "confirmed",
        "confirmed-driver-name",
        "install",
        "unchanged",
        "trailing-slash",
        "other-values",
        "no-flags-on-the-live-daemonset",
    ],
)
def test_an_upgrade_that_keeps_the_agents_state_or_is_confirmed_gets_past_the_check(
    helm: Path,
    cluster_at: Any,
    tmp_path: Path,
    objects: str,
    live: dict[str, Any],
    new: dict[str, Any],
) -> None:
    """The move confirmed with node.allowStateMove=true (after a drain), a first install
    (no DaemonSet yet), the same state under other values or spellings, or a DaemonSet
    that gives no such flags: the chart renders, and helm goes on to check the objects
    (against schemas this endpoint does not have)."""
    found = {"running": running(helm, live), "none": {}, "0.1.0": installed("0.1.0")}[objects]
    kubeconfig, discovery = cluster_at("1.34.2", RESOURCE_V1, found)
    message = upgrade_with(helm, kubeconfig, tmp_path, new)
    assert "error validating" in message
    assert "allowStateMove" not in message
    assert DAEMONSET in discovery.reads
    assert discovery.writes == []
