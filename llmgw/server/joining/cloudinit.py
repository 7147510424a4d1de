"""cloud-init user-data that joins a machine on its first boot (issue 18): the join token in
a root-only file, the bundle fetched and checked by SHA-256 as the one-liner does, the
installer run with the token read from that file, and the file removed whatever happens.

The token goes to ``/run/llmgw-join-token``: ``write_files`` runs in cloud-init's first stage
and ``runcmd`` in its last, on the same boot, and ``/run`` is a tmpfs, so the file reaches
runcmd but never the disk, and a reboot before runcmd loses it (the token expires unspent).
cloud-init itself keeps the user-data, token included, under ``/var/lib/cloud/`` (root
only): the protection there is that the token is single-use and short-lived. The token is
never on a command line: the script names only the file.

One name for a node: with ``set_hostname`` the machine's host name becomes the node id
(cloud-init's ``hostname``, and ``/etc/hosts``' 127.0.1.1 line, before runcmd); the script
warns, in cloud-init's output log, when they differ.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from typing import Any

import yaml

from llmgw.server.joining.bundles import Bundle, fetch_steps, installer_step

__all__ = ["TOKEN_FILE", "user_data"]

TOKEN_FILE = "/run/llmgw-join-token"


class _Dumper(yaml.SafeDumper):
    """YAML with multi-line strings as literal blocks: the script stays readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def join_script(
    base_url: str,
    bundles: Sequence[Bundle],
    *,
    node_id: str,
    enroll_url: str,
    ca_hash: str,
    verify_tls: bool,
    extra_args: Sequence[str] = (),
    set_hostname: bool = False,
) -> str:
    """runcmd's script: the token read from :data:`TOKEN_FILE` into the environment (a
    builtin, no process), the file removed at once (and by a trap if the read fails), then
    the one-liner's own download, check and install. NotFound when there is no bundle."""
    retry = f"llmgw ctl join-command --node {node_id} --cloud-init"
    lines = [
        "set -eu",
        f"t={TOKEN_FILE}",
        "trap 'rm -f \"$t\"' EXIT",
        'LLMGW_JOIN_TOKEN=""',
        'IFS= read -r LLMGW_JOIN_TOKEN <"$t" || true',
        'rm -f "$t"',
        '[ -n "$LLMGW_JOIN_TOKEN" ] || { echo "llmgw: no join token in $t (write_files did not '
        f'write it); boot the machine with new user-data: {retry}" >&2; exit 1; }}',
        "export LLMGW_JOIN_TOKEN",
        _hostname_warning(node_id, set_hostname),
        *fetch_steps(base_url, bundles, verify_tls=verify_tls),
        installer_step("install", node_id, enroll_url, ca_hash, extra_args),
    ]
    return "\n".join(lines) + "\n"


def _hostname_warning(node_id: str, set_hostname: bool) -> str:
    """A line of the script that warns (in cloud-init's log) when the machine's host name is
    not the node id: one name for host, node and certificate is what the guides use."""
    fix = (
        "cloud-init did not set it (preserve_hostname: true in /etc/cloud/cloud.cfg?); set it "
        f"with hostnamectl set-hostname {node_id}"
        if set_hostname
        else f"set it (hostnamectl set-hostname {node_id}), or mint the user-data with "
        "--set-hostname"
    )
    return (
        f'h=$(uname -n); [ "$h" = {shlex.quote(node_id)} ] || echo "llmgw: warning: this '
        f"machine is called $h but joins as node {node_id}; one name for host, node and "
        f'certificate keeps logs, alerts and the console in step: {fix}" >&2'
    )


def user_data(
    base_url: str,
    bundles: Sequence[Bundle],
    *,
    node_id: str,
    enroll_url: str,
    ca_hash: str,
    token: str,
    token_id: str,
    expires_at: float,
    auto_approve: bool,
    verify_tls: bool = True,
    extra_args: Sequence[str] = (),
    set_hostname: bool = False,
) -> str:
    """``#cloud-config`` user-data that installs the agent on first boot and joins it as
    ``node_id`` with ``token`` (see the module's docstring for where the token lives);
    ``set_hostname``: the machine is named ``node_id`` too."""
    script = join_script(
        base_url,
        bundles,
        node_id=node_id,
        enroll_url=enroll_url,
        ca_hash=ca_hash,
        verify_tls=verify_tls,
        extra_args=extra_args,
        set_hostname=set_hostname,
    )
    expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires_at))
    approval = (
        "approved on first use (auto-approve token: trust on first use)"
        if auto_approve
        else f"then waits for approval: llmgw ctl approve {node_id} --fingerprint ..."
    )
    config: dict[str, Any] = {}
    if set_hostname:
        config.update(hostname=node_id, preserve_hostname=False, manage_etc_hosts="localhost")
    config |= {
        "write_files": [
            {
                "path": TOKEN_FILE,
                "owner": "root:root",
                "permissions": "0600",
                "content": token + "\n",
            }
        ],
        "runcmd": [["sh", "-c", script]],
    }
    header = [
        "#cloud-config",
        f"# llmgw: on first boot this machine installs the agent and joins as {node_id}"
        + (f" (its host name set to {node_id})" if set_hostname else "")
        + ";",
        f"# {approval}.",
        f"# Join token {token_id}: one use, valid until {expires}. cloud-init keeps this",
        "# user-data under /var/lib/cloud (root only); the token file is removed after use.",
    ]
    body = yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=10_000)
    return "\n".join(header) + "\n" + body
