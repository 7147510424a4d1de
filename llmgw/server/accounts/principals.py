"""Who a request to the admin API or the console acts as: a :class:`Principal`.

Three credentials name one: the shared admin token (``LLMGW_TOKEN``, for automation; it acts
as an admin and events record it as ``token``), an account's own token from ``llmgw ctl
login``, and a console session's cookie. Whatever the credential, a viewer may only read,
and every change is recorded in the events with :attr:`Principal.actor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from aiohttp import web

__all__ = [
    "ADMIN",
    "PRINCIPAL",
    "VIA_CLI",
    "VIA_CONSOLE",
    "VIA_TOKEN",
    "VIEWER",
    "Principal",
    "principal_of",
]

ADMIN: Final = "admin"
VIEWER: Final = "viewer"

VIA_TOKEN: Final = "token"
"""The shared admin token."""
VIA_CLI: Final = "cli"
"""An account's token from ``llmgw ctl login``."""
VIA_CONSOLE: Final = "console"
"""A console session's cookie."""

SHARED_TOKEN_ACTOR: Final = "token"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: an operator account (``name``, ``role``) or the shared admin
    token, and the credential it came with (``via``)."""

    name: str
    role: str
    via: str

    @classmethod
    def shared_token(cls) -> Principal:
        return cls(name=SHARED_TOKEN_ACTOR, role=ADMIN, via=VIA_TOKEN)

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN

    @property
    def actor(self) -> str:
        """What the events record as having acted: the account's name, or ``token``."""
        return SHARED_TOKEN_ACTOR if self.via == VIA_TOKEN else self.name

    @property
    def password_account(self) -> str:
        """The account whose password a password-gated action (signing an update) asks:
        the caller's own, or ``admin``'s (the admin password) for the shared token."""
        return ADMIN if self.via == VIA_TOKEN else self.name


PRINCIPAL: Final = web.RequestKey("llmgw.principal", Principal)
"""The request key under which the admin API's and the console's guards put the principal."""


def principal_of(request: web.Request) -> Principal:
    """The principal a guard put on ``request``; a handler reached without one is a bug."""
    found = request.get(PRINCIPAL)
    if found is None:
        raise RuntimeError(f"{request.path}: no principal on the request; route it through a guard")
    return found
