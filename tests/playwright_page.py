"""One headless Chromium page driven with Playwright, for the browser tests.

Playwright's own browsers are downloads; the tests use Debian's Chromium instead
(``apt-get install chromium``, or ``CHROMIUM_PATH``), offline, on loopback only::

    with chromium_page(tmp) as page:       # Playwright's sync API, Debian's Chromium
        page.goto(url)                      # about:blank first: errors are per page
        page.evaluate("(() => ...)()")      # an expression (a promise is awaited)
        page.shot(".selector", path)        # a PNG of one element
        page.errors                         # console errors and uncaught exceptions

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
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.errors.append(f"uncaught {error.name}: {error.message}"))

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def goto(self, url: str) -> None:
        """Open ``url`` (after about:blank, so the errors listed are this page's only)."""
        self.page.goto("about:blank")
        self.errors.clear()
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


@contextlib.contextmanager
def chromium_page(tmp_path: Path, width: int = 1280, height: int = 1000) -> Iterator[Page]:
    """Debian's headless Chromium (its profile under ``tmp_path``), one page in it."""
    chromium = chromium_path()
    if chromium is None:
        missing("Chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Playwright (pip install playwright)")
    with sync_playwright() as playwright:
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
