"""`gpudra migrate` on files: what it prints and writes, and that bad input writes nothing."""

from __future__ import annotations

from pathlib import Path

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
    renamed = TIME_SLICING.replace("replicas: 4", "replicas: 4\n      rename: gpu-ts")
    (tmp_path / "cm.yaml").write_text(configmap(default=renamed))
    out = tmp_path / "plan"
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/cm.yaml", f"--out={out}"])
    message = str(exit_.value)
    assert message.startswith("gpudra migrate: nothing written:\n")
    assert "default: sharing.timeSlicing.resources[0].rename: 'gpu-ts':" in message
    assert not out.exists()


def test_a_configmap_of_several_configs_needs_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cm.yaml").write_text(configmap(default="version: v1\n", t4=TIME_SLICING))
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/cm.yaml"])
    assert "--config-key: the ConfigMap holds 2 configs (default, t4)" in str(exit_.value)
    assert main(["migrate", f"--config={tmp_path}/cm.yaml", "--config-key=t4"]) == 0
    assert "gpuShares: 4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/cm.yaml", "--config-key=a100"])
    assert "--config-key: 'a100' is not in the ConfigMap" in str(exit_.value)


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", f"--config={tmp_path}/nope.yaml"])
    missing = f"--config {tmp_path}/nope.yaml: No such file or directory"
    assert str(exit_.value) == f"gpudra migrate: {missing}"
