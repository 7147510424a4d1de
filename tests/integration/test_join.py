"""Joining nodes end to end, as an operator does it (DESIGN §4).

``llmgw ctl join-command`` mints a token, ``llmgw agent join`` (token in the environment,
never argv) enrols the node over real TLS on loopback, the agent connects as pending, an
operator approves it by fingerprint; then revocation, rekey and renewal over the stream.
Every process is a real ``python -m llmgw`` subprocess; every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import netaddr, pki
from llmgw.agent.join import join
from llmgw.errors import ConfigError, EnrolmentError, PinMismatch, TokenError
from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

WAIT = 30.0
CLI_TIMEOUT = 60.0
WRONG_FP = "sha256:" + "0" * 64


# --------------------------------------------------------------------------- helpers


def _base_env(tmp: Path) -> dict[str, str]:
    """This environment without any LLMGW_* setting that could leak in from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.pop("JOURNAL_STREAM", None)
    env["XDG_CONFIG_HOME"] = str(tmp / "xdg")  # no operator's ctl.yaml
    return env


def ctl(server: Server, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = _base_env(tmp)
    env.update(LLMGW_SERVER=server.url, LLMGW_TOKEN=server.admin_token)
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT
    )


def ctl_json(server: Server, tmp: Path, *args: str) -> Any:
    out = ctl(server, tmp, "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@dataclass(frozen=True)
class JoinCommand:
    """What ``llmgw ctl join-command --json`` printed, its command split into its parts."""

    id: str
    node: str
    kind: str
    token: str
    enroll_url: str
    ca_hash: str
    rekey: bool
    node_uid: str | None = None


def join_command(
    server: Server, tmp: Path, node_id: str, *, rekey: bool = False, lost_state: bool = False
) -> JoinCommand:
    extra = ["--re-pair"] if lost_state else []
    data = ctl_json(server, tmp, "join-command", "--rekey" if rekey else "--node", node_id, *extra)
    words = shlex.split(data["command"])
    # LLMGW_JOIN_TOKEN=… llmgw agent join --node-id N --enroll-url U --ca-hash H [--rekey]
    # (a lost-state re-pair: --node-uid UID instead of --rekey)
    assert words[0].startswith("LLMGW_JOIN_TOKEN=")
    assert words[1:4] == ["llmgw", "agent", "join"]
    opts = dict(zip(words[4::2], words[5::2], strict=False))
    assert opts["--node-id"] == node_id
    assert ("--rekey" in words) == (rekey and not lost_state)
    assert opts.get("--node-uid") == data["node_uid"]
    assert (data["node_uid"] is not None) == lost_state
    token = words[0].split("=", 1)[1]
    assert token == data["token"]
    assert opts["--enroll-url"] == data["enroll_url"]
    assert opts["--ca-hash"] == data["ca_hash"]
    return JoinCommand(
        id=data["id"],
        node=node_id,
        kind=data["kind"],
        token=token,
        enroll_url=opts["--enroll-url"],
        ca_hash=opts["--ca-hash"],
        rekey=rekey and not lost_state,
        node_uid=opts.get("--node-uid"),
    )


@dataclass
class JoinRun:
    returncode: int
    stdout: str
    stderr: str
    cmdlines: list[str] = field(default_factory=list)

    @property
    def fingerprint(self) -> str:
        for line in self.stdout.splitlines():
            if line.startswith("fingerprint: "):
                return line.split(": ", 1)[1].strip()
        raise AssertionError(f"no fingerprint line in:\n{self.stdout}\n{self.stderr}")


def agent_join(
    tmp: Path,
    cmd: JoinCommand,
    *,
    config: Path,
    state_dir: Path | None = None,
    node_id: str | None = None,
    ca_hash: str | None = None,
    token: str | None = None,
    rekey: bool | None = None,
    node_uid: str | None = None,
) -> JoinRun:
    """``llmgw agent join`` as a subprocess with the token in LLMGW_JOIN_TOKEN only; reads
    /proc/PID/cmdline while it runs."""
    argv = [
        *LLMGW,
        "agent",
        "join",
        "--node-id",
        node_id or cmd.node,
        "--enroll-url",
        cmd.enroll_url,
        "--ca-hash",
        ca_hash or cmd.ca_hash,
        "--config",
        str(config),
    ]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    if cmd.rekey if rekey is None else rekey:
        argv.append("--rekey")
    if node_uid is not None:
        argv += ["--node-uid", node_uid]
    env = _base_env(tmp)
    env["LLMGW_JOIN_TOKEN"] = token or cmd.token
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    cmdlines: list[str] = []
    deadline = time.monotonic() + CLI_TIMEOUT
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                raw = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            except OSError:
                break
            if raw:
                cmdlines.append(raw.replace(b"\0", b" ").decode(errors="replace"))
            time.sleep(0.01)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return JoinRun(proc.returncode, stdout, stderr, cmdlines)


def prepare_config(config: Path) -> dict[str, Any]:
    """The agent.yaml the join wrote, made fit for a test: data plane on a free loopback
    port, engines stopped with the agent. Everything else stays as the join wrote it."""
    data = yaml.safe_load(config.read_text())
    data["listen"] = "127.0.0.1:0"
    data["stop_shards_on_exit"] = True
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def node(server: Server, node_id: str) -> dict[str, Any] | None:
    return next((n for n in server.nodes() if n["id"] == node_id), None)


def serial_of(path: Path) -> str:
    return pki.serial_hex(x509.load_pem_x509_certificate(path.read_bytes()))


def identity_bytes(state: Path) -> dict[str, bytes]:
    return {
        name: (state / name).read_bytes()
        for name in ("node.key", "node.crt", "ca.crt", "node.uid", "node.key.old", "node.crt.old")
        if (state / name).exists()
    }


def ready_replica(server: Server, model: str) -> dict[str, Any]:
    return wait_for(
        lambda: next((r for r in server.replicas(model) if r["state"] == "ready"), None),
        timeout=WAIT,
        what=f"a ready replica of {model}",
    )


def complete(server: Server, key: str, model: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    content = out.choices[0].message.content
    assert content
    return content


def dataplane_cert(server: Server, port: int) -> x509.Certificate:
    """The certificate a fresh TLS connection to the agent's data plane presents, as the
    gateway sees it (its client certificate, the cluster CA)."""
    ctx = ssl.create_default_context(cafile=str(server.pki_dir / "ca.crt"))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(server.pki_dir / "client.crt"), str(server.pki_dir / "client.key"))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der
    return x509.load_der_x509_certificate(der)


def dataplane_port(server: Server, node_id: str) -> int:
    n = node(server, node_id)
    assert n is not None and n["dataplane_addr"]
    return int(str(n["dataplane_addr"]).rsplit(":", 1)[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class Node:
    """A node joined through the CLI, with its agent."""

    id: str
    dir: Path
    config: Path
    state: Path
    fingerprint: str
    agent: Agent

    @property
    def pid(self) -> int:
        assert self.agent.proc is not None
        return self.agent.proc.pid

    def alive(self) -> bool:
        return self.agent.proc is not None and self.agent.proc.poll() is None


class Nodes:
    """Agents a test started; stopped afterwards whatever happened."""

    def __init__(self) -> None:
        self.started: list[Node] = []

    def join_and_start(
        self, server: Server, tmp: Path, node_id: str, *, sub: str | None = None
    ) -> Node:
        d = tmp / (sub or node_id)
        d.mkdir(parents=True, exist_ok=True)
        config, state = d / "agent.yaml", d / "state"
        # Set-up only (the CLI path is under test elsewhere): the admin API and the join
        # library against the real enrolment endpoint, which saves two interpreter starts.
        token = server.api("POST", "/api/join-tokens", {"node": node_id})
        result = join(
            node_id=node_id,
            enroll_url=token["enroll_url"],
            ca_hash=token["ca_hash"],
            token=token["token"],
            config_path=config,
            state_dir=state,
        )
        assert result.state == "pending" and result.config_written
        prepare_config(config)
        agent = Agent(node_id, d, config, 0)
        n = Node(node_id, d, config, state, result.fingerprint, agent)
        self.started.append(n)
        start_agent(agent)
        return n

    def stop(self, n: Node) -> None:
        if n.agent.proc is not None:
            stop_process(n.agent.proc)

    def stop_all(self) -> None:
        for n in self.started:
            self.stop(n)


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    started = Nodes()
    try:
        yield started
    finally:
        started.stop_all()


def wait_connected(server: Server, n: Node, *, state: str | None = None) -> dict[str, Any]:
    """The node's entry once its agent is connected (in ``state``); fails at once if the
    agent died."""

    def connected() -> dict[str, Any] | None:
        assert n.alive(), f"agent of {n.id} exited:\n{n.agent.log()[-3000:]}"
        got = node(server, n.id)
        if got and got["connected"] and (state is None or got["state"] == state):
            return got
        return None

    return wait_for(connected, timeout=WAIT, what=f"{n.id} connected")


def approved_with_replica(
    server: Server, tmp: Path, nodes: Nodes, node_id: str, model: str
) -> tuple[Node, dict[str, Any]]:
    """A node joined, started, approved, running the one ready replica of ``model``."""
    n = nodes.join_and_start(server, tmp, node_id)
    wait_connected(server, n, state="pending")
    server.api("POST", f"/api/nodes/{node_id}/approve", {"fingerprint": n.fingerprint})
    server.api("POST", "/api/models", {"name": model, "engine": "sim", "replicas": 1})
    replica = ready_replica(server, model)
    assert replica["node"] == node_id
    return n, replica


# --------------------------------------------------------------------------- 1. the whole flow


def test_operator_joins_a_node_and_approves_it_by_fingerprint(
    server: Server, tmp_path: Path, nodes: Nodes
) -> None:
    cmd = join_command(server, tmp_path, "gpu-01")
    assert cmd.kind == "join" and cmd.enroll_url.startswith("https://127.0.0.1:")
    d = tmp_path / "gpu-01"
    config, state = d / "agent.yaml", d / "state"

    run = agent_join(tmp_path, cmd, config=config, state_dir=state)
    assert run.returncode == 0, run.stderr
    # The token travelled in the environment only: never on the command line, never echoed.
    assert run.cmdlines, "could not read the join's /proc/PID/cmdline while it ran"
    assert all("agent join" in c and cmd.token not in c for c in run.cmdlines), run.cmdlines
    assert cmd.token not in run.stdout + run.stderr
    fp = run.fingerprint
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    assert f"llmgw ctl approve gpu-01 --fingerprint {fp}" in run.stdout
    assert "state: pending" in run.stdout
    # The key was made here: the fingerprint is the one of the key on disk.
    key = serialization.load_pem_private_key((state / "node.key").read_bytes(), None)
    assert pki.fingerprint(key.public_key()) == fp
    assert (state / "node.key").stat().st_mode & 0o777 == 0o600

    written = prepare_config(config)
    assert written["node_id"] == "gpu-01"
    assert written["state_dir"] == str(state)
    assert written["server"] == f"127.0.0.1:{server.grpc_port}"
    agent = Agent("gpu-01", d, config, 0)
    n = Node("gpu-01", d, config, state, fp, agent)
    nodes.started.append(n)
    start_agent(agent)
    agent_pid = n.pid

    wait_connected(server, n)
    listed = ctl(server, tmp_path, "nodes")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("gpu-01 "))
    assert row.split()[1:4] == ["pending", "healthy", "yes"], row  # STATE HEALTH CONNECTED
    assert fp in row, row  # the whole fingerprint while pending, to compare
    assert "in 30d" in row, row  # the certificate's expiry
    as_json = {x["id"]: x for x in ctl_json(server, tmp_path, "nodes")}["gpu-01"]
    assert as_json["state"] == "pending" and as_json["fingerprint"] == fp
    assert as_json["cert_serial"] == serial_of(state / "node.crt")
    assert abs(as_json["cert_expires_at"] - (time.time() + 30 * 86400)) < 600

    # A pending node gets no work.
    deployed = ctl(server, tmp_path, "deploy", "m", "--replicas", "1")
    assert deployed.returncode == 0, deployed.stderr
    wait_for(
        lambda: "gpu-01: pending" in (server.api("GET", "/api/models")[0]["unplaceable"] or ""),
        timeout=WAIT,
        what="the unplaceable reason naming the pending node",
    )
    models = ctl(server, tmp_path, "models")
    assert "gpu-01: pending" in models.stdout, models.stdout
    assert server.replicas("m") == []

    # The wrong fingerprint is refused and changes nothing.
    wrong = ctl(server, tmp_path, "approve", "gpu-01", "--fingerprint", WRONG_FP)
    assert wrong.returncode == 1
    assert "does not match" in wrong.stderr, wrong.stderr
    assert (node(server, "gpu-01") or {})["state"] == "pending"
    assert server.replicas("m") == []

    # The right one: the replica starts on the live stream, the agent is the same process.
    ok = ctl(server, tmp_path, "approve", "gpu-01", "--fingerprint", fp)
    assert ok.returncode == 0, ok.stderr
    replica = ready_replica(server, "m")
    assert replica["node"] == "gpu-01"
    assert n.alive() and n.pid == agent_pid
    assert n.agent.log().count("connected to the control plane") == 1  # the same stream
    assert complete(server, server.api_key(), "m")
    assert (node(server, "gpu-01") or {})["state"] == "approved"
    kinds = [e["kind"] for e in server.api("GET", "/api/events?subject=gpu-01")]
    assert {"node_enrolled", "node_approved"} <= set(kinds)


# --------------------------------------------------------------------------- 2. tokens


def test_a_revoked_token_is_listed_and_refused(server: Server, tmp_path: Path) -> None:
    cmd = join_command(server, tmp_path, "gpu-07")
    listed = ctl(server, tmp_path, "tokens")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(cmd.id))
    assert row.split()[1:3] == ["gpu-07", "join"] and row.endswith("active"), row
    assert cmd.token not in listed.stdout  # only the prefix is ever shown

    revoked = ctl(server, tmp_path, "tokens", "revoke", cmd.id)
    assert revoked.returncode == 0, revoked.stderr
    assert f"revoked join token {cmd.id} for node gpu-07" in revoked.stdout
    assert cmd.id not in ctl(server, tmp_path, "tokens").stdout
    everything = {t["id"]: t for t in ctl_json(server, tmp_path, "tokens", "--all")}
    assert everything[cmd.id]["revoked_at"] is not None and not everything[cmd.id]["active"]

    state = tmp_path / "gpu-07" / "state"
    run = agent_join(tmp_path, cmd, config=tmp_path / "gpu-07" / "agent.yaml", state_dir=state)
    assert run.returncode == 1
    assert "was revoked" in run.stderr and "(token_revoked)" in run.stderr, run.stderr
    assert not (state / "node.key").exists()
    assert not (tmp_path / "gpu-07" / "agent.yaml").exists()
    assert node(server, "gpu-07") is None


def test_node_ids_the_control_plane_answers_to_get_no_token(tmp_path: Path) -> None:
    """A node under the control plane's own name (its advertise name, its host name) would hold
    a certificate for that name: no token is minted for one, by the CLI or the admin API."""
    server = start_server_with(tmp_path, advertise=["cp-adv.example"])
    try:
        names = pki.control_plane_names(pki.load_cert(server.pki_dir / "server.crt"))
        assert {"cp-adv.example", netaddr.CONTROL_PLANE_NAME} <= names
        refused = ctl(server, tmp_path, "join-command", "--node", "cp-adv.example")
        assert refused.returncode != 0
        assert "invalid node id 'cp-adv.example': the control plane answers to that name" in (
            refused.stderr
        ), refused.stderr
        assert "could pose as the control plane" in refused.stderr

        host = socket.gethostname().lower()
        with pytest.raises(urllib.error.HTTPError) as info:
            server.api("POST", "/api/join-tokens", {"node": host})
        assert info.value.code == 400
        message = json.loads(info.value.read())["error"]["message"]
        try:
            netaddr.validate_node_id(host)
        except ConfigError:
            pass  # not a node id at all: refused for that, which is fine
        else:
            assert "the control plane answers to that name" in message, message
        assert server.api("GET", "/api/join-tokens") == []
        assert ctl(server, tmp_path, "join-command", "--node", "gpu-1").returncode == 0
    finally:
        stop_process(server.proc)


# --------------------------------------------------------------------------- 3. bad input


def test_bad_pins_and_misused_tokens_are_refused(server: Server, tmp_path: Path) -> None:
    cmd = join_command(server, tmp_path, "gpu-03")

    def lib_join(
        name: str,
        *,
        token: str,
        node_id: str = "gpu-03",
        pin: str = cmd.ca_hash,
        rekey: bool = False,
    ) -> Any:
        d = tmp_path / name
        return join(
            node_id=node_id,
            enroll_url=cmd.enroll_url,
            ca_hash=pin,
            token=token,
            config_path=d / "agent.yaml",
            state_dir=d / "state",
            rekey=rekey,
        )

    def refused(kind: type[EnrolmentError], code: str, name: str, **kw: Any) -> str:
        """The message of the refusal ``lib_join(name, **kw)`` must end in."""
        with pytest.raises(kind) as info:
            lib_join(name, **kw)
        assert info.value.code == code, str(info.value)
        return str(info.value)

    # A CA that is not the pinned one: refused before the token goes out.
    message = refused(
        PinMismatch, "ca_pin_mismatch", "wrong-pin", token=cmd.token, pin="sha256:" + "ab" * 32
    )
    assert "the token was NOT sent" in message
    assert not (tmp_path / "wrong-pin").exists()
    tokens = {t["id"]: t for t in server.api("GET", "/api/join-tokens")}
    assert tokens[cmd.id]["active"] and tokens[cmd.id]["used_at"] is None

    # A malformed pin, through the CLI.
    bad = agent_join(tmp_path, cmd, config=tmp_path / "x" / "agent.yaml", ca_hash="sha256:xyz")
    assert bad.returncode != 0
    assert "is not a CA hash" in bad.stderr, bad.stderr
    assert not (tmp_path / "x").exists()
    refused(EnrolmentError, "ca_pin_malformed", "y", token=cmd.token, pin="md5:" + "0" * 32)

    # The token is still good: the correct join succeeds with it.
    first = lib_join("good", token=cmd.token)
    assert first.state == "pending" and first.node_id == "gpu-03"
    assert (tmp_path / "good" / "state" / "node.key").exists()

    # Used twice: the second is refused.
    refused(TokenError, "token_used", "again", token=cmd.token)
    assert not (tmp_path / "again" / "state" / "node.key").exists()

    # A token minted for another node.
    other = join_command(server, tmp_path, "gpu-04")
    message = refused(TokenError, "token_wrong_node", "wrong-node", token=other.token)
    assert "is for node gpu-04, not gpu-03" in message

    # A rekey token used for a join, and a join token used for a rekey.
    rekey = join_command(server, tmp_path, "gpu-03", rekey=True)
    message = refused(TokenError, "token_wrong_kind", "rekey-as-join", token=rekey.token)
    assert "run 'llmgw agent join --rekey'" in message
    assert not (tmp_path / "rekey-as-join" / "state" / "node.key").exists()
    good = tmp_path / "good" / "state"
    before = identity_bytes(good)
    fresh = join_command(server, tmp_path, "gpu-03")
    message = refused(TokenError, "token_wrong_kind", "good", token=fresh.token, rekey=True)
    assert "not a rekey token" in message
    assert identity_bytes(good) == before
    # None of the refused tokens was spent.
    active = {t["id"] for t in server.api("GET", "/api/join-tokens")}
    assert {other.id, rekey.id, fresh.id} <= active


# --------------------------------------------------------------------------- 4. revocation


def test_revoked_node_is_cut_and_comes_back_only_through_a_fresh_join(
    server: Server, tmp_path: Path, nodes: Nodes
) -> None:
    n, replica = approved_with_replica(server, tmp_path, nodes, "gpu-01", "m")
    serial = serial_of(n.state / "node.crt")

    out = ctl(server, tmp_path, "revoke", "gpu-01")
    assert out.returncode == 0, out.stderr
    assert serial in out.stdout and "fresh join" in out.stdout

    def cut() -> dict[str, Any] | None:
        got = node(server, "gpu-01") or {}
        return got if not got["connected"] and got["state"] == "revoked" else None

    wait_for(cut, timeout=5, interval=0.1, what="the revoked node cut")
    as_json = {x["id"]: x for x in ctl_json(server, tmp_path, "nodes")}["gpu-01"]
    assert as_json["state"] == "revoked" and as_json["connected"] is False
    # The agent keeps trying and is refused, naming the revocation.
    wait_for(
        lambda: [
            line
            for line in n.agent.log().splitlines()
            if "reconnecting" in line and "revoked" in line and "refused" in line
        ],
        timeout=WAIT,
        what="a refused reconnect in the agent's log",
    )
    assert n.alive()
    assert (node(server, "gpu-01") or {})["connected"] is False
    # Its replica is gone from the node (the only one: it cannot be rebuilt elsewhere).
    assert all(r["shard"] != replica["shard"] for r in server.replicas("m"))
    wait_for(
        lambda: "gpu-01: revoked" in (server.api("GET", "/api/models")[0]["unplaceable"] or ""),
        timeout=WAIT,
        what="the unplaceable reason naming the revoked node",
    )

    # The control plane recorded the refusals too.
    refused = [
        e
        for e in server.api("GET", "/api/events?subject=gpu-01")
        if e["kind"] == "stream_refused" and "revoked" in e["message"]
    ]
    assert refused and serial in refused[0]["message"]
    # A rekey cannot bring it back either.
    no_rekey = ctl(server, tmp_path, "join-command", "--rekey", "gpu-01")
    assert no_rekey.returncode == 1 and "revoked" in no_rekey.stderr, no_rekey.stderr

    # A fresh join (a new identity, on this machine a new state directory) brings it back,
    # as pending; the old identity stays refused.
    back = nodes.join_and_start(server, tmp_path, "gpu-01", sub="gpu-01-again")
    assert back.fingerprint != n.fingerprint
    got = wait_connected(server, back, state="pending")
    assert got["fingerprint"] == back.fingerprint
    assert got["cert_serial"] == serial_of(back.state / "node.crt") != serial
    # The old agent, still retrying with its revoked certificate, never takes the node back.
    assert n.alive()
    time.sleep(1.0)
    got = node(server, "gpu-01") or {}
    assert got["fingerprint"] == back.fingerprint and got["state"] == "pending"


def test_revoking_a_node_stops_its_engines(server: Server, tmp_path: Path, nodes: Nodes) -> None:
    n, replica = approved_with_replica(server, tmp_path, nodes, "gpu-01", "m")
    assert pid_alive(replica["pid"])
    assert ctl(server, tmp_path, "revoke", "gpu-01").returncode == 0
    wait_for(
        lambda: not pid_alive(replica["pid"]),
        timeout=5,
        what=f"engine {replica['pid']} of the revoked node to stop",
    )
    assert n.alive()


# --------------------------------------------------------------------------- 5. rekey


def test_rekey_replaces_the_key_keeps_the_uid_and_the_shard(
    server: Server, tmp_path: Path, nodes: Nodes
) -> None:
    n, replica = approved_with_replica(server, tmp_path, nodes, "gpu-01", "m")
    uid = (n.state / "node.uid").read_text()
    before = identity_bytes(n.state)
    old_serial = serial_of(n.state / "node.crt")
    assert (node(server, "gpu-01") or {})["cert_serial"] == old_serial
    connects = n.agent.log().count("connected to the control plane")

    cmd = join_command(server, tmp_path, "gpu-01", rekey=True)
    assert cmd.kind == "rekey"
    run = agent_join(tmp_path, cmd, config=n.config)
    assert run.returncode == 0, run.stderr
    assert "rekeyed" in run.stdout
    assert (n.state / "node.uid").read_text() == uid
    after = identity_bytes(n.state)
    assert after["node.key"] != before["node.key"]
    assert after["node.crt"] != before["node.crt"]
    assert after["ca.crt"] == before["ca.crt"]
    assert after["node.key.old"] == before["node.key"]
    assert after["node.crt.old"] == before["node.crt"]
    new_serial = serial_of(n.state / "node.crt")
    assert run.fingerprint != n.fingerprint

    def reconnected() -> dict[str, Any] | None:
        got = {x["id"]: x for x in server.nodes()}["gpu-01"]
        return (
            got
            if got["connected"] and n.agent.log().count("connected to the control plane") > connects
            else None
        )

    got = wait_for(reconnected, timeout=WAIT, what="the agent back with its new certificate")
    as_json = {x["id"]: x for x in ctl_json(server, tmp_path, "nodes")}["gpu-01"]
    assert as_json["state"] == "approved"
    assert as_json["uid"] == got["uid"] == uid.strip()
    assert as_json["cert_serial"] == new_serial != old_serial
    assert as_json["fingerprint"] == run.fingerprint
    assert n.alive()
    again = ready_replica(server, "m")
    assert again["shard"] == replica["shard"] and again["pid"] == replica["pid"]
    assert complete(server, server.api_key(), "m")

    # A rekey that fails (the token was used) leaves the identity byte for byte as it was.
    snapshot = identity_bytes(n.state)
    failed = agent_join(tmp_path, cmd, config=n.config)
    assert failed.returncode == 1
    assert "(token_used)" in failed.stderr, failed.stderr
    assert identity_bytes(n.state) == snapshot


def test_after_a_rekey_new_dataplane_connections_present_the_new_certificate(
    server: Server, tmp_path: Path, nodes: Nodes
) -> None:
    n, _ = approved_with_replica(server, tmp_path, nodes, "gpu-01", "m")
    port = dataplane_port(server, "gpu-01")
    old_serial = serial_of(n.state / "node.crt")
    assert pki.serial_hex(dataplane_cert(server, port)) == old_serial
    connects = n.agent.log().count("connected to the control plane")
    run = agent_join(
        tmp_path, join_command(server, tmp_path, "gpu-01", rekey=True), config=n.config
    )
    assert run.returncode == 0, run.stderr
    new_serial = serial_of(n.state / "node.crt")
    wait_for(
        lambda: n.agent.log().count("connected to the control plane") > connects,
        timeout=WAIT,
        what="the agent back on the stream",
    )
    assert n.alive()
    wait_for(
        lambda: pki.serial_hex(dataplane_cert(server, port)) == new_serial,
        timeout=3,
        what=f"the data plane to present certificate {new_serial}, not the revoked {old_serial}",
    )


def test_a_node_that_lost_its_state_directory_re_pairs_as_the_same_node(
    server: Server, tmp_path: Path, nodes: Nodes
) -> None:
    n, replica = approved_with_replica(server, tmp_path, nodes, "gpu-01", "m")
    before = node(server, "gpu-01") or {}
    uid = (n.state / "node.uid").read_text().strip()
    nodes.stop(n)
    shutil.rmtree(n.state)  # the disk was replaced; agent.yaml survived

    # A plain rekey token needs the old identity: refused, and the token stays unspent.
    plain = join_command(server, tmp_path, "gpu-01", rekey=True)
    run = agent_join(tmp_path, plain, config=n.config, rekey=False, node_uid=uid)
    assert run.returncode == 1
    assert "(token_needs_old_key)" in run.stderr, run.stderr
    assert "'llmgw ctl join-command --rekey gpu-01 --re-pair'" in run.stderr
    assert not n.state.exists() or not (n.state / "node.uid").exists()

    cmd = join_command(server, tmp_path, "gpu-01", rekey=True, lost_state=True)
    assert cmd.node_uid == uid
    # Another uid than the token's is refused, saying which to give.
    wrong = agent_join(tmp_path, cmd, config=n.config, node_uid="f" * 32)
    assert wrong.returncode == 1
    assert f"give --node-uid {uid}" in wrong.stderr, wrong.stderr
    run = agent_join(tmp_path, cmd, config=n.config, node_uid=cmd.node_uid)
    assert run.returncode == 0, run.stderr
    assert f"node gpu-01 re-paired (uid {uid})" in run.stdout
    assert "state: pending" in run.stdout
    assert (n.state / "node.uid").read_text().strip() == uid
    # The token is spent: a second re-pair with it is refused.
    again = agent_join(tmp_path, cmd, config=n.config, node_uid=uid)
    assert again.returncode == 1 and "already has an identity" not in again.stderr
    assert "still has its identity" in again.stderr

    start_agent(n.agent)
    got = wait_connected(server, n, state="pending")
    assert got["uid"] == uid and got["fingerprint"] == run.fingerprint
    assert got["uid"] == before["uid"]
    events = ctl_json(server, tmp_path, "events", "--subject", "gpu-01", "--limit", "1000")
    kinds = [e["kind"] for e in events]
    assert "node_repaired" in kinds and "node_enrolled" in kinds  # the history is kept
    # Approved by its new fingerprint, it takes work again.
    wrong_fp = ctl(server, tmp_path, "approve", "gpu-01", "--fingerprint", n.fingerprint)
    assert wrong_fp.returncode != 0
    approve = ctl(server, tmp_path, "approve", "gpu-01", "--fingerprint", run.fingerprint)
    assert approve.returncode == 0, approve.stderr
    again_ready = ready_replica(server, "m")
    assert again_ready["node"] == "gpu-01"
    assert complete(server, server.api_key(), "m")
    del replica


# --------------------------------------------------------------------------- 6. junk
# (before the renewal tests: their node renews in the background until the module ends)


def test_junk_on_the_enrolment_port_is_refused_and_joins_still_work(
    server: Server, tmp_path: Path
) -> None:
    cmd = join_command(server, tmp_path, "gpu-05")
    port = int(cmd.enroll_url.rsplit(":", 1)[1])

    # Plain HTTP on the TLS port: the connection is closed without an answer.
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/enroll/ca", timeout=5)
    # A client that speaks no TLS, only garbage: closed (at most a TLS alert comes back).
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(os.urandom(512))
            try:
                data = s.recv(4096)
            except ConnectionError:
                data = b""
        assert data == b"" or data[:1] == b"\x15", data[:64]  # 0x15: a TLS alert record
    # Garbage inside a good TLS session: a 400, no certificate, no enrolment.
    ctx = ssl.create_default_context(cafile=str(server.pki_dir / "ca.crt"))
    ctx.check_hostname = False
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        tls.sendall(b"\x00\xff garbage \r\n\r\n")
        reply = tls.recv(4096)
    assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n", 1)[0], reply[:200]

    # The server is unharmed: a good join works.
    state = tmp_path / "gpu-05" / "state"
    run = agent_join(tmp_path, cmd, config=tmp_path / "gpu-05" / "agent.yaml", state_dir=state)
    assert run.returncode == 0, run.stderr
    assert (state / "node.key").exists()
    assert server.proc.poll() is None
    tokens = {t["id"]: t for t in server.api("GET", "/api/join-tokens?all=1")}
    assert tokens[cmd.id]["used_at"] is not None


# --------------------------------------------------------------------------- 7. renewal

LIFETIME = 12.0  # seconds a node certificate lives on the renewal test's control plane


@dataclass
class Renewing:
    """A control plane issuing LIFETIME-second certificates and a node joined to it, approved,
    running the one ready replica of "m"."""

    server: Server
    node: Node
    replica: dict[str, Any]
    first_crt: bytes
    first_serial: str
    started: float  # when the agent was started (time.time())

    def renewals(self, since: float = 0.0) -> list[dict[str, Any]]:
        events = self.server.api("GET", "/api/events?subject=gpu-01&limit=1000")
        return [e for e in events if e["kind"] == "cert_renewed" and e["ts"] >= since]


@pytest.fixture(scope="module")
def renewing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Renewing]:
    tmp = tmp_path_factory.mktemp("renewal")
    srv = start_server_with(tmp, cert_lifetime=LIFETIME)
    agents = Nodes()
    try:
        t0 = time.time()
        n, replica = approved_with_replica(srv, tmp, agents, "gpu-01", "m")
        crt = (n.state / "node.crt").read_bytes()
        yield Renewing(srv, n, replica, crt, serial_of(n.state / "node.crt"), t0)
    finally:
        agents.stop_all()
        stop_process(srv.proc)


