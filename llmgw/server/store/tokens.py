"""Join tokens: what a token is, and when one may be spent.

A join token is a one-time secret (``llmgwjt_`` + 43 random characters) that lets one
node join, or rekey, once, before it expires. A rekey token is bound to the node's uid and
spent by a node that still has its state directory (its uid read from there); a *re-pair*
token, a rekey token stored with ``lost_state`` (``join-command --rekey NODE --re-pair``), is
spent by a node whose state
directory is gone, which names its uid itself (``llmgw agent join --node-uid UID``): same
node record, new key, and the node waits for approval by fingerprint again. The store keeps only its hash and its
prefix (:mod:`llmgw.server.store` persists them as :class:`JoinToken` rows); this module makes the secrets,
hashes them, checks what is asked of a new token, and decides, with the message an
operator reads, why a token is refused.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from dataclasses import dataclass, field

from llmgw.contracts.joining import REPAIR_FLAG, JoinOptions, JoinRefused
from llmgw.errors import Conflict, TokenError
from llmgw.netaddr import validate_node_id
from llmgw.server.store.states import NodeState, TokenKind

__all__ = [
    "JOIN_TOKEN_PREFIX",
    "PREFIX_LENGTH",
    "JoinToken",
    "check_kind",
    "check_new",
    "check_rekey",
    "check_revocable",
    "check_use",
    "hash_secret",
    "new_secret",
    "unknown_refusal",
    "used_refusal",
]

JOIN_TOKEN_PREFIX = "llmgwjt_"
PREFIX_LENGTH = len(JOIN_TOKEN_PREFIX) + 6
"""Characters of the secret kept in clear, to name a token by (``llmgwjt_`` + 6)."""


@dataclass(frozen=True)
class JoinToken:
    """A one-time token that lets one node join (or rekey); only its hash is stored.

    ``as_of`` is the store's clock when the row was read; :attr:`active` is judged at it.
    """

    id: str
    hash: str
    prefix: str
    node_id: str
    kind: TokenKind
    node_uid: str | None
    require_approval: bool
    created_at: float
    expires_at: float
    used_at: float | None
    revoked_at: float | None
    lost_state: bool = False
    auto_approve: bool = False
    approved_fingerprint: str | None = None
    as_of: float = field(default=0.0, compare=False, repr=False)

    @property
    def used(self) -> bool:
        return self.used_at is not None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def expired(self) -> bool:
        return self.expires_at <= self.as_of

    @property
    def active(self) -> bool:
        """Neither used, nor revoked, nor expired when it was read."""
        return not (self.used or self.revoked or self.expired)


def new_secret() -> str:
    """A fresh token secret, shown once to the operator and never stored."""
    return JOIN_TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of a secret, as stored and looked up."""
    # surrogatepass: a secret that came out of JSON may hold lone surrogates; it matches nothing.
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def check_kind(kind: str) -> TokenKind:
    """*kind* as a :class:`TokenKind`; ValueError names the kinds there are."""
    try:
        return TokenKind(kind)
    except ValueError:
        raise ValueError(f"{kind!r} is not a join token kind; use 'join' or 'rekey'") from None


def check_new(
    node_id: str,
    *,
    kind: str,
    ttl: float,
    node_uid: str | None,
    lost_state: bool = False,
    require_approval: bool = False,
    auto_approve: bool = False,
) -> TokenKind:
    """Refuse (ValueError) a token that could never be spent: a rekey token binds the
    node's current uid, a join token none; a re-pair token is a rekey token that needs
    approval again; an auto-approve token is a fresh join's only (trust on first use of a
    new machine, never a key swapped under a known node's name); the ttl is a positive
    number of seconds."""
    validate_node_id(node_id)
    token_kind = check_kind(kind)
    if lost_state and token_kind != TokenKind.REKEY:
        raise ValueError("lost_state goes with rekey tokens only (a join needs no old key)")
    try:
        JoinOptions.of_flags(
            node=node_id,
            rekey=token_kind == TokenKind.REKEY,
            re_pair=lost_state,
            auto_approve=auto_approve,
            # A join token needs approval whatever it says; only the contradiction counts.
            require_approval=require_approval and (token_kind == TokenKind.REKEY or auto_approve),
        ).check()
    except JoinRefused as exc:
        raise ValueError(str(exc)) from None
    if lost_state and not require_approval:
        raise ValueError(
            "a re-pair token needs require_approval: the node's new key is approved "
            "by its fingerprint again"
        )
    if token_kind == TokenKind.REKEY and not node_uid:
        raise ValueError(f"a rekey token for {node_id} needs the node's uid (node_uid)")
    if token_kind == TokenKind.JOIN and node_uid is not None:
        raise ValueError("node_uid binds rekey tokens only; leave it out for a join token")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf:
        raise ValueError(f"a join token's ttl must be a positive number of seconds, not {ttl!r}")
    return token_kind


