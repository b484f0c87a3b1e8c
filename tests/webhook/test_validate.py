"""Hand-written claims and templates: opaque configs and tenant rules, and the
/validate-claims path of the server over real HTTPS."""

from __future__ import annotations

import copy
import dataclasses
import json
import ssl
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteStream
from gpudra.api.configcache import ConfigCache
from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import API_VERSION, parse_tenant
from gpudra.driver.checkpoint import Checkpoint
from gpudra.driver.claims import ClaimError, ClaimRef, checked_claim
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml import NvmlEmulator
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.driver.planning import mps_settings, plan
from gpudra.webhook.admission import VALIDATE_CLAIMS_PATH, Admission
from gpudra.webhook.certs import ensure_pki, service_dns_names
from gpudra.webhook.convert import DEFAULT_POLICY, convert_pod
from gpudra.webhook.device_classes import DeviceClassCache
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.tenant_rules import TenantRules, policy_for
from gpudra.webhook.tenant_state import TenantState
from gpudra.webhook.validate import (
    ClaimVerdict,
    class_configs,
    driver_classes,
    validate_claim_object,
)
from prometheus_client import CollectorRegistry

CONFIG_API = "resource.nvidia.com/v1beta1"
CLASSES = driver_classes(DEFAULT_POLICY)


