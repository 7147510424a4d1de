"""What ``llmgw ctl login`` keeps (llmgw.client): one login per server in a 0600 file, found
for that server before a ctl.yaml's admin token but after a token given outright, and a
file that cannot be read refused with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw.client import Login, find_target, forget_login, logins_file, save_login, saved_login
from llmgw.errors import ConfigError

SERVER = "https://cp.example.net:8080"


def test_a_login_is_kept_per_server_in_a_private_file() -> None:
    path = save_login(Login(SERVER + "/", "alice", "tok-a", 1e10))
    assert path == logins_file() and oct(path.stat().st_mode & 0o777) == "0o600"
    save_login(Login("http://127.0.0.1:8080", "bob", "tok-b", 2e10))
    # The server is matched without its trailing slash or case.
    assert saved_login("HTTPS://cp.example.net:8080") == Login(
        "HTTPS://cp.example.net:8080", "alice", "tok-a", 1e10
    )
    assert forget_login(SERVER) is not None
    assert saved_login(SERVER) is None
    assert saved_login("http://127.0.0.1:8080") is not None  # the other server's stays
    assert forget_login(SERVER) is None


def test_a_login_goes_before_a_config_token_but_not_before_a_given_one(tmp_path: Path) -> None:
    config = tmp_path / "ctl.yaml"
    config.write_text(yaml.safe_dump({"server": SERVER, "token": "the admin token"}))
    (target,) = find_target(None, None, config)
    assert (target.token, target.account) == ("the admin token", None)
    save_login(Login(SERVER, "alice", "alice's token", 1e10))
    (target,) = find_target(None, None, config)
    assert (target.token, target.account) == ("alice's token", "alice")
    assert "'llmgw ctl login' as alice" in target.source
    (target,) = find_target(None, "given outright", config)
    assert (target.token, target.account) == ("given outright", None)
    (target,) = find_target(SERVER, None, None)
    assert target.account == "alice"


def test_a_broken_logins_file_is_refused_with_the_fix() -> None:
    path = logins_file()
    path.parent.mkdir(parents=True)
    path.write_text("- not\n- a mapping\n")
    with pytest.raises(ConfigError, match="sign in again with 'llmgw ctl login'"):
        saved_login(SERVER)
    path.write_text("{unclosed")
    with pytest.raises(ConfigError, match="remove it and sign in again"):
        saved_login(SERVER)
