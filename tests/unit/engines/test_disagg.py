"""Disaggregated shards' commands: each role's flags and environment per engine, checked
against the engines' real help texts (every flag documented, with a value where the help
takes one and one of its choices where it lists them), and the roles refused."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from llmgw.engines.check import check_help
from llmgw.engines.disagg import Handover, runs_bootstrap_server, ucx_devices
from llmgw.engines.kvevents import events_config
from llmgw.engines.launch import build_command, engine_module
from llmgw.engines.registry import ENGINES, disaggregating_engines
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError

HELP = Path(__file__).resolve().parents[2] / "fixtures" / "engines" / "help"

ADDR = "10.0.0.1:29600"
HCAS = ("mlx5_0", "mlx5_1")
BOOTSTRAP = 41001  # the loopback port the agent picked for an SGLang prefill's bootstrap server


def _spec(engine: str, role: str, **kw: object) -> EngineSpec:
    fields: dict[str, object] = {
        "source": "/models/llama-8b",
        "gpus": ("GPU-0", "GPU-1"),
        "disagg_role": role,
        "transfer_addr": ADDR,
        "fabric_devices": HCAS,
        "bootstrap_port": BOOTSTRAP,
        **kw,
    }
    return EngineSpec(engine=engine, model="llama-8b", port=41000, **fields)  # type: ignore[arg-type]


def _help_entry(text: str, flag: str) -> str | None:
    """The value the help shows ``flag`` taking (its metavar or ``{choices}``), None for a
    flag that takes none; AssertionError when the help has no entry for it."""
    # "  --flag {a,b}", "  --flag METAVAR, --alias METAVAR", "  --flag METAVAR [METAVAR ...]",
    # "  --flag   description" (none).
    value = r"(?: (\{[^}]*\}|[^\s,]+))?"
    pattern = re.compile(r"^\s+" + re.escape(flag) + value + r"(?:,|\s|$)", re.M)
    match = pattern.search(text)
    assert match is not None, f"{flag} has no entry of its own in the help text"
    return match.group(1)


def _check_against_help(engine: str, argv: list[str]) -> None:
    """Every flag of ``argv`` has an entry in the engine's help, followed by a value exactly
    where the help shows one, and by one of its choices where it lists them."""
    text = (HELP / f"{engine}.txt").read_text()
    args = argv[len(engine_module(engine).prefix("")) :]
    while args and not args[0].startswith("--"):
        args = args[1:]  # vLLM's positional model tag
    index = 0
    while index < len(args):
        flag = args[index]
        assert flag.startswith("--"), f"{flag!r} is a value without a flag in {args}"
        shown = _help_entry(text, flag)
        if shown is None:
            assert index + 1 == len(args) or args[index + 1].startswith("--"), flag
            index += 1
            continue
        assert index + 1 < len(args), f"{flag} takes a value ({shown}) and has none"
        value = args[index + 1]
        assert not value.startswith("--"), f"{flag} takes a value ({shown}), not {value}"
        if shown.startswith("{"):
            assert value in shown.strip("{}").split(","), f"{flag} {value} is not in {shown}"
        index += 2


# --------------------------------------------------------------------------- the real help


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_role_passes_the_engines_own_help(engine: str, role: str) -> None:
    _check_against_help(engine, build_command(_spec(engine, role)).argv)
    # With the profile's task, parameters and KV events as well.
    module = engine_module(engine)
    params = {key: p.sample for key, p in module.PARAMS.items() if p.flag}
    events = events_config("ipc:///var/lib/llmgw-agent/kv/0123/kv.sock", "s1")
    wide = _spec(engine, role, params=params, kv_events_config=events)
    _check_against_help(engine, build_command(wide).argv)


def test_the_help_check_itself_catches_a_wrong_choice_and_a_missing_value() -> None:
    argv = build_command(_spec("sglang", "prefill")).argv
    wrong = [("mixed" if a == "prefill" else a) for a in argv]
    with pytest.raises(AssertionError, match="is not in"):
        _check_against_help("sglang", wrong)
    cut = argv[: argv.index("--disaggregation-bootstrap-port") + 1]
    with pytest.raises(AssertionError, match="takes a value"):
        _check_against_help("sglang", cut)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_check_covers_both_pools(engine: str) -> None:
    report = check_help(engine, (HELP / f"{engine}.txt").read_text(), source="test")
    assert report.ok, report.missing
    used = {c.flag: c.used_by for c in report.flags}
    pools = ("single node, prefill", "single node, decode")
    if engine == "vllm":
        assert used["--kv-transfer-config"] == pools
    else:
        assert used["--disaggregation-mode"] == pools
        assert used["--disaggregation-transfer-backend"] == pools
        assert used["--disaggregation-ib-device"] == pools
        assert used["--disaggregation-bootstrap-port"] == ("single node, prefill",)


# --------------------------------------------------------------------------- vLLM


def test_vllm_runs_nixl_with_its_side_channel_at_the_transfer_address() -> None:
    command = build_command(_spec("vllm", "prefill"))
    argv = command.argv
    config = argv[argv.index("--kv-transfer-config") + 1]
    assert json.loads(config) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert command.env == {
        "CUDA_VISIBLE_DEVICES": "GPU-0,GPU-1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "29600",
        "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1",
    }
    # Its HTTP server stays on loopback; the side channel alone is on the fabric.
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_vllm_roles_differ_in_nothing_on_the_command_line() -> None:
    prefill = build_command(_spec("vllm", "prefill"))
    decode = build_command(_spec("vllm", "decode"))
    assert (prefill.argv, prefill.env) == (decode.argv, decode.env)


def test_vllm_profile_args_come_after_the_transfer_config() -> None:
    spec = _spec("vllm", "decode", extra_args=("--enforce-eager",))
    argv = build_command(spec).argv
    assert argv.index("--kv-transfer-config") < argv.index("--enforce-eager")
    assert argv[-1] == "--enforce-eager"


def test_vllm_without_fabric_adapters_leaves_ucx_its_own_choice() -> None:
    env = build_command(_spec("vllm", "decode", fabric_devices=())).env
    assert "UCX_NET_DEVICES" not in env
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "29600"


def test_ucx_devices_name_the_adapters_port_once() -> None:
    assert ucx_devices(("mlx5_0",)) == "mlx5_0:1"
    assert ucx_devices(("mlx5_0", "mlx5_3:2")) == "mlx5_0:1,mlx5_3:2"
    assert ucx_devices(()) == ""


def test_vllm_side_channel_on_ipv6() -> None:
    env = build_command(_spec("vllm", "prefill", transfer_addr="[fd00::1]:29600")).env
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "fd00::1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "29600"


# --------------------------------------------------------------------------- SGLang


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sglang_prefill_runs_its_bootstrap_server_on_loopback_at_the_agents_port() -> None:
    command = build_command(_spec("sglang", "prefill"))
    argv = command.argv
    assert _after(argv, "--disaggregation-mode") == "prefill"
    assert _after(argv, "--disaggregation-transfer-backend") == "mooncake"
    # Its bootstrap server binds the HTTP host, loopback, at the port the agent's relay
    # pipes the transfer address to: nothing of the engine listens beyond loopback.
    assert _after(argv, "--disaggregation-bootstrap-port") == str(BOOTSTRAP)
    assert _after(argv, "--host") == "127.0.0.1"
    assert _after(argv, "--port") == "41000"
    assert "29600" not in argv
    assert _after(argv, "--disaggregation-ib-device") == "mlx5_0,mlx5_1"
    # Its ranks register their KV senders on the transfer host, which the decode dials.
    assert command.env == {"CUDA_VISIBLE_DEVICES": "GPU-0,GPU-1", "SGLANG_HOST_IP": "10.0.0.1"}


def test_sglang_decode_binds_no_bootstrap_server_and_stays_on_loopback() -> None:
    command = build_command(_spec("sglang", "decode"))
    argv = command.argv
    assert _after(argv, "--disaggregation-mode") == "decode"
    assert "--disaggregation-bootstrap-port" not in argv
    assert _after(argv, "--host") == "127.0.0.1"
    assert _after(argv, "--disaggregation-ib-device") == "mlx5_0,mlx5_1"
    # Its KV receiver's socket is on the transfer host, which the prefill pushes to.
    assert command.env["SGLANG_HOST_IP"] == "10.0.0.1"


def test_sglang_prefill_with_an_ipv6_transfer_addr_stays_on_loopback() -> None:
    command = build_command(_spec("sglang", "prefill", transfer_addr="[fd00::1]:29600"))
    assert _after(command.argv, "--host") == "127.0.0.1"
    assert _after(command.argv, "--disaggregation-bootstrap-port") == str(BOOTSTRAP)
    assert command.env["SGLANG_HOST_IP"] == "fd00::1"


def test_only_an_sglang_prefill_runs_a_bootstrap_server_to_relay() -> None:
    assert runs_bootstrap_server(Handover.SGLANG, "prefill")
    assert not runs_bootstrap_server(Handover.SGLANG, "decode")
    assert not runs_bootstrap_server(Handover.SGLANG, "")
    assert not runs_bootstrap_server(Handover.VLLM, "prefill")
    assert not runs_bootstrap_server(None, "prefill")


def test_sglang_adapters_lose_their_port_suffix_and_none_give_no_flag() -> None:
    argv = build_command(_spec("sglang", "decode", fabric_devices=("mlx5_2:1",))).argv
    assert _after(argv, "--disaggregation-ib-device") == "mlx5_2"
    argv = build_command(_spec("sglang", "decode", fabric_devices=())).argv
    assert "--disaggregation-ib-device" not in argv


def test_sglang_profile_may_name_another_transfer_backend_and_it_wins() -> None:
    extra = ("--disaggregation-transfer-backend", "nixl")
    argv = build_command(_spec("sglang", "prefill", extra_args=extra)).argv
    assert argv[-2:] == list(extra)
    assert argv.index("--disaggregation-transfer-backend") < len(argv) - 2
    _check_against_help("sglang", argv)


# --------------------------------------------------------------------------- sim


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sim_takes_its_pull_address(role: str) -> None:
    command = build_command(_spec("sim", role, source="", gpus=()))
    argv = command.argv
    assert _after(argv, "--kv-transfer-addr") == ADDR
    assert _after(argv, "--host") == "127.0.0.1"
    assert command.env == {}


# --------------------------------------------------------------------------- aggregated


@pytest.mark.parametrize("engine", ["sim", "vllm", "sglang", "llamacpp"])
def test_an_aggregated_shard_is_built_as_before(engine: str) -> None:
    plain = EngineSpec(engine=engine, model="m", port=41000, source="/models/m", gpus=("GPU-0",))
    fabric = replace(plain, fabric_devices=HCAS)  # adapters alone add nothing
    assert build_command(plain) == build_command(fabric)
    command = build_command(plain)
    assert not any("disaggregation" in a or "kv-transfer" in a for a in command.argv)
    assert set(command.env) <= {"CUDA_VISIBLE_DEVICES"}


# --------------------------------------------------------------------------- the registry


def test_the_registry_says_which_hand_over_each_engine_speaks() -> None:
    assert ENGINES["vllm"].disagg_handover is Handover.VLLM
    assert ENGINES["sim"].disagg_handover is Handover.VLLM
    assert ENGINES["sglang"].disagg_handover is Handover.SGLANG
    assert ENGINES["llamacpp"].disagg_handover is None
    # The refusal below names these: keep it in step.
    assert disaggregating_engines() == ("sglang", "sim", "vllm")


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            _spec("vllm", "mixed"),
            "disaggregation role 'mixed' is not one llmgw knows; use prefill or decode (or "
            "none for an aggregated replica)",
        ),
        (
            _spec("llamacpp", "prefill", source="/models/m.gguf"),
            "llama.cpp cannot disaggregate prefill and decode; use vllm, sglang or sim (or "
            "deploy the model without prefill and decode pools)",
        ),
        (
            _spec("sglang", "decode", transfer_addr=""),
            "a decode shard needs transfer_addr (host:port where its engine binds its KV "
            "transfer side channel); the control plane sends one with every role, so upgrade "
            "a control plane that does not",
        ),
        (
            _spec("vllm", "", transfer_addr=ADDR),
            f"transfer_addr {ADDR} is given without a disaggregation role; an aggregated shard "
            "transfers no KV cache: give a role (prefill or decode) or no transfer_addr",
        ),
        (
            _spec("sim", "prefill", nodes=2, dist_init_addr="10.0.0.1:29500"),
            "a prefill shard of a 2-node replica: disaggregated pools are single-node replicas "
            "in this release; deploy the pools with nodes 1",
        ),
        (
            _spec("sglang", "prefill", bootstrap_port=0),
            "an SGLang prefill shard needs bootstrap_port, the free loopback port its bootstrap "
            "server binds (it binds the HTTP --host, 127.0.0.1): the agent picks one and relays "
            f"transfer_addr {ADDR} to it; a caller that builds the command itself must pick one "
            "too",
        ),
    ],
    ids=["unknown-role", "llamacpp", "no-addr", "addr-without-role", "multi-node", "no-bootstrap"],
)
def test_a_role_that_cannot_run_is_refused(spec: EngineSpec, message: str) -> None:
    with pytest.raises(EngineError) as info:
        build_command(spec)
    assert info.value.message == message


@pytest.mark.parametrize("addr", ["10.0.0.1", "10.0.0.1:", "10.0.0.1:http", ":29600"])
def test_a_transfer_addr_that_is_not_host_port_is_refused(addr: str) -> None:
    with pytest.raises(EngineError, match=r"transfer_addr .* is not host:port \(e\.g\."):
        build_command(_spec("vllm", "prefill", transfer_addr=addr))
