"""Tests for the join-token policy: secrets, what a new token may be, and why one is refused.

The same refusals, reached through the store's ``consume_join_token``, are tested in
``tests/unit/server/store/test_credentials.py``."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from llmgw.contracts.joining import refusal
from llmgw.errors import Conflict, TokenError
from llmgw.server.store import tokens
from llmgw.server.store.states import NodeState, TokenKind
from llmgw.server.store.tokens import JoinToken

T0 = 1_700_000_000.0

TOKEN = JoinToken(
    id="ab12cd34",
    hash="h",
    prefix="llmgwjt_abcdef",
    node_id="gpu-1",
    kind=TokenKind.JOIN,
    node_uid=None,
    require_approval=False,
    created_at=T0,
    expires_at=T0 + 60,
    used_at=None,
    revoked_at=None,
    as_of=T0 + 1,
)
REKEY = dataclasses.replace(TOKEN, kind=TokenKind.REKEY, node_uid="u1")


def _refusal(token: JoinToken, node_id: str = "gpu-1", **kw: str | None) -> TokenError:
    kind = str(kw.pop("kind", "join"))
    with pytest.raises(TokenError) as info:
        tokens.check_use(token, node_id=node_id, kind=kind, node_uid=kw.pop("node_uid", None))
    assert info.value.status == 403
    return info.value


def test_a_secret_is_prefixed_random_and_stored_as_its_sha256() -> None:
    a, b = tokens.new_secret(), tokens.new_secret()
    assert a != b and a.startswith(tokens.JOIN_TOKEN_PREFIX) and len(a) == 8 + 43
    assert tokens.hash_secret(a) == hashlib.sha256(a.encode()).hexdigest()
    assert a[: tokens.PREFIX_LENGTH] == a[:14]
    # A lone surrogate (from JSON) hashes without an error, and matches no real secret.
    assert len(tokens.hash_secret("\ud800")) == 64


def test_check_new() -> None:
    assert tokens.check_new("gpu-1", kind="join", ttl=60, node_uid=None) is TokenKind.JOIN
    assert tokens.check_new("gpu-1", kind="rekey", ttl=0.5, node_uid="u") is TokenKind.REKEY
    with pytest.raises(ValueError, match="needs the node's uid"):
        tokens.check_new("gpu-1", kind="rekey", ttl=60, node_uid=None)
    with pytest.raises(ValueError, match="rekey tokens only"):
        tokens.check_new("gpu-1", kind="join", ttl=60, node_uid="u")
    with pytest.raises(ValueError) as info:
        tokens.check_new("gpu-1", kind="renew", ttl=60, node_uid=None)
    assert str(info.value) == "'renew' is not a join token kind; use 'join' or 'rekey'"
    for ttl in (0, -1, True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl must be a positive number of seconds"):
            tokens.check_new("gpu-1", kind="join", ttl=ttl, node_uid=None)
    with pytest.raises(Exception, match="invalid node id"):
        tokens.check_new("Not_A_Node", kind="join", ttl=60, node_uid=None)


def test_an_active_token_of_the_right_node_and_kind_passes() -> None:
    assert TOKEN.active
    tokens.check_use(TOKEN, node_id="gpu-1", kind="join", node_uid=None)
    tokens.check_use(REKEY, node_id="gpu-1", kind="rekey", node_uid="u1")


def test_refusals_in_order_revoked_used_expired() -> None:
    both = dataclasses.replace(TOKEN, revoked_at=T0 + 10, used_at=T0 + 5)
    err = _refusal(both)
    assert (err.code, str(err)) == (
        "token_revoked",
        "join token ab12cd34 for gpu-1 was revoked at 2023-11-14 22:13:30 UTC; mint a new one "
        "with 'llmgw ctl join-command --node gpu-1'",
    )
    err = _refusal(dataclasses.replace(TOKEN, used_at=T0 + 5, as_of=T0 + 120))
    assert err.code == "token_used"
    assert "was already used at 2023-11-14 22:13:25 UTC; a token works once" in str(err)
    for ago, said in ((0, "0s"), (119, "119s"), (120, "2m"), (7200, "2h"), (3 * 86400, "3d")):
        err = _refusal(dataclasses.replace(TOKEN, as_of=T0 + 60 + ago))
        assert err.code == "token_expired"
        assert f"expired at 2023-11-14 22:14:20 UTC ({said} ago)" in str(err)


def test_refusals_wrong_node_kind_and_uid() -> None:
    err = _refusal(TOKEN, "gpu-2")
    assert err.code == "token_wrong_node"
    assert str(err).startswith("join token ab12cd34 is for node gpu-1, not gpu-2; join as gpu-1")
    assert _refusal(REKEY, kind="join").code == "token_wrong_kind"
    assert _refusal(TOKEN, kind="rekey", node_uid="u1").code == "token_wrong_kind"
    err = _refusal(REKEY, kind="rekey", node_uid="u2")
    assert err.code == "node_uid_mismatch"
    assert "mint a new rekey token for gpu-1, or join it afresh" in str(err)


def test_used_and_unknown_refusals() -> None:
    assert tokens.used_refusal(TOKEN, None).code == "token_used"
    assert " already used; a token works once" in str(tokens.used_refusal(TOKEN, None))
    err = tokens.unknown_refusal("")
    assert (err.code, str(err)) == (
        "token_unknown",
        "no such join token; mint one with 'llmgw ctl join-command --node NODE'",
    )


def test_check_rekey() -> None:
    tokens.check_rekey("gpu-1", state=NodeState.APPROVED, uid="u1", node_uid="u1")
    tokens.check_rekey("gpu-1", state=NodeState.PENDING, uid="u1", node_uid="u1")
    cases = (
        (None, None, "u1", "node_unknown"),
        (NodeState.REVOKED, "u1", "u1", "node_revoked"),
        (NodeState.APPROVED, "u1", "u2", "node_uid_mismatch"),
        (NodeState.APPROVED, "u1", None, "node_uid_mismatch"),
    )
    for state, uid, node_uid, code in cases:
        with pytest.raises(TokenError) as info:
            tokens.check_rekey("gpu-1", state=state, uid=uid, node_uid=node_uid)
        assert info.value.code == code


def test_check_revocable() -> None:
    tokens.check_revocable(dataclasses.replace(TOKEN, as_of=T0 + 1000))  # expired: still may
    with pytest.raises(Conflict, match=r"already revoked .*; nothing to do"):
        tokens.check_revocable(dataclasses.replace(TOKEN, revoked_at=T0))
    with pytest.raises(Conflict, match="run 'llmgw ctl revoke gpu-1'"):
        tokens.check_revocable(dataclasses.replace(TOKEN, used_at=T0))


# -- lost-state rekey tokens (a node whose state directory is gone re-pairs by its uid) --------

LOST = dataclasses.replace(REKEY, lost_state=True, require_approval=True)


def test_a_lost_state_token_is_a_rekey_token_that_needs_approval() -> None:
    assert (
        tokens.check_new(
            "gpu-1", kind="rekey", ttl=60, node_uid="u1", lost_state=True, require_approval=True
        )
        is TokenKind.REKEY
    )
    with pytest.raises(ValueError, match="lost_state goes with rekey tokens only"):
        tokens.check_new(
            "gpu-1", kind="join", ttl=60, node_uid=None, lost_state=True, require_approval=True
        )
    with pytest.raises(ValueError, match="needs require_approval"):
        tokens.check_new("gpu-1", kind="rekey", ttl=60, node_uid="u1", lost_state=True)


def test_a_lost_state_token_is_spent_without_the_old_state_and_with_it() -> None:
    tokens.check_use(LOST, node_id="gpu-1", kind="rekey", node_uid="u1", lost_state=True)
    # A node that kept its state shows more than the token asks: not refused.
    tokens.check_use(LOST, node_id="gpu-1", kind="rekey", node_uid="u1", lost_state=False)


def test_a_plain_rekey_token_still_needs_the_old_state() -> None:
    with pytest.raises(TokenError) as info:
        tokens.check_use(REKEY, node_id="gpu-1", kind="rekey", node_uid="u1", lost_state=True)
    assert info.value.code == "token_needs_old_key"
    assert str(info.value) == (
        "rekey token ab12cd34 for gpu-1 needs the node's old identity (its state directory), "
        "which this node does not have; for a node whose state directory is gone mint "
        "'llmgw ctl join-command --rekey gpu-1 --re-pair'"
    )


def test_lost_state_refusals_say_what_to_do() -> None:
    def refusal(token: JoinToken, node_id: str = "gpu-1", **kw: object) -> TokenError:
        with pytest.raises(TokenError) as info:
            tokens.check_use(
                token,
                node_id=node_id,
                kind=str(kw.get("kind", "rekey")),
                node_uid=kw.get("node_uid", "u1"),  # type: ignore[arg-type]
                lost_state=True,
            )
        return info.value

    err = refusal(LOST, node_uid="u2")
    assert err.code == "node_uid_mismatch"
    assert "re-pairs gpu-1 with uid u1, not u2; give --node-uid u1" in str(err)
    assert refusal(LOST, "gpu-2").code == "token_wrong_node"
    err = refusal(dataclasses.replace(LOST, used_at=T0))
    assert err.code == "token_used"
    assert str(err).endswith("mint a new one with 'llmgw ctl join-command --rekey gpu-1 --re-pair'")
    err = refusal(dataclasses.replace(LOST, as_of=T0 + 3600))
    assert err.code == "token_expired"
    assert "'llmgw ctl join-command --rekey gpu-1 --re-pair'" in str(err)
    err = refusal(TOKEN)
    assert err.code == "token_wrong_kind"
    assert "--node-uid re-pairs a node with a re-pair token" in str(err)


def test_auto_approve_goes_with_a_fresh_join_only() -> None:
    assert (
        tokens.check_new("gpu-1", kind="join", ttl=60, node_uid=None, auto_approve=True)
        is TokenKind.JOIN
    )
    with pytest.raises(ValueError) as rekey:
        tokens.check_new("gpu-1", kind="rekey", ttl=60, node_uid="u1", auto_approve=True)
    assert str(rekey.value) == refusal(
        "auto_approve_on_rekey", node="gpu-1", kind="rekey", proof="proved by the old one"
    )
    with pytest.raises(ValueError, match="contradict each other"):
        tokens.check_new(
            "gpu-1",
            kind="rekey",
            ttl=60,
            node_uid="u1",
            lost_state=True,
            require_approval=True,
            auto_approve=True,
        )
    with pytest.raises(ValueError, match="contradict each other"):
        tokens.check_new(
            "gpu-1", kind="join", ttl=60, node_uid=None, require_approval=True, auto_approve=True
        )
