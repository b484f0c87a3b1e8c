"""`gpudra migrate`'s mapping, on configs in the device plugin's documented `version: v1`
format (the examples of NVIDIA/k8s-device-plugin's README and its chart's config map)."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import yaml
from gpudra.api.tenants import parse_tenant
from gpudra.webhook.migration import (
    CONFIG_LABEL,
    SHARES_BY_NODE_VALUE,
    SHARES_VALUE,
    MigrationError,
    NodeConfigs,
    config_texts,
    node_configs,
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


def shares(values: dict[str, Any], path: tuple[str, ...] = SHARES_VALUE) -> Any:
    for key in path:
        values = values[key]
    return values


def node(name: str, config: str | None = None) -> dict[str, Any]:
    labels = {CONFIG_LABEL: config} if config is not None else {}
    return {"kind": "Node", "metadata": {"name": name, "labels": labels}}


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


def test_mps_replicas_are_not_capped_twice_and_flag_requests_it_refused() -> None:
    """The device plugin held each of a GPU's N MPS clients, running side by side in one
    server, to 100/N of its threads. gpudra's claims each run their own MPS daemon and
    are time-sliced on a shared GPU, which already splits it N ways under load: the
    same cap on top would leave each busy pod 1/N of 1/N. The plan sets none and says
    why, and how to keep the cap for a pod alone on its GPU."""
    result = plan(parse_config(MPS), [pod("two", **{"nvidia.com/gpu": 2})])
    assert result.values["deviceClasses"]["shared"] == {"strategy": "MPS"}
    (why,) = [n for n in result.notes if n.startswith("sharing.mps replicas 10: ")]
    assert "active thread percentage 10" in why
    assert "so the plan sets no thread percentage (it would make that 1/10 of 1/10)" in why
    assert why.endswith("set deviceClasses.shared.mps.defaultActiveThreadPercentage")
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
            TIME_SLICING.replace("name: nvidia.com/gpu", "name: nvidia.com/mig-1g.10gb"),
            "sharing.timeSlicing.resources[0].name: 'nvidia.com/mig-1g.10gb'",
            "own",
        ),
        (
            TIME_SLICING.replace("replicas: 10", "replicas: 0"),
            "sharing.timeSlicing.resources[0].replicas: 0",
            "at least 2",
        ),
        # The device plugin refuses 1 too ("number of replicas must be >= 2").
        (
            TIME_SLICING.replace("replicas: 10", "replicas: 1"),
            "sharing.timeSlicing.resources[0].replicas: 1",
            "it does not start with fewer",
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


def test_opted_out_pods_are_not_reported() -> None:
    shared = {"nvidia.com/gpu.shared": 1}
    opted_out = pod("opted-out", **shared)
    opted_out["metadata"]["labels"] = {"gpudra.nvidia.com/convert": "false"}
    result = plan(parse_config("version: v1\n"), [opted_out, pod("moved", **shared)])
    assert [c.name for c in result.pods] == ["moved"]


def in_namespace(namespace: str, name: str, **limits: Any) -> dict[str, Any]:
    out = pod(name, **limits)
    out["metadata"]["namespace"] = namespace
    return out


@pytest.mark.parametrize("namespace", ["kube-system", "gpu-system"])
def test_gpu_pods_where_the_webhook_never_looks_are_reported_as_stranded(namespace: str) -> None:
    """kube-system and gpudra's own namespace (`excluded_namespaces`) are never reviewed,
    so a pod there keeps nvidia.com/gpu, which no node advertises once the device
    plugin is gone: it is reported with what to do, even opted out or with a GPU
    count no claim could hold, and whatever the config shares."""
    opted_out = in_namespace(namespace, "opted-out", **{"nvidia.com/gpu": 1})
    opted_out["metadata"]["labels"] = {"gpudra.nvidia.com/convert": "false"}
    pods = [
        in_namespace(namespace, "trainer", **{"nvidia.com/gpu": 40}),
        in_namespace(namespace, "mig", **{"nvidia.com/mig-1g.10gb": 1}),
        opted_out,
        in_namespace(namespace, "web", cpu="1"),
        {**in_namespace(namespace, "done", **{"nvidia.com/gpu": 1}), "status": {"phase": "Failed"}},
    ]
    for config in (parse_config("version: v1\n"), parse_config(TIME_SLICING)):
        result = plan(config, pods, own_namespace="gpu-system")
        assert [c.name for c in result.pods] == ["trainer", "mig", "opted-out"]
        trainer, mig, _ = result.pods
        assert trainer.namespace == namespace
        assert trainer.reason == (
            f"asks for nvidia.com/gpu in {namespace}, which the webhook never reviews (it "
            "leaves out the system's namespace and gpudra's own), so it is never converted: "
            "once the device plugin is removed no node advertises it (but nvidia.com/gpu "
            "where deviceClasses.gpu.extendedResourceName names it) and the pod pends (a "
            "running one keeps running until it is recreated); move the workload to another "
            "namespace, or give it a ResourceClaim by hand"
        )
        assert mig.reason.startswith(f"asks for nvidia.com/mig-1g.10gb in {namespace}, ")


def test_gpudra_s_namespace_is_only_left_out_where_it_is_named() -> None:
    """Without `own_namespace` only the system's namespace is left out: another one is
    converted like any, so its pods are judged by what the conversion changes."""
    pods = [in_namespace("gpu-system", "whole", **{"nvidia.com/gpu": 1})]
    assert plan(parse_config("version: v1\n"), pods).pods == []
    (change,) = plan(parse_config("version: v1\n"), pods, own_namespace="gpu-system").pods
    assert "never reviews" in change.reason


def test_an_unreadable_gpu_request_where_the_webhook_never_looks_says_why() -> None:
    bad = in_namespace("kube-system", "bad", **{"nvidia.com/gpu": "half"})
    (change,) = plan(parse_config("version: v1\n"), [bad]).pods
    assert change.reason.startswith(
        "is in kube-system, which the webhook never reviews (it leaves out the system's "
        "namespace and gpudra's own), and its GPU requests cannot be read: "
    )
    assert '"nvidia.com/gpu"' in change.reason


@pytest.mark.parametrize("rename", ["gpu.shared", "nvidia.com/gpu.shared", "gpu-ts"])
def test_rename_is_ignored_as_the_device_plugin_ignores_it(rename: str) -> None:
    """The device plugin drops `rename` (DisableResourceNamingInConfig): without
    renameByDefault pods asked for plain nvidia.com/gpu and got a replica, so the plan
    keeps the GpuTenant that makes nvidia.com/gpu a share."""
    config = TIME_SLICING.replace("replicas: 10", f"replicas: 10\n      rename: {rename}")
    parsed = parse_config(config)
    assert parsed.sharing is not None
    assert not parsed.sharing.renamed
    result = plan(parsed, [pod("whole", **{"nvidia.com/gpu": 1})])
    (tenant,) = result.tenants
    assert tenant["spec"]["gpuResource"] == {"sharing": "TimeSlicing"}
    assert result.pods == []
    assert any(
        n.startswith(f"sharing.timeSlicing.resources[0].rename: {rename!r}: ignored")
        and "advertised nvidia.com/gpu " in n
        for n in result.notes
    )
    # With renameByDefault the name is nvidia.com/gpu.shared, whatever `rename` says.
    renamed = parse_config(RENAMED.replace("replicas: 10", f"replicas: 10\n      rename: {rename}"))
    assert renamed.sharing is not None
    assert renamed.sharing.renamed
    assert plan(renamed).tenants == []


def test_mig_strategy_flag_overrides_the_file_with_the_same_consequences() -> None:
    """The device plugin's --mig-strategy (MIG_STRATEGY, set by the GPU Operator's
    mig.strategy and its chart's migStrategy) overrides flags.migStrategy."""
    mixed = parse_config("version: v1\n", mig_strategy="mixed")
    assert plan(mixed).values == {"node": {"migStrategy": "static"}}
    # The flag wins over the file, and the note says so.
    none = parse_config("version: v1\nflags: {migStrategy: mixed}\n", mig_strategy="none")
    assert plan(none).values == {}
    assert any(
        "flags.migStrategy: 'mixed' is overridden by --mig-strategy none" in n for n in none.notes
    )
    # A bad value in the file does not matter where the flag overrides it.
    assert (
        parse_config("version: v1\nflags: {migStrategy: all}\n", mig_strategy="mixed").mig_strategy
        == "mixed"
    )
    with pytest.raises(MigrationError) as error:
        parse_config(
            "version: v1\nflags: {migStrategy: mixed}\n", "cm/default", mig_strategy="single"
        )
    (problem,) = error.value.problems
    assert problem.startswith("--mig-strategy: single: ")
    assert "move the device plugin to mixed" in problem


