"""The agent's start-up: each step's failure names the step, and what started is stopped in
the reverse order, whether the agent is stopped or a later step fails."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw import pki
from llmgw.agent.config import AgentConfig, parse_agent_config
from llmgw.agent.dataplane import DataPlane
from llmgw.agent.kvevents import KvEventsHub
from llmgw.agent.service import Agent, step
from llmgw.agent.shards import ShardManager
from llmgw.agent.stream import StreamClient
from llmgw.errors import ConfigError, StartupError, StreamError
from llmgw.proto import control_pb2 as pb


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def config(tmp_path: Path, *, listen: str = "127.0.0.1:0", **extra: Any) -> AgentConfig:
    ca = pki.init_ca(tmp_path / "ca")
    ident = pki.issue_node_cert(ca, "gpu-1", tmp_path / "pki")
    return parse_agent_config(
        {
            # Nothing answers here: the stream keeps retrying, which is all these tests need.
            "server": "127.0.0.1:1",
            "node_id": "gpu-1",
            "listen": listen,
            "state_dir": str(tmp_path / "state"),
            "models_root": str(tmp_path / "models"),
            "discovery": {"ib_root": str(tmp_path / "no-infiniband")},
            "tls": {"cert": str(ident.cert), "key": str(ident.key), "ca": str(ident.ca)},
            **extra,
        }
    )


def start_fails(cfg: AgentConfig) -> tuple[StartupError, Agent]:
    agent = Agent(cfg)
    with pytest.raises(StartupError) as info:
        asyncio.run(asyncio.wait_for(agent.run(), 30))
    return info.value, agent


def test_busy_port_names_the_data_plane_step(
    tmp_path: Path, empty_path: Path, busy_port: int
) -> None:
    err, agent = start_fails(config(tmp_path, listen=f"127.0.0.1:{busy_port}"))
    assert err.step == "data plane listener"
    assert str(err).startswith(
        f"agent start-up failed at 'data plane listener': listen: cannot listen on "
        f"127.0.0.1:{busy_port}: "
    )
    assert str(err).endswith("; free the port or change listen in agent.yaml")
    assert err.exit_code == 2  # the cause's: a configuration to change
    # Not a certificate problem, as it was reported before.
    assert type(err.cause).__name__ == "ConfigError"
    # What started before it was stopped again.
    assert agent.shards is not None and agent.shards._session is None
    assert agent.stream is None


def test_bad_certificate_names_the_identity_step(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(tmp_path)
    cfg.tls.cert.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    err, agent = start_fails(cfg)
    assert err.step == "node identity"
    assert str(err).startswith("agent start-up failed at 'node identity': ")
    assert "rejoin the node" in str(err)
    assert agent.shards is None and agent.dataplane is None  # nothing after it started


def test_missing_certificate_says_to_join(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(tmp_path)
    cfg.tls.cert.unlink()
    err, _ = start_fails(cfg)
    assert str(err) == (
        f"agent start-up failed at 'node identity': the node's cert {cfg.tls.cert} does not "
        "exist; join the node first ('llmgw agent join') or set tls.cert in agent.yaml"
    )
    assert err.exit_code == 1


def test_state_directory_that_cannot_be_made_names_its_step(
    tmp_path: Path, empty_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    cfg = config(tmp_path, state_dir=str(tmp_path / "a-file" / "state"))
    err, agent = start_fails(cfg)
    assert err.step == "state directory"
    assert str(err).startswith(
        f"agent start-up failed at 'state directory': cannot create directory {cfg.state_dir}: "
    )
    assert agent.shards is None


def test_corrupt_operation_log_names_its_step(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(tmp_path)
    cfg.state_dir.mkdir(parents=True)
    (cfg.state_dir / "oplog.json").write_text("{")
    err, agent = start_fails(cfg)
    assert err.step == "operation log"
    assert "the operation log is corrupt; move it aside" in str(err)
    assert agent.shards is None


def test_stops_in_the_reverse_order_of_start_up(
    tmp_path: Path, empty_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []

    def record(cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        async def wrapper(self: object, *args: Any, **kwargs: Any) -> Any:
            order.append(label)
            return await original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    record(ShardManager, "open", "shards open")
    record(ShardManager, "stop_all", "shards stop all")
    record(ShardManager, "close", "shards close")
    record(KvEventsHub, "aclose", "kv events close")
    record(DataPlane, "start", "data plane start")
    record(DataPlane, "drain", "data plane drain")
    record(DataPlane, "stop", "data plane stop")
    record(StreamClient, "run", "stream run")
    record(StreamClient, "close", "stream close")
    agent = Agent(config(tmp_path, stop_shards_on_exit=True))

    async def main() -> None:
        running = asyncio.create_task(agent.run())
        while "stream run" not in order:
            assert not running.done(), running.exception()
            await asyncio.sleep(0.01)
        agent.request_stop()
        await asyncio.wait_for(running, 30)

    asyncio.run(main())
    assert order == [
        "shards open",
        "data plane start",
        "stream run",
        "data plane drain",
        "stream close",
        "data plane stop",
        "shards stop all",
        "shards close",
        # After the shards: stopping them sends each one's cleared through it.
        "kv events close",
    ]


def test_a_new_stream_gets_the_kv_events_snapshot_after_its_hello(tmp_path: Path) -> None:
    agent = Agent(config(tmp_path))
    hub = KvEventsHub(lambda msg: True, state_dir=tmp_path)
    resyncs: list[str] = []
    hub.resync = lambda: resyncs.append("resync")  # type: ignore[method-assign]
    agent.kv_events = hub
    agent._on_stream_state("disconnected", "cp:7443")
    assert resyncs == []
    agent._on_stream_state("connected", "cp:7443")
    assert resyncs == ["resync"]
    # With no stream the hub's sends are refused: dropped, the snapshot covers them.
    assert agent._send(pb.AgentMessage(kv_events=pb.KvEvents(shard_id="s"))) is False


def test_a_step_wraps_our_errors_and_os_errors_keeping_exit_code_and_retryability() -> None:
    with pytest.raises(StartupError) as info, step("operation log"):
        raise ConfigError("the operation log is corrupt; move it aside", file="/s/oplog.json")
    assert str(info.value) == (
        "agent start-up failed at 'operation log': /s/oplog.json: the operation log is corrupt; "
        "move it aside"
    )
    assert (info.value.exit_code, info.value.retryable) == (2, False)
    with pytest.raises(StartupError) as info, step("stream"):
        raise StreamError("no control plane answered; is one running?")
    assert (info.value.exit_code, info.value.retryable) == (1, True)
    with pytest.raises(StartupError) as info, step("state directory"):
        raise PermissionError(13, "Permission denied", "/var/lib/llmgw-agent")
    assert str(info.value) == (
        "agent start-up failed at 'state directory': /var/lib/llmgw-agent: Permission denied; "
        "check that it exists and that the agent's user may use it"
    )
    assert info.value.exit_code == 1
    # A step inside a step is named once, by the innermost.
    with pytest.raises(StartupError) as info, step("outer"), step("inner"):
        raise ConfigError("x")
    assert info.value.step == "inner"
    # What is no error of ours or of the system is a bug: not dressed up as a start-up error.
    with pytest.raises(ZeroDivisionError), step("arithmetic"):
        _ = 1 / 0


def _client_accepted(server_ctx: ssl.SSLContext, client: pki.Identity, trust: Path) -> bool:
    """One TLS connection to a listener of ``server_ctx``: does it take ``client``'s
    certificate?"""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    result: dict[str, bool] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")
                result["ok"] = True
        except (ssl.SSLError, OSError):
            result["ok"] = False

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ctx = ssl.create_default_context(cafile=str(trust))
    ctx.check_hostname = False
    ctx.load_cert_chain(client.cert, client.key)
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="gpu-1") as tls:
                tls.recv(2)
    except (ssl.SSLError, OSError):
        pass
    thread.join(10)
    listener.close()
    return result.get("ok", False)


def test_the_data_plane_trusts_exactly_the_cas_in_the_file_after_a_reload(
    tmp_path: Path,
) -> None:
    """A CA rotation: the new CA joins the data plane's trust, and the dropped one leaves
    it, without a restart (a context only ever adds CAs: the identity swaps contexts)."""
    from llmgw.agent.service import NodeIdentity

    cfg = config(tmp_path)
    identity = NodeIdentity(cfg.tls)
    d = tmp_path / "ca"
    old = pki.load_ca(d)
    old_cp = pki.issue_control_plane_client_cert(old, tmp_path / "cp-old")
    assert _client_accepted(identity.ssl_context, old_cp, cfg.tls.ca)
    pki.rotate_ca(d, overlap=3600)
    new = pki.load_ca(d)
    new_cp = pki.issue_control_plane_client_cert(new, tmp_path / "cp-new")  # no cross-cert
    # The control plane verifies the node's certificate (the old CA's) with its own bundle.
    cp_trust = tmp_path / "cp-trust.crt"
    cp_trust.write_bytes(pki.cert_pem(new.cert) + pki.cert_pem(old.cert))
    assert not _client_accepted(identity.ssl_context, new_cp, cp_trust)
    cfg.tls.ca.write_bytes(pki.cert_pem(new.cert) + pki.cert_pem(old.cert))
    identity.reload()
    assert _client_accepted(identity.ssl_context, new_cp, cp_trust)
    assert _client_accepted(identity.ssl_context, old_cp, cp_trust)
    cfg.tls.ca.write_bytes(pki.cert_pem(new.cert))  # the old CA dropped
    identity.reload()
    assert _client_accepted(identity.ssl_context, new_cp, cp_trust)
    assert not _client_accepted(identity.ssl_context, old_cp, cp_trust)
