"""`gpudra webhook`: the admission webhook, with its own certificates, the chart's CA, or
cert-manager's.

``--cert-source=self`` (default) makes and rotates a private CA and serving certificate
in ``--cert-dir`` and keeps the configurations' ``caBundle`` current through
`gpudra.webhook.cabundle`; the pod is ready only once that bundle is in every
configuration, so a restarted pod gets no traffic the API server cannot verify.
``--cert-source=ca`` signs and renews the serving certificate in ``--cert-dir`` from the
CA the chart keeps in its Secret (``--ca-dir``, `gpudra.webhook.renewal`); the chart owns
the ``caBundle``. ``--cert-source=files`` serves tls.crt/tls.key from a mounted
cert-manager Secret (reloaded when it changes) and leaves the configurations and their
``caBundle`` to the chart and cert-manager's CA injector (``cert-manager.io/inject-ca-from``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import ssl
import uuid
from pathlib import Path
from typing import Any, Final

import anyio
from gpudra.api.config import (
    API_VERSION,
    GPU_CONFIG_KIND,
    INTERVALS,
    STRATEGIES,
    ConfigError,
    GpuConfig,
    parse_opaque_config,
)
from gpudra.api.deviceclasses import mig_profile_class
from gpudra.api.names import DNS_SUBDOMAIN_MAX, dns_subdomain_problem, driver_name_problem
from gpudra.api.tenants import LabelSelector, quota_key
from gpudra.cli.cluster import add_kubeconfig
from gpudra.cli.flagvalues import seconds_within
from gpudra.common.eventloop import run_event_loop
from gpudra.common.kube import Kube
from gpudra.common.leader import LeaderElector
from gpudra.common.openfiles import raise_open_files_limit
from gpudra.common.signals import stop_on_signal
from gpudra.webhook import registration
from gpudra.webhook.cabundle import (
    ROLLOUT_OVERLAP_S,
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
from gpudra.webhook.convert import DEFAULT_POLICY, ConversionPolicy, is_legacy_resource
from gpudra.webhook.device_classes import DeviceClassCache
from gpudra.webhook.metrics import QuotaLeader
from gpudra.webhook.pod_security import ENFORCE_LABEL, LEVELS, PRIVILEGED
from gpudra.webhook.renewal import ServingRenewal
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.templates import ApiClaimReader, ApiTemplateEnsurer
from gpudra.webhook.tenants import TenantController
from gpudra.webhook.transport import HttpConfig
from gpudra.webhook.validate import driver_classes
from pydantic import ValidationError

log = logging.getLogger(__name__)

SHUTDOWN_DELAY_S: Final = 5.0
"""How long a stopping replica serves on: the API servers' endpoint watch and their
connections to it catch up within a few seconds of the pod's deletion."""
MAX_SHUTDOWN_DELAY_S: Final = 20.0
"""Under the pod's default grace period (30 s), leaving the clean-up its time."""
QUOTA_LEASE: Final = "gpudra-webhook-tenant-quotas"
"""The Lease whose holder is the one replica writing the tenants' ResourceQuotas (the
chart's Role grants it by this name)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("webhook", help="run the admission webhook (legacy GPU pod conversion)")
    p.add_argument(
        "--cert-dir",
        type=Path,
        required=True,
        help="directory for the CA and serving certificate (created and rotated), for the "
        "serving certificate alone with --cert-source=ca, or where the cert-manager Secret "
        "is mounted with --cert-source=files",
    )
    p.add_argument(
        "--cert-source",
        choices=["self", "ca", "files"],
        default="self",
        help="self: make and rotate a private CA and keep the caBundle current (default); "
        "ca: sign and renew the serving certificate from the CA in --ca-dir (the chart's "
        "Secret), whose caBundle the chart registers; "
        "files: serve the tls.crt/tls.key cert-manager writes, reload on change, and leave "
        "the configurations and their caBundle to the chart and cert-manager's CA injector",
    )
    p.add_argument(
        "--ca-dir",
        type=Path,
        default=None,
        help="with --cert-source=ca: where ca.crt and ca.key are mounted",
    )
    p.add_argument("--host", default="0.0.0.0", help="listen address")  # noqa: S104
    p.add_argument(
        "--client-ca-file",
        type=Path,
        default=None,
        help="refuse every connection to --port without a client certificate signed by "
        "this CA (PEM): the one that signs the certificate the API server presents from "
        "its admission kubeConfigFile; /healthz, /readyz and /metrics move to --health-port",
    )
    p.add_argument(
        "--client-cert-name",
        action="append",
        default=[],
        metavar="NAME",
        help="with --client-ca-file: serve only a client certificate whose subject common "
        "name or a DNS name is NAME (repeat for more) and that has the clientAuth extended "
        "key usage; without it any certificate the CA signed is served, which for a "
        "cluster's CA means every kubelet's too",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="with --client-ca-file: a port serving /healthz, /readyz and /metrics "
        "without client certificates, for the kubelet's probes and metrics scrapers",
    )
    p.add_argument(
        "--extended-resource-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a legacy resource a DeviceClass maps itself (extendedResourceName, e.g. "
        "nvidia.com/gpu): pods asking for it are left to the scheduler while a stored "
        "DeviceClass of the driver carries it, and converted otherwise; repeatable",
    )
    p.add_argument(
        "--conversion-namespace-selector",
        type=_label_selector,
        default=None,
        metavar="JSON",
        help='a LabelSelector as JSON, e.g. \'{"matchLabels":{"gpudra.nvidia.com/dra":"true"}}\': '
        "only pods in the namespaces it picks are converted; pods elsewhere stay on the "
        "device plugin during a migration (default: all). With --tenants the webhook "
        "evaluates it and pods elsewhere still get the tenant rules; without, it narrows "
        "the pod webhook's registration",
    )
    p.add_argument("--port", type=int, default=8443, help="listen port")
    p.add_argument(
        "--max-connections",
        type=int,
        default=HttpConfig.max_connections,
        metavar="N",
        help="connections held open at most on each port, and as many TLS handshakes; at the "
        "bound a new one takes the place of the one idle (or in its handshake) longest "
        "(lowered at start to what the open-files limit allows; default: "
        f"{HttpConfig.max_connections})",
    )
    p.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        default=HttpConfig.max_buffered_body_bytes,
        metavar="BYTES",
        help="request-body bytes buffered at once over both ports; past it the bodies "
        "received longest are answered 503, or the new request when that makes no room "
        f"(default: {HttpConfig.max_buffered_body_bytes}; at least the largest body, "
        f"{HttpConfig.max_body_bytes})",
    )
    p.add_argument("--service", default="gpudra-webhook", help="the webhook's Service name")
    p.add_argument("--namespace", default="gpudra", help="the driver's namespace")
    p.add_argument(
        "--url",
        default=None,
        help="register this URL instead of the Service (for a local control plane)",
    )
    add_kubeconfig(p)
    p.add_argument(
        "--tenants",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply GpuTenant rules and keep their ResourceQuotas (default: on)",
    )
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --tenants: only the replica holding the Lease --leader-elect-lease-name "
        "writes the tenants' ResourceQuotas, so replicas of two releases never overwrite "
        "each other's during a rollout; the others keep their caches and admit as usual "
        "(default: on)",
    )
    p.add_argument(
        "--shutdown-delay",
        type=_shutdown_seconds,
        default=SHUTDOWN_DELAY_S,
        metavar="SECONDS",
        help="after SIGTERM, serve reviews this long more, not ready and writing no "
        "quota, while the API servers stop sending them here (its endpoint withdrawn); "
        f"a second signal ends it (default: {SHUTDOWN_DELAY_S:g}; 0: stop at once)",
    )
    p.add_argument(
        "--leader-elect-lease-name",
        default=QUOTA_LEASE,
        type=_lease_name,
        metavar="NAME",
        help=f"the coordination.k8s.io Lease of the quota writer (default: {QUOTA_LEASE})",
    )
    p.add_argument(
        "--leader-elect-lease-namespace",
        default=None,
        metavar="NAMESPACE",
        help="the Lease's namespace (default: --namespace)",
    )
    p.add_argument(
        "--leader-elect-identity",
        default=None,
        metavar="ID",
        help="this replica's name in the Lease, unique among the replicas (default: "
        "$POD_NAME, which the chart sets from the pod's name, else the host name and a "
        "random suffix)",
    )
    p.add_argument(
        "--pod-security-default",
        choices=LEVELS,
        default=PRIVILEGED,
        help="the Pod Security level the API server enforces in namespaces without the "
        f"{ENFORCE_LABEL} label (its PodSecurity admission configuration's default); "
        "tenant namespaces at privileged are reported, since a privileged pod gets every "
        f"GPU of its node without a claim (default: {PRIVILEGED}, Kubernetes' own)",
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
        type=_device_class_name,
        metavar="NAME",
        help="another DeviceClass that selects this driver's devices (repeatable); tenant "
        "class rules and claim validation cover it too",
    )
    p.add_argument(
        "--mig-profile-class",
        action="append",
        default=[],
        metavar="PROFILE",
        help="a MIG profile served by its own DeviceClass, mig-<profile>.nvidia.com "
        "(repeatable; the chart's deviceClasses.mig.profiles): converted "
        "nvidia.com/mig-<profile> claims request it, and tenant MIG-profile rules read the "
        "profile from it",
    )
    p.add_argument(
        "--driver-name",
        default=DEFAULT_POLICY.driver,
        help="the DRA driver name (the node agent's --driver-name): converted MIG "
        "selectors, converted configs, config validation and the tenant sharing check "
        f"use it (default: {DEFAULT_POLICY.driver})",
    )
    p.add_argument(
        "--shared-strategy",
        choices=STRATEGIES,
        default=DEFAULT_POLICY.shared_strategy,
        help="how converted shared GPUs (nvidia.com/gpu.shared) are shared, the shared "
        "DeviceClass's strategy; a GpuTenant's gpuResource mapping overrides it in its "
        f"namespaces (default: {DEFAULT_POLICY.shared_strategy})",
    )
    p.add_argument(
        "--time-slice-interval",
        choices=INTERVALS,
        default=DEFAULT_POLICY.time_slice_interval,
        help="time-slice interval of converted TimeSlicing GPUs, the shared DeviceClass's "
        f"(default: {DEFAULT_POLICY.time_slice_interval})",
    )
    p.add_argument(
        "--shared-whole-gpu-fallback",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_POLICY.shared_whole_gpu_fallback,
        help="converted shared GPUs (nvidia.com/gpu.shared) take a whole GPU where no GPU "
        "is published with shares (default: on). --no-shared-whole-gpu-fallback: one "
        "share or nothing, so they run only on nodes with --gpu-shares, and a queue "
        "counting nvidia.com/gpu.shared (Kueue, which cannot admit a pod whose claim has "
        "the fallback) is charged a share per unit, never a whole GPU",
    )
    p.add_argument(
        "--mps-default-active-thread-percentage",
        type=int,
        default=None,
        metavar="PERCENT",
        help="with --shared-strategy=MPS: the shared DeviceClass's "
        "mpsConfig.defaultActiveThreadPercentage, carried by converted MPS claims "
        "(default: the driver's)",
    )
    p.add_argument(
        "--mps-default-pinned-device-memory-limit",
        default=None,
        metavar="QUANTITY",
        help="with --shared-strategy=MPS: the shared DeviceClass's "
        "mpsConfig.defaultPinnedDeviceMemoryLimit (e.g. 10Gi), carried by converted MPS "
        "claims (default: the driver's)",
    )
    p.set_defaults(func=run)


def _device_class_name(raw: str) -> str:
    """--device-class: a DeviceClass name that also makes a valid ResourceQuota key (a
    tenant's quota limits every class of the driver)."""
    longest = DNS_SUBDOMAIN_MAX - len(quota_key("").split("/")[0])
    if problem := dns_subdomain_problem(raw, max_length=longest):
        raise argparse.ArgumentTypeError(
            f"{raw!r} {problem}; give a DeviceClass's name (it is also part of the "
            "tenants' quota keys)"
        )
    return raw


def _shutdown_seconds(raw: str) -> float:
    """--shutdown-delay: seconds, 0 or more, well under the pod's grace period."""
    value = seconds_within(raw, 0, MAX_SHUTDOWN_DELAY_S)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"{raw!r}: give seconds from 0 to {MAX_SHUTDOWN_DELAY_S:g}, under the pod's "
            f"termination grace period (30 s by default), e.g. {SHUTDOWN_DELAY_S:g}"
        )
    return value


