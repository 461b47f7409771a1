"""The stitchboard vLLM worker extension: in-place, bit-exact weight updates inside the engine.

Start vLLM with::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CKPT \\
        --worker-extension-cls stitchboard.sidecar.vllm_worker.StitchWorkerExtension

and drive it over ``POST /collective_rpc`` (the adapter in :mod:`.adapter` does). Every method
takes one argument, a JSON string (vLLM's dev endpoint passes only strings), and returns a small
JSON dict: ``{"ok": true, "state": {...}, ...}`` or ``{"ok": false, "error": {"type", "message",
...details}, "state": {...}}``, the error's wire body: type ``ApplyFailed`` (details ``cause``,
``restored``) once writing began, any other type means refused with nothing written. Methods
(all ranks run each call, in step):

* ``stitch_state("{}")``: ``state`` only.
* ``stitch_lease('{"owner": O, "ttl_s": T}')``: take the engine's lease for owner O for T seconds,
  or renew it; refused (``LeaseNotHeld``, details ``holder`` and ``expires_in_s``) while another
  owner's lease is live. ``{"owner": O, "release": true}`` ends O's lease at once.
* ``stitch_set_version('{"version": V, "base": B}')``: record V (for ``--boot-version`` and empty
  deltas), refused unless the engine records B now (``null``: no version).
* ``stitch_stage('{"steps": [{"paths": [...], "from_version": F, "to_version": T}, ...]}')``:
  start staging consecutive patch steps from the held version in a background thread (see
  :mod:`.update`); the engine keeps serving. Returns at once.
* ``stitch_staged("{}")``: ``staging`` ``{"state": "running" | "ready", "to_version", "report"}``;
  a failed staging answers its error (nothing written).
* ``stitch_commit('{"to_version": T}')``: write the ready staged update, verify (engine paused).
* ``stitch_apply_patch('{"paths": [...], "from_version": F, "to_version": T}')``: stage and
  commit the patch files of one version in one call; refused unless the engine holds F.
* ``stitch_load_snapshot('{"paths": [...], "version": V, "checksums": {name: xxh3}, "layouts": {name: parts}}')``.
* ``stitch_checksums('{"names": [...], "layouts": {name: parts}}')``: ``checksums`` {name: xxh3-128 hex} as held now.
  ``layouts`` (optional, both calls): ``[[dim, start, stop], ...]`` of the tensors published in parts, whose
  checksum is then their ``xxh3_128_parts`` over that layout (:mod:`stitchboard.proto.parts`).
* ``stitch_output_counts("{}")``: ``report`` ``{"output_tokens": {key: count}}``, the output
  tokens so far of each output of the sidecar's marked requests (key ``<mark>:<prompt>:<choice>``; read at a pause:
  :mod:`.token_counts`).
* ``stitch_routed_experts('{"marks": [...]}')``: ``report``: the experts the marked requests'
  tokens were routed to during generation, handed over once (:mod:`.routing`).
* ``stitch_base_names("{}")``: ``report`` ``{"names": [...]}``: the base model's checkpoint names.
* ``stitch_adapters("{}")``: ``report`` ``{"slots": n, "loaded": {name: {"id", "pinned", "slot"}}}``:
  the LoRA adapters the worker holds (:mod:`.lora`).
* ``stitch_adapter_verify('{"name": N, "folder": F, "checksums": {peft name: xxh3}}')``: check
  that adapter N (just loaded from F by ``/v1/load_lora_adapter``) serves exactly those bits,
  then pin it; ``checksums``: the held blocks' checksums.
* ``stitch_adapter_remove('{"name": N}')``: remove adapter N from the worker (slot freed);
  ``report`` ``{"removed": bool}``.

The lease (:mod:`..lease`, ``docs/reference/engine-lease.md``): each rank holds one, its expiry
on the worker's own monotonic clock. The state-changing methods (``stitch_set_version``,
``stitch_stage``, ``stitch_commit``, ``stitch_apply_patch``, ``stitch_load_snapshot``,
``stitch_adapter_verify``, ``stitch_adapter_remove``) take the
caller's ``owner`` in their arguments and are refused (``LeaseNotHeld``, nothing done) unless
that owner's lease is live on every rank (the ranks agree on it over vLLM's TP group before
anything else, so none goes on alone); the read-only ones (state, staged, checksums, counts,
routed experts) need none. A call whose ``owner`` held a live lease when it began renews that
lease when it ends. Every answer carries the rank's ``lease`` (``holder``, ``expires_in_s``).

TP > 1: the ranks gather tensors on a gloo group of stitchboard's own. A step one rank can fail
alone (reading a hand-off file, mapping a name, writing) ends with an agreement between the
ranks (:meth:`.weights.WeightIO.agreed`), so they all refuse or restore together and the
others answer ``TpRankFailed``; only a rank that dies or hangs makes the others wait, up to
:data:`COLLECTIVE_TIMEOUT`.

State (the engine is the source of truth, DESIGN.md invariant 7): ``instance`` (a random id
drawn when the worker process imports this module: a restarted engine has a new one, so the
sidecar can tell that the weights it verified are gone), ``version`` (int or None: a fresh
engine holds no known version until told) and ``phase``: ``idle``, ``applying`` /
``loading`` (only ever seen by a process that died mid-call: RPCs run one at a time), or
``failed`` (a snapshot load died after writing, or a restore failed: no version is held; only a
snapshot load clears it).

Importing this module (vLLM does it in every worker before the model loads) makes vLLM's CPU
GEMM dispatch keep each linear layer's weight (``remove_weight=False``) so that the weights
can be written in place and re-packed; it costs one extra copy of the linear weights in host
memory. Set ``STITCH_ENGINE_FAULT_PHASE`` to ``staged``, ``half-written`` or ``written-unverified`` to
make the process exit (``os._exit(86)``) at that point of an apply or load (crash tests); with
``STITCH_ENGINE_FAULT_VERSION=V`` too, only an apply or load to version V exits (the others run).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import uuid
from datetime import timedelta
from typing import Any

from stitchboard.proto.env import env_setting
from stitchboard.proto.errors import StitchError
from stitchboard.proto.parts import layouts_from_json

from ...errors import ApplyFailedError, EngineStateError, TpRankError
from ..contract import FAULT_ENV, FAULT_EXIT_CODE, FAULT_VERSION_ENV
from ..lease import Lease, parse_owner, parse_ttl
from ..write_core import agreed
from . import lora, routing
from .experts import ExpertLayout
from .layout import RuntimeLayout
from .token_counts import output_counts, track_finished
from .update import StagingJob, apply_patch_files, commit_staged, parse_steps
from .weights import WeightIO, load_snapshot_files

log = logging.getLogger("stitchboard.sidecar.engines.vllm.worker")

#: Timeout of a collective of stitchboard's TP group (how long the others wait for a rank that died or hangs).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
#: The longest a ``stitch_staged`` call may wait in the worker for the staging, seconds (the engine schedules
#: nothing meanwhile).
MAX_STAGED_WAIT_S = 2.0
#: This worker process's instance id (``state.instance``): new in every process, so a restarted
#: engine never looks like the one whose weights the sidecar verified.
INSTANCE_ID = uuid.uuid4().hex


def _keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep the unpacked weight of every linear layer.

    vLLM resolves ``dispatch_cpu_unquantized_gemm`` from ``vllm.model_executor.layers.utils``
    at call time (after the weights load), so replacing it there before the model loads is
    enough. No-op when vLLM or that function is absent (GPU builds keep their weights).
    """
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, "_stitch_keeps_weight", False):
        return

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    dispatch_keeping_weight._stitch_keeps_weight = True  # type: ignore[attr-defined]
    dispatch_keeping_weight._stitch_original = original  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


