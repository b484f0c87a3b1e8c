"""`gpudra node` with its kubelet plugin, as a process, driven like a kubelet would.

The real scheduler allocates claims against the slices the process publishes; the
kubelet stand-in registers the plugin from its socket and prepares the claims of
pods bound to the node over the real gRPC protocols. Crash tests SIGKILL the process
at every step of a prepare and check that a restart gives the same answer and that
nothing stays behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import grpc
import pytest
from gpudra.api.tenants import API_VERSION as TENANT_API
from gpudra.api.tenants import PATH as TENANTS
from gpudra.api.tenants import crd_manifest
from gpudra.common.kube import Kube as AsyncKube
from gpudra.common.metricsserver import MAX_CONNECTIONS as METRICS_MAX_CONNECTIONS
from gpudra.common.metricsserver import MAX_PER_CLIENT as METRICS_MAX_PER_CLIENT
from gpudra.common.metricsserver import WRITE_STALL_S
from gpudra.driver.agent import AgentConfig
from gpudra.driver.health import HealthPolicy
from gpudra.driver.node import NodeService, PluginConfig
from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.nvml.standin import FAKEBIN
from gpudra.driver.plugin import DRA_V1, HEALTH_V1, ClaimRef
from gpudra.driver.prepare import PREPARE_STEPS
from gpudra.driver.proto import dra_v1_pb2, dra_v1_pb2_grpc

from bench.slices import process_rss_mib
from e2e.claims import pod_with_claim, wait_allocated
from e2e.cluster.harness import REPO, Cluster
from e2e.cluster.kube import ApiError, Kube, apply_crd, wait_for
from e2e.kubelet_pods import PodClaimsDriver
from e2e.kubelet_standin import KubeletStandin, Registration
from e2e.node_process import (
    EMULATED_H100,
    NodeDirs,
    create_driver_namespace,
    delete_driver_namespace,
    delete_slices,
)
from e2e.processes import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]

NODE = "worker-1"


@dataclass
class NodeProcess:
    cluster: Cluster
    driver: str
    dirs: NodeDirs
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[str] | None = None
    nvml: tuple[str, ...] = EMULATED_H100

    def start(self, *extra: str) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.layout.admin_kubeconfig),
            "NODE_NAME": NODE,
            "GPUDRA_FAKEBIN_LOG": str(self.dirs.tools_log),
        }
        self.proc = subprocess.Popen(
            self.dirs.command(
                self.driver,
                "--nvidia-smi",
                str(FAKEBIN / "nvidia-smi"),
                "--mps-control",
                str(FAKEBIN / "nvidia-cuda-mps-control"),
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
                "--cleanup-interval",
                "2",
                *extra,
                nvml=self.nvml,
            ),
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        self.proc = None
        return code

    def wait_exit(self) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout=60)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        self.proc = None
        return code

    def wait_exit_with_stderr(self) -> tuple[int, str]:
        assert self.proc is not None
        _, stderr = self.proc.communicate(timeout=60)
        code = self.proc.returncode
        self.proc = None
        return code, stderr

    def event_loop(self) -> str:
        """Whose compiled event loop the running agent has loaded: only
        `gpudra.common.eventloop` brings uvloop's into a node process."""
        assert self.proc is not None
        maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        return "uvloop" if "/uvloop/loop." in maps else "asyncio"

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text: str = response.read().decode()
            return text


@dataclass
class Setup:
    kube: Kube
    driver: str
    namespace: str
    node: NodeProcess

    def pod(self, name: str, claim: dict[str, Any]) -> dict[str, Any]:
        """A pod on the node with one claim from a template (owned by the pod)."""
        self.kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"spec": claim},
            }
        )
        pod: dict[str, Any] = self.kube.create(
            pod_with_claim(name, self.namespace, NODE, template=name)
        )
        return pod

    def allocated_claim(self, name: str, claim: dict[str, Any]) -> dict[str, Any]:
        """A claim the real scheduler allocated for a pod on the node."""
        self.kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": claim,
            }
        )
        self.kube.create(pod_with_claim(name, self.namespace, NODE, claim=name))
        return wait_allocated(self.kube, name, self.namespace)


def _gpu_claim(driver: str, config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {
        "requests": [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": driver,
                    "selectors": [
                        {"cel": {"expression": 'device.attributes["' + driver + '"].type == "gpu"'}}
                    ],
                },
            }
        ]
    }
    if config:
        devices["config"] = config
    return {"devices": devices}


