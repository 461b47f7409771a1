"""A sidecar whose bulletin answers with another run's objects (a misrouted ingress) loads none of
them: it keeps serving, and stamping, the version it holds, and says why in its status."""

from __future__ import annotations

import uuid

from stitchboard.bulletin.client import BulletinClient
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher, make_view, same_bits, wait_for
from tests.support.app_server import AppServer
from tests.support.misroute import MisrouteProxy


def test_another_runs_versions_are_never_loaded_or_stamped(sc_bulletin, sc_client, sc_publisher, sc_start, tmp_path):
    other = Publisher(sc_client, f"other-{uuid.uuid4().hex[:6]}", tmp_path)
    sc_publisher.publish(make_view(1))  # run s: version 0 only
    other.publish(make_view(1))  # run t from the same base model: the same version 0, then its own version 1
    other.step(3)
    proxy = MisrouteProxy(sc_bulletin.url)
    front = AppServer(proxy)
    client = BulletinClient(front.url, retries=0, backoff_s=0.01)
    try:
        engine = FakeEngine()
        sidecar = sc_start(engine, client=client, bulletin=front.url, poll_wait_s=0.3)
        sidecar.wait_applied(0)
        proxy.misroute = (sc_publisher.run, other.run)  # from now on, run s's requests reach run t
        wait_for(
            lambda: "MisdirectedAnswer" in str(sidecar.status().get("last_error")),
            30,
            f"the misdirected answer reported (status {sidecar.status()})",
        )
        status = sidecar.status()
        assert status["applied_version"] == 0 and status["target_version"] == 0
        assert other.run in str(status["last_error"])
        assert engine.version == 0 and same_bits(engine.weights, sc_publisher.views[0])
        answer = sidecar.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["weight_version_end"] == 0
        assert engine.count("apply_patch") + engine.count("commit_staged") + engine.count("load_snapshot") == 1
        proxy.misroute = None  # routing fixed: the sidecar follows its own run again
        sc_publisher.step(4)
        sidecar.wait_applied(1)
        assert same_bits(engine.weights, sc_publisher.views[1])
    finally:
        client.close()
        front.stop()
