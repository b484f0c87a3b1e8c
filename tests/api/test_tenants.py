"""GpuTenant model: strict parsing with field paths, selection, and the generated CRD."""

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpudra.api.tenants import (
    API_VERSION,
    GpuTenantSpec,
    LabelSelector,
    Specificity,
    TenantError,
    TenantReach,
    crd_manifest,
    crd_yaml,
    excluded_namespace_list,
    excluded_namespaces,
    invalid_in_reach,
    parse_tenant,
    quota_key,
    winning_tenants,
)

CRD_FILE = Path(__file__).resolve().parents[2] / "api" / "crds" / "gpudra.io_gputenants.yaml"


def tenant(name: str = "team-a", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "GpuTenant",
        "metadata": {"name": name},
        "spec": spec,
    }


def errors(obj: dict[str, Any]) -> str:
    with pytest.raises(TenantError) as err:
        parse_tenant(obj)
    return str(err.value)


def test_full_tenant_parses() -> None:
    t = parse_tenant(
        tenant(
            namespaceSelector={"matchLabels": {"team": "a"}},
            namespaces=["ml-a"],
            maxDevicesPerPod=4,
            allowedDeviceClasses=["gpu.nvidia.com", "mig.nvidia.com"],
            allowedMigProfiles=["1g.10gb", "3g.40gb"],
            allowedSharing=["Exclusive", "TimeSlicing"],
            gpuResource={"sharing": "TimeSlicing", "timeSlicingInterval": "Long"},
            deviceQuota={"gpu.nvidia.com": 4, "mig.nvidia.com": 0},
        )
    )
    spec = t.spec
    assert t.name == "team-a"
    assert t.label == 'tenant "team-a" (GpuTenant team-a)'
    assert spec.max_devices_per_pod == 4
    assert spec.gpu_sharing == "TimeSlicing"
    assert spec.device_quota == {"gpu.nvidia.com": 4, "mig.nvidia.com": 0}
    assert spec.allows_class("mig.nvidia.com") and not spec.allows_class("other.example.com")
    assert spec.allows_mig_profile("1g.10gb") and not spec.allows_mig_profile("7g.80gb")
    assert spec.allows_sharing("Exclusive") and not spec.allows_sharing("MPS")


def test_unset_lists_allow_everything_and_empty_lists_nothing() -> None:
    spec = parse_tenant(tenant(namespaces=["a"])).spec
    assert spec.allows_class("x.example.com") and spec.allows_sharing("MPS")
    assert spec.allows_mig_profile("7g.80gb")
    none = parse_tenant(tenant(namespaces=["a"], allowedMigProfiles=[])).spec
    assert not none.allows_mig_profile("1g.10gb")
    # A privilege the tenant's rules never gave before it existed: off unless allowed.
    assert not spec.allow_mps_multi_user
    assert parse_tenant(tenant(namespaces=["a"], allowMpsMultiUser=True)).spec.allow_mps_multi_user


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"namespaces": ["a"], "allowedSharing": ["Exclusive", "Shared"]},
            "spec.allowedSharing[1]: Input should be 'Exclusive', 'TimeSlicing' or 'MPS'",
        ),
        ({"namespaces": ["a"], "maxDevicePerPod": 4}, "spec.maxDevicePerPod: unknown field"),
        ({"namespaces": ["a"], "maxDevicesPerPod": "4"}, "spec.maxDevicesPerPod: Input should"),
        ({"namespaces": ["a"], "maxDevicesPerPod": 0}, "spec.maxDevicesPerPod: Input should be"),
        ({"namespaces": ["a"], "allowMpsMultiUser": "yes"}, "spec.allowMpsMultiUser: Input should"),
        ({"namespaces": ["a"], "deviceQuota": {"gpu.nvidia.com": -1}}, "spec.deviceQuota."),
        ({"namespaces": ["Team_A"]}, "spec.namespaces[0]: String should match pattern"),
        ({"namespaces": ["a"], "allowedMigProfiles": ["9g.80gb"]}, "spec.allowedMigProfiles[0]"),
        ({"maxDevicesPerPod": 2}, "spec: selects no namespace: set namespaceSelector"),
        (
            {"namespaces": ["a"], "gpuResource": {"sharing": "MPS", "timeSlicingInterval": "Long"}},
            "spec.gpuResource: timeSlicingInterval only applies to sharing TimeSlicing",
        ),
        (
            {
                "namespaces": ["a"],
                "allowedSharing": ["Exclusive"],
                "gpuResource": {"sharing": "MPS"},
            },
            "gpuResource.sharing is MPS but allowedSharing is [Exclusive]",
        ),
        (
            {"namespaceSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}},
            "spec.namespaceSelector.matchExpressions[0]: operator In needs a non-empty values",
        ),
    ],
)
def test_errors_name_the_field(spec: dict[str, Any], expected: str) -> None:
    message = errors(tenant(**spec))
    assert message.startswith("GpuTenant team-a: ")
    assert expected in message


