"""The signed repositories (scripts/repo.sh): an apt repository apt installs from over
loopback, and refuses once its InRelease is tampered with; a yum repository of signed
packages with signed metadata.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.ci import require_tools

from .pkgcheck import CURRENT, ROOT, Container, Packages, run

pytestmark = pytest.mark.timeout(900)

URL = "http://127.0.0.1:8000"  # where the tests' containers serve it, on their loopback
LIST = f"deb [signed-by=/usr/share/keyrings/llmgw.gpg] {URL}/apt stable main\n"
YUM_REPO = f"""[llmgw]
name=llmgw
baseurl={URL}/yum
enabled=1
gpgcheck=1
repo_gpgcheck=1
gpgkey={URL}/yum/RPM-GPG-KEY-llmgw
"""
SERVE = (
    "setsid python3 -m http.server --bind 127.0.0.1 --directory {root} 8000 "
    ">/tmp/http.log 2>&1 </dev/null &"
)
ADD_SOURCE = (
    "cp /pkgs/repo/apt/llmgw.gpg /usr/share/keyrings/llmgw.gpg && "
    "cp /pkgs/repo/apt/llmgw.list /etc/apt/sources.list.d/llmgw.list"
)


def make_repo(packages: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """scripts/repo.sh; its throwaway key (when no release key is given) next to ``out``."""
    require_tools("apt-ftparchive", "gpg", "gpgv", "createrepo_c", "rpmsign", "dpkg-deb")
    throwaway = out.parent / "release-key" / "throwaway.asc"
    return run(
        ROOT / "scripts" / "repo.sh",
        "--packages",
        packages,
        "--out",
        out,
        "--url",
        URL,
        env={"LLMGW_THROWAWAY_KEY": str(throwaway), **env},
    )


def fingerprint(public_key: Path) -> str:
    shown = run("gpg", "--batch", "--with-colons", "--show-keys", public_key).stdout
    return next(line.split(":")[9] for line in shown.splitlines() if line.startswith("fpr:"))


@pytest.fixture(scope="module")
def repo(standin_packages: dict[str, Packages], packages_root: Path) -> Path:
    """The repositories of the stand-in's CURRENT packages, at packages_root/repo."""
    out = packages_root / "repo"
    made = make_repo(standin_packages[CURRENT].directory, out)
    assert "signing with the throwaway key" in made.stderr  # no LLMGW_RELEASE_KEY: it says so
    return out


def test_apt_repository_is_signed_and_lists_the_packages(repo: Path, tmp_path: Path) -> None:
    apt = repo / "apt"
    assert (apt / "llmgw.list").read_text() == LIST
    dists = apt / "dists" / "stable"
    run("gpgv", "--keyring", apt / "llmgw.gpg", dists / "InRelease")
    run("gpgv", "--keyring", apt / "llmgw.gpg", dists / "Release.gpg", dists / "Release")
    release = (dists / "Release").read_text()
    for field in ("Suite: stable", "Codename: stable", "Components: main", "Architectures: amd64"):
        assert f"\n{field}\n" in f"\n{release}"
    listed = re.findall(r"^ [0-9a-f]{64} +[0-9]+ (\S+)$", release, re.MULTILINE)
    assert sorted(listed) == ["main/binary-amd64/Packages", "main/binary-amd64/Packages.gz"]
    packages = (dists / "main" / "binary-amd64" / "Packages").read_text()
    # llmgw-agent-bundles (Architecture: all) is in the architecture's own index.
    assert sorted(re.findall(r"^Filename: (\S+)$", packages, re.MULTILINE)) == [
        f"pool/main/llmgw-agent-bundles_{CURRENT}_all.deb",
        f"pool/main/llmgw-agent_{CURRENT}_amd64.deb",
        f"pool/main/llmgw-server_{CURRENT}_amd64.deb",
    ]
    assert "ed25519" in run("gpg", "--batch", "--show-keys", apt / "llmgw.asc").stdout
    assert fingerprint(apt / "llmgw.gpg") == fingerprint(apt / "llmgw.asc")


def test_yum_repository_holds_signed_packages_and_signed_metadata(
    repo: Path, standin_packages: dict[str, Packages], tmp_path: Path
) -> None:
    yum = repo / "yum"
    assert (yum / "llmgw.repo").read_text() == YUM_REPO
    db = tmp_path / "rpmdb"
    db.mkdir()
    run("rpm", "--dbpath", db, "--import", yum / "RPM-GPG-KEY-llmgw")
    signed = sorted((yum / "x86_64").glob("*.rpm")) + sorted((yum / "noarch").glob("*.rpm"))
    assert [p.name for p in signed] == [
        f"llmgw-agent-{CURRENT}-1.x86_64.rpm",
        f"llmgw-server-{CURRENT}-1.x86_64.rpm",
        f"llmgw-agent-bundles-{CURRENT}-1.noarch.rpm",
    ]
    for rpm in signed:
        assert (
            run("rpm", "--dbpath", db, "-K", rpm).stdout.strip().endswith("digests signatures OK")
        )
    # The packages 'make packages' left in place are not signed; the repository's are.
    original = standin_packages[CURRENT].path("llmgw-agent", "rpm")
    assert run("rpm", "--dbpath", db, "-K", original).stdout.strip().endswith(": digests OK")
    keyring = tmp_path / "yum.gpg"
    run("gpg", "--batch", "--yes", "--output", keyring, "--dearmor", yum / "RPM-GPG-KEY-llmgw")
    repomd = yum / "repodata" / "repomd.xml"
    run("gpgv", "--keyring", keyring, repomd.with_name("repomd.xml.asc"), repomd)
    assert 'type="primary"' in repomd.read_text()


