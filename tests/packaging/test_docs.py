"""What the builds generate for the packages and the bundle (issue 20), each generator on its
own: the Debian changelog from CHANGELOG.md (packaging/changelog.py), the licences, copyright
file and SBOM from an inventory (packaging/licenses.py), the manual pages and the shell
completions from the click definitions (packaging/manpages.py, completions.py)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from llmgw.cli import main as cli
from tests.ci import require_tools

from .distcheck import ROOT, load_packaging_module

changelog = load_packaging_module("changelog")
licenses = load_packaging_module("licenses")
manpages = load_packaging_module("manpages")
completions = load_packaging_module("completions")

NOTES = """# Changelog

Intro text is ignored.

## [Unreleased]

- Next thing, said over
  two lines.

## [0.2.0] - 2026-12-01

- Second.

## [0.1.0] - 2026-11-29

- First.
"""


# ---------------------------------------------------------------------------- changelog


def test_the_changelog_of_a_release_starts_at_it_and_parses_with_dpkg(tmp_path: Path) -> None:
    releases = changelog.parse(NOTES)
    assert [r.version for r in releases] == ["Unreleased", "0.2.0", "0.1.0"]
    assert releases[0].items == ("Next thing, said over two lines.",)
    text = changelog.debian_changelog(
        releases, package="llmgw-agent", version="0.1.0", maintainer="A <a@llmgw.dev>", epoch=0
    )
    assert text.startswith("llmgw-agent (0.1.0) unstable; urgency=medium\n")
    assert "0.2.0" not in text and "Next thing" not in text
    require_tools("dpkg-parsechangelog")
    path = tmp_path / "changelog"
    path.write_text(text)
    parsed = subprocess.run(
        ["dpkg-parsechangelog", "-l", str(path), "-S", "Version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert parsed.stdout.strip() == "0.1.0"


def test_a_version_without_its_section_takes_unreleased_dated_source_date_epoch() -> None:
    releases = changelog.parse(NOTES)
    text = changelog.debian_changelog(
        releases, package="p", version="0.3.0", maintainer="A <a@llmgw.dev>", epoch=1796428800
    )
    first = text.split("\n\n")[0:3]
    assert first[0] == "p (0.3.0) unstable; urgency=medium"
    assert "Next thing, said over two lines." in first[1]
    assert "Sat, 05 Dec 2026" in first[2]
    assert text.count(" -- A <a@llmgw.dev>") == 3
    rpm = changelog.chglog(
        releases, package="p", version="0.3.0", maintainer="A <a@llmgw.dev>", epoch=0
    )
    assert rpm.startswith("- semver: 0.3.0-1\n")


@pytest.mark.parametrize(
    ("notes", "says"),
    [
        ("## [0.1.0]\n- x\n", "release 0.1.0 needs a date"),
        ("## 0.1.0 - 2026-11-29\n- x\n", "is not '## [VERSION] - YYYY-MM-DD'"),
        ("## [0.1.0] - 2026-11-29\n", "lists no change"),
        ("## [0.1.0] - 2026-11-29\nloose text\n", "neither a '- ' item"),
    ],
)
def test_release_notes_that_cannot_be_read_are_refused_with_the_fix(notes: str, says: str) -> None:
    with pytest.raises(
        changelog.ChangelogError, match=says.replace("[", r"\[").replace("(", r"\(")
    ):
        changelog.parse(notes)


def test_a_version_with_no_section_and_no_unreleased_is_refused() -> None:
    releases = changelog.parse("## [0.1.0] - 2026-11-29\n- First.\n")
    with pytest.raises(changelog.ChangelogError, match=r"no section \[0.9.0\]"):
        changelog.debian_changelog(
            releases, package="p", version="0.9.0", maintainer="A <a@b.c>", epoch=0
        )


def test_the_projects_changelog_parses_and_the_readme_links_it() -> None:
    releases = changelog.parse((ROOT / "CHANGELOG.md").read_text())
    assert releases and all(r.items for r in releases)
    assert "[CHANGELOG.md](CHANGELOG.md)" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------- licences


def python(name: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kind": "python",
        "name": name,
        "version": "1.0",
        "license_expression": "",
        "license": "",
        "classifiers": [],
        "license_files": {},
        "files": [{"name": f"{name}.core", "kind": "pure", "typecode": "PYMODULE"}],
    }
    base.update(fields)
    return base


BSD3 = "Copyright (c) 2020 Someone\n\nRedistributions in binary form ...\nNeither the name ..."


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"license_expression": "Apache-2.0 OR MIT"}, "Apache-2.0 OR MIT"),
        ({"license": "MIT License"}, "MIT"),
        ({"license": "PSF-2.0"}, "PSF-2.0"),
        (
            {"classifiers": ["License :: OSI Approved :: Apache Software License"]},
            "Apache-2.0",
        ),
        (
            {
                "classifiers": [
                    "License :: OSI Approved :: Apache Software License",
                    "License :: OSI Approved :: MIT License",
                ]
            },
            "Apache-2.0 OR MIT",
        ),
        (
            {
                "classifiers": ["License :: OSI Approved :: BSD License"],
                "license_files": {"LICENSE": BSD3},
            },
            "BSD-3-Clause",
        ),
        (
            {"license": "GPLv2-or-later with a special exception which allows to use PyInstaller"},
            "GPL-2.0-or-later WITH Bootloader-exception",
        ),
    ],
)
def test_a_distributions_licence_is_read_from_its_own_metadata(
    fields: dict[str, Any], expected: str
) -> None:
    assert licenses.resolve(python("x", **fields)).expression == expected


def test_a_bsd_licence_without_text_is_named_not_guessed() -> None:
    resolved = licenses.resolve(python("x", classifiers=["License :: OSI Approved :: BSD License"]))
    assert resolved.expression is None and resolved.names == ["BSD"]


def test_a_distribution_that_names_no_licence_fails_the_build() -> None:
    with pytest.raises(licenses.LicenceError, match=r"x 1\.0 names no licence"):
        licenses.resolve(python("x"))


def debian(name: str, copyright_file: str) -> dict[str, Any]:
    return {
        "kind": "debian",
        "name": name,
        "version": "1-1",
        "copyright_file": copyright_file,
        "files": [{"name": f"{name}.so.1", "kind": "binaries", "typecode": "BINARY"}],
    }


DEP5 = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/

Files: *
Copyright: 2001 Someone
License: BSD-3-clause and GPL-2+
"""