def claim(*requests: dict[str, Any], config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if config is not None:
        devices["config"] = config
    return {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": devices}}


def template(obj: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": obj["metadata"], "spec": {"spec": obj["spec"]}}


def req(name: str, cls: str = "gpu.nvidia.com", count: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, "count": count, **extra}}


def opaque(params: dict[str, Any], driver: str = "gpu.nvidia.com", **entry: Any) -> dict[str, Any]:
    return {"opaque": {"driver": driver, "parameters": params}, **entry}


def gpu_config(**sharing: Any) -> dict[str, Any]:
    return {
        "apiVersion": CONFIG_API,
        "kind": "GpuConfig",
        **({"sharing": sharing} if sharing else {}),
    }


def rules(**spec: Any) -> TenantRules:
    t = parse_tenant(
        {
            "apiVersion": API_VERSION,
            "kind": "GpuTenant",
            "metadata": {"name": "team-a"},
            "spec": {"namespaces": ["ns"], **spec},
        }
    )
    return TenantRules(t, policy_for(t))


def check(obj: dict[str, Any], r: TenantRules | None = None, **kw: Any) -> ClaimVerdict:
    return validate_claim_object(
        obj,
        template=kw.pop("template", False),
        policy=DEFAULT_POLICY,
        classes=kw.pop("classes", CLASSES),
        rules=r,
        **kw,
    )


def test_valid_claim_passes_without_tenant() -> None:
    obj = claim(req("gpu"), config=[opaque(gpu_config(strategy="TimeSlicing"))])
    assert check(obj).allowed
    assert check(template(obj), template=True).allowed


def test_invalid_opaque_config_names_the_path_and_accepted_values() -> None:
    obj = claim(req("gpu"), config=[opaque(gpu_config(strategy="Sliced"))])
    verdict = check(obj)
    assert verdict.invalid == [
        "spec.devices.config[0].opaque.parameters.sharing.strategy: unknown value 'Sliced'; "
        "accepted values: TimeSlicing, MPS"
    ]
    tpl = check(template(obj), template=True)
    assert tpl.invalid[0].startswith("spec.spec.devices.config[0].opaque.parameters.sharing")


def test_unknown_config_field_and_kind_are_reported() -> None:
    obj = claim(
        req("gpu"),
        config=[
            opaque({"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharring": {}}),
            opaque({"apiVersion": CONFIG_API, "kind": "TpuConfig"}),
        ],
    )
    message = check(obj).message
    assert "spec.devices.config[0].opaque.parameters.sharring: unknown field" in message
    assert "spec.devices.config[1].opaque.parameters.kind: unknown 'TpuConfig'" in message


def test_other_drivers_configs_are_ignored() -> None:
    obj = claim(req("gpu"), config=[opaque({"whatever": True}, driver="nic.example.com")])
    assert check(obj).allowed


def test_config_bound_to_a_mig_request_must_be_mig_config() -> None:
    obj = claim(
        req("mig", "mig.nvidia.com"),
        config=[opaque(gpu_config(strategy="TimeSlicing"), requests=["mig"])],
    )
    message = check(obj).message
    assert "spec.devices.config[0].opaque.parameters.kind: GpuConfig cannot configure" in message


def test_disallowed_class_is_forbidden_with_accepted_values() -> None:
    verdict = check(
        claim(req("m", "mig.nvidia.com")), rules(allowedDeviceClasses=["gpu.nvidia.com"])
    )
    assert verdict.forbidden == [
        'spec.devices.requests[0].exactly.deviceClassName: tenant "team-a" (GpuTenant team-a) '
        "does not allow device class mig.nvidia.com; accepted values: gpu.nvidia.com"
    ]
    # Other vendors' classes are not the tenant's concern here.
    assert check(claim(req("n", "nic.example.com")), rules(allowedDeviceClasses=[])).allowed


def test_sharing_mode_rules_point_at_the_config() -> None:
    r = rules(allowedSharing=["Exclusive", "TimeSlicing"])
    mps = claim(req("gpu"), config=[opaque(gpu_config(strategy="MPS"))])
    (line,) = check(mps, r).forbidden
    assert line.startswith("spec.devices.config[0].opaque.parameters.sharing.strategy: ")
    assert "does not allow sharing mode MPS; accepted values: Exclusive, TimeSlicing" in line
    only_shared = rules(allowedSharing=["TimeSlicing"], gpuResource={"sharing": "TimeSlicing"})
    (line,) = check(claim(req("gpu")), only_shared).forbidden
    assert "spec.devices.requests[0].exactly (no sharing config: Exclusive)" in line


def test_a_config_admitted_elsewhere_is_still_held_to_this_tenants_rules() -> None:
    """An escape attempt on the config cache: a config parsed (and kept) for a claim in
    a namespace without rules is checked against the sharing rules of the next
    namespace as if never seen; the cache holds parses, never verdicts."""
    cache = ConfigCache()
    mps = claim(req("gpu"), config=[opaque(gpu_config(strategy="MPS"))])
    assert check(mps, parse_config=cache.parse).allowed
    assert len(cache) == 1
    r = rules(allowedSharing=["Exclusive", "TimeSlicing"])
    (line,) = check(copy.deepcopy(mps), r, parse_config=cache.parse).forbidden
    assert "does not allow sharing mode MPS" in line
    assert len(cache) == 1  # the same parse, judged again


def test_mig_profile_must_be_pinned_to_an_allowed_one() -> None:
    r = rules(allowedMigProfiles=["1g.10gb"])
    sel = [{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].profile == "1g.10gb"'}}]
    assert check(claim(req("m", "mig.nvidia.com", selectors=sel)), r).allowed
    bad = [{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].profile == "7g.80gb"'}}]
    (line,) = check(claim(req("m", "mig.nvidia.com", selectors=bad)), r).forbidden
    assert "selectors: " in line and "does not allow MIG profile 7g.80gb" in line
    (line,) = check(claim(req("m", "mig.nvidia.com")), r).forbidden
    assert "must select one with a CEL selector of the form" in line


def test_a_per_profile_class_pins_its_profile_for_the_tenant_rule() -> None:
    """A claim on a per-profile MIG class is a MIG request of that profile whatever its
    selectors say: a tenant allowed 1g.10gb only cannot take 3g.40gb through its class,
    with or without a selector naming the allowed profile."""
    policy = dataclasses.replace(DEFAULT_POLICY, mig_profile_classes=("1g.10gb", "3g.40gb"))
    classes = driver_classes(policy)
    assert {"mig-1g.10gb.nvidia.com", "mig-3g.40gb.nvidia.com"} <= classes
    tenant = rules(allowedMigProfiles=["1g.10gb"])

    def verdict(obj: dict[str, Any]) -> ClaimVerdict:
        return validate_claim_object(
            obj, template=False, policy=policy, classes=classes, rules=tenant
        )

    assert verdict(claim(req("m", "mig-1g.10gb.nvidia.com"))).allowed
    sel = [{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].profile == "1g.10gb"'}}]
    for selectors in ([], sel):
        (line,) = verdict(claim(req("m", "mig-3g.40gb.nvidia.com", selectors=selectors))).forbidden
        assert line == (
            'spec.devices.requests[0].exactly.deviceClassName: tenant "team-a" (GpuTenant '
            "team-a) does not allow MIG profile 3g.40gb (device class "
            "mig-3g.40gb.nvidia.com); accepted values: 1g.10gb"
        )


def test_devices_per_claim_limit() -> None:
    r = rules(maxDevicesPerPod=4)
    (line,) = check(claim(req("a", count=3), req("b", count=3)), r).forbidden
    assert "maxDevicesPerPod is 4, this claim asks for 6 devices" in line
    all_mode = claim(
        {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}}
    )
    assert "asks for 32 devices" in check(all_mode, r).forbidden[0]
    first = claim(
        {
            "name": "a",
            "firstAvailable": [
                {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 4},
                {"name": "small", "deviceClassName": "gpu.nvidia.com", "count": 2},
            ],
        }
    )
    assert check(first, r).allowed


XID = "gpu.nvidia.com/xid"
LOST = "gpu.nvidia.com/gpu-lost"


def tolerating(*keys: str, cls: str = "gpu.nvidia.com") -> dict[str, Any]:
    """A claim whose one request tolerates `keys` ("": a toleration of every taint)."""
    tolerations = [
        {"key": k, "operator": "Exists", "effect": "NoExecute"} if k else {"operator": "Exists"}
        for k in keys
    ]
    return claim(req("gpu", cls, tolerations=tolerations))


def test_a_tenant_tolerates_only_the_device_taints_its_rules_name() -> None:
    """Health taints and an admin's DeviceTaintRules take devices out of service: a tenant
    whose rules name no taint key tolerates none, so it is never handed an unhealthy or
    reserved device, nor stays on one a NoExecute taint drains."""
    path = "spec.devices.requests[0].exactly.tolerations"
    assert check(tolerating(XID, LOST, "")).allowed  # no tenant: not this webhook's rule
    assert check(tolerating(XID), rules()).forbidden == [
        f'{path}[0]: tenant "team-a" (GpuTenant team-a) does not allow tolerating device '
        f"taint {XID}; accepted keys: none (allowedTaintTolerations)"
    ]
    some = rules(allowedTaintTolerations=[XID])
    assert check(tolerating(XID), some).allowed
    assert check(tolerating(XID, ""), some).forbidden == [
        f'{path}[1]: tenant "team-a" (GpuTenant team-a) does not allow tolerating every '
        f"device taint (no key); accepted keys: {XID} (allowedTaintTolerations)"
    ]
    # One line per request, however many tolerations it carries.
    many = tolerating(XID, LOST, "", *(f"example.com/t{i}" for i in range(1000)))
    assert check(many, some).forbidden == [
        f'{path}[1]: tenant "team-a" (GpuTenant team-a) does not allow tolerating device '
        f"taint {LOST} (and 1001 more); accepted keys: {XID} (allowedTaintTolerations)"
    ]
    assert check(tolerating(XID, LOST, ""), rules(allowedTaintTolerations=["*"])).allowed
    # In a template and in a firstAvailable alternative alike.
    assert check(template(tolerating(LOST)), some, template=True).forbidden
    alternatives = claim(
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "a", "deviceClassName": "gpu.nvidia.com"},
                {
                    "name": "b",
                    "deviceClassName": "mig.nvidia.com",
                    "tolerations": [{"key": LOST, "operator": "Exists"}],
                },
            ],
        }
    )
    (line,) = check(alternatives, some).forbidden
    assert line.startswith("spec.devices.requests[0].firstAvailable[1].tolerations[0]: ")
    # Another vendor's devices are not the tenant rules' concern.
    assert check(tolerating(LOST, cls="nic.example.com"), some).allowed


def test_namespace_denial_applies_to_driver_claims_only() -> None:
    assert check(claim(req("gpu")), denial="ambiguous").forbidden == ["ambiguous"]
    assert check(claim(req("n", "nic.example.com")), denial="ambiguous").allowed


def test_converted_templates_pass_their_own_tenant_rules() -> None:
    r = rules(
        allowedSharing=["TimeSlicing"],
        gpuResource={"sharing": "TimeSlicing", "timeSlicingInterval": "Short"},
        maxDevicesPerPod=2,
    )
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]},
    }
    (tpl,) = convert_pod(pod, r.policy).templates
    assert check(tpl, r, template=True).allowed


# -- sharing resolved as prepare resolves it -----------------------------------------------

SHARED = "gpu-shared.nvidia.com"


def shared_class(**sharing: Any) -> dict[str, Any]:
    """The shared DeviceClass with a sharing config, as the chart renders it."""
    (dc,) = (c for c in device_classes() if c["metadata"]["name"] == SHARED)
    dc["spec"]["config"] = [opaque(gpu_config(**sharing))]
    return dc


def class_view(*objects: dict[str, Any]) -> DeviceClassCache:
    cache = DeviceClassCache(DEFAULT_POLICY.driver)
    cache.replace([*device_classes(), *objects])
    return cache


def memory_slice(name: str = "slice", **extra: Any) -> dict[str, Any]:
    return req(name, SHARED, capacity={"requests": {"memory": "10Gi"}}, **extra)


