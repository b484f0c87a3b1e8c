"""What the webhook tests serve against: the webhook's TLS serving config that the
API server trusts, and nodes of emulated GPUs whose slices the scheduler allocates
the converted pods' claims from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from anyio.abc import TaskGroup
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import MigStrategy
from gpudra.driver.nvml import load_nvml
from gpudra.webhook import registration
from gpudra.webhook.certs import TLS_CERT, TLS_KEY, WebhookPki, ensure_pki, service_dns_names
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.templates import ApiClaimReader, ApiTemplateEnsurer
from gpudra.webhook.tenants import TenantController
from gpudra.webhook.validate import driver_classes

from e2e.cluster.harness import Cluster

T = TypeVar("T")


async def call(fn: Callable[..., T], *args: Any) -> T:
    """Blocking calls of the harness's client, off the event loop that serves the webhook."""
    return await anyio.to_thread.run_sync(fn, *args)


def serving_config(cluster: Cluster, pki_dir: Path) -> tuple[WebhookPki, ServerConfig]:
    """The PKI in `pki_dir` (made when missing) and a server on a free port where the
    cluster's API server reaches it, its certificate naming that address (kind's API
    server dials the host's address on kind's network, not 127.0.0.1); the PKI's CA
    bundle goes into the registration."""
    host = cluster.webhook_host()
    pki, _ = ensure_pki(
        pki_dir, service_dns_names("gpudra-webhook", "gpudra"), ip_addresses=(host,)
    )
    config = ServerConfig(
        cert_file=pki_dir / TLS_CERT,
        key_file=pki_dir / TLS_KEY,
        host=host,
        port=0,
    )
    return pki, config


def tenant_webhook(akube: Kube, config: ServerConfig) -> tuple[TenantController, WebhookServer]:
    """The webhook with tenant rules, wired as `gpudra webhook --tenants` wires it."""
    controller = TenantController(akube, config.policy)
    server = WebhookServer(
        config,
        ApiTemplateEnsurer(akube),
        tenants=controller.state,
        read_claims=ApiClaimReader(akube),
    )
    return controller, server


async def register_webhook(akube: Kube, pki: WebhookPki, config: ServerConfig, url: str) -> None:
    """Both webhook configurations, pointing the API server at `url`; a conversion
    selector in `config` is registered as `gpudra webhook --tenants` registers it."""
    bundle = pki.ca_bundle_base64()
    selector = config.conversion_selector
    await registration.apply(
        akube,
        registration.mutating_configuration(
            ca_bundle_b64=bundle,
            own_namespace="gpudra",
            url=url,
            namespace_selector=selector.model_dump(exclude_none=True) if selector else None,
            selector_in_webhook=True,
        ),
    )
    await registration.apply(
        akube,
        registration.validating_configuration(
            ca_bundle_b64=bundle,
            own_namespace="gpudra",
            device_classes=sorted(driver_classes(config.policy)),
            driver=config.policy.driver,
            url=url,
        ),
    )


async def unregister_webhook(akube: Kube) -> None:
    await registration.delete(akube)
    await registration.delete(akube, registration.VALIDATING_NAME, validating=True)


@dataclass(frozen=True)
class EmulatedNode:
    """A node name, its emulated NVML spec and a UUID salt that keeps its GPUs apart
    from those other tests publish."""

    name: str
    nvml: str
    uuid_salt: str


async def start_emulated_nodes(
    tg: TaskGroup, akube: Kube, driver: str, nodes: Sequence[EmulatedNode]
) -> None:
    """Agents publishing the nodes' slices, run in `tg` beside the webhook; returns once
    every slice is published, so that the scheduler can allocate at once."""
    agents = [
        NodeAgent(
            AgentConfig(
                node_name=node.name,
                driver_name=driver,
                mig_strategy=MigStrategy.STATIC,
                health_events=False,
            ),
            akube,
            load_nvml(node.nvml, uuid_salt=node.uuid_salt),
        )
        for node in nodes
    ]
    for agent in agents:
        await tg.start(agent.run)
    for agent in agents:
        await agent.slices.converged.wait()
