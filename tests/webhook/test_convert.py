from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from gpudra.api.deviceclasses import mig_profile_class
from gpudra.api.names import is_dns_label
from gpudra.api.tenants import excluded_namespaces
from gpudra.webhook import registration
from gpudra.webhook.convert import (
    DEFAULT_POLICY,
    OPT_OUT_LABEL,
    ConversionError,
    ConversionPolicy,
    DeviceKind,
    convert_pod,
    generated_template_name,
    parse_mig_profile,
)

Patcher = Callable[[Any, Sequence[dict[str, Any]]], Any]


def container(name: str, limits: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "busybox", **extra}
    if limits is not None:
        c["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    return c


def pod(
    *containers: dict[str, Any],
    init: Sequence[dict[str, Any]] = (),
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    p: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {"containers": list(containers), **spec},
    }
    if init:
        p["spec"]["initContainers"] = list(init)
    if labels:
        p["metadata"]["labels"] = labels
    return p


def converted(p: dict[str, Any], apply_patch: Patcher, policy: ConversionPolicy | None = None):
    result = convert_pod(p, policy) if policy else convert_pod(p)
    assert result.changed
    return result, apply_patch(p, result.patch)


def requests_of(template: dict[str, Any]) -> list[tuple[str, int]]:
    return [
        (r["name"], r["exactly"]["count"]) for r in template["spec"]["spec"]["devices"]["requests"]
    ]


def claims(c: dict[str, Any]) -> list[dict[str, str]]:
    return c["resources"]["claims"]


def test_single_container_whole_gpus(apply_patch: Patcher) -> None:
    original = pod(container("train", {"nvidia.com/gpu": "2", "cpu": "4"}))
    result, out = converted(original, apply_patch)

    assert out["spec"]["resourceClaims"] == [
        {"name": "gpudra-gpu", "resourceClaimTemplateName": "gpudra-gpu-2"}
    ]
    train = out["spec"]["containers"][0]
    assert train["resources"]["limits"] == {"cpu": "4"}
    assert train["resources"]["requests"] == {"cpu": "4"}
    assert claims(train) == [{"name": "gpudra-gpu"}]
    (template,) = result.templates
    assert template["apiVersion"] == "resource.k8s.io/v1"
    assert template["kind"] == "ResourceClaimTemplate"
    assert template["metadata"]["name"] == "gpudra-gpu-2"
    assert "namespace" not in template["metadata"]  # the server's namespace applies
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request == {
        "name": "part-0",
        "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "allocationMode": "ExactCount",
            "count": 2,
        },
    }
    assert [(c.kind, c.devices) for c in result.claims] == [(DeviceKind.GPU, 2)]
    assert original["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_limits_only_as_the_device_plugin_wants(apply_patch: Patcher) -> None:
    c = {"name": "a", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    _, out = converted(pod(c), apply_patch)
    assert out["spec"]["containers"][0]["resources"] == {
        "limits": {},
        "claims": [{"name": "gpudra-gpu"}],
    }


def test_multiple_containers_get_their_own_requests(apply_patch: Patcher) -> None:
    result, out = converted(
        pod(
            container("a", {"nvidia.com/gpu": "1"}),
            container("sidecar-less", {"cpu": "1"}),
            container("b", {"nvidia.com/gpu": "2"}),
        ),
        apply_patch,
    )
    (template,) = result.templates
    assert template["metadata"]["name"] == "gpudra-gpu-1-2"
    assert requests_of(template) == [("part-0", 1), ("part-1", 2)]
    a, plain, b = out["spec"]["containers"]
    assert claims(a) == [{"name": "gpudra-gpu", "request": "part-0"}]
    assert "claims" not in plain["resources"]
    assert claims(b) == [{"name": "gpudra-gpu", "request": "part-1"}]
    assert result.claims[0].devices == 3


def test_init_container_reuses_app_devices(apply_patch: Patcher) -> None:
    result, out = converted(
        pod(
            container("a", {"nvidia.com/gpu": "1"}),
            container("b", {"nvidia.com/gpu": "1"}),
            init=[container("setup", {"nvidia.com/gpu": "2"})],
        ),
        apply_patch,
    )
    (template,) = result.templates
    assert requests_of(template) == [("part-0", 1), ("part-1", 1)]
    assert result.claims[0].devices == 2  # max(2, 1 + 1), not 4
    assert claims(out["spec"]["initContainers"][0]) == [{"name": "gpudra-gpu"}]
    a, b = out["spec"]["containers"]
    assert claims(a) == [{"name": "gpudra-gpu", "request": "part-0"}]
    assert claims(b) == [{"name": "gpudra-gpu", "request": "part-1"}]


def test_init_container_larger_than_the_app_containers(apply_patch: Patcher) -> None:
    result, out = converted(
        pod(
            container("app", {"nvidia.com/gpu": "1"}),
            init=[container("warmup", {"nvidia.com/gpu": "3"})],
        ),
        apply_patch,
    )
    assert requests_of(result.templates[0]) == [("part-0", 1), ("part-1", 2)]
    assert result.claims[0].devices == 3
    assert claims(out["spec"]["initContainers"][0]) == [{"name": "gpudra-gpu"}]
    assert claims(out["spec"]["containers"][0]) == [{"name": "gpudra-gpu", "request": "part-0"}]


def test_sidecars_keep_their_devices_and_init_containers_after_them_do_not_reuse_them(
    apply_patch: Patcher,
) -> None:
    # init-a runs alone; the sidecar keeps running through init-b and the app.
    # Device-plugin/Kubernetes rule: max(1, 2 + 1, 1 + 1) = 3 devices.
    result, out = converted(
        pod(
            container("app", {"nvidia.com/gpu": "1"}),
            init=[
                container("init-a", {"nvidia.com/gpu": "1"}),
                container("proxy", {"nvidia.com/gpu": "1"}, restartPolicy="Always"),
                container("init-b", {"nvidia.com/gpu": "2"}),
            ],
        ),
        apply_patch,
    )
    assert result.claims[0].devices == 3
    assert requests_of(result.templates[0]) == [("part-0", 1), ("part-1", 1), ("part-2", 1)]
    init_a, proxy, init_b = out["spec"]["initContainers"]
    (app,) = out["spec"]["containers"]
    ref = {"name": "gpudra-gpu"}
    assert claims(proxy) == [{**ref, "request": "part-0"}]
    assert claims(app) == [{**ref, "request": "part-1"}]
    assert claims(init_a) == [{**ref, "request": "part-0"}]  # reuses the not-yet-started sidecar
    assert claims(init_b) == [{**ref, "request": "part-1"}, {**ref, "request": "part-2"}]
    sidecar_parts = {r["request"] for r in claims(proxy)}
    assert sidecar_parts.isdisjoint(r["request"] for r in claims(init_b))
    assert sidecar_parts.isdisjoint(r["request"] for r in claims(app))


def test_mig_devices_select_the_profile(apply_patch: Patcher) -> None:
    result, out = converted(
        pod(container("infer", {"nvidia.com/mig-1g.10gb": "2"})),
        apply_patch,
    )
    (template,) = result.templates
    assert template["metadata"]["name"] == "gpudra-mig-1g10gb-2"
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mig.nvidia.com"
    assert request["exactly"]["count"] == 2
    assert request["exactly"]["selectors"] == [
        {"cel": {"expression": 'device.attributes["gpu.nvidia.com"].profile == "1g.10gb"'}}
    ]
    assert out["spec"]["resourceClaims"][0]["name"] == "gpudra-mig-1g10gb"
    assert out["spec"]["containers"][0]["resources"]["limits"] == {}


@pytest.mark.parametrize(
    ("profile", "claim_name"),
    [
        ("1g.10gb+me", "gpudra-mig-1g10gbme"),
        ("1g.24gb-me", "gpudra-mig-1g24gbnome"),
        ("1g.24gb+me.all", "gpudra-mig-1g24gbmeall"),
        ("3g.40gb", "gpudra-mig-3g40gb"),
        ("7g.141gb", "gpudra-mig-7g141gb"),
        ("1c.3g.40gb", "gpudra-mig-1c3g40gb"),
    ],
)
def test_mig_profile_suffixes_get_distinct_names(profile: str, claim_name: str) -> None:
    result = convert_pod(pod(container("c", {f"nvidia.com/mig-{profile}": "1"})))
    assert result.claims[0].pod_claim_name == claim_name
    assert result.claims[0].profile == profile
    assert result.templates[0]["metadata"]["name"] == f"{claim_name}-1"


# A resource name (k8s.io/apimachinery IsQualifiedName, the part after the prefix).
_RESOURCE_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


@pytest.mark.parametrize(
    ("resource", "profile"),
    [
        ("nvidia.com/mig-1g.10gb", "1g.10gb"),
        ("nvidia.com/mig-1g.10gb.me", "1g.10gb+me"),
        ("nvidia.com/mig-1g.24gb.me.all", "1g.24gb+me.all"),
        ("nvidia.com/mig-1g.10gb.gfx", "1g.10gb+gfx"),
        ("nvidia.com/mig-4g.40gb.gfx", "4g.40gb+gfx"),
        ("nvidia.com/mig-1g.24gb-me", "1g.24gb-me"),
    ],
)
def test_mig_resources_as_the_device_plugin_names_them(
    resource: str, profile: str, apply_patch: Patcher
) -> None:
    """The device plugin names a profile's resource with each "+" spelled "." (no "+" is
    allowed in a resource name); the claim selects the profile by the name the driver
    publishes, and a per-profile class is the profile's."""
    assert _RESOURCE_NAME.fullmatch(resource.removeprefix("nvidia.com/"))
    result, out = converted(pod(container("infer", {resource: "1"})), apply_patch)
    (claim,) = result.claims
    assert (claim.kind, claim.profile, claim.resources) == (DeviceKind.MIG, profile, (resource,))
    (request,) = result.templates[0]["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["selectors"] == [
        {"cel": {"expression": f'device.attributes["gpu.nvidia.com"].profile == "{profile}"'}}
    ]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {}
    policy = ConversionPolicy(mig_profile_classes=(profile,))
    (own,) = convert_pod(pod(container("infer", {resource: "1"})), policy).claims
    assert own.device_class == mig_profile_class(profile)


def test_both_spellings_of_a_profile_are_one_claim() -> None:
    """The device plugin's spelling and the profile's own ask for the same devices: one
    claim holds both, and no more than one claim may hold."""
    both = {"nvidia.com/mig-1g.10gb.me": "1", "nvidia.com/mig-1g.10gb+me": "2"}
    (claim,) = convert_pod(pod(container("infer", both))).claims
    assert (claim.profile, claim.devices, claim.resources) == ("1g.10gb+me", 3, tuple(sorted(both)))
    over = {"nvidia.com/mig-1g.10gb.me": "20", "nvidia.com/mig-1g.10gb+me": "20"}
    assert "at most 32" in _error(pod(container("infer", over)))


def test_a_profile_with_its_own_class_is_converted_to_that_class(apply_patch: Patcher) -> None:
    """With per-profile MIG classes, a converted MIG claim requests its profile's class,
    so a quota per class (Kueue's deviceClassMappings) counts it under that profile;
    other profiles keep the MIG class, and the template is still recognised as ours."""
    policy = ConversionPolicy(mig_profile_classes=("1g.10gb", "1g.10gb+me"))
    limits = {"nvidia.com/mig-1g.10gb+me": "1", "nvidia.com/mig-3g.40gb": "1"}
    result, _out = converted(pod(container("infer", limits)), apply_patch, policy)
    classes = {c.profile: c.device_class for c in result.claims}
    assert classes == {"1g.10gb+me": "mig-1g.10gb-me.nvidia.com", "3g.40gb": "mig.nvidia.com"}
    for template in result.templates:
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] in classes.values()
        spec = template["spec"]["spec"]
        assert generated_template_name(spec, policy) == template["metadata"]["name"]
    with pytest.raises(ValueError, match=r"'1g\.10gb\+ME' is not a MIG profile"):
        ConversionPolicy(mig_profile_classes=("1g.10gb+ME",))


def test_shared_gpu_gets_time_slicing_config(apply_patch: Patcher) -> None:
    result, out = converted(pod(container("nb", {"nvidia.com/gpu.shared": "1"})), apply_patch)
    (template,) = result.templates
    assert template["metadata"]["name"] == "gpudra-gpu-shared-1"
    devices = template["spec"]["spec"]["devices"]
    # One share of a GPU published with shares first; a whole GPU only where none is free.
    assert devices["requests"] == [
        {
            "name": "part-0",
            "firstAvailable": [
                {
                    "name": "share",
                    "deviceClassName": "gpu-shared.nvidia.com",
                    "allocationMode": "ExactCount",
                    "count": 1,
                    "capacity": {"requests": {"shares": "1"}},
                },
                {
                    "name": "gpu",
                    "deviceClassName": "gpu-shared.nvidia.com",
                    "allocationMode": "ExactCount",
                    "count": 1,
                },
            ],
        }
    ]
    assert devices["config"] == [
        {
            "opaque": {
                "driver": "gpu.nvidia.com",
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {
                        "strategy": "TimeSlicing",
                        "timeSlicingConfig": {"interval": "Default"},
                    },
                },
            }
        }
    ]
    assert claims(out["spec"]["containers"][0]) == [{"name": "gpudra-gpu-shared"}]
    assert generated_template_name(template["spec"]["spec"], DEFAULT_POLICY) == (
        "gpudra-gpu-shared-1"
    )


