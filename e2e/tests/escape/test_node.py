"""A hostile tenant against the node agent, on the real node.

The tenant controls its pods and claims and every file its containers can write.
An MPS claim's container can write the daemon's pipe folder and its /dev/shm;
nothing it leaves there may keep the claim prepared at unprepare, nor reach the
next tenant of the same GPU. Its claim's config may not change what another tenant's
claim on the same GPU runs under (the GPU's time-slice).

Runs like e2e/tests/test_realnode_gpus.py (the real kubelet, containerd and runc,
gpudra as host processes or from the chart, emulated GPUs); skips with the reason
when the machine cannot run a real node.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from gpudra.api.names import POD_CLAIM_NAME_ANNOTATION
from gpudra.driver.processes import ProcessIdentity

from e2e.claims import (
    attr,
    claim_name,
    claim_template,
    node_devices,
    shared_devices,
    wait_running,
)
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube, wait_for
from e2e.gpu_pods import (
    daemon_alive,
    daemon_pods,
    gpu_minors,
    gpu_pod,
    mps_template,
    seen,
    whole_gpu_template,
)
from e2e.node.gpus import DRIVER, GpuStack, NodeGpus
from e2e.tests.test_realnode_gpus import events

pytestmark = pytest.mark.cluster

PIPE = "/tmp/nvidia-mps"  # where the claim's containers see the daemon's pipe folder
DONE = "/tmp/attack-done"  # made once an attack's script has done its part
# The attack, as root in the container: leave a file in the claim's /dev/shm, quit
# the daemon through its control FIFO, put a plain file where the FIFO was, make the
# PID file name PID 1, and leave a tree deeper than Python's recursion limit in the
# pipe folder (under the agent's state folder, a tmpfs of the claim's own).
TAMPER = f"""
echo tenant-a > /dev/shm/left-by-tenant-a
echo quit > {PIPE}/control
i=0
while [ -e {PIPE}/nvidia-cuda-mps-control.pid ] && [ $i -lt 100 ]; do
    sleep 0.1; i=$((i + 1))
