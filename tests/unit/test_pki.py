"""Unit tests of llmgw.pki: files and modes, certificate contents, node ids, real TLS."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
import socket
import ssl
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import fsutil, netaddr, pki
from llmgw.errors import CertificateError, ConfigError, CSRError, NoAuthority, PKIError
from llmgw.pki import issue

# Umask 000, so the modes checked are the ones the code sets itself.
pytestmark = pytest.mark.usefixtures("open_umask")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    return {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns, mode(p))
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def sans(cert: x509.Certificate) -> list[x509.GeneralName]:
    return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def ekus(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


@pytest.fixture
def ca(tmp_path: Path) -> pki.Authority:
    return pki.init_ca(tmp_path / "pki")


# --------------------------------------------------------------------------- the CA


def test_init_ca_creates_private_files(tmp_path: Path) -> None:
    d = tmp_path / "a" / "pki"
    authority = pki.init_ca(d)
    assert authority.directory == d
    assert mode(d) == 0o700
    assert mode(d / pki.CA_KEY) == 0o600
    assert mode(d / pki.CA_CERT) == 0o644
    assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "ca.key"]  # no temp files left
    cert = pki.load_cert(d / pki.CA_CERT)
    assert cert == authority.cert
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert pki.cert_common_name(cert) == "llmgw cluster CA"
    assert isinstance(authority.key.curve, ec.SECP256R1)
    assert cert.signature_hash_algorithm is not None
    assert cert.signature_hash_algorithm.name == "sha256"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=3649) < lifetime < dt.timedelta(days=3651)


def test_init_ca_tightens_existing_empty_directory(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    pki.init_ca(d)
    assert mode(d) == 0o700


def test_ca_hash_is_kubeadm_format_and_independent(ca: pki.Authority) -> None:
    h = ca.ca_hash()
    assert h.startswith("sha256:")
    assert len(h) == len("sha256:") + 64
    assert all(c in "0123456789abcdef" for c in h[7:])
    cert = x509.load_pem_x509_certificate((ca.directory / "ca.crt").read_bytes())
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert h == "sha256:" + hashlib.sha256(spki).hexdigest()
    assert h == pki.fingerprint(ca.key.public_key())


def test_init_ca_refuses_to_overwrite(ca: pki.Authority) -> None:
    before = snapshot(ca.directory)
    with pytest.raises(PKIError) as info:
        pki.init_ca(ca.directory)
    assert str(info.value) == (
        f"a CA already exists in {ca.directory} (ca-hash {ca.ca_hash()}); refusing to overwrite it"
    )
    assert snapshot(ca.directory) == before


def test_init_ca_exist_ok_and_ensure_ca_load_the_same(ca: pki.Authority) -> None:
    before = snapshot(ca.directory)
    assert pki.init_ca(ca.directory, exist_ok=True).ca_hash() == ca.ca_hash()
    assert pki.ensure_ca(ca.directory).ca_hash() == ca.ca_hash()
    assert pki.load_ca(ca.directory).ca_hash() == ca.ca_hash()
    assert snapshot(ca.directory) == before


def test_ensure_ca_creates_when_missing(tmp_path: Path) -> None:
    authority = pki.ensure_ca(tmp_path / "new")
    assert (tmp_path / "new" / "ca.key").exists()
    assert pki.load_ca(tmp_path / "new").ca_hash() == authority.ca_hash()


def test_load_ca_missing_is_no_authority(tmp_path: Path) -> None:
    for d in (tmp_path / "absent", tmp_path):
        with pytest.raises(NoAuthority) as info:
            pki.load_ca(d)
        assert str(info.value) == f"no authority in {d}; run 'llmgw ctl cert init-ca' first"
        assert info.value.exit_code == 2


def test_corrupt_ca_key_is_certificate_error_and_untouched(ca: pki.Authority) -> None:
    (ca.directory / "ca.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\ngarbage\n")
    os.chmod(ca.directory / "ca.key", 0o600)
    before = snapshot(ca.directory)
    with pytest.raises(CertificateError) as info:
        pki.load_ca(ca.directory)
    assert "ca.key" in str(info.value)
    with pytest.raises(CertificateError):
        pki.ensure_ca(ca.directory)
    with pytest.raises(CertificateError):
        pki.ensure_server_identity(ca.directory, hosts=["cp.example"])
    with pytest.raises(PKIError):
        pki.init_ca(ca.directory)
    assert snapshot(ca.directory) == before


def test_mismatched_ca_key_is_certificate_error(ca: pki.Authority, tmp_path: Path) -> None:
    other = pki.init_ca(tmp_path / "other")
    (ca.directory / "ca.key").write_bytes((other.directory / "ca.key").read_bytes())
    with pytest.raises(CertificateError, match="does not belong"):
        pki.load_ca(ca.directory)


def test_half_a_ca_is_certificate_error(ca: pki.Authority) -> None:
    (ca.directory / "ca.crt").unlink()
    with pytest.raises(CertificateError, match=r"ca\.crt is missing"):
        pki.load_ca(ca.directory)
    with pytest.raises(PKIError, match="refusing to overwrite"):
        pki.init_ca(ca.directory)


def test_load_cert_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match=r"nope\.crt"):
        pki.load_cert(tmp_path / "nope.crt")
    (tmp_path / "bad.crt").write_text("not a cert")
    with pytest.raises(CertificateError, match=r"bad\.crt"):
        pki.load_cert(tmp_path / "bad.crt")


# --------------------------------------------------------------------------- leaf certificates


def test_node_cert(ca: pki.Authority, tmp_path: Path) -> None:
    out = tmp_path / "agent"
    ident = pki.issue_node_cert(ca, "gpu1.rack2", out)
    assert ident == pki.Identity(cert=out / "node.crt", key=out / "node.key", ca=out / "ca.crt")
    assert mode(out) == 0o700
    assert mode(ident.key) == 0o600
    assert mode(ident.cert) == 0o644
    assert ident.ca.read_bytes() == (ca.directory / "ca.crt").read_bytes()
    cert = pki.load_cert(ident.cert)
    assert pki.cert_common_name(cert) == "gpu1.rack2"
    assert sans(cert) == [x509.DNSName("gpu1.rack2")]
    assert ekus(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not pki.is_ca_certificate(cert) and pki.is_ca_certificate(ca.cert)
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign and not usage.crl_sign
    ca_usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_usage.key_cert_sign and ca_usage.crl_sign
    cert.verify_directly_issued_by(ca.cert)
    key = serialization.load_pem_private_key(ident.key.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    assert pki.fingerprint(key.public_key()) == pki.fingerprint(cert.public_key())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=364) < lifetime < dt.timedelta(days=366)


def test_node_cert_custom_name_and_reserved_refused(ca: pki.Authority, tmp_path: Path) -> None:
    ident = pki.issue_node_cert(ca, "gpu2", tmp_path, name="agent")
    assert ident.cert == tmp_path / "agent.crt"
    for bad in (pki.CONTROL_PLANE_CN, "Bad_Name"):
        with pytest.raises(ConfigError):
            pki.issue_node_cert(ca, bad, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError):
        pki.issue_node_cert(ca, "gpu3", ca.directory, name="ca")  # would overwrite ca.key


def test_server_cert_sans(ca: pki.Authority, tmp_path: Path) -> None:
    ident = pki.issue_server_cert(
        ca,
        tmp_path,
        hosts=["cp.example.com", "10.1.2.3", "fe80::1%eth0", "CP2", "", "[2001:db8::5]"],
    )
    cert = pki.load_cert(ident.cert)
    got = sans(cert)
    for name in (
        x509.DNSName("cp.example.com"),
        x509.DNSName("cp2"),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("10.1.2.3")),
        x509.IPAddress(ipaddress.ip_address("fe80::1")),
        x509.IPAddress(ipaddress.ip_address("2001:db8::5")),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
        x509.DNSName(netaddr.CONTROL_PLANE_NAME),
    ):
        assert name in got
    assert len(got) == len(set(got)) == 9
    assert ekus(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, pki.CONTROL_PLANE_OID}
    assert pki.cert_common_name(cert) == "llmgw control plane"
    assert mode(ident.key) == 0o600


def test_server_cert_rejects_garbage_host(ca: pki.Authority, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hosts"):
        pki.issue_server_cert(ca, tmp_path / "s", hosts=["not a host"])


def test_control_plane_client_cert(ca: pki.Authority, tmp_path: Path) -> None:
    ident = pki.issue_control_plane_client_cert(ca, tmp_path)
    assert ident.cert == tmp_path / "client.crt"
    cert = pki.load_cert(ident.cert)
    assert pki.cert_common_name(cert) == pki.CONTROL_PLANE_CN == "llmgw-control-plane"
    assert ekus(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH, pki.CONTROL_PLANE_OID}
    assert sans(cert) == [x509.DNSName(netaddr.CONTROL_PLANE_NAME)]
    assert mode(ident.key) == 0o600


def test_leaf_never_outlives_ca(tmp_path: Path) -> None:
    short = pki.init_ca(tmp_path / "short", valid_days=10)
    ident = pki.issue_node_cert(short, "gpu1", tmp_path / "n", valid_days=365)
    assert pki.load_cert(ident.cert).not_valid_after_utc <= short.cert.not_valid_after_utc


# --------------------------------------------------------------------------- ensure_server_identity


def test_ensure_server_identity_creates_everything(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    ca, server, client = pki.ensure_server_identity(d, hosts=["cp.example.com", "192.0.2.7"])
    assert mode(d) == 0o700
    for key in ("ca.key", "server.key", "client.key"):
        assert mode(d / key) == 0o600
    assert server == pki.Identity(cert=d / "server.crt", key=d / "server.key", ca=d / "trust.crt")
    assert client == pki.Identity(cert=d / "client.crt", key=d / "client.key", ca=d / "trust.crt")
    # No rotation: the trust bundle is the CA alone.
    assert (d / "trust.crt").read_bytes() == (d / "ca.crt").read_bytes()
    server_cert = pki.load_cert(server.cert)
    assert x509.DNSName("cp.example.com") in sans(server_cert)
    assert x509.IPAddress(ipaddress.ip_address("192.0.2.7")) in sans(server_cert)
    assert pki.cert_common_name(pki.load_cert(client.cert)) == pki.CONTROL_PLANE_CN
    assert ca.ca_hash() == pki.load_ca(d).ca_hash()


def test_ensure_server_identity_is_stable(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    pki.ensure_server_identity(d, hosts=["cp.example.com", "192.0.2.7"])
    before = snapshot(d)
    # a subset (in another spelling) is covered: nothing is rewritten
    pki.ensure_server_identity(d, hosts=["CP.example.com", "192.0.2.7"])
    pki.ensure_server_identity(d, hosts=[])
    assert snapshot(d) == before


def test_ensure_server_identity_reissues_on_new_host_keeps_ca(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    ca1, _, _ = pki.ensure_server_identity(d, hosts=["cp.example.com"])
    before = snapshot(d)
    ca2, server, _ = pki.ensure_server_identity(d, hosts=["cp.example.com", "198.51.100.9"])
    after = snapshot(d)
    assert ca2.ca_hash() == ca1.ca_hash()
    assert after["ca.key"] == before["ca.key"]
    assert after["ca.crt"] == before["ca.crt"]
    assert after["client.crt"] == before["client.crt"]  # client cert was still fine
    assert after["server.crt"][0] != before["server.crt"][0]
    assert after["server.key"][0] != before["server.key"][0]
    got = sans(pki.load_cert(server.cert))
    assert x509.IPAddress(ipaddress.ip_address("198.51.100.9")) in got
    pki.load_cert(server.cert).verify_directly_issued_by(ca1.cert)


def test_ensure_server_identity_reissues_foreign_and_expiring(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    ca, _, _ = pki.ensure_server_identity(d, hosts=["cp"])
    other = pki.init_ca(tmp_path / "other")
    pki.issue_server_cert(other, d / "tmp", hosts=["cp"])  # a server cert from another CA
    os.replace(d / "tmp" / "server.crt", d / "server.crt")
    os.replace(d / "tmp" / "server.key", d / "server.key")
    pki.issue_control_plane_client_cert(ca, d, valid_days=20)  # expires within 30 days
    old_client = (d / "client.crt").read_bytes()
    _, server, client = pki.ensure_server_identity(d, hosts=["cp"])
    pki.load_cert(server.cert).verify_directly_issued_by(ca.cert)
    assert (d / "client.crt").read_bytes() != old_client
    remaining = pki.load_cert(client.cert).not_valid_after_utc - dt.datetime.now(dt.UTC)
    assert remaining > dt.timedelta(days=300)


def test_ensure_server_identity_reissues_missing_and_tightens_modes(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    pki.ensure_server_identity(d, hosts=["cp"])
    (d / "server.key").unlink()
    os.chmod(d / "client.key", 0o644)
    os.chmod(d, 0o755)
    pki.ensure_server_identity(d, hosts=["cp"])
    assert (d / "server.key").exists()
    assert mode(d / "server.key") == 0o600
    assert mode(d / "client.key") == 0o600
    assert mode(d) == 0o700


def test_ensure_server_identity_on_a_ca_alone_makes_this_instance_s_certificates(
    tmp_path: Path,
) -> None:
    """A directory holding only ca.crt and ca.key (a CA imported from another instance):
    the CA is kept as it is, and this instance's own certificates are issued from it."""
    first = tmp_path / "first"
    pki.ensure_server_identity(first, hosts=["cp-1.example"])
    d = tmp_path / "second"
    d.mkdir(mode=0o700)
    for name in ("ca.crt", "ca.key"):
        (d / name).write_bytes((first / name).read_bytes())
    os.chmod(d / "ca.key", 0o600)
    ca, server, client = pki.ensure_server_identity(d, hosts=["cp-2.example"])
    assert ca.ca_hash() == pki.load_ca(first).ca_hash()
    assert (d / "ca.key").read_bytes() == (first / "ca.key").read_bytes()
    assert (d / "trust.crt").read_bytes() == (d / "ca.crt").read_bytes()
    for mine, theirs in ((server.cert, first / "server.crt"), (client.cert, first / "client.crt")):
        cert = pki.load_cert(mine)
        cert.verify_directly_issued_by(ca.cert)
        assert pki.control_plane_problem(cert) is None
        assert cert.public_key() != pki.load_cert(theirs).public_key()
    assert x509.DNSName("cp-2.example") in sans(pki.load_cert(server.cert))
    assert x509.DNSName("cp-1.example") not in sans(pki.load_cert(server.cert))
    assert mode(d / "server.key") == mode(d / "client.key") == 0o600


