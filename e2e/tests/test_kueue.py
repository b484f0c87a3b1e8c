"""Kueue (pinned, e2e/tools/versions.env) queueing GPU Jobs beside gpudra.

The manager runs as a host process against the local control plane with its release's
CRDs and webhooks (`make kueue-up`, e2e/kueue/). The manifests are demo/kueue/*.yaml,
the ones docs/kueue.md shows.

- Admission against a ClusterQueue's `nvidia.com/gpu` quota, Jobs exactly as written for
  the device plugin, on the fake nodes (no GPU needed: Kueue counts the pod template).
- On the real node (skipped with the reason where the machine cannot run one): legacy
  Jobs converted by gpudra's webhook and native ResourceClaimTemplate Jobs run on
  emulated GPUs, and a watcher checks that allocated GPUs never exceed the quota.

Run with `make test-kueue` (kept out of `make test`: see README.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from gpudra.api.deviceclasses import device_classes, mig_profile_class
from gpudra.api.tenants import API_VERSION as TENANT_API
from gpudra.api.tenants import crd_manifest as tenant_crd
from gpudra.common.kube import Kube as AsyncKube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import MigStrategy
from gpudra.driver.gpushares import GpuShares
from gpudra.driver.nvml import load_nvml
from gpudra.webhook.convert import CONVERTED_ANNOTATION as CONVERTED
from gpudra.webhook.convert import DEFAULT_POLICY, ConversionPolicy
from gpudra.webhook.server import WebhookServer
from gpudra.webhook.templates import ApiClaimReader, ApiTemplateEnsurer
from gpudra.webhook.tenants import TenantController

from bench import kueue as bench_kueue
from e2e.claims import claim_template, node_devices, pod_with_claim, running, wait_running
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, Kube, apply_crd, wait_for
from e2e.kueue import jobs
from e2e.kueue.manager import KueueError, KueueManager, frameworks_from_env, kueue_home
from e2e.kueue.manifests import MIG_PROFILES, Endpoint, crds, webhook_configurations
from e2e.node import images
from e2e.node.gpus import DRIVER, GpuStack, NodeGpus
from e2e.node.realnode import RealNode, unavailable_reason
from e2e.node_process import delete_slices
from e2e.provider import local_only
from e2e.webhook_env import (
    EmulatedNode,
    register_webhook,
    serving_config,
    start_emulated_nodes,
    tenant_webhook,
    unregister_webhook,
)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.kueue,
    local_only(
        "Kueue and the webhook run as host processes on the local control plane's "
        "loopback (make test-kueue)"
    ),
]
TEAMS = ("team-a", "team-b")
FRAMEWORKS = ["batch/job", "pod"]


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[KueueManager]:
    try:
        kueue_home()
    except KueueError as e:
        pytest.skip(f"Kueue cannot be built here: {e}")
    manager = KueueManager(cluster)
    started = not manager.is_up()
    manager.up(frameworks=FRAMEWORKS, log=lambda _m: None)
    try:
        yield manager
    finally:
        if started:
            manager.down(log=lambda _m: None)


@pytest.fixture
def queues(kueue: KueueManager, kube: Kube) -> Iterator[None]:
    """The flavor, ClusterQueue and LocalQueues of demo/kueue/00-queues.yaml; the Jobs and
    pods a test left are deleted."""
    for obj in jobs.load(jobs.QUEUES):
        kube.apply(obj)
    yield
    for team in TEAMS:
        for job in kube.list("Job", team):
            jobs.delete_job(kube, team, job["metadata"]["name"])
        for pod in kube.list("Pod", team):  # plain pods, queued by Kueue's Pod integration
            kube.delete("Pod", pod["metadata"]["name"], team, grace=0)
    for team in TEAMS:
        wait_for(
            f"the Jobs and pods of {team} gone",
            lambda t=team: not kube.list("Job", t) and not kube.list("Pod", t),
            timeout=90,
        )


def test_release_webhooks_are_called_by_url_with_the_served_ca() -> None:
    """Every webhook of the release is rewritten to the loopback URL (the API server has
    no route to a Service here); the integrations left out have none."""
    home = kueue_home()
    endpoint = Endpoint(url="https://127.0.0.1:1", ca_bundle_b64="Q0E=")
    configs = webhook_configurations(home / "config", endpoint, ["batch/job"])
    hooks = [h for c in configs for h in c["webhooks"]]
    assert {c["metadata"]["name"] for c in configs} == {
        "kueue-mutating-webhook-configuration",
        "kueue-validating-webhook-configuration",
    }
    assert {h["name"] for h in hooks} >= {"mjob.kb.io", "vjob.kb.io", "mworkload.kb.io"}
    assert not {h["name"] for h in hooks} & {"mpod.kb.io", "mdeployment.kb.io"}
    assert all(
        set(h["clientConfig"]) == {"url", "caBundle"}
        and h["clientConfig"]["url"].startswith(endpoint.url + "/")
        for h in hooks
    )
    converted = [c for c in crds(home / "config", endpoint) if "conversion" in c["spec"]]
    assert {c["metadata"]["name"] for c in converted} >= {"workloads.kueue.x-k8s.io"}
    assert all(
        c["spec"]["conversion"]["webhook"]["clientConfig"]["url"] == f"{endpoint.url}/convert"
        for c in converted
    )


def test_up_is_idempotent_and_down_removes_the_webhooks(kueue: KueueManager, kube: Kube) -> None:
    pid = kueue.status()["pid"]
    said: list[str] = []
    kueue.up(frameworks=FRAMEWORKS, log=said.append)
    assert kueue.status()["pid"] == pid
    assert said == ["Kueue already up (v0.19.2)"]
    name = "kueue-mutating-webhook-configuration"
    assert kube.get_or_none("MutatingWebhookConfiguration", name)
    kueue.down(log=said.append)
    kueue.down(log=said.append)
    assert said[1:] == ["Kueue stopped", "Kueue was not running; nothing to stop"]
    assert kube.get_or_none("MutatingWebhookConfiguration", name) is None
    kueue.up(frameworks=FRAMEWORKS, log=said.append)
    assert kueue.is_up()


def test_unknown_integration_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDRA_KUEUE_FRAMEWORKS", "batch/job,ray.io/rayjob")
    with pytest.raises(KueueError, match=r"GPUDRA_KUEUE_FRAMEWORKS=.*'ray.io/rayjob'.*batch/job"):
        frameworks_from_env()


def test_jobs_are_admitted_up_to_the_quota_and_the_rest_wait(
    kueue: KueueManager, kube: Kube, queues: None
) -> None:
    """Quota 2 `nvidia.com/gpu`, three one-GPU Jobs from two teams: two admitted, the
    third suspended with Kueue's reason until an admitted one goes."""
    names = [("team-a", "fill-0"), ("team-b", "fill-1"), ("team-a", "fill-2")]
    for ns, name in names:
        kube.create(jobs.job_from(jobs.LEGACY_JOB, name, ns))

    def admitted_now() -> list[tuple[str, str]]:
        return [(ns, n) for ns, n in names if jobs.admitted(kube, ns, n)]

    first = wait_for("two Jobs admitted", lambda: len(admitted_now()) == 2 and admitted_now())
    (waiting,) = [j for j in names if j not in first]
    wl = wait_for("the waiting Job's Workload", lambda: jobs.workload_of(kube, *waiting))
    reserved = wait_for(
        "Kueue's reason on the waiting Workload",
        lambda: jobs.condition(jobs.workload_of(kube, *waiting), "QuotaReserved"),
    )
    assert reserved["status"] == "False"
    assert "nvidia.com/gpu" in reserved["message"], reserved
    assert kube.get("Job", waiting[1], waiting[0])["spec"]["suspend"] is True
    assert wl["spec"]["queueName"] == "gpus"

    jobs.delete_job(kube, *first[0])
    wait_for("the waiting Job admitted", lambda: jobs.admitted(kube, *waiting), timeout=60)
    assert len(admitted_now()) == 2


