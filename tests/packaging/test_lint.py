"""The packages and the bundle as a distribution's reviewer reads them (issue 20): lintian and
rpmlint report nothing that is not overridden with a reason; the copyright file is DEP-5 and
names every Python distribution the binary carries; each bundle and package has a CycloneDX
SBOM listing every distribution inside the binary, checked against the binary's own archive;
manual pages and completions are where man and the shells look, after a real install.

These tests package the real one-folder build of `make dist` (the stand-in would say nothing
about the shared objects, the licences or the SBOM).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.ci import require_tools, unavailable

from .conftest import Dist
from .distcheck import DIST, ROOT
from .pkgcheck import Container, Packages, build_packages, run

pytestmark = pytest.mark.timeout(900)

# lintian's and rpmlint's report lines that count: errors and warnings.
LINTIAN_LINE = re.compile(r"^(?P<level>[EW]): (?P<package>[^:]+): (?P<tag>\S+)(?P<rest>.*)$")
RPMLINT_LINE = re.compile(r"^(?P<package>\S+): (?P<level>[EW]): (?P<tag>\S+)(?P<rest>.*)$")
TEST_CACHE = Path(os.environ.get("LLMGW_TEST_CACHE", "/var/cache/llmgw-test"))
PACKAGES = ("llmgw-agent", "llmgw-server", "llmgw-agent-bundles")


@pytest.fixture(scope="module")
def built(dist_x64: Dist, packages_root: Path) -> Packages:
    """The six packages of the real one-folder build, with their SBOMs beside them (the
    bundles package with the x64 bundle alone: the arm64 build may still be running)."""
    out = packages_root / "lint"
    build_packages(dist_x64.onedir, out, bundle_archs="x64")
    said = run(dist_x64.onedir_binary, "--version").stdout.strip()
    return Packages(said.removeprefix("llmgw "), out)


def deb_file(deb: Path, path: str) -> bytes:
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        member = archive.extractfile(f".{path}")
        assert member is not None, f"{deb.name} has no {path}"
        return member.read()


def bundle_file(bundle: Path, path: str) -> bytes:
    with tarfile.open(bundle) as archive:
        top = archive.getnames()[0].split("/")[0]
        member = archive.extractfile(f"{top}/{path}")
        assert member is not None, f"{bundle.name} has no {path}"
        return member.read()


def contents() -> dict:
    return json.loads((DIST / ".contents-x64.json").read_text())


# ---------------------------------------------------------------------------- the checkers


def test_lintian_reports_no_error_or_warning_that_is_not_overridden(built: Packages) -> None:
    require_tools("lintian")
    debs = [built.path(name, "deb") for name in PACKAGES]
    result = subprocess.run(
        ["lintian", "--tag-display-limit", "0", "--display-info", *map(str, debs)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = result.stdout.splitlines()
    reported = [line for line in lines if LINTIAN_LINE.match(line)]
    assert reported == [], "lintian reports (fix, or override with a reason):\n" + "\n".join(
        reported
    )
    # Every override still matches something: none is left to hide a future tag.
    stale = [line for line in lines if "unused-override" in line or "mismatched-override" in line]
    assert stale == [], "overrides that no longer apply:\n" + "\n".join(stale)
    # Each override line has a comment above it saying why.
    for name in PACKAGES:
        text = deb_file(built.path(name, "deb"), f"/usr/share/lintian/overrides/{name}").decode()
        previous = ""
        for line in text.splitlines():
            if line.startswith(f"{name}: "):
                # Its comment, or the override above it that shares one comment.
                assert previous.startswith(("#", f"{name}: ")), (
                    f"override without its reason: {line}"
                )
            previous = line if line.strip() else ""


def test_rpmlint_reports_no_error_or_unfiltered_warning(built: Packages) -> None:
    require_tools("rpmlint")
    rpms = [built.path(name, "rpm") for name in PACKAGES]
    result = subprocess.run(
        ["rpmlint", "-c", str(ROOT / "packaging" / "rpmlint.toml"), *map(str, rpms)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    reported = [line for line in result.stdout.splitlines() if RPMLINT_LINE.match(line)]
    assert reported == [], (
        "rpmlint reports (fix, or filter in packaging/rpmlint.toml with a reason):\n"
        + "\n".join(reported)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The filters each carry their reason (a comment above them).
    text = (ROOT / "packaging" / "rpmlint.toml").read_text()
    block = text[text.index("Filters = [") :]
    previous = ""
    for line in block.splitlines()[1:]:
        if line.strip().startswith("'"):
            assert previous.startswith(("#", "'")), f"filter without its reason: {line}"
        previous = line.strip()


def test_rpm_license_tag_is_the_spdx_expression_of_everything_bundled(built: Packages) -> None:
    require_tools("rpm")
    tag = run("rpm", "-qp", "--qf", "%{LICENSE}", built.path("llmgw-agent", "rpm")).stdout
    from cyclonedx.spdx import is_expression

    # LicenseRef- names (a Debian library whose copyright is not machine-readable) are SPDX
    # too, which cyclonedx's list of ids does not know: check the rest.
    plain = re.sub(r"LicenseRef-[A-Za-z0-9.-]+", "MIT", tag)
    assert is_expression(plain), tag
    for needed in ("Apache-2.0", "PSF-2.0", "LGPL-3.0-only", "Bootloader-exception"):
        assert needed in tag, f"{needed} missing from License: {tag}"
    server = run("rpm", "-qp", "--qf", "%{LICENSE}", built.path("llmgw-server", "rpm")).stdout
    assert server == "Apache-2.0"
    # The bundles carry the same program, and so the same licences.
    bundles = built.path("llmgw-agent-bundles", "rpm")
    assert run("rpm", "-qp", "--qf", "%{LICENSE}", bundles).stdout == tag


# ---------------------------------------------------------------------------- licences


def test_copyright_is_dep5_names_every_bundled_distribution_and_is_the_bundles_licenses(
    built: Packages, dist_x64: Dist
) -> None:
    from debian.copyright import Copyright

    text = deb_file(built.path("llmgw-agent", "deb"), "/usr/share/doc/llmgw-agent/copyright")
    parsed = Copyright(io.StringIO(text.decode()), strict=True)
    assert parsed.header.upstream_name == "llmgw"
    comments = "\n".join(p.comment or "" for p in parsed.all_files_paragraphs())
    inventory = contents()
    python = [c for c in inventory["components"] if c["kind"] == "python"]
    assert len(python) > 20
    for component in python:
        assert f"the Python distribution {component['name']} {component['version']}" in comments
    assert "CPython" in comments and "pyinstaller" in comments.lower()
    for paragraph in parsed.all_files_paragraphs():
        assert paragraph.license is not None and paragraph.license.synopsis
        assert paragraph.copyright
    # The bundle carries the same text, and the rpm (as %license), and the bundles package.
    assert bundle_file(dist_x64.bundle, "LICENSES") == text
    bundles = built.path("llmgw-agent-bundles", "deb")
    assert deb_file(bundles, "/usr/share/doc/llmgw-agent-bundles/copyright") == text
    server = deb_file(built.path("llmgw-server", "deb"), "/usr/share/doc/llmgw-server/copyright")
    assert Copyright(io.StringIO(server.decode()), strict=True).header.upstream_name == "llmgw"


def build_rootfs() -> Path:
    """The cached build rootfs of make dist (x64), whose venv the binary was frozen from."""
    ready = [
        p.parent
        for p in (TEST_CACHE / "dist").glob("bullseye-amd64-*/.llmgw-ready")
        if (p.parent / "opt" / "llmgw-build" / ".key").is_file()
    ]
    if not ready:
        unavailable(f"no build rootfs under {TEST_CACHE / 'dist'}; make dist makes it")
    return max(ready, key=lambda p: (p / "opt" / "llmgw-build" / ".key").stat().st_mtime)


# Run by the build rootfs's own Python (with PyInstaller): every distribution in the build venv
# that owns a module or file of the one-file binary's archive, read from the binary itself.
ARCHIVE_OWNERS = r"""
import importlib.metadata, json, sys
from PyInstaller.archive.readers import CArchiveReader
site, binary = sys.argv[1], sys.argv[2]
archive = CArchiveReader(binary)
names = set(archive.toc)
modules = set(archive.open_embedded_archive("PYZ.pyz").toc)
owners = {}
for dist in importlib.metadata.distributions(path=[site]):
    for entry in dist.files or []:
        path = str(entry)
        if path.endswith(".py"):
            module = path[:-3].replace("/", ".").removesuffix(".__init__")
            if module in modules:
                owners.setdefault(dist.metadata["Name"], []).append(module)
        elif path in names:
            owners.setdefault(dist.metadata["Name"], []).append(path)
