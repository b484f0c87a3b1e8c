"""Escape attempts on the webhook's HTTP transport: a tenant that reaches the webhook's
port (the chart's default: no client certificates, no NetworkPolicy) holds what the
server shares among all its clients, and every GPU pod and driver claim of the cluster
would be refused (both webhooks fail closed). The webhook runs with the server's own
defaults for its bounds and body budget, over TLS on its own port, and the real API
server calls it: each attempt is judged by what the API server then admits for the
tenant's own user, and refuses, so that the webhook is shown judging, not bypassed.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import anyio
import pytest
from anyio.abc import SocketStream, TaskStatus
from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import crd_manifest
from gpudra.common.kube import Kube
from gpudra.webhook.server import MUTATE_PATH, WebhookServer
from gpudra.webhook.transport import HttpConfig

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, apply_crd
from e2e.cluster.kube import Kube as SyncKube
from e2e.tenant_user import TenantUser, tenant_user
from e2e.tests.escape.test_claims import drop_tenant, with_tenant
from e2e.tests.escape.test_pods import forged_review, gpu_claim, pod
from e2e.webhook_env import (
    call,
    register_webhook,
    serving_config,
    tenant_webhook,
    unregister_webhook,
)
from e2e.webhook_wire import PARTIAL_HELLO, Unread, posted

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"
BODY = HttpConfig.max_body_bytes
"""The largest body the server takes (3 MiB): each held connection holds one."""
BUDGET = HttpConfig.max_buffered_body_bytes
HELD = BUDGET // BODY
"""Connections whose bodies fill the budget but for less than one body (21)."""
SLACK = 512
"""Budget left free once the attack is in place: less than any review the API server
sends (a pod's is a few KiB)."""
BACKLOG = 256 * 1024
"""The size of each fast review, whose answer repeats its uid: past what the server's
kernel takes for a client announcing small segments (about 100 KiB) and what the
server's socket buffers beyond it (64 KiB), so the TLS layer stops passing on what is
written after it."""
ANSWER = 128 * 1024
"""The size of each slow review, and so of its answer: past the mark of the
connection's write buffer (64 KiB), which that answer, held by the TLS layer, crosses."""
MAX_SEGMENT = 536
"""The TCP segment size the attacker announces (the IPv4 default minimum)."""
CLAIM_READS = 50
"""Claims that do not exist named by each slow review's pod: the webhook reads each
from the API server, one after another, before it answers (a dry run counts none)."""
FILLER_READS = 500
"""Claims named by the review that keeps the budget's last bytes: a second or so of
reads, well inside the webhook's deadline for them (5 s), then it is sent again."""
HELD_PATH = "/healthz"
"""Where the held bodies are posted: any path; answered, it would be counted there."""
GUARD = 60  # seconds: only a hang guard, never a speed check


@dataclass
class Wire:
    """The tenant's namespace and user, and the webhook's port as a tenant reaches it."""

    ns: str
    tenant: TenantUser
    server: WebhookServer
    host: str
    port: int
    ca: bytes
    serving: anyio.CancelScope
    """Cancelled, stops the webhook as its process does after its drain."""
    stopped: anyio.Event
    """Set once the webhook's `serve` has returned."""


@pytest.fixture
async def wire(cluster: Cluster, kube: SyncKube, tmp_path: Path) -> AsyncIterator[Wire]:
    """The webhook with tenant rules as `gpudra webhook --tenants` runs it, registered
    with the API server as the chart registers it, and a tenant namespace whose
    GpuTenant allows one device per pod."""
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    apply_crd(kube, crd_manifest())
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    pki, config = serving_config(cluster, tmp_path / "pki")
    controller, server = tenant_webhook(akube, config)
    ns = await call(smoke.make_namespace, kube, "escape-wire")
    tenant_name = f"t-{ns}"
    serving, stopped = anyio.CancelScope(), anyio.Event()

    async def serve(*, task_status: TaskStatus[int]) -> None:
        try:
            with serving:
                await server.serve(task_status=task_status)
        finally:
            stopped.set()

    try:
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve)
            await tg.start(controller.run)
            host = cluster.webhook_host()
            await register_webhook(akube, pki, config, f"https://{host}:{port}")
            try:
                await call(lambda: with_tenant(kube, ns, maxDevicesPerPod=1))
                with anyio.fail_after(GUARD):
                    while controller.state.lookup(ns).rules is None:
                        await anyio.sleep(0.1)
                tenant = await call(tenant_user, kube, ns)
                yield Wire(ns, tenant, server, host, port, pki.ca_bundle, serving, stopped)
            finally:
                await unregister_webhook(akube)
                tg.cancel_scope.cancel()
    finally:
        await call(drop_tenant, kube, tenant_name)
        await call(kube.delete, "Namespace", ns)
        await akube.close()


