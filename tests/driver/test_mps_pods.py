"""MPS control daemons in pods of their own: the pod the agent asks for, the sharing
backend's start, adoption and stop of a daemon pod, and the pods on a real API server.

The backend tests run each pod's command as a process of its own, as the kubelet
would run the container, with the stand-in `nvidia-cuda-mps-control`; the API side of
the same pods is the cluster test at the end, and the real kubelet runs them in
e2e/tests/test_realnode_gpus.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.common.kube import Kube as AsyncKube
from gpudra.driver.driverroot import CUDA_LIBRARY, NVML_LIBRARY
from gpudra.driver.mpspods import (
    CLAIM_LABEL,
    MpsDaemonPods,
    PodTemplateError,
    describe_problem,
    load_template,
)
from gpudra.driver.nvml.standin import FAKEBIN, TOOLS_LOG_ENV
from gpudra.driver.processes import ProcessIdentity
from gpudra.driver.records import DeviceDetails, MpsStarted, details_from_json, details_to_json
from gpudra.driver.sharing import MPS_SERVER, DaemonPod, MpsDaemon, NvidiaSharing, SharingError

from e2e.cluster.kube import Kube
from e2e.shared_libraries import shared_library

TEMPLATE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "gpudra-node-mps",
        "labels": {"app.kubernetes.io/component": "mps-daemon"},
    },
    "spec": {
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "mps-control-daemon",
                "image": "gpudra:test",
                "env": [
                    {"name": "KEEP", "value": "1"},
                    {"name": "CUDA_VISIBLE_DEVICES", "value": "x"},
                ],
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    },
}


class ProcessPods:
    """`DaemonPods` without a cluster: each pod's command runs as a process of its own,
    in its own session with only the pod's environment, as the kubelet runs a
    container; removing a pod terminates it (TERM, then KILL), as the kubelet does."""

    def __init__(self) -> None:
        self.pods: dict[str, tuple[DaemonPod, subprocess.Popen[bytes]]] = {}
        self.runs = 0
        # The host folders each pod was given: its own paths, then its /dev/shm.
        self.mounts: dict[str, tuple[tuple[Path, ...], Path | None]] = {}
        # Each pod's command and environment.
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def run(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        shm_dir: Path | None,
        *,
        folders: Sequence[Path],
    ) -> DaemonPod:
        self.runs += 1
        self.mounts[name] = (tuple(folders), shm_dir)
        self.commands[name] = (list(argv), dict(env))
        proc = subprocess.Popen(
            list(argv), env={"PATH": os.environ["PATH"], **env}, start_new_session=True
        )
        pod = DaemonPod(f"mps-{name}", str(uuid.uuid4()))
        self.pods[name] = (pod, proc)
        return pod

    def problem(self, pod: DaemonPod) -> str | None:
        for known, proc in self.pods.values():
            if known == pod:
                code = proc.poll()
                return None if code is None else f"ended (exit code {code})"
        return "is gone"

    def remove(self, name: str, uid: str | None, timeout_s: float) -> None:
        entry = self.pods.get(name)
        if entry is None or (uid is not None and entry[0].uid != uid):
            return
        proc = entry[1]
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        del self.pods[name]


@pytest.fixture
def tools_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "tools.log"
    monkeypatch.setenv(TOOLS_LOG_ENV, str(log))
    return log


def sharing(pods: ProcessPods | None, tools_log: Path, **env: str) -> NvidiaSharing:
    return NvidiaSharing(
        mps_control=FAKEBIN / "nvidia-cuda-mps-control",
        env={TOOLS_LOG_ENV: str(tools_log), **env},
        ready_timeout_s=5.0,
        pods=pods,
        pod_ready_timeout_s=10.0,
    )


def daemon(base: Path, identity: ProcessIdentity | DaemonPod | None = None) -> MpsDaemon:
    return MpsDaemon(
        "claim-1",
        base / "pipe",
        base / "log",
        ("GPU-1",),
        active_thread_percentage=50,
        pinned_memory_limits={"GPU-1": 2 << 30},
        shm_dir=base / "shm",
        identity=identity,
    )


def calls(tools_log: Path) -> list[str]:
    return [line.split(" pipe=")[0] for line in tools_log.read_text().splitlines()]


def test_a_daemon_pod_runs_the_daemon_in_the_foreground_and_gets_the_defaults(
    tmp_path: Path, tools_log: Path
) -> None:
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    identity = backend.start_mps(daemon(tmp_path))
    assert isinstance(identity, DaemonPod) and pods.problem(identity) is None
    assert (tmp_path / "pipe" / "control").is_fifo()
    assert calls(tools_log) == [
        "mps-control -f",
        "mps-control set_default_active_thread_percentage 50",
        "mps-control set_default_device_pinned_mem_limit GPU-1 2048M",
    ]
    proc = pods.pods["claim-1"][1]

    backend.stop_mps(daemon(tmp_path, identity))
    assert calls(tools_log)[-1] == "mps-control quit"
    assert proc.poll() == 0  # the daemon quit; its pod ended with it
    assert not pods.pods
    assert not any((tmp_path / d).exists() for d in ("pipe", "log", "shm"))


def test_a_multi_user_daemon_runs_with_dash_m_in_a_pod_and_as_a_child(
    tmp_path: Path, tools_log: Path
) -> None:
    """`mpsConfig.multiUser` starts NVIDIA's control daemon with `-M`, as upstream does,
    however it runs: in the foreground in a pod of its own, or forked by the agent."""
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    multi_user = dataclasses.replace(daemon(tmp_path / "pod"), multi_user=True)
    identity = backend.start_mps(multi_user)
    try:
        assert calls(tools_log)[0] == "mps-control -f -M"
    finally:
        backend.stop_mps(dataclasses.replace(multi_user, identity=identity))
    tools_log.write_text("")
    child = dataclasses.replace(daemon(tmp_path / "child"), multi_user=True)
    started = sharing(None, tools_log).start_mps(child)
    try:
        assert calls(tools_log)[0] == "mps-control -d -M"
    finally:
        sharing(None, tools_log).stop_mps(dataclasses.replace(child, identity=started))
    assert not daemon(tmp_path / "pod").multi_user  # the default: one user per server


def test_a_daemon_pod_gets_only_its_claims_folders(tmp_path: Path, tools_log: Path) -> None:
    """The pod sees of the agent's folders only the claim's: the pipe and log folders its
    environment names, and its /dev/shm; the claim's containers talk to it."""
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    identity = backend.start_mps(daemon(tmp_path))
    try:
        assert pods.mounts["claim-1"] == ((tmp_path / "pipe", tmp_path / "log"), tmp_path / "shm")
    finally:
        backend.stop_mps(daemon(tmp_path, identity))


