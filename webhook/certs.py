"""The webhook's TLS material, made with `cryptography` only: CA, serving cert, rotation.

Why a private CA: the API server trusts the webhook through the ``caBundle`` of the
webhook configuration, so the webhook can bootstrap itself without cert-manager.

Rotation keeps clients on a known issuer at every moment:

- the CA is long-lived (10 years) and replaced only when less than a third of its life
  remains; the old CA then stays in the bundle (``previous_ca``) until it expires;
- serving certificates (1 year, replaced with a third left) are signed by the newest CA
  only once the bundle holding both CAs has been confirmed in every webhook
  configuration for `CA_PROPAGATION` (the ``ca_published`` callback, which the caBundle
  controller in `gpudra.webhook.cabundle` answers), so every API server trusts the new
  CA before any client meets it; until then the previous CA signs. Without a callback
  the bundle is assumed published when the CA was made. A serving certificate never
  outlives its issuer.

`reconcile_pki` is pure (the caller publishes ``ca_bundle`` when it changed);
`ensure_pki` adds file storage in the layout of a ``kubernetes.io/tls`` Secret.
`ensure_serving_from_ca` renews only the serving pair from a CA someone else keeps and
publishes (the chart's, ``--cert-source=ca``); both share `reconcile_serving`.
`check_serving_files` validates such a directory filled by someone else (cert-manager).
Keys are ECDSA P-256: cheap to generate and fast to handshake.

Storage is atomic as a whole, the way the kubelet updates a Secret volume: every write
puts all the files in a fresh hidden folder and swaps the ``..data`` link to it with one
rename; ``tls.crt`` and the others are links through ``..data``. A certificate and its
key replaced one after the other could be torn (a full emptyDir, the container killed
between the two writes), and since the emptyDir outlives the container, a torn pair
would stop every later rotation and every restart, while the running server served its
old certificate until it expired. A torn or damaged directory (one written by an
earlier release, or edited by hand) is repaired rather than refused: a serving pair
whose key does not belong is issued again, and a CA pair whose key does not belong
keeps its certificate in the bundle, trusted but signing nothing, while a new CA is
made and published before it signs (`ensure_pki`, through `reconcile_pki`).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import logging
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Final, NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from gpudra.api.names import check_dns_label
from gpudra.common.files import atomic_write, fsync_dir
from typing_extensions import TypedDict, Unpack

__all__ = [
    "CA_PROPAGATION",
    "CA_VALIDITY",
    "LOOPBACK_IPS",
    "SERVING_VALIDITY",
    "BundlePublished",
    "CertKeyPair",
    "PkiParts",
    "PkiSettings",
    "WebhookPki",
    "ca_bundle",
    "check_serving_files",
    "ensure_pki",
    "ensure_serving_from_ca",
    "generate_ca",
    "generate_serving_cert",
    "load_pki",
    "needs_rotation",
    "reconcile_pki",
    "reconcile_serving",
    "service_dns_names",
    "store_pki",
    "write_atomic",
]

logger = logging.getLogger(__name__)

CA_VALIDITY: Final = dt.timedelta(days=3650)
SERVING_VALIDITY: Final = dt.timedelta(days=365)
CA_PROPAGATION: Final = dt.timedelta(minutes=10)
ROTATE_REMAINING: Final = 1 / 3
LOOPBACK_IPS: Final = ("127.0.0.1",)
# Certificates start a little in the past so a peer with a slow clock accepts them.
_BACKDATE: Final = dt.timedelta(minutes=5)

CA_CERT: Final = "ca.crt"
CA_KEY: Final = "ca.key"
PREVIOUS_CA_CERT: Final = "ca-previous.crt"
PREVIOUS_CA_KEY: Final = "ca-previous.key"
CA_BUNDLE: Final = "ca-bundle.crt"
TLS_CERT: Final = "tls.crt"
TLS_KEY: Final = "tls.key"
_PKI_FILES: Final = (
    CA_BUNDLE,
    CA_CERT,
    CA_KEY,
    PREVIOUS_CA_CERT,
    PREVIOUS_CA_KEY,
    TLS_CERT,
    TLS_KEY,
)
_SERVING_FILES: Final = (TLS_CERT, TLS_KEY)
_DATA: Final = "..data"
"""The link to the folder that holds the current files (as in a Secret volume)."""
_VERSION_PREFIX: Final = "..pki-"
"""The folders `_store_files` writes, one per write; only the one ``..data`` names stays."""
_LINK_SUFFIX: Final = ".link"
"""The end of the name of a link `_link` makes before renaming it into place."""

BundlePublished = Callable[[bytes], dt.datetime | None]
"""Given a CA bundle (PEM), when it was confirmed in every webhook configuration;
None while it is not (yet)."""


@dataclass(frozen=True)
class CertKeyPair:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key."""

    cert_pem: bytes
    key_pem: bytes

    @cached_property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @cached_property
    def private_key(self) -> CertificateIssuerPrivateKeyTypes:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise TypeError(f"unsupported private key type {type(key).__name__}")
        return key

    @property
    def not_before(self) -> dt.datetime:
        return self.certificate.not_valid_before_utc

    @property
    def not_after(self) -> dt.datetime:
        return self.certificate.not_valid_after_utc

    def check(self, name: str) -> None:
        """Raise ValueError (naming `name`) unless the key belongs to the certificate."""
        try:
            matches = self.certificate.public_key() == self.private_key.public_key()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{name}: unreadable certificate or key: {exc}") from None
        if not matches:
            raise ValueError(f"{name}: the private key does not belong to the certificate")


