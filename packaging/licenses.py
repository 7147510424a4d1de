"""The licences of a frozen llmgw, from the build's inventory (packaging/inventory.py): the
machine-readable copyright file (DEP-5) that the packages install as
``/usr/share/doc/<package>/copyright`` and the agent bundle carries as ``LICENSES``, the SPDX
expression of the rpm's ``License:`` tag, and a CycloneDX SBOM of each bundle and package.

Nothing here is written by hand per component: each licence is read from what the component
itself says (a Python distribution's ``License-Expression``, else its ``License`` field, else
its trove classifiers; a Debian package's machine-readable copyright file; CPython's
LICENSE.txt), and each text is the component's own licence file, verbatim.

usage: licenses.py copyright --contents C.json [--package NAME] --out FILE
       licenses.py expression --contents C.json
       licenses.py sbom --contents C.json --artifact FILE --name NAME --version V
                         --purl PURL --out FILE.cdx.json
       licenses.py names --contents C.json      (the Python distributions, one a line)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import textwrap
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "LicenceError",
    "Resolved",
    "copyright_text",
    "package_expression",
    "resolve",
    "sbom_json",
]

PROJECT = "llmgw"
PROJECT_LICENCE = "Apache-2.0"
PROJECT_URL = "https://llmgw.dev"
DEFAULT_CONTACT = "llmgw developers <packages@llmgw.dev>"
ROOT = Path(__file__).resolve().parent.parent
DEP5_FORMAT = "https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"
FIRST_YEAR = 2026
# llmgw's own licence, by reference (Debian policy 12.5: the common licences are not copied);
# the file LICENSE of the sources and of the wheel holds its text.
PROJECT_LICENCE_NOTE = (
    'Licensed under the Apache License, Version 2.0 (the "License"); you may not use this '
    "software except in compliance with the License. You may obtain a copy of the License at "
    "https://www.apache.org/licenses/LICENSE-2.0\n\n"
    "Unless required by applicable law or agreed to in writing, software distributed under "
    'the License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF '
    "ANY KIND, either express or implied. See the License for the specific language "
    "governing permissions and limitations under the License.\n\n"
    "On Debian systems, the complete text of the Apache License, Version 2.0 is in "
    "/usr/share/common-licenses/Apache-2.0."
)

# Trove classifiers -> SPDX (the classifiers that name one licence unambiguously).
TROVE = {
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "License :: OSI Approved :: Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: GNU Lesser General Public License v2 or later (LGPLv2+)": (
        "LGPL-2.1-or-later"
    ),
    "License :: OSI Approved :: GNU Lesser General Public License v3 (LGPLv3)": "LGPL-3.0-only",
    "License :: OSI Approved :: GNU General Public License v2 or later (GPLv2+)": (
        "GPL-2.0-or-later"
    ),
    "License :: OSI Approved :: GNU General Public License v3 (GPLv3)": "GPL-3.0-only",
    # Which BSD licence: read from the text (bsd_variant).
    "License :: OSI Approved :: BSD License": "BSD",
}
# Spellings of the License field that are not SPDX but say one licence plainly.
LICENSE_FIELD = {
    "apache 2.0": "Apache-2.0",
    "apache-2.0": "Apache-2.0",
    "apache software license": "Apache-2.0",
    "mit license": "MIT",
    "mit": "MIT",
    "3-clause bsd license": "BSD-3-Clause",
    "bsd-3-clause": "BSD-3-Clause",
    "bsd": "BSD",
    "lgplv2+": "LGPL-2.1-or-later",
    "psf-2.0": "PSF-2.0",
    "mpl-2.0": "MPL-2.0",
}
# PyInstaller's License field (its COPYING.txt: GPL 2 or later, with the exception that lets a
# frozen program carry the bootloader under its own licence).
PYINSTALLER_LICENCE = "GPL-2.0-or-later WITH Bootloader-exception"
# Debian's short licence names (copyright-format 1.0) -> SPDX.
DEBIAN_SIMPLE = {
    "zlib": "Zlib",
    "expat": "MIT",
    "mit": "MIT",
    "isc": "ISC",
    "cc0-1.0": "CC0-1.0",
    "apache-2.0": "Apache-2.0",
    "bsd-2-clause": "BSD-2-Clause",
    "bsd-3-clause": "BSD-3-Clause",
    "bsd-4-clause": "BSD-4-Clause",
    "mpl-2.0": "MPL-2.0",
}
DEBIAN_GNU = re.compile(r"^(GPL|LGPL|AGPL)-(\d)(?:\.(\d))?(\+)?$", re.IGNORECASE)
COPYRIGHT_LINE = re.compile(r"^\s*(?:Copyright\b|\(c\)|©).*\d{4}.*$", re.IGNORECASE | re.MULTILINE)


class LicenceError(Exception):
    """The inventory cannot be turned into licences; the message says what to do."""


@dataclass
class Resolved:
    """One component's licence: an SPDX expression when its own metadata gives one, else the
    names it gives (``names``); the texts it ships; the copyright notices found in them."""

    expression: str | None
    names: list[str] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    source: str = ""

    @property
    def short(self) -> str:
        """The licence as a DEP-5 ``License:`` short name."""
        if self.expression:
            return self.expression
        return " and ".join(n.replace(" ", "-") for n in self.names)


def is_spdx(expression: str) -> bool:
    from cyclonedx.spdx import is_expression

    return bool(expression) and is_expression(expression)


def bsd_variant(texts: Iterable[str]) -> str:
    """BSD-3-Clause or BSD-2-Clause as the text reads, else plain 'BSD' (no text to read)."""
    joined = "\n".join(texts)
    if re.search(r"Neither the name", joined, re.IGNORECASE):
        return "BSD-3-Clause"
    if re.search(r"Redistributions in binary form", joined, re.IGNORECASE):
        return "BSD-2-Clause"
    return "BSD"


def _notices(texts: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for text in texts:
        for match in COPYRIGHT_LINE.finditer(text):
            line = " ".join(match.group(0).split())
            if len(line) < 200 and "copyright notice" not in line.lower():
                seen.setdefault(line, None)
    return list(seen)


def _python(component: dict[str, Any]) -> Resolved:
    texts = dict(component.get("license_files") or {})
    expression = component.get("license_expression") or ""
    source = "License-Expression"
    if not is_spdx(expression):
        expression, source = "", ""
        field_value = (component.get("license") or "").strip()
        if field_value.lower().startswith("gplv2-or-later with a special exception"):
            expression, source = PYINSTALLER_LICENCE, "License (PyInstaller's exception)"
        elif field_value and is_spdx(field_value):
            expression, source = field_value, "License"
        elif field_value.lower() in LICENSE_FIELD:
            expression, source = LICENSE_FIELD[field_value.lower()], "License"
        if not expression:
            mapped = [TROVE[c] for c in component.get("classifiers", []) if c in TROVE]
            if mapped:
                expression = " OR ".join(dict.fromkeys(mapped))
                source = "classifiers"
    if expression == "BSD":
        expression = bsd_variant(texts.values())
    if not expression:
        raise LicenceError(
            f"{component['name']} {component['version']} names no licence (no "
            "License-Expression, License or licence classifier); find its licence and teach "
            "packaging/licenses.py how to read it"
        )
    if is_spdx(expression):
        return Resolved(expression, texts=texts, notices=_notices(texts.values()), source=source)
    return Resolved(None, [expression], texts, _notices(texts.values()), source)


def _debian_expression(names: str) -> str | None:
    """A Debian ``License:`` value ('BSD-3-clause and GPL-2') as SPDX, or None."""
    parts = re.split(r"\s+(and|or)\s+", names.strip(), flags=re.IGNORECASE)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(part.upper())
            continue
        gnu = DEBIAN_GNU.match(part)
        if gnu:
            kind, major, minor, later = gnu.groups()
            version = f"{major}.{minor or (1 if kind.upper() == 'LGPL' and major == '2' else 0)}"
            out.append(f"{kind.upper()}-{version}-{'or-later' if later else 'only'}")
        elif part.lower() in DEBIAN_SIMPLE:
            out.append(DEBIAN_SIMPLE[part.lower()])
        else:
            return None
    expression = " ".join(out)
    return expression if is_spdx(expression) else None


def _dep5_paragraphs(text: str) -> list[dict[str, str]]:
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields:
            paragraphs.append(fields)
    return paragraphs


def _debian(component: dict[str, Any]) -> Resolved:
    text = component.get("copyright_file") or ""
    name = component["name"]
    if not text:
        raise LicenceError(
            f"the Debian package {name} has no /usr/share/doc/{name}/copyright in the build "
            "rootfs; rebuild the rootfs (rm -rf the cached one under /var/cache/llmgw-test/dist)"
        )
    texts = {f"/usr/share/doc/{name}/copyright (Debian)": text}
    if text.startswith("Format:"):
        paragraphs = _dep5_paragraphs(text)
        for paragraph in paragraphs:
            if paragraph.get("files", "").split() == ["*"] and paragraph.get("license"):
                names = paragraph["license"].split("\n")[0]
                notices = [n for n in paragraph.get("copyright", "").split("\n") if n.strip()]
                expression = _debian_expression(names)
                if expression:
                    return Resolved(expression, texts=texts, notices=notices, source="DEP-5")
                return Resolved(None, [names], texts, notices, "DEP-5")
    # Not machine-readable: the licence is what its copyright file (given in full) says.
    return Resolved(
        None,
        [f"Debian-{name}-copyright"],
        texts,
        _notices([text]) or [f"the authors of {name} (see its copyright file below)"],
        "Debian copyright file, not machine-readable",
    )


def _cpython(component: dict[str, Any]) -> Resolved:
    texts = dict(component["license_files"])
    if "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" not in "".join(texts.values()):
        raise LicenceError(
            "CPython's LICENSE.txt does not carry the PSF License Version 2 any more; read it "
            "and update packaging/licenses.py"
        )
    return Resolved("PSF-2.0", texts=texts, notices=_notices(texts.values()), source="LICENSE.txt")


def resolve(component: dict[str, Any]) -> Resolved:
    kind = component["kind"]
    if kind == "python":
        return _python(component)
    if kind == "debian":
        return _debian(component)
    if kind == "cpython":
        return _cpython(component)
    raise LicenceError(f"unknown kind of component {kind!r} in the inventory")


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise LicenceError(
            f"{path} does not exist: the build's inventory comes with the binaries (make dist)"
        ) from exc
    except ValueError as exc:
        raise LicenceError(f"{path} is not JSON ({exc}); build again (make dist)") from exc
    if not isinstance(data, dict) or not isinstance(data.get("components"), list):
        raise LicenceError(f"{path} is not an inventory of packaging/inventory.py; make dist")
    return data


# ---------------------------------------------------------------------------- DEP-5


def _field_text(text: str) -> str:
    """A multi-line field value: each line indented by one space, empty ones as ' .'."""
    lines = text.rstrip("\n").expandtabs(8).splitlines()
    return "\n".join(f" {line.rstrip()}" if line.strip() else " ." for line in lines)


def _files(component: dict[str, Any]) -> list[str]:
    """Where the component's files are inside the frozen program, by their top-level name."""
    names: dict[str, None] = {}
    for entry in component["files"]:
        name, kind = entry["name"], entry["kind"]
        if kind == "bootloader":
            names.setdefault("llmgw", None)
            continue
        if kind in ("pure", "scripts"):
            name = name.replace(".", "/")
        top, _, rest = name.partition("/")
        names.setdefault(f"{top}/*" if rest else top, None)
    # A package's own __init__ is covered by its directory's pattern.
    return sorted(n for n in names if f"{n}/*" not in names)