def test_without_the_whole_gpu_fallback_a_shared_gpu_is_a_share_or_nothing(
    apply_patch: Patcher,
) -> None:
    """Kueue counts only `exactly` requests (a `firstAvailable` claim leaves a queued pod
    inadmissible) and charges its count as that many `nvidia.com/gpu.shared`: the request
    is the share alone, one share per device, so no unit is ever a whole GPU."""
    share_only = ConversionPolicy(shared_whole_gpu_fallback=False)
    p = pod(
        container("a", {"nvidia.com/gpu.shared": "2"}),
        container("b", {"nvidia.com/gpu.shared": "1"}),
    )
    result, out = converted(p, apply_patch, share_only)
    (template,) = result.templates
    share = {
        "deviceClassName": "gpu-shared.nvidia.com",
        "allocationMode": "ExactCount",
        "capacity": {"requests": {"shares": "1"}},
    }
    devices = template["spec"]["spec"]["devices"]
    assert devices["requests"] == [
        {"name": "part-0", "exactly": {**share, "count": 2}},
        {"name": "part-1", "exactly": {**share, "count": 1}},
    ]
    # The same sharing config as with the fallback.
    default_devices = convert_pod(p).templates[0]["spec"]["spec"]["devices"]
    assert devices["config"] == default_devices["config"]
    (claim,) = result.claims
    assert (claim.kind, claim.devices, claim.device_class) == (
        DeviceKind.SHARED,
        3,
        "gpu-shared.nvidia.com",
    )
    # Other content than the default's: its own name, bound to it.
    name = template["metadata"]["name"]
    assert re.fullmatch(r"gpudra-gpu-shared-2-1-[0-9a-f]{8}", name), name
    assert generated_template_name(template["spec"]["spec"], share_only) == name
    assert generated_template_name(template["spec"]["spec"], DEFAULT_POLICY) is None
    assert generated_template_name(convert_pod(p).templates[0]["spec"]["spec"], share_only) is None
    assert out["spec"]["resourceClaims"] == [
        {"name": "gpudra-gpu-shared", "resourceClaimTemplateName": name}
    ]
    assert convert_pod(out, share_only).patch == ()  # reinvocation: already converted
    # Whole GPUs and MIG devices are not shared: their templates do not change.
    other = pod(container("a", {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}))
    assert convert_pod(other, share_only).templates == convert_pod(other).templates
    # A plain nvidia.com/gpu made shared (a GpuTenant's gpuResource) loses it too.
    mapped = ConversionPolicy(gpu_resource_kind=DeviceKind.SHARED, shared_whole_gpu_fallback=False)
    (template,) = convert_pod(pod(container("a", {"nvidia.com/gpu": "1"})), mapped).templates
    assert template["spec"]["spec"]["devices"]["requests"] == [
        {"name": "part-0", "exactly": {**share, "count": 1}}
    ]


