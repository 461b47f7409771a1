"""What a sidecar's ``/v1/completions`` answer must hold for :class:`~.rollout.SidecarRollout` (trainer process).

Checks an answer against the request (its stamps at or above the version asked, one completion per
index, token ids in the vocabulary, one numeric logprob per token) and turns it into TRL's
per-completion fields, with the per-token versions from the sidecar's spans (sidecar/spans.py).
"""

from __future__ import annotations

from typing import Any, TypeGuard

from stitchboard.proto import sidecar_wire as wire

from ..errors import RolloutError

#: The answer field holding per-token version spans (``X-Stitch-Return-Weight-Versions: 1``).
SPANS_FIELD = "weight_versions"


def expand_spans(spans: Any, length: int) -> list[int]:
    """Per-token versions of ``length`` output tokens from spans ``[{"version", "start", "end"}]``.

    Tokens no span covers (the sidecar could not count them) get -1.
    """
    out = [-1] * length
    for span in spans if isinstance(spans, list) else []:
        if isinstance(span, dict) and all(isinstance(span.get(k), int) for k in ("version", "start", "end")):
            for i in range(max(0, span["start"]), min(length, span["end"])):
                out[i] = span["version"]
    return out


def completions(sidecar: str, answer: dict[str, Any], count: int, version: int, vocab: int) -> list[dict[str, Any]]:
    """The ``count`` completions of a sidecar's ``/v1/completions`` answer to a request for ``version`` or later.

    Each: ``completion_ids`` (token ids in ``[0, vocab)``; vocab 0: not checked), ``logprobs`` (floats, one
    per token; zeros when the answer has none), ``weight_versions`` (the version of each token, -1 where
    the sidecar could not say), ``weight_version_start`` / ``weight_version_end`` (the answer's stamps).

    Raises:
        RolloutError: naming ``sidecar`` and what is wrong: no stamps, or a start below ``version``; not
            ``count`` completions, or their indexes not each of ``0..count-1`` once; token ids missing or
            not ints in ``[0, vocab)``; logprobs not one number per token.
    """

    def bad(what: str) -> RolloutError:
        return RolloutError(f"sidecar {sidecar}: {what}", sidecar=sidecar, status=200)

    start, end = answer.get(wire.START_FIELD), answer.get(wire.END_FIELD)
    if not is_int(start) or not is_int(end) or start < version:
        raise bad(
            f"asked for version {version} or later ({wire.MIN_HEADER}), the answer is stamped "
            f"{wire.START_FIELD}={start!r}, {wire.END_FIELD}={end!r}: is it a sidecar of this run?"
        )
    raw = answer.get("choices")
    choices = [c for c in raw if isinstance(c, dict)] if isinstance(raw, list) else []
    if len(choices) != count:
        raise bad(
            f"answered {len(choices)} completions for n={count}; use group_requests=False for an engine without n"
        )
    indexes = [c.get("index") for c in choices]
    if sorted(i if is_int(i) else -1 for i in indexes) != list(range(count)):
        raise bad(f"choice indexes {indexes} for n={count} (each of 0..{count - 1} once)")
    choices.sort(key=lambda c: int(c["index"]))
    out = []
    for c in choices:
        ids = c.get("token_ids")
        if not isinstance(ids, list):
            raise bad("a completion without token_ids (the engine ignored return_token_ids)")
        wrong = [t for t in ids if not is_int(t) or t < 0 or (vocab and t >= vocab)]
        if wrong:
            raise bad(f"token ids {wrong[:5]} are not ints in [0, {vocab or 'vocab'}) (choice {c['index']})")
        lp = (c.get("logprobs") or {}).get("token_logprobs") if isinstance(c.get("logprobs"), dict) else None
        if lp is not None and (
            not isinstance(lp, list)
            or len(lp) != len(ids)
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in lp)
        ):
            raise bad(f"logprobs {str(lp)[:80]} are not one number per token (choice {c['index']})")
        spans = c.get(SPANS_FIELD) if count > 1 else answer.get(SPANS_FIELD)
        if spans is None and start is not None and start == end:
            spans = [{"version": start, "start": 0, "end": len(ids)}]  # made under one version
        out.append(
            {
                "completion_ids": list(ids),
                "logprobs": [float(x) for x in lp] if lp is not None else [0.0] * len(ids),
                "weight_versions": expand_spans(spans, len(ids)),
                "weight_version_start": start,
                "weight_version_end": end,
            }
        )
    return out


def is_int(value: Any) -> TypeGuard[int]:
    """An int of JSON (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def vocab_size(trainer: Any) -> int:
    """The larger of the trainer's model config ``vocab_size`` and its tokenizer's length (0: neither known)."""
    config = getattr(getattr(trainer, "model", None), "config", None)
    sizes = [getattr(config, "vocab_size", None)]
    try:
        sizes.append(len(trainer.processing_class))
    except TypeError:
        pass
    return max((n for n in sizes if is_int(n)), default=0)
