"""The sidecar's side of routing replay on SGLang without an engine: the fields sent on to SGLang,
the cache salt, and the rows' weight versions from the output tokens' spans
(:mod:`stitchboard.sidecar.engines.sglang.routing_replay`). SGLang's own rows: ``test_sglang_moe.py``."""

from __future__ import annotations

from stitchboard.sidecar.engines.sglang.routing_replay import SglangRoutedExperts, row_versions
from stitchboard.sidecar.routed_experts import ERROR_FIELD, START_LEN_FIELD, VERSIONS_FIELD, WANT_FIELD, wants_routing


def test_rows_carry_the_version_of_the_pass_that_routed_them():
    one = [{"version": 1, "start": 0, "end": 5}]
    assert row_versions(one, 4, 5, 0) == [{"version": 1, "start": 0, "end": 8}]
    assert row_versions(one, 4, 5, 5) == [{"version": 1, "start": 0, "end": 3}]
    # 4 prompt + 5 output tokens, outputs 3.. under version 2: output token 3 was sampled from
    # position 6's pass; the prompt's rows and positions 3-5 keep version 1's first routing
    crossed = [{"version": 1, "start": 0, "end": 3}, {"version": 2, "start": 3, "end": 5}]
    assert row_versions(crossed, 4, 5, 0) == [
        {"version": 1, "start": 0, "end": 6},
        {"version": 2, "start": 6, "end": 8},
    ]
    assert row_versions(crossed, 4, 5, 5) == [
        {"version": 1, "start": 0, "end": 1},
        {"version": 2, "start": 1, "end": 3},
    ]
    assert row_versions(crossed, 4, 5, 7) == [{"version": 2, "start": 0, "end": 1}]
    twice = [
        {"version": 1, "start": 0, "end": 1},
        {"version": 2, "start": 1, "end": 2},
        {"version": 3, "start": 2, "end": 5},
    ]
    assert row_versions(twice, 4, 5, 0) == [
        {"version": 1, "start": 0, "end": 4},
        {"version": 2, "start": 4, "end": 5},
        {"version": 3, "start": 5, "end": 8},
    ]
    assert row_versions(None, 4, 5, 0) is None


def test_the_fields_go_on_to_sglang_and_prompt_rows_salt_the_cache():
    body = {"prompt": "hello", "return_routed_experts": True, "cache_salt": "mine"}
    start_len = wants_routing({}, body, "/v1/completions")
    assert start_len == 0 and WANT_FIELD not in body
    SglangRoutedExperts(start_len, body)
    assert body[WANT_FIELD] is True and START_LEN_FIELD not in body
    assert body["cache_salt"].startswith("mine|stitch-routing-")
    again = {"prompt": "hello"}
    SglangRoutedExperts(0, again)
    assert again["cache_salt"] != body["cache_salt"].split("|")[1], "two requests share a salt"
    tokens = {"prompt": [5, 6, 7]}
    SglangRoutedExperts(3, tokens)  # only output rows of a token prompt: the cache is kept
    assert tokens[START_LEN_FIELD] == 3 and "cache_salt" not in tokens
    SglangRoutedExperts(2, partly := {"prompt": [5, 6, 7]})
    assert "cache_salt" in partly, "the last prompt row was asked for but the prompt may be read from the cache"


def test_an_answer_gets_its_row_versions_or_says_why_not():
    routed = SglangRoutedExperts(0, {"prompt": "x"})
    answer = {
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "weight_versions": [{"version": 4, "start": 0, "end": 2}],
        "sglext": {"routed_experts": "AAAA"},
    }
    routed.attach(answer)
    assert (
        answer[VERSIONS_FIELD] == [{"version": 4, "start": 0, "end": 4}]
        and answer["sglext"]["routed_experts"] == "AAAA"
    )
    assert ERROR_FIELD not in answer
    missing = {
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "weight_versions": [{"version": 4, "start": 0, "end": 2}],
        "sglext": {"routed_experts": None},
    }
    SglangRoutedExperts(0, {"prompt": "x"}).attach(missing)
    assert "loader" in missing[ERROR_FIELD]
    stream = SglangRoutedExperts(1, {"prompt": "x"})
    assert (
        stream.fields([{"version": 4, "start": 0, "end": 2}])[ERROR_FIELD]
        == "the engine did not report the answer's length"
    )
    stream.see_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert stream.fields([{"version": 4, "start": 0, "end": 2}]) == {
        START_LEN_FIELD: 1,
        VERSIONS_FIELD: [{"version": 4, "start": 0, "end": 3}],
    }


def test_the_sidecar_sends_the_fields_to_sglang_and_tags_the_answer(sc_publisher, sc_start):
    from tests.sidecar.fake_sglang import FakeSglang
    from tests.sidecar.sidecar_helpers import make_view

    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeSglang(), engine="sglang", engine_call_timeout_s=3.0)
    sidecar.wait_applied(0)
    answer = sidecar.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, WANT_FIELD: True}).json()
    sent = answer["echo_body"]
    assert sent[WANT_FIELD] is True and sent["cache_salt"].startswith("stitch-routing-"), sent
    # the fake reports no usage (a real SGLang does: test_sglang_moe.py), so neither spans nor the rows' versions can
    # be had
    assert "weight_versions" in answer
    assert answer[VERSIONS_FIELD] is None and answer[ERROR_FIELD] == "the engine did not report the answer's length"
    refused = sidecar.http.post("/v1/completions", json={"prompt": "x", "n": 2, WANT_FIELD: True})
    assert refused.status_code == 400 and refused.json()["type"] == "RoutedExpertsRefused", refused.text
