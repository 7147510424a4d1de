"""``llmgw ctl``: operator commands against a control plane's admin API.

This module builds the ``ctl`` group (its options make the ``Ctl`` object each command
receives, see ``context``); each command group lives in a module of its own: ``nodes`` (list,
approve, reject, revoke, drain, uncordon), ``gpus`` (list, cordon, uncordon), ``models`` (models, models show, deploy, undeploy, replicas),
``keys`` (with their policies), ``usage`` (the keys' usage), ``join`` (join-command, tokens), ``onboard`` (over ssh, one host or a file of them),
``events``, ``engines``, ``updates`` (update, admin password), ``cert``, ``instances`` (the
control-plane instances on PostgreSQL, retire), ``users`` (operator accounts), ``login``
(login, logout, whoami: ctl acting as an account) and ``engine_check``. A new command goes in the module of its group, or
a new module added below.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click

from llmgw.cli.common import ReportingGroup
from llmgw.cli.ctl.cert import cert
from llmgw.cli.ctl.context import Ctl
from llmgw.cli.ctl.engine_check import engine_check
from llmgw.cli.ctl.engines import engines
from llmgw.cli.ctl.events import events
from llmgw.cli.ctl.gpus import gpus
from llmgw.cli.ctl.instances import instances
from llmgw.cli.ctl.join import join_command, tokens
from llmgw.cli.ctl.keys import keys
from llmgw.cli.ctl.login import login, logout, whoami
from llmgw.cli.ctl.models import deploy, models, replicas, undeploy
from llmgw.cli.ctl.nodes import approve, drain, nodes, reject, revoke, uncordon
from llmgw.cli.ctl.onboard import onboard
from llmgw.cli.ctl.updates import admin, update
from llmgw.cli.ctl.usage import usage
from llmgw.cli.ctl.users import users
from llmgw.client import Transport

__all__ = ["ctl"]


@click.group(cls=ReportingGroup)
@click.option(
    "--server",
    envvar="LLMGW_SERVER",
    help="Control plane URL, e.g. https://cp:8080 (env: LLMGW_SERVER).",
)
@click.option("--token", envvar="LLMGW_TOKEN", help="Admin token (env: LLMGW_TOKEN).")
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_CTL_CONFIG",
    help="ctl.yaml with server, token/token_file and ca (env: LLMGW_CTL_CONFIG; default ~/.config/llmgw/ctl.yaml, then the one 'llmgw up' writes).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="LLMGW_STATE_DIR",
    help="Use the ctl.yaml that 'llmgw up --state-dir DIR' (or 'llmgw server') wrote into DIR (env: LLMGW_STATE_DIR, as for 'llmgw up').",
)
@click.option(
    "--ca",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_CA",
    help="CA certificate (PEM) that verifies an https control plane, e.g. its STATE/pki/ca.crt with tls: cluster (env: LLMGW_CA; default: the ctl.yaml's ca, else the system trust store).",
)
@click.option(
    "--insecure-http",
    is_flag=True,
    envvar="LLMGW_INSECURE_HTTP",
    help="Send the admin token and password over plain http:// to a host that is not loopback (env: LLMGW_INSECURE_HTTP=1). Anyone on the path can read them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of tables.")
@click.pass_context
def ctl(
    ctx: click.Context,
    server: str | None,
    token: str | None,
    config: Path | None,
    state_dir: Path | None,
    ca: Path | None,
    insecure_http: bool,
    as_json: bool,
) -> None:
    """Operate a cluster: nodes, models, replicas, API keys, certificates."""
    # A transport handed in as the invocation's object (the tests' in-process admin API).
    transport = ctx.find_object(Transport)
    ctx.obj = Ctl(
        server=server,
        token=token,
        config=config,
        as_json=as_json,
        state_dir=state_dir.expanduser().absolute() if state_dir else None,
        ca=ca,
        insecure_http=insecure_http,
        transport=transport,
    )


for _command in (
    nodes,
    models,
    deploy,
    undeploy,
    replicas,
    keys,
    usage,
    events,
    join_command,
    onboard,
    tokens,
    approve,
    reject,
    revoke,
    engines,
    drain,
    uncordon,
    gpus,
    update,
    admin,
    cert,
    instances,
    users,
    login,
    logout,
    whoami,
    engine_check,
):
    ctl.add_command(_command)


def _json_after(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    c = ctx.find_object(Ctl)
    if value and c is not None:
        c.as_json = True


def _every_command(group: click.Group) -> Iterator[click.Command]:
    for command in group.commands.values():
        yield command
        if isinstance(command, click.Group):
            yield from _every_command(command)


# Users put --json where they put every other option, after the subcommand: each command takes
# it there too ('ctl nodes --json' as 'ctl --json nodes'), unless it has a --json of its own.
for _command in _every_command(ctl):
    if not any("--json" in p.opts for p in _command.params):
        _command.params.append(
            click.Option(
                ["--json"],
                is_flag=True,
                expose_value=False,
                callback=_json_after,
                help="Print JSON for scripts instead of text (as 'llmgw ctl --json').",
            )
        )
