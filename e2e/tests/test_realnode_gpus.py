"""GPU pods on the real node: the real scheduler allocates, the real kubelet calls the
plugin of `gpudra node` (emulated GPUs), containerd injects the CDI spec and runc
starts the container. Each test looks inside the containers.

Every test runs twice, once per way gpudra gets onto the node:
- `processes`: the agent and webhook as host processes with every host path given
  (real character devices under a dev root, a driver root), as on a GPU node;
- `chart`: the Helm chart installed with the image `make image` builds, the agent and
  webhook as pods, emulated GPUs with the agent's own defaults (numbered device nodes,
  a stand-in driver root under its state dir). This is what `make e2e-kind` runs on kind.

The sample workloads in demo/ are the scenarios: a legacy `nvidia.com/gpu` pod the
webhook converts, a claim with a CEL selector, a dynamic MIG device and a time-sliced
GPU shared by two pods. Then exclusivity, faults (kubelet restart, agent killed in the
middle of a prepare, slices deleted under running pods) and bad input.

Skips with the exact reason when the machine cannot run a real node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from gpudra.cli.node import EMULATED_DRIVER_ROOT, EMULATED_TOOLS_LOG
from gpudra.cli.scrape import get, metric_samples
from gpudra.cli.webhook import QUOTA_LEASE
from gpudra.driver.driverroot import CUDA_LIBRARY, NVML_LIBRARY
from gpudra.driver.mpspods import CLAIM_LABEL
from gpudra.driver.plugin import (
    DRA_APIS,
    HEALTH_V1,
    HEALTH_V1ALPHA1,
    STILL_UNDER_WAY,
    UNHEARD_FAILURE_NOTE,
)
from gpudra.driver.sharing import MPS_SERVER
from gpudra.webhook.cabundle import FIELD_MANAGER
from gpudra.webhook.convert import CONVERTED_ANNOTATION as CONVERTED

from e2e import features
from e2e.claims import (
    attr,
    claim_template,
    node_devices,
    running,
    shared_devices,
    wait_running,
)
from e2e.cluster.harness import BUILD_SCRIPT, Cluster, known_gates
from e2e.cluster.kube import ApiError, Kube, field_managers, wait_for
from e2e.debian_driver import LIBRARY_DIR as DEBIAN_LIBRARY_DIR
from e2e.debian_driver import debian_layout
from e2e.gobuild import GoBuildError
from e2e.gpu_pods import (
    allocation,
    cap_nodes,
    claim_uid,
    containers,
    daemon_alive,
    daemon_pods,
    daemon_process,
    demo_objects,
    gpu_minors,
    gpu_pod,
    mps_pipes,
    mps_template,
    seen,
    spec_of,
    wait_released,
    wait_unprepared,
    whole_gpu_template,
)
from e2e.node.chart import NAMESPACE as CHART_NAMESPACE
from e2e.node.chart import ChartStack, webhook_deployments, webhook_ready
from e2e.node.gpus import DRIVER, MIG_COMPUTE_INSTANCES, MIG_FIRST_MINOR, NodeGpus
from e2e.node.realnode import WEBHOOK_CONFIGURATIONS
from e2e.progress import build_script
from e2e.provider import on_kind
from e2e.shared_libraries import shared_library
from e2e.tools import helm as h
from e2e.tools import metadataread
from e2e.tools import prometheus as p

pytestmark = pytest.mark.cluster
OWN_NAMESPACE = "gpudra"  # the webhook's own namespace, which it never intercepts


@pytest.fixture
def own_ns(stack: NodeGpus, kube: Kube) -> Iterator[None]:
    if kube.get_or_none("Namespace", OWN_NAMESPACE) is None:
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OWN_NAMESPACE}})
    yield

    # What the tests made there; the chart's own pods live in that namespace too.
    def ours() -> list[tuple[str, dict[str, Any]]]:
        return [
            (kind, obj)
            for kind in ("Pod", "ResourceClaim", "ResourceClaimTemplate")
            for obj in kube.list(kind, OWN_NAMESPACE)
            if "app.kubernetes.io/instance" not in obj["metadata"].get("labels", {})
        ]

    made = ours()
    claims = {obj["metadata"]["uid"] for kind, obj in made if kind == "ResourceClaim"}
    for kind, obj in made:
        kube.delete(kind, obj["metadata"]["name"], OWN_NAMESPACE, grace=0)
    wait_for("its pods gone", lambda: not [o for k, o in ours() if k == "Pod"], timeout=60)
    wait_released(stack, claims, "its claims")  # as `scratch_namespace` says why


# --- helpers ---------------------------------------------------------------------------


def with_sidecars(pod: dict[str, Any]) -> dict[str, Any]:
    """`pod` with a sidecar that uses its claim too, and a container that does not."""
    main = pod["spec"]["containers"][0]
    sleeper = {k: main[k] for k in ("image", "imagePullPolicy", "command")}
    pod["spec"]["initContainers"] = [
        {**sleeper, "name": "watcher", "restartPolicy": "Always", "resources": main["resources"]}
    ]
    pod["spec"]["containers"].append({**sleeper, "name": "shipper"})
    return pod


def configured_claim(name: str, namespace: str, sharing: dict[str, Any]) -> dict[str, Any]:
    """A claim for one whole GPU with a GpuConfig of the given `sharing`."""
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                "config": [
                    {"opaque": {"driver": DRIVER, "parameters": {**parameters, "sharing": sharing}}}
                ],
            }
        },
    }


def events(kube: Kube, namespace: str, pod: str) -> list[str]:
    """The events of this pod: not those of an earlier pod of the same name."""
    uid = kube.get("Pod", pod, namespace)["metadata"]["uid"]
    return [
        f"{e['reason']}: {e.get('message', '')}"
        for e in kube.list("Event", namespace)
        if e["involvedObject"].get("uid") == uid
    ]


def common_view_ok(nodes: set[str], env: dict[str, str]) -> None:
    assert {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} <= nodes
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["LD_LIBRARY_PATH"].startswith("/usr/lib/x86_64-linux-gnu:")


# --- the demo's workloads ----------------------------------------------------------------


def test_demo_workloads_see_exactly_their_devices(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    for obj in demo_objects(ns):
        kube.create(obj)
    pods = [o["metadata"]["name"] for o in demo_objects(ns) if o["kind"] == "Pod"]
    wait_running(kube, ns, *pods)
    devices = node_devices(kube, stack.node_name)
    views = {p: seen(cluster, ns, p) for p in pods}
    gpu_of: dict[str, str] = {}
    for pod in pods:
        nodes, env = views[pod]
        common_view_ok(nodes, env)
        (result,) = allocation(kube, ns, pod)
        device = devices[result["device"]]
        uuid_env = [v for k, v in env.items() if k.startswith("GPUDRA_DEVICE_")]
        if attr(device, "type") == "mig":
            # A dynamic MIG device gets its UUID when the plugin creates it.
            assert len(uuid_env) == 1 and uuid_env[0].startswith("MIG-"), pod
            parent = attr(device, "parentUUID")
        else:
            assert uuid_env == [attr(device, "uuid")], pod
            parent = attr(device, "uuid")
        # Exactly the allocated GPU (the MIG device's parent) and no other.
        assert gpu_minors(nodes) == {stack.gpu_minors()[parent]}, (pod, nodes)
        gpu_of[pod] = result["device"]
    # The converted legacy pod and the CEL-selected pod hold different exclusive GPUs.
    assert gpu_of["legacy-gpu"] != gpu_of["cel-selected"]
    assert attr(devices[gpu_of["cel-selected"]], "productName").startswith("NVIDIA H100")
    # The MIG pod sees its GPU-instance and compute-instance access nodes, nothing else.
    mig_nodes = cap_nodes(views["mig-1g"][0])
    assert not any(cap_nodes(v[0]) for p, v in views.items() if p != "mig-1g")
    mig = devices[gpu_of["mig-1g"]]
    assert attr(mig, "profile") == "1g.10gb"
    assert len(mig_nodes) == 2
    first = min(int(n.removeprefix("nvidia-cap")) for n in mig_nodes)
    assert (first - MIG_FIRST_MINOR) % (1 + MIG_COMPUTE_INSTANCES) == 0  # a GI access node
    # Both time-sliced pods see the same GPU, with the long time slice applied once.
    assert gpu_of["sliced-a"] == gpu_of["sliced-b"]
    assert gpu_minors(views["sliced-a"][0]) == gpu_minors(views["sliced-b"][0])
    sliced_uuid = attr(devices[gpu_of["sliced-a"]], "uuid")
    calls = stack.tool_calls()
    assert calls.count(f"nvidia-smi compute-policy -i {sliced_uuid} --set-timeslice 3") == 1
    # Two memory slices of one shared GPU: distinct shares, each pinned to 10 GiB.
    slices = [allocation(kube, ns, p)[0] for p in ("slice-a", "slice-b")]
    assert (
        gpu_of["slice-a"] == gpu_of["slice-b"] not in (gpu_of["legacy-gpu"], gpu_of["cel-selected"])
    )
    assert devices[gpu_of["slice-a"]].get("allowMultipleAllocations") is True
    assert slices[0]["shareID"] != slices[1]["shareID"]
    shared_uuid = attr(devices[gpu_of["slice-a"]], "uuid")
    pinned = f"set_default_device_pinned_mem_limit {shared_uuid} 10240M"
    assert sum(pinned in c for c in stack.tool_calls()) == 2
    # The driver's libraries are mounted where LD_LIBRARY_PATH says.
    out = cluster.kubectl("exec", "-n", ns, "legacy-gpu", "--", "ls", "/usr/lib/x86_64-linux-gnu")
    assert "libcuda.so.580.95.05" in out.stdout.split()

    uids = {claim_uid(kube, ns, p) for p in pods}
    assert {spec_of(u) for u in uids} <= stack.cdi_specs()
    for pod in pods:
        kube.delete("Pod", pod, ns)
    # Deleting the pods unprepares every claim: no spec, no record, MIG instance gone,
    # the time slice reset.
    wait_unprepared(stack, uids, "the demo's claims")
    wait_for(
        "the time slice reset",
        lambda: (
            f"nvidia-smi compute-policy -i {sliced_uuid} --set-timeslice 0" in stack.tool_calls()
        ),
    )


def test_exclusive_gpus_are_never_shared(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    devices = node_devices(kube, stack.node_name)
    whole = [
        n
        for n, d in devices.items()
        if attr(d, "type") == "gpu" and not d.get("allowMultipleAllocations")
    ]
    kube.create(whole_gpu_template(ns))
    pods = [f"x-{i}" for i in range(len(whole) + 1)]
    for pod in pods[:-1]:
        kube.create(gpu_pod(stack, pod, ns, template="whole"))
    wait_running(kube, ns, *pods[:-1])
    minors = {p: gpu_minors(seen(cluster, ns, p)[0]) for p in pods[:-1]}
    assert all(len(m) == 1 for m in minors.values())
    assert len(set().union(*minors.values())) == len(whole), minors
    # One more: no GPU left, so it stays Pending and says why.
    kube.create(gpu_pod(stack, pods[-1], ns, template="whole"))
    wait_for(
        "the extra pod's scheduling failure",
        lambda: any("cannot allocate all claims" in e for e in events(kube, ns, pods[-1])),
        timeout=60,
    )
    assert kube.get("Pod", pods[-1], ns)["status"]["phase"] == "Pending"
    # Deleting one pod unprepares its claim and hands its GPU to the waiting pod.
    freed = minors[pods[0]]
    uid = claim_uid(kube, ns, pods[0])
    kube.delete("Pod", pods[0], ns)
    wait_for("its CDI spec removed", lambda: spec_of(uid) not in stack.cdi_specs(), timeout=60)
    wait_running(kube, ns, pods[-1])
    assert gpu_minors(seen(cluster, ns, pods[-1])[0]) == freed


def test_containers_read_their_device_metadata_where_kubernetes_puts_it(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str, tmp_path: Path
) -> None:
    """With `--device-metadata`, containerd mounts each request's file at Kubernetes'
    path: under the pod's name for a claim made from a template, under the claim's own
    name for one the pod names. What the container reads names the GPU it got, and
    Kubernetes' reader of 1.37 decodes and validates it; the files go with the claim."""
    base = "/var/run/kubernetes.io/dra-device-attributes"
    paths = {
        "from-template": f"{base}/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json",
        "named": f"{base}/resourceclaims/named-gpu/gpu/{DRIVER}-metadata.json",
    }
    with stack.agent_flags("--device-metadata"):
        kube.create(whole_gpu_template(ns))
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "named-gpu", "namespace": ns},
                "spec": claim_template(ns, ns, "!device.allowMultipleAllocations")["spec"]["spec"],
            }
        )
        for pod, path in paths.items():
            source = {"template": "whole"} if pod == "from-template" else {"claim": "named-gpu"}
            script = f"cat {path} && sleep 86400"
            kube.create(gpu_pod(stack, pod, ns, script=script, **source))
        wait_running(kube, ns, *paths)
        uids = {claim_uid(kube, ns, pod) for pod in paths}
        files = {f"{uid}.gpu.json" for uid in uids}  # one per claim and request
        assert files <= set(stack.list_names(stack.state_dir / "device-metadata"))
        for pod in paths:
            logs = cluster.kubectl("logs", "-n", ns, pod)
            assert logs.returncode == 0, logs.stderr
            newest, oldest = (json.loads(line) for line in logs.stdout.splitlines())
            assert (newest["apiVersion"], oldest["apiVersion"]) == (
                "metadata.resource.k8s.io/v1beta1",
                "metadata.resource.k8s.io/v1alpha1",
            )
            [device] = newest["requests"][0]["devices"]
            assert device["name"] == allocation(kube, ns, pod)[0]["device"]
            _, env = seen(cluster, ns, pod)
            gpus = {v for k, v in env.items() if k.startswith("GPUDRA_DEVICE_GPU_")}
            assert device["attributes"]["uuid"]["string"] in gpus
            saved = tmp_path / f"{pod}.json"
            saved.write_text(logs.stdout)
            try:
                decoded = metadataread.read("1.37", saved)
            except GoBuildError as exc:
                pytest.skip(f"Kubernetes' reader cannot be built here: {exc}")
            assert decoded["validation"] == ""
            assert decoded["object"]["Requests"][0]["Devices"][0]["Name"] == device["name"]
        for pod in paths:
            kube.delete("Pod", pod, ns, grace=0)
        kube.delete("ResourceClaim", "named-gpu", ns)
        wait_unprepared(stack, uids, "the two claims")
        left = files & set(stack.list_names(stack.state_dir / "device-metadata"))
        assert not left, f"device metadata left for {sorted(left)}"


