"""Client-certificate authentication of the API server, over real HTTPS: with a client CA
only a caller presenting a certificate it signed is served; the health listener stays
open to the kubelet's probes, which present none."""

from __future__ import annotations

import datetime as dt
import json
import resource
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteStream
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from gpudra.webhook.certs import CertKeyPair, ensure_pki, generate_ca, service_dns_names
from gpudra.webhook.server import ServerConfig, WebhookServer
from gpudra.webhook.tls import certificate_names

pytestmark = pytest.mark.anyio
NAMES = service_dns_names("gpudra-webhook", "gpudra")
GUARD = 30  # seconds: a hang guard, never a speed check
# What a refused handshake looks like to the client: TLS 1.3 reports the server's alert
# on the first read, earlier versions during the handshake.
REFUSED = (ssl.SSLError, OSError, anyio.EndOfStream, anyio.BrokenResourceError)


def client_cert(
    ca: CertKeyPair,
    name: str = "kube-apiserver",
    *dns: str,
    usage: x509.ObjectIdentifier | None = ExtendedKeyUsageOID.CLIENT_AUTH,
) -> CertKeyPair:
    """A client certificate as the API server's admission kubeConfigFile holds one: common
    name `name`, DNS names `dns`, extended key usage `usage` (None: no such extension)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = x509.CertificateBuilder()
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if dns:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False
        )
    cert = (
        builder.subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(ca.private_key, hashes.SHA256())
    )
    return CertKeyPair(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


class NoTemplates:
    async def __call__(self, namespace: str, templates: Any, dry_run: bool) -> None:
        return None


def review() -> bytes:
    pod = {"metadata": {"name": "p", "namespace": "a"}, "spec": {"containers": [{"name": "c"}]}}
    body = json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "namespace": "a",
                "operation": "CREATE",
                "object": pod,
            },
        }
    ).encode()
    head = f"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def call(
    port: int, server_ca: bytes, tmp: Path, request: bytes, identity: CertKeyPair | None = None
) -> bytes:
    """One request on a fresh connection; the status line of the answer."""
    context = ssl.create_default_context(cadata=server_ca.decode())
    if identity is not None:
        (tmp / "client.crt").write_bytes(identity.cert_pem)
        (tmp / "client.key").write_bytes(identity.key_pem)
        context.load_cert_chain(tmp / "client.crt", tmp / "client.key")
    stream = await anyio.connect_tcp(
        "127.0.0.1", port, tls=True, ssl_context=context, tls_hostname=NAMES[0]
    )
    try:
        buffered = BufferedByteStream(stream)
        await buffered.send(request)
        head = await buffered.receive_until(b"\r\n", 4096)
    finally:
        await anyio.aclose_forcefully(stream)
    return head


def serving(
    tmp: Path, client_ca: CertKeyPair, *names: str, max_connections: int = 1024
) -> tuple[WebhookServer, bytes]:
    """A server on a fresh serving PKI under `tmp` that trusts `client_ca` for clients
    (with `names`, only certificates carrying one); and the serving CA."""
    pki, _ = ensure_pki(tmp / "serving", NAMES)
    (tmp / "client-ca.crt").write_bytes(client_ca.cert_pem)
    config = ServerConfig(
        cert_file=tmp / "serving" / "tls.crt",
        key_file=tmp / "serving" / "tls.key",
        host="127.0.0.1",
        port=0,
        cert_check_interval=0.05,
        max_connections=max_connections,
    )
    server = WebhookServer(config, NoTemplates())
    server.tls.require_client_certificates(tmp / "client-ca.crt", names)
    return server, pki.ca.cert_pem


async def test_only_a_client_certificate_from_the_ca_is_served(tmp_path: Path) -> None:
    api_ca, other_ca = generate_ca(), generate_ca()
    server, ca = serving(tmp_path, api_ca)
    client_ca_file = tmp_path / "client-ca.crt"
    health = server.health_server(0)
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            health_port = await tg.start(health.serve)

            assert await call(port, ca, tmp_path, review(), client_cert(api_ca)) == (
                b"HTTP/1.1 200 OK"
            )
            for stranger in (None, client_cert(other_ca)):
                with pytest.raises(REFUSED):
                    await call(port, ca, tmp_path, review(), stranger)
            # The probes' port: no client certificate, no admission endpoints.
            ready = b"GET /readyz HTTP/1.1\r\nHost: w\r\n\r\n"
            assert await call(health_port, ca, tmp_path, ready) == b"HTTP/1.1 200 OK"
            status = await call(health_port, ca, tmp_path, review())
            assert status.startswith(b"HTTP/1.1 404")

            # The API server's CA is replaced: the file is reloaded like the serving files.
            new_api_ca = generate_ca()
            client_ca_file.write_bytes(new_api_ca.cert_pem)
            while not await _served(port, ca, tmp_path, client_cert(new_api_ca)):
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()


async def test_strangers_cannot_close_the_api_servers_connections(tmp_path: Path) -> None:
    """A client that cannot pass the handshake (no certificate, or one of another CA)
    only ever takes the place of another handshake, never of a served connection: more
    of them than the connection bound leave the API server's kept-alive one served."""
    api_ca, other_ca = generate_ca(), generate_ca()
    server, ca = serving(tmp_path, api_ca, max_connections=2)
    health = b"GET /healthz HTTP/1.1\r\nHost: w\r\n\r\n"
    identity = client_cert(api_ca)
    (tmp_path / "api.crt").write_bytes(identity.cert_pem)
    (tmp_path / "api.key").write_bytes(identity.key_pem)
    context = ssl.create_default_context(cadata=ca.decode())
    context.load_cert_chain(tmp_path / "api.crt", tmp_path / "api.key")
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            kept = BufferedByteStream(
                await anyio.connect_tcp(
                    "127.0.0.1", port, tls=True, ssl_context=context, tls_hostname=NAMES[0]
                )
            )
            await kept.send(health)
            assert (await kept.receive_until(b"ok\n", 4096)).startswith(b"HTTP/1.1 200 OK")
            bare = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(4)]
            for _ in range(2):
                with pytest.raises(REFUSED):
                    await call(port, ca, tmp_path, review(), client_cert(other_ca))
            await kept.send(health)
            assert (await kept.receive_until(b"ok\n", 4096)).startswith(b"HTTP/1.1 200 OK")
            for stream in bare:
                await stream.aclose()
            await kept.aclose()
            tg.cancel_scope.cancel()