def test_a_debian_librarys_licence_comes_from_its_machine_readable_copyright() -> None:
    resolved = licenses.resolve(debian("libx1", DEP5))
    assert resolved.expression == "BSD-3-Clause AND GPL-2.0-or-later"
    assert resolved.notices == ["2001 Someone"]
    other = licenses.resolve(
        debian("liby1", "This package was debianized by ...\nCopyright 1999 Y")
    )
    assert other.expression is None and other.names == ["Debian-liby1-copyright"]
    with pytest.raises(licenses.LicenceError, match="has no /usr/share/doc/libz1/copyright"):
        licenses.resolve(debian("libz1", ""))


def inventory() -> dict[str, Any]:
    return {
        "project": {"kind": "project", "name": "llmgw", "files": []},
        "components": [
            {
                "kind": "cpython",
                "name": "CPython",
                "version": "3.11.2",
                "license_files": {"LICENSE.txt": "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2\n"},
                "files": [{"name": "json", "kind": "pure", "typecode": "PYMODULE"}],
            },
            python(
                "aiothing", license_expression="Apache-2.0", license_files={"LICENSE": "A\n\nB"}
            ),
            python("dual", license_expression="Apache-2.0 OR MIT"),
            debian("libx1", DEP5),
        ],
    }


def test_the_copyright_file_is_strict_dep5_naming_each_component() -> None:
    from debian.copyright import Copyright

    text = licenses.copyright_text(inventory(), contact="A <a@llmgw.dev>")
    parsed = Copyright(io.StringIO(text), strict=True)
    assert list(parsed.header.upstream_contact) == ["A <a@llmgw.dev>"]
    paragraphs = list(parsed.all_files_paragraphs())
    assert paragraphs[0].files == ("*",) and paragraphs[0].license.synopsis == "Apache-2.0"
    comments = [p.comment for p in paragraphs[1:]]
    assert "CPython 3.11.2" in comments[0]
    assert "the Python distribution aiothing 1.0" in comments[1]
    assert "the Debian 11 package libx1 1-1" in comments[3]
    assert paragraphs[2].files == ("aiothing/*",)
    assert paragraphs[2].license.text.splitlines()[-1] == "B"  # its own text, verbatim
    server = licenses.copyright_text(inventory(), package="llmgw-server")
    assert len(list(Copyright(io.StringIO(server), strict=True).all_files_paragraphs())) == 1


