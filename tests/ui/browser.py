"""What the console's browser tests share: Debian's Chromium driven by Playwright (found and
launched, never downloaded), screenshots at a laptop's and a phone's size, the Content
Security Policy violations the browser reports, and the accessibility check (axe-core,
vendored in ``vendor/``).

Playwright is imported only where a browser is started (``tests/ui/conftest.py``), so that a
machine without it reports the tests unavailable instead of failing their collection.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.ci import unavailable

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, ConsoleMessage, Page

__all__ = [
    "AXE_SHA256",
    "SIZES",
    "AxeViolation",
    "CspViolation",
    "CspViolations",
    "Screenshots",
    "axe_violations",
    "check_accessibility",
    "check_fits_phone",
    "check_tables",
    "chromium_executable",
    "expect",
    "launch_options",
]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ENV = "LLMGW_TEST_CHROMIUM"
SCREENSHOTS_ENV = "LLMGW_TEST_SCREENSHOTS"
# Kept after the run (build/ is git-ignored); .ci/run names it when the suite fails.
DEFAULT_SCREENSHOTS = ROOT / "build" / "test-screenshots"

# The issue's two sizes: a laptop screen and a phone (an iPhone 12-14's CSS viewport).
SIZES: dict[str, tuple[int, int]] = {"laptop": (1366, 900), "phone": (390, 844)}

AXE = Path(__file__).resolve().parent / "vendor" / "axe.min.js"
AXE_SHA256 = "29348999450cdf2849a8e70b7912fc2da85a849da39c0d0d5394f51d4a9ed95c"  # 4.14.1
FAILING_IMPACTS = ("serious", "critical")


# --------------------------------------------------------------------------- the browser


def chromium_executable() -> Path:
    """Debian's Chromium (``$LLMGW_TEST_CHROMIUM``, else ``chromium`` on PATH), else
    :func:`tests.ci.unavailable`: Playwright's own browser download is never used, the
    tests drive the browser Debian ships and keeps patched."""
    named = os.environ.get(CHROMIUM_ENV)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            unavailable(
                f"${CHROMIUM_ENV} names {named}, which is not an executable file; "
                f"point it at a Chromium binary or unset it to use chromium on PATH"
            )
        return path
    found = shutil.which("chromium")
    if found is None:
        unavailable(
            f"no chromium on PATH for the console's browser tests; apt-get install -y "
            f"chromium, or name a Chromium binary in ${CHROMIUM_ENV}"
        )
    return Path(found)


def launch_options(executable: Path) -> dict[str, Any]:
    """Keyword arguments of ``chromium.launch``: headless, Debian's executable, and
    ``--no-sandbox`` only as root. Chromium refuses to start as root with its sandbox on
    ("Running as root without --no-sandbox is not supported", crbug.com/638180), and .ci/run
    runs as root on a throwaway machine; as any other user the sandbox stays on."""
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    return {"executable_path": str(executable), "headless": True, "args": args}


# --------------------------------------------------------------------------- screenshots


def _file_name(name: str) -> str:
    """``name`` as a file name: what is not a letter, digit, '-', '_' or '.' becomes '-'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    if not cleaned:
        raise ValueError(f"screenshot name {name!r} has no letter or digit; name the page")
    return cleaned


@dataclass
class Screenshots:
    """The screenshots of one test session, in one directory kept after the run: each page
    at both :data:`SIZES` (``NAME-laptop.png``, ``NAME-phone.png``), and under ``failures/``
    the pages a failed test left open."""

    directory: Path
    taken: list[Path] = field(default_factory=list)

    @classmethod
    def for_session(cls) -> Screenshots:
        """``$LLMGW_TEST_SCREENSHOTS``, else build/test-screenshots/, its pictures removed
        first: the pictures it holds after a run are that run's, never an older run's. Only
        PNG files go (here and in failures/), whatever else a directory named by the
        variable holds stays."""
        directory = Path(os.environ.get(SCREENSHOTS_ENV) or DEFAULT_SCREENSHOTS)
        for old in [*directory.glob("*.png"), *directory.glob("failures/*.png")]:
            old.unlink()
        directory.mkdir(parents=True, exist_ok=True)
        return cls(directory)

    def take(self, page: Page, name: str) -> list[Path]:
        """``page`` as it is now, the whole page at the laptop's and then the phone's width;
        its viewport is given back after. A name taken twice in one session is refused: the
        second test would overwrite the first one's pages."""
        stem = _file_name(name)
        paths = [self.directory / f"{stem}-{size}.png" for size in SIZES]
        clash = [p for p in paths if p in self.taken]
        if clash:
            raise ValueError(f"screenshot {name!r} was taken already this session; name it apart")
        before = page.viewport_size
        try:
            for path, (width, height) in zip(paths, SIZES.values(), strict=True):
                page.set_viewport_size({"width": width, "height": height})
                page.screenshot(path=str(path), full_page=True)
                self.taken.append(path)
        finally:
            if before is not None:
                page.set_viewport_size(before)
        return paths

    def take_failure(self, page: Page, test: str) -> Path | None:
        """The page a failed test left open, as it was (None when it could not be taken:
        a crashed or closed page must not hide the test's own failure)."""
        directory = self.directory / "failures"
        directory.mkdir(exist_ok=True)
        stem = _file_name(test)
        path = directory / f"{stem}.png"
        n = 1
        while path.exists():
            n += 1
            path = directory / f"{stem}-{n}.png"
        try:
            page.screenshot(path=str(path), full_page=True)
        except Exception:  # a crashed or closed page: no picture, the test's error stands
            return None
        self.taken.append(path)
        return path


