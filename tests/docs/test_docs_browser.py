"""The built site in a browser, offline from its files: the front page, a guide, the API
reference and the search, at 1280x900 (and the front page at 1024x768), with screenshots.

Screenshots go to ``AIR_MAGIC_UI_ARTIFACTS`` when set (``docs-*.png``), else to the test's
temporary folder. Chromium and Playwright as in the other browser tests (marker ``ui``).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from playwright_page import Page, chromium_page  # noqa: E402

pytestmark = pytest.mark.ui

#: What each page must show without scrolling: a selector, and text it holds.
PAGES = [
    ("index.html", "front", "h1", "air_magic"),
    ("guides/hangs.html", "guide", "h1", "Why is it stuck?"),
    ("reference/api.html#air_magic.Pool", "api", "#air_magic\\.Pool", "Pool"),
]


#: A search, and the title the first result starts with.
FIRST_FOUND = {
    "pool": "Keep the ranks: a pool",
    "hang": "Why is it stuck?",
    "debug": "Debug a rank",
    "breakpoint": "Debug a rank",
    "model back": "Get the model back",
    "gpu": "Run a cell on every GPU",
    "mlflow": "MLflow tracking",
}


def _geometry(page: Page, selector: str) -> dict[str, float]:
    return page.evaluate(
        f"""(() => {{
            const e = document.querySelector({selector!r});
            const r = e.getBoundingClientRect();
            const side = document.querySelector('.bd-sidebar-primary');
            const s = side ? side.getBoundingClientRect() : null;
            return {{top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                     width: window.innerWidth, height: window.innerHeight,
                     scroll: document.scrollingElement.scrollWidth,
                     sidebar: s && s.width > 0 && getComputedStyle(side).display !== 'none' ? s.width : 0}};
        }})()"""
    )


def _shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("AIR_MAGIC_UI_ARTIFACTS") or tmp_path / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[str]:
    """The folder over HTTP on a loopback port of its own, for as long as the block runs."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _search(page: Page, shots: Path) -> None:
    page.page.keyboard.press("Control+k")
    field = page.page.locator("input[name='q']:visible").first
    field.fill("hang report")
    field.press("Enter")
    page.page.wait_for_url("**/search.html*")
    page.page.wait_for_selector("#search-results ul.search li", timeout=60_000)
    found = page.page.locator("#search-results ul.search li a").all_inner_texts()
    assert any("stuck" in title.lower() for title in found), found
    page.page.wait_for_selector("#search-results ul.search li p.context", timeout=60_000)  # the snippets
    page.page.screenshot(path=str(shots / "docs-search-1280.png"))
    assert page.errors == [], page.errors


def test_the_site_reads_in_a_browser(site: Path, tmp_path: Path) -> None:
    shots = _shots(tmp_path)
    with chromium_page(tmp_path, width=1280, height=900) as page:
        for name, label, selector, text in PAGES:
            path, _, anchor = name.partition("#")
            page.goto((site / path).as_uri() + (f"#{anchor}" if anchor else ""))
            page.page.wait_for_selector(selector)
            assert text in page.page.locator(selector).first.inner_text()
            box = _geometry(page, selector)
            assert 0 <= box["top"] < box["height"] and box["right"] <= box["width"], (name, box)
            assert box["scroll"] <= box["width"], f"{name} scrolls sideways: {box}"
            if path != "index.html":  # the front page's navigation is the header's
                assert box["sidebar"] > 0, f"{name}: the section's navigation is not shown at 1280 px"
            page.page.screenshot(path=str(shots / f"docs-{label}-1280.png"))
            assert page.errors == [], (name, page.errors)

        # The search box, as a reader uses it, on the site served as `build_docs.sh --serve`
        # serves it (from files, a browser lets the results page list the pages it found but not
        # read them for their snippets): type, press Enter, read the results.
        with serving(site) as url:
            page.goto(f"{url}/index.html")
            _search(page, shots)
            # The task guide first for its words (not the benchmarks, the architecture or the
            # errors table, which mention everything; not the API entry).
            for query, guide in FIRST_FOUND.items():
                page.goto(f"{url}/search.html?q={query.replace(' ', '+')}")
                page.page.wait_for_selector("#search-results ul.search li", timeout=60_000)
                page.page.wait_for_function(
                    "document.querySelector('#search-results h2') && "
                    "!document.querySelector('#search-results h2').innerText.includes('Searching')",
                    timeout=60_000,
                )
                found = page.page.locator("#search-results ul.search li a").all_inner_texts()
                assert found and found[0].startswith(guide), (query, found[:6])

        page.page.set_viewport_size({"width": 1024, "height": 768})
        page.goto((site / "index.html").as_uri())
        box = _geometry(page, "h1")
        assert box["scroll"] <= box["width"], box
        page.page.screenshot(path=str(shots / "docs-front-1024.png"))
        assert page.errors == [], page.errors