def test_converted_pods_say_what_became_what(apply_patch: Patcher) -> None:
    _, out = converted(
        pod(
            container("a", {"nvidia.com/gpu": "2"}),
            container("b", {"nvidia.com/gpu.shared": "1", "nvidia.com/mig-1g.10gb": "1"}),
            container("c", {"nvidia.com/gpu.shared": "2"}),
        ),
        apply_patch,
    )
    assert out["metadata"]["annotations"] == {
        "gpudra.nvidia.com/converted": (
            "nvidia.com/gpu: 2 -> claim gpudra-gpu (template gpudra-gpu-2, class "
            "gpu.nvidia.com, 2 GPUs whole, sharing Exclusive); "
            "nvidia.com/mig-1g.10gb: 1 -> claim gpudra-mig-1g10gb (template "
            "gpudra-mig-1g10gb-1, class mig.nvidia.com, 1 MIG device whole, sharing Exclusive); "
            "nvidia.com/gpu.shared: 3 -> claim gpudra-gpu-shared (template "
            "gpudra-gpu-shared-1-2, class gpu-shared.nvidia.com, 3 GPUs one share each, "
            "sharing TimeSlicing/Default)"
        )
    }
    # Annotations the pod already has are kept.
    p = pod(container("a", {"nvidia.com/gpu.shared": "1"}))
    p["metadata"]["annotations"] = {"team": "ml"}
    policy = ConversionPolicy(gpu_resource_kind=DeviceKind.SHARED, shared_strategy="MPS")
    _, out = converted(p, apply_patch, policy)
    assert out["metadata"]["annotations"] == {
        "team": "ml",
        "gpudra.nvidia.com/converted": (
            "nvidia.com/gpu.shared: 1 -> claim gpudra-gpu-shared (template "
            f"{out['spec']['resourceClaims'][0]['resourceClaimTemplateName']}, class "
            "gpu-shared.nvidia.com, 1 GPU one share each, sharing MPS)"
        ),
    }