def test_shares_say_they_need_the_consumable_capacity_gate() -> None:
    gate = [n for n in plan(parse_config(TIME_SLICING)).notes if "DRAConsumableCapacity" in n]
    assert len(gate) == 1
    assert "1.34 and 1.35" in gate[0]
    assert "each converted pod gets a GPU of its own" in gate[0]
    assert not any("DRAConsumableCapacity" in n for n in plan(parse_config("version: v1\n")).notes)


def test_render_writes_tenants_only_when_the_plan_has_some() -> None:
    assert set(render(plan(parse_config(RENAMED)))) == {"values.yaml"}
    assert set(render(plan(parse_config(TIME_SLICING)))) == {"values.yaml", "tenants.yaml"}


SHARED_4 = TIME_SLICING.replace("replicas: 10", "replicas: 4")
MIXED = "version: v1\nflags: {migStrategy: mixed}\n"


def test_per_node_configs_keep_their_shares_per_node() -> None:
    """Each node keeps the config its label names: the default one's shares for every
    node, node.gpuSharesByNode for the nodes whose config shares otherwise."""
    texts = {"default": "version: v1\n", "t4": SHARED_4, "a100": TIME_SLICING, "spare": MPS}
    nodes = [node("cpu-1"), node("gpu-1", "t4"), node("gpu-2", "a100"), node("gpu-3", "default")]
    configs = node_configs(texts, nodes)
    assert configs.default.source == "default"
    assert {n: c.source for n, c in configs.nodes.items()} == {"gpu-1": "t4", "gpu-2": "a100"}
    assert configs.notes == ("spare: no node runs this config, so it is left out",)
    result = plan(configs, [pod("whole", **{"nvidia.com/gpu": 1})])
    assert shares(result.values) == 0
    assert shares(result.values, SHARES_BY_NODE_VALUE) == {"gpu-1": 4, "gpu-2": 10}
    (tenant,) = result.tenants
    assert tenant["spec"]["gpuResource"] == {"sharing": "TimeSlicing"}
    assert any("shares nothing (gpuShares 0)" in n for n in result.notes)
    assert "spare: no node runs this config, so it is left out" in result.notes
    # --config-key: the device plugin chart's config.default, for unlabelled nodes.
    configs = node_configs(texts, nodes, default="t4")
    assert {n: c.source for n, c in configs.nodes.items()} == {"gpu-2": "a100", "gpu-3": "default"}
    result = plan(configs)
    assert shares(result.values) == 4
    assert shares(result.values, SHARES_BY_NODE_VALUE) == {"gpu-2": 10, "gpu-3": 0}