@pytest.fixture
def node_dirs() -> Iterator[NodeDirs]:
    root = Path(tempfile.mkdtemp(prefix="gd-"))
    dirs = NodeDirs(root)
    dirs.make_dev()
    dirs.boot_id.write_text("3f2b0c4e-0000-4000-8000-00000000b007\n")
    yield dirs
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def setup(cluster: Cluster, kube: Kube, node_dirs: NodeDirs) -> AsyncIterator[Setup]:
    driver = f"n{secrets.token_hex(4)}.gpudra.dev"
    namespace = f"node-{secrets.token_hex(3)}"

    await anyio.to_thread.run_sync(create_driver_namespace, kube, driver, namespace)
    node = NodeProcess(cluster, driver, node_dirs)
    s = Setup(kube, driver, namespace, node)
    try:
        yield s
    finally:
        if node.proc is not None:
            node.stop()
        await anyio.to_thread.run_sync(delete_driver_namespace, kube, driver, namespace)


async def test_a_checkpoint_of_a_future_major_version_stops_the_node_untouched(
    setup: Setup, node_dirs: NodeDirs
) -> None:
    """A downgrade onto a node whose checkpoint a newer release wrote in a format this
    release cannot read: one line, exit 1, the file byte for byte as it was."""
    path = node_dirs.state / "checkpoint.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 9, "majorVersion": 3, "claims": {"u": {"x": 1}}}))
    before = path.read_bytes()
    setup.node.start()
    code = await anyio.to_thread.run_sync(setup.node.wait_exit_with_stderr)
    assert code[0] == 1
    assert code[1].strip().splitlines()[-1] == (
        f"gpudra node: checkpoint {path} has majorVersion 3, written by a newer gpudra release; "
        "this release reads majorVersion 2 at most. The file is left as is: run that release "
        "or a newer one on this node (or drain the node, then move the file aside)"
    )
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint.json"
    ]


async def _wait_published(kube: Kube, driver: str, devices: int = 8) -> None:
    def published() -> bool:
        items = kube.list("ResourceSlice", fieldSelector=f"spec.driver={driver}")
        return sum(len(o["spec"].get("devices", [])) for o in items) >= devices

    await anyio.to_thread.run_sync(lambda: wait_for("the node's slices", published, timeout=60))


async def test_a_stopped_node_leaves_every_change_in_the_checkpoint_file(
    setup: Setup, node_dirs: NodeDirs
) -> None:
    """Prepares' ends and removals go to the changes file beside the checkpoint; the
    node's SIGTERM stop folds them into the file, the one a release from before the
    changes file reads (an upgrade or downgrade stops the agent this way), and the node
    started again reads the same and unprepares what it lists."""
    driver = setup.driver
    path = node_dirs.state / "checkpoint.json"
    setup.node.start()
    await _wait_published(setup.kube, driver)
    refs = []
    for name in ("first", "second"):
        claim = await anyio.to_thread.run_sync(setup.allocated_claim, name, _gpu_claim(driver))
        refs.append(ClaimRef(setup.namespace, claim["metadata"]["uid"], name))
    first, second = refs
    async with KubeletStandin(node_dirs.kubelet) as kubelet:
        reg = await kubelet.wait_for_driver(driver, timeout_s=60)
        assert (await kubelet.prepare(driver, [first]))[first.uid].error is None
        assert (await kubelet.prepare(driver, [second]))[second.uid].error is None
        assert await kubelet.unprepare(driver, [first]) == {first.uid: None}
        assert node_dirs.prepared_claims() == [second.uid]
        # The file alone: as the agent wrote it at its start (it takes the file over).
        assert json.loads(path.read_text())["claims"] == {}

        assert setup.node.stop() == 0
        claims = json.loads(path.read_text())["claims"]
        assert list(claims) == [second.uid]
        assert claims[second.uid]["state"] == "PrepareCompleted"
        changes = path.with_name("checkpoint.json.changes")
        assert not changes.exists() or changes.read_bytes() == b""

        setup.node.start()
        await kubelet.wait_for_driver(driver, timeout_s=60, replacing=reg)
        assert await kubelet.unprepare(driver, [second]) == {second.uid: None}
        assert node_dirs.prepared_claims() == []
        assert node_dirs.cdi_specs() == []


