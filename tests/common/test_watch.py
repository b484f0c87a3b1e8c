"""The shared list/watch loop against the real API server: an outage and the recovery
after it, a resourceVersion the server has forgotten (410 Gone), bookmarks that keep a
quiet watch resumable, and a collection that is not served.

The objects are of a CRD made for these tests: its watch cache starts when the CRD is
created, so an old resourceVersion is one the real server answers with 410.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import pytest
from aiohttp import web
from gpudra.common.backoff import Backoff
from gpudra.common.kube import ApiError, Kube
from gpudra.common.watch import EventType, Reflector
from kubernetes_asyncio.client import ApiClient, Configuration

from e2e.cluster.harness import Cluster
from e2e.cluster.kube import CRD_PATH, apply_crd, wait_for
from e2e.cluster.kube import Kube as SyncKube
from e2e.proxy import Proxy

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
GROUP = "watch.test.gpudra.dev"
PROBES = f"/apis/{GROUP}/v1/probes"
GUARD = 60  # seconds: only a hang guard, never a speed check
LOGGER = "gpudra.common.watch"


def probe_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"probes.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": {"plural": "probes", "singular": "probe", "kind": "Probe"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def probes(kube: SyncKube) -> Iterator[str]:
    """The collection path of the tests' own CRD, once the server serves it."""
    apply_crd(kube, probe_crd())
    wait_for("probes to be served", lambda: kube.request("GET", PROBES) is not None)
    yield PROBES
    kube.request("DELETE", f"{CRD_PATH}/probes.{GROUP}")


@pytest.fixture
def label() -> str:
    """A label value of this test's own objects; the reflector selects only them."""
    return secrets.token_hex(4)


class Mirror:
    """What a caller of the reflector keeps: the objects by name, and every callback."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.lists = 0
        self.events: list[tuple[str, str]] = []

    def listed(self, items: list[dict[str, Any]]) -> None:
        self.lists += 1
        self.objects = {o["metadata"]["name"]: o for o in items}

    def watched(self, kind: EventType, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self.events.append((kind, name))
        if kind == "DELETED":
            self.objects.pop(name, None)
        else:
            self.objects[name] = obj


def reflector(kube: Kube, path: str, mirror: Mirror, label: str, **kwargs: Any) -> Reflector:
    return Reflector(
        kube,
        path,
        query={"labelSelector": f"test={label}"},
        on_list=mirror.listed,
        on_event=mirror.watched,
        **kwargs,
    )


async def create(kube: Kube, label: str) -> dict[str, Any]:
    body = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Probe",
        "metadata": {"generateName": "probe-", "labels": {"test": label}},
    }
    created: dict[str, Any] = await kube.request("POST", PROBES, body)
    return created


async def until(what: str, probe: Callable[[], object]) -> None:
    try:
        with anyio.fail_after(GUARD):
            while not probe():
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured context a log call passed as `extra={"fields": ...}`."""
    found: dict[str, Any] = record.__dict__["fields"]
    return found


def logged(caplog: pytest.LogCaptureFixture, message: str) -> list[dict[str, Any]]:
    return [fields(r) for r in caplog.records if r.name == LOGGER and r.msg == message]


class Front:
    """A plain-HTTP address for the real API server that forwards every request through
    our own client. It records where each watch starts, and can send the next watch
    from a resourceVersion the server has forgotten, so the server itself answers 410."""

    def __init__(self, upstream: Kube) -> None:
        self.upstream = upstream
        self.watches: list[str | None] = []
        self.expire_next_watch = False
        self.kube: Kube | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        try:
            if query.pop("watch", None) != "true":
                body = await self.upstream.request(request.method, request.path, query=query)
                return web.json_response(body)
            timeout_s = int(query.pop("timeoutSeconds", "300"))
            if self.expire_next_watch:
                self.expire_next_watch = False
                query["resourceVersion"] = "1"
            self.watches.append(query.get("resourceVersion"))
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            async for event in self.upstream.watch(request.path, query, timeout_s):
                if not response.prepared:
                    await response.prepare(request)
                await response.write(json.dumps(event).encode() + b"\n")
        except ApiError as exc:
            status = {"kind": "Status", "code": exc.status, "message": exc.message}
            return web.json_response(status, status=exc.status)
        if not response.prepared:
            await response.prepare(request)
        await response.write_eof()
        return response


