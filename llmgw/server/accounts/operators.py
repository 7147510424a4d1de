"""Operator accounts: who may log in to the console and what they may do (issue 17).

The first account, ``admin`` (role admin), *is* the admin password of
:mod:`llmgw.server.accounts.passwords`: it is made from that password's hash, and that password's
change (``llmgw ctl admin password``, which needs the old one) writes both in one
transaction, so that there is one secret, not two that drift. Its password is changed only
that way: the admin password is the second secret beside the admin token (it signs updates
and exports the CA), so the token that manages accounts must not be able to reset it. For
the same reason ``admin`` can be neither removed nor demoted. Every change is an event naming
the account (or ``token``) that made it.

An admin account's own password also signs updates (the console's "Update now" asks it
again). So that the admin token alone still cannot sign, every change that gives someone that
power (an admin account added, a viewer promoted, an admin's password set) is confirmed with
the password of whoever makes it (:meth:`OperatorAccounts.confirm`): the admin password for
the admin token, an account's own for an account.

Every such confirmation counts in the logins' lockout (:mod:`llmgw.server.accounts.lockout`), against
the confirming account and the source address, so that it cannot be guessed at more than a
login can.

A removal, a role change or a password change ends the account's login sessions
(:mod:`llmgw.server.accounts.logins`) in the change's own transaction: a stolen cookie does not
outlive the password it was made with, and a session never carries a role the account no
longer has. A password changed through one of the account's own sessions keeps that one.
"""

from __future__ import annotations

import asyncio
import functools

from llmgw.errors import Conflict, PasswordError, WeakPassword
from llmgw.server.accounts.lockout import Lockout
from llmgw.server.accounts.passwords import (
    MIN_PASSWORD,
    PASSWORD_META,
    AdminPassword,
    check_password,
    hash_password,
)
from llmgw.server.store import Operator, Store, hash_session_token

__all__ = ["FIRST_ADMIN", "OperatorAccounts"]

FIRST_ADMIN = "admin"
"""The account that is the admin password."""


@functools.cache
def _dummy_hash() -> str:
    """Checked against when the name is unknown, so that a miss costs what a hit does."""
    return hash_password("llmgw-no-such-operator")


