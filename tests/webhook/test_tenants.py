"""Tenant resolution, per-tenant conversion policy, pod rule checks and desired quotas."""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
from gpudra.api.quantity import parse_quantity
from gpudra.api.tenants import API_VERSION, parse_tenant
from gpudra.common.kube import ApiError
from gpudra.common.leader import LeaderElector
from gpudra.webhook import tenants as tenants_module
from gpudra.webhook.convert import ConversionPolicy, DeviceKind, convert_pod
from gpudra.webhook.metrics import PodSecurityGaps, QuotaLeader
from gpudra.webhook.tenant_rules import Lookup, QuotaUsage, TenantRules, claim_devices, policy_for
from gpudra.webhook.tenant_state import QUOTA_NAME, TENANT_LABEL, TenantState
from gpudra.webhook.tenants import MANAGED_BY_LABEL, MANAGED_BY_VALUE, TenantController
from prometheus_client import CollectorRegistry, generate_latest

from tests.common.leases import Clock as LeaseClock
from tests.common.leases import LeaseApi
from tests.webhook.quotas import KEY, quota


def tenant(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "GpuTenant",
        "metadata": {"name": name},
        "spec": spec,
    }


def namespace(name: str, phase: str = "Active", **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "status": {"phase": phase}}


def state(
    tenants: list[dict[str, Any]],
    namespaces: list[dict[str, Any]],
    quotas: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> TenantState:
    s = TenantState()
    s.replace("tenants", tenants)
    s.replace("namespaces", namespaces)
    s.replace("quotas", quotas)
    return s


def rules(**spec: Any) -> TenantRules:
    t = parse_tenant(tenant("team-a", namespaces=["ns"], **spec))
    return TenantRules(t, policy_for(t))


def pod(*containers: tuple[str, dict[str, str]], init: tuple[str, dict[str, str]] | None = None):
    def c(name: str, limits: dict[str, str]) -> dict[str, Any]:
        return {"name": name, "image": "cuda", "resources": {"limits": limits}}

    p: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [c(n, lim) for n, lim in containers]},
    }
    if init:
        p["spec"]["initContainers"] = [c(*init)]
    return p


def test_nothing_applies_without_tenants() -> None:
    s = state([], [namespace("ns")])
    assert s.lookup("ns").rules is None and not s.lookup("ns").denial
    assert s.desired_quotas() == {}


def test_denied_until_every_watch_listed() -> None:
    s = TenantState()
    s.replace("tenants", [])
    s.replace("namespaces", [])
    assert "has not loaded the GpuTenant rules" in s.lookup("ns").denial
    s.replace("quotas", [])
    assert s.lookup("ns").denial == ""


def test_label_and_name_selection() -> None:
    s = state(
        [tenant("team-a", namespaceSelector={"matchLabels": {"team": "a"}})],
        [namespace("a1", team="a"), namespace("b1", team="b")],
    )
    a1 = s.lookup("a1").rules
    assert a1 is not None and a1.tenant.name == "team-a"
    assert s.lookup("b1").rules is None
    assert "not in the gpudra webhook's cache yet" in s.lookup("unknown").denial


def test_listed_namespace_wins_over_label_selection() -> None:
    s = state(
        [
            tenant("broad", namespaceSelector={}),
            tenant("narrow", namespaces=["special"]),
        ],
        [namespace("special"), namespace("other")],
    )
    special, other = s.lookup("special").rules, s.lookup("other").rules
    assert special is not None and special.tenant.name == "narrow"
    assert other is not None and other.tenant.name == "broad"


