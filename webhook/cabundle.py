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

Several pods (``--cert-source=self``): every pod makes its own CA, and the bundle must
trust each pod that may serve: the old pod of a rollout until it has terminated, a
surge pod that never turns Ready, a second replica. A fixed window from first sight
(the design before this one) cannot tell a pod that is gone from one that is alive and
agrees: once the windows passed, two live pods dropped each other's CA, each put its own
back, and they rewrote the configurations in a tight loop with a pod's CA missing half
the time. Taking a CA that reappears after being dropped as a sign of life would stop
the loop, but only after dropping it: a failed review each window. So the bundle
follows *live writers*, through leases kept on the configurations themselves (the
webhook already writes them by name; nothing more is granted), the way Kubernetes'
own Lease objects work:

- Each pod's controller (with ``keep_foreign_s``, the lease duration) holds a lease on
  each certificate of its own bundle: the annotation
  ``ca-lease.gpudra.nvidia.com/<first 128 bits of the certificate's SHA-256, hex>``,
  whose value is a timestamp and the holder (the pod's name), e.g.
  ``2025-06-01T10:00:00.000+00:00 gpudra-webhook-7d9f-x2x4z``. It renews its leases
  every quarter of ``keep_foreign_s`` while another pod's lease is live (a pod alone, or
  beside pods of an earlier release only, writes nothing on a timer), and at once when
  it meets a new one or finds one of its own taken over by another pod. When a CA
  rotation drops one of its certificates it marks that lease ``released`` in the same
  write, and the others drop the certificate at once instead of keeping it against it.
- Every other pod keeps a certificate in its bundle while that certificate's lease is
  live: until ``keep_foreign_s`` after its value was last seen to change, timed on its
  own monotonic clock. A pod that is gone stops renewing, and every pod drops its CA,
  and the lease, at most ``keep_foreign_s`` after its last renewal: the old CA of a
  rollout stays while the old pod terminates and goes once it is gone.
- A certificate that shows up without a live lease (a pod of a release before leases,
  a CA put back by hand, or a pod that was alone and let its stamp age), or with one
  whose stamp ends before its holder would renew it, is stamped by the first pod that
  sees it (``<time> <that pod> first-seen``) and kept for
  ``keep_foreign_s`` from that stamp (the rollout window of old); the stamp is shared,
  so every pod drops it at the same moment instead of each from when it happened to
  look. If it is put back after being dropped, something alive holds it (a pod of an
  earlier release still serving): it is stamped again and kept, not taken out again
  and again.

All pods compute the same canonical bundle (certificates sorted), so they agree and
write nothing but renewals: four writes per configuration and pod per
``keep_foreign_s``. Clocks of different nodes disagree, so a lease's timestamp is
compared with this pod's clock only when the lease is first seen, and never again once
its value has been seen to change: then it is live for ``keep_foreign_s`` from when the
change was seen, and it is never stamped over. A stamp that looks stale only because
the holder's clock is behind costs one stamp over it when the pods first meet; the
holder, finding its lease taken, renews it, and from that change on the lease is
timed here. Stepping a node's clock while the pods run costs nothing. A lease that
disappears says nothing (it expired and was removed, or someone removed it by hand);
its holder, if alive, writes it back.

A write that keeps being undone is not repeated at once: if the configuration no
longer holds what this controller wrote less than `_FIGHT_WINDOW_S` earlier, the next
write waits a delay that doubles up to a minute (`gpudra.common.backoff.Backoff`), and
the first undo of an episode is logged once, with what the other writer adds and takes
away (certificates by subject and fingerprint, their lease holders, the last field
manager). Such a writer is a pod of an earlier release, a GitOps tool that resets
``caBundle``, or a person; pods of this release do not fight one another.

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
import math
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID
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
    "FIELD_MANAGER",
    "LEASE_PREFIX",
    "ROLLOUT_OVERLAP_S",
    "CABundleController",
    "ConfigurationKind",
    "SelfSignedRotation",
    "WebhookConfiguration",
    "certificates",
    "fingerprint",
]

logger = logging.getLogger(__name__)

