"""POST /api/join-tokens: the command an operator pastes, for a join, a rekey and a re-pair of a
node that lost its state directory, with and without agent bundles, node facts appended;
each command parsed back as the shell will, and run where bundles are served. Refusals mint
nothing."""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw import pki
from llmgw.contracts.joining import refusal
from llmgw.server.admin.access import AccessRoutes
from llmgw.server.admin.context import guarded
from llmgw.server.joining.bundles import add_bundle_routes
from llmgw.server.store import Store
from tests.ci import require_tools
from tests.oneliner import make_bundle, run_one_liner
from tests.unit.clock import Clock
from tests.unit.server.admin.access_rig import ADMIN, NODE, call, context, joined, one


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> pki.Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store.open(tmp_path / "state.db", clock=Clock(1_700_000_000.0))
    yield s
    s.close()


def bare(command: str) -> tuple[str, list[str]]:
    """The token and the argv of ``LLMGW_JOIN_TOKEN=… llmgw agent join …``, as sh reads it."""
    words = shlex.split(command)
    assert words[0].startswith("LLMGW_JOIN_TOKEN=")
    return words[0].split("=", 1)[1], words[1:]


FACTS = {
    "fabrics": ["ib-a:mlx5_0,mlx5_1"],
    "nvidia_smi": "/usr/bin/nvidia-smi",
    "engines": ["vllm=/opt/vllm/bin/vllm"],
}


def test_without_bundles_a_rekey_is_the_bare_agent_join(store: Store, ca: pki.Authority) -> None:
    joined(store)
    data = one(store, ca, {"node": NODE, "rekey": True})
    token, argv = bare(data["command"])
    assert token == data["token"]
    assert argv == [
        "llmgw", "agent", "join", "--node-id", NODE,
        "--enroll-url", "https://cp.example.net:8443", "--ca-hash", ca.ca_hash(), "--rekey",
    ]  # fmt: skip
    assert (data["kind"], data["re_pair"], data["node_uid"]) == ("rekey", False, None)


def test_without_bundles_a_lost_state_re_pair_names_the_uid_and_the_facts(
    store: Store, ca: pki.Authority
) -> None:
    uid = joined(store)
    data = one(store, ca, {"node": NODE, "rekey": True, "re_pair": True, "facts": FACTS})
    _, argv = bare(data["command"])
    assert "--rekey" not in argv
    assert argv[9:] == [
        "--node-uid", uid,
        "--fabric", "ib-a:mlx5_0,mlx5_1",
        "--nvidia-smi", "/usr/bin/nvidia-smi",
        "--engine", "vllm=/opt/vllm/bin/vllm",
    ]  # fmt: skip
    assert (data["re_pair"], data["node_uid"], data["facts"]) == (True, uid, FACTS)
    token = store.list_join_tokens()[-1]
    assert (token.kind, token.node_uid, token.lost_state, token.require_approval) == (
        "rekey",
        uid,
        True,
        True,
    )
    assert store.list_events(limit=1)[0].message.startswith("re-pair token ")


def test_join_facts_go_on_the_bare_command(store: Store, ca: pki.Authority) -> None:
    facts = {"fabrics": ["ib-a:mlx5_0"], "ib_root": "/x/ib", "engines": ["none"]}
    data = one(store, ca, {"node": NODE, "facts": facts})
    _, argv = bare(data["command"])
    assert argv[9:] == ["--fabric", "ib-a:mlx5_0", "--ib-root", "/x/ib", "--engine", "none"]


def bundle_dir(tmp_path: Path) -> Path:
    served = tmp_path / "served"
    served.mkdir()
    make_bundle(served, "0.1.0", "linux-x64")
    make_bundle(served, "0.1.0", "linux-arm64")
    return served


def installer_argv(command: str) -> list[str]:
    """What the one-liner passes to install-agent.sh, read as sh reads its last step."""
    last = command.rsplit("; ", 1)[1]
    assert last.endswith(")")
    assert last.startswith('$s sh ./llmgw-agent-*-"$r"/install-agent.sh ')
    return shlex.split(last[:-1].split("/install-agent.sh ", 1)[1])


def test_with_bundles_a_rekey_is_the_checked_one_liner_ending_in_the_rekey_verb(
    store: Store, ca: pki.Authority, tmp_path: Path
) -> None:
    joined(store)
    data = one(store, ca, {"node": NODE, "rekey": True}, bundle_dir=bundle_dir(tmp_path))
    command = data["command"]
    assert "sha256sum -c -" in command and "llmgw agent join" not in command
    assert f"export LLMGW_JOIN_TOKEN={data['token']}" in command
    assert installer_argv(command) == [
        "rekey", "--node-id", NODE,
        "--enroll-url", "https://cp.example.net:8443", "--ca-hash", ca.ca_hash(),
    ]  # fmt: skip


