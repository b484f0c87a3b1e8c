from __future__ import annotations

import base64
import datetime as dt
import errno
import ipaddress
import json
import os
import ssl
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteStream
from anyio.streams.tls import TLSAttribute
from cryptography import x509
from gpudra.webhook.cabundle import certificates
from gpudra.webhook.certs import (
    CA_PROPAGATION,
    CertKeyPair,
    WebhookPki,
    ca_bundle,
    check_serving_files,
    ensure_pki,
    ensure_serving_from_ca,
    generate_ca,
    generate_serving_cert,
    load_pki,
    needs_rotation,
    reconcile_pki,
    service_dns_names,
    write_atomic,
)
from gpudra.webhook.renewal import ServingRenewal
from gpudra.webhook.server import ServerConfig, WebhookServer

NAMES = service_dns_names("gpudra-webhook", "gpudra")
T0 = dt.datetime(2027, 1, 1, tzinfo=dt.UTC)


def issued_by(cert: CertKeyPair, ca: CertKeyPair) -> bool:
    try:
        cert.certificate.verify_directly_issued_by(ca.certificate)
    except Exception:
        return False
    return True


def sans(cert: CertKeyPair) -> tuple[set[str], set[str]]:
    ext = cert.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        set(ext.get_values_for_type(x509.DNSName)),
        {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)},
    )


def test_service_dns_names() -> None:
    assert NAMES == ("gpudra-webhook.gpudra.svc", "gpudra-webhook.gpudra.svc.cluster.local")
    assert service_dns_names("s", "n", "corp.example")[1] == "s.n.svc.corp.example"
    with pytest.raises(ValueError, match="namespace 'Bad_NS'"):
        service_dns_names("svc", "Bad_NS")


def test_serving_cert_has_service_names_and_loopback() -> None:
    ca = generate_ca(now=T0)
    serving = generate_serving_cert(ca, NAMES, now=T0)
    assert sans(serving) == (set(NAMES), {"127.0.0.1"})
    assert issued_by(serving, ca)
    cert = serving.certificate
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert serving.not_after == T0 + dt.timedelta(days=365)
    assert serving.not_before < T0  # backdated for clock skew


