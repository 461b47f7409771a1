"""The wire models of the sidecar's answers (proto/sidecar_wire.py) hold what the sidecar sends:
spans, routing replay fields and /health's body, with the JSON unchanged."""

from __future__ import annotations

import base64

import numpy as np

from stitchboard.proto.sidecar_wire import Health, LeaseView, RoutingReplay, VersionSpan
from stitchboard.sidecar.engines.sglang.routing_replay import SglangRoutedExperts
from stitchboard.sidecar.routed_experts import routed_fields
from stitchboard.sidecar.spans import build_spans


def test_spans_and_routing_fields_are_the_wire_models():
    spans = build_spans(3, [(4, 2)], 5)
    assert [VersionSpan.model_validate(s).model_dump() for s in spans] == spans
    rows = base64.b64encode(np.zeros((6, 2, 1), dtype=np.int32).tobytes()).decode()
    fields = routed_fields(
        {"num_layers": 2, "top_k": 1}, {"start": 0, "rows": rows, "versions": [[3, 0, 6]]}, 1, (4, 3)
    )
    replay = RoutingReplay.model_validate({k: v for k, v in fields.items() if k != "sglext"})
    assert replay.routed_experts_weight_versions == [VersionSpan(version=3, start=0, end=5)]
    sglang = SglangRoutedExperts(0, {"text": "x"})
    sglang.see_event({"usage": {"prompt_tokens": 2, "completion_tokens": 2}})
    assert RoutingReplay.model_validate(sglang.fields(spans)).routed_experts_error is None
    assert RoutingReplay.model_validate(SglangRoutedExperts(0, {}).fields(None)).routed_experts_error


def test_health_body_keeps_its_json():
    lease = LeaseView(owner="a", held=True, holder="a", holder_expires_in_s=4.5)
    ok = Health(applied_version=2, state="idle", lease=lease, status="ok").wire()
    assert list(ok) == ["applied_version", "state", "lease", "status"] and ok["lease"]["holder"] == "a"
    down = Health(applied_version=None, state="starting", lease=lease, status="starting", reason="r").wire()
    assert down["applied_version"] is None and down["reason"] == "r" and "refused" not in down
