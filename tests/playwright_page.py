"""One headless Chromium page driven with Playwright, for the browser tests.

Playwright's own browsers are downloads; the tests use Debian's Chromium instead
(``apt-get install chromium``, or ``CHROMIUM_PATH``), offline, on loopback only::

    with chromium_page(tmp) as page:       # Playwright's sync API, Debian's Chromium
        page.goto(url)                      # about:blank first: errors are per page
        page.evaluate("(() => ...)()")      # an expression (a promise is awaited)
        page.shot(".selector", path)        # a PNG of one element
        page.errors                         # console errors and uncaught exceptions

Pages may be open at the same time (a module's page and a test's own): they share one
Playwright driver, whose sync API cannot be started twice in one thread.

Skipped without Chromium or Playwright unless ``AIR_MAGIC_UI_REQUIRED=1``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

# What the browser may do: nothing outside loopback, no background services.
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-default-apps",
    "--no-first-run",
    "--mute-audio",
]


def chromium_path() -> str | None:
    for candidate in (
        os.environ.get("CHROMIUM_PATH"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def missing(what: str) -> None:
    if os.environ.get("AIR_MAGIC_UI_REQUIRED") == "1":
        pytest.fail(f"the UI test needs {what} (AIR_MAGIC_UI_REQUIRED=1)")
    pytest.skip(f"the UI test needs {what}")


class Page:
    """A Playwright page with what the tests ask of it."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self._errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self._errors.append(f"uncaught {error.name}: {error.message}"))

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self._errors.append(message.text)

    @property
    def errors(self) -> list[str]:
        """The page's console errors and uncaught exceptions so far.

        Playwright's sync API hands events over only while a call of it runs: one round
        trip to its driver first, so that what the browser has reported is in the list."""
        if not self.page.is_closed():
            self.page.wait_for_timeout(0)
        return self._errors

    def goto(self, url: str) -> None:
        """Open ``url`` (after about:blank, so the errors listed are this page's only)."""
        self.page.goto("about:blank")
        self._errors.clear()
        self.page.goto(url, wait_until="domcontentloaded", timeout=120_000)

    def blank(self) -> None:
        """Leave the page (before its server goes away)."""
        self.page.goto("about:blank")

    def evaluate(self, expression: str) -> Any:
        """A JavaScript expression's value (awaited when it is a promise)."""
        return self.page.evaluate(expression)

    def shot(self, selector: str, path: Path) -> None:
        """A PNG of the first element that ``selector`` matches."""
        self.page.locator(selector).first.screenshot(path=str(path), animations="disabled", timeout=30_000)


# The Playwright driver of the pages open now, and how many they are.
_driver: Any = None
_users = 0


@contextlib.contextmanager
def _playwright() -> Iterator[Any]:
    """The one Playwright driver, started with the first open page and stopped with the last."""
    global _driver, _users
    if _driver is None:
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            missing("Playwright (pip install playwright)")
        _driver = sync_playwright().start()
    _users += 1
    try:
        yield _driver
    finally:
        _users -= 1
        if _users == 0:
            driver, _driver = _driver, None
            driver.stop()


@contextlib.contextmanager
def chromium_page(tmp_path: Path, width: int = 1280, height: int = 1000) -> Iterator[Page]:
    """Debian's headless Chromium (its profile under ``tmp_path``), one page in it."""
    chromium = chromium_path()
    if chromium is None:
        missing("Chromium (apt-get install chromium)")
    with _playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": width, "height": height},
            device_scale_factor=1,
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(60_000)
            yield Page(page)
        finally:
            context.close()
