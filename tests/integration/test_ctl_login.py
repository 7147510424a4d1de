"""``llmgw ctl login``, ``whoami`` and ``logout`` against a real control plane: ctl acts as
the account signed in (the events name it), a viewer's token reads and is refused every
change, the account's own password signs an update, a wrong password is rate-limited, and a
logout ends the token at the control plane as well as here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import LLMGW, Server, start_server_with, stop_process


@pytest.fixture
def server(tmp_path: Path) -> Any:
    srv = start_server_with(tmp_path, **{"console": {"login_failures_per_account": 3}})
    yield srv
    stop_process(srv.proc)


def _ctl(srv: Server, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("LLMGW_") or k == "LLMGW_EVENT_LOOP"
    }
    environ.update(XDG_CONFIG_HOME=str(home), **env)
    return subprocess.run(
        [*LLMGW, "ctl", "--server", srv.url, *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


def test_ctl_acts_as_the_account_signed_in(server: Server, tmp_path: Path) -> None:
    home = tmp_path / "home"
    admin_pw = (server.state_dir / "admin.password").read_text().strip()
    token = {"LLMGW_TOKEN": server.admin_token}

    # With no login and no token, ctl says how to get either.
    out = _ctl(server, home, "whoami")
    assert (
        out.returncode == 1 and "sign in as your account with 'llmgw ctl login NAME'" in out.stderr
    )

    out = _ctl(server, home, "login", "admin", LLMGW_PASSWORD=admin_pw)
    assert out.returncode == 0, out.stderr
    assert f"signed in to {server.url} as admin (admin)" in out.stdout
    saved = home / "llmgw" / "logins.yaml"
    assert oct(saved.stat().st_mode & 0o777) == "0o600"
    stored = yaml.safe_load(saved.read_text())[server.url]
    assert stored["account"] == "admin" and stored["token"] != server.admin_token
    assert _ctl(server, home, "whoami").stdout == "admin (admin)\n"

    # As admin: make a viewer, then an admin (which asks admin's own password again).
    out = _ctl(server, home, "users", "add", "vera", "--role", "viewer",
               LLMGW_USER_PASSWORD="vera's long password")  # fmt: skip
    assert out.returncode == 0, out.stderr
    out = _ctl(server, home, "users", "add", "carl", "--role", "admin",
               LLMGW_USER_PASSWORD="carl's long password", LLMGW_PASSWORD="wrong one here")  # fmt: skip
    assert out.returncode == 1 and "wrong admin password; 'carl' was not added" in out.stderr
    out = _ctl(server, home, "users", "add", "carl", "--role", "admin",
               LLMGW_USER_PASSWORD="carl's long password", LLMGW_PASSWORD=admin_pw)  # fmt: skip
    assert out.returncode == 0, out.stderr
    events = json.loads(_ctl(server, home, "--json", "events", "--subject", "vera").stdout)
    assert [(e["kind"], e["actor"]) for e in events] == [("operator_added", "admin")]

    # A token given outright still wins over the login (automation keeps working as 'token').
    assert "shared admin token" in _ctl(server, home, "whoami", **token).stdout

    # As the viewer: reads, and every change refused with what to do.
    out = _ctl(server, home, "login", "vera", LLMGW_PASSWORD="vera's long password")
    assert out.returncode == 0, out.stderr
    assert _ctl(server, home, "whoami").stdout == "vera (viewer)\n"
    assert _ctl(server, home, "nodes").returncode == 0
    out = _ctl(server, home, "keys", "create", "vera-key")
    assert out.returncode == 1
    assert "the account 'vera' is a viewer: it reads the cluster but changes nothing" in out.stderr
    assert not [k for k in server.api("GET", "/api/keys") if k["name"] == "vera-key"]

    # An update is signed with the signed-in account's own password: carl's, not admin's.
    assert (
        _ctl(server, home, "login", "carl", LLMGW_PASSWORD="carl's long password").returncode == 0
    )
    out = _ctl(server, home, "update", "--all", "--version", "0.0.1", LLMGW_PASSWORD=admin_pw)
    assert out.returncode == 1 and "wrong password for the account 'carl'; nothing was signed" in (
        out.stderr
    )
    out = _ctl(
        server, home, "update", "--all", "--version", "0.0.1", LLMGW_PASSWORD="carl's long password"
    )
    # Past the password: there is no approved node to update, which is the next check.
    assert out.returncode == 1 and "there is no approved node to update" in out.stderr

    # Logout ends the token at the control plane too: the saved copy no longer works.
    carl_token = yaml.safe_load(saved.read_text())[server.url]["token"]
    out = _ctl(server, home, "logout")
    assert out.returncode == 0 and f"signed out of {server.url} (carl)" in out.stdout
    assert server.url not in (yaml.safe_load(saved.read_text()) or {})
    out = _ctl(server, home, "whoami", LLMGW_TOKEN=carl_token)
    assert out.returncode == 1 and "missing or wrong admin token" in out.stderr
    assert "not signed in" in _ctl(server, home, "logout").stdout


def test_wrong_passwords_lock_the_account_and_say_when_to_retry(
    server: Server, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    for _ in range(3):
        out = _ctl(server, home, "login", "admin", LLMGW_PASSWORD="not the admin password")
        assert out.returncode == 1
        assert "wrong account name or password" in out.stderr or "locked" in out.stderr
    admin_pw = (server.state_dir / "admin.password").read_text().strip()
    out = _ctl(server, home, "login", "admin", LLMGW_PASSWORD=admin_pw)
    assert out.returncode == 1 and "try again" in out.stderr.lower(), out.stderr
    assert not (home / "llmgw" / "logins.yaml").exists()
    kinds = [e["kind"] for e in server.api("GET", "/api/events?subject=admin")]
    assert "login_locked" in kinds