def padded_review(ns: str, reads: int, size: int) -> bytes:
    """A dry-run review of a pod in `ns`, as a client that reaches the port forges it,
    `size` bytes long, its pod naming `reads` claims that do not exist: the webhook
    reads each claim from the API server before it answers, and its answer repeats the
    review's uid, which pads it."""
    claims = {f"c{i}": {"resourceClaimName": f"absent-{i}"} for i in range(reads)}
    review = forged_review("", ns, pod(ns, "slow", claims=claims), dry_run=True)
    bare = len(json.dumps(review).encode())
    assert bare < size, f"a slow review of {reads} claims takes {bare} bytes, over {size}"
    review["request"]["uid"] = "u" * (size - bare)
    return json.dumps(review).encode()


def requests(server: WebhookServer, path: str) -> float:
    """Requests of `path` the webhook answered (or refused), from its own metrics."""
    return sum(
        sample.value
        for family in server.registry.collect()
        for sample in family.samples
        if sample.name == "gpudra_webhook_requests_total" and sample.labels["path"] == path
    )


def evicted(server: WebhookServer) -> float:
    """Connections the webhook closed to make room, from its own metrics."""
    value = server.registry.get_sample_value(
        "gpudra_webhook_connections_shed_total", {"action": "evicted"}
    )
    return value or 0.0


def held_unread(server: WebhookServer) -> int:
    """Body bytes the server holds behind answers their clients have not read, read from
    the server itself: shows the attack in place before the API server is asked."""
    return sum(c.unread_charge for c in server._http._connections)


async def hold_bodies(wire: Wire, held: list[Unread]) -> None:
    """The attack: `HELD` connections that announce small TCP segments and never read,
    each with three requests pipelined in one write: a fast review with a big answer,
    which fills what the server's kernel and socket take for the connection; a slow
    review, whose answer waits on the API server; and a request with a `BODY`-byte body,
    complete and queued by the time that answer is written. That answer stays in the
    TLS layer above the connection's write mark, so the server stops answering with
    the body queued behind it, charged to the budget. Connections go a few at a time,
    so that the reviews being answered never push the attack's own bodies over the
    budget; each batch is done once both reviews of each connection are answered."""
    pipelined = (
        posted(padded_review(wire.ns, 0, BACKLOG))
        + posted(padded_review(wire.ns, CLAIM_READS, ANSWER))
        + posted(b"x" * BODY, HELD_PATH)
    )
    batch = max(1, (BUDGET - HELD * BODY) // (BACKLOG + ANSWER))

    def connect() -> Unread:
        return Unread(wire.port, wire.ca, wire.host, max_segment=MAX_SEGMENT, timeout=GUARD / 2)

    while len(held) < HELD:
        opened = [await call(connect) for _ in range(min(batch, HELD - len(held)))]
        held.extend(opened)
        async with anyio.create_task_group() as tg:
            for unread in opened:
                tg.start_soon(unread.send, pipelined)
        while requests(wire.server, MUTATE_PATH) < 2 * len(held):
            await anyio.sleep(0.01)


async def keep_held(wire: Wire, size: int, stop: anyio.Event) -> None:
    """A slow review of `size` bytes, sent again each time it is answered until `stop`,
    by a client that reads its answers: while it is answered its body is held, as the
    body of every request being answered is, so the attack keeps the budget's last
    bytes without a connection the server may close to make room. Returns once the
    last one is answered: nothing of it is left running in the webhook."""
    review = padded_review(wire.ns, FILLER_READS, size)
    context = ssl.create_default_context(cadata=wire.ca.decode())
    url = f"https://{wire.host}:{wire.port}{MUTATE_PATH}"
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.post(url, data=review, ssl=context) as resp:
                await resp.read()


async def test_bodies_held_behind_unread_answers_cannot_lock_the_api_server_out(
    wire: Wire,
) -> None:
    """A tenant that reaches the webhook's port holds the whole body budget but for a few
    hundred bytes, 63 MiB of it in 3 MiB bodies queued behind answers it never reads
    (21 connections) and the rest in a review being answered: the server closes the
    connections holding bodies behind unread answers to make room, and the API
    server's reviews get through, so the tenant's GPU pod is admitted and converted,
    its driver claim is admitted, and a pod over its GpuTenant's rules is still refused
    by them."""
    bodies = wire.server._http.bodies
    held: list[Unread] = []
    try:
        with anyio.fail_after(GUARD):
            await hold_bodies(wire, held)
            assert requests(wire.server, HELD_PATH) == 0  # no held body was answered
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_held, wire, BUDGET - HELD * BODY - SLACK, stop)
                while bodies.used < BUDGET - SLACK:
                    await anyio.sleep(0.01)
                assert held_unread(wire.server) == HELD * BODY
                shed = evicted(wire.server)

                gpu_pod = pod(wire.ns, "admitted", {"nvidia.com/gpu": "1"})
                admitted = await call(wire.tenant.create, gpu_pod)
                assert [c["name"] for c in admitted["spec"]["resourceClaims"]] == ["gpudra-gpu"]
                assert evicted(wire.server) > shed  # room was made, not found
                claim = await call(wire.tenant.create, gpu_claim(wire.ns, "admitted"))
                assert claim["metadata"]["name"] == "admitted"
                over = pod(wire.ns, "refused", {"nvidia.com/gpu": "2"})
                with pytest.raises(ApiError) as refused:
                    await call(wire.tenant.create, over)
                assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in str(refused.value)
                stop.set()
    finally:
        for unread in held:
            unread.close()
    # The held bodies went with their connections: the budget is whole again.
    with anyio.fail_after(GUARD):
        while bodies.used:
            await anyio.sleep(0.05)


