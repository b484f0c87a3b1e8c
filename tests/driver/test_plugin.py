"""The kubelet plugin protocol layer over real unix sockets and real gRPC."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import socket
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
from gpudra.driver.claims import AllocatedDevice, Claim, ClaimError
from gpudra.driver.metrics import ClaimMetrics
from gpudra.driver.plugin import (
    ANSWER_MARGIN_S,
    DRA_V1,
    DRA_V1BETA1,
    HEALTH_V1,
    HEALTH_V1ALPHA1,
    NOT_BEGUN,
    STILL_UNDER_WAY,
    UNHEARD_FAILURE_NOTE,
    UNPREPARE_UNDER_WAY,
    ClaimRef,
    DeviceHealth,
    HealthBoard,
    KubeletPlugin,
    PreparedDevice,
    PrepareResult,
    _answer_within,
    _CallsInFlight,
    endpoint_problem,
)
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
from prometheus_client import CollectorRegistry

from e2e.kubelet_standin import KubeletStandin

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
DRIVER = "gpu.nvidia.com"
# Generous bound so a broken test fails instead of hanging; not a speed assertion.
WAIT_S = 20


class RecordingHandler:
    """A device layer that records what reached it and answers predictably."""

    def __init__(
        self,
        *,
        fail: frozenset[str] = frozenset(),
        skip: frozenset[str] = frozenset(),
        extra: dict[str, PrepareResult] | None = None,
        errors: dict[str, str] | None = None,
    ) -> None:
        self.fail = fail
        self.skip = skip
        self.extra = extra or {}
        self.errors = errors or {}
        self.prepare_calls: list[list[ClaimRef]] = []
        self.unprepare_calls: list[list[ClaimRef]] = []

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]:
        self.prepare_calls.append([c.ref for c in claims])
        for claim in claims:
            if claim.uid in self.fail:
                raise RuntimeError(f"cannot prepare {claim.name}")
        out = {c.uid: self.result(c.ref) for c in claims if c.uid not in self.skip}
        out.update(self.extra)
        return out

    def result(self, claim: ClaimRef) -> PrepareResult:
        if claim.uid in self.errors:
            return PrepareResult(error=self.errors[claim.uid])
        return PrepareResult(
            devices=[
                PreparedDevice(
                    request_names=["gpu"],
                    pool_name="node-a",
                    device_name=f"gpu-{claim.name}",
                    cdi_device_ids=[f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu"],
                    share_id=f"share-{claim.name}",
                ),
                PreparedDevice(
                    request_names=[],
                    pool_name="node-a",
                    device_name=f"mig-{claim.name}",
                    cdi_device_ids=[],
                ),
            ]
        )

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        self.unprepare_calls.append(list(claims))
        for claim in claims:
            if claim.uid in self.fail:
                raise RuntimeError(f"cannot unprepare {claim.name}")
        return {c.uid: self.errors.get(c.uid) for c in claims if c.uid not in self.skip}


class Allocated:
    """The API side: every claim reads as allocated one GPU, except those in `missing`
    (gone from the API) and `broken` (the read itself fails)."""

    def __init__(
        self, missing: frozenset[str] = frozenset(), broken: frozenset[str] = frozenset()
    ) -> None:
        self.missing = missing
        self.broken = broken

    async def read(self, ref: ClaimRef) -> Claim:
        if ref.uid in self.missing:
            raise ClaimError(f"{ref.describe()} does not exist in the API server")
        if ref.uid in self.broken:
            raise RuntimeError(f"reader bug for {ref.name}")
        return Claim(ref=ref, devices=(AllocatedDevice(index=0, request="gpu", device="gpu-0"),))


def claim(name: str) -> ClaimRef:
    return ClaimRef(namespace="default", uid=f"uid-{name}", name=name)


@pytest.fixture
def root(short_tmp: Path) -> Path:
    # Unix socket paths are limited to 107 bytes: keep the kubelet root short.
    return short_tmp


@asynccontextmanager
async def channel(path: Path) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
        yield ch


def stub(stub_class: Callable[[Any], Any], ch: Any) -> Any:
    return stub_class(ch)


async def get_info(plugin: KubeletPlugin) -> Any:
    async with channel(plugin.registration_socket) as ch:
        client = stub(pluginregistration_v1_pb2_grpc.RegistrationStub, ch)
        return await client.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=WAIT_S)


# --- registration ---------------------------------------------------------------------


async def test_get_info_advertises_driver_endpoint_and_versions_v1_first(root: Path) -> None:
    async with KubeletPlugin(
        DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root
    ) as plugin:
        info = await get_info(plugin)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(root / "plugins" / DRIVER / "dra.sock")
    assert Path(info.endpoint).is_absolute()
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert plugin.registration_socket == root / "plugins_registry" / f"{DRIVER}-reg.sock"


async def test_get_info_lists_health_service_only_with_a_health_source(root: Path) -> None:
    async with KubeletPlugin(
        DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root, health=HealthBoard()
    ) as plugin:
        info = await get_info(plugin)
    # Both health APIs, newest first, as upstream's plugin helper (v0.37) advertises
    # them: the kubelet of 1.37 opens no health stream where it finds neither.
    assert list(info.supported_versions) == [DRA_V1, DRA_V1BETA1, HEALTH_V1, HEALTH_V1ALPHA1]


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param((dra_health_v1_pb2, dra_health_v1_pb2_grpc), id="v1"),
        pytest.param((dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc), id="v1alpha1"),
    ],
)
async def test_health_service_is_not_served_without_a_health_source(
    root: Path, messages: tuple[Any, Any]
) -> None:
    pb, pb_grpc = messages
    async with (
        KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root) as plugin,
        channel(plugin.dra_socket) as ch,
    ):
        client = stub(pb_grpc.DRAResourceHealthStub, ch)
        call = client.NodeWatchResources(pb.NodeWatchResourcesRequest())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_kubelet_registration_sets_registered_and_picks_v1(root: Path) -> None:
    async with (
        KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root) as plugin,
        KubeletStandin(root) as kubelet,
    ):
        reg = await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        with anyio.fail_after(WAIT_S):
            await plugin.registered.wait()
    assert reg.dra_version == DRA_V1
    assert reg.endpoint == plugin.dra_socket
    assert plugin.registration_error is None


async def test_older_kubelet_picks_v1beta1(root: Path) -> None:
    async with (
        KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root),
        KubeletStandin(root, dra_versions=(DRA_V1BETA1,)) as kubelet,
    ):
        reg = await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
    assert reg.dra_version == DRA_V1BETA1


@pytest.mark.parametrize(
    ("offered", "unserved"),
    [
        (DRA_V1, dra_v1beta1_pb2_grpc.DRAPluginStub),
        (DRA_V1BETA1, dra_v1_pb2_grpc.DRAPluginStub),
    ],
)
async def test_one_dra_api_is_offered_and_served_alone(
    root: Path, offered: str, unserved: Callable[[Any], Any]
) -> None:
    """What a test of a release's kubelet relies on: the other API is not there to fall
    back on, so a working prepare proves the offered one works."""
    async with (
        KubeletPlugin(
            DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root, dra_apis=[offered]
        ) as plugin,
        KubeletStandin(root) as kubelet,
        channel(plugin.dra_socket) as ch,
    ):
        reg = await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        assert list((await get_info(plugin)).supported_versions) == [offered]
        request = dra_v1_pb2.NodeUnprepareResourcesRequest()
        if unserved is dra_v1beta1_pb2_grpc.DRAPluginStub:
            request = dra_v1beta1_pb2.NodeUnprepareResourcesRequest()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub(unserved, ch).NodeUnprepareResources(request)
    assert reg.dra_version == offered
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("apis", [[], ["v2.DRAPlugin"]])
def test_an_unknown_or_empty_dra_api_list_is_refused(root: Path, apis: list[str]) -> None:
    with pytest.raises(ValueError, match=r"dra_apis .*: give one or more of \['v1.DRAPlugin'"):
        KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), dra_apis=apis)


async def test_refused_registration_is_recorded(root: Path) -> None:
    async with (
        KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root) as plugin,
        KubeletStandin(root, dra_versions=("v2.DRAPlugin",)) as kubelet,
    ):
        rejection = await kubelet.wait_for_rejection(plugin.registration_socket, timeout_s=WAIT_S)
        assert plugin.registration_error == rejection.reason
        assert "v1.DRAPlugin" in rejection.reason
        assert not plugin.registered.is_set()


async def test_rolling_update_sockets_include_pod_uid_and_coexist(root: Path) -> None:
    handler = RecordingHandler()
    old = KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root, pod_uid="pod-old")
    new = KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root, pod_uid="pod-new")
    assert old.registration_socket == root / "plugins_registry" / f"{DRIVER}-pod-old-reg.sock"
    assert old.dra_socket == root / "plugins" / DRIVER / "dra-pod-old.sock"
    async with old, KubeletStandin(root) as kubelet:
        await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        async with new:
            assert (await get_info(new)).endpoint == str(new.dra_socket)
            assert (await get_info(old)).endpoint == str(old.dra_socket)
            await kubelet.wait_for_registration(new.registration_socket, timeout_s=WAIT_S)
            assert len(kubelet.registrations(DRIVER)) == 2
            # Like the kubelet, the newest registration serves the calls.
            assert kubelet.active(DRIVER).endpoint == new.dra_socket
            await old.stop()
            await kubelet.wait_for_deregistration(old.registration_socket, timeout_s=WAIT_S)
            assert kubelet.active(DRIVER).endpoint == new.dra_socket
            assert (await kubelet.prepare(DRIVER, [claim("a")]))["uid-a"].error is None
            assert new.registration_socket.exists()
            assert not old.registration_socket.exists()


def test_rolling_update_names_stay_under_the_socket_limit_with_a_long_kubelet_root() -> None:
    """A pod UID (36 characters) under a long kubelet root would pass the 107-byte
    unix path limit; a digest of it keeps the names short and still distinct."""
    long_root = Path("/" + "k" * 40) / "kubelet"
    uids = ("a464f592-31c6-49a5-b251-e04b7587c836", "0f2d7a1e-9c7b-4e57-8a5e-3b9d2f6c1a00")
    plugins = [
        KubeletPlugin(
            DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=long_root, pod_uid=u
        )
        for u in uids
    ]
    names = {p.registration_socket for p in plugins} | {p.dra_socket for p in plugins}
    assert len(names) == 4
    assert all(len(bytes(n)) <= 107 for n in names)
    assert all(uids[0] not in str(n) and uids[1] not in str(n) for n in names)
    # Where the full UID fits it is used as is.
    short = KubeletPlugin(
        DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=Path("/k"), pod_uid=uids[0]
    )
    assert short.registration_socket.name == f"{DRIVER}-{uids[0]}-reg.sock"


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock", None),
        ("/var/lib/kube let/plugins/x/dra.sock", None),
        ("/var/lib/kübelet/plugins/x/dra.sock", None),
        ("/" + "k" * 106, None),
        ("", "is empty"),
        ("var/lib/kubelet/dra.sock", "is not an absolute path"),
        ("/" + "k" * 107, "is 108 bytes, longer than 107, the unix socket limit"),
        ("//var/lib/kubelet/dra.sock", "begins with //"),
        ("/plugins/%2e%2e/run/evil.sock", "holds '%'"),
        ("/var/lib/kubelet?x/dra.sock", "holds '?'"),
        ("/var/lib/kubelet#x/dra.sock", "holds '#'"),
        ("/var/lib/kube\tlet/dra.sock", "holds the control character '\\t'"),
    ],
)
def test_an_endpoint_is_judged_as_the_kubelet_of_1_38_judges_it(
    endpoint: str, problem: str | None
) -> None:
    """The kubelet of 1.38 refuses to register a plugin whose endpoint is not a plain
    absolute path shorter than 108 bytes (`validateEndpoint`); these are cases of
    that function's own tests and of the characters Go's URL parser reads otherwise."""
    found = endpoint_problem(endpoint)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert found.startswith(problem), found


async def test_a_kubelet_root_with_two_leading_slashes_registers_with_one(root: Path) -> None:
    """`//var/lib/kubelet` is `/var/lib/kubelet` on Linux, but a URL's `//` starts a
    host name: advertised as given, the kubelet of 1.38 refuses the endpoint and older
    ones dial another path. The plugin advertises the folder with one slash."""
    doubled = Path("//" + str(root).lstrip("/"))
    assert str(doubled).startswith("//")
    async with (
        KubeletPlugin(
            DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=doubled
        ) as plugin,
        KubeletStandin(root) as kubelet,
    ):
        assert (await get_info(plugin)).endpoint == str(root / "plugins" / DRIVER / "dra.sock")
        await kubelet.wait_for_registration(plugin.registration_socket, timeout_s=WAIT_S)
        assert plugin.registration_error is None
        assert (await kubelet.prepare(DRIVER, [claim("a")]))["uid-a"].error is None


@pytest.mark.parametrize(
    ("part", "problem"),
    [
        ("kube%2elet", "the endpoint the kubelet dials, holds '%'"),
        ("kube?let", "the endpoint the kubelet dials, holds '?'"),
        ("k" * 80, "needs 1"),
    ],
)
async def test_a_kubelet_root_the_kubelet_could_not_dial_is_refused_at_start(
    root: Path, part: str, problem: str
) -> None:
    """Refused before any socket is served, naming the socket and why, rather than
    registered and then dialled at a path that is not the socket."""
    plugin = KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root / part)
    with pytest.raises(
        ValueError, match=f"kubelet root {re.escape(str(root / part))}: the "
    ) as exc:
        await plugin.start()
    assert problem in str(exc.value)
    assert not (root / part).exists()


# --- sockets --------------------------------------------------------------------------


async def test_sockets_are_owner_only(root: Path) -> None:
    async with KubeletPlugin(
        DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root
    ) as plugin:
        for path in (plugin.registration_socket, plugin.dra_socket):
            mode = path.stat().st_mode
            assert stat.S_ISSOCK(mode), path
            assert stat.S_IMODE(mode) == 0o600, (path, oct(mode))
        # Beside each socket, the empty owner-only folder it was bound in, hidden from
        # the kubelet's watcher by its leading dot, stays until the stop (`_bind_private`).
        for path in (plugin.registration_socket, plugin.dra_socket):
            (staging,) = [p for p in path.parent.iterdir() if p != path]
            assert staging.name.startswith(".gpudra-bind-"), staging
            assert stat.S_IMODE(staging.stat().st_mode) == 0o700
            assert list(staging.iterdir()) == []
    assert list(plugin.dra_socket.parent.iterdir()) == []
    assert list(plugin.registration_socket.parent.iterdir()) == []


async def test_a_killed_agents_staging_folders_go_at_the_next_start(root: Path) -> None:
    """An agent killed before its stop leaves its staging folders, one of them perhaps
    with a socket that the kubelet's walk of plugins_registry, at its own restart, would
    try to register. The next start removes them; a fresh one (another agent's bind in a
    rolling update) and other folders stay."""
    plugin = KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root)
    folder = plugin.registration_socket.parent
    folder.mkdir(parents=True)
    killed, fresh, other = (folder / n for n in (".gpudra-bind-x1", ".gpudra-bind-x2", ".x3"))
    for staging in (killed, fresh, other):
        staging.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(killed / "s"))
    an_hour_ago = time.time() - 3600
    for staging in (killed, other):
        os.utime(staging, (an_hour_ago, an_hour_ago))
    async with plugin:
        assert not killed.exists()
        assert fresh.is_dir() and other.is_dir()


async def test_stale_sockets_are_replaced(root: Path) -> None:
    plugin = KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root)
    plugin.dra_socket.parent.mkdir(parents=True)
    plugin.registration_socket.parent.mkdir(parents=True)
    # A socket file left by a crashed run: nothing listens on it any more.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(plugin.registration_socket))
    plugin.dra_socket.write_text("stale")
    async with plugin:
        info = await get_info(plugin)
        assert info.name == DRIVER
        assert stat.S_ISSOCK(plugin.dra_socket.stat().st_mode)
        assert "uid-a" in await prepare_v1(plugin, [claim("a")])


async def test_stop_removes_sockets(root: Path) -> None:
    plugin = KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root)
    await plugin.start()
    assert plugin.registration_socket.exists()
    assert plugin.dra_socket.exists()
    await plugin.stop()
    assert not plugin.registration_socket.exists()
    assert not plugin.dra_socket.exists()


async def test_stop_leaves_a_socket_that_another_instance_took_over(root: Path) -> None:
    first = KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root)
    second = KubeletPlugin(DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root)
    async with first, second:
        await first.stop()
        assert (await get_info(second)).name == DRIVER
        assert "uid-a" in await prepare_v1(second, [claim("a")])
    assert not second.registration_socket.exists()


async def test_too_long_socket_path_is_refused_with_the_fix(root: Path) -> None:
    plugin = KubeletPlugin(
        DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root / ("x" * 120)
    )
    with pytest.raises(ValueError, match="kubelet root"):
        await plugin.start()


# --- DRA calls ------------------------------------------------------------------------


async def prepare_v1(
    plugin: KubeletPlugin, claims: list[ClaimRef], deadline_s: float = WAIT_S
) -> dict[str, dra_v1_pb2.NodePrepareResourceResponse]:
    async with channel(plugin.dra_socket) as ch:
        client = stub(dra_v1_pb2_grpc.DRAPluginStub, ch)
        request = dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        response = await client.NodePrepareResources(request, timeout=deadline_s)
    return dict(response.claims)


async def unprepare_v1(
    plugin: KubeletPlugin, claims: list[ClaimRef], deadline_s: float = WAIT_S
) -> dict[str, str]:
    async with channel(plugin.dra_socket) as ch:
        client = stub(dra_v1_pb2_grpc.DRAPluginStub, ch)
        request = dra_v1_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        response = await client.NodeUnprepareResources(request, timeout=deadline_s)
    return {uid: answer.error for uid, answer in response.claims.items()}


async def prepare_v1beta1(
    plugin: KubeletPlugin, claims: list[ClaimRef]
) -> dict[str, dra_v1beta1_pb2.NodePrepareResourceResponse]:
    async with channel(plugin.dra_socket) as ch:
        client = stub(dra_v1beta1_pb2_grpc.DRAPluginStub, ch)
        request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
            claims=[
                dra_v1beta1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims
            ]
        )
        response = await client.NodePrepareResources(request, timeout=WAIT_S)
    return dict(response.claims)


async def test_v1_and_v1beta1_reach_the_same_handler(root: Path) -> None:
    handler = RecordingHandler()
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        v1 = await prepare_v1(plugin, [claim("a"), claim("b")])
        beta = await prepare_v1beta1(plugin, [claim("c")])
    assert handler.prepare_calls == [[claim("a"), claim("b")], [claim("c")]]
    assert set(v1) == {"uid-a", "uid-b"}
    device = v1["uid-a"].devices[0]
    assert list(device.request_names) == ["gpu"]
    assert device.pool_name == "node-a"
    assert device.device_name == "gpu-a"
    assert list(device.cdi_device_ids) == ["k8s.gpu.nvidia.com/claim=uid-a-gpu"]
    assert v1["uid-a"].error == ""
    (beta_device, beta_second) = beta["uid-c"].devices
    assert beta_device.device_name == "gpu-c"
    assert list(beta_device.cdi_device_ids) == ["k8s.gpu.nvidia.com/claim=uid-c-gpu"]
    assert list(beta_second.request_names) == []


async def test_share_id_is_sent_on_v1_only(root: Path) -> None:
    async with KubeletPlugin(
        DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root
    ) as plugin:
        v1 = await prepare_v1(plugin, [claim("a")])
        beta = await prepare_v1beta1(plugin, [claim("a")])
    with_share, without_share = v1["uid-a"].devices
    assert with_share.HasField("share_id")
    assert with_share.share_id == "share-a"
    assert not without_share.HasField("share_id")
    # On the wire, the v1beta1 answer carries no field 5 at all.
    as_v1 = dra_v1_pb2.NodePrepareResourceResponse.FromString(beta["uid-a"].SerializeToString())
    assert not as_v1.devices[0].HasField("share_id")
    assert as_v1.devices[0].device_name == "gpu-a"


async def test_unprepare_via_both_versions(root: Path) -> None:
    handler = RecordingHandler(errors={"uid-b": "device busy"})
    async with (
        KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin,
        channel(plugin.dra_socket) as ch,
    ):
        v1 = await stub(dra_v1_pb2_grpc.DRAPluginStub, ch).NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(
                claims=[dra_v1_pb2.Claim(namespace="default", uid="uid-a", name="a")]
            ),
            timeout=WAIT_S,
        )
        beta = await stub(dra_v1beta1_pb2_grpc.DRAPluginStub, ch).NodeUnprepareResources(
            dra_v1beta1_pb2.NodeUnprepareResourcesRequest(
                claims=[dra_v1beta1_pb2.Claim(namespace="default", uid="uid-b", name="b")]
            ),
            timeout=WAIT_S,
        )
    assert handler.unprepare_calls == [[claim("a")], [claim("b")]]
    assert dict(v1.claims)["uid-a"].error == ""
    assert dict(beta.claims)["uid-b"].error == "device busy"


class GatedHandler(RecordingHandler):
    """A device layer whose work waits for `go`, and records what it finished."""

    def __init__(self) -> None:
        super().__init__()
        self.go = anyio.Event()
        self.started = anyio.Event()
        self.finished: list[str] = []

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]:
        self.started.set()
        await self.go.wait()
        self.finished += [f"prepare {c.uid}" for c in claims]
        return await super().prepare(claims)

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        self.started.set()
        await self.go.wait()
        self.finished += [f"unprepare {c.uid}" for c in claims]
        return await super().unprepare(claims)


@pytest.mark.parametrize("op", ["prepare", "unprepare"])
async def test_a_call_cut_by_the_kubelets_deadline_still_finishes_its_work(
    root: Path, op: str
) -> None:
    """grpc.aio cancels a handler with a plain asyncio cancel at the deadline, which
    anyio's shields do not stop: the device layer would be cut at whatever it awaited,
    its worker threads going on without it and its claim's lock released. The kubelet
    gets its deadline error; the work goes on to the end, and `stop` waits for it."""
    handler = GatedHandler()
    plugin = KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root)
    await plugin.start()
    try:
        async with channel(plugin.dra_socket) as ch:
            client = stub(dra_v1_pb2_grpc.DRAPluginStub, ch)
            claims = [dra_v1_pb2.Claim(namespace="default", uid="uid-a", name="a")]
            # Time enough to connect and reach the handler on a loaded machine: the
            # handler waits for `go`, so the call meets its deadline all the same.
            deadline = 3.0
            call = (
                client.NodePrepareResources(
                    dra_v1_pb2.NodePrepareResourcesRequest(claims=claims), timeout=deadline
                )
                if op == "prepare"
                else client.NodeUnprepareResources(
                    dra_v1_pb2.NodeUnprepareResourcesRequest(claims=claims), timeout=deadline
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await call
            assert cut.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert handler.started.is_set() and handler.finished == []
    finally:
        async with anyio.create_task_group() as group:
            group.start_soon(plugin.stop)
            await anyio.sleep(0.2)
            assert handler.finished == []  # stop is waiting for the work
            handler.go.set()
    assert handler.finished == [f"{op} uid-a"]


async def cut_prepare(plugin: KubeletPlugin, claims: list[ClaimRef]) -> None:
    """A prepare call the kubelet's deadline ends before the device layer answers."""
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        # Time enough to reach the handler on a loaded machine, which then waits.
        await prepare_v1(plugin, claims, deadline_s=3.0)
    assert cut.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_prepare_failure_the_kubelet_never_heard_answers_its_retry(root: Path) -> None:
    """A prepare that fails after the kubelet's deadline (an MPS daemon pod that never
    starts gets 60 s, the call 45): the retry that comes while it still runs waits for
    it and is answered with its failure, so the pod's events name the cause instead of
    `context deadline exceeded` call after call. A claim of the call whose work
    succeeded is prepared as usual, and the call after that prepares the failed claim
    anew."""
    handler = GatedHandler()
    handler.errors["uid-a"] = "its pod did not listen on its control pipe within 60s"
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        await cut_prepare(plugin, [claim("a"), claim("b")])
        async with anyio.create_task_group() as group:
            retried: dict[str, Any] = {}

            async def retry() -> None:
                retried.update(await prepare_v1(plugin, [claim("a"), claim("b")]))

            group.start_soon(retry)
            await anyio.sleep(0.5)
            answered_early = bool(retried)
            handler.go.set()  # before any assert: the plugin's stop waits for the work
        assert not answered_early  # the retry waited for the work the first call left
        again = await prepare_v1(plugin, [claim("a")])
    assert retried["uid-a"].error == (
        f"its pod did not listen on its control pipe within 60s ({UNHEARD_FAILURE_NOTE})"
    )
    assert retried["uid-b"].error == "" and retried["uid-b"].devices[0].device_name == "gpu-b"
    assert handler.prepare_calls == [[claim("a"), claim("b")], [claim("b")], [claim("a")]]
    assert again["uid-a"].error == "its pod did not listen on its control pipe within 60s"


