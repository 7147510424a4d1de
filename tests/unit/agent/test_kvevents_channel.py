"""The KV event channel between an engine and the agent stays private and cheap: the socket
directory is the agent's alone, another user can neither reach nor forge, an oversized or
costly batch from another process never holds the agent's event loop (a ticker measures its
lag) nor its memory, and an adopted engine is dialled again at the same endpoint, or
restarted when that endpoint cannot be opened again as privately as it was made."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from llmgw.agent.kvevents import KvEventsHub
from llmgw.agent.kvsockets import (
    MAX_STATE_DIR,
    kv_endpoint,
    kv_socket_dir,
    kv_socket_path,
    prepare_socket_dir,
)
from llmgw.agent.shards import KV_EVENTS_RESTART, Shard, ShardManager, ShardState
from llmgw.contracts.kvblocks import ROOT, chain
from llmgw.engines.kvevents import BlockStored
from llmgw.errors import ShardError
from llmgw.sim.config import kv_events_settings
from llmgw.sim.publisher import EventPublisher
from tests.ci import unavailable
from tests.unit.agent.kvevents_rig import (
    TOKENS,
    WAIT_S,
    H,
    IdleRuntime,
    Publisher,
    Sender,
    array_batch,
    kv_order,
    stored_array,
)

pytestmark = pytest.mark.timeout(90)

STALL_S = 0.5
"""The longest the agent's loop may be held: about 10 ms is measured here while the worker
decodes, and the channel before this one held it for seconds on the same messages."""
GOOD = array_batch(stored_array(H[:1], None, TOKENS[:16]))
GOOD_KEY = chain(ROOT, TOKENS[:16])
NEXT = array_batch(stored_array(H[1:2], H[0], TOKENS[16:32]))
NEXT_KEY = chain(GOOD_KEY, TOKENS[16:32])
FORGED_TOKENS = list(range(7000, 7016))
FORGED_KEY = chain(ROOT, FORGED_TOKENS)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a unix socket's is at most 107 bytes; pytest's
    tmp_path is long), that other users may traverse: in a real install the state
    directory is 0700, here only the socket directory keeps others out."""
    path = Path(tempfile.mkdtemp(prefix="llmgw-kv-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class LoopLag:
    """How late the event loop ran a 5 ms ticker, at worst."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, loop.time() - before - 0.005)


async def until(sender: Sender, check: Callable[[], bool], what: str, timeout: float) -> None:
    """Wait for ``check`` to hold, looked at whenever ``sender`` sends."""

    async def wait() -> None:
        while not check():
            sender._changed.clear()
            await sender._changed.wait()

    try:
        await asyncio.wait_for(wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def stored(sender: Sender) -> set[int]:
    return {key for msg in sender.sent for key in msg.stored}


# --------------------------------------------------------------------------- the directory


def test_the_socket_directories_are_0700_and_the_agents(short_dir: Path) -> None:
    state = short_dir / "state"
    state.mkdir(mode=0o755)

    async def main() -> None:
        hub = KvEventsHub(Sender(), state_dir=state)
        try:
            assert hub.open("org/model:7b-s0") == kv_endpoint(state, "org/model:7b-s0")
        finally:
            await hub.aclose()

    asyncio.run(main())
    directory = kv_socket_dir(state, "org/model:7b-s0")  # a shard id of any model name
    assert directory.parent == state / "kv" and len(directory.name) == 16
    for path in (state / "kv", directory):
        info = os.lstat(path)
        assert stat.S_ISDIR(info.st_mode)
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o700, os.geteuid())
    # Widened since, with a socket left in it: private again and empty before an engine binds.
    os.chmod(directory, 0o755)
    kv_socket_path(state, "org/model:7b-s0").write_bytes(b"")
    prepare_socket_dir(state, "org/model:7b-s0")
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    assert list(directory.iterdir()) == []
    # A link in its place is no directory of the agent's.
    shutil.rmtree(directory)
    directory.symlink_to(short_dir)
    with pytest.raises(ShardError, match=r"is not a directory \(a link or a file\); remove it"):
        prepare_socket_dir(state, "org/model:7b-s0")


def test_a_socket_directory_of_another_user_is_refused(short_dir: Path) -> None:
    if os.geteuid() != 0:
        unavailable("giving a directory to another user needs root; run the tests as root")
    state = short_dir / "state"
    (state / "kv").mkdir(parents=True)
    os.chown(state / "kv", 65534, 65534)
    with pytest.raises(ShardError, match=r"belongs to uid 65534, not the agent's \(0\); remove"):
        prepare_socket_dir(state, "r1-s0")


def test_a_state_directory_too_long_for_a_socket_path_is_refused_with_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = Path("/var/lib/" + "x" * (MAX_STATE_DIR - len("/var/lib/")))
    assert kv_endpoint(state, "r1-s0").startswith("ipc://")  # the longest that fits
    longer = Path(str(state) + "y")
    with pytest.raises(ShardError) as info:
        prepare_socket_dir(longer, "r1-s0")
    assert str(info.value) == (
        f"the socket for an engine's KV cache events would be {kv_socket_path(longer, '')}, "
        "108 bytes: a unix socket's path is at most 107; give the agent a state_dir of at "
        "most 79 bytes (agent.yaml state_dir, now 80)"
    )
    # The agent says so when it starts, before any shard asks.
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.kvevents"):
        KvEventsHub(Sender(), state_dir=longer)
        KvEventsHub(Sender(), state_dir=state)
    (line,) = [r for r in caplog.records if "cannot start here" in r.getMessage()]
    assert line.__dict__["fields"]["error"] == str(info.value)


def test_a_shard_whose_socket_directory_cannot_be_made_is_not_started(tmp_path: Path) -> None:
    (tmp_path / "kv").write_text("a file where the directory goes")

    async def main() -> None:
        runtime = IdleRuntime()
        hub = KvEventsHub(Sender(), state_dir=tmp_path)
        manager = ShardManager(tmp_path, runtime, lambda shard: None, kv_events=hub)
        await manager.open()
        try:
            with pytest.raises(ShardError, match="is not a directory"):
                await manager.start(kv_order())
            assert runtime.launches == [] and hub.feeds == {}
        finally:
            await manager.close()
            await hub.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------- another user

# Runs as root, takes what it needs, then becomes nobody for good: the venv's interpreter may
# lie where nobody may not read (pyenv under /root), and only what it tries must be nobody's.
FORGER = r"""
import json, os, socket, sys, zmq
endpoint, topic, payload = sys.argv[1], sys.argv[2].encode(), bytes.fromhex(sys.argv[3])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
tried = {"uid": os.geteuid()}
context = zmq.Context()
pub = context.socket(zmq.XPUB)
pub.setsockopt(zmq.LINGER, 2000)
if endpoint.startswith("ipc://"):
    path = endpoint[len("ipc://"):]
    try:  # to read the token ids the engine publishes
        socket.socket(socket.AF_UNIX).connect(path)
        tried["connect"] = "connected"
    except OSError as exc:
        tried["connect"] = exc.strerror
    for name, where in (("bind", path), ("bind beside", os.path.dirname(path) + "/x.sock")):
        try:  # to be what the agent dials
            pub.bind("ipc://" + where)
            tried[name] = "bound"
        except zmq.ZMQError as exc:
            tried[name] = exc.strerror.split(" (")[0]
else:  # a port on loopback, as the agent bound one before
    pub.connect(endpoint)
    tried["connect"] = "connected"
if "bound" in tried.values() or "connected" in tried.values():
    if pub.poll(5000):
        pub.recv()
        pub.send_multipart([topic, (1).to_bytes(8, "big"), payload])  # the engine's next
        tried["sent"] = True
pub.close()
context.term()  # sends what is queued (linger) before the process ends
print(json.dumps(tried))
"""


def test_another_user_can_neither_reach_the_socket_nor_forge_a_block(short_dir: Path) -> None:
    if os.geteuid() != 0:
        unavailable("running a process as another user (nobody) needs root; run as root")
    state = short_dir / "state"
    state.mkdir(mode=0o755)
    forged = array_batch(stored_array([b"f" * 32], None, FORGED_TOKENS))

    async def main() -> None:
        sender = Sender()
        hub = KvEventsHub(sender, state_dir=state)
        context = zmq.asyncio.Context()
        try:
            endpoint = hub.open("r1-s0")
            engine = Publisher(context, endpoint)
            await engine.subscribed()
            await engine.publish(0, GOOD)
            await until(sender, lambda: GOOD_KEY in stored(sender), "the engine's block", WAIT_S)
            forger = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", FORGER, endpoint, "r1-s0", forged.hex()],
                capture_output=True,
                text=True,
                timeout=60,
                cwd="/",
            )
            assert forger.returncode == 0, forger.stderr
            tried = json.loads(forger.stdout)
            await asyncio.sleep(0.3)  # anything forged would have been flushed by now
            assert FORGED_KEY not in stored(sender)
            assert tried == {
                "uid": 65534,
                "connect": "Permission denied",
                "bind": "Permission denied",
                "bind beside": "Permission denied",
            }
            # The engine's socket is still the one the agent dials.
            await engine.publish(1, NEXT)
            await until(sender, lambda: NEXT_KEY in stored(sender), "the engine's next", WAIT_S)
        finally:
            await hub.aclose()
            context.destroy(linger=0)

    asyncio.run(main())


# --------------------------------------------------------------------------- the loop stays free

# A process standing in for an engine that sends what no engine would: it binds or dials the
# endpoint by vLLM's rule, waits for the agent's subscription, sends its payloads (after an
# oversized one, waiting for the agent to dial again), then GOOD, and holds its socket until
# its stdin closes.
SENDER = r"""
import sys, msgpack, zmq
endpoint, topic, kind = sys.argv[1], sys.argv[2].encode(), sys.argv[3]
good = bytes.fromhex(sys.argv[4])
pub = zmq.Context().socket(zmq.XPUB)
pub.setsockopt(zmq.LINGER, 2000)
pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a second one from a new dial too
binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
(pub.bind if binds else pub.connect)(endpoint)
assert pub.poll(20000) and pub.recv() == b"\x01"

def stored(tokens):  # one BlockStored of one block of them, built byte by byte
    head = msgpack.packb("BlockStored") + msgpack.packb([b"h" * 32]) + b"\xc0"
    size = msgpack.packb(tokens[1]) + b"\xc0" + msgpack.packb("GPU")
    return b"\x97" + head + b"\xdd" + tokens[1].to_bytes(4, "big") + tokens[0] + size

def batch(*events):
    return b"\x93" + msgpack.packb(0.0) + bytes([0x90 + len(events)]) + b"".join(events) + b"\xc0"

seq = 0
if kind == "huge":  # 16 MiB, just under what the TCP channel took: 16 Mi one-byte token ids
    n = 16 * 1024 * 1024 - 1024
    payloads = [batch(stored((b"\x01" * n, n)))]
else:  # under 4 MiB, costly: nested empty arrays, then 3 Mi token ids
    n = 4 * 1024 * 1024 - 1024
    nested = b"\x97" + msgpack.packb("BlockStored") + msgpack.packb([b"h" * 32]) + b"\xc0"
    nested += b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n + msgpack.packb(1) + b"\xc0\xc0"
    m = 1 << 20
    payloads = [batch(nested), batch(*[stored((b"\x01" * m, m))] * 3)]
for payload in payloads:
    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
    seq += 1
    if kind == "huge":  # dropped with its connection: dialled again?
        while pub.poll(5000) and pub.recv() != b"\x01":
            pass
pub.send_multipart([topic, seq.to_bytes(8, "big"), good])
print("sent", flush=True)
sys.stdin.read()
"""


def flood(short_dir: Path, kind: str) -> tuple[float, int, list[Any], Sender]:
    """Send ``kind`` from another process to a shard's endpoint, then GOOD; the loop's worst
    lag until GOOD's block came out, the agent's peak memory growth (KiB), and its sends."""
    state = short_dir / "state"
    state.mkdir()

    async def main() -> tuple[float, int, list[Any], Sender]:
        sender = Sender()
        hub = KvEventsHub(sender, state_dir=state)
        lag = LoopLag()
        ticker = asyncio.create_task(lag.run())
        endpoint = hub.open("r1-s0")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SENDER,
            endpoint,
            "r1-s0",
            kind,
            GOOD.hex(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            await until(sender, lambda: GOOD_KEY in stored(sender), "the good batch after", 60)
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
            return lag.worst, grown, list(sender.sent), sender
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            await proc.wait()
            ticker.cancel()
            await hub.aclose()

    return asyncio.run(main())


def test_a_16_mib_batch_from_another_process_neither_stalls_the_loop_nor_takes_memory(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.kvevents"):
        worst, grown_kib, sent, _ = flood(short_dir, "huge")
    assert worst < STALL_S, f"the loop was held {worst:.2f}s"
    # ZeroMQ drops it before the agent holds it (the TCP channel took 1.2 GB for one).
    assert grown_kib < 64 * 1024, f"the agent grew {grown_kib} KiB"
    # Counted lost, said once, and the engine's connection dialled again for what follows.
    assert sum(m.lost for m in sent) == 1
    (line,) = [r for r in caplog.records if "never reached the agent" in r.getMessage()]
    assert line.__dict__["fields"]["count"] == 1


def test_costly_batches_under_the_bound_are_read_off_the_loop(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.kvevents"):
        worst, _, sent, _ = flood(short_dir, "costly")
    assert worst < STALL_S, f"the loop was held {worst:.2f}s"
    # The nested arrays are refused by their count, before one is read (bad: 1); the three
    # blocks of 2**20 tokens are read, and lost as no block size llmgw keys (3).
    assert sum(m.lost for m in sent) == 4
    (bad,) = [r for r in caplog.records if "bad KV cache event" in r.getMessage()]
    assert bad.__dict__["fields"]["problem"] == (
        "events[0].token_ids has 4193280 items, over the 1048576 read"
    )


# --------------------------------------------------------------------------- adoption


def agent(state: Path, runtime: IdleRuntime) -> tuple[ShardManager, KvEventsHub, list[Shard]]:
    statuses: list[Shard] = []
    hub = KvEventsHub(Sender(), state_dir=state)
    manager = ShardManager(
        state, runtime, lambda shard: statuses.append(shard), kv_events=hub, health_interval=0.01
    )
    return manager, hub, statuses


def test_an_adopting_agent_dials_the_same_endpoint_and_the_sims_publisher_reaches_it(
    short_dir: Path,
) -> None:
    async def main() -> None:
        engine_runtime = IdleRuntime()
        first, first_hub, _ = agent(short_dir, engine_runtime)
        await first.open()
        await first.start(kv_order())
        argv = list(engine_runtime.launches[0].argv)
        # The engine, as the sim runs it from its flag: it binds the agent's endpoint.
        settings = kv_events_settings(argv[argv.index("--kv-events-config") + 1])
        assert settings is not None
        engine = EventPublisher(settings)
        try:
            await first.close()  # the agent goes; the engine runs on
            await first_hub.aclose()
            manager, hub, _ = agent(short_dir, IdleRuntime())
            await manager.open()
            try:
                (adopted,), dead = await manager.adopt_all()
                assert dead == [] and adopted.kv_events_endpoint == settings.endpoint
                assert hub.feeds["r1-s0"].endpoint == kv_endpoint(short_dir, "r1-s0")
                sender = hub.send
                assert isinstance(sender, Sender)
                block = BlockStored((H[0],), None, tuple(TOKENS[:16]), 16, None, "GPU")
                # A PUB socket drops what it sends before the subscription arrives.
                while GOOD_KEY not in stored(sender):
                    engine.publish([block])
                    await asyncio.sleep(0.05)
            finally:
                await manager.stop_all()
                await manager.close()
                await hub.aclose()
        finally:
            engine.close()

    asyncio.run(asyncio.wait_for(main(), WAIT_S * 3))


def restart_after(
    state: Path, change: Callable[[dict[str, Any]], None]
) -> tuple[Shard, IdleRuntime, list[Shard]]:
    """Start a kv-events shard, stop the agent, ``change`` its record (and whatever it
    touches), adopt it again: the shard and what the second agent saw."""

    async def main() -> tuple[Shard, IdleRuntime, list[Shard]]:
        first, first_hub, _ = agent(state, IdleRuntime())
        await first.open()
        await first.start(kv_order())
        await first.close()
        await first_hub.aclose()
        records = json.loads((state / "shards.json").read_text())
        change(records["r1-s0"])
        (state / "shards.json").write_text(json.dumps(records))
        runtime = IdleRuntime()
        manager, hub, statuses = agent(state, runtime)
        await manager.open()
        try:
            adopted, dead = await manager.adopt_all()
            assert adopted == [] and [r.shard_id for r in dead] == ["r1-s0"]
            assert hub.feeds == {}
            shard = manager.shards["r1-s0"]
            return shard, runtime, statuses
        finally:
            await manager.close()
            await hub.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        pytest.param(
            lambda r: (r.pop("kv_events_endpoint"), r.update(kv_events_port=40123)),
            "its engine publishes them to loopback TCP port 40123, as an older agent had it "
            "do, where any local user may listen",
            id="an-older-agents-tcp-port",
        ),
        pytest.param(
            lambda r: os.chmod(r["kv_events_endpoint"][6:].rsplit("/", 1)[0], 0o755),
            "is mode 0755, no longer 0700: others may have used it",
            id="a-widened-directory",
        ),
        pytest.param(
            lambda r: shutil.rmtree(r["kv_events_endpoint"][6:].rsplit("/", 1)[0]),
            "is gone (No such file or directory)",
            id="a-directory-gone",
        ),
        pytest.param(
            lambda r: r.update(state="ready"),
            "kv.sock is gone (No such file or directory)",
            id="a-ready-engines-socket-gone",
        ),
        pytest.param(
            lambda r: r.update(kv_events_endpoint="ipc:///tmp/elsewhere.sock"),
            "its endpoint ipc:///tmp/elsewhere.sock is not this agent's private socket",
            id="an-endpoint-elsewhere",
        ),
    ],
)
def test_an_endpoint_that_cannot_be_opened_again_restarts_the_shard(
    short_dir: Path, change: Callable[[dict[str, Any]], None], why: str
) -> None:
    shard, runtime, statuses = restart_after(short_dir, change)
    assert shard.state == ShardState.FAILED
    assert shard.reason.startswith(KV_EVENTS_RESTART + ": ") and why in shard.reason
    # Its engine was stopped (the control plane starts it again on a fresh socket), and the
    # stream was told.
    assert shard.handle is not None and not runtime.alive(shard.handle)
    assert [(s.shard_id, s.state) for s in statuses] == [("r1-s0", ShardState.FAILED)]
