"""The web console as the control plane wires it: served at /ui/ on :8080 beside the gateway
and the admin API, its pages behind a login with the admin account, its errors HTML while
the gateway's stay JSON, its static files from the package.

A real control plane runs in the test's process on loopback ports picked free.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp

from llmgw.server.app import ControlPlane
from llmgw.server.common.config import load_server_config
from llmgw.server.console.security import CSP


def test_the_control_plane_serves_the_console(tmp_path: Path) -> None:
    cfg = load_server_config(
        None,
        overrides={
            "state_dir": str(tmp_path / "server"),
            "http_listen": "127.0.0.1:0",
            "grpc_listen": "127.0.0.1:0",
            "enroll_listen": "127.0.0.1:0",
            "bundle_dir": str(tmp_path / "bundles"),
        },
    )

    async def main() -> None:
        cp = ControlPlane(cfg)
        await cp.start()
        try:
            base = f"http://{cp.http_addr}"
            password = (tmp_path / "server" / "admin.password").read_text().strip()
            jar = aiohttp.CookieJar(unsafe=True)  # cookies for 127.0.0.1
            async with aiohttp.ClientSession(cookie_jar=jar) as http:
                async with http.get(f"{base}/ui/nodes", allow_redirects=False) as resp:
                    assert resp.status == 303
                    assert resp.headers["Location"] == "/ui/login?next=%2Fui%2Fnodes"
                    assert resp.headers["Content-Security-Policy"] == CSP
                async with http.get(f"{base}/ui/login") as resp:
                    page = await resp.text()
                    script = re.search(r'<script src="([^"]+)"', page)
                    assert script is not None
                csrf = re.search(r'name="csrf" value="([^"]+)"', page)
                assert csrf is not None
                form = {"csrf": csrf.group(1), "name": "admin", "password": password}
                form["next"] = "/ui/nodes"
                async with http.post(f"{base}/ui/login", data=form, allow_redirects=False) as resp:
                    assert resp.status == 303 and resp.headers["Location"] == "/ui/nodes"
                async with http.get(f"{base}/ui/nodes") as resp:
                    assert resp.status == 200 and "No nodes yet" in await resp.text()
                async with http.get(f"{base}{script.group(1)}") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"] == "text/javascript; charset=utf-8"
                async with http.get(f"{base}/ui/nope") as resp:
                    assert resp.status == 404 and resp.content_type == "text/html"
                async with http.get(f"{base}/v1/nope") as resp:
                    assert resp.status == 404 and resp.content_type == "application/json"
                    assert "Content-Security-Policy" not in resp.headers
        finally:
            await cp.stop()

    asyncio.run(main())
