"""The engine sandbox: what a process engine (and each of its sidecars) sees when it runs
under bubblewrap (:mod:`llmgw.agent.bwrap`), built as an allow-list per shard.

A sandbox sees, each at its own path:

- the system, read-only: ``/usr`` and the merged-usr links (``/bin``, ``/lib*``, ``/sbin``),
  ``/etc`` without ``/etc/llmgw``, ``/sys`` (NVML reads it); a new ``/dev`` with the GPUs'
  device nodes (``/dev/nvidia*``, ``/dev/dri``; ``/dev/infiniband`` for a shard of a
  multi-node replica or of a disaggregated model's pool, ``multi_node`` below) and a ``/dev/shm`` of its own; a new ``/proc`` of its own pid namespace;
- its program, read-only: the engine's install prefix (a venv, a folder under the state
  directory's ``engines/``), or for the built-in ``sim`` this llmgw (a frozen binary's folder,
  else the interpreter's prefixes and the package);
- the model's folder (or file), read-only;
- its scratch directory ``STATE/scratch/<shard>``, read-write: ``HOME``, ``TMPDIR``,
  ``/var/tmp`` and the caches (Hugging Face, XDG, Triton, vLLM, CUDA) point there; ``/tmp``
  is a tmpfs of its own;
- the profile's ``sandbox.extra_ro`` and ``sandbox.extra_rw``
  (:class:`~llmgw.contracts.sandbox.SandboxPolicy`).

The host's network is shared (engines listen on loopback; the agent relays to them); the
user, pid and IPC namespaces are its own. Never visible, even where a bound folder holds
them: the agent's state directory (the node's key, the operation log, the other shards'
scratch), its configuration's folder, the key's folder, ``/etc/llmgw``, and models_root and
cache_root beyond the shard's own model. A profile's extra path that would expose one is
refused. An engine that fails on a path its sandbox hides gets a reason naming the path and
the key that widens it (:func:`hidden_path_reason`).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.errors import ShardError
from llmgw.log import kv

if TYPE_CHECKING:
    from llmgw.agent.bwrap import Bubblewrap, BwrapFeatures
    from llmgw.agent.runtimes.base import Launch

__all__ = [
    "Mount",
    "SandboxLayout",
    "SandboxPlan",
    "Sandboxed",
    "Sandboxes",
    "builtin_roots",
    "hidden_path_reason",
    "make_scratch",
    "program_roots",
    "remove_scratch",
]

log = logging.getLogger("llmgw.agent.sandbox")

Kind = Literal["ro", "rw", "dev", "devfs", "proc", "tmpfs", "symlink"]
Seen = Literal["ro", "rw", "dev"]

# The merged-usr links of the root, or folders on hosts that still have them.
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_GPU_NODES = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/nvidia-caps-imex-channels", "/dev/dri")
_FABRIC_NODES = ("/dev/infiniband",)
_ETC_LLMGW = Path("/etc/llmgw")
# Every engine's caches go to the shard's scratch (README "Engine sandbox").
_CACHE_ENV = {
    "XDG_CACHE_HOME": "cache",
    "HF_HOME": "cache/huggingface",
    "TRITON_CACHE_DIR": "cache/triton",
    "VLLM_CACHE_ROOT": "cache/vllm",
    "CUDA_CACHE_PATH": "cache/nv",
}


@dataclass(frozen=True)
class Mount:
    """One step of a sandbox's making, in bwrap's order: a later step covers an earlier one."""

    kind: Kind
    path: Path
    source: Path | None = None
    """Where it comes from on the host (a bind), or what a symlink points to; None: ``path``."""


@dataclass(frozen=True)
class SandboxPlan:
    """What one process sees: :attr:`mounts` in order, then its scratch and environment."""

    mounts: tuple[Mount, ...]
    scratch: Path
    env: Mapping[str, str] = field(default_factory=dict)

    def visible(self, path: Path) -> Seen | None:
        """How the node's ``path`` is seen inside: read-only, read-write, a device; None
        when the sandbox hides it (not bound, covered, or its place holds something else:
        /var/tmp is the scratch's)."""
        seen: Seen | None = None
        for mount in self.mounts:
            if mount.kind == "symlink" or not _within(path, mount.path):
                continue
            remapped = mount.source is not None and mount.source != mount.path
            if mount.kind == "proc":
                seen = "ro"
            elif mount.kind in ("ro", "rw", "dev") and not remapped:
                seen = mount.kind
            else:
                seen = None
        return seen

    def command(self, argv: Sequence[str], features: BwrapFeatures) -> list[str]:
        """bwrap's command line that runs ``argv`` in this sandbox.

        No --die-with-parent: engines outlive the agent. No --new-session: the agent starts
        every engine in a session of its own, without a controlling terminal, so there is
        none to push keystrokes into; and the stop's signals reach the engine through its
        process group (:mod:`llmgw.agent.runtimes.process`)."""
        out = [features.program, "--unshare-user", "--unshare-pid", "--unshare-ipc"]
        if features.disable_userns:
            out.append("--disable-userns")
        for mount in self.mounts:
            out += _mount_args(mount, features)
        out += ["--chdir", str(self.scratch / "home"), "--", *argv]
        return out


def _mount_args(mount: Mount, features: BwrapFeatures) -> list[str]:
    path = str(mount.path)
    source = str(mount.source or mount.path)
    if mount.kind == "proc":
        # The host's /proc where a fresh one cannot be mounted (bwrap.HOST_PROC_WARNING).
        return ["--proc", path] if features.fresh_proc else ["--ro-bind", "/proc", path]
    flag = {
        "symlink": "--symlink",
        "tmpfs": "--tmpfs",
        "devfs": "--dev",
        "dev": "--dev-bind",
        "ro": "--ro-bind",
        "rw": "--bind",
    }[mount.kind]
    if mount.kind in ("tmpfs", "devfs"):
        return [flag, path]
    return [flag, source, path]


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _overlaps(a: Path, b: Path) -> bool:
    return _within(a, b) or _within(b, a)


@dataclass(frozen=True)
class SandboxLayout:
    """What every sandbox on this node is made of (the node's paths), and the shard's own
    parts: :meth:`plan` builds one shard's sandbox."""

    state_dir: Path
    secret: tuple[Path, ...]
    """What no sandbox sees and no profile may widen it to: the state directory, the
    configuration's and the key's folders, /etc/llmgw."""
    stores: tuple[Path, ...]
    """models_root and cache_root: covered where a bound folder holds them; a shard sees its
    own model in them, and a profile's extra path may name them."""

    @classmethod
    def for_node(
        cls,
        state_dir: Path,
        *,
        config_file: Path | None,
        key_file: Path,
        models_root: Path,
        cache_root: Path,
    ) -> SandboxLayout:
        secret = [state_dir, key_file.parent, _ETC_LLMGW]
        if config_file is not None:
            secret.append(config_file.parent)
        return cls(
            state_dir=_real(state_dir),
            secret=tuple(dict.fromkeys(_real(p) for p in secret)),
            stores=tuple(dict.fromkeys(_real(p) for p in (models_root, cache_root))),
        )

    @property
    def hidden(self) -> tuple[Path, ...]:
        return self.secret + self.stores

    def scratch_of(self, shard_id: str) -> Path:
        return self.state_dir / "scratch" / shard_id

    def plan(
        self,
        shard_id: str,
        *,
        programs: Iterable[Path],
        model: Path | None,
        policy: SandboxPolicy,
        multi_node: bool,
        shard_rw: Iterable[Path] = (),
    ) -> SandboxPlan:
        """One shard's sandbox. ``programs``: the folders its program needs (read-only);
        ``model``: its weights; ``shard_rw``: folders the agent makes for the shard that its
        engine writes (e.g. a socket's folder). ShardError names the profile key whose path
        would expose the agent's secrets, and a path that is not absolute."""
        scratch = self.scratch_of(shard_id)
        mounts: list[Mount] = [*_system_mounts()]
        mounts += _devices(multi_node)
        # /tmp is a tmpfs of its own (TMPDIR, on disk, is the scratch's), first: what the
        # sandbox shows of the node's /tmp (a program, a model, the scratch) is bound on it.
        mounts.append(Mount("tmpfs", Path("/tmp")))
        bound: list[Path] = [m.path for m in mounts if m.kind in ("ro", "rw")]
        for root in dict.fromkeys(_real(p) for p in programs):
            if not any(_within(root, b) for b in bound):
                mounts.append(Mount("ro", root))
                bound.append(root)
        # Covered after the folders that hold them, before the shard's own parts (which may
        # lie inside them: the model in models_root, the scratch in the state directory).
        for folder in self.hidden:
            if folder.is_dir() and any(_within(folder, b) for b in bound):
                mounts.append(Mount("tmpfs", folder))
        mounts.append(Mount("proc", Path("/proc")))
        if model is not None:
            mounts.append(Mount("ro", self._own(model, "source")))
        for key, kind in (("extra_ro", "ro"), ("extra_rw", "rw")):
            for given in getattr(policy, key):
                mounts.append(Mount(kind, self._extra(given, key)))  # type: ignore[arg-type]
        for folder in shard_rw:
            mounts.append(Mount("rw", folder))
        mounts.append(Mount("rw", Path("/var/tmp"), scratch / "tmp"))
        mounts.append(Mount("rw", scratch))
        return SandboxPlan(mounts=tuple(mounts), scratch=scratch, env=_scratch_env(scratch))

    def _own(self, path: Path, what: str) -> Path:
        real = _real(path)
        for secret in self.secret:
            if _overlaps(real, secret):
                raise ShardError(
                    f"the shard's {what} {path} is or holds {secret}, which no engine may see "
                    "(the agent's keys and state); move the weights under models_root"
                )
        return real

    def _extra(self, given: str, key: str) -> Path:
        if not given.startswith("/"):
            raise ShardError(
                f"the profile's sandbox.{key} entry {given!r} is not an absolute path; "
                "give the path on the node, e.g. /opt/data"
            )
        real = _real(Path(given))
        for secret in self.secret:
            if _overlaps(real, secret):
                raise ShardError(
                    f"the profile's sandbox.{key} entry {given} is or holds {secret}, which "
                    "no engine may see (the agent's keys, state and configuration); remove "
                    "it from the profile"
                )
        return real


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _system_mounts() -> list[Mount]:
    mounts: list[Mount] = [Mount("ro", Path("/usr"))]
    for name in _ROOT_LINKS:
        path = Path(name)
        if path.is_symlink():
            mounts.append(Mount("symlink", path, Path(os.readlink(path))))
        elif path.is_dir():
            mounts.append(Mount("ro", path))
    mounts.append(Mount("ro", Path("/etc")))
    # A resolv.conf that links into /run (systemd-resolved): the file it names, alone.
    resolv = _real(Path("/etc/resolv.conf"))
    if resolv.is_file() and not any(_within(resolv, Path(p)) for p in ("/etc", "/usr")):
        mounts.append(Mount("ro", resolv))
    mounts.append(Mount("ro", Path("/sys")))
    return mounts


def _devices(multi_node: bool) -> list[Mount]:
    mounts = [Mount("devfs", Path("/dev"))]
    patterns = _GPU_NODES + (_FABRIC_NODES if multi_node else ())
    for pattern in patterns:
        for found in sorted(glob.glob(pattern)):
            mounts.append(Mount("dev", Path(found)))
    mounts.append(Mount("tmpfs", Path("/dev/shm")))
    return mounts


def _scratch_env(scratch: Path) -> dict[str, str]:
    env = {"HOME": str(scratch / "home"), "TMPDIR": str(scratch / "tmp")}
    env.update({name: str(scratch / rel) for name, rel in _CACHE_ENV.items()})
    return env


def program_roots(program: str, state_dir: Path) -> list[Path]:
    """The folders a program needs to run, read-only: its install prefix (the parent of a
    ``bin`` folder that looks like one: a venv, a conda env, ``lib`` beside it; else the
    folder it is in), the same for the file a link leads to and for a script's interpreter,
    and a venv's base interpreter. An engine installed under ``STATE/engines`` gets its
    version's folder. "" or a bare name is looked up on PATH."""
    found = shutil.which(program) if program and "/" not in program else program
    if not found:
        return []
    roots: list[Path] = []
    for path in dict.fromkeys([Path(os.path.abspath(found)), _real(Path(found))]):
        roots.append(_prefix(path, state_dir))
        roots += _interpreter_roots(path, state_dir)
    for root in list(roots):
        roots += _venv_home(root)
    return list(dict.fromkeys(roots))


def builtin_roots() -> list[Path]:
    """The folders this llmgw needs to run as the built-in engine: a frozen binary's folder,
    or the interpreter's prefixes, the folders on its path that are not the working
    directory, and the package itself (an editable install's checkout holds more)."""
    if getattr(sys, "frozen", False):
        return [_real(Path(sys.executable)).parent]
    import llmgw

    roots = [Path(p) for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix)]
    roots.append(Path(llmgw.__file__).resolve().parent)
    cwd = Path.cwd()
    for entry in sys.path:
        path = Path(entry) if entry else cwd
        if path.is_absolute() and path.is_dir() and path != cwd and not _within(cwd, path):
            roots.append(path)
    return [_real(p) for p in dict.fromkeys(roots)]


