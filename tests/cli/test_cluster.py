"""How every command finds the cluster: the order kubectl follows, ending at
`~/.kube/config` before the pod's service account, and one line naming the fix when
there is none (the commands that read the cluster ended in a traceback before)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from gpudra.common.kube import kubeconfig_source

from tests.cli.stubs import api_server, gpudra


def run_without_kubeconfig(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpudra ARGS` with no $KUBECONFIG, `home` as $HOME, and not in a pod."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
    }
    env["HOME"] = str(home)
    return gpudra(*args, env=env)


def test_the_order_is_the_flag_then_kubeconfig_then_the_home_file(tmp_path: Path) -> None:
    listed = {"KUBECONFIG": "/a/config:/b/config"}
    assert kubeconfig_source("/given", listed, tmp_path) == "/given"
    assert kubeconfig_source(None, listed, tmp_path) == "/a/config:/b/config"
    assert kubeconfig_source(None, {}, tmp_path) is None  # the pod's service account
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("{}")
    assert kubeconfig_source(None, {}, tmp_path) == str(tmp_path / ".kube" / "config")
    assert kubeconfig_source(None, {"KUBECONFIG": ""}, tmp_path) == str(
        tmp_path / ".kube" / "config"
    )


def test_devices_reads_the_cluster_of_the_home_kubeconfig(tmp_path: Path) -> None:
    """What kubectl reads with no flag and no $KUBECONFIG, gpudra reads too."""
    with api_server([], tmp_path) as (kubeconfig, asked):
        (tmp_path / ".kube").mkdir()
        kubeconfig.rename(tmp_path / ".kube" / "config")
        done = run_without_kubeconfig(tmp_path, "devices")
    assert done.returncode == 0, done.stderr
    assert "/apis/resource.k8s.io/v1/resourceslices" in asked


@pytest.mark.parametrize(
    ("args", "otherwise"),
    [
        (["devices"], "set $KUBECONFIG"),
        (
            ["migrate", "--configmap", "nvidia-device-plugin/configs"],
            "give the files kubectl prints instead (--config, --nodes, --pods)",
        ),
    ],
)
def test_no_cluster_is_one_line_naming_the_fix(
    tmp_path: Path, args: list[str], otherwise: str
) -> None:
    done = run_without_kubeconfig(tmp_path, *args)
    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert line.startswith(f"gpudra {args[0]}: no cluster to read (")
    assert line.endswith(f"give --kubeconfig, or {otherwise}")


def test_a_cluster_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        '{"apiVersion": "v1", "kind": "Config", "current-context": "c",'
        ' "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],'
        ' "users": [{"name": "u", "user": {}}],'
        ' "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}'
    )
    for args in (["devices"], ["migrate", "--configmap", "ns/name"]):
        done = run_without_kubeconfig(tmp_path, *args, "--kubeconfig", str(kubeconfig))
        assert done.returncode != 0
        [line] = done.stderr.splitlines()
        assert line.startswith(f"gpudra {args[0]}: reading the cluster failed: "), line