_API: Final = "/apis/admissionregistration.k8s.io/v1"
_WATCH_TIMEOUT_S: Final = 290
_BACKOFF: Final = Backoff(max_s=5.0)
_PEM_BLOCK: Final = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
_MAX_FOREIGN: Final = 64
ROLLOUT_OVERLAP_S: Final = 600.0
"""How long a CA stays in the bundle after its pod last renewed its lease (or, without
a lease, after it was first stamped): longer than a pod's termination (the chart's
grace period plus endpoint propagation)."""
FIELD_MANAGER: Final = "gpudra-webhook"
"""Whom the API server records for the webhook's writes to its configurations (their
`managedFields`), so that a conflict a `helm upgrade` meets names the webhook rather
than the HTTP client's user agent."""
LEASE_PREFIX: Final = "ca-lease.gpudra.nvidia.com/"
"""The annotations, one per certificate, that say a live pod still serves from it."""
_RENEWALS_PER_LEASE: Final = 4
_FIGHT_WINDOW_S: Final = 30.0
"""A write undone within this long is repeated only after a backoff delay."""
_FIGHT_BACKOFF: Final = Backoff(first_s=1.0, max_s=60.0)


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


def fingerprint(cert_pem: bytes) -> str:
    """The name of a certificate's lease: the first 128 bits of its SHA-256, in hex."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.fingerprint(hashes.SHA256()).hex()[:32]


def _describe(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    subject = str(names[0].value) if names else cert.subject.rfc4514_string()
    return f"CN={subject} sha256:{fingerprint(cert_pem)[:12]}"


def _decoded(bundle_b64: object) -> bytes:
    if not isinstance(bundle_b64, str):
        return b""
    try:
        return base64.b64decode(bundle_b64, validate=True)
    except ValueError:
        return b""


def _stamp(at: float, holder: str) -> str:
    """A lease value: when, then who."""
    when = dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds")
    return f"{when} {holder}"


def _stamped_at(value: str) -> float | None:
    """The time of a lease value; None if it has none that can be read."""
    try:
        when = dt.datetime.fromisoformat(value.split(" ", 1)[0])
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def _lease_note(value: str | None) -> str:
    """Who wrote a lease, and how: ``pod-a``, ``pod-b first-seen``, ``pod-a released``."""
    parts = (value or "").split(" ", 1)
    return parts[1] if len(parts) > 1 else ""


def _held(value: str) -> bool:
    """A lease as its holder writes it: a time and a pod name, nothing after."""
    note = _lease_note(value)
    return bool(note) and " " not in note


def _released(value: str | None) -> bool:
    """A lease its holder gave up: its certificate is to go at once."""
    return value is not None and value.endswith(" released")


def _version(obj: dict[str, Any] | None) -> int | None:
    """The resourceVersion as a number, where it is one (etcd's revision)."""
    version = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    return int(version) if isinstance(version, str) and version.isdigit() else None


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

    def certificates(self) -> dict[str, bytes]:
        """Every parseable certificate of any webhook's bundle, by fingerprint."""
        found: dict[str, bytes] = {}
        for stored in self.bundles():
            for cert in certificates(_decoded(stored)):
                found.setdefault(fingerprint(cert), cert)
        return found

    def annotations(self) -> dict[str, str]:
        if self.object is None:
            return {}
        found = (self.object.get("metadata") or {}).get("annotations") or {}
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}

    def leases(self) -> dict[str, str]:
        """The CA leases: fingerprint -> value."""
        return {
            k.removeprefix(LEASE_PREFIX): v
            for k, v in self.annotations().items()
            if k.startswith(LEASE_PREFIX)
        }

    def last_writer(self) -> str:
        """The field manager of the latest write, from ``managedFields`` (if any)."""
        entries = [
            e
            for e in ((self.object or {}).get("metadata") or {}).get("managedFields") or []
            if isinstance(e, dict)
        ]
        if not entries:
            return ""
        last = max(entries, key=lambda e: str(e.get("time") or ""))
        return f"{last.get('manager')} ({last.get('operation')} at {last.get('time')})"