def test_with_bundles_a_re_pair_installs_with_the_uid_and_every_fact(
    store: Store, ca: pki.Authority, tmp_path: Path
) -> None:
    uid = joined(store)
    facts = dict(
        FACTS,
        models_root="/data/models",
        cache_root="/data/cache",
        firewall_from=["10.0.0.1"],
        fabric_peers=["192.168.50.0/24"],
    )
    body = {"node": NODE, "rekey": True, "re_pair": True, "facts": facts}
    data = one(store, ca, body, bundle_dir=bundle_dir(tmp_path))
    assert installer_argv(data["command"])[0] == "install"
    assert installer_argv(data["command"])[7:] == [
        "--node-uid", uid,
        "--fabric", "ib-a:mlx5_0,mlx5_1",
        "--nvidia-smi", "/usr/bin/nvidia-smi",
        "--engine", "vllm=/opt/vllm/bin/vllm",
        "--models-root", "/data/models",
        "--cache-root", "/data/cache",
        "--firewall-from", "10.0.0.1",
        "--fabric-peers", "192.168.50.0/24",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("machine", "uid", "lost_state"),
    [("x86_64", 0, False), ("aarch64", 1000, False), ("x86_64", 1000, True)],
)
def test_the_rekey_one_liner_runs_the_bundles_installer_with_the_token_in_its_environment(
    store: Store, ca: pki.Authority, tmp_path: Path, machine: str, uid: int, lost_state: bool
) -> None:
    """The printed one-liner, run by sh: it downloads the bundle for the machine from the
    gateway, checks its SHA-256 and runs 'install-agent.sh rekey' (a re-pair: 'install
    --node-uid UID' and the facts) with exactly the options the installer reads, the token
    in LLMGW_JOIN_TOKEN (its read_join_token)."""
    require_tools("sha256sum")
    if not shutil.which("wget"):
        require_tools("curl")
    node_uid = joined(store)
    body: dict[str, Any] = {"node": NODE, "rekey": True}
    if lost_state:
        body |= {"re_pair": True, "facts": {"fabrics": ["ib-a:mlx5_0"]}}
    served = bundle_dir(tmp_path)

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
                json=body,
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            data = await resp.json()
            assert resp.status == 201, data
            result = await asyncio.to_thread(
                run_one_liner, tmp_path, data["command"], machine=machine, uid=uid
            )
        return result, data

    result, data = asyncio.run(main())
    assert result.returncode == 0, result.stderr
    assert "agent.tar.gz: OK" in result.stdout
    record = tmp_path / "record"
    join_args = ["--node-id", NODE, "--enroll-url", "https://127.0.0.1:8443"]
    join_args += ["--ca-hash", ca.ca_hash()]
    expected = ["rekey", *join_args]
    if lost_state:
        expected = ["install", *join_args, "--node-uid", node_uid, "--fabric", "ib-a:mlx5_0"]
    assert Path(f"{record}.argv").read_text().splitlines() == expected
    assert Path(f"{record}.token").read_text() == data["token"]
    rid = "linux-x64" if machine == "x86_64" else "linux-arm64"
    assert Path(f"{record}.path").read_text().endswith(f"/llmgw-agent-0.1.0-{rid}/install-agent.sh")
    if uid != 0:  # through sudo, which got no token on its command line
        assert data["token"] not in Path(f"{record}.sudo").read_text()


@pytest.mark.parametrize(
    ("body", "piece"),
    [
        ({"node": NODE, "re_pair": True}, refusal("repair_without_rekey", node=NODE)),
        (
            {"node": NODE, "rekey": True, "facts": {"fabrics": ["ib-a:mlx5_0"]}},
            refusal("facts_on_rekey", facts="--fabric"),
        ),
        (
            {"node": NODE, "facts": {"models_root": "/data/models"}},
            "--models-root are options of the installer, and this control plane serves no "
            "agent bundles",
        ),
        ({"node": NODE, "facts": {"engines": ["sim=/x"]}}, "built in and takes no program"),
        ({"node": NODE, "facts": {"fabrics": ["ib a"]}}, "--fabric: 'ib a' does not start"),
        ({"node": NODE, "facts": {"fabrics": ["ib-a", "ib-b"]}}, "both name no adapters"),
        (
            {"node": NODE, "facts": {"nvidia_smi": "/opt/nv;reboot"}},
            "--nvidia-smi: '/opt/nv;reboot' holds a character other than",
        ),
        ({"node": NODE, "facts": {"gpus": 8}}, "unknown fact(s) gpus"),
        ({"node": NODE, "facts": "ib-a"}, "facts: must be an object of node facts"),
    ],
)
def test_refusals_mint_nothing(
    store: Store, ca: pki.Authority, body: dict[str, Any], piece: str
) -> None:
    joined(store)
    [(status, data)] = call(store, ca, [body])
    assert status == 400, data
    assert piece in data["error"]["message"]
    assert store.list_join_tokens(include_inactive=True) == []


