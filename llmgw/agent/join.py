"""``llmgw agent join``: enrol this node with the control plane (DESIGN §4).

The key is generated here and never leaves the node. The cluster CA is fetched over an
unverified TLS connection and accepted only if its hash equals the pin (``--ca-hash``); the
token travels only afterwards, over TLS verified against that CA, and only to a server whose
certificate carries the control plane's identity (a node's certificate from the same CA, even
one for the very host name dialled, does not). Nothing is written until the returned
certificate has been checked, and then every file is replaced atomically (llmgw.fsutil).

A node whose state directory is gone re-pairs with ``node_uid`` (``--node-uid``) and a
re-pair token: the same node record, a new key, approval by fingerprint again. Node
facts (``--fabric``, ``--nvidia-smi``, ``--ib-root``, ``--engine``) go into the agent.yaml
written when there is none (``none`` for a fabric or an engine: the key is left out).

Every control-plane instance the enrolment answer lists goes into the agent.yaml written
here (``servers``); when the operator's agent.yaml is kept (it exists, or a rekey), the list
goes into the state directory's ``servers.json`` instead (llmgw.agent.servers), which the
agent dials after agent.yaml's own.

Over 600 lines because it is one protocol, read top to bottom in the order it runs: the
inputs, the pinned CA fetch, the enrolment request, the checks of the answer and the files;
each part exists only for the next.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import http.client
import json
import os
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw import netaddr, pki
from llmgw.agent.config import load_agent_config, parse_agent_config
from llmgw.agent.servers import SERVERS_FILE, servers_json
from llmgw.contracts.control_planes import check_control_planes
from llmgw.contracts.joining import REPAIR_FIELD, REPAIR_FLAG, JoinKind, JoinOptions
from llmgw.contracts.nodefacts import AGENT_FACTS, FACT_OPTIONS, NodeFacts
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG, DEFAULT_AGENT_STATE_DIR
from llmgw.contracts.ports import DEFAULT_ENROLL_PORT, DEFAULT_GRPC_PORT
from llmgw.contracts.rekeyproof import proof_message, sign_proof
from llmgw.errors import (
    ConfigError,
    CSRError,
    EnrolmentError,
    FileError,
    LlmgwError,
    PinMismatch,
    TokenError,
)
from llmgw.fsutil import create_file, fsync_dir, make_dir, stage_file
from llmgw.netaddr import format_hostport

__all__ = [
    "JoinPaths",
    "JoinResult",
    "check_ca_hash",
    "join",
    "parse_enroll_url",
]

UID_FILE = "node.uid"
MAX_BODY = 64 * 1024
MAX_TOKEN = 4096
TIMEOUT = 10.0

_PIN = re.compile(r"sha256:[0-9a-f]{64}")
_PIN_FORMAT = "'sha256:' followed by 64 hex digits (as printed by 'llmgw ctl join-command')"
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_STATES = ("pending", "approved")
# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH = (62, 64)


@dataclass(frozen=True)
class EnrollURL:
    """Where the control plane's enrolment endpoint listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"https://{format_hostport(self.host, self.port)}"


@dataclass(frozen=True)
class JoinPaths:
    """Where the node's identity and configuration go."""

    config: Path
    state_dir: Path
    cert: Path
    key: Path
    ca: Path
    uid: Path


@dataclass(frozen=True)
class JoinResult:
    """What a successful join (or rekey) produced."""

    node_id: str
    node_uid: str
    fingerprint: str
    state: str
    expires_at: float
    not_after: dt.datetime
    servers: tuple[str, ...]
    paths: JoinPaths
    config_written: bool
    rekeyed: bool
    repaired: bool = False
    old_key: Path | None = None
    old_cert: Path | None = None


# --------------------------------------------------------------------------- inputs