@pytest.fixture
async def front(akube: Kube, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Front]:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    fronted = Front(akube)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fronted.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fronted.kube = Kube(ApiClient(configuration=Configuration(host=f"http://127.0.0.1:{port}")))
    yield fronted
    await fronted.kube.close()
    await runner.cleanup()


async def test_bookmarks_advance_the_version_a_quiet_watch_resumes_from(
    akube: Kube, probes: str, front: Front, label: str
) -> None:
    assert front.kube is not None
    mirror = Mirror()
    # The server closes each watch after 4 s and sends a bookmark 2 s before that.
    watcher = reflector(front.kube, probes, mirror, label, watch_timeout_s=4)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        listed_at = watcher.resource_version
        # A write the selector filters out: no event, but the server's version moves on.
        other = await create(akube, label=f"not-{label}")
        moved_to = int(other["metadata"]["resourceVersion"])  # numeric on every real server
        await until(
            "a watch that resumes past the unrelated write",
            lambda: any(int(v or 0) >= moved_to for v in front.watches),
        )
        tg.cancel_scope.cancel()
    assert front.watches[0] == listed_at
    assert mirror.lists == 1, "a quiet watch resumes; it does not list again"
    assert mirror.events == []


async def test_an_expired_version_is_listed_again(
    akube: Kube, probes: str, front: Front, label: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    assert front.kube is not None
    mirror = Mirror()
    watcher = reflector(
        front.kube, probes, mirror, label, watch_timeout_s=2, backoff=Backoff(first_s=0.05)
    )
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        assert mirror.lists == 1
        front.expire_next_watch = True
        await until("a second listing", lambda: mirror.lists == 2)
        assert "1" in front.watches
        [expired] = logged(caplog, "watch expired; listing again")
        assert expired["error"].startswith("410 Expired: too old resource version")
        # Watching goes on from the new listing.
        created = await create(akube, label)
        name = created["metadata"]["name"]
        await until("the event after the relist", lambda: ("ADDED", name) in mirror.events)
        tg.cancel_scope.cancel()
    assert logged(caplog, "watch failed; listing again") == []


async def test_an_outage_is_ridden_out_with_a_capped_backoff_and_a_relist(
    cluster: Cluster,
    akube: Kube,
    probes: str,
    label: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    config = json.loads(cluster.layout.admin_kubeconfig.read_text())
    server = urlsplit(config["clusters"][0]["cluster"]["server"])
    assert server.port is not None
    mirror = Mirror()
    async with anyio.create_task_group() as tg:
        proxy = Proxy(target_port=server.port)
        await proxy.start(tg)
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
        (tmp_path / "kubeconfig").write_text(json.dumps(config))
        through_proxy = await Kube.connect(str(tmp_path / "kubeconfig"))
        cap = 0.2
        watcher = reflector(
            through_proxy, probes, mirror, label, backoff=Backoff(first_s=0.05, max_s=cap)
        )
        await tg.start(watcher.run)
        before = await create(akube, label)
        await until("the event before the outage", lambda: len(mirror.events) == 1)

        await proxy.cut()
        during = (await create(akube, label))["metadata"]["name"]
        await until(
            "retries at the cap",
            lambda: (
                [f["retry_s"] for f in logged(caplog, "watch failed; listing again")].count(cap)
                >= 2
            ),
        )
        delays = [f["retry_s"] for f in logged(caplog, "watch failed; listing again")]
        assert delays == sorted(delays)
        assert max(delays) == cap
        await proxy.restore(tg)

        # What changed while the server was away arrives with the new listing.
        await until("the relist after the outage", lambda: during in mirror.objects)
        assert ("ADDED", during) not in mirror.events
        assert before["metadata"]["name"] in mirror.objects
        after = (await create(akube, label))["metadata"]["name"]
        await until("watching again", lambda: ("ADDED", after) in mirror.events)
        tg.cancel_scope.cancel()
    await through_proxy.close()


async def test_a_collection_not_served_reads_as_empty_and_is_checked_again(
    akube: Kube, label: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mirror = Mirror()
    mirror.objects = {"stale": {}}
    path = "/apis/absent.test.gpudra.dev/v1/things"
    watcher = reflector(akube, path, mirror, label, absent_retry_s=0.1)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)  # started: an absent collection is a complete answer
        assert mirror.objects == {}
        await until("a second look", lambda: mirror.lists >= 2)
        tg.cancel_scope.cancel()
    [absent, *_] = logged(
        caplog, "collection not served (CRD not installed?); treating it as empty until it is"
    )
    assert absent["path"] == path
    assert logged(caplog, "watch failed; listing again") == []
