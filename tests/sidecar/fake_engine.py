"""A fake engine for the sidecar tests: the adapter seam plus a tiny OpenAI-compatible server.

Its "weights" are a dict of writable :class:`RawTensor`; patches are really applied with
:func:`stitchboard.proto.apply.apply_patch` and snapshots really loaded, so a test can compare
the engine's bits with the trainer's view. Generation is token by token (``token_delay_s``
apart), and every token names a fingerprint of the weights it was produced with. Pausing
(vLLM's ``mode=keep``) stops token production without dropping requests; resuming continues
them. The server runs uvicorn in a thread on a free loopback port.

It serves LoRA adapters too (:class:`~stitchboard.sidecar.engines.base.ServesAdapters`): a load
reads the PEFT folder (``adapter_model.safetensors`` + ``adapter_config.json``), checks every
tensor's xxh3-128 against the checksums given and keeps a copy of the tensors (the folder may go),
so a test compares what the engine holds with what was published; at most ``adapter_slots_n``
at once (a load beyond them is refused, never an eviction). A request whose ``model`` names a
loaded adapter gets tokens that also name a fingerprint of that adapter's bits; one naming
neither ``fake`` nor a loaded adapter is answered 404, as vLLM does.

The engine's lease is the real one (:class:`stitchboard.sidecar.engines.lease.Lease`): every
state-changing seam method acts for the owner of the seam's last :meth:`FakeEngine.take_lease`
and raises ``LeaseNotHeldError`` (nothing done, as the real adapter and engine code) without a
live lease. A second sidecar on the same engine gets its own seam: :meth:`FakeEngine.seam`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.proto.decode import read_patch
from stitchboard.proto.parts import Layout, tensor_checksum
from stitchboard.sidecar.engines.base import EngineState, LeaseGrant
from stitchboard.sidecar.engines.lease import Lease
from stitchboard.sidecar.errors import (
    AdapterLoadError,
    ApplyRefusedError,
    EngineStateError,
    EngineUnavailableError,
    LeaseNotHeldError,
)

CONTROL_ROUTES = [
    "/pause",
    "/stitch/pause",
    "/resume",
    "/collective_rpc",
    "/update_weights",
    "/start_weight_update",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
]


def fingerprint(view: dict[str, RawTensor]) -> str:
    """Short digest of a whole view's bits."""
    h = xxhash.xxh3_64()
    for name in sorted(view):
        h.update(name.encode())
        h.update(checksum(view[name]).encode())
    return h.hexdigest()[:12]


def _sums(view: Mapping[str, RawTensor], names: list[str], layouts: Mapping[str, Layout] | None) -> dict[str, str]:
    """Each named tensor's xxh3-128, or its xxh3_128_parts over ``layouts[name]`` (a tensor published in parts)."""
    parted = layouts or {}
    return {n: tensor_checksum(view[n].bits, view[n].shape, parted.get(n)) for n in names}


def copy_view(view: dict[str, RawTensor]) -> dict[str, RawTensor]:
    """Writable copy of a view."""
    return {n: RawTensor(t.dtype, tuple(t.shape), np.array(t.bits, copy=True)) for n, t in view.items()}


