"""The one contract for joining a node: its kinds (a join, a rekey, a re-pair) and the options
a token is minted or spent with, checked by one :meth:`JoinOptions.check` that ``llmgw ctl
join-command``, ``llmgw ctl onboard``, the admin API (``POST /api/join-tokens``), ``llmgw
agent join`` and the enroller all call, so each refusal has one wording everywhere.

A *re-pair* is the rekey of a node whose state directory is gone: it has no old key to prove,
names the uid it had, and needs approval by fingerprint again. The wire (the admin API's body,
the enrolment request) spells it ``rekey`` + ``re_pair``, the ctl flag ``--re-pair``; the node
side (``agent join --node-uid``, ``ctl onboard --re-pair``) spells it as a mode of its own.
The old names (``lost_state``, ``--lost-state``) are read as aliases that warn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from llmgw.errors import ConfigError

__all__ = [
    "OLD_REPAIR_FIELD",
    "OLD_REPAIR_FLAG",
    "REFUSALS",
    "REPAIR_FIELD",
    "REPAIR_FLAG",
    "JoinKind",
    "JoinOptions",
    "JoinRefused",
    "read_flag",
    "read_repair",
    "refusal",
]

REPAIR_FIELD: Final = "re_pair"
"""The JSON field of a re-pair (the admin API's body and answer, the enrolment request)."""
OLD_REPAIR_FIELD: Final = "lost_state"
"""Its old name, still read (with a warning) and still written in answers for old clients."""
REPAIR_FLAG: Final = "--re-pair"
OLD_REPAIR_FLAG: Final = "--lost-state"
"""``ctl join-command``'s and ``ctl onboard``'s flag of a re-pair, and its old name (an alias
that warns)."""


class JoinKind(StrEnum):
    """What a token does to a node: join it afresh (a new uid), rekey it (the same uid, a new
    key proved by the old one) or re-pair it (the same uid, no old key: approved again)."""

    JOIN = "join"
    REKEY = "rekey"
    REPAIR = "re-pair"

    @property
    def token_kind(self) -> str:
        """The kind a token of this kind is stored with: a re-pair is a rekey token."""
        return "join" if self is JoinKind.JOIN else "rekey"


REFUSALS: Final[Mapping[str, str]] = {
    "repair_without_rekey": (
        "re-pair goes with rekey: it replaces the key of a joined node whose state directory "
        "is gone; mint it with 'llmgw ctl join-command --rekey {node} --re-pair' (a new node "
        "needs none: --node {node})"
    ),
    "rekey_and_repair": (
        "rekey and re-pair go alone: a rekey proves the key of a node that has its state "
        "directory, a re-pair (agent join --node-uid, onboard --re-pair) is for one whose state "
        "directory is gone; give one of them"
    ),
    "approval_contradiction": (
        "auto-approve and require-approval contradict each other: leave out require-approval "
        "for a node approved on first use of its token, or auto-approve for the approval by "
        "fingerprint"
    ),
    "require_approval_on_join": (
        "require-approval goes with a rekey: a join always needs approval by fingerprint "
        "(unless auto-approve), a re-pair too; for {node}: 'llmgw ctl join-command --rekey "
        "{node} --require-approval'"
    ),
    "auto_approve_on_rekey": (
        "auto-approve goes with a fresh join only (trust on first use of a new machine): a "
        "{kind} keeps {node}'s record, and its new key is {proof}; leave auto-approve out, or "
        "join the machine afresh: 'llmgw ctl join-command --node {node} --auto-approve'"
    ),
    "cloud_init_on_rekey": (
        "cloud-init user-data joins a machine on its first boot (a fresh join); a {kind} runs "
        "on the joined node: 'llmgw ctl join-command --rekey {node}{repair_flag}' prints its "
        "command"
    ),
    "set_hostname_without_cloud_init": (
        "set-hostname goes with cloud-init (the user-data sets the host name to the node id on "
        "first boot); where you paste the command, run 'hostnamectl set-hostname {node}' "
        "first, or let 'llmgw ctl onboard --set-hostname' do it"
    ),
    "facts_on_rekey": (
        "{facts} go with a join or a re-pair; a rekey keeps the node's agent.yaml: to change "
        "them on a joined node, run its installer again (install-agent.sh install with them) "
        "or edit agent.yaml"
    ),
    "package_on_rekey": (
        "package goes with a join or a re-pair: a rekey keeps what the node has installed; "
        "leave it out"
    ),
    "not_a_flag": (
        "'{name}' must be true or false (a JSON boolean), not {value}; leave it out for false"
    ),
}
"""Every refusal of the contract, by name: what is wrong, then what to do."""


class JoinRefused(ConfigError):
    """Options of a join that do not go together; ``reason`` names the :data:`REFUSALS`
    entry. Each surface turns it into its own error (a usage error, a 400, a refused
    enrolment) with these words."""

    def __init__(self, reason: str, **values: object) -> None:
        super().__init__(REFUSALS[reason].format(**values))
        self.reason = reason


def refusal(reason: str, **values: object) -> str:
    """The words of refusal ``reason`` (for tests, and for a surface that words its own
    error around them)."""
    return REFUSALS[reason].format(**values)


def read_flag(body: Mapping[str, Any], name: str) -> bool:
    """A boolean field of a JSON body, false when absent. Only JSON true and false are read:
    ``"false"``, ``0`` and ``null`` are refused, since Python's truth of ``"false"`` would
    turn on what it names (a rekey, a re-pair)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise JoinRefused("not_a_flag", name=name, value=json.dumps(value)[:40])
    return value


def read_repair(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``re_pair`` of a JSON body (or its old name ``lost_state``), strictly a boolean, and
    whether the old name was used (the caller warns)."""
    if REPAIR_FIELD in body or OLD_REPAIR_FIELD not in body:
        return read_flag(body, REPAIR_FIELD), False
    return read_flag(body, OLD_REPAIR_FIELD), True


@dataclass(frozen=True)
class JoinOptions:
    """What a join is asked to do: its kind and the options that go with it. ``facts``: the
    options of the node facts given (``--fabric``, ...); ``package``: the signed package
    instead of the bundle's binary. Build it with :meth:`of_flags` (the wire's spelling) or
    :meth:`of_modes` (the node side's), then :meth:`check` it."""

    kind: JoinKind
    node: str = "NODE"
    require_approval: bool = False
    auto_approve: bool = False
    cloud_init: bool = False
    set_hostname: bool = False
    package: bool = False
    facts: tuple[str, ...] = ()

    @classmethod
    def of_flags(
        cls, *, rekey: bool, re_pair: bool, node: str = "NODE", **options: Any
    ) -> JoinOptions:
        """The wire's spelling: ``re_pair`` is a kind of ``rekey`` and needs it."""
        if re_pair and not rekey:
            raise JoinRefused("repair_without_rekey", node=node)
        kind = JoinKind.REPAIR if re_pair else (JoinKind.REKEY if rekey else JoinKind.JOIN)
        return cls(kind=kind, node=node, **options)

    @classmethod
    def of_modes(
        cls, *, rekey: bool, re_pair: bool, node: str = "NODE", **options: Any
    ) -> JoinOptions:
        """The node side's spelling: a rekey and a re-pair are two modes, one at most."""
        if rekey and re_pair:
            raise JoinRefused("rekey_and_repair")
        kind = JoinKind.REPAIR if re_pair else (JoinKind.REKEY if rekey else JoinKind.JOIN)
        return cls(kind=kind, node=node, **options)

    @property
    def rekey(self) -> bool:
        """A rekey or a re-pair: the node keeps its uid and record."""
        return self.kind is not JoinKind.JOIN

    @property
    def re_pair(self) -> bool:
        """A node without its old state: it names its uid and is approved again."""
        return self.kind is JoinKind.REPAIR

    def check(self) -> JoinOptions:
        """These options, or the :class:`JoinRefused` of the first that does not go with the
        others."""
        node, kind = self.node, self.kind
        if self.auto_approve and self.require_approval:
            raise JoinRefused("approval_contradiction")
        if self.require_approval and kind is JoinKind.JOIN:
            raise JoinRefused("require_approval_on_join", node=node)
        if self.auto_approve and kind is not JoinKind.JOIN:
            proof = "approved by its fingerprint" if self.re_pair else "proved by the old one"
            raise JoinRefused("auto_approve_on_rekey", node=node, kind=kind, proof=proof)
        if self.cloud_init and kind is not JoinKind.JOIN:
            flag = f" {REPAIR_FLAG}" if self.re_pair else ""
            raise JoinRefused("cloud_init_on_rekey", node=node, kind=kind, repair_flag=flag)
        if self.set_hostname and not self.cloud_init:
            raise JoinRefused("set_hostname_without_cloud_init", node=node)
        if self.facts and kind is JoinKind.REKEY:
            raise JoinRefused("facts_on_rekey", facts=", ".join(self.facts))
        if self.package and kind is JoinKind.REKEY:
            raise JoinRefused("package_on_rekey")
        return self
