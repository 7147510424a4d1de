"""The Models pages (llmgw.server.console.models): the catalog, the deployed models with
their ready/desired replicas and why they cannot be placed, a model's replicas live; and
their actions through the admin API's own code (deploy a profile, scale, switch profile,
undeploy), each refusal shown on the page with the operator's input kept; a viewer sees no
form and its POSTs are refused; a POST without its CSRF token changes nothing."""

from __future__ import annotations

import html
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.server.fleet.planner import Planner
from llmgw.server.gateway.capacity import Demand
from llmgw.server.gateway.routing import Endpoint
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import HOSTILE, NOW, VIEWER_PW, Browser, ConsoleRig, flash_of

PROFILES: dict[str, Any] = {
    "small": {"engine": "sim", "gpus": 1},
    "big": {"engine": "sim", "gpus": 2, "task": ["generate"]},
}


@pytest.fixture
def refreshed() -> list[str]:
    """The gateway's caches refreshed, in order."""
    return []


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path, refreshed: list[str]) -> ConsoleRig:
    rig = ConsoleRig(store, clock, tmp_path)
    # What deploying touches beyond the rig's fleet: the router and the gateway's caches.
    ctx: Any = rig.ctx
    ctx.router = rig.scheduler.router
    ctx.serving = SimpleNamespace(
        refresh_models=lambda: refreshed.append("models"),
        refresh_keys=lambda: refreshed.append("keys"),
    )
    rig.add_node("gpu-1")
    store.put_catalog_model("chat", PROFILES)
    store.put_catalog_model("embed", {"default": {"engine": "sim"}})
    return rig


def _ready(rig: ConsoleRig, model: str) -> None:
    """Every shard of ``model`` ready and routable, as its agent would report."""
    for replica in rig.store.list_replicas(model):
        rig.store.set_replica_state(replica.id, "ready")
        for shard in rig.store.list_shards(replica_id=replica.id):
            rig.store.update_shard(shard.id, state="ready", port=8000)
            rig.scheduler.router.set_ready(
                Endpoint(model, replica.id, shard.id, shard.node_id, "10.0.0.1:9443")
            )


async def deploy(b: Browser, **fields: str) -> tuple[int, str, Any]:
    return await b.post("/ui/models", {"csrf": b.csrf, **fields})


