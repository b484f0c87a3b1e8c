"""The `kubernetes` Service's address on the real node's host, for pods on the pod
network.

No kube-proxy runs beside the real node (there is no iptables to program), and the
local API server listens on loopback only, so a pod on the pod network that dials the
address the kubelet gives it for the API server (`KUBERNETES_SERVICE_HOST`, the
`kubernetes` Service's cluster IP) reaches nothing. That is why the chart's components
run on the node's network there. For a test that needs one on the pod network, the
host takes the Service's address on its loopback device and forwards its port to the
API server: a pod's packets for it leave by the pod's default route into the host,
where the address is local. The API server's certificate names that address, as a
real cluster's does, so clients verify it as they would there.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator

from anyio import create_task_group
from anyio.from_thread import start_blocking_portal

from e2e.cluster.kube import Kube
from e2e.proxy import Proxy


def service_address(kube: Kube) -> tuple[str, int]:
    """The `kubernetes` Service's cluster IP and port: what the kubelet tells pods."""
    service = kube.get("Service", "kubernetes", "default")
    return str(service["spec"]["clusterIP"]), int(service["spec"]["ports"][0]["port"])


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def _on_loopback(address: str) -> bool:
    return f"inet {address}/32 " in _ip("-4", "-o", "addr", "show", "dev", "lo")


def route_unavailable_reason(address: str) -> str | None:
    """Why the host cannot take `address` for the Service, or None: it must not be one
    of the host's addresses already, nor on a network the host routes other than by its
    default route, or taking it would cut the host off from that network."""
    if _on_loopback(address):
        return None  # left by an interrupted run: ours
    if f"inet {address}/" in _ip("-4", "-o", "addr", "show"):
        return f"{address} is already one of this host's addresses"
    local = _ip("-4", "-o", "route", "show", "table", "local", "match", address).splitlines()
    if any(r.startswith("local ") for r in local):
        return f"{address} is already local to this host"
    routes = [r for r in _ip("-4", "-o", "route", "show", "match", address).splitlines() if r]
    networks = [r for r in routes if not r.startswith("default")]
    if networks:
        return f"this host routes {address} to a network of its own ({networks[0].strip()})"
    return None


@contextlib.asynccontextmanager
async def _forwarding(proxy: Proxy) -> AsyncIterator[Proxy]:
    async with create_task_group() as tg:
        await proxy.start(tg)
        try:
            yield proxy
        finally:
            await proxy.cut()


@contextlib.contextmanager
def api_service_route(kube: Kube, api_port: int) -> Iterator[tuple[str, int]]:
    """Inside, the `kubernetes` Service's address and port reach the API server at
    `api_port` on loopback from the host and from its pods; yields them. The address is
    taken off the loopback device again after (also one an interrupted run left)."""
    host, port = service_address(kube)
    reason = route_unavailable_reason(host)
    if reason:
        raise RuntimeError(f"cannot route the kubernetes Service here: {reason}")
    if not _on_loopback(host):
        _ip("addr", "add", f"{host}/32", "dev", "lo")
    try:
        proxy = Proxy(target_port=api_port, port=port, host=host)
        with (
            start_blocking_portal() as portal,
            portal.wrap_async_context_manager(_forwarding(proxy)),
        ):
            yield host, port
    finally:
        _ip("addr", "del", f"{host}/32", "dev", "lo")