async def _answers_of(reg: Registration, method: str, claims: Sequence[ClaimRef]) -> dict[str, str]:
    """The error (empty: none) that the plugin behind `reg` answers each claim of a
    NodePrepareResources or NodeUnprepareResources (`method`) with. The stand-in calls
    only the newest registration of a driver, and a surge pod's is newer than that of
    the agent it replaces, which the kubelet may still call."""
    assert reg.dra_version == DRA_V1
    stub_class: Any = dra_v1_pb2_grpc.DRAPluginStub  # generated, untyped
    stub = stub_class(reg.channel)
    wire = [dra_v1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
    request: Any = (
        dra_v1_pb2.NodePrepareResourcesRequest(claims=wire)
        if method == "NodePrepareResources"
        else dra_v1_pb2.NodeUnprepareResourcesRequest(claims=wire)
    )
    response: Any = await getattr(stub, method)(request, timeout=45)
    return {uid: entry.error for uid, entry in response.claims.items()}


async def test_an_agent_taken_over_by_a_surge_pod_stands_down_and_stops_once_it_is_gone(
    setup: Setup, cluster: Cluster, node_dirs: NodeDirs
) -> None:
    """A rolling update with a surge pod: a second agent starts on the same folders,
    with sockets of its own (its pod's UID) and its own metrics port, and its start
    takes the checkpoint over. The old agent still answers the kubelet, but refuses to
    prepare or unprepare, naming the take-over, and leaves the node's slices to the new
    one. The new one killed, the old one stops with an error rather than refuse every
    prepare for good; started again, it takes the checkpoint back: it publishes the
    slices and unprepares what either agent prepared."""
    kube, driver = setup.kube, setup.driver
    path = node_dirs.state / "checkpoint.json"
    old = setup.node
    old_uid = str(uuid.uuid4())
    old.start("--pod-uid", old_uid)
    await _wait_published(kube, driver)
    refs = []
    for name in ("before", "during"):
        claim = await anyio.to_thread.run_sync(setup.allocated_claim, name, _gpu_claim(driver))
        refs.append(ClaimRef(setup.namespace, claim["metadata"]["uid"], name))
    before, during = refs
    new = NodeProcess(cluster, driver, node_dirs)
    try:
        async with KubeletStandin(node_dirs.kubelet) as kubelet:
            old_reg = await kubelet.wait_for_driver(driver, timeout_s=60)
            assert (await kubelet.prepare(driver, [before]))[before.uid].error is None
            [spec] = node_dirs.cdi_specs()

            new.start("--pod-uid", str(uuid.uuid4()))
            # Registered only once its recovery, which takes the checkpoint over, is done.
            new_reg = await kubelet.wait_for_driver(driver, timeout_s=60, replacing=old_reg)
            assert new_reg.registration_socket != old_reg.registration_socket
            assert "gpudra_claim_operations_total" in new.metrics()

            refused = f"checkpoint {path} was changed by another process"
            answers = await _answers_of(old_reg, "NodePrepareResources", [during])
            assert refused in answers[during.uid], answers
            assert "a newer agent on this node took it over" in answers[during.uid], answers
            answers = await _answers_of(old_reg, "NodeUnprepareResources", [before])
            assert refused in answers[before.uid], answers
            assert node_dirs.cdi_specs() == [spec]  # the refused calls touched nothing
            assert node_dirs.prepared_claims() == [before.uid]

            # The slices deleted: both agents see it, only the new one writes them again.
            await anyio.to_thread.run_sync(delete_slices, kube, driver)
            await _wait_published(kube, driver)
            assert (await kubelet.prepare(driver, [during]))[during.uid].error is None
            assert len(node_dirs.cdi_specs()) == 2

            assert new.proc is not None
            new.proc.kill()
            assert new.wait_exit() == -signal.SIGKILL
            # A hang guard (the old agent looks every 5 s), not a timing requirement.
            code, stderr = await anyio.to_thread.run_sync(old.wait_exit_with_stderr)
            assert code == 1, stderr
            assert "another agent publishes this node's ResourceSlices now" in stderr
            assert "the agent that took the checkpoint over is gone" in stderr
            last = stderr.strip().splitlines()[-1]
            assert last.startswith("gpudra node: the agents that took the checkpoint over"), last

            # Its restart (the same pod) takes the checkpoint over again.
            await anyio.to_thread.run_sync(delete_slices, kube, driver)
            old.start("--pod-uid", old_uid)
            again = await kubelet.wait_for_driver(driver, timeout_s=60, replacing=new_reg)
            assert again.registration_socket == old_reg.registration_socket
            await _wait_published(kube, driver)
            assert sorted(node_dirs.prepared_claims()) == sorted(r.uid for r in refs)
            assert await kubelet.unprepare(driver, refs) == {r.uid: None for r in refs}
            assert node_dirs.cdi_specs() == []
            assert node_dirs.prepared_claims() == []
            assert old.stop() == 0
    finally:
        if new.proc is not None:
            new.proc.kill()
            new.wait_exit()


async def test_pod_claims_are_prepared_through_the_running_node(
    setup: Setup, cluster: Cluster, node_dirs: NodeDirs
) -> None:
    kube, driver = setup.kube, setup.driver
    setup.node.start()
    akube = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig))
    try:
        async with KubeletStandin(node_dirs.kubelet) as kubelet:
            registration = await kubelet.wait_for_driver(driver, timeout_s=60)
            assert registration.dra_version == "v1.DRAPlugin"
            assert registration.health_version == HEALTH_V1
            await _wait_published(kube, driver)
            pods = PodClaimsDriver(akube, kubelet, NODE, (driver,))
            async with anyio.create_task_group() as tg:
                await tg.start(pods.run)
                pod = await anyio.to_thread.run_sync(setup.pod, "trainer", _gpu_claim(driver))
                done = await pods.wait_for(pod["metadata"]["uid"])
                assert done.error is None
                [cdi_id] = done.cdi_ids()
                [spec_file] = node_dirs.cdi_specs()
                assert node_dirs.prepared_claims() == [c.uid for c in done.claims[driver]]
                spec = json.loads(spec_file.read_text())
                [claim_ref] = done.claims[driver]
                claim = await anyio.to_thread.run_sync(
                    lambda: kube.get("ResourceClaim", claim_ref.name, setup.namespace)
                )
                device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
                minor = int(device.removeprefix("gpu-"))
                paths = [
                    n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]
                ]
                assert paths == [f"/dev/nvidia{minor}"]
                assert cdi_id.endswith(f"={claim_ref.uid}-{device}")

                metrics = setup.node.metrics()
                assert 'gpudra_claim_operations_total{operation="prepare"} 1.0' in metrics
                assert 'pod="trainer"' in metrics
                assert f'claim="{claim_ref.name}"' in metrics
                # As the webhook: the agent's API and gRPC traffic runs on uvloop's loop.
                assert setup.node.event_loop() == "uvloop"

                async with kubelet.watch_health(driver) as updates:
                    health = await anext(updates)
                assert sorted(h.device_name for h in health) == [f"gpu-{i}" for i in range(8)]
                assert all(h.healthy for h in health)

                await anyio.to_thread.run_sync(
                    lambda: kube.delete("Pod", "trainer", setup.namespace, grace=0)
                )
                gone = await pods.wait_for(pod["metadata"]["uid"], unprepared=True)
                assert gone.error is None
                assert node_dirs.cdi_specs() == []
                assert node_dirs.prepared_claims() == []
                tg.cancel_scope.cancel()
            assert setup.node.stop() == 0
            await kubelet.wait_for_deregistration(registration.registration_socket, timeout_s=30)
    finally:
        await akube.close()