_OVERFLOW = """() => {
  // What sticks out: a box past the screen's edge, or content spilling out of its box;
  // the innermost such elements name the culprit. A .scroll box's inside is its own.
  const width = document.documentElement.clientWidth;
  const found = [];
  for (const el of document.body.querySelectorAll("*")) {
    if (el.closest(".scroll")) { continue; }
    const box = el.getBoundingClientRect();
    const spills = el.scrollWidth > el.clientWidth + 1
      && getComputedStyle(el).overflowX === "visible";
    if (box.right > width + 1 || spills) { found.push(el); }
  }
  const innermost = found.filter(el => !found.some(other => other !== el && el.contains(other)));
  const named = innermost.slice(0, 5).map(el => {
    const id = el.id ? "#" + el.id : "";
    const cls = el.classList.length ? "." + Array.from(el.classList).join(".") : "";
    return el.tagName.toLowerCase() + id + cls;
  });
  return {scroll: document.documentElement.scrollWidth, width: width, wide: named};
}"""


def check_fits_phone(page: Page, what: str) -> None:
    """At the phone's width the page scrolls down only: nothing but a ``.scroll`` box (a
    wide table's own scroller) is wider than the screen. Fails naming the widest elements;
    the viewport is given back after."""
    before = page.viewport_size
    width, height = SIZES["phone"]
    try:
        page.set_viewport_size({"width": width, "height": height})
        found = page.evaluate(_OVERFLOW)
    finally:
        if before is not None:
            page.set_viewport_size(before)
    if found["scroll"] > found["width"]:
        raise AssertionError(
            f"{what} ({page.url}) is {found['scroll']} px wide on a {width} px phone: it "
            f"scrolls sideways; wrap what is wider in a .scroll box or let it wrap: "
            f"{', '.join(found['wide']) or 'no single element found'}"
        )


