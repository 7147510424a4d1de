"""``llmgw server``: the control plane.

``llmgw server [--config FILE]`` runs it (what the systemd unit runs); ``--import-ca FILE``
installs the cluster CA exported from another instance (``llmgw ctl cert export-ca``) into
this instance's state directory instead, and exits; the group's verbs act on a control
plane's state without running it (``migrate``: SQLite to PostgreSQL).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import click

from llmgw import caexport, caimport
from llmgw.cli.common import ReportingGroup
from llmgw.cli.prompts import read_secret
from llmgw.contracts.paths import DEFAULT_SERVER_CONFIG
from llmgw.log import setup_logging
from llmgw.loop import run as run_loop
from llmgw.server.app import ControlPlane
from llmgw.server.common.config import ServerConfig, load_server_config
from llmgw.server.store.location import parse_location
from llmgw.server.store.transfer import migrate_to_postgresql

__all__ = ["server"]


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_SERVER_CONFIG",
    help=f"server.yaml (env: LLMGW_SERVER_CONFIG; default {DEFAULT_SERVER_CONFIG} when it exists).",
)
@click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), help="Override state_dir."
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
@click.option(
    "--import-ca",
    "import_ca",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Install the cluster CA and admin token that 'llmgw ctl cert export-ca' exported on "
    "another instance into this one's state directory, then exit (the passphrase: env "
    f"{caexport.CA_PASSPHRASE_ENV}, else a prompt).",
)
@click.pass_context
def server(
    ctx: click.Context,
    config_path: Path | None,
    state_dir: Path | None,
    log_level: str,
    import_ca: Path | None,
) -> None:
    """Run the control plane: gateway :8080, enrolment, agent stream :7443.

    With a command, act on a control plane's state instead of running it."""
    setup_logging(log_level)
    if import_ca is not None and ctx.invoked_subcommand is not None:
        raise click.UsageError(f"--import-ca runs alone, not with '{ctx.invoked_subcommand}'")
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None and DEFAULT_SERVER_CONFIG.exists():
        config_path = DEFAULT_SERVER_CONFIG
    overrides = {"state_dir": str(state_dir)} if state_dir else None
    cfg = load_server_config(config_path, overrides=overrides)
    if import_ca is not None:
        _import_ca(cfg, import_ca)
        return

    async def main() -> None:
        cp = ControlPlane(cfg)
        stop = asyncio.Event()

        def signalled() -> None:
            # The first signal drains (llmgw.server.ha.drain); a second stops at once.
            if stop.is_set():
                cp.drain.hurry()
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled)
        await cp.start()
        try:
            await stop.wait()
        except BaseException:
            await cp.stop()
            raise
        await cp.drain_then_stop()

    run_loop(main(), process="server")


def _import_ca(cfg: ServerConfig, path: Path) -> None:
    """``--import-ca``: the file read and its header checked before the passphrase is asked
    for, opened, installed (nothing written on any refusal), and what was done said."""
    data = caexport.read_export(path)
    caexport.read_header(data, source=str(path))
    passphrase = read_secret(
        caexport.CA_PASSPHRASE_ENV,
        f"passphrase of {path} (not echoed): ",
        what="passphrase of the CA export",
    )
    export = caexport.unseal(data, passphrase, source=str(path))
    done = caimport.install(export, pki_dir=cfg.pki_dir, token_file=cfg.admin_token_file)
    if done.ca:
        click.echo(
            f"imported CA {export.ca_hash} of cluster {export.cluster_id} into {cfg.pki_dir}"
        )
    else:
        click.echo(f"this instance already has CA {export.ca_hash} (in {cfg.pki_dir}); unchanged")
    rotation = export.rotation
    if done.ca and rotation is not None and rotation.active:
        drop = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(rotation.drop_at))
        click.echo(
            f"with the CA rotation under way: the old CA {rotation.previous} is trusted until "
            f"{drop}"
        )
    if done.token:
        click.echo(f"admin token: written to {cfg.admin_token_file}")
    else:
        click.echo(f"admin token: {cfg.admin_token_file} holds it already; unchanged")
    click.echo(
        f"delete {path} now (and the copy on the instance it came from): its passphrase alone "
        "protects the CA key"
    )
    click.echo(
        "this instance makes its own server and client certificates at its first start; "
        "start the control plane: systemctl start llmgw-server"
    )


@server.command("migrate")
@click.option(
    "--from",
    "source",
    required=True,
    metavar="sqlite:///PATH",
    help="The control plane's SQLite file (a plain path too).",
)
@click.option(
    "--to",
    "target",
    required=True,
    metavar="postgresql://USER@HOST[:PORT]/DBNAME",
    help="The empty PostgreSQL database, as server.yaml's database: will name it; no password.",
)
@click.option(
    "--password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file holding the role's password (mode 0600); without it libpq reads PGPASSFILE "
    "(env) or ~/.pgpass.",
)
@click.option(
    "--state-dir",
    "lock_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The control plane's state directory, whose leader.lock says whether it runs "
    "(default: the SQLite file's directory).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def migrate(
    source: str, target: str, password_file: Path | None, lock_dir: Path | None, as_json: bool
) -> None:
    """Move a stopped control plane's state from its SQLite file into an empty PostgreSQL
    database.

    Every table is copied in one transaction and the rows counted on both sides before it
    commits; nothing is written when a check fails. A file of an older schema is migrated in
    place first, as the control plane would on its next start. The SQLite file is left as it
    was: keep it as the backup."""
    src = parse_location(source, key="--from")
    dst = parse_location(target, password_file=password_file, key="--to")
    done = migrate_to_postgresql(src, dst, state_dir=lock_dir)
    step = _next_step(target, password_file, Path(src.path))
    if as_json:
        data = {
            "source": done.source,
            "target": done.target,
            "schema_version": done.schema_version,
            "upgraded_from": done.upgraded_from,
            "tables": done.rows,
            "next": step,
        }
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    upgraded = (
        f", its schema first upgraded from {done.upgraded_from}"
        if done.upgraded_from != done.schema_version
        else ""
    )
    click.echo(
        f"copied {done.source} into {done.target} (schema version {done.schema_version}"
        f"{upgraded}); rows by table:"
    )
    width = max(len(name) for name in [*done.rows, "TABLE"])
    click.echo(f"  {'TABLE'.ljust(width)}  ROWS")
    for name, rows in done.rows.items():
        click.echo(f"  {name.ljust(width)}  {rows}")
    click.echo(f"next: {step}")


def _next_step(url: str, password_file: Path | None, sqlite: Path) -> str:
    """What the operator does next: server.yaml's database (the URL quoted: a flow mapping
    would split it at a comma between hosts)."""
    if password_file is not None:
        setting = f"{{url: {json.dumps(url)}, password_file: {password_file.absolute()}}}"
        note = ""
    else:
        setting, note = json.dumps(url), " (the password in the llmgw user's ~/.pgpass)"
    return (
        f"set database: {setting} in server.yaml{note}, start the control plane "
        f"(systemctl start llmgw-server); keep {sqlite.absolute()} as the backup"
    )