def test_a_daemon_pod_runs_the_tool_of_the_driver_root_with_its_libraries(
    tmp_path: Path, tools_log: Path
) -> None:
    """The chart's agent sees the driver root under /host, and so does the daemon's
    pod (it mounts the root at the same path): the pod runs the tool found there, with
    the root's NVML and CUDA preloaded, as the agent's own tools get them. NVIDIA's
    daemon starts its server by name from its PATH, which the pod's image leaves
    without one: the root's server folder (`/usr/sbin`, as Debian has it) ends it."""
    host = tmp_path / "host"
    seen = host / "run/nvidia/driver"
    nvml = shared_library(seen / "usr/lib64" / NVML_LIBRARY, NVML_LIBRARY)
    cuda = shared_library(seen / "usr/lib64" / CUDA_LIBRARY, CUDA_LIBRARY)
    tool = seen / "usr/bin" / "nvidia-cuda-mps-control"
    tool.parent.mkdir(parents=True)
    shutil.copy(FAKEBIN / "nvidia-cuda-mps-control", tool)
    server = seen / "usr/sbin" / MPS_SERVER
    server.parent.mkdir(parents=True)
    shutil.copy(FAKEBIN / MPS_SERVER, server)
    pods = ProcessPods()
    backend = NvidiaSharing(
        driver_root=Path("/run/nvidia/driver"),
        host_view=host,
        env={TOOLS_LOG_ENV: str(tools_log)},
        ready_timeout_s=5.0,
        pods=pods,
        pod_ready_timeout_s=10.0,
    )
    identity = backend.start_mps(daemon(tmp_path))
    try:
        argv, env = pods.commands["claim-1"]
        assert argv[-1] == str(tool)
        assert env["LD_PRELOAD"] == f"{nvml}:{cuda}"
        assert env["PATH"] == f"{os.environ['PATH']}:{server.parent}"
        assert env[TOOLS_LOG_ENV] == str(tools_log)
        assert calls(tools_log)[0] == "mps-control -f"
        assert tools_log.read_text().splitlines()[0].endswith(f" server={server}")
    finally:
        backend.stop_mps(daemon(tmp_path, identity))


