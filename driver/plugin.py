"""The kubelet plugin protocol layer: registration, DRA v1/v1beta1 and device health.

This module only speaks the kubelet's gRPC protocols over unix sockets. As the
upstream kubeletplugin library does, it reads and checks the claims the kubelet names
(through a `ClaimSource`) before the device layer sees them: what a claim means and
how devices are prepared lives behind `ClaimHandler`, which gets checked claims;
device health comes from a `HealthSource`. All of them take and return plain Python
types, so the device layer never sees protobuf, gRPC or the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, Protocol, Self, TypeVar

import anyio
import grpc
from gpudra.common.errors import exception_text
from gpudra.driver.claims import Claim, ClaimError, ClaimRef
from gpudra.driver.proto import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)

log = logging.getLogger(__name__)

DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
PLUGIN_TYPE = "DRAPlugin"
DRA_V1 = "v1.DRAPlugin"
DRA_V1BETA1 = "v1beta1.DRAPlugin"
HEALTH_V1 = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
DRA_APIS = (DRA_V1, DRA_V1BETA1)
# Both served, newest first, as upstream's kubelet plugin helper (v0.37) serves them.
# The kubelet of 1.37 and later takes the first of its own list (v1, then v1alpha1)
# that the plugin advertises, and opens no health stream where it finds none; it keeps
# v1alpha1 through 1.39. The kubelets of 1.34 to 1.36 know only v1alpha1 and call it
# without looking at the list.
HEALTH_APIS = (HEALTH_V1, HEALTH_V1ALPHA1)
# Per health API, its generated modules: the messages, and the gRPC service (its
# servicer's `add_DRAResourceHealthServicer_to_server`, a client's
# `DRAResourceHealthStub`).
HEALTH_MODULES: Mapping[str, tuple[ModuleType, ModuleType]] = {
    HEALTH_V1: (dra_health_v1_pb2, dra_health_v1_pb2_grpc),
    HEALTH_V1ALPHA1: (dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc),
}
# Bytes. The kubelet truncates longer messages; doing it here keeps what it shows predictable.
MAX_HEALTH_MESSAGE = 1024
# A third of the kubelet's default per-device health timeout (30 s): see `_Health`.
HEALTH_REFRESH_S = 10.0
# The kubelet cancels a NodePrepareResources call after this long (its DRA plugin
# client's defaultClientCallTimeout).
KUBELET_CALL_TIMEOUT_S = 45.0
# How long a prepare failure the kubelet's call left before it ended waits for the
# claim's next prepare call (`_CallsInFlight`). The kubelet does not count a failed
# prepare as a failed sync of the pod: it tries again at the pod's next sync, every
# `syncFrequency` (1 min by default) plus up to half of it, or at a change of the pod.
UNHEARD_FAILURE_KEEP_S = 300.0
UNHEARD_FAILURE_NOTE = (
    "the outcome of the prepare the kubelet's previous call left under way at its "
    "deadline; the next call prepares anew"
)
# A call still under way this long before its caller's deadline is answered: each
# claim with `STILL_UNDER_WAY` (a prepare) or `UNPREPARE_UNDER_WAY`, while the work goes
# on (`_CallsInFlight`). Time for the answer to reach the kubelet over its socket on a
# loaded node.
ANSWER_MARGIN_S = 2.0
STILL_UNDER_WAY = (
    "prepare still under way when the kubelet's call was about to end; it goes on, and "
    "the claim's next prepare call answers with its outcome"
)
NOT_BEGUN = (
    "not answered: the kubelet's call was about to end while the prepare of another of "
    "its claims, left by an earlier call, was still under way; the next call answers it"
)
UNPREPARE_UNDER_WAY = (
    "unprepare still under way when the kubelet's call was about to end; it goes on, and "
    "the claim's next unprepare call waits for it"
)
# sun_path is 108 bytes including the terminating NUL.
_MAX_UNIX_PATH = 107
_SOCKET_MODE = 0o600
# Each socket is bound in a folder of this name beside it (`_bind_private`); one older
# than `_STALE_STAGING_S` is a killed agent's.
_STAGING_PREFIX = ".gpudra-bind-"
# The random part `tempfile.mkdtemp` adds to it.
_STAGING_RANDOM = 8
# Characters Go's URL parser reads as more than a path's (`endpoint_problem`).
_URL_SPECIAL = frozenset("%?#")
_STALE_STAGING_S = 60.0

R = TypeVar("R")
C = TypeVar("C", ClaimRef, Claim)


# --- Plain types shared with the device layer -------------------------------------


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet hands it to the runtime."""

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    # Sent only to kubelets speaking DRA v1; older versions have no such field.
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """Outcome for one claim; a non-empty `error` fails that claim alone."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str | None = None


class ClaimHandler(Protocol):
    """What the protocol layer needs from the device layer.

    Both methods get the claims of one kubelet call (one pod) and return results
    keyed by claim UID; `prepare` gets only claims that were read and checked. They
    must be idempotent: the kubelet retries, and when a call raises, each claim is
    retried alone so one bad claim cannot fail the others.
    """

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]: ...

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        """Map each claim UID to None on success or to an error message."""
        ...


class ClaimSource(Protocol):
    """Where the claims the kubelet names are read and checked (the API server)."""

    async def read(self, ref: ClaimRef) -> Claim:
        """The claim, checked; raises ClaimError with the message for the kubelet."""
        ...


class CallMetrics(Protocol):
    """Told of every claim the plugin answers, with the time its call took."""

    def observe(self, operation: str, seconds: float, *, failed: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """Health of one device; `healthy` None means it cannot be determined."""

    pool_name: str
    device_name: str
    healthy: bool | None
    updated_at: float  # unix time, seconds
    message: str = ""
    # Zero lets the kubelet use its default timeout for this device.
    health_check_timeout_s: int = 0


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """The complete device list at one generation; generations only grow."""

    generation: int
    devices: tuple[DeviceHealth, ...]


class HealthSource(Protocol):
    """Where the health stream reads from.

    A generation number instead of a bare "changed" signal means a change that lands
    between reading the list and starting to wait is never missed.
    """

    def snapshot(self) -> HealthSnapshot: ...

    async def wait_for_change(self, generation: int) -> None:
        """Return once the current generation differs from `generation`."""
        ...


class HealthBoard:
    """In-memory `HealthSource`: a health checker publishes, kubelet streams read.

    Call `publish` from the event loop thread (from a worker thread, go through
    `anyio.from_thread.run_sync`).
    """

    def __init__(self, devices: Iterable[DeviceHealth] = ()) -> None:
        self._snapshot = HealthSnapshot(0, tuple(devices))
        self._changed: anyio.Event | None = None

    def snapshot(self) -> HealthSnapshot:
        return self._snapshot

    def publish(self, devices: Iterable[DeviceHealth]) -> None:
        """Replace the whole list; an identical list wakes nobody."""
        new = tuple(devices)
        if new == self._snapshot.devices:
            return
        self._snapshot = HealthSnapshot(self._snapshot.generation + 1, new)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_for_change(self, generation: int) -> None:
        while self._snapshot.generation == generation:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()


# --- Socket handling ----------------------------------------------------------------


def kubelet_root_path(kubelet_root: Path) -> Path:
    """`kubelet_root` made absolute, with one leading slash.

    pathlib keeps a leading `//` (POSIX lets it mean something other than `/`; Linux
    reads it as `/`), but the kubelet reads the endpoint a plugin advertises as a URL,
    `unix:` + endpoint, where `//var/lib/...` names the host `var`: the same folder with
    one slash is the endpoint it can dial."""
    text = str(Path(kubelet_root).absolute())
    if text.startswith("//"):
        text = "/" + text.lstrip("/")
    return Path(text)


def plugin_sockets(kubelet_root: Path, driver_name: str, pod_uid: str | None) -> tuple[Path, Path]:
    """The plugin's registration socket and its DRA socket, the endpoint it advertises.

    Under a pod UID each name carries it (`_socket_suffix`), so that the agent of a
    rolling update serves beside the old one."""
    root = kubelet_root_path(kubelet_root)
    suffix = _socket_suffix(root, driver_name, pod_uid)
    return (
        root / "plugins_registry" / f"{driver_name}{suffix}-reg.sock",
        root / "plugins" / driver_name / f"dra{suffix}.sock",
    )


def _socket_suffix(kubelet_root: Path, driver_name: str, pod_uid: str | None) -> str:
    """`-<pod UID>`, or `-<12 hex digits of its SHA-256>` where the full UID would push
    the registration socket past the unix path limit (a long kubelet root): old and
    new pods of a rolling update still get different names."""
    if not pod_uid:
        return ""
    full = kubelet_root / "plugins_registry" / f"{driver_name}-{pod_uid}-reg.sock"
    if len(os.fsencode(full)) <= _MAX_UNIX_PATH:
        return f"-{pod_uid}"
    return "-" + hashlib.sha256(pod_uid.encode()).hexdigest()[:12]


def endpoint_problem(endpoint: str) -> str | None:
    """Why the kubelet would refuse `endpoint` as a DRA plugin's, or None.

    The kubelet of 1.38 checks the endpoint a plugin advertises before it registers
    the plugin (`validateEndpoint` in `pkg/kubelet/cm/dra/plugin`): absolute, shorter
    than sun_path's 108 bytes with its NUL, and a plain path. It dials `unix:` +
    endpoint through Go's URL parser, which reads `%2e` as `.`, a `?` as a query, a `#`
    as a fragment and a leading `//` as a host, and refuses control characters; the
    endpoint must come out of that parser unchanged. Earlier kubelets register such an
    endpoint and then cannot dial it, or dial another path, so that every prepare
    fails. Checked against that function's own code on every ASCII character and some
    others.
    """
    if not endpoint:
        return "is empty"
    if not endpoint.startswith("/"):
        return "is not an absolute path"
    if problem := _length_problem(endpoint):
        return problem
    if endpoint.startswith("//"):
        return "begins with //, which the kubelet would read as a host name"
    for char in endpoint:
        if char in _URL_SPECIAL:
            return f"holds {char!r}, which the kubelet's URL parser would not read as a path"
        if ord(char) < 0x20 or ord(char) == 0x7F:
            return f"holds the control character {char!r}"
    return None


def plugin_socket_problem(kubelet_root: Path, driver_name: str, pod_uid: str | None) -> str | None:
    """Why the plugin could not serve its sockets under `kubelet_root`, or None.

    Each socket is bound in a folder beside it before it is moved into place
    (`_bind_private`), so that path must fit a unix socket path too; the DRA socket is
    also the endpoint the kubelet dials (`endpoint_problem`). `gpudra node` checks its
    flags with it before anything starts, and the plugin again at its start."""
    registration, dra = plugin_sockets(kubelet_root, driver_name, pod_uid)
    for what, socket in (("registration", registration), ("DRA", dra)):
        bound_in = socket.parent / f"{_STAGING_PREFIX}{'x' * _STAGING_RANDOM}" / "s"
        size = max(len(os.fsencode(socket)), len(os.fsencode(bound_in)))
        if size > _MAX_UNIX_PATH:
            return (
                f"the {what} socket {socket} needs {size} bytes of socket path (it is "
                f"bound in a folder beside it first), over {_MAX_UNIX_PATH}, the unix "
                "socket limit"
            )
    if problem := endpoint_problem(str(dra)):
        return f"the DRA socket {dra}, the endpoint the kubelet dials, {problem}"
    return None


def _length_problem(path: str | Path) -> str | None:
    """Why `path` is too long for a unix socket, or None."""
    size = len(os.fsencode(path))
    if size > _MAX_UNIX_PATH:
        return f"is {size} bytes, longer than {_MAX_UNIX_PATH}, the unix socket limit"
    return None


def _check_socket_path(path: Path, what: str) -> None:
    if problem := _length_problem(path):
        msg = f"{what} socket path {path} {problem}; use a shorter kubelet root or driver name"
        raise ValueError(msg)


def _bind_private(server: Any, path: Path) -> tuple[tuple[int, int], Path]:
    """Bind `server` to `path` so that the socket is owner-only from its first moment.

    gRPC binds with the process umask; rather than change the process-wide umask
    (which would race with other threads creating files), bind inside a fresh 0700
    directory, chmod there, then rename into place. The rename also atomically
    replaces a stale socket left by an earlier run. Returns the socket's (dev, inode),
    so that `stop` removes only its own socket, and the directory.

    The directory stays, empty, until `stop` removes it: the kubelet's watcher of
    plugins_registry stats each new entry when its event comes, skips a name starting
    with "." only once that stat succeeds, and logs an error for one already gone. One
    that a killed agent left is removed at the next start (`_remove_stale_staging`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(path.parent)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=path.parent))
    temp = staging / "s"
    bound = False
    try:
        _check_socket_path(temp, "staging")
        if server.add_insecure_port(f"unix://{temp}") == 0:
            msg = f"gRPC could not bind unix socket {temp}"
            raise OSError(msg)
        temp.chmod(_SOCKET_MODE)
        temp.replace(path)
        st = path.stat()
        bound = True
    finally:
        if not bound:
            temp.unlink(missing_ok=True)
            staging.rmdir()
    return (st.st_dev, st.st_ino), staging