def test_renamed_shares_beside_unshared_nodes_keep_plain_gpu_pods() -> None:
    """Nodes of a config that shares nothing still advertised plain nvidia.com/gpu."""
    texts = {"default": "version: v1\n", "shared": RENAMED}
    whole = pod("whole", **{"nvidia.com/gpu": 1})
    result = plan(node_configs(texts, [node("gpu-1", "shared")]), [whole])
    assert result.tenants == []
    assert result.pods == []
    assert plan(parse_config(RENAMED), [whole]).pods != []


@pytest.mark.parametrize(
    ("texts", "field", "fix"),
    [
        (
            {"default": "version: v1\n", "a100": MIXED},
            "flags.migStrategy: the configs differ (default: none; a100: mixed)",
            "--mig-strategy mixed",
        ),
        (
            {"default": TIME_SLICING, "a100": MPS},
            "sharing: the configs differ (default: TimeSlicing; a100: MPS)",
            "make them agree",
        ),
        (
            {"default": TIME_SLICING, "a100": RENAMED},
            "renameByDefault: the configs differ",
            "GpuTenant",
        ),
        (
            {"default": MPS, "a100": MPS.replace("replicas: 10", "replicas: 4")},
            "sharing.mps replicas: the configs differ (default: 10; a100: 4)",
            "defaultPinnedDeviceMemoryLimit",
        ),
    ],
)
def test_per_node_configs_that_differ_in_a_chart_wide_value_are_refused(
    texts: dict[str, str], field: str, fix: str
) -> None:
    configs = node_configs(texts, [node("gpu-1"), node("gpu-2", "a100")])
    with pytest.raises(MigrationError) as error:
        plan(configs)
    (problem,) = error.value.problems
    assert problem.startswith(field)
    assert fix in problem
    # The --mig-strategy the device plugin ran with makes the configs agree.
    if "migStrategy" in field:
        agreed = node_configs(texts, [node("gpu-2", "a100")], mig_strategy="mixed")
        assert plan(agreed).values == {"node": {"migStrategy": "static"}}


def test_per_node_configs_need_the_nodes_and_a_default() -> None:
    texts = {"t4": SHARED_4, "a100": TIME_SLICING}
    with pytest.raises(MigrationError) as error:
        node_configs(texts, None, source="cm.yaml")
    assert str(error.value).startswith(
        "--nodes: the ConfigMap holds 2 configs (a100, t4), chosen per node by the label "
        "nvidia.com/device-plugin.config"
    )
    with pytest.raises(MigrationError) as error:
        node_configs(texts, [node("gpu-1", "t4"), node("gpu-2", "v100")], source="cm.yaml")
    assert [p.split(":")[0] for p in error.value.problems] == ["--config-key", "node gpu-2"]
    assert "config.default" in error.value.problems[0]
    assert "nvidia.com/device-plugin.config='v100' names no config" in error.value.problems[1]
    with pytest.raises(MigrationError, match=r"--config-key: 'v100' is not in the ConfigMap"):
        node_configs(texts, [], default="v100")
    # A bad config a node runs is named with its key; one no node runs is not read.
    texts = {
        "default": "version: v1\n",
        "a100": MIXED.replace("mixed", "single"),
        "old": "version: v0\n",
    }
    with pytest.raises(MigrationError) as error:
        node_configs(texts, [node("gpu-1", "a100")], source="cm.yaml")
    assert [p.split(":")[:2] for p in error.value.problems] == [["a100", " flags.migStrategy"]]
    assert str(error.value).startswith("cm.yaml: a100: flags.migStrategy: single")


def test_one_config_is_every_node_s() -> None:
    configs = node_configs({"only": TIME_SLICING}, None)
    assert configs == NodeConfigs(parse_config(TIME_SLICING, "only"))