def test_a_job_larger_than_the_quota_stays_suspended_with_kueues_reason(
    kueue: KueueManager, kube: Kube, queues: None
) -> None:
    """Three GPUs against a quota of two: never admitted, no pod and so no claim made."""
    job = jobs.job_from(jobs.LEGACY_JOB, "too-big", "team-a")
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": 3}
    kube.create(job)
    reserved = wait_for(
        "Kueue's reason on the Workload",
        lambda: jobs.condition(jobs.workload_of(kube, "team-a", "too-big"), "QuotaReserved"),
    )
    assert reserved["status"] == "False"
    assert "nvidia.com/gpu" in reserved["message"], reserved
    assert kube.get("Job", "too-big", "team-a")["spec"]["suspend"] is True
    assert not kube.list("Pod", "team-a") and not kube.list("ResourceClaim", "team-a")


def test_a_mapping_of_a_class_gpudra_does_not_serve_leaves_native_jobs_waiting(
    kueue: KueueManager, kube: Kube, queues: None
) -> None:
    """Kueue configured with a class that is not gpudra's: a native Job's claim on
    gpu.nvidia.com maps to no quota, so Kueue keeps it suspended with its reason."""
    kueue.up(
        frameworks=FRAMEWORKS,
        mappings={"nvidia.com/gpu": ["gpu.example.com"]},
        log=lambda _m: None,
    )
    try:
        jobs.submit(kube, jobs.NATIVE_JOB, "unmapped", "team-b")
        wl = wait_for(
            "Kueue's verdict on the Workload",
            lambda: (
                (w := jobs.workload_of(kube, "team-b", "unmapped"))
                and (jobs.condition(w, "QuotaReserved") or jobs.condition(w, "Inadmissible"))
                and w
            ),
        )
        assert kube.get("Job", "unmapped", "team-b")["spec"]["suspend"] is True
        reasons = [c.get("message", "") for c in wl["status"]["conditions"]]
        assert any("gpu.nvidia.com" in m for m in reasons), wl["status"]
        assert not kube.list("ResourceClaim", "team-b")
    finally:
        kueue.down(log=lambda _m: None)
        kueue.up(frameworks=FRAMEWORKS, log=lambda _m: None)


@contextlib.asynccontextmanager
async def gpudra_webhook(
    cluster: Cluster,
    kube: Kube,
    pki_dir: Path,
    *,
    tenants: bool = False,
    policy: ConversionPolicy = DEFAULT_POLICY,
    shares: int = 0,
) -> AsyncIterator[TenantController | None]:
    """gpudra's webhook served from this event loop (with its tenant rules if `tenants`,
    converting by `policy`), emulated GPUs published on the fake node worker-1, and with
    `shares` on worker-2 too, each GPU offering that many shares (`--gpu-shares`):
    converted pods get claims the scheduler allocates, without a real node (their
    containers never run)."""
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    akube = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig))
    pki, config = serving_config(cluster, pki_dir)
    config = dataclasses.replace(config, policy=policy)
    controller = None
    if tenants:
        apply_crd(kube, tenant_crd())
        controller, server = tenant_webhook(akube, config)
    else:
        server = WebhookServer(config, ApiTemplateEnsurer(akube), read_claims=ApiClaimReader(akube))
    node = EmulatedNode("worker-1", "emulated:h100-80gb-hbm3-x8", uuid_salt="kueue")
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        if controller is not None:
            await tg.start(controller.run)
        await start_emulated_nodes(tg, akube, DRIVER, [node])
        if shares:
            agent = NodeAgent(
                AgentConfig(
                    node_name=SHARES_NODE,
                    driver_name=DRIVER,
                    mig_strategy=MigStrategy.STATIC,
                    health_events=False,
                    gpu_shares=GpuShares(default=shares),
                ),
                akube,
                load_nvml("emulated:h100-80gb-hbm3-x8", uuid_salt="kueue-shares"),
            )
            await tg.start(agent.run)
            await agent.slices.converged.wait()
        await register_webhook(akube, pki, config, f"https://{cluster.webhook_host()}:{port}")
        yield controller
        await unregister_webhook(akube)
        tg.cancel_scope.cancel()
    delete_slices(kube, DRIVER)
    await akube.close()


@pytest.fixture
async def converting(cluster: Cluster, kube: Kube, tmp_path: Path) -> AsyncIterator[None]:
    async with gpudra_webhook(cluster, kube, tmp_path / "pki"):
        yield


