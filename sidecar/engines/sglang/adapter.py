"""The SGLang engine adapter: drives an SGLang server's HTTP control routes (runs in the sidecar).

:class:`SglangEngine` implements :class:`~stitchboard.sidecar.engines.base.EngineAdapter` for a
server started with stitchboard's custom weight loader (:mod:`.launch`, :mod:`.loader`). Every
in-engine call is ``/begin_weight_update`` -> ``/update_weights_from_tensor`` (``load_format``
the loader, one small request tensor per rank naming hand-off files and their sha256, never
patch bytes) -> ``/end_weight_update`` (always, in a ``finally``); each rank writes its answer
to a record file under ``record_dir``, parsed like the vLLM worker's (:mod:`..rpc`).

* Version: SGLang's own ``weight_version`` (``GET /model_info``), passed with the write itself.
  SGLang sets it after any call its loader returns from (the loader never raises), so when a
  rank reports a failure a second call in the same session sets it back to the version held
  before, or to :data:`UNVERIFIED` when the old bits may be gone; the engine is paused
  meanwhile, and a restarted sidecar takes a recorded version only once the engine's checksums
  match it. ``/update_weight_version`` is never called (it aborts requests by default).
* Commit: ``/pause_generation`` mode ``retract`` (never ``abort``): running requests go back to
  the waiting queue and their KV is freed; the write; ``/flush_cache`` (it succeeds while
  retracted requests wait, since the scheduler is paused); ``/continue_generation``. Retracted
  requests recompute their KV under the new weights, and nothing admitted later can match a
  prefix computed under the old ones: the radix cache was emptied inside the pause.
* Staging while serving: SGLang runs any update call under its model-update writer lock, which
  waits for every request in flight and holds new ones, unless the engine is paused. At TP = 1
  :meth:`stage_patches` hands the files to the loader's stager thread (:mod:`.stager`, its
  socket named in the rank records), which decodes and checks them on the live weights while
  the engine serves; in the pause the stager itself writes the plan (each chunk read back as it
  is written, the scheduler thread held in its paused loop meanwhile: :mod:`.paused_hold`) and
  records, and ``/update_weight_version`` (``abort_all_requests`` false, never
  its default) sets the version: no write session, whose begin, call and end cost ~30 ms of
  the pause. A plan made stale by another write is staged again by an update call. At TP > 1 (or with no stager) the
  files are checked here (sha256, patch format)
  and the engine decodes, checks, writes and verifies them inside the pause.
* Instance: each rank's loader draws an id when its process first imports it; records carry the
  process id and start time, so a record whose process is gone (the server restarted) is
  noticed from the records alone, without a call into the engine (an update call would wait
  for requests in flight); a fresh server is asked with a ``state`` call.
* The lease (``docs/reference/engine-lease.md``): :meth:`SglangEngine.take_lease` asks every
  rank's control socket (:func:`.stager.control_address`, named by the server's port: no call
  into SGLang, so a lease held elsewhere is learnt without touching the engine and a renewal
  never waits for requests in flight); only a server that runs no stitchboard code yet (no
  socket answers) is asked through an update call, which starts the sockets. Every later loader
  request names the owner; the state-changing ones are refused by the loader without a live
  lease, and none of SGLang's own state-changing routes (``/pause_generation``,
  ``/continue_generation``, ``/flush_cache``, ``/update_weight_version``, the write session and
  ``/update_weights_from_tensor`` for a change) is called unless the lease is live, renewed
  first when less than half its TTL is left (:class:`~..base.LeaseGuard`). A write session left
  open is closed only by the lease's holder (it was its own caller's, who died).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import pickle
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from stitchboard.proto.decode import read_patch
from stitchboard.proto.parts import Layout

from ...errors import ApplyFailedError, EngineRequestError, EngineStateError, EngineUnavailableError, LeaseNotHeldError
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
from .loader import LOADER_PATH, REQUEST_NAME, process_start
from .stager import ask, control_address

log = logging.getLogger("stitchboard.sidecar.engines.sglang.adapter")

#: ``weight_version`` given to an engine whose label must not be trusted (not an integer).
UNVERIFIED = "stitchboard-unverified"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _request_tensor(req: dict[str, Any]) -> str:
    """One rank's ``serialized_named_tensors`` entry: a pickled [(name, uint8 tensor)] in base64."""
    import torch

    data = json.dumps(req).encode()
    buf = io.BytesIO()
    pickle.dump([(REQUEST_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))], buf)
    return base64.b64encode(buf.getvalue()).decode()


