"""The sidecar's first question, full-model or adapter run (sidecar/adapter_checks.py ``run_kind``), while the
bulletin or the engine is not up: it keeps asking and says what it waits for, as the reconciler's boot would."""

from __future__ import annotations

import asyncio
import logging

import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.processes import free_port
from stitchboard.sidecar.adapter_checks import run_kind
from stitchboard.sidecar.engines import create_adapter
from stitchboard.sidecar.gate import Gate
from stitchboard.sidecar.loop_status import LoopStatus
from stitchboard.sidecar.metrics import SidecarMetrics
from stitchboard.sidecar.pools import Pools
from stitchboard.sidecar.settings import SidecarSettings


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_with_neither_bulletin_nor_engine_up_it_names_the_engine_it_waits_for(engine: str, caplog) -> None:
    """The compose stack starts the sidecar before the bulletin and the engine (deploy/compose/compose-check.sh):
    its log must name the engine it waits for and /health's state say ``waiting_for_engine``, not only the
    bulletin's error."""
    down_bulletin, down_engine = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    settings = SidecarSettings(
        bulletin=down_bulletin, run="r", engine=engine, engine_url=down_engine, retry_backoff_s=0.05
    )
    status, pools = LoopStatus(Gate(), SidecarMetrics()), Pools()
    client = BulletinClient(down_bulletin, retries=0, timeout_s=2.0)

    async def ask() -> None:
        with pytest.raises(TimeoutError):  # it never gives up while nothing answers
            await asyncio.wait_for(run_kind(client, settings, create_adapter(settings), status, pools), 3.0)

    try:
        with caplog.at_level(logging.WARNING):
            asyncio.run(ask())
    finally:
        pools.close()
        client.close()
    assert status.state == "waiting_for_engine"
    assert status.last_error is not None and status.last_error.type == "EngineUnavailable"
    logged = caplog.text
    assert f"engine at {down_engine} does not answer" in logged
    assert "reading the run's latest manifest failed" in logged
