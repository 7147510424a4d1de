"""The console's read pages (llmgw.server.console.pages) with data: Overview (nodes by state,
GPUs, models ready/desired, a model's charts, recent events), Nodes (filters), a node
(inventory, shards, events, why models are not placed there), Events (filters); the live
fragments; hostile names escaped everywhere; no inline script or style in any page; the
static files with their types and caching; HTML (never JSON) errors inside /ui/."""

from __future__ import annotations

import html
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from llmgw.errors import ConfigError, Conflict, NotFound, PasswordError
from llmgw.proto import control_pb2 as pb
from llmgw.server.admin.context import BadRequest
from llmgw.server.console.render import STATIC_DIR, Assets, Renderer, ago
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import HOSTILE, NOW, Browser, ConsoleRig

SIM_PROFILE = {"engine": "sim", "gpus": 1}


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> ConsoleRig:
    rig = ConsoleRig(store, clock, tmp_path)
    rig.add_node("gpu-1")
    rig.add_node("gpu-2", gpus=4, name="NVIDIA A100")
    rig.add_node("new-1", state="pending", gpus=0)
    rig.add_node("old-1", state="revoked", connected=False, gpus=0)
    store.add_event("node_drain", "gpu-1", "drain started", "admin")
    store.add_event("replica_placed", "r-1", "chat (default) on gpu-2[0]", "")
    return rig


def _deploy(store: Store, name: str, replicas: int = 1, gpus: int = 1) -> None:
    store.put_model(
        name,
        engine="sim",
        params={},
        replicas=replicas,
        profiles={"default": {**SIM_PROFILE, "gpus": gpus}},
    )


def pages(rig: ConsoleRig, *paths: str, login: bool = True) -> dict[str, tuple[int, str]]:
    async def scenario(b: Browser) -> dict[str, tuple[int, str]]:
        if login:
            await b.login()
        out = {}
        for path in paths:
            status, body, _ = await b.get(path)
            out[path] = (status, body)
        return out

    return rig.run(scenario)


def test_the_overview(rig: ConsoleRig, store: Store) -> None:
    _deploy(store, "chat", replicas=2)
    replica = store.add_replica("chat")
    store.set_replica_state(replica.id, "ready")
    shard = store.add_shard(replica.id, "gpu-2", rank=0)
    store.update_shard(shard.id, gpus=["GPU-gpu-2-0"])
    rig.history.record("chat", ttft=0.25)
    rig.history.record("chat", ttft=0.5)
    ((status, page),) = pages(rig, "/ui/").values()
    assert status == 200
    assert re.search(r'id="nodes-approved">2<', page)
    assert re.search(r'id="nodes-pending">1<', page)
    assert re.search(r'id="nodes-revoked">1<', page)
    assert re.search(r'id="gpus">1 / 6<', page)  # the approved nodes' GPUs only
    assert re.search(
        r'<td><a href="/ui/models/chat">chat</a></td>\s*<td>default</td>\s*<td[^>]*>1 / 2</td>',
        page,
    )
    assert "this instance&#39;s gateway traffic" in page.lower() or (
        "This instance's gateway traffic" in page
    )
    assert "chat: requests per second" in page and "chat: time to first token" in page
    assert "<svg" in page and "no data" not in page.split("chat: requests per second")[1][:2000]
    assert "drain started" in page and "chat (default) on gpu-2[0]" in page


def test_an_empty_fleet_says_what_to_do(store: Store, clock: Clock, tmp_path: Path) -> None:
    rig = ConsoleRig(store, clock, tmp_path)
    result = pages(rig, "/ui/", "/ui/nodes")
    assert "No nodes yet" in result["/ui/"][1] and "/ui/add-node" in result["/ui/"][1]
    assert "llmgw ctl deploy" in result["/ui/"][1]
    assert "No nodes yet" in result["/ui/nodes"][1]


