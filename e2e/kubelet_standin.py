"""A kubelet stand-in that drives kubelet plugins over the real wire protocols.

The local cluster has no kubelet, so end-to-end tests use this to do the kubelet's
part: watch `<root>/plugins_registry/` for registration sockets, register plugins the
way the kubelet does (GetInfo with a 1 s deadline, pick the first DRA version it
knows, dial the endpoint, NotifyRegistrationStatus), and call NodePrepareResources /
NodeUnprepareResources with the kubelet's 45 s deadline. It also checks responses the
way the kubelet does: every claim sent must be answered and nothing else.

Usage:

    async with KubeletStandin(root) as kubelet:
        await kubelet.wait_for_driver("gpu.nvidia.com")
        results = await kubelet.prepare("gpu.nvidia.com", [ClaimRef(ns, uid, name)])
        async with kubelet.watch_health("gpu.nvidia.com") as updates:
            devices = await anext(updates)

Preparing the claims of pods the scheduler bound to this node belongs on top of
`prepare`/`unprepare` (one call per driver per pod, like the kubelet); this module
does not talk to Kubernetes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import grpc
from anyio.abc import TaskGroup
from gpudra.driver.claims import ClaimRef
from gpudra.driver.plugin import (
    DRA_V1,
    DRA_V1BETA1,
    HEALTH_MODULES,
    HEALTH_V1,
    HEALTH_V1ALPHA1,
    PLUGIN_TYPE,
    DeviceHealth,
    PreparedDevice,
    PrepareResult,
    endpoint_problem,
)
from gpudra.driver.proto import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)

log = logging.getLogger(__name__)

# The kubelet's timeouts (pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra).
GET_INFO_TIMEOUT_S = 1.0
DIAL_TIMEOUT_S = 10.0
NOTIFY_TIMEOUT_S = 5.0
DRA_CALL_TIMEOUT_S = 45.0

DEFAULT_DRA_VERSIONS = (DRA_V1, DRA_V1BETA1)
# The kubelet's health services, newest first (1.37's `healthServicesSupportedByKubelet`).
DEFAULT_HEALTH_VERSIONS = (HEALTH_V1, HEALTH_V1ALPHA1)


class ProtocolViolation(Exception):
    """A plugin answered in a way the real kubelet would reject."""


class NotRegistered(Exception):
    """No plugin of that driver is registered with the stand-in."""


@dataclass
class Registration:
    """One registered plugin socket; the newest one of a driver gets the calls."""

    driver: str
    registration_socket: Path
    socket_identity: tuple[int, int]
    endpoint: Path
    dra_version: str
    health_version: str | None  # the health service chosen; None: none advertised
    channel: Any = field(repr=False)


@dataclass
class Rejection:
    """Why a registration socket was not registered (kept until the socket changes)."""

    registration_socket: Path
    socket_identity: tuple[int, int]
    reason: str


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stub(stub_class: Callable[[Any], Any], channel: Any) -> Any:
    """Build a generated client stub; the generated classes are untyped."""
    return stub_class(channel)


def _target(path: Path) -> str:
    return f"unix://{path}"


class KubeletStandin:
    """Registers kubelet plugins found under `root` and calls them like the kubelet.

    `dra_versions` are the DRA services this "kubelet" knows; like the kubelet it
    takes the first entry of the plugin's list that it knows, so the plugin's order
    decides. Pass `(DRA_V1BETA1,)` to act as an older kubelet.

    `health_versions` are the health services it knows, in its own order of
    preference: like the kubelet of 1.37 and later, it takes the first of them that
    the plugin advertises, whatever the plugin's order. Pass `(HEALTH_V1ALPHA1,)` to
    act as a kubelet of 1.36 or earlier.
    """

    def __init__(
        self,
        root: Path,
        *,
        dra_versions: Sequence[str] = DEFAULT_DRA_VERSIONS,
        health_versions: Sequence[str] = DEFAULT_HEALTH_VERSIONS,
        poll_interval_s: float = 0.05,
    ) -> None:
        self.root = Path(root)
        self.registry = self.root / "plugins_registry"
        self.dra_versions = tuple(dra_versions)
        self.health_versions = tuple(health_versions)
        self.poll_interval_s = poll_interval_s
        # Per driver, oldest first; the last one is the active one.
        self._registrations: dict[str, list[Registration]] = {}
        self.rejected: dict[Path, Rejection] = {}
        self._changed: anyio.Event | None = None
        self._task_group: TaskGroup | None = None

    # --- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._changed = anyio.Event()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(self._watch)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(exc_type, exc, tb)
        self._task_group = None
        with anyio.CancelScope(shield=True):
            for regs in self._registrations.values():
                for reg in regs:
                    await reg.channel.close()
        self._registrations.clear()

    # --- registration ----------------------------------------------------------------

    def registrations(self, driver: str) -> list[Registration]:
        return list(self._registrations.get(driver, ()))

    def active(self, driver: str) -> Registration:
        regs = self._registrations.get(driver)
        if not regs:
            msg = f"driver {driver!r} is not registered"
            raise NotRegistered(msg)
        return regs[-1]

    async def wait_for_driver(
        self, driver: str, *, timeout_s: float = 30.0, replacing: Registration | None = None
    ) -> Registration:
        """Wait until a plugin of `driver` is registered and return the active one.

        With `replacing`, wait for a registration other than that one: after a plugin
        restarts, the old one stays active until the next scan notices its socket went.
        """
        with anyio.fail_after(timeout_s):
            while True:
                regs = self._registrations.get(driver)
                if regs and regs[-1] is not replacing:
                    return regs[-1]
                await self._wait_changed()

    async def wait_for_registration(self, socket: Path, *, timeout_s: float = 30.0) -> Registration:
        """Wait until the plugin behind one registration socket is registered."""
        with anyio.fail_after(timeout_s):
            while True:
                for regs in self._registrations.values():
                    for reg in regs:
                        if reg.registration_socket == socket:
                            return reg
                await self._wait_changed()

    async def wait_for_rejection(self, socket: Path, *, timeout_s: float = 30.0) -> Rejection:
        with anyio.fail_after(timeout_s):
            while socket not in self.rejected:
                await self._wait_changed()
        return self.rejected[socket]

    async def wait_for_deregistration(self, socket: Path, *, timeout_s: float = 30.0) -> None:
        with anyio.fail_after(timeout_s):
            while any(
                reg.registration_socket == socket
                for regs in self._registrations.values()
                for reg in regs
            ):
                await self._wait_changed()

    async def _wait_changed(self) -> None:
        if self._changed is None:
            msg = "KubeletStandin must be entered (async with) first"
            raise RuntimeError(msg)
        await self._changed.wait()

    def _notify_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self._changed = anyio.Event()

    async def _watch(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Poll the registry folder; the kubelet uses inotify, polling is enough here."""
        task_status.started()
        while True:
            await self._scan()
            await anyio.sleep(self.poll_interval_s)

    async def _scan(self) -> None:
        present: dict[Path, tuple[int, int]] = {}
        if self.registry.is_dir():
            for path in sorted(self.registry.glob("*-reg.sock")):
                ident = _identity(path)
                if ident is not None and not path.name.startswith("."):
                    present[path] = ident
        known = {
            reg.registration_socket: reg for regs in self._registrations.values() for reg in regs
        }
        for path, reg in known.items():
            if present.get(path) != reg.socket_identity:
                await self._deregister(reg)
        for path, rejection in list(self.rejected.items()):
            if present.get(path) != rejection.socket_identity:
                del self.rejected[path]
        for path, ident in present.items():
            current = known.get(path)
            if current is not None and current.socket_identity == ident:
                continue
            if path in self.rejected:
                continue
            await self._register(path, ident)

    async def _register(self, path: Path, ident: tuple[int, int]) -> None:
        async with grpc.aio.insecure_channel(_target(path)) as channel:
            stub = _stub(pluginregistration_v1_pb2_grpc.RegistrationStub, channel)
            try:
                info = await stub.GetInfo(
                    pluginregistration_v1_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                # A socket that does not answer yet (or any more): try again next scan.
                log.debug(
                    "GetInfo failed",
                    extra={"fields": {"socket": str(path), "error": str(exc)}},
                )
                return
            reason, version = self._validate(info)
            dra_channel: Any = None
            if reason is None:
                dra_channel = grpc.aio.insecure_channel(_target(Path(info.endpoint)))
                try:
                    with anyio.fail_after(DIAL_TIMEOUT_S):
                        await dra_channel.channel_ready()
                except TimeoutError:
                    reason = f"could not dial endpoint {info.endpoint}"
                    await dra_channel.close()
            status = pluginregistration_v1_pb2.RegistrationStatus(
                plugin_registered=reason is None, error=reason or ""
            )
            try:
                await stub.NotifyRegistrationStatus(status, timeout=NOTIFY_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "NotifyRegistrationStatus failed",
                    extra={"fields": {"socket": str(path), "error": str(exc)}},
                )
        if reason is not None:
            self.rejected[path] = Rejection(path, ident, reason)
            log.info("plugin rejected", extra={"fields": {"socket": str(path), "reason": reason}})
        else:
            assert version is not None
            reg = Registration(
                driver=info.name,
                registration_socket=path,
                socket_identity=ident,
                endpoint=Path(info.endpoint),
                dra_version=version,
                health_version=next(
                    (v for v in self.health_versions if v in info.supported_versions), None
                ),
                channel=dra_channel,
            )
            self._registrations.setdefault(info.name, []).append(reg)
            log.info(
                "plugin registered",
                extra={"fields": {"driver": info.name, "socket": str(path), "version": version}},
            )
        self._notify_changed()

    def _validate(self, info: Any) -> tuple[str | None, str | None]:
        """Check GetInfo like the kubelet's DRA plugin handler; returns (error, version)."""
        if info.type != PLUGIN_TYPE:
            return f"unsupported plugin type {info.type!r}, want {PLUGIN_TYPE!r}", None
        if not info.name:
            return "plugin name is empty", None
        # As the kubelet of 1.38 checks it; earlier ones register it and then cannot
        # dial it, or dial whatever path Go's URL parser makes of it.
        if problem := endpoint_problem(info.endpoint):
            return f"endpoint {info.endpoint!r} {problem}", None
        for version in info.supported_versions:
            if version in self.dra_versions:
                return None, version
        return (
            f"none of the plugin's versions {list(info.supported_versions)} is supported "
            f"(kubelet supports {list(self.dra_versions)})",
            None,
        )

    async def _deregister(self, reg: Registration) -> None:
        regs = self._registrations.get(reg.driver, [])
        if reg in regs:
            regs.remove(reg)
        if not regs:
            self._registrations.pop(reg.driver, None)
        with anyio.CancelScope(shield=True):
            await reg.channel.close()
        log.info(
            "plugin deregistered",
            extra={"fields": {"driver": reg.driver, "socket": str(reg.registration_socket)}},
        )
        self._notify_changed()

    # --- DRA calls -------------------------------------------------------------------

    async def prepare(
        self, driver: str, claims: Sequence[ClaimRef], *, timeout_s: float = DRA_CALL_TIMEOUT_S
    ) -> dict[str, PrepareResult]:
        """NodePrepareResources for one pod's claims of `driver`; gRPC errors propagate."""
        reg = self.active(driver)
        if reg.dra_version == DRA_V1:
            request_v1 = dra_v1_pb2.NodePrepareResourcesRequest(claims=_claims_v1(claims))
            stub_v1 = _stub(dra_v1_pb2_grpc.DRAPluginStub, reg.channel)
            response: Any = await stub_v1.NodePrepareResources(request_v1, timeout=timeout_s)
        else:
            request_b1 = dra_v1beta1_pb2.NodePrepareResourcesRequest(claims=_claims_v1beta1(claims))
            stub_b1 = _stub(dra_v1beta1_pb2_grpc.DRAPluginStub, reg.channel)
            response = await stub_b1.NodePrepareResources(request_b1, timeout=timeout_s)
        _check_answered("NodePrepareResources", claims, response.claims.keys())
        results: dict[str, PrepareResult] = {}
        for uid, entry in response.claims.items():
            if entry.error:
                results[uid] = PrepareResult(error=entry.error)
                continue
            devices = [
                PreparedDevice(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                    share_id=(
                        d.share_id if reg.dra_version == DRA_V1 and d.HasField("share_id") else None
                    ),
                )
                for d in entry.devices
            ]
            results[uid] = PrepareResult(devices=devices)
        return results

    async def unprepare(
        self, driver: str, claims: Sequence[ClaimRef], *, timeout_s: float = DRA_CALL_TIMEOUT_S
    ) -> dict[str, str | None]:
        """NodeUnprepareResources; maps each claim UID to None or its error."""
        reg = self.active(driver)
        if reg.dra_version == DRA_V1:
            request_v1 = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=_claims_v1(claims))
            stub_v1 = _stub(dra_v1_pb2_grpc.DRAPluginStub, reg.channel)
            response: Any = await stub_v1.NodeUnprepareResources(request_v1, timeout=timeout_s)
        else:
            request_b1 = dra_v1beta1_pb2.NodeUnprepareResourcesRequest(
                claims=_claims_v1beta1(claims)
            )
            stub_b1 = _stub(dra_v1beta1_pb2_grpc.DRAPluginStub, reg.channel)
            response = await stub_b1.NodeUnprepareResources(request_b1, timeout=timeout_s)
        _check_answered("NodeUnprepareResources", claims, response.claims.keys())
        return {uid: (entry.error or None) for uid, entry in response.claims.items()}

    # --- health ----------------------------------------------------------------------

    @asynccontextmanager
    async def watch_health(self, driver: str) -> AsyncIterator[AsyncIterator[list[DeviceHealth]]]:
        """Open NodeWatchResources; yields an iterator of complete device lists."""
        reg = self.active(driver)
        if reg.health_version is None:
            msg = f"driver {driver!r} advertises none of {list(self.health_versions)}"
            raise ProtocolViolation(msg)
        messages, service = HEALTH_MODULES[reg.health_version]
        stub = _stub(service.DRAResourceHealthStub, reg.channel)
        call = stub.NodeWatchResources(messages.NodeWatchResourcesRequest())

        async def updates() -> AsyncIterator[list[DeviceHealth]]:
            async for response in call:
                yield [_device_health(d, messages) for d in response.devices]

        try:
            yield updates()
        finally:
            call.cancel()


def _claims_v1(claims: Sequence[ClaimRef]) -> list[dra_v1_pb2.Claim]:
    return [dra_v1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]


def _claims_v1beta1(claims: Sequence[ClaimRef]) -> list[dra_v1beta1_pb2.Claim]:
    return [dra_v1beta1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]


def _check_answered(method: str, claims: Sequence[ClaimRef], answered: Any) -> None:
    sent = {c.uid for c in claims}
    got = set(answered)
    if got != sent:
        msg = (
            f"{method}: answers do not match the claims sent "
            f"(missing {sorted(sent - got)}, unexpected {sorted(got - sent)})"
        )
        raise ProtocolViolation(msg)


def _device_health(msg: Any, status: Any) -> DeviceHealth:
    healthy = {status.HEALTHY: True, status.UNHEALTHY: False}.get(msg.health)
    return DeviceHealth(
        pool_name=msg.device.pool_name,
        device_name=msg.device.device_name,
        healthy=healthy,
        updated_at=float(msg.last_updated_time),
        message=msg.message,
        health_check_timeout_s=msg.health_check_timeout_seconds,
    )