def _prefix(path: Path, state_dir: Path) -> Path:
    engines = _real(state_dir) / "engines"
    if engines in path.parents:
        parts = path.relative_to(engines).parts
        return engines.joinpath(*parts[:2])  # STATE/engines/<engine>/<version>
    folder = path.parent
    prefix = folder.parent
    home = Path.home()
    if folder.name in ("bin", "sbin") and prefix != Path("/") and prefix.parent != Path("/home"):
        if prefix != home and any(
            (prefix / marker).exists() for marker in ("pyvenv.cfg", "conda-meta", "lib", "lib64")
        ):
            return prefix
    return folder


def _interpreter_roots(path: Path, state_dir: Path) -> list[Path]:
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        return []
    interpreter = words[1] if Path(words[0]).name == "env" and len(words) > 1 else words[0]
    found = shutil.which(interpreter) if "/" not in interpreter else interpreter
    if not found:
        return []
    return list(dict.fromkeys(_prefix(p, state_dir) for p in (Path(found), _real(Path(found)))))


def _venv_home(root: Path) -> list[Path]:
    try:
        text = (root / "pyvenv.cfg").read_text()
    except OSError:
        return []
    match = re.search(r"^home\s*=\s*(.+)$", text, re.MULTILINE)
    if not match:
        return []
    home = _real(Path(match.group(1).strip()))
    return [home.parent if home.name == "bin" else home]


