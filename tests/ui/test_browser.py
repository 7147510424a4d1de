"""The browser tests' own helpers, each proved on tiny pages of this module's own server
(aiohttp, under the console's policy ``default-src 'self'``): the CSP collector reports an
inline script, an inline style and a foreign load and nothing else, the accessibility check
fails a form field without a label, and the screenshots come at both sizes."""

from __future__ import annotations

import asyncio
import re
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from aiohttp import web

from llmgw.server.console.render import STATIC_DIR
from tests.ui import browser as helpers
from tests.ui.browser import (
    CHROMIUM_ENV,
    CspViolation,
    CspViolations,
    Screenshots,
    axe_violations,
    check_accessibility,
    check_fits_phone,
    check_tables,
    chromium_executable,
    expect,
    launch_options,
)

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page

pytestmark = pytest.mark.integration

CSP = "default-src 'self'"


def _page(body: str, *, head: str = "") -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tiny</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{head}</head>'
        f"<body><main><h1>Tiny page</h1>{body}</main></body></html>"
    )


_SHEET = '<link rel="stylesheet" href="/site.css">'
# Six columns of a few words each: wider than a phone, narrower than a laptop.
_WIDE_TABLE = (
    '<div class="scroll"><table id="wide"><thead><tr>'
    + "".join(f"<th>Column {i}</th>" for i in range(6))
    + "</tr></thead><tbody><tr>"
    + "".join(f"<td>value number {i}</td>" for i in range(6))
    + "</tr></tbody></table></div>"
)
PAGES = {
    # A script from 'self' runs: it marks the page, so a test sees the policy let it through.
    "/clean": _page(
        '<form><label for="q">Query</label><input id="q" name="q" type="text"></form>'
        '<script src="/app.js"></script>'
    ),
    "/inline-script": _page("<script>document.body.dataset.inline = 'ran'</script>"),
    "/inline-style": _page('<p style="color: red">styled in the element</p>'),
    "/foreign": _page('<img src="http://127.0.0.2:9/pixel.png" alt="a pixel from elsewhere">'),
    "/missing-image": _page('<img src="/nothing-here.png" alt="an image that is missing">'),
    "/unlabelled": _page('<form><input name="q" type="text"></form>'),
    "/tall": _page("".join(f"<p>line {i}</p>" for i in range(120))),
    # Widths need a style sheet: the policy refuses style attributes.
    "/wide": _page('<pre id="wide-text">' + "x" * 300 + "</pre>", head=_SHEET),
    "/wide-in-scroll": _page(
        '<div class="scroll"><pre id="wide-text">' + "x" * 300 + "</pre></div>", head=_SHEET
    ),
    "/table-spill": _page(
        '<table id="spill"><thead><tr><th>Node</th><th>Message</th></tr></thead><tbody>'
        '<tr><td>gpu-1</td><td class="clip">' + "sha256:" + "ab" * 32 + "</td></tr>"
        "</tbody></table>",
        head=_SHEET,
    ),
    "/table-misaligned": _page(
        '<table id="models" class="full"><thead><tr><th>Model</th>'
        "<th>Replicas ready / desired</th></tr></thead>"
        '<tbody><tr><td>chat</td><td class="num">1 / 1</td></tr></tbody></table>',
        head=_SHEET,
    ),
    "/table-wide-bare": _page(_WIDE_TABLE, head=_SHEET),
    # The console's own style sheet and script: the cue they give passes.
    "/table-wide-console": _page(
        _WIDE_TABLE,
        head='<link rel="stylesheet" href="/console.css"><script src="/console.js" defer></script>',
    ),
}
APP_JS = "document.body.dataset.external = 'ran';\n"
SITE_CSS = (
    ".scroll { overflow-x: auto; }\n"
    "td.clip { max-width: 4rem; overflow: hidden; white-space: nowrap; }\n"
    "table.full { width: 100%; }\n"
    "td.num { text-align: right; }\n"
    ".scroll table { width: max-content; }\n"
)
CONSOLE_FILES = {"/console.css": "text/css", "/console.js": "text/javascript"}


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """The pages above on a free loopback port, served from a thread of this process."""

    async def page(request: web.Request) -> web.StreamResponse:
        if request.path == "/app.js":
            return web.Response(text=APP_JS, content_type="text/javascript")
        if request.path == "/site.css":
            return web.Response(text=SITE_CSS, content_type="text/css")
        if request.path in CONSOLE_FILES:
            body = (STATIC_DIR / request.path.lstrip("/")).read_text()
            return web.Response(text=body, content_type=CONSOLE_FILES[request.path])
        if request.path not in PAGES:
            raise web.HTTPNotFound()
        return web.Response(
            text=PAGES[request.path],
            content_type="text/html",
            headers={"Content-Security-Policy": CSP},
        )

    app = web.Application()
    app.router.add_get("/{name:.*}", page)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        # All of it on this thread: between its calls, Playwright's sync API marks the
        # test's thread as running an event loop, and no other loop may run there.
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(timeout=10), "the tiny site did not start"
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# --------------------------------------------------------------------------- CSP


