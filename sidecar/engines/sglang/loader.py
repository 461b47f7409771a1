"""stitchboard's custom weight loader for SGLang: runs in every TP rank's scheduler process.

Start SGLang with ``--custom-weight-loader stitchboard.sidecar.engines.sglang.loader.load`` (see
:mod:`.launch`) and call ``POST /update_weights_from_tensor`` with ``load_format`` set to that
path, between ``/begin_weight_update`` and ``/end_weight_update`` (:mod:`.adapter` does). SGLang
calls :func:`load` with the rank's live ``nn.Module`` and the (name, tensor) list decoded from
``serialized_named_tensors[tp_rank]``: here one uint8 tensor named :data:`REQUEST_NAME` holding
a JSON request. Patch and snapshot bytes never travel over HTTP: the request names hand-off files
and their sha256 digests, and the loader reads them itself. Requests (``op``)::

    {"op": "state"}
    {"op": "apply", "steps": [{"paths": [...], "digests": [...]}, ...], "what": "1->2"}
    {"op": "load_snapshot", "paths": [...], "digests": [...], "checksums": {name: xxh3}, "layouts": {...}}
    {"op": "checksums", "names": [...], "layouts": {name: [[dim, start, stop], ...]}}
    {"op": "output_counts"}   (at a pause: the marked requests' output tokens, :mod:`.token_counts`)
    {"op": "lease", "owner": O, "ttl_s": T} | {"op": "lease", "owner": O, "release": true}
    {"op": "label"}           (a call that sets SGLang's weight_version: only with the lease)

plus ``id`` (the request id), ``record_dir`` (where the answers go), ``held`` (the version the
caller reads from SGLang's ``weight_version``, echoed in the state) and ``owner`` (the caller's
lease owner id). **An exception raised here kills the SGLang server**, so :func:`load` never
raises: each rank writes its answer, the shape of
:class:`~stitchboard.sidecar.engines.rpc.RankAnswer` (with the rank's ``lease``), to
``<record_dir>/rank<r>.json`` with the request id and the process's pid and start time (so that
the sidecar can tell a record of a process that is gone). Everything that can be refused is
checked before the first write (:mod:`.inplace`); a failure after it writes the old bits back.

The lease (``docs/reference/engine-lease.md``, :mod:`..lease`): each rank's process holds one.
``{"op": "lease", "owner", "ttl_s"}`` takes or renews it (``"release": true`` ends it), refused
(``LeaseNotHeld``, naming the holder and its time left) while another owner's is live; the
sidecar makes that call through an update call only at its first contact with a server that runs
no stitchboard code yet, and through the control socket otherwise. The ops that change the engine
(``apply``, ``load_snapshot``, and ``label``: a call that sets SGLang's ``weight_version``) are
answered with a refusal, by the records and never by raising, unless the caller's ``owner`` holds
a live lease on every rank (the ranks agree on it before any collective). SGLang itself sets the
``weight_version`` a call names whatever the loader answers: the sidecar's adapter sends none
without its lease. A call whose ``owner`` held a live lease when it began renews it when it ends.

Control socket: the first call of a process starts a :class:`.stager.StageServer` thread on the
rank's :func:`.stager.control_address` (named by SGLang's HTTP port). Any TP size: ``lease``
requests. TP = 1, staging while serving: a ``stage`` request (the ``apply`` request's fields,
with ``id`` and ``owner``) runs :func:`.inplace.stage` on the live weights (reads only) and keeps
the writes as the process's one staged plan. A ``commit`` request naming that ``plan`` (engine
paused) then only writes, reading each chunk back as it writes it, and records, without an update
call (SGLang's write session costs ~30 ms of the pause: begin, the call's round trip through the
tokenizer and scheduler processes, end). Both need the caller's live lease. What staging checked
still holds at the write: staging and every loader write hold one lock, every write op bumps a
generation, and a plan staged under another generation is not written; nothing else writes
SGLang's weights (its own weight routes are refused by the sidecar's proxy, the engine listens
on loopback) and an engine restart is caught by the instance check. A plan that is missing or
stale is never an error: the commit answers ``committed: false`` and the sidecar sends an
``apply``, which stages in the pause, as at TP > 1. The commit writes only while the scheduler
thread waits in its paused loop (:mod:`.paused_hold`), so no forward pass runs meanwhile.

State of this process: ``instance`` (a random id drawn when SGLang first imports this module,
at the first update call of the process: a restarted engine has a new one) and ``phase``
(``idle``; ``failed`` when a snapshot load died after writing or a restore failed: only a
snapshot load clears it). The version itself is SGLang's ``weight_version``.

``STITCH_ENGINE_FAULT_PHASE`` = ``staged`` | ``half-written`` | ``written-unverified`` makes
the process exit (``os._exit(86)``) at that point of an apply or snapshot load (crash tests);
``STITCH_ENGINE_FAULT_VERSION`` = V limits it to the update whose ``what`` ends at V.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from stitchboard.proto.env import env_setting
from stitchboard.proto.errors import StitchError
from stitchboard.proto.parts import layouts_from_json

from ...errors import EngineStateError, TpRankError
from ..contract import FAULT_ENV, FAULT_EXIT_CODE, FAULT_VERSION_ENV
from ..lease import Lease, parse_owner, parse_ttl
from . import paused_hold
from .routing import install_capturer, keep_first_routing
from .token_counts import number_samples, output_counts, track_finished

log = logging.getLogger("stitchboard.sidecar.engines.sglang.loader")

#: The name of the request tensor in ``serialized_named_tensors``.
REQUEST_NAME = "stitchboard.request"
#: The ``load_format`` / ``--custom-weight-loader`` path of :func:`load`.
LOADER_PATH = "stitchboard.sidecar.engines.sglang.loader.load"
#: This process's instance id.
INSTANCE_ID = uuid.uuid4().hex
track_finished()  # the final counts of finished marked requests (:mod:`.token_counts`)
number_samples()  # the choice of each output of a request with several outputs (:mod:`.token_counts`)
# a request retracted at a commit answers the routing its tokens were sampled from (:mod:`.routing`)
keep_first_routing()
paused_hold.install()  # the stager's write holds the paused scheduler loop (:mod:`.paused_hold`)
#: How long the stager's commit waits for the scheduler thread to reach its paused loop, seconds
#: (it finishes the forward pass it runs first); past it the update call applies the plan (an
#: event loop that never calls the wrapped method, or a very long forward pass).
PARK_TIMEOUT_S = 15.0

#: The update-call ops that change the engine (op -> what, for messages): only with the caller's lease.
OWNED_OPS = {"apply": "applying an update", "load_snapshot": "loading a snapshot", "label": "recording a version"}

_phase = "idle"
_ranks: Any = None
_lease = Lease()  # this rank's lease on the engine
#: Held by staging and by every write of the loader; ``_generation`` counts the write ops.
_lock = threading.Lock()
_generation = 0
_stager: Any = None
_stager_tp = 1  # the TP size the control socket serves (staging while serving only at TP = 1)


@dataclass
class _Plan:
    id: str
    generation: int
    writes: list
    report: dict[str, Any]


_plan: _Plan | None = None


def process_start(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _tp() -> tuple[int, int, object | None]:
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    rank, size = int(parallel.tp_rank), int(parallel.tp_size)
    return rank, size, (get_tp_group().cpu_group if size > 1 else None)


def _get_ranks(model: torch.nn.Module) -> Any:
    global _ranks
    if _ranks is None or _ranks.layout.model is not model:
        from .inplace import Ranks
        from .layout import SglangLayout

        rank, size, group = _tp()
        _ranks = Ranks(SglangLayout(model, rank, size), group)
    return _ranks


def _fault(what: str) -> Any:
    only = env_setting(FAULT_VERSION_ENV)

    def hook(phase: str) -> None:
        if env_setting(FAULT_ENV) == phase and (only is None or what.endswith(f"->{only}")):
            log.error("stitchboard fault injection: exiting at phase %s of version %s", phase, what)
            os._exit(FAULT_EXIT_CODE)

    return hook


def _error(exc: BaseException) -> dict[str, Any]:
    kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
    details = exc.details if isinstance(exc, StitchError) else {}
    return {"type": kind, "message": str(exc), **details}


def _require_idle() -> None:
    if _phase != "idle":
        raise EngineStateError(
            f"the engine is in phase {_phase!r} and holds no verified version: load a snapshot", held=None, phase=_phase
        )


def _state(req: dict[str, Any]) -> dict[str, Any]:
    """This process's state for an answer (``version``: the ``held`` the caller sent, echoed)."""
    held = req.get("held") if type(req.get("held")) is int else None
    return {"version": held, "phase": _phase, "instance": INSTANCE_ID}