def swap_is_refused_until_the_job_goes(kube: Kube, job: str, verdict: str) -> None:
    """The native Job `job` of team-b has been counted by Kueue: its template deleted and
    created again asking for eight GPUs is refused by gpudra's claim validation with
    `verdict` about its Workload; once the Job is deleted the same template is created.
    The original template is back afterwards."""
    workload = jobs.workload_of(kube, "team-b", job)
    assert workload is not None
    original = kube.get("ResourceClaimTemplate", "one-gpu", "team-b")
    restored = {
        "apiVersion": original["apiVersion"],
        "kind": original["kind"],
        "metadata": {"name": "one-gpu", "namespace": "team-b"},
        "spec": original["spec"],
    }
    bigger = copy.deepcopy(restored)
    bigger["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 8
    kube.delete("ResourceClaimTemplate", "one-gpu", "team-b")
    try:
        with pytest.raises(ApiError) as refused:
            kube.create(bigger)
        assert refused.value.status == 403, refused.value
        message = str(refused.value)
        assert f"Kueue Workload {workload['metadata']['name']} {verdict}" in message
        jobs.delete_job(kube, "team-b", job)
        wait_for(
            "the Workload gone",
            lambda: jobs.workload_of(kube, "team-b", job) is None,
            timeout=60,
        )
        kube.create(bigger)
    finally:
        with contextlib.suppress(ApiError):
            kube.delete("ResourceClaimTemplate", "one-gpu", "team-b")
        wait_for(
            "the bigger template gone",
            lambda: (
                not any(
                    t["metadata"]["name"] == "one-gpu"
                    for t in kube.list("ResourceClaimTemplate", "team-b")
                )
            ),
        )
        kube.create(restored)


@pytest.mark.anyio
async def test_a_template_an_admitted_job_uses_is_not_created_again_bigger(
    kueue: KueueManager, kube: Kube, queues: None, converting: None
) -> None:
    """Kueue charges a Job for its ResourceClaimTemplates when it admits it, and never
    again (kueue#13842). With the Job admitted, its template deleted and created again
    asking for eight GPUs is refused by gpudra's claim validation, naming the Workload;
    once the Job is deleted the same template is created."""

    def scenario() -> None:
        jobs.submit(kube, jobs.NATIVE_JOB, "swap", "team-b", node="worker-1")
        wait_for("the Job admitted", lambda: jobs.admitted(kube, "team-b", "swap"))
        swap_is_refused_until_the_job_goes(kube, "swap", "was admitted")

    await anyio.to_thread.run_sync(scenario)


def requested(workload: dict[str, Any] | None, resource: str) -> str | None:
    """What a pending Workload was counted for `resource` when Kueue last tried to
    admit it (``status.resourceRequests``, one pod set here), or None before."""
    for pod_set in ((workload or {}).get("status") or {}).get("resourceRequests") or ():
        quantity = (pod_set.get("resources") or {}).get(resource)
        if quantity is not None:
            return str(quantity)
    return None


@pytest.mark.anyio
async def test_a_template_a_waiting_job_was_counted_with_is_not_created_again_bigger(
    kueue: KueueManager, kube: Kube, queues: None, converting: None
) -> None:
    """Kueue reads a pending Workload's templates when it queues it and keeps that count
    in its queue: it watches no ResourceClaimTemplate, so a template replaced while the
    Workload waits for quota is not read again before admission. The quota is full (a
    two-GPU legacy Job), a native Job waits, counted `nvidia.com/gpu: 1`; its template
    deleted and created again asking for eight GPUs is refused, naming the Workload,
    before the Job is admitted; once the Job is deleted the same template is created."""

    def scenario() -> None:
        filler = jobs.job_from(jobs.LEGACY_JOB, "fill", "team-a", node="worker-1")
        filler["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
            "nvidia.com/gpu": 2
        }
        kube.create(filler)
        wait_for("the two-GPU Job admitted", lambda: jobs.admitted(kube, "team-a", "fill"))
        jobs.submit(kube, jobs.NATIVE_JOB, "waits", "team-b", node="worker-1")
        wait_for(
            "the waiting Job counted nvidia.com/gpu: 1",
            lambda: requested(jobs.workload_of(kube, "team-b", "waits"), "nvidia.com/gpu") == "1",
        )
        assert not jobs.workload_admitted(kube, "team-b", "waits")
        swap_is_refused_until_the_job_goes(kube, "waits", "was admitted or counted")

    await anyio.to_thread.run_sync(scenario)


def plain_pod(
    name: str, namespace: str, node: str, command: list[str] | None = None
) -> dict[str, Any]:
    """The legacy Job's pod template as a plain pod in the queue."""
    job = jobs.job_from(jobs.LEGACY_JOB, name, namespace, node=node, command=command)
    spec = job["spec"]["template"]["spec"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {jobs.QUEUE_LABEL: "gpus"}},
        "spec": spec,
    }


def pods_admitted(kube: Kube, names: list[str]) -> int:
    return sum(jobs.workload_admitted(kube, "team-a", n, "Pod") for n in names)


@pytest.mark.anyio
async def test_plain_pods_are_counted_after_conversion_without_a_node(
    kueue: KueueManager, kube: Kube, queues: None, converting: None
) -> None:
    """Kueue's Pod integration reads the pod as stored, after gpudra's webhook converted
    it: each legacy pod's Workload counts `nvidia.com/gpu: 1` (its claim on
    gpu.nvidia.com, mapped back), two are admitted under quota 2, the third is held."""

    def scenario() -> None:
        names = [f"plain-{i}" for i in range(3)]
        for name in names:
            created = kube.create(plain_pod(name, "team-a", "worker-1"))
            assert created["spec"]["resourceClaims"], created["spec"]
        wait_for("two pods admitted", lambda: pods_admitted(kube, names) == 2)
        for name in names:
            wl = wait_for(
                f"the Workload of {name}",
                lambda n=name: jobs.workload_of(kube, "team-a", n, "Pod"),
            )
            assert wl["spec"]["podSets"][0]["template"]["spec"]["resourceClaims"]
            if jobs.workload_admitted(kube, "team-a", name, "Pod"):
                usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
                assert usage == {"nvidia.com/gpu": "1"}, usage
            else:
                gates = kube.get("Pod", name, "team-a")["spec"].get("schedulingGates")
                assert gates, "the waiting pod is not held by Kueue"

    await anyio.to_thread.run_sync(scenario)


SHARES_NODE = "worker-2"
SHARED = "nvidia.com/gpu.shared"