# --------------------------------------------------------------------------- real TLS


def _server_ctx(ident: pki.Identity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ident.cert, ident.key)
    ctx.load_verify_locations(ident.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


def _client_ctx(ident: pki.Identity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(ident.cert, ident.key)
    ctx.load_verify_locations(ident.ca)
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


def _peer_cn(tls: ssl.SSLSocket) -> str:
    peer: Any = tls.getpeercert()
    for rdn in peer["subject"]:
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    raise AssertionError(f"peer certificate has no commonName: {peer}")


def _handshake(
    server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str
) -> tuple[BaseException | str | None, BaseException | str | None]:
    """One TLS connection over loopback TCP; returns (server result, client result): the peer's
    CN on success, else the exception."""
    results: dict[str, BaseException | str | None] = {"server": None, "client": None}
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server.wrap_socket(conn, server_side=True) as tls:
                results["server"] = _peer_cn(tls)
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:
            results["server"] = e
        finally:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client.wrap_socket(raw, server_hostname=server_hostname) as tls:
                data = tls.recv(2)  # with TLS 1.3 a rejected client cert shows up here
                if data != b"ok":
                    raise ConnectionError("server closed the connection")
                results["client"] = _peer_cn(tls)
    except (ssl.SSLError, OSError) as e:
        results["client"] = e
    finally:
        thread.join(10)
        listener.close()
    return results["server"], results["client"]


def test_tls_gateway_to_agent_data_plane(ca: pki.Authority, tmp_path: Path) -> None:
    node = pki.issue_node_cert(ca, "gpu1", tmp_path / "agent")
    cp_client = pki.issue_control_plane_client_cert(ca, tmp_path / "cp")
    server_res, client_res = _handshake(_server_ctx(node), _client_ctx(cp_client), "gpu1")
    assert server_res == pki.CONTROL_PLANE_CN
    assert client_res == "gpu1"


def test_tls_agent_to_control_plane(tmp_path: Path) -> None:
    ca, server, _ = pki.ensure_server_identity(tmp_path / "cp", hosts=["cp.example.com"])
    node = pki.issue_node_cert(ca, "gpu1", tmp_path / "agent")
    server_res, client_res = _handshake(_server_ctx(server), _client_ctx(node), "127.0.0.1")
    assert server_res == "gpu1"
    assert client_res == "llmgw control plane"


def test_tls_node_cert_for_another_name_fails(ca: pki.Authority, tmp_path: Path) -> None:
    node = pki.issue_node_cert(ca, "gpu1", tmp_path / "agent")
    cp_client = pki.issue_control_plane_client_cert(ca, tmp_path / "cp")
    _, client_res = _handshake(_server_ctx(node), _client_ctx(cp_client), "gpu2")
    assert isinstance(client_res, ssl.SSLCertVerificationError)


def test_tls_client_from_another_ca_fails(ca: pki.Authority, tmp_path: Path) -> None:
    node = pki.issue_node_cert(ca, "gpu1", tmp_path / "agent")
    rogue_ca = pki.init_ca(tmp_path / "rogue")
    rogue = pki.issue_control_plane_client_cert(rogue_ca, tmp_path / "rogue-client")
    # the rogue client trusts the real CA, so only its own certificate is at fault
    rogue_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    rogue_ctx.load_cert_chain(rogue.cert, rogue.key)
    rogue_ctx.load_verify_locations(node.ca)
    server_res, client_res = _handshake(_server_ctx(node), rogue_ctx, "gpu1")
    assert isinstance(server_res, ssl.SSLError)
    assert isinstance(client_res, (ssl.SSLError, OSError))


def test_tls_server_from_another_ca_fails(ca: pki.Authority, tmp_path: Path) -> None:
    rogue_ca = pki.init_ca(tmp_path / "rogue")
    rogue_node = pki.issue_node_cert(rogue_ca, "gpu1", tmp_path / "rogue-agent")
    cp_client = pki.issue_control_plane_client_cert(ca, tmp_path / "cp")
    _, client_res = _handshake(_server_ctx(rogue_node), _client_ctx(cp_client), "gpu1")
    assert isinstance(client_res, ssl.SSLCertVerificationError)


# --------------------------------------------------------------------------- certificate requests


def _pem(csr: x509.CertificateSigningRequest) -> bytes:
    return csr.public_bytes(serialization.Encoding.PEM)


def _csr_error(csr: x509.CertificateSigningRequest, node_id: str = "gpu-1") -> CSRError:
    with pytest.raises(CSRError) as info:
        pki.check_csr(csr, node_id)
    assert info.value.status == 400
    return info.value


def test_make_csr_and_load_roundtrip() -> None:
    key = pki.new_private_key()
    assert isinstance(key.curve, ec.SECP256R1)
    csr = pki.make_csr(key, "gpu-1")
    loaded = pki.load_csr(_pem(csr))
    assert loaded == pki.load_csr(_pem(csr).decode())
    assert loaded.is_signature_valid
    assert pki.fingerprint(loaded.public_key()) == pki.fingerprint(key.public_key())
    pki.check_csr(loaded, "gpu-1")
    with pytest.raises(ConfigError, match="invalid node id"):
        pki.make_csr(key, "Not A Node")


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        "not a csr",
        b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        "\ud800",
        b"\xff\xfe garbage",
    ],
)
def test_load_csr_malformed(pem: bytes | str) -> None:
    with pytest.raises(CSRError) as info:
        pki.load_csr(pem)
    assert info.value.code == "csr_malformed"
    assert "not a PEM CSR" in str(info.value) and "llmgw agent join" in str(info.value)


