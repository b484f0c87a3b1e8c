"""`gpudra webhook`: the admission webhook, with its own certificates or cert-manager's.

``--cert-source=self`` (default) makes and rotates a private CA and serving certificate
in ``--cert-dir`` and keeps the configurations' ``caBundle`` current through
`gpudra.webhook.cabundle`. ``--cert-source=files`` serves tls.crt/tls.key from a
mounted cert-manager Secret (reloaded when it changes) and leaves the configurations
and their ``caBundle`` to the chart and cert-manager's CA injector
(``cert-manager.io/inject-ca-from``).
"""

from __future__ import annotations

import argparse
import base64
import logging
from pathlib import Path

import anyio
from gpudra.common.kube import Kube
from gpudra.webhook import registration
from gpudra.webhook.cabundle import (
    CABundleController,
    ConfigurationKind,
    SelfSignedRotation,
    WebhookConfiguration,
)
from gpudra.webhook.certs import (
    TLS_CERT,
    TLS_KEY,
    check_serving_files,
    ensure_pki,
    service_dns_names,
)
from gpudra.webhook.convert import ConversionPolicy
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.templates import ApiClaimReader, ApiTemplateEnsurer
from gpudra.webhook.tenants import TenantController
from gpudra.webhook.validate import driver_classes

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("webhook", help="run the admission webhook (legacy GPU pod conversion)")
    p.add_argument(
        "--cert-dir",
        type=Path,
        required=True,
        help="directory for the CA and serving certificate (created and rotated), or "
        "where the cert-manager Secret is mounted with --cert-source=files",
    )
    p.add_argument(
        "--cert-source",
        choices=["self", "files"],
        default="self",
        help="self: make and rotate a private CA and keep the caBundle current (default); "
        "files: serve the tls.crt/tls.key cert-manager writes, reload on change, and leave "
        "the configurations and their caBundle to the chart and cert-manager's CA injector",
    )
    p.add_argument("--host", default="0.0.0.0", help="listen address")  # noqa: S104
    p.add_argument(
        "--extended-resource-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a legacy resource a DeviceClass maps itself (extendedResourceName, e.g. "
        "nvidia.com/gpu): pods asking for it are left to the scheduler; repeatable",
    )
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
    p.add_argument(
        "--tenants",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply GpuTenant rules and keep their ResourceQuotas (default: on)",
    )
    p.add_argument(
        "--validate-claims",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="register the validating webhook for hand-written ResourceClaims and "
        "ResourceClaimTemplates (default: on)",
    )
    p.add_argument(
        "--device-class",
        action="append",
        default=[],
        metavar="NAME",
        help="another DeviceClass that selects this driver's devices (repeatable); tenant "
        "class rules and claim validation cover it too",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise SystemExit(f"gpudra webhook: --port {args.port} is out of range (1-65535)")
    names = service_dns_names(args.service, args.namespace)
    try:
        if args.cert_source == "files":
            check_serving_files(args.cert_dir)
        else:
            # The server loads the files when it is built: make them first.
            ensure_pki(args.cert_dir, names)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"gpudra webhook: --cert-dir: {exc}") from None

    async def main() -> None:
        kube = await Kube.connect(args.kubeconfig)
        config = ServerConfig(
            cert_file=args.cert_dir / TLS_CERT,
            key_file=args.cert_dir / TLS_KEY,
            host=args.host,
            port=args.port,
            extra_device_classes=tuple(args.device_class),
            policy=ConversionPolicy(native_resources=frozenset(args.extended_resource_name)),
            own_namespace=args.namespace,
        )
        tenants = TenantController(kube, config.policy) if args.tenants else None
        server = WebhookServer(
            config,
            ApiTemplateEnsurer(kube),
            tenants=tenants.state if tenants else None,
            read_claims=ApiClaimReader(kube),
            # Not ready (no traffic from the Service) until the tenant rules are loaded.
            ready=(lambda: tenants.ready) if tenants else None,
        )
        async with anyio.create_task_group() as tg:
            if tenants is not None:
                tg.start_soon(tenants.run)
            await tg.start(server.serve)
            if args.cert_source == "files":
                # cert-manager renews the files (the server reloads them) and injects
                # the caBundle into the chart's configurations: nothing to manage here.
                await anyio.sleep_forever()
            configurations = [WebhookConfiguration(ConfigurationKind.MUTATING, registration.NAME)]
            if args.validate_claims:
                configurations.append(
                    WebhookConfiguration(ConfigurationKind.VALIDATING, registration.VALIDATING_NAME)
                )
            bundles = CABundleController(kube, configurations)
            # Rotation (hourly, sooner during a CA rollover) hands each new bundle to the
            # controller, which writes it at once and puts it back after foreign edits.
            await tg.start(SelfSignedRotation(args.cert_dir, names, bundles).run)
            watching = False
            while True:
                # The whole configurations are re-applied hourly so other drift is undone.
                assert bundles.bundle is not None  # set by the rotation's first check
                bundle_b64 = base64.b64encode(bundles.bundle).decode("ascii")
                target = (
                    {"url": args.url}
                    if args.url
                    else {"service": (args.service, args.namespace, args.port)}
                )
                await registration.apply(
                    kube,
                    registration.mutating_configuration(
                        ca_bundle_b64=bundle_b64,
                        own_namespace=args.namespace,
                        native_resources=args.extended_resource_name,
                        **target,
                    ),
                )
                if args.validate_claims:
                    await registration.apply(
                        kube,
                        registration.validating_configuration(
                            ca_bundle_b64=bundle_b64,
                            own_namespace=args.namespace,
                            device_classes=sorted(driver_classes(config.policy, args.device_class)),
                            driver=config.policy.driver,
                            **target,
                        ),
                    )
                if not watching:
                    await tg.start(bundles.run)
                    watching = True
                await anyio.sleep(3600)

    anyio.run(main)
    return 0