_TABLES = """async () => {
  // Measured after the layout and console.js have caught up with the last resize.
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
  const name = el => {
    const id = el.id ? "#" + el.id : "";
    const cls = el.classList.length ? "." + Array.from(el.classList).join(".") : "";
    return el.tagName.toLowerCase() + id + cls;
  };
  const shown = el => { const b = el.getBoundingClientRect(); return b.width > 0 && b.height > 0; };
  const textBox = el => { const r = document.createRange(); r.selectNodeContents(el); return r.getBoundingClientRect(); };
  const cellName = (table, cell) => `${name(table)} row ${cell.parentElement.rowIndex + 1} ` +
    `column ${cell.cellIndex + 1} (${JSON.stringify(cell.textContent.trim().slice(0, 40))})`;
  const width = document.documentElement.clientWidth;
  const cut = [], misaligned = [], boxes = [];
  for (const table of document.querySelectorAll("table")) {
    if (!shown(table)) { continue; }
    // A cell may lie anywhere its scrolling box scrolls to, else on the screen.
    const scroller = table.closest(".scroll");
    let left = 0, right = width;
    if (scroller) {
      const outer = scroller.getBoundingClientRect();
      left = outer.left + scroller.clientLeft - scroller.scrollLeft;
      right = left + scroller.scrollWidth;
    }
    for (const cell of table.querySelectorAll("th, td")) {
      if (!shown(cell)) { continue; }
      const box = cell.getBoundingClientRect();
      if (box.left < left - 1 || box.right > right + 1) {
        cut.push(`${cellName(table, cell)} lies beyond ${scroller ? "its scrolling box" : "the screen"}`);
      } else if (cell.scrollWidth > cell.clientWidth + 1) {
        cut.push(`${cellName(table, cell)} spills out of its cell`);
      }
    }
    // Each value under its header: a number's right edge on its header's, any other
    // value overlapping its header.
    const rows = table.tHead ? table.tHead.rows : [];
    const heads = rows.length ? Array.from(rows[rows.length - 1].cells) : [];
    for (const body of table.tBodies) {
      for (const row of body.rows) {
        if (row.cells.length !== heads.length) { continue; }
        for (const cell of row.cells) {
          const head = heads[cell.cellIndex];
          if (!cell.textContent.trim() || !shown(cell)) { continue; }
          const a = textBox(head), b = textBox(cell);
          const number = cell.classList.contains("num");
          const off = number ? Math.abs(a.right - b.right) : Math.max(a.left - b.right, b.left - a.right);
          if (off > 2 || (!number && off > 0)) {
            misaligned.push(`${cellName(table, cell)} is ${Math.round(off)} px off its header ` +
              JSON.stringify(head.textContent.trim()) +
              (number ? " (a number: their right edges)" : " (they do not overlap)"));
          }
        }
      }
    }
  }
  for (const box of document.querySelectorAll(".scroll")) {
    if (!shown(box)) { continue; }
    const hidden = box.scrollWidth - box.clientWidth;
    const style = getComputedStyle(box);
    let scrolls = false;
    if (hidden > 1) {
      const before = box.scrollLeft;
      box.scrollLeft = before + hidden;
      scrolls = box.scrollLeft > before;
      box.scrollLeft = before;
    }
    boxes.push({
      name: name(box) + (box.querySelector("table[id]") ? " of table#" + box.querySelector("table[id]").id : ""),
      hidden: hidden > 1 ? hidden : 0,
      scrolls: scrolls,
      start: box.scrollLeft <= 1,
      more: box.getAttribute("data-more") || "",
      mask: style.maskImage || style.webkitMaskImage || "none",
    });
  }
  return {cut: cut, misaligned: misaligned, boxes: boxes};
}"""


def check_tables(page: Page, what: str) -> None:
    """At each of :data:`SIZES`: no table cell is cut off (each lies inside its ``.scroll``
    box's scrolled area, else on the screen, and its content inside it), each value lines
    up with its header (a ``td.num`` on its right edge, any other overlapping it), and a
    ``.scroll`` box wider than the screen scrolls and shows its cue (``data-more`` naming
    the hidden side, the edge faded by a mask) while one that fits shows none. Fails
    listing every finding; the viewport is given back after."""
    before = page.viewport_size
    findings: list[str] = []
    try:
        for size, (width, height) in SIZES.items():
            page.set_viewport_size({"width": width, "height": height})
            found = page.evaluate(_TABLES)
            at = f"at {width} px ({size})"
            findings += [f"{at}: {c}" for c in found["cut"]]
            findings += [f"{at}: {m}" for m in found["misaligned"]]
            for box in found["boxes"]:
                findings += [f"{at}: {p}" for p in _scroll_problems(box)]
    finally:
        if before is not None:
            page.set_viewport_size(before)
    if findings:
        listed = "\n".join(f"  {f}" for f in findings)
        raise AssertionError(f"{what} ({page.url}) has tables that do not read well:\n{listed}")


def _scroll_problems(box: dict[str, Any]) -> list[str]:
    name, hidden, more, mask = box["name"], box["hidden"], box["more"], box["mask"]
    if not hidden:
        if more or mask != "none":
            return [f"{name} fits, yet shows a cue of more to see (data-more={more!r})"]
        return []
    problems = []
    if not box["scrolls"]:
        problems.append(f"{name} hides {hidden} px of its table and does not scroll")
    wanted = ("right",) if box["start"] else ("left", "both")
    if more not in wanted or mask == "none":
        problems.append(
            f"{name} hides {hidden} px of its table with no cue (data-more={more!r}, "
            f"mask {mask!r}): console.js marks the side, the style fades it"
        )
    return problems


# --------------------------------------------------------------------------- CSP


@dataclass(frozen=True)
class CspViolation:
    """One violation as Chromium reported it (the console message it prints)."""

    url: str  # the page's URL when the browser reported it
    text: str

    def __str__(self) -> str:
        return f"{self.url}: {self.text}"