print(json.dumps(sorted(owners)))
"""


def test_sbom_lists_every_python_distribution_inside_the_binary(
    dist_x64: Dist, built: Packages
) -> None:
    rootfs = build_rootfs()
    python = rootfs / "opt" / "python"
    site = rootfs / "opt" / "llmgw-build" / "lib" / "python3.11" / "site-packages"
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_LIBRARY_PATH": str(python / "lib"),
        "PYTHONHOME": str(python),
        "PYTHONPATH": str(site),
    }
    found = subprocess.run(
        [
            str(python / "bin" / "python3.11"),
            "-c",
            ARCHIVE_OWNERS,
            str(site),
            str(dist_x64.onefile),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert found.returncode == 0, found.stderr
    inside = set(json.loads(found.stdout))
    assert {"aiohttp", "grpcio", "cryptography", "tokenizers", "PyYAML"} <= inside

    sbom_paths = [
        Path(f"{dist_x64.bundle}.cdx.json"),
        Path(f"{built.path('llmgw-agent', 'deb')}.cdx.json"),
        Path(f"{built.path('llmgw-agent', 'rpm')}.cdx.json"),
        Path(f"{built.path('llmgw-agent-bundles', 'deb')}.cdx.json"),
        Path(f"{built.path('llmgw-agent-bundles', 'rpm')}.cdx.json"),
    ]
    for path in sbom_paths:
        sbom = json.loads(path.read_text())
        assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.6"
        listed = {
            c["name"]: c for c in sbom["components"] if c.get("purl", "").startswith("pkg:pypi/")
        }
        assert inside <= set(listed), f"{path.name} lacks {sorted(inside - set(listed))}"
        for component in sbom["components"]:
            assert component.get("version"), component["name"]
            assert component.get("licenses"), f"{path.name}: {component['name']} has no licence"
        # It describes the very artifact beside it.
        artifact = Path(str(path).removesuffix(".cdx.json"))
        digest = sbom["metadata"]["component"]["hashes"][0]["content"]
        assert digest == hashlib.sha256(artifact.read_bytes()).hexdigest()
    # The bundle's SBOM is in dist/SHA256SUMS.
    sums = (DIST / "SHA256SUMS").read_text()
    assert f"  {dist_x64.bundle.name}.cdx.json\n" in sums


# ---------------------------------------------------------------------------- after install


def test_after_apt_install_man_completion_and_copyright(
    container: Container, built: Packages
) -> None:
    """What an operator meets after `apt install llmgw-agent`: `man llmgw-ctl`, `llmgw <TAB>`
    (bash-completion loads it lazily) and the copyright file."""
    c = container
    c.sh(f"apt-get install -y -q {built.mounted('llmgw-agent', 'deb')} >/dev/null")
    assert c.out("man -w llmgw-ctl") == "/usr/share/man/man1/llmgw-ctl.1.gz"
    assert c.out("man -w llmgw") == "/usr/share/man/man1/llmgw.1.gz"
    assert "llmgw ctl approve" in c.out("MANWIDTH=100 man llmgw-ctl 2>/dev/null | col -b")
    loaded = c.out(
        "bash -c '. /usr/share/bash-completion/bash_completion; _completion_loader llmgw; "
        "complete -p llmgw'"
    )
    assert "_llmgw_completion" in loaded and loaded.endswith(" llmgw")
    # The completion asks the program itself: the ctl subcommands for 'llmgw ctl ap<TAB>'.
    offered = c.out(
        "COMP_WORDS='llmgw ctl ap' COMP_CWORD=2 _LLMGW_COMPLETE=bash_complete llmgw ctl ap"
    )
    assert "plain,approve" in offered.splitlines()
    assert c.out("head -n 1 /usr/share/doc/llmgw-agent/copyright").startswith("Format: ")
    assert c.out("zcat /usr/share/doc/llmgw-agent/changelog.gz | head -n 1").startswith(
        f"llmgw-agent ({built.version})"
    )


# ---------------------------------------------------------------------------- build settings


def test_the_maintainer_is_a_build_setting_and_a_bogus_one_is_refused(tmp_path: Path) -> None:
    from .pkgcheck import make_standin, nfpm_path

    standin = make_standin(tmp_path / "standin", "0.1.0")
    script = ROOT / "scripts" / "packages.sh"
    base = {**os.environ, "NFPM": str(nfpm_path())}
    out = tmp_path / "out"
    refused = subprocess.run(
        [str(script), "--binary", str(standin), "--out", str(out)],
        env={**base, "LLMGW_MAINTAINER": "llmgw <llmgw@localhost>"},
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "no real mail host" in refused.stderr
    assert not out.exists() or not list(out.iterdir()), "nothing is written when refused"
    refused = subprocess.run(
        [str(script), "--binary", str(standin), "--out", str(out)],
        env={**base, "LLMGW_MAINTAINER": "just a name"},
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "is not 'Name <address@domain>'" in refused.stderr
    # Given, it is the packages' maintainer; by default the project's address.
    (out / "SHA256SUMS").parent.mkdir(parents=True, exist_ok=True)
    (out / "SHA256SUMS").write_text("")
    made = subprocess.run(
        [str(script), "--binary", str(standin), "--out", str(out)],
        env={**base, "LLMGW_MAINTAINER": "Ops Team <ops@example.org>"},
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    packages = Packages("0.1.0", out)
    deb = packages.path("llmgw-agent", "deb")
    maintainer = run("dpkg-deb", "-f", deb, "Maintainer").stdout.strip()
    assert maintainer == "Ops Team <ops@example.org>"
    # An OUT that keeps a SHA256SUMS (dist/) gets it rewritten over the packages and SBOMs.
    sums = (out / "SHA256SUMS").read_text()
    assert f"  {deb.name}\n" in sums and f"  {deb.name}.cdx.json\n" in sums
    default = tmp_path / "default"
    made = subprocess.run(
        [str(script), "--binary", str(standin), "--out", str(default)],
        env={k: v for k, v in base.items() if k != "LLMGW_MAINTAINER"},
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    deb = Packages("0.1.0", default).path("llmgw-server", "deb")
    assert run("dpkg-deb", "-f", deb, "Maintainer").stdout.strip() == (
        "llmgw developers <packages@llmgw.dev>"
    )


def test_packages_without_the_builds_inventory_are_refused(tmp_path: Path) -> None:
    from .pkgcheck import make_standin, nfpm_path

    standin = make_standin(tmp_path / "standin", "0.1.0")
    (tmp_path / ".contents-x64.json").unlink()
    result = subprocess.run(
        [
            str(ROOT / "scripts" / "packages.sh"),
            "--binary",
            str(standin),
            "--out",
            str(tmp_path / "o"),
        ],
        env={**os.environ, "NFPM": str(nfpm_path())},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "no inventory of the build" in result.stderr and "--contents" in result.stderr