def _lease_name(raw: str) -> str:
    """--leader-elect-lease-name: a Lease's name is a DNS subdomain."""
    if problem := dns_subdomain_problem(raw):
        raise argparse.ArgumentTypeError(
            f"{raw!r} {problem}; give a Lease name such as {QUOTA_LEASE}, the one the "
            "chart's Role grants"
        )
    return raw


def quota_leader(args: argparse.Namespace, kube: Kube) -> LeaderElector | None:
    """The elector of the one quota writer, as the flags ask; None where every replica
    writes (--no-leader-elect) or none does (--no-tenants). Identity: the pod's name
    from the downward API ($POD_NAME); else, as kube-controller-manager's, the host name
    with a random suffix, since two webhooks on one host (or pods with hostNetwork,
    whose host name is the node's) would otherwise both take the lease as theirs."""
    if not (args.tenants and args.leader_elect):
        return None
    identity = (
        args.leader_elect_identity
        or os.environ.get("POD_NAME")
        or f"{socket.gethostname()}_{uuid.uuid4()}"
    )
    return LeaderElector(
        kube,
        name=args.leader_elect_lease_name,
        namespace=args.leader_elect_lease_namespace or args.namespace,
        identity=identity,
    )


def _label_selector(raw: str) -> dict[str, Any]:
    """--conversion-namespace-selector, checked by the model GpuTenant selectors use."""
    try:
        selector = LabelSelector.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in error["loc"]) or "the selector"
        raise argparse.ArgumentTypeError(
            f"{where}: {error['msg']}; give a LabelSelector as JSON, e.g. "
            '\'{"matchLabels":{"gpudra.nvidia.com/dra":"true"}}\''
        ) from None
    dumped: dict[str, Any] = selector.model_dump(exclude_none=True)
    return dumped


