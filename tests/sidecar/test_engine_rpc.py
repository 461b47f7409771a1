"""The typed answers of the in-engine methods (sidecar/engines/rpc.py): shapes, states, errors."""

from __future__ import annotations

import pytest

from stitchboard.sidecar.engines.rpc import combine, parse_answers, raise_if_failed
from stitchboard.sidecar.errors import ApplyFailedError, ApplyRefusedError, EngineRequestError, EngineStateError


def _answer(
    ok: bool = True,
    version: int | None = 3,
    phase: str = "idle",
    instance: str = "a",
    error: dict | None = None,
    **extra,
) -> dict:
    return {
        "ok": ok,
        "state": {"version": version, "phase": phase, "instance": instance},
        **({"error": error} if error else {}),
        **extra,
    }


def test_ranks_combine_into_one_state_whose_instance_changes_with_any_rank():
    answers = parse_answers("m", [_answer(instance="r0"), _answer(instance="r1")])
    state = combine(answers)
    assert (state.version, state.phase, state.instance) == (3, "idle", "r0/r1")
    assert combine(parse_answers("m", [_answer(instance="r0"), _answer(instance="new")])).instance != state.instance


@pytest.mark.parametrize(
    "results",
    [None, [], [{"ok": True}], [{"ok": True, "state": {"version": 1, "phase": "dancing"}}], [_answer(report=[1])]],
)
def test_an_answer_of_another_shape_is_an_engine_request_error(results):
    with pytest.raises(EngineRequestError):
        parse_answers("m", results)


def test_ranks_that_disagree_are_an_engine_state_error():
    with pytest.raises(EngineStateError, match="different states"):
        combine(parse_answers("m", [_answer(version=3), _answer(version=4)]))


def test_a_rank_error_becomes_the_sidecar_error_of_its_kind():
    written = _answer(
        ok=False,
        version=None,
        phase="failed",
        error={"type": "ApplyFailed", "message": "boom", "cause": "TargetMismatch", "restored": False},
    )
    with pytest.raises(ApplyFailedError) as failed:
        raise_if_failed("stitch_commit", parse_answers("m", [written]))
    assert failed.value.details == {"cause": "TargetMismatch", "restored": False, "held": None, "phase": "failed"}
    state = _answer(ok=False, error={"type": "EngineStateError", "message": "holds 2"})
    with pytest.raises(EngineStateError):
        raise_if_failed("stitch_apply_patch", parse_answers("m", [state]))
    refused = _answer(ok=False, error={"type": "UnmappedTensor", "message": "no place", "name": "x.weight"})
    with pytest.raises(ApplyRefusedError) as no_place:
        raise_if_failed("stitch_checksums", parse_answers("m", [_answer(), refused]))
    assert no_place.value.details == {"cause": "UnmappedTensor", "name": "x.weight", "held": 3, "phase": "idle"}
    raise_if_failed("stitch_state", parse_answers("m", [_answer(), _answer()]))  # nothing failed: no error