def test_equal_specificity_is_a_conflict_naming_both() -> None:
    s = state(
        [
            tenant("team-b", namespaceSelector={"matchLabels": {"gpu": "yes"}}),
            tenant(
                "team-a",
                namespaceSelector={"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
                deviceQuota={"gpu.nvidia.com": 8},
            ),
        ],
        [namespace("shared", gpu="yes")],
    )
    found = s.lookup("shared")
    assert found.rules is None
    assert 'GpuTenants "team-a" and "team-b" with equal specificity' in found.denial
    assert "make the selectors disjoint" in found.denial


SYSTEM = frozenset({"kube-system", "gpudra"})
"""The namespaces the webhook never reviews, as `TenantController` passes them."""


def default_state(tenants: list[dict[str, Any]], namespaces: list[dict[str, Any]]) -> TenantState:
    s = TenantState(excluded=SYSTEM)
    s.replace("tenants", tenants)
    s.replace("namespaces", namespaces)
    s.replace("quotas", [])
    return s


def test_the_default_tenant_governs_only_the_namespaces_no_other_tenant_selects() -> None:
    """An empty namespaceSelector makes the default tenant, ranked below label and name
    selection: a team's tenant keeps its namespaces without a conflict, every other
    namespace (one made later without labels too) gets the default's rules and quota,
    and the namespaces the webhook never reviews get neither."""
    s = default_state(
        [
            tenant("default", namespaceSelector={}, deviceQuota={"gpu.nvidia.com": 0}),
            tenant("team-a", namespaceSelector={"matchLabels": {"team": "a"}}),
            tenant("special", namespaces=["named"]),
        ],
        [
            namespace("a1", team="a"),
            namespace("named"),
            namespace("fresh"),
            *(namespace(n) for n in SYSTEM),
        ],
    )
    s.event("namespaces", "ADDED", namespace("later"))

    def governs(ns: str) -> str | None:
        found = s.lookup(ns)
        assert "equal specificity" not in found.denial
        return found.rules.tenant.name if found.rules else None

    assert {ns: governs(ns) for ns in ("a1", "named", "kube-system", "gpudra")} == {
        "a1": "team-a",
        "named": "special",
        "kube-system": None,
        "gpudra": None,
    }
    assert set(s.desired_quotas()) == {"fresh", "later"}
    assert {s.desired_quotas()[ns][1] for ns in ("fresh", "later")} == {"default"}
    # Until the quota is in place, the default tenant's namespaces are refused.
    assert "gpudra-gpu-quota" in s.lookup("fresh").denial


def test_two_default_tenants_conflict_naming_both_and_the_fix() -> None:
    s = default_state(
        [
            tenant("default-b", namespaceSelector={}),
            tenant("default-a", namespaceSelector={"matchLabels": {}}),
            tenant("team-a", namespaceSelector={"matchLabels": {"team": "a"}}),
        ],
        [namespace("fresh"), namespace("a1", team="a")],
    )
    denial = s.lookup("fresh").denial
    assert 'GpuTenants "default-a" and "default-b" with equal specificity' in denial
    assert "keep one default tenant (namespaceSelector: {})" in denial
    a1 = s.lookup("a1").rules
    assert a1 is not None and a1.tenant.name == "team-a"


@pytest.mark.anyio
async def test_the_quota_moves_between_the_default_tenant_and_the_one_a_label_picks() -> None:
    """A namespace labelled into a team's tenant takes that tenant's quota (limit and
    tenant label), and back to the default's when the label goes; where the team's
    tenant sets no deviceQuota, the default's quota goes. kube-system and gpudra's own
    namespace get none."""
    server = QuotaServer()
    controller = TenantController(server, own_namespace="gpudra")  # type: ignore[arg-type]
    state = controller.state
    default = tenant("default", namespaceSelector={}, deviceQuota={"gpu.nvidia.com": 0})
    team_a = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    state.replace(
        "tenants", [default, tenant("team-a", **team_a, deviceQuota={"gpu.nvidia.com": 4})]
    )
    state.replace("namespaces", [namespace("ns"), *(namespace(n) for n in SYSTEM)])
    state.replace("quotas", [])

    async def held() -> tuple[str | None, str, str] | None:
        await settle(controller, server)
        obj = server.objs.get("ns")
        found = state.lookup("ns")
        name = found.rules.tenant.name if found.rules else found.denial
        if obj is None:
            return None
        return name, obj["metadata"]["labels"][TENANT_LABEL], obj["spec"]["hard"][KEY]

    assert await held() == ("default", "default", "0")
    assert set(server.objs) == {"ns"}
    state.event("namespaces", "MODIFIED", namespace("ns", team="a"))
    assert await held() == ("team-a", "team-a", "4")
    state.event("namespaces", "MODIFIED", namespace("ns"))
    assert await held() == ("default", "default", "0")
    state.event("tenants", "MODIFIED", tenant("team-a", **team_a))
    state.event("namespaces", "MODIFIED", namespace("ns", team="a"))
    assert await held() is None
    found = state.lookup("ns")
    assert found.rules is not None and found.rules.tenant.name == "team-a"


def test_conflict_quota_takes_the_smallest_limit() -> None:
    s = state(
        [
            tenant("team-a", namespaces=["shared"], deviceQuota={"gpu.nvidia.com": 8}),
            tenant(
                "team-b",
                namespaces=["shared"],
                deviceQuota={"gpu.nvidia.com": 2, "mig.nvidia.com": 5},
            ),
        ],
        [namespace("shared")],
    )
    hard, owner = s.desired_quotas()["shared"]
    assert hard == {KEY: "2", "mig.nvidia.com.deviceclass.resource.k8s.io/devices": "5"}
    assert owner == "team-a.team-b"


def test_quota_of_the_drivers_classes_a_tenant_does_not_name_is_zero_even_in_a_conflict() -> None:
    """A deviceQuota gives the driver's classes it does not name 0, an empty one all of
    them (no GPUs); in a conflict each class gets the smallest of what each tenant alone
    would give it, so two quotas naming different classes never allow both."""
    gpu, shared = "gpu.nvidia.com", "gpu-shared.nvidia.com"
    classes = frozenset({gpu, shared, "mig.nvidia.com"})

    def hard(*quotas: dict[str, int]) -> dict[str, str]:
        s = TenantState(quota_classes=classes)
        s.replace(
            "tenants",
            [tenant(f"t{i}", namespaces=["ns"], deviceQuota=q) for i, q in enumerate(quotas)],
        )
        s.replace("namespaces", [namespace("ns")])
        s.replace("quotas", [])
        return s.desired_quotas()["ns"][0]

    none = {f"{c}.deviceclass.resource.k8s.io/devices": "0" for c in classes}
    assert hard({}) == none
    assert hard({gpu: 4}, {shared: 4}) == none
    assert hard({gpu: 4, "other.example.com": 2}, {gpu: 6}) == {
        **none,
        KEY: "4",
        "other.example.com.deviceclass.resource.k8s.io/devices": "2",
    }


def test_desired_quotas_follow_selection_and_skip_terminating() -> None:
    s = state(
        [
            tenant(
                "team-a",
                namespaceSelector={"matchLabels": {"team": "a"}},
                deviceQuota={"gpu.nvidia.com": 4},
            )
        ],
        [namespace("a1", team="a"), namespace("a2", "Terminating", team="a"), namespace("b")],
    )
    assert s.desired_quotas() == {"a1": ({KEY: "4"}, "team-a")}
    # Until the quota is in place the API server counts nothing: refused, with a retry.
    assert "ResourceQuota gpudra-gpu-quota that enforces deviceQuota" in s.lookup("a1").denial
    s.event("quotas", "ADDED", quota("a1", "team-a", 4))
    assert s.lookup("a1").rules is not None
    # A late DELETED of an earlier quota of the same name does not drop the live one.
    stale = quota("a1", "team-a", 4)
    stale["metadata"]["uid"] = "uid-before"
    s.event("quotas", "DELETED", stale)
    assert s.lookup("a1").rules is not None
    s.event("namespaces", "MODIFIED", namespace("a1", team="b"))
    assert s.desired_quotas() == {}
    assert s.lookup("a1").rules is None
    s.event("namespaces", "MODIFIED", namespace("a1", team="a"))
    s.event("tenants", "DELETED", tenant("team-a"))
    assert s.desired_quotas() == {}


def test_invalid_tenant_keeps_its_quota_and_fails_closed() -> None:
    bad = tenant("team-a", namespaces=["a1"], maxDevicesPerPod="four")
    s = state([bad], [namespace("a1")], [quota("a1", "team-a", 4)])
    assert "team-a" in s.invalid and "spec.maxDevicesPerPod" in s.invalid["team-a"]
    assert s.desired_quotas() == {"a1": ({KEY: "4"}, "team-a")}
    assert "belongs to GpuTenant team-a, which is invalid" in s.lookup("a1").denial


def test_quota_usage_from_status() -> None:
    s = state(
        [tenant("team-a", namespaces=["a1"])], [namespace("a1")], [quota("a1", "team-a", 4, 3)]
    )
    assert s.quota_usage("a1") == QuotaUsage({"gpu.nvidia.com": 4}, {"gpu.nvidia.com": 3})
    assert s.quota_usage("other") is None
    s.event("quotas", "MODIFIED", quota("a1", "team-a", 4, 4))
    assert s.quota_usage("a1") == QuotaUsage({"gpu.nvidia.com": 4}, {"gpu.nvidia.com": 4})


def test_max_devices_per_pod_message_names_rule_limit_and_containers() -> None:
    r = rules(maxDevicesPerPod=4)
    conversion = convert_pod(pod(("a", {"nvidia.com/gpu": "4"}), ("b", {"nvidia.com/gpu": "2"})))
    assert r.check_pod(conversion, "ns", None) == (
        'tenant "team-a" (GpuTenant team-a): maxDevicesPerPod is 4, this pod asks for 6 '
        "devices (nvidia.com/gpu in containers a=4, b=2)"
    )
    ok = convert_pod(pod(("a", {"nvidia.com/gpu": "2"}), ("b", {"nvidia.com/gpu": "2"})))
    assert r.check_pod(ok, "ns", None) is None


def test_max_devices_counts_init_containers_like_the_device_plugin() -> None:
    # init (3) reuses the app containers' devices: the pod needs max(3, 1 + 1) = 3.
    conversion = convert_pod(
        pod(
            ("a", {"nvidia.com/gpu": "1"}),
            ("b", {"nvidia.com/gpu": "1"}),
            init=("setup", {"nvidia.com/gpu": "3"}),
        )
    )
    assert rules(maxDevicesPerPod=3).check_pod(conversion, "ns", None) is None
    message = rules(maxDevicesPerPod=2).check_pod(conversion, "ns", None)
    assert message is not None
    assert "this pod asks for 3 devices (nvidia.com/gpu in containers setup=3, a=1, b=1)" in message


def test_quota_precheck_message() -> None:
    r = rules(deviceQuota={"gpu.nvidia.com": 4})
    conversion = convert_pod(pod(("a", {"nvidia.com/gpu": "1"})))
    usage = QuotaUsage({"gpu.nvidia.com": 4}, {"gpu.nvidia.com": 4})
    assert r.check_pod(conversion, "ns", usage) == (
        'tenant "team-a" (GpuTenant team-a): quota gpu.nvidia.com in namespace ns: limit 4, '
        "used 4, this pod asks for 1"
    )
    room = QuotaUsage({"gpu.nvidia.com": 4}, {"gpu.nvidia.com": 3})
    assert r.check_pod(conversion, "ns", room) is None


def test_mig_profile_sharing_and_class_rules() -> None:
    mig = convert_pod(pod(("a", {"nvidia.com/mig-3g.40gb": "1"})))
    message = rules(allowedMigProfiles=["1g.10gb"]).check_pod(mig, "ns", None)
    assert message is not None
    assert "MIG profile 3g.40gb is not allowed; allowed profiles: 1g.10gb" in message
    assert "(nvidia.com/mig-3g.40gb in container a=1)" in message

    shared = convert_pod(pod(("a", {"nvidia.com/gpu.shared": "1"})))
    message = rules(allowedSharing=["Exclusive"]).check_pod(shared, "ns", None)
    assert message is not None and "sharing mode TimeSlicing is not allowed" in message

    gpu = convert_pod(pod(("a", {"nvidia.com/gpu": "1"})))
    message = rules(allowedDeviceClasses=["mig.nvidia.com"]).check_pod(gpu, "ns", None)
    assert message is not None
    assert "device class gpu.nvidia.com is not allowed; allowed classes: mig.nvidia.com" in message


def test_tenant_maps_gpu_to_time_sliced_shared_gpu() -> None:
    r = rules(gpuResource={"sharing": "TimeSlicing", "timeSlicingInterval": "Long"})
    assert r.policy.gpu_resource_kind is DeviceKind.SHARED
    conversion = convert_pod(pod(("a", {"nvidia.com/gpu": "1"})), r.policy)
    (claim,) = conversion.claims
    assert claim.kind is DeviceKind.SHARED and claim.device_class == "gpu-shared.nvidia.com"
    devices = conversion.templates[0]["spec"]["spec"]["devices"]
    assert devices["config"][0]["opaque"]["parameters"]["sharing"] == {
        "strategy": "TimeSlicing",
        "timeSlicingConfig": {"interval": "Long"},
    }
    # Content differs from the default, so the template name carries a hash.
    assert conversion.templates[0]["metadata"]["name"].startswith("gpudra-gpu-shared-1-")


def test_tenant_maps_gpu_to_mps() -> None:
    r = rules(gpuResource={"sharing": "MPS"})
    conversion = convert_pod(pod(("a", {"nvidia.com/gpu": "2"})), r.policy)
    params = conversion.templates[0]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert params["sharing"] == {"strategy": "MPS"}
    assert r.check_pod(conversion, "ns", None) is None


def test_share_only_conversion_holds_in_tenant_namespaces_and_counts_each_share() -> None:
    """`gpudra webhook --no-shared-whole-gpu-fallback` (the base policy) holds in a
    tenant's namespaces too, its gpuResource mapping included; the share-only claim
    counts one device per share against maxDevicesPerPod and the shared class's quota,
    the same count Kueue charges as nvidia.com/gpu.shared."""
    base = ConversionPolicy(shared_whole_gpu_fallback=False)
    shared = "gpu-shared.nvidia.com"
    s = TenantState(base_policy=base)
    s.replace("namespaces", [namespace("ns")])
    s.replace("quotas", [])
    s.replace(
        "tenants",
        [tenant("team-a", namespaces=["ns"], maxDevicesPerPod=2, gpuResource={"sharing": "MPS"})],
    )
    r = s.lookup("ns").rules
    assert r is not None and r.policy.shared_whole_gpu_fallback is False
    for resource in ("nvidia.com/gpu.shared", "nvidia.com/gpu"):
        conversion = convert_pod(pod(("a", {resource: "2"}), ("b", {resource: "1"})), r.policy)
        (template,) = conversion.templates
        spec = template["spec"]["spec"]
        assert [list(q) for q in spec["devices"]["requests"]] == [["name", "exactly"]] * 2
        assert claim_devices(spec, frozenset({shared})) == conversion.claims[0].devices == 3
        message = r.check_pod(conversion, "ns", None)
        assert message is not None and "maxDevicesPerPod is 2, this pod asks for 3" in message
        one = convert_pod(pod(("a", {resource: "1"})), r.policy)
        assert r.check_pod(one, "ns", QuotaUsage({shared: 2}, {shared: 1})) is None
        assert r.check_pod(one, "ns", QuotaUsage({shared: 2}, {shared: 2})) == (
            f'tenant "team-a" (GpuTenant team-a): quota {shared} in namespace ns: limit 2, '
            "used 2, this pod asks for 1"
        )


def test_only_the_own_quota_counts() -> None:
    s = state([tenant("team-a", namespaces=["a1"])], [namespace("a1")], [quota("a1", "team-a", 4)])
    other = quota("a1", "team-a", 9)
    other["metadata"]["name"] = "something-else"
    s.event("quotas", "ADDED", other)
    s.event("quotas", "DELETED", other)
    assert s.quota_usage("a1") == QuotaUsage({"gpu.nvidia.com": 4}, {"gpu.nvidia.com": 0})
    s.event("quotas", "DELETED", quota("a1", "team-a", 4))
    assert s.quota_usage("a1") is None


def test_claim_devices_counts_the_driver_classes_the_largest_alternative_and_all() -> None:
    classes = frozenset({"gpu.nvidia.com", "mig.nvidia.com"})
    spec = {
        "devices": {
            "requests": [
                {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
                {"name": "b", "exactly": {"deviceClassName": "nic.example.com", "count": 5}},
                {
                    "name": "c",
                    "firstAvailable": [
                        {"name": "x", "deviceClassName": "mig.nvidia.com", "count": 3},
                        {"name": "y", "deviceClassName": "gpu.nvidia.com"},
                    ],
                },
            ]
        }
    }
    assert claim_devices(spec, classes) == 5
    everything = {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}
    assert claim_devices({"devices": {"requests": [{"exactly": everything}]}}, classes) == 32
    assert claim_devices({"devices": {"requests": "x"}}, classes) == 0


LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
"""A label value as the API server takes it (apimachinery's IsValidLabelValue), <= 63."""


class QuotaApi:
    """Creates ResourceQuotas as the API server does, label values checked, and refuses
    those of the namespaces in `refuse`."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.refuse = refuse
        self.created: dict[str, dict[str, Any]] = {}

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        assert method == "POST" and path.endswith("/resourcequotas"), (method, path)
        namespace = body["metadata"]["namespace"]
        for value in body["metadata"]["labels"].values():
            if len(value) > 63 or not LABEL_VALUE.fullmatch(value):
                raise ApiError(422, f"metadata.labels: Invalid value: {value!r}", method, path)
        if namespace in self.refuse:
            raise ApiError(500, "etcdserver: request timed out", method, path)
        self.created[namespace] = body
        return {**body, "metadata": {**body["metadata"], "uid": "u"}}


def quota_tenant(name: str, ns: str) -> dict[str, Any]:
    return tenant(name, namespaces=[ns], deviceQuota={"gpu.nvidia.com": 2})


@pytest.mark.anyio
async def test_a_long_tenant_name_still_makes_a_valid_quota_label() -> None:
    long_name = "research-" + "x" * 53 + "-gpu"  # cut at 63, it would end in "-"
    api = QuotaApi()
    controller = TenantController(api)  # type: ignore[arg-type]
    controller.state.replace("tenants", [quota_tenant(long_name, "a-ns")])
    controller.state.replace("namespaces", [namespace("a-ns")])
    controller.state.replace("quotas", [])
    assert await controller.reconcile_once() == 1
    label = api.created["a-ns"]["metadata"]["labels"][TENANT_LABEL]
    assert long_name.startswith(label) and label[-1].isalnum()


@pytest.mark.anyio
async def test_one_namespaces_failed_quota_write_keeps_no_other_from_its_quota() -> None:
    api = QuotaApi(refuse=frozenset({"a-ns"}))
    controller = TenantController(api)  # type: ignore[arg-type]
    state = controller.state
    state.replace("tenants", [quota_tenant("team-a", "a-ns"), quota_tenant("team-b", "b-ns")])
    state.replace("namespaces", [namespace("a-ns"), namespace("b-ns")])
    state.replace("quotas", [])
    with pytest.raises(ApiError, match="timed out"):  # raised for the loop to retry
        await controller.reconcile_once()
    assert set(api.created) == {"b-ns"}


def test_an_invalid_tenant_fails_closed_wherever_it_would_decide() -> None:
    """Its rules are unknown, so where it would select a namespace (as far as its object
    can be read) at least as specifically as a valid tenant, admission is denied, quota
    or no quota."""
    # Stored by the API server, refused by the webhook's model: gpuResource defaults to
    # Exclusive, which allowedSharing leaves out.
    bad = tenant("team-a", namespaces=["a1"], maxDevicesPerPod=1, allowedSharing=["MPS"])
    broad = tenant("all", namespaceSelector={"matchLabels": {"team": "a"}})
    s = state([bad, broad], [namespace("a1", team="a"), namespace("a2", team="a")], [])
    assert "team-a" in s.invalid
    assert "belongs to GpuTenant team-a, which is invalid" in s.lookup("a1").denial
    assert s.lookup("a2").rules is not None  # not the invalid tenant's: the broad one's

    # By label against a valid tenant's name, the name wins; label against label conflicts.
    by_label = tenant(
        "team-b", namespaceSelector={"matchLabels": {"team": "b"}}, allowedSharing=["MPS"]
    )
    named = tenant("b1-owner", namespaces=["b1"])
    known = [namespace("b1", team="b"), namespace("b2", team="b"), namespace("c3", team="c")]
    s = state([by_label, named], known, [])
    assert s.lookup("b1").rules is not None
    assert "GpuTenant team-b, which is invalid" in s.lookup("b2").denial
    assert s.lookup("c3") == Lookup()  # outside its selector: no tenant
    # A namespace not yet known may be one its selector picks.
    assert "GpuTenant team-b, which is invalid" in s.lookup("unknown").denial

    # A selector that cannot be read is taken to select every namespace.
    unreadable = tenant(
        "team-c", namespaceSelector={"matchExpressions": [{"key": "x", "operator": "In"}]}
    )
    s = state([unreadable], [namespace("c1")], [])
    assert "GpuTenant team-c, which is invalid" in s.lookup("c1").denial


class QuotaServer:
    """ResourceQuotas as the API server keeps them (UIDs, 409 on a taken name, UID
    preconditions); `events` is what the controller's label-selected watch would see,
    delivered when a test says (`deliver`)."""

    def __init__(self) -> None:
        self.objs: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._serial = itertools.count(1)
        self.lose_next_create_answer = False

    def _emit(self, event_type: str, obj: dict[str, Any]) -> None:
        if (obj["metadata"].get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE:
            self.events.append((event_type, copy.deepcopy(obj)))

    @staticmethod
    def _stored(body: dict[str, Any]) -> dict[str, Any]:
        """As etcd keeps it: whole quantities in their canonical form (1000 as "1k")."""
        obj = copy.deepcopy(body)
        for key, value in (obj["spec"].get("hard") or {}).items():
            n, suffix = int(parse_quantity(value).amount), iter(("", "k", "M", "G"))
            unit = next(suffix)
            while n and n % 1000 == 0:
                n, unit = n // 1000, next(suffix)
            obj["spec"]["hard"][key] = f"{n}{unit}"
        return obj

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        ns = path.strip("/").split("/")[3]
        have = self.objs.get(ns)
        if method == "POST":
            if have is not None:
                raise ApiError(409, "already exists", method, path)
            obj = self._stored(body)
            obj["metadata"].update(uid=f"uid-{next(self._serial)}", resourceVersion="1")
            self.objs[ns] = obj
            self._emit("ADDED", obj)
            if self.lose_next_create_answer:
                self.lose_next_create_answer = False
                raise ApiError(504, "Timeout: request did not complete", method, path)
            return copy.deepcopy(obj)
        if have is None:
            raise ApiError(404, "not found", method, path)
        if method == "GET":
            return copy.deepcopy(have)
        if method == "PUT":
            version = body["metadata"].get("resourceVersion")
            if version is not None and version != have["metadata"]["resourceVersion"]:
                raise ApiError(409, "the object has been modified", method, path)
            if body["spec"].get("scopes") != have["spec"].get("scopes"):
                raise ApiError(422, "spec.scopes: field is immutable", method, path)
            obj = self._stored(body)
            obj["metadata"]["resourceVersion"] = str(next(self._serial))
            obj.pop("status", None)
            if "status" in have:  # an update of the object leaves its status alone
                obj["status"] = copy.deepcopy(have["status"])
            self.objs[ns] = obj
            self._emit("MODIFIED", obj)
            return copy.deepcopy(obj)
        if method == "DELETE":
            del self.objs[ns]
            self._emit("DELETED", have)
            return {}
        raise AssertionError(method)

    def delete_by_hand(self, ns: str) -> None:
        self._emit("DELETED", self.objs.pop(ns))

    def count(self) -> None:
        """What kube-controller-manager's quota controller does after a quota's spec
        changed: its status takes the spec's limits, and what the namespace uses."""
        for obj in self.objs.values():
            hard = obj["spec"].get("hard") or {}
            status = obj.get("status") or {}
            if status.get("hard") == hard and set(hard) <= set(status.get("used") or {}):
                continue
            used = status.get("used") or {}
            obj["status"] = {"hard": dict(hard), "used": {k: used.get(k, "0") for k in hard}}
            obj["metadata"]["resourceVersion"] = str(next(self._serial))
            self._emit("MODIFIED", obj)


async def settle(
    controller: TenantController, server: QuotaServer, *, counted: bool = True
) -> None:
    """Reconcile and deliver the watch's events until nothing changes; `counted`: with
    the quota controller counting each quota's status as it goes."""
    for _ in range(5):
        with contextlib.suppress(ApiError):
            await controller.reconcile_once()
        if counted:
            server.count()
        while server.events:
            event_type, obj = server.events.pop(0)
            controller.state.event("quotas", event_type, obj)


def quota_controller(server: QuotaServer, **quota: int) -> TenantController:
    controller = TenantController(server)  # type: ignore[arg-type]
    spec = {"namespaces": ["ns"], "deviceQuota": quota}
    controller.state.replace("tenants", [tenant("team-a", **spec)])
    controller.state.replace("namespaces", [namespace("ns")])
    controller.state.replace("quotas", [])
    return controller


@pytest.mark.anyio
async def test_the_quota_limits_the_driver_classes_deviceQuota_leaves_out_to_none() -> None:
    """Several classes give the same GPUs and Kubernetes counts a claim against its own
    class only: each driver class the tenant's deviceQuota does not name gets 0."""
    server = QuotaServer()
    controller = quota_controller(server, **{"gpu.nvidia.com": 2})
    await settle(controller, server)
    hard = server.objs["ns"]["spec"]["hard"]
    assert hard.pop(KEY) == "2"
    assert sorted(hard) == sorted(
        f"{c}.deviceclass.resource.k8s.io/devices"
        for c in ("gpu-shared.nvidia.com", "mig.nvidia.com")
    )
    assert set(hard.values()) == {"0"}
    lookup = controller.state.lookup("ns")
    assert lookup.rules is not None
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu.shared": "1"}}
    reason = lookup.rules.check_pod(
        convert_pod(pod, lookup.rules.policy), "ns", controller.state.quota_usage("ns")
    )
    assert reason is not None and "deviceQuota sets no limit for this class" in reason


@pytest.mark.anyio
async def test_a_lost_create_answer_or_a_late_event_never_loses_the_quota() -> None:
    """The create's answer is lost (the retry meets its own quota: 409), or a late
    DELETED of an earlier quota of the same name arrives: the controller still owns the
    quota, and puts it back when someone deletes it."""
    server = QuotaServer()
    server.lose_next_create_answer = True
    controller = quota_controller(server, **{"gpu.nvidia.com": 2})
    with pytest.raises(ApiError):
        await controller.reconcile_once()
    await controller.reconcile_once()  # 409: its own, by its label: taken in
    assert controller.state.quotas["ns"]["metadata"]["uid"] == server.objs["ns"]["metadata"]["uid"]
    server.events.clear()
    server.delete_by_hand("ns")
    await settle(controller, server)
    assert "ns" in server.objs
    assert controller.state.lookup("ns").rules is not None


@pytest.mark.anyio
async def test_a_change_meeting_the_quota_controllers_status_write_lands_in_one_pass() -> None:
    """The quota controller writes a quota's status right after each change, so the
    version the controller holds is often one behind when a tenant's limit changes: the
    update reads the quota again and lands, with no failed pass in between."""
    server = QuotaServer()
    controller = quota_controller(server, **{"gpu.nvidia.com": 2})
    await controller.reconcile_once()
    server.count()  # the status write; its event has not arrived yet
    spec = {"namespaces": ["ns"], "deviceQuota": {"gpu.nvidia.com": 3}}
    controller.state.replace("tenants", [tenant("team-b", **spec)])
    assert await controller.reconcile_once() == 1
    stored = server.objs["ns"]
    assert stored["spec"]["hard"][KEY] == "3"
    assert stored["metadata"]["labels"][TENANT_LABEL] == "team-b"
    assert stored["status"]["hard"][KEY] == "2"  # the update left the status alone


@pytest.mark.anyio
async def test_a_limit_the_api_server_writes_in_its_own_form_settles() -> None:
    """The API server keeps 1000 as "1k": the quota is in place, not rewritten forever,
    and the namespace's pods are admitted."""
    server = QuotaServer()
    controller = quota_controller(server, **{"gpu.nvidia.com": 1000})
    await settle(controller, server)
    assert server.objs["ns"]["spec"]["hard"][KEY] == "1k"
    assert await controller.reconcile_once() == 0
    assert controller.state.lookup("ns").rules is not None


@pytest.mark.anyio
async def test_a_quota_is_in_place_once_the_api_server_enforces_it() -> None:
    """The API server's quota admission limits by `status.hard`, which
    kube-controller-manager writes after each change of the spec: a quota just made
    limits nothing and one just lowered keeps its old limit, so until then the namespace
    is refused, and the early check reads the limits enforced, never the spec's."""
    server = QuotaServer()
    controller = quota_controller(server, **{"gpu.nvidia.com": 8})
    await settle(controller, server, counted=False)
    assert "status" not in server.objs["ns"]
    assert "not in place" in controller.state.lookup("ns").denial
    assert controller.state.quota_usage("ns") == QuotaUsage({}, {})
    await settle(controller, server)
    assert controller.state.lookup("ns").rules is not None
    lowered = tenant("team-a", namespaces=["ns"], deviceQuota={"gpu.nvidia.com": 2})
    controller.state.event("tenants", "MODIFIED", lowered)
    await settle(controller, server, counted=False)
    quota = server.objs["ns"]
    assert (quota["spec"]["hard"][KEY], quota["status"]["hard"][KEY]) == ("2", "8")
    assert "not in place" in controller.state.lookup("ns").denial
    await settle(controller, server)
    assert controller.state.lookup("ns").rules is not None
    assert controller.state.quota_usage("ns") == QuotaUsage(
        {"gpu.nvidia.com": 2, "gpu-shared.nvidia.com": 0, "mig.nvidia.com": 0},
        {"gpu.nvidia.com": 0, "gpu-shared.nvidia.com": 0, "mig.nvidia.com": 0},
    )


def test_reviews_for_made_up_namespaces_leave_nothing_behind() -> None:
    """Anyone who reaches the webhook's port may name any namespace in a review: the
    answers kept are for namespaces that exist, or memory grows with every forged name."""
    s = state(
        [tenant("team-a", namespaces=["a1"], deviceQuota={"gpu.nvidia.com": 2})],
        [namespace("a1")],
        [quota("a1", "team-a", 2)],
    )
    assert s.lookup("a1").rules is not None
    for i in range(100):
        assert s.lookup(f"made-up-{i}").rules is None
        assert s.quota_usage(f"made-up-{i}") is None
    assert set(s._memo) | set(s._selected) | set(s._usage) <= {"a1"}


@pytest.mark.anyio
async def test_a_same_named_quota_removed_by_the_admin_is_replaced_by_the_tenants() -> None:
    """A ResourceQuota of the managed name that gpudra does not manage keeps the
    namespace refused; its removal sends no event to the label-selected watch, so the
    create is tried again, after `foreign_retry_s`, not on every pass."""
    server = QuotaServer()
    server.objs["ns"] = {
        "metadata": {"name": QUOTA_NAME, "namespace": "ns", "uid": "theirs", "labels": {}},
        "spec": {"hard": {"pods": "10"}},
    }
    clock = [0.0]
    controller = TenantController(server, foreign_retry_s=30, clock=lambda: clock[0])  # type: ignore[arg-type]
    spec = {"namespaces": ["ns"], "deviceQuota": {"gpu.nvidia.com": 2}}
    controller.state.replace("tenants", [tenant("team-a", **spec)])
    controller.state.replace("namespaces", [namespace("ns")])
    controller.state.replace("quotas", [])
    await settle(controller, server)
    assert "not in place" in controller.state.lookup("ns").denial
    del server.objs["ns"]  # by the admin, as the denial and the log say
    clock[0] = 29
    await settle(controller, server)
    assert "ns" not in server.objs
    clock[0] = 31
    await settle(controller, server)
    assert server.objs["ns"]["metadata"]["labels"][TENANT_LABEL] == "team-a"
    assert controller.state.lookup("ns").rules is not None


@pytest.mark.anyio
async def test_a_quota_found_as_desired_is_not_parsed_again_until_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reconcile follows every status update of every owned quota (one per claim made
    or removed): quotas unchanged since they were found as desired cost no parsing."""
    server = QuotaServer()
    names = [f"ns{i}" for i in range(50)]
    controller = TenantController(server)  # type: ignore[arg-type]
    spec = {"namespaces": names, "deviceQuota": {"gpu.nvidia.com": 2}}
    controller.state.replace("tenants", [tenant("team-a", **spec)])
    controller.state.replace("namespaces", [namespace(n) for n in names])
    controller.state.replace("quotas", [])
    await settle(controller, server)
    await controller.reconcile_once()  # every quota found as desired once
    parsed: list[str] = []
    real = tenants_module.quota_spec_is

    def counting(quota: Mapping[str, Any], hard: Mapping[str, str]) -> bool:
        parsed.append(quota["metadata"]["namespace"])
        return real(quota, hard)

    monkeypatch.setattr(tenants_module, "quota_spec_is", counting)
    used = copy.deepcopy(server.objs["ns7"])
    used["status"]["used"][KEY] = "1"
    used["metadata"]["resourceVersion"] = "999"
    server.objs["ns7"] = used
    controller.state.event("quotas", "MODIFIED", used)
    assert await controller.reconcile_once() == 0
    assert parsed == ["ns7"]


def test_a_namespace_named_by_a_tenant_is_refused_until_its_quota_is_in_place() -> None:
    """A namespace the tenant lists by name whose watch event has not arrived (applied
    together with its pods): its rules are known, its quota is not there yet."""
    s = state([tenant("team-a", namespaces=["new"], deviceQuota={"gpu.nvidia.com": 2})], [])
    assert "that enforces deviceQuota in namespace new" in s.lookup("new").denial


@pytest.mark.anyio
async def test_a_scope_added_to_the_owned_quota_is_put_back() -> None:
    """A scope would make the quota count no claim, and the API server refuses to change
    a quota's scopes: the quota is made again, and meanwhile the namespace is refused."""
    server = QuotaServer()
    controller = quota_controller(server, **{"gpu.nvidia.com": 2})
    await settle(controller, server)
    edited = copy.deepcopy(server.objs["ns"])
    edited["spec"]["scopes"] = ["Terminating"]
    edited["metadata"]["resourceVersion"] = "100"  # as every write gets a new one
    server.objs["ns"] = edited
    controller.state.event("quotas", "MODIFIED", edited)
    assert "not in place" in controller.state.lookup("ns").denial
    await settle(controller, server)
    assert "scopes" not in server.objs["ns"]["spec"]
    assert controller.state.lookup("ns").rules is not None


ENFORCE = "pod-security.kubernetes.io/enforce"


def test_tenant_namespaces_where_pods_may_be_privileged_are_listed() -> None:
    """A privileged pod gets every GPU of its node without a claim: tenant namespaces
    whose Pod Security level allows it are listed with their tenants, valid or not, as
    the API server reads the level (a label, else the cluster's default; an unknown
    value is enforced as restricted), and the list follows label changes."""
    bad = tenant("broken", namespaces=["b1"], allowedSharing=["MPS"])  # invalid
    labelled = tenant("team-l", namespaceSelector={"matchLabels": {"team": "l"}})
    known = [
        namespace("open"),
        namespace("privileged", **{ENFORCE: "privileged"}),
        namespace("baseline", **{ENFORCE: "baseline"}),
        namespace("restricted", **{ENFORCE: "restricted"}),
        namespace("typo", **{ENFORCE: "Baseline"}),
        namespace("l1", team="l"),
        namespace("b1"),
        namespace("no-tenant"),
        namespace("leaving", phase="Terminating"),
    ]
    named = ["open", "privileged", "baseline", "restricted", "typo", "leaving"]
    s = state([tenant("team-a", namespaces=named), labelled, bad], known)
    assert s.without_pod_security() == {
        "b1": ("broken",),
        "l1": ("team-l",),
        "open": ("team-a",),
        "privileged": ("team-a",),
    }

    s.event("namespaces", "MODIFIED", namespace("open", **{ENFORCE: "baseline"}))
    assert "open" not in s.without_pod_security()
    s.event("namespaces", "MODIFIED", namespace("open"))
    assert "open" in s.without_pod_security()

    # Where the API server's configuration enforces baseline by default, only the
    # namespaces labelled privileged are open.
    s = TenantState(pod_security_default="baseline")
    s.replace("tenants", [tenant("team-a", namespaces=named)])
    s.replace("namespaces", known)
    s.replace("quotas", [])
    assert s.without_pod_security() == {"privileged": ("team-a",)}
    assert state([], known).without_pod_security() == {}


def test_a_default_tenant_reports_the_namespaces_it_governs_not_the_systems() -> None:
    """The default tenant makes every namespace a tenant namespace: those it governs are
    reported, by its name, but not kube-system and gpudra's own, which it does not
    govern (the node agent's must allow privileged pods)."""
    s = default_state(
        [
            tenant("default", namespaceSelector={}),
            tenant("team-l", namespaceSelector={"matchLabels": {"team": "l"}}),
        ],
        [
            namespace("fresh"),
            namespace("l1", team="l"),
            namespace("safe", **{ENFORCE: "baseline"}),
            namespace("gpudra", **{ENFORCE: "privileged"}),
            namespace("kube-system"),
        ],
    )
    assert s.without_pod_security() == {"fresh": ("default",), "l1": ("team-l",)}


@pytest.mark.anyio
async def test_the_webhook_exports_and_logs_tenant_namespaces_without_pod_security(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The series is read from the tenant state at each scrape (gone once the namespace
    is labelled), and the controller warns once per change, naming the namespaces."""
    server = QuotaServer()
    controller = quota_controller(server)
    registry = CollectorRegistry()
    registry.register(PodSecurityGaps(controller.state.without_pod_security))
    series = (
        'gpudra_webhook_tenant_namespace_without_pod_security{namespace="ns",tenant="team-a"} 1.0'
    )
    assert series in generate_latest(registry).decode()

    with caplog.at_level("WARNING", logger="gpudra.webhook.tenants"):
        await controller.reconcile_once()
        await controller.reconcile_once()
    (record,) = [r for r in caplog.records if "Pod Security" in r.getMessage()]
    assert record.fields == {"count": 1, "namespaces": ["ns"], "tenants": ["team-a"]}  # type: ignore[attr-defined]
    assert f"label them {ENFORCE}=baseline" in record.getMessage()

    controller.state.event("namespaces", "MODIFIED", namespace("ns", **{ENFORCE: "restricted"}))
    assert "without_pod_security{" not in generate_latest(registry).decode()


def test_the_controllers_own_write_does_not_undo_a_later_event_of_its_quota() -> None:
    """The quota controller's status (what the namespace uses) may come in through the
    watch before the answer to the write that made the quota: the answer, an older
    version, must not put used back to nothing."""
    s = state([tenant("t", namespaces=["a"], deviceQuota={"gpu.nvidia.com": 1})], [namespace("a")])
    written = quota("a", "t", 1, 0)
    written["metadata"]["resourceVersion"] = "10"
    del written["status"]
    counted = quota("a", "t", 1, 2)
    counted["metadata"]["resourceVersion"] = "11"
    s.event("quotas", "MODIFIED", counted)
    s.put_quota("a", written)
    usage = s.quota_usage("a")
    assert usage is not None and usage.used == {"gpu.nvidia.com": 2}
    # A later write of the controller's own is taken at once.
    newer = quota("a", "t", 3, 2)
    newer["metadata"]["resourceVersion"] = "12"
    s.put_quota("a", newer)
    usage = s.quota_usage("a")
    assert usage is not None and usage.hard["gpu.nvidia.com"] == 3


@pytest.mark.anyio
async def test_only_the_replica_leading_the_lease_writes_quotas_and_a_new_leader_at_once() -> None:
    """A follower keeps its state (admission reads it) but writes no quota; gaining the
    lease pokes the reconcile loop, which writes with no other change to wake it."""
    server, leases, clock = QuotaServer(), LeaseApi(), LeaseClock()
    holder, elector = (
        LeaderElector(
            leases,  # type: ignore[arg-type]
            name="quota-writer",
            namespace="gpudra",
            identity=identity,
            clock=clock,
        )
        for identity in ("old-release", "new-release")
    )
    controller = TenantController(server, leader=elector)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    registry.register(QuotaLeader(lambda: controller.writing))
    assert await holder.try_acquire_or_renew()
    assert not await elector.try_acquire_or_renew()
    spec = {"namespaces": ["ns"], "deviceQuota": {"gpu.nvidia.com": 2}}
    controller.state.replace("tenants", [tenant("team-a", **spec)])
    controller.state.replace("namespaces", [namespace("ns")])
    controller.state.replace("quotas", [])
    assert await controller.reconcile_once() == 0
    assert server.objs == {} and controller.writes == 0
    assert controller.ready  # readiness and admission read the same state as before
    assert "gpudra_webhook_quota_leader 0.0" in generate_latest(registry).decode()

    async with anyio.create_task_group() as tg:
        await tg.start(controller._reconciler.run)
        await holder.release()
        assert await elector.try_acquire_or_renew()
        with anyio.fail_after(60):
            while "ns" not in server.objs:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert server.objs["ns"]["spec"]["hard"][KEY] == "2"
    assert controller.writes == 1
    assert "gpudra_webhook_quota_leader 1.0" in generate_latest(registry).decode()