def test_a_lost_state_token_for_a_revoked_or_unknown_node_is_refused(
    store: Store, ca: pki.Authority
) -> None:
    [(status, data)] = call(store, ca, [{"node": NODE, "rekey": True, "re_pair": True}])
    assert status == 404, data
    joined(store, "revoked")
    [(status, data)] = call(store, ca, [{"node": NODE, "rekey": True, "re_pair": True}])
    assert status == 409
    assert (
        "only through a fresh join ('llmgw ctl join-command --node gpu-01')"
        in (data["error"]["message"])
    )
    assert store.list_join_tokens(include_inactive=True) == []


REPO = {"repo_url": "https://repo.example.net/llmgw", "repo_key": "/etc/llmgw/repo.asc"}


def test_a_package_join_runs_the_installers_package_verb(
    store: Store, ca: pki.Authority, tmp_path: Path
) -> None:
    """``package`` (ctl onboard --package): the same checked one-liner, ending in
    'install-agent.sh package' with the repository and its key."""
    body = {"node": NODE, "package": REPO, "facts": {"models_root": "/data/models"}}
    data = one(store, ca, body, bundle_dir=bundle_dir(tmp_path))
    assert "sha256sum -c -" in data["command"]
    assert installer_argv(data["command"]) == [
        "package", "--node-id", NODE,
        "--enroll-url", "https://cp.example.net:8443", "--ca-hash", ca.ca_hash(),
        "--repo-url", "https://repo.example.net/llmgw", "--repo-key", "/etc/llmgw/repo.asc",
        "--models-root", "/data/models",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "bundles", "piece"),
    [
        ({"node": NODE, "package": REPO}, False, "serves no agent bundles"),
        ({"node": NODE, "rekey": True, "package": REPO}, True, refusal("package_on_rekey")),
        ({"node": NODE, "package": {"repo_url": "x"}}, True, "'package' is {\"repo_url\""),
        ({"node": NODE, "package": "https://r"}, True, "'package' is {\"repo_url\""),
        (
            {"node": NODE, "package": REPO | {"repo_url": "ftp://r/x"}},
            True,
            "package repo_url 'ftp://r/x' is not an http(s) URL",
        ),
        (
            {"node": NODE, "package": REPO | {"repo_url": "https://r/x;reboot"}},
            True,
            "is not an http(s) URL of plain characters",
        ),
        (
            {"node": NODE, "package": REPO | {"repo_key": "repo.asc"}},
            True,
            "package repo_key 'repo.asc' is neither an absolute path",
        ),
        (
            {"node": NODE, "package": REPO | {"repo_key": "/k $(id)"}},
            True,
            "is neither an absolute path on the node nor an http(s) URL",
        ),
    ],
)
def test_package_refusals_mint_nothing(
    store: Store, ca: pki.Authority, tmp_path: Path, body: dict[str, Any], bundles: bool, piece: str
) -> None:
    joined(store)
    [(status, data)] = call(store, ca, [body], bundle_dir=bundle_dir(tmp_path) if bundles else None)
    assert status == 400, data
    assert piece in data["error"]["message"]
    assert store.list_join_tokens(include_inactive=True) == []


FLAGS = ("rekey", "re_pair", "lost_state", "require_approval", "auto_approve", "cloud_init")


@pytest.mark.parametrize("value", ["false", 0, None], ids=["string-false", "zero", "null"])
@pytest.mark.parametrize("flag", FLAGS)
def test_every_flag_is_a_json_boolean(
    store: Store, ca: pki.Authority, flag: str, value: object
) -> None:
    """Python's truth of "false" turned a fresh join into a rekey; null is refused as well
    (not read as the default), so a client that sends a placeholder learns so."""
    joined(store)
    [(status, data)] = call(store, ca, [{"node": NODE, flag: value}])
    assert status == 400, data
    shown = "null" if value is None else json.dumps(value)
    assert data["error"]["message"] == (
        f"'{flag}' must be true or false (a JSON boolean), not {shown}; leave it out for false"
    )
    assert store.list_join_tokens(include_inactive=True) == []


