"""The web console through a standby on PostgreSQL: the standby forwards /ui/ to the leader,
so an operator signs in, reads the pages, acts (the POST's Origin is the standby's, its Host
forwarded) and follows the live events on any instance."""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.ha import cluster, stop_all


def test_the_console_through_a_standby(tmp_path: Path, pg_cluster: Any) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = cluster(tmp_path, pg_cluster, count=2)
        procs.extend(i.server.proc for i in instances)
        leader, standby = instances
        password = (leader.server.state_dir / "admin.password").read_text().strip()
        base = standby.server.url

        async def main() -> None:
            jar = aiohttp.CookieJar(unsafe=True)
            async with aiohttp.ClientSession(cookie_jar=jar) as http:
                async with http.get(f"{base}/ui/login") as resp:
                    assert resp.status == 200, await resp.text()
                    page = await resp.text()
                csrf = re.search(r'name="csrf" value="([^"]+)"', page)
                assert csrf is not None
                form = {"csrf": csrf.group(1), "name": "admin", "password": password}
                async with http.post(
                    f"{base}/ui/login", data=form, allow_redirects=False, headers={"Origin": base}
                ) as resp:
                    assert resp.status == 303, await resp.text()
                async with http.get(f"{base}/ui/events") as resp:
                    assert resp.status == 200
                    page = await resp.text()
                    assert "operator_login" in page
                async with http.get(f"{base}/ui/events/stream?after=0") as stream:
                    assert stream.headers["Content-Type"].startswith("text/event-stream")
                    seen = b""
                    while b"operator_login" not in seen:
                        seen += await asyncio.wait_for(stream.content.readany(), 10)
                async with http.get(f"{base}/ui/nodes") as resp:
                    assert resp.status == 200 and "No nodes yet" in await resp.text()

        asyncio.run(main())
    finally:
        stop_all(procs)