def test_shared_class_config_decides_the_sharing_mode() -> None:
    classes = class_view(shared_class(strategy="TimeSlicing")).configs
    obj = claim(req("gpu", SHARED))
    (line,) = check(obj, rules(allowedSharing=["Exclusive"]), device_classes=classes).forbidden
    assert line.startswith(
        "DeviceClass gpu-shared.nvidia.com spec.config[0].opaque.parameters.sharing.strategy: "
    )
    assert "does not allow sharing mode TimeSlicing; accepted values: Exclusive" in line
    only_shared = rules(allowedSharing=["TimeSlicing"], gpuResource={"sharing": "TimeSlicing"})
    assert check(obj, only_shared, device_classes=classes).allowed


def test_a_memory_slice_counts_as_mps() -> None:
    classes = class_view(shared_class(strategy="MPS")).configs
    (line,) = check(
        claim(memory_slice()), rules(allowedSharing=["Exclusive"]), device_classes=classes
    ).forbidden
    assert "does not allow sharing mode MPS" in line
    # Even on a class with no config: the slice's memory is enforced by an MPS daemon.
    plain = req("slice", "gpu.nvidia.com", capacity={"requests": {"memory": "10Gi"}})
    (line,) = check(claim(plain), rules(allowedSharing=["Exclusive"])).forbidden
    assert line.startswith("spec.devices.requests[0].exactly.capacity.requests (a memory slice")
    assert "does not allow sharing mode MPS" in line


def test_some_integer_shares_count_as_time_slicing_and_all_of_them_as_the_whole_gpu() -> None:
    """Claims holding some of a GPU's integer shares use it together: prepare time-slices
    a share with no sharing config (or MPS with one), never Exclusive, so an
    Exclusive-only tenant is refused a shares request. As many shares as the GPU has
    give the whole GPU, which runs as the config says: a shares request is judged both
    ways, as a memory request is."""
    share = req("gpu", "gpu.nvidia.com", capacity={"requests": {"shares": "1"}})
    (line,) = check(claim(share), rules(allowedSharing=["Exclusive"])).forbidden
    assert line.startswith(
        "spec.devices.requests[0].exactly.capacity.requests.shares (some of a GPU's integer "
        "shares are time-sliced with the claims holding its other shares)"
    )
    assert "does not allow sharing mode TimeSlicing; accepted values: Exclusive" in line
    sliced_only = rules(allowedSharing=["TimeSlicing"], gpuResource={"sharing": "TimeSlicing"})
    (line,) = check(claim(share), sliced_only).forbidden
    assert "capacity.requests.shares (as many shares as the GPU has give the whole GPU" in line
    assert "does not allow sharing mode Exclusive" in line
    assert check(claim(share), rules(allowedSharing=["Exclusive", "TimeSlicing"])).allowed
    mps = claim(share, config=[opaque(gpu_config(strategy="MPS"))])
    assert check(mps, rules(allowedSharing=["MPS"], gpuResource={"sharing": "MPS"})).allowed


def test_a_capacity_named_with_the_driver_domain_is_judged_as_its_short_name() -> None:
    """From Kubernetes 1.38 the scheduler gives a request for `gpu.nvidia.com/shares` one
    of the shares a GPU publishes as `shares` (kubernetes#142202), and prepare time-slices
    it. Judged by its literal name it would be a memory slice (MPS or the whole GPU),
    which a tenant allowed Exclusive and MPS but not TimeSlicing may have."""
    no_time_slicing = rules(allowedSharing=["Exclusive", "MPS"], gpuResource={"sharing": "MPS"})
    for name in ("shares", "gpu.nvidia.com/shares"):
        share = req("gpu", "gpu.nvidia.com", capacity={"requests": {name: "1"}})
        (line,) = check(claim(share), no_time_slicing).forbidden
        assert line.startswith(
            "spec.devices.requests[0].exactly.capacity.requests.shares (some of a GPU's "
            "integer shares are time-sliced"
        ), name
        assert "does not allow sharing mode TimeSlicing" in line
    # Either spelling of a shared GPU's memory is a memory slice, run under MPS.
    for name in ("memory", "gpu.nvidia.com/memory"):
        asks = req("slice", "gpu.nvidia.com", capacity={"requests": {name: "10Gi"}})
        (line,) = check(claim(asks), rules(allowedSharing=["Exclusive"])).forbidden
        assert "does not allow sharing mode MPS" in line, name


def test_a_capacity_request_is_judged_as_a_slice_and_as_a_whole_device(tmp_path: Path) -> None:
    """A capacity request only filters a device that is not shared, and one for a shared
    GPU's whole memory leaves nothing beside it: the scheduler may give the request a
    whole device, which prepare runs as the config says, not under MPS."""
    asks_memory = req("slice", "gpu.nvidia.com", capacity={"requests": {"memory": "10Gi"}})
    mps_only = rules(allowedSharing=["MPS"], gpuResource={"sharing": "MPS"})
    (line,) = check(claim(asks_memory), mps_only).forbidden
    assert line.startswith(
        "spec.devices.requests[0].exactly.capacity.requests (the scheduler may give this "
        "request a whole device"
    )
    assert "does not allow sharing mode Exclusive; accepted values: MPS" in line
    with_mps = claim(asks_memory, config=[opaque(gpu_config(strategy="MPS"))])
    assert check(with_mps, mps_only).allowed

    # What prepare runs on a whole GPU so allocated: Exclusive without the config, MPS
    # with it. The webhook's verdict covers both.
    inventory = discover(NvmlEmulator(load_builtin_profile("l4")))
    device = inventory.gpus[0].device.name
    for obj, mode in ((claim(asks_memory), "Exclusive"), (with_mps, "MPS")):
        result = {"request": "slice", "driver": "gpu.nvidia.com", "pool": "n", "device": device}
        allocation = {
            "devices": {"results": [result], "config": obj["spec"]["devices"].get("config", [])}
        }
        allocated = {
            **obj,
            "metadata": {**obj["metadata"], "uid": "u"},
            "status": {"allocation": allocation},
        }
        for entry in allocation["devices"]["config"]:
            entry["source"] = "FromClaim"
        (planned,) = plan(
            checked_claim(ClaimRef("ns", "u", "c"), allocated, driver="gpu.nvidia.com", pool="n"),
            inventory=inventory,
            checkpoint=Checkpoint(tmp_path / f"{mode}.json", boot_id="b"),
            pool="n",
            mig_strategy=MigStrategy.STATIC,
        )
        assert ("MPS" if planned.mps else "Exclusive") == mode


def mps_config(**settings: Any) -> dict[str, Any]:
    return gpu_config(strategy="MPS", mpsConfig=settings)


