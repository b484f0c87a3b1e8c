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
`ensure_pki` adds atomic file storage in the layout of a ``kubernetes.io/tls`` Secret.
`ensure_serving_from_ca` renews only the serving pair from a CA someone else keeps and
publishes (the chart's, ``--cert-source=ca``); both share `reconcile_serving`.
`check_serving_files` validates such a directory filled by someone else (cert-manager).
Keys are ECDSA P-256: cheap to generate and fast to handshake.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from gpudra.api.names import check_dns_label
from gpudra.common.files import atomic_write

__all__ = [
    "CA_PROPAGATION",
    "CA_VALIDITY",
    "LOOPBACK_IPS",
    "SERVING_VALIDITY",
    "BundlePublished",
    "CertKeyPair",
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
    that stays trusted until it expires."""

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
        if PREVIOUS_CA_CERT in files and PREVIOUS_CA_KEY in files:
            previous = CertKeyPair(files[PREVIOUS_CA_CERT], files[PREVIOUS_CA_KEY])
            previous.check(PREVIOUS_CA_CERT)
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


def reconcile_pki(
    current: WebhookPki | None,
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
    with both CAs published at least `ca_propagation` ago.
    """
    now = now or _now()
    if current is None:
        ca = generate_ca(validity=ca_validity, now=now)
        serving = generate_serving_cert(
            ca, dns_names, ip_addresses=ip_addresses, validity=serving_validity, now=now
        )
        return WebhookPki(ca=ca, serving=serving)
    ca, previous = current.ca, current.previous_ca
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
    serving = reconcile_serving(
        signer,
        current.serving,
        dns_names,
        ip_addresses=ip_addresses,
        now=now,
        validity=serving_validity,
    )
    result = WebhookPki(ca=ca, serving=serving, previous_ca=previous)
    return current if result == current else result


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
    cert_dir.mkdir(parents=True, exist_ok=True)
    # The key first: a reader that loads the new certificate finds its key already there.
    write_atomic(cert_dir / TLS_KEY, serving.key_pem)
    write_atomic(cert_dir / TLS_CERT, serving.cert_pem, mode=0o644)
    return serving, True


def load_pki(directory: Path) -> WebhookPki | None:
    """Read the files `ensure_pki` writes; None when there are none yet."""
    names = (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY, PREVIOUS_CA_CERT, PREVIOUS_CA_KEY)
    files = {n: (directory / n).read_bytes() for n in names if (directory / n).is_file()}
    if not files:
        return None
    try:
        return WebhookPki.from_files(files)
    except ValueError as exc:
        raise ValueError(
            f"{directory}: {exc}; remove the directory's files to start over"
        ) from None


def ensure_pki(
    directory: Path,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = LOOPBACK_IPS,
    now: dt.datetime | None = None,
    ca_validity: dt.timedelta = CA_VALIDITY,
    serving_validity: dt.timedelta = SERVING_VALIDITY,
    ca_propagation: dt.timedelta = CA_PROPAGATION,
    ca_published: BundlePublished | None = None,
) -> tuple[WebhookPki, bool]:
    """Load, rotate what is due and write back atomically; (pki, changed)."""
    directory.mkdir(parents=True, exist_ok=True)
    current = load_pki(directory)
    pki = reconcile_pki(
        current,
        dns_names,
        ip_addresses=ip_addresses,
        now=now,
        ca_validity=ca_validity,
        serving_validity=serving_validity,
        ca_propagation=ca_propagation,
        ca_published=ca_published,
    )
    if pki is current:
        return pki, False
    store_pki(directory, pki)
    return pki, True


def store_pki(directory: Path, pki: WebhookPki) -> None:
    """Write `pki` in the order that keeps every intermediate state servable."""
    directory.mkdir(parents=True, exist_ok=True)
    files = pki.files()
    # The bundle goes first so no certificate appears before the CA that trusts it;
    # the key before the certificate, so a reader that loads the new certificate
    # finds its key already there.
    for name in (CA_BUNDLE, PREVIOUS_CA_KEY, PREVIOUS_CA_CERT, CA_KEY, CA_CERT, TLS_KEY, TLS_CERT):
        if name in files:
            write_atomic(
                directory / name, files[name], mode=0o600 if name.endswith(".key") else 0o644
            )
        else:
            (directory / name).unlink(missing_ok=True)


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