def check_use(
    token: JoinToken, *, node_id: str, kind: str, node_uid: str | None, lost_state: bool = False
) -> None:
    """Raise the TokenError that refuses *token* for a *kind* of *node_id* (a rekey by a node
    that lost its state directory with *lost_state*), if any. A lost-state token spent by a
    node that still has its state is not refused: it shows more than the token asks."""
    if token.revoked_at is not None:
        raise TokenError(
            f"{token.kind} token {token.id} for {token.node_id} was revoked at "
            f"{_when(token.revoked_at)}; {_mint_hint(token)}",
            code="token_revoked",
        )
    if token.used_at is not None:
        raise used_refusal(token, token.used_at)
    if token.expired:
        ago = token.as_of - token.expires_at
        raise TokenError(
            f"{token.kind} token {token.id} for {token.node_id} expired at "
            f"{_when(token.expires_at)} ({_ago(ago)} ago); {_mint_hint(token)}",
            code="token_expired",
        )
    if token.node_id != node_id:
        raise TokenError(
            f"{token.kind} token {token.id} is for node {token.node_id}, not {node_id}; join as "
            f"{token.node_id} (--node-id {token.node_id}), or mint a token for {node_id} with "
            f"'llmgw ctl join-command --node {node_id}'",
            code="token_wrong_node",
        )
    if token.kind != kind:
        if token.kind == TokenKind.REKEY:
            message = f"this is a rekey token for {token.node_id}; run 'llmgw agent join --rekey'"
        elif lost_state:
            message = (
                f"this is a join token for {token.node_id}; --node-uid re-pairs a node with a "
                f"re-pair token: 'llmgw ctl join-command --rekey {token.node_id} {REPAIR_FLAG}'"
            )
        else:
            message = (
                f"this is a join token for {token.node_id}, not a rekey token; run "
                "'llmgw agent join' without --rekey"
            )
        raise TokenError(message, code="token_wrong_kind")
    if kind == TokenKind.REKEY and lost_state and not token.lost_state:
        raise TokenError(
            f"rekey token {token.id} for {token.node_id} needs the node's old identity (its "
            "state directory), which this node does not have; for a node whose state directory "
            f"is gone mint 'llmgw ctl join-command --rekey {token.node_id} {REPAIR_FLAG}'",
            code="token_needs_old_key",
        )
    if kind == TokenKind.REKEY and token.node_uid != node_uid:
        if lost_state:
            raise TokenError(
                f"rekey token {token.id} re-pairs {token.node_id} with uid {token.node_uid}, "
                f"not {node_uid or '(none)'}; give --node-uid {token.node_uid} as printed by "
                f"'llmgw ctl join-command --rekey NODE {REPAIR_FLAG}'",
                code="node_uid_mismatch",
            )
        raise TokenError(
            f"rekey token {token.id} is bound to {token.node_id} with uid {token.node_uid}, but "
            f"this node has uid {node_uid or '(none)'}; the node joined afresh since the token "
            f"was minted; {_mint_hint(token)}",
            code="node_uid_mismatch",
        )


def check_rekey(
    node_id: str, *, state: NodeState | None, uid: str | None, node_uid: str | None
) -> None:
    """Raise the TokenError that refuses a rekey of *node_id*, known here in *state* with
    *uid* (None: not known), claimed by a node with uid *node_uid*, if any."""
    if state is None:
        raise TokenError(
            f"node {node_id} is not known here (it was deleted); join it afresh with "
            f"'llmgw ctl join-command --node {node_id}'",
            code="node_unknown",
        )
    if state == NodeState.REVOKED:
        raise TokenError(
            f"node {node_id} is revoked; a revoked node can come back only through a "
            f"fresh join: 'llmgw ctl join-command --node {node_id}'",
            code="node_revoked",
        )
    if node_uid is None or uid != node_uid:
        raise TokenError(
            f"node {node_id} has uid {uid}, not {node_uid or '(none)'}: it joined "
            "afresh since this node last got a certificate; join this machine afresh "
            f"with 'llmgw ctl join-command --node {node_id}'",
            code="node_uid_mismatch",
        )


def check_revocable(token: JoinToken) -> None:
    """Refuse (Conflict) revoking a token already revoked, or already spent."""
    if token.revoked_at is not None:
        raise Conflict(
            f"join token {token.id} for {token.node_id} is already revoked "
            f"(at {_when(token.revoked_at)}); nothing to do"
        )
    if token.used_at is not None:
        raise Conflict(
            f"join token {token.id} for {token.node_id} is already used "
            f"(at {_when(token.used_at)}); to shut the node out, run "
            f"'llmgw ctl revoke {token.node_id}'"
        )


def unknown_refusal(node_id: str) -> TokenError:
    """The refusal of a secret that is no token's."""
    return TokenError(
        f"no such join token; mint one with 'llmgw ctl join-command --node {node_id or 'NODE'}'",
        code="token_unknown",
    )


def used_refusal(token: JoinToken, used_at: float | None) -> TokenError:
    """The refusal of a token spent already (at *used_at*, when known)."""
    when = f" at {_when(used_at)}" if used_at is not None else ""
    return TokenError(
        f"{token.kind} token {token.id} for {token.node_id} was already used{when}; a token "
        f"works once; {_mint_hint(token)}",
        code="token_used",
    )


def _mint_hint(token: JoinToken) -> str:
    if token.lost_state:
        return f"mint a new one with 'llmgw ctl join-command --rekey {token.node_id} {REPAIR_FLAG}'"
    if token.kind == TokenKind.REKEY:
        return (
            f"mint a new rekey token for {token.node_id}, or join it afresh with "
            f"'llmgw ctl join-command --node {token.node_id}'"
        )
    return f"mint a new one with 'llmgw ctl join-command --node {token.node_id}'"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"
