"""One writer among replicas: leader election on a coordination.k8s.io/v1 Lease.

Replicas that each compute and write the same objects agree while they run one release,
but during a rollout two releases may want different things and overwrite each other
until the old pods are gone. Kubernetes controllers solve that with a Lease that one
replica holds and renews; the others keep their caches warm and write nothing until
the holder stops renewing. This is that, with client-go's ``leaderelection`` semantics
(``spec.holderIdentity``, ``leaseDurationSeconds``, ``acquireTime`` and ``renewTime``
as MicroTime, ``leaseTransitions``), so a platform team reads the Lease as it reads
kube-controller-manager's:

- No Lease: created, held. Held by us: renewed (a PUT guarded by its resourceVersion).
  Released (empty holder): taken at once. Held by another: taken only once its record
  (holder, renewTime, resourceVersion) has not changed for its ``leaseDurationSeconds``
  as timed by *this* process's monotonic clock from when that record was first seen:
  another node's timestamps are never compared with our clock, so clock skew between
  nodes cannot make a live lease look expired. A 409 on a write means another
  candidate wrote first: we follow.
- A leader counts as leading only until its last successful renewal (timed from
  before the request was sent) plus ``renew_deadline_s``, shorter than the lease
  duration: it stops writing before any other candidate may take the lease, even
  while its renewals hang or fail.
- Stopped (cancelled) while leading, it releases the Lease (holder ``""``,
  ``leaseDurationSeconds: 1``, as client-go's ReleaseOnCancel), shielded and bounded:
  a rollout hands over within one retry period, not one lease duration. `resign` does
  the same for a process that keeps running a while (a webhook still serving while
  its endpoints are withdrawn): it stops leading at once and takes no further part.

Why not kubernetes_asyncio's ``leaderelection`` package: it works on the generated API
models this project keeps out of its processes (`gpudra.common.kubeimports`); it
times leases by comparing the holder's renewTime with this node's wall clock, so a
skewed node takes a live lease or waits past a dead one; and it never releases its
lease when stopped, so every rollout waits a whole lease duration with no writer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.common.kube import ApiError, Kube

__all__ = ["LEASE_DURATION_S", "RENEW_DEADLINE_S", "RETRY_S", "LeaderElector", "micro_time"]

log = logging.getLogger(__name__)

LEASE_DURATION_S: Final = 15.0
"""How long a candidate waits on a lease that is not renewed before taking it."""
RENEW_DEADLINE_S: Final = 10.0
"""How long a leader keeps leading without a successful renewal."""
RETRY_S: Final = 2.0
"""How often a candidate tries to take the lease, and the leader renews it."""
RELEASE_TIMEOUT_S: Final = 5.0
"""How long a stopping leader spends at most on releasing its lease."""


def micro_time(seconds: float) -> str:
    """A Unix time as the API server writes a MicroTime (``renewTime``, ``acquireTime``)."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Takes and keeps the Lease `namespace`/`name` for `identity`; run `run` in a task
    group and read `leading` before each write that only one replica may make.

    `clock` times leases and renewals (monotonic; injectable for tests); `wall` only
    stamps ``renewTime`` and ``acquireTime`` for people and other tools to read.
    """

    def __init__(
        self,
        kube: Kube,
        *,
        name: str,
        namespace: str,
        identity: str,
        lease_duration_s: float = LEASE_DURATION_S,
        renew_deadline_s: float = RENEW_DEADLINE_S,
        retry_s: float = RETRY_S,
        release_timeout_s: float = RELEASE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not identity:
            raise ValueError(
                "leader election identity is empty: give each replica a unique one (its pod name)"
            )
        if not 0 < retry_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                f"leader election timings: retry ({retry_s}s) < renew deadline "
                f"({renew_deadline_s}s) < lease duration ({lease_duration_s}s) must hold, "
                "all above 0, so a leader stops writing before another may take the "
                "lease; raise the lease duration or lower the others"
            )
        self._kube = kube
        self.name = name
        self.namespace = namespace
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_s = retry_s
        self._release_timeout_s = release_timeout_s
        self._clock = clock
        self._wall = wall
        self._path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self._listeners: list[Callable[[bool], None]] = []
        self._leading = False
        self._renewed_at = -math.inf
        # The Lease as we last wrote it while leading: its resourceVersion guards the release.
        self._held: dict[str, Any] | None = None
        # The record last seen and when this process first saw it.
        self._observed: tuple[str, Any, Any] | None = None
        self._observed_at = -math.inf
        self._holder = ""
        self._failing = False
        self._resigned = False
        # The running loop's scope, and set once it has ended (its release done).
        self._scope: anyio.CancelScope | None = None
        self._ended: anyio.Event | None = None

    @property
    def leading(self) -> bool:
        """Whether this replica holds the lease now: false from ``renew_deadline_s``
        after its last successful renewal, whether or not the loop has noticed yet."""
        return (
            self._leading
            and not self._resigned
            and self._clock() < self._renewed_at + self.renew_deadline_s
        )

    @property
    def holder(self) -> str:
        """Who holds the lease as last seen ("" when nobody or not yet read)."""
        return self._holder

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(leading)` each time leadership is gained or lost: a consumer
        that writes only while leading catches up at once when it gains it."""
        self._listeners.append(listener)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Try to take, then renew, the lease every ``retry_s`` until cancelled or
        resigned; released on the way out while leading."""
        self._ended = anyio.Event()
        task_status.started()
        try:
            with anyio.CancelScope() as self._scope:
                while not self._resigned:
                    # A request that hangs is a failed attempt, not a stalled loop.
                    with anyio.move_on_after(self.renew_deadline_s):
                        await self.try_acquire_or_renew()
                    if self._leading and not self.leading:
                        self._set_leading(False, reason="renewals failed past the renew deadline")
                    await anyio.sleep(self.retry_s)
        finally:
            if self._held is not None:
                with anyio.move_on_after(self._release_timeout_s, shield=True):
                    await self.release()
            self._ended.set()

    async def resign(self) -> None:
        """Stop leading now and hand the lease back, for good: a replica that is about
        to stop but serves a while longer writes nothing more, and another takes over
        within a retry. Returns once `run` has ended (its release done), at once where
        it is not running."""
        self._resigned = True
        if self._scope is not None:
            self._scope.cancel()
        if self._ended is not None:
            await self._ended.wait()
        elif self._held is not None:
            with anyio.move_on_after(self._release_timeout_s, shield=True):
                await self.release()

    async def try_acquire_or_renew(self) -> bool:
        """One attempt, as client-go's tryAcquireOrRenew: whether we lead after it. A
        failed request leaves leadership to the renew deadline."""
        now = self._clock()
        try:
            return await self._attempt(now)
        except Exception as exc:  # aiohttp's errors are not OSErrors; never die on them
            if not self._failing:
                self._failing = True
                log.warning(
                    "leader election: lease request failed; retrying",
                    extra={"fields": {**self._fields(), "error": repr(exc)}},
                )
            return False

    async def _attempt(self, now: float) -> bool:
        try:
            lease = await self._kube.request("GET", self._path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            return await self._write("POST", self._lease(None), now)
        self._failing = False
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), lease["metadata"].get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self._holder = holder
        if holder and holder != self.identity:
            duration = spec.get("leaseDurationSeconds") or self.lease_duration_s
            if now < self._observed_at + duration:
                self._held = None
                if self._leading:
                    self._set_leading(False, reason="another replica holds the lease")
                return False
        return await self._write("PUT", self._lease(lease), now)

    def _lease(self, have: dict[str, Any] | None) -> dict[str, Any]:
        """The Lease held by us: renewed where it is ours, taken over otherwise."""
        stamp = micro_time(self._wall())
        spec = dict((have or {}).get("spec") or {})
        ours = spec.get("holderIdentity") == self.identity
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=math.ceil(self.lease_duration_s),
            renewTime=stamp,
            acquireTime=spec.get("acquireTime") if ours and spec.get("acquireTime") else stamp,
            leaseTransitions=int(spec.get("leaseTransitions") or 0)
            + (0 if ours or not have else 1),
        )
        if have is not None:
            return {**have, "spec": spec}
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        }

    async def _write(self, method: str, body: dict[str, Any], now: float) -> bool:
        path = self._path if method == "PUT" else self._path.rsplit("/", 1)[0]
        try:
            written = await self._kube.request(method, path, body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Another candidate wrote first (or the holder renewed): follow it.
            self._held = None
            if self._leading:
                self._set_leading(False, reason="another replica wrote the lease first")
            return False
        self._failing = False
        self._held = written
        self._holder = self.identity
        spec = written.get("spec") or {}
        self._observed = (
            self.identity,
            spec.get("renewTime"),
            written["metadata"].get("resourceVersion"),
        )
        self._observed_at = now
        self._renewed_at = now
        if not self._leading:
            self._set_leading(True, reason="took the lease")
        return True

    async def release(self) -> None:
        """Stop leading and hand the lease back (empty holder, 1 s duration), so that
        another candidate takes it on its next try instead of after a lease duration.
        The write is guarded by the resourceVersion we last wrote: a lease another
        candidate wrote since (a leader that lost its renewals) is left as it is."""
        held, self._held = self._held, None
        if self._leading:
            self._set_leading(False, reason="stopping")
        if held is None:
            return
        stamp = micro_time(self._wall())
        spec = {
            **(held.get("spec") or {}),
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "renewTime": stamp,
            "acquireTime": stamp,
        }
        try:
            await self._kube.request("PUT", self._path, {**held, "spec": spec})
        except Exception as exc:  # aiohttp's errors are not OSErrors
            log.warning(
                "leader election: lease not released; another replica takes it once it expires",
                extra={"fields": {**self._fields(), "error": repr(exc)}},
            )
            return
        self._holder = ""
        log.info("leader election: lease released", extra={"fields": self._fields()})

    def _set_leading(self, leading: bool, *, reason: str) -> None:
        self._leading = leading
        fields = {**self._fields(), "holder": self._holder, "reason": reason}
        if leading:
            log.info("leader election: leading", extra={"fields": fields})
        else:
            log.info("leader election: not leading", extra={"fields": fields})
        for listener in list(self._listeners):
            listener(leading)

    def _fields(self) -> dict[str, Any]:
        return {"lease": f"{self.namespace}/{self.name}", "identity": self.identity}
