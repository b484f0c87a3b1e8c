"""gpudra on the real node as a platform team installs it: the image `make image`
builds, imported into the node's containerd, and the Helm chart's node DaemonSet and
webhook Deployment running as pods on `real-1`.

This is the path `make e2e-kind` takes on kind (e2e/kind), run where no Docker engine
exists: the same chart, the same image, the agent's emulated-GPU defaults (numbered
device nodes in the CDI specs, a stand-in driver root under its state dir), the
chart's RBAC and its ValidatingAdmissionPolicy checked against the agent's real
service-account token. What differs from kind, and why (`ChartStack.values`):
- no kube-proxy runs here, so both components use `hostNetwork` and reach the API
  server at the address `kubernetesApi` gives; the API server calls the webhook at
  its endpoint (the harness routes to endpoints). `webhook_on_pod_network` runs the
  webhook on the pod network, as the chart does by default, for the tests that need
  it, with the host routing the `kubernetes` Service's address meanwhile;
- the node's own kubelet root and CDI folder; a state dir under the node's folder;
- the node's GPU profile (the same as the host-process installation's) is read from
  the state dir, which the agent sees at the same path.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudra.cli.node import EMULATED_NVML_STATE, EMULATED_TOOLS_LOG
from gpudra.driver.mpspods import CLAIM_LABEL
from gpudra.driver.nvml.standin import install_driver_root

from e2e.cluster.harness import REPO
from e2e.cluster.kube import ApiError, Kube, wait_for
from e2e.image import build as image
from e2e.node.gpus import DRIVER, NodeGpus
from e2e.node.realnode import NodeError, NodeState, unavailable_reason
from e2e.node.realnode import build as build_containerd
from e2e.node.service_route import api_service_route, route_unavailable_reason, service_address
from e2e.processes import free_port
from e2e.progress import BuildFailed, build_script, run_build
from e2e.tools import helm as h

RELEASE = "gpudra"
NAMESPACE = "gpudra"
IMAGE_REPOSITORY = "gpudra.local/gpudra"
IMAGE_TAG = "e2e"
# What a Helm release adopts when the host-process installation made it before.
ADOPTED = (
    ("DeviceClass", "gpu.nvidia.com"),
    ("DeviceClass", "mig.nvidia.com"),
    ("DeviceClass", "gpu-shared.nvidia.com"),
    ("CustomResourceDefinition", "gputenants.gpudra.io"),
)
SIGKILL_EXIT = 128 + 9
# `gpudra node` flags the chart sets from values of its own, and refuses in
# node.extraArgs so that it can check them: given to `agent_flags`, they set the value.
VALUE_FLAGS = {"--accounting-zero-window": "accountingZeroWindowSeconds"}
RELEASE_BUILD = REPO / "e2e" / "tools" / "build-release.sh"


@dataclass(frozen=True)
class ChartBuild:
    """Which gpudra the release installs: a chart folder and the image its values name.
    `archive` is that image, built already; None builds the working tree's at install."""

    chart: Path
    tag: str
    archive: Path | None = None


WORKING_TREE = ChartBuild(h.CHART, IMAGE_TAG)


def previous_release() -> ChartBuild:
    """The release pinned in e2e/tools/versions.env, exported from git and its image
    built by its own build script on first use (cached per commit)."""
    try:
        cache = build_script(
            RELEASE_BUILD,
            prefix="build-release",
            what="building the previous release",
            env={**os.environ, "PYTHON": sys.executable},
        )
    except BuildFailed as e:
        raise NodeError(f"the previous release could not be built: {e}") from e
    return ChartBuild(
        cache / "src" / "charts" / "gpudra",
        (cache / "tag").read_text().strip(),
        cache / "gpudra.oci.tar",
    )


def chart_unavailable_reason() -> str | None:
    """Why the chart cannot be installed here (helm or the image cannot be built)."""
    try:
        h.helm_binary()
    except h.HelmUnavailable as e:
        return f"helm: {e}"
    if not image.base_cached() and not image.debootstrap_installable():
        return "the image needs debootstrap for its base layer: apt-get install debootstrap"
    return None


def chart_node_unavailable_reason() -> str | None:
    """Why the chart cannot be installed on a real node here, for a test to skip with:
    no real node (`unavailable_reason`), or no chart (`chart_unavailable_reason`)."""
    if reason := unavailable_reason():
        return f"no real node on this machine: {reason}"
    if reason := chart_unavailable_reason():
        return f"the chart cannot be installed here: {reason}"
    return None


