"""engine-check: every flag llmgw may pass, looked up in the engine's own help text."""

from __future__ import annotations

import os
import stat
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from llmgw.cli.ctl.engine_check import engine_check
from llmgw.engines.check import (
    FROM_HELP_OUTPUT,
    AgentEngines,
    FoundEngine,
    check_engine,
    check_help,
    command_flags,
    documents,
    locate_engine,
    widest_specs,
)
from llmgw.engines.launch import build_command, engine_module
from llmgw.errors import EngineError

HELP = Path(__file__).resolve().parents[2] / "fixtures" / "engines" / "help"


def _text(engine: str) -> str:
    return (HELP / f"{engine}.txt").read_text()


def _invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(engine_check, list(args), input=input, catch_exceptions=False)


# --------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    "line",
    [
        "--port PORT            port to listen",
        "  --port, -p PORT",
        "  -p, --port PORT",
        "  --port=PORT",
        "usage: x [--port PORT] [-h]",
        "--host HOST\n--port\n",
        "(env: X) --port",
    ],
)
def test_a_flag_is_documented_as_a_token(line: str) -> None:
    assert documents(line, "--port")


@pytest.mark.parametrize(
    "line",
    [
        "--port-range LO-HI     ports to use",
        "--no-port              do not listen",
        "--ports PORTS",
        "--port_number N",
        "--reuse-port",
        "report--port",
    ],
)
def test_a_longer_flag_does_not_document_a_prefix_of_it(line: str) -> None:
    assert not documents(line, "--port")


def test_short_and_long_forms_of_llama_server() -> None:
    line = "-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers"
    for flag in ("-ngl", "--gpu-layers", "--n-gpu-layers"):
        assert documents(line, flag)
    assert not documents(line, "-n")
    assert not documents(line, "--layers")
    assert not documents("-m,    --model FNAME", "-mg")
    assert documents("-m,    --model FNAME", "-m")


def test_command_flags_skips_program_values_and_positionals() -> None:
    argv = ["vllm", "serve", "/m", "--port", "1", "--x=y", "--tp", "-1", "-q", "fp8", "--port"]
    assert command_flags(argv, ["vllm", "serve"]) == ["--port", "--x", "--tp", "-q"]


# --------------------------------------------------------------------------- the widest commands


@pytest.mark.parametrize("engine", ["sim", "vllm", "sglang", "llamacpp"])
def test_widest_commands_carry_every_parameter_and_the_multi_node_flags(engine: str) -> None:
    (form0, rank0), (form1, worker), *_ = widest_specs(engine)
    assert (form0, form1) == ("rank 0", "worker")
    assert (rank0.nodes, rank0.rank, worker.rank) == (2, 0, 1)
    module = engine_module(engine)
    argv = build_command(rank0).argv
    for param in module.PARAMS.values():
        if param.flag:
            assert param.flag in argv
    assert build_command(worker).serves is False


def test_vllm_widest_flags() -> None:
    report = check_help("vllm", _text("vllm"), source="test")
    assert [(c.flag, c.used_by) for c in report.flags] == [
        ("--served-model-name", ("rank 0",)),
        ("--host", ("rank 0",)),
        ("--port", ("rank 0",)),
        ("--tensor-parallel-size", ("rank 0", "worker")),
        ("--pipeline-parallel-size", ("rank 0", "worker")),
        ("--nnodes", ("rank 0", "worker")),
        ("--node-rank", ("rank 0", "worker")),
        ("--master-addr", ("rank 0", "worker")),
        ("--master-port", ("rank 0", "worker")),
        ("--max-model-len", ("rank 0", "worker")),
        ("--gpu-memory-utilization", ("rank 0", "worker")),
        ("--max-num-seqs", ("rank 0", "worker")),
        ("--dtype", ("rank 0", "worker")),
        ("--quantization", ("rank 0", "worker")),
        ("--kv-events-config", ("rank 0",)),
        ("--headless", ("worker",)),
        # embed and rerank run the same pooling runner: one form for both.
        ("--runner", ("rank 0, task embed/rerank",)),
        # Both sleep levels need the one flag: one form for both.
        ("--enable-sleep-mode", ("rank 0, sleep level 1/2",)),
        # Both pools of a disaggregated model: NixlConnector whatever the role.
        ("--kv-transfer-config", ("single node, prefill", "single node, decode")),
    ]
    assert report.ok and not report.warnings and not report.skipped


