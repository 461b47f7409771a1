"""The stitchboard vLLM worker extension: in-place, bit-exact weight updates inside the engine.

Start vLLM with::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CKPT \\
        --worker-extension-cls stitchboard.sidecar.vllm_worker.StitchWorkerExtension

and drive it over ``POST /collective_rpc`` (the adapter in :mod:`.engine` does). Every method
takes one argument, a JSON string (vLLM's dev endpoint passes only strings), and returns a small
JSON dict: ``{"ok": true, "state": {...}, ...}`` or ``{"ok": false, "error": {"type", "message",
"written", "restored"}, "state": {...}}``. Methods (all ranks run each call, in step):

* ``stitch_state("{}")``: ``state`` only.
* ``stitch_set_version('{"version": V}')``: record V (for ``--boot-version`` and empty deltas).
* ``stitch_apply_patch('{"paths": [...], "from_version": F, "to_version": T}')``: apply hand-off
  patch files (see :func:`.vllm_weights.apply_patch_files`); refused unless the engine holds F.
* ``stitch_load_snapshot('{"paths": [...], "version": V, "checksums": {name: xxh3}}')``.
* ``stitch_checksums('{"names": [...]}')``: ``checksums`` {name: xxh3-128 hex} as held now.

State (the engine is the source of truth, DESIGN.md invariant 7): ``version`` (int or None:
a fresh engine holds no known version until told) and ``phase``: ``idle``, ``applying`` /
``loading`` (only ever seen by a process that died mid-call: RPCs run one at a time), or
``failed`` (a snapshot load died after writing, or a restore failed: no version is held; only a
snapshot load clears it).

Importing this module (vLLM does it in every worker before the model loads) makes vLLM's CPU
GEMM dispatch keep each linear layer's weight (``remove_weight=False``) so that the weights
can be written in place and re-packed; it costs one extra copy of the linear weights in host
memory. Set ``STITCH_FAULT_PHASE`` to ``staged``, ``half-written`` or ``written-unverified`` to
make the process exit (``os._exit(86)``) at that point of an apply or load (crash tests); with
``STITCH_FAULT_VERSION=V`` too, only an apply or load to version V exits (the others run).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

from stitchboard.proto.errors import StitchError

from .errors import EngineStateError
from .vllm_layout import RuntimeLayout
from .vllm_weights import WeightIO, apply_patch_files, load_snapshot_files

log = logging.getLogger("stitchboard.sidecar.vllm_worker")

#: Environment variable naming the phase at which to kill the process (crash tests).
FAULT_ENV = "STITCH_FAULT_PHASE"
#: Environment variable restricting the fault to an apply or load to this version (crash tests).
FAULT_VERSION_ENV = "STITCH_FAULT_VERSION"
FAULT_PHASES = ("staged", "half-written", "written-unverified")
#: Exit status of a fault-injected exit.
FAULT_EXIT_CODE = 86


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


def _fault(phase: str, version: int) -> None:
    """Exit the process at once when ``STITCH_FAULT_PHASE`` names ``phase`` and
    ``STITCH_FAULT_VERSION`` is unset or names ``version`` (the one being applied or loaded)."""
    only = os.environ.get(FAULT_VERSION_ENV)
    if os.environ.get(FAULT_ENV) == phase and (only is None or only == str(version)):
        log.error("stitchboard fault injection: exiting at phase %s of version %d", phase, version)
        os._exit(FAULT_EXIT_CODE)


def _error(exc: BaseException, restored: bool | None) -> dict[str, Any]:
    kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
    details = exc.details if isinstance(exc, StitchError) else {}
    return {"type": kind, "message": str(exc), "written": bool(getattr(exc, "written", False)), "restored": restored, **details}


class StitchWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); see the module docstring.

    Every attribute is prefixed ``stitch_`` / ``_stitch`` so it cannot collide with the worker's.
    """

    _stitch_version: int | None = None
    _stitch_phase: str = "idle"
    _stitch_io: WeightIO | None = None

    # -- plumbing ------------------------------------------------------------------------------

    def _stitch_weights(self) -> WeightIO:
        if self._stitch_io is None:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
            from vllm.platforms import current_platform

            rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            layout = RuntimeLayout(self.get_model(), rank, size)
            self._stitch_io = WeightIO(layout, get_tp_group().cpu_group if size > 1 else None, repack=current_platform.is_cpu())
        return self._stitch_io

    def _stitch_state(self) -> dict[str, Any]:
        return {"version": self._stitch_version, "phase": self._stitch_phase}

    def _stitch_call(self, request: str, run: Any) -> dict[str, Any]:
        """Parse ``request`` (JSON object), run ``run(args)``, wrap the result or the error."""
        try:
            args = json.loads(request) if request else {}
            if not isinstance(args, dict):
                raise ValueError("the request must be a JSON object")
            result = run(args)
            return {"ok": True, "state": self._stitch_state(), **(result or {})}
        except Exception as exc:  # noqa: BLE001 - every error goes back to the sidecar as a report
            log.warning("stitchboard call failed: %s: %s", type(exc).__name__, exc)
            restored = None if not getattr(exc, "written", False) else self._stitch_phase != "failed"
            return {"ok": False, "state": self._stitch_state(), "error": _error(exc, restored)}

    def _stitch_require_idle(self) -> None:
        if self._stitch_phase != "idle":
            raise EngineStateError(f"the engine is in phase {self._stitch_phase!r} and holds no verified version: load a snapshot", held=self._stitch_version, phase=self._stitch_phase)

    # -- RPC methods ---------------------------------------------------------------------------

    def stitch_state(self, request: str = "{}") -> dict[str, Any]:
        """``{"ok": true, "state": {"version", "phase"}}``."""
        return self._stitch_call(request, lambda args: None)

    def stitch_set_version(self, request: str) -> dict[str, Any]:
        """Record ``version`` (int >= 0) as held; refused in phase ``failed``."""

        def run(args: dict[str, Any]) -> None:
            version = args.get("version")
            if type(version) is not int or version < 0:
                raise ValueError(f"version must be an integer >= 0, got {version!r}")
            self._stitch_require_idle()
            self._stitch_version = version

        return self._stitch_call(request, run)

    def stitch_apply_patch(self, request: str) -> dict[str, Any]:
        """Apply ``paths`` (patch files of one version) taking ``from_version`` to ``to_version``.

        Returns ``{"ok": true, "state", "report": {...}}`` (see
        :func:`.vllm_weights.apply_patch_files`) or an error report: ``written`` False means
        refused before any write; True with ``restored`` True means the old bits are back.
        """

        def run(args: dict[str, Any]) -> dict[str, Any]:
            paths, start, end = args.get("paths"), args.get("from_version"), args.get("to_version")
            if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
                raise ValueError("paths must be a non-empty list of file paths")
            if type(start) is not int or type(end) is not int or not 0 <= start < end:
                raise ValueError(f"need integers 0 <= from_version < to_version, got {start!r}, {end!r}")
            self._stitch_require_idle()
            if self._stitch_version != start:
                raise EngineStateError(f"the engine holds version {self._stitch_version}, the patch is from version {start}", held=self._stitch_version, phase=self._stitch_phase)
            io = self._stitch_weights()
            self._stitch_phase = "applying"
            try:
                report = apply_patch_files(io, paths, functools.partial(_fault, version=end))
            except BaseException as exc:
                if getattr(exc, "restore_failed", False):
                    self._stitch_version, self._stitch_phase = None, "failed"
                else:  # refused, or written and restored: the engine still holds ``start``
                    self._stitch_phase = "idle"
                raise
            self._stitch_version, self._stitch_phase = end, "idle"
            return {"report": report}

        return self._stitch_call(request, run)

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
                raise ValueError("checksums must map every tensor name to its xxh3_128 hex digest")
            io = self._stitch_weights()
            held, phase = self._stitch_version, self._stitch_phase
            self._stitch_phase = "loading"
            try:
                report = load_snapshot_files(io, paths, sums, functools.partial(_fault, version=version))
            except BaseException as exc:
                if getattr(exc, "written", False):
                    self._stitch_version, self._stitch_phase = None, "failed"
                else:
                    self._stitch_version, self._stitch_phase = held, phase
                raise
            self._stitch_version, self._stitch_phase = version, "idle"
            return {"report": report}

        return self._stitch_call(request, run)

    def stitch_checksums(self, request: str) -> dict[str, Any]:
        """``{"ok": true, "state", "checksums": {name: xxh3-128 hex}}`` of ``names`` as held now."""

        def run(args: dict[str, Any]) -> dict[str, Any]:
            names = args.get("names")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("names must be a list of checkpoint tensor names")
            return {"checksums": self._stitch_weights().checksums(names)}

        return self._stitch_call(request, run)
