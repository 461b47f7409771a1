"""vLLM's LoRA adapter calls: :class:`~..base.ServesAdapters` for :class:`.adapter.VllmEngine`
(runs in the sidecar; ``docs/reference/adapter-engines.md``).

An adapter is loaded by vLLM's own loader from a PEFT folder on the sidecar's memory-backed
hand-off folder: ``POST /v1/load_lora_adapter {lora_name, lora_path}`` (the engine started with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, :func:`.launch.vllm_command`), no
pause. The worker extension then checks every slot the adapter fills against the version's
checksums and pins it (``stitch_adapter_verify``, :mod:`.lora`), so vLLM can never evict it
silently: unpinned, a load beyond ``max_cpu_loras`` answers 200 and evicts the oldest adapter,
and a later request for it re-reads its folder. Any failure drops the adapter again, from the
API server (``/v1/unload_lora_adapter``, which alone leaves the worker's slot taken) and from the
worker (``stitch_adapter_remove``, which frees it); the adapters loaded before are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from ...errors import AdapterLoadError, ApplyRefusedError, EngineRequestError, EngineUnavailableError, SidecarError
from ..base import LeaseGuard

if TYPE_CHECKING:
    from ..base import LeaseGrant
    from ..rpc import RankAnswer

log = logging.getLogger("stitchboard.sidecar.engines.vllm.lora_calls")

#: vLLM's routes that load and unload an adapter by name (API server).
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def _slot_refusal(text: str) -> bool:
    """Whether vLLM's error text says every slot is held by a pinned adapter (``LRUCache.popitem``,
    ``LoRAModelManager.activate_adapter``)."""
    return "All items are pinned" in text or "No free" in text


class LoraCalls:
    """The :class:`~..base.ServesAdapters` methods of :class:`.adapter.VllmEngine` (a mixin over its
    HTTP client, lease guard and worker-extension calls)."""

    _http: httpx.Client
    _lease: LeaseGuard
    engine_url: str
    apply_timeout_s: float

    if TYPE_CHECKING:

        def _checked(self, method: str, args: dict[str, Any], timeout: float | None = None) -> list[RankAnswer]: ...

        def _owned(self, method: str, args: dict[str, Any], timeout: float | None = None) -> list[RankAnswer]: ...

        def take_lease(self, owner: str, ttl_s: float) -> LeaseGrant: ...

    def _lora_route(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """``POST`` vLLM's ``path`` with the lease live (renewed first when due); (status, body text).

        Raises:
            EngineUnavailableError: the engine does not answer. LeaseNotHeldError: no live lease.
        """
        self._lease.ensure(f"POST {path}", self.take_lease)
        try:
            resp = self._http.post(path, json=body, timeout=self.apply_timeout_s)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(
                f"engine at {self.engine_url} does not answer {path}: {type(exc).__name__}: {exc}", path=path
            ) from exc
        return resp.status_code, resp.text

    def _adapters(self) -> dict[str, Any]:
        report = self._checked("stitch_adapters", {})[0].report
        if not isinstance(report, dict) or not isinstance(report.get("loaded"), dict):
            raise EngineRequestError(f"stitch_adapters answered no adapters: {report!r}", path="/collective_rpc")
        return report

    def adapter_slots(self) -> int:
        """``min(max_loras, max_cpu_loras)`` of the engine (0: started without ``--enable-lora``).

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer.
        """
        return int(self._adapters()["slots"])

    def loaded_adapters(self) -> list[str]:
        """The adapter names the engine's worker holds now, sorted (rank 0).

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer.
        """
        return sorted(self._adapters()["loaded"])

    def base_names(self) -> list[str]:
        """The base model's checkpoint names as the engine holds them (``stitch_base_names``).

        Raises:
            ApplyRefusedError: a runtime parameter has no checkpoint name the layout maps back
                (``cause`` ``UnmappedTensor``). EngineUnavailableError, EngineRequestError.
        """
        report = self._checked("stitch_base_names", {}, self.apply_timeout_s)[0].report
        names = report.get("names") if isinstance(report, dict) else None
        if not isinstance(names, list):
            raise EngineRequestError(f"stitch_base_names answered no names: {report!r}", path="/collective_rpc")
        return [str(n) for n in names]

    def load_adapter(self, name: str, folder: str, checksums: Mapping[str, str]) -> None:
        """Load PEFT folder ``folder`` under ``name`` (vLLM's loader, no pause), verify every slot it
        fills against ``checksums`` (PEFT name -> xxh3-128) and pin it. Needs the lease.

        Raises:
            AdapterLoadError: cause ``LoraDisabled``, ``NameInUse``, ``NoFreeSlot`` (details
                ``loaded``, ``slots``: refused before the engine is asked, or by the engine's pins),
                ``EngineRefused`` (vLLM refused the folder: ``status``), ``ChecksumMismatch``,
                ``TensorSetMismatch``, ``NotLoaded``; the adapter is dropped again, the others keep
                serving. LeaseNotHeldError: no live lease (nothing called).
                EngineUnavailableError: the engine does not answer.
        """
        report = self._adapters()
        slots, held = int(report["slots"]), sorted(report["loaded"])
        if slots == 0:
            raise AdapterLoadError(
                f"adapter {name!r}: the engine was started without --enable-lora", adapter=name, cause="LoraDisabled"
            )
        if name in held:
            raise AdapterLoadError(f"adapter {name!r} is loaded already", adapter=name, cause="NameInUse")
        if len(held) >= slots:
            raise AdapterLoadError(
                f"adapter {name!r}: all {slots} adapter slots are held ({', '.join(held)}); unload one first",
                adapter=name,
                cause="NoFreeSlot",
                loaded=held,
                slots=slots,
            )
        status, text = self._lora_route(LOAD_PATH, {"lora_name": name, "lora_path": folder})
        if status != 200:
            self._undo(name)
            if status in (502, 503, 504):
                raise EngineUnavailableError(f"engine answered {LOAD_PATH} with HTTP {status}", path=LOAD_PATH)
            slot_full = _slot_refusal(text)
            raise AdapterLoadError(
                f"adapter {name!r}: vLLM refused {folder} (HTTP {status}): {text[:300]}",
                adapter=name,
                cause="NoFreeSlot" if slot_full else "EngineRefused",
                status=status,
                loaded=held,
                slots=slots,
            )
        try:
            self._owned("stitch_adapter_verify", {"name": name, "folder": folder, "checksums": dict(checksums)})
        except (AdapterLoadError, ApplyRefusedError, EngineRequestError) as exc:
            self._undo(name)
            if isinstance(exc, AdapterLoadError):
                raise
            raise AdapterLoadError(
                f"adapter {name!r}: verifying it failed: {exc}", adapter=name, cause=exc.details.get("cause", exc.type)
            ) from exc

    def unload_adapter(self, name: str) -> None:
        """Unload ``name``: from vLLM's API server (no new request can name it) and from the worker
        (its slot and pin freed). An unknown name is a no-op. Needs the lease.

        Raises:
            AdapterLoadError: vLLM refused the unload (cause ``EngineRefused``). LeaseNotHeldError,
                EngineUnavailableError, EngineRequestError.
        """
        self._drop(name)

    def _undo(self, name: str) -> None:
        """Drop a failed load's adapter; a failure to do so is logged (the load's own error is raised)."""
        try:
            self._drop(name)
        except SidecarError as exc:
            log.warning("adapter %r: dropping it after a failed load failed: %s", name, exc)

    def _drop(self, name: str) -> None:
        status, text = self._lora_route(UNLOAD_PATH, {"lora_name": name})
        if status not in (200, 404):
            raise AdapterLoadError(
                f"adapter {name!r}: vLLM refused to unload it (HTTP {status}): {text[:300]}",
                adapter=name,
                cause="EngineRefused",
                status=status,
            )
        try:
            self._owned("stitch_adapter_remove", {"name": name})
        except SidecarError as exc:
            if isinstance(exc, AdapterLoadError):
                raise
            raise AdapterLoadError(
                f"adapter {name!r}: removing it from the worker failed: {exc}", adapter=name, cause=exc.type
            ) from exc
