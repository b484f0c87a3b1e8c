"""The DaemonSet's liveness probe (charts/gpudra/files/probe.py) against the real kubelet
plugin servers: it passes while both gRPC services answer and fails once they stop."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from gpudra.driver.claims import Claim, ClaimRef
from gpudra.driver.plugin import DRA_V1, DRA_V1BETA1, KubeletPlugin, PrepareResult

PROBE = Path(__file__).resolve().parents[2] / "charts" / "gpudra" / "files" / "probe.py"
DRIVER = "gpu.nvidia.com"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class NoClaims:
    """A device layer with nothing to prepare: the probe sends no claims."""

    async def read(self, ref: ClaimRef) -> Claim:
        raise AssertionError("the probe must never prepare a claim")

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]:
        assert claims == [], "the probe must never prepare a claim"
        return {}

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        return {}


def probe(
    root: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROBE), str(root), DRIVER, *extra],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "POD_UID"} | (env or {}),
    )


async def test_probe_follows_the_plugin() -> None:
    # A short root: unix socket paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="kl-") as tmp:
        root = Path(tmp)
        async with KubeletPlugin(DRIVER, NoClaims(), claims=NoClaims(), kubelet_root=root):
            ok = await anyio.to_thread.run_sync(probe, root)
            assert ok.returncode == 0, ok.stderr
        stopped = await anyio.to_thread.run_sync(probe, root)
    assert stopped.returncode == 1
    assert "/pluginregistration.Registration/GetInfo" in stopped.stderr


async def test_probe_uses_the_pods_sockets_during_a_rolling_update() -> None:
    with tempfile.TemporaryDirectory(prefix="kl-") as tmp:
        root = Path(tmp)
        async with KubeletPlugin(
            DRIVER, NoClaims(), claims=NoClaims(), kubelet_root=root, pod_uid="pod-new"
        ):
            ok = await anyio.to_thread.run_sync(probe, root, "pod-new")
            assert ok.returncode == 0, ok.stderr
            # Another pod's sockets (the old pod of the update) are not this pod's health.
            other = await anyio.to_thread.run_sync(probe, root, "pod-old")
            assert other.returncode == 1


async def test_probe_finds_the_shortened_sockets_under_a_long_kubelet_root() -> None:
    """Under a long kubelet root the plugin names its sockets after a digest of the
    pod UID (the full UID would pass the unix path limit); the probe follows."""
    uid = "a464f592-31c6-49a5-b251-e04b7587c836"
    with tempfile.TemporaryDirectory(prefix="kl-") as tmp:
        root = Path(tmp) / ("k" * 30)
        async with KubeletPlugin(
            DRIVER, NoClaims(), claims=NoClaims(), kubelet_root=root, pod_uid=uid
        ) as plugin:
            assert uid not in plugin.registration_socket.name
            ok = await anyio.to_thread.run_sync(probe, root, uid)
            assert ok.returncode == 0, ok.stderr


async def test_probe_takes_the_pod_uid_from_the_environment() -> None:
    """The kubelet runs an exec probe's command unexpanded (a `$(POD_UID)` argument
    stays literal) but with the container's environment, so the chart passes no UID
    and the probe reads $POD_UID."""
    uid = "a464f592-31c6-49a5-b251-e04b7587c836"
    with tempfile.TemporaryDirectory(prefix="kl-") as tmp:
        root = Path(tmp)
        async with KubeletPlugin(
            DRIVER, NoClaims(), claims=NoClaims(), kubelet_root=root, pod_uid=uid
        ):
            ok = await anyio.to_thread.run_sync(
                functools.partial(probe, root, env={"POD_UID": uid})
            )
            assert ok.returncode == 0, ok.stderr
            without = await anyio.to_thread.run_sync(probe, root)
            assert without.returncode == 1


@pytest.mark.parametrize("api", [DRA_V1, DRA_V1BETA1])
async def test_probe_passes_whichever_dra_api_the_plugin_serves(api: str) -> None:
    """A plugin told to serve one version (`--dra-api`, as the kubelet version tests run
    it) is alive all the same: asked for a method it does not serve, the probe asks the
    other version's."""
    with tempfile.TemporaryDirectory(prefix="kl-") as tmp:
        root = Path(tmp)
        async with KubeletPlugin(
            DRIVER, NoClaims(), claims=NoClaims(), kubelet_root=root, dra_apis=(api,)
        ):
            ok = await anyio.to_thread.run_sync(probe, root)
            assert ok.returncode == 0, ok.stderr