@pytest.fixture
async def share_only(
    cluster: Cluster, kube: Kube, queues: None, tmp_path: Path
) -> AsyncIterator[None]:
    """gpudra's webhook converting without the whole-GPU fallback (`gpudra webhook
    --no-shared-whole-gpu-fallback`, the chart's
    webhook.conversion.sharedWholeGpuFallback: false), worker-2 publishing 2 shares per
    GPU, and a ClusterQueue `shared` with a quota of 2 `nvidia.com/gpu.shared` that
    team-a's LocalQueue `shared` feeds."""
    queue: list[dict[str, Any]] = [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": "shared"},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": [SHARED],
                        "flavors": [
                            {
                                "name": "gpu-default",
                                "resources": [{"name": SHARED, "nominalQuota": 2}],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "shared", "namespace": "team-a"},
            "spec": {"clusterQueue": "shared"},
        },
    ]
    for obj in queue:
        kube.apply(obj)
    policy = ConversionPolicy(shared_whole_gpu_fallback=False)
    try:
        async with gpudra_webhook(cluster, kube, tmp_path / "pki", policy=policy, shares=2):
            yield
    finally:

        def remove() -> None:
            for pod in kube.list("Pod", "team-a"):
                kube.delete("Pod", pod["metadata"]["name"], "team-a", grace=0)
            wait_for("the pods of team-a gone", lambda: not kube.list("Pod", "team-a"))
            for obj in reversed(queue):
                meta = obj["metadata"]
                kube.delete(obj["kind"], meta["name"], meta.get("namespace"))

        await anyio.to_thread.run_sync(remove)


@pytest.mark.anyio
async def test_plain_shared_pods_without_the_fallback_are_admitted_and_get_a_share(
    kueue: KueueManager, kube: Kube, share_only: None
) -> None:
    """Kueue (v0.19.2) cannot count a `firstAvailable` request, so a plain pod asking
    `nvidia.com/gpu.shared: 1` converted with the whole-GPU fallback stays gated
    (Inadmissible). Converted without it, its claim is one share, `exactly`: Kueue
    counts it as `nvidia.com/gpu.shared: 1`, admits two under quota 2 and holds the
    third, and each admitted pod's claim gets one share of a GPU on the node with
    `--gpu-shares`, never a whole GPU."""

    def scenario() -> None:
        names = [f"share-{i}" for i in range(3)]
        for name in names:
            pod = plain_pod(name, "team-a", SHARES_NODE)
            pod["metadata"]["labels"][jobs.QUEUE_LABEL] = "shared"
            pod["spec"]["containers"][0]["resources"]["limits"] = {SHARED: 1}
            created = kube.create(pod)
            (entry,) = created["spec"]["resourceClaims"]
            template = kube.get(
                "ResourceClaimTemplate", entry["resourceClaimTemplateName"], "team-a"
            )
            (request,) = template["spec"]["spec"]["devices"]["requests"]
            assert set(request) == {"name", "exactly"}, request
        wait_for("two pods admitted", lambda: pods_admitted(kube, names) == 2, timeout=60)
        admitted = [n for n in names if jobs.workload_admitted(kube, "team-a", n, "Pod")]
        for name in names:
            wl = jobs.workload_of(kube, "team-a", name, "Pod")
            assert wl is not None
            if name not in admitted:
                assert kube.get("Pod", name, "team-a")["spec"].get("schedulingGates")
                reserved = wait_for(
                    f"Kueue's reason on the Workload of {name}",
                    lambda n=name: jobs.condition(
                        jobs.workload_of(kube, "team-a", n, "Pod"), "QuotaReserved"
                    ),
                )
                assert reserved["status"] == "False", reserved
                assert f"insufficient unused quota for {SHARED}" in reserved["message"], reserved
                continue
            usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
            assert usage == {SHARED: "1"}, usage

        def allocations(name: str) -> list[dict[str, Any]]:
            pod = kube.get("Pod", name, "team-a")
            statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or [{}]
            claim_name = statuses[0].get("resourceClaimName")
            if not claim_name:
                return []
            claim = kube.get("ResourceClaim", claim_name, "team-a")
            allocation = (claim.get("status") or {}).get("allocation") or {}
            results: list[dict[str, Any]] = allocation.get("devices", {}).get("results", [])
            return results

        for name in admitted:
            (result,) = wait_for(f"the claim of {name} allocated", lambda n=name: allocations(n))
            assert result["pool"] == SHARES_NODE, result
            assert result["consumedCapacity"]["shares"] == "1", result
            assert result.get("shareID"), result

    await anyio.to_thread.run_sync(scenario)


def job_events(kube: Kube, ns: str, job: str, reason: str) -> list[str]:
    uid = kube.get("Job", job, ns)["metadata"]["uid"]
    return [
        e.get("message", "")
        for e in kube.list("Event", ns, fieldSelector=f"involvedObject.uid={uid}")
        if e.get("reason") == reason
    ]


TENANT = "kueue-team-a"


@pytest.fixture
async def one_device_per_pod(cluster: Cluster, kube: Kube, tmp_path: Path) -> AsyncIterator[None]:
    """gpudra's webhook with its tenant rules, and a GpuTenant for team-a allowing one
    device per pod, seen by the webhook."""
    body = {
        "apiVersion": TENANT_API,
        "kind": "GpuTenant",
        "metadata": {"name": TENANT},
        "spec": {"namespaces": ["team-a"], "maxDevicesPerPod": 1},
    }
    async with gpudra_webhook(cluster, kube, tmp_path / "pki", tenants=True) as controller:
        assert controller is not None
        await anyio.to_thread.run_sync(kube.request, "POST", f"/apis/{TENANT_API}/gputenants", body)
        try:
            await anyio.to_thread.run_sync(
                lambda: wait_for(
                    "the webhook to see the tenant",
                    lambda: controller.state.lookup("team-a").rules is not None,
                )
            )
            yield
        finally:
            await anyio.to_thread.run_sync(
                kube.request, "DELETE", f"/apis/{TENANT_API}/gputenants/{TENANT}"
            )


def refused_job(kube: Kube) -> None:
    """A two-GPU Job in team-a: Kueue admits it within the quota of 2, gpudra's webhook
    refuses its pod, and the Job carries a FailedCreate event naming tenant and rule."""
    job = jobs.job_from(jobs.LEGACY_JOB, "too-wide", "team-a", node="worker-1")
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": 2}
    kube.create(job)
    wait_for("the Job admitted", lambda: jobs.admitted(kube, "team-a", "too-wide"))
    (message, *_) = wait_for(
        "a FailedCreate event on the Job",
        lambda: job_events(kube, "team-a", "too-wide", "FailedCreate"),
    )
    assert (
        f'tenant "{TENANT}" (GpuTenant {TENANT}): maxDevicesPerPod is 1, this pod asks for 2 '
        "devices"
    ) in message, message
    assert not jobs.pods_of(kube, "team-a", "too-wide")
    kube.create(jobs.job_from(jobs.LEGACY_JOB, "next", "team-b", node="worker-1"))


def next_job_waits(kube: Kube) -> None:
    reserved = wait_for(
        "Kueue's reason on the next Job's Workload",
        lambda: jobs.condition(jobs.workload_of(kube, "team-b", "next"), "QuotaReserved"),
    )
    assert reserved["status"] == "False", reserved