async def test_a_failure_the_kubelet_never_heard_goes_with_the_claims_unprepare(
    root: Path,
) -> None:
    """Once the kubelet unprepared the claim (its pod went), a later prepare of it (a
    new pod of a claim made by hand) is no retry of the failed one: it prepares anew."""
    handler = GatedHandler()
    handler.errors["uid-a"] = "device busy"
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        await cut_prepare(plugin, [claim("a")])
        handler.go.set()
        await wait_until(lambda: handler.finished == ["prepare uid-a"])
        handler.errors.clear()
        assert await unprepare_v1(plugin, [claim("a")]) == {"uid-a": ""}
        prepared = await prepare_v1(plugin, [claim("a")])
    assert prepared["uid-a"].error == ""
    assert handler.prepare_calls == [[claim("a")], [claim("a")]]


class GatedWork:
    """The work of a prepare call that waits for `go`, then fails each claim with
    "no"; `tries` holds the claims of each call that began it."""

    def __init__(self) -> None:
        self.tries: list[list[str]] = []
        self.go = anyio.Event()

    async def __call__(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        self.tries.append([r.uid for r in refs])
        await self.go.wait()
        return {r.uid: PrepareResult(error="no") for r in refs}


async def left_under_way(calls: _CallsInFlight, refs: list[ClaimRef], work: GatedWork) -> None:
    """A prepare call whose caller leaves (its deadline, or a hang-up) while `work` waits."""
    async with anyio.create_task_group() as group:
        group.start_soon(calls.prepare, refs, work)
        await wait_until(lambda: bool(work.tries))
        group.cancel_scope.cancel()


async def test_a_failure_the_kubelet_never_heard_is_kept_only_for_a_while() -> None:
    """A pod that went for good sends no retry: its claim's kept failure is dropped
    once older than `keep_s`, and a prepare after that tries again."""
    now = [0.0]
    calls = _CallsInFlight(keep_s=120.0, clock=lambda: now[0])
    work = GatedWork()
    await left_under_way(calls, [claim("a")], work)  # the kubelet's deadline
    work.go.set()
    await calls.wait()
    now[0] = 120.5
    assert (await calls.prepare([claim("a")], work))["uid-a"].error == "no"
    assert work.tries == [["uid-a"], ["uid-a"]]


async def test_a_prepare_still_under_way_near_the_kubelets_deadline_is_answered_before_it(
    root: Path,
) -> None:
    """The kubelet gives a prepare call 45 s; an MPS daemon pod that never starts gets
    60. Instead of letting the deadline end the call (the pod's first event would read
    `context deadline exceeded`), the plugin answers each claim `ANSWER_MARGIN_S`
    before it, saying the prepare goes on; the work finishes, and the retry is answered
    with what it came to: the failure with its cause, a success prepared as usual."""
    handler = GatedHandler()
    handler.errors["uid-a"] = "its pod did not listen on its control pipe within 60s"
    deadline = 2 * ANSWER_MARGIN_S + 1.5  # the margin leaves 1.5 s for the work
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        # An answer at all is one before the deadline: after it, the call raises.
        first = await prepare_v1(plugin, [claim("a"), claim("b")], deadline_s=deadline)
        assert handler.started.is_set() and handler.finished == []  # still under way
        handler.go.set()
        await wait_until(lambda: handler.finished == ["prepare uid-a", "prepare uid-b"])
        retried = await prepare_v1(plugin, [claim("a"), claim("b")])
    assert {uid: r.error for uid, r in first.items()} == {
        "uid-a": f"ResourceClaim default/a (uid-a): {STILL_UNDER_WAY}",
        "uid-b": f"ResourceClaim default/b (uid-b): {STILL_UNDER_WAY}",
    }
    assert retried["uid-a"].error == (
        f"its pod did not listen on its control pipe within 60s ({UNHEARD_FAILURE_NOTE})"
    )
    assert retried["uid-b"].error == "" and retried["uid-b"].devices[0].device_name == "gpu-b"
    assert handler.prepare_calls == [[claim("a"), claim("b")], [claim("b")]]


async def test_a_call_that_waits_out_an_earlier_calls_work_is_answered_before_its_deadline() -> (
    None
):
    """A retry waits for the work an earlier call left before it begins its own; where
    that work outlasts the retry's time too, the retry is answered in time all the
    same: the claim still under way says so, and a claim of the call not begun says
    that the next call answers it. Neither is tried meanwhile."""
    calls = _CallsInFlight()
    work = GatedWork()
    await left_under_way(calls, [claim("a")], work)
    answered = await calls.prepare([claim("a"), claim("c")], work, answer_within=0.2)
    work.go.set()
    await calls.wait()
    assert {uid: r.error for uid, r in answered.items()} == {
        "uid-a": f"ResourceClaim default/a (uid-a): {STILL_UNDER_WAY}",
        "uid-c": f"ResourceClaim default/c (uid-c): {NOT_BEGUN}",
    }
    assert work.tries == [["uid-a"]]
    # The next call is answered with the first one's outcome, and begins the other.
    again = await calls.prepare([claim("a"), claim("c")], work, answer_within=5.0)
    assert again["uid-a"].error == f"no ({UNHEARD_FAILURE_NOTE})"
    assert again["uid-c"].error == "no"
    assert work.tries == [["uid-a"], ["uid-c"]]


def test_a_call_with_little_time_left_waits_for_its_deadline() -> None:
    """Where the margin would leave the work too little of the caller's time (or the
    caller set no deadline), the call waits as before: its caller's deadline ends it."""
    assert _answer_within(None) is None
    assert _answer_within(2 * ANSWER_MARGIN_S) is None
    assert _answer_within(45.0) == 45.0 - ANSWER_MARGIN_S


async def test_an_unprepare_still_under_way_near_the_kubelets_deadline_is_answered_before_it(
    root: Path,
) -> None:
    """An unprepare whose steps run to their bounds (a tool gets 30 s, a daemon's stop
    more; the kubelet's call 45) is answered `ANSWER_MARGIN_S` before the deadline,
    each claim saying the unprepare goes on, rather than ending in `context deadline
    exceeded`; the work finishes, and the retry finds it done."""
    handler = GatedHandler()
    deadline = 2 * ANSWER_MARGIN_S + 1.5
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        first = await unprepare_v1(plugin, [claim("a"), claim("b")], deadline_s=deadline)
        assert handler.started.is_set() and handler.finished == []  # still under way
        handler.go.set()
        await wait_until(lambda: handler.finished == ["unprepare uid-a", "unprepare uid-b"])
        retried = await unprepare_v1(plugin, [claim("a"), claim("b")])
    assert first == {
        "uid-a": f"ResourceClaim default/a (uid-a): {UNPREPARE_UNDER_WAY}",
        "uid-b": f"ResourceClaim default/b (uid-b): {UNPREPARE_UNDER_WAY}",
    }
    assert retried == {"uid-a": "", "uid-b": ""}


async def test_an_unprepare_answered_early_drops_a_kept_failure_once_its_work_has_ended() -> None:
    """An unprepare answered before its work ended (it waited behind a prepare an
    earlier call left, as the claim's lock makes it) must still drop that prepare's
    failure, which is kept only once the prepare ends: a later prepare of the claim (a
    new pod of a claim made by hand) prepares anew rather than hearing old news."""
    calls = _CallsInFlight()
    guard = anyio.Lock()  # the claim's lock in the device layer
    go = anyio.Event()

    async def prepare(refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        async with guard:
            await go.wait()
            return {r.uid: PrepareResult(error="no") for r in refs}

    async def unprepare(refs: list[ClaimRef]) -> dict[str, str | None]:
        async with guard:
            return dict.fromkeys((r.uid for r in refs), None)

    async with anyio.create_task_group() as group:  # a prepare whose caller left
        group.start_soon(calls.prepare, [claim("a")], prepare)
        await wait_until(guard.locked)
        group.cancel_scope.cancel()
    answered = await calls.unprepare([claim("a")], unprepare, answer_within=0.2)
    assert answered == {"uid-a": f"ResourceClaim default/a (uid-a): {UNPREPARE_UNDER_WAY}"}
    go.set()
    await calls.wait()
    go = anyio.Event()
    go.set()
    again = await calls.prepare([claim("a")], prepare)
    assert again["uid-a"].error == "no"  # tried anew: not "no (UNHEARD_FAILURE_NOTE)"


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(WAIT_S):
        while not condition():
            await anyio.sleep(0.01)


async def test_one_claim_raising_does_not_fail_the_others(root: Path) -> None:
    handler = RecordingHandler(fail=frozenset({"uid-bad"}))
    claims = [claim("a"), claim("bad"), claim("b")]
    async with (
        KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root),
        KubeletStandin(root) as kubelet,
    ):
        await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        prepared = await kubelet.prepare(DRIVER, claims)
        unprepared = await kubelet.unprepare(DRIVER, claims)
    assert prepared["uid-a"].error is None
    assert prepared["uid-a"].devices[0].device_name == "gpu-a"
    assert prepared["uid-b"].devices[0].device_name == "gpu-b"
    assert prepared["uid-bad"].devices == []
    assert prepared["uid-bad"].error is not None
    assert "cannot prepare bad" in prepared["uid-bad"].error
    assert unprepared["uid-a"] is None
    assert unprepared["uid-b"] is None
    assert unprepared["uid-bad"] is not None
    assert "cannot unprepare bad" in unprepared["uid-bad"]


async def test_per_claim_errors_are_passed_through(root: Path) -> None:
    handler = RecordingHandler(errors={"uid-b": "claim not allocated to this node"})
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        out = await prepare_v1(plugin, [claim("a"), claim("b")])
    assert out["uid-b"].error == "claim not allocated to this node"
    assert list(out["uid-b"].devices) == []
    assert out["uid-a"].error == ""


async def test_claims_that_cannot_be_read_fail_alone_and_never_reach_the_handler(
    root: Path,
) -> None:
    handler = RecordingHandler()
    claims = Allocated(missing=frozenset({"uid-gone"}), broken=frozenset({"uid-odd"}))
    async with KubeletPlugin(DRIVER, handler, claims=claims, kubelet_root=root) as plugin:
        out = await prepare_v1(plugin, [claim("a"), claim("gone"), claim("odd"), claim("b")])
    assert handler.prepare_calls == [[claim("a"), claim("b")]]
    assert out["uid-a"].error == "" and out["uid-b"].error == ""
    assert (
        out["uid-gone"].error
        == "ResourceClaim default/gone (uid-gone) does not exist in the API server"
    )
    assert list(out["uid-gone"].devices) == []
    assert "reader bug for odd" in out["uid-odd"].error


async def test_metrics_count_every_claim_answered_read_failures_included(root: Path) -> None:
    registry = CollectorRegistry()
    handler = RecordingHandler(errors={"uid-b": "device busy"})
    claims = Allocated(missing=frozenset({"uid-gone"}))
    async with (
        KubeletPlugin(
            DRIVER, handler, claims=claims, metrics=ClaimMetrics(registry), kubelet_root=root
        ),
        KubeletStandin(root) as kubelet,
    ):
        await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        await kubelet.prepare(DRIVER, [claim("a"), claim("b"), claim("gone")])
        await kubelet.unprepare(DRIVER, [claim("a"), claim("b")])

    def sample(name: str, operation: str) -> float | None:
        return registry.get_sample_value(name, {"operation": operation})

    assert sample("gpudra_claim_operations_total", "prepare") == 3.0
    assert sample("gpudra_claim_operation_errors_total", "prepare") == 2.0
    assert sample("gpudra_claim_operation_duration_seconds_count", "prepare") == 3.0
    assert sample("gpudra_claim_operations_total", "unprepare") == 2.0
    assert sample("gpudra_claim_operation_errors_total", "unprepare") == 1.0


async def test_unanswered_claim_becomes_an_error_and_strays_are_dropped(root: Path) -> None:
    stray = {"uid-stray": PrepareResult()}
    handler = RecordingHandler(skip=frozenset({"uid-b"}), extra=stray)
    async with (
        KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root),
        KubeletStandin(root) as kubelet,
    ):
        await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        # The stand-in fails the call like the kubelet if a claim is missing or extra.
        prepared = await kubelet.prepare(DRIVER, [claim("a"), claim("b")])
        unprepared = await kubelet.unprepare(DRIVER, [claim("a"), claim("b")])
    assert prepared["uid-a"].error is None
    assert prepared["uid-b"].error is not None
    assert "no result" in prepared["uid-b"].error
    assert unprepared["uid-a"] is None
    assert unprepared["uid-b"] is not None