class CspViolations:
    """Every Content Security Policy violation the browser reports on the pages it watches.

    Chromium reports each blocked inline script, inline style, ``eval`` or foreign load as an
    error on the page's console ("Executing inline script violates the following Content
    Security Policy directive ..."; DevTools' ``Log.entryAdded`` of source ``security``,
    which Playwright hands on as a console message). Listening there needs nothing inside
    the page: a ``securitypolicyviolation`` listener would have to be injected as a script,
    the very kind of thing the policy under test governs."""

    def __init__(self) -> None:
        self._found: list[CspViolation] = []
        self._pages: list[Page] = []

    def watch_context(self, context: BrowserContext) -> None:
        """Watch every page ``context`` opens from now on (call before its first page).
        Playwright calls the listener when it learns of the page, before the call that made
        it returns and before any message of the page: none is missed."""
        context.on("page", self.watch)

    def watch(self, page: Page) -> None:
        """Watch ``page`` (before it navigates: what it loaded earlier is not seen)."""

        def message(msg: ConsoleMessage) -> None:
            if msg.type == "error" and "Content Security Policy" in msg.text:
                self._found.append(CspViolation(page.url, msg.text))

        page.on("console", message)
        self._pages.append(page)

    def take(self) -> list[CspViolation]:
        """The violations reported so far (and forgotten here). A round trip into each open
        page first: the browser keeps the order of what a page says, so every message it
        reported before this call has arrived when the answer has."""
        for page in self._pages:
            if page.is_closed():
                continue
            try:
                page.evaluate("0")
            except Exception:  # closed or crashed meanwhile: it has nothing more to say
                continue
        found, self._found = self._found, []
        return found

    def assert_none(self) -> None:
        """No page watched reported a violation; else each one, with its page's URL."""
        found = self.take()
        if found:
            listed = "\n".join(f"  {v}" for v in found)
            raise AssertionError(
                f"the browser reported {len(found)} Content Security Policy violation(s); "
                f"the page has an inline script or style, or loads from elsewhere: move it "
                f"into a file served by the console\n{listed}"
            )


# --------------------------------------------------------------------------- accessibility


@dataclass(frozen=True)
class AxeViolation:
    """One axe-core rule a page breaks, with the elements that break it."""

    rule: str
    impact: str
    help: str
    help_url: str
    targets: tuple[str, ...]
    summary: str  # axe's failureSummary of the first element: what to fix

    def __str__(self) -> str:
        shown = ", ".join(self.targets[:5]) + (" ..." if len(self.targets) > 5 else "")
        return (
            f"[{self.impact}] {self.rule}: {self.help} ({self.help_url})\n"
            f"    on {shown}\n    {self.summary.strip().replace(chr(10), chr(10) + '    ')}"
        )


def _axe_source() -> str:
    data = AXE.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != AXE_SHA256:
        raise AssertionError(
            f"{AXE} has sha256 {digest}, not the vendored release's {AXE_SHA256}; restore it "
            f"from axe-core's tarball, or update AXE_SHA256 and vendor/README.md with it"
        )
    return data.decode()


_RUN_AXE = """async () => {
  const result = await axe.run(document, {resultTypes: ["violations"]});
  return result.violations.map(v => ({
    rule: v.id, impact: v.impact || "unknown", help: v.help, help_url: v.helpUrl,
    targets: v.nodes.map(n => n.target.join(" ")),
    summary: v.nodes.length ? (v.nodes[0].failureSummary || "") : "",
  }));
}"""


def axe_violations(page: Page) -> list[AxeViolation]:
    """Every axe-core violation of the page as it is now, whatever its impact.

    axe is evaluated into the page through the DevTools protocol (``page.evaluate``), which
    the page's Content Security Policy does not govern: the check sees the page exactly as
    the console serves it, with its real policy. (An injected ``<script>`` tag would be
    blocked by ``default-src 'self'``; ``bypass_csp`` would lift the policy and with it any
    style the policy blocks, so the page checked would not be the page a user gets.)"""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(_axe_source())
    rows = page.evaluate(_RUN_AXE)
    return [
        AxeViolation(
            rule=row["rule"],
            impact=row["impact"],
            help=row["help"],
            help_url=row["help_url"],
            targets=tuple(row["targets"]),
            summary=row["summary"],
        )
        for row in rows
    ]


def check_accessibility(page: Page, what: str) -> list[AxeViolation]:
    """Fail when the page has a violation of impact serious or critical, listing rule,
    impact, help URL and the elements; return the lesser ones (moderate, minor)."""
    found = axe_violations(page)
    failing = [v for v in found if v.impact in FAILING_IMPACTS]
    if failing:
        listed = "\n".join(f"  {v}" for v in failing)
        raise AssertionError(
            f"{what} ({page.url}) has {len(failing)} serious or critical accessibility "
            f"violation(s) (axe-core 4.14.1):\n{listed}"
        )
    return [v for v in found if v.impact not in FAILING_IMPACTS]


def expect(actual: Any, message: str | None = None) -> Any:
    """Playwright's ``expect`` (its assertions retry until their timeout), imported when
    first used so that this module loads without Playwright."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(actual, message)
