"""engine-check: does this engine understand every flag llmgw may give it?

It builds the widest commands llmgw would produce for the engine (a multi-node replica's
rank 0 with every optional parameter set, a worker, and rank 0 run for each task that takes
flags of its own, like llama.cpp's ``--embedding``) and looks for each flag in the
engine's own ``--help``, as a whole token: ``--port`` is documented by ``--port PORT``,
``-p, --port``, ``--port=PORT`` or ``[--port]``, never by ``--port-range``. A help text that
does not document ``--help`` itself was probably cut short, and says so in a warning.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import llmgw
from llmgw.engines.disagg import PREFILL, ROLES
from llmgw.engines.kvevents import events_config
from llmgw.engines.launch import build_command, engine_module, self_argv
from llmgw.engines.registry import AVAILABLE_ENGINES, get_engine
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError
from llmgw.procutil import Finished, run_to_end

__all__ = [
    "FROM_HELP_OUTPUT",
    "AgentEngines",
    "CheckReport",
    "FlagCheck",
    "FoundEngine",
    "check_engine",
    "check_help",
    "command_flags",
    "documents",
    "engine_help",
    "engine_version",
    "locate_engine",
    "widest_specs",
]

FROM_HELP_OUTPUT = "unknown (from --help-output)"
"""The version reported when the help text was given rather than produced by the engine."""

RUN_TIMEOUT = 120.0  # vLLM and SGLang import torch before they print anything
_VERSION_LIMIT = 200

# A flag is a token: not preceded by a word character or '-', not followed by one.
_BOUNDARY_BEFORE = r"(?<![\w-])"
_BOUNDARY_AFTER = r"(?![\w-])"
_FLAG = re.compile(r"^--?[A-Za-z][\w-]*")


class FoundEngine(Protocol):
    """An engine program found on this machine, the way the agent finds it
    (``llmgw.agent.discovery.EngineCandidate``)."""

    @property
    def name(self) -> str: ...
    @property
    def argv(self) -> Sequence[str]: ...
    @property
    def origin(self) -> str: ...
    @property
    def problem(self) -> str: ...


@dataclass(frozen=True)
class AgentEngines:
    """The engines an agent configuration finds here: ``config``, its file (named in
    messages), and ``find``, which looks them up (called only when the engine must be
    located, so a check of a given help text never reads the configuration)."""

    config: Path
    find: Callable[[], Sequence[FoundEngine]]


@dataclass(frozen=True)
class FlagCheck:
    """One flag llmgw may pass, the commands that pass it, and whether the help has it."""

    flag: str
    used_by: tuple[str, ...]
    documented: bool


@dataclass(frozen=True)
class CheckReport:
    """What engine-check found; ``ok`` when every flag is documented."""

    engine: str
    version: str
    source: str  # where the help text came from: the command run, or --help-output
    help_lines: int
    flags: tuple[FlagCheck, ...]
    warnings: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # commands of another program, not checked

    @property
    def missing(self) -> list[str]:
        return [check.flag for check in self.flags if not check.documented]

    @property
    def ok(self) -> bool:
        return not self.missing


def documents(help_text: str, flag: str) -> bool:
    """Whether ``flag`` appears in ``help_text`` as a token of its own."""
    pattern = _BOUNDARY_BEFORE + re.escape(flag) + _BOUNDARY_AFTER
    return re.search(pattern, help_text) is not None


def command_flags(argv: Sequence[str], prefix: Sequence[str]) -> list[str]:
    """The flags in ``argv`` after the engine's ``prefix`` (program and subcommand), in
    order, each once; ``--flag=value`` counts as ``--flag``. Values and positional
    arguments are skipped, negative numbers too."""
    flags: list[str] = []
    for token in argv[len(prefix) :]:
        match = _FLAG.match(token)
        if match is None:
            continue
        flag = match.group(0)
        if flag not in flags:
            flags.append(flag)
    return flags


def widest_specs(engine: str, binary: str = "") -> list[tuple[str, EngineSpec]]:
    """The shards whose commands carry every flag llmgw may emit for ``engine``: rank 0 of a
    two-node replica with two GPUs a node, every parameter set and (for an engine with KV
    events) publishing them, its worker, then rank 0
    with the flags of each task (``rank 0, task embed``; tasks that share their flags in one
    form, ``task embed/rerank``), which a profile's ``task`` puts before its args, and with
    those of each sleep level (``rank 0, sleep level 1/2``), which its ``sleep`` puts there,
    and, for an engine that disaggregates, a single-node shard of each pool
    (``single node, prefill``)."""
    module = engine_module(engine)
    events = events_config("ipc:///var/lib/llmgw-agent/kv/0123456789abcdef/kv.sock", "engine-check")
    rank0 = EngineSpec(
        engine=engine,
        model="engine-check",
        port=8000,
        source=module.PARAMS["model_path"].sample if "model_path" in module.PARAMS else "",
        binary=binary,
        gpus=("GPU-0", "GPU-1"),
        nodes=2,
        rank=0,
        dist_init_addr="10.0.0.1:29500",
        params={key: param.sample for key, param in module.PARAMS.items()},
        peers=("10.0.0.2:50052",),
        kv_events_config=events if get_engine(engine).kv_events else "",
    )
    # The worker as the control plane orders it: its own endpoint, not rank 0's list.
    worker = replace(rank0, rank=1, peers=(), listen_addr=rank0.peers[0])
    forms = [("rank 0", rank0), ("worker", worker)]
    groups: dict[tuple[str, ...], list[str]] = {}
    for task, flags in module.TASK_FLAGS.items():
        groups.setdefault(tuple(flags), []).append(task)
    for flags, tasks in groups.items():
        forms.append((f"rank 0, task {'/'.join(tasks)}", replace(rank0, extra_args=flags)))
    # A profile's ``sleep`` puts its flags before the args too; levels that share their
    # flags in one form.
    sleeps: dict[tuple[str, ...], list[str]] = {}
    for level, flags in module.SLEEP_FLAGS.items():
        sleeps.setdefault(tuple(flags), []).append(str(level))
    for flags, levels in sleeps.items():
        form = f"rank 0, sleep level {'/'.join(levels)}"
        forms.append((form, replace(rank0, extra_args=flags)))
    # Each pool of a disaggregated model: a single-node shard (pools are single-node) with its
    # role, its transfer address and the node's fabric adapters. Not the built-in sim's: its
    # --kv-transfer-addr comes with its KV pull (llmgw.sim), checked against its CLI there.
    row = get_engine(engine)
    if row.disagg_handover is not None and not row.builtin:
        single = replace(rank0, nodes=1, rank=0, dist_init_addr="", peers=())
        for role in ROLES:
            pool = replace(
                single,
                disagg_role=role,
                transfer_addr="10.0.0.1:29600",
                fabric_devices=("mlx5_0", "mlx5_1"),
                # An SGLang prefill's bootstrap server's loopback port (the others ignore it).
                bootstrap_port=8001 if role == PREFILL else 0,
            )
            forms.append((f"single node, {role}", pool))
    return forms


def check_help(
    engine: str, help_text: str, *, binary: str = "", version: str = FROM_HELP_OUTPUT, source: str
) -> CheckReport:
    """Check the flags of ``engine``'s widest commands against ``help_text``."""
    module = engine_module(engine)
    prefix = module.prefix(binary)
    used: dict[str, list[str]] = {}
    skipped: list[str] = []
    rank0: list[str] = []
    for index, (form, spec) in enumerate(widest_specs(engine, binary)):
        argv = build_command(spec).argv
        if argv[: len(prefix)] != prefix:
            skipped.append(
                f"{form}: runs {os.path.basename(argv[0])}, not {os.path.basename(prefix[0])}; "
                "its flags are not in this help text"
            )
            continue
        passed = command_flags(argv, prefix)
        if index == 0:
            rank0 = passed
        # A task's form is rank 0 and the task's flags: it is named for those alone.
        for flag in passed if index < 2 else [f for f in passed if f not in rank0]:
            used.setdefault(flag, []).append(form)
    flags = tuple(
        FlagCheck(flag, tuple(forms), documents(help_text, flag)) for flag, forms in used.items()
    )
    warnings = []
    if not documents(help_text, "--help"):
        warnings.append(
            "the help text does not document --help itself; it looks cut short (give the "
            "whole output of the engine's help)"
        )
    return CheckReport(
        engine=engine,
        version=version,
        source=source,
        help_lines=len(help_text.splitlines()),
        flags=flags,
        warnings=tuple(warnings),
        skipped=tuple(skipped),
    )


