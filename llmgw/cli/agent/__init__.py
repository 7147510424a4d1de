"""The ``llmgw agent`` group: everything that runs on a node.

``llmgw agent`` runs the node agent (``--check`` only validates agent.yaml; with ``--print
multinode_ports`` it prints that range alone, for install-agent.sh's firewall); ``join``
enrols the node; ``render-facts`` prints the agent.yaml keys of node facts for the
installer; ``docker-proxy`` is the Docker socket proxy the agent may use instead of
docker.sock; ``update-apply`` and ``update-trust`` are the root update helper's entry points
(systemd and the installer run them as root; the code behind them is the helper's, these
commands only parse options and print verdicts).

The helper's commands run as root, so this module, which they load, imports nothing of the
agent or the control plane: only the helper (``llmgw.updater``), the contracts it checks
against and the foundations (a unit test holds this). The agent is imported when it is run;
``join``, ``render-facts`` and ``docker-proxy`` are modules of their own
(``llmgw.cli.agent.join``, ``llmgw.cli.agent.facts``, ``llmgw.cli.agent.docker_proxy``),
imported when they are named (``NODE_COMMANDS``, a :class:`llmgw.cli.common.LazyGroup`) and
listed by ``--help`` without being imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from llmgw.cli.common import LazyCommand, LazyGroup
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG
from llmgw.contracts.update_order import DEFAULT_SPOOL
from llmgw.updater.apply import DEFAULT_INSTALLED_BINARY, DEFAULT_STATE, apply_request
from llmgw.updater.trust import DEFAULT_TRUST, install_trust

if TYPE_CHECKING:
    from llmgw.agent.config import AgentConfig

__all__ = ["NODE_COMMANDS", "PRINTABLE_KEYS", "agent"]


# Plain import statements, so that PyInstaller finds the modules (see LazyCommand).
def _join() -> object:
    from llmgw.cli.agent.join import join_command

    return join_command


def _render_facts() -> object:
    from llmgw.cli.agent.facts import render_facts

    return render_facts


def _inventory() -> object:
    from llmgw.cli.agent.inventory import inventory

    return inventory


def _docker_proxy() -> object:
    from llmgw.cli.agent.docker_proxy import docker_proxy

    return docker_proxy


# What `llmgw agent --check --print KEY` may print (agent.yaml keys a script needs).
PRINTABLE_KEYS = ("multinode_ports",)

# The node commands, which load the agent: imported when they are named, not to list them.
NODE_COMMANDS: dict[str, LazyCommand] = {
    "join": LazyCommand(
        _join,
        "Enrol this node with the control plane; the join token comes from "
        "LLMGW_JOIN_TOKEN or a prompt, never from an argument.",
    ),
    "render-facts": LazyCommand(
        _render_facts,
        "Print the agent.yaml keys (fabrics, discovery, engines) of these node facts, as "
        "install-agent.sh writes them; 'none' alone clears fabrics or engine programs "
        "(nothing is printed for them); a bare fabric name takes this node's active "
        "InfiniBand adapters. Exit 2 when a fact is not valid, saying which and why.",
    ),
    "inventory": LazyCommand(
        _inventory,
        "Print what this node's agent would report (GPUs, driver, engines, fabrics), looked "
        "up now; with --sources, NVML's and nvidia-smi's views side by side.",
    ),
    "docker-proxy": LazyCommand(
        _docker_proxy,
        "Serve a Docker socket that allows only what llmgw's docker runtime does (as root "
        "or a member of the docker group, from llmgw-docker-proxy.service): llmgw's "
        "labelled containers, not privileged, no host namespaces, devices or mounts, ports "
        "on 127.0.0.1. Everything else is answered 403 with the reason.",
    ),
}


@click.group(cls=LazyGroup, lazy=NODE_COMMANDS, invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_AGENT_CONFIG,
    show_default=True,
    envvar="LLMGW_AGENT_CONFIG",
    help="agent.yaml (env: LLMGW_AGENT_CONFIG).",
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
@click.option("--check", is_flag=True, help="Validate the configuration and exit.")
@click.option(
    "--print",
    "print_key",
    type=click.Choice(PRINTABLE_KEYS),
    default=None,
    help="With --check: print only this key's value, as the agent reads it (default "
    "included), once the configuration is valid; for scripts (install-agent.sh opens the "
    "multinode_ports range in the firewall).",
)
@click.pass_context
def agent(
    ctx: click.Context, config_path: Path, log_level: str, check: bool, print_key: str | None
) -> None:
    """Run the node agent (systemd Type=notify)."""
    if ctx.invoked_subcommand is not None:
        return
    if print_key is not None and not check:
        raise click.UsageError("--print goes with --check: llmgw agent --check --print KEY")
    from llmgw.agent.config import load_agent_config
    from llmgw.agent.service import run_agent
    from llmgw.log import setup_logging

    cfg = load_agent_config(config_path)
    if check:
        if print_key == "multinode_ports":
            click.echo(str(cfg.multinode_ports))
        else:
            click.echo(
                f"{config_path}: ok (node {cfg.node_id}, servers {', '.join(cfg.servers)}"
                f"{_reported_address(cfg)})"
            )
        return
    setup_logging(log_level)
    run_agent(cfg)


def _reported_address(cfg: AgentConfig) -> str:
    """What ``--check`` says of the data-plane address agent.yaml chooses (nothing when it
    leaves it to the route); ConfigError (the check fails) when mgmt_interface is missing
    here or has no address."""
    from llmgw.agent.address import configured_host

    host = configured_host(cfg)
    if host is None:
        return ""
    if cfg.mgmt_interface is not None:
        return f", data plane address {host} from {cfg.mgmt_interface}"
    return f", data plane address {host}"


@agent.command("update-apply")
@click.option(
    "--spool",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_SPOOL,
    show_default=True,
    help="The agent's update spool, where it renames a finished download to 'request'.",
)
@click.option(
    "--trust",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_TRUST,
    show_default=True,
    help="ca.pem and node-id, written by the installer; only root may write there.",
)
@click.option(
    "--state",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE,
    show_default=True,
    help="The helper's own state (0700, root): the last accepted counter, work directories.",
)
@click.option(
    "--installed-binary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_INSTALLED_BINARY,
    show_default=True,
    help="The installed agent program, asked for its --version (a downgrade is refused).",
)
def update_apply(spool: Path, trust: Path, state: Path, installed_binary: Path) -> None:
    """Check and apply the signed update the agent spooled (as root, from
    llmgw-agent-update.service). The request is moved out of the agent's reach first; the
    verdict goes to SPOOL/status.json. Exit 0: applied, or nothing to do."""
    result = apply_request(spool=spool, trust=trust, state=state, installed_binary=installed_binary)
    if result.exit_code:
        click.echo(f"error: update {result.state}: {result.message}", err=True)
    raise click.exceptions.Exit(result.exit_code)


@agent.command("update-trust")
@click.option(
    "--ca",
    "ca_file",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The cluster CA to trust (a copy of root's; never read through a symlink).",
)
@click.option(
    "--ca-hash",
    default=None,
    help="sha256:<hex> the CA's public key must hash to (from 'llmgw ctl join-command'); "
    "without it, the pin recorded at the first install.",
)
@click.option(
    "--trust",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_TRUST,
    show_default=True,
    help="Where the update helper's trust lives (root's).",
)
def update_trust(ca_file: Path, ca_hash: str | None, trust: Path) -> None:
    """Make the update helper trust the CA in --ca, once it matches the pin (as root, from
    install-agent.sh). Prints 'trust: written' or 'trust: unchanged'; exits 1, the trust
    kept as it was, when the CA does not match."""
    changed = install_trust(ca_file, trust, ca_hash)
    click.echo("trust: written" if changed else "trust: unchanged")
