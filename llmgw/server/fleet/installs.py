"""Desired engines: the engine builds the operator wants on the nodes (engine, version, and
per architecture a URL and SHA-256; for every node, now and later, or for one), ordered on
each node that connects, for its architecture, and checked there before placement gives the
node a replica of that engine.

The desired set lives in the store (llmgw.server.store.engines), so it outlives a restart
of the control plane. Every new stream of an approved node is sent the install orders of
its desired engines (``InstallEngine``); an agent that already has that version from that
SHA-256 checks it again without downloading it (llmgw.agent.installs), so the re-send on
each reconnect costs a trial run. Until the node answered the order for the desired build
and offers the engine, :meth:`EngineInstalls.holds` keeps the engine back from it, with the
reason placement gives (``llmgw ctl models``, the ``unplaceable`` event).

An engine desired for one node replaces, on that node, what is desired for every node.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from llmgw.contracts.install_order import (
    ARCH,
    SHA256,
    VERSION,
    canonical_arch,
    display_url,
    url_problem,
    url_shape_ok,
)
from llmgw.engines.registry import installable_engines
from llmgw.errors import ConfigError, Fenced, NotFound, StoreUnavailable
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.store import ALL_NODES, DesiredBuild, Node, NodeEngine, Store
from llmgw.server.store.states import InstallState, NodeState

__all__ = ["Build", "Desired", "EngineInstalls"]

log = logging.getLogger("llmgw.server.installs")

INSTALLABLE = installable_engines()

Holds = dict[str, tuple[tuple[str, str], ...]]
"""Per node id, the engines held back from it and why (placement's ``held_engines``)."""


@dataclass(frozen=True)
class Build:
    """One architecture's build of an engine: ``arch`` ``""`` runs on any."""

    arch: str
    url: str
    sha256: str

    @classmethod
    def checked(cls, arch: str, url: str, sha256: str) -> Build:
        """A build from what an operator typed; ConfigError saying what to fix."""
        arch = canonical_arch(arch) if arch else ""
        if arch and not ARCH.fullmatch(arch):
            raise ConfigError(
                f"arch {arch[:40]!r} is not an architecture; give what 'uname -m' prints on "
                "the nodes (x86_64, aarch64), or no arch for a build that runs on any"
            )
        url = url.strip()
        if not url_shape_ok(url):
            raise ConfigError(
                f"the nodes do not fetch {display_url(url)[:200]!r}: give an https:// URL (or "
                "http:// or file:// from a place the nodes list in install_sources in "
                "agent.yaml), at most 4096 characters, without spaces"
            )
        try:
            host = urlsplit(url).hostname
        except ValueError:  # a malformed [IPv6] host
            host = None
        if not url.lower().startswith("file:") and not host:
            raise ConfigError(f"{display_url(url)[:200]!r} names no host; give the full URL")
        # What the agent refuses too (a port that is no number, '..' in the path, a host in a
        # file:// URL): refused here, before any node is ordered to fetch it.
        problem = url_problem(url)
        if problem is not None:
            raise ConfigError(
                f"the nodes do not fetch {display_url(url)[:200]!r}: {problem}; give the URL "
                "of the build itself"
            )
        if not SHA256.fullmatch(sha256.strip()):
            raise ConfigError(
                f"sha256 {sha256[:80]!r} is not 64 hex digits; give the SHA-256 the publisher "
                f"lists for the {arch or 'any-architecture'} build"
            )
        return cls(arch, url, sha256.strip().lower())


@dataclass(frozen=True)
class Desired:
    """An engine desired for a scope (:data:`ALL_NODES` or one node id): one version, and
    its builds by architecture."""

    scope: str
    engine: str
    version: str
    builds: tuple[Build, ...]

    def build_for(self, arch: str) -> Build | None:
        """The build for a node of ``arch``: its own, else one for any architecture."""
        arch = canonical_arch(arch)
        own = next((b for b in self.builds if b.arch == arch), None)
        return own or next((b for b in self.builds if not b.arch), None)

    def covered(self) -> str:
        return ", ".join(b.arch or "any" for b in self.builds)

    def target(self) -> str:
        """How ``llmgw ctl engines install`` names the scope."""
        return "--all" if self.scope == ALL_NODES else self.scope


def _desired(rows: Iterable[DesiredBuild]) -> dict[tuple[str, str], Desired]:
    grouped: dict[tuple[str, str], list[DesiredBuild]] = {}
    for row in rows:
        grouped.setdefault((row.scope, row.engine), []).append(row)
    return {
        key: Desired(
            key[0],
            key[1],
            group[0].version,
            tuple(Build(r.arch, r.url, r.sha256) for r in group),
        )
        for key, group in grouped.items()
    }


def _wanted(node_id: str, desired: Mapping[tuple[str, str], Desired]) -> dict[str, Desired]:
    """What is desired on one node, by engine: its own entry, else the one for all nodes."""
    out: dict[str, Desired] = {}
    for (scope, engine), want in sorted(desired.items()):
        if scope == node_id or (scope == ALL_NODES and engine not in out):
            out[engine] = want
    return out


def _arch(node: Node) -> str:
    return canonical_arch(str(node.inventory.get("arch") or ""))


def _engine_detail(node: Node, engine: str) -> dict[str, Any]:
    """What the node reported of ``engine`` (its pb.EngineInfo as stored), or {}."""
    for detail in node.inventory.get("engine_details") or []:
        if isinstance(detail, dict) and detail.get("name") == engine:
            return detail
    return {}


def _installed_path(engine: str, version: str) -> str:
    """What the path of an engine the agent installed holds: it unpacks each build under
    ``<state_dir>/engines/<engine>/<version>/`` (llmgw.agent.installs)."""
    return f"/engines/{engine}/{version}/"


@dataclass(frozen=True)
class Judgement:
    """Where a desired engine stands on one node: ``state`` and, unless ready, why."""

    state: str  # ready, waiting, installing, failed, no-build, not-offered, other-build
    reason: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


def judge(
    node: Node,
    want: Desired,
    row: NodeEngine | None,
    session: NodeSession | None,
) -> Judgement:
    """Whether ``want`` is installed and checked on ``node``, and if not, why (in the words
    placement and ``llmgw ctl engines`` give)."""
    engine, version = want.engine, want.version
    arch = _arch(node)
    build = want.build_for(arch)
    if arch and build is None:
        return Judgement(
            "no-build",
            f"no {engine} {version} build for its architecture {arch} (the desired set "
            f"covers {want.covered()}); add one: llmgw ctl engines install {want.target()} "
            f"{engine} {version} --arch {arch} --url URL --sha256 SHA256",
        )
    if node.state != NodeState.APPROVED:
        return Judgement("waiting", f"{engine} {version} is ordered once the node is approved")
    if session is None:
        return Judgement("waiting", f"{engine} {version} is ordered when the node connects")
    if build is None:
        return Judgement(
            "waiting", f"{engine} {version}: the node has not reported its architecture yet"
        )
    if row is None or row.version != version or row.sha256 != build.sha256:
        return Judgement("waiting", f"{engine} {version} is about to be ordered")
    if row.state == InstallState.INSTALLING:
        return Judgement("installing", f"{engine} {version} is being installed")
    if row.state == InstallState.FAILED:
        return Judgement(
            "failed",
            f"{engine} {version} failed to install: {row.error}; once fixed, run 'llmgw ctl "
            f"engines install {want.target()} {engine} {version} ...' again",
        )
    detail = _engine_detail(node, engine)
    if engine not in session.engines:
        problem = detail.get("problem") or "it is not in the engines the node reports"
        return Judgement(
            "not-offered",
            f"{engine} {version} is installed but the node does not offer it: {problem}",
        )
    path = str(detail.get("path") or "")
    if path and _installed_path(engine, version) not in path:
        # The agent offers a program named in agent.yaml, else one on PATH, before the
        # builds it installed, and of those the newest: not the desired one here.
        return Judgement(
            "other-build",
            f"{engine} {version} is installed but the node offers {path} instead (a program "
            f"named in agent.yaml or on PATH comes first, then the newest install); remove "
            f"that one on the node, or 'llmgw ctl engines forget {want.target()} {engine}'",
        )
    return Judgement("ready")


class EngineInstalls:
    """The desired engines, their orders to the nodes, and what came of them."""

    def __init__(
        self,
        store: Store,
        *,
        sessions: Mapping[str, NodeSession],
        epoch: int,
        interval: float = 1.0,
    ) -> None:
        self.store = store
        # The live streams (node id -> session), as llmgw.server.fleet.sessions keeps them.
        self.sessions = sessions
        self.epoch = epoch
        self.interval = interval
        # Per live stream, the build of each engine it was sent: (version, url, sha256).
        self._sent: weakref.WeakKeyDictionary[NodeSession, dict[str, tuple[str, str, str]]] = (
            weakref.WeakKeyDictionary()
        )
        # Orders that check an install already recorded as done (no event when they pass).
        self._rechecks: set[str] = set()
        self._kick = asyncio.Event()

    # -- what the operator records ---------------------------------------------------------

    def desire(
        self, *, engine: str, version: str, builds: list[Build], node: str | None, actor: str
    ) -> dict[str, Any]:
        """Record ``engine`` ``version`` with ``builds`` as desired on ``node`` (None: every
        node, now and later) and order it on the connected, approved nodes it concerns.

        Returns ``{"replaced": <an entry of another version was replaced>, "nodes": rows}``,
        a row per node it concerns (see :meth:`node_rows`)."""
        if engine not in INSTALLABLE:
            raise ConfigError(
                f"cannot install engine {engine!r}: installable engines are "
                f"{', '.join(INSTALLABLE)}; name one of them"
            )
        if not VERSION.fullmatch(version):
            raise ConfigError(
                f"version {version[:80]!r} is not a version: 1-64 letters, digits, '.', '_', "
                "'+' and '-', starting with a letter or digit"
            )
        if not builds:
            raise ConfigError("give at least one build: --url and --sha256 (with --arch)")
        arches = [b.arch for b in builds]
        if len(set(arches)) != len(arches):
            raise ConfigError(
                f"architecture {next(a for a in arches if arches.count(a) > 1) or 'any'} is "
                "given twice; give one build per architecture"
            )
        scope = ALL_NODES if node is None else node
        if node is not None:
            target = self.store.get_node(node)
            arch = _arch(target)
            given = Desired(scope, engine, version, tuple(builds))
            if arch and given.build_for(arch) is None:
                raise ConfigError(
                    f"node {node} is {arch}, and the builds given cover {given.covered()}; "
                    f"add --arch {arch} with the {arch} build's --url and --sha256"
                )
        replaced = self.store.set_desired_engine(
            scope, engine, version, [(b.arch, b.url, b.sha256) for b in builds]
        )
        who = "every node" if node is None else f"node {node}"
        shown = "; ".join(f"{b.arch or 'any'}: {display_url(b.url)}" for b in builds)
        self.store.add_event(
            "engine_desired", node or "all nodes", f"{engine} {version} on {who} ({shown})", actor
        )
        log.info("engine desired", extra=kv(engine=engine, version=version, scope=node or "all"))
        # Order it now on the live streams it concerns (a failed install is tried again).
        desired = _desired(self.store.list_desired_engines())
        nodes = {n.id: n for n in self.store.list_nodes()}
        for session in list(self.sessions.values()):
            target_node = nodes.get(session.node_id)
            wanted = _wanted(session.node_id, desired).get(engine)
            if target_node is None or wanted is None or wanted.scope != scope:
                continue  # another node, or one whose own entry stands
            self._sent.get(session, {}).pop(engine, None)
            self._sync(session, target_node, desired, recheck=False, only=engine)
        concerned = [n for n in nodes.values() if node is None or n.id == node]
        return {
            "replaced": replaced,
            "nodes": [r for r in self.node_rows(concerned) if r["engine"] == engine],
        }

    def forget(self, *, engine: str, node: str | None, arch: str | None = None, actor: str) -> int:
        """Remove what is desired of ``engine`` on ``node`` (None: for every node), only
        ``arch``'s build when given; NotFound when nothing was desired. Installs on the
        nodes stay; placement no longer waits for them."""
        scope = ALL_NODES if node is None else node
        wanted_arch = None if arch is None else (canonical_arch(arch) if arch != "any" else "")
        removed = self.store.forget_desired_engine(scope, engine, wanted_arch)
        who = "every node" if node is None else f"node {node}"
        if not removed:
            only = "" if arch is None else f" for {arch}"
            raise NotFound(
                f"no {engine} build{only} is desired on {who}; 'llmgw ctl engines' lists "
                "what is desired"
            )
        only = "" if arch is None else f" ({arch} build)"
        self.store.add_event(
            "engine_forgotten",
            node or "all nodes",
            f"{engine}{only} no longer desired on {who}",
            actor,
        )
        return removed

    # -- orders on the streams -------------------------------------------------------------

    def kick(self) -> None:
        self._kick.set()

    async def run(self) -> None:
        """Order the desired engines on every new stream of an approved node (and on a node
        approved while connected), about once per ``interval``."""
        while True:
            try:
                self.sync()
            except (StoreUnavailable, Fenced):
                pass  # the database is away, or another instance leads: nothing to order now
            except Exception:
                log.exception("ordering the desired engines failed; trying again")
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.interval)
            except TimeoutError:
                pass
            self._kick.clear()

    def sync(self) -> None:
        """Send each approved node's stream the install orders it has not had yet."""
        sessions = [s for s in self.sessions.values() if s.approved]
        if not sessions:
            return
        rows = self.store.list_desired_engines()
        if not rows:
            return
        desired = _desired(rows)
        nodes = {n.id: n for n in self.store.list_nodes()}
        for session in sessions:
            node = nodes.get(session.node_id)
            if node is not None:
                self._sync(session, node, desired, recheck=True)

    def _sync(
        self,
        session: NodeSession,
        node: Node,
        desired: Mapping[tuple[str, str], Desired],
        *,
        recheck: bool,
        only: str | None = None,
    ) -> None:
        if node.state != NodeState.APPROVED or not session.approved:
            return
        arch = _arch(node)  # "" when unknown: only a build for any architecture fits
        sent = self._sent.setdefault(session, {})
        for engine, want in _wanted(node.id, desired).items():
            if only is not None and engine != only:
                continue
            build = want.build_for(arch)
            if build is None:
                continue  # placement says why (judge: no-build)
            key = (want.version, build.url, build.sha256)
            if sent.get(engine) != key:
                self._order(session, engine, want.version, build, recheck=recheck)
                sent[engine] = key

    def _order(
        self, session: NodeSession, engine: str, version: str, build: Build, *, recheck: bool
    ) -> None:
        node_id = session.node_id
        row = self.store.get_node_engine(node_id, engine)
        if row is not None:
            self._rechecks.discard(row.op_id)  # replaced: its answer will not be taken
        # A reconnect re-sends what was installed: the agent checks it without downloading,
        # and placement keeps using it meanwhile.
        done = (
            recheck
            and row is not None
            and row.state == InstallState.INSTALLED
            and (row.version, row.sha256) == (version, build.sha256)
        )
        meta = pb.OrderMeta(epoch=self.epoch, op_id=uuid.uuid4().hex)
        session.send(
            pb.ServerMessage(
                install_engine=pb.InstallEngine(
                    meta=meta,
                    engine=engine,
                    version=version,
                    url=build.url,
                    sha256=build.sha256,
                    arch=build.arch,
                )
            )
        )
        self.store.put_node_engine(
            node_id,
            engine,
            version=version,
            sha256=build.sha256,
            state=InstallState.INSTALLED if done else InstallState.INSTALLING,
            op_id=meta.op_id,
        )
        if done:
            self._rechecks.add(meta.op_id)
            return
        self.store.add_event(
            "engine_install",
            node_id,
            f"{engine} {version} ({build.arch or 'any arch'}) from {display_url(build.url)}",
        )

    def on_result(self, session: NodeSession, result: pb.OperationResult) -> bool:
        """Record the node's answer to an install order; False when ``result`` answers
        another kind of order (or an install order since replaced by a newer one)."""
        recheck = result.op_id in self._rechecks
        self._rechecks.discard(result.op_id)
        state = InstallState.INSTALLED if result.ok else InstallState.FAILED
        row = self.store.finish_node_engine(session.node_id, result.op_id, state, result.error)
        if row is None:
            return False
        what = f"{row.engine} {row.version}"
        if not result.ok:
            self.store.add_event(
                "engine_install_failed", session.node_id, f"{what}: {result.error}"
            )
            log.warning(
                "engine install failed",
                extra=kv(node=session.node_id, engine=row.engine, error=result.error[:300]),
            )
        elif not recheck:
            self.store.add_event("engine_installed", session.node_id, what)
        return True

    # -- placement ---------------------------------------------------------------------------

    def holds(self, nodes: Iterable[Node]) -> Holds:
        """Per node, the desired engines not yet installed and checked there, with why:
        placement does not give the node a replica of them (only connected nodes are
        judged; the others are not placed on anyway)."""
        rows = self.store.list_desired_engines()
        if not rows:
            return {}
        desired = _desired(rows)
        installs = {(r.node_id, r.engine): r for r in self.store.list_node_engines()}
        out: Holds = {}
        for node in nodes:
            session = self.sessions.get(node.id)
            if session is None:
                continue
            held = []
            for engine, want in _wanted(node.id, desired).items():
                verdict = judge(node, want, installs.get((node.id, engine)), session)
                if not verdict.ready:
                    held.append((engine, verdict.reason))
            if held:
                out[node.id] = tuple(held)
        return out

    # -- what operators read -------------------------------------------------------------------

    def desired_rows(self) -> list[dict[str, Any]]:
        """The desired set: one row per scope and engine, its builds' URLs shown without
        credentials."""
        return [
            {
                "node": None if want.scope == ALL_NODES else want.scope,
                "engine": want.engine,
                "version": want.version,
                "builds": [
                    {"arch": b.arch, "url": display_url(b.url), "sha256": b.sha256}
                    for b in want.builds
                ],
            }
            for want in _desired(self.store.list_desired_engines()).values()
        ]

    def node_rows(self, nodes: Iterable[Node] | None = None) -> list[dict[str, Any]]:
        """Per node and engine, desired vs installed: the engines desired there, those ever
        ordered there and those it offers (sim aside). ``state``: ready, waiting,
        installing, failed, no-build, not-offered, other-build; ``offered`` for an engine
        the node offers that is not desired."""
        desired = _desired(self.store.list_desired_engines())
        installs = {(r.node_id, r.engine): r for r in self.store.list_node_engines()}
        out: list[dict[str, Any]] = []
        for node in self.store.list_nodes() if nodes is None else nodes:
            if node.state == NodeState.REVOKED:
                continue
            session = self.sessions.get(node.id)
            wanted = _wanted(node.id, desired)
            details = {
                str(d.get("name")): d
                for d in node.inventory.get("engine_details") or []
                if isinstance(d, dict) and d.get("name") != "sim"
            }
            ordered = {e for (n, e) in installs if n == node.id}
            for engine in sorted(set(wanted) | ordered | set(details)):
                want = wanted.get(engine)
                row = installs.get((node.id, engine))
                detail = details.get(engine, {})
                if want is not None:
                    verdict = judge(node, want, row, session)
                elif detail.get("ok"):
                    verdict = Judgement("offered")
                else:
                    verdict = Judgement("", str(detail.get("problem") or ""))
                out.append(
                    {
                        "node": node.id,
                        "arch": _arch(node),
                        "engine": engine,
                        "desired": want.version if want is not None else "",
                        "desired_for": ""
                        if want is None
                        else ("all" if want.scope == ALL_NODES else "node"),
                        "installed": row.version
                        if row is not None and row.state == InstallState.INSTALLED
                        else "",
                        "offered": str(detail.get("version") or "") if detail.get("ok") else "",
                        "state": verdict.state,
                        "reason": verdict.reason,
                        "op_id": row.op_id if row is not None else None,
                        "connected": session is not None,
                    }
                )
        return out

    def results(self, op_ids: list[str]) -> list[dict[str, Any]]:
        """What became of the install orders ``op_ids`` (those since replaced left out)."""
        return [
            {
                "op_id": r.op_id,
                "node": r.node_id,
                "engine": r.engine,
                "version": r.version,
                "state": str(r.state),
                "error": r.error,
            }
            for r in self.store.node_engines_by_op(op_ids)
        ]
