"""Whether this node's Docker daemon answers, for a node whose ``runtime`` is ``docker``:
every shard there is a container, so a daemon it cannot reach leaves it able to run nothing.

Never raises: what went wrong is the answer, with what to start or fix. The docker SDK is
loaded only when asked (it costs every other command about 70 ms).
"""

from __future__ import annotations

import os

from llmgw.agent.dockerproxy import DEFAULT_LISTEN

__all__ = ["DOCKER_PING_TIMEOUT", "docker_address", "docker_problem"]

DOCKER_PING_TIMEOUT = 5.0
_DEFAULT_SOCKET = "unix:///var/run/docker.sock"
_NO_SHARD = "until then this node runs no shard"


def docker_address(host: str | None) -> str:
    """The daemon the agent talks to: agent.yaml's ``docker.host``, else ``DOCKER_HOST``,
    else dockerd's own socket."""
    return host or os.environ.get("DOCKER_HOST") or _DEFAULT_SOCKET


def _os_reason(exc: BaseException) -> str | None:
    """The system error under the SDK's and requests' wrappers ("Connection refused"); None
    when there is none (the daemon answered, with an error)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen or len(seen) > 16:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        pending.extend(
            inner
            for inner in (*current.args, current.__cause__, current.__context__)
            if isinstance(inner, BaseException)
        )
    return None


def docker_problem(host: str | None, timeout: float = DOCKER_PING_TIMEOUT) -> str:
    """'' when the daemon at ``host`` (see :func:`docker_address`) answers its version and a
    ping within ``timeout`` seconds; otherwise what is wrong and what to do."""
    address = docker_address(host)
    try:
        import docker
        import docker.utils

        kwargs = {"base_url": host} if host else docker.utils.kwargs_from_env()
        # "auto" asks the daemon its API version, as the docker runtime does on first use.
        api = docker.APIClient(version="auto", timeout=timeout, **kwargs)
        try:
            api.ping()
        finally:
            api.close()
    except Exception as exc:
        reason = _os_reason(exc)
        if reason is not None:
            return _unreachable(address, reason)
        said = str(exc).strip() or type(exc).__name__
        return (
            f"runtime is docker but dockerd at {address} does not answer as it should ({said}); "
            "see its log (journalctl -u docker) and restart it (systemctl restart docker); "
            f"{_NO_SHARD}"
        )
    return ""


def _unreachable(address: str, reason: str) -> str:
    if address.startswith(f"unix://{DEFAULT_LISTEN.parent}/"):
        fix = (
            "start llmgw's Docker proxy (systemctl start llmgw-docker-proxy; it needs dockerd "
            "itself: systemctl start docker)"
        )
    else:
        fix = (
            "install Docker (Debian/Ubuntu: apt install docker.io; RHEL: dnf install docker-ce "
            "from Docker's repository) and start it (systemctl start docker), and let the agent "
            "use it (install-agent.sh install --docker sets up llmgw-docker-proxy for it)"
        )
    return f"runtime is docker but dockerd at {address} cannot be reached ({reason}); {fix}; {_NO_SHARD}"
