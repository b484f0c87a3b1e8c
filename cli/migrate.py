"""`gpudra migrate`: what a cluster's device plugin configuration becomes under gpudra.

Reads the device plugin's config (a file, a ConfigMap manifest, or the ConfigMap in the
cluster) and, optionally, the cluster's pods, and prints the chart values and GpuTenants
that keep the same behaviour and the pods whose behaviour would still change. With
`--out` it writes ``values.yaml`` and ``tenants.yaml`` there, and only when the whole
config could be mapped: a half-written plan would hide what gpudra does differently.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import yaml
from gpudra.cli.terminal import printable
from gpudra.common.files import atomic_write
from gpudra.common.kube import ApiError, Kube
from gpudra.webhook import migration
from gpudra.webhook.migration import MigrationError


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
        help="the config to use when the ConfigMap holds several (one per node label "
        "nvidia.com/device-plugin.config value)",
    )
    pods = p.add_mutually_exclusive_group()
    pods.add_argument(
        "--pods",
        metavar="FILE",
        help="pods to check, as `kubectl get pods -A -o yaml` prints them",
    )
    pods.add_argument(
        "--cluster-pods",
        action="store_true",
        help="check every pod in the cluster",
    )
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write values.yaml and tenants.yaml into DIR instead of printing them",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    needs_cluster = args.configmap is not None or args.cluster_pods
    try:
        cluster: dict[str, Any] = (
            anyio.run(_read_cluster, args.kubeconfig, args.configmap, args.cluster_pods)
            if needs_cluster
            else {}
        )
        if args.config is not None:
            text = sys.stdin.read() if args.config == "-" else _read(args.config, "--config")
            configs = migration.config_texts(text, source=args.config)
        else:
            configs = cluster["configs"]
        name, text = _pick(configs, args.config_key)
        config = migration.parse_config(text, source=name)
    except MigrationError as exc:
        raise SystemExit(f"gpudra migrate: nothing written:\n{exc}") from None
    pods = cluster.get("pods", [])
    if args.pods is not None:
        pods = _pod_list(_read(args.pods, "--pods"), args.pods)
    result = migration.plan(config, pods)
    files = migration.render(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for filename, content in files.items():
            atomic_write(args.out / filename, content.encode(), durable=False)
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


def _pick(configs: Mapping[str, str], key: str | None) -> tuple[str, str]:
    """The one config to map: `key`, or the only one there is."""
    if key is not None:
        if key not in configs:
            raise MigrationError(
                "--config-key", [f"{key!r} is not in the ConfigMap; it holds {sorted(configs)}"]
            )
        return key, configs[key]
    if len(configs) > 1:
        raise MigrationError(
            "--config-key",
            [
                f"the ConfigMap holds {len(configs)} configs ({', '.join(sorted(configs))}); "
                "name the one to map (run once per config your nodes use)"
            ],
        )
    ((name, text),) = configs.items()
    return name, text


def _pod_list(text: str, source: str) -> list[dict[str, Any]]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SystemExit(f"gpudra migrate: --pods {source}: not YAML: {exc}") from None
    if isinstance(raw, dict) and raw.get("kind") == "Pod":
        return [raw]
    items = raw.get("items") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise SystemExit(
            f"gpudra migrate: --pods {source}: items: expected a pod List, as "
            "`kubectl get pods -A -o yaml` prints"
        )
    return [p for p in items if isinstance(p, dict)]


async def _read_cluster(
    kubeconfig: str | None, configmap: str | None, with_pods: bool
) -> dict[str, Any]:
    kube = await Kube.connect(kubeconfig)
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
        if with_pods:
            listed = await kube.request("GET", "/api/v1/pods")
            out["pods"] = listed.get("items") or []
    except ApiError as exc:
        raise SystemExit(f"gpudra migrate: {exc}") from None
    finally:
        await kube.close()
    return out