@dataclass(frozen=True)
class WebhookPki:
    """Current CA, the serving pair it (or `previous_ca`) signed, and the old CA
    that stays trusted until it expires.

    A `previous_ca` without a key (``key_pem`` empty) is a CA whose key was lost to a
    damaged directory: it stays in the bundle so the certificate it signed is trusted
    until the new CA may sign, and it signs nothing.
    """

    ca: CertKeyPair
    serving: CertKeyPair
    previous_ca: CertKeyPair | None = None

    @property
    def ca_bundle(self) -> bytes:
        """PEM for the webhook configuration's ``caBundle``: every CA still trusted."""
        return ca_bundle(self.ca, *([self.previous_ca] if self.previous_ca else []))

    def serving_signed_by_ca(self) -> bool:
        """False during a CA rotation while the previous CA still signs the serving
        certificate (waiting for the new bundle to propagate)."""
        return _issued_by(self.serving, self.ca)

    def ca_bundle_base64(self) -> str:
        """``caBundle`` as the API's JSON wants it (base64 of the PEM)."""
        return base64.b64encode(self.ca_bundle).decode("ascii")

    def files(self) -> dict[str, bytes]:
        """File (or Secret key) name to content."""
        files = {
            CA_BUNDLE: self.ca_bundle,
            CA_CERT: self.ca.cert_pem,
            CA_KEY: self.ca.key_pem,
            TLS_CERT: self.serving.cert_pem,
            TLS_KEY: self.serving.key_pem,
        }
        if self.previous_ca:
            files[PREVIOUS_CA_CERT] = self.previous_ca.cert_pem
            if self.previous_ca.key_pem:
                files[PREVIOUS_CA_KEY] = self.previous_ca.key_pem
        return files

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> WebhookPki:
        """Inverse of `files`; ValueError naming the file when a pair is broken."""
        missing = [n for n in (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY) if n not in files]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        ca = CertKeyPair(files[CA_CERT], files[CA_KEY])
        serving = CertKeyPair(files[TLS_CERT], files[TLS_KEY])
        ca.check(CA_CERT)
        serving.check(TLS_CERT)
        previous = None
        if PREVIOUS_CA_CERT in files:
            previous = CertKeyPair(files[PREVIOUS_CA_CERT], files.get(PREVIOUS_CA_KEY, b""))
            if previous.key_pem:
                previous.check(PREVIOUS_CA_CERT)
            else:
                _check_certificate(previous, PREVIOUS_CA_CERT)
        return cls(ca=ca, serving=serving, previous_ca=previous)


def service_dns_names(
    service: str, namespace: str, cluster_domain: str = "cluster.local"
) -> tuple[str, ...]:
    """The names the API server uses to reach a webhook Service."""
    check_dns_label(service, "service")
    check_dns_label(namespace, "namespace")
    return (
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.{cluster_domain}",
    )


def generate_ca(
    *,
    common_name: str = "gpudra-webhook-ca",
    validity: dt.timedelta = CA_VALIDITY,
    now: dt.datetime | None = None,
) -> CertKeyPair:
    """A self-signed CA that may sign only leaf certificates (path length 0)."""
    now = now or _now()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pair(cert, key)


