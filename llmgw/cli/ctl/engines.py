"""``llmgw ctl engines``: the engines desired on the nodes (recorded by the control plane,
installed on every node that connects, for its architecture), and desired vs installed per
node."""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.cli.common import Duration, ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, table
from llmgw.engines.registry import installable_engines

__all__ = ["engines"]

# What ends the wait of 'engines install --wait' for one node.
_FINAL = ("installed", "failed")
# Rows of 'engines install' that make it exit 1: nothing will install there as it stands.
_REFUSED = ("failed", "no-build", "not-offered", "other-build")


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.pass_context
def engines(ctx: click.Context) -> None:
    """Engines on the nodes: what is desired (every node, or one) and, per node, what is
    installed; install a build with 'engines install', stop wanting it with 'engines forget'."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx.find_object(Ctl)
    assert c is not None
    data = c.call("GET", "/api/engines")
    if c.as_json:
        echo_json(data)
        return
    desired = [
        [
            d["node"] or "(all)",
            d["engine"],
            d["version"],
            b["arch"] or "any",
            b["sha256"][:12],
            b["url"],
        ]
        for d in data["desired"]
        for b in d["builds"]
    ]
    if desired:
        click.echo(table(["DESIRED ON", "ENGINE", "VERSION", "ARCH", "SHA256", "URL"], desired))
    else:
        click.echo("no engine is desired; 'llmgw ctl engines install --all ENGINE VERSION ...'")
    click.echo()
    rows = [
        [
            r["node"],
            r["arch"] or "?",
            r["engine"],
            r["desired"] or "-",
            r["installed"] or "-",
            r["state"] or "-",
            r["reason"],
        ]
        for r in data["nodes"]
    ]
    click.echo(table(["NODE", "ARCH", "ENGINE", "DESIRED", "INSTALLED", "STATE", "REASON"], rows))


def _split(args: tuple[str, ...], all_nodes: bool, names: str) -> tuple[str | None, list[str]]:
    """``[NODE] ENGINE ...``: the node (None with --all) and the rest, the engine checked.

    (Click cannot give an optional argument before required ones, hence by hand.)"""
    count = len(names.split())
    if len(args) != count + (0 if all_nodes else 1):
        raise click.UsageError(f"give NODE {names}, or --all {names}")
    node, rest = (None, list(args)) if all_nodes else (args[0], list(args[1:]))
    if rest[0] not in installable_engines():
        raise click.UsageError(
            f"engine {rest[0]!r} cannot be installed: use one of {', '.join(installable_engines())}"
        )
    return node, rest


def _target(node: str | None) -> dict[str, Any]:
    return {"all": True} if node is None else {"node": node}


@engines.command("install")
@click.argument("args", nargs=-1, metavar="NODE|--all ENGINE VERSION")
@click.option(
    "--all", "all_nodes", is_flag=True, help="Every node: those connected now and any later."
)
@click.option(
    "--url",
    help="Where the nodes download the build (a .tar.gz/.tar.xz/.zip): https://, or http:// "
    "and file:// from places the nodes list in install_sources in agent.yaml.",
)
@click.option("--sha256", "sha", help="The publisher's SHA-256 of that file.")
@click.option(
    "--arch",
    default="",
    help="The architecture the --url build is for (x86_64, aarch64); none: any.",
)
@click.option(
    "--build",
    "builds",
    nargs=3,
    multiple=True,
    metavar="ARCH URL SHA256",
    help="One architecture's build (repeatable), instead of --arch/--url/--sha256.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait for the result on the nodes connected now.",
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
    args: tuple[str, ...],
    all_nodes: bool,
    url: str | None,
    sha: str | None,
    arch: str,
    builds: tuple[tuple[str, str, str], ...],
    wait: bool,
    timeout: float,
) -> None:
    """Desire ENGINE VERSION on NODE (or --all, now and on nodes that join later): each node
    downloads the build for its architecture, checks the SHA-256, unpacks and runs it; no
    replica of ENGINE is placed on a node before that."""
    node, (engine, version) = _split(args, all_nodes, "ENGINE VERSION")
    body: dict[str, Any] = {"engine": engine, "version": version, **_target(node)}
    if builds:
        if url or sha or arch:
            raise click.UsageError("give --build ARCH URL SHA256, or --url/--sha256/--arch")
        body["builds"] = [{"arch": a, "url": u, "sha256": s} for a, u, s in builds]
    elif url and sha:
        body["builds"] = [{"arch": arch, "url": url, "sha256": sha}]
    else:
        raise click.UsageError("give --url and --sha256 (with --arch), or --build ARCH URL SHA256")
    sent = c.call("POST", "/api/engines/install", body)
    rows: list[dict[str, Any]] = sent["nodes"]
    ops = [r["op_id"] for r in rows if r["state"] == "installing" and r["op_id"]]
    deadline = time.monotonic() + timeout
    results: dict[str, dict[str, Any]] = {}
    while wait and ops and time.monotonic() < deadline:
        found = c.call("GET", "/api/engines/installs?" + "&".join(f"op={op}" for op in ops))
        results = {r["op_id"]: r for r in found}
        if all(results.get(op, {}).get("state") in _FINAL for op in ops):
            break
        time.sleep(1.0)
    for row in rows:
        done = results.get(row["op_id"] or "")
        if done is not None and done["state"] in _FINAL:
            row["state"] = "ready" if done["state"] == "installed" else "failed"
            row["reason"] = done["error"]
    if c.as_json:
        echo_json(sent)
    else:
        if sent["replaced"]:
            click.echo(f"{engine} {version} replaces the version desired before")
        click.echo(
            table(
                ["NODE", "ARCH", "ENGINE", "VERSION", "STATE", "REASON"],
                [
                    [r["node"], r["arch"] or "?", engine, version, r["state"], r["reason"]]
                    for r in rows
                ],
            )
        )
    if any(r["state"] in _REFUSED for r in rows):
        raise click.exceptions.Exit(1)


@engines.command("forget")
@click.argument("args", nargs=-1, metavar="NODE|--all ENGINE")
@click.option("--all", "all_nodes", is_flag=True, help="What is desired on every node.")
@click.option("--arch", help="Only this architecture's build ('any' for the one that runs on any).")
@pass_ctl
def engines_forget(c: Ctl, args: tuple[str, ...], all_nodes: bool, arch: str | None) -> None:
    """No longer desire ENGINE on NODE (or on every node, --all): placement stops waiting for
    it; what is installed on the nodes stays."""
    node, (engine,) = _split(args, all_nodes, "ENGINE")
    body: dict[str, Any] = {"engine": engine, **_target(node)}
    if arch:
        body["arch"] = arch
    out = c.call("POST", "/api/engines/forget", body)
    if c.as_json:
        echo_json(out)
        return
    where = "every node" if node is None else node
    click.echo(f"{engine} is no longer desired on {where} ({out['removed']} build(s) removed)")