def test_policy_can_map_plain_gpus_to_shared() -> None:
    policy = ConversionPolicy(gpu_resource_kind=DeviceKind.SHARED)
    result = convert_pod(
        pod(
            container("a", {"nvidia.com/gpu": "1"}),
            container("b", {"nvidia.com/gpu.shared": "1"}),
        ),
        policy,
    )
    (claim,) = result.claims
    assert claim.kind is DeviceKind.SHARED
    assert claim.devices == 2
    assert result.templates[0]["metadata"]["name"] == "gpudra-gpu-shared-1-1"


def test_mixed_device_types_get_one_claim_each(apply_patch: Patcher) -> None:
    result, out = converted(
        pod(container("c", {"nvidia.com/gpu": "1", "nvidia.com/mig-2g.20gb": "1"})),
        apply_patch,
    )
    assert [t["metadata"]["name"] for t in result.templates] == [
        "gpudra-gpu-1",
        "gpudra-mig-2g20gb-1",
    ]
    assert claims(out["spec"]["containers"][0]) == [
        {"name": "gpudra-gpu"},
        {"name": "gpudra-mig-2g20gb"},
    ]
    assert [c["name"] for c in out["spec"]["resourceClaims"]] == [
        "gpudra-gpu",
        "gpudra-mig-2g20gb",
    ]