def test_one_claims_mps_configs_agree_on_the_thread_percentage_as_prepare_requires() -> None:
    """One MPS daemon serves the claim: prepare refuses configs that ask for different
    active thread percentages (`planning._check_mps`), so admission refuses them first."""
    a, b = req("a"), req("b")
    differ = claim(
        a,
        b,
        config=[
            opaque(mps_config(defaultActiveThreadPercentage=20), requests=["a"]),
            opaque(mps_config(defaultActiveThreadPercentage=50), requests=["b"]),
        ],
    )
    (line,) = check(differ).invalid
    assert line.startswith("one MPS daemon serves the claim, but its configs ask for different")
    assert "spec.devices.config[1].opaque.parameters.sharing.mpsConfig." in line
    same = copy.deepcopy(differ)
    same["spec"]["devices"]["config"][1]["opaque"]["parameters"] = mps_config(
        defaultActiveThreadPercentage=20
    )
    assert check(same).allowed
    # Alternatives of one request never meet: one of them is allocated.
    alternatives = {
        "name": "gpu",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu.nvidia.com"},
            {"name": "small", "deviceClassName": "gpu.nvidia.com"},
        ],
    }
    either = claim(
        alternatives,
        config=[
            opaque(mps_config(defaultActiveThreadPercentage=20), requests=["gpu/big"]),
            opaque(mps_config(defaultActiveThreadPercentage=50), requests=["gpu/small"]),
        ],
    )
    assert check(either).allowed


def test_a_pinned_memory_index_past_the_devices_of_its_config_is_refused() -> None:
    """An index key counts into the devices its config is given; prepare refuses one
    that names none of them (`MpsConfig.pinned_memory_limits`)."""
    limits = mps_config(defaultPerDevicePinnedMemoryLimit={"1": "1Gi"})
    (line,) = check(claim(req("gpu", count=1), config=[opaque(limits)])).invalid
    assert line.startswith(
        "spec.devices.config[0].opaque.parameters.sharing.mpsConfig."
        "defaultPerDevicePinnedMemoryLimit[1]: names no device this config is sure to be given"
    )
    assert check(claim(req("gpu", count=2), config=[opaque(limits)])).allowed
    assert check(claim(req("a"), req("b"), config=[opaque(limits)])).allowed


def test_a_pinned_memory_limit_beyond_any_gpus_memory_is_refused() -> None:
    """No GPU has a petabyte: a larger limit (`1e100` would reach the MPS daemon as a
    hundred-digit number) is refused at admission, naming the field; the node refuses
    any limit above the memory of the device it is given (`planning.mps_limits`)."""
    for limit in ("1e100", "2Pi", 10**16):
        for limits, field in (
            ({"defaultPinnedDeviceMemoryLimit": limit}, "defaultPinnedDeviceMemoryLimit"),
            (
                {"defaultPerDevicePinnedMemoryLimit": {"0": limit}},
                "defaultPerDevicePinnedMemoryLimit[0]",
            ),
        ):
            (line,) = check(claim(req("gpu"), config=[opaque(mps_config(**limits))])).invalid
            assert line.startswith(
                f"spec.devices.config[0].opaque.parameters.sharing.mpsConfig.{field}: must be "
                "at most 1Pi, more memory than any GPU has"
            ), line
            assert "use at most the memory of the device" in line
    assert check(
        claim(req("gpu"), config=[opaque(mps_config(defaultPinnedDeviceMemoryLimit="1Pi"))])
    ).allowed


def test_time_slicing_on_a_memory_slice_is_refused_as_prepare_refuses_it() -> None:
    obj = claim(memory_slice(), config=[opaque(gpu_config(strategy="TimeSlicing"))])
    (line,) = check(obj).invalid
    assert line.startswith("spec.devices.config[0].opaque.parameters.sharing.strategy: ")
    assert "TimeSlicing cannot apply to spec.devices.requests[0].exactly" in line
    # The class's own time-slicing config reaches the slice too.
    classes = class_view(shared_class(strategy="TimeSlicing")).configs
    (line,) = check(claim(memory_slice()), device_classes=classes).invalid
    assert "DeviceClass gpu-shared.nvidia.com spec.config[0]" in line
    assert "TimeSlicing cannot apply" in line
    mps = claim(memory_slice(), config=[opaque(gpu_config(strategy="MPS"))])
    assert check(mps, device_classes=classes).allowed


def test_an_invalid_class_config_refuses_claims_of_that_class() -> None:
    broken = shared_class(strategy="Sliced")
    classes = class_view(broken).configs
    (line,) = check(claim(req("gpu", SHARED)), device_classes=classes).invalid
    assert line.startswith("spec.devices.requests[0].exactly.deviceClassName: DeviceClass ")
    assert "unknown value 'Sliced'" in line and "cluster admin must fix" in line
    assert check(claim(req("gpu")), device_classes=classes).allowed


def test_device_class_cache_follows_events() -> None:
    cache = class_view()
    assert cache.ready and cache.configs["gpu.nvidia.com"].configs == ()

    def strategy() -> str:
        sharing = cache.configs[SHARED].configs[0].config.sharing
        assert sharing is not None
        return sharing.strategy

    assert strategy() == "TimeSlicing"  # the class as installed
    cache.event("MODIFIED", shared_class(strategy="MPS"))
    assert strategy() == "MPS"
    cache.event("DELETED", shared_class(strategy="MPS"))
    assert SHARED not in cache.configs


# -- type-confused objects ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "field"),
    [
        ({"requests": [], "config": [None]}, "spec.devices.config[0]"),
        ({"requests": [], "config": ["x"]}, "spec.devices.config[0]"),
        ({"requests": [], "config": [{"requests": 5}]}, "spec.devices.config[0].requests"),
        ({"requests": 5}, "spec.devices.requests"),
        (
            {"requests": [{"name": "a", "exactly": {"deviceClassName": "x", "selectors": True}}]},
            "spec.devices.requests[0].exactly.selectors",
        ),
        (
            {"requests": [{"name": "a", "exactly": {"selectors": [{"cel": "x"}]}}]},
            "spec.devices.requests[0].exactly.selectors[0].cel",
        ),
        (
            {"requests": [{"name": "a", "exactly": {"count": "2"}}]},
            "spec.devices.requests[0].exactly.count",
        ),
    ],
)
def test_a_field_of_the_wrong_type_is_invalid_naming_it(devices: Any, field: str) -> None:
    obj = {"metadata": {"name": "c"}, "spec": {"devices": devices}}
    verdict = check(obj, rules(allowedSharing=["Exclusive"]))
    assert not verdict.allowed
    assert any(line.startswith(f"{field}: ") for line in verdict.invalid), verdict.invalid
    # The same types hold in a template, one level down.
    tpl = check({"spec": {"spec": {"devices": devices}}}, template=True)
    assert any(line.startswith(f"spec.{field}: ") for line in tpl.invalid), tpl.invalid
    # The messages say what is accepted, not the name of a class of ours.
    assert not any("instance of" in line for line in [*verdict.invalid, *tpl.invalid])


