"""The caBundle controller among other writers, against an in-memory API server: pods of
``tls.source=self`` alive together past the rollout window, pods whose clocks disagree,
a pod that is gone, a CA rotation beside another pod, and writers that keep undoing
what the controller writes. Windows are scaled down to a second or two; test_cabundle.py
runs the rollout on a real API server."""

from __future__ import annotations

import base64
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from gpudra.common.kube import ApiError, Kube
from gpudra.webhook.cabundle import (
    LEASE_PREFIX,
    CABundleController,
    ConfigurationKind,
    WebhookConfiguration,
    certificates,
    fingerprint,
)
from gpudra.webhook.certs import generate_ca

pytestmark = pytest.mark.anyio
W = 1.0  # keep_foreign_s, scaled down from ROLLOUT_OVERLAP_S
GUARD = 20  # seconds: only a hang guard, never a speed check
MUTATING = WebhookConfiguration(ConfigurationKind.MUTATING, "gpudra-pod-conversion")
VALIDATING = WebhookConfiguration(ConfigurationKind.VALIDATING, "gpudra-claim-validation")
BOTH = [MUTATING, VALIDATING]


def ca(name: str) -> bytes:
    return generate_ca(common_name=name).cert_pem


def b64(*pems: bytes) -> str:
    return base64.b64encode(b"".join(pems)).decode()


class ConfigurationApi:
    """Webhook configurations as the API server keeps them: a resourceVersion bumped on
    every write, JSON patches whose test op fails with 422, list and watch by name.
    Writes are counted by client."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.version = 0
        self.writes: dict[str, int] = {}
        self._changed = anyio.Event()

    def store(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[path] = obj
        self.history.append((self.version, path, copy.deepcopy(obj)))
        self._changed.set()
        self._changed = anyio.Event()
        return copy.deepcopy(obj)

    def create(self, ref: WebhookConfiguration, bundle_b64: str) -> None:
        hooks = [{"name": f"h{i}.gpudra.nvidia.com", "clientConfig": {}} for i in range(2)]
        for hook in hooks:
            if bundle_b64:
                hook["clientConfig"]["caBundle"] = bundle_b64
        self.store(ref.path, {"metadata": {"name": ref.name}, "webhooks": hooks})

    def certs(self, ref: WebhookConfiguration) -> list[set[bytes]]:
        """Each webhook's certificates."""
        return [
            set(certificates(base64.b64decode(h["clientConfig"].get("caBundle", ""))))
            for h in self.objects[ref.path]["webhooks"]
        ]

    def trusts(self, *pems: bytes) -> bool:
        """Every webhook of every configuration trusts all of `pems`."""
        wanted = {c for p in pems for c in certificates(p)}
        return all(wanted <= certs for ref in BOTH for certs in self.certs(ref))

    def holds(self, pem: bytes) -> bool:
        """Any webhook still holds `pem`."""
        return any(set(certificates(pem)) & certs for ref in BOTH for certs in self.certs(ref))

    def leases(self, ref: WebhookConfiguration) -> dict[str, str]:
        found = self.objects[ref.path]["metadata"].get("annotations") or {}
        return {
            k.removeprefix(LEASE_PREFIX): v for k, v in found.items() if k.startswith(LEASE_PREFIX)
        }

    def set_bundle(self, ref: WebhookConfiguration, bundle_b64: str, who: str) -> None:
        """Someone else's write of every webhook's caBundle, unguarded (a plain edit)."""
        obj = copy.deepcopy(self.objects[ref.path])
        for hook in obj["webhooks"]:
            hook["clientConfig"]["caBundle"] = bundle_b64
        self.writes[who] = self.writes.get(who, 0) + 1
        self.store(ref.path, obj)

    def client(self, who: str) -> Kube:
        return _Client(self, who)  # type: ignore[return-value]

    async def changes(self, after: int) -> AsyncIterator[tuple[int, str, dict[str, Any]]]:
        """Every stored version after `after`, as it comes."""
        while True:
            pending = [entry for entry in self.history if entry[0] > after]
            for entry in pending:
                after = entry[0]
                yield entry
            if not pending:
                await self._changed.wait()