def test_generate_name_pod_converts_without_a_name(apply_patch: Patcher) -> None:
    p = pod(container("c", {"nvidia.com/gpu": "1"}))
    p["metadata"] = {"generateName": "job-"}
    _, out = converted(p, apply_patch)
    # Only a template reference: the claim gets its name and owner from the pod later.
    assert out["spec"]["resourceClaims"] == [
        {"name": "gpudra-gpu", "resourceClaimTemplateName": "gpudra-gpu-1"}
    ]


def test_identical_shapes_share_one_template() -> None:
    one = convert_pod(pod(container("x", {"nvidia.com/gpu": "2"})))
    other = convert_pod(pod(container("y", {"nvidia.com/gpu": "2", "memory": "1Gi"})))
    assert one.templates == other.templates


def test_reinvocation_of_a_converted_pod_is_a_no_op(apply_patch: Patcher) -> None:
    _, out = converted(
        pod(
            container("a", {"nvidia.com/gpu": "1"}),
            init=[container("i", {"nvidia.com/gpu": "1"})],
        ),
        apply_patch,
    )
    again = convert_pod(out)
    assert again.patch == ()
    assert again.templates == ()
    assert not again.changed
    assert again.skipped == "already converted"


def test_existing_claims_are_kept_and_ours_appended(apply_patch: Patcher) -> None:
    nic = {"name": "nic", "resourceClaimTemplateName": "rdma"}
    c = container("a", {"nvidia.com/gpu": "1"})
    c["resources"]["claims"] = [{"name": "nic"}]
    _, out = converted(pod(c, resourceClaims=[nic]), apply_patch)
    assert out["spec"]["resourceClaims"] == [
        nic,
        {"name": "gpudra-gpu", "resourceClaimTemplateName": "gpudra-gpu-1"},
    ]
    assert claims(out["spec"]["containers"][0]) == [{"name": "nic"}, {"name": "gpudra-gpu"}]


def test_opt_out_label_leaves_the_pod_alone() -> None:
    p = pod(container("a", {"nvidia.com/gpu": "1"}), labels={OPT_OUT_LABEL: "false"})
    result = convert_pod(p)
    assert result.patch == ()
    assert "opted out" in result.skipped
    # Opting out skips validation too: the pod is not ours to judge.
    bad = pod(container("a", {"nvidia.com/gpu": "-1"}), labels={OPT_OUT_LABEL: "false"})
    assert convert_pod(bad).patch == ()


