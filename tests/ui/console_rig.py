"""What the console's browser tests share: the accounts, ``llmgw ctl`` as an operator runs it,
agents with fake GPUs, signing in, and the checks every photographed page passes."""

from __future__ import annotations

import html
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.integration.harness import LLMGW, Agent, Server, make_agent, start_agent
from tests.ui.browser import check_accessibility, check_fits_phone, check_tables, expect

if TYPE_CHECKING:
    from playwright.sync_api import Page

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
LIVE = 15_000  # ms: a live part refreshes every 5 s; a replica starts within that


@dataclass(frozen=True)
class Account:
    name: str
    password: str
    role: str


ADMIN = Account("ops", "ops-console-password-1", "admin")
VIEWER = Account("vera", "vera-console-password-1", "viewer")


Shots = Callable[["Page", str], list[Path]]


def ctl(server: Server, tmp: Path, *args: str, password: str = "") -> str:
    """``llmgw ctl ARGS`` with the admin token, as an operator's script runs it."""
    # No LLMGW_* setting of the caller's leaks in, nor an operator's ctl.yaml.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {
        "XDG_CONFIG_HOME": str(tmp / "xdg"),
        "LLMGW_SERVER": server.url,
        "LLMGW_TOKEN": server.admin_token,
        "LLMGW_USER_PASSWORD": password,
        # Making an admin is confirmed with the operator's own password, as a signing is.
        "LLMGW_ADMIN_PASSWORD": (server.state_dir / "admin.password").read_text().strip(),
    }
    out = subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert out.returncode == 0, f"ctl {' '.join(args)}: {out.stderr}"
    return out.stdout


def add_accounts(server: Server, tmp: Path, *accounts: Account) -> None:
    for account in accounts:
        ctl(
            server,
            tmp,
            "users",
            "add",
            account.name,
            "--role",
            account.role,
            password=account.password,
        )


def gpu_agent(tmp: Path, server: Server, node_id: str, fixture: str) -> Agent:
    """An agent whose GPUs are those the fake nvidia-smi ``fixture`` prints."""
    extra = {"discovery": {"nvidia_smi": str(FIXTURES / fixture)}}
    return start_agent(make_agent(tmp, server, node_id, extra=extra))


def sign_in(page: Page, base: str, account: Account, path: str = "/ui/") -> None:
    """Open ``path`` signed out, get the login page, sign in, land back on ``path``."""
    page.goto(base + path)
    expect(page).to_have_url(re.compile(re.escape(base) + r"/ui/login\?next="))
    page.fill("#login-name", account.name)
    page.fill("#login-password", account.password)
    page.click("#login-submit")
    expect(page).to_have_url(base + path)
    expect(page.locator("#account")).to_have_text(f"{account.name} ({account.role})")


def mark(page: Page) -> None:
    """A value kept in the page's window: still there later, the page was not reloaded."""
    page.evaluate("() => { window.llmgwTestMark = 'not reloaded' }")


def not_reloaded(page: Page) -> bool:
    return bool(page.evaluate("() => window.llmgwTestMark === 'not reloaded'"))


def csrf_of(page: Page) -> str:
    """The session's CSRF token, from the sign-out form every signed-in page carries."""
    value = page.locator("form[action='/ui/logout'] input[name=csrf]").get_attribute("value")
    assert value, "no CSRF token in the page's sign-out form"
    return value


def text_of(answer: Any) -> str:
    """An HTML answer's body as its reader sees the text (entities decoded)."""
    return html.unescape(answer.text())


def checked(page: Page, screenshot: Shots, name: str, what: str) -> None:
    """The page photographed at both sizes, then checked: axe-core's rules, a phone's
    width without scrolling sideways, and its tables at both sizes (no cell cut off, values
    under their headers, a wide table scrolling in its box with a cue)."""
    screenshot(page, name)
    check_accessibility(page, what)
    check_fits_phone(page, what)
    check_tables(page, what)