# --------------------------------------------------------------------------- running it


def _run(argv: Sequence[str], timeout: float, env: Mapping[str, str]) -> Finished:
    """Run ``argv`` to the end, stdout and stderr together, in the C locale with ``env``
    added; its failures to start or finish in time as EngineErrors."""
    try:
        return run_to_end(
            argv, timeout, env={**os.environ, "LC_ALL": "C", **env}, merge_stderr=True
        )
    except OSError as exc:
        raise EngineError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired:
        raise EngineError(f"'{_shown(argv, env)}' did not finish within {timeout:g} s") from None


def _shown(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """``argv`` as a shell would run it, after the variables ``env`` sets."""
    return shlex.join([*(f"{key}={value}" for key, value in env.items()), *argv])


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(kept[-lines:])[:600] or "(no output)"


def locate_engine(
    engine: str, *, binary: str | None = None, agent: AgentEngines | None = None
) -> str:
    """The program that runs ``engine`` here: ``binary``; else what the agent would use
    (``agent``: its configuration's setting, PATH, an installed release); else the default
    on PATH."""
    module = engine_module(engine)
    if binary:
        return binary
    if get_engine(engine).builtin:
        return ""  # this llmgw
    if agent is not None:
        for candidate in agent.find():
            if candidate.name != engine:
                continue
            if candidate.problem or not candidate.argv:
                raise EngineError(
                    f"{engine} ({candidate.origin}): {candidate.problem or 'no command'}"
                )
            return candidate.argv[0]
        raise EngineError(
            f"{engine} is not configured in {agent.config}, not on PATH and not installed; "
            f"set engines.{engine} there, or pass --binary PROGRAM"
        )
    found = shutil.which(module.PROGRAM)
    if found is None:
        raise EngineError(
            f"{module.PROGRAM} is not on PATH; pass --binary PROGRAM, --agent-config "
            "agent.yaml, or the help text with --help-output FILE"
        )
    return found


def engine_help(engine: str, binary: str, timeout: float = RUN_TIMEOUT) -> tuple[str, str]:
    """``(help text, the command that printed it)`` from running the engine."""
    argv = _help_argv(engine, binary)
    env = engine_module(engine).CHECK_ENV
    output = _run(argv, timeout, env)
    shown = _shown(argv, env)
    if output.returncode != 0:
        raise EngineError(
            f"'{shown}' failed (exit {output.returncode}): {_tail(output.stdout)}; check the "
            f"{engine} installation, or pass its help text with --help-output FILE"
        )
    return output.stdout, shown


def _help_argv(engine: str, binary: str) -> list[str]:
    module = engine_module(engine)
    if get_engine(engine).builtin:
        return [*([binary] if binary else self_argv()), *module.HELP_ARGS]
    return [binary or module.PROGRAM, *module.HELP_ARGS]


def engine_version(engine: str, binary: str, timeout: float = RUN_TIMEOUT) -> str:
    """The first line the engine's version command prints, or why there is none."""
    module = engine_module(engine)
    if get_engine(engine).builtin and not binary:
        return llmgw.__version__
    argv = [binary or module.PROGRAM, *module.VERSION_ARGS]
    try:
        output = _run(argv, timeout, module.CHECK_ENV)
    except EngineError as exc:
        return f"unknown ({exc})"
    lines = [line.strip() for line in output.stdout.splitlines() if line.strip()]
    if output.returncode != 0 or not lines:
        return f"unknown ('{_shown(argv, module.CHECK_ENV)}' failed: {_tail(output.stdout, 1)})"
    # llama-server says "version: 0.7.0 (build 11669, ...)"; the label is ours to print.
    return re.sub(r"^version\b[:\s]*", "", lines[0], flags=re.IGNORECASE)[:_VERSION_LIMIT]


def check_engine(
    engine: str,
    *,
    help_text: str | None = None,
    binary: str | None = None,
    agent: AgentEngines | None = None,
    timeout: float = RUN_TIMEOUT,
) -> CheckReport:
    """engine-check: against ``help_text`` when given, else against the help of the engine
    found on this machine (:func:`locate_engine`)."""
    if engine not in AVAILABLE_ENGINES:
        engine_module(engine)  # raises, naming the known engines
    if help_text is not None:
        return check_help(engine, help_text, binary=binary or "", source="--help-output")
    program = locate_engine(engine, binary=binary, agent=agent)
    text, shown = engine_help(engine, program, timeout)
    version = engine_version(engine, program, timeout)
    return check_help(engine, text, binary=program, version=version, source=shown)
