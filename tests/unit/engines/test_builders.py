"""The commands llmgw builds for each engine: exact argv, environment, who serves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw.engines import launch
from llmgw.engines.kvevents import events_config
from llmgw.engines.launch import build_argv, build_command, check_params, self_argv
from llmgw.engines.registry import AVAILABLE_ENGINES
from llmgw.engines.spec import EngineCommand, EngineSpec
from llmgw.errors import EngineError

TWO_GPUS = ("GPU-aaaa", "GPU-bbbb")


def _host_of(argv: list[str]) -> str:
    for flag in ("--host", "-H"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    raise AssertionError(f"no --host in {argv}")


# --------------------------------------------------------------------------- registry


def test_every_engine_llmgw_knows_is_available() -> None:
    assert AVAILABLE_ENGINES == ("sim", "vllm", "sglang", "llamacpp")


@pytest.mark.parametrize("engine", ["", "SIM", "tgi", "llama.cpp"])
def test_unknown_engine_names_the_known_ones(engine: str) -> None:
    with pytest.raises(EngineError) as info:
        build_command(EngineSpec(engine=engine, model="m", port=8000))
    message = str(info.value)
    assert repr(engine) in message
    for name in AVAILABLE_ENGINES:
        assert name in message


# --------------------------------------------------------------------------- vLLM


def test_vllm_single_node() -> None:
    spec = EngineSpec(
        engine="vllm",
        model="llama-8b",
        port=41000,
        source="/models/llama-8b",
        binary="/opt/vllm/bin/vllm",
        gpus=TWO_GPUS,
        params={"max_model_len": "8192", "gpu_memory_utilization": "0.85"},
        extra_args=("--enforce-eager",),
    )
    cmd = build_command(spec)
    assert cmd == EngineCommand(
        argv=[
            "/opt/vllm/bin/vllm",
            "serve",
            "/models/llama-8b",
            "--served-model-name",
            "llama-8b",
            "--host",
            "127.0.0.1",
            "--port",
            "41000",
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "8192",
            "--gpu-memory-utilization",
            "0.85",
            "--enforce-eager",
        ],
        env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"},
        serves=True,
        health_path="/health",
    )


def test_vllm_multi_node_rank0_and_worker() -> None:
    rank0 = EngineSpec(
        engine="vllm",
        model="llama-405b",
        port=41000,
        source="/models/llama-405b",
        gpus=TWO_GPUS,
        nodes=2,
        dist_init_addr="10.1.0.5:29500",
    )
    assert build_command(rank0).argv == [
        "vllm",
        "serve",
        "/models/llama-405b",
        "--served-model-name",
        "llama-405b",
        "--host",
        "127.0.0.1",
        "--port",
        "41000",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "10.1.0.5",
        "--master-port",
        "29500",
    ]
    worker = build_command(replace(rank0, rank=1, port=41001))
    assert worker == EngineCommand(
        argv=[
            "vllm",
            "serve",
            "/models/llama-405b",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.1.0.5",
            "--master-port",
            "29500",
            "--headless",
        ],
        env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"},
        serves=False,
        health_path="",
    )


def test_vllm_without_weights_serves_the_name_as_a_repo_id() -> None:
    argv = build_command(EngineSpec(engine="vllm", model="Qwen/Qwen3-0.6B", port=1)).argv
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]


def test_vllm_ipv6_rendezvous() -> None:
    spec = EngineSpec(engine="vllm", model="m", port=1, nodes=2, dist_init_addr="[fd00::5]:29500")
    argv = build_command(spec).argv
    assert argv[argv.index("--master-addr") + 1] == "fd00::5"
    assert argv[argv.index("--master-port") + 1] == "29500"


# --------------------------------------------------------------------------- SGLang


def test_sglang_single_node() -> None:
    spec = EngineSpec(
        engine="sglang",
        model="qwen",
        port=42000,
        source="/models/qwen",
        binary="/opt/sglang/bin/python",
        gpus=("GPU-aaaa",),
        params={"context_length": "4096", "mem_fraction_static": "0.8"},
    )
    assert build_command(spec) == EngineCommand(
        argv=[
            "/opt/sglang/bin/python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/qwen",
            "--served-model-name",
            "qwen",
            "--host",
            "127.0.0.1",
            "--port",
            "42000",
            "--tp-size",
            "1",
            "--context-length",
            "4096",
            "--mem-fraction-static",
            "0.8",
        ],
        env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa"},
        serves=True,
    )


def test_sglang_multi_node_rank0_and_worker() -> None:
    rank0 = EngineSpec(
        engine="sglang",
        model="ds",
        port=42000,
        source="/models/ds",
        gpus=TWO_GPUS,
        nodes=2,
        dist_init_addr="10.1.0.5:20000",
    )
    expected = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/ds",
        "--served-model-name",
        "ds",
        "--host",
        "127.0.0.1",
        "--port",
        "42000",
        "--tp-size",
        "4",  # every GPU of the replica
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--dist-init-addr",
        "10.1.0.5:20000",
    ]
    assert build_command(rank0).argv == expected
    worker = build_command(replace(rank0, rank=1))
    expected[expected.index("--node-rank") + 1] = "1"
    assert worker.argv == expected
    assert (worker.serves, worker.health_path) == (False, "")


# --------------------------------------------------------------------------- llama.cpp


def test_llamacpp_single_node_on_gpus() -> None:
    spec = EngineSpec(
        engine="llamacpp",
        model="tiny",
        port=43000,
        source="/models/tiny.gguf",
        binary="/usr/local/bin/llama-server",
        gpus=("GPU-aaaa",),
        params={"ctx_size": "2048", "parallel": "2"},
    )
    assert build_command(spec) == EngineCommand(
        argv=[
            "/usr/local/bin/llama-server",
            "--model",
            "/models/tiny.gguf",
            "--alias",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            "43000",
            "--n-gpu-layers",
            "999",
            "--ctx-size",
            "2048",
            "--parallel",
            "2",
        ],
        env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa"},
        serves=True,
    )


def test_llamacpp_without_gpus_stays_on_the_cpu() -> None:
    cmd = build_command(
        EngineSpec(engine="llamacpp", model="tiny", port=1, params={"model_path": "/m.gguf"})
    )
    assert cmd.argv == [
        "llama-server",
        "--model",
        "/m.gguf",
        "--alias",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "1",
        "--n-gpu-layers",
        "0",
    ]
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": ""}


def test_llamacpp_source_wins_over_model_path_and_n_gpu_layers_overrides() -> None:
    spec = EngineSpec(
        engine="llamacpp",
        model="tiny",
        port=1,
        source="/from/source.gguf",
        params={"model_path": "/from/params.gguf", "n_gpu_layers": "12"},
    )
    argv = build_command(spec).argv
    assert argv[argv.index("--model") + 1] == "/from/source.gguf"
    assert argv[argv.index("--n-gpu-layers") + 1] == "12"
    assert argv.count("--n-gpu-layers") == 1


def test_llamacpp_needs_weights() -> None:
    with pytest.raises(EngineError, match=r"GGUF file.*source.*model_path"):
        build_command(EngineSpec(engine="llamacpp", model="tiny", port=1))


def test_llamacpp_multi_node_rank0_dials_the_rpc_workers() -> None:
    rank0 = EngineSpec(
        engine="llamacpp",
        model="big",
        port=43000,
        source="/models/big.gguf",
        binary="/opt/llama/bin/llama-server",
        gpus=TWO_GPUS,
        nodes=3,
        dist_init_addr="10.1.0.5:29500",
        peers=("10.1.0.6:50052", "10.1.0.7:50052"),
    )
    assert build_command(rank0).argv == [
        "/opt/llama/bin/llama-server",
        "--model",
        "/models/big.gguf",
        "--alias",
        "big",
        "--host",
        "127.0.0.1",
        "--port",
        "43000",
        "--n-gpu-layers",
        "999",
        "--rpc",
        "10.1.0.6:50052,10.1.0.7:50052",
    ]
    worker = build_command(replace(rank0, rank=2, port=43001))
    assert worker == EngineCommand(
        argv=["/opt/llama/bin/rpc-server", "--host", "10.1.0.7", "--port", "50052"],
        env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"},
        serves=False,
        health_path="",
    )


def test_llamacpp_worker_on_path_when_the_binary_is_a_bare_name() -> None:
    spec = EngineSpec(
        engine="llamacpp",
        model="big",
        port=1,
        nodes=2,
        rank=1,
        dist_init_addr="10.1.0.5:29500",
        peers=("10.1.0.6:50052",),
    )
    assert build_command(spec).argv[0] == "rpc-server"


@pytest.mark.parametrize("peers", [(), ("10.1.0.6:50052", "10.1.0.7:50052"), ("10.1.0.6",)])
def test_llamacpp_multi_node_needs_one_peer_per_worker(peers: tuple[str, ...]) -> None:
    spec = EngineSpec(
        engine="llamacpp",
        model="big",
        port=1,
        source="/m.gguf",
        nodes=2,
        dist_init_addr="10.1.0.5:29500",
        peers=peers,
    )
    with pytest.raises(EngineError, match="rpc-server"):
        build_command(spec)


def test_llamacpp_worker_binds_the_listen_addr_it_was_given() -> None:
    worker = EngineSpec(
        engine="llamacpp",
        model="big",
        port=1,
        gpus=("GPU-cccc",),
        nodes=3,
        rank=2,
        dist_init_addr="10.1.0.5:50052",
        listen_addr="[fd00::7]:50053",
    )
    assert build_command(worker) == EngineCommand(
        argv=["rpc-server", "--host", "fd00::7", "--port", "50053"],
        env={"CUDA_VISIBLE_DEVICES": "GPU-cccc"},
        serves=False,
        health_path="",
    )
    # listen_addr wins over a list of every worker's endpoint.
    both = replace(worker, peers=("10.1.0.6:50052", "10.1.0.7:50052"))
    assert build_command(both).argv[2:] == ["fd00::7", "--port", "50053"]


@pytest.mark.parametrize(
    ("listen_addr", "needle"),
    [("", "needs the host:port its rpc-server binds"), ("10.1.0.6", "is not host:port")],
)
def test_llamacpp_worker_without_a_usable_listen_addr_is_refused(
    listen_addr: str, needle: str
) -> None:
    worker = EngineSpec(
        engine="llamacpp",
        model="big",
        port=1,
        nodes=2,
        rank=1,
        dist_init_addr="10.1.0.5:50052",
        listen_addr=listen_addr,
    )
    with pytest.raises(EngineError, match=needle):
        build_command(worker)


# --------------------------------------------------------------------------- sim


def test_sim_single_node_is_what_build_argv_always_built() -> None:
    cmd = build_command(EngineSpec(engine="sim", model="m", port=5, params={"seed": "3"}))
    assert cmd.argv == [
        *self_argv(),
        "engine",
        "sim",
        "--host",
        "127.0.0.1",
        "--port",
        "5",
        "--model",
        "m",
        "--seed",
        "3",
    ]
    assert cmd.argv == build_argv("sim", model="m", port=5, params={"seed": "3"})
    assert (cmd.env, cmd.serves) == ({}, True)


def test_sim_cache_params_become_its_flags_within_their_bounds() -> None:
    params = {"block_size": "32", "kv_blocks": "64", "prefill_us_per_token": "2.5"}
    check_params("sim", params)
    argv = build_command(EngineSpec(engine="sim", model="m", port=5, params=params)).argv
    assert argv[-6:] == ["--block-size", "32", "--kv-blocks", "64", "--prefill-us-per-token", "2.5"]
    with pytest.raises(EngineError, match=r"block_size='2048' must be at most 1024"):
        check_params("sim", {"block_size": "2048"})
    with pytest.raises(EngineError, match=r"kv_blocks='0' must be at least 1"):
        check_params("sim", {"kv_blocks": "0"})
    with pytest.raises(EngineError, match=r"prefill_us_per_token='-1' must be at least 0"):
        check_params("sim", {"prefill_us_per_token": "-1"})
    with pytest.raises(EngineError, match="kv_events_config"):
        check_params("sim", {"kv_events_config": "{}"})  # the agent's to add, not a profile's


def test_sim_multi_node_rank0_and_worker() -> None:
    rank0 = EngineSpec(
        engine="sim",
        model="m",
        port=5,
        gpus=("GPU-aaaa",),
        nodes=3,
        dist_init_addr="10.1.0.5:29500",
        extra_args=("--x",),
    )
    tail = ["--nodes", "3", "--rank", "0", "--dist-init-addr", "10.1.0.5:29500", "--x"]
    cmd = build_command(rank0)
    assert cmd.argv[-len(tail) :] == tail
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}
    worker = build_command(replace(rank0, rank=2))
    tail[3] = "2"
    assert worker.argv[-len(tail) :] == tail
    assert (worker.serves, worker.health_path) == (False, "")


# --------------------------------------------------------------------------- for every engine


def _spec(engine: str, **changes: object) -> EngineSpec:
    base = EngineSpec(
        engine=engine,
        model="m",
        port=40000,
        source="/models/m.gguf",
        gpus=TWO_GPUS,
        nodes=2,
        rank=0,
        dist_init_addr="10.9.0.1:29500",
        peers=("10.9.0.2:50052",),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
def test_rank0_binds_loopback_and_serves(engine: str) -> None:
    cmd = build_command(_spec(engine))
    assert cmd.serves is True
    assert cmd.health_path == "/health"
    assert _host_of(cmd.argv) == "127.0.0.1"
    assert "0.0.0.0" not in cmd.argv
    assert cmd.argv[cmd.argv.index("--port") + 1] == "40000"


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
def test_workers_serve_nothing(engine: str) -> None:
    cmd = build_command(_spec(engine, rank=1))
    assert cmd.serves is False
    assert cmd.health_path == ""
    assert "0.0.0.0" not in cmd.argv
    if engine == "llamacpp":
        # rpc-server listens where rank 0 dials it: its own address in peers.
        assert _host_of(cmd.argv) == "10.9.0.2"
    elif "--host" in cmd.argv:
        assert _host_of(cmd.argv) == "127.0.0.1"


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
def test_gpus_go_to_cuda_visible_devices(engine: str) -> None:
    for rank in (0, 1):
        cmd = build_command(_spec(engine, rank=rank))
        assert cmd.env == {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
        assert "GPU-aaaa" not in " ".join(cmd.argv)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_real_engines_without_gpus_see_none(engine: str) -> None:
    cmd = build_command(_spec(engine, gpus=(), nodes=1, dist_init_addr="", peers=()))
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
def test_extra_args_come_last_on_rank0(engine: str) -> None:
    cmd = build_command(_spec(engine, extra_args=("--foo", "bar")))
    assert cmd.argv[-2:] == ["--foo", "bar"]


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"nodes": 2, "dist_init_addr": ""}, "dist_init_addr"),
        ({"nodes": 2, "dist_init_addr": "10.0.0.1"}, "host:port"),
        ({"nodes": 2, "dist_init_addr": "10.0.0.1:99999"}, "host:port"),
        ({"nodes": 2, "dist_init_addr": ":29500"}, "host:port"),
        # One host:port syntax (llmgw.netaddr): IPv6 in brackets, hosts that are names.
        ({"nodes": 2, "dist_init_addr": "fd00::1:29500"}, "needs brackets"),
        ({"nodes": 2, "dist_init_addr": "bad host:29500"}, "not a valid host name"),
        ({"nodes": 2, "rank": 2}, r"rank 2 is not in 0\.\.1"),
        ({"nodes": 0}, "nodes must be at least 1"),
        ({"port": 0}, "port 0"),
        ({"port": 65536}, "port 65536"),
        ({"model": ""}, "model name is empty"),
    ],
)
def test_bad_shapes_are_refused(engine: str, changes: dict[str, object], match: str) -> None:
    with pytest.raises(EngineError, match=match):
        build_command(_spec(engine, **changes))


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
def test_unknown_param_lists_the_known_ones(engine: str) -> None:
    with pytest.raises(EngineError) as info:
        check_params(engine, {"temperature": "0.5"})
    message = str(info.value)
    assert engine in message and "'temperature'" in message
    for name in launch.engine_module(engine).PARAMS:
        assert name in message


@pytest.mark.parametrize(
    ("engine", "key", "value"),
    [
        ("vllm", "max_model_len", "lots"),
        ("vllm", "gpu_memory_utilization", "1.5"),
        ("vllm", "gpu_memory_utilization", "nan"),
        ("sglang", "mem_fraction_static", "0"),
        ("llamacpp", "ctx_size", "-1"),
        ("llamacpp", "n_gpu_layers", "all of them"),
        ("llamacpp", "model_path", " /padded.gguf"),
        ("vllm", "dtype", ""),
    ],
)
def test_bad_param_values_name_the_param(engine: str, key: str, value: str) -> None:
    with pytest.raises(EngineError) as info:
        check_params(engine, {key: value})
    assert key in str(info.value) and repr(value) in str(info.value)


def test_params_are_checked_by_build_command() -> None:
    with pytest.raises(EngineError, match="max_num_seqs"):
        build_command(_spec("vllm", params={"max_num_seqs": "0"}))


# --------------------------------------------------------------------------- tasks


@pytest.mark.parametrize(
    ("engine", "tasks", "flags"),
    [
        ("llamacpp", ("embed",), ["--embedding"]),
        ("llamacpp", ("rerank",), ["--reranking"]),
        ("vllm", ("embed",), ["--runner", "pooling"]),
        ("vllm", ("rerank", "embed"), ["--runner", "pooling"]),  # one runner, given once
        ("sglang", ("rerank",), ["--is-embedding"]),
        ("sim", ("generate", "embed", "rerank"), []),
        ("vllm", ("generate",), []),
    ],
)
def test_task_args_run_the_engine_for_its_task(
    engine: str, tasks: tuple[str, ...], flags: list[str]
) -> None:
    assert launch.task_args(engine, tasks) == flags
    # The scheduler sends them as the shard's first extra args: the engine gets them after
    # its own flags, before the profile's.
    spec = EngineSpec(
        engine=engine,
        model="m",
        port=43000,
        source="/models/m.gguf",
        extra_args=(*flags, "--verbose"),
    )
    argv = build_command(spec).argv
    assert argv[len(argv) - len(flags) - 1 :] == [*flags, "--verbose"]


@pytest.mark.parametrize(
    ("engine", "tasks", "message"),
    [
        (
            "vllm",
            ("generate", "embed"),
            "one vllm replica cannot do generate and embed at once (it can do embed + rerank "
            "together); give each task a profile of its own and deploy them as two models "
            "(e.g. NAME and NAME-embed)",
        ),
        (
            "llamacpp",
            ("embed", "rerank"),
            "one llamacpp replica cannot do embed and rerank at once; give each task a profile "
            "of its own and deploy them as two models (e.g. NAME and NAME-embed)",
        ),
        ("sglang", ("generate", "rerank"), "one sglang replica cannot do generate and rerank"),
        ("tgi", ("embed",), "engine 'tgi' is not one llmgw can run"),
    ],
)
def test_task_args_refuse_what_one_process_cannot_do(
    engine: str, tasks: tuple[str, ...], message: str
) -> None:
    with pytest.raises(EngineError) as info:
        launch.task_args(engine, tasks)
    assert str(info.value).startswith(message)


# --------------------------------------------------------------------------- KV cache events

_EVENTS = events_config("ipc:///var/lib/llmgw-agent/kv/0123456789abcdef/kv.sock", "shard-1")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_an_engine_publishing_kv_events_gets_its_config(engine: str) -> None:
    argv = build_command(_spec(engine, nodes=1, dist_init_addr="", kv_events_config=_EVENTS)).argv
    assert argv[argv.index("--kv-events-config") + 1] == _EVENTS
    assert argv.count("--kv-events-config") == 1
    assert ("--enable-cache-report" in argv) is (engine == "sglang")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_without_a_kv_events_config_the_flag_is_absent(engine: str) -> None:
    argv = build_command(_spec(engine, nodes=1, dist_init_addr="")).argv
    assert "--kv-events-config" not in argv
    assert "--enable-cache-report" not in argv


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_a_worker_publishes_no_kv_events(engine: str) -> None:
    # rank 0's scheduler owns the prefix cache; a worker has none of its own to report.
    argv = build_command(_spec(engine, rank=1, kv_events_config=_EVENTS)).argv
    assert "--kv-events-config" not in argv
    rank0 = build_command(_spec(engine, rank=0, kv_events_config=_EVENTS)).argv
    assert "--kv-events-config" in rank0


def test_an_engine_without_kv_events_refuses_a_config() -> None:
    with pytest.raises(EngineError, match=r"llamacpp publishes no KV cache events.*sim, vllm"):
        build_command(_spec("llamacpp", kv_events_config=_EVENTS))


# --- sleep mode ------------------------------------------------------------------------


def test_vllm_with_sleep_mode_serves_its_sleep_routes_in_dev_mode() -> None:
    from llmgw.engines.launch import sleep_args

    flags = sleep_args("vllm", 1)
    assert flags == ["--enable-sleep-mode"]
    spec = EngineSpec(engine="vllm", model="m", port=8000, source="/w", extra_args=tuple(flags))
    command = build_command(spec)
    assert "--enable-sleep-mode" in command.argv
    # The sleep routes are dev routes (vllm/entrypoints/serve/dev/api_router.py).
    assert command.env["VLLM_SERVER_DEV_MODE"] == "1"
    plain = build_command(EngineSpec(engine="vllm", model="m", port=8000, source="/w"))
    assert "VLLM_SERVER_DEV_MODE" not in plain.env


def test_sglang_sleeps_at_level_1_with_the_weights_backed_up() -> None:
    from llmgw.engines.launch import sleep_args

    assert sleep_args("sglang", 1) == ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    with pytest.raises(EngineError, match="engine sglang sleeps at level 1, not 2"):
        sleep_args("sglang", 2)


def test_llamacpp_cannot_sleep_and_the_refusal_names_the_engines_that_can() -> None:
    from llmgw.engines.launch import sleep_args

    with pytest.raises(EngineError, match="engine llamacpp cannot sleep") as caught:
        sleep_args("llamacpp", 1)
    assert "sglang, sim, vllm" in str(caught.value) or "sim, vllm, sglang" in str(caught.value)


def test_the_registry_says_which_engines_sleep_at_which_levels() -> None:
    from llmgw.engines.registry import get_engine, sleeping_engines
    from llmgw.engines.sleep import SleepApi

    assert sleeping_engines() == ("sglang", "sim", "vllm")
    assert get_engine("vllm").sleep_levels == (1, 2)
    assert get_engine("vllm").sleep_api is SleepApi.VLLM
    assert get_engine("sglang").sleep_api is SleepApi.SGLANG
    assert get_engine("llamacpp").sleep_api is None


def test_the_sleep_calls_of_each_protocol() -> None:
    from llmgw.engines.sleep import SleepApi, is_sleeping_call, sleep_call, wake_calls

    assert sleep_call(SleepApi.VLLM, 2).path == "/sleep"
    assert dict(sleep_call(SleepApi.VLLM, 2).query) == {"level": "2", "mode": "wait"}
    assert [c.path for c in wake_calls(SleepApi.VLLM, 1)] == ["/wake_up"]
    # Level 2 dropped the weights: reloaded, and the prefix cache that indexed them reset.
    assert [c.path for c in wake_calls(SleepApi.VLLM, 2)] == [
        "/wake_up",
        "/collective_rpc",
        "/reset_prefix_cache",
    ]
    assert sleep_call(SleepApi.SGLANG, 1).path == "/release_memory_occupation"
    assert [c.path for c in wake_calls(SleepApi.SGLANG, 1)] == ["/resume_memory_occupation"]
    assert is_sleeping_call(SleepApi.SGLANG) is None
    assert is_sleeping_call(SleepApi.VLLM) is not None