def check_ca_hash(ca_hash: str) -> str:
    """``ca_hash`` normalised to lower case; EnrolmentError ``ca_pin_malformed`` if it is not
    ``sha256:`` + 64 hex digits."""
    text = ca_hash.strip().lower() if isinstance(ca_hash, str) else ""
    if not _PIN.fullmatch(text):
        shown = ca_hash if isinstance(ca_hash, str) and len(ca_hash) <= 80 else "the value"
        raise EnrolmentError(
            f"--ca-hash {shown!r} is not a CA hash; it is {_PIN_FORMAT}",
            code="ca_pin_malformed",
        )
    return text


def parse_enroll_url(url: str) -> EnrollURL:
    """``https://HOST[:PORT]`` (port 8443 when left out); ConfigError for anything else."""

    def bad(reason: str) -> ConfigError:
        return ConfigError(
            f"{url!r} {reason}; give the control plane's enrolment address as "
            f"https://HOST[:PORT] (port {DEFAULT_ENROLL_PORT} by default)",
            key="--enroll-url",
        )

    parts = urlsplit(url.strip())
    if parts.scheme.lower() != "https":
        raise bad("is not an https:// URL")
    if parts.username is not None or parts.password is not None:
        raise bad("carries a user name or password")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise bad("has a path, query or fragment")
    host = parts.hostname
    if not host:
        raise bad("has no host")
    try:
        port = parts.port
    except ValueError:
        raise bad("has an invalid port") from None
    if port == 0:
        raise bad("has port 0")
    return EnrollURL(host=host, port=port or DEFAULT_ENROLL_PORT)


def _check_token(token: str) -> str:
    text = token.strip()
    if not text:
        raise ConfigError(
            "the join token is empty; copy it from 'llmgw ctl join-command' or the UI's Add node"
        )
    if len(text) > MAX_TOKEN or not text.isprintable() or any(c.isspace() for c in text):
        raise ConfigError(
            "the join token contains spaces or control characters, or is too long; copy it "
            "again from 'llmgw ctl join-command'"
        )
    return text


def _resolve_paths(
    node_id: str, config_path: Path, state_dir: Path | None
) -> tuple[JoinPaths, bool]:
    """The identity's paths and whether the config file already exists."""
    config_path = Path(config_path).absolute()
    if config_path.exists():
        cfg = load_agent_config(config_path)
        if cfg.node_id != node_id:
            raise ConfigError(
                f"this file is for node {cfg.node_id!r} (its node_id, or the host name when "
                f"unset), not {node_id!r}; join as --node-id {cfg.node_id}, or set "
                f"'node_id: {node_id}' in it, or pass another --config",
                file=str(config_path),
            )
        if state_dir is not None and Path(state_dir).absolute() != cfg.state_dir:
            raise ConfigError(
                f"its state_dir is {cfg.state_dir}, not {Path(state_dir).absolute()}; "
                "drop --state-dir or change state_dir in the file",
                file=str(config_path),
            )
        paths = JoinPaths(
            config=config_path,
            state_dir=cfg.state_dir,
            cert=cfg.tls.cert,
            key=cfg.tls.key,
            ca=cfg.tls.ca,
            uid=cfg.state_dir / UID_FILE,
        )
        return paths, True
    base = Path(state_dir if state_dir is not None else DEFAULT_AGENT_STATE_DIR).absolute()
    paths = JoinPaths(
        config=config_path,
        state_dir=base,
        cert=base / "node.crt",
        key=base / "node.key",
        ca=base / pki.CA_CERT,
        uid=base / UID_FILE,
    )
    return paths, False


def _check_writable(path: Path) -> None:
    """Refuse, before the token is spent, a file we would not be allowed to write."""
    probe = path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise EnrolmentError(
            f"cannot write {path}: {probe} is not writable by this user; run the join as root "
            "(sudo) or choose a --config / state directory this user may write",
            code="not_writable",
        )


