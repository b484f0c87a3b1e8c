"""`gpudra migrate`'s mapping, on configs in the device plugin's documented `version: v1`
format (the examples of NVIDIA/k8s-device-plugin's README and its chart's config map)."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import yaml
from gpudra.api.tenants import parse_tenant
from gpudra.webhook.migration import (
    SHARES_VALUE,
    MigrationError,
    config_texts,
    parse_config,
    plan,
    render,
)

# The device plugin README's time-slicing example.
TIME_SLICING = """\
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""
# Its MPS example (failRequestsGreaterThanOne defaults to true there).
MPS = """\
version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""
RENAMED = TIME_SLICING.replace("renameByDefault: false", "renameByDefault: true")


def pod(name: str, **limits: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": limits}}]},
        "status": {"phase": "Running"},
    }


def shares(values: dict[str, Any]) -> Any:
    for key in SHARES_VALUE:
        values = values[key]
    return values


def test_time_slicing_keeps_n_pods_per_gpu_and_what_nvidia_gpu_means() -> None:
    result = plan(parse_config(TIME_SLICING))
    assert shares(result.values) == 10
    assert result.values["deviceClasses"] == {"shared": {"strategy": "TimeSlicing"}}
    (tenant,) = result.tenants
    # A GpuTenant the webhook accepts, mapping plain nvidia.com/gpu to a share everywhere.
    parsed = parse_tenant(tenant)
    assert parsed.spec.gpu_sharing == "TimeSlicing"
    assert tenant["spec"]["namespaceSelector"] == {}
    files = render(result)
    assert yaml.safe_load(files["values.yaml"]) == result.values
    assert list(yaml.safe_load_all(files["tenants.yaml"])) == result.tenants


def test_renamed_shares_need_no_tenant_and_plain_gpu_pods_are_reported() -> None:
    config = parse_config(RENAMED)
    pods = [
        pod("shared", **{"nvidia.com/gpu.shared": 1}),
        pod("whole", **{"nvidia.com/gpu": 1}),
        pod("cpu", cpu="1"),
    ]
    result = plan(config, pods)
    assert shares(result.values) == 10
    assert result.tenants == []
    assert [(c.name, c.reason) for c in result.pods] == [
        (
            "whole",
            "asks for nvidia.com/gpu, which nodes with renameByDefault no longer advertised "
            "(only nvidia.com/gpu.shared); gpudra gives it whole GPUs",
        )
    ]


def test_mps_gives_each_client_its_part_and_flags_requests_it_refused() -> None:
    result = plan(parse_config(MPS), [pod("two", **{"nvidia.com/gpu": 2})])
    assert result.values["deviceClasses"]["shared"] == {
        "strategy": "MPS",
        "mps": {"defaultActiveThreadPercentage": 10},
    }
    assert any("defaultPinnedDeviceMemoryLimit" in n for n in result.notes)
    (change,) = result.pods
    assert "failRequestsGreaterThanOne: true" in change.reason


def test_no_sharing_changes_nothing_but_shared_and_mig_pods() -> None:
    config = parse_config("version: v1\nflags:\n  migStrategy: none\n")
    pods = [
        pod("whole", **{"nvidia.com/gpu": 2}),
        pod("shared", **{"nvidia.com/gpu.shared": 1}),
        pod("mig", **{"nvidia.com/mig-1g.10gb": 1}),
        {**pod("done", **{"nvidia.com/gpu.shared": 1}), "status": {"phase": "Succeeded"}},
    ]
    result = plan(config, pods)
    assert result.values == {}
    assert result.tenants == []
    reasons = {c.name: c.reason for c in result.pods}
    assert set(reasons) == {"shared", "mig"}
    assert "no node with this config advertised" in reasons["shared"]
    assert "migStrategy none never advertised" in reasons["mig"]


def test_mixed_mig_publishes_only_existing_mig_devices() -> None:
    result = plan(parse_config("version: v1\nflags: {migStrategy: mixed}\n"))
    assert result.values == {"node": {"migStrategy": "static"}}


def test_replicas_one_shares_nothing() -> None:
    config = parse_config(TIME_SLICING.replace("replicas: 10", "replicas: 1"))
    assert config.sharing is None
    assert plan(config).values == {}


def test_a_denied_pod_is_reported_with_the_webhook_reason() -> None:
    bad = pod("frac", **{"nvidia.com/gpu": "0.5"})
    (change,) = plan(parse_config(TIME_SLICING), [bad]).pods
    assert change.reason.startswith("the webhook would deny it:")


@pytest.mark.parametrize(
    ("config", "field", "instead"),
    [
        ("version: v1\nflags: {migStrategy: single}\n", "flags.migStrategy: single", "mixed"),
        ("version: v1\nflags: {migStrategy: all}\n", "flags.migStrategy: 'all'", "dynamic"),
        ("version: v2\n", "version: 'v2'", "v1"),
        (
            TIME_SLICING.replace("replicas: 10", "replicas: 10\n      rename: gpu-ts"),
            "sharing.timeSlicing.resources[0].rename: 'gpu-ts'",
            "renameByDefault",
        ),
        (
            TIME_SLICING.replace("name: nvidia.com/gpu", "name: nvidia.com/mig-1g.10gb"),
            "sharing.timeSlicing.resources[0].name: 'nvidia.com/mig-1g.10gb'",
            "own",
        ),
        (
            TIME_SLICING.replace("replicas: 10", "replicas: 0"),
            "sharing.timeSlicing.resources[0].replicas: 0",
            "at least 1",
        ),
        (
            TIME_SLICING.replace("timeSlicing:", "timeslicing:"),
            "sharing.timeslicing: unknown field",
            "timeSlicing",
        ),
        (
            TIME_SLICING + "  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n",
            "sharing: timeSlicing and mps are both set",
            "keep the one",
        ),
        (
            "version: v1\nsharing: {timeSlicing: {renameByDefault: yes please, resources: []}}\n",
            "sharing.timeSlicing.renameByDefault: 'yes please' is not true or false",
            "",
        ),
    ],
)
def test_unmappable_config_names_the_field_and_what_gpudra_does(
    config: str, field: str, instead: str
) -> None:
    with pytest.raises(MigrationError) as error:
        parse_config(config, source="cm/default")
    message = str(error.value)
    assert f"cm/default: {field}" in message
    assert instead in message


def test_every_problem_is_named_at_once() -> None:
    config = "version: v1\nflags: {migStrategy: single}\nsharing: {timeSlicing: {resources: []}}\n"
    with pytest.raises(MigrationError) as error:
        parse_config(config)
    assert [p.split(":")[0] for p in error.value.problems] == [
        "flags.migStrategy",
        "sharing.timeSlicing.resources",
    ]


def test_configmap_of_the_device_plugin_chart_holds_named_configs() -> None:
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "nvidia-device-plugin-configs"},
        "data": {"default": "version: v1\n", "a100": TIME_SLICING},
    }
    texts = config_texts(yaml.safe_dump(configmap), source="cm.yaml")
    assert set(texts) == {"default", "a100"}
    assert parse_config(texts["a100"]).sharing is not None
    # A plain config file is one config, named after where it came from.
    assert config_texts(TIME_SLICING, source="config.yaml") == {"config.yaml": TIME_SLICING}
    empty = {**configmap, "data": {}}
    with pytest.raises(MigrationError, match=r"cm.yaml: data: the ConfigMap holds no config"):
        config_texts(yaml.safe_dump(empty), source="cm.yaml")


def test_ignored_fields_are_said_once_not_refused() -> None:
    config = textwrap.dedent(
        """\
        version: v1
        resources:
          gpus: [{pattern: "*", name: gpu}]
        sharing:
          timeSlicing:
            resources:
            - name: gpu
              devices: [0, 1]
              replicas: 2
        """
    )
    parsed = parse_config(config)
    assert parsed.sharing is not None
    assert parsed.sharing.replicas == 2
    assert any(n.startswith("resources:") for n in parsed.notes)
    assert any("devices: ignored" in n for n in parsed.notes)


def test_pods_the_webhook_never_converts_are_not_reported() -> None:
    shared = {"nvidia.com/gpu.shared": 1}
    system = pod("dp", **shared)
    system["metadata"]["namespace"] = "kube-system"
    opted_out = pod("opted-out", **shared)
    opted_out["metadata"]["labels"] = {"gpudra.nvidia.com/convert": "false"}
    result = plan(parse_config("version: v1\n"), [system, opted_out, pod("moved", **shared)])
    assert [c.name for c in result.pods] == ["moved"]
