"""prime-rl's LoRA routes on the sidecar (sidecar process, event loop), with its admin API on (``admin_api=prime-rl``).

prime-rl's orchestrator, training a LoRA adapter, tells each inference server which adapter to serve with
vLLM's runtime adapter routes and then names it in its requests' ``model``. A sidecar following an adapter
run (``sidecar/adapter_follower.py``) loads the run's versions itself as they are published; these routes
only say which version prime-rl's name stands for, and keep it resident while prime-rl uses it:

* ``POST /load_lora_adapter {"lora_name": NAME, "lora_path": ".../step_N"}``: the path's step N is looked
  up as the first version recording step N or later (the same lookup as ``/update_weights``:
  :func:`~.admin_steps.version_of_step`), the route waits until that version is resident
  (at most ``admin_update_wait_s``), pins it (it counts as one admitted request on that version, so it is
  not unloaded while pinned: ``/health``'s ``adapters.in_use``) and binds NAME to it
  (:class:`~.adapter_alias.AdapterAliases`): requests naming NAME are served by ``<run>@<version>``.
  Loading NAME again moves it (and its pin) to the new version. It answers like vLLM: 200, the text
  ``Success: LoRA adapter 'NAME' added successfully.``.
* ``POST /v1/unload_lora_adapter {"lora_name": NAME}``: unbinds NAME and drops its pin (the follower
  unloads the version once it is no longer among the resident ones and unused); 200
  ``Success: LoRA adapter 'NAME' removed successfully.``; an unknown NAME is 404 ``AdapterNotLoaded``, as
  vLLM answers one.

Errors: 422 ``InvalidAdminRequest`` (a body without the fields, a path naming no step), 409
``NotAnAdapterRun`` (the run is a full-model run: use ``/update_weights``), 503 ``StepNotApplied`` (no
version of the step published in time, or not resident in time), 409 ``WeightVersionPassed`` (the step's
version is older than every resident one: it will not be loaded again).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.adapter import adapter_name

from .adapter_set import AdapterAsk, ResidentAdapters
from .admin_steps import APPLIED_POLL_S, step_of_weight_dir, version_of_step
from .errors import (
    AdapterNotLoadedError,
    InvalidAdminRequestError,
    NotAnAdapterRunError,
    NotReadyError,
    StepNotAppliedError,
    WeightVersionNotReadyError,
)
from .gate import VersionConstraint
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")
LOAD_EXPECTED = '{"lora_name": "<name>", "lora_path": "<output_dir>/broadcasts/step_N"}'
UNLOAD_EXPECTED = '{"lora_name": "<name>"}'


def _fields(body: bytes, names: tuple[str, ...], route: str, expected: str) -> list[str]:
    """The string fields ``names`` of a JSON object body (other keys, e.g. ``load_inplace``, are ignored).

    Raises:
        InvalidAdminRequestError: not a JSON object, or a field missing or not a non-empty string.
    """
    try:
        data = json.loads(body) if body else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        data = None
    values = [data.get(n) if isinstance(data, dict) else None for n in names]
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, str) or not value.strip():
            raise InvalidAdminRequestError(
                f"the body of POST {route} must be a JSON object with {name} a non-empty string, got "
                f"{body[:80]!r}; expected {expected}",
                field=name,
                value=value if isinstance(value, str | int | float | bool) or value is None else repr(value)[:80],
            )
    return [str(v) for v in values]


async def _adapters(request: Request, settings: SidecarSettings, deadline: float) -> ResidentAdapters:
    """The app's resident adapters, once the sidecar knows its run is an adapter run (waits for the run's
    first version until ``deadline``).

    Raises:
        NotAnAdapterRunError: the run is a full-model run, or not known to be an adapter run by ``deadline``.
    """
    loop = asyncio.get_running_loop()
    state = request.app.state
    while (adapters := state.proxy.adapters) is None:
        if state.gate.applied is not None or loop.time() >= deadline:  # a full-model run applied a version
            raise NotAnAdapterRunError(
                f"POST {request.url.path}: run {settings.run!r} is not an adapter run (its versions are whole "
                "models): prime-rl's LoRA routes serve adapter runs only; a full-model run's versions are waited "
                "for with POST /update_weights",
                run=settings.run,
                path=request.url.path,
            )
        await asyncio.sleep(APPLIED_POLL_S)
    return adapters


def lora_router(settings: SidecarSettings, client: BulletinClient) -> APIRouter:
    """The two LoRA routes (see the module docstring), for :func:`~.admin_prime_rl.register`."""
    router = APIRouter(tags=["prime-rl admin"])
    pins: dict[str, int] = {}  # lora_name -> the version its pin holds

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        """Bind ``lora_name`` to the resident version of ``lora_path``'s step, once it is resident."""
        name, path = _fields(await request.body(), ("lora_name", "lora_path"), "/load_lora_adapter", LOAD_EXPECTED)
        step = step_of_weight_dir(path, field="lora_path")
        loop = asyncio.get_running_loop()
        wait_s = settings.admin_update_wait_s
        deadline = loop.time() + wait_s
        adapters = await _adapters(request, settings, deadline)
        gate = request.app.state.gate
        info, problem = await version_of_step(client, settings, gate, step, deadline)
        if info is None:
            raise StepNotAppliedError(
                f"no version of adapter run {settings.run!r} records step {step} or later after {wait_s:g} s"
                f"{f' ({problem})' if problem else ''}: retry once the trainer has published it",
                step=step,
                version=None,
                applied_version=gate.applied,
                wait_s=wait_s,
            )
        ask = AdapterAsk(info.version, VersionConstraint(exact_version=info.version))
        try:
            version, _ = await adapters.admit(ask, max(0.0, deadline - loop.time()))  # resident, and pinned
        except (WeightVersionNotReadyError, NotReadyError):
            raise StepNotAppliedError(
                f"step {step} is version {info.version} of adapter run {settings.run!r}, not resident after "
                f"{wait_s:g} s (resident: {adapters.names()}; see the sidecar's /health). Retry later",
                step=step,
                version=info.version,
                applied_version=gate.applied,
                wait_s=wait_s,
            ) from None
        before = pins.get(name)
        pins[name] = version
        adapters.aliases.bind(name, version)
        if before is not None:
            adapters.release(before)
        log.info(
            "prime-rl /load_lora_adapter: %r is %s (step %d; pinned)", name, adapter_name(settings.run, version), step
        )
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        """Unbind ``lora_name`` and drop its pin."""
        (name,) = _fields(await request.body(), ("lora_name",), "/v1/unload_lora_adapter", UNLOAD_EXPECTED)
        adapters: ResidentAdapters | None = request.app.state.proxy.adapters
        if adapters is None:
            raise NotAnAdapterRunError(
                f"POST {request.url.path}: run {settings.run!r} is not an adapter run: no LoRA adapter is loaded "
                "through this sidecar",
                run=settings.run,
                path=request.url.path,
            )
        version = pins.pop(name, None)
        if version is None:
            raise AdapterNotLoadedError(
                f"LoRA adapter {name!r} is not loaded on this sidecar (loaded: {sorted(pins)})",
                adapter=name,
                loaded=sorted(pins),
            )
        adapters.aliases.unbind(name)
        adapters.release(version)
        log.info("prime-rl /v1/unload_lora_adapter: %r (%s) unpinned", name, adapter_name(settings.run, version))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