async def test_with_client_certificates_fewer_handshakes_may_be_under_way(
    tmp_path: Path,
) -> None:
    """A handshake that asks for a client certificate holds one as large as its client
    declares (one stalled inside a declared 100 KiB certificate held about 0.21 MiB, one
    that sent only its hello 0.06 MiB): with client certificates required, a quarter of
    the connection bound may be under way at once, the one accepted longest ago making
    room, and the API server is still served. The health port asks for none and keeps
    the whole bound."""
    api_ca = generate_ca()
    server, ca = serving(tmp_path, api_ca, max_connections=400)
    health = server.health_server(0)
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            health_port = await tg.start(health.serve)
            http = server._http
            bound = http._handshake_bound()
            assert bound == max(64, http._max_connections // 4) < http._max_connections
            assert health._handshake_bound() == health._max_connections > bound + 1
            held = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(bound + 1)]
            held += [await anyio.connect_tcp("127.0.0.1", health_port) for _ in range(bound + 1)]
            try:
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError, OSError)):
                    await held[0].receive()  # the first accepted made room
                assert len(http._handshaking) == bound
                while len(health._handshaking) < bound + 1:
                    await anyio.sleep(0.01)
                identity = client_cert(api_ca)
                assert await call(port, ca, tmp_path, review(), identity) == b"HTTP/1.1 200 OK"
            finally:
                for stream in held:
                    await stream.aclose()
            tg.cancel_scope.cancel()


async def test_with_names_only_a_certificate_carrying_one_is_served(tmp_path: Path) -> None:
    """A CA often signs more than the API server's certificate (a cluster's CA signs every
    kubelet's): with names, a certificate of that CA carrying none of them is cut off
    before any HTTP, whatever it sends; its common name or a DNS name may carry one."""
    cluster_ca = generate_ca()
    server, ca = serving(tmp_path, cluster_ca, NAMES[0])
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            served = (
                client_cert(cluster_ca, NAMES[0]),
                client_cert(cluster_ca, "kube-apiserver", "apiserver.example", NAMES[0]),
            )
            for identity in served:
                assert await call(port, ca, tmp_path, review(), identity) == b"HTTP/1.1 200 OK"
            strangers = (
                client_cert(cluster_ca, "system:node:worker-1"),
                client_cert(cluster_ca, "kube-apiserver", "apiserver.example"),
                client_cert(cluster_ca, NAMES[0].upper()),
                # Not made for client authentication (a serving certificate of the CA).
                client_cert(cluster_ca, "x", NAMES[0], usage=None),
                client_cert(cluster_ca, "x", NAMES[0], usage=ExtendedKeyUsageOID.SERVER_AUTH),
            )
            for stranger in strangers:
                with pytest.raises(REFUSED):
                    await call(port, ca, tmp_path, review(), stranger)
            tg.cancel_scope.cancel()


def test_certificate_names_are_its_common_names_and_dns_names() -> None:
    ca = generate_ca()
    both = x509.load_pem_x509_certificate(client_cert(ca, "api", "a.example").cert_pem)
    assert certificate_names(both) == {"api", "a.example"}
    alone = x509.load_pem_x509_certificate(client_cert(ca, "api").cert_pem)
    assert certificate_names(alone) == {"api"}


def _client_context(
    server_ca: bytes, tmp: Path, identity: CertKeyPair, version: ssl.TLSVersion
) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=server_ca.decode())
    context.minimum_version = context.maximum_version = version
    (tmp / "client.crt").write_bytes(identity.cert_pem)
    (tmp / "client.key").write_bytes(identity.key_pem)
    context.load_cert_chain(tmp / "client.crt", tmp / "client.key")
    return context


