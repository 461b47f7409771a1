"""The LoRA demo's checks and what they watch: resident adapters, a base stream across a swap (demo process).

Each check is one key of ``summary.json``'s ``checks`` and one ``ok``/``FAIL`` line (:data:`CHECKS`):

* ``oracle``: each version's greedy answers (top-5 logprobs, one request at a time) through the sidecar,
  taken right after the version became resident, equal bit for bit those of a fresh plain vLLM that
  loaded that version's PEFT folder, pulled from the bulletin, from disk at start (``--lora-modules``);
* ``pinned``: after the newest version is loaded, the one before it, pinned as ``<run>@<N-1>``, answers
  as it did when it was the newest, and both are resident;
* ``swap``: a streamed base-model completion (the base's served name, ungated by adapter versions) in
  flight from before the last publish until after its version is resident completes with every token,
  and the sidecar took no engine pause in the whole run (``pause_seconds_by_route`` empty);
* ``stamps``: step N's rollouts, asked of the run with ``min_version`` N-1, were stamped N-1 (the
  newest resident version served them);
* ``changed``: every step changed the adapter's bits, and the last version answers differently from version 0.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from stitchboard.proto.adapter import adapter_name
from stitchboard.proto.sidecar_wire import SidecarStatus

from .errors import DemoError

#: check key -> the line the demo prints for it.
CHECKS = {
    "oracle": "each version through the sidecar == a fresh engine loading the pulled adapter from disk (bitwise, cold)",
    "pinned": "an older resident version, pinned, still answers as itself after the newer one is loaded",
    "swap": "base-model requests in flight during a swap completed without a pause",
    "stamps": "rollouts were served by the newest resident adapter version (stamps)",
    "changed": "every step changed the adapter, and the last version answers differently from version 0",
}
#: Tokens of the base-model stream kept in flight across the last swap (``ignore_eos``).
STREAM_TOKENS = 300


def served_models(url: str) -> list[str]:
    """The model ids ``url``'s ``GET /v1/models`` lists (a sidecar: the base and its resident adapters).

    Raises:
        DemoError: the server answered an error.
    """
    resp = httpx.get(f"{url}/v1/models", timeout=30)
    if resp.status_code != 200:
        raise DemoError(f"GET {url}/v1/models failed: {resp.status_code} {resp.text[:300]}")
    return [m["id"] for m in resp.json().get("data", [])]


def resident_adapters(url: str) -> list[str]:
    """The adapter versions (``<run>@<N>``) a sidecar lists as resident."""
    return sorted(m for m in served_models(url) if "@" in m)


def wait_resident(url: str, name: str, timeout_s: float) -> float:
    """Poll a sidecar until it lists adapter ``name`` as resident; returns the seconds waited.

    Raises:
        DemoError: ``timeout_s`` passed (with the sidecar's ``/health`` body).
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if name in served_models(url):
                return time.monotonic() - t0
        except (httpx.HTTPError, DemoError):  # the sidecar starting, or its engine not yet answering
            pass
        time.sleep(0.05)
    health = httpx.get(f"{url}/health", timeout=10).text[:800]
    raise DemoError(f"adapter {name} not resident behind {url} after {timeout_s:.0f} s; /health: {health}")


class BaseStream:
    """One streamed greedy base-model completion (``STREAM_TOKENS`` tokens) through a sidecar, in a thread.

    Args:
        url: the sidecar.
        model: the base's served name.

    Call :meth:`wait_started` before the swap, :meth:`mark` at its moments, :meth:`finish` after it.
    """

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.token_times: list[float] = []
        self.marks: dict[str, float] = {}
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="lora-demo-base-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as resp:
                if resp.status_code != 200:
                    self.error = f"{resp.status_code} {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    for choice in event.get("choices", []):
                        if choice.get("text"):
                            self.token_times.append(time.perf_counter())
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def wait_started(self, timeout_s: float = 300.0) -> None:
        """Return once the first token arrived.

        Raises:
            DemoError: the stream failed or sent no token within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while not self.token_times and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        if not self.token_times:
            raise DemoError(f"the base-model stream through {self.url} sent no token: {self.error}")
        self.marks["swap_start"] = time.perf_counter()

    def mark(self, moment: str) -> None:
        """Note the time of ``moment`` (e.g. ``resident``)."""
        self.marks[moment] = time.perf_counter()

    def finish(self, timeout_s: float = 900.0) -> dict[str, Any]:
        """Wait for the stream to end; its figures: tokens, finish reason, the marks and its end relative to
        its start (seconds), tokens during the swap, the longest gap between two tokens (ms), whether it
        spanned the swap."""
        self._thread.join(timeout_s)
        times = self.token_times
        start, end = self.marks.get("swap_start"), self.marks.get("resident")
        during = [t for t in times if start is not None and end is not None and start <= t <= end]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return {
            "tokens": len(times),
            "max_tokens": STREAM_TOKENS,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "marks_s": {k: round(v - self.t0, 3) for k, v in self.marks.items()},
            "ended_s": round(times[-1] - self.t0, 3) if times else None,
            "tokens_during_swap": len(during),
            "longest_gap_ms": round(1000 * max(gaps), 1) if gaps else None,
            "spanned_swap": bool(times)
            and start is not None
            and end is not None
            and times[0] < start < end < times[-1],
        }


def check_lora_demo(
    run: str,
    final: int,
    rows: Sequence[Any],
    swap: dict[str, Any],
    answers: dict[int, list[dict]],
    reference: dict[int, list[dict]],
    older: list[dict],
    resident: list[str],
    status: SidecarStatus,
) -> tuple[dict[str, bool], list[str]]:
    """The checks (the lines of :data:`CHECKS` -> held) and why each failed one failed.

    Args:
        run: the adapter run; ``final``: its last version.
        rows: the steps' rows (``step``, ``changed_pct``, ``versions_seen``: the (start, end) stamps of their rollouts).
        swap: :meth:`BaseStream.finish` of the stream across the last swap.
        answers: version -> its greedy answers through the sidecar when it became resident.
        reference: version -> the fresh engine's greedy answers of the pulled adapter.
        older: the answers of version ``final - 1``, pinned, after ``final`` was loaded.
        resident: the sidecar's resident adapters at that moment.
        status: the sidecar's status at the end of the run.
    """
    ok = {
        "oracle": bool(reference)
        and set(answers) == set(reference)
        and all(answers[v] == reference[v] for v in answers),
        "pinned": older == answers.get(final - 1)
        and {adapter_name(run, final - 1), adapter_name(run, final)} <= set(resident),
        "swap": swap.get("spanned_swap") is True
        and swap.get("tokens") == STREAM_TOKENS
        and not swap.get("error")
        and not status.pause_seconds_by_route,
        "stamps": bool(rows) and all(r.versions_seen == [[r.step - 1, r.step - 1]] for r in rows),
        "changed": bool(rows) and all(r.changed_pct > 0 for r in rows) and answers.get(final) != answers.get(0),
    }
    why = {
        "oracle": [f"version {v}: sidecar {answers.get(v, [{}])[0].get('token_logprobs')} != fresh "
                   f"{reference[v][0].get('token_logprobs')}" for v in reference if answers.get(v) != reference[v]],
        "pinned": [f"version {final - 1} pinned answered {older[:1]}, resident {resident}"],
        "swap": [f"base stream {swap}, sidecar pauses {status.pause_seconds_by_route}"],
        "stamps": [f"step {r.step} stamped {r.versions_seen}" for r in rows if r.versions_seen != [[r.step - 1] * 2]],
        "changed": [f"changed % {[r.changed_pct for r in rows]}"],
    }  # fmt: skip
    reasons = [f"{CHECKS[key]}: " + "; ".join(why[key][:2]) for key, held in ok.items() if not held]
    return {CHECKS[key]: held for key, held in ok.items()}, reasons