def _gpu_config(driver: str, sharing: dict[str, Any]) -> list[dict[str, Any]]:
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", **sharing}
    return [{"opaque": {"driver": driver, "parameters": parameters}}]


def _mig_claim(driver: str) -> dict[str, Any]:
    cel = (
        f'device.attributes["{driver}"].type == "mig" && '
        f'device.attributes["{driver}"].profile == "1g.10gb"'
    )
    request = {"deviceClassName": driver, "selectors": [{"cel": {"expression": cel}}]}
    return {"devices": {"requests": [{"name": "mig", "exactly": request}]}}


def _gpu_state(node_dirs: NodeDirs) -> list[dict[str, Any]]:
    state: list[dict[str, Any]] = json.loads((node_dirs.root / "gpus.json").read_text())["gpus"]
    return state


# (shape, the node's NVML flags, the steps that shape goes through)
CRASH_SHAPES = {
    "time-sliced-gpu": (
        ("--nvml", "emulated:h100-80gb-hbm3-x8"),
        ["prepare-started", "time-slice-recorded", "time-slice-applied"],
    ),
    "mps-gpu": (
        ("--nvml", "emulated:h100-80gb-hbm3-x8"),
        ["compute-mode-recorded", "compute-mode-applied", "mps-recorded", "mps-started"],
    ),
    "dynamic-mig": (
        ("--nvml", "emulated:h100-80gb-hbm3-x8-mig", "--mig-strategy", "dynamic"),
        ["mig-recorded", "mig-gpu-instance-created", "mig-created", "cdi-written"],
    ),
}


def _threads(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())


async def test_connections_held_on_the_metrics_port_cannot_exhaust_the_agent(
    setup: Setup, cluster: Cluster, node_dirs: NodeDirs
) -> None:
    """An escape attempt on the node agent: tenants' pods reach the agent's metrics
    port, open many connections from many addresses and hold them. The agent's threads
    stay within the metrics server's bound (a thread each before): past it, the oldest
    connection that sent no request is closed for each new one, and claims still
    prepare."""
    kube, driver = setup.kube, setup.driver
    bound = METRICS_MAX_CONNECTIONS // 4  # set by its flag: it reaches the server
    setup.node.start("--metrics-max-connections", str(bound))
    akube = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig))
    held: list[socket.socket] = []
    try:
        async with KubeletStandin(node_dirs.kubelet) as kubelet:
            await kubelet.wait_for_driver(driver, timeout_s=60)
            await _wait_published(kube, driver)
            assert setup.node.proc is not None
            pid = setup.node.proc.pid
            before = _threads(pid)
            for i in range(10 * METRICS_MAX_CONNECTIONS):
                held.append(_connect_from(i, setup.node.metrics_port))
            # Each from an address of its own, so the per-address bound does not close
            # them: the bound set by the flag does, the oldest first (with the default
            # bound it would have been served, and held to its head deadline).
            held[0].settimeout(1)
            assert held[0].recv(1) == b""
            # Held past the bound, they would be a thread each; the agent's own worker
            # threads come and go by a few, hence the slack.
            after = _threads(pid)
            assert after <= before + bound + 8, (before, after)
            pods = PodClaimsDriver(akube, kubelet, NODE, (driver,))
            async with anyio.create_task_group() as tg:
                await tg.start(pods.run)
                pod = await anyio.to_thread.run_sync(setup.pod, "held", _gpu_claim(driver))
                done = await pods.wait_for(pod["metadata"]["uid"])
                assert done.error is None
                assert len(done.cdi_ids()) == 1
                tg.cancel_scope.cancel()
    finally:
        for s in held:
            s.close()
        await akube.close()