def test_serving_cert_verifies_with_a_standard_tls_client(tmp_path: Path) -> None:
    ca = generate_ca()
    serving = generate_serving_cert(ca, NAMES)
    (tmp_path / "tls.crt").write_bytes(serving.cert_pem)
    (tmp_path / "tls.key").write_bytes(serving.key_pem)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_ctx = ssl.create_default_context(cadata=ca_bundle(ca).decode())
    if hasattr(ssl, "VERIFY_X509_STRICT"):
        client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    for hostname in (NAMES[0], NAMES[1], "127.0.0.1"):
        _handshake(server_ctx, client_ctx, hostname)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server_ctx, client_ctx, "other.gpudra.svc")


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str) -> None:
    """In-memory TLS handshake between the two contexts."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, obj in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    obj.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


def test_serving_cert_never_outlives_its_ca() -> None:
    ca = generate_ca(validity=dt.timedelta(days=30), now=T0)
    serving = generate_serving_cert(ca, NAMES, now=T0)
    assert serving.not_after == ca.not_after


def test_generate_serving_cert_needs_a_name() -> None:
    with pytest.raises(ValueError, match="dns_names"):
        generate_serving_cert(generate_ca(), [])


def test_needs_rotation_when_a_third_remains() -> None:
    serving = generate_serving_cert(generate_ca(now=T0), NAMES, now=T0)
    life = serving.not_after - serving.not_before
    two_thirds = serving.not_before + life * 2 / 3
    assert not needs_rotation(serving, now=T0)
    assert not needs_rotation(serving, now=two_thirds - dt.timedelta(hours=1))
    assert needs_rotation(serving, now=two_thirds + dt.timedelta(hours=1))
    assert needs_rotation(serving, now=serving.not_after)
    assert needs_rotation(serving.certificate, now=serving.not_before - dt.timedelta(days=1))


def test_reconcile_creates_then_keeps() -> None:
    pki = reconcile_pki(None, NAMES, now=T0)
    assert issued_by(pki.serving, pki.ca)
    assert pki.previous_ca is None
    assert pki.ca_bundle == pki.ca.cert_pem
    assert reconcile_pki(pki, NAMES, now=T0 + dt.timedelta(days=100)) is pki


def test_serving_rotation_keeps_the_ca() -> None:
    pki = reconcile_pki(None, NAMES, now=T0)
    later = T0 + dt.timedelta(days=250)
    rotated = reconcile_pki(pki, NAMES, now=later)
    assert rotated.ca == pki.ca
    assert rotated.ca_bundle == pki.ca_bundle  # nothing to publish
    assert rotated.serving != pki.serving
    assert issued_by(rotated.serving, pki.ca)
    assert rotated.serving.not_before > pki.serving.not_before


def test_changed_names_reissue_the_serving_cert() -> None:
    pki = reconcile_pki(None, NAMES, now=T0)
    renamed = reconcile_pki(pki, (*NAMES, "extra.gpudra.svc"), now=T0)
    assert renamed.ca == pki.ca
    assert "extra.gpudra.svc" in sans(renamed.serving)[0]
    more_ips = reconcile_pki(
        renamed, (*NAMES, "extra.gpudra.svc"), ip_addresses=("127.0.0.1", "::1"), now=T0
    )
    assert sans(more_ips.serving)[1] == {"127.0.0.1", str(ipaddress.ip_address("::1"))}


def test_ca_rotation_overlaps_so_clients_never_see_an_unknown_issuer() -> None:
    pki = reconcile_pki(None, NAMES, now=T0)
    old_ca = pki.ca
    # Two thirds into the CA's ten years: a new CA, the old one still in the bundle,
    # and the serving cert still from the old CA until the new bundle has propagated.
    t1 = T0 + dt.timedelta(days=2500)
    step1 = reconcile_pki(pki, NAMES, now=t1)
    assert step1.ca != old_ca
    assert step1.previous_ca == old_ca
    assert old_ca.cert_pem in step1.ca_bundle
    assert step1.ca.cert_pem in step1.ca_bundle
    assert issued_by(step1.serving, old_ca)
    assert not needs_rotation(step1.serving, now=t1)

    t2 = t1 + CA_PROPAGATION + dt.timedelta(minutes=1)
    step2 = reconcile_pki(step1, NAMES, now=t2)
    assert step2.ca == step1.ca
    assert issued_by(step2.serving, step2.ca)
    assert step2.ca_bundle == step1.ca_bundle  # the old CA stays until it expires

    step3 = reconcile_pki(step2, NAMES, now=old_ca.not_after + dt.timedelta(days=1))
    assert step3.previous_ca is None
    assert step3.ca_bundle == step3.ca.cert_pem
    assert issued_by(step3.serving, step3.ca)


def test_ca_bundle_dedupes_and_keeps_order() -> None:
    a, b = generate_ca(), generate_ca()
    assert ca_bundle(a, b, a) == a.cert_pem + b.cert_pem
    pki = WebhookPki(ca=a, serving=generate_serving_cert(a, NAMES), previous_ca=b)
    assert pki.ca_bundle == a.cert_pem + b.cert_pem
    assert base64.b64decode(pki.ca_bundle_base64()) == pki.ca_bundle


def test_ensure_pki_writes_atomically_with_private_keys(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    pki, changed = ensure_pki(d, NAMES, now=T0)
    assert changed
    assert visible(d) == ["ca-bundle.crt", "ca.crt", "ca.key", "tls.crt", "tls.key"]
    # Each a link through ..data to the one folder of the last write.
    assert all((d / name).readlink() == Path("..data", name) for name in visible(d))
    assert [p.name for p in d.iterdir() if p.name.startswith("..pki-")] == [
        (d / "..data").readlink().name
    ]
    for name in ("ca.key", "tls.key"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "tls.crt").stat().st_mode) == 0o644
    assert (d / "ca-bundle.crt").read_bytes() == pki.ca_bundle
    assert load_pki(d) == pki

    again, changed = ensure_pki(d, NAMES, now=T0 + dt.timedelta(days=1))
    assert (again, changed) == (pki, False)

    rotated, changed = ensure_pki(d, NAMES, now=T0 + dt.timedelta(days=2500))
    assert changed
    assert (d / "ca-previous.crt").read_bytes() == pki.ca.cert_pem
    assert load_pki(d) == rotated
    expired, _ = ensure_pki(d, NAMES, now=pki.ca.not_after + dt.timedelta(days=1))
    assert expired.previous_ca is None
    assert not (d / "ca-previous.crt").exists()
    assert not (d / "ca-previous.key").exists()
    assert visible(d) == ["ca-bundle.crt", "ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert len([p for p in d.iterdir() if p.name.startswith("..pki-")]) == 1


def visible(directory: Path) -> list[str]:
    """The names a reader uses: no hidden folder, link or temp file."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def test_load_pki_rejects_a_broken_pair(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    ensure_pki(d, NAMES)
    assert load_pki(tmp_path / "empty") is None
    (d / "tls.key").write_bytes(generate_ca().key_pem)
    with pytest.raises(ValueError, match=r"tls\.crt: the private key does not belong"):
        load_pki(d)
    (d / "ca.crt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"ca\.crt: unreadable"):
        load_pki(d)
    (d / "ca.key").unlink()
    with pytest.raises(ValueError, match=r"missing ca\.key"):
        load_pki(d)


# -- a write that fails halfway, and directories an earlier release left torn ----------


def fail_once(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Make the first rename onto a file called `name` fail as on a full disk; the list
    says whether it did."""
    real = os.replace
    failed: list[str] = []

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        if Path(dst).name == name and not failed:
            failed.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return failed


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def plain_files(directory: Path, files: Mapping[str, bytes]) -> None:
    """A directory as an earlier release wrote it: each file on its own, no links."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def test_a_renewal_that_fails_halfway_leaves_the_old_pair_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving renewal fails between the key and the certificate (the emptyDir
    full, the container killed): the old pair stays whole, so the next check renews it
    and a restart loads it. Written one file after the other, the new key sat beside the
    old certificate, and every later check and every restart failed on it."""
    d = tmp_path / "pki"
    before, _ = ensure_pki(d, NAMES, now=T0)
    left = hidden(d)
    due = T0 + dt.timedelta(days=300)
    failed = fail_once(monkeypatch, "tls.crt")
    with pytest.raises(OSError, match="No space left"):
        ensure_pki(d, NAMES, now=due)
    assert failed == ["tls.crt"]
    assert load_pki(d) == before
    assert hidden(d) == left  # nothing half-written left behind
    renewed, changed = ensure_pki(d, NAMES, now=due)
    assert changed and renewed.ca == before.ca and renewed.serving != before.serving
    assert issued_by(renewed.serving, before.ca) and not needs_rotation(renewed.serving, now=due)
    assert load_pki(d) == renewed


def test_a_swap_that_fails_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one rename that replaces the whole set fails: the old set is still served
    and nothing is left behind."""
    d = tmp_path / "pki"
    before, _ = ensure_pki(d, NAMES, now=T0)
    left = hidden(d)
    failed = fail_once(monkeypatch, "..data")
    with pytest.raises(OSError, match="No space left"):
        ensure_pki(d, NAMES, now=T0 + dt.timedelta(days=2500))  # a CA rotation
    assert failed == ["..data"]
    assert load_pki(d) == before
    assert hidden(d) == left


def test_a_renewal_from_the_charts_ca_that_fails_halfway_leaves_the_old_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_dir, cert_dir = tmp_path / "secret", tmp_path / "serving"
    ca = generate_ca(now=T0)
    chart_secret(ca_dir, ca, 0)
    first, _ = ensure_serving_from_ca(ca_dir, cert_dir, NAMES, now=T0)
    failed = fail_once(monkeypatch, "tls.crt")
    with pytest.raises(OSError, match="No space left"):
        ensure_serving_from_ca(ca_dir, cert_dir, NAMES, now=T0 + dt.timedelta(days=250))
    assert failed == ["tls.crt"]
    assert (cert_dir / "tls.crt").read_bytes() == first.cert_pem
    assert (cert_dir / "tls.key").read_bytes() == first.key_pem


def test_after_every_rename_a_reader_finds_a_whole_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked after each rename in the directory, from an earlier release's plain files
    (turned into links first) through a renewal and a CA rotation: tls.crt and tls.key
    belong together and the whole set loads, so a server reloading at any moment, or a
    container killed at any moment, finds the old set or the new one."""
    d = tmp_path / "pki"
    first = reconcile_pki(None, NAMES, now=T0)
    plain_files(d, first.files())
    real = os.replace
    loaded: list[WebhookPki] = []

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        real(src, dst, **kwargs)
        if Path(dst).parent == d:
            CertKeyPair((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes()).check("x")
            pki = load_pki(d)
            assert pki is not None
            loaded.append(pki)

    monkeypatch.setattr(os, "replace", replace)
    renewed, _ = ensure_pki(d, NAMES, now=T0 + dt.timedelta(days=300))
    rotated, _ = ensure_pki(d, NAMES, now=T0 + dt.timedelta(days=2500))
    assert loaded[-1] == rotated
    assert {p.serving for p in loaded} == {first.serving, renewed.serving, rotated.serving}


def test_a_write_clears_what_a_stopped_one_left(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    ensure_pki(d, NAMES, now=T0)
    (d / "..pki-stopped").mkdir()
    (d / "..pki-stopped" / "tls.key").write_bytes(b"half")
    (d / ".tls.crt.0123.link").symlink_to("..data/tls.crt")
    ensure_pki(d, NAMES, now=T0 + dt.timedelta(days=300))
    assert hidden(d) == ["..data", (d / "..data").readlink().name]


def test_a_serving_pair_torn_by_an_earlier_release_is_issued_again(tmp_path: Path) -> None:
    """An earlier release's renewal stopped between tls.key and tls.crt: the pair is
    dropped and issued again from the CA, which stays, so the bundle does not change.
    Refused, it stopped every later renewal and made every restart fail."""
    d = tmp_path / "pki"
    pki = reconcile_pki(None, NAMES, now=T0)
    stranger = generate_serving_cert(pki.ca, NAMES, now=T0)
    plain_files(d, {**pki.files(), "tls.key": stranger.key_pem})
    later = T0 + dt.timedelta(days=1)
    repaired, changed = ensure_pki(d, NAMES, now=later)
    assert changed and repaired.ca == pki.ca and repaired.ca_bundle == pki.ca_bundle
    assert repaired.serving not in (pki.serving, stranger)
    assert issued_by(repaired.serving, pki.ca)
    assert load_pki(d) == repaired
    assert (d / "tls.crt").is_symlink() and (d / "tls.key").is_symlink()  # the new layout
    assert ensure_pki(d, NAMES, now=later) == (repaired, False)


def test_a_ca_rotation_torn_between_key_and_certificate_is_made_again(tmp_path: Path) -> None:
    """An earlier release wrote ca.key before ca.crt during a CA rotation; stopped
    between them, it left the new CA's key beside the old CA's certificate, with the old
    CA as the previous one. The old CA is recovered (ca-previous.key is its key), the
    rotation is made again, and the new CA signs only once its bundle is published."""
    d = tmp_path / "pki"
    t1 = T0 + dt.timedelta(days=2500)
    ca = generate_ca(now=T0)
    pki = WebhookPki(ca=ca, serving=generate_serving_cert(ca, NAMES, now=t1))
    lost = reconcile_pki(pki, NAMES, now=t1)  # the rotation being written
    assert lost.previous_ca == ca and lost.serving == pki.serving
    plain_files(
        d,
        {
            **pki.files(),
            "ca-bundle.crt": lost.ca_bundle,
            "ca-previous.crt": ca.cert_pem,
            "ca-previous.key": ca.key_pem,
            "ca.key": lost.ca.key_pem,
        },
    )
    published: dict[bytes, dt.datetime] = {}
    repaired, changed = ensure_pki(d, NAMES, now=t1, ca_published=published.get)
    assert changed and repaired.previous_ca == ca
    assert repaired.ca not in (ca, lost.ca)
    assert repaired.serving == pki.serving  # the bundle in place trusts it
    assert load_pki(d) == repaired
    published[repaired.ca_bundle] = t1
    done, changed = ensure_pki(d, NAMES, now=t1 + CA_PROPAGATION, ca_published=published.get)
    assert changed and done.ca == repaired.ca and issued_by(done.serving, repaired.ca)


def test_a_ca_whose_key_is_lost_stays_trusted_and_signs_nothing(tmp_path: Path) -> None:
    """ca.key damaged, and no other CA: a new CA is made, the old certificate stays in
    the bundle without a key so the serving certificate it signed is still trusted and
    served, and the new CA signs once its bundle has propagated. Neither a failed start
    nor a certificate from a CA the API server does not know yet."""
    d = tmp_path / "pki"
    before, _ = ensure_pki(d, NAMES, now=T0)
    (d / "ca.key").write_bytes(generate_ca().key_pem)
    with pytest.raises(ValueError, match=r"ca\.crt: the private key does not belong"):
        load_pki(d)
    t1 = T0 + dt.timedelta(days=1)
    published: dict[bytes, dt.datetime] = {}
    repaired, changed = ensure_pki(d, NAMES, now=t1, ca_published=published.get)
    assert changed and repaired.ca != before.ca
    assert repaired.previous_ca == CertKeyPair(before.ca.cert_pem, b"")
    assert repaired.serving == before.serving
    assert set(certificates(repaired.ca_bundle)) == set(
        certificates(before.ca.cert_pem + repaired.ca.cert_pem)
    )
    assert load_pki(d) == repaired
    assert (d / "ca-previous.crt").exists() and not (d / "ca-previous.key").exists()
    # A restart (no publication callback) within the propagation time changes nothing.
    assert ensure_pki(d, NAMES, now=t1) == (repaired, False)
    published[repaired.ca_bundle] = t1
    done, changed = ensure_pki(d, NAMES, now=t1 + CA_PROPAGATION, ca_published=published.get)
    assert changed and issued_by(done.serving, repaired.ca)
    assert done.previous_ca == repaired.previous_ca  # kept until it expires, like any


def test_an_expired_serving_cert_from_a_ca_without_its_key_is_replaced() -> None:
    """What a CA without its key signed is kept only while it is valid: past its end the
    new CA signs, published or not, as nothing else could be served."""
    old = generate_ca(now=T0)
    expired = generate_serving_cert(old, NAMES, now=T0, validity=dt.timedelta(days=1))
    new = generate_ca(now=T0 + dt.timedelta(days=2))
    pki = WebhookPki(ca=new, serving=expired, previous_ca=CertKeyPair(old.cert_pem, b""))
    now = T0 + dt.timedelta(days=2)
    fixed = reconcile_pki(pki, NAMES, now=now, ca_published=lambda _: None)
    assert issued_by(fixed.serving, new) and not needs_rotation(fixed.serving, now=now)


def test_write_atomic_replaces_without_leftovers(tmp_path: Path) -> None:
    target = tmp_path / "f"
    write_atomic(target, b"one")
    write_atomic(target, b"two", mode=0o640)
    assert target.read_bytes() == b"two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing-dir" / "f", b"x")


# -- --cert-source=files: a cert-manager Secret mounted as a volume --------------------


def write_secret_volume(directory: Path, files: dict[str, bytes], generation: int) -> None:
    """Update `directory` the way the kubelet updates a Secret volume: the files go in a
    fresh hidden directory and the ``..data`` symlink is swapped to it atomically."""
    directory.mkdir(exist_ok=True)
    payload = directory / f"..gen_{generation}"
    payload.mkdir()
    for name, data in files.items():
        (payload / name).write_bytes(data)
    tmp_link = directory / "..data_tmp"
    tmp_link.symlink_to(payload.name)
    tmp_link.replace(directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    for old in directory.glob("..gen_*"):
        if old != payload:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()


def secret_files(ca: CertKeyPair) -> dict[str, bytes]:
    serving = generate_serving_cert(ca, NAMES)
    return {"ca.crt": ca.cert_pem, "tls.crt": serving.cert_pem, "tls.key": serving.key_pem}


def admission_request() -> bytes:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "team-a",
            "operation": "CREATE",
            "object": pod,
        },
    }
    body = json.dumps(review).encode()
    head = f"POST /mutate-pods HTTP/1.1\r\nHost: w\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Client:
    """One keep-alive HTTPS connection that trusts only `ca`."""

    def __init__(self, stream: BufferedByteStream, der: bytes) -> None:
        self.stream = stream
        self.certificate = der

    @classmethod
    async def connect(cls, port: int, ca: bytes) -> Client:
        context = ssl.create_default_context(cadata=ca.decode())
        tls = await anyio.connect_tcp(
            "127.0.0.1",
            port,
            tls=True,
            ssl_context=context,
            tls_hostname=NAMES[0],
            tls_standard_compatible=False,
        )
        der = tls.extra(TLSAttribute.peer_certificate_binary)
        assert der is not None
        return cls(BufferedByteStream(tls), der)

    async def admit(self) -> bool:
        await self.stream.send(admission_request())
        head = await self.stream.receive_until(b"\r\n\r\n", 65536)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = json.loads(await self.stream.receive_exactly(length))
        return head.startswith(b"HTTP/1.1 200") and body["response"]["allowed"] is True

    async def aclose(self) -> None:
        # The client hangs up like the API server does: no close_notify round trip.
        await anyio.aclose_forcefully(self.stream)


class KnownTemplates:
    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        return None


async def admit_on_a_new_connection(port: int, ca: bytes, failures: list[str]) -> bytes | None:
    """One admission on a fresh connection: the certificate served when it was allowed,
    else None with the failure recorded."""
    try:
        client = await Client.connect(port, ca)
        try:
            allowed = await client.admit()
        finally:
            await client.aclose()
    except (OSError, ssl.SSLError, anyio.EndOfStream) as exc:
        failures.append(repr(exc))
        return None
    if not allowed:
        failures.append("denied on a new connection")
        return None
    return client.certificate


def loopback_server(directory: Path, cert_check_interval: float) -> WebhookServer:
    """A webhook on a free loopback port serving tls.crt/tls.key from `directory`."""
    config = ServerConfig(
        cert_file=directory / "tls.crt",
        key_file=directory / "tls.key",
        host="127.0.0.1",
        port=0,
        cert_check_interval=cert_check_interval,
    )
    return WebhookServer(config, KnownTemplates())


@pytest.mark.anyio
async def test_files_source_rotation_while_requests_flow_fails_nothing(tmp_path: Path) -> None:
    ca = generate_ca()
    secret = tmp_path / "secret"
    write_secret_volume(secret, secret_files(ca), 0)
    assert check_serving_files(secret) is not None
    server = loopback_server(secret, cert_check_interval=0.01)
    ok, failures = 0, []
    seen: set[bytes] = set()
    rotations = 8

    async def keep_alive(port: int, stop: anyio.Event) -> None:
        nonlocal ok
        client = await Client.connect(port, ca.cert_pem)
        try:
            while not stop.is_set():
                if await client.admit():
                    ok += 1
                else:
                    failures.append("denied on a kept-alive connection")
        finally:
            await client.aclose()

    async def fresh_connections(port: int, stop: anyio.Event) -> None:
        nonlocal ok
        while not stop.is_set():
            certificate = await admit_on_a_new_connection(port, ca.cert_pem, failures)
            if certificate is not None:
                seen.add(certificate)
                ok += 1

    with anyio.fail_after(60):  # hang guard only
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            stop = anyio.Event()
            for _ in range(2):
                tg.start_soon(keep_alive, port, stop)
                tg.start_soon(fresh_connections, port, stop)
            for generation in range(1, rotations + 1):
                await anyio.sleep(0.1)
                write_secret_volume(secret, secret_files(ca), generation)
            await anyio.sleep(0.2)
            stop.set()
            last = x509.load_pem_x509_certificate((secret / "tls.crt").read_bytes())
            # The last files are picked up at a check to come, however late a loaded
            # machine runs it: new connections meet them within the hang guard.
            while True:
                client = await Client.connect(port, ca.cert_pem)
                try:
                    assert await client.admit()
                finally:
                    await client.aclose()
                if x509.load_der_x509_certificate(client.certificate) == last:
                    break
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

    assert failures == []
    assert ok > 0
    # New connections met the rotated certificates while requests flowed, ending on the last.
    assert len(seen) > 1
    assert x509.load_der_x509_certificate(client.certificate) == last


def test_check_serving_files_names_the_problem(tmp_path: Path) -> None:
    ca = generate_ca()
    with pytest.raises(ValueError, match=r"no tls\.crt or tls\.key: with --cert-source=files"):
        check_serving_files(tmp_path)
    files = secret_files(ca)
    write_secret_volume(tmp_path, {k: v for k, v in files.items() if k != "ca.crt"}, 0)
    assert check_serving_files(tmp_path) is None  # ca.crt is optional
    other = secret_files(generate_ca())
    write_secret_volume(tmp_path, {**files, "ca.crt": other["ca.crt"]}, 1)
    with pytest.raises(ValueError, match=r"tls\.crt is not signed by .*ca\.crt"):
        check_serving_files(tmp_path)
    write_secret_volume(tmp_path, {**files, "tls.key": other["tls.key"]}, 2)
    with pytest.raises(ValueError, match="private key does not belong"):
        check_serving_files(tmp_path)


def test_new_ca_signs_only_after_its_bundle_is_published_for_the_propagation_time() -> None:
    pki = reconcile_pki(None, NAMES, now=T0)
    t1 = T0 + dt.timedelta(days=2500)
    published: dict[bytes, dt.datetime] = {}
    step1 = reconcile_pki(pki, NAMES, now=t1, ca_published=published.get)
    assert step1.previous_ca == pki.ca and issued_by(step1.serving, pki.ca)
    # Long after the CA was made, but the bundle was never confirmed: the old CA signs.
    later = t1 + CA_PROPAGATION * 10
    assert reconcile_pki(step1, NAMES, now=later, ca_published=published.get) is step1
    published[step1.ca_bundle] = later
    too_soon = later + CA_PROPAGATION - dt.timedelta(seconds=1)
    assert reconcile_pki(step1, NAMES, now=too_soon, ca_published=published.get) is step1
    done = reconcile_pki(step1, NAMES, now=later + CA_PROPAGATION, ca_published=published.get)
    assert issued_by(done.serving, step1.ca) and done.ca == step1.ca
    assert done.serving_signed_by_ca() and not step1.serving_signed_by_ca()


# -- --cert-source=ca: the chart's CA, the serving certificate renewed by the webhook ------


def chart_secret(directory: Path, ca: CertKeyPair, generation: int) -> None:
    """The chart's Secret as mounted: it keeps the CA key since the webhook renews."""
    write_secret_volume(directory, {**secret_files(ca), "ca.key": ca.key_pem}, generation)


def test_serving_from_the_charts_ca_is_renewed_before_expiry(tmp_path: Path) -> None:
    ca_dir, cert_dir = tmp_path / "secret", tmp_path / "serving"
    ca = generate_ca(now=T0)
    chart_secret(ca_dir, ca, 0)
    first, changed = ensure_serving_from_ca(ca_dir, cert_dir, NAMES, now=T0)
    assert changed and issued_by(first, ca)
    assert (cert_dir / "tls.crt").read_bytes() == first.cert_pem
    assert stat.S_IMODE((cert_dir / "tls.key").stat().st_mode) == 0o600
    assert ensure_serving_from_ca(ca_dir, cert_dir, NAMES, now=T0 + dt.timedelta(days=200)) == (
        first,
        False,
    )
    # A third of the year left: renewed, months before it would have expired.
    renew_at = T0 + dt.timedelta(days=250)
    assert renew_at < first.not_after - dt.timedelta(days=100)
    renewed, changed = ensure_serving_from_ca(ca_dir, cert_dir, NAMES, now=renew_at)
    assert changed and renewed != first and issued_by(renewed, ca)
    assert not needs_rotation(renewed, now=renew_at)
    # The chart replaced its CA (the old one stays in its caBundle): the next check follows.
    new_ca = generate_ca(now=renew_at)
    chart_secret(ca_dir, new_ca, 1)
    followed, changed = ensure_serving_from_ca(ca_dir, cert_dir, NAMES, now=renew_at)
    assert changed and issued_by(followed, new_ca)


def test_serving_from_ca_names_a_missing_ca_key(tmp_path: Path) -> None:
    write_secret_volume(tmp_path / "secret", secret_files(generate_ca()), 0)
    with pytest.raises(ValueError, match=r"has no ca\.key: with --cert-source=ca mount"):
        ensure_serving_from_ca(tmp_path / "secret", tmp_path / "serving", NAMES)


@pytest.mark.anyio
async def test_short_lived_serving_certificates_renew_without_a_failed_request(
    tmp_path: Path,
) -> None:
    """Certificates valid for seconds, renewed by the running webhook: requests keep
    succeeding past the first certificate's expiry, on new and kept-alive connections."""
    ca = generate_ca()
    ca_dir, cert_dir = tmp_path / "secret", tmp_path / "serving"
    chart_secret(ca_dir, ca, 0)
    renewal = ServingRenewal(
        ca_dir, cert_dir, NAMES, check_interval_s=0.2, validity=dt.timedelta(seconds=3)
    )
    first, _ = renewal.renew()
    server = loopback_server(cert_dir, cert_check_interval=0.05)
    failures: list[str] = []
    seen: set[bytes] = set()
    with anyio.fail_after(60):  # hang guard only
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            await tg.start(renewal.run)
            kept = await Client.connect(port, ca.cert_pem)
            while dt.datetime.now(dt.UTC) < first.not_after + dt.timedelta(seconds=1):
                certificate = await admit_on_a_new_connection(port, ca.cert_pem, failures)
                if certificate is None:
                    continue
                seen.add(certificate)
                last = x509.load_der_x509_certificate(certificate)
                if not await kept.admit():
                    failures.append("denied on a kept-alive connection")
                await anyio.sleep(0.05)
            await kept.aclose()
            tg.cancel_scope.cancel()
    assert failures == []
    # Past the first certificate's end, a renewed one from the same CA was served.
    assert last.not_valid_after_utc > first.not_after
    last.verify_directly_issued_by(ca.certificate)
    assert len(seen) > 1