def test_a_clean_page_reports_no_violation_and_its_own_script_runs(
    page: Page, site: str, csp: CspViolations
) -> None:
    page.goto(site + "/clean")
    page.wait_for_function("() => document.body.dataset.external === 'ran'")
    assert csp.take() == []


def test_an_inline_script_is_blocked_and_reported(
    page: Page, site: str, csp: CspViolations
) -> None:
    page.goto(site + "/inline-script")
    found = csp.take()
    assert len(found) == 1, found
    assert found[0].url == site + "/inline-script"
    assert "inline script" in found[0].text
    assert "default-src 'self'" in found[0].text
    assert page.evaluate("() => document.body.dataset.inline") is None  # blocked, not run
    assert csp.take() == []  # taken once


def test_an_inline_style_and_a_foreign_load_are_reported(
    page: Page, site: str, csp: CspViolations
) -> None:
    page.goto(site + "/inline-style")
    page.goto(site + "/foreign")
    found = csp.take()
    assert [v.url for v in found] == [site + "/inline-style", site + "/foreign"], found
    assert "inline style" in found[0].text
    assert "http://127.0.0.2:9/pixel.png" in found[1].text


def test_other_console_errors_are_not_csp_violations(
    page: Page, site: str, csp: CspViolations
) -> None:
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text))
    page.goto(site + "/missing-image")
    page.wait_for_load_state("load")
    assert csp.take() == []
    assert any("404" in e for e in errors), errors  # the browser did complain, of a 404


def test_every_page_of_a_watched_context_is_watched(
    new_context: Callable[..., BrowserContext], site: str, csp: CspViolations
) -> None:
    context = new_context()
    first, second = context.new_page(), context.new_page()
    first.goto(site + "/clean")
    second.goto(site + "/inline-script")
    assert [v.url for v in csp.take()] == [site + "/inline-script"]


def test_assert_none_lists_each_violation_with_its_page() -> None:
    violations = CspViolations()
    violations._found.append(CspViolation("http://x/ui/", "Executing inline script violates"))
    with pytest.raises(AssertionError) as failure:
        violations.assert_none()
    message = str(failure.value)
    assert "1 Content Security Policy violation(s)" in message
    assert "http://x/ui/: Executing inline script violates" in message
    assert "move it into a file served by the console" in message
    violations.assert_none()  # reported once


# --------------------------------------------------------------------------- accessibility


def test_a_field_without_a_label_fails_the_accessibility_check(page: Page, site: str) -> None:
    page.goto(site + "/unlabelled")
    with pytest.raises(AssertionError) as failure:
        check_accessibility(page, "the unlabelled page")
    message = str(failure.value)
    assert "the unlabelled page (" + site + "/unlabelled)" in message
    assert "[critical] label: Form elements must have labels" in message
    assert "https://dequeuniversity.com/rules/axe/4.14/label" in message
    assert "on input" in message


def test_a_labelled_page_passes_and_axe_runs_under_the_policy(
    page: Page, site: str, csp: CspViolations
) -> None:
    page.goto(site + "/clean")
    lesser = check_accessibility(page, "the clean page")
    assert all(v.impact in ("moderate", "minor") for v in lesser), lesser
    # Evaluated through the protocol, axe broke nothing of the page's policy; run again on
    # the same document, it is not evaluated a second time.
    assert csp.take() == []
    assert axe_violations(page) == lesser


def test_a_changed_axe_file_is_refused(
    page: Page, site: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changed = tmp_path / "axe.min.js"
    changed.write_text("window.axe = {run: async () => ({violations: []})};\n")
    monkeypatch.setattr(helpers, "AXE", changed)
    page.goto(site + "/unlabelled")
    with pytest.raises(AssertionError, match=r"not the vendored release's 29348999"):
        axe_violations(page)
    assert page.evaluate("() => typeof window.axe") == "undefined"  # nothing evaluated


# --------------------------------------------------------------------------- screenshots


def test_screenshots_come_at_both_sizes_and_give_the_viewport_back(
    page: Page, site: str, screenshots: Screenshots
) -> None:
    page.goto(site + "/tall")
    paths = screenshots.take(page, "helpers/tall page")
    assert [p.name for p in paths] == [
        "helpers-tall-page-laptop.png",
        "helpers-tall-page-phone.png",
    ]
    assert all(p.parent == screenshots.directory for p in paths)
    (laptop_w, laptop_h), (phone_w, phone_h) = (png_size(p) for p in paths)
    assert (laptop_w, phone_w) == (1366, 390)
    assert laptop_h > 900 and phone_h > 844  # the whole page, not only the viewport
    assert page.viewport_size == {"width": 1366, "height": 900}
    with pytest.raises(ValueError, match="taken already this session"):
        screenshots.take(page, "helpers/tall page")
    with pytest.raises(ValueError, match="no letter or digit"):
        screenshots.take(page, "//")


def test_a_failed_tests_page_is_kept_apart(page: Page, site: str, tmp_path: Path) -> None:
    shots = Screenshots(tmp_path)
    page.goto(site + "/clean")
    first = shots.take_failure(page, "test_x[param]")
    second = shots.take_failure(page, "test_x[param]")
    assert first == tmp_path / "failures" / "test_x-param.png"
    assert second == tmp_path / "failures" / "test_x-param-2.png"
    assert png_size(first)[0] == 1366
    page.close()
    assert shots.take_failure(page, "test_x[param]") is None  # the test's own error stands


def test_the_session_directory_holds_this_runs_pictures_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "shots"
    (directory / "failures").mkdir(parents=True)
    (directory / "old-laptop.png").write_bytes(b"from an earlier run")
    (directory / "failures" / "old.png").write_bytes(b"from an earlier run")
    (directory / "notes.txt").write_text("not a picture of ours\n")
    monkeypatch.setenv(helpers.SCREENSHOTS_ENV, str(directory))
    shots = Screenshots.for_session()
    assert shots.directory == directory and shots.taken == []
    assert sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")) == [
        "failures",
        "notes.txt",
    ]
    monkeypatch.setenv(helpers.SCREENSHOTS_ENV, str(tmp_path / "new" / "shots"))
    assert Screenshots.for_session().directory.is_dir()  # made when missing