def test_the_nodes_table_and_its_filters(rig: ConsoleRig) -> None:
    result = pages(
        rig,
        "/ui/nodes",
        "/ui/nodes?state=pending",
        "/ui/nodes?q=a100",
        "/ui/nodes?state=approved&q=gpu-1",
        "/ui/nodes?q=nothing-like-it",
    )

    def rows(path: str) -> list[str]:
        return re.findall(r'<tr data-node="([^"]+)">', result[path][1])

    assert rows("/ui/nodes") == ["gpu-1", "gpu-2", "new-1", "old-1"]
    assert rows("/ui/nodes?state=pending") == ["new-1"]
    assert rows("/ui/nodes?q=a100") == ["gpu-2"]
    assert rows("/ui/nodes?state=approved&q=gpu-1") == ["gpu-1"]
    assert "No node of 4 matches" in result["/ui/nodes?q=nothing-like-it"][1]
    page = result["/ui/nodes"][1]
    assert "4 \u00d7 NVIDIA A100: 0.0 GiB of 320.0 GiB</li>" in page  # one line per GPU model
    assert "0.9.0" in page and "ib-a" in page and "connected" in page
    # The filters stay in the form: the URL is the page.
    assert 'value="pending" selected' in result["/ui/nodes?state=pending"][1]


def test_gpu_utilisation_shows_when_reported(rig: ConsoleRig) -> None:
    # Live from the node's session (its heartbeats); a GPU that cannot tell: not reported.
    rig.sessions["gpu-1"].gpu_utilization = {"GPU-gpu-1-0": 87}
    result = pages(rig, "/ui/nodes", "/ui/nodes/gpu-1", "/ui/nodes/gpu-1?fragment=detail")
    # The list: one line per GPU model, the mean of those that report, saying how many do.
    assert (
        "2 \u00d7 NVIDIA H100: 0.0 GiB of 160.0 GiB, 87 % busy (the 1 reporting)</li>"
        in (result["/ui/nodes"][1])
    )
    rig.sessions["gpu-1"].gpu_utilization = {"GPU-gpu-1-0": 80, "GPU-gpu-1-1": 0}
    (listed,) = pages(rig, "/ui/nodes").values()
    assert "2 \u00d7 NVIDIA H100: 0.0 GiB of 160.0 GiB, 40 % busy</li>" in listed[1]
    for path in ("/ui/nodes/gpu-1", "/ui/nodes/gpu-1?fragment=detail"):
        node_page = result[path][1]
        assert re.search(r'<td class="num">87 %</td>', node_page)
        assert node_page.count("not reported") == 1


def test_a_node_page(rig: ConsoleRig, store: Store) -> None:
    _deploy(store, "chat")
    replica = store.add_replica("chat")
    shard = store.add_shard(replica.id, "gpu-1", rank=0)
    store.update_shard(shard.id, gpus=["GPU-gpu-1-0"])
    ((status, page),) = pages(rig, "/ui/nodes/gpu-1").values()
    assert status == 200
    assert '<span id="node-id">gpu-1</span>' in page
    assert "GPU-gpu-1-0" in page and shard.id in page and "<td>chat</td>" in page
    assert "drain started" in page  # its events
    assert "replica_placed" not in page  # another subject's
    assert "sim" in page and "mlx5_0" in page
    assert 'id="no-refusals"' in page


def test_a_node_page_says_why_a_waiting_model_is_not_placed_there(
    rig: ConsoleRig, store: Store
) -> None:
    _deploy(store, "big", gpus=3)
    _deploy(store, "huge", gpus=5)
    rig.scheduler.reconcile()  # big goes to gpu-2 (4 GPUs), huge fits nowhere
    assert set(rig.scheduler.unplaceable) == {"huge"}
    result = pages(rig, "/ui/nodes/gpu-1", "/ui/nodes/new-1")
    page = result["/ui/nodes/gpu-1"][1]
    assert re.search(r"<strong>huge</strong>: 2 of 2 GPUs free, needs 5", page), page
    assert "<strong>big</strong>" not in page  # placed: it waits for nothing
    assert "<strong>huge</strong>: pending" in result["/ui/nodes/new-1"][1]


