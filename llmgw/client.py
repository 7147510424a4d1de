"""A small client of the admin API for ``llmgw ctl``: finds the control plane, says what it tried.

Where the control plane and its admin token are looked for, first match wins:
flags (``--server``, ``--token``), the environment (``LLMGW_SERVER``, ``LLMGW_TOKEN``),
a ctl config file (``--config``/``LLMGW_CTL_CONFIG``, else the ``ctl.yaml`` in
``--state-dir``/``LLMGW_STATE_DIR`` when given, else ``$XDG_CONFIG_HOME/llmgw/ctl.yaml``
and the one ``llmgw up`` writes into its default state directory), then the ``ctl.yaml``
a local ``llmgw server`` writes (``/var/lib/llmgw``), then ``http://127.0.0.1:8080`` with
the token of a local control plane (``/var/lib/llmgw/admin.token``). Where no token was
given by flag or environment, the account signed in to that server with ``llmgw ctl login``
(``$XDG_CONFIG_HOME/llmgw/logins.yaml``, 0600) goes before a config file's admin token, so
that what an operator does is recorded under their own name.

An https server is verified against the system trust store, or the CA given with ``--ca``
(``LLMGW_CA``) or the ``ca:`` of the ctl.yaml it came from; a server that an llmgw cluster CA
in that file certified must carry the control plane's identity (:mod:`llmgw.controlpeer`),
checked before anything is sent. The admin token and password
never go over plain HTTP to anything but a loopback address (``localhost``, 127.0.0.0/8,
``::1``, as written in the URL; a name is not looked up to decide) unless
``--insecure-http`` says so.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.contracts.paths import DEFAULT_SERVER_STATE_DIR
from llmgw.contracts.ports import DEFAULT_HTTP_PORT
from llmgw.controlpeer import NotControlPlane, cluster_cas_in, require_control_plane
from llmgw.errors import APIError, CertificateError, ClientError, ConfigError, ConnectError
from llmgw.fsutil import write_private
from llmgw.netaddr import is_loopback_host
from llmgw.pki import load_bundle

__all__ = [
    "ADMIN_PASSWORD_ENV",
    "NEW_ADMIN_PASSWORD_ENV",
    "AdminClient",
    "Login",
    "Target",
    "default_up_state_dir",
    "find_target",
    "forget_login",
    "is_loopback_url",
    "logins_file",
    "save_login",
    "saved_login",
    "write_ctl_config",
]

# The admin password signed updates ask for again (never an argument: /proc shows those);
# the control plane writes the first one to admin.password next to admin.token.
ADMIN_PASSWORD_ENV = "LLMGW_ADMIN_PASSWORD"
NEW_ADMIN_PASSWORD_ENV = "LLMGW_NEW_ADMIN_PASSWORD"


def default_up_state_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "llmgw"


def _user_config() -> Path:
    return _config_dir() / "ctl.yaml"


def _config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw"


def logins_file() -> Path:
    """Where ``llmgw ctl login`` keeps its tokens, one per server (0600)."""
    return _config_dir() / "logins.yaml"


@dataclass(frozen=True)
class Login:
    """An account's token for one control plane, from ``llmgw ctl login``."""

    server: str
    account: str
    token: str
    expires_at: float


def _server_key(server: str) -> str:
    return server.strip().rstrip("/").lower()


def _read_logins() -> dict[str, Any]:
    path = logins_file()
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"cannot read it: {exc}; remove it and sign in again with 'llmgw ctl login'",
            file=str(path),
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            "must be a mapping of server URL to login; remove it and sign in again with "
            "'llmgw ctl login'",
            file=str(path),
        )
    return data


def saved_login(server: str) -> Login | None:
    """The login kept for ``server``, or None."""
    entry = _read_logins().get(_server_key(server))
    if not isinstance(entry, dict):
        return None
    account, token, expires = entry.get("account"), entry.get("token"), entry.get("expires_at")
    if not isinstance(account, str) or not isinstance(token, str) or not token:
        return None
    when = float(expires) if isinstance(expires, int | float) else 0.0
    return Login(server, account, token, when)


