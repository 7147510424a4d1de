"""``llmgw agent join`` against a fake enrolment server speaking the wire protocol over real TLS."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import pki
from llmgw.agent import join as join_module
from llmgw.agent.config import load_agent_config
from llmgw.agent.join import JoinResult, join
from llmgw.agent.servers import KnownServers
from llmgw.cli import main, prompts
from llmgw.contracts.joining import refusal
from llmgw.contracts.nodefacts import NodeFacts
from llmgw.contracts.rekeyproof import proof_message, verify_proof
from llmgw.errors import ConfigError, CSRError, EnrolmentError, PinMismatch, TokenError

NODE = "gpu-01"
TOKEN = "llmgw-join.0123456789abcdef.s3cr3t-t0ken-value"
REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- the fake server


@dataclass
class Fake:
    """What the fake enrolment server does, and what it saw."""

    ca: pki.Authority
    identity: pki.Identity
    requests: list[tuple[str, str, dict[str, object] | None]] = field(default_factory=list)
    refuse: tuple[int, str, str] | None = None
    issue_cn: str | None = None  # a CN other than the one asked for
    issue_with: pki.Authority | None = None  # another CA's key signs
    issue_key: ec.EllipticCurvePrivateKey | None = None  # certify another key
    node_uid: str | None = None  # answer this uid instead of the right one
    state: str = "pending"
    servers: tuple[str, ...] = ("cp-1.example:7443", "cp-2.example:7443")
    post_delay: float = 0.0
    post_seen: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    @property
    def posts(self) -> list[dict[str, object]]:
        return [body for method, _, body in self.requests if method == "POST" and body]

    def answer(self, req: dict[str, object]) -> tuple[int, dict[str, object]]:
        if self.refuse is not None:
            status, code, message = self.refuse
            return status, {"error": {"code": code, "message": message}}
        csr = x509.load_pem_x509_csr(str(req["csr"]).encode())
        signer = self.issue_with or self.ca
        public_key = self.issue_key.public_key() if self.issue_key else csr.public_key()
        assert isinstance(public_key, ec.EllipticCurvePublicKey)
        now = dt.datetime.now(dt.UTC)
        cn = self.issue_cn or str(req["node_id"])
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.ca.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
                ),
                critical=False,
            )
            .sign(signer.key, hashes.SHA256())
        )
        uid = self.node_uid or (req["node_uid"] if req["rekey"] else uuid.uuid4().hex)
        return 200, {
            "certificate": cert.public_bytes(serialization.Encoding.PEM).decode(),
            "ca": self.ca.cert.public_bytes(serialization.Encoding.PEM).decode(),
            "node_id": req["node_id"],
            "node_uid": uid,
            "fingerprint": pki.fingerprint(public_key),
            "state": self.state,
            "expires_at": cert.not_valid_after_utc.timestamp(),
            "servers": list(self.servers),
        }


def _handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            fake.requests.append(("GET", self.path, None))
            if self.path != "/enroll/ca":
                self._send(404, b'{"error": {"code": "not_found", "message": "no"}}', "x/y")
                return
            pem = fake.ca.cert.public_bytes(serialization.Encoding.PEM)
            self._send(200, pem, "application/x-pem-file")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            req = json.loads(self.rfile.read(length))
            fake.requests.append(("POST", self.path, req))
            fake.post_seen.set()
            time.sleep(fake.post_delay)
            status, answer = fake.answer(req)
            self._send(status, json.dumps(answer).encode(), "application/json")

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that aborts the handshake is part of some tests


def _serve(fake: Fake, host: str) -> Iterator[Fake]:
    server = _Server((host, 0), _handler(fake))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(fake.identity.cert, fake.identity.key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    fake.url = f"https://{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _fake(tmp_path: Path) -> Fake:
    ca = pki.init_ca(tmp_path / "cp-pki")
    identity = pki.issue_server_cert(ca, tmp_path / "cp-pki", hosts=["cp-1.example"])
    return Fake(ca=ca, identity=identity)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Fake]:
    yield from _serve(_fake(tmp_path), "127.0.0.1")


@pytest.fixture
def node(tmp_path: Path) -> Path:
    return tmp_path / "node"


def do_join(fake: Fake, node: Path, **kwargs: object) -> JoinResult:
    args: dict[str, object] = {
        "node_id": NODE,
        "enroll_url": fake.url,
        "ca_hash": fake.ca.ca_hash(),
        "token": TOKEN,
        "config_path": node / "etc" / "agent.yaml",
        "state_dir": node / "state",
    }
    args.update(kwargs)
    return join(**args)  # type: ignore[arg-type]


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under ``directory``: bytes, mtime (ns) and mode."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


# --------------------------------------------------------------------------- a first join


def test_join_writes_the_identity_and_a_minimal_config(fake: Fake, node: Path) -> None:
    result = do_join(fake, node)

    state = node / "state"
    key_path, cert_path, ca_path, uid_path = (
        state / "node.key",
        state / "node.crt",
        state / "ca.crt",
        state / "node.uid",
    )
    assert mode(state) == 0o700
    assert mode(key_path) == 0o600
    assert mode(cert_path) == 0o644
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert pki.cert_common_name(cert) == NODE
    cert.verify_directly_issued_by(fake.ca.cert)
    assert ca_path.read_bytes() == fake.ca.cert.public_bytes(serialization.Encoding.PEM)
    assert uid_path.read_text() == result.node_uid + "\n"
    assert result.fingerprint == pki.fingerprint(key.public_key())
    assert result.state == "pending"
    assert result.servers == ("cp-1.example:7443", "cp-2.example:7443")
    assert not list(state.glob(".*tmp")) and not list(state.glob("*.old"))

    # what the server saw: the token, our node id, a CSR with CN and SAN = node id
    (post,) = fake.posts
    assert post["token"] == TOKEN and post["node_id"] == NODE
    assert post["rekey"] is False and post["node_uid"] is None
    csr = x509.load_pem_x509_csr(str(post["csr"]).encode())
    assert csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == NODE
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [NODE]

    config = node / "etc" / "agent.yaml"
    assert result.config_written and mode(config) == 0o640
    assert yaml.safe_load(config.read_text()) == {
        "servers": ["cp-1.example:7443", "cp-2.example:7443"],
        "node_id": NODE,
        "state_dir": str(state),
    }
    cfg = load_agent_config(config)
    assert (cfg.tls.cert, cfg.tls.key, cfg.tls.ca) == (cert_path, key_path, ca_path)


def test_one_server_is_written_as_server(fake: Fake, node: Path) -> None:
    fake.servers = ("10.0.0.1:7443",)
    do_join(fake, node)
    data = yaml.safe_load((node / "etc" / "agent.yaml").read_text())
    assert data["server"] == "10.0.0.1:7443" and "servers" not in data


def test_an_existing_config_decides_the_paths_and_is_kept(fake: Fake, node: Path) -> None:
    config = node / "agent.yaml"
    config.parent.mkdir(parents=True)
    text = (
        f"server: cp-9:7443\nnode_id: {NODE}\nstate_dir: {node / 'var'}\n"
        f"tls:\n  key: {node / 'keys' / 'my.key'}\n"
    )
    config.write_text(text)
    result = do_join(fake, node, config_path=config, state_dir=None)
    assert config.read_text() == text and not result.config_written
    assert mode(node / "keys" / "my.key") == 0o600
    assert (node / "var" / "node.crt").is_file() and (node / "var" / "node.uid").is_file()


def test_a_fresh_join_puts_every_server_in_agent_yaml_and_learns_nothing(
    fake: Fake, node: Path
) -> None:
    fake.servers = ("cp-1.example:7443", "10.0.0.2:7443", "[fd00::3]:7443", "10.0.0.2:7443")
    result = do_join(fake, node)
    listed = ["cp-1.example:7443", "10.0.0.2:7443", "[fd00::3]:7443"]
    assert yaml.safe_load((node / "etc" / "agent.yaml").read_text())["servers"] == listed
    assert result.servers == tuple(listed)
    assert not (node / "state" / "servers.json").exists()  # agent.yaml holds them all


def test_a_kept_config_gets_the_enrolments_servers_in_the_state_directory(
    fake: Fake, node: Path
) -> None:
    """agent.yaml is the operator's and kept as it is: the instances the enrolment names go
    into servers.json beside the identity, which the agent dials after agent.yaml's."""
    config = node / "agent.yaml"
    config.parent.mkdir(parents=True)
    text = f"server: cp-9:7443\nnode_id: {NODE}\nstate_dir: {node / 'var'}\n"
    config.write_text(text)
    do_join(fake, node, config_path=config, state_dir=None)
    assert config.read_text() == text
    learnt = node / "var" / "servers.json"
    assert json.loads(learnt.read_text()) == {"servers": list(fake.servers)}
    assert mode(learnt) == 0o600
    known = KnownServers(load_agent_config(config).servers, node / "var")
    assert known.rotation() == ("cp-9:7443", *fake.servers)


