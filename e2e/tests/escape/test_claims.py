"""Escape attempts with hand-written claims: a tenant user (a ServiceAccount with `edit`
in its own namespace only, its requests made with its own token) writes the claims
that used to slip past its GpuTenant's `allowedSharing` or past validation into a
prepare that fails. The real API server calls the webhook, which resolves each claim's
sharing from the real DeviceClasses as the kubelet plugin will."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.to_thread import run_sync
from gpudra.api import jsonbytes
from gpudra.api.deviceclasses import device_classes, mig_profile_class
from gpudra.api.tenants import API_VERSION, crd_manifest, quota_key
from gpudra.cli import devices as cli_devices
from gpudra.common.kube import ApiError as KubeApiError
from gpudra.common.kube import Kube
from gpudra.webhook import registration
from gpudra.webhook.device_classes import DeviceClassCache
from gpudra.webhook.server import WebhookServer
from gpudra.webhook.templates import ApiTemplateEnsurer
from gpudra.webhook.tenant_state import QUOTA_NAME
from gpudra.webhook.tenants import TenantController
from gpudra.webhook.validate import driver_classes

from e2e import smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError, apply_crd, wait_for
from e2e.cluster.kube import Kube as SyncKube
from e2e.provider import local_only
from e2e.tenant_user import TenantUser, tenant_user
from e2e.webhook_env import serving_config

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"
SHARED = "gpu-shared.nvidia.com"
TENANTS = f"/apis/{API_VERSION}/gputenants"
MERGE_PATCH = "application/merge-patch+json"
EXTRA = "a100-80gb.example.com"
"""A DeviceClass an admin made that selects the driver's devices (the chart's
webhook.extraDeviceClasses, the webhook's --device-class)."""
EXTRA_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": EXTRA},
    "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
}
CONFIG_API = "resource.nvidia.com/v1beta1"
MIG_PROFILES = ("1g.10gb", "3g.40gb")
"""Served with classes of their own too (the chart's deviceClasses.mig.profiles)."""


def shared_class_as_the_chart_renders_it() -> dict[str, Any]:
    """gpu-shared.nvidia.com with the chart's default sharing config (TimeSlicing)."""
    (dc,) = (c for c in device_classes(DRIVER) if c["metadata"]["name"] == SHARED)
    return dc


@dataclass
class Env:
    controller: TenantController
    classes: DeviceClassCache


@pytest.fixture
async def env(cluster: Cluster, kube: SyncKube, tmp_path: Path) -> AsyncIterator[Env]:
    for dc in device_classes(DRIVER, mig_profiles=MIG_PROFILES):
        kube.apply(dc)
    kube.apply(shared_class_as_the_chart_renders_it())
    kube.apply(EXTRA_CLASS)
    apply_crd(kube, crd_manifest())
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    pki, served = serving_config(cluster, tmp_path / "pki")
    policy = dataclasses.replace(served.policy, mig_profile_classes=MIG_PROFILES)
    config = dataclasses.replace(served, policy=policy, extra_device_classes=(EXTRA,))
    controller = TenantController(akube, config.policy, extra_classes=[EXTRA])
    classes = DeviceClassCache(DRIVER)
    server = WebhookServer(
        config,
        ApiTemplateEnsurer(akube),
        tenants=controller.state,
        device_classes=classes.configs,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        await tg.start(controller.run)
        await tg.start(classes.run, akube)
        await registration.apply(
            akube,
            registration.validating_configuration(
                ca_bundle_b64=pki.ca_bundle_base64(),
                own_namespace="gpudra",
                device_classes=sorted(driver_classes(config.policy, [EXTRA])),
                driver=DRIVER,
                url=f"https://{cluster.webhook_host()}:{port}",
            ),
        )
        yield Env(controller, classes)
        await registration.delete(akube, registration.VALIDATING_NAME, validating=True)
        tg.cancel_scope.cancel()
    for dc in device_classes(DRIVER):
        kube.apply(dc)  # the shared class without the config again, as other tests expect
    for name in (*(mig_profile_class(p) for p in MIG_PROFILES), EXTRA):
        kube.delete("DeviceClass", name)
    await akube.close()


@pytest.fixture
def namespace(kube: SyncKube) -> Iterator[str]:
    ns = smoke.make_namespace(kube, "escape-claims")
    yield ns
    kube.delete("Namespace", ns)


def with_tenant(kube: SyncKube, ns: str, **spec: Any) -> str:
    name = f"t-{ns}"
    body = {"apiVersion": API_VERSION, "kind": "GpuTenant", "metadata": {"name": name}}
    kube.request("POST", TENANTS, {**body, "spec": {"namespaces": [ns], **spec}})
    return name


def drop_tenant(kube: SyncKube, name: str) -> None:
    try:
        kube.request("DELETE", f"{TENANTS}/{name}")
    except ApiError as e:
        if e.status != 404:
            raise


def claim(ns: str, name: str, request: dict[str, Any], *config: dict[str, Any]) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": request}]}
    if config:
        devices["config"] = list(config)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"devices": devices},
    }


