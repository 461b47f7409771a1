"""A headless Chromium for the bulletin's status page: log in with a token, read the page, save a screenshot.

Debian's Chromium (``/usr/bin/chromium``, installed by ``make venv``) driven by the ``playwright``
package pointed at that executable (playwright's own browser download is never used). The
flags are those known to work in a sandbox without a network: headless, no GPU, no QUIC, no
background networking, a fresh user-data folder per start.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DemoError

#: Where Debian's chromium package puts the browser.
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_browser() -> None:
    """Raise :class:`DemoError` naming what is missing when Chromium or playwright is not installed."""
    if not os.access(CHROMIUM, os.X_OK):
        raise DemoError(
            f"no browser at {CHROMIUM}: the status page screenshot needs Debian's chromium "
            "(`apt-get install -y chromium`, run by `make venv`)",
            browser=CHROMIUM,
        )
    try:
        import playwright.sync_api  # noqa: F401 - only checking that it is installed
    except ImportError:
        raise DemoError(
            "the python package playwright is not installed: pip install 'stitchboard[test]' "
            "(it drives /usr/bin/chromium)",
            browser=CHROMIUM,
        ) from None


@contextmanager
def browser_page(viewport: tuple[int, int] = (1280, 900)) -> Iterator[Any]:
    """A playwright ``Page`` in a fresh headless Chromium (closed on exit).

    Raises:
        DemoError: Chromium or playwright is missing.
    """
    require_browser()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="stitchboard-chromium-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=FLAGS,
            headless=True,
            viewport={"width": viewport[0], "height": viewport[1]},
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


@dataclass(frozen=True)
class StatusPage:
    """What the status page of a run showed in the browser.

    Attributes:
        latest_version: the page's latest version ("none" when there is none).
        live_replicas: the page's count of live replicas.
        at_latest: live replicas at the latest version.
        rows: per replica row, ``(replica id, applied version)`` as the table shows them.
        svg_texts: the texts of the page's SVG plots.
        svgs: how many SVG plots the page holds.
    """

    latest_version: str
    live_replicas: int
    at_latest: int
    rows: list[tuple[str, str]]
    svg_texts: list[str]
    svgs: int


def read_status_page(
    page: Any, bulletin: str, run: str, token: str | None, screenshot: Path | None = None
) -> StatusPage:
    """Open ``bulletin``'s status page for ``run`` in ``page`` (logging in with ``token`` through the
    page's form when the bulletin asks for one), read it, and save a full-page ``screenshot``.

    Raises:
        DemoError: the page did not load or the login was refused.
    """
    page.goto(f"{bulletin.rstrip('/')}/status")
    if page.locator("#token").count():
        if token is None:
            raise DemoError(f"the status page of {bulletin} asks for a token and none was given")
        page.fill("#token", token)
        page.click("#login")
        page.wait_for_load_state()
        if page.locator("#login-error").count():
            raise DemoError(f"the status page of {bulletin} refused the token: {page.inner_text('#login-error')}")
    page.click(f"a[href='/status/runs/{run}']")
    page.wait_for_selector("#replicas")
    rows = [
        (tr.get_attribute("data-replica") or "", tr.locator(".applied").inner_text())
        for tr in page.locator("tr.replica").all()
    ]
    result = StatusPage(
        latest_version=page.inner_text("#latest-version"),
        live_replicas=int(page.inner_text("#live-replicas")),
        at_latest=int(page.inner_text("#at-latest")),
        rows=rows,
        svg_texts=page.locator("svg text").all_text_contents(),
        svgs=page.locator("svg").count(),
    )
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    return result
