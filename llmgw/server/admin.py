"""The admin API under /api on :8080, for ``llmgw ctl`` and the web UI; bearer admin token.

Every answer is JSON; errors are ``{"error": {"message", "code"}}`` with a message that
says what to do.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import shlex
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw import __version__
from llmgw.bodies import BodiesBusy, BodyIncomplete, BodyTimeout, BodyTooLarge, read_body
from llmgw.engines.base import engine_names
from llmgw.errors import ConfigError, Conflict, LlmgwError, NotFound, PasswordError
from llmgw.log import kv
from llmgw.netaddr import check_node_id_free, format_hostport, parse_hostport
from llmgw.server.bundles import one_liner
from llmgw.server.catalog import MODEL_NAME, adhoc_profile, parse_catalog, parse_profile
from llmgw.server.httpapi import bearer_token
from llmgw.server.store import DEFAULT_PROFILE, Model, Node
from llmgw.server.updates import DEFAULT_ORDER_TTL

if TYPE_CHECKING:
    from llmgw.server.app import ControlPlane

__all__ = ["ADMIN_MAX_BODY", "add_admin_routes"]

ADMIN_MAX_BODY = 1024 * 1024
"""The largest admin API request body: orders, keys and a whole catalog fit many times."""

log = logging.getLogger("llmgw.server.admin")

_INSTALLABLE = ("llamacpp", "vllm", "sglang")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


class _BadRequest(Exception):
    pass


def _profiles_of(model: Model) -> dict[str, Any]:
    """A model's profiles; one stored without them has its engine and params as its
    ``default``."""
    return model.profiles or {DEFAULT_PROFILE: adhoc_profile(model.engine, model.params)}


def _is_adhoc(model: Model) -> bool:
    """Deployed without the catalog: no profiles, or just the one an ad-hoc deploy makes."""
    return _profiles_of(model) == {DEFAULT_PROFILE: adhoc_profile(model.engine, model.params)}


def add_admin_routes(app: web.Application, cp: ControlPlane) -> None:
    api = AdminAPI(cp)
    r = app.router
    r.add_get("/api/status", api.wrap(api.status))
    r.add_get("/api/nodes", api.wrap(api.nodes))
    r.add_get("/api/models", api.wrap(api.models))
    r.add_post("/api/models", api.wrap(api.deploy))
    r.add_delete("/api/models/{name:.+}", api.wrap(api.undeploy))
    r.add_get("/api/catalog", api.wrap(api.catalog))
    r.add_put("/api/catalog", api.wrap(api.apply_catalog))
    r.add_get("/api/replicas", api.wrap(api.replicas))
    r.add_get("/api/keys", api.wrap(api.keys))
    r.add_post("/api/keys", api.wrap(api.create_key))
    r.add_delete("/api/keys/{key}", api.wrap(api.revoke_key))
    r.add_get("/api/events", api.wrap(api.events))
    r.add_post("/api/join-tokens", api.wrap(api.create_join_token))
    r.add_get("/api/join-tokens", api.wrap(api.join_tokens))
    r.add_delete("/api/join-tokens/{token}", api.wrap(api.revoke_join_token))
    r.add_post("/api/nodes/{node}/approve", api.wrap(api.approve))
    r.add_post("/api/nodes/{node}/reject", api.wrap(api.reject))
    r.add_post("/api/nodes/{node}/revoke", api.wrap(api.revoke))
    r.add_post("/api/nodes/{node}/drain", api.wrap(api.drain))
    r.add_get("/api/nodes/{node}/drain", api.wrap(api.drain_status))
    r.add_post("/api/nodes/{node}/uncordon", api.wrap(api.uncordon))
    r.add_post("/api/engines/install", api.wrap(api.install_engine))
    r.add_get("/api/engines/installs", api.wrap(api.engine_installs))
    r.add_post("/api/updates", api.wrap(api.order_update))
    r.add_get("/api/updates", api.wrap(api.updates))
    r.add_put("/api/admin/password", api.wrap(api.change_password))


class AdminAPI:
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp

    def wrap(self, handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            peer = request.remote or ""
            token = bearer_token(request)
            if token is None or not hmac.compare_digest(token, self.cp.admin_token.encode()):
                log.info(
                    "refused an admin request without the admin token",
                    extra=kv(method=request.method[:16], path=request.path[:100], peer=peer),
                )
                return _error(
                    401,
                    "missing or wrong admin token; pass --token or set LLMGW_TOKEN (the control "
                    f"plane keeps it in {self.cp.cfg.admin_token_file})",
                    "unauthorized",
                )
            try:
                return await handler(request)
            except _BadRequest as exc:
                log.info(
                    "refused an admin request",
                    extra=kv(path=request.path[:100], peer=peer, reason=str(exc)[:200]),
                )
                return _error(400, str(exc), "bad_request")
            except ConfigError as exc:  # a value in the request that cannot be used
                log.info(
                    "refused an admin request",
                    extra=kv(path=request.path[:100], peer=peer, reason=str(exc)[:200]),
                )
                return _error(400, str(exc), "bad_request")
            except BodyTooLarge as exc:
                return _error(
                    413,
                    f"{exc} for the admin API; split the change (a catalog can be applied "
                    "model by model)",
                    "request_too_large",
                )
            except BodiesBusy as exc:
                return _error(503, str(exc), "overloaded")
            except BodyIncomplete as exc:
                return _error(400, str(exc), "incomplete_body")
            except BodyTimeout as exc:
                return _error(408, str(exc), "body_timeout")
            except PasswordError as exc:
                return _error(403, str(exc), "wrong_password")
            except NotFound as exc:
                return _error(404, str(exc), "not_found")
            except Conflict as exc:
                return _error(409, str(exc), "conflict")
            except LlmgwError as exc:
                return _error(500, str(exc), "server_error")

        return wrapped

    async def _json(self, request: web.Request) -> dict[str, Any]:
        raw = await read_body(request, ADMIN_MAX_BODY, self.cp.bodies)
        try:
            body = json.loads(raw)
            # A lone surrogate ("\ud800") parses but cannot be stored or sent on.
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            raise _BadRequest(
                "the request body is nested too deep; send a flat JSON object"
            ) from None
        except UnicodeEncodeError:
            raise _BadRequest(
                "the request body holds a lone UTF-16 surrogate (such as \\ud800); send valid "
                "Unicode"
            ) from None
        except ValueError:  # UnicodeDecodeError too
            raise _BadRequest("the request body is not valid JSON (UTF-8)") from None
        finally:
            self.cp.bodies.give(len(raw))
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        return body

    # -- status ---------------------------------------------------------------------------------

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": __version__,
                "cluster_id": self.cp.cluster_id,
                "epoch": self.cp.epoch,
                "nodes_connected": len(self.cp.sessions),
                "http": self.cp.http_addr,
                "grpc_port": self.cp.grpc_port,
            }
        )

    # -- nodes ----------------------------------------------------------------------------------

    def _node(self, node: Node, shard_count: int) -> dict[str, Any]:
        inv = node.inventory
        cert = self.cp.store.latest_certificate(node.id)
        return {
            "id": node.id,
            "uid": node.uid,
            "state": node.state,
            "connected": node.id in self.cp.sessions,
            "draining": node.draining,
            "lost": node.id in self.cp.lost,
            "dataplane_addr": node.dataplane_addr,
            "agent_version": node.agent_version,
            "last_seen": node.last_seen,
            "shards": shard_count,
            "cpus": inv.get("cpus"),
            "memory_total_bytes": inv.get("memory_total_bytes"),
            "gpus": inv.get("gpus", []),
            "gpu_status": inv.get("gpu_status", ""),
            "engines": inv.get("engines", []),
            "fingerprint": node.fingerprint,
            "cert_expires_at": cert.not_after if cert else None,
            "cert_serial": cert.serial if cert else None,
            "update": self.cp.updates.status_of(node.id),
        }

    async def nodes(self, request: web.Request) -> web.Response:
        counts: dict[str, int] = {}
        for shard in self.cp.store.list_shards():
            counts[shard.node_id] = counts.get(shard.node_id, 0) + 1
        return web.json_response(
            [self._node(n, counts.get(n.id, 0)) for n in self.cp.store.list_nodes()]
        )

    # -- models ---------------------------------------------------------------------------------

    def _model(self, model: Model) -> dict[str, Any]:
        ready = len(self.cp.router.endpoints(model.name))
        unplaceable = self.cp.scheduler.unplaceable.get(model.name)
        profiles = _profiles_of(model)
        spec = profiles.get(model.profile, {})
        return {
            "name": model.name,
            "profile": model.profile,
            "profiles": sorted(profiles),
            "engine": model.engine,
            "gpus": spec.get("gpus", 0),
            "nodes": spec.get("nodes", 1),
            "replicas": model.replicas,
            "ready": ready,
            "params": model.params,
            "unplaceable": (
                None
                if unplaceable is None
                else f"replacing replicas of an older profile waits for room: {unplaceable.reason}"
                if model.name in self.cp.scheduler.rolling
                else unplaceable.reason
            ),
            # Replicas of another profile still running while a profile switch rolls.
            "older_profile_replicas": sum(
                1
                for r in self.cp.store.list_replicas(model.name)
                if r.profile is not None and r.profile != model.profile
            ),
            "created_at": model.created_at,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response([self._model(m) for m in self.cp.store.list_models()])

    async def catalog(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"models": {m.name: {"profiles": _profiles_of(m)} for m in self.cp.store.list_models()}}
        )

    async def apply_catalog(self, request: web.Request) -> web.Response:
        """Add or update every model of the catalog, all or none; models it does not name
        are left as they are."""
        body = await self._json(request)
        try:
            catalog = parse_catalog(body, source="catalog")
        except ConfigError as exc:
            raise _BadRequest(str(exc)) from None
        store = self.cp.store
        changes: list[dict[str, Any]] = []
        with store.transaction():
            for name, spec in catalog.models.items():
                profiles = spec.to_dict()["profiles"]
                try:
                    before: Model | None = store.get_model(name)
                except NotFound:
                    before = None
                if before is not None and before.profiles == profiles:
                    change, after = "unchanged", before
                else:
                    change = "added" if before is None else "updated"
                    after = store.put_catalog_model(name, profiles)
                running = len(store.list_replicas(name))
                note = None
                if (
                    before is not None
                    and running
                    and _profiles_of(before).get(before.profile) != profiles[after.profile]
                ):
                    note = (
                        f"{running} running replica(s) of profile {after.profile} keep the "
                        "settings they started with until they are replaced"
                    )
                changes.append(
                    {
                        "name": name,
                        "change": change,
                        "profiles": sorted(profiles),
                        "profile": after.profile,
                        "note": note,
                    }
                )
        for row in changes:
            if row["change"] != "unchanged":
                store.add_event(
                    "catalog_applied",
                    row["name"],
                    f"{row['change']}: profiles {', '.join(row['profiles'])}",
                )
        self.cp.refresh_models()
        self.cp.scheduler.kick()
        return web.json_response({"models": changes})

    async def deploy(self, request: web.Request) -> web.Response:
        """Deploy a catalog model's profile (``{"name", "profile", "replicas"}``), scale a
        model (``{"name", "replicas"}``), or deploy an ad-hoc model (``{"name", "engine",
        "replicas", "params"}``), which gets a single ``default`` profile."""
        body = await self._json(request)
        name = body.get("name")
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
            raise _BadRequest(
                "model name must be 1-128 characters of letters, digits and . _ : / -, "
                "starting with a letter or digit"
            )
        replicas = body.get("replicas")
        if replicas is not None and (
            not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= 1000
        ):
            raise _BadRequest("replicas must be a whole number from 0 to 1000")
        profile = body.get("profile")
        adhoc = "engine" in body or "params" in body
        if profile is not None and adhoc:
            raise _BadRequest(
                "give either 'profile' (a profile of a catalog model) or 'engine' and 'params' "
                "(a model deployed without the catalog), not both"
            )
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise _BadRequest("profile must be the name of one of the model's profiles")
        try:
            existing = self.cp.store.get_model(name)
        except NotFound:
            existing = None
        if replicas is None:
            # Not given: a deployed model keeps its count (e.g. a profile switch), a new one
            # gets one replica.
            replicas = existing.replicas if existing is not None else 1
        if not adhoc and (profile is not None or existing is not None):
            if existing is None:
                raise NotFound(
                    f"no model named {name}; add it to the catalog with 'llmgw ctl models apply "
                    "-f catalog.yaml' ('llmgw ctl models' lists the models there are)"
                )
            model = self.cp.store.deploy_model(
                name, profile=profile or existing.profile, replicas=replicas
            )
            what = f"profile {model.profile} ({model.engine})"
        else:
            model = self._deploy_adhoc(name, body, replicas, existing)
            what = model.engine
        self.cp.refresh_models()
        self.cp.store.add_event("model_deployed", name, f"{what}, {replicas} replicas")
        self.cp.scheduler.kick()
        return web.json_response(self._model(model), status=201 if existing is None else 200)

    def _deploy_adhoc(
        self, name: str, body: dict[str, Any], replicas: int, existing: Model | None
    ) -> Model:
        engine = body.get("engine", "sim")
        if engine not in engine_names():
            raise _BadRequest(
                f"unknown engine {engine!r}; choose one of {', '.join(engine_names())}"
            )
        params = body.get("params", {})
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise _BadRequest("params must be an object of name: value")
        for key, value in params.items():
            if key == "extra_args":
                if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                    raise _BadRequest("params.extra_args must be a list of strings")
            elif not isinstance(value, str | int | float) or isinstance(value, bool):
                raise _BadRequest(f"params.{key} must be a string or a number")
        # An ad-hoc deploy is a catalog model with one "default" profile: check it as one.
        profile = adhoc_profile(engine, params)
        for key in ("source", "gpus", "nodes", "gpu_memory", "placement"):
            if body.get(key) is not None:
                profile[key] = body[key]
        try:
            parse_profile(profile, model=name, profile=DEFAULT_PROFILE, source="request")
        except ConfigError as exc:
            raise _BadRequest(str(exc)) from None
        if existing is not None and not _is_adhoc(existing):
            raise Conflict(
                f"model {name} comes from the catalog (profiles "
                f"{', '.join(sorted(existing.profiles))}); deploy one of them with "
                f"'llmgw ctl deploy {name} --profile P', or change them in the catalog and "
                "'llmgw ctl models apply -f catalog.yaml'"
            )
        if existing is not None and (existing.engine != engine or existing.params != params):
            if self.cp.store.list_replicas(name):
                raise Conflict(
                    f"model {name} is deployed with engine {existing.engine} and other params; "
                    f"'llmgw ctl undeploy {name}' first, or deploy it under another name"
                )
        return self.cp.store.put_model(
            name,
            engine=engine,
            params=params,
            replicas=replicas,
            profiles={DEFAULT_PROFILE: profile},
        )

    async def undeploy(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.cp.store.get_model(name)
        for replica in self.cp.store.list_replicas(name):
            self.cp.remove_replica(replica.id, why=f"undeployed {name}")
        self.cp.store.delete_model(name)
        self.cp.router.remove_model(name)
        self.cp.refresh_models()
        self.cp.store.add_event("model_undeployed", name, "undeployed")
        return web.json_response({"name": name, "undeployed": True})

    # -- replicas -------------------------------------------------------------------------------

    async def replicas(self, request: web.Request) -> web.Response:
        model = request.query.get("model") or None
        if model is not None:
            self.cp.store.get_model(model)
        out = []
        for replica in self.cp.store.list_replicas(model):
            for shard in self.cp.store.list_shards(replica_id=replica.id):
                ep = next(
                    (e for e in self.cp.router.endpoints(replica.model) if e.shard_id == shard.id),
                    None,
                )
                out.append(
                    {
                        "replica": replica.id,
                        "model": replica.model,
                        "profile": replica.profile,
                        "state": shard.state,
                        "node": shard.node_id,
                        "shard": shard.id,
                        "rank": shard.rank,
                        "port": shard.port,
                        "pid": shard.pid,
                        "restarts": shard.restarts,
                        "exit_code": shard.exit_code,
                        "reason": shard.reason,
                        "inflight": ep.inflight if ep else 0,
                        "routable": ep is not None,
                    }
                )
        return web.json_response(out)

    # -- API keys -------------------------------------------------------------------------------

    async def keys(self, request: web.Request) -> web.Response:
        include = request.query.get("all") in ("1", "true")
        return web.json_response(
            [
                {
                    "id": k.id,
                    "name": k.name,
                    "prefix": k.prefix,
                    "created_at": k.created_at,
                    "revoked_at": k.revoked_at,
                }
                for k in self.cp.store.list_api_keys(include_revoked=include)
            ]
        )

    async def create_key(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 64:
            raise _BadRequest("a key needs a name of 1-64 characters (who or what uses it)")
        key, secret = self.cp.store.create_api_key(name.strip())
        self.cp.refresh_keys()
        self.cp.store.add_event("key_created", key.id, name)
        return web.json_response(
            {
                "id": key.id,
                "name": key.name,
                "prefix": key.prefix,
                "key": secret,
                "created_at": key.created_at,
            },
            status=201,
        )

    async def revoke_key(self, request: web.Request) -> web.Response:
        key = self.cp.store.revoke_api_key(request.match_info["key"])
        self.cp.refresh_keys()
        self.cp.store.add_event("key_revoked", key.id, key.name)
        return web.json_response({"id": key.id, "name": key.name, "revoked_at": key.revoked_at})

    # -- events ---------------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(1000, int(request.query.get("limit", "100"))))
        except ValueError:
            raise _BadRequest("limit must be a number") from None
        subject = request.query.get("subject") or None
        return web.json_response(
            [
                {"id": e.id, "ts": e.ts, "kind": e.kind, "subject": e.subject, "message": e.message}
                for e in self.cp.store.list_events(limit=limit, subject=subject)
            ]
        )

    # -- joining nodes -----------------------------------------------------------------------------

    async def create_join_token(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        node_id = body.get("node")
        if not isinstance(node_id, str):
            raise _BadRequest("'node' (the node id to join) is required")
        try:
            check_node_id_free(node_id, self.cp.control_plane_names)
        except ConfigError as exc:
            raise _BadRequest(str(exc)) from None
        ttl = body.get("ttl", 3600)
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 60 <= ttl <= 7 * 86400:
            raise _BadRequest("ttl must be between 60 seconds and 7 days")
        rekey = bool(body.get("rekey", False))
        require_approval = bool(body.get("require_approval", False))
        host, http_port = self._join_address(request, body.get("address"))
        warning = None
        node_uid = None
        if rekey:
            node = self.cp.store.get_node(node_id)
            if node.state == "revoked":
                raise Conflict(
                    f"node {node_id} is revoked; it can come back only through a fresh join "
                    f"('llmgw ctl join-command --node {node_id}')"
                )
            node_uid = node.uid
        else:
            try:
                existing = self.cp.store.get_node(node_id)
            except NotFound:
                existing = None
            if existing is not None and existing.state != "revoked":
                warning = (
                    f"node {node_id} already exists ({existing.state}); a fresh join gives it a new "
                    "identity, denies its old certificates and needs approval again. To replace "
                    f"only its key use 'llmgw ctl join-command --rekey {node_id}'"
                )
        token, secret = self.cp.store.create_join_token(
            node_id,
            kind="rekey" if rekey else "join",
            ttl=float(ttl),
            node_uid=node_uid,
            require_approval=require_approval,
        )
        enroll_url = f"https://{format_hostport(host, self.cp.enroll_port)}"
        assert self.cp.ca is not None
        ca_hash = self.cp.ca.ca_hash()
        # Everything in a command for an operator to paste is quoted for the shell, whatever
        # validation it went through.
        q = shlex.quote
        command = (
            f"LLMGW_JOIN_TOKEN={q(secret)} llmgw agent join --node-id {q(node_id)} "
            f"--enroll-url {q(enroll_url)} --ca-hash {q(ca_hash)}" + (" --rekey" if rekey else "")
        )
        # With agent bundles to serve, a new node needs nothing but curl: the one-liner
        # downloads the bundle for its architecture, checks its hash and runs the installer.
        bundles = [] if rekey or self.cp.bundles is None else await self.cp.bundles.bundles()
        if bundles:
            tls = self.cp.cfg.tls
            command = one_liner(
                f"{self.cp.cfg.http_scheme}://{format_hostport(host, http_port)}",
                bundles,
                node_id=node_id,
                enroll_url=enroll_url,
                ca_hash=ca_hash,
                token=secret,
                # A new node does not trust the cluster CA yet, and curl cannot pin one by
                # its key hash: the download's integrity is the SHA-256 in the command.
                verify_tls=tls is None or not tls.cluster,
            )
        self.cp.store.add_event(
            "join_token_created", node_id, f"{token.kind} token {token.id}, expires in {ttl:.0f}s"
        )
        return web.json_response(
            {
                "id": token.id,
                "node": node_id,
                "kind": token.kind,
                "token": secret,
                "expires_at": token.expires_at,
                "enroll_url": enroll_url,
                "ca_hash": ca_hash,
                "command": command,
                "warning": warning,
            },
            status=201,
        )

    def _join_address(self, request: web.Request, address: object) -> tuple[str, int]:
        """The host a new node reaches the control plane at, and the gateway port it
        downloads the bundle from: ``address`` (host[:port], IPv6 in brackets), else the
        first ``advertise`` name, else the host of the request's Host header. Anything that
        is not a host[:port] is refused (it would end up in a command run as root)."""
        port = self.cp.http_port
        if address is not None:
            if not isinstance(address, str):
                raise _BadRequest(
                    "address must be a string host[:port] (IPv6 in brackets), e.g. "
                    "cp.example.net or [fd00::1]:8080"
                )
            try:
                return parse_hostport(address, default_port=port)
            except ConfigError as exc:
                raise _BadRequest(
                    f"address {exc.message}; give host[:port] (IPv6 in brackets), e.g. "
                    "--address cp.example.net"
                ) from None
        if self.cp.cfg.advertise:
            return self.cp.cfg.advertise[0], port
        header = request.headers.get("Host", "")
        if not header:
            return "127.0.0.1", port
        try:
            host, _port = parse_hostport(header, default_port=port)
        except ConfigError as exc:
            raise _BadRequest(
                f"the request's Host header {exc.message}; give the address nodes reach the "
                "control plane at ('llmgw ctl join-command --address HOST', or advertise in "
                "server.yaml)"
            ) from None
        # The port in Host is the one this request came in through (a tunnel, a proxy);
        # a node dials the gateway's own.
        return host, port

    async def join_tokens(self, request: web.Request) -> web.Response:
        include = request.query.get("all") in ("1", "true")
        return web.json_response(
            [
                {
                    "id": t.id,
                    "prefix": t.prefix,
                    "node": t.node_id,
                    "kind": t.kind,
                    "created_at": t.created_at,
                    "expires_at": t.expires_at,
                    "used_at": t.used_at,
                    "revoked_at": t.revoked_at,
                    "active": t.active,
                }
                for t in self.cp.store.list_join_tokens(include_inactive=include)
            ]
        )

    async def revoke_join_token(self, request: web.Request) -> web.Response:
        token = self.cp.store.revoke_join_token(request.match_info["token"])
        self.cp.store.add_event("join_token_revoked", token.node_id, f"token {token.id}")
        return web.json_response(
            {"id": token.id, "node": token.node_id, "revoked_at": token.revoked_at}
        )

    async def approve(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        fp = body.get("fingerprint")
        if not isinstance(fp, str):
            raise _BadRequest(
                "'fingerprint' is required: the sha256:... the node printed when it joined"
            )
        node_id = request.match_info["node"]
        self.cp.membership.approve(node_id, fp)
        return web.json_response({"node": node_id, "state": "approved"})

    async def reject(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        self.cp.membership.reject(node_id)
        return web.json_response({"node": node_id, "state": "rejected"})

    async def revoke(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        serials = self.cp.membership.revoke(node_id)
        return web.json_response({"node": node_id, "state": "revoked", "serials": serials})

    # -- engine installs ----------------------------------------------------------------------------

    async def install_engine(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        engine = body.get("engine")
        if engine not in _INSTALLABLE:
            raise _BadRequest(f"engine must be one of {', '.join(_INSTALLABLE)}")
        fields: dict[str, str] = {}
        for key in ("version", "url", "sha256"):
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise _BadRequest(f"'{key}' is required")
            fields[key] = value
        if not re.fullmatch(r"[0-9a-fA-F]{64}", fields["sha256"]):
            raise _BadRequest("sha256 must be the 64 hex characters the publisher lists")
        if not fields["url"].startswith(("http://", "https://", "file://")):
            raise _BadRequest(
                "url must be https:// (or http:// or file:// from a place the node lists in "
                "install_sources in its agent.yaml)"
            )
        arch = body.get("arch") or ""
        if not isinstance(arch, str):
            raise _BadRequest("arch must be a string such as x86_64 or aarch64")
        nodes = body.get("nodes")
        if body.get("all"):
            nodes = [n.id for n in self.cp.store.list_nodes() if n.state == "approved"]
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise _BadRequest("give 'nodes' (a list of node ids) or 'all': true")
        for node in nodes:
            self.cp.store.get_node(node)
        out = self.cp.install_engine(
            nodes,
            engine=engine,
            version=fields["version"],
            url=fields["url"],
            sha256=fields["sha256"].lower(),
            arch=arch,
        )
        return web.json_response(out, status=202)

    async def engine_installs(self, request: web.Request) -> web.Response:
        wanted = set(request.query.getall("op", []))
        rows = [r for op, r in self.cp.installs.items() if not wanted or op in wanted]
        return web.json_response(rows)

    # -- signed self-updates -----------------------------------------------------------------------

    async def order_update(self, request: web.Request) -> web.Response:
        """``{"nodes": [...] | "all": true, "version", "password", "ttl"?}``: sign an update
        order for each node; the admin password is asked again, and a wrong one signs
        nothing (403)."""
        body = await self._json(request)
        version = body.get("version")
        if not isinstance(version, str) or not version:
            raise _BadRequest("'version' (the agent version to install) is required")
        nodes = body.get("nodes")
        if body.get("all"):
            if nodes:
                raise _BadRequest("give 'nodes' or 'all': true, not both")
            nodes = None
        elif not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise _BadRequest("give 'nodes' (a list of node ids) or 'all': true")
        ttl = body.get("ttl", DEFAULT_ORDER_TTL)
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 60 <= ttl <= 7 * 86400:
            raise _BadRequest("ttl must be a whole number of seconds from 60 to 7 days")
        out = await self.cp.updates.order(
            nodes, version=version, password=body.get("password"), ttl=ttl
        )
        return web.json_response(out, status=202)

    async def updates(self, request: web.Request) -> web.Response:
        wanted = set(request.query.getall("node", []))
        rows = self.cp.updates.all_status()
        return web.json_response([r for n, r in rows.items() if not wanted or n in wanted])

    async def change_password(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        await self.cp.updates.change_password(body.get("old"), body.get("new"))
        return web.json_response({"changed": True, "removed": str(self.cp.updates.password_file)})

    # -- drain ----------------------------------------------------------------------------------------

    async def drain(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        node = self.cp.store.get_node(node_id)
        if not node.draining:
            self.cp.store.set_node_draining(node_id, True)
            self.cp.store.add_event("node_drain", node_id, "drain started")
            self.cp.scheduler.kick()
        return web.json_response(self.cp.scheduler.drain_progress(node_id))

    async def drain_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.cp.scheduler.drain_progress(request.match_info["node"]))

    async def uncordon(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        node = self.cp.store.get_node(node_id)
        if not node.draining:
            raise Conflict(f"node {node_id} is not draining; nothing to undo")
        self.cp.store.set_node_draining(node_id, False)
        self.cp.store.add_event("node_uncordon", node_id, "takes new replicas again")
        self.cp.scheduler.kick()
        return web.json_response(self.cp.scheduler.drain_progress(node_id))