def test_a_rekey_keeps_agent_yaml_and_learns_the_servers_named_now(fake: Fake, node: Path) -> None:
    do_join(fake, node)
    config_before = (node / "etc" / "agent.yaml").read_bytes()
    fake.servers = ("cp-2.example:7443", "cp-3.example:7443")
    do_join(fake, node, rekey=True, state_dir=None)
    assert (node / "etc" / "agent.yaml").read_bytes() == config_before
    learnt = json.loads((node / "state" / "servers.json").read_text())
    assert learnt == {"servers": ["cp-2.example:7443", "cp-3.example:7443"]}


def test_no_server_named_falls_back_to_the_enrolment_host_and_learns_nothing(
    fake: Fake, node: Path
) -> None:
    fake.servers = ()
    result = do_join(fake, node)
    assert result.servers == ("127.0.0.1:7443",)
    assert yaml.safe_load((node / "etc" / "agent.yaml").read_text())["server"] == "127.0.0.1:7443"
    fake.servers = ()
    do_join(fake, node, rekey=True, state_dir=None)
    assert not (node / "state" / "servers.json").exists()


@pytest.mark.parametrize(
    ("servers", "reason"),
    [
        (("cp-1.example:7443", "cp-2.example"), "control plane [1]: 'cp-2.example' has no port"),
        (("0.0.0.0:7443",), "control plane [0] '0.0.0.0:7443' is a wildcard listen address"),
        (tuple(f"cp-{i}:7443" for i in range(65)), "the list names 65 control planes"),
    ],
)
def test_a_bad_server_list_is_refused_and_nothing_written(
    fake: Fake, node: Path, servers: tuple[str, ...], reason: str
) -> None:
    fake.servers = servers
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node)
    assert info.value.code == "bad_response"
    assert f"its 'servers': {reason}" in str(info.value), str(info.value)
    assert "nothing was written" in str(info.value)
    assert not node.exists()