def test_pod_without_gpu_resources_is_untouched() -> None:
    p = pod(
        container("web", {"cpu": "1", "memory": "1Gi"}),
        container("nic", {"nvidia.com/hostdev": "1", "nvidia.com/rdma_shared_device_a": "1"}),
    )
    result = convert_pod(p)
    assert result.patch == ()
    assert result.templates == ()
    assert convert_pod(pod(container("bare"))).patch == ()


def test_zero_gpus_are_removed_without_a_claim(apply_patch: Patcher) -> None:
    result, out = converted(pod(container("a", {"nvidia.com/gpu": "0"})), apply_patch)
    assert result.templates == ()
    assert "resourceClaims" not in out["spec"]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {}


@pytest.mark.parametrize("value", ["2", 2, 2.0, "2e0", "2000m", " 2 "])
def test_count_forms_the_api_server_accepts(value: Any) -> None:
    result = convert_pod(pod({"name": "a", "resources": {"limits": {"nvidia.com/gpu": value}}}))
    assert result.claims[0].devices == 2


def test_policy_content_changes_give_new_template_names() -> None:
    p = pod(container("a", {"nvidia.com/gpu.shared": "1"}))
    default = convert_pod(p).templates[0]["metadata"]["name"]
    short = convert_pod(p, ConversionPolicy(time_slice_interval="Short"))
    name = short.templates[0]["metadata"]["name"]
    assert default == "gpudra-gpu-shared-1"
    assert re.fullmatch(r"gpudra-gpu-shared-1-[0-9a-f]{8}", name)
    # The shared template is affected by the interval, whole-GPU templates are not.
    gpu = convert_pod(
        pod(container("a", {"nvidia.com/gpu": "1"})), ConversionPolicy(time_slice_interval="Short")
    )
    assert gpu.templates[0]["metadata"]["name"] == "gpudra-gpu-1"


def test_names_stay_dns_labels_within_63_characters() -> None:
    many = [container(f"c{i}", {"nvidia.com/mig-1c.7g.141gb+me.all": "1"}) for i in range(30)]
    result = convert_pod(pod(*many))
    for template in result.templates:
        name = template["metadata"]["name"]
        assert len(name) <= 63
        assert is_dns_label(name)
    assert len(result.templates[0]["spec"]["spec"]["devices"]["requests"]) == 30
    for entry in result.claims:
        assert is_dns_label(entry.pod_claim_name)


def test_custom_prefix_is_used_for_names_and_detection(apply_patch: Patcher) -> None:
    policy = ConversionPolicy(name_prefix="acme")
    result, out = converted(pod(container("a", {"nvidia.com/gpu": "1"})), apply_patch, policy)
    assert result.templates[0]["metadata"]["name"] == "acme-gpu-1"
    assert convert_pod(out, policy).patch == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_resource_kind": DeviceKind.MIG}, "gpu_resource_kind"),
        ({"time_slice_interval": "Forever"}, "time_slice_interval"),
        ({"name_prefix": "Bad_Prefix"}, "name_prefix"),
        ({"max_devices_per_claim": 64}, "max_devices_per_claim"),
    ],
)
def test_policy_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConversionPolicy(**kwargs)


# --- bad input: every message names the container, the resource and the fix ---


def _error(p: dict[str, Any]) -> str:
    with pytest.raises(ConversionError) as info:
        convert_pod(p)
    return str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("-1", "negative"),
        (-1, "negative"),
        ("1.5", "not a whole number"),
        (1.5, "not a whole number"),
        ("500m", "not a whole number"),
        ("two", "not a quantity"),
        ("", "must not be empty"),
        (True, "true"),
        (None, "null"),
        ([1], "[1]"),
        (float("inf"), "inf"),
    ],
)
def test_bad_counts(value: Any, expected: str) -> None:
    message = _error(pod({"name": "train", "resources": {"limits": {"nvidia.com/gpu": value}}}))
    assert 'container "train"' in message
    assert 'limits["nvidia.com/gpu"]' in message
    assert expected in message
    assert "whole numbers of devices" in message


def test_gpu_in_requests_but_not_limits() -> None:
    message = _error(pod({"name": "train", "resources": {"requests": {"nvidia.com/gpu": "1"}}}))
    assert 'container "train"' in message
    assert '"nvidia.com/gpu" is set in resources.requests but not in resources.limits' in message
    assert 'set limits["nvidia.com/gpu"]' in message