def conversion_policy(args: argparse.Namespace) -> ConversionPolicy:
    """The base conversion policy the flags describe (tenants layer their rules on it)."""
    if problem := driver_name_problem(args.driver_name):
        raise SystemExit(
            f"gpudra webhook: --driver-name {args.driver_name!r} {problem}: give the node "
            "agent's driver name, e.g. gpu.nvidia.com"
        )
    for name in args.extended_resource_name:
        if not is_legacy_resource(name):
            # The tenant rules count the device plugin's names at a pod's admission; a
            # name of another form would be counted only when the scheduler creates the
            # pod's claim, after the pod was admitted.
            raise SystemExit(
                f"gpudra webhook: --extended-resource-name {name!r} is not a device-plugin "
                "resource (nvidia.com/gpu, nvidia.com/gpu.shared, nvidia.com/mig-<profile>), "
                "which the tenant rules count at a pod's admission: map nvidia.com/gpu, or "
                "have pods ask for the DeviceClass by name "
                "(deviceclass.resource.kubernetes.io/<class>)"
            )
    return ConversionPolicy(
        driver=args.driver_name,
        shared_strategy=args.shared_strategy,
        time_slice_interval=args.time_slice_interval,
        shared_whole_gpu_fallback=args.shared_whole_gpu_fallback,
        mps_config=_mps_config(args),
        native_resources=frozenset(args.extended_resource_name),
        mig_profile_classes=tuple(_mig_profiles(args.mig_profile_class)),
    )