def save_login(login: Login) -> Path:
    """Keep ``login`` for its server (replacing one there); the file is the user's alone."""
    data = _read_logins()
    data[_server_key(login.server)] = {
        "account": login.account,
        "token": login.token,
        "expires_at": login.expires_at,
    }
    path = logins_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, yaml.safe_dump(data).encode())
    return path


def forget_login(server: str) -> Login | None:
    """Drop the login kept for ``server``; the one dropped, or None."""
    found = saved_login(server)
    data = _read_logins()
    if data.pop(_server_key(server), None) is None:
        return None
    write_private(logins_file(), yaml.safe_dump(data).encode())
    return found


@dataclass(frozen=True)
class Target:
    server: str
    token: str | None
    source: str  # where it came from, for messages
    ca: Path | None = None  # the CA that verifies an https server (None: the system's)
    account: str | None = None  # the account whose login token this is (None: admin token)


def is_loopback_url(url: str) -> bool:
    """True when the URL's host, as written, is a loopback address: ``localhost``, an IPv4
    address in 127.0.0.0/8 or ``::1``. No name is resolved: what a name resolves to can
    change between this check and the request (and differs per resolver)."""
    try:
        host = urllib.parse.urlsplit(url).hostname
    except ValueError:
        return False
    return bool(host) and is_loopback_host(host or "")


def _read_ctl_file(
    path: Path, *, optional: bool = False
) -> tuple[str | None, str | None, Path | None]:
    """server, token and CA of a ctl.yaml; nothing when it does not exist (or, ``optional``,
    cannot be read by this user: a local server's, for the users that may)."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None, None, None
    except PermissionError:
        if optional:
            return None, None, None
        raise ConfigError(
            "cannot read it: permission denied; run as a user that may", file=str(path)
        ) from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read it: {exc}", file=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            "must be a mapping with 'server' and 'token' or 'token_file'", file=str(path)
        )
    server = data.get("server")
    token = data.get("token")
    token_file = data.get("token_file")
    if token is None and isinstance(token_file, str):
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"cannot read token_file {token_file}: {exc.strerror}",
                key="token_file",
                file=str(path),
            ) from exc
    if server is not None and not isinstance(server, str):
        raise ConfigError("must be a URL like http://cp:8080", key="server", file=str(path))
    ca = data.get("ca")
    if ca is not None and not isinstance(ca, str):
        raise ConfigError(
            "must be the path of the CA certificate (PEM) that verifies the server",
            key="ca",
            file=str(path),
        )
    ca_path = None if ca is None else path.parent / Path(ca).expanduser()
    return server, token if isinstance(token, str) else None, ca_path


def write_ctl_config(path: Path, server: str, token_file: Path, *, ca: Path | None = None) -> None:
    """The ctl.yaml ``llmgw up`` and ``llmgw server`` leave in their state directory."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {"server": server, "token_file": str(token_file)}
    if ca is not None:
        data["ca"] = str(ca)
    write_private(path, yaml.safe_dump(data).encode())