def test_a_page_wider_than_a_phone_is_refused_a_scroll_box_is_not(page: Page, site: str) -> None:
    page.goto(site + "/wide")
    with pytest.raises(AssertionError) as failure:
        check_fits_phone(page, "the wide page")
    message = str(failure.value)
    assert f"the wide page ({site}/wide) is " in message
    assert "px wide on a 390 px phone" in message
    assert "pre#wide-text" in message
    assert page.viewport_size == {"width": 1366, "height": 900}
    page.goto(site + "/wide-in-scroll")
    check_fits_phone(page, "the page whose wide part scrolls in its box")
    page.goto(site + "/clean")
    check_fits_phone(page, "the clean page")


def test_a_cut_off_cell_a_number_off_its_header_and_a_wide_table_without_cue_are_refused(
    page: Page, site: str
) -> None:
    page.goto(site + "/table-spill")
    with pytest.raises(AssertionError) as failure:
        check_tables(page, "the spilling table")
    message = str(failure.value)
    assert f"the spilling table ({site}/table-spill) has tables that do not read well" in message
    assert 'at 1366 px (laptop): table#spill row 2 column 2 ("sha256:abab' in message
    assert "spills out of its cell" in message

    page.goto(site + "/table-misaligned")
    with pytest.raises(AssertionError) as failure:
        check_tables(page, "the misaligned table")
    message = str(failure.value)
    assert re.search(
        r'at 1366 px \(laptop\): table#models\.full row 2 column 2 \("1 / 1"\) is \d{3} px off '
        r'its header "Replicas ready / desired" \(a number: their right edges\)',
        message,
    ), message

    page.goto(site + "/table-wide-bare")
    with pytest.raises(AssertionError) as failure:
        check_tables(page, "the wide table")
    message = str(failure.value)
    assert "at 390 px (phone): div.scroll of table#wide hides " in message
    assert "px of its table with no cue (data-more='', mask 'none')" in message
    assert "laptop" not in message  # it fits a laptop: nothing to say there
    assert page.viewport_size == {"width": 1366, "height": 900}


def test_the_consoles_cue_passes_and_follows_the_scroll(page: Page, site: str) -> None:
    page.goto(site + "/table-wide-console")
    check_tables(page, "a wide table with the console's style and script")
    box = page.locator(".scroll")
    expect(box).not_to_have_attribute("data-more", re.compile(".*"))  # it fits a laptop
    page.set_viewport_size({"width": 390, "height": 844})
    expect(box).to_have_attribute("data-more", "right")
    expect(box).to_have_attribute("tabindex", "0")  # the keyboard scrolls it too
    box.evaluate("b => { b.scrollLeft = 40 }")
    expect(box).to_have_attribute("data-more", "both")
    box.evaluate("b => { b.scrollLeft = b.scrollWidth }")
    expect(box).to_have_attribute("data-more", "left")
    page.set_viewport_size({"width": 1366, "height": 900})
    expect(box).not_to_have_attribute("data-more", re.compile(".*"))
    expect(box).not_to_have_attribute("tabindex", re.compile(".*"))


# --------------------------------------------------------------------------- the browser


def test_a_chromium_named_in_the_environment_must_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "no-chromium"))
    with pytest.raises((pytest.skip.Exception, pytest.fail.Exception)) as refused:
        chromium_executable()
    assert f"${CHROMIUM_ENV} names {tmp_path / 'no-chromium'}" in str(refused.value)
    assert "not an executable file" in str(refused.value)


def test_the_sandbox_is_off_only_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers.os, "geteuid", lambda: 0)
    assert launch_options(Path("/usr/bin/chromium")) == {
        "executable_path": "/usr/bin/chromium",
        "headless": True,
        "args": ["--no-sandbox"],
    }
    monkeypatch.setattr(helpers.os, "geteuid", lambda: 1000)
    assert launch_options(Path("/usr/bin/chromium"))["args"] == []