class OperatorAccounts:
    """The operator accounts of one control plane, over ``store``."""

    def __init__(
        self,
        store: Store,
        admin_password: AdminPassword | None = None,
        *,
        lockout: Lockout | None = None,
    ) -> None:
        self.store = store
        # Checks ``admin``'s password with the message that says where it was first written.
        self.admin_password = admin_password
        if lockout is None:  # the admin password's, else the default limits: never none
            if admin_password is not None:
                lockout = admin_password.lockout
            else:
                lockout = Lockout(store)
        self.lockout = lockout

    async def confirm(self, name: str, password: object, *, refused: str, source: str = "") -> None:
        """PasswordError unless *password* is the password of the account *name* (who is
        acting: ``admin`` for the admin token); *refused* says what was not done. Counted
        against *name* and *source* (the client's address): while either is locked,
        :class:`~llmgw.server.accounts.lockout.LoginThrottled` whatever the password."""
        if name == FIRST_ADMIN and self.admin_password is not None:
            await self.admin_password.check(password, refused=refused, source=source)
            return
        if not isinstance(password, str) or not password:
            self.lockout.refuse_if_locked(name, source)
            found = None
        else:
            found = await self.lockout.check(
                name,
                source,
                lambda: self.verify(name, password),
                what=f"a password confirmation ({refused})",
            )
        if found is None:
            raise PasswordError(
                f"wrong password for the account {name!r}; {refused}. Give your own account's "
                "password (the admin password when acting with the admin token)"
            )

    def ensure_first_admin(self) -> Operator | None:
        """Make ``admin`` from the admin password's hash when the store has no account yet
        (a new store, or one from before accounts); after :meth:`AdminPassword.start`."""
        stored = self.store.get_meta(PASSWORD_META)
        if not stored:
            return None
        with self.store.transaction():
            if self.store.count_operators():
                return None
            made = self.store.add_operator(FIRST_ADMIN, "admin", stored, "control-plane")
            self.store.add_event(
                "operator_added", FIRST_ADMIN, "first admin account, from the admin password"
            )
        return made

    async def verify(self, name: object, password: object) -> Operator | None:
        """The active account *name* when *password* is its password, else None. An
        unknown name is checked against a dummy hash: the answer takes as long either way."""
        found = self.store.find_operator(name) if isinstance(name, str) else None
        stored = found.password_hash if found is not None else _dummy_hash()
        given = password if isinstance(password, str) else ""
        ok = await asyncio.to_thread(check_password, stored, given)
        return found if ok and found is not None and bool(given) else None

    async def add(
        self,
        name: str,
        role: str,
        password: object,
        *,
        actor: str,
        confirm_as: str = "",
        confirm_password: object = None,
        source: str = "",
    ) -> Operator:
        """Add an account; one with role admin can sign updates, so *confirm_password* must
        be the password of *confirm_as* (the acting account, ``admin`` for the token), from
        *source* (the client's address)."""
        if name == FIRST_ADMIN:  # always there: never removed (see remove)
            raise Conflict(
                f"operator {FIRST_ADMIN!r} exists already: it is the admin password's account; "
                "change that password with 'llmgw ctl admin password'"
            )
        stored = await _hashed(password)
        if role == "admin":
            await self._confirm_grant(
                confirm_as, confirm_password, f"{name!r} was not added", source
            )
        with self.store.transaction():
            made = self.store.add_operator(name, role, stored, actor)
            self.store.add_event("operator_added", name, f"role {role}", actor)
        return made

    async def set_password(
        self,
        name: str,
        password: object,
        *,
        actor: str,
        confirm_as: str = "",
        confirm_password: object = None,
        keep_session: str | None = None,
        source: str = "",
    ) -> Operator:
        """Change *name*'s password (not ``admin``'s: that is the admin password, changed
        with its old one by :meth:`AdminPassword.change`); its sessions end, but for the
        one whose token is *keep_session* (the session the change was made through)."""
        return await self.update(
            name,
            password=password,
            actor=actor,
            confirm_as=confirm_as,
            confirm_password=confirm_password,
            keep_session=keep_session,
            source=source,
        )

    async def set_role(
        self,
        name: str,
        role: str,
        *,
        actor: str,
        confirm_as: str = "",
        confirm_password: object = None,
        source: str = "",
    ) -> Operator:
        return await self.update(
            name,
            role=role,
            actor=actor,
            confirm_as=confirm_as,
            confirm_password=confirm_password,
            source=source,
        )

    async def update(
        self,
        name: str,
        *,
        role: str | None = None,
        password: object = None,
        actor: str,
        confirm_as: str = "",
        confirm_password: object = None,
        keep_session: str | None = None,
        source: str = "",
    ) -> Operator:
        """Change *name*'s role, password or both, all or nothing (the password is checked
        before anything is written). Making an admin (a promotion, or a new password for an
        admin account) is confirmed with *confirm_as*'s *confirm_password*. A new role ends
        all of *name*'s sessions; a new password all but *keep_session*'s."""
        current = self.store.get_operator(name)  # an unknown name is the first thing to say
        if password is not None and name == FIRST_ADMIN:
            raise Conflict(_ADMIN_PASSWORD_ONLY)
        stored = None if password is None else await _hashed(password)
        promoted = role == "admin" and current.role != "admin"
        new_admin_password = stored is not None and (role or current.role) == "admin"
        if promoted or new_admin_password:
            what = "promoted" if promoted else "given a new password"
            await self._confirm_grant(
                confirm_as, confirm_password, f"{name!r} was not {what}", source
            )
        with self.store.transaction():
            changed = self.store.get_operator(name)
            if role is not None:
                changed = self._set_role(name, role, actor)
            if stored is not None:
                changed = self.store.set_operator_password(name, stored)
                keep = None if keep_session is None else hash_session_token(keep_session)
                self.store.delete_login_sessions_of(changed.id, keep=keep)
                self.store.add_event("operator_password_changed", name, "password changed", actor)
        return changed

    async def _confirm_grant(
        self, account: str, password: object, refused: str, source: str
    ) -> None:
        """An admin account can sign updates: making one is confirmed like a signing."""
        if not account or password is None or password == "":
            if account:  # a locked account answers as locked, password or none
                self.lockout.refuse_if_locked(account, source)
            raise PasswordError(
                f"{refused}: an admin account can sign updates, so making one needs your own "
                "password (the admin password when acting with the admin token); give it at "
                "the prompt or in LLMGW_ADMIN_PASSWORD"
            )
        await self.confirm(account, password, refused=refused, source=source)

    def _set_role(self, name: str, role: str, actor: str) -> Operator:
        current = self.store.get_operator(name)
        if name == FIRST_ADMIN and role != "admin":
            raise Conflict(_FIRST_ADMIN_STAYS.format(what="demoted"))
        changed = self.store.set_operator_role(name, role)
        if current.role != role:
            self.store.delete_login_sessions_of(current.id)
            self.store.add_event("operator_role_changed", name, f"{current.role} -> {role}", actor)
        return changed

    def remove(self, name: str, *, actor: str) -> Operator:
        with self.store.transaction():
            self.store.get_operator(name)
            if name == FIRST_ADMIN:
                raise Conflict(_FIRST_ADMIN_STAYS.format(what="removed"))
            removed = self.store.remove_operator(name)
            self.store.delete_login_sessions_of(removed.id)
            self.store.add_event("operator_removed", name, "removed", actor)
        return removed


_FIRST_ADMIN_STAYS = (
    f"{FIRST_ADMIN!r} cannot be {{what}}: its password is the admin password, which signs "
    "updates and exports the CA; change that password with 'llmgw ctl admin password'"
)
_ADMIN_PASSWORD_ONLY = (
    f"the password of {FIRST_ADMIN!r} is the admin password, the second secret beside the "
    "admin token, so it is not changed through the accounts; change it with 'llmgw ctl admin "
    "password', which asks for the current one"
)


async def _hashed(password: object) -> str:
    if not isinstance(password, str) or len(password) < MIN_PASSWORD:
        raise WeakPassword(
            f"an operator's password must have at least {MIN_PASSWORD} characters; nothing "
            "was changed"
        )
    return await asyncio.to_thread(hash_password, password)