def test_wrong_kind_and_missing_spec_are_errors() -> None:
    assert "apiVersion/kind must be gpudra.io/v1alpha1 GpuTenant" in errors(
        {**tenant(namespaces=["a"]), "kind": "Tenant"}
    )
    obj = tenant()
    del obj["spec"]
    assert "spec: required object is missing" in errors(obj)


def test_label_selector_semantics() -> None:
    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"team": "a"},
            "matchExpressions": [
                {"key": "env", "operator": "In", "values": ["dev", "prod"]},
                {"key": "frozen", "operator": "DoesNotExist"},
            ],
        }
    )
    assert sel.matches({"team": "a", "env": "dev"})
    assert not sel.matches({"team": "a", "env": "test"})
    assert not sel.matches({"team": "a", "env": "dev", "frozen": "1"})
    assert not sel.matches({"team": "b", "env": "dev"})
    assert LabelSelector.model_validate({}).matches({"anything": "x"})
    not_in = LabelSelector.model_validate(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]}
    )
    assert not_in.matches({}) and not not_in.matches({"tier": "gold"})


def test_selection_specificity() -> None:
    spec = GpuTenantSpec.model_validate(
        {"namespaces": ["ml-a"], "namespaceSelector": {"matchLabels": {"team": "a"}}}
    )
    assert spec.selects("ml-a", {}) is Specificity.NAME
    assert spec.selects("other", {"team": "a"}) is Specificity.LABEL
    assert spec.selects("other", {"team": "b"}) is None
    assert Specificity.NAME > Specificity.LABEL


def test_the_most_specific_tenant_wins_and_equals_conflict() -> None:
    by_label = parse_tenant(tenant("by-label", namespaceSelector={"matchLabels": {"team": "a"}}))
    by_name = parse_tenant(tenant("by-name", namespaces=["ml-a"]))
    exists = {"matchExpressions": [{"key": "team", "operator": "Exists"}]}
    also_label = parse_tenant(tenant("also", namespaceSelector=exists))
    team_a = {"team": "a"}
    assert winning_tenants("ml-a", team_a, [by_label, by_name, also_label]) == [by_name]
    assert winning_tenants("ml-b", team_a, [by_label, by_name]) == [by_label]
    assert winning_tenants("ml-b", team_a, [also_label, by_label]) == [also_label, by_label]
    assert winning_tenants("ml-b", {}, [by_label, by_name]) == []
    # Labels not known yet: a name decides, a selector cannot.
    assert winning_tenants("ml-a", None, [by_name]) == [by_name]
    assert winning_tenants("ml-a", None, [by_name, by_label]) is None