def _connect_from(client: int, port: int, *, small_window: bool = False) -> socket.socket:
    """A connection to the agent's metrics port on loopback from address 127.0.0.<2 +
    client % 200>: clients at addresses of their own, as pods have, which the metrics
    server bounds one by one as well as together. With `small_window` its receive buffer
    and segments are as small as a client may ask for (before it connects, so that the
    window it offers is), so that the agent's sockets take some tens of KiB of an
    answer it does not read before the agent's write waits for it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if small_window:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.bind((f"127.0.0.{2 + client % 200}", 0))
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s


def _huge_heads(client: int, port: int, rounds: int) -> list[bytes]:
    """What the metrics port answers to requests with 98 header lines of 64 KiB, as
    many as the standard library's request parser takes, sent by `client`."""
    line = b"X-Pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"
    head = b"GET /metrics HTTP/1.1\r\nHost: m\r\n" + line * 98 + b"\r\n"
    answers = []
    for _ in range(rounds):
        with _connect_from(client, port) as s:
            s.settimeout(30)
            s.sendall(head)  # read past the bound only to be dropped
            answers.append(s.recv(64))
    return answers


async def test_huge_request_heads_on_the_metrics_port_cannot_exhaust_the_agent(
    setup: Setup, node_dirs: NodeDirs
) -> None:
    """An escape attempt on the node agent: a tenant's pod sends the metrics port, from
    as many connections as it serves, requests with 6 MiB heads, which the server's
    parser took whole (16 such connections held over 500 MiB in it, past the chart's
    memory limit). Each is answered 431 after a bounded head, and the agent's memory
    stays where it was, far from the 6 MiB a connection it would otherwise read."""
    setup.node.start()
    async with KubeletStandin(node_dirs.kubelet) as kubelet:
        await kubelet.wait_for_driver(setup.driver, timeout_s=60)
        assert setup.node.proc is not None
        pid = setup.node.proc.pid
        before = process_rss_mib(pid)
        answers: list[bytes] = []

        async def sender(client: int) -> None:
            got = await anyio.to_thread.run_sync(_huge_heads, client, setup.node.metrics_port, 4)
            answers.extend(got)

        async with anyio.create_task_group() as tg:
            for client in range(METRICS_MAX_CONNECTIONS):
                tg.start_soon(sender, client)
        after = process_rss_mib(pid)
    assert before is not None and after is not None
    assert len(answers) == 4 * METRICS_MAX_CONNECTIONS
    assert all(a.startswith(b"HTTP/1.0 431") for a in answers), set(answers)
    assert after - before < 64, (before, after)


def _shed_counts(answer: str) -> dict[str, float]:
    """The metrics port's closes in a metrics answer, by why (`action`)."""
    prefix = 'gpudra_metrics_connections_shed_total{action="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in answer.splitlines()
        if line.startswith(prefix)
    }


def _unread_scrape(client: int, port: int) -> socket.socket | None:
    """A scrape from `client` that never reads its answer, returned once the agent
    answers it (the answer's first byte peeked at, not read: the window stays shut);
    None when the agent closed it at once (its address at its own bound)."""
    s = _connect_from(client, port, small_window=True)
    try:
        s.settimeout(30)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
        if s.recv(1, socket.MSG_PEEK) == b"H":
            return s
    except OSError:
        pass  # closed at once, its request unread: a reset
    s.close()
    return None


def _many_gpus_profile(path: Path, gpus: int) -> Path:
    """The built-in 8-GPU H100 profile with `gpus` GPUs instead, written to `path`: a
    node whose metrics answer is large (a few KiB a GPU)."""
    profile = json.loads((REPO / "driver/nvml/profiles/h100-80gb-hbm3-x8.json").read_text())
    [product] = profile["products"]
    profile["gpus"] = [
        {
            "product": product,
            "uuid": f"GPU-{i:08x}-e2e0-4000-8000-{i:012x}",
            "minor": i,
            "busId": f"00000000:{16 + i:02X}:00.0",
            "pcieRoot": f"pci0000:{16 + i:02x}",
            "numaNode": i % 2,
        }
        for i in range(gpus)
    ]
    path.write_text(json.dumps(profile))
    return path