def test_requests_must_equal_limits() -> None:
    c = {
        "name": "train",
        "resources": {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "1"}},
    }
    message = _error(pod(c))
    assert 'container "train"' in message
    assert 'requests["nvidia.com/gpu"] is 1 but limits["nvidia.com/gpu"] is 2' in message
    assert "make them equal" in message


@pytest.mark.parametrize(
    "profile",
    [
        "1g",
        "big",
        "1g.10GB",
        "8g.80gb",
        "1g.10gb+xx",
        "1g.0gb",
        "1g.10gb.xx",
        "1g.10gb.me.me",
        "1g.10gb.shared",
        "1g.10gb.me.shared",
        ".me",
    ],
)
def test_unknown_mig_profile(profile: str) -> None:
    message = _error(pod(container("infer", {f"nvidia.com/mig-{profile}": "1"})))
    assert 'container "infer"' in message
    assert f'unknown MIG profile "{profile}"' in message
    assert "for example" in message


def test_parse_mig_profile() -> None:
    assert parse_mig_profile("1g.10gb+me") == "1g.10gb+me"
    assert parse_mig_profile("1g.10gb.me") == "1g.10gb+me"
    assert parse_mig_profile("1g.24gb.me.all") == "1g.24gb+me.all"
    assert parse_mig_profile("1g.10gb.gfx") == "1g.10gb+gfx"
    assert parse_mig_profile("1g.24gb-me") == "1g.24gb-me"
    with pytest.raises(ConversionError, match="unknown MIG profile"):
        parse_mig_profile("10gb")


def test_too_many_devices_in_one_container() -> None:
    message = _error(pod(container("big", {"nvidia.com/gpu": "33"})))
    assert 'container "big"' in message
    assert "33 devices" in message
    assert "at most 32" in message
    assert "lower the count" in message
    assert "at most" in _error(pod(container("k", {"nvidia.com/gpu": "1k"})))


def test_too_many_devices_in_one_pod() -> None:
    message = _error(
        pod(container("a", {"nvidia.com/gpu": "20"}), container("b", {"nvidia.com/gpu": "20"}))
    )
    assert 'needs 40 devices for "nvidia.com/gpu"' in message
    assert "at most 32" in message
    # Init containers reuse: 20 + 12 app devices and a 30-device init container fit.
    ok = convert_pod(
        pod(
            container("a", {"nvidia.com/gpu": "20"}),
            container("b", {"nvidia.com/gpu": "12"}),
            init=[container("i", {"nvidia.com/gpu": "30"})],
        )
    )
    assert ok.claims[0].devices == 32


def test_a_pod_left_to_the_device_plugin_is_counted_past_what_a_claim_holds() -> None:
    """Where the device plugin serves a pod, no claim is made: the tenant rules' view
    counts every device it asks for, as the device plugin would hand them out, past
    what one claim holds and under MIG names gpudra cannot read, and writes nothing."""
    left = ConversionPolicy(left_to_device_plugin=True)
    big = pod(
        container("a", {"nvidia.com/gpu": "20", "nvidia.com/mig-1g.5gb": "40"}),
        container("b", {"nvidia.com/gpu": "20", "nvidia.com/mig-1g.5gb.shared": "2"}),
        init=[container("i", {"nvidia.com/gpu": "50", "nvidia.com/mig-1g.10gb.me": "3"})],
    )
    for unreadable in ({"nvidia.com/gpu": "40"}, {"nvidia.com/mig-1g.5gb.shared": "1"}):
        with pytest.raises(ConversionError):
            convert_pod(pod(container("a", unreadable)))
    view = convert_pod(big, left)
    assert (view.patch, view.templates, view.skipped) == ((), (), "left to the device plugin")
    counted = {(c.kind, c.profile, c.device_class, c.devices) for c in view.claims}
    assert counted == {
        (DeviceKind.GPU, "", "gpu.nvidia.com", 50),
        (DeviceKind.MIG, "1g.5gb", "mig.nvidia.com", 40),
        (DeviceKind.MIG, "1g.5gb.shared", "mig.nvidia.com", 2),
        (DeviceKind.MIG, "1g.10gb+me", "mig.nvidia.com", 3),
    }
    # What the API server refuses in any pod is refused here too.
    with pytest.raises(ConversionError, match="not a whole number"):
        convert_pod(pod(container("a", {"nvidia.com/mig-1g.5gb.shared": "0.5"})), left)


