"""The seccomp profile of the agent's container (packaging/compose/seccomp-agent.json), made
from the agent's own unit: the system calls ``systemd/llmgw-agent.service`` allows
(``SystemCallFilter=`` lines, expanded with ``systemd-analyze syscall-filter``), the
namespaces it lets bubblewrap make (``RestrictNamespaces=``), its error number and its
native-only architecture. So an engine in the container gets the system calls an engine
under the packaged unit gets, and no more; Docker's default profile would refuse bwrap its
user namespaces and mounts (README "The agent as a container").

usage: seccomp.py [--check] [--unit FILE] [--out FILE]
    writes the profile (default packaging/compose/seccomp-agent.json); --check exits 1 when
    the file differs from what this systemd-analyze makes of the unit
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["CLONE_FLAGS", "GENERATED_WITH", "profile", "read_groups", "unit_filter"]

UNIT = ROOT / "systemd" / "llmgw-agent.service"
PROFILE = ROOT / "packaging" / "compose" / "seccomp-agent.json"
# The systemd whose syscall groups made the committed profile (Debian 12's): another
# version's groups differ, so --check compares only with this one.
GENERATED_WITH = 252

# The namespace flags of clone(2)/unshare(2) (linux/sched.h). CLONE_NEWTIME shares its bit
# with clone's exit signal (CSIGNAL), so only unshare's filter names it.
CLONE_FLAGS = {
    "ipc": 0x08000000,
    "mnt": 0x00020000,
    "pid": 0x20000000,
    "user": 0x10000000,
    "net": 0x40000000,
    "uts": 0x04000000,
    "cgroup": 0x02000000,
}
CLONE_NEWTIME = 0x00000080
ENOSYS = 38
ERRNO = {"EPERM": 1, "EACCES": 13, "ENOSYS": ENOSYS}
# The calls that make or enter namespaces: allowed only through RestrictNamespaces='s filters.
NAMESPACE_CALLS = ("clone", "clone3", "unshare", "setns")
# Docker picks the entry of the machine's own architecture; no sub-architecture (x32, i386,
# arm) is added: SystemCallArchitectures=native.
ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64")


def read_groups(text: str) -> dict[str, list[str]]:
    """``systemd-analyze syscall-filter``'s output -> group name -> its entries (system
    calls and ``@group`` references), comments dropped."""
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif current is not None and line.startswith("    ") and not line.strip().startswith("#"):
            current.append(line.strip())
        elif not line.strip():
            current = None
    if "@default" not in groups:
        raise ValueError("systemd-analyze syscall-filter listed no @default group")
    return groups


def _expand(
    item: str, groups: Mapping[str, list[str]], seen: frozenset[str] = frozenset()
) -> set[str]:
    if not item.startswith("@"):
        return {item}
    if item not in groups:
        raise ValueError(f"systemd-analyze knows no syscall group {item}")
    if item in seen:
        return set()
    out: set[str] = set()
    for entry in groups[item]:
        out |= _expand(entry, groups, seen | {item})
    return out


def unit_filter(unit_text: str) -> dict[str, list[str]]:
    """The unit's ``SystemCallFilter=``, ``RestrictNamespaces=``, ``SystemCallErrorNumber=``
    and ``SystemCallArchitectures=`` lines, each key -> its values in order."""
    wanted = ("SystemCallFilter", "RestrictNamespaces", "SystemCallErrorNumber")
    found: dict[str, list[str]] = {key: [] for key in (*wanted, "SystemCallArchitectures")}
    for line in unit_text.splitlines():
        m = re.match(r"^(\w+)=(.*)$", line.strip())
        if m and m.group(1) in found:
            found[m.group(1)].append(m.group(2).strip())
    for key in wanted:
        if not found[key]:
            raise ValueError(f"the unit has no {key}= line")
    return found


def allowed_calls(lines: Iterable[str], groups: Mapping[str, list[str]]) -> set[str]:
    """What ``SystemCallFilter=`` lines allow, read as systemd does: the first (an allow list)
    sets it, a ``~`` line takes away, a later plain line adds; @default is always allowed."""
    allowed: set[str] = set()
    for i, line in enumerate(lines):
        deny = line.startswith("~")
        items = line.lstrip("~").split()
        names = set().union(*(_expand(item, groups) for item in items)) if items else set()
        if i == 0 and deny:
            raise ValueError(
                "the unit's first SystemCallFilter= is a deny list; expected an allow list"
            )
        if deny:
            allowed -= names
        else:
            allowed |= names
    return allowed | _expand("@default", groups)


def profile(unit_text: str, groups: Mapping[str, list[str]]) -> dict[str, object]:
    """The Docker/OCI seccomp profile of the unit's filter."""
    found = unit_filter(unit_text)
    if found["SystemCallArchitectures"] != ["native"]:
        raise ValueError("the unit's SystemCallArchitectures= is not 'native'; update seccomp.py")
    errno_name = found["SystemCallErrorNumber"][-1]
    if errno_name not in ERRNO:
        raise ValueError(f"SystemCallErrorNumber={errno_name}: add it to seccomp.py's ERRNO")
    kinds = set(" ".join(found["RestrictNamespaces"]).split())
    unknown = kinds - set(CLONE_FLAGS)
    if unknown or not kinds:
        raise ValueError(
            f"RestrictNamespaces= names {sorted(unknown) or 'nothing'}; expected kinds of namespace"
        )
    blocked = sum(flag for kind, flag in CLONE_FLAGS.items() if kind not in kinds)
    plain = sorted(allowed_calls(found["SystemCallFilter"], groups) - set(NAMESPACE_CALLS))

    def masked(call: str, mask: int) -> dict[str, object]:
        # Allowed when (flags & mask) == 0: no namespace outside RestrictNamespaces=.
        arg = {"index": 0, "value": mask, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
        return {"names": [call], "action": "SCMP_ACT_ALLOW", "args": [arg]}

    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": ERRNO[errno_name],
        "archMap": [{"architecture": arch, "subArchitectures": []} for arch in ARCHITECTURES],
        "syscalls": [
            {"names": plain, "action": "SCMP_ACT_ALLOW"},
            masked("clone", blocked),
            masked("unshare", blocked | CLONE_NEWTIME),
            # clone3 passes its flags in memory, which seccomp cannot read: ENOSYS makes glibc
            # fall back to clone, whose flags the filter above checks (as systemd does). setns
            # stays refused: bwrap never enters a namespace it did not make.
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }


def render(data: Mapping[str, object]) -> str:
    return json.dumps(data, indent=2) + "\n"


def systemd_groups() -> tuple[int, dict[str, list[str]]]:
    """This machine's systemd version and syscall groups."""
    version = subprocess.run(
        ["systemd-analyze", "--version"], capture_output=True, text=True, check=True
    ).stdout
    m = re.search(r"systemd (\d+)", version)
    if m is None:
        raise ValueError(f"systemd-analyze --version said {version!r}")
    listed = subprocess.run(
        ["systemd-analyze", "syscall-filter", "--no-pager"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(m.group(1)), read_groups(listed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--unit", type=Path, default=UNIT)
    parser.add_argument("--out", type=Path, default=PROFILE)
    args = parser.parse_args(argv)
    version, groups = systemd_groups()
    if version != GENERATED_WITH:
        print(
            f"systemd-analyze is systemd {version}; the profile is made with systemd "
            f"{GENERATED_WITH}'s groups (Debian 12): run this there, or change GENERATED_WITH "
            "on purpose",
            file=sys.stderr,
        )
        return 2
    text = render(profile(args.unit.read_text(), groups))
    if args.check:
        if args.out.read_text() != text:
            print(
                f"{args.out} differs from {args.unit}'s filter; run {sys.argv[0]}", file=sys.stderr
            )
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
