"""The packages' Debian changelog, from the project's release notes (CHANGELOG.md).

Each ``## [VERSION] - YYYY-MM-DD`` section of CHANGELOG.md becomes one entry, newest first;
``## [Unreleased]`` becomes the entry of the version being built when CHANGELOG.md has no
section of that version yet (a build of the next release, or a test build stamped another
version), dated SOURCE_DATE_EPOCH. The output is gzip'd without a name or a timestamp, so
that a rebuild of one commit gives the same bytes.

The packages are native (their version has no Debian revision), so Debian policy names the
file ``/usr/share/doc/<package>/changelog.gz``, which is what lintian checks for.

usage: changelog.py --package NAME --version V --maintainer 'Name <mail>' [--changelog FILE]
                    --out FILE.gz [--chglog FILE.yml]
"""

from __future__ import annotations

import argparse
import email.utils
import gzip
import io
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["ChangelogError", "Release", "debian_changelog", "parse"]

ROOT = Path(__file__).resolve().parent.parent
SECTION = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?\s*$")
UNRELEASED = "Unreleased"


class ChangelogError(Exception):
    """CHANGELOG.md cannot be read as release notes; the message says what to fix."""


@dataclass(frozen=True)
class Release:
    version: str
    date: datetime | None
    items: tuple[str, ...]


def parse(text: str, *, source: str = "CHANGELOG.md") -> list[Release]:
    """The sections of ``text``, in order, each with its items (continuation lines joined)."""
    releases: list[Release] = []
    current: tuple[str, datetime | None] | None = None
    items: list[str] = []

    def close() -> None:
        if current is not None:
            if not items:
                raise ChangelogError(
                    f"{source}: section [{current[0]}] lists no change; add '- ...' items"
                )
            releases.append(Release(current[0], current[1], tuple(items)))

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            match = SECTION.match(line)
            if not match:
                raise ChangelogError(
                    f"{source}:{number}: '{line}' is not '## [VERSION] - YYYY-MM-DD' "
                    "(or '## [Unreleased]')"
                )
            close()
            version, date = match.group("version"), match.group("date")
            if version != UNRELEASED and not date:
                raise ChangelogError(f"{source}:{number}: release {version} needs a date")
            day = datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=UTC) if date else None
            current, items = (version, day), []
        elif current is None:
            continue
        elif line.startswith("- "):
            items.append(line[2:].strip())
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        elif line.strip():
            raise ChangelogError(
                f"{source}:{number}: '{line.strip()[:40]}' is neither a '- ' item nor its "
                "continuation (indent it by two spaces)"
            )
    close()
    return releases


def debian_changelog(
    releases: list[Release], *, package: str, version: str, maintainer: str, epoch: int
) -> str:
    """The Debian changelog of ``package`` at ``version``: that version's entry first."""
    released = [r for r in releases if r.version != UNRELEASED]
    entries = list(released)
    if not any(r.version == version for r in released):
        unreleased = next((r for r in releases if r.version == UNRELEASED), None)
        if unreleased is None:
            raise ChangelogError(
                f"CHANGELOG.md has no section [{version}] and no [Unreleased]; add the release "
                "notes of this version"
            )
        entries.insert(0, Release(version, datetime.fromtimestamp(epoch, UTC), unreleased.items))
    else:
        # The entries up to the version built: a build of an older version has no later ones.
        index = next(i for i, r in enumerate(entries) if r.version == version)
        entries = entries[index:]
    blocks = []
    for release in entries:
        assert release.date is not None
        lines = [f"{package} ({release.version}) unstable; urgency=medium", ""]
        for item in release.items:
            wrapped = textwrap.wrap(item, width=76, break_on_hyphens=False)
            lines.append("  * " + wrapped[0])
            lines += ["    " + rest for rest in wrapped[1:]]
        stamp = email.utils.format_datetime(release.date)
        lines += ["", f" -- {maintainer}  {stamp}"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def chglog(
    releases: list[Release],
    *,
    package: str,
    version: str,
    maintainer: str,
    epoch: int,
    release: str = "1",
) -> str:
    """The same entries as nfpm's changelog file (chglog YAML), which nfpm turns into the
    rpm's %changelog; each version with the rpm's ``release`` (0.1.0-1), as rpm's own
    %changelog entries say it."""
    import yaml

    text = debian_changelog(
        releases, package=package, version=version, maintainer=maintainer, epoch=epoch
    )
    entries = []
    for block in text.strip().split("\n\n" + f"{package} ("):
        header, _, rest = block.partition("\n")
        entry_version = header.removeprefix(f"{package} (").split(")")[0]
        stamp = rest.rsplit("  ", 1)[-1].strip()
        day = email.utils.parsedate_to_datetime(stamp)
        items = re.findall(r"^  \* (.*(?:\n    .*)*)", rest, re.MULTILINE)
        entries.append(
            {
                "semver": f"{entry_version}-{release}",
                "date": day.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "packager": maintainer,
                "changes": [{"note": " ".join(i.split())} for i in items],
            }
        )
    return yaml.safe_dump(entries, sort_keys=False, width=1000)


def gzipped(text: str) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        gz.write(text.encode("utf-8"))
    return raw.getvalue()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="changelog.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--maintainer", required=True)
    parser.add_argument("--changelog", type=Path, default=ROOT / "CHANGELOG.md")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chglog", type=Path, help="also nfpm's changelog YAML (the rpm's)")
    parser.add_argument("--release", default="1", help="the rpm's release, for --chglog")
    args = parser.parse_args(argv)
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or 0)
    try:
        releases = parse(args.changelog.read_text(encoding="utf-8"), source=str(args.changelog))
        text = debian_changelog(
            releases,
            package=args.package,
            version=args.version,
            maintainer=args.maintainer,
            epoch=epoch,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(gzipped(text))
        if args.chglog is not None:
            args.chglog.write_text(
                chglog(
                    releases,
                    package=args.package,
                    version=args.version,
                    maintainer=args.maintainer,
                    epoch=epoch,
                    release=args.release,
                ),
                encoding="utf-8",
            )
    except (ChangelogError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