def gpu_config(strategy: str) -> dict[str, Any]:
    params = {"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharing": {"strategy": strategy}}
    return {"opaque": {"driver": DRIVER, "parameters": params}}


SHARED_GPU = {"deviceClassName": SHARED}
WHOLE_GPU = {"deviceClassName": DRIVER}
MEMORY_SLICE = {
    "deviceClassName": SHARED,
    "capacity": {"requests": {f"{DRIVER}/memory": "10Gi"}},
}


async def denied(user: TenantUser, obj: dict[str, Any]) -> str:
    with pytest.raises(ApiError) as err:
        await run_sync(user.create, obj)
    return str(err.value)


async def tenant_rules_loaded(env: Env, ns: str) -> None:
    await run_sync(
        wait_for,
        "the webhook to see the tenant",
        lambda: env.controller.state.lookup(ns).rules is not None,
    )


async def skip_without_capacity_requests(user: TenantUser, ns: str) -> None:
    """The API server drops `capacity` without DRAConsumableCapacity: no slices to test."""
    stored = await run_sync(user.create, claim(ns, "probe", MEMORY_SLICE, gpu_config("MPS")))
    if "capacity" not in stored["spec"]["devices"]["requests"][0]["exactly"]:
        pytest.skip("the API server drops capacity requests: DRAConsumableCapacity is off")


