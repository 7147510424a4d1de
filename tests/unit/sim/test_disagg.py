"""The sim engine's disaggregated prefill/decode: real prefill and decode sims on loopback
driven as vLLM's disaggregation proxy drives them, the KV transfer's wire protocol, its
failures recomputed, and the refusals of bad kv_transfer_params and settings."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from llmgw.cli import engine as engine_cli
from llmgw.engines.launch import build_command, check_params
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import tokenize
from tests.unit.sim.running import running

MODEL = "llmgw-sim"
BPT = 1000  # kv_bytes_per_token of the engines here
BLOCK = 16
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def words(n: int, start: int = 0) -> str:
    """A prompt of exactly ``n`` sim tokens."""
    vocab = ["river", "stone", "bridge", "road", "valley", "forest", "cloud", "music"]
    text = " ".join(vocab[(start + i) % len(vocab)] for i in range(n))
    assert len(tokenize(text)) == n
    return text


def post(url: str, body: Any) -> tuple[int, Any]:
    """POST ``body``: the status and the JSON answer, or the SSE events' payloads."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = resp.read().decode()
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                events = [e[6:] for e in data.split("\n\n") if e.startswith("data: ")]
                assert events[-1] == "[DONE]"
                return resp.status, [json.loads(e) for e in events[:-1]]
            return resp.status, json.loads(data) if data else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        line.split()[0].removeprefix("llmgw_sim_"): float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def text_of(answer: Any, chat: bool) -> tuple[str, str]:
    """The text and finish reason of a whole answer or of a stream's events."""
    if isinstance(answer, dict):
        choice = answer["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    text, finish = "", ""
    for event in answer:
        for choice in event["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill's request as vLLM's proxy makes it from the client's."""
    out = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def hand_over(p_url: str, d_url: str, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """Prefill on ``p_url``, then decode on ``d_url``: both answers."""
    status, prefilled = post(f"{p_url}{path}", prefill_body(body))
    assert status == 200, prefilled
    status, decoded = post(
        f"{d_url}{path}", {**body, "kv_transfer_params": prefilled["kv_transfer_params"]}
    )
    assert status == 200, decoded
    return prefilled, decoded


def kv_cfg(**extra: Any) -> SimConfig:
    settings: dict[str, Any] = {"kv_transfer_addr": "127.0.0.1:0", "kv_bytes_per_token": BPT}
    return SimConfig(port=0, seed=3, **{**settings, **extra})


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[str, str, str]]:
    """A prefill, a decode and an aggregated engine."""
    with (
        running(kv_cfg()) as p_url,
        running(kv_cfg()) as d_url,
        running(SimConfig(port=0, seed=3)) as a_url,
    ):
        yield p_url, d_url, a_url


# ------------------------------------------------------------------ the hand-over


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_decode_answers_what_the_aggregated_engine_answers(
    engines: tuple[str, str, str], chat: bool, stream: bool
) -> None:
    p_url, d_url, a_url = engines
    prompt = f"{words(37, start=int(chat) + 2 * int(stream))} tell me"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    before_p, before_d = metrics(p_url), metrics(d_url)

    prefilled, decoded = hand_over(p_url, d_url, path, body)
    _, aggregated = post(f"{a_url}{path}", body)

    # The prefill: one token cut by its length, and its blocks named as vLLM names them.
    assert text_of(prefilled, chat)[1] == "length"
    assert prefilled["usage"]["completion_tokens"] == 1
    tokens = prefilled["usage"]["prompt_tokens"]
    kv = prefilled["kv_transfer_params"]
    assert set(kv) == {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
    }
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert len(kv["remote_block_ids"]) == -(-tokens // BLOCK)
    assert kv["remote_host"] == "127.0.0.1" and isinstance(kv["remote_port"], int)
    assert kv["tp_size"] == 1 and kv["remote_engine_id"]

    # The decode: the aggregated answer, exactly, and usage as vLLM reports a remote prefill.
    assert text_of(decoded, chat) == text_of(aggregated, chat)
    usage = decoded[-1]["usage"] if stream else decoded["usage"]
    assert usage["prompt_tokens"] == tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] == tokens - 1
    if not stream:
        assert decoded["kv_transfer_params"] is None
    # The blocks crossed the wire once, prompt tokens times kv_bytes_per_token, and went.
    after_p, after_d = metrics(p_url), metrics(d_url)
    assert after_p["kv_bytes_sent_total"] - before_p["kv_bytes_sent_total"] == tokens * BPT
    assert after_d["kv_bytes_received_total"] - before_d["kv_bytes_received_total"] == tokens * BPT
    assert after_d["kv_pulls_total"] - before_d["kv_pulls_total"] == 1
    assert after_d["kv_load_failures_total"] == before_d["kv_load_failures_total"]
    assert after_p["kv_blocks_held"] == 0


def test_decode_pulls_only_what_its_own_cache_lacks(engines: tuple[str, str, str]) -> None:
    p_url, d_url, _ = engines
    shared = words(48, start=5)  # three full blocks the decode will have cached
    post(f"{d_url}/v1/completions", {"model": MODEL, "prompt": shared, "max_tokens": 1})
    body = {"model": MODEL, "prompt": f"{shared} {words(10)}", "max_tokens": 3}
    before = metrics(d_url)
    prefilled, decoded = hand_over(p_url, d_url, "/v1/completions", body)
    tokens = prefilled["usage"]["prompt_tokens"]
    moved = metrics(d_url)["kv_bytes_received_total"] - before["kv_bytes_received_total"]
    assert moved == (tokens - 48) * BPT  # vLLM's get_num_new_matched_tokens: prompt - local
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens - 1
    assert metrics(p_url)["kv_blocks_held"] == 0  # the pull freed the whole prompt's blocks


def test_pulled_decode_skips_the_prefill_a_recompute_pays() -> None:
    # 1 ms a prompt token: a 1,000-token prompt costs the decode 1 s unless its blocks come.
    slow = {"prefill_us_per_token": 1000.0}
    body = {"model": MODEL, "prompt": words(1000), "max_tokens": 2}
    with running(kv_cfg()) as p_url, running(kv_cfg(**slow)) as d_url:
        start = time.monotonic()
        _, decoded = hand_over(p_url, d_url, "/v1/completions", body)
        pulled_s = time.monotonic() - start
        start = time.monotonic()
        status, _ = post(f"{d_url}/v1/completions", dict(body, prompt=words(1000, start=3)))
        recomputed_s = time.monotonic() - start
    assert status == 200 and decoded["usage"]["prompt_tokens"] == 1000
    assert recomputed_s >= 1.0
    assert pulled_s < 0.9  # generous: the pull on loopback takes milliseconds


# ------------------------------------------------------------------ failed pulls: recompute


def test_pull_of_freed_or_unknown_blocks_is_recomputed(engines: tuple[str, str, str]) -> None:
    p_url, d_url, a_url = engines
    body = {"model": MODEL, "prompt": words(40, start=1) + " again", "max_tokens": 12}
    _, aggregated = post(f"{a_url}/v1/completions", body)
    status, prefilled = post(f"{p_url}/v1/completions", prefill_body(body))
    kv = prefilled["kv_transfer_params"]
    post(f"{d_url}/reset_prefix_cache", {})
    cases = [
        dict(kv, remote_engine_id="another-engine"),  # unknown engine: refused
        dict(kv, remote_block_ids=[b + 10**9 for b in kv["remote_block_ids"]]),  # never kept
        kv,  # the real ones: pulled
        kv,  # pulled already: freed
    ]
    failures = []
    for params in cases:
        before = metrics(d_url)["kv_load_failures_total"]
        post(f"{d_url}/reset_prefix_cache", {})  # each decode pulls every block
        status, decoded = post(f"{d_url}/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 200, decoded
        assert text_of(decoded, False) == text_of(aggregated, False)
        failures.append(metrics(d_url)["kv_load_failures_total"] - before)
        if failures[-1]:  # recomputed: its cached tokens are what it found itself
            assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert failures == [1, 1, 0, 1]
    assert metrics(p_url)["kv_pulls_refused_total"] >= 3


def test_blocks_unpulled_are_freed_after_the_timeout() -> None:
    body = {"model": MODEL, "prompt": words(20), "max_tokens": 4}
    with running(kv_cfg(kv_transfer_timeout_s=0.3)) as p_url, running(kv_cfg()) as d_url:
        _, prefilled = post(f"{p_url}/v1/completions", prefill_body(body))
        assert metrics(p_url)["kv_blocks_held"] == 2
        deadline = time.monotonic() + 10
        while metrics(p_url)["kv_blocks_held"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = metrics(p_url)
        assert after["kv_blocks_held"] == 0 and after["kv_expired_requests_total"] == 1
        params = prefilled["kv_transfer_params"]
        status, decoded = post(f"{d_url}/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 200 and decoded["choices"][0]["text"]
        assert metrics(d_url)["kv_load_failures_total"] == 1


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP listener that accepts and never answers: a prefill that hangs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(sock.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        sock.close()


def test_a_prefill_that_never_answers_is_recomputed_after_the_timeout() -> None:
    body = {"model": MODEL, "prompt": words(20), "max_tokens": 4}
    with (
        silent_listener() as port,
        running(kv_cfg(kv_transfer_timeout_s=0.4)) as d_url,
        running(SimConfig(port=0, seed=3)) as a_url,
    ):
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "e",
            "remote_block_ids": [1, 2],
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
        }
        start = time.monotonic()
        status, decoded = post(f"{d_url}/v1/completions", {**body, "kv_transfer_params": params})
        waited = time.monotonic() - start
        assert status == 200
        assert text_of(decoded, False) == text_of(post(f"{a_url}/v1/completions", body)[1], False)
        assert waited >= 0.4
        assert metrics(d_url)["kv_load_failures_total"] == 1


def test_a_prefill_that_is_gone_is_recomputed(engines: tuple[str, str, str]) -> None:
    _, d_url, _ = engines
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there: the connection is refused
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [7],
        "remote_host": "127.0.0.1",
        "remote_port": port,
    }
    before = metrics(d_url)["kv_load_failures_total"]
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "kv_transfer_params": params}
    status, decoded = post(f"{d_url}/v1/completions", body)
    assert status == 200 and decoded["choices"][0]["text"]
    assert metrics(d_url)["kv_load_failures_total"] == before + 1


# ------------------------------------------------------------------ the wire protocol


def frame(obj: Any) -> bytes:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


def exchange(port: int, request: bytes) -> tuple[dict[str, Any] | None, int]:
    """Send ``request`` to a transfer port: the answer's header (None: closed without one)
    and the bytes after it until the prefill closed the connection."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(request)
            while chunk := conn.recv(1 << 16):
                data += chunk
        except (ConnectionResetError, BrokenPipeError):  # closed on us mid-request
            assert not data
    if not data:
        return None, 0
    (length,) = struct.unpack("!I", data[:4])
    return json.loads(data[4 : 4 + length]), len(data) - 4 - length


def test_wire_bytes_are_prompt_tokens_times_bytes_per_token(engines: tuple[str, str, str]) -> None:
    p_url, _, _ = engines
    body = {"model": MODEL, "prompt": words(45, start=4), "max_tokens": 3}
    _, prefilled = post(f"{p_url}/v1/completions", prefill_body(body))
    kv = prefilled["kv_transfer_params"]
    ask = frame({"engine_id": kv["remote_engine_id"], "block_ids": kv["remote_block_ids"]})
    header, sent = exchange(kv["remote_port"], ask)
    assert header == {"bytes": 45 * BPT} and sent == 45 * BPT  # real bytes on the socket
    header, sent = exchange(kv["remote_port"], ask)  # pulled: freed
    assert header is not None and "not held" in header["error"] and sent == 0


def test_wire_refuses_malformed_requests_by_closing(engines: tuple[str, str, str]) -> None:
    p_url, _, _ = engines
    _, prefilled = post(f"{p_url}/v1/completions", prefill_body({"model": MODEL, "prompt": "a b"}))
    kv = prefilled["kv_transfer_params"]
    port, engine_id, blocks = kv["remote_port"], kv["remote_engine_id"], kv["remote_block_ids"]
    malformed = [
        struct.pack("!I", 1 << 30),  # a length beyond any holding: nothing allocated
        struct.pack("!I", 0),
        frame(b"not json"),
        frame([1, 2]),
        frame({"engine_id": engine_id}),
        frame({"engine_id": engine_id, "block_ids": []}),
        frame({"engine_id": engine_id, "block_ids": ["1"]}),
        frame({"engine_id": engine_id, "block_ids": [blocks[0], blocks[0]]}),
        frame({"engine_id": 5, "block_ids": blocks}),
        frame({"engine_id": engine_id, "block_ids": list(range(10**6))}),  # over the bound
    ]
    for request in malformed:
        assert exchange(port, request) == (None, 0), request[:40]
    assert metrics(p_url)["kv_blocks_held"] == len(blocks)  # still there for its decode
    header, _ = exchange(port, frame({"engine_id": "other", "block_ids": blocks}))
    assert header is not None and "unknown engine id 'other'" in header["error"]
    header, sent = exchange(port, frame({"engine_id": engine_id, "block_ids": blocks}))
    assert header is not None and sent == header["bytes"] > 0


# ------------------------------------------------------------------ refusals


GOOD_REMOTE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e",
    "remote_block_ids": [1],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}


@pytest.mark.parametrize(
    ("params", "extra", "param", "says"),
    [
        ([1], {}, "kv_transfer_params", "must be an object"),
        ({"do_remote_decode": "yes"}, {}, "kv_transfer_params.do_remote_decode", "boolean"),
        ({"do_remote_prefill": 1}, {}, "kv_transfer_params.do_remote_prefill", "boolean"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, {}, "kv_transfer_params", "both"),
        (dict(PREFILL_PARAMS), {"stream": True}, "stream", "must not stream"),
        (dict(PREFILL_PARAMS), {"n": 2}, "kv_transfer_params", "n=2"),
        (dict(PREFILL_PARAMS), {"prompt": ["a", "b"]}, "kv_transfer_params", "2 prompt"),
        (dict(GOOD_REMOTE, remote_host=None), {}, "kv_transfer_params.remote_host", "host"),
        (dict(GOOD_REMOTE, remote_port=None), {}, "kv_transfer_params.remote_port", "port"),
        (dict(GOOD_REMOTE, remote_port=70000), {}, "kv_transfer_params.remote_port", "65535"),
        (dict(GOOD_REMOTE, remote_port=True), {}, "kv_transfer_params.remote_port", "port"),
        (
            dict(GOOD_REMOTE, remote_engine_id=None),
            {},
            "kv_transfer_params.remote_engine_id",
            "engine id",
        ),
        (
            dict(GOOD_REMOTE, remote_block_ids=None),
            {},
            "kv_transfer_params.remote_block_ids",
            "list of block ids",
        ),
        (
            dict(GOOD_REMOTE, remote_block_ids=["1"]),
            {},
            "kv_transfer_params.remote_block_ids",
            "list of block ids",
        ),
        (
            dict(GOOD_REMOTE, remote_block_ids=[1, 1]),
            {},
            "kv_transfer_params.remote_block_ids",
            "twice",
        ),
        (
            dict(GOOD_REMOTE, remote_block_ids=[1, 2, 3]),
            {},
            "kv_transfer_params.remote_block_ids",
            "another prompt",
        ),
        (dict(GOOD_REMOTE, tp_size=0), {}, "kv_transfer_params.tp_size", "positive"),
    ],
)
def test_bad_kv_transfer_params_are_refused(
    engines: tuple[str, str, str], params: Any, extra: dict[str, Any], param: str, says: str
) -> None:
    _, d_url, _ = engines
    before = metrics(d_url)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "kv_transfer_params": params}
    status, answer = post(f"{d_url}/v1/completions", {**body, **extra})
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"], error["message"]
    assert metrics(d_url)["kv_pulls_total"] == before["kv_pulls_total"]  # nothing pulled


def test_params_asking_for_nothing_are_served_whole(engines: tuple[str, str, str]) -> None:
    _, d_url, a_url = engines
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
    none = {"do_remote_decode": False, "do_remote_prefill": False}
    status, answer = post(f"{d_url}/v1/completions", {**body, "kv_transfer_params": none})
    assert status == 200
    assert text_of(answer, False) == text_of(post(f"{a_url}/v1/completions", body)[1], False)


@pytest.mark.parametrize("params", [dict(PREFILL_PARAMS), GOOD_REMOTE])
def test_an_engine_without_a_transfer_address_refuses_transfers(
    engines: tuple[str, str, str], params: dict[str, Any]
) -> None:
    _, _, a_url = engines
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "kv_transfer_params": params}
    status, answer = post(f"{a_url}/v1/completions", body)
    assert status == 400
    assert "--kv-transfer-addr" in answer["error"]["message"]
    assert answer["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"kv_transfer_addr": "nowhere"}, "kv_transfer_addr must be HOST:PORT"),
        ({"kv_transfer_addr": 5}, "kv_transfer_addr must be a string"),
        ({"kv_bytes_per_token": -1}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": 1.5}, "kv_bytes_per_token"),
        ({"kv_transfer_timeout_s": 0}, "kv_transfer_timeout"),
        ({"kv_transfer_timeout_s": float("inf")}, "kv_transfer_timeout"),
    ],
)
def test_bad_transfer_settings_are_refused(settings: dict[str, Any], says: str) -> None:
    with pytest.raises(EngineError, match=re.escape(says)):
        SimConfig(**settings)


def test_a_transfer_address_in_use_stops_the_engine() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with (
            pytest.raises(EngineError, match="cannot listen for KV transfers"),
            running(kv_cfg(kv_transfer_addr=f"127.0.0.1:{port}")),
        ):
            pass


def test_profile_params_and_flags() -> None:
    params = {"kv_bytes_per_token": "0", "kv_transfer_timeout": "2.5"}
    check_params("sim", params)
    argv = build_command(EngineSpec(engine="sim", model="m", port=5, params=params)).argv
    assert argv[argv.index("--kv-bytes-per-token") + 1] == "0"
    assert argv[argv.index("--kv-transfer-timeout") + 1] == "2.5"
    with pytest.raises(EngineError, match="at least"):
        check_params("sim", {"kv_bytes_per_token": "-1"})
    with pytest.raises(EngineError, match="no parameter 'kv_transfer_addr'"):
        check_params("sim", {"kv_transfer_addr": "127.0.0.1:1"})  # the agent's to add
    result = CliRunner().invoke(
        engine_cli.engine, ["sim", "--kv-transfer-addr", "bad", "--port", "0"]
    )
    assert result.exit_code != 0 and "kv_transfer_addr must be HOST:PORT" in result.output


def test_a_decode_that_stalls_is_cut_off_after_the_timeout() -> None:
    big = kv_cfg(kv_transfer_timeout_s=0.3, kv_bytes_per_token=100_000)  # 100 MB a prompt
    with running(big) as p_url:
        body = {"model": MODEL, "prompt": words(1000), "max_tokens": 2}
        _, prefilled = post(f"{p_url}/v1/completions", prefill_body(body))
        kv = prefilled["kv_transfer_params"]
        ask = frame({"engine_id": kv["remote_engine_id"], "block_ids": kv["remote_block_ids"]})
        with socket.create_connection(("127.0.0.1", kv["remote_port"]), timeout=10) as conn:
            conn.sendall(ask)
            time.sleep(0.8)  # reads nothing: the prefill's sends back up, then it gives up
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := conn.recv(1 << 20):
                    got += chunk
        assert 0 < len(got) < 1000 * 100_000
        with socket.create_connection(("127.0.0.1", kv["remote_port"]), timeout=10) as conn:
            start = time.monotonic()
            assert conn.recv(16) == b""  # asked nothing: closed after the timeout
            assert time.monotonic() - start >= 0.25
        assert metrics(p_url)["kv_pulls_served_total"] == 0
