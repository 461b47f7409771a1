"""A sidecar (over the fake engine) with ``STITCH_SIDECAR_RELAYS``: it syncs through a real nginx relay
(``deploy/relay/``), and with the relay down it syncs from the bulletin and says so in ``/health`` and the metrics.
The nginx test is skipped, saying why, only where nginx is not installed."""

from __future__ import annotations

import pytest

from tests.bulletin.relay_nginx import NGINX, NO_NGINX, Nginx
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import assert_at, make_view, mutate


def _metric(sidecar, name: str, **labels: str) -> float:
    registry = sidecar.app.state.metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
@pytest.mark.skipif(NGINX is None, reason=NO_NGINX)
def test_a_sidecar_syncs_through_its_relay_and_reports_it(sc_bulletin, sc_publisher, sc_start, tmp_path):
    """Every blob of the versions comes through the relay (nginx's cache holds them); /health lists the relay up
    with what it fetched; nothing fell back to the bulletin."""
    relay = Nginx(sc_bulletin.url.removeprefix("http://"), tmp_path / "relay")
    try:
        sc_publisher.publish(make_view(0))
        sidecar = sc_start(FakeEngine(), relays=[relay.url])
        assert_at(sidecar, sc_publisher, 0)
        sc_publisher.publish(mutate(sc_publisher.views[-1], 1))
        assert_at(sidecar, sc_publisher, 1)
        health = sidecar.http.get("/health").json()
        (seen,) = health["relays"]
        assert seen["url"] == relay.url and seen["up"] is True and seen["failed"] == 0 and seen["fetched"] >= 2
        assert _metric(sidecar, "stitch_sidecar_relay_fetches_total", relay=relay.url, outcome="ok") == seen["fetched"]
        assert _metric(sidecar, "stitch_sidecar_relay_fallbacks_total") == 0
        assert len(relay.cached_files()) == seen["fetched"]
    finally:
        relay.stop()


def test_with_its_relay_down_a_sidecar_syncs_from_the_bulletin_and_says_so(sc_publisher, sc_start, tmp_path):
    """A relay that refuses connections: the versions come from the bulletin, /health stays ok and shows the relay
    down with its error, the metrics count the fallbacks and say the relay is down."""
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(), relays=[dead])
    assert_at(sidecar, sc_publisher, 0)
    answer = sidecar.http.get("/health")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
    (seen,) = answer.json()["relays"]
    assert seen["url"] == dead and seen["up"] is False and seen["failed"] >= 1  # downloads in flight at once
    assert "Unavailable" in seen["last_error"]
    assert _metric(sidecar, "stitch_sidecar_relay_up", relay=dead) == 0
    assert _metric(sidecar, "stitch_sidecar_relay_fallbacks_total") >= 1
    assert "relays" not in sc_start(FakeEngine()).http.get("/health").json()  # none configured: left out


def test_relays_are_http_base_urls_read_from_a_json_list(monkeypatch):
    """STITCH_SIDECAR_RELAYS is a JSON list of http(s) base URLs (trailing slash dropped); anything else is refused at
    start, naming the setting."""
    from pydantic import ValidationError

    from stitchboard.sidecar.settings import SidecarSettings

    monkeypatch.setenv("STITCH_SIDECAR_RELAYS", '["http://relay-eu:8780/", "https://cdn.example.com"]')
    settings = SidecarSettings(bulletin="http://bulletin:8700", run="r")
    assert settings.relays == ["http://relay-eu:8780", "https://cdn.example.com"]
    assert SidecarSettings(bulletin="http://b", run="r", relays=[]).relays == []
    with pytest.raises(ValidationError, match="STITCH_SIDECAR_RELAYS"):
        SidecarSettings(bulletin="http://b", run="r", relays=["relay-eu:8780"])
