"""The join contract: every refusal, its one wording, and the kinds' two spellings."""

from __future__ import annotations

import pytest

from llmgw.contracts.joining import (
    REFUSALS,
    JoinKind,
    JoinOptions,
    JoinRefused,
    read_flag,
    read_repair,
    refusal,
)
from llmgw.errors import ConfigError

JOIN = JoinKind.JOIN
REKEY = JoinKind.REKEY
REPAIR = JoinKind.REPAIR


def refused(call: object, reason: str) -> JoinRefused:
    assert callable(call)
    with pytest.raises(JoinRefused) as caught:
        call()
    assert caught.value.reason == reason
    return caught.value


# -- the kinds ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rekey", "re_pair", "kind"), [(False, False, JOIN), (True, False, REKEY), (True, True, REPAIR)]
)
def test_the_wire_spells_a_repair_as_a_rekey_that_re_pairs(
    rekey: bool, re_pair: bool, kind: JoinKind
) -> None:
    options = JoinOptions.of_flags(rekey=rekey, re_pair=re_pair)
    assert options.kind is kind
    assert options.rekey is (kind is not JOIN)
    assert options.re_pair is (kind is REPAIR)


def test_a_repair_without_rekey_is_refused_on_the_wire() -> None:
    error = refused(
        lambda: JoinOptions.of_flags(rekey=False, re_pair=True, node="gpu-1"),
        "repair_without_rekey",
    )
    assert str(error) == (
        "re-pair goes with rekey: it replaces the key of a joined node whose state directory "
        "is gone; mint it with 'llmgw ctl join-command --rekey gpu-1 --re-pair' (a new node "
        "needs none: --node gpu-1)"
    )
    assert isinstance(error, ConfigError)


@pytest.mark.parametrize(
    ("rekey", "re_pair", "kind"),
    [(False, False, JOIN), (True, False, REKEY), (False, True, REPAIR)],
)
def test_the_node_side_spells_them_as_modes(rekey: bool, re_pair: bool, kind: JoinKind) -> None:
    assert JoinOptions.of_modes(rekey=rekey, re_pair=re_pair).kind is kind


def test_rekey_and_repair_together_are_refused_on_the_node_side() -> None:
    error = refused(lambda: JoinOptions.of_modes(rekey=True, re_pair=True), "rekey_and_repair")
    assert str(error) == refusal("rekey_and_repair")
    assert "give one of them" in str(error)


def test_a_repair_is_stored_as_a_rekey_token() -> None:
    assert [k.token_kind for k in JoinKind] == ["join", "rekey", "rekey"]
    assert str(REPAIR) == "re-pair"


# -- check(): each refusal --------------------------------------------------------------------


def test_auto_approve_and_require_approval_contradict() -> None:
    options = JoinOptions(JOIN, auto_approve=True, require_approval=True)
    assert "contradict each other" in str(refused(options.check, "approval_contradiction"))


def test_require_approval_goes_with_a_rekey() -> None:
    error = refused(
        JoinOptions(JOIN, "gpu-1", require_approval=True).check, "require_approval_on_join"
    )
    assert "'llmgw ctl join-command --rekey gpu-1 --require-approval'" in str(error)
    JoinOptions(REKEY, require_approval=True).check()
    JoinOptions(REPAIR, require_approval=True).check()


@pytest.mark.parametrize(
    ("kind", "proof"), [(REKEY, "proved by the old one"), (REPAIR, "approved by its fingerprint")]
)
def test_auto_approve_goes_with_a_fresh_join(kind: JoinKind, proof: str) -> None:
    error = refused(JoinOptions(kind, "gpu-1", auto_approve=True).check, "auto_approve_on_rekey")
    assert f"a {kind} keeps gpu-1's record, and its new key is {proof}" in str(error)
    assert "'llmgw ctl join-command --node gpu-1 --auto-approve'" in str(error)
    JoinOptions(JOIN, auto_approve=True).check()


@pytest.mark.parametrize(
    ("kind", "command"), [(REKEY, "--rekey gpu-1'"), (REPAIR, "--rekey gpu-1 --re-pair'")]
)
def test_cloud_init_goes_with_a_fresh_join(kind: JoinKind, command: str) -> None:
    error = refused(JoinOptions(kind, "gpu-1", cloud_init=True).check, "cloud_init_on_rekey")
    assert f"a {kind} runs on the joined node: 'llmgw ctl join-command {command}" in str(error)
    JoinOptions(JOIN, cloud_init=True, set_hostname=True).check()


def test_set_hostname_goes_with_cloud_init() -> None:
    error = refused(
        JoinOptions(JOIN, "gpu-1", set_hostname=True).check, "set_hostname_without_cloud_init"
    )
    assert "'hostnamectl set-hostname gpu-1'" in str(error)


def test_node_facts_go_with_a_join_or_a_repair() -> None:
    error = refused(JoinOptions(REKEY, facts=("--fabric", "--engine")).check, "facts_on_rekey")
    assert str(error).startswith("--fabric, --engine go with a join or a re-pair; a rekey keeps")
    JoinOptions(JOIN, facts=("--fabric",)).check()
    JoinOptions(REPAIR, facts=("--fabric",)).check()


def test_a_package_goes_with_a_join_or_a_repair() -> None:
    refused(JoinOptions(REKEY, package=True).check, "package_on_rekey")
    JoinOptions(JOIN, package=True).check()
    JoinOptions(REPAIR, package=True).check()


def test_what_goes_together_passes() -> None:
    options = JoinOptions(JOIN, "gpu-1", auto_approve=True, cloud_init=True, set_hostname=True)
    assert options.check() is options
    assert JoinOptions(REPAIR, require_approval=True, package=True, facts=("--fabric",)).check()


# -- flags read from JSON ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["false", "true", 0, 1, None], ids=["str-false", "str-true", "0", "1", "null"]
)
def test_a_flag_is_a_json_boolean_only(value: object) -> None:
    """Python's truth of "false" would turn on what it names: refused, not read."""
    error = refused(lambda: read_flag({"rekey": value}, "rekey"), "not_a_flag")
    assert str(error).startswith("'rekey' must be true or false (a JSON boolean), not ")


def test_a_flag_is_false_when_absent() -> None:
    assert read_flag({}, "rekey") is False
    assert read_flag({"rekey": True}, "rekey") is True


def test_repair_is_read_by_its_name_and_its_old_one() -> None:
    assert read_repair({}) == (False, False)
    assert read_repair({"re_pair": True}) == (True, False)
    assert read_repair({"lost_state": True}) == (True, True)
    assert read_repair({"re_pair": False, "lost_state": True}) == (False, False)
    refused(lambda: read_repair({"lost_state": "false"}), "not_a_flag")


def test_every_refusal_is_tested_here() -> None:
    """A refusal added to the contract gets its test in this module."""
    source = open(__file__, encoding="utf-8").read()
    assert [r for r in REFUSALS if f'"{r}"' not in source] == []