async def test_invalid_handler_result_fails_only_its_claim(root: Path) -> None:
    broken = PrepareResult(
        devices=[
            PreparedDevice(
                request_names=["gpu"],
                pool_name="node-a",
                device_name="gpu-x",
                cdi_device_ids=[None],  # type: ignore[list-item]
            )
        ]
    )
    handler = RecordingHandler(extra={"uid-x": broken})
    async with KubeletPlugin(DRIVER, handler, claims=Allocated(), kubelet_root=root) as plugin:
        out = await prepare_v1(plugin, [claim("a"), claim("x")])
    assert out["uid-a"].error == ""
    assert "invalid result" in out["uid-x"].error
    assert list(out["uid-x"].devices) == []


# --- health ---------------------------------------------------------------------------


def gpu(name: str, healthy: bool | None, message: str = "") -> DeviceHealth:
    return DeviceHealth(
        pool_name="node-a",
        device_name=name,
        healthy=healthy,
        updated_at=1_700_000_000.5,
        message=message,
        health_check_timeout_s=30,
    )


@pytest.mark.parametrize(
    ("kubelet_knows", "chosen"),
    [
        pytest.param((HEALTH_V1, HEALTH_V1ALPHA1), HEALTH_V1, id="kubelet-1.37"),
        pytest.param((HEALTH_V1ALPHA1,), HEALTH_V1ALPHA1, id="kubelet-1.36"),
    ],
)
async def test_health_stream_sends_the_full_list_on_every_change(
    root: Path, kubelet_knows: tuple[str, ...], chosen: str
) -> None:
    """Over either health API: v1, which the kubelet of 1.37 and later picks first,
    and v1alpha1, the only one the kubelets of 1.34 to 1.36 know."""
    board = HealthBoard([gpu("gpu-0", True), gpu("gpu-1", None)])
    async with (
        KubeletPlugin(
            DRIVER, RecordingHandler(), claims=Allocated(), kubelet_root=root, health=board
        ) as plugin,
        KubeletStandin(root, health_versions=kubelet_knows) as kubelet,
    ):
        registration = await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        assert registration.health_version == chosen
        async with kubelet.watch_health(DRIVER) as updates:
            with anyio.fail_after(WAIT_S):
                first = await anext(updates)
            assert [(d.device_name, d.healthy) for d in first] == [
                ("gpu-0", True),
                ("gpu-1", None),
            ]
            assert first[0].updated_at == 1_700_000_000
            assert first[0].health_check_timeout_s == 30
            board.publish([gpu("gpu-0", False, "XID 79: fell off the bus"), gpu("gpu-1", True)])
            with anyio.fail_after(WAIT_S):
                second = await anext(updates)
            assert [(d.device_name, d.healthy, d.message) for d in second] == [
                ("gpu-0", False, "XID 79: fell off the bus"),
                ("gpu-1", True, ""),
            ]
            board.publish([gpu("gpu-0", False, "x" * 5000), gpu("gpu-1", True)])
            with anyio.fail_after(WAIT_S):
                third = await anext(updates)
            assert len(third) == 2
            assert len(third[0].message) == 1024
            assert third[0].message.endswith("...")
            # The kubelet counts bytes: two-byte characters are cut between characters.
            board.publish([gpu("gpu-0", False, "\u00e9" * 1100), gpu("gpu-1", True)])
            with anyio.fail_after(WAIT_S):
                fourth = await anext(updates)
            assert fourth[0].message == "\u00e9" * 510 + "..."
            assert len(fourth[0].message.encode()) == 1023
            await plugin.stop()
            # Stopping ends the stream cleanly (status OK) instead of the server
            # cutting it off after its grace period.
            with anyio.fail_after(WAIT_S):
                rest = [u async for u in updates]
            assert rest == []