async def test_slow_readers_of_a_large_answer_on_the_metrics_port_cannot_starve_scrapes(
    setup: Setup, node_dirs: NodeDirs
) -> None:
    """An escape attempt on the node agent: tenants' pods fill the metrics port's bound
    with scrapes of a node whose answer is large (160 GPUs: about 430 KiB, asked for
    uncompressed) and never read them, 4 from each of 4 addresses, reopening each as it
    is closed. Held as being answered while the agent's writes waited for them, such
    connections kept every scrape out (until the deadline, set far here). An answer
    whose write has waited a moment for its client makes room for a new connection:
    each scrape from another address gets in, and a connection closed for it is
    counted `stalled`.

    Each scrape is preceded by a check that the bound is full, but a place can still
    free itself between that check and the scrape (a connection ending of itself, or
    one closed for the last scrape whose thread is still ending), and a scrape let in
    at a free place rightly closes nobody. So the scrapes go on until `rounds` closes
    were counted, three times as many scrapes at most: every one must get in."""
    # At 64 GPUs (170 KiB) the kernel's send buffer, which grows on loopback, took a
    # whole answer now and then, and its connection ended without stalling.
    gpus = 160
    profile = _many_gpus_profile(node_dirs.root / "many-gpus.json", gpus)
    setup.node.nvml = ("--nvml", f"emulated:{profile}")
    setup.node.start("--metrics-deadline", "600")
    await _wait_published(setup.kube, setup.driver, devices=gpus)
    port = setup.node.metrics_port
    addresses = METRICS_MAX_CONNECTIONS // METRICS_MAX_PER_CLIENT
    rounds = 5

    def metrics() -> str | None:
        try:
            return setup.node.metrics()
        except OSError:  # closed at once: every connection answered, none stalled yet
            return None

    held: list[socket.socket] = []

    def fill(client: int) -> int:
        """Unread scrapes from `client` until the agent closes one at once (its address
        at its own bound); how many it took."""
        opened = 0
        while (s := _unread_scrape(client, port)) is not None:
            held.append(s)
            opened += 1
            assert opened <= METRICS_MAX_PER_CLIENT, client
        return opened

    refills: list[int] = []  # what each pass opened: told when the count below fails

    async def fill_the_bound() -> None:
        """Every address at its own bound, so the bound is full of unread answers, as
        the agent counts them. A pass that opened some is checked by another once those
        have stalled: a connection may still end of itself (the kernel's buffers took
        its whole answer), or the agent may still count the last scrape's as open (the
        address that lost a place was then let in for another stalled one)."""
        for _ in range(10):
            opened = 0
            for client in range(addresses):
                opened += await anyio.to_thread.run_sync(fill, client)
            refills.append(opened)
            if not opened:
                return
            await anyio.sleep(2 * WRITE_STALL_S)
        raise AssertionError("the unread scrapes never filled the bound")

    try:
        for i in range(METRICS_MAX_CONNECTIONS):
            s = await anyio.to_thread.run_sync(_unread_scrape, i % addresses, port)
            assert s is not None, i
            held.append(s)
        shed: list[dict[str, float]] = []  # each scrape's count of closes, by why
        while len(shed) < 3 * rounds and (not shed or shed[-1].get("stalled", 0) < rounds):
            # Checked before each scrape, not assumed: a scrape let in with a place
            # free closes none for its place.
            await fill_the_bound()
            with anyio.fail_after(60):  # a hang guard: the deadline is 600 s
                while (answer := await anyio.to_thread.run_sync(metrics)) is None:
                    await anyio.sleep(0.1)
            shed.append(_shed_counts(answer))
        assert shed[-1].get("stalled", 0) >= rounds, (refills, shed)
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("shape", sorted(CRASH_SHAPES))
async def test_kill_at_every_prepare_step_then_restart_gives_the_same_result(
    setup: Setup, node_dirs: NodeDirs, shape: str
) -> None:
    """SIGKILL right after each durable step of a prepare, restart, prepare again:
    the same answer, and after unprepare nothing is left on the node or the GPUs
    (the emulated GPUs keep their state in a file, as real ones outlive the process).
    Every step of PREPARE_STEPS is covered by one of the shapes."""
    driver = setup.driver
    nvml, steps = CRASH_SHAPES[shape]
    steps = [*steps, "prepare-completed"]
    setup.node.nvml = (*nvml, "--nvml-state", str(node_dirs.root / "gpus.json"))
    if shape == "time-sliced-gpu":
        sharing = {
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
        }
        claim_spec = _gpu_claim(driver, _gpu_config(driver, sharing))
    elif shape == "mps-gpu":
        mps = {"defaultActiveThreadPercentage": 50}
        sharing = {"sharing": {"strategy": "MPS", "mpsConfig": mps}}
        claim_spec = _gpu_claim(driver, _gpu_config(driver, sharing))
    else:
        claim_spec = _mig_claim(driver)
    setup.node.start()
    await _wait_published(setup.kube, driver)
    claim = await anyio.to_thread.run_sync(setup.allocated_claim, "crashy", claim_spec)
    ref = ClaimRef(setup.namespace, claim["metadata"]["uid"], "crashy")
    async with KubeletStandin(node_dirs.kubelet) as kubelet:
        reg = await kubelet.wait_for_driver(driver, timeout_s=60)
        reference = (await kubelet.prepare(driver, [ref]))[ref.uid]
        assert reference.error is None
        assert node_dirs.prepared_claims() == [ref.uid]
        assert await kubelet.unprepare(driver, [ref]) == {ref.uid: None}
        for step in steps:
            assert setup.node.stop() == 0
            setup.node.start("--crash-at", step)
            reg = await kubelet.wait_for_driver(driver, timeout_s=60, replacing=reg)
            with pytest.raises(grpc.aio.AioRpcError):  # the process dies mid-call
                await kubelet.prepare(driver, [ref])
            assert setup.node.wait_exit() == -signal.SIGKILL, step
            setup.node.start()
            reg = await kubelet.wait_for_driver(driver, timeout_s=60, replacing=reg)
            again = (await kubelet.prepare(driver, [ref]))[ref.uid]
            assert again == reference, step
            assert await kubelet.unprepare(driver, [ref]) == {ref.uid: None}, step
            assert node_dirs.cdi_specs() == [], step
            assert node_dirs.prepared_claims() == [], step
            gpus = _gpu_state(node_dirs)
            assert [g["gpuInstances"] for g in gpus] == [[]] * len(gpus), step
            assert {g["computeMode"] for g in gpus} == {0}, step
    mps_dirs = node_dirs.state / "mps"
    assert not mps_dirs.exists() or not any(mps_dirs.iterdir())
    if shape == "time-sliced-gpu":
        calls = [c for c in node_dirs.tool_calls() if c.startswith("nvidia-smi compute-policy")]
        # Whatever a crashed process applied was reset afterwards: nothing is left set.
        assert calls[-1].endswith("--set-timeslice 0")
    if shape == "mps-gpu":
        starts = [c for c in node_dirs.tool_calls() if c.startswith("mps-control -d")]
        assert len(starts) >= len(steps)  # a daemon per prepare, each one gone again