def _lease_op(req: dict[str, Any], ranks: Any = None) -> dict[str, Any]:
    """A ``lease`` request: take or renew (``ttl_s``), or end (``release``), ``owner``'s lease.
    With ``ranks`` (an update call, every rank in step) a take refused on any rank is undone on
    the others, so that every rank holds it or none. Raises LeaseNotHeldError (another owner's is
    live), TpRankError (another rank refused) or ValueError (malformed)."""
    owner = parse_owner(req)
    if req.get("release") is True:
        _lease.release(owner)
        return {}
    ttl_s = parse_ttl(req)
    if ranks is None:
        _lease.take(owner, ttl_s)
        return {}
    try:
        ranks.agreed(lambda: _lease.take(owner, ttl_s), "taking the engine's lease")
    except TpRankError:  # another rank refused: this rank's take is undone
        _lease.release(owner)
        raise
    return {}


def _run(model: torch.nn.Module, req: dict[str, Any]) -> dict[str, Any]:
    """Run one request on this rank; returns the answer's extra fields (raises on failure)."""
    op = req.get("op")
    if op == "state":
        return {}
    if op == "output_counts":
        return {"report": {"output_tokens": output_counts()}}
    if op == "lease":
        with _lock:
            ranks = _get_ranks(model)
        return _lease_op(req, ranks)
    with _lock:
        if op in OWNED_OPS:  # every rank refuses, or none, before any collective
            owner, what = parse_owner(req), OWNED_OPS[str(op)]
            _get_ranks(model).agreed(lambda: _lease.require(owner, what), what)
        return _locked(model, req, op)


