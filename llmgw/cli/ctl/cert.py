"""``llmgw ctl cert``: the cluster CA. Through the admin API: show it (``ctl cert``), rotate it
(``rotate-ca``), drop the old one early (``finish-rotation``) and export it, encrypted, for
another control-plane instance (``export-ca``). Offline, on a PKI directory: create a CA
(``init-ca``) and issue a node certificate (``issue-client``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from llmgw import caexport, netaddr, pki
from llmgw.cli.common import Duration, ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, until, wants_json
from llmgw.cli.prompts import read_secret
from llmgw.client import ADMIN_PASSWORD_ENV
from llmgw.errors import ClientError, FileError
from llmgw.fsutil import atomic_write, create_file

_dir_option = click.option(
    "--dir",
    "directory",
    required=True,
    envvar="LLMGW_PKI_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="PKI directory holding ca.crt and ca.key (env: LLMGW_PKI_DIR).",
)


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.pass_context
def cert(ctx: click.Context) -> None:
    """The cluster CA: with no command, show it (and, during a rotation, the old CA, when it
    is dropped and the nodes still on it); rotate it; create a CA and issue certificates."""
    if ctx.invoked_subcommand is None:
        c = ctx.find_object(Ctl)
        if c is None:  # only outside 'llmgw ctl'
            raise click.UsageError("run it as 'llmgw ctl cert'")
        _show(c, c.call("GET", "/api/ca"))


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts)) + f" ({until(ts)})"


def _show(c: Ctl, status: dict[str, Any]) -> None:
    if c.as_json:
        echo_json(status)
        return
    current = status["current"]
    click.echo(f"CA:          {current['ca_hash']}  (valid until {_when(current['not_after'])})")
    previous = status.get("previous")
    if previous is None:
        rotation = status.get("rotation")
        if rotation and rotation.get("dropped"):
            click.echo(
                f"old CA:      {rotation['previous']} dropped "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(rotation['dropped']))}"
            )
        return
    click.echo(
        f"old CA:      {previous['ca_hash']}  (trusted too; dropped {_when(previous['drop_at'])})"
    )
    left = status.get("nodes_on_previous") or []
    if left:
        click.echo(f"still on the old CA: {', '.join(left)} (they renew when they connect)")
    else:
        click.echo(
            "every node holds a certificate of the new CA: 'llmgw ctl cert finish-rotation' "
            "drops the old one now"
        )


@cert.command("rotate-ca")
@click.option(
    "--overlap",
    type=Duration(minimum=60),
    default="7d",
    show_default=True,
    help="How long both CAs are trusted (agents renew under the new one meanwhile); the old "
    "CA is dropped after it.",
)
@pass_ctl
def rotate_ca(c: Ctl, overlap: float) -> None:
    """Create a new cluster CA, cross-signed by the current one so that both are trusted for
    --overlap. The control plane's certificates move to it at once; connected agents get the
    new trust bundle and renew their certificates under it, others when they reconnect."""
    status = c.call("POST", "/api/ca/rotate", {"overlap": overlap})
    if c.as_json:
        echo_json(status)
        return
    new = status["current"]["ca_hash"]
    drop_at = status["previous"]["drop_at"] if status.get("previous") else None
    click.echo(f"rotated: the new CA is {new}")
    if drop_at is not None:
        click.echo(f"the old CA {status['previous']['ca_hash']} is dropped {_when(drop_at)}")
    click.echo(
        "agents renew under the new CA by themselves. Each node's update helper moves to it "
        "with the next signed update within the overlap ('llmgw ctl update'), or run the "
        f"installer on the node: 'install-agent.sh upgrade --ca-hash {new}'. New join "
        "commands carry the new --ca-hash."
    )


@cert.command("finish-rotation")
@click.option(
    "--force",
    is_flag=True,
    help="Drop the old CA even though nodes still hold its certificates: they cannot connect "
    "until rekeyed ('llmgw ctl join-command --rekey NODE').",
)
@pass_ctl
def finish_rotation(c: Ctl, force: bool) -> None:
    """Drop the old CA now instead of at the end of the overlap. Refused while nodes still
    hold certificates it issued, unless --force."""
    status = c.call("POST", "/api/ca/finish", {"force": force})
    if c.as_json:
        echo_json(status)
        return
    click.echo(f"dropped the old CA; only {status['current']['ca_hash']} is trusted now")


@cert.command("export-ca")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The file to write (0600); refused when it exists, unless --force.",
)
@click.option("--force", is_flag=True, help="Replace --out when it exists.")
@pass_ctl
def export_ca(c: Ctl, out: Path, force: bool) -> None:
    """Export the cluster CA (its key, the CA rotation under way, the cluster id and the
    admin token), encrypted with a passphrase, for 'llmgw server --import-ca FILE' on another
    control-plane instance. Asks for the admin password (env: LLMGW_ADMIN_PASSWORD) and a
    passphrase of at least 12 characters, twice (env: LLMGW_CA_PASSPHRASE)."""
    _check_out(out, force)
    password = read_secret(
        ADMIN_PASSWORD_ENV, "admin password (not echoed): ", what="admin password"
    )
    passphrase = caexport.check_passphrase(
        read_secret(
            caexport.CA_PASSPHRASE_ENV,
            "passphrase for the export (not echoed): ",
            what="passphrase",
            again="passphrase again: ",
        )
    )
    answer = c.call(
        "POST", "/api/ca/export", {"password": password, "passphrase": passphrase}, password=True
    )
    data = str(answer.get("file", "")).encode()
    header = caexport.read_header(data, source="the control plane's export")
    if header.ca_hash != answer.get("ca_hash"):
        raise ClientError(
            f"the control plane answered an export of CA {header.ca_hash} for CA "
            f"{answer.get('ca_hash')}; nothing was written. Try again"
        )
    if force:
        atomic_write(out, data, mode=0o600)
    elif not create_file(out, data, mode=0o600):
        raise _exists(out)
    if c.as_json:
        echo_json({k: v for k, v in answer.items() if k != "file"} | {"out": str(out)})
        return
    click.echo(f"exported CA {header.ca_hash} of cluster {header.cluster_id} to {out}")
    rotation = answer.get("rotation")
    if rotation and rotation.get("dropped") is None:
        click.echo(
            f"with the CA rotation under way: the old CA {rotation['previous']} is trusted "
            f"until {_when(rotation['drop_at'])}"
        )
    click.echo(
        "the passphrase alone protects the CA key in it. On the new instance: "
        f"'llmgw server --config /etc/llmgw/server.yaml --import-ca {out.name}', then delete "
        "the file on both machines"
    )


def _exists(out: Path) -> FileError:
    return FileError(
        f"{out} exists; nothing was exported. Choose another --out, or pass --force to replace it",
        path=str(out),
    )


def _check_out(out: Path, force: bool) -> None:
    """Refuse --out before anything is asked or exported (click refuses a directory)."""
    if out.exists() and not force:
        raise _exists(out)
    parent = out.parent
    if not parent.is_dir():
        raise FileError(
            f"{parent} does not exist; nothing was exported. Create it, or give --out a file "
            "in an existing directory",
            path=str(out),
        )


@cert.command("init-ca")
@_dir_option
def init_ca(directory: Path) -> None:
    """Create a new cluster CA in --dir (refuses to overwrite an existing one)."""
    authority = pki.init_ca(directory)
    if wants_json():
        echo_json({"directory": str(authority.directory), "ca_hash": authority.ca_hash()})
        return
    click.echo(f"created CA in {authority.directory}")
    click.echo(f"ca-hash: {authority.ca_hash()}")


@cert.command("issue-client")
@click.argument("node")
@_dir_option
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write node.crt, node.key and ca.crt into (created 0700 if missing).",
)
def issue_client(node: str, directory: Path, out_dir: Path) -> None:
    """Issue the certificate of node NODE (CN and DNS name = NODE) from the CA in --dir."""
    netaddr.validate_node_id(node)
    authority = pki.load_ca(directory)
    server_cert = directory / "server.crt"  # a control plane's own PKI directory
    if server_cert.exists():
        netaddr.check_node_id_free(node, pki.control_plane_names(pki.load_cert(server_cert)))
    identity = pki.issue_node_cert(authority, node, out_dir)
    key_fp = pki.fingerprint(pki.load_cert(identity.cert).public_key())
    if wants_json():
        echo_json(
            {
                "certificate": str(identity.cert),
                "key": str(identity.key),
                "ca": str(identity.ca),
                "fingerprint": key_fp,
            }
        )
        return
    click.echo(f"certificate: {identity.cert}")
    click.echo(f"key:         {identity.key}")
    click.echo(f"ca:          {identity.ca}")
    click.echo(f"fingerprint: {key_fp}")


__all__ = ["cert"]