def test_crash_shapes_cover_every_prepare_step() -> None:
    covered = {step for _, steps in CRASH_SHAPES.values() for step in steps}
    assert covered | {"prepare-completed"} == set(PREPARE_STEPS)


async def test_health_stream_follows_xids_and_recovery(
    setup: Setup, cluster: Cluster, node_dirs: NodeDirs
) -> None:
    """The kubelet's health stream carries the agent's health state: a critical XID
    makes the device unhealthy, an application XID does not, recovery clears it."""
    driver = setup.driver
    emu = load_nvml("emulated:h100-80gb-hbm3-x8")
    assert isinstance(emu, NvmlEmulator)
    config = AgentConfig(
        node_name=NODE,
        driver_name=driver,
        health=HealthPolicy(driver_name=driver, recovery_after_s=2.0),
    )
    plugin = PluginConfig(
        kubelet_root=node_dirs.kubelet,
        cdi_root=node_dirs.cdi,
        state_dir=node_dirs.state,
        dev_root=node_dirs.host,
        boot_id_path=node_dirs.boot_id,
        toolkit_spec=False,
    )
    akube = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig))
    try:
        service = NodeService(config, akube, emu, plugin)
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            async with KubeletStandin(node_dirs.kubelet) as kubelet:
                await kubelet.wait_for_driver(driver, timeout_s=60)
                async with kubelet.watch_health(driver) as updates:

                    async def next_state() -> dict[str, tuple[bool | None, str]]:
                        with anyio.fail_after(30):
                            health = await anext(updates)
                        return {h.device_name: (h.healthy, h.message) for h in health}

                    first = await next_state()
                    assert sorted(first) == [f"gpu-{i}" for i in range(8)]
                    assert all(healthy for healthy, _ in first.values())

                    emu.inject_xid(3, 13)  # application error: no taint effect
                    emu.inject_xid(2, 74)  # critical, and heals with time (no GPU reset)
                    state = await next_state()
                    while state["gpu-2"][0]:
                        state = await next_state()
                    assert state["gpu-2"] == (False, "XID 74 (critical error)")
                    assert state["gpu-3"][0] is True
                    assert all(state[f"gpu-{i}"][0] for i in (0, 1, 4, 5, 6, 7))

                    while not state["gpu-2"][0]:  # recovery_after_s without new errors
                        state = await next_state()
                    assert all(healthy for healthy, _ in state.values())
            tg.cancel_scope.cancel()
    finally:
        await akube.close()