@pytest.mark.anyio
async def test_a_job_whose_pods_break_a_tenant_rule_fails_creating_them_with_the_rule(
    kueue: KueueManager, kube: Kube, queues: None, one_device_per_pod: None
) -> None:
    """Kueue admits a two-GPU Job within its quota; the GpuTenant of team-a allows one
    device per pod, so gpudra's webhook refuses each pod the Job controller creates and
    the Job carries FailedCreate events naming the tenant and the rule. Kueue does not
    see pods that were never created: with Kueue's defaults the Workload stays admitted
    and holds its quota (a one-GPU Job of team-b waits) until the Job is deleted."""

    def scenario() -> None:
        refused_job(kube)
        next_job_waits(kube)
        assert jobs.workload_admitted(kube, "team-a", "too-wide")
        jobs.delete_job(kube, "team-a", "too-wide")
        wait_for("the next Job admitted", lambda: jobs.admitted(kube, "team-b", "next"))

    await anyio.to_thread.run_sync(scenario)


@pytest.mark.anyio
async def test_wait_for_pods_ready_gives_back_the_quota_of_a_refused_job(
    kueue: KueueManager, kube: Kube, queues: None, one_device_per_pod: None
) -> None:
    """With Kueue's waitForPodsReady (here 10 s, no requeuing), the Workload whose pods
    the tenant rule refuses is evicted when its pods are not ready in time and, past the
    requeuing limit, deactivated; its Job is suspended again, and the Job waiting behind
    it is admitted without anyone deleting anything."""

    def scenario() -> None:
        kueue.up(frameworks=FRAMEWORKS, pods_ready_timeout_s=10, log=lambda _m: None)
        try:
            refused_job(kube)
            next_job_waits(kube)
            wait_for(
                "the next Job admitted once the refused one is evicted",
                lambda: jobs.admitted(kube, "team-b", "next"),
                timeout=90,
            )
            wl = jobs.workload_of(kube, "team-a", "too-wide")
            evicted = jobs.condition(wl, "Evicted")
            assert evicted, wl
            assert evicted["reason"] == "DeactivatedDueToRequeuingLimitExceeded", evicted
            assert wl is not None and wl["spec"].get("active") is False, wl["spec"]
            assert kube.get("Job", "too-wide", "team-a")["spec"]["suspend"] is True
        finally:
            kueue.down(log=lambda _m: None)
            kueue.up(frameworks=FRAMEWORKS, log=lambda _m: None)

    await anyio.to_thread.run_sync(scenario)


@pytest.mark.anyio
async def test_a_flavor_no_node_matches_admits_but_nothing_is_allocated(
    kueue: KueueManager, kube: Kube, queues: None, converting: None
) -> None:
    """A ClusterQueue whose only flavor carries node labels no node has: Kueue does not
    look at nodes, so it admits the Job and puts the flavor's labels into its pod's
    nodeSelector; the scheduler keeps the converted pod Pending with its reason, and the
    pod's claim is never allocated, so nothing reaches a node."""
    nowhere = {"gpudra.example/pool": "none"}

    def scenario() -> None:
        kube.apply(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ResourceFlavor",
                "metadata": {"name": "gpu-nowhere"},
                "spec": {"nodeLabels": nowhere},
            }
        )
        cq = jobs.one(jobs.load(jobs.QUEUES), "ClusterQueue")
        cq["metadata"]["name"] = "nowhere"
        cq["spec"]["resourceGroups"][0]["flavors"][0]["name"] = "gpu-nowhere"
        kube.apply(cq)
        kube.apply(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "LocalQueue",
                "metadata": {"name": "nowhere", "namespace": "team-a"},
                "spec": {"clusterQueue": "nowhere"},
            }
        )
        job = jobs.job_from(jobs.LEGACY_JOB, "nowhere", "team-a")
        job["metadata"]["labels"][jobs.QUEUE_LABEL] = "nowhere"
        kube.create(job)
        wait_for("the Job admitted", lambda: jobs.admitted(kube, "team-a", "nowhere"))
        (pod,) = wait_for("the Job's pod", lambda: jobs.pods_of(kube, "team-a", "nowhere"))
        assert pod["spec"]["nodeSelector"] == nowhere, pod["spec"]
        assert pod["spec"]["resourceClaims"], "the pod was not converted"

        def unschedulable() -> str:
            p = kube.get("Pod", pod["metadata"]["name"], "team-a")
            scheduled = jobs.condition(p, "PodScheduled")
            return (scheduled or {}).get("message", "") if scheduled else ""

        message = wait_for("the scheduler's reason", unschedulable)
        assert "didn't match Pod's node affinity/selector" in message, message
        claims = kube.list("ResourceClaim", "team-a")
        assert claims and not any((c.get("status") or {}).get("allocation") for c in claims)

    await anyio.to_thread.run_sync(scenario)


# --- on the real node ------------------------------------------------------------------


