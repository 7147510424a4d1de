"""The Events page's live feed: ``GET /ui/events/stream`` as server-sent events.

Each event is one SSE message whose ``id:`` is the event's id, so that a browser that
reconnects sends ``Last-Event-ID`` and misses nothing the store still holds; a comment every
15 s keeps proxies from closing an idle stream. The feed reads the store (the events of every
instance, the leader's writes), not an in-memory bus, and ends when the session does (signed
out, expired, its account removed) or when the client goes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Final

from aiohttp import web

from llmgw.log import kv
from llmgw.server.console.auth import KIND
from llmgw.server.console.pages import EVENT_FILTERS, event_json, matches
from llmgw.server.console.security import secure_headers
from llmgw.server.console.site import SESSION, Site

__all__ = ["EventStream"]

log = logging.getLogger("llmgw.server.console")

HEARTBEAT_S: Final = 15.0
POLL_S: Final = 1.0
SESSION_CHECK_S: Final = 5.0
BATCH: Final = 100
RETRY_MS: Final = 3000


def _last_id(request: web.Request) -> int | None:
    """Where the stream resumes: ``Last-Event-ID`` (a reconnect), else ``?after=`` (the id
    the page was rendered up to); None: from now."""
    for raw in (request.headers.get("Last-Event-ID"), request.query.get("after")):
        if raw is None:
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            continue
        if value >= 0:
            return value
    return None


class EventStream:
    """``GET /ui/events/stream[?kind=&subject=&actor=&after=]``."""

    def __init__(
        self,
        site: Site,
        *,
        poll_s: float = POLL_S,
        heartbeat_s: float = HEARTBEAT_S,
        session_check_s: float = SESSION_CHECK_S,
    ) -> None:
        self.site = site
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.session_check_s = session_check_s

    async def stream(self, request: web.Request) -> web.StreamResponse:
        store = self.site.ctx.store
        token, session = request[SESSION]
        filters = {name: request.query.get(name, "").strip() for name in EVENT_FILTERS}
        last = _last_id(request)
        if last is None:
            newest = store.list_events(limit=1)
            last = newest[0].id if newest else 0
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "X-Accel-Buffering": "no"}
        )
        secure_headers(response)
        await response.prepare(request)
        await response.write(f"retry: {RETRY_MS}\n\n".encode())
        loop = asyncio.get_running_loop()
        beat_at = checked_at = loop.time()
        try:
            while True:
                now = loop.time()
                if now - checked_at >= self.session_check_s:
                    checked_at = now
                    if self.site.logins.resolve(token, KIND) is None:
                        await response.write(b"event: session-ended\ndata: {}\n\n")
                        break
                events = store.events_after(last, BATCH)
                for event in events:
                    last = event.id
                    if matches(event, filters):
                        data = json.dumps(event_json(event), ensure_ascii=True)
                        await response.write(f"id: {event.id}\ndata: {data}\n\n".encode())
                if now - beat_at >= self.heartbeat_s:
                    beat_at = now
                    await response.write(f": heartbeat {int(time.time())}\n\n".encode())
                if len(events) < BATCH:
                    await asyncio.sleep(self.poll_s)
        except (ConnectionResetError, ConnectionError):
            pass  # the client went
        log.debug("an event stream ended", extra=kv(operator=session.operator, last=last))
        return response