def test_a_config_for_another_node_is_refused_naming_both(fake: Fake, node: Path) -> None:
    config = node / "agent.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("server: cp-9:7443\nnode_id: gpu-02\n")
    with pytest.raises(ConfigError) as info:
        do_join(fake, node, config_path=config, state_dir=None)
    assert "for node 'gpu-02'" in str(info.value) and f"not '{NODE}'" in str(info.value)
    assert fake.requests == []


def test_an_existing_identity_is_not_overwritten_without_rekey(fake: Fake, node: Path) -> None:
    do_join(fake, node)
    before = snapshot(node)
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node)
    assert info.value.code == "already_joined" and "--rekey" in str(info.value)
    assert snapshot(node) == before
    assert len(fake.posts) == 1


# --------------------------------------------------------------------------- the pin


def test_a_wrong_pin_sends_no_token_and_writes_nothing(fake: Fake, node: Path) -> None:
    other = "sha256:" + "ab" * 32
    with pytest.raises(PinMismatch) as info:
        do_join(fake, node, ca_hash=other)
    assert str(info.value) == (
        f"the control plane at {fake.url} presented CA {fake.ca.ca_hash()}, not the pinned "
        f"{other}; the token was NOT sent. Check the address, or ask for a fresh join command"
    )
    assert info.value.code == "ca_pin_mismatch"
    assert [method for method, _, _ in fake.requests] == ["GET"]
    assert not node.exists()


@pytest.mark.parametrize(
    "pin",
    ["", "sha256:abc", "md5:" + "0" * 64, "0" * 64, "sha256:" + "g" * 64, "sha256:" + "0" * 65],
)
def test_a_malformed_pin_is_refused_before_anything(fake: Fake, node: Path, pin: str) -> None:
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node, ca_hash=pin)
    assert info.value.code == "ca_pin_malformed"
    assert "'sha256:' followed by 64 hex digits" in str(info.value)
    assert fake.requests == [] and not node.exists()