def test_the_rpm_expression_joins_every_licence_once() -> None:
    expression = licenses.package_expression(inventory())
    assert expression == (
        "Apache-2.0 AND PSF-2.0 AND (Apache-2.0 OR MIT) AND BSD-3-Clause AND GPL-2.0-or-later"
    )
    assert licenses.package_expression(inventory(), package="llmgw-server") == "Apache-2.0"


def test_the_sbom_validates_and_describes_the_artifact(tmp_path: Path) -> None:
    artifact = tmp_path / "llmgw-agent_1.0_amd64.deb"
    artifact.write_bytes(b"package bytes")
    text = licenses.sbom_json(
        inventory(),
        artifact=artifact,
        name="llmgw-agent",
        version="1.0",
        purl="pkg:deb/llmgw/llmgw-agent@1.0?arch=amd64",
        arch="amd64",
        epoch=0,
    )
    sbom = json.loads(text)
    purls = {c["purl"] for c in sbom["components"]}
    assert "pkg:pypi/aiothing@1.0" in purls and "pkg:generic/cpython@3.11.2" in purls
    assert "pkg:deb/debian/libx1@1-1?arch=amd64&distro=debian-11" in purls
    digest = sbom["metadata"]["component"]["hashes"][0]["content"]
    assert digest == hashlib.sha256(b"package bytes").hexdigest()
    again = licenses.sbom_json(
        inventory(),
        artifact=artifact,
        name="llmgw-agent",
        version="1.0",
        purl="pkg:deb/llmgw/llmgw-agent@1.0?arch=amd64",
        arch="amd64",
        epoch=0,
    )
    assert again == text  # reproducible: serial number and time from the artifact and epoch


def test_an_inventory_that_is_missing_or_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(licenses.LicenceError, match="make dist"):
        licenses.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(licenses.LicenceError, match="is not JSON"):
        licenses.load(bad)
    bad.write_text("[]")
    with pytest.raises(licenses.LicenceError, match="not an inventory"):
        licenses.load(bad)


# ---------------------------------------------------------------------------- manual pages


def every_command(group: click.Group, path: list[str]) -> list[tuple[list[str], click.Command]]:
    ctx = click.Context(group, info_name=path[-1])
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        if command.hidden:
            continue
        out.append(([*path, name], command))
        if isinstance(command, click.Group):
            out += every_command(command, [*path, name])
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("man")
    manpages.write(out, "9.8.7", "2026-12-05")
    return {p.name: gzip.decompress(p.read_bytes()).decode() for p in sorted(out.iterdir())}


