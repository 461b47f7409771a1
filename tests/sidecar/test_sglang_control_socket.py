"""The SGLang loader's control socket without SGLang: the lease over real Unix sockets.

:class:`~stitchboard.sidecar.engines.sglang.stager.StageServer` and the loader's own handler
(``loader._control``) run here as they do in a scheduler process, on an abstract address of
the test's own; no weights are touched (the ops under test are refused before any). The real
server's socket is exercised by test_sglang_engine.py and test_sglang_sidecar.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from stitchboard.sidecar.engines.lease import Lease
from stitchboard.sidecar.engines.sglang import loader
from stitchboard.sidecar.engines.sglang.stager import StageServer, ask


def _address() -> str:
    return f"\0stitchboard-test-{uuid.uuid4().hex}"


@pytest.fixture
def control(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The loader's handler on a socket of its own, with a fresh lease and no staged plan."""
    monkeypatch.setattr(loader, "_lease", Lease())
    monkeypatch.setattr(loader, "_plan", None)
    address = _address()
    StageServer(address, lambda req: loader._control(None, req), after=loader._after_answer).start()  # type: ignore[arg-type]
    yield address


def test_one_owner_holds_the_lease_and_the_others_stage_and_commit_nothing(control: str) -> None:
    taken = ask(control, {"op": "lease", "owner": "a", "ttl_s": 30.0}, 10)
    assert taken["ok"] and taken["lease"]["holder"] == "a" and 29 < taken["lease"]["expires_in_s"] <= 30
    refused = ask(control, {"op": "lease", "owner": "b", "ttl_s": 30.0}, 10)
    assert refused["error"]["type"] == "LeaseNotHeld" and refused["error"]["holder"] == "a"
    assert 0 < refused["error"]["expires_in_s"] <= 30
    steps = [{"paths": ["/nonexistent.patch"], "digests": ["0" * 64]}]
    for req in (
        {"op": "stage", "id": "p", "owner": "b", "steps": steps},
        {"op": "commit", "id": "c", "owner": "b", "plan": "p", "what": "0->1"},
        {"op": "stage", "id": "p", "steps": steps},  # no owner at all
    ):
        answer = ask(control, req, 10)
        assert not answer["ok"] and answer["lease"]["holder"] == "a", answer
        assert answer["error"]["type"] in ("LeaseNotHeld", "ValueError"), answer
    assert loader._plan is None, "a refused staging kept a plan"
    ask(control, {"op": "lease", "owner": "a", "release": True}, 10)
    assert ask(control, {"op": "lease", "owner": "b", "ttl_s": 30.0}, 10)["lease"]["holder"] == "b"


def test_a_lease_request_is_answered_while_another_connection_is_busy() -> None:
    """Each connection is answered in a thread of its own: a renewal never waits behind a
    staging (seconds of decoding) on the same socket; ``after`` gets each request."""
    release, seen = threading.Event(), []

    def handle(req: dict) -> dict:
        if req.get("op") == "stage":
            release.wait(30)
        return {"ok": True, "op": req.get("op")}

    address = _address()
    StageServer(address, handle, after=lambda req: seen.append(req.get("op"))).start()
    staging: dict = {}
    thread = threading.Thread(target=lambda: staging.update(ask(address, {"op": "stage"}, 30)), daemon=True)
    thread.start()
    assert ask(address, {"op": "lease"}, 5) == {"ok": True, "op": "lease"}
    assert thread.is_alive() and not staging
    release.set()
    thread.join(30)
    assert staging == {"ok": True, "op": "stage"}
    deadline = time.monotonic() + 10  # ``after`` runs once the answer is sent: it may trail the reply
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(seen) == ["lease", "stage"]
