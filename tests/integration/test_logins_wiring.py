"""The control plane's logins as it wires them: made over its store and accounts with
server.yaml's ``console:`` policy, the account ``admin`` logging in with the admin password,
and the periodic prune deleting a lapsed session while the control plane runs.

A real control plane runs in the test's process on loopback ports picked free.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import llmgw.server.leader as leader_module
from llmgw.server.app import ControlPlane
from llmgw.server.common.config import load_server_config
from llmgw.server.store import hash_session_token


def test_the_control_plane_logs_in_and_prunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leader_module, "LOGIN_PRUNE_EVERY", 0.05)
    cfg = load_server_config(
        None,
        overrides={
            "state_dir": str(tmp_path / "server"),
            "http_listen": "127.0.0.1:0",
            "grpc_listen": "127.0.0.1:0",
            "enroll_listen": "127.0.0.1:0",
            "bundle_dir": str(tmp_path / "bundles"),
            "console.session_idle": "10m",
            "console.login_failures_per_account": 2,
        },
    )

    async def main() -> None:
        cp = ControlPlane(cfg)
        await cp.start()
        try:
            assert cp.leader.logins.policy.session_idle == 600.0
            assert cp.leader.logins.policy.failures_per_account == 2
            password = (tmp_path / "server" / "admin.password").read_text().strip()
            token, session = await cp.leader.logins.login(
                "admin", password, addr="127.0.0.1", kind="cli"
            )
            assert (session.operator, session.role) == ("admin", "admin")
            assert cp.leader.logins.resolve(token, "cli") == session
            # A session that lapsed an hour ago goes at the next prune.
            admin_id = cp.store.get_operator("admin").id
            lapsed = hash_session_token("lapsed")
            cp.store.add_login_session(
                lapsed,
                admin_id,
                "console",
                csrf="c",
                now=1.0,
                expires_at=2.0,
                addr="127.0.0.1",
                agent="",
            )
            for _ in range(100):
                if cp.store.find_login_session(lapsed) is None:
                    break
                await asyncio.sleep(0.05)
            assert cp.store.find_login_session(lapsed) is None
            assert cp.leader.logins.resolve(token, "cli") is not None
        finally:
            await cp.stop()

    asyncio.run(main())
