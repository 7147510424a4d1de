"""What lets a client or a node in, as stored: API keys (for the gateway), join tokens
(for a node's first certificate, or a new one) and the certificates issued to nodes (for
the deny list). Secrets are never stored, only their hashes."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.errors import Conflict, NotFound
from llmgw.server.store import tokens
from llmgw.server.store.database import Database
from llmgw.server.store.rows import ApiKey, Certificate, join_token_from_row, policy_columns
from llmgw.server.store.states import TokenKind
from llmgw.server.store.tokens import JoinToken

__all__ = ["API_KEY_PREFIX", "ApiKeys", "Certificates", "JoinTokens", "hash_api_key"]

API_KEY_PREFIX = "sk-llmgw-"
_NO_POLICY = KeyPolicy()


def hash_api_key(secret: str) -> str:
    """The hex SHA-256 of an API key secret, as stored and as the gateway caches it."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class ApiKeys:
    """The gateway's API keys: a secret shown once, its hash kept, its policy beside it;
    revoked but never deleted. Among the active keys a name names one key (new keys are
    refused a name an active key has), so that an operator may call a key by its name."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_api_key(self, name: str, policy: KeyPolicy = _NO_POLICY) -> tuple[ApiKey, str]:
        """Make a key with *policy*; return its row and the secret, which is shown once and
        never stored. Refused (:class:`Conflict`) when an active key has this *name*."""
        secret = API_KEY_PREFIX + secrets.token_urlsafe(32)
        with self._db.write():
            taken = self._active_named(name)
            if taken:
                raise Conflict(
                    f"an active API key is named {name} already ({', '.join(taken)}); choose "
                    f"another name, or revoke that key first ('llmgw ctl keys revoke "
                    f"{taken[0]}') if this one replaces it"
                )
            key_id = self._db.unused_id("api_keys", lambda: secrets.token_hex(6))
            now = self._db.clock()
            columns = {
                "id": key_id,
                "name": name,
                "prefix": secret[:12],
                "hash": hash_api_key(secret),
                "created_at": now,
                "updated_at": now,
                **policy_columns(policy),
            }
            self._db.execute(
                f"INSERT INTO api_keys({', '.join(columns)}) "
                f"VALUES ({', '.join('?' for _ in columns)})",
                tuple(columns.values()),
            )
            row = self._db.one("SELECT * FROM api_keys WHERE id = ?", (key_id,))
        assert row is not None
        return ApiKey.from_row(row), secret

    def get_api_key(self, key: str, *, prefer_active: bool = False) -> ApiKey:
        """The key *key* names: its id; else the only key with this prefix; else the only
        active key with this name (the only key with it when none is active).

        With *prefer_active*, a prefix shared by several keys names the one unrevoked among them.
        """
        row = self._db.one("SELECT * FROM api_keys WHERE id = ?", (key,))
        if row is not None:
            return ApiKey.from_row(row)
        rows = self._db.all("SELECT * FROM api_keys WHERE prefix = ?", (key,))
        if prefer_active and len(rows) > 1:
            active = [r for r in rows if r["revoked_at"] is None]
            rows = active or rows
        if len(rows) > 1:
            raise Conflict(
                f"{len(rows)} API keys have prefix {key} "
                f"({', '.join(str(r['id']) for r in rows)}); name the key by its id"
            )
        if rows:
            return ApiKey.from_row(rows[0])
        rows = self._db.all("SELECT * FROM api_keys WHERE name = ? ORDER BY created_at, id", (key,))
        active = [r for r in rows if r["revoked_at"] is None]
        rows = active or rows
        if not rows:
            raise NotFound(
                f"no API key with id, prefix or name {key}; 'llmgw ctl keys list --all' lists them"
            )
        if len(rows) > 1:
            state = "active " if active else "revoked "
            raise Conflict(
                f"{len(rows)} {state}API keys are named {key} "
                f"({', '.join(str(r['id']) for r in rows)}); name the key by its id"
            )
        return ApiKey.from_row(rows[0])

    def list_api_keys(self, include_revoked: bool = False) -> list[ApiKey]:
        sql = "SELECT * FROM api_keys"
        if not include_revoked:
            sql += " WHERE revoked_at IS NULL"
        sql += " ORDER BY created_at, id"
        return [ApiKey.from_row(r) for r in self._db.all(sql)]

    def active_api_keys(self) -> list[ApiKey]:
        """Every unrevoked key with its hash and policy (expired ones included: the gateway
        says why it refuses them), oldest first: what the gateway's cache loads."""
        return self.list_api_keys(include_revoked=False)

    def update_api_key(self, key: str, policy: KeyPolicy) -> ApiKey:
        """Give the key *key* names (id, prefix or name, as :meth:`get_api_key`) *policy*;
        return its row. A revoked key is refused (:class:`Conflict`): it stays revoked."""
        with self._db.write():
            found = self.get_api_key(key, prefer_active=True)
            if found.revoked:
                raise Conflict(
                    f"API key {found.id} ({found.name}) is revoked, and a revoked key stays "
                    f"revoked; create a new one instead ('llmgw ctl keys create {found.name}')"
                )
            columns = {**policy_columns(policy), "updated_at": self._db.clock()}
            self._db.execute(
                f"UPDATE api_keys SET {', '.join(f'{c} = ?' for c in columns)} WHERE id = ?",
                (*columns.values(), found.id),
            )
            return self.get_api_key(found.id)

    def revoke_api_key(self, key: str) -> ApiKey:
        """Revoke a key by id, unique prefix or name; return the revoked row."""
        with self._db.write():
            found = self.get_api_key(key, prefer_active=True)
            if found.revoked:
                raise Conflict(
                    f"API key {found.id} ({found.name}) is already revoked; "
                    "'llmgw ctl keys list' lists the active ones"
                )
            self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ?", (self._db.clock(), found.id)
            )
            return self.get_api_key(found.id)

    def verify_api_key(self, secret: str) -> ApiKey | None:
        """The active key whose secret this is, or None."""
        row = self._db.one(
            "SELECT * FROM api_keys WHERE hash = ? AND revoked_at IS NULL",
            (hash_api_key(secret),),
        )
        return None if row is None else ApiKey.from_row(row)

    def active_key_hashes(self) -> set[str]:
        """Hashes of all unrevoked keys (whether a secret kept on disk still works)."""
        rows = self._db.all("SELECT hash FROM api_keys WHERE revoked_at IS NULL")
        return {str(r["hash"]) for r in rows}

    def _active_named(self, name: str) -> list[str]:
        rows = self._db.all(
            "SELECT id FROM api_keys WHERE name = ? AND revoked_at IS NULL ORDER BY created_at, id",
            (name,),
        )
        return [str(r["id"]) for r in rows]


