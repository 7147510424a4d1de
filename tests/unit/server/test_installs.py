"""Desired engines (llmgw.server.fleet.installs) on a real store with sessions as the stream keeps
them: what an operator may record and each refusal, the order each approved stream gets (the
build of its architecture, once per stream, re-sent on a reconnect without losing a checked
install), the answers, what placement is told to wait for and why, and the per-node view."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmgw.contracts.install_order import canonical_arch, display_url
from llmgw.errors import ConfigError, NotFound
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.installs import Build, EngineInstalls
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.store import Store
from llmgw.server.store.states import InstallState, NodeState

X86, ARM = "a" * 64, "b" * 64
URL_X86 = "https://pub.example/llama-b1-x64.tar.gz"
URL_ARM = "https://pub.example/llama-b1-arm64.tar.gz"


class Fleet:
    """Nodes in the store and their live streams, as llmgw.server.fleet.sessions keeps them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.live: dict[str, NodeSession] = {}
        self.installs = EngineInstalls(store, sessions=self.live, epoch=3)

    def node(
        self,
        node_id: str,
        *,
        arch: str = "x86_64",
        engines: tuple[str, ...] = ("sim",),
        state: NodeState = NodeState.APPROVED,
        connect: bool = True,
        details: list[dict[str, Any]] | None = None,
    ) -> NodeSession | None:
        self.store.upsert_node(
            node_id,
            dataplane_addr="127.0.0.1:9443",
            agent_version="0.1.0",
            inventory={"arch": arch, "engines": list(engines), "engine_details": details or []},
            connected=connect,
        )
        self.store.set_node_state(node_id, state)
        if not connect:
            return None
        session = NodeSession(
            node_id=node_id,
            dataplane_addr="127.0.0.1:9443",
            epoch=3,
            engines=frozenset(engines),
            approved=state == NodeState.APPROVED,
        )
        self.live[node_id] = session
        return session

    def desire(self, node: str | None = None, **kw: Any) -> dict[str, Any]:
        args: dict[str, Any] = {
            "engine": "llamacpp",
            "version": "b1",
            "builds": [
                Build.checked("x86_64", URL_X86, X86),
                Build.checked("aarch64", URL_ARM, ARM),
            ],
            "node": node,
        }
        args.update(kw)
        return self.installs.desire(**args, actor="operator")


def orders(session: NodeSession) -> list[pb.InstallEngine]:
    out = []
    while not session.queue.empty():
        msg = session.queue.get_nowait()
        assert msg is not None and msg.WhichOneof("msg") == "install_engine"
        out.append(msg.install_engine)
    return out


def answer(fleet: Fleet, session: NodeSession, order: pb.InstallEngine, error: str = "") -> bool:
    result = pb.OperationResult(op_id=order.meta.op_id, ok=not error, error=error)
    return fleet.installs.on_result(session, result)


@pytest.fixture
def fleet(store: Store) -> Fleet:
    return Fleet(store)