def generate_serving_cert(
    ca: CertKeyPair,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = LOOPBACK_IPS,
    validity: dt.timedelta = SERVING_VALIDITY,
    now: dt.datetime | None = None,
) -> CertKeyPair:
    """A server certificate for `dns_names` and `ip_addresses`, signed by `ca` and
    ending no later than the CA does."""
    if not dns_names:
        raise ValueError("dns_names must name at least one host (see service_dns_names)")
    now = now or _now()
    key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = ca.certificate
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(min(now + validity, ca.not_after))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private_key.public_key()),
            critical=False,
        )
        .sign(ca.private_key, hashes.SHA256())
    )
    return _pair(cert, key)


def needs_rotation(
    cert: x509.Certificate | CertKeyPair,
    *,
    now: dt.datetime | None = None,
    remaining: float = ROTATE_REMAINING,
) -> bool:
    """True when less than `remaining` of the validity is left (or it is not valid now)."""
    if isinstance(cert, CertKeyPair):
        cert = cert.certificate
    now = now or _now()
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < start or now >= end:
        return True
    return (end - now) < (end - start) * remaining


def ca_bundle(*cas: CertKeyPair) -> bytes:
    """Concatenated PEM of the given CAs, in order, without duplicates."""
    seen: list[bytes] = []
    for ca in cas:
        pem = ca.cert_pem if ca.cert_pem.endswith(b"\n") else ca.cert_pem + b"\n"
        if pem not in seen:
            seen.append(pem)
    return b"".join(seen)


class PkiParts(NamedTuple):
    """What a directory that does not load still holds (`_salvage`), any part missing."""

    ca: CertKeyPair | None
    previous_ca: CertKeyPair | None
    serving: CertKeyPair | None


class PkiSettings(TypedDict, total=False):
    """`reconcile_pki`'s settings, which `ensure_pki` passes on as they come."""

    ip_addresses: Sequence[str]
    now: dt.datetime | None
    ca_validity: dt.timedelta
    serving_validity: dt.timedelta
    ca_propagation: dt.timedelta
    ca_published: BundlePublished | None


def reconcile_pki(
    current: WebhookPki | PkiParts | None,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = LOOPBACK_IPS,
    now: dt.datetime | None = None,
    ca_validity: dt.timedelta = CA_VALIDITY,
    serving_validity: dt.timedelta = SERVING_VALIDITY,
    ca_propagation: dt.timedelta = CA_PROPAGATION,
    ca_published: BundlePublished | None = None,
) -> WebhookPki:
    """The PKI that should exist now; returns `current` itself when nothing is due.

    During a CA rotation the new CA signs only once `ca_published` reports the bundle
    with both CAs published at least `ca_propagation` ago. `current` may be the parts
    of a damaged directory (`PkiParts`): no CA makes a new one (beside a previous CA
    kept from it), no serving pair issues one.
    """
    now = now or _now()
    ca, previous, serving = (
        PkiParts(current.ca, current.previous_ca, current.serving)
        if isinstance(current, WebhookPki)
        else current or PkiParts(None, None, None)
    )
    if ca is None:
        ca = generate_ca(validity=ca_validity, now=now)
    if previous is not None and previous.not_after <= now:
        previous = None
    if needs_rotation(ca, now=now):
        previous = ca if ca.not_after > now else None
        ca = generate_ca(validity=ca_validity, now=now)
    signer = ca
    if previous is not None:
        if ca_published is None:
            since: dt.datetime | None = ca.not_before + _BACKDATE
        else:
            since = ca_published(ca_bundle(ca, previous))
        if since is None or now - since < ca_propagation:
            signer = previous
    # A CA whose key was lost signs nothing. What it signed stays served while it is
    # valid, until the new CA's bundle has propagated; with nothing valid left, the new
    # CA signs at once (nothing the API server trusts is left to serve).
    lost_key = not signer.key_pem
    kept = serving if lost_key and serving is not None and _issued_by(serving, signer) else None
    if kept is None or _expired(kept, now):
        kept = reconcile_serving(
            ca if lost_key else signer,
            serving,
            dns_names,
            ip_addresses=ip_addresses,
            now=now,
            validity=serving_validity,
        )
    result = WebhookPki(ca=ca, serving=kept, previous_ca=previous)
    return current if isinstance(current, WebhookPki) and result == current else result