def device_class_cache(
    args: argparse.Namespace, policy: ConversionPolicy
) -> DeviceClassCache | None:
    """The DeviceClasses' mirror, where a decision reads it: claim validation resolves
    sharing with their configs, and a native resource is left to the scheduler only while
    a stored class maps it (the API server drops extendedResourceName while its
    DRAExtendedResource gate is off); without the mirror such pods are always converted."""
    if args.validate_claims or policy.native_resources:
        return DeviceClassCache(policy.driver)
    return None


def server_config(args: argparse.Namespace, policy: ConversionPolicy) -> ServerConfig:
    """The server's listener, limits and admission settings, as the flags give them."""
    return ServerConfig(
        cert_file=args.cert_dir / TLS_CERT,
        key_file=args.cert_dir / TLS_KEY,
        host=args.host,
        port=args.port,
        max_connections=args.max_connections,
        max_buffered_body_bytes=args.max_buffered_body_bytes,
        extra_device_classes=tuple(args.device_class),
        policy=policy,
        own_namespace=args.namespace,
        conversion_selector=(
            LabelSelector.model_validate(args.conversion_namespace_selector)
            if args.conversion_namespace_selector
            else None
        ),
    )


def _mig_profiles(profiles: list[str]) -> list[str]:
    """The --mig-profile-class values, each a MIG profile whose class name is valid."""
    for profile in profiles:
        try:
            mig_profile_class(profile)
        except ValueError as exc:
            raise SystemExit(f"gpudra webhook: --mig-profile-class: {exc}") from None
    return profiles


