"""POST /api/join-tokens answered in process on a real store and CA, for the tests of join
commands and of cloud-init user data."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw import pki
from llmgw.bodies import BodyBudget
from llmgw.server.admin.access import AccessRoutes
from llmgw.server.admin.context import AdminContext, guarded
from llmgw.server.joining.bundles import BundleStore
from llmgw.server.store import Store

ADMIN = "admin-secret"
NODE = "gpu-01"


def context(store: Store, ca: pki.Authority, bundle_dir: Path | None) -> AdminContext:
    return cast(
        AdminContext,
        SimpleNamespace(
            store=store,
            ca=ca,
            bodies=BodyBudget(1 << 20),
            listening=SimpleNamespace(http_port=8080, enroll_port=8443),
            bundles=None if bundle_dir is None else BundleStore(bundle_dir),
            tls=None,
            http_scheme="http",
            advertise=("cp.example.net",),
            enroll_loopback_only=False,
            control_plane_names=frozenset({"cp.example.net"}),
            admin_token=ADMIN,
            admin_token_file=Path("/s/token"),
        ),
    )


def call(
    store: Store,
    ca: pki.Authority,
    bodies: list[dict[str, Any]],
    *,
    bundle_dir: Path | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    ctx = context(store, ca, bundle_dir)
    app = web.Application()
    app.router.add_post("/api/join-tokens", guarded(ctx, AccessRoutes(ctx).create_join_token))

    async def main() -> list[tuple[int, dict[str, Any]]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for body in bodies:
                resp = await client.post(
                    "/api/join-tokens", json=body, headers={"Authorization": f"Bearer {ADMIN}"}
                )
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(main())


def one(store: Store, ca: pki.Authority, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    [(status, data)] = call(store, ca, [body], **kw)
    assert status == 201, data
    return data


def joined(store: Store, state: str = "approved") -> str:
    node = store.enrol_node(
        NODE, fingerprint="sha256:" + "1" * 64, rekey=False, node_uid=None, require_approval=True
    )
    store.set_node_state(NODE, state)
    return node.uid
