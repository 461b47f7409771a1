"""A sidecar process over the tests' fake engine: ``python -m tests.sidecar.fake_sidecar_main``.

For tests that measure the sidecar's own process (its memory: ``tests/test_body_caps.py``).
The fake engine (:mod:`tests.sidecar.fake_engine`, no weights, no version) runs in this
process, its HTTP server on a thread; the sidecar app is served by uvicorn as ``stitchboard
sidecar run`` serves it. Settings come from the ``STITCH_SIDECAR_*`` environment variables
(``ENGINE_URL`` is the fake engine's); the repository root must be on ``PYTHONPATH``.
"""

from __future__ import annotations

import uvicorn

from stitchboard.sidecar.app import create_app
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import FakeEngine
from tests.support.app_server import AppServer


def main() -> None:
    """Serve the fake engine on a free loopback port and the sidecar in front of it until killed."""
    engine = FakeEngine(token_delay_s=0.001)
    engine.url = AppServer(engine.app()).url
    settings = SidecarSettings(engine_url=engine.url)
    uvicorn.run(create_app(settings, engine=engine), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