class AllocationWatcher:
    """Samples, in a thread for the whole test, how many devices the claims in the teams'
    namespaces hold, so an excess between two checks of the test is seen too."""

    def __init__(self, kube: Kube, namespaces: tuple[str, ...]) -> None:
        self.kube = kube
        self.namespaces = namespaces
        self.samples: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="allocations", daemon=True)

    def allocated(self) -> int:
        return sum(
            len(claim["status"]["allocation"]["devices"]["results"])
            for ns in self.namespaces
            for claim in self.kube.list("ResourceClaim", ns)
            if (claim.get("status") or {}).get("allocation")
        )

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.samples.append(self.allocated())
            except (ApiError, OSError) as e:
                self.errors.append(str(e))

    def __enter__(self) -> AllocationWatcher:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def gpus(cluster: Cluster, kueue: KueueManager) -> Iterator[NodeGpus]:
    """The real node with gpudra's agent and webhook as host processes."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no real node on this machine: {reason}")
    node = RealNode(cluster)
    node.up(log=lambda _m: None)
    stack = GpuStack(node)
    try:
        stack.up(log=lambda _m: None)
        yield stack
    finally:
        stack.down(log=lambda _m: None)
        node.down(log=lambda _m: None)


def quota(kube: Kube, resource: str = "nvidia.com/gpu") -> int:
    cq = kube.get("ClusterQueue", "gpus")
    resources = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    return int(next(r["nominalQuota"] for r in resources if r["name"] == resource))


def run_queued(kube: Kube, gpus: NodeGpus, specs: list[tuple[Path, str, str]]) -> list[int]:
    """Creates the Jobs (file, namespace, name) at once, checks that Kueue admits no more
    than the quota allows while the rest stay suspended, and waits until all succeeded;
    returns what the watcher saw."""
    limit = quota(kube)
    for path, ns, name in specs:
        jobs.submit(
            kube, path, name, ns, image=images.TEST_IMAGE, command=WORK, node=gpus.node_name
        )
    with AllocationWatcher(kube, TEAMS) as watcher:
        wait_for(
            f"{limit} Jobs admitted",
            lambda: sum(jobs.admitted(kube, ns, n) for _p, ns, n in specs) == limit,
        )
        suspended = [n for _p, ns, n in specs if kube.get("Job", n, ns)["spec"]["suspend"]]
        assert len(suspended) == len(specs) - limit, suspended
        for _path, ns, name in specs:
            wait_for(
                f"Job {ns}/{name} finished",
                lambda ns=ns, name=name: jobs.job_finished(kube, ns, name),
                timeout=240,
            )
    assert not watcher.errors, watcher.errors
    for _path, ns, name in specs:
        assert kube.get("Job", name, ns)["status"].get("succeeded") == 1, name
    assert watcher.samples, "the watcher took no sample"
    assert max(watcher.samples) <= limit, watcher.samples
    assert limit in watcher.samples, f"never {limit} GPUs in use at once: {watcher.samples}"
    return watcher.samples


WORK = ["sh", "-c", "ls /dev | grep -q '^nvidia[0-9]' && sleep 4"]
"""Succeeds only where the container sees a GPU device node."""


def test_legacy_jobs_queue_convert_and_run_within_the_quota(
    kube: Kube, gpus: NodeGpus, queues: None
) -> None:
    """Jobs exactly as written for the device plugin: Kueue admits them against the
    `nvidia.com/gpu` quota, gpudra's webhook converts their pods to claims, they run on
    the node's GPUs, and the next is admitted when one completes."""
    specs = [(jobs.LEGACY_JOB, TEAMS[i % 2], f"legacy-{i}") for i in range(4)]
    run_queued(kube, gpus, specs)
    for _path, ns, name in specs:
        (pod,) = jobs.pods_of(kube, ns, name)
        assert CONVERTED in pod["metadata"].get("annotations", {}), pod["metadata"]
        assert pod["spec"]["resourceClaims"], pod["spec"]


def test_native_and_legacy_jobs_share_one_quota(kube: Kube, gpus: NodeGpus, queues: None) -> None:
    """ResourceClaimTemplate Jobs on gpu.nvidia.com count against the same
    `nvidia.com/gpu` quota through Kueue's deviceClassMappings."""
    specs = [
        (jobs.NATIVE_JOB, "team-b", "native-0"),
        (jobs.LEGACY_JOB, "team-a", "legacy-0"),
        (jobs.NATIVE_JOB, "team-b", "native-1"),
        (jobs.NATIVE_JOB, "team-b", "native-2"),
    ]
    run_queued(kube, gpus, specs)
    wl = jobs.workload_of(kube, "team-b", "native-0")
    assert wl is not None
    usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
    assert usage == {"nvidia.com/gpu": "1"}, usage


def test_plain_pods_are_counted_after_conversion(kube: Kube, gpus: NodeGpus, queues: None) -> None:
    """Kueue's Pod integration reads the pod as stored, after gpudra's webhook converted
    it: the legacy `nvidia.com/gpu: 1` pod becomes a claim on gpu.nvidia.com, which
    deviceClassMappings count as `nvidia.com/gpu` again, so the quota holds for pods."""
    names = [f"plain-{i}" for i in range(3)]
    for name in names:
        pod = plain_pod(name, "team-a", gpus.node_name, command=WORK)
        pod["spec"]["containers"][0].update(image=images.TEST_IMAGE, imagePullPolicy="Never")
        kube.create(pod)

    with AllocationWatcher(kube, TEAMS) as watcher:
        wait_for("two pods admitted", lambda: pods_admitted(kube, names) == 2)
        for name in names:
            wait_for(
                f"pod {name} succeeded",
                lambda n=name: kube.get("Pod", n, "team-a")["status"].get("phase") == "Succeeded",
                timeout=240,
            )
    for name in names:
        pod = kube.get("Pod", name, "team-a")
        assert CONVERTED in pod["metadata"].get("annotations", {})
        wl = jobs.workload_of(kube, "team-a", name, "Pod")
        assert wl is not None
        usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
        assert usage == {"nvidia.com/gpu": "1"}, usage
    assert max(watcher.samples) <= 2, watcher.samples


def mig_profiles_allocated(kube: Kube) -> Counter[str]:
    """Allocated MIG devices in team-b per profile, read from the device names
    (`gpu-<minor>-mig-<profile without dots>-...`)."""
    counts: Counter[str] = Counter()
    for claim in kube.list("ResourceClaim", "team-b"):
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in allocation.get("devices", {}).get("results", ()):
            for profile in MIG_PROFILES:
                counts[profile] += f"-mig-{profile.replace('.', '')}-" in result["device"]
    return counts


class ProfileWatcher(AllocationWatcher):
    """Also keeps each sample's MIG devices per profile."""

    def __init__(self, kube: Kube) -> None:
        super().__init__(kube, ("team-b",))
        self.by_profile: list[Counter[str]] = []

    def allocated(self) -> int:
        counts = mig_profiles_allocated(self.kube)
        self.by_profile.append(counts)
        return sum(counts.values())


@pytest.fixture
def profile_classes(kube: Kube, queues: None) -> Iterator[None]:
    """The per-profile MIG classes (deviceClasses.mig.profiles) and their queue."""
    own = {mig_profile_class(p) for p in MIG_PROFILES}
    extra = [
        c for c in device_classes(DRIVER, mig_profiles=MIG_PROFILES) if c["metadata"]["name"] in own
    ]
    assert len(extra) == len(MIG_PROFILES)
    for obj in [*extra, *jobs.load(jobs.MIG_PROFILE_QUEUE)]:
        kube.apply(obj)
    yield
    for job in kube.list("Job", "team-b"):
        jobs.delete_job(kube, "team-b", job["metadata"]["name"])
    wait_for("the Jobs of team-b gone", lambda: not kube.list("Pod", "team-b"), timeout=90)
    for obj in reversed(jobs.load(jobs.MIG_PROFILE_QUEUE)):
        kube.delete(obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))
    for dc in extra:
        kube.delete("DeviceClass", dc["metadata"]["name"])