def test_load_csr_refuses_a_certificate(ca: pki.Authority) -> None:
    with pytest.raises(CSRError) as info:
        pki.load_csr(ca.cert.public_bytes(serialization.Encoding.PEM))
    assert info.value.code == "csr_malformed"


def test_check_csr_cn_mismatch() -> None:
    err = _csr_error(pki.make_csr(pki.new_private_key(), "gpu-2"), "gpu-1")
    assert err.code == "csr_cn_mismatch"
    assert "common name 'gpu-2'" in str(err) and "joining as node gpu-1" in str(err)
    assert "--node-id gpu-1" in str(err)


def test_check_csr_without_cn() -> None:
    key = pki.new_private_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "acme")]))
        .sign(key, hashes.SHA256())
    )
    err = _csr_error(csr)
    assert err.code == "csr_cn_mismatch"
    assert "has no common name" in str(err)


def test_check_csr_bad_signature() -> None:
    csr = pki.make_csr(pki.new_private_key(), "gpu-1")
    der = csr.public_bytes(serialization.Encoding.DER)
    assert der.count(b"gpu-1") == 2  # CN and SAN, both under the signature
    tampered = x509.load_der_x509_csr(der.replace(b"gpu-1", b"gpu-2"))
    pem = tampered.public_bytes(serialization.Encoding.PEM)
    err = _csr_error(pki.load_csr(pem), "gpu-2")
    assert err.code == "csr_bad_signature"
    assert "signature does not match its key" in str(err)


