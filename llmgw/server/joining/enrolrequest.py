"""The enrolment request (``POST /enroll``'s body): its shape checked field by field, and
its kind (a join, a rekey, a re-pair) read and checked by the join contract
(:mod:`llmgw.contracts.joining`). Everything here refuses with :class:`EnrolmentError`
before the store is touched."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from llmgw import netaddr
from llmgw.contracts.joining import (
    OLD_REPAIR_FIELD,
    REPAIR_FIELD,
    JoinOptions,
    read_flag,
    read_repair,
)
from llmgw.errors import ConfigError, EnrolmentError
from llmgw.log import kv
from llmgw.server.store.states import TokenKind

__all__ = ["MAX_BODY", "EnrolRequest", "parse_enrol_request", "too_large"]

log = logging.getLogger("llmgw.server.enroll")

MAX_BODY = 64 * 1024
"""Largest request body accepted; a P-256 CSR in PEM is under 1 KiB."""


_FIELDS = {
    "token": str,
    "node_id": str,
    "csr": str,
    "rekey": bool,
    "node_uid": str,
    REPAIR_FIELD: bool,
    OLD_REPAIR_FIELD: bool,
    "proof": dict,
}
# The join contract reads these itself, with its own words for a value that is no boolean.
_FLAGS = ("rekey", REPAIR_FIELD, OLD_REPAIR_FIELD)
_REQUIRED = ("token", "node_id", "csr")
_JSON_TYPE = {str: "a string", bool: "true or false", dict: "an object"}
_NODE_UID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FIELD_HELP = {
    "token": "give the token printed by 'llmgw ctl join-command'",
    "node_id": "give the node's id (a DNS name, e.g. gpu-1)",
    "csr": "give the PEM certificate request made with the node's own key",
    "node_uid": "give the uid the node got when it joined, or null for a join",
    "proof": "give the old key's signature that 'llmgw agent join --rekey' makes",
}


def _bad_request(message: str) -> EnrolmentError:
    return EnrolmentError(message, code="bad_request", status=400)


def too_large(size: int | None = None) -> EnrolmentError:
    got = f" ({size} bytes)" if size is not None else ""
    return EnrolmentError(
        f"the request body is larger than {MAX_BODY} bytes{got}; send only the token, node id "
        "and CSR that 'llmgw agent join' sends",
        code="body_too_large",
        status=413,
    )


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


@dataclass(frozen=True)
class EnrolRequest:
    """A parsed ``POST /enroll`` body; the token never shows in its repr."""

    token: str = field(repr=False)
    node_id: str
    csr: str = field(repr=False)
    rekey: bool = False
    node_uid: str | None = None
    re_pair: bool = False
    proof: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        return TokenKind.REKEY if self.rekey else TokenKind.JOIN


def parse_enrol_request(body: bytes) -> EnrolRequest:
    """Check a ``POST /enroll`` body's shape, and its kind by the join contract
    (:mod:`llmgw.contracts.joining`); raises only :class:`EnrolmentError` (``body_too_large``,
    ``bad_json``, ``bad_request``)."""
    data = _json_object(body)
    _check_fields(data)
    token, node_id, csr = data["token"], data["node_id"], data["csr"]
    if not token:
        raise _bad_request(f"field 'token' is empty; {_FIELD_HELP['token']}")
    if not csr:
        raise _bad_request(f"field 'csr' is empty; {_FIELD_HELP['csr']}")
    try:
        netaddr.validate_node_id(node_id)
    except ConfigError as exc:
        reason = exc.message.removeprefix("node_id: ")  # ConfigError names the key itself
        raise _bad_request(f"field 'node_id': {reason}") from exc
    try:
        re_pair, old_name = read_repair(data)
        options = JoinOptions.of_flags(
            node=node_id, rekey=read_flag(data, "rekey"), re_pair=re_pair
        ).check()
    except ConfigError as exc:
        raise _bad_request(str(exc)) from None
    if old_name:
        log.warning(
            "an enrolment request names a re-pair by its old field name; upgrade the agent",
            extra=kv(node=node_id, field=OLD_REPAIR_FIELD),
        )
    node_uid: str | None = data.get("node_uid")
    if options.rekey:
        _check_node_uid(node_uid)
    return EnrolRequest(
        token=token,
        node_id=node_id,
        csr=csr,
        rekey=options.rekey,
        node_uid=node_uid if options.rekey else None,
        re_pair=options.re_pair,
        proof=data.get("proof") if options.rekey else None,
    )


def _json_object(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_BODY:
        raise too_large(len(body))
    try:
        data = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError too
        raise EnrolmentError(
            f"the request body is not JSON ({type(exc).__name__}: {str(exc)[:200]}); send a "
            'JSON object such as {"token": "...", "node_id": "...", "csr": "..."}',
            code="bad_json",
            status=400,
        ) from exc
    if not isinstance(data, dict):
        raise _bad_request(
            f"the request body is {_json_kind(data)}, not a JSON object; send "
            '{"token": "...", "node_id": "...", "csr": "..."}'
        )
    return data


def _check_fields(data: dict[str, Any]) -> None:
    """Every field known, the required ones there, each of its type."""
    unknown = sorted(k for k in data if k not in _FIELDS)
    if unknown:
        names = ", ".join(repr(k[:40]) for k in unknown[:5])
        raise _bad_request(
            f"unknown field(s) {names}; an enrolment request has only {', '.join(_FIELDS)}"
        )
    for name in _REQUIRED:
        if name not in data:
            raise _bad_request(f"field '{name}' is missing; {_FIELD_HELP[name]}")
    for name, kind in _FIELDS.items():
        if name not in data or name in _FLAGS:
            continue
        value = data[name]
        if name == "node_uid" and value is None:
            continue
        if not isinstance(value, kind):
            raise _bad_request(
                f"field '{name}' is {_json_kind(value)}, not {_JSON_TYPE[kind]}; "
                f"{_FIELD_HELP[name]}"
            )


def _check_node_uid(node_uid: str | None) -> None:
    if not node_uid:
        raise _bad_request(
            "field 'node_uid' is missing; a rekey names the uid the node got when it "
            "joined (kept in the agent's state directory)"
        )
    if not _NODE_UID.fullmatch(node_uid):
        raise _bad_request(
            "field 'node_uid' is not a node uid (1-64 letters, digits, '_' or '-'); give "
            "the uid the node got when it joined"
        )
