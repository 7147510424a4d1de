"""``llmgw ctl engines``: install an engine build on the nodes."""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.cli.common import Duration, ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, table
from llmgw.engines.registry import installable_engines

__all__ = ["engines"]


@click.group(cls=ReportingGroup)
def engines() -> None:
    """Engines on the nodes: install a build on one node or all of them."""


@engines.command("install")
@click.argument("target", metavar="NODE|--all", required=False)
@click.argument("engine", type=click.Choice(installable_engines()))
@click.argument("version")
@click.option("--all", "all_nodes", is_flag=True, help="Every approved node.")
@click.option(
    "--url",
    required=True,
    help="Where the nodes download the build (a .tar.gz/.tar.xz/.zip): https://, or http:// "
    "and file:// from places the nodes list in install_sources in agent.yaml.",
)
@click.option("--sha256", "sha", required=True, help="The publisher's SHA-256 of that file.")
@click.option("--arch", default="", help="Only for this architecture (x86_64, aarch64).")
@click.option(
    "--wait/--no-wait", default=True, show_default=True, help="Wait for every node's result."
)
@click.option(
    "--timeout",
    type=Duration(),
    default="1h",
    show_default=True,
    help="How long to wait with --wait.",
)
@pass_ctl
def engines_install(
    c: Ctl,
    target: str | None,
    engine: str,
    version: str,
    all_nodes: bool,
    url: str,
    sha: str,
    arch: str,
    wait: bool,
    timeout: float,
) -> None:
    """Install ENGINE VERSION on NODE (or --all): download, check the SHA-256, unpack, run it."""
    if bool(target) == all_nodes:
        raise click.UsageError("name one NODE or pass --all")
    body: dict[str, Any] = {
        "engine": engine,
        "version": version,
        "url": url,
        "sha256": sha,
        "arch": arch,
    }
    if all_nodes:
        body["all"] = True
    else:
        body["nodes"] = [target]
    sent = c.call("POST", "/api/engines/install", body)
    ops = [r["op_id"] for r in sent if r["op_id"]]
    deadline = time.monotonic() + timeout
    rows = sent
    while wait and ops and time.monotonic() < deadline:
        rows = c.call("GET", "/api/engines/installs?" + "&".join(f"op={op}" for op in ops))
        if all(r["state"] != "installing" for r in rows):
            break
        time.sleep(1.0)
    rows = rows + [r for r in sent if not r["op_id"]]
    if c.as_json:
        echo_json(rows)
    else:
        click.echo(
            table(
                ["NODE", "ENGINE", "VERSION", "STATE", "ERROR"],
                [[r["node"], engine, version, r["state"], r.get("error") or ""] for r in rows],
            )
        )
    if any(r["state"] in ("failed", "skipped") for r in rows):
        raise click.exceptions.Exit(1)