def test_check_csr_weak_rsa() -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    err = _csr_error(pki.make_csr(key, "gpu-1"))
    assert err.code == "csr_weak_key"
    assert "RSA of 1024 bits, too weak" in str(err)
    assert "2048 bits or more" in str(err)


def test_check_csr_accepts_rsa_2048_and_big_curves() -> None:
    pki.check_csr(
        pki.make_csr(rsa.generate_private_key(public_exponent=65537, key_size=2048), "gpu-1"),
        "gpu-1",
    )
    for curve in (ec.SECP384R1(), ec.SECP521R1()):
        pki.check_csr(pki.make_csr(ec.generate_private_key(curve), "gpu-1"), "gpu-1")


def test_check_csr_refuses_ed25519() -> None:
    err = _csr_error(pki.make_csr(ed25519.Ed25519PrivateKey.generate(), "gpu-1"))
    assert err.code == "csr_weak_key"
    assert "key is Ed25519, which llmgw does not issue certificates for" in str(err)
    assert "ECDSA on P-256, P-384 or P-521" in str(err)


@pytest.mark.parametrize("curve", [ec.SECP224R1(), ec.SECP256K1()])
def test_check_csr_refuses_other_curves(curve: ec.EllipticCurve) -> None:
    err = _csr_error(pki.make_csr(ec.generate_private_key(curve), "gpu-1"))
    assert err.code == "csr_weak_key"
    assert f"ECDSA on {curve.name} ({curve.key_size} bits)" in str(err)


