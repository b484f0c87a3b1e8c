"""Escape attempts with the webhook's own identity, which the API server must stop.

The webhook pod is reachable by every tenant, so the chart assumes it can be taken over
and bounds what its ServiceAccount can write: its webhook configurations only in their
caBundle (tls.source=self), and only its own device ResourceQuota. Each attempt here is
made with a token of the chart's webhook ServiceAccount, bound by the chart's own
ClusterRole and admission policies, against the real API server; the webhook's real
writes (gpudra's registration, CA bundle controller and tenant controller, run with
that token) must still pass.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.cli.webhook import QUOTA_LEASE
from gpudra.common.kube import Kube as AsyncKube
from gpudra.common.leader import LeaderElector
from gpudra.webhook import registration
from gpudra.webhook.cabundle import CABundleController, ConfigurationKind, WebhookConfiguration
from gpudra.webhook.certs import generate_ca
from gpudra.webhook.convert import DEFAULT_POLICY
from gpudra.webhook.tenant_state import QUOTA_NAME
from gpudra.webhook.tenants import MANAGED_BY_LABEL, MANAGED_BY_VALUE, TenantController

from e2e import smoke
from e2e.cluster.kube import ApiError, wait_for
from e2e.cluster.kube import Kube as SyncKube
from e2e.tenant_user import TenantUser, service_account_token, tenant_user, token_kubeconfig
from e2e.tests.escape.test_rbac import denied
from e2e.tests.test_chart import apply, delete, helm, kubectl  # noqa: F401 - fixtures
from e2e.tools import helm as h

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
NAMESPACE = "gpudra-webhook-rbac-e2e"
RELEASE = "rbac-e2e"
SA = "rbac-e2e-gpudra-webhook"
USER = f"system:serviceaccount:{NAMESPACE}:{SA}"
MUTATING = SyncKube.path("MutatingWebhookConfiguration", name=registration.NAME)
VALIDATING = SyncKube.path("ValidatingWebhookConfiguration", name=registration.VALIDATING_NAME)
# The rendered configurations get an object selector no object carries, so that while
# they exist no pod or claim of the cluster is sent to a webhook that is not running.
INERT = {"matchLabels": {"gpudra.dev/webhook-rbac-e2e": "inert"}}
DEVICES = "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"


def chart_objects(helm_bin: Path) -> list[dict[str, Any]]:
    return h.template(helm_bin, release=RELEASE, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def webhook_rbac(
    helm: Path,  # noqa: F811
    kube: SyncKube,
    kubectl: list[str],  # noqa: F811
) -> Iterator[list[dict[str, Any]]]:
    """The chart's webhook ServiceAccount, ClusterRole, leader-election Role and
    admission policies (default values: tls.source=self, tenants on), installed for real."""

    def settled() -> bool:  # a run just before may still be removing the namespace
        found = kube.get_or_none("Namespace", NAMESPACE)
        return found is None or "deletionTimestamp" not in found["metadata"]

    wait_for(f"namespace {NAMESPACE} to be removed", settled, timeout=120)
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    kinds = {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    objects = [
        o
        for o in chart_objects(helm)
        if o["kind"] in kinds
        and o["metadata"]["labels"].get("app.kubernetes.io/component") == "webhook"
        and (not o["kind"].startswith("Validating") or o["metadata"]["name"].startswith(SA))
    ]
    apply(kubectl, objects)
    yield objects
    delete(kubectl, [o for o in objects if o["kind"] != "ServiceAccount"])
    kube.delete("Namespace", NAMESPACE)


@pytest.fixture
def webhook_token(kube: SyncKube, webhook_rbac: list[dict[str, Any]]) -> str:
    """A token of the webhook's ServiceAccount, as its pod holds one."""
    return service_account_token(kube, NAMESPACE, SA)


@pytest.fixture
def webhook_user(kube: SyncKube, webhook_token: str) -> TenantUser:
    """Requests with the webhook's token, as a taken-over pod would send them."""
    return TenantUser(kube.creds, webhook_token, USER)


@pytest.fixture
async def webhook_kube(
    kube: SyncKube, webhook_token: str, tmp_path: Path
) -> AsyncIterator[AsyncKube]:
    """gpudra's own client with the webhook's token, as the webhook pod runs it."""
    path = token_kubeconfig(kube.creds, webhook_token, "webhook", tmp_path / "webhook.kubeconfig")
    k = await AsyncKube.connect(str(path))
    yield k
    await k.close()