async def test_health_stream_resends_an_unchanged_list_before_the_kubelet_forgets_it(
    root: Path,
) -> None:
    """The kubelet reads a device as Unknown once it has heard nothing of it for its
    timeout (30 s by default), so a quiet stream must repeat itself in time."""
    board = HealthBoard([gpu("gpu-0", True)])
    async with (
        KubeletPlugin(
            DRIVER,
            RecordingHandler(),
            claims=Allocated(),
            kubelet_root=root,
            health=board,
            health_refresh_s=0.2,
        ),
        KubeletStandin(root) as kubelet,
    ):
        await kubelet.wait_for_driver(DRIVER, timeout_s=WAIT_S)
        async with kubelet.watch_health(DRIVER) as updates:
            with anyio.fail_after(WAIT_S):
                reports = [await anext(updates) for _ in range(3)]
    assert [[(d.device_name, d.healthy) for d in r] for r in reports] == [[("gpu-0", True)]] * 3


def test_health_refresh_must_be_positive(root: Path) -> None:
    with pytest.raises(ValueError, match="health_refresh_s 0 must be positive"):
        KubeletPlugin(
            DRIVER,
            RecordingHandler(),
            claims=Allocated(),
            kubelet_root=root,
            health=HealthBoard(),
            health_refresh_s=0,
        )


