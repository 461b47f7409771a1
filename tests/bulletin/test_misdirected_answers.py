"""A bulletin client refuses every answer for another run or version than it asked (issue: a
misrouted ingress answering run ``s``'s requests with run ``t``'s objects)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stitchboard.bulletin.answer_checks import check_plan
from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import MisdirectedAnswerError
from stitchboard.bulletin.fleet_client import FleetClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.schema import Plan, PlanStep
from tests.sidecar.sidecar_helpers import Publisher, make_view
from tests.support.app_server import AppServer
from tests.support.misroute import MisrouteProxy


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[MisrouteProxy, BulletinClient, Publisher, Publisher]]:
    """A bulletin with runs ``s`` (versions 0-1) and ``t`` (versions 0-2), a misrouting proxy in front,
    and a client of the proxy."""
    bulletin = AppServer(create_app(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05)))
    proxy = MisrouteProxy(bulletin.url)
    front = AppServer(proxy)
    direct = BulletinClient(bulletin.url, retries=0)
    s = Publisher(direct, f"s-{uuid.uuid4().hex[:6]}", tmp_path)
    t = Publisher(direct, f"t-{uuid.uuid4().hex[:6]}", tmp_path)
    s.publish(make_view(1))
    s.step(2)
    t.publish(make_view(3))
    t.step(4)
    t.step(5)
    client = BulletinClient(front.url, retries=0)
    try:
        yield proxy, client, s, t
    finally:
        client.close()
        direct.close()
        front.stop()
        bulletin.stop()


def test_answers_are_used_when_routed_right(routed) -> None:
    proxy, client, s, _ = routed
    assert client.manifest(s.run, 1).version == 1
    assert client.latest(s.run, 0) == 1
    assert [v.version for v in client.versions(s.run)] == [0, 1]
    assert client.plan(s.run, None, 1).to_version == 1
    assert client.squashes(s.run) == []
    assert FleetClient(client).count(s.run, 1).version == 1
    assert proxy.rewritten == 0


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c, run: c.manifest(run, 1), id="manifest"),
        pytest.param(lambda c, run: c.latest(run, 0), id="latest"),
        pytest.param(lambda c, run: c.latest_info(run, 1, wait_s=0.2), id="long-poll"),
        pytest.param(lambda c, run: c.versions(run), id="versions"),
        pytest.param(lambda c, run: c.plan(run, 0, 1, squash=True), id="plan"),
        pytest.param(lambda c, run: FleetClient(c).replicas(run), id="replicas"),
        pytest.param(lambda c, run: FleetClient(c).count(run, 1), id="fleet-count"),
    ],
)
def test_an_answer_for_another_run_is_refused_naming_both(routed, call) -> None:
    proxy, client, s, t = routed
    proxy.misroute = (s.run, t.run)
    with pytest.raises(MisdirectedAnswerError) as caught:
        call(client, s.run)
    assert proxy.rewritten >= 1
    assert s.run in str(caught.value) and t.run in str(caught.value)
    assert caught.value.details["run_id"] == s.run and caught.value.details["answer_run_id"] == t.run


def test_a_stale_latest_answer_is_refused() -> None:
    from stitchboard.bulletin.answer_checks import check_newer

    check_newer("asking", "s", "s", 3, 4)
    with pytest.raises(MisdirectedAnswerError, match="newer than 3"):
        check_newer("asking", "s", "s", 3, 3)


def _step(version: int, kind: str = "delta", base: int | None = None) -> PlanStep:
    return PlanStep(version=version, kind=kind, files=[], size_bytes=0, base_version=base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("plan", "start", "end", "refused"),
    [
        (Plan(run_id="s", from_version=1, to_version=3, steps=[_step(2), _step(3)], total_bytes=0), 1, 3, None),
        (Plan(run_id="s", from_version=0, to_version=3, steps=[_step(3, "squash", 0)], total_bytes=0), 0, 3, None),
        (
            Plan(run_id="s", from_version=None, to_version=2, steps=[_step(1, "snapshot"), _step(2)], total_bytes=0),
            None,
            2,
            None,
        ),
        (Plan(run_id="s", from_version=2, to_version=3, steps=[_step(3)], total_bytes=0), 1, 3, "its start"),
        (
            Plan(run_id="s", from_version=1, to_version=4, steps=[_step(2), _step(3), _step(4)], total_bytes=0),
            1,
            3,
            "its end",
        ),
        (Plan(run_id="s", from_version=1, to_version=3, steps=[_step(3)], total_bytes=0), 1, 3, "step 1"),
        (Plan(run_id="s", from_version=1, to_version=3, steps=[_step(3, "squash", 0)], total_bytes=0), 1, 3, "step 1"),
        (Plan(run_id="s", from_version=1, to_version=3, steps=[_step(2)], total_bytes=0), 1, 3, "its last step"),
        (Plan(run_id="s", from_version=None, to_version=1, steps=[_step(1)], total_bytes=0), None, 1, "step 1"),
    ],
)
def test_a_plan_must_chain_from_the_start_asked_to_the_end_asked(plan: Plan, start, end, refused) -> None:
    if refused is None:
        check_plan("planning", plan, "s", start, end)
    else:
        with pytest.raises(MisdirectedAnswerError, match=refused):
            check_plan("planning", plan, "s", start, end)