def reconcile_serving(
    signer: CertKeyPair,
    serving: CertKeyPair | None,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = LOOPBACK_IPS,
    now: dt.datetime | None = None,
    validity: dt.timedelta = SERVING_VALIDITY,
) -> CertKeyPair:
    """The serving pair `signer` should have issued now; `serving` itself when it is
    still good (same issuer and names, more than a third of its life left)."""
    now = now or _now()
    if serving is not None and not _reissue(serving, signer, dns_names, ip_addresses, now):
        return serving
    return generate_serving_cert(
        signer, dns_names, ip_addresses=ip_addresses, validity=validity, now=now
    )


def ensure_serving_from_ca(
    ca_dir: Path,
    cert_dir: Path,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = LOOPBACK_IPS,
    now: dt.datetime | None = None,
    validity: dt.timedelta = SERVING_VALIDITY,
) -> tuple[CertKeyPair, bool]:
    """Keep tls.crt/tls.key in `cert_dir` issued by the CA in `ca_dir` (ca.crt, ca.key:
    the chart's Secret) and renewed before expiry; (serving pair, changed).

    The CA, and so the ``caBundle``, stays the chart's: only the serving certificate is
    made here, so no API write is needed and each replica renews its own.
    """
    ca = _read_pair(
        ca_dir,
        CA_CERT,
        CA_KEY,
        "with --cert-source=ca mount the chart's webhook TLS Secret (it keeps the CA key) "
        "at --ca-dir",
    )
    try:
        current: CertKeyPair | None = _read_pair(cert_dir, TLS_CERT, TLS_KEY, "")
    except ValueError:
        current = None  # none yet, or a half-written pair of ours: issue a new one
    serving = reconcile_serving(
        ca, current, dns_names, ip_addresses=ip_addresses, now=now, validity=validity
    )
    if serving is current:
        return serving, False
    _store_files(
        cert_dir,
        {TLS_CERT: (serving.cert_pem, 0o644), TLS_KEY: (serving.key_pem, 0o600)},
        managed=_SERVING_FILES,
    )
    return serving, True


def load_pki(directory: Path) -> WebhookPki | None:
    """Read the files `ensure_pki` writes; None when there are none yet, ValueError
    naming the file when a pair is broken (`ensure_pki` repairs that)."""
    files = _read_files(directory)
    if not files:
        return None
    try:
        return WebhookPki.from_files(files)
    except ValueError as exc:
        raise ValueError(
            f"{directory}: {exc}; remove the directory's files to start over"
        ) from None


def ensure_pki(
    directory: Path, dns_names: Sequence[str], **settings: Unpack[PkiSettings]
) -> tuple[WebhookPki, bool]:
    """Load, `reconcile_pki` and write back atomically; (pki, changed).

    A directory that does not load (a pair torn by an earlier release, a file damaged)
    is repaired, not refused: refusing would stop every later rotation and, since the
    emptyDir outlives the container, make every restart fail. What is whole is kept
    (`_salvage`); the rest is made again under the rules of a rotation, so nothing is
    served that the published bundle does not trust.
    """
    directory.mkdir(parents=True, exist_ok=True)
    settings["now"] = now = settings.get("now") or _now()
    damage: ValueError | None = None
    try:
        current: WebhookPki | PkiParts | None = load_pki(directory)
    except ValueError as exc:
        current, damage = _salvage(_read_files(directory), now), exc
    pki = reconcile_pki(current, dns_names, **settings)
    if isinstance(current, PkiParts):
        logger.warning(
            "webhook certificate files damaged; repaired",
            extra={
                "fields": {
                    "error": str(damage),
                    "ca_kept": current.ca is not None and pki.ca == current.ca,
                    "serving_kept": current.serving is not None and pki.serving == current.serving,
                    "previous_ca_signs": bool(pki.previous_ca and pki.previous_ca.key_pem),
                }
            },
        )
    elif pki is current:
        return pki, False
    store_pki(directory, pki)
    return pki, True


def store_pki(directory: Path, pki: WebhookPki) -> None:
    """Replace the files in `directory` with `pki`'s, all at once (`_store_files`)."""
    files = pki.files()
    _store_files(
        directory,
        {n: (data, 0o600 if n.endswith(".key") else 0o644) for n, data in files.items()},
        managed=_PKI_FILES,
    )