def test_the_models_page_lists_the_catalog_and_nothing_deployed(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> str:
        await b.login()
        status, page, _ = await b.get("/ui/models")
        assert status == 200
        return page

    page = rig.run(scenario)
    assert 'id="no-deployed"' in page
    assert 'data-model="chat" data-profile="big"' in page
    assert "<td>2 GPUs</td>" in page and "<td>no GPU</td>" in page  # what each needs
    assert "<td>generate</td>" in page  # the task, else the engine's default
    assert 'id="deploy-form"' in page and 'name="csrf"' in page
    assert 'href="/ui/models?name=chat&amp;profile=small#deploy"' in page


def test_deploy_a_profile_then_see_its_replica_on_the_model_page(
    rig: ConsoleRig, store: Store, refreshed: list[str]
) -> None:
    async def scenario(b: Browser) -> tuple[tuple[int, str, Any], str, str, str]:
        await b.login()
        answer = await deploy(b, name="chat", profile="small", replicas="1")
        _, page, _ = await b.get("/ui/models/chat")
        rig.scheduler.reconcile()
        _ready(rig, "chat")
        _, live, _ = await b.get("/ui/models/chat?fragment=detail")
        _, table, _ = await b.get("/ui/models?fragment=deployed")
        return answer, page, live, table

    (status, _body, resp), page, live, table = rig.run(scenario)
    assert status == 303 and resp.headers["Location"] == "/ui/models/chat"
    assert flash_of(page) == (
        "info: model chat: profile small, 1 replica(s) wanted; the scheduler places them"
    )
    assert 'id="no-replicas"' in page and 'data-live="detail"' in page
    replica = store.list_replicas("chat")[0]
    assert f'data-replica="{replica.id}"' in live and "gpu-1" in live
    assert 'id="model-ready">1 / 1<' in live
    assert "<html" not in live  # a fragment, no layout
    assert '<span class="ready">1</span> / <span class="desired">1</span>' in table
    assert "1 ready" in table
    kinds = [(e.kind, e.actor) for e in store.list_events() if e.subject == "chat"]
    assert ("model_deployed", "admin") in kinds
    assert refreshed == ["models"]


def test_a_deployed_models_page_without_events_kept_says_so(rig: ConsoleRig, store: Store) -> None:
    # Its model_deployed event trimmed long ago (the newest events are kept): the page must
    # not tell the operator that events come "as models are deployed".
    store.put_model(
        "chat", engine="sim", params={}, replicas=1, profiles={"default": PROFILES["small"]}
    )

    async def scenario(b: Browser) -> tuple[str, str]:
        await b.login()
        _, page, _ = await b.get("/ui/models/chat")
        _, live, _ = await b.get("/ui/models/chat?fragment=detail")
        return page, live

    for page in rig.run(scenario):
        assert "No recent event about this model." in page
        assert "as models are deployed" not in page


def test_deploy_refusals_keep_the_form(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        for fields in (
            {"name": "chat", "profile": "huge", "replicas": "2"},
            {"name": "nobody", "profile": "small", "replicas": "1"},
            {"name": "chat", "profile": "small", "replicas": "many"},
            {"name": "chat", "profile": "small", "replicas": "1001"},
            {"name": "chat", "profile": "", "replicas": "1"},
        ):
            status, page, _ = await deploy(b, **fields)
            out.append((status, page))
        return out

    (unknown, p1), (missing, p2), (word, p3), (many, p4), (empty, p5) = rig.run(scenario)
    assert unknown == 404 and "huge" in flash_of(p1) and "big, small" in flash_of(p1)
    assert 'id="deploy-replicas" name="replicas" type="text" inputmode="numeric"' in p1
    assert 'size="9" value="2"' in p1
    assert missing == 404 and "no model named nobody" in flash_of(p2)
    assert "llmgw ctl models apply" in flash_of(p2)  # what to do
    assert word == 400 and "replicas must be a whole number from 0 to 1000" in flash_of(p3)
    assert 'value="many"' in p3
    assert many == 400 and "'1001'" in flash_of(p4)
    assert empty == 400 and "choose a model of the catalog" in flash_of(p5)
    assert store.get_model("chat").replicas == 0  # nothing changed
    assert not [e for e in store.list_events() if e.kind == "model_deployed"]


def test_scale_and_switch_profile_through_the_model_page(rig: ConsoleRig, store: Store) -> None:
    store.deploy_model("chat", profile="small", replicas=1)

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        _, page, _ = await b.get("/ui/models/chat")
        assert 'id="action-scale"' in page and '<option value="big"' in page
        assert '<option value="small"' not in page  # the one it runs is no choice
        out = []
        for action, fields in (
            ("scale", {"replicas": "2"}),
            ("profile", {"profile": "big"}),
            ("profile", {"profile": "big"}),
            ("profile", {"profile": "nope"}),
            ("scale", {"replicas": "-1"}),
        ):
            status, body, resp = await b.post(
                f"/ui/models/chat/{action}", {"csrf": b.csrf, **fields}
            )
            if status == 303:
                assert resp.headers["Location"] == "/ui/models/chat"
                _, body, _ = await b.get("/ui/models/chat")
            out.append((status, flash_of(body)))
        return out

    scaled, switched, same, unknown, negative = rig.run(scenario)
    assert scaled == (303, "info: model chat: 2 replica(s) wanted")
    assert switched[0] == 303 and "switches to profile big" in switched[1]
    assert "one at a time" in switched[1]
    assert same[0] == 400 and "runs profile big already" in same[1]
    assert unknown[0] == 404 and "nothing done" in unknown[1] and "nope" in unknown[1]
    assert negative[0] == 400 and "whole number" in negative[1]
    model = store.get_model("chat")
    assert (model.profile, model.replicas) == ("big", 2)


def test_a_profile_switch_shows_the_older_replicas_rolling(rig: ConsoleRig, store: Store) -> None:
    rig.add_node("gpu-2")  # room for the successor beside the replica it replaces
    store.deploy_model("chat", profile="small", replicas=1)
    rig.scheduler.reconcile()
    _ready(rig, "chat")

    async def scenario(b: Browser) -> tuple[str, str]:
        await b.login()
        await b.post("/ui/models/chat/profile", {"csrf": b.csrf, "profile": "big"})
        rig.scheduler.reconcile()  # its successor is placed; the old one serves meanwhile
        _, live, _ = await b.get("/ui/models/chat?fragment=detail")
        _, table, _ = await b.get("/ui/models?fragment=deployed")
        return live, table

    live, table = rig.run(scenario)
    assert 'id="model-rolling"' in live and "1 replica(s) of an older profile" in live
    assert "switching: 1 of an older profile" in table
    assert sorted(r.profile or "" for r in store.list_replicas("chat")) == ["big", "small"]


def test_a_model_that_cannot_be_placed_says_why(rig: ConsoleRig, store: Store) -> None:
    store.deploy_model("chat", profile="big", replicas=2)  # 2 GPUs each, the node has 2
    rig.scheduler.reconcile()

    async def scenario(b: Browser) -> tuple[str, str]:
        await b.login()
        _, table, _ = await b.get("/ui/models?fragment=deployed")
        _, page, _ = await b.get("/ui/models/chat")
        return table, page

    table, page = rig.run(scenario)
    reason = rig.scheduler.unplaceable["chat"].reason
    assert reason and "gpu-1" in reason
    assert "cannot be placed: " in table and 'id="model-unplaceable"' in page


def test_undeploy_needs_the_model_name(rig: ConsoleRig, store: Store) -> None:
    store.deploy_model("chat", profile="small", replicas=1)
    rig.scheduler.reconcile()

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        for confirm in ("", "embed", "chat"):
            status, body, resp = await b.post(
                "/ui/models/chat/undeploy", {"csrf": b.csrf, "confirm": confirm}
            )
            if status == 303:
                assert resp.headers["Location"] == "/ui/models"
                _, body, _ = await b.get("/ui/models")
            out.append((status, flash_of(body)))
        status, page, _ = await b.get("/ui/models/chat")
        out.append((status, page))
        return out

    (s1, f1), (s2, f2), (s3, f3), (gone, page) = rig.run(scenario)
    assert s1 == s2 == 400
    assert "confirm with its name ('chat')" in f1 and "confirm with its name" in f2
    assert (s3, f3) == (303, "info: model chat is undeployed: its replicas are stopping")
    assert gone == 404 and "chat" in page
    assert [e.actor for e in store.list_events() if e.kind == "model_undeployed"] == ["admin"]


def test_an_unknown_model_or_action(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        status, page, _ = await b.get("/ui/models/nobody")
        out.append((status, page))
        status, page, _ = await b.post("/ui/models/nobody/scale", {"csrf": b.csrf, "replicas": "1"})
        out.append((status, page))
        status, page, _ = await b.post("/ui/models/chat/explode", {"csrf": b.csrf})
        out.append((status, page))
        return out

    (s1, p1), (s2, p2), (s3, p3) = rig.run(scenario)
    assert s1 == 404 and "no model" in p1.lower() and "<h1" in p1
    assert s2 == 404 and "nobody" in p2
    assert s3 == 404 and "scale, profile, undeploy" in p3


def test_a_model_name_with_a_slash_has_its_page_and_actions(rig: ConsoleRig, store: Store) -> None:
    store.put_catalog_model("org/chat", {"default": {"engine": "sim"}})

    async def scenario(b: Browser) -> tuple[tuple[int, str, Any], int, str]:
        await b.login()
        answer = await deploy(b, name="org/chat", profile="default", replicas="1")
        status, page, _ = await b.get(answer[2].headers["Location"])
        return answer, status, page

    (status, _body, resp), page_status, page = rig.run(scenario)
    assert status == 303 and resp.headers["Location"] == "/ui/models/org/chat"
    assert page_status == 200 and 'action="/ui/models/org/chat/scale"' in page
    assert store.get_model("org/chat").replicas == 1


def test_a_viewer_sees_no_form_and_its_posts_are_refused(rig: ConsoleRig, store: Store) -> None:
    store.deploy_model("chat", profile="small", replicas=1)

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login("vera", VIEWER_PW)
        out = []
        for path in ("/ui/models", "/ui/models/chat"):
            out.append((await b.get(path))[:2])
        for path, fields in (
            ("/ui/models", {"name": "embed", "profile": "default", "replicas": "1"}),
            ("/ui/models/chat/scale", {"replicas": "3"}),
            ("/ui/models/chat/undeploy", {"confirm": "chat"}),
        ):
            out.append((await b.post(path, {"csrf": b.csrf, **fields}))[:2])
        return out

    (s1, models), (s2, model), *posts = rig.run(scenario)
    assert s1 == s2 == 200
    assert "<form" in models and 'id="deploy-form"' not in models and "Deploy…" not in models
    assert 'id="model-actions"' not in model and 'id="action-undeploy"' not in model
    for status, page in posts:
        assert status == 403 and "is a viewer and may only read" in page
    assert store.get_model("chat").replicas == 1 and store.get_model("embed").replicas == 0


def test_a_post_without_its_csrf_token_changes_nothing(rig: ConsoleRig, store: Store) -> None:
    store.deploy_model("chat", profile="small", replicas=1)

    async def scenario(b: Browser) -> list[int]:
        await b.login()
        return [
            (await b.post("/ui/models", {"name": "embed", "profile": "default"}))[0],
            (await b.post("/ui/models/chat/undeploy", {"confirm": "chat", "csrf": "forged"}))[0],
        ]

    assert rig.run(scenario) == [403, 403]
    assert store.get_model("chat").replicas == 1 and store.get_model("embed").replicas == 0


def test_hostile_text_from_a_catalog_or_an_agent_is_escaped(rig: ConsoleRig, store: Store) -> None:
    """A model's weights path (the catalog's) and a shard's failure (an agent's words) are
    other people's text: shown, never run."""
    store.put_catalog_model("wild", {"default": {"engine": "sim", "source": HOSTILE}})
    store.deploy_model("wild", profile="default", replicas=1)
    rig.scheduler.reconcile()
    shard = store.list_shards(replica_id=store.list_replicas("wild")[0].id)[0]
    store.update_shard(shard.id, state="failed", reason=HOSTILE, exit_code=3, restarts=2)

    async def scenario(b: Browser) -> list[str]:
        await b.login()
        return [(await b.get(path))[1] for path in ("/ui/models", "/ui/models/wild")]

    models, model = rig.run(scenario)
    for page in (models, model):
        assert "<script>" not in page
    assert "<code>&lt;script&gt;alert(" in models  # the weights column
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; (exit 3)" in model
    assert '<td class="num">2</td>' in model  # its restarts


def test_a_refused_actions_page_keeps_its_replicas_live(rig: ConsoleRig, store: Store) -> None:
    """The page a refused POST answers stands at the action's URL: its live part names the
    model page's own, which answers the fragment."""
    store.deploy_model("chat", profile="small", replicas=1)

    async def scenario(b: Browser) -> tuple[int, str, int, str]:
        await b.login()
        status, page, _ = await b.post("/ui/models/chat/scale", {"csrf": b.csrf, "replicas": "x"})
        found = re.search(r'data-live="detail" data-live-url="([^"]+)"', page)
        assert found is not None
        live_status, live, _ = await b.get(html.unescape(found.group(1)))
        return status, found.group(1), live_status, live

    status, url, live_status, live = rig.run(scenario)
    assert status == 400 and url == "/ui/models/chat?fragment=detail"
    assert live_status == 200 and 'id="model-ready"' in live and "<html" not in live


def test_scale_by_demand_through_the_model_page(rig: ConsoleRig, store: Store) -> None:
    store.deploy_model("chat", profile="small", replicas=1)

    async def scenario(b: Browser) -> list[tuple[int, str, str]]:
        await b.login()
        out = []
        for fields in ({"replicas": "3-1"}, {"replicas": "0-3"}, {"replicas": "2"}):
            status, body, _ = await b.post("/ui/models/chat/scale", {"csrf": b.csrf, **fields})
            if status == 303:
                _, body, _ = await b.get("/ui/models/chat")
            out.append((status, flash_of(body), body))
        return out

    (backwards, b1, _), (ranged, r1, page), (fixed, f1, again) = rig.run(scenario)
    assert backwards == 400 and "min (3) is above max (1); give min <= max" in b1
    assert ranged == 303 and r1 == "info: model chat: 0-3 replicas by demand (1 now)"
    assert 'id="model-scaling">0-3 replicas, 8 in flight each' in page
    assert 'value="0-3"' in page  # the form shows the range it scales in
    assert fixed == 303 and f1 == "info: model chat: 2 replica(s) wanted"
    assert 'id="model-scaling"' not in again  # a fixed count again
    assert store.get_model("chat").scaling == {}


def test_the_scale_field_keeps_the_rest_of_the_models_policy(rig: ConsoleRig, store: Store) -> None:
    # The field sets the range (and prefetch); the target, windows, priority and sleep set
    # by ctl or the API stay: a new range is not a new policy.
    store.deploy_model("chat", profile="small", replicas=1)
    policy = {
        "min": 0,
        "max": 3,
        "target_inflight": 4,
        "scale_down_after": 60.0,
        "cold_start_timeout": 30.0,
        "priority": "high",
        "sleep_after": 120.0,
        "ttft_slo": 2.0,
    }
    store.set_scaling("chat", policy, replicas=1)

    async def scenario(b: Browser) -> list[tuple[int, Any]]:
        await b.login()
        out = []
        for fields in ({"replicas": "1-5"}, {"replicas": "2"}):
            status, _, _ = await b.post("/ui/models/chat/scale", {"csrf": b.csrf, **fields})
            out.append((status, store.get_model("chat").scaling))
        return out

    (ranged, kept), (fixed, dropped) = rig.run(scenario)
    assert ranged == 303 and kept == {**policy, "min": 1, "max": 5}
    assert fixed == 303 and dropped == {}  # a fixed count has no policy


def test_the_scale_field_sends_prefetch_with_the_policy_and_the_page_shows_it(
    rig: ConsoleRig, store: Store
) -> None:
    store.deploy_model("chat", profile="small", replicas=1)
    forms = (
        {"replicas": "0-3", "prefetch": "on"},
        {"replicas": "2", "prefetch": "on"},
        {"replicas": "9-1", "prefetch": "on"},  # refused: the form keeps the tick
        {"replicas": "0-3"},  # unticked: prefetch off again
    )

    async def scenario(b: Browser) -> list[tuple[int, str, str, Any]]:
        await b.login()
        out = []
        for fields in forms:
            status, body, _ = await b.post("/ui/models/chat/scale", {"csrf": b.csrf, **fields})
            if status == 303:
                _, body, _ = await b.get("/ui/models/chat")
            out.append((status, flash_of(body), body, store.get_model("chat").scaling))
        return out

    ranged, fixed, refused, off = rig.run(scenario)
    assert ranged[:2] == (303, "info: model chat: 0-3 replicas by demand (1 now), prefetch")
    assert (ranged[3]["min"], ranged[3]["max"], ranged[3]["prefetch"]) == (0, 3, True)
    assert '<span id="model-prefetch">prefetch</span>' in ranged[2]
    assert re.search(r'id="scale-prefetch"[^>]* checked>', ranged[2])
    assert fixed[:2] == (303, "info: model chat: 2 replica(s) wanted, prefetch")
    assert (fixed[3]["min"], fixed[3]["max"], fixed[3]["prefetch"]) == (2, 2, True)
    assert 'value="2"' in fixed[2] and re.search(r'id="scale-prefetch"[^>]* checked>', fixed[2])
    assert refused[0] == 400 and "min (9) is above max (1)" in refused[1]
    assert re.search(r'id="scale-prefetch"[^>]* checked>', refused[2])
    assert off[0] == 303 and "prefetch" not in off[3]
    assert 'id="model-prefetch"' not in off[2]
    assert re.search(r'id="scale-prefetch"[^>]*>', off[2])
    assert not re.search(r'id="scale-prefetch"[^>]* checked>', off[2])


def test_a_model_by_demand_charts_its_replicas_against_its_demand(
    rig: ConsoleRig, store: Store
) -> None:
    store.deploy_model("chat", profile="small", replicas=1)
    store.set_scaling("chat", {"min": 0, "max": 3}, replicas=1)
    wall = [NOW - 600.0]
    demand = {"chat": Demand(inflight=5)}
    planner = Planner(
        store,
        demand=lambda: demand,
        kick_scheduler=lambda: None,
        ready=lambda model: 1,
        wall_clock=lambda: wall[0],
    )
    rig.ctx.planner = planner
    for _ in range(3):
        planner.plan()
        wall[0] += 10

    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/models/chat")
        return page

    page = rig.run(scenario)
    assert 'id="model-scaling-chart"' in page
    assert "chat: replicas and demand" in page
    assert ">wanted<" in page and ">demand<" in page
    assert "now 5 in flight, 0 queued, 0 waiting for a replica" in page


def test_an_asleep_replica_shows_its_level_and_host_memory(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> str:
        await b.login()
        await deploy(b, name="chat", profile="small", replicas="1")
        rig.scheduler.reconcile()
        (replica,) = store.list_replicas("chat")
        store.set_replica_state(replica.id, "asleep")
        for shard in store.list_shards(replica_id=replica.id):
            store.update_shard(shard.id, state="asleep", sleep_level=1, host_memory_mib=512)
        _, live, _ = await b.get("/ui/models/chat?fragment=detail")
        return live

    live = rig.run(scenario)
    assert (
        '<span class="replica-state state-asleep">asleep</span> (level 1, 512 MiB host memory)'
        in live
    )


def test_a_disaggregated_model_shows_both_pools_and_their_replicas(
    rig: ConsoleRig, store: Store
) -> None:
    """Deployed from the page (the form's count is the aggregated profiles'), listed once with
    each pool's ready of desired, its page with both pools and their replicas by role."""
    split = {
        "engine": "sim",
        "gpus": 1,
        "disaggregated": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}},
    }
    store.put_catalog_model("pd", {"split": split})

    async def scenario(b: Browser) -> tuple[tuple[int, str, Any], str, str]:
        await b.login()
        answer = await deploy(b, name="pd", profile="split", replicas="3")
        rig.scheduler.reconcile()
        _ready(rig, "pd#prefill")
        _, table, _ = await b.get("/ui/models?fragment=deployed")
        _, live, _ = await b.get("/ui/models/pd?fragment=detail")
        return answer, table, live

    (status, _body, resp), table, live = rig.run(scenario)
    assert status == 303 and resp.headers["Location"] == "/ui/models/pd"
    assert 'data-model="pd"' in table and "pd#" not in table
    assert (
        '<span class="pool" data-role="prefill">prefill <span class="ready">1</span> / '
        '<span class="desired">1</span></span>, <span class="pool" data-role="decode">decode '
        '<span class="ready">0</span> / <span class="desired">1</span></span>'
    ) in table
    assert 'id="model-pool-prefill">1 / 1 ready, 1 GPU(s) each' in live
    assert 'id="model-pool-decode">0 / 1 ready' in live
    for role in ("prefill", "decode"):
        (replica,) = store.list_replicas(f"pd#{role}")
        row = re.search(f'<tr data-replica="{replica.id}">.*?</tr>', live, re.S)
        assert row is not None and f'<td class="role">{role}</td>' in row.group(0)
    # Nothing handed over yet: zeros, and bytes that cannot be counted said so.
    assert 'id="handover-done">0</td>' in live
    assert 'id="handover-seconds">-</td>' in live
    assert "(the profile sets no kv_bytes_per_token)" in live


def test_a_disaggregated_models_page_shows_its_pools_load_and_hand_over(
    rig: ConsoleRig, store: Store
) -> None:
    """The page's hand-over table: this gateway's counts (fallbacks with their reasons, the
    hand-over's time from its histogram, tokens and bytes moved) and each pool's load."""
    split = {
        "engine": "sim",
        "gpus": 1,
        "disaggregated": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}},
    }
    store.put_catalog_model("pd", {"split": split})
    m = rig.ctx.metrics
    m.disagg_requests.inc(("pd", "handed_over"), 7)
    m.disagg_requests.inc(("pd", "fallback"), 2)
    m.disagg_fallbacks.inc(("pd", "transfer_timeout"), 2)
    m.disagg_handover.observe(("pd",), 0.02)
    m.disagg_transfer_tokens.inc(("pd",), 70000)
    m.disagg_transfer_bytes.inc(("pd",), 70000 * 131072)

    async def scenario(b: Browser) -> str:
        await b.login()
        await deploy(b, name="pd", profile="split", replicas="1")
        rig.scheduler.reconcile()
        _ready(rig, "pd#decode")
        (ep,) = rig.scheduler.router.endpoints("pd#decode")
        ep.inflight, ep.tokens, ep.decoding = 3, 300, 250
        _, live, _ = await b.get("/ui/models/pd?fragment=detail")
        return live

    live = rig.run(scenario)
    assert 'id="handover-done">7</td>' in live
    assert '<span class="fallback" data-reason="transfer_timeout">transfer_timeout 2</span>' in live
    assert re.search(r'id="handover-seconds">0\.0\d\d s / 0\.0\d\d s</td>', live)
    assert 'id="handover-tokens">70000</td>' in live
    assert 'id="handover-bytes">8.5 GiB</td>' in live
    decode = re.search(r'<tr data-role="decode">.*?</tr>', live, re.S)
    assert decode is not None
    assert [c for c in re.findall(r'<td class="num">(\d+)</td>', decode.group(0))] == [
        "3",
        "300",
        "250",
    ]