class ChartStack(NodeGpus):
    """The chart's release `gpudra` on the real node, with emulated GPUs."""

    name = "chart"

    def __init__(self, node: Any, build: ChartBuild = WORKING_TREE) -> None:
        super().__init__(node)
        self.root = node.layout.root / "gpudra-chart"
        self.build = build
        self._ports: dict[str, int] = {}

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def tools_log(self) -> Path:
        return self.state_dir / EMULATED_TOOLS_LOG

    @property
    def nvml_state_path(self) -> Path:
        return self.state_dir / EMULATED_NVML_STATE

    @property
    def metrics_port(self) -> int:
        return self.ports["metrics"]

    @property
    def ports(self) -> dict[str, int]:
        """The webhook's and the agent's metrics port: on the host's network."""
        if not self._ports:
            saved = self.root / "ports.json"
            if saved.exists():
                self._ports = json.loads(saved.read_text())
            else:
                self._ports = {"webhook": free_port(), "metrics": free_port()}
                self.root.mkdir(parents=True, exist_ok=True)
                saved.write_text(json.dumps(self._ports))
        return self._ports

    @property
    def host_driver_root(self) -> Path:
        """A driver root on the node's host, where `driver_root_on_host` installs one."""
        return self.root / "driver"

    def values(
        self,
        *,
        node_args: list[str] | None = None,
        api_host: str = "127.0.0.1",
        api_port: int | None = None,
        driver_root: Path | None = None,
        webhook: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        cluster = self.node.cluster
        lay = self.node.layout
        pin = {"kubernetes.io/hostname": self.node.name}
        values: dict[str, Any] = {
            "image": {"repository": IMAGE_REPOSITORY, "tag": self.build.tag, "pullPolicy": "Never"},
            "kubernetesApi": {
                "host": api_host,
                "port": api_port or cluster.require_state().ports["apiserver"],
            },
            "node": {
                "nvml": f"emulated:{self.state_dir / 'profile.json'}",
                "sharedGpus": self.shared_gpus(),
                "kubeletRoot": str(lay.kubelet_root),
                "cdiRoot": str(lay.cdi),
                "stateDir": str(self.state_dir),
                "hostNetwork": True,
                "metricsPort": self.ports["metrics"],
                "nodeSelector": pin,
                "extraArgs": ["--cleanup-interval=5"],
            },
            "webhook": {
                "hostNetwork": True,
                "port": self.ports["webhook"],
                "nodeSelector": pin,
                **(webhook or {}),
            },
        }
        for arg in node_args or []:
            flag, _, value = arg.partition("=")
            if flag in VALUE_FLAGS:
                values["node"][VALUE_FLAGS[flag]] = float(value) if "." in value else int(value)
            else:
                values["node"]["extraArgs"].append(arg)
        if driver_root is not None:
            values["node"]["driverRoot"] = str(driver_root)
        return values

    # --- lifecycle -----------------------------------------------------------------

    def up(self, *, webhook: bool = True, log: Callable[[str], None] = print) -> None:
        """Image into containerd, profile into the state dir, then `helm upgrade
        --install --wait`; returns once the pool is published, the kubelet has the
        plugin and the webhook is registered."""
        del webhook  # the chart always runs it
        start = time.monotonic()
        kube = self.node.cluster.kube()
        self.root.mkdir(parents=True, exist_ok=True)
        # A release an interrupted run left behind has other ports and values.
        self.down(log=lambda _m: None)
        self.prepare_node()
        self._adopt(kube)
        mark = self.kubelet_log_size()
        self._helm_upgrade(self.values(), wait=True)
        wait_for(f"{self.node.name}'s pool published", lambda: self.published(kube), timeout=90)
        self.wait_registered(mark)
        wait_for("the webhook registered", lambda: webhook_ready(kube), timeout=90)
        wait_for("the API server reaching the webhook", lambda: webhook_answers(kube), timeout=60)
        log(
            f"gpudra chart on {self.node.name}: pods running, pool published and the "
            f"plugin registered in {time.monotonic() - start:.1f}s"
        )

    def down(self, log: Callable[[str], None] = print) -> None:
        """Uninstalls the release, if there is one, and waits for its pods to go."""
        kube = self.node.cluster.kube()
        if not self._installed():
            return
        self._helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "2m")
        # Not Helm's: MPS daemon pods of claims still prepared when the agent went (or
        # left as Completed by an older release that knows nothing of them).
        for pod in kube.list("Pod", NAMESPACE, labelSelector=CLAIM_LABEL):
            kube.delete("Pod", pod["metadata"]["name"], NAMESPACE, grace=0)
        wait_for(
            "the chart's pods gone",
            lambda: not [p for p in kube.list("Pod", NAMESPACE) if _chart_pod(p)],
            timeout=120,
        )
        log(f"gpudra chart removed from {self.node.name}")

    def upgrade_to(self, build: ChartBuild) -> None:
        """`helm upgrade` of the running release to `build`'s chart and image, values
        unchanged, as a platform team upgrades (or rolls back) with GPU pods running;
        returns once every pod of the release is ready, the agent pod runs that image
        and the kubelet has connected to it."""
        # 0.1.0's webhook applied its whole configurations with force, so the chart's
        # changes to them conflict with it: docs/install.md has that upgrade force them.
        force = self.build is not WORKING_TREE and build is WORKING_TREE
        self.build = build
        self._import_image(self._node_state())
        self._roll(self.values(), wait=True, force_conflicts=force)
        wait_for("the webhook registered", lambda: webhook_ready(self.node.cluster.kube()))

    def roll_unwaited(self, build: ChartBuild) -> None:
        """`helm upgrade` to `build` as `upgrade_to` does, without waiting for its agent:
        for one that is to refuse to start."""
        force = self.build is not WORKING_TREE and build is WORKING_TREE
        self.build = build
        self._import_image(self._node_state())
        self._helm_upgrade(self.values(), wait=False, force_conflicts=force)

    def agent_log(self, *, previous: bool = False) -> str:
        """The agent container's log, as `kubectl logs` shows it (`previous`: that of the
        container before its last restart)."""
        pod = self._agent_pod(self.node.cluster.kube())["metadata"]["name"]
        flags = ["--previous"] if previous else []
        out = self.node.cluster.kubectl("logs", "-n", NAMESPACE, pod, *flags)
        assert out.returncode == 0, out.stderr
        return str(out.stdout)

    def agent_output(self) -> str:
        return self.agent_log()

    def agent_image_restarts(self) -> tuple[str, int] | None:
        """The image and restart count of the one agent pod not being deleted (None:
        none such, as while a rollout replaces it)."""
        kube = self.node.cluster.kube()
        pods = [
            p
            for p in kube.list("Pod", NAMESPACE)
            if _agent(p) and not p["metadata"].get("deletionTimestamp")
        ]
        if len(pods) != 1:
            return None
        image = pods[0]["spec"]["containers"][0]["image"]
        statuses = pods[0]["status"].get("containerStatuses") or [{}]
        return str(image), int(statuses[0].get("restartCount", 0))

    @contextlib.contextmanager
    def crashing_at(self, step: str) -> Iterator[Callable[[], None]]:
        kube = self.node.cluster.kube()
        self._roll(self.values(node_args=[f"--crash-at={step}"]))
        before = self._agent_restarts(kube)

        def crashed() -> None:
            wait_for(
                "the agent container SIGKILLed",
                lambda: self._agent_restarts(kube) > before,
                timeout=120,
            )
            status = self._agent_pod(kube)["status"]["containerStatuses"][0]
            assert status["lastState"]["terminated"]["exitCode"] == SIGKILL_EXIT, status

        try:
            yield crashed
        finally:
            self._roll(self.values())

    @contextlib.contextmanager
    def agent_flags(self, *flags: str) -> Iterator[None]:
        self._roll(self.values(node_args=list(flags)))
        try:
            yield
        finally:
            self._roll(self.values())

    @contextlib.contextmanager
    def driver_root_on_host(
        self, arrange: Callable[[Path], object] | None = None
    ) -> Iterator[Path]:
        """Inside, `node.driverRoot` names a stand-in driver root installed on the host
        rather than `/`, as with a driver container's `/run/nvidia/driver`: the chart
        mounts it under /host in the agent and its MPS daemon pods, whose image holds
        no driver files. `arrange` lays the installed root out otherwise (as a
        distribution's packages do) before the agent starts on it. Yields the root's
        host path.

        The chart mounts the root HostToContainer, which the runtime allows only from
        a shared (or slave) mount. systemd makes a node's / shared; this machine's is
        private, so the root is a bind mount of its own, shared."""
        root = self.host_driver_root
        _unmount(root)  # left by an interrupted run
        install_driver_root(root, str(self.profile()["driverVersion"]))
        if arrange is not None:
            try:
                arrange(root)
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
        try:
            subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
            subprocess.run(["mount", "--make-shared", str(root)], check=True)
            self._roll(self.values(driver_root=root))
            yield root
        finally:
            self._roll(self.values())
            _unmount(root)
            shutil.rmtree(root, ignore_errors=True)

    @contextlib.contextmanager
    def api_unreachable(self) -> Iterator[None]:
        """Only the agent loses the API. `kubernetesApi` is the webhook's too, and its
        pod, rolled to the wrong address, would never be ready without the API (nor
        would the one rolled back be at once), leaving pod admission without endpoints:
        its Deployment is paused meanwhile, and the webhook is ready again after."""
        kube = self.node.cluster.kube()
        _pause_webhook(kube, paused=True)
        try:
            self._roll(self.values(api_port=1))
            try:
                yield
            finally:
                self._roll(self.values())
        finally:
            _pause_webhook(kube, paused=False)
            wait_for("the webhook ready", lambda: webhook_ready(kube), timeout=180)

    @contextlib.contextmanager
    def webhook_on_node_network(self) -> Iterator[None]:
        """Inside, one webhook replica on the node's network with its own CA, as this
        node runs the chart already (`values`): nothing to change here."""
        yield

    def pod_network_unreachable(self, kube: Kube) -> str | None:
        """Why pods on the pod network cannot reach the API server here, or None: the
        host must be able to take the `kubernetes` Service's address (no kube-proxy
        runs beside this node)."""
        return route_unavailable_reason(service_address(kube)[0])

    @contextlib.contextmanager
    def webhook_on_pod_network(self) -> Iterator[Callable[[int], None]]:
        """Inside, the webhook runs as the chart runs it by default, on the pod network
        (a surge pod rolls it), with the replicas the yielded function sets
        (`webhook_replicas`: an upgrade, waited for). Both components reach the API
        server at the `kubernetes` Service's address, which the host routes meanwhile
        (`api_service_route`: no kube-proxy runs here); after, the release is as it
        was."""
        kube = self.node.cluster.kube()
        api_port = self.node.cluster.require_state().ports["apiserver"]
        with api_service_route(kube, api_port) as (host, port):

            def upgrade(webhook: dict[str, Any], force_conflicts: bool, first: bool) -> None:
                webhook = {"hostNetwork": False, **webhook}
                values = self.values(api_host=host, api_port=port, webhook=webhook)
                if first:  # the agent rolls too, to the Service's address
                    self._roll(values, wait=True, force_conflicts=force_conflicts)
                else:  # the webhook's values alone change
                    self._helm_upgrade(values, wait=True, force_conflicts=force_conflicts)

            try:
                yield webhook_replicas(kube, "self", upgrade)
            finally:
                self._roll(self.values(), wait=True)
                wait_for("the webhook registered", lambda: webhook_ready(kube), timeout=90)

    # --- what differs on kind (e2e/kind/gpus.py) -----------------------------------

    def prepare_node(self) -> None:
        """The image in the node's containerd, the GPU profile in the state dir."""
        self._import_image(self._node_state())
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "profile.json").write_text(json.dumps(self.profile(), indent=2))

    # --- internals -----------------------------------------------------------------

    def _node_state(self) -> NodeState:
        state = NodeState.load(self.node.layout.state)
        if state is None or not state.ready:
            raise NodeError(f"node {self.node.name} is not up: run `make node-up` first")
        return state

    def _import_image(self, state: NodeState) -> None:
        ctr = build_containerd()
        archive = self.build.archive or self.build_image()
        self.node.ctr(ctr, "images", "import", "--snapshotter", state.snapshotter, str(archive))

    def build_image(self) -> Path:
        """The one image, as `make image` builds it, tagged for the chart's values."""
        archive = self.root / "gpudra.oci.tar"
        argv = [
            sys.executable,
            str(REPO / "e2e" / "image" / "build.py"),
            "--out",
            str(archive),
            "--name",
            f"{IMAGE_REPOSITORY}:{IMAGE_TAG}",
        ]
        try:
            run_build(argv, prefix="image", what="building the image", timeout=600)
        except BuildFailed as e:
            raise NodeError(f"building the image failed: {e}") from e
        return archive

    def _helm(self, *args: str, timeout: float = 360) -> str:
        env = {"KUBECONFIG": str(self.node.cluster.layout.admin_kubeconfig)}
        return h.run(h.helm_binary(), *args, env=env, timeout=timeout)

    def _installed(self) -> bool:
        try:
            self._helm("status", RELEASE, "--namespace", NAMESPACE)
        except h.HelmFailed:
            return False
        return True

    def _helm_upgrade(
        self, values: dict[str, Any], *, wait: bool, force_conflicts: bool = False
    ) -> None:
        values_file = self.root / "values.json"
        values_file.write_text(json.dumps(values, indent=2))
        self._helm(
            "upgrade", "--install", RELEASE, str(self.build.chart),
            "--namespace", NAMESPACE, "--create-namespace",
            "-f", str(values_file),
            *(["--wait", "--timeout", "5m"] if wait else []),
            *(["--force-conflicts"] if force_conflicts else []),
        )  # fmt: skip

    def _roll(
        self, values: dict[str, Any], *, wait: bool = False, force_conflicts: bool = False
    ) -> None:
        """Upgrade the release (`wait`: until all its pods are ready) and wait for the
        agent pod with exactly these arguments and image to run and the kubelet to
        connect to it."""
        kube = self.node.cluster.kube()
        mark = self.kubelet_log_size()
        self._helm_upgrade(values, wait=wait, force_conflicts=force_conflicts)
        image = f"{values['image']['repository']}:{values['image']['tag']}"
        api = values.get("kubernetesApi", {})
        env = {"KUBERNETES_SERVICE_PORT": str(api["port"]) if api.get("host") else None}

        driver_root = values["node"].get("driverRoot")
        node = values["node"]
        valued = [f"{flag}={node[key]}" for flag, key in VALUE_FLAGS.items() if key in node]
        args = [*node["extraArgs"], *valued]

        def rolled() -> bool:
            pods = [p for p in kube.list("Pod", NAMESPACE) if _agent(p)]
            if len(pods) != 1 or pods[0]["metadata"].get("deletionTimestamp"):
                return False
            container = pods[0]["spec"]["containers"][0]
            got = {e["name"]: e.get("value") for e in container.get("env", [])}
            roots = [a for a in container["args"] if a.startswith("--driver-root=")]
            return (
                container["image"] == image
                and all(a in container["args"] for a in args)
                and roots == ([f"--driver-root={driver_root}"] if driver_root else [])
                and all(got.get(k) == v for k, v in env.items())
                and pods[0]["status"].get("phase") == "Running"
            )

        wait_for("the agent pod rolled", rolled, timeout=180)
        self.wait_registered(mark)

    def _agent_pod(self, kube: Kube) -> dict[str, Any]:
        pods = [p for p in kube.list("Pod", NAMESPACE) if _agent(p)]
        if len(pods) != 1:
            raise AssertionError(f"expected one agent pod, found {len(pods)}")
        return pods[0]

    def _agent_restarts(self, kube: Kube) -> int:
        statuses = self._agent_pod(kube)["status"].get("containerStatuses") or [{}]
        return int(statuses[0].get("restartCount", 0))

    def _adopt(self, kube: Kube) -> None:
        """Objects the host-process installation created get the release's ownership
        metadata, as `helm install` requires to take over existing objects."""
        meta = {
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {
                "meta.helm.sh/release-name": RELEASE,
                "meta.helm.sh/release-namespace": NAMESPACE,
            },
        }
        for kind, name in ADOPTED:
            with contextlib.suppress(ApiError):
                if kube.get_or_none(kind, name) is not None:
                    kube.request(
                        "PATCH",
                        kube.path(kind, None, name),
                        {"metadata": meta},
                        content_type="application/merge-patch+json",
                    )