def _write(ranks: Any, writes: list, what: str, verify: str) -> dict[str, Any]:
    """Write staged ``writes`` in place (``_lock`` held): any staged plan is stale from here on;
    phase ``failed`` when a failure leaves the old bits not restored. Returns the timing."""
    global _phase, _generation
    from .inplace import commit

    _generation += 1
    try:
        return commit(ranks, writes, _fault(what), f"writing versions {what}", verify=verify)
    except StitchError as exc:
        if not exc.details.get("restored", True):
            _phase = "failed"
        raise


def _locked(model: torch.nn.Module, req: dict[str, Any], op: object) -> dict[str, Any]:
    global _phase, _generation
    from .inplace import load_snapshot, stage

    ranks = _get_ranks(model)
    if op == "label":
        return {}
    if op == "checksums":
        layouts = layouts_from_json(req.get("layouts"), "checksums")
        return {"checksums": {n: ranks.checksum(ranks.layout.place(n), layouts.get(n)) for n in req["names"]}}
    what = str(req.get("what", ""))
    if op == "apply":
        _require_idle()
        t = time.perf_counter()
        writes, report = stage(ranks, [(s["paths"], s["digests"]) for s in req["steps"]])
        report.update(staged_while_serving=False, stage_s=time.perf_counter() - t)
        report.update(_write(ranks, writes, what, "full"))
        return {"report": report}
    if op == "load_snapshot":
        _generation += 1
        try:
            layouts = layouts_from_json(req.get("layouts"), "load_snapshot")
            report = load_snapshot(ranks, req["paths"], req["digests"], req["checksums"], _fault(what), layouts)
        except StitchError as exc:
            if exc.type == "ApplyFailed":
                _phase = "failed"
            raise
        _phase = "idle"
        return {"report": report}
    raise ValueError(f"unknown op {op!r}")