def test_a_short_lived_certificate_renews_at_two_thirds_of_its_life(renewing: Renewing) -> None:
    # Due 2/3 * 12 s = 8 s after it was issued: well within 20 s of the agent's start.
    deadline = renewing.started + 20.0
    first = wait_for(
        renewing.renewals,
        timeout=max(0.5, deadline - time.time()),
        interval=0.2,
        what=f"a renewal of a {LIFETIME:g} s certificate",
    )
    # And at that cadence, not back to back: a renewed certificate lives LIFETIME again.
    window_start = max(e["ts"] for e in first)
    time.sleep(4.0)
    burst = renewing.renewals(since=window_start + 0.001)
    assert len(burst) <= 1, f"{len(burst)} renewals within 4 s of a {LIFETIME:g} s certificate"


def test_certificates_renew_over_the_stream_without_touching_the_shard(
    renewing: Renewing,
) -> None:
    server, n = renewing.server, renewing.node
    key = server.api_key()
    # The renewal must come before long (45 s leaves room for the agent's 30 s retry).
    wait_for(
        renewing.renewals,
        timeout=max(0.5, renewing.started + 45.0 - time.time()),
        interval=0.2,
        what="a cert_renewed event",
    )
    wait_for(
        lambda: (n.state / "node.crt").read_bytes() != renewing.first_crt,
        timeout=WAIT,
        what="node.crt replaced on disk",
    )
    got = node(server, "gpu-01") or {}
    assert got["cert_serial"] != renewing.first_serial
    assert got["state"] == "approved" and got["connected"]
    # The renewed certificate is for a new key made on the node, from the same CA.
    renewed = x509.load_pem_x509_certificate((n.state / "node.crt").read_bytes())
    assert pki.cert_common_name(renewed) == "gpu-01"
    assert pki.fingerprint(renewed.public_key()) != n.fingerprint
    assert (n.state / "node.crt.old").exists() and (n.state / "node.key.old").exists()
    # The engine was not touched, the agent is the same process.
    assert n.alive()
    again = ready_replica(server, "m")
    assert again["shard"] == renewing.replica["shard"]
    assert again["pid"] == renewing.replica["pid"]
    # New data-plane connections present a renewed certificate, and traffic flows.
    presented = dataplane_cert(server, dataplane_port(server, "gpu-01"))
    assert pki.serial_hex(presented) != renewing.first_serial
    assert pki.cert_common_name(presented) == "gpu-01"
    for _ in range(3):
        assert complete(server, key, "m")
