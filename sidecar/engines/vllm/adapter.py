"""The vLLM engine adapter: drives a vLLM server's HTTP dev/RL endpoints (runs in the sidecar).

:class:`VllmEngine` implements :class:`~stitchboard.sidecar.engines.base.EngineAdapter` for a
vLLM server started with ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
stitchboard.sidecar.vllm_worker.StitchWorkerExtension`` (:mod:`.worker`): ``/stitch/pause?mode=keep``
(:mod:`.pause_route`; vLLM's ``/pause`` where that route is not loaded: in-flight requests are frozen,
never aborted), ``/resume``, ``/is_paused``,
``/reset_prefix_cache`` and ``/collective_rpc`` into the worker extension (one JSON-string
argument per call; results are small dicts, one per TP rank). Patches and snapshots travel as
files under the hand-off folder, never as bytes over HTTP.

The lease (``docs/reference/engine-lease.md``): :meth:`VllmEngine.take_lease` calls
``stitch_lease`` on every rank; every later call names that owner, the state-changing
``stitch_*`` ones are refused in the engine without a live lease, and the HTTP pause routes,
``/resume`` and ``/reset_prefix_cache`` (which cannot check it) are not called unless the lease
is live, renewed first when less than half its TTL is left (:class:`~..base.LeaseGuard`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from stitchboard.proto.parts import Layout

from ...errors import EngineRequestError, EngineUnavailableError, LeaseNotHeldError
from ..base import EngineState, LeaseGrant, LeaseGuard
from ..rpc import (
    RankAnswer,
    combine,
    granted_lease,
    lease_grant,
    lease_refusal,
    parse_answers,
    raise_if_failed,
    snapshot_checksums,
)
from .lora_calls import LoraCalls
from .pause_route import PAUSE_PATH

#: How long a staging poll waits in the worker while no request is in flight, seconds (at most the worker's
#: ``MAX_STAGED_WAIT_S``): a request arriving meanwhile starts at most this much later.
IDLE_WAIT_S = 0.5


class VllmEngine(LoraCalls):
    """:class:`EngineAdapter` over a vLLM server's HTTP endpoints; also
    :class:`~..base.ServesAdapters` (LoRA adapters: :class:`.lora_calls.LoraCalls`, on an engine
    started with ``--enable-lora``; without it :meth:`adapter_slots` is 0 and every load is refused)
    and :class:`~..base.WaitsForStaging`.

    Args:
        engine_url: base URL, e.g. ``http://127.0.0.1:8001``.
        timeout_s: timeout of control calls (health, state, pause...), seconds.
        apply_timeout_s: timeout of an apply or snapshot load, seconds.
    """

    def __init__(self, engine_url: str, timeout_s: float = 10.0, apply_timeout_s: float = 900.0) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.timeout_s = timeout_s
        self.apply_timeout_s = apply_timeout_s
        self._http = httpx.Client(base_url=self.engine_url, timeout=timeout_s)
        self._lease = LeaseGuard()
        #: The route :meth:`pause` posts to: :data:`.pause_route.PAUSE_PATH`, vLLM's ``/pause`` once that answered 404.
        self.pause_path = PAUSE_PATH

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    # -- HTTP plumbing ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, timeout=timeout or self.timeout_s, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(
                f"engine at {self.engine_url} does not answer {path}: {type(exc).__name__}: {exc}", path=path
            ) from exc
        if resp.status_code in (502, 503, 504):
            raise EngineUnavailableError(
                f"engine answered {path} with HTTP {resp.status_code}", path=path, status=resp.status_code
            )
        if resp.status_code != 200:
            raise EngineRequestError(
                f"engine answered {path} with HTTP {resp.status_code}: {resp.text[:300]}",
                path=path,
                status=resp.status_code,
            )
        try:
            return resp.json() if resp.content else None
        except ValueError:
            raise EngineRequestError(
                f"engine answered {path} with a non-JSON body: {resp.text[:300]}", path=path, status=200
            ) from None

    def _rpc(self, method: str, args: dict[str, Any], timeout: float | None = None) -> list[RankAnswer]:
        """Call a worker-extension method on every rank, naming this adapter's lease owner (if
        any); returns the per-rank answers (what they say of the lease is noted)."""
        owner = self._lease.owner
        if owner is not None and "owner" not in args:
            args = {**args, "owner": owner}
        body = {"method": method, "args": [json.dumps(args)]}
        sent = time.monotonic()
        answer = self._request("POST", "/collective_rpc", json=body, timeout=timeout)
        answers = parse_answers(f"collective_rpc {method}", answer.get("results") if isinstance(answer, dict) else None)
        if owner is not None:
            self._lease.note(lease_grant(answers, owner, sent))
        return answers

    def _checked(self, method: str, args: dict[str, Any], timeout: float | None = None) -> list[RankAnswer]:
        answers = self._rpc(method, args, timeout)
        try:
            raise_if_failed(method, answers)
        except LeaseNotHeldError:  # the engine says this adapter's lease is gone: nothing is known to be held
            if self._lease.owner is not None:
                self._lease.refused(self._lease.owner)
            raise
        return answers

    def _owned(self, method: str, args: dict[str, Any], timeout: float | None = None) -> list[RankAnswer]:
        """:meth:`_checked` for a state-changing method: only with a live lease (renewed first when
        less than half its TTL is left). Raises LeaseNotHeldError (nothing called) without one."""
        self._lease.ensure(method, self.take_lease)
        return self._checked(method, args, timeout)

    def _control(self, path: str, params: dict[str, str] | None = None) -> Any:
        """``POST`` one of vLLM's own state-changing routes, only with a live lease (see :meth:`_owned`)."""
        self._lease.ensure(f"POST {path}", self.take_lease)
        return self._request("POST", path, params=params)

    # -- EngineAdapter ---------------------------------------------------------------------------

    def health(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            return self._http.get("/health", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def take_lease(self, owner: str, ttl_s: float) -> LeaseGrant:
        """``stitch_lease`` on every rank: take the engine's lease for ``owner`` for ``ttl_s``
        seconds, or renew it; this adapter acts for ``owner`` from then on.

        Returns:
            The grant: live for sure until the call's send time plus the least time any rank has left.

        Raises:
            LeaseNotHeldError: another owner's lease is live on some rank (details ``holder``,
                ``expires_in_s``); no rank holds it for ``owner`` after the call.
            EngineUnavailableError, EngineRequestError.
        """
        sent = time.monotonic()
        answers = self._rpc("stitch_lease", {"owner": owner, "ttl_s": ttl_s})
        refusal = lease_refusal(answers)
        if refusal is not None:
            self._lease.refused(owner)
            raise refusal
        raise_if_failed("stitch_lease", answers)
        grant = granted_lease(answers, owner, sent, "stitch_lease", "/collective_rpc")
        self._lease.taken(grant, ttl_s)
        return grant

    def release_lease(self, owner: str) -> None:
        """``stitch_lease`` with ``release``: end ``owner``'s lease on every rank at once.

        Raises:
            EngineUnavailableError, EngineRequestError.
        """
        self._checked("stitch_lease", {"owner": owner, "release": True})
        self._lease.released(owner)

    def known_lease(self) -> LeaseGrant | None:
        """See :meth:`~..base.EngineAdapter.known_lease`."""
        return self._lease.grant

    def state(self, timeout_s: float | None = None) -> EngineState:
        """What the worker extension records; phase ``paused`` when it is idle and the engine paused.

        The worker's record (``collective_rpc``) and ``/is_paused`` are asked at once: the engine
        core answers both after the step in flight, so one after the other they waited for two
        steps (under load on a CPU host: ~2 s each, docs/benchmarks.md), together for one.

        Args:
            timeout_s: how long each call may wait for its answer, seconds (None: ``timeout_s`` of
                the adapter). The engine core answers ``collective_rpc`` between steps.

        Raises:
            EngineUnavailableError, EngineRequestError, EngineStateError (ranks disagree).
        """
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-is-paused") as pool:
            paused = pool.submit(self._request, "GET", "/is_paused", timeout=timeout_s)
            state = combine(self._rpc("stitch_state", {}, timeout_s))
            if state.phase == "idle" and paused.result().get("is_paused"):
                return dataclasses.replace(state, phase="paused")
        return state

    def _pause(self, params: dict[str, str]) -> None:
        """``POST /stitch/pause`` (:mod:`.pause_route`: vLLM's pause without its fixed 20 ms sleep), or vLLM's own
        ``/pause`` on an engine started without that route (it answers 404; remembered for this adapter)."""
        if self.pause_path == PAUSE_PATH:
            try:
                self._control(PAUSE_PATH, params)
                return
            except EngineRequestError as exc:
                if exc.details.get("status") != 404:
                    raise
                self.pause_path = "/pause"
        self._control(self.pause_path, params)

    def pause(self) -> None:
        """``POST /stitch/pause?mode=keep`` (else ``/pause``, see :meth:`_pause`): requests in flight are frozen and
        kept (never aborted)."""
        self._pause({"mode": "keep"})

    def pause_keeping_cache(self) -> None:
        """``POST /stitch/pause?mode=keep&clear_cache=false`` (or ``/pause``): as :meth:`pause`, but the prefix cache
        is kept (a plain pause resets it, running requests preempted); for the version-salted cache
        (:mod:`stitchboard.sidecar.salt`)."""
        self._pause({"mode": "keep", "clear_cache": "false"})

    def resume(self) -> None:
        """``POST /resume``."""
        self._control("/resume")

    def apply_patch(self, handoff_path: str | Sequence[str], from_version: int, to_version: int) -> dict[str, Any]:
        """Apply the patch file(s) of one version (all files of the version in one call).

        Returns:
            The worker's report (rank 0): ``bytes``, ``tensors``, ``elements``,
            ``repacked_modules``, seconds ``read_s``, ``check_s``, ``build_s``, ``pack_s``,
            ``write_s``, ``swap_s``, ``verify_s``, plus ``rpc_s`` (the whole call, HTTP included).

        Raises:
            ApplyRefusedError: refused before any write (details ``cause``: ``BaseMismatch``,
                ``PatchFormatError``, ``TensorSetMismatch``, ``UnmappedTensor``...).
            EngineStateError: the engine does not hold ``from_version`` (nothing written).
            ApplyFailedError: failed after writing (``restored`` says whether the old bits are back).
            EngineUnavailableError, EngineRequestError.
        """
        paths = [handoff_path] if isinstance(handoff_path, str) else list(handoff_path)
        t = time.perf_counter()
        results = self._owned(
            "stitch_apply_patch",
            {"paths": paths, "from_version": from_version, "to_version": to_version},
            self.apply_timeout_s,
        )
        return {**(results[0].report or {}), "rpc_s": time.perf_counter() - t}

    def stage_patches(self, steps: Sequence[tuple[Sequence[str], int, int]], poll_s: float = 0.02) -> dict[str, Any]:
        """Stage consecutive patch steps in the engine while it keeps serving; blocks until ready.

        The worker reads, decodes and checks the patches and (CPU backend) packs the new GEMM
        copies in a background thread; this polls ``stitch_staged`` every ``poll_s`` seconds,
        up to ``apply_timeout_s`` in all. A poll may wait for what is left of that, not only
        ``timeout_s``: vLLM answers it after the engine step in flight, which takes longer than
        a control call may under load (50 streams on a 2-core CPU host: over 10 s).

        Args:
            steps: ``(hand-off paths, from_version, to_version)`` in order from the held version.

        Returns:
            The worker's staging report (rank 0; see :func:`.update.stage_patches`) plus
            ``rpc_s`` (start to ready, HTTP included).

        Raises:
            ApplyRefusedError: the update is refused (base or target mismatch, bad file...);
                nothing written. EngineStateError: the engine does not hold the first
                ``from_version``. EngineUnavailableError, EngineRequestError: also on timeout.
        """
        return self.stage_patches_waiting(steps, lambda: False, poll_s)

    def stage_patches_waiting(
        self, steps: Sequence[tuple[Sequence[str], int, int]], idle: Callable[[], bool], poll_s: float = 0.02
    ) -> dict[str, Any]:
        """:meth:`stage_patches`, whose polls wait in the worker up to :data:`IDLE_WAIT_S` for the staging while
        ``idle()`` (no request in flight through this sidecar; a request arriving meanwhile, or one sent to the
        engine another way, starts at most that much later), and return at once, ``poll_s`` apart, otherwise.
        Measured on SmolLM2 on the 2-core CPU host: the staging's threads spent 0.8-1.1 s where 20 ms polls
        made them spend 1.0-2.4 s (``docs/benchmarks.md``)."""
        t = time.perf_counter()
        body = {
            "steps": [{"paths": list(paths), "from_version": start, "to_version": end} for paths, start, end in steps]
        }
        self._owned("stitch_stage", body, self.apply_timeout_s)
        while True:
            # vLLM answers collective_rpc between engine steps: while it generates, a poll waits up
            # to a step, under load longer than a control call may; it may take what the staging has left.
            polled = time.perf_counter()
            left = self.apply_timeout_s - (polled - t)
            wait_s = IDLE_WAIT_S if idle() else 0.0
            results = self._checked("stitch_staged", {"wait_s": wait_s}, max(left, self.timeout_s + wait_s))
            if all((r.staging or {}).get("state") == "ready" for r in results):
                return {**(results[0].staging or {}).get("report", {}), "rpc_s": time.perf_counter() - t}
            if time.perf_counter() - t > self.apply_timeout_s:
                raise EngineRequestError(
                    f"staging versions {steps[0][1]}->{steps[-1][2]} did not finish within {self.apply_timeout_s} s",
                    path="/collective_rpc",
                )
            time.sleep(max(0.0, poll_s - (time.perf_counter() - polled)))  # a worker that did not wait: poll_s apart

    def commit_staged(self, to_version: int) -> dict[str, Any]:
        """Write the staged update ending at ``to_version`` into the live weights and verify.

        Returns:
            The worker's report (rank 0): the staging figures plus seconds ``write_s``,
            ``swap_s``, ``verify_s``, and ``rpc_s``.

        Raises:
            EngineStateError: nothing staged and ready, or the engine moved since (nothing
                written). ApplyFailedError: failed after writing (``restored`` says whether
                the old bits are back). EngineUnavailableError, EngineRequestError.
        """
        t = time.perf_counter()
        results = self._owned("stitch_commit", {"to_version": to_version}, self.apply_timeout_s)
        return {**(results[0].report or {}), "rpc_s": time.perf_counter() - t}

    def load_snapshot(
        self,
        paths: Sequence[str],
        version: int,
        checksums: dict[str, str] | None = None,
        layouts: Mapping[str, Layout] | None = None,
    ) -> dict[str, Any]:
        """Load snapshot shards in place and record ``version``.

        Args:
            paths: the shard files in the hand-off folder.
            version: the version they hold.
            checksums: the manifest's tensor checksums (``VersionManifest.checksums()``: name -> xxh3-128, or
                xxh3_128_parts over ``layouts[name]``); when None they are computed here from the files (the
                files were verified by sha256 when staged).
            layouts: part layouts of the tensors published in parts (``VersionManifest.layouts()``).

        Returns:
            The worker's report (``bytes``, ``tensors``, ``repacked_modules``, ``read_s``,
            ``write_s``, ``repack_s``, ``verify_s``) plus ``rpc_s``.

        Raises:
            ApplyRefusedError: refused before any write; ApplyFailedError (``restored`` False):
            failed after writing, the engine holds no version; EngineUnavailableError...
        """
        sums = dict(checksums) if checksums is not None else snapshot_checksums(paths)
        t = time.perf_counter()
        results = self._owned(
            "stitch_load_snapshot",
            {"paths": list(paths), "version": version, "checksums": sums, "layouts": dict(layouts or {})},
            self.apply_timeout_s,
        )
        return {**(results[0].report or {}), "rpc_s": time.perf_counter() - t}

    def set_version(self, version: int, base: int | None = None) -> None:
        """Record ``version`` in the engine if it records ``base`` now (None: no version).

        Raises:
            EngineStateError: phase ``failed``, or the engine records another version than
                ``base`` (e.g. it restarted); nothing recorded.
        """
        self._owned("stitch_set_version", {"version": version, "base": base})

    def checksums(self, names: Sequence[str], layouts: Mapping[str, Layout] | None = None) -> dict[str, str]:
        """xxh3-128 of the named checkpoint tensors as the engine holds them (for verification), or xxh3_128_parts
        over ``layouts[name]`` for a name ``layouts`` lists."""
        args = {"names": list(names), "layouts": dict(layouts or {})}
        return self._checked("stitch_checksums", args, self.apply_timeout_s)[0].checksums or {}

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache?reset_running_requests=true``: running (kept) requests are
        preempted so their KV is recomputed with the new weights.

        Raises:
            EngineRequestError: the engine reports the reset failed.
        """
        answer = self._control("/reset_prefix_cache", {"reset_running_requests": "true"})
        if not (isinstance(answer, dict) and answer.get("success")):
            raise EngineRequestError(f"engine could not reset its prefix cache: {answer}", path="/reset_prefix_cache")

    def output_counts(self) -> dict[str, int]:
        """Output tokens so far of each output of the requests the sidecar marked (``X-Request-Id``
        holding ``stitch-<32 hex>``), by output key ``<mark>:<prompt>:<choice>`` (:mod:`.token_counts`):
        rank 0's count (every rank runs the same requests); call it while the engine is paused.

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer or cannot count.
        """
        counts = (self._checked("stitch_output_counts", {})[0].report or {}).get("output_tokens")
        if not isinstance(counts, dict):
            raise EngineRequestError(f"stitch_output_counts answered no counts: {counts!r}", path="/collective_rpc")
        return {str(k): int(v) for k, v in counts.items()}

    def routed_experts(self, marks: list[str]) -> dict[str, Any]:
        """Rank 0's report of the routing captured for the marked requests ``marks``, handed over
        once (see :func:`.routing.take`; every rank routes alike); ``[]``: whether the model has
        MoE layers.

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer or refuses.
        """
        report = self._checked("stitch_routed_experts", {"marks": marks})[0].report
        if not isinstance(report, dict):
            raise EngineRequestError(f"stitch_routed_experts answered no report: {report!r}", path="/collective_rpc")
        return report