def test_an_upper_case_pin_is_accepted(fake: Fake, node: Path) -> None:
    pin = fake.ca.ca_hash()
    do_join(fake, node, ca_hash="sha256:" + pin.removeprefix("sha256:").upper())
    assert (node / "state" / "node.crt").is_file()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://cp-1:8443", "is not an https:// URL"),
        ("https://", "has no host"),
        ("https://cp-1:99999", "has an invalid port"),
        ("https://cp-1:8443/enroll", "has a path"),
        ("https://user:pw@cp-1", "user name or password"),
    ],
)
def test_a_bad_url_is_refused(node: Path, url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        join(
            node_id=NODE,
            enroll_url=url,
            ca_hash="sha256:" + "0" * 64,
            token=TOKEN,
            config_path=node / "agent.yaml",
            state_dir=node,
        )
    assert reason in str(info.value) and "https://HOST[:PORT]" in str(info.value)


def test_the_default_port_is_8443() -> None:
    url = join_module.parse_enroll_url("https://cp-1.example")
    assert (url.host, url.port) == ("cp-1.example", 8443)
    url = join_module.parse_enroll_url("https://[fd00::1]:9000/")
    assert (url.host, url.port) == ("fd00::1", 9000)


def test_an_invalid_node_id_is_refused(fake: Fake, node: Path) -> None:
    with pytest.raises(ConfigError, match="invalid node id 'GPU_01'"):
        do_join(fake, node, node_id="GPU_01")
    assert fake.requests == []


def test_nothing_listening_says_what_to_check(node: Path) -> None:
    with pytest.raises(EnrolmentError) as info:
        join(
            node_id=NODE,
            enroll_url="https://127.0.0.1:1",
            ca_hash="sha256:" + "0" * 64,
            token=TOKEN,
            config_path=node / "agent.yaml",
            state_dir=node,
        )
    assert info.value.code == "unreachable"
    assert "cannot reach the control plane at https://127.0.0.1:1: connection refused" in str(
        info.value
    )
    assert "firewall" in str(info.value)


def test_a_directory_this_user_cannot_write_is_refused_before_the_token_is_sent(
    fake: Fake, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(join_module.os, "access", lambda path, how: False)
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node)
    assert info.value.code == "not_writable"
    assert f"cannot write {node / 'state' / 'node.key'}: " in str(info.value)
    assert "run the join as root (sudo)" in str(info.value)
    assert fake.requests == [] and not node.exists()


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (403, "token_used", TokenError),
        (403, "token_expired", TokenError),
        (400, "csr_cn_mismatch", CSRError),
        (409, "node_exists", EnrolmentError),
    ],
)
def test_server_refusals_keep_code_and_message_and_write_nothing(
    fake: Fake, node: Path, status: int, code: str, error: type[EnrolmentError]
) -> None:
    fake.refuse = (status, code, f"message for {code}")
    with pytest.raises(error) as info:
        do_join(fake, node)
    assert type(info.value) is error
    assert info.value.code == code and info.value.status == status
    assert str(info.value) == f"the control plane refused the join: message for {code} ({code})"
    assert not node.exists()


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("cn", "the certificate is for 'gpu-02', not 'gpu-01'"),
        ("ca", "the certificate was not issued by the pinned CA"),
        ("key", "the certificate is not for the key this node generated"),
    ],
)
def test_a_wrong_certificate_is_refused_and_nothing_written(
    fake: Fake, node: Path, tmp_path: Path, setup: str, reason: str
) -> None:
    if setup == "cn":
        fake.issue_cn = "gpu-02"
    elif setup == "ca":
        fake.issue_with = pki.init_ca(tmp_path / "other-ca")
    else:
        fake.issue_key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node)
    assert info.value.code == "bad_response"
    assert reason in str(info.value) and "nothing was written" in str(info.value)
    assert not node.exists()


# --------------------------------------------------------------------------- rekey


def test_rekey_keeps_the_uid_and_the_previous_identity(fake: Fake, node: Path) -> None:
    first = do_join(fake, node)
    state = node / "state"
    old_key, old_cert = (state / "node.key").read_bytes(), (state / "node.crt").read_bytes()
    config_before = (node / "etc" / "agent.yaml").read_bytes()
    fake.state = "approved"

    second = do_join(fake, node, rekey=True, state_dir=None)

    assert second.node_uid == first.node_uid and second.rekeyed
    assert second.fingerprint != first.fingerprint
    post = fake.posts[-1]
    assert post["rekey"] is True and post["node_uid"] == first.node_uid
    # It proves the key it had, for this node, uid, new key and token only.
    message = proof_message(
        node_id=NODE,
        node_uid=first.node_uid,
        new_key_fingerprint=second.fingerprint,
        token=TOKEN,
    )
    assert verify_proof(post["proof"], message) == first.fingerprint
    assert "re_pair" not in post and "lost_state" not in post
    assert (state / "node.key.old").read_bytes() == old_key
    assert (state / "node.crt.old").read_bytes() == old_cert
    assert mode(state / "node.key.old") == 0o600 and mode(state / "node.crt.old") == 0o644
    new_key = serialization.load_pem_private_key((state / "node.key").read_bytes(), None)
    assert pki.fingerprint(new_key.public_key()) == second.fingerprint
    assert mode(state / "node.key") == 0o600
    assert (state / "node.uid").read_text() == first.node_uid + "\n"
    assert (node / "etc" / "agent.yaml").read_bytes() == config_before


def test_a_failed_rekey_leaves_the_old_identity_byte_for_byte(fake: Fake, node: Path) -> None:
    do_join(fake, node)
    before = snapshot(node)
    fake.refuse = (403, "token_expired", "this rekey token expired 2 hours ago")
    time.sleep(0.01)  # an mtime written now would differ

    with pytest.raises(TokenError) as info:
        do_join(fake, node, rekey=True)

    assert info.value.code == "token_expired"
    assert snapshot(node) == before
    assert {"state/node.key", "state/node.crt", "state/ca.crt", "state/node.uid"} <= set(before)


