"""`llmgw up` as a user runs it, driven by the official openai client."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmgw.agent.records import ShardRecords
from llmgw.procutil import process_start_time
from tests.integration.harness import (
    LLMGW,
    Up,
    alive,
    cmdline,
    start_up,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cluster = start_up(tmp_path_factory.mktemp("up"))
    try:
        yield cluster
    finally:
        stop_process(cluster.proc, signal.SIGINT, timeout=60)


def test_banner_has_url_key_and_curl_line(up: Up) -> None:
    text = "".join(up.output)
    assert up.base_url.startswith("http://127.0.0.1:") and up.base_url.endswith("/v1")
    assert up.api_key.startswith("sk-llmgw-")
    assert f"curl -s {up.base_url}/chat/completions -H 'Authorization: Bearer {up.api_key}'" in text
    # A quiet start: nothing of gRPC's own (its fork handlers' "skipping fork() handlers").
    assert "fork_posix" not in text and "fork()" not in text, text


def test_a_browser_at_the_root_lands_on_the_console(up: Up) -> None:
    root = up.base_url.removesuffix("/v1") + "/"
    page = urllib.request.urlopen(urllib.request.Request(root, headers={"Accept": "text/html"}))
    assert page.status == 200
    assert urllib.parse.urlsplit(page.url).path.startswith("/ui/"), page.url
    assert "text/html" in page.headers["Content-Type"]


def test_the_model_up_deploys_answers_embeddings_and_responses(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key)
    emb = client.embeddings.create(model="llmgw-sim", input="out of the box")
    assert len(emb.data[0].embedding) > 0
    resp = client.responses.create(model="llmgw-sim", input="Hello", max_output_tokens=8)
    assert resp.output_text
    events = [e.type for e in client.responses.create(model="llmgw-sim", input="Hi", stream=True)]
    assert events[0] == "response.created" and events[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "answers every endpoint: /v1/chat/completions" in "".join(up.output)


def test_every_process_runs_on_the_loop_it_is_given(up: Up, event_loop_of_processes: str) -> None:
    # llmgw up itself (control plane and gateway), its agent, and the agent's sim engine:
    # each says at start which loop it runs (uvloop here unless LLMGW_EVENT_LOOP says).
    said: dict[str, str] = {}
    for log in up.state_dir.rglob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if m := re.search(r"event loop: (\w+)\"?(?: process=(\S+))?", line):
                said[m.group(2) or log.name] = m.group(1)
    expected = event_loop_of_processes
    assert said.get("up") == expected and said.get("agent") == expected, said
    engines = {k: v for k, v in said.items() if k not in ("up", "agent")}
    assert engines and set(engines.values()) == {expected}, said


def test_list_models(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key)
    assert [m.id for m in client.models.list()] == ["llmgw-sim"]


def test_chat_completion_and_stream_reassemble_to_the_same_text(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key)
    messages = [{"role": "user", "content": "Tell me about GPUs"}]
    full = client.chat.completions.create(
        model="llmgw-sim", messages=messages, seed=7, max_tokens=40
    )  # type: ignore[arg-type]
    text = full.choices[0].message.content
    assert text
    assert full.usage is not None and full.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="llmgw-sim", messages=messages, seed=7, max_tokens=40, stream=True
    )  # type: ignore[arg-type]
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1  # really streamed, chunk by chunk
    assert "".join(pieces) == text


def test_completions_endpoint(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key)
    out = client.completions.create(
        model="llmgw-sim", prompt="Once upon a time", max_tokens=5, seed=1
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens <= 5


def test_wrong_key_is_an_authentication_error(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key="sk-llmgw-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(
            model="llmgw-sim", messages=[{"role": "user", "content": "hi"}]
        )
    # The fix named as the banner names ctl: as the user can type it (here python -m llmgw).
    assert f"'{typed(sys.executable)} -m llmgw ctl keys create NAME'" in str(info.value)


def test_unknown_model_is_not_found_naming_the_models(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-17" in str(info.value) and "llmgw-sim" in str(info.value)


def test_ctl_finds_the_cluster_from_the_state_dir(up: Up) -> None:
    env = dict(os.environ, XDG_CONFIG_HOME=str(up.state_dir / "xdg"))
    out = subprocess.run(
        [*LLMGW, "ctl", "--config", str(up.state_dir / "ctl.yaml"), "nodes"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    header, row = out.splitlines()[:2]
    assert header.split()[:4] == ["NODE", "STATE", "HEALTH", "CONNECTED"]
    node, state, health, connected = row.split()[:4]
    assert (node, state, connected) == ("local", "approved", "yes")
    # Degraded where this machine has an engine on PATH that will not run.
    assert health in ("healthy", "degraded")


def test_ctl_finds_the_cluster_through_llmgw_state_dir_as_the_banner_says(up: Up) -> None:
    text = "".join(up.output)
    # The command exactly as printed, typed into a shell from where 'llmgw up' was started:
    # this test runs 'python -m llmgw', which is not 'llmgw' on the PATH.
    line = next(line for line in up.output if "Operator view:" in line)
    command = line.split("Operator view:", 1)[1].split("   (also", 1)[0].strip()
    assert command == (
        f"LLMGW_STATE_DIR={shlex.quote(str(up.state_dir))} {typed(sys.executable)} -m llmgw "
        "ctl nodes"
    ), text
    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(up.state_dir / "xdg"),
        XDG_DATA_HOME=str(up.state_dir / "not-here"),
    )
    env.pop("LLMGW_CTL_CONFIG", None)
    env.pop("LLMGW_SERVER", None)
    out = subprocess.run(
        ["/bin/sh", "-c", command], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    node, state, _health, connected = out.stdout.splitlines()[1].split()[:4]
    assert (node, state, connected) == ("local", "approved", "yes")


def typed(path: str) -> str:
    """A path as the banner prints it: relative to the current directory when under it."""
    try:
        shown = str(Path(path).absolute().relative_to(Path.cwd()))
    except ValueError:
        return shlex.quote(path)
    return shlex.quote(shown if "/" in shown else f"./{shown}")


def test_metrics_count_requests_tokens_and_ttft(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key)
    for chunk in client.chat.completions.create(
        model="llmgw-sim", messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=4
    ):
        del chunk
    import urllib.error
    import urllib.request

    root = up.base_url.removesuffix("/v1")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(root + "/metrics", timeout=5)
    assert refused.value.code == 401
    token = (up.state_dir / "server" / "metrics.token").read_text().strip()
    scrape = urllib.request.Request(root + "/metrics", headers={"Authorization": f"Bearer {token}"})
    text = urllib.request.urlopen(scrape, timeout=5).read().decode()
    assert re.search(
        r'llmgw_requests_total\{model="llmgw-sim",replica="[^"]+",code="200"\} \d+', text
    )
    assert 'llmgw_time_to_first_token_seconds_count{model="llmgw-sim"' in text
    assert 'llmgw_tokens_total{model="llmgw-sim",kind="completion"}' in text
    assert "llmgw_request_duration_seconds_bucket" in text


def test_ctrl_c_leaves_no_process_and_second_up_reuses_ca_and_key(tmp_path: Path) -> None:
    first = start_up(tmp_path / "state")
    ca_before = (tmp_path / "state" / "server" / "pki" / "ca.crt").read_bytes()
    records = json.loads((tmp_path / "state" / "agent" / "shards.json").read_text())
    engine_pids = [r["pid"] for r in records.values()]
    assert engine_pids
    agent_pids = [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and cmdline(int(p)).count(str(tmp_path / "state" / "agent" / "agent.yaml"))
    ]
    assert agent_pids
    # The operator scales the model (as the console's Scale does); the next up keeps it.
    ctl = [*LLMGW, "ctl", "--state-dir", str(tmp_path / "state")]
    scaled = subprocess.run(
        [*ctl, "deploy", "llmgw-sim", "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scaled.returncode == 0, scaled.stderr
    code = stop_process(first.proc, signal.SIGINT, timeout=60)
    assert code == 0, "".join(first.output)
    assert "stopped." in "".join(first.output)
    for pid in engine_pids + agent_pids:
        wait_for(lambda pid=pid: not alive(pid), timeout=10, what=f"process {pid} to exit")
    leftovers = [
        f"{p}: {cmdline(int(p))}"
        for p in os.listdir("/proc")
        if p.isdigit() and str(tmp_path) in cmdline(int(p))
    ]
    assert leftovers == []

    second = start_up(tmp_path / "state")
    try:
        assert (tmp_path / "state" / "server" / "pki" / "ca.crt").read_bytes() == ca_before
        assert second.api_key == first.api_key
        client = openai.OpenAI(base_url=second.base_url, api_key=second.api_key)
        assert [m.id for m in client.models.list()] == ["llmgw-sim"]
        shown = subprocess.run(
            [*LLMGW, "ctl", "--state-dir", str(tmp_path / "state"), "--json", "models"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        (model,) = json.loads(shown.stdout)
        assert model["replicas"] == 2  # not the default 1 re-applied
        events = subprocess.run(
            [*LLMGW, "ctl", "--state-dir", str(tmp_path / "state"), "--json", "events"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        deployed = [e for e in json.loads(events.stdout) if e["kind"] == "model_deployed"]
        # Newest first: the operator's scale; up's first deploy, named as up's.
        assert [e["actor"] for e in deployed] == ["token", "llmgw up"], deployed
    finally:
        assert stop_process(second.proc, signal.SIGINT, timeout=60) == 0


def test_up_refuses_a_state_dir_in_use(up: Up) -> None:
    out = subprocess.run(
        [
            *LLMGW,
            "up",
            "--state-dir",
            str(up.state_dir),
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--agent-port",
            "0",
            "--enroll-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"another 'llmgw up' is running on {up.state_dir}" in out.stderr
    # Refused before anything else: the first cluster's engines are untouched and serve.
    assert "left behind" not in out.stderr
    engines = [(r.pid, r.start_time) for r in ShardRecords(up.state_dir / "agent").load()]
    assert engines
    assert all(process_start_time(pid) == start for pid, start in engines)
    client = openai.OpenAI(base_url=up.base_url, api_key=up.api_key)
    reply = client.chat.completions.create(
        model="llmgw-sim", messages=[{"role": "user", "content": "still there?"}]
    )
    assert reply.choices[0].message.content


def test_sigterm_stops_it_too(tmp_path: Path) -> None:
    cluster = start_up(tmp_path / "s")
    started = time.monotonic()
    assert stop_process(cluster.proc, signal.SIGTERM, timeout=60) == 0
    assert time.monotonic() - started < 60
    assert sys.executable  # the interpreter the cluster ran under


def test_the_readmes_python_snippet_runs_as_written(up: Up) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    after = readme.split("and any OpenAI client works against it", 1)[1]
    assert ".venv/bin/pip install openai" in after.split("```python", 1)[0]
    snippet = after.split("```python\n", 1)[1].split("```", 1)[0]
    # Only the two values the banner prints differ from a default 'make run'.
    assert snippet.count("http://127.0.0.1:8080/v1") == 1 and snippet.count("sk-llmgw-…") == 1
    code = snippet.replace("http://127.0.0.1:8080/v1", up.base_url).replace(
        "sk-llmgw-…", up.api_key
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ChatCompletion(") and "llmgw-sim" in out.stdout, out.stdout


def test_add_node_on_a_loopback_cluster_says_no_other_machine_can_join(up: Up) -> None:
    out = subprocess.run(
        [*LLMGW, "ctl", "--state-dir", str(up.state_dir), "join-command", "--node", "gpu-2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "warning: this control plane takes joins on loopback only" in out.stderr
    assert "'llmgw up --host 0.0.0.0'" in out.stderr
