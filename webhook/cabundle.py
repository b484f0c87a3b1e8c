"""Keeps the ``caBundle`` of the webhook's configurations equal to its CA bundle.

Why a controller and not a one-off apply: the API server trusts the webhook only
through ``webhooks[*].clientConfig.caBundle``, and that field is lost whenever someone
edits the configuration or a chart re-applies it with an empty bundle; every admission
call then fails (``failurePolicy: Fail``). Each named configuration (mutating or
validating) is watched, so a wrong bundle is put back within a watch round trip, and a
new bundle (`CABundleController.set_bundle`, called right after a rotation) is written
at once. Patches are JSON patches guarded by the observed ``resourceVersion``, so a
concurrent edit is re-read instead of overwritten with stale webhooks.

The controller also tells the rotation when a bundle is live everywhere
(`CABundleController.published_at`, the ``ca_published`` callback of
`gpudra.webhook.certs.reconcile_pki`): a serving certificate from a new CA is only
served once the bundle trusting both the old and the new CA has been confirmed in every
configuration for ``CA_PROPAGATION``. A configuration that does not exist calls nobody
and counts as up to date; it is patched as soon as it appears.

Rollouts: a restarted pod (``--cert-source=self``) makes a new CA while the old pod
still serves until it has terminated. With ``keep_foreign_s`` the controller keeps each
certificate it finds in a configuration that is not its own for that long after first
seeing it, so the bundle trusts both pods during the overlap; both pods write the same
canonical bundle (certificates sorted), so they do not fight, and the old CA is dropped
once the window has passed. Only parseable certificates are kept.

`SelfSignedRotation` is the loop of ``--cert-source=self``: it rotates the files with
`gpudra.webhook.certs.ensure_pki` and hands every bundle to the controller. With
``--cert-source=files`` (cert-manager) neither runs: cert-manager's CA injector owns
the bundle.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from gpudra.common.backoff import Backoff
from gpudra.common.kube import ApiError, Kube
from gpudra.common.reconcile import ReconcileLoop
from gpudra.common.watch import EventType, Reflector
from gpudra.webhook.certs import (
    CA_PROPAGATION,
    CA_VALIDITY,
    LOOPBACK_IPS,
    SERVING_VALIDITY,
    WebhookPki,
    ensure_pki,
)

__all__ = [
    "ROLLOUT_OVERLAP_S",
    "CABundleController",
    "ConfigurationKind",
    "SelfSignedRotation",
    "WebhookConfiguration",
    "certificates",
]

logger = logging.getLogger(__name__)

_API: Final = "/apis/admissionregistration.k8s.io/v1"
_WATCH_TIMEOUT_S: Final = 290
_BACKOFF: Final = Backoff(max_s=5.0)
_PEM_BLOCK: Final = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
_MAX_FOREIGN: Final = 64
ROLLOUT_OVERLAP_S: Final = 600.0
"""How long a restarted pod keeps the CA of the pod it replaces: longer than that pod's
termination (the chart's grace period plus endpoint propagation)."""


def certificates(bundle: bytes) -> list[bytes]:
    """The parseable certificates of a PEM bundle, each in canonical PEM; junk is dropped."""
    found: list[bytes] = []
    for block in _PEM_BLOCK.findall(bundle):
        try:
            cert = x509.load_pem_x509_certificate(block)
        except ValueError:
            continue
        pem = cert.public_bytes(serialization.Encoding.PEM)
        if pem not in found:
            found.append(pem)
    return found


def _decoded(bundle_b64: object) -> bytes:
    if not isinstance(bundle_b64, str):
        return b""
    try:
        return base64.b64decode(bundle_b64, validate=True)
    except ValueError:
        return b""


class ConfigurationKind(StrEnum):
    MUTATING = "mutatingwebhookconfigurations"
    VALIDATING = "validatingwebhookconfigurations"


@dataclass(frozen=True)
class WebhookConfiguration:
    """One webhook configuration whose every webhook gets our bundle."""

    kind: ConfigurationKind
    name: str

    @property
    def collection(self) -> str:
        return f"{_API}/{self.kind.value}"

    @property
    def path(self) -> str:
        return f"{self.collection}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind.value}/{self.name}"


@dataclass(frozen=True)
class _Observed:
    """What the API server last showed of one configuration (None: it does not exist)."""

    object: dict[str, Any] | None

    def bundles(self) -> list[Any]:
        """Each webhook's ``caBundle`` as stored (base64, or whatever is there)."""
        if self.object is None:
            return []
        return [
            (w.get("clientConfig") or {}).get("caBundle") for w in self.object.get("webhooks") or []
        ]

    def stale_indices(self, bundle_b64: str) -> list[int]:
        return [i for i, b in enumerate(self.bundles()) if b != bundle_b64]

    def trusts(self, certs: Sequence[bytes]) -> bool:
        """Every webhook's bundle holds all of `certs`."""
        return all(set(certs) <= set(certificates(_decoded(b))) for b in self.bundles())


class CABundleController:
    """Watches the given configurations and writes `bundle` into each of their webhooks.

    With `keep_foreign_s`, certificates found there that are not in `bundle` stay for that
    long after they were first seen (see the module's rollout notes).
    """

    def __init__(
        self,
        kube: Kube,
        configurations: Sequence[WebhookConfiguration],
        *,
        keep_foreign_s: float = 0.0,
    ) -> None:
        if not configurations:
            raise ValueError("configurations must name at least one webhook configuration")
        self._kube = kube
        self._configurations = tuple(dict.fromkeys(configurations))
        self._bundle: bytes | None = None
        self._bundle_b64 = ""
        self._keep_foreign_s = keep_foreign_s
        # Foreign certificate -> monotonic time it stops being kept. Expired entries stay,
        # so a certificate put back after its window is not kept again.
        self._foreign: dict[bytes, float] = {}
        # Every certificate this pod has published: one it rotated out is never foreign.
        self._owned: set[bytes] = set()
        self._foreign_added = anyio.Event()
        self._observed: dict[WebhookConfiguration, _Observed] = {}
        # (bundle, when it was first seen in every configuration); replaced, never mutated,
        # so the rotation thread reads a consistent pair.
        self._published: tuple[bytes, dt.datetime] | None = None
        self._trusted = False
        self._repairs = {
            c: ReconcileLoop(
                functools.partial(self._patch, c),
                backoff=_BACKOFF,
                fields={"configuration": str(c)},
            )
            for c in self._configurations
        }
        self._progress = anyio.Event()
        self.patches = 0
        """Patches written (tests and metrics read it)."""

    @property
    def bundle(self) -> bytes | None:
        return self._bundle

    def desired_b64(self) -> str:
        """What every webhook's ``caBundle`` should hold now (base64): the bundle, plus
        the foreign certificates still inside their window, in canonical order."""
        return self._bundle_b64

    def set_bundle(self, bundle: bytes) -> None:
        """Make `bundle` (PEM) the desired ``caBundle``; written at once."""
        if not bundle.strip():
            raise ValueError("bundle must hold at least one PEM certificate")
        if bundle == self._bundle:
            return
        self._bundle = bundle
        self._owned.update(certificates(bundle))
        self._refresh_desired()
        logger.info(
            "new caBundle for the webhook configurations",
            extra={"fields": {"certificates": bundle.count(b"-----BEGIN CERTIFICATE-----")}},
        )
        self._check_published()
        for repair in self._repairs.values():
            repair.poke()

    @property
    def trusted(self) -> bool:
        """True once a bundle set here has been in every configuration: from then on the
        API server trusts the serving certificate (a new CA signs only after its bundle is
        published), so the pod may report ready. It stays True through CA rotations,
        which keep the old CA in the bundle, so a single replica never drops out."""
        return self._trusted

    def published_at(self, bundle: bytes) -> dt.datetime | None:
        """When `bundle` was first seen in every configuration; None if it is not."""
        published = self._published
        if published is None or published[0] != bundle:
            return None
        return published[1]

    async def wait_published(self, bundle: bytes) -> dt.datetime:
        """Wait until `bundle` is the desired bundle and is in every configuration."""
        while (at := self.published_at(bundle)) is None:
            await self._progress.wait()
        return at

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch and repair until cancelled; started once every configuration was read."""
        async with anyio.create_task_group() as tg:
            for config in self._configurations:
                await tg.start(self._reflector(config).run)
                tg.start_soon(self._repairs[config].run)
            if self._keep_foreign_s > 0:
                tg.start_soon(self._expire_foreign)
            task_status.started()

    def _reflector(self, config: WebhookConfiguration) -> Reflector:
        def listed(items: list[dict[str, Any]]) -> None:
            self._observe(config, items[0] if items else None)

        def watched(kind: EventType, obj: dict[str, Any]) -> None:
            self._observe(config, None if kind == "DELETED" else obj)

        return Reflector(
            self._kube,
            config.collection,
            query={"fieldSelector": f"metadata.name={config.name}"},
            on_list=listed,
            on_event=watched,
            backoff=_BACKOFF,
            watch_timeout_s=_WATCH_TIMEOUT_S,
            fields={"configuration": str(config)},
        )

    def _refresh_desired(self) -> None:
        """Recompute the desired bundle: ours, then the foreign ones still kept."""
        if self._bundle is None:
            return
        now = time.monotonic()
        kept = [c for c, until in self._foreign.items() if until > now]
        desired = b"".join(sorted({*certificates(self._bundle), *kept})) if kept else self._bundle
        self._bundle_b64 = base64.b64encode(desired).decode("ascii")

    def _note_foreign(self, observed: _Observed) -> None:
        if self._keep_foreign_s <= 0 or self._bundle is None:
            return
        until = time.monotonic() + self._keep_foreign_s
        for stored in observed.bundles():
            for cert in certificates(_decoded(stored)):
                if cert not in self._owned and cert not in self._foreign:
                    if len(self._foreign) >= _MAX_FOREIGN:
                        return
                    self._foreign[cert] = until
                    self._foreign_added.set()
                    logger.info(
                        "keeping another CA in the caBundle for a rollout",
                        extra={"fields": {"keep_s": self._keep_foreign_s}},
                    )

    async def _expire_foreign(self) -> None:
        """Drop foreign certificates when their window ends, and write the bundle."""
        while True:
            now = time.monotonic()
            pending = [until for until in self._foreign.values() if until > now]
            added = self._foreign_added
            with anyio.move_on_after(min(pending) - now + 0.01 if pending else None):
                await added.wait()
            if added.is_set():
                self._foreign_added = anyio.Event()
            before = self._bundle_b64
            self._refresh_desired()
            if self._bundle_b64 != before:
                for repair in self._repairs.values():
                    repair.poke()

    def _observe(self, config: WebhookConfiguration, obj: dict[str, Any] | None) -> None:
        self._observed[config] = _Observed(obj)
        self._note_foreign(self._observed[config])
        self._refresh_desired()
        self._check_published()
        if self._bundle is not None and self._observed[config].stale_indices(self._bundle_b64):
            self._repairs[config].poke()

    def _check_published(self) -> None:
        bundle = self._bundle
        if (
            bundle is not None
            and (self._published is None or self._published[0] != bundle)
            and all(
                c in self._observed and self._observed[c].trusts(certificates(bundle))
                for c in self._configurations
            )
        ):
            self._published = (bundle, dt.datetime.now(dt.UTC))
            self._trusted = True
            logger.info(
                "caBundle is in every webhook configuration",
                extra={"fields": {"configurations": [str(c) for c in self._configurations]}},
            )
        progress, self._progress = self._progress, anyio.Event()
        progress.set()

    async def _patch(self, config: WebhookConfiguration) -> None:
        observed = self._observed.get(config)
        if self._bundle is None or observed is None or observed.object is None:
            return
        stale = observed.stale_indices(self._bundle_b64)
        if not stale:
            return
        obj = observed.object
        patch: list[dict[str, Any]] = [
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": obj["metadata"]["resourceVersion"],
            }
        ]
        patch += [
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": self._bundle_b64}
            for i in stale
        ]
        try:
            updated = await self._kube.request(
                "PATCH", config.path, patch, content_type="application/json-patch+json"
            )
        except ApiError as exc:
            if exc.status == 404:
                self._observe(config, None)
                return
            if exc.status in (409, 422):
                # The object changed under us (the test op failed): read it again.
                self._observe(config, await self._get(config))
                return
            raise
        self.patches += 1
        logger.info(
            "caBundle written",
            extra={"fields": {"configuration": str(config), "webhooks": len(stale)}},
        )
        self._observe(config, updated)

    async def _get(self, config: WebhookConfiguration) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = await self._kube.request("GET", config.path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return obj


class SelfSignedRotation:
    """``--cert-source=self``: keep the files in `directory` rotated and the bundle
    published. The server reloads the files itself (`ReloadingTLSContext`)."""

    def __init__(
        self,
        directory: Path,
        dns_names: Sequence[str],
        controller: CABundleController,
        *,
        ip_addresses: Sequence[str] = LOOPBACK_IPS,
        check_interval_s: float = 3600.0,
        ca_validity: dt.timedelta = CA_VALIDITY,
        serving_validity: dt.timedelta = SERVING_VALIDITY,
        ca_propagation: dt.timedelta = CA_PROPAGATION,
    ) -> None:
        self._directory = directory
        self._dns_names = tuple(dns_names)
        self._ip_addresses = tuple(ip_addresses)
        self._controller = controller
        self._check_interval_s = check_interval_s
        self._ca_validity = ca_validity
        self._serving_validity = serving_validity
        self._ca_propagation = ca_propagation
        self._wake = anyio.Event()

    def rotate_now(self) -> None:
        """Run a rotation check at once (after files changed, or to force one)."""
        self._wake.set()

    async def reconcile(self) -> WebhookPki:
        """One rotation check; the resulting bundle goes to the controller."""
        pki, changed = await anyio.to_thread.run_sync(
            lambda: ensure_pki(
                self._directory,
                self._dns_names,
                ip_addresses=self._ip_addresses,
                ca_validity=self._ca_validity,
                serving_validity=self._serving_validity,
                ca_propagation=self._ca_propagation,
                ca_published=self._controller.published_at,
            )
        )
        if changed:
            logger.info(
                "webhook certificates rotated",
                extra={
                    "fields": {
                        "serving_not_after": pki.serving.not_after.isoformat(),
                        "ca_not_after": pki.ca.not_after.isoformat(),
                        "previous_ca": pki.previous_ca is not None,
                    }
                },
            )
        self._controller.set_bundle(pki.ca_bundle)
        return pki

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Check now, then every `check_interval_s`; during a CA rotation, again as soon
        as the new bundle has been published for ``ca_propagation``."""
        pki = await self.reconcile()
        task_status.started()
        while True:
            with anyio.move_on_after(self._check_interval_s):
                if pki.serving_signed_by_ca():
                    await self._wake.wait()
                else:
                    at = await self._controller.wait_published(pki.ca_bundle)
                    due = at + self._ca_propagation - dt.datetime.now(dt.UTC)
                    with anyio.move_on_after(max(0.0, due.total_seconds()) + 0.05):
                        await self._wake.wait()
            self._wake = anyio.Event()
            try:
                pki = await self.reconcile()
            except (OSError, ValueError) as exc:
                logger.error(
                    "webhook certificate rotation failed; serving the current files",
                    extra={"fields": {"directory": str(self._directory), "error": str(exc)}},
                )