# -- what may be recorded ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "url", "sha", "message"),
    [
        (
            "",
            "ftp://pub.example/x.tar.gz",
            X86,
            "the nodes do not fetch 'ftp://pub.example/x.tar.gz': give an https:// URL (or "
            "http:// or file:// from a place the nodes list in install_sources in agent.yaml), "
            "at most 4096 characters, without spaces",
        ),
        (
            "",
            "https:///x.tar.gz",
            X86,
            "'https:///x.tar.gz' names no host; give the full URL",
        ),
        ("", "https://[::1/x.tgz", X86, "'https://[::1/x.tgz' names no host; give the full URL"),
        (
            "",
            "https://h/x\x00.tgz",
            X86,
            "the nodes do not fetch 'https://h/x\\x00.tgz': give an https:// URL (or "
            "http:// or file:// from a place the nodes list in install_sources in agent.yaml), "
            "at most 4096 characters, without spaces",
        ),
        # Accepted here before the install-order contract, refused by every agent.
        (
            "",
            "https://pub.example/a/../x.tgz",
            X86,
            "the nodes do not fetch 'https://pub.example/a/../x.tgz': the path must not have "
            "'.' or '..' segments or backslashes; give the URL of the build itself",
        ),
        (
            "",
            "file://host/srv/x.tgz",
            X86,
            "the nodes do not fetch 'file://host/srv/x.tgz': a file:// URL names a path on "
            "this node: file:///DIR/…; give the URL of the build itself",
        ),
        (
            "x86_64",
            URL_X86,
            "abc",
            "sha256 'abc' is not 64 hex digits; give the SHA-256 the publisher lists for the "
            "x86_64 build",
        ),
        (
            "x86-64!",
            URL_X86,
            X86,
            "arch 'x86-64!' is not an architecture; give what 'uname -m' prints on the nodes "
            "(x86_64, aarch64), or no arch for a build that runs on any",
        ),
    ],
)
def test_a_build_the_nodes_cannot_use_is_refused(
    arch: str, url: str, sha: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Build.checked(arch, url, sha)
    assert str(info.value) == message


def test_a_build_is_kept_in_its_canonical_form() -> None:
    build = Build.checked("AMD64", " https://pub.example/x.tgz ", "AB" * 32)
    assert build == Build("x86_64", "https://pub.example/x.tgz", "ab" * 32)
    assert canonical_arch("arm64") == "aarch64" and canonical_arch("x64") == "x86_64"
    assert canonical_arch("riscv64") == "riscv64"
    assert Build.checked("", "file:///srv/builds/x.tgz", X86).arch == ""


def test_signed_url_credentials_are_never_shown() -> None:
    shown = display_url("https://user:secret@pub.example:8443/x.tgz?X-Amz-Signature=abc")
    assert shown == "https://pub.example:8443/x.tgz?…"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"engine": "sim"},
            "cannot install engine 'sim': installable engines are llamacpp, sglang, vllm; "
            "name one of them",
        ),
        (
            {"version": "../b1"},
            "version '../b1' is not a version: 1-64 letters, digits, '.', '_', '+' and '-', "
            "starting with a letter or digit",
        ),
        ({"builds": []}, "give at least one build: --url and --sha256 (with --arch)"),
        (
            {"builds": [Build("x86_64", URL_X86, X86), Build("x86_64", URL_ARM, ARM)]},
            "architecture x86_64 is given twice; give one build per architecture",
        ),
    ],
)
def test_what_cannot_be_desired_is_refused_and_nothing_recorded(
    fleet: Fleet, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        fleet.desire(**kw)
    assert str(info.value) == message
    assert fleet.store.list_desired_engines() == []


def test_a_node_whose_arch_the_builds_miss_is_refused_naming_the_covered_ones(
    fleet: Fleet,
) -> None:
    fleet.node("arm-1", arch="aarch64")
    with pytest.raises(ConfigError) as info:
        fleet.desire("arm-1", builds=[Build("x86_64", URL_X86, X86)])
    assert str(info.value) == (
        "node arm-1 is aarch64, and the builds given cover x86_64; add --arch aarch64 with "
        "the aarch64 build's --url and --sha256"
    )
    with pytest.raises(NotFound):
        fleet.desire("nobody")
    assert fleet.store.list_desired_engines() == []


# -- orders ------------------------------------------------------------------------------------


def test_each_connected_node_gets_the_build_of_its_arch_at_once(fleet: Fleet) -> None:
    x86 = fleet.node("x86-1")
    arm = fleet.node("arm-1", arch="arm64")
    assert x86 is not None and arm is not None
    out = fleet.desire()
    assert out["replaced"] is False
    assert [(r["node"], r["state"]) for r in out["nodes"]] == [
        ("arm-1", "installing"),
        ("x86-1", "installing"),
    ]
    (to_x86,) = orders(x86)
    (to_arm,) = orders(arm)
    assert (to_x86.url, to_x86.sha256, to_x86.arch, to_x86.meta.epoch) == (
        URL_X86,
        X86,
        "x86_64",
        3,
    )
    assert (to_arm.url, to_arm.arch, to_arm.version) == (URL_ARM, "aarch64", "b1")
    fleet.installs.sync()  # already sent on these streams: nothing again
    assert orders(x86) == [] and orders(arm) == []
    assert [e.kind for e in fleet.store.list_events()].count("engine_install") == 2


def test_a_node_that_joins_later_is_ordered_once_approved(fleet: Fleet) -> None:
    fleet.desire()
    late = fleet.node("late-1", state=NodeState.PENDING)
    assert late is not None
    fleet.installs.sync()
    assert orders(late) == []  # pending: no orders
    fleet.store.set_node_state("late-1", NodeState.APPROVED)
    late.approved = True
    fleet.installs.sync()
    (order,) = orders(late)
    assert (order.engine, order.version, order.url) == ("llamacpp", "b1", URL_X86)


def test_a_reconnect_resends_without_losing_a_checked_install(fleet: Fleet) -> None:
    first = fleet.node("x86-1", engines=("sim", "llamacpp"))
    assert first is not None
    fleet.desire()
    (order,) = orders(first)
    assert answer(fleet, first, order)
    row = fleet.store.get_node_engine("x86-1", "llamacpp")
    assert row is not None and row.state == InstallState.INSTALLED
    assert fleet.installs.holds(fleet.store.list_nodes()) == {}
    # A new stream (the agent reconnected, or the control plane restarted: a new object).
    second = fleet.node("x86-1", engines=("sim", "llamacpp"))
    assert second is not None
    fleet.installs.sync()
    (again,) = orders(second)
    assert (again.version, again.sha256) == ("b1", X86) and again.meta.op_id != order.meta.op_id
    # Meanwhile placement keeps the node: the install was checked before.
    assert fleet.installs.holds(fleet.store.list_nodes()) == {}
    assert answer(fleet, second, again)
    kinds = [e.kind for e in fleet.store.list_events()]
    assert kinds.count("engine_installed") == 1  # a passed re-check is no news


def test_a_failed_recheck_holds_the_engine_back_again(fleet: Fleet) -> None:
    first = fleet.node("x86-1", engines=("sim", "llamacpp"))
    assert first is not None
    fleet.desire()
    assert answer(fleet, first, orders(first)[0])
    second = fleet.node("x86-1", engines=("sim", "llamacpp"))
    assert second is not None
    fleet.installs.sync()
    assert answer(fleet, second, orders(second)[0], error="libcudart.so.12 => not found")
    assert fleet.installs.holds(fleet.store.list_nodes()) == {
        "x86-1": (
            (
                "llamacpp",
                "llamacpp b1 failed to install: libcudart.so.12 => not found; once fixed, run "
                "'llmgw ctl engines install --all llamacpp b1 ...' again",
            ),
        )
    }


def test_installing_again_retries_a_failed_install_on_the_live_stream(fleet: Fleet) -> None:
    session = fleet.node("x86-1")
    assert session is not None
    fleet.desire()
    assert answer(fleet, session, orders(session)[0], error="download failed")
    fleet.installs.sync()
    assert orders(session) == []  # not retried behind the operator's back
    out = fleet.desire()
    assert [r["state"] for r in out["nodes"]] == ["installing"]
    assert len(orders(session)) == 1


def test_a_new_version_is_ordered_and_replaces_the_old_one(fleet: Fleet) -> None:
    session = fleet.node("x86-1")
    assert session is not None
    fleet.desire()
    orders(session)
    out = fleet.desire(version="b2", builds=[Build("", "https://pub.example/any.tgz", ARM)])
    assert out["replaced"] is True
    (order,) = orders(session)
    assert (order.version, order.arch, order.sha256) == ("b2", "", ARM)


def test_an_answer_to_a_replaced_order_or_another_kind_is_not_taken(fleet: Fleet) -> None:
    session = fleet.node("x86-1")
    assert session is not None
    fleet.desire()
    (old,) = orders(session)
    fleet.desire(version="b2")
    (new,) = orders(session)
    assert not answer(fleet, session, old)  # the scheduler's op results go on to shards
    assert not fleet.installs.on_result(session, pb.OperationResult(op_id="start-1", ok=True))
    row = fleet.store.get_node_engine("x86-1", "llamacpp")
    assert row is not None and row.state == InstallState.INSTALLING
    assert answer(fleet, session, new)


def test_what_one_node_desires_replaces_what_all_do_there(fleet: Fleet) -> None:
    one = fleet.node("gpu-1")
    other = fleet.node("gpu-2")
    assert one is not None and other is not None
    fleet.desire()
    orders(one), orders(other)
    fleet.desire("gpu-1", version="b9", builds=[Build("x86_64", URL_X86, ARM)])
    (order,) = orders(one)
    assert order.version == "b9"
    assert orders(other) == []
    fleet.installs.forget(engine="llamacpp", node="gpu-1", actor="operator")
    fleet.installs.sync()
    # Back to what every node desires: b1 again (the node's last install was b9).
    (back,) = orders(one)
    assert back.version == "b1"
    assert orders(other) == []


def test_forget_says_when_nothing_was_desired(fleet: Fleet) -> None:
    fleet.desire()
    with pytest.raises(NotFound) as info:
        fleet.installs.forget(engine="vllm", node=None, actor="operator")
    assert str(info.value) == (
        "no vllm build is desired on every node; 'llmgw ctl engines' lists what is desired"
    )
    with pytest.raises(NotFound) as info:
        fleet.installs.forget(engine="llamacpp", node="gpu-1", arch="riscv64", actor="operator")
    assert str(info.value) == (
        "no llamacpp build for riscv64 is desired on node gpu-1; 'llmgw ctl engines' lists "
        "what is desired"
    )
    assert fleet.installs.forget(engine="llamacpp", node=None, arch="arm64", actor="operator") == 1
    assert [b.arch for b in fleet.store.list_desired_engines()] == ["x86_64"]
    assert "engine_forgotten" in [e.kind for e in fleet.store.list_events()]


def test_the_loop_orders_new_streams_by_itself(fleet: Fleet) -> None:
    fleet.desire()
    session = fleet.node("x86-1")
    assert session is not None

    async def main() -> None:
        task = asyncio.create_task(fleet.installs.run())
        fleet.installs.interval = 60.0
        fleet.installs.kick()
        for _ in range(100):
            if not session.queue.empty():
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert len(orders(session)) == 1


# -- placement and what operators read -----------------------------------------------------------


def test_holds_say_why_each_node_waits(fleet: Fleet) -> None:
    fleet.desire(builds=[Build("x86_64", URL_X86, X86)])
    ready = fleet.node("ready-1", engines=("sim", "llamacpp"))
    busy = fleet.node("busy-1")
    broken = fleet.node(
        "broken-1",
        details=[{"name": "llamacpp", "ok": False, "problem": "exit 127: libggml.so missing"}],
    )
    installed = "/var/lib/llmgw-agent/engines/llamacpp/b1/llama-b1/bin/llama-server"
    checked = fleet.node(
        "checked-1",
        engines=("sim", "llamacpp"),
        details=[{"name": "llamacpp", "ok": True, "path": installed}],
    )
    other = fleet.node(
        "other-1",
        engines=("sim", "llamacpp"),
        details=[{"name": "llamacpp", "ok": True, "path": "/usr/local/bin/llama-server"}],
    )
    fleet.node("arm-1", arch="aarch64")
    fleet.node("gone-1", connect=False)
    assert ready is not None and broken is not None and busy is not None
    assert checked is not None and other is not None
    fleet.installs.sync()
    for session in (ready, broken, checked, other):
        assert answer(fleet, session, orders(session)[0])
    holds = fleet.installs.holds(fleet.store.list_nodes())
    assert holds == {
        "arm-1": (
            (
                "llamacpp",
                "no llamacpp b1 build for its architecture aarch64 (the desired set covers "
                "x86_64); add one: llmgw ctl engines install --all llamacpp b1 --arch aarch64 "
                "--url URL --sha256 SHA256",
            ),
        ),
        "busy-1": (("llamacpp", "llamacpp b1 is being installed"),),
        "other-1": (
            (
                "llamacpp",
                "llamacpp b1 is installed but the node offers /usr/local/bin/llama-server "
                "instead (a program named in agent.yaml or on PATH comes first, then the newest "
                "install); remove that one on the node, or 'llmgw ctl engines forget --all "
                "llamacpp'",
            ),
        ),
        "broken-1": (
            (
                "llamacpp",
                "llamacpp b1 is installed but the node does not offer it: exit 127: "
                "libggml.so missing",
            ),
        ),
    }
    # Nothing desired: nothing held, whatever was installed.
    fleet.installs.forget(engine="llamacpp", node=None, actor="operator")
    assert fleet.installs.holds(fleet.store.list_nodes()) == {}


def test_node_rows_show_desired_against_installed(fleet: Fleet) -> None:
    fleet.desire(builds=[Build("x86_64", URL_X86, X86)])
    ready = fleet.node(
        "ready-1",
        engines=("sim", "llamacpp", "vllm"),
        details=[
            {"name": "sim", "ok": True, "version": "0.1.0"},
            {"name": "llamacpp", "ok": True, "version": "version: 1 (b1)"},
            {"name": "vllm", "ok": True, "version": "0.9.1"},
        ],
    )
    fleet.node("pending-1", state=NodeState.PENDING)
    fleet.node("away-1", connect=False)
    fleet.node("revoked-1", state=NodeState.REVOKED, connect=False)
    assert ready is not None
    fleet.installs.sync()
    assert answer(fleet, ready, orders(ready)[0])
    rows = {(r["node"], r["engine"]): r for r in fleet.installs.node_rows()}
    assert set(rows) == {
        ("away-1", "llamacpp"),
        ("pending-1", "llamacpp"),
        ("ready-1", "llamacpp"),
        ("ready-1", "vllm"),
    }
    mine = rows[("ready-1", "llamacpp")]
    assert (mine["desired"], mine["desired_for"], mine["installed"], mine["state"]) == (
        "b1",
        "all",
        "b1",
        "ready",
    )
    assert mine["offered"] == "version: 1 (b1)" and mine["connected"] is True
    other = rows[("ready-1", "vllm")]
    assert (other["desired"], other["installed"], other["state"]) == ("", "", "offered")
    assert rows[("pending-1", "llamacpp")]["reason"] == (
        "llamacpp b1 is ordered once the node is approved"
    )
    assert rows[("away-1", "llamacpp")]["reason"] == "llamacpp b1 is ordered when the node connects"
    (desired,) = fleet.installs.desired_rows()
    assert desired == {
        "node": None,
        "engine": "llamacpp",
        "version": "b1",
        "builds": [{"arch": "x86_64", "url": URL_X86, "sha256": X86}],
    }
    (result,) = fleet.installs.results([orders_sent_op(fleet, "ready-1"), "nope"])
    assert (result["node"], result["state"], result["error"]) == ("ready-1", "installed", "")


def orders_sent_op(fleet: Fleet, node_id: str) -> str:
    row = fleet.store.get_node_engine(node_id, "llamacpp")
    assert row is not None
    return row.op_id


def test_desiring_for_all_leaves_a_node_with_its_own_entry_alone(fleet: Fleet) -> None:
    own = fleet.node("gpu-1")
    assert own is not None
    fleet.desire("gpu-1", version="b9")
    (order,) = orders(own)
    assert answer(fleet, own, order)
    fleet.desire(version="b2")
    assert orders(own) == []  # its own b9 stands, checked: not ordered again
    row = fleet.store.get_node_engine("gpu-1", "llamacpp")
    assert row is not None and (row.version, row.state) == ("b9", InstallState.INSTALLED)