@pytest.fixture
def configurations(
    helm: Path,  # noqa: F811
    kube: SyncKube,
    kubectl: list[str],  # noqa: F811
    webhook_rbac: list[dict[str, Any]],
) -> Iterator[list[dict[str, Any]]]:
    """The chart's two webhook configurations as Helm installs them (no caBundle yet),
    made inert."""
    for path in (MUTATING, VALIDATING):
        try:
            kube.request("GET", path)
        except ApiError as e:
            assert e.status == 404, e
        else:
            pytest.skip(f"{path} exists: a webhook of another run is registered")
    rendered = [
        o
        for o in chart_objects(helm)
        if o["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    ]
    for config in rendered:
        for hook in config["webhooks"]:
            hook["objectSelector"] = INERT
    apply(kubectl, rendered)
    yield rendered
    delete(kubectl, rendered)


def changed(user: TenantUser, path: str, change: Any) -> dict[str, Any]:
    """The stored object as the webhook reads it, changed by `change`."""
    obj: dict[str, Any] = user.request("GET", path)
    change(obj)
    return obj


def as_webhook_update(user: TenantUser, path: str, change: Any) -> ApiError:
    """The stored configuration, changed by `change`, PUT with the webhook's token."""
    return denied(user.request, "PUT", path, changed(user, path, change))


def wait_enforced(user: TenantUser, method: str, path: str, body: Any, what: str) -> ApiError:
    """The policy's first denial of a dry run (the API server loads a new policy within
    seconds; a dry run admitted before then changes nothing)."""

    def refused() -> ApiError | None:
        try:
            user.request(method, f"{path}?dryRun=All", body)
        except ApiError as e:
            if e.status == 403 and "ValidatingAdmissionPolicy" in str(e):
                return e
            raise
        return None

    found: ApiError = wait_for(f"the admission policy to deny {what}", refused, timeout=30)
    return found


def test_the_webhook_cannot_repoint_or_widen_its_configurations(
    kube: SyncKube, webhook_user: TenantUser, configurations: list[dict[str, Any]]
) -> None:
    user = webhook_user
    before = {p: kube.request("GET", p) for p in (MUTATING, VALIDATING)}

    def to_attacker(c: dict[str, Any]) -> None:
        c["webhooks"][0]["clientConfig"] = {"url": "https://attacker.example/"}

    def every_object(c: dict[str, Any]) -> None:
        c["webhooks"][0]["rules"] = [
            {
                "apiGroups": ["*"],
                "apiVersions": ["*"],
                "operations": ["*"],
                "resources": ["*/*"],
                "scope": "*",
            }
        ]

    err = wait_enforced(
        user,
        "PUT",
        MUTATING,
        changed(user, MUTATING, to_attacker),
        "a url in the webhook's configuration",
    )
    assert f"{USER} may only change webhooks[*].clientConfig.caBundle" in str(err)

    def ignore(c: dict[str, Any]) -> None:
        c["webhooks"][0]["failurePolicy"] = "Ignore"

    def unselected(c: dict[str, Any]) -> None:
        c["webhooks"][0]["namespaceSelector"] = {}
        c["webhooks"][0]["objectSelector"] = {}
        c["webhooks"][0].pop("matchConditions", None)

    def no_conditions(c: dict[str, Any]) -> None:
        c["webhooks"][0].pop("matchConditions", None)

    def other_service(c: dict[str, Any]) -> None:
        c["webhooks"][0]["clientConfig"]["service"]["namespace"] = "kube-system"

    def extra_hook(c: dict[str, Any]) -> None:
        c["webhooks"].append(dict(c["webhooks"][0], name="more.gpudra.nvidia.com"))

    def reordered(c: dict[str, Any]) -> None:
        c["webhooks"].reverse()

    def no_hooks(c: dict[str, Any]) -> None:
        c["webhooks"] = []

    for path, change in (
        (MUTATING, to_attacker),
        (MUTATING, every_object),
        (MUTATING, ignore),
        (MUTATING, unselected),
        (MUTATING, no_conditions),
        (MUTATING, other_service),
        (MUTATING, extra_hook),
        (MUTATING, no_hooks),
        (VALIDATING, to_attacker),
        (VALIDATING, every_object),
        (VALIDATING, ignore),
        (VALIDATING, reordered),
    ):
        err = as_webhook_update(user, path, change)
        assert err.status == 403, (change.__name__, err)
        assert f"{USER} may only change webhooks[*].clientConfig.caBundle" in str(err), err

    # A merge patch is judged on the object it makes, as an update is.
    err = denied(user.request, "PATCH", MUTATING, {"webhooks": []})
    assert err.status == 403 and "clientConfig.caBundle" in str(err), err
    # Nor may it remove its configurations or make others (RBAC alone).
    err = denied(user.request, "DELETE", MUTATING)
    assert err.status == 403, err
    made = copy.deepcopy(before[MUTATING])
    made["metadata"] = {"name": "gpudra-elsewhere"}
    err = denied(user.request, "POST", SyncKube.path("MutatingWebhookConfiguration"), made)
    assert err.status == 403, err

    for path, was in before.items():
        assert kube.request("GET", path)["webhooks"] == was["webhooks"]


async def test_the_webhooks_own_ca_bundle_writes_pass(
    kube: SyncKube,
    webhook_user: TenantUser,
    webhook_kube: AsyncKube,
    configurations: list[dict[str, Any]],
) -> None:
    user = webhook_user
    # Enforced already: a change beside the bundle is refused...
    no_rules = changed(user, MUTATING, lambda c: c["webhooks"][0].pop("rules"))
    wait_enforced(user, "PUT", MUTATING, no_rules, "a change of the rules")
    # ...while registration.apply, as `gpudra webhook --cert-source=self` runs it hourly
    # (a server-side apply of the caBundle alone on a configuration Helm manages), passes.
    first = base64.b64encode(generate_ca().cert_pem).decode()
    service = (SA, NAMESPACE, 8443)
    await registration.apply(
        webhook_kube,
        registration.mutating_configuration(
            ca_bundle_b64=first, own_namespace=NAMESPACE, service=service, selector_in_webhook=True
        ),
    )
    await registration.apply(
        webhook_kube,
        registration.validating_configuration(
            ca_bundle_b64=first,
            own_namespace=NAMESPACE,
            device_classes=["gpu.nvidia.com"],
            driver="gpu.nvidia.com",
            service=service,
        ),
    )
    for path in (MUTATING, VALIDATING):
        stored = kube.request("GET", path)
        assert {w["clientConfig"]["caBundle"] for w in stored["webhooks"]} == {first}
        assert all(w["objectSelector"] == INERT for w in stored["webhooks"])

    # The CA bundle controller's JSON patches (a new bundle and its lease annotations).
    second = generate_ca().cert_pem
    controller = CABundleController(
        webhook_kube,
        [
            WebhookConfiguration(ConfigurationKind.MUTATING, registration.NAME),
            WebhookConfiguration(ConfigurationKind.VALIDATING, registration.VALIDATING_NAME),
        ],
        keep_foreign_s=60,
        holder="webhook-rbac-e2e",
    )
    controller.set_bundle(second)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(controller.run)
            await controller.wait_published(second)
            tg.cancel_scope.cancel()
    # Both configurations carry the new bundle and the controller's lease annotations,
    # so both of its patches passed the policy (its own count of them may trail the
    # watch that woke `wait_published`). The first CA, found without a lease, is kept
    # beside the new one for a while.
    want = controller.desired_b64()
    assert second.strip() in base64.b64decode(want)
    for path in (MUTATING, VALIDATING):
        stored = kube.request("GET", path)
        assert {w["clientConfig"]["caBundle"] for w in stored["webhooks"]} == {want}
        assert any(
            k.startswith("ca-lease.gpudra.nvidia.com/")
            for k in stored["metadata"].get("annotations", {})
        )


def quota(ns: str, name: str = QUOTA_NAME, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE},
        },
        "spec": spec or {"hard": {DEVICES: "1"}},
    }