def test_an_empty_selector_makes_the_default_tenant_ranked_below_every_other() -> None:
    """``namespaceSelector: {}`` governs exactly the namespaces no other tenant selects
    (never the ones the webhook does not review); two of them are a conflict."""
    default = parse_tenant(tenant("default", namespaceSelector={}))
    also = parse_tenant(
        tenant("also", namespaceSelector={"matchLabels": {}, "matchExpressions": []})
    )
    by_label = parse_tenant(tenant("by-label", namespaceSelector={"matchLabels": {"team": "a"}}))
    by_name = parse_tenant(tenant("by-name", namespaces=["ml-a"]))
    team_a = {"team": "a"}
    assert default.spec.is_default and also.spec.is_default
    assert not by_label.spec.is_default and not by_name.spec.is_default
    assert default.spec.selects("any", {}) is Specificity.DEFAULT
    assert Specificity.DEFAULT < Specificity.LABEL < Specificity.NAME
    assert winning_tenants("ml-b", team_a, [default, by_label]) == [by_label]
    assert winning_tenants("ml-a", team_a, [default, by_label, by_name]) == [by_name]
    assert winning_tenants("fresh", {}, [default, by_label, by_name]) == [default]
    assert winning_tenants("fresh", {}, [default, also]) == [default, also]
    assert winning_tenants("kube-system", {}, [default], excluded={"kube-system"}) == []
    assert winning_tenants("kube-system", {}, [by_label], excluded={"kube-system"}) == []
    # Listed by name and default elsewhere: the name wins over another default.
    both = parse_tenant(tenant("both", namespaces=["ml-a"], namespaceSelector={}))
    assert winning_tenants("ml-a", {}, [default, both]) == [both]
    assert winning_tenants("fresh", {}, [default, both]) == [default, both]
    # Labels not known yet: the default decides only where no label selector could.
    assert winning_tenants("fresh", None, [default]) == [default]
    assert winning_tenants("fresh", None, [default, by_label]) is None


def test_a_default_tenant_governs_no_excluded_namespace_wherever_it_is_asked() -> None:
    """The namespaces the webhook never reviews (`excluded_namespaces`) are out of a
    default tenant's reach as its spec says it (`GpuTenantSpec.selects`), as the winners
    are chosen, labels known or not, and as an invalid default tenant reaches: one rule,
    so the webhook's rules, its denials for invalid tenants and the node agent's
    accounting cannot part. A namespace listed by name is still the tenant's."""
    excluded = excluded_namespaces("gpudra")
    default = parse_tenant(tenant("default", namespaceSelector={}))
    invalid = {"bad": TenantReach.of(tenant("bad", namespaceSelector={}, typo=1))}
    for namespace in ("kube-system", "gpudra", "fresh"):
        expected = None if namespace in excluded else Specificity.DEFAULT
        assert default.spec.selects(namespace, {"any": "x"}, excluded) is expected
        assert invalid["bad"].selects(namespace, None, excluded) is expected
        for labels in ({}, None):
            winners = winning_tenants(namespace, labels, [default], excluded)
            assert winners == ([] if expected is None else [default])
        in_reach = invalid_in_reach(namespace, {}, [], invalid, excluded)
        assert in_reach == (None if expected is None else "bad")
    listed = parse_tenant(tenant("listed", namespaces=["gpudra"], namespaceSelector={}))
    assert listed.spec.selects("gpudra", {}, excluded) is Specificity.NAME
    assert winning_tenants("gpudra", None, [default, listed], excluded) == [listed]
    assert winning_tenants("kube-system", None, [default, listed], excluded) == []


def test_the_excluded_namespaces_are_listed_in_one_order_each_once() -> None:
    """The registrations list the excluded namespaces in order (the system's, then
    gpudra's own, as the chart does); the set the webhook and the node agent test
    against is the same names. An unknown own namespace (``""``) adds none, and one that
    is a system namespace is listed once."""
    assert excluded_namespace_list("gpudra") == ("kube-system", "gpudra")
    assert excluded_namespaces("gpudra") == {"kube-system", "gpudra"}
    assert excluded_namespace_list("") == ("kube-system",)
    assert excluded_namespaces("") == {"kube-system"}
    assert excluded_namespace_list("kube-system") == ("kube-system",)


def test_the_install_guides_tenants_parse_and_its_default_tenant_allows_no_gpus() -> None:
    """docs/install.md's GpuTenant examples are what the webhook accepts; the default
    tenant it recommends right after the install is one, and allows no device."""
    install = (CRD_FILE.parents[2] / "docs" / "install.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", install, re.DOTALL)
    parsed = [
        parse_tenant(o)
        for b in blocks
        for o in yaml.safe_load_all(b)
        if isinstance(o, dict) and o.get("kind") == "GpuTenant"
    ]
    (default,) = [t for t in parsed if t.spec.is_default]
    assert default.spec.device_quota == {}
    assert len(parsed) >= 2