def _describe(component: dict[str, Any], resolved: Resolved) -> str:
    kind, name, version = component["kind"], component["name"], component["version"]
    if kind == "python":
        where = (
            f"the Python distribution {name} {version} (https://pypi.org/project/{name}/{version}/)"
        )
    elif kind == "debian":
        where = f"the Debian 11 package {name} {version}, a shared library the build links"
    else:
        where = f"CPython {version}, the interpreter and standard library the build freezes"
    extra = ""
    if name.lower() == "pyinstaller":
        extra = (
            "; its bootloader starts the llmgw executable, compiled with "
            "packaging/pyinstaller-runtime-dir.patch (the directory a one-file build unpacks "
            "into)"
        )
    return f"{where}{extra}; licence from {resolved.source}."


def copyright_text(
    contents: dict[str, Any],
    *,
    package: str = "llmgw-agent",
    contact: str = DEFAULT_CONTACT,
) -> str:
    """The DEP-5 copyright file of ``package`` (llmgw-agent and the bundle: everything the
    frozen program carries; llmgw-server: llmgw alone, whose program is llmgw-agent's)."""
    bundles = package != "llmgw-server"
    header = [
        f"Format: {DEP5_FORMAT}",
        f"Upstream-Name: {PROJECT}",
        f"Upstream-Contact: {contact}",
        f"Source: {PROJECT_URL}",
    ]
    comment = (
        "Generated at build time by packaging/licenses.py from the build's own inventory "
        "(packaging/inventory.py), never by hand."
    )
    if bundles:
        comment += (
            " The llmgw program is a PyInstaller build that carries CPython, the Python "
            "distributions and the shared libraries below; each paragraph's Files names where "
            "they are inside it (under /usr/lib/llmgw/_internal/ in the packages, in the "
            "executable's archive otherwise). Each licence text is the component's own, verbatim."
        )
    else:
        comment += " The llmgw program and what it bundles come with the llmgw-agent package."
    header.append(f"Comment:\n{_field_text(comment)}")
    paragraphs = ["\n".join(header)]
    year = datetime.fromtimestamp(int(os.environ.get("SOURCE_DATE_EPOCH") or 0), UTC).year
    years = f"{FIRST_YEAR}-{year}" if year > FIRST_YEAR else str(FIRST_YEAR)
    paragraphs.append(
        "\n".join(
            [
                "Files: *",
                f"Copyright: {years} llmgw developers",
                f"License: {PROJECT_LICENCE}",
                _field_text(
                    "\n\n".join(textwrap.fill(p, 78) for p in PROJECT_LICENCE_NOTE.split("\n\n"))
                ),
            ]
        )
    )
    if bundles:
        for component in contents["components"]:
            resolved = resolve(component)
            notices = resolved.notices or [f"the {component['name']} authors"]
            text = "\n\n".join(
                f"{name}:\n\n{body.strip()}" for name, body in sorted(resolved.texts.items())
            ) or (
                f"{component['name']} {component['version']} ships no licence text; its "
                f"metadata says {resolved.short}."
            )
            files = _files(component)
            paragraphs.append(
                "\n".join(
                    [
                        "Files:\n" + _field_text("\n".join(files)),
                        "Copyright:\n" + _field_text("\n".join(notices)),
                        f"License: {resolved.short}\n{_field_text(text)}",
                        f"Comment:\n{_field_text(_describe(component, resolved))}",
                    ]
                )
            )
    return "\n\n".join(paragraphs) + "\n"