def _extensions(cert: x509.Certificate) -> dict[x509.ObjectIdentifier, tuple[bool, object]]:
    skip = {x509.SubjectKeyIdentifier.oid}  # derived from the key, which differs
    return {e.oid: (e.critical, e.value) for e in cert.extensions if e.oid not in skip}


def test_sign_csr_is_a_node_certificate(ca: pki.Authority, tmp_path: Path) -> None:
    key = pki.new_private_key()
    cert = pki.sign_csr(ca, pki.make_csr(key, "gpu-1"), node_id="gpu-1", lifetime=3600)
    cert.verify_directly_issued_by(ca.cert)
    assert pki.cert_common_name(cert) == "gpu-1"
    assert cert.subject == x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "gpu-1")])
    assert sans(cert) == [x509.DNSName("gpu-1")]
    assert ekus(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert pki.fingerprint(cert.public_key()) == pki.fingerprint(key.public_key())
    ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    reference = pki.load_cert(pki.issue_node_cert(ca, "gpu-1", tmp_path / "ref").cert)
    assert _extensions(cert) == _extensions(reference)
    assert [e.oid for e in cert.extensions] == [e.oid for e in reference.extensions]
    assert cert.issuer == reference.issuer
    assert cert.signature_hash_algorithm is not None
    assert cert.signature_hash_algorithm.name == "sha256"
    # valid from 5 minutes back (clock skew) for the lifetime asked, from now
    now = dt.datetime.now(dt.UTC)
    skew = cert.not_valid_before_utc - (now - dt.timedelta(minutes=5))
    assert abs(skew) < dt.timedelta(seconds=5)
    assert abs((cert.not_valid_after_utc - now) - dt.timedelta(hours=1)) < dt.timedelta(seconds=5)
    assert pki.serial_hex(cert) == format(cert.serial_number, "x")
    assert pki.serial_hex(cert) == pki.serial_hex(cert).lower()
    assert int(pki.serial_hex(cert), 16) == cert.serial_number


def test_sign_csr_never_outlives_the_ca(tmp_path: Path) -> None:
    short = pki.init_ca(tmp_path / "short", valid_days=2)
    csr = pki.make_csr(pki.new_private_key(), "gpu-1")
    cert = pki.sign_csr(short, csr, node_id="gpu-1", lifetime=365 * 86400.0)
    assert cert.not_valid_after_utc == short.cert.not_valid_after_utc


def test_sign_csr_refuses(ca: pki.Authority) -> None:
    other = pki.make_csr(pki.new_private_key(), "gpu-2")
    with pytest.raises(CSRError) as info:
        pki.sign_csr(ca, other, node_id="gpu-1", lifetime=60)
    assert info.value.code == "csr_cn_mismatch"
    good = pki.make_csr(pki.new_private_key(), "gpu-1")
    for lifetime in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="cert_lifetime"):
            pki.sign_csr(ca, good, node_id="gpu-1", lifetime=lifetime)
    with pytest.raises(ConfigError, match="invalid node id"):
        pki.sign_csr(ca, good, node_id="llmgw-x", lifetime=60)


