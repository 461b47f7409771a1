"""prime-rl's admin API on the sidecar (``sidecar/admin_prime_rl.py``, ``STITCH_SIDECAR_ADMIN_API``).

Real sidecars over the fake engine and a real bulletin, over loopback HTTP; the requests are the
ones prime-rl's orchestrator sends (PrimeIntellect-ai/prime-rl ``src/prime_rl/utils/client.py``):
``POST /pause?mode=keep&clear_cache=false``, ``POST /update_weights {"weight_dir": ...}``,
``POST /resume``, ``POST /load_lora_adapter {lora_name, lora_path}``, ``POST /v1/unload_lora_adapter``,
``GET /v1/models``. Versions carry the trainer's step in their manifest's metadata, as
``stitchboard watch --layout prime-rl`` publishes them.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

from stitchboard.proto.sidecar_wire import SHOULD_RETRY_HEADER
from stitchboard.sidecar.admin_prime_rl import step_of_weight_dir
from stitchboard.sidecar.errors import InvalidAdminRequestError
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher, assert_at, make_view, mutate, wait_for

ON = {"admin_api": "prime-rl"}
#: The admin routes prime-rl's client calls, with the bodies it sends.
ADMIN_CALLS = [
    ("/pause?mode=keep&clear_cache=false", None),
    ("/resume", None),
    ("/update_weights", {"weight_dir": "/out/broadcasts/step_1"}),
    ("/load_lora_adapter", {"lora_name": "r", "lora_path": "/out/broadcasts/step_1"}),
    ("/v1/unload_lora_adapter", {"lora_name": "r"}),
]


def publish_step(publisher: Publisher, view, step: int) -> int:
    """Publish ``view`` as the next version recording training ``step`` (as the watcher does); its version."""
    manifest = publisher.prepare(view)
    manifest = manifest.model_copy(update={"metadata": {**manifest.metadata, "step": step}})
    publisher.commit(manifest, view)
    return manifest.version


def _in_thread(call) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["response"] = call()
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _complete(sidecar, wait_s: float = 30.0) -> httpx.Response:
    return httpx.post(
        f"{sidecar.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"X-Stitch-Wait-S": str(wait_s)},
        timeout=60,
    )


def test_off_every_admin_route_answers_403_and_reaches_no_engine(sc_publisher, sc_start):
    """The default (admin_api off): each of prime-rl's admin calls is the catch-all's 403 of today."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine)
    for path, body in ADMIN_CALLS:
        r = sidecar.http.post(path, json=body) if body is not None else sidecar.http.post(path)
        assert r.status_code == 403 and r.json()["type"] == "RouteForbidden", (path, r.status_code, r.text)
    assert engine.http_control_calls == []