def package_expression(contents: dict[str, Any], *, package: str = "llmgw-agent") -> str:
    """The SPDX expression of everything ``package`` carries (the rpm's License: tag)."""
    parts = [PROJECT_LICENCE]
    if package != "llmgw-server":
        for component in contents["components"]:
            resolved = resolve(component)
            if resolved.expression:
                parts.append(resolved.expression)
            else:
                parts += [f"LicenseRef-{re.sub(r'[^A-Za-z0-9.-]', '-', n)}" for n in resolved.names]
    atoms: list[str] = []
    for part in parts:
        # A conjunction of plain ids is as many terms of the whole; anything else is one.
        plain = part.split(" AND ")
        if all(" " not in t and "(" not in t for t in plain):
            atoms += plain
        else:
            atoms.append(f"({part})")
    return " AND ".join(dict.fromkeys(atoms))


# ---------------------------------------------------------------------------- CycloneDX


def _purl(component: dict[str, Any], arch: str) -> str:
    from packageurl import PackageURL

    kind, name, version = component["kind"], component["name"], component["version"]
    if kind == "python":
        return PackageURL("pypi", None, name.lower().replace("_", "-"), version).to_string()
    if kind == "debian":
        # "all": the package of every architecture's bundle (llmgw-agent-bundles), which
        # carries this library once per architecture.
        qualifiers = (
            {"distro": "debian-11"} if arch == "all" else {"arch": arch, "distro": "debian-11"}
        )
        return PackageURL("deb", "debian", name, version, qualifiers).to_string()
    return PackageURL("generic", None, "cpython", version).to_string()