def test_the_throwaway_key_is_kept_and_a_given_key_is_used(
    standin_packages: dict[str, Packages], tmp_path: Path
) -> None:
    packages = standin_packages[CURRENT].directory
    make_repo(packages, tmp_path / "a" / "repo")
    first = fingerprint(tmp_path / "a" / "repo" / "apt" / "llmgw.gpg")
    assert (tmp_path / "a" / "release-key").stat().st_mode & 0o777 == 0o700
    make_repo(packages, tmp_path / "a" / "repo")
    assert fingerprint(tmp_path / "a" / "repo" / "apt" / "llmgw.gpg") == first

    # A release key of one's own, with a passphrase: every signature is made with it.
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    passphrase = tmp_path / "passphrase"
    passphrase.write_text("correct horse\n")
    gpg = ["gpg", "--homedir", str(home), "--batch", "--pinentry-mode", "loopback"]
    run(
        *gpg,
        "--passphrase-file",
        passphrase,
        "--quick-generate-key",
        "llmgw test release <t@localhost>",
        "ed25519",
        "sign",
        "never",
    )
    key = tmp_path / "release.key"
    run(*gpg, "--passphrase-file", passphrase, "--armor", "--output", key, "--export-secret-keys")
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], check=False)
    made = make_repo(
        packages,
        tmp_path / "b" / "repo",
        LLMGW_RELEASE_KEY=str(key),
        LLMGW_RELEASE_KEY_PASSPHRASE_FILE=str(passphrase),
    )
    assert "signing with the throwaway key" not in made.stderr
    assert not (tmp_path / "b" / "release-key").exists()
    apt = tmp_path / "b" / "repo" / "apt"
    own = fingerprint(key)
    assert fingerprint(apt / "llmgw.gpg") == own != first
    verified = run("gpgv", "--keyring", apt / "llmgw.gpg", apt / "dists/stable/InRelease")
    assert own in verified.stderr
    db = tmp_path / "rpmdb"
    db.mkdir()
    run("rpm", "--dbpath", db, "--import", tmp_path / "b" / "repo" / "yum" / "RPM-GPG-KEY-llmgw")
    for rpm in (tmp_path / "b" / "repo" / "yum" / "x86_64").glob("*.rpm"):
        assert run("rpm", "--dbpath", db, "-K", rpm).stdout.strip().endswith("signatures OK")


def test_repo_sh_says_what_is_missing(
    standin_packages: dict[str, Packages], tmp_path: Path
) -> None:
    require_tools("apt-ftparchive", "gpg", "createrepo_c", "rpmsign", "dpkg-deb")
    script = str(ROOT / "scripts" / "repo.sh")
    empty = tmp_path / "empty"
    empty.mkdir()
    no_packages = subprocess.run(
        [script, "--packages", str(empty), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
    )
    assert no_packages.returncode == 1
    assert f"no .deb in {empty}; run 'make packages' first" in no_packages.stderr
    missing_key = tmp_path / "no-such.key"
    no_key = subprocess.run(
        [
            script,
            "--packages",
            str(standin_packages[CURRENT].directory),
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "LLMGW_RELEASE_KEY": str(missing_key)},
    )
    assert no_key.returncode == 1
    assert f"LLMGW_RELEASE_KEY names {missing_key}, which does not exist" in no_key.stderr
    assert not (tmp_path / "r").exists()
    assert not list(tmp_path.glob(".repo.*")), "a failed run leaves no staging directory"


def test_apt_installs_from_the_signed_repository_on_loopback(
    container: Container, repo: Path
) -> None:
    c = container
    c.sh(SERVE.format(root="/pkgs/repo"))
    c.sh(ADD_SOURCE)
    c.wait_for(
        f"python3 -c \"import urllib.request as u; u.urlopen('{URL}/apt/llmgw.list')\"",
        "the repository served",
    )
    c.sh("apt-get update -q")
    c.sh("apt-get install -y -q llmgw-agent")
    assert c.out("dpkg-query -W -f '${Version}' llmgw-agent") == CURRENT
    assert c.out("llmgw --version") == f"llmgw {CURRENT}"


def test_apt_refuses_a_tampered_inrelease(container: Container, repo: Path) -> None:
    c = container
    c.sh("cp -r /pkgs/repo /srv/repo")
    c.sh("sed -i 's/^Label: llmgw$/Label: llmgX/' /srv/repo/apt/dists/stable/InRelease")
    assert c.out("grep -c '^Label: llmgX$' /srv/repo/apt/dists/stable/InRelease") == "1"
    c.sh(SERVE.format(root="/srv/repo"))
    c.sh(ADD_SOURCE)
    c.wait_for(
        f"python3 -c \"import urllib.request as u; u.urlopen('{URL}/apt/llmgw.list')\"",
        "the repository served",
    )
    update = c.sh("apt-get update -q", check=False)
    assert update.returncode != 0
    assert "BADSIG" in update.stderr + update.stdout
    assert "is not signed" in update.stderr
    install = c.sh("apt-get install -y -q llmgw-agent", check=False)
    assert install.returncode != 0
    assert "Unable to locate package llmgw-agent" in install.stderr
    assert c.sh("test -e /usr/bin/llmgw", check=False).returncode == 1