def _unmount(path: Path) -> None:
    """Unmount every mount stacked on `path` (none: nothing to do)."""
    while _mount_point(path):
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def _mount_point(path: Path) -> bool:
    """Whether something is mounted on `path`, by this process's mount table: a bind
    mount of a folder of the same file system onto itself has the device of its
    parent, which `os.path.ismount` reads as no mount."""
    with Path("/proc/self/mountinfo").open(encoding="utf-8") as table:
        return any(line.split()[4] == str(path) for line in table)


def remove_unreleased(kube: Kube) -> None:
    """Removes what a release would have to adopt (`ADOPTED`) when no installed release
    owns it: objects other tests applied directly, or the CRD an uninstalled release
    kept (crds.keep). After this the cluster is, for `helm install`, one gpudra was
    never installed on."""
    for kind, name in ADOPTED:
        obj = kube.get_or_none(kind, name)
        if obj is not None and not _release_exists(kube, obj["metadata"].get("annotations")):
            kube.delete(kind, name)
            gone = functools.partial(_gone, kube, kind, name)
            wait_for(f"{kind} {name} deleted", gone)


def _gone(kube: Kube, kind: str, name: str) -> bool:
    return kube.get_or_none(kind, name) is None


def _release_exists(kube: Kube, annotations: dict[str, str] | None) -> bool:
    """Whether the Helm release an object's annotations name is installed (Helm keeps a
    Secret per release revision, labelled with the release's name)."""
    release = (annotations or {}).get("meta.helm.sh/release-name")
    namespace = (annotations or {}).get("meta.helm.sh/release-namespace")
    if not release or not namespace:
        return False
    return bool(kube.list("Secret", namespace, labelSelector=f"owner=helm,name={release}"))


