"""``llmgw agent docker-proxy``: the Docker socket proxy the agent may use instead of
docker.sock (the proxy itself is ``llmgw.agent.dockerproxy``)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from llmgw.agent.dockerproxy import DEFAULT_LISTEN, DEFAULT_UPSTREAM, Policy, serve
from llmgw.errors import ConfigError
from llmgw.log import setup_logging
from llmgw.loop import run as run_loop
from llmgw.notify import Notifier

__all__ = ["docker_proxy"]


@click.command("docker-proxy")
@click.option(
    "--listen",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_LISTEN,
    show_default=True,
    help="The socket to serve; the agent's DOCKER_HOST is unix://LISTEN.",
)
@click.option(
    "--upstream",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_UPSTREAM,
    show_default=True,
    help="dockerd's socket.",
)
@click.option(
    "--group",
    default="llmgw-agent",
    show_default=True,
    help="The group that may connect (the socket is 0660).",
)
@click.option(
    "--bind-root",
    "bind_roots",
    multiple=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="A directory containers may bind read-only (it, or what is below it when every "
    "directory on the way is root's). Repeatable; none by default: no bind mounts.",
)
@click.option(
    "--host-network/--no-host-network",
    default=True,
    show_default=True,
    help="Whether containers may use the host's network (multi-node shards do).",
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
def docker_proxy(
    listen: Path,
    upstream: Path,
    group: str,
    bind_roots: tuple[Path, ...],
    host_network: bool,
    log_level: str,
) -> None:
    """Serve a Docker socket that allows only what llmgw's docker runtime does (as root or
    a member of the docker group, from llmgw-docker-proxy.service): llmgw's labelled
    containers, not privileged, no host namespaces, devices or mounts, ports on 127.0.0.1.
    Everything else is answered 403 with the reason."""
    for root in bind_roots:
        if not root.is_absolute() or os.path.normpath(root) != str(root):
            raise ConfigError(f"--bind-root {root}: give an absolute, normalised path")
    setup_logging(log_level)
    notifier = Notifier()
    policy = Policy(bind_roots=tuple(bind_roots), host_network=host_network)
    run_loop(
        serve(listen, upstream, policy, group=group or None, on_ready=notifier.ready),
        process="docker-proxy",
    )