DROPPED = 40
"""Reviews sent and dropped by the attempt below, one connection each."""


def answering(server: WebhookServer) -> int:
    """Requests of open connections whose answer the webhook is making, from the server
    itself."""
    return sum(c._answering for c in server._http._connections)


def abandoned(server: WebhookServer) -> float:
    """Requests whose connection closed before their answer was made, from the
    webhook's own metrics."""
    value = server.registry.get_sample_value(
        "gpudra_webhook_requests_total", {"path": MUTATE_PATH, "result": "abandoned"}
    )
    return value or 0.0


async def test_reviews_sent_and_dropped_leave_no_admission_running(wire: Wire) -> None:
    """A tenant that reaches the webhook's port sends a review whose pod names 500 claims,
    which the webhook reads one by one from the API server (a second or so), and closes
    the connection as soon as the answer is being made, over and over. A closed
    connection counts against no bound and its body is back in the budget, so
    admissions left running for it would pile up without limit: each is stopped at the
    close, and the API server's own reviews are judged as before."""
    review = posted(padded_review(wire.ns, FILLER_READS, 64 * 1024))
    before = abandoned(wire.server)
    with anyio.fail_after(GUARD):
        for sent in range(1, DROPPED + 1):
            dropped = await call(lambda: Unread(wire.port, wire.ca, wire.host, timeout=GUARD))
            try:
                await dropped.send(review)
                while not answering(wire.server):
                    await anyio.sleep(0.005)
            finally:
                dropped.close()
            while abandoned(wire.server) - before < sent:
                await anyio.sleep(0.005)
        assert answering(wire.server) == 0
        assert wire.server._http.bodies.used == 0
        admitted = await call(wire.tenant.create, pod(wire.ns, "admitted", {"nvidia.com/gpu": "1"}))
        assert [c["name"] for c in admitted["spec"]["resourceClaims"]] == ["gpudra-gpu"]
        over = pod(wire.ns, "refused", {"nvidia.com/gpu": "2"})
        with pytest.raises(ApiError) as refused:
            await call(wire.tenant.create, over)
        assert "maxDevicesPerPod is 1, this pod asks for 2 devices" in str(refused.value)


HELLOS = 4
"""Connections the attempt below holds in their TLS handshake."""
SILENT = 4
"""Connections it holds past their handshake, having sent nothing."""
TRICKLED = 4
"""Connections on which it sends a request one byte at a time."""
UNREAD = 2
"""Connections whose answer, larger than what the server's kernel takes, it never reads."""
STOP_READS = 10
"""The tenant's own claims named by its pod being reviewed at the stop, before one that
does not exist: the webhook reads and judges each, one after another, before it reaches
the missing one and refuses the pod (it refuses at the first missing claim, so missing
ones alone would be answered within one read). Long enough for the stop to begin while
the review is being answered, well inside the stop's grace (1 s)."""
STOP_TRIES = 5
"""Reviews sent at most, one after another, until the stop is seen beginning while one
is answered: the test looks every 2 ms, and on a loaded machine a review can still be
answered between two looks."""


