"""The admin API answered in process for ``llmgw ctl``'s tests, as httpx's ``MockTransport``
answers for its clients: ctl runs whole — its admin client builds each request, reads each
answer and turns an error status into the error the operator reads — and only the network is
left out. ``handler(method, path, body)`` returns the JSON of a 200 answer, a
:class:`Status` for another status, or raises an :class:`~llmgw.errors.APIError`, answered
with its status and code as the control plane's error middleware answers."""

from __future__ import annotations

import json
import ssl
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from click.testing import CliRunner, Result

from llmgw.cli import main
from llmgw.client import Reply, Transport
from llmgw.errors import APIError

SERVER = "http://127.0.0.1:9"
"""The --server every invocation names: nothing listens there, nothing is sent there."""


@dataclass(frozen=True)
class Status:
    """An answer with a status other than 200."""

    status: int
    data: Any = None


@dataclass(frozen=True)
class Sent:
    """A request as the control plane would have received it."""

    method: str
    path: str
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[str, str, Any], Any]


class FakeAPI(Transport):
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sent: list[Sent] = []
        self.requests: list[str] = []
        """"METHOD path" of each request, in order."""
        self.calls: list[tuple[str, str, Any]] = []
        """(method, path, body) of each request, in order."""

    def send(
        self, request: urllib.request.Request, *, timeout: float, context: ssl.SSLContext | None
    ) -> Reply:
        url = urllib.parse.urlsplit(request.full_url)
        path = url.path + (f"?{url.query}" if url.query else "")
        data = request.data
        body = json.loads(data) if isinstance(data, bytes) and data else None
        self.sent.append(Sent(request.get_method(), path, body, dict(request.header_items())))
        self.requests.append(f"{request.get_method()} {path}")
        self.calls.append((request.get_method(), path, body))
        try:
            answer = self.handler(request.get_method(), path, body)
        except APIError as exc:
            error = {"error": {"message": str(exc), "code": exc.code}}
            return Reply(exc.status, json.dumps(error).encode(), "error")
        if isinstance(answer, Status):
            status, data_out = answer.status, answer.data
        else:
            status, data_out = 200, answer
        return Reply(status, b"" if data_out is None else json.dumps(data_out).encode(), "")

    def ctl(
        self,
        *args: str,
        stdin: str | None = None,
        env: Mapping[str, str | None] | None = None,
        server: str = SERVER,
    ) -> Result:
        """``llmgw ctl ARGS`` against this API (``server``: the --server it names)."""
        return CliRunner().invoke(
            main, ["ctl", "--server", server, *args], input=stdin, env=env, obj=self
        )
