"""Fixtures of the console's browser tests: Debian's Chromium through Playwright (one browser
per module), browser contexts whose pages are watched for CSP violations and photographed
when their test fails, and the session's screenshots (their directory named in the summary).

Without Playwright or Chromium the tests are unavailable (tests.ci): skipped here, failed
under ``CI=true``, where .ci/run installs Debian's chromium.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.ci import unavailable
from tests.ui.browser import CspViolations, Screenshots, chromium_executable, launch_options

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page, Playwright

SCREENSHOTS_KEY = pytest.StashKey[Screenshots]()
REPORTS_KEY = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """Each phase's report kept on the test, so that its fixtures know whether it failed."""
    outcome = yield
    report = outcome.get_result()
    item.stash.setdefault(REPORTS_KEY, {})[report.when] = report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    shots = config.stash.get(SCREENSHOTS_KEY, None)
    if shots is None:
        return
    failures = [p for p in shots.taken if p.parent.name == "failures"]
    line = f"console screenshots: {shots.directory} ({len(shots.taken)} files"
    line += f", {len(failures)} of failed tests under failures/)" if failures else ")"
    terminalreporter.write_sep("-", "browser tests")
    terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def screenshots(request: pytest.FixtureRequest) -> Screenshots:
    """This session's screenshots (build/test-screenshots/, or $LLMGW_TEST_SCREENSHOTS)."""
    shots = Screenshots.for_session()
    request.config.stash[SCREENSHOTS_KEY] = shots
    return shots


@pytest.fixture
def screenshot(screenshots: Screenshots) -> Callable[[Page, str], list[Any]]:
    """``screenshot(page, name)``: the page at 1366x900 and at 390x844, kept after the run."""
    return screenshots.take


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable(
            "playwright is not installed for the console's browser tests; pip install -e "
            "'.[test]' (its wheel carries the driver; never 'playwright install': the tests "
            "use Debian's chromium)"
        )
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    """Debian's Chromium, headless, one per test module (a start takes about a second)."""
    browser = playwright.chromium.launch(**launch_options(chromium_executable()))
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture
def csp() -> CspViolations:
    """The CSP violations of every page :func:`new_context`'s contexts open."""
    return CspViolations()


@pytest.fixture
def new_context(
    request: pytest.FixtureRequest,
    browser: Browser,
    csp: CspViolations,
    screenshots: Screenshots,
) -> Iterator[Callable[..., BrowserContext]]:
    """``new_context(**options)``: a fresh browser context (its own cookies) at the laptop
    size. After the test: a screenshot of each page it left open when the test failed, and
    a failure of the test's teardown when a page reported a CSP violation the test did not
    take (``csp.take()``): no console page may break the policy unnoticed."""
    contexts: list[BrowserContext] = []

    def make(**options: Any) -> BrowserContext:
        options.setdefault("viewport", {"width": 1366, "height": 900})
        context = browser.new_context(**options)
        context.set_default_timeout(10_000)
        csp.watch_context(context)
        contexts.append(context)
        return context

    yield make
    reports = request.node.stash.get(REPORTS_KEY, {})
    failed = any(r.failed for r in reports.values())
    try:
        if failed:
            for context in contexts:
                for page in context.pages:
                    screenshots.take_failure(page, request.node.name)
        if not failed:
            csp.assert_none()
    finally:
        for context in contexts:
            context.close()


@pytest.fixture
def page(new_context: Callable[..., BrowserContext]) -> Page:
    """A page of its own fresh context."""
    return new_context().new_page()