def test_a_disaggregated_models_page_scales_each_pool_with_the_same_refusals(
    rig: ConsoleRig, store: Store
) -> None:
    """Its scale form has a field per pool (no Replicas field to dead-end on): a count or a
    range each, either or both, as ``ctl deploy --prefill/--decode``; a range keeps the
    rest of that pool's policy; each refusal shown on the page with the pools' form."""
    split = {
        "engine": "sim",
        "gpus": 1,
        "disaggregated": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}},
    }
    store.put_catalog_model("pd", {"split": split})

    async def scenario(b: Browser) -> tuple[str, list[tuple[int, str, str]]]:
        await b.login()
        await deploy(b, name="pd", profile="split")
        store.set_scaling("pd#decode", {"min": 1, "max": 2, "priority": "high"}, replicas=1)
        _, page, _ = await b.get("/ui/models/pd")
        out = []
        for fields in (
            {"prefill": "2", "decode": "1-4"},
            {"decode": "3"},
            {"replicas": "3"},
            {"prefill": "", "decode": ""},
            {"prefill": "x"},
            {"decode": "4-2"},
        ):
            status, body, resp = await b.post("/ui/models/pd/scale", {"csrf": b.csrf, **fields})
            if status == 303:
                assert resp.headers["Location"] == "/ui/models/pd"
                _, body, _ = await b.get("/ui/models/pd")
            out.append((status, flash_of(body), body))
        return page, out

    page, (both, one, replicas, empty, bad, backwards) = rig.run(scenario)
    assert 'id="scale-replicas"' not in page and 'id="scale-prefetch"' not in page
    # Its own count is 0 (it places nothing): the undeploy dialog names its pools instead.
    assert 'data-confirm="Undeploy model pd? The replicas of its prefill and decode pools stop' in (
        page
    )
    assert re.search(r'id="scale-prefill" name="prefill"[^>]* value="1"', page)
    assert re.search(r'id="scale-decode" name="decode"[^>]* value="1-2"', page)
    assert both[:2] == (
        303,
        "info: model pd's pools: prefill 2, decode 1-4 by demand (8 in flight each, priority high)",
    )
    assert re.search(r'id="scale-decode" name="decode"[^>]* value="1-4"', both[2])
    assert one[0] == 303 and one[1] == "info: model pd's pools: prefill 2, decode 3"
    assert (store.get_model("pd#prefill").replicas, store.get_model("pd#decode").replicas) == (
        2,
        3,
    )
    assert store.get_model("pd").replicas == 0  # the model places nothing: its pools do
    assert replicas[0] == 400 and "model pd is disaggregated" in replicas[1]
    assert "Prefill and/or Decode field" in replicas[1]
    assert 'id="scale-prefill"' in replicas[2]  # refused with the pools' form, not a dead end
    assert empty[0] == 400 and "no count given for model pd's pools" in empty[1]
    assert bad[0] == 400 and "the prefill pool's replicas must be a whole number" in bad[1]
    assert re.search(r'id="scale-prefill" name="prefill"[^>]* value="x"', bad[2])  # kept
    assert backwards[0] == 400 and "nothing done" in backwards[1]
    assert "pools.decode" in backwards[1]
    assert (store.get_model("pd#prefill").replicas, store.get_model("pd#decode").replicas) == (
        2,
        3,
    )