@dataclass
class _Foreign:
    """A certificate of another pod, as this controller knows it."""

    pem: bytes | None = None
    """Its PEM, once seen in a bundle (a lease names only the fingerprint)."""
    until: float = 0.0
    """time.monotonic() at which it stops being kept; kept while in the future. Not the
    wall clock: stepping it (NTP) must not end or stretch a lease."""
    stamp: str | None = None
    """The lease value this controller stamped it with (first seen without a live lease)."""
    changed: bool = False
    """Its lease was seen to change (or appear) to a value this controller did not write,
    since it was last stamped: someone alive writes it, so it is kept from when that was
    seen, never by comparing its time with this pod's clock, and never stamped over."""
    met: bool = False
    """Its holder's own lease has been seen (a pod that reads leases)."""


@dataclass
class _Writes:
    """What this controller last wrote to one configuration, to notice a write undone."""

    bundle_b64: str | None = None
    annotations: dict[str, str] | None = None
    at: float = -math.inf
    """time.monotonic() of that write."""
    delays: Iterator[float] = field(default_factory=_FIGHT_BACKOFF.delays)
    waited: bool = False
    """The backoff delay before the next write has been served."""
    episode: bool = False
    """The current episode of undone writes has been logged."""


class CABundleController:
    """Watches the given configurations and writes `bundle` into each of their webhooks.

    With `keep_foreign_s`, certificates of other pods found there stay while their pods
    keep their leases, and the pod's own certificates are leased under `holder` (the
    host name, which is the pod's name, by default); see the module's notes. `clock` is
    the wall clock leases are stamped with and a lease first seen is read against: the
    node's, which another pod's may run ahead of or behind. How long a lease lives once
    seen is timed on ``time.monotonic()``.
    """

    def __init__(
        self,
        kube: Kube,
        configurations: Sequence[WebhookConfiguration],
        *,
        keep_foreign_s: float = 0.0,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not configurations:
            raise ValueError("configurations must name at least one webhook configuration")
        self._kube = kube
        self._configurations = tuple(dict.fromkeys(configurations))
        self._bundle: bytes | None = None
        self._bundle_b64 = ""
        self._keep_foreign_s = keep_foreign_s
        self._clock = clock
        self._renew_s = keep_foreign_s / _RENEWALS_PER_LEASE
        self._holder = holder or socket.gethostname()
        # Foreign certificate's fingerprint -> what is known of it. Entries outlive their
        # window (so a certificate is not stamped again while it stays in the bundle)
        # and are pruned once nothing names them.
        self._foreign: dict[str, _Foreign] = {}
        # The fingerprints of every certificate this pod has published (one it rotated
        # out is never foreign), and of those in its bundle now.
        self._owned_fps: set[str] = set()
        self._own_fps: frozenset[str] = frozenset()
        self._lease = ""
        self._renewed_at = -math.inf
        # The leases of each configuration as last seen, to tell a renewal from a repeat.
        self._leases: dict[WebhookConfiguration, dict[str, str]] = {}
        self._changed = anyio.Event()
        self._observed: dict[WebhookConfiguration, _Observed] = {}
        # (bundle, when it was first seen in every configuration); replaced, never mutated,
        # so the rotation thread reads a consistent pair.
        self._published: tuple[bytes, dt.datetime] | None = None
        self._trusted = False
        self._writes = {c: _Writes() for c in self._configurations}
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
        self.undone = 0
        """Writes found undone by another writer within `_FIGHT_WINDOW_S`."""

    @property
    def bundle(self) -> bytes | None:
        return self._bundle

    def desired_b64(self) -> str:
        """What every webhook's ``caBundle`` should hold now (base64): the bundle, plus
        the foreign certificates still kept, in canonical order."""
        return self._bundle_b64

    def set_bundle(self, bundle: bytes) -> None:
        """Make `bundle` (PEM) the desired ``caBundle``; written at once."""
        if not bundle.strip():
            raise ValueError("bundle must hold at least one PEM certificate")
        if bundle == self._bundle:
            return
        first = self._bundle is None
        self._bundle = bundle
        self._own_fps = frozenset(fingerprint(c) for c in certificates(bundle))
        self._owned_fps.update(self._own_fps)
        for fp in self._own_fps:
            self._foreign.pop(fp, None)
        if self._keep_foreign_s > 0:
            self._renew()  # a new certificate's lease starts fresh
            if first:  # configurations seen before the bundle: their CAs are first seen now
                for config, observed in self._observed.items():
                    self._note_foreign(config, None, observed)
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
                tg.start_soon(self._keep_time)
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
        kept = [e.pem for e in self._foreign.values() if e.pem is not None and e.until > now]
        desired = b"".join(sorted({*certificates(self._bundle), *kept})) if kept else self._bundle
        self._bundle_b64 = base64.b64encode(desired).decode("ascii")

    def _renew(self) -> None:
        self._lease = _stamp(self._clock(), self._holder)
        self._renewed_at = time.monotonic()

    def _peers_present(self) -> bool:
        """Another pod that reads leases is alive: one of its own is live. (A pod of an
        earlier release holds none and reads none; renewing for it is of no use.)"""
        now = time.monotonic()
        for leases in self._leases.values():
            for fp, value in leases.items():
                entry = self._foreign.get(fp)
                if (
                    entry is not None
                    and entry.until > now
                    and value != entry.stamp
                    and not _released(value)
                ):
                    return True
        return False

    def _renew_if_due(self) -> bool:
        """Renew our leases when due: only while another pod reads them."""
        if (
            self._keep_foreign_s > 0
            and self._bundle is not None
            and time.monotonic() >= self._renewed_at + self._renew_s
            and self._peers_present()
        ):
            self._renew()
            return True
        return False

    def _entry(self, fp: str) -> _Foreign | None:
        """The entry of a foreign certificate, made if there is room."""
        entry = self._foreign.get(fp)
        if entry is None and len(self._foreign) >= _MAX_FOREIGN:
            self._prune()
        if entry is None and len(self._foreign) < _MAX_FOREIGN:
            entry = self._foreign[fp] = _Foreign()
        return entry

    def _prune(self) -> None:
        """Forget expired certificates that no configuration names any more."""
        now = time.monotonic()
        named = {fp for o in self._observed.values() for fp in (*o.certificates(), *o.leases())}
        for fp in [fp for fp, e in self._foreign.items() if e.until <= now and fp not in named]:
            del self._foreign[fp]

    def _note_foreign(
        self, config: WebhookConfiguration, prev: _Observed | None, observed: _Observed
    ) -> None:
        """Update what is known of other pods' certificates from one observation."""
        if self._keep_foreign_s <= 0 or self._bundle is None:
            return
        if observed.object is None:
            # Deleted: no news of anyone's lease; a recreated one starts from first sight.
            self._leases.pop(config, None)
            return
        now, wall, keep = time.monotonic(), self._clock(), self._keep_foreign_s
        watched = config in self._leases
        before = self._leases.get(config, {})
        after = observed.leases()
        self._leases[config] = after
        present = observed.certificates()
        had = prev.certificates() if prev is not None else {}
        # Another pod took one of our leases for a stale one (its clock runs ahead of
        # ours, or we were alone and let it age): a new stamp, so that it sees the lease
        # change and knows we live, and so that writing it back repeats no undone write.
        renew = any(
            (value := after.get(fp)) is not None
            and value != before.get(fp)
            and _lease_note(value) != self._holder
            for fp in self._own_fps
        )
        for fp, value in after.items():
            if fp in self._owned_fps or (entry := self._entry(fp)) is None:
                continue
            if _released(value):  # its pod rotated it out: keeping it would fight that pod
                entry.until = min(entry.until, now)
                continue
            if not entry.met and _held(value):
                # A pod that reads leases, met for the first time: ours is renewed at
                # once, so it sees us live within a round trip, whatever our stamp
                # looks like to its clock, instead of at our next renewal.
                entry.met = renew = True
            if watched and before.get(fp) != value:
                # Written while this pod watched (a renewal, another pod's stamp, a lease
                # put back): it counts from now, whatever the writer's clock says.
                entry.until = max(entry.until, now + keep)
                entry.changed = entry.changed or value != entry.stamp
            elif fp not in before and not entry.changed:
                # First sight: trust its stamp, never one in the future. The only time
                # another pod's clock is compared with ours.
                stamped = _stamped_at(value)
                if stamped is not None:
                    entry.until = max(entry.until, now + min(stamped - wall, 0.0) + keep)
        if renew:
            self._renew()
        # A lease that disappears says nothing: it was removed once expired (by this pod
        # or another) or by hand, and its holder, if alive, writes it back.
        for fp, cert in present.items():
            if fp in self._owned_fps or (entry := self._entry(fp)) is None:
                continue
            entry.pem = cert
            if (
                fp not in had
                and not _released(after.get(fp))
                and (
                    entry.until <= now or (not entry.changed and entry.until < now + self._renew_s)
                )
            ):
                # New here and no live lease, or one that by its stamp ends before its
                # holder would renew it (its clock may be behind ours): stamp it, so every
                # pod keeps it alike, and a live holder, seeing it taken, renews it.
                entry.until = now + keep
                entry.stamp = f"{_stamp(wall, self._holder)} first-seen"
                entry.changed = False
                logger.info(
                    "keeping another CA in the caBundle",
                    extra={
                        "fields": {
                            "certificate": _describe(cert),
                            "lease": _lease_note(after.get(fp)),
                            "keep_s": keep,
                        }
                    },
                )
        self._changed.set()

    def _desired_annotations(self, observed: _Observed) -> dict[str, str] | None:
        """The configuration's annotations with our leases, stamps and releases; None
        when they need no change."""
        if self._keep_foreign_s <= 0 or self._bundle is None or observed.object is None:
            return None
        now, wall = time.monotonic(), self._clock()
        current = observed.annotations()
        leases = observed.leases()
        wanted = dict(current)
        for fp in self._own_fps:
            wanted[LEASE_PREFIX + fp] = self._lease
        for fp in leases.keys() - self._own_fps:
            entry = self._foreign.get(fp)
            if fp in self._owned_fps:  # rotated out: say so, then let the mark expire
                stamped = _stamped_at(leases[fp])
                if not _released(leases[fp]):
                    wanted[LEASE_PREFIX + fp] = f"{_stamp(wall, self._holder)} released"
                elif stamped is None or stamped + self._keep_foreign_s <= wall:
                    del wanted[LEASE_PREFIX + fp]
            elif entry is not None and entry.until <= now:
                del wanted[LEASE_PREFIX + fp]  # expired or released: let go
        for fp, entry in self._foreign.items():
            if entry.stamp is None or entry.until <= now or entry.changed:
                continue  # a lease seen changing has a live writer: never stamped over
            stamped = _stamped_at(leases[fp]) if fp in leases else None
            if stamped is None or stamped + self._keep_foreign_s < wall + self._renew_s:
                wanted[LEASE_PREFIX + fp] = entry.stamp  # nobody else keeps it alive
        return wanted if wanted != current else None

    async def _keep_time(self) -> None:
        """Renew our leases, and drop foreign certificates when theirs end."""
        while True:
            now = time.monotonic()
            deadlines = [e.until for e in self._foreign.values() if e.until > now]
            if self._bundle is not None and self._peers_present():
                deadlines.append(self._renewed_at + self._renew_s)
            changed = self._changed
            with anyio.move_on_after(max(0.0, min(deadlines) - now) + 0.01 if deadlines else None):
                await changed.wait()
            if changed.is_set():
                self._changed = anyio.Event()
            self._renew_if_due()
            self._refresh_desired()
            for config in self._configurations:
                if self._needs_write(config):
                    self._repairs[config].poke()

    def _needs_write(self, config: WebhookConfiguration) -> bool:
        observed = self._observed.get(config)
        if self._bundle is None or observed is None or observed.object is None:
            return False
        return bool(observed.stale_indices(self._bundle_b64)) or (
            self._desired_annotations(observed) is not None
        )

    def _observe(self, config: WebhookConfiguration, obj: dict[str, Any] | None) -> None:
        prev = self._observed.get(config)
        old, new = _version(prev.object if prev else None), _version(obj)
        if old is not None and new is not None and new < old:
            return  # a watch event older than what a write or a read already showed
        self._observed[config] = _Observed(obj)
        self._note_foreign(config, prev, self._observed[config])
        self._refresh_desired()
        self._check_published()
        if self._needs_write(config):
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

    def _undone(
        self, config: WebhookConfiguration, stale: list[int], annotations: dict[str, str] | None
    ) -> bool:
        """Whether this write repeats one that another writer undid a moment ago."""
        last = self._writes[config]
        if time.monotonic() - last.at >= _FIGHT_WINDOW_S:
            return False
        return bool(stale and last.bundle_b64 == self._bundle_b64) or bool(
            annotations is not None and last.annotations == annotations
        )

    def _log_fight(self, config: WebhookConfiguration, observed: _Observed, delay: float) -> None:
        wanted = {fingerprint(c): c for c in certificates(base64.b64decode(self._bundle_b64))}
        found = observed.certificates()
        leases = observed.leases()

        def described(fps: set[str], certs: dict[str, bytes]) -> list[str]:
            return sorted(
                _describe(certs[fp])
                + (f" (lease: {note})" if (note := _lease_note(leases.get(fp))) else "")
                + (" (ours)" if fp in self._owned_fps else "")
                for fp in fps
            )

        logger.warning(
            "another writer keeps undoing the caBundle this pod writes; writing it again "
            "only after a growing delay",
            extra={
                "fields": {
                    "configuration": str(config),
                    "it_adds": described(found.keys() - wanted.keys(), found),
                    "it_removes": described(wanted.keys() - found.keys(), wanted),
                    "annotations_undone": sorted(
                        k
                        for k, v in (self._writes[config].annotations or {}).items()
                        if observed.annotations().get(k) != v
                    ),
                    "last_writer": observed.last_writer(),
                    "retry_s": delay,
                }
            },
        )

    async def _patch(self, config: WebhookConfiguration) -> None:
        observed = self._observed.get(config)
        if self._bundle is None or observed is None or observed.object is None:
            return
        self._renew_if_due()
        stale = observed.stale_indices(self._bundle_b64)
        annotations = self._desired_annotations(observed)
        if not stale and annotations is None:
            return
        writes = self._writes[config]
        if writes.waited:
            writes.waited = False  # the delay is served: write what is wanted now
        elif self._undone(config, stale, annotations):
            self.undone += 1
            delay = next(writes.delays)
            if not writes.episode:
                writes.episode = True
                self._log_fight(config, observed, delay)
            writes.waited = True
            await anyio.sleep(delay)
            self._repairs[config].poke()
            return
        elif writes.episode and time.monotonic() - writes.at >= _FIGHT_WINDOW_S:
            # Our last write stood for the whole window: the episode is over.
            logger.info(
                "caBundle writes no longer undone", extra={"fields": {"configuration": str(config)}}
            )
            self._writes[config] = writes = _Writes()
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
        if annotations is not None:
            # The whole map, so no key needs escaping; the test op above keeps it current.
            patch.append({"op": "add", "path": "/metadata/annotations", "value": annotations})
        try:
            updated = await self._kube.request(
                "PATCH",
                config.path,
                patch,
                query={"fieldManager": FIELD_MANAGER},
                content_type="application/json-patch+json",
            )
        except ApiError as exc:
            if exc.status == 404:
                self._observe(config, None)
                return
            if exc.status in (409, 422):
                # The object changed under us (the test op failed): read it again. If it
                # did not, the write itself was refused: retried after a backoff.
                current = await self._get(config)
                self._observe(config, current)
                if _version(current) is None or _version(current) != _version(obj):
                    return
            raise
        self.patches += 1
        if stale:
            writes.bundle_b64 = self._bundle_b64
        if annotations is not None:
            writes.annotations = annotations
        writes.at = time.monotonic()
        if stale:
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