done
rm -f {PIPE}/control
echo 'not a pipe' > {PIPE}/control
echo 1 > {PIPE}/nvidia-cuda-mps-control.pid
(cd {PIPE} && i=0 && while [ $i -lt 1200 ]; do mkdir d && cd d || exit 1; i=$((i + 1)); done) &&
touch {DONE}
sleep 86400
"""


def claim_of(kube: Kube, namespace: str, pod_name: str) -> dict[str, Any]:
    obj = kube.get("Pod", pod_name, namespace)
    name = claim_name(obj, obj["spec"]["resourceClaims"][0]["name"])
    claim: dict[str, Any] = kube.get("ResourceClaim", name, namespace)
    return claim


def in_pod(cluster: Cluster, namespace: str, pod_name: str, script: str) -> str:
    out = cluster.kubectl("exec", "-n", namespace, pod_name, "--", "sh", "-c", script)
    assert out.returncode == 0, out.stderr
    return str(out.stdout)


def attacked_mps_claim(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str, script: str
) -> dict[str, Any]:
    """The MPS claim of pod `tenant-a`, once the pod has run `script` up to `DONE`."""
    kube.create(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
    kube.create(gpu_pod(stack, "tenant-a", ns, template="mps", script=script))
    wait_running(kube, ns, "tenant-a")
    wait_for(
        "the tenant's attack done",
        lambda: "yes" in in_pod(cluster, ns, "tenant-a", f"test -e {DONE} && echo yes || :"),
        timeout=30,
    )
    return claim_of(kube, ns, "tenant-a")


def test_a_tenant_that_fakes_its_mps_daemons_files_cannot_keep_the_gpu(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    claim = attacked_mps_claim(stack, kube, cluster, ns, TAMPER)
    uid = claim["metadata"]["uid"]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    mps = stack.checkpoint()[uid]["devices"][0]["details"]["mps"]
    device = node_devices(kube, stack.node_name)[result["device"]]
    gpu_uuid = next(iter(device["attributes"]["uuid"].values()))

    kube.delete("Pod", "tenant-a", ns)

    spec = f"k8s.{DRIVER}-claim_{uid}.json"
    wait_for("the claim's CDI spec removed", lambda: spec not in stack.cdi_specs(), timeout=90)
    wait_for("the claim out of the checkpoint", lambda: uid not in stack.checkpoint(), timeout=30)
    assert uid not in stack.list_names(stack.state_dir / "mps")  # pipe, log and shm folders
    if isinstance(stack, GpuStack):  # the agent's PIDs are this machine's
        assert not ProcessIdentity(mps["daemonPid"], mps["daemonStartTime"]).alive()
    else:  # the chart's agent runs the daemon in a pod, which is gone with the claim
        assert uid not in daemon_pods(kube)
    assert not daemon_alive(mps["pipeDir"])
    # The next tenant gets that very GPU, and a /dev/shm with nothing of the first.
    selector = f'device.attributes["{DRIVER}"].uuid == "{gpu_uuid}"'
    kube.create(mps_template(ns, "same-gpu", selector))
    kube.create(gpu_pod(stack, "tenant-b", ns, template="same-gpu", script="sleep 86400"))
    wait_running(kube, ns, "tenant-b")
    (again,) = claim_of(kube, ns, "tenant-b")["status"]["allocation"]["devices"]["results"]
    assert again["device"] == result["device"]
    assert "left-by-tenant-a" not in in_pod(cluster, ns, "tenant-b", "ls -a /dev/shm")
    uid = claim_of(kube, ns, "tenant-b")["metadata"]["uid"]
    kube.delete("Pod", "tenant-b", ns)
    # Its daemon outlives the agent as a real one would: unprepared before the node goes.
    wait_for("the next claim unprepared", lambda: uid not in stack.checkpoint(), timeout=90)


# The attack, as root in the container: leave what only CAP_DAC_OVERRIDE and
# CAP_FOWNER remove, a folder without write permission in the pipe folder and, in
# the claim's /dev/shm (sticky), another user's closed folder, as a workload that
# runs as that user makes one.
LOCK_OUT = f"""
mkdir {PIPE}/kept && echo x > {PIPE}/kept/f && chmod 555 {PIPE}/kept &&
mkdir /dev/shm/theirs && echo x > /dev/shm/theirs/f &&
chown -R 1000:1000 /dev/shm/theirs && chmod 700 /dev/shm/theirs &&
touch {DONE}
sleep 86400
"""


def test_a_tenant_that_leaves_files_the_agent_may_not_open_cannot_keep_the_gpu(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """Where the agent may not mount (the chart's, for emulated GPUs) the claim's MPS
    folders are plain folders, which unprepare must empty whoever made what is in
    them; the agent is root only for the folders the kubelet and the runtime own, and
    keeps just the two capabilities that takes."""
    uid = attacked_mps_claim(stack, kube, cluster, ns, LOCK_OUT)["metadata"]["uid"]

    kube.delete("Pod", "tenant-a", ns)

    wait_for("the claim out of the checkpoint", lambda: uid not in stack.checkpoint(), timeout=90)
    assert uid not in stack.list_names(stack.state_dir / "mps")  # pipe, log and shm folders


# The attack: fill the pipe folder, which the container may write, as far as it goes.
FILL = f"""
dd if=/dev/zero of={PIPE}/fill bs=1048576 count=256 2>/dev/null
stat -c %s {PIPE}/fill > /tmp/filled
sleep 86400
"""


def test_a_tenant_that_fills_its_mps_pipe_folder_stops_no_other_tenants_prepare(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """The pipe folder is mounted writable into the claim's containers, and sits under
    the agent's state folder, beside the checkpoint. It is a small tmpfs of the claim's
    own: a tenant that fills it fills that, and the next claim's prepare (whose
    checkpoint write needs the state disk) goes through."""
    if not isinstance(stack, GpuStack):
        pytest.skip(
            "the chart runs the agent for emulated GPUs without CAP_SYS_ADMIN, so it cannot "
            "mount the folder's tmpfs (docs/security.md, known limitations); for real GPUs "
            "it runs privileged"
        )
    kube.create(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
    kube.create(gpu_pod(stack, "tenant-a", ns, template="mps", script=FILL))
    wait_running(kube, ns, "tenant-a")
    wait_for(
        "the tenant's pipe folder filled",
        lambda: in_pod(cluster, ns, "tenant-a", "cat /tmp/filled 2>/dev/null || :").strip(),
        timeout=60,
    )
    written = int(in_pod(cluster, ns, "tenant-a", "cat /tmp/filled"))
    assert written <= 4 << 20, f"{written} bytes written to the node through the pipe folder"
    # What the daemon logs for each command the tenant's containers send goes to a
    # small tmpfs of the claim's own too, off the checkpoint's disk.
    log_dir = stack.state_dir / "mps" / claim_of(kube, ns, "tenant-a")["metadata"]["uid"] / "log"
    assert os.path.ismount(log_dir), f"{log_dir} is on the state disk"
    fs = os.statvfs(log_dir)
    assert fs.f_blocks * fs.f_frsize <= 16 << 20, f"{log_dir} holds more than 16 MiB"

    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "tenant-b", ns, template="whole"))
    wait_running(kube, ns, "tenant-b")
    uids = {claim_of(kube, ns, pod)["metadata"]["uid"] for pod in ("tenant-a", "tenant-b")}
    assert all(stack.checkpoint()[uid]["state"] == "PrepareCompleted" for uid in uids)
    for pod in ("tenant-a", "tenant-b"):
        kube.delete("Pod", pod, ns)
    wait_for("both claims unprepared", lambda: not uids & stack.checkpoint().keys(), timeout=90)


def test_a_pod_without_a_claim_cannot_name_another_claims_devices(
    stack: NodeGpus, kube: Kube, cluster: Cluster, ns: str
) -> None:
    """The CDI specs on the node name each prepared claim's devices, and containerd
    injects CDI devices named in a container's annotations (`cdi.k8s.io/*`). A pod
    holding no claim names another pod's GPU that way, through a pod annotation (the
    kubelet does not pass a pod's annotations to its containers), and through
    `NVIDIA_VISIBLE_DEVICES` (read only by NVIDIA's container runtime, which gpudra does
    not need): its container gets no GPU device node and none of the claim's edits,
    while the claim's own pod keeps them."""
    kube.create(whole_gpu_template(ns))
    kube.create(gpu_pod(stack, "holder", ns, template="whole"))
    wait_running(kube, ns, "holder")
    uid = claim_of(kube, ns, "holder")["metadata"]["uid"]
    (device,) = stack.checkpoint()[uid]["devices"]
    cdi_id = device["cdiDeviceIds"][0]
    held, held_env = seen(cluster, ns, "holder")
    assert gpu_minors(held) and any(k.startswith("GPUDRA_") for k in held_env)

    thief = gpu_pod(stack, "thief", ns, template="whole")
    del thief["spec"]["resourceClaims"]
    container = thief["spec"]["containers"][0]
    del container["resources"]
    uuid = next(v for k, v in held_env.items() if k.endswith("_UUID"))
    container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": f"{uuid},all"}]
    thief["metadata"]["annotations"] = {"cdi.k8s.io/steal": cdi_id}
    kube.create(thief)
    wait_running(kube, ns, "thief")
    nodes, env = seen(cluster, ns, "thief")
    assert not gpu_minors(nodes), nodes
    assert not {n for n in nodes if n.startswith("nvidia")}, nodes
    assert not [k for k in env if k.startswith("GPUDRA_")], env
    assert seen(cluster, ns, "holder") == (held, held_env)