# A path an engine failed on, in the words of Python, C's strerror, llama.cpp and Go.
_FAILED_ON = re.compile(
    r"(?P<why>No such file or directory|Permission denied|Read-only file system|"
    r"failed to open|cannot open|could not open|can't open|unable to open|ENOENT|EACCES|EROFS)",
    re.IGNORECASE,
)
_PATH = re.compile(r"""(?<![\w.~-])(/[^\s'"`:,;()\[\]{}<>]+)""")


def hidden_path_reason(plan: SandboxPlan, log_tail: str) -> str:
    """ "the engine could not open /x, which its sandbox hides; ..." for the first path in
    ``log_tail`` (the end of a failed engine's log) that a line calls missing, forbidden or
    read-only, that exists on this node and that the sandbox hides (or shows read-only, for
    a write); "" when there is none."""
    for line in log_tail.splitlines():
        failed = _FAILED_ON.search(line)
        if failed is None:
            continue
        for match in _PATH.finditer(line):
            raw = match.group(1).rstrip(".")
            path = Path(os.path.normpath(raw))
            if not os.path.lexists(path) or path == Path("/"):
                continue
            seen = plan.visible(path)
            if seen is None:
                return (
                    f"the engine could not open {path}, which its sandbox hides; add it to "
                    "the profile's sandbox.extra_ro (or sandbox.extra_rw for a path it writes)"
                )
            if seen == "ro" and "read-only" in failed.group("why").lower():
                return (
                    f"the engine could not write {path}, which its sandbox shows read-only; "
                    "add it to the profile's sandbox.extra_rw"
                )
    return ""