def test_false_flags_mint_a_fresh_join(store: Store, ca: pki.Authority) -> None:
    joined(store)
    data = one(store, ca, {"node": NODE, "rekey": False, "re_pair": False})
    assert data["kind"] == "join" and data["re_pair"] is False
    assert data["warning"] is not None  # a fresh join of an existing node says what it does


def test_lost_state_is_re_pairs_old_name_and_warns(store: Store, ca: pki.Authority) -> None:
    """An old client's ``lost_state`` still re-pairs, and the answer says the new name (and
    carries the old one for old clients)."""
    joined(store)
    data = one(store, ca, {"node": NODE, "rekey": True, "lost_state": True})
    assert (data["re_pair"], data["lost_state"]) == (True, True)
    assert "'lost_state' is the old name of 're_pair'; send re_pair" in data["warning"]


def test_a_node_named_like_another_instance_is_refused(store: Store, ca: pki.Authority) -> None:
    """cp.example.net is this instance's name; cp2.example.net (and its advertise entry
    api.example.net) another instance's on the same database: neither is a node id."""
    store.register_instance("cp2", "host/1", stale_after=30, version="0.1.0")
    store.set_instance_addresses(
        "cp2",
        stream="cp2.example.net:7443",
        http="https://cp2.example.net:8080",
        enroll="cp2.example.net:8443",
        ca_hash="",
        client_serial="",
        server_serial="",
        names=["cp2", "cp2.example.net", "api.example.net"],
    )
    answers = call(
        store, ca, [{"node": "cp2.example.net"}, {"node": "api.example.net"}, {"node": "cp2"}]
    )
    for node, (status, data) in zip(
        ("cp2.example.net", "api.example.net", "cp2"), answers, strict=True
    ):
        assert status == 400, data
        assert data["error"]["message"] == (
            f"node_id: invalid node id {node!r}: control-plane instance cp2 answers to that "
            "name (it is "
            "in that instance's TLS certificate), and a node under it could pose as that "
            "instance; give this machine another node id (node_id in its agent.yaml, 'llmgw "
            "ctl join-command --node OTHER-ID')"
        )
    assert store.list_join_tokens(include_inactive=True) == []
    assert call(store, ca, [{"node": "gpu-02"}])[0][0] == 201


def test_a_join_command_only_this_machine_can_run_says_so(store: Store, ca: pki.Authority) -> None:
    assert one(store, ca, {"node": NODE})["warning"] is None  # cp.example.net: reachable
    loopback = one(store, ca, {"node": "gpu-02", "address": "127.0.0.1"})
    assert loopback["enroll_url"] == "https://127.0.0.1:8443"
    assert loopback["warning"].startswith("the command names 127.0.0.1, which only this machine")
    assert "--address HOST" in loopback["warning"]


def test_a_cluster_taking_joins_on_loopback_says_how_to_start_one_others_reach(
    store: Store, ca: pki.Authority
) -> None:
    ctx = context(store, ca, None)
    ctx.enroll_loopback_only = True  # type: ignore[misc]
    app = web.Application()
    app.router.add_post("/api/join-tokens", guarded(ctx, AccessRoutes(ctx).create_join_token))

    async def main() -> dict[str, Any]:
        async with TestClient(TestServer(app)) as client:
            resp = await client.post(
                "/api/join-tokens",
                json={"node": NODE},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            assert resp.status == 201
            data: dict[str, Any] = await resp.json()
            return data

    warning = asyncio.run(main())["warning"]
    assert warning.startswith("this control plane takes joins on loopback only, so no other")
    assert "'llmgw up --host 0.0.0.0'" in warning


def test_require_approval_on_a_fresh_join_is_taken_as_what_a_join_does(
    store: Store, ca: pki.Authority
) -> None:
    """Scripts (bench/fleet.py among them) send it; the API has always taken it. ctl refuses
    the flag with --node (tests/unit/cli/ctl/test_join.py)."""
    data = one(store, ca, {"node": NODE, "require_approval": True})
    token = store.list_join_tokens()[-1]
    assert (data["kind"], token.kind, token.auto_approve) == ("join", "join", False)
    [(status, error)] = call(
        store, ca, [{"node": "gpu-02", "require_approval": True, "auto_approve": True}]
    )
    assert status == 400 and "contradict each other" in error["error"]["message"]
