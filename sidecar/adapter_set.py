"""The resident adapter versions of an adapter run and the requests that use each (sidecar process, event loop).

An adapter run's versions are served by the engine as LoRA adapters named ``<run>@<N>``
(:func:`~stitchboard.proto.adapter.adapter_name`) beside its base model, which keeps serving.
:class:`ResidentAdapters` is what the proxy admits adapter requests against and what the follower
(:mod:`.adapter_follower`) changes:

* a request whose ``model`` is ``<run>@<N>`` gets version N while it is resident; ``<run>`` with
  the request's version constraint (:class:`~.gate.VersionConstraint`: ``min_version``,
  ``exact_version``) gets the newest resident version that satisfies it, and its ``model`` is
  rewritten to ``<run>@<N>`` for the engine. A version older than the newest resident one that is
  not resident (evicted, or coalesced away) never comes back: 409 ``WeightVersionPassed`` listing
  the resident versions; a future one is held up to the request's wait, as the gate holds it.
  Any other ``model`` (the base's served name) is not an adapter request: it passes ungated.
  TRL's ``trl-policy-v{N}`` and the names prime-rl loaded are aliases of ``<run>@<N>``
  (:mod:`.adapter_alias`, :attr:`ResidentAdapters.aliases`).
* every admitted adapter request holds a reference on its version until it ends. A version past
  the newest K is retired (:meth:`ResidentAdapters.retire`: no new request gets it, it is answered
  as evicted) and the follower unloads it only once no admitted request holds it.
* while the follower (re)loads the resident versions into an engine (boot, an engine restart),
  the set is not ``ready``: adapter requests are held.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from stitchboard.proto.adapter import adapter_name, parse_adapter_name
from stitchboard.proto.errors import SchemaError

from .adapter_alias import AdapterAliases
from .errors import InvalidVersionConstraintError, NotReadyError, WeightVersionNotReadyError, WeightVersionPassedError
from .gate import Gate, VersionConstraint

Verdict = Literal["ok", "wait", "passed"]


@dataclass(frozen=True)
class AdapterAsk:
    """What an adapter request asks for: ``pinned`` (N of ``<run>@<N>``; None: the run's newest that
    satisfies the constraint) and its version ``constraint``."""

    pinned: int | None
    constraint: VersionConstraint

    @property
    def exact(self) -> int | None:
        """The one version the request accepts (None: any satisfying ``min_version``)."""
        return self.pinned if self.pinned is not None else self.constraint.exact_version


class ResidentAdapters:
    """The resident versions of one adapter run and their admitted requests (one per app; event-loop only).

    Args:
        run: the adapter run id (the ``<run>`` of ``<run>@<N>``).
        gate: the app's gate: its ``applied`` is kept at the newest resident version (status,
            fleet report) and its ``in_flight`` counts adapter requests too.

    Attributes:
        refs: loaded version -> admitted requests using it now (retired ones included).
        retired: loaded versions past the newest K, unloaded once their requests end.
        ready: whether adapter requests are admitted (False while the follower loads the
            resident versions into an engine that lost them, and before the first load).
        waiting_load: why the next version's load waits (every slot is held by admitted
            requests), or None.
        aliases: other names of the run's versions (TRL's, prime-rl's), resolved before anything else.
    """

    def __init__(self, run: str, gate: Gate) -> None:
        self.run = run
        self.gate = gate
        self.refs: dict[int, int] = {}
        self.retired: set[int] = set()
        self.ready = False
        self.waiting_load: str | None = None
        self.aliases = AdapterAliases(run)
        self._changed = asyncio.Event()

    # -- what the follower changes -----------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def versions(self) -> list[int]:
        """The resident versions (loaded, not retired), oldest first."""
        return sorted(set(self.refs) - self.retired)

    def unused_retired(self) -> list[int]:
        """Retired versions no admitted request holds (to unload now), oldest first."""
        return sorted(v for v in self.retired if self.refs.get(v, 0) == 0)

    def names(self) -> list[str]:
        """The resident versions as engine names ``<run>@<N>``, oldest first."""
        return [adapter_name(self.run, v) for v in self.versions]

    def add(self, version: int) -> None:
        """Mark ``version`` loaded, verified and servable (the newest becomes the gate's applied version)."""
        self.refs.setdefault(version, 0)
        self.gate.set_applied(max(self.versions))
        self._notify()

    def retire(self, version: int) -> None:
        """No new request gets ``version`` (it is past the newest K); it stays loaded while requests hold it."""
        self.retired.add(version)
        self._notify()

    def remove(self, version: int) -> None:
        """Mark ``version`` unloaded (no request holds it)."""
        self.refs.pop(version, None)
        self.retired.discard(version)
        self.gate.set_applied(max(self.versions) if self.versions else None)
        self._notify()

    def set_ready(self, ready: bool) -> None:
        """Open (True) or close (False) admission of adapter requests."""
        self.ready = ready
        self._notify()

    def set_waiting(self, why: str | None) -> None:
        """Say why the next load waits (None: it does not)."""
        self.waiting_load = why

    async def changed(self, timeout_s: float) -> None:
        """Wait until a request ends or the set changes, at most ``timeout_s`` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    # -- what the proxy asks -----------------------------------------------------------------

    def ask_of(self, payload: Any, constraint: VersionConstraint) -> AdapterAsk | None:
        """The adapter ask of a request body (None: its ``model`` is not this run's, e.g. the base's
        served name: the request passes ungated).

        Raises:
            InvalidVersionConstraintError: ``<run>@<x>`` where x is no version number; ``<run>@<N>``
                with an ``exact_version`` other than N or a ``min_version`` above N (no version satisfies both).
        """
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str):
            return None
        model = self.aliases.resolve(model) or model
        if model.partition("@")[0] != self.run:
            return None
        try:
            _, version = parse_adapter_name(model)
        except SchemaError as exc:
            raise InvalidVersionConstraintError(
                f"model {model!r}: {exc}; name a version of run {self.run!r} as {self.run}@<version>", model=model
            ) from None
        exact, low = constraint.exact_version, constraint.min_version
        if version is not None and ((exact is not None and exact != version) or (low is not None and low > version)):
            raise InvalidVersionConstraintError(
                f"model {model!r} names version {version}, but the request's constraint asks for "
                f"{constraint.details()}: no version satisfies both",
                model=model,
                **constraint.details(),
            )
        return AdapterAsk(version, constraint)

    def verdict(self, ask: AdapterAsk) -> tuple[Verdict, int | None]:
        """``("ok", N)`` (admit on resident version N), ``("wait", None)`` (a later load may satisfy
        it) or ``("passed", None)`` (the version is gone for good)."""
        resident = self.versions
        exact = ask.exact
        if exact is not None:
            if exact in resident:
                return "ok", exact
            return ("passed", None) if resident and exact < resident[-1] else ("wait", None)
        low = ask.constraint.min_version or 0
        if resident and resident[-1] >= low:
            return "ok", resident[-1]
        return "wait", None

    def _passed(self, ask: AdapterAsk) -> WeightVersionPassedError:
        return WeightVersionPassedError(
            f"adapter version {ask.exact} of run {self.run!r} is no longer resident and will not be loaded again; "
            f"resident: {self.names()}",
            adapter=adapter_name(self.run, ask.exact) if ask.exact is not None else None,
            resident=self.names(),
            applied_version=self.gate.applied,
            target_version=self.gate.target,
            **ask.constraint.details(),
        )

    async def admit(self, ask: AdapterAsk, wait_s: float) -> tuple[int, bool]:
        """Wait until a resident version satisfies ``ask``; hold a reference on it (call
        :meth:`release` with it when the request ends). Returns (the version, whether the request was held).

        Raises:
            WeightVersionPassedError: the asked version is older than the newest resident one and
                not resident (details ``resident``: the resident names).
            WeightVersionNotReadyError: no resident version satisfied it within ``wait_s``.
            NotReadyError: the request accepts a resident version but admission stayed closed
                (the resident versions are being loaded again) for ``wait_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        held = False
        try:
            while True:
                changed = self._changed
                verdict, version = self.verdict(ask)
                if verdict == "passed":
                    raise self._passed(ask)
                if verdict == "ok" and self.ready and version is not None:
                    self.refs[version] += 1
                    self.gate.in_flight += 1
                    return version, held
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                if not held:
                    held = True
                    self.gate.waiting += 1
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    pass
        finally:
            if held:
                self.gate.waiting -= 1
        if verdict == "ok":
            raise NotReadyError(
                f"the resident adapters of run {self.run!r} are being loaded into the engine (held {wait_s:g} s)",
                applied_version=self.gate.applied,
                target_version=self.gate.target,
            )
        raise WeightVersionNotReadyError(
            f"no resident adapter version of run {self.run!r} satisfies {ask.constraint.details()} "
            f"(model version {ask.pinned}) after {wait_s:g} s; resident: {self.names()}",
            resident=self.names(),
            applied_version=self.gate.applied,
            target_version=self.gate.target,
            **ask.constraint.details(),
        )

    def release(self, version: int) -> None:
        """One admitted request on ``version`` ended."""
        if version in self.refs:
            self.refs[version] -= 1
        self.gate.in_flight -= 1
        self._notify()

    def list_models(self, answer: Any) -> bool:
        """Rewrite an engine's ``GET /v1/models`` answer (OpenAI's model list, in place): the base
        model (and any other entry) as the engine lists it, this run's entries replaced by the
        resident versions (``parent``: the first model listed, the base). False if ``answer`` is
        not a model list (left as it is)."""
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            return False
        kept = [m for m in data if not (isinstance(m, dict) and str(m.get("id", "")).partition("@")[0] == self.run)]
        first = next((m for m in kept if isinstance(m, dict)), {})
        shape = {k: first[k] for k in ("object", "created", "owned_by") if k in first} or {"object": "model"}
        parent = first.get("id")
        answer["data"] = kept + [{**shape, "id": name, "root": name, "parent": parent} for name in self.names()]
        return True

    def body(self) -> dict[str, Any]:
        """What ``/health`` says of the adapters: ``run``, ``resident`` (names, oldest first),
        ``retired`` (still loaded for their requests), ``in_use`` (name -> admitted requests),
        ``ready``, ``waiting_load``."""
        return {
            "run": self.run,
            "resident": self.names(),
            "retired": [adapter_name(self.run, v) for v in sorted(self.retired)],
            "in_use": {adapter_name(self.run, v): n for v, n in sorted(self.refs.items()) if n},
            "ready": self.ready,
            "waiting_load": self.waiting_load,
        }