@pytest.fixture
def tenant_namespaces(kube: SyncKube) -> Iterator[tuple[str, str]]:
    mine = smoke.make_namespace(kube, "escape-webhook-quota")
    admins = smoke.make_namespace(kube, "escape-webhook-admin")
    yield mine, admins
    kube.delete("Namespace", mine)
    kube.delete("Namespace", admins)


async def test_the_webhook_writes_only_its_own_device_quota(
    kube: SyncKube,
    webhook_user: TenantUser,
    webhook_kube: AsyncKube,
    tenant_namespaces: tuple[str, str],
) -> None:
    ns, admins = tenant_namespaces
    user = webhook_user
    path = SyncKube.path("ResourceQuota", ns)
    err = wait_enforced(user, "POST", path, quota(ns, "kube-stopper"), "a quota of another name")
    assert f"{USER} may only write the ResourceQuota {QUOTA_NAME}, not kube-stopper" in str(err)
    unlabelled = quota(ns)
    del unlabelled["metadata"]["labels"]
    for body, message in (
        (quota(ns, hard={"pods": "0"}), "may only limit devices"),
        (quota(ns, hard={DEVICES: "1", "pods": "0"}), "may only limit devices"),
        (quota(ns, hard={DEVICES: "1"}, scopes=["BestEffort"]), "may only limit devices"),
        (unlabelled, "may only write the ResourceQuotas it made"),
    ):
        err = denied(user.request, "POST", path, body)
        assert err.status == 403 and message in str(err), err
    assert kube.list("ResourceQuota", ns) == []

    # The tenant controller's own writes, as it makes them, pass: create, change, delete.
    controller = TenantController(webhook_kube, DEFAULT_POLICY)
    await controller._create(ns, {DEVICES: "2"}, "team-a")
    made = kube.get("ResourceQuota", QUOTA_NAME, ns)
    assert made["spec"] == {"hard": {DEVICES: "2"}}
    await controller._update(made, {DEVICES: "3"}, "team-b")
    changed = kube.get("ResourceQuota", QUOTA_NAME, ns)
    assert changed["spec"] == {"hard": {DEVICES: "3"}}
    # ...but not turned into something else on the way (a merge patch: the quota
    # controller writes the status meanwhile).
    pods = {"spec": {"hard": {"pods": "0"}}}
    err = denied(user.request, "PATCH", SyncKube.path("ResourceQuota", ns, QUOTA_NAME), pods)
    assert err.status == 403 and "may only limit devices" in str(err), err
    await controller._delete(ns, changed)
    assert kube.get_or_none("ResourceQuota", QUOTA_NAME, ns) is None

    # The admin's quota of the same name (no gpudra label) is neither changed nor removed.
    theirs = quota(admins, hard={"pods": "10"})
    del theirs["metadata"]["labels"]
    kube.create(theirs)
    taken = {
        "metadata": {"labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE}},
        "spec": {"hard": {"pods": "0"}},
    }
    quota_path = SyncKube.path("ResourceQuota", admins, QUOTA_NAME)
    err = denied(user.request, "PATCH", quota_path, taken)
    assert err.status == 403 and "may only write the ResourceQuotas it made" in str(err), err
    err = denied(user.request, "DELETE", quota_path)
    assert err.status == 403 and "may only write the ResourceQuotas it made" in str(err), err
    assert kube.get("ResourceQuota", QUOTA_NAME, admins)["spec"]["hard"] == {"pods": "10"}


def lease(name: str, holder: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 3600},
    }