async def test_device_metrics_name_the_pod_holding_an_idle_gpu(
    setup: Setup, cluster: Cluster, node_dirs: NodeDirs
) -> None:
    """The agent samples the emulated GPUs (scripted idle) and labels the held one's
    series with its pod, the container using the claim (read from the pod) and the
    GpuTenant its namespace belongs to (watched from the API server); `gpudra top --idle`
    finds it; the claim's status shows the GPU."""
    kube, driver = setup.kube, setup.driver
    script = node_dirs.root / "telemetry.json"
    script.write_text(json.dumps({str(i): {"utilization": 2} for i in range(8)}))
    tenant = f"t-{setup.namespace}"
    await anyio.to_thread.run_sync(apply_crd, kube, crd_manifest())
    tenant_body = {"apiVersion": TENANT_API, "kind": "GpuTenant", "metadata": {"name": tenant}}
    kube.request("POST", TENANTS, {**tenant_body, "spec": {"namespaces": [setup.namespace]}})
    options = ("--sample-interval", "0.2", "--nvml-script", str(script), "--claim-status")
    setup.node.start(*options)
    akube = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig))
    try:
        async with KubeletStandin(node_dirs.kubelet) as kubelet:
            await kubelet.wait_for_driver(driver, timeout_s=60)
            await _wait_published(kube, driver)
            pods = PodClaimsDriver(akube, kubelet, NODE, (driver,))
            async with anyio.create_task_group() as tg:
                await tg.start(pods.run)
                pod = await anyio.to_thread.run_sync(setup.pod, "idler", _gpu_claim(driver))
                done = await pods.wait_for(pod["metadata"]["uid"])
                assert done.error is None

                def billed() -> bool:
                    """Billed to the claim's DeviceClass (read from the claim)."""
                    return f'device_class="{driver}"' in setup.node.metrics()

                def contained() -> bool:
                    """The container using the claim, read from the pod (its status names
                    the claim generated from the template)."""
                    return 'container="main"' in setup.node.metrics()

                await anyio.to_thread.run_sync(
                    lambda: wait_for("the claim's device-seconds", billed, timeout=30)
                )
                await anyio.to_thread.run_sync(
                    lambda: wait_for("the holder's container label", contained, timeout=30)
                )
                metrics = setup.node.metrics()
                held = [
                    ln
                    for ln in metrics.splitlines()
                    if ln.startswith("gpudra_gpu_utilization_percent{") and 'pod="idler"' in ln
                ]
                assert len(held) == 1
                assert f'namespace="{setup.namespace}"' in held[0]
                assert f'tenant="{tenant}"' in held[0]
                assert 'container="main"' in held[0]
                assert "gpudra_device_idle_seconds{" in metrics
                assert held[0].endswith(" 2.0")

                url = f"{NODE}=http://127.0.0.1:{setup.node.metrics_port}/metrics"
                top = await anyio.run_process(
                    [
                        *(sys.executable, "-m", "gpudra.cli", "top", "--idle", "0s", "-o", "json"),
                        *("--kubeconfig", str(cluster.layout.admin_kubeconfig)),
                        *("--driver-name", driver, "--node", NODE, "--metrics", url),
                    ],
                    cwd=REPO,
                    check=False,
                )
                assert top.returncode == 0, top.stderr
                [row] = json.loads(top.stdout)
                assert row["state"] == f"held by {setup.namespace}/idler"
                assert row["utilization"] == 2

                [claim_ref] = done.claims[driver]

                def status_devices() -> list[dict[str, Any]]:
                    claim = kube.get("ResourceClaim", claim_ref.name, setup.namespace)
                    devices: list[dict[str, Any]] = claim["status"].get("devices") or []
                    return devices

                await anyio.to_thread.run_sync(
                    lambda: wait_for("the claim's status.devices", status_devices, timeout=30)
                )
                [entry] = status_devices()
                assert entry["driver"] == driver
                assert entry["data"]["sharing"] == "Exclusive"
                assert entry["data"]["gpuUUID"].startswith("GPU-")

                # A restart reads the prepared claim again: still billed to its class.
                assert setup.node.stop() == 0
                setup.node.start(*options)
                await anyio.to_thread.run_sync(
                    lambda: wait_for("the claim billed after a restart", billed, timeout=30)
                )
                tg.cancel_scope.cancel()
            assert setup.node.stop() == 0
    finally:
        await akube.close()
        try:
            kube.request("DELETE", f"{TENANTS}/{tenant}")
        except ApiError as e:
            if e.status != 404:
                raise