def test_a_daemon_pod_that_fails_is_removed_and_named(tmp_path: Path, tools_log: Path) -> None:
    pods = ProcessPods()
    backend = sharing(pods, tools_log, GPUDRA_FAKE_MPS_FAIL="1")
    with pytest.raises(SharingError) as caught:
        backend.start_mps(daemon(tmp_path))
    assert "its pod mps-claim-1 ended (exit code 1)" in str(caught.value)
    assert not pods.pods
    # Nothing is left: no mounted /dev/shm, no folders.
    assert not any((tmp_path / d).exists() for d in ("pipe", "log", "shm"))


def test_a_daemon_pod_whose_daemon_never_listens_is_removed_and_named(
    tmp_path: Path, tools_log: Path
) -> None:
    """A daemon that makes its control pipe and then hangs (the pod runs, so the pod
    shows no problem) gets the pod's start timeout; the error says what it waited
    for and where to look, and the pod is gone."""
    hung = tmp_path / "nvidia-cuda-mps-control"
    hung.write_text('#!/bin/sh\nmkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"\nexec sleep 600\n')
    hung.chmod(0o755)
    pods = ProcessPods()
    backend = NvidiaSharing(mps_control=hung, pods=pods, pod_ready_timeout_s=2.0)
    base = tmp_path / "claim"
    with pytest.raises(SharingError) as caught:
        backend.start_mps(daemon(base))
    assert (
        f"the daemon in pod mps-claim-1 did not listen on its control pipe "
        f"{base / 'pipe' / 'control'} within 2s; see the pod's events and the logs in "
        f"{base / 'log'}"
    ) in str(caught.value)
    assert not pods.pods


def test_a_retried_start_adopts_the_recorded_daemon_pod(tmp_path: Path, tools_log: Path) -> None:
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    first = backend.start_mps(daemon(tmp_path))
    again = backend.start_mps(daemon(tmp_path, first))
    assert again == first and pods.runs == 1
    backend.stop_mps(daemon(tmp_path, first))


def test_a_start_without_a_record_replaces_a_leftover_pod(tmp_path: Path, tools_log: Path) -> None:
    """A crash between creating the pod and recording it: the retry starts afresh."""
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    first = backend.start_mps(daemon(tmp_path))
    pods.remove("claim-1", first.uid if isinstance(first, DaemonPod) else None, 5)
    second = backend.start_mps(daemon(tmp_path))
    assert second != first and pods.runs == 2
    backend.stop_mps(daemon(tmp_path))  # no record of the pod: removed by its name
    assert not pods.pods


@pytest.mark.parametrize("left", ["nothing", "the empty mount point"])
def test_the_daemon_pod_ends_once_its_pipe_folder_is_removed(
    tmp_path: Path, tools_log: Path, left: str
) -> None:
    """An older agent knows nothing of pods; its unprepare removes the claim's folders
    (`shutil.rmtree`, errors ignored), and the daemon must not outlive them. Where the
    pipe folder is a tmpfs of its own, what is left is its mount point, emptied."""
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    identity = backend.start_mps(daemon(tmp_path))
    proc = pods.pods["claim-1"][1]
    pipe = tmp_path / "pipe"
    if left == "nothing" and pipe.is_mount():
        subprocess.run(["umount", "--lazy", str(pipe)], check=True)
    elif left == "the empty mount point" and not pipe.is_mount():
        pytest.skip("the pipe folder is a tmpfs only where the agent may mount one")
    shutil.rmtree(pipe, ignore_errors=True)
    assert proc.wait(timeout=30) == 0  # a normal end: the pod Succeeded
    backend.stop_mps(daemon(tmp_path, identity))  # what is left: the pod, the folders
    assert not pods.pods and not (tmp_path / "shm").exists() and not pipe.exists()


def test_a_pod_record_needs_an_agent_that_runs_pods(tmp_path: Path, tools_log: Path) -> None:
    with pytest.raises(SharingError) as caught:
        sharing(None, tools_log).stop_mps(daemon(tmp_path, DaemonPod("mps-claim-1", "u-1")))
    assert "--mps-daemon-pod-template" in str(caught.value)


def test_an_agent_with_pods_stops_a_daemon_an_older_agent_started_as_its_child(
    tmp_path: Path, tools_log: Path
) -> None:
    """After an upgrade from a release that ran daemons as its children (a host
    process agent's outlive it), the new agent still stops them by their record."""
    identity = sharing(None, tools_log).start_mps(daemon(tmp_path))
    assert isinstance(identity, ProcessIdentity)
    pods = ProcessPods()
    sharing(pods, tools_log).stop_mps(daemon(tmp_path, identity))
    assert not identity.alive()
    assert calls(tools_log)[-1] == "mps-control quit" and pods.runs == 0


