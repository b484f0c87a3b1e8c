"""The serving TLS context, reloaded when the certificate files change.

Every certificate source rotates the files under a running server, each the same way:
the set is swapped whole through a ``..data`` link (the kubelet's swap of cert-manager's
Secret volume, and `gpudra.webhook.certs` for the webhook's own certificates), so the
certificate and its key always change together. A rotated certificate must reach new
connections at once while open connections keep theirs: no restart, no dropped
requests. The listener gets one context for its whole life
(`listener_context`); during each handshake its SNI callback (called for every
ClientHello, with or without a server name) moves the connection to the newest loaded
context, so the swap costs one attribute write per handshake and never touches an open
connection.

With `require_client_certificates` every handshake must also present a client
certificate signed by the given CA (the API server's, from its admission
``kubeConfigFile``), so only the API server can send reviews; a client without one is
refused before any HTTP. The CA file is reloaded like the serving files. A CA often
signs more than the API server's certificate (a cluster's CA signs every kubelet's and
many users'), so the names a client certificate may carry can be given too: its
subject's common name or one of its DNS names must be one of them, and it must be made
for client authentication (the clientAuth extended key usage, present, so that a
serving certificate of the same CA, which often has no key usage at all, does not
pass). `client_problem` checks a connection once the handshake has verified its
certificate, before any HTTP.

No TLS session is resumed while client certificates are required: a resumed session
skips verification, so a client whose certificate the CA no longer signs (the CA file
replaced after a leak) would be served as long as it kept resuming, each resumption
handing it a new ticket. The contexts issue no tickets, and a connection that resumed
a session anyway (TLS 1.2's session IDs, which Python cannot turn off) is refused; Go's
TLS client, the API server's, resumes with tickets only, so it always makes a full
handshake.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio
import anyio.to_thread
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["ReloadingTLSContext", "certificate_names"]

logger = logging.getLogger(__name__)


class ReloadingTLSContext:
    """Serving TLS context, rebuilt when the certificate or key file changes.

    A pair that does not match (read across a swap, or written by hand one file at a
    time) keeps the previous context until the files change again.
    """

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        *,
        on_reload: Callable[[bool], None] | None = None,
    ) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._client_ca_file: Path | None = None
        self._client_names: frozenset[str] = frozenset()
        self._on_reload = on_reload
        self._signature = self._stat()
        self._context = self._build()
        self._failed: tuple[tuple[int, ...], ...] | None = None
        self._listener = self._context
        self._listener.sni_callback = self._select

    @property
    def context(self) -> ssl.SSLContext:
        """The newest loaded context: the one a handshake starting now uses."""
        return self._context

    @property
    def listener_context(self) -> ssl.SSLContext:
        """The context to give the listener: it hands each handshake to `context`."""
        return self._listener

    @property
    def client_ca_file(self) -> Path | None:
        """The CA client certificates must be signed by; None when none is asked for."""
        return self._client_ca_file

    @property
    def client_names(self) -> frozenset[str]:
        """The names a client certificate must carry one of; empty: any the CA signed."""
        return self._client_names

    def require_client_certificates(self, ca_file: Path, names: Iterable[str] = ()) -> None:
        """From now on, refuse every handshake without a client certificate signed by the
        CA in `ca_file` and, with `names`, every connection whose certificate carries
        none of them (`client_problem`). Call before serving; OSError or ssl.SSLError
        when unreadable."""
        self._client_ca_file = ca_file
        self._client_names = frozenset(names)
        # OpenSSL keeps the verify mode of the context a connection was accepted on, and
        # verifies against the store of the one the SNI callback moved it to: set both.
        _require_client_certificates(self._listener, ca_file)
        self._signature = self._stat()
        self._context = self._build()
        self._failed = None

    def client_problem(self, tls: ssl.SSLObject | None) -> str | None:
        """Why a connection whose handshake passed may not send requests; None when it
        may, or when no client certificate is required. `tls` is the connection's
        ``ssl_object``."""
        if self._client_ca_file is None:
            return None
        if tls is None:
            return "not a TLS connection"
        if tls.session_reused:
            return "a resumed TLS session, whose certificate was not verified again"
        if not self._client_names:
            return None
        der = tls.getpeercert(binary_form=True)
        if not der:
            return "no client certificate"
        try:
            cert = x509.load_der_x509_certificate(der)
            usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            return "a client certificate without the clientAuth extended key usage"
        except ValueError as exc:
            return f"a client certificate that cannot be read: {exc}"
        if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
            return "a client certificate without the clientAuth extended key usage"
        carried = certificate_names(cert)
        if carried & self._client_names:
            return None
        shown = ", ".join(sorted(carried)[:4]) or "no common name or DNS name"
        return f"client certificate names {shown}, none of the accepted ones"

    def reload_if_changed(self) -> bool:
        """Reload when the files changed since the last load; True when reloaded."""
        try:
            signature = self._stat()
        except OSError as exc:
            logger.warning(
                "serving certificate files unreadable; keeping the current certificate",
                extra={"fields": {"error": str(exc)}},
            )
            return False
        if signature in (self._signature, self._failed):
            return False
        try:
            context = self._build()
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._failed = signature
            logger.warning(
                "could not load the new serving certificate; keeping the current one",
                extra={"fields": {"cert_file": str(self._cert_file), "error": str(exc)}},
            )
            if self._on_reload:
                self._on_reload(False)
            return False
        self._context, self._signature, self._failed = context, signature, None
        logger.info(
            "serving certificate reloaded", extra={"fields": {"cert_file": str(self._cert_file)}}
        )
        if self._on_reload:
            self._on_reload(True)
        return True

    async def watch(self, interval: float) -> None:
        """Poll the files every `interval` seconds (off the event loop) until cancelled."""
        while True:
            await anyio.sleep(interval)
            await anyio.to_thread.run_sync(self.reload_if_changed)

    def _select(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext
    ) -> None:
        current = self._context
        if connection.context is not current:
            connection.context = current

    def _stat(self) -> tuple[tuple[int, ...], ...]:
        # stat() follows symlinks, so a Secret volume's atomic ..data swap is seen.
        files = [self._cert_file, self._key_file]
        if self._client_ca_file is not None:
            files.append(self._client_ca_file)
        return tuple(
            (s.st_mtime_ns, s.st_size, s.st_ino, s.st_dev) for s in (f.stat() for f in files)
        )

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._cert_file, self._key_file)
        # Only HTTP/1.1: the API server must not try HTTP/2 on this listener.
        context.set_alpn_protocols(["http/1.1"])
        if self._client_ca_file is not None:
            _require_client_certificates(context, self._client_ca_file)
        return context


def _require_client_certificates(context: ssl.SSLContext, ca_file: Path) -> None:
    context.load_verify_locations(cafile=ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    # No session tickets, so no resumption without verification (see the module
    # docstring): none issued in TLS 1.3, none accepted in TLS 1.2.
    context.num_tickets = 0
    context.options |= ssl.OP_NO_TICKET


def certificate_names(cert: x509.Certificate) -> frozenset[str]:
    """The subject common names and subjectAltName DNS names of a certificate."""
    names = {
        a.value
        for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if isinstance(a.value, str)
    }
    try:
        alternative = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return frozenset(names)
    return frozenset(names | set(alternative.value.get_values_for_type(x509.DNSName)))