def test_a_rekey_answered_with_another_uid_changes_nothing(fake: Fake, node: Path) -> None:
    first = do_join(fake, node)
    before = snapshot(node)
    fake.node_uid = "someone-else"
    with pytest.raises(EnrolmentError, match=f"not this node's '{first.node_uid}'"):
        do_join(fake, node, rekey=True)
    assert snapshot(node) == before


@pytest.mark.parametrize("damage", ["missing", "not a key"])
def test_a_rekey_without_its_key_says_re_pair_and_sends_nothing(
    fake: Fake, node: Path, damage: str
) -> None:
    first = do_join(fake, node)
    key = node / "state" / "node.key"
    if damage == "missing":
        key.unlink()
    else:
        key.write_text("garbage")
    before = snapshot(node)
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node, rekey=True)
    assert f"'llmgw agent join --node-uid {first.node_uid}'" in str(info.value)
    assert "--re-pair" in str(info.value)
    assert len(fake.posts) == 1 and snapshot(node) == before
    if damage == "not a key":  # moved aside first, as the message says
        with pytest.raises(EnrolmentError, match="still has its identity"):
            do_join(fake, node, state_dir=None, node_uid=first.node_uid)
        return
    # With its uid kept and its key gone, it re-pairs as that uid (and no other).
    with pytest.raises(EnrolmentError, match="this state directory is another identity's"):
        do_join(fake, node, state_dir=None, node_uid="0" * 32)
    again = do_join(fake, node, state_dir=None, node_uid=first.node_uid)
    assert again.repaired and fake.posts[-1]["re_pair"] is True
    assert "proof" not in fake.posts[-1]


def test_rekey_without_an_identity_says_join_first(fake: Fake, node: Path) -> None:
    with pytest.raises(EnrolmentError) as info:
        do_join(fake, node, rekey=True)
    assert str(info.value) == (
        f"no identity to rekey in {node / 'state'} (no node.uid); join first, without --rekey"
    )
    assert fake.requests == []


# --------------------------------------------------------------------------- TLS names


@pytest.fixture
def fake_elsewhere(tmp_path: Path) -> Iterator[Fake]:
    # The server certificate covers cp-1.example and loopback (127.0.0.1, ::1), not 127.0.0.2.
    yield from _serve(_fake(tmp_path), "127.0.0.2")


def test_an_address_not_in_the_certificate_gets_the_advertise_hint(
    fake_elsewhere: Fake, node: Path
) -> None:
    with pytest.raises(EnrolmentError) as info:
        do_join(fake_elsewhere, node)
    assert info.value.code == "hostname_mismatch"
    assert str(info.value) == (
        "127.0.0.2 is not an address in the control plane's TLS certificate; the token was NOT "
        "sent. Use the address printed by 'llmgw ctl join-command', or add 127.0.0.2 to the "
        "server's 'advertise' and restart it"
    )
    assert fake_elsewhere.posts == [] and not node.exists()


# --------------------------------------------------------------------------- only the control plane