def _commit_plan(model: torch.nn.Module, req: dict[str, Any]) -> dict[str, Any]:
    """Write the plan ``req["plan"]`` from the control socket thread (engine paused, see :func:`_control`);
    the answer's extra fields, ``report.committed`` False when that plan is missing or stale
    (nothing written: the caller applies through the update call). Raises on failure."""
    global _plan
    with _lock:
        _require_idle()
        plan, _plan = _plan, None
        if plan is None or plan.id != req.get("plan") or plan.generation != _generation:
            return {"report": {"committed": False, "why": "no such plan staged since the last write"}}
        t = time.perf_counter()
        if not paused_hold.hold(PARK_TIMEOUT_S):  # released once the answer is sent (the stager's ``after``)
            return {
                "report": {
                    "committed": False,
                    "why": f"the scheduler thread did not reach its paused loop within {PARK_TIMEOUT_S:g} s",
                }
            }
        park_s = time.perf_counter() - t
        timing = _write(_get_ranks(model), plan.writes, str(req.get("what", "")), "written")
        t = time.perf_counter()
        flushed = bool(req.get("flush")) and paused_hold.flush_cache()
        if torch.cuda.is_available():  # the stager thread's kernels ordered before the scheduler's streams resume
            torch.cuda.synchronize()
        timing["flush_s"] = time.perf_counter() - t
        return {
            "report": {
                **plan.report,
                "staged_while_serving": True,
                "committed": True,
                "flushed": flushed,
                "stage_s": 0.0,
                "park_s": park_s,
                **timing,
            }
        }


def _stage_plan(model: torch.nn.Module, req: dict[str, Any]) -> dict[str, Any]:
    """Stage ``req``'s steps on the live weights from the stager thread (engine serving; nothing
    written) and keep them as the process's plan ``req["id"]``; the answer's extra fields. Raises
    on failure (the previous plan is dropped either way)."""
    global _plan
    from .inplace import stage

    _require_idle()
    with _lock:
        _plan = None
        t = time.perf_counter()
        writes, report = stage(_get_ranks(model), [(s["paths"], s["digests"]) for s in req["steps"]])
        report["stage_s"] = time.perf_counter() - t
        _plan = _Plan(str(req["id"]), _generation, writes, report)
    return {"report": report}


def _control(model: torch.nn.Module, req: dict[str, Any]) -> dict[str, Any]:
    """The control socket's handler (see the module doc). ``lease``: :func:`_lease_op`. At TP = 1,
    with the caller's live lease: ``stage``: :func:`_stage_plan`; ``commit``: :func:`_commit_plan`
    (write plan ``req["plan"]`` in place, each chunk read back as it is written, empty the radix
    cache when ``req["flush"]``, while the scheduler thread is held in its paused loop:
    :mod:`.paused_hold`; when it is not reached, nothing is written), and record the answer in
    ``req["record_dir"]`` as :func:`load` does. Returns the answer as :func:`load` records it;
    never raises."""
    op = req.get("op")
    owner = req.get("owner") if isinstance(req.get("owner"), str) else None
    held = owner is not None and _lease.holds(owner)
    try:
        if op == "lease":
            extra = _lease_op(req)
        elif op in ("stage", "commit"):
            if _stager_tp != 1:
                raise ValueError(f"staging while serving needs TP = 1 (this engine runs TP = {_stager_tp})")
            _lease.require(parse_owner(req), "writing the staged update" if op == "commit" else "staging an update")
            extra = _commit_plan(model, req) if op == "commit" else _stage_plan(model, req)
        else:
            raise ValueError(f"unknown op {op!r}")
        answer: dict[str, Any] = {"ok": True, **extra}
    except Exception as exc:  # noqa: BLE001 - answered, never raised
        log.warning("stitchboard stager: %s: %s", type(exc).__name__, exc)
        answer = {"ok": False, "error": _error(exc)}
    if held and owner is not None:
        _lease.extend(owner)
    answer["state"], answer["lease"] = _state(req), _lease.view()
    if op == "commit" and isinstance(req.get("record_dir"), str):
        try:
            _write_record(req["record_dir"], 0, req.get("id"), answer)
        except Exception:  # the answer still goes back on the socket
            log.exception("stitchboard stager: could not write the answer record")
    return answer