def test_a_device_class_config_of_the_wrong_type_is_reported_for_the_admin() -> None:
    found = class_configs(
        {"metadata": {"name": "gpu"}, "spec": {"config": [{"requests": "a"}, 5]}},
        DEFAULT_POLICY.driver,
    )
    assert found.error is not None
    assert [str(issue) for issue in found.error.issues] == [
        "DeviceClass gpu spec.config[0].requests: Input should be a valid list (got 'a')",
        "DeviceClass gpu spec.config[1]: Input should be a valid dictionary (got 5)",
    ]


@pytest.mark.anyio
async def test_type_confused_claims_are_answered_400_naming_the_field() -> None:
    endpoints = Admission(_NoTemplates(), WebhookMetrics(CollectorRegistry())).endpoints()
    validate = endpoints[VALIDATE_CLAIMS_PATH]
    bad = claim(req("gpu"), config=[opaque(gpu_config(strategy="Sliced"))])
    bad["metadata"] = ["c"]
    decision = await validate(json.dumps(claim_review(bad)).encode())
    status = decision.response["status"]
    assert (decision.result, status["code"]) == ("denied", 400)
    assert "metadata: " in status["message"]
    null_entry = claim(req("gpu"), config=[None])  # type: ignore[list-item]
    decision = await validate(json.dumps(claim_review(null_entry)).encode())
    assert decision.response["status"]["code"] == 400
    assert "spec.devices.config[0]: " in decision.response["status"]["message"]


@pytest.mark.anyio
async def test_claims_repeating_a_config_have_it_validated_once() -> None:
    configs = ConfigCache()
    admission = Admission(_NoTemplates(), WebhookMetrics(CollectorRegistry()), configs=configs)
    validate = admission.endpoints()[VALIDATE_CLAIMS_PATH]
    shared = opaque(gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}))
    for name in ("a", "b"):
        body = claim(req("gpu"), config=[copy.deepcopy(shared)])
        body["metadata"] = {"name": name}
        decision = await validate(json.dumps(claim_review(body)).encode())
        assert decision.result == "allowed"
    assert len(configs) == 1
    bad = claim(req("gpu"), config=[opaque(gpu_config(strategy="Sliced"))])
    for _ in range(2):  # refused the same way each time, and not kept
        decision = await validate(json.dumps(claim_review(bad)).encode())
        assert decision.response["status"]["code"] == 400
        assert (
            "spec.devices.config[0].opaque.parameters.sharing.strategy"
            in (decision.response["status"]["message"])
        )
    assert len(configs) == 1


class _NoTemplates:
    async def __call__(self, namespace: str, templates: Any, dry_run: bool) -> None:
        raise AssertionError("claim validation writes nothing")


# -- through the server ------------------------------------------------------------------


async def post(port: int, ca: bytes, path: str, body: dict[str, Any]) -> dict[str, Any]:
    context = ssl.create_default_context(cadata=ca.decode())
    tls = await anyio.connect_tcp(
        "127.0.0.1", port, tls=True, ssl_context=context, tls_hostname="127.0.0.1"
    )
    stream = BufferedByteStream(tls)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: w\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    await stream.send(head.encode() + data)
    raw = await stream.receive_until(b"\r\n\r\n", 65536)
    length = next(
        int(line.split(b":")[1])
        for line in raw.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    payload = await stream.receive_exactly(length)
    await anyio.aclose_forcefully(stream)
    result: dict[str, Any] = json.loads(payload)["response"]
    return result


def claim_review(obj: dict[str, Any], kind: str = "ResourceClaim") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind},
            "namespace": "ns",
            "operation": "CREATE",
            "object": obj,
        },
    }


def pod_review(limits: dict[str, str]) -> dict[str, Any]:
    pod = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [{"name": "a", "resources": {"limits": limits}}]},
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u2",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "ns",
            "operation": "CREATE",
            "object": pod,
        },
    }


class NoTemplates:
    async def __call__(self, namespace: str, templates: Any, dry_run: bool) -> None:
        return None


class NoClaims:
    """An empty namespace: no claims, templates or pods to count."""

    async def __call__(self, namespace: str, kind: str, name: str) -> None:
        return None

    async def pods(self, namespace: str, keep: Any) -> list[dict[str, Any]]:
        return []

    async def claims_made_for(self, namespace: str, pod_uids: Any) -> dict[str, Any]:
        return {}

    async def workloads_admitted_with(self, namespace: str, template: str) -> list[str]:
        return []


@pytest.mark.anyio
async def test_server_applies_tenant_rules_and_validates_claims(tmp_path: Path) -> None:
    pki, _ = ensure_pki(tmp_path / "pki", service_dns_names("gpudra-webhook", "gpudra"))
    tenants = TenantState()
    tenants.replace(
        "tenants",
        [
            {
                "apiVersion": API_VERSION,
                "kind": "GpuTenant",
                "metadata": {"name": "team-a"},
                "spec": {"namespaces": ["ns"], "maxDevicesPerPod": 2, "allowedMigProfiles": []},
            }
        ],
    )
    tenants.replace("namespaces", [{"metadata": {"name": "ns"}}])
    config = ServerConfig(
        cert_file=tmp_path / "pki" / "tls.crt",
        key_file=tmp_path / "pki" / "tls.key",
        host="127.0.0.1",
        port=0,
    )
    server = WebhookServer(config, NoTemplates(), tenants=tenants, read_claims=NoClaims())
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        # Quotas not listed yet: GPU pods are denied, not admitted without rules.
        early = await post(port, pki.ca_bundle, "/mutate-pods", pod_review({"nvidia.com/gpu": "1"}))
        assert not early["allowed"] and "has not loaded" in early["status"]["message"]
        tenants.replace("quotas", [])

        ok = await post(port, pki.ca_bundle, "/mutate-pods", pod_review({"nvidia.com/gpu": "2"}))
        assert ok["allowed"] and ok["patchType"] == "JSONPatch"
        big = await post(port, pki.ca_bundle, "/mutate-pods", pod_review({"nvidia.com/gpu": "3"}))
        assert not big["allowed"] and big["status"]["code"] == 403
        assert big["status"]["reason"] == "Forbidden"
        assert "maxDevicesPerPod is 2, this pod asks for 3 devices" in big["status"]["message"]

        bad = claim(req("gpu"), config=[opaque(gpu_config(strategy="Sliced"))])
        denied = await post(port, pki.ca_bundle, "/validate-claims", claim_review(bad))
        assert not denied["allowed"] and denied["status"]["code"] == 400
        assert (
            "spec.devices.config[0].opaque.parameters.sharing.strategy"
            in denied["status"]["message"]
        )
        mig = template(claim(req("m", "mig.nvidia.com")))
        denied = await post(
            port, pki.ca_bundle, "/validate-claims", claim_review(mig, "ResourceClaimTemplate")
        )
        assert not denied["allowed"] and denied["status"]["code"] == 403
        assert denied["status"]["message"].startswith("ResourceClaimTemplate c: spec.spec.devices")
        good = await post(port, pki.ca_bundle, "/validate-claims", claim_review(claim(req("gpu"))))
        assert good["allowed"]
        tg.cancel_scope.cancel()