def test_a_gpu_a_force_deleted_pod_held_starts_the_pod_waiting_for_it_at_once(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """A pod deleted with no grace leaves the API at once, and the scheduler gives its
    GPU to a pod waiting for it while the node still stops the old containers (2 s at
    least: they ignore SIGTERM) and has not unprepared the old claim. The agent waits
    for that unprepare rather than refusing the new claim's prepare: the waiting pod
    starts once the GPU is free, with no failed prepare and no wait for the kubelet's
    next sync of it.

    The test needs that race, and the node can win it: the waiting pod reaches the
    node only after the claim controller has deleted the old claim and the scheduler
    has tried the pod again, which its backoff may put off past the 2 s the old
    containers take. Then the old claim is unprepared before the new one comes, which
    is also right but tests nothing. So up to `RACE_TRIES` pods take the GPU in turn,
    each force-deleted for the next, every one checked; the race must be met once."""
    gpu = next(
        d
        for _, d in sorted(node_devices(kube, stack.node_name).items())
        if attr(d, "type") == "gpu" and not d.get("allowMultipleAllocations")
    )
    pinned = f'device.attributes["{DRIVER}"].uuid == "{attr(gpu, "uuid")}"'
    kube.create(claim_template("pinned", ns, pinned))
    holder = "pod-0"
    kube.create(gpu_pod(stack, holder, ns, template="pinned"))
    wait_running(kube, ns, holder)
    met: list[bool] = []
    for attempt in range(1, RACE_TRIES + 1):
        waiting = f"pod-{attempt}"
        kube.create(gpu_pod(stack, waiting, ns, template="pinned"))
        wait_for(
            f"{waiting}'s scheduling failure",
            lambda w=waiting: any("cannot allocate all claims" in e for e in events(kube, ns, w)),
            timeout=60,
        )

        kube.delete("Pod", holder, ns, grace=0)
        wait_running(kube, ns, waiting, timeout=60)

        assert not [e for e in events(kube, ns, waiting) if "FailedPrepare" in e]
        new = claim_uid(kube, ns, waiting)
        met.append(
            any(
                "waits for a device's holder to be unprepared" in line and new in line
                for line in stack.agent_output().splitlines()
            )
        )
        if met[-1]:
            break
        holder = waiting
    print(f"the race was met at try {len(met)} of {RACE_TRIES}: {met}")  # with -rP
    # Else each old claim was unprepared before the next one came, and nothing was tested.
    assert met[-1], f"in {len(met)} tries no new claim's prepare found the GPU still held"


RACE_TRIES = 3
"""Pods in turn that `test_a_gpu_a_force_deleted_pod_held_starts_the_pod_waiting_for_it_at_once`
gives the race: it was lost once in many runs, on a busy machine."""


def legacy_pod(stack: NodeGpus, name: str, namespace: str, resource: str) -> dict[str, Any]:
    """A pod written for the device plugin, asking for one `resource`: the webhook
    converts it."""
    pod = gpu_pod(stack, name, namespace, template="none")
    del pod["spec"]["resourceClaims"]
    (container,) = pod["spec"]["containers"]
    container["resources"] = {"limits": {resource: "1"}}
    return pod


HOLDERS = (
    "custom-columns=NAMESPACE:.metadata.namespace,CLAIM:.metadata.name,"
    "POD:.status.reservedFor[*].name,NODE:.status.allocation.devices.results[*].pool,"
    "DEVICE:.status.allocation.devices.results[*].device,"
    "SHARES:.status.allocation.devices.results[*].consumedCapacity.shares,"
    "SHARING:.status.allocation.devices.config[*].opaque.parameters.sharing.strategy"
)


def gpudra(cluster: Cluster, *args: str) -> str:
    """`gpudra ARGS` against the cluster, as an admin runs it: its output."""
    out = subprocess.run(
        [sys.executable, "-m", "gpudra.cli", *args],
        env={**os.environ, "KUBECONFIG": str(cluster.layout.admin_kubeconfig)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def gpudra_devices(cluster: Cluster, node: str) -> str:
    """`gpudra devices --node NODE`."""
    return gpudra(cluster, "devices", "--node", node)


def gpudra_top(cluster: Cluster, *args: str) -> list[dict[str, Any]]:
    """`gpudra top -o json ARGS`, its rows."""
    rows: list[dict[str, Any]] = json.loads(gpudra(cluster, "top", "-o", "json", *args))
    return rows


def test_legacy_shared_pods_pack_onto_gpus_by_integer_shares(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """`gpudra node --gpu-shares=2`, the device plugin's `replicas: 2`: pods asking
    `nvidia.com/gpu.shared: 1` get one share each, two see the same GPU, the third the
    next one; a whole-GPU claim goes to no GPU with a share taken; the GPU's time-slice
    is set once for both shares and reset when the last one goes. Each holder is billed
    the shares it took: the third pod, alone on its GPU, pays for its one share of two,
    never for the share nobody took."""
    port = stack.metrics_port
    flags = (f"--metrics-address=127.0.0.1:{port}", "--sample-interval=1")
    with stack.agent_flags("--gpu-shares=2", *flags):
        devices = shared_devices(kube, stack.node_name, least=2)
        with_shares = set(devices)
        calls_before = len(stack.tool_calls())
        pods = ["share-a", "share-b", "share-c"]
        for pod in pods:  # one at a time: the scheduler fills a GPU before the next
            kube.create(legacy_pod(stack, pod, ns, "nvidia.com/gpu.shared"))
            wait_running(kube, ns, pod)
        converted = kube.get("Pod", "share-a", ns)["metadata"]["annotations"]
        assert "one share each, sharing TimeSlicing/Default" in converted[CONVERTED]
        results = {p: allocation(kube, ns, p)[0] for p in pods}
        assert all(r["request"] == "part-0/share" for r in results.values()), results
        assert all(r["consumedCapacity"]["shares"] == "1" for r in results.values())
        gpu_of = {p: r["device"] for p, r in results.items()}
        assert gpu_of["share-a"] == gpu_of["share-b"] != gpu_of["share-c"]
        assert {gpu_of["share-a"], gpu_of["share-c"]} <= with_shares
        # Separate claims, the same device in both containers.
        minors = {p: gpu_minors(seen(cluster, ns, p)[0]) for p in pods}
        assert minors["share-a"] == minors["share-b"] != minors["share-c"]
        assert len(minors["share-a"]) == 1

        # What docs/troubleshooting.md shows: which pod holds which device, how shared.
        out = cluster.kubectl("get", "resourceclaims", "-n", ns, "-o", HOLDERS)
        assert out.returncode == 0, out.stderr
        rows = {r.split()[2]: r.split() for r in out.stdout.splitlines()[1:]}
        sharing = "TimeSlicing,TimeSlicing"  # the class's config, then the claim's
        assert rows["share-a"][3:] == [stack.node_name, gpu_of["share-a"], "1", sharing]
        out = gpudra_devices(cluster, stack.node_name)
        (line,) = [r for r in out.splitlines() if r.split()[1:2] == [gpu_of["share-a"]]]
        assert "full: 2/2 shares taken" in line and f"{ns}/" in line, out
        assert "(pod share-a, TimeSlicing, 1 share)" in line, out

        # A whole GPU takes all of a GPU's shares: never one with a share taken.
        plain = whole_gpu_template(ns, "plain")
        del plain["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
        kube.create(plain)
        kube.create(gpu_pod(stack, "whole", ns, template="plain"))
        wait_running(kube, ns, "whole")
        assert allocation(kube, ns, "whole")[0]["device"] not in set(gpu_of.values())

        # Billing: three one-share holders pay half a GPU each, 1.5 GPUs for the
        # namespace's time-sliced claims, while the whole GPU's holder pays one. Billed
        # equally among a GPU's holders, the third pod paid for a whole GPU (2 to 1).
        if stack.name != "kind":  # the host cannot reach a kind worker's agent
            billed = billed_per_second(port, ns)
            assert billed["TimeSlicing"] / billed["Exclusive"] == pytest.approx(1.5, rel=0.1)

        # The time-slice of the GPU two shares hold: set once, kept while one remains,
        # reset with the last.
        uuid = attr(devices[gpu_of["share-a"]], "uuid")

        def settings() -> list[str]:
            mark = f"nvidia-smi compute-policy -i {uuid} --set-timeslice"
            return [c for c in stack.tool_calls()[calls_before:] if c.startswith(mark)]

        assert len(settings()) == 1
        uid = claim_uid(kube, ns, "share-a")
        kube.delete("Pod", "share-a", ns)
        wait_for("share-a unprepared", lambda: spec_of(uid) not in stack.cdi_specs(), timeout=60)
        assert len(settings()) == 1
        kube.delete("Pod", "share-b", ns)
        wait_for("the time-slice reset with the last share", lambda: len(settings()) == 2)
        assert settings()[-1].endswith("--set-timeslice 0")
        for pod in ("share-c", "whole"):
            kube.delete("Pod", pod, ns, grace=0)
        wait_for("the pods gone", lambda: not kube.list("Pod", ns), timeout=60)


def allocated_seconds(port: int, ns: str) -> dict[str, float]:
    """The agent's `gpudra_allocated_device_seconds` of one namespace, by sharing, with
    what a new series withholds while it is served at zero (its first window)."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = get(url, 10)
    wanted = {"gpudra_allocated_device_seconds_total", "gpudra_withheld_allocated_device_seconds"}
    found: dict[str, float] = {}
    for s in metric_samples(url, text, wanted.__contains__):
        if s.labels["namespace"] == ns:
            found[s.labels["sharing"]] = found.get(s.labels["sharing"], 0.0) + s.value
    return found


def billed_per_second(port: int, ns: str) -> dict[str, float]:
    """How fast each sharing mode's device-seconds grow over a few of the agent's
    samples, once every series is there; both are read from the same samples, so their
    ratio does not depend on when the agent sampled."""
    seen: list[dict[str, float]] = [{}]

    def both() -> dict[str, float] | None:
        got = seen[0] = allocated_seconds(port, ns)
        ready = {"TimeSlicing", "Exclusive"} <= got.keys() and all(v > 0 for v in got.values())
        return got if ready else None

    try:
        first = wait_for("the agent billing both kinds of claim", both, timeout=60)
    except TimeoutError as e:
        raise AssertionError(f"{e}; the namespace's allocated seconds: {seen[0]}") from e
    last = wait_for(
        "five seconds more of billing",
        lambda: (
            got
            if (got := allocated_seconds(port, ns))["Exclusive"] >= first["Exclusive"] + 5
            else None
        ),
        timeout=60,
    )
    return {k: last[k] - first[k] for k in ("TimeSlicing", "Exclusive")}


# --- faults -----------------------------------------------------------------------------


def test_kubelet_restart_keeps_running_pods_and_starts_new_ones(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "before", ns, template="whole"))
    wait_running(kube, ns, "before")
    container = kube.get("Pod", "before", ns)["status"]["containerStatuses"][0]
    view = seen(cluster, ns, "before")
    uid = claim_uid(kube, ns, "before")
    stack.restart_kubelet()
    kube.create(gpu_pod(stack, "after", ns, template="whole"))
    wait_running(kube, ns, "after")
    # The running pod kept its container and its devices; its claim is prepared once.
    now = kube.get("Pod", "before", ns)["status"]["containerStatuses"][0]
    assert (now["containerID"], now["restartCount"]) == (container["containerID"], 0)
    assert seen(cluster, ns, "before") == view
    assert stack.checkpoint()[uid]["state"] == "PrepareCompleted"
    assert gpu_minors(seen(cluster, ns, "after")[0]).isdisjoint(gpu_minors(view[0]))


def kubelet_binary(kube: Kube, node: str) -> Path:
    """The kubelet of the version `node` runs, from the harness's build cache: the
    same binary on the local real node and in a kind node image built here."""
    version = kube.get("Node", node)["status"]["nodeInfo"]["kubeletVersion"]
    env = {**os.environ, "K8S_VERSION": version.removeprefix("v")}
    return build_script(BUILD_SCRIPT, prefix="build", what="the kubelet", env=env) / "kubelet"


@pytest.mark.parametrize("api", DRA_APIS)
def test_the_kubelet_prepares_over_each_dra_api_and_streams_health(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str, api: str
) -> None:
    """This release's own kubelet, offered one DRA gRPC API only (the other is not even
    served): it registers the plugin, pods start with their GPUs and are cleaned up, and
    the kubelet reads the devices' health from the health service into the pod status.

    One pod's claim comes from a template, the other's is named as the pod refers to it:
    the 1.34 kubelet reports health only for the second kind, 1.35 only for the first,
    later ones for both, so at least one of them must show its GPU Healthy."""
    kubelet = kubelet_binary(kube, stack.node.name)
    mark = stack.kubelet_log_size()
    with stack.agent_flags("--dra-api", api):
        # The agent's start made each socket in a folder of its own: the kubelet's
        # watcher stats every new entry of plugins_registry, and logs an error for one
        # already gone by then.
        assert not [
            line
            for line in stack.kubelet_log(mark).splitlines()
            if "plugins_registry/." in line and "failed" in line
        ]
        kube.create(whole_gpu_template(ns))
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "gpu", "namespace": ns},
                **whole_gpu_template(ns)["spec"],
            }
        )
        kube.create(gpu_pod(stack, "from-template", ns, template="whole"))
        kube.create(gpu_pod(stack, "named", ns, claim="gpu"))
        pods = ("from-template", "named")
        wait_running(kube, ns, *pods)
        uids = {pod: claim_uid(kube, ns, pod) for pod in pods}
        for pod in pods:
            assert len(gpu_minors(seen(cluster, ns, pod)[0])) == 1
        if "ResourceHealthStatus" in known_gates(kubelet):

            def healthy() -> list[tuple[str, str]]:
                """(pod, resourceID) of each GPU the kubelet reports Healthy; it shows
                Unknown until the health stream's first report reaches it."""
                found = []
                for pod in pods:
                    status = kube.get("Pod", pod, ns)["status"]["containerStatuses"][0]
                    found += [
                        (pod, r.get("resourceID", ""))
                        for entry in status.get("allocatedResourcesStatus") or []
                        for r in entry.get("resources") or []
                        if r.get("health") == "Healthy"
                    ]
                return found

            # The kubelet names the device by the first CDI ID the plugin returned. Pods
            # that start long after the stream's last change (seen after a kubelet
            # restart) still read Healthy only because the agent repeats the list within
            # the kubelet's timeout. The wait is a hang guard.
            reported = wait_for("the kubelet to report a GPU Healthy", healthy, timeout=240)
            for pod, resource_id in reported:
                assert resource_id.startswith("k8s.gpu.nvidia.com/claim=")
                assert uids[pod] in resource_id
            # The agent serves both health APIs. The kubelet of 1.37 and later takes the
            # newest it knows among those advertised (v1); older ones know only v1alpha1.
            version = kube.get("Node", stack.node.name)["status"]["nodeInfo"]["kubeletVersion"]
            minor = int(version.removeprefix("v").split(".")[1])
            chosen = HEALTH_V1 if minor >= 37 else HEALTH_V1ALPHA1
            opened = [
                json.loads(line)["api"]
                for line in stack.agent_output().splitlines()
                if "kubelet opened a health stream" in line
            ]
            assert opened, "the agent logged no health stream the kubelet opened"
            assert set(opened) == {chosen}, (version, opened)
        for pod in pods:
            kube.delete("Pod", pod, ns, grace=0)
        for uid in uids.values():
            wait_for("the claim unprepared", lambda u=uid: u not in stack.checkpoint(), timeout=60)
            assert spec_of(uid) not in stack.cdi_specs()


def test_agent_killed_mid_prepare_recovers_without_leaks(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """SIGKILL right after the CDI spec is written (the kubelet's call fails), then a
    normal restart: the kubelet retries, the pod starts, one record, one spec."""
    kube.create(whole_gpu_template(ns))
    with stack.crashing_at("cdi-written") as crashed:
        kube.create(gpu_pod(stack, "crash", ns, template="whole"))
        crashed()
        assert kube.get("Pod", "crash", ns)["status"]["phase"] == "Pending"
    wait_running(kube, ns, "crash")
    uid = claim_uid(kube, ns, "crash")
    assert stack.checkpoint()[uid]["state"] == "PrepareCompleted"
    assert [s for s in stack.cdi_specs() if uid in s] == [spec_of(uid)]
    assert len(gpu_minors(seen(cluster, ns, "crash")[0])) == 1
    kube.delete("Pod", "crash", ns)
    wait_for("its CDI spec removed", lambda: spec_of(uid) not in stack.cdi_specs(), timeout=60)
    wait_for("the claim out of the checkpoint", lambda: uid not in stack.checkpoint())


def test_mps_daemons_outlive_the_agent(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """Replacing the agent (the chart: a new agent pod, as an upgrade or a changed value
    does; host processes: a new process) leaves each MPS claim's control daemon running:
    the pod keeps its container and its daemon, the new agent starts the daemons of new
    claims, and deleting the pods ends every daemon and removes its pod."""
    kube.create(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
    kube.create(gpu_pod(stack, "mps-a", ns, template="mps"))
    wait_running(kube, ns, "mps-a")
    first = claim_uid(kube, ns, "mps-a")
    pipes = mps_pipes(stack)
    assert daemon_alive(pipes[first])
    in_pods = isinstance(stack, ChartStack)
    before = (containers(kube, ns, "mps-a"), daemon_pods(kube))
    assert set(before[1]) == ({first} if in_pods else set())
    with stack.agent_flags("--cleanup-interval=30"):
        assert daemon_alive(pipes[first])
        assert (containers(kube, ns, "mps-a"), daemon_pods(kube)) == before
        kube.create(gpu_pod(stack, "mps-b", ns, template="mps"))
        wait_running(kube, ns, "mps-b")
        second = claim_uid(kube, ns, "mps-b")
        pipes = mps_pipes(stack)
        assert daemon_alive(pipes[second])
        assert set(daemon_pods(kube)) == ({first, second} if in_pods else set())
        for pod in ("mps-a", "mps-b"):
            kube.delete("Pod", pod, ns)
        wait_unprepared(stack, {first, second}, "the MPS pods' claims")
        assert not any(daemon_alive(p) for p in pipes.values())
        assert not daemon_pods(kube)


def daemon_root(pipe_dir: str) -> Path:
    """The root folder as the stand-in MPS daemon for this pipe folder sees it (its
    container's, for a daemon pod)."""
    proc = daemon_process(pipe_dir)
    if proc is None:
        raise AssertionError(f"no MPS daemon runs for {pipe_dir}")
    return proc / "root"


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_stopped_webhook_pod_hands_the_quota_writers_lease_back(
    stack: NodeGpus, kube: Kube
) -> None:
    """A rollout stops webhook pods with SIGTERM: the one holding the quota writer's
    Lease hands it back on its way out, so once that pod is gone the Lease names
    nobody or its successor, which then writes within a retry instead of waiting out
    the lease duration (15 s) on a holder that no longer runs."""
    if not isinstance(stack, ChartStack):
        pytest.skip("the host-process webhook is not a pod a rollout stops")

    def holder() -> str:
        lease = kube.get_or_none("Lease", QUOTA_LEASE, CHART_NAMESPACE)
        return str((lease or {}).get("spec", {}).get("holderIdentity") or "")

    def running_holder() -> str | None:
        # The chart names the pod as the holder; a Lease an earlier install's pod held
        # may still name that pod until it expires.
        name = holder()
        return name if name and kube.get_or_none("Pod", name, CHART_NAMESPACE) else None

    old = wait_for("a webhook pod holding the quota writer's Lease", running_holder, timeout=60)
    kube.delete("Pod", old, CHART_NAMESPACE)  # the default grace period: SIGTERM first
    wait_for(
        "the old webhook pod gone",
        lambda: kube.get_or_none("Pod", old, CHART_NAMESPACE) is None,
        timeout=60,
    )
    assert holder() != old  # handed back as it stopped, not left to expire
    new = wait_for("another webhook pod leading", running_holder, timeout=60)
    assert new != old
    wait_for("the webhook ready again", lambda: webhook_ready(kube), timeout=90)


WEBHOOK_SERVICE = "gpudra-webhook"
"""The chart's webhook Service for the release `gpudra`."""
NO_ENDPOINT = f'no endpoints available for service "{WEBHOOK_SERVICE}"'
"""How the local API server refuses a review while no webhook endpoint is ready."""


HELD = "context deadline exceeded"
"""How the API server reports a review that waited out the webhook's timeout."""


def no_endpoint_error(kube: Kube) -> str:
    """How the API server refuses a review while no webhook endpoint is ready. The
    local control plane picks an endpoint itself (`--enable-aggregator-routing`, as no
    kube-proxy runs there) and names the gap. kind's, like most clusters', dials the
    Service's cluster IP, which kube-proxy rejects while the Service has no ready
    endpoint: the connection is refused before any byte is sent."""
    if not on_kind():
        return NO_ENDPOINT
    spec = kube.get("Service", WEBHOOK_SERVICE, CHART_NAMESPACE)["spec"]
    return f"dial tcp {spec['clusterIP']}:{spec['ports'][0]['port']}: connect: connection refused"


class AdmissionLoad:
    """Admission reviews sent through the API server without pause, from a thread: a
    legacy pod (dry run) the conversion webhook must convert, and a template whose
    config the claim webhook must refuse. Each outcome is kept with its time: empty
    where the webhook gave its own, right answer, else what happened instead."""

    def __init__(self, stack: NodeGpus, kube: Kube, ns: str) -> None:
        self.kube = kube
        self.outcomes: list[tuple[float, str]] = []
        self._pod = legacy_pod(stack, "rollout-load", ns, "nvidia.com/gpu")
        self._template = mps_template(ns, "rollout-load", "true")
        config = self._template["spec"]["spec"]["devices"]["config"][0]["opaque"]
        config["parameters"]["sharing"]["strategy"] = "Nonsense"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="admission-load", daemon=True)

    def _pod_problem(self) -> str:
        try:
            pod = self.kube.create(self._pod, dryRun="All")
        except ApiError as e:
            return f"legacy pod: {e}"
        return "" if CONVERTED in pod["metadata"].get("annotations", {}) else "not converted"

    def _template_problem(self) -> str:
        try:
            self.kube.create(self._template, dryRun="All")
        except ApiError as e:
            # The webhook's refusal, not the API server's failure to call it.
            denied = "denied the request" in str(e) and "Nonsense" in str(e)
            return "" if denied else f"bad template: {e}"
        return "bad template admitted"

    def _run(self) -> None:
        while not self._stop.is_set():
            for review in (self._pod_problem, self._template_problem):
                problem = review()
                self.outcomes.append((time.monotonic(), problem))

    def answered_since(self, since: float) -> bool:
        return any(t >= since and not problem for t, problem in self.outcomes)

    def __enter__(self) -> AdmissionLoad:
        assert not self._pod_problem() and not self._template_problem()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def clock(monotonic: float) -> str:
    """A `time.monotonic()` reading as the wall clock's time of day, to the millisecond,
    so that reviews and the webhook pods' states line up in a failure's report."""
    wall = time.time() + monotonic - time.monotonic()
    return f"{time.strftime('%X', time.localtime(wall))}.{int(wall * 1000) % 1000:03d}"


class WebhookPod(NamedTuple):
    """Where a webhook pod runs, and its state (ready, terminating) with that of its
    address in the Service's EndpointSlices, which the API server calls."""

    node: str
    """Empty until it is scheduled."""
    state: str
    serving: bool
    """Ready, not being deleted, and its endpoint ready."""


def webhook_pods(kube: Kube) -> dict[str, WebhookPod]:
    """The chart's webhook pods by name, terminating ones included."""
    pods = kube.list("Pod", CHART_NAMESPACE, labelSelector="app.kubernetes.io/component=webhook")
    slices = kube.request(
        "GET",
        f"/apis/discovery.k8s.io/v1/namespaces/{CHART_NAMESPACE}/endpointslices",
        query={"labelSelector": f"kubernetes.io/service-name={WEBHOOK_SERVICE}"},
    )["items"]
    endpoints = {
        address: endpoint.get("conditions", {})
        for s in slices
        for endpoint in s.get("endpoints") or ()
        for address in endpoint.get("addresses", ())
    }
    states = {}
    for pod in pods:
        conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", ())}
        ip = pod.get("status", {}).get("podIP", "")
        deleting = "deletionTimestamp" in pod["metadata"]
        endpoint = endpoints.get(ip)
        states[pod["metadata"]["name"]] = WebhookPod(
            str(pod["spec"].get("nodeName") or ""),
            f"ready={conditions.get('Ready')} deleting={deleting} endpoint={endpoint}",
            conditions.get("Ready") == "True"
            and not deleting
            and bool(endpoint and endpoint.get("ready")),
        )
    return states


@dataclass
class Rollout:
    """What a webhook rollout under `AdmissionLoad` gave: each review's time and
    problem (empty: the webhook's right answer), when the new pods had answered, and
    the pods' states as the rollout went."""

    outcomes: list[tuple[float, str]]
    settled: float
    timeline: list[str]
    nodes: set[str]

    @property
    def problems(self) -> list[str]:
        return [p for _, p in self.outcomes if p]

    @property
    def after(self) -> list[str]:
        """The reviews' problems once the new pods had answered."""
        return [p for t, p in self.outcomes if t >= self.settled]

    @property
    def gap(self) -> float:
        """From the first review not answered right to the last, in seconds."""
        times = [t for t, p in self.outcomes if p]
        return times[-1] - times[0] if times else 0.0

    def report(self, what: str) -> str:
        """A summary for `-rP`: the counts, then the most frequent problems (their ends,
        where the cause is, with digits masked)."""
        kinds = Counter(re.sub(r"[0-9]+", "N", p)[-200:] for p in self.problems)
        return "\n  ".join(
            [
                f"{what}: reviews {len(self.outcomes)}, not answered right "
                f"{len(self.problems)}, gap {self.gap:.1f} s, "
                f"pods on {', '.join(sorted(self.nodes))}",
                *(f"{n} x {kind}" for kind, n in kinds.most_common(3)),
            ]
        )


def roll_under_load(
    stack: NodeGpus, kube: Kube, ns: str, start: Callable[[], None] | None = None
) -> Rollout:
    """Rolls the webhook's Deployment under `AdmissionLoad`, until the old pods are
    gone, the new ones are ready and one has answered, and 3 s more: by `start` (an
    upgrade, say), else by restarting it as `kubectl rollout restart` does. It starts
    once every webhook pod serves, none left terminating from an upgrade just before,
    so that what the reviews meet is this rollout's doing alone."""

    def settled() -> bool:
        pods = webhook_pods(kube)
        return bool(pods) and all(p.serving for p in pods.values()) and webhook_ready(kube)

    wait_for("the webhook's pods all serving, none being replaced", settled, timeout=90)
    (deployment,) = webhook_deployments(kube)
    old = webhook_pods(kube)
    timeline: list[str] = []
    nodes = {pod.node for pod in old.values() if pod.node}

    def replaced() -> bool:
        pods = webhook_pods(kube)
        timeline.append(f"{clock(time.monotonic())} {pods}")
        nodes.update(pod.node for pod in pods.values() if pod.node)
        return bool(pods) and not pods.keys() & old.keys() and webhook_ready(kube)

    def restart() -> None:
        restarted = {"gpudra.e2e/restartedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        kube.request(
            "PATCH",
            kube.path("Deployment", CHART_NAMESPACE, deployment["metadata"]["name"]),
            {"spec": {"template": {"metadata": {"annotations": restarted}}}},
            content_type="application/merge-patch+json",
        )

    with AdmissionLoad(stack, kube, ns) as load:
        time.sleep(2)
        (start or restart)()
        wait_for("the webhook's pods replaced, the old ones gone", replaced, timeout=180)
        now = time.monotonic()
        wait_for("a review answered by the new pod", lambda: load.answered_since(now), timeout=30)
        settled = time.monotonic()
        time.sleep(3)
    return Rollout(load.outcomes, settled, timeline, nodes)


def test_a_webhook_rollout_under_load_answers_right_or_finds_no_endpoint(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """A rollout of the webhook while pods and claims keep coming, with the chart as
    this node runs it: one replica on the node's network, so the new pod can only
    listen once the old one has gone (`maxSurge: 0`), and its CA is a new one
    (tls.source self). Every review is either the webhook's right answer or the API
    server finding no ready endpoint to call (`no_endpoint_error`; docs/install.md,
    Upgrade: two replicas or the pod network close that gap, below); never a TLS
    failure against a CA the configurations do not trust yet or any more, a connection
    cut before its review was answered (`EOF`: the pod being stopped answers those
    opened before its stop, in their handshake or before their first request), or a
    wrong answer from the pod being stopped. The one exception is kube-proxy's, on kind:
    the review it holds as the endpoints go from none to one (`held_by_kube_proxy`).
    Once the new pod is ready and has answered, every review is answered. The gap, from
    the first review refused to the last, is printed (with `-rP`): the chart drains a
    lone replica on the node's network for 1 s, not 5, and probes its readiness every
    second."""
    if not isinstance(stack, ChartStack):
        pytest.skip("the host-process webhook is not a pod a rollout replaces")
    with stack.webhook_on_node_network():
        gap = no_endpoint_error(kube)
        rollout = roll_under_load(stack, kube, ns)
    print(rollout.report("one replica on the node's network"))
    refused = [i for i, (_, p) in enumerate(rollout.outcomes) if p and gap in p]
    held = held_by_kube_proxy(rollout, refused)
    if held is not None:
        t, problem = rollout.outcomes[held]
        print(
            "  held by kube-proxy as the endpoints went from none to one (the gap above "
            f"counts its wait): {clock(t)} {problem}"
        )
    other = [
        f"{clock(t)} {p}"
        for i, (t, p) in enumerate(rollout.outcomes)
        if p and gap not in p and i != held
    ]
    if other and refused:
        span = [clock(rollout.outcomes[i][0]) for i in (refused[0], refused[-1])]
        other.append(f"the gap's refusals: {span[0]} to {span[1]}")
    assert not other, "\n".join([*other[:20], "webhook pods:", *rollout.timeline])
    assert len(rollout.after) >= 10 and not any(rollout.after), rollout.after


def held_by_kube_proxy(rollout: Rollout, refused: list[int]) -> int | None:
    """The review kube-proxy held, if one was: where the API server dials the Service's
    cluster IP through kube-proxy (kind's, kubeadm's), the first connection as the
    Service's endpoints go from none to one can get a conntrack entry that is not
    translated to the new endpoint, and its SYNs go nowhere until the webhook's timeout
    (kubernetes/kubernetes#48719). The load sends one review at a time, so that is the
    review right after the gap's last refusal, and it fails with `HELD`. Seen on kind in
    5 rollouts of 20 with this webhook and 6 of 13 with the one before, with the
    control-plane node's conntrack table holding that connection's SYN untranslated
    (reply tuple the cluster IP's own) for the whole wait. Nothing the webhook does
    reaches it, so it alone is excused, and only there: the local control plane picks
    an endpoint itself, with no kube-proxy on the path."""
    if not on_kind() or not refused:
        return None
    after = refused[-1] + 1
    if after < len(rollout.outcomes) and HELD in rollout.outcomes[after][1]:
        return after
    return None


def assert_every_review_answered(rollout: Rollout) -> None:
    """Every review of the rollout answered right, and enough of them after it."""
    assert not rollout.problems, "\n".join(
        [*rollout.problems[:20], "webhook pods:", *rollout.timeline]
    )
    assert len(rollout.after) >= 10


def test_a_webhook_on_the_pod_network_rolls_under_load_answering_every_review(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """The chart's default, the webhook on the pod network: a rollout starts the new
    pod beside the old one (a surge pod), so an endpoint is ready throughout and every
    review is answered right: with one replica and its own CA (tls.source self, the
    default), where the new pod's CA must be trusted before it serves and the old
    one's until it stops, and with two replicas on the chart's CA (tls.source helm).
    Then the upgrade back to the default, under the same stream: the chart keeps the
    bundle Helm set until the new pod has added its own CA beside it, and that write
    leaves the bundle the webhook's alone, so later upgrades leave it to the webhook.
    The pods reach the API server at the `kubernetes` Service's address, which the host
    routes for this test on the local node (no kube-proxy runs there) and kube-proxy
    on kind, where the pods may land on either GPU worker (the report names the nodes
    each rollout's pods ran on)."""
    if not isinstance(stack, ChartStack):
        pytest.skip("the host-process webhook is not a pod a rollout replaces")
    reason = stack.pod_network_unreachable(kube)
    if reason:
        pytest.skip(f"no route to the API server from the pod network here: {reason}")
    with stack.webhook_on_pod_network() as replicas:
        for count in (1, 2):
            replicas(count)
            rollout = roll_under_load(stack, kube, ns)
            print(rollout.report(f"{count} replica(s) on the pod network"))
            assert_every_review_answered(rollout)
        # Back to the default, an upgrade under the same stream.
        rollout = roll_under_load(stack, kube, ns, start=lambda: replicas(1))
        print(rollout.report("upgraded from two replicas on the chart's CA to one with its own"))
        assert_every_review_answered(rollout)
        for kind, name in WEBHOOK_CONFIGURATIONS:
            assert field_managers(kube.get(kind, name), "caBundle") == {FIELD_MANAGER}, (kind, name)


def test_an_mps_daemon_pod_sees_only_its_claims_folders(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """A claim's containers talk to its MPS daemon, so its pod gets of the agent's state
    folder only the claim's own pipe, log and shm folders: not the checkpoint, not
    another claim's folders. The pipe and log folders are at the paths the agent sees
    them at, as the daemon's environment names them."""
    if not isinstance(stack, ChartStack):
        pytest.skip("daemons of host-process agents are their children, not pods")
    if on_kind():
        pytest.skip(
            "it reads the agent's state folder on the host; a kind node's is in its container"
        )
    kube.create(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
    for pod in ("mps-a", "mps-b"):
        kube.create(gpu_pod(stack, pod, ns, template="mps"))
    wait_running(kube, ns, "mps-a", "mps-b")
    first, second = (claim_uid(kube, ns, p) for p in ("mps-a", "mps-b"))
    pipes = mps_pipes(stack)
    assert set(daemon_pods(kube)) == {first, second}
    state = stack.state_dir
    assert (state / "checkpoint.json").is_file() and Path(pipes[first]).is_dir()

    root = daemon_root(pipes[second])
    inside = root / str(state).lstrip("/")
    assert (root / pipes[second].lstrip("/") / "control").is_fifo()  # its own pipe folder
    assert (inside / "mps" / second / "log").is_dir()
    # Nothing else of the state folder: the checkpoint, the other claim's folders.
    assert not (inside / "checkpoint.json").exists()
    assert not (root / pipes[first].lstrip("/")).exists()
    assert names(inside / "mps") == [second]
    assert names(inside / "mps" / second) == ["log", "pipe"]
    assert names(inside) == sorted(
        ["mps", EMULATED_DRIVER_ROOT, EMULATED_TOOLS_LOG]  # the stand-in tools, their log
    )
    for pod in ("mps-a", "mps-b"):
        kube.delete("Pod", pod, ns)
    wait_unprepared(stack, {first, second}, "the MPS pods' claims")
    assert not daemon_pods(kube)


def test_a_multi_user_mps_claims_daemon_pod_runs_with_dash_m(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """Upstream's `mpsConfig.multiUser` through the chart: the agent's daemon pod, its
    command ending in `-M`, passes the chart's admission policy for daemon pods, the
    real kubelet runs it, and the daemon starts in multi-user mode."""
    if not isinstance(stack, ChartStack):
        pytest.skip("daemons of host-process agents are their children, not pods")
    template = mps_template(ns, "users", "!device.allowMultipleAllocations")
    (config,) = template["spec"]["spec"]["devices"]["config"]
    config["opaque"]["parameters"]["sharing"]["mpsConfig"] = {"multiUser": True}
    kube.create(template)
    kube.create(gpu_pod(stack, "users", ns, template="users"))
    wait_running(kube, ns, "users")
    uid = claim_uid(kube, ns, "users")
    (pod,) = kube.list("Pod", OWN_NAMESPACE, labelSelector=f"{CLAIM_LABEL}={uid}")
    *_, tool, option = pod["spec"]["containers"][0]["command"]
    assert tool.endswith("/nvidia-cuda-mps-control") and option == "-M"
    assert any(c.startswith("mps-control -f -M pipe=") for c in stack.tool_calls())
    kube.delete("Pod", "users", ns)
    wait_unprepared(stack, {uid}, "the multi-user MPS pod's claim")
    assert not daemon_pods(kube)


def test_an_mps_daemon_that_never_listens_is_named_in_the_pods_events(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """A daemon pod gets 60 s to start its daemon, the kubelet's prepare call 45. With
    a control daemon that makes its pipe and hangs (its pod runs, so nothing shows a
    problem), the first call is answered before its deadline, saying the prepare goes
    on (not left to end in `context deadline exceeded`); the kubelet's retry is
    answered with what that prepare came to, so the pod's events name the cause. Once
    the daemon is fixed, the next retry starts the pod."""
    if not isinstance(stack, ChartStack):
        pytest.skip("daemons of host-process agents are their children: a start gets 10 s")
    if on_kind():
        pytest.skip("it changes the stand-in driver root on the host, not in a kind node")
    tool = stack.state_dir / EMULATED_DRIVER_ROOT / "usr/bin/nvidia-cuda-mps-control"
    original = tool.read_bytes()

    def install(content: bytes) -> None:
        staged = tool.with_name(f".{tool.name}.new")
        staged.write_bytes(content)
        staged.chmod(0o755)
        staged.replace(tool)

    kube.create(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
    try:
        install(b'#!/bin/sh\nmkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"\nexec sleep 600\n')
        kube.create(gpu_pod(stack, "hung", ns, template="mps"))
        named = wait_for(
            "an event that names the cause",
            lambda: [e for e in events(kube, ns, "hung") if "did not listen on its" in e],
            timeout=240,
        )
    finally:
        install(original)
    assert "within 60s; see the pod's events" in named[0]
    assert UNHEARD_FAILURE_NOTE in named[0]
    seen = events(kube, ns, "hung")
    assert [e for e in seen if STILL_UNDER_WAY in e]
    assert not [e for e in seen if "DeadlineExceeded" in e]
    wait_running(kube, ns, "hung")
    uid = claim_uid(kube, ns, "hung")
    assert set(daemon_pods(kube)) == {uid}
    kube.delete("Pod", "hung", ns)
    wait_unprepared(stack, {uid}, "the MPS pod's claim")
    assert not daemon_pods(kube)


class _Libraries:
    """How a test lays out a stand-in driver root: the real NVML and CUDA libraries
    (`shared_library`) put where the layout keeps them, as `driver_root_on_host`'s
    `arrange`; then where they are, by soname."""

    def __init__(self, debian: bool) -> None:
        self.debian = debian
        self.files: dict[str, Path] = {}

    def __call__(self, root: Path) -> None:
        libraries = root / DEBIAN_LIBRARY_DIR
        moved = debian_layout(root) if self.debian else {}
        for name in (NVML_LIBRARY, CUDA_LIBRARY):
            file = moved.get(name, libraries / name)
            file.unlink()
            self.files[name] = shared_library(file, name)


@pytest.mark.parametrize("debian", [False, True], ids=["files", "debian-alternatives"])
def test_the_chart_runs_the_tools_of_a_driver_root_it_mounts_under_host(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str, debian: bool
) -> None:
    """`node.driverRoot` other than / (a driver container's root): the agent's image
    holds no driver files, and the agent sees the root only under /host. It runs the
    root's nvidia-smi for a time-sliced claim, and its MPS daemon pod (which mounts the
    root at the same path) runs the root's control daemon with the root's NVML and
    CUDA preloaded (real libraries here: stand-ins that are no ELF objects are not).

    Laid out as Debian's packages do (`e2e.debian_driver`), the libraries and
    nvidia-smi are absolute links through the root's /etc/alternatives, which name the
    agent's own files under /host and the host's outside the root: the agent follows
    them inside the root, and the container gets the root's files under their names."""
    if not isinstance(stack, ChartStack):
        pytest.skip("host processes see the driver root at its own path")
    if on_kind():
        pytest.skip("it bind-mounts a stand-in driver root on the host, not in a kind node")
    arranged = _Libraries(debian)
    with stack.driver_root_on_host(arranged) as root:
        sliced = claim_template("sliced", ns, "!device.allowMultipleAllocations")
        sharing = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
        parameters = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": sharing,
        }
        sliced["spec"]["spec"]["devices"]["config"] = [
            {"opaque": {"driver": DRIVER, "parameters": parameters}}
        ]
        kube.create(sliced)
        kube.create(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
        kube.create(gpu_pod(stack, "sliced", ns, template="sliced"))
        kube.create(gpu_pod(stack, "mps", ns, template="mps"))
        wait_running(kube, ns, "sliced", "mps")
        devices = node_devices(kube, stack.node_name)
        uuid = attr(devices[allocation(kube, ns, "sliced")[0]["device"]], "uuid")
        assert f"nvidia-smi compute-policy -i {uuid} --set-timeslice 3" in stack.tool_calls()
        mps = claim_uid(kube, ns, "mps")
        (pod,) = [
            p
            for p in kube.list("Pod", OWN_NAMESPACE, labelSelector=CLAIM_LABEL)
            if p["metadata"]["labels"][CLAIM_LABEL] == mps
        ]
        container = pod["spec"]["containers"][0]
        seen_root = f"/host{root}"
        assert container["command"][-1] == f"{seen_root}/usr/bin/nvidia-cuda-mps-control"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LD_PRELOAD"] == ":".join(
            f"/host{arranged.files[name]}" for name in (NVML_LIBRARY, CUDA_LIBRARY)
        )
        assert daemon_alive(mps_pipes(stack)[mps])
        # NVIDIA's daemon starts its server by name from its PATH: the root's (in
        # /usr/sbin, as Debian has it) ends the pod's.
        server = f"{seen_root}/usr/{'sbin' if debian else 'bin'}/{MPS_SERVER}"
        assert env["PATH"].endswith(":" + server.rsplit("/", 1)[0])
        name = pod["metadata"]["name"]
        found = f"command -v {MPS_SERVER}"
        out = cluster.kubectl("exec", "-n", OWN_NAMESPACE, name, "--", "sh", "-c", found)
        assert out.stdout.strip() == server, (out.stdout, out.stderr)
        # The claim's container has the root's libraries under their sonames.
        for name in (NVML_LIBRARY, CUDA_LIBRARY):
            inside = f"/{DEBIAN_LIBRARY_DIR}/{name}"
            out = cluster.kubectl("exec", "-n", ns, "sliced", "--", "sha256sum", inside)
            assert out.returncode == 0, out.stderr
            host = hashlib.sha256(arranged.files[name].read_bytes()).hexdigest()
            assert out.stdout.split()[0] == host, name
        uids = {claim_uid(kube, ns, p) for p in ("sliced", "mps")}
        for name in ("sliced", "mps"):
            kube.delete("Pod", name, ns)
        wait_unprepared(stack, uids, "the claims")
        wait_for(
            "the time slice reset",
            lambda: f"nvidia-smi compute-policy -i {uuid} --set-timeslice 0" in stack.tool_calls(),
        )
        assert not daemon_pods(kube)


def test_deleted_slices_come_back_and_running_pods_keep_their_gpus(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "keeps", ns, template="whole"))
    wait_running(kube, ns, "keeps")
    view = seen(cluster, ns, "keeps")
    before = node_devices(kube, stack.node_name)
    for s in kube.list("ResourceSlice", fieldSelector=f"spec.nodeName={stack.node_name}"):
        kube.delete("ResourceSlice", s["metadata"]["name"])
    wait_for(
        "the pool restored",
        lambda: node_devices(kube, stack.node_name).keys() == before.keys(),
        timeout=60,
    )
    kube.create(gpu_pod(stack, "next", ns, template="whole"))
    wait_running(kube, ns, "next")
    assert running(kube, ns, "keeps")
    assert seen(cluster, ns, "keeps") == view
    # The allocator still knew the running pod's GPU was taken.
    assert gpu_minors(seen(cluster, ns, "next")[0]).isdisjoint(gpu_minors(view[0]))


def test_a_no_execute_taint_rule_evicts_the_pod_and_the_node_unprepares_its_claim(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """Maintenance that cannot wait, through a real kubelet: the controller-manager evicts
    the pod holding the tainted GPU, the kubelet stops it and asks the agent to
    unprepare, and the claim leaves the node with nothing behind (no spec, no record);
    a new pod gets another GPU while the rule stands."""
    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "user", ns, template="whole"))
    wait_running(kube, ns, "user")
    (result,) = allocation(kube, ns, "user")
    uid = claim_uid(kube, ns, "user")
    assert uid in stack.checkpoint()
    with features.device_taint_rule(kube, DRIVER, stack.node_name, result["device"], "NoExecute"):
        wait_for("the pod evicted", lambda: kube.get_or_none("Pod", "user", ns) is None, timeout=90)
        wait_unprepared(stack, {uid}, "the evicted pod's claim")
        kube.create(gpu_pod(stack, "next", ns, template="whole"))
        wait_running(kube, ns, "next")
        assert allocation(kube, ns, "next")[0]["device"] != result["device"]


# --- bad input ---------------------------------------------------------------------------


def test_more_gpus_than_the_node_has_stays_pending_and_the_node_stays_healthy(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    kube.create(whole_gpu_template(ns, "too-many", count=8))
    kube.create(gpu_pod(stack, "greedy", ns, template="too-many"))
    wait_for(
        "the greedy pod's scheduling failure",
        lambda: any("cannot allocate all claims" in e for e in events(kube, ns, "greedy")),
        timeout=60,
    )
    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "modest", ns, template="whole"))
    wait_running(kube, ns, "modest")
    assert kube.get("Pod", "greedy", ns)["status"]["phase"] == "Pending"


def test_invalid_claim_config_is_refused_with_the_field(stack: NodeGpus, kube: Kube) -> None:
    claim = configured_claim("bad-config", "default", {"strategy": "Sometimes"})
    with pytest.raises(ApiError) as caught:
        kube.create(claim)
    assert caught.value.status in (400, 403)
    assert "sharing.strategy" in str(caught.value.body)
    assert "TimeSlicing" in str(caught.value.body)


def test_invalid_config_that_reaches_the_node_fails_the_pod_with_an_event(
    stack: NodeGpus, kube: Kube, own_ns: None
) -> None:
    """A claim the webhook never saw (the driver's own namespace, which it leaves
    alone): the plugin refuses it per claim, the kubelet's event names the field, and
    the node keeps serving other pods."""
    ns = OWN_NAMESPACE
    claim = configured_claim(
        "bad", ns, {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}
    )
    kube.create(claim)
    kube.create(gpu_pod(stack, "refused", ns, claim="bad"))
    failures = wait_for(
        "the kubelet's prepare failure event",
        lambda: [e for e in events(kube, ns, "refused") if "FailedPrepare" in e],
        timeout=90,
    )
    (failure,) = set(failures)
    assert "sharing.timeSlicingConfig.interval: unknown value 'Forever'" in failure
    assert "accepted values: Default, Short, Medium, Long" in failure
    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "fine", ns, template="whole"))
    wait_running(kube, ns, "fine")
    assert kube.get("Pod", "refused", ns)["status"]["phase"] == "Pending"
    assert spec_of(kube.get("ResourceClaim", "bad", ns)["metadata"]["uid"]) not in stack.cdi_specs()


def test_agent_without_the_api_fails_prepares_with_the_cause(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """The agent's API server address is wrong: GPU pods wait with an event that says
    so, ordinary pods keep running, and the fixed agent starts the waiting pod."""
    kube.create(whole_gpu_template(ns))
    with stack.api_unreachable():
        kube.create(gpu_pod(stack, "waits", ns, template="whole"))
        failure = wait_for(
            "the prepare failure event",
            lambda: [e for e in events(kube, ns, "waits") if "FailedPrepare" in e],
            timeout=90,
        )
        assert "reading it from the API server failed" in failure[0]
        plain = gpu_pod(stack, "plain", ns, template="whole")
        del plain["spec"]["resourceClaims"]
        del plain["spec"]["containers"][0]["resources"]
        kube.create(plain)
        wait_running(kube, ns, "plain")
        assert kube.get("Pod", "waits", ns)["status"]["phase"] == "Pending"
    wait_running(kube, ns, "waits")


def test_prometheus_fires_the_idle_alert_for_the_pod_whose_gpu_idles(
    stack: NodeGpus, kube: Kube, ns: str, tmp_path: Path, cluster: Cluster
) -> None:
    """A real Prometheus scrapes the node agent and evaluates the chart's alert rules
    (rendered by helm with short thresholds): of two pods holding a whole GPU each, the
    one whose GPU is scripted idle gets GpuAllocatedIdle and GpuLowUtilization naming
    it; the busy one gets no alert, not even pending."""
    if stack.name == "kind":
        pytest.skip("Prometheus runs on the host, which cannot reach a kind worker's agent")
    try:
        helm, prometheus = h.helm_binary(), p.bin_dir()
    except (h.HelmUnavailable, p.PrometheusUnavailable) as e:
        pytest.skip(str(e))
    values = {"enabled": True, "idleSeconds": 3, "lowUtilizationFor": "5s"}
    monitoring = {"prometheusRule": values, "podMonitor": {"enabled": True}}
    objects = h.template(helm, {"monitoring": monitoring})
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    # Scraped as the Prometheus Operator scrapes the chart's PodMonitor: the target's own
    # namespace, pod and container labels must not replace the holder's.
    monitor = p.pod_monitor(objects, "node")
    gpus = list(stack.gpu_minors())
    script = stack.telemetry_script

    def utilization(idle: set[str]) -> None:
        script.write_text(json.dumps({u: {"utilization": 1 if u in idle else 90} for u in gpus}))

    script.parent.mkdir(parents=True, exist_ok=True)
    utilization(set())
    port = stack.metrics_port
    # This Prometheus scrapes every second: the shortest zero window the chart accepts
    # for that interval (two scrapes), not the default, sized for 30 s to 1 m scrapes.
    flags = (
        f"--metrics-address=127.0.0.1:{port}",
        "--sample-interval=1",
        "--accounting-zero-window=2",
    )
    with stack.agent_flags(*flags, f"--nvml-script={script}"):
        kube.create(whole_gpu_template(ns))
        kube.create(with_sidecars(gpu_pod(stack, "idler", ns, template="whole")))
        kube.create(gpu_pod(stack, "busy", ns, template="whole"))
        wait_running(kube, ns, "idler", "busy")
        devices = node_devices(kube, stack.node_name)
        idle_uuid = attr(devices[allocation(kube, ns, "idler")[0]["device"]], "uuid")
        utilization({idle_uuid})
        targets = [f"127.0.0.1:{port}"]
        rules = p.rule_groups(rule)
        with p.serve(
            prometheus, tmp_path, targets=targets, rules=rules, pod_monitor=monitor
        ) as prom:

            def firing() -> dict[str, dict[str, Any]]:
                found = {
                    a["labels"]["alertname"]: a
                    for a in prom.alerts()
                    if a["state"] == "firing"
                    and a["labels"].get("pod") == "idler"
                    and a["labels"].get("container")  # once the agent has read the pod
                }
                return found if {"GpuAllocatedIdle", "GpuLowUtilization"} <= found.keys() else {}

            alerts = wait_for("the idle pod's alerts firing", firing, timeout=120)
            assert prom.targets_up(), prom.log_tail()
            idle = alerts["GpuAllocatedIdle"]
            assert idle["labels"]["namespace"] == ns
            assert idle["labels"]["uuid"] == idle_uuid
            # The claim came from a template (named through the pod's status); the
            # sidecar uses it too, the log shipper does not.
            assert idle["labels"]["container"] == "main,watcher"
            assert alerts["GpuLowUtilization"]["labels"]["container"] == "main,watcher"
            assert idle["annotations"]["summary"].startswith(f"{ns}/idler holds ")
            assert not [a for a in prom.alerts() if a["labels"].get("pod") == "busy"]

            # `gpudra report` asks the same Prometheus for the namespace's GPU-hours: two
            # GPUs allocated, one of them idle, so some of the hours are idle ones.
            def billed() -> dict[str, Any] | None:
                out = gpudra(
                    cluster, "report", "--prometheus", prom.url, "--since", "5m", "-o", "json"
                )
                mine = [u for u in json.loads(out)["usage"] if u["namespace"] == ns]
                if mine and mine[0]["allocated_hours"] > 0 and mine[0]["idle_hours"] > 0:
                    return dict(mine[0])
                return None

            usage = wait_for("the namespace's GPU-hours from Prometheus", billed, timeout=90)
            assert usage["idle_hours"] < usage["allocated_hours"]
        # `gpudra top` joins the same agent's series to the cluster's claims.
        url = f"{stack.node_name}=http://127.0.0.1:{port}/metrics"
        rows = {
            r["device"]: r for r in gpudra_top(cluster, "--node", stack.node_name, "--metrics", url)
        }
        idler = rows[allocation(kube, ns, "idler")[0]["device"]]
        busy = rows[allocation(kube, ns, "busy")[0]["device"]]
        assert (idler["state"], idler["uuid"], idler["utilization"]) == (
            f"held by {ns}/idler",
            idle_uuid,
            1,
        )
        assert idler["idle_seconds"] is not None
        assert (busy["state"], busy["utilization"], busy["idle_seconds"]) == (
            f"held by {ns}/busy",
            90,
            None,
        )
