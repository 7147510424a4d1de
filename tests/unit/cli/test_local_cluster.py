"""What ``llmgw up`` prints: commands that paste into a shell as they are, whatever the state
directory is called, and that name the cluster they were printed for; and the engines it
stops when the agent left them behind."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.agent.records import ShardRecords
from llmgw.agent.runtimes.base import ShardRecord
from llmgw.cli import local_cluster
from llmgw.cli.local_cluster import UP_MODEL, LocalCluster, UpOptions
from llmgw.contracts.endpoints import TASKS, served_paths
from llmgw.procutil import process_start_time
from llmgw.server.gateway.serving import ServedModel

RECORDER = (
    '#!/bin/sh\n: >"$RECORD"\nfor a in "$@"; do printf "%s\\n" "$a" >>"$RECORD"; done\n'
    'printf "%s" "${LLMGW_STATE_DIR-<unset>}" >"$RECORD.state"\n'
)


@pytest.fixture(autouse=True)
def llmgw_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The banner's commands as for an llmgw the PATH finds (tests/unit/cli/
    test_typed_command.py has the others)."""
    monkeypatch.setattr(local_cluster, "typed_command", lambda: "llmgw")


def banner_of(state_dir: Path, *, password: bool = False) -> str:
    cluster = LocalCluster(UpOptions(state_dir=state_dir), say=print)
    cluster.api_key = "sk-llmgw-abc"
    password_file = state_dir / "admin.password"
    if password:
        password_file.write_text("x\n")
    sim = ServedModel(UP_MODEL, "sim", TASKS, served_paths("sim", TASKS), 64, None)
    stand_in: Any = SimpleNamespace(
        http_addr="127.0.0.1:18080",
        leader=SimpleNamespace(password=SimpleNamespace(password_file=password_file)),
        serving=SimpleNamespace(models={UP_MODEL: sim}),
    )
    cluster.cp = stand_in
    return cluster.banner()


