"""`gpudra node`: the per-node agent (discovery, health taints, ResourceSlices)."""

from __future__ import annotations

import argparse
import logging
import os

import anyio
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import MigStrategy
from gpudra.driver.health import HealthPolicy, TaintEffect
from gpudra.driver.nvml import NvmlLoadError, ProfileError, load_nvml

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="run the node agent: discover GPUs and publish ResourceSlices")
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="this node's name (default: $NODE_NAME)",
    )
    p.add_argument("--driver-name", default="gpu.nvidia.com", help="DRA driver name")
    p.add_argument(
        "--nvml",
        default="real",
        help="'real', 'emulated:<profile>' or 'emulated:<file.json>' (default: real)",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)"
    )
    p.add_argument(
        "--mig-strategy",
        choices=[s.value for s in MigStrategy],
        default="dynamic",
        help="publish existing MIG devices (static) or every placement (dynamic)",
    )
    p.add_argument(
        "--critical-xid-effect",
        choices=["NoSchedule", "NoExecute"],
        default="NoSchedule",
        help="taint effect for critical XIDs",
    )
    p.add_argument(
        "--application-xids",
        default="",
        help="extra comma-separated XIDs treated as application errors (effect None)",
    )
    p.add_argument(
        "--recovery-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="remove a health taint after this long without new errors",
    )
    p.set_defaults(func=run)


def _xids(raw: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise SystemExit(
            f"gpudra node: --application-xids {raw!r}: give integers, e.g. 13,31"
        ) from None


def run(args: argparse.Namespace) -> int:
    if not args.node_name:
        raise SystemExit("gpudra node: --node-name is required (or set NODE_NAME)")
    try:
        nvml = load_nvml(args.nvml)
    except (NvmlLoadError, ProfileError) as e:
        raise SystemExit(f"gpudra node: --nvml: {e}") from None
    policy = HealthPolicy(
        driver_name=args.driver_name,
        critical_effect=TaintEffect(args.critical_xid_effect),
        extra_application_xids=_xids(args.application_xids),
        recovery_after_s=args.recovery_after,
    )
    config = AgentConfig(
        node_name=args.node_name,
        driver_name=args.driver_name,
        mig_strategy=MigStrategy(args.mig_strategy),
        health=policy,
    )

    async def main() -> None:
        kube = await Kube.connect(args.kubeconfig)
        try:
            await NodeAgent(config, kube, nvml).run()
        finally:
            await kube.close()

    anyio.run(main)
    return 0