class FakeEngine:
    """Implements the engine adapter seam in process and serves HTTP (start with :meth:`serve`).

    Attributes:
        weights: name -> writable tensor.
        instance: the engine's instance id (new at every :meth:`restart`, as a real engine's).
        version, phase: what :meth:`state` reports (phase ``idle``, ``applying``, ``loading``
            or ``failed`` as the real worker extension; ``paused`` when idle and paused, as the adapter).
        paused: whether the engine is paused (in-flight requests frozen, kept).
        calls: adapter calls in order, as (method, args) tuples.
        http_control_calls: control routes the HTTP server received (the sidecar must never forward any).
        aborted: requests whose client went away before they completed.
        adapters: loaded adapter name -> its tensors (copies, PEFT names).
        adapter_configs: loaded adapter name -> its ``adapter_config.json``.
        adapter_slots_n: how many adapters the engine holds at once.
        fail_adapter_loads: number of next :meth:`load_adapter` calls the engine refuses (nothing loaded).
        adapter_requests: the ``model`` of every completion request the server received, in order.
        started: completion requests whose body the server has read (they reached the engine).
        first_tokens: completion requests that have produced their first token.
        fail_apply: number of next patch writes (:meth:`apply_patch`, :meth:`commit_staged`)
            that corrupt weights then raise.
        fail_snapshot: number of next :meth:`load_snapshot` calls that raise.
        refuse_stage: number of next :meth:`stage_patches` calls that raise (nothing written).
        refuse_checksums: number of next :meth:`checksums` calls refused for another reason than a name.
        refuse_versions: versions the engine refuses as the target of an update, before any
            write (:meth:`stage_patches`: its last step; :meth:`apply_patch`; :meth:`load_snapshot`),
            as a real engine refuses a version naming a tensor it lacks (``UnmappedTensor``).
        refuse_cause: the cause those refusals name (``UnmappedTensor``: permanent for the
            sidecar; e.g. ``BaseMismatch``: transient).
        refuse_commit: number of next :meth:`commit_staged` calls refused before any write.
        staged_names: per :meth:`stage_patches` call, the tensor names its patch files touch.
        write_s_per_tensor: time each tensor write takes (patches and snapshots), seconds.
        break_stream_after: when set, a streamed answer breaks off (the connection drops, as
            when the engine is killed) after that many tokens.
        staged: the steps :meth:`stage_patches` kept for :meth:`commit_staged`.
        unreachable: while True, :meth:`state` and :meth:`health` fail as for an engine that does
            not answer (the process and its weights are kept).
        state_delay_s: how long :meth:`state` keeps its caller waiting, as an engine busy with a
            long step does; past the call's ``timeout_s`` it fails as a read timeout would.
        fail_resume: while True, :meth:`resume` fails as for an engine that went away.
        lease: the engine's lease (shared by every seam of this engine).
        changes: ``(method, owner)`` of every state-changing seam call the lease let through.
        lease_refusals: ``(method, owner)`` of every state-changing seam call refused for want of
            the lease (a sidecar must make none: it stops before the call).
    """

    def __init__(
        self, weights: dict[str, RawTensor] | None = None, version: int | None = None, *, token_delay_s: float = 0.01
    ) -> None:
        self.weights = copy_view(weights or {})
        self.version = version
        self.instance = uuid.uuid4().hex
        self.phase = "idle"
        self.paused = False
        self.token_delay_s = token_delay_s
        self.calls: list[tuple[str, tuple]] = []
        self.http_control_calls: list[str] = []
        self.aborted = 0
        self.completed = 0
        self.started = 0
        self.first_tokens = 0
        self.fail_apply = 0
        self.fail_snapshot = 0
        self.refuse_stage = 0
        self.refuse_checksums = 0
        self.refuse_versions: set[int] = set()
        self.refuse_cause = "UnmappedTensor"
        self.refuse_commit = 0
        self.staged_names: list[list[str]] = []
        self.write_s_per_tensor = 0.0
        self.break_stream_after: int | None = None
        self.unreachable = False
        self.state_delay_s = 0.0
        self.fail_resume = False
        self.staged: list[tuple[list[str], int, int]] | None = None
        self.prefix_cache_resets = 0
        self.lease = Lease()
        self.changes: list[tuple[str, str]] = []
        self.lease_refusals: list[tuple[str, str | None]] = []
        self._owner: str | None = None  # the owner this seam acts for (its last take)
        self._grant: LeaseGrant | None = None
        self._seam_lock = threading.RLock()  # a seam's call runs with its owner swapped in
        self._running = threading.Event()
        self._running.set()
        self._lock = threading.Lock()
        self.fp = fingerprint(self.weights)
        self.url = ""
        self.adapters: dict[str, dict[str, RawTensor]] = {}
        self.adapter_configs: dict[str, dict] = {}
        self.adapter_slots_n = 3
        self.fail_adapter_loads = 0
        self.adapter_requests: list[str | None] = []

    # -- adapter seam --------------------------------------------------------------------------

    def health(self) -> bool:
        self.calls.append(("health", ()))
        return not self.unreachable

    def take_lease(self, owner: str, ttl_s: float) -> LeaseGrant:
        """Take or renew the lease for ``owner`` (the real lease's rules); this seam acts for it."""
        if self.unreachable:
            raise EngineUnavailableError(
                "engine at the fake does not answer stitch_lease (test)", path="/collective_rpc"
            )
        sent = time.monotonic()
        with self._seam_lock:
            try:
                view = self.lease.take(owner, ttl_s)
            except LeaseNotHeldError:
                if self._owner == owner:
                    self._grant = None
                raise
            self._owner, self._grant = owner, LeaseGrant(owner, sent + view["expires_in_s"])
            return self._grant

    def release_lease(self, owner: str) -> None:
        """End ``owner``'s lease."""
        with self._seam_lock:
            self.lease.release(owner)
            if self._owner == owner:
                self._owner, self._grant = None, None

    def known_lease(self) -> LeaseGrant | None:
        """The seam's last grant."""
        with self._seam_lock:
            return self._grant

    def _require_lease(self, method: str) -> None:
        """Before a state-changing call: the seam's owner holds a live lease (else refused, nothing done)."""
        with self._seam_lock:
            owner = self._owner
        try:
            if owner is None:
                raise LeaseNotHeldError(f"{method}: no lease taken (test)", holder=None, expires_in_s=None, owner=None)
            self.lease.require(owner, method)
        except LeaseNotHeldError:
            self.lease_refusals.append((method, owner))
            raise
        self.changes.append((method, owner))

    def seam(self) -> FakeSeam:
        """Another sidecar's adapter on this engine: the same engine, its own lease owner."""
        return FakeSeam(self)

    def state(self, timeout_s: float | None = None) -> EngineState:
        if self.state_delay_s:
            time.sleep(min(self.state_delay_s, timeout_s if timeout_s is not None else self.state_delay_s))
            if timeout_s is not None and self.state_delay_s > timeout_s:
                raise EngineUnavailableError(
                    f"engine at the fake does not answer stitch_state: ReadTimeout after {timeout_s:g} s (test)",
                    path="/collective_rpc",
                )
        if self.unreachable:
            raise EngineUnavailableError(
                "engine at the fake does not answer stitch_state (test)", path="/collective_rpc"
            )
        return EngineState(
            self.version, "paused" if self.phase == "idle" and self.paused else self.phase, self.instance
        )  # type: ignore[arg-type]

    def restart(self, weights: dict[str, RawTensor]) -> None:
        """What a restarted engine is: a new instance holding ``weights`` (its boot checkpoint),
        recording no version, idle and not paused, with nothing staged."""
        with self._lock:
            self.weights = copy_view(weights)
            self.fp = fingerprint(self.weights)
            self.version, self.phase, self.paused, self.staged = None, "idle", False, None
            self.instance = uuid.uuid4().hex
            self.adapters, self.adapter_configs = {}, {}
            self._running.set()

    def pause(self) -> None:
        self._require_lease("pause")
        self.calls.append(("pause", ()))
        self._running.clear()
        self.paused = True

    def resume(self) -> None:
        self._require_lease("resume")
        self.calls.append(("resume", ()))
        if self.fail_resume:
            raise EngineUnavailableError(
                "engine at the fake does not answer /continue_generation (test)", path="/continue_generation"
            )
        self.paused = False
        self._running.set()

    def apply_patch(self, handoff_path: str | list[str], from_version: int, to_version: int) -> dict:
        """Apply the patch file(s) of one version, as one update."""
        self._require_lease("apply_patch")
        paths = [handoff_path] if isinstance(handoff_path, str) else list(handoff_path)
        self.calls.append(("apply_patch", (tuple(paths), from_version, to_version)))
        with self._lock:
            self._refuse_version(to_version)
            return {"elements": self._apply(paths, from_version, to_version)}

    def stage_patches(self, steps: list[tuple[list[str], int, int]]) -> dict:
        """Check the first step starts at the held version and keep the steps for :meth:`commit_staged`."""
        self._require_lease("stage_patches")
        steps = [(list(paths), start, end) for paths, start, end in steps]
        self.calls.append(("stage_patches", tuple((tuple(paths), start, end) for paths, start, end in steps)))
        with self._lock:
            if self.phase != "idle" or self.version != steps[0][1]:
                raise RuntimeError(
                    f"engine holds version {self.version} in phase {self.phase}, the update is from {steps[0][1]}"
                )
            if self.refuse_stage:
                self.refuse_stage -= 1
                raise RuntimeError("injected staging refusal")
            self._refuse_version(steps[-1][2])
            self.staged_names.append(
                sorted({n for paths, _, _ in steps for p in paths for n in read_patch(Path(p).read_bytes()).entries})
            )
            self.staged = steps
        return {"steps": len(steps)}

    def commit_staged(self, to_version: int) -> dict:
        """Apply the staged steps in order (the real worker writes them at once)."""
        self._require_lease("commit_staged")
        self.calls.append(("commit_staged", (to_version,)))
        with self._lock:
            if self.refuse_commit:
                self.refuse_commit -= 1
                self.staged = None
                raise ApplyRefusedError(
                    "stitch_commit_staged refused, nothing written: EngineStateError: the staged update was dropped "
                    "(test)",
                    cause="EngineStateError",
                    held=self.version,
                )
            steps, self.staged = self.staged, None
            if not steps or steps[-1][2] != to_version:
                raise RuntimeError(f"nothing staged ends at version {to_version}")
            return {"elements": sum(self._apply(paths, start, end) for paths, start, end in steps)}

    def _refuse_version(self, version: int) -> None:
        if version in self.refuse_versions:
            raise ApplyRefusedError(
                f"version {version} refused, nothing written: {self.refuse_cause}: the engine refuses it (test)",
                cause=self.refuse_cause,
                held=self.version,
            )

    def _apply(self, paths: list[str], from_version: int, to_version: int) -> int:
        if self.phase != "idle" or self.version != from_version:
            raise RuntimeError(
                f"engine holds version {self.version} in phase {self.phase}, the patch is from {from_version}"
            )
        self.phase = "applying"
        if self.fail_apply:
            self.fail_apply -= 1
            name = min(self.weights)
            self.weights[name].bits[:4] ^= 0x5A5A  # a partial write, then a failure that could not restore
            self.version, self.phase = None, "failed"
            raise RuntimeError("injected apply failure")
        try:
            results = [apply_patch(self.weights, read_patch(Path(p).read_bytes())) for p in paths]
            written = sum(r.elements_written for r in results)
            time.sleep(self.write_s_per_tensor * sum(r.tensors_written for r in results))
        finally:
            self.phase = "idle"  # the codec refuses before writing, or undoes its writes
        self.fp = fingerprint(self.weights)
        self.version, self.phase = to_version, "idle"
        return written

    def load_snapshot(
        self,
        paths: list[str],
        version: int,
        checksums: dict[str, str] | None = None,
        layouts: Mapping[str, Layout] | None = None,
    ) -> dict:
        self._require_lease("load_snapshot")
        self.calls.append(("load_snapshot", (tuple(paths), version)))
        with self._lock:
            self._refuse_version(version)
            self.phase, self.version = "loading", None
            if self.fail_snapshot:
                self.fail_snapshot -= 1
                self.phase = "failed"
                raise RuntimeError("injected snapshot failure")
            loaded = {}
            for path in paths:
                loaded.update(read_safetensors(path)[1])
            if checksums is not None and checksums != _sums(loaded, list(loaded), layouts):
                self.phase = "failed"
                raise RuntimeError("snapshot does not match the checksums")
            self.weights = copy_view(loaded)
            time.sleep(self.write_s_per_tensor * len(loaded))
            self.fp = fingerprint(self.weights)
            self.version, self.phase = version, "idle"
        return {"tensors": len(loaded)}

    def set_version(self, version: int, base: int | None = None) -> None:
        self._require_lease("set_version")
        self.calls.append(("set_version", (version,)))
        if self.phase == "failed":
            raise RuntimeError("engine in phase failed: load a snapshot")
        if self.version != base:
            raise EngineStateError(
                f"the engine records version {self.version}, not {base}", held=self.version, phase=self.phase
            )
        self.version = version

    def checksums(self, names: list[str], layouts: Mapping[str, Layout] | None = None) -> dict[str, str]:
        self.calls.append(("checksums", (tuple(names),)))
        if self.refuse_checksums:
            self.refuse_checksums -= 1
            raise ApplyRefusedError(
                "stitch_checksums refused, nothing written: EngineStateError: busy (test)", cause="EngineStateError"
            )
        unknown = sorted(set(names) - set(self.weights))
        if unknown:
            raise ApplyRefusedError(
                f"stitch_checksums refused, nothing written: UnmappedTensor: {unknown[:3]}",
                cause="UnmappedTensor",
                name=unknown[0],
            )
        return _sums(self.weights, names, layouts)

    def reset_prefix_cache(self) -> None:
        self._require_lease("reset_prefix_cache")
        self.calls.append(("reset_prefix_cache", ()))
        self.prefix_cache_resets += 1

    # -- ServesAdapters ------------------------------------------------------------------------

    def adapter_slots(self) -> int:
        return self.adapter_slots_n

    def base_names(self) -> list[str]:
        return sorted(self.weights)

    def load_adapter(self, name: str, folder: str, checksums: Mapping[str, str]) -> None:
        """Load the PEFT folder under ``name``, verified against ``checksums`` (refused: nothing loaded)."""
        self._require_lease("load_adapter")
        self.calls.append(("load_adapter", (name,)))
        with self._lock:
            if self.fail_adapter_loads:
                self.fail_adapter_loads -= 1
                raise AdapterLoadError(
                    f"adapter {name}: the engine refused the folder (test)", adapter=name, cause="EngineRefused"
                )
            if name not in self.adapters and len(self.adapters) >= self.adapter_slots_n:
                raise AdapterLoadError(
                    f"adapter {name}: all {self.adapter_slots_n} slots hold adapters", adapter=name, cause="NoFreeSlot"
                )
            config = json.loads((Path(folder) / "adapter_config.json").read_text())
            tensors = copy_view(read_safetensors(Path(folder) / "adapter_model.safetensors")[1])
            got = {n: checksum(t) for n, t in tensors.items()}
            if got != dict(checksums):
                bad = sorted(n for n in set(got) | set(checksums) if got.get(n) != checksums.get(n))
                raise AdapterLoadError(
                    f"adapter {name}: loaded tensors differ from the checksums ({bad[:3]})",
                    adapter=name,
                    cause="ChecksumMismatch",
                    name=bad[0],
                )
            self.adapters[name], self.adapter_configs[name] = tensors, config

    def unload_adapter(self, name: str) -> None:
        self._require_lease("unload_adapter")
        self.calls.append(("unload_adapter", (name,)))
        with self._lock:
            self.adapters.pop(name, None)
            self.adapter_configs.pop(name, None)

    def loaded_adapters(self) -> list[str]:
        return sorted(self.adapters)

    def count(self, method: str) -> int:
        """How many times the sidecar called ``method``."""
        return sum(1 for m, _ in self.calls if m == method)

    # -- HTTP server ---------------------------------------------------------------------------

    async def _token(self, i: int, adapter: str | None = None) -> str:
        while not self._running.is_set():
            await asyncio.sleep(0.002)
        await asyncio.sleep(self.token_delay_s)
        while not self._running.is_set():  # a pause that began while this token was computed
            await asyncio.sleep(0.002)
        if i == 0:
            self.first_tokens += 1
        if adapter is None:
            return f" t{i}@{self.fp}"
        tensors = self.adapters.get(adapter)
        if tensors is None:  # unloaded under a running request: vLLM's engine would fail the request
            raise RuntimeError(f"adapter {adapter} was unloaded while a request used it (test)")
        return f" t{i}@{self.fp}+{adapter}:{fingerprint(tensors)}"

    def app(self) -> FastAPI:
        app = FastAPI()
        engine = self

        async def generate(request: Request, chat: bool) -> object:
            body = await request.json()
            model = body.get("model")
            engine.adapter_requests.append(model)
            adapter = model if model in engine.adapters else None
            if model not in (None, "fake") and adapter is None:
                return JSONResponse({"error": {"message": f"The model `{model}` does not exist."}}, status_code=404)
            engine.started += 1
            n = int(body.get("max_tokens", 4))
            rid = f"cmpl-{time.monotonic_ns()}"
            obj = "chat.completion" if chat else "text_completion"
            if body.get("stream"):

                async def events():
                    try:
                        for i in range(n):
                            if engine.break_stream_after is not None and i >= engine.break_stream_after:
                                raise ConnectionAbortedError("the fake engine is killed mid-stream (test)")
                            text = await engine._token(i, adapter)
                            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                            yield f"data: {json.dumps({'id': rid, 'object': obj + '.chunk' if chat else obj, 'created': 1, 'model': 'fake', 'choices': [choice]})}\n\n"  # noqa: E501
                        yield "data: [DONE]\n\n"
                        engine.completed += 1
                    except asyncio.CancelledError:
                        engine.aborted += 1
                        raise

                return StreamingResponse(events(), media_type="text/event-stream")
            text = ""
            for i in range(n):
                if await request.is_disconnected():
                    engine.aborted += 1
                    return PlainTextResponse("aborted", status_code=499)
                text += await engine._token(i, adapter)
            engine.completed += 1
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            )
            return JSONResponse(
                {"id": rid, "object": obj, "created": 1, "model": "fake", "echo_body": body, "choices": [choice]}
            )

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await generate(request, chat=True)

        @app.get("/v1/models")
        async def models():
            listed = [{"id": "fake", "object": "model"}]
            listed += [{"id": n, "object": "model", "parent": "fake", "root": "/dev/shm"} for n in engine.adapters]
            return {"object": "list", "data": listed}

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            return {"tokens": [ord(c) for c in body.get("prompt", "")]}

        @app.get("/server_info")
        async def server_info():
            engine.http_control_calls.append("/server_info")
            return {"config": "secret", "env": {"HF_TOKEN": "x"}}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(f"fake_engine_completed_total {engine.completed}\n")

        for route in CONTROL_ROUTES:

            async def control(request: Request, route: str = route):
                engine.http_control_calls.append(route)
                return {"ok": True}

            app.add_api_route(route, control, methods=["POST", "GET"])
        return app


#: The seam methods that act for a lease owner (a :class:`FakeSeam` swaps its owner in for them).
OWNED_METHODS = frozenset(
    {
        "take_lease", "release_lease", "known_lease", "pause", "resume", "apply_patch", "stage_patches",
        "commit_staged", "load_snapshot", "set_version", "reset_prefix_cache", "load_adapter", "unload_adapter",
    }
)  # fmt: skip


class FakeSeam:
    """A second sidecar's adapter on a :class:`FakeEngine`: every attribute is the engine's, but
    the methods of :data:`OWNED_METHODS` act for this seam's own lease owner (its last take)."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._owner: str | None = None
        self._grant: LeaseGrant | None = None

    def __getattr__(self, name: str):
        attr = getattr(self._engine, name)
        if name not in OWNED_METHODS:
            return attr
        engine = self._engine

        def call(*args, **kwargs):
            with engine._seam_lock:
                saved = engine._owner, engine._grant
                engine._owner, engine._grant = self._owner, self._grant
                try:
                    return attr(*args, **kwargs)
                finally:
                    self._owner, self._grant = engine._owner, engine._grant
                    engine._owner, engine._grant = saved

        return call
