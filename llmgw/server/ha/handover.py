"""The :8080 socket kept across changes of role (PostgreSQL): one server holds the listening
socket and its connections for the process's life and hands each request to the current
role's application, so that a change of role closes no client's connection (a keep-alive
connection closed as a request is sent on it fails that request). The application replaced
is cleaned up once the requests it was serving have ended; until then its gateway's queued
requests still hear of replicas becoming ready (each gateway's admission subscribes to the
router until the gateway is closed).

aiohttp has no public way to hand a request to another running application: a
sub-application (``add_subapp``) is fixed when the outer application freezes, and the
low-level server's ``request_handler`` is read once per connection (a keep-alive
connection would stay on the old role). So :meth:`Handover._dispatch` enters the role's
application through ``Application._handle``, the entry aiohttp itself uses for every
application and sub-application (router, middlewares, expect handler, ``request.app``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from aiohttp import web

from llmgw.listener import GuardedSite, ListenerLimits
from llmgw.netaddr import parse_hostport
from llmgw.server.ha.drain import stop_accepting

__all__ = ["Handover"]

# How long a retired application's requests may run on (its streams may run long).
RETIRE_WAIT = 60.0


class Handover:
    """:8080's one server on the kept socket, and the role's application it hands
    requests to."""

    def __init__(self, sock: socket.socket, *, listen: str, limits: ListenerLimits) -> None:
        self.sock = sock
        self.listen = listen
        self.limits = limits
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._current: web.Application | None = None
        self._inflight: dict[int, int] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    async def serve(self, app: web.Application, ssl_context: ssl.SSLContext | None) -> None:
        """Serve *app* (the leader's or a standby's) from now on; the one it replaces is
        retired once its requests have ended. *ssl_context* is the listener's, taken when
        the server first starts."""
        app.freeze()
        await app.startup()
        old, self._current = self._current, app
        if self._runner is None:
            await self._start(ssl_context)
        if old is not None:
            task = asyncio.create_task(self._retire(old), name="retire-app")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _start(self, ssl_context: ssl.SSLContext | None) -> None:
        outer = web.Application(client_max_size=1024 * 1024)
        outer.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(
            outer, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = GuardedSite(
            self._runner,
            *parse_hostport(self.listen, allow_zero=True),
            label="http",
            limits=self.limits,
            backlog=2048,
            hint="listeners.header_timeout in server.yaml",
            ssl_context=ssl_context,
            sock=self.sock,
        )
        await site.start()
        self.port = site.bound_port

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        app = self._current
        if app is None:
            return web.json_response(
                {"error": {"message": "this instance is changing role; retry", "code": "busy"}},
                status=503,
                headers={"Retry-After": "1"},
            )
        key = id(app)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        try:
            return await app._handle(request)  # the module's docstring says why
        finally:
            self._inflight[key] -= 1

    async def _retire(self, app: web.Application) -> None:
        key = id(app)
        for _ in range(int(RETIRE_WAIT * 10)):
            if not self._inflight.get(key):
                break
            await asyncio.sleep(0.1)
        self._inflight.pop(key, None)
        await app.cleanup()

    async def stop_accepting(self) -> None:
        """A stop's drain: no new connection (the kept socket closed with the site's
        duplicate of it), idle keep-alive connections closed; the requests in flight go on."""
        if self._runner is not None:
            await stop_accepting(self._runner, self.sock)
        else:
            self.sock.close()

    async def close(self) -> None:
        """Stop serving: the server, the applications being retired, then the current one
        (the socket stays open: its owner closes it)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._current is not None:
            app, self._current = self._current, None
            await app.cleanup()