class _Tables(HTMLParser):
    """Each table's header row and, per body row, the classes of its cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[list[str], list[list[str]]]] = []
        self._part = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = dict(attrs).get("class") or ""
        if tag == "table":
            self.tables.append(([], []))
        elif tag in ("thead", "tbody"):
            self._part = tag
        elif tag == "tr" and self._part == "tbody":
            self.tables[-1][1].append([])
        elif tag in ("th", "td") and self.tables:
            head, rows = self.tables[-1]
            (head if self._part == "thead" else rows[-1]).append(classes)


def test_numbers_and_their_headers_share_the_right_edge(rig: ConsoleRig, store: Store) -> None:
    # A right-aligned number under a left-aligned header sat 400 px from it on a desktop.
    _deploy(store, "chat")
    replica = store.add_replica("chat")
    store.add_shard(replica.id, "gpu-1", rank=0)
    result = pages(rig, "/ui/", "/ui/nodes", "/ui/nodes/gpu-1")
    numbers = 0
    for path, (_status, body) in result.items():
        parser = _Tables()
        parser.feed(body)
        for head, rows in parser.tables:
            for row in rows:
                for index, classes in enumerate(row):
                    if "num" in classes.split():
                        numbers += 1
                        assert "num" in head[index].split(), (path, index, head)
    assert numbers >= 8  # the models' ready/desired, the nodes' shards, a node's GPUs, shards


def test_a_node_page_shows_its_warm_sources_and_what_its_sleepers_hold(
    rig: ConsoleRig, store: Store
) -> None:
    rig.add_node(
        "gpu-3",
        warm=[
            pb.WarmStatus(
                source="org/llama",
                state="warm",
                bytes=15 << 30,
                pass_seconds=62.0,
                last_pass_at=time.time() - 180,  # the ago filter reads the real clock
            ),
            pb.WarmStatus(
                source="qwen", state="skipped", reason="the node is short of memory: 2.0 GiB"
            ),
        ],
    )
    _deploy(store, "chat")
    replica = store.add_replica("chat")
    shard = store.add_shard(replica.id, "gpu-3", rank=0)
    store.set_replica_state(replica.id, "asleep")
    store.update_shard(shard.id, state="asleep", sleep_level=1, host_memory_mib=3 * 1024)
    result = pages(rig, "/ui/nodes/gpu-3", "/ui/nodes/gpu-1")
    page = result["/ui/nodes/gpu-3"][1]
    assert '<dd id="node-sleepers-memory">3.0 GiB of host memory</dd>' in page
    rows = re.findall(
        r"<tr><td><code>([^<]*)</code></td><td class=\"warm-state\">(\w+)</td>"
        r"<td class=\"num\">([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>",
        page,
    )
    assert rows == [
        ("org/llama", "warm", "15.0 GiB", "in 62.0 s, 3 min ago", ""),
        ("qwen", "skipped", "", "not yet", "the node is short of memory: 2.0 GiB"),
    ]
    other = result["/ui/nodes/gpu-1"][1]
    assert '<dd id="node-sleepers-memory">no host memory</dd>' in other
    assert 'id="no-warm"' in other and 'id="node-warm"' not in other


def test_empty_facts_and_events_say_so_in_their_context(rig: ConsoleRig, store: Store) -> None:
    _deploy(store, "quiet")  # deployed, its events since trimmed (none kept about it)
    result = pages(rig, "/ui/nodes/new-1", "/ui/events?kind=no_such_kind", "/ui/events")
    node_page = result["/ui/nodes/new-1"][1]
    assert '<dd id="node-driver">none found</dd>' in node_page
    assert "<dd></dd>" not in node_page  # no empty card
    assert "No recent event about this node." in node_page
    assert "No event matches these filters." in result["/ui/events?kind=no_such_kind"][1]
    assert "No event matches" not in result["/ui/events"][1]
    for page in (node_page, result["/ui/events?kind=no_such_kind"][1]):
        assert "as nodes join and models are deployed" not in page


def test_an_unknown_node_is_an_html_404(rig: ConsoleRig) -> None:
    ((status, page),) = pages(rig, "/ui/nodes/nobody").values()
    assert status == 404 and "<h1" in page and "nobody" in page
    assert not page.lstrip().startswith("{")


def test_unknown_console_paths_are_html_not_json(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str, str]]:
        out = []
        for path in ("/ui/nope", "/ui/static/x/nope.js"):
            status, body, resp = await b.get(path)
            out.append((status, resp.headers["Content-Type"], body))
        status, body, resp = await b.post("/ui/nodes")
        out.append((status, resp.headers["Content-Type"], body))
        return out

    for status, content_type, body in rig.run(scenario):
        assert status in (404, 405)
        assert content_type.startswith("text/html") and "<h1" in body


def test_the_events_page_and_its_filters(rig: ConsoleRig, store: Store) -> None:
    store.add_event("node_drain", "gpu-2", "drain started", "carol")
    result = pages(
        rig,
        "/ui/events",
        "/ui/events?kind=node_drain",
        "/ui/events?kind=node_drain&actor=carol",
        "/ui/events?subject=r-1",
    )

    def subjects(path: str) -> list[str]:
        return re.findall(
            r"<td>[^<]*</td>\s*<td>([^<]*)</td>\s*<td>[^<]*</td>\s*<td>", result[path][1]
        )

    assert subjects("/ui/events?kind=node_drain") == ["gpu-2", "gpu-1"]
    assert subjects("/ui/events?kind=node_drain&actor=carol") == ["gpu-2"]
    assert subjects("/ui/events?subject=r-1") == ["r-1"]
    page = result["/ui/events?kind=node_drain&actor=carol"][1]
    newest = store.list_events(limit=1)[0].id
    assert (
        f'data-stream="/ui/events/stream?after={newest}&amp;kind=node_drain&amp;actor=carol"'
        in page
    )


def test_fragments_are_the_live_parts_alone(rig: ConsoleRig) -> None:
    result = pages(
        rig,
        "/ui/?fragment=summary",
        "/ui/?fragment=charts",
        "/ui/?fragment=events",
        "/ui/nodes?fragment=table&state=pending",
        "/ui/nodes/gpu-1?fragment=detail",
        "/ui/nodes?fragment=nope",
    )
    for path, (status, body) in result.items():
        if "nope" in path:
            assert status == 404 and "table" in body  # names the page's live parts
            continue
        assert status == 200, path
        assert "<html" not in body and "<nav" not in body, path
    assert re.findall(
        r'<tr data-node="([^"]+)">', result["/ui/nodes?fragment=table&state=pending"][1]
    ) == ["new-1"]
    assert 'id="nodes-approved"' in result["/ui/?fragment=summary"][1]
    assert "drain started" in result["/ui/?fragment=events"][1]


def test_fragments_need_a_session(rig: ConsoleRig) -> None:
    result = pages(rig, "/ui/?fragment=summary", login=False)
    assert result["/ui/?fragment=summary"][0] == 303


def test_hostile_names_are_escaped_everywhere(rig: ConsoleRig, store: Store) -> None:
    rig.add_node(HOSTILE, name=HOSTILE)
    _deploy(store, HOSTILE)
    rig.history.record(HOSTILE, ttft=0.1)
    store.add_event(HOSTILE, HOSTILE, HOSTILE, HOSTILE)
    rig.scheduler.unplaceable.clear()
    from urllib.parse import quote

    node_path = "/ui/nodes/" + quote(HOSTILE, safe="")
    result = pages(
        rig,
        "/ui/",
        "/ui/nodes",
        node_path,
        "/ui/events",
        "/ui/nodes?q=" + quote(HOSTILE, safe=""),
        "/ui/events?kind=" + quote(HOSTILE, safe=""),
    )
    for path, (status, body) in result.items():
        assert status == 200, (path, body[:500])
        assert "<script>" not in body, path
        assert "&lt;script&gt;" in body, path


def _inline(body: str) -> list[str]:
    """Inline script or style: a <script> without src, an on* handler, a style attribute or
    element, a javascript: URL."""
    found = []
    for tag in re.findall(r"<script\b[^>]*>", body, re.I):
        if "src=" not in tag:
            found.append(tag)
    found += re.findall(r"<[a-z][^>]*\son[a-z]+\s*=", body, re.I)
    found += re.findall(r"<[a-z][^>]*\sstyle\s*=", body, re.I)
    found += re.findall(r"<style\b", body, re.I)
    found += re.findall(r"javascript:", body, re.I)
    return found


def test_no_page_has_inline_script_or_style(rig: ConsoleRig, store: Store) -> None:
    _deploy(store, "chat")
    rig.history.record("chat", ttft=0.2)
    paths = (
        "/ui/",
        "/ui/nodes",
        "/ui/nodes/gpu-1",
        "/ui/nodes/new-1",
        "/ui/events",
        "/ui/nodes/nobody",
        "/ui/nope",
        "/ui/?fragment=charts",
    )
    result = pages(rig, *paths)
    result.update(pages(rig, "/ui/login", login=False))
    assert len(result) == len(paths) + 1
    for path, (_status, body) in result.items():
        assert _inline(body) == [], path
        if "fragment" not in path:
            assert re.search(r'<script src="/ui/static/[0-9a-f]{16}/console.js" defer>', body), path


def test_the_scan_would_see_inline_code() -> None:
    assert _inline('<script>alert(1)</script><p onclick="x()">') == [
        "<script>",
        "<p onclick=",
    ]
    assert _inline('<div style="color:red">') and _inline("<style>p{}</style>")
    assert _inline('<a href="javascript:x()">')


def test_static_files_are_served_with_their_types_and_cached(rig: ConsoleRig) -> None:
    assets = Assets()
    assert set(assets.files) == {"console.js", "console.css"}

    async def scenario(b: Browser) -> list[tuple[str, int, str, str, bytes]]:
        out = []
        for name in ("console.js", "console.css"):
            for url in (assets.url(name), f"/ui/static/0000000000000000/{name}"):
                resp = await b.client.get(url)
                out.append(
                    (
                        url,
                        resp.status,
                        resp.headers["Content-Type"],
                        resp.headers["Cache-Control"],
                        await resp.read(),
                    )
                )
        return out

    (js, js_old, css, css_old) = rig.run(scenario)
    assert js[1] == 200 and js[2] == "text/javascript; charset=utf-8"
    assert js[4] == (STATIC_DIR / "console.js").read_bytes()
    assert css[1] == 200 and css[2] == "text/css; charset=utf-8"
    assert "max-age=31536000" in js[3] and "immutable" in css[3]
    # An old page's URL gets today's file, revalidated rather than kept.
    assert js_old[1] == 200 and js_old[3] == "no-cache" and css_old[3] == "no-cache"


def test_a_stray_file_in_static_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "console.js").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    from llmgw.errors import ConfigError

    with pytest.raises(ConfigError, match=r"notes\.txt: not a kind of file the console serves"):
        Assets(tmp_path)
    with pytest.raises(ConfigError, match="static files are missing"):
        Assets(tmp_path / "gone")
    with pytest.raises(ConfigError, match="templates are missing"):
        Renderer(Assets(), tmp_path / "gone")


def test_the_script_uses_nothing_a_strict_csp_forbids() -> None:
    script = (STATIC_DIR / "console.js").read_text()
    for forbidden in (
        "eval(",
        "new Function",
        'setTimeout("',
        'setInterval("',
        "document.write",
        "http://",
        "https://",
    ):
        assert forbidden not in script, forbidden
    css = (STATIC_DIR / "console.css").read_text()
    assert "@import" not in css and "url(" not in css


def test_ago() -> None:
    assert ago(None, NOW) == "never"
    assert ago(NOW - 5, NOW) == "5 s ago"
    assert ago(NOW - 600, NOW) == "10 min ago"
    assert ago(NOW - 3 * 3600, NOW) == "3 h ago"
    assert ago(NOW - 5 * 86400, NOW) == "5 days ago"


def test_a_failing_page_is_an_html_500_with_the_trace_in_the_log(
    rig: ConsoleRig, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(node_id: str) -> list[tuple[str, str]]:
        raise RuntimeError("a bug behind the node page")

    rig.scheduler.refusals_on = broken  # type: ignore[method-assign]
    ((status, body),) = pages(rig, "/ui/nodes/gpu-1").values()
    assert status == 500 and "<h1" in body
    assert "its operator finds why in its log" in body and "a bug behind" not in body
    assert any("a bug behind the node page" in (r.exc_text or "") for r in caplog.records)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (BadRequest("'replicas' must be a whole number from 0 to 64"), 400),
        (ConfigError("must be a duration such as 1h"), 400),
        (PasswordError("wrong password for the account 'ops'; nothing was signed"), 403),
        (NotFound("no node 'gpu-9'"), 404),
        (Conflict("node gpu-1 is already approved"), 409),
    ],
)
def test_a_refusal_behind_a_page_is_its_own_html_answer(
    rig: ConsoleRig, error: Exception, status: int
) -> None:
    def refusing(node_id: str) -> list[tuple[str, str]]:
        raise error

    rig.scheduler.refusals_on = refusing  # type: ignore[method-assign]
    ((got, body),) = pages(rig, "/ui/nodes/gpu-1").values()
    assert got == status and "<h1" in body
    assert html.escape(str(error)).replace("&#x27;", "&#39;") in body  # as Jinja escapes