def _read_uid(path: Path, state_dir: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise EnrolmentError(
            f"no identity to rekey in {state_dir} (no {UID_FILE}); join first, without --rekey",
            code="no_identity",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EnrolmentError(
            f"cannot read {path}: {exc}; run as root (sudo) or restore it from a backup",
            code="no_identity",
        ) from exc
    if not _UID.fullmatch(text):
        raise EnrolmentError(
            f"{path} does not hold a node uid; restore it from a backup or join afresh",
            code="no_identity",
        )
    return text


def _read_optional(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EnrolmentError(
            f"cannot read {path}: {exc.strerror or exc}; run as root (sudo)", code="no_identity"
        ) from exc


# --------------------------------------------------------------------------- the network


def _unverified_context() -> ssl.SSLContext:
    # Only for fetching the CA, which is trusted solely because its hash equals the pin.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _unreachable(url: EnrollURL, exc: BaseException) -> EnrolmentError:
    if isinstance(exc, socket.gaierror):
        reason = f"cannot resolve {url.host} ({exc.strerror or exc})"
    elif isinstance(exc, TimeoutError):
        reason = "no answer within the timeout"
    elif isinstance(exc, ConnectionRefusedError):
        reason = "connection refused"
    else:
        reason = str(getattr(exc, "strerror", None) or exc) or type(exc).__name__
    return EnrolmentError(
        f"cannot reach the control plane at {url}: {reason}; check the address and port "
        f"(enrolment listens on {DEFAULT_ENROLL_PORT}), that 'llmgw server' runs there, and that "
        "no firewall blocks this node",
        code="unreachable",
    )


def _request(
    url: EnrollURL,
    ctx: ssl.SSLContext,
    method: str,
    path: str,
    *,
    body: bytes | None,
    timeout: float,
    check_peer: Callable[[bytes | None], None] | None = None,
) -> tuple[int, bytes]:
    """One request; ``check_peer`` sees the server's certificate (DER) once the handshake is
    done and before a byte of the request is sent, and raises to stop it there."""
    conn = http.client.HTTPSConnection(url.host, url.port, context=ctx, timeout=timeout)
    try:
        if check_peer is not None:
            conn.connect()
            assert isinstance(conn.sock, ssl.SSLSocket)
            check_peer(conn.sock.getpeercert(binary_form=True))
        headers = {"Accept": "application/json", "User-Agent": "llmgw-agent-join"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read(MAX_BODY + 1)
        status = response.status
    finally:
        conn.close()
    if len(data) > MAX_BODY:
        raise EnrolmentError(
            f"the control plane at {url} answered {method} {path} with more than "
            f"{MAX_BODY // 1024} KiB; is this llmgw's enrolment port?",
            code="bad_response",
        )
    return status, data


def _fetch_ca(url: EnrollURL, timeout: float) -> x509.Certificate:
    try:
        status, data = _request(
            url, _unverified_context(), "GET", "/enroll/ca", body=None, timeout=timeout
        )
    except ssl.SSLError as exc:
        raise EnrolmentError(
            f"the control plane at {url} did not complete a TLS handshake ({exc.reason or exc}); "
            f"check the port: enrolment is on {DEFAULT_ENROLL_PORT}, "
            f"agents' stream on {DEFAULT_GRPC_PORT}",
            code="tls_failed",
        ) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise _unreachable(url, exc) from exc
    if status != 200:
        raise EnrolmentError(
            f"the control plane at {url} answered HTTP {status} to GET /enroll/ca; check that "
            f"this is llmgw's enrolment address (port {DEFAULT_ENROLL_PORT})",
            code="bad_response",
            status=status,
        )
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise EnrolmentError(
            f"the control plane at {url} did not send a PEM certificate from /enroll/ca; check "
            f"that this is llmgw's enrolment address (port {DEFAULT_ENROLL_PORT})",
            code="bad_response",
        ) from exc


def _require_control_plane(url: EnrollURL) -> Callable[[bytes | None], None]:
    """The check of the enrolment server's certificate that the TLS library cannot make: the
    pinned CA issues node certificates too, and a node's id may equal the host name in ``url``;
    only the control plane's certificate carries :data:`pki.CONTROL_PLANE_OID`."""

    def check(der: bytes | None) -> None:
        problem = pki.control_plane_problem(der)
        if problem is not None:
            raise EnrolmentError(
                f"the server at {url} is not the control plane, though the pinned CA issued "
                f"its certificate: {problem}; the token was NOT sent. Check the address "
                "against the one printed by 'llmgw ctl join-command'",
                code="not_control_plane",
            )

    return check


def _post_enroll(
    url: EnrollURL, ca_pem: bytes, payload: dict[str, object], timeout: float
) -> dict[str, object]:
    ctx = ssl.create_default_context(cadata=ca_pem.decode("ascii"))
    body = json.dumps(payload).encode()
    try:
        status, data = _request(
            url,
            ctx,
            "POST",
            "/enroll",
            body=body,
            timeout=timeout,
            check_peer=_require_control_plane(url),
        )
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code in _NAME_MISMATCH:
            raise EnrolmentError(
                f"{url.host} is not an address in the control plane's TLS certificate; the "
                "token was NOT sent. Use the address printed by 'llmgw ctl join-command', or "
                f"add {url.host} to the server's 'advertise' and restart it",
                code="hostname_mismatch",
            ) from exc
        raise EnrolmentError(
            f"the control plane at {url} presented a TLS certificate the pinned CA did not "
            f"issue ({exc.verify_message}); the token was NOT sent. Check the address, or ask "
            "for a fresh join command",
            code="server_untrusted",
        ) from exc
    except ssl.SSLError as exc:
        raise EnrolmentError(
            f"the TLS handshake with {url} failed ({exc.reason or exc}); the token was NOT sent",
            code="tls_failed",
        ) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise _unreachable(url, exc) from exc
    if status != 200:
        raise _refusal(status, data)
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise EnrolmentError(
            f"the control plane at {url} answered the join with something other than a JSON "
            "object; is its version compatible with this agent's?",
            code="bad_response",
        )
    return answer


def _refusal(status: int, data: bytes) -> EnrolmentError:
    code, message = None, None
    try:
        error = json.loads(data).get("error")
        if isinstance(error, dict):
            code = error.get("code") if isinstance(error.get("code"), str) else None
            message = error.get("message") if isinstance(error.get("message"), str) else None
    except (ValueError, AttributeError):
        pass
    if code is None:
        excerpt = data[:200].decode("utf-8", "replace").strip() or "no body"
        return EnrolmentError(
            f"the control plane refused the join: HTTP {status} ({excerpt})",
            code="enrolment_failed",
            status=status,
        )
    text = f"the control plane refused the join: {message or code} ({code})"
    if code.startswith("token"):
        return TokenError(text, code=code, status=status)
    if code.startswith("csr"):
        return CSRError(text, code=code, status=status)
    return EnrolmentError(text, code=code, status=status)


# --------------------------------------------------------------------------- keys and checks


def _new_key_and_csr(node_id: str) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = pki.new_private_key()
    return key, pki.make_csr(key, node_id).public_bytes(serialization.Encoding.PEM)


def _bad(message: str) -> EnrolmentError:
    return EnrolmentError(
        f"the control plane's answer was refused: {message}; nothing was written. Ask for a "
        "fresh join command, and report this if it happens again",
        code="bad_response",
    )


def _check_answer(
    answer: dict[str, object],
    *,
    node_id: str,
    key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    old_uid: str | None,
) -> tuple[x509.Certificate, str, str, float, tuple[str, ...]]:
    cert_pem = answer.get("certificate")
    if not isinstance(cert_pem, str):
        raise _bad("it holds no certificate")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError:
        raise _bad("its certificate is not a readable PEM certificate") from None
    try:
        cn = pki.cert_common_name(cert)
    except LlmgwError:
        raise _bad("its certificate has no common name") from None
    if cn != node_id:
        raise _bad(f"the certificate is for {cn!r}, not {node_id!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise _bad("the certificate was not issued by the pinned CA") from None
    if pki.fingerprint(cert.public_key()) != pki.fingerprint(key.public_key()):
        raise _bad("the certificate is not for the key this node generated")
    ca_pem = answer.get("ca")
    if isinstance(ca_pem, str):
        try:
            sent_ca = x509.load_pem_x509_certificate(ca_pem.encode())
        except ValueError:
            raise _bad("its CA is not a readable PEM certificate") from None
        if pki.fingerprint(sent_ca.public_key()) != pki.fingerprint(ca.public_key()):
            raise _bad("the CA it names is not the pinned CA")
    if answer.get("node_id", node_id) != node_id:
        raise _bad(f"it names node {answer.get('node_id')!r}, not {node_id!r}")
    uid = answer.get("node_uid")
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise _bad("it carries no valid node uid")
    if old_uid is not None and uid != old_uid:
        raise _bad(f"the rekeyed node has uid {uid!r}, not this node's {old_uid!r}")
    sent_fp = answer.get("fingerprint")
    if sent_fp is not None and sent_fp != pki.fingerprint(key.public_key()):
        raise _bad(f"it states fingerprint {sent_fp!r}, which is not this node's key")
    state = answer.get("state")
    if state not in _STATES:
        raise _bad(f"its state {state!r} is neither 'pending' nor 'approved'")
    expires = answer.get("expires_at")
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        expires = cert.not_valid_after_utc.timestamp()
    servers_value = answer.get("servers")
    if not isinstance(servers_value, list) or not all(isinstance(s, str) for s in servers_value):
        raise _bad("its 'servers' is not a list of host:port addresses")
    try:
        # The agent takes the leader's later lists by the same check (llmgw.agent.servers).
        servers = check_control_planes(servers_value) if servers_value else ()
    except ConfigError as exc:
        raise _bad(f"its 'servers': {exc}") from None
    return cert, uid, str(state), float(expires), servers


# --------------------------------------------------------------------------- files


def _make_dir(directory: Path, mode: int) -> None:
    try:
        make_dir(directory, mode=mode)
    except FileError as exc:
        reason = exc.__cause__.strerror if isinstance(exc.__cause__, OSError) else exc
        raise EnrolmentError(
            f"cannot create {directory}: {reason}; run as root (sudo)", code="not_writable"
        ) from exc


def _stage(path: Path, data: bytes, mode: int) -> str:
    """Write ``data`` to a fsynced temporary file beside ``path`` (mode set at creation)."""
    try:
        return stage_file(path, data, mode=mode)
    except FileError as exc:
        raise EnrolmentError(exc.message, code="not_writable") from exc


def _commit(staged: list[tuple[str, Path]]) -> None:
    """Move staged files into place, in order; on failure remove what was not moved."""
    try:
        for tmp, path in staged:
            os.replace(tmp, path)
    except OSError as exc:
        raise EnrolmentError(
            f"cannot move the new identity into place ({exc.strerror or exc}); the previous "
            "files, if any, are kept as *.old",
            code="not_writable",
        ) from exc
    finally:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    for directory in {path.parent for _, path in staged}:
        fsync_dir(directory)


def _write_files(files: list[tuple[Path, bytes, int]]) -> None:
    staged: list[tuple[str, Path]] = []
    try:
        for path, data, mode in files:
            staged.append((_stage(path, data, mode), path))
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    _commit(staged)


def _check_node_uid(node_uid: str) -> str:
    text = node_uid.strip()
    if not _UID.fullmatch(text):
        raise ConfigError(
            f"{node_uid[:80]!r} is not a node uid; give the one printed by 'llmgw ctl "
            f"join-command --rekey NODE {REPAIR_FLAG}' (also in 'llmgw ctl nodes --json')",
            key="--node-uid",
        )
    return text


def _old_private_key(
    data: bytes | None, path: Path, node_id: str, uid: str
) -> ec.EllipticCurvePrivateKey:
    """The key a rekey proves; refused (before the token is sent) when there is none."""
    repair = (
        f"re-pair it instead: 'llmgw ctl join-command --rekey {node_id} {REPAIR_FLAG}', then "
        f"'llmgw agent join --node-uid {uid}' (or install-agent.sh install --node-uid {uid}) "
        "once the state directory is moved aside"
    )
    if data is None:
        raise EnrolmentError(
            f"no key in {path}: a rekey proves the node's current key, and this node has none; "
            + repair,
            code="no_identity",
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise EnrolmentError(
            f"{path} does not hold this node's EC private key, which a rekey proves; restore it "
            "from node.key.old or a backup, or " + repair,
            code="no_identity",
        )
    return key


def _config_text(
    node_id: str,
    servers: tuple[str, ...],
    state_dir: Path,
    facts: dict[str, object] | None = None,
) -> str:
    data: dict[str, object] = {}
    if len(servers) == 1:
        data["server"] = servers[0]
    else:
        data["servers"] = list(servers)
    data["node_id"] = node_id
    data["state_dir"] = str(state_dir)
    data.update(facts or {})
    header = (
        "# Written by 'llmgw agent join'; see agent.example.yaml for every setting.\n"
        "# tls: the node's identity is state_dir/node.crt, node.key and ca.crt.\n"
    )
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    parse_agent_config(yaml.safe_load(text))  # what the agent will read must be valid
    return text


def _write_config_if_missing(path: Path, text: str) -> bool:
    """Create ``path`` (0640) atomically, never replacing a file that appeared meanwhile."""
    _make_dir(path.parent, 0o755)
    try:
        return create_file(path, text.encode(), mode=0o640)
    except FileError as exc:
        raise EnrolmentError(
            f"the identity was saved but {path} could not be written ({exc.message}); "
            "create it with 'server', 'node_id' and 'state_dir'",
            code="not_writable",
        ) from exc


# --------------------------------------------------------------------------- join


@dataclass(frozen=True)
class _Prior:
    """What a rekey or re-pair keeps of the node's identity: its uid (read here for a rekey,
    given for a re-pair), its old key and certificate (kept as *.old), and the key that
    proves a rekey."""

    uid: str | None = None
    key: bytes | None = None
    cert: bytes | None = None
    proving_key: ec.EllipticCurvePrivateKey | None = None


@dataclass(frozen=True)
class _Enrolled:
    """The control plane's answer, checked, with the key and CA it is for."""

    key: ec.EllipticCurvePrivateKey
    ca_pem: bytes
    cert: x509.Certificate
    uid: str
    state: str
    expires_at: float
    learnt: tuple[str, ...]


def join(
    *,
    node_id: str,
    enroll_url: str,
    ca_hash: str,
    token: str,
    config_path: Path = DEFAULT_AGENT_CONFIG,
    state_dir: Path | None = None,
    rekey: bool = False,
    node_uid: str | None = None,
    facts: NodeFacts | None = None,
    timeout: float = TIMEOUT,
) -> JoinResult:
    """Enrol (or with ``rekey`` re-key, or with ``node_uid`` re-pair) node ``node_id`` with
    the control plane at ``enroll_url`` whose CA hashes to ``ca_hash``, and save the identity
    where the agent's config (``config_path``; when missing, ``state_dir``) says; ``facts``
    go into that config when it is written here. Raises only llmgw errors; on any error
    nothing was written."""
    netaddr.validate_node_id(node_id)
    pin = check_ca_hash(ca_hash)
    url = parse_enroll_url(enroll_url)
    token = _check_token(token)
    facts = facts or NodeFacts()
    options = _check_options(node_id, rekey, node_uid, facts)
    if node_uid is not None:
        node_uid = _check_node_uid(node_uid)
    paths, config_exists = _resolve_paths(node_id, config_path, state_dir)
    given = facts.given(AGENT_FACTS)
    if given and config_exists:
        raise ConfigError(
            f"{', '.join(given)} go into the agent.yaml this join writes, but {paths.config} "
            "exists already and is kept as it is; set them in it (fabrics, discovery, engines, "
            "mgmt_addr, mgmt_interface), "
            "or pass another --config"
        )
    prior = _prior_identity(paths, options, node_uid)
    learnt_path = paths.state_dir / SERVERS_FILE
    targets = [paths.key, paths.cert, paths.ca, paths.uid]
    targets.append(learnt_path if config_exists else paths.config)
    for target in targets:
        _check_writable(target)

    enrolled = _enrol(url, pin, token, options, prior, timeout)
    servers = enrolled.learnt or (format_hostport(url.host, DEFAULT_GRPC_PORT),)
    config_text = None
    if not config_exists:
        facts_config = facts.agent_config() if given else {}
        config_text = _config_text(node_id, servers, paths.state_dir, facts_config)
    kept_key, kept_cert = _save_identity(paths, enrolled, prior, config_exists)
    written = _write_config_if_missing(paths.config, config_text) if config_text else False
    return JoinResult(
        node_id=node_id,
        node_uid=enrolled.uid,
        fingerprint=pki.fingerprint(enrolled.key.public_key()),
        state=enrolled.state,
        expires_at=enrolled.expires_at,
        not_after=enrolled.cert.not_valid_after_utc,
        servers=servers,
        paths=paths,
        config_written=written,
        rekeyed=options.kind is JoinKind.REKEY,
        repaired=options.re_pair,
        old_key=kept_key,
        old_cert=kept_cert,
    )


def _check_options(
    node_id: str, rekey: bool, node_uid: str | None, facts: NodeFacts
) -> JoinOptions:
    """The join's kind and facts checked by the join contract; the installer's own facts
    refused (this join writes only agent.yaml)."""
    other = facts.given(set(FACT_OPTIONS) - set(AGENT_FACTS))
    if other:
        raise ConfigError(
            f"{', '.join(other)} are options of install-agent.sh, not of 'llmgw agent join'; "
            "give them to the installer"
        )
    return JoinOptions.of_modes(
        node=node_id,
        rekey=rekey,
        re_pair=node_uid is not None,
        facts=tuple(facts.given(AGENT_FACTS)),
    ).check()


def _prior_identity(paths: JoinPaths, options: JoinOptions, node_uid: str | None) -> _Prior:
    """What this node has of an identity, as its kind needs it: none for a join or a
    re-pair (refused when there is one), its uid, key and certificate for a rekey."""
    if options.re_pair:
        assert node_uid is not None
        if paths.key.exists():
            raise EnrolmentError(
                f"this node still has its identity in {paths.state_dir} ({paths.key} exists); "
                "--node-uid is for a node whose state directory is gone: rekey it with "
                "--rekey and a rekey token ('llmgw ctl join-command --rekey NODE')",
                code="already_joined",
            )
        # A state directory that kept its uid but lost its key re-pairs as that uid only.
        if paths.uid.exists() and (kept := _read_uid(paths.uid, paths.state_dir)) != node_uid:
            raise EnrolmentError(
                f"{paths.uid} names uid {kept}, not {node_uid}: this state directory is another "
                f"identity's; move it aside, or give --node-uid {kept} with a re-pair token "
                "for that node",
                code="already_joined",
            )
        return _Prior(uid=node_uid)
    if options.rekey:
        old_uid = _read_uid(paths.uid, paths.state_dir)
        old_key, old_cert = _read_optional(paths.key), _read_optional(paths.cert)
        # The rekey proves the key this node has now; without one it can only re-pair.
        proving = _old_private_key(old_key, paths.key, options.node, old_uid)
        return _Prior(uid=old_uid, key=old_key, cert=old_cert, proving_key=proving)
    if paths.uid.exists():
        raise EnrolmentError(
            f"this node already has an identity in {paths.state_dir} ({paths.uid} exists); to "
            "replace its key use a rekey token with --rekey, or move the directory aside to "
            "join as a new node",
            code="already_joined",
        )
    return _Prior()


def _enrol(
    url: EnrollURL,
    pin: str,
    token: str,
    options: JoinOptions,
    prior: _Prior,
    timeout: float,
) -> _Enrolled:
    """Fetch the CA and check it against the pin, then (only then) send the token with a
    new key's CSR (and for a rekey the old key's proof); the answer, checked."""
    ca = _fetch_ca(url, timeout)
    presented = pki.fingerprint(ca.public_key())
    if not hmac.compare_digest(presented.encode(), pin.encode()):
        raise PinMismatch(
            f"the control plane at {url} presented CA {presented}, not the pinned {pin}; the "
            "token was NOT sent. Check the address, or ask for a fresh join command"
        )
    ca_pem = pki.cert_pem(ca)
    node_id = options.node
    key, csr_pem = _new_key_and_csr(node_id)
    payload: dict[str, object] = {
        "token": token,
        "node_id": node_id,
        "csr": csr_pem.decode("ascii"),
        "rekey": options.rekey,
        "node_uid": prior.uid,
    }
    if options.re_pair:
        payload[REPAIR_FIELD] = True
    elif prior.proving_key is not None:
        assert prior.uid is not None
        message = proof_message(
            node_id=node_id,
            node_uid=prior.uid,
            new_key_fingerprint=pki.fingerprint(key.public_key()),
            token=token,
        )
        payload["proof"] = sign_proof(prior.proving_key, message)
    answer = _post_enroll(url, ca_pem, payload, timeout)
    cert, uid, state, expires_at, learnt = _check_answer(
        answer, node_id=node_id, key=key, ca=ca, old_uid=prior.uid
    )
    return _Enrolled(key, ca_pem, cert, uid, state, expires_at, learnt)


def _save_identity(
    paths: JoinPaths, enrolled: _Enrolled, prior: _Prior, config_exists: bool
) -> tuple[Path | None, Path | None]:
    """Write the new identity (the old key and certificate kept as *.old), and the
    instances the enrolment named beside it when agent.yaml is the operator's; the *.old
    paths written."""
    for directory in {paths.state_dir, paths.key.parent, paths.cert.parent, paths.ca.parent}:
        _make_dir(directory, 0o700)
    files: list[tuple[Path, bytes, int]] = []
    kept_key = kept_cert = None
    if prior.key is not None:
        kept_key = paths.key.with_name(paths.key.name + ".old")
        files.append((kept_key, prior.key, 0o600))
    if prior.cert is not None:
        kept_cert = paths.cert.with_name(paths.cert.name + ".old")
        files.append((kept_cert, prior.cert, 0o644))
    files += [
        (paths.ca, enrolled.ca_pem, 0o644),
        (paths.key, pki.key_pem(enrolled.key), 0o600),
        (paths.cert, pki.cert_pem(enrolled.cert), 0o644),
    ]
    if prior.proving_key is None:  # a rekey keeps the uid file it read
        files.append((paths.uid, (enrolled.uid + "\n").encode(), 0o644))
    if config_exists and enrolled.learnt:
        # agent.yaml is the operator's (root's) and kept: the agent finds the instances
        # the enrolment named beside its identity instead.
        files.append((paths.state_dir / SERVERS_FILE, servers_json(enrolled.learnt), 0o600))
    _write_files(files)
    return kept_key, kept_cert
