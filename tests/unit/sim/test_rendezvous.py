"""A multi-node ``sim`` replica assembling over real TCP on loopback, as real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from llmgw.sim.config import SimConfig
from llmgw.sim.generate import generate
from llmgw.sim.rendezvous import JOINED

pytestmark = pytest.mark.timeout(90)

HEARTBEAT_S = 0.2
PEER_TIMEOUT_S = 1.0
START_S = 30.0  # an interpreter start on a busy machine, with margin
MODEL = "rdv-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Sim:
    rank: int
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` until true; fail the test (never pass it) when ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g}s")


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process ``pid`` listens on (its sockets in LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[Callable[..., Sim]]:
    started: list[Sim] = []

    def start(
        rank: int,
        nodes: int,
        dist: int,
        *,
        port: int = 0,
        join_timeout: float = 60.0,
        extra: tuple[str, ...] = (),
        name: str = "",
    ) -> Sim:
        log = tmp_path / f"{name or f'rank{rank}'}.log"
        argv = [
            sys.executable,
            "-m",
            "llmgw",
            "engine",
            "sim",
            "--model",
            MODEL,
            "--seed",
            "11",
            "--port",
            str(port),
            "--nodes",
            str(nodes),
            "--rank",
            str(rank),
            "--dist-init-addr",
            f"127.0.0.1:{dist}",
            "--join-timeout",
            str(join_timeout),
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            "--heartbeat-timeout",
            str(PEER_TIMEOUT_S),
            *extra,
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        sim = Sim(rank, proc, log)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        if sim.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sim.proc.pid, signal.SIGKILL)
        sim.proc.wait(10)


def joined(sim: Sim) -> bool:
    return JOINED in sim.text()


def test_three_nodes_serve_only_once_all_joined_and_a_dead_worker_takes_rank0_down(
    sims: Callable[..., Sim],
) -> None:
    port, dist, worker_port = free_port(), free_port(), free_port()
    rank0 = sims(0, 3, dist, port=port)
    wait_until(lambda: listening(dist), START_S, "rank 0 binds the dist-init port")
    # Alone, rank 0 holds the dist-init port and serves nothing.
    assert health(port) is None
    assert listening_ports(rank0.proc.pid) == {dist}

    # One worker of two: still nothing served.
    w1 = sims(1, 3, dist, port=worker_port)
    wait_until(lambda: joined(w1), START_S, "worker 1 joins")
    time.sleep(3 * HEARTBEAT_S)
    assert health(port) is None, "rank 0 served before every worker had joined"
    assert rank0.proc.poll() is None

    # The second worker, started late: now rank 0 serves, promptly.
    w2 = sims(2, 3, dist)
    joined_at = wait_until(lambda: joined(w2), START_S, "worker 2 joins")
    served_at = wait_until(lambda: health(port) == 200, 10.0, "rank 0 serves once all joined")
    assert served_at - joined_at < 10.0
    text = rank0.text()
    assert "worker rank 1 joined" in text and "worker rank 2 joined" in text
    assert "all 3 ranks joined" in text

    # Completions, deterministic exactly as a single-node sim's.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=20
    )
    tokens, finish = generate(SimConfig(seed=11), "hello there", max_tokens=20, seed=None)
    assert reply.choices[0].message.content == "".join(tokens)
    assert reply.choices[0].finish_reason == finish

    # Workers serve nothing: no listening socket at all, not even on the --port given.
    for worker in (w1, w2):
        assert listening_ports(worker.proc.pid) == set()
    assert not listening(worker_port)
    assert listening_ports(rank0.proc.pid) == {dist, port}

    # A worker dies: rank 0 exits non-zero, naming the rank, well within the peer timeout
    # (a killed process's connection is closed by the kernel at once).
    killed_at = time.monotonic()
    os.kill(w2.proc.pid, signal.SIGKILL)
    code = rank0.wait(PEER_TIMEOUT_S + 5.0)
    assert code != 0
    assert time.monotonic() - killed_at < PEER_TIMEOUT_S + 5.0
    assert "worker rank 2" in rank0.text() and "is gone" in rank0.text()
    assert "error: sim rank 0: worker rank 2" in rank0.text()
    # ... and the remaining worker leaves with it.
    assert w1.wait(PEER_TIMEOUT_S + 5.0) != 0
    assert "rank 0 at" in w1.text() and "is gone" in w1.text()


def test_silent_worker_counts_as_dead_after_the_heartbeat_timeout(
    sims: Callable[..., Sim],
) -> None:
    port, dist = free_port(), free_port()
    rank0 = sims(0, 2, dist, port=port)
    w1 = sims(1, 2, dist)
    wait_until(lambda: health(port) == 200, START_S, "a 2-node replica assembles")
    stopped_at = time.monotonic()
    os.kill(w1.proc.pid, signal.SIGSTOP)
    try:
        code = rank0.wait(PEER_TIMEOUT_S + 5.0)
        elapsed = time.monotonic() - stopped_at
    finally:
        os.kill(w1.proc.pid, signal.SIGCONT)
    assert code != 0
    # Not before the peer timeout (heartbeats were flowing), not long after it.
    assert PEER_TIMEOUT_S * 0.8 <= elapsed < PEER_TIMEOUT_S + 5.0
    assert "worker rank 1 (127.0.0.1:" in rank0.text()
    assert f"silent for {PEER_TIMEOUT_S:g}s" in rank0.text()


def hello(dist: int, line: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", dist), timeout=5) as s:
        s.sendall(line)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = s.recv(1024)
            if not chunk:
                break
            answer += chunk
        return answer


def test_duplicate_out_of_range_and_mismatched_ranks_are_refused(
    sims: Callable[..., Sim],
) -> None:
    port, dist = free_port(), free_port()
    rank0 = sims(0, 3, dist, port=port)
    w1 = sims(1, 3, dist)
    wait_until(lambda: joined(w1), START_S, "worker 1 joins")

    dup = sims(1, 3, dist, name="dup")
    assert dup.wait(START_S) == 1
    assert "refused this worker: rank 1 has already joined" in dup.text()
    assert JOINED not in dup.text()

    assert hello(dist, b"HELLO 5 3\n").startswith(b"REFUSE rank 5 is out of range for 3 nodes")
    assert hello(dist, b"HELLO 0 3\n").startswith(b"REFUSE rank 0 is out of range")
    assert hello(dist, b"HELLO 2 4\n").startswith(b"REFUSE this replica has 3 nodes")
    assert hello(dist, b"GET / HTTP/1.1\r\n").startswith(b"REFUSE expected 'HELLO")

    # None of it disturbed the replica: rank 2 can still join and rank 0 then serves.
    assert rank0.proc.poll() is None and w1.proc.poll() is None
    sims(2, 3, dist)
    wait_until(lambda: health(port) == 200, START_S, "the replica assembles")
    assert "refused a worker" in rank0.text()


def test_worker_retries_until_rank0_appears_and_leaves_cleanly_when_rank0_stops(
    sims: Callable[..., Sim],
) -> None:
    port, dist = free_port(), free_port()
    w1 = sims(1, 2, dist)
    time.sleep(1.0)  # the worker dials a port nothing listens on yet
    assert w1.proc.poll() is None
    rank0 = sims(0, 2, dist, port=port)
    wait_until(lambda: health(port) == 200, START_S, "the replica assembles")
    assert joined(w1)

    # Rank 0 stopped on purpose says BYE: the worker ends with it, cleanly.
    rank0.proc.send_signal(signal.SIGTERM)
    assert rank0.wait(15) == 0
    assert w1.wait(PEER_TIMEOUT_S + 5.0) == 0
    assert "rank 0 ended the replica" in w1.text()


def test_worker_stopped_on_purpose_still_takes_rank0_down(sims: Callable[..., Sim]) -> None:
    port, dist = free_port(), free_port()
    rank0 = sims(0, 2, dist, port=port)
    w1 = sims(1, 2, dist)
    wait_until(lambda: health(port) == 200, START_S, "the replica assembles")
    w1.proc.send_signal(signal.SIGTERM)
    assert w1.wait(15) == 0
    assert rank0.wait(PEER_TIMEOUT_S + 5.0) != 0
    assert "worker rank 1" in rank0.text() and "it left (BYE)" in rank0.text()


def test_join_timeouts_name_what_is_missing(sims: Callable[..., Sim]) -> None:
    dist = free_port()
    lonely = sims(1, 2, dist, join_timeout=1.0, name="lonely")
    assert lonely.wait(START_S) == 1
    assert f"could not join rank 0 at 127.0.0.1:{dist} within 1s" in lonely.text()

    port, dist = free_port(), free_port()
    rank0 = sims(0, 3, dist, port=port, join_timeout=1.0)
    assert rank0.wait(START_S) == 1
    assert "rank(s) 1, 2 of 3 did not join within 1s" in rank0.text()
    assert health(port) is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nodes", "2"], "needs dist_init_addr HOST:PORT"),
        (["--nodes", "2", "--dist-init-addr", "nohost"], "'nohost' has no port"),
        (["--nodes", "2", "--rank", "2", "--dist-init-addr", "127.0.0.1:1"], "rank must be"),
        (["--heartbeat-interval", "2", "--heartbeat-timeout", "1"], "must exceed heartbeat_s"),
    ],
)
def test_cli_rejects_bad_rendezvous_options(args: list[str], needle: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", "engine", "sim", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: sim: ")
    assert needle in out.stderr


def test_single_node_is_unchanged(sims: Callable[..., Sim], tmp_path: Path) -> None:
    # --nodes 1 (the default) ignores the rendezvous options and serves at once.
    port = free_port()
    log = tmp_path / "single.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "engine", "sim", "--port", str(port)],
            stdout=out,
            stderr=out,
        )
    try:
        wait_until(lambda: health(port) == 200, START_S, "a single-node sim serves")
        assert listening_ports(proc.pid) == {port}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
            assert json.load(resp)["data"][0]["id"] == "llmgw-sim"
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
