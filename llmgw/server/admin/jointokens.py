"""Minting a join token (``POST /api/join-tokens`` and the console's Add node and rekey
buttons): the body parsed and checked by the join contract (:mod:`llmgw.contracts.joining`),
the token minted in the store, and the commands an operator pastes on the node rendered
(the agent's, the bundle one-liner, the cloud-init user-data)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.joining import (
    OLD_REPAIR_FIELD,
    REPAIR_FIELD,
    REPAIR_FLAG,
    JoinKind,
    JoinOptions,
    read_flag,
    read_repair,
)
from llmgw.contracts.nodefacts import AGENT_FACTS, FACT_OPTIONS, INSTALLER_FACTS, NodeFacts
from llmgw.errors import ConfigError, Conflict, NotFound
from llmgw.netaddr import check_node_id_free, format_hostport, is_loopback_host, parse_hostport
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.joining import cloudinit
from llmgw.server.joining.bundles import ADD_BUNDLES, Bundle, one_liner
from llmgw.server.store import JoinToken as StoredToken
from llmgw.server.store.states import NodeState, TokenKind

__all__ = ["CLOUD_INIT_TTL", "JoinAsk", "JoinToken", "create_join_token", "parse_join_ask"]


@dataclass(frozen=True)
class JoinToken:
    """A join token just minted, with what an operator pastes on the node: ``agent_command``
    (``llmgw agent join ...``, for a node that has llmgw) and, when the control plane serves
    agent bundles, ``one_liner`` (download, check, install). ``secret`` is shown once, here,
    and never stored (the store keeps its hash)."""

    id: str
    node: str
    kind: str
    re_pair: bool
    node_uid: str | None
    secret: str
    expires_at: float
    enroll_url: str
    ca_hash: str
    facts: dict[str, object]
    agent_command: str
    one_liner: str | None
    warning: str | None
    auto_approve: bool = False
    user_data: str | None = None

    @property
    def command(self) -> str:
        """The one command to paste: the one-liner where there are bundles."""
        return self.one_liner or self.agent_command

    def as_json(self) -> dict[str, Any]:
        """``POST /api/join-tokens``' answer (``lost_state``: ``re_pair``'s old name, for
        clients older than it)."""
        return {
            "id": self.id,
            "node": self.node,
            "kind": self.kind,
            REPAIR_FIELD: self.re_pair,
            OLD_REPAIR_FIELD: self.re_pair,
            "auto_approve": self.auto_approve,
            "node_uid": self.node_uid if self.re_pair else None,
            "token": self.secret,
            "expires_at": self.expires_at,
            "enroll_url": self.enroll_url,
            "ca_hash": self.ca_hash,
            "facts": self.facts,
            "command": self.command,
            "warning": self.warning,
            **({"user_data": self.user_data} if self.user_data is not None else {}),
        }


@dataclass(frozen=True)
class JoinAsk:
    """``POST /api/join-tokens``' body, parsed and checked against the join contract: what
    to mint, before anything is looked up or written."""

    options: JoinOptions
    ttl: float
    facts: NodeFacts
    package: list[str]
    warning: str | None = None


@dataclass(frozen=True)
class Minted:
    """A token in the store, with where its node reaches the control plane."""

    token: StoredToken
    secret: str
    node_uid: str | None
    host: str
    http_port: int
    bundles: list[Bundle]
    warning: str | None


async def create_join_token(
    ctx: AdminContext, body: Mapping[str, Any], *, host_header: str, actor: str
) -> JoinToken:
    """Mint a join token as ``body`` asks (``node``, ``ttl``, ``rekey``, ``re_pair`` (old
    name ``lost_state``), ``require_approval``, ``auto_approve``, ``cloud_init`` (with
    ``set_hostname``), ``facts``, ``package``, ``address``: ``POST /api/join-tokens``' JSON,
    which the console's Add node form is turned into), recorded in the events as
    ``actor``'s. The host nodes reach the control plane at is ``address``, else the first
    ``advertise`` name, else ``host_header``'s host. ``auto_approve``: the node that spends
    the token is approved on first use (fresh joins only); ``cloud_init``: the answer
    carries ``user_data`` (llmgw.server.joining.cloudinit; default ttl 24 h). BadRequest, Conflict
    or NotFound mint nothing."""
    ask = parse_join_ask(ctx, body)
    host, http_port = _join_address(ctx, host_header, body.get("address"))
    minted = await _mint(ctx, ask, host, http_port)
    made = _render(ctx, ask, minted)
    _record(ctx, ask, minted, actor)
    return made


def parse_join_ask(ctx: AdminContext, body: Mapping[str, Any]) -> JoinAsk:
    """``body`` read and checked by the join contract (:mod:`llmgw.contracts.joining`);
    BadRequest with the contract's words when it asks for what does not go together."""
    node_id = body.get("node")
    if not isinstance(node_id, str):
        raise BadRequest("'node' (the node id to join) is required")
    try:
        check_node_id_free(node_id, ctx.control_plane_names, instances=ctx.store.instance_names())
        cloud_init = read_flag(body, "cloud_init")
        ttl = body.get("ttl", CLOUD_INIT_TTL if cloud_init else 3600)
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 60 <= ttl <= 7 * 86400:
            raise BadRequest("ttl must be between 60 seconds and 7 days")
        re_pair, old_name = read_repair(body)
        flags = {
            name: read_flag(body, name)
            for name in ("rekey", "require_approval", "auto_approve", "set_hostname")
        }
        if not flags["rekey"] and not re_pair and not flags["auto_approve"]:
            # A join always waits for approval by fingerprint: asked for, it is what the join
            # does. The API has always taken it (scripts send it); ctl refuses the flag.
            flags["require_approval"] = False
        facts = _facts_of(body.get("facts"))
        options = JoinOptions.of_flags(
            node=node_id,
            re_pair=re_pair,
            cloud_init=cloud_init,
            package=body.get("package") is not None,
            facts=tuple(facts.given(FACT_OPTIONS)),
            **flags,
        ).check()
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    package = _package_source(body.get("package"))
    warning = None
    if old_name:
        warning = f"'{OLD_REPAIR_FIELD}' is the old name of '{REPAIR_FIELD}'; send {REPAIR_FIELD}"
    return JoinAsk(options=options, ttl=float(ttl), facts=facts, package=package, warning=warning)


def _facts_of(value: object) -> NodeFacts:
    try:
        return NodeFacts.from_json(value)
    except ConfigError as exc:
        raise BadRequest(f"{exc}; fix the option and run join-command again") from None


def _node_to_mint_for(ctx: AdminContext, options: JoinOptions) -> tuple[str | None, str | None]:
    """The uid a rekey or re-pair token binds (Conflict for a revoked node, NotFound for
    none), and the warning a fresh join of a node that exists gets."""
    node_id = options.node
    if options.rekey:
        node = ctx.store.get_node(node_id)
        if node.state == NodeState.REVOKED:
            raise Conflict(
                f"node {node_id} is revoked; it can come back only through a fresh join "
                f"('llmgw ctl join-command --node {node_id}')"
            )
        return node.uid, None
    try:
        existing = ctx.store.get_node(node_id)
    except NotFound:
        return None, None
    if existing.state == NodeState.REVOKED:
        return None, None
    return None, (
        f"node {node_id} already exists ({existing.state}); a fresh join gives it a new "
        "identity, denies its old certificates and needs approval again. To replace "
        f"only its key use 'llmgw ctl join-command --rekey {node_id}' (with "
        f"{REPAIR_FLAG} if its state directory is gone)"
    )


async def _bundles_for(ctx: AdminContext, ask: JoinAsk) -> list[Bundle]:
    """The agent bundles the command downloads; BadRequest when what was asked for needs
    them and there are none."""
    # With agent bundles to serve, a node needs nothing but curl: the one-liner downloads
    # the bundle for its architecture, checks its hash and runs the installer (for a
    # rekey its 'rekey' verb, which stops the agent, rekeys and starts it again).
    bundles = [] if ctx.bundles is None else await ctx.bundles.bundles()
    if bundles:
        return bundles
    installer_only = ask.facts.given(INSTALLER_FACTS)
    if ask.package:
        raise BadRequest(
            "'package' installs through the bundle's install-agent.sh, and this control plane "
            f"serves no agent bundles; {ADD_BUNDLES}"
        )
    if ask.options.cloud_init:
        raise BadRequest(
            "cloud-init user-data downloads the agent bundle, and this control plane serves "
            f"none; {ADD_BUNDLES}, then mint the user-data again"
        )
    if installer_only:
        raise BadRequest(
            f"{', '.join(installer_only)} are options of the installer, and this control "
            f"plane serves no agent bundles to print its one-liner with; {ADD_BUNDLES}; or "
            "leave them out and pass them to install-agent.sh on the node"
        )
    return bundles


async def _mint(ctx: AdminContext, ask: JoinAsk, host: str, http_port: int) -> Minted:
    """The token in the store, once everything it needs is there."""
    options = ask.options
    node_uid, warning = _node_to_mint_for(ctx, options)
    bundles = await _bundles_for(ctx, ask)
    token, secret = ctx.store.create_join_token(
        options.node,
        kind=TokenKind(options.kind.token_kind),
        ttl=ask.ttl,
        node_uid=node_uid,
        require_approval=options.require_approval or options.re_pair,
        lost_state=options.re_pair,
        auto_approve=options.auto_approve,
    )
    for also in (ask.warning, _unreachable_warning(ctx, host)):
        if also is not None:
            warning = also if warning is None else f"{warning}. Also: {also}"
    return Minted(token, secret, node_uid, host, http_port, bundles, warning)


def _render(ctx: AdminContext, ask: JoinAsk, minted: Minted) -> JoinToken:
    """What the operator pastes: the agent's command, the one-liner where there are
    bundles, the cloud-init user-data when asked for."""
    options, token, secret = ask.options, minted.token, minted.secret
    enroll_url = f"https://{format_hostport(minted.host, ctx.listening.enroll_port)}"
    ca_hash = ctx.ca.ca_hash()
    # Everything in a command for an operator to paste is quoted for the shell, whatever
    # validation it went through.
    args = [
        *("llmgw", "agent", "join", "--node-id", options.node),
        *("--enroll-url", enroll_url, "--ca-hash", ca_hash),
        *(["--rekey"] if options.kind is JoinKind.REKEY else []),
        *_repair_args(options, minted),
        *ask.facts.args(AGENT_FACTS),
    ]
    command, user_data = _bundle_commands(ctx, ask, minted, enroll_url, ca_hash)
    return JoinToken(
        id=token.id,
        node=options.node,
        kind=str(token.kind),
        re_pair=token.lost_state,
        node_uid=minted.node_uid,
        secret=secret,
        expires_at=token.expires_at,
        enroll_url=enroll_url,
        ca_hash=ca_hash,
        facts=ask.facts.as_json(),
        agent_command=f"LLMGW_JOIN_TOKEN={shlex.quote(secret)} " + shlex.join(args),
        one_liner=command,
        warning=minted.warning,
        auto_approve=token.auto_approve,
        user_data=user_data,
    )


def _repair_args(options: JoinOptions, minted: Minted) -> list[str]:
    # A re-pair names the uid it keeps: the node has no state directory to read it from.
    return ["--node-uid", minted.node_uid] if options.re_pair and minted.node_uid else []


def _bundle_commands(
    ctx: AdminContext, ask: JoinAsk, minted: Minted, enroll_url: str, ca_hash: str
) -> tuple[str | None, str | None]:
    """The one-liner that downloads the agent bundle (None without bundles), and the
    cloud-init user-data that does it on first boot (None unless asked for)."""
    options = ask.options
    base_url = f"{ctx.http_scheme}://{format_hostport(minted.host, minted.http_port)}"
    # A new node does not trust the cluster CA yet, and curl cannot pin one by its key hash:
    # the download's integrity is the SHA-256 in the command.
    verify_tls = ctx.tls is None or not ctx.tls.cluster
    user_data = None
    if options.cloud_init:
        user_data = cloudinit.user_data(
            base_url,
            minted.bundles,
            node_id=options.node,
            enroll_url=enroll_url,
            ca_hash=ca_hash,
            token=minted.secret,
            token_id=minted.token.id,
            expires_at=minted.token.expires_at,
            auto_approve=options.auto_approve,
            verify_tls=verify_tls,
            extra_args=ask.facts.args(),
            set_hostname=options.set_hostname,
        )
    if not minted.bundles:
        return None, user_data
    plain_rekey = options.kind is JoinKind.REKEY
    command = one_liner(
        base_url,
        minted.bundles,
        node_id=options.node,
        enroll_url=enroll_url,
        ca_hash=ca_hash,
        token=minted.secret,
        verify_tls=verify_tls,
        verb="rekey" if plain_rekey else ("package" if ask.package else "install"),
        extra_args=[*ask.package, *_repair_args(options, minted), *ask.facts.args()],
    )
    return command, user_data


def _record(ctx: AdminContext, ask: JoinAsk, minted: Minted, actor: str) -> None:
    options = ask.options
    what = "auto-approve join" if options.auto_approve else str(options.kind)
    ctx.store.add_event(
        "join_token_created",
        options.node,
        f"{what} token {minted.token.id}, expires in {ask.ttl:.0f}s"
        + (" (cloud-init user-data)" if options.cloud_init else ""),
        actor,
    )


CLOUD_INIT_TTL = 86400
"""A cloud-init token's default ttl: the user-data waits for a machine to boot, and the
token sits in cloud-init's copy of it (root only) until it expires unspent."""


def _unreachable_warning(ctx: AdminContext, host: str) -> str | None:
    """What to tell an operator whose join command only this machine could run: the
    control plane takes joins on loopback only, or the command names a loopback host."""
    if ctx.enroll_loopback_only:
        return (
            "this control plane takes joins on loopback only, so no other machine can reach "
            "it and the command works on this machine alone; for a cluster other machines "
            "join, start it on an address they reach: 'llmgw up --host 0.0.0.0' (or this "
            "machine's address), or 'llmgw server' with http_listen and enroll_listen on it "
            "in server.yaml"
        )
    if is_loopback_host(host):
        return (
            f"the command names {host}, which only this machine reaches; give the address "
            "other machines reach the control plane at ('llmgw ctl join-command --address "
            "HOST', the Add node form's address, or advertise: in server.yaml)"
        )
    return None


def _join_address(ctx: AdminContext, header: str, address: object) -> tuple[str, int]:
    """The host a new node reaches the control plane at, and the gateway port it
    downloads the bundle from: ``address`` (host[:port], IPv6 in brackets), else the
    first ``advertise`` name, else the host of the request's Host ``header``. Anything that
    is not a host[:port] is refused (it would end up in a command run as root)."""
    port = ctx.listening.http_port
    if address is not None:
        if not isinstance(address, str):
            raise BadRequest(
                "address must be a string host[:port] (IPv6 in brackets), e.g. "
                "cp.example.net or [fd00::1]:8080"
            )
        try:
            return parse_hostport(address, default_port=port)
        except ConfigError as exc:
            raise BadRequest(
                f"address {exc.message}; give host[:port] (IPv6 in brackets), e.g. "
                "--address cp.example.net"
            ) from None
    if ctx.advertise:
        return ctx.advertise[0], port
    if not header:
        return "127.0.0.1", port
    try:
        host, _port = parse_hostport(header, default_port=port)
    except ConfigError as exc:
        raise BadRequest(
            f"the request's Host header {exc.message}; give the address nodes reach the "
            "control plane at ('llmgw ctl join-command --address HOST', or advertise in "
            "server.yaml)"
        ) from None
    # The port in Host is the one this request came in through (a tunnel, a proxy);
    # a node dials the gateway's own.
    return host, port


# What a repository URL and its key's file or URL may hold: they are quoted into a command,
# but a value a shell or apt would take apart is refused before that.
_SOURCE = re.compile(r"^[A-Za-z0-9._~:/?&=%+@-]+$")


def _package_source(value: object) -> list[str]:
    """``body['package']`` (``{"repo_url": URL, "repo_key": FILE|URL}``: the one-liner runs
    ``install-agent.sh package`` with them, which installs the signed package instead of the
    bundle's binary) as the installer's options; none when absent. BadRequest when wrong."""
    if value is None:
        return []
    if not isinstance(value, dict) or set(value) != {"repo_url", "repo_key"}:
        raise BadRequest(
            '\'package\' is {"repo_url": URL, "repo_key": FILE|URL}: the signed repository '
            "(scripts/repo.sh's --url) and its public key"
        )
    url, key = value["repo_url"], value["repo_key"]
    if (
        not isinstance(url, str)
        or not url.startswith(("https://", "http://"))
        or not _SOURCE.match(url)
    ):
        raise BadRequest(
            f"package repo_url {url!r} is not an http(s) URL of plain characters; give the URL "
            "the repository is served at, e.g. https://repo.example.net/llmgw"
        )
    if (
        not isinstance(key, str)
        or not _SOURCE.match(key)
        or not key.startswith(("/", "https://", "http://"))
    ):
        raise BadRequest(
            f"package repo_key {key!r} is neither an absolute path on the node nor an http(s) "
            "URL of plain characters; give where the repository's public key is"
        )
    return ["--repo-url", url, "--repo-key", key]
