"""The Docker runtime: each shard is a container from its engine's image, published on 127.0.0.1.

A shard of a multi-node replica runs in the host's network namespace instead: its
rendezvous (rank 0's dist-init port, or a llama.cpp worker's rpc-server) binds the node's
management address, which other nodes reach, and its HTTP server the host's 127.0.0.1:port,
as the process runtime's would.

Containers carry ``llmgw.*`` labels (cluster, node, replica, shard) so that a restarted agent
finds and adopts the engines it left running; their output is copied into the shard's log
file, where the agent reads the tail when an engine fails. Images are never pulled: an image
must already be on the node (``docker load``), as no registry is assumed.

What a shard's container is (image, command, labels, ports) is built without the SDK, in
:mod:`llmgw.agent.runtimes.containers`; this module talks to the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import docker
import docker.errors
import docker.types
import docker.utils

from llmgw.agent.dockerproxy import DEFAULT_LISTEN
from llmgw.agent.runtimes.base import Handle, Launch, Runtime, ShardRecord, open_shard_log
from llmgw.agent.runtimes.containers import (
    LABEL_CLUSTER,
    LABEL_LOG,
    LABEL_NODE,
    LABEL_SHARD,
    ShardContainer,
    container_name,
)
from llmgw.errors import ShardError
from llmgw.log import kv

__all__ = ["DockerRuntime"]

log = logging.getLogger("llmgw.agent.runtimes.docker")

_DEFAULT_SOCKET = "unix:///var/run/docker.sock"
HOST_NETWORK_CAP_DROP = ("NET_RAW", "NET_BIND_SERVICE")
_LOG_DRAIN_S = 5.0  # how long to let the log copy catch up once a container has ended
_QUICK_TIMEOUT_S = 5  # for alive(), which runs on the event loop
_RETRY_MAX_S = 10.0


def _os_reason(exc: BaseException, depth: int = 0) -> str | None:
    """The system error at the root of a connection failure ("Connection refused"), which the
    SDK and requests wrap in two or three layers of their own."""
    if depth > 8:
        return None
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    for inner in (*exc.args, exc.__cause__, exc.__context__):
        if isinstance(inner, BaseException):
            reason = _os_reason(inner, depth + 1)
            if reason:
                return reason
    return None


def _container_id(handle: Handle) -> str:
    ref = handle.container_id or handle.ref
    assert isinstance(ref, str), f"not a Docker handle: {handle!r}"
    return ref


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class DockerRuntime(Runtime):
    """Engines as containers of the local Docker daemon (``DOCKER_HOST``, or its socket).

    The docker SDK blocks, so every call runs in a thread; waiting for a container and
    copying its output each hold a connection of their own in a daemon thread, which
    neither keeps a stopping agent alive nor stops the container.
    """

    name = "docker"

    def __init__(self, *, base_url: str | None = None, network: str | None = None) -> None:
        self.network = network
        self._client_kwargs: dict[str, Any] = (
            {"base_url": base_url} if base_url else docker.utils.kwargs_from_env()
        )
        self.address = base_url or os.environ.get("DOCKER_HOST") or _DEFAULT_SOCKET
        self._lock = threading.Lock()
        self._api: Any = None
        self._quick: Any = None
        self._followers: dict[str, threading.Thread] = {}
        self._exit_codes: dict[str, int] = {}

    # --- connections -------------------------------------------------------------------

    def _unreachable(self, exc: BaseException) -> ShardError:
        reason = _os_reason(exc) or str(exc).strip() or type(exc).__name__
        if self.address.startswith(f"unix://{DEFAULT_LISTEN.parent}/"):
            fix = (
                "is the proxy running (systemctl start llmgw-docker-proxy; it needs docker "
                "itself: systemctl start docker)?"
            )
        else:
            fix = (
                "is docker running (systemctl start docker), and may the agent use it? "
                "(install-agent.sh install --docker sets up llmgw-docker-proxy for it)"
            )
        return ShardError(f"cannot reach dockerd at {self.address} ({reason}); {fix}")

    def _client(self) -> Any:
        """The shared API client, made on first use (it asks the daemon its API version)."""
        with self._lock:
            if self._api is None:
                try:
                    self._api = docker.APIClient(version="auto", **self._client_kwargs)
                except docker.errors.DockerException as exc:
                    raise self._unreachable(exc) from exc
            return self._api

    def _own_client(self, timeout: float | None) -> Any:
        """A client of its own for a long request (wait, logs) or a short timeout."""
        api = self._client()
        return docker.APIClient(version=api.api_version, timeout=timeout, **self._client_kwargs)

    def _translate(self, exc: BaseException, doing: str, image: str | None = None) -> ShardError:
        """A docker SDK (or connection) error as a ShardError that says what to do."""
        if isinstance(exc, ShardError):
            return exc
        if isinstance(exc, docker.errors.ImageNotFound) and image:
            return ShardError(
                f"image {image} is not on this node; load or pull it (docker load -i FILE, "
                "docker pull IMAGE; docker images lists what is there)"
            )
        if isinstance(exc, docker.errors.APIError):
            explanation = str(exc.explanation or exc).strip()
            lowered = explanation.lower()
            if "could not select device driver" in lowered or "nvidia" in lowered:
                fix = (
                    "install the NVIDIA Container Toolkit and run 'nvidia-ctk runtime configure "
                    "--runtime=docker', then restart dockerd"
                )
            elif "port is already allocated" in lowered or "address already in use" in lowered:
                fix = "another process holds the port; start the shard again on another port"
            elif exc.status_code == 404 and "network" in lowered:
                fix = (
                    f"create the network (docker network create {self.network}) or remove "
                    "docker.network from agent.yaml"
                )
            else:
                fix = "see the dockerd log (journalctl -u docker) for more"
            return ShardError(f"dockerd refused to {doing}: {explanation}; {fix}")
        if isinstance(exc, OSError):  # requests' connection errors are OSErrors
            return self._unreachable(exc)
        return ShardError(f"docker failed to {doing}: {exc}; see the dockerd log for more")

    # --- starting ------------------------------------------------------------------------

    async def create(self, launch: Launch) -> str:
        """Create the shard's container without starting it; returns its id."""
        return await asyncio.to_thread(self._create, launch)

    def _create(self, launch: Launch) -> str:
        image = launch.image
        if not image:
            raise ShardError(
                f"shard {launch.shard_id} has no image; the docker runtime needs one per "
                "engine (docker.images in agent.yaml)"
            )
        api = self._client()
        inner = launch.container_port or launch.port
        labels = {**launch.labels, LABEL_SHARD: launch.shard_id, LABEL_LOG: str(launch.log_path)}
        name = container_name(launch.shard_id, launch.labels.get(LABEL_NODE))
        device_requests = (
            [docker.types.DeviceRequest(device_ids=list(launch.gpus), capabilities=[["gpu"]])]
            if launch.gpus
            else None
        )
        try:
            if launch.host_network:
                # The engine binds the host's loopback itself; only its rendezvous is on the
                # node's address (DESIGN §2), so nothing is published.
                host_config = api.create_host_config(
                    restart_policy={"Name": "no"},
                    device_requests=device_requests,
                    network_mode="host",
                    # In the host's network namespace: no raw sockets on its interfaces, no
                    # ports below 1024 (llmgw-docker-proxy insists).
                    cap_drop=list(HOST_NETWORK_CAP_DROP),
                )
                networking_config = None
                ports: list[tuple[int, str]] = []
            else:
                host_config = api.create_host_config(
                    # Loopback only: the agent's data plane is the one way in from other hosts.
                    port_bindings={f"{inner}/tcp": ("127.0.0.1", launch.port)},
                    restart_policy={"Name": "no"},
                    device_requests=device_requests,
                    network_mode=self.network,
                )
                networking_config = (
                    api.create_networking_config({self.network: api.create_endpoint_config()})
                    if self.network
                    else None
                )
                ports = [(inner, "tcp")]
            kwargs: dict[str, Any] = {
                "command": list(launch.argv),
                "name": name,
                "labels": labels,
                "environment": dict(launch.env),
                "ports": ports,
                "host_config": host_config,
                "networking_config": networking_config,
                "detach": True,
            }
            try:
                created = api.create_container(image, **kwargs)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:
                    raise
                self._remove_leftover(api, name, launch.shard_id)
                created = api.create_container(image, **kwargs)
        except (docker.errors.DockerException, OSError) as exc:
            doing = f"create the container for shard {launch.shard_id}"
            raise self._translate(exc, doing, image) from exc
        return str(created["Id"])

    def _remove_leftover(self, api: Any, name: str, shard_id: str) -> None:
        """Remove a container of the same name that a previous run left behind, if it is ours."""
        attrs = api.inspect_container(name)
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        if labels.get(LABEL_SHARD) != shard_id:
            raise ShardError(
                f"a container named {name} exists and is not shard {shard_id}'s; remove or "
                f"rename it (docker rm {name})"
            )
        log.warning(
            "removing a leftover container of the shard",
            extra=kv(shard=shard_id, container=attrs["Id"][:12], status=attrs["State"]["Status"]),
        )
        api.remove_container(attrs["Id"], force=True)

    async def start(self, launch: Launch) -> Handle:
        log_file = open_shard_log(launch.log_path)
        try:
            container_id = await self.create(launch)
            pid = await asyncio.to_thread(self._start_created, container_id, launch)
        except BaseException:
            log_file.close()
            raise
        self._follow(container_id, log_file, since=None)
        return Handle(
            shard_id=launch.shard_id,
            pid=pid,
            port=launch.port,
            ref=container_id,
            container_id=container_id,
        )

    def _start_created(self, container_id: str, launch: Launch) -> int:
        api = self._client()
        try:
            api.start(container_id)
            attrs = api.inspect_container(container_id)
        except (docker.errors.DockerException, OSError) as exc:
            error = self._translate(
                exc, f"start the container for shard {launch.shard_id}", launch.image
            )
            with contextlib.suppress(docker.errors.DockerException, OSError):
                api.remove_container(container_id, force=True)
            raise error from exc
        return int(attrs["State"].get("Pid") or 0)

    # --- logs ---------------------------------------------------------------------------

    def _follow(self, container_id: str, log_file: IO[bytes], since: int | None) -> None:
        thread = threading.Thread(
            target=self._copy_logs,
            args=(container_id, log_file, since),
            name=f"docker-logs-{container_id[:12]}",
            daemon=True,
        )
        self._followers[container_id] = thread
        thread.start()

    def _copy_logs(self, container_id: str, log_file: IO[bytes], since: int | None) -> None:
        try:
            api = self._own_client(timeout=None)
            try:
                for chunk in api.logs(
                    container_id, stream=True, follow=True, stdout=True, stderr=True, since=since
                ):
                    log_file.write(chunk)
            finally:
                api.close()
        except (docker.errors.DockerException, OSError, ShardError) as exc:
            log.warning(
                "stopped copying the container's output",
                extra=kv(container=container_id[:12], error=str(exc)),
            )
        finally:
            log_file.close()

    def follow_logs(self, handle: Handle, log_path: Path) -> None:
        """Copy the container's output from now on into ``log_path`` (after adoption)."""
        container_id = _container_id(handle)
        thread = self._followers.get(container_id)
        if thread is not None and thread.is_alive():
            return
        try:
            since = int(log_path.stat().st_mtime)
        except OSError:
            since = None
        try:
            log_file = open_shard_log(log_path)
        except ShardError as exc:
            log.warning(
                "cannot open the shard log",
                extra=kv(shard=handle.shard_id, path=str(log_path), error=str(exc)),
            )
            return
        self._follow(container_id, log_file, since=since)

    async def _drain_logs(self, container_id: str) -> None:
        thread = self._followers.pop(container_id, None)
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join, _LOG_DRAIN_S)

    # --- waiting and stopping -------------------------------------------------------------

    async def wait(self, handle: Handle) -> int | None:
        """The container's exit code (137 when it was killed); None when it was removed
        before its end could be seen."""
        container_id = _container_id(handle)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[int | None] = loop.create_future()
        threading.Thread(
            target=self._wait_thread,
            args=(container_id, loop, ended),
            name=f"docker-wait-{container_id[:12]}",
            daemon=True,
        ).start()
        code = await ended
        await self._drain_logs(container_id)
        return code

    def _wait_thread(
        self,
        container_id: str,
        loop: asyncio.AbstractEventLoop,
        ended: asyncio.Future[int | None],
    ) -> None:
        result: int | None = None
        error: BaseException | None = None
        try:
            result = self._wait_blocking(container_id, ended)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(_resolve, ended, result, error)

    def _wait_blocking(self, container_id: str, ended: asyncio.Future[int | None]) -> int | None:
        delay = 0.5
        warned = False
        while not ended.done():
            try:
                api = self._own_client(timeout=None)
                try:
                    status = api.wait(container_id)
                finally:
                    api.close()
                return int(status.get("StatusCode", -1))
            except docker.errors.NotFound:
                return self._exit_codes.get(container_id)
            except (docker.errors.DockerException, OSError, ShardError) as exc:
                # dockerd restarting: the container's end is still to come, or known to it.
                if not warned:
                    log.warning(
                        "lost dockerd while waiting for a container; retrying",
                        extra=kv(container=container_id[:12], error=str(exc)),
                    )
                    warned = True
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
        return None

    def alive(self, handle: Handle) -> bool:
        container_id = _container_id(handle)
        if container_id in self._exit_codes:
            return False
        try:
            quick = self._quick
            if quick is None:
                quick = self._quick = self._own_client(timeout=_QUICK_TIMEOUT_S)
            state = quick.inspect_container(container_id)["State"]
        except docker.errors.NotFound:
            return False
        except (docker.errors.DockerException, OSError, ShardError):
            # Unknown: say alive so that stop() is tried and reports what is wrong.
            return True
        return bool(state.get("Running"))

    async def stop(self, handle: Handle, grace: float) -> None:
        """``docker stop`` (SIGTERM, SIGKILL after ``grace``), then remove the container."""
        await asyncio.to_thread(self._stop, _container_id(handle), grace)

    def _stop(self, container_id: str, grace: float) -> None:
        api = self._client()
        try:
            try:
                api.stop(container_id, timeout=max(0, math.ceil(grace)))
                state = api.inspect_container(container_id)["State"]
            except docker.errors.NotFound:
                return
            self._exit_codes[container_id] = int(state.get("ExitCode") or 0)
            # The output copy ends with the container; let it finish before the log goes.
            follower = self._followers.get(container_id)
            if follower is not None:
                follower.join(_LOG_DRAIN_S)
            with contextlib.suppress(docker.errors.NotFound):
                api.remove_container(container_id, force=True)
        except docker.errors.APIError as exc:
            if exc.status_code == 409 and "in progress" in str(exc.explanation):
                return  # someone else is removing it
            raise self._translate(exc, f"stop container {container_id[:12]}") from exc
        except (docker.errors.DockerException, OSError) as exc:
            raise self._translate(exc, f"stop container {container_id[:12]}") from exc

    # --- adoption -------------------------------------------------------------------------

    async def find_by_labels(
        self, node_id: str, cluster_id: str | None = None
    ) -> list[ShardContainer]:
        """Every llmgw container of this node, running or not (for adoption after a restart)."""
        return await asyncio.to_thread(self._find_by_labels, node_id, cluster_id)

    def _find_by_labels(self, node_id: str, cluster_id: str | None) -> list[ShardContainer]:
        filters = [f"{LABEL_NODE}={node_id}", LABEL_SHARD]
        if cluster_id:
            filters.append(f"{LABEL_CLUSTER}={cluster_id}")
        api = self._client()
        found: list[ShardContainer] = []
        try:
            for summary in api.containers(all=True, filters={"label": filters}):
                with contextlib.suppress(docker.errors.NotFound):  # removed meanwhile
                    found.append(ShardContainer.from_inspect(api.inspect_container(summary["Id"])))
        except (docker.errors.DockerException, OSError) as exc:
            raise self._translate(exc, "list llmgw's containers") from exc
        return found

    async def adopt(self, record: ShardRecord) -> Handle | None:
        """The running container of ``record``'s shard (by its id, else by label), or None."""
        found = await asyncio.to_thread(self._locate, record)
        if found is None or not found.running:
            return None
        handle = Handle(
            shard_id=record.shard_id,
            pid=found.pid,
            port=found.port or record.port,
            ref=found.container_id,
            container_id=found.container_id,
        )
        if found.log_path is not None:
            self.follow_logs(handle, found.log_path)
        return handle

    def _locate(self, record: ShardRecord) -> ShardContainer | None:
        api = self._client()
        try:
            if record.container_id:
                with contextlib.suppress(docker.errors.NotFound):
                    found = ShardContainer.from_inspect(api.inspect_container(record.container_id))
                    if found.shard_id == record.shard_id:
                        return found
            summaries = api.containers(
                all=True, filters={"label": [f"{LABEL_SHARD}={record.shard_id}"]}
            )
            containers = [
                ShardContainer.from_inspect(api.inspect_container(s["Id"])) for s in summaries
            ]
        except docker.errors.NotFound:
            return None
        except (docker.errors.DockerException, OSError) as exc:
            raise self._translate(exc, f"find the container of shard {record.shard_id}") from exc
        # A running one first; there should be one at most.
        containers.sort(key=lambda c: not c.running)
        return containers[0] if containers else None

    def close(self) -> None:
        """Close the shared connections (the threads that wait or copy output keep theirs)."""
        with self._lock:
            for api in (self._api, self._quick):
                if api is not None:
                    api.close()
            self._api = self._quick = None