def check_serving_files(directory: Path) -> WebhookPki | None:
    """Validate a serving certificate directory filled by someone else (the Secret
    cert-manager writes: tls.crt, tls.key, ca.crt); returns what could be read as a
    `WebhookPki` when ca.crt is there (its key is not: the issuer keeps it), else None.

    ValueError names the missing or broken file and the fix.
    """
    serving = _read_pair(
        directory,
        TLS_CERT,
        TLS_KEY,
        "with --cert-source=files mount the Secret that cert-manager fills "
        "(type kubernetes.io/tls) at --cert-dir",
    )
    ca_file = directory / CA_CERT
    if not ca_file.is_file():
        return None
    ca = CertKeyPair(ca_file.read_bytes(), b"")
    try:
        ca.certificate  # noqa: B018 (parses the PEM)
    except ValueError as exc:
        raise ValueError(f"{ca_file}: unreadable certificate: {exc}") from None
    if not _issued_by(serving, ca):
        raise ValueError(
            f"{directory / TLS_CERT} is not signed by {ca_file}; the caBundle cert-manager "
            "injects would not trust it: check the Certificate's issuer"
        )
    return WebhookPki(ca=ca, serving=serving)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """`atomic_write` with an owner-only default: most of these files are keys."""
    atomic_write(path, data, mode=mode)


def _read_files(directory: Path) -> dict[str, bytes]:
    """The files of `ensure_pki` that are there (a link whose target is gone is not)."""
    return {n: (directory / n).read_bytes() for n in _PKI_FILES if (directory / n).is_file()}


def _salvage(files: Mapping[str, bytes], now: dt.datetime) -> PkiParts:
    """What can be kept of a directory that does not load: (ca, previous, serving).

    The CA is the newest unexpired CA certificate that some CA key in the directory
    belongs to (a CA rotation torn between ca.key and ca.crt leaves the old CA's
    certificate with ca-previous.key, which is its key); the previous CA is the other
    certificate, without a key when none belongs to it, so that what it signed stays
    trusted; the serving pair is kept only when its key belongs to it.
    """
    keys = [k for k in (files.get(CA_KEY), files.get(PREVIOUS_CA_KEY)) if k]
    cas: list[CertKeyPair] = []
    for name in (CA_CERT, PREVIOUS_CA_CERT):
        if name not in files:
            continue
        cert = CertKeyPair(files[name], b"")
        if not _readable_ca(cert) or cert.not_after <= now:
            continue
        if any(c.cert_pem == cert.cert_pem for c in cas):
            continue
        pairs = [CertKeyPair(cert.cert_pem, k) for k in keys]
        cas.append(next((pair for pair in pairs if _belongs(pair)), cert))
    serving = None
    if TLS_CERT in files and TLS_KEY in files:
        pair = CertKeyPair(files[TLS_CERT], files[TLS_KEY])
        serving = pair if _belongs(pair) else None
    keyed = sorted((c for c in cas if c.key_pem), key=lambda c: c.not_after, reverse=True)
    ca = keyed[0] if keyed else None
    others = [c for c in cas if c is not ca]
    # The one that signed the serving certificate first: it must stay trusted.
    others.sort(key=lambda c: serving is not None and _issued_by(serving, c), reverse=True)
    return PkiParts(ca, others[0] if others else None, serving)


def _store_files(
    directory: Path, files: Mapping[str, tuple[bytes, int]], *, managed: Iterable[str]
) -> None:
    """Make `files` (name: content, mode) the files of `directory`, all in one rename.

    They go in a fresh folder, then the ``..data`` link is swapped to it; each name is a
    link through ``..data``, so a reader (the server reloading tls.crt and tls.key, a
    restart) finds the old set or the new one, never a mix. A failure before the swap
    leaves the old set whole and nothing behind. `managed` are the names this writer
    owns: those not in `files` are removed after the swap.
    """
    directory.mkdir(parents=True, exist_ok=True)
    managed = tuple(managed)
    version = _new_version(directory, files)
    try:
        _adopt(directory, managed)
        for name in files:
            _link(directory, name, f"{_DATA}/{name}")  # dangles until the swap if new
        _link(directory, _DATA, version.name)
    except BaseException:
        if not _links_to(directory / _DATA, version.name):
            _remove_version(version)
        raise
    fsync_dir(directory)
    for name in managed:
        if name not in files and (directory / name).is_symlink():
            (directory / name).unlink()
    # What an earlier write left when it was stopped: older folders, unused links.
    for old in directory.iterdir():
        if old.name.startswith(_VERSION_PREFIX) and old.name != version.name:
            _remove_version(old)
        elif old.name.startswith(".") and old.name.endswith(_LINK_SUFFIX) and old.is_symlink():
            old.unlink(missing_ok=True)


