"""Spans and the cache salt without an engine: the span arithmetic, the ledger, request parsing,
SGLang's spans normalised, and when a salted commit still resets the cache."""

from __future__ import annotations

import json

import pytest

from stitchboard.sidecar.errors import InvalidVersionConstraintError
from stitchboard.sidecar.salt import CacheSalter
from stitchboard.sidecar.spans import SpanLedger, Spans, SpanStamper, build_spans, engine_spans, wants_spans


def test_spans_split_at_each_commit_count():
    assert build_spans(3, [], 10) == [{"version": 3, "start": 0, "end": 10}]
    assert build_spans(3, [(4, 6)], 10) == [{"version": 3, "start": 0, "end": 6}, {"version": 4, "start": 6, "end": 10}]
    assert build_spans(3, [(4, 0)], 10) == [{"version": 4, "start": 0, "end": 10}], "not started at the commit: all under the new version"
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
    ledger.commit(3, {rid[-39:]: 5})
    assert ledger.close(rid, 8) == [{"version": 2, "start": 0, "end": 5}, {"version": 3, "start": 5, "end": 8}]
    assert ledger.close(rid, 8) is None, "closed once"
    ledger.commit(4, None)  # the engine could not count: no spans rather than wrong ones
    assert ledger.close(other, 8) is None and not ledger.wanted()


def test_request_flags_and_single_outputs():
    body = {"return_weight_versions": True, "prompt": "x"}
    assert wants_spans({}, body, counted=True) and "return_weight_versions" not in body
    assert wants_spans({"x-stitch-return-weight-versions": "1"}, {"prompt": [1, 2, 3]}, counted=True)
    assert not wants_spans({}, {"prompt": "x"}, counted=True)
    with pytest.raises(InvalidVersionConstraintError):
        wants_spans({}, {"return_weight_versions": "yes"}, counted=True)
    with pytest.raises(InvalidVersionConstraintError, match="one output"):
        wants_spans({}, {"return_weight_versions": True, "n": 2}, counted=True)
    assert wants_spans({}, {"return_weight_versions": True, "n": 2}, counted=False)


def test_sglang_spans_are_passed_on_with_integer_versions():
    info = {"weight_version": "5", "weight_versions": [{"version": "4", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 8}]}
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
    assert spans.see_event({"choices": [{"text": "a"}]})
    assert not spans.see_event({"choices": [], "usage": {"completion_tokens": 4}})
    ledger.commit(2, {spans.request_id[-39:]: 1} if spans.request_id else {})
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
    assert not salter.salt("/v1/embeddings", {"input": "x"}, 7) and salter.needs_reset(0), "an unsalted request was admitted"
    salter.was_reset()
    assert not salter.needs_reset(0)
    assert CacheSalter(False, "vllm").needs_reset(0) and CacheSalter(True, "sglang").needs_reset(0)