def test_pause_holds_new_requests_until_resume_and_never_pauses_the_engine(sc_publisher, sc_start):
    """/pause: a request in flight finishes, a new one is held (it never reaches the engine) until
    /resume, one whose wait runs out first gets 503 NotReady; the engine's own pause is never called."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine(token_delay_s=0.05)
    sidecar = sc_start(engine, **ON)
    sidecar.wait_applied(0)
    pauses, controls = engine.count("pause"), list(engine.http_control_calls)
    flight, flown = _in_thread(
        lambda: httpx.post(f"{sidecar.url}/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=60)
    )
    wait_for(lambda: engine.first_tokens >= 1, 30, "the request in flight generating")
    r = sidecar.http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert r.status_code == 200 and r.json()["status"] == "paused"
    started = engine.started
    held, out = _in_thread(lambda: _complete(sidecar))
    wait_for(lambda: sidecar.app.state.admin_pause.held == 1, 10, "the new request held")
    flight.join(60)
    assert flown["response"].status_code == 200, "the request in flight did not finish while paused"
    late = _complete(sidecar, wait_s=0.3)
    assert late.status_code == 503 and late.json()["type"] == "NotReady" and "/resume" in late.json()["message"]
    assert late.headers[SHOULD_RETRY_HEADER] == "true" and "Retry-After" in late.headers
    time.sleep(0.5)
    assert held.is_alive() and engine.started == started, "a new request reached the engine while paused"
    resumed_at = time.monotonic()
    r = sidecar.http.post("/resume")
    assert r.status_code == 200 and r.json()["status"] == "resumed"
    held.join(30)
    assert out["response"].status_code == 200 and out["at"] >= resumed_at
    assert out["response"].json()["weight_version_start"] == 0
    assert engine.count("pause") == pauses and engine.http_control_calls == controls


def test_update_weights_answers_once_the_steps_version_is_applied(sc_publisher, sc_start):
    """/update_weights for a step published later waits for its version, then answers 200 with
    {step, version} once the sidecar holds that version (or a later one), bit-exact."""
    assert publish_step(sc_publisher, make_view(0), 0) == 0
    engine = FakeEngine()
    engine.write_s_per_tensor = 0.2  # a commit takes ~1 s: an answer at publish time would come before it
    sidecar = sc_start(engine, **ON)
    sidecar.wait_applied(0)
    r = sidecar.http.post("/update_weights", json={"weight_dir": "/out/broadcasts/step_0"})
    assert r.status_code == 200 and r.json() == {"status": "ok", "step": 0, "version": 0, "applied_version": 0}

    thread, out = _in_thread(
        lambda: httpx.post(f"{sidecar.url}/update_weights", json={"weight_dir": "/out/broadcasts/step_3/"}, timeout=60)
    )
    publish_step(sc_publisher, mutate(sc_publisher.views[-1], 1), 2)  # step 2: not the step asked
    sidecar.wait_applied(1)
    time.sleep(0.3)
    assert thread.is_alive(), f"answered before step 3 was published: {out}"
    version = publish_step(sc_publisher, mutate(sc_publisher.views[-1], 2), 3)
    thread.join(60)
    r = out["response"]
    assert r.status_code == 200 and r.json()["step"] == 3 and r.json()["version"] == version == 2, r.text
    assert sidecar.status()["applied_version"] >= 2, "answered before the step's version was applied"
    assert_at(sidecar, sc_publisher, 2)
    # A step whose version the sidecar is already past (prime-rl's checkpoint folder form): at once.
    r = sidecar.http.post("/update_weights", json={"weight_dir": "/out/checkpoints/step_1/weight"})
    assert r.status_code == 200 and (r.json()["step"], r.json()["version"]) == (1, 1)


@pytest.mark.parametrize(
    "body",
    [
        {"weight_dir": "/out/broadcasts/checkpoint-3"},
        {"weight_dir": "/out/broadcasts/step_x"},
        {"weight_dir": "/out/broadcasts/step_\u0660"},  # a Unicode digit zero: not step 0
        {"weight_dir": None},
        {"weight_dir": 3},
        {"path": "/out/broadcasts/step_3"},
        "step_3",
    ],
)
def test_a_malformed_weight_dir_is_422_naming_the_expected_form(sc_publisher, sc_start, body):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(), **ON)
    r = sidecar.http.post("/update_weights", json=body)
    assert r.status_code == 422 and r.json()["type"] == "InvalidAdminRequest", r.text
    assert "step_N" in r.json()["message"] and r.headers[SHOULD_RETRY_HEADER] == "false"


@pytest.fixture
def default_recursion_limit():
    """The interpreter's recursion limit at CPython's default (1000), as in a sidecar's own process, for this test.

    The sidecar under test runs in this process, and an xdist worker may have compiled with torch inductor for an
    earlier module, which raises the limit to 2000 (torch/_inductor/compile_fx.py): the 1900-deep body then parses,
    names step_0 and waits for it (seen in CI: a 30 s read timeout)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)