async def test_a_tenant_cannot_take_or_break_the_quota_writers_lease(
    kube: SyncKube,
    webhook_user: TenantUser,
    webhook_kube: AsyncKube,
    tenant_namespaces: tuple[str, str],
) -> None:
    """Whoever holds the Lease is the one replica writing tenants' quotas: a tenant that
    could hold it, or delete it again and again, would stop quota writes (a replica
    follows a live lease it does not hold). The chart's Role lets only the webhook's
    ServiceAccount write it, and that account no other Lease but by creating one."""
    ns, _ = tenant_namespaces
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
    path = f"{leases}/{QUOTA_LEASE}"
    # The webhook's own elector, with its token: takes, renews and releases the lease.
    elector = LeaderElector(
        webhook_kube, name=QUOTA_LEASE, namespace=NAMESPACE, identity="webhook-pod-a"
    )

    def granted() -> bool:  # a just-applied RoleBinding takes effect within moments
        try:
            webhook_user.request("GET", path)
        except ApiError as e:
            return e.status == 404
        return True

    wait_for("the webhook's Role to take effect", granted, timeout=30)
    assert await elector.try_acquire_or_renew()
    assert await elector.try_acquire_or_renew()
    assert kube.request("GET", path)["spec"]["holderIdentity"] == "webhook-pod-a"

    tenant = tenant_user(kube, ns)
    stolen = kube.request("GET", path)
    stolen["spec"]["holderIdentity"] = "tenant"
    for method, target, body in (
        ("GET", path, None),
        ("PUT", path, stolen),
        ("PATCH", path, {"spec": {"holderIdentity": "tenant"}}),
        ("DELETE", path, None),
        ("POST", leases, lease("decoy", "tenant")),
    ):
        err = denied(tenant.request, method, target, body)
        assert err.status == 403, (method, err)
    assert kube.request("GET", path)["spec"]["holderIdentity"] == "webhook-pod-a"

    # The webhook's account itself cannot delete its lease, nor write another one.
    err = denied(webhook_user.request, "DELETE", path)
    assert err.status == 403, err
    kube.request("POST", leases, lease("other-controller", "someone"))
    other = f"{leases}/other-controller"
    err = denied(webhook_user.request, "PUT", other, lease("other-controller", "webhook"))
    assert err.status == 403, err

    await elector.release()
    assert kube.request("GET", path)["spec"]["holderIdentity"] == ""
