"""SGLang OpenAI streams with several outputs, without an engine: the sidecar's mark in
``custom_params`` and the scheduler-side numbering of the outputs
(:mod:`stitchboard.sidecar.engines.sglang.token_counts`).

The scheduler-side objects are stand-ins with the attributes SGLang 0.5.23's
``TokenizedGenerateReqInput`` (``stream``, ``sampling_params.custom_params``, ``sampling_params.n``)
and ``Req`` carry; the real path is tested against SGLang in ``test_sglang_spans.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

from stitchboard.sidecar.engines.contract import MARK_PARAM
from stitchboard.sidecar.engines.sglang import token_counts
from stitchboard.sidecar.engines.sglang.token_counts import sample_key
from stitchboard.sidecar.spans import SpanLedger, Spans


def _arrive(mark: str, n: int, stream: bool = True) -> SimpleNamespace:
    # One request reaching the scheduler's intake; returns the Req made of it.
    req = SimpleNamespace(rid="0f" * 16, output_ids=[], finished=lambda: False)
    recv = SimpleNamespace(
        stream=stream, sampling_params=SimpleNamespace(custom_params={"mine": 1, MARK_PARAM: mark}, n=n)
    )
    token_counts._number(req, recv)
    return req


def test_outputs_are_numbered_in_arrival_order_per_mark_skipping_the_prefill_request():
    a, b = "stitch-" + "a" * 32, "stitch-" + "b" * 32
    prefills = [_arrive(a, 2, stream=False) for _ in range(2)]  # one prefill-only request per prompt, not streamed
    assert [token_counts._key(r) for r in prefills] == [None, None]
    first = [_arrive(a, 2) for _ in range(2)]
    other = _arrive(b, 3)  # another request's output in between changes nothing
    second = [_arrive(a, 2) for _ in range(2)]
    assert [token_counts._key(r) for r in first + second] == [f"{a}:0:0", f"{a}:0:1", f"{a}:1:0", f"{a}:1:1"]
    assert token_counts._key(other) == f"{b}:0:0"
    assert (
        token_counts._key(_arrive("not-a-mark", 2)) is None
        and sample_key("stitch-" + "c" * 32, 5, None) == "stitch-" + "c" * 32 + ":5:0"
    )
    plain = SimpleNamespace(rid="mine-stitch-" + "d" * 32, output_ids=[1, 2], finished=lambda: True)
    assert token_counts._key(plain) == "stitch-" + "d" * 32 + ":0:0", "a one-output request is still keyed by its rid"


def test_several_outputs_are_marked_in_custom_params_and_split_per_choice():
    ledger = SpanLedger()
    body = {"model": "x", "prompt": "x", "stream": True, "n": 2, "custom_params": {"mine": 1}, "rid": "client"}
    spans = Spans(ledger, True, 4, "/v1/completions", body, None)
    mark = body["custom_params"][MARK_PARAM]
    assert not spans.engine_reports and spans.multi and spans.changed_body and body["rid"] == "client", (
        "the client's rid is left alone"
    )
    assert body["custom_params"]["mine"] == 1 and mark == spans.request_id[-39:] and body["return_token_ids"] is True
    reqs = [_arrive(mark, 2, stream=False), _arrive(mark, 2), _arrive(mark, 2)]
    reqs[1].output_ids, reqs[2].output_ids = [7] * 3, [7] * 5
    ledger.commit(5, {k: len(r.output_ids) for r in reqs if (k := token_counts._key(r)) is not None})
    for index, ids in ((1, [1, 2, 3, 4, 5, 6]), (0, [1, 2, 3, 4])):
        event = {"choices": [{"index": index, "text": "t", "token_ids": ids}]}
        assert spans.see_event(event) == "edited" and "token_ids" not in event["choices"][0], (
            "ids only the sidecar asked for are taken out"
        )
    top, per_choice = spans.streamed(5)
    assert top is None and per_choice == {
        0: [{"version": 4, "start": 0, "end": 3}, {"version": 5, "start": 3, "end": 4}],
        1: [{"version": 4, "start": 0, "end": 5}, {"version": 5, "start": 5, "end": 6}],
    }
    chat = {"messages": [], "stream": True, "n": 3}
    counted = Spans(ledger, True, 4, "/v1/chat/completions", chat, None)
    assert chat["custom_params"] == {MARK_PARAM: counted.request_id} and not counted.engine_reports
    unmarkable = {"prompt": "x", "stream": True, "n": 2, "custom_params": "no dict"}
    assert Spans(ledger, True, 4, "/v1/completions", unmarkable, None).engine_reports, (
        "params it cannot extend: no count (null spans)"
    )