def find_target(
    server: str | None,
    token: str | None,
    config: Path | None,
    state_dir: Path | None = None,
) -> list[Target]:
    """Every place to try, in order; flags and environment were merged by click already."""
    candidates: list[Target] = []
    if server:
        candidates.append(
            _signed_in(token, server, None) or Target(server, token, "--server/LLMGW_SERVER")
        )
        return candidates
    if config is not None:
        files = [config]
        if not config.exists():
            raise ConfigError(
                "no such file; pass an existing --config or unset LLMGW_CTL_CONFIG",
                file=str(config),
            )
    elif state_dir is not None:
        files = [state_dir / "ctl.yaml"]
        if not files[0].exists():
            raise ConfigError(
                "no such file: nothing written it there yet; start 'llmgw up --state-dir "
                f"{state_dir}' (it writes it once the cluster is up), or pass another "
                "--state-dir / unset LLMGW_STATE_DIR",
                file=str(files[0]),
            )
    else:
        files = [
            _user_config(),
            default_up_state_dir() / "ctl.yaml",
            DEFAULT_SERVER_STATE_DIR / "ctl.yaml",
        ]
    for path in files:
        file_server, file_token, file_ca = _read_ctl_file(
            path, optional=path == DEFAULT_SERVER_STATE_DIR / "ctl.yaml"
        )
        if file_server:
            candidates.append(
                _signed_in(token, file_server, file_ca)
                or Target(file_server, token or file_token, str(path), file_ca)
            )
    if config is not None or state_dir is not None:
        return candidates
    local_token = token
    if local_token is None:
        try:
            local_token = (DEFAULT_SERVER_STATE_DIR / "admin.token").read_text().strip()
        except OSError:
            local_token = None
    local = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"
    candidates.append(_signed_in(token, local, None) or Target(local, local_token, "default"))
    return candidates


def _signed_in(token: str | None, server: str, ca: Path | None) -> Target | None:
    """``server`` with the account signed in to it, unless a token was given outright."""
    if token is not None:
        return None
    login = saved_login(server)
    if login is None:
        return None
    return Target(
        server, login.token, f"'llmgw ctl login' as {login.account}", ca, account=login.account
    )


@dataclass(frozen=True)
class Reply:
    """An HTTP answer of the admin API, error statuses included: ``reason`` is its status
    line's phrase."""

    status: int
    body: bytes
    reason: str = ""


class Transport:
    """Sends one request of :class:`AdminClient` and returns the answer, whatever its status;
    a server that cannot be reached raises (``URLError``, ``OSError``). This one speaks HTTP
    with urllib; a caller may hand ``AdminClient`` another, as httpx's clients take a transport
    (the ctl tests answer in process: ``CliRunner().invoke(main, args, obj=transport)``)."""

    def send(
        self, request: urllib.request.Request, *, timeout: float, context: ssl.SSLContext | None
    ) -> Reply:
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
                return Reply(resp.status, resp.read(), str(resp.reason))
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, exc.read(), str(exc.reason))