async def trickle(unread: Unread) -> None:
    """A request sent one byte every 50 ms, never finished, until the server cuts it."""
    await unread.send(b"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: 65536\r\n\r\n")
    try:
        while True:
            await unread.send(b"{")
            await anyio.sleep(0.05)
    except OSError:
        return


def cut(unread: Unread) -> bool:
    """Whether the server closed `unread`'s connection (blocking; run in a thread): what
    it had sent is read to the end, or the reset. False when the connection is still
    open after the guard's half."""
    unread.tls.settimeout(GUARD / 2)
    try:
        while unread.tls.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


async def test_connections_held_open_cannot_hold_a_stop_nor_lose_its_last_review(
    wire: Wire,
) -> None:
    """A tenant that reaches the webhook's port holds connections in each state a stop
    waits on before closing them: handshakes never finished, connections past their
    handshake that send nothing, requests sent a byte at a time that never end, and
    answers it never reads. Then the webhook stops, as at a rollout or a node drain,
    while the API server's review of the tenant's pod is being answered. That review is
    still answered, with the webhook's own verdict, not lost; and the stop does not wait
    on the tenant: the webhook stops, and closes each of the tenant's connections, while
    the tenant still holds them open. New connections are refused from the stop on."""
    http = wire.server._http
    hellos: list[SocketStream] = []
    held: list[Unread] = []
    claims = {f"c{i}": {"resourceClaimName": f"held-{i}"} for i in range(STOP_READS)}
    claims["missing"] = {"resourceClaimName": "absent"}
    verdict: list[str] = []

    async def review_at_stop(name: str) -> None:
        with pytest.raises(ApiError) as refused:
            await call(wire.tenant.create, pod(wire.ns, name, claims=claims))
        verdict.append(str(refused.value))

    try:
        with anyio.fail_after(GUARD):
            for i in range(STOP_READS):
                await call(wire.tenant.create, gpu_claim(wire.ns, f"held-{i}"))
            for _ in range(HELLOS):
                hello = await anyio.connect_tcp(wire.host, wire.port)
                hellos.append(hello)
                await hello.send(PARTIAL_HELLO)

            def connect(max_segment: int = 0) -> Unread:
                return Unread(wire.port, wire.ca, wire.host, max_segment=max_segment, timeout=GUARD)

            silent = [await call(connect) for _ in range(SILENT)]
            trickled = [await call(connect) for _ in range(TRICKLED)]
            unread = [await call(connect, MAX_SEGMENT) for _ in range(UNREAD)]
            held += [*silent, *trickled, *unread]
            answered = requests(wire.server, MUTATE_PATH)
            for u in unread:
                await u.send(posted(padded_review(wire.ns, 0, BACKLOG)))
            async with anyio.create_task_group() as tg:
                for t in trickled:
                    tg.start_soon(trickle, t)
                while (
                    len(http._handshaking) < HELLOS
                    or len(http._connections) < len(held)
                    or requests(wire.server, MUTATE_PATH) < answered + UNREAD
                    or answering(wire.server)
                ):
                    await anyio.sleep(0.01)

                for tries in range(1, STOP_TRIES + 1):
                    tg.start_soon(review_at_stop, f"at-stop-{tries}")
                    while not answering(wire.server) and len(verdict) < tries:
                        await anyio.sleep(0.002)
                    if answering(wire.server):
                        break
                else:
                    pytest.fail(f"none of {STOP_TRIES} reviews was seen being answered: {verdict}")
                wire.server.begin_shutdown()
                wire.serving.cancel()
                await wire.stopped.wait()
            # Every tenant connection is still open on the tenant's side, and was closed
            # by the server's: none is left in the server.
            assert not http._handshaking and not http._connections
            assert all([await call(cut, u) for u in held])
            for hello in hellos:
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await hello.receive()
            with pytest.raises(OSError):
                await anyio.connect_tcp(wire.host, wire.port)
    finally:
        for hello in hellos:
            await hello.aclose()
        for u in held:
            u.close()
    # The review under way at the stop was answered by the webhook, not cut: the API
    # server reports the webhook's refusal, not a failed call.
    assert len(verdict) == tries
    assert all("refers to ResourceClaim absent, which does not exist" in v for v in verdict)
