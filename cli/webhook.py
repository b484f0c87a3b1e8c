"""`gpudra webhook`: the admission webhook, with its own certificates."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import anyio
from gpudra.common.kube import Kube
from gpudra.webhook import registration
from gpudra.webhook.certs import TLS_CERT, TLS_KEY, ensure_pki, service_dns_names
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.templates import ApiTemplateEnsurer

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("webhook", help="run the admission webhook (legacy GPU pod conversion)")
    p.add_argument(
        "--cert-dir",
        type=Path,
        required=True,
        help="directory for the CA and serving certificate (created and rotated)",
    )
    p.add_argument("--host", default="0.0.0.0", help="listen address")  # noqa: S104
    p.add_argument("--port", type=int, default=8443, help="listen port")
    p.add_argument("--service", default="gpudra-webhook", help="the webhook's Service name")
    p.add_argument("--namespace", default="gpudra", help="the driver's namespace")
    p.add_argument(
        "--url",
        default=None,
        help="register this URL instead of the Service (for a local control plane)",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise SystemExit(f"gpudra webhook: --port {args.port} is out of range (1-65535)")
    names = service_dns_names(args.service, args.namespace)

    async def main() -> None:
        kube = await Kube.connect(args.kubeconfig)
        server = WebhookServer(
            ServerConfig(
                cert_file=args.cert_dir / TLS_CERT,
                key_file=args.cert_dir / TLS_KEY,
                host=args.host,
                port=args.port,
            ),
            ApiTemplateEnsurer(kube),
        )
        async with anyio.create_task_group() as tg:
            ensure_pki(args.cert_dir, names)
            await tg.start(server.serve)
            while True:
                # Rotation is checked hourly; the server reloads the files itself and
                # the configuration's caBundle is re-applied so it stays current.
                pki, _changed = ensure_pki(args.cert_dir, names)
                target = (
                    {"url": args.url}
                    if args.url
                    else {"service": (args.service, args.namespace, args.port)}
                )
                await registration.apply(
                    kube,
                    registration.mutating_configuration(
                        ca_bundle_b64=pki.ca_bundle_base64(), own_namespace=args.namespace, **target
                    ),
                )
                await anyio.sleep(3600)

    anyio.run(main)
    return 0
