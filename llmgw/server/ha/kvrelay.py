"""KV events on every instance: the leader relays the ``KvEvents`` its agents send to each
standby, so that a standby routes a ``kv-events`` model by what the replicas hold, as the
leader does (issue 40).

**Why the leader relays (and not the agents to every instance).** The agents already send
their events to the leader alone, on the stream it checks and bounds (:mod:`llmgw.server.
fleet.intake`); sending them to every instance would need each agent to hold a stream to
each standby, which refuses agents' streams today, and would multiply the agents' work by
the number of instances. PostgreSQL's ``NOTIFY`` (how standbys learn routes) carries at most
8000 bytes a payload through the database's one queue, and has no way to give a standby
that starts late the whole index. So the one new moving part is one HTTP stream per standby
to the leader's :8080, which every standby already reaches (its admin API proxy):

- ``GET /api/ha/kv-events`` (:data:`RELAY_PATH`) with the admin token every instance holds
  (a bearer credential, compared in constant time; anything else is 401);
- the answer: the leader's whole events index first (:meth:`Router.kv_snapshot
  <llmgw.server.gateway.routing.Router.kv_snapshot>`, each shard ``cleared`` then its keys),
  taken in the same step of the event loop as the subscription, then every ``KvEvents`` the
  leader places, as it places it; each a frame of a 4-byte big-endian length and a
  ``pb.KvRelayed`` (the node and model the leader placed it under); a frame of length 0 every
  :data:`KEEPALIVE` seconds while nothing else is sent;
- a standby that falls :data:`MAX_QUEUED` frames behind is cut off; it dials again and is
  sent the whole index again, as it is on every (re)connection.

**When the leader changes.** A standby's stream to the old leader ends (connection reset,
or no frame for :data:`READ_TIMEOUT` after a pause); it dials whoever leads then, clears its
index and takes the snapshot: the new leader's own index, rebuilt from the agents' whole
sets that every agent sends after its Hello (:mod:`llmgw.agent.kvevents`). A standby that
becomes the leader stops following and hears the agents itself; their resync replaces what
it was relayed. Until a standby's first snapshot it routes a kv-events model as ``session``
does (rendezvous hashing, the same choice on every instance).

**Cost.** On the leader, one serialisation per event batch, whatever the number of
standbys, and a write per standby; on a standby, one parse and the same index update as the
leader's. ``bench/kvrelay.py`` measures it (the README has the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from google.protobuf.message import DecodeError
from yarl import URL

from llmgw.log import kv
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.intake import MAX_KV_KEYS
from llmgw.server.gateway.routing import Router

__all__ = [
    "KEEPALIVE",
    "MAX_FRAME",
    "MAX_QUEUED",
    "READ_TIMEOUT",
    "RELAY_PATH",
    "KvFollower",
    "KvRelay",
    "frame",
]

log = logging.getLogger("llmgw.server.kvrelay")

RELAY_PATH = "/api/ha/kv-events"
CONTENT_TYPE = "application/x-llmgw-kv-relay"
KEEPALIVE = 5.0
"""Seconds between frames of length 0 while the leader has nothing else to send."""
READ_TIMEOUT = 3 * KEEPALIVE
"""Seconds a standby waits for a frame before it takes the leader for gone and dials again."""
MAX_QUEUED = 4096
"""Frames a standby may be behind before the leader cuts it off (it is sent all again)."""
SNAPSHOT_CHUNK = 8192
"""Keys per relayed message of the snapshot."""
MAX_FRAME = MAX_KV_KEYS * 8 + 4096
"""The largest frame a standby reads (an agent's largest KvEvents, with its node and model)."""
RETRY = 1.0


def frame(msg: pb.KvRelayed) -> bytes:
    """``msg`` as the relay sends it: its length (4 bytes, big-endian), then its bytes."""
    data = msg.SerializeToString()
    return len(data).to_bytes(4, "big") + data


_KEEPALIVE_FRAME = (0).to_bytes(4, "big")


class _Subscriber:
    """One standby's frames not yet written."""

    def __init__(self) -> None:
        self.frames: deque[bytes] = deque()
        self.ready = asyncio.Event()
        self.overflowed = False
        self.ended = False  # the leader stops leading: the stream ends

    def put(self, data: bytes) -> None:
        if len(self.frames) >= MAX_QUEUED:
            self.overflowed = True
        else:
            self.frames.append(data)
        self.ready.set()


class KvRelay:
    """The leader's side: every KvEvents its router places, to each subscribed standby."""

    def __init__(
        self, router: Router, token: Callable[[], str], metrics: Metrics | None = None
    ) -> None:
        self.router = router
        self.token = token
        self.metrics = metrics or Metrics()
        self.subscribers: set[_Subscriber] = set()
        self.relayed = 0  # frames put to subscribers
        self.cut_off = 0  # standbys cut off for falling behind
        # Shown from the start on a leader (a standby has neither).
        self.metrics.kv_relay_standbys.set((), 0)
        self.metrics.kv_relay_cut_off.inc((), 0)
        router.on_kv_events = self.publish

    def close(self) -> None:
        """Relay nothing more and end every standby's stream (this instance stops leading:
        its :8080 is shut down, which would otherwise wait for these streams)."""
        if self.router.on_kv_events == self.publish:
            self.router.on_kv_events = None
        for sub in self.subscribers:
            sub.ended = True
            sub.ready.set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(RELAY_PATH, self.handle)

    def publish(self, node_id: str, model: str, msg: pb.KvEvents) -> None:
        if not self.subscribers:
            return
        data = frame(pb.KvRelayed(node_id=node_id, model=model, events=msg))
        for sub in self.subscribers:
            sub.put(data)
        self.relayed += len(self.subscribers)
        self.metrics.kv_relay_frames.inc(("sent",), len(self.subscribers))

    def _authorised(self, request: web.Request) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        secret = self.token()
        return (
            scheme.lower() == "bearer"
            and bool(secret)
            and hmac.compare_digest(token.strip().encode(), secret.encode())
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not self._authorised(request):
            return web.json_response(
                {
                    "error": {
                        "message": "the KV events relay is for the cluster's instances: send "
                        "the admin token (server.yaml's admin_token_file) as a bearer token",
                        "type": "authentication_error",
                        "code": "unauthorised",
                    }
                },
                status=401,
            )
        sub = _Subscriber()
        self.subscribers.add(sub)
        self.metrics.kv_relay_standbys.set((), len(self.subscribers))
        # Taken with the subscription, no await between: what is queued after it follows it.
        snapshot = self.router.kv_snapshot(SNAPSHOT_CHUNK)
        out = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        peer = request.remote or ""
        log.info("a standby follows the KV events", extra=kv(peer=peer, shards=len(snapshot)))
        try:
            await out.prepare(request)
            for msg in snapshot:
                await out.write(frame(msg))
            self.metrics.kv_relay_frames.inc(("sent",), len(snapshot))
            await self._live(sub, out)
        except ConnectionError:
            pass
        finally:
            self.subscribers.discard(sub)
            self.metrics.kv_relay_standbys.set((), len(self.subscribers))
        if sub.overflowed:
            self.cut_off += 1
            self.metrics.kv_relay_cut_off.inc(())
            log.warning(
                "a standby fell behind the KV events; cut off (it dials again and is sent the "
                "whole index)",
                extra=kv(peer=peer, queued=MAX_QUEUED),
            )
        return out

    async def _live(self, sub: _Subscriber, out: web.StreamResponse) -> None:
        while not (sub.overflowed or sub.ended):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sub.ready.wait(), KEEPALIVE)
            sub.ready.clear()
            if sub.overflowed or sub.ended:
                return
            if not sub.frames:
                await out.write(_KEEPALIVE_FRAME)
                continue
            chunk = b"".join(sub.frames)
            sub.frames.clear()
            await out.write(chunk)


class KvFollower:
    """A standby's side: the leader's KV events into this instance's router, dialled again
    whenever the stream ends or the leader changes."""

    def __init__(
        self,
        router: Router,
        leader_http: Callable[[], str],
        *,
        token: Callable[[], str],
        ssl: Callable[[], Any] = lambda: None,
        retry: float = RETRY,
        read_timeout: float = READ_TIMEOUT,
        metrics: Metrics | None = None,
    ) -> None:
        self.router = router
        self.metrics = metrics or Metrics()
        self.leader_http = leader_http
        self.token = token
        self.ssl = ssl
        self.retry = retry
        self.read_timeout = read_timeout
        self.applied = 0  # relayed messages applied
        self.connections = 0  # snapshots taken
        self._last_problem = ""

    async def run(self) -> None:
        """Follow whoever leads, forever."""
        timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=self.read_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                leader = self.leader_http()
                problem = "no instance leads now"
                if leader:
                    try:
                        problem = await self._follow(session, leader)
                    except (
                        aiohttp.ClientError,
                        TimeoutError,
                        ValueError,
                        EOFError,  # asyncio.IncompleteReadError: the stream ended mid-frame
                        DecodeError,
                    ) as exc:
                        problem = f"{type(exc).__name__}: {exc}"
                self._note(problem, leader)
                await asyncio.sleep(self.retry)

    def _note(self, problem: str, leader: str) -> None:
        if problem != self._last_problem:  # once per kind of trouble, not every second
            log.warning(
                "not following the leader's KV events; dialling again (this standby routes "
                "kv-events models by what it was last sent)",
                extra=kv(leader=leader or "-", problem=problem),
            )
            self._last_problem = problem

    async def _follow(self, session: aiohttp.ClientSession, leader: str) -> str:
        """One stream from ``leader``; returns why it ended."""
        url = URL(leader.rstrip("/") + RELAY_PATH)
        headers = {"Authorization": f"Bearer {self.token()}"}
        async with session.get(url, headers=headers, ssl=self.ssl()) as resp:
            if resp.status != 200 or resp.content_type != CONTENT_TYPE:
                body = (await resp.text())[:300]
                return f"the leader answered {resp.status}: {body}"
            self.router.prefixes.clear_events()
            self.connections += 1
            self._last_problem = ""
            log.info("following the leader's KV events", extra=kv(leader=leader))
            reader = resp.content
            while self.leader_http() == leader:
                size = int.from_bytes(await reader.readexactly(4), "big")
                if size > MAX_FRAME:
                    return f"a frame of {size} bytes, over {MAX_FRAME}"
                if size == 0:
                    continue
                msg = pb.KvRelayed.FromString(await reader.readexactly(size))
                self.router.kv_relayed(msg)
                self.applied += 1
                self.metrics.kv_relay_frames.inc(("applied",))
                # readexactly does not yield while frames are buffered: a snapshot or a
                # burst would be indexed in one step of the loop, the requests this standby
                # routes waiting behind it.
                await asyncio.sleep(0)
            return "another instance leads now"
