"""cloud-init user-data (``POST /api/join-tokens {"cloud_init": true}``): what it holds
(the token only in a root-only file of write_files, never in runcmd), its script run by sh
against served bundles (the token reaches the installer's environment, the file is gone
afterwards, a bad download stops it and still removes the file), Debian's ``cloud-init
schema`` accepting it for several option sets, and the refusals, which mint nothing."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw import pki
from llmgw.contracts.joining import refusal
from llmgw.server.admin.access import AccessRoutes
from llmgw.server.admin.context import guarded
from llmgw.server.joining.bundles import Bundle, add_bundle_routes
from llmgw.server.joining.cloudinit import TOKEN_FILE, join_script
from llmgw.server.store import Store
from tests.ci import require_tools
from tests.oneliner import make_bundle, run_one_liner
from tests.unit.clock import Clock
from tests.unit.server.admin.access_rig import ADMIN, NODE, call, context, joined, one

NOW = 1_700_000_000.0  # test_access's store clock


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> pki.Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store.open(tmp_path / "state.db", clock=Clock(NOW))
    yield s
    s.close()


@pytest.fixture
def served(tmp_path: Path) -> Path:
    folder = tmp_path / "served"
    folder.mkdir()
    make_bundle(folder, "0.1.0", "linux-x64")
    make_bundle(folder, "0.1.0", "linux-arm64")
    return folder


def parsed(user_data: str) -> dict[str, Any]:
    assert user_data.startswith("#cloud-config\n")
    config = yaml.safe_load(user_data)
    assert isinstance(config, dict)
    return config


def script_of(config: dict[str, Any]) -> str:
    [command] = config["runcmd"]
    assert command[:2] == ["sh", "-c"] and len(command) == 3
    return str(command[2])


def test_the_user_data_puts_the_token_in_a_root_only_file_and_nowhere_else(
    store: Store, ca: pki.Authority, served: Path
) -> None:
    data = one(store, ca, {"node": NODE, "cloud_init": True}, bundle_dir=served)
    config = parsed(data["user_data"])
    [token_file] = config["write_files"]
    assert token_file == {
        "path": TOKEN_FILE,
        "owner": "root:root",
        "permissions": "0600",
        "content": data["token"] + "\n",
    }
    script = script_of(config)
    assert data["token"] not in script  # runcmd's argv (and its log) name the file only
    assert data["user_data"].count(data["token"]) == 1
    # The one-liner's own download and check, and the installer with the join's options.
    assert "sha256sum -c -" in script and "/agent/bundles/" in script
    assert (
        f"install-agent.sh install --node-id {NODE} --enroll-url https://cp.example.net:8443 "
        f"--ca-hash {ca.ca_hash()}" in script
    )
    # A cloud-init token lives a day unless told otherwise; the header says so.
    assert data["expires_at"] - NOW == 86400
    assert f"Join token {data['id']}: one use" in data["user_data"]
    assert "then waits for approval" in data["user_data"]
    assert not data["auto_approve"]
    ttl = one(store, ca, {"node": "gpu-02", "cloud_init": True, "ttl": 600}, bundle_dir=served)
    assert ttl["expires_at"] - NOW == 600
    plain = one(store, ca, {"node": "gpu-03"}, bundle_dir=served)
    assert "user_data" not in plain and plain["expires_at"] - NOW == 3600
    kinds = [e.message for e in store.list_events() if e.kind == "join_token_created"]
    assert any(m.endswith("(cloud-init user-data)") for m in kinds), kinds


def test_auto_approve_and_facts_are_carried(store: Store, ca: pki.Authority, served: Path) -> None:
    body = {
        "node": NODE,
        "cloud_init": True,
        "auto_approve": True,
        "facts": {"fabrics": ["ib-a:mlx5_0"], "models_root": "/data/models"},
    }
    data = one(store, ca, body, bundle_dir=served)
    assert data["auto_approve"] is True
    assert "approved on first use (auto-approve token: trust on first use)" in data["user_data"]
    script = script_of(parsed(data["user_data"]))
    assert script.rstrip().endswith("--fabric ib-a:mlx5_0 --models-root /data/models")
    [token] = store.list_join_tokens()
    assert token.auto_approve
    [event] = [e for e in store.list_events() if e.kind == "join_token_created"]
    assert event.message.startswith(f"auto-approve join token {token.id}")


def test_set_hostname_names_the_machine_as_the_node(
    store: Store, ca: pki.Authority, served: Path
) -> None:
    data = one(
        store, ca, {"node": NODE, "cloud_init": True, "set_hostname": True}, bundle_dir=served
    )
    config = parsed(data["user_data"])
    assert (config["hostname"], config["preserve_hostname"]) == (NODE, False)
    assert config["manage_etc_hosts"] == "localhost"  # 127.0.1.1 resolves the new name
    assert f"joins as {NODE} (its host name set to {NODE});" in data["user_data"]
    # Still checked when the script runs: an image that keeps its name is said.
    assert "cloud-init did not set it (preserve_hostname: true" in script_of(config)
    plain = parsed(
        one(store, ca, {"node": "gpu-02", "cloud_init": True}, bundle_dir=served)["user_data"]
    )
    assert "hostname" not in plain and "manage_etc_hosts" not in plain


def write_files(token_file: Path, entry: dict[str, Any], tamper: Path | None) -> None:
    """What write_files does with the entry; then the served bundles replaced, if asked."""
    token_file.write_text(entry["content"])
    token_file.chmod(int(entry["permissions"], 8))
    for bundle in tamper.iterdir() if tamper else ():
        bundle.write_bytes(b"not the bundle the user-data names")


def run_user_data(
    tmp_path: Path,
    store: Store,
    ca: pki.Authority,
    served: Path,
    *,
    tamper: bool = False,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """Mint user-data from a live control plane serving ``served``, write its token file as
    write_files would (at a path of the test's: the script's own is /run), run runcmd's
    script with sh; ``tamper`` replaces the bundle after minting (its SHA-256 no longer
    matches)."""
    token_file = tmp_path / "llmgw-join-token"

    async def main() -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        ctx = context(store, ca, None)
        app = web.Application()
        ctx.bundles = add_bundle_routes(app, served)
        app.router.add_post("/api/join-tokens", guarded(ctx, AccessRoutes(ctx).create_join_token))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            ctx.advertise = ("127.0.0.1",)
            ctx.listening.http_port = client.port  # type: ignore[misc]
            resp = await client.post(
                "/api/join-tokens",
                json={"node": NODE, "cloud_init": True},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            data = await resp.json()
            assert resp.status == 201, data
            config = parsed(data["user_data"])
            [entry] = config["write_files"]
            await asyncio.to_thread(write_files, token_file, entry, served if tamper else None)
            script = script_of(config)
            assert script.count(TOKEN_FILE) == 1
            script = script.replace(TOKEN_FILE, str(token_file))
            result = await asyncio.to_thread(run_one_liner, tmp_path, script)
        return result, data

    result, data = asyncio.run(main())
    return result, data, token_file


def test_runcmd_installs_with_the_token_from_the_file_and_removes_it(
    store: Store, ca: pki.Authority, served: Path, tmp_path: Path
) -> None:
    require_tools("sha256sum")
    if not shutil.which("wget"):
        require_tools("curl")
    result, data, token_file = run_user_data(tmp_path, store, ca, served)
    assert result.returncode == 0, result.stderr
    assert "agent.tar.gz: OK" in result.stdout
    # The machine (uname -n answers x86_64 here) is not called as the node: said, not fatal.
    assert (
        f"llmgw: warning: this machine is called x86_64 but joins as node {NODE}; one name for "
        "host, node and certificate keeps logs, alerts and the console in step: set it "
        f"(hostnamectl set-hostname {NODE}), or mint the user-data with --set-hostname"
    ) in result.stderr
    record = tmp_path / "record"
    assert Path(f"{record}.token").read_text() == data["token"]
    assert Path(f"{record}.argv").read_text().splitlines() == [
        "install", "--node-id", NODE, "--enroll-url", "https://127.0.0.1:8443",
        "--ca-hash", ca.ca_hash(),
    ]  # fmt: skip
    assert not token_file.exists()


def test_a_bundle_that_fails_its_check_installs_nothing_and_the_file_still_goes(
    store: Store, ca: pki.Authority, served: Path, tmp_path: Path
) -> None:
    require_tools("sha256sum")
    if not shutil.which("wget"):
        require_tools("curl")
    result, _, token_file = run_user_data(tmp_path, store, ca, served, tamper=True)
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr
    assert not Path(f"{tmp_path / 'record'}.argv").exists()
    assert not token_file.exists()


def test_without_its_token_file_runcmd_stops_and_says_what_to_do(tmp_path: Path) -> None:
    bundle = Bundle(
        rid="linux-x64",
        version="0.1.0",
        path=tmp_path / "llmgw-agent-0.1.0-linux-x64.tar.gz",
        sha256="0" * 64,
        size=1,
    )
    script = join_script(
        "http://127.0.0.1:9",
        [bundle],
        node_id=NODE,
        enroll_url="https://cp:8443",
        ca_hash="sha256:x",
        verify_tls=True,
    ).replace(TOKEN_FILE, str(tmp_path / "missing"))
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "no join token in" in result.stderr
    assert f"llmgw ctl join-command --node {NODE} --cloud-init" in result.stderr


@pytest.mark.parametrize(
    "body",
    [
        {"cloud_init": True},
        {"cloud_init": True, "auto_approve": True, "ttl": 7200},
        {
            "cloud_init": True,
            "facts": {
                "fabrics": ["ib-a:mlx5_0,mlx5_1"],
                "engines": ["vllm=/opt/vllm/bin/vllm"],
                "firewall_from": ["10.0.0.1"],
            },
        },
        {"cloud_init": True, "address": "[fd00::1]:8080"},
        {"cloud_init": True, "set_hostname": True, "facts": {"mgmt_interface": "eth1"}},
    ],
)
def test_cloud_init_schema_accepts_the_user_data(
    store: Store, ca: pki.Authority, served: Path, tmp_path: Path, body: dict[str, Any]
) -> None:
    require_tools("cloud-init")
    data = one(store, ca, {"node": NODE, **body}, bundle_dir=served)
    path = tmp_path / "user-data"
    path.write_text(data["user_data"])
    checked = subprocess.run(
        ["cloud-init", "schema", "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Valid cloud-config" in checked.stdout, checked.stdout


@pytest.mark.parametrize(
    ("body", "piece"),
    [
        (
            {"cloud_init": True, "rekey": True},
            refusal("cloud_init_on_rekey", node="gpu-01", kind="rekey", repair_flag=""),
        ),
        (
            {"auto_approve": True, "rekey": True},
            refusal(
                "auto_approve_on_rekey", node="gpu-01", kind="rekey", proof="proved by the old one"
            ),
        ),
        (
            {"auto_approve": True, "rekey": True, "re_pair": True},
            "a re-pair keeps gpu-01's record, and its new key is approved by its fingerprint",
        ),
        ({"auto_approve": True, "require_approval": True}, "contradict each other"),
        (
            {"auto_approve": "false"},
            "'auto_approve' must be true or false (a JSON boolean), not \"false\"",
        ),
        ({"cloud_init": 1}, "'cloud_init' must be true or false"),
        ({"set_hostname": True}, refusal("set_hostname_without_cloud_init", node="gpu-01")),
    ],
)
def test_refusals_mint_nothing(
    store: Store, ca: pki.Authority, served: Path, body: dict[str, Any], piece: str
) -> None:
    joined(store)
    [(status, data)] = call(store, ca, [{"node": NODE, **body}], bundle_dir=served)
    assert status == 400, data
    assert piece in data["error"]["message"]
    assert store.list_join_tokens(include_inactive=True) == []


def test_cloud_init_without_bundles_is_refused_with_the_fix(
    store: Store, ca: pki.Authority
) -> None:
    [(status, data)] = call(store, ca, [{"node": NODE, "cloud_init": True}])
    assert status == 400, data
    message = data["error"]["message"]
    assert "install the llmgw-agent-bundles package" in message
    assert "copy llmgw-agent-*-linux-<arch>.tar.gz (make dist) into the bundle_dir" in message
    assert store.list_join_tokens(include_inactive=True) == []


def test_the_token_listing_shows_auto_approve_and_the_key_it_approved(
    store: Store, ca: pki.Authority
) -> None:
    auto, _ = store.create_join_token("gpu-05", ttl=600, auto_approve=True)
    store.record_auto_approval(auto.id, "sha256:" + "e" * 64)
    plain, _ = store.create_join_token("gpu-06", ttl=600)
    ctx = context(store, ca, None)
    app = web.Application()
    app.router.add_get("/api/join-tokens", guarded(ctx, AccessRoutes(ctx).join_tokens))

    async def main() -> list[dict[str, Any]]:
        async with TestClient(TestServer(app)) as client:
            resp = await client.get(
                "/api/join-tokens?all=1", headers={"Authorization": f"Bearer {ADMIN}"}
            )
            assert resp.status == 200
            return await resp.json()  # type: ignore[no-any-return]

    listed = {t["id"]: t for t in asyncio.run(main())}
    assert listed[auto.id]["auto_approve"] is True
    assert listed[auto.id]["approved_fingerprint"] == "sha256:" + "e" * 64
    assert listed[plain.id]["auto_approve"] is False
    assert listed[plain.id]["approved_fingerprint"] is None
