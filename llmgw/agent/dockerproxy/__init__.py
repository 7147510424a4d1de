"""A proxy for dockerd's socket that lets through only what llmgw's docker runtime does.

``docker`` group membership is root on the host; with this proxy the agent gets a socket of
its own (group llmgw-agent, 0660) instead: :mod:`.policy` decides what passes, :mod:`.relay`
serves the socket (``llmgw agent docker-proxy``, systemd/llmgw-docker-proxy.service).
"""

from llmgw.agent.dockerproxy.policy import Policy, Refused, check_create, route
from llmgw.agent.dockerproxy.relay import DEFAULT_LISTEN, DEFAULT_UPSTREAM, DockerProxy, serve

__all__ = [
    "DEFAULT_LISTEN",
    "DEFAULT_UPSTREAM",
    "DockerProxy",
    "Policy",
    "Refused",
    "check_create",
    "route",
    "serve",
]
