"""The sidecar's side of routing replay without an engine: what a request asks, and the answer's
rows and version spans cut from a worker capture (:mod:`stitchboard.sidecar.routed_experts`)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from stitchboard.sidecar.errors import RoutedExpertsRefusedError
from stitchboard.sidecar.routed_experts import (
    ERROR_FIELD,
    VERSIONS_FIELD,
    RoutedExperts,
    RoutingSource,
    routed_fields,
    wants_routing,
)

LAYERS, TOP_K = 2, 2


def _capture(start: int, n: int, versions: list[list[int]]) -> tuple[dict, dict, np.ndarray]:
    rows = np.arange(start * LAYERS * TOP_K, (start + n) * LAYERS * TOP_K, dtype=np.int32).reshape(n, LAYERS, TOP_K)
    report = {"moe": True, "model": "m", "num_layers": LAYERS, "top_k": TOP_K}
    return (
        report,
        {"prompt_tokens": 5, "start": start, "rows": base64.b64encode(rows.tobytes()).decode(), "versions": versions},
        rows,
    )


def _rows(fields: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(fields["sglext"]["routed_experts"]), dtype=np.int32).reshape(
        -1, LAYERS, TOP_K
    )


def test_asking_takes_the_fields_out_and_checks_them():
    body = {"prompt": "x", "return_routed_experts": True, "routed_experts_start_len": 3}
    assert wants_routing({}, body, "/v1/completions") == 3 and body == {"prompt": "x"}
    assert wants_routing({"x-stitch-return-routed-experts": "1"}, {"messages": []}, "/v1/chat/completions") == 0
    assert wants_routing({}, {"prompt": "x", "return_routed_experts": False}, "/v1/completions") is None
    for headers, body, path, says in [
        ({}, {"return_routed_experts": "yes"}, "/v1/completions", "true or false"),
        ({"x-stitch-return-routed-experts": "maybe"}, {}, "/v1/completions", "1 or 0"),
        ({}, {"return_routed_experts": True, "routed_experts_start_len": -1}, "/v1/completions", "integer >= 0"),
        ({}, {"return_routed_experts": True}, "/v1/embeddings", "not on /v1/embeddings"),
        ({}, {"return_routed_experts": True, "n": 2}, "/v1/completions", "one output per request"),
        ({}, {"return_routed_experts": True, "prompt": ["a", "b"]}, "/v1/completions", "one output per request"),
        ({"x-stitch-return-routed-experts": "1"}, None, "/v1/completions", "JSON request body"),
    ]:
        with pytest.raises(RoutedExpertsRefusedError, match=says):
            wants_routing(headers, body, path)


def test_rows_from_start_len_to_the_last_read_token_with_their_versions():
    # prompt 5 + 4 output tokens: positions 0..7 were read (the last output token never is)
    report, capture, rows = _capture(0, 9, [[3, 0, 6], [4, 6, 9]])
    fields = routed_fields(report, capture, 2, (5, 4))
    assert np.array_equal(_rows(fields), rows[2:8]) and fields["routed_experts_start_len"] == 2
    assert fields[VERSIONS_FIELD] == [{"version": 3, "start": 0, "end": 4}, {"version": 4, "start": 4, "end": 6}]
    full = routed_fields(report, capture, 0, (5, 4))
    assert np.array_equal(_rows(full), rows[:8]) and ERROR_FIELD not in full


def test_a_capture_that_misses_asked_rows_says_so_instead_of_guessing():
    report, capture, _ = _capture(3, 5, [[1, 3, 8]])  # positions 0..2 came from the prefix cache
    fields = routed_fields(report, capture, 0, (5, 4))
    assert fields["sglext"]["routed_experts"] is None and "not all of 0..7" in fields[ERROR_FIELD]
    assert ERROR_FIELD not in routed_fields(report, capture, 4, (5, 4))
    assert "captured no routing" in routed_fields(report, None, 0, (5, 4))[ERROR_FIELD]
    assert "length" in routed_fields(report, capture, 0, None)[ERROR_FIELD]


def test_prompt_rows_salt_the_cache_unless_a_token_prompt_needs_none():
    source = RoutingSource(lambda marks: {}, 1.0)
    text = {"prompt": "abc", "cache_salt": "mine"}
    routed = RoutedExperts(source, 0, text, "client-1")
    assert text["cache_salt"] == f"mine|{routed.mark}" and routed.request_id == f"client-1-{routed.mark}"
    tokens = {"prompt": [1, 2, 3, 4]}
    RoutedExperts(source, 3, tokens, None)
    assert "cache_salt" not in tokens
    RoutedExperts(source, 2, tokens, None)
    assert tokens["cache_salt"].startswith("stitch-routing-")
    stream = {"prompt": "abc", "stream": True}
    routed = RoutedExperts(source, 0, stream, None)
    assert stream["stream_options"] == {"include_usage": True}
    assert routed.see_event(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    ) is False and routed.usage == (3, 2)


def test_a_model_without_experts_is_refused_by_name():
    source = RoutingSource(lambda marks: {"moe": False, "model": "smollm2", "requests": {}}, 1.0)
    with pytest.raises(RoutedExpertsRefusedError, match="'smollm2' has no mixture-of-experts layers"):
        asyncio.run(source.require_moe())


def _step(capture, batch: list[tuple[str, int, int]], ids: list, layers: int = LAYERS) -> None:
    """One forward pass of ``capture`` over ``batch`` ((request id, computed tokens, scheduled
    tokens) in batch order), each layer routing ``ids`` (int [rows, top_k]); a stand-in for
    vLLM's model runner and scheduler output."""
    from types import SimpleNamespace

    import torch

    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=[r for r, _, _ in batch], num_computed_tokens_cpu=np.array([c for _, c, _ in batch])
        ),
        requests={r: SimpleNamespace(num_prompt_tokens=3) for r, _, _ in batch},
    )
    capture.step = SimpleNamespace(num_scheduled_tokens={r: n for r, _, n in batch})
    for layer in range(layers):
        capture.capture(runner, layer, torch.tensor(ids, dtype=torch.int64) + 10 * layer)
    capture.step = None