def test_a_body_nested_too_deep_is_422_not_500(sc_publisher, sc_start, default_recursion_limit):
    """A body under the cap whose JSON nests deeper than the parser recurses is refused as unreadable (422, not
    retried), not a 500 that prime-rl would retry for minutes."""
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(), **ON)
    body = '{"weight_dir": "/out/broadcasts/step_0", "a": ' + "[" * 1900 + "]" * 1900 + "}"
    assert len(body) < 4096
    r = sidecar.http.post("/update_weights", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["type"] == "InvalidAdminRequest", r.text
    assert r.headers[SHOULD_RETRY_HEADER] == "false"


def test_the_step_is_read_from_the_last_folder():
    assert step_of_weight_dir("/o/broadcasts/step_12") == 12
    assert step_of_weight_dir("/o/checkpoints/step_7/weight/") == 7
    for bad in ("/o/step_1/model", "/o/step_-1", "step_", f"/o/step_{2**63}", "", "/o/step_\u0661\u0662"):
        with pytest.raises(InvalidAdminRequestError):
            step_of_weight_dir(bad)


def test_a_step_never_published_answers_503_within_the_bound(sc_publisher, sc_start):
    publish_step(sc_publisher, make_view(0), 0)
    sidecar = sc_start(FakeEngine(), admin_update_wait_s=1.0, **ON)
    sidecar.wait_applied(0)
    t0 = time.monotonic()
    r = sidecar.http.post("/update_weights", json={"weight_dir": "/out/broadcasts/step_7"})
    elapsed = time.monotonic() - t0
    assert r.status_code == 503 and r.json()["type"] == "StepNotApplied", r.text
    assert (r.json()["step"], r.json()["version"], r.json()["applied_version"]) == (7, None, 0)
    assert "step 7" in r.json()["message"] and r.headers[SHOULD_RETRY_HEADER] == "true"
    assert 1.0 <= elapsed < 10, elapsed


def test_many_waits_leave_health_and_requests_answered(sc_publisher, sc_start):
    """40 /update_weights waits for a step not yet published (more than the event loop's default executor has
    threads) hold none of the threads /health's engine call uses: /health answers 200 while every wait is still
    pending, and a wait still answers once its step's version is applied."""
    publish_step(sc_publisher, make_view(0), 0)
    sidecar = sc_start(FakeEngine(), admin_update_wait_s=6.0, engine_call_timeout_s=2.0, **ON)
    sidecar.wait_applied(0)
    waits = [
        _in_thread(
            lambda: httpx.post(
                f"{sidecar.url}/update_weights", json={"weight_dir": "/out/broadcasts/step_1"}, timeout=60
            )
        )
        for _ in range(40)
    ]
    time.sleep(0.5)  # the waits reach the sidecar (not a bound on anything asserted)
    health = sidecar.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert all(thread.is_alive() for thread, _ in waits), "a wait answered before its step was published"
    publish_step(sc_publisher, mutate(sc_publisher.views[-1], 1), 1)
    for thread, out in waits:
        thread.join(60)
        assert out["response"].status_code == 200 and out["response"].json()["version"] == 1, out["response"].text


def test_a_step_whose_version_the_engine_refuses_for_good_is_409(sc_publisher, sc_start):
    publish_step(sc_publisher, make_view(0), 0)
    engine = FakeEngine()
    sidecar = sc_start(engine, **ON)
    sidecar.wait_applied(0)
    engine.refuse_versions = {1}  # cause UnmappedTensor: permanent
    publish_step(sc_publisher, mutate(sc_publisher.views[-1], 1), 1)
    r = sidecar.http.post("/update_weights", json={"weight_dir": "/out/broadcasts/step_1"})
    assert r.status_code == 409 and r.json()["type"] == "StepRefused", r.text
    assert (r.json()["step"], r.json()["version"], r.json()["applied_version"]) == (1, 1, 0)
    assert "UnmappedTensor" in r.json()["message"] and r.headers[SHOULD_RETRY_HEADER] == "false"


def test_lora_routes_on_a_full_model_run_are_409(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine, **ON)
    sidecar.wait_applied(0)
    for path, body in ADMIN_CALLS[3:]:
        r = sidecar.http.post(path, json=body)
        assert r.status_code == 409 and r.json()["type"] == "NotAnAdapterRun", (path, r.text)
        assert "/update_weights" in r.json()["message"] or "not an adapter run" in r.json()["message"]
    assert engine.http_control_calls == []


def test_admin_bodies_over_the_cap_are_413(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(), **ON)
    r = sidecar.http.post("/update_weights", json={"weight_dir": "/out/" + "a" * 5000 + "/step_1"})
    assert r.status_code == 413 and r.json()["type"] == "BodyTooLarge", r.text
    r = sidecar.http.post("/pause", json={"mode": "keep"})  # /pause takes no body
    assert r.status_code == 413 and r.json()["type"] == "BodyTooLarge", r.text
    assert not sidecar.app.state.admin_pause.paused


def test_models_list_the_served_model_as_prime_rl_checks(sc_publisher, sc_start):
    """prime-rl's check: some entry of /v1/models' ``data`` has ``id`` equal to its model name (the
    engine's served model name, passed through)."""
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(), **ON)
    sidecar.wait_applied(0)
    r = sidecar.http.get("/v1/models")
    assert r.status_code == 200 and any(model["id"] == "fake" for model in r.json()["data"])
    assert sidecar.http.get("/health").status_code == 200
