"""`gpudra node --emulated-profile-label`: each node's emulated profile named by a label
on its Node (kind's `nodes[].labels`, a node pool's labels), read from the API server
when the agent starts; nodes without it keep `--nvml`'s profile, and a label naming no
profile stops the agent with one line naming the node, the label and the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web
from gpudra.cli.node import node_nvml
from gpudra.common.backoff import Backoff
from gpudra.common.kube import Kube
from gpudra.driver.nvml import NvmlLoadError, builtin_profile_names, labelled_nvml
from kubernetes_asyncio.client import ApiClient, Configuration

LABEL = "gpudra.dev/emulated-profile"
DEFAULT = "emulated:h100-80gb-hbm3-x8"
FAST = Backoff(first_s=0.01, max_s=0.01)


def node(labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": labels}}


@asynccontextmanager
async def api_server(*replies: tuple[int, dict[str, Any]]) -> AsyncIterator[tuple[str, list[str]]]:
    """An API server answering GETs with `replies` in turn (the last one repeats), and
    the paths it was asked for."""
    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        status, body = replies[min(len(asked), len(replies)) - 1]
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


def kube(host: str) -> Kube:
    return Kube(ApiClient(configuration=Configuration(host=host)))


@pytest.mark.parametrize(
    ("labels", "expected"),
    [({}, DEFAULT), ({LABEL: "l4"}, "emulated:l4"), ({"other": "t4"}, DEFAULT)],
    ids=["unlabelled", "labelled", "other-label"],
)
def test_the_label_names_the_profile_and_unlabelled_nodes_keep_nvml(
    labels: dict[str, str], expected: str
) -> None:
    assert labelled_nvml(DEFAULT, label=LABEL, node="n1", labels=labels) == expected


def test_a_label_naming_no_profile_names_the_node_the_label_and_the_fix() -> None:
    with pytest.raises(NvmlLoadError) as e:
        labelled_nvml(DEFAULT, label=LABEL, node="n1", labels={LABEL: "h200"})
    assert str(e.value) == (
        f"node n1 has label {LABEL}='h200' (--emulated-profile-label {LABEL}), which names "
        f"no emulated profile: set it to one of {', '.join(builtin_profile_names())} "
        f"(kubectl label node n1 {LABEL}=<profile> --overwrite), or remove it to use "
        f"--nvml {DEFAULT}"
    )


def test_real_gpus_take_no_profile_label() -> None:
    with pytest.raises(NvmlLoadError, match=r"needs --nvml emulated:<profile> .* not --nvml real"):
        labelled_nvml("real", label=LABEL, node="n1", labels={LABEL: "l4"})


@pytest.mark.anyio
async def test_the_agent_reads_its_node_and_waits_out_a_server_not_ready() -> None:
    async with api_server((503, {"message": "starting"}), (200, node({LABEL: "l4"}))) as (
        host,
        asked,
    ):
        k = kube(host)
        try:
            assert await node_nvml(k, "n1", DEFAULT, LABEL, FAST) == "emulated:l4"
        finally:
            await k.close()
    assert asked == ["/api/v1/nodes/n1", "/api/v1/nodes/n1"]


@pytest.mark.anyio
async def test_a_refused_node_read_stops_with_the_reason() -> None:
    async with api_server((403, {"message": "nodes is forbidden"})) as (host, asked):
        k = kube(host)
        try:
            with pytest.raises(NvmlLoadError, match=r"reading node n1: .*nodes is forbidden"):
                await node_nvml(k, "n1", DEFAULT, LABEL, FAST)
        finally:
            await k.close()
    assert len(asked) == 1  # no retry mends a refusal


@pytest.mark.anyio
async def test_the_agent_stops_with_one_line_when_its_label_names_no_profile(
    tmp_path: Path,
) -> None:
    """`gpudra node` as the chart starts it, against an API server whose Node carries
    an unknown profile: nothing is published, one line says what to change."""
    async with api_server((200, node({LABEL: "h200"}))) as (host, _asked):
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": host}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        argv = [
            sys.executable, "-m", "gpudra.cli", "node", "--node-name", "n1",
            f"--nvml={DEFAULT}", f"--emulated-profile-label={LABEL}",
            "--kubeconfig", str(kubeconfig), "--state-dir", str(tmp_path / "state"),
        ]  # fmt: skip
        proc = await anyio.run_process(argv, check=False)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1
    assert lines[-1].startswith(f"gpudra node: node n1 has label {LABEL}='h200' "), lines
    assert "set it to one of" in lines[-1]
    assert not (tmp_path / "state").exists()  # stopped before any emulated state was written


def test_the_flag_is_refused_with_real_gpus() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpudra.cli", "node", "--node-name", "n1", "--nvml=real",
         f"--emulated-profile-label={LABEL}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"gpudra node: --emulated-profile-label {LABEL} needs --nvml emulated:<profile>"
        )
    )