def test_the_worker_splits_batched_rows_per_marked_request_and_keeps_first_routings():
    from stitchboard.sidecar.engines.vllm import routing

    capture = routing._Capture(layer_ids=[0, 1], num_layers=LAYERS, top_k=TOP_K, model="m")
    mark = f"stitch-routing-{'a' * 32}"
    routing.note_version(7)
    _step(
        capture, [("cmpl-other-0-x", 0, 2), (f"cmpl-{mark}-0-x", 0, 3)], [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]
    )  # prefill of 3
    routing.note_version(8)
    _step(capture, [(f"cmpl-{mark}-0-x", 3, 1)], [[5, 6]])  # one decode step under version 8
    _step(
        capture, [(f"cmpl-{mark}-0-x", 0, 5)], [[9, 9]] * 5
    )  # recomputed after a preemption: positions 0..3 keep their routing
    got = capture.take(mark)
    rows = np.frombuffer(base64.b64decode(got["rows"]), dtype=np.int32).reshape(-1, LAYERS, TOP_K)
    assert rows[:, 0].tolist() == [[2, 3], [3, 4], [4, 5], [5, 6], [9, 9]] and rows[:, 1].tolist() == [
        [12, 13],
        [13, 14],
        [14, 15],
        [15, 16],
        [19, 19],
    ]
    assert got["start"] == 0 and got["prompt_tokens"] == 3 and got["versions"] == [[7, 0, 3], [8, 3, 5]]
    assert capture.take(mark) is None, "a routing is handed over once"
    _step(capture, [(f"cmpl-{mark}-0-x", 0, 4)], [[0, 1]] * 2)  # fewer rows than scheduled tokens
    assert "for a step of 4 token rows" in capture.take(mark)["error"]