def _exchange(
    port: int, context: ssl.SSLContext, session: ssl.SSLSession | None = None
) -> tuple[bytes, ssl.SSLSession | None]:
    """Blocking: one request (resuming `session` if given); the answer's status line
    (b"" when the server closed without one) and the session."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=GUARD) as raw,
        context.wrap_socket(raw, server_hostname=NAMES[0], session=session) as tls,
    ):
        tls.sendall(review())
        try:
            line = tls.recv(4096).split(b"\r\n", 1)[0]
        except (ssl.SSLError, OSError):
            line = b""
        return line, tls.session


async def test_a_client_the_ca_no_longer_signs_cannot_resume_its_way_in(tmp_path: Path) -> None:
    """A resumed TLS session skips certificate verification: after the client CA is
    replaced (a leaked key), a client that resumed its earlier session would be served
    for as long as it kept resuming. No session is resumed while client certificates are
    required, in TLS 1.3 (no tickets) or 1.2 (session IDs refused)."""
    old_ca, new_ca = generate_ca(), generate_ca()
    server, ca = serving(tmp_path, old_ca)
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
                (tmp_path / "client-ca.crt").write_bytes(old_ca.cert_pem)
                while not await _served(port, ca, tmp_path, client_cert(old_ca)):
                    await anyio.sleep(0.05)
                context = _client_context(ca, tmp_path, client_cert(old_ca), version)
                line, session = await anyio.to_thread.run_sync(_exchange, port, context)
                assert line == b"HTTP/1.1 200 OK"
                (tmp_path / "client-ca.crt").write_bytes(new_ca.cert_pem)
                while not await _served(port, ca, tmp_path, client_cert(new_ca)):
                    await anyio.sleep(0.05)
                try:
                    line, _ = await anyio.to_thread.run_sync(_exchange, port, context, session)
                except REFUSED:
                    line = b""  # a full handshake, refused
                assert line == b"", version
            tg.cancel_scope.cancel()


async def _served(port: int, ca: bytes, tmp: Path, identity: CertKeyPair) -> bool:
    try:
        return await call(port, ca, tmp, review(), identity) == b"HTTP/1.1 200 OK"
    except REFUSED:
        return False


async def test_unreadable_client_ca_is_refused_at_start(tmp_path: Path) -> None:
    ensure_pki(tmp_path, NAMES)
    config = ServerConfig(cert_file=tmp_path / "tls.crt", key_file=tmp_path / "tls.key")
    server = WebhookServer(config, NoTemplates())
    (tmp_path / "garbage.crt").write_text("not a certificate")
    with pytest.raises(ssl.SSLError):
        server.tls.require_client_certificates(tmp_path / "garbage.crt")
    with pytest.raises(OSError):
        server.tls.require_client_certificates(tmp_path / "missing.crt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_gpudra_webhook_wires_client_auth_and_the_charts_ca(tmp_path: Path) -> None:
    """`gpudra webhook` as the chart runs it with tls.source=helm and clientAuth: the
    serving certificate signed from the mounted CA, the API server's certificate
    required on the admission port, the probes answered on the health port. Started, as
    in many containers, with a soft open-files limit far under the hard one, it raises
    the soft limit, so a connection flood finds its connection bound, not the limit."""
    chart_ca, api_ca = generate_ca(), generate_ca()
    ca_dir = tmp_path / "chart-secret"
    ca_dir.mkdir()
    (ca_dir / "ca.crt").write_bytes(chart_ca.cert_pem)
    (ca_dir / "ca.key").write_bytes(chart_ca.key_pem)
    (tmp_path / "client-ca.crt").write_bytes(api_ca.cert_pem)
    # Nothing here calls the API server (no tenants, no GPU pods): an address that is
    # never dialled is enough.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    port, health_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "gpudra.cli",
        "webhook",
        "--host=127.0.0.1",
        f"--port={port}",
        "--cert-source=ca",
        f"--ca-dir={ca_dir}",
        f"--cert-dir={tmp_path / 'serving'}",
        f"--client-ca-file={tmp_path / 'client-ca.crt'}",
        f"--health-port={health_port}",
        f"--kubeconfig={kubeconfig}",
        "--no-tenants",
        "--no-validate-claims",
    ]
    ready = b"GET /readyz HTTP/1.1\r\nHost: w\r\n\r\n"
    ca = chart_ca.cert_pem
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    command = ["bash", "-c", f'ulimit -Sn {low} && exec "$@"', "gpudra", *command]
    async with await anyio.open_process(command) as process:
        try:
            with anyio.fail_after(GUARD):
                while True:
                    try:
                        if await call(health_port, ca, tmp_path, ready) == b"HTTP/1.1 200 OK":
                            break
                    except REFUSED:
                        pass
                    assert process.returncode is None, "gpudra webhook exited"
                    await anyio.sleep(0.1)
                assert await _served(port, ca, tmp_path, client_cert(api_ca))
                assert open_files_limits(process.pid) == (hard, hard)
                with pytest.raises(REFUSED):
                    await call(port, ca, tmp_path, review())
        finally:
            if process.returncode is None:  # uvloop refuses to signal a process that ended
                process.terminate()


def open_files_limits(pid: int) -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE of process `pid`, from /proc."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")
