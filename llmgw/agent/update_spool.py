"""The agent's side of a signed self-update (DESIGN §7): turn an UpdateOrder from the control
plane into a spooled request for the root helper, and report the helper's verdict.

The agent, never root, checks the order's fields (:func:`~llmgw.contracts.update_order.parse_order`;
verifying the signature is the helper's), downloads the bundle (over https only from the
control plane, when the server's certificate comes from the cluster CA), checks its SHA-256
and renames a finished directory to ``<spool>/request``: ``llmgw-agent-update.path`` then
starts the root helper (``llmgw.updater``). What the helper writes to ``status.json`` is
reported to the control plane as it changes. An agent in its container image
(``CONTAINER_ENV`` set) has no helper to apply a request: it refuses orders, saying how such a
node is upgraded (:data:`IN_CONTAINER`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import shutil
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.contracts.update_order import (
    BUNDLE_FILE,
    MAX_BUNDLE,
    MAX_SMALL,
    ORDER_FILE,
    REQUEST,
    SIGNATURE_FILE,
    STATUS,
    parse_order,
)
from llmgw.controlpeer import NotControlPlane, require_control_plane
from llmgw.errors import FileError, UpdateError
from llmgw.fsutil import atomic_write, fsync_dir

__all__ = ["CONTAINER_ENV", "IN_CONTAINER", "NotControlPlane", "Spooler", "read_status"]

log = logging.getLogger("llmgw.agent.update_spool")

_CHUNK = 1 << 20

# Set by the agent's container image (scripts/agent-image.sh): this agent is its container.
CONTAINER_ENV = "LLMGW_AGENT_CONTAINER"
IN_CONTAINER = (
    "this agent runs in its container image, where no update helper applies a spooled "
    "update; nothing was downloaded: load the new image on the node (docker load) and "
    'recreate the container (docker compose up -d; README "The agent as a container")'
)


def read_status(spool: Path) -> dict[str, Any] | None:
    """What the root helper last wrote to ``spool/status.json``, or None."""
    try:
        fd = os.open(spool / STATUS, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, MAX_SMALL))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not isinstance(data.get("state"), str):
        return None
    return data


@dataclass
class Spooler:
    """The agent's side: turn an UpdateOrder into a spooled request and report its progress.

    ``report(op_id, counter, version, state, message)`` sends an UpdateStatus (or does
    nothing while there is no stream)."""

    node_id: str
    spool: Path
    report: Callable[[str, int, str, str, str], object]
    ssl_context: Callable[[], ssl.SSLContext]
    download_timeout: float = 1800.0
    poll_interval: float = 2.0
    # The cluster CA: an https server whose certificate it issued must be the control plane
    # (a node's certificate may name the same host), checked in the handshake. Others (an
    # operator's or ACME certificate) are left to the context's trust; the order's SHA-256
    # vouches for the bytes either way.
    cluster_ca: Path | None = None
    # Why this agent cannot apply an update at all (IN_CONTAINER); orders are refused with it.
    refusal: str | None = None

    def __post_init__(self) -> None:
        self._op_ids: dict[int, str] = {}
        self._last_sent: tuple[Any, ...] | None = None

    async def handle(self, op_id: str, order_bytes: bytes, signature: bytes) -> None:
        """Spool one order; UpdateError (reported first) when it cannot be."""
        counter, version = 0, ""
        try:
            order = parse_order(order_bytes)
            counter, version = int(order["counter"]), str(order["version"])
            self._op_ids[counter] = op_id
            if self.refusal is not None:
                raise UpdateError(self.refusal)
            if order["node_id"] != self.node_id:
                raise UpdateError(
                    f"the update order is for node {order['node_id']}, and this is "
                    f"{self.node_id}; nothing was downloaded"
                )
            if _request_pending(self.spool):
                self.report(
                    op_id,
                    counter,
                    version,
                    "busy",
                    f"{self.spool / REQUEST} is still waiting for the update helper; is "
                    "llmgw-agent-update.path active? (systemctl status llmgw-agent-update.path)",
                )
                return
            self.report(op_id, counter, version, "downloading", order["url"])
            await self._spool(order, order_bytes, signature)
        except UpdateError as exc:
            self.report(op_id, counter, version, exc.state, exc.message)
            raise
        self.report(op_id, counter, version, "spooled", f"{self.spool / REQUEST}")

    async def _spool(self, order: dict[str, Any], order_bytes: bytes, signature: bytes) -> None:
        try:
            self.spool.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise UpdateError(
                f"cannot create the update spool {self.spool}: {exc.strerror}; the agent's "
                "state directory must be writable by its user",
                state="failed",
            ) from exc
        incoming = self.spool / f"incoming.{secrets.token_hex(8)}"
        incoming.mkdir(mode=0o755)
        try:
            digest = await self._download(order["url"], incoming / BUNDLE_FILE)
            if digest != order["sha256"]:
                raise UpdateError(
                    f"the bundle downloaded from {order['url']} has SHA-256 {digest}, not the "
                    f"{order['sha256']} the order names; the control plane's bundle changed "
                    "since it signed the order: order the update again",
                    state="failed",
                )
            await asyncio.to_thread(_commit_request, incoming, self.spool, order_bytes, signature)
        except (OSError, FileError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else exc.message
            raise UpdateError(
                f"cannot write the update request in {self.spool}: {why}; free space "
                "in the agent's state directory and order the update again",
                state="failed",
            ) from exc
        finally:
            shutil.rmtree(incoming, ignore_errors=True)

    async def _download(self, url: str, dest: Path) -> str:
        import aiohttp

        digest = hashlib.sha256()
        size = 0
        timeout = aiohttp.ClientTimeout(total=self.download_timeout, sock_connect=30)
        ssl_arg: ssl.SSLContext | bool = False
        if url.startswith("https:"):
            ssl_arg = self.ssl_context()
            if self.cluster_ca is not None:
                require_control_plane(ssl_arg, self.cluster_ca)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session,
                session.get(url, ssl=ssl_arg) as resp,
            ):
                if resp.status != 200:
                    raise UpdateError(
                        f"downloading the bundle from {url} failed: HTTP {resp.status}; check "
                        "the control plane's bundle directory and order the update again",
                        state="failed",
                    )
                with open(dest, "xb") as out:
                    async for chunk in resp.content.iter_chunked(_CHUNK):
                        size += len(chunk)
                        if size > MAX_BUNDLE:
                            raise UpdateError(
                                f"the bundle from {url} is bigger than {MAX_BUNDLE} bytes; "
                                "it is not an agent bundle",
                                state="failed",
                            )
                        out.write(chunk)
                        digest.update(chunk)
                    out.flush()
                    os.fsync(out.fileno())
        except aiohttp.ClientConnectorCertificateError as exc:
            if not isinstance(exc.certificate_error, NotControlPlane):
                raise UpdateError(
                    f"downloading the bundle from {url} failed: {exc}; check that this node "
                    "reaches the control plane's HTTP port",
                    state="failed",
                ) from exc
            log.warning(
                "refused a bundle download from a server that is not the control plane",
                extra={"fields": {"url": url, "reason": str(exc.certificate_error)}},
            )
            raise UpdateError(
                f"downloading the bundle from {url} was refused before it was asked for: the "
                f"server is not the control plane ({exc.certificate_error}); check the control "
                "plane's advertised address and order the update again",
                state="failed",
            ) from exc
        except aiohttp.ClientError as exc:
            raise UpdateError(
                f"downloading the bundle from {url} failed: {exc or type(exc).__name__}; "
                "check that this node reaches the control plane's HTTP port",
                state="failed",
            ) from exc
        except TimeoutError as exc:
            raise UpdateError(
                f"downloading the bundle from {url} took longer than "
                f"{self.download_timeout:g} s; order the update again",
                state="failed",
            ) from exc
        return digest.hexdigest()

    def connected(self) -> None:
        """A new stream: report the helper's last verdict again (the control plane may have
        missed it while this agent was being replaced)."""
        self._last_sent = None
        self.poll()

    def poll(self) -> None:
        """Report ``status.json`` if it changed since the last report."""
        status = read_status(self.spool)
        if status is None:
            return
        try:
            counter = int(status.get("counter") or 0)
        except (TypeError, ValueError):
            counter = 0
        version = str(status.get("version") or "")
        key = (counter, status["state"], str(status.get("message") or ""), status.get("time"))
        if key == self._last_sent:
            return
        sent = self.report(self._op_ids.get(counter, ""), counter, version, status["state"], key[2])
        if sent is not False:
            self._last_sent = key

    async def run(self) -> None:
        """Watch ``status.json`` for the helper's progress until cancelled."""
        while True:
            await asyncio.sleep(self.poll_interval)
            self.poll()


def _request_pending(spool: Path) -> bool:
    return os.path.lexists(spool / REQUEST)


def _commit_request(incoming: Path, spool: Path, order_bytes: bytes, signature: bytes) -> None:
    """Order and signature next to the bundle, everything on disk, then one rename makes it
    the request the path unit sees."""
    for name, data in ((ORDER_FILE, order_bytes), (SIGNATURE_FILE, signature)):
        atomic_write(incoming / name, data)
    if _request_pending(spool):
        raise UpdateError(
            f"another request appeared in {spool} while downloading; order the update again "
            "once it is applied",
            state="busy",
        )
    os.rename(incoming, spool / REQUEST)
    fsync_dir(spool)