def _version(label: object) -> int | None:
    return int(label) if isinstance(label, str) and label.isdigit() else None


class SglangEngine:
    """:class:`EngineAdapter` over an SGLang server's HTTP routes.

    Args:
        engine_url: base URL, e.g. ``http://127.0.0.1:30000``.
        record_dir: folder the loader writes its per-rank answers to (the sidecar's hand-off
            folder, readable and writable by both).
        timeout_s: timeout of control calls (health, pause, model info...), seconds.
        apply_timeout_s: timeout of a call that reads or writes weights, seconds.
    """

    def __init__(
        self,
        engine_url: str,
        record_dir: str | os.PathLike[str],
        timeout_s: float = 10.0,
        apply_timeout_s: float = 900.0,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.record_dir = Path(record_dir)
        self.timeout_s = timeout_s
        self.apply_timeout_s = apply_timeout_s
        self._http = httpx.Client(base_url=self.engine_url, timeout=timeout_s)
        url = urlsplit(self.engine_url)
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._lease = LeaseGuard()
        self._tp: int | None = None
        self._staged: list[tuple[list[str], list[str], int, int]] = []
        self._plan: str | None = None
        self._stager: str | None = None  # the address the plan was staged at
        # In this pause: the sidecar will reset the prefix cache (pause, not pause_keeping_cache);
        # the stager emptied it after its write (nothing has run since: no flush call needed).
        self._flush_at_commit = self._cache_clean = False

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    # -- HTTP plumbing ---------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, *, timeout: float | None = None, ok: tuple[int, ...] = (200,), **kwargs: Any
    ) -> httpx.Response:
        try:
            resp = self._http.request(method, path, timeout=timeout or self.timeout_s, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(
                f"engine at {self.engine_url} does not answer {path}: {type(exc).__name__}: {exc}", path=path
            ) from exc
        if resp.status_code in (502, 503, 504) and resp.status_code not in ok:
            raise EngineUnavailableError(
                f"engine answered {path} with HTTP {resp.status_code}", path=path, status=resp.status_code
            )
        if resp.status_code not in ok:
            raise EngineRequestError(
                f"engine answered {path} with HTTP {resp.status_code}: {resp.text[:300]}",
                path=path,
                status=resp.status_code,
            )
        return resp

    def _tp_size(self) -> int:
        if self._tp is None:
            self._tp = int(self._request("GET", "/server_info").json().get("tp_size", 1))
        return self._tp

    def _version(self, timeout_s: float | None = None) -> int | None:
        return _version(self._request("GET", "/model_info", timeout=timeout_s).json().get("weight_version"))

    def _update(self, req: dict[str, Any], timeout: float, weight_version: str | None = None) -> None:
        body = {
            "serialized_named_tensors": [_request_tensor(req)] * self._tp_size(),
            "load_format": LOADER_PATH,
            "flush_cache": False,
            "weight_version": weight_version,
        }
        resp = self._request("POST", "/update_weights_from_tensor", json=body, timeout=timeout, ok=(200, 400))
        if resp.status_code != 200:
            raise EngineRequestError(
                f"update_weights_from_tensor failed: {resp.text[:300]}",
                path="/update_weights_from_tensor",
                status=resp.status_code,
            )

    def _set_label(self, label: str) -> None:
        # SGLang's weight_version, in the scheduler (its spans) and the tokenizer (answers); its
        # answer comes from the scheduler (paused here: at once). Never with abort_all_requests
        # true (its default). Waits timeout_s, not apply_timeout_s: it writes no weights.
        self._lease.ensure("POST /update_weight_version", self.take_lease)
        self._request("POST", "/update_weight_version", json={"new_version": label, "abort_all_requests": False})

    def _unverified(self) -> None:
        # Label the engine UNVERIFIED when its bits may not be the recorded version's; best
        # effort: an engine that cannot be reached is handled by the caller's error.
        try:
            self._set_label(UNVERIFIED)
        except Exception as exc:  # noqa: BLE001 - the caller raises its own error
            log.warning("could not label the engine %s: %s", UNVERIFIED, exc)

    def _session(self, calls: Any) -> Any:
        """Run ``calls()`` between ``/begin_weight_update`` and ``/end_weight_update`` (always ended).

        Raises:
            EngineUnavailableError: a session is open and this adapter does not hold the lease
                (another sidecar's may be under way: only the holder closes one left open).
        """
        resp = self._request("POST", "/begin_weight_update", json={}, ok=(200, 400), timeout=self.apply_timeout_s)
        if resp.status_code == 400:  # a session left open by a caller that died: its holder closes it, opens ours
            if not self._lease.live():
                raise EngineUnavailableError(
                    "a weight-update session is open on the engine and this sidecar does not hold its lease: "
                    "not closed (another sidecar may be writing); try again",
                    path="/begin_weight_update",
                    status=400,
                )
            self._request("POST", "/end_weight_update", json={}, ok=(200, 400), timeout=self.apply_timeout_s)
            self._request("POST", "/begin_weight_update", json={}, timeout=self.apply_timeout_s)
        try:
            return calls()
        finally:
            self._request("POST", "/end_weight_update", json={}, timeout=self.apply_timeout_s)

    def _answers(self, req_id: str) -> list[RankAnswer]:
        records = []
        for rank in range(self._tp_size()):
            path = self.record_dir / f"rank{rank}.json"
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                record = None
            if not isinstance(record, dict) or record.get("request") != req_id:
                raise EngineRequestError(
                    f"rank {rank} wrote no answer to request {req_id} in {path} (is the stitchboard loader registered "
                    f"with --custom-weight-loader {LOADER_PATH}?)",
                    path="/update_weights_from_tensor",
                )
            records.append(record.get("answer"))
        return parse_answers("stitchboard loader", records)

    def _call(
        self,
        op: str,
        args: dict[str, Any],
        *,
        timeout: float | None = None,
        version: int | None = None,
        instance: str | None = None,
        held: int | None = None,
    ) -> list[RankAnswer]:
        """One loader request on every rank in one session; with ``version``, SGLang's
        ``weight_version`` is set to it by the same call (SGLang sets it after any call its loader
        returns from: when a rank failed, or the engine is not ``instance``, a second call in the
        session sets it back to ``held``, or to :data:`UNVERIFIED` when the old bits may be gone).

        Args:
            held: the version SGLang records now, echoed in the ranks' state (None: asked here).

        Raises:
            the rank's typed error (see :func:`..rpc.raise_if_failed`); EngineStateError when the
            engine is not ``instance`` (nothing written; the version set on it is withdrawn).
        """
        timeout = timeout or self.apply_timeout_s
        req_id = uuid.uuid4().hex
        req = {"op": op, "id": req_id, "record_dir": str(self.record_dir), "held": held, "owner": self._lease.owner}
        req.update(args)

        def calls() -> list[RankAnswer]:
            if req["held"] is None:
                req["held"] = self._version()
            sent = time.monotonic()
            self._update(req, timeout, weight_version=None if version is None else str(version))
            try:
                answers = self._answers(req_id)
                if isinstance(req["owner"], str):
                    self._lease.note(lease_grant(answers, req["owner"], sent))
                if instance is not None and combine(answers).instance != instance:
                    raise EngineStateError(
                        f"the engine restarted (instance {instance} -> {combine(answers).instance}): nothing is "
                        "recorded on it",
                        held=None,
                        phase="idle",
                    )
                self._raise_if_failed(op, answers)
            except Exception as exc:
                if version is not None:
                    # the label goes back to what the engine held, or to UNVERIFIED when its bits may have
                    # changed; refused for want of the lease, nothing of this call changed the engine
                    # but the label (another sidecar's, now): it goes back as it was
                    kept = (
                        req["held"] is not None
                        and (instance is None or isinstance(exc, LeaseNotHeldError))
                        and not (isinstance(exc, ApplyFailedError) and not exc.details.get("restored"))
                    )
                    self._update(
                        {"op": "state", "id": uuid.uuid4().hex, "record_dir": str(self.record_dir)},
                        timeout,
                        weight_version=str(req["held"]) if kept else UNVERIFIED,
                    )
                raise
            return answers

        self.record_dir.mkdir(parents=True, exist_ok=True)
        return self._session(calls)

    def _raise_if_failed(self, what: str, answers: list[RankAnswer]) -> None:
        # :func:`..rpc.raise_if_failed`; a refusal for want of the lease: nothing is known to be held.
        try:
            raise_if_failed(what, answers)
        except LeaseNotHeldError:
            if self._lease.owner is not None:
                self._lease.refused(self._lease.owner)
            raise

    def _live_records(self) -> list[dict[str, Any]] | None:
        # The ranks' last records, if every one is of a process still running; else None.
        records = []
        for rank in range(self._tp_size()):
            try:
                record = json.loads((self.record_dir / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                return None
            if (
                not isinstance(record, dict)
                or not record.get("start")
                or process_start(int(record.get("pid", 0))) != record["start"]
            ):
                return None
            records.append(record)
        return records

    # -- EngineAdapter ---------------------------------------------------------------------------

    def health(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            return self._http.get("/health", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _ask_ranks(self, req: dict[str, Any], what: str) -> list[RankAnswer] | None:
        """``req`` to every rank's control socket; their answers, or None when rank 0's socket
        does not exist (no stitchboard code runs in the server yet).

        Raises:
            EngineUnavailableError: a socket broke off, timed out or answered garbage.
        """
        answers = []
        for rank in range(self._tp_size()):
            try:
                answers.append(ask(control_address(self._port, rank), req, self.timeout_s))
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                if rank == 0:
                    return None
                raise EngineUnavailableError(
                    f"{what}: rank {rank}'s control socket does not answer ({exc})", path="control_socket"
                ) from exc
            except (OSError, ValueError) as exc:
                raise EngineUnavailableError(
                    f"{what}: rank {rank}'s control socket failed: {type(exc).__name__}: {exc}", path="control_socket"
                ) from exc
        return parse_answers("stitchboard control socket", answers)

    def take_lease(self, owner: str, ttl_s: float) -> LeaseGrant:
        """Take the engine's lease for ``owner`` for ``ttl_s`` seconds, or renew it, on every rank
        (their control sockets; a server without them yet through one update call, which starts
        them); this adapter acts for ``owner`` from then on. A take refused by one rank is undone
        on the others.

        Raises:
            LeaseNotHeldError: another owner's lease is live (details ``holder``, ``expires_in_s``).
            EngineUnavailableError, EngineRequestError.
        """
        sent = time.monotonic()
        req = {"op": "lease", "owner": owner, "ttl_s": ttl_s}
        answers = self._ask_ranks(req, "taking the engine's lease")
        try:
            if answers is None:  # first contact: the loader answers by its records, then listens
                answers = self._call("lease", {"owner": owner, "ttl_s": ttl_s}, timeout=self.timeout_s * 6)
            refusal = lease_refusal(answers)
            if refusal is not None:
                granted = [rank for rank, a in enumerate(answers) if a.ok]
                if granted:  # the lease is held on every rank or none
                    self._ask_ranks({"op": "lease", "owner": owner, "release": True}, "undoing a partial take")
                raise refusal
            raise_if_failed("lease", answers)
        except LeaseNotHeldError:
            self._lease.refused(owner)
            raise
        grant = granted_lease(answers, owner, sent, "lease", "control_socket")
        self._lease.taken(grant, ttl_s)
        return grant

    def release_lease(self, owner: str) -> None:
        """End ``owner``'s lease on every rank at once (nothing to do on a server that runs no
        stitchboard code).

        Raises:
            EngineUnavailableError, EngineRequestError.
        """
        answers = self._ask_ranks({"op": "lease", "owner": owner, "release": True}, "releasing the engine's lease")
        if answers is not None:
            raise_if_failed("lease", answers)
        self._lease.released(owner)

    def known_lease(self) -> LeaseGrant | None:
        """See :meth:`~..base.EngineAdapter.known_lease`."""
        return self._lease.grant

    def state(self, timeout_s: float | None = None) -> EngineState:
        """SGLang's ``weight_version``; the loader's phase and instance (from its live records, or
        a ``state`` call when none is of a running process); phase ``paused`` when SGLang is
        paused (``/ready`` 503 while ``/health`` 200).

        Args:
            timeout_s: how long each HTTP call may wait for its answer, seconds (None: ``timeout_s``
                of the adapter; a loader ``state`` call gets six times it).

        Raises:
            EngineUnavailableError, EngineRequestError, EngineStateError (ranks disagree).
        """
        records = self._live_records()
        answers = (
            parse_answers("stitchboard loader", [r["answer"] for r in records])
            if records
            else self._call("state", {}, timeout=(timeout_s or self.timeout_s) * 6)
        )
        state = combine(answers)
        version = self._version(timeout_s)
        phase = state.phase
        if phase == "idle" and self._request("GET", "/ready", ok=(200, 503), timeout=timeout_s).status_code == 503:
            phase = "paused"
        return EngineState(version if phase in ("idle", "paused") else None, phase, state.instance)

    def pause(self) -> None:
        """``POST /pause_generation`` mode ``retract``: running requests are kept (retracted to the
        waiting queue, recomputed after the resume), never aborted. SGLang answers once it has
        passed the request on to the scheduler, not once the scheduler paused: an update call
        queues behind it, and the stager's write waits for the scheduler's paused loop (and
        empties the cache there, for :meth:`reset_prefix_cache`)."""
        self._lease.ensure("POST /pause_generation", self.take_lease)
        self._request("POST", "/pause_generation", json={"mode": "retract"})
        self._flush_at_commit, self._cache_clean = True, False

    def pause_keeping_cache(self) -> None:
        """As :meth:`pause`, the radix cache kept (a retract leaves it as it is): its presence tells
        the sidecar that a version-salted commit may skip ``/flush_cache`` (:mod:`stitchboard.sidecar.salt`)."""
        self.pause()
        self._flush_at_commit = False

    def output_counts(self) -> dict[str, int]:
        """Output tokens so far of the streamed requests the sidecar marked (``rid`` or
        ``custom_params`` holding ``stitch-<32 hex>``), by output key (:mod:`.token_counts`); rank 0's. Call it while
        paused.

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer or cannot count.
        """
        counts = (self._call("output_counts", {}, timeout=self.timeout_s * 6)[0].report or {}).get("output_tokens")
        if not isinstance(counts, dict):
            raise EngineRequestError(f"the loader answered no counts: {counts!r}", path="/update_weights_from_tensor")
        return {str(k): int(v) for k, v in counts.items()}

    def resume(self) -> None:
        """``POST /continue_generation``."""
        self._flush_at_commit = self._cache_clean = False
        self._lease.ensure("POST /continue_generation", self.take_lease)
        self._request("POST", "/continue_generation", json={})

    def stage_patches(self, steps: Sequence[tuple[Sequence[str], int, int]]) -> dict[str, Any]:
        """Stage the steps while the engine serves: at TP = 1, the loader's stager thread decodes
        and checks them on the live weights (base and target checksums; nothing written) and keeps
        the writes for :meth:`commit_staged`; else (TP > 1, or no stager) the files are checked
        here (sha256, patch format) and the engine stages them in the pause (see the module doc).

        Returns:
            ``files``, ``rpc_s``, ``in_engine`` (staged by the stager) and its report (``read_s``,
            ``check_s``, ``decode_s``, ``index_s``, ``stage_s``, ``elements``...).

        Raises:
            EngineStateError: the engine does not hold the first step's base version.
            ApplyRefusedError: the stager refused the steps (``cause``: ``BaseMismatch``,
                ``UnmappedTensor``...); nothing written. PatchFormatError: a file is not a
                valid patch. OSError: a file cannot be read.
        """
        t = time.perf_counter()
        self._staged, self._plan, self._stager = [], None, None
        held = self._version()
        if steps and held != steps[0][1]:
            raise EngineStateError(
                f"the engine holds version {held}, the update is from version {steps[0][1]}", held=held, phase="idle"
            )
        address = control_address(self._port, 0) if self._tp_size() == 1 else None
        staged = []
        for paths, start, end in steps:
            digests = []
            for path in paths:
                data = Path(path).read_bytes()
                if not address:
                    read_patch(data, what=os.path.basename(path))
                digests.append(hashlib.sha256(data).hexdigest())
            staged.append((list(paths), digests, start, end))
        report: dict[str, Any] = {"files": sum(len(s[0]) for s in staged), "in_engine": False}
        if isinstance(address, str):
            plan = uuid.uuid4().hex
            req = {
                "op": "stage",
                "id": plan,
                "held": held,
                "owner": self._lease.ensure("staging an update", self.take_lease),
                "steps": [{"paths": p, "digests": d} for p, d, _, _ in staged],
            }
            try:
                answer = ask(address, req, self.apply_timeout_s)
            except (OSError, ValueError) as exc:  # a stager that is gone: the engine stages in the pause
                log.warning(
                    "the engine's stager at %r did not answer (%s): the update is staged in the pause", address, exc
                )
            else:
                answers = parse_answers("stitchboard stager", [answer])
                self._raise_if_failed("stage", answers)
                self._plan, self._stager = plan, address
                report.update(answers[0].report or {}, in_engine=True)
        self._staged = staged
        return {**report, "rpc_s": time.perf_counter() - t}

    def commit_staged(self, to_version: int) -> dict[str, Any]:
        """Apply the staged steps (engine paused) and record ``to_version``: the stager's plan,
        when it is still current, written by the stager (each chunk read back) and the version
        set by ``/update_weight_version``; else the steps staged, written and verified in the
        pause by one loader call that records the version itself.

        Returns:
            The loader's report (see :meth:`apply_patch`), ``committed`` (written by the stager)
            and seconds ``rpc_s``; after the stager's write also ``flushed`` (the radix cache
            emptied, after :meth:`pause`), seconds ``park_s`` (until the scheduler thread was
            held in its paused loop), ``flush_s``, ``stager_s`` (its call) and ``label_s``.

        Raises:
            EngineStateError: nothing staged for ``to_version``, or the engine does not hold the
                first step's base. ApplyRefusedError / ApplyFailedError: as :meth:`apply_patch`.
            EngineUnavailableError: the stager broke off while writing (the engine may hold part
                of the update: apply a snapshot).
        """
        staged, plan, address, self._staged, self._plan, self._stager = (
            self._staged,
            self._plan,
            self._stager,
            [],
            None,
            None,
        )
        if not staged or staged[-1][3] != to_version:
            raise EngineStateError(f"no staged update ends at version {to_version}", held=None, phase="idle")
        if plan is not None and address is not None:
            report = self._commit_in_stager(address, plan, staged[0][2], to_version)
            if report is not None:
                return report
        return {**self._apply(staged), "committed": False}

    def _commit_in_stager(self, address: str, plan: str, start: int, end: int) -> dict[str, Any] | None:
        # The stager writes plan ``plan`` (start -> end); None when it does not hold it (nothing written).
        t = time.perf_counter()
        req = {
            "op": "commit",
            "id": uuid.uuid4().hex,
            "owner": self._lease.ensure("writing the staged update", self.take_lease),
            "plan": plan,
            "what": f"{start}->{end}",
            "held": start,
            "flush": self._flush_at_commit,
            "record_dir": str(self.record_dir),
        }
        try:
            answer = ask(address, req, self.apply_timeout_s)
        except (ConnectionRefusedError, FileNotFoundError) as exc:  # never reached: nothing written
            log.warning(
                "the engine's stager at %r is gone (%s): versions %d->%d are applied by an update call",
                address,
                exc,
                start,
                end,
            )
            return None
        except (OSError, ValueError) as exc:
            self._unverified()  # the bits may be anything between the two versions
            raise EngineUnavailableError(
                f"the engine's stager at {address!r} broke off writing versions {start}->{end} ({type(exc).__name__}: "
                f"{exc}): the engine may hold part of them",
                path="stage_socket",
            ) from exc
        answers = parse_answers("stitchboard stager", [answer])
        report = answers[0].report or {}
        if answers[0].ok and report.get("committed") is False:
            log.warning(
                "the engine's stager did not write versions %d->%d (%s): an update call applies them",
                start,
                end,
                report.get("why"),
            )
            return None
        try:
            self._raise_if_failed("apply", answers)
        except ApplyFailedError as exc:
            if not exc.details.get("restored"):
                self._unverified()
            raise
        stager_s = time.perf_counter() - t
        try:
            self._set_label(str(end))
        except Exception:  # the engine holds version end's bits under version start's label
            self._unverified()
            raise
        self._cache_clean = bool(report.get("flushed"))
        return {
            **report,
            "stager_s": stager_s,
            "label_s": time.perf_counter() - t - stager_s,
            "rpc_s": time.perf_counter() - t,
        }

    def _apply(self, steps: list[tuple[list[str], list[str], int, int]]) -> dict[str, Any]:
        start, end = steps[0][2], steps[-1][3]
        self._lease.ensure("applying an update", self.take_lease)
        held = self._version()
        if held != start:
            raise EngineStateError(
                f"the engine holds version {held}, the update is from version {start}", held=held, phase="idle"
            )
        t = time.perf_counter()
        args = {"steps": [{"paths": p, "digests": d} for p, d, _, _ in steps], "what": f"{start}->{end}"}
        answers = self._call("apply", args, version=end, held=held)
        return {**(answers[0].report or {}), "rpc_s": time.perf_counter() - t}

    def apply_patch(self, handoff_path: str | Sequence[str], from_version: int, to_version: int) -> dict[str, Any]:
        """Apply the patch file(s) of one version in place (engine paused) and record ``to_version``.

        Returns:
            The loader's report (rank 0): ``bytes``, ``tensors``, ``elements``, ``rank_elements``,
            seconds ``read_s``, ``check_s``, ``decode_s``, ``write_s``, ``verify_s``; plus ``rpc_s``.

        Raises:
            ApplyRefusedError: refused before any write (``cause``: ``BaseMismatch``,
                ``PatchFormatError``, ``UnmappedTensor``...). EngineStateError: the engine does not
                hold ``from_version``. ApplyFailedError: failed after writing (``restored``).
        """
        paths = [handoff_path] if isinstance(handoff_path, str) else list(handoff_path)
        return self._apply([(paths, [_sha256(p) for p in paths], from_version, to_version)])

    def load_snapshot(
        self,
        paths: Sequence[str],
        version: int,
        checksums: dict[str, str] | None = None,
        layouts: Mapping[str, Layout] | None = None,
    ) -> dict[str, Any]:
        """Load snapshot shards in place through the loader and record ``version``.

        Args:
            paths: the shard files in the hand-off folder.
            version: the version they hold.
            checksums: the manifest's tensor checksums (``VersionManifest.checksums()``: xxh3-128, or
                xxh3_128_parts over ``layouts[name]``); None: computed from the files.
            layouts: part layouts of the tensors published in parts (``VersionManifest.layouts()``).

        Raises:
            ApplyRefusedError: refused before any write; ApplyFailedError (``restored`` False).
        """
        if checksums is None:
            checksums = snapshot_checksums(paths)
        self._lease.ensure("loading a snapshot", self.take_lease)
        t = time.perf_counter()
        args = {
            "paths": list(paths),
            "digests": [_sha256(p) for p in paths],
            "checksums": checksums,
            "layouts": dict(layouts or {}),
            "what": f"snapshot->{version}",
        }
        answers = self._call("load_snapshot", args, version=version)
        return {**(answers[0].report or {}), "rpc_s": time.perf_counter() - t}

    def set_version(self, version: int, base: int | None = None) -> None:
        """Record ``version`` if the engine records ``base`` now (None: no version).

        Raises:
            EngineStateError: the engine records another version than ``base``, is not idle, or
                restarted while being recorded (then it is labelled unverified); nothing recorded.
        """
        self._lease.ensure("recording a version", self.take_lease)
        state = self.state()
        if state.phase not in ("idle", "paused") or state.version != base:
            raise EngineStateError(
                f"the engine records version {state.version} (phase {state.phase}), not {base}: version {version} is "
                "not recorded",
                held=state.version,
                phase=state.phase,
            )
        self._call("label", {}, version=version, instance=state.instance)

    def checksums(self, names: Sequence[str], layouts: Mapping[str, Layout] | None = None) -> dict[str, str]:
        """xxh3-128 of the named checkpoint tensors as the engine holds them, or xxh3_128_parts over
        ``layouts[name]`` for a name ``layouts`` lists."""
        return self._call("checksums", {"names": list(names), "layouts": dict(layouts or {})})[0].checksums or {}

    def reset_prefix_cache(self) -> None:
        """``POST /flush_cache`` (succeeds while paused, retracted requests waiting); no call when
        the stager emptied the cache after its write in this pause (nothing ran since to fill it).

        Raises:
            EngineRequestError: the engine could not flush (requests running: not paused).
        """
        if self._cache_clean:
            return
        self._lease.ensure("POST /flush_cache", self.take_lease)
        self._request("POST", "/flush_cache")
