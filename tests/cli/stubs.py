"""Stand-ins for what `gpudra top` and `gpudra report` talk to, for the CLI tests: an
HTTP endpoint answering as a test says (an agent that misbehaves, a tenant's pod
posing as one), an API server listing the pods it is given, and the command itself
run as the admin runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

AGENT_LABELS = {"app.kubernetes.io/name": "gpudra", "app.kubernetes.io/component": "node"}
Handler = Callable[[BaseHTTPRequestHandler], None]


@contextmanager
def http_server(handler: Handler) -> Iterator[int]:
    """A server on a free port whose every GET `handler` answers; its port."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            handler(self)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def send(h: BaseHTTPRequestHandler, body: bytes, content_type: str = "text/plain") -> None:
    """A 200 answer carrying `body`."""
    h.send_response(200)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def serving(body: bytes) -> Handler:
    """A handler that answers every GET with `body`."""
    return lambda h: send(h, body)


def port_of(endpoint: str) -> int:
    """The port of a `NODE=http://HOST:PORT/metrics` endpoint."""
    return int(endpoint.rsplit(":", 1)[1].split("/", 1)[0])


def agent_pod(
    namespace: str,
    name: str,
    node: str,
    port: int,
    *,
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A running pod with the agent's labels and a `metrics` port on 127.0.0.1:`port`,
    controlled by a DaemonSet unless `owner` says otherwise ({}: no owner)."""
    if owner is None:
        owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "controller": True}
    refs = [{"name": "gpudra-node", "uid": f"uid-{namespace}", **owner}] if owner else []
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": AGENT_LABELS,
            "ownerReferences": refs,
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "ports": [{"name": "metrics", "containerPort": port}]}],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1"},
    }


@contextmanager
def kube_api(handler: Handler, folder: Path) -> Iterator[Path]:
    """Serve `handler` as the API server until the block ends: the kubeconfig for it,
    written in `folder`, that the CLI reads as an admin's (one context, a token)."""
    with http_server(handler) as port:
        kubeconfig = folder / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        yield kubeconfig


@contextmanager
def api_server(pods: list[dict[str, Any]], folder: Path) -> Iterator[tuple[Path, list[str]]]:
    """An API server that lists `pods` (all of them at /api/v1/pods, a namespace's at
    /api/v1/namespaces/NS/pods, in the API server's order: namespace, then name) and
    no ResourceSlices or ResourceClaims; a kubeconfig for it in `folder`, and the
    paths it was asked for."""
    ordered = sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"]))
    asked: list[str] = []

    def answer(h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        asked.append(path)
        items: list[dict[str, Any]] = []
        if path == "/api/v1/pods":
            items = ordered
        elif path.startswith("/api/v1/namespaces/") and path.endswith("/pods"):
            namespace = path.split("/")[4]
            items = [p for p in ordered if p["metadata"]["namespace"] == namespace]
        send(h, json.dumps({"kind": "List", "items": items}).encode(), "application/json")

    with kube_api(answer, folder) as kubeconfig:
        yield kubeconfig, asked


def gpudra(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`gpudra ARGS` as the admin runs it (in `env`, where given)."""
    return subprocess.run(
        [sys.executable, "-m", "gpudra.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