def test_a_retry_in_an_agent_with_pods_ends_the_daemon_a_first_attempt_started(
    tmp_path: Path, tools_log: Path
) -> None:
    """A prepare that a host-process agent began, retried by one that runs pods: the
    first daemon is ended before the pod starts, never two daemons for one claim."""
    first = sharing(None, tools_log).start_mps(daemon(tmp_path))
    assert isinstance(first, ProcessIdentity)
    pods = ProcessPods()
    backend = sharing(pods, tools_log)
    second = backend.start_mps(daemon(tmp_path, first))
    assert isinstance(second, DaemonPod) and not first.alive()
    backend.stop_mps(daemon(tmp_path, second))


def test_a_daemon_pod_is_recorded_and_read_back() -> None:
    started = MpsStarted(
        pipe_dir=Path("/s/mps/u/pipe"),
        log_dir=Path("/s/mps/u/log"),
        uuids=("GPU-1",),
        daemon=DaemonPod("gpudra-node-mps-u", "5d1c"),
    )
    wire = details_to_json(DeviceDetails(type="gpu", mps=started))
    assert wire["mps"]["daemonPod"] == "gpudra-node-mps-u"
    assert wire["mps"]["daemonPodUid"] == "5d1c"
    assert "daemonPid" not in wire["mps"]
    assert details_from_json(json.loads(json.dumps(wire))).mps == started


# --- the pod asked for --------------------------------------------------------------------


def test_the_pod_is_the_template_bound_to_the_node_with_the_daemons_command() -> None:
    pods = MpsDaemonPods(None, namespace="gpudra", node_name="gpu-1", template=TEMPLATE)  # type: ignore[arg-type]
    pod = pods.manifest(
        "uid-1",
        ["sh", "-c", "x"],
        {"CUDA_VISIBLE_DEVICES": "GPU-1"},
        Path("/s/shm"),
        folders=(Path("/s/pipe"), Path("/s/log")),
    )
    assert pod["metadata"]["name"] == "gpudra-node-mps-uid-1"
    assert pod["metadata"]["namespace"] == "gpudra"
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/component": "mps-daemon",
        CLAIM_LABEL: "uid-1",
    }
    spec = pod["spec"]
    assert (spec["nodeName"], spec["restartPolicy"]) == ("gpu-1", "Never")
    container = spec["containers"][0]
    assert container["command"] == ["sh", "-c", "x"]
    assert container["env"] == [
        {"name": "KEEP", "value": "1"},
        {"name": "CUDA_VISIBLE_DEVICES", "value": "GPU-1"},
    ]
    # The template's volumes, then the claim's folders: each at its own path (the
    # agent's, so the paths in the environment mean the same), its shm as /dev/shm.
    assert container["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "claim-folder-1", "mountPath": "/s/pipe"},
        {"name": "claim-folder-2", "mountPath": "/s/log"},
        {"name": "claim-shm", "mountPath": "/dev/shm"},
    ]
    assert spec["volumes"] == [
        {"name": "tmp", "emptyDir": {}},
        {"name": "claim-folder-1", "hostPath": {"path": "/s/pipe", "type": "Directory"}},
        {"name": "claim-folder-2", "hostPath": {"path": "/s/log", "type": "Directory"}},
        {"name": "claim-shm", "hostPath": {"path": "/s/shm", "type": "Directory"}},
    ]
    assert TEMPLATE["spec"]["containers"][0].get("command") is None  # the template is kept


def test_a_template_that_mounts_the_whole_state_folder_still_makes_a_valid_pod() -> None:
    """An older chart's template mounts the agent's state folder: the claim's folders
    are mounted again beneath it (the runtime mounts parents first), under names and
    paths of their own, so the API server takes the pod."""
    older = json.loads(json.dumps(TEMPLATE))
    older["spec"]["volumes"].append({"name": "state", "hostPath": {"path": "/s"}})
    older["spec"]["containers"][0]["volumeMounts"].append({"name": "state", "mountPath": "/s"})
    pods = MpsDaemonPods(None, namespace="gpudra", node_name="gpu-1", template=older)  # type: ignore[arg-type]
    base = Path("/s/mps/uid-1")
    pod = pods.manifest(
        "uid-1", ["sh"], {}, base / "shm", folders=(base / "pipe", base / "log", base / "pipe")
    )
    volumes = [v["name"] for v in pod["spec"]["volumes"]]
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert len(volumes) == len(set(volumes)) == 5  # a folder named twice is mounted once
    assert len({m["mountPath"] for m in mounts}) == len(mounts) == 5
    assert {m["name"] for m in mounts} == set(volumes)
    assert [m["mountPath"] for m in mounts][-3:] == [
        str(base / "pipe"),
        str(base / "log"),
        "/dev/shm",
    ]