_keep_cpu_linear_weights()
track_finished()
lora.track_lora_names()
routing.track_routing()


def _fault(phase: str, version: int) -> None:
    """Exit the process at once when ``STITCH_ENGINE_FAULT_PHASE`` names ``phase`` and
    ``STITCH_ENGINE_FAULT_VERSION`` is unset or names ``version`` (the one being applied or loaded)."""
    only = env_setting(FAULT_VERSION_ENV)
    if env_setting(FAULT_ENV) == phase and (only is None or only == str(version)):
        log.error("stitchboard fault injection: exiting at phase %s of version %d", phase, version)
        os._exit(FAULT_EXIT_CODE)


def _error(exc: BaseException) -> dict[str, Any]:
    """The wire body of ``exc`` (a StitchError's ``type`` and details; else the class name)."""
    kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
    details = exc.details if isinstance(exc, StitchError) else {}
    return {"type": kind, "message": str(exc), **details}


class StitchWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); see the module docstring.

    Every attribute is prefixed ``stitch_`` / ``_stitch`` so it cannot collide with the worker's.
    """

    _stitch_version: int | None = None
    _stitch_phase: str = "idle"
    _stitch_io: WeightIO | None = None
    _stitch_job: StagingJob | None = None
    _stitch_lease_record: Lease | None = None

    # -- plumbing ------------------------------------------------------------------------------

    def _stitch_weights(self) -> WeightIO:
        if self._stitch_io is None:
            import torch
            from vllm.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
                get_tp_group,
            )
            from vllm.platforms import current_platform

            rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            layout = RuntimeLayout(self.get_model(), rank, size, experts=ExpertLayout(self.get_model(), rank))
            # A group of our own: staging runs collectives from a background thread.
            group = (
                torch.distributed.new_group(get_tp_group().ranks, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
                if size > 1
                else None
            )
            self._stitch_io = WeightIO(layout, group, repack=current_platform.is_cpu())
        return self._stitch_io

    def _stitch_state(self) -> dict[str, Any]:
        routing.note_version(self._stitch_version)  # every version change happens inside a call, before its answer
        return {"version": self._stitch_version, "phase": self._stitch_phase, "instance": INSTANCE_ID}

    def _stitch_lease(self) -> Lease:
        if self._stitch_lease_record is None:
            self._stitch_lease_record = Lease()
        return self._stitch_lease_record

    def _stitch_agreed(self, step: Any, what: str) -> Any:
        """:func:`..write_core.agreed` over vLLM's own TP CPU group: RPCs run in the worker's main
        thread, where no staging collective of stitchboard's group can be under way."""
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        group = get_tp_group().cpu_group if get_tensor_model_parallel_world_size() > 1 else None
        return agreed(group, step, what)

    def _stitch_call(self, request: str, run: Any, owned: str | None = None) -> dict[str, Any]:
        """Parse ``request`` (JSON object), run ``run(args)``, wrap the result or the error. With
        ``owned`` (the state change, for messages) the caller's ``owner`` must hold a live lease
        on every rank first; a call whose ``owner`` held one when it began renews it at its end."""
        lease = self._stitch_lease()
        owner: str | None = None
        held = False
        try:
            args = json.loads(request) if request else {}
            if not isinstance(args, dict):
                raise ValueError("the request must be a JSON object")  # noqa: TRY004 - reported to the sidecar as a refused request
            owner = args.get("owner") if isinstance(args.get("owner"), str) else None
            held = owner is not None and lease.holds(owner)
            if owned is not None:
                caller = parse_owner(args)
                self._stitch_agreed(lambda: lease.require(caller, owned), owned)
            result = run(args)
            answer = {"ok": True, "state": self._stitch_state(), **(result or {})}
        except Exception as exc:  # noqa: BLE001 - every error goes back to the sidecar as a report
            log.warning("stitchboard call failed: %s: %s", type(exc).__name__, exc)
            answer = {"ok": False, "state": self._stitch_state(), "error": _error(exc)}
        if held and owner is not None:
            lease.extend(owner)
        return {**answer, "lease": lease.view()}

    def _stitch_finish_staging(self, drop: bool) -> None:
        """Wait for a background staging to end (it reads the weights and uses the TP group);
        with ``drop``, forget it (the weights are about to change)."""
        if self._stitch_job is not None:
            self._stitch_job.thread.join()
            if drop:
                self._stitch_job = None

    def _stitch_update(self, end: int, write: Any) -> dict[str, Any]:
        """Run ``write()`` (an apply or a staged commit) in phase ``applying``; on success the
        engine holds ``end``; on failure it still holds its version unless restoring failed."""
        self._stitch_phase = "applying"
        try:
            report = write()
        except BaseException as exc:
            if isinstance(exc, ApplyFailedError) and not exc.details.get("restored"):
                self._stitch_version, self._stitch_phase = None, "failed"
            else:  # refused, or written and restored: the engine still holds its version
                self._stitch_phase = "idle"
            raise
        self._stitch_version, self._stitch_phase = end, "idle"
        return {"report": report}

    def _stitch_require_version(self, start: int) -> None:
        self._stitch_require_idle()
        if self._stitch_version != start:
            raise EngineStateError(
                f"the engine holds version {self._stitch_version}, the patch is from version {start}",
                held=self._stitch_version,
                phase=self._stitch_phase,
            )

    def _stitch_require_idle(self) -> None:
        if self._stitch_phase != "idle":
            raise EngineStateError(
                f"the engine is in phase {self._stitch_phase!r} and holds no verified version: load a snapshot",
                held=self._stitch_version,
                phase=self._stitch_phase,
            )

    # -- RPC methods ---------------------------------------------------------------------------

    def stitch_state(self, request: str = "{}") -> dict[str, Any]:
        """``{"ok": true, "state": {"version", "phase", "instance"}, "lease": {...}}``."""
        return self._stitch_call(request, lambda args: None)

    def stitch_lease(self, request: str) -> dict[str, Any]:
        """Take (``owner``, ``ttl_s`` seconds) or renew the engine's lease on every rank, or end it
        (``owner``, ``release``: true). A take refused on any rank (another owner's lease is live
        there: ``LeaseNotHeld``) is undone on the ranks that granted it, so that the lease is
        held on every rank or on none; ``lease`` in the answer says who holds it."""

        def run(args: dict[str, Any]) -> None:
            owner, lease = parse_owner(args), self._stitch_lease()
            if args.get("release") is True:
                lease.release(owner)
                return
            ttl_s = parse_ttl(args)
            try:
                self._stitch_agreed(lambda: lease.take(owner, ttl_s), "taking the engine's lease")
            except TpRankError:  # another rank refused: this rank's take is undone
                lease.release(owner)
                raise

        return self._stitch_call(request, run)

    def stitch_set_version(self, request: str) -> dict[str, Any]:
        """Record ``version`` (int >= 0) as held, only if the engine records ``base`` now (int, or
        None: no version); refused in phase ``failed`` and when the record is not ``base`` (an
        engine restarted or changed since the caller looked must not be relabelled)."""

        def run(args: dict[str, Any]) -> None:
            version, base = args.get("version"), args.get("base")
            if type(version) is not int or version < 0:
                raise ValueError(f"version must be an integer >= 0, got {version!r}")
            if base is not None and (type(base) is not int or base < 0):
                raise ValueError(f"base must be null or an integer >= 0, got {base!r}")
            self._stitch_require_idle()
            if self._stitch_version != base:
                raise EngineStateError(
                    f"the engine records version {self._stitch_version}, not {base}: version {version} is not recorded",
                    held=self._stitch_version,
                    phase=self._stitch_phase,
                )
            self._stitch_version = version

        return self._stitch_call(request, run, owned="recording a version")

    def stitch_stage(self, request: str) -> dict[str, Any]:
        """Start staging ``steps`` (consecutive patch versions from the held one) in the background.

        Returns ``{"ok": true, "state", "staging": {"state": "running", ...}}``; poll
        :meth:`stitch_staged`. A staging already running is waited for and replaced.
        """

        def run(args: dict[str, Any]) -> dict[str, Any]:
            steps = parse_steps(args)
            self._stitch_finish_staging(drop=True)
            self._stitch_require_version(steps[0][1])
            self._stitch_job = StagingJob(self._stitch_weights(), steps)
            return {"staging": self._stitch_job.status()}

        return self._stitch_call(request, run, owned="staging an update")

    def stitch_staged(self, request: str = "{}") -> dict[str, Any]:
        """``{"ok": true, "state", "staging": {"state": "running" | "ready", ...}}``, or the
        staging's error (a refusal: the engine was not touched).

        ``wait_s`` (optional, seconds in [0, :data:`MAX_STAGED_WAIT_S`]): wait that long at most for a running
        staging to end before answering. The engine schedules nothing meanwhile, so the sidecar asks it only
        while no request is in flight: the staging threads then have the host's cores to themselves, where
        polls every few ms would each take the worker's GIL and keep vLLM's message queues spinning (a reader
        busy-loops for a second after every call, ``shm_broadcast``'s ``busy_loop_s``).
        """

        def run(args: dict[str, Any]) -> dict[str, Any]:
            if self._stitch_job is None:
                raise EngineStateError(
                    "nothing is staged: call stitch_stage first", held=self._stitch_version, phase=self._stitch_phase
                )
            wait_s = args.get("wait_s", 0)
            if type(wait_s) not in (int, float) or not 0 <= wait_s <= MAX_STAGED_WAIT_S:
                raise ValueError(f"wait_s must be a number of seconds in [0, {MAX_STAGED_WAIT_S}], got {wait_s!r}")
            if wait_s:
                self._stitch_job.thread.join(wait_s)
            return {"staging": self._stitch_job.status()}

        return self._stitch_call(request, run)

    def stitch_commit(self, request: str) -> dict[str, Any]:
        """Commit the ready staged update ending at ``to_version`` (see
        :func:`.update.commit_staged`); the staged update is used up either way.

        Returns ``{"ok": true, "state", "report"}`` or an error report as
        :meth:`stitch_apply_patch` does.
        """

        def run(args: dict[str, Any]) -> dict[str, Any]:
            end = args.get("to_version")
            job = self._stitch_job
            if job is None or job.thread.is_alive() or job.result is None:
                raise EngineStateError(
                    "no staged update is ready: stage it and wait until stitch_staged says ready",
                    held=self._stitch_version,
                    phase=self._stitch_phase,
                )
            staged = job.result
            if end != staged.to_version:
                raise ValueError(f"the staged update ends at version {staged.to_version}, not {end!r}")
            self._stitch_require_version(staged.from_version)
            self._stitch_job = None
            return self._stitch_update(
                end, lambda: commit_staged(self._stitch_weights(), staged, functools.partial(_fault, version=end))
            )

        return self._stitch_call(request, run, owned="committing the staged update")

    def stitch_apply_patch(self, request: str) -> dict[str, Any]:
        """Apply ``paths`` (patch files of one version) taking ``from_version`` to ``to_version``.

        Returns ``{"ok": true, "state", "report": {...}}`` (see
        :func:`.update.commit_staged`) or an error report: type ``ApplyFailed`` once writing
        began (``restored`` True: the old bits are back), any other type: refused, nothing written.
        """

        def run(args: dict[str, Any]) -> dict[str, Any]:
            ((paths, start, end),) = parse_steps({"steps": [args]})
            self._stitch_finish_staging(drop=True)
            self._stitch_require_version(start)
            io = self._stitch_weights()
            return self._stitch_update(
                end, lambda: apply_patch_files(io, paths, start, end, functools.partial(_fault, version=end))
            )

        return self._stitch_call(request, run, owned="applying a patch")

    def stitch_load_snapshot(self, request: str) -> dict[str, Any]:
        """Load ``paths`` (snapshot shards) verified against ``checksums``; record ``version``.

        A failure after the first write leaves phase ``failed`` and version None.
        """

        def run(args: dict[str, Any]) -> dict[str, Any]:
            paths, version, sums = args.get("paths"), args.get("version"), args.get("checksums")
            if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
                raise ValueError("paths must be a non-empty list of file paths")
            if type(version) is not int or version < 0:
                raise ValueError(f"version must be an integer >= 0, got {version!r}")
            if not isinstance(sums, dict) or not sums or not all(isinstance(v, str) for v in sums.values()):
                raise ValueError("checksums must map every tensor name to its xxh3_128 (or xxh3_128_parts) hex digest")
            layouts = layouts_from_json(args.get("layouts"), "stitch_load_snapshot")
            self._stitch_finish_staging(drop=True)
            io = self._stitch_weights()
            held, phase = self._stitch_version, self._stitch_phase
            self._stitch_phase = "loading"
            try:
                report = load_snapshot_files(io, paths, sums, functools.partial(_fault, version=version), layouts)
            except BaseException as exc:
                if isinstance(exc, ApplyFailedError):  # written: no version is held any more
                    self._stitch_version, self._stitch_phase = None, "failed"
                else:
                    self._stitch_version, self._stitch_phase = held, phase
                raise
            self._stitch_version, self._stitch_phase = version, "idle"
            return {"report": report}

        return self._stitch_call(request, run, owned="loading a snapshot")

    def stitch_checksums(self, request: str) -> dict[str, Any]:
        """``{"ok": true, "state", "checksums": {name: hex}}`` of ``names`` as held now: xxh3-128, or
        xxh3_128_parts over ``layouts[name]`` for a name ``layouts`` lists."""

        def run(args: dict[str, Any]) -> dict[str, Any]:
            names = args.get("names")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("names must be a list of checkpoint tensor names")
            layouts = layouts_from_json(args.get("layouts"), "stitch_checksums")
            self._stitch_finish_staging(drop=False)
            return {"checksums": self._stitch_weights().checksums(names, layouts)}

        return self._stitch_call(request, run)

    def stitch_output_counts(self, request: str = "{}") -> dict[str, Any]:
        """``{"ok": true, "state", "report": {"output_tokens": {key: count}}}``: output tokens of
        each output of the marked requests the engine holds or finished last (see :mod:`.token_counts`)."""
        return self._stitch_call(request, lambda args: {"report": {"output_tokens": output_counts(self.model_runner)}})  # type: ignore[attr-defined]

    def stitch_routed_experts(self, request: str) -> dict[str, Any]:
        """``{"ok": true, "state", "report": {...}}``: the routing captured for ``marks`` (see
        :func:`.routing.take`), forgotten afterwards."""

        def run(args: dict[str, Any]) -> dict[str, Any]:
            marks = args.get("marks")
            if not isinstance(marks, list) or not all(isinstance(m, str) for m in marks):
                raise ValueError("marks must be a list of request marks")
            return {"report": routing.take(self.model_runner, marks)}  # type: ignore[attr-defined]

        return self._stitch_call(request, run)

    def stitch_base_names(self, request: str = "{}") -> dict[str, Any]:
        """``{"ok": true, "state", "report": {"names": [...]}}``: the base model's checkpoint names
        (:meth:`.layout.RuntimeLayout.checkpoint_names`)."""
        return self._stitch_call(
            request, lambda args: {"report": {"names": self._stitch_weights().layout.checkpoint_names()}}
        )

    def stitch_adapters(self, request: str = "{}") -> dict[str, Any]:
        """``{"ok": true, "state", "report": {"slots": n, "loaded": {name: {"id", "pinned", "slot"}}}}``."""
        runner = self.model_runner  # type: ignore[attr-defined]
        return self._stitch_call(
            request, lambda args: {"report": {"slots": lora.slots(runner), "loaded": lora.loaded(runner)}}
        )

    def stitch_adapter_verify(self, request: str) -> dict[str, Any]:
        """Verify adapter ``name`` against ``folder`` and ``checksums`` (:func:`.lora.verify`), then
        pin it (:func:`.lora.pin`); ``checksums`` in the answer: the held blocks' xxh3-128. A
        refusal pins nothing (the caller unloads the adapter)."""

        def run(args: dict[str, Any]) -> dict[str, Any]:
            name, folder, sums = args.get("name"), args.get("folder"), args.get("checksums")
            if not isinstance(name, str) or not isinstance(folder, str):
                raise ValueError("name and folder must be strings")  # noqa: TRY004 - reported to the sidecar as a refused request
            if not isinstance(sums, dict) or not sums or not all(isinstance(v, str) for v in sums.values()):
                raise ValueError("checksums must map every PEFT tensor name to its xxh3_128 hex digest")
            runner = self.model_runner  # type: ignore[attr-defined]
            held = lora.verify(runner, name, folder, sums)
            lora.pin(runner, name)
            return {"checksums": held}

        return self._stitch_call(request, run, owned="verifying and pinning a LoRA adapter")

    def stitch_adapter_remove(self, request: str) -> dict[str, Any]:
        """Remove adapter ``name`` from the worker: ``report`` ``{"removed": bool}`` (False: none held)."""

        def run(args: dict[str, Any]) -> dict[str, Any]:
            name = args.get("name")
            if not isinstance(name, str):
                raise ValueError("name must be a string")  # noqa: TRY004 - reported to the sidecar as a refused request
            return {"report": {"removed": lora.remove(self.model_runner, name)}}  # type: ignore[attr-defined]

        return self._stitch_call(request, run, owned="removing a LoRA adapter")
