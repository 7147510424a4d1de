"""llmgw.agent.sandbox: what an engine's sandbox sees (the plan, bwrap's command line), the
refusals of a profile's extra paths, the reason an engine that failed on a hidden path gets,
and what an engine's program needs; with the real bwrap, what a sandboxed process can open."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.agent.bwrap import Bubblewrap, BwrapFeatures
from llmgw.agent.sandbox import (
    Sandboxes,
    SandboxLayout,
    SandboxPlan,
    hidden_path_reason,
    program_roots,
)
from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.errors import ShardError
from tests.ci import require_tools

FEATURES = BwrapFeatures(program="/usr/bin/bwrap", fresh_proc=True, disable_userns=True)


def layout(tmp_path: Path) -> SandboxLayout:
    for name in ("state", "conf", "models", "cache"):
        (tmp_path / name).mkdir(exist_ok=True)
    return SandboxLayout.for_node(
        tmp_path / "state",
        config_file=tmp_path / "conf" / "agent.yaml",
        key_file=tmp_path / "state" / "node.key",
        models_root=tmp_path / "models",
        cache_root=tmp_path / "cache",
    )


def plan(tmp_path: Path, **kwargs: object) -> SandboxPlan:
    args: dict[str, object] = {
        "programs": [],
        "model": None,
        "policy": SandboxPolicy(),
        "multi_node": False,
    }
    args.update(kwargs)
    return layout(tmp_path).plan("s1", **args)  # type: ignore[arg-type]


def test_the_plan_shows_the_system_the_model_and_the_scratch_and_hides_the_agents_parts(
    tmp_path: Path,
) -> None:
    model = tmp_path / "models" / "m1"
    other = tmp_path / "models" / "m2"
    model.mkdir(parents=True)
    other.mkdir()
    # A program folder that holds the whole tree: what the agent's parts are covered in.
    p = plan(tmp_path, programs=[tmp_path], model=model)
    state = (tmp_path / "state").resolve()
    scratch = state / "scratch" / "s1"
    assert p.scratch == scratch
    assert p.visible(Path("/usr/bin/env")) == "ro"
    assert p.visible(Path("/etc/hostname")) == "ro"
    if Path("/etc/llmgw").is_dir():  # covered where it exists (the dry run's nodes)
        assert p.visible(Path("/etc/llmgw/agent.yaml")) is None
    assert p.visible(Path("/sys/class")) == "ro"
    assert p.visible(model.resolve() / "config.json") == "ro"
    assert p.visible(scratch / "home" / ".cache") == "rw"
    # The state directory (the key, the other shards' scratch), the configuration's folder
    # and the other models are covered, though the program folder holds them.
    assert p.visible(state / "node.key") is None
    assert p.visible(state / "scratch" / "s2" / "home") is None
    assert p.visible((tmp_path / "conf" / "agent.yaml").resolve()) is None
    assert p.visible(other.resolve()) is None
    assert p.visible(tmp_path.resolve() / "elsewhere") == "ro"
    # /tmp is its own, not the node's; /var/tmp is the scratch's.
    assert p.visible(Path("/tmp/x")) is None
    assert p.visible(Path("/var/tmp")) is None
    assert p.visible(Path("/home")) is None and p.visible(Path("/root")) is None
    assert p.env["HOME"] == str(scratch / "home")
    assert p.env["TMPDIR"] == str(scratch / "tmp")
    assert p.env["HF_HOME"] == str(scratch / "cache" / "huggingface")


def test_the_command_keeps_bwraps_order_and_has_no_die_with_parent(tmp_path: Path) -> None:
    model = tmp_path / "models" / "m1"
    model.mkdir(parents=True)
    argv = plan(tmp_path, programs=[tmp_path], model=model).command(["engine", "--x"], FEATURES)
    assert argv[:5] == [
        "/usr/bin/bwrap",
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--disable-userns",
    ]
    assert argv[-3:] == ["--", "engine", "--x"]
    assert "--die-with-parent" not in argv and "--new-session" not in argv
    assert "--share-net" not in argv and "--unshare-net" not in argv  # the host's loopback
    joined = " ".join(argv)
    state = str((tmp_path / "state").resolve())
    # The cover over the state directory comes after the folder that holds it, and the
    # scratch (inside it) after the cover.
    assert joined.index(f"--ro-bind {tmp_path.resolve()} ") < joined.index(f"--tmpfs {state} ")
    assert joined.index(f"--tmpfs {state} ") < joined.index(f"--bind {state}/scratch/s1 ")
    assert joined.index("--tmpfs /tmp ") < joined.index(f"--bind {state}/scratch/s1 ")
    assert "--proc /proc" in joined and "--dev /dev" in joined and "--tmpfs /dev/shm" in joined
    host_proc = BwrapFeatures("/usr/bin/bwrap", fresh_proc=False, disable_userns=False)
    older = " ".join(plan(tmp_path).command(["engine"], host_proc))
    assert "--ro-bind /proc /proc" in older and "--disable-userns" not in older


def test_extra_paths_are_bound_and_one_that_exposes_the_agent_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    out = tmp_path / "out"
    data.mkdir()
    out.mkdir()
    p = plan(tmp_path, policy=SandboxPolicy(extra_ro=(str(data),), extra_rw=(str(out),)))
    assert p.visible(data.resolve() / "x") == "ro"
    assert p.visible(out.resolve() / "x") == "rw"
    for given, key, secret in (
        (str(tmp_path / "state"), "extra_ro", tmp_path / "state"),
        (str(tmp_path), "extra_rw", tmp_path / "state"),
        (str(tmp_path / "conf" / "sub"), "extra_ro", tmp_path / "conf"),
        ("/etc", "extra_ro", Path("/etc/llmgw")),
    ):
        policy = SandboxPolicy(**{key: (given,)})  # type: ignore[arg-type]
        with pytest.raises(ShardError) as info:
            plan(tmp_path, policy=policy)
        assert f"sandbox.{key} entry {given} is or holds {secret.resolve()}" in str(info.value)
        assert "remove it from the profile" in str(info.value)
    with pytest.raises(ShardError, match="'data' is not an absolute path"):
        plan(tmp_path, policy=SandboxPolicy(extra_ro=("data",)))
    with pytest.raises(ShardError, match="move the weights under models_root"):
        plan(tmp_path, model=tmp_path / "state")


def test_gpu_and_fabric_device_nodes_are_bound_when_the_node_has_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = {
        "/dev/nvidia*": ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"],
        "/dev/infiniband": ["/dev/infiniband"],
    }
    monkeypatch.setattr("llmgw.agent.sandbox.glob.glob", lambda pattern: found.get(pattern, []))
    single = plan(tmp_path).command(["e"], FEATURES)
    assert "--dev-bind /dev/nvidia0 /dev/nvidia0" in " ".join(single)
    assert "/dev/infiniband" not in single
    multi = plan(tmp_path, multi_node=True).command(["e"], FEATURES)
    assert "--dev-bind /dev/infiniband /dev/infiniband" in " ".join(multi)


@pytest.mark.parametrize(
    "line",
    [
        "FileNotFoundError: [Errno 2] No such file or directory: '{p}'",
        "PermissionError: [Errno 13] Permission denied: '{p}'",
        "gguf_init_from_file: failed to open GGUF file '{p}' (No such file or directory)",
        "llama_model_load: error loading model: failed to open {p}: No such file or directory",
        "open {p}: no such file or directory",
    ],
)
def test_a_failure_on_a_path_the_sandbox_hides_names_the_path_and_the_key(
    tmp_path: Path, line: str
) -> None:
    hidden = tmp_path / "elsewhere" / "tokenizer.json"
    hidden.parent.mkdir()
    hidden.write_text("{}")
    p = plan(tmp_path)
    tail = "loading\n" + line.format(p=hidden) + "\nexiting\n"
    assert hidden_path_reason(p, tail) == (
        f"the engine could not open {hidden}, which its sandbox hides; add it to the "
        "profile's sandbox.extra_ro (or sandbox.extra_rw for a path it writes)"
    )


def test_no_reason_for_paths_it_shows_or_that_the_node_does_not_have(tmp_path: Path) -> None:
    p = plan(tmp_path)
    missing = tmp_path / "nowhere" / "x.bin"
    tail = (
        f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'\n"
        "FileNotFoundError: [Errno 2] No such file or directory: '/usr/lib/nothing-here.so'\n"
        "ERROR /usr/bin/env mentioned without a failure word is no failure\n"
    )
    assert hidden_path_reason(p, tail) == ""
    data = tmp_path / "data"
    data.mkdir()
    shown = plan(tmp_path, policy=SandboxPolicy(extra_ro=(str(data),)))
    write = f"OSError: [Errno 30] Read-only file system: '{data}'"
    assert "sandbox.extra_rw" in hidden_path_reason(shown, write)
    assert "shows read-only" in hidden_path_reason(shown, write)


def test_program_roots_are_the_install_prefix_not_a_home_or_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    venv = tmp_path / "opt" / "vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {Path(sys.base_prefix) / 'bin'}\n")
    (venv / "bin" / "vllm").write_text(f"#!{venv / 'bin' / 'python'}\n")
    os.symlink(sys.executable, venv / "bin" / "python")
    roots = program_roots(str(venv / "bin" / "vllm"), state)
    assert roots[0] == venv
    assert Path(os.path.realpath(sys.base_prefix)) in roots  # the venv's interpreter
    # An engine installed under the state directory: its version's folder, nothing more.
    installed = state / "engines" / "llamacpp" / "b1" / "build" / "bin" / "llama-server"
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"\x7fELF")
    assert program_roots(str(installed), state) == [(state / "engines/llamacpp/b1").resolve()]
    # A program in a plain folder: that folder; in a home's bin: the bin folder alone.
    plain = tmp_path / "tools" / "engine"
    plain.parent.mkdir()
    plain.write_bytes(b"\x7fELF")
    assert program_roots(str(plain), state) == [plain.parent.resolve()]
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / "bin" / "engine").write_bytes(b"\x7fELF")
    monkeypatch.setenv("HOME", str(home))
    assert program_roots(str(home / "bin" / "engine"), state) == [(home / "bin").resolve()]
    assert program_roots("no-such-program-here", state) == []


# ------------------------------------------------------------------ with the real bubblewrap


def run_sandboxed(tmp_path: Path, code: str, policy: SandboxPolicy | None = None) -> str:
    """``python -c code`` in a shard's sandbox made by the real bwrap; its output."""
    require_tools("bwrap")

    async def make() -> tuple[list[str], dict[str, str]]:
        sandboxes = Sandboxes(layout(tmp_path), Bubblewrap())
        made = await sandboxes.prepare(
            "s1",
            policy or SandboxPolicy(),
            program=sys.executable,
            model=None,
            multi_node=False,
        )
        assert made is not None
        argv = made.plan.command([sys.executable, "-c", code], made.features)
        return argv, {**os.environ, **made.plan.env}

    argv, env = asyncio.run(make())
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


