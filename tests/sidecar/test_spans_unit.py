"""Spans and the cache salt without an engine: the span arithmetic, the ledger, request parsing,
SGLang's spans normalised, and when a salted commit still resets the cache."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stitchboard.sidecar.engines import lookup, register
from stitchboard.sidecar.engines.sglang.token_counts import output_key as sglang_output_key
from stitchboard.sidecar.engines.vllm.token_counts import output_key
from stitchboard.sidecar.errors import InvalidVersionConstraintError
from stitchboard.sidecar.salt import CacheSalter
from stitchboard.sidecar.spans import DROP, SEND, SpanLedger, Spans, SpanStamper, build_spans, engine_spans, wants_spans


def test_spans_split_at_each_commit_count():
    assert build_spans(3, [], 10) == [{"version": 3, "start": 0, "end": 10}]
    assert build_spans(3, [(4, 6)], 10) == [{"version": 3, "start": 0, "end": 6}, {"version": 4, "start": 6, "end": 10}]
    assert build_spans(3, [(4, 0)], 10) == [{"version": 4, "start": 0, "end": 10}], (
        "not started at the commit: all under the new version"
    )
    assert build_spans(3, [(4, 10)], 10) == [{"version": 3, "start": 0, "end": 10}], "finished before the commit"
    assert build_spans(3, [(4, 2), (5, 2), (6, 7)], 9) == [
        {"version": 3, "start": 0, "end": 2},
        {"version": 5, "start": 2, "end": 7},
        {"version": 6, "start": 7, "end": 9},
    ], "a commit with no token in between leaves no empty span"


def test_ledger_records_counts_by_mark_and_forgets_closed_requests():
    ledger = SpanLedger()
    rid = ledger.open(2, "client-7")
    other = ledger.open(2)
    assert rid.startswith("client-7-stitch-") and len(other) == 39 and ledger.wanted()
    ledger.commit(3, {f"{rid[-39:]}:0:0": 5, f"{other}:0:0": 1})
    assert ledger.close(rid, {0: 8}) == {
        0: [{"version": 2, "start": 0, "end": 5}, {"version": 3, "start": 5, "end": 8}]
    }
    assert ledger.close(rid, {0: 8}) is None, "closed once"
    ledger.commit(4, None)  # the engine could not count: no spans rather than wrong ones
    assert ledger.close(other, {0: 8}) is None and not ledger.wanted()


def test_each_output_of_a_request_splits_at_its_own_count():
    ledger = SpanLedger()
    rid = ledger.open(1, choices=2)  # two prompts, n = 2: choices 0..3
    ledger.commit(2, {f"{rid}:0:0": 3, f"{rid}:0:1": 0, f"{rid}:1:1": 6, "stitch-other:0:0": 9})
    assert ledger.close(rid, {0: 4, 1: 4, 2: 5, 3: 6}) == {
        0: [{"version": 1, "start": 0, "end": 3}, {"version": 2, "start": 3, "end": 4}],
        1: [{"version": 2, "start": 0, "end": 4}],
        2: [{"version": 2, "start": 0, "end": 5}],
        3: [{"version": 1, "start": 0, "end": 6}],
    }


def test_vllm_request_ids_name_their_output():
    mark = "stitch-" + "ab" * 16
    assert output_key(f"cmpl-{mark}-0-1a2b3c4d") == f"{mark}:0:0"
    assert output_key(f"3_cmpl-client-7-{mark}-2-12345678") == f"{mark}:2:3"
    assert (
        output_key(f"chatcmpl-{mark}-12345678") == f"{mark}:0:0"
        and output_key(f"1_chatcmpl-{mark}-00000001") == f"{mark}:0:1"
    )
    assert output_key("cmpl-plain-0-1a2b3c4d") is None


def test_request_flags():
    body = {"return_weight_versions": True, "prompt": "x"}
    assert wants_spans({}, body) and "return_weight_versions" not in body
    assert wants_spans({"x-stitch-return-weight-versions": "1"}, {"prompt": [1, 2, 3]})
    assert not wants_spans({}, {"prompt": "x"})
    with pytest.raises(InvalidVersionConstraintError):
        wants_spans({}, {"return_weight_versions": "yes"})
    assert wants_spans({}, {"return_weight_versions": True, "n": 2})


def test_several_outputs_get_spans_per_choice_and_the_token_ids_only_the_sidecar_asked_for_go():
    ledger = SpanLedger()
    body = {"prompt": "x", "n": 2}
    spans = Spans(ledger, False, 1, "/v1/completions", body, None)
    assert body["return_token_ids"] and spans.changed_body and spans.multi
    ledger.commit(2, {f"{spans.request_id}:0:1": 2})
    answer = {
        "choices": [
            {"index": 0, "text": "ab", "token_ids": [5, 6], "prompt_token_ids": [1]},
            {"index": 1, "text": "abc", "token_ids": [5, 6, 7]},
        ]
    }
    spans.attach(answer)
    assert (
        answer["weight_versions"] is None
        and "token_ids" not in answer["choices"][0]
        and "prompt_token_ids" not in answer["choices"][0]
    )
    assert [c["weight_versions"] for c in answer["choices"]] == [
        [{"version": 2, "start": 0, "end": 2}],
        [{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 3}],
    ]
    streamed = Spans(
        ledger, False, 1, "/v1/completions", {"prompt": "x", "n": 2, "stream": True, "return_token_ids": True}, None
    )
    assert streamed.see_event({"choices": [{"index": 1, "text": "a", "token_ids": [5]}]}) == SEND, (
        "the client asked for the ids"
    )
    ledger.commit(2, {f"{streamed.request_id}:0:1": 1})
    streamed.see_event(
        {"choices": [{"index": 0, "text": "a", "token_ids": [5, 6]}, {"index": 1, "text": "b", "token_ids": [7]}]}
    )
    stamper = SpanStamper(1, lambda: 2, None, lambda: streamed.streamed(2))
    stamp = json.loads(stamper.finish()[5:])
    assert stamp["weight_versions"] is None and stamp["choices"] == [
        {"index": 0, "weight_versions": [{"version": 2, "start": 0, "end": 2}]},
        {"index": 1, "weight_versions": [{"version": 1, "start": 0, "end": 1}, {"version": 2, "start": 1, "end": 2}]},
    ]


def test_sglang_spans_are_passed_on_with_integer_versions():
    info = {
        "weight_version": "5",
        "weight_versions": [{"version": "4", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 8}],
    }
    assert engine_spans(info, 8) == [{"version": 4, "start": 0, "end": 3}, {"version": 5, "start": 3, "end": 8}]
    assert engine_spans({"weight_version": "5"}, 8) == [{"version": 5, "start": 0, "end": 8}]
    assert engine_spans({"weight_version": "default"}, 8) is None
    spans = Spans(SpanLedger(), True, 5, "/generate", {"text": "x"}, None)
    answer = [{"text": "a", "meta_info": {"weight_version": "5", "completion_tokens": 2}}]
    spans.attach(answer)
    assert answer[0]["weight_versions"] == [{"version": 5, "start": 0, "end": 2}]


def test_stream_usage_is_asked_for_and_withheld_unless_the_client_asked():
    ledger = SpanLedger()
    body = {"stream": True, "prompt": "x"}
    spans = Spans(ledger, False, 1, "/v1/completions", body, None)
    assert body["stream_options"] == {"include_usage": True} and spans.changed_body
    assert spans.see_event({"choices": [{"text": "a"}]}) == SEND
    assert spans.see_event({"choices": [], "usage": {"completion_tokens": 4}}) == DROP
    ledger.commit(2, {f"{spans.request_id[-39:]}:0:0": 1} if spans.request_id else {})
    stamper = SpanStamper(1, lambda: 2, None, lambda: spans.streamed(2))
    stamper.emit(b'data: {"id": "c", "choices": [{"text": "a"}]}\n\n')
    stamp = json.loads(stamper.finish()[5:])
    assert stamp["weight_versions"] == [{"version": 1, "start": 0, "end": 1}, {"version": 2, "start": 1, "end": 4}]
    assert (stamp["weight_version_start"], stamp["weight_version_end"], stamp["id"]) == (1, 2, "c")


def test_salted_commits_reset_only_when_old_kv_could_still_be_used():
    salter = CacheSalter(True, "vllm")
    body = {"prompt": "x", "cache_salt": "mine"}
    assert salter.salt("/v1/completions", body, 7) and body["cache_salt"] == "mine|stitch-v7"
    assert not salter.needs_reset(0), "nothing in flight, every request salted: no reset"
    assert salter.needs_reset(1), "a request admitted under the old version runs on"
    assert not salter.salt("/v1/embeddings", {"input": "x"}, 7) and salter.needs_reset(0), (
        "an unsalted request was admitted"
    )
    salter.was_reset()
    assert not salter.needs_reset(0)
    register(replace(lookup("vllm"), name="unsalted", salted_paths=frozenset()))  # a kind that salts no route
    assert CacheSalter(False, "vllm").needs_reset(0) and CacheSalter(True, "unsalted").needs_reset(0)
    sglang = CacheSalter(True, "sglang")
    batch = {"text": ["a", "b"], "cache_salt": ["mine", ""]}
    assert sglang.salt("/generate", batch, 3) and batch["cache_salt"] == ["mine|stitch-v3", "stitch-v3"]
    assert not sglang.salt("/generate", {"text": "a", "cache_salt": 5}, 3) and sglang.needs_reset(0), (
        "a salt it cannot extend"
    )


def test_sglang_openai_streams_are_counted_by_their_rid():
    ledger = SpanLedger()
    body = {"prompt": "x", "stream": True, "rid": "mine"}
    spans = Spans(ledger, True, 4, "/v1/completions", body, None)
    assert body["rid"] == spans.request_id and body["rid"].startswith("mine-stitch-") and not spans.engine_reports
    assert sglang_output_key(body["rid"]) == f"{body['rid'][-39:]}:0:0" and sglang_output_key(
        body["rid"] + "_3"
    ).endswith(":0:3")
    ledger.commit(5, {f"{body['rid'][-39:]}:0:0": 2})
    spans.see_event({"choices": [], "usage": {"completion_tokens": 6}})
    assert spans.streamed(5) == ([{"version": 4, "start": 0, "end": 2}, {"version": 5, "start": 2, "end": 6}], None)
    for plain in ({"prompt": "x"}, {"prompt": "x", "n": 2}, {"text": "x", "stream": True}):
        assert Spans(
            ledger, True, 4, "/generate" if "text" in plain else "/v1/completions", plain, None
        ).engine_reports, f"SGLang reports its own spans (or none): {plain}"