def _mps_config(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """The MPS defaults as the driver's own config parser accepts them, so a value the
    kubelet plugin would refuse fails here, at start, naming the flag."""
    flags = {
        "defaultActiveThreadPercentage": (
            "--mps-default-active-thread-percentage",
            args.mps_default_active_thread_percentage,
        ),
        "defaultPinnedDeviceMemoryLimit": (
            "--mps-default-pinned-device-memory-limit",
            args.mps_default_pinned_device_memory_limit,
        ),
    }
    given = {wire: value for wire, (_, value) in flags.items() if value not in (None, "")}
    if not given:
        return ()
    if args.shared_strategy != "MPS":
        raise SystemExit(
            f"gpudra webhook: {', '.join(flags[w][0] for w in given)}: MPS settings apply "
            "only with --shared-strategy=MPS; drop them or add --shared-strategy=MPS"
        )
    raw = {
        "apiVersion": API_VERSION,
        "kind": GPU_CONFIG_KIND,
        "sharing": {"strategy": "MPS", "mpsConfig": given},
    }
    try:
        config = parse_opaque_config(raw)
    except ConfigError as exc:
        problems = []
        for issue in exc.issues:
            wire = issue.path.rsplit(".", 1)[-1]  # sharing.mpsConfig.<wire name>
            flag = f"{flags[wire][0]} {given[wire]!r}" if wire in given else issue.path
            problems.append(f"{flag}: {issue.message}")
        raise SystemExit(f"gpudra webhook: {'; '.join(problems)}") from None
    assert isinstance(config, GpuConfig) and config.sharing and config.sharing.mps_config
    return tuple(sorted(config.sharing.mps_config.to_wire().items()))


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise SystemExit(f"gpudra webhook: --port {args.port} is out of range (1-65535)")
    if args.max_connections < 1:
        raise SystemExit(
            f"gpudra webhook: --max-connections {args.max_connections}: give at least 1 "
            f"(default: {HttpConfig.max_connections})"
        )
    if args.max_buffered_body_bytes < HttpConfig.max_body_bytes:
        raise SystemExit(
            f"gpudra webhook: --max-buffered-body-bytes {args.max_buffered_body_bytes}: give "
            f"at least the largest request body, {HttpConfig.max_body_bytes} "
            f"(default: {HttpConfig.max_buffered_body_bytes})"
        )
    if args.client_cert_name and args.client_ca_file is None:
        raise SystemExit(
            "gpudra webhook: --client-cert-name needs --client-ca-file: names are checked on "
            "the client certificates that CA signs"
        )
    for name in args.client_cert_name:
        if not name or name != name.strip() or "\x00" in name:
            raise SystemExit(
                f"gpudra webhook: --client-cert-name {name!r}: give the common name or DNS "
                "name of the API server's client certificate, e.g. gpudra-admission-client"
            )
    if (args.client_ca_file is None) != (args.health_port is None):
        raise SystemExit(
            "gpudra webhook: --client-ca-file and --health-port go together: the kubelet's "
            "probes present no client certificate, so they need a port of their own"
        )
    if args.health_port is not None and not (
        0 < args.health_port < 65536 and args.health_port != args.port
    ):
        raise SystemExit(
            f"gpudra webhook: --health-port {args.health_port} must be 1-65535 and differ "
            f"from --port {args.port}"
        )
    if args.tenants and not args.validate_claims:
        raise SystemExit(
            "gpudra webhook: --tenants needs --validate-claims: tenant rules on classes, "
            "sharing and MIG profiles are judged on each ResourceClaim and template as it "
            "is created, so without claim validation those a tenant writes are admitted "
            "unjudged. Drop --no-validate-claims, or add --no-tenants"
        )
    if (args.ca_dir is not None) != (args.cert_source == "ca"):
        raise SystemExit(
            "gpudra webhook: --ca-dir and --cert-source=ca go together: give both or neither"
        )
    policy = conversion_policy(args)
    names = service_dns_names(args.service, args.namespace)
    renewal = (
        ServingRenewal(args.ca_dir, args.cert_dir, names) if args.cert_source == "ca" else None
    )
    try:
        # The server loads the files when it is built: check or make them first.
        if args.cert_source == "files":
            check_serving_files(args.cert_dir)
        elif renewal is not None:
            renewal.renew()
        else:
            ensure_pki(args.cert_dir, names)
    except (OSError, ValueError) as exc:
        flag = "--ca-dir" if renewal is not None else "--cert-dir"
        raise SystemExit(f"gpudra webhook: {flag}: {exc}") from None

    # One descriptor per connection: the transport bounds connections by what this leaves.
    before, after = raise_open_files_limit()
    if before != after:
        log.info("open-files limit raised", extra={"fields": {"from": before, "to": after}})

    async def main() -> None:
        kube = await Kube.connect(args.kubeconfig)
        config = server_config(args, policy)
        tenants = (
            TenantController(
                kube,
                config.policy,
                extra_classes=args.device_class,
                pod_security_default=args.pod_security_default,
                own_namespace=args.namespace,
                leader=quota_leader(args, kube),
            )
            if args.tenants
            else None
        )
        classes = device_class_cache(args, config.policy)
        configurations = [WebhookConfiguration(ConfigurationKind.MUTATING, registration.NAME)]
        if args.validate_claims:
            configurations.append(
                WebhookConfiguration(ConfigurationKind.VALIDATING, registration.VALIDATING_NAME)
            )
        # A restarted pod keeps the CA of the pod it replaces while that one terminates.
        bundles = (
            CABundleController(kube, configurations, keep_foreign_s=ROLLOUT_OVERLAP_S)
            if args.cert_source == "self"
            else None
        )

        # Not ready (no traffic from the Service) until the tenant rules and the
        # DeviceClasses (claim validation and native resources read them) are loaded and,
        # with its own CA, until the API server trusts it: a restarted pod makes a new CA.
        def ready() -> bool:
            return (
                (classes is None or classes.ready)
                and (tenants is None or tenants.ready)
                and (bundles is None or bundles.trusted)
            )

        server = WebhookServer(
            config,
            ApiTemplateEnsurer(kube),
            tenants=tenants.state if tenants else None,
            read_claims=ApiClaimReader(kube),
            ready=ready,
            device_classes=classes.configs if classes is not None else None,
        )
        if tenants is not None and tenants.leader is not None:
            server.registry.register(QuotaLeader(lambda: tenants.writing))
        health = None
        if args.client_ca_file is not None:
            try:
                server.tls.require_client_certificates(args.client_ca_file, args.client_cert_name)
            except (OSError, ssl.SSLError) as exc:
                raise SystemExit(f"gpudra webhook: --client-ca-file: {exc}") from None
            health = server.health_server(args.health_port)

        async def drain() -> None:
            """After SIGTERM: the quota writer hands its Lease back at once, so the next
            replica writes within a retry; reviews are still served, not ready and each
            connection closed after its answer, while the API servers see this
            replica's endpoint withdrawn."""
            for listener in (server, health):
                if listener is not None:
                    listener.begin_shutdown()
            log.info("draining", extra={"fields": {"seconds": args.shutdown_delay}})
            if tenants is not None and tenants.leader is not None:
                await tenants.leader.resign()
            await anyio.sleep(args.shutdown_delay)

        async with stop_on_signal(drain) as tg:
            if classes is not None:
                tg.start_soon(classes.run, kube)
            if tenants is not None:
                tg.start_soon(tenants.run)
            await tg.start(server.serve)
            if health is not None:
                await tg.start(health.serve)
            if bundles is None:
                # The chart (or cert-manager's CA injector) owns the configurations and
                # their caBundle; the server reloads the serving files when they change.
                if renewal is not None:
                    await renewal.run()
                await anyio.sleep_forever()
                return
            # Rotation (hourly, sooner during a CA rollover) hands each new bundle to the
            # controller, which writes it at once and puts it back after foreign edits.
            await tg.start(SelfSignedRotation(args.cert_dir, names, bundles).run)
            # Watching starts before the first apply, so the CA of a pod still serving
            # (a rollout) is seen, and kept, before the configurations are replaced.
            await tg.start(bundles.run)
            while True:
                # The whole configurations are re-applied hourly so other drift is undone.
                assert bundles.bundle is not None  # set by the rotation's first check
                bundle_b64 = bundles.desired_b64()
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
                        namespace_selector=args.conversion_namespace_selector,
                        selector_in_webhook=args.tenants,
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
                await anyio.sleep(3600)

    run_event_loop(main)
    return 0