# --- bounded work: what a hostile review can cost (found by an outside review) -------------


def test_a_review_past_the_api_servers_limits_is_refused_before_any_work() -> None:
    """A review sent straight to the port was checked by no API server: past its limits
    (32 requests, 8 subrequests, 32 configs of 32 request names) it is refused, naming
    the field, before the configs are resolved against the requests (20,000 requests and
    a config bound to 400,000 names held the webhook's loop for minutes)."""
    many = claim(*(req(f"r{i}") for i in range(33)))
    assert "spec.devices.requests: List should have at most 32 items" in check(many).message
    subs = [{"name": f"s{i}", "deviceClassName": "gpu.nvidia.com"} for i in range(9)]
    first_available = claim({"name": "r", "firstAvailable": subs})
    message = check(first_available).message
    assert "spec.devices.requests[0].firstAvailable: List should have at most 8 items" in message
    names = claim(req("r"), config=[opaque(gpu_config(), requests=[f"r{i}" for i in range(33)])])
    message = check(names).message
    assert "spec.devices.config[0].requests: List should have at most 32 items" in message
    configs = claim(req("r"), config=[opaque(gpu_config())] * 33)
    assert "spec.devices.config: List should have at most 32 items" in check(configs).message
    assert check(claim(*(req(f"r{i}") for i in range(32)))).allowed


def test_a_claim_with_thousands_of_bad_fields_gets_a_denial_a_user_can_read() -> None:
    """32 configs of 10 KiB, each with 1,400 unknown fields, as the API server stores
    them: the denial names the first problems and counts the rest (it was 4.8 MB, and
    finding which fields to report compared every pair of them: 17 s)."""
    unknown = {f"x{i:04d}": 0 for i in range(1400)}
    bad = claim(req("r"), config=[opaque({**gpu_config(), **unknown})] * 32)
    verdict = check(bad)
    assert not verdict.allowed
    assert len(verdict.message) < 16 * 1024
    assert "spec.devices.config[0].opaque.parameters" in verdict.message
    assert verdict.message.endswith("more problems")


def test_a_value_nested_a_thousand_deep_is_a_denial_not_a_crash() -> None:
    """Where an object belongs, a list nested 1,000 deep (orjson decodes up to 1,024):
    showing it in the denial must not recurse past Python's limit."""
    deep: Any = []
    for _ in range(1000):
        deep = [deep]
    for obj in (
        claim(deep),
        claim(req("r", capacity={"requests": {"memory": deep}})),
        claim(req("r"), config=[{"requests": deep}]),
    ):
        verdict = check(obj)
        assert verdict.invalid and "(got [[[[" in verdict.message


# --- admitted means preparable: cross-checks with the node's planning ----------------------
# Found by an outside review: each case was admitted here and refused (or run in a mode
# the tenant may not use) by the node.


def planned_on(
    obj: dict[str, Any],
    results: list[tuple[str, str]],
    profile: str | NvmlEmulator,
    tmp_path: Path,
    device_class: dict[str, Any] | None = None,
) -> list[Any]:
    """What the node plans for `obj` allocated as `results` ((request, device) pairs) on
    an emulated `profile` node (or that emulator); `device_class`'s configs are bound by
    the allocator to the requests of that class, as kube-scheduler binds them."""
    emulator = profile if isinstance(profile, NvmlEmulator) else None
    inventory = discover(emulator or NvmlEmulator(load_builtin_profile(str(profile))))
    config = [{**c, "source": "FromClaim"} for c in obj["spec"]["devices"].get("config", [])]
    if device_class is not None:
        name = device_class["metadata"]["name"]
        of_class = [r["name"] for r in obj["spec"]["devices"]["requests"]]
        of_class = [
            n
            for n, r in zip(of_class, obj["spec"]["devices"]["requests"], strict=True)
            if r.get("exactly", {}).get("deviceClassName") == name
        ]
        config = [
            {**c, "source": "FromClass", "requests": of_class}
            for c in device_class["spec"].get("config", [])
        ] + config
    allocation = {
        "devices": {
            "results": [
                {"request": r, "driver": "gpu.nvidia.com", "pool": "n", "device": d}
                for r, d in results
            ],
            "config": config,
        }
    }
    allocated = {
        **obj,
        "metadata": {**obj["metadata"], "uid": "u"},
        "status": {"allocation": allocation},
    }
    return plan(
        checked_claim(ClaimRef("ns", "u", "c"), allocated, driver="gpu.nvidia.com", pool="n"),
        inventory=inventory,
        checkpoint=Checkpoint(tmp_path / f"cp-{len(list(tmp_path.iterdir()))}.json", boot_id="b"),
        pool="n",
        mig_strategy=MigStrategy.DYNAMIC,
    )