def _remove_stale_staging(folder: Path) -> None:
    """Remove the staging directories in `folder` that no bind is using: those older
    than `_STALE_STAGING_S`, left by an agent killed before its stop, with the socket a
    kill between its bind and its rename left inside (which the kubelet would try to
    register after its own restart: its walk of plugins_registry descends into every
    directory). Another agent's, in a rolling update, is either that old and empty, or
    new and left alone."""
    now = time.time()
    for staging in folder.glob(f"{_STAGING_PREFIX}*"):
        try:
            if staging.is_symlink() or not staging.is_dir():
                continue
            if now - staging.stat().st_mtime < _STALE_STAGING_S:
                continue
            (staging / "s").unlink(missing_ok=True)
            staging.rmdir()
        except OSError as exc:
            log.warning(
                "could not remove a stale socket staging folder",
                extra={"fields": {"folder": str(staging), "error": str(exc)}},
            )
            continue
        log.info(
            "removed a stale socket staging folder", extra={"fields": {"folder": str(staging)}}
        )


def _remove_own_socket(path: Path, identity: tuple[int, int]) -> None:
    """Unlink `path` unless another instance has replaced it since we bound it."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        path.unlink(missing_ok=True)
    else:
        log.info(
            "socket replaced by another instance; leaving it",
            extra={"fields": {"socket": str(path)}},
        )


# --- Claim dispatch -----------------------------------------------------------------


def _claim_refs(claims: Iterable[Any]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]


async def _answer_each(
    op: str,
    claims: list[C],
    call: Callable[[list[C]], Awaitable[Mapping[str, R]]],
    failed: Callable[[str], R],
) -> dict[str, R]:
    """Call the handler for the batch and make sure every claim gets exactly one answer.

    If the batch call raises, each claim is retried alone, so the exception stays
    with the claim that caused it. Claims the handler left out become errors (the
    kubelet would otherwise fail them with a vaguer message), and answers for UIDs
    that were not asked about are dropped (the kubelet rejects them).
    """
    answered: dict[str, R] = {}
    try:
        answered = dict(await call(list(claims)))
    except Exception as exc:
        log.exception(
            "claim handler failed for the batch",
            extra={"fields": {"op": op, "claims": [c.uid for c in claims]}},
        )
        if len(claims) == 1:
            answered = {claims[0].uid: failed(f"{op} failed: {exception_text(exc)}")}
        else:
            answered = {}
            for claim in claims:
                try:
                    one = await call([claim])
                except Exception as one_exc:
                    log.exception(
                        "claim handler failed for a claim",
                        extra={"fields": {"op": op, "claim": claim.uid}},
                    )
                    answered[claim.uid] = failed(f"{op} failed: {exception_text(one_exc)}")
                else:
                    if claim.uid in one:
                        answered[claim.uid] = one[claim.uid]
    wanted = {c.uid for c in claims}
    extra = sorted(set(answered) - wanted)
    if extra:
        log.warning(
            "claim handler answered claims that were not asked for; dropping them",
            extra={"fields": {"op": op, "uids": extra}},
        )
    result: dict[str, R] = {}
    for claim in claims:
        if claim.uid in answered:
            result[claim.uid] = answered[claim.uid]
        else:
            log.error(
                "claim handler gave no answer for a claim",
                extra={"fields": {"op": op, "claim": claim.uid}},
            )
            result[claim.uid] = failed(f"{op}: the driver returned no result for this claim")
    return result


def _prepare_failed(message: str) -> PrepareResult:
    return PrepareResult(error=message)


def _unprepare_failed(message: str) -> str | None:
    return message


class ClaimDispatcher:
    """What both DRA versions do with the claims of a call, without the sockets.

    Prepare reads and checks each claim first (as the upstream library does), answers
    the ones that fail with their error and hands the rest to the handler; every
    claim gets exactly one answer, and `metrics` hears of each with its call's time.
    """

    def __init__(
        self, handler: ClaimHandler, claims: ClaimSource, metrics: CallMetrics | None = None
    ) -> None:
        self._handler = handler
        self._claims = claims
        self._metrics = metrics

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        started = time.perf_counter()
        unread: dict[str, PrepareResult] = {}
        read: list[Claim] = []

        async def read_one(ref: ClaimRef) -> None:
            try:
                read.append(await self._claims.read(ref))
            except ClaimError as exc:
                unread[ref.uid] = _prepare_failed(str(exc))
            except Exception as exc:
                log.exception("reading a claim failed", extra={"fields": {"claim": ref.uid}})
                unread[ref.uid] = _prepare_failed(f"prepare failed: {exception_text(exc)}")

        if len(refs) == 1:
            await read_one(refs[0])
        else:
            async with anyio.create_task_group() as group:
                for ref in refs:
                    group.start_soon(read_one, ref)
        for uid, result in unread.items():
            log.warning(
                "claim not prepared", extra={"fields": {"claim": uid, "error": result.error}}
            )
        answered: dict[str, PrepareResult] = {}
        if read:
            order = {ref.uid: i for i, ref in enumerate(refs)}
            read.sort(key=lambda c: order[c.uid])
            answered = await _answer_each("prepare", read, self._handler.prepare, _prepare_failed)
        results = {r.uid: unread[r.uid] if r.uid in unread else answered[r.uid] for r in refs}
        self._observe("prepare", started, [bool(r.error) for r in results.values()])
        return results

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str | None]:
        started = time.perf_counter()
        results = await _answer_each("unprepare", refs, self._handler.unprepare, _unprepare_failed)
        self._observe("unprepare", started, [bool(e) for e in results.values()])
        return results

    def _observe(self, operation: str, started: float, failed: list[bool]) -> None:
        if self._metrics is None:
            return
        seconds = time.perf_counter() - started
        for one in failed:
            self._metrics.observe(operation, seconds, failed=one)


class _CallsInFlight:
    """The claim work of the DRA calls, owned by the plugin rather than by each call.

    grpc.aio cancels a call's handler with a plain asyncio cancel when the kubelet's
    deadline passes or it hangs up, and anyio's shields do not hold against that: the
    work would stop at whatever it was waiting for while its worker threads (a
    checkpoint write, a tool run) go on, its claim's lock released and its checkpoint
    change neither known durable nor undone. So each call's work runs as a task of its
    own, which the call awaits through `asyncio.wait` (which cancels nothing it waits
    for): the kubelet gets its answer or its deadline error, and the work finishes in
    order under its locks. The kubelet's retry waits for the claim's lock and is
    answered from the record. `wait` lets `stop` finish them. An unprepare can outlast
    the kubelet's 45 s too: its own steps run to their bounds (each tool run gets 30 s,
    a daemon's stop more), or it waits for a prepare of the claim that a restarted
    kubelet left under way. (The kubelet does not cut the prepare call of a pod deleted
    meanwhile: it unprepares after that call's answer, so such an unprepare waits only
    for what is left of the prepare.)

    A prepare that fails after its caller left would be news nobody hears: the retry
    would try again, meet the same slow failure (an MPS daemon pod that never starts
    gets 60 s, the kubelet's call 45) and the pod's events would say only `context
    deadline exceeded`, call after call. So such a failure is kept, per claim, for the
    claim's next prepare call, which first waits for the work still under way and then
    answers with it instead of trying again (the call after that tries again). A kept
    failure goes with the claim's unprepare, or after `keep_s`.

    Nor does a call wait for its deadline: given `answer_within` (the caller's time
    less `ANSWER_MARGIN_S`), a prepare still under way then is answered, each claim
    with `STILL_UNDER_WAY` (or `NOT_BEGUN`), as if its caller had left, so that the pod's
    first event says the driver is still at it rather than `context deadline
    exceeded`, and the retry gets the outcome. An unprepare is answered so too, each
    claim with `UNPREPARE_UNDER_WAY`: the kubelet logs that rather than the deadline, and
    its retry queues behind the work on the claim's lock, finding it done (or trying
    again where it failed; an unprepare's failure needs no keeping).
    """

    def __init__(
        self,
        keep_s: float = UNHEARD_FAILURE_KEEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keep_s = keep_s
        self._clock = clock
        # Prepares whose caller left before they ended, by claim UID.
        self._left: dict[str, asyncio.Task[dict[str, PrepareResult]]] = {}
        # What such a prepare came to where it failed: when it ended, its answer.
        self._unheard: dict[str, tuple[float, PrepareResult]] = {}

    async def prepare(
        self,
        refs: list[ClaimRef],
        work: Callable[[list[ClaimRef]], Coroutine[Any, Any, dict[str, PrepareResult]]],
        *,
        answer_within: float | None = None,
    ) -> dict[str, PrepareResult]:
        """`work(refs)` as `run` does it, where no failure of an earlier call's work is
        kept for a claim; the claims that have one are answered with it. Where the
        call (the wait for an earlier call's work included) lasts `answer_within`
        seconds, it is answered at once (`_unanswered`): `STILL_UNDER_WAY` for a claim
        whose work is under way, `NOT_BEGUN` for one whose work waited behind it."""
        loop = asyncio.get_running_loop()
        until = None if answer_within is None else loop.time() + answer_within
        earlier = {task for ref in refs if (task := self._left.get(ref.uid)) is not None}
        if earlier:
            _, pending = await asyncio.wait(earlier, timeout=_left_of(until, loop))
            if pending:
                # Their outcome is kept for the next call already; the other claims'
                # work has not begun, and that call begins it.
                return _unanswered(refs, {u for u, t in self._left.items() if t in pending})
        heard = self._take_unheard(refs)
        rest = [ref for ref in refs if ref.uid not in heard]
        if not rest:
            return heard
        task = self._start(work(rest))
        try:
            # Neither the caller's cancel nor the timeout stops the work: `wait`
            # cancels nothing it waits for.
            done, _ = await asyncio.wait({task}, timeout=_left_of(until, loop))
        except asyncio.CancelledError:
            self._caller_left(task, [ref.uid for ref in rest])
            raise
        if not done:
            self._caller_left(task, [ref.uid for ref in rest])
            return {**_unanswered(rest, {ref.uid for ref in rest}), **heard}
        return {**task.result(), **heard}

    async def unprepare(
        self,
        refs: list[ClaimRef],
        work: Callable[[list[ClaimRef]], Coroutine[Any, Any, dict[str, str | None]]],
        *,
        answer_within: float | None = None,
    ) -> dict[str, str | None]:
        """`work(refs)`, answered `UNPREPARE_UNDER_WAY` for each claim where it lasts
        `answer_within` seconds. Once the work has ended, a prepare failure kept for
        the claims is dropped: it is no news to a later prepare of theirs. Only then,
        not when the call is answered: the work ends after the claim's lock let it in,
        so after any prepare of the claim an earlier call left, whose failure would
        otherwise be kept after the claim was unprepared."""
        task = self._start(work(refs))
        task.add_done_callback(lambda _: self._forget(refs))
        # Neither the caller's cancel nor the timeout stops the work (as in `prepare`).
        done, _ = await asyncio.wait({task}, timeout=answer_within)
        if not done:
            return {ref.uid: f"{ref.describe()}: {UNPREPARE_UNDER_WAY}" for ref in refs}
        return task.result()

    def _forget(self, refs: Iterable[ClaimRef]) -> None:
        for ref in refs:
            self._unheard.pop(ref.uid, None)

    async def wait(self) -> None:
        """Until every call's work has finished (its caller may be long gone)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def _start(self, work: Coroutine[Any, Any, R]) -> asyncio.Task[R]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _caller_left(self, task: asyncio.Task[dict[str, PrepareResult]], uids: list[str]) -> None:
        for uid in uids:
            self._left[uid] = task

        def ended(done: asyncio.Task[dict[str, PrepareResult]]) -> None:
            for uid in uids:
                if self._left.get(uid) is done:
                    del self._left[uid]
            if done.cancelled() or done.exception() is not None:
                return  # the dispatcher answers every claim; only a stop ends it so
            now = self._clock()
            for uid, result in done.result().items():  # only the claims it was asked
                if result.error:
                    self._unheard[uid] = (now, result)

        task.add_done_callback(ended)

    def _take_unheard(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        now = self._clock()
        for uid in [u for u, (at, _) in self._unheard.items() if now - at > self._keep_s]:
            del self._unheard[uid]
        heard: dict[str, PrepareResult] = {}
        for ref in refs:
            kept = self._unheard.pop(ref.uid, None)
            if kept is None:
                continue
            log.info(
                "prepare answered with the failure of the work an earlier call left",
                extra={"fields": {"claim": ref.uid, "error": kept[1].error}},
            )
            heard[ref.uid] = PrepareResult(error=f"{kept[1].error} ({UNHEARD_FAILURE_NOTE})")
        return heard


def _conversion_failed(op: str, uid: str, exc: Exception) -> str:
    log.exception(
        "claim result could not be encoded",
        extra={"fields": {"op": op, "claim": uid}},
    )
    return f"{op}: the driver returned an invalid result: {exception_text(exc)}"


def _left_of(until: float | None, loop: asyncio.AbstractEventLoop) -> float | None:
    """Seconds to `until` on `loop`'s clock (None: no bound)."""
    return None if until is None else max(0.0, until - loop.time())


def _unanswered(refs: Iterable[ClaimRef], under_way: set[str]) -> dict[str, PrepareResult]:
    """The answer for claims whose call ran out of time: `STILL_UNDER_WAY` for those
    whose work is `under_way`, `NOT_BEGUN` for the others."""
    return {
        ref.uid: PrepareResult(
            error=f"{ref.describe()}: {STILL_UNDER_WAY if ref.uid in under_way else NOT_BEGUN}"
        )
        for ref in refs
    }


def _answer_within(remaining: float | None) -> float | None:
    """How long a call may wait for its work: up to `ANSWER_MARGIN_S` before its
    caller's deadline. None, to wait for the deadline itself, where the call has none
    or too little time for the margin to leave any (its caller then gets its deadline
    error, as before)."""
    if remaining is None or remaining <= 2 * ANSWER_MARGIN_S:
        return None
    return remaining - ANSWER_MARGIN_S


class _DraServicer:
    """Serves one DRA API version. v1 and v1beta1 carry the same messages in different
    protobuf packages; only v1 has `share_id`."""

    def __init__(
        self,
        dispatcher: ClaimDispatcher,
        messages: ModuleType,
        *,
        share_id: bool,
        calls: _CallsInFlight,
    ) -> None:
        self._dispatcher = dispatcher
        self._pb = messages
        self._share_id = share_id
        self._calls = calls

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        results = await self._calls.prepare(
            _claim_refs(request.claims),
            self._dispatcher.prepare,
            answer_within=_answer_within(context.time_remaining()),
        )
        response = self._pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            try:
                entry.CopyFrom(self._claim_response(result))
            except Exception as exc:
                entry.Clear()
                entry.error = _conversion_failed("prepare", uid, exc)
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        results = await self._calls.unprepare(
            _claim_refs(request.claims),
            self._dispatcher.unprepare,
            answer_within=_answer_within(context.time_remaining()),
        )
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            entry = response.claims[uid]
            try:
                entry.error = error or ""
            except Exception as exc:
                entry.error = _conversion_failed("unprepare", uid, exc)
        return response

    def _claim_response(self, result: PrepareResult) -> Any:
        if result.error:
            return self._pb.NodePrepareResourceResponse(error=result.error)
        out = self._pb.NodePrepareResourceResponse()
        for device in result.devices:
            msg = out.devices.add(
                request_names=device.request_names,
                pool_name=device.pool_name,
                device_name=device.device_name,
                cdi_device_ids=device.cdi_device_ids,
            )
            if self._share_id and device.share_id is not None:
                msg.share_id = device.share_id
        return out


# --- Health -------------------------------------------------------------------------


def _truncate_message(message: str) -> str:
    """At most `MAX_HEALTH_MESSAGE` bytes of UTF-8, cut between characters. The kubelet
    counts bytes, as Go's `len` does, and would cut a longer message mid-character."""
    data = message.encode()
    if len(data) <= MAX_HEALTH_MESSAGE:
        return message
    return data[: MAX_HEALTH_MESSAGE - 3].decode(errors="ignore") + "..."


def health_response(devices: Iterable[DeviceHealth], messages: ModuleType) -> Any:
    """Encode a complete device list as one NodeWatchResources message of the health
    API whose generated module is `messages` (v1 and v1alpha1 carry the same messages
    in different protobuf packages)."""
    out = messages.NodeWatchResourcesResponse()
    for device in devices:
        if device.healthy is None:
            health = messages.UNKNOWN
        elif device.healthy:
            health = messages.HEALTHY
        else:
            health = messages.UNHEALTHY
        out.devices.add(
            device=messages.DeviceIdentifier(
                pool_name=device.pool_name, device_name=device.device_name
            ),
            health=health,
            last_updated_time=int(device.updated_at),
            health_check_timeout_seconds=device.health_check_timeout_s,
            message=_truncate_message(device.message),
        )
    return out


class _Health:
    """Serves one health API (`api`, one of HEALTH_APIS). Streams the device list on
    every change and again every `refresh_s` without one.

    The kubelet stamps each device with the time it heard of it and reads it as Unknown
    once that is older than the device's timeout (30 s by default, fixed on 1.34), with
    no notice to the pods: a pod started a minute after the last change would show its
    GPU Unknown for good. Resending the unchanged list keeps the stamps fresh; the
    kubelet treats an unchanged device as no news, so this costs no pod updates.
    """

    def __init__(
        self,
        source: HealthSource,
        streams: set[anyio.CancelScope],
        refresh_s: float,
        api: str,
    ) -> None:
        self._source = source
        self._streams = streams
        self._refresh_s = refresh_s
        self._api = api
        self._pb = HEALTH_MODULES[api][0]

    async def NodeWatchResources(self, request: Any, context: Any) -> None:
        # Which API the kubelet chose shows here only: a kubelet that found none it
        # knows among the advertised ones opens no stream, and says nothing of it.
        log.info("kubelet opened a health stream", extra={"fields": {"api": self._api}})
        # The scope lets `stop` end open streams cleanly instead of waiting out the
        # server's grace period on a stream that never finishes by itself.
        with anyio.CancelScope() as scope:
            self._streams.add(scope)
            try:
                while True:
                    snapshot = self._source.snapshot()
                    await context.write(health_response(snapshot.devices, self._pb))
                    with anyio.move_on_after(self._refresh_s):
                        await self._source.wait_for_change(snapshot.generation)
            finally:
                self._streams.discard(scope)


# --- Registration -------------------------------------------------------------------


class _Registration(pluginregistration_v1_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin: KubeletPlugin) -> None:
        self._plugin = plugin

    async def GetInfo(
        self, request: pluginregistration_v1_pb2.InfoRequest, context: Any
    ) -> pluginregistration_v1_pb2.PluginInfo:
        plugin = self._plugin
        return pluginregistration_v1_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=plugin.driver_name,
            endpoint=str(plugin.dra_socket),
            supported_versions=list(plugin.supported_versions),
        )

    async def NotifyRegistrationStatus(
        self, request: pluginregistration_v1_pb2.RegistrationStatus, context: Any
    ) -> pluginregistration_v1_pb2.RegistrationStatusResponse:
        self._plugin._registration_status(request.plugin_registered, request.error)
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


# --- The plugin ---------------------------------------------------------------------


def _add(add_to_server: Callable[[Any, Any], None], servicer: object, server: Any) -> None:
    """Call a generated `add_*_to_server`; they are untyped, this gives them a type."""
    add_to_server(servicer, server)


class KubeletPlugin:
    """Serves the kubelet plugin protocols for one driver on one node.

    Claims to prepare are read and checked through `claims` before `handler` gets
    them; `metrics` hears of every claim answered. `start` serves the DRA socket
    first and the registration socket last, so that by the time the kubelet sees
    the plugin, the endpoint it advertises answers.
    `stop` does the reverse. With `pod_uid`, socket names include it, which lets an
    old and a new plugin pod run side by side during a rolling update.
    """

    def __init__(
        self,
        driver_name: str,
        handler: ClaimHandler,
        *,
        claims: ClaimSource,
        metrics: CallMetrics | None = None,
        kubelet_root: Path = DEFAULT_KUBELET_ROOT,
        pod_uid: str | None = None,
        health: HealthSource | None = None,
        stop_grace_s: float = 5.0,
        dra_apis: Sequence[str] = DRA_APIS,
        health_refresh_s: float = HEALTH_REFRESH_S,
    ) -> None:
        for name, value in (("driver_name", driver_name), ("pod_uid", pod_uid)):
            if value is not None and (not value or "/" in value or value.startswith(".")):
                msg = (
                    f"{name} {value!r} must be a non-empty file name part (no '/', no leading '.')"
                )
                raise ValueError(msg)
        self.driver_name = driver_name
        self.kubelet_root = kubelet_root_path(kubelet_root)
        self.pod_uid = pod_uid
        self._dispatcher = ClaimDispatcher(handler, claims, metrics)
        self._calls = _CallsInFlight()
        self._health = health
        if health_refresh_s <= 0:
            msg = f"health_refresh_s {health_refresh_s!r} must be positive (seconds)"
            raise ValueError(msg)
        self._health_refresh_s = health_refresh_s
        self._stop_grace_s = stop_grace_s
        self.registration_socket, self.dra_socket = plugin_sockets(
            self.kubelet_root, driver_name, pod_uid
        )
        unknown = [a for a in dra_apis if a not in DRA_APIS]
        if unknown or not dra_apis:
            msg = f"dra_apis {list(dra_apis)!r}: give one or more of {list(DRA_APIS)}"
            raise ValueError(msg)
        # Offered (and served) in our order of preference, v1 first: the kubelet takes
        # the first it knows. Serving only some lets a test hold each release's kubelet
        # to each API it still speaks.
        versions = [a for a in DRA_APIS if a in dra_apis]
        if health is not None:
            versions.extend(HEALTH_APIS)
        self.supported_versions: tuple[str, ...] = tuple(versions)
        self._registered: anyio.Event | None = None
        self.registration_error: str | None = None
        self._health_streams: set[anyio.CancelScope] = set()
        # (server, socket path, socket identity), in start order.
        self._serving: list[tuple[Any, Path, tuple[int, int], Path]] = []

    @property
    def registered(self) -> anyio.Event:
        """Set once the kubelet reports a successful registration (after `start`)."""
        if self._registered is None:
            msg = "KubeletPlugin.registered is available only after start()"
            raise RuntimeError(msg)
        return self._registered

    def _registration_status(self, ok: bool, error: str) -> None:
        fields = {"driver": self.driver_name, "registered": ok, "error": error}
        if ok:
            self.registration_error = None
            log.info("kubelet registered the plugin", extra={"fields": fields})
            if self._registered is not None:
                self._registered.set()
        else:
            self.registration_error = error or "kubelet refused the registration"
            log.error("kubelet refused the plugin registration", extra={"fields": fields})

    async def start(self) -> None:
        if self._serving:
            msg = "KubeletPlugin is already started"
            raise RuntimeError(msg)
        if problem := plugin_socket_problem(self.kubelet_root, self.driver_name, self.pod_uid):
            msg = f"kubelet root {self.kubelet_root}: {problem}"
            raise ValueError(msg)
        self._registered = anyio.Event()
        self.registration_error = None
        try:
            dra = grpc.aio.server()
            if DRA_V1 in self.supported_versions:
                _add(
                    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server,
                    _DraServicer(self._dispatcher, dra_v1_pb2, share_id=True, calls=self._calls),
                    dra,
                )
            if DRA_V1BETA1 in self.supported_versions:
                _add(
                    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server,
                    _DraServicer(
                        self._dispatcher, dra_v1beta1_pb2, share_id=False, calls=self._calls
                    ),
                    dra,
                )
            if self._health is not None:
                for api in HEALTH_APIS:
                    _add(
                        HEALTH_MODULES[api][1].add_DRAResourceHealthServicer_to_server,
                        _Health(self._health, self._health_streams, self._health_refresh_s, api),
                        dra,
                    )
            await self._serve(dra, self.dra_socket)
            registration = grpc.aio.server()
            _add(
                pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server,
                _Registration(self),
                registration,
            )
            await self._serve(registration, self.registration_socket)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kubelet plugin serving",
            extra={
                "fields": {
                    "driver": self.driver_name,
                    "registration_socket": str(self.registration_socket),
                    "dra_socket": str(self.dra_socket),
                    "versions": list(self.supported_versions),
                }
            },
        )

    async def _serve(self, server: Any, path: Path) -> None:
        identity, staging = _bind_private(server, path)
        self._serving.append((server, path, identity, staging))
        await server.start()

    async def stop(self) -> None:
        """Deregister first (remove the registration socket), then drain DRA calls;
        the work of calls cut off by the grace period still finishes before this
        returns, so no prepare stops half-way at shutdown."""
        with anyio.CancelScope(shield=True):
            for scope in list(self._health_streams):
                scope.cancel()
            while self._serving:
                server, path, identity, staging = self._serving.pop()
                _remove_own_socket(path, identity)
                with contextlib.suppress(OSError):
                    staging.rmdir()
                await server.stop(self._stop_grace_s)
            await self._calls.wait()
        log.info("kubelet plugin stopped", extra={"fields": {"driver": self.driver_name}})

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