@pytest.mark.parametrize("name", ["claim-shm", "claim-folder-1"])
def test_a_template_may_not_use_the_names_of_a_claims_volumes(tmp_path: Path, name: str) -> None:
    """The agent adds them to every daemon pod: the same name twice is a pod the API
    server refuses at every MPS claim, so the agent refuses the template at start."""
    template = json.loads(json.dumps(TEMPLATE))
    template["spec"]["volumes"].append({"name": name, "emptyDir": {}})
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(template))
    with pytest.raises(PodTemplateError) as caught:
        load_template(path)
    assert repr(name) in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        ({"phase": "Pending"}, None),
        ({"phase": "Running"}, None),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {"state": {"waiting": {"reason": "ErrImageNeverPull", "message": "no image"}}}
                ],
            },
            "cannot start its container: ErrImageNeverPull: no image",
        ),
        (
            {
                "phase": "Failed",
                "containerStatuses": [
                    {"state": {"terminated": {"reason": "Error", "exitCode": 1}}}
                ],
            },
            "ended (Error, exit code 1); see its log",
        ),
    ],
)
def test_a_pod_that_cannot_serve_says_why(status: dict[str, Any], problem: str | None) -> None:
    pod = {"metadata": {"uid": "u-1"}, "status": status}
    assert describe_problem(pod, "u-1") == problem


def test_another_pod_under_the_name_is_not_the_daemons() -> None:
    pod = {"metadata": {"uid": "u-2"}, "status": {"phase": "Running"}}
    assert describe_problem(pod, "u-1") == "was replaced by another pod of the same name"


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("not json", "cannot read a JSON Pod"),
        ('{"kind": "Deployment"}', "kind: Pod"),
        ('{"kind": "Pod", "metadata": {}, "spec": {}}', "metadata.name"),
        (
            '{"kind": "Pod", "metadata": {"name": "m"}, "spec": {"containers": []}}',
            "spec.containers",
        ),
        (
            '{"kind": "Pod", "metadata": {"name": "m"}, "spec": {"containers": [{"name": "c"}]}}',
            "spec.containers[0].image",
        ),
    ],
)
def test_a_bad_template_names_the_field(tmp_path: Path, content: str, field: str) -> None:
    path = tmp_path / "pod.json"
    path.write_text(content)
    with pytest.raises(PodTemplateError) as caught:
        load_template(path)
    assert field in str(caught.value) and str(path) in str(caught.value)


# --- on the API server --------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.anyio
async def test_daemon_pods_on_the_api_server(kube: Kube, akube: AsyncKube) -> None:
    """Created bound to the node, told apart from a later pod of the same name, and
    deleted even where no kubelet confirms it (forced after the grace wait)."""
    ns = f"mps-pods-{secrets.token_hex(3)}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        pods = MpsDaemonPods(
            akube, namespace=ns, node_name="no-kubelet-here", template=TEMPLATE, leftover_wait_s=1
        )
        run = functools.partial(pods.run, folders=())
        pod = await anyio.to_thread.run_sync(run, "uid-1", ["sleep", "1"], {"A": "1"}, None)
        got = kube.get("Pod", pod.name, ns)
        assert got["metadata"]["uid"] == pod.uid
        assert got["spec"]["nodeName"] == "no-kubelet-here"
        assert await anyio.to_thread.run_sync(pods.problem, pod) is None  # pending

        # A leftover of the same name (a crash before the record) is replaced.
        second = await anyio.to_thread.run_sync(run, "uid-1", ["sleep", "1"], {}, None)
        assert second.uid != pod.uid
        assert await anyio.to_thread.run_sync(pods.problem, pod) == (
            "was replaced by another pod of the same name"
        )
        # The first pod's UID no longer deletes the second.
        await anyio.to_thread.run_sync(pods.remove, "uid-1", pod.uid, 1.0)
        assert kube.get("Pod", second.name, ns)["metadata"]["uid"] == second.uid

        await anyio.to_thread.run_sync(pods.remove, "uid-1", second.uid, 1.0)
        assert kube.get_or_none("Pod", second.name, ns) is None
        assert await anyio.to_thread.run_sync(pods.problem, second) == "is gone"
    finally:
        kube.delete("Namespace", ns)