def run(tmp_path: Path, command: str) -> tuple[list[str], str]:
    """``command`` pasted into sh, with curl and llmgw standing in: the words each got."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("curl", "llmgw"):
        (bindir / tool).write_text(RECORDER)
        (bindir / tool).chmod(0o755)
    record = tmp_path / "record"
    result = subprocess.run(
        ["sh", "-c", command],
        env={"PATH": f"{bindir}:/usr/bin:/bin", "RECORD": str(record)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return record.read_text().splitlines(), Path(f"{record}.state").read_text()


@pytest.fixture
def odd_state_dir(tmp_path: Path) -> Path:
    state = tmp_path / 'my cluster\'s "state" $(id)'
    state.mkdir()
    return state


def test_the_curl_line_pastes_as_printed(tmp_path: Path, odd_state_dir: Path) -> None:
    lines = banner_of(odd_state_dir).splitlines()
    start = lines.index("  Try it:") + 1
    command = "\n".join(lines[start : start + 2])
    argv, _ = run(tmp_path, command)
    assert argv[:4] == [
        "-s",
        "http://127.0.0.1:18080/v1/chat/completions",
        "-H",
        "Authorization: Bearer sk-llmgw-abc",
    ]
    assert argv[4:6] == ["-H", "Content-Type: application/json"]
    assert argv[6] == "-d"
    assert json.loads(argv[7])["messages"] == [{"role": "user", "content": "Hello!"}]


def test_the_ctl_hint_names_a_state_dir_that_is_not_the_default(
    tmp_path: Path, odd_state_dir: Path
) -> None:
    text = banner_of(odd_state_dir, password=True)
    (hint,) = [line for line in text.splitlines() if "Operator view:" in line]
    command = hint.split("Operator view:", 1)[1].split("   (", 1)[0].strip()
    assert command == f"LLMGW_STATE_DIR={shlex.quote(str(odd_state_dir))} llmgw ctl nodes"
    argv, state = run(tmp_path, command)
    assert argv == ["ctl", "nodes"]
    assert state == str(odd_state_dir)
    assert f"LLMGW_STATE_DIR={shlex.quote(str(odd_state_dir))} llmgw ctl update asks" in text


def test_the_default_state_dir_needs_no_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    (tmp_path / "llmgw").mkdir()
    text = banner_of(tmp_path / "llmgw")
    assert "  Operator view:   llmgw ctl nodes   (also: models, replicas, events)" in text
    assert "LLMGW_STATE_DIR" not in text


def test_make_runs_llmgw_is_printed_as_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_cluster, "typed_command", lambda: ".venv/bin/llmgw")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    (tmp_path / "llmgw").mkdir()
    text = banner_of(tmp_path / "llmgw", password=True)
    assert "  Operator view:   .venv/bin/llmgw ctl nodes   (also:" in text
    assert (
        "(.venv/bin/llmgw ctl update asks for it; change it with .venv/bin/llmgw ctl admin" in text
    )


def test_the_banner_names_the_console_beside_the_base_url(tmp_path: Path) -> None:
    lines = banner_of(tmp_path).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  OpenAI base URL: "))
    assert lines[at] == "  OpenAI base URL: http://127.0.0.1:18080/v1"
    (console,) = [line for line in lines if line.startswith("  Web console:")]
    assert console == (
        "  Web console:     http://127.0.0.1:18080/ui/   (account admin, the admin password)"
    )


def test_stopping_kills_the_engines_the_agent_left_behind_and_only_those(tmp_path: Path) -> None:
    def engine() -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        return subprocess.Popen(argv, start_new_session=True)

    left, reused = engine(), engine()
    try:
        cluster = LocalCluster(UpOptions(state_dir=tmp_path), say=print)
        left_start = process_start_time(left.pid)
        reused_start = process_start_time(reused.pid)
        assert left_start is not None and reused_start is not None
        ShardRecords(cluster.agent_dir).save(
            [
                ShardRecord("s1", "r1", "llmgw-sim", "sim", pid=left.pid, start_time=left_start),
                # The pid now names another process (a later start time): not ours to kill.
                ShardRecord(
                    "s2", "r2", "llmgw-sim", "sim", pid=reused.pid, start_time=reused_start - 1
                ),
            ]
        )
        cluster._kill_leftover_engines()
        assert left.wait(timeout=10) == -9
        assert reused.poll() is None
    finally:
        for proc in (left, reused):
            proc.kill()
            proc.wait()


def test_stopping_with_no_records_kills_nothing(tmp_path: Path) -> None:
    LocalCluster(UpOptions(state_dir=tmp_path), say=print)._kill_leftover_engines()
    assert not (tmp_path / "agent").exists()


def test_the_key_is_kept_and_one_whose_secret_is_lost_is_not_reused(tmp_path: Path) -> None:
    # Its secret on disk: the same key again. The file gone while the old key is active
    # (a name names one active key): a new key beside it, the old one left alone.
    from llmgw.server.store import Store

    with Store.open(tmp_path / "state.db") as store:
        refreshed: list[int] = []
        cluster = LocalCluster(UpOptions(state_dir=tmp_path), say=print)
        cluster.cp = SimpleNamespace(  # type: ignore[assignment]
            store=store, serving=SimpleNamespace(refresh_keys=lambda: refreshed.append(1))
        )
        first = cluster._api_key()
        assert cluster._api_key() == first
        (tmp_path / "api-key").unlink()
        second = cluster._api_key()
        (tmp_path / "api-key").unlink()
        third = cluster._api_key()
        assert len({first, second, third}) == 3 and len(refreshed) == 3
        assert [k.name for k in store.active_api_keys()] == ["llmgw-up", "llmgw-up-2", "llmgw-up-3"]
        assert (tmp_path / "api-key").read_text() == third + "\n"


def test_the_banner_lists_every_endpoint_the_model_answers(tmp_path: Path) -> None:
    line = next(x for x in banner_of(tmp_path).splitlines() if "answers every endpoint" in x)
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/rerank"):
        assert path in line


class _Deployed:
    """A LocalCluster's deploy step against a real store, the scheduler and serving stand-ins
    recording what they were asked."""

    def __init__(self, tmp_path: Path) -> None:
        from llmgw.server.store import Store

        self.store = Store.open(tmp_path / "llmgw.db")
        self.removed: list[tuple[str, str]] = []

        def remove_replica(replica_id: str, *, why: str, actor: str = "") -> None:
            self.removed.append((replica_id, actor))
            self.store.delete_replica(replica_id)

        self.cp: Any = SimpleNamespace(
            store=self.store,
            leader=SimpleNamespace(
                scheduler=SimpleNamespace(kick=lambda: None, remove_replica=remove_replica)
            ),
            serving=SimpleNamespace(refresh_models=lambda: None),
        )

    def up(self, tmp_path: Path, **given: Any) -> None:
        cluster = LocalCluster(UpOptions(state_dir=tmp_path, **given), say=print)
        cluster.cp = self.cp
        cluster._deploy()

    def deployed(self) -> list[tuple[str, str]]:
        """(message, actor) of each model_deployed event, oldest first."""
        events = reversed(self.store.list_events(kind="model_deployed"))
        return [(e.message, e.actor) for e in events]


def test_up_changes_only_what_it_is_given_and_says_so_as_itself(tmp_path: Path) -> None:
    rig = _Deployed(tmp_path)
    rig.up(tmp_path)
    model = rig.store.get_model(UP_MODEL)
    assert (model.replicas, model.params) == (1, {})
    assert rig.deployed() == [("sim, 1 replicas", "llmgw up")]
    # An operator scales it and slows it down; a plain 'up' again changes nothing.
    rig.store.put_model(UP_MODEL, engine="sim", params={"ttft_ms": 50.0}, replicas=3)
    rig.store.add_replica(UP_MODEL)
    rig.up(tmp_path)
    model = rig.store.get_model(UP_MODEL)
    assert (model.replicas, model.params) == (3, {"ttft_ms": 50.0})
    assert len(rig.deployed()) == 1 and rig.removed == []
    # Given on the command line: applied, and recorded as up's doing.
    rig.up(tmp_path, replicas=2)
    assert rig.store.get_model(UP_MODEL).replicas == 2
    assert rig.deployed()[-1] == ("2 replicas (was 3)", "llmgw up")
    rig.up(tmp_path, ttft_ms=0.0, tps=20.0)  # other engine settings: its replicas restart
    model = rig.store.get_model(UP_MODEL)
    assert (model.replicas, model.params) == (2, {"tps": 20.0})
    assert [actor for _replica, actor in rig.removed] == ["llmgw up"]
    assert rig.deployed()[-1] == ("sim with {'tps': 20.0}, 2 replicas", "llmgw up")