PROBE = """
import os, sys
for path in sys.argv[1:] or {paths!r}:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
        print("readable", path)
    except OSError as exc:
        print("refused", path, type(exc).__name__)
"""


def test_a_sandboxed_process_cannot_open_the_key_the_config_or_another_shards_scratch(
    tmp_path: Path,
) -> None:
    lay = layout(tmp_path)
    (tmp_path / "state" / "node.key").write_text("secret")
    (tmp_path / "conf" / "agent.yaml").write_text("node_id: n1\n")
    other = lay.scratch_of("s2") / "home"
    other.mkdir(parents=True)
    (other / "notes").write_text("another shard's")
    data = tmp_path / "data"
    data.mkdir()
    (data / "shown").write_text("ok")
    paths = [
        str(tmp_path / "state" / "node.key"),
        str(tmp_path / "conf" / "agent.yaml"),
        str(other / "notes"),
        str(data / "shown"),
        "/etc/hostname",
        "/proc/self/status",
    ]
    out = run_sandboxed(
        tmp_path, PROBE.format(paths=paths), SandboxPolicy(extra_ro=(str(data),))
    ).splitlines()
    assert out == [
        f"refused {paths[0]} FileNotFoundError",
        f"refused {paths[1]} FileNotFoundError",
        f"refused {paths[2]} FileNotFoundError",
        f"readable {paths[3]}",
        "readable /etc/hostname",
        "readable /proc/self/status",
    ]


def test_a_sandboxed_process_is_alone_in_its_pid_namespace_and_cannot_make_user_namespaces(
    tmp_path: Path,
) -> None:
    code = (
        "import ctypes, os\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000))\n"  # CLONE_NEWUSER
        "print(os.environ['HOME'], os.getcwd())\n"
    )
    lines = run_sandboxed(tmp_path, code).splitlines()
    assert lines[0] == "[1, 2]"  # bwrap's reaper and this process: nothing of the node's
    if asyncio.run(Bubblewrap().features()).disable_userns:
        assert lines[1] == "-1"
    home = str(layout(tmp_path).scratch_of("s1") / "home")
    assert lines[2] == f"{home} {home}"