def _cdx_licences(resolved: Resolved) -> list[Any]:
    from cyclonedx.model.license import DisjunctiveLicense, LicenseExpression

    if resolved.expression:
        return [LicenseExpression(resolved.expression)]
    return [DisjunctiveLicense(name=name) for name in resolved.names]


def sbom_json(
    contents: dict[str, Any],
    *,
    artifact: Path,
    name: str,
    version: str,
    purl: str,
    arch: str,
    package: str = "llmgw-agent",
    epoch: int | None = None,
) -> str:
    """A CycloneDX 1.6 JSON SBOM of ``artifact`` (a bundle or a package), validated against
    the schema: the artifact (with its SHA-256), llmgw, and every component it carries."""
    from cyclonedx.model import HashAlgorithm, HashType, Property
    from cyclonedx.model.bom import Bom
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.model.license import LicenseExpression
    from cyclonedx.output.json import JsonV1Dot6
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator
    from packageurl import PackageURL

    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    if epoch is None:
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or 0)
    bom = Bom(serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"llmgw-sbom:{artifact.name}:{digest}"))
    bom.metadata.timestamp = datetime.fromtimestamp(epoch, UTC)
    top = Component(
        name=name,
        version=version,
        type=ComponentType.APPLICATION,
        purl=PackageURL.from_string(purl),
        bom_ref=purl,
        hashes=[HashType(alg=HashAlgorithm.SHA_256, content=digest)],
        licenses=[LicenseExpression(package_expression(contents, package=package))],
        properties=[Property(name="llmgw:file", value=artifact.name)],
    )
    bom.metadata.component = top
    program = Component(
        name=PROJECT,
        version=version,
        type=ComponentType.APPLICATION,
        purl=PackageURL("generic", None, PROJECT, version),
        bom_ref=f"pkg:generic/{PROJECT}@{version}",
        licenses=[LicenseExpression(PROJECT_LICENCE)],
        description="the llmgw program",
    )
    bom.components.add(program)
    bom.register_dependency(top, [program])
    children = []
    if package != "llmgw-server":
        for component in contents["components"]:
            resolved = resolve(component)
            ref = _purl(component, arch)
            kind = component["kind"]
            child = Component(
                name=component["name"],
                version=component["version"],
                type=ComponentType.FRAMEWORK if kind == "cpython" else ComponentType.LIBRARY,
                purl=PackageURL.from_string(ref),
                bom_ref=ref,
                licenses=_cdx_licences(resolved),
                properties=[
                    Property(name="llmgw:kind", value=kind),
                    Property(name="llmgw:licence-source", value=resolved.source),
                    Property(name="llmgw:files", value=" ".join(_files(component))),
                ],
            )
            bom.components.add(child)
            children.append(child)
        bom.register_dependency(program, children)
    for child in children:
        bom.register_dependency(child, [])
    text = JsonV1Dot6(bom).output_as_string(indent=1)
    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if errors is not None:
        raise LicenceError(f"the SBOM of {artifact.name} does not validate: {errors}")
    return text + "\n"