@pytest.mark.parametrize(
    ("engine", "forms"),
    [
        ("sim", []),
        ("vllm", [("rank 0, task embed/rerank", ["--runner", "pooling"])]),
        ("sglang", [("rank 0, task embed/rerank", ["--is-embedding"])]),
        (
            "llamacpp",
            [("rank 0, task embed", ["--embedding"]), ("rank 0, task rerank", ["--reranking"])],
        ),
    ],
)
def test_each_task_with_flags_of_its_own_is_a_form_checked(
    engine: str, forms: list[tuple[str, list[str]]]
) -> None:
    tasks = [(f, s) for f, s in widest_specs(engine)[2:] if ", task " in f]
    got = [(form, list(spec.extra_args)) for form, spec in tasks]
    assert got == forms
    for _, spec in tasks:
        argv = build_command(spec).argv
        assert argv[-len(spec.extra_args) :] == list(spec.extra_args)


def test_a_task_flag_the_engine_lacks_is_missing() -> None:
    # vLLM before 0.10.1 had --task embed, not --runner pooling: engine-check says so.
    text = _text("vllm").replace("--runner", "--task")
    report = check_help("vllm", text, source="test")
    assert report.missing == ["--runner"]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_the_fixture_help_texts_pass(engine: str) -> None:
    report = check_help(engine, _text(engine), source="test")
    assert report.ok, report.missing
    assert report.warnings == ()
    assert report.version == FROM_HELP_OUTPUT


def test_llamacpp_worker_is_another_program() -> None:
    report = check_help("llamacpp", _text("llamacpp"), source="test")
    assert report.skipped == (
        "worker: runs rpc-server, not llama-server; its flags are not in this help text",
    )
    assert "--rpc" in [c.flag for c in report.flags]


# --------------------------------------------------------------------------- failures


def test_a_renamed_flag_is_missing() -> None:
    text = _text("sglang").replace("--dist-init-addr", "--dist-init-address")
    report = check_help("sglang", text, source="test")
    assert report.missing == ["--dist-init-addr"]
    assert not report.ok


def test_truncated_help_warns() -> None:
    text = "\n".join(_text("llamacpp").splitlines()[100:400])
    report = check_help("llamacpp", text, source="test")
    assert any("does not document --help" in w for w in report.warnings)
    assert "--alias" in report.missing  # documented further down


# --------------------------------------------------------------------------- the command


def test_cli_passes_on_a_fixture(tmp_path: Path) -> None:
    result = _invoke("vllm", "--help-output", str(HELP / "vllm.txt"))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "engine vllm, version unknown (from --help-output)"
    assert lines[1].startswith("help: --help-output (")
    assert lines[3].split() == ["FLAG", "USED", "BY", "HELP"]
    assert lines[4].split() == ["--served-model-name", "rank", "0", "ok"]
    assert ["--headless", "worker", "ok"] in [line.split() for line in lines]
    assert lines[-1] == "ok: all 19 flags are documented"  # with --kv-transfer-config


def test_cli_fails_listing_missing_flags_and_version(tmp_path: Path) -> None:
    help_file = tmp_path / "help.txt"
    help_file.write_text(_text("llamacpp").replace("--alias", "--nickname"))
    result = _invoke("llamacpp", "--help-output", str(help_file))
    assert result.exit_code == 1
    assert ["--alias", "rank", "0", "MISSING"] in [
        line.split() for line in result.stdout.splitlines()
    ]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: llamacpp does not document 1 of the 11 flags llmgw may pass it: --alias "
        "(engine version: unknown (from --help-output)); upgrade the engine to one that has "
        "them, or deploy its models with another engine"
    )


def test_cli_warns_on_truncated_help(tmp_path: Path) -> None:
    help_file = tmp_path / "help.txt"
    help_file.write_text("\n".join(_text("llamacpp").splitlines()[100:400]) + "\n")
    result = _invoke("llamacpp", "--help-output", str(help_file))
    assert result.exit_code == 1
    assert "warning: the help text does not document --help itself" in result.stderr


