"""`gpudra migrate`: what a cluster's device plugin configuration becomes under gpudra.

Reads the device plugin's config (a file, a ConfigMap manifest, or the ConfigMap in the
cluster), the nodes that choose among a ConfigMap's configs and, optionally, the
cluster's pods, and prints the chart values and GpuTenants that keep the same behaviour
and the pods whose behaviour would still change. With `--out` it writes ``values.yaml``
(and ``tenants.yaml`` when the plan has GpuTenants) there, and only when the whole
config could be mapped: a half-written plan would hide what gpudra does differently.
A file of an earlier run that this plan does not hold is removed, so the folder never
mixes two plans.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import aiohttp
import anyio
import yaml
from gpudra.cli.agents import AGENT_NAMESPACE, namespace_argument
from gpudra.cli.cluster import add_kubeconfig, connect
from gpudra.cli.terminal import printable
from gpudra.common.files import atomic_write
from gpudra.common.kube import ApiError
from gpudra.webhook import migration
from gpudra.webhook.migration import MigrationError

# What the --nodes and --pods files hold.
NODES_COMMAND: Final = "kubectl get nodes -o yaml"
PODS_COMMAND: Final = "kubectl get pods -A -o yaml"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "migrate",
        help="print the chart values and GpuTenants that keep a device plugin config's behaviour",
        description=__doc__,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--config",
        metavar="FILE",
        help="the device plugin's config file (version: v1), or a ConfigMap manifest "
        "holding it ('-': standard input)",
    )
    source.add_argument(
        "--configmap",
        metavar="NAMESPACE/NAME",
        help="read the device plugin's ConfigMap from the cluster",
    )
    p.add_argument(
        "--config-key",
        metavar="KEY",
        help="the config of nodes without the label nvidia.com/device-plugin.config, when "
        "the ConfigMap holds several (the device plugin chart's config.default; default: "
        "the key 'default')",
    )
    nodes = p.add_mutually_exclusive_group()
    nodes.add_argument(
        "--nodes",
        metavar="FILE",
        help=f"nodes, as `{NODES_COMMAND}` prints them: their label "
        "nvidia.com/device-plugin.config says which of the ConfigMap's configs each runs",
    )
    nodes.add_argument(
        "--cluster-nodes",
        action="store_true",
        help="read the nodes from the cluster",
    )
    p.add_argument(
        "--mig-strategy",
        choices=migration.MIG_STRATEGIES,
        help="the device plugin's --mig-strategy (MIG_STRATEGY; the GPU Operator's "
        "mig.strategy, its chart's migStrategy), which overrides the config's "
        "flags.migStrategy",
    )
    pods = p.add_mutually_exclusive_group()
    pods.add_argument(
        "--pods",
        metavar="FILE",
        help=f"pods to check, as `{PODS_COMMAND}` prints them",
    )
    pods.add_argument(
        "--cluster-pods",
        action="store_true",
        help="check every pod in the cluster",
    )
    p.add_argument(
        "--namespace",
        default=AGENT_NAMESPACE,
        type=namespace_argument,
        metavar="NAMESPACE",
        help="the namespace gpudra is (or will be) installed in: the webhook never reviews "
        "pods there or in kube-system, so their device-plugin requests are never converted "
        f"and such pods are reported (default: {AGENT_NAMESPACE})",
    )
    add_kubeconfig(p)
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write values.yaml (and tenants.yaml, when there are GpuTenants) into DIR "
        "instead of printing them",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    needs_cluster = args.configmap is not None or args.cluster_pods or args.cluster_nodes
    try:
        cluster: dict[str, Any] = (
            anyio.run(
                _read_cluster,
                args.kubeconfig,
                args.configmap,
                args.cluster_nodes,
                args.cluster_pods,
            )
            if needs_cluster
            else {}
        )
        if args.config is not None:
            text = sys.stdin.read() if args.config == "-" else _read(args.config, "--config")
            source = args.config
            texts = migration.config_texts(text, source=source)
        else:
            source, texts = args.configmap, cluster["configs"]
        nodes = cluster.get("nodes")
        if args.nodes is not None:
            nodes = _list(
                _read(args.nodes, "--nodes"), "--nodes", args.nodes, "Node", NODES_COMMAND
            )
        configs = migration.node_configs(
            texts,
            nodes,
            default=args.config_key,
            mig_strategy=args.mig_strategy,
            source=source,
        )
        pods = cluster.get("pods", [])
        if args.pods is not None:
            pods = _list(_read(args.pods, "--pods"), "--pods", args.pods, "Pod", PODS_COMMAND)
        result = migration.plan(configs, pods, own_namespace=args.namespace)
    except MigrationError as exc:
        raise SystemExit(f"gpudra migrate: nothing written:\n{exc}") from None
    files = migration.render(result)
    if args.out is not None:
        _write(args.out, files)
    else:
        for filename, content in files.items():
            # The notes quote the config; the YAML itself escapes what it holds.
            print(f"# --- {filename}\n{printable(content, newlines=True)}", end="")
    if args.pods is None and not args.cluster_pods:
        print("# pods: not checked (give --pods FILE or --cluster-pods)")
    elif not result.pods:
        print(f"# pods: none of {len(pods)} would behave differently")
    else:
        print(f"# pods whose behaviour would change ({len(result.pods)} of {len(pods)}):")
        for change in result.pods:
            print(f"#   {printable(f'{change.namespace}/{change.name}: {change.reason}')}")
    return 0


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"gpudra migrate: {flag} {path}: {exc.strerror}") from None


def _write(out: Path, files: Mapping[str, str]) -> None:
    """Write the plan's files into `out`, each replaced whole, and remove those of an
    earlier run that this plan does not hold: a stale ``tenants.yaml`` beside new values
    would make `nvidia.com/gpu` a share where the new config shares nothing."""
    out.mkdir(parents=True, exist_ok=True)
    for filename, content in files.items():
        atomic_write(out / filename, content.encode(), durable=False)
        print(f"# wrote {printable(str(out / filename))}")
    for filename in migration.PLAN_FILES:
        if filename not in files and (stale := out / filename).exists():
            stale.unlink()
            print(f"# removed {printable(str(stale))}: an earlier run's; this plan has none")


def _list(text: str, flag: str, source: str, kind: str, command: str) -> list[dict[str, Any]]:
    """The objects of `kind` in `text`: one, or a List as `command` prints them."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SystemExit(f"gpudra migrate: {flag} {source}: not YAML: {exc}") from None
    if isinstance(raw, dict) and raw.get("kind") == kind:
        return [raw]
    items = raw.get("items") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise SystemExit(
            f"gpudra migrate: {flag} {source}: items: expected a {kind} List, as `{command}` prints"
        )
    return [p for p in items if isinstance(p, dict)]


async def _read_cluster(
    kubeconfig: str | None, configmap: str | None, with_nodes: bool, with_pods: bool
) -> dict[str, Any]:
    kube = await connect(
        kubeconfig,
        command="migrate",
        otherwise="give the files kubectl prints instead (--config, --nodes, --pods)",
    )
    out: dict[str, Any] = {}
    try:
        if configmap is not None:
            namespace, _, name = configmap.partition("/")
            if not namespace or not name:
                raise SystemExit(
                    f"gpudra migrate: --configmap {configmap!r}: give NAMESPACE/NAME, "
                    "e.g. nvidia-device-plugin/nvidia-device-plugin-configs"
                )
            obj = await kube.request("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}")
            out["configs"] = migration.config_texts(yaml.safe_dump(obj), source=configmap)
        if with_nodes:
            listed = await kube.request("GET", "/api/v1/nodes")
            out["nodes"] = listed.get("items") or []
        if with_pods:
            listed = await kube.request("GET", "/api/v1/pods")
            out["pods"] = listed.get("items") or []
    except (ApiError, aiohttp.ClientError, OSError) as exc:
        raise SystemExit(f"gpudra migrate: reading the cluster failed: {exc}") from None
    finally:
        await kube.close()
    return out
