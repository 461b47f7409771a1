"""The demo's fleet check: the bulletin's fleet view (API and status page) shows every engine at the last version.

The sidecars report themselves to the bulletin (``sidecar/report.py``); the trainer waits on
that report (:meth:`Publisher.wait_for_fleet`), and the status page, read in a headless
Chromium (:mod:`.browser`), must show the same replicas and version; its screenshot is saved as
``status.png``.
"""

from __future__ import annotations

from pathlib import Path

from stitchboard.trainer_client.errors import FleetTimeoutError
from stitchboard.trainer_client.publisher_core import PublisherCore

from .browser import browser_page, read_status_page

#: The name of the check in the demo's PASS list.
CHECK = "the bulletin's fleet view shows every engine at the last version"


def check_fleet(
    publisher: PublisherCore, bulletin: str, version: int, engines: int, screenshot: Path, timeout_s: float = 60.0
) -> list[str]:
    """Wait until ``engines`` replicas report ``version`` and the status page shows them;
    the problems found (empty: passed).

    Raises:
        DemoError: no browser to read the page with (names what is missing).
    """
    problems = []
    try:
        count = publisher.wait_for_fleet(version, min_replicas=engines, timeout_s=timeout_s)
    except FleetTimeoutError as exc:
        return [f"fleet view: {exc.message}"]
    if count.live != engines:
        problems.append(f"fleet view: {count.live} live replicas, {engines} engines started")
    with browser_page() as page:
        shown = read_status_page(page, bulletin, publisher.run, None, screenshot)
    if shown.latest_version != str(version) or shown.live_replicas != engines or shown.at_latest != engines:
        problems.append(
            f"status page shows latest version {shown.latest_version}, {shown.live_replicas} live replicas, "
            f"{shown.at_latest} at it; expected {version}, {engines}, {engines}"
        )
    return problems