# --- generated code -------------------------------------------------------------------


def test_the_generator_pin_is_the_release_that_made_the_committed_code() -> None:
    """A fresh install takes grpcio-tools from the pin; were it another release than
    the committed code's, the comparison below would only ever skip."""
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "dev"
    ]
    pins = [d for d in dev if d.startswith("grpcio-tools")]
    assert len(pins) == 1 and pins[0].startswith("grpcio-tools=="), pins
    committed = (REPO / "driver" / "proto" / "dra_v1_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed)
    assert match is not None
    assert pins[0].removeprefix("grpcio-tools==") == match.group(1), (
        "pyproject.toml pins another grpcio-tools than the one that generated "
        "driver/proto: run driver/proto/generate.sh with the pinned release"
    )


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed; cannot regenerate the proto code")
    proto_dir = REPO / "driver" / "proto"
    committed = (proto_dir / "dra_v1_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed)
    assert match is not None
    installed = importlib.metadata.version("grpcio-tools")
    if installed != match.group(1):
        pytest.skip(
            f"committed code comes from grpcio-tools {match.group(1)}, installed is "
            f"{installed}; run driver/proto/generate.sh to refresh it"
        )
    subprocess.run(
        ["bash", "driver/proto/generate.sh", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
        check=True,
    )
    generated = sorted(p.name for p in tmp_path.iterdir())
    expected = sorted(
        p.name
        for p in proto_dir.iterdir()
        if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    )
    assert generated == expected
    assert len(generated) == 15
    for name in generated:
        assert (tmp_path / name).read_text() == (proto_dir / name).read_text(), (
            f"{name} is stale: run driver/proto/generate.sh"
        )