def test_an_invalid_default_tenant_decides_only_where_no_other_tenant_selects() -> None:
    by_label = parse_tenant(tenant("by-label", namespaceSelector={"matchLabels": {"team": "a"}}))
    reach = {"bad": TenantReach.of(tenant("bad", namespaceSelector={}, typo=1))}
    assert reach["bad"].selects("fresh", None) is Specificity.DEFAULT
    assert invalid_in_reach("fresh", {}, [], reach) == "bad"
    assert invalid_in_reach("ml-b", {"team": "a"}, [by_label], reach) is None
    assert invalid_in_reach("kube-system", {}, [], reach, excluded={"kube-system"}) is None


def test_an_invalid_tenant_decides_where_it_would_win_or_tie() -> None:
    """Its rules are unknown, so where it reaches as far as the valid winner, it decides:
    the webhook denies there and the node agent bills no tenant."""
    by_label = parse_tenant(tenant("by-label", namespaceSelector={"matchLabels": {"team": "a"}}))
    by_name = parse_tenant(tenant("by-name", namespaces=["ml-a"]))
    team_a = {"team": "a"}
    names = {"bad": TenantReach.of(tenant("bad", namespaces=["ml-a"], typo=1))}
    assert invalid_in_reach("ml-a", team_a, [by_name], names) == "bad"  # a tie
    assert invalid_in_reach("ml-a", team_a, [by_label], names) == "bad"  # it would win
    assert invalid_in_reach("ml-b", team_a, [by_label], names) is None  # out of reach
    labels = {"bad": TenantReach.of(tenant("bad", namespaceSelector={"matchLabels": team_a}))}
    assert invalid_in_reach("ml-b", team_a, [by_label], labels) == "bad"
    assert invalid_in_reach("ml-a", team_a, [by_name], labels) is None  # a name beats it
    assert invalid_in_reach("ml-b", {}, [], labels) is None
    # What cannot be read is taken to reach as far as it might.
    for spec in ({"namespaceSelector": "team"}, {}, {"namespaces": "ml-b"}):
        reach = {"bad": TenantReach.of(tenant("bad", **spec))}
        assert invalid_in_reach("ml-b", {}, [by_label], reach) == "bad"
    assert invalid_in_reach("ml-b", None, [], labels) == "bad"  # labels not known yet


def test_quota_key_matches_the_api_server_resource_name() -> None:
    assert quota_key("gpu.nvidia.com") == "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"


def test_committed_crd_is_the_generated_one() -> None:
    assert CRD_FILE.read_text() == crd_yaml(), (
        "api/crds/gpudra.io_gputenants.yaml is stale: regenerate it with "
        "`python -m gpudra.api.tenants > api/crds/gpudra.io_gputenants.yaml`"
    )
    assert yaml.safe_load(CRD_FILE.read_text()) == crd_manifest()


def _walk(node: Any, path: str = "schema") -> list[str]:
    """Nodes that break the structural-schema rules the API server enforces."""
    problems: list[str] = []
    if not isinstance(node, dict):
        return problems
    for banned in ("$ref", "anyOf", "oneOf", "allOf", "patternProperties", "title", "default"):
        if banned in node:
            problems.append(f"{path}: {banned}")
    if "type" not in node:
        problems.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties with additionalProperties")
    for key, child in (node.get("properties") or {}).items():
        problems += _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        problems += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += _walk(node["additionalProperties"], f"{path}{{}}")
    return problems


def test_crd_schema_is_structural_and_complete() -> None:
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "gputenants.gpudra.io"
    assert crd["spec"]["scope"] == "Cluster"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    spec = schema["properties"]["spec"]["properties"]
    assert set(spec) == {
        "namespaceSelector",
        "namespaces",
        "maxDevicesPerPod",
        "allowedDeviceClasses",
        "allowedMigProfiles",
        "allowedSharing",
        "allowMpsMultiUser",
        "allowedTaintTolerations",
        "gpuResource",
        "deviceQuota",
    }
    assert spec["allowMpsMultiUser"]["type"] == "boolean"
    assert spec["allowedSharing"]["items"]["enum"] == ["Exclusive", "TimeSlicing", "MPS"]
    assert spec["maxDevicesPerPod"]["minimum"] == 1
    assert spec["deviceQuota"]["additionalProperties"] == {
        "maximum": 1_000_000,
        "minimum": 0,
        "type": "integer",
    }
    assert "?P<" not in spec["allowedMigProfiles"]["items"]["pattern"]