class JoinTokens:
    """The join tokens minted; :mod:`llmgw.server.store.tokens` says what they are and when one
    may be spent."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_join_token(
        self,
        node_id: str,
        *,
        kind: str = TokenKind.JOIN,
        ttl: float,
        node_uid: str | None = None,
        require_approval: bool = False,
        lost_state: bool = False,
        auto_approve: bool = False,
    ) -> tuple[JoinToken, str]:
        """Mint a one-time token for *node_id*, valid *ttl* seconds; return its row and the
        secret, which is shown once and stored only as a hash.

        A ``rekey`` token is bound to the node's current uid (*node_uid*); with
        *require_approval* the rekeyed node goes back to pending. A *lost_state* rekey token
        is spent without the old identity (it needs *require_approval*). An *auto_approve*
        join token approves the node that spends it (:meth:`record_auto_approval`).
        """
        token_kind = tokens.check_new(
            node_id,
            kind=kind,
            ttl=ttl,
            node_uid=node_uid,
            lost_state=lost_state,
            require_approval=require_approval,
            auto_approve=auto_approve,
        )
        secret = tokens.new_secret()
        now = self._db.clock()
        with self._db.write():
            token_id = self._db.unused_id("join_tokens", lambda: secrets.token_hex(4))
            self._db.execute(
                "INSERT INTO join_tokens(id, hash, prefix, node_id, kind, node_uid, "
                "require_approval, created_at, expires_at, lost_state, auto_approve) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    token_id,
                    tokens.hash_secret(secret),
                    secret[: tokens.PREFIX_LENGTH],
                    node_id,
                    token_kind,
                    node_uid,
                    int(require_approval),
                    now,
                    now + float(ttl),
                    int(lost_state),
                    int(auto_approve),
                ),
            )
            row = self._db.one("SELECT * FROM join_tokens WHERE id = ?", (token_id,))
        assert row is not None
        return join_token_from_row(row, now), secret

    def list_join_tokens(self, include_inactive: bool = False) -> list[JoinToken]:
        """Tokens still usable, oldest first; with *include_inactive* also used, revoked and
        expired ones."""
        now = self._db.clock()
        sql = "SELECT * FROM join_tokens"
        params: tuple[Any, ...] = ()
        if not include_inactive:
            sql += " WHERE used_at IS NULL AND revoked_at IS NULL AND expires_at > ?"
            params = (now,)
        sql += " ORDER BY created_at, id"
        return [join_token_from_row(r, now) for r in self._db.all(sql, params)]

    def get_join_token(self, id_or_prefix: str) -> JoinToken:
        """The token with this id, or the only one with this prefix (``llmgwjt_`` + 6)."""
        now = self._db.clock()
        row = self._db.one("SELECT * FROM join_tokens WHERE id = ?", (id_or_prefix,))
        if row is not None:
            return join_token_from_row(row, now)
        rows = self._db.all("SELECT * FROM join_tokens WHERE prefix = ?", (id_or_prefix,))
        if not rows:
            raise NotFound(
                f"no join token with id or prefix {id_or_prefix}; mint one with "
                "'llmgw ctl join-command --node NODE'"
            )
        if len(rows) > 1:
            raise Conflict(
                f"{len(rows)} join tokens have prefix {id_or_prefix}; name the token by its id"
            )
        return join_token_from_row(rows[0], now)

    def revoke_join_token(self, id_or_prefix: str) -> JoinToken:
        """Revoke an unused token by id or prefix; return the revoked row."""
        with self._db.write():
            token = self.get_join_token(id_or_prefix)
            tokens.check_revocable(token)
            self._db.execute(
                "UPDATE join_tokens SET revoked_at = ? WHERE id = ?", (self._db.clock(), token.id)
            )
            return self.get_join_token(token.id)

    def record_auto_approval(self, token_id: str, fingerprint: str) -> None:
        """Keep on an auto-approve token the key of the node it approved (its listing shows
        which machine was trusted on first use)."""
        with self._db.write():
            cur = self._db.execute(
                "UPDATE join_tokens SET approved_fingerprint = ? "
                "WHERE id = ? AND auto_approve = 1 AND approved_fingerprint IS NULL",
                (fingerprint, token_id),
            )
            if cur.rowcount != 1:
                raise Conflict(
                    f"join token {token_id} is not an unspent auto-approve token; nothing was "
                    "approved by it"
                )

    def consume_join_token(
        self,
        secret: str,
        *,
        node_id: str,
        kind: str,
        node_uid: str | None,
        lost_state: bool = False,
    ) -> JoinToken:
        """Check the token *secret* for a *kind* (``join``/``rekey``; with *lost_state* a
        rekey by a node without its old identity) of *node_id* and mark it used, atomically: of two racing consumers exactly one wins. Raises
        :class:`~llmgw.errors.TokenError`; inside :meth:`Store.transaction` the use is undone
        if the transaction rolls back."""
        tokens.check_kind(kind)
        with self._db.write():
            now = self._db.clock()
            row = self._db.one(
                "SELECT * FROM join_tokens WHERE hash = ?", (tokens.hash_secret(secret),)
            )
            if row is None:
                raise tokens.unknown_refusal(node_id)
            token = join_token_from_row(row, now)
            tokens.check_use(
                token, node_id=node_id, kind=kind, node_uid=node_uid, lost_state=lost_state
            )
            cur = self._db.execute(
                "UPDATE join_tokens SET used_at = ? "
                "WHERE id = ? AND used_at IS NULL AND revoked_at IS NULL",
                (now, token.id),
            )
            if cur.rowcount != 1:
                # Someone else got there between our read and this write.
                row = self._db.one("SELECT * FROM join_tokens WHERE id = ?", (token.id,))
                assert row is not None
                tokens.check_use(
                    join_token_from_row(row, now),
                    node_id=node_id,
                    kind=kind,
                    node_uid=node_uid,
                    lost_state=lost_state,
                )
                raise tokens.used_refusal(token, now)
            row = self._db.one("SELECT * FROM join_tokens WHERE id = ?", (token.id,))
            assert row is not None
            return join_token_from_row(row, now)


class Certificates:
    """The certificates issued to nodes, kept after a node is deleted so that the serials
    of a removed node stay refused."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_certificate(
        self,
        serial: str,
        *,
        node_id: str,
        fingerprint: str,
        not_before: float,
        not_after: float,
    ) -> Certificate:
        """Record a certificate issued to *node_id*; *serial* is hex (stored lowercase)."""
        serial = _normal_serial(serial)
        with self._db.write():
            self._db.execute(
                "INSERT INTO certificates(serial, node_id, fingerprint, not_before, not_after, "
                "issued_at, seq) VALUES (?, ?, ?, ?, ?, ?, "
                "(SELECT COALESCE(MAX(seq), 0) + 1 FROM certificates))",
                (serial, node_id, fingerprint, not_before, not_after, self._db.clock()),
            )
            row = self._db.one("SELECT * FROM certificates WHERE serial = ?", (serial,))
        assert row is not None
        return Certificate.from_row(row)

    def latest_certificate(self, node_id: str) -> Certificate | None:
        """The node's newest unrevoked certificate, or None."""
        row = self._db.one(
            "SELECT * FROM certificates WHERE node_id = ? AND revoked_at IS NULL "
            "ORDER BY issued_at DESC, seq DESC LIMIT 1",
            (node_id,),
        )
        return None if row is None else Certificate.from_row(row)

    def latest_certificates(self) -> dict[str, Certificate]:
        """Each node's newest unrevoked certificate (:meth:`latest_certificate` of every
        node, in one query), by node id; nodes without one are absent."""
        latest: dict[str, Certificate] = {}
        for row in self._db.all(
            "SELECT * FROM certificates WHERE revoked_at IS NULL ORDER BY node_id, issued_at, seq"
        ):
            cert = Certificate.from_row(row)
            latest[cert.node_id] = cert
        return latest

    def list_certificates(self, node_id: str | None = None) -> list[Certificate]:
        """Every certificate recorded (of *node_id*), oldest first, revoked ones included."""
        if node_id is None:
            rows = self._db.all("SELECT * FROM certificates ORDER BY issued_at, seq")
        else:
            rows = self._db.all(
                "SELECT * FROM certificates WHERE node_id = ? ORDER BY issued_at, seq",
                (node_id,),
            )
        return [Certificate.from_row(r) for r in rows]

    def revoke_certificates(
        self, node_id: str, *, reason: str, except_serial: str | None = None
    ) -> list[str]:
        """Revoke every unrevoked certificate of *node_id* but *except_serial*; return their
        serials."""
        keep = None if except_serial is None else _normal_serial(except_serial)
        with self._db.write():
            rows = self._db.all(
                "SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL "
                "ORDER BY issued_at, seq",
                (node_id,),
            )
            serials = [str(r["serial"]) for r in rows if r["serial"] != keep]
            now = self._db.clock()
            self._db.executemany(
                "UPDATE certificates SET revoked_at = ?, reason = ? WHERE serial = ?",
                [(now, reason, serial) for serial in serials],
            )
        return serials

    def is_revoked(self, serial: str) -> bool:
        """True if the certificate with this (hex) serial was revoked; unknown serials are not."""
        row = self._db.one(
            "SELECT 1 FROM certificates WHERE serial = ? AND revoked_at IS NOT NULL",
            (_normal_serial(serial),),
        )
        return row is not None

    def revoked_serials(self) -> set[str]:
        """Serials of every revoked certificate, for the stream's and data plane's deny list."""
        rows = self._db.all("SELECT serial FROM certificates WHERE revoked_at IS NOT NULL")
        return {str(r["serial"]) for r in rows}


def _normal_serial(serial: str) -> str:
    try:
        return format(int(serial, 16), "x")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"certificate serial {serial!r} is not a hex number") from exc