def test_there_is_a_page_per_command_group_and_each_command_is_in_its_page(
    pages: dict[str, str],
) -> None:
    groups = [path[1] for path, _ in every_command(cli, ["llmgw"]) if len(path) == 2]
    assert set(pages) == {"llmgw.1.gz", *(f"llmgw-{g}.1.gz" for g in groups)}
    for path, command in every_command(cli, ["llmgw"]):
        if len(path) < 3:
            continue
        page = pages[f"llmgw-{path[1]}.1.gz"]
        title = manpages.escape(" ".join(path))
        assert f'.SS "{title}"' in page, f"{' '.join(path)} is missing from its page"
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert manpages.escape(param.opts[0]) in page, f"{' '.join(path)} {param.opts[0]}"
    for text in pages.values():
        assert '"llmgw 9.8.7" "llmgw manual"' in text.splitlines()[0]


def test_the_pages_format_without_a_warning_and_have_a_whatis_line(
    pages: dict[str, str], tmp_path: Path
) -> None:
    require_tools("groff", "man", "lexgrog")
    for name, text in pages.items():
        groff = subprocess.run(
            ["groff", "-man", "-Tutf8", "-ww", "-z"], input=text, capture_output=True, text=True
        )
        assert groff.stderr == "", f"{name}: {groff.stderr}"
        path = tmp_path / name
        path.write_bytes(gzip.compress(text.encode()))
        man = subprocess.run(
            ["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(path)],
            capture_output=True,
            text=True,
            env={"LC_ALL": "C.UTF-8", "MANROFFSEQ": "", "MANWIDTH": "80", "PATH": "/usr/bin:/bin"},
        )
        assert man.returncode == 0 and man.stderr == "", f"{name}: {man.stderr}"
        whatis = subprocess.run(["lexgrog", str(path)], capture_output=True, text=True)
        assert whatis.returncode == 0 and " - " in whatis.stdout, whatis.stdout


def test_pages_are_reproducible(tmp_path: Path) -> None:
    first = manpages.write(tmp_path / "a", "1.0", "2026-12-05")
    second = manpages.write(tmp_path / "b", "1.0", "2026-12-05")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


def test_roff_escapes_what_would_be_a_request_or_an_escape() -> None:
    assert manpages.escape(".start") == "\\&.start"
    assert manpages.escape("'quote") == "\\&'quote"
    assert manpages.escape("a\\b --x é") == "a\\eb \\-\\-x \\[u00E9]"


# ---------------------------------------------------------------------------- completions


def test_completion_scripts_for_three_shells_call_back_into_llmgw(tmp_path: Path) -> None:
    scripts = completions.scripts()
    assert set(scripts) == {"llmgw.bash", "_llmgw", "llmgw.fish"}
    for text in scripts.values():
        assert "_LLMGW_COMPLETE" in text
    assert scripts["_llmgw"].startswith("#compdef llmgw\n")
    path = tmp_path / "llmgw.bash"
    path.write_text(scripts["llmgw.bash"])
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_completion_offers_groups_subcommands_and_options() -> None:
    from click.shell_completion import ShellComplete

    def offered(args: list[str], incomplete: str) -> list[str]:
        complete = ShellComplete(cli, {}, "llmgw", "_LLMGW_COMPLETE")
        return [item.value for item in complete.get_completions(args, incomplete)]

    assert {"up", "server", "agent", "ctl", "engine"} <= set(offered([], ""))
    assert {"approve", "admin"} <= set(offered(["ctl"], "a"))
    assert "--fingerprint" in offered(["ctl", "approve"], "--")


def test_bash_itself_completes_through_the_generated_script(tmp_path: Path) -> None:
    """The generated script in a real bash, calling a real llmgw (this checkout's)."""
    require_tools("bash")
    llmgw = shutil.which("llmgw", path=str(Path(sys.executable).parent))
    assert llmgw, "the venv's llmgw command"
    script = tmp_path / "llmgw.bash"
    script.write_text(completions.scripts()["llmgw.bash"])
    probe = (
        f"PATH={Path(llmgw).parent}:$PATH; . {script}; "
        "COMP_WORDS=(llmgw ctl appr); COMP_CWORD=2; _llmgw_completion llmgw appr ctl; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    result = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["approve"], result.stderr
