"""`gpudra node` as its own process on emulated GPUs, for the tests and the prepare
benchmark: its host folders, its command line, and the namespace and DeviceClass of
the driver it serves. One definition, so that the benchmark measures the node the
tests check."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudra.driver.checkpoint import DEFAULT_BOOT_ID_PATH
from gpudra.driver.checkpoint import load as load_checkpoint

from e2e.cluster.kube import Kube, wait_for

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
EMULATED_H100 = ("--nvml", "emulated:h100-80gb-hbm3-x8")


@dataclass(frozen=True)
class NodeDirs:
    """The host folders one node process uses; short, for unix socket path limits.

    `cdi_root` puts the CDI specs elsewhere than under `root`, e.g. on a tmpfs as
    /var/run/cdi is on a node.
    """

    root: Path
    cdi_root: Path | None = None

    @property
    def kubelet(self) -> Path:
        return self.root / "k"

    @property
    def cdi(self) -> Path:
        return self.cdi_root or self.root / "cdi"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def host(self) -> Path:
        return self.root / "host"

    @property
    def boot_id(self) -> Path:
        return self.root / "boot_id"

    @property
    def tools_log(self) -> Path:
        return self.root / "tools.log"

    def make_dev(self, gpus: int = 8) -> None:
        """The host's /dev/nvidia* nodes as empty files: CDI specs list only those present."""
        dev = self.host / "dev"
        dev.mkdir(parents=True)
        for name in (*CONTROL_NODES, *(f"nvidia{i}" for i in range(gpus))):
            (dev / name).touch()

    def command(
        self,
        driver: str,
        *options: str,
        nvml: Sequence[str] = EMULATED_H100,
        runner: Sequence[str] = (),
    ) -> list[str]:
        """`gpudra node` for `driver` on these folders, without the toolkit's CDI spec
        (no toolkit here); `runner` goes between the interpreter and the module (for
        cProfile), so that the process is still the node itself."""
        return [
            sys.executable,
            *runner,
            "-m",
            "gpudra.cli",
            "node",
            *nvml,
            "--driver-name",
            driver,
            "--kubelet-root",
            str(self.kubelet),
            "--cdi-root",
            str(self.cdi),
            "--state-dir",
            str(self.state),
            "--dev-root",
            str(self.host),
            "--no-toolkit-cdi",
            *options,
        ]

    def tool_calls(self) -> list[str]:
        return self.tools_log.read_text().splitlines() if self.tools_log.exists() else []

    def cdi_specs(self) -> list[Path]:
        return sorted(self.cdi.glob("*.json")) if self.cdi.is_dir() else []

    def prepared_claims(self, boot_id_path: Path = DEFAULT_BOOT_ID_PATH) -> list[str]:
        """Claims in the checkpoint (the node process reads the machine's boot ID)."""
        path = self.state / "checkpoint.json"
        assert path.exists()
        cp = load_checkpoint(path, boot_id_path=boot_id_path)
        return [r.uid for r in cp.claims()]


def create_driver_namespace(
    kube: Kube, driver: str, namespace: str, *, labels: dict[str, str] | None = None
) -> None:
    """A namespace for the claims and a DeviceClass of all the driver's devices, a
    driver named for one run so that no other run's slices are allocated; waits for
    the service account, without which the namespace's pods are refused."""
    meta: dict[str, object] = {"name": namespace}
    if labels:
        meta["labels"] = labels
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": driver},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
        }
    )
    wait_for(
        f"service account in {namespace}",
        lambda: kube.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default"),
        timeout=60,
    )


def delete_driver_namespace(kube: Kube, driver: str, namespace: str) -> None:
    """What `create_driver_namespace` and the node made: the pods (at once), the
    driver's slices, the DeviceClass and the namespace."""
    for pod in kube.list("Pod", namespace):
        kube.delete("Pod", pod["metadata"]["name"], namespace, grace=0)
    delete_slices(kube, driver)
    kube.delete("DeviceClass", driver)
    kube.delete("Namespace", namespace)


def delete_slices(kube: Kube, driver: str) -> None:
    """The driver's slices, once its agents are stopped, so that later tests do not
    allocate from nodes nobody serves."""
    for o in kube.list("ResourceSlice", fieldSelector=f"spec.driver={driver}"):
        kube.delete("ResourceSlice", o["metadata"]["name"])