def _chart_pod(pod: dict[str, Any]) -> bool:
    return pod["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE


def _agent(pod: dict[str, Any]) -> bool:
    return (
        _chart_pod(pod) and pod["metadata"]["labels"].get("app.kubernetes.io/component") == "node"
    )


def webhook_deployments(kube: Kube) -> list[dict[str, Any]]:
    """The release's webhook Deployments."""
    return [
        d
        for d in kube.list("Deployment", NAMESPACE)
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "webhook"
    ]


def _pause_webhook(kube: Kube, *, paused: bool) -> None:
    """A paused Deployment keeps its pods through template changes (helm leaves the
    field alone: the chart does not set it)."""
    for d in webhook_deployments(kube):
        kube.request(
            "PATCH",
            kube.path("Deployment", NAMESPACE, d["metadata"]["name"]),
            {"spec": {"paused": paused}},
            content_type="application/merge-patch+json",
        )


def webhook_answers(kube: Kube) -> bool:
    """The API server reaches the webhook: a legacy GPU pod's dry-run create is reviewed
    (answered either way). A ready replica does not say so on a pod network, where the
    Service's rules on the API server's node may lag the endpoint (kind's kube-proxy)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpudra-webhook-probe", "namespace": "default"},
        "spec": {
            "containers": [
                {"name": "c", "image": "probe", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ]
        },
    }
    try:
        kube.create(pod, dryRun="All")
    except ApiError as e:
        return "failed calling webhook" not in str(e)
    return True


def webhook_replicas(
    kube: Kube, source: str, upgrade: Callable[[dict[str, Any], bool, bool], None]
) -> Callable[[int], None]:
    """The function `webhook_on_pod_network` yields: `upgrade` (the webhook's values,
    whether to take `--force-conflicts`, whether it is the first) to `count` replicas,
    more than one with the chart's CA (tls.source helm), as the chart requires, one with
    its own (self); from `source`, the one the release has now. The upgrade from `self`
    to `helm` takes `--force-conflicts`, as docs/install.md says: under `self` the
    webhook owns the configurations' caBundle. Each returns once the webhook is
    registered again."""
    sources = [source]

    def replicas(count: int) -> None:
        source = "helm" if count > 1 else "self"
        force = (sources[-1], source) == ("self", "helm")
        upgrade({"replicas": count, "tls": {"source": source}}, force, len(sources) == 1)
        sources.append(source)
        wait_for("the webhook registered", lambda: webhook_ready(kube), timeout=90)

    return replicas


def webhook_ready(kube: Kube) -> bool:
    """Its configuration carries the CA (tls.source self) and a replica is ready."""
    deployments = webhook_deployments(kube)
    ready = bool(deployments) and all(
        d.get("status", {}).get("readyReplicas", 0) >= 1 for d in deployments
    )
    configs = [
        c
        for c in kube.list("MutatingWebhookConfiguration")
        if c["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE
    ]
    return (
        ready
        and bool(configs)
        and all(w["clientConfig"].get("caBundle") for c in configs for w in c.get("webhooks", []))
    )


__all__ = [
    "DRIVER",
    "WORKING_TREE",
    "ChartBuild",
    "ChartStack",
    "chart_node_unavailable_reason",
    "chart_unavailable_reason",
    "previous_release",
]
