"""The manual pages of ``llmgw``, generated from its click definitions at build time, so that
they never drift from ``--help``: ``llmgw(1)`` and one page per command group
(``llmgw-up(1)``, ``llmgw-server(1)``, ``llmgw-agent(1)``, ``llmgw-ctl(1)``, ...), each with
every subcommand below it, its options and their defaults.

Written gzip'd without a name or a timestamp (``gzip -9n``), so that two builds of one commit
give the same bytes.

usage: manpages.py --version V --date YYYY-MM-DD --out DIR
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import io
import re
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["escape", "pages"]

MANUAL = "llmgw manual"


def escape(text: str) -> str:
    """``text`` as roff: backslashes and hyphens escaped, no line starting a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    # Non-ASCII as groff's named Unicode characters: the page reads the same without preconv.
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)
    lines = []
    for line in text.split("\n"):
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line)
    return "\n".join(lines)


def _paragraphs(help_text: str) -> list[str]:
    """click's help text as paragraphs (click's \\b blocks kept as they are laid out)."""
    text = inspect.cleandoc(help_text or "")
    out = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        if not block.strip():
            continue
        if block.startswith("\b"):
            out.append("\b" + block[1:].lstrip("\n"))
        else:
            out.append(" ".join(block.split()))
    return out


def _body(help_text: str) -> list[str]:
    roff: list[str] = []
    for paragraph in _paragraphs(help_text):
        if paragraph.startswith("\b"):
            roff += [".PP", ".nf", escape(paragraph[1:]), ".fi"]
        else:
            roff += [".PP", escape(paragraph)]
    return roff


def _visible(group: click.Group, ctx: click.Context) -> list[tuple[str, click.Command]]:
    commands = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is not None and not command.hidden:
            commands.append((name, command))
    return commands


def _options(command: click.Command, ctx: click.Context) -> list[str]:
    roff: list[str] = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        roff += [".TP", f"\\fB{escape(names)}\\fR", escape(" ".join(help_text.split()))]
    return roff


def _usage(command: click.Command, ctx: click.Context) -> str:
    pieces = command.collect_usage_pieces(ctx)
    return " ".join(pieces)


def _command_section(path: list[str], command: click.Command, parent: click.Context) -> list[str]:
    ctx = click.Context(command, info_name=path[-1], parent=parent)
    title = " ".join(path)
    roff = [f'.SS "{escape(title)}"', f".B {escape(title)}", escape(_usage(command, ctx))]
    roff += _body(command.help or "")
    options = _options(command, ctx)
    if options:
        roff += [".PP", "Options:", ".RS", *options, ".RE"]
    if isinstance(command, click.Group):
        for name, sub in _visible(command, ctx):
            roff += _command_section([*path, name], sub, ctx)
    return roff


def _header(name: str, version: str, date: str, summary: str) -> list[str]:
    return [
        f'.TH "{name.upper()}" "1" "{date}" "llmgw {version}" "{MANUAL}"',
        ".SH NAME",
        f"{escape(name)} \\- {escape(summary)}",
    ]


def _summary(command: click.Command) -> str:
    text = command.get_short_help_str(limit=200).rstrip(".")
    text = text.removeprefix("llmgw: ")
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def group_page(
    root: click.Group, name: str, command: click.Command, version: str, date: str
) -> str:
    root_ctx = click.Context(root, info_name="llmgw")
    ctx = click.Context(command, info_name=name, parent=root_ctx)
    page = f"llmgw-{name}"
    roff = _header(page, version, date, _summary(command))
    roff += [".SH SYNOPSIS", f".B llmgw {escape(name)}", escape(_usage(command, ctx))]
    roff += [".SH DESCRIPTION", *_body(command.help or "")]
    options = _options(command, ctx)
    if options:
        roff += [".SH OPTIONS", *options]
    if isinstance(command, click.Group):
        subcommands = _visible(command, ctx)
        if subcommands:
            roff.append(".SH COMMANDS")
            for sub_name, sub in subcommands:
                roff += _command_section(["llmgw", name, sub_name], sub, ctx)
    siblings = [n for n, _ in _visible(root, root_ctx) if n != name]
    roff += [".SH SEE ALSO", _see_also(["llmgw"] + [f"llmgw-{n}" for n in siblings])]
    return "\n".join(roff) + "\n"


def _see_also(pages: list[str]) -> str:
    return ",\n".join(f"\\fB{escape(p)}\\fR(1)" for p in pages)


def main_page(root: click.Group, version: str, date: str) -> str:
    ctx = click.Context(root, info_name="llmgw")
    roff = _header("llmgw", version, date, _summary(root))
    roff += [".SH SYNOPSIS", ".B llmgw", escape(_usage(root, ctx))]
    roff += [".SH DESCRIPTION", *_body(root.help or "")]
    roff += [".SH OPTIONS", *_options(root, ctx)]
    roff.append(".SH COMMANDS")
    commands = _visible(root, ctx)
    for name, command in commands:
        roff += [
            ".TP",
            f"\\fBllmgw {escape(name)}\\fR",
            f"{escape(command.get_short_help_str(limit=300))} See \\fBllmgw\\-{escape(name)}\\fR(1).",
        ]
    roff += [".SH SEE ALSO", _see_also([f"llmgw-{n}" for n, _ in commands])]
    return "\n".join(roff) + "\n"


def pages(version: str, date: str) -> dict[str, str]:
    """Every page's file name -> its roff source."""
    from llmgw.cli import main as root

    ctx = click.Context(root, info_name="llmgw")
    out = {"llmgw.1": main_page(root, version, date)}
    for name, command in _visible(root, ctx):
        out[f"llmgw-{name}.1"] = group_page(root, name, command, version, date)
    return out


def write(out: Path, version: str, date: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(pages(version, date).items()):
        raw = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write(text.encode("utf-8"))
        path = out / f"{name}.gz"
        path.write_bytes(raw.getvalue())
        path.chmod(0o644)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="manpages.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True)
    parser.add_argument("--date", required=True, help="YYYY-MM-DD, the pages' date")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.date):
        print(f"error: --date {args.date!r} is not YYYY-MM-DD", file=sys.stderr)
        return 2
    try:
        write(args.out, args.version, args.date)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
