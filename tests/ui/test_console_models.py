"""The console's Models and API keys pages in Debian's Chromium against a real control plane
with a real agent (the fake nvidia-smi's GPU): an operator deploys a sim model from the
catalog and watches its replica become ready without a reload, switches its profile (a
rolling replacement), scales it and undeploys it through a dialog naming it; scales a
disaggregated model's pools each from its own field (a refusal kept in the form); creates an API
key in the page (a bad policy value refused in the form first), copies its secret with the
copy button, uses it with the official ``openai`` client against the gateway, and revokes
it, after which the client is refused. A viewer sees no form and its POST is refused. Each
page passes axe-core's check, breaks no CSP rule and is photographed at both sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.integration.harness import Agent, Server, start_server_with, stop_process, wait_for
from tests.ui.browser import expect
from tests.ui.console_rig import (
    LIVE,
    Account,
    add_accounts,
    checked,
    csrf_of,
    gpu_agent,
    mark,
    not_reloaded,
    sign_in,
    text_of,
)

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page

pytestmark = pytest.mark.integration

ADMIN = Account("mia", "mia-console-password-1", "admin")
VIEWER = Account("vic", "vic-console-password-1", "viewer")
CATALOG = {
    "models": {
        "sim-chat": {
            "profiles": {
                "small": {"engine": "sim"},
                "fast": {"engine": "sim", "params": {"tps": "500"}},
            }
        },
        "sim-split": {
            "profiles": {
                "split": {
                    "engine": "sim",
                    "disaggregated": {
                        "prefill": {"gpus": 0, "replicas": 1},
                        "decode": {"gpus": 0, "replicas": 1},
                    },
                }
            }
        },
    }
}
SERVED = "echo"  # deployed by the fixture: what the keys are used with

Shots = Callable[["Page", str], list[Path]]


@dataclass
class Fleet:
    server: Server
    agents: list[Agent]

    def url(self, path: str) -> str:
        return self.server.url + path

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return self.server.replicas(model)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("console-models")
    server = start_server_with(tmp)
    agents: list[Agent] = []
    try:
        agents.append(gpu_agent(tmp, server, "gpu-m", "one-gpu"))
        assert server.approve_pending(1) == ["gpu-m"]
        add_accounts(server, tmp, ADMIN, VIEWER)
        server.api("PUT", "/api/catalog", CATALOG)
        server.api("POST", "/api/models", {"name": SERVED, "engine": "sim", "replicas": 1})
        wait_for(
            lambda: [r["state"] for r in server.replicas(SERVED)] == ["ready"],
            what=f"{SERVED}'s replica ready",
        )
        yield Fleet(server, agents)
    finally:
        for agent in agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)


def signed_in(
    new_context: Callable[..., BrowserContext], fleet: Fleet, account: Account, path: str
) -> Page:
    page = new_context().new_page()
    sign_in(page, fleet.server.url, account, path)
    return page


def _ready(fleet: Fleet, model: str, count: int, profile: str) -> bool:
    rows = fleet.replicas(model)
    return len(rows) == count and all(
        r["state"] == "ready" and r["routable"] and r["profile"] == profile for r in rows
    )


def test_deploy_from_the_catalog_switch_profile_scale_and_undeploy(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    page = signed_in(new_context, fleet, ADMIN, "/ui/models")
    # The catalog's two profiles, beside the ad-hoc model's own "default".
    expect(page.locator("#catalog tbody tr[data-model='sim-chat']")).to_have_count(2)
    expect(page.locator(f"#catalog tbody tr[data-model='{SERVED}']")).to_have_count(1)
    expect(page.locator("#deployed-models tr[data-model='sim-chat']")).to_have_count(0)
    checked(page, screenshot, "models", "the Models page")

    # "Deploy…" on the catalog's row fills the form in (a bookmarkable URL).
    page.locator("#catalog tr[data-profile='small']").get_by_role("link").click()
    expect(page).to_have_url(fleet.url("/ui/models?name=sim-chat&profile=small#deploy"))
    expect(page.locator("#deploy-name")).to_have_value("sim-chat")
    expect(page.locator("#deploy-profile")).to_have_value("small")
    # Only the chosen model's profiles are offered; another model's choice follows it.
    page.select_option("#deploy-name", SERVED)
    expect(page.locator("#deploy-profile")).to_have_value("default")
    page.select_option("#deploy-name", "sim-chat")
    expect(page.locator("#deploy-profile")).to_have_value("fast")
    page.select_option("#deploy-profile", "small")
    page.fill("#deploy-replicas", "1")
    page.click("#deploy-button")
    expect(page).to_have_url(fleet.url("/ui/models/sim-chat"))
    expect(page.locator("#flash")).to_have_text(
        "model sim-chat: profile small, 1 replica(s) wanted; the scheduler places them"
    )
    mark(page)
    # The replica appears and becomes ready on the page's live part, without a reload.
    ready = page.locator("#model-replicas tbody tr .replica-state", has_text="ready")
    expect(ready).to_have_count(1, timeout=LIVE)
    expect(page.locator("#model-ready")).to_have_text("1 / 1", timeout=LIVE)
    expect(page.locator("#model-replicas tbody tr td").nth(2)).to_have_text("gpu-m")
    assert not_reloaded(page)
    assert _ready(fleet, "sim-chat", 1, "small")
    checked(page, screenshot, "model", "a model's page")

    # Switch profile: the old replica serves until its successor is ready.
    old = {r["replica"] for r in fleet.replicas("sim-chat")}
    page.select_option("#switch-profile", "fast")
    page.click("#button-profile")
    expect(page.locator("#flash")).to_contain_text("switches to profile fast")
    wait_for(lambda: _ready(fleet, "sim-chat", 1, "fast"), timeout=60, what="the profile rolled")
    assert not old & {r["replica"] for r in fleet.replicas("sim-chat")}
    expect(page.locator("#model-profile")).to_have_text("fast (sim)")
    expect(page.locator("#model-replicas tbody tr td").nth(1)).to_have_text("fast", timeout=LIVE)

    page.fill("#scale-replicas", "2")
    page.click("#button-scale")
    expect(page.locator("#flash")).to_have_text("model sim-chat: 2 replica(s) wanted")
    expect(page.locator("#model-ready")).to_have_text("2 / 2", timeout=LIVE)
    expect(page.locator("#scale-prefetch")).not_to_be_checked()
    # Prefetch rides on the same scale call: a count N is sent as {min: N, max: N}.
    page.check("#scale-prefetch")
    page.click("#button-scale")
    expect(page.locator("#flash")).to_have_text("model sim-chat: 2 replica(s) wanted, prefetch")
    expect(page.locator("#model-prefetch")).to_have_text("prefetch")
    expect(page.locator("#scale-prefetch")).to_be_checked()
    expect(page.locator("#scale-replicas")).to_have_value("2")
    scaling = next(m for m in fleet.server.api("GET", "/api/models") if m["name"] == "sim-chat")
    assert (scaling["scaling"]["min"], scaling["scaling"]["max"]) == (2, 2)
    assert scaling["scaling"]["prefetch"] is True
    expect(page.locator("#model-ready")).to_have_text("2 / 2", timeout=LIVE)

    # The Models page shows it deployed, ready/desired live.
    page.goto(fleet.url("/ui/models"))
    row = page.locator("#deployed-models tr[data-model='sim-chat']")
    expect(row.locator(".ready")).to_have_text("2")
    expect(row.locator(".desired")).to_have_text("2")
    checked(page, screenshot, "models-deployed", "the Models page with a deployed model")

    page.goto(fleet.url("/ui/models/sim-chat"))
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("#button-undeploy")
    # Dismissed: nothing done.
    assert any(m["name"] == "sim-chat" for m in fleet.server.api("GET", "/api/models"))
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#button-undeploy")
    expected = "Undeploy model sim-chat? Its 2 replica(s) stop and the gateway answers 404 for it."
    assert asked == [expected, expected]
    expect(page).to_have_url(fleet.url("/ui/models"))
    expect(page.locator("#flash")).to_have_text(
        "model sim-chat is undeployed: its replicas are stopping"
    )
    assert not any(m["name"] == "sim-chat" for m in fleet.server.api("GET", "/api/models"))
    events = fleet.server.api("GET", "/api/events?subject=sim-chat&limit=50")
    assert {e["actor"] for e in events if e["kind"] in ("model_deployed", "model_undeployed")} == {
        ADMIN.name
    }


def test_a_disaggregated_models_page_scales_each_pool(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    fleet.server.api("POST", "/api/models", {"name": "sim-split", "profile": "split"})
    try:
        page = signed_in(new_context, fleet, ADMIN, "/ui/models/sim-split")
        # A field per pool, each showing its count; no Replicas field the API would refuse.
        expect(page.locator("#scale-replicas")).to_have_count(0)
        expect(page.locator("#scale-prefill")).to_have_value("1")
        expect(page.locator("#scale-decode")).to_have_value("1")
        checked(page, screenshot, "model-pools", "a disaggregated model's page")
        page.fill("#scale-decode", "2")
        page.click("#button-scale")
        expect(page.locator("#flash")).to_have_text("model sim-split's pools: prefill 1, decode 2")
        expect(page.locator("#model-pool-decode")).to_contain_text("/ 2 ready")
        expect(page.locator("#scale-decode")).to_have_value("2")
        # Refused by the API as ctl's --prefill would be: said on the page, the input kept.
        page.fill("#scale-prefill", "5-2")
        page.click("#button-scale")
        expect(page.locator("#problem")).to_contain_text("nothing done: ")
        expect(page.locator("#problem")).to_contain_text("pools.prefill")
        expect(page.locator("#scale-prefill")).to_have_value("5-2")
        pools = next(
            m["pools"] for m in fleet.server.api("GET", "/api/models") if m["name"] == "sim-split"
        )
        assert (pools["prefill"]["replicas"], pools["decode"]["replicas"]) == (1, 2)
    finally:
        fleet.server.api("DELETE", "/api/models/sim-split")


def test_a_deploy_refused_says_why_in_the_form(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    page = signed_in(new_context, fleet, ADMIN, "/ui/models?name=sim-chat&profile=small")
    page.fill("#deploy-replicas", "5000")
    page.click("#deploy-button")
    expect(page.locator("#problem")).to_have_text(
        "replicas must be a whole number from 0 to 1000 (or MIN-MAX, e.g. 0-8, to scale by "
        "demand); got '5000'"
    )
    expect(page.locator("#deploy-replicas")).to_have_value("5000")


def test_create_a_key_copy_it_use_it_and_revoke_it(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    context = new_context(permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    sign_in(page, fleet.server.url, ADMIN, "/ui/keys")
    checked(page, screenshot, "keys", "the API keys page")

    # A bad policy value is refused in the form, what was typed kept.
    page.fill("#key-name", "browser-app")
    page.fill("#key-models", SERVED)
    page.fill("#key-rpm", "lots")
    page.click("#key-create")
    expect(page.locator("#problem")).to_contain_text("rpm must be a whole number")
    expect(page.locator("#key-name")).to_have_value("browser-app")
    expect(page.locator("#key-rpm")).to_have_value("lots")

    page.fill("#key-rpm", "600")
    page.fill("#key-budget", "1M/day")
    page.click("#key-create")
    expect(page.locator("h1")).to_have_text("API key browser-app created")
    secret = page.locator("#key-secret-text").input_value()
    assert secret.startswith("sk-llmgw-")
    page.click("#key-secret-copy")
    expect(page.locator("#key-secret-copy")).to_have_text("Copied")
    expect(page.locator("#key-secret-copied")).to_have_text("copied to the clipboard")
    copied = page.evaluate("() => navigator.clipboard.readText()")
    assert copied == secret
    checked(page, screenshot, "key-created", "a new key's page")

    client = openai.OpenAI(base_url=fleet.url("/v1"), api_key=copied, max_retries=0, timeout=30)
    answer = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert answer.choices[0].message.content

    # Never shown again: not on the list, the key's page or the events.
    for path in ("/ui/keys", "/ui/events"):
        page.goto(fleet.url(path))
        assert secret not in page.content()
    page.goto(fleet.url("/ui/keys"))
    row = page.locator("#keys tbody tr", has_text="browser-app")
    expect(row).to_contain_text("models echo, rpm 600, budget 1M/day")
    expect(row.locator("td.num")).to_contain_text("1 req")
    # Its next use shows up live (this instance's counts, flushed or not).
    mark(page)
    client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "more"}], max_tokens=8
    )
    expect(row.locator("td.num")).to_contain_text("2 req", timeout=LIVE)
    assert not_reloaded(page)
    checked(page, screenshot, "keys-list", "the API keys page with a key")
    row.get_by_role("link", name="browser-app").click()
    expect(page.locator("#key-name")).to_have_text("browser-app")
    assert secret not in page.content()
    checked(page, screenshot, "key", "a key's page")

    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#button-revoke")
    assert asked and asked[0].startswith("Revoke API key browser-app (")
    expect(page.locator("#flash")).to_contain_text("API key browser-app (")
    expect(page.locator("#key-state")).to_contain_text("revoked")
    expect(page.locator("#button-revoke")).to_have_count(0)

    def refused() -> bool:
        try:
            client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": "again"}], max_tokens=4
            )
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, timeout=10, what="the revoked key refused by the gateway")


def test_a_viewer_sees_no_forms_and_its_post_is_refused(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    page = signed_in(new_context, fleet, VIEWER, "/ui/models")
    expect(page.locator("#catalog tbody tr").first).to_be_visible()
    expect(page.locator("#deploy-form")).to_have_count(0)
    page.goto(fleet.url("/ui/models/" + SERVED))
    expect(page.locator("#model-actions")).to_have_count(0)
    page.goto(fleet.url("/ui/keys"))
    expect(page.locator("#key-form")).to_have_count(0)
    before = len(fleet.server.api("GET", "/api/keys"))
    answer = page.request.post(
        fleet.url("/ui/keys"),
        form={"csrf": csrf_of(page), "name": "viewer-made"},
        headers={"Origin": fleet.server.url},
    )
    assert answer.status == 403 and "is a viewer and may only read" in text_of(answer)
    answer = page.request.post(
        fleet.url(f"/ui/models/{SERVED}/undeploy"),
        form={"csrf": csrf_of(page), "confirm": SERVED},
        headers={"Origin": fleet.server.url},
    )
    assert answer.status == 403
    assert len(fleet.server.api("GET", "/api/keys")) == before
    assert [r["state"] for r in fleet.replicas(SERVED)] == ["ready"]