class AdminClient:
    """Calls the admin API of the first control plane that answers.

    ``ca``: the CA certificate that verifies every https server (else each target's own, else
    the system trust store). ``insecure_http``: allow the admin token and password over
    plain HTTP to a host that is not loopback."""

    def __init__(
        self,
        candidates: list[Target],
        timeout: float = 10.0,
        *,
        ca: Path | None = None,
        insecure_http: bool = False,
        transport: Transport | None = None,
    ) -> None:
        self.candidates = candidates
        self.timeout = timeout
        self.ca = ca
        self.insecure_http = insecure_http
        self.transport = transport or Transport()
        self.target: Target | None = None

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        password: bool = False,
    ) -> Any:
        """``password``: the body holds the admin password (kept off plain HTTP like the
        token)."""
        tried: list[str] = []
        order = [self.target] if self.target else self.candidates
        for target in order:
            assert target is not None
            url = target.server.rstrip("/") + path
            scheme = urllib.parse.urlsplit(url).scheme.lower()
            if scheme not in ("http", "https"):
                raise ConfigError(
                    f"server {target.server} (from {target.source}) must be an http:// or "
                    "https:// URL, e.g. https://cp.example.net:8080"
                )
            self._refuse_clear_text(target, scheme, password=password)
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            if target.token:
                req.add_header("Authorization", f"Bearer {target.token}")
            context = self._ssl_context(target) if scheme == "https" else None
            try:
                reply = self.transport.send(req, timeout=self.timeout, context=context)
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, NotControlPlane):
                    raise ClientError(
                        f"refusing {target.server} (from {target.source}): the cluster CA "
                        f"certified it, but not as the control plane: {reason}; nothing was "
                        "sent. Check the address: a node may hold a certificate for that name"
                    ) from exc
                if isinstance(reason, ssl.SSLCertVerificationError):
                    raise self._unverified(target, reason) from exc
                hint = ""
                if scheme == "http" and isinstance(
                    exc, http.client.RemoteDisconnected | http.client.BadStatusLine
                ):
                    hint = " (a control plane with tls: in server.yaml speaks https://)"
                tried.append(f"{target.server} (from {target.source}): {reason}{hint}")
                continue
            self.target = target
            if reply.status >= 400:
                raise _api_error(reply, target)
            return json.loads(reply.body) if reply.body else None
        raise ConnectError(
            "cannot reach a control plane; tried:\n  "
            + "\n  ".join(tried)
            + "\nstart one ('llmgw up' or 'llmgw server') or pass --server URL / set LLMGW_SERVER"
        )

    def _refuse_clear_text(self, target: Target, scheme: str, *, password: bool) -> None:
        """The admin token and the admin password cross the network only encrypted."""
        secrets = [
            *(
                [("admin" if target.account is None else "login") + " token"]
                if target.token
                else []
            ),
            *(["admin password"] if password else []),
        ]
        secret = " and the ".join(secrets) or None
        if secret is None or scheme != "http" or self.insecure_http:
            return
        if is_loopback_url(target.server):
            return
        raise ClientError(
            f"refusing to send the {secret} in clear over plain HTTP to {target.server} (from "
            f"{target.source}), which is not a loopback address; turn TLS on in the control "
            "plane's server.yaml (tls: cluster, or tls: {cert: FILE, key: FILE}) and use "
            "https://, or pass --insecure-http (env: LLMGW_INSECURE_HTTP=1) to send it anyway"
        )

    def _ssl_context(self, target: Target) -> ssl.SSLContext:
        """Trust the CA given (else the system's); a server certified by an llmgw cluster CA
        among them must also carry the control plane's identity (a node's certificate from
        that CA passes TLS for any name the node was enrolled under)."""
        ca = self.ca or target.ca
        try:
            context = ssl.create_default_context(cafile=str(ca) if ca else None)
            cluster = [] if ca is None else cluster_cas_in(load_bundle(ca))
        except (OSError, ssl.SSLError, CertificateError) as exc:
            where = "--ca/LLMGW_CA" if self.ca else f"ca in {target.source}"
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(
                f"cannot load the CA certificate {ca} ({where}): {reason}; give the PEM file "
                "of the CA that signed the control plane's certificate"
            ) from exc
        return require_control_plane(context, cluster) if cluster else context

    def _unverified(self, target: Target, exc: ssl.SSLCertVerificationError) -> ClientError:
        ca = self.ca or target.ca
        trusted = f"the CA in {ca}" if ca else "the system trust store"
        return ClientError(
            f"cannot verify the certificate of {target.server} (from {target.source}) against "
            f"{trusted}: {exc.verify_message or exc}; pass --ca FILE (env: LLMGW_CA) with the "
            "CA that signed it (with tls: cluster, the control plane's STATE/pki/ca.crt)"
        )


def _api_error(reply: Reply, target: Target) -> APIError:
    try:
        payload = json.loads(reply.body or b"{}")
        err = payload.get("error", {})
        message, code = err.get("message") or reply.reason, err.get("code")
    except (ValueError, AttributeError):
        message, code = reply.reason, None
    # A refused sign-in (code wrong_login) says itself what was wrong.
    if reply.status == 401 and code == "unauthorized" and target.account is not None:
        message = (
            f"the login of {target.account!r} at {target.server} has expired or was ended; "
            f"sign in again with 'llmgw ctl login {target.account}' (or give --token)"
        )
    elif reply.status == 401 and code == "unauthorized" and not target.token:
        message = (
            f"{target.server} wants an admin token and none was found; pass --token or set "
            "LLMGW_TOKEN (it is in the control plane's state directory, admin.token), or sign "
            "in as your account with 'llmgw ctl login NAME'"
        )
    return APIError(str(message), status=reply.status, code=code)