async def test_shared_class_sharing_counts_against_allowed_sharing(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    user = await run_sync(tenant_user, kube, namespace)
    await run_sync(wait_for, "the DeviceClasses' configs", lambda: SHARED in env.classes.configs)
    tenant = await run_sync(lambda: with_tenant(kube, namespace, allowedSharing=["Exclusive"]))
    try:
        await tenant_rules_loaded(env, namespace)
        message = await denied(user, claim(namespace, "shared", SHARED_GPU))
        assert "HTTP 403" in message
        assert f"DeviceClass {SHARED} spec.config[0].opaque.parameters.sharing.strategy" in message
        assert "does not allow sharing mode TimeSlicing; accepted values: Exclusive" in message
    finally:
        await run_sync(drop_tenant, kube, tenant)
    await run_sync(
        wait_for, "the tenant to go", lambda: env.controller.state.lookup(namespace).rules is None
    )
    tenant = await run_sync(
        lambda: with_tenant(
            kube, namespace, allowedSharing=["TimeSlicing"], gpuResource={"sharing": "TimeSlicing"}
        )
    )
    try:
        await tenant_rules_loaded(env, namespace)
        created = await run_sync(user.create, claim(namespace, "shared", SHARED_GPU))
        assert created["metadata"]["name"] == "shared"
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_memory_slices_count_as_mps(env: Env, kube: SyncKube, namespace: str) -> None:
    user = await run_sync(tenant_user, kube, namespace)
    await skip_without_capacity_requests(user, namespace)
    tenant = await run_sync(
        lambda: with_tenant(
            kube, namespace, allowedSharing=["TimeSlicing"], gpuResource={"sharing": "TimeSlicing"}
        )
    )
    try:
        await tenant_rules_loaded(env, namespace)
        message = await denied(user, claim(namespace, "slice", MEMORY_SLICE, gpu_config("MPS")))
        assert "does not allow sharing mode MPS; accepted values: TimeSlicing" in message
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_a_memory_request_counts_as_what_a_whole_device_runs_too(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A capacity request only filters a device that is not shared, so the scheduler may
    give the request a whole GPU, which prepare runs as the config says: under a tenant
    that allows MPS only, the request needs an MPS config, not the slice's MPS alone."""
    user = await run_sync(tenant_user, kube, namespace)
    await skip_without_capacity_requests(user, namespace)
    tenant = await run_sync(
        lambda: with_tenant(kube, namespace, allowedSharing=["MPS"], gpuResource={"sharing": "MPS"})
    )
    try:
        await tenant_rules_loaded(env, namespace)
        asks_memory = {**WHOLE_GPU, "capacity": {"requests": {"memory": "10Gi"}}}
        message = await denied(user, claim(namespace, "memory", asks_memory))
        assert "the scheduler may give this request a whole device" in message
        assert "does not allow sharing mode Exclusive; accepted values: MPS" in message
        mps = claim(namespace, "memory-mps", asks_memory, gpu_config("MPS"))
        assert (await run_sync(user.create, mps))["metadata"]["name"] == "memory-mps"
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_a_share_asked_for_under_the_drivers_domain_counts_as_time_slicing(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A capacity may be named with its driver's domain, and from Kubernetes 1.38 the
    scheduler gives a request for `gpu.nvidia.com/shares` one of the integer shares a GPU
    publishes as `shares` (kubernetes#142202), which the node time-slices. Under a tenant
    allowed Exclusive and MPS, but not TimeSlicing, the qualified spelling is refused as
    the short one is, not judged a memory slice run under MPS."""
    user = await run_sync(tenant_user, kube, namespace)
    await skip_without_capacity_requests(user, namespace)
    tenant = await run_sync(
        lambda: with_tenant(
            kube, namespace, allowedSharing=["Exclusive", "MPS"], gpuResource={"sharing": "MPS"}
        )
    )
    try:
        await tenant_rules_loaded(env, namespace)
        for index, name in enumerate(("shares", f"{DRIVER}/shares")):
            asks_a_share = {**WHOLE_GPU, "capacity": {"requests": {name: "1"}}}
            message = await denied(user, claim(namespace, f"share-{index}", asks_a_share))
            assert "capacity.requests.shares (some of a GPU's integer shares" in message, name
            assert "does not allow sharing mode TimeSlicing" in message
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_an_invalid_tenant_without_a_quota_fails_closed(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A GpuTenant the CRD stores but the webhook refuses (gpuResource defaults to
    Exclusive, which allowedSharing leaves out) and that sets no deviceQuota: its rules
    are unknown, so its namespace's claims are refused, not admitted under no rules."""
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(
        lambda: with_tenant(kube, namespace, maxDevicesPerPod=1, allowedSharing=["MPS"])
    )
    try:
        await run_sync(
            wait_for,
            "the webhook to see the invalid tenant",
            lambda: "invalid" in env.controller.state.lookup(namespace).denial,
        )
        message = await denied(user, claim(namespace, "two", {**WHOLE_GPU, "count": 2}))
        assert f"belongs to GpuTenant {tenant}, which is invalid" in message
        assert "allowedSharing" in message
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_time_slicing_on_a_memory_slice_is_refused_at_admission(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    user = await run_sync(tenant_user, kube, namespace)
    await skip_without_capacity_requests(user, namespace)
    # The claim's own TimeSlicing config, and the class's one it would inherit.
    own = await denied(user, claim(namespace, "own", MEMORY_SLICE, gpu_config("TimeSlicing")))
    assert "HTTP 400" in own
    assert (
        "spec.devices.config[0].opaque.parameters.sharing.strategy: TimeSlicing cannot apply" in own
    )
    inherited = await denied(user, claim(namespace, "inherited", MEMORY_SLICE))
    assert f"DeviceClass {SHARED} spec.config[0].opaque.parameters.sharing.strategy" in inherited
    assert "TimeSlicing cannot apply" in inherited


async def test_a_per_profile_class_does_not_get_around_allowed_mig_profiles(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A tenant allowed MIG profile 1g.10gb asks for the 3g.40gb class, bare and with a
    selector naming the allowed profile: the class pins its profile, so both are denied;
    the allowed profile's class is accepted."""
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(lambda: with_tenant(kube, namespace, allowedMigProfiles=["1g.10gb"]))
    allowed = f'device.attributes["{DRIVER}"].profile == "1g.10gb"'
    try:
        await tenant_rules_loaded(env, namespace)
        for name, request in (
            ("bare", {"deviceClassName": "mig-3g.40gb.nvidia.com"}),
            (
                "disguised",
                {
                    "deviceClassName": "mig-3g.40gb.nvidia.com",
                    "selectors": [{"cel": {"expression": allowed}}],
                },
            ),
        ):
            message = await denied(user, claim(namespace, name, request))
            assert "HTTP 403" in message, message
            assert "does not allow MIG profile 3g.40gb (device class mig-3g.40gb.nvidia.com)" in (
                message
            )
        ok = {"deviceClassName": "mig-1g.10gb.nvidia.com"}
        created = await run_sync(user.create, claim(namespace, "ok", ok))
        assert created["metadata"]["name"] == "ok"
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_a_config_admitted_in_another_namespace_is_judged_by_this_ones_rules(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """The webhook keeps the parses of configs it has seen (`ConfigCache`) and the specs
    it allowed (`ClaimJudge`). A tenant without rules has a claim with an MPS config
    admitted first, so that both are kept; the same spec from a tenant whose rules forbid
    MPS is refused all the same: an allowed spec is kept with the rules it was allowed
    under, and judged again under any others."""
    free = await run_sync(smoke.make_namespace, kube, "escape-free")
    try:
        first = await run_sync(tenant_user, kube, free)
        created = await run_sync(first.create, claim(free, "mps", WHOLE_GPU, gpu_config("MPS")))
        assert created["metadata"]["name"] == "mps"
        user = await run_sync(tenant_user, kube, namespace)
        tenant = await run_sync(
            lambda: with_tenant(kube, namespace, allowedSharing=["Exclusive", "TimeSlicing"])
        )
        try:
            await tenant_rules_loaded(env, namespace)
            message = await denied(user, claim(namespace, "mps", WHOLE_GPU, gpu_config("MPS")))
            assert "HTTP 403" in message
            assert "does not allow sharing mode MPS; accepted values: Exclusive, TimeSlicing" in (
                message
            )
        finally:
            await run_sync(drop_tenant, kube, tenant)
    finally:
        await run_sync(kube.delete, "Namespace", free)


async def test_a_spec_allowed_before_the_rules_were_tightened_is_refused_after(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A tenant's claim with MPS is allowed (its spec is kept, `ClaimJudge`); the tenant's
    rules then stop allowing MPS, and the same spec, in the same namespace, is refused."""
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(lambda: with_tenant(kube, namespace))
    try:
        await tenant_rules_loaded(env, namespace)
        created = await run_sync(user.create, claim(namespace, "a", WHOLE_GPU, gpu_config("MPS")))
        assert created["metadata"]["name"] == "a"
        body = {"spec": {"allowedSharing": ["Exclusive", "TimeSlicing"]}}
        await run_sync(
            lambda: kube.request(
                "PATCH", f"{TENANTS}/{tenant}", body, content_type="application/merge-patch+json"
            )
        )

        def tightened() -> bool:
            rules = env.controller.state.lookup(namespace).rules
            return rules is not None and not rules.tenant.spec.allows_sharing("MPS")

        await run_sync(wait_for, "the webhook to see the new rules", tightened)
        message = await denied(user, claim(namespace, "b", WHOLE_GPU, gpu_config("MPS")))
        assert "HTTP 403" in message
        assert "does not allow sharing mode MPS" in message
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_a_pod_groups_claim_is_refused_where_a_tenant_governs(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """Kubernetes 1.36 (DRAWorkloadResourceClaims) makes a PodGroup's claim from a
    template, controlled by the PodGroup and handed to the group's pods without being
    tied to any of them, so no per-pod rule could hold for it. The cluster admin, as the
    resourceclaim controller would, creates such a claim in a tenant's namespace (the
    PodGroup itself need not exist): it is refused, naming the owner and the fix, and
    the same claim without that owner is admitted. The rule holds wherever a GpuTenant
    governs, whatever its limits (with a per-pod limit this webhook, which reads no
    pods, would refuse the second claim too)."""
    tenant = await run_sync(lambda: with_tenant(kube, namespace, allowedSharing=["Exclusive"]))
    try:
        await tenant_rules_loaded(env, namespace)
        grouped = claim(namespace, "group-b", {**WHOLE_GPU, "count": 2})
        grouped["metadata"]["annotations"] = {"resource.kubernetes.io/podgroup-claim-name": "b"}
        grouped["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "scheduling.k8s.io/v1alpha2",
                "kind": "PodGroup",
                "name": "group",
                "uid": "5a1b7c3e-0000-4000-8000-000000000001",
                "controller": True,
            }
        ]
        with pytest.raises(ApiError) as err:
            await run_sync(kube.create, grouped)
        message = str(err.value)
        assert "HTTP 403" in message
        assert (
            "ResourceClaim group-b: tenant " in message
            and "its controlling owner is PodGroup group (scheduling.k8s.io/v1alpha2)" in message
        )
        assert "leave the entry out of the PodGroup's spec.resourceClaims" in message
        assert "or run the workload in a namespace no GpuTenant governs" in message
        own = claim(namespace, "own-b", {**WHOLE_GPU, "count": 2})
        assert (await run_sync(kube.create, own))["metadata"]["name"] == "own-b"
    finally:
        await run_sync(drop_tenant, kube, tenant)


@contextlib.contextmanager
def controller_manager_paused(cluster: Cluster) -> Iterator[None]:
    """kube-controller-manager stopped for a moment, as one behind or restarting is
    (it runs without leader election here, so it loses nothing by the pause)."""
    state = cluster.require_state()
    pid = state.pids["kube-controller-manager"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@local_only("pauses kube-controller-manager by its process, which kind runs in a container")
async def test_claims_over_a_quota_the_api_server_has_not_counted_are_refused(
    env: Env, kube: SyncKube, cluster: Cluster, namespace: str
) -> None:
    """The API server's quota admission limits by the quota's status, which
    kube-controller-manager writes after the quota is made or changed: until then a new
    quota limits nothing and a lowered one keeps its old limit. A tenant sends claims
    over its deviceQuota while that status lags (kube-controller-manager held), from the
    moment its quota exists and from the moment it is lowered: none is stored."""
    user = await run_sync(tenant_user, kube, namespace)
    over = {**WHOLE_GPU, "count": 2}

    def quota_says(where: str, limit: int) -> bool:
        quota = kube.get_or_none("ResourceQuota", QUOTA_NAME, namespace) or {}
        return (quota.get(where) or {}).get("hard", {}).get(quota_key(DRIVER)) == str(limit)

    def send_over(label: str) -> list[str]:
        """Claims over the quota, while its status lags: the denials."""
        denials = []
        for i in range(10):
            with pytest.raises(ApiError) as err:
                user.create(claim(namespace, f"{label}-{i}", over))
            denials.append(str(err.value))
        return denials

    patch = functools.partial(kube.request, "PATCH", content_type=MERGE_PATCH)
    with controller_manager_paused(cluster):
        tenant = await run_sync(lambda: with_tenant(kube, namespace, deviceQuota={DRIVER: 1}))
        try:
            await run_sync(wait_for, "the quota's spec", lambda: quota_says("spec", 1))
            denials = await run_sync(send_over, "new")
        except BaseException:
            await run_sync(drop_tenant, kube, tenant)
            raise
    try:
        assert all("is not in place yet" in d for d in denials)
        await run_sync(lambda: patch(f"{TENANTS}/{tenant}", {"spec": {"deviceQuota": {DRIVER: 4}}}))
        await run_sync(wait_for, "the quota counted at 4", lambda: quota_says("status", 4))
        await tenant_rules_loaded(env, namespace)
        with controller_manager_paused(cluster):
            lowered = {"spec": {"deviceQuota": {DRIVER: 1}}}
            await run_sync(lambda: patch(f"{TENANTS}/{tenant}", lowered))
            await run_sync(wait_for, "the lowered quota's spec", lambda: quota_says("spec", 1))
            assert quota_says("status", 4)
            denials = await run_sync(send_over, "lowered")
        assert all("is not in place yet" in d for d in denials)
        await run_sync(wait_for, "the quota counted at 1", lambda: quota_says("status", 1))
        message = await denied(user, claim(namespace, "after", over))
        assert "HTTP 403" in message
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_device_quota_on_one_class_holds_for_the_classes_that_give_the_same_gpus(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """Kubernetes counts a claim's devices against its own DeviceClass only, and the
    shared class (and the per-profile MIG classes) give the same GPUs: with
    `deviceQuota` naming only gpu.nvidia.com, a tenant allowed the shared class asked
    for GPUs through it uncounted. The quota limits every driver class it does not
    name to 0, so the API server itself refuses the claim."""
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(
        lambda: with_tenant(
            kube,
            namespace,
            allowedSharing=["Exclusive", "TimeSlicing"],
            deviceQuota={DRIVER: 1},
        )
    )
    try:
        await tenant_rules_loaded(env, namespace)
        quota = await run_sync(
            wait_for,
            "the tenant's quota",
            lambda: kube.get_or_none("ResourceQuota", QUOTA_NAME, namespace),
        )
        hard = quota["spec"]["hard"]
        assert hard[quota_key(DRIVER)] == "1"
        assert hard[quota_key(SHARED)] == "0"
        assert hard[quota_key(mig_profile_class(MIG_PROFILES[0]))] == "0"
        message = await denied(user, claim(namespace, "shared", SHARED_GPU))
        assert "exceeded quota" in message and SHARED in message
        assert (await run_sync(user.create, claim(namespace, "whole", WHOLE_GPU)))["metadata"]
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_an_admins_own_device_class_gets_no_way_around_the_rules(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A DeviceClass an admin made that selects the driver's devices is sent to the
    webhook and judged like the driver's own (its claims once reached the webhook only
    where the registration was left to the webhook, not the chart), and counts in the
    tenant's quota."""
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(
        lambda: with_tenant(kube, namespace, allowedDeviceClasses=[DRIVER], deviceQuota={})
    )
    try:
        await tenant_rules_loaded(env, namespace)
        message = await denied(user, claim(namespace, "extra", {"deviceClassName": EXTRA}))
        assert "HTTP 403" in message and f"does not allow device class {EXTRA}" in message
        quota = await run_sync(
            wait_for,
            "the tenant's quota",
            lambda: kube.get_or_none("ResourceQuota", QUOTA_NAME, namespace),
        )
        assert quota["spec"]["hard"][quota_key(EXTRA)] == "0"
        assert quota["spec"]["hard"][quota_key(DRIVER)] == "0"  # an empty quota: no GPUs
    finally:
        await run_sync(drop_tenant, kube, tenant)


async def test_an_admins_class_that_only_seems_to_pin_whole_gpus_is_judged_as_both(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """A class whose selector names the whole-GPU type under another operator
    (`false == (false && type == "gpu")`) selects MIG devices too. Read as pinning whole
    GPUs, its requests skipped the MIG profile rule, and a tenant given the class got any
    profile by selecting it; read as it is, the request is judged as both kinds and
    refused. The same request of a class that does pin whole GPUs is admitted: such a
    class gives no MIG device."""
    pinned = f'device.attributes["{DRIVER}"].type == "gpu"'

    def extra_class(expression: str) -> dict[str, Any]:
        return {**EXTRA_CLASS, "spec": {"selectors": [{"cel": {"expression": expression}}]}}

    def read_as(kinds: tuple[str, ...] | None) -> None:
        # Each step reads the class differently from the step before it.
        wait_for(
            f"the webhook to read {EXTRA} as pinning {kinds}",
            lambda: (found := env.classes.configs.get(EXTRA)) is not None and found.kinds == kinds,
        )

    big = f'device.attributes["{DRIVER}"].profile == "3g.40gb"'
    request = {"deviceClassName": EXTRA, "selectors": [{"cel": {"expression": big}}]}
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(
        lambda: with_tenant(
            kube, namespace, allowedDeviceClasses=[EXTRA], allowedMigProfiles=["1g.10gb"]
        )
    )
    try:
        await tenant_rules_loaded(env, namespace)
        await run_sync(kube.apply, extra_class(pinned))
        await run_sync(read_as, ("gpu",))
        admitted = await run_sync(user.create, claim(namespace, "whole", request))
        assert admitted["metadata"]["name"] == "whole"
        await run_sync(kube.apply, extra_class(f"false == (false && {pinned})"))
        await run_sync(read_as, None)
        message = await denied(user, claim(namespace, "hidden", request))
        assert "HTTP 403" in message
        assert "spec.devices.requests[0].exactly.selectors: " in message, message
        assert "does not allow MIG profile 3g.40gb; accepted values: 1g.10gb" in message
    finally:
        await run_sync(kube.apply, EXTRA_CLASS)
        await run_sync(drop_tenant, kube, tenant)


XID_TAINT = "gpu.nvidia.com/xid"
LOST_TAINT = "gpu.nvidia.com/gpu-lost"


def tolerating(key: str | None) -> dict[str, Any]:
    """A whole GPU that tolerates the taint `key` (None: every taint), whatever its effect."""
    toleration = {"operator": "Exists"} if key is None else {"key": key, "operator": "Exists"}
    return {**WHOLE_GPU, "tolerations": [toleration]}


async def test_a_tenant_cannot_tolerate_the_taints_that_take_devices_out_of_service(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """Health taints (an XID, a lost GPU) and an admin's DeviceTaintRules keep devices from
    new claims and, with NoExecute, drain the pods on them. A tenant's claim that
    tolerates them would be handed a broken or reserved device and sit out a drain: its
    rules allow only the taint keys they name, in claims, in templates and in any
    alternative of a request."""
    user = await run_sync(tenant_user, kube, namespace)
    stored = await run_sync(user.create, claim(namespace, "probe", tolerating(XID_TAINT)))
    if "tolerations" not in stored["spec"]["devices"]["requests"][0]["exactly"]:
        pytest.skip("the API server drops device tolerations: DRADeviceTaints is off")
    tenant = await run_sync(
        lambda: with_tenant(kube, namespace, allowedTaintTolerations=[XID_TAINT])
    )
    try:
        await tenant_rules_loaded(env, namespace)
        allowed = await run_sync(user.create, claim(namespace, "xid", tolerating(XID_TAINT)))
        assert allowed["metadata"]["name"] == "xid"
        message = await denied(user, claim(namespace, "lost", tolerating(LOST_TAINT)))
        assert "HTTP 403" in message
        assert (
            "spec.devices.requests[0].exactly.tolerations[0]: " in message
            and f"does not allow tolerating device taint {LOST_TAINT}; accepted keys: "
            f"{XID_TAINT} (allowedTaintTolerations)"
            in message
        )
        message = await denied(user, claim(namespace, "every", tolerating(None)))
        assert "does not allow tolerating every device taint (no key)" in message
        template = claim(namespace, "tpl", tolerating(LOST_TAINT))
        template = {
            **template,
            "kind": "ResourceClaimTemplate",
            "spec": {"spec": template["spec"]},
        }
        message = await denied(user, template)
        assert "spec.spec.devices.requests[0].exactly.tolerations[0]: " in message
        alternatives = claim(namespace, "alt", WHOLE_GPU)
        alternatives["spec"]["devices"]["requests"] = [
            {
                "name": "gpu",
                "firstAvailable": [
                    {"name": "whole", **WHOLE_GPU},
                    {"name": "any", **tolerating(LOST_TAINT)},
                ],
            }
        ]
        message = await denied(user, alternatives)
        assert "spec.devices.requests[0].firstAvailable[1].tolerations[0]: " in message
    finally:
        await run_sync(drop_tenant, kube, tenant)


def mps_multi_user(kind: str = "GpuConfig", **binding: Any) -> dict[str, Any]:
    sharing = {"strategy": "MPS", "mpsConfig": {"multiUser": True}}
    params = {"apiVersion": CONFIG_API, "kind": kind, "sharing": sharing}
    return {"opaque": {"driver": DRIVER, "parameters": params}, **binding}


async def test_multi_user_mps_needs_the_tenants_leave_however_it_is_asked_for(
    env: Env, kube: SyncKube, namespace: str
) -> None:
    """`mpsConfig.multiUser` runs the claim's MPS server as root for the clients of every
    user (NVIDIA's MPS guide), where it otherwise runs as its client's user. A tenant
    that allows MPS, but not `allowMpsMultiUser`, gets it by no way of asking: a claim,
    a template (what a pod's resourceClaims and a converted pod use), a config bound to
    one alternative of firstAvailable, an admin's class config its request picks up.
    `allowMpsMultiUser: true` admits them, and tightening it again refuses them."""
    user = await run_sync(tenant_user, kube, namespace)
    tenant = await run_sync(
        lambda: with_tenant(kube, namespace, allowedSharing=["Exclusive", "MPS"])
    )
    shared = shared_class_as_the_chart_renders_it()
    shared["spec"]["config"] = [mps_multi_user()]
    try:
        await tenant_rules_loaded(env, namespace)
        await run_sync(kube.apply, shared)

        def class_config_seen() -> bool:
            seen = env.classes.configs.get(SHARED)
            return seen is not None and any(
                b.config.sharing is not None
                and b.config.sharing.mps_config is not None
                and b.config.sharing.mps_config.multi_user
                for b in seen.configs
            )

        await run_sync(wait_for, "the shared class's multi-user config", class_config_seen)
        one = claim(namespace, "claim", WHOLE_GPU, mps_multi_user())
        tpl = claim(namespace, "tpl", WHOLE_GPU, mps_multi_user())
        tpl = {**tpl, "kind": "ResourceClaimTemplate", "spec": {"spec": tpl["spec"]}}
        alternatives = claim(namespace, "alt", WHOLE_GPU, mps_multi_user(requests=["gpu/any"]))
        alternatives["spec"]["devices"]["requests"] = [
            {
                "name": "gpu",
                "firstAvailable": [
                    {"name": "first", **WHOLE_GPU},
                    {"name": "any", **WHOLE_GPU, "count": 2},
                ],
            }
        ]
        by_class = claim(namespace, "by-class", SHARED_GPU)
        ways = {
            "spec.devices.config[0].opaque.parameters.sharing.mpsConfig.multiUser": one,
            "spec.spec.devices.config[0].opaque.parameters.sharing.mpsConfig.multiUser": tpl,
            "spec.devices.config[0].opaque.parameters.sharing.mpsConfig.multiUser:": alternatives,
            f"DeviceClass {SHARED} spec.config[0].opaque.parameters.sharing.mpsConfig.multiUser": (
                by_class
            ),
        }
        for field, obj in ways.items():
            message = await denied(user, obj)
            assert "HTTP 403" in message, field
            assert field in message, message
            assert "does not allow multi-user MPS (allowMpsMultiUser is false)" in message

        async def set_leave(allowed: bool) -> None:
            body = {"spec": {"allowMpsMultiUser": allowed}}
            await run_sync(
                lambda: kube.request("PATCH", f"{TENANTS}/{tenant}", body, content_type=MERGE_PATCH)
            )

            def seen() -> bool:
                rules = env.controller.state.lookup(namespace).rules
                return rules is not None and rules.tenant.spec.allow_mps_multi_user is allowed

            await run_sync(wait_for, "the webhook to see the new rules", seen)

        await set_leave(True)
        for obj in ways.values():
            created = await run_sync(user.create, obj)
            assert created["metadata"]["name"] == obj["metadata"]["name"]
        await set_leave(False)
        again = claim(namespace, "again", WHOLE_GPU, mps_multi_user())
        assert "does not allow multi-user MPS" in await denied(user, again)
    finally:
        await run_sync(drop_tenant, kube, tenant)
        await run_sync(kube.apply, shared_class_as_the_chart_renders_it())


OTHER_DRIVER = "other.example.com"


def raw_claim(ns: str, name: str, driver: str, parameters: bytes) -> bytes:
    """A claim for `driver`'s class whose opaque parameters are `parameters` as
    written, which the API server keeps as raw JSON; for text a tenant's own client
    may send and the standard encoder never writes."""
    config = {"opaque": {"driver": driver, "parameters": {"raw": 0}}}
    body = jsonbytes.dumps(claim(ns, name, {"deviceClassName": driver}, config))
    return body.replace(b'{"raw":0}', parameters)


async def test_another_drivers_claim_the_api_server_keeps_raw_breaks_no_listing(
    env: Env, cluster: Cluster, kube: SyncKube, namespace: str
) -> None:
    """A tenant writes a claim for another driver's class whose opaque parameters hold
    what Go's decoder takes and orjson refuses: an unpaired surrogate escape, invalid
    UTF-8, nesting past 1024 levels. The API server keeps them as written and serves
    them back in every listing of claims (the tenant writes the surrogate; the raw
    bytes go out through the admin's client, as any client could send them). `gpudra
    devices` (which lists the whole cluster's claims) still lists the cluster's
    devices, reading each such string as Go does (U+FFFD); and a claim of gpudra's
    with such a string or nesting is judged by its content, as the API server read
    it, not refused as unreadable."""
    user = await run_sync(tenant_user, kube, namespace)
    params = {"apiVersion": "other.example.com/v1", "note": "\ud800"}
    config = {"opaque": {"driver": OTHER_DRIVER, "parameters": params}}
    other = claim(namespace, "other-surrogate", {"deviceClassName": OTHER_DRIVER}, config)
    await run_sync(user.create, other)  # the tenant's own request writes "\ud800"
    depth = 5000  # about as deep as 10 KiB of parameters nest
    nested = b"[" * depth + b"]" * depth
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    slice_name = f"{namespace}-probe"
    try:
        path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
        for name, parameters in [
            ("other-utf8", b'{"x":"a\xffb"}'),
            ("other-deep", b'{"x":%s}' % nested),
        ]:
            await akube.request("POST", path, raw_claim(namespace, name, OTHER_DRIVER, parameters))
        got = await akube.request("GET", f"{path}/other-surrogate")
        assert got["spec"]["devices"]["config"][0]["opaque"]["parameters"]["note"] == "\ufffd"
        await akube.request(
            "POST",
            "/apis/resource.k8s.io/v1/resourceslices",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": slice_name},
                "spec": {
                    "driver": DRIVER,
                    "allNodes": True,
                    "pool": {"name": slice_name, "generation": 1, "resourceSliceCount": 1},
                    "devices": [{"name": "probe-gpu"}],
                },
            },
        )
        listed = await cli_devices.read(akube, DRIVER)
        assert [(d.pool, d.name, d.use()) for d in listed if d.pool == slice_name] == [
            (slice_name, "probe-gpu", "free")
        ]
        gpudras = claim(namespace, "gpudra-surrogate", WHOLE_GPU, gpu_config("\ud800"))
        message = await denied(user, gpudras)
        assert (
            "ResourceClaim gpudra-surrogate: spec.devices.config[0].opaque.parameters.sharing"
            ".strategy: unknown value '\ufffd'; accepted values: TimeSlicing, MPS" in message
        )
        deep = b'{"apiVersion":"%s","kind":"GpuConfig","x":%s}' % (CONFIG_API.encode(), nested)
        with pytest.raises(KubeApiError) as err:
            await akube.request("POST", path, raw_claim(namespace, "gpudra-deep", DRIVER, deep))
        # Judged by the webhook (a config nested that deep is no GpuConfig), not unread.
        assert (
            'admission webhook "resourceclaims.gpudra.nvidia.com" denied the request: '
            "ResourceClaim gpudra-deep: spec.devices.config[0].opaque.parameters: "
        ) in str(err.value)
    finally:
        with contextlib.suppress(ApiError):
            await run_sync(kube.delete, "ResourceSlice", slice_name)
        await akube.close()