@dataclass(frozen=True)
class Sandboxed:
    """A shard's sandbox, ready to run its engine and sidecars in."""

    plan: SandboxPlan
    features: BwrapFeatures
    state_dir: Path
    """Where engine installs live (``STATE/engines``): a program there gets its version's
    folder."""
    remake: Callable[[Iterable[Path]], SandboxPlan]
    """The shard's plan again with more program folders (its covers laid after them)."""

    def launch(self, launch: Launch) -> Launch:
        """``launch`` run inside the sandbox, with the scratch's environment."""
        return dataclasses.replace(
            launch,
            argv=tuple(self.plan.command(launch.argv, self.features)),
            env={**launch.env, **self.plan.env},
            sandboxed=True,
        )

    def for_program(self, program: str) -> Sandboxed:
        """The same sandbox with ``program``'s folders too (a sidecar's)."""
        return dataclasses.replace(self, plan=self.remake(program_roots(program, self.state_dir)))


class Sandboxes:
    """The sandboxes of this node's shards: its layout, and bubblewrap probed once."""

    def __init__(self, layout: SandboxLayout, bwrap: Bubblewrap, *, required: bool = True) -> None:
        self.layout = layout
        self.bwrap = bwrap
        # False ('sandbox: if-available', llmgw up): where bubblewrap cannot run, engines run
        # unconfined, said once as a warning with the fix.
        self.required = required
        self._unavailable_said = False

    async def prepare(
        self,
        shard_id: str,
        policy: SandboxPolicy,
        *,
        program: str | None,
        model: Path | None,
        multi_node: bool,
        shard_rw: Iterable[Path] = (),
    ) -> Sandboxed | None:
        """The shard's sandbox, its scratch made; None (logged as a warning) for a profile
        with ``sandbox: false``. ``program``: the engine's binary, None for the built-in one.
        ShardError with the fix when bubblewrap cannot run here or a path is refused.

        ``shard_rw`` is the one place for folders the agent makes for a shard and its
        engine writes (the KV events' socket folder, say): bound read-write."""
        if not policy.enabled:
            log.warning(
                "engine not sandboxed: its profile says sandbox: false; it runs as the "
                "agent's user and can read the agent's keys",
                extra=kv(shard=shard_id),
            )
            return None
        try:
            features = await self.bwrap.features()
        except ShardError as exc:
            if self.required:
                raise
            if not self._unavailable_said:
                self._unavailable_said = True
                log.warning(
                    "engines not sandboxed: bubblewrap cannot run here (agent.yaml says "
                    "sandbox: if-available); they run as the agent's user and can read what "
                    "it reads",
                    extra=kv(reason=str(exc)),
                )
            return None
        state_dir = self.layout.state_dir
        programs = builtin_roots() if program is None else program_roots(program, state_dir)
        shard_rw = tuple(shard_rw)

        def remake(more: Iterable[Path]) -> SandboxPlan:
            return self.layout.plan(
                shard_id,
                programs=[*programs, *more],
                model=model,
                policy=policy,
                multi_node=multi_node,
                shard_rw=shard_rw,
            )

        plan = remake(())
        make_scratch(plan)
        return Sandboxed(plan, features, state_dir, remake)

    def forget(self, shard_id: str) -> None:
        """A shard stopped for good: its scratch goes."""
        remove_scratch(self.layout.scratch_of(shard_id))


def make_scratch(plan: SandboxPlan) -> None:
    """The shard's scratch folders (0700), made before its sandbox; ShardError when not."""
    try:
        for sub in ("home", "tmp", "cache"):
            (plan.scratch / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        plan.scratch.chmod(0o700)
    except OSError as exc:
        raise ShardError(
            f"cannot make the shard's scratch directory {plan.scratch}: {exc.strerror}; "
            "check the state directory's owner and free space"
        ) from exc


def remove_scratch(scratch: Path) -> None:
    """The scratch of a shard that was stopped for good; what cannot be removed stays."""
    shutil.rmtree(scratch, ignore_errors=True)