def test_cli_reads_help_from_stdin_and_from_text() -> None:
    assert _invoke("sglang", "--help-output", "-", input=_text("sglang")).exit_code == 0
    assert _invoke("sglang", "--help-output", _text("sglang")).exit_code == 0


def test_cli_refuses_a_help_output_that_is_neither_file_nor_text() -> None:
    result = _invoke("vllm", "--help-output", "/no/such/help.txt")
    assert result.exit_code == 2
    assert "is not a file" in result.stderr


def test_cli_refuses_an_unknown_engine() -> None:
    result = _invoke("tgi", "--help-output", "-", input="")
    assert result.exit_code == 2
    assert "'tgi' is not one of 'sim', 'vllm', 'sglang', 'llamacpp'" in result.stderr


# --------------------------------------------------------------------------- running the engine


def _fake_engine(path: Path, help_text: str, version: str = "fake 1.2.3") -> Path:
    (path.parent / "help.txt").write_text(help_text)
    path.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            case "$1" in
                --help) cat '{path.parent / "help.txt"}' ;;
                --version) echo 'version: {version}' >&2 ;;
                *) echo "unexpected: $*" >&2; exit 3 ;;
            esac
            """
        )
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_live_check_runs_help_and_version(tmp_path: Path) -> None:
    binary = _fake_engine(tmp_path / "llama-server", _text("llamacpp"))
    report = check_engine("llamacpp", binary=str(binary))
    assert report.ok
    assert report.version == "fake 1.2.3"
    assert report.source == f"{binary} --help"


def test_live_check_finds_the_engine_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_engine(tmp_path / "llama-server", _text("llamacpp").replace("--rpc", "--rpc-x"))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    result = _invoke("llamacpp")
    assert result.exit_code == 1
    assert "--rpc" in result.stderr and "(engine version: fake 1.2.3)" in result.stderr


def test_live_check_finds_the_engine_through_agent_config(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    binary = _fake_engine(tmp_path / "bin" / "my-llama", _text("llamacpp"))
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"server: 127.0.0.1:7443\nnode_id: n1\nstate_dir: {tmp_path / 'state'}\n"
        f"engines:\n  llamacpp:\n    bin: {binary}\n"
    )
    result = _invoke("llamacpp", "--agent-config", str(config))
    assert result.exit_code == 0, result.output
    assert f"help: {binary} --help" in result.stdout


def test_live_check_reports_a_failing_help(tmp_path: Path) -> None:
    binary = tmp_path / "vllm"
    binary.write_text("#!/bin/sh\necho 'ImportError: libcudart.so.12' >&2\nexit 1\n")
    binary.chmod(0o755)
    with pytest.raises(EngineError, match=r"serve --help=all' failed \(exit 1\).*libcudart"):
        check_engine("vllm", binary=str(binary))


def test_live_check_of_vllm_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    # vLLM 0.33/0.34 pick a platform before they parse a flag: with no GPU to find, even
    # `vllm --version` and `vllm serve --help=all` stop (vllm/config/device.py). Its CPU
    # platform prints the same flags, so engine-check asks for it.
    (tmp_path / "help.txt").write_text(_text("vllm"))
    binary = tmp_path / "vllm"
    binary.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "${{VLLM_TARGET_DEVICE:-cuda}}" != cpu ]; then
                echo 'RuntimeError: Failed to infer device type, please set the environment \
            variable `VLLM_LOGGING_LEVEL=DEBUG` to turn on verbose logging' >&2
                exit 1
            fi
            case "$*" in
                "serve --help=all") cat '{tmp_path / "help.txt"}' ;;
                --version) echo 0.34.0 ;;
                *) echo "unexpected: $*" >&2; exit 3 ;;
            esac
            """
        )
    )
    binary.chmod(0o755)
    report = check_engine("vllm", binary=str(binary))
    assert report.ok, report.missing
    assert report.version == "0.34.0"
    assert report.source == f"VLLM_TARGET_DEVICE=cpu {binary} serve --help=all"


