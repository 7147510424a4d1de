"""The admin password: the second secret, besides the admin token, that signing an update
order (DESIGN §7) and exporting the cluster CA need.

It is made at the first start into ``admin.password`` next to ``admin.token`` (0600) and
kept in the store only as a scrypt hash; the admin token alone cannot update nodes. It is
changed with the old one, after which the first password's file is removed. It is also the
password of the operator account ``admin``, whose login sessions a change ends (but the one
it was made through).

Each check of it counts in the logins' lockout (:mod:`llmgw.server.accounts.lockout`), against the
account ``admin`` and the source address: a guesser holding the admin token, or a stolen
session, gets as few tries at it as at a login.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from llmgw.errors import ConfigError, PasswordError
from llmgw.fsutil import write_private
from llmgw.log import kv
from llmgw.server.accounts.lockout import Lockout
from llmgw.server.store import Store, hash_session_token

__all__ = [
    "MIN_PASSWORD",
    "PASSWORD_FILE",
    "PASSWORD_META",
    "AdminPassword",
    "check_password",
    "hash_password",
]

log = logging.getLogger("llmgw.server.passwords")

PASSWORD_FILE = "admin.password"
ADMIN_ACCOUNT = "admin"
"""The operator account whose password the admin password is (llmgw.server.accounts.operators)."""
PASSWORD_META = "admin_password_hash"
MIN_PASSWORD = 12
# scrypt: 16 MiB and about 50 ms per check: cheap for an operator, dear for a guesser.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """``scrypt$N$r$p$salt$hash`` (base64) of ``password``."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32
    )
    b64 = base64.b64encode
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${b64(salt).decode()}${b64(digest).decode()}"


def check_password(stored: str, password: str) -> bool:
    """Whether ``password`` matches the ``stored`` hash (constant time)."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        got = hashlib.scrypt(
            password.encode(),
            salt=base64.b64decode(salt),
            n=int(n),
            r=int(r),
            p=int(p),
            dklen=len(expected),
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


def _new_password() -> str:
    return "llmgw-pw-" + secrets.token_urlsafe(18)


class AdminPassword:
    """The admin password of one control plane: its hash in ``store``, its first value in
    ``password_file``."""

    def __init__(
        self, store: Store, password_file: Path, *, lockout: Lockout | None = None
    ) -> None:
        self.store = store
        self.password_file = password_file
        if lockout is None:  # the default limits, so that no check is ever unlimited
            lockout = Lockout(store)
        self.lockout = lockout

    def start(self) -> None:
        """Make the admin password at the first start: into admin.password (0600) and, as a
        hash, into the store. A password file left without a hash (a new store) is kept."""
        if self.store.get_meta(PASSWORD_META):
            return
        path = self.password_file
        try:
            password = path.read_text().strip()
        except FileNotFoundError:
            password = ""
        except OSError as exc:
            raise ConfigError(
                f"cannot read the admin password: {exc.strerror}; it must be readable by the "
                "control plane's user",
                file=str(path),
            ) from exc
        if not password:
            password = _new_password()
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, (password + "\n").encode())
        self.store.set_meta(PASSWORD_META, hash_password(password))
        log.info("admin password created", extra=kv(file=str(path)))

    async def check(
        self, password: object, *, refused: str = "nothing was signed", source: str = ""
    ) -> None:
        """PasswordError unless ``password`` is the admin password; ``refused`` says what
        was not done. The check counts against ``admin`` and *source* (the client's address):
        :class:`~llmgw.server.accounts.lockout.LoginThrottled` while either is locked, whatever the
        password."""
        stored = self.store.get_meta(PASSWORD_META) or ""
        if not isinstance(password, str) or not password:
            # No guess to count, but a locked account answers as locked all the same.
            self.lockout.refuse_if_locked(ADMIN_ACCOUNT, source)
            ok = False
        else:
            ok = await self.lockout.check(
                ADMIN_ACCOUNT,
                source,
                lambda: asyncio.to_thread(check_password, stored, password),
                what=f"an admin password confirmation ({refused})",
            )
        if not ok:
            raise PasswordError(
                f"wrong admin password; {refused}. It was made at the control plane's "
                f"first start in {self.password_file} (unless changed since with 'llmgw ctl "
                "admin password'); give it at the prompt or in LLMGW_ADMIN_PASSWORD"
            )

    async def change(
        self,
        old: object,
        new: object,
        *,
        actor: str,
        keep_session: str | None = None,
        source: str = "",
    ) -> None:
        """Change the admin password from *old* to *new* (``actor`` made the change, from
        *source*); the account ``admin``'s login sessions end, but for the one whose token
        is *keep_session* (the session the change was made through, if any)."""
        await self.check(old, refused="nothing was changed", source=source)
        if not isinstance(new, str) or len(new) < MIN_PASSWORD:
            raise PasswordError(
                f"the new admin password must have at least {MIN_PASSWORD} characters; "
                "nothing was changed"
            )
        if new == old:
            raise PasswordError("the new admin password is the old one; nothing was changed")
        stored = await asyncio.to_thread(hash_password, new)
        with self.store.transaction():
            self.store.set_meta(PASSWORD_META, stored)
            # The operator account 'admin' is this password (llmgw.server.accounts.operators).
            account = self.store.find_operator(ADMIN_ACCOUNT)
            if account is not None:
                self.store.set_operator_password(ADMIN_ACCOUNT, stored)
                keep = None if keep_session is None else hash_session_token(keep_session)
                self.store.delete_login_sessions_of(account.id, keep=keep)
        # The first password's file would now mislead (and leak nothing but an old secret).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.password_file)
        self.store.add_event(
            "admin_password_changed", "control-plane", "admin password changed", actor
        )