def test_a_request_of_an_admins_extra_class_is_judged_as_both_kinds(tmp_path: Path) -> None:
    """A class named with --device-class may select whole GPUs and MIG devices alike: its
    requests are judged as both, so the MIG profile and sharing rules hold for them, and
    a GpuConfig bound to one is refused as the node refuses it on a MIG device."""
    extra = "any-gpu.example.com"
    tenant = rules(
        allowedDeviceClasses=[extra], allowedSharing=["Exclusive"], allowedMigProfiles=["1g.5gb"]
    )
    mig_mps = opaque(
        {"apiVersion": CONFIG_API, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}
    )
    verdict = check(claim(req("gpu", extra), config=[mig_mps]), tenant, classes=CLASSES | {extra})
    assert "allows only MIG profiles 1g.5gb, so a any-gpu.example.com request" in verdict.message
    assert "does not allow sharing mode MPS" in verdict.message
    (planned,) = planned_on(
        claim(req("gpu", extra), config=[mig_mps]),
        [("gpu", "gpu-0-mig-3g20gb-9-4")],
        "a100-40gb-mig-mixed",
        tmp_path,
    )
    assert planned.mps  # what the node would have run, had it been admitted

    bound = claim(req("gpu", extra), config=[opaque(gpu_config(), requests=["gpu"])])
    verdict = check(bound, classes=CLASSES | {extra})
    assert "GpuConfig cannot configure the MIG device" in verdict.message
    assert (
        "its selectors do not pin"
        in check(claim(req("gpu", extra)), tenant, classes=CLASSES | {extra}).message
    )

    # A class whose selectors pin whole GPUs (a class per GPU model) is judged as one.
    def admins_class(expression: str) -> dict[str, Any]:
        selectors = [{"cel": {"expression": expression}}]
        return {"metadata": {"name": extra}, "spec": {"selectors": selectors}}

    whole = 'device.driver == "gpu.nvidia.com" && device.attributes["gpu.nvidia.com"].type == "gpu"'
    view = class_view(admins_class(whole)).configs
    kw: dict[str, Any] = {"classes": CLASSES | {extra}, "device_classes": view}
    assert check(bound, **kw).allowed
    assert check(claim(req("gpu", extra)), tenant, **kw).allowed
    sliced = claim(req("gpu", extra), config=[opaque(gpu_config(strategy="TimeSlicing"))])
    time_slicing = rules(
        allowedDeviceClasses=[extra],
        allowedSharing=["TimeSlicing"],
        gpuResource={"sharing": "TimeSlicing"},
    )
    assert check(sliced, time_slicing, **kw).allowed
    # One it cannot read as pinning the kind (an alternative, a negation, the type's
    # equality under another operator or inside a string) is judged as both: each of
    # these selects MIG devices too.
    pinned = 'device.attributes["gpu.nvidia.com"].type == "gpu"'
    hidden = f'"""a && {pinned} && b"""'
    for loose in (
        f"{whole} || true",
        '!(device.attributes["gpu.nvidia.com"].type == "mig")',
        f"false == (false && {pinned})",
        f"false == (true && false && {pinned} && true)",
        f"{hidden} == {hidden}",
        f'device.attributes["gpu.nvidia.com"].productName == "x" == ({pinned} && false)',
    ):
        view = class_view(admins_class(loose)).configs
        verdict = check(bound, classes=CLASSES | {extra}, device_classes=view)
        assert "GpuConfig cannot configure the MIG device" in verdict.message, loose
    # The equality at the top level still pins, in parentheses or beside them.
    for tight in (f"({pinned})", f'(device.driver == "gpu.nvidia.com") && ({pinned})'):
        view = class_view(admins_class(tight)).configs
        assert check(bound, classes=CLASSES | {extra}, device_classes=view).allowed, tight


def test_one_request_that_may_get_a_gpu_and_a_mig_device_needs_one_mps_percentage(
    tmp_path: Path,
) -> None:
    """A class that does not pin the kind may give one request of several devices a whole
    GPU and a MIG device at once; the claim's one MPS daemon serves both, so the
    GpuConfig's and the MigDeviceConfig's active thread percentages must agree, as the
    node requires (`planning._check_mps`)."""
    extra = "any-gpu.example.com"

    def mps(kind: str, percentage: int) -> dict[str, Any]:
        settings = {"defaultActiveThreadPercentage": percentage}
        sharing = {"strategy": "MPS", "mpsConfig": settings}
        return opaque({"apiVersion": CONFIG_API, "kind": kind, "sharing": sharing})

    differ = [mps("GpuConfig", 20), mps("MigDeviceConfig", 80)]
    obj = claim(req("r", extra, count=2), config=differ)
    (line,) = check(obj, classes=CLASSES | {extra}).invalid
    assert line.startswith(
        "spec.devices.requests[0].exactly: may be given several devices, whole GPUs and MIG "
        "devices together (device class any-gpu.example.com does not pin the kind), and one "
        "MPS daemon serves the claim"
    )
    assert "config[0].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage=20" in line
    assert "config[1].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage=80" in line
    assert line.endswith("; use one value")
    every = req("r", extra, allocationMode="All")
    del every["exactly"]["count"]
    assert not check(claim(every, config=differ), classes=CLASSES | {extra}).allowed
    # What the node does with it, given a whole GPU and a MIG device: refuses it.
    emu = NvmlEmulator(load_builtin_profile("h100-80gb-hbm3-x8"))
    emu.nvmlInit()
    emu.nvmlDeviceSetMigMode(emu.nvmlDeviceGetHandleByIndex(0), 1)
    emu.reset_gpu(0)
    emu.nvmlShutdown()
    with pytest.raises(ClaimError, match="different active thread percentages"):
        planned_on(obj, [("r", "gpu-6"), ("r", "gpu-0-mig-1g10gb-19-6")], emu, tmp_path)
    # One device meets one of the two configs; one percentage serves both kinds.
    assert check(claim(req("r", extra), config=differ), classes=CLASSES | {extra}).allowed
    same = [mps("GpuConfig", 20), mps("MigDeviceConfig", 20)]
    assert check(claim(req("r", extra, count=2), config=same), classes=CLASSES | {extra}).allowed


def mps_multi_user(kind: str = "GpuConfig", multi_user: object = True) -> dict[str, Any]:
    sharing = {"strategy": "MPS", "mpsConfig": {"multiUser": multi_user}}
    return opaque({"apiVersion": CONFIG_API, "kind": kind, "sharing": sharing})


def test_multi_user_mps_is_upstreams_field_and_a_tenants_leave() -> None:
    """`mpsConfig.multiUser` (upstream's, since May 2026) is a JSON boolean, as Go's
    `*bool` takes it. It puts the claim's MPS server in multi-user mode, which NVIDIA's
    MPS guide runs as root for the clients of every user: a GpuTenant's namespaces need
    `allowMpsMultiUser`, whatever gives the config (a claim's, a class's)."""
    obj = claim(req("gpu"), config=[mps_multi_user()])
    assert check(obj).allowed  # no tenant: no rule
    assert check(template(obj), template=True).allowed
    path = "spec.devices.config[0].opaque.parameters.sharing.mpsConfig.multiUser"
    (line,) = check(obj, rules()).forbidden
    assert line == (
        f'{path}: tenant "team-a" (GpuTenant team-a) does not allow multi-user MPS '
        "(allowMpsMultiUser is false): remove multiUser and run the claim's containers as "
        "one user"
    )
    (line,) = check(template(obj), rules(), template=True).forbidden
    assert "does not allow multi-user MPS" in line
    assert check(obj, rules(allowMpsMultiUser=True)).allowed
    assert check(claim(req("gpu"), config=[mps_multi_user(multi_user=False)]), rules()).allowed
    # A request that may resolve two ways (a whole GPU, or a memory slice run under MPS)
    # is denied once for its one config.
    sliced = claim(memory_slice(), config=[mps_multi_user()])
    (line,) = check(sliced, rules()).forbidden
    assert line.startswith(f"{path}: ")
    # An admin's class config is the tenant's rule to apply too.
    classes = class_view(shared_class(strategy="MPS", mpsConfig={"multiUser": True})).configs
    (line,) = check(claim(req("gpu", SHARED)), rules(), device_classes=classes).forbidden
    assert line.startswith(
        "DeviceClass gpu-shared.nvidia.com spec.config[0].opaque.parameters.sharing.mpsConfig"
        ".multiUser: "
    )
    allowed = rules(allowMpsMultiUser=True)
    assert check(claim(req("gpu", SHARED)), allowed, device_classes=classes).allowed
    for wrong in ("true", 1, {}):
        (line,) = check(claim(req("gpu"), config=[mps_multi_user(multi_user=wrong)])).invalid
        assert line == f"{path}: must be true or false (got {wrong!r})"