@pytest.fixture
def resolve_cp_host_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """cp-1.example (the control plane's name) resolves to 127.0.0.1, where the fake listens."""
    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        return real("127.0.0.1" if host == "cp-1.example" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def impostor(tmp_path: Path) -> Iterator[Fake]:
    """A node enrolled as cp-1.example (the control plane's host name) serving the enrolment
    protocol with its node certificate: same CA, so the pin matches, and its SAN is the very
    host name the joining node dials."""
    ca = pki.init_ca(tmp_path / "cp-pki")
    node_identity = pki.issue_node_cert(ca, "cp-1.example", tmp_path / "impostor")
    yield from _serve(Fake(ca=ca, identity=node_identity), "127.0.0.1")


def test_a_node_certificate_for_the_control_plane_host_gets_no_token(
    impostor: Fake, node: Path, resolve_cp_host_to_loopback: None
) -> None:
    port = impostor.url.rsplit(":", 1)[1]
    with pytest.raises(EnrolmentError) as info:
        do_join(impostor, node, enroll_url=f"https://cp-1.example:{port}")
    assert info.value.code == "not_control_plane"
    message = str(info.value)
    assert message.startswith(
        f"the server at https://cp-1.example:{port} is not the control plane, though the "
        "pinned CA issued its certificate: its certificate (CN=cp-1.example, serial "
    )
    assert pki.CONTROL_PLANE_OID.dotted_string in message
    assert "the token was NOT sent" in message
    assert impostor.posts == [], "the token went to a node"
    assert [method for method, _, _ in impostor.requests] == ["GET"]  # only the CA, pinned
    assert not node.exists()


def test_the_control_plane_by_its_host_name_gets_the_token(
    fake: Fake, node: Path, resolve_cp_host_to_loopback: None
) -> None:
    """The same path with the control plane's own certificate: the check refuses only nodes."""
    port = fake.url.rsplit(":", 1)[1]
    result = do_join(fake, node, enroll_url=f"https://cp-1.example:{port}")
    assert result.node_id == NODE
    assert len(fake.posts) == 1


# --------------------------------------------------------------------------- the CLI


def test_cli_without_a_token_says_how_to_give_one(
    fake: Fake, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLMGW_JOIN_TOKEN", raising=False)
    args = ["agent", "join", "--node-id", NODE, "--enroll-url", fake.url]
    args += ["--ca-hash", fake.ca.ca_hash(), "--config", str(node / "agent.yaml")]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2
    assert out.stderr == (
        "error: no join token: set LLMGW_JOIN_TOKEN or run in a terminal to be prompted; "
        "never pass it as an argument\n"
    )
    assert fake.requests == []


def test_cli_prompts_for_the_token_in_a_terminal(
    fake: Fake, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLMGW_JOIN_TOKEN", raising=False)
    monkeypatch.setattr(prompts, "stdin_is_tty", lambda: True)
    asked: list[str] = []

    def getpass(prompt: str) -> str:
        asked.append(prompt)
        return TOKEN

    monkeypatch.setattr(prompts.getpass, "getpass", getpass)
    args = ["agent", "--config", str(node / "etc" / "agent.yaml"), "join", "--node-id", NODE]
    args += ["--enroll-url", fake.url, "--ca-hash", fake.ca.ca_hash()]
    args += ["--state-dir", str(node / "state")]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert asked == ["join token (not echoed): "]
    assert fake.posts[0]["token"] == TOKEN
    assert (node / "etc" / "agent.yaml").is_file()


def test_cli_refuses_two_different_configs(node: Path) -> None:
    args = ["agent", "--config", str(node / "a.yaml"), "join", "--config", str(node / "b.yaml")]
    args += ["--node-id", NODE, "--enroll-url", "https://cp", "--ca-hash", "sha256:" + "0" * 64]
    out = CliRunner().invoke(main, args, env={"LLMGW_JOIN_TOKEN": TOKEN})
    assert out.exit_code == 2
    assert "--config is given twice" in out.stderr


def test_cli_error_exit_code_comes_from_the_error(fake: Fake, node: Path) -> None:
    args = ["agent", "join", "--node-id", NODE, "--enroll-url", fake.url]
    args += ["--ca-hash", "sha256:" + "0" * 64, "--config", str(node / "agent.yaml")]
    args += ["--state-dir", str(node / "state")]
    out = CliRunner().invoke(main, args, env={"LLMGW_JOIN_TOKEN": TOKEN})
    assert out.exit_code == 1
    assert out.stderr.startswith(f"error: the control plane at {fake.url} presented CA ")


def test_cli_join_in_a_subprocess_keeps_the_token_out_of_argv(fake: Fake, node: Path) -> None:
    fake.post_delay = 1.0
    config = node / "etc" / "agent.yaml"
    env = {**os.environ, "LLMGW_JOIN_TOKEN": TOKEN}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "llmgw", "agent", "join", "--node-id", NODE]
    cmd += ["--enroll-url", fake.url, "--ca-hash", fake.ca.ca_hash(), "--config", str(config)]
    cmd += ["--state-dir", str(node / "state")]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.post_seen.wait(30), "the join never reached POST /enroll"
        assert proc.poll() is None  # still waiting for the delayed answer
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert NODE.encode() in cmdline  # it is the right process
        assert TOKEN.encode() not in cmdline
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert fake.posts[0]["token"] == TOKEN

    state = node / "state"
    key = serialization.load_pem_private_key((state / "node.key").read_bytes(), None)
    fp = pki.fingerprint(key.public_key())
    uid = (state / "node.uid").read_text().strip()
    cert = x509.load_pem_x509_certificate((state / "node.crt").read_bytes())
    assert f"fingerprint: {fp}\n" in stdout
    assert stdout == (
        f"node {NODE} joined (uid {uid})\n"
        f"fingerprint: {fp}\n"
        "state: pending\n"
        f"certificate valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC\n"
        f"key:         {state / 'node.key'} (0600; it never leaves this machine)\n"
        f"certificate: {state / 'node.crt'}\n"
        f"ca:          {state / 'ca.crt'}\n"
        f"uid:         {state / 'node.uid'}\n"
        f"config:      {config} (written)\n"
        f"next: ask the operator to approve it: llmgw ctl approve {NODE} --fingerprint {fp}\n"
        "then start the agent: sudo systemctl enable --now llmgw-agent "
        f"(or: llmgw agent --config {config})\n"
    )
    assert stderr == ""


def test_cli_rekey_of_an_approved_node_says_restart(
    fake: Fake, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    do_join(fake, node)
    fake.state = "approved"
    monkeypatch.setenv("LLMGW_JOIN_TOKEN", TOKEN)
    args = ["agent", "join", "--node-id", NODE, "--enroll-url", fake.url, "--rekey"]
    args += ["--ca-hash", fake.ca.ca_hash(), "--config", str(node / "etc" / "agent.yaml")]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    state = node / "state"
    assert f"node {NODE} rekeyed (uid " in out.stdout
    assert "state: approved\n" in out.stdout
    assert f"previous:    {state / 'node.key.old'}, {state / 'node.crt.old'}\n" in out.stdout
    assert out.stdout.endswith(
        "next: restart the agent to use the new identity: sudo systemctl restart llmgw-agent\n"
    )


def test_cli_join_in_the_agents_image_says_to_start_its_container(
    fake: Fake, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image sets LLMGW_AGENT_CONTAINER: its agent is the container, not a unit."""
    monkeypatch.setenv("LLMGW_JOIN_TOKEN", TOKEN)
    monkeypatch.setenv("LLMGW_AGENT_CONTAINER", "1")
    args = ["agent", "join", "--node-id", NODE, "--enroll-url", fake.url]
    args += ["--ca-hash", fake.ca.ca_hash(), "--config", str(node / "etc" / "agent.yaml")]
    args += ["--state-dir", str(node / "state")]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "systemctl" not in out.stdout
    assert out.stdout.endswith("then start the agent's container: docker compose up -d\n")
    fake.state = "approved"
    out = CliRunner().invoke(main, [*args[:-2], "--rekey"])
    assert out.exit_code == 0, out.output
    assert out.stdout.endswith(
        "next: restart the agent's container to use the new identity: "
        "docker compose restart agent\n"
    )


# --------------------------------------------------------------------------- re-pair (--node-uid)


def test_a_node_that_lost_its_state_re_pairs_with_its_uid(fake: Fake, node: Path) -> None:
    first = do_join(fake, node)
    config_before = (node / "etc" / "agent.yaml").read_bytes()
    for path in (node / "state").iterdir():
        path.unlink()
    (node / "state").rmdir()

    again = do_join(fake, node, state_dir=None, node_uid=first.node_uid)

    assert again.repaired and not again.rekeyed and again.node_uid == first.node_uid
    post = fake.posts[-1]
    assert (post["rekey"], post["node_uid"], post["re_pair"]) == (True, first.node_uid, True)
    state = node / "state"
    assert (state / "node.uid").read_text() == first.node_uid + "\n"
    key = serialization.load_pem_private_key((state / "node.key").read_bytes(), None)
    assert pki.fingerprint(key.public_key()) == again.fingerprint != first.fingerprint
    assert not list(state.glob("*.old"))
    assert (node / "etc" / "agent.yaml").read_bytes() == config_before


def test_a_re_pair_refusals_send_nothing_or_write_nothing(fake: Fake, node: Path) -> None:
    first = do_join(fake, node)
    before = snapshot(node)
    # The state is still there: that is a rekey.
    with pytest.raises(EnrolmentError, match=r"still has its identity in .*rekey it with --rekey"):
        do_join(fake, node, state_dir=None, node_uid=first.node_uid)
    with pytest.raises(ConfigError) as both:
        do_join(fake, node, state_dir=None, node_uid=first.node_uid, rekey=True)
    assert str(both.value) == refusal("rekey_and_repair")
    with pytest.raises(ConfigError, match="--node-uid: 'a b' is not a node uid"):
        do_join(fake, node / "other", node_uid="a b")
    assert len(fake.posts) == 1 and snapshot(node) == before
    # Answered with another uid: nothing written.
    fresh = node / "fresh"
    fake.node_uid = "someone-else"
    with pytest.raises(EnrolmentError, match="not this node's 'u1'"):
        do_join(fake, fresh, node_uid="u1")
    assert snapshot(fresh) == {}


# --------------------------------------------------------------------------- node facts


def test_node_facts_go_into_the_config_the_join_writes(fake: Fake, node: Path) -> None:
    facts = NodeFacts.parse(
        fabrics=["ib-a:mlx5_0,mlx5_1", "ib-b:mlx5_2"],
        nvidia_smi="/usr/bin/nvidia-smi",
        ib_root="/sys/class/infiniband",
        engines=["vllm=/opt/vllm/bin/vllm", "sglang=/opt/sg/bin/python"],
    )
    do_join(fake, node, facts=facts)
    config = node / "etc" / "agent.yaml"
    data = yaml.safe_load(config.read_text())
    assert data["fabrics"] == [
        {"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]},
        {"name": "ib-b", "hcas": ["mlx5_2"]},
    ]
    assert data["discovery"] == {
        "nvidia_smi": "/usr/bin/nvidia-smi",
        "ib_root": "/sys/class/infiniband",
    }
    assert data["engines"] == {
        "vllm": {"bin": "/opt/vllm/bin/vllm"},
        "sglang": {"python": "/opt/sg/bin/python"},
    }
    cfg = load_agent_config(config)
    assert [f.hcas for f in cfg.fabrics] == [("mlx5_0", "mlx5_1"), ("mlx5_2",)]
    assert cfg.engines.program("vllm") == "/opt/vllm/bin/vllm"
    # What the agent's own check reads.
    out = CliRunner().invoke(main, ["agent", "--config", str(config), "--check"])
    assert out.exit_code == 0, out.output


def test_none_leaves_the_fabrics_and_engines_out(fake: Fake, node: Path) -> None:
    do_join(fake, node, facts=NodeFacts.parse(fabrics=["none"], engines=["none"]))
    data = yaml.safe_load((node / "etc" / "agent.yaml").read_text())
    assert "fabrics" not in data and "engines" not in data


def test_node_facts_refusals_come_before_the_token_is_sent(fake: Fake, node: Path) -> None:
    with pytest.raises(ConfigError) as info:
        do_join(fake, node, facts=NodeFacts.parse(models_root="/data/models"))
    assert "--models-root are options of install-agent.sh, not of 'llmgw agent join'" in str(
        info.value
    )
    assert fake.requests == []
    do_join(fake, node)
    before = snapshot(node)
    with pytest.raises(ConfigError) as refused:
        do_join(fake, node, rekey=True, facts=NodeFacts.parse(nvidia_smi="/bin/nvidia-smi"))
    assert str(refused.value) == refusal("facts_on_rekey", facts="--nvidia-smi")
    # A config that exists is kept as it is: the facts would be lost, so they are refused.
    other = node / "again"
    other.mkdir()
    (other / "agent.yaml").write_text((node / "etc" / "agent.yaml").read_text())
    with pytest.raises(ConfigError, match="exists already and is kept as it is; set them in it"):
        do_join(
            fake,
            node,
            config_path=other / "agent.yaml",
            state_dir=None,
            facts=NodeFacts.parse(engines=["vllm=/opt/vllm"]),
        )
    after = {k: v for k, v in snapshot(node).items() if not k.startswith("again/")}
    assert len(fake.posts) == 1 and after == before


def test_cli_node_facts_and_node_uid(fake: Fake, node: Path) -> None:
    base = ["agent", "join", "--node-id", NODE, "--enroll-url", fake.url]
    base += ["--ca-hash", fake.ca.ca_hash(), "--config", str(node / "etc" / "agent.yaml")]
    base += ["--state-dir", str(node / "state")]
    env = {"LLMGW_JOIN_TOKEN": TOKEN}
    no_ib = node / "no-ib"
    out = CliRunner().invoke(main, [*base, "--fabric", "ib-a", "--ib-root", str(no_ib)], env=env)
    assert out.exit_code == 2
    assert "--fabric: ib-a names no adapters, so it takes this node's active InfiniBand " in (
        out.stderr
    )
    assert f"and {no_ib} has none" in out.stderr
    out = CliRunner().invoke(main, [*base, "--engine", "sim=/usr/bin/llmgw"], env=env)
    assert out.exit_code == 2 and "built in and takes no program" in out.stderr
    out = CliRunner().invoke(main, [*base, "--rekey", "--node-uid", "u1"], env=env)
    assert out.exit_code == 2 and refusal("rekey_and_repair") in " ".join(out.stderr.split())
    assert fake.requests == []
    # A bare fabric name takes the active adapters of the sysfs tree (mlx5_1's port is down);
    # install-agent.sh's join (LLMGW_BY_INSTALLER) leaves the config and the start to it.
    ib = Path(__file__).resolve().parents[2] / "fixtures" / "ib"
    facts = ["--fabric", "ib-a", "--ib-root", str(ib), "--engine", "vllm=/opt/v/vllm"]
    facts += ["--node-address", "10.0.0.5"]
    out = CliRunner().invoke(main, [*base, *facts], env={**env, "LLMGW_BY_INSTALLER": "1"})
    assert out.exit_code == 0, out.output
    data = yaml.safe_load((node / "etc" / "agent.yaml").read_text())
    assert data["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0"]}]
    assert data["engines"] == {"vllm": {"bin": "/opt/v/vllm"}}
    assert data["mgmt_addr"] == "10.0.0.5"
    assert "config:" not in out.stdout and "start the agent" not in out.stdout
    assert out.stdout.splitlines()[-1].startswith("next: ask the operator to approve it: ")
    uid = (node / "state" / "node.uid").read_text().strip()
    for path in (node / "state").iterdir():
        path.unlink()
    out = CliRunner().invoke(main, [*base, "--node-uid", uid], env=env)
    assert out.exit_code == 0, out.output
    assert f"node {NODE} re-paired (uid {uid})" in out.stdout
    assert "restart the agent to use the new identity" in out.stdout