def test_live_check_without_the_engine_says_how_to_give_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = _invoke("llamacpp")
    assert result.exit_code == 1
    assert "llama-server is not on PATH; pass --binary PROGRAM" in result.stderr


@pytest.mark.parametrize(
    ("engine", "flags"),
    [
        ("vllm", ["--kv-events-config"]),
        ("sglang", ["--kv-events-config", "--enable-cache-report"]),
    ],
)
def test_the_kv_events_flags_are_checked_and_documented(engine: str, flags: list[str]) -> None:
    report = check_help(engine, _text(engine), source="test")
    checked = {c.flag: c for c in report.flags}
    for flag in flags:
        assert checked[flag].used_by == ("rank 0",)  # workers publish nothing
        assert checked[flag].documented
    # An engine's help that predates the flag fails the check, naming it.
    older = "\n".join(line for line in _text(engine).splitlines() if flags[0] not in line)
    assert flags[0] in check_help(engine, older, source="test").missing


def test_the_built_in_sim_documents_every_flag_llmgw_passes_it() -> None:
    # The sim's CLI and its command builder live in different modules: keep them in step.
    report = check_engine("sim")
    assert report.ok, report.missing
    assert {"--nodes", "--rank", "--dist-init-addr"} <= {c.flag for c in report.flags}


@dataclass(frozen=True)
class _Found:
    name: str
    argv: tuple[str, ...]
    origin: str = "engines.llamacpp.bin"
    problem: str = ""


def _never() -> list[FoundEngine]:
    raise AssertionError("the agent's configuration was read, though nothing needed it")


def test_the_agents_engines_are_looked_up_only_when_needed(tmp_path: Path) -> None:
    agent = AgentEngines(tmp_path / "agent.yaml", _never)
    assert locate_engine("llamacpp", binary="/opt/llama-server", agent=agent) == "/opt/llama-server"
    assert locate_engine("sim", agent=agent) == ""
    assert check_engine("llamacpp", help_text=_text("llamacpp"), agent=agent).ok


def test_the_agents_engines_name_the_program_or_why_not(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    found = [_Found("vllm", ("/opt/vllm",)), _Found("llamacpp", ("/opt/llama-server", "-x"))]
    assert locate_engine("llamacpp", agent=AgentEngines(config, lambda: found)) == (
        "/opt/llama-server"
    )
    broken = [_Found("llamacpp", (), origin="/state/engines/llamacpp/1", problem="no manifest")]
    with pytest.raises(EngineError, match=r"llamacpp \(/state/engines/llamacpp/1\): no manifest"):
        locate_engine("llamacpp", agent=AgentEngines(config, lambda: broken))
    with pytest.raises(EngineError, match=f"sglang is not configured in {config}, not on PATH"):
        locate_engine("sglang", agent=AgentEngines(config, lambda: found))


@pytest.mark.parametrize(
    ("engine", "forms"),
    [
        ("sim", [("rank 0, sleep level 1/2", ["--enable-sleep-mode"])]),
        ("vllm", [("rank 0, sleep level 1/2", ["--enable-sleep-mode"])]),
        (
            "sglang",
            [("rank 0, sleep level 1", ["--enable-memory-saver", "--enable-weights-cpu-backup"])],
        ),
        ("llamacpp", []),
    ],
)
def test_each_sleep_level_is_a_form_checked(
    engine: str, forms: list[tuple[str, list[str]]]
) -> None:
    got = [(f, list(s.extra_args)) for f, s in widest_specs(engine)[2:] if "sleep" in f]
    assert got == forms


@pytest.mark.parametrize(
    ("engine", "flag"),
    [
        ("vllm", "--enable-sleep-mode"),
        ("sglang", "--enable-memory-saver"),
        ("sglang", "--enable-weights-cpu-backup"),
    ],
)
def test_the_sleep_flags_are_documented_and_an_engine_without_them_fails(
    engine: str, flag: str
) -> None:
    report = check_help(engine, _text(engine), source="test")
    checked = {c.flag: c for c in report.flags}
    assert checked[flag].documented
    assert checked[flag].used_by == (next(f for f in checked[flag].used_by if "sleep" in f),)
    older = _text(engine).replace(flag, "--something-else")
    assert flag in check_help(engine, older, source="test").missing
