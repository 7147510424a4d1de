"""A real engine: Debian's llama.cpp ``llama-server`` serving a tiny random-weight GGUF.

``scripts/llamacpp-rootfs.sh`` makes a forky rootfs with llama.cpp-tools (debootstrap, about
45 s the first time on a machine, cached in /var/cache/llmgw-test) and a ``llama-server``
wrapper that runs it through the rootfs's own dynamic loader (no chroot: the agent runs it in
its unprivileged engine sandbox). Tests: the command llmgw builds, run directly; a control
plane and an agent serving it, sandboxed, through the gateway to the official openai client;
and engine-check against the real ``--help``. They need root (debootstrap) and, the first
time, the Debian mirror: without those they skip, saying why, except under ``CI=true``, where
they fail: CI must run them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw.engines.launch import build_command
from llmgw.engines.spec import EngineSpec
from tests.ci import unavailable
from tests.integration.harness import (
    Server,
    free_port,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "llamacpp-rootfs.sh"
MODEL = "tiny"
# The CPU back-end on a small, possibly busy machine: one thread, one slot.
PARAMS = {"threads": "1", "parallel": "1", "ctx_size": "256"}
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]
READY_S = 120.0


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``llama-server`` wrapper of a fresh copy of the (cached) forky rootfs."""
    if os.geteuid() != 0:
        unavailable("the llama.cpp rootfs needs root (debootstrap)")
    rootfs = tmp_path_factory.mktemp("llamacpp") / "rootfs"
    started = time.monotonic()
    try:
        made = subprocess.run(
            [str(SCRIPT), str(rootfs)],
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )
    except subprocess.TimeoutExpired:
        unavailable(f"{SCRIPT.name} did not finish within 540 s (is the Debian mirror slow?)")
    if made.returncode != 0:
        why = made.stderr.strip()[-800:]
        if shutil.which("debootstrap") is None:
            why += " (no debootstrap: apt-get install -y debootstrap)"
        unavailable(f"could not make the llama.cpp rootfs: {why}")
    took = time.monotonic() - started
    # Shown with -s or -rA; the first run on a machine includes debootstrap.
    print(f"\n{SCRIPT.name}: rootfs and wrapper ready in {took:.1f} s", file=sys.stderr)
    return Path(made.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the model


def write_tiny_llama(path: Path) -> Path:
    """A random-weight llama GGUF small enough to load in a blink (about 0.5 MB, F32).

    What llama.cpp's loader insists on: ``tokenizer.ggml.model`` ("llama", SentencePiece),
    byte tokens ``<0x00>``..``<0xFF>`` (else every request fails "unordered_map::at") and
    ``tokenizer.ggml.token_type`` (else the output is literal ``<0x56>`` text). numpy
    shapes are ggml's reversed: ``token_embd`` is (n_vocab, n_embd).
    """
    import gguf
    import numpy as np

    n_embd, n_head, n_layer, n_ff, n_ctx = 64, 4, 2, 128, 256
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    words = ["▁", "▁the", "▁a", "▁hello", "▁world", "e", "t", "a", "o", "n", "s", "r", "h"]
    tokens += words
    types += [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * (len(tokens) - len(words)) + [-float(i) for i in range(len(words))]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llmgw-tiny")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    weight("token_embd.weight", len(tokens), n_embd)
    norm("output_norm.weight")
    # Only the word tokens get output weights: the byte and control tokens' logits stay 0,
    # below the best word's, so greedy decoding writes words, never stray UTF-8 bytes
    # (which streaming and non-streaming replies would render differently).
    output = np.zeros((len(tokens), n_embd), dtype=np.float32)
    output[-len(words) :] = rng.standard_normal((len(words), n_embd))
    writer.add_tensor("output.weight", output)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        for part in ("q", "k", "v", "output"):
            weight(f"blk.{i}.attn_{part}.weight", n_embd, n_embd)
        norm(f"blk.{i}.ffn_norm.weight")
        weight(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        weight(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        weight(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf")


# --------------------------------------------------------------------------- helpers


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code  # 503 while the model loads
    except OSError:
        return None


def chat_both_ways(client: openai.OpenAI) -> tuple[str, str]:
    """The same greedy request non-streamed and streamed (reassembled): their texts, which
    must be the same non-empty words."""
    reply = client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=12, temperature=0, seed=1
    )
    assert reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=12, temperature=0, seed=1, stream=True
    )
    parts: list[str] = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "length"
    return reply.choices[0].message.content or "", "".join(parts)


def engine_in_sandbox(bwrap_pid: int) -> list[bytes]:
    """The command line of the llama-server that the sandbox (bwrap, ``bwrap_pid``) runs."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == bwrap_pid:
            continue
        try:
            if os.getsid(int(entry)) != bwrap_pid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"/usr/bin/llama-server") for arg in argv):
            return argv
    raise AssertionError(f"no llama-server in the session of {bwrap_pid}")


# --------------------------------------------------------------------------- (a) the command


def test_the_built_command_serves_health_and_chat(wrapper: Path, model: Path) -> None:
    port = free_port()
    spec = EngineSpec(
        engine="llamacpp",
        model=MODEL,
        port=port,
        source=str(model),
        binary=str(wrapper),
        params=PARAMS,
    )
    cmd = build_command(spec)
    assert cmd.serves and cmd.env == {"CUDA_VISIBLE_DEVICES": ""}
    log = model.parent / "direct.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd.argv,
            env={**os.environ, **cmd.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: proc.poll() is not None or health(port) == 200,
            timeout=READY_S,
            what="llama-server /health",
        )
        assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        text, streamed = chat_both_ways(client)
        assert text and streamed == text
        assert [m.id for m in client.models.list().data] == [MODEL]
    finally:
        # The wrapper execs all the way: this pid is llama-server, and TERM stops it.
        code = stop_process(proc, signal.SIGTERM, timeout=30)
    assert code == 0, log.read_text(errors="replace")[-2000:]


# --------------------------------------------------------------------------- (b) end to end


@pytest.fixture(scope="module")
def fleet(
    wrapper: Path, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, str]]:
    tmp = tmp_path_factory.mktemp("fleet")
    server = start_server(tmp)
    agent = make_agent(
        tmp,
        server,
        "cpu-a",
        # The model's folder is the node's models_root: sources are found (and checked
        # before placement) there.
        extra={"engines": {"llamacpp": {"bin": str(wrapper)}}, "models_root": str(model.parent)},
    )
    # Only engines.llamacpp.bin names the wrapper: the agent must run the program discovery
    # found, not a `llama-server` from PATH (there is none on this machine).
    start_agent(agent)
    try:
        wait_for(
            lambda: any(n["id"] == "cpu-a" and n["connected"] for n in server.nodes()),
            what="the agent connected",
        )
        assert server.approve_pending(1) == ["cpu-a"]
        yield server, server.api_key()
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def test_agent_offers_llamacpp_and_the_gateway_serves_it(
    fleet: tuple[Server, str], model: Path, wrapper: Path
) -> None:
    server, key = fleet

    def offered() -> list[str] | None:
        node = next(n for n in server.nodes() if n["id"] == "cpu-a")
        engines: list[str] = node["engines"]
        return engines if "llamacpp" in engines else None

    wait_for(offered, timeout=60, what="the agent to offer llamacpp")
    server.api(
        "POST",
        "/api/models",
        {
            "name": MODEL,
            "engine": "llamacpp",
            "replicas": 1,
            "source": str(model),
            "params": PARAMS,
        },
    )
    wait_for(
        lambda: [r["state"] for r in server.replicas(MODEL)] == ["ready"],
        timeout=READY_S,
        what="the llama.cpp replica ready",
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    text, streamed = chat_both_ways(client)
    assert text and streamed == text

    # The engine is the real llama-server, from the rootfs, on a loopback port, in its
    # sandbox: the recorded process is bubblewrap, the server runs in its session.
    replica = server.replicas(MODEL)[0]
    assert os.readlink(f"/proc/{replica['pid']}/exe").endswith("/bwrap")
    cmdline = engine_in_sandbox(replica["pid"])
    assert str(wrapper.parent.parent / "rootfs" / "usr/bin/llama-server").encode() in cmdline
    assert [b"--host", b"127.0.0.1"] == cmdline[cmdline.index(b"--host") :][:2]

    server.api("DELETE", f"/api/models/{MODEL}")
    wait_for(lambda: not os.path.exists(f"/proc/{replica['pid']}"), what="the engine stopped")


def test_an_embedding_profile_of_the_gguf_serves_embeddings_through_the_gateway(
    fleet: tuple[Server, str], model: Path
) -> None:
    """A catalog profile with task: embed runs llama-server with --embedding; the gateway
    routes /v1/embeddings to it and refuses chat, which that profile does not serve."""
    server, key = fleet
    server.api(
        "PUT",
        "/api/catalog",
        {
            "models": {
                "tiny-embed": {
                    "profiles": {
                        "default": {
                            "engine": "llamacpp",
                            "source": model.name,
                            "gpus": 0,
                            "task": ["embed"],
                            "params": PARAMS,
                            # A generative GGUF has no pooling of its own: mean, as OpenAI's
                            # embeddings are one vector per input.
                            "args": ["--pooling", "mean"],
                        }
                    }
                }
            }
        },
    )
    server.api("POST", "/api/models", {"name": "tiny-embed", "profile": "default", "replicas": 1})
    wait_for(
        lambda: [r["state"] for r in server.replicas("tiny-embed")] == ["ready"],
        timeout=READY_S,
        what="the llama.cpp embedding replica ready",
    )
    replica = server.replicas("tiny-embed")[0]
    cmdline = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--embedding" in cmdline
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    emb = client.embeddings.create(model="tiny-embed", input=["hello world", "world"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    assert emb.data[0].embedding != emb.data[1].embedding
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/chat/completions"):
        client.chat.completions.create(model="tiny-embed", messages=PROMPT, max_tokens=2)
    server.api("DELETE", "/api/models/tiny-embed")
    wait_for(lambda: not os.path.exists(f"/proc/{replica['pid']}"), what="the engine stopped")


# --------------------------------------------------------------------------- (c) engine-check


def engine_check(*args: str) -> subprocess.CompletedProcess[str]:
    # `llmgw ctl engine-check` once attached; the command itself is the same click command.
    code = "import sys; from llmgw.cli.ctl.engine_check import engine_check; engine_check(sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
    )


def test_engine_check_passes_against_the_real_help(wrapper: Path) -> None:
    result = engine_check("llamacpp", "--binary", str(wrapper))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # The version from `llama-server --version` ("version: 0.7.0 (build 11669, ...)").
    assert re.fullmatch(r"engine llamacpp, version \d+\.\d+.*\(build \d+.*\)", lines[0]), lines[0]
    assert lines[1].startswith(f"help: {wrapper} --help (")
    assert ["--alias", "rank", "0", "ok"] in [line.split() for line in lines]
    # The task flags (an embedding or a reranking profile) are in the real help too.
    for flag in ("--embedding", "--reranking"):
        assert any(line.split()[:1] == [flag] and line.endswith("ok") for line in lines), lines
    assert lines[-1] == "ok: all 11 flags are documented"
    assert result.stderr == ""


def real_help(wrapper: Path) -> list[str]:
    return subprocess.run(
        [str(wrapper), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()


def test_engine_check_fails_on_a_renamed_flag(wrapper: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "help.txt"
    renamed.write_text("\n".join(real_help(wrapper)).replace("--alias", "--model-alias"))
    result = engine_check("llamacpp", "--help-output", str(renamed))
    assert result.returncode == 1
    assert ["--alias", "rank", "0", "MISSING"] in [
        line.split() for line in result.stdout.splitlines()
    ]
    assert result.stderr.splitlines() == [
        "error: llamacpp does not document 1 of the 11 flags llmgw may pass it: --alias "
        "(engine version: unknown (from --help-output)); upgrade the engine to one that has "
        "them, or deploy its models with another engine"
    ]


def test_engine_check_fails_on_a_truncated_help(wrapper: Path, tmp_path: Path) -> None:
    lines = real_help(wrapper)
    assert len(lines) > 400
    # The last 400 lines, as a scrollback or `| tail -n 400` keeps them: -h, --help is
    # at the top of llama-server's help, so its absence gives the truncation away.
    truncated = tmp_path / "tail.txt"
    truncated.write_text("\n".join(lines[-400:]) + "\n")
    result = engine_check("llamacpp", "--help-output", str(truncated))
    assert result.returncode == 1
    assert "warning: the help text does not document --help itself" in result.stderr
    error = result.stderr.splitlines()[-1]
    assert error.startswith("error: llamacpp does not document ")
    # Those the tail does not even mention (a mention in another flag's text counts).
    for flag in ("--model", "--n-gpu-layers", "--rpc"):
        assert flag in error

    # The first 400 lines keep --help, so no warning, but the server flags past them fail.
    head = tmp_path / "head.txt"
    head.write_text("\n".join(lines[:400]) + "\n")
    result = engine_check("llamacpp", "--help-output", str(head))
    assert result.returncode == 1
    assert "warning" not in result.stderr
    for flag in ("--alias", "--host", "--port", "--parallel"):
        assert flag in result.stderr


# --------------------------------------------------------------------------- (d) prefix-approx


def served_by(server: Server, model: str) -> dict[str, int]:
    """Requests answered 200 per replica of ``model``, from the gateway's /metrics."""
    text = server.metrics()
    pattern = re.compile(
        r'^llmgw_requests_total\{model="'
        + re.escape(model)
        + r'",replica="([^"]+)",code="200"\} (\d+)$',
        re.M,
    )
    return {replica: int(count) for replica, count in pattern.findall(text)}


def test_prefix_approx_sends_a_shared_prefix_back_to_the_llama_server_that_cached_it(
    fleet: tuple[Server, str], model: Path
) -> None:
    """Two llama-server replicas (one slot each, which keeps its last prompt's KV cache);
    routing: prefix-approx. The second request with the same long prefix goes to the replica
    the first went to, and llama-server reports the prefix's tokens as cached."""
    server, key = fleet
    name = "tiny-approx"
    server.api(
        "PUT",
        "/api/catalog",
        {
            "models": {
                name: {
                    "profiles": {
                        "default": {
                            "engine": "llamacpp",
                            "source": model.name,
                            "gpus": 0,
                            "params": PARAMS,
                            "routing": "prefix-approx",
                        }
                    }
                }
            }
        },
    )
    server.api("POST", "/api/models", {"name": name, "profile": "default", "replicas": 2})
    wait_for(
        lambda: [r["state"] for r in server.replicas(name)] == ["ready", "ready"],
        timeout=READY_S,
        what="two llama.cpp replicas ready",
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    # About 170 of the tiny model's tokens: inside its 256-token context with the answer.
    system = (
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
        "pi rho sigma tau upsilon phi chi psi omega"
    )

    def ask(question: str) -> int:
        reply = client.chat.completions.create(
            model=name,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.usage is not None
        details = reply.usage.prompt_tokens_details
        return details.cached_tokens or 0 if details is not None else 0

    assert ask("one") == 0
    first = served_by(server, name)
    assert sum(first.values()) == 1, first
    cached = ask("two two")
    after = served_by(server, name)
    assert after == {replica: 2 for replica in first}, (first, after)  # the same replica
    assert cached > 100, f"llama-server reported {cached} cached prompt tokens"
    models = {m["name"]: m for m in server.api("GET", "/api/models")}
    assert models[name]["routing"] == "prefix-approx"
    assert models[name]["cache_hit_rate"] > 0.3
    pids = [r["pid"] for r in server.replicas(name)]
    server.api("DELETE", f"/api/models/{name}")
    wait_for(
        lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids),
        what="the engines stopped",
    )
