"""Other names a request may give an adapter run's version (sidecar process, event loop): TRL's and prime-rl's.

A version of the adapter run a sidecar follows is served as ``<run>@<N>``
(:func:`~stitchboard.proto.adapter.adapter_name`). Two trainers name it their own way, and
:meth:`AdapterAliases.resolve` turns their names into ``<run>@<N>`` before the request is admitted
(:meth:`~.adapter_set.ResidentAdapters.ask_of`), so it is gated, stamped and rewritten for the engine
like any request naming ``<run>@<N>``:

* TRL (1.16, ``trl/experimental/async_grpo``): its rollout worker asks for ``trl-policy-v{N}``, N its
  ``model_version`` (0 before the first sync, +1 per sync), and needs the engine's ``max_loras >=
  max_staleness + 2``. With stitchboard publishing one version per sync from version 0
  (``trainer_client/trl/``), TRL's N is the run's version N: ``trl-policy-v{N}`` is ``<run>@<N>``.
  TRL's own name prefix is the fixed ``trl-policy`` (``AsyncGRPOTrainer._lora_name``).
* prime-rl: ``POST /load_lora_adapter {lora_name, lora_path}`` names the adapter its requests will
  use; the admin route (:mod:`.admin_prime_rl`) binds ``lora_name`` to the version of ``lora_path``'s
  step (:meth:`AdapterAliases.bind`) and ``POST /v1/unload_lora_adapter`` unbinds it.

A bound name wins over TRL's pattern; a name that is neither is returned unchanged by :meth:`resolve`'s
caller (the run's own names, the base's served name).
"""

from __future__ import annotations

import re
from typing import Any

from stitchboard.proto.adapter import adapter_name

#: TRL's versioned adapter name: ``trl-policy-v{N}`` (ASCII digits; no sign, no spaces).
TRL_POLICY = re.compile(r"trl-policy-v([0-9]{1,18})")


class AdapterAliases:
    """The aliases of one adapter run's versions (one per sidecar; event-loop only).

    Args:
        run: the adapter run the sidecar follows.

    Attributes:
        bound: name -> version of the names prime-rl loaded (``/load_lora_adapter``), until unloaded.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self.bound: dict[str, int] = {}

    def resolve(self, model: Any) -> str | None:
        """``<run>@<N>`` when ``model`` is an alias of version N (a bound name, then ``trl-policy-v{N}``);
        None otherwise (not a string, or no alias: the caller keeps ``model`` as it is)."""
        if not isinstance(model, str):
            return None
        if model in self.bound:
            return adapter_name(self.run, self.bound[model])
        match = TRL_POLICY.fullmatch(model)
        return adapter_name(self.run, int(match.group(1))) if match else None

    def bind(self, name: str, version: int) -> int | None:
        """Make ``name`` an alias of ``version``; returns the version it named before (None: none)."""
        before = self.bound.get(name)
        self.bound[name] = version
        return before

    def unbind(self, name: str) -> int | None:
        """Forget alias ``name``; returns the version it named (None: it was not bound)."""
        return self.bound.pop(name, None)