def python_names(contents: dict[str, Any]) -> list[str]:
    return [c["name"] for c in contents["components"] if c["kind"] == "python"]


def _write(out: Path, text: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="licenses.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("copyright", "expression", "sbom", "names"):
        p = sub.add_parser(command)
        p.add_argument("--contents", type=Path, required=True, help="the build's inventory")
        if command != "names":
            p.add_argument("--package", default="llmgw-agent")
        if command in ("copyright", "sbom"):
            p.add_argument("--out", type=Path, required=True)
        if command == "copyright":
            p.add_argument(
                "--contact", default=os.environ.get("LLMGW_MAINTAINER") or DEFAULT_CONTACT
            )
        if command == "sbom":
            p.add_argument("--artifact", type=Path, required=True)
            p.add_argument("--name", required=True)
            p.add_argument("--version", required=True)
            p.add_argument("--purl", required=True)
            p.add_argument(
                "--arch",
                required=True,
                help="the Debian architecture (amd64, arm64; all for llmgw-agent-bundles)",
            )
    args = parser.parse_args(argv)
    try:
        contents = load(args.contents)
        if args.command == "copyright":
            _write(args.out, copyright_text(contents, package=args.package, contact=args.contact))
        elif args.command == "expression":
            print(package_expression(contents, package=args.package))
        elif args.command == "names":
            print("\n".join(python_names(contents)))
        else:
            if not args.artifact.is_file():
                raise LicenceError(f"{args.artifact} does not exist; build it first")
            text = sbom_json(
                contents,
                artifact=args.artifact,
                name=args.name,
                version=args.version,
                purl=args.purl,
                arch=args.arch,
                package=args.package,
            )
            _write(args.out, text)
    except (LicenceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
