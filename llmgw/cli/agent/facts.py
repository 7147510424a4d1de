"""``llmgw agent render-facts``: the node facts given to ``install-agent.sh`` as the agent.yaml
keys they set, printed for the installer's managed block.

The installer is a shell script: it neither parses ``--fabric NAME:HCA,...`` nor knows which
setting names an engine's program (``bin``, or SGLang's ``python``). It hands the options it
was given to this command, which parses them with the one parser of node facts
(:mod:`llmgw.contracts.nodefacts`, the one ``llmgw ctl join-command`` and ``llmgw agent
join`` use) and prints YAML, or exits 2 with what is wrong; nothing is written anywhere.
"""

from __future__ import annotations

import click
import yaml

from llmgw.contracts.nodefacts import NodeFacts
from llmgw.errors import ConfigError

__all__ = ["render_facts"]


@click.command("render-facts")
@click.option("--fabric", "fabrics", multiple=True, metavar="NAME:HCA[,HCA...]")
@click.option("--nvidia-smi", metavar="PATH")
@click.option("--ib-root", metavar="DIR")
@click.option("--engine", "engines", multiple=True, metavar="NAME=PATH")
def render_facts(
    fabrics: tuple[str, ...],
    nvidia_smi: str | None,
    ib_root: str | None,
    engines: tuple[str, ...],
) -> None:
    """Print the agent.yaml keys (fabrics, discovery, engines) of these node facts, as
    install-agent.sh writes them; 'none' alone clears fabrics or engine programs (nothing is
    printed for them). Exit 2 when a fact is not valid, saying which and why."""
    try:
        facts = NodeFacts.parse(
            fabrics=fabrics, nvidia_smi=nvidia_smi, ib_root=ib_root, engines=engines
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    data = facts.agent_config()
    if data:
        click.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), nl=False)
