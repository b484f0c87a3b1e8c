"""`gpudra migrate` on files: what it prints and writes, and that bad input writes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from gpudra.cli.main import main

TIME_SLICING = """\
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def configmap(**data: str) -> str:
    return yaml.safe_dump(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dp"}, "data": data}
    )


def test_prints_values_tenants_and_the_pods_that_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text(TIME_SLICING)
    shared = {"nvidia.com/gpu": 2}
    pods = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "metadata": {"name": "trainer", "namespace": "ml"},
                "spec": {"containers": [{"name": "c", "resources": {"limits": shared}}]},
            },
            {"metadata": {"name": "web", "namespace": "ml"}, "spec": {"containers": [{}]}},
        ],
    }
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump(pods))
    args = ["migrate", f"--config={tmp_path}/config.yaml", f"--pods={tmp_path}/pods.yaml"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "node:\n  gpuShares: 4\n" in out
    assert "kind: GpuTenant" in out
    assert "# pods whose behaviour would change (1 of 2):" in out
    assert "#   ml/trainer: asks for 2 shared GPUs in one container" in out


def test_out_writes_the_files_helm_and_kubectl_take(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(TIME_SLICING)
    out = tmp_path / "plan"
    assert main(["migrate", f"--config={tmp_path}/config.yaml", f"--out={out}"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tenants.yaml", "values.yaml"]
    assert yaml.safe_load((out / "values.yaml").read_text())["node"] == {"gpuShares": 4}
    (tenant,) = yaml.safe_load_all((out / "tenants.yaml").read_text())
    assert tenant["spec"]["gpuResource"] == {"sharing": "TimeSlicing"}


def test_unmappable_config_names_the_field_and_writes_nothing(tmp_path: Path) -> None:
    mig = TIME_SLICING.replace("name: nvidia.com/gpu", "name: nvidia.com/mig-1g.10gb")
    (tmp_path / "cm.yaml").write_text(configmap(default=mig))
    out = tmp_path / "plan"
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/cm.yaml", f"--out={out}"])
    message = str(exit_.value)
    assert message.startswith("gpudra migrate: nothing written:\n")
    assert "default: sharing.timeSlicing.resources[0].name: 'nvidia.com/mig-1g.10gb':" in message
    assert not out.exists()


def nodes_file(tmp_path: Path, **configs: str | None) -> Path:
    """`kubectl get nodes -o yaml` of nodes labelled with the config each runs."""
    items = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {} if key is None else {"nvidia.com/device-plugin.config": key},
            },
        }
        for name, key in configs.items()
    ]
    return list_file(tmp_path / "nodes.yaml", items)


def list_file(path: Path, items: list[dict[str, Any]]) -> Path:
    """`items` as a `kubectl get -o yaml` List at `path`."""
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


def test_a_configmap_of_several_configs_keeps_each_node_s_shares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per-node configs map to node.gpuSharesByNode, not to one value for every node."""
    (tmp_path / "cm.yaml").write_text(configmap(default="version: v1\n", t4=TIME_SLICING))
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/cm.yaml", "--config-key=t4"])
    assert "--nodes: the ConfigMap holds 2 configs (default, t4)" in str(exit_.value)
    nodes = nodes_file(tmp_path, **{"gpu-1": "t4", "gpu-2": None, "gpu-3": "default"})
    out = tmp_path / "plan"
    args = ["migrate", f"--config={tmp_path}/cm.yaml", f"--nodes={nodes}", f"--out={out}"]
    assert main(args) == 0
    values = yaml.safe_load((out / "values.yaml").read_text())
    assert values["node"] == {"gpuShares": 0, "gpuSharesByNode": {"gpu-1": 4}}
    assert main([*args, "--config-key=t4"]) == 0
    values = yaml.safe_load((out / "values.yaml").read_text())
    assert values["node"] == {"gpuShares": 4, "gpuSharesByNode": {"gpu-3": 0}}
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--config-key=a100"])
    assert "--config-key: 'a100' is not in the ConfigMap" in str(exit_.value)
    (tmp_path / "bad.yaml").write_text("kind: NodeList\n")
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/cm.yaml", f"--nodes={tmp_path}/bad.yaml"])
    assert "items: expected a Node List, as `kubectl get nodes -o yaml` prints" in str(exit_.value)


def test_a_rerun_leaves_no_file_of_the_earlier_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan without GpuTenants removes the tenants.yaml an earlier run wrote there,
    which would make nvidia.com/gpu a share where the new config shares nothing."""
    (tmp_path / "shared.yaml").write_text(TIME_SLICING)
    (tmp_path / "plain.yaml").write_text("version: v1\n")
    out = tmp_path / "plan"
    assert main(["migrate", f"--config={tmp_path}/shared.yaml", f"--out={out}"]) == 0
    assert (out / "tenants.yaml").exists()
    capsys.readouterr()
    assert main(["migrate", f"--config={tmp_path}/plain.yaml", f"--out={out}"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["values.yaml"]
    assert yaml.safe_load((out / "values.yaml").read_text()) == {}
    printed = capsys.readouterr().out
    assert f"# wrote {out}/values.yaml\n" in printed
    assert f"# removed {out}/tenants.yaml: an earlier run's; this plan has none\n" in printed


def test_mig_strategy_overrides_the_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--mig-strategy is the device plugin's flag (MIG_STRATEGY), which wins over the file."""
    (tmp_path / "config.yaml").write_text("version: v1\nflags:\n  migStrategy: none\n")
    args = ["migrate", f"--config={tmp_path}/config.yaml"]
    assert main([*args, "--mig-strategy=mixed"]) == 0
    assert "node:\n  migStrategy: static\n" in capsys.readouterr().out
    out = tmp_path / "plan"
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--mig-strategy=single", f"--out={out}"])
    assert "config.yaml: --mig-strategy: single: " in str(exit_.value)
    assert not out.exists()
    with pytest.raises(SystemExit):
        main([*args, "--mig-strategy=all"])  # argparse names the choices
    assert "argument --mig-strategy: invalid choice: 'all'" in capsys.readouterr().err


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/nope.yaml"])
    missing = f"--config {tmp_path}/nope.yaml: No such file or directory"
    assert str(exit_.value) == f"gpudra migrate: {missing}"


def gpu_pods_file(tmp_path: Path, *namespaces: str) -> Path:
    """`kubectl get pods -A -o yaml` of one pod asking for a whole GPU per namespace."""
    limits = {"nvidia.com/gpu": 1}
    items = [
        {
            "metadata": {"name": "app", "namespace": namespace},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        }
        for namespace in namespaces
    ]
    return list_file(tmp_path / "pods.yaml", items)


def test_pods_where_the_webhook_never_looks_are_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--namespace is gpudra's release namespace (default: the one the docs install
    into): its pods and kube-system's keep nvidia.com/gpu, so they are listed; a
    whole-GPU pod elsewhere is converted to the same thing and is not."""
    (tmp_path / "config.yaml").write_text("version: v1\n")
    pods = gpu_pods_file(tmp_path, "kube-system", "gpudra", "ops", "ml")
    args = ["migrate", f"--config={tmp_path}/config.yaml", f"--pods={pods}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "# pods whose behaviour would change (2 of 4):" in out
    assert "#   kube-system/app: asks for nvidia.com/gpu in kube-system, which the webhook" in out
    assert "#   gpudra/app: asks for nvidia.com/gpu in gpudra, which the webhook" in out
    assert main([*args, "--namespace=ops"]) == 0
    out = capsys.readouterr().out
    assert "# pods whose behaviour would change (2 of 4):" in out
    assert "#   ops/app: asks for nvidia.com/gpu in ops, which the webhook" in out
    assert "gpudra/app" not in out


def test_a_namespace_that_is_no_dns_label_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["migrate", "--config=-", "--namespace=GPU_system"])
    err = capsys.readouterr().err
    assert "argument --namespace: 'GPU_system' must be a DNS label " in err
    assert "give the namespace gpudra is (or will be) installed in" in err
