"""``llmgw ctl cert``: create the cluster CA and issue node certificates."""

from __future__ import annotations

from pathlib import Path

import click

from llmgw import netaddr, pki
from llmgw.cli.common import ReportingGroup

_dir_option = click.option(
    "--dir",
    "directory",
    required=True,
    envvar="LLMGW_PKI_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="PKI directory holding ca.crt and ca.key (env: LLMGW_PKI_DIR).",
)


@click.group(cls=ReportingGroup)
def cert() -> None:
    """Create the cluster CA and issue certificates."""


@cert.command("init-ca")
@_dir_option
def init_ca(directory: Path) -> None:
    """Create a new cluster CA in --dir (refuses to overwrite an existing one)."""
    authority = pki.init_ca(directory)
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
    click.echo(f"certificate: {identity.cert}")
    click.echo(f"key:         {identity.key}")
    click.echo(f"ca:          {identity.ca}")
    click.echo(f"fingerprint: {key_fp}")


__all__ = ["cert"]