def test_a_quota_per_mig_profile(kube: Kube, gpus: NodeGpus, profile_classes: None) -> None:
    """Quota 2 `nvidia.com/mig-1g.10gb` and 1 `nvidia.com/mig-3g.40gb`: three 1g.10gb Jobs
    (two on the profile's own class, one asking `nvidia.com/mig-1g.10gb` the device-plugin
    way) and two on the 3g.40gb class. Kueue admits two and one, keeps two suspended, and
    admits them as others complete; all run on MIG devices of their profile, and per
    profile no more devices than its quota are ever allocated."""
    on_node: dict[str, Any] = {"image": images.TEST_IMAGE, "command": WORK, "node": gpus.node_name}
    small = ["small-0", "small-1"]
    for name in small:
        jobs.submit(kube, jobs.MIG_PROFILE_JOB, name, "team-b", **on_node)
    legacy = jobs.job_from(jobs.LEGACY_JOB, "small-legacy", "team-b", **on_node)
    legacy["metadata"]["labels"][jobs.QUEUE_LABEL] = "mig-profiles"
    legacy["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/mig-1g.10gb": 1
    }
    kube.create(legacy)
    large = ["large-0", "large-1"]
    for name in large:
        job = jobs.job_from(jobs.MIG_PROFILE_JOB, name, "team-b", **on_node)
        job["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = (
            "one-3g40gb"
        )
        kube.create(job)
    names = [*small, "small-legacy", *large]
    watcher = ProfileWatcher(kube)
    with watcher:
        wait_for(
            "two 1g.10gb Jobs and one 3g.40gb Job admitted",
            lambda: sum(jobs.admitted(kube, "team-b", n) for n in names) == 3,
        )
        suspended = [n for n in names if kube.get("Job", n, "team-b")["spec"]["suspend"]]
        assert len(suspended) == 2, suspended
        assert sum(n in suspended for n in large) == 1, suspended
        for name in names:
            wait_for(
                f"Job {name} finished",
                lambda n=name: jobs.job_finished(kube, "team-b", n),
                timeout=240,
            )
    assert not watcher.errors, watcher.errors
    for name in names:
        assert kube.get("Job", name, "team-b")["status"].get("succeeded") == 1, name
    peak = {p: max(c[p] for c in watcher.by_profile) for p in MIG_PROFILES}
    assert peak == {"1g.10gb": 2, "3g.40gb": 1}, peak
    for name, resource in (
        ("small-0", "nvidia.com/mig-1g.10gb"),
        ("small-legacy", "nvidia.com/mig-1g.10gb"),
        ("large-0", "nvidia.com/mig-3g.40gb"),
    ):
        wl = jobs.workload_of(kube, "team-b", name)
        assert wl is not None
        usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
        assert usage == {resource: "1"}, (name, usage)


# --- priorities --------------------------------------------------------------------------

HOLD = ["sh", "-c", "ls /dev | grep -q '^nvidia[0-9]' && sleep 3600"]
"""Runs until deleted, only where the container sees a GPU device node."""
LOW = [
    (jobs.LEGACY_JOB, "team-a", "low-gpu"),  # an exclusive GPU, converted by the webhook
    (jobs.MEMORY_SLICE_JOB, "team-a", "low-slice"),  # a memory slice, its own MPS daemon
    (jobs.MIG_JOB, "team-b", "low-mig"),  # a MIG instance created for it
]
HIGH = [
    (jobs.PRIORITIES, "team-b", "high-gpu"),  # two GPUs, the device-plugin way
    (jobs.MIG_JOB, "team-b", "high-mig"),
]
ROUNDS = 3


@pytest.fixture
def priorities(queues: None, kube: Kube) -> None:
    for obj in jobs.classes():
        kube.apply(obj)


@dataclass(frozen=True)
class Footprint:
    """What gpudra keeps on the node for prepared claims."""

    records: frozenset[str]  # claim UIDs in the checkpoint
    specs: frozenset[str]  # CDI spec files
    mig_instances: int
    mps_daemons: frozenset[str]  # per-claim MPS folders

    def holds(self, uid: str) -> bool:
        return uid in self.records or any(uid in s for s in self.specs)


def footprint(gpus: NodeGpus) -> Footprint:
    return Footprint(
        records=frozenset(gpus.checkpoint()),
        specs=frozenset(gpus.cdi_specs()),
        mig_instances=sum(len(g["gpuInstances"]) for g in gpus.nvml_state().get("gpus", ())),
        mps_daemons=frozenset(gpus.list_names(gpus.state_dir / "mps")),
    )


def claim_uids(kube: Kube, pod: dict[str, Any]) -> set[str]:
    ns = pod["metadata"]["namespace"]
    statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or ()
    return {
        kube.get("ResourceClaim", s["resourceClaimName"], ns)["metadata"]["uid"]
        for s in statuses
        if s.get("resourceClaimName")
    }


def running_pod(kube: Kube, ns: str, job: str) -> dict[str, Any]:
    pods = wait_for(
        f"the pod of Job {ns}/{job} running",
        lambda: jobs.running_pods(kube, ns, job),
        timeout=180,
    )
    pod: dict[str, Any] = pods[0]
    assert len(pods) == 1, pods
    return pod


def preempted(kube: Kube, ns: str, job: str) -> bool:
    """Kueue evicted the Job's Workload for a higher priority and suspended the Job."""
    wl = jobs.workload_of(kube, ns, job)
    evicted = jobs.condition(wl, "Evicted")
    by_priority = jobs.condition(wl, "Preempted")
    suspended = bool(kube.get("Job", job, ns)["spec"].get("suspend"))
    return suspended and bool(
        (by_priority and by_priority["status"] == "True")
        or (evicted and evicted["reason"] == "Preempted")
    )