def test_a_pools_target_tokens_is_shown_and_kept_when_the_console_scales_it(
    rig: ConsoleRig, store: Store
) -> None:
    """A pool scaled by tokens says its target on the model's page; scaling it to another
    range through the console keeps the target (the rest of its policy)."""
    split = {
        "engine": "sim",
        "gpus": 1,
        "disaggregated": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}},
    }
    store.put_catalog_model("pd", {"split": split})

    async def scenario(b: Browser) -> tuple[str, int, str]:
        await b.login()
        await deploy(b, name="pd", profile="split")
        store.set_scaling("pd#prefill", {"min": 1, "max": 2, "target_tokens": 16000}, replicas=1)
        _, page, _ = await b.get("/ui/models/pd")
        status, _, _ = await b.post("/ui/models/pd/scale", {"csrf": b.csrf, "prefill": "1-6"})
        _, after, _ = await b.get("/ui/models/pd")
        return page, status, after

    page, status, after = rig.run(scenario)
    assert re.search(
        r'id="model-pool-prefill">[^<]*1-2 by demand \(<span class="target-tokens">16000 '
        r"prompt tokens each</span>",
        page,
    )
    assert status == 303
    assert store.get_model("pd#prefill").scaling["target_tokens"] == 16000
    assert store.get_model("pd#prefill").scaling["max"] == 6
    assert '1-6 by demand (<span class="target-tokens">16000 prompt tokens each' in after


def test_a_models_target_tokens_is_shown_beside_its_target_inflight(
    rig: ConsoleRig, store: Store
) -> None:
    store.deploy_model("chat", profile="small", replicas=1)
    store.set_scaling("chat", {"min": 0, "max": 3, "target_tokens": 4096}, replicas=1)

    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/models/chat")
        return page

    page = rig.run(scenario)
    assert 'id="model-scaling">0-3 replicas, 8 in flight or 4096 output tokens each' in page
