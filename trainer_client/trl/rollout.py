"""``SidecarRollout``: TRL's ``rollout_func`` that generates through stitchboard sidecars (trainer process).

TRL 1.16.0 calls ``rollout_func(prompts, trainer)`` with this process's prompts (TRL's sampler
repeats each prompt ``num_generations`` times, one after the other) and expects a dict with
``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list per prompt); any other key is passed
to the reward functions. This one:

* tokenizes as TRL would (the trainer's chat template for conversational prompts, with its tools
  and ``chat_template_kwargs``) and sends token ids, so the engine's tokenizer plays no part;
* sends each group of equal consecutive prompts (a ``num_generations`` group, or the part of it
  this process holds) as one ``/v1/completions`` request with ``n``, groups spread round-robin
  over the sidecars and sent at once; a sidecar that cannot be reached is skipped for the next;
* asks for "at least the step just published": ``X-Stitch-Min-Version`` is the version of training
  step ``global_step - staleness_steps`` (from the :class:`~.callback.PublishCallback` in this
  process, else the bulletin's step lookup), ``X-Stitch-Wait-S`` how long the sidecar may hold it;
* checks once that each sidecar follows the run being trained (its ``/v1/stitch/status``), and each
  answer: its stamps at or above the version asked, one completion per index, token ids in the vocabulary, numeric
  logprobs; anything else is a :class:`~stitchboard.trainer_client.errors.RolloutError`;
* returns ``weight_versions`` besides: per completion, the weight version of each of its tokens
  (from the sidecar's spans, ``X-Stitch-Return-Weight-Versions: 1``), which reward functions get
  as a keyword argument. ``weight_version_start`` / ``weight_version_end``: the sidecar's stamps.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import AuthError, BulletinError, UnavailableError
from stitchboard.proto import sidecar_wire as wire

from ..errors import RolloutError, RolloutVersionError
from .callback import PublishCallback
from .rollout_answers import completions, vocab_size

log = logging.getLogger("stitchboard.trainer_client.trl")

#: Largest answer read from a sidecar, bytes (a group of completions with token ids and logprobs).
MAX_ANSWER_BYTES = 64 << 20
#: Connection failures that send a group to the next sidecar (nothing was generated).
FAILOVER_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
#: The header asking a sidecar for per-token version spans (sidecar/spans.py).
SPANS_HEADER = "X-Stitch-Return-Weight-Versions"
#: The sidecar's status route, whose ``run_id`` names the run it follows (sidecar/app.py).
STATUS_PATH = "/v1/stitch/status"


def group_runs(prompt_ids: Sequence[Sequence[int]], limit: int) -> list[tuple[int, int]]:
    """``(first index, count)`` of each run of equal consecutive prompts, at most ``limit`` long."""
    runs: list[tuple[int, int]] = []
    for i, ids in enumerate(prompt_ids):
        if runs and runs[-1][1] < limit and list(prompt_ids[runs[-1][0]]) == list(ids):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class SidecarRollout:
    """TRL's ``rollout_func`` over one or more sidecars (pass the instance as ``rollout_func=``).

    Args:
        sidecars: base URLs of the sidecars, e.g. ``["http://gpu0:8100"]`` (tried round-robin).
        callback: the :class:`~.callback.PublishCallback` of this trainer (it knows each step's version);
            None: the bulletin's step lookup (``bulletin`` and ``run``).
        bulletin, run, token: the bulletin's URL, the run id and a read token, for the step lookup; ``run``
            (else the callback's publisher's) is also the run every sidecar must follow.
        staleness_steps: how many optimizer steps behind the rollout's weights may be (default 0: the
            step just published).
        wait_s: how long a request may wait for its version, seconds (the publish's commit, then the
            sidecar's ``X-Stitch-Wait-S``; default 120).
        timeout_s: read timeout of one generation request, seconds (default 600).
        model: the model name sent to the engine (default: the first one its ``/v1/models`` lists).
        sampling: extra ``/v1/completions`` fields (e.g. ``{"seed": 0}``); the trainer's
            ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
            ``max_completion_length`` are sent unless given here.
        group_requests: send a group as one request with ``n`` (default); False: one request per
            completion (for an engine without ``n``).
        max_concurrency: requests in flight at once (default 8).

    Raises (from a call):
        RolloutVersionError: the version of step ``global_step - staleness_steps`` could not be had within
            ``wait_s`` (it names the step, the version and the sidecar).
        RolloutError: no sidecar could be reached; one follows another run (or is no sidecar); one answered
            with an error, broke the answer off or timed out; an answer without stamps, stamped below the
            version asked, or malformed (token ids outside the vocabulary, duplicate indexes, non-numeric
            logprobs); the bulletin refused the token of the step lookup.
        ValueError (construction): no sidecars, or a negative staleness or wait.
    """

    def __init__(
        self,
        sidecars: Sequence[str],
        *,
        callback: PublishCallback | None = None,
        bulletin: str | None = None,
        run: str | None = None,
        token: str | None = None,
        staleness_steps: int = 0,
        wait_s: float = 120.0,
        timeout_s: float = 600.0,
        model: str | None = None,
        sampling: dict[str, Any] | None = None,
        group_requests: bool = True,
        max_concurrency: int = 8,
    ) -> None:
        if not sidecars:
            raise ValueError("give at least one sidecar URL")
        if staleness_steps < 0 or wait_s < 0:
            raise ValueError(f"staleness_steps and wait_s must be >= 0, got {staleness_steps} and {wait_s}")
        if callback is None and (bulletin is None or run is None):
            raise ValueError("without a PublishCallback, give bulletin= and run= for the step lookup")
        self.sidecars = [s.rstrip("/") for s in sidecars]
        self.callback = callback
        self.staleness_steps = staleness_steps
        self.wait_s = wait_s
        self.model = model
        self.sampling = dict(sampling or {})
        self.group_requests = group_requests
        self.run = run
        self._bulletin = BulletinClient(bulletin, token) if bulletin is not None else None
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=httpx.Limits())
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_concurrency), thread_name_prefix="stitch-rollout")
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._checked: set[str] = set()  # sidecars whose run was checked
        self._vocab = 0  # token ids must be in [0, vocab) (0: not known)
        #: What the last call did: ``min_step``, ``min_version``, ``requests``, ``sidecars`` (per request).
        self.last: dict[str, Any] = {}

    def close(self) -> None:
        """Close the HTTP clients and the request pool."""
        self._pool.shutdown(wait=True)
        self._http.close()
        if self._bulletin is not None:
            self._bulletin.close()

    # -- the rollout_func ---------------------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """Generate one completion per prompt (TRL's ``rollout_func``); see the class docstring."""
        prompt_ids = self.tokenize(prompts, trainer)
        self._vocab = vocab_size(trainer)
        min_step = max(0, int(trainer.state.global_step) - self.staleness_steps)
        min_version = self.version_for_step(min_step)
        model = self.model or self._model_id()
        limit = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        runs = group_runs(prompt_ids, limit if self.group_requests else 1)
        body = self._sampling(trainer)
        jobs = [
            self._pool.submit(self._generate, prompt_ids[first], count, model, body, min_step, min_version)
            for first, count in runs
        ]
        out: dict[str, list[Any]] = {
            k: []
            for k in (
                "prompt_ids",
                "completion_ids",
                "logprobs",
                "weight_versions",
                "weight_version_start",
                "weight_version_end",
            )
        }
        used: list[str] = []
        for (first, _count), job in zip(runs, jobs, strict=True):
            sidecar, choices = job.result()
            used.append(sidecar)
            for choice in choices:
                out["prompt_ids"].append(list(prompt_ids[first]))
                for key in (
                    "completion_ids",
                    "logprobs",
                    "weight_versions",
                    "weight_version_start",
                    "weight_version_end",
                ):
                    out[key].append(choice[key])
        self.last = {"min_step": min_step, "min_version": min_version, "requests": len(runs), "sidecars": used}
        return out

    def tokenize(self, prompts: list[Any], trainer: Any) -> list[list[int]]:
        """Token ids of each prompt, as TRL's ``GRPOTrainer`` makes them for its own generation."""
        from trl.data_utils import is_conversational

        processing = trainer.processing_class
        if is_conversational({"prompt": prompts[0]}):
            encoded = processing.apply_chat_template(
                conversation=prompts,
                tools=getattr(trainer, "tools", None) or None,
                chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(getattr(trainer, "chat_template_kwargs", None) or {}),
            )
            return [list(ids) for ids in encoded["input_ids"]]
        return [list(ids) for ids in processing(text=prompts)["input_ids"]]

    def version_for_step(self, step: int) -> int:
        """The first version at training step ``step`` or later, waiting up to ``wait_s`` for it: from the
        callback's own publishes, else the bulletin's step lookup (``bulletin=``, or the callback's publisher's).

        Raises:
            RolloutVersionError: none within the wait.
        """
        deadline = time.monotonic() + self.wait_s
        if self.callback is not None:
            version = self.callback.version_for_step(step, self.wait_s)
            if version is not None:
                return version
        client, run = self._bulletin, self.run
        if client is None and self.callback is not None and self.callback.publisher is not None:
            client, run = self.callback.publisher.client, self.callback.publisher.run
        skipped = f" (steps skipped by the callback: {self.callback.skipped_steps})" if self.callback else ""
        unreachable = ""
        while client is not None and run is not None:
            try:
                info = client.version_for_step(run, step)
            except UnavailableError as exc:  # the bulletin down: as not found yet, until the deadline
                info, unreachable = None, f"; the bulletin was unreachable ({exc})"
            except AuthError as exc:
                raise RolloutError(
                    f"run {run}: the bulletin refused the token of the step lookup ({exc}); give SidecarRollout "
                    "a token= that may read the run",
                    sidecar=None,
                    status=exc.status,
                ) from exc
            except BulletinError as exc:
                raise RolloutError(
                    f"run {run}: the step lookup of step {step} failed: {exc}", sidecar=None, status=exc.status
                ) from exc
            if info is not None:
                return info.version
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        raise RolloutVersionError(
            f"run {run}: no version of step {step} or later within {self.wait_s:g} s{skipped}{unreachable}; "
            "see the trainer's log for a failed publish",
            step=step,
            min_version=None,
            sidecar=None,
            applied_version=None,
        )

    # -- requests -----------------------------------------------------------------------------------

    def _sampling(self, trainer: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": trainer.max_completion_length}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(trainer, name, None)
            if value is not None and not (name == "top_k" and value <= 0):
                body[name] = value
        return {**body, **self.sampling}

    def _model_id(self) -> str:
        errors = []
        for sidecar in self.sidecars:
            try:
                r = self._http.get(f"{sidecar}/v1/models")
                r.raise_for_status()
                self.model = str(r.json()["data"][0]["id"])
                return self.model
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                errors.append(f"{sidecar}: {exc!r}")
        raise RolloutError(f"no sidecar lists a model ({'; '.join(errors)}); pass model=", sidecar=None, status=None)

    def _trained_run(self) -> str | None:
        if self.run is not None:
            return self.run
        publisher = self.callback.publisher if self.callback is not None else None
        return publisher.run if publisher is not None else None

    def _check_run(self, sidecar: str) -> None:
        """Once per sidecar: refuse one that follows another run than the one trained, or is no sidecar.

        Raises:
            RolloutError: naming both runs (or what the sidecar answered); httpx's connection errors pass.
        """
        run = self._trained_run()
        if run is None or sidecar in self._checked:
            return
        try:
            r = self._http.get(f"{sidecar}{STATUS_PATH}")
            followed = r.json().get("run_id") if r.status_code == 200 else None
        except FAILOVER_ERRORS:
            raise
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise RolloutError(
                f"sidecar {sidecar}: its {STATUS_PATH} could not be read ({exc!r}); is it a stitchboard sidecar?",
                sidecar=sidecar,
                status=None,
            ) from exc
        if followed != run:
            what = f"follows run {followed!r}" if followed is not None else f"answered {r.status_code} to {STATUS_PATH}"
            raise RolloutError(
                f"sidecar {sidecar} {what}, but this trainer trains run {run!r}: give the sidecars of run {run!r}",
                sidecar=sidecar,
                status=r.status_code,
            )
        with self._lock:
            self._checked.add(sidecar)

    def _order(self) -> list[str]:
        with self._lock:
            first = next(self._next) % len(self.sidecars)
        return self.sidecars[first:] + self.sidecars[:first]

    def _generate(
        self, prompt: list[int], count: int, model: str, sampling: dict[str, Any], step: int, version: int
    ) -> tuple[str, list[dict[str, Any]]]:
        """``count`` completions of one prompt: (the sidecar that made them, one dict per completion)."""
        body = {
            "model": model,
            "prompt": prompt,
            **sampling,
            "n": count,
            "logprobs": 0,
            "return_token_ids": True,
        }
        headers = {
            wire.MIN_HEADER: str(version),
            wire.WAIT_HEADER: f"{self.wait_s:g}",
            SPANS_HEADER: "1",
        }
        refused = []
        for sidecar in self._order():
            try:
                self._check_run(sidecar)
                answer = self._post(sidecar, body, headers, step, version)
            except FAILOVER_ERRORS as exc:
                log.warning("sidecar %s unreachable (%r): trying the next", sidecar, exc)
                refused.append(f"{sidecar}: {exc!r}")
                continue
            return sidecar, completions(sidecar, answer, count, version, self._vocab)
        raise RolloutError(f"no sidecar could be reached: {'; '.join(refused)}", sidecar=None, status=None)

    def _post(self, sidecar: str, body: dict[str, Any], headers: dict[str, str], step: int, version: int) -> Any:
        try:
            status, data = self._read(sidecar, body, headers)
        except FAILOVER_ERRORS:
            raise
        except httpx.HTTPError as exc:  # the request reached the sidecar: never sent again
            raise RolloutError(
                f"sidecar {sidecar}: the request failed after it was sent ({exc!r}); raise timeout_s if it timed out",
                sidecar=sidecar,
                status=None,
            ) from exc
        try:
            answer = httpx.Response(status, content=bytes(data)).json()
        except ValueError:
            answer = None
        if (
            status in (409, 503)
            and isinstance(answer, dict)
            and answer.get("type") in ("WeightVersionNotReady", "NotReady")
        ):
            raise RolloutVersionError(
                f"step {step}: sidecar {sidecar} did not apply version {version} (the first of step {step} or later) "
                f"within {self.wait_s:g} s; it holds version {answer.get('applied_version')}",
                step=step,
                min_version=version,
                sidecar=sidecar,
                applied_version=answer.get("applied_version"),
            )
        if status != 200 or not isinstance(answer, dict):
            raise RolloutError(
                f"sidecar {sidecar} answered {status}: {bytes(data[:500])!r}",
                sidecar=sidecar,
                status=status,
                body=bytes(data[:500]).decode(errors="replace"),
            )
        return answer

    def _read(self, sidecar: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytearray]:
        """POST a completion request; (status, the answer read up to :data:`MAX_ANSWER_BYTES`)."""
        with self._http.stream("POST", f"{sidecar}/v1/completions", json=body, headers=headers) as r:
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    raise RolloutError(
                        f"sidecar {sidecar}: answer over {MAX_ANSWER_BYTES} bytes",
                        sidecar=sidecar,
                        status=r.status_code,
                    )
            return r.status_code, data