def test_a_high_priority_job_preempts_low_ones_and_nothing_leaks(
    kube: Kube, gpus: NodeGpus, priorities: None
) -> None:
    """Quota 2 `nvidia.com/gpu` and 1 `mig.nvidia.com`, full with gpu-low Jobs (an
    exclusive GPU, a memory slice, a MIG device); gpu-high Jobs (two GPUs, a MIG device)
    make Kueue evict all three: their pods go, gpudra unprepares their claims on the
    node (checkpoint record, CDI spec, MPS daemon, MIG instance) and the high Jobs run.
    Round after round the node's footprint comes back to where it started."""
    baseline = footprint(gpus)
    on_node = {"image": images.TEST_IMAGE, "command": HOLD, "node": gpus.node_name}
    for r in range(ROUNDS):
        low = [(path, ns, f"{name}-{r}") for path, ns, name in LOW]
        high = [(path, ns, f"{name}-{r}") for path, ns, name in HIGH]
        for path, ns, name in low:
            jobs.submit(kube, path, name, ns, priority="gpu-low", **on_node)
        victims = set().union(*(claim_uids(kube, running_pod(kube, ns, n)) for _p, ns, n in low))
        held = footprint(gpus)
        assert len(victims) == len(low) and all(held.holds(u) for u in victims), held
        assert victims <= held.records, held
        assert held.mig_instances == baseline.mig_instances + 1, held
        assert len(held.mps_daemons) == len(baseline.mps_daemons) + 1, held

        for path, ns, name in high:
            jobs.submit(kube, path, name, ns, priority="gpu-high", **on_node)
        winners = [running_pod(kube, ns, n) for _p, ns, n in high]
        for _path, ns, name in low:
            wait_for(f"{ns}/{name} preempted", lambda ns=ns, n=name: preempted(kube, ns, n))
            wait_for(
                f"the pods of {name} gone", lambda ns=ns, n=name: not jobs.pods_of(kube, ns, n)
            )
        wait_for(
            "the preempted claims unprepared on the node",
            lambda v=victims: not any(footprint(gpus).holds(u) for u in v),
            timeout=90,
        )
        now = footprint(gpus)
        assert now.mig_instances == baseline.mig_instances + 1, now  # the high Job's
        assert now.mps_daemons == baseline.mps_daemons, now
        allocated = [
            result
            for pod in winners
            for uid in claim_uids(kube, pod)
            for claim in kube.list("ResourceClaim", pod["metadata"]["namespace"])
            if claim["metadata"]["uid"] == uid
            for result in claim["status"]["allocation"]["devices"]["results"]
        ]
        assert len(allocated) == 3, allocated  # two GPUs and a MIG device
        assert all(now.holds(uid) for pod in winners for uid in claim_uids(kube, pod)), now

        for _path, ns, name in low + high:
            jobs.delete_job(kube, ns, name)
        wait_for(
            f"round {r}: the node's footprint back to where it started",
            lambda: footprint(gpus) == baseline,
            timeout=120,
        )


UUID_ATTR = f'device.attributes["{DRIVER}"].uuid'


def exclusive_gpu(kube: Kube, node: str) -> tuple[str, str]:
    """The name and UUID of one whole GPU the node publishes for exclusive use."""
    for name, device in sorted(node_devices(kube, node).items()):
        attrs = device.get("attributes", {})
        kind = next(iter(attrs.get("type", {}).values()), "")
        if kind == "gpu" and not device.get("allowMultipleAllocations"):
            return name, str(next(iter(attrs["uuid"].values())))
    raise LookupError(f"no exclusive GPU published for {node}")


def pinned_pod(name: str, ns: str, node: str, uuid: str, priority: str) -> list[dict[str, Any]]:
    """A pod of `priority` whose claim can only get the GPU `uuid`."""
    pod = pod_with_claim(name, ns, node, template=name)
    pod["spec"].update(priorityClassName=priority, terminationGracePeriodSeconds=1)
    pod["spec"]["containers"][0].update(
        image=images.TEST_IMAGE, imagePullPolicy="Never", command=HOLD
    )
    return [claim_template(name, ns, f"{UUID_ATTR} == {uuid!r}"), pod]


def scheduling_failures(kube: Kube, ns: str, pod: str) -> list[str]:
    return [
        e.get("message", "")
        for e in kube.list("Event", ns, fieldSelector=f"involvedObject.name={pod}")
        if e.get("reason") == "FailedScheduling"
    ]


def test_the_scheduler_alone_does_not_preempt_for_a_claim(
    kube: Kube, gpus: NodeGpus, priorities: None
) -> None:
    """Without Kueue: a gpu-high pod whose claim can only get the GPU a gpu-low pod
    holds stays Pending. kube-scheduler's DynamicResources plugin fails the node with
    "cannot allocate all claims" (UnschedulableAndUnresolvable) and has no
    PreFilterExtensions to free a victim's devices, so DefaultPreemption finds no
    candidate: an upstream limitation (docs/kueue.md). When the low pod goes, its claim
    is unprepared and the GPU goes to the high pod."""
    ns = "team-a"
    device, uuid = exclusive_gpu(kube, gpus.node_name)
    for obj in pinned_pod("holder", ns, gpus.node_name, uuid, "gpu-low"):
        kube.create(obj)
    wait_running(kube, ns, "holder", timeout=120)
    (victim,) = claim_uids(kube, kube.get("Pod", "holder", ns))
    try:
        for obj in pinned_pod("urgent", ns, gpus.node_name, uuid, "gpu-high"):
            kube.create(obj)
        (message, *_) = wait_for(
            "the scheduler's verdict on the high-priority pod",
            lambda: scheduling_failures(kube, ns, "urgent"),
        )
        assert "cannot allocate all claims" in message, message
        assert "Preemption is not helpful for scheduling" in message, message
        assert running(kube, ns, "holder"), "the low-priority pod was preempted"
        assert kube.get("Pod", "urgent", ns)["status"].get("phase") == "Pending"

        kube.delete("Pod", "holder", ns, grace=0)
        wait_running(kube, ns, "urgent", timeout=120)
        assert not footprint(gpus).holds(victim)
        (claim,) = [
            kube.get("ResourceClaim", s["resourceClaimName"], ns)
            for s in kube.get("Pod", "urgent", ns)["status"]["resourceClaimStatuses"]
        ]
        assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == device
    finally:
        for name in ("holder", "urgent"):
            kube.delete("Pod", name, ns, grace=0)
            kube.delete("ResourceClaimTemplate", name, ns)


def test_bench_writes_admission_to_running_per_job(
    kube: Kube, gpus: NodeGpus, queues: None, tmp_path: Path
) -> None:
    """`make bench-kueue` with one Job of each kind: every Job ran and has its time."""
    out = tmp_path / "kueue.json"
    bench_kueue.measure(kube, gpus, 1, out)
    result = json.loads(out.read_text())
    assert set(result) >= {"kueue", "quota_gpus", "resolution_s", "summary", "jobs"}
    assert result["kueue"] == "v0.19.2"
    assert {j["kind"] for j in result["jobs"]} == {"legacy", "native"}
    for job in result["jobs"]:
        assert job["state"] == "Succeeded", job
        assert isinstance(job["admitted_to_running_s"], float), job
    assert {k: v["jobs"] for k, v in result["summary"].items()} == {"legacy": 1, "native": 1}