def share_template(
    namespace: str, name: str, selector: str, sharing: dict[str, Any]
) -> dict[str, Any]:
    """One integer share of the GPU `selector` picks, shared as `sharing` says."""
    template = claim_template(name, namespace, selector)
    devices = template["spec"]["spec"]["devices"]
    devices["requests"][0]["exactly"]["capacity"] = {"requests": {"shares": "1"}}
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": sharing,
    }
    devices["config"] = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    return template


def test_a_tenant_cannot_set_a_time_slice_under_another_tenants_mps_share(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """A GPU published with integer shares: one tenant's share runs MPS (under the
    GPU's Default time-slice); another tenant's share of the same GPU asking for the Long
    interval would change it under that MPS server. The node refuses that prepare, with
    the reason in the pod's events, and never sets the GPU's time-slice."""
    with stack.agent_flags("--gpu-shares=2"):
        devices = shared_devices(kube, stack.node_name)
        uuid = attr(devices[min(devices)], "uuid")
        selector = f'device.attributes["{DRIVER}"].uuid == "{uuid}"'
        long = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
        kube.create(share_template(ns, "mps", selector, {"strategy": "MPS"}))
        kube.create(share_template(ns, "long", selector, long))
        calls_before = len(stack.tool_calls())
        kube.create(gpu_pod(stack, "tenant-a", ns, template="mps"))
        wait_running(kube, ns, "tenant-a")
        kube.create(gpu_pod(stack, "tenant-b", ns, template="long"))
        failures = wait_for(
            "the kubelet's prepare failure event",
            lambda: [e for e in events(kube, ns, "tenant-b") if "FailedPrepare" in e],
            timeout=90,
        )
        assert any("which runs under the Default time-slice interval" in f for f in failures)
        mark = f"nvidia-smi compute-policy -i {uuid} --set-timeslice"
        assert not [c for c in stack.tool_calls()[calls_before:] if c.startswith(mark)]
        assert kube.get("Pod", "tenant-b", ns)["status"]["phase"] == "Pending"
        for pod in ("tenant-a", "tenant-b"):
            kube.delete("Pod", pod, ns, grace=0)
        wait_for("the pods gone", lambda: not kube.list("Pod", ns), timeout=60)


def test_a_claim_whose_pod_claim_name_is_a_path_gets_no_metadata_mount(
    stack: NodeGpus, kube: Kube, ns: str
) -> None:
    """With `--device-metadata`, a claim's `resource.kubernetes.io/pod-claim-name`
    becomes a folder of the container path its metadata file is mounted at. The chart's
    `gpudra-claim-links` policy keeps a tenant from writing that annotation; where no
    such policy runs, the tenant writes it as the cluster admin does here. A name that
    climbs out of the metadata folder fails the prepare, naming the annotation, and the
    node writes no metadata file and no CDI spec for the claim."""
    hostile = "../../../../../etc"
    with stack.agent_flags("--device-metadata"):
        claim = claim_template("path", ns, "!device.allowMultipleAllocations")
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "name": "path",
                    "namespace": ns,
                    "annotations": {POD_CLAIM_NAME_ANNOTATION: hostile},
                },
                "spec": claim["spec"]["spec"],
            }
        )
        kube.create(gpu_pod(stack, "climber", ns, claim="path"))
        expected = f"annotation {POD_CLAIM_NAME_ANNOTATION} {hostile!r}"
        wait_for(
            "the prepare's failure in the pod's events",
            lambda: any(expected in e for e in events(kube, ns, "climber")),
            timeout=120,
        )
        assert kube.get("Pod", "climber", ns)["status"]["phase"] == "Pending"
        uid = kube.get("ResourceClaim", "path", ns)["metadata"]["uid"]
        assert uid not in stack.checkpoint()
        assert not [n for n in stack.list_names(stack.state_dir / "device-metadata") if uid in n]
        assert not [s for s in stack.cdi_specs() if uid in s]
