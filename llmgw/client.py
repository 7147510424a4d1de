"""A small client of the admin API for ``llmgw ctl``: finds the control plane, says what it tried.

Where the control plane and its admin token are looked for, first match wins:
flags (``--server``, ``--token``), the environment (``LLMGW_SERVER``, ``LLMGW_TOKEN``),
a ctl config file (``--config``/``LLMGW_CTL_CONFIG``, else ``$XDG_CONFIG_HOME/llmgw/ctl.yaml``),
the file ``llmgw up`` writes into its state directory, then ``http://127.0.0.1:8080`` with
the token of a local control plane (``/var/lib/llmgw/admin.token``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.errors import APIError, ConfigError, ConnectError

__all__ = [
    "ADMIN_PASSWORD_ENV",
    "NEW_ADMIN_PASSWORD_ENV",
    "AdminClient",
    "Target",
    "default_up_state_dir",
    "find_target",
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
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "ctl.yaml"


@dataclass(frozen=True)
class Target:
    server: str
    token: str | None
    source: str  # where it came from, for messages


def _read_ctl_file(path: Path) -> tuple[str | None, str | None]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None, None
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
    return server, token if isinstance(token, str) else None


def write_ctl_config(path: Path, server: str, token_file: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump({"server": server, "token_file": str(token_file)}))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def find_target(server: str | None, token: str | None, config: Path | None) -> list[Target]:
    """Every place to try, in order; flags and environment were merged by click already."""
    candidates: list[Target] = []
    if server:
        candidates.append(Target(server, token, "--server/LLMGW_SERVER"))
        return candidates
    files = [config] if config else [_user_config(), default_up_state_dir() / "ctl.yaml"]
    for path in files:
        if path is None:
            continue
        if config is not None and not path.exists():
            raise ConfigError(
                "no such file; pass an existing --config or unset LLMGW_CTL_CONFIG", file=str(path)
            )
        file_server, file_token = _read_ctl_file(path)
        if file_server:
            candidates.append(Target(file_server, token or file_token, str(path)))
    local_token = token
    if local_token is None:
        try:
            local_token = Path("/var/lib/llmgw/admin.token").read_text().strip()
        except OSError:
            local_token = None
    candidates.append(Target("http://127.0.0.1:8080", local_token, "default"))
    return candidates


class AdminClient:
    """Calls the admin API of the first control plane that answers."""

    def __init__(self, candidates: list[Target], timeout: float = 10.0) -> None:
        self.candidates = candidates
        self.timeout = timeout
        self.target: Target | None = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        tried: list[str] = []
        order = [self.target] if self.target else self.candidates
        for target in order:
            assert target is not None
            url = target.server.rstrip("/") + path
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            if target.token:
                req.add_header("Authorization", f"Bearer {target.token}")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    self.target = target
                    raw = resp.read()
                    return json.loads(raw) if raw else None
            except urllib.error.HTTPError as exc:
                self.target = target
                raise _api_error(exc, target) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                tried.append(f"{target.server} (from {target.source}): {reason}")
        raise ConnectError(
            "cannot reach a control plane; tried:\n  "
            + "\n  ".join(tried)
            + "\nstart one ('llmgw up' or 'llmgw server') or pass --server URL / set LLMGW_SERVER"
        )


def _api_error(exc: urllib.error.HTTPError, target: Target) -> APIError:
    try:
        payload = json.loads(exc.read() or b"{}")
        err = payload.get("error", {})
        message, code = err.get("message") or exc.reason, err.get("code")
    except (ValueError, AttributeError):
        message, code = str(exc.reason), None
    if exc.code == 401 and not target.token:
        message = (
            f"{target.server} wants an admin token and none was found; pass --token or set "
            "LLMGW_TOKEN (it is in the control plane's state directory, admin.token)"
        )
    return APIError(str(message), status=exc.code, code=code)
