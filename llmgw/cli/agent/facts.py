"""``llmgw agent render-facts``: the node facts given to ``install-agent.sh`` as the agent.yaml
keys they set, printed for the installer's managed block.

The installer is a shell script: it neither parses ``--fabric NAME:HCA,...`` nor knows which
setting names an engine's program (``bin``, or SGLang's ``python``). It hands the options it
was given to this command, which parses them with the one parser of node facts
(:mod:`llmgw.contracts.nodefacts`, the one ``llmgw ctl join-command`` and ``llmgw agent
join`` use) and prints YAML, or exits 2 with what is wrong; nothing is written anywhere.

A bare fabric name (``--fabric ib-b``) takes this node's active InfiniBand adapters, found
here in sysfs (``--ib-root``); ``--resolved-fabrics`` prints the fabrics as found, one
``NAME:HCA,HCA`` a line, for the installer to record and show.
"""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from llmgw.agent.config import DEFAULT_IB_ROOT
from llmgw.agent.discovery.fabrics import active_ib_adapters
from llmgw.contracts.nodefacts import NodeFacts
from llmgw.errors import ConfigError

__all__ = ["node_facts", "render_facts"]


def node_facts(
    *,
    fabrics: tuple[str, ...],
    nvidia_smi: str | None,
    ib_root: str | None,
    engines: tuple[str, ...],
    node_address: str | None = None,
    mgmt_interface: str | None = None,
) -> NodeFacts:
    """The facts of these option values, a bare fabric name filled with the active
    InfiniBand adapters of this node; a usage error names the option and the fix."""
    try:
        facts = NodeFacts.parse(
            fabrics=fabrics,
            nvidia_smi=nvidia_smi,
            ib_root=ib_root,
            engines=engines,
            node_address=node_address,
            mgmt_interface=mgmt_interface,
        )
        sysfs = Path(facts.ib_root) if facts.ib_root else DEFAULT_IB_ROOT
        return facts.with_active_adapters(active_ib_adapters(sysfs), str(sysfs))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@click.command("render-facts")
@click.option("--fabric", "fabrics", multiple=True, metavar="NAME[:HCA,...]")
@click.option("--nvidia-smi", metavar="PATH")
@click.option("--ib-root", metavar="DIR")
@click.option("--engine", "engines", multiple=True, metavar="NAME=PATH")
@click.option(
    "--resolved-fabrics",
    is_flag=True,
    help="Print only the fabrics, one NAME:HCA,HCA a line, a bare name's adapters found here.",
)
def render_facts(
    fabrics: tuple[str, ...],
    nvidia_smi: str | None,
    ib_root: str | None,
    engines: tuple[str, ...],
    resolved_fabrics: bool,
) -> None:
    """Print the agent.yaml keys (fabrics, discovery, engines) of these node facts, as
    install-agent.sh writes them; 'none' alone clears fabrics or engine programs (nothing is
    printed for them); a bare fabric name takes this node's active InfiniBand adapters. Exit
    2 when a fact is not valid, saying which and why."""
    facts = node_facts(fabrics=fabrics, nvidia_smi=nvidia_smi, ib_root=ib_root, engines=engines)
    if resolved_fabrics:
        for fabric in facts.fabrics:
            click.echo(str(fabric))
        return
    data = facts.agent_config()
    if data:
        click.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), nl=False)
