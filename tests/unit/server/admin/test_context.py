"""llmgw.server.admin.context.guarded: the admin token, and each error answered as JSON."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from llmgw.bodies import BodiesBusy, BodyIncomplete, BodyTimeout, BodyTooLarge
from llmgw.errors import ConfigError, Conflict, LlmgwError, NotFound, PasswordError
from llmgw.server.admin.context import AdminContext, BadRequest, guarded

TOKEN = "admin-secret"
# No login token resolves: a token that is not the admin token is nobody's.
NO_LOGINS = SimpleNamespace(resolve=lambda token, kind: None)
CTX = cast(
    AdminContext,
    SimpleNamespace(admin_token=TOKEN, admin_token_file=Path("/s/token"), logins=NO_LOGINS),
)


def _answer(error: BaseException, *, token: str = TOKEN) -> tuple[int, dict[str, str]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise error

    async def scenario() -> web.Response:
        request = make_mocked_request(
            "POST", "/api/things", headers={"Authorization": f"Bearer {token}"}
        )
        response = await guarded(CTX, handler)(request)
        assert isinstance(response, web.Response)
        return response

    response = asyncio.run(scenario())
    assert response.body is not None
    body = json.loads(cast(bytes, response.body))
    return response.status, body["error"]


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (BadRequest("not JSON"), 400, "bad_request"),
        (ConfigError("port 99999 is out of range"), 400, "bad_request"),
        (BodiesBusy(1024), 503, "overloaded"),
        (BodyIncomplete("cut short"), 400, "incomplete_body"),
        (BodyTimeout(10.0), 408, "body_timeout"),
        (PasswordError("wrong password"), 403, "wrong_password"),
        (NotFound("no model m1"), 404, "not_found"),
        (Conflict("node n1 is revoked"), 409, "conflict"),
        (LlmgwError("something else"), 500, "server_error"),
    ],
)
def test_each_error_has_its_status_and_code(error: LlmgwError, status: int, code: str) -> None:
    assert _answer(error) == (status, {"message": str(error), "code": code})


def test_a_body_too_large_says_to_split_the_change() -> None:
    status, error = _answer(BodyTooLarge(1024, 4096))
    assert (status, error["code"]) == (413, "request_too_large")
    assert "for the admin API; split the change" in error["message"]


def test_a_wrong_token_is_refused_before_the_handler() -> None:
    status, error = _answer(RuntimeError("the handler must not run"), token="guess")
    assert (status, error["code"]) == (401, "unauthorized")
    assert "/s/token" in error["message"]
