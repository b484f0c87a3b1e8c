"""Certificates for the local control plane: one CA, serving and client certs."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)
CaKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _write_key(path: Path, key: CaKey, *, pkcs1: bool = False) -> None:
    """PKCS#8, or PKCS#1 for an RSA key a reader takes only in that form (Kueue's rotator)."""
    fmt = (
        serialization.PrivateFormat.TraditionalOpenSSL
        if pkcs1
        else serialization.PrivateFormat.PKCS8
    )
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def make_ca(
    directory: Path,
    cn: str = "gpudra-local-ca",
    *,
    dns: tuple[str, ...] = (),
    rsa_key: bool = False,
) -> tuple[x509.Certificate, CaKey]:
    """A CA in `directory`. For Kueue's certificate rotator, which keeps a CA only if it
    is valid for its name (`dns`) and its key is RSA (`rsa_key`), written as PKCS#1."""
    key: CaKey = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if rsa_key
        else ec.generate_private_key(ec.SECP256R1())
    )
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
    )
    if dns:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False
        )
    cert = builder.sign(key, hashes.SHA256())
    (directory / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / "ca.key", key, pkcs1=rsa_key)
    return cert, key


def load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA that `make_ca` wrote, for certificates issued after the cluster is up."""
    cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{directory / 'ca.key'} is not an EC key")
    return cert, key


def issue(
    directory: Path,
    stem: str,
    ca: tuple[x509.Certificate, CaKey],
    cn: str,
    *,
    org: str | None = None,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    server: bool = False,
) -> None:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn, org))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if server
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if dns or ips:
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / f"{stem}.key", key)


def make_service_account_keys(directory: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(directory / "sa.key", key)
    (directory / "sa.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