def _after_answer(req: dict[str, Any]) -> None:
    # Once a commit's answer is sent (or failed): the scheduler thread goes on.
    if req.get("op") == "commit":
        paused_hold.release()


def _http_port() -> int:
    from sglang.srt.runtime_context import get_server_args

    return int(get_server_args().port)


def _serve_control(model: torch.nn.Module, rank: int, size: int) -> None:
    """Start this process's control socket thread (once; see the module doc). Raises OSError (the
    address cannot be bound) or what reading SGLang's port raises; the caller logs it."""
    global _stager, _stager_tp
    from .stager import StageServer, control_address

    if _stager is not None and _stager.is_alive():
        return
    with _lock:
        _get_ranks(model)  # here, in SGLang's thread (it reads the TP rank from its context)
    _stager_tp = size
    _stager = StageServer(control_address(_http_port(), rank), lambda req: _control(model, req), after=_after_answer)
    _stager.start()


def _write_record(record_dir: str, rank: int, request: object, answer: dict[str, Any]) -> None:
    # The rank's answer to request id ``request``, with this process's pid and start time.
    record = {"request": request, "pid": os.getpid(), "start": process_start(os.getpid()), "answer": answer}
    os.makedirs(record_dir, exist_ok=True)
    path = os.path.join(record_dir, f"rank{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def load(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader entry point (see the module docstring). Never raises."""
    req: dict[str, Any] = {}
    rank, size = 0, 1
    held, owner = False, None
    why = install_capturer()  # SGLang's return_routed_experts on the CPU (:mod:`.routing`)
    if why is not None:
        log.debug("stitchboard loader: no routed-experts capture: %s", why)
    try:
        rank, size = _tp()[:2]
        tensors = dict(named_tensors)
        if set(tensors) != {REQUEST_NAME}:
            raise ValueError(f"expected one tensor named {REQUEST_NAME!r}, got {sorted(tensors)[:5]}")
        req = json.loads(bytes(tensors[REQUEST_NAME].to("cpu", torch.uint8).numpy().tobytes()))
        if not isinstance(req, dict) or not isinstance(req.get("record_dir"), str):
            raise ValueError("the request must be a JSON object with a record_dir")  # noqa: TRY004 - reported, never raised to SGLang
        owner = req.get("owner") if isinstance(req.get("owner"), str) else None
        held = owner is not None and _lease.holds(owner)
        answer: dict[str, Any] = {"ok": True, **_run(model, req)}
    except Exception as exc:  # noqa: BLE001 - an exception here would kill the server: reported instead
        log.warning("stitchboard loader: %s: %s", type(exc).__name__, exc)
        answer = {"ok": False, "error": _error(exc)}
    if held and owner is not None:
        _lease.extend(owner)
    answer["state"], answer["lease"] = _state(req), _lease.view()
    try:
        _serve_control(model, rank, size)
    except Exception:  # never raise into SGLang: no control socket (lease and staging through update calls)
        log.exception("stitchboard loader: could not start the control socket")
    if not isinstance(req.get("record_dir"), str):
        log.error("stitchboard loader: no record_dir, the answer is lost: %s", answer)
        return
    try:
        _write_record(req["record_dir"], rank, req.get("id"), answer)
    except Exception:  # never raise into SGLang
        log.exception("stitchboard loader: could not write the answer record")