class _Client:
    """What CABundleController and its Reflector use of `Kube`."""

    def __init__(self, api: ConfigurationApi, who: str) -> None:
        self.api, self.who = api, who

    async def request(
        self, method: str, path: str, body: Any = None, *, query: Any = None, **_: Any
    ) -> Any:
        await anyio.sleep(0.001)  # a round trip
        api = self.api
        if method == "GET" and query and "fieldSelector" in query:
            name = query["fieldSelector"].split("=", 1)[1]
            items = [copy.deepcopy(o) for p, o in api.objects.items() if p == f"{path}/{name}"]
            return {"items": items, "metadata": {"resourceVersion": str(api.version)}}
        obj = api.objects.get(path)
        if obj is None:
            raise ApiError(404, "not found", method, path)
        if method == "GET":
            return copy.deepcopy(obj)
        assert method == "PATCH", method
        new = copy.deepcopy(obj)
        for op in body:
            *parents, last = [
                t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]
            ]
            target: Any = new
            for token in parents:
                target = target[int(token)] if isinstance(target, list) else target[token]
            if op["op"] == "test":
                if target[last] != op["value"]:
                    raise ApiError(422, "the test operation failed", method, path)
            else:
                assert op["op"] == "add", op
                target[last] = copy.deepcopy(op["value"])
        api.writes[self.who] = api.writes.get(self.who, 0) + 1
        return api.store(path, new)

    async def watch(
        self, path: str, query: dict[str, str], timeout_s: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        name = query["fieldSelector"].split("=", 1)[1]
        with anyio.move_on_after(timeout_s):
            async for _version, stored, obj in self.api.changes(int(query["resourceVersion"])):
                if stored == f"{path}/{name}":
                    yield {"type": "MODIFIED", "object": obj}


async def sample(check: Callable[[], bool], seconds: float) -> list[bool]:
    """`check` every 10 ms for `seconds`."""
    found = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found.append(check())
        await anyio.sleep(0.01)
    return found


async def wait_until(check: Callable[[], bool]) -> None:
    with anyio.fail_after(GUARD):
        while not check():
            await anyio.sleep(0.01)


def pod(
    api: ConfigurationApi,
    name: str,
    bundle: bytes,
    *,
    clock: Callable[[], float] = time.time,
    window: float = W,
) -> CABundleController:
    controller = CABundleController(
        api.client(name), BOTH, keep_foreign_s=window, holder=name, clock=clock
    )
    controller.set_bundle(bundle)
    return controller


def behind(seconds: float) -> Callable[[], float]:
    """A node's clock `seconds` behind the others (ahead when negative)."""
    return lambda: time.time() - seconds


LIVE_W = 2 * W
"""The window of pods that must keep renewing throughout: a loaded machine that runs a
pod's renewal (every quarter window) late by most of a window does not lapse its lease."""


@pytest.mark.parametrize(
    "skew",
    [0.0, 2 * LIVE_W, 0.8 * LIVE_W, -2 * LIVE_W],
    ids=["same-clock", "2w", "0.8w", "ahead-2w"],
)
async def test_two_live_pods_keep_both_cas_past_the_window_without_fighting(
    caplog: pytest.LogCaptureFixture, skew: float
) -> None:
    """A surge pod that never turns Ready, or two replicas: both pods live far longer
    than the window. Neither CA leaves the bundle, and the pods write only their lease
    renewals (a window-based bundle made them drop each other's CA and rewrite the
    configurations thousands of times a second).

    So also where the clocks of their nodes disagree by more than the window (`skew`).
    Judged against its own clock on every pass, the other pod's lease looked stale to
    the pod ahead, which stamped over it as first-seen, stopped renewing its own for a
    peer it no longer saw, and the two took turns writing: a pod's CA left the bundle,
    and each saw its writes undone. A lease is timed by when it is seen to change: the
    clocks cost at most one write each, when the pods first meet."""
    api = ConfigurationApi()
    old, new = ca("old-pod"), ca("new-pod")
    for ref in BOTH:
        api.create(ref, b64(old))
    a = pod(api, "pod-a", old, clock=behind(skew), window=LIVE_W)
    b = pod(api, "pod-b", new, window=LIVE_W)
    caplog.set_level(logging.INFO, logger="gpudra.webhook.cabundle")
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        await tg.start(b.run)
        await wait_until(lambda: api.trusts(old, new))
        writes = dict(api.writes)
        trusted = await sample(lambda: api.trusts(old, new), 5 * LIVE_W)
        assert all(trusted), f"a CA was missing in {trusted.count(False)} of {len(trusted)}"
        # Renewals only: each pod renews each configuration four times per window.
        renewals = sum(api.writes.values()) - sum(writes.values())
        assert renewals <= 2 * len(BOTH) * (5 * 4 + 5), api.writes
        assert a.undone == b.undone == 0
        assert a.desired_b64() == b.desired_b64()
        for ref in BOTH:  # each lease its holder's: nobody stamps over a live one
            leases = api.leases(ref)
            assert leases.keys() == {fingerprint(old), fingerprint(new)}
            assert leases[fingerprint(old)].endswith(" pod-a")
            assert leases[fingerprint(new)].endswith(" pod-b")
        tg.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("step", [2 * LIVE_W, -2 * LIVE_W], ids=["forward", "back"])
async def test_a_clock_stepped_under_running_pods_changes_nothing(
    caplog: pytest.LogCaptureFixture, step: float
) -> None:
    """A node's clock set right while the pods run (an NTP step): leases are timed on a
    clock that is never set, so no CA leaves the bundle and no lease is taken over."""
    api = ConfigurationApi()
    old, new = ca("old-pod"), ca("new-pod")
    for ref in BOTH:
        api.create(ref, b64(old))
    offset = [0.0]
    a = pod(api, "pod-a", old, clock=lambda: time.time() + offset[0], window=LIVE_W)
    b = pod(api, "pod-b", new, window=LIVE_W)
    caplog.set_level(logging.INFO, logger="gpudra.webhook.cabundle")
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        await tg.start(b.run)
        await wait_until(lambda: api.trusts(old, new))
        await anyio.sleep(LIVE_W)
        offset[0] = step
        trusted = await sample(lambda: api.trusts(old, new), 3 * LIVE_W)
        assert all(trusted), f"a CA was missing in {trusted.count(False)} of {len(trusted)}"
        assert a.undone == b.undone == 0
        for ref in BOTH:
            leases = api.leases(ref)
            assert leases[fingerprint(old)].endswith(" pod-a")
            assert leases[fingerprint(new)].endswith(" pod-b")
        tg.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("skew", [0.0, 2 * LIVE_W], ids=["same-clock", "slow-clock-2w"])
async def test_the_ca_of_a_pod_that_is_gone_goes_once_its_lease_lapses(skew: float) -> None:
    """The rollout as it should end: the old pod terminates (stops renewing); its CA and
    its lease leave every configuration about one window after its last renewal, the new
    pod's stays, and a pod alone writes nothing more. Timing leases by this pod's clock
    keeps that for a pod whose clock is behind by twice the window too."""
    api = ConfigurationApi()
    old, new = ca("old-pod"), ca("new-pod")
    for ref in BOTH:
        api.create(ref, b64(old))
    a = pod(api, "pod-a", old, clock=behind(skew), window=LIVE_W)
    b = pod(api, "pod-b", new, window=LIVE_W)
    async with anyio.create_task_group() as tg:
        old_pod = anyio.CancelScope()

        async def run_a() -> None:
            with old_pod:
                await a.run()

        tg.start_soon(run_a)
        await tg.start(b.run)
        await wait_until(lambda: api.trusts(old, new))
        await anyio.sleep(2 * LIVE_W)  # past the first window: A is kept because it renews
        assert api.trusts(old, new)
        old_pod.cancel()
        gone = time.monotonic()
        await wait_until(lambda: not api.holds(old))
        # A window after its last renewal, with room for a loaded machine's late wakeups.
        assert time.monotonic() - gone <= 3 * LIVE_W
        assert api.trusts(new)
        for ref in BOTH:
            assert api.leases(ref).keys() == {fingerprint(new)}
        writes = sum(api.writes.values())
        await anyio.sleep(2 * W)
        assert sum(api.writes.values()) == writes
        tg.cancel_scope.cancel()


async def test_a_ca_nobody_keeps_putting_back_goes_after_the_window() -> None:
    """A CA in the bundle without a lease (a pod of an earlier release that has gone, or
    one put there by hand) is kept for the window from when it is first seen, then
    dropped for good."""
    api = ConfigurationApi()
    stale, mine = ca("gone-pod"), ca("this-pod")
    for ref in BOTH:
        api.create(ref, b64(stale))
    b = pod(api, "pod-b", mine)
    async with anyio.create_task_group() as tg:
        started = time.monotonic()
        await tg.start(b.run)
        await wait_until(lambda: api.trusts(stale, mine))
        await wait_until(lambda: not api.holds(stale))
        assert time.monotonic() - started >= W - 0.1
        for ref in BOTH:
            assert api.leases(ref).keys() == {fingerprint(mine)}
        writes = sum(api.writes.values())
        await anyio.sleep(2 * W)
        assert not api.holds(stale)
        assert sum(api.writes.values()) == writes
        tg.cancel_scope.cancel()


async def test_an_old_release_pod_that_keeps_its_ca_in_is_kept_not_fought() -> None:
    """A pod that holds no lease (an earlier release) but is alive puts its CA back
    each time it is dropped: that makes it a live writer, so its CA is stamped again
    and kept instead of being taken out again and again."""
    api = ConfigurationApi()
    theirs, mine = ca("old-release-pod"), ca("this-pod")
    for ref in BOTH:
        api.create(ref, b64(theirs))
    b = pod(api, "pod-b", mine)

    async def old_release_pod() -> None:
        """Puts its CA back when missing, keeping what else is there."""
        async for _v, path, _obj in api.changes(api.version):
            ref = next(r for r in BOTH if r.path == path)
            if not all(set(certificates(theirs)) <= certs for certs in api.certs(ref)):
                kept = {c for certs in api.certs(ref) for c in certs}
                api.set_bundle(ref, b64(*sorted(kept | set(certificates(theirs)))), "old")

    async with anyio.create_task_group() as tg:
        tg.start_soon(old_release_pod)
        await tg.start(b.run)
        await wait_until(lambda: api.trusts(theirs, mine))
        present = await sample(lambda: api.trusts(theirs), 5 * W)
        # Dropped only for a round trip once per window, never in a loop.
        assert present.count(False) <= len(present) / 20, f"missing {present.count(False)} times"
        assert api.writes.get("pod-b", 0) <= len(BOTH) * (2 * 5 + 4), api.writes
        assert api.writes.get("old", 0) <= len(BOTH) * (5 + 2), api.writes
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("keep_foreign_s", [0.0, W])
async def test_a_writer_that_keeps_undoing_the_bundle_meets_a_backoff_and_one_warning(
    caplog: pytest.LogCaptureFixture, keep_foreign_s: float
) -> None:
    """Something (a GitOps tool syncing caBundle from git, a stale pod) writes its own
    bundle back each time: the controller still puts its CA back, but after delays that
    grow, and it says once what fights it."""
    api = ConfigurationApi()
    theirs, mine = ca("gitops-ca"), ca("this-pod")
    for ref in BOTH:
        api.create(ref, b64(theirs))
    controller = CABundleController(
        api.client("pod-b"), BOTH, keep_foreign_s=keep_foreign_s, holder="pod-b"
    )
    controller.set_bundle(mine)

    async def resetter() -> None:
        async for _v, path, _obj in api.changes(api.version):
            ref = next(r for r in BOTH if r.path == path)
            if any(certs != set(certificates(theirs)) for certs in api.certs(ref)):
                api.set_bundle(ref, b64(theirs), "gitops")

    caplog.set_level(logging.INFO, logger="gpudra.webhook.cabundle")
    async with anyio.create_task_group() as tg:
        tg.start_soon(resetter)
        await tg.start(controller.run)
        await anyio.sleep(5.0)
        # Writes at 0, 1 and 3 s per configuration (the delay doubles from 1 s), and a
        # stamp or two: a tight loop made thousands.
        assert api.writes.get("pod-b", 0) <= len(BOTH) * 6, api.writes
        assert controller.undone >= len(BOTH)
        tg.cancel_scope.cancel()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == len(BOTH)  # one per configuration, for the whole episode
    fields = [r.__dict__["fields"] for r in warnings]
    assert {f["configuration"] for f in fields} == {str(ref) for ref in BOTH}
    for f in fields:
        (removed,) = f["it_removes"]
        assert removed.startswith("CN=this-pod ") and removed.endswith("(ours)")
        gitops = f"CN=gitops-ca sha256:{fingerprint(certificates(theirs)[0])[:12]}"
        assert f["it_adds"] == ([] if keep_foreign_s else [gitops])


async def test_a_ca_rotation_beside_another_pod_is_followed_and_released() -> None:
    """The rotation handshake with a second pod: the new CA is published (both pods
    keep it), and the CA the rotation drops leaves with its lease, without a fight."""
    api = ConfigurationApi()
    a_ca, b_old, b_new = ca("pod-a"), ca("pod-b-1"), ca("pod-b-2")
    for ref in BOTH:
        api.create(ref, b64(a_ca))
    a, b = pod(api, "pod-a", a_ca, window=LIVE_W), pod(api, "pod-b", b_old, window=LIVE_W)
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        await tg.start(b.run)
        await wait_until(lambda: api.trusts(a_ca, b_old))
        rotating = b_new + b_old
        b.set_bundle(rotating)
        with anyio.fail_after(GUARD):
            await b.wait_published(rotating)
        assert api.trusts(a_ca, b_new, b_old)
        b.set_bundle(b_new)  # the old CA has expired
        await wait_until(lambda: not api.holds(b_old))
        assert api.trusts(a_ca, b_new)
        await anyio.sleep(2 * LIVE_W)  # past every window: still both pods, no fight
        assert api.trusts(a_ca, b_new) and not api.holds(b_old)
        for ref in BOTH:
            assert api.leases(ref).keys() == {fingerprint(a_ca), fingerprint(b_new)}
        assert a.undone == b.undone == 0
        tg.cancel_scope.cancel()