def test_tls_with_a_certificate_from_a_csr(tmp_path: Path) -> None:
    """The key never leaves the node: it signs a CSR, the CA signs it, and TLS works."""
    ca, server, _ = pki.ensure_server_identity(tmp_path / "cp", hosts=["cp.example.com"])
    key = pki.new_private_key()
    cert = pki.sign_csr(ca, pki.make_csr(key, "gpu1"), node_id="gpu1", lifetime=600)
    out = tmp_path / "agent"
    out.mkdir()
    node = pki.Identity(cert=out / "node.crt", key=out / "node.key", ca=server.ca)
    fsutil.write_private(
        node.key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    node.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    server_res, client_res = _handshake(_server_ctx(server), _client_ctx(node), "127.0.0.1")
    assert server_res == "gpu1"
    assert client_res == "llmgw control plane"


def test_csr_with_an_invalid_version_is_malformed_not_a_crash() -> None:
    """Found by the enrolment fuzz: cryptography raises its own InvalidVersion for this."""
    import base64

    from cryptography.hazmat.primitives import serialization

    from llmgw.errors import CSRError

    der = pki.make_csr(pki.new_private_key(), "node-v").public_bytes(serialization.Encoding.DER)
    at = der.index(b"\x02\x01\x00")  # CertificationRequestInfo.version = 0 (v1)
    bad = der[:at] + b"\x02\x01\x01" + der[at + 3 :]
    pem = (
        b"-----BEGIN CERTIFICATE REQUEST-----\n"
        + base64.encodebytes(bad)
        + b"-----END CERTIFICATE REQUEST-----\n"
    )
    with pytest.raises(CSRError) as info:
        pki.load_csr(pem)
    assert info.value.code == "csr_malformed"


# --------------------------------------------------------------------------- the control plane's identity


def _old_control_plane_identity(ca: pki.Authority, d: Path) -> None:
    """server.crt and client.crt as versions before the control-plane OID issued them: the same
    names and usages, neither the OID nor the reserved SAN."""
    hosts = [x509.DNSName("cp"), x509.DNSName("localhost")]
    for name, cn, sans_, usage in (
        ("server", "llmgw control plane", hosts, ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", pki.CONTROL_PLANE_CN, [], ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = pki.new_private_key()
        cert = issue._leaf(
            ca,
            key.public_key(),
            common_name=cn,
            sans=sans_,
            usages=[usage],
            lifetime=dt.timedelta(days=365),
        )
        issue._write_identity(ca, d, name, key, cert)


def test_control_plane_certificates_carry_the_oid_and_node_certificates_never(
    tmp_path: Path,
) -> None:
    ca, server, client = pki.ensure_server_identity(tmp_path / "cp", hosts=["cp.example.com"])
    for ident in (server, client):
        cert = pki.load_cert(ident.cert)
        assert pki.CONTROL_PLANE_OID in ekus(cert)
        assert x509.DNSName(netaddr.CONTROL_PLANE_NAME) in sans(cert)
        assert pki.control_plane_problem(cert) is None
        assert pki.control_plane_problem(cert.public_bytes(serialization.Encoding.DER)) is None
    # A node named like the control plane's host, issued directly by the CA, as an attacker who
    # holds such a certificate would have it: no OID, no reserved name.
    node = pki.load_cert(pki.issue_node_cert(ca, "cp.example.com", tmp_path / "n").cert)
    assert pki.CONTROL_PLANE_OID not in ekus(node)
    assert sans(node) == [x509.DNSName("cp.example.com")]
    problem = pki.control_plane_problem(node)
    assert problem is not None
    assert "CN=cp.example.com" in problem and pki.serial_hex(node) in problem
    assert pki.CONTROL_PLANE_OID.dotted_string in problem
    csr = pki.make_csr(pki.new_private_key(), "gpu-1")
    signed = pki.sign_csr(ca, csr, node_id="gpu-1", lifetime=600)
    assert pki.CONTROL_PLANE_OID not in ekus(signed)
    assert pki.control_plane_problem(None) == "it presented no certificate"
    assert pki.control_plane_problem(b"garbage").startswith("its certificate cannot be read")


def test_the_oid_is_under_the_uuid_arc() -> None:
    """2.25.<uuid as an integer> (ITU-T X.667): nobody else will ever assign it."""
    import uuid

    arc, _, number = pki.CONTROL_PLANE_OID.dotted_string.partition("2.25.")
    assert arc == "" and number.isdigit()
    assert str(uuid.UUID(int=int(number))) == "0ffb3298-e281-4223-b680-f5913b09eb6d"


def test_ensure_server_identity_reissues_certificates_without_the_oid(tmp_path: Path) -> None:
    """An existing cluster upgrades on the control plane's next start; the CA stays."""
    d = tmp_path / "cp"
    ca = pki.init_ca(d)
    _old_control_plane_identity(ca, d)
    before = snapshot(d)
    ca2, server, client = pki.ensure_server_identity(d, hosts=["cp"])
    assert ca2.ca_hash() == ca.ca_hash()
    after = snapshot(d)
    assert after["ca.crt"] == before["ca.crt"] and after["ca.key"] == before["ca.key"]
    for name in ("server.crt", "server.key", "client.crt", "client.key"):
        assert after[name][0] != before[name][0], name
    for ident in (server, client):
        cert = pki.load_cert(ident.cert)
        assert pki.control_plane_problem(cert) is None
        assert x509.DNSName(netaddr.CONTROL_PLANE_NAME) in sans(cert)
        cert.verify_directly_issued_by(ca.cert)
    assert x509.DNSName("cp") in sans(pki.load_cert(server.cert))
    # and once marked, a restart keeps them
    pki.ensure_server_identity(d, hosts=["cp"])
    assert snapshot(d) == after


def test_a_server_certificate_with_the_oid_but_not_the_name_is_reissued(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    ca = pki.init_ca(d)
    key = pki.new_private_key()
    cert = issue._leaf(
        ca,
        key.public_key(),
        common_name="llmgw control plane",
        sans=[x509.DNSName("cp")],
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, pki.CONTROL_PLANE_OID],
        lifetime=dt.timedelta(days=365),
    )
    issue._write_identity(ca, d, "server", key, cert)
    _, server, _ = pki.ensure_server_identity(d, hosts=["cp"])
    assert x509.DNSName(netaddr.CONTROL_PLANE_NAME) in sans(pki.load_cert(server.cert))


def test_node_ids_the_control_plane_answers_to_are_refused(tmp_path: Path) -> None:
    _, server, _ = pki.ensure_server_identity(
        tmp_path / "cp", hosts=["cp-host", "cp-host.example.com", "10.0.0.5"]
    )
    names = pki.control_plane_names(pki.load_cert(server.cert))
    assert {"cp-host", "cp-host.example.com", "10.0.0.5", netaddr.CONTROL_PLANE_NAME} <= names
    for taken in ("cp-host", "cp-host.example.com"):
        with pytest.raises(ConfigError) as info:
            netaddr.check_node_id_free(taken, names)
        message = str(info.value)
        assert message.startswith(f"node_id: invalid node id {taken!r}: the control plane ")
        assert "could pose as the control plane" in message
        assert "'llmgw ctl join-command --node OTHER-ID'" in message
        assert info.value.exit_code == 2
    assert netaddr.check_node_id_free("gpu-1", names) == "gpu-1"
    assert netaddr.check_node_id_free("cp-host.rack2", names) == "cp-host.rack2"
    with pytest.raises(ConfigError, match="invalid node id"):
        netaddr.check_node_id_free("Bad_Name", names)


def _csr_with(
    node_id: str, *, usages: list[x509.ObjectIdentifier] | None, dns: list[str]
) -> x509.CertificateSigningRequest:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    )
    builder = builder.add_extension(
        x509.SubjectAlternativeName([x509.DNSName(n) for n in dns]), critical=False
    )
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(pki.new_private_key(), hashes.SHA256())


def test_check_csr_refuses_the_control_plane_usage(ca: pki.Authority) -> None:
    csr = _csr_with(
        "gpu-1",
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, pki.CONTROL_PLANE_OID],
        dns=["gpu-1"],
    )
    error = _csr_error(csr)
    assert error.code == "csr_forbidden_usage"
    assert pki.CONTROL_PLANE_OID.dotted_string in error.message
    with pytest.raises(CSRError, match="no node may hold"):
        pki.sign_csr(ca, csr, node_id="gpu-1", lifetime=60)
    # asking for ordinary usages is harmless (and ignored: the certificate is built here)
    plain = _csr_with("gpu-1", usages=[ExtendedKeyUsageOID.CLIENT_AUTH], dns=["gpu-1"])
    pki.check_csr(plain, "gpu-1")


@pytest.mark.parametrize("name", [netaddr.CONTROL_PLANE_NAME, "LLMGW-Control-Plane.", "llmgw-x"])
def test_check_csr_refuses_a_reserved_name(ca: pki.Authority, name: str) -> None:
    csr = _csr_with("gpu-1", usages=None, dns=["gpu-1", name])
    error = _csr_error(csr)
    assert error.code == "csr_reserved_name"
    assert repr(name) in error.message and "reserved for the control plane" in error.message
    with pytest.raises(CSRError):
        pki.sign_csr(ca, csr, node_id="gpu-1", lifetime=60)


def test_tls_a_node_named_like_the_control_plane_is_no_control_plane(tmp_path: Path) -> None:
    """What the agent's stream checks: the TLS name CONTROL_PLANE_NAME, whatever address it
    dialled. The control plane's certificate passes; a node's for the dialled host fails."""
    ca, server, _ = pki.ensure_server_identity(tmp_path / "cp", hosts=["cp.example.com"])
    agent = pki.issue_node_cert(ca, "gpu1", tmp_path / "agent")
    impostor = pki.issue_node_cert(ca, "cp.example.com", tmp_path / "impostor")
    _, client_res = _handshake(_server_ctx(server), _client_ctx(agent), netaddr.CONTROL_PLANE_NAME)
    assert client_res == "llmgw control plane"
    # by the host name alone (what the stream checked before) the impostor passed
    _, client_res = _handshake(_server_ctx(impostor), _client_ctx(agent), "cp.example.com")
    assert client_res == "cp.example.com"
    _, client_res = _handshake(
        _server_ctx(impostor), _client_ctx(agent), netaddr.CONTROL_PLANE_NAME
    )
    assert isinstance(client_res, ssl.SSLCertVerificationError)


# --------------------------------------------------------------------------- CA rotation


def _rotated(tmp_path: Path, overlap: float = 3600) -> tuple[pki.Authority, pki.Identity, Path]:
    """A control plane's PKI directory before and after a rotation: the old CA, a node
    certificate it issued, and the directory (rotated, leaves reissued)."""
    d = tmp_path / "cp"
    old, _, _ = pki.ensure_server_identity(d, hosts=["cp.example.com"])
    node = pki.issue_node_cert(old, "gpu1", tmp_path / "old-node")
    pki.rotate_ca(d, overlap=overlap)
    pki.ensure_server_identity(d, hosts=["cp.example.com"])
    return old, node, d


def test_rotate_ca_keeps_the_subject_and_cross_signs(tmp_path: Path) -> None:
    old, _, d = _rotated(tmp_path)
    new = pki.load_ca(d)
    assert new.ca_hash() != old.ca_hash()
    assert new.cert.subject == old.cert.subject  # self-issued: no path length is spent
    cross = pki.load_cert(d / pki.CROSS_CERT)
    assert pki.fingerprint(cross.public_key()) == new.ca_hash()
    assert pki.issued_by(cross, old.cert)
    assert not pki.issued_by(cross, new.cert)
    assert pki.is_ca_certificate(cross)
    rotation = pki.read_rotation(d)
    assert rotation is not None and rotation.active
    assert (rotation.previous, rotation.current) == (old.ca_hash(), new.ca_hash())
    assert 3600 <= rotation.drop_at - rotation.started < 3601
    # The cross-certificate ends with the overlap.
    assert abs(cross.not_valid_after_utc.timestamp() - rotation.drop_at) < 2
    assert [c.fingerprint(hashes.SHA256()) for c in pki.load_bundle(d / pki.TRUST_BUNDLE)] == [
        new.cert.fingerprint(hashes.SHA256()),
        old.cert.fingerprint(hashes.SHA256()),
    ]
    assert mode(d / pki.PREVIOUS_CA_KEY) == 0o600


def test_rotation_moves_the_control_plane_certificates(tmp_path: Path) -> None:
    _, _, d = _rotated(tmp_path)
    new = pki.load_ca(d)
    cross = pki.load_cert(d / pki.CROSS_CERT)
    for name in ("server.crt", "client.crt"):
        chain = pki.load_bundle(d / name)
        assert len(chain) == 2  # the leaf, then the cross-certificate
        assert pki.issued_by(chain[0], new.cert)
        assert chain[1] == cross


def test_chains_verify_under_the_old_root_and_the_new(tmp_path: Path) -> None:
    """An agent that trusts only the old CA, one with the new bundle, and one with only the
    new CA all accept the rotated control plane; the control plane accepts a node
    certificate of the old CA during the overlap and one of the new CA."""
    old, old_node, d = _rotated(tmp_path)
    server = pki.Identity(cert=d / "server.crt", key=d / "server.key", ca=d / pki.TRUST_BUNDLE)
    new_node = pki.issue_node_cert(pki.load_ca(d), "gpu1", tmp_path / "new-node")
    (tmp_path / "old.crt").write_bytes(pki.cert_pem(old.cert))
    for trust in (tmp_path / "old.crt", d / "ca.crt", d / pki.TRUST_BUNDLE):
        for node in (old_node, new_node):
            agent = pki.Identity(cert=node.cert, key=node.key, ca=trust)
            server_res, client_res = _handshake(
                _server_ctx(server), _client_ctx(agent), "cp.example.com"
            )
            assert (server_res, client_res) == ("gpu1", "llmgw control plane"), (trust, node)


def test_finish_rotation_drops_the_old_ca(tmp_path: Path) -> None:
    _, old_node, d = _rotated(tmp_path)
    done = pki.finish_rotation(d)
    assert not done.active and done.dropped is not None
    for name in (pki.PREVIOUS_CA_CERT, pki.PREVIOUS_CA_KEY, pki.CROSS_CERT):
        assert not (d / name).exists()
    assert pki.load_bundle(d / pki.TRUST_BUNDLE) == [pki.load_ca(d).cert]
    _, server, _ = pki.ensure_server_identity(d, hosts=["cp.example.com"])
    assert len(pki.load_bundle(server.cert)) == 1  # the cross-certificate is gone
    # A node certificate of the old CA no longer passes.
    server_res, _ = _handshake(_server_ctx(server), _client_ctx(old_node), "cp.example.com")
    assert isinstance(server_res, ssl.SSLError)
    with pytest.raises(PKIError, match="no CA rotation is under way"):
        pki.finish_rotation(d)


def test_rotate_ca_refuses_while_one_is_under_way_and_bad_overlaps(tmp_path: Path) -> None:
    _, _, d = _rotated(tmp_path)
    before = snapshot(d)
    with pytest.raises(PKIError, match="finish-rotation"):
        pki.rotate_ca(d, overlap=60)
    assert snapshot(d) == before
    for bad in (0, 0.5, float("nan"), -5):
        with pytest.raises(ConfigError, match="overlap"):
            pki.rotate_ca(d, overlap=bad)
    with pytest.raises(NoAuthority):
        pki.rotate_ca(tmp_path / "empty", overlap=60)
    # After the drop, another rotation may start.
    pki.finish_rotation(d)
    pki.rotate_ca(d, overlap=60)


def test_ensure_server_identity_drops_the_old_ca_after_the_overlap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, d = _rotated(tmp_path, overlap=60)
    pki.ensure_server_identity(d, hosts=["cp.example.com"])
    assert (d / pki.PREVIOUS_CA_CERT).exists()  # still within the overlap
    import time as time_module

    real = time_module.time
    monkeypatch.setattr(time_module, "time", lambda: real() + 61)
    _, server, _ = pki.ensure_server_identity(d, hosts=["cp.example.com"])
    rotation = pki.read_rotation(d)
    assert rotation is not None and not rotation.active
    assert not (d / pki.PREVIOUS_CA_KEY).exists()
    assert len(pki.load_bundle(server.ca)) == 1


def test_the_overlap_never_outlives_the_old_ca(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    short = pki.init_ca(d, valid_days=2)
    rotation = pki.rotate_ca(d, overlap=30 * 86400)
    assert rotation.drop_at <= short.cert.not_valid_after_utc.timestamp()


def test_a_node_certificate_is_no_cross_certificate(ca: pki.Authority, tmp_path: Path) -> None:
    """issued_by proves a signature only; that a node's certificate is not a CA is what
    every caller checks besides (is_ca_certificate)."""
    node = pki.issue_node_cert(ca, "gpu1", tmp_path / "n")
    cert = pki.load_cert(node.cert)
    assert pki.issued_by(cert, ca.cert)
    assert not pki.is_ca_certificate(cert)


def test_read_rotation_refuses_garbage(tmp_path: Path) -> None:
    d = tmp_path / "cp"
    pki.init_ca(d)
    assert pki.read_rotation(d) is None
    (d / pki.ROTATION_FILE).write_text("{not json")
    with pytest.raises(PKIError, match="not a rotation record"):
        pki.read_rotation(d)


def test_load_certs_refuses_garbage() -> None:
    with pytest.raises(CertificateError, match="not a list of PEM certificates"):
        pki.load_certs(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    with pytest.raises(CertificateError):
        pki.load_certs(b"")