def _new_version(directory: Path, files: Mapping[str, tuple[bytes, int]]) -> Path:
    """A new hidden folder in `directory` holding `files`; nothing left on failure."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    version = directory / f"{_VERSION_PREFIX}{stamp}-{secrets.token_hex(4)}"
    version.mkdir(mode=0o755)
    try:
        for name, (data, mode) in files.items():
            write_atomic(version / name, data, mode=mode)
    except BaseException:
        _remove_version(version)
        raise
    return version


def _adopt(directory: Path, managed: Sequence[str]) -> None:
    """Turn plain files (an earlier release's layout, or a hand-made one) into links
    through ``..data`` without changing what any of them reads: their contents move to a
    folder of their own first."""
    plain = [n for n in managed if (directory / n).is_file() and not (directory / n).is_symlink()]
    if not plain:
        return
    current = {
        n: ((directory / n).read_bytes(), stat.S_IMODE((directory / n).stat().st_mode))
        for n in managed
        if (directory / n).is_file()
    }
    version = _new_version(directory, current)
    _link(directory, _DATA, version.name)
    for name in current:
        _link(directory, name, f"{_DATA}/{name}")
    fsync_dir(directory)


def _link(directory: Path, name: str, target: str) -> None:
    """Make `name` a link to `target`, replacing what is there in one rename."""
    path = directory / name
    if _links_to(path, target):
        return
    tmp = directory / f".{name}.{secrets.token_hex(6)}{_LINK_SUFFIX}"
    tmp.symlink_to(target)
    try:
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _links_to(path: Path, target: str) -> bool:
    return path.is_symlink() and path.readlink() == Path(target)


def _remove_version(version: Path) -> None:
    """Remove a folder `_new_version` made (flat: files only); a failure is left for the
    next write to sweep."""
    with contextlib.suppress(OSError):
        for f in version.iterdir():
            f.unlink()
        version.rmdir()


def _read_pair(directory: Path, cert: str, key: str, fix: str) -> CertKeyPair:
    """The pair in `directory`, checked; ValueError naming what is missing or broken."""
    missing = [n for n in (cert, key) if not (directory / n).is_file()]
    if missing:
        raise ValueError(f"{directory} has no {' or '.join(missing)}: {fix}")
    pair = CertKeyPair((directory / cert).read_bytes(), (directory / key).read_bytes())
    pair.check(str(directory / cert))
    return pair


def _reissue(
    serving: CertKeyPair,
    signer: CertKeyPair,
    dns_names: Iterable[str],
    ip_addresses: Iterable[str],
    now: dt.datetime,
) -> bool:
    if needs_rotation(serving, now=now):
        return True
    if not _issued_by(serving, signer):
        return True
    try:
        sans = serving.certificate.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value
    except x509.ExtensionNotFound:
        return True
    wanted_ips = {ipaddress.ip_address(ip) for ip in ip_addresses}
    return (
        set(sans.get_values_for_type(x509.DNSName)) != set(dns_names)
        or set(sans.get_values_for_type(x509.IPAddress)) != wanted_ips
    )


def _belongs(pair: CertKeyPair) -> bool:
    """The key belongs to the certificate (both readable)."""
    try:
        pair.check("")
    except ValueError:
        return False
    return True


def _readable_ca(cert: CertKeyPair) -> bool:
    try:
        cert.certificate  # noqa: B018 (parses the PEM)
    except ValueError:
        return False
    return True


def _check_certificate(cert: CertKeyPair, name: str) -> None:
    """ValueError naming `name` unless the certificate can be read."""
    if not _readable_ca(cert):
        raise ValueError(f"{name}: unreadable certificate")


def _expired(cert: CertKeyPair, now: dt.datetime) -> bool:
    return now >= cert.not_after


def _issued_by(cert: CertKeyPair, ca: CertKeyPair) -> bool:
    try:
        cert.certificate.verify_directly_issued_by(ca.certificate)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertKeyPair:
    return CertKeyPair(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