def test_one_claim_has_one_multi_user_mode(tmp_path: Path) -> None:
    """One MPS daemon serves the claim, so its configs must agree on multi-user mode,
    at admission and on the node (`planning._check_mps`); a config that does not say
    leaves it to the others."""
    extra = "any-gpu.example.com"
    differ = [mps_multi_user("GpuConfig", True), mps_multi_user("MigDeviceConfig", False)]
    obj = claim(req("r", extra, count=2), config=differ)
    (line,) = check(obj, classes=CLASSES | {extra}).invalid
    assert "one MPS daemon serves the claim, but its configs ask for different multi-user " in line
    assert "config[0].opaque.parameters.sharing.mpsConfig.multiUser=true" in line
    assert "config[1].opaque.parameters.sharing.mpsConfig.multiUser=false" in line
    emu = NvmlEmulator(load_builtin_profile("h100-80gb-hbm3-x8"))
    emu.nvmlInit()
    emu.nvmlDeviceSetMigMode(emu.nvmlDeviceGetHandleByIndex(0), 1)
    emu.reset_gpu(0)
    emu.nvmlShutdown()
    results = [("r", "gpu-6"), ("r", "gpu-0-mig-1g10gb-19-6")]
    with pytest.raises(ClaimError, match="different multi-user modes"):
        planned_on(obj, results, emu, tmp_path)
    # The MigDeviceConfig says true and the GpuConfig nothing: one daemon, multi-user.
    unset = opaque(gpu_config(strategy="MPS"))
    quiet = claim(req("r", extra, count=2), config=[unset, mps_multi_user("MigDeviceConfig")])
    assert check(quiet, classes=CLASSES | {extra}).allowed
    assert mps_settings(planned_on(quiet, results, emu, tmp_path)) == {"multiUser": True}


def test_multi_user_mps_needs_a_volta_or_newer_gpu(tmp_path: Path) -> None:
    """NVIDIA's MPS guide runs a multi-user server on Volta or newer (compute capability
    7.0); an older GPU's daemon takes `-M`, then refuses CUDA to every client but root's.
    The node refuses such a claim before anything changes, naming the field. No profile
    of a pre-Volta product is kept: a T4's, with Pascal's compute capability (6.0),
    stands in for one."""
    obj = claim(req("gpu"), config=[mps_multi_user()])
    assert planned_on(obj, [("gpu", "gpu-0")], "t4", tmp_path)  # Turing: 7.5
    t4 = load_builtin_profile("t4")
    pascal = t4.model_copy(
        update={
            "products": {
                name: product.model_copy(update={"cudaComputeCapability": (6, 0)})
                for name, product in t4.products.items()
            }
        }
    )
    with pytest.raises(ClaimError) as refused:
        planned_on(obj, [("gpu", "gpu-0")], NvmlEmulator(pascal), tmp_path)
    message = str(refused.value)
    assert "config[0].opaque.parameters.sharing.mpsConfig.multiUser: GPU GPU-" in message
    assert "has CUDA compute capability 6.0, and multi-user MPS needs Volta or newer" in message
    assert "remove multiUser" in message
    single = claim(req("gpu"), config=[mps_multi_user(multi_user=False)])
    assert planned_on(single, [("gpu", "gpu-0")], NvmlEmulator(pascal), tmp_path)


def test_a_pinned_memory_index_must_name_a_device_whatever_is_allocated(
    tmp_path: Path,
) -> None:
    """An index counts into the fewest devices the config may be given: one for
    `allocationMode: All` (a node may have one GPU), none for an admin-access request
    (it joins no daemon), the smallest of the firstAvailable alternatives."""
    limits = {"defaultPerDevicePinnedMemoryLimit": {"1": "1Gi"}}
    all_mode = req("gpu", allocationMode="All")
    del all_mode["exactly"]["count"]
    small_last = {
        "name": "gpu",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 4},
            {"name": "small", "deviceClassName": "gpu.nvidia.com", "count": 1},
        ],
    }
    for requests in ([all_mode], [req("watch", adminAccess=True), req("work")], [small_last]):
        obj = claim(*requests, config=[opaque(mps_config(**limits))])
        (line,) = check(obj).invalid
        assert "defaultPerDevicePinnedMemoryLimit[1]: names no device this config is sure" in line
    # An alternative that does not use the config gives it no device.
    parent = {
        "name": "a",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 2},
            {"name": "small", "deviceClassName": "gpu.nvidia.com", "count": 1},
        ],
    }
    mps = opaque(
        mps_config(defaultPerDevicePinnedMemoryLimit={"1": "1Gi"}), requests=["a/big", "b"]
    )
    plain = opaque(gpu_config(), requests=["a/small"])
    obj = claim(parent, req("b"), config=[mps, plain])
    assert "names no device this config is sure to be given" in check(obj).message
    with pytest.raises(ClaimError, match="names no device"):
        planned_on(obj, [("a/small", "gpu-0"), ("b", "gpu-1")], "h100-80gb-hbm3-x8", tmp_path)
    # What the node does with the first on a one-GPU node: refuses it.
    obj = claim(all_mode, config=[opaque(mps_config(**limits))])
    with pytest.raises(ClaimError, match="names no device"):
        planned_on(obj, [("gpu", "gpu-0")], "l4", tmp_path)
    assert check(claim(req("gpu", count=2), config=[opaque(mps_config(**limits))])).allowed


def test_a_class_with_a_config_for_each_kind_serves_both(tmp_path: Path) -> None:
    """The allocator binds each of a class's configs to every request of the class; the
    node uses the one of the device's kind, as the webhook does, instead of refusing
    the other (a class that may give GPUs and MIG devices carries one of each)."""
    both = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": SHARED},
        "spec": {
            "selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}],
            "config": [
                opaque(gpu_config(strategy="TimeSlicing")),
                opaque({"apiVersion": CONFIG_API, "kind": "MigDeviceConfig"}),
            ],
        },
    }
    obj = claim(req("a", SHARED))
    assert check(obj, device_classes=class_view(both).configs).allowed
    (planned,) = planned_on(obj, [("a", "gpu-0")], "h100-80gb-hbm3-x8", tmp_path, both)
    assert planned.time_slice is not None