def test_init_container_errors_name_the_init_container() -> None:
    message = _error(pod(container("a"), init=[container("prep", {"nvidia.com/gpu": "-2"})]))
    assert 'init container "prep"' in message


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda p: p.__setitem__("spec", []), "spec must be an object"),
        (lambda p: p["spec"].__setitem__("containers", {}), "spec.containers must be a list"),
        (lambda p: p["spec"]["containers"].append("x"), "spec.containers[1] must be an object"),
        (
            lambda p: p["spec"]["containers"][0]["resources"].__setitem__("limits", []),
            'container "a": resources.limits must be an object',
        ),
        (lambda p: p["spec"].__setitem__("resourceClaims", {}), "spec.resourceClaims"),
    ],
)
def test_malformed_pods(mutate: Callable[[dict[str, Any]], None], expected: str) -> None:
    p = copy.deepcopy(pod(container("a", {"nvidia.com/gpu": "1"})))
    mutate(p)
    assert expected in _error(p)


def test_resources_a_device_class_maps_itself_are_left_to_the_scheduler(
    apply_patch: Patcher,
) -> None:
    native = ConversionPolicy(native_resources=frozenset({"nvidia.com/gpu"}))
    only_native = pod(container("a", {"nvidia.com/gpu": "1"}))
    assert not convert_pod(only_native, native).changed

    mixed = pod(container("a", {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}))
    result, out = converted(mixed, apply_patch, native)
    assert [c.kind for c in result.claims] == [DeviceKind.MIG]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_registration_skips_pods_that_only_ask_for_native_resources() -> None:
    config = registration.mutating_configuration(
        ca_bundle_b64="",
        own_namespace="gpudra",
        url="https://127.0.0.1:1",
        native_resources=["nvidia.com/gpu"],
    )
    [condition] = config["webhooks"][0]["matchConditions"]
    assert "k != 'nvidia.com/gpu'" in condition["expression"]
    assert condition["expression"].count("k.startsWith('nvidia.com/')") == 3
    default = registration.mutating_configuration(
        ca_bundle_b64="", own_namespace="gpudra", url="https://127.0.0.1:1"
    )
    assert default["webhooks"][0]["matchConditions"][0]["expression"] == registration.GPU_POD_CEL


def test_registrations_leave_out_the_namespaces_the_webhook_never_reviews() -> None:
    """Every webhook of both registrations leaves out exactly `excluded_namespaces`,
    which the webhook ignores a review for and no default tenant governs: the system's
    first, then gpudra's own, as the chart lists them. Were the two lists to part, the
    API server would send reviews the webhook drops, or skip namespaces its rules govern."""
    for own in ("gpudra", "gpu-system"):
        mutating = registration.mutating_configuration(
            ca_bundle_b64="", own_namespace=own, url="https://127.0.0.1:1"
        )
        validating = registration.validating_configuration(
            ca_bundle_b64="",
            own_namespace=own,
            device_classes=["gpu.nvidia.com"],
            driver="gpu.nvidia.com",
            url="https://127.0.0.1:1",
        )
        hooks = [*mutating["webhooks"], *validating["webhooks"]]
        assert len(hooks) == 3
        for hook in hooks:
            (expression,) = hook["namespaceSelector"]["matchExpressions"]
            assert expression["key"] == "kubernetes.io/metadata.name"
            assert expression["operator"] == "NotIn"
            assert expression["values"] == ["kube-system", own]
            assert set(expression["values"]) == excluded_namespaces(own)


def test_generated_template_names_are_bound_to_their_content() -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                {"name": "b", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}},
                {"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}},
            ]
        },
    }
    for template in convert_pod(pod).templates:
        spec = template["spec"]["spec"]
        assert generated_template_name(spec, DEFAULT_POLICY) == template["metadata"]["name"]
        bigger = copy.deepcopy(spec)
        first_exact(bigger)["count"] += 1
        assert generated_template_name(bigger, DEFAULT_POLICY) != template["metadata"]["name"]
        extra = copy.deepcopy(spec)
        first_exact(extra)["adminAccess"] = True
        assert generated_template_name(extra, DEFAULT_POLICY) is None
        if "firstAvailable" in spec["devices"]["requests"][0]:
            # A shared device's share without its whole-GPU fallback is not ours either.
            alone = copy.deepcopy(spec)
            del alone["devices"]["requests"][0]["firstAvailable"][1]
            assert generated_template_name(alone, DEFAULT_POLICY) is None


def first_exact(spec: dict[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = spec["devices"]["requests"][0]
    return request["exactly"] if "exactly" in request else request["firstAvailable"][0]
